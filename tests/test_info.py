"""Analytic parameter counts, FLOPs and per-device memory."""

import math
from pathlib import Path

from lwm.base.mesh import LOGICAL_AXIS_RULES, mesh_axis_sizes
from lwm.config import load_config
from lwm.info import (
    VISION_PARAMS,
    flops_per_token,
    memory_per_device,
    param_counts,
    param_specs,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _model(name: str, *overrides: str):
    return load_config(CONFIGS / name, overrides).model


def test_7b_parameter_counts() -> None:
    counts = param_counts(_model("7b.yaml"))
    assert counts.text == 6_738_415_616  # LLaMA-2-7B
    assert counts.vision == 2 * 8448 * 4096
    assert counts.total == counts.text + counts.vision


def test_specs_shapes_and_axes() -> None:
    model = _model("debug.yaml")
    specs = param_specs(model)
    assert specs["layers.attn.q"] == ((2, 64, 64), ("layers", "embed", "heads"))
    assert specs["layers.attn.k"] == ((2, 64, 32), ("layers", "embed", "kv_heads"))
    assert specs["layers.mlp.down"] == ((2, 128, 64), ("layers", "mlp", "embed"))
    assert specs["lm_head"] == ((64, 256), ("embed", "vocab"))
    assert specs["vision_head"] == ((64, 8448), ("embed", "vocab"))
    assert {"embed_vision", "vision_head"} <= set(specs)
    assert "embed_vision_row" not in specs  # only with model.vision_grid
    grid = param_specs(
        _model(
            "debug.yaml",
            "model.vision_grid=[2,3]",
            "model.vision_window=1",
            "model.vision_codes=16",
        )
    )
    assert set(grid) >= VISION_PARAMS
    # one table of the model's codes per neighbour: left, up-left, up, up-right
    assert grid["embed_vision_window"] == ((4, 16, 64), ("grid", "vocab", "embed"))
    assert grid["embed_vision_row"] == ((2, 64), ("grid", "embed"))
    assert grid["embed_vision_col"] == ((3, 64), ("grid", "embed"))
    assert param_counts(_model("debug.yaml", "model.vision_grid=[2,3]")).vision == (
        param_counts(model).vision + 5 * 64
    )
    for shape, axes in {**specs, **grid}.values():
        assert len(shape) == len(axes)
        assert all(a in LOGICAL_AXIS_RULES for a in axes)
    unrolled = param_specs(_model("debug.yaml", "model.scan_layers=false"))
    assert unrolled["layers.1.attn.q"] == ((64, 64), ("embed", "heads"))
    total = sum(math.prod(s.shape) for s in specs.values())
    assert total == sum(math.prod(s.shape) for s in unrolled.values())


def test_tied_heads_have_no_matrix() -> None:
    untied = param_counts(_model("debug.yaml"))
    tied = param_counts(
        _model("debug.yaml", "model.tie_word_embeddings=true", "model.tie_vision_embeddings=true")
    )
    assert untied.text - tied.text == 64 * 256
    assert untied.vision - tied.vision == 64 * 8448
    assert "lm_head" not in param_specs(_model("debug.yaml", "model.tie_word_embeddings=true"))


def test_flops_per_token() -> None:
    model = _model("7b.yaml")
    flops = flops_per_token(model)
    n = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 4096 * (32000 + 8448)
    assert flops.matmul_params == n
    assert flops.train == 6 * n + 12 * 32 * 4096 * 32768
    assert flops.inference == 2 * n
    assert flops_per_token(model, seq_len=1024).train < flops.train


def test_per_device_bytes_shrink_with_fsdp() -> None:
    model = _model("7b.yaml")
    one = memory_per_device(model, mesh_axis_sizes((1, 1, 1, 1)))
    total = param_counts(model).total
    assert one.params == total * 4
    assert one.optimizer == total * 8
    eight = memory_per_device(model, mesh_axis_sizes((1, 8, 1, 1)))
    # Everything but the small norms is sharded 8 ways.
    norms = (2 * 32 + 1) * 4096 * 4
    assert eight.params == (one.params - norms) // 8 + norms
    # sp shares the weights like fsdp does; dp replicates them.
    assert memory_per_device(model, mesh_axis_sizes((1, 2, 4, 1))) == eight
    assert memory_per_device(model, mesh_axis_sizes((8, 1, 1, 1))) == one
    bf16 = memory_per_device(
        _model("7b.yaml", "model.param_dtype=bfloat16"), mesh_axis_sizes((1, 8, 1, 1))
    )
    assert bf16.params * 2 == eight.params and bf16.optimizer == eight.optimizer
    # Muon keeps one moment for each block matrix (LLaMA-2 7B: q, k, v, o of 4096 x 4096 and
    # gate, up, down of 4096 x 11008, 32 layers), AdamW's two for everything else.
    matrices = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    muon = memory_per_device(model, mesh_axis_sizes((1, 1, 1, 1)), "muon")
    assert muon.params == one.params and muon.optimizer == total * 8 - matrices * 4


def test_info_names_the_kernel_that_runs_and_the_rows_with_their_own_schedules(monkeypatch):
    """`lwm info`'s device line: the kernel the config's inputs run on (on a GPU, simulated,
    float32 falls back to the XLA kernel and says why) and the orders of rows `lwm train`
    compiles a schedule for (`row_orders`: only with cuDNN; ``in_order`` only where each device
    attends over the whole sequence)."""
    import jax
    from jax._src.cudnn import fused_attention_stablehlo as fa

    import lwm.train_step as ts
    from lwm.base.mesh import make_mesh
    from lwm.commands.info import describe_devices

    one = make_mesh("1,1,1,1", devices=jax.devices()[:1])
    ring = make_mesh("1,1,2,1", devices=jax.devices()[:2])
    bf16 = ["model.attention_kernel=cudnn", "model.dtype=bfloat16"]
    line = describe_devices(load_config(CONFIGS / "tiny.yaml", bf16), one)
    assert line.endswith(
        "attention_kernel cudnn -> cudnn (emulated); rows with their own schedules: any, "
        "in_order, one_document"
    ), line
    cfg = load_config(CONFIGS / "tiny.yaml", [*bf16, "model.attention=ring"])
    assert describe_devices(cfg, ring).endswith("schedules: any, one_document")
    cfg = load_config(CONFIGS / "tiny.yaml", ["model.attention_kernel=xla"])
    assert describe_devices(cfg, one).endswith("attention_kernel xla -> xla")

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)  # a GPU's cuDNN
    monkeypatch.setattr(ts, "resolve_kernel", lambda k, p=None: ("cudnn", False))
    cfg = load_config(CONFIGS / "tiny.yaml", ["model.attention_kernel=auto"])
    assert describe_devices(cfg, one).endswith(
        "attention_kernel auto -> xla: cudnn refuses dtype float32 (cuDNN's flash attention "
        "takes bfloat16 or float16)"
    )
    assert describe_devices(load_config(CONFIGS / "tiny.yaml", bf16), one).endswith(
        "attention_kernel cudnn -> cudnn; rows with their own schedules: any, in_order, "
        "one_document"
    )


