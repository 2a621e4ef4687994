"""Needle-in-a-haystack evaluations, as LWM's ``run_eval_needle`` / ``run_eval_needle_multi``
and a video needle, scored on a grid of context lengths x depths.

- **text**: LWM's needle, ``The special magic {city} number is: {7 digits}.``, inserted at a
  sentence boundary at ``depth`` (0 = start, 1 = end) of a haystack of about ``length`` tokens
  (sentences of a text file, by default ``lwm/haystack.txt`` which ships with the package,
  repeated from a sample-dependent sentence as often as needed); the model is asked ``What is
  the special magic {city} number?`` and is right when the number is in its greedy answer.
- **multi**: ``needles`` such needles (distinct cities and numbers), the first at ``depth`` and
  the others at depths drawn per sample; ``asked`` of them are asked, one prompt each; the
  sample's score is the share of asked numbers found.
- **video**: a long video of ``length`` frames made of synthetic clips (`data.synthetic`, no
  needles of their own), with one needle (a shape in a colour no shape of the video has) drawn
  for ``needle_frames`` frames starting at ``depth``; asked ``What appeared briefly?`` as the
  synthetic QA asks it, and right when the answer is ``a {colour} {shape}``.

Prompts are the ones the model was trained with (`data.tokens`): ``BOS haystack USER: question
ASSISTANT:`` for text, ``BOS <vision> codes </vision> USER: question ASSISTANT:`` for video;
answers come from `lwm.vision_qa.VideoQA.answer_prompts` (greedy, stop at EOS). LWM's
``eval_needle.py`` asks its own chat models otherwise: ``"You are a helpful assistant. USER:
{context} {question} Don't give information outside the document or repeat your findings. Keep
your response short and direct. ASSISTANT: "``, so scores of LWM's weights here are not those
of its script.

    report = evaluate_needles(qa, text_cases(codec, lengths=[1000, 4000], depths=[0, .5, 1]))
    report.write_jsonl("needle.jsonl"); report.heatmap("needle.png", title="...")
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data.tokens import TextCodec, qa_prompt, qa_prompt_streams
from lwm.base.metrics import percent

__all__ = [
    "CITIES",
    "DEFAULT_HAYSTACK",
    "Haystack",
    "NeedleCase",
    "NeedleReport",
    "evaluate_needles",
    "needle_video",
    "side_by_side",
    "shortest_text_prompt",
    "text_cases",
    "video_cases",
    "write_needle_videos",
]

DEFAULT_HAYSTACK = Path(__file__).with_name("haystack.txt")
NEEDLE = "The special magic {city} number is: {number}."
QUESTION = "What is the special magic {city} number?"
VIDEO_QUESTION = "What appeared briefly?"
CITIES = (
    "Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hanoi", "Perth", "Dakar", "Lima",
    "Oslo", "Tbilisi", "Accra", "Havana", "Bergen", "Cusco", "Porto", "Kyoto", "Split",
    "Ghent", "Malmo", "Turin", "Lyon", "Krakow", "Izmir", "Tunis", "Recife", "Hobart",
    "Sapporo", "Dundee", "Bilbao",
)  # fmt: skip


@dataclass
class NeedleCase:
    """One sample of one grid cell: its prompts and what each answer must contain."""

    kind: str  # "text", "multi" or "video"
    length: int  # the cell's length: haystack tokens (text, multi) or frames (video)
    depth: float  # the cell's depth of the (first) needle
    sample: int
    prompts: list[tuple[np.ndarray, np.ndarray]]  # (tokens, vision_mask), one per question
    expected: list[str]  # per prompt: the number (text) or the answer (video)
    questions: list[str]
    info: dict[str, Any] = field(default_factory=dict)  # actual depths, prompt tokens, ...


class Haystack:
    """Sentences of a text, tokenized once, laid end to end to any length."""

    def __init__(self, codec: TextCodec, text: str, name: str = "haystack"):
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]
        if not sentences:
            raise ValueError(f"{name}: no text to build a haystack from")
        self.codec, self.name = codec, name
        self.sentences = [codec.encode(" " + s) for s in sentences]

    @classmethod
    def from_file(cls, codec: TextCodec, path: str | Path | None = None) -> Haystack:
        path = Path(path) if path is not None else DEFAULT_HAYSTACK
        if not path.is_file():
            raise FileNotFoundError(f"haystack file '{path}' not found")
        return cls(codec, path.read_text(errors="replace"), name=str(path))

    def build(
        self, length: int, needles: Sequence[tuple[float, list[int]]], start: int = 0
    ) -> tuple[list[int], list[float]]:
        """About ``length`` tokens: whole sentences from sentence ``start`` on (cycling), with
        each needle ``(depth, ids)`` inserted at the sentence boundary nearest to ``depth`` of
        the haystack. Returns the tokens and each needle's actual depth (the share of the
        haystack's tokens before it), in the order given."""
        budget = length - sum(len(ids) for _, ids in needles)
        if budget <= 0:
            raise ValueError(f"a haystack of {length} tokens cannot hold the needles")
        pieces: list[list[int]] = []
        total, i = 0, start
        while total < budget:
            sentence = self.sentences[i % len(self.sentences)]
            if total + len(sentence) > budget:
                break  # whole sentences only: never longer than asked
            pieces.append(sentence)
            total += len(sentence)
            i += 1
        bounds = np.cumsum([0] + [len(p) for p in pieces])  # token offset of each boundary
        where = [int(np.abs(bounds - d * total).argmin()) for d, _ in needles]
        tokens: list[int] = []
        for b, piece in enumerate([*pieces, []]):
            for k, (_, ids) in enumerate(needles):
                if where[k] == b:
                    tokens += ids
            tokens += piece
        actual = [float(bounds[w] / max(total, 1)) for w in where]
        return tokens, actual


