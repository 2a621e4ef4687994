"""`lwm train`: loss falls on real meshes, exact resume after kill -9, damaged checkpoints,
non-finite loss, gradient accumulation, context stages, and two processes == one."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import subprocess_xla_flags

ROOT = Path(__file__).resolve().parents[1]
BASE = [
    "train.batch_size=2",
    "train.seq_len=64",
    "train.log_every=1",
    "train.progress=false",
    "train.peak_flops=1e9",
    "train.learning_rate=3e-3",
    "model.attention=ring",
    "model.block_q=8",
    "model.block_k=8",
]


def lwm_train(out: Path, *overrides: str, devices: int = 8, env=None, wait=True):
    env = dict(os.environ if env is None else env)
    env["XLA_FLAGS"] = subprocess_xla_flags()  # the devices come from --cpu-devices (issue 14)
    cmd = [
        sys.executable,
        "-m",
        "lwm",
        "train",
        f"--cpu-devices={devices}",
        "--config",
        "configs/debug.yaml",
        *BASE,
        f"train.output_dir={out}",
        *overrides,
    ]
    if not wait:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def lwm_train_here(out: Path, *overrides: str) -> SimpleNamespace:
    """`lwm train` in this process, on its 8 devices (tests/conftest.py): the same command
    without the start-up of a new Python; returns its exit status and stderr."""
    from lwm.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(
            [
                "train",
                "--config",
                str(ROOT / "configs/debug.yaml"),
                *BASE,
                f"train.output_dir={out}",
                *overrides,
            ]
        )
    return SimpleNamespace(returncode=code, stderr=err.getvalue())


def losses(out: Path) -> dict[int, float]:
    """The last logged loss of every step (a resumed run logs its steps again)."""
    result = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            result[record["step"]] = record["loss"]
    return result


REFERENCE = ("train.steps=12", "train.save_every=3", "mesh.shape=1,2,2,2")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> SimpleNamespace:
    """An uninterrupted 12-step run on mesh (1,2,2,2) (in this process: the runs compared with
    it in processes of their own give the same losses bit for bit): its losses, and its folder
    (``out``), which tests read but never change: those that need a finished run to damage or
    resume start from a copy of it (`copy_of_reference`). A run with its settings (`REFERENCE`)
    loads its compiled train step instead of compiling it again (seconds of XLA each)."""
    out = tmp_path_factory.mktemp("ref")
    r = lwm_train_here(out, *REFERENCE)
    assert r.returncode == 0, r.stderr
    return SimpleNamespace(losses=losses(out), out=out)


def copy_of_reference(reference: SimpleNamespace, tmp_path: Path) -> Path:
    """A copy of the reference run's folder, as its run left it: config.yaml, metrics.jsonl,
    tensorboard/ and checkpoints 6, 9 and 12 (train.max_to_keep=3), no .lock (removed at the
    end of the run); a rerun in it resumes as in the run's own folder (train.output_dir, the
    one setting that differs, is not compared on a resume)."""
    out = tmp_path / "run"
    shutil.copytree(reference.out, out)
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [6, 9, 12]
    assert not (out / ".lock").exists()
    return out


def test_loss_falls_with_ring_attention_on_two_meshes(reference, tmp_path):
    """The second run also gives each code its row, column and window of neighbours
    (`model.vision_grid`, `model.vision_window`: the loader's extra batch field)."""
    assert sorted(reference.losses) == list(range(1, 13))
    assert reference.losses[12] < reference.losses[1] - 0.3, reference.losses
    r = lwm_train_here(
        tmp_path,
        "train.steps=12",
        "mesh.shape=1,1,4,2",
        "train.learning_rate=3e-3",
        "train.schedule=constant",
        "model.vision_grid=[2,4]",
        "model.vision_window=1",
    )
    assert r.returncode == 0, r.stderr
    got = losses(tmp_path)
    assert got[12] < got[1] - 0.3, got
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    for key in (
        "text_loss",
        "vision_loss",
        "text_accuracy",
        "vision_accuracy",
        "grad_norm",
        "learning_rate",
        "tokens_per_s",
        "step_time_s",
        "data_wait_s",
        "data_make_s",
        "mfu",
    ):
        assert np.isfinite(record[key]), key
    assert 0 < record["data_wait_s"] < record["step_time_s"]
    assert record["data_make_s"] > 0
    assert record["data_wait_share"] == pytest.approx(record["data_wait_s"] / record["step_time_s"])
    assert (tmp_path / "tensorboard").is_dir() and (tmp_path / "config.yaml").is_file()


def test_step_time_is_the_mean_of_the_steps_each_logged_window_holds(tmp_path, monkeypatch):
    """`step_time_s` (and so tokens/s and MFU) of a logged line is the time since the line
    before over the steps between them, whether the line is logged while the next step runs
    or at a checkpoint (a save step, the last step), and whether the metrics are fetched every
    step or several steps at once (`train.fetch_every`, here 1 and 3: the loop also fetches at
    each step it logs). A fake clock advances one second as each step's metrics arrive, so
    every window after the first (which holds the compile) is 1 s a step; counting the steps
    dispatched instead made it 4/3 s at a save, 4/5 s after it and 2 s at the last step."""
    from types import SimpleNamespace

    import jax

    import lwm.train as lt

    clock = [0.0]
    real_get = jax.device_get

    def device_get(x):
        # a list of steps' metrics: those steps have finished
        if isinstance(x, list) and all(isinstance(a, jax.Array) and a.ndim == 1 for a in x):
            clock[0] += len(x)
        return real_get(x)

    monkeypatch.setattr(jax, "device_get", device_get)
    monkeypatch.setattr(lt, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    # train.learning_rate: that of the resumes of
    # `test_a_resume_with_other_settings_says_so_and_keeps_the_old_config` (one train step
    # compiled for both)
    args = (
        "train.steps=14",
        "train.log_every=4",
        "train.save_every=8",
        "mesh.shape=1,2,2,2",
        "train.learning_rate=2e-3",
    )
    for fetch_every in (1, 3):
        out = tmp_path / str(fetch_every)
        r = lwm_train_here(out, *args, f"train.fetch_every={fetch_every}")
        assert r.returncode == 0, r.stderr
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [4, 8, 12, 14]
        for r in records[1:]:
            assert r["step_time_s"] == pytest.approx(1.0), (fetch_every, r)
            assert r["tokens_per_s"] == pytest.approx(2 * 64), (fetch_every, r)


def test_the_first_batch_is_made_while_the_run_sets_up_after_the_peak_rate(tmp_path, monkeypatch):
    """The loader's thread makes batch 1 while the rest of the run is set up (on a chip the
    held-out evaluator encodes its videos then), so the first step does not wait for it; the
    peak rate (`train.peak_flops=auto`) is measured before any of the loader's threads runs,
    so that they do not slow its timing; and a set-up that fails stops that thread. Before,
    batch 1 was asked for only once the loop ran (0.3 s of the demo's 2% data wait on a TPU v5e
    chip, docs/tpu.md). The set-up is stopped at the metrics writer: no step is compiled."""
    import threading

    import lwm.train as lt

    class SetUpStoppedError(Exception):
        pass

    made = threading.Event()
    real_pack = lt.pack_batch

    def pack_batch(local):
        made.set()
        return real_pack(local)

    seen = {}

    def writer(*args, **kwargs):
        seen["made_during_setup"] = made.wait(timeout=30)
        raise SetUpStoppedError

    def peak(devices, dtype):
        seen["threads_at_peak"] = {t.name for t in threading.enumerate()}
        return 1e9

    monkeypatch.setattr(lt, "pack_batch", pack_batch)
    monkeypatch.setattr(lt, "MetricsWriter", writer)
    monkeypatch.setattr(lt, "measure_peak_flops", peak)
    with pytest.raises(SetUpStoppedError):
        lwm_train_here(tmp_path / "run", "train.peak_flops=auto", "mesh.shape=1,2,2,2")
    assert seen["made_during_setup"]
    assert not {"lwm-batches", "lwm-record-warm"} & seen["threads_at_peak"]
    assert "lwm-batches" not in {t.name for t in threading.enumerate()}


def test_each_batch_runs_the_step_compiled_for_its_rows(tmp_path, monkeypatch):
    """With cuDNN attention (its stand-in) `lwm train` checks each batch on the host and runs
    the step compiled for its rows' order (`lwm.model.row_order`): here packed rows (in order)
    and, every other step, one document per row. Each order compiles once, the metrics give
    the share of each, and the losses are the XLA kernel's. As many processes run it (their
    count patched): one step checking on the device, compiled for the reach of the loader's
    plan (`last_look_back`), the same losses."""
    import lwm.train as lt

    real = lt.build_loader

    class EveryOtherOneDocument:
        def __init__(self, inner):
            self.inner = inner

        def __next__(self):
            batch = next(self.inner)
            if self.inner.step % 2 == 0:
                n = batch["positions"].shape[1]
                batch["segment_ids"] = np.ones_like(batch["segment_ids"])
                batch["positions"] = np.broadcast_to(np.arange(n, dtype=np.int32), (2, n)).copy()
            return batch

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(lt, "build_loader", lambda *a: EveryOtherOneDocument(real(*a)))
    runs = {}
    for run in ("xla", "cudnn", "cudnn-many"):
        if run == "cudnn-many":
            monkeypatch.setattr(lt, "_many_processes", lambda: True)
        out = tmp_path / run
        args = ("train.steps=4", "mesh.shape=1,2,4,1", "model.attention=blockwise")
        r = lwm_train_here(out, *args, f"model.attention_kernel={run.split('-')[0]}")
        assert r.returncode == 0, r.stderr
        runs[run] = (losses(out), r.stderr, out)
    ref = runs["xla"][0]
    for got, _, _ in (runs["cudnn"], runs["cudnn-many"]):
        assert sorted(got) == [1, 2, 3, 4]
        for step in got:
            assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    many = runs["cudnn-many"][1]
    assert many.count("rows checked on the device") == 1, many
    assert "else in order within 32 tokens): compiling" in many and "rows in_order" not in many
    lines = (runs["cudnn-many"][2] / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["one_document"] for x in lines] == [0.0, 1.0, 0.0, 1.0]
    # a plan that says less than a host's rows look back stops the run, naming both
    from data.batches import SyntheticTokenLoader

    monkeypatch.setattr(SyntheticTokenLoader, "last_look_back", lambda self: 4)
    r = lwm_train_here(tmp_path / "short", *args, "model.attention_kernel=cudnn")
    assert r.returncode != 0
    assert (
        "step 1: this host's rows look back 32 tokens, more than the 4 of the loader's" in r.stderr
    )
    err, out = runs["cudnn"][1], runs["cudnn"][2]
    # in order: one step per reach (`row_reach`) the batches have, here one
    assert err.count("rows in_order within 32 tokens: compiling") == 1, err
    assert err.count("rows one_document: compiling") == 1, err
    assert "rows any" not in err and "rows " not in runs["xla"][1]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rows_one_document"] for r in records] == [0.0, 1.0, 0.0, 1.0]
    assert [r["rows_in_order"] for r in records] == [1.0, 0.0, 1.0, 0.0]


def _wait_for_step(out: Path, step: int, proc, timeout=300.0):
    deadline = time.time() + timeout
    path = out / "metrics.jsonl"
    while time.time() < deadline:
        if path.exists() and any(
            json.loads(x)["step"] >= step for x in path.read_text().splitlines() if x.strip()
        ):
            return
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.02)
    raise AssertionError(f"step {step} never logged")


def test_two_processes_with_cudnn_check_rows_on_the_device(tmp_path):
    """Two real processes (4 simulated devices each) with cuDNN attention (its stand-in):
    the step checks each batch's rows on the device, compiled once for the reach of the
    loader's plan, which every host checks its own rows against; the losses are one
    process's with the XLA kernel (`test_each_batch_runs_the_step_compiled_for_its_rows`
    patches the process count instead). The settings of that test's runs: its XLA run's
    train step is loaded here, not compiled again."""
    args = ("train.steps=4", "mesh.shape=1,2,4,1", "model.attention=blockwise")
    one = lwm_train_here(tmp_path / "one", *args, "model.attention_kernel=xla")
    assert one.returncode == 0, one.stderr
    port = _free_port()
    many = (
        *args,
        "model.attention_kernel=cudnn",
        f"distributed.coordinator_address=127.0.0.1:{port}",
        "distributed.num_processes=2",
    )
    procs = [
        lwm_train(tmp_path / "two", *many, f"distributed.process_id={i}", devices=4, wait=False)
        for i in range(2)
    ]
    errs = []
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        errs.append(err)
    assert "rows checked on the device" in errs[0] and "rows in_order" not in errs[0], errs[0]
    ref, got = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    records = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["one_document"] for x in records] == [0.0, 0.0, 0.0, 0.0]


