"""The `lwm` command line, run as a user would."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lwm(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)  # conftest set 8 simulated CPU devices
    return subprocess.run(
        [sys.executable, "-m", "lwm", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_info_7b() -> None:
    result = _lwm("info", "--config", "configs/7b.yaml")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "hidden_size: 4096" in out and "shape: 1,-1,1,1" in out
    assert "6,738,415,616" in out  # text parameters
    assert "69,206,016" in out  # vision parameters
    assert "FLOPs per token at seq_len 32,768" in out
    assert "per device on mesh dp=1 fsdp=8 sp=1 tp=1 (8 devices)" in out
    assert "GiB" in out


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_a_reader_that_leaves_early_gets_no_traceback(unbuffered: str) -> None:
    """`lwm info ... | head -1`, where the reader has left before the output comes (buffered
    or not): the output meets a closed pipe, and the command stops with status 1 and nothing
    on stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lwm", "info", "--config", "configs/7b.yaml"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED=unbuffered),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # before anything is printed: importing takes a second
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1 and err == "", err


def _assert_one_line_error(
    result: subprocess.CompletedProcess, *needles: str, verb: str = "info"
) -> None:
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"lwm {verb}: error: "), lines[0]
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_unknown_key_is_one_line() -> None:
    result = _lwm("info", "--config", "configs/7b.yaml", "model.not_a_field=1")
    _assert_one_line_error(result, "'model.not_a_field'", "hidden_size")


def test_wrong_mesh_product_is_one_line() -> None:
    result = _lwm("info", "--config", "configs/7b.yaml", "mesh.shape=1,3,1,1")
    _assert_one_line_error(result, "'1,3,1,1'", "needs 3 devices but 8 are available")


def test_in_process_plan_and_help(capsys, monkeypatch) -> None:
    from lwm.cli import main

    monkeypatch.chdir(ROOT)
    plan = ["info", "--config", "configs/7b_1m.yaml", "--devices", "256"]
    assert main([*plan, "mesh.shape=1,-1,32,1"]) == 0
    out = capsys.readouterr().out
    assert "per device on mesh dp=1 fsdp=8 sp=32 tp=1 (256 devices)" in out
    assert main([*plan, "--mesh", "1,-1,32,1"]) == 0  # the same, as the inference verbs say it
    assert capsys.readouterr().out == out
    assert main([*plan, "--mesh", "1,-1,32,1", "mesh.shape=1,-1,32,1"]) == 2
    assert capsys.readouterr().err == (
        "lwm info: error: --mesh 1,-1,32,1 and mesh.shape=1,-1,32,1 both set mesh.shape; give one\n"
    )
    assert main(["info", "--config", "configs/missing.yaml"]) == 2
    assert (
        capsys.readouterr().err == "lwm info: error: config file 'configs/missing.yaml' not found\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--help"])
    assert exit_info.value.code == 0
    assert "--devices N" in capsys.readouterr().out


def test_mesh_and_out_are_short_for_their_config_keys() -> None:
    """`lwm train`, `lwm vqgan train` and `lwm info`: --mesh is mesh.shape=, --out (the
    trainings) train.output_dir=; an option and its key both given is an error naming both."""
    from argparse import Namespace

    from lwm.commands import UsageError, config_overrides

    args = Namespace(overrides=["train.steps=3"], mesh="1,2,2,2", out="runs/x")
    assert config_overrides(args) == [
        "train.steps=3",
        "mesh.shape=1,2,2,2",
        "train.output_dir=runs/x",
    ]
    assert config_overrides(Namespace(overrides=["a=1"], mesh=None)) == ["a=1"]  # lwm info
    args = Namespace(overrides=["train.output_dir=runs/y"], mesh=None, out="runs/x")
    with pytest.raises(UsageError) as e:
        config_overrides(args)
    assert str(e.value) == (
        "--out runs/x and train.output_dir=runs/y both set train.output_dir; give one"
    )


PIPELINE = ["synthetic", "vqgan", "tokenize", "train", "info", "ask", "chat", "eval", "generate"]


