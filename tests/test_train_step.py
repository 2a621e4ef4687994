"""The training step: it learns, and it compiles ahead of time from abstract sharded state."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from data.batches import next_token_targets
from data.tokens import frame_cells
from lwm.base.mesh import make_mesh
from lwm.config import load_config
from lwm.info import memory_per_device
from lwm.model import create_model
from lwm.train_step import abstract_batch, abstract_train_state, make_optimizer, train_step


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_loss_falls_on_a_repeated_batch(optimizer):
    cfg = load_config("configs/debug.yaml").model
    model = create_model(cfg)
    graphdef, params = nnx.split(model, nnx.Param)
    tx, _ = make_optimizer(
        3e-3, warmup_steps=1, total_steps=30, schedule="constant", optimizer=optimizer
    )
    opt_state = tx.init(params)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (2, 32)).astype(np.int32)
    vision = np.zeros((2, 32), bool)
    vision[:, 16:] = True
    ones = np.ones((2, 32), np.float32)
    t = next_token_targets(tokens, vision, ones)
    batch = dict(
        tokens=tokens,
        vision_mask=vision,
        frame_cells=frame_cells(tokens, vision),
        positions=np.tile(np.arange(32), (2, 1)),
        segment_ids=np.ones((2, 32), np.int32),
        target_tokens=t.tokens,
        target_is_vision=t.is_vision,
        target_weight=t.weight,
    )
    step = jax.jit(lambda p, o, b: train_step(p, o, b, graphdef=graphdef, tx=tx))
    losses = []
    for _ in range(30):
        params, opt_state, metrics = step(params, opt_state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0], losses
    assert np.isfinite(float(metrics["grad_norm"]))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_train_step_compiles_from_abstract_sharded_state(optimizer):
    cfg = load_config("configs/debug.yaml").model
    mesh = make_mesh("1,2,2,2")
    tx, _ = make_optimizer(optimizer=optimizer)
    graphdef, params, opt_state = abstract_train_state(cfg, mesh, tx)
    batch = abstract_batch(mesh, 2, 256)
    compiled = (
        jax.jit(lambda p, o, b: train_step(p, o, b, graphdef=graphdef, tx=tx))
        .lower(params, opt_state, batch)
        .compile()
    )
    planned = memory_per_device(cfg, dict(mesh.shape), optimizer)
    batch_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(batch)) // 4  # fsdp x sp
    args = compiled.memory_analysis().argument_size_in_bytes
    # Arguments are the sharded parameters, optimizer moments and batch: nothing replicated.
    assert args <= 1.1 * (planned.params + planned.optimizer + batch_bytes) + 4096, (args, planned)


def test_muon_orthogonalises_the_block_matrices_and_leaves_the_rest_to_adamw():
    """One step from a fresh state: each layer's slice of a block matrix moves by an
    orthogonalised gradient (singular values near one, scaled to RMS 0.2 x lr); the
    embeddings, heads and norms move exactly as under AdamW with the same betas (Nesterov's
    form, as optax's Muon runs it)."""
    import optax

    from lwm.train_step import muon_dimension_numbers

    cfg = load_config("configs/debug.yaml").model
    graphdef, params = nnx.split(create_model(cfg), nnx.Param)
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
    lr = 1e-2
    muon, _ = make_optimizer(lr, schedule="constant", clip_norm=None, optimizer="muon")
    adamw = optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.0, nesterov=True)
    # jitted, as a train step runs them (called eagerly, each operation compiled its own)
    by_muon, _ = jax.jit(lambda g, p: muon.update(g, muon.init(p), p))(grads, params)
    by_adamw, _ = jax.jit(lambda g, p: adamw.update(g, adamw.init(p), p))(grads, params)

    numbers = muon_dimension_numbers(params)
    flat = jax.tree_util.tree_leaves_with_path(
        numbers, is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)
    )
    orthogonalised = sorted(jax.tree_util.keystr(k) for k, n in flat if n is not None)
    assert orthogonalised == sorted(
        f"['layers']['{name.split('.')[0]}']['{name.split('.')[1]}'].value"
        for name in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")
    )
    for (path, n), m, a in zip(
        flat, jax.tree.leaves(by_muon), jax.tree.leaves(by_adamw), strict=True
    ):
        if n is None:
            np.testing.assert_allclose(m, a, rtol=1e-5, atol=1e-9, err_msg=str(path))
            continue
        for layer in np.asarray(m):  # stacked: [layers, fan_in, fan_out]
            scale = lr * 0.2 * np.sqrt(max(layer.shape))
            sv = np.linalg.svd(-layer / scale, compute_uv=False)
            # five Newton-Schulz steps: singular values in about [0.68, 1.13], the gradient's
            # smallest few (a random square matrix has some near zero) not all the way up
            assert sv.max() < 1.2 and (sv > 0.6).mean() > 0.9, (path, sv)
    assert optax.tree.norm(by_muon) > 0