def _complete_checkpoints(out: Path) -> list[int]:
    """The steps of the checkpoints whose save completed (Orbax's commit marker is written)."""
    found = (out / "checkpoints").iterdir()
    return sorted(int(p.name) for p in found if (p / "commit_success.txt").exists())


@pytest.mark.parametrize("kill_after", [6, 7])
def test_kill_9_then_rerun_matches_uninterrupted(reference, tmp_path, kill_after):
    """Killed right after step 6 is logged (its asynchronous save may be in flight, or done)
    or after step 7 with checkpoint 6 complete: the rerun resumes from the newest checkpoint
    complete when the run was killed (recorded then: 3 if step 6's save was cut, else 6),
    says so, logs every step after it again and no earlier one, and every later loss equals
    the uninterrupted run's (as it would from an older checkpoint: the step is checked)."""
    args = REFERENCE
    proc = lwm_train(tmp_path, *args, wait=False)
    _wait_for_step(tmp_path, kill_after, proc)
    # Checkpoints are saved asynchronously: after step 6, let checkpoint 3 complete (6's may
    # be in flight); after step 7, checkpoint 6, so that the rerun must take the newest.
    saved = 3 if kill_after == 6 else 6
    deadline = time.time() + 120
    while not (tmp_path / "checkpoints" / str(saved) / "commit_success.txt").exists():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    complete = _complete_checkpoints(tmp_path)  # what the killed run left
    assert complete[-1] in (3, 6) and complete[-1] >= saved, complete
    logged = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (tmp_path / ".lock").is_file()  # the killed run's, left behind
    r = lwm_train_here(tmp_path, *args)  # the rerun: in this process
    assert r.returncode == 0, r.stderr
    resumed = [int(x) for x in re.findall(r"resumed from checkpoint (\d+)", r.stderr)]
    assert resumed == [complete[-1]], (resumed, complete, r.stderr[-2000:])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    again = [json.loads(x)["step"] for x in lines[len(logged) :]]
    assert again == list(range(complete[-1] + 1, 13)), again  # the rerun's steps
    assert (
        f"taking over the lock of train.output_dir '{tmp_path}' left by pid {proc.pid}" in r.stderr
    )
    assert not (tmp_path / ".lock").exists()  # removed at the end of the run
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert got[step] == reference.losses[step], (step, got[step], reference.losses[step])
    print(f"killed after step {kill_after}: resumed from checkpoint {complete[-1]}")