def test_bare_lwm_lists_the_verbs_in_pipeline_order(capsys) -> None:
    """Bare `lwm`: the verbs, one line each, in the order of the pipeline, on stderr, status 2
    (as a verb given too little); `lwm --help` the same list on stdout, status 0."""
    from lwm.cli import main

    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    start = lines.index("commands, in the order of the pipeline:") + 1
    assert [line.split()[0] for line in lines[start : start + len(PIPELINE)]] == PIPELINE
    assert lines[start + len(PIPELINE)] == ""  # one line each, then the end of the list
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "\n".join(lines[start - 1 : start + len(PIPELINE)]) in capsys.readouterr().out


def test_version(capsys) -> None:
    from importlib.metadata import version

    from lwm.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"lwm {version('lwm-jax')}\n"


def _options(parser) -> dict:
    return {name: action for action in parser._actions for name in action.option_strings}


def test_every_verb_names_the_same_things_the_same_way() -> None:
    """One grammar (issue 54): a config is --config FILE, an output --out, a VQGAN --vqgan DIR,
    a mesh --mesh DP,FSDP,SP,TP, simulated devices --cpu-devices N, in every verb and
    subcommand that takes them; the old names are no option a --help lists; each verb
    offers only what it uses."""
    from lwm.cli import all_parsers

    parsers = all_parsers()
    assert [name.split()[1] for name in parsers if len(name.split()) == 2] == PIPELINE
    subcommands = {name for name in parsers if len(name.split()) == 3}
    assert subcommands == {
        "lwm vqgan train",
        "lwm vqgan encode",
        "lwm vqgan decode",
        "lwm vqgan import",
        "lwm tokenize merge",
        "lwm eval qa",
        "lwm eval needle",
    }
    same = {
        "--config": "FILE",
        "--vqgan": "DIR",
        "--mesh": "DP,FSDP,SP,TP",
        "--cpu-devices": "N",
        "--tokenizer": "DIR",
        "--max-frames": "N",
    }
    for name, parser in parsers.items():
        options = _options(parser)
        old = {"--output", "--checkpoint", "--merge", "--ckpt", "-o", "--devices-cpu"}
        assert not old & set(options), name
        positionals = {a.dest for a in parser._actions if not a.option_strings}
        assert not positionals & {"config", "out", "output", "vqgan", "checkpoint"}, name
        for flag, metavar in same.items():
            if flag in options:
                assert options[flag].metavar == metavar, (name, flag)
                assert options[flag].option_strings == [flag], (name, flag)
        if "--out" in options:
            assert options["--out"].metavar in ("DIR", "FILE"), name
        if "--mesh" in options:  # a mesh of more devices than a CPU host has
            assert "--cpu-devices" in options, name
        for old_name, new_name in getattr(parser, "renamed", {}).items():
            assert new_name in options and old_name not in options, (name, old_name)

    def having(flag: str) -> set[str]:
        return {name for name, parser in parsers.items() if flag in _options(parser)}

    assert having("--vqgan") == {
        "lwm vqgan encode",
        "lwm vqgan decode",
        "lwm tokenize",
        "lwm ask",
        "lwm chat",
        "lwm eval qa",
        "lwm eval needle",
        "lwm generate",
    }
    models = {"lwm ask", "lwm chat", "lwm eval qa", "lwm eval needle", "lwm generate"}
    assert having("--mesh") == {"lwm vqgan train", "lwm train", "lwm info", *models}
    assert having("--config") == {"lwm vqgan train", "lwm vqgan import", "lwm train"} | {
        "lwm info",
        *models,
    }
    assert "lwm chat" not in having("--batch-size")  # one conversation
    assert "lwm eval needle" not in having("--max-frames") | having("--fps")  # no video files
    assert _options(parsers["lwm tokenize merge"]).keys() == {"-h", "--help", "--out", "--strict"}