def test_muon_refuses_weight_decay_and_unknown_optimizers_are_named():
    with pytest.raises(ValueError, match="weight_decay is not supported with .*muon"):
        make_optimizer(optimizer="muon", weight_decay=0.1)
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        make_optimizer(optimizer="sgd")


def _assert_same_grads(ref, got) -> None:
    """Every leaf of ``got`` within 1e-5 of ``ref``'s largest magnitude, computed in numpy
    (float32, as jnp computes it; jnp's ops, called one by one, compiled one program per op
    and shape)."""
    for a, b in zip(ref, got, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        err = float(np.max(np.abs(a - b)))
        assert err <= 1e-5 * (float(np.max(np.abs(a))) + 1e-12), err


def _loss_and_grads(batch, **update):
    from lwm.train_step import loss_fn

    cfg = load_config("configs/debug.yaml").model.model_copy(
        update={"attention": "ring", "block_q": 4, "block_k": 4, **update}
    )
    graphdef, params = nnx.split(create_model(cfg, mesh=make_mesh("1,1,8,1")), nnx.Param)
    grad = jax.jit(jax.value_and_grad(lambda p, b, g=graphdef: loss_fn(p, g, b), has_aux=True))
    (loss, metrics), grads = grad(params, batch)
    return loss, metrics, jax.tree.leaves(grads)


@pytest.fixture(scope="module")
def full_logits():
    """A batch whose rows train on the second half of every document only (as a QA record
    trains on its answers), and the loss, metrics and gradients with every logit computed."""
    from data.batches import SyntheticTokenLoader
    from lwm.attention.layout import zigzag_permutation

    batch = next(
        SyntheticTokenLoader(
            batch_size=2, seq_len=64, text_vocab_size=256, layout=zigzag_permutation(64, 8)
        )
    )
    w = np.asarray(batch["target_weight"]).copy()
    w[:, ::2] = 0
    batch = dict(batch, target_weight=w)
    assert (w > 0).sum(axis=1).max() <= 32
    return batch, _loss_and_grads(batch)


@pytest.mark.parametrize(
    "options",
    [
        {"logits_chunk_size": 16},
        {"loss_positions": 40},
        {"loss_positions": 32, "logits_chunk_size": 8},
    ],
)
def test_chunked_or_gathered_logits_loss_equals_full_logits_loss(full_logits, options):
    """logits_chunk_size computes the same loss and gradients without all logits at once;
    loss_positions computes the heads only where rows are trained (here: half the tokens of
    every row are trained, so 32 positions hold all text targets)."""
    batch, (l0, m0, g0) = full_logits
    l1, m1, g1 = _loss_and_grads(batch, **options)
    assert abs(float(l1) - float(l0)) <= 1e-6 * abs(float(l0))
    assert float(m1.get("targets_dropped", 0)) == 0
    for key in m0:
        assert abs(float(m1[key]) - float(m0[key])) <= 1e-5 * max(1.0, abs(float(m0[key]))), key
    _assert_same_grads(g0, g1)


def test_loss_positions_counts_what_does_not_fit():
    from data.batches import SyntheticTokenLoader
    from lwm.train_step import loss_fn

    batch = next(SyntheticTokenLoader(batch_size=2, seq_len=64, text_vocab_size=256))
    w, is_vision = np.asarray(batch["target_weight"]), np.asarray(batch["target_is_vision"])
    trained = int(((w > 0) & ~is_vision).sum())  # text targets: only these need the text head
    assert trained > 32
    cfg = load_config("configs/debug.yaml").model.model_copy(update={"loss_positions": 16})
    graphdef, params = nnx.split(create_model(cfg), nnx.Param)
    _, metrics = jax.jit(lambda p, b: loss_fn(p, graphdef, b))(params, batch)
    assert float(metrics["targets_dropped"]) == trained - 2 * 16


def test_vision_codes_restrict_the_vision_softmax_to_the_codebook():
    """With vision_codes=N the vision loss is the cross-entropy over codes 0..N-1 and the two
    markers: computed here from the full logits of the same weights."""
    import jax.numpy as jnp

    from data.batches import SyntheticTokenLoader
    from data.tokens import EOF_ID
    from lwm.train_step import loss_fn

    batch = next(SyntheticTokenLoader(batch_size=2, seq_len=64, text_vocab_size=256))
    full_cfg = load_config("configs/debug.yaml").model
    graphdef, params = nnx.split(create_model(full_cfg), nnx.Param)
    restricted = nnx.graphdef(create_model(full_cfg.model_copy(update={"vision_codes": 512})))
    _, metrics = jax.jit(lambda p, b: loss_fn(p, restricted, b))(params, batch)

    def full_logits(p, b):  # jitted (called eagerly, each operation compiled its own)
        model = nnx.merge(graphdef, p)
        return model(b["tokens"], b["vision_mask"], b["positions"], b["segment_ids"])[1]

    vision = jax.jit(full_logits)(params, batch)
    cols = np.r_[0:512, EOF_ID, EOF_ID + 1]
    logits = np.asarray(vision)[..., cols]
    target = np.asarray(batch["target_tokens"])
    index = np.where(target >= EOF_ID, target - EOF_ID + 512, target)
    w = np.asarray(batch["target_weight"]) * np.asarray(batch["target_is_vision"])
    logz = np.asarray(jax.nn.logsumexp(jnp.asarray(logits), axis=-1))
    picked = np.take_along_axis(logits, index[..., None], axis=-1)[..., 0]
    expected = ((logz - picked) * w).sum() / w.sum()
    assert abs(float(metrics["vision_loss"]) - expected) <= 1e-5 * expected


def test_one_schedule_warms_up_linearly_then_decays_by_cosine():
    import math

    from lwm.base.schedule import warmup_schedule
    from vqgan.config import TrainConfig as VQGANTrainConfig
    from vqgan.train import _schedule as vqgan_schedule

    lr = warmup_schedule(1.0, warmup_steps=4, total_steps=14, end_ratio=0.1)
    np.testing.assert_allclose([float(lr(i)) for i in range(5)], [0.25, 0.5, 0.75, 1.0, 1.0])
    half = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10))  # 5 of the 10 decay steps
    assert float(lr(9)) == pytest.approx(half) and float(lr(14)) == pytest.approx(0.1)
    flat = warmup_schedule(2.0, warmup_steps=2, total_steps=9, kind="constant")
    assert [float(flat(i)) for i in (0, 1, 5, 50)] == [1.0, 2.0, 2.0, 2.0]
    # the language model's optimizer and the VQGAN's follow this one schedule
    _, lm = make_optimizer(1.0, warmup_steps=4, total_steps=14, end_learning_rate=0.1)
    vq = vqgan_schedule(
        VQGANTrainConfig(steps=14, warmup_steps=4, schedule="cosine", end_learning_rate_ratio=0.1),
        1.0,
    )
    for step in range(16):
        assert float(lm(step)) == pytest.approx(float(lr(step)))
        assert float(vq(step)) == pytest.approx(float(lr(step)))


