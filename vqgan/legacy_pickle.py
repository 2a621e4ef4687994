"""A restricted unpickler for legacy parameter files (LWM ships its VQGAN as a pickled tree of
numpy arrays). Pickle can run arbitrary code when a file names a callable global; this one
admits only plain containers and the few numpy functions that rebuild arrays and scalars from
bytes, and refuses every other global with an error that names it.

    tree = load_legacy_pickle("vqgan", allow_pickle=True)   # nested dicts of numpy arrays

Never use this for files we write ourselves (those are safetensors or orbax).
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["LegacyPickleError", "RestrictedUnpickler", "load_legacy_pickle"]


class LegacyPickleError(ValueError):
    """A legacy pickle was refused (not allowed, references a forbidden global, or malformed)."""


def _numpy_attr(module: str, name: str) -> Any:
    """``module.name`` for numpy's private array-rebuilding helpers, whichever of
    ``numpy._core`` (numpy 2) or ``numpy.core`` (numpy 1) this numpy has."""
    for prefix in ("numpy._core", "numpy.core"):
        try:
            return getattr(importlib.import_module(f"{prefix}.{module}"), name)
        except (ImportError, AttributeError):
            continue
    raise LegacyPickleError(f"this numpy has no {module}.{name}")


def _frozen_dict(*args: Any, **kwargs: Any) -> dict:
    # flax's FrozenDict pickles as FrozenDict(plain_dict); a plain dict is all we need.
    return dict(*args, **kwargs)


def _allowed() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("collections", "OrderedDict"): dict,
        ("builtins", "dict"): dict,
        ("builtins", "list"): list,
        ("builtins", "tuple"): tuple,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("_codecs", "encode"): _latin1_encode,  # protocol 0-2 pickles store bytes via it
        ("flax.core.frozen_dict", "FrozenDict"): _frozen_dict,
    }
    for prefix in ("numpy._core", "numpy.core"):
        table[(f"{prefix}.multiarray", "_reconstruct")] = _numpy_attr("multiarray", "_reconstruct")
        table[(f"{prefix}.multiarray", "scalar")] = _numpy_attr("multiarray", "scalar")
        table[(f"{prefix}.numeric", "_frombuffer")] = _numpy_attr("numeric", "_frombuffer")
    return table


def _latin1_encode(text: str, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise LegacyPickleError(
            f"_codecs.encode is admitted only for latin1 text, got {encoding!r}"
        )
    return text.encode(encoding, errors)


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler whose `find_class` admits only containers and numpy array reconstruction."""

    ALLOWED: dict[tuple[str, str], Any] = _allowed()

    def __init__(self, file: io.BufferedIOBase, *, source: str = "<pickle>"):
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            raise LegacyPickleError(
                f"refusing to load '{self._source}': it references the global '{module}.{name}', "
                "which the restricted unpickler does not admit (only plain containers and numpy "
                "arrays are allowed; a pickle naming other globals can run arbitrary code)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise LegacyPickleError(f"refusing to load '{self._source}': it uses persistent ids")


def _check_tree(tree: Any, source: str, path: str = "") -> None:
    if isinstance(tree, dict):
        for key, value in tree.items():
            if not isinstance(key, str):
                raise LegacyPickleError(f"'{source}': non-string key {key!r} at '{path}'")
            _check_tree(value, source, f"{path}/{key}" if path else key)
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            _check_tree(value, source, f"{path}/{i}")
    elif isinstance(tree, np.ndarray):
        if tree.dtype.hasobject:
            raise LegacyPickleError(f"'{source}': array at '{path}' has object dtype")
    elif not isinstance(tree, int | float | str | bytes | bool | np.generic | type(None)):
        raise LegacyPickleError(f"'{source}': unexpected {type(tree).__name__} at '{path}'")


def load_legacy_pickle(path: str | os.PathLike, *, allow_pickle: bool = False) -> Any:
    """Read a pickled tree of numpy arrays through `RestrictedUnpickler`.

    Refuses unless ``allow_pickle=True`` (on the command line: ``--allow-legacy-pickle``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pickle '{path}' not found")
    with path.open("rb") as f:
        head = f.read(2)
    if not (len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5):  # protocols 2-5
        raise LegacyPickleError(
            f"'{path}' is not a pickle of protocol 2 or later (LWM's parameter files are)"
        )
    if not allow_pickle:
        raise LegacyPickleError(
            f"'{path}' is a legacy pickle; loading it needs an explicit opt-in "
            "(allow_pickle=True, or --allow-legacy-pickle on the command line)"
        )
    with path.open("rb") as f:
        try:
            tree = RestrictedUnpickler(f, source=str(path)).load()
        except LegacyPickleError:
            raise
        except Exception as e:  # malformed or truncated pickles raise many types
            raise LegacyPickleError(f"'{path}' is not a readable pickle: {e}") from None
    _check_tree(tree, str(path))
    return tree