def test_old_spellings_work_with_one_notice(tmp_path, capsys, monkeypatch) -> None:
    """Each old spelling does what the new one does, with one line more on stderr first:
    ``PROG: warning: OLD is deprecated, use NEW``."""
    from lwm.cli import main

    monkeypatch.chdir(ROOT)
    missing = str(tmp_path / "missing")
    cases = [  # (old, new)
        (
            ["info", "configs/tiny.yaml", "--devices", "8"],
            ["info", "--config", "configs/tiny.yaml"],
        ),
        (["tokenize", "--merge", missing], ["tokenize", "merge", "--out", missing]),
        (["tokenize", "--merge=" + missing], ["tokenize", "merge", "--out", missing]),
        (
            ["tokenize", "--input", missing, "--output", missing, "--vqgan", missing],
            ["tokenize", "--input", missing, "--out", missing, "--vqgan", missing],
        ),
        (
            ["vqgan", "encode", missing, "--checkpoint", missing],
            ["vqgan", "encode", missing, "--vqgan", missing],
        ),
        (
            ["vqgan", "decode", missing, "--checkpoint=" + missing, "--out", "x.mp4"],
            ["vqgan", "decode", missing, "--vqgan=" + missing, "--out", "x.mp4"],
        ),
    ]
    notices = []
    for old, new in cases:
        if old[0] == "info":
            new = [*new, "--devices", "8"]
        status = main(old)
        before = capsys.readouterr()
        assert main(new) == status, old
        after = capsys.readouterr()
        assert before.out == after.out, old
        notice, rest = before.err.split("\n", 1)
        assert rest == after.err, old
        assert notice.startswith(f"lwm {old[0]}") and ": warning: " in notice, notice
        assert " is deprecated, use " in notice, notice
        notices.append(notice)
    assert notices[0] == (
        "lwm info: warning: the config as a positional argument is deprecated, "
        "use --config configs/tiny.yaml"
    )
    assert (
        notices[1]
        == "lwm tokenize: warning: --merge OUT is deprecated, use lwm tokenize merge --out OUT"
    )
    assert notices[3] == "lwm tokenize: warning: --output is deprecated, use --out"
    assert notices[4] == "lwm vqgan encode: warning: --checkpoint is deprecated, use --vqgan"
    assert notices[5] == "lwm vqgan decode: warning: --checkpoint is deprecated, use --vqgan"
    # an option given twice in its old spelling: still one notice
    assert main(["vqgan", "encode", missing, "--checkpoint", "a", "--checkpoint", "b"]) == 2
    assert capsys.readouterr().err.count("deprecated") == 1
    assert list(tmp_path.iterdir()) == []


