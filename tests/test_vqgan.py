"""The VQGAN tokenizer: configs, shapes, quantizer, preprocessing, exact resume over 8 devices,
the batched sharded tokenizer, LWM weight import and the restricted unpickler."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from lwm.base.mesh import make_mesh
from lwm.config import ConfigError
from vqgan import load_model, load_tokenizer
from vqgan.config import VQGANConfig, VQGANModelConfig, load_vqgan_config
from vqgan.legacy_pickle import LegacyPickleError, load_legacy_pickle
from vqgan.model import VQGAN, GroupNorm, init_model
from vqgan.preprocess import postprocess, preprocess, resize_and_crop, resized_shape
from vqgan.quantizer import (
    VectorQuantizer,
    code_counts,
    nearest_codes,
    restart_dead_codes,
    update_usage,
    usage_stats,
)
from vqgan.train import step_phase, train
from vqgan.weights import WeightsError, export_lwm_params, import_lwm_params, read_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "vqgan"
TINY = CONFIGS / "tiny.yaml"


def _tiny_model_cfg(**update) -> VQGANModelConfig:
    return load_vqgan_config(TINY).model.model_copy(update=update)


# ---------------------------------------------------------------------------------------------
# Configs and shapes


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_presets_load(path: Path) -> None:
    """Each preset starts with the command that trains it, and that command's config loads."""
    command = path.read_text().splitlines()[0].split()
    assert command[:5] == ["#", "lwm", "vqgan", "train", "--config"]
    assert command[5] == f"configs/vqgan/{path.name}"
    cfg = load_vqgan_config(path, command[6:])  # key=value overrides, e.g. data.manifest
    assert cfg.model.tokens_per_frame == cfg.model.codes_per_side**2


def test_lwm_preset_is_lwms_architecture() -> None:
    cfg = load_vqgan_config(CONFIGS / "lwm.yaml").model
    assert cfg == VQGANModelConfig()  # the defaults are LWM's
    assert (cfg.resolution, cfg.codes_per_side, cfg.tokens_per_frame) == (256, 16, 256)
    assert (cfg.num_embeddings, cfg.embed_dim, cfg.channel_mult) == (8192, 64, (1, 2, 2, 4, 6))
    abstract = nnx.eval_shape(lambda: VQGAN(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    frames = jax.ShapeDtypeStruct((2, 256, 256, 3), jnp.float32)
    codes = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s).encode(x).codes, state, frames)
    assert codes.shape == (2, 16, 16) and codes.dtype == jnp.int32
    out = jax.eval_shape(lambda s, c: nnx.merge(graphdef, s).decode_codes(c), state, codes)
    assert out.shape == (2, 256, 256, 3)
    params = nnx.state(abstract, nnx.Param)
    assert params["quantizer"]["embeddings"].shape == (8192, 64)
    assert params["decoder"]["up"][4]["res"][0]["conv1"]["kernel"].shape == (3, 3, 768, 768)
    assert (
        len(params["decoder"]["up"][0]["res"]) == 3
        and len(params["encoder"]["down"][0]["res"]) == 2
    )


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="unknown config key 'model.attn'; valid keys in 'model'"):
        load_vqgan_config(TINY, ["model.attn=1"])
    with pytest.raises(ConfigError, match="divisible by the downsampling factor"):
        load_vqgan_config(TINY, ["model.resolution=15"])
    with pytest.raises(ConfigError, match="num_groups"):
        load_vqgan_config(TINY, ["model.num_groups=5"])
    assert load_vqgan_config(TINY, ["model.channel_mult=[1,2,2]"]).model.tokens_per_frame == 16


def test_shapes_and_code_range() -> None:
    cfg = _tiny_model_cfg()
    model = init_model(cfg)
    x = jax.random.uniform(jax.random.key(1), (3, 16, 16, 3), minval=-1, maxval=1)

    @nnx.jit
    def run(model, x):
        x_hat, out = model(x)
        return x_hat, out.codes, model.decode_codes(out.codes)

    x_hat, codes, frames = run(model, x)
    assert x_hat.shape == x.shape and codes.shape == (3, 8, 8) and codes.dtype == jnp.int32
    assert int(codes.min()) >= 0 and int(codes.max()) < cfg.num_embeddings
    assert frames.shape == (3, 16, 16, 3) and float(jnp.abs(frames).max()) <= 1.0
    with pytest.raises(ValueError, match=r"expected frames \[N, 16, 16, 3\]"):
        jax.eval_shape(lambda x: model.encode(x), jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float32))


# ---------------------------------------------------------------------------------------------
# Quantizer


def test_quantizer_straight_through_and_losses() -> None:
    q = VectorQuantizer(16, 4, rngs=nnx.Rngs(0))
    q.embeddings[...] = jax.random.normal(jax.random.key(0), (16, 4))
    z = jax.random.normal(jax.random.key(1), (2, 3, 3, 4))
    emb = q.embeddings[...]
    out = q(z)
    brute = jnp.argmin(jnp.sum((z[..., None, :] - emb) ** 2, axis=-1), axis=-1)
    assert np.array_equal(out.codes, brute)
    np.testing.assert_allclose(out.quantized, emb[out.codes], rtol=1e-6, atol=1e-6)
    mse = jnp.mean((z - emb[out.codes]) ** 2)
    np.testing.assert_allclose(out.codebook_loss, mse, rtol=1e-6)
    np.testing.assert_allclose(out.commitment_loss, mse, rtol=1e-6)
    # Straight-through: d(quantized)/dz is the identity.
    c = jax.random.normal(jax.random.key(2), z.shape)
    g = jax.grad(lambda z: jnp.sum(q(z).quantized * c))(z)
    np.testing.assert_allclose(g, c, rtol=1e-6)
    # The codebook loss moves only the codebook; the commitment loss only the encoder output.
    graphdef, params = nnx.split(q)

    def loss(params, z, name):
        return getattr(nnx.merge(graphdef, params)(z), name)

    g_cb = jax.grad(loss, argnums=(0, 1))(params, z, "codebook_loss")
    g_cm = jax.grad(loss, argnums=(0, 1))(params, z, "commitment_loss")
    assert (
        float(jnp.abs(g_cb[1]).max()) == 0 and float(jnp.abs(g_cb[0]["embeddings"][...]).max()) > 0
    )
    assert (
        float(jnp.abs(g_cm[0]["embeddings"][...]).max()) == 0 and float(jnp.abs(g_cm[1]).max()) > 0
    )