def test_profiled_run_writes_a_trace_of_its_steps_and_trains_the_same(reference, tmp_path):
    """`train.profile_steps`: a trace (jax.profiler's Perfetto file) holding the train step's
    runs of the profiled steps, and the same losses as the unprofiled reference."""
    import gzip

    r = lwm_train_here(tmp_path, *REFERENCE, "train.profile_start=4", "train.profile_steps=3")
    assert r.returncode == 0, r.stderr
    assert f"profile of steps 4-6 in {tmp_path / 'profile'}" in r.stderr
    (trace,) = (tmp_path / "profile").rglob("perfetto_trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    runs = sorted(e["ts"] for e in events if e.get("name") == "PjitFunction(train_step)")
    starts = [t for i, t in enumerate(runs) if i == 0 or t - runs[i - 1] > 1000]  # µs: one each
    assert len(starts) == 3, runs
    assert losses(tmp_path) == reference.losses


def test_metrics_reach_tensorboard_without_importing_torch(tmp_path):
    """`MetricsWriter` writes each scalar into TensorBoard's event file (read back here record
    by record) in a process that never imports PyTorch, though tensorboardX's package would
    (2.4 s of every training command's start); torch stays importable after it."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    code = (
        "import sys\n"
        "from lwm.base.metrics import MetricsWriter\n"
        f"w = MetricsWriter({str(tmp_path)!r})\n"
        "w.write(3, {'loss': 2.5}); w.write(4, {'psnr': 26.0}, split='eval'); w.close()\n"
        "print('torch' in sys.modules)\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('torch'):\n"
        "    import torch; print(bool(torch.ones(1)))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "False", r.stdout
    assert r.stdout.split()[1:] in ([], ["True"]), r.stdout
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    data, scalars = events.read_bytes(), []
    while data:  # TFRecord: length, its CRC, the record, its CRC
        (n,) = struct.unpack("<Q", data[:8])
        event = Event.FromString(data[12 : 12 + n])
        scalars += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
        data = data[16 + n :]
    assert scalars == [(3, "train/loss", 2.5), (4, "eval/psnr", 26.0)]


def test_metrics_come_back_in_one_transfer_and_the_rate_from_the_host_cpu():
    """The loop's two host-side shortcuts give the values they replace: each metric under its
    own name (sorted, cast to float32 on the devices), and the schedule's learning rate."""
    import jax.numpy as jnp

    from lwm.config import TrainConfig
    from lwm.train import on_host_cpu, packed_metrics
    from lwm.train_step import optimizer_from_config

    metrics = {
        "loss": jnp.float32(2.5),
        "text_tokens": jnp.int32(7),
        "grad_norm": jnp.float32(0.25),
    }
    keys, packed = packed_metrics(metrics)
    assert keys == ("grad_norm", "loss", "text_tokens")
    assert dict(zip(keys, np.asarray(packed).tolist(), strict=True)) == {
        "grad_norm": 0.25,
        "loss": 2.5,
        "text_tokens": 7.0,
    }
    _, schedule = optimizer_from_config(TrainConfig(steps=50, warmup_steps=10))
    rate = on_host_cpu(schedule)
    assert [rate(s) for s in (0, 5, 10, 30, 49)] == [float(schedule(s)) for s in (0, 5, 10, 30, 49)]
    assert rate(5) < rate(10) > rate(49)


def test_damaged_latest_checkpoint_falls_back(reference, tmp_path):
    """The newest checkpoint of a finished run (a copy of the reference's), damaged: the rerun
    says it cannot be restored, sets it aside, resumes from the one before it and redoes the
    steps after that exactly as the first time."""
    out = copy_of_reference(reference, tmp_path)
    # Truncate every data file of checkpoint 12.
    damaged = [
        p
        for p in (out / "checkpoints" / "12").rglob("*")
        if p.is_file() and p.stat().st_size > 0 and "state" in p.parts
    ]
    assert damaged
    for p in damaged:
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 2)
    logged = len((out / "metrics.jsonl").read_text().splitlines())
    r = lwm_train_here(out, *REFERENCE)
    assert r.returncode == 0, r.stderr
    assert "checkpoint 12 cannot be restored" in r.stderr
    assert "resumed from checkpoint 9" in r.stderr
    assert any(p.name.startswith("12.damaged") for p in (out / "checkpoints").iterdir())
    lines = (out / "metrics.jsonl").read_text().splitlines()[logged:]
    redone = {json.loads(x)["step"]: json.loads(x)["loss"] for x in lines}
    assert sorted(redone) == [10, 11, 12], redone  # from checkpoint 9, exactly as the first time
    for step, loss in redone.items():
        assert loss == reference.losses[step], (step, loss, reference.losses[step])
    assert sorted(losses(out)) == list(range(1, 13))


