"""Imports point down the layers of docs/architecture.md (and `lwm.base`'s docstring): every
import of every module of lwm/, vqgan/ and data/ is read from its source (function-level
imports included) and must not reach a higher layer. The data layer uses the VQGAN's public
API only (`import vqgan` / `from vqgan import ...`)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from conftest import subprocess_xla_flags

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lwm", "vqgan", "data")

# Bottom to top; a module belongs to the layer of its longest matching prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("lwm", "lwm.base")),
    ("vqgan", ("vqgan",)),
    ("data", ("data",)),
    (
        "model",
        ("lwm.config", "lwm.attention", "lwm.model", "lwm.loss", "lwm.info", "lwm.weights")
        + ("lwm.runs",),
    ),
    (
        "training, inference and evaluation",
        (
            "lwm.train",
            "lwm.train_data",
            "lwm.train_step",
            "lwm.generate",
            "lwm.vision_qa",
            "lwm.qa_eval",
        )
        + ("lwm.needle", "lwm.chat", "lwm.text_to_video"),
    ),
    # the command line, and what the scripts and the docs (lwm.config_reference) are made with
    (
        "commands",
        ("lwm.commands", "lwm.cli", "lwm.__main__", "lwm.scripting", "lwm.config_reference"),
    ),
]


def module_names() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def layer_of(module: str) -> int | None:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def imports_of(path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported module) for every import of one of the project's packages."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import sub` imports the module pkg.sub when there is one
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            ]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in PACKAGES]
    return found


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in module_names() if layer_of(m) is None]
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"


def test_imports_point_down() -> None:
    modules = module_names()
    upward = []
    for module, path in modules.items():
        here = layer_of(module)
        for line, target in imports_of(path, modules):
            there = layer_of(target)
            assert here is not None and there is not None, (module, target)
            where = f"{path.relative_to(ROOT)}:{line}: {module} ({LAYERS[here][0]}) imports"
            if there > here:
                upward.append(f"{where} {target} ({LAYERS[there][0]})")
            if LAYERS[here][0] == "data" and target.startswith("vqgan."):
                upward.append(f"{where} {target}, not the vqgan package's public API")
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_the_walk_sees_upward_imports(tmp_path: Path) -> None:
    # The checker itself: a data module importing the model, and one reaching into vqgan's
    # internals, are both found.
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from lwm.loss import lwm_loss\n    import vqgan.train\n")
    found = imports_of(bad, module_names())
    assert found == [(2, "lwm.loss"), (3, "vqgan.train")]
    assert layer_of("lwm.loss") > layer_of("data.batches") > layer_of("vqgan")
    assert layer_of("lwm.base.mesh") == 0 and layer_of("lwm.commands.train") == len(LAYERS) - 1


def test_vision_ids_have_one_owner() -> None:
    # The code count and marker ids of the token stream are written down in data/tokens.py
    # only; every other module of lwm/ and data/ takes them from there.
    owner = ROOT / "data" / "tokens.py"
    literals = []
    for module, path in module_names().items():
        if path == owner or module.startswith("vqgan"):  # the VQGAN's codebook is its own fact
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in (8192, 8193, 8448):
                literals.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert not literals, "vision ids written outside data/tokens.py:\n" + "\n".join(literals)


OWNER_PROBE = """
import json
import jax, jax.numpy as jnp, numpy as np
import data.tokens
from data.batches import SyntheticTokenLoader
from lwm.config import load_config
from lwm.generate import Sampling, generate
from lwm.model import create_model
from lwm.train_data import TrainingInputError, check_dataset

cfg = load_config("debug.yaml").model.model_copy(update={"vision_codes": 16})
model = create_model(cfg)
out = {"owner": data.tokens.__file__}
out["span"] = data.tokens.vision_span(np.zeros((2, 1, 2), np.int32)).tolist()
tokens = jnp.zeros((1, 3), jnp.int32)
gen, _ = generate(model, tokens, jnp.zeros((1, 3), bool), jnp.asarray([3]),
                  key=jax.random.key(0), mode="vision", sampling=Sampling(temperature=1.0),
                  tokens_per_frame=2, num_frames=2)
out["generated"] = np.asarray(gen)[0].tolist()
out["head"] = np.asarray(model.vision_head_ids())[-2:].tolist()
loader = SyntheticTokenLoader(batch_size=1, seq_len=512, text_vocab_size=256, seed=0)
batch = next(iter(loader))
out["synthetic"] = sorted({int(t) for t, v in zip(batch["tokens"].ravel(), batch["vision_mask"].ravel()) if v and t >= 8192})
meta = {"markers": {"eof": 8192, "eov": 8193}, "text_tokenizer": {"vocab_size": 10}}
try:
    check_dataset("old-ids", meta, cfg)
    out["check"] = "accepted"
except TrainingInputError as e:
    out["check"] = str(e)
print(json.dumps(out))
"""


def test_the_marker_ids_change_in_one_place(tmp_path: Path) -> None:
    # Moving <eof>/<eov> in data/tokens.py alone (in a copy of the tree) moves them in what
    # tokenize writes, what the synthetic loader makes, what generation forces, what the
    # vision head scores, and makes the loader refuse a dataset marked with the old ids.
    import json
    import shutil
    import subprocess
    import sys

    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copy(ROOT / "configs" / "debug.yaml", tmp_path / "debug.yaml")
    tokens = tmp_path / "data" / "tokens.py"
    text = tokens.read_text()
    for old, new in (("EOF_ID = 8192", "EOF_ID = 8300"), ("EOV_ID = 8193", "EOV_ID = 8301")):
        assert old in text, f"data/tokens.py no longer defines {old}"
        text = text.replace(old, new)
    tokens.write_text(text)
    run = subprocess.run(
        [sys.executable, "-c", OWNER_PROBE],
        cwd=tmp_path,
        env={
            **os.environ,
            "PYTHONPATH": str(tmp_path),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": subprocess_xla_flags(),  # one device, compiled as the tests compile
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(out["owner"]).resolve() == tokens.resolve()
    assert out["span"] == [0, 0, 8300, 0, 0, 8301]  # what tokenize writes
    assert out["generated"][2] == 8300 and out["generated"][5] == 8301  # what generation forces
    assert out["head"] == [8300, 8301]  # what the vision head scores
    assert out["synthetic"] and set(out["synthetic"]) <= {8300, 8301}  # the synthetic loader
    assert (
        "{'eof': 8192, 'eov': 8193}" in out["check"]
        and "{'eof': 8300, 'eov': 8301}" in out["check"]
    )  # the loader refuses a dataset marked with the old ids
