"""The inference commands on a tiny trained run: `lwm eval needle` writes its JSON lines and
heatmap, `lwm chat` answers several turns from one cache, `lwm generate` writes clips the
VQGAN decoded; their bad input is one line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from lwm.cli import main as lwm

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One step of the debug model with the project's 4,096-token text vocabulary; its vision
    head scores the 64 codes of the tests' tiny VQGAN."""
    run = tmp_path_factory.mktemp("tiny") / "run"
    args = ["--config", str(ROOT / "configs/debug.yaml"), "train.steps=1", "train.progress=false"]
    args += ["model.text_vocab_size=4096", "model.max_seq_len=512", "model.vision_codes=64"]
    args += ["--out", str(run), "train.batch_size=8", "train.seq_len=64"]
    args += ["train.peak_flops=1e9"]
    assert lwm(["train", *args]) == 0
    return run


def test_eval_needle_command_writes_jsonl_and_heatmap(run, tmp_path, capsys):
    out = tmp_path / "needle"
    needle = ["eval", "needle", "--model", f"run:{run}", "--lengths", "96,120", "--batch-size", "8"]
    needle += ["--depths", "0,1", "--max-new-tokens", "4", "--out", str(out)]
    assert lwm([*needle, "--kind", "multi", "--needles", "3", "--asked", "2"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["kind"] == "multi" and summary["lengths"] == [96, 120]
    assert summary["depths"] == [0.0, 1.0] and summary["cases"] == 4  # 2 lengths x 2 depths
    assert summary["questions"] == 8  # two asked in each
    rows = [json.loads(x) for x in (out / "needle-multi.jsonl").read_text().splitlines()]
    assert len(rows) == 9 and rows[-1] == {"summary": summary}
    assert all(r["prompt_tokens"] <= r["length"] for r in rows[:-1])
    png = (out / "needle-multi.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and "wrote" in captured.err
    # bad input: one line, exit 2
    assert lwm([*needle, "--depths", "0,1.5"]) == 2
    assert capsys.readouterr().err.strip() == "lwm eval: error: depth 1.5 is not in [0, 1]"
    # said before the model loads (it logs "loaded ... at step"): the haystack, and a length
    # too short for whichever needles are drawn
    assert lwm([*needle, "--haystack", str(tmp_path / "none.txt")]) == 2
    err = capsys.readouterr().err
    assert err == f"lwm eval: error: haystack file '{tmp_path / 'none.txt'}' not found\n"
    assert lwm([*needle, "--lengths", "20,96", "--kind", "multi", "--needles", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lwm eval: error: a prompt of 20 tokens cannot hold the question")
    assert len(err.splitlines()) == 1
    assert lwm([*needle, "--kind", "video", "--clip-frames", "2"]) == 2
    err = capsys.readouterr().err  # before the model loads (it failed after)
    assert err == "lwm eval: error: --clip-frames must be at least 3 (a clip's motion), not 2\n"
    assert lwm([*needle, "--kind", "video", "--needle-colours", "white,pink"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lwm eval: error: --needle-colours: unknown colour 'pink' (known: red,")
    assert len(err.splitlines()) == 1


def greedy_conversation(run: Path, questions: list[str], max_new_tokens: int):
    """``(answer, cut)`` of each turn of a text conversation with the run's model, worked out
    without `lwm.chat` and its cache: BOS, then per turn ``USER: {question} ASSISTANT:`` (the
    text of training's QA turns, encoded with the project's tokenizer) and the argmax of a
    full forward pass, one token at a time, up to EOS or ``max_new_tokens``; a turn cut short
    is closed with an EOS, as training closes every turn."""
    import jax.numpy as jnp
    from flax import nnx
    from transformers import AutoTokenizer

    from lwm.runs import run_config
    from lwm.weights import load_model

    tok = AutoTokenizer.from_pretrained(ROOT / "data" / "tokenizer")
    eos = tok.eos_token_id
    model = load_model(f"run:{run}", run_config(run).model, log=lambda _: None)
    forward = nnx.jit(lambda m, t: m(t, jnp.zeros(t.shape, bool))[0])
    width = 64  # right-padded: causal attention never sees the padding
    history, answers = [tok.bos_token_id], []
    for question in questions:
        history += tok.encode(f"USER: {question} ASSISTANT:", add_special_tokens=False)
        new: list[int] = []
        while len(new) < max_new_tokens and eos not in new:
            ids = np.zeros((1, width), np.int32)
            ids[0, : len(history) + len(new)] = history + new
            logits = np.asarray(forward(model, jnp.asarray(ids)))
            new.append(int(logits[0, len(history) + len(new) - 1].argmax()))
        cut = eos not in new
        history += new + ([eos] if cut else [])
        text = tok.decode([x for x in new if x != eos], skip_special_tokens=True).strip()
        answers.append((text, cut))
    return answers


def test_chat_answers_every_turn_and_reports_a_full_context(run, monkeypatch, capsys):
    chat = ["chat", "--model", f"run:{run}", "--max-new-tokens", "3", "--prefill-chunk", "16"]
    monkeypatch.setattr("sys.stdin", io.StringIO("What is it?\n\nAnd now?\n"))
    assert lwm([*chat, "--max-context", "64"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [x["question"] for x in lines] == ["What is it?", "And now?"]
    # the answers are the greedy ones of full forward passes over the whole conversation
    want = greedy_conversation(run, ["What is it?", "And now?"], max_new_tokens=3)
    assert [(x["answer"], x["cut"]) for x in lines] == want
    # four turns of about 11 tokens do not fit 32: the answers so far, then one error line
    questions = ["--question", "What is it?"] * 4
    assert lwm([*chat, "--max-context", "32", *questions]) == 2
    captured = capsys.readouterr()
    assert 1 <= len(captured.out.strip().splitlines()) < 4
    (err,) = [x for x in captured.err.splitlines() if "error" in x]
    assert err.startswith("lwm chat: error: the conversation needs") and "holds 32" in err
    assert lwm([*chat, "--video", "missing.mp4"]) == 2
    err = capsys.readouterr().err  # said before the model loads
    assert err == "lwm chat: error: video 'missing.mp4' not found\n"


def test_generate_writes_clips_of_the_asked_frames(run, tmp_path, capsys):
    from PIL import Image
    from tokenize_helpers import save_tiny_vqgan

    from lwm.base.media import read_video

    vqgan = save_tiny_vqgan(tmp_path / "vqgan")
    gen = ["generate", "--model", f"run:{run}", "--vqgan", str(vqgan), "--prompt", "A red circle."]
    clip = tmp_path / "clip.mp4"
    assert (
        lwm([*gen, "--frames", "3", "--samples", "2", "--cfg-scale", "2", "--out", str(clip)]) == 0
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    paths = [tmp_path / "clip-0.mp4", tmp_path / "clip-1.mp4"]
    assert [x["out"] for x in lines] == [str(p) for p in paths] and not clip.exists()
    for path in paths:
        assert read_video(path).shape == (3, 16, 16, 3)  # the tiny VQGAN's 16x16 frames
    png = tmp_path / "frame.png"
    assert lwm([*gen, "--frames", "1", "--out", str(png)]) == 0
    assert Image.open(png).size == (16, 16)
    capsys.readouterr()
    # bad input: one line, exit 2, nothing written
    assert lwm([*gen, "--frames", "2", "--out", str(tmp_path / "two.png")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"lwm generate: error: --out '{tmp_path / 'two.png'}' is a PNG, which holds one frame; "
        "--frames is 2"
    )
    assert lwm([*gen, "--out", str(tmp_path / "none" / "c.mp4")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert (
        lwm([*gen[:-4], "--vqgan", str(tmp_path / "missing"), "--prompt", "x", "--out", str(clip)])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lwm generate: error:") and "missing" in err[-1]
    # a VQGAN of fewer codes than the model samples: said before sampling (it failed decoding)
    small = save_tiny_vqgan(tmp_path / "small", num_embeddings=32)
    assert lwm([*gen[:3], "--vqgan", str(small), *gen[5:], "--out", str(clip)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"lwm generate: error: the model samples 64 codes (model.vision_codes: 64), the VQGAN "
        f"{small} decodes 32; train with model.vision_codes=32, or give that model's VQGAN"
    )
    assert not clip.exists() and not (tmp_path / "two.png").exists()


def test_a_step_of_a_run_given_as_orbax_weights_names_the_run(run):
    """A run's checkpoint folder (or its state) given as ``orbax:``: one error naming the run
    to give instead (it was an AttributeError, or an optimizer tensor "with no place")."""
    from lwm.runs import run_config
    from lwm.weights import WeightsError, load_model

    cfg = run_config(run).model
    (step,) = [p for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    for given in (step, step / "state"):
        with pytest.raises(WeightsError) as e:
            load_model(f"orbax:{given}", cfg)
        assert str(e.value) == (
            f"'{given}' is a checkpoint of the lwm train run '{run}', not parameters saved "
            f"alone: give the run, run:{run} (its newest checkpoint that restores)"
        )


def test_a_vqgan_with_more_codes_than_the_model_reads_is_refused(run, tmp_path, capsys):
    from tokenize_helpers import save_tiny_vqgan

    from lwm.base.media import write_mp4

    video = tmp_path / "v.mp4"
    write_mp4(video, np.zeros((2, 16, 16, 3), np.uint8), fps=2)
    vqgan = save_tiny_vqgan(tmp_path / "vq128", num_embeddings=128)  # the model reads 64
    ask = ["ask", "--model", f"run:{run}", "--video", str(video), "--question", "Which?"]
    assert lwm([*ask, "--vqgan", str(vqgan)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"lwm ask: error: the VQGAN {vqgan} has 128 codes, more than the model's vision_codes (64)"
    )


def test_a_run_loaded_with_other_vision_codes_is_refused(run):
    """The same vision table read as other codes (the run learned 64; with none set, its head
    scored all 8,448): refused, as other parameter shapes are."""
    from lwm.runs import run_config
    from lwm.weights import WeightsError, load_model

    cfg = run_config(run).model
    assert load_model(f"run:{run}", cfg, log=lambda _: None).cfg.vision_codes == 64
    with pytest.raises(WeightsError, match=r"model.vision_codes: 64 there, None here"):
        load_model(f"run:{run}", cfg.model_copy(update={"vision_codes": None}), log=print)


def test_ask_with_lwms_chat_prompt(run, tmp_path, capsys, monkeypatch):
    """`lwm ask --prompt lwm` sends the prompt LWM's vision_chat.py (``construct_input``)
    builds, written out here from LWM's code: each piece encoded on its own with the
    tokenizer's default special tokens (a BOS each), ``"<s>You are a helpful assistant. USER:
    {question}\\n"``, ``<vision>``, the video's codes (vision), ``</vision>``, ``" ASSISTANT:"``;
    the video's codes are the ones the default prompt (our QA records') sends; one JSON line
    per question."""
    from tokenize_helpers import save_tiny_vqgan
    from transformers import AutoTokenizer

    from lwm import vision_qa
    from lwm.base.media import write_mp4

    sent = []
    real = vision_qa.prompt_batch

    def record(prompts, *args, **kwargs):
        sent.extend((np.asarray(t).tolist(), np.asarray(v).tolist()) for t, v in prompts)
        return real(prompts, *args, **kwargs)

    monkeypatch.setattr(vision_qa, "prompt_batch", record)
    video = tmp_path / "v.mp4"
    write_mp4(video, np.zeros((2, 16, 16, 3), np.uint8), fps=2)
    vqgan = save_tiny_vqgan(tmp_path / "vq64", num_embeddings=64)
    ask = ["ask", "--model", f"run:{run}", "--video", str(video), "--question", "Which?"]
    ask += ["--vqgan", str(vqgan), "--max-new-tokens", "2"]
    assert lwm([*ask, "--prompt", "lwm"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert json.loads(line)["question"] == "Which?"
    assert lwm(ask) == 0  # the default prompt, for the video's codes
    capsys.readouterr()
    (lwm_tokens, lwm_vision), (record_tokens, record_vision) = sent
    codes = [t for t, v in zip(record_tokens, record_vision, strict=True) if v]
    assert len(codes) == 2 * 65 and codes[64] == 8192 and codes[-1] == 8193  # 2 frames of 8x8
    tok = AutoTokenizer.from_pretrained(ROOT / "data" / "tokenizer")
    pieces = [
        (tok.encode("<s>You are a helpful assistant. USER: Which?\n"), False),
        (tok.encode("<vision>"), False),
        (codes, True),
        (tok.encode("</vision>"), False),
        (tok.encode(" ASSISTANT:"), False),
    ]
    assert lwm_tokens == [t for ids, _ in pieces for t in ids]
    assert lwm_vision == [v for ids, v in pieces for _ in ids]
    assert lwm_tokens[:2] == [tok.bos_token_id] * 2  # the BOS, then LWM's text "<s>"
