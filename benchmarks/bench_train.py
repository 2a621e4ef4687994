"""Training-step throughput: tokens/s and MFU of the full training step (forward, backward,
AdamW) for two model sizes and two sequence lengths, ring attention against dense attention,
side by side in one process on 8 simulated CPU devices, or on the TPU chips or NVIDIA GPUs
JAX sees.

    python benchmarks/bench_train.py                       # defaults below
    python benchmarks/bench_train.py --sizes tiny --seqs 2048 --repeats 5
    # one GPU: LWM-7B's width with 4 layers (1.14B parameters), bf16 compute, fp32 parameters,
    # blockwise attention with the XLA and the cuDNN block kernel side by side
    python benchmarks/bench_train.py --platform gpu --sizes 7b-4l --seqs 8192,32768 \
        --attention blockwise --kernels xla,cudnn --one-document
    # one TPU v5e chip: the 570M model, Pallas attention, 8K and 32K tokens
    python benchmarks/bench_train.py --platform tpu --sizes 570m --seqs 8192,32768 \
        --attention blockwise --kernels pallas --one-document --set model.logits_chunk_size=8192
    python benchmarks/bench_train.py --sizes small --seqs 1024 --attention ring --batch 8 \
        --dataset runs/demo/tokens --repeats 20     # batches read from a token dataset
    # long context on one GPU: the MLP and the loss computed 8K tokens at a time
    python benchmarks/bench_train.py --platform gpu --sizes 7b-4l --seqs 262144 \
        --attention blockwise --kernels cudnn --one-document \
        --set model.mlp_chunk_size=8192 --set model.logits_chunk_size=8192
    # packed rows (a conditional per piece and layer) with XLA's command buffers taking them
    python benchmarks/bench_train.py --platform gpu --sizes 7b-4l --seqs 8192 \
        --attention blockwise --kernels cudnn --compiler-options \
        '{"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"}'

With ``--dataset`` (an `lwm tokenize` dataset) every timed step takes a new batch from the
training loader (`data.loader.TokenDatasetLoader`, ``--read-threads`` grain threads; 0: no
grain), as `lwm train` does, and the line adds the time each step waited for it.

One JSON line per measurement on stdout, then one ratio line (ring over dense) per
(size, seq). Two MFUs, named: ``mfu`` = model FLOPs (lwm.info.flops_per_token: 6N + 12*L*H*S
per token, attention counted in full as in PaLM) x tokens/s over the matmul FLOP/s measured on
all devices at once in the same run, in the model's compute dtype; ``mfu_causal_of_spec`` =
6N + 6*L*H*S (causal attention halved, MaxText's convention) over the chip's specified peak
(`lwm.info.SPEC_PEAK_BF16`; only for chips listed there).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import typing
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from data.batches import SyntheticTokenLoader
from lwm.base.mesh import PLATFORMS, MeshError, make_mesh, use_platform
from lwm.config import ConfigError, ModelConfig, load_config
from lwm.info import (
    flops_per_token,
    measure_peak_flops,
    mfu_of_spec,
    param_counts,
    spec_peak_flops,
)
from lwm.model import (
    ROW_ORDERS,
    create_model,
    round_reach,
    row_permutation,
    row_schedule,
    sequence_layout,
)
from lwm.scripting import check_choices, failed_status
from lwm.train_step import (
    abstract_train_state,
    batch_sharding,
    jit_train_step,
    make_optimizer,
    row_orders,
)

ATTENTIONS = typing.get_args(ModelConfig.model_fields["attention"].annotation)
KERNELS = typing.get_args(ModelConfig.model_fields["attention_kernel"].annotation)

SIZES = {
    # name: (config, overrides)
    "small": (
        "configs/debug.yaml",
        {
            "hidden_size": 128,
            "intermediate_size": 344,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
        },
    ),
    "tiny": ("configs/tiny.yaml", {}),
    # LWM-7B's width (32 heads of 128, MLP 11008) with 4 layers: 1.14B parameters
    "7b-4l": ("configs/7b.yaml", {"num_layers": 4}),
    "7b-1l": ("configs/7b.yaml", {"num_layers": 1}),
    # what fits one 16 GiB TPU v5e chip with fp32 parameters and AdamW: hidden 2048, 8 layers,
    # 16 heads of 128, MLP 5504 (570M parameters)
    "570m": (
        "configs/7b.yaml",
        {
            "hidden_size": 2048,
            "intermediate_size": 5504,
            "num_layers": 8,
            "num_heads": 16,
            "num_kv_heads": 16,
        },
    ),
}


def bench_one(
    size: str,
    seq: int,
    attention: str,
    mesh,
    batch: int,
    repeats: int,
    peak: float,
    dataset: str | None = None,
    read_threads: int = 2,
    kernel: str = "xla",
    remat: str = "nothing_saveable",
    one_document: bool = False,
    settings: tuple[str, ...] = (),
    compiler_options: dict | None = None,
    rows: str = "auto",
    block: int = 512,
    profile: str | None = None,
):
    """One JSON record. ``rows``: the order of rows the step is compiled for
    (`lwm.model.ROW_ORDERS`), ``auto`` for each batch's own (`row_order`, as one process of
    `lwm train` chooses), or ``device`` for the step that checks on the device (as many
    processes run it, for the reach of the loader's plan). ``block``: the attention's query and
    key blocks; ``profile``: a folder to write a JAX profiler trace of one more step into."""
    path, overrides = SIZES[size]
    full = load_config(path, settings)
    cfg = full.model.model_copy(
        update={
            **overrides,
            "attention": attention,
            "attention_kernel": kernel,
            "max_seq_len": seq,
            "block_q": block,
            "block_k": block,
            "remat_policy": remat,
        }
    )
    model = create_model(cfg, mesh=mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    tx, _ = make_optimizer(1e-4)
    _, abs_params, abs_opt = abstract_train_state(
        cfg, mesh, tx, offload_optimizer=full.train.offload_optimizer
    )
    opt_shardings = jax.tree.map(lambda x: x.sharding, abs_opt)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    sp = mesh.shape["sp"]
    layout = row_permutation(cfg, seq, sp)  # the order the model's attention assumes
    if dataset:
        from data.loader import TokenDatasetLoader

        loader = TokenDatasetLoader(
            dataset, batch_size=batch, seq_len=seq, layout=layout, read_threads=read_threads
        )
    else:
        loader = SyntheticTokenLoader(
            batch_size=batch, seq_len=seq, text_vocab_size=cfg.text_vocab_size, layout=layout
        )
    sharding = batch_sharding(mesh)

    def next_batch():
        local = next(loader)
        if one_document:  # one document per row, as long-context training has
            order = np.arange(seq) if layout is None else np.asarray(layout)
            local["segment_ids"] = np.ones_like(local["segment_ids"])
            local["positions"] = np.broadcast_to(order, local["positions"].shape).astype(np.int32)
        return {
            k: jax.make_array_from_process_local_data(sharding, v, (batch, seq))
            for k, v in local.items()
        }

    orders = row_orders(cfg, mesh)
    order_layout = sequence_layout(cfg, sp)
    compiled_for: dict = {}

    def step_for(data):
        """The compiled step for ``data``'s rows; the seconds spent compiling it now."""
        order, reach = {"auto": None, "device": None}.get(rows, rows), 0
        if rows == "device" and "in_order" in orders:  # the loader's plan's, as lwm train's
            reach = round_reach(loader.last_look_back())
        if rows == "auto":
            host = {k: np.asarray(data[k]) for k in ("positions", "segment_ids")}
            order, reach = row_schedule(
                host["positions"], host["segment_ids"], order_layout, sp, orders
            )
        name = order or "device"  # None: checked on the device
        key = f"{name}@{reach}" if reach else name
        if key in compiled_for:
            return compiled_for[key], key, 0.0
        t0 = time.perf_counter()
        step = jit_train_step(graphdef, tx, mesh, abs_params, abs_opt, rows=order, reach=reach)
        lowered = step.lower(abs_params, abs_opt, data)  # the state's buffers may be donated
        compiled_for[key] = lowered.compile(compiler_options)
        return compiled_for[key], key, time.perf_counter() - t0

    data = next_batch()
    compiled, first_order, compile_s = step_for(data)
    temp = compiled.memory_analysis().temp_size_in_bytes
    params, opt_state, m = compiled(params, opt_state, data)  # warm-up
    jax.block_until_ready(m)
    times, waits, taken = [], [], [first_order]
    if dataset:  # as lwm train: read the next batch while the previous step runs
        t0 = time.perf_counter()
        compiling = 0.0  # a batch of another order compiles its own step: not timed
        for _ in range(repeats):
            t = time.perf_counter()
            data = next_batch()
            waits.append(time.perf_counter() - t)
            compiled, order, c = step_for(data)
            compiling += c
            taken.append(order)
            params, opt_state, m_next = compiled(params, opt_state, data)
            jax.block_until_ready(m)  # the previous step
            m = m_next
        jax.block_until_ready(m)
        times = [(time.perf_counter() - t0 - compiling) / repeats]
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            params, opt_state, m = compiled(params, opt_state, data)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t0)
    if profile:  # one more step, traced (TensorBoard's or XProf's profile tools read it)
        with jax.profiler.trace(profile):
            params, opt_state, m = compiled(params, opt_state, data)
            jax.block_until_ready(m)
    dt = statistics.median(times)
    # the rows' order each timed batch ran for (None: checked on the device; ORDER@N: in order,
    # no query looking back more than N tokens)
    extra = {"rows": rows, "row_orders": {o: taken.count(o) for o in dict.fromkeys(taken)}}
    if "one_document" in m:  # checked on the device: 1 when it took the known-order schedule
        extra["one_document_schedule"] = float(m["one_document"])
    if dataset:
        wait = statistics.mean(waits)
        extra |= {
            "dataset": dataset,
            "read_threads": read_threads,
            "data_wait_s": round(wait, 5),
            "data_wait_share": round(wait / dt, 4),
        }
    tokens = batch * seq
    per_token = flops_per_token(cfg, seq)
    flops = per_token.train * tokens
    # MaxText's convention: causal attention, the chip's specified peak
    spec_mfu = mfu_of_spec(per_token.train_causal * tokens, dt, mesh.devices.flat)
    if spec_mfu is not None:
        extra["mfu_causal_of_spec"] = round(spec_mfu, 4)
        extra["spec_peak_flops_per_device"] = spec_peak_flops(mesh.devices.flat[0].device_kind)
    return {
        "bench": "train_step",
        "size": size,
        "params": param_counts(cfg).total,
        "attention": attention,
        "kernel": kernel,
        "documents": "one per row" if one_document else "packed",
        **({"settings": list(settings)} if settings else {}),
        **({"compiler_options": compiler_options} if compiler_options else {}),
        "dtype": cfg.dtype,
        "remat": remat,
        "block": block,
        "seq": seq,
        "batch": batch,
        "mesh": dict(mesh.shape),
        "step_s": round(dt, 4),
        "compile_s": round(compile_s, 1),
        "tokens_per_s": round(tokens / dt, 1),
        # attention counted in full (PaLM's convention), against the matmul rate measured here
        "mfu": round(flops / dt / peak, 4),
        "temp_bytes_per_device": temp,
        # what the device held at most so far in this process (GPUs; None on CPUs): with the
        # lengths in rising order, the longest's own peak, parameters and AdamW state included
        "peak_bytes_in_use": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
        "loss": float(m["loss"]),
        **extra,
    }


