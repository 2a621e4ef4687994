"""Needle-in-a-haystack evaluations (`lwm.needle`, `lwm eval needle`): needles at exact depths,
substring and multi-needle scoring, the video needle's frames, and the command's outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data.tokens import TextCodec
from lwm.needle import (
    NEEDLE,
    Haystack,
    NeedleCase,
    evaluate_needles,
    needle_video,
    text_cases,
    video_cases,
)
from lwm.qa_eval import Answer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.load()


def find(haystack: list[int], needle: list[int]) -> list[int]:
    n = len(needle)
    return [i for i in range(len(haystack) - n + 1) if haystack[i : i + n] == needle]


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_a_needle_sits_at_its_depth_between_whole_sentences(codec, depth):
    hay = Haystack.from_file(codec)
    needle = codec.encode(" " + NEEDLE.format(city="Oslo", number="1234567"))
    tokens, (actual,) = hay.build(3000, [(depth, needle)], start=5)
    (at,) = find(tokens, needle)  # exactly once
    rest = tokens[:at] + tokens[at + len(needle) :]
    longest = max(len(s) for s in hay.sentences)
    assert 3000 - longest <= len(tokens) <= 3000
    assert actual == pytest.approx(at / len(rest))
    assert abs(at - depth * len(rest)) <= longest  # the nearest sentence boundary
    if depth == 0.0:
        assert at == 0
    if depth == 1.0:
        assert at + len(needle) == len(tokens)
    # the haystack around it is whole sentences, starting at sentence 5, in order
    assert rest[: len(hay.sentences[5])] == hay.sentences[5]


def test_text_cases_hold_the_needle_and_ask_for_it(codec):
    (case,) = text_cases(codec, lengths=[500], depths=[0.5], samples=1, seed=3)
    (tokens, vision), (number,), (question,) = case.prompts[0], case.expected, case.questions
    assert not vision.any() and len(tokens) <= 500 and case.info["prompt_tokens"] == len(tokens)
    text = codec.tokenizer.decode(tokens.tolist(), skip_special_tokens=True)
    city = question.split("magic ")[1].split(" number")[0]
    assert NEEDLE.format(city=city, number=number) in text
    assert len(number) == 7 and text.endswith(f"USER: {question} ASSISTANT:")
    assert tokens[0] == codec.bos_id


class Oracle:
    """Answers from the prompt itself: the number of the city asked, if it is in the first
    ``reach`` share of the prompt (a model whose retrieval fails past some depth)."""

    batch_size = 3

    def __init__(self, codec: TextCodec, reach: float = 1.0, only_first: bool = False):
        self.codec, self.reach, self.only_first = codec, reach, only_first
        self.asked: set[str] = set()

    def answer_prompts(self, prompts):
        out = []
        for tokens, _ in prompts:
            text = self.codec.tokenizer.decode(tokens.tolist(), skip_special_tokens=True)
            city = text.rsplit("special magic ", 1)[1].split(" number")[0]
            seen = text[: int(self.reach * len(text))]
            key = f"The special magic {city} number is: "
            found = key in seen and not (self.only_first and city in self.asked)
            self.asked.add(city)
            number = seen.split(key)[1][:7] if found else "unknown"
            out.append(Answer(f"It is {number}.", cut=False))
        return out


def test_substring_scoring_fills_the_grid_by_depth(codec):
    cases = text_cases(codec, lengths=[300, 600], depths=[0.0, 0.5, 1.0], samples=2)
    report = evaluate_needles(Oracle(codec, reach=0.7), cases)
    lengths, depths, acc = report.grid()
    assert lengths == [300, 600] and depths == [0.0, 0.5, 1.0]
    np.testing.assert_array_equal(acc, [[1, 1], [1, 1], [0, 0]])  # found up to 70% deep
    assert len(report.rows) == 12 and report.summary()["mean"] == pytest.approx(2 / 3)
    assert "100%" in report.table() and "0%" in report.table()


def test_multi_needle_scores_the_share_of_asked_needles_found(codec):
    cases = list(text_cases(codec, lengths=[800], depths=[0.25], needles=4, asked=2, samples=3))
    for case in cases:
        assert len(case.prompts) == 2 and len(set(case.expected)) == 2
        text = codec.tokenizer.decode(case.prompts[0][0].tolist(), skip_special_tokens=True)
        assert text.count("The special magic") == 4  # four needles, two asked
    # An oracle that answers only the first question about each city: half of each sample.
    oracle = Oracle(codec)
    oracle.batch_size = 2  # a batch is one case's two prompts
    oracle.answer_prompts = _first_of_each_case(oracle.answer_prompts)
    report = evaluate_needles(oracle, cases)
    assert report.kind == "multi" and report.grid()[2][0, 0] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="asked <= needles"):
        next(text_cases(codec, lengths=[800], depths=[0.0], needles=2, asked=3))
    summary = report.summary()
    assert summary["cases"] == 3 and summary["questions"] == 6  # "cases" counted questions
    with pytest.raises(ValueError, match=r"a prompt of 5 tokens cannot hold .* at least \d+$"):
        text_cases(codec, lengths=[5], depths=[0.0])  # it said "a haystack of -13 tokens"
    with pytest.raises(ValueError, match=r"depth 1.5 is not in \[0, 1\]"):
        text_cases(codec, lengths=[800], depths=[0.5, 1.5])  # made cases labelled 1.5
    with pytest.raises(ValueError, match=r"depth -0.1 is not in \[0, 1\]"):
        video_cases(codec, None, lengths=[8], depths=[-0.1])


@pytest.mark.parametrize("needles", [1, 3])
def test_every_length_from_the_shortest_prompt_holds_every_draw(codec, needles):
    """The needles and questions are drawn per case, so the room they take varies: one bound,
    `shortest_text_prompt`, checked for the whole grid before any case is made (37 tokens
    failed, 38 held and 39 failed again, each after the cells before it had run)."""
    from lwm.needle import shortest_text_prompt

    least = shortest_text_prompt(codec, needles)
    lengths = list(range(least, least + 24))
    grid = text_cases(codec, lengths=lengths, depths=[0.0, 0.5, 1.0], samples=3, needles=needles)
    for case in grid:
        assert len(case.prompts[0][0]) <= case.length
    with pytest.raises(ValueError, match=f"a prompt of {least - 1} tokens .* at least {least}$"):
        text_cases(codec, lengths=[10**4, least - 1], depths=[0.5], needles=needles)


def _first_of_each_case(answer):
    def first_only(prompts):
        answers = answer(prompts)
        return [a if i % 2 == 0 else Answer("no idea", cut=False) for i, a in enumerate(answers)]

    return first_only


def test_a_video_needle_is_in_the_frames_asked_and_in_no_other_shape():
    from data.synthetic import PALETTE

    frames, expected, where = needle_video(
        12, 0.5, seed=2, size=32, clip_frames=4, needle_frames=2, max_objects=2
    )
    assert frames.shape == (12, 32, 32, 3) and where == range(5, 7)  # round(0.5 * 10)
    article, colour, shape = expected.split()
    assert article in ("a", "an") and shape in ("circle", "square", "triangle")
    has = [(frames[t] == PALETTE[colour]).all(-1).sum() for t in range(12)]
    assert all(has[t] > 0 for t in where) and all(has[t] == 0 for t in range(12) if t not in where)
    first, *_ = needle_video(12, 0.0, seed=2, size=32, clip_frames=4, max_objects=2)
    last, _, at_end = needle_video(12, 1.0, seed=2, size=32, clip_frames=4, max_objects=2)
    assert at_end == range(11, 12) and first.shape == last.shape


def test_needle_colours_are_the_needles_alone():
    """With ``needle_colours`` the needle takes one of them and no haystack pixel has any of
    them, whatever the needle drawn; unknown colours and a palette with nothing left fail."""
    from data.synthetic import PALETTE

    reserved = ("white", "cyan")
    seen = set()
    for seed in range(6):
        frames, expected, where = needle_video(
            16, 0.4, seed=seed, clip_frames=4, needle_frames=2, needle_colours=reserved
        )
        colour = expected.split()[1]
        seen.add(colour)
        assert colour in reserved
        for t in range(16):
            for name in reserved:
                n = (frames[t] == PALETTE[name]).all(-1).sum()
                assert (n > 0) == (name == colour and t in where), (seed, t, name)
    assert seen == set(reserved)
    with pytest.raises(ValueError, match="unknown colour 'pink'"):
        needle_video(8, 0.5, needle_colours=["white", "pink"])
    with pytest.raises(ValueError, match="a colour that is not a needle's"):
        needle_video(8, 0.5, needle_colours=list(PALETTE))


def test_video_cases_prompt_with_every_frame(codec):
    class Encoder:  # codes of the right shape; what they are does not matter here
        def encode(self, frames):
            return np.zeros((*frames.shape[:2], 2, 2), np.int32)

    (case,) = video_cases(codec, Encoder(), lengths=[8], depths=[0.25], size=32, max_objects=1)
    tokens, vision = case.prompts[0]
    assert vision.sum() == 8 * (4 + 1) and case.questions == ["What appeared briefly?"]
    assert case.info["needle_frames"] == [2, 3]  # round(0.25 * 7)

    class Says:
        batch_size = 4

        def __init__(self, text):
            self.text = text

        def answer_prompts(self, prompts):
            return [Answer(self.text) for _ in prompts]

    right = NeedleCase("video", 8, 0.25, 0, case.prompts, case.expected, case.questions)
    assert evaluate_needles(Says(case.expected[0].upper() + "."), [right]).rows[0]["score"] == 1
    assert evaluate_needles(Says("nothing"), [right]).rows[0]["score"] == 0


def test_needle_training_videos_report_round_trip_and_side_by_side(tmp_path, codec):
    import json

    from lwm.base.media import read_video
    from lwm.needle import NeedleReport, side_by_side, write_needle_videos

    video = dict(size=32, clip_frames=4, needle_frames=2, max_objects=1, needle_radius=(0.25, 0.3))
    manifest = write_needle_videos(tmp_path / "v", count=2, frames=8, seed=1000, **video)
    lines = [json.loads(x) for x in manifest.read_text().splitlines()]
    assert [x["video"] for x in lines] == ["videos/00000.mp4", "videos/00001.mp4"]
    for i, line in enumerate(lines):
        (turn,) = line["qa"]
        assert turn["question"] == "What appeared briefly?" and turn["category"] == "needle"
        depth = float(np.random.default_rng([1000 + i, 11]).uniform())
        frames, expected, _ = needle_video(8, depth, seed=1000 + i, **video)
        assert turn["answer"] == expected
        decoded = read_video(tmp_path / "v" / line["video"])
        assert decoded.shape == frames.shape
        assert np.abs(decoded.astype(int) - frames).max() <= 2  # lossless H.264 4:4:4
    # a needle of radius 0.25-0.3 of 32 px covers more than the default 0.12-0.16 allows
    big, expected, where = needle_video(8, 0.5, seed=3, **video)
    colour = expected.split()[1]
    from data.synthetic import PALETTE

    assert (big[where.start] == PALETTE[colour]).all(-1).sum() > np.pi * (0.16 * 32 + 1) ** 2

    cases = text_cases(codec, lengths=[300, 600], depths=[0.0, 1.0])
    report = evaluate_needles(Oracle(codec, reach=0.7), cases)
    report.write_jsonl(tmp_path / "r.jsonl")
    again = NeedleReport.read_jsonl(tmp_path / "r.jsonl")
    assert again.kind == report.kind and again.rows == report.rows
    side_by_side(tmp_path / "both.png", [(report, "before"), (again, "after")])
    assert (tmp_path / "both.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
