"""Mesh shapes, the logical axis rules, and shardings on 8 simulated CPU devices."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from lwm.base.mesh import (
    LOGICAL_AXIS_RULES,
    MESH_AXES,
    MeshError,
    logical_sharding,
    logical_to_spec,
    make_mesh,
    mesh_axis_sizes,
    parse_mesh_shape,
    shard_bytes,
    shard_shape,
    use_platform,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("spec", "devices", "expected"),
    [
        ("1,-1,1,1", 8, (1, 8, 1, 1)),
        ("1,-1,4,1", 8, (1, 2, 4, 1)),
        (" 2, 1, -1, 2 ", 8, (2, 1, 2, 2)),
        ("1,2,2,2", 8, (1, 2, 2, 2)),
        ((1, -1, 1, 1), 1, (1, 1, 1, 1)),
        ([8, 1, 1, 1], 8, (8, 1, 1, 1)),
    ],
)
def test_parse_mesh_shape(spec, devices, expected) -> None:
    assert parse_mesh_shape(spec, devices) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("1,2,2,3", "mesh shape '1,2,2,3' needs 12 devices but 8 are available"),
        ("1,-1,3,1", "mesh shape '1,-1,3,1': 8 devices cannot be split evenly"),
        ("1,-1,-1,1", "mesh shape '1,-1,-1,1' has more than one -1"),
        (
            "1,0,8,1",
            "mesh shape '1,0,8,1': axis sizes must be positive integers or a single -1, got 0",
        ),
        ("1,-2,4,1", "got -2"),
        ("1,2.5,4,1", "mesh shape '1,2.5,4,1': '2.5' is not an integer"),
        ("1,x,4,1", "'x' is not an integer"),
        ("1,,4,1", "'' is not an integer"),
        (
            "1,-1,4",
            "mesh shape '1,-1,4' must have 4 comma-separated integers (dp,fsdp,sp,tp), got 3",
        ),
        ("1,1,1,1,8", "got 5"),
        ((1, 2.0, 4, 1), "'2.0' is not an integer"),
    ],
)
def test_parse_mesh_shape_errors(spec, message) -> None:
    with pytest.raises(MeshError) as info:
        parse_mesh_shape(spec, 8)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_make_mesh_on_8_devices() -> None:
    assert jax.device_count() == 8
    mesh = make_mesh("1,2,-1,2")
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 2, "sp": 2, "tp": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 4
    assert make_mesh("1,-1,1,1", devices=jax.devices()[:2]).shape["fsdp"] == 2
    with pytest.raises(MeshError, match="needs 16 devices but 8 are available"):
        make_mesh("2,2,2,2")


def test_logical_to_spec() -> None:
    assert logical_to_spec(("embed", "mlp")) == PartitionSpec(("fsdp", "sp"), "tp")
    assert logical_to_spec(("layers", "embed", "heads")) == PartitionSpec(
        None, ("fsdp", "sp"), "tp"
    )
    assert logical_to_spec(("batch", "length", "act_embed")) == PartitionSpec(
        ("dp", "fsdp"), "sp", None
    )
    assert logical_to_spec(("norm",)) == PartitionSpec(None)
    assert logical_to_spec((None, "vocab")) == PartitionSpec(None, "tp")
    with pytest.raises(MeshError, match="unknown logical axis 'embd'; known axes: act_embed"):
        logical_to_spec(("embd", "mlp"))
    with pytest.raises(MeshError, match="use mesh axis 'tp' twice"):
        logical_to_spec(("heads", "mlp"))
    with pytest.raises(MeshError, match="use mesh axis 'fsdp' twice"):
        logical_to_spec(("batch", "embed"))


def test_rules_only_name_mesh_axes() -> None:
    for value in LOGICAL_AXIS_RULES.values():
        axes = () if value is None else (value,) if isinstance(value, str) else value
        assert set(axes) <= set(MESH_AXES)


def test_device_put_with_logical_sharding() -> None:
    mesh = make_mesh("1,2,2,2")
    sharding = logical_sharding(mesh, ("embed", "mlp"))
    assert isinstance(sharding, NamedSharding)
    assert sharding.spec == PartitionSpec(("fsdp", "sp"), "tp")
    x = jax.device_put(jnp.arange(16 * 6, dtype=jnp.float32).reshape(16, 6), sharding)
    assert {s.data.shape for s in x.addressable_shards} == {(4, 3)}
    assert len(x.addressable_shards) == 8
    assert shard_shape(x.shape, sharding.spec, mesh.shape) == (4, 3)
    np.testing.assert_array_equal(np.asarray(x), np.arange(96).reshape(16, 6))


def test_shard_shape_rounds_up_for_planned_meshes() -> None:
    sizes = mesh_axis_sizes((1, 4, 2, 4))
    spec = logical_to_spec(("embed", "vocab"))
    assert shard_shape((4096, 32001), spec, sizes) == (512, 8001)
    assert shard_bytes((4096, 32001), spec, sizes, 2) == 512 * 8001 * 2
    assert shard_shape((3, 5), PartitionSpec(), sizes) == (3, 5)


def run_benchmark(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``benchmarks/<script> args`` in a fresh process, free to pick its own platform and
    devices (without the suite's JAX_PLATFORMS and XLA_FLAGS)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the errors of a CPU host")
def test_use_platform_errors_are_one_line() -> None:
    """Late or unknown platforms are refused by name; a benchmark asked for a GPU on a host
    without CUDA exits non-zero with one line (no traceback) before it measures anything."""
    with pytest.raises(MeshError, match="--platform gpu: JAX has already started on cpu"):
        use_platform("gpu")
    with pytest.raises(MeshError, match="--platform tpu: JAX has already started on cpu"):
        use_platform("tpu")
    with pytest.raises(MeshError, match="--platform npu: expected one of cpu, tpu, gpu, auto"):
        use_platform("npu")
    for script in ("bench_train.py", "bench_attention.py"):
        run = run_benchmark(script, "--platform", "gpu", timeout=120)
        lines = run.stderr.strip().splitlines()
        assert run.returncode != 0 and run.stdout == "", (script, run.stdout, run.stderr)
        assert len(lines) == 1 and "--platform gpu: JAX finds no CUDA GPU" in lines[0], lines
    # a mesh the simulated CPU devices cannot form: one line, nothing measured
    run = run_benchmark("bench_train.py", "--mesh", "2,1,2", timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and run.stdout == "", (run.stdout, run.stderr)
    assert len(lines) == 1 and "mesh shape '2,1,2' must have 4" in lines[0], lines


def test_bench_train_writes_a_profile_of_each_measurement(tmp_path) -> None:
    """`bench_train --profile DIR` writes a JAX profiler trace of each measurement into a folder
    named by its size, length, kernel, remat policy and block, which its JSON line names."""
    run = run_benchmark(
        "bench_train.py", "--sizes", "tiny", "--seqs", "256", "--attention", "blockwise",
        "--mesh", "1,1,1,1", "--repeats", "1", "--block", "128", "--remat", "attention_saveable",
        "--profile", str(tmp_path),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    step = [r for r in records if r["bench"] == "train_step"]
    assert len(step) == 1 and step[0]["block"] == 128 and step[0]["remat"] == "attention_saveable"
    traces = list((tmp_path / "tiny-256-xla-attention_saveable-128").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0, list(tmp_path.rglob("*"))


def test_bench_attention_ours_given_head_major_arrays_equals_dense() -> None:
    """`bench_attention --impls ours-hm` (blockwise attention given splash's [batch, heads,
    seq, head_dim] arrays) computes the same attention as dense, forward and gradients."""
    run = run_benchmark(
        "bench_attention.py", "--impls", "ours-hm", "--seqs", "256", "--block", "64", "--heads",
        "4", "--cpu-devices", "1", "--repeats", "1", "--check",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    checks = [json.loads(x) for x in run.stdout.splitlines() if '"attention_check"' in x]
    assert {c["mode"] for c in checks} == {"fwd", "fwd_bwd"}, checks
    assert all(c["status"] == "ok" and c["max_rel_err_vs_dense"] < 1e-5 for c in checks), checks
