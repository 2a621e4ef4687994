"""Plot an `lwm train` run: losses and held-out QA accuracy per category against steps (PNG).

    python tools/plot_run.py runs/demo/lm                 # writes runs/demo/lm/run.png
    python tools/plot_run.py runs/demo/lm --out run.png

Reads ``RUN/metrics.jsonl``: training lines (loss, text_loss, vision_loss) and, when the run
evaluated held-out questions (``eval.manifest``), its ``"split": "eval"`` lines: the model's
accuracy per category (solid), its overall accuracy with the videos swapped and the blind
baseline (dashed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="an lwm train output folder")
    p.add_argument("--out", help="PNG to write (default: RUN/run.png)")
    args = p.parse_args(argv)
    path = Path(args.run) / "metrics.jsonl"
    if not path.is_file():
        print(
            f"plot_run: error: '{path}' not found (is '{args.run}' an lwm train run?)",
            file=sys.stderr,
        )
        return 2
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("split", "train") == "train"]
    # held-out QA (an lwm vqgan train run has eval rows of its own: left out)
    evals = [r for r in rows if r.get("split") == "eval" and "model_accuracy" in r]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if evals else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    for key, style in (("loss", "-"), ("text_loss", "--"), ("vision_loss", ":")):
        points = [(r["step"], r[key]) for r in train if key in r]
        if points:
            ax.plot(*zip(*points, strict=True), style, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax.legend()
    ax.grid(alpha=0.3)
    if evals:
        ax = axes[0][1]
        steps = [r["step"] for r in evals]
        categories = sorted(
            {k.removeprefix("model_accuracy_") for r in evals for k in r}
            - {k for r in evals for k in r if not k.startswith("model_accuracy_")}
        )
        for cat in categories:
            ax.plot(steps, [r.get(f"model_accuracy_{cat}") for r in evals], "-o", ms=3, label=cat)
        ax.plot(steps, [r["model_accuracy"] for r in evals], "-o", color="black", lw=2, label="all")
        for key, label, colour in (
            ("swapped_accuracy", "all, videos swapped", "tab:red"),
            ("blind_accuracy", "all, blind baseline", "tab:gray"),
        ):
            if all(key in r for r in evals):
                ax.plot(steps, [r[key] for r in evals], "--", color=colour, label=label)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("step")
        ax.set_ylabel("exact-match accuracy")
        ax.set_title("held-out QA accuracy")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(str(args.run))
    fig.tight_layout()
    out = Path(args.out) if args.out else Path(args.run) / "run.png"
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(out)
    print(out)
    return 0


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("plot_run", main, also=(ValueError,)))
