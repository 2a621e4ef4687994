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
    result = _lwm("info", "configs/7b.yaml")
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
        [sys.executable, "-m", "lwm", "info", "configs/7b.yaml"],
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
    result = _lwm("info", "configs/7b.yaml", "model.not_a_field=1")
    _assert_one_line_error(result, "'model.not_a_field'", "hidden_size")


def test_wrong_mesh_product_is_one_line() -> None:
    result = _lwm("info", "configs/7b.yaml", "mesh.shape=1,3,1,1")
    _assert_one_line_error(result, "'1,3,1,1'", "needs 3 devices but 8 are available")


def test_in_process_plan_and_help(capsys, monkeypatch) -> None:
    from lwm.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["info", "configs/7b_1m.yaml", "mesh.shape=1,-1,32,1", "--devices", "256"]) == 0
    out = capsys.readouterr().out
    assert "per device on mesh dp=1 fsdp=8 sp=32 tp=1 (256 devices)" in out
    assert main(["info", "configs/missing.yaml"]) == 2
    assert (
        capsys.readouterr().err == "lwm info: error: config file 'configs/missing.yaml' not found\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--help"])
    assert exit_info.value.code == 0
    assert "--devices N" in capsys.readouterr().out


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
    (["vqgan", "encode", "v.mp4", "--checkpoint", "x", "--max-frames", "-2"], "--max-frames"),
    (["vqgan", "decode", "c.npy", "--checkpoint", "x", "--out", "x.mp4", "--fps", "0"], "--fps"),
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
        (["vqgan", "decode", str(file), "--checkpoint", "x", "--out", str(folder)], "is a folder"),
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
        ("bench_train", ["--attention", "bogus"], "unknown --attention 'bogus' (known: dense,"),
        ("cudnn_memory", ["--cases", "sacn"], "unknown case 'sacn' (attention: plain or"),
        ("bench_loader", ["--batches", "0"], "--batches, --prefetch and --min-len must be at"),
        ("bench_vqgan", ["--ops", "encdoe"], "unknown --ops 'encdoe' (known: encode, decode)"),
        ("bench_attention", ["--heads", "0"], "--heads must be at least 1, not 0"),
        ("bench_attention", ["--seqs", "500"], "sequence length 500 is not a positive multiple"),
        ("build_text_tokenizer", ["--vocab-size", "0"], "--vocab-size 0 is below 261"),
        ("demo", ["--mesh", "1,1,3"], "--mesh: mesh shape '1,1,3' must have 4 comma-separated"),
        ("text_to_video", ["--vqgan", "/nowhere"], "--vqgan '/nowhere' does not exist"),
        ("long_context", ["--clip-frames", "2"], "--clip-frames 2 is below 3"),
        pytest.param(
            "aot_compile",
            ["configs/tiny.yaml", "--topology", "v4:2x2x1"],
            "--topology v4:2x2x1: JAX's TPU support (libtpu) is not installed",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("libtpu") is not None, reason="libtpu is installed"
            ),
        ),
    ],
)
def test_a_script_given_bad_input_says_so_in_one_line(script, args, message) -> None:
    """The scripts end as the lwm verbs do (`lwm.cli.run_reporting_errors`): bad input is one
    line naming it, exit 2, nothing on stdout (several were tracebacks, or ran anyway: an
    unknown --attention timed blockwise under its name, an unknown case ran as plain)."""
    result = subprocess.run(
        [sys.executable, str(script_path(script)), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.startswith(f"{script}: error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


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
