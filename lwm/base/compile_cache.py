"""The persistent compilation cache of `lwm` commands: compiled programs kept on disk, so that
the next process that compiles the same program (a second `lwm tokenize` with the same VQGAN,
a second stage of `lwm train` with the same shapes, any rerun) loads it instead; programs that
compile in under a second (JAX's ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``) are not kept.

JAX's own settings decide, where given: ``JAX_COMPILATION_CACHE_DIR`` names the folder,
``JAX_ENABLE_COMPILATION_CACHE=false`` turns the cache off, ``JAX_COMPILATION_CACHE_MAX_SIZE``
bounds it. Otherwise the folder is ``$XDG_CACHE_HOME/lwm/jax`` (``~/.cache/lwm/jax``), at most
`DEFAULT_MAX_BYTES`, least recently used programs removed first.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DEFAULT_MAX_BYTES", "default_cache_dir", "use_compilation_cache"]

DEFAULT_MAX_BYTES = 4 << 30


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lwm/jax``, or ``~/.cache/lwm/jax``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "lwm" / "jax"


def use_compilation_cache() -> str | None:
    """Keep this process's compiled programs in the cache (module docstring); call it before
    the first compilation. Returns the folder in use, None where the cache is off (or the
    default folder cannot be made: a read-only home compiles as before)."""
    import jax

    if not jax.config.jax_enable_compilation_cache:
        return None
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # JAX reads it itself
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    path = default_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    if jax.config.jax_compilation_cache_max_size == -1:  # not bounded by the environment
        jax.config.update("jax_compilation_cache_max_size", DEFAULT_MAX_BYTES)
    return str(path)
