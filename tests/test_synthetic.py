"""Synthetic videos: determinism, answers that follow from the frames, MP4s that decord reads."""

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from data.manifest import read_inputs
from data.synthetic import (
    CATEGORIES,
    DEMO_WORLD,
    NUMBER_WORDS,
    check_spec,
    render_frames,
    render_video,
    sample_video,
    write_dataset,
)
from data.synthetic_check import Seen, answer, observe, question_category
from lwm.base.media import VideoError, read_video, write_mp4


def test_deterministic() -> None:
    a = [sample_video(3, i, size=32, num_frames=8) for i in range(5)]
    b = [sample_video(3, i, size=32, num_frames=8) for i in range(5)]
    assert a == b
    assert all(np.array_equal(render_video(x), render_video(y)) for x, y in zip(a, b, strict=True))
    assert a != [sample_video(4, i, size=32, num_frames=8) for i in range(5)]
    frames = render_frames(3, 3, size=32, num_frames=8, start=2)
    assert frames.shape == (3, 8, 32, 32, 3) and frames.dtype == np.uint8
    assert np.array_equal(frames[0], render_video(a[2]))


WORLDS = [
    dict(size=48, num_frames=10, needle_prob=0.6),
    dict(size=32, num_frames=4, radius=(0.12, 0.16), travel=(0.3, 0.45), max_objects=2),
    dict(DEMO_WORLD, num_frames=4),
    dict(size=64, num_frames=8, max_objects=3),
]


@pytest.mark.parametrize("world", WORLDS)
def test_sampling_keeps_only_videos_that_observe_answers(world) -> None:
    """A consistency check of `sample_video`'s filter, not of `observe`: a kept video is one
    whose frames `check_spec` (the same `observe` and `answer`) found to give every answer, so
    this only fails if the filter is bypassed, or if `observe` sees more or fewer objects than
    the spec drew. Whether `observe` reads frames right is
    `test_observe_reads_hand_drawn_frames`, on frames drawn without this package."""
    for index in range(25):
        spec = sample_video(0, index, **world)
        seen = observe(render_video(spec))
        assert seen.problems == ()
        for turn in spec.qa:
            assert answer(seen, turn["question"]) == turn["answer"], (index, turn)
        assert len(seen.objects) == len(spec.objects)


# Colours as RGB, written here rather than taken from `PALETTE`, and a little off its values,
# as a decoded or reconstructed frame would be.
RED, BLUE, GREEN, DARK = (225, 45, 35), (55, 85, 235), (45, 195, 75), (10, 20, 30)


def hand_drawn(
    frames: int = 6,
    size: int = 40,
    *,
    red_step: int = 2,
    needle_at: int | None = 3,
    drop_red: int | None = None,
) -> np.ndarray:
    """Frames drawn with numpy alone: a red disc of radius 5 moving right ``red_step`` pixels a
    frame along y = 10, a blue 9x9 square moving down 2 pixels a frame along x = 30, and a
    green triangle (apex up, rows 1, 3, .., 11 pixels wide) in frame ``needle_at`` only.
    ``drop_red``: a frame without the disc."""
    video = np.empty((frames, size, size, 3), np.uint8)
    video[...] = DARK
    ys, xs = np.mgrid[:size, :size]
    for t in range(frames):
        if t != drop_red:
            video[t][(xs - (8 + red_step * t)) ** 2 + (ys - 10) ** 2 <= 25] = RED
        top = 4 + 2 * t
        video[t, top : top + 9, 26:35] = BLUE
        if t == needle_at:
            for row in range(6):
                video[t, 28 + row, 10 - row : 11 + row] = GREEN
    return video


