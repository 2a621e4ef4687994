"""Typed, validated configuration: YAML files with `base:` inheritance and `key=value` overrides."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, overload

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

__all__ = [
    "Config",
    "DataConfig",
    "DistributedConfig",
    "EvalConfig",
    "TrainConfig",
    "ConfigError",
    "MeshConfig",
    "ModelConfig",
    "config_to_yaml",
    "load_config",
]

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
DType = Literal["float32", "bfloat16", "float16"]
RematPolicy = Literal[
    "none",
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
]


class ConfigError(ValueError):
    """A config file, override or value is invalid; the message names the key and the problem."""


class ModelConfig(BaseModel):
    """LLaMA-style transformer with separate text and vision embeddings and heads (as in LWM).

    Frozen (and so hashable): the model keeps it as static structure under `jax.jit`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text_vocab_size: PositiveInt = 32000
    vision_vocab_size: PositiveInt = 8448
    # The vision head scores only codes 0..vision_codes-1 and the <eof>/<eov> markers (a VQGAN
    # with that many codes never produces the others); 0: the whole vision vocabulary. The
    # parameters keep their full size (LWM's checkpoints load either way).
    vision_codes: Annotated[int, Field(ge=0)] = 0
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_layers: PositiveInt
    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt | None = None  # None: hidden_size // num_heads (filled in on validation)
    rope_theta: PositiveFloat = 10000.0
    max_seq_len: PositiveInt
    rms_norm_eps: PositiveFloat = 1e-5
    dtype: DType = "float32"  # activations / compute
    param_dtype: DType = "float32"  # stored parameters
    attention: Literal["dense", "blockwise", "ring"] = "blockwise"
    block_q: PositiveInt = 512
    block_k: PositiveInt = 512
    remat_policy: RematPolicy = "nothing_saveable"
    scan_layers: bool = True
    mlp_chunk_size: Annotated[int, Field(ge=0)] = 0  # 0 = unchunked
    logits_chunk_size: Annotated[int, Field(ge=0)] = 0  # loss: tokens per logits chunk, 0 = all
    # Loss: the text head only at the first N positions of each row that have a text target
    # (0 = at every position). Where few are trained (answers after a video, captions) this
    # skips most of the text head's work; a row with more text targets than N is counted in
    # the `targets_dropped` metric, and `lwm train` stops.
    loss_positions: Annotated[int, Field(ge=0)] = 0
    tie_word_embeddings: bool = False
    tie_vision_embeddings: bool = False
    initializer_range: PositiveFloat = 0.02
    zigzag: bool = True  # load-balanced sequence layout for ring attention

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_heads "
                    f"({self.num_heads}) when head_dim is not given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        return self

    @property
    def num_kv_groups(self) -> int:
        """Query heads per K/V head (1 = multi-head attention, >1 = grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        """Width of the concatenated query heads."""
        assert self.head_dim is not None
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the concatenated key (or value) heads."""
        assert self.head_dim is not None
        return self.num_kv_heads * self.head_dim


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


class TrainConfig(BaseModel):
    """`lwm train`: optimisation, checkpoints and logging. Defaults of the 7B configs are LWM's."""

    model_config = ConfigDict(extra="forbid")

    output_dir: str = "runs/default"
    steps: PositiveInt = 1000
    batch_size: PositiveInt = 8  # global, in sequences
    seq_len: PositiveInt | None = None  # None: model.max_seq_len
    grad_accum: PositiveInt = 1
    learning_rate: PositiveFloat = 3e-4
    end_learning_rate: Annotated[float, Field(ge=0)] = 0.0
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    schedule: Literal["cosine", "constant"] = "cosine"
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: PositiveFloat | None = 1.0
    text_loss_weight: Annotated[float, Field(ge=0)] = 0.5
    vision_loss_weight: Annotated[float, Field(ge=0)] = 0.5
    init_from: str | None = None  # hf:DIR, lwm:PATH (params::PATH), orbax:DIR
    log_every: PositiveInt = 10
    save_every: PositiveInt = 100
    max_to_keep: PositiveInt = 3
    async_save: bool = True
    peak_flops: Literal["auto"] | PositiveFloat = "auto"  # per device, for MFU
    progress: bool = True


