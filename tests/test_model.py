"""The LWM transformer: parameter table, sharding, and equality across meshes and layouts."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from data.batches import next_token_targets
from data.tokens import frame_cells, frame_window
from lwm.attention.layout import apply_layout, zigzag_permutation
from lwm.base.mesh import make_mesh
from lwm.config import load_config
from lwm.info import param_specs
from lwm.loss import lwm_loss
from lwm.model import create_model


def debug_cfg(**overrides):
    cfg = load_config("configs/debug.yaml").model
    return cfg.model_copy(update=overrides)


def flat_state(model) -> dict[str, jax.Array]:
    return {
        ".".join(str(k) for k in path): v[...]
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def make_batch(cfg, b=2, s=64, seed=0):
    """Two packed documents per row, each text then a short vision span."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.text_vocab_size, (b, s)).astype(np.int32)
    vision = np.zeros((b, s), bool)
    vision[:, 8:24] = True
    vision[:, 40:56] = True
    tokens[vision] = rng.integers(0, 8194, int(vision.sum()))
    segment_ids = np.where(np.arange(s) < 32, 1, 2)[None].repeat(b, 0).astype(np.int32)
    positions = np.where(np.arange(s) < 32, np.arange(s), np.arange(s) - 32)[None].repeat(b, 0)
    loss_mask = np.ones((b, s), np.float32)
    loss_mask[:, :4] = 0  # a prompt
    return dict(
        tokens=jnp.asarray(tokens),
        vision_mask=jnp.asarray(vision),
        positions=jnp.asarray(positions, jnp.int32),
        segment_ids=jnp.asarray(segment_ids),
        loss_mask=jnp.asarray(loss_mask),
    )


def loss_and_grads(model, batch, perm=None):
    targets = next_token_targets(
        batch["tokens"], batch["vision_mask"], batch["loss_mask"], batch["segment_ids"]
    )
    inputs = {k: batch[k] for k in ("tokens", "vision_mask", "positions", "segment_ids")}
    if perm is not None:  # the layout is applied once, at the model input
        # In a ring layout the model cannot find frames: the loader gives each code's cell.
        inputs["cells"] = frame_cells(batch["tokens"], batch["vision_mask"])
        if model.cfg.vision_window:  # and each code's neighbours
            inputs["window"] = frame_window(
                batch["tokens"],
                batch["vision_mask"],
                model.cfg.vision_grid,
                model.cfg.vision_window,
            )
        inputs, targets = apply_layout((inputs, targets), perm)

    def loss_fn(model):
        text, vision = model(**inputs)
        return lwm_loss(text, vision, targets)

    (loss, metrics), grads = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(model)
    return loss, metrics, flat_state_of(grads)


def flat_state_of(state) -> dict[str, jax.Array]:
    return {".".join(str(k) for k in path): v[...] for path, v in nnx.to_flat_state(state)}