def test_observe_reads_hand_drawn_frames() -> None:
    """`observe` and `answer` on frames drawn in this test, not by `render_video`: each shape,
    colour, direction and the needle as drawn; every question's answer as a viewer gives it;
    and frames that do not settle a question give no answer."""
    seen = observe(hand_drawn())
    assert seen.problems == ()
    assert seen.objects == {
        "red": Seen("red", "circle", "right", (0, 1, 2, 3, 4, 5)),
        "blue": Seen("blue", "square", "down", (0, 1, 2, 3, 4, 5)),
    }
    assert seen.needle == Seen("green", "triangle", None, (3,))
    answers = {
        "How many shapes move in the video?": "two",
        "How many circles move in the video?": "one",
        "How many squares move in the video?": "one",
        "How many triangles move in the video?": "zero",
        "What colour is the moving circle?": "red",
        "What colour is the moving square?": "blue",
        "What colour is the moving triangle?": None,  # none moves
        "What shape is the red one?": "circle",
        "What shape is the blue one?": "square",
        "What shape is the green one?": None,  # the needle does not move
        "Which direction does the red circle move?": "right",
        "Which direction does the blue square move?": "down",
        "Which direction does the red square move?": None,  # no red square
        "What appeared briefly?": "a green triangle",
    }
    assert {q: answer(seen, q) for q in answers} == answers
    # the same video without its needle, with the motions reversed in time
    still = observe(hand_drawn(needle_at=None)[::-1])
    assert still.needle is None and answer(still, "What appeared briefly?") == "nothing"
    assert {o.colour: o.direction for o in still.objects.values()} == {"red": "left", "blue": "up"}
    # the disc missing from one frame is neither a moving object nor a needle
    gap = observe(hand_drawn(drop_red=2))
    assert set(gap.objects) == {"blue"} and gap.needle == Seen("green", "triangle", None, (3,))
    assert gap.problems == ("red: present in frames [0, 1, 3, 4, 5] of 6",)
    # a disc that does not move has no direction
    stuck = observe(hand_drawn(red_step=0))
    assert stuck.objects["red"] == Seen("red", "circle", None, (0, 1, 2, 3, 4, 5))
    assert stuck.problems == ("red: direction unclear",)
    assert answer(stuck, "Which direction does the red circle move?") is None


def test_questions_cover_every_category_in_drawn_orders() -> None:
    specs = [
        sample_video(2, i, size=32, num_frames=4, radius=(0.13, 0.18), max_objects=2)
        for i in range(40)
    ]
    # the default layout: one record per video, every kind of question first in some videos
    assert all(s.qa_records() == [s.qa] for s in specs)
    assert {s.qa[0]["category"] for s in specs} == set(CATEGORIES)
    for spec in specs:
        # the "kind" layout: one record per kind, in CATEGORIES order, the same turns
        kinds = [{t["category"] for t in r} for r in spec.qa_records("kind")]
        assert all(len(k) == 1 for k in kinds)
        assert [k.pop() for k in kinds] == [
            c for c in CATEGORIES if c in {t["category"] for t in spec.qa}
        ]
        same = lambda t: (t["question"], t["answer"], t["category"])  # noqa: E731
        turns = [same(t) for r in spec.qa_records("kind") for t in r]
        assert sorted(turns) == sorted(map(same, spec.qa))
    # the turns of a record come in orders drawn per video
    orders = {tuple(t["question"] for t in s.qa_records("kind")[1]) for s in specs}
    assert len(orders) > 3
    with pytest.raises(ValueError, match="unknown QA layout 'frame'"):
        specs[0].qa_records("frame")
    for spec in specs:
        qa = {t["question"]: t for t in spec.qa}
        assert {t["category"] for t in spec.qa} >= {
            "count",
            "count_shape",
            "shape",
            "direction",
            "needle",
        }
        # Every kind of shape is counted, zero included, and only moving shapes count.
        for shape in ("circle", "square", "triangle"):
            n = sum(o.shape == shape for o in spec.objects)
            assert qa[f"How many {shape}s move in the video?"]["answer"] == NUMBER_WORDS[n]
        assert all(question_category(q) == t["category"] for q, t in qa.items())
    # No learned answer about an object can be read off an earlier turn of its record: with one
    # record per kind no earlier turn names the object's colour and its shape together; in the
    # default layout some do (a direction question names both), and exactly those turns are
    # marked "learn": false (context only).
    leaks = {"kind": 0, "video": 0}
    unlearned = {"kind": 0, "video": 0}
    for spec in specs:
        for layout in leaks:
            for record in spec.qa_records(layout):
                words = [
                    set(re.findall(r"[a-z]+", f"{t['question']} {t['answer']}")) for t in record
                ]
                for i, turn in enumerate(record):
                    leaked = any(
                        turn["category"] in ("colour", "shape")
                        and o.colour in words[i]
                        and any({o.colour, o.shape} <= w for w in words[:i])
                        for o in spec.objects
                    )
                    learned = turn.get("learn", True)
                    assert not (leaked and learned), (layout, record, i)
                    leaks[layout] += leaked
                    unlearned[layout] += not learned
    assert leaks["kind"] == 0 and unlearned["kind"] == 0
    assert leaks["video"] > 10 and unlearned["video"] == leaks["video"]
    # The isolated layout (for data.qa_turns=isolated, where no turn sees another, or mixed)
    # is the video layout's record with every answer learned. The alone layout is the same
    # record with the turns an earlier one narrows learned only when asked alone (context
    # where chained): every turn the video layout does not learn (given away), the shape of
    # one of two objects after the other's colour or shape, a count after any count_shape;
    # never the first turn nor a direction.
    alone = {c: 0 for c in ("given away", "shape", "count")}
    for spec in specs:
        (video,) = spec.qa_records("video")
        (isolated,) = spec.qa_records("isolated")
        (marked,) = spec.qa_records("alone")
        drop = [{k: v for k, v in t.items() if k != "learn"} for t in video]
        assert [{k: v for k, v in t.items() if k != "learn"} for t in isolated] == drop
        assert [{k: v for k, v in t.items() if k != "learn"} for t in marked] == drop
        assert all(t["learn"] is True for t in isolated)
        assert all(t["learn"] in (True, "alone") for t in marked)
        assert marked[0]["learn"] is True
        for i, (v, t) in enumerate(zip(video, marked, strict=True)):
            before = {u["category"] for u in marked[:i]}
            if t["category"] == "direction":
                assert t["learn"] is True
            if not v["learn"]:
                assert t["learn"] == "alone"
                alone["given away"] += 1
            if t["category"] == "shape" and before & {"colour", "shape"}:
                assert t["learn"] == "alone"
                alone["shape"] += 1
            if t["category"] == "count" and "count_shape" in before:
                assert t["learn"] == "alone"
                alone["count"] += 1
    assert min(alone.values()) > 5, alone
    # The counts of objects and of needles are not biased by redrawing crowded videos.
    counts = [
        len(s.objects)
        for s in (
            sample_video(3, i, size=32, num_frames=4, radius=(0.13, 0.18), max_objects=2)
            for i in range(200)
        )
    ]
    assert 0.35 < counts.count(2) / len(counts) < 0.65