def test_nearest_codes_are_exact_where_rounded_products_are_not() -> None:
    """The code search finds the float64 nearest code for latents near the boundary of two
    codes (its products float32-exact, on a TPU too), where products of operands rounded to
    bfloat16 (what a TPU computes at its default precision) pick another code for many."""
    from tokenize_helpers import near_tie_latents

    z, emb, nearest = near_tie_latents()
    np.testing.assert_array_equal(
        np.asarray(nearest_codes(jnp.asarray(z), jnp.asarray(emb))), nearest
    )
    rounded = [jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32) for a in (z, emb)]
    scores = jnp.sum(rounded[1] ** 2, axis=1)[None, :] - 2.0 * rounded[0] @ rounded[1].T
    assert (np.asarray(jnp.argmin(scores, axis=1)) != nearest).mean() > 0.1


def _compiled_programs(model: VQGAN) -> tuple[list[str], list[str]]:
    """The lowered encode and decode programs of ``model`` (tiny frames), as lines."""
    graphdef, state = nnx.split(model)
    encode = jax.jit(lambda s, x: nnx.merge(graphdef, s).encode(x).codes)
    decode = jax.jit(lambda s, c: nnx.merge(graphdef, s).decode_codes(c))
    return (
        encode.lower(state, jnp.zeros((1, 16, 16, 3))).as_text().splitlines(),
        decode.lower(state, jnp.zeros((1, 8, 8), jnp.int32)).as_text().splitlines(),
    )


def _exact_convolutions(lines: list[str]) -> tuple[int, int]:
    """(float32-exact convolutions, all convolutions) of a lowered program."""
    convs = [line for line in lines if "stablehlo.convolution" in line]
    return sum(line.count("precision HIGHEST") == 2 for line in convs), len(convs)


def test_matmul_precision_reaches_every_convolution() -> None:
    """`model.matmul_precision` is the precision of every convolution of the encoder and the
    decoder in the compiled programs (what a TPU rounds by); the code search's product is
    float32-exact whatever the setting."""
    from tokenize_helpers import TINY_VQGAN

    for precision in ("default", "highest"):
        model = init_model(VQGANModelConfig(**TINY_VQGAN, matmul_precision=precision))
        encoding, decoding = _compiled_programs(model)
        for lines in (encoding, decoding):
            exact, convs = _exact_convolutions(lines)
            assert convs and exact == (convs if precision == "highest" else 0)
        dots = [line for line in encoding if "stablehlo.dot_general" in line]
        assert dots and all("precision = [HIGHEST, HIGHEST]" in line for line in dots)


def test_training_computes_at_train_matmul_precision() -> None:
    """The model `lwm vqgan train` trains is computed at `train.matmul_precision`, whatever
    `model.matmul_precision` (the precision of the commands that use the trained VQGAN) says:
    on a TPU the training step compiles for minutes at `highest`, encoding for seconds."""
    from vqgan.train import create_state

    for model_p, train_p in (("highest", "default"), ("default", "highest")):
        cfg = load_vqgan_config(
            TINY, [f"model.matmul_precision={model_p}", f"train.matmul_precision={train_p}"]
        )
        model = create_state(cfg).model
        for lines in _compiled_programs(model):
            exact, convs = _exact_convolutions(lines)
            assert convs and exact == (convs if train_p == "highest" else 0)


def test_usage_stats() -> None:
    counts = code_counts(jnp.array([[0, 1], [2, 3]]), 8)
    assert counts.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    stats = usage_stats(counts)
    np.testing.assert_allclose(stats["perplexity"], 4.0, rtol=1e-5)
    assert float(stats["codebook_used"]) == 0.5
    usage = update_usage(jnp.ones(8), jnp.array([0, 0]), decay=0.5)
    assert usage.tolist() == [1.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]


def test_dead_code_restart() -> None:
    emb = jnp.arange(24, dtype=jnp.float32).reshape(6, 4)
    usage = jnp.array([2.0, 0.0, 1.0, 0.001, 3.0, 0.0])
    z = 100 + jax.random.normal(jax.random.key(0), (5, 2, 4))
    new, new_usage, n = restart_dead_codes(emb, usage, z, jax.random.key(1), threshold=0.01)
    dead = np.array([False, True, False, True, False, True])
    assert int(n) == 3
    np.testing.assert_array_equal(new[~dead], emb[~dead])
    flat = np.asarray(z).reshape(-1, 4)
    for row in np.asarray(new)[dead]:  # each restarted code sits on an encoder output
        assert np.abs(flat - row).max(axis=1).min() < 0.1
    assert np.all(np.asarray(new_usage)[dead] >= 0.01)
    np.testing.assert_array_equal(np.asarray(new_usage)[~dead], np.asarray(usage)[~dead])


# ---------------------------------------------------------------------------------------------
# Preprocessing


def test_preprocess_as_lwm() -> None:
    """Short side resized to the resolution, centre crop, x/127.5 - 1: as LWM does with PIL."""
    rng = np.random.default_rng(0)
    h, w, size = 40, 30, 16
    smooth = np.kron(rng.integers(0, 256, (8, 6, 3)), np.ones((5, 5, 1))).astype(np.uint8)
    assert resized_shape(h, w, size) == (21, 16)
    ours = np.asarray(resize_and_crop(jnp.asarray(smooth[None]), size))[0]
    image = Image.fromarray(smooth).resize((16, 21), Image.BICUBIC)  # LWM's _process_frame
    left, top = (16 - size) / 2, (21 - size) / 2
    theirs = np.asarray(image.crop((left, top, left + size, top + size)))
    assert ours.shape == theirs.shape == (16, 16, 3)
    assert np.abs(ours.astype(int) - theirs).mean() < 3
    x = preprocess(jnp.asarray(smooth[None, :16, :16]), size)
    np.testing.assert_allclose(x[0], smooth[:16, :16] / 127.5 - 1, atol=1e-6)  # no resize
    assert np.array_equal(np.asarray(postprocess(x))[0], smooth[:16, :16])