def test_vision_grid_adds_each_codes_row_and_column_embedding():
    """With vision_grid (2, 3): a code's input is its code embedding plus the row and column
    embeddings of its cell (raster order from the frame's start); text and markers get
    nothing added; without vision_grid a code's input is its code embedding alone."""
    model = create_model(debug_cfg(vision_grid=(2, 3)))
    frame = [7, 8, 9, 10, 11, 12]
    tokens = np.asarray([[1, 2, *frame, 8192, *frame[:4], 5]], np.int32)
    vision = np.asarray([[0, 0] + [1] * 11 + [0]], bool)
    cells = [None, None, 0, 1, 2, 3, 4, 5, None, 0, 1, 2, 3, None]
    x = np.asarray(model.embed(jnp.asarray(tokens), jnp.asarray(vision)))
    vis, text = np.asarray(model.embed_vision[...]), np.asarray(model.embed_text[...])
    row, col = np.asarray(model.embed_vision_row[...]), np.asarray(model.embed_vision_col[...])
    for i, (t, v, c) in enumerate(zip(tokens[0], vision[0], cells, strict=True)):
        want = (vis if v else text)[t] + (0 if c is None else row[c // 3] + col[c % 3])
        np.testing.assert_allclose(x[0, i], want, rtol=1e-6, atol=1e-7)
    plain = create_model(debug_cfg())
    got = np.asarray(plain.embed(jnp.asarray(tokens), jnp.asarray(vision)))
    np.testing.assert_array_equal(got[0, 2], np.asarray(plain.embed_vision[...])[7])
    assert not hasattr(plain, "embed_vision_row")


def test_vision_window_adds_each_neighbours_code_embedding():
    """With vision_window 1 on 2x3 codes: a code's input is its code, row and column
    embeddings plus, for each offset of `window_offsets` (left, up-left, up, up-right), the
    embedding of the code there from that offset's table, where the neighbour is in the frame."""
    model = create_model(debug_cfg(vision_grid=(2, 3), vision_window=1))
    frame = [7, 8, 9, 10, 11, 12]  # rows [7 8 9], [10 11 12]
    tokens = np.asarray([[1, 2, *frame, 8192, *frame[:4], 5]], np.int32)
    vision = np.asarray([[0, 0] + [1] * 11 + [0]], bool)
    neighbours = {  # cell -> (left, up-left, up, up-right)
        0: (None, None, None, None),
        1: (7, None, None, None),
        2: (8, None, None, None),
        3: (None, None, 7, 8),
        4: (10, 7, 8, 9),
        5: (11, 8, 9, None),
    }
    cells = [None, None, 0, 1, 2, 3, 4, 5, None, 0, 1, 2, 3, None]
    x = np.asarray(model.embed(jnp.asarray(tokens), jnp.asarray(vision)))
    vis, text = np.asarray(model.embed_vision[...]), np.asarray(model.embed_text[...])
    row, col = np.asarray(model.embed_vision_row[...]), np.asarray(model.embed_vision_col[...])
    table = np.asarray(model.embed_vision_window[...])
    assert table.shape == (4, 8192, 64)
    for i, (t, v, c) in enumerate(zip(tokens[0], vision[0], cells, strict=True)):
        want = (vis if v else text)[t]
        if c is not None:
            want = want + row[c // 3] + col[c % 3]
            for k, code in enumerate(neighbours[c]):
                want = want + (0 if code is None else table[k, code])
        np.testing.assert_allclose(x[0, i], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scan", [True, False])
def test_parameters_follow_the_table(scan):
    cfg = debug_cfg(scan_layers=scan)
    model = create_model(cfg)
    params = flat_state(model)
    specs = param_specs(cfg)
    assert sorted(params) == sorted(specs)
    for name, spec in specs.items():
        assert params[name].shape == spec.shape, name


def test_large_parameters_are_sharded_on_full_mesh():
    cfg = debug_cfg(hidden_size=128, intermediate_size=512, num_heads=4, num_kv_heads=2)
    mesh = make_mesh("1,2,2,2")
    model = create_model(cfg, mesh=mesh)
    for name, value in flat_state(model).items():
        if value.size <= 64 * 1024:
            continue
        spec = value.sharding.spec
        used = {
            a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)
        }
        assert {"fsdp", "sp"} <= used, f"{name} {value.shape} is sharded as {spec}"
        shard = value.addressable_shards[0].data
        assert math.prod(shard.shape) <= value.size // 4, name


def test_sharded_init_equals_single_device_init():
    cfg = debug_cfg()
    single = flat_state(create_model(cfg, seed=3))
    sharded = flat_state(create_model(cfg, mesh=make_mesh("1,2,2,2"), seed=3))
    for name in single:  # the same random draws; jit and eager may round the last bit apart
        np.testing.assert_allclose(np.asarray(sharded[name]), np.asarray(single[name]), rtol=1e-6)


_DENSE = {}


def dense_reference(grid=None, window=0):
    """The loss, metrics and gradients of the dense debug model (seed 0) on `make_batch`'s
    batch, computed once per (vision_grid, vision_window) for the whole module: the tests
    below compare a dozen other layouts and kernels with the same three references, and each
    computation is a program to trace and compile (a few seconds each)."""
    if (grid, window) not in _DENSE:
        cfg = debug_cfg(attention="dense", vision_grid=grid, vision_window=window)
        _DENSE[grid, window] = loss_and_grads(create_model(cfg), make_batch(debug_cfg()))
    return _DENSE[grid, window]


def _assert_close(a: dict, b: dict, rtol: float):
    for name in a:
        scale = float(jnp.max(jnp.abs(b[name]))) or 1.0
        err = float(jnp.max(jnp.abs(a[name] - b[name])))
        assert err <= rtol * scale, f"{name}: {err} > {rtol} x {scale}"


@pytest.mark.parametrize(
    "mesh_shape,zigzag,attention,kernel,grid,window",
    [
        ("1,2,2,2", False, "ring", "xla", None, 0),
        ("1,1,8,1", True, "ring", "xla", None, 0),
        ("1,2,2,2", True, "ring", "xla", None, 0),
        ("1,2,2,2", False, "blockwise", "xla", None, 0),
        ("1,2,2,2", True, "ring", "pallas", None, 0),  # remat, scan, the Pallas block kernel
        pytest.param(  # cuDNN's schedule, its kernels computed by their dense stand-in
            "1,2,2,2",
            True,
            "ring",
            "cudnn",
            None,
            0,
            id="1,2,2,2-True-ring-cudnn_schedule_with_standin-None-0",
        ),
        ("1,2,2,2", True, "ring", "xla", (2, 4), 0),  # code cells from the loader, permuted
        ("1,2,2,2", True, "ring", "xla", (2, 4), 2),  # and each code's neighbours
    ],
)
def test_sharded_model_equals_dense_on_one_device(
    mesh_shape, zigzag, attention, kernel, grid, window
):
    batch = make_batch(debug_cfg())
    ref_loss, ref_metrics, ref_grads = dense_reference(grid, window)
    mesh = make_mesh(mesh_shape)
    perm = zigzag_permutation(64, mesh.shape["sp"]) if zigzag else None
    cfg = debug_cfg(
        attention=attention,
        block_q=4,
        block_k=4,
        attention_kernel=kernel,
        vision_grid=grid,
        vision_window=window,
    )
    model = create_model(cfg, mesh=mesh)
    loss, metrics, grads = loss_and_grads(model, batch, perm)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for key in ("text_accuracy", "vision_accuracy", "text_tokens", "vision_tokens"):
        assert float(metrics[key]) == pytest.approx(float(ref_metrics[key]), rel=1e-6), key
    _assert_close(grads, ref_grads, 1e-5)


def test_blockwise_remat_and_chunked_mlp_do_not_change_results():
    batch = make_batch(debug_cfg())
    assert debug_cfg().remat_policy == "none"
    ref = dense_reference()
    for overrides in (
        dict(attention="blockwise", remat_policy="nothing_saveable", mlp_chunk_size=16),
        dict(attention="blockwise", remat_policy="dots_saveable", scan_layers=True),
        dict(attention="blockwise", remat_policy="attention_saveable", attention_kernel="pallas"),
        dict(attention="blockwise", remat_policy="attention_dots_saveable", block_q=16),
        dict(attention="blockwise", remat_policy="attention_saveable", offload_layer_inputs=True),
    ):
        got = loss_and_grads(create_model(debug_cfg(**overrides)), batch)
        assert abs(float(got[0]) - float(ref[0])) <= 1e-5 * abs(float(ref[0]))
        _assert_close(got[2], ref[2], 1e-5)


def test_chunked_mlp_over_a_sharded_sequence_equals_dense():
    """`model.mlp_chunk_size` with the sequence sharded (sp = 2: strided chunks that keep the
    sharding) gives the loss and gradients of the unchunked dense model."""
    batch = make_batch(debug_cfg())
    assert debug_cfg().remat_policy == "none"
    ref = dense_reference()
    cfg = debug_cfg(attention="ring", block_q=4, block_k=4, mlp_chunk_size=16, zigzag=False)
    got = loss_and_grads(create_model(cfg, mesh=make_mesh("1,2,2,2")), batch)
    assert abs(float(got[0]) - float(ref[0])) <= 1e-5 * abs(float(ref[0]))
    _assert_close(got[2], ref[2], 1e-5)


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_attention_saveable_keeps_the_kernels_output_across_the_remat(kernel, capsys):
    """What `attention_saveable` saves for the backward pass of a layer: its inputs and the
    attention kernel's output and log-sum-exp, so that recomputing the layer needs no attention
    (on a TPU the compiled step then calls the forward kernel once per layer, not twice:
    tests/test_tpu.py). ``nothing_saveable`` saves the inputs only."""
    from jax.ad_checkpoint import print_saved_residuals

    from lwm.attention.blockwise import blockwise_attention
    from lwm.model import REMAT_POLICIES

    b, s, h, d = 1, 64, 2, 8

    def layer(x, w):
        q, k, v = ((x @ w[i]).reshape(b, s, h, d) for i in range(3))
        o = blockwise_attention(q, k, v, block_q=16, block_k=16, kernel=kernel)
        return o.reshape(b, s, h * d) @ w[3]

    x, w = jnp.ones((b, s, h * d)), jnp.full((4, h * d, h * d), 0.01)
    saved = {}
    for policy in ("nothing_saveable", "attention_saveable", "attention_dots_saveable"):
        print_saved_residuals(jax.checkpoint(layer, policy=REMAT_POLICIES[policy]), x, w)
        saved[policy] = capsys.readouterr().out.splitlines()
    assert len(saved["nothing_saveable"]) == 2, saved  # x and w
    names = [line for line in saved["attention_saveable"] if "named" in line]
    assert len(saved["attention_saveable"]) == 4, saved
    assert any("'attention_out'" in n for n in names) and any("'attention_lse'" in n for n in names)
    dots = [line for line in saved["attention_dots_saveable"] if "dot_general" in line]
    assert len(dots) == 3 and len(saved["attention_dots_saveable"]) == 7, saved  # and q, k, v


def test_offload_layer_inputs_keeps_the_layer_inputs_on_the_host(capsys):
    """`model.offload_layer_inputs`: the layer scan's saved inputs (one per layer) live in
    host memory, not on the device, and nothing else moves."""
    from jax.ad_checkpoint import print_saved_residuals

    batch = make_batch(debug_cfg(), b=1, s=32)
    cfg = debug_cfg(attention="blockwise", remat_policy="nothing_saveable")
    saved = {}
    for offload in (False, True):
        model = create_model(cfg.model_copy(update=dict(offload_layer_inputs=offload)))
        graphdef, params = nnx.split(model)

        def hidden(params, graphdef=graphdef):
            m = nnx.merge(graphdef, params)
            return m.hidden_states(batch["tokens"], batch["vision_mask"]).sum()

        print_saved_residuals(hidden, params)
        saved[offload] = capsys.readouterr().out.splitlines()
    layers, hid = cfg.num_layers, cfg.hidden_size
    stacked = f"[{layers},1,32,{hid}] output of scan"  # the layers' inputs, stacked
    assert [line for line in saved[False] if stacked in line and "<host>" not in line]
    assert not [line for line in saved[True] if stacked in line and "<host>" not in line]
    assert [line for line in saved[True] if stacked in line and "<host>" in line]
    assert len(saved[True]) == len(saved[False])


def test_loss_targets_respect_segments_and_loss_mask():
    tokens = jnp.asarray([[5, 6, 7, 8, 9, 10]])
    vision = jnp.asarray([[False, False, True, True, False, False]])
    loss_mask = jnp.asarray([[0, 1, 0, 1, 1, 1]], jnp.float32)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2]])
    t = next_token_targets(tokens, vision, loss_mask, seg)
    assert t.tokens.tolist() == [[6, 7, 8, 9, 10, 0]]
    assert t.is_vision.tolist() == [[False, True, True, False, False, False]]
    # No target where the next token is not trained (position 1 -> 2), across the segment
    # boundary (position 2 -> 3) or past the end.
    assert t.weight.tolist() == [[1, 0, 0, 1, 1, 0]]


