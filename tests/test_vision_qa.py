"""Inference prompts match what training saw; lwm ask reports bad input clearly."""

from __future__ import annotations

import numpy as np
import pytest

from data.tokens import TextCodec, build_example, qa_prompt_streams
from lwm.cli import main as lwm


def test_qa_prompt_is_the_context_of_a_training_record():
    codec = TextCodec.load()
    codes = np.random.default_rng(0).integers(0, 512, (3, 4, 4))
    question, answer = "What colour is the square?", "red"
    record = build_example(codec, codes, qa=[{"question": question, "answer": answer}])
    tokens, vision = qa_prompt_streams(codec, codes, question)
    n = len(tokens)
    assert record["tokens"][:n].tolist() == tokens.tolist()
    assert record["vision_mask"][:n].tolist() == vision.tolist()
    # Everything in the prompt is context; the answer right after it is what training teaches.
    assert not record["loss_mask"][:n].any() and record["loss_mask"][n:].all()
    assert (
        codec.tokenizer.decode(record["tokens"][n:].tolist(), skip_special_tokens=True).strip()
        == answer
    )
    assert vision.sum() == 3 * (16 + 1)


def _lwm_vision_chat_prompt(tokenizer, codes, question):
    """LWM's ``lwm/vision_chat.py`` for one prompt, transcribed (``_read_process_vision`` turns
    the codes into ids, ``construct_input`` builds the prompt without its left padding)."""
    vision = []
    for t in range(len(codes)):
        vision.extend(codes[t].reshape(-1).tolist())
        vision.append(8193 if t == len(codes) - 1 else 8192)
    text_1 = tokenizer.encode(f"<s>You are a helpful assistant. USER: {question}\n")
    vision_start = tokenizer.encode("<vision>")
    vision_end = tokenizer.encode("</vision>")
    tail = tokenizer.encode(" ASSISTANT:")
    tokens, vm = [], []
    for ids, is_vision in ((text_1, False), (vision_start, False), (vision, True),
                           (vision_end, False), (tail, False)):  # fmt: skip
        tokens.extend(ids)
        vm.extend([is_vision] * len(ids))
    return tokens, vm


def test_lwm_prompt_is_the_prompt_of_lwms_vision_chat():
    """``prompt="lwm"`` (``lwm ask --prompt lwm``) asks as LWM's own chat script does, so LWM's
    released chat weights see the prompt they were made for; the default stays our records'."""
    from lwm.qa_eval import Answer
    from lwm.vision_qa import VideoQA

    codec = TextCodec.load()
    codes = np.random.default_rng(1).integers(0, 8192, (3, 16, 16))
    question = "What is the video about?"
    asked = {}

    for prompt in ("lwm", "record"):
        qa = VideoQA(None, codec, None, prompt=prompt)
        qa._codes["v.mp4"] = codes  # as if the VQGAN had encoded the video

        def generate(prompts, prompt=prompt):
            asked[prompt] = prompts
            return [(Answer("", cut=False), []) for _ in prompts]

        qa._generate = generate
        qa.answer([("v.mp4", question)])
    (tokens, vision), = asked["lwm"]  # fmt: skip
    want_tokens, want_vision = _lwm_vision_chat_prompt(codec.tokenizer, codes, question)
    assert tokens.tolist() == want_tokens and vision.tolist() == want_vision
    (tokens, vision), = asked["record"]  # fmt: skip
    assert tokens.tolist() == qa_prompt_streams(codec, codes, question)[0].tolist()
    assert tokens.tolist() != want_tokens
    with pytest.raises(ValueError, match="one question"):
        VideoQA(None, codec, None, prompt="lwm").answer_in_conversations([("v.mp4", question)])
    with pytest.raises(ValueError, match="unknown prompt 'llava'"):
        VideoQA(None, codec, None, prompt="llava")


def test_ask_about_a_missing_run_is_one_clear_error(tmp_path, capsys):
    video = tmp_path / "v.mp4"
    question = ["--video", str(video), "--question", "What is it?"]
    assert lwm(["ask", "--model", f"run:{tmp_path}", *question]) == 2
    assert capsys.readouterr().err == f"lwm ask: error: video '{video}' not found\n"
    video.write_bytes(b"")  # the video is looked for first, before any model loads
    assert lwm(["ask", "--model", f"run:{tmp_path}", *question]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"lwm ask: error: '{tmp_path}' is not an lwm train run (expected config.yaml and "
        "checkpoints/)"
    ]
    # a run brings its own config: --config beside it was ignored without a word
    assert lwm(["ask", "--model", f"run:{tmp_path}", "--config", "c.yaml", *question]) == 2
    assert capsys.readouterr().err == (
        f"lwm ask: error: --config is for weights without one (hf:, lwm:, orbax:); the run "
        f"'{tmp_path}' brings its own (config.yaml)\n"
    )


def test_training_inputs_come_from_the_dataset_metadata(tmp_path):
    import json

    from lwm.vision_qa import TrainingInputs

    assert TrainingInputs.of("synthetic") == {}
    with pytest.raises(ValueError, match="^a VQGAN is needed .--vqgan.: the model's training "):
        TrainingInputs.of("synthetic").vqgan_path()
    # a dataset not found from here (e.g. a relative path, another working directory)
    assert TrainingInputs.of(str(tmp_path)) == {"missing": str(tmp_path)}
    with pytest.raises(ValueError, match=f"dataset '{tmp_path}' is not found from here"):
        TrainingInputs.of(str(tmp_path)).vqgan_path()
    assert TrainingInputs.of(str(tmp_path)).vqgan_path("/given") == "/given"
    meta = {
        "vqgan": {"path": "/v"},
        "text_tokenizer": {"name": "/t"},
        "sampling": {"fps": None, "max_frames": 8},
        "input": "/data/manifest.jsonl",
    }
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    assert TrainingInputs.of(str(tmp_path)) == {
        "vqgan": "/v",
        "tokenizer": "/t",
        "max_frames": 8,
        "manifest": "/data/manifest.jsonl",
        "dataset": str(tmp_path),
    }
