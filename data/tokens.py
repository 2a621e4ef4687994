"""The token stream of one example: vision ids, text markers, and the layout of each record.

Vision ids (LWM's): codes ``0 .. 8191``, ``<eof>`` = 8192 after every frame but the last,
``<eov>`` = 8193 after the last frame; the vision vocabulary is padded to 8,448 entries. Text
ids come from a Hugging Face tokenizer and overlap the vision ids numerically: ``vision_mask``
says which table a position uses. ``<vision>`` / ``</vision>`` are text: the ids the text
tokenizer gives those strings (one id each with the project's tokenizer, several with LLaMA's).

A vision span of ``T`` frames of ``h x w`` codes (raster order) is::

    <vision>  c c .. c <eof>  c c .. c <eof>  ..  c c .. c <eov>  </vision>
              '-- h*w --'                         '-- h*w --'
    (T * (h*w + 1) positions with vision_mask True: the codes, every <eof> and the <eov>)

Records (``B`` = the tokenizer's BOS where it has one, added once at the start of the example,
never before the markers; ``E`` = its EOS where it has one; loss 1 = trained on):

============== ========================================================== ====================
record         tokens                                                     loss_mask = 1 on
============== ========================================================== ====================
video+caption  B <vision> V </vision> caption E                            everything but B
caption+video  B caption <vision> V </vision> E                            everything but B
video+QA       B <vision> V </vision> ("USER: q ASSISTANT:" " a" E) x n    each " a" and E (*)
image(+..)     as a video of one frame (caption, QA or neither)           as for the video
video, no text B <vision> V </vision> E                                   everything but B
text only      B text E                                                   everything but B
============== ========================================================== ====================

(*) except the answers of turns marked ``"learn": false`` (context only); the answers of turns
marked ``"learn": "alone"`` have loss_mask `LOSS_ALONE` (2): learned where the turn is asked
alone (``data.qa_turns: isolated``) and not where it follows the record's earlier turns
(``chained``, and the chained share of ``mixed``), because an earlier turn gives it away or
narrows it (`data.synthetic`). Every reader of ``loss_mask`` goes through `loss_weight`.

Caption-first records (``text_first=True``; `lwm tokenize --text-first-ratio`) teach the model
to continue a caption with its video: text-to-video generation prompts with
``B caption <vision>`` (`text_to_video_prompt_streams`).

A caption record trains on its video too (LWM trains on both the frames and the caption of
its video-text data); in a QA record the video and the questions are context (loss 0) and only
the answers (with the EOS that ends each) are learned. The QA prompt is `qa_prompt`, so
inference can build exactly the prompt the model was trained on.

Turns (`record_turns`): the start of a record up to its ``</vision>`` is turn 0, each
``"USER: q ASSISTANT:" " a" E`` after it turn 1, 2, ... Trained with isolated turns
(`data.batches.turn_segment_ids`, ``data.qa_turns: isolated``), each turn sees turn 0 and
itself, at the positions right after the video: every question is asked as `lwm ask` asks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "EOF_ID",
    "EOV_ID",
    "LEARN_ALONE",
    "LOSS_ALONE",
    "NUM_CODES",
    "VISION_END",
    "VISION_START",
    "VISION_VOCAB_SIZE",
    "Example",
    "TextCodec",
    "build_example",
    "frame_cells",
    "frame_markers",
    "lwm_chat_prompt_streams",
    "loss_weight",
    "qa_prompt",
    "qa_prompt_streams",
    "record_turns",
    "text_first",
    "text_to_video_prompt_streams",
    "vision_span",
]

NUM_CODES = 8192  # VQGAN codebook entries: codes 0 .. 8191
EOF_ID = 8192  # end of a frame (every frame but the last)
EOV_ID = 8193  # end of the video, after the last frame
VISION_VOCAB_SIZE = 8448  # codes + markers, padded
VISION_START = "<vision>"
VISION_END = "</vision>"
# loss_mask of an answer learned only where its turn is asked alone (``"learn": "alone"``).
LOSS_ALONE = 2
# A QA turn's ``"learn"`` is true (learned), false (context only) or this (learned only when
# the turn is asked alone).
LEARN_ALONE = "alone"


def loss_weight(loss_mask: Any, chained: Any = False, xp: Any = np) -> Any:
    """The training weight (0 or 1, float32) of each position of a record's ``loss_mask``:
    1 where it is 1, and where it is `LOSS_ALONE` unless the position's turn follows the
    record's earlier turns (``chained``, broadcast against ``loss_mask``)."""
    m = xp.asarray(loss_mask)
    return ((m == 1) | ((m == LOSS_ALONE) & ~xp.asarray(chained, bool))).astype(xp.float32)


