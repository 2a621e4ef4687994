"""Build the project's default text tokenizer (``data/tokenizer/``) offline.

A byte-level BPE (GPT-2 style: every byte sequence is representable, no unknown token) with
4,096 entries, matching ``configs/tiny.yaml``'s ``text_vocab_size``. It is trained with the
``tokenizers`` library on text that is on every machine running this project: the captions
and questions of the synthetic videos (`data.synthetic`, many seeds) and the docstrings of the
Python standard library. The result is a Hugging Face tokenizer folder that
``transformers.AutoTokenizer.from_pretrained`` loads:

- ``<s>`` (BOS, added at the start when ``add_special_tokens=True``, as LLaMA's tokenizer
  does), ``</s>`` (EOS), ``<pad>``;
- ``<vision>`` and ``</vision>``: the vision markers, each one token.

    python tools/build_text_tokenizer.py            # writes data/tokenizer/
    python tools/build_text_tokenizer.py --out /tmp/tok --vocab-size 8192

Deterministic: the corpus is read in a sorted order and the BPE trainer is deterministic.
"""

from __future__ import annotations

import argparse
import ast
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<vision>", "</vision>"]
# the 256 bytes of the byte-level alphabet and the special tokens, before any merge
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


def synthetic_texts(videos: int = 4000) -> Iterator[str]:
    """Captions and question/answer pairs of synthetic videos (several sizes and seeds)."""
    from data.synthetic import sample_video

    for i in range(videos):
        spec = sample_video(seed=i % 7, index=i, size=64, num_frames=8 + i % 9)
        yield spec.caption
        for qa in spec.qa:
            yield f"USER: {qa['question']} ASSISTANT: {qa['answer']}"


def stdlib_docstrings() -> Iterator[str]:
    """Docstrings of the standard library's Python modules (sorted by path)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts)
        if parts & {"site-packages", "test", "tests", "idlelib", "lib2to3"}:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc


def build(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def corpus() -> Iterator[str]:
        # The captions are short and repetitive: repeat them so their words become tokens.
        texts = list(synthetic_texts())
        yield from texts * 3
        yield from stdlib_docstrings()

    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<vision>", "</vision>"],
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    print(f"wrote {out} ({tokenizer.get_vocab_size()} tokens)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "data" / "tokenizer",
        help="folder to write the tokenizer to (default data/tokenizer/)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=4096,
        help=f"entries in the vocabulary, at least {MIN_VOCAB_SIZE} (256 bytes + "
        f"{len(SPECIAL_TOKENS)} special tokens; default 4096)",
    )
    args = parser.parse_args(argv)
    if args.vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"--vocab-size {args.vocab_size} is below {MIN_VOCAB_SIZE}, the 256 bytes and "
            f"{len(SPECIAL_TOKENS)} special tokens every vocabulary holds"
        )
    build(args.out, args.vocab_size)
    return 0


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("build_text_tokenizer", main, also=(ValueError,)))
