"""Test setup: 8 simulated CPU devices, configured before anything imports jax, and one
persistent compilation cache for the session (a fresh folder per run), shared with the `lwm`
subprocesses the tests start: the same programs compiled again (the train step of every
`lwm train` run of tests/test_train.py) are loaded instead of compiled. A cached program is
the compiled executable itself, so results are unchanged (the resume tests compare losses
bit for bit between a fresh and a cached compile). Every program is kept, however short its
compile (each `lwm` process compiles dozens of small ones, the same in every run of a test
file: tests/test_train.py took 263 s instead of 300 with only those over 0.5 s kept). The
folder (about 190 MB after the whole suite) is removed when the run ends.

On the CPU, XLA compiles for speed of compiling here: LLVM at -O0
(``--xla_backend_optimization_level=0``) and XLA's older fusion code generator
(``--xla_cpu_use_fusion_emitters=false``; the newer, MLIR-based one spent 2-3x as long on the
tests' ring train step: 10-13 s against 4-6). The tests' programs are small, so compiling
them is most of their time. Both choose how XLA turns the same HLO program into machine code:
how fast it runs, not what it computes (results are compared with references within the
tolerances the tests state, and bit for bit only between runs made with the same flags). The
`lwm` subprocesses keep them (`subprocess_xla_flags`), except the one training that runs for
minutes (tests/test_vision_learning.py). -O0 took the suite from 677 to 540 s on this
project's 2-core machine (2026-12-05). An XLA that no longer knows the second flag would abort
at start-up, so it is given only when a probe process accepts it."""

import os
import shutil
import subprocess
import sys
import tempfile

DEVICES = "--xla_force_host_platform_device_count=8"
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib starts with ``flag`` (an unknown flag in XLA_FLAGS is fatal); a
    probe that hangs counts as no after two minutes (the tests then run without the flag)."""
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    code = "import jax; jax.devices()"
    try:
        probe = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0


if os.environ.get("LWM_REQUIRE_TPU") == "1":  # tests/test_tpu.py on a TPU VM: the chip
    os.environ.setdefault("JAX_PLATFORMS", "tpu,cpu")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a GPU run of the cuDNN tests sets it
for _flag in (DEVICES, *FAST_COMPILE) if os.environ["JAX_PLATFORMS"] == "cpu" else (DEVICES,):
    if _flag.split("=")[0] in os.environ.get("XLA_FLAGS", ""):
        continue
    if _flag == FAST_COMPILE[1]:  # checked once: pytest-xdist's workers inherit the answer
        if os.environ.get("LWM_TESTS_FUSION_FLAG") == "no":
            continue
        if not _xla_accepts(_flag):
            os.environ["LWM_TESTS_FUSION_FLAG"] = "no"
            continue
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

OWN_CACHE = None  # the compilation cache this run made, removed when it ends
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    OWN_CACHE = tempfile.mkdtemp(prefix="lwm-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = OWN_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


def pytest_unconfigure(config) -> None:
    """Remove this run's compilation cache: every run makes a fresh one, and each left behind
    held about 190 MB of the temporary folder."""
    if OWN_CACHE is not None:
        shutil.rmtree(OWN_CACHE, ignore_errors=True)


def subprocess_xla_flags(*, fast_compile: bool = True) -> str:
    """XLA_FLAGS for a subprocess that picks its own devices (``--cpu-devices``): this
    process's, without the 8 simulated devices, and without `FAST_COMPILE` where the
    subprocess runs long enough for the code's speed to matter."""
    drop = [DEVICES] if fast_compile else [DEVICES, *FAST_COMPILE]
    names = tuple(flag.split("=")[0] for flag in drop)
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(names))