def frame_markers() -> dict[str, int]:
    """The frame marker ids by name, as a dataset's metadata records them."""
    return {"eof": EOF_ID, "eov": EOV_ID}


def frame_cells(tokens: Any, vision_mask: Any, xp: Any = np) -> Any:
    """Each vision code's cell in its frame, ``row * w + col`` in raster order (its offset from
    the ``<vision>`` or ``<eof>`` before it), and -1 at every other position (text, markers),
    for ``[..., seq]`` streams in document order. ``xp`` is ``numpy`` or ``jax.numpy``.

    A model with `ModelConfig.vision_grid` adds a learned embedding of the cell's row and
    column to each code, so where a code sits in its frame is not left to the rotary position
    alone (cf. Qwen2-VL's multimodal positions)."""
    tokens, vision_mask = xp.asarray(tokens), xp.asarray(vision_mask, bool)
    is_code = vision_mask & (tokens < EOF_ID)
    index = xp.broadcast_to(xp.arange(tokens.shape[-1], dtype=np.int32), tokens.shape)
    boundary = xp.where(is_code, -1, index)  # the last position that is not a code
    if xp is np:
        boundary = np.maximum.accumulate(boundary, axis=-1)
    else:
        import jax

        boundary = jax.lax.cummax(boundary, axis=boundary.ndim - 1)
    return xp.where(is_code, index - boundary - 1, -1).astype(np.int32)


def window_offsets(radius: int) -> list[tuple[int, int]]:
    """The causal neighbourhood of a code in its frame, as (rows up, columns left) of each
    neighbour: the ``radius`` codes to its left in its row, then the ``2 * radius + 1`` codes
    centred above it in each of the ``radius`` rows above (all before it in raster order)."""
    left = [(0, dc) for dc in range(1, radius + 1)]
    return left + [(dr, dc) for dr in range(1, radius + 1) for dc in range(radius, -radius - 1, -1)]


def window_neighbours(cells: Any, cols: int, radius: int) -> list[tuple[int, Any]]:
    """Per offset of `window_offsets`: how many positions before a code its neighbour there
    comes in document order (a frame's codes are contiguous, raster order), and where that
    neighbour lies in the frame (``cells``: `frame_cells`; False off the frame or off codes)."""
    row, col = cells // cols, cells % cols
    return [
        (dr * cols + dc, (cells >= 0) & (row >= dr) & (col >= dc) & (col - dc < cols))
        for dr, dc in window_offsets(radius)
    ]


def frame_window(
    tokens: Any,
    vision_mask: Any,
    grid: tuple[int, int],
    radius: int,
    xp: Any = np,
    cells: Any = None,
) -> Any:
    """``[..., seq, K]``: the codes of each vision code's causal neighbours in its frame
    (`window_offsets`, K of them), -1 where a neighbour falls outside the frame and at every
    position that is not a code, for ``[..., seq]`` streams in document order. ``cells``:
    their `frame_cells` when already computed.

    A model with `ModelConfig.vision_window` adds a learned embedding of each neighbour's code
    (one table per offset) to each code's embedding: a causal convolution over the frame, so
    the shape an object's codes draw together is one layer away from every code of it, and
    vision-mode generation still sees only codes before the one it predicts."""
    rows, cols = grid
    if not 0 <= radius < cols:
        raise ValueError(f"window radius {radius} must lie in [0, {cols}) for {cols} columns")
    tokens = xp.asarray(tokens, np.int32)
    if cells is None:
        cells = frame_cells(tokens, vision_mask, xp=xp)
    n = tokens.shape[-1]
    out = []
    for k, inside in window_neighbours(cells, cols, radius):  # k >= 1 positions earlier
        pad = xp.full(tokens.shape[:-1] + (min(k, n),), -1, np.int32)
        shifted = xp.concatenate([pad, tokens[..., : max(n - k, 0)]], axis=-1)
        out.append(xp.where(inside, shifted, -1))
    if not out:
        return xp.zeros(tokens.shape + (0,), np.int32)
    return xp.stack(out, axis=-1).astype(np.int32)


