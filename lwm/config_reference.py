"""The reference of every config key (`docs/config.md`), generated from the pydantic models.

    python -m lwm.config_reference > docs/config.md

Each key's type and default come from the model's field; its meaning from the comments written
next to the field in the model's source (the line's own comment and the comment lines right
above it), and each section's from its class docstring. Nothing here adds to the models: the
page says what the code says, and `tests/test_docs.py` checks that the page is current.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

__all__ = ["field_comments", "render", "main"]

# Meanings of the keys whose field has no comment in its model, keyed "FAMILY:dotted.key"
# (FAMILY: lm or vqgan). `render` refuses a note for a key that does not exist, so a renamed
# or removed key cannot leave a stale line here.
NOTES = {
    "lm:seed": "seeds the parameter initialisation (and the other random draws of a run)",
    "lm:model.text_vocab_size": "rows of the text embedding and columns of the text head",
    "lm:model.hidden_size": "width of the residual stream",
    "lm:model.intermediate_size": "width of the SwiGLU MLP",
    "lm:model.num_layers": "transformer blocks",
    "lm:model.num_heads": "query heads",
    "lm:model.num_kv_heads": "key/value heads (fewer than num_heads: grouped-query attention)",
    "lm:model.rope_theta": "base of the rotary embedding; LWM's context stages raise it",
    "lm:model.max_seq_len": "the longest sequence; train.seq_len defaults to it",
    "lm:model.attention": "dense (reference), blockwise (flash-style, one device), or ring "
    "(blockwise, sequence sharded over the mesh's sp axis)",
    "lm:model.block_q": "query block of blockwise and ring attention",
    "lm:model.block_k": "key block of blockwise and ring attention",
    "lm:model.remat_policy": "what the backward pass keeps of each layer (jax.checkpoint "
    "policy); `attention_saveable` keeps attention's output so it is not run twice (the "
    "fastest on a TPU chip where memory allows: docs/benchmarks.md)",
    "lm:model.scan_layers": "run the layers as one lax.scan (one compiled layer)",
    "lm:model.tie_word_embeddings": "the text head shares the text embedding's weights",
    "lm:model.tie_vision_embeddings": "the vision head shares the vision embedding's weights",
    "lm:model.initializer_range": "standard deviation of the random initialisation",
    "lm:mesh.shape": "dp,fsdp,sp,tp: data, fully-sharded data, sequence and tensor parallelism",
    "lm:train.output_dir": "the run's folder: config, checkpoints, metrics; a folder that holds "
    "a run is resumed",
    "lm:train.steps": "optimizer steps in all (a resumed run continues to this)",
    "lm:train.grad_accum": "micro-batches per step",
    "lm:train.learning_rate": "peak learning rate",
    "lm:train.end_learning_rate": "learning rate at the last step of the cosine schedule",
    "lm:train.warmup_steps": "linear warmup steps",
    "lm:train.schedule": "learning rate after the warmup",
    "lm:train.weight_decay": "AdamW's decoupled weight decay (0 with muon)",
    "lm:train.b1": "Adam's first-moment decay",
    "lm:train.b2": "Adam's second-moment decay",
    "lm:train.clip_norm": "global gradient-norm clipping; null: none",
    "lm:train.text_loss_weight": "weight of the text loss in LWM's modality-balanced loss",
    "lm:train.vision_loss_weight": "weight of the vision loss in LWM's modality-balanced loss",
    "lm:train.log_every": "steps between metric lines (metrics.jsonl, TensorBoard)",
    "lm:train.fetch_every": "steps between fetches of the metrics (the loop runs that far ahead; a non-finite loss stops at the next)",
    "lm:train.save_every": "steps between checkpoints",
    "lm:train.max_to_keep": "checkpoints kept",
    "lm:train.async_save": "write checkpoints in the background",
    "lm:train.progress": "progress bar on stderr",
    "lm:data.split": "the dataset's split to read",
    "lm:data.shuffle_seed": "seeds the order of the examples in each epoch",
    "lm:eval.every": "steps between held-out evaluations (and one after the last step)",
    "lm:eval.max_new_tokens": "the most tokens an answer may have",
    "lm:eval.batch_size": "questions per generate call",
    "lm:distributed.enabled": "auto: initialise jax.distributed where a coordinator address "
    "is given or on a multi-host TPU slice; on; off",
    "lm:distributed.coordinator_address": "HOST:PORT of process 0 (or JAX_COORDINATOR_ADDRESS)",
    "lm:distributed.num_processes": "processes of the job (or JAX_NUM_PROCESSES)",
    "lm:distributed.process_id": "this process's index (or JAX_PROCESS_ID)",
    "lm:distributed.cpu_collectives": "JAX's collectives between CPU processes",
    "vqgan:seed": "seeds the initialisation and the random draws of training",
    "vqgan:model.resolution": "frame height and width the model encodes",
    "vqgan:model.num_channels": "colour channels of a frame",
    "vqgan:model.hidden_channels": "width of the first level",
    "vqgan:model.channel_mult": "each level's width as a multiple of hidden_channels",
    "vqgan:model.num_res_blocks": "residual blocks per encoder level (one more per decoder level)",
    "vqgan:model.z_channels": "channels of the encoder's output before quant_conv",
    "vqgan:model.num_embeddings": "codebook size (codes)",
    "vqgan:model.embed_dim": "dimension of a code vector",
    "vqgan:model.param_dtype": "stored parameters",
    "vqgan:quantizer.restart_dead_codes": "reset unused codes to encoder outputs of the batch",
    "vqgan:loss.recon": "reconstruction loss",
    "vqgan:loss.recon_weight": "weight of the reconstruction loss",
    "vqgan:loss.adversarial_weight": "weight of the generator's adversarial loss",
    "vqgan:loss.perceptual_weight": "weight of the perceptual loss (0: off)",
    "vqgan:discriminator.channels": "width of the first discriminator layer",
    "vqgan:discriminator.num_layers": "stride-2 layers (each halves the frame)",
    "vqgan:discriminator.num_groups": "GroupNorm groups",
    "vqgan:discriminator.learning_rate": "the discriminator's own Adam learning rate",
    "vqgan:train.output_dir": "the run's folder; a folder that holds a run is resumed",
    "vqgan:train.steps": "optimizer steps in all",
    "vqgan:train.learning_rate": "peak learning rate",
    "vqgan:train.warmup_steps": "linear warmup steps",
    "vqgan:train.schedule": "learning rate after the warmup",
    "vqgan:train.b1": "Adam's first-moment decay",
    "vqgan:train.b2": "Adam's second-moment decay",
    "vqgan:train.weight_decay": "weight decay",
    "vqgan:train.clip_norm": "global gradient-norm clipping; null: none",
    "vqgan:train.log_every": "steps between metric lines",
    "vqgan:train.eval_every": "steps between held-out evaluations and sample grids",
    "vqgan:train.save_every": "steps between checkpoints",
    "vqgan:train.max_to_keep": "checkpoints kept",
    "vqgan:train.progress": "progress bar on stderr",
    "vqgan:data.source": "synthetic videos rendered in memory, or the videos of data.manifest",
    "vqgan:data.num_frames": "synthetic: frames per video",
    "vqgan:data.needle_prob": "synthetic: share of the videos with a needle",
    "vqgan:data.seed": "synthetic: draws the videos",
    "vqgan:mesh.shape": "dp,fsdp,sp,tp; batches are sharded over dp and fsdp",
}

HEADER = """\
# Config reference