def test_training_frames_from_manifest_mp4s(tmp_path: Path) -> None:
    from data.synthetic import write_dataset
    from data.vqgan_frames import load_frames

    manifest = write_dataset(tmp_path, count=3, seed=2, size=32, num_frames=4)
    cfg = load_vqgan_config(TINY, ["data.source=manifest", f"data.manifest={manifest}"])
    source = load_frames(cfg)  # decord-read MP4s, resized 32 -> 16; the last video held out
    assert source.train.shape == (8, 16, 16, 3) and source.eval.shape == (4, 16, 16, 3)
    assert source.train.dtype == np.uint8
    batch = source.batch(step=5, batch_size=6)
    assert batch.shape == (6, 16, 16, 3) and np.array_equal(batch, source.batch(5, 6))
    with pytest.raises(ConfigError, match="data.manifest is not set"):
        load_vqgan_config(TINY, ["data.source=manifest"])


# ---------------------------------------------------------------------------------------------
# Training: exact resume over 8 devices; the trained folder feeds the tokenizer tests


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(uninterrupted run, interrupted-and-resumed run) of the tiny preset, 3 steps on 8 devices
    with the adversarial loss on (one compiled step: the switch is `test_step_phase`'s) and dead
    codes restarted at step 2."""
    root = tmp_path_factory.mktemp("vqgan")
    overrides = ["train.steps=3", "loss.disc_start=0", "train.progress=false"]
    overrides += ["train.eval_every=2", "train.save_every=100", "mesh.shape=1,-1,1,1"]
    full = load_vqgan_config(TINY, [*overrides, f"train.output_dir={root / 'full'}"])
    part = load_vqgan_config(TINY, [*overrides, f"train.output_dir={root / 'part'}"])
    from data.vqgan_frames import load_frames

    source = load_frames(full)
    mesh = make_mesh(full.mesh.shape)
    train(full, mesh=mesh, source=source)
    assert train(part, mesh=mesh, source=source, stop_at=1) == {}
    assert not (root / "part" / "model.safetensors").exists()
    logged: list[str] = []
    train(part, mesh=mesh, source=source, log=logged.append)
    # it resumes from the checkpoint at step 1: starting over would give the same weights
    assert "resumed from checkpoint 1" in logged, logged
    return root / "full", root / "part"


def test_frames_per_s_counts_the_training_steps_only(tmp_path, monkeypatch) -> None:
    """A fake clock advances 1 s a training step and 100 s a held-out evaluation: every
    logged window reads batch_size frames/s, the one after an evaluation too (it counted the
    evaluation's 100 s as training's: 0.08 frames/s for 8)."""
    from types import SimpleNamespace

    import vqgan.train as vt
    from data.vqgan_frames import load_frames

    clock = [0.0]

    def ticking(fn, seconds):
        def run(*args, **kwargs):
            clock[0] += seconds
            return fn(*args, **kwargs)

        return run

    make_step, evaluate = vt.make_train_step, vt.evaluate
    monkeypatch.setattr(vt, "make_train_step", lambda cfg: ticking(make_step(cfg), 1.0))
    monkeypatch.setattr(vt, "evaluate", ticking(evaluate, 100.0))
    monkeypatch.setattr(vt, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    overrides = ["train.steps=4", "loss.disc_start=0", "train.progress=false"]
    overrides += ["train.eval_every=2", "train.save_every=100", "mesh.shape=1,-1,1,1"]
    cfg = load_vqgan_config(TINY, [*overrides, f"train.output_dir={tmp_path}"])
    train(cfg, mesh=make_mesh(cfg.mesh.shape), source=load_frames(cfg))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rates = [r["frames_per_s"] for r in map(json.loads, lines) if "frames_per_s" in r]
    assert rates == [pytest.approx(cfg.train.batch_size)] * 4


def test_a_rerun_names_the_settings_it_changes_and_keeps_the_config_they_replace(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    """Another learning rate, more steps and another precision resume, named in one line, the
    earlier config kept as config.until-STEP.yaml (they were taken silently, config.yaml
    rewritten)."""
    import shutil

    from data.vqgan_frames import load_frames

    run = tmp_path / "run"
    shutil.copytree(trained[1], run)
    overrides = ["loss.disc_start=0", "train.progress=false", "train.eval_every=2"]
    overrides += ["train.save_every=100", "mesh.shape=1,-1,1,1", f"train.output_dir={run}"]
    before = (run / "config.yaml").read_text()
    changes = ["train.steps=4", "train.learning_rate=3e-4", "model.matmul_precision=highest"]
    cfg = load_vqgan_config(TINY, [*overrides, *changes])
    logged: list[str] = []
    train(cfg, mesh=make_mesh(cfg.mesh.shape), source=load_frames(cfg), log=logged.append)
    assert logged[1] == (
        "resuming with other settings than the run's: model.matmul_precision: default there, "
        "highest here; train.steps: 3 there, 4 here; train.learning_rate: 0.001 there, 0.0003 "
        "here (its config until step 3 kept as config.until-3.yaml)"
    )
    assert (run / "config.until-3.yaml").read_text() == before
    assert read_config(run).train.learning_rate == 3e-4
    assert read_config(run).model.matmul_precision == "highest"


def test_resume_equals_uninterrupted(trained: tuple[Path, Path]) -> None:
    from safetensors.numpy import load_file

    full, part = trained
    a, b = load_file(full / "model.safetensors"), load_file(part / "model.safetensors")
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    train_rows = {r["step"]: r for r in rows if r["split"] == "train"}
    assert all("d_loss" in r and "g_adv" in r for r in train_rows.values())
    assert train_rows[3]["restarted"] > 0 and train_rows[2]["restarted"] == 0  # at step 2
    assert [r["step"] for r in rows if r["split"] == "eval"] == [2, 3]
    assert (full / "samples" / "step_000002.png").is_file() and (full / "eval.json").is_file()
    assert list((full / "tb").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (full / "checkpoints").iterdir() if p.name.isdigit()) == ["3"]


def test_a_rerun_with_another_model_is_refused_and_changes_nothing(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    """A VQGAN folder resumed with another model: one error naming the setting, before its
    config.yaml (which the folder's weights are read with) is overwritten."""
    import shutil

    from vqgan.weights import WeightsError

    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    before = (run / "config.yaml").read_text()
    wider = load_vqgan_config(TINY, ["model.hidden_channels=32", f"train.output_dir={run}"])
    with pytest.raises(WeightsError, match=r"another VQGAN \(model.hidden_channels: 16 there, 32"):
        train(wider, mesh=make_mesh("1,-1,1,1"), source=None)
    assert (run / "config.yaml").read_text() == before
    # the discriminator's shape too (orbax's tree mismatch was a line of 2,000 characters)
    deeper = load_vqgan_config(TINY, ["discriminator.num_layers=3", f"train.output_dir={run}"])
    with pytest.raises(WeightsError, match=r"\(discriminator.num_layers: 2 there, 3 here\)"):
        train(deeper, mesh=make_mesh("1,-1,1,1"), source=None)
    assert (run / "config.yaml").read_text() == before and not list(run.glob("config.until-*"))
    # the compute dtype alone may change (the same weights, in another precision)
    from vqgan.train import _check_same_model

    overrides = [f"train.output_dir={run}"]
    _check_same_model(run, load_vqgan_config(TINY, [*overrides, "model.dtype=bfloat16"]))
    with pytest.raises(WeightsError, match=r"model.param_dtype: float32 there, bfloat16 here"):
        _check_same_model(run, load_vqgan_config(TINY, [*overrides, "model.param_dtype=bfloat16"]))


def test_a_finished_run_records_another_encoding_precision_and_keeps_its_weights(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    """Rerun finished with another `model.matmul_precision`: nothing is trained, and the
    precision is written into config.yaml (what tokenize, encode and ask read), the rest of
    the run's config and every other file as they were (it was left, to be edited by hand).
    Its frames are not read, nor its checkpoint restored (a minute for the demo's VQGAN)."""
    import shutil

    def frames() -> None:
        pytest.fail("a finished run read its training frames")

    run = tmp_path / "run"
    shutil.copytree(trained[1], run)
    before = read_config(run)
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "config.yaml"}
    overrides = ["loss.disc_start=0", "train.progress=false", "train.eval_every=2"]
    overrides += ["train.save_every=100", "mesh.shape=1,-1,1,1", f"train.output_dir={run}"]
    changes = ["train.steps=3", "model.matmul_precision=high", "train.learning_rate=0.5"]
    cfg = load_vqgan_config(TINY, [*overrides, *changes])
    logged: list[str] = []
    train(cfg, mesh=make_mesh(cfg.mesh.shape), source=frames, log=logged.append)
    assert logged == [
        "nothing to do: checkpoint 3 already reaches train.steps=3",
        "model.matmul_precision: default there, high here: written to config.yaml for the "
        "commands that use the weights",
    ]
    after = read_config(run)
    assert after.model.matmul_precision == "high" and after.train == before.train
    assert after.model_copy(update={"model": before.model}) == before
    others = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "config.yaml"}
    assert others == files


def test_a_damaged_checkpoint_is_set_aside_and_a_run_past_its_steps_is_left_alone(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    """Rerun with train.steps below its checkpoint, a finished run is nothing to do (it wrote
    eval.json labelled with the lower step over the later weights, and rewrote config.yaml);
    with its newest checkpoint damaged, the one before is resumed, to the same weights as an
    uninterrupted run (it was ~500 lines of tracebacks, exit 1, config.yaml rewritten)."""
    import shutil

    from safetensors.numpy import load_file

    from data.vqgan_frames import load_frames

    full, part = trained
    run = tmp_path / "run"
    shutil.copytree(part, run)
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [1, 3]
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    overrides = ["loss.disc_start=0", "train.progress=false", "train.eval_every=2"]
    overrides += ["train.save_every=100", "mesh.shape=1,-1,1,1", f"train.output_dir={run}"]
    cfg = load_vqgan_config(TINY, [*overrides, "train.steps=2"])
    source, mesh, logged = load_frames(cfg), make_mesh(cfg.mesh.shape), []
    metrics = train(cfg, mesh=mesh, source=source, log=logged.append)
    written = json.loads((part / "eval.json").read_text())
    assert written.pop("step") == 3 and metrics == written
    assert logged == ["nothing to do: checkpoint 3 already reaches train.steps=2"]
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files
    for p in (run / "checkpoints" / "3").rglob("d/*"):
        with open(p, "r+b") as f:  # the arrays' data files, cut short
            f.truncate(10)
    (run / "model.safetensors").unlink()
    logged.clear()
    cfg = load_vqgan_config(TINY, [*overrides, "train.steps=3"])
    train(cfg, mesh=mesh, source=source, log=logged.append)
    assert logged[0].startswith("checkpoint 3 cannot be restored") and len(logged) == 2
    assert logged[1] == "resumed from checkpoint 1"
    names = [p.name for p in (run / "checkpoints").iterdir()]
    assert any(n.startswith("3.damaged-") for n in names) and "3" in names
    a, b = load_file(full / "model.safetensors"), load_file(run / "model.safetensors")
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_weights_handed_over_in_another_layout_are_written_as_they_are(tmp_path, monkeypatch):
    """A TPU hands some parameters to the host in another memory layout (strides), and safetensors
    writes an array's memory as it lies: `save_weights` must make each row-major first, or the
    file holds them scrambled. Here every parameter comes back column-major."""
    import vqgan.weights as weights

    cfg = _tiny_model_cfg()
    model = init_model(cfg, seed=0)
    expected = {k: np.array(v) for k, v in weights._flat_params(model).items()}
    device_get = jax.device_get
    monkeypatch.setattr(weights.jax, "device_get", lambda x: np.asfortranarray(device_get(x)))
    assert not np.asfortranarray(expected["quant_conv.kernel"]).flags.c_contiguous
    weights.save_weights(tmp_path, model, cfg)
    monkeypatch.undo()
    loaded, _ = weights.load_weights(tmp_path)
    for name, value in weights._flat_params(loaded).items():
        np.testing.assert_array_equal(np.asarray(value), expected[name], err_msg=name)


def test_weights_that_do_not_read_back_are_refused_and_not_kept(tmp_path, monkeypatch):
    """`save_weights` reads the file back: a writer that changes one tensor (here its bytes
    reversed) is a `WeightsError` naming it, and no model.safetensors is left."""
    import safetensors.numpy

    import vqgan.weights as weights

    cfg = _tiny_model_cfg()
    model = init_model(cfg, seed=0)
    save_file = safetensors.numpy.save_file

    def garbling(tensors, filename, metadata=None):
        kernel = tensors["quant_conv.kernel"]
        tensors = dict(
            tensors, **{"quant_conv.kernel": kernel.ravel()[::-1].reshape(kernel.shape).copy()}
        )
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.numpy, "save_file", garbling)
    with pytest.raises(WeightsError, match="tensor 'quant_conv.kernel' does not read back"):
        weights.save_weights(tmp_path, model, cfg)
    assert not (tmp_path / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir() if "safetensors" in p.name] == []


def test_the_fingerprint_names_the_weights_whatever_holds_them(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    """`VideoTokenizer.fingerprint`, which a dataset records: the same for the same weights
    from the weights file or the checkpoint, and in another compute dtype (the resumed run's
    equal the uninterrupted one's); another for weights that moved."""
    import shutil

    from safetensors.numpy import load_file, save_file

    full, part = trained
    first = load_tokenizer(full).fingerprint
    assert len(first) == 16 and load_tokenizer(part).fingerprint == first
    assert load_tokenizer(full, dtype="bfloat16").fingerprint == first
    checkpoint_only = tmp_path / "checkpoint_only"
    shutil.copytree(full, checkpoint_only)
    (checkpoint_only / "model.safetensors").unlink()
    assert load_tokenizer(checkpoint_only).fingerprint == first
    weights = load_file(full / "model.safetensors")
    name = sorted(weights)[-1]
    weights[name] = weights[name] * 1.001
    moved = tmp_path / "moved"
    shutil.copytree(full, moved)
    save_file(weights, moved / "model.safetensors")
    assert load_tokenizer(moved).fingerprint != first


def test_encode_writes_the_codes_to_the_name_given(
    trained: tuple[Path, Path], tmp_path, capfd
) -> None:
    """`lwm vqgan encode --out NAME` writes NAME itself (np.save would add .npy to a name
    without it, and the codes went to a hidden temporary file); a folder there is refused
    before any work; a file that is no video is one line (ffmpeg's and decord's own log lines
    came first)."""
    from lwm.base.media import write_mp4
    from lwm.cli import main

    video = tmp_path / "v.mp4"
    write_mp4(video, np.zeros((2, 16, 16, 3), np.uint8))
    encode = ["vqgan", "encode", str(video), "--vqgan", str(trained[0])]
    out = tmp_path / "codes"
    assert main([*encode, "--out", str(out)]) == 0
    assert np.load(out).shape == (1, 2, 8, 8) and sorted(os.listdir(tmp_path)) == ["codes", "v.mp4"]
    assert main([*encode, "--out", str(tmp_path)]) == 2
    fake = tmp_path / "fake.mp4"
    fake.write_text("not a video")
    capfd.readouterr()
    assert main(["vqgan", "encode", str(fake), "--vqgan", str(trained[0])]) == 2
    assert capfd.readouterr().err == (
        f"lwm vqgan: error: cannot read video '{fake}': unknown format, or the file is damaged\n"
    )


def test_step_phase() -> None:
    cfg = load_vqgan_config(TINY, ["loss.disc_start=5", "quantizer.restart_every=3"])
    phases = [step_phase(cfg, s) for s in range(8)]
    assert [a for a, _ in phases] == [False] * 5 + [True] * 3
    assert [r for _, r in phases] == [False, False, False, True, False, False, True, False]
    cfg = load_vqgan_config(TINY, ["loss.adversarial_weight=0", "quantizer.restart_until=4"])
    assert [step_phase(cfg, s) for s in (2, 4, 6)] == [(False, True), (False, True), (False, False)]


def test_tokenizer_batched_sharded_round_trip(trained: tuple[Path, Path]) -> None:
    full, _ = trained
    mesh = make_mesh("1,-1,1,1")  # 8 devices on fsdp
    tok = load_tokenizer(full, mesh=mesh, batch_size=8)
    assert (tok.resolution, tok.tokens_per_frame, tok.codebook_size) == (16, 64, 64)
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (2, 5, 24, 20, 3), dtype=np.uint8)  # 10 frames: 2 chunks, padded
    codes = tok.encode(frames)
    assert codes.shape == (2, 5, 8, 8) and codes.dtype == np.int32
    assert codes.min() >= 0 and codes.max() < 64
    decoded = tok.decode(codes)
    assert decoded.shape == (2, 5, 16, 16, 3) and decoded.dtype == np.uint8
    # Same codes as the unsharded model (one jitted call on all 10 frames).
    model = load_model(full)
    x = preprocess(jnp.asarray(frames.reshape(10, 24, 20, 3)), 16)
    direct = np.asarray(nnx.jit(lambda m, x: m.encode(x).codes)(model, x)).reshape(2, 5, 8, 8)
    assert np.array_equal(codes, direct)
    # Decoded as the unsharded model decodes the same codes (`decode_codes`, then uint8).
    frames_of = nnx.jit(lambda m, c: postprocess(m.decode_codes(c)))
    direct = np.asarray(frames_of(model, jnp.asarray(codes.reshape(10, 8, 8))))
    # up to float rounding: one frame per device and ten on one device may take different
    # convolution kernels, and a value on a rounding boundary then lands 1 apart in uint8 (one
    # channel of 7,680 with the weights of the threefry-keyed training)
    apart = np.abs(decoded.astype(int) - direct.reshape(2, 5, 16, 16, 3).astype(int))
    assert apart.max() <= 1 and np.count_nonzero(apart) <= 8, np.count_nonzero(apart)
    # Chunking and padding do not change results: one video at a time gives the same.
    assert np.array_equal(tok.decode(codes[1:]), decoded[1:])
    assert np.array_equal(tok.encode(frames[:1]), codes[:1])
    assert tok.encode(decoded).shape == codes.shape  # decoded frames are valid input
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 64\)"):
        tok.decode(np.full((1, 1, 8, 8), 64))
    with pytest.raises(ValueError, match="uint8 frames"):
        tok.encode(frames.astype(np.float32))