def test_tokenize_merge_takes_only_its_own_options(tmp_path, capsys) -> None:
    from lwm.cli import main

    out = tmp_path / "tokens"
    assert main(["tokenize", "merge", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"lwm tokenize: error: no tokenize job to merge for '{out}': '{out}.partial' does not "
        "exist (run the shards, `lwm tokenize ... --shard I/N`, first)\n"
    )
    for argv, message in [
        ([], "the following arguments are required: --out"),
        (["--out", str(out), "--input", "x"], "unrecognized arguments: --input x"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["tokenize", "merge", *argv])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == (
            f"lwm tokenize merge: error: {message} (see 'lwm tokenize merge --help')\n"
        )
    assert list(tmp_path.iterdir()) == []


def test_each_needle_kind_takes_only_its_own_options(tmp_path, capsys) -> None:
    """`lwm eval needle --kind text --clip-frames 3` is refused (before any model loads),
    naming the option and the kinds it is for."""
    from lwm.cli import main

    needle = ["eval", "needle", "--model", f"run:{tmp_path / 'none'}", "--lengths", "9"]
    needle += ["--out", str(tmp_path / "out")]
    for kind, option in [
        ("text", "--clip-frames 3"),
        ("video", "--haystack h"),
        ("text", "--asked 1"),
    ]:
        assert main([*needle, "--kind", kind, *option.split()]) == 2
        flag = option.split()[0]
        kinds = {"--clip-frames": "video", "--haystack": "text and multi", "--asked": "multi"}
        assert capsys.readouterr().err == (
            f"lwm eval: error: {flag} is an option of --kind {kinds[flag]}, not of --kind {kind}\n"
        )
    assert list(tmp_path.iterdir()) == []


def test_synthetic_verb_writes_a_manifest_and_refuses_an_impossible_world(tmp_path) -> None:
    from lwm.cli import main

    out = tmp_path / "videos"
    assert (
        main(["synthetic", "--out", str(out), "--count", "2", "--size", "32", "--frames", "4"]) == 0
    )
    lines = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    assert (out / "videos" / "00001.mp4").is_file()
    # per video: a caption, then one QA record (by default) or one per kind of question
    assert [set(x) for x in lines] == [{"video", "text"}, {"video", "qa"}] * 2
    by_kind = tmp_path / "by_kind"
    args = ["--count", "2", "--size", "32", "--frames", "4", "--qa-records", "kind"]
    assert main(["synthetic", "--out", str(by_kind), *args]) == 0
    lines = [json.loads(x) for x in (by_kind / "manifest.jsonl").read_text().splitlines()]
    assert sum("text" in x for x in lines) == 2 and len(lines) >= 2 + 2 * 5
    assert all(len({t["category"] for t in x["qa"]}) == 1 for x in lines if "qa" in x)
    # only the shape questions (a shapes-first stage): all learned, none gives another away
    shapes = tmp_path / "shapes"
    args = ["--count", "2", "--size", "32", "--frames", "4", "--no-captions"]
    assert main(["synthetic", "--out", str(shapes), *args, "--categories", "shape"]) == 0
    lines = [json.loads(x) for x in (shapes / "manifest.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    assert all(t["category"] == "shape" and t["learn"] for x in lines for t in x["qa"])
    # the same into the folder of all questions, as a second manifest: no video rendered again
    mp4 = out / "videos" / "00001.mp4"
    os.utime(mp4, ns=(1, 1))
    argv = ["synthetic", "--out", str(out), *args, "--categories", "shape", "--manifest", "s.jsonl"]
    assert main(argv) == 0
    assert mp4.stat().st_mtime_ns == 1  # kept
    assert (out / "s.jsonl").read_text() == (shapes / "manifest.jsonl").read_text()
    assert (out / "manifest.jsonl").is_file()  # the first manifest stays
    mp4.unlink()
    assert main(argv) == 0 and mp4.is_file()  # a missing video is rendered
    # or both manifests in one pass: --also-manifest writes what the second call writes
    plain, both = tmp_path / "plain", tmp_path / "both"
    assert main(["synthetic", "--out", str(plain), *args]) == 0
    assert main(["synthetic", "--out", str(both), *args, "--also-manifest", "s.jsonl:shape"]) == 0
    assert (both / "s.jsonl").read_text() == (shapes / "manifest.jsonl").read_text()
    assert (both / "manifest.jsonl").read_text() == (plain / "manifest.jsonl").read_text()
    result = _lwm("synthetic", "--out", str(tmp_path / "no"), "--also-manifest", "s.jsonl:colours")
    _assert_one_line_error(result, "unknown question categories colours", verb="synthetic")
    result = _lwm("synthetic", "--out", str(out), "--manifest", "../m.jsonl")
    _assert_one_line_error(result, "is not a file name ending in .jsonl", verb="synthetic")
    result = _lwm("synthetic", "--out", str(tmp_path / "no"), "--categories", "shape,colours")
    _assert_one_line_error(result, "unknown question categories colours", verb="synthetic")
    assert not (tmp_path / "no").exists()
    result = _lwm(
        "synthetic", "--out", str(tmp_path / "no"), "--size", "16", "--radius", "0.45,0.49"
    )
    _assert_one_line_error(result, "could not draw an answerable video", verb="synthetic")
    assert not (tmp_path / "no").exists()  # nothing written


def test_the_command_line_module_imports_no_jax() -> None:
    # `lwm tokenize` starts its decoding workers with multiprocessing's spawn, which imports the
    # console script's module again in each worker: that import must stay light (no JAX).
    code = "import sys, lwm.cli; print(sorted(m for m in ('jax', 'flax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


BAD_ARGUMENTS = [
    (["synthetic", "--count", "0"], "argument --count: expected a positive integer, got '0'"),
    (["synthetic", "--size", "31"], "argument --size: expected an even integer >= 2, got '31'"),
    (["synthetic", "--needle-prob", "2"], "argument --needle-prob: expected a number from 0 to 1"),
    (["synthetic", "--max-objects", "0"], "argument --max-objects: expected a positive integer"),
    (["synthetic", "--fps", "-3"], "argument --fps: expected a positive integer, got '-3'"),
    (["ask", "--model", "run:x", "--video", "v.mp4", "--question", " "], "expected some text"),
    (["ask", "--model", "run:x", "--video", "v", "--question", "q", "--top-p", "2"], "--top-p"),
    (["ask", "--model", "run:x", "--video", "v", "--question", "q", "--temperature", "-1"],
     "argument --temperature: expected a number >= 0"),
    (["ask", "--model", "run:x", "--video", "v", "--question", "q", "--fps", "0"],
     "argument --fps: expected a positive number, got '0'"),
    (["vqgan", "encode", "v.mp4", "--vqgan", "x", "--max-frames", "-2"], "--max-frames"),
    (["vqgan", "decode", "c.npy", "--vqgan", "x", "--out", "x.mp4", "--fps", "0"], "--fps"),
    (["chat", "--model", "run:x", "--batch-size", "4"], "unrecognized arguments: --batch-size"),
    (["eval", "needle", "--model", "run:x", "--lengths", "9", "--out", "o", "--max-frames", "4"],
     "unrecognized arguments: --max-frames 4"),
]  # fmt: skip


@pytest.mark.parametrize("argv,message", BAD_ARGUMENTS, ids=lambda a: " ".join(a)[:40])
def test_bad_values_are_refused_before_any_work(argv, message, tmp_path, capsys) -> None:
    from lwm.cli import main

    out = ["--out", str(tmp_path / "out")] if argv[0] == "synthetic" else []
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, *out])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"lwm {argv[0]}"), err
    assert list(tmp_path.iterdir()) == []


def test_an_output_of_the_wrong_kind_is_refused_before_any_work(tmp_path, capsys) -> None:
    """A folder where a file is written, or a file where a folder is: one line, status 2,
    before a model is loaded (the run named here does not exist: it is never reached)."""
    from lwm.cli import main

    folder, file = tmp_path / "folder.mp4", tmp_path / "file.mp4"
    folder.mkdir()
    file.write_bytes(b"")
    model = ["--model", f"run:{tmp_path / 'no_run'}"]
    cases = [
        (["eval", "qa", *model, "--manifest", "m.jsonl", "--out", str(folder)], "is a folder"),
        (["eval", "needle", *model, "--lengths", "100", "--out", str(file)], "is a file"),
        (["generate", *model, "--prompt", "p", "--out", str(folder)], "is a folder"),
        (["synthetic", "--out", str(file)], "is a file; give a folder"),
        (["vqgan", "decode", str(file), "--vqgan", "x", "--out", str(folder)], "is a folder"),
        (["vqgan", "import", str(file), "--out", str(file)], "is a file; give a folder"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and err[0].startswith("lwm "), (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.mp4", "folder.mp4"]
    assert list(folder.iterdir()) == []


def test_files_are_written_whole_with_the_usual_permissions(tmp_path) -> None:
    """`atomic_path` writes under a temporary name and renames: the file gets what open()
    would give it (0666 less the umask; mkstemp's 0600 before), and a folder in the way is
    refused before anything is written."""
    from lwm.base.files import write_text

    old = os.umask(0o022)
    try:
        write_text(tmp_path / "a.txt", "x")
        assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o644
        os.umask(0o077)
        write_text(tmp_path / "b.txt", "x")
        assert (tmp_path / "b.txt").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)
    (tmp_path / "dir").mkdir()
    with pytest.raises(IsADirectoryError):
        write_text(tmp_path / "dir", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "dir"]


def test_many_processes_without_a_coordinator_are_refused() -> None:
    """Else each process would run the whole job alone (`lwm tokenize --num-processes 2`)."""
    from lwm.base.config import DistributedConfig
    from lwm.base.distributed import init_distributed
    from lwm.config import ConfigError

    with pytest.raises(ConfigError, match="a job of 2 processes needs the coordinator's address"):
        init_distributed(DistributedConfig(num_processes=2))
    init_distributed(DistributedConfig(num_processes=1))  # one process: nothing to join


SCRIPT_FOLDERS = ("recipes", "benchmarks", "tools")


def all_scripts() -> list[Path]:
    """Every runnable script of the repository: recipes, benchmarks and tools."""
    return sorted(p for folder in SCRIPT_FOLDERS for p in (ROOT / folder).glob("*.py"))


def script_path(name: str) -> Path:
    (path,) = [p for p in all_scripts() if p.stem == name]
    return path


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("bench_generate", ["--config", "/nowhere.yaml"], "config file '/nowhere.yaml' not found"),
        ("bench_generate", ["--sp", "1,0"], "--sp '1,0': every value must be at least 1"),
        ("bench_train", ["--attention", "bogus"], "unknown --attention 'bogus' (known: dense,"),
        ("cudnn_memory", ["--cases", "sacn"], "unknown case 'sacn' (attention: plain or"),
        ("bench_loader", ["--batches", "0"], "--batches, --prefetch and --min-len must be at"),
        ("bench_vqgan", ["--ops", "encdoe"], "unknown --ops 'encdoe' (known: encode, decode)"),
        ("bench_tokenize", ["--cpu-devices", "0"], "--cpu-devices must be at least 1, not 0"),
        ("bench_attention", ["--heads", "0"], "--heads must be at least 1, not 0"),
        ("bench_attention", ["--seqs", "500"], "sequence length 500 is not a positive multiple"),
        ("build_text_tokenizer", ["--vocab-size", "0"], "--vocab-size 0 is below 261"),
        ("demo", ["--mesh", "1,1,3"], "--mesh: mesh shape '1,1,3' must have 4 comma-separated"),
        ("text_to_video", ["--vqgan", "/nowhere"], "--vqgan '/nowhere' does not exist"),
        ("long_context", ["--clip-frames", "2"], "--clip-frames 2 is below 3"),
        pytest.param(
            "aot_compile",
            ["--config", "configs/tiny.yaml", "--topology", "v4:2x2x1"],
            "--topology v4:2x2x1: JAX's TPU support (libtpu) is not installed",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("libtpu") is not None, reason="libtpu is installed"
            ),
        ),
    ],
)
def test_a_script_given_bad_input_says_so_in_one_line(
    script, args, message, monkeypatch, capsys
) -> None:
    """The scripts end as the lwm verbs do (`lwm.cli.run_reporting_errors`): bad input is one
    line naming it, exit 2, nothing on stdout (several were tracebacks, or ran anyway: an
    unknown --attention timed blockwise under its name, an unknown case ran as plain). They run
    as ``__main__`` in this process (a new Python's start-up was 2-5 s of each case): the exit
    status is the one their last line raises, and an exception let out would fail here with its
    traceback. JAX has started here first: a script that set its devices before checking its
    input (three did: bad input cost a start of JAX) would stop on that instead."""
    import runpy

    import jax

    jax.devices()
    path = script_path(script)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(path), run_name="__main__")
    code = stop.value.code
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    assert err.startswith(f"{script}: error: ") and message in err
    assert len(err.strip().splitlines()) == 1, err