def test_a_reader_of_a_run_leaves_its_damaged_checkpoint_alone(reference, tmp_path):
    """Loading a run for inference (`load_run`, as `lwm ask` does) skips a damaged newest
    checkpoint without renaming it: only training, which redoes its steps, sets it aside. The
    reads orbax left running say nothing (each printed a traceback, "RuntimeError: Event loop
    is closed", as an unraisable exception, when the process went on or ended). The run: a
    copy of the reference's."""
    out = copy_of_reference(reference, tmp_path)
    cut = list((out / "checkpoints" / "12" / "state").rglob("d/*"))
    assert cut
    for p in cut:
        with open(p, "r+b") as f:  # the arrays' data files, cut short
            f.truncate(10)
    code = f"from lwm.runs import load_run; load_run({str(out)!r}); import gc; gc.collect()"
    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags())
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stderr
    assert lines[0].startswith("checkpoint 12 cannot be restored")
    assert lines[1] == f"loaded {out} at step 9"
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [6, 9, 12]


def test_a_rerun_with_another_model_is_refused_and_changes_nothing(reference, tmp_path):
    """A run's folder (a copy of the reference's) resumed with other model shapes: one line
    naming the settings, and its checkpoints and config untouched (they used to be set aside
    as damaged, and the run started over on top of them). Bad input to a new folder leaves no
    folder behind."""
    out, mesh = copy_of_reference(reference, tmp_path), "mesh.shape=1,2,2,2"
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    r = lwm_train_here(out, "train.steps=14", "model.intermediate_size=96", mesh)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"lwm train: error: train.output_dir '{out}' holds a run of another model "
        "(model.intermediate_size: 128 there, 96 here); resume it with its own model settings, "
        "or choose another train.output_dir"
    )
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before
    # Another form of optimizer state: refused alike (the checkpoints were taken for damaged,
    # set aside, and the run started again from step 0, exit 0), with its config.yaml or not.
    for other in ("train.optimizer=muon", "train.clip_norm=null"):
        r = lwm_train_here(out, "train.steps=14", other, mesh)
        assert r.returncode == 2 and "whose optimizer state has another form" in r.stderr
        setting = other.split("=")[0]
        assert f"{setting}: " in r.stderr and f"train.init_from=run:{out}" in r.stderr
    (out / "config.yaml").rename(tmp_path / "config.yaml")
    r = lwm_train_here(out, "train.steps=14", "train.optimizer=muon", mesh)
    assert r.returncode == 2 and "holds a state of another form" in r.stderr, r.stderr
    (tmp_path / "config.yaml").rename(out / "config.yaml")
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before
    one_video = tmp_path / "one.jsonl"  # asked about one video: no other to swap in
    turn = {"question": "How many?", "answer": "two", "category": "count"}
    one_video.write_text(json.dumps({"video": "a.mp4", "qa": [turn, turn]}))
    bad_line = tmp_path / "bad_line.jsonl"
    bad_line.write_text(json.dumps({"video": "a.mp4", "qa": [["How many?", "two"]]}))
    no_qa = tmp_path / "no_qa.jsonl"
    no_qa.write_text(json.dumps({"video": "a.mp4", "text": "a caption"}))
    for bad, message in [
        ("eval.manifest=/nowhere.jsonl", "eval.manifest '/nowhere.jsonl' not found"),
        (f"eval.manifest={one_video}", "asks about one video; the video-swap ablation needs two"),
        (f"eval.manifest={no_qa}", f"eval.manifest: manifest '{no_qa}' has no questions"),
        (f"eval.manifest={bad_line}", "line 1: each 'qa' entry needs string 'question'"),
        (f"train.init_from=foo:{out}", f"'foo:{out}': unknown format 'foo:'"),
        ("data.source=/nowhere", "'/nowhere' is not a token dataset"),
    ]:
        r = lwm_train_here(tmp_path / "new", "train.steps=2", mesh, bad, "eval.vqgan=/vq")
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "new").exists(), bad


