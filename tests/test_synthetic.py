"""Synthetic videos: determinism, answers that follow from the frames, MP4s that decord reads."""

from pathlib import Path

import numpy as np
import pytest

from data.synthetic import (
    BACKGROUND,
    DIRECTIONS,
    NUMBER_WORDS,
    PALETTE,
    read_manifest,
    render_frames,
    render_video,
    sample_video,
    write_dataset,
)
from data.video_io import VideoError, read_video, write_mp4


def test_deterministic() -> None:
    a = [sample_video(3, i, size=32, num_frames=8) for i in range(5)]
    b = [sample_video(3, i, size=32, num_frames=8) for i in range(5)]
    assert a == b
    assert all(np.array_equal(render_video(x), render_video(y)) for x, y in zip(a, b, strict=True))
    assert a != [sample_video(4, i, size=32, num_frames=8) for i in range(5)]
    frames = render_frames(3, 3, size=32, num_frames=8, start=2)
    assert frames.shape == (3, 8, 32, 32, 3) and frames.dtype == np.uint8
    assert np.array_equal(frames[0], render_video(a[2]))


def _mask(frames: np.ndarray, colour: str, tol: int = 0) -> np.ndarray:
    diff = np.abs(frames.astype(int) - np.array(PALETTE[colour])).max(axis=-1)
    return diff <= tol


def _answers_from_frames(frames: np.ndarray, tol: int = 0) -> dict[str, object]:
    """What a viewer sees: colours present in every frame move, one present once flashed."""
    present = {c: _mask(frames, c, tol).any(axis=(1, 2)) for c in PALETTE}
    moving = [c for c, p in present.items() if p.all()]
    flashed = [c for c, p in present.items() if p.sum() == 1]
    directions = {}
    for c in moving:
        m = _mask(frames, c, tol)
        ys, xs = np.nonzero(m[0])
        ye, xe = np.nonzero(m[-1])
        dx, dy = xe.mean() - xs.mean(), ye.mean() - ys.mean()
        step = (
            int(np.sign(dx)) if abs(dx) > abs(dy) else 0,
            0 if abs(dx) > abs(dy) else int(np.sign(dy)),
        )
        directions[c] = next(k for k, v in DIRECTIONS.items() if v == step)
    return {"moving": sorted(moving), "flashed": flashed, "directions": directions}


@pytest.mark.parametrize("index", range(12))
def test_answers_follow_from_frames(index: int) -> None:
    spec = sample_video(0, index, size=48, num_frames=10, needle_prob=0.6)
    frames = render_video(spec)
    seen = _answers_from_frames(frames)
    qa = {p["question"]: p["answer"] for p in spec.qa}
    assert qa["How many shapes move in the video?"] == NUMBER_WORDS[len(seen["moving"])]
    assert sorted(o.colour for o in spec.objects) == seen["moving"]
    for o in spec.objects:
        assert (
            qa[f"Which direction does the {o.colour} {o.shape} move?"]
            == seen["directions"][o.colour]
        )
        question = f"What colour is the {o.shape}?"
        if sum(p.shape == o.shape for p in spec.objects) == 1:
            assert qa[question] == o.colour
        else:
            assert question not in qa
        count = sum(p.shape == o.shape for p in spec.objects)
        assert qa[f"How many {o.shape}s are there?"] == NUMBER_WORDS[count]
    if spec.needle is None:
        assert seen["flashed"] == [] and qa["What appeared briefly?"] == "nothing"
    else:
        assert seen["flashed"] == [spec.needle.colour]
        assert qa["What appeared briefly?"].endswith(f"{spec.needle.colour} {spec.needle.shape}")
        assert _mask(frames[spec.needle.frame], spec.needle.colour).any()
    assert (frames == np.array(BACKGROUND)).all(axis=-1).mean() > 0.3  # mostly background


def test_mp4_dataset_read_back_with_decord(tmp_path: Path) -> None:
    manifest = write_dataset(tmp_path, count=3, seed=1, size=32, num_frames=8, fps=8)
    rows = read_manifest(manifest)
    assert len(rows) == 6
    assert [set(r) for r in rows[:2]] == [{"video", "text"}, {"video", "qa"}]
    for i in range(3):
        path = Path(rows[2 * i]["video"])
        assert path == (tmp_path / f"videos/{i:05d}.mp4").resolve() and path.is_file()
        frames = read_video(path)
        assert frames.shape == (8, 32, 32, 3) and frames.dtype == np.uint8
        spec = sample_video(1, i, size=32, num_frames=8)
        assert rows[2 * i]["text"] == spec.caption and rows[2 * i + 1]["qa"] == spec.qa
        rendered = render_video(spec)
        assert np.abs(frames.astype(int) - rendered).mean() < 4  # H.264 at low CRF
        # The colour question is answerable from the decoded video, too.
        for o in spec.objects:
            x, y = (int(v) for v in o.centre(4))
            pixel = frames[4, y, x].astype(int)
            nearest = min(PALETTE, key=lambda c: np.abs(pixel - PALETTE[c]).sum())
            assert nearest == o.colour
    assert len(read_video(tmp_path / "videos/00000.mp4", max_frames=3)) == 3


def test_bad_video_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.mp4"
    bad.write_text("not a video")
    with pytest.raises(VideoError, match="bad.mp4"):
        read_video(bad)
    with pytest.raises(VideoError, match="even frame sizes"):
        write_mp4(tmp_path / "odd.mp4", np.zeros((2, 15, 16, 3), np.uint8))
    assert not (tmp_path / "odd.mp4").exists()