def test_muon_momentum_is_split_by_layer_with_whole_matrices():
    """Muon's momentum of a stacked block matrix is split over the mesh by layer, each device
    holding its layers' matrices whole (Newton-Schulz needs them whole); AdamW's moments and
    parameters keep the parameters' sharding. On (1,2,2,2) with 4 layers: fsdp x sp = 4 ways by
    layer, tp stays on its matrix axis."""
    from lwm.train_step import layers_sharding

    cfg = load_config("configs/debug.yaml").model.model_copy(update={"num_layers": 4})
    mesh = make_mesh("1,2,2,2")
    tx, _ = make_optimizer(optimizer="muon")
    _, params, opt_state = abstract_train_state(cfg, mesh, tx)
    muon_mu = opt_state[1].inner_states["muon"].inner_state[0].mu
    by_path = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}
    checked = 0
    for path, mu in jax.tree_util.tree_leaves_with_path(muon_mu):
        if mu.ndim != 3:
            continue
        p = by_path[jax.tree_util.keystr(path)]
        shard = mu.sharding.shard_shape(mu.shape)
        assert shard[0] == 1, (jax.tree_util.keystr(path), mu.sharding.spec)
        spec = tuple(mu.sharding.spec)
        assert spec[0] == ("fsdp", "sp") and sorted(map(str, spec[1:])) == ["None", "tp"], spec
        tp_axis = spec.index("tp")
        whole = 3 - tp_axis  # the matrix axis that tp does not split: on every device whole
        assert shard[whole] == mu.shape[whole] and shard[tp_axis] * 2 == mu.shape[tp_axis]
        assert p.sharding.spec[0] is None  # the parameter itself is not split by layer
        checked += 1
    assert checked == 7  # q, k, v, o, gate, up, down
    # AdamW's moments keep their parameters' shardings (its update is elementwise)
    adamw, _ = make_optimizer(optimizer="adamw")
    _, _, adamw_state = abstract_train_state(cfg, mesh, adamw)
    for moments in (adamw_state[1][0].mu, adamw_state[1][0].nu):
        for path, m in jax.tree_util.tree_leaves_with_path(moments):
            assert m.sharding == by_path[jax.tree_util.keystr(path)].sharding, path
    # a layer count no mesh axis divides keeps the parameter's sharding
    one = jax.tree.leaves(params["layers"]["attn"]["q"])[0].sharding
    assert layers_sharding(one, 3) == one