# ---------------------------------------------------------------------------------------------
# LWM weights and the restricted unpickler


def _res(rng: np.random.Generator, cin: int, cout: int) -> dict:
    block = {
        "GroupNorm_0": {"scale": rng.normal(size=cin), "bias": rng.normal(size=cin)},
        "Conv_0": {"kernel": rng.normal(size=(3, 3, cin, cout)), "bias": rng.normal(size=cout)},
        "GroupNorm_1": {"scale": rng.normal(size=cout), "bias": rng.normal(size=cout)},
        "Conv_1": {"kernel": rng.normal(size=(3, 3, cout, cout)), "bias": rng.normal(size=cout)},
    }
    if cin != cout:
        block["Conv_2"] = {
            "kernel": rng.normal(size=(1, 1, cin, cout)),
            "bias": rng.normal(size=cout),
        }
    return block


def _conv(rng: np.random.Generator, k: int, cin: int, cout: int) -> dict:
    return {"kernel": rng.normal(size=(k, k, cin, cout)), "bias": rng.normal(size=cout)}


def _lwm_tree(seed: int = 0) -> dict:
    """LWM's linen parameter names, written out by hand for channels 16 x (1, 2), one residual
    block per level (two in the decoder), latent 8, codebook 32 x 8."""
    rng = np.random.default_rng(seed)
    gn = lambda c: {"scale": rng.normal(size=c), "bias": rng.normal(size=c)}  # noqa: E731
    tree = {
        "encoder": {
            "Conv_0": _conv(rng, 3, 3, 16),
            "DownsamplingBlock_0": {
                "ResnetBlock_0": _res(rng, 16, 16),
                "Downsample_0": {"Conv_0": _conv(rng, 3, 16, 16)},
            },
            "DownsamplingBlock_1": {"ResnetBlock_0": _res(rng, 16, 32)},
            "MidBlock_0": {"ResnetBlock_0": _res(rng, 32, 32), "ResnetBlock_1": _res(rng, 32, 32)},
            "GroupNorm_0": gn(32),
            "Conv_1": _conv(rng, 3, 32, 8),
        },
        "decoder": {
            "Conv_0": _conv(rng, 3, 8, 32),
            "MidBlock_0": {"ResnetBlock_0": _res(rng, 32, 32), "ResnetBlock_1": _res(rng, 32, 32)},
            # linen names the levels in creation order: the coarsest (level 1) first.
            "UpsamplingBlock_0": {
                "ResnetBlock_0": _res(rng, 32, 32),
                "ResnetBlock_1": _res(rng, 32, 32),
                "Upsample_0": {"Conv_0": _conv(rng, 3, 32, 32)},
            },
            "UpsamplingBlock_1": {
                "ResnetBlock_0": _res(rng, 32, 16),
                "ResnetBlock_1": _res(rng, 16, 16),
            },
            "GroupNorm_0": gn(16),
            "Conv_1": _conv(rng, 3, 16, 3),
        },
        "quantize": {"embeddings": rng.normal(size=(32, 8))},
        "quant_conv": _conv(rng, 1, 8, 8),
        "post_quant_conv": _conv(rng, 1, 8, 8),
    }
    return jax.tree.map(lambda a: a.astype(np.float32), tree)


