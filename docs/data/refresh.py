"""Re-run the commands whose numbers the docs quote, and keep their JSON here.

``python docs/data/refresh.py [NAME ...]`` (``make docs-data`` runs it for every NAME) runs,
one after the other, each command of :data:`RUNS` with one torch thread (``--threads 1``,
``OMP_NUM_THREADS=1``) into ``runs/NAME/`` (ignored by git: JSON, markdown and figures as the
command writes them), then

- copies its JSON to ``docs/data/NAME.json``, without the per-point arrays that :data:`TRIM`
  leaves out (they stay in ``runs/NAME/``), so that every stored file stays under a few hundred KB;
- copies the figures the docs show (:data:`FIGURES`) to ``docs/figures/``, the large heat maps
  reduced (:data:`REDUCED`: 0.6 of their size, 256 colours);
- records in ``docs/data/runs.json`` the command line, wall-clock and CPU seconds, the load
  average before and after, when it finished, the git commit and whether ``src/`` had
  uncommitted changes.

``tests/test_docs_figures.py`` then checks every figure that docs/results.md, docs/bounds.md,
docs/convergence.md and README.md quote from these runs against the stored JSON: after a
refresh, update the quotes it reports as different. Timings are those of the machine the
refresh ran on (the load average beside them says how busy it was).

The commands read or train the digits ViT at ``checkpoints/digits_vit.pt``. With no NAME,
all runs: about 14 minutes on two busy shared cores, 8.5 minutes of CPU (``runs.json`` has
each one's time; ``spectrum`` alone about 4 minutes).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "data"
RAW = ROOT / "runs"

#: name -> (blockhess command and options, JSON file it writes); the options are the ones the docs quote
RUNS = {
    "validate-full": (["validate"], "validate.json"),
    "validate-quick": (["validate", "--quick"], "validate.json"),
    "bounds": (["bounds"], "bounds.json"),
    "scaling-full": (["scaling"], "scaling.json"),
    "scaling-quick": (["scaling", "--quick"], "scaling.json"),
    "convergence-full": (["convergence"], "convergence.json"),
    "convergence-quick": (["convergence", "--quick"], "convergence.json"),
    "report": (["report"], "report.json"),
    "spectrum": (["spectrum", "--series", "--tol", "1e-8"], "spectrum.json"),
}


def _tightest(rows: list[dict]) -> dict:
    row = min((r for r in rows if r["ratio"] is not None), key=lambda r: r["ratio"])
    return {k: row[k] for k in ("block", "norm", "bound", "ratio")}


def _bounds(data: dict) -> dict:
    """Each of the sweep's points keeps its settings and its tightest row (smallest valid bound/norm), not
    all its rows (1.5 MB in all); the docs quote the summary, the failures, the counts and the tightest ratio."""
    meta = ("kind", "L", "weight_scale", "sigma", "seed", "target")
    points = [{**{m: p[m] for m in meta}, "tightest": _tightest(p["rows"])} for p in data["sweep"]["points"]]
    return {**data, "sweep": {**data["sweep"], "points": points}}


def _no_records(data: dict) -> dict:
    """Without ``records``, every measured norm (5.7 MB for the full preset); the docs quote the fits."""
    return {k: v for k, v in data.items() if k != "records"}


def _no_density_curves(data: dict) -> dict:
    """Each block's SLQ density without its curves on the grid (grid, density, stderr, quadrature error:
    0.8 MB); its settings, width and products stay, and the figure shows the curves."""
    curves = ("grid", "density", "stderr", "quadrature_error")
    blocks = {key: {part: {**r, "density": {k: v for k, v in r["density"].items() if k not in curves}}
                    if "density" in r else r for part, r in parts.items()}
              for key, parts in data["spectra"]["blocks"].items()}
    return {**data, "spectra": {**data["spectra"], "blocks": blocks}}


#: name -> what the stored copy keeps of the command's JSON (all of it where absent)
TRIM = {"bounds": _bounds, "scaling-full": _no_records, "scaling-quick": _no_records, "spectrum": _no_density_curves}

#: name -> (figure the command writes, name under docs/figures)
FIGURES = {
    "bounds": [("bounds.png", "bounds.png")],
    "scaling-full": [(f, f) for f in ("scaling_input_scale.png", "scaling_seq_len.png", "scaling_ln_variance.png")],
    "convergence-full": [(f"{f}.png", f"convergence_{f}.png")
                         for f in ("differences", "bound", "taylor", "assumption1", "spectra")],
    "report": [("training_dynamics.png", "report_training_dynamics.png")],
    "spectrum": [(f"{f}.png", f"spectrum_{f}.png") for f in ("eigenvalues", "density", "series")],
}

#: name -> (figure the command writes, name under docs/figures), stored reduced (:func:`_reduced`)
REDUCED = {"report": [("model_hessian.png", "report_model_hessian.png"),
                      ("two_block_hessian.png", "report_two_block_hessian.png")]}


def _reduced(src: Path, dst: Path, scale: float = 0.6) -> None:
    """A heat map at ``scale`` of its size in 256 colours (a tenth of the bytes; Pillow comes with matplotlib)."""
    from PIL import Image

    im = Image.open(src).convert("RGB")
    im = im.resize((round(im.size[0] * scale), round(im.size[1] * scale)), Image.LANCZOS)
    im.quantize(256, method=Image.Quantize.MAXCOVERAGE).save(dst, optimize=True)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def refresh(name: str) -> dict:
    """Run ``name`` of :data:`RUNS`, store its JSON and figures; returns its entry of ``runs.json``."""
    argv, json_name = RUNS[name]
    out = RAW / name
    cmd = [*argv, "--threads", "1", "--quiet", "--out", str(out.relative_to(ROOT))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    print(f"blockhess {' '.join(cmd)}", flush=True)
    commit = _git("rev-parse", "--short", "HEAD")
    src_changed = bool(_git("status", "--porcelain", "--", "src"))  # uncommitted changes to the code
    load_start = list(os.getloadavg())
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", "import sys; from blockhess_lab.cli import main; sys.exit(main())", *cmd],
                          cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"blockhess {' '.join(cmd)} exited with status {proc.returncode}; nothing stored for {name}")
    data = json.loads((out / json_name).read_text())
    (DATA / f"{name}.json").write_text(json.dumps(TRIM.get(name, lambda d: d)(data), indent=1, allow_nan=False) + "\n")
    for src, dst in FIGURES.get(name, []):
        shutil.copyfile(out / src, ROOT / "docs" / "figures" / dst)
    for src, dst in REDUCED.get(name, []):
        _reduced(out / src, ROOT / "docs" / "figures" / dst)
    return {
        "command": "blockhess " + " ".join(cmd[:-2]),
        "wall_s": wall,
        "cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
        "load_average_start": load_start,
        "load_average_end": list(os.getloadavg()),
        "cpus": os.cpu_count(),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": commit,
        "src_changed": src_changed,
        "trimmed": name in TRIM,  # what the stored copy leaves out: TRIM
    }


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        print(f"refresh.py: error: unknown run {', '.join(unknown)}; known: {', '.join(RUNS)}", file=sys.stderr)
        return 2
    index = DATA / "runs.json"
    runs = json.loads(index.read_text()) if index.exists() else {}
    for name in names or list(RUNS):
        runs[name] = refresh(name)
        index.write_text(json.dumps({k: runs[k] for k in RUNS if k in runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
