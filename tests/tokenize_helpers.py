"""Small media and models for the `lwm tokenize` tests: videos in several codecs, broken files,
a tiny randomly initialised VQGAN, latents near the boundary between two codes, and a
LLaMA-style (SentencePiece BPE, BOS by default) Hugging Face tokenizer built offline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# 16x16 frames, 2 levels: 8x8 = 64 codes per frame, a codebook of 64.
TINY_VQGAN = dict(
    resolution=16,
    hidden_channels=16,
    channel_mult=(1, 2),
    num_res_blocks=1,
    z_channels=8,
    num_embeddings=64,
    embed_dim=8,
    num_groups=8,
)
CODES_PER_FRAME = 64


def near_tie_latents(
    n: int = 2048, codes: int = 512, dim: int = 8, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(z [n, dim], codebook [codes, dim], nearest [n])``: float32 latents, a float32
    codebook of pairs of near codes (5% of a code's size apart, as a VQGAN's codes of two
    similar colours) and the float64 nearest code of each z. Each z lies near the midpoint of a
    pair, 1e-3 to 1e-2 of their distance to one side: float32 products find the same code as
    float64, products of operands rounded to bfloat16 often do not."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(codes // 2, dim))
    emb = np.concatenate([base, base + 0.05 * rng.normal(size=base.shape)]).astype(np.float32)
    i = rng.integers(0, codes // 2, n)
    e_i, e_j = emb[i].astype(np.float64), emb[i + codes // 2].astype(np.float64)
    step = rng.uniform(1e-3, 1e-2, (n, 1)) * np.where(rng.random((n, 1)) < 0.5, -1.0, 1.0)
    z = ((e_i + e_j) / 2 + step * (e_i - e_j)).astype(np.float32)
    distances = ((z.astype(np.float64)[:, None, :] - emb.astype(np.float64)[None]) ** 2).sum(-1)
    return z, emb, distances.argmin(axis=1)


def save_tiny_vqgan(directory: Path, **overrides) -> Path:
    """A randomly initialised tiny VQGAN saved with the VQGAN package's `save_weights`.

    The parameters are drawn with numpy into the model's abstract shapes (building the model
    eagerly with its own initialisers takes ~10 s of op-by-op dispatch on a busy CPU)."""
    import jax
    from flax import nnx

    from vqgan.config import VQGANModelConfig
    from vqgan.model import VQGAN
    from vqgan.weights import save_weights

    cfg = VQGANModelConfig(**{**TINY_VQGAN, **overrides})
    graphdef, state = nnx.split(nnx.eval_shape(lambda: VQGAN(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)

    def draw(path, x):
        name = getattr(path[-1], "key", None)
        if name == "scale":
            return np.ones(x.shape, x.dtype)
        if name == "bias":
            return np.zeros(x.shape, x.dtype)
        fan_in = int(np.prod(x.shape[:-1])) or 1
        return (rng.standard_normal(x.shape) / np.sqrt(fan_in)).astype(x.dtype)

    values = jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, values)
    return save_weights(directory, nnx.merge(graphdef, state), cfg)


def moving_frames(t: int, h: int, w: int, seed: int) -> np.ndarray:
    """A bright square moving over a gradient: compresses well in every codec."""
    rng = np.random.default_rng(seed)
    base = np.zeros((h, w, 3), np.uint8)
    base[..., 0] = np.linspace(0, 200, w, dtype=np.uint8)[None]
    base[..., 1] = np.linspace(0, 200, h, dtype=np.uint8)[:, None]
    base[..., 2] = rng.integers(0, 255)
    frames = np.repeat(base[None], t, axis=0)
    side = max(4, min(h, w) // 4)
    for i in range(t):
        y = (i * 3) % (h - side)
        x = (i * 5) % (w - side)
        frames[i, y : y + side, x : x + side] = 255
    return frames


def write_video(
    path: Path, frames: np.ndarray, codec: str, fps: int, pix_fmt: str = "yuv420p"
) -> Path:
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = pix_fmt
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


# name: (codec, frames, height, width, fps, pixel format)
GOOD_VIDEOS = {
    "a_h264.mp4": ("libx264", 12, 48, 64, 8, "yuv420p"),
    "b_mpeg4.avi": ("mpeg4", 7, 64, 40, 25, "yuv420p"),
    "c_mjpeg.avi": ("mjpeg", 5, 32, 32, 10, "yuvj420p"),
    "d_vp9.webm": ("libvpx-vp9", 9, 36, 64, 30, "yuv420p"),
}


def write_media(folder: Path) -> dict[str, str]:
    """Good videos of several codecs, sizes, rates and lengths, and broken files. Returns the
    broken file names with a word their error line must contain."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, (name, (codec, t, h, w, fps, pix)) in enumerate(GOOD_VIDEOS.items()):
        write_video(folder / name, moving_frames(t, h, w, i), codec, fps, pix)
    (folder / "a_h264.txt").write_text("A white square moving across a gradient.\n")
    (folder / "c_mjpeg.txt").write_text("A small clip.")
    (folder / "empty.mp4").write_bytes(b"")
    (folder / "not_a_video.mp4").write_text("this is text, not a video\n" * 20)
    good = (folder / "a_h264.mp4").read_bytes()
    (folder / "truncated.mp4").write_bytes(good[: len(good) // 2])
    write_video(folder / "short.mp4", moving_frames(2, 32, 32, 9), "libx264", 8)
    return {
        "empty.mp4": "empty",
        "not_a_video.mp4": "not a readable video",
        "truncated.mp4": "not a readable video",
        "short.mp4": "fewer than --min-frames",
    }


def write_llama_style_tokenizer(directory: Path) -> Path:
    """A SentencePiece-style BPE (``▁`` for spaces, byte fallback, ``<unk>``/``<s>``/``</s>`` at
    0/1/2) that adds ``<s>`` by default and does not know the vision markers: like LLaMA's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    def style(tok: Tokenizer) -> None:
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    style(trained)
    texts = [
        "A white square moving across a gradient.",
        "USER: What colour is the square? ASSISTANT: white",
        "Two shapes on a dark background: a red circle moving left.",
    ]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    trained.train_from_iterator(texts * 10, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    style(tok)
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(directory))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "LlamaTokenizerFast"
    config_path.write_text(json.dumps(config))
    return directory


def read_records(directory: Path) -> list[dict]:
    import tensorflow_datasets as tfds

    source = tfds.builder_from_directory(str(directory)).as_data_source("train")
    return [source[i] for i in range(len(source))]


def vision_spans(record: dict) -> list[tuple[int, int]]:
    """(start, end) of each run of vision positions."""
    mask = np.asarray(record["vision_mask"]).astype(np.int8)
    edges = np.diff(np.concatenate([[0], mask, [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True))
