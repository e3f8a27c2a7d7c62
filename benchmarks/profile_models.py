"""Where the closed form's time goes on the whole-model cases of ``blockhess bench`` group (m).

``python benchmarks/profile_models.py [--only m/gpt2/B8] [--threads 1] --out FILE``

For each case (the same problems as the bench, :func:`blockhess_lab.bench.model_cases`): one
warm-up call of ``blockhess.hessian(...).dense()``, then one call under ``torch.profiler`` (the
operators by self CPU time) and one under ``cProfile`` (the package's functions by cumulative
time). Writes the tables as text into ``--out``; docs/results.md quotes them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

import blockhess as bh
from blockhess_lab import bench
from blockhess_lab.bench_worker import make_problem
from blockhess_lab.runtime import git_commit, load_average


def profile(case: dict, rows: int) -> str:
    P = make_problem(case["problem"])
    loss, target = P.bh_loss()

    def call():
        return bh.hessian(P.params, P.X, P.cfg, loss=loss, target=target).dense()

    out = io.StringIO()
    t0 = time.perf_counter()
    call()
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    call()
    timed = time.perf_counter() - t0
    out.write(f"## {case['id']}: n = {P.n:,}, first call {warm:.2f} s, second {timed:.2f} s, load average {load_average()}\n\n")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    out.write("torch.profiler, operators by self CPU time:\n")
    out.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows) + "\n")
    pr = cProfile.Profile()
    pr.enable()
    call()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats("blockhess/", rows)
    out.write("cProfile, the package's functions by cumulative time:\n")
    out.write(s.getvalue() + "\n")
    return out.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated substrings of the case ids (default: every case)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--rows", type=int, default=25, help="rows of each table (default: 25)")
    p.add_argument("--out", required=True, help="the text file to write")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = bench.matching(bench.model_cases(quick=False, mem=False), args.only)
    if not cases:
        p.error(f"--only {args.only!r} matches no case")
    commit = git_commit() or "?"
    text = [f"blockhess {commit}, torch {torch.__version__}, {args.threads} thread(s)\n\n"]
    for c in cases:
        print(f"profiling {c['id']}", file=sys.stderr, flush=True)
        text.append(profile(c, args.rows))
    Path(args.out).write_text("".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
