"""The inputs of `lwm tokenize`: a folder of videos or a JSONL manifest, as a list of `Item`.

A manifest has one JSON object per line:

    {"video": "clips/a.mp4", "text": "A red circle moving left."}          video + caption
    {"video": "clips/a.mp4", "qa": [{"question": "...", "answer": "..."}]}  video + questions
    {"image": "photos/b.png", "text": "..."}                                image (+ text/qa)
    {"video": "clips/c.mp4"}                                                video alone
    {"text": "Any text."}                                                   text only

A ``qa`` entry may also carry ``"category"`` (for `lwm eval qa`'s table) and ``"learn"``:
``false`` (the turn stays in the record as context but its answer is not trained on) or
``"alone"`` (its answer is trained on where the turn is asked alone, ``data.qa_turns:
isolated``, and not where it follows the earlier turns: `data.tokens.LOSS_ALONE`). Relative paths are
relative to the manifest's folder; every item's path is made absolute and normalised
(``os.path.abspath``: no ``..``), so a dataset's records name their sources alike from any working
directory. A folder means every file with a video
extension under it (recursively, sorted by path), each with the caption in a sidecar file of the
same name ending ``.txt`` (``a.mp4`` -> ``a.txt``) where there is one. The order of the items is
the order of the dataset. A malformed line is an error of the whole input (`ManifestError`); a
missing or unreadable video is a failure of that item only, reported when it is decoded.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from data.tokens import LEARN_ALONE

__all__ = ["VIDEO_SUFFIXES", "Item", "ManifestError", "QATurn", "read_inputs"]

VIDEO_SUFFIXES = (
    ".mp4",
    ".m4v",
    ".mov",
    ".mkv",
    ".webm",
    ".avi",
    ".mpg",
    ".mpeg",
    ".ts",
    ".flv",
    ".wmv",
    ".3gp",
    ".ogv",
)


class ManifestError(ValueError):
    """The input list itself is malformed; the message names the file and line."""


class QATurn(NamedTuple):
    """One question about an item, its answer, optionally its category (for scoring), and
    whether its answer is learned (``learn``; False: the turn is context only, its answer gets
    no loss; "alone": learned only where the turn is asked alone)."""

    question: str
    answer: str
    category: str | None = None
    learn: bool | str = True


@dataclass(frozen=True)
class Item:
    """One example to make. ``kind`` is "video", "image" or "text"."""

    kind: str
    path: str | None = None
    text: str | None = None
    qa: tuple[QATurn, ...] | None = None

    def qa_dicts(self) -> list[dict[str, Any]] | None:
        if self.qa is None:
            return None
        return [{"question": t.question, "answer": t.answer, "learn": t.learn} for t in self.qa]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def read_inputs(path: str | os.PathLike) -> list[Item]:
    """The items of a folder or a ``.jsonl`` manifest, in dataset order."""
    path = Path(path)
    if path.is_dir():
        return _folder_items(path)
    if not path.is_file():
        raise FileNotFoundError(f"input '{path}' not found (expected a folder or a .jsonl)")
    if path.suffix.lower() in VIDEO_SUFFIXES:  # one video: not read as a manifest
        raise ManifestError(
            f"input '{path}' is a video; give the folder of videos or a .jsonl manifest"
        )
    return _manifest_items(path)


def _folder_items(folder: Path) -> list[Item]:
    items = []
    for video in sorted(p for p in folder.rglob("*") if p.suffix.lower() in VIDEO_SUFFIXES):
        if not video.is_file() and not video.is_symlink():
            continue
        sidecar = video.with_suffix(".txt")
        caption = sidecar.read_text(encoding="utf-8").strip() if sidecar.is_file() else None
        items.append(Item("video", os.path.abspath(video), text=caption or None))
    if not items:
        raise ManifestError(f"folder '{folder}' has no videos ({', '.join(VIDEO_SUFFIXES)})")
    return items


def _manifest_items(path: Path) -> list[Item]:
    base = Path(os.path.abspath(path.parent))
    items = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"manifest '{path}' line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ManifestError(f"{where}: not valid JSON ({e.msg})") from None
            items.append(_item(row, base, where))
    if not items:
        raise ManifestError(f"manifest '{path}' has no lines")
    return items


def _item(row: Any, base: Path, where: str) -> Item:
    if not isinstance(row, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(row).__name__}")
    media = [k for k in ("video", "image") if k in row]
    if len(media) > 1:
        raise ManifestError(f"{where}: has both 'video' and 'image'")
    text, qa = row.get("text"), row.get("qa")
    if text is not None and not isinstance(text, str):
        raise ManifestError(f"{where}: 'text' must be a string")
    if text is not None and qa is not None:
        raise ManifestError(f"{where}: has both 'text' and 'qa'; make them two lines")
    pairs = None
    if qa is not None:
        if not isinstance(qa, list) or not qa:
            raise ManifestError(f"{where}: 'qa' must be a non-empty list")
        pairs = []
        for turn in qa:
            if not (
                isinstance(turn, dict)
                and isinstance(turn.get("question"), str)
                and isinstance(turn.get("answer"), str)
            ):
                raise ManifestError(
                    f"{where}: each 'qa' entry needs string 'question' and 'answer'"
                )
            category = turn.get("category")
            if category is not None and not isinstance(category, str):
                raise ManifestError(f"{where}: a 'qa' entry's 'category' must be a string")
            learn = turn.get("learn", True)
            if not (isinstance(learn, bool) or learn == LEARN_ALONE):
                raise ManifestError(
                    f"{where}: a 'qa' entry's 'learn' must be true, false or \"alone\""
                )
            pairs.append(QATurn(turn["question"], turn["answer"], category, learn))
        pairs = tuple(pairs)
    if not media:
        if text is None:
            raise ManifestError(f"{where}: needs 'video', 'image' or 'text'")
        if qa is not None:
            raise ManifestError(f"{where}: 'qa' needs a 'video' or an 'image'")
        return Item("text", None, text=text)
    kind = media[0]
    file = row[kind]
    if not isinstance(file, str) or not file:
        raise ManifestError(f"{where}: '{kind}' must be a path")
    return Item(kind, os.path.normpath(base / file), text=text, qa=pairs)