def test_loss_is_balanced_between_modalities():
    # Perfect text logits, uniform vision logits: loss = 0.5 * 0 + 0.5 * log(V).
    b, s, vt, vv = 1, 4, 16, 32
    targets = next_token_targets(
        jnp.asarray([[1, 2, 3, 4]]), jnp.asarray([[False, False, True, True]]), jnp.ones((1, 4))
    )
    text = jax.nn.one_hot(targets.tokens, vt) * 1e4
    vision = jnp.zeros((b, s, vv))
    loss, m = lwm_loss(text, vision, targets)
    assert float(m["text_loss"]) == pytest.approx(0.0, abs=1e-3)
    assert float(m["vision_loss"]) == pytest.approx(math.log(vv), rel=1e-5)
    assert float(loss) == pytest.approx(0.5 * math.log(vv), rel=1e-4)
    assert float(m["text_tokens"]) == 1 and float(m["vision_tokens"]) == 2
    # Accuracy counts weighted targets only: the perfect text logits hit their one target;
    # the uniform vision logits pick code 0, the token of no vision target (the last
    # position's target, 0, has weight 0).
    assert float(m["text_accuracy"]) == 1.0
    assert float(m["vision_accuracy"]) == 0.0


def test_cross_entropy_and_its_gradient_match_a_numpy_reference():
    """`loss_sums`' cross-entropy (the target's logit taken by a masked sum) against float64
    numpy: the summed NLL, and its gradient softmax - one_hot per weighted position."""
    from lwm.loss import _cross_entropy

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((2, 9, 50)) * 4).astype(np.float32)
    targets = rng.integers(0, 50, (2, 9))
    weight = (rng.random((2, 9)) > 0.3).astype(np.float32)
    x = logits.astype(np.float64)
    logz = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    picked = np.take_along_axis(x, targets[..., None], -1)[..., 0]
    want = ((logz - picked) * weight).sum()
    softmax = np.exp(x - logz[..., None])
    want_grad = (softmax - np.eye(50)[targets]) * weight[..., None]

    def nll(lg):
        return _cross_entropy(lg, jnp.asarray(targets), jnp.asarray(weight))[0]

    got, grad = jax.value_and_grad(nll)(jnp.asarray(logits))
    assert float(got) == pytest.approx(want, rel=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, atol=1e-6)


