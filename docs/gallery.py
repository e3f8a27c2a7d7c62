"""Writes the gallery's pages, docs/gallery/<example>.md, from examples/*.py: each page holds the
script's docstring, its source and what it printed and drew when run here (figures copied to
docs/gallery/figures/). `make docs` runs this before `mkdocs build`; the pages are generated, not
committed (.gitignore), so the site always shows what the current code prints.

    python docs/gallery.py            # from the repository root, with blockhess importable
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GALLERY = ROOT / "docs" / "gallery"
FIGURES = GALLERY / "figures"


def page(script: Path, work: Path) -> str:
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    title, _, rest = doc.partition("\n\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start = time.perf_counter()
    run = subprocess.run([sys.executable, str(script), str(work / "out")], cwd=work, env=env, capture_output=True,
                         text=True, timeout=600)
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        sys.exit(f"docs/gallery.py: examples/{script.name} failed (exit status {run.returncode}):\n{run.stdout}{run.stderr}")
    figures = []
    for path in re.findall(r"^wrote (.+)$", run.stdout, flags=re.M):
        target = FIGURES / f"{script.stem}-{Path(path).name}"
        shutil.copyfile(work / path, target)
        figures.append(target.name)
    load = os.getloadavg()[0]
    lines = [f"# examples/{script.name}", "", title.replace("\n", " "), "", rest.strip("\n"), "",
             f"Source: `examples/{script.name}`. Run when this site was built: {seconds:.1f} s wall clock on "
             f"{os.cpu_count()} CPUs at load average {load:.1f}, one thread.", "",
             "```python", script.read_text().rstrip(), "```", "", "## Output", "", "```text",
             (run.stdout + run.stderr).rstrip(), "```", ""]
    lines += [f"![{name}](figures/{name})\n" for name in figures]
    return "\n".join(lines)


def main() -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    for script in sorted((ROOT / "examples").glob("*.py")):
        with tempfile.TemporaryDirectory() as work:
            (GALLERY / f"{script.stem}.md").write_text(page(script, Path(work)))
        print(f"docs/gallery/{script.stem}.md", flush=True)


if __name__ == "__main__":
    main()
