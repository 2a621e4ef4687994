"""Tests that need a TPU: the Pallas block kernels compiled by Mosaic (not interpreted, as
every other test runs them), the model and a short `lwm train` on the chip.

On a CPU every test here is skipped with the reason. On a TPU VM run them in one process (one
program at a time can hold the chips), with skips turned into failures::

    LWM_REQUIRE_TPU=1 python -m pytest -q tests/test_tpu.py

(``LWM_REQUIRE_TPU=1`` also makes tests/conftest.py leave JAX on the TPU rather than on the
8 simulated CPU devices the rest of the suite uses.)

Tolerances. The reference is `dense_attention` on the same chip at
``jax.default_matmul_precision("highest")`` from float32 copies of the inputs. At the TPU's
default precision a matrix product rounds its operands to bfloat16 (8 significant bits), in
the kernels as in XLA, so a float32 attention is good to a few parts in a thousand of the
largest value, not to float32's 1e-7; bfloat16 inputs and outputs add their own rounding. Each
case is therefore held twice: to an absolute bound (2e-2 of the largest reference value, about
five bfloat16 ulps) and to at most twice the error of our XLA block kernel on the same inputs
on the same chip (that kernel is checked against a float64 numpy reference on the CPU), plus
1e-3 for the rounding of either.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data.batches import turn_segment_ids
from lwm.attention import blockwise_attention, dense_attention, ring_attention
from lwm.attention.layout import zigzag_permutation

ROOT = Path(__file__).resolve().parents[1]
ON_TPU = jax.default_backend() == "tpu"
if os.environ.get("LWM_REQUIRE_TPU") == "1" and not ON_TPU:
    raise RuntimeError(
        f"LWM_REQUIRE_TPU=1, but JAX runs on {jax.default_backend()}: the TPU tests would skip"
    )
pytestmark = pytest.mark.skipif(
    not ON_TPU, reason="needs a TPU (on a TPU VM: LWM_REQUIRE_TPU=1 pytest tests/test_tpu.py)"
)

SEQ, BLOCK = 2048, 512


def inputs(h: int, kvh: int, d: int, dtype, b: int = 2, seed: int = 0, seq: int = SEQ):
    rng = np.random.default_rng(seed)
    shapes = ((b, seq, h, d), (b, seq, kvh, d), (b, seq, kvh, d), (b, seq, h, d))
    return tuple(jnp.asarray(rng.normal(size=s), dtype) for s in shapes)


def packed_qa_row(b: int, seq: int = SEQ) -> tuple[jax.Array, jax.Array]:
    """Positions and segment ids of rows packed as training packs them: row 0 one document;
    row 1 a plain document, then a QA document (a video turn 0 that every question sees, then
    three question turns that see it and themselves), then another plain document, positions
    restarting at each document (cut where they are in `SEQ` tokens, scaled to ``seq``)."""
    seg = np.zeros((b, seq), np.int32)
    pos = np.tile(np.arange(seq, dtype=np.int32), (b, 1))
    # plain, turn 0, turns 1-3, plain
    cuts = [round(c * seq / SEQ) for c in (0, 300, 1100, 1300, 1500, 1700, SEQ)]
    ids = [1, turn_segment_ids(2, 0), turn_segment_ids(2, 1), turn_segment_ids(2, 2)]
    ids += [turn_segment_ids(2, 3), 3]
    for (lo, hi), sid in zip(zip(cuts[:-1], cuts[1:], strict=True), ids, strict=True):
        seg[1, lo:hi] = sid
    for lo, hi in ((0, cuts[1]), (cuts[1], cuts[5]), (cuts[5], seq)):  # one range per document
        pos[1, lo:hi] = np.arange(hi - lo)
    return jnp.asarray(pos), jnp.asarray(seg)


def out_and_grads(f, q, k, v, ct) -> tuple:
    """The output of ``f`` and dq, dk, dv of ``sum(out * ct)``, compiled."""

    def both(q, k, v):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(ct.astype(out.dtype)))

    return jax.jit(both)(q, k, v)


def reference(ref, q, k, v, ct) -> tuple:
    """`out_and_grads` of ``ref`` in float32 at the highest matmul precision."""
    with jax.default_matmul_precision("highest"):
        return out_and_grads(ref, *(x.astype(jnp.float32) for x in (q, k, v, ct)))


def errors(fn, want, q, k, v, ct) -> list[float]:
    """Max |got - want| / max |want| of the output and of dq, dk, dv against ``want``
    (`reference`)."""
    got = out_and_grads(fn, q, k, v, ct)
    return [
        float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / jnp.max(jnp.abs(w)))
        for g, w in zip(got, want, strict=True)
    ]


CASES = {
    # name: (query heads, key/value heads, packed rows with QA turns)
    "causal": (8, 8, False),
    "gqa": (8, 2, False),
    "packed_qa": (4, 2, True),
}


# Each case, each head dimension and each dtype, in six compiled programs rather than twelve
# (compiling is most of the time here): every case with both head dimensions and both dtypes.
GRID = [
    ("causal", 128, jnp.bfloat16),
    ("causal", 64, jnp.float32),
    ("gqa", 128, jnp.float32),
    ("gqa", 64, jnp.bfloat16),
    ("packed_qa", 128, jnp.bfloat16),
    ("packed_qa", 64, jnp.float32),
]
# The demo's world model on one chip (`recipes/demo.py --platform tpu`): heads of 32, rows of
# 832 tokens in blocks of 208 (896 and 224 in its first stage), blocks that are not multiples
# of the chip's 128 lanes.
DEMO_GRID = [("packed_qa", 32, jnp.bfloat16, 832, 208), ("packed_qa", 32, jnp.float32, 896, 224)]


@pytest.mark.parametrize(
    ("case", "head_dim", "dtype", "seq", "block"),
    [(*g, SEQ, BLOCK) for g in GRID] + DEMO_GRID,
)
def test_compiled_pallas_kernel_equals_dense(case, head_dim, dtype, seq, block):
    h, kvh, packed = CASES[case]
    q, k, v, ct = inputs(h, kvh, head_dim, dtype, seq=seq)
    kw = {}
    if packed:
        pos, seg = packed_qa_row(q.shape[0], seq)
        kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)

    def ours(kernel):
        return lambda q, k, v: blockwise_attention(
            q, k, v, causal=True, block_q=block, block_k=block, kernel=kernel, **kw
        )

    lowered = jax.jit(ours("pallas")).lower(q, k, v).as_text()
    assert "tpu_custom_call" in lowered  # Mosaic, not the interpreter
    want = reference(lambda q, k, v: dense_attention(q, k, v, **kw), q, k, v, ct)
    pallas = errors(ours("pallas"), want, q, k, v, ct)
    xla = errors(ours("xla"), want, q, k, v, ct)
    for name, p, x in zip(("out", "dq", "dk", "dv"), pallas, xla, strict=True):
        assert p <= 2e-2, (name, p)
        assert p <= 2 * x + 1e-3, (name, p, x)


def test_ring_steps_on_one_chip_equal_dense():
    """The ring's per-step kernel calls on the chip: a one-device ring in the zigzag layout
    (its two half-shards as the pieces) with the Pallas kernel, packed rows, GQA."""
    q, k, v, ct = inputs(8, 2, 128, jnp.bfloat16)
    pos, seg = packed_qa_row(q.shape[0])
    perm = zigzag_permutation(SEQ, 1)
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    mesh = jax.make_mesh(
        (1, 1, 1, 1),
        ("dp", "fsdp", "sp", "tp"),
        axis_types=(jax.sharding.AxisType.Auto,) * 4,
        devices=jax.devices()[:1],
    )
    zig = {name: x[:, perm] for name, x in kw.items()}

    def ring(q, k, v):
        return ring_attention(
            q, k, v, mesh=mesh, block_q=BLOCK, block_k=BLOCK, kernel="pallas", layout="zigzag",
            **zig,
        )  # fmt: skip

    args = [x[:, perm] for x in (q, k, v, ct)]
    errs = errors(ring, reference(lambda q, k, v: dense_attention(q, k, v, **zig), *args), *args)
    assert max(errs) <= 2e-2, errs


def test_dead_blocks_are_never_read():
    """Keys and values of blocks that no query may see (a later document's, and everything
    above the causal diagonal) are NaN: the compiled kernel skips those tiles, so the output
    stays finite and equal to the unpoisoned one. A kernel that computed every tile and
    masked afterwards would carry the NaN (0 x NaN is NaN)."""
    q, k, v, _ = inputs(4, 4, 128, jnp.float32, b=1)
    seg = jnp.asarray(np.repeat(np.arange(4), SEQ // 4)[None], jnp.int32)  # 4 documents of 512
    pos = jnp.asarray(np.tile(np.arange(SEQ // 4), 4)[None], jnp.int32)
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)

    def attend(k, v):
        return blockwise_attention(q, k, v, block_q=BLOCK, block_k=BLOCK, kernel="pallas", **kw)

    clean = jax.jit(attend)(k, v)
    # Only the last document's own block is ever live for the last query block; poison the
    # last block's keys for every earlier query block, i.e. make the last document NaN and
    # check the first three documents' outputs.
    poisoned_k = k.at[:, 3 * BLOCK :].set(jnp.nan)
    poisoned_v = v.at[:, 3 * BLOCK :].set(jnp.nan)
    out = jax.jit(attend)(poisoned_k, poisoned_v)
    assert bool(jnp.all(jnp.isfinite(out[:, : 3 * BLOCK])))
    np.testing.assert_array_equal(
        np.asarray(out[:, : 3 * BLOCK]), np.asarray(clean[:, : 3 * BLOCK])
    )


@pytest.mark.parametrize(("config", "seq", "block"), [("debug", 512, 128), ("demo", 832, 208)])
def test_model_logits_with_pallas_equal_xla(config, seq, block):
    """A model's logits with the Pallas kernel against the XLA kernel, same parameters, packed
    documents, on the chip: the debug model (heads of 16), and the demo's world model at its
    rows and blocks on one chip (heads of 32, blocks of 208). And causal: the Pallas logits
    before a position do not move when every token after it changes (a kernel that let a query
    see a later key would train to a loss no model that generates can reach)."""
    from flax import nnx

    from lwm.config import load_config
    from lwm.model import create_model

    cfg = load_config(str(ROOT / f"configs/{config}.yaml")).model.model_copy(
        update=dict(attention="blockwise", block_q=block, block_k=block, max_seq_len=seq)
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.text_vocab_size, (2, seq))
    later = tokens.copy()
    cut = seq // 2 + 3  # inside a block, not at its edge
    later[:, cut:] = rng.integers(0, cfg.text_vocab_size, (2, seq - cut))
    first = seq * 2 // 5  # two documents, positions restarting at the second
    seg = jnp.asarray(np.where(np.arange(seq) < first, 1, 2)[None].repeat(2, 0), jnp.int32)
    pos = np.where(np.arange(seq) < first, np.arange(seq), np.arange(seq) - first)
    pos = jnp.asarray(pos[None].repeat(2, 0), jnp.int32)
    vision = jnp.zeros((2, seq), bool)
    logits = {}
    for kernel in ("xla", "pallas"):
        model = create_model(cfg.model_copy(update=dict(attention_kernel=kernel)), seed=0)

        @nnx.jit
        def forward(model, tokens):
            return model(tokens=tokens, vision_mask=vision, positions=pos, segment_ids=seg)[0]

        logits[kernel] = np.asarray(forward(model, jnp.asarray(tokens, jnp.int32)), np.float32)
    later_logits = np.asarray(forward(model, jnp.asarray(later, jnp.int32)), np.float32)  # pallas
    scale = np.max(np.abs(logits["xla"]))
    assert np.max(np.abs(logits["pallas"] - logits["xla"])) <= 1e-2 * scale
    moved = np.abs(later_logits - logits["pallas"])
    assert np.max(moved[:, :cut]) <= 1e-6 * scale, np.argwhere(moved[:, :cut] > 1e-6 * scale)[:5]
    assert np.max(moved[:, cut:]) > 1e-2 * scale  # the change reaches the positions after it


def test_attention_saveable_runs_the_forward_kernel_once():
    """With `attention_saveable` the compiled gradient of rematerialised layers (scanned, as
    the model runs them) calls the Pallas forward kernel once per layer, then the two backward
    kernels: the recomputation for the backward pass finds attention's output saved. With
    ``nothing_saveable`` the forward kernel runs twice. (One call site per kernel in the
    program: the layers are a loop.)"""
    from lwm.model import REMAT_POLICIES

    x = jnp.ones((1, SEQ, 8, 128), jnp.bfloat16)
    ws = jnp.full((2, 3, 128, 128), 0.01, jnp.bfloat16)  # two layers

    def layer(x, w):
        q, k, v = (x @ w[i] for i in range(3))
        out = blockwise_attention(q, k, v, block_q=BLOCK, block_k=BLOCK, kernel="pallas")
        return x + out, None

    calls = {}
    for policy in ("nothing_saveable", "attention_saveable"):
        body = jax.checkpoint(layer, policy=REMAT_POLICIES[policy])

        def loss(x, ws, body=body):
            return jax.lax.scan(body, x, ws)[0].astype(jnp.float32).sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        calls[policy] = grad.lower(x, ws).compile().as_text().count('"tpu_custom_call"')
    assert calls == {"nothing_saveable": 4, "attention_saveable": 3}, calls


def test_narrow_heads_are_read_where_they_lie(monkeypatch):
    """Heads of 64 (narrower than the 128 lanes): the chip lays ``[.., seq, 64]`` arrays out
    with the sequence minor, and the kernel reads them so (`seq_minor_q`): the compiled
    forward and backward, given ``[batch, heads, seq, 64]`` arrays as a model's projections
    give them, plans less temporary memory than one copy of q (8K tokens, 32 heads: 16 MiB,
    32 MiB padded to 128 lanes), where the head-dim-minor kernel copies q, k, v, dO and the
    outputs in and out (320 MiB, compiled for a v5e chip)."""
    import lwm.attention.blockwise as blockwise_module

    b, s, h, d = 1, 8192, 32, 64
    arr = jax.ShapeDtypeStruct((b, h, s, d), jnp.bfloat16)

    def temp() -> int:
        def grads(q, k, v, ct):  # a new function each time: traced again, not cached
            def loss(q, k, v):
                q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
                out = blockwise_attention(q, k, v, block_q=1024, block_k=1024, kernel="pallas")
                return jnp.sum(jnp.swapaxes(out, 1, 2).astype(jnp.float32) * ct)

            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

        compiled = jax.jit(grads).lower(arr, arr, arr, arr).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one_copy = b * s * h * d * 2
    seq_minor = temp()
    monkeypatch.setattr(blockwise_module, "SEQ_MINOR_BELOW", 0)
    head_dim_minor = temp()
    assert seq_minor < one_copy < head_dim_minor, (seq_minor, head_dim_minor)


def test_lwm_train_runs_on_the_chip(tmp_path, capsys):
    """A short `lwm train` of configs/tiny.yaml on the chip, in this process (a second process
    could not open the chip this one holds): it names the TPU and the Pallas kernel in its
    first lines, trains, and its losses are finite."""
    from lwm.cli import main

    out = tmp_path / "run"
    status = main(
        ["train", "--config", str(ROOT / "configs/tiny.yaml"), "train.steps=6"]
        + ["train.log_every=2", f"train.output_dir={out}"]
    )
    err = capsys.readouterr().err
    assert status == 0, err[-3000:]
    head = "\n".join(err.splitlines()[:10]).lower()
    assert "tpu" in head and "pallas" in head, head
    losses = [
        json.loads(line)["loss"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if "loss" in json.loads(line)
    ]
    assert losses and all(np.isfinite(losses)), losses


def test_the_vqgans_random_draws_are_the_cpus():
    """The VQGAN's training draws its dead-code restarts from `vqgan.train._key`: on the chip
    the same bits as on the host's CPU, so that a seed trains the same VQGAN on either, up to
    the rounding of their arithmetic (with "rbg" keys the backends drew different bits)."""
    from vqgan.train import _key

    def draws(device):
        with jax.default_device(device):
            key = jax.random.fold_in(_key(0), 7)
            picks = jax.random.randint(key, (256,), 0, 10_000)
            return np.asarray(picks), np.asarray(jax.random.bits(key, (64, 8)))

    on_chip, on_cpu = draws(jax.devices()[0]), draws(jax.devices("cpu")[0])
    assert jax.devices()[0].platform == "tpu"
    for a, b in zip(on_chip, on_cpu, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_vqgans_codes_are_the_cpus():
    """The VQGAN's code search on the chip finds the float64 nearest code, as on a CPU, for
    latents near the boundary of two codes, where the chip's default precision does not: a
    frame gets the same codes whichever machine tokenizes it."""
    from tokenize_helpers import near_tie_latents

    from vqgan.quantizer import nearest_codes

    assert jax.devices()[0].platform == "tpu"
    z, emb, nearest = near_tie_latents()
    codes = jax.jit(nearest_codes)(jnp.asarray(z), jnp.asarray(emb))
    np.testing.assert_array_equal(np.asarray(codes), nearest)
    default = jax.jit(lambda z, e: jnp.argmin(jnp.sum(e * e, axis=1)[None] - 2.0 * z @ e.T, axis=1))
    assert (np.asarray(default(jnp.asarray(z), jnp.asarray(emb))) != nearest).mean() > 0.1


def test_the_vqgan_at_highest_precision_encodes_as_the_cpu():
    """With `model.matmul_precision: highest` the VQGAN's latents on the chip are the CPU's up
    to float32 rounding (1e-4), and the codes the same but for near ties (at most 1 in 1,000):
    a dataset tokenized on a chip is the one a CPU would write."""
    from flax import nnx
    from tokenize_helpers import TINY_VQGAN

    from vqgan.config import VQGANModelConfig
    from vqgan.model import init_model

    cfg = VQGANModelConfig(**TINY_VQGAN, matmul_precision="highest")
    graphdef, state = nnx.split(init_model(cfg, seed=3))
    frames = np.random.default_rng(0).uniform(-1, 1, (64, 16, 16, 3)).astype(np.float32)

    def encode(device):
        s, x = jax.device_put((state, frames), device)
        out = jax.jit(lambda s, x: nnx.merge(graphdef, s).encode(x))(s, x)
        return np.asarray(out.latents), np.asarray(out.codes)

    (z_chip, codes_chip), (z_cpu, codes_cpu) = (
        encode(jax.devices()[0]),
        encode(jax.devices("cpu")[0]),
    )
    assert jax.devices()[0].platform == "tpu"
    np.testing.assert_allclose(z_chip, z_cpu, rtol=1e-4, atol=1e-4)
    assert (codes_chip == codes_cpu).mean() >= 0.999


def test_vqgan_weights_written_on_the_chip_read_back_the_same(tmp_path):
    """`save_weights` of a VQGAN whose parameters live on the chip writes each tensor as it is:
    the chip hands some of them (the demo VQGAN's 3x3 and 1x1 kernels with few output channels,
    its codebook) to the host in a layout other than row-major, and before they were made
    row-major the file held them scrambled (a 30 dB VQGAN read back at 7 dB)."""
    from flax import nnx

    from vqgan.config import load_vqgan_config
    from vqgan.model import init_model
    from vqgan.weights import _flat_params, load_weights, save_weights

    cfg = load_vqgan_config(ROOT / "configs" / "vqgan" / "demo.yaml", ["data.manifest=none"])
    model = init_model(cfg.model, seed=3)
    nnx.update(model, jax.device_put(nnx.state(model), jax.devices()[0]))
    assert jax.devices()[0].platform == "tpu"
    on_chip = {k: np.array(jax.device_get(v)) for k, v in _flat_params(model).items()}
    save_weights(tmp_path, model, cfg)
    loaded, _ = load_weights(tmp_path)
    for name, value in _flat_params(loaded).items():
        np.testing.assert_array_equal(np.asarray(value), on_chip[name], err_msg=name)
