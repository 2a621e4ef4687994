"""QA evaluation: per-category scores, the blind baseline and the video-swap ablation on
hand-made manifests whose every number is known in advance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lwm.cli import main as lwm
from lwm.qa_eval import (
    Answer,
    BlindBaseline,
    QAReport,
    Question,
    evaluate,
    normalise,
    read_questions,
    swap_videos,
)


def _manifest(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _qa(q: str, a: str, cat: str | None = None) -> dict:
    return {"question": q, "answer": a, **({"category": cat} if cat else {})}


# Three held-out videos; the colour differs in each, the count is "one" in all.
HELD_OUT = [
    {
        "video": "a.mp4",
        "qa": [_qa("What colour?", "red", "colour"), _qa("How many?", "one", "count")],
    },
    {
        "video": "b.mp4",
        "qa": [_qa("What colour?", "blue", "colour"), _qa("How many?", "one", "count")],
    },
    {"video": "c.mp4", "text": "a caption line has no questions"},
    {"video": "c.mp4", "qa": [_qa("What colour?", "green", "colour"), _qa("Odd one?", "yes")]},
]
# Training answers: "blue" is the most frequent colour (3 of 5), "one" the only count; "Odd
# one?" is never asked in training, so it falls back to its category ("other": none) and then
# to the most frequent answer overall: "one" and "blue" (3 of 9 each) tie, and "one" was seen
# first.
TRAIN = [
    {
        "video": "t1.mp4",
        "qa": [_qa("What colour?", "red", "colour"), _qa("How many?", "one", "count")],
    },
    {
        "video": "t2.mp4",
        "qa": [_qa("What colour?", "Blue.", "colour"), _qa("How many?", "one", "count")],
    },
    {
        "video": "t3.mp4",
        "qa": [_qa("What colour?", "blue", "colour"), _qa("How many?", "two", "count")],
    },
    {"video": "t4.mp4", "qa": [_qa("What colour?", "blue", "colour")]},
    {
        "video": "t5.mp4",
        "qa": [_qa("What colour?", "green", "colour"), _qa("How many?", "one", "count")],
    },
]


@pytest.fixture
def held_out(tmp_path: Path) -> list[Question]:
    return read_questions(_manifest(tmp_path / "held_out.jsonl", HELD_OUT))


def test_read_questions_keeps_order_paths_and_categories(tmp_path: Path, held_out):
    assert [(Path(q.video).name, q.question, q.answer, q.category) for q in held_out] == [
        ("a.mp4", "What colour?", "red", "colour"),
        ("a.mp4", "How many?", "one", "count"),
        ("b.mp4", "What colour?", "blue", "colour"),
        ("b.mp4", "How many?", "one", "count"),
        ("c.mp4", "What colour?", "green", "colour"),
        ("c.mp4", "Odd one?", "yes", "other"),
    ]
    assert all(Path(q.video).is_absolute() for q in held_out)
    with pytest.raises(ValueError, match="has no questions"):
        read_questions(_manifest(tmp_path / "captions.jsonl", [HELD_OUT[2]]))


def test_blind_baseline_answers_the_most_frequent_training_answer(tmp_path: Path, held_out):
    blind = BlindBaseline.from_manifest(_manifest(tmp_path / "train.jsonl", TRAIN))
    assert [blind.answer(q) for q in held_out] == ["blue", "one", "blue", "one", "blue", "one"]
    # Ties go to the answer seen first; an unseen question falls back to its category.
    tie = BlindBaseline([Question("v", "Q?", "x", "k"), Question("v", "Q?", "y", "k")])
    assert tie.answer(Question("w", "Q?", "?", "k")) == "x"
    assert tie.answer(Question("w", "Other?", "?", "k")) == "x"


def test_swap_is_a_derangement_of_the_videos():
    assert swap_videos(["a", "a", "b", "c", "b"]) == {"a": "b", "b": "c", "c": "a"}
    with pytest.raises(ValueError, match="at least two videos"):
        swap_videos(["a", "a"])


def test_normalise():
    assert normalise("  A  Red circle. ") == "a red circle"
    assert normalise("Blue.") == normalise("blue")


def _truth(questions):
    return {(q.video, q.question): q.answer for q in questions}


def test_a_model_that_reads_the_video_drops_when_the_videos_are_swapped(tmp_path, held_out):
    truth = _truth(held_out)
    blind = BlindBaseline.from_manifest(_manifest(tmp_path / "train.jsonl", TRAIN))

    def seeing(pairs):  # answers what the shown video really shows
        return [Answer(truth.get(p, "no such question")) for p in pairs]

    scores = evaluate(held_out, seeing, blind=blind).scores()
    assert scores["model"] == {"colour": (3, 3), "count": (2, 2), "other": (1, 1), "all": (6, 6)}
    assert scores["swapped"] == {"colour": (0, 3), "count": (1, 2), "other": (0, 1), "all": (1, 6)}
    assert scores["blind"] == {"colour": (1, 3), "count": (2, 2), "other": (0, 1), "all": (3, 6)}


def test_swap_shows_the_next_video_and_scores_against_the_original(held_out):
    truth = _truth(held_out)
    asked = []

    def seeing(pairs):
        asked.extend(pairs)
        return [Answer(truth.get(p, "no such question")) for p in pairs]

    report = evaluate(held_out, seeing)
    a, b, c = (q.video for q in held_out[::2])
    swapped = [r for r in report.records if r["condition"] == "swapped"]
    assert [r["shown"] for r in swapped] == [b, b, c, c, a, a]
    assert [r["video"] for r in swapped] == [a, a, b, b, c, c]
    # Scored against the original video: colours never match, "one" matches twice, and the
    # "Odd one?" question asked about a.mp4 gets "no such question".
    assert [r["correct"] for r in swapped] == [False, True, False, False, False, False]
    assert report.scores()["swapped"]["all"] == (1, 6)
    assert report.conditions == ("model", "swapped")  # no blind baseline given


def test_a_model_that_ignores_the_video_scores_the_same_swapped(held_out):
    def blind_model(pairs):  # always the same answer per question
        return [
            Answer({"What colour?": "blue", "How many?": "one"}.get(q, "yes")) for _, q in pairs
        ]

    report = evaluate(held_out, blind_model)
    assert report.accuracy("model") == report.accuracy("swapped") == pytest.approx(4 / 6)


def test_cut_answers_are_wrong_and_counted(held_out):
    truth = _truth(held_out)

    def run_on(pairs):
        return [Answer(truth[p], cut=(i == 0)) for i, p in enumerate(pairs)]

    report = evaluate(held_out, run_on, swap=False)
    assert report.scores()["model"]["all"] == (5, 6)
    assert report.cut("model") == 1
    assert "cut (no end within the token budget, scored wrong): model 1" in report.table()
    summary = report.summary()
    assert summary["model"]["all"] == {"correct": 5, "questions": 6, "accuracy": 0.8333}
    assert summary["cut"] == {"model": 1}


def test_table_lists_every_category_and_condition(tmp_path, held_out):
    truth = _truth(held_out)
    blind = BlindBaseline.from_manifest(_manifest(tmp_path / "train.jsonl", TRAIN))
    report = evaluate(
        held_out, lambda pairs: [Answer(truth.get(p, "")) for p in pairs], blind=blind
    )
    lines = report.table().splitlines()
    assert lines[0].split() == ["category", "model", "swapped", "blind"]
    assert [line.split()[0] for line in lines[2:6]] == ["colour", "count", "other", "all"]
    assert lines[2].split()[1:] == ["3/3", "100%", "0/3", "0%", "1/3", "33%"]
    assert lines[-1] == f"blind: most frequent answer per question in {tmp_path / 'train.jsonl'}"
    out = tmp_path / "qa.jsonl"
    report.write_jsonl(out)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 3 * 6 + 1 and lines[-1]["summary"] == "qa"
    again = QAReport.read_jsonl(out)
    assert again.table() == report.table() and again.summary() == report.summary()
    (tmp_path / "bad.jsonl").write_text('{"condition": "model"}\n')
    with pytest.raises(ValueError, match="not a QA report"):
        QAReport.read_jsonl(tmp_path / "bad.jsonl")


def test_eval_qa_bad_input_is_one_line(tmp_path, capsys):
    """Each manifest missing is named by its flag, before the model loads."""
    qa = ["eval", "qa", "--model", f"run:{tmp_path}"]
    assert lwm([*qa, "--manifest", str(tmp_path / "no.jsonl")]) == 2
    assert (
        capsys.readouterr().err
        == f"lwm eval: error: --manifest '{tmp_path / 'no.jsonl'}' not found\n"
    )
    (tmp_path / "m.jsonl").write_text("")
    train = ["--train-manifest", str(tmp_path / "t.jsonl")]
    assert lwm([*qa, "--manifest", str(tmp_path / "m.jsonl"), *train]) == 2
    assert capsys.readouterr().err == (
        f"lwm eval: error: --train-manifest '{tmp_path / 't.jsonl'}' not found\n"
    )
    # questions about one video: no other to swap in (it failed after every answer)
    turn = {"question": "How many?", "answer": "two", "category": "count"}
    (tmp_path / "one.jsonl").write_text(json.dumps({"video": "a.mp4", "qa": [turn]}))
    assert lwm([*qa, "--manifest", str(tmp_path / "one.jsonl")]) == 2
    assert "asks about one video; the video-swap ablation needs two" in capsys.readouterr().err


def test_plot_run_draws_loss_and_accuracy_per_category(tmp_path, monkeypatch):
    """tools/plot_run.py draws every training loss and every held-out accuracy of
    metrics.jsonl, each against its steps, in two panels: the lines of the figure it saves
    hold exactly the values written here."""
    import importlib.util
    import subprocess
    import sys

    from matplotlib.figure import Figure
    from PIL import Image

    run = tmp_path / "run"
    run.mkdir()
    lines = [
        {"step": s, "loss": 3.0 / s, "text_loss": 2.0 / s, "vision_loss": 4.0 / s}
        for s in (1, 2, 3)
    ]
    for step, colour, count in ((2, 0.25, 0.5), (3, 0.4, 0.9)):
        lines.append(
            {
                "step": step,
                "split": "eval",
                "model_accuracy": (colour + count) / 2,
                "model_accuracy_colour": colour,
                "model_accuracy_count": count,
                "swapped_accuracy": colour / 2,
                "blind_accuracy": 0.3,
            }
        )
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    root = Path(__file__).resolve().parents[1]
    script = root / "tools" / "plot_run.py"
    spec = importlib.util.spec_from_file_location("plot_run", script)
    plot_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_run)
    saved, savefig = [], Figure.savefig

    def keep(fig, *args, **kwargs):
        saved.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    assert plot_run.main([str(run)]) == 0
    (fig,) = saved
    panels = [
        {line.get_label(): line.get_xydata().tolist() for line in ax.get_lines()} for ax in fig.axes
    ]
    assert panels == [
        {
            "loss": [[1, 3.0], [2, 1.5], [3, 1.0]],
            "text_loss": [[1, 2.0], [2, 1.0], [3, 2.0 / 3]],
            "vision_loss": [[1, 4.0], [2, 2.0], [3, 4.0 / 3]],
        },
        {
            "colour": [[2, 0.25], [3, 0.4]],
            "count": [[2, 0.5], [3, 0.9]],
            "all": [[2, 0.375], [3, 0.65]],
            "all, videos swapped": [[2, 0.125], [3, 0.2]],
            "all, blind baseline": [[2, 0.3], [3, 0.3]],
        },
    ]
    with Image.open(run / "run.png") as image:
        assert image.size[0] > 2 * image.size[1] > 0  # the two panels side by side
    missing = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2
    assert missing.stderr.strip() == (
        f"plot_run: error: '{tmp_path / 'nothing' / 'metrics.jsonl'}' not found "
        f"(is '{tmp_path / 'nothing'}' an lwm train run?)"
    )


def test_percentages_round_halves_up() -> None:
    """The tables' percentages: 5 of 40 and 11 of 40 are 13% and 28% (Python's rounding of
    halves to even printed 12% and 28%), 57 of 200 is 29% (its float is 28.4999...)."""
    from lwm.base.metrics import percent

    cases = [(5, 40), (11, 40), (57, 200), (1, 8), (0, 3), (2, 3), (3, 3)]
    assert [percent(a / n) for a, n in cases] == [13, 28, 29, 13, 0, 67, 100]
    records = [
        {"condition": "model", "category": "colour", "correct": i < 5, "cut": False}
        for i in range(40)
    ]
    report = QAReport(conditions=("model",), records=records)
    assert report.table().splitlines()[2].split()[1:] == ["5/40", "13%"]
