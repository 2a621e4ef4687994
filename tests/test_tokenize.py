"""`lwm tokenize`: videos of several codecs and broken files to a tfds dataset; the vision
spans, the errors file, --strict, a LLaMA-style tokenizer, kill and resume, and `lwm train` on
the result."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import subprocess_xla_flags
from tokenize_helpers import (
    CODES_PER_FRAME,
    GOOD_VIDEOS,
    read_records,
    save_tiny_vqgan,
    vision_spans,
    write_llama_style_tokenizer,
    write_media,
)

from data.tokens import EOF_ID, EOV_ID, TextCodec
from lwm.cli import main as lwm

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--workers", "0", "--no-progress", "--batch-frames", "16"]


@pytest.fixture(scope="module")
def vqgan_dir(tmp_path_factory):
    return save_tiny_vqgan(tmp_path_factory.mktemp("vqgan") / "tiny")


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media") / "videos"
    broken = write_media(folder)
    return folder, broken


def check_vision_span(record, codec: TextCodec, frames: int) -> tuple[int, int]:
    """The record has one vision span, exactly as DESIGN.md says; returns its (start, end)."""
    tokens = np.asarray(record["tokens"])
    ((start, end),) = vision_spans(record)
    per = CODES_PER_FRAME + 1
    assert end - start == per * frames
    span = tokens[start:end].reshape(frames, per)
    assert (span[:, :-1] < 64).all() and (span[:, :-1] >= 0).all()  # codes of the tiny VQGAN
    assert (span[:-1, -1] == EOF_ID).all() and span[-1, -1] == EOV_ID
    vs, ve = codec.vision_start, codec.vision_end
    assert tokens[start - len(vs) : start].tolist() == vs
    assert tokens[end : end + len(ve)].tolist() == ve
    return start, end


def test_folder_of_videos_with_broken_files(tmp_path, media, vqgan_dir, capsys):
    folder, broken = media
    out = tmp_path / "tokens"
    args = ["--input", str(folder), "--out", str(out), "--vqgan", str(vqgan_dir)]
    code = lwm(["tokenize", *args, *FAST, "--max-frames", "8", "--min-frames", "3"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "4 ok, 4 failed" in err and "encoder busy" in err

    errors = (tmp_path / "tokens.errors.txt").read_text().splitlines()
    assert len(errors) == len(broken)
    for line, (name, problem) in zip(errors, sorted(broken.items()), strict=True):
        assert line.startswith(str(folder / name) + ": ") and problem in line

    codec = TextCodec.load(None)
    records = read_records(out)
    assert [Path(r["source"].decode()).name for r in records] == sorted(GOOD_VIDEOS)
    for record, (name, (_, t, *_)) in zip(records, sorted(GOOD_VIDEOS.items()), strict=True):
        frames = min(t, 8)  # --max-frames 8
        assert record["num_frames"] == frames and record["kind"] == b"video"
        tokens, loss = np.asarray(record["tokens"]), np.asarray(record["loss_mask"])
        assert len(tokens) == len(record["vision_mask"]) == len(loss)
        text_ids = tokens[~np.asarray(record["vision_mask"])]
        assert tokens[0] == codec.bos_id and loss[0] == 0 and (text_ids == codec.bos_id).sum() == 1
        _, end = check_vision_span(record, codec, frames)
        text = tokens[end + len(codec.vision_end) :]
        assert text[-1] == codec.eos_id
        caption = (folder / name).with_suffix(".txt")
        expected = caption.read_text().strip() if caption.exists() else ""
        assert codec.tokenizer.decode(text[:-1]) == expected
        assert (loss[1:] == 1).all()  # a captioned (or bare) video trains on all but BOS

    import tensorflow_datasets as tfds

    meta = tfds.builder_from_directory(str(out)).info.metadata
    assert meta["markers"]["eof"] == EOF_ID and meta["markers"]["eov"] == EOV_ID
    assert meta["markers"]["vision_start"] == codec.vision_start
    assert meta["text_tokenizer"]["vocab_size"] == 4096
    assert meta["vqgan"]["tokens_per_frame"] == CODES_PER_FRAME
    assert meta["vqgan"]["path"] == str(vqgan_dir.absolute())
    assert meta["counts"]["records"] == 4 and meta["counts"]["failed"] == 4
    assert not (tmp_path / "tokens.partial").exists()

    # --strict: the same errors, a non-zero exit, no dataset
    strict_out = tmp_path / "strict"
    code = lwm(["tokenize", *args[:2], "--out", str(strict_out), *args[4:], *FAST, "--strict"])
    err = capsys.readouterr().err
    assert code == 1 and not strict_out.exists()
    for name in broken:
        if name != "short.mp4":  # no --min-frames here: a 2-frame video is fine
            assert str(folder / name) in (tmp_path / "strict.errors.txt").read_text()
            assert f"failed: {folder / name}: " in err
    # the finished work is kept: without --strict it is published at once, nothing re-encoded
    assert lwm(["tokenize", *args[:2], "--out", str(strict_out), *args[4:], *FAST]) == 0
    assert "0 frames encoded" in capsys.readouterr().err
    assert len(read_records(strict_out)) == 5  # the 2-frame video is fine without --min-frames

    # nothing tokenizes: the errors are kept, no work folder is (nothing there to resume)
    bad = tmp_path / "bad.jsonl"
    name = next(n for n in broken if n != "short.mp4")
    bad.write_text(json.dumps({"video": str(folder / name), "text": "x"}) + "\n")
    none = tmp_path / "none"
    assert lwm(["tokenize", "--input", str(bad), "--out", str(none), *args[4:], *FAST]) == 1
    assert "no item could be tokenized; nothing written" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.glob("none*")) == ["none.errors.txt"]
    # a tokenizer folder that holds none is named before any work
    (tmp_path / "empty").mkdir()
    extra = ["--tokenizer", str(tmp_path / "empty")]
    assert lwm(["tokenize", *args[:2], "--out", str(none), *args[4:], *FAST, *extra]) == 2
    assert "tokenizer folder '" in capsys.readouterr().err and not none.exists()


def test_manifest_qa_image_text_and_llama_tokenizer(tmp_path, media, vqgan_dir, capsys):
    from PIL import Image

    folder, _ = media
    llama = write_llama_style_tokenizer(tmp_path / "llama")
    Image.fromarray(np.full((20, 30, 3), 200, np.uint8)).save(tmp_path / "photo.png")
    qa = [
        {"question": "What colour is the square?", "answer": "white"},
        {"question": "Does it move?", "answer": "yes"},
    ]
    lines = [
        {"video": str(folder / "a_h264.mp4"), "qa": qa},
        {"image": "photo.png", "text": "A grey picture."},
        {"text": "Two shapes on a dark background."},
        {"video": "missing.mp4", "text": "gone"},
        {"video": str(folder / "a_h264.mp4"), "text": "The same video."},  # encoded once
        {"video": "missing.mp4", "qa": qa},
    ]
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "tokens"
    code = lwm(
        ["tokenize", "--input", str(manifest), "--out", str(out), "--vqgan", str(vqgan_dir)]
        + ["--tokenizer", str(llama), "--fps", "4", "--text-first-ratio", "1", *FAST]
    )
    err = capsys.readouterr().err
    assert code == 0, err
    assert json.loads((out / "metadata.json").read_text())["text_first_ratio"] == 1.0
    assert (tmp_path / "tokens.errors.txt").read_text() == (
        f"{tmp_path / 'missing.mp4'}: file not found\n" * 2
    )
    assert "7 frames encoded" in err  # 6 of the video (once), 1 of the image
    codec = TextCodec.load(str(llama))
    assert codec.bos_id == 1 and len(codec.vision_start) > 1  # LLaMA-like: markers are pieces
    assert codec.tokenizer.encode("<vision>")[0] == 1  # and BOS is added by default
    video, image, text, captioned = read_records(out)
    assert captioned["source"] == video["source"] and captioned["num_frames"] == 6
    np.testing.assert_array_equal(
        np.asarray(captioned["tokens"])[captioned["vision_mask"]],
        np.asarray(video["tokens"])[video["vision_mask"]],
    )

    # video + QA at --fps 4 of an 8 fps video: 6 of 12 frames; video and questions are context
    tokens, loss = np.asarray(video["tokens"]), np.asarray(video["loss_mask"])
    assert video["num_frames"] == 6
    text_ids = tokens[~np.asarray(video["vision_mask"])]
    assert tokens[0] == 1 and (text_ids == 1).sum() == 1  # BOS once, not before <vision>
    start, end = check_vision_span(video, codec, 6)
    assert start == 1 + len(codec.vision_start)
    assert not loss[: end + len(codec.vision_end)].any()
    trained = codec.tokenizer.decode(tokens[loss == 1])
    assert trained.replace(" ", "") == "white</s>yes</s>"
    after = end + len(codec.vision_end)
    context = codec.tokenizer.decode(tokens[after:][loss[after:] == 0])
    assert "USER: What colour is the square? ASSISTANT:" in context

    # The codes in the record are what the VQGAN gives for the sampled frames when asked
    # directly: frames 0, 2, .., 10 of the 12 (8 fps read at 4 fps), read here with decord.
    import decord

    import vqgan as vqgan_pkg

    frames = decord.VideoReader(str(folder / "a_h264.mp4")).get_batch(list(range(0, 12, 2)))
    from lwm.base.mesh import make_mesh

    tok = vqgan_pkg.load_tokenizer(vqgan_dir, mesh=make_mesh("1,-1,1,1"))  # as lwm tokenize
    direct = tok.encode(frames.asnumpy()[None])[0]
    span = tokens[start:end].reshape(6, CODES_PER_FRAME + 1)[:, :-1]
    np.testing.assert_array_equal(span, direct.reshape(6, -1))

    assert image["num_frames"] == 1 and image["kind"] == b"image"
    check_vision_span(image, codec, 1)
    # --text-first-ratio 1: every captioned video (the image too) is written caption first
    for record, caption in ((image, "A grey picture."), (captioned, "The same video.")):
        start, end = vision_spans(record)[0]
        before = start - len(codec.vision_start)
        assert codec.tokenizer.decode(np.asarray(record["tokens"])[:before]) == f"<s> {caption}"
        assert np.asarray(record["tokens"])[end + len(codec.vision_end)] == codec.eos_id
        assert np.asarray(record["loss_mask"])[1:].all()  # everything but BOS is learned
    assert text["num_frames"] == 0 and not np.asarray(text["vision_mask"]).any()
    assert codec.tokenizer.decode(text["tokens"]) == "<s> Two shapes on a dark background.</s>"


def _synthetic_manifest(folder: Path, seed: int = 1, count: int = 6) -> Path:
    from data.synthetic import write_dataset

    return write_dataset(folder, count=count, seed=seed, size=32, num_frames=6)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return _synthetic_manifest(tmp_path_factory.mktemp("synthetic"))


def assert_same_dataset(got: Path, want: Path) -> None:
    a, b = read_records(got), read_records(want)
    assert len(a) == len(b) == 12
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
    # every file, the array_record shards included, byte for byte (`dataset_io.ShardWriter`
    # serializes deterministically)
    names = sorted(p.name for p in want.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names
    for name in names:
        assert (got / name).read_bytes() == (want / name).read_bytes(), name


# `python -c HANG_AFTER N ...` is `python -m lwm ...` whose chunk writer hangs after writing N
# chunks: a process run this way has exactly N chunks done when it is killed, however fast the
# rest of it goes.
HANG_AFTER = """
import sys, threading
from data.chunk_encoder import ChunkEncoder
from lwm.cli import main

