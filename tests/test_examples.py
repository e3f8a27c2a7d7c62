"""The gallery (examples/, rendered into the docs by docs/gallery.py): each script runs in a fresh
interpreter from a temporary folder, exits 0, writes the files it says it wrote, and stays short."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_the_gallery_has_its_examples():
    assert {p.stem for p in EXAMPLES} >= {"block_hessian", "gpt2_whole_model", "operator_spectrum", "estimators",
                                           "distributed", "digits_vit"}


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(script, tmp_path):
    assert len(script.read_text().splitlines()) <= 80, f"{script.name}: an example is at most 80 lines"
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("RANK", None)
    run = subprocess.run([sys.executable, str(script), str(out)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip(), f"{script.name} printed nothing"
    wrote = re.findall(r"^wrote (.+)$", run.stdout, flags=re.M)
    for path in wrote:
        assert (tmp_path / path).is_file() and (tmp_path / path).stat().st_size > 0, path
    figures = re.findall(r"OUT/(\S+\.png)", script.read_text())
    assert {Path(p).name for p in wrote} == set(figures), "the figures the docstring names are those written"