# not run on a device: a reference model module, and compilers' plans (for a CPU device with
# cuDNN stand-ins; for a TPU --topology)
NOT_ON_A_DEVICE = {"lwm_vqgan_reference", "cudnn_memory", "aot_attention"}


def test_every_benchmark_takes_platform(monkeypatch, capsys) -> None:
    """Each benchmark script offers --platform, as the repository's rules ask of benchmarks
    (four of them had none: they ran where JAX started). Its `--help`, in this process: every
    script builds its parser in ``main`` and reads ``sys.argv``, as when run."""
    import runpy

    missing = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        if path.stem in NOT_ON_A_DEVICE:
            continue
        script = runpy.run_path(str(path), run_name="help_of_" + path.stem)  # not "__main__"
        monkeypatch.setattr(sys, "argv", [path.name, "--help"])
        with pytest.raises(SystemExit) as stop:
            script["main"]()
        assert stop.value.code == 0, path.name
        if "--platform {" not in capsys.readouterr().out:
            missing.append(path.name)
    assert missing == []


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu is installed")
def test_aot_compile_takes_the_old_positional_config_with_a_notice() -> None:
    """`tools/aot_compile.py CONFIG` (before --config) still reads the config, saying once how
    to spell it now; it then stops at the missing libtpu, as with --config."""
    result = subprocess.run(
        [sys.executable, str(script_path("aot_compile")), "configs/tiny.yaml"]
        + ["--topology", "v4:2x2x1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 2, result.stderr
    assert lines[0] == (
        "aot_compile: warning: the config as a positional argument is deprecated, "
        "use --config configs/tiny.yaml"
    )
    assert lines[1].startswith("aot_compile: error: --topology v4:2x2x1: JAX's TPU support")


def test_every_script_ends_through_the_verbs_error_reporting() -> None:
    for script in all_scripts():
        text = script.read_text()
        if '__name__ == "__main__"' in text:
            assert f'run_reporting_errors("{script.stem}", main' in text, script.name


def test_bench_attention_records_the_block_each_impl_computes_with() -> None:
    """At 256 tokens over 8 devices our ring tiles each shard's two 16-token zigzag halves, so
    it computes with blocks of 16 whatever --block asks (the record said 512); dense has
    none."""
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_attention.py", "--seqs", "256", "--block", "512"]
        + ["--impls", "ours,dense", "--modes", "fwd", "--repeats", "1", "--heads", "1"]
        + ["--head-dim", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    blocks = {r["impl"]: r["block"] for r in map(json.loads, result.stdout.splitlines())}
    assert blocks == {"ours": 16, "dense": None}


def test_every_option_of_the_verbs_and_scripts_has_help() -> None:
    """`--help` of each `lwm` verb and script explains every option and argument (several
    scripts listed some bare)."""
    import ast

    bare = []
    for path in sorted([*all_scripts(), *ROOT.glob("lwm/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                kinds = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
                if "help" not in kinds and kinds.get("action") not in ("help", "version"):
                    names = [a.value for a in node.args if isinstance(a, ast.Constant)]
                    bare.append(f"{path.relative_to(ROOT)}:{node.lineno} {names}")
    assert not bare, bare


def test_the_demo_rerun_with_other_videos_into_its_folder_is_refused(tmp_path) -> None:
    """The demo reuses the videos and tokens under --out: a rerun asking for others is one
    line naming them, exit 2 (it went on with the old ones without a word)."""
    demo = [sys.executable, "recipes/demo.py", "--out", str(tmp_path), "--videos-only"]
    first = subprocess.run(
        [*demo, "--videos", "2", "--held-out", "2", "--frames", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    again = subprocess.run(
        [*demo, "--videos", "3", "--held-out", "2", "--frames", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 2 and again.stderr.strip() == (
        f"demo: error: --out {tmp_path} holds the videos and tokens of other settings "
        "(--videos 2 there, 3 here): rerun with those, or give another --out"
    )


def test_the_demo_refuses_a_vqgan_seed_other_than_its_folders_before_making_anything(
    tmp_path,
) -> None:
    """`--vqgan-seed` against a folder whose VQGAN trained from another seed (its config.yaml):
    one line naming both, exit 2, nothing made (the rerun would have resumed or kept that VQGAN
    under the new seed's name). The same seed, no seed, or no VQGAN yet pass."""
    from lwm.scripting import check_vqgan_seed, demo_vqgan_command

    (tmp_path / "vqgan").mkdir()
    (tmp_path / "vqgan" / "config.yaml").write_text("data:\n  seed: 9\nseed: 3\n")
    result = subprocess.run(
        [sys.executable, "recipes/demo.py", "--out", str(tmp_path), "--vqgan-seed", "5"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"demo: error: --vqgan-seed 5: {tmp_path / 'vqgan'} holds a VQGAN trained from seed 3; "
        "rerun with that seed, or give another --out"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vqgan"]
    for seed in (3, None):
        check_vqgan_seed(tmp_path / "vqgan", seed)
    check_vqgan_seed(tmp_path / "elsewhere", 5)
    command = demo_vqgan_command(["lwm"], [], tmp_path, 10, tmp_path / "m.jsonl", seed=5)
    assert command[-1] == "seed=5"
    assert "seed=" not in " ".join(demo_vqgan_command(["lwm"], [], tmp_path, 10, tmp_path))


def test_the_demo_names_a_wrong_set_key_before_making_anything(tmp_path) -> None:
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "recipes/demo.py", "--out", str(out), "--set", "model.remat=none"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith(
        "demo.py: error: --set: unknown config key 'model.remat'; valid keys in 'model': "
    )
    assert not out.exists()


def test_lwm_traceback_shows_where_an_input_error_came_from() -> None:
    """`LWM_TRACEBACK=1` raises what would be one line (a script takes any ValueError for bad
    input: a fault of its own would otherwise lose its traceback)."""
    cmd = [sys.executable, "benchmarks/bench_attention.py", "--heads", "0"]
    env = dict(os.environ, LWM_TRACEBACK="1")
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1 and "Traceback (most recent call last)" in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith("--heads must be at least 1, not 0")


def test_a_failed_measurement_keeps_its_traceback_when_asked(monkeypatch, capsys) -> None:
    """A benchmark records a failed case as one JSON line and goes on (`lwm.scripting.failed_status`);
    with `LWM_TRACEBACK=1` the case's
    traceback goes to stderr as well, naming the function that raised; without it, nothing."""
    from lwm.scripting import failed_status

    def kernel_that_fails() -> None:
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\nwhile allocating 9 GiB")

    try:
        kernel_that_fails()
    except RuntimeError as e:
        error = e
    monkeypatch.delenv("LWM_TRACEBACK", raising=False)
    assert failed_status(error) == "failed: RuntimeError: RESOURCE_EXHAUSTED: out of memory"
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("LWM_TRACEBACK", "1")
    assert failed_status(error) == "failed: RuntimeError: RESOURCE_EXHAUSTED: out of memory"
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)")
    assert "in kernel_that_fails" in err and err.rstrip().endswith("while allocating 9 GiB")


def test_commands_keep_compiled_programs_on_disk(tmp_path, monkeypatch) -> None:
    """Every verb turns on JAX's persistent compilation cache before it compiles: in
    ``$XDG_CACHE_HOME/lwm/jax`` unless the environment names another folder or turns it off,
    so a later command (the demo's second tokenize, a rerun) loads what an earlier compiled."""
    import lwm.base.compile_cache as compile_cache
    from lwm.cli import main

    calls = []
    monkeypatch.setattr(compile_cache, "use_compilation_cache", lambda: calls.append(1))
    monkeypatch.chdir(ROOT)
    assert main(["info", "--config", "configs/tiny.yaml"]) == 0 and calls == [1]

    code = (
        "import jax, jax.numpy as jnp; from lwm.base.compile_cache import use_compilation_cache; "
        "print(use_compilation_cache()); jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or k == "JAX_PLATFORMS"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")

    def run(**extra: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", code], env={**env, **extra}, cwd=ROOT,
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return out.stdout.strip()

    default = tmp_path / "xdg" / "lwm" / "jax"
    assert run() == str(default)
    kept = sorted(p.name for p in default.iterdir())
    assert kept and run() == str(default)
    assert sorted(p.name for p in default.iterdir()) == kept  # loaded, not compiled again
    other = tmp_path / "other"
    assert run(JAX_COMPILATION_CACHE_DIR=str(other)) == str(other) and any(other.iterdir())
    off = tmp_path / "off"
    assert run(XDG_CACHE_HOME=str(off), JAX_ENABLE_COMPILATION_CACHE="false") == "None"
    assert not off.exists()