def test_a_muon_run_resumes_to_the_same_losses(tmp_path):
    """Muon's state (its momentum on the blocks' matrices, AdamW's moments on the rest, each
    masked to its share) goes through the checkpoint: steps 4-6 redone from checkpoint 3 equal
    the first run's."""
    import shutil

    args = ["train.steps=6", "train.save_every=3", "mesh.shape=1,2,2,2", "train.optimizer=muon"]
    assert lwm_train_here(tmp_path, *args).returncode == 0
    first = losses(tmp_path)
    assert first[6] < first[1], first
    shutil.rmtree(tmp_path / "checkpoints" / "6")
    r = lwm_train_here(tmp_path, *args)
    assert r.returncode == 0, r.stderr
    assert "resumed from checkpoint 3" in r.stderr
    got = losses(tmp_path)
    for step in (4, 5, 6):
        assert got[step] == first[step], (step, got[step], first[step])


def test_a_resume_with_other_settings_says_so_and_keeps_the_old_config(reference, tmp_path):
    """Settings that may change on a resume are named, with where a new train.steps moves a
    decaying learning rate (it jumped back up, without a word, when a finished cosine run was
    extended), and the config the earlier steps ran with is kept beside the new one. The run:
    a copy of the reference's (12 steps, cosine schedule); the resumes have the settings of
    `test_step_time_is_the_mean_of_the_steps_each_logged_window_holds` (one train step
    compiled for both)."""
    out = copy_of_reference(reference, tmp_path)
    args = ["mesh.shape=1,2,2,2", "train.schedule=cosine"]
    old_config = (out / "config.yaml").read_text()
    first = {
        json.loads(x)["step"]: json.loads(x)
        for x in (out / "metrics.jsonl").read_text().splitlines()
    }
    resume = ("train.steps=14", "train.learning_rate=2e-3")
    r = lwm_train_here(out, *resume, "train.save_every=3", *args)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if "resuming with other settings" in x]
    assert lines == [
        "lwm train: resuming with other settings than the run's: train.steps: 12 there, 14 "
        "here; train.learning_rate: 0.003 there, 0.002 here (its config until step 12 kept as "
        "config.until-12.yaml)"
    ]
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    step13 = next(x for x in logged if x["step"] == 13)["learning_rate"]
    step12 = first[12]["learning_rate"]
    assert step13 != step12  # the cosine over 14 steps, from 2e-3
    assert (
        f"lwm train: train.steps 12 -> 14 spreads the cosine schedule over the new steps: the "
        f"learning rate of step 13 is {step13:.3g} (step 12 had {step12:.3g})"
    ) in r.stderr.splitlines()
    assert (out / "config.until-12.yaml").read_text() == old_config
    assert "learning_rate: 0.002" in (out / "config.yaml").read_text()
    # Steps 13-14 lost (their checkpoint gone, as after a kill -9 or a damaged save): the next
    # resume, with another setting again (one its train step does not depend on), starts at
    # step 12 again, and config.until-12.yaml still holds the settings steps 1-12 ran with,
    # not those of the run whose steps were lost (it overwrote them).
    shutil.rmtree(out / "checkpoints" / "14")
    r = lwm_train_here(out, *resume, "train.save_every=2", *args)
    assert r.returncode == 0, r.stderr
    assert "resumed from checkpoint 12" in r.stderr
    assert "train.save_every: 3 there, 2 here" in r.stderr
    assert (out / "config.until-12.yaml").read_text() == old_config
    assert "save_every: 2" in (out / "config.yaml").read_text()


