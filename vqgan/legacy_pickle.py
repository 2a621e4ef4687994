"""A restricted unpickler for legacy parameter files (LWM ships its VQGAN as a pickled tree of
numpy arrays). Pickle can run arbitrary code when a file names a callable global; this one
admits only plain containers and numpy's array and scalar rebuilders, and refuses every other
global with an error that names it.

numpy's own rebuilders trust the file too: ``numpy.dtype.__setstate__`` takes a pickled
dtype's fields, item size and flags as they are (a field of object dtype with the "holds
objects" flag cleared makes file bytes into object pointers; an item size smaller than a
field's offset reads past the buffer), and ``numpy.ndarray(shape, object)`` fills any number of
slots. So the numpy names are admitted as stand-ins that never hand pickled state to numpy:
they record the dtype's name and state and the array's bytes, and build plain numeric
(bool, integer, float, complex) dtypes and arrays from them, checking that the bytes fill the
shape. Nothing is allocated beyond what the file holds.

    tree = load_legacy_pickle("vqgan", allow_pickle=True)   # nested dicts of numpy arrays

Never use this for files we write ourselves (those are safetensors or orbax).
"""

from __future__ import annotations

import io
import math
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["LegacyPickleError", "RestrictedUnpickler", "load_legacy_pickle"]

_PLAIN_KINDS = "biufc"  # bool, signed and unsigned integers, floats, complex: no pointers
_MAX_DEPTH = 100  # LWM's parameter trees are 6 deep


class LegacyPickleError(ValueError):
    """A legacy pickle was refused (not allowed, references a forbidden global, or malformed)."""


class _RefusedError(Exception):
    """Raised inside unpickling by the stand-ins; `load` names the file."""


class _Admitted:
    """An admitted callable that a pickle cannot alter (BUILD on it is refused)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Any):
        self._fn = fn

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)

    def __setstate__(self, state: Any) -> None:
        raise _RefusedError("it sets state on an admitted function")


class _DtypeSpec:
    """Stand-in for ``numpy.dtype``: its arguments, then (BUILD) its state, kept as data."""

    __slots__ = ("spec", "state")

    def __new__(cls, spec: Any = None, align: Any = False, copy: Any = True) -> _DtypeSpec:
        self = object.__new__(cls)
        self.spec, self.state = spec, None
        return self

    def __setstate__(self, state: Any) -> None:
        if self.state is not None:
            raise _RefusedError("it sets a dtype's state twice")
        self.state = state

    def resolve(self) -> np.dtype:
        spec, state = self.spec, self.state
        try:
            dtype = np.dtype(spec) if isinstance(spec, str) else None
        except TypeError:
            dtype = None
        if dtype is None or dtype.kind not in _PLAIN_KINDS:
            raise _RefusedError(f"dtype {spec!r} is not a plain numeric dtype")
        if state is None:
            return dtype
        # numpy writes (version 3 or 4, byte order, subarray, names, fields, item size,
        # alignment, flags[, metadata]); a plain dtype has no subarray, names or fields.
        plain = (
            isinstance(state, tuple)
            and len(state) in (8, 9)
            and type(state[0]) is int
            and state[0] in (3, 4)
            and isinstance(state[1], str)
            and state[1] in ("<", ">", "=", "|")
            and all(x is None for x in state[2:5])
            and (len(state) == 8 or state[8] is None)
        )
        if not plain:
            raise _RefusedError(f"dtype {spec!r} has a state other than a plain numeric dtype's")
        return dtype.newbyteorder(state[1]) if state[1] in "<>" else dtype


def _array(raw: Any, dtype: Any, shape: Any, order: str) -> np.ndarray:
    """A plain numeric array of ``shape`` from exactly its bytes, copied (writable)."""
    if not isinstance(dtype, _DtypeSpec):
        raise _RefusedError(f"an array's dtype is a {type(dtype).__name__}")
    dt = dtype.resolve()
    if not (isinstance(shape, tuple) and all(type(n) is int and n >= 0 for n in shape)):
        raise _RefusedError(f"an array's shape is {shape!r:.60}")
    if not isinstance(raw, bytes | bytearray):
        raise _RefusedError(f"an array's data is a {type(raw).__name__}, not bytes")
    need = math.prod(shape) * dt.itemsize
    if len(raw) != need:
        raise _RefusedError(
            f"an array of shape {shape} {dt} needs {need} bytes, the file has {len(raw)}"
        )
    return np.frombuffer(raw, dt).reshape(shape, order=order).copy(order="K")


class _ArraySpec:
    """What ``_reconstruct`` gives: an array whose state (BUILD) carries its dtype and bytes."""

    __slots__ = ("array",)

    def __init__(self) -> None:
        self.array: np.ndarray | None = None

    def __setstate__(self, state: Any) -> None:
        if self.array is not None:
            raise _RefusedError("it sets an array's state twice")
        if isinstance(state, tuple) and len(state) == 5:  # (version, shape, dtype, fortran, raw)
            state = state[1:]
        if not (isinstance(state, tuple) and len(state) == 4):
            raise _RefusedError(f"an array's state is {type(state).__name__} of another form")
        shape, dtype, fortran, raw = state
        self.array = _array(raw, dtype, shape, "F" if fortran else "C")


class _NdarrayName:
    """``numpy.ndarray`` as the file names it: only `_reconstruct`'s first argument."""

    __slots__ = ()

    def __call__(self, *args: Any) -> Any:
        raise _RefusedError("it calls numpy.ndarray (only numpy's rebuilders may make arrays)")

    def __setstate__(self, state: Any) -> None:
        raise _RefusedError("it sets state on numpy.ndarray")


