"""The ``blockhess`` command line: exit status of user errors and of bugs, ``python -m blockhess``,
``--threads`` of every command, and what ``validate --help`` says it checks."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import blockhess
from blockhess_lab import cli
from blockhess_lab import bench, validate
from blockhess.validation import InsufficientMemoryError

SRC = str(Path(blockhess.__file__).resolve().parents[1])


def _python_m(*argv, env_extra=None):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-m", "blockhess", *argv], capture_output=True, text=True, env=env,
                          timeout=120)


def test_python_m_blockhess_is_the_console_script(capsys, monkeypatch):
    done = _python_m("--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: blockhess ")
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])  # the console script's entry point
    assert exit_.value.code == 0 and capsys.readouterr().out == done.stdout
    bad = _python_m("report", "--threads", "0")
    assert bad.returncode == 2 and "blockhess report: error: argument --threads" in bad.stderr


@pytest.fixture
def fake_command(monkeypatch):
    """A command ``fake`` whose run raises what the test puts in ``box``."""
    box = {}
    mod = types.ModuleType("blockhess_lab._fake_command")
    mod.HELP = "a command of the tests"
    mod.add_arguments = lambda p: p.add_argument("--out", default="x")

    def run(args):
        raise box["exc"]

    mod.run = run
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(cli, "COMMANDS", {"fake": "_fake_command"})
    return box


@pytest.mark.parametrize("exc", [
    ValueError("--batch must be >= 1, got 0\nsecond line"),
    InsufficientMemoryError("the dense 9x9 Hessian needs 8.0 GiB, 1.0 GiB available"),
    OSError("cannot write to --out /x: Permission denied"),
], ids=["ValueError", "InsufficientMemoryError", "OSError"])
def test_user_errors_are_one_line_and_exit_2(fake_command, capsys, exc):
    fake_command["exc"] = exc
    assert cli.main(["fake"]) == 2
    err = capsys.readouterr().err
    assert err == f"blockhess fake: error: {str(exc).splitlines()[0]}\n"


@pytest.mark.parametrize("exc", [RuntimeError("an internal invariant failed"), TypeError("bad call"), KeyError("W_Q"),
                                 AssertionError("unreachable")])
def test_a_bug_is_not_reported_as_bad_input(fake_command, capsys, exc):
    """Anything but ValueError/OSError propagates: the console script exits 1 with the traceback."""
    fake_command["exc"] = exc
    with pytest.raises(type(exc)):
        cli.main(["fake"])
    assert capsys.readouterr().err == ""


def test_a_bug_shows_its_traceback_from_python_m(tmp_path):
    plugin = tmp_path / "sitecustomize.py"  # makes validate's run a bug before the interpreter starts the CLI
    plugin.write_text("import blockhess_lab.validate as v\n"
                      "def run(args):\n    raise RuntimeError('an internal invariant failed')\n"
                      "v.run = run\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), SRC])}
    done = subprocess.run([sys.executable, "-m", "blockhess", "validate", "--out", str(tmp_path / "v")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr and "RuntimeError: an internal invariant failed" in done.stderr
    assert "error:" not in done.stderr


def test_ctrl_c_is_one_line_and_exit_130(fake_command, capsys):
    fake_command["exc"] = KeyboardInterrupt()
    assert cli.main(["fake"]) == 130
    assert capsys.readouterr().err == "blockhess fake: interrupted\n"


def _parser(name):
    p = argparse.ArgumentParser(prog=f"blockhess {name}")
    __import__(f"blockhess_lab.{cli.COMMANDS[name]}", fromlist=["x"]).add_arguments(p)
    return p


@pytest.mark.parametrize("name", [n for n in cli.COMMANDS if n != "bench"])
def test_threads_default_1_and_below_1_refused(name, capsys):
    assert _parser(name).parse_args([]).threads == 1
    assert _parser(name).parse_args(["--threads", "3"]).threads == 3
    for bad in ("0", "-2", "two", "auto"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([name, "--threads", bad])
        assert exit_.value.code == 2
        assert f"blockhess {name}: error: argument --threads: expected an integer >= 1" in capsys.readouterr().err


def test_bench_threads_auto_or_at_least_1(tmp_path, capsys, monkeypatch):
    p = _parser("bench")
    assert p.parse_args([]).threads is None and p.parse_args(["--threads", "auto"]).threads is None
    assert p.parse_args(["--threads", "2"]).threads == 2
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["bench", "--threads", bad])
        assert exit_.value.code == 2
        assert "blockhess bench: error: argument --threads: expected auto or an integer >= 1" in capsys.readouterr().err
    assert "auto (the default)" in p.format_help()
    import torch

    cpus = os.cpu_count() or 1
    for load, threads, want, reason in [(0.0, None, torch.get_num_threads(), "torch default"), (0.0, 3, 3, "--threads")]:
        args = p.parse_args([] if threads is None else ["--threads", str(threads)])
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
        bench._choose_threads(args)
        assert (args.effective_threads, args.threads_reason) == (want, reason)
    if cpus > 1:  # auto on a busy machine: one thread, and why
        monkeypatch.setattr(os, "getloadavg", lambda: (float(cpus), 0.0, 0.0))
        args = p.parse_args([])
        bench._choose_threads(args)
        assert args.effective_threads == 1 and args.threads_reason.startswith("auto: load average")
    args = p.parse_args(["--out", str(tmp_path / "b")])
    args.threads = 0  # a Namespace built by hand is checked too
    with pytest.raises(ValueError, match="--threads must be auto or an integer >= 1, got 0"):
        bench.run(args)


def test_validate_help_says_what_it_checks(capsys):
    with pytest.raises(SystemExit):
        cli.main(["validate", "--help"])
    help_text = capsys.readouterr().out
    text = " ".join(help_text.split())
    assert "every closed form" not in text
    for what in ("bh.jacobian against torch.func.jacrev", "bh.hessian against torch.func.hessian", "MSE, CE and a custom",
                 f"{len(validate.OPTIONS)} block settings", "w.r.t. the input X", "Not covered here",
                 f"{len(validate.OPTIONS) * 9} cases instead of {len(validate.OPTIONS) * 15}"):
        assert what in text, what
    assert text.index("Not covered here") > text.index("--quiet")  # the details come after the options


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_subcommand_help_opens_with_its_one_line_help_and_has_the_same_quiet(name, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # one line per paragraph
    with pytest.raises(SystemExit):
        cli.main([name, "--help"])
    lines = capsys.readouterr().out.splitlines()
    mod = __import__(f"blockhess_lab.{cli.COMMANDS[name]}", fromlist=["x"])
    assert lines[1:4] == ["", mod.HELP, ""]
    quiet = [line.split(None, 1)[1] for line in lines if line.strip().startswith("--quiet ")]
    assert len(quiet) == 1 and quiet[0].startswith("no progress output and no ") and quiet[0].endswith(
        "(errors and failed checks are still shown)")
    seed = [line for line in lines if line.strip().startswith("--seed ")]
    assert all(line.split()[1] == "SEED" for line in seed)


def test_bench_quiet_prints_nothing(tmp_path, capsys):
    out = tmp_path / "b"
    argv = ["bench", "--quick", "--cases", "a", "--only", "a/ln/", "--no-memory", "--disable", "jax,curvlinops",
            "--threads", "1", "--out", str(out)]
    assert cli.main([*argv, "--quiet"]) == 0
    assert capsys.readouterr() == ("", "") and (out / "bench.md").is_file()
    assert cli.main(argv) == 0  # without it: progress on stderr, the tables on stdout
    std = capsys.readouterr()
    assert "[bench " in std.err and "|" in std.out


def test_bounds_exits_1_after_writing_when_a_valid_bound_fails(tmp_path, monkeypatch, capsys):
    from blockhess_lab import bounds as cmd

    monkeypatch.setattr(cmd, "RANDOM_SIZE", {"d_model": 4, "d_k": 2, "d_ff": 6, "L": 3})
    monkeypatch.setattr(cmd, "SWEEP_SIZE", {"d_model": 4, "d_k": 2, "d_ff": 6, "L": 3})
    monkeypatch.setattr(cmd, "SWEEP_SCALES", (1.0,))
    monkeypatch.setattr(cmd, "SWEEP_LENGTHS", (3,))
    monkeypatch.setattr(cmd, "SWEEP_WEIGHT_SCALES", (1.0,))
    table = cmd._table

    def violated(name, rows, **meta):  # as if one valid bound were below its exact norm
        t = table(name, rows, **meta)
        t["valid_violations"].append(rows[0]["block"])
        return t

    monkeypatch.setattr(cmd, "_table", violated)
    out = tmp_path / "b"
    assert cli.main(["bounds", "--out", str(out), "--no-trained", "--seeds", "1", "--quiet"]) == 1
    assert "valid bound is below the exact norm" in capsys.readouterr().err
    assert (out / "bounds.json").is_file()  # the results are there to look at


@pytest.mark.parametrize("argv, prog, what", [
    (["report", "--threads", "0"], "blockhess report", "argument --threads: expected an integer >= 1, got 0"),
    (["bounds", "--threads", "-1"], "blockhess bounds", "argument --threads: expected an integer >= 1, got -1"),
    (["scaling", "--threads", "abc"], "blockhess scaling", "argument --threads: expected an integer >= 1, got 'abc'"),
    (["bench", "--threads", "0"], "blockhess bench", "argument --threads: expected auto or an integer >= 1"),
    (["report", "--batch", "x"], "blockhess report", "argument --batch: invalid int value: 'x'"),
    (["report", "--dtype", "float16"], "blockhess report", "argument --dtype: invalid choice: 'float16'"),
    (["validate", "--bogus"], "blockhess validate", "unrecognized arguments: --bogus"),
    (["nosuch"], "blockhess", "argument COMMAND: invalid choice: 'nosuch'"),
    ([], "blockhess", "the following arguments are required: COMMAND"),
])
def test_every_argparse_error_is_one_line_without_the_usage_block(argv, prog, what, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: {what}"), err
    assert "usage:" not in err


def test_version_is_printed_without_the_lab_extra(monkeypatch, capsys):
    monkeypatch.setattr(cli, "missing_lab_requirements", lambda: ["matplotlib"])
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("blockhess ")
    assert cli.main(["--help"]) == 2  # everything else still says what to install


def _no_work(monkeypatch):
    """Make any command's work fail loudly: each starts it by recording the environment or loading the ViT."""
    from blockhess_lab import vit

    def started(*a, **k):
        raise AssertionError("the command started its work")

    for name in set(cli.COMMANDS.values()):
        monkeypatch.setattr(f"blockhess_lab.{name}.environment", started)
    monkeypatch.setattr(vit, "load_for_command", started)


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_an_unwritable_out_fails_at_once_in_every_command(name, tmp_path, monkeypatch, capsys):
    _no_work(monkeypatch)
    quick = ["--quick"] if name in ("validate", "scaling", "convergence", "bench") else []
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = [(blocker / "out", f"cannot write to --out {blocker / 'out'}: {blocker} is not a folder"),
           (blocker, f"--out {blocker} exists and is not a folder")]
    if Path("/proc/self").is_dir():  # Linux: no folder can be made in /proc
        bad.append((Path("/proc/blockhess-out"), "cannot write to --out /proc/blockhess-out: No such file or directory"))
    for out, msg in bad:
        assert cli.main([name, "--out", str(out), *quick]) == 2
        assert capsys.readouterr().err == f"blockhess {name}: error: {msg}\n"
    assert list(tmp_path.iterdir()) == [blocker]  # the probe leaves nothing behind


