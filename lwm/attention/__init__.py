"""Attention ops: dense (reference), blockwise (flash-style), ring (sequence-parallel), decode
(one new token against a cache sharded over the ring), and the zigzag layout that balances the
causal ring's work."""

from lwm.attention._common import default_positions, keys_precede_queries, look_back
from lwm.attention.blockwise import attention_flops, blockwise_attention
from lwm.attention.decode import ring_decode_attention
from lwm.attention.dense import dense_attention
from lwm.attention.layout import inverse_permutation, zigzag_permutation
from lwm.attention.ring import ring_attention, ring_attention_local

__all__ = [
    "attention_flops",
    "blockwise_attention",
    "default_positions",
    "dense_attention",
    "inverse_permutation",
    "keys_precede_queries",
    "look_back",
    "ring_attention",
    "ring_attention_local",
    "ring_decode_attention",
    "zigzag_permutation",
]
