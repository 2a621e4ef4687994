"""The language model's config: the model, the mesh, and the sections of `lwm train`, `lwm
eval` and friends (`Config`), loaded from YAML by the base's `lwm.base.config.load_config`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from data.batches import QA_CHAINED_SHARE, QA_TURNS
from data.tokens import EOV_ID, NUM_CODES, VISION_VOCAB_SIZE
from lwm.base import config as base_config
from lwm.base.config import (
    ConfigError,
    DistributedConfig,
    MeshConfig,
    PositiveFloat,
    PositiveInt,
    Precision,
    config_to_yaml,
)

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
    "validate_config",
]

DType = Literal["float32", "bfloat16", "float16"]
RematPolicy = Literal[
    "none",
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "attention_saveable",
    "attention_dots_saveable",
    "everything_saveable",
]


class ModelConfig(BaseModel):
    """LLaMA-style transformer with separate text and vision embeddings and heads (as in LWM).

    Frozen (and so hashable): the model keeps it as static structure under `jax.jit`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text_vocab_size: PositiveInt = 32000
    vision_vocab_size: PositiveInt = VISION_VOCAB_SIZE  # codes and the <eof>/<eov> markers
    # The vision head scores only codes 0..vision_codes-1 and the <eof>/<eov> markers (a VQGAN
    # with that many codes never produces the others); 0: the whole vision vocabulary. The
    # parameters keep their full size (LWM's checkpoints load either way).
    vision_codes: Annotated[int, Field(ge=0)] = 0
    # (rows, cols) of the VQGAN's code grid: each vision code gets a learned embedding of its
    # row and its column in the frame (`data.tokens.frame_cells`) added to its code embedding,
    # so the model knows where a code sits without decoding it from rotary positions. None: off
    # (as LWM, whose checkpoints have no such table).
    vision_grid: tuple[PositiveInt, PositiveInt] | None = None
    # With vision_grid: each code also gets a learned embedding of the code of each of its
    # causal neighbours in the frame (`data.tokens.window_offsets`: radius codes to the left,
    # 2 * radius + 1 above in each of radius rows), one table per offset: a causal convolution
    # over the frame, so an object's shape is local to its codes from the first layer. 0: off.
    vision_window: Annotated[int, Field(ge=0)] = 0
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_layers: PositiveInt
    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt | None = None  # None: hidden_size // num_heads (filled in on validation)
    rope_theta: PositiveFloat = 10000.0
    # Rotary embedding on the first rope_dims of each head's dimensions only (partial rotary,
    # as GPT-NeoX's rotary_pct): the rest carry no position, so a query can match a key by
    # content alone at any distance. None: every dimension (LLaMA, LWM; their checkpoint
    # formats have no such setting, and export refuses a model with it).
    rope_dims: PositiveInt | None = None
    max_seq_len: PositiveInt
    # 1e-5 as Hugging Face's Llama-2 configs; LWM's own models use 1e-6 (`configs/7b.yaml`):
    # give that when loading LWM's weights with a config of your own.
    rms_norm_eps: PositiveFloat = 1e-5
    dtype: DType = "float32"  # activations / compute
    param_dtype: DType = "float32"  # stored parameters
    attention: Literal["dense", "blockwise", "ring"] = "blockwise"
    # The block kernel of blockwise and ring attention: XLA, Pallas (TPU; interpreted, slowly,
    # elsewhere), cuDNN's flash attention (NVIDIA GPUs; a dense stand-in elsewhere, for tests)
    # or auto (Pallas on TPUs, cuDNN on GPUs, XLA elsewhere). `lwm.attention.blockwise.KERNELS`.
    attention_kernel: Literal["xla", "pallas", "cudnn", "auto"] = "auto"
    block_q: PositiveInt = 512
    block_k: PositiveInt = 512
    remat_policy: RematPolicy = "nothing_saveable"
    # Keep each layer's input (what the remat recomputes the layer from) in the host's memory
    # between the forward and the backward pass instead of on the device: long context on few
    # chips, for host-device copies. Needs a remat_policy other than none.
    offload_layer_inputs: bool = False
    # The rotary embedding's arithmetic: float32 (LWM's), or the compute dtype (as MaxText):
    # with bfloat16 compute, no float32 copies of q and k (4.4 GiB of the 570M model's 128K
    # step on one chip), for one bfloat16 rounding of the angles' cos and sin.
    rope_dtype: Literal["float32", "compute"] = "float32"
    # Float32 matrix products (jax.default_matmul_precision) in the model's layers, head and XLA
    # attention: on TPUs "default" is one bfloat16 pass, "high" three, "highest" float32-exact
    # as on CPUs. The Pallas attention kernel keeps its own. Only float32 models are affected.
    matmul_precision: Precision = "default"
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
        if self.vision_vocab_size <= EOV_ID:
            raise ValueError(
                f"vision_vocab_size ({self.vision_vocab_size}) must exceed the <eov> id {EOV_ID}: "
                "the vision vocabulary holds the codes and the <eof>/<eov> markers "
                "(data.tokens)"
            )
        if self.vision_window and self.vision_grid is None:
            raise ValueError("vision_window needs vision_grid (the code grid it runs over)")
        if self.offload_layer_inputs and self.remat_policy == "none":
            raise ValueError(
                "offload_layer_inputs needs a remat_policy other than none (the layer inputs "
                "it offloads are what the remat recomputes from)"
            )
        if self.vision_grid is not None and self.vision_window >= self.vision_grid[1]:
            raise ValueError(
                f"vision_window ({self.vision_window}) must be below the grid's "
                f"{self.vision_grid[1]} columns"
            )
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
        if self.rope_dims is not None and (self.rope_dims > self.head_dim or self.rope_dims % 2):
            raise ValueError(
                f"rope_dims ({self.rope_dims}) must be even and at most head_dim ({self.head_dim})"
            )
        return self

    @property
    def codes_read(self) -> int:
        """The vision codes the model reads and its vision head scores: ``vision_codes``, or
        every code of the vision vocabulary when that is 0."""
        return self.vision_codes or NUM_CODES

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