Every key of the two config families, with its type, default and meaning. Generated from the
pydantic models by `python -m lwm.config_reference > docs/config.md` (do not edit by hand;
`tests/test_docs.py` checks that this page is current).

Configs are YAML files; `base: other.yaml` inherits from another file, and any key can be
overridden on the command line as `section.key=value` (e.g. `train.steps=100
mesh.shape=1,-1,4,1`). An unknown key, a wrong type or an impossible value is one error line
naming the key. "required" means the key has no default and a config must set it.
"""


def field_comments(model: type[BaseModel]) -> dict[str, str]:
    """The comments written next to each field of ``model`` in its class body: the comment lines
    right above the field, then the field's own trailing comment (type-checker pragmas left
    out), joined into one paragraph; fields without comments are left out."""
    try:
        source = textwrap.dedent(inspect.getsource(model))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}  # line number -> comment text
    code_lines: set[int] = set()  # lines holding code
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if not text.startswith(("type:", "noqa", "pragma")):
                comments[tok.start[0]] = text
        elif tok.type not in (
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    (cls,) = ast.parse(source).body
    assert isinstance(cls, ast.ClassDef)
    found: dict[str, str] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above = []
        line = node.lineno - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        end = node.end_lineno or node.lineno
        trailing = [comments[n] for n in range(node.lineno, end + 1) if n in comments]
        text = " ".join(above + trailing).strip()
        if text:
            found[node.target.id] = text
    return found


def _constraint(meta: Any) -> str | None:
    for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        value = getattr(meta, attr, None)
        if value is not None:
            return f"{sign} {value}"
    return None


def describe_type(annotation: Any, metadata: list[Any] = ()) -> str:  # type: ignore[assignment]
    """A short, readable name of a field's type: `int > 0`, `'a' | 'b'`, `float or null`."""
    bounds = [c for m in metadata if (c := _constraint(m))]
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        inner, *extra = typing.get_args(annotation)
        nested = [m for e in extra for m in getattr(e, "metadata", [e])]
        return describe_type(inner, [*metadata, *nested])
    if origin is Literal:
        return " | ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        parts = [describe_type(a) for a in typing.get_args(annotation)]
        return " or ".join(parts)
    if origin is tuple:
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis:
            name = f"list of {describe_type(args[0])}"
        else:
            name = "[" + ", ".join(describe_type(a) for a in args) + "]"
    elif annotation is type(None):
        name = "null"
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        name = "section"
    else:
        name = getattr(annotation, "__name__", str(annotation))
    return f"{name} {', '.join(bounds)}" if bounds else name


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    if isinstance(value, str):
        return f"`{value}`"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    """One table cell: one line, pipes escaped, and ``<...>`` outside code spans kept as text."""
    pieces = " ".join(text.split()).replace("|", "\\|").split("`")
    for i in range(0, len(pieces), 2):  # outside code spans
        pieces[i] = re.sub(r"<(?=[A-Za-z/])", "&lt;", pieces[i])
    return "`".join(pieces)