def test_caption_lists_objects_left_to_right() -> None:
    spec = next(
        s
        for s in (sample_video(0, i, size=64, num_frames=8) for i in range(50))
        if len(s.objects) == 3
    )
    ordered = sorted(spec.objects, key=lambda o: o.x)
    positions = [spec.caption.index(f"{o.colour} {o.shape} moving {o.direction}") for o in ordered]
    assert positions == sorted(positions)


def test_a_spec_the_pixels_cannot_settle_is_reported() -> None:
    """A circle and a square of radius 1.5 px are the same blob: `check_spec` says so, and
    `sample_video` never returns such a draw."""
    spec = sample_video(0, 0, size=32, num_frames=4)
    tiny = replace(spec, objects=tuple(replace(o, radius=1.4) for o in spec.objects), needle=None)
    assert check_spec(tiny)
    assert any("shape unclear" in p or "frames give" in p for p in check_spec(tiny))
    with pytest.raises(ValueError, match="could not draw an answerable video"):
        sample_video(0, 0, size=16, num_frames=4, radius=(0.02, 0.03))


@pytest.mark.parametrize("layout", ["video", "kind"])
def test_mp4_dataset_read_back_with_decord(tmp_path: Path, layout: str) -> None:
    manifest = write_dataset(
        tmp_path, count=3, seed=1, size=32, num_frames=8, fps=8, qa_layout=layout
    )
    rows = read_inputs(manifest)
    specs = [sample_video(1, i, size=32, num_frames=8) for i in range(3)]
    records = [1 + len(s.qa_records(layout)) for s in specs]  # a caption, then QA records
    assert records == [2, 2, 2] if layout == "video" else all(r >= 6 for r in records)
    starts = np.cumsum([0] + records)
    assert len(rows) == starts[-1]
    for i, spec in enumerate(specs):
        lines = rows[starts[i] : starts[i + 1]]
        assert lines[0].text == spec.caption and lines[0].qa is None
        assert all(r.text is None and r.path == lines[0].path for r in lines[1:])
        assert [[t._asdict() for t in r.qa] for r in lines[1:]] == spec.qa_records(layout)
        path = Path(lines[0].path)
        assert path == (tmp_path / f"videos/{i:05d}.mp4").absolute() and path.is_file()
        frames = read_video(path)
        assert frames.shape == (8, 32, 32, 3) and frames.dtype == np.uint8
        rendered = render_video(spec)
        # Lossless H.264: the rendered frames up to the RGB <-> YUV rounding, so every run of
        # `lwm synthetic` gives the VQGAN the same pixels.
        assert np.abs(frames.astype(int) - rendered).max() <= 2
        # Every answer can be read off the decoded video, too.
        seen = observe(frames)
        assert all(answer(seen, t["question"]) == t["answer"] for t in spec.qa)
    assert len(read_video(tmp_path / "videos/00000.mp4", max_frames=3)) == 3