class DataConfig(BaseModel):
    """Where training batches come from: a dataset written by `lwm tokenize`, or synthetic."""

    model_config = ConfigDict(extra="forbid")

    source: str = "synthetic"  # "synthetic" or the path of a tokenized dataset
    split: str = "train"
    shuffle_seed: int = 0
    pack: bool = True  # pack documents into sequences (else pad each)


class EvalConfig(BaseModel):
    """Held-out question answering during `lwm train` (`lwm.qa_eval`): every ``every`` steps
    and after the last, per category, with the video-swap ablation and the blind baseline."""

    model_config = ConfigDict(extra="forbid")

    manifest: str | None = None  # QA manifest of held-out videos; None: no evaluation
    every: PositiveInt = 100
    train_manifest: str | None = None  # blind baseline; None: the dataset's input manifest
    vqgan: str | None = None  # None: the VQGAN named in the dataset's metadata
    swap: bool = True  # also ask every question about another video
    max_new_tokens: PositiveInt = 16
    batch_size: PositiveInt = 32


class DistributedConfig(BaseModel):
    """`jax.distributed` for many hosts; unset fields come from the environment (or TPU)."""

    model_config = ConfigDict(extra="forbid")

    enabled: Literal["auto", "on", "off"] = "auto"
    coordinator_address: str | None = None
    num_processes: PositiveInt | None = None
    process_id: Annotated[int, Field(ge=0)] | None = None
    cpu_collectives: Literal["gloo", "mpi", "none"] = "gloo"


class Config(BaseModel):
    """Root config: the model, the device mesh, and the sections of each command."""

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    seed: int = 0


# ---------------------------------------------------------------------------------------------
# Loading


RootT = TypeVar("RootT", bound=BaseModel)


@overload
def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config: ...
@overload
def load_config(path: str | Path, overrides: Sequence[str], root: type[RootT]) -> RootT: ...
def load_config(
    path: str | Path, overrides: Sequence[str] = (), root: type[BaseModel] = Config
) -> BaseModel:
    """Load a YAML config (following `base:` links), apply `a.b=value` overrides, validate.

    `root` is the config class of the file (default `Config`; e.g. `vqgan.config.VQGANConfig`)."""
    data = _load_yaml_with_base(Path(path), ())
    for override in overrides:
        _apply_override(data, override, root)
    return validate_config(data, root)


@overload
def validate_config(data: Mapping[str, Any]) -> Config: ...
@overload
def validate_config(data: Mapping[str, Any], root: type[RootT]) -> RootT: ...
def validate_config(data: Mapping[str, Any], root: type[BaseModel] = Config) -> BaseModel:
    """Validate a plain dict into `root`, turning pydantic errors into one `ConfigError`."""
    try:
        return root.model_validate(data)
    except ValidationError as e:
        raise ConfigError("; ".join(_format_error(err, root) for err in e.errors())) from None


def config_to_yaml(config: BaseModel) -> str:
    """The resolved config as YAML, in field order."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def _load_yaml_with_base(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise ConfigError(f"config file '{path}': circular 'base' chain: {cycle}")
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


def _apply_override(data: dict[str, Any], override: str, root: type[BaseModel] = Config) -> None:
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


def _field_at(parts: Sequence[str], root: type[BaseModel] = Config) -> FieldInfo | None:
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


def _known_prefix(loc: Sequence[Any], root: type[BaseModel] = Config) -> list[str]:
    """The longest prefix of an error location that is a path of fields (drops union tags)."""
    model: type[BaseModel] | None = root
    path: list[str] = []
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            break
        path.append(part)
        model = _model_class(model.model_fields[part].annotation)
    return path


def _format_error(err: Mapping[str, Any], root: type[BaseModel] = Config) -> str:
    kind = err["type"]
    loc = _known_prefix(err["loc"], root)
    if kind == "extra_forbidden":
        loc.append(str(err["loc"][len(loc)]))
    key = ".".join(loc)
    if kind == "extra_forbidden":
        parent = _model_at(loc[:-1], root)
        where = f"in '{'.'.join(loc[:-1])}'" if len(loc) > 1 else "at the top level"
        valid = ", ".join(sorted(parent.model_fields)) if parent else "(none)"
        return f"unknown config key '{key}'; valid keys {where}: {valid}"
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


def _model_at(parts: Sequence[str], root: type[BaseModel] = Config) -> type[BaseModel] | None:
    if not parts:
        return root
    field = _field_at(parts, root)
    return _model_class(field.annotation) if field is not None else None