def profile_dir(root: str | None, size: str, seq: int, kernel: str, remat: str, block: int):
    """Where ``--profile`` writes one measurement's trace (None without ``--profile``)."""
    return None if root is None else str(Path(root) / f"{size}-{seq}-{kernel}-{remat}-{block}")


def cpu_devices_for(mesh: str) -> int:
    """How many simulated CPU devices ``--mesh`` asks for: the product of its sizes (8 where one
    is -1 or the text is no mesh; `make_mesh` then names the problem)."""
    try:
        sizes = [int(s) for s in mesh.split(",")]
    except ValueError:
        return 8
    return math.prod(sizes) if sizes and min(sizes) > 0 else 8


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes", default="small,tiny", help=f"model sizes, comma-separated: {', '.join(SIZES)}"
    )
    p.add_argument("--seqs", default="1024,4096", help="sequence lengths, comma-separated")
    p.add_argument(
        "--attention",
        default="ring,dense",
        help=f"model.attention values, comma-separated: {', '.join(ATTENTIONS)}",
    )
    p.add_argument(
        "--mesh",
        default="1,1,8,1",
        help="dp,fsdp,sp,tp (on an accelerator the default is 1,1,<devices>,1; on a CPU that many "
        "simulated devices)",
    )
    p.add_argument("--batch", type=int, default=1, help="rows per step")
    p.add_argument("--repeats", type=int, default=3, help="timed steps (the median is reported)")
    p.add_argument("--dataset", help="read every step's batch from this token dataset")
    p.add_argument("--read-threads", type=int, default=2, help="grain threads (0: no grain)")
    p.add_argument(
        "--platform",
        choices=PLATFORMS,
        default="cpu",
        help="cpu: simulated CPU devices (default); tpu: the TPU chips JAX sees; gpu: the "
        "NVIDIA GPUs; auto: what JAX picks",
    )
    p.add_argument(
        "--kernels",
        default="xla",
        help=f"attention block kernels, comma-separated: {', '.join(KERNELS)}",
    )
    p.add_argument(
        "--remat",
        default="nothing_saveable",
        help="model.remat_policy, comma-separated to time several (e.g. "
        "nothing_saveable,dots_with_no_batch_dims_saveable)",
    )
    p.add_argument(
        "--block", type=int, default=512, help="attention block_q = block_k (default 512)"
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="trace one more step of each measurement with JAX's profiler into DIR/<size>-<seq>-"
        "<kernel>-<remat>-<block> (read it with TensorBoard's or XProf's profile tools)",
    )
    p.add_argument("--cudnn-piece", type=int, help="lwm.attention.cudnn.pairs.PIECE (default 4096)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every size, e.g. model.mlp_chunk_size=8192 (repeatable)",
    )
    p.add_argument(
        "--compiler-options",
        type=json.loads,
        help="XLA options for compiling the step, as JSON (e.g. XLA's command buffers taking "
        "conditionals too, as benchmarks/profile_attention.py measures them)",
    )
    p.add_argument(
        "--one-document",
        action="store_true",
        help="one document per row (the FLOP count's full causal attention) instead of the "
        "synthetic loader's short packed documents",
    )
    p.add_argument(
        "--rows",
        default="auto",
        help="the order of rows the step is compiled for, comma-separated to time several: "
        "auto (each batch's own and, in order, how far back its queries look, as lwm train "
        "chooses), device (checked on the device, as with many processes) or one of "
        f"{', '.join(ROW_ORDERS)}",
    )
    args = p.parse_args()
    check_choices(
        ("--rows", args.rows, ("auto", "device", *ROW_ORDERS)),
        ("--attention", args.attention, ATTENTIONS),
        ("--kernels", args.kernels, KERNELS),
    )
    if min(args.batch, args.repeats) < 1:
        print("bench_train: error: --batch and --repeats must be at least 1", file=sys.stderr)
        return 2
    try:
        # before anything asks JAX for its devices; on a CPU, as many as the mesh has
        platform = use_platform(args.platform, cpu_devices=cpu_devices_for(args.mesh))
        if platform != "cpu" and args.mesh == "1,1,8,1":
            args.mesh = f"1,1,{jax.device_count()},1"
        mesh = make_mesh(args.mesh)
    except MeshError as e:
        print(f"bench_train: error: {e}", file=sys.stderr)
        return 2
    if args.cudnn_piece:
        import lwm.attention.cudnn.pairs

        lwm.attention.cudnn.pairs.PIECE = args.cudnn_piece
    if unknown := [s for s in args.sizes.split(",") if s not in SIZES]:
        print(f"bench_train: error: unknown size {unknown[0]!r}; sizes: {', '.join(SIZES)}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        dtypes = {load_config(SIZES[s][0], args.set).model.dtype for s in args.sizes.split(",")}
    except ConfigError as e:
        print(f"bench_train: error: {e}", file=sys.stderr)
        return 2
    peaks = {}
    for dtype in sorted(dtypes):
        peaks[dtype] = measure_peak_flops(jax.devices(), dtype) * jax.device_count()
        line = {
            "bench": "peak_matmul",
            "dtype": dtype,
            "flops_per_s_all_devices": round(peaks[dtype]),
        }
        print(json.dumps(line), flush=True)
    devices = {"devices": [str(d) for d in jax.devices()], "kind": jax.devices()[0].device_kind}
    print(json.dumps({"bench": "devices", **devices}), flush=True)  # kind: which chip
    runs = [
        (a, k, r, remat)
        for a in args.attention.split(",")
        for k in args.kernels.split(",")
        for r in args.rows.split(",")
        for remat in args.remat.split(",")
    ]
    for size in args.sizes.split(","):
        peak = peaks[load_config(SIZES[size][0], args.set).model.dtype]
        for seq in (int(s) for s in args.seqs.split(",")):
            row = {}
            for attention, kernel, rows, remat in runs:
                if attention == "dense" and (kernel, rows, remat) != runs[0][1:]:
                    continue  # dense attention has no block kernel and no schedules
                try:
                    rec = bench_one(
                        size,
                        seq,
                        attention,
                        mesh,
                        args.batch,
                        args.repeats,
                        peak,
                        args.dataset,
                        args.read_threads,
                        kernel,
                        remat,
                        args.one_document,
                        tuple(args.set),
                        args.compiler_options,
                        rows,
                        args.block,
                        profile_dir(args.profile, size, seq, kernel, remat, args.block),
                    )
                except Exception as e:  # e.g. out of memory for dense at long sequences
                    rec = {
                        "bench": "train_step",
                        "size": size,
                        "seq": seq,
                        "attention": attention,
                        "kernel": kernel,
                        "rows": rows,
                        "remat": remat,
                        "status": failed_status(e),
                    }
                row.setdefault(attention, rec)
                print(json.dumps(rec), flush=True)
            if (
                "ring" in row
                and "dense" in row
                and "step_s" in row["ring"]
                and "step_s" in row["dense"]
            ):
                print(
                    json.dumps(
                        {
                            "bench": "train_step_ratio",
                            "size": size,
                            "seq": seq,
                            "ring_speedup_vs_dense": round(
                                row["dense"]["step_s"] / row["ring"]["step_s"], 3
                            ),
                            "ring_temp_vs_dense": round(
                                row["ring"]["temp_bytes_per_device"]
                                / row["dense"]["temp_bytes_per_device"],
                                3,
                            ),
                        }
                    ),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("bench_train", main, also=(ValueError,)))
