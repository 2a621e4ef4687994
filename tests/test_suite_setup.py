"""The test setup itself (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_leaves_no_compilation_cache_behind(tmp_path):
    """Each pytest run makes a fresh compilation cache in the temporary folder; it is removed
    when the run ends (about 190 MB each after the whole suite)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["TMPDIR"] = str(tmp)
    probe = tmp_path / "cache_dir.txt"
    env["LWM_TEST_REPORT_CACHE"] = str(probe)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_suite_setup.py::test_the_cache_is_in_use"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout
    used = Path(probe.read_text())
    assert used.parent == tmp and used.name.startswith("lwm-tests-jax-cache-")
    assert not used.exists()
    assert list(tmp.iterdir()) == []


def test_the_cache_is_in_use():
    """Run by the test above: says where this run's cache is, and that it exists."""
    cache = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    assert cache.is_dir()
    if "LWM_TEST_REPORT_CACHE" in os.environ:
        Path(os.environ["LWM_TEST_REPORT_CACHE"]).write_text(str(cache))