@pytest.mark.parametrize("attention", ["blockwise", "dense"])
def test_matmul_precision_reaches_every_product_forward_and_backward(attention):
    """`model.matmul_precision: highest`: every matrix product of the gradient of the model's
    logits (projections, MLP, heads, attention's forward and its custom backward) carries
    HIGHEST; with ``default`` none does (on TPUs: one bfloat16 pass for float32)."""
    import re

    tokens, vision = jnp.zeros((1, 64), jnp.int32), jnp.zeros((1, 64), bool)
    counts = {}
    for precision in ("default", "highest"):
        cfg = debug_cfg(attention=attention, block_q=16, block_k=16, matmul_precision=precision)
        graphdef, params = nnx.split(create_model(cfg))

        def f(params, graphdef=graphdef):
            m = nnx.merge(graphdef, params)
            text, image = m.logits(m.hidden_states(tokens, vision))
            return text.sum() + image.sum()

        dots = re.findall(r"stablehlo.dot_general.*", jax.jit(jax.grad(f)).lower(params).as_text())
        counts[precision] = (len(dots), sum("HIGHEST" in d for d in dots))
    n = counts["default"][0]
    assert n > 20 and counts == {"default": (n, 0), "highest": (n, n)}, counts


def test_rope_in_the_compute_dtype_is_within_bfloat16_rounding_of_float32():
    """`model.rope_dtype: compute`: a float32 model is unchanged to the bit; a bfloat16
    model's hidden states stay within bfloat16 rounding of the float32 rotary embedding's."""
    batch = make_batch(debug_cfg(), b=1, s=32)
    out = {}
    for dtype in ("float32", "bfloat16"):
        for rope in ("float32", "compute"):
            cfg = debug_cfg(dtype=dtype, rope_dtype=rope)
            model = create_model(cfg, seed=0)
            h = model.hidden_states(batch["tokens"], batch["vision_mask"], batch["positions"])
            out[dtype, rope] = np.asarray(h, np.float32)
    np.testing.assert_array_equal(out["float32", "compute"], out["float32", "float32"])
    ref = out["float32", "float32"]
    scale = np.abs(ref).max()
    base = np.abs(out["bfloat16", "float32"] - ref).max()  # bfloat16 compute's own error
    err = np.abs(out["bfloat16", "compute"] - ref).max()
    assert not np.array_equal(out["bfloat16", "compute"], out["bfloat16", "float32"])
    assert err <= 2 * base + 1e-2 * scale, (err, base, scale)


