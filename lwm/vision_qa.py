"""Questions about videos: the prompt a QA record trains on, then greedy (or sampled) answers.

The prompt is exactly the context of the first turn of an `lwm tokenize` QA record
(`data.tokens`): ``BOS <vision> codes... </vision> USER: {question} ASSISTANT:``; the model
writes the answer and stops at EOS. Videos are read, sampled, resized and cropped as
`lwm tokenize` does (by default with the sampling recorded in the training dataset's metadata),
then encoded with the VQGAN, once per video. ``prompt="lwm"`` asks instead with the prompt of
LWM's own ``vision_chat.py`` (`data.tokens.lwm_chat_prompt_streams`), for weights LWM trained.

    qa = VideoQA(model, codec, vqgan, max_frames=8)
    answers = qa.answer([("clip.mp4", "What colour is the moving square?")])  # [Answer(...)]
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from data.decode import DecodeOptions, decode_item
from data.manifest import Item
from data.tokens import (
    TextCodec,
    lwm_chat_prompt_streams,
    qa_prompt,
    qa_prompt_streams,
    video_prompt_streams,
)
from lwm.generate import GREEDY, Sampling, generate, prompt_batch
from lwm.model import LWMModel
from lwm.qa_eval import Answer

__all__ = ["VideoQA", "video_codes"]


def video_codes(vqgan: Any, path: str | Path, *, max_frames: int | None, fps: float | None = None):
    """VQGAN codes ``[T, h, w]`` of a video (or image) file, sampled as `lwm tokenize` does.
    A file that cannot be read raises ValueError naming it."""
    decoded = decode_item(
        0,
        Item(kind="video", path=str(path)),
        DecodeOptions(resolution=vqgan.resolution, fps=fps, max_frames=max_frames),
    )
    if decoded.error is not None:
        raise ValueError(decoded.error)
    return np.asarray(vqgan.encode(decoded.frames[None]))[0]


class VideoQA:
    """Answers ``(video, question)`` pairs with a model; each video is encoded once.

    Prompts go to `lwm.generate.generate` in batches of ``batch_size`` rows, right-padded to a
    multiple of ``pad_to`` tokens, so repeated calls (an evaluation every N training steps)
    reuse one compiled program. ``model`` may be replaced between calls (same structure).
    ``prompt``: ``"record"`` (our QA records' prompt, `qa_prompt_streams`) or ``"lwm"`` (LWM's
    ``vision_chat.py`` prompt, `lwm_chat_prompt_streams`; one question at a time)."""

    PROMPTS = ("record", "lwm")

    def __init__(
        self,
        model: LWMModel,
        codec: TextCodec,
        vqgan: Any,
        *,
        max_frames: int | None = None,
        fps: float | None = None,
        max_new_tokens: int = 16,
        sampling: Sampling = GREEDY,
        batch_size: int = 32,
        pad_to: int = 128,
        seed: int = 0,
        prefill_chunk: int | None = None,
        prompt: str = "record",
    ):
        if prompt not in self.PROMPTS:
            raise ValueError(f"unknown prompt '{prompt}'; choose one of {', '.join(self.PROMPTS)}")
        self.prompt = prompt
        self.model, self.codec, self.vqgan = model, codec, vqgan
        self.max_frames, self.fps = max_frames, fps
        self.max_new_tokens, self.sampling = max_new_tokens, sampling
        self.batch_size, self.pad_to, self.seed = batch_size, pad_to, seed
        self.prefill_chunk = prefill_chunk
        self._codes: dict[str, np.ndarray] = {}

    def codes(self, video: str | Path) -> np.ndarray:
        key = str(video)
        if key not in self._codes:
            self._codes[key] = video_codes(
                self.vqgan, video, max_frames=self.max_frames, fps=self.fps
            )
        return self._codes[key]

    def answer(self, pairs: Sequence[tuple[str | Path, str]]) -> list[Answer]:
        _check_pairs(pairs)
        streams = lwm_chat_prompt_streams if self.prompt == "lwm" else qa_prompt_streams
        prompts = [streams(self.codec, self.codes(v), q) for v, q in pairs]
        answers: list[Answer] = []
        for start in range(0, len(prompts), self.batch_size):
            answers += self.answer_prompts(prompts[start : start + self.batch_size])
        return answers

    def answer_in_conversations(self, pairs: Sequence[tuple[str | Path, str]]) -> list[Answer]:
        """Answers to ``(video, question)`` pairs, each video's questions (in the order given)
        asked one after another in one conversation about it, as `lwm chat` asks them: a
        question follows the earlier questions and the model's own answers to them (each
        closed by its EOS, also when cut). Turn k of every conversation is answered in one
        pass over all of them."""
        _check_pairs(pairs)
        if self.prompt != "record":
            raise ValueError("LWM's vision_chat prompt has one question: ask each one alone")
        order: dict[str, list[int]] = {}
        for i, (video, _) in enumerate(pairs):
            order.setdefault(str(video), []).append(i)
        history = {}
        for v in order:
            tokens, vision = video_prompt_streams(self.codec, self.codes(v))
            history[v] = ([np.asarray(tokens)], [np.asarray(vision)])
        answers: list[Answer | None] = [None] * len(pairs)
        eos = [] if self.codec.eos_id is None else [self.codec.eos_id]
        for turn in range(max(len(ix) for ix in order.values())):
            asked = [(v, ix[turn]) for v, ix in order.items() if turn < len(ix)]
            prompts = []
            for v, i in asked:
                ids = np.asarray(self.codec.encode(qa_prompt(pairs[i][1])), np.int32)
                history[v][0].append(ids)
                history[v][1].append(np.zeros(len(ids), bool))
                prompts.append((np.concatenate(history[v][0]), np.concatenate(history[v][1])))
            for start in range(0, len(prompts), self.batch_size):
                batch = asked[start : start + self.batch_size]
                done = self._generate(prompts[start : start + self.batch_size])
                for (v, i), (answer, generated) in zip(batch, done, strict=True):
                    answers[i] = answer
                    said = generated if not answer.cut else generated + eos
                    history[v][0].append(np.asarray(said, np.int32))
                    history[v][1].append(np.zeros(len(said), bool))
        return answers  # type: ignore[return-value]

    def answer_prompts(self, prompts: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[Answer]:
        """Answers to ``(tokens, vision_mask)`` prompts (at most ``batch_size``, one batch)."""
        return [answer for answer, _ in self._generate(prompts)]

    def _generate(
        self, prompts: Sequence[tuple[np.ndarray, np.ndarray]]
    ) -> list[tuple[Answer, list[int]]]:
        """Each prompt's answer and the ids generated for it (its stop token included)."""
        width = -(-max(len(t) for t, _ in prompts) // self.pad_to) * self.pad_to
        rows = max(self.batch_size, len(prompts))
        tokens, vision, lengths = prompt_batch(prompts, rows, width, self.model.mesh)
        stops = () if self.codec.eos_id is None else (self.codec.eos_id,)
        out, n = generate(
            self.model,
            tokens,
            vision,
            lengths,
            key=jax.random.key(self.seed),
            max_new_tokens=self.max_new_tokens,
            sampling=self.sampling,
            stop_tokens=stops,
            prefill_chunk=self.prefill_chunk,
        )
        out, n = np.asarray(out), np.asarray(n)
        answers = []
        for row in range(len(prompts)):
            generated = [int(x) for x in out[row, : n[row]]]
            ended = bool(stops) and bool(generated) and generated[-1] in stops
            ids = [x for x in generated if x not in stops]
            text = self.codec.tokenizer.decode(ids, skip_special_tokens=True).strip()
            answers.append((Answer(text, cut=not ended), generated))
        return answers


def _check_pairs(pairs: Sequence[tuple[str | Path, str]]) -> None:
    """``pairs`` is a list of ``(video, question)`` (one pair alone was read as two)."""
    if isinstance(pairs, tuple) and len(pairs) == 2 and isinstance(pairs[1], str):
        raise TypeError("pairs must be a list of (video, question) pairs, not one pair")


class TrainingInputs(dict):
    """What a model's training dataset records (`lwm tokenize`'s metadata.json), for asking it
    questions the way it was trained: ``vqgan`` (path), ``tokenizer`` (path), ``max_frames``,
    ``fps`` (the frame sampling) and ``manifest`` (the input it was made from). Empty when the
    run did not train on a token dataset; only ``missing`` (its path) when that dataset is not
    found from here (gone, or a relative path read from another directory)."""

    @classmethod
    def of(cls, data_source: str | None) -> TrainingInputs:
        from data.dataset_io import read_metadata

        if not data_source or data_source == "synthetic":
            return cls()
        try:
            meta = read_metadata(data_source)
        except FileNotFoundError:
            return cls({"missing": str(data_source)})
        except ValueError:
            return cls()
        sampling = meta.get("sampling") or {}
        vq = meta.get("vqgan") or {}
        found = {
            "vqgan": vq.get("path"),
            "vqgan_shape": {
                k: vq[k] for k in ("resolution", "tokens_per_frame", "codebook_size") if k in vq
            }
            or None,
            "vqgan_weights": vq.get("weights"),
            "tokenizer": (meta.get("text_tokenizer") or {}).get("name"),
            "max_frames": sampling.get("max_frames"),
            "fps": sampling.get("fps"),
            "manifest": meta.get("input")
            if str(meta.get("input", "")).endswith(".jsonl")
            else None,
            "dataset": str(data_source),
        }
        return cls({k: v for k, v in found.items() if v is not None})

    def text_codec(self, given: str | None = None):
        """The `data.tokens.TextCodec` of ``given`` (a tokenizer folder), else of the training
        dataset's tokenizer, else the default one."""
        from data.tokens import TextCodec

        return TextCodec.load(given or self.get("tokenizer"))

    def vqgan_path(self, given: str | None = None) -> str:
        """``given``, else the training dataset's VQGAN; a `ValueError` naming what is missing
        when there is neither."""
        if given or self.get("vqgan"):
            return given or self["vqgan"]
        if "missing" in self:
            raise ValueError(
                f"a VQGAN is needed (--vqgan): the model's training dataset '{self['missing']}' "
                "is not found from here (a relative path is read from the current directory)"
            )
        raise ValueError("a VQGAN is needed (--vqgan): the model's training dataset names none")


def check_vqgan_fits(encoder: Any, path: str, model_cfg: Any, inputs: TrainingInputs) -> None:
    """A `ValueError` when the VQGAN at ``path`` (loaded: ``encoder``) cannot be the one the
    model learned to read: more codes than the model's ``vision_codes``, another code grid
    than its ``vision_grid``, or another resolution, grid or codebook than its training
    dataset was tokenized with (``inputs``). Its codes would be read as others, or as none
    the model was trained on, and every answer would be about another video."""
    codes, per_frame = encoder.codebook_size, encoder.tokens_per_frame
    if model_cfg.vision_codes and codes > model_cfg.vision_codes:
        raise ValueError(
            f"the VQGAN {path} has {codes} codes, more than the model's vision_codes "
            f"({model_cfg.vision_codes})"
        )
    grid = model_cfg.vision_grid
    if grid is not None and per_frame != grid[0] * grid[1]:
        raise ValueError(
            f"the VQGAN {path} gives {per_frame} codes per frame; the model's vision_grid "
            f"{grid[0]}x{grid[1]} is {grid[0] * grid[1]}"
        )
    trained = inputs.get("vqgan_shape") or {}
    given = {
        "resolution": encoder.resolution,
        "tokens_per_frame": per_frame,
        "codebook_size": codes,
    }
    differ = [f"{k} {given[k]} here, {v} there" for k, v in trained.items() if given[k] != v]
    if differ:
        raise ValueError(
            f"the VQGAN {path} is not the one the model's training dataset "
            f"{inputs['dataset']} was tokenized with ({'; '.join(differ)}); give that one "
            "(--vqgan), or none to use it"
        )
    weights = inputs.get("vqgan_weights")
    if weights and getattr(encoder, "fingerprint", weights) != weights:
        raise ValueError(
            f"the VQGAN {path} has other weights than the model's training dataset "
            f"{inputs['dataset']} was tokenized with (trained on since?); its codes would mean "
            "other things to the model: give the VQGAN the dataset was made with (--vqgan)"
        )


def model_config(model: str, *, config: str | None = None):
    """The config of ``model``, read without its weights: a run's own (``run:DIR``), or the
    ``config`` file given with any other `lwm.weights.load_model` source."""
    from lwm.config import load_config
    from lwm.weights import detect_format

    fmt, location = detect_format(model)
    if fmt == "run":  # the run's own config says how its dataset was made
        from lwm.runs import run_config

        if config:  # it was ignored without a word
            raise ValueError(
                f"--config is for weights without one (hf:, lwm:, orbax:); the run '{location}' "
                "brings its own (config.yaml)"
            )
        return run_config(location)
    if not config:
        raise ValueError("a model config is needed with a --model that is not run:DIR")
    return load_config(config)


def load_language_model(model: str, *, config: str | None = None, mesh=None, log=print):
    """``(config, model)`` for ``model``: ``run:DIR`` (an `lwm train` output, its own config),
    or a `lwm.weights.load_model` source with the model ``config`` file (`model_config`)."""
    from lwm.weights import detect_format, load_model

    cfg = model_config(model, config=config)
    fmt, location = detect_format(model)
    if fmt == "run":
        from lwm.runs import load_run

        return load_run(location, mesh=mesh, log=log)
    return cfg, load_model(model, cfg.model, mesh=mesh)


def text_codec_for(model: str, *, config: str | None = None, tokenizer: str | None = None):
    """The text tokenizer `load_video_qa` would give ``model`` (``tokenizer``, else its
    training dataset's), without loading the model: for checks before it loads."""
    cfg = model_config(model, config=config)
    return TrainingInputs.of(cfg.data.source).text_codec(tokenizer)


def load_video_qa(
    model: str,
    *,
    config: str | None = None,
    mesh=None,
    vqgan: str | bool | None = None,
    tokenizer: str | None = None,
    max_frames: int | None = None,
    fps: float | None = None,
    log=print,
    **options: Any,
) -> tuple[VideoQA, TrainingInputs]:
    """A `VideoQA` for ``model`` (``run:DIR``, or a `lwm.weights.load_model` source with the
    model ``config`` file), and what its training dataset records. The VQGAN, the tokenizer and
    the frame sampling default to the training dataset's; ``options`` go to `VideoQA`."""
    cfg, lm = load_language_model(model, config=config, mesh=mesh, log=log)
    inputs = TrainingInputs.of(cfg.data.source)
    if max_frames is None and fps is None and "dataset" in inputs:
        log(
            f"sampling videos as the training dataset {inputs['dataset']} was: "
            f"max_frames={inputs.get('max_frames')}, fps={inputs.get('fps')}"
        )
    qa = video_qa_for(lm, inputs, vqgan, tokenizer, max_frames, fps, **options)
    return qa, inputs


def video_qa_for(
    model: Any,
    inputs: TrainingInputs,
    vqgan: str | bool | None = None,
    tokenizer: str | None = None,
    max_frames: int | None = None,
    fps: float | None = None,
    model_cfg: Any = None,
    **options: Any,
) -> VideoQA:
    """A `VideoQA` whose VQGAN, text tokenizer and frame sampling default to those of the
    training dataset described by ``inputs``; ``options`` go to `VideoQA`. ``vqgan=False``:
    text prompts only, no VQGAN loaded. The VQGAN must fit the model (``model_cfg``, by
    default ``model.cfg``) and its dataset: `check_vqgan_fits`."""
    from vqgan import load_tokenizer

    codec = inputs.text_codec(tokenizer)
    if vqgan is False:
        return VideoQA(model, codec, None, **options)
    vqgan = inputs.vqgan_path(vqgan)
    if max_frames is None and fps is None:
        max_frames, fps = inputs.get("max_frames"), inputs.get("fps")
    # The VQGAN shards its frames over the language model's mesh: one mesh per process.
    encoder = load_tokenizer(vqgan, mesh=getattr(model, "mesh", None))
    model_cfg = model_cfg if model_cfg is not None else getattr(model, "cfg", None)
    if model_cfg is not None:
        check_vqgan_fits(encoder, vqgan, model_cfg, inputs)
    return VideoQA(model, codec, encoder, max_frames=max_frames, fps=fps, **options)
