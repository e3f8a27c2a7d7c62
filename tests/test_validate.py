"""``blockhess validate`` end to end (quick grid) and the all-or-nothing output folder."""

import json
import os

import pytest

from blockhess_lab.cli import main
from blockhess_lab import validate as V
from blockhess_lab.outputs import MARKER, atomic_dir


def test_validate_quick(tmp_path):
    out = tmp_path / "val"
    assert main(["validate", "--quick", "--quiet", "--out", str(out)]) == 0
    data = json.loads((out / "validate.json").read_text())
    assert data["passed"] and data["max_rel_error"] <= 1e-10
    assert len(data["cases"]) == 45 and {c["setting"] for c in data["cases"]} == set(V.OPTIONS)
    assert sum(c["wrt_input"] for c in data["cases"]) == 27 and max(c["n_heads"] for c in data["cases"]) == 2
    for c in data["cases"]:  # each case ran the block its label names
        options, wrt_input = V.OPTIONS[c["setting"]]
        want = {**options, "n_heads": options.get("n_heads", 1) if c["d_model"] % 2 == 0 else 1}
        assert {k: c["config"][k] for k in want} == want and c["wrt_input"] == wrt_input, c["setting"]
    assert {c["loss"] for c in data["cases"]} == {"mse", "ce", "custom"}
    assert (out / "validate.md").read_text().startswith("# blockhess validate")
    assert "tolerance 1e-10: **passed**." in (out / "validate.md").read_text()


def test_validate_failure_is_shown_quiet_or_not(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(V, "QUICK_GRID", V.FULL_GRID[:1])
    monkeypatch.setattr(V, "OPTIONS", {k: V.OPTIONS[k] for k in ["attention (paper)"]})
    out = tmp_path / "val"
    assert main(["validate", "--quick", "--out", str(out)]) == 0  # a pass: the summary line says so, stderr is empty
    std = capsys.readouterr()
    assert std.out.startswith("passed: max relative error") and std.err == ""
    monkeypatch.setattr(V, "rel_error", lambda *a: 1e-3)  # as if far off
    for quiet in ([], ["--quiet"]):
        assert main(["validate", "--quick", "--tol", "1e-10", "--out", str(out), *quiet]) == 1
        std = capsys.readouterr()
        if quiet:
            assert std.out == ""
        else:
            assert std.out.startswith("FAILED: max relative error 1.00e-03")
        assert std.err.startswith("blockhess validate: FAILED: largest relative error 1.00e-03 is above --tol 1e-10, in "
                                  "the jacobian of attention (paper), L=1, d=4, d_k=4, scale 1, loss mse")
        assert std.err.count("\n") == 1
        data = json.loads((out / "validate.json").read_text())
        assert not data["passed"] and data["max_rel_error_case"].startswith("jacobian of attention (paper)")
        assert "tolerance 1e-10: **FAILED** (above the tolerance)." in (out / "validate.md").read_text()


def test_atomic_dir_leaves_nothing_on_error(tmp_path):
    out = tmp_path / "res"
    with atomic_dir(out) as tmp:
        (tmp / "old.txt").write_text("previous results")
    with pytest.raises(RuntimeError):
        with atomic_dir(out) as tmp:
            (tmp / "partial.json").write_text("{")
            raise RuntimeError("failed half way")
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "old.txt"])
    assert [p.name for p in tmp_path.iterdir()] == ["res"]  # no temporary folder left behind


def test_atomic_dir_replaces_only_results_or_empty_folders(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "main.py").write_text("code")
    with pytest.raises(OSError, match="holds files that are not blockhess results"):
        with atomic_dir(work):
            raise AssertionError("not reached: refused before any work")
    assert [p.name for p in work.iterdir()] == ["main.py"]
    inner = tmp_path / "inner"
    inner.mkdir()
    (tmp_path / MARKER).write_text("")  # even a folder of results
    (inner / MARKER).write_text("")
    monkeypatch.chdir(inner)
    for here in (".", inner, "..", tmp_path):  # the current folder, and one above it
        with pytest.raises(OSError, match="is the current folder or one above it"):
            with atomic_dir(here):
                raise AssertionError("not reached")
    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic_dir(empty) as tmp:
        (tmp / "a.json").write_text("{}")
    with atomic_dir(empty) as tmp:  # a previous run's results are replaced
        (tmp / "b.json").write_text("{}")
    assert sorted(p.name for p in empty.iterdir()) == sorted([MARKER, "b.json"])
    assert main(["validate", "--quick", "--quiet", "--out", str(work)]) == 2
    assert [p.name for p in work.iterdir()] == ["main.py"]


def test_atomic_dir_gives_an_ordinary_folder(tmp_path):
    out = tmp_path / "res"
    with atomic_dir(out) as tmp:
        (tmp / "a.json").write_text("{}")
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "a.json").exists() and out.stat().st_mode & 0o777 == 0o777 & ~umask


def test_unwritable_out_is_one_line_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["validate", "--quick", "--quiet", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("blockhess validate: error: cannot write to --out") and "\n" not in err


def test_atomic_dir_rechecks_before_replacing(tmp_path):
    """A file put into --out while the command ran is not deleted by the final move."""
    out = tmp_path / "res"
    out.mkdir()
    with pytest.raises(OSError, match="not blockhess results"):
        with atomic_dir(out) as tmp:
            (tmp / "a.json").write_text("{}")
            (out / "user.txt").write_text("written during the run")
    assert [p.name for p in out.iterdir()] == ["user.txt"]


@pytest.mark.parametrize("cmd, module, work", [("scaling", "scaling", "compute"), ("bounds", "bounds", "_random_tables"),
                                               ("convergence", "vit", "load_for_command")])
def test_bad_out_is_refused_before_any_work(tmp_path, monkeypatch, cmd, module, work):
    import importlib

    def started(*args, **kwargs):
        raise AssertionError("work started")

    monkeypatch.setattr(importlib.import_module(f"blockhess_lab.{module}"), work, started)
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "main.py").write_text("code")
    assert main([cmd, "--quiet", "--out", str(folder)]) == 2
    assert [p.name for p in folder.iterdir()] == ["main.py"]