LWM_TINY = dict(
    resolution=16, hidden_channels=16, channel_mult=(1, 2), num_res_blocks=1, z_channels=8,
    num_embeddings=32, embed_dim=8, num_groups=8,
)  # fmt: skip


def _lwm_reference():
    """`benchmarks/lwm_vqgan_reference.py`: LWM's linen architecture, re-expressed."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "lwm_vqgan_reference.py"
    spec = importlib.util.spec_from_file_location("lwm_vqgan_reference", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_ours_equals_lwm_architecture_with_the_same_weights() -> None:
    """Our NNX VQGAN and LWM's linen architecture, given one set of weights (ours exported in
    LWM's parameter names), encode to the same codes and decode to the same frames."""
    ref = _lwm_reference()
    cfg = VQGANModelConfig(
        resolution=16, hidden_channels=32, channel_mult=(1, 2), num_res_blocks=1,
        z_channels=8, num_embeddings=32, embed_dim=8, num_groups=32,
    )  # fmt: skip
    ours = init_model(cfg, seed=3)
    tree = export_lwm_params(ours)
    lwm = ref.LWMVQGAN(cfg)
    x = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (2, 16, 16, 3)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        _, ref_codes = lwm.apply({"params": tree}, x, method=ref.LWMVQGAN.encode)
        np.testing.assert_array_equal(np.asarray(ours.encode(x).codes), np.asarray(ref_codes))
        ref_frames = lwm.apply({"params": tree}, ref_codes, method=ref.LWMVQGAN.decode)
        np.testing.assert_allclose(ours.decode_codes(ref_codes), ref_frames, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_group_norm_equals_flax(dtype: str) -> None:
    """`vqgan.model.GroupNorm` (per-channel sums, then groups) gives Flax's `nnx.GroupNorm`
    result for the same parameters: frames and flat vectors, one channel or several per group,
    inputs centred on zero and off it."""
    rng = np.random.default_rng(0)
    for shape, groups, offset in [
        ((2, 5, 7, 64), 8, 0.0),
        ((3, 4, 4, 32), 32, 5.0),
        ((4, 16), 4, 1.0),
    ]:
        c = shape[-1]
        ours = GroupNorm(c, num_groups=groups, epsilon=1e-6, dtype=dtype, rngs=nnx.Rngs(0))
        flax_gn = nnx.GroupNorm(c, num_groups=groups, epsilon=1e-6, dtype=dtype, rngs=nnx.Rngs(0))
        ours.scale[...] = jnp.asarray(rng.standard_normal(c), jnp.float32)
        ours.bias[...] = jnp.asarray(rng.standard_normal(c), jnp.float32)
        flax_gn.scale[...], flax_gn.bias[...] = ours.scale[...], ours.bias[...]
        x = jnp.asarray(rng.standard_normal(shape) * 2 + offset, dtype)
        got, want = ours(x), flax_gn(x)
        assert got.dtype == want.dtype == jnp.dtype(dtype) and got.shape == shape
        tol = 1e-5 if dtype == "float32" else 3e-2
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
        )