def _one_document(batch: dict, order: np.ndarray) -> dict:
    """``batch`` with every row one document in ``order`` (as long-context rows are)."""
    positions = np.broadcast_to(order, batch["positions"].shape).astype(np.int32)
    return dict(batch, segment_ids=np.ones_like(batch["segment_ids"]), positions=positions)


def test_one_document_rows_are_recognised():
    """`one_document_rows` says yes only to rows of one segment whose positions are the
    layout's own order: not to packed rows, padding, or positions of another order."""
    from data.batches import SyntheticTokenLoader
    from lwm.attention.layout import zigzag_permutation
    from lwm.model import one_document_rows

    perm = zigzag_permutation(64, 4)
    packed = next(SyntheticTokenLoader(batch_size=2, seq_len=64, text_vocab_size=256, layout=perm))
    one = _one_document(packed, perm)

    def check(batch, layout="zigzag", sp=4):
        return bool(one_document_rows(batch["positions"], batch["segment_ids"], layout, sp))

    assert check(one) and not check(packed)
    assert not check(_one_document(packed, np.arange(64)))  # contiguous positions, zigzag model
    assert check(_one_document(packed, np.arange(64)), "contiguous", 1)
    padded = dict(one, segment_ids=one["segment_ids"].copy())
    padded["segment_ids"][1, -5:] = 0
    assert not check(padded)