def _number(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def shortest_text_prompt(codec: TextCodec, needles: int = 1) -> int:
    """The shortest prompt (in tokens) that holds the question and ``needles`` needles
    whatever cities and numbers are drawn: the longest question, the longest needles, each
    number counted as a token per character (and one for the space before it), which no
    tokenizer of bytes exceeds."""
    bos = 0 if codec.bos_id is None else 1
    tail = max(len(codec.encode(" " + qa_prompt(QUESTION.format(city=c)))) for c in CITIES)
    number = 1 + len(_number(np.random.default_rng(0)))
    longest = sorted(
        (len(codec.encode(" " + NEEDLE.format(city=c, number=""))) + number for c in CITIES),
        reverse=True,
    )
    return bos + tail + sum(longest[:needles]) + 1


def check_grid(lengths: Sequence[int], depths: Sequence[float]) -> None:
    """A `ValueError` unless every length is positive and every depth in [0, 1] (a depth past
    1 put the needle at the end, labelled with the depth asked)."""
    if not lengths or min(lengths) < 1:
        raise ValueError("lengths must be positive")
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad or not depths:
        raise ValueError(f"depth {bad[0]} is not in [0, 1]" if bad else "no depths given")


def text_cases(
    codec: TextCodec,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int = 1,
    needles: int = 1,
    asked: int = 1,
    haystack: Haystack | None = None,
    seed: int = 0,
) -> Iterator[NeedleCase]:
    """The text (``needles == 1``) or multi-needle grid: ``samples`` cases per (length, depth);
    ``length`` counts the whole prompt's tokens. Checked when called, before any case is made:
    a length shorter than `shortest_text_prompt` is an error naming it."""
    check_grid(lengths, depths)
    if not 1 <= asked <= needles <= len(CITIES):
        raise ValueError(
            f"need 1 <= asked <= needles <= {len(CITIES)}, got {asked} asked of {needles}"
        )
    least = shortest_text_prompt(codec, needles)
    if min(lengths) < least:
        raise ValueError(
            f"a prompt of {min(lengths)} tokens cannot hold the question and the needles "
            f"whichever are drawn; give lengths of at least {least}"
        )
    return _text_cases(codec, lengths, depths, samples, needles, asked, haystack, seed)


def _text_cases(codec, lengths, depths, samples, needles, asked, haystack, seed):
    haystack = haystack or Haystack.from_file(codec)
    bos = [] if codec.bos_id is None else [codec.bos_id]
    for length in lengths:
        for depth in depths:
            for sample in range(samples):
                rng = np.random.default_rng([seed, length, round(depth * 1000), sample])
                cities = [CITIES[i] for i in rng.permutation(len(CITIES))[:needles]]
                numbers = [_number(rng) for _ in cities]
                spots = [float(depth)] + [float(d) for d in rng.uniform(0, 1, needles - 1)]
                ids = [
                    codec.encode(" " + NEEDLE.format(city=c, number=n))
                    for c, n in zip(cities, numbers, strict=True)
                ]
                ask = [0] + [int(i) for i in 1 + rng.permutation(needles - 1)[: asked - 1]]
                questions = [QUESTION.format(city=cities[k]) for k in ask]
                tails = [codec.encode(" " + qa_prompt(q)) for q in questions]
                fixed = len(bos) + max(len(t) for t in tails) + sum(len(x) for x in ids)
                if length <= fixed:  # `shortest_text_prompt` bounds it, for tokenizers of bytes
                    raise ValueError(
                        f"a prompt of {length} tokens cannot hold the question and the needles "
                        f"({fixed} tokens); give lengths of more than {fixed}"
                    )
                room = length - len(bos) - max(len(t) for t in tails)
                start = int(rng.integers(len(haystack.sentences)))
                body, actual = haystack.build(room, list(zip(spots, ids, strict=True)), start)
                prompts = []
                for tail in tails:
                    tokens = np.asarray(bos + body + tail, np.int32)
                    prompts.append((tokens, np.zeros(len(tokens), bool)))
                yield NeedleCase(
                    kind="text" if needles == 1 else "multi",
                    length=length,
                    depth=float(depth),
                    sample=sample,
                    prompts=prompts,
                    expected=[numbers[k] for k in ask],
                    questions=questions,
                    info={
                        "prompt_tokens": len(prompts[0][0]),
                        "needle_depths": [actual[k] for k in ask],
                    },
                )


def check_needle_colours(colours: Sequence[str] | None) -> None:
    """`needle_video`'s ``needle_colours``: None, or some (not all) of the world's colours;
    a ValueError saying which rule they break otherwise."""
    from data.synthetic import PALETTE

    if colours is None:
        return
    unknown = sorted(set(colours) - set(PALETTE))
    if unknown:
        raise ValueError(f"unknown colour {unknown[0]!r} (known: {', '.join(PALETTE)})")
    if not colours:
        raise ValueError("no colour given")
    if len(set(colours)) == len(PALETTE):
        raise ValueError("the haystack needs a colour that is not a needle's")


def needle_video(
    frames: int,
    depth: float,
    *,
    seed: int = 0,
    size: int = 32,
    clip_frames: int = 4,
    needle_frames: int = 1,
    needle_radius: tuple[float, float] | None = None,
    needle_colours: Sequence[str] | None = None,
    **world: Any,
) -> tuple[np.ndarray, str, range]:
    """A long video: ``frames`` frames of consecutive synthetic clips of ``seed`` (without
    needles of their own), and one needle (a shape in a colour that no shape of the video has)
    in frames ``[start, start + needle_frames)``, ``start`` at ``depth`` of the video. Returns
    uint8 frames ``[frames, size, size, 3]``, the expected answer and the needle's frames.
    ``world``: `data.synthetic.sample_video`'s ``max_objects``, ``radius``, ``travel``;
    ``needle_radius``: the needle's radius range (default: the shapes' ``radius``);
    ``needle_colours``: the needle's colour is drawn from these, and no shape of the haystack
    has any of them (default: any colour, which the haystack then avoids), so that finding the
    needle is looking for a colour known beforehand rather than for the one that is rare."""
    from data.synthetic import DEMO_WORLD, PALETTE, SHAPES, render_video, sample_video, shape_mask
    from data.synthetic import with_article as article

    if not 1 <= needle_frames <= frames:
        raise ValueError(f"a needle of {needle_frames} frames does not fit in {frames} frames")
    try:
        check_needle_colours(needle_colours)
    except ValueError as e:
        raise ValueError(f"needle colours: {e}") from None
    rng = np.random.default_rng([seed, frames, round(depth * 1000), 7])
    colour = str(rng.choice(sorted(needle_colours or PALETTE)))
    avoid = set(needle_colours or [colour])
    shape = str(rng.choice(SHAPES))
    parts, index = [], 0
    while sum(len(p) for p in parts) < frames:
        spec = sample_video(
            seed, index, size=size, num_frames=clip_frames, needle_prob=0.0, **world
        )
        index += 1
        if all(o.colour not in avoid for o in spec.objects):
            parts.append(render_video(spec))
        if index > 100 * frames:
            raise ValueError(f"no clips of seed {seed} avoid the colours {sorted(avoid)}")
    video = np.concatenate(parts)[:frames].copy()
    lo, hi = needle_radius or world.get("radius", DEMO_WORLD["radius"])
    radius = float(rng.uniform(lo, hi)) * size
    margin = 1.3 * radius + 1
    x, y = (float(v) for v in rng.uniform(margin, size - margin, 2))
    start = round(depth * (frames - needle_frames))
    mask = shape_mask(shape, x, y, radius, size)
    for t in range(start, start + needle_frames):
        video[t][mask] = PALETTE[colour]
    return video, f"{article(colour)} {shape}", range(start, start + needle_frames)


def write_needle_videos(
    out: str | Path,
    *,
    count: int,
    frames: int,
    seed: int,
    fps: int = 4,
    progress: bool = False,
    **video: Any,
) -> Path:
    """Training data for video needle retrieval: ``count`` MP4s of `needle_video` (``video``:
    its options) under ``OUT/videos``, video ``i`` made from clips of seed ``seed + i`` with its
    needle at a depth drawn uniformly, and ``OUT/manifest.jsonl`` asking each what appeared
    briefly (category ``needle``), the input of `lwm tokenize`. Seeds at or above 1,000 never
    meet `video_cases`' (``seed * 1000 + sample``, for small seeds and samples)."""
    from lwm.base.files import write_jsonl
    from lwm.base.media import LOSSLESS, write_mp4

    out = Path(out)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    lines = []
    indices: Any = range(count)
    if progress:
        from tqdm import tqdm

        indices = tqdm(indices, desc="needle videos", unit="video")
    for i in indices:
        depth = float(np.random.default_rng([seed + i, 11]).uniform())
        clip, expected, _ = needle_video(frames, depth, seed=seed + i, **video)
        rel = f"videos/{i:05d}.mp4"
        write_mp4(out / rel, clip, fps=fps, **LOSSLESS)
        turn = {"question": VIDEO_QUESTION, "answer": expected, "category": "needle"}
        lines.append({"video": rel, "qa": [turn]})
    write_jsonl(out / "manifest.jsonl", lines)
    return out / "manifest.jsonl"


def video_cases(
    codec: TextCodec,
    vqgan: Any,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int = 1,
    seed: int = 0,
    **video: Any,
) -> Iterator[NeedleCase]:
    """The video grid: ``samples`` long videos per (frames, depth), each encoded with ``vqgan``
    and asked what appeared briefly; ``video``: `needle_video`'s options. The grid is checked
    when called (`check_grid`)."""
    check_grid(lengths, depths)
    return _video_cases(codec, vqgan, lengths, depths, samples, seed, video)


def _video_cases(codec, vqgan, lengths, depths, samples, seed, video):
    for length in lengths:
        for depth in depths:
            for sample in range(samples):
                frames, expected, where = needle_video(
                    length, depth, seed=seed * 1000 + sample, **video
                )
                codes = np.asarray(vqgan.encode(frames[None]))[0]
                tokens, vision = qa_prompt_streams(codec, codes, VIDEO_QUESTION)
                yield NeedleCase(
                    kind="video",
                    length=length,
                    depth=float(depth),
                    sample=sample,
                    prompts=[(tokens, vision)],
                    expected=[expected],
                    questions=[VIDEO_QUESTION],
                    info={"prompt_tokens": len(tokens), "needle_frames": [where.start, where.stop]},
                )


def _right(kind: str, answer: str, expected: str) -> bool:
    if kind == "video":
        from lwm.qa_eval import normalise

        return normalise(answer) == normalise(expected)
    return expected in answer  # LWM's substring score


@dataclass
class NeedleReport:
    """Every answer (``rows``) and the accuracy of each grid cell."""

    kind: str
    rows: list[dict[str, Any]]

    def grid(self) -> tuple[list[int], list[float], np.ndarray]:
        """(lengths, depths, accuracy [depths, lengths]): the mean score of each cell."""
        lengths = sorted({r["length"] for r in self.rows})
        depths = sorted({r["depth"] for r in self.rows})
        acc = np.full((len(depths), len(lengths)), np.nan)
        for i, d in enumerate(depths):
            for j, n in enumerate(lengths):
                scores = [r["score"] for r in self.rows if r["depth"] == d and r["length"] == n]
                if scores:
                    acc[i, j] = float(np.mean(scores))
        return lengths, depths, acc

    def summary(self) -> dict[str, Any]:
        lengths, depths, acc = self.grid()
        return {
            "kind": self.kind,
            "lengths": lengths,
            "depths": depths,
            "accuracy": [[None if np.isnan(v) else round(float(v), 4) for v in row] for row in acc],
            "mean": float(np.nanmean(acc)) if np.isfinite(acc).any() else None,
            "cases": len({(r["length"], r["depth"], r["sample"]) for r in self.rows}),
            "questions": len(self.rows),  # a multi-needle case asks ``asked`` of them
        }

    def write_jsonl(self, path: str | Path) -> None:
        from lwm.base.files import write_jsonl

        write_jsonl(path, [*self.rows, {"summary": self.summary()}])

    @classmethod
    def read_jsonl(cls, path: str | Path) -> NeedleReport:
        """The report `write_jsonl` wrote."""
        import json

        rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
        rows = [r for r in rows if "summary" not in r]
        return cls(rows[0]["kind"] if rows else "", rows)

    def table(self) -> str:
        """Accuracy per depth (rows) and length (columns), as text."""
        lengths, depths, acc = self.grid()
        unit = "frames" if self.kind == "video" else "tokens"
        head = f"{'depth':>6} | " + " ".join(f"{n:>8}" for n in lengths) + f"   ({unit})"
        lines = [head, "-" * len(head)]
        for d, row in zip(depths, acc, strict=True):
            cells = " ".join("       -" if np.isnan(v) else f"{percent(v):7}%" for v in row)
            lines.append(f"{100 * d:5.0f}% | {cells}")
        return "\n".join(lines)

    def heatmap(self, path: str | Path, *, title: str) -> None:
        """LWM's layout: length on x, depth on y, accuracy as colour (red 0 to green 1)."""
        side_by_side(path, [(self, title)])


def side_by_side(path: str | Path, panels: Sequence[tuple[NeedleReport, str]]) -> None:
    """One PNG of the reports' heatmaps next to each other (LWM's layout, one colour scale),
    each under its own title: e.g. a model before and after a context-extension stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap

    from lwm.base.files import atomic_path

    cmap = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])
    grids = [report.grid() for report, _ in panels]
    widths = [max(5.5, 1.6 + 0.9 * len(lengths)) for lengths, _, _ in grids]
    rows = max(len(depths) for _, depths, _ in grids)
    fig, axes = plt.subplots(
        1, len(panels), figsize=(sum(widths), 1.8 + 0.45 * rows), squeeze=False
    )
    for ax, (report, title), (lengths, depths, acc), width in zip(
        axes[0], panels, grids, widths, strict=True
    ):
        image = ax.imshow(acc, cmap=cmap, vmin=0, vmax=1, aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not np.isnan(acc[i, j]):
                    ax.text(j, i, f"{percent(acc[i, j])}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
        ax.set_xlabel("frames" if report.kind == "video" else "context length (tokens)")
        ax.set_ylabel("needle depth")
        lines = [textwrap.fill(line, width=int(11 * width)) for line in title.splitlines()]
        ax.set_title("\n".join(lines), fontsize=8)
        fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def evaluate_needles(qa: Any, cases: Iterable[NeedleCase], log=None) -> NeedleReport:
    """Answer every case's prompts with ``qa`` (a `lwm.vision_qa.VideoQA`), a batch of
    ``qa.batch_size`` prompts at a time, and score them."""
    log = log or (lambda _: None)
    rows: list[dict[str, Any]] = []
    kind = ""
    batch: list[tuple[NeedleCase, int]] = []

    def flush() -> None:
        answers = qa.answer_prompts([c.prompts[k] for c, k in batch])
        for (case, k), answer in zip(batch, answers, strict=True):
            rows.append(
                {
                    "kind": case.kind,
                    "length": case.length,
                    "depth": case.depth,
                    "sample": case.sample,
                    "question": case.questions[k],
                    "expected": case.expected[k],
                    "answer": answer.text,
                    "cut": answer.cut,
                    "score": float(_right(case.kind, answer.text, case.expected[k])),
                    **case.info,
                }
            )
        batch.clear()

    for case in cases:
        kind = case.kind
        if batch and batch[0][0].length != case.length:
            flush()  # one cell length per batch: short prompts are not padded to long ones
        for k in range(len(case.prompts)):
            batch.append((case, k))
            if len(batch) == qa.batch_size:
                flush()
        log(
            f"{case.kind} needle: length {case.length}, depth {case.depth:.2f}, sample {case.sample}"
        )
    if batch:
        flush()
    return NeedleReport(kind, rows)
