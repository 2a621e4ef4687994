"""A conversation about a video: the video is encoded and prefilled once, and every turn extends
the same KV cache (LWM's ``run_vision_chat``, without re-reading the video for each question).

The token stream is a training QA record's (`data.tokens.build_example`): ``BOS <vision> codes
</vision>``, then per turn ``USER: {question} ASSISTANT:`` and the answer with its EOS, so any
turn sits where training put turns. New tokens are fed in chunks of ``prefill_chunk``
(`lwm.generate.extend`) into a cache of ``max_context`` slots sharded over ``sp``; answers are
sampled with `lwm.generate`'s decode loop, which writes them into the same cache.

    chat = ChatSession(model, codec, video_codes(vqgan, "clip.mp4", max_frames=32), max_context=8192)
    chat.ask("What colour is the moving square?")   # Answer(text="red", cut=False)
    chat.ask("Which direction does it move?")       # the video is not read again
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data.tokens import (
    TextCodec,
    frame_cells,
    frame_window,
    qa_prompt,
    video_prompt_streams,
)
from lwm.generate import GREEDY, Sampling, decode_loop, empty_cache, extend
from lwm.model import LWMModel
from lwm.qa_eval import Answer

__all__ = ["ChatSession", "ContextFullError"]


class ContextFullError(ValueError):
    """The conversation does not fit the cache; the message names both lengths."""


@partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _extend(graphdef, state, cache, tokens, vision, start, cells, window):
    return extend(nnx.merge(graphdef, state), cache, tokens, vision, start, cells, window)


@partial(
    jax.jit,
    static_argnames=("graphdef", "max_new_tokens", "sampling", "stop_tokens"),
    donate_argnames=("cache",),
)
def _answer(
    graphdef, state, cache, hidden, position, key, *, max_new_tokens, sampling, stop_tokens
):
    model = nnx.merge(graphdef, state)
    return decode_loop(
        model,
        cache,
        hidden,
        position,
        key,
        b=1,
        max_new_tokens=max_new_tokens,
        mode="text",
        sampling=sampling,
        stop_tokens=stop_tokens,
        tokens_per_frame=0,
        cfg_scale=None,
        pad_id=0,
    )


class ChatSession:
    """One conversation (one row) about a video's VQGAN ``codes [T, h, w]`` (`lwm.vision_qa.
    video_codes`), or about nothing (text only)."""

    def __init__(
        self,
        model: LWMModel,
        codec: TextCodec,
        codes: np.ndarray | None = None,
        *,
        max_context: int = 4096,
        prefill_chunk: int = 512,
        max_new_tokens: int = 64,
        sampling: Sampling = GREEDY,
        seed: int = 0,
    ):
        sp = 1 if model.mesh is None else model.mesh.shape["sp"]
        if max_context % sp or prefill_chunk < 1:
            raise ValueError(
                f"max_context {max_context} must be a multiple of sp = {sp}, and the prefill "
                f"chunk positive (got {prefill_chunk})"
            )
        if codes is not None and np.size(codes):
            limit = model.cfg.codes_read
            low, high = int(np.min(codes)), int(np.max(codes))
            if low < 0 or high >= limit:  # they would be read as markers or as nothing learned
                raise ValueError(
                    f"codes must lie in [0, {limit}) (the model's vision codes), got "
                    f"[{low}, {high}]"
                )
        self.model, self.codec = model, codec
        # A chunk longer than the cache holds nothing more (a feed never exceeds it) and would
        # not fit it: cut to the cache.
        self.max_context, self.chunk = max_context, min(prefill_chunk, max_context)
        self.max_new_tokens, self.sampling = max_new_tokens, sampling
        self.key = jax.random.key(seed)
        self.graphdef, self.state = nnx.split(model)
        tokens, vision = video_prompt_streams(codec, codes)
        self.pending = (list(tokens), list(vision))  # fed with the first question
        self.length = 0  # tokens in the cache
        self.history: list[int] = []  # every token of the conversation, for inspection
        self.cache = empty_cache(model, 1, max_context)
        self.hidden: jax.Array | None = None

    def feed(self, tokens: list[int], vision: list[bool]) -> None:
        """Put tokens into the cache, ``prefill_chunk`` at a time."""
        need = self.length + len(tokens) + self.max_new_tokens
        if need > self.max_context:
            raise ContextFullError(
                f"the conversation needs {need} tokens ({self.length} so far, {len(tokens)} "
                f"new, {self.max_new_tokens} for the answer) but the context holds "
                f"{self.max_context} (--max-context)"
            )
        ids, is_vision = np.asarray(tokens, np.int32), np.asarray(vision, bool)
        cells = frame_cells(ids, is_vision)
        cfg = self.model.cfg
        window = None
        if cfg.vision_window:  # of this feed's tokens, as the cells: a video is fed whole
            window = frame_window(ids, is_vision, cfg.vision_grid, cfg.vision_window, cells=cells)
        for at in range(0, len(tokens), self.chunk):
            piece = tokens[at : at + self.chunk]
            n = len(piece)
            t = np.zeros((1, self.chunk), np.int32)
            v = np.zeros((1, self.chunk), bool)
            c = np.full((1, self.chunk), -1, np.int32)
            t[0, :n], v[0, :n], c[0, :n] = piece, vision[at : at + n], cells[at : at + n]
            w = None
            if window is not None:
                w = np.full((1, self.chunk, window.shape[-1]), -1, np.int32)
                w[0, :n] = window[at : at + n]
                w = jnp.asarray(w)
            # A short last chunk writes padding past the conversation; causal masking hides
            # it, and later tokens overwrite it.
            self.cache, hidden = _extend(
                self.graphdef,
                self.state,
                self.cache,
                jnp.asarray(t),
                jnp.asarray(v),
                self.length,
                jnp.asarray(c),
                w,
            )
            self.hidden = hidden[:, n - 1]
            self.length += n
        self.history += tokens

    def ask(self, question: str) -> Answer:
        """Answer one question, as the next turn of the conversation."""
        tokens, vision = self.pending
        ids = self.codec.encode(qa_prompt(question))
        self.feed(tokens + ids, vision + [False] * len(ids))
        self.pending = ([], [])
        stops = () if self.codec.eos_id is None else (self.codec.eos_id,)
        self.key, sub = jax.random.split(self.key)
        out, n, self.cache = _answer(
            self.graphdef,
            self.state,
            self.cache,
            self.hidden,
            jnp.asarray([self.length], jnp.int32),
            sub,
            max_new_tokens=self.max_new_tokens,
            sampling=Sampling(*self.sampling),
            stop_tokens=stops,
        )
        generated = [int(x) for x in np.asarray(out)[0, : int(np.asarray(n)[0])]]
        ended = bool(stops) and bool(generated) and generated[-1] in stops
        # The decode loop fed every generated token into the cache (the last one included).
        self.length += len(generated)
        self.history += generated
        if not ended and stops:  # close the turn as training does, so the next one follows
            self.pending = ([stops[0]], [False])
        ids = [x for x in generated if x not in stops]
        text = self.codec.tokenizer.decode(ids, skip_special_tokens=True).strip()
        return Answer(text, cut=not ended)