def test_one_document_schedule_gives_the_same_loss_and_gradients():
    """With cuDNN attention (its stand-in here) on a zigzag ring: the loss and gradients of
    a one-document batch told its order (`loss_fn(rows="one_document")`) equal those computed
    from its positions and segment ids; and the train step left to check on the device
    (``rows=None``, as with many processes) gives the XLA kernel's loss on one-document and
    packed batches alike."""
    import jax.numpy as jnp
    import optax

    from data.batches import SyntheticTokenLoader
    from lwm.attention.layout import zigzag_permutation
    from lwm.train_step import loss_fn

    mesh = make_mesh("1,2,4,1")
    perm = zigzag_permutation(64, 4)
    packed = next(SyntheticTokenLoader(batch_size=2, seq_len=64, text_vocab_size=256, layout=perm))
    one = _one_document(packed, perm)

    def setup(kernel):
        cfg = load_config("configs/debug.yaml").model.model_copy(
            update={"attention": "ring", "block_q": 4, "block_k": 4, "attention_kernel": kernel}
        )
        return nnx.split(create_model(cfg, mesh=mesh), nnx.Param)

    graphdef, params = setup("cudnn")
    fn = jax.value_and_grad(lambda p, b: loss_fn(p, graphdef, b, rows="any"), has_aux=True)
    (l0, _), g0 = jax.jit(fn)(params, one)

    # The train step left to check on the device, with an optimizer whose state is the last
    # gradients (bit for bit; the parameters stay): on the one-document batch its
    # one-document schedule (`loss_fn(rows="one_document")`, its metric `one_document` says
    # so) gives the gradients, where a program of its own compiled that schedule once more.
    keep_grads = optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p),
        lambda g, state, p=None: (jax.tree.map(jnp.zeros_like, g), g),
    )
    step = jax.jit(lambda p, o, b: train_step(p, o, b, graphdef=graphdef, tx=keep_grads))
    runs = [step(params, keep_grads.init(params), b) for b in (one, packed)]
    metrics = [m for _, _, m in runs]
    took = [float(m.get("one_document", -1)) for m in metrics]
    assert took == [1.0, 0.0]  # which schedule each batch took (the metric `one_document`)
    l1, g1 = float(metrics[0]["loss"]), runs[0][1]
    assert abs(l1 - float(l0)) <= 1e-6 * abs(float(l0))
    _assert_same_grads(jax.tree.leaves(g0), jax.tree.leaves(g1))

    # The XLA kernel's loss of each batch: the loss its train step reports (`loss_fn`'s, of
    # the same parameters before the update), from the forward pass alone (its step compiled
    # the backward pass and the optimizer as well: 3x the CPU time).
    xla_graphdef, xla_params = setup("xla")
    xla_loss = jax.jit(lambda p, b: loss_fn(p, xla_graphdef, b)[0])
    losses = {
        "xla": [float(xla_loss(xla_params, b)) for b in (one, packed)],
        "cudnn": [float(m["loss"]) for m in metrics],
    }
    assert np.allclose(losses["cudnn"], losses["xla"], rtol=1e-6, atol=0), losses


def _padded_packed_batch(seq: int) -> dict:
    """Two rows of packed documents (ids 1, 2, ..) and then padding (segment 0), positions
    counting in each, as `lwm train`'s loader lays them out."""
    from data.batches import SyntheticTokenLoader, make_training_batch

    b = next(SyntheticTokenLoader(batch_size=2, seq_len=seq, text_vocab_size=256))
    seg = b["segment_ids"].copy()
    seg[0, -11:], seg[1, -5:] = 0, 0
    pos = b["positions"].copy()
    pos[0, -11:], pos[1, -5:] = np.arange(11), np.arange(5)
    loss = (seg > 0).astype(np.float32)
    return make_training_batch(b["tokens"], b["vision_mask"], loss, seg, pos)


