"""Weight import/export: Hugging Face LLaMA (against transformers' PyTorch model), LWM's
streaming msgpack checkpoints (written here by an independent writer), orbax, and dispatch."""

from __future__ import annotations

import flax.serialization
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import pytest
import safetensors.numpy

from lwm.base.mesh import make_mesh
from lwm.config import ModelConfig
from lwm.info import VISION_PARAMS
from lwm.model import apply_rope, create_model, rope_tables, state_shardings
from lwm.weights import (
    WeightsError,
    detect_format,
    load_hf_llama,
    load_lwm_streaming,
    load_model,
    load_params,
    model_config_from_hf,
    save_hf_llama,
    save_lwm_streaming,
    save_params,
)
from lwm.weights.common import flat_params
from lwm.weights.hf import _read_raw
from lwm.weights.lwm_streaming import interleaved_to_rotate_half, iter_streaming, lwm_config

SEQ = 16


def tokens(vocab=256, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (2, SEQ)).astype(np.int32)


def text_logits(model, toks, vision_mask=None):
    mask = np.zeros(toks.shape, bool) if vision_mask is None else vision_mask
    text, vision = model(jnp.asarray(toks), jnp.asarray(mask))
    return np.asarray(text), np.asarray(vision)


def assert_params_equal(a, b, skip=()):
    fa, fb = flat_params(a), flat_params(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        if name not in skip:
            np.testing.assert_array_equal(np.asarray(fa[name]), np.asarray(fb[name]), name)


# ---------------------------------------------------------------------------------------------
# Hugging Face


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A small random GQA LLaMA saved by transformers, and its logits on `tokens()`. torch is
    part of the dev install: without it these tests fail (they never skip)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        rope_theta=10000.0,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).float().eval()
    folder = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(folder, safe_serialization=True)
    with torch.no_grad():
        ref = model(torch.tensor(tokens(), dtype=torch.long)).logits.numpy()
    return folder, ref


@pytest.fixture(scope="module")
def hf_model(hf_folder):
    cfg = model_config_from_hf(hf_folder[0], attention="dense", scan_layers=False)
    return load_hf_llama(hf_folder[0], cfg)


def test_hf_config_is_translated(hf_folder):
    cfg = model_config_from_hf(hf_folder[0], dtype="bfloat16")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (64, 2, 4, 2)
    assert (cfg.text_vocab_size, cfg.max_seq_len, cfg.head_dim) == (256, 64, 16)
    assert cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 10000.0 and cfg.dtype == "bfloat16"


@pytest.mark.parametrize(
    "overrides",
    [dict(attention="dense", scan_layers=False), dict(attention="blockwise", block_q=8, block_k=8)],
)
def test_hf_import_matches_torch(hf_folder, overrides):
    folder, ref = hf_folder
    model = load_hf_llama(folder, model_config_from_hf(folder, **overrides))
    text, _ = text_logits(model, tokens())
    assert np.abs(text - ref).max() <= 1e-4


def test_hf_export_round_trip_is_exact(hf_folder, hf_model, tmp_path):
    import torch
    import transformers

    folder, ref = hf_folder
    out = tmp_path / "export"
    save_hf_llama(hf_model, out, max_shard_bytes=60_000)  # several shards and an index
    assert (out / "model.safetensors.index.json").is_file()
    again = load_hf_llama(out, hf_model.cfg)
    assert_params_equal(again, hf_model)  # vision params: the same seeded initialisation
    torch_again = transformers.LlamaForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        logits = torch_again(torch.tensor(tokens(), dtype=torch.long)).logits.numpy()
    assert np.abs(logits - ref).max() <= 1e-5
    with pytest.raises(WeightsError, match="already holds a model"):
        save_hf_llama(hf_model, out)


def test_hf_sharded_import_equals_single_device(hf_folder, hf_model):
    folder, _ = hf_folder
    mesh = make_mesh("1,2,2,2")
    cfg = hf_model.cfg.model_copy(update=dict(scan_layers=True))
    sharded = load_hf_llama(folder, cfg, mesh=mesh)
    q = flat_params(sharded)["layers.attn.q"]
    assert q.sharding == state_shardings_of(sharded)["layers.attn.q"]
    assert q.addressable_shards[0].data.size < q.size
    got = text_logits(sharded, tokens())[0]
    np.testing.assert_allclose(got, text_logits(hf_model, tokens())[0], atol=1e-5)


def state_shardings_of(model):
    from flax import nnx

    shardings = state_shardings(nnx.state(model, nnx.Param), model.mesh)
    return {".".join(map(str, p)): s for p, s in nnx.to_flat_state(shardings)}