def test_import_lwm_pickle(tmp_path: Path) -> None:
    tree = _lwm_tree()
    path = tmp_path / "vqgan.pkl"
    path.write_bytes(pickle.dumps({"params": tree}, protocol=4))
    loaded = load_legacy_pickle(path, allow_pickle=True)
    model = import_lwm_params(loaded, VQGANModelConfig(**LWM_TINY), source=str(path))
    dec = tree["decoder"]
    np.testing.assert_array_equal(
        model.decoder.up[0].res[0].shortcut.kernel[...],
        dec["UpsamplingBlock_1"]["ResnetBlock_0"]["Conv_2"]["kernel"],
    )
    np.testing.assert_array_equal(
        model.decoder.up[1].upsample.bias[...],
        dec["UpsamplingBlock_0"]["Upsample_0"]["Conv_0"]["bias"],
    )
    np.testing.assert_array_equal(
        model.encoder.down[0].downsample.kernel[...],
        tree["encoder"]["DownsamplingBlock_0"]["Downsample_0"]["Conv_0"]["kernel"],
    )
    np.testing.assert_array_equal(model.quantizer.embeddings[...], tree["quantize"]["embeddings"])
    back = export_lwm_params(model)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True)
    )
    # Protocol 2 and 5 pickles (other numpy rebuild paths) load too.
    for protocol in (2, 5):
        path.write_bytes(pickle.dumps(tree, protocol=protocol))
        again = load_legacy_pickle(path, allow_pickle=True)
        np.testing.assert_array_equal(again["quant_conv"]["kernel"], tree["quant_conv"]["kernel"])
    # A tree of another architecture is refused with the offending name.
    del tree["decoder"]["UpsamplingBlock_0"]["Upsample_0"]
    with pytest.raises(WeightsError, match="UpsamplingBlock_0/Upsample_0/Conv_0"):
        import_lwm_params(tree, VQGANModelConfig(**LWM_TINY))


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_restricted_unpickler_refuses_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps({"encoder": _Exploit(marker)}))
    with pytest.raises(LegacyPickleError, match=r"references the global '(posix|os|nt)\.system'"):
        load_legacy_pickle(path, allow_pickle=True)
    assert not marker.exists()
    with pytest.raises(LegacyPickleError, match="explicit opt-in"):
        load_legacy_pickle(path)
    text = tmp_path / "notes.txt"  # was called "a legacy pickle" too
    text.write_text("hello")
    with pytest.raises(LegacyPickleError, match="is not a pickle of protocol 2 or later"):
        load_legacy_pickle(text)
    path.write_bytes(pickle.dumps({"x": np.array([object()], dtype=object)[:0]}))
    with pytest.raises(
        LegacyPickleError, match="builtins.object|dtype 'O8?' is not a plain numeric dtype"
    ):
        load_legacy_pickle(path, allow_pickle=True)


