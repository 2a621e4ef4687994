"""Question-answering evaluation that cannot be fooled by a model that never looks at the video.

Every question of a QA manifest (``{"video": P, "qa": [{"question", "answer", "category"?}]}``
lines, as `lwm tokenize` reads them) is scored by exact match (case, surrounding space and a
final full stop ignored) under three conditions, per category and overall:

- ``model``: the model answers the question about its own video;
- ``swapped``: the model answers the same question about another video of the set (each
  distinct video is replaced by the next one, cyclically), and is scored against the answers of
  the original video. A model that uses the video falls towards the blind baseline here; one
  that ignores the video scores as it does with the right video;
- ``blind``: no model and no video: the most frequent answer the same question text has in a
  training manifest (ties: the answer seen first there); a question never seen there gets the
  most frequent answer of its category, then of the whole manifest.

An answer that did not end (no stop token within the generation budget) is marked ``cut`` and
scored wrong whatever its text. Questions without a category are in ``other``.

    questions = read_questions("held_out/manifest.jsonl")
    report = evaluate(questions, answer_fn, blind=BlindBaseline.from_manifest("train/manifest.jsonl"))
    print(report.table())
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data.manifest import read_inputs
from lwm.base.files import write_jsonl
from lwm.base.metrics import percent

__all__ = [
    "Answer",
    "BlindBaseline",
    "QAReport",
    "Question",
    "evaluate",
    "normalise",
    "read_questions",
    "swap_videos",
]

CONDITIONS = ("model", "swapped", "blind")
OTHER = "other"


@dataclass(frozen=True)
class Question:
    video: str
    question: str
    answer: str  # the expected answer
    category: str = OTHER


@dataclass(frozen=True)
class Answer:
    text: str
    cut: bool = False  # generation stopped at its budget, not at a stop token


AnswerFn = Callable[[Sequence[tuple[str, str]]], list[Answer]]


def normalise(text: str) -> str:
    """The form answers are compared in: lower case, single spaces, no final full stop."""
    return " ".join(text.lower().split()).rstrip(".").strip()


def read_questions(manifest: str | os.PathLike) -> list[Question]:
    """Every QA turn of a manifest's video (or image) lines, in manifest order."""
    questions = [
        Question(item.path, turn[0], turn[1], (turn[2] if len(turn) > 2 else None) or OTHER)
        for item in read_inputs(manifest)
        if item.qa and item.path is not None
        for turn in item.qa
    ]
    if not questions:
        raise ValueError(f"manifest '{manifest}' has no questions (no line with a 'qa' list)")
    return questions


class BlindBaseline:
    """The best a model that never sees the video can do from a training manifest's answers
    (module docstring)."""

    def __init__(self, questions: Sequence[Question], source: str = "<questions>"):
        if not questions:
            raise ValueError(f"blind baseline: '{source}' has no questions")
        self.source = source
        self._by_text = self._most_frequent((q.question, q.answer) for q in questions)
        self._by_category = self._most_frequent((q.category, q.answer) for q in questions)
        self._overall = self._most_frequent(("", q.answer) for q in questions)[""]

    @classmethod
    def from_manifest(cls, manifest: str | os.PathLike) -> BlindBaseline:
        return cls(read_questions(manifest), str(manifest))

    @staticmethod
    def _most_frequent(pairs) -> dict[str, str]:
        counts: dict[str, Counter] = defaultdict(Counter)
        for key, answer in pairs:
            counts[key][normalise(answer)] += 1
        # Counter.most_common keeps first-seen order among equal counts.
        return {key: c.most_common(1)[0][0] for key, c in counts.items()}

    def answer(self, question: Question) -> str:
        return self._by_text.get(
            question.question, self._by_category.get(question.category, self._overall)
        )


def swap_videos(videos: Sequence[str]) -> dict[str, str]:
    """Each distinct video (in order of first appearance) -> the next one, cyclically: no video
    maps to itself. Needs at least two distinct videos."""
    distinct = list(dict.fromkeys(videos))
    if len(distinct) < 2:
        raise ValueError("the video-swap ablation needs questions about at least two videos")
    return {v: distinct[(i + 1) % len(distinct)] for i, v in enumerate(distinct)}


