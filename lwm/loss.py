"""LWM's modality-balanced next-token loss and per-modality accuracy.

Targets are made in the original token order (`data.batches.next_token_targets`), before any permutation
of the sequence (zigzag), so "next token" always means the next token of the same document:
a target is dropped where the following token belongs to another segment, at the end of the
sequence, and where ``loss_mask`` of the target is 0 (prompts, questions, padding).

The loss is LWM's: the mean cross-entropy over text targets (text head) and the mean over
vision targets (vision head), combined with weights (LWM: 0.5 and 0.5).

One difference in the means, on purpose: here each is over all of the batch's targets of its
modality (so micro-batches and sequence chunks add up exactly), while LWM's (tux's
``cross_entropy_loss_and_accuracy``) averages each row's targets and then the rows, a row
without targets of a modality counting as 0 in that mean. The two agree when every row has
as many targets of each modality, and differ for packed rows of unequal mixes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from data.batches import Targets


def _cross_entropy(logits: jax.Array, targets: jax.Array, weight: jax.Array):
    """Summed cross-entropy, summed correct predictions and the number of weighted targets."""
    logits = logits.astype(jnp.float32)
    targets = jnp.clip(targets, 0, logits.shape[-1] - 1)
    logz = jax.nn.logsumexp(logits, axis=-1)
    # The target's logit as a masked sum, not a gather: its gradient is then elementwise (fused
    # into the softmax's) instead of a scatter, which on a TPU flattened and copied the float32
    # logits three times (8 ms of a 320 ms step for 8K tokens and a 32,000-word vocabulary).
    # The same value and gradient to the bit: every other term is an exact zero.
    hit = jnp.arange(logits.shape[-1], dtype=targets.dtype) == targets[..., None]
    picked = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    nll = (logz - picked) * weight
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32) * weight
    return nll.sum(), correct.sum(), weight.sum()


def target_counts(targets: Targets) -> tuple[jax.Array, jax.Array]:
    """Weighted numbers of text and of vision targets."""
    vision = targets.weight * targets.is_vision
    return jnp.sum(targets.weight) - jnp.sum(vision), jnp.sum(vision)


def loss_sums(
    text_logits: jax.Array | None, vision_logits: jax.Array | None, targets: Targets
) -> dict:
    """Summed cross-entropy, correct predictions and target counts per modality: additive
    over any split of the positions (chunks of the sequence, micro-batches). A modality whose
    logits are None (its head was not computed: its loss weight is 0) sums to 0 but keeps its
    target count."""
    text_w = targets.weight * (~targets.is_vision)
    vision_w = targets.weight * targets.is_vision

    def sums(logits, weight):
        if logits is None:
            zero = jnp.zeros((), jnp.float32)
            return zero, zero, weight.sum()
        return _cross_entropy(logits, targets.tokens, weight)

    t_nll, t_correct, t_n = sums(text_logits, text_w)
    v_nll, v_correct, v_n = sums(vision_logits, vision_w)
    return {
        "t_nll": t_nll,
        "t_correct": t_correct,
        "t_n": t_n,
        "v_nll": v_nll,
        "v_correct": v_correct,
        "v_n": v_n,
    }


def loss_from_sums(
    sums: dict,
    *,
    text_weight: float = 0.5,
    vision_weight: float = 0.5,
    counts: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The modality-balanced loss and metrics from `loss_sums` (see `lwm_loss`)."""
    t_den, v_den = (sums["t_n"], sums["v_n"]) if counts is None else counts
    t_den, v_den = jnp.maximum(t_den, 1.0), jnp.maximum(v_den, 1.0)
    text_loss, vision_loss = sums["t_nll"] / t_den, sums["v_nll"] / v_den
    loss = text_weight * text_loss + vision_weight * vision_loss
    metrics = {
        "loss": loss,
        "text_loss": text_loss,
        "vision_loss": vision_loss,
        "text_accuracy": sums["t_correct"] / t_den,
        "vision_accuracy": sums["v_correct"] / v_den,
        "text_tokens": sums["t_n"],
        "vision_tokens": sums["v_n"],
    }
    return loss, metrics


def lwm_loss(
    text_logits: jax.Array,
    vision_logits: jax.Array,
    targets: Targets,
    *,
    text_weight: float = 0.5,
    vision_weight: float = 0.5,
    counts: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``text_weight * mean text CE + vision_weight * mean vision CE`` and metrics.

    A modality with no target in the batch contributes 0 (as in LWM). ``counts`` are the
    (text, vision) target counts to average over; by default this batch's. Gradient
    accumulation passes the whole batch's counts, so the micro-batch losses sum exactly to
    the whole batch's loss. Metrics: the two losses, the two accuracies, the target counts.
    """
    return loss_from_sums(
        loss_sums(text_logits, vision_logits, targets),
        text_weight=text_weight,
        vision_weight=vision_weight,
        counts=counts,
    )