limit, save, saved = int(sys.argv.pop(1)), ChunkEncoder.save, []
def save_then_hang(self, work, c):
    if len(saved) == limit:
        threading.Event().wait()
    save(self, work, c)
    saved.append(c)
ChunkEncoder.save = save_then_hang
sys.argv[0] = "lwm"
raise SystemExit(main())
"""


def test_killed_run_resumes_to_the_same_dataset(
    tmp_path, synthetic, vqgan_dir, one_process, capsys
):
    common = ["--input", str(synthetic), "--vqgan", str(vqgan_dir)]
    common += ["--chunk-size", "1", "--batch-frames", "16", "--no-progress"]
    out = tmp_path / "resumed"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", HANG_AFTER, "2", "tokenize", *common, "--out", str(out)]
        + ["--workers", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    work = tmp_path / "resumed.partial"
    deadline = time.time() + 120
    while not (work / "chunk-00001.json").exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    done = sorted(work.glob("chunk-*.json"))
    assert not out.exists() and len(done) == 2  # of 6 videos x (caption, QA) lines

    assert lwm(["tokenize", *common, "--out", str(out), "--workers", "0"]) == 0
    assert f"resuming: {len(done)} of 12 chunks" in capsys.readouterr().err
    assert_same_dataset(out, one_process)  # the same arguments (`SHARED`), in one run


def test_rerun_with_other_arguments_is_refused(tmp_path, synthetic, vqgan_dir, capsys):
    common = ["--input", str(synthetic), "--vqgan", str(vqgan_dir), *FAST]
    out = tmp_path / "tokens"
    (tmp_path / "tokens.partial").mkdir()
    (tmp_path / "tokens.partial" / "job.json").write_text(json.dumps({"max_frames": 3}))
    assert lwm(["tokenize", *common, "--out", str(out)]) == 2
    assert "other arguments" in capsys.readouterr().err and not out.exists()
    out.mkdir()
    assert lwm(["tokenize", *common, "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_bad_manifest_line_is_one_clear_error(tmp_path, vqgan_dir, capsys):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"video": "a.mp4"}\n{"video": 3\n')
    code = lwm(
        ["tokenize", "--input", str(manifest), "--out", str(tmp_path / "o")]
        + ["--vqgan", str(vqgan_dir), *FAST]
    )
    err = capsys.readouterr().err
    assert code == 2 and f"manifest '{manifest}' line 2: not valid JSON" in err


def test_item_paths_are_absolute_without_dots_from_any_working_directory(tmp_path, monkeypatch):
    from data.manifest import read_inputs

    (tmp_path / "clips" / "sub").mkdir(parents=True)
    (tmp_path / "lists").mkdir()
    for name in ("a.mp4", "sub/b.mp4"):
        (tmp_path / "clips" / name).write_bytes(b"")
    manifest = tmp_path / "lists" / "m.jsonl"
    manifest.write_text('{"video": "../clips/a.mp4"}\n{"video": "../clips/./sub/b.mp4"}\n')
    expected = [str(tmp_path / "clips" / "a.mp4"), str(tmp_path / "clips" / "sub" / "b.mp4")]
    for cwd, given in (
        (tmp_path, "lists/../lists/m.jsonl"),
        (tmp_path / "clips", "../lists/m.jsonl"),
    ):
        monkeypatch.chdir(cwd)
        assert [item.path for item in read_inputs(given)] == expected
    monkeypatch.chdir(tmp_path / "lists")
    assert [item.path for item in read_inputs("../lists/../clips")] == expected


def test_train_runs_on_a_tokenized_dataset_and_evaluates_held_out_qa(
    tmp_path, synthetic, vqgan_dir, capsys
):
    data = tmp_path / "tokens"
    assert (
        lwm(
            ["tokenize", "--input", str(synthetic), "--out", str(data)]
            + ["--vqgan", str(vqgan_dir), *FAST]
        )
        == 0
    )
    held_out = _synthetic_manifest(tmp_path / "held_out", seed=2, count=3)
    run = tmp_path / "run"
    overrides = [f"data.source={data}", f"train.output_dir={run}", "model.num_layers=1"]
    # the debug model's widths, and a vision head over the tiny VQGAN's 64 codes (not the
    # 8,448 of tiny.yaml): the same run in half the time
    overrides += ["model.hidden_size=64", "model.intermediate_size=128", "model.vision_codes=64"]
    overrides += ["model.num_heads=4", "model.num_kv_heads=2"]
    overrides += ["train.seq_len=512", "train.steps=4", "train.batch_size=8"]
    overrides += ["train.progress=false", "train.log_every=1", "train.peak_flops=1e9"]
    overrides += [f"eval.manifest={held_out}", "eval.every=2", "eval.max_new_tokens=4"]
    capsys.readouterr()
    assert lwm(["train", "--config", str(ROOT / "configs/tiny.yaml"), *overrides]) == 0
    err = capsys.readouterr().err
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_lines = [r for r in logged if "split" not in r]
    assert [r["step"] for r in train_lines][-1] == 4
    assert all(np.isfinite(r["loss"]) for r in train_lines)
    # Held-out QA every 2 steps, scored per category, with the swap ablation and the blind
    # baseline from the manifest the dataset was tokenized from (its metadata says which).
    evals = [r for r in logged if r.get("split") == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    categories = {t["category"] for line in _qa_lines(held_out) for t in line["qa"]}
    blind = blind_scores(synthetic, held_out)
    for r in evals:
        for condition in ("model", "swapped"):
            assert 0 <= r[f"{condition}_accuracy"] <= 1
            assert {f"{condition}_accuracy_{c}" for c in categories} <= set(r)
        # the blind baseline does not depend on the model: exactly what the manifests give
        assert {k: v for k, v in r.items() if k.startswith("blind_accuracy")} == pytest.approx(
            blind
        )
    report = [json.loads(x) for x in (run / "eval" / "qa-4.jsonl").read_text().splitlines()]
    questions = sum(len(line["qa"]) for line in _qa_lines(held_out))
    assert len(report) == 3 * questions + 1
    assert report[-1]["model"]["all"]["accuracy"] == pytest.approx(
        evals[-1]["model_accuracy"], abs=1e-4
    )
    assert f"blind baseline from {synthetic}" in err
    assert "step 4: held-out QA accuracy" in err
    # Extended with another batch size, its place in the data does not carry over: one line
    # naming the setting (it was a traceback, exit 1), nothing changed.
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    argv = ["train", "--config", str(ROOT / "configs/tiny.yaml"), *overrides, "train.steps=6"]
    assert lwm([*argv, "train.batch_size=16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"lwm train: error: train.output_dir '{run}' holds a run that read its data otherwise "
        "(train.batch_size: 8 there, 16 here); resume it with the settings it ran with, or start "
        f"a new run from its weights (train.init_from=run:{run} and another train.output_dir)"
    )
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before
    # A VQGAN other than the dataset's is refused: its codes mean other things to the model
    # (lwm ask answered, exit 0, from codes it was never trained on).
    other = save_tiny_vqgan(tmp_path / "other_vqgan", resolution=32)
    video = synthetic.parent / "videos" / "00000.mp4"
    ask = ["ask", "--model", f"run:{run}", "--video", str(video), "--question", "How many?"]
    assert lwm([*ask, "--vqgan", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"lwm ask: error: the VQGAN {other} is not the one the model's training dataset {data} "
        "was tokenized with (resolution 32 here, 16 there; tokens_per_frame 256 here, 64 there);"
        " give that one (--vqgan), or none to use it"
    )
    assert lwm([*ask, "--vqgan", str(vqgan_dir)]) == 0
    # ... and so is one of the same shapes whose weights moved on (trained further, say)
    from safetensors.numpy import load_file, save_file

    moved = tmp_path / "moved_vqgan"
    shutil.copytree(vqgan_dir, moved)
    weights = load_file(moved / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3
    save_file(weights, moved / "model.safetensors")
    assert lwm([*ask, "--vqgan", str(moved)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"lwm ask: error: the VQGAN {moved} has other weights than the model's training dataset "
        f"{data} was tokenized with (trained on since?); its codes would mean other things to "
        "the model: give the VQGAN the dataset was made with (--vqgan)"
    )


def _qa_lines(manifest: Path) -> list[dict]:
    lines = [json.loads(x) for x in manifest.read_text().splitlines()]
    return [line for line in lines if "qa" in line]


def blind_scores(train: Path, held_out: Path) -> dict[str, float]:
    """The blind baseline's accuracy on the questions of ``held_out`` (``blind_accuracy``, and
    ``blind_accuracy_CATEGORY``), worked out here: each question is answered with the answer
    the questions of ``train`` with the same text have most often (the first one seen of
    those tied), else the most frequent of its category, else of all."""

    def most_frequent(pairs) -> dict[str, str]:
        counts: dict[str, dict[str, int]] = {}
        for key, answer in pairs:
            seen = counts.setdefault(key, {})
            seen[answer] = seen.get(answer, 0) + 1
        return {key: max(c, key=c.get) for key, c in counts.items()}  # max keeps the first

    turns = [t for line in _qa_lines(train) for t in line["qa"]]
    by_text = most_frequent((t["question"], t["answer"]) for t in turns)
    by_category = most_frequent((t["category"], t["answer"]) for t in turns)
    overall = most_frequent(("", t["answer"]) for t in turns)[""]
    right: dict[str, list[bool]] = {}
    for turn in (t for line in _qa_lines(held_out) for t in line["qa"]):
        guess = by_text.get(turn["question"], by_category.get(turn["category"], overall))
        for key in ("blind_accuracy", f"blind_accuracy_{turn['category']}"):
            right.setdefault(key, []).append(guess == turn["answer"])
    return {key: sum(r) / len(r) for key, r in right.items()}


def test_train_refuses_a_dataset_with_a_larger_text_vocabulary(
    tmp_path, synthetic, vqgan_dir, capsys
):
    data = tmp_path / "tokens"
    args = ["tokenize", "--input", str(synthetic), "--out", str(data), "--vqgan"]
    assert lwm([*args, str(vqgan_dir), *FAST]) == 0
    overrides = [f"data.source={data}", f"train.output_dir={tmp_path / 'run'}"]
    overrides += ["model.text_vocab_size=256", "train.seq_len=512", "train.steps=1"]
    assert lwm(["train", "--config", str(ROOT / "configs/tiny.yaml"), *overrides]) == 2
    err = capsys.readouterr().err
    assert "text vocabulary of 4096 tokens, but model.text_vocab_size is 256" in err


# ----------------------------------------------------------------------------------------------
# many hosts (issue 14): shards + merge, a jax.distributed job, and outputs in use

SHARED = ["--chunk-size", "1", "--batch-frames", "16", "--no-progress", "--workers", "0"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, synthetic, vqgan_dir):
    """The dataset of one process, which every way of sharing the job must reproduce."""
    out = tmp_path_factory.mktemp("one_process") / "tokens"
    args = ["--input", str(synthetic), "--vqgan", str(vqgan_dir), *SHARED]
    assert lwm(["tokenize", *args, "--out", str(out)]) == 0
    return out


# `python -c IDLE_AT_SAVE N PATH ...` is `python -m lwm ...` (with Ctrl-C's default action)
# whose chunk writer, at its save N+1, waits until the decoding workers are idle (the stream's
# feeder has nothing in flight: `DecodeStream.quiet`), writes PATH, and then waits until the
# SIGINT arrives (up to 30 s). The handler is Ctrl-C's default one, noting first that it ran:
# the run stops waiting for the writer (`saver.shutdown()`) once the signal is in, not 30 s on.
IDLE_AT_SAVE = """
import signal, sys, threading, weakref
from pathlib import Path
from data.chunk_encoder import ChunkEncoder, DecodeStream
from lwm.cli import main

