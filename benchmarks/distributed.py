"""``python benchmarks/distributed.py``: the digits ViT's dataset Hessian on 1 against 2 processes
(docs/results.md, "Dataset Hessian on several processes"; docs/distributed.md).

Each sample is one ``torchrun --standalone --nproc_per_node=W -m blockhess distributed`` run (gloo,
one torch thread and ``OMP_NUM_THREADS=1`` per process) over the first ``--n-images`` training images
(default: all), in the order 1, 2, 1, 2, ... so that both see the same load; from each run's
``distributed.json``: the Hessian's wall time on the slowest rank (from the start, all ranks
together, to every rank holding the result), the time of one ``all_reduce`` of the ``n × n`` buffer
timed alone after it, and each rank's own, with its CPU time. Reports the median throughput
(images/s) of each ``W``, their ratio, the ratio of the slowest rank's CPU time to one process's (what
the speed-up would be on free cores, the waits for the messages left out), the all-reduce's share of
the time, and the load average before and after each run. The machine may be shared: the JSON's
``summary.meaningful`` is ``false`` when a rank of some run had a core for less than 90 % of its wall
time (its CPU time over its wall time): the ratio then measures the sharing, not the method. Writes ``--out`` (default ``benchmarks/results/distributed-<commit>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SRC = os.path.join(ROOT, "src")
CORE_SHARE = 0.9  # a rank's CPU time over its wall time below which the run measures sharing (summarise)
sys.path.insert(0, SRC)


def summarise(samples: list, procs: list) -> dict:
    """Medians per process count, the speed-ups, and whether the runs measure the method: every rank
    of every run had a core for at least ``CORE_SHARE`` of its wall time (its CPU time over its wall
    time; a rank waiting for a message or for a core shared with other work falls below)."""
    med = {W: {"images_per_second": statistics.median(s["images_per_second"] for s in samples if s["processes"] == W),
               "hessian_seconds": statistics.median(s["hessian_seconds"] for s in samples if s["processes"] == W),
               "all_reduce_seconds": statistics.median(s["all_reduce_seconds"] for s in samples if s["processes"] == W),
               "all_reduce_share": statistics.median(s["all_reduce_share"] for s in samples if s["processes"] == W),
               "hessian_cpu_seconds_max": statistics.median(s["hessian_cpu_seconds_max"] for s in samples
                                                            if s["processes"] == W)}
           for W in procs}
    cores = os.cpu_count() or 1
    loads = [s["load_before"][0] for s in samples]
    share = min(r["hessian_cpu_seconds"] / r["hessian_seconds"] for s in samples for r in s["per_rank"])
    summary = {
        "median": {str(W): v for W, v in med.items()},
        "speedup": {str(W): med[W]["images_per_second"] / med[procs[0]]["images_per_second"] for W in procs},
        # the slowest rank's CPU time against one process's: the speed-up on free cores, communication waits left out
        "cpu_time_speedup": {str(W): med[procs[0]]["hessian_cpu_seconds_max"] / med[W]["hessian_cpu_seconds_max"]
                             for W in procs},
        "target_speedup_2": 1.7,
        "load_before_max": max(loads), "logical_cpus": cores,
        "core_share_min": share, "meaningful": share >= CORE_SHARE and max(procs) <= cores,
        "note": (f"every rank had a core for at least {CORE_SHARE:.0%} of its wall time" if share >= CORE_SHARE
                 else "a rank ran on a core for less than {:.0%} of its wall time: the processes shared cores with other "
                      "work and the ratio measures that sharing, not the method; rerun on a quiet machine".format(CORE_SHARE)),
    }
    return summary


def _run(W: int, args, folder: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = os.path.join(folder, f"w{W}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={W}", "-m", "blockhess",
           "distributed", "--what", args.what, "--threads", "1", "--quiet", "--out", out]
    if args.n_images:
        cmd += ["--n-images", str(args.n_images)]
    if args.checkpoint:
        cmd += ["--checkpoint", args.checkpoint]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=args.cwd)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"torchrun with {W} processes failed ({done.returncode}):\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "distributed.json")) as f:
        res = json.load(f)
    shutil.rmtree(out)
    t = res["timing"]
    return {"processes": W, "hessian_seconds": t["hessian_seconds"], "images_per_second": t["images_per_second"],
            "hessian_cpu_seconds_max": t["hessian_cpu_seconds_max"],
            "all_reduce_seconds": t["all_reduce_seconds"], "all_reduce_share": t["all_reduce_share"],
            "per_rank": t["per_rank"], "launch_wall_seconds": wall, "load_before": list(load_before),
            "load_after": list(os.getloadavg()), "n": res["n"], "n_images": res["n_images"],
            "all_reduce_bytes": t["all_reduce_bytes"], "frobenius": res["frobenius"], "environment": res["environment"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-images", type=int, default=None, help="training images (default: all)")
    p.add_argument("--what", choices=("model", "block"), default="model")
    p.add_argument("--repeats", type=int, default=3, help="samples of each process count (default: 3)")
    p.add_argument("--procs", default="1,2", help="process counts, comma-separated (default: 1,2)")
    p.add_argument("--checkpoint", default=None, help="digits ViT checkpoint (default: the commands' default file)")
    p.add_argument("--cwd", default=ROOT, help="folder the runs start in (default checkpoint under it; default: the checkout)")
    p.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/distributed-<commit>.json)")
    args = p.parse_args(argv)
    from blockhess_lab.runtime import git_commit

    procs = [int(w) for w in args.procs.split(",")]
    commit = git_commit()
    out = args.out or os.path.join(HERE, "results", f"distributed-{(commit or 'unknown').replace('+dirty', '')}.json")
    samples = []
    with tempfile.TemporaryDirectory(prefix="bh-dist-bench-") as folder:
        for r in range(args.repeats):
            for W in procs:
                s = _run(W, args, folder)
                s["repeat"] = r
                samples.append(s)
                print(f"W={W} repeat {r}: {s['hessian_seconds']:.2f} s ({s['images_per_second']:.1f} images/s), "
                      f"all-reduce {s['all_reduce_seconds'] * 1e3:.1f} ms, load {s['load_before'][0]:.2f}", flush=True)
    summary = summarise(samples, procs)
    res = {"what": args.what, "n_images": samples[0]["n_images"], "n": samples[0]["n"], "procs": procs,
           "repeats": args.repeats, "commit": commit, "summary": summary, "samples": samples}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
        f.write("\n")
    print(json.dumps(summary, indent=2))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
