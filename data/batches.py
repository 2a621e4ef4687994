"""Training batches: the fields the training step reads, and the loader protocol.

A loader yields this host's share of each global batch as a dict of numpy arrays
``[local_batch, seq_len]`` with exactly the fields of `BATCH_FIELDS`, already in the model's
sequence layout (zigzag when the model uses ring attention). Targets are made in the original
token order first (`make_training_batch`), so "next token" never crosses a document, whatever
the layout. A loader's position is a JSON-serialisable dict (`state()` / `restore(state)`),
saved with every checkpoint, so a resumed run sees exactly the batches it would have seen.

Segment ids say which keys a query sees (`segments_see`; every attention kernel masks by it):
plain ids (documents 1, 2, .. of a row; 0 is padding) see equal ids only. Ids made by
`turn_segment_ids` (``TURN_FLAG | document << TURN_BITS | turn``) also let every turn of a
document see its turn 0: a QA record's video is seen by each question, and no question sees
another (``data.qa_turns: isolated``, `data.tokens.record_turns`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np

from data.tokens import EOV_ID, NUM_CODES, frame_cells, frame_window

BATCH_FIELDS: dict[str, Any] = {
    "tokens": np.int32,
    "vision_mask": np.bool_,
    "positions": np.int32,
    "segment_ids": np.int32,
    "frame_cells": np.int32,  # each vision code's cell in its frame, -1 elsewhere
    "target_tokens": np.int32,
    "target_is_vision": np.bool_,
    "target_weight": np.float32,
}
# Only for a model with `model.vision_window` (``[batch, seq, K]``, `data.tokens.frame_window`).
WINDOW_FIELD = "frame_window"
# The code grid and window radius of such a model (`ModelConfig.vision_grid`, `.vision_window`).
WindowSpec = tuple[tuple[int, int], int]


# How the turns of a QA record see each other in training (`data.qa_turns`, the loader's
# ``qa_turns``): ``chained``, each turn after the ones before it (LWM's records); ``isolated``,
# each turn sees only the record's start (BOS, the video) and itself (`turn_segment_ids`);
# ``mixed``, each epoch a drawn share of the records chained and the rest isolated.
QA_TURNS = ("chained", "isolated", "mixed")
# The share of records ``mixed`` chains each epoch by default: at 0.1 the longer setting's model
# answers as well in conversation as asked alone (96%) and binds shapes; at 0.25 it learned
# shapes by elimination (docs/notebook.md, "A tenth of the records chained").
QA_CHAINED_SHARE = 0.1
# Segment ids with turns (`turn_segment_ids`): bit 30 set, the document above TURN_BITS bits
# of turn; plain ids (small non-negative documents, negative padding) never have it.
TURN_FLAG = 1 << 30
TURN_BITS = 8
MAX_TURNS = (1 << TURN_BITS) - 1
MAX_TURN_DOCUMENTS = 1 << (30 - TURN_BITS)


def turn_segment_ids(document: Any, turn: Any, xp: Any = np) -> Any:
    """Segment ids of ``turn`` (0 .. `MAX_TURNS`) of ``document`` (1 .. `MAX_TURN_DOCUMENTS`
    - 1): equal ids see each other, and turn 0 is seen by every turn of its document."""
    document, turn = xp.asarray(document, xp.int32), xp.asarray(turn, xp.int32)
    return TURN_FLAG | (document << TURN_BITS) | turn


def segments_see(q_seg: Any, kv_seg: Any) -> Any:
    """Whether queries of segment ``q_seg`` see keys of segment ``kv_seg`` (broadcasting):
    equal ids, or a key of turn 0 of the query's document (`turn_segment_ids`)."""
    prefix = (kv_seg >= TURN_FLAG) & ((kv_seg & MAX_TURNS) == 0)
    return (q_seg == kv_seg) | (prefix & ((q_seg >> TURN_BITS) == (kv_seg >> TURN_BITS)))


def segment_documents(seg: Any, xp: Any = np) -> Any:
    """Each segment id's document key: ids that can see each other (`segments_see`) have the
    same key (ids without turns are their own key), so disjoint ranges of keys see nothing."""
    return xp.where(seg >= TURN_FLAG, seg >> TURN_BITS, seg)


class Targets(NamedTuple):
    tokens: Any  # [batch, seq] int32: the token to predict at each position
    is_vision: Any  # [batch, seq] bool: the target is a vision token
    weight: Any  # [batch, seq] float32: 1 where the position is trained, else 0


def next_token_targets(
    tokens,
    vision_mask,
    loss_mask,
    segment_ids=None,
    *,
    xp: Any = np,
) -> Targets:
    """Targets for every position of ``[batch, seq]`` streams in their original order.

    The target of position t is token t+1 when t+1 is trained (``loss_mask``) and, given
    segment ids, t+1 sees t (`segments_see`: the same document, and with turns the same turn
    or t in turn 0); segment id 0 is padding and never has a target.
    ``xp`` is ``numpy`` (the data loaders build targets on the host) or ``jax.numpy``.
    """

    def shift(x, fill):
        return xp.concatenate([x[:, 1:], xp.full_like(x[:, :1], fill)], axis=1)

    weight = shift(xp.asarray(loss_mask, xp.float32), 0.0)
    if segment_ids is not None:
        same_doc = segments_see(shift(segment_ids, -1), segment_ids) & (segment_ids != 0)
        weight = weight * same_doc.astype(xp.float32)
    return Targets(
        tokens=shift(xp.asarray(tokens, xp.int32), 0),
        is_vision=shift(xp.asarray(vision_mask, bool), False),
        weight=weight,
    )