class _Reduce:
    """Pickles as ``callable(*args)`` then, with a state, BUILD: to hand-craft numpy pickles."""

    def __init__(self, *reduce):
        self.reduce = reduce

    def __reduce__(self):
        return self.reduce


def _dtype_with_state(name: str, state: tuple) -> _Reduce:
    return _Reduce(np.dtype, (name, False, True), state)


def test_restricted_unpickler_refuses_crafted_numpy_state(tmp_path: Path) -> None:
    """numpy's dtype.__setstate__ trusts a pickled dtype's fields, item size and flags: an object
    field with the "holds objects" flag cleared turned file bytes into object pointers (a crash
    on first use, or while unpickling for a datetime dtype given fields), and an item size below
    a field's offset read past the buffer. Such dtypes are refused; plain ones still load."""
    from numpy._core.multiarray import scalar
    from numpy._core.numeric import _frombuffer

    obj_field = {"a": (np.dtype("O"), 0)}
    crafted = {
        "object field, flags cleared": _Reduce(
            _frombuffer,
            (
                b"A" * 8,
                _dtype_with_state("V8", (3, "|", None, ("a",), obj_field, 8, 1, 0)),
                (1,),
                "C",
            ),
        ),
        "a field past the item size": _Reduce(
            _frombuffer,
            (
                b"\0" * 4,
                _dtype_with_state(
                    "V1", (3, "|", None, ("a",), {"a": (np.dtype("f8"), 4096)}, 1, 1, 0)
                ),
                (4,),
                "C",
            ),
        ),
        "a float32 given fields": _Reduce(
            scalar,
            (_dtype_with_state("f4", (3, "<", None, ("a",), obj_field, 8, 1, 0)), b"A" * 4),
        ),
        "datetime given fields": _dtype_with_state(
            "M8[s]", (3, "|", None, ("a",), obj_field, 8, 1, 31)
        ),
    }
    path = tmp_path / "crafted.pkl"
    for what, payload in crafted.items():
        path.write_bytes(pickle.dumps({"w": payload}, protocol=4))
        with pytest.raises(LegacyPickleError, match=f"refusing to load '{path}'"):
            load_legacy_pickle(path, allow_pickle=True)
            pytest.fail(what)
    # Plain dtypes load, with their byte order, memory order and scalars, in every protocol.
    tree = {
        "big_endian": np.arange(5, dtype=">i4"),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "half": np.linspace(0, 1, 4, dtype=np.float16),
        "flags": np.array([True, False]),
        "scalars": [np.float32(2.5), np.int8(-3), np.complex64(1j)],
    }
    for protocol in (2, 4, 5):
        path.write_bytes(pickle.dumps(tree, protocol=protocol))
        got = load_legacy_pickle(path, allow_pickle=True)
        assert got.keys() == tree.keys()
        for want, have in zip(jax.tree.leaves(tree), jax.tree.leaves(got), strict=True):
            assert type(have) is type(want) and np.array_equal(have, want)
            assert have.dtype.newbyteorder("=") == want.dtype.newbyteorder("=")
        assert got["fortran"].flags.f_contiguous and got["fortran"].flags.writeable