def test_partial_rotary_matches_a_per_pair_reference():
    """`model.rope_dims`: the first r dimensions of a head rotate as an r-wide rotary embedding
    (pairs i and i + r/2 by position * theta^(-2i/r)); the others pass through unchanged."""
    from lwm.model import apply_rope, rope_tables

    rng = np.random.default_rng(0)
    b, s, h, d, r, theta = 2, 7, 3, 16, 6, 100.0
    x = rng.standard_normal((b, s, h, d)).astype(np.float32)
    pos = rng.integers(0, 500, (b, s))
    want = x.copy()
    for i in range(r // 2):
        angle = pos * theta ** (-2 * i / r)
        c, sn = np.cos(angle)[..., None], np.sin(angle)[..., None]  # [b, s, 1]: every head
        a, z = x[..., i], x[..., i + r // 2]
        want[..., i] = a * c - z * sn
        want[..., i + r // 2] = z * c + a * sn
    cos, sin = rope_tables(jnp.asarray(pos), d, theta, r)
    # float32 angles of positions up to 500 against float64: within 1e-4
    np.testing.assert_allclose(np.asarray(apply_rope(jnp.asarray(x), cos, sin)), want, atol=1e-4)
    # rope_dims = head_dim is the full rotary embedding, bit for bit
    full = apply_rope(jnp.asarray(x), *rope_tables(jnp.asarray(pos), d, theta))
    same = apply_rope(jnp.asarray(x), *rope_tables(jnp.asarray(pos), d, theta, d))
    np.testing.assert_array_equal(np.asarray(full), np.asarray(same))


def test_partial_rotary_ring_model_equals_dense():
    """A ring model with `rope_dims` in the zigzag layout equals the dense model on one device,
    and its unrotated dimensions make the model differ from the full-rotary one."""
    batch = make_batch(debug_cfg())
    ref_loss, _, ref_grads = loss_and_grads(
        create_model(debug_cfg(attention="dense", rope_dims=8)), batch
    )
    full_loss, _, _ = dense_reference()
    assert float(full_loss) != float(ref_loss)
    mesh = make_mesh("1,2,4,1")
    model = create_model(debug_cfg(attention="ring", block_q=4, block_k=4, rope_dims=8), mesh=mesh)
    loss, _, grads = loss_and_grads(model, batch, zigzag_permutation(64, 4))
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    _assert_close(grads, ref_grads, 1e-5)


@pytest.mark.parametrize("rope_dims", [3, 1024])
def test_rope_dims_must_be_even_and_within_a_head(rope_dims):
    with pytest.raises(ValueError, match="rope_dims"):
        debug_cfg().model_validate({**debug_cfg().model_dump(), "rope_dims": rope_dims})


def test_inputs_of_other_shapes_are_one_clear_error():
    """Shapes the model cannot read are named before anything is traced deep (they were
    broadcasting errors inside attention, or JAX's IndivisibleError from a sharding)."""
    from lwm.base.mesh import MeshError

    cfg = debug_cfg(attention="ring")
    model = create_model(cfg, mesh=make_mesh("1,1,8,1"))
    tokens, mask = jnp.zeros((2, 64), jnp.int32), jnp.zeros((2, 64), bool)
    with pytest.raises(ValueError, match=r"vision_mask has shape \(2, 60\); the tokens \(2, 64\)"):
        model(tokens, mask[:, :60])
    with pytest.raises(ValueError, match=r"tokens must be \[batch, seq\], got shape \(64,\)"):
        model(tokens[0], mask[0])
    with pytest.raises(ValueError, match=r"positions has shape \(64,\)"):
        model(tokens, mask, jnp.arange(64))
    with pytest.raises(MeshError, match="sequence length 60 is not divisible by sp = 8"):
        model(tokens[:, :60], mask[:, :60])