def test_info_takes_the_cpu_devices_its_mesh_error_names() -> None:
    """A mesh of more devices than the host has: one line naming `--cpu-devices N`, which
    `lwm info` takes, as every verb that runs on devices does (it had only `--devices`)."""
    import os
    import subprocess
    import sys

    from conftest import subprocess_xla_flags

    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags())
    cmd = [sys.executable, "-m", "lwm", "info", "--config", str(CONFIGS / "demo.yaml")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "needs 2 devices but 1 is available" in r.stderr, r.stderr
    assert "--cpu-devices 2" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([*cmd, "--cpu-devices", "2"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# devices: 2 x cpu") and "mesh dp=1 fsdp=1 sp=2 tp=1" in r.stdout


def test_info_says_what_parameters_and_adamw_leave_of_a_chip() -> None:
    """On a device that reports its memory (a TPU's or GPU's ``bytes_limit``), `lwm info`
    adds what the float32 parameters and AdamW's two float32 moments (12 bytes a parameter on
    one device) take of it, and what is left."""
    from lwm.commands.info import format_info
    from lwm.info import param_counts

    cfg = load_config("configs/tiny.yaml", [])
    state = param_counts(cfg.model).total * (4 + 2 * 4)
    chip = 16 * 2**30
    report = format_info(cfg, "tiny", {"dp": 1, "fsdp": 1, "sp": 1, "tp": 1}, 1, chip)
    line = report.splitlines()[-1]
    assert (
        line.split()
        == (
            f"device memory 16.00 GiB: parameters and optimizer state take {state / chip:.0%}, "
            f"{(chip - state) / 2**30:.2f} GiB left for activations"
        ).split()
    )


def test_info_counts_an_optimizer_state_on_the_host_out_of_the_chip() -> None:
    """`train.offload_optimizer`: AdamW's moments are listed as host memory and the chip's line
    counts the parameters alone."""
    from lwm.commands.info import format_info
    from lwm.info import param_counts

    cfg = load_config("configs/tiny.yaml", ["train.offload_optimizer=true"])
    params = param_counts(cfg.model).total * 4
    chip = 16 * 2**30
    report = format_info(cfg, "tiny", {"dp": 1, "fsdp": 1, "sp": 1, "tp": 1}, 1, chip)
    lines = report.splitlines()
    assert lines[-3].split()[:4] == ["AdamW", "state", "(host", "memory)"]
    assert lines[-2].split() == ["total", "on", "the", "device", f"{params / 2**30:.2f}", "GiB"]
    assert (
        lines[-1].split()
        == (
            f"device memory 16.00 GiB: parameters take {params / chip:.0%}, "
            f"{(chip - params) / 2**30:.2f} GiB left for activations"
        ).split()
    )