_NDARRAY = _NdarrayName()


def _reconstruct(subtype: Any, shape: Any, dtype: Any) -> _ArraySpec:
    if subtype is not _NDARRAY:
        raise _RefusedError(f"it rebuilds an array of type {type(subtype).__name__}")
    return _ArraySpec()  # the shape and dtype come with the state; nothing is allocated here


def _frombuffer(buf: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
    if not (isinstance(order, str) and order in ("C", "F")):
        raise _RefusedError(f"an array's order is {order!r:.20}")
    return _array(buf, dtype, shape, order)


def _scalar(dtype: Any, data: Any = None) -> np.generic:
    if not isinstance(dtype, _DtypeSpec):
        raise _RefusedError(f"a scalar's dtype is a {type(dtype).__name__}")
    return _array(data, dtype, (), "C")[()]


def _frozen_dict(*args: Any) -> dict:
    # flax's FrozenDict pickles as FrozenDict(plain_dict); a plain dict is all we need.
    return dict(*args)


def _latin1_encode(text: Any, encoding: Any = "utf-8", errors: Any = "strict") -> bytes:
    latin1 = isinstance(encoding, str) and encoding in ("latin1", "latin-1")
    if not (isinstance(text, str) and latin1 and isinstance(errors, str) and errors == "strict"):
        raise _RefusedError(
            f"_codecs.encode is admitted only for latin1 text, got {encoding!r:.20}"
        )
    return text.encode(encoding)


def _allowed() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): _NDARRAY,
        ("numpy", "dtype"): _DtypeSpec,
        ("collections", "OrderedDict"): dict,
        ("builtins", "dict"): dict,
        ("builtins", "list"): list,
        ("builtins", "tuple"): tuple,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("_codecs", "encode"): _Admitted(_latin1_encode),  # protocol 2 stores bytes via it
        ("flax.core.frozen_dict", "FrozenDict"): _Admitted(_frozen_dict),
    }
    for prefix in ("numpy._core", "numpy.core"):  # numpy 2 and numpy 1 names
        table[(f"{prefix}.multiarray", "_reconstruct")] = _Admitted(_reconstruct)
        table[(f"{prefix}.multiarray", "scalar")] = _Admitted(_scalar)
        table[(f"{prefix}.numeric", "_frombuffer")] = _Admitted(_frombuffer)
    return table


def _finish(obj: Any, done: dict[int, Any], active: set[int], path: str, depth: int) -> Any:
    """The tree with its arrays built; refuses anything but containers, arrays and scalars.
    Shared containers are visited once (``done``); a container inside itself is refused."""
    where = f" at '{path}'" if path else ""
    if isinstance(obj, _ArraySpec):
        if obj.array is None:
            raise _RefusedError(f"an array{where} has no data")
        return obj.array
    if isinstance(obj, np.ndarray | np.generic):
        if obj.dtype.kind not in _PLAIN_KINDS:  # only our stand-ins build these
            raise _RefusedError(f"an array{where} has dtype {obj.dtype}")
        return obj
    if obj is None or isinstance(obj, int | float | str | bytes):
        return obj
    if not isinstance(obj, dict | list | tuple):
        what = "numpy.dtype" if isinstance(obj, _DtypeSpec) else type(obj).__name__
        raise _RefusedError(f"unexpected {what}{where}")
    if id(obj) in done:
        return done[id(obj)]
    if id(obj) in active:
        raise _RefusedError(f"the container{where} contains itself")
    if depth >= _MAX_DEPTH:
        raise _RefusedError(f"nested deeper than {_MAX_DEPTH} levels{where}")
    active.add(id(obj))
    if isinstance(obj, dict):
        out: Any = {}
        for key, value in obj.items():
            if not isinstance(key, str):
                raise _RefusedError(f"non-string key {key!r:.60}{where}")
            out[key] = _finish(value, done, active, f"{path}/{key}" if path else key, depth + 1)
    else:
        items = [_finish(v, done, active, f"{path}/{i}", depth + 1) for i, v in enumerate(obj)]
        out = tuple(items) if isinstance(obj, tuple) else items
    active.discard(id(obj))
    done[id(obj)] = out
    return out


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler whose `find_class` admits only containers and numpy array reconstruction;
    `load` gives nested dicts, lists and tuples of plain numeric numpy arrays and scalars."""

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

    def load(self) -> Any:
        try:
            return _finish(super().load(), {}, set(), "", 0)
        except _RefusedError as e:
            raise LegacyPickleError(f"refusing to load '{self._source}': {e}") from None


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
            return RestrictedUnpickler(f, source=str(path)).load()
        except LegacyPickleError:
            raise
        except Exception as e:  # malformed or truncated pickles raise many types
            raise LegacyPickleError(f"'{path}' is not a readable pickle: {e}") from None