def test_check_out_accepts_new_nested_and_result_folders(tmp_path):
    from blockhess_lab.outputs import MARKER, check_out

    check_out(tmp_path / "new" / "deeper")  # missing parents are made when the results are written
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / MARKER).write_text("")
    check_out(tmp_path / "old")
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(["old", MARKER])


@pytest.mark.parametrize("argv, option", [(["bounds", "--batch", "6"], "--batch"), (["report", "--batch", "6"], "--batch"),
                                          (["convergence", "--quick", "--batch-size", "6"], "--batch-size")])
def test_a_batch_larger_than_the_training_set_is_refused_before_any_work(argv, option, tmp_path, monkeypatch, capsys):
    import torch
    from blockhess_lab import bounds, convergence, vit

    def started(*a, **k):
        raise AssertionError("the command started its work")

    monkeypatch.setattr(vit, "load_for_command", lambda *a, **k: types.SimpleNamespace(train_labels=torch.zeros(5)))
    monkeypatch.setattr(bounds, "_random_tables", started)
    monkeypatch.setattr(convergence, "environment", started)
    out = tmp_path / "out"
    assert cli.main([*argv, "--out", str(out), "--quiet"]) == 2
    assert capsys.readouterr().err == f"blockhess {argv[0]}: error: {option} 6 is larger than the 5 training images\n"
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["spectrum", "--blocks", "W_Z"], "--blocks: unknown block 'W_Z'"),
    (["spectrum", "--density-blocks", "blocks.0.W_Z"], "--density-blocks: 'blocks.0.W_Z' is not among the blocks"),
    (["spectrum", "--batch", "100000"], "--batch 100000 is larger than the 1438 training images"),
    (["report", "--batch", "100000"], "--batch 100000 is larger than the 1438 training images"),
    (["bounds", "--batch", "100000"], "--batch 100000 is larger than the 1438 training images"),
    (["convergence", "--batch-size", "100000"], "--batch-size 100000 is larger than the 1438 training images"),
    (["distributed", "--n-images", "99999"], "--n-images 99999 is larger than the 1438 training images"),
])
def test_options_are_refused_before_a_model_is_trained(argv, message, tmp_path, monkeypatch, capsys):
    """With no checkpoint yet, an option the model would refuse is refused first: no training, no file."""
    from blockhess_lab import vit

    def trained(*a, **k):
        raise AssertionError("the command trained a model before checking its options")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(vit, "train", trained)
    assert cli.main([*argv, "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"blockhess {argv[0]}: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "out").exists()


def test_quiet_transformers_silences_and_restores():
    """``runtime.quiet_transformers``: transformers' log at errors only and its progress bars off inside the
    block, both as they were after it (also when the block raises); ``quiet=False`` changes nothing."""
    from transformers.utils import logging as tf_logging

    from blockhess_lab.runtime import quiet_transformers

    original = (tf_logging.get_verbosity(), tf_logging.is_progress_bar_enabled())
    tf_logging.set_verbosity_warning()
    tf_logging.enable_progress_bar()
    before = (tf_logging.WARNING, True)
    try:
        with quiet_transformers(False):
            assert (tf_logging.get_verbosity(), tf_logging.is_progress_bar_enabled()) == before
        with pytest.raises(RuntimeError, match="inside"):
            with quiet_transformers():
                assert tf_logging.get_verbosity() == tf_logging.ERROR and not tf_logging.is_progress_bar_enabled()
                raise RuntimeError("inside")
        assert (tf_logging.get_verbosity(), tf_logging.is_progress_bar_enabled()) == before
    finally:  # the process's settings as they were, whatever failed
        tf_logging.set_verbosity(original[0])
        if not original[1]:
            tf_logging.disable_progress_bar()
