"""Test setup: 8 simulated CPU devices, configured before anything imports jax, and one
persistent compilation cache for the session (a fresh folder per run), shared with the `lwm`
subprocesses the tests start: the same programs compiled again (the train step of every
`lwm train` run of tests/test_train.py) are loaded instead of compiled. A cached program is
the compiled executable itself, so results are unchanged (the resume tests compare losses
bit for bit between a fresh and a cached compile)."""

import os
import tempfile

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a GPU run of the cuDNN tests sets it
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="lwm-tests-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
