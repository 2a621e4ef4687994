"""A tiny model learns a task that cannot be done without the video, through the whole
pipeline: MP4 files -> `lwm tokenize` -> `lwm train` (ring attention over sp, zigzag layout,
packed rows) -> answers generated about held-out videos -> `lwm.qa_eval`.

Each video shows three frames, each of one colour of six; the questions ask the colour of a
given frame. The encoder is a stand-in for the VQGAN that maps each quarter of a frame to the
code of its nearest colour, so a failure here is the language model's vision path (the
embedding picked by vision_mask, targets, masks, positions after the zigzag permutation,
generation), not the tokenizer's.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import subprocess_xla_flags

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 200, 60),
    "blue": (40, 70, 230),
    "white": (235, 235, 235),
    "yellow": (240, 220, 40),
    "purple": (160, 60, 220),
}
ORDINALS = ("first", "second", "third")
ROOT = Path(__file__).resolve().parents[1]


class QuarterColourEncoder:
    """Stands in for a VQGAN: 16x16 frames, 2x2 codes, code = index of the nearest colour."""

    resolution = 16
    tokens_per_frame = 4
    codebook_size = 8

    def encode(self, frames: np.ndarray) -> np.ndarray:
        frames = np.asarray(frames, np.float32)
        b, t = frames.shape[:2]
        quarters = frames.reshape(b, t, 2, 8, 2, 8, 3).mean(axis=(3, 5))
        palette = np.asarray(list(COLOURS.values()), np.float32)
        return np.abs(quarters[..., None, :] - palette).sum(-1).argmin(-1).astype(np.int32)


def _write_videos(folder: Path, combos) -> Path:
    from lwm.base.media import write_mp4

    folder.mkdir(parents=True)
    lines = []
    for i, combo in enumerate(combos):
        frames = np.stack([np.full((32, 32, 3), COLOURS[c], np.uint8) for c in combo])
        write_mp4(folder / f"{i:03d}.mp4", frames, fps=4)
        turns = [
            {
                "question": f"What colour is the {ORDINALS[k]} frame?",
                "answer": combo[k],
                "category": ORDINALS[k],
            }
            for k in np.random.default_rng(i).permutation(3)
        ]
        lines.append({"video": f"{i:03d}.mp4", "qa": turns})
    manifest = folder / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return manifest


@pytest.mark.slow
def test_a_tiny_model_learns_to_read_the_video(tmp_path: Path):
    from data.tokenize_dataset import TokenizeOptions, tokenize_dataset
    from data.tokens import TextCodec
    from lwm.base.mesh import make_mesh
    from lwm.qa_eval import BlindBaseline, evaluate, read_questions
    from lwm.runs import load_run
    from lwm.vision_qa import VideoQA

    combos = list(itertools.product(COLOURS, repeat=3))  # 216 videos: 192 to train on, 24 held out
    order = np.random.default_rng(0).permutation(len(combos))
    train_manifest = _write_videos(tmp_path / "train", [combos[i] for i in order[:192]])
    held_out = _write_videos(tmp_path / "held_out", [combos[i] for i in order[192:]])
    encoder = QuarterColourEncoder()
    tokens = tmp_path / "tokens"
    tokenize_dataset(
        TokenizeOptions(
            input=str(train_manifest),
            output=str(tokens),
            vqgan="quarter-colours",
            workers=0,
            progress=False,
        ),
        encoder=encoder,
        log=lambda _: None,
    )
    # `lwm train` in a process of its own: 400 steps, where the code's speed matters, so at
    # XLA's default optimization level (`subprocess_xla_flags`), ring over 2 devices
    overrides = [
        f"data.source={tokens}",
        f"train.output_dir={tmp_path / 'lm'}",
        "model.text_vocab_size=4096",
        "model.hidden_size=128",  # 64 (the debug width) fits the training set, not 100%
        "model.intermediate_size=256",
        "model.vision_codes=8",  # the encoder's codebook: a vision softmax of 8 + markers
        "model.loss_positions=32",  # the text head only where answers are trained
        "model.attention=ring",
        "model.block_q=16",
        "model.block_k=16",
        "mesh.shape=1,1,2,1",
        "train.seq_len=128",
        "train.batch_size=8",
        "train.steps=400",
        "train.learning_rate=3e-3",
        "train.warmup_steps=10",
        "train.save_every=400",
        "train.progress=false",
        "train.peak_flops=1e9",
    ]
    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags(fast_compile=False))
    cmd = [sys.executable, "-m", "lwm", "train", "--cpu-devices=2", "--config"]
    run = subprocess.run(
        [*cmd, "configs/debug.yaml", *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    mesh = make_mesh("1,1,2,1", devices=jax.devices()[:2])
    _, model = load_run(tmp_path / "lm", mesh=mesh, log=lambda _: None)
    qa = VideoQA(model, TextCodec.load(), encoder, max_new_tokens=6, batch_size=24)
    report = evaluate(
        read_questions(held_out), qa.answer, blind=BlindBaseline.from_manifest(train_manifest)
    )
    assert report.cut("model") == 0
    assert report.accuracy("model") == 1.0, report.table()
    # Without the right video the answers are chance; so is the blind baseline (4 colours).
    assert report.accuracy("swapped") < 0.5, report.table()
    assert report.accuracy("blind") < 0.5, report.table()
