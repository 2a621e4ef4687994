"""What cuDNN's fused flash attention takes (`unsupported`), its forward and backward kernels
(reached through JAX's private ``jax._src.cudnn.fused_attention_stablehlo``: the public
`jax.nn.dot_product_attention` rounds the float32 log-sum-exp to the input dtype and reaches
the backward only through its own VJP), their dense float32 stand-ins with the same
conventions (off a GPU, or with ``Spec.interpret``), and one call of either with a mask as an
additive bias (`_call_fwd`, `_call_bwd`)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from lwm.attention.blocks import F32, Spec

log = logging.getLogger(__name__)

DTYPES = (jnp.bfloat16, jnp.float16)


def unsupported(q: jax.Array, k: jax.Array) -> str | None:
    """Why cuDNN's flash attention cannot run these inputs on this GPU, or None if it can."""
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (cuDNN's flash attention takes bfloat16 or float16)"
    d = q.shape[-1]
    if d % 8 or d > 256:
        return f"head_dim {d} (cuDNN needs a multiple of 8, at most 128 before Hopper, 256 on)"
    if k.dtype != q.dtype:
        return f"keys in {k.dtype} and queries in {q.dtype}"
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        version = fa.check_cudnn_version()
        if d > 128 and not fa.check_compute_capability("9.0"):
            return f"head_dim {d} before Hopper"
    except Exception as e:  # no cuDNN in this jaxlib, or not a CUDA backend
        return f"cuDNN is not available ({e})"
    if version < 8904:
        return f"cuDNN {version} (flash attention needs 8.9.4 or later)"
    return None


_logged: set[str] = set()


def log_fallback(reason: str) -> None:
    """One log line per reason: the XLA block kernel runs instead of cuDNN."""
    if reason not in _logged:
        _logged.add(reason)
        log.warning("attention_kernel cudnn: falling back to the XLA block kernel for %s", reason)


def _negative(dtype) -> int:
    """What a masked-out score gets added: JAX's own choice for cuDNN
    (`fused_attention_stablehlo.get_large_negative_number`), finite because cuDNN mishandles
    the difference of two infinities; float16's is the largest it holds."""
    return -(2 << 14) if jnp.dtype(dtype) == jnp.float16 else -(2 << 40)


def _cudnn_fwd(q, k, v, causal: bool, scale: float, bias=None):
    from jax._src.cudnn import fused_attention_stablehlo as fa

    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    out, lse = fa.dot_product_attention(
        q, k, v, bias, scale=scale, mask_type=mask, qkv_layout="BTNH", return_residual=True
    )
    return out, lse


def _cudnn_bwd(q, k, v, out, lse, dout, causal: bool, scale: float, bias=None):
    from jax._src.cudnn import fused_attention_stablehlo as fa

    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    unused = jnp.zeros(0, q.dtype)
    dq, dk, dv = fa._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused if bias is None else bias, *([unused] * 6), lse, out, dout,
        scale=scale, seed=42, dropout_rate=0.0, variadic_args=(bias is not None, False),
        mask_type=mask, layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None,
    )  # fmt: skip
    return dq, dk, dv


def _emulated_scores(q, k, causal: bool, scale: float, bias=None):
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qf = q.astype(F32).reshape(b, t, kvh, h // kvh, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qf, k.astype(F32)) * scale
    if bias is not None:  # [b, 1, t, s]: added to the scaled scores, as cuDNN adds it
        s = s + bias.astype(F32)[:, :, None]
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((t, k.shape[1]), bool)), s, -jnp.inf)
    return s


def _emulated_fwd(q, k, v, causal: bool, scale: float, bias=None):
    b, t, h, d = q.shape
    s = _emulated_scores(q, k, causal, scale, bias)
    lse = jax.nn.logsumexp(s, axis=-1)  # [b, kvh, g, t]
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(F32)).reshape(b, t, h, d)
    return out.astype(q.dtype), lse.reshape(b, h, t)


def _emulated_bwd(q, k, v, out, lse, dout, causal: bool, scale: float, bias=None):
    b, t, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    s = _emulated_scores(q, k, causal, scale, bias)
    p = jnp.exp(s - lse.reshape(b, kvh, g, t)[..., None])
    do = dout.astype(F32).reshape(b, t, kvh, g, d)
    delta = jnp.sum(do * out.astype(F32).reshape(b, t, kvh, g, d), axis=-1)  # [b, t, kvh, g]
    dp = jnp.einsum("btkgd,bskd->bkgts", do, v.astype(F32))
    ds = p * (dp - delta.transpose(0, 2, 3, 1)[..., None]) * scale
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(F32)).reshape(b, t, h, d)
    qf = q.astype(F32).reshape(b, t, kvh, g, d)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, qf)
    dv = jnp.einsum("bkgts,btkgd->bskd", p, do)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _kernels(spec: Spec):
    return (_emulated_fwd, _emulated_bwd) if spec.interpret else (_cudnn_fwd, _cudnn_bwd)


def _mask_bias(seen: jax.Array, dtype):
    """cuDNN's additive mask ``[batch, 1, q, kv]`` for the mask ``seen`` (0 where visible)."""
    bias = jnp.where(seen, jnp.asarray(0, dtype), jnp.asarray(_negative(dtype), dtype))
    return bias[:, None]


def _call_fwd(fwd, q, k, v, causal: bool, spec: Spec, dtype, seen=None):
    """One cuDNN forward call: output in ``dtype`` and float32 log-sum-exp; with ``seen`` (the
    mask ``[batch, q, kv]``) as a bias, and a query that sees nothing gets nothing (cuDNN
    averages such a row): output 0, log-sum-exp -inf, as everywhere else."""
    bias = None if seen is None else _mask_bias(seen, q.dtype)
    out, lse = fwd(q, k, v, causal, spec.scale, bias)
    out, lse = out.astype(dtype), lse.astype(F32)
    if seen is not None:
        rows = jnp.any(seen, axis=-1)
        out = jnp.where(rows[:, :, None, None], out, 0.0).astype(dtype)
        lse = jnp.where(rows[:, None, :], lse, -jnp.inf)
    return out, lse


def _call_bwd(bwd, q, k, v, out, lse, dout, causal: bool, spec: Spec, dtype, seen=None):
    """One cuDNN backward call (dQ, dK, dV in ``dtype``) from the global output and
    log-sum-exp; ``seen`` as in `_call_fwd`."""
    bias = None
    if seen is not None:
        bias = _mask_bias(seen, q.dtype)
        # A query that sees nothing at all (padding) has -inf: make its weights 0, not NaN
        # (its output and cotangent are 0, so it adds nothing).
        lse = jnp.where(jnp.isneginf(lse), jnp.finfo(F32).max, lse)
    grads = bwd(q, k, v, out, lse, dout, causal, spec.scale, bias)
    return tuple(g.astype(dtype) for g in grads)


__all__ = ["DTYPES", "log_fallback", "unsupported"]
