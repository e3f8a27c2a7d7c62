"""``python benchmarks/anchor_extrapolation.py --run FILE``: the run of record's work (``run_of_record.py``'s JSON)
by the anchor's method, timed on a few steps and extrapolated (issue 29).

Zhang et al.'s method (NeurIPS 2024, the hessian-spectrum code; ``benchmarks/lockstep.py``'s ``zhang``): per
tensor and Lanczos step a forward, one ``create_graph=True`` gradient and a full second backward. Its cost per
tensor-column does not depend on the tensor or on the weights, so one step over the 25 tensors on a
GPT-2-small-sized ``GPT2LMHeadModel`` of the run's shape (B = 1, L = the run's ``--seq-len``; float32, one
thread) is timed (``--warmup`` then ``--rounds`` steps, the median), divided by 25, and multiplied by

* the run of record's tensor-columns (its top-k and SLQ phases together: the same work by their method), and
* their own settings' (100 Lanczos steps × 10 probes × 25 tensors).

The result is added to the run's JSON under ``"anchor"`` (the file is rewritten whole, atomically).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import torch  # noqa: E402

import interleaved  # noqa: E402  (benchmarks/, the script's own folder)
import lockstep  # noqa: E402
from blockhess_lab.runtime import git_commit, load_average  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run_of_record.py's JSON (read, then rewritten with 'anchor')")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    with open(args.run) as f:
        run = json.load(f)
    torch.set_num_threads(1)
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    L, seed = run["settings"]["seq_len"], run["settings"]["seed"]
    start_load = load_average()
    P = lockstep.Problem(1, L, 50257, 12, 768, 12, seed)
    times, _ = interleaved.rounds({"zhang": lockstep.setup(P, "zhang")}, args.rounds, args.warmup, log,
                                  keep=lambda m, out: None)
    step = statistics.median(times["zhang"])
    per_column = step / len(P.blocks)
    theirs = 100 * 10 * len(P.blocks)
    run["anchor"] = {
        "method": "zhang (lockstep.py): per tensor a forward, a create_graph gradient and a full second backward",
        "commit": git_commit(), "shape": [1, L], "tensors": len(P.blocks), "step_seconds": times["zhang"],
        "median_step_s": step, "per_tensor_column_s": per_column,
        "run_columns": run["columns"], "extrapolated_run_s": per_column * run["columns"],
        "their_settings_columns": theirs, "extrapolated_their_settings_s": per_column * theirs,
        "ours_total_s": run["total_s"], "ratio_extrapolated_over_ours": per_column * run["columns"] / run["total_s"],
        "load_average_at_start": start_load, "load_average_at_end": load_average()}
    tmp = args.run + ".tmp"
    with open(tmp, "w") as f:
        json.dump(run, f, indent=1)
    os.replace(tmp, args.run)
    a = run["anchor"]
    log(f"their step {step:.1f} s ({per_column:.2f} s a tensor-column): the run's {a['run_columns']} columns "
        f"{a['extrapolated_run_s']:.0f} s against ours {run['total_s']:.0f} s ({a['ratio_extrapolated_over_ours']:.1f}x); "
        f"their settings {a['extrapolated_their_settings_s'] / 3600:.1f} h")
    return 0


if __name__ == "__main__":
    sys.exit(main())