def test_hf_bfloat16_tensors_load_exactly(tmp_path, hf_folder):
    folder, _ = hf_folder
    cfg = model_config_from_hf(folder, param_dtype="bfloat16", scan_layers=False)
    model = create_model(cfg)
    save_hf_llama(model, tmp_path / "bf16", dtype="bfloat16")
    path = tmp_path / "bf16" / "model.safetensors"
    name = "model.layers.1.self_attn.k_proj.weight"
    raw = _read_raw(path, name)  # the reader for safetensors versions without numpy bf16
    assert raw.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(raw, safetensors.numpy.load_file(path)[name])
    np.testing.assert_array_equal(raw.T, np.asarray(flat_params(model)["layers.1.attn.k"]))
    # The vision params are not in the file: initialised again (jit may round the last bit).
    assert_params_equal(load_hf_llama(tmp_path / "bf16", cfg), model, skip=VISION_PARAMS)


def _rewrite(src, dst, change):
    """Copy an HF folder with `change(dict of tensors)` applied to its weights."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = safetensors.numpy.load_file(src / "model.safetensors")
    change(tensors)
    safetensors.numpy.save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_hf_errors_name_the_tensor_and_file(hf_folder, hf_model, tmp_path):
    folder, _ = hf_folder
    cfg = hf_model.cfg
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(folder, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(WeightsError, match=rf"missing.*'{name}'|'{name}'.*missing") as e:
        load_hf_llama(tmp_path / "missing", cfg)
    assert "missing" in str(e.value)

    def reshape(t):
        t[name] = np.zeros((128, 32), np.float32)

    _rewrite(folder, tmp_path / "shape", reshape)
    with pytest.raises(WeightsError) as e:
        load_hf_llama(tmp_path / "shape", cfg)
    msg = str(e.value)
    assert name in msg and "(32, 128)" in msg and "(64, 128)" in msg and "model.safetensors" in msg

    def extra(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)

    _rewrite(folder, tmp_path / "extra", extra)
    with pytest.raises(WeightsError, match="unexpected tensor 'model.layers.0.self_attn.q_proj"):
        load_hf_llama(tmp_path / "extra", cfg)

    with pytest.raises(WeightsError, match="nowhere.*does not exist"):
        load_hf_llama(tmp_path / "nowhere", cfg)
    with pytest.raises(WeightsError, match="model.rms_norm_eps: 1e-06 there, 1e-05 here"):
        load_hf_llama(folder, cfg.model_copy(update=dict(rms_norm_eps=1e-5)))
    with pytest.raises(WeightsError, match="model.rope_dims: None there, 8 here"):
        load_hf_llama(folder, cfg.model_copy(update=dict(rope_dims=8)))
    with pytest.raises(WeightsError, match="model.rope_dims 8 .* cannot be saved"):
        save_hf_llama(create_model(cfg.model_copy(update=dict(rope_dims=8))), tmp_path / "p")


def test_hf_unsupported_configs_are_rejected():
    base = dict(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )
    assert model_config_from_hf(base, max_seq_len=32).num_kv_heads == 4
    for change, message in [
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "RoPE scaling 'llama3'"),
        ({"rope_parameters": None, "rope_scaling": {"type": "linear"}}, "RoPE scaling 'linear'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"model_type": "mistral"}, "model_type 'mistral'"),
    ]:
        with pytest.raises(WeightsError, match=message):
            model_config_from_hf({**base, **change})


# ---------------------------------------------------------------------------------------------
# LWM streaming checkpoints


def lwm_cfg(**overrides):
    base = dict(
        text_vocab_size=128,
        vision_vocab_size=8448,  # codes and the <eof>/<eov> markers (8193)
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        max_seq_len=64,
        attention="dense",
        remat_policy="none",
        scan_layers=False,
    )
    return ModelConfig(**{**base, **overrides})


def to_interleaved(w, head_dim):
    """Independent of the code under test: column h*d + 2j + c (LWM) is our h*d + c*d/2 + j."""
    out = w.shape[-1]
    idx = np.empty(out, int)
    for h in range(out // head_dim):
        for j in range(head_dim // 2):
            for c in range(2):
                idx[h * head_dim + 2 * j + c] = h * head_dim + c * head_dim // 2 + j
    return w[..., idx]


def write_lwm_checkpoint(
    model, path, *, scanned=False, scan_axis=0, prefix=(), text_only=False, extra=()
):
    """A streaming checkpoint in LWM's names and RoPE layout, following tux's format: a file of
    msgpack pairs (key path, flax.serialization.to_bytes(array))."""
    cfg = model.cfg
    p = {k: np.asarray(v) for k, v in flat_params(model).items()}

    def layer(i, name):
        return p[f"layers.{name}"][i] if cfg.scan_layers else p[f"layers.{i}.{name}"]

    blocks = {
        ("attention", "wq", "kernel"): "attn.q",
        ("attention", "wk", "kernel"): "attn.k",
        ("attention", "wv", "kernel"): "attn.v",
        ("attention", "wo", "kernel"): "attn.o",
        ("feed_forward", "w1", "kernel"): "mlp.gate",
        ("feed_forward", "w2", "kernel"): "mlp.down",
        ("feed_forward", "w3", "kernel"): "mlp.up",
        ("attention_norm", "kernel"): "attn_norm",
        ("ffn_norm", "kernel"): "mlp_norm",
    }
    entries = [(("transformer", "wte", "embedding"), p["embed_text"])]
    if not text_only:
        entries.append((("transformer", "vte", "embedding"), p["embed_vision"]))
    for key, name in blocks.items():
        per_layer = [layer(i, name) for i in range(cfg.num_layers)]
        if name in ("attn.q", "attn.k"):
            per_layer = [to_interleaved(w, cfg.head_dim) for w in per_layer]
        if scanned:
            stacked = np.stack(per_layer, axis=scan_axis)  # LWM's param_scan_axis
            entries.append((("transformer", "h", "scan_decoder", *key), stacked))
        else:
            for i, w in enumerate(per_layer):
                entries.append((("transformer", "h", str(i), *key), w))
    entries.append((("transformer", "ln_f", "kernel"), p["final_norm"]))
    entries.append((("lm_head", "kernel"), p["lm_head"]))
    if not text_only:
        entries.append((("vision_head", "kernel"), p["vision_head"]))
    packer = msgpack.Packer()
    with open(path, "wb") as f:
        for key, value in [*extra, *((prefix + k, v) for k, v in entries)]:
            f.write(packer.pack((key, flax.serialization.to_bytes(value))))


def vision_batch(cfg):
    toks = tokens(cfg.text_vocab_size, seed=1)
    mask = np.zeros(toks.shape, bool)
    mask[:, 4:12] = True
    toks[mask] = np.random.default_rng(2).integers(0, cfg.vision_vocab_size, int(mask.sum()))
    return toks, mask


def test_lwm_rope_layout_matches_interleaved_rotary():
    """LWM's apply_rotary_emb (complex pairs) on LWM's kernel equals our rotate-half RoPE on the
    converted kernel, up to the same per-head permutation on q and k: same attention scores."""
    rng = np.random.default_rng(0)
    heads, hd, dim, seq = 2, 8, 16, 5
    x = rng.normal(size=(1, seq, dim)).astype(np.float32)
    wq, wk = (rng.normal(size=(dim, heads * hd)).astype(np.float32) for _ in range(2))
    pos = np.arange(seq)

    def lwm_rope(w):  # LWM lwm/llama.py: precompute_freqs_cis + apply_rotary_emb
        y = (x @ w).reshape(1, seq, heads, hd // 2, 2)
        freqs = np.outer(pos, 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd))
        c = (y[..., 0] + 1j * y[..., 1]) * np.exp(1j * freqs)[None, :, None]
        return np.stack([c.real, c.imag], -1).reshape(1, seq, heads, hd)

    cos, sin = rope_tables(jnp.asarray(pos)[None], hd, 10000.0)

    def our_rope(w):
        return np.asarray(apply_rope(jnp.asarray((x @ w).reshape(1, seq, heads, hd)), cos, sin))

    lwm_scores = np.einsum("bqhd,bkhd->bhqk", lwm_rope(wq), lwm_rope(wk))
    ours = [our_rope(interleaved_to_rotate_half(w, hd)) for w in (wq, wk)]
    np.testing.assert_allclose(
        np.einsum("bqhd,bkhd->bhqk", *ours), lwm_scores, rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize(
    "scanned_file,scan_axis,scan_model",
    [(False, 0, False), (True, 0, True), (True, 1, False), (False, 0, True)],
)
def test_lwm_checkpoint_loads_with_same_logits(tmp_path, scanned_file, scan_axis, scan_model):
    source = create_model(lwm_cfg(), seed=1)
    path = tmp_path / "streaming_params"
    write_lwm_checkpoint(source, path, scanned=scanned_file, scan_axis=scan_axis)
    model = load_lwm_streaming(f"params::{path}", lwm_cfg(scan_layers=scan_model))
    toks, mask = vision_batch(source.cfg)
    for got, want in zip(
        text_logits(model, toks, mask), text_logits(source, toks, mask), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-5)
    if not scan_model:
        assert_params_equal(model, source)


def test_lwm_save_matches_writer_and_round_trips(tmp_path):
    source = create_model(lwm_cfg(scan_layers=True), seed=2)
    for scanned in (False, True):
        ours, theirs = tmp_path / f"ours{scanned}", tmp_path / f"theirs{scanned}"
        save_lwm_streaming(source, ours, scan_layers=scanned)
        write_lwm_checkpoint(source, theirs, scanned=scanned)
        a, b = dict(iter_streaming(ours)), dict(iter_streaming(theirs))
        assert sorted(a) == sorted(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], "/".join(key))
        assert_params_equal(load_lwm_streaming(ours, source.cfg), source)
    fields = lwm_config(source.cfg, scan_layers=True)
    assert (fields["num_attention_heads"], fields["vision_vocab_size"]) == (4, 8448)


def test_lwm_trainstate_and_text_only_checkpoints(tmp_path):
    source = create_model(lwm_cfg(), seed=3)
    path = tmp_path / "streaming_train_state"
    extra = [(("step",), np.int32(7)), (("opt_state", "0", "mu"), np.zeros(3, np.float32))]
    write_lwm_checkpoint(source, path, prefix=("params", "params"), extra=extra)
    model = load_lwm_streaming(f"trainstate_params::{path}", source.cfg)
    assert_params_equal(model, source)

    text_path = tmp_path / "text_params"
    write_lwm_checkpoint(source, text_path, text_only=True)
    model = load_model(f"lwm:{text_path}", source.cfg)
    np.testing.assert_allclose(
        text_logits(model, tokens(128))[0], text_logits(source, tokens(128))[0], atol=1e-5
    )
    fresh = flat_params(create_model(source.cfg))  # vision: the seed-0 initialisation
    np.testing.assert_allclose(
        np.asarray(flat_params(model)["vision_head"]), np.asarray(fresh["vision_head"]), rtol=1e-6
    )


def test_lwm_bfloat16_checkpoint_is_cast(tmp_path):
    source = create_model(lwm_cfg(), seed=4)
    path = tmp_path / "bf16"
    save_lwm_streaming(source, path, float_dtype="bfloat16")
    assert next(iter(iter_streaming(path)))[1].dtype == ml_dtypes.bfloat16
    model = load_lwm_streaming(path, lwm_cfg(param_dtype="bfloat16"))
    want = np.asarray(flat_params(source)["layers.1.attn.k"]).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(flat_params(model)["layers.1.attn.k"]), want)


def test_lwm_errors_name_the_tensor_and_file(tmp_path):
    source = create_model(lwm_cfg(), seed=5)
    path = tmp_path / "params"
    write_lwm_checkpoint(source, path)
    entries = list(iter_streaming(path))
    packer = msgpack.Packer()

    def rewrite(name, change):
        out = tmp_path / name
        with open(out, "wb") as f:
            for key, value in change(list(entries)):
                f.write(packer.pack((list(key), flax.serialization.to_bytes(value))))
        return out

    gone = ("transformer", "h", "1", "feed_forward", "w3", "kernel")
    bad = rewrite("missing", lambda es: [(k, v) for k, v in es if k != gone])
    with pytest.raises(WeightsError, match=r"missing.*transformer/h/1/feed_forward/w3/kernel"):
        load_lwm_streaming(bad, source.cfg)

    key = ("transformer", "h", "0", "attention", "wo", "kernel")
    bad = rewrite("shape", lambda es: [(k, v[:16] if k == key else v) for k, v in es])
    with pytest.raises(WeightsError) as e:
        load_lwm_streaming(bad, source.cfg)
    assert "transformer/h/0/attention/wo/kernel" in str(e.value)
    assert "(16, 32)" in str(e.value) and "(32, 32)" in str(e.value) and str(bad) in str(e.value)

    bad = rewrite("extra", lambda es: [*es, (("transformer", "wpe", "embedding"), np.zeros(2))])
    with pytest.raises(WeightsError, match="unexpected tensor 'transformer/wpe/embedding'"):
        load_lwm_streaming(bad, source.cfg)
    with pytest.raises(WeightsError, match="nowhere' does not exist"):
        load_lwm_streaming(f"params::{tmp_path / 'nowhere'}", source.cfg)
    # Malformed entries are one WeightsError naming the file (they were a TypeError, or a
    # ValueError from casting an array of strings, both tracebacks), and its arrays numbers.
    norm = ("transformer", "ln_f", "kernel")
    strings = msgpack.packb(  # flax's chunked-array form rebuilds any msgpack list as an array
        {"__msgpack_chunked_array__": True, "shape": {"0": 32}, "chunks": {"0": ["x"] * 32}}
    )
    for name, entry, message in [
        ("key", (7, flax.serialization.to_bytes(np.zeros(3))), "not a streaming checkpoint"),
        ("value", (list(norm), 5), "not a streaming checkpoint"),
        ("strings", (list(norm), strings), "entry 'transformer/ln_f/kernel' holds <U1, not"),
    ]:
        (tmp_path / name).write_bytes(packer.pack(entry))
        with pytest.raises(WeightsError, match=f"{tmp_path / name}: {message}"):
            load_lwm_streaming(tmp_path / name, source.cfg)
    with pytest.raises(WeightsError, match="no grouped-query attention"):
        save_lwm_streaming(create_model(lwm_cfg(num_kv_heads=2)), tmp_path / "gqa")
    with pytest.raises(WeightsError, match="model.rope_dims 8 cannot be saved"):
        save_lwm_streaming(create_model(lwm_cfg(rope_dims=8)), tmp_path / "partial")


# ---------------------------------------------------------------------------------------------
# Orbax and dispatch


def test_orbax_round_trip_is_exact_on_one_device_and_on_a_mesh(tmp_path):
    cfg = lwm_cfg(scan_layers=True)
    source = create_model(cfg, seed=6)
    save_params(source, tmp_path / "params")
    assert_params_equal(load_params(tmp_path / "params", cfg), source)
    mesh = make_mesh("1,2,2,2")
    sharded = load_model(tmp_path / "params", cfg, mesh=mesh)  # detected as orbax
    assert_params_equal(sharded, source)
    want = state_shardings_of(sharded)
    for name, value in flat_params(sharded).items():
        assert value.sharding == want[name], name
    with pytest.raises(WeightsError, match="already exists"):
        save_params(source, tmp_path / "params")
    narrow = lwm_cfg(scan_layers=True, num_heads=2, num_kv_heads=2, head_dim=8)
    with pytest.raises(
        WeightsError, match=r"'layers.attn.k' has shape \(2, 32, 32\), .*\(2, 32, 16\)"
    ):
        load_params(tmp_path / "params", narrow)
    with pytest.raises(WeightsError, match="'lm_head' has no place in the model"):
        load_params(tmp_path / "params", lwm_cfg(scan_layers=True, tie_word_embeddings=True))


def test_format_detection_and_missing_sources(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    assert detect_format(tmp_path / "file") == ("lwm", str(tmp_path / "file"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert detect_format(tmp_path / "hf") == ("hf", str(tmp_path / "hf"))
    assert detect_format("params::/x/y") == ("lwm", "params::/x/y")
    assert detect_format("orbax:/x/y") == ("orbax", "/x/y")
    with pytest.raises(WeightsError, match="'.*nowhere' does not exist"):
        load_model(tmp_path / "nowhere", lwm_cfg())
    with pytest.raises(WeightsError, match="neither a Hugging Face model"):
        load_model(tmp_path, lwm_cfg())
    with pytest.raises(WeightsError, match="orbax checkpoint '.*nowhere' does not exist"):
        load_model(f"orbax:{tmp_path / 'nowhere'}", lwm_cfg())
    with pytest.raises(WeightsError, match="no config.json"):
        load_model(f"hf:{tmp_path}", lwm_cfg())
    with pytest.raises(WeightsError, match=r"'foo:/x': unknown format 'foo:' \(known: hf:, lwm:"):
        load_model("foo:/x", lwm_cfg())


def test_shape_differences_name_the_settings_that_change_the_parameters():
    from lwm.info import shape_differences

    cfg = lwm_cfg()
    longer = cfg.model_copy(update={"max_seq_len": 4 * cfg.max_seq_len, "rope_theta": 1e6})
    assert shape_differences(cfg, longer) == []  # a context stage: the same parameters
    wider = cfg.model_copy(update={"intermediate_size": 2 * cfg.intermediate_size})
    assert shape_differences(cfg, wider) == [
        f"model.intermediate_size: {cfg.intermediate_size} there, {2 * cfg.intermediate_size} here"
    ]
    both = wider.model_copy(update={"rope_theta": 1e6})  # the theta changes no shape: not named
    assert shape_differences(cfg, both) == shape_differences(cfg, wider)