interrupted = threading.Event()
def on_sigint(signum, frame):
    interrupted.set()
    signal.default_int_handler(signum, frame)
signal.signal(signal.SIGINT, on_sigint)
limit, idle = int(sys.argv.pop(1)), Path(sys.argv.pop(1))
save, saved, streams, made = ChunkEncoder.save, [], [], DecodeStream.__init__
def remember(self, *args, **kwargs):
    made(self, *args, **kwargs)
    streams.append(weakref.ref(self))  # a stream alive at exit would be closed too late
def save_when_idle(self, work, c):
    if len(saved) == limit:
        assert len(streams) == 1 and streams[0]().quiet.wait(60)
        idle.write_text("idle")
        interrupted.wait(30)
    save(self, work, c)
    saved.append(c)
DecodeStream.__init__ = remember
ChunkEncoder.save = save_when_idle
sys.argv[0] = "lwm"
raise SystemExit(main())
"""


def test_ctrl_c_stops_with_its_workers_and_keeps_the_finished_chunks(
    tmp_path, synthetic, vqgan_dir
):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while the decoding
    workers wait for work: exit 130 at once with one line, no traceback, the finished chunks
    kept. The workers took the signal too and died inside the task queue's lock, printing
    their tracebacks, and the pool's terminate then waited for that lock, at times forever."""
    common = ["--input", str(synthetic), "--vqgan", str(vqgan_dir), "--out", str(tmp_path / "t")]
    common += ["--chunk-size", "1", "--batch-frames", "16", "--no-progress", "--workers", "2"]
    idle = tmp_path / "workers-idle"
    # A terminal's foreground job starts with Ctrl-C's default action; a suite run in the
    # background by a shell without job control (`pytest &` in a script) starts with SIGINT
    # ignored, which the child would inherit, and Python then installs no KeyboardInterrupt.
    proc = subprocess.Popen(  # the third save waits until the workers idle, then for SIGINT
        [sys.executable, "-c", IDLE_AT_SAVE, "2", str(idle), "tokenize", *common],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    work = tmp_path / "t.partial"
    deadline = time.time() + 120
    while not idle.exists():  # written by the hook once the stream's feeder is quiet
        assert proc.poll() is None, proc.stderr.read()
        assert time.time() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"still running 60 s after Ctrl-C: {proc.communicate()[1]}") from None
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].endswith("rerun the same command to continue")
    assert len(list(work.glob("chunk-*.json"))) >= 2 and not (tmp_path / "t").exists()


