"""Token layouts over the ring, and the work each device does per ring step.

With causal attention and the contiguous layout, device ``i`` only has work for chunks from
devices ``j <= i``: the last device works at every step while the first idles. The zigzag
layout splits the sequence into ``2 * num_shards`` chunks and gives device ``i`` chunks ``i``
and ``2 * num_shards - 1 - i``, so every device has the same number of live blocks at every
step. Striped gives device ``i`` tokens ``i, i + n, i + 2n, ...``: balanced too, but no block
pair is ever fully masked, so it computes about twice the blocks zigzag does.

A layout is a permutation ``perm`` of ``range(seq_len)``: the permuted sequence is
``x[:, perm]`` and its positions are ``perm`` itself. Apply it once at the model input (tokens,
positions, segment ids, targets) and invert it on the outputs with `inverse_permutation`.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from lwm.attention._common import block_is_live

Layout = Literal["contiguous", "zigzag", "striped"]


def zigzag_permutation(seq_len: int, num_shards: int) -> np.ndarray:
    """Device ``i`` holds chunks ``i`` and ``2n-1-i`` of ``2n`` equal chunks."""
    if num_shards <= 0 or seq_len % (2 * num_shards):
        raise ValueError(
            f"zigzag layout needs seq_len ({seq_len}) divisible by 2 x num_shards ({2 * num_shards})"
        )
    chunks = np.arange(seq_len).reshape(2 * num_shards, seq_len // (2 * num_shards))
    order = [c for i in range(num_shards) for c in (i, 2 * num_shards - 1 - i)]
    return chunks[order].reshape(-1)


def striped_permutation(seq_len: int, num_shards: int) -> np.ndarray:
    """Device ``i`` holds tokens ``i, i + n, i + 2n, ...``."""
    if num_shards <= 0 or seq_len % num_shards:
        raise ValueError(
            f"striped layout needs seq_len ({seq_len}) divisible by num_shards ({num_shards})"
        )
    return np.arange(seq_len).reshape(seq_len // num_shards, num_shards).T.reshape(-1)


def layout_permutation(layout: Layout, seq_len: int, num_shards: int) -> np.ndarray:
    if layout == "contiguous":
        return np.arange(seq_len)
    if layout == "zigzag":
        return zigzag_permutation(seq_len, num_shards)
    if layout == "striped":
        return striped_permutation(seq_len, num_shards)
    raise ValueError(f"unknown layout '{layout}'; choose contiguous, zigzag or striped")


def ring_block_size(length: int, block: int) -> int:
    """The block size ring attention uses for a shard of ``length`` tokens: one that tiles
    each half of the shard, so no block straddles a device's two zigzag chunks (a straddling
    block mixes distant positions and is never skipped). Keeps ``block`` when only much
    smaller blocks would tile the halves."""
    if length % 2:
        return block
    half = length // 2
    if block >= half:
        return half
    for count in range(-(-half // block), half + 1):
        if half % count == 0:  # the largest size <= block that tiles the half
            size = half // count
            return size if 2 * size >= block else block
    return block


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)
    return inv


def ring_schedule_work(
    seq_len: int,
    num_shards: int,
    *,
    block_q: int = 512,
    block_k: int = 512,
    layout: Layout = "zigzag",
    causal: bool = True,
) -> np.ndarray:
    """Live (computed) block pairs, ``[device, ring_step]``, for one sequence.

    Uses the same liveness test as the kernel (`block_is_live`), so it counts exactly the
    blocks ring attention computes. At step ``t`` device ``i`` holds the key chunk of device
    ``(i - t) mod n``.
    """
    pos = layout_permutation(layout, seq_len, num_shards).reshape(num_shards, -1)
    local = pos.shape[1]
    if num_shards > 1:
        bq, bk = ring_block_size(local, block_q), ring_block_size(local, block_k)
    else:
        bq, bk = min(block_q, local), min(block_k, local)
    if local % bq or local % bk:
        raise ValueError(f"blocks ({bq}, {bk}) must divide the shard length {local}")
    work = np.zeros((num_shards, num_shards), dtype=np.int64)
    for dev in range(num_shards):
        q_blocks = pos[dev].reshape(-1, bq)
        for step in range(num_shards):
            k_blocks = pos[(dev - step) % num_shards].reshape(-1, bk)
            work[dev, step] = sum(
                bool(block_is_live(qb, kb, None, None, causal, xp=np))
                for qb in q_blocks
                for kb in k_blocks
            )
    return work


def balance(work: np.ndarray) -> float:
    """Max over devices of computed blocks, over the mean: 1.0 is perfect balance."""
    per_device = work.sum(axis=1)
    return float(per_device.max() / per_device.mean())


def ring_step_balance(work: np.ndarray) -> float:
    """Ring steps are synchronised by the ppermute: time ~ sum over steps of the busiest device.
    Returns that over the mean work per device (1.0 = no device ever waits)."""
    return float(work.max(axis=0).sum() / work.sum(axis=1).mean())


def apply_layout(arrays, perm: np.ndarray):
    """Permute the sequence axis (axis 1) of every ``[batch, seq, ...]`` array in a pytree."""
    import jax

    index = np.asarray(perm)
    return jax.tree.map(lambda x: x[:, index], arrays)