# `TrainConfig.optimizer`, `lwm.train_step.make_optimizer`
OPTIMIZERS = ("adamw", "muon")


def optimizer_problem(optimizer: str, weight_decay: float) -> str | None:
    """Why ``optimizer`` with ``weight_decay`` cannot train (one line), or None."""
    if optimizer not in OPTIMIZERS:
        return f"unknown optimizer '{optimizer}'; choose one of {', '.join(OPTIMIZERS)}"
    if optimizer == "muon" and weight_decay:
        return (
            "train.weight_decay is not supported with train.optimizer=muon (optax's Muon would "
            "decay the norms too); set train.weight_decay=0"
        )
    return None


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
    # "adamw"; or "muon": Muon on the transformer blocks' matrices, AdamW on the rest
    # (`lwm.train_step.make_optimizer`)
    optimizer: Literal[OPTIMIZERS] = "adamw"  # type: ignore[valid-type]
    clip_norm: PositiveFloat | None = 1.0
    # Keep the optimizer state (AdamW's two moments: twice the float32 parameters) in pinned
    # host memory between steps; each step moves it to the device for the update only, so the
    # forward and backward passes have that much more device memory (two transfers of the
    # state per step; for long sequences on few chips, `docs/long-context.md`)
    offload_optimizer: bool = False
    text_loss_weight: Annotated[float, Field(ge=0)] = 0.5
    vision_loss_weight: Annotated[float, Field(ge=0)] = 0.5
    init_from: str | None = None  # hf:DIR, lwm:PATH (params::PATH), orbax:DIR
    # A fresh model's vision code embeddings: "random" (normal, model.initializer_range), or
    # "codebook": each code's vector in the codebook of the VQGAN that tokenized data.source,
    # standardised and projected to hidden_size at the same scale, so that codes which look
    # alike start alike (lwm.train.codebook_embeddings); not applied with init_from
    vision_embed_init: Literal["random", "codebook"] = "random"
    log_every: PositiveInt = 10
    # Fetch the metrics of the steps dispatched so far every this many steps (and at every
    # logged step, checkpoint and evaluation), in one transfer: the loop dispatches that many
    # steps ahead of the devices instead of waiting for each step's loss. A non-finite loss
    # stops the run at the next fetch (before any checkpoint is written); 1: after every step
    fetch_every: PositiveInt = 10
    save_every: PositiveInt = 100
    max_to_keep: PositiveInt = 3
    async_save: bool = True
    peak_flops: Literal["auto"] | PositiveFloat = "auto"  # per device, for MFU
    progress: bool = True
    # A trace of `profile_steps` steps from step `profile_start` (jax.profiler: the devices'
    # kernels and the host's threads) in OUTPUT/profile, for TensorBoard's profile plugin or
    # Perfetto (its perfetto_trace.json.gz); 0 steps = none
    profile_start: PositiveInt = 5
    profile_steps: Annotated[int, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _check_optimizer(self) -> TrainConfig:
        if problem := optimizer_problem(self.optimizer, self.weight_decay):
            raise ValueError(problem)
        return self


class DataConfig(BaseModel):
    """Where training batches come from: a dataset written by `lwm tokenize`, or synthetic."""

    model_config = ConfigDict(extra="forbid")

    source: str = "synthetic"  # "synthetic" or the path of a tokenized dataset
    split: str = "train"
    shuffle_seed: int = 0
    pack: bool = True  # pack documents into sequences (else pad each)
    # batches read and packed ahead of the step by grain, in this many threads (0: no grain,
    # each batch is read when the step asks for it)
    read_threads: Annotated[int, Field(ge=0)] = 2
    prefetch: PositiveInt = 4  # batches read ahead
    # Read and pack in this many worker processes (grain's mp_prefetch, each with read_threads
    # threads) instead of threads of the training process (0: threads): for reading that is
    # itself slow (large records, remote files); the batches then cross a process boundary,
    # which on a TPU chip slowed the demo's short steps
    read_processes: Annotated[int, Field(ge=0)] = 0
    # batches made ready on the devices (read, packed, transferred, their rows' order checked)
    # ahead of the step that takes them, by a thread beside the training loop
    # (`lwm.train.BatchPrefetch`)
    device_prefetch: PositiveInt = 2
    # How the turns of a QA record see each other (`data.batches.QA_TURNS`): "chained", each
    # after the turns before it (LWM's records); "isolated", each sees only the record's video
    # and itself, right after the video, as `lwm ask` asks a question (a dataset source only);
    # "mixed", each epoch a drawn share `qa_chained_share` of the records chained (as `lwm chat`
    # asks its later turns) and the others isolated.
    qa_turns: Literal[QA_TURNS] = "chained"  # type: ignore[valid-type]
    qa_chained_share: Annotated[float, Field(ge=0, le=1)] = QA_CHAINED_SHARE  # with mixed

    @model_validator(mode="after")
    def _qa_turns_need_a_dataset(self) -> DataConfig:
        if self.qa_turns != "chained" and self.source == "synthetic":
            raise ValueError(
                f"qa_turns {self.qa_turns} needs a dataset written by `lwm tokenize` as "
                "data.source (the synthetic source has no QA turns)"
            )
        return self


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


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Load a language-model config file (following `base:` links) with `a.b=value` overrides."""
    return base_config.load_config(path, overrides, Config)


def validate_config(data: Mapping[str, Any]) -> Config:
    """Validate a plain dict into `Config` (one `ConfigError` naming the keys at fault)."""
    return base_config.validate_config(data, Config)
