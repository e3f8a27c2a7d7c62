"""``python benchmarks/threads_autograd.py --out FILE``: the closed form's dense block Hessian against
``torch.func.hessian`` on 1 and 2 intra-op threads, alone and beside one busy process (issue 29, item 5:
"with more threads than free cores, no worse relative to autograd than on one thread").

The case is the bench's ``b/mse/16x32x64`` (one sequence, L = 16, d = 32, d_ff = 64, MSE, float64, n = 7,168
here as there; ``blockhess_lab.bench_worker``'s own set-ups, ``closed_form_out`` and ``func_hessian``). For each
condition (threads 1 or 2; a busy process ``while True: pass`` started beside or not) the two methods are
timed in interleaved rounds after a warm-up in this process (``interleaved.rounds``: the order rotated each round); the JSON keeps
every time, the medians, torch.func's median over ours per condition and ``os.getloadavg()`` before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402

import interleaved  # noqa: E402  (benchmarks/, the script's own folder)
from blockhess_lab import bench_worker as bw  # noqa: E402
from blockhess_lab.runtime import environment, git_commit, load_average  # noqa: E402

SPEC = dict(kind="hessian", L=16, d=32, d_ff=64, B=0, dtype="float64", loss="mse", seed=0)
METHODS = ("closed_form_out", "func_hessian")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    P = bw.Problem(SPEC)
    calls = {m: bw.METHODS[m](P)[0] for m in METHODS}
    rep = {"benchmark": "threads_autograd", "commit": git_commit(), "environment": environment(), "spec": SPEC,
           "n": P.n, "load_average_at_start": load_average(), "conditions": {}}
    for busy in (False, True):
        proc = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            if busy:
                time.sleep(1.0)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                times, _ = interleaved.rounds(calls, args.rounds, 1, lambda msg: None, keep=lambda m, out: None)
                med = {m: statistics.median(t) for m, t in times.items()}
                key = f"threads{threads}" + ("_busy" if busy else "")
                rep["conditions"][key] = {"seconds": times, "median_s": med,
                                          "func_over_ours": med["func_hessian"] / med["closed_form_out"]}
                print(f"{key}: ours {med['closed_form_out'] * 1e3:.1f} ms, torch.func {med['func_hessian'] * 1e3:.1f} ms, "
                      f"{rep['conditions'][key]['func_over_ours']:.2f}x", flush=True)
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
    rep["load_average_at_end"] = load_average()
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