def _sections(root: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    """``root`` and every section model under it, depth first, with its dotted prefix."""
    found = [(prefix, root)]
    for name, field in root.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            found += _sections(ann, f"{prefix}{name}.")
    return found


def _keys(root: type[BaseModel]) -> list[str]:
    return [f"{prefix}{name}" for prefix, model in _sections(root) for name in model.model_fields]


def render_family(title: str, intro: str, root: type[BaseModel], family: str) -> str:
    """One config family: a table per section, every key with type, default and meaning (the
    field's description or comment, else its line in `NOTES`)."""
    out = [f"## {title}", "", intro, ""]
    for prefix, model in _sections(root):
        doc = inspect.cleandoc(model.__doc__ or "")
        heading = f"`{prefix.rstrip('.')}`" if prefix else "top level"
        out += [f"### {heading}", ""]
        if doc and model.__doc__ != BaseModel.__doc__:
            out += [" ".join(doc.split()), ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        comments = field_comments(model)
        for name, field in model.model_fields.items():
            ann = field.annotation
            kind = describe_type(ann, list(field.metadata))
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                meaning = f"see `{prefix}{name}` below"
            else:
                meaning = (
                    field.description
                    or comments.get(name)
                    or NOTES.get(f"{family}:{prefix}{name}", "")
                )
            out.append(
                f"| `{prefix}{name}` | {_cell(kind)} | {_default(field)} | {_cell(meaning)} |"
            )
        out.append("")
    return "\n".join(out)


def render() -> str:
    """The whole page, `docs/config.md`."""
    from lwm.config import Config
    from vqgan.config import VQGANConfig

    known = {f"lm:{k}" for k in _keys(Config)} | {f"vqgan:{k}" for k in _keys(VQGANConfig)}
    if stale := sorted(set(NOTES) - known):
        raise ValueError(f"lwm.config_reference.NOTES names keys that do not exist: {stale}")
    parts = [
        HEADER,
        render_family(
            "The world model (`lwm.config.Config`)",
            "Read by `lwm info`, `lwm train` and the inference verbs (`--config`); the files are "
            "`configs/*.yaml`.",
            Config,
            "lm",
        ),
        render_family(
            "The VQGAN (`vqgan.config.VQGANConfig`)",
            "Read by `lwm vqgan train --config`; the files are `configs/vqgan/*.yaml`.",
            VQGANConfig,
            "vqgan",
        ),
    ]
    return "\n".join(parts).rstrip("\n") + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