def test_in_order_schedule_gives_the_same_loss_and_gradients(monkeypatch):
    """Packed, padded rows (as the loader writes them) are in order on the host
    (`row_order`), no query looking back more than 32 tokens (`row_reach`); with cuDNN
    attention (its stand-in, pieces of 8 tokens: 16 a side) told so (`loss_fn(rows="in_order",
    reach=...)`: the in-order schedule over each piece's band of 4 key pieces) the loss and
    gradients equal the XLA kernel's; so do they where the step checks on the device
    (``rows=None``, as many processes run it: the one-document schedule, else the in-order one
    without a reach, its paired loops of 15 pieces). With the padding all at one position the
    rows are not in order; one-document rows are ``one_document``."""
    from test_cudnn_attention import scan_lengths, top_level_conds

    import lwm.attention.cudnn as cudnn
    from lwm.model import row_order, row_reach
    from lwm.train_step import _grads_fn, loss_fn

    monkeypatch.setattr(cudnn.pairs, "PIECE", 8)
    mesh = make_mesh("1,2,4,1")  # blockwise: each device attends over the whole sequence
    batch = _padded_packed_batch(128)
    assert row_order(batch["positions"], batch["segment_ids"], "contiguous", 1) == "in_order"
    assert row_reach(batch["segment_ids"]) == 32
    flat = np.where(batch["segment_ids"] == 0, 0, batch["positions"])
    assert row_order(flat, batch["segment_ids"], "contiguous", 1) == "any"
    one = _one_document(batch, np.arange(128))
    assert row_order(one["positions"], one["segment_ids"], "contiguous", 1) == "one_document"
    assert row_order(one["positions"], one["segment_ids"], "contiguous", 1, ("any",)) == "any"

    models = {}  # the model of each kernel, created once

    def grads(kernel, rows, reach=0):
        if kernel not in models:
            cfg = load_config("configs/debug.yaml").model.model_copy(
                update={
                    "attention": "blockwise",
                    "block_q": 8,
                    "block_k": 8,
                    "attention_kernel": kernel,
                }
            )
            models[kernel] = nnx.split(create_model(cfg, mesh=mesh), nnx.Param)
        graphdef, params = models[kernel]
        if rows is None:  # checked on the device

            def fn(p, b):
                return _grads_fn(p, graphdef, (0.5, 0.5), None)(b)
        else:
            fn = jax.value_and_grad(
                lambda p, b: loss_fn(p, graphdef, b, rows=rows, reach=reach), has_aux=True
            )
        (loss, _), g = jax.jit(fn)(params, batch)
        jaxpr = jax.make_jaxpr(fn)(params, batch).jaxpr
        # the in-order schedule's one check per call: a conditional of two branches, one of
        # them (the schedule) without any (`test_in_order_rows_decide_once_per_call`)
        checks = [c for c in top_level_conds(jaxpr) if len(c) == 2 and min(c) == 0]
        return float(loss), jax.tree.leaves(g), len(checks), scan_lengths(jaxpr)

    # (the general schedule and the paired one against dense attention: test_cudnn_attention)
    ref_loss, ref, checks, _ = grads("xla", "any")
    assert checks == 0
    loss, got, checks, loops = grads("cudnn", "in_order", 32)
    assert checks > 0 and 4 in loops and 15 not in loops  # the band's loops, not all pieces'
    device_loss, device_got, _, device_loops = grads("cudnn", None)
    assert 15 in device_loops  # the paired schedule: all 15 pieces below the diagonal
    for value, grads_of in ((loss, got), (device_loss, device_got)):
        assert abs(value - ref_loss) <= 1e-6 * abs(ref_loss)
        _assert_same_grads(ref, grads_of)


def test_row_orders_follow_the_kernel_and_the_mesh(monkeypatch):
    """On a GPU (simulated: the kernel resolves to cuDNN's own) the orders of rows that get
    their own schedule are all three for bfloat16 where each device attends over the whole
    sequence, ``any`` and ``one_document`` on a ring of 8, and ``any`` alone for float32 (cuDNN
    refuses it: the XLA kernel runs whatever the order) and for the XLA kernel. A step left to
    check on the device builds its conditional only where there is a choice."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    import lwm.train_step as ts

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)  # the GPU's cuDNN
    real = ts.resolve_kernel
    monkeypatch.setattr(
        ts, "resolve_kernel", lambda k, p=None: ("cudnn", False) if k == "cudnn" else real(k, p)
    )
    tx, _ = make_optimizer(1e-3)
    got, chooses = {}, {}
    for shape, attention, kernel, dtype in [
        ("1,1,8,1", "ring", "cudnn", "float32"),
        ("1,1,8,1", "ring", "cudnn", "bfloat16"),
        ("1,1,8,1", "blockwise", "cudnn", "bfloat16"),
        ("1,8,1,1", "ring", "cudnn", "bfloat16"),
        ("1,8,1,1", "ring", "xla", "bfloat16"),
    ]:
        mesh = make_mesh(shape)
        cfg = load_config("configs/debug.yaml").model.model_copy(
            update={"attention": attention, "attention_kernel": kernel, "dtype": dtype}
        )
        key = (shape, attention, kernel, dtype)
        got[key] = ts.row_orders(cfg, mesh)
        if shape == "1,1,8,1" and attention == "ring":
            graphdef, params = nnx.split(create_model(cfg, mesh=mesh), nnx.Param)
            step = jax.jit(lambda p, o, b, g=graphdef: train_step(p, o, b, graphdef=g, tx=tx))
            metrics = jax.eval_shape(step, params, tx.init(params), abstract_batch(mesh, 2, 64))[2]
            chooses[dtype] = "one_document" in metrics
    three = ("any", "in_order", "one_document")
    assert list(got.values()) == [("any",), ("any", "one_document"), three, three, ("any",)]
    assert chooses == {"float32": False, "bfloat16": True}


def _text_batch(seq: int, vision_from: int | None = None) -> dict:
    """Two rows of random tokens (vision codes from ``vision_from`` on) with their targets."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (2, seq)).astype(np.int32)
    vision = np.zeros((2, seq), bool)
    if vision_from is not None:
        vision[:, vision_from:] = True
    t = next_token_targets(tokens, vision, rng.uniform(0.5, 2, (2, seq)).astype(np.float32))
    return dict(
        tokens=tokens,
        vision_mask=vision,
        frame_cells=frame_cells(tokens, vision),
        positions=np.tile(np.arange(seq), (2, 1)).astype(np.int32),
        segment_ids=np.ones((2, seq), np.int32),
        target_tokens=t.tokens,
        target_is_vision=t.is_vision,
        target_weight=t.weight,
    )


