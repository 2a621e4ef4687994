"""cuDNN's fused flash attention as the block kernel of blockwise and ring attention
(``model.attention_kernel: cudnn``; ``auto`` picks it on NVIDIA GPUs).

cuDNN masks by index (causal or nothing) or by an additive bias, while our masks come from
positions and segment ids. So the local shard is cut into pieces (its two zigzag halves under
ring attention, the whole shard on one device) and each (query piece, key piece) pair of a ring
step is classified at run time from its positions and segment ids (`pair_kind`):

- ``DEAD``: nothing visible, skipped;
- ``FULL``: everything visible: one cuDNN call without a mask;
- ``CAUSAL``: exactly cuDNN's causal mask (the zigzag layout's diagonal pairs of one
  document): one cuDNN call with it;
- ``GENERAL`` (a pair longer than `PIECE` tokens, classified from its ranges of positions and
  segment ids): cut into pieces of at most `PIECE` tokens on each side, each classified
  exactly, from its whole mask;
- ``MASKED_CAUSAL`` (a piece, or a short pair, whose mask lies within cuDNN's causal one:
  documents packed in order) and ``MASKED`` (anything else): one cuDNN call with the mask as a
  bias (0 or a large negative number), under its causal mask for the former so that it skips
  the blocks above the diagonal. A query that sees nothing in the piece gets nothing from it.

So the result equals `dense_attention` for any positions and segment ids, and every live pair
or piece is one cuDNN call: a row of one document makes one per pair (as large as cuDNN alone
would make on that shard); rows packed with documents, one per piece. The pairs' outputs are
combined with their float32 log-sum-exps, as the ring combines chunks.

Each of those choices is a conditional, and on a GPU the device idles while the host reads its
predicate (1-2 ms per fwd+bwd call at 8K on an H200, more than the kernels' own gap to cuDNN;
docs/benchmarks.md). So when the caller gives no positions and no segment ids (``Spec.order``:
one document in a contiguous or zigzag order), every call is scheduled when tracing
(`_ordered_forward`): nothing is decided at run time. On one device, when the caller says that
every key a query sees comes before it (``in_order``: documents packed one after another), one
thing is decided per call, whether that holds (`_if_in_order`), and then every call is
scheduled when tracing (`_in_order_forward`), at the price of computing every piece below the
diagonal, or, told how far back any query looks (``reach``), each piece's band of them.

Backward: JAX's own cuDNN rule is for one call; it drops the log-sum-exp's cotangent, so autodiff
through the combine would be wrong. This package has its own VJP (as ring-flash-attention does
with flash-attn): every live pair calls cuDNN's backward kernel with the **global** output and
log-sum-exp of its queries, which makes each pair's dQ, dK, dV exact parts of the total; dK and
dV travel around the ring with their chunk, as in `lwm.attention.blockwise`.

The forward and backward kernels are reached through ``jax._src.cudnn.fused_attention_stablehlo``
(private: `dot_product_attention(..., return_residual=True)` for the float32 statistics, which
the public `jax.nn.dot_product_attention` rounds to the input dtype, and the backward
primitive, which the public API only reaches through its own VJP). Off a GPU, or with
``emulate``, both kernels are replaced by a dense float32 computation with cuDNN's conventions
(output in the input dtype, log-sum-exp ``[batch, heads, q]`` in float32): how the tests check
everything around the kernels on a CPU.

Modules: `kernels` (what cuDNN takes, its two kernels and their stand-ins, one call with a
mask), `pairs` (a pair's kind, its branch, pieces and their combining), `ordered` (the
schedules fixed when tracing), `general` (`attention_core`, its VJP and the schedule for any
positions). `pairs.PIECE` is the longest piece of a general pair (the benchmarks' knob).
"""

from lwm.attention.cudnn.general import attention_core
from lwm.attention.cudnn.kernels import DTYPES, log_fallback, unsupported
from lwm.attention.cudnn.pairs import CAUSAL, DEAD, FULL, GENERAL, MASKED, MASKED_CAUSAL, pair_kind

__all__ = [
    "CAUSAL",
    "DEAD",
    "DTYPES",
    "FULL",
    "GENERAL",
    "MASKED",
    "MASKED_CAUSAL",
    "attention_core",
    "log_fallback",
    "pair_kind",
    "unsupported",
]