def _subprocess_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=subprocess_xla_flags())


def test_shards_killed_rerun_and_merged_equal_one_process(
    tmp_path, synthetic, vqgan_dir, one_process, capsys
):
    args = ["--input", str(synthetic), "--vqgan", str(vqgan_dir), *SHARED]
    out = tmp_path / "tokens"
    work = tmp_path / "tokens.partial"
    # Shard 1 of 2 (chunks 1, 3, .., 11) is killed after its first chunk.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HANG_AFTER,
            "1",
            "tokenize",
            *args,
            "--out",
            str(out),
            "--shard",
            "1/2",
        ],
        cwd=ROOT,
        env=_subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 120
    while not (work / "chunk-00001.json").exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert (tmp_path / "tokens.lock.1").is_file()  # the dead shard's lock

    assert lwm(["tokenize", *args, "--out", str(out), "--shard", "0/2"]) == 0
    err = capsys.readouterr().err
    assert "shard 0/2: made 6 of the 12 chunks" in err and "still to do" in err
    assert not out.exists()
    # Merging before every chunk is done names the missing ones and writes nothing.
    assert lwm(["tokenize", "merge", "--out", str(out)]) == 2
    assert "are not done in" in capsys.readouterr().err and not out.exists()

    assert lwm(["tokenize", *args, "--out", str(out), "--shard", "1/2"]) == 0
    err = capsys.readouterr().err
    assert f"taking over the lock of '{out}' left by pid {proc.pid}" in err
    assert f"publish with `lwm tokenize merge --out {out}`" in err
    assert lwm(["tokenize", "merge", "--out", str(out)]) == 0
    assert f"wrote {out} (12 records" in capsys.readouterr().err
    assert_same_dataset(out, one_process)
    assert not work.exists() and not list(tmp_path.glob("tokens.lock*"))