def test_non_finite_loss_stops_naming_the_step(tmp_path):
    """The first step whose loss is NaN is named, and no checkpoint of it or after it is
    written, whether metrics are fetched after every step or five at a time (logged every 4)."""
    bad = {}
    for fetch in ("train.fetch_every=1", "train.fetch_every=5"):
        out = tmp_path / fetch
        r = lwm_train_here(
            out,
            "train.steps=8",
            "train.save_every=2",
            "mesh.shape=1,2,2,2",
            "train.learning_rate=1e30",
            "train.clip_norm=null",
            fetch,
            *(["train.log_every=4"] if fetch.endswith("5") else []),
        )
        assert r.returncode == 1
        line = r.stderr.strip().splitlines()[-1]
        assert line.startswith("lwm train: error: loss is nan at step"), line
        assert "Traceback" not in r.stderr
        bad[fetch] = int(line.split("at step ")[1].split(";")[0])
        kept = out / "checkpoints"
        saved = [int(p.name) for p in kept.iterdir() if p.name.isdigit()] if kept.exists() else []
        assert all(s < bad[fetch] for s in saved), (fetch, saved)
    assert len(set(bad.values())) == 1, bad


def test_sigterm_saves_then_resumes(reference, tmp_path):
    """SIGTERM mid-run saves the step it finished and exits 143; the rerun resumes from that
    checkpoint and every loss equals the uninterrupted run's."""
    args = ("train.steps=12", "train.save_every=100", "mesh.shape=1,2,2,2")
    proc = lwm_train(tmp_path, *args, wait=False)
    _wait_for_step(tmp_path, 4, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "SIGTERM at step" in err
    stopped = int(err.split("SIGTERM at step ")[1].split(":")[0])
    assert 4 <= stopped < 12
    # the step it finished is saved (save_every=100 saves nothing else), and the rerun
    # resumes from it: a rerun from step 0 logs the same losses
    saved = [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    assert saved == [str(stopped)], saved
    r = lwm_train_here(tmp_path, *args)  # the rerun: in this process
    assert r.returncode == 0, r.stderr
    assert f"resumed from checkpoint {stopped}" in r.stderr, r.stderr
    got = losses(tmp_path)
    assert all(got[s] == reference.losses[s] for s in range(1, 13))


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    common = ("train.steps=3", "mesh.shape=1,2,2,2", "train.batch_size=4")
    assert lwm_train_here(one, *common).returncode == 0
    r = lwm_train_here(two, *common, "train.grad_accum=2")
    assert r.returncode == 0, r.stderr
    a, b = losses(one), losses(two)
    for step in (1, 2, 3):
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])


