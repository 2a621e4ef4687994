"""Attention ops: dense (reference), blockwise (flash-style), ring (sequence-parallel), decode."""

from lwm.attention.blockwise import attention_flops, blockwise_attention
from lwm.attention.dense import dense_attention
from lwm.attention.ring import ring_attention, ring_attention_local

__all__ = [
    "attention_flops",
    "blockwise_attention",
    "dense_attention",
    "ring_attention",
    "ring_attention_local",
]