def test_a_packed_batch_is_the_batch_bit_for_bit():
    """`lwm train` moves a batch as one int32 array (`pack_batch`, one transfer instead of one
    per field); unpacked in the step it is every field again, with its dtype and bits (float32
    weights included), the window field too; and the step given it equals the step given the
    dict, to the bit, on a sharded mesh."""
    from data.batches import BATCH_FIELDS, WINDOW_FIELD
    from lwm.train_step import jit_train_step, pack_batch, packed_batch_sharding, unpack_batch

    batch = _text_batch(64, vision_from=40)
    window = np.random.default_rng(1).integers(-1, 64, (2, 64, 3)).astype(np.int32)
    for local in (batch, {**batch, WINDOW_FIELD: window}):
        back = jax.jit(unpack_batch)(pack_batch(local))
        assert set(back) == set(local)
        for k, v in local.items():
            assert back[k].dtype == np.dtype(BATCH_FIELDS.get(k, np.int32)), k
            np.testing.assert_array_equal(np.asarray(back[k]), v)

    cfg = load_config("configs/debug.yaml").model
    mesh = make_mesh("1,2,2,2")
    tx, _ = make_optimizer(1e-2, warmup_steps=1, total_steps=10)
    _, abs_params, abs_opt = abstract_train_state(cfg, mesh, tx)
    runs = []
    for packed in (False, True):
        graphdef, params = nnx.split(create_model(cfg, mesh=mesh), nnx.Param)
        opt_state = jax.jit(tx.init, out_shardings=jax.tree.map(lambda x: x.sharding, abs_opt))(
            params
        )
        step = jit_train_step(graphdef, tx, mesh, abs_params, abs_opt, packed_batch=packed)
        given = jax.device_put(pack_batch(batch), packed_batch_sharding(mesh)) if packed else batch
        for _ in range(2):
            params, opt_state, metrics = step(params, opt_state, given)
        runs.append((float(metrics["loss"]), params))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(jax.tree.leaves(runs[0][1]), jax.tree.leaves(runs[1][1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_optimizer_state_kept_on_the_host_gives_the_same_steps():
    """`train.offload_optimizer`: the state lives in pinned host memory between steps (the
    step's inputs and outputs say so) and the steps equal those with it on the devices."""
    from lwm.train_step import HOST_MEMORY, jit_train_step

    cfg = load_config("configs/debug.yaml").model
    mesh = make_mesh("1,2,2,2")
    tx, _ = make_optimizer(1e-2, warmup_steps=1, total_steps=10)
    batch = _text_batch(64)
    runs = {}
    for offload in (False, True):
        graphdef, params = nnx.split(create_model(cfg, mesh=mesh), nnx.Param)
        _, abs_params, abs_opt = abstract_train_state(cfg, mesh, tx, offload_optimizer=offload)
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(abs_opt)}
        assert kinds == ({HOST_MEMORY} if offload else {"device"})
        opt_state = jax.jit(tx.init, out_shardings=jax.tree.map(lambda x: x.sharding, abs_opt))(
            params
        )
        step = jit_train_step(graphdef, tx, mesh, abs_params, abs_opt)
        losses = []
        for _ in range(3):
            params, opt_state, metrics = step(params, opt_state, batch)
            losses.append(float(metrics["loss"]))
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(opt_state)}
        assert kinds == ({HOST_MEMORY} if offload else {"device"})
        runs[offload] = losses, params, opt_state
    assert runs[True][0] == runs[False][0]
    for a, b in zip(jax.tree.leaves(runs[True][1:]), jax.tree.leaves(runs[False][1:]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
