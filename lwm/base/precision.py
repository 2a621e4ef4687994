"""The precision of a model's float32 matrix products and convolutions, as its config names it
(``matmul_precision``: ``default``, ``high``, ``highest``; `jax.default_matmul_precision`).

On TPUs ``default`` is one bfloat16 pass, ``high`` three, ``highest`` float32-exact as on CPUs
(where all three compute the same). The world model (`lwm.model`) and the VQGAN
(`vqgan.model`) trace their layers under it.
"""

from __future__ import annotations

import functools

import jax

__all__ = ["PRECISIONS", "with_precision"]

# the setting's `jax.lax.Precision` (None: the backend's default)
PRECISIONS = {
    "default": None,
    "high": jax.lax.Precision.HIGH,
    "highest": jax.lax.Precision.HIGHEST,
}


def with_precision(method):
    """Trace ``method`` (of a module with ``self.cfg.matmul_precision``) under that precision."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        precision = self.cfg.matmul_precision
        if precision == "default":
            return method(self, *args, **kwargs)
        with jax.default_matmul_precision(precision):
            return method(self, *args, **kwargs)

    return wrapped