def test_restricted_unpickler_bounds_memory_and_nesting(tmp_path: Path) -> None:
    """A small file cannot make large allocations (``numpy.ndarray(shape, object)`` filled N
    slots before the tree was checked), nor loop or crash the tree check: a container inside
    itself is refused in one line (it was a RecursionError), and a list holding the same list
    twice, 60 levels deep, loads at once (it took 2**60 steps)."""
    from numpy._core.multiarray import _reconstruct

    path = tmp_path / "bomb.pkl"
    for payload, message in [
        (_Reduce(np.ndarray, ((10**12,), np.dtype("O"))), "calls numpy.ndarray"),
        (_Reduce(np.ndarray, ((10**12,), np.dtype("f4"))), "calls numpy.ndarray"),
        (_Reduce(_reconstruct, (np.ndarray, (10**12,), b"b")), "has no data"),
        (
            _Reduce(
                _reconstruct, (np.ndarray, (0,), b"b"), (1, (10**12,), np.dtype("f4"), False, b"")
            ),
            r"needs 4000000000000 bytes, the file has 0",
        ),
    ]:
        path.write_bytes(pickle.dumps({"w": payload}, protocol=4))
        with pytest.raises(LegacyPickleError, match=f"refusing to load '{path}': .*{message}"):
            load_legacy_pickle(path, allow_pickle=True)
    loop: list = []
    loop.append(loop)
    path.write_bytes(pickle.dumps({"w": loop}, protocol=4))
    with pytest.raises(LegacyPickleError, match="the container at 'w/0' contains itself"):
        load_legacy_pickle(path, allow_pickle=True)
    shared: list = []
    for _ in range(60):
        shared = [shared, shared]
    path.write_bytes(pickle.dumps({"w": shared}, protocol=4))
    got = load_legacy_pickle(path, allow_pickle=True)
    assert got["w"][0] is got["w"][1]


def test_cli_import_and_refusal(tmp_path: Path) -> None:
    pkl = tmp_path / "vqgan.pkl"
    pkl.write_bytes(pickle.dumps(_lwm_tree(), protocol=4))
    config = tmp_path / "lwm_tiny.yaml"
    config.write_text(
        "model:\n"
        + "".join(f"  {k}: {list(v) if isinstance(v, tuple) else v}\n" for k, v in LWM_TINY.items())
    )
    env = dict(os.environ)

    def lwm(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "lwm", "vqgan", *args]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    refused = lwm("import", str(pkl), "--out", str(tmp_path / "w"), "--config", str(config))
    assert refused.returncode == 2 and "--allow-legacy-pickle" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / "w").exists()
    out = tmp_path / "w"
    done = lwm(
        "import", str(pkl), "--config", str(config), "--allow-legacy-pickle", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert (out / "model.safetensors").is_file() and (out / "config.yaml").is_file()
    tok = load_tokenizer(out)
    assert (tok.resolution, tok.tokens_per_frame, tok.codebook_size) == (16, 64, 32)
    assert isinstance(load_vqgan_config(out / "config.yaml"), VQGANConfig)
    # again into the same folder: refused, the weights there kept (they were replaced)
    weights = (out / "model.safetensors").read_bytes()
    again = lwm(
        "import", str(pkl), "--config", str(config), "--allow-legacy-pickle", "--out", str(out)
    )
    assert again.returncode == 2 and again.stderr == (
        f"lwm vqgan: error: --out '{out}' already holds a VQGAN (model.safetensors); import "
        "into a new folder\n"
    )
    assert (out / "model.safetensors").read_bytes() == weights


def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path: Path) -> None:
    """`lwm vqgan train` stopped by SIGINT saves the step it finished and exits 130 with one
    line saying so, as `lwm train` does (it exited 130 without saving: a rerun went back to
    the last `train.save_every` checkpoint)."""
    import signal
    import time

    from conftest import subprocess_xla_flags

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lwm", "vqgan", "train", "--cpu-devices", "2"]
    cmd += ["--config", str(TINY), f"train.output_dir={out}", "train.steps=1000"]
    cmd += ["train.progress=false", "train.eval_every=1000", "mesh.shape=1,-1,1,1"]
    cmd += ["loss.disc_start=1000"]  # one compiled step: the adversarial one is not needed
    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags())
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    metrics, deadline = out / "metrics.jsonl", time.time() + 240
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.stderr.read()
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    step = int(err.strip().splitlines()[-1].split(" at step ")[1].split(":")[0])
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"lwm vqgan: SIGINT at step {step}: saved checkpoint {step}; rerun to resume"
    )
    assert 2 <= step < 1000 and (out / "checkpoints" / str(step)).is_dir()
    assert not (out / "model.safetensors").exists()