class Loader(Protocol):
    """What the training loop needs from a data source. A loader may also say how far back
    any query of the whole batch it last gave looks, the same on every host
    (``last_look_back() -> int``): with many processes `lwm train` compiles its step for it."""

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]: ...

    def __next__(self) -> dict[str, np.ndarray]: ...

    def state(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Stop any reading ahead (threads, processes)."""
        ...


def make_training_batch(
    tokens: np.ndarray,
    vision_mask: np.ndarray,
    loss_mask: np.ndarray,
    segment_ids: np.ndarray,
    positions: np.ndarray,
    layout: np.ndarray | None = None,
    cells: np.ndarray | None = None,
    window: np.ndarray | WindowSpec | None = None,
) -> dict[str, np.ndarray]:
    """Targets from ``[batch, seq]`` streams in document order (`next_token_targets`: never
    across a segment boundary, none from padding segment 0), then the sequence layout.
    ``cells``: `data.tokens.frame_cells` of each document (computed from the rows when not
    given; pass them for rows that start inside a frame of a document split across rows).
    ``window``: `data.tokens.frame_window` of each document, or the `WindowSpec` to compute
    it from the rows with; None: no `WINDOW_FIELD`."""
    targets = next_token_targets(tokens, vision_mask, loss_mask, segment_ids, xp=np)
    batch = {
        "tokens": tokens,
        "vision_mask": vision_mask,
        "positions": positions,
        "segment_ids": segment_ids,
        "frame_cells": frame_cells(tokens, vision_mask) if cells is None else cells,
        "target_tokens": targets.tokens,
        "target_is_vision": targets.is_vision,
        "target_weight": targets.weight,
    }
    if window is not None:
        if isinstance(window, tuple):
            window = frame_window(tokens, vision_mask, *window, cells=batch["frame_cells"])
        batch[WINDOW_FIELD] = window
    if layout is not None:
        batch = {k: v[:, layout] for k, v in batch.items()}
    return {
        k: np.ascontiguousarray(v, dtype=BATCH_FIELDS.get(k, np.int32)) for k, v in batch.items()
    }


class SyntheticTokenLoader:
    """Deterministic token streams for smoke tests, benchmarks and the training tests.

    Each row packs documents made of a text span and a short "video" (vision codes with
    ``<eof>``/``<eov>``), drawn from a small set of repeated patterns so a model can learn them
    and its loss falls. Batch ``i`` depends only on ``(seed, i)``; each host builds only its
    own rows (``process_index`` of ``process_count``).
    """

    def __init__(
        self,
        *,
        batch_size: int,
        seq_len: int,
        text_vocab_size: int,
        seed: int = 0,
        vision_codes: int = NUM_CODES,
        patterns: int = 8,
        process_index: int = 0,
        process_count: int = 1,
        layout: np.ndarray | None = None,
        window: WindowSpec | None = None,
    ):
        if batch_size % process_count:
            raise ValueError(
                f"batch size {batch_size} is not divisible by the {process_count} processes"
            )
        self.batch_size, self.seq_len = batch_size, seq_len
        self.local_rows = batch_size // process_count
        self.first_row = process_index * self.local_rows
        self.text_vocab_size, self.vision_codes = text_vocab_size, vision_codes
        self.seed, self.layout, self.window = seed, layout, window
        rng = np.random.default_rng(seed)
        self._patterns = [
            (
                rng.integers(3, text_vocab_size, rng.integers(4, 12)),
                rng.integers(0, min(vision_codes, 512), rng.integers(6, 20)),
            )
            for _ in range(patterns)
        ]
        self.step = 0

    def state(self) -> dict[str, Any]:
        return {"kind": "synthetic", "step": self.step, "seed": self.seed}

    def last_look_back(self) -> int:
        """How far back, counting itself, any query of any batch looks over every host's rows
        (`lwm.attention.look_back`), at most: the longest document of the patterns, or the
        row. The same on every host (`lwm train` with many processes compiles its step for
        it)."""
        return min(self.seq_len, max(len(t) + len(c) + 1 for t, c in self._patterns))

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "synthetic" or state.get("seed") != self.seed:
            raise ValueError(f"loader state {state} does not belong to this synthetic loader")
        self.step = int(state["step"])

    def close(self) -> None:  # nothing is read ahead
        pass

    def __iter__(self) -> SyntheticTokenLoader:
        return self

    def _row(self, rng: np.random.Generator):
        tokens, vision, seg, pos = [], [], [], []
        doc = 0
        while len(tokens) < self.seq_len:
            doc += 1
            text, codes = self._patterns[rng.integers(len(self._patterns))]
            frames = np.concatenate([codes, [EOV_ID]])  # one short frame, then <eov>
            span = list(text) + list(frames)
            tokens += span
            vision += [False] * len(text) + [True] * len(frames)
            seg += [doc] * len(span)
            pos += list(range(len(span)))
        cut = slice(0, self.seq_len)
        return tokens[cut], vision[cut], seg[cut], pos[cut]

    def __next__(self) -> dict[str, np.ndarray]:
        rows = []
        for r in range(self.first_row, self.first_row + self.local_rows):
            rng = np.random.default_rng((self.seed, self.step, r))
            rows.append(self._row(rng))
        self.step += 1
        tokens, vision, seg, pos = (np.asarray(x) for x in zip(*rows, strict=True))
        return make_training_batch(
            tokens,
            vision,
            np.ones_like(tokens, np.float32),
            seg,
            pos,
            self.layout,
            None,
            self.window,
        )
