"""Token streams of each record type, the project's text tokenizer, frame sampling and the
input manifest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data.decode import sample_indices
from data.manifest import Item, ManifestError, QATurn, read_inputs
from data.tokens import (
    EOF_ID,
    EOV_ID,
    LOSS_ALONE,
    TextCodec,
    build_example,
    frame_cells,
    frame_window,
    loss_weight,
    text_first,
    text_to_video_prompt_streams,
    vision_span,
    window_offsets,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def codec():
    return TextCodec.load(None)


def test_project_tokenizer_loads_with_autotokenizer(codec):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(codec.name)  # the default: data/tokenizer
    assert len(tok) == 4096 == codec.vocab_size
    assert codec.bos_id == tok.bos_token_id is not None and codec.eos_id is not None
    assert len(codec.vision_start) == len(codec.vision_end) == 1  # one token each
    text = "Two shapes on a dark background: a red circle moving left."
    ids = tok.encode(text)
    assert ids[0] == codec.bos_id and tok.decode(ids[1:]) == text
    assert len(ids) < len(text) / 2  # a real subword vocabulary, not bytes


def test_loading_the_tokenizer_without_pytorch_prints_nothing():
    """On a machine without PyTorch (a TPU VM) transformers advises at import that its models
    need it; loading the project's tokenizer needs none of them, so nothing is printed. A user
    who set TRANSFORMERS_NO_ADVISORY_WARNINGS keeps their setting."""
    hide_torch = (
        "import importlib.util as u; f = u.find_spec; "
        "u.find_spec = lambda name, *a, **k: None if name == 'torch' else f(name, *a, **k); "
        "from data.tokens import TextCodec; TextCodec.load(None); "
        "import os; print(os.environ['TRANSFORMERS_NO_ADVISORY_WARNINGS'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}

    def load() -> subprocess.CompletedProcess:
        run = subprocess.run(
            [sys.executable, "-c", hide_torch], cwd=ROOT, env=env, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        return run

    quiet = load()
    assert (quiet.stdout, quiet.stderr) == ("1\n", "")
    env["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = ""  # the user's own (empty) setting is kept,
    loud = load()  # and transformers then says its line: PyTorch was hidden from it
    assert loud.stdout == "\n" and "PyTorch was not found" in loud.stderr, loud.stderr


def test_the_project_tokenizer_loads_as_autotokenizer_would_without_importing_torch(codec):
    """`TextCodec.load` gives the project's tokenizer the class `AutoTokenizer` gives it, with
    the same ids for text and markers, in a process that never imports PyTorch (AutoTokenizer
    imports it wherever it is installed); a folder naming another class goes through
    AutoTokenizer."""
    from transformers import AutoTokenizer

    from data.tokens import _tokenizer_class

    auto = AutoTokenizer.from_pretrained(codec.name)
    assert type(codec.tokenizer) is type(auto)
    for text in ("Two shapes: a red circle moving left.", "<vision> x </vision>", " What?"):
        for special in (False, True):
            got = codec.tokenizer.encode(text, add_special_tokens=special)
            assert got == auto.encode(text, add_special_tokens=special), (text, special)
    assert codec.tokenizer.all_special_ids == auto.all_special_ids
    code = "import sys; from data.tokens import TextCodec; TextCodec.load(None); print('torch' in sys.modules)"
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert (r.returncode, r.stdout) == (0, "False\n"), r.stderr
    assert _tokenizer_class(Path("/nowhere")) is AutoTokenizer


def test_frame_cells_count_codes_from_each_frame_start():
    """Two videos of 2x3-code frames after some text: each code's raster index in its frame,
    -1 on text and on the <eof>/<eov> markers; the same with jax.numpy."""
    import jax.numpy as jnp

    codec_ids = [1, 3]  # BOS, <vision> (text)
    video = vision_span(np.arange(12).reshape(2, 2, 3) + 100)
    tokens = np.asarray(codec_ids + video.tolist() + [4, 7] + [3] + video[:7].tolist())
    vision = np.asarray([False] * 2 + [True] * 14 + [False] * 3 + [True] * 7)
    frame = list(range(6))
    expected = [-1, -1] + frame + [-1] + frame + [-1] + [-1, -1, -1] + frame + [-1]
    assert frame_cells(tokens, vision).tolist() == expected
    both = np.stack([tokens, tokens[::-1]]), np.stack([vision, vision[::-1]])
    np.testing.assert_array_equal(
        np.asarray(frame_cells(*map(jnp.asarray, both), xp=jnp)), frame_cells(*both)
    )
    # a code id with vision_mask False is text
    assert frame_cells(np.asarray([5, 5]), np.asarray([False, True])).tolist() == [-1, 0]


def test_frame_window_holds_each_codes_causal_neighbours():
    """For two videos of 3x4-code frames after text: each code's neighbours at the offsets of
    `window_offsets` (radius 1: left, then up-left, up, up-right), looked up in the code grid
    of its own frame; -1 outside the frame, on text and on markers; the same with jax.numpy.
    The window never reaches the code it predicts: every neighbour comes earlier."""
    import jax.numpy as jnp

    assert window_offsets(1) == [(0, 1), (1, 1), (1, 0), (1, -1)]
    assert len(window_offsets(2)) == 12
    rng = np.random.default_rng(0)
    grids = rng.integers(0, 512, (2, 3, 4))  # two frames of 3x4 codes
    video = vision_span(grids)
    tokens = np.asarray([1, 3] + video.tolist() + [4, 3] + video[:7].tolist())
    vision = np.asarray([False] * 2 + [True] * 26 + [False] * 2 + [True] * 7)
    starts = {2: 0, 15: 1, 30: 0}  # position of each frame's first code -> its frame
    expected = np.full((len(tokens), 4), -1)
    for start, f in starts.items():
        for cell in range(12):
            at = start + cell
            if at >= len(tokens) or not vision[at]:
                break
            r, c = divmod(cell, 4)
            for k, (dr, dc) in enumerate(window_offsets(1)):
                if r - dr >= 0 and 0 <= c - dc < 4:
                    expected[at, k] = grids[f, r - dr, c - dc]
    got = frame_window(tokens, vision, (3, 4), 1)
    np.testing.assert_array_equal(got, expected)
    both = np.stack([tokens, tokens]), np.stack([vision, vision])
    jx = frame_window(*map(jnp.asarray, both), (3, 4), 1, xp=jnp)
    np.testing.assert_array_equal(np.asarray(jx), np.stack([expected, expected]))
    with pytest.raises(ValueError, match="radius 4 must lie in"):
        frame_window(tokens, vision, (3, 4), 4)


def test_vision_span_markers():
    codes = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    span = vision_span(codes)
    assert span.tolist() == list(range(12)) + [EOF_ID] + list(range(12, 24)) + [EOV_ID]
    assert vision_span(codes[:1]).tolist() == list(range(12)) + [EOV_ID]
    with pytest.raises(ValueError):
        vision_span(np.full((1, 2, 2), 8192))


def test_caption_record(codec):
    codes = np.zeros((3, 2, 2), np.int32)
    ex = build_example(codec, codes, text="A red circle.")
    t, v, loss = ex["tokens"], ex["vision_mask"], ex["loss_mask"]
    caption = codec.encode("A red circle.")
    expected = [codec.bos_id, *codec.vision_start, *vision_span(codes), *codec.vision_end]
    assert t.tolist() == expected + caption + [codec.eos_id]
    assert v.sum() == 3 * 5 and v[1 + len(codec.vision_start)]
    assert loss.tolist() == [0] + [1] * (len(t) - 1)


def test_caption_first_record_and_its_generation_prompt(codec):
    codes = np.arange(2 * 2 * 2).reshape(2, 2, 2)
    ex = build_example(codec, codes, text="A red circle.", text_first=True)
    t, v, loss = ex["tokens"], ex["vision_mask"], ex["loss_mask"]
    caption = codec.encode("A red circle.")
    span = [*codec.vision_start, *vision_span(codes), *codec.vision_end]
    assert t.tolist() == [codec.bos_id, *caption, *span, codec.eos_id]
    assert v.tolist() == [False] * (1 + len(caption) + 1) + [True] * 10 + [False, False]
    assert loss.tolist() == [0] + [1] * (len(t) - 1)
    # the prompt of text-to-video is this record up to and including <vision>
    tokens, vision = text_to_video_prompt_streams(codec, "A red circle.")
    n = len(tokens)
    assert tokens.tolist() == t[:n].tolist() and t[n] == 0 and not vision.any()
    uncond, _ = text_to_video_prompt_streams(codec, None)
    assert uncond.tolist() == [codec.bos_id, *codec.vision_start]
    # text_first is ignored where there is no caption or no video
    qa = [{"question": "How many?", "answer": "two"}]
    assert build_example(codec, codes, qa=qa, text_first=True)["tokens"].tolist() == (
        build_example(codec, codes, qa=qa)["tokens"].tolist()
    )


def test_text_first_picks_the_asked_fraction_evenly():
    for ratio in (0.0, 0.25, 0.5, 1.0):
        picked = [text_first(i, ratio) for i in range(1000)]
        assert abs(sum(picked) - 1000 * ratio) <= 2
        assert abs(sum(picked[:100]) - 100 * ratio) <= 2  # spread, not bunched
    assert [text_first(i, 0.5) for i in range(8)] == [text_first(i, 0.5) for i in range(8)]


def test_qa_record(codec):
    codes = np.zeros((1, 2, 2), np.int32)
    qa = [{"question": "How many?", "answer": "two"}, {"question": "Colour?", "answer": "red"}]
    ex = build_example(codec, codes, qa=qa)
    t, loss = ex["tokens"], ex["loss_mask"]
    trained = codec.tokenizer.decode(t[loss == 1], skip_special_tokens=False)
    assert trained == " two</s> red</s>"
    context = codec.tokenizer.decode(t[loss == 0], skip_special_tokens=False)
    assert context.startswith("<s><vision>") and "USER: How many? ASSISTANT:" in context
    # a turn marked "learn": false is context: same tokens, its answer and EOS get no loss
    qa[0]["learn"] = False
    ex2 = build_example(codec, codes, qa=qa)
    assert ex2["tokens"].tolist() == t.tolist()
    trained = codec.tokenizer.decode(t[ex2["loss_mask"] == 1], skip_special_tokens=False)
    assert trained == " red</s>"
    # "learn": "alone": the same tokens, its answer and EOS marked LOSS_ALONE, which weigh 1
    # where the turn is asked alone and 0 where it follows earlier turns
    qa[0]["learn"] = "alone"
    ex3 = build_example(codec, codes, qa=qa)
    assert ex3["tokens"].tolist() == t.tolist()
    assert set(np.unique(ex3["loss_mask"]).tolist()) == {0, 1, LOSS_ALONE}
    alone = codec.tokenizer.decode(t[ex3["loss_mask"] == LOSS_ALONE], skip_special_tokens=False)
    assert alone == " two</s>"
    assert (loss_weight(ex3["loss_mask"]) == loss).all()
    assert (loss_weight(ex3["loss_mask"], chained=True) == ex2["loss_mask"]).all()
    qa[0]["learn"] = "yes"
    with pytest.raises(ValueError, match="'learn' is 'yes'; use true, false or 'alone'"):
        build_example(codec, codes, qa=qa)


def test_text_only_and_bare_video_records(codec):
    ex = build_example(codec, text="Hello world.")
    assert codec.tokenizer.decode(ex["tokens"], skip_special_tokens=False) == "<s>Hello world.</s>"
    assert not ex["vision_mask"].any() and ex["loss_mask"].tolist()[0] == 0
    bare = build_example(codec, np.zeros((2, 1, 1), np.int32))
    assert bare["tokens"][-1] == codec.eos_id and bare["vision_mask"].sum() == 4


def test_sampling_by_fps_then_max_frames():
    assert sample_indices(10, 30.0, None, None) == list(range(10))
    assert sample_indices(12, 8.0, 4.0, None) == [0, 2, 4, 6, 8, 10]
    assert sample_indices(10, 30.0, 10.0, None) == [0, 3, 6, 9]
    assert sample_indices(10, 5.0, 10.0, None) == list(range(10))  # never upsampled
    assert sample_indices(10, float("nan"), 4.0, None) == list(range(10))
    assert sample_indices(100, 25.0, None, 4) == [0, 33, 66, 99]  # LWM's linspace
    assert sample_indices(3, 25.0, None, 8) == [0, 1, 2]


def test_manifest_lines_and_relative_paths(tmp_path):
    rows = [
        {"video": "v/a.mp4", "text": "cap"},
        {"video": "/abs/b.mp4", "qa": [{"question": "q", "answer": "a"}]},
        {"video": "c.mp4", "qa": [{"question": "q", "answer": "a", "learn": False}]},
        {"video": "d.mp4", "qa": [{"question": "q", "answer": "a", "learn": "alone"}]},
        {"image": "i.png"},
        {"text": "just text"},
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    items = read_inputs(path)
    assert items == [
        Item("video", str(tmp_path / "v/a.mp4"), text="cap"),
        Item("video", "/abs/b.mp4", qa=(QATurn("q", "a"),)),
        Item("video", str(tmp_path / "c.mp4"), qa=(QATurn("q", "a", learn=False),)),
        Item("video", str(tmp_path / "d.mp4"), qa=(QATurn("q", "a", learn="alone"),)),
        Item("image", str(tmp_path / "i.png")),
        Item("text", None, text="just text"),
    ]
    for bad, message in [
        ('{"video": "a.mp4", "text": "x", "qa": []}', "both 'text' and 'qa'"),
        ('{"qa": [{"question": "q", "answer": "a"}]}', "needs 'video', 'image' or 'text'"),
        ('{"video": "a.mp4", "qa": [{"question": "q"}]}', "'question' and 'answer'"),
        (
            '{"video": "a.mp4", "qa": [{"question": "q", "answer": "a", "learn": 0}]}',
            "'learn' must be true, false or \"alone\"",
        ),
        ("[1]", "expected a JSON object"),
    ]:
        path.write_text('{"text": "ok"}\n' + bad + "\n")
        with pytest.raises(ManifestError, match=f"line 2: .*{message}"):
            read_inputs(path)


def test_folder_inputs_with_sidecar_captions(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("b.mp4", "a.webm", "sub/c.MKV", "notes.txt", "b.txt"):
        (tmp_path / name).write_text("caption of b" if name == "b.txt" else "")
    items = read_inputs(tmp_path)
    assert [(i.path, i.text) for i in items] == [
        (str(tmp_path / "a.webm"), None),
        (str(tmp_path / "b.mp4"), "caption of b"),
        (str(tmp_path / "sub/c.MKV"), None),
    ]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ManifestError, match="no videos"):
        read_inputs(tmp_path / "empty")


def test_a_video_given_as_the_input_is_named_as_such(tmp_path):
    """`lwm tokenize --input clip.mp4` was read as a manifest ("line 1: not valid JSON")."""
    video = tmp_path / "clip.mp4"
    video.write_bytes(b"\x00\x00\x00\x18ftypmp42")
    with pytest.raises(ManifestError, match="is a video; give the folder of videos or a .jsonl"):
        read_inputs(video)
