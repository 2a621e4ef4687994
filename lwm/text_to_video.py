"""Text-to-video generation: a caption in, frames out (LWM's ``run_sample_video``).

The prompt is a caption-first record up to its ``<vision>`` (`data.tokens`, the records
`lwm tokenize --text-first-ratio` writes); the model then samples ``frames`` frames in vision
mode (`lwm.generate.generate`: codes only, ``<eof>`` after every frame but the last, ``<eov>``
after it), and the VQGAN decodes the codes to pixels. With ``cfg_scale`` (classifier-free
guidance) every step also runs the unconditional prompt (BOS, ``<vision>``) and samples from
``uncond + cfg_scale * (cond - uncond)``; ``cfg_scale=1`` is the conditional model alone.

Where LWM's ``vision_generation.py`` differs (this module follows our own records, not it):
its prompt is ``"<s>You are a helpful assistant. USER: Generate a video of {caption}
ASSISTANT: <vision>"`` ("Generate an image of" for the first frame, which it samples first with
its image settings), its unconditional prompt ``"<s><vision>"``; it samples code positions
from all 8,448 vision logits (markers and padding included; here only codes), and forces
``<eof>`` (8192) after every 256 codes, the last frame's too, where we end with ``<eov>``.

    gen = load_video_generator("run:runs/t2v/lm", cfg_scale=3.0)
    clips = gen.frames(["One shape on a dark background: a red circle moving left."], frames=4)
    clips.shape                     # uint8 [1, 4, 32, 32, 3]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from data.tokens import TextCodec, text_to_video_prompt_streams
from lwm.generate import Sampling, generate, prompt_batch
from lwm.model import LWMModel

__all__ = ["VideoGenerator", "load_video_generator"]

SAMPLE = Sampling(temperature=1.0)  # plain sampling, as LWM samples video


class VideoGenerator:
    """Generates clips for captions with ``model``, decoding them with ``vqgan`` (a
    `vqgan.VideoTokenizer`). Captions go in batches of ``batch_size`` rows (padded), so one
    compiled program serves every call of the same number of frames."""

    def __init__(
        self,
        model: LWMModel,
        codec: TextCodec,
        vqgan: Any,
        *,
        cfg_scale: float = 1.0,
        sampling: Sampling = SAMPLE,
        batch_size: int = 8,
        seed: int = 0,
    ):
        if cfg_scale <= 0:
            raise ValueError(f"cfg_scale must be positive, got {cfg_scale}")
        self.model, self.codec, self.vqgan = model, codec, vqgan
        self.cfg_scale, self.sampling = cfg_scale, sampling
        self.batch_size, self.seed = batch_size, seed

    def codes(self, captions: Sequence[str | None], frames: int) -> np.ndarray:
        """int32 codes ``[len(captions), frames, h, w]``; a caption of None asks for a video
        without one (the unconditional prompt)."""
        if frames < 1:
            raise ValueError(f"frames must be at least 1, got {frames}")
        if isinstance(captions, str):  # each character was a caption
            raise TypeError("captions must be a list of captions (or None), not one string")
        out = [
            self._batch(captions[start : start + self.batch_size], frames, start)
            for start in range(0, len(captions), self.batch_size)
        ]
        return np.concatenate(out)

    def frames(self, captions: Sequence[str | None], frames: int) -> np.ndarray:
        """uint8 clips ``[len(captions), frames, R, R, 3]`` (R: the VQGAN's resolution)."""
        return self.vqgan.decode(self.codes(captions, frames))

    def _batch(self, captions: Sequence[str | None], frames: int, start: int) -> np.ndarray:
        prompts = [text_to_video_prompt_streams(self.codec, c) for c in captions]
        mesh = self.model.mesh
        width = max(len(t) for t, _ in prompts)
        tokens, vision, lengths = prompt_batch(prompts, self.batch_size, width, mesh)
        guided = self.cfg_scale != 1.0
        uncond = (None, None, None)
        if guided:  # every row's unconditional twin: BOS <vision>
            t, v = text_to_video_prompt_streams(self.codec, None)
            uncond = prompt_batch([(t, v)] * len(tokens), len(tokens), len(t), mesh)
        h, w = self.vqgan.codes_shape
        per_frame = h * w
        out, _ = generate(
            self.model,
            tokens,
            vision,
            lengths,
            # each batch its own stream, so a caption's clip depends on its place, not its batch
            key=jax.random.fold_in(jax.random.key(self.seed), start),
            mode="vision",
            sampling=self.sampling,
            tokens_per_frame=per_frame,
            num_frames=frames,
            cfg_scale=self.cfg_scale if guided else None,
            uncond_tokens=uncond[0],
            uncond_vision_mask=uncond[1],
            uncond_len=uncond[2],
        )
        out = np.asarray(out)[: len(captions)].reshape(len(captions), frames, per_frame + 1)
        return out[:, :, :per_frame].reshape(len(captions), frames, h, w)


def load_video_generator(
    model: str,
    *,
    config: str | None = None,
    mesh=None,
    vqgan: str | None = None,
    tokenizer: str | None = None,
    log=print,
    **options: Any,
) -> VideoGenerator:
    """A `VideoGenerator` for ``model`` (``run:DIR``, or a weights source with ``config``);
    the VQGAN and the text tokenizer default to those of its training dataset."""
    from lwm.vision_qa import TrainingInputs, check_vqgan_fits, load_language_model
    from vqgan import load_tokenizer

    cfg, lm = load_language_model(model, config=config, mesh=mesh, log=log)
    inputs = TrainingInputs.of(cfg.data.source)
    vqgan = inputs.vqgan_path(vqgan)
    codec = inputs.text_codec(tokenizer)
    encoder = load_tokenizer(vqgan, mesh=mesh)
    check_vqgan_fits(encoder, vqgan, cfg.model, inputs)
    codes = encoder.codebook_size
    if cfg.model.codes_read > codes:  # it would sample codes past the VQGAN's
        raise ValueError(
            f"the model samples {cfg.model.codes_read} codes "
            f"(model.vision_codes: {cfg.model.vision_codes}), the VQGAN {vqgan} decodes "
            f"{codes}; train with model.vision_codes={codes}, or give that model's VQGAN"
        )
    return VideoGenerator(lm, codec, encoder, **options)