def test_next_context_stage_starts_from_previous_run(reference, tmp_path):
    """Stage 1: the reference run (12 steps of seq_len 64 on mesh 1,2,2,2); stage 2, twice as
    long a context, sequence-parallel over the 8 devices, starts from its weights."""
    stage1, stage2 = reference.out, tmp_path / "s2"
    r = lwm_train_here(
        stage2,
        "train.steps=2",
        "mesh.shape=1,1,8,1",
        "train.seq_len=128",
        "model.max_seq_len=128",
        "model.rope_theta=100000.0",
        f"train.init_from=run:{stage1}",
    )
    assert r.returncode == 0, r.stderr
    assert f"initialising from run:{stage1}" in r.stderr
    # Stage 2 starts from the trained weights: its first loss is below a fresh model's (stage
    # 1's first step, on the same synthetic token distribution).
    assert losses(stage2)[1] < reference.losses[1] - 0.25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one(reference, tmp_path):
    """Two processes with 4 simulated CPU devices each, joined by jax.distributed."""
    port = _free_port()
    args = (
        "train.steps=12",
        "train.save_every=6",
        "mesh.shape=1,2,2,2",
        f"distributed.coordinator_address=127.0.0.1:{port}",
        "distributed.num_processes=2",
    )
    procs = [
        lwm_train(tmp_path, *args, f"distributed.process_id={i}", devices=4, wait=False)
        for i in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert got[step] == pytest.approx(reference.losses[step], rel=1e-6), step
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_codebook_init_puts_codes_that_look_alike_close(tmp_path):
    """train.vision_embed_init=codebook: the rows of the VQGAN's codes are a linear image of
    its codebook (rank = the code dimension), at the scale of a random initialisation, with
    distances that follow the codebook's; every other parameter is the random initialisation."""
    from flax import nnx
    from tokenize_helpers import save_tiny_vqgan

    import vqgan
    from lwm.base.mesh import make_mesh
    from lwm.config import load_config
    from lwm.train import _initial_params

    vq = save_tiny_vqgan(tmp_path / "vq")
    cfg = load_config(ROOT / "configs/debug.yaml", ["train.vision_embed_init=codebook"])
    random_cfg = load_config(ROOT / "configs/debug.yaml")
    mesh = make_mesh("1,2,2,2")
    logged = []
    params = _initial_params(cfg, cfg.model, mesh, logged.append, {"vqgan": {"path": str(vq)}})
    fresh = _initial_params(random_cfg, random_cfg.model, mesh, print)
    codebook = np.asarray(vqgan.load_model(vq).quantizer.embeddings[...], np.float64)
    k, dim = codebook.shape
    table = np.asarray(params["embed_vision"][...], np.float64)
    rows = table[:k]
    np.testing.assert_array_equal(table[k:], np.asarray(fresh["embed_vision"][...])[k:])
    # a linear image of the codebook: least squares from [codebook, 1] leaves nothing
    basis = np.concatenate([codebook, np.ones((k, 1))], axis=1)
    fit = basis @ np.linalg.lstsq(basis, rows, rcond=None)[0]
    assert np.abs(rows - fit).max() < 1e-5 * np.abs(rows).max()
    assert np.linalg.matrix_rank(rows, tol=1e-6 * np.abs(rows).max()) == dim
    assert 0.5 < rows.std() / cfg.model.initializer_range < 2.0
    # codes close in the codebook are close in the table
    i, j = np.triu_indices(k, 1)
    standard = (codebook - codebook.mean(0)) / codebook.std(0)
    near = np.linalg.norm(standard[i] - standard[j], axis=1)
    embedded = np.linalg.norm(rows[i] - rows[j], axis=1)
    assert np.corrcoef(near, embedded)[0, 1] > 0.8
    before = dict(nnx.to_flat_state(fresh))
    others = [
        np.array_equal(np.asarray(x[...]), np.asarray(before[path][...]))
        for path, x in nnx.to_flat_state(params)
        if path != ("embed_vision",)
    ]
    assert len(others) > 5 and all(others)
    assert f"from the codebook of {vq}" in logged[0]
    # the dataset records its VQGAN's weights: the same ones are taken, others refused
    from lwm.train import TrainingInputError
    from vqgan.tokenizer import VideoTokenizer

    meta = {"path": str(vq), "weights": VideoTokenizer(vqgan.load_model(vq)).fingerprint}
    again = _initial_params(cfg, cfg.model, mesh, print, {"vqgan": meta})
    np.testing.assert_array_equal(again["embed_vision"][...], params["embed_vision"][...])
    with pytest.raises(TrainingInputError, match="has other weights than the dataset was"):
        _initial_params(cfg, cfg.model, mesh, print, {"vqgan": meta | {"weights": "0" * 16}})


ONE_STEP = ("train.steps=1", "mesh.shape=1,2,2,2")


def test_codebook_init_needs_a_dataset_with_a_vqgan_and_a_fresh_model(reference, tmp_path):
    r = lwm_train_here(tmp_path / "a", *ONE_STEP, "train.vision_embed_init=codebook")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "train.vision_embed_init=codebook needs a dataset tokenized with a VQGAN" in line
    assert "data.source 'synthetic' names none" in line
    # A run initialised from another (the reference run; with its steps and mesh: its train
    # step is compiled) keeps that run's embeddings (a context stage of the demo).
    r = lwm_train_here(
        tmp_path / "c",
        "train.steps=12",
        "mesh.shape=1,2,2,2",
        "train.vision_embed_init=codebook",
        f"train.init_from=run:{reference.out}",
    )
    assert r.returncode == 0, r.stderr
    assert "train.vision_embed_init=codebook does not apply: train.init_from" in r.stderr


@pytest.mark.parametrize(
    ("xla_text", "sizes"),
    [
        (  # the TPU compiler's refusal of a program too large for the chip
            "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
            "space hbm. Used 21.61G of 15.75G hbm. Exceeded hbm capacity by 5.86G.\n\n"
            "Total hbm usage >= 22.11G:\n    reserved        530.00M\n    program          21.6G",
            "Used 21.61G of 15.75G hbm. Exceeded hbm capacity by 5.86G.",
        ),
        (  # an allocation at run time
            "RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 7.10G. "
            "That was not possible. There are 6.61G free.; (0x0x0_HBM0)",
            "Attempting to allocate 7.10G. That was not possible. There are 6.61G free.",
        ),
    ],
)
def test_a_step_too_large_for_the_devices_is_one_line_naming_the_sizes(xla_text, sizes):
    from lwm.train import out_of_memory

    message = out_of_memory(RuntimeError(xla_text), 1, 131072)
    assert message is not None and "\n" not in message
    assert message.startswith("the train step of 1 x 131072 tokens does not fit")
    assert sizes in message and "train.seq_len" in message
    assert out_of_memory(RuntimeError("INVALID_ARGUMENT: shapes differ"), 1, 8) is None


def test_batch_prefetch_keeps_order_and_hands_errors_to_the_step_that_needed_them():
    import threading

    from lwm.train import BatchPrefetch

    made = []

    def make(step):
        if step == 5:
            raise ValueError("step 5's batch is broken")
        made.append(step)
        return step * 10

    batches = BatchPrefetch(make, range(1, 9), depth=2)
    got = []
    for _ in range(4):
        got.append(batches.get())
        batches.taken()
    assert got == [10, 20, 30, 40]
    with pytest.raises(ValueError, match="step 5's batch is broken"):
        batches.get()
    batches.close()
    assert made == [1, 2, 3, 4]

    # a loop that stops early (SIGTERM) leaves no thread behind, however far ahead it was
    started = threading.active_count()
    batches = BatchPrefetch(lambda step: step, range(10**6), depth=3)
    assert batches.get() == 0
    batches.taken()
    batches.close()
    assert threading.active_count() == started
