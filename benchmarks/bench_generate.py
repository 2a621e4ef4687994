"""Generation speed against context length and the number of `sp` devices: chunked prefill
(`lwm.generate.prefill_chunked`, as `lwm chat` feeds a long video) and decoding (one token at a
time against the cache, `lwm.generate.decode_step`), with the planned temporary memory per
device of the prefill, on simulated CPU devices.

    python benchmarks/bench_generate.py                                  # tiny model, see --help
    python benchmarks/bench_generate.py --lengths 4096 --sp 1,2,4,8      # decode flat in sp?

Each (sp, length) compiles its own programs (not timed); one timed prefill of ``length`` random
tokens in chunks of ``--chunk`` into a cache of ``length + --decode`` slots, then ``--decode``
timed decode steps. One JSON line per measurement. ``--plan-only``: compile the prefill and
report its temporary memory and the cache per device without running it (what a context
needs, at lengths too long to prefill on this machine in reasonable time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lwm.base.mesh import make_mesh  # noqa: E402
from lwm.config import load_config  # noqa: E402
from lwm.generate import decode_step, prefill_chunked  # noqa: E402
from lwm.model import create_model  # noqa: E402
from lwm.scripting import add_platform_argument, start_platform  # noqa: E402


def bench(cfg, sp: int, length: int, chunk: int, steps: int, plan_only: bool = False) -> dict:
    mesh = make_mesh(f"1,1,{sp},1", devices=jax.devices()[:sp]) if sp > 1 else None
    model_cfg = cfg.model_copy(
        update={"attention": "ring" if sp > 1 else "blockwise", "max_seq_len": length + steps}
    )
    model = create_model(model_cfg, mesh=mesh)
    graphdef, state = nnx.split(model)
    max_len = -(-(length + steps) // max(sp, 1)) * max(sp, 1)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, model_cfg.text_vocab_size, (1, length)), jnp.int32)
    vision = jnp.zeros((1, length), bool)
    lens = jnp.asarray([length], jnp.int32)

    def run_prefill(state, tokens, vision, lens):
        m = nnx.merge(graphdef, state)
        return prefill_chunked(m, tokens, vision, lens, max_len, chunk)

    def run_decode(state, cache, start):
        m = nnx.merge(graphdef, state)

        def body(i, carry):
            cache, token = carry
            cache, hidden = decode_step(m, cache, token, jnp.zeros((1,), bool), start + i)
            return cache, jnp.argmax(m.logits(hidden[:, None])[0][:, 0], -1).astype(jnp.int32)

        return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros((1,), jnp.int32)))

    t0 = time.perf_counter()
    prefill = jax.jit(run_prefill).lower(state, tokens, vision, lens).compile()
    compile_s = time.perf_counter() - t0
    temp = prefill.memory_analysis().temp_size_in_bytes
    layer = model_cfg.num_kv_heads * model_cfg.head_dim * jnp.dtype(model_cfg.dtype).itemsize
    cache_bytes = 2 * model_cfg.num_layers * max_len * layer // max(sp, 1)
    planned = {
        "bench": "generate",
        "sp": sp,
        "context": length,
        "chunk": chunk,
        "prefill_temp_bytes_per_device": temp,
        "cache_bytes_per_device": int(cache_bytes),
        "compile_s": round(compile_s, 1),
    }
    if plan_only:  # compiled, not run: what the context needs per device
        return {**planned, "planned_only": True}
    t0 = time.perf_counter()
    cache, _ = jax.block_until_ready(prefill(state, tokens, vision, lens))
    prefill_s = time.perf_counter() - t0
    start = jnp.asarray([length], jnp.int32)
    decode = jax.jit(run_decode).lower(state, cache, start).compile()
    t0 = time.perf_counter()
    jax.block_until_ready(decode(state, cache, start))
    decode_s = time.perf_counter() - t0
    return {
        **planned,
        "prefill_s": round(prefill_s, 3),
        "prefill_tokens_per_s": round(length / prefill_s, 1),
        "decode_ms_per_token": round(1e3 * decode_s / steps, 2),
    }


def positive_ints(flag: str, text: str) -> list[int]:
    """The comma-separated positive integers of option ``flag`` (ValueError: one line)."""
    try:
        values = [int(n) for n in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} '{text}': expected comma-separated integers") from None
    if min(values) < 1:
        raise ValueError(f"{flag} '{text}': every value must be at least 1")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config", default="configs/tiny.yaml", help="model config (default configs/tiny.yaml)"
    )
    p.add_argument(
        "--lengths",
        default="1024,4096,16384",
        help="comma-separated context lengths in tokens (default 1024,4096,16384)",
    )
    p.add_argument("--sp", default="1,4", help="sp device counts (each length runs on each)")
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk in tokens (default 1024)")
    p.add_argument("--decode", type=int, default=32, help="decode steps timed")
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="compile the prefill and report its memory per device, without running it",
    )
    add_platform_argument(p, cpu_devices=8)
    args = p.parse_args(argv)
    # all input checked before JAX starts (bad input costs no start-up)
    cfg = load_config(args.config).model
    sps, lengths = positive_ints("--sp", args.sp), positive_ints("--lengths", args.lengths)
    for flag, value in (("--chunk", args.chunk), ("--decode", args.decode)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, not {value}")
    platform = start_platform(args)  # before anything asks JAX for devices
    for sp in sps:
        for length in lengths:
            chunk = min(args.chunk, length)  # a context shorter than a chunk is one chunk
            result = bench(cfg, sp, length, chunk, args.decode, args.plan_only)
            print(json.dumps({**result, "platform": platform}), flush=True)
    return 0


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("bench_generate", main, also=(ValueError,)))