def test_a_jax_distributed_job_killed_and_rerun_equals_one_process(
    tmp_path, synthetic, vqgan_dir, one_process
):
    """Two processes on localhost (gloo), 2 CPU devices each by --cpu-devices, no XLA_FLAGS.
    The job is killed (both processes, kill -9) once each has written one chunk, as a scheduler
    kills a job whose host died; the rerun finishes the rest and publishes the one-process dataset."""
    out = tmp_path / "tokens"
    work = tmp_path / "tokens.partial"

    def start(python: list[str]) -> list[subprocess.Popen]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = ["--input", str(synthetic), "--vqgan", str(vqgan_dir), *SHARED]
        args += ["--out", str(out), "--coordinator", f"127.0.0.1:{port}"]
        args += ["--num-processes", "2", "--cpu-devices", "2"]
        return [
            subprocess.Popen(
                [*python, "tokenize", *args, "--process-id", str(i)],
                cwd=ROOT,
                env=_subprocess_env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]

    procs = start([sys.executable, "-c", HANG_AFTER, "1"])  # each writes one chunk, then hangs
    deadline = time.time() + 120
    while len(list(work.glob("chunk-*.json"))) < 2:
        assert all(p.poll() is None for p in procs), [p.stderr.read() for p in procs]
        assert time.time() < deadline
        time.sleep(0.01)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stderr.close()
    done = len(list(work.glob("chunk-*.json")))
    assert not out.exists() and done == 2

    errs = []
    for p in start([sys.executable, "-m", "lwm"]):
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        errs.append(err)
    # process 0 listed the chunks still to do; the two split them evenly
    left = 12 - done
    assert f"process 0 of 2: made {-(-left // 2)} of the 12 chunks" in errs[0]
    assert f"process 1 of 2: made {left // 2} of the 12 chunks" in errs[1]
    assert f"wrote {out}" in errs[0] and "wrote" not in errs[1]
    assert "taking over the lock" in errs[0] + errs[1]
    assert_same_dataset(out, one_process)
    assert not list(tmp_path.glob("tokens.lock*"))


HOLD = """
import sys, time
from contextlib import ExitStack
from lwm.base.lock import output_lock
with ExitStack() as stack:
    for path in sys.argv[1:]:
        stack.enter_context(output_lock(path, what=path))
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_second_run_on_an_output_in_use_is_refused(tmp_path, synthetic, vqgan_dir, capsys):
    from lwm.base.lock import output_lock

    tokens, run, vq = tmp_path / "tokens", tmp_path / "run", tmp_path / "vq"
    locks = [tmp_path / "tokens.lock", run / ".lock", vq / ".lock"]
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, *map(str, locks)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        args = ["--input", str(synthetic), "--vqgan", str(vqgan_dir), *SHARED]
        assert lwm(["tokenize", *args, "--out", str(tokens)]) == 2
        err = capsys.readouterr().err
        assert f"lwm tokenize: error: '{tokens}' is in use by another run: pid {holder.pid}" in err
        assert not tokens.exists() and not (tmp_path / "tokens.partial").exists()
        assert (
            lwm(["train", "--config", str(ROOT / "configs/tiny.yaml"), f"train.output_dir={run}"])
            == 2
        )
        err = capsys.readouterr().err
        assert f"error: train.output_dir '{run}' is in use by another run: pid {holder.pid}" in err
        assert sorted(p.name for p in run.iterdir()) == [".lock"]  # nothing written
        vqgan_cfg = ["--config", str(ROOT / "configs/vqgan/tiny.yaml"), f"train.output_dir={vq}"]
        assert lwm(["vqgan", "train", *vqgan_cfg]) == 2
        assert f"pid {holder.pid}" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    # The holder died without removing its locks: the next run takes one over, with a warning.
    warnings = []
    with output_lock(locks[1], what="the run", warn=warnings.append):
        assert (run / ".lock").is_file()
    assert len(warnings) == 1 and f"left by pid {holder.pid} on host" in warnings[0]
    assert not (run / ".lock").exists()


def test_cpu_devices_too_few_and_too_late_are_one_line(capsys):
    assert lwm(["train", "--config", str(ROOT / "configs/tiny.yaml"), "mesh.shape=1,2,8,1"]) == 2
    err = capsys.readouterr().err
    assert "needs 16 devices but 8 are available; on a CPU, run the lwm command with" in err
    assert "--cpu-devices 16" in err and len(err.strip().splitlines()) == 1
    # This process has started JAX already (8 devices): the flag cannot change that.
    assert lwm(["train", "--cpu-devices", "4", "--config", str(ROOT / "configs/tiny.yaml")]) == 2
    err = capsys.readouterr().err
    assert "--cpu-devices 4: JAX has already started with 8 device(s)" in err


def test_decoding_starts_when_the_stream_is_made_and_keeps_to_its_frames(synthetic):
    from data.chunk_encoder import DecodeStream
    from data.decode import DecodeOptions
    from data.manifest import read_inputs

    items = read_inputs(str(synthetic))
    indices = list(range(len(items))) * 4
    options = DecodeOptions(resolution=16)

    # Room for everything: every item is decoded before the first is taken (as `lwm tokenize`
    # has the workers decode while its encoder compiles). `quiet`: the feeder has handed
    # over every item, or waits for the consumer with nothing in flight.
    stream = DecodeStream(items, indices, options, 1, frames_ahead=10**6)
    try:
        assert stream.quiet.wait(60)
        assert stream.decoded_ahead == len(indices)
        assert [d.index for d in stream] == indices
    finally:
        stream.close()
    # Room for 12 frames (two 6-frame videos): one worker keeps 4 items (2 * workers + 2)
    # decoded or in flight once it knows the frames per item, at most one group of 2 beyond.
    # Once the feeder waits for the consumer, nothing more is decoded until an item is taken.
    stream = DecodeStream(items, indices, options, 1, frames_ahead=12)
    try:
        assert stream.quiet.wait(60)
        assert 4 <= stream.decoded_ahead <= 6
        got = [next(stream).index for _ in range(3)]
        stream.close()  # early, with items in flight: returns, and stops the stream's workers
        assert got == indices[:3] and stream.decoded_ahead <= 6
    finally:
        stream.close()


def test_workers_decode_ahead_in_frames_and_in_order(synthetic):
    from data.chunk_encoder import DecodeStream
    from data.decode import DecodeOptions
    from data.manifest import read_inputs

    items = read_inputs(str(synthetic))
    indices = list(range(len(items)))
    options = DecodeOptions(resolution=16)
    here = list(DecodeStream(items, indices, options, 0))
    ahead = list(DecodeStream(items, indices, options, 1, frames_ahead=64))
    assert [d.index for d in ahead] == [d.index for d in here] == indices
    for a, b in zip(ahead, here, strict=True):
        assert (a.error, a.frames is None) == (b.error, b.frames is None)
        if a.frames is not None:
            np.testing.assert_array_equal(a.frames, b.frames)


def test_the_vqgans_precision_is_recorded_and_a_changed_one_does_not_resume(
    tmp_path, synthetic, vqgan_dir, capsys, monkeypatch
):
    """The dataset's metadata names the VQGAN's `model.matmul_precision` (on a TPU its codes
    depend on it); an interrupted run rerun after that setting changed is refused, naming it
    (it would have mixed codes of two precisions in one dataset)."""
    import tensorflow_datasets as tfds
    import yaml

    import data.tokenize_dataset as tokenize_dataset

    vqgan = tmp_path / "vqgan"
    shutil.copytree(vqgan_dir, vqgan)

    def set_precision(value: str) -> None:
        config = yaml.safe_load((vqgan / "config.yaml").read_text())
        config["model"]["matmul_precision"] = value
        (vqgan / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    common = ["--input", str(synthetic), "--vqgan", str(vqgan), *FAST]
    set_precision("high")
    assert lwm(["tokenize", *common, "--out", str(tmp_path / "a")]) == 0
    meta = tfds.builder_from_directory(str(tmp_path / "a")).info.metadata
    assert meta["vqgan"]["matmul_precision"] == "high"

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(tokenize_dataset, "DecodeStream", interrupt)
        assert lwm(["tokenize", *common, "--out", str(tmp_path / "b")]) == 130
    assert (tmp_path / "b.partial" / "job.json").is_file()
    set_precision("default")
    capsys.readouterr()
    assert lwm(["tokenize", *common, "--out", str(tmp_path / "b")]) == 2
    assert "(vqgan_matmul_precision differ)" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
