"""Questions about videos: the prompt a QA record trains on, then greedy (or sampled) answers.

The prompt is exactly the context part of an `lwm tokenize` QA record (`data.tokens`):
``BOS <vision> codes... </vision> USER: {question} ASSISTANT:``; the model writes the answer
and stops at EOS. Videos are read, sampled, resized and cropped as `lwm tokenize` does, then
encoded with the VQGAN.

    answers = answer_questions(model, codec, vqgan, [("clip.mp4", "What colour is the square?")])
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from data.decode import DecodeOptions, decode_item
from data.manifest import Item
from data.tokens import TextCodec, qa_prompt, vision_span
from lwm.generate import GREEDY, Sampling, generate
from lwm.model import LWMModel


def video_codes(vqgan, path: str | Path, *, max_frames: int | None, fps: float | None = None):
    """VQGAN codes ``[T, h, w]`` of a video (or image) file, sampled as `lwm tokenize` does."""
    decoded = decode_item(
        0,
        Item(kind="video", path=str(path)),
        DecodeOptions(resolution=vqgan.resolution, fps=fps, max_frames=max_frames),
    )
    if decoded.error is not None:
        raise ValueError(decoded.error)
    return np.asarray(vqgan.encode(decoded.frames[None]))[0]


def qa_prompt_streams(codec: TextCodec, codes: np.ndarray, question: str):
    """``(tokens, vision_mask)`` of the prompt for one question about one video."""
    tokens: list[int] = [] if codec.bos_id is None else [codec.bos_id]
    vision: list[bool] = [False] * len(tokens)
    for ids, is_vision in (
        (codec.vision_start, False),
        (vision_span(codes).tolist(), True),
        (codec.vision_end, False),
        (codec.encode(qa_prompt(question)), False),
    ):
        tokens += list(ids)
        vision += [is_vision] * len(ids)
    return np.asarray(tokens, np.int32), np.asarray(vision, bool)


def answer_prompts(
    model: LWMModel,
    codec: TextCodec,
    prompts: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    max_new_tokens: int = 16,
    sampling: Sampling = GREEDY,
    seed: int = 0,
) -> list[str]:
    """Generate an answer for each ``(tokens, vision_mask)`` prompt (one batch, right-padded)."""
    width = max(len(t) for t, _ in prompts)
    batch = len(prompts)
    if model.mesh is not None:  # the batch is sharded over (dp, fsdp)
        data = model.mesh.shape["dp"] * model.mesh.shape["fsdp"]
        batch = -(-batch // data) * data
    tokens = np.zeros((batch, width), np.int32)
    vision = np.zeros((batch, width), bool)
    lengths = np.ones((batch,), np.int32)
    for i, (t, v) in enumerate(prompts):
        tokens[i, : len(t)], vision[i, : len(v)], lengths[i] = t, v, len(t)
    stops = () if codec.eos_id is None else (codec.eos_id,)
    out, n = generate(
        model,
        tokens,
        vision,
        lengths,
        key=jax.random.key(seed),
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop_tokens=stops,
    )
    out, n = np.asarray(out), np.asarray(n)
    answers = []
    for row in range(len(prompts)):
        ids = [int(x) for x in out[row, : n[row]] if x not in stops]
        answers.append(codec.tokenizer.decode(ids, skip_special_tokens=True).strip())
    return answers


def answer_questions(
    model: LWMModel,
    codec: TextCodec,
    vqgan,
    questions: Sequence[tuple[str | Path, str]],
    *,
    max_frames: int | None = 8,
    fps: float | None = None,
    max_new_tokens: int = 16,
    sampling: Sampling = GREEDY,
) -> list[str]:
    """Answers to ``(video path, question)`` pairs; each video is encoded once."""
    codes: dict[str, np.ndarray] = {}
    for path, _ in questions:
        if str(path) not in codes:
            codes[str(path)] = video_codes(vqgan, path, max_frames=max_frames, fps=fps)
    prompts = [qa_prompt_streams(codec, codes[str(p)], q) for p, q in questions]
    return answer_prompts(model, codec, prompts, max_new_tokens=max_new_tokens, sampling=sampling)