def test_worker_processes_write_the_same_dataset(tmp_path: Path) -> None:
    kwargs = dict(count=6, seed=3, size=32, num_frames=4, also={"s.jsonl": ("shape",)})
    serial = write_dataset(tmp_path / "serial", **kwargs)
    parallel = write_dataset(tmp_path / "parallel", workers=2, **kwargs)
    for name in ("manifest.jsonl", "s.jsonl", "videos.jsonl"):
        assert (parallel.parent / name).read_text() == (serial.parent / name).read_text()
    assert not (parallel.parent / "videos.progress.jsonl").exists()
    for i in range(6):
        a = read_video(serial.parent / f"videos/{i:05d}.mp4")
        b = read_video(parallel.parent / f"videos/{i:05d}.mp4")
        np.testing.assert_array_equal(a, b)


def test_a_stopped_run_keeps_its_videos_and_forgets_the_one_it_was_replacing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import shutil

    import lwm.base.media

    a, b = (
        dict(count=6, seed=0, size=32, num_frames=4),
        dict(count=6, seed=0, size=32, num_frames=6),
    )
    out, other = tmp_path / "out", tmp_path / "other"
    write_dataset(out, **a)
    real, calls = lwm.base.media.write_mp4, []

    def stopped_on_the_third(*args, **kwargs):
        real(*args, **kwargs)  # the third video is replaced, then the run stops
        calls.append(args[0])
        if len(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(lwm.base.media, "write_mp4", stopped_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        write_dataset(out, **b)
    monkeypatch.setattr(lwm.base.media, "write_mp4", real)
    for mp4 in (out / "videos").iterdir():
        os.utime(mp4, ns=(1, 1))
    shutil.copytree(out, other)
    # Rerun as stopped: the two videos it finished are kept, the rest made.
    write_dataset(out, **b)
    kept = [(out / f"videos/{i:05d}.mp4").stat().st_mtime_ns == 1 for i in range(6)]
    assert kept == [True, True, False, False, False, False]
    # Back to the first world: the three it replaced (the third before its line) are made again.
    write_dataset(other, **a)
    kept = [(other / f"videos/{i:05d}.mp4").stat().st_mtime_ns == 1 for i in range(6)]
    assert kept == [False, False, False, True, True, True]
    for folder, world in ((out, b), (other, a)):
        fresh = write_dataset(tmp_path / f"fresh{world['num_frames']}", **world).parent
        for name in ("manifest.jsonl", "videos.jsonl"):
            assert (folder / name).read_text() == (fresh / name).read_text()
        assert not (folder / "videos.progress.jsonl").exists()
        for i in range(6):
            assert len(read_video(folder / f"videos/{i:05d}.mp4")) == world["num_frames"]


def test_bad_video_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.mp4"
    bad.write_text("not a video")
    with pytest.raises(VideoError, match="bad.mp4"):
        read_video(bad)
    with pytest.raises(VideoError, match="even frame sizes"):
        write_mp4(tmp_path / "odd.mp4", np.zeros((2, 15, 16, 3), np.uint8))
    assert not (tmp_path / "odd.mp4").exists()


@pytest.mark.parametrize("width", [48, 24, 40])
def test_widths_that_decord_misreads_come_back_right(tmp_path: Path, width: int) -> None:
    # decord 0.6 copies rows of some widths (16, 24, 48) with the decoder's padded line size
    # and fails in get_batch; read_video must return what FFmpeg decodes (read here by PyAV).
    import av

    frames = np.zeros((5, width, width, 3), np.uint8)
    frames[:, :, : width // 2, 0] = 200
    frames[:, : width // 3, :, 2] = 150
    frames[2, width // 2 :, width // 2 :, 1] = 250
    path = tmp_path / f"w{width}.mp4"
    write_mp4(path, frames, fps=4)
    with av.open(str(path)) as container:
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    got = read_video(path)
    assert got.shape == (5, width, width, 3)
    np.testing.assert_array_equal(got, decoded)
    np.testing.assert_array_equal(read_video(path, max_frames=3), decoded[[0, 2, 4]])
    # lwm tokenize reads through the same path (data.decode).
    from data.decode import DecodeOptions, decode_item
    from data.manifest import Item

    item = decode_item(0, Item("video", str(path)), DecodeOptions(resolution=width))
    assert item.error is None and item.frames.shape == (5, width, width, 3)
    # resized to its own size: the frames PyAV decodes, up to rounding
    assert np.abs(item.frames.astype(int) - decoded).max() <= 1