@dataclass
class QAReport:
    """Per-question records and per-category scores of each condition that was run."""

    conditions: tuple[str, ...]
    records: list[dict[str, Any]] = field(default_factory=list)
    blind_source: str | None = None

    def scores(self) -> dict[str, dict[str, tuple[int, int]]]:
        """condition -> category (and ``all``) -> (correct, questions)."""
        out: dict[str, dict[str, list[int]]] = {
            c: defaultdict(lambda: [0, 0]) for c in self.conditions
        }
        for r in self.records:
            for key in (r["category"], "all"):
                cell = out[r["condition"]][key]
                cell[0] += int(r["correct"])
                cell[1] += 1
        return {c: {k: (v[0], v[1]) for k, v in cats.items()} for c, cats in out.items()}

    def accuracy(self, condition: str = "model", category: str = "all") -> float:
        correct, total = self.scores()[condition].get(category, (0, 0))
        return correct / total if total else 0.0

    def cut(self, condition: str = "model") -> int:
        return sum(r["cut"] for r in self.records if r["condition"] == condition)

    def summary(self) -> dict[str, Any]:
        """A JSON-serialisable summary: per condition and category correct, total, accuracy."""
        scores = self.scores()
        out: dict[str, Any] = {"summary": "qa"}
        for c in self.conditions:
            out[c] = {
                k: {"correct": a, "questions": n, "accuracy": round(a / n, 4)}
                for k, (a, n) in sorted(scores[c].items(), key=lambda kv: (kv[0] == "all", kv[0]))
            }
        out["cut"] = {c: self.cut(c) for c in self.conditions if c != "blind"}
        if self.blind_source is not None:
            out["blind_baseline"] = f"most frequent answer per question in {self.blind_source}"
        return out

    def table(self) -> str:
        """The per-category table (one column per condition) as text."""
        scores = self.scores()
        categories = sorted({k for s in scores.values() for k in s if k != "all"}) + ["all"]
        width = max(len(c) for c in [*categories, "category"])
        head = f"{'category':<{width}}  " + "  ".join(f"{c:>14}" for c in self.conditions)
        lines = [head, "-" * len(head)]
        for cat in categories:
            cells = []
            for c in self.conditions:
                a, n = scores[c].get(cat, (0, 0))
                cells.append(f"{a:>4}/{n:<4} {percent(a / n) if n else 0:>3}%")
            lines.append(f"{cat:<{width}}  " + "  ".join(f"{x:>14}" for x in cells))
        if self.blind_source is not None:
            lines.append(f"blind: most frequent answer per question in {self.blind_source}")
        cut = {c: self.cut(c) for c in self.conditions if c != "blind" and self.cut(c)}
        if cut:
            lines.append(
                "cut (no end within the token budget, scored wrong): "
                + ", ".join(f"{c} {n}" for c, n in cut.items())
            )
        return "\n".join(lines)

    @classmethod
    def read_jsonl(cls, path: str | os.PathLike) -> QAReport:
        """A report written by `write_jsonl` (e.g. ``OUTPUT/eval/qa-STEP.jsonl`` of `lwm train`)."""
        lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
        if not lines or lines[-1].get("summary") != "qa":
            raise ValueError(f"{path}: not a QA report (no summary line at the end)")
        records, summary = lines[:-1], lines[-1]
        conditions = tuple(c for c in ("model", "swapped", "blind") if c in summary)
        source = summary.get("blind_baseline")
        prefix = "most frequent answer per question in "
        if source is not None and source.startswith(prefix):
            source = source[len(prefix) :]
        return cls(conditions, records, source)

    def write_jsonl(self, path: str | os.PathLike) -> None:
        """Every record, then the summary, as JSON lines (written to a temporary name, then
        renamed)."""
        write_jsonl(path, [*self.records, self.summary()])


def evaluate(
    questions: Sequence[Question],
    answer_fn: AnswerFn | None,
    *,
    blind: BlindBaseline | None = None,
    swap: bool = True,
) -> QAReport:
    """Score ``questions`` under ``model`` and ``swapped`` (with ``answer_fn``, which answers
    ``(video, question)`` pairs) and ``blind`` (with ``blind``); a condition whose input is
    missing (or ``swap=False``) is left out."""
    conditions = tuple(
        c
        for c, on in zip(
            CONDITIONS,
            (answer_fn is not None, answer_fn is not None and swap, blind is not None),
            strict=True,
        )
        if on
    )
    if not conditions:
        raise ValueError("nothing to evaluate: give an answer function or a blind baseline")
    report = QAReport(conditions, blind_source=None if blind is None else blind.source)

    def record(condition: str, q: Question, shown: str, got: Answer) -> None:
        correct = not got.cut and normalise(got.text) == normalise(q.answer)
        report.records.append(
            {
                "condition": condition,
                "category": q.category,
                "video": q.video,
                "shown": shown,
                "question": q.question,
                "expected": q.answer,
                "answer": got.text,
                "cut": got.cut,
                "correct": correct,
            }
        )

    if answer_fn is not None:
        answers = answer_fn([(q.video, q.question) for q in questions])
        for q, a in zip(questions, answers, strict=True):
            record("model", q, q.video, a)
        if swap:
            other = swap_videos([q.video for q in questions])
            answers = answer_fn([(other[q.video], q.question) for q in questions])
            for q, a in zip(questions, answers, strict=True):
                record("swapped", q, other[q.video], a)
    if blind is not None:
        for q in questions:
            record("blind", q, "", Answer(blind.answer(q)))
    return report
