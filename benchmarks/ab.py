"""``python benchmarks/ab.py --base COMMIT``: the core at ``COMMIT`` against this checkout's, on the
bench's group (b) problems (full float64 Hessians), timed in one process (docs/results.md, "A/B").

Three packages are imported side by side: the base (``git archive`` of ``src/blockhess`` at
``--base``), this checkout's, and a second copy of this checkout's (``copy``). The copy gives the
noise: current against copy compares a package with itself, so its ratios show how far two
identical packages' medians drift apart in the same rounds on this machine. Each round times every
case with every package in a rotated order; one thread; after ``--warmup`` calls each. Every
package is given its own ``BlockConfig`` (built from the same fields) and the same tensors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics as st
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, HERE)

from threads import base_package  # noqa: E402

# the bench's group (b) cases (blockhess_lab.bench): id -> Problem spec
CASES = {
    "b/mse/8x16x32": dict(kind="hessian", L=8, d=16, d_ff=32, dtype="float64", loss="mse"),
    "b/ce/8x16x32": dict(kind="hessian", L=8, d=16, d_ff=32, dtype="float64", loss="ce"),
    "b/mse/16x32x64": dict(kind="hessian", L=16, d=32, d_ff=64, dtype="float64", loss="mse"),
    "b/ce/16x32x64": dict(kind="hessian", L=16, d=32, d_ff=64, dtype="float64", loss="ce"),
    "b/digits/B128": dict(kind="hessian", L=16, d=16, d_ff=32, dtype="float64", loss="digits", B=128, ln_eps=1e-5),
    "b/mse/torch-layer-16x32x64-4heads": dict(kind="hessian", L=16, d=32, d_ff=64, dtype="float64", loss="mse", heads=4),
    "b/mse/32x64x128": dict(kind="hessian", L=32, d=64, d_ff=128, dtype="float64", loss="mse"),
}


def _copy_of_current() -> str:
    d = tempfile.mkdtemp(prefix="blockhess_copy")
    shutil.copytree(os.path.join(ROOT, "src", "blockhess"), os.path.join(d, "blockhess_copy"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    return d


def _call(bh, P):
    cfg = bh.BlockConfig(**dataclasses.asdict(P.cfg))
    loss, target = P.bh_loss()
    return lambda: bh.hessian(P.params, P.X, cfg, loss=loss, target=target).dense()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="commit of the base package")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, base_package(args.base))
    sys.path.insert(0, _copy_of_current())
    import blockhess as current
    import blockhess_base as base
    import blockhess_copy as copy
    from blockhess_lab import bench_worker as bw

    impls = {"base": base, "current": current, "copy": copy}
    cases = args.cases.split(",")
    fs = {}
    for c in cases:
        P = bw.Problem(dict(CASES[c], seed=0))
        for i, bh in impls.items():
            fs[(c, i)] = _call(bh, P)
            for _ in range(args.warmup):
                fs[(c, i)]()
    order = list(impls)
    times: dict = {}
    load0 = os.getloadavg()
    for r in range(args.rounds):
        for c in cases:
            for i in order[r % 3:] + order[: r % 3]:
                t = time.perf_counter()
                fs[(c, i)]()
                times.setdefault(f"{c}/{i}", []).append(time.perf_counter() - t)
    med = {k: 1e3 * st.median(v) for k, v in times.items()}
    rows = {c: {"base_ms": med[f"{c}/base"], "current_ms": med[f"{c}/current"], "copy_ms": med[f"{c}/copy"],
                "current_over_base": med[f"{c}/current"] / med[f"{c}/base"],
                "current_over_copy": med[f"{c}/current"] / med[f"{c}/copy"]} for c in cases}
    for c, r in rows.items():
        print(f"{c:40s} base {r['base_ms']:9.2f} ms  current {r['current_ms']:9.2f} ms  copy {r['copy_ms']:9.2f} ms  "
              f"current/base {r['current_over_base']:.3f}  current/copy {r['current_over_copy']:.3f}", flush=True)
    result = {"base": args.base, "torch": torch.__version__, "threads": 1, "rounds": args.rounds, "warmup": args.warmup,
              "cpus": os.cpu_count(), "load_at_start": load0, "load_at_end": os.getloadavg(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows, "times_s": times}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
