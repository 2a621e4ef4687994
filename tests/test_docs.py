"""The docs stay true to the repository: the config reference is the one the models generate,
no tracked file points outside the repository, and every relative link in the README and
docs/ leads to a file that exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from lwm.config_reference import render

ROOT = Path(__file__).resolve().parent.parent

# Written in two pieces so that this file does not match itself.
OUTSIDE = ("../" + "shared", "/" + "work/")


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_config_reference_is_current():
    page = (ROOT / "docs" / "config.md").read_text()
    assert page == render(), (
        "docs/config.md is not the generated reference; run "
        "`python -m lwm.config_reference > docs/config.md`"
    )


def test_no_tracked_file_points_outside_the_repository():
    found = []
    for path in tracked_files():
        if not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="ignore")
        for number, line in enumerate(text.splitlines(), 1):
            if any(marker in line for marker in OUTSIDE):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]}")
    assert not found, "files that refer outside the repository:\n" + "\n".join(found)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def markdown_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_relative_links_lead_to_files_that_exist():
    broken = []
    for page in markdown_pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)