def qa_prompt(question: str) -> str:
    """The text of a question turn; the answer follows as ``" " + answer``."""
    return f"USER: {question} ASSISTANT:"


def record_turns(
    tokens: np.ndarray, vision_mask: np.ndarray, vision_end: list[int], eos_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(turn, positions)`` int32 of one record's streams (module docstring, "Turns"): turn 0
    up to and including the ``</vision>`` (``vision_end``) after the record's last vision
    token, then a new turn after each text EOS; positions count on from the end of turn 0 in
    every turn. A record without a video is all turn 0, positions ``0 .. n-1``."""
    tokens = np.asarray(tokens)
    text = np.where(np.asarray(vision_mask, bool), -1, tokens)  # text and vision ids overlap
    n = len(tokens)
    turn = np.zeros(n, np.int32)
    positions = np.arange(n, dtype=np.int32)
    vision = np.flatnonzero(np.asarray(vision_mask, bool))
    end = int(vision[-1]) + 1 + len(vision_end) if len(vision) else 0
    if not len(vision) or list(text[end - len(vision_end) : end]) != list(vision_end):
        return turn, positions
    after = text[end:]
    if not len(after):
        return turn, positions
    turn[end:] = 1 + np.concatenate([[0], np.cumsum(after[:-1] == eos_id)])
    starts = np.flatnonzero(np.diff(turn, prepend=turn[0]))  # the first token of each turn
    positions[end:] -= np.repeat(starts - end, np.diff(np.append(starts, n)))
    return turn, positions


def vision_span(codes: np.ndarray) -> np.ndarray:
    """int32 codes ``[T, h, w]`` -> ``T * (h*w + 1)`` ids: each frame's codes in raster order,
    then ``<eof>`` (every frame but the last) or ``<eov>`` (the last)."""
    codes = np.asarray(codes)
    if codes.ndim != 3 or codes.shape[0] < 1:
        raise ValueError(f"expected codes [T, h, w] with T >= 1, got {codes.shape}")
    t = codes.shape[0]
    frames = codes.reshape(t, -1).astype(np.int32)
    if frames.size and (frames.min() < 0 or frames.max() >= NUM_CODES):
        raise ValueError(
            f"codes must lie in [0, {NUM_CODES}), got [{frames.min()}, {frames.max()}]"
        )
    ends = np.full((t, 1), EOF_ID, np.int32)
    ends[-1] = EOV_ID
    return np.concatenate([frames, ends], axis=1).reshape(-1)


# The classes of a plain `tokenizers` file (the project's own tokenizer) that transformers
# exports without importing PyTorch; `AutoTokenizer` imports torch wherever it is installed
# (2.5 s against 1.1 for every command that loads the tokenizer on a 2-core machine).
PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_class(folder: Path) -> Any:
    """The class `AutoTokenizer` would load ``folder`` with, where it is a plain one (its
    tokenizer_config.json names it), else `AutoTokenizer` itself."""
    import json

    import transformers

    try:
        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named in PLAIN_TOKENIZER_CLASSES and hasattr(transformers, named):
        return getattr(transformers, named)
    return transformers.AutoTokenizer


class TextCodec:
    """A Hugging Face tokenizer used the way the token stream needs it.

    Every piece of text (markers included) is encoded with ``add_special_tokens=False``; BOS is
    added once, at the start of an example, and only if the tokenizer defines one. (LWM's
    ``VisionTextProcessor`` encodes ``<vision>``, ``</vision>`` and every text field with the
    default special tokens, so with LLaMA's tokenizer a BOS comes before each of them: before
    each video, after its codes, and before its caption; `lwm_chat_prompt_streams` builds its
    chat prompt that way.)
    """

    def __init__(self, tokenizer: Any, name: str):
        self.tokenizer, self.name = tokenizer, name
        # Questions, prompts and answers repeat across a dataset; each text is encoded once.
        self._encoded: dict[str, tuple[int, ...]] = {}
        self.bos_id: int | None = tokenizer.bos_token_id
        self.eos_id: int | None = tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)
        self.vision_start = self.encode(VISION_START)
        self.vision_end = self.encode(VISION_END)
        if not self.vision_start or not self.vision_end:
            raise ValueError(f"tokenizer '{name}' encodes the vision markers to nothing")

    @classmethod
    def load(cls, path: str | None = None) -> TextCodec:
        """A tokenizer folder, loaded as ``AutoTokenizer`` loads it (`_tokenizer_class`); None:
        the project's ``data/tokenizer``."""
        import os

        # transformers says at import that PyTorch is missing, which only its models need (on
        # a TPU VM it is never installed): that advice is silenced unless the user set it.
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

        folder = Path(path) if path is not None else Path(__file__).parent / "tokenizer"
        if not folder.is_dir():
            raise FileNotFoundError(f"tokenizer folder '{folder}' not found")
        known = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
        if not any((folder / name).is_file() for name in known):
            raise FileNotFoundError(
                f"tokenizer folder '{folder}' holds no tokenizer (none of {', '.join(known)})"
            )
        try:
            tokenizer = _tokenizer_class(folder).from_pretrained(str(folder))
        except (OSError, ValueError) as e:
            raise ValueError(f"tokenizer folder '{folder}' cannot be loaded: {e}") from None
        return cls(tokenizer, str(folder))

    def encode(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            if len(text) <= 256 and len(self._encoded) < 1 << 16:  # short, repeated texts
                self._encoded[text] = ids
        return list(ids)

    def metadata(self) -> dict[str, Any]:
        """What a dataset records about its text vocabulary."""
        return {
            "name": self.name,
            "class": type(self.tokenizer).__name__,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "vision_start": self.vision_start,
            "vision_end": self.vision_end,
        }


@dataclass
class Example:
    """One record's streams, built piece by piece."""

    tokens: list[int] = field(default_factory=list)
    vision: list[bool] = field(default_factory=list)
    loss: list[int] = field(default_factory=list)

    def add(self, ids: Any, *, vision: bool, loss: bool | int) -> None:
        ids = [int(i) for i in ids]
        self.tokens += ids
        self.vision += [vision] * len(ids)
        self.loss += [int(loss)] * len(ids)

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "tokens": np.asarray(self.tokens, np.int32),
            "vision_mask": np.asarray(self.vision, np.bool_),
            "loss_mask": np.asarray(self.loss, np.uint8),
        }


def _begin(codec: TextCodec, codes: np.ndarray | None, train_vision: bool) -> Example:
    """BOS, then the video (``<vision>`` codes ``</vision>``) when there is one."""
    ex = Example()
    if codec.bos_id is not None:
        ex.add([codec.bos_id], vision=False, loss=False)
    if codes is not None:
        _add_video(ex, codec, codes, train_vision)
    return ex


def _add_video(ex: Example, codec: TextCodec, codes: np.ndarray, train_vision: bool) -> None:
    ex.add(codec.vision_start, vision=False, loss=train_vision)
    ex.add(vision_span(codes), vision=True, loss=train_vision)
    ex.add(codec.vision_end, vision=False, loss=train_vision)


def video_prompt_streams(codec: TextCodec, codes: np.ndarray | None):
    """``(tokens, vision_mask)`` of the start of a QA record: BOS, then the video (if any)."""
    arrays = _begin(codec, codes, train_vision=False).arrays()
    return arrays["tokens"], arrays["vision_mask"].astype(bool)


def qa_prompt_streams(codec: TextCodec, codes: np.ndarray, question: str):
    """``(tokens, vision_mask)`` of the prompt for one question about one video: a QA record
    (`build_example`) up to and including its first ``ASSISTANT:``, where the answer follows."""
    ex = _begin(codec, codes, train_vision=False)
    ex.add(codec.encode(qa_prompt(question)), vision=False, loss=False)
    arrays = ex.arrays()
    return arrays["tokens"], arrays["vision_mask"].astype(bool)


def lwm_chat_prompt_streams(codec: TextCodec, codes: np.ndarray, question: str):
    """``(tokens, vision_mask)`` of the prompt LWM's own ``vision_chat.py`` (``construct_input``)
    builds for one question about one video, for models trained by LWM (its released chat
    checkpoints): ``"<s>You are a helpful assistant. USER: {question}\\n"``, ``<vision>``, the
    video, ``</vision>``, ``" ASSISTANT:"``, each piece encoded on its own with the tokenizer's
    default special tokens (so with LLaMA's tokenizer each begins with a BOS, and the text
    ``<s>`` is one more), the question before the video. Only the video is vision. Our own QA
    records (`qa_prompt_streams`) put the video first and have no system sentence."""
    tok = codec.tokenizer
    pieces = [
        (tok.encode(f"<s>You are a helpful assistant. USER: {question}\n"), False),
        (tok.encode(VISION_START), False),
        (vision_span(codes), True),
        (tok.encode(VISION_END), False),
        (tok.encode(" ASSISTANT:"), False),
    ]
    tokens = np.concatenate([np.asarray(ids, np.int32) for ids, _ in pieces])
    vision = np.concatenate([np.full(len(ids), v, bool) for ids, v in pieces])
    return tokens, vision


def text_to_video_prompt_streams(codec: TextCodec, caption: str | None):
    """``(tokens, vision_mask)`` of the prompt that asks for the video of ``caption``: a
    caption-first record up to and including its ``<vision>``. ``caption=None``: the
    unconditional prompt (BOS, ``<vision>``) of classifier-free guidance."""
    ex = _begin(codec, None, train_vision=False)
    if caption:
        ex.add(codec.encode(caption), vision=False, loss=False)
    ex.add(codec.vision_start, vision=False, loss=False)
    arrays = ex.arrays()
    return arrays["tokens"], arrays["vision_mask"].astype(bool)


def text_first(index: int, ratio: float) -> bool:
    """Whether captioned item ``index`` of a dataset is written caption-first: the items
    ``i`` with ``frac(i * phi) < ratio`` (phi the golden ratio), a fraction ``ratio`` of every
    long enough run of items, spread evenly and the same in every run of `lwm tokenize`."""
    return (index * 0.6180339887498949) % 1.0 < ratio


def build_example(
    codec: TextCodec,
    codes: np.ndarray | None = None,
    *,
    text: str | None = None,
    qa: list[dict[str, str]] | None = None,
    learn_video: bool | None = None,
    text_first: bool = False,
) -> dict[str, np.ndarray]:
    """The streams of one record (see the module docstring): ``tokens`` int32, ``vision_mask``
    bool, ``loss_mask`` uint8, all of one length. ``codes`` ``[T, h, w]`` or None (text only);
    at most one of ``text`` (a caption, or the text of a text-only record) and ``qa``.
    ``learn_video``: whether the video's tokens are trained on (loss 1); None: as in the table
    above (yes, except in a QA record). ``text_first``: a captioned video is written
    caption-first (ignored for other records)."""
    if text is not None and qa is not None:
        raise ValueError("an example has a caption or questions, not both")
    if codes is None and text is None:
        raise ValueError("a text-only example needs text")
    train_vision = qa is None if learn_video is None else learn_video
    if text_first and text and codes is not None:
        ex = _begin(codec, None, train_vision)
        ex.add(codec.encode(text), vision=False, loss=True)
        _add_video(ex, codec, codes, train_vision)
        ex.add([codec.eos_id] if codec.eos_id is not None else [], vision=False, loss=True)
        return ex.arrays()
    ex = _begin(codec, codes, train_vision)
    eos = [codec.eos_id] if codec.eos_id is not None else []
    if qa is not None:
        for turn in qa:
            ex.add(codec.encode(qa_prompt(turn["question"])), vision=False, loss=False)
            learn = turn.get("learn", True)
            if not (isinstance(learn, bool) or learn == LEARN_ALONE):
                raise ValueError(f"a QA turn's 'learn' is {learn!r}; use true, false or 'alone'")
            loss = LOSS_ALONE if learn == LEARN_ALONE else int(learn)
            ex.add(codec.encode(" " + turn["answer"]) + eos, vision=False, loss=loss)
    else:
        if text:
            ex.add(codec.encode(text), vision=False, loss=True)
        ex.add(eos, vision=False, loss=True)
    return ex.arrays()
