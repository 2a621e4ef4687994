"""Typed, validated configuration: YAML files with `base:` inheritance and `key=value`
overrides, errors that name the key, and the field types every config shares.

    cfg = load_config("configs/tiny.yaml", ["train.steps=10"], Config)

Each config family defines its root class (`lwm.config.Config` for the language model,
`vqgan.config.VQGANConfig` for the tokenizer) and loads through `load_config`.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.fields import FieldInfo

__all__ = [
    "ConfigError",
    "DistributedConfig",
    "MeshConfig",
    "PositiveFloat",
    "PositiveInt",
    "Precision",
    "config_to_yaml",
    "load_config",
    "validate_config",
]

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
# a model's float32 products and convolutions (`lwm.base.precision`)
Precision = Literal["default", "high", "highest"]


class ConfigError(ValueError):
    """A config file, override or value is invalid; the message names the key and the problem."""


class MeshConfig(BaseModel):
    """Device mesh over the axes (dp, fsdp, sp, tp); one -1 takes the remaining devices."""

    model_config = ConfigDict(extra="forbid")

    shape: str = "1,-1,1,1"

    @field_validator("shape", mode="before")
    @classmethod
    def _join_sequence(cls, value: Any) -> Any:
        # Accept `shape: [1, -1, 4, 1]` in YAML as well as the string form.
        if isinstance(value, list | tuple):
            return ",".join(str(v) for v in value)
        return value


class DistributedConfig(BaseModel):
    """`jax.distributed` for many hosts; unset fields come from the environment (or TPU)."""

    model_config = ConfigDict(extra="forbid")

    enabled: Literal["auto", "on", "off"] = "auto"
    coordinator_address: str | None = None
    num_processes: PositiveInt | None = None
    process_id: Annotated[int, Field(ge=0)] | None = None
    cpu_collectives: Literal["gloo", "mpi", "none"] = "gloo"


# ---------------------------------------------------------------------------------------------
# Loading


RootT = TypeVar("RootT", bound=BaseModel)


def load_config(path: str | Path, overrides: Sequence[str], root: type[RootT]) -> RootT:
    """Load a YAML config (following `base:` links), apply `a.b=value` overrides, validate
    into `root`, the config class of the file (`lwm.config.Config`, `vqgan.config.VQGANConfig`)."""
    if isinstance(overrides, str):  # each character was an override
        raise ConfigError(f"overrides must be a list of 'key=value' strings, got {overrides!r}")
    data = _load_yaml_with_base(Path(path), ())
    for override in overrides:
        _apply_override(data, override, root)
    return validate_config(data, root)


def validate_config(data: Mapping[str, Any], root: type[RootT]) -> RootT:
    """Validate a plain dict into `root`, turning pydantic errors into one `ConfigError`."""
    try:
        return root.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        unknown: dict[tuple[str, ...], list[str]] = {}  # parent -> its unknown keys
        messages = []
        missing = []
        for err in errors:
            if err["type"] == "extra_forbidden":
                loc = _known_prefix(err["loc"], root)
                unknown.setdefault(tuple(loc), []).append(str(err["loc"][len(loc)]))
            else:
                messages.append(_format_error(err, root))
                if err["type"] == "missing":
                    missing.append(".".join(str(x) for x in err["loc"]))
        strangers = [".".join((*parent, k)) for parent, keys in unknown.items() for k in keys]
        if len(strangers) >= 5:  # a config of another kind: say so, without every valid key
            shown = ", ".join(f"'{k}'" for k in strangers[:3])
            message = (
                f"is it a config of another kind than {root.__name__}? {len(strangers)} of its keys "
                f"are unknown to it ({shown}, ...)"
            )
            if missing:
                message += f" and it lacks {len(missing)} that it needs ('{missing[0]}', ...)"
            raise ConfigError(message) from None
        for parent, keys in unknown.items():
            model = _model_at(parent, root)
            where = f"in '{'.'.join(parent)}'" if parent else "at the top level"
            valid = ", ".join(sorted(model.model_fields)) if model else "(none)"
            named = ", ".join(f"'{'.'.join((*parent, k))}'" for k in keys)
            plural = "s" if len(keys) > 1 else ""
            messages.append(f"unknown config key{plural} {named}; valid keys {where}: {valid}")
        raise ConfigError("; ".join(dict.fromkeys(messages))) from None


def has_checkpoint(run: Path) -> bool:
    """Whether the run folder ``run`` holds a checkpoint (``checkpoints/STEP``)."""
    return any(p.name.isdigit() for p in (run / "checkpoints").glob("*"))


def resumable_config(run: Path, root: type[RootT]) -> RootT | None:
    """The config a rerun in the folder ``run`` would resume: its ``config.yaml`` as ``root``
    where it holds a checkpoint too; None where not, or where the file is of another version
    (its checkpoints then decide)."""
    if not (run / "config.yaml").is_file() or not has_checkpoint(run):
        return None
    try:
        return load_config(run / "config.yaml", (), root)
    except ConfigError:
        return None


def setting_differences(found: BaseModel, wanted: BaseModel, section: str, keep=None) -> list[str]:
    """Each field of ``section`` whose value differs (those ``keep(name)`` accepts, where
    given), as ``SECTION.NAME: FOUND there, WANTED here``."""
    return [
        f"{section}.{k}: {getattr(found, k)} there, {getattr(wanted, k)} here"
        for k in type(found).model_fields
        if getattr(found, k) != getattr(wanted, k) and (keep is None or keep(k))
    ]


def keep_config_before_changes(
    output: Path,
    found: BaseModel,
    wanted: BaseModel,
    sections: Sequence[str],
    start: int,
    write: bool = True,
    ignore: Sequence[str] = ("train.output_dir",),
) -> str | None:
    """The line to log when a run resumed at step ``start`` changes settings of ``sections``
    (fields of the root config: sections, or single values) from its saved config ``found``,
    naming them as `setting_differences` words them; None when it changes none. Where there
    are any, ``found`` is kept as ``OUTPUT/config.until-START.yaml`` before the caller rewrites
    ``config.yaml``, unless an earlier resume at the same step kept one: that one holds the
    settings steps 1..START ran with (the run since lost its later steps). ``write``: False on
    all processes but one. ``ignore``: settings not named (by default where the run is: a
    run's folder may move)."""
    changed = []
    for name in sections:
        there, here = getattr(found, name), getattr(wanted, name)
        if isinstance(there, BaseModel):
            named = lambda k, section=name: f"{section}.{k}" not in ignore  # noqa: E731
            changed += setting_differences(there, here, name, named)
        elif there != here:
            changed.append(f"{name}: {there} there, {here} here")
    if not changed:
        return None
    kept = Path(output) / f"config.until-{start}.yaml"
    if write and not kept.exists():
        kept.write_text(config_to_yaml(found))
    return (
        f"resuming with other settings than the run's: {'; '.join(changed)} (its config until "
        f"step {start} kept as {kept.name})"
    )


def config_to_yaml(config: BaseModel) -> str:
    """The resolved config as YAML, in field order."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def _load_yaml_with_base(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise ConfigError(f"config file '{path}': circular 'base' chain: {cycle}")
    if path.is_dir():
        raise ConfigError(f"config file '{path}' is a folder; give a .yaml file")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        problem = " ".join(str(e).split())
        raise ConfigError(f"config file '{path}' is not valid YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file '{path}' must contain a mapping at the top level, "
            f"got {type(data).__name__}"
        )
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"config file '{path}': 'base' must be a file name, got {base!r}")
    parent = _load_yaml_with_base(path.parent / base, (*chain, resolved))
    return _deep_merge(parent, data)


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def _apply_override(data: dict[str, Any], override: str, root: type[BaseModel]) -> None:
    key, sep, raw = override.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not p for p in parts):
        raise ConfigError(
            f"malformed override '{override}': expected KEY=VALUE, e.g. model.num_layers=4"
        )
    field = _field_at(parts, root)
    if field is not None and _is_str_field(field):
        value: Any = raw
    else:
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parts[: i + 1])
            raise ConfigError(
                f"override '{override}': config key '{prefix}' is a value, not a section"
            )
        node = child
    node[parts[-1]] = value


# ---------------------------------------------------------------------------------------------
# Error messages


def _field_at(parts: Sequence[str], root: type[BaseModel]) -> FieldInfo | None:
    """The pydantic field at a dotted path under `root`, or None if there is none."""
    model: type[BaseModel] | None = root
    field = None
    for part in parts:
        if model is None or part not in model.model_fields:
            return None
        field = model.model_fields[part]
        model = _model_class(field.annotation)
    return field


def _model_class(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _is_str_field(field: FieldInfo) -> bool:
    ann = field.annotation
    return ann is str or str in _union_args(ann)


def _union_args(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return ()


def _describe_type(annotation: Any) -> str:
    if typing.get_origin(annotation) is Annotated:
        return _describe_type(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    args = _union_args(annotation)
    if args:
        return " or ".join(_describe_type(a) for a in args)
    if annotation is type(None):
        return "null"
    if model := _model_class(annotation):
        return f"a mapping ({model.__name__})"
    return getattr(annotation, "__name__", str(annotation))


def _known_prefix(loc: Sequence[Any], root: type[BaseModel]) -> list[str]:
    """The longest prefix of an error location that is a path of fields (drops union tags)."""
    model: type[BaseModel] | None = root
    path: list[str] = []
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            break
        path.append(part)
        model = _model_class(model.model_fields[part].annotation)
    return path


def _format_error(err: Mapping[str, Any], root: type[BaseModel]) -> str:
    """One error other than an unknown key (`validate_config` groups those)."""
    kind = err["type"]
    loc = _known_prefix(err["loc"], root)
    key = ".".join(loc)
    if kind == "missing":
        return f"missing required config key '{key}'"
    msg = str(err["msg"]).removeprefix("Value error, ")
    field = _field_at(loc, root)
    if kind.startswith("value_error") or kind == "assertion_error" or field is None:
        return f"invalid config '{key or '<root>'}': {msg}"
    expected = _describe_type(field.annotation)
    return (
        f"invalid value for config key '{key}': {err.get('input')!r} (expected {expected}): {msg}"
    )


def _model_at(parts: Sequence[str], root: type[BaseModel]) -> type[BaseModel] | None:
    if not parts:
        return root
    field = _field_at(parts, root)
    return _model_class(field.annotation) if field is not None else None
