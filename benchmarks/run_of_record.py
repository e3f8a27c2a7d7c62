"""``python benchmarks/run_of_record.py --out FILE``: issue 29's run of record. On a GPT-2-small-sized
``GPT2LMHeadModel`` (the ``gpt2-small`` preset of ``blockhess spectrum --model``: random weights, vocabulary
50,257), one sequence of 128 random tokens, mean next-token cross-entropy, float32, one thread: the top-5
eigenvalues (``blockwise_eigs``, Lanczos to ``--tol``, ``--check-runs`` checks of at least ``--check`` products
each) and the SLQ density (``blockwise_slq``, ``--probes`` × ``--steps``) of Zhang et al.'s 25 tensors, in
lock-step. The densities take the eigensolver's own runs as probes (``probes=``: its first run from a random
start when ``--ncv`` leaves it ``--steps`` steps before a restart, and its checks, each on the complement of
the found vectors; docs/derivations.md §17, "Probes kept from the eigensolver"): only the probes still
missing are drawn and multiplied.

Memory: the 25 tensors hold 66.9M entries, 38.6M of them ``W_E``'s. Every lock-step block keeps its own
Lanczos basis and its checks', which grow until they certify the block. So the work runs as two phases
(``--phases``), each in a fresh process with its own operator: ``W_E`` alone and the 24 layer tensors
together, each its top-5 and then its densities (``W_E``'s top-5 after the layers' in one process was
killed by the kernel at 24 GB: docs/results.md, "The run of record"). The log prints every 10 lock-step
products; the JSON keeps each phase's wall time (and its process's, set-up included), the top-5's and the
densities' products and columns per tensor, the probes each density took from the eigensolver, peak
resident memory, the eigenvalues, residuals, checks and densities, ``os.getloadavg()`` at start and end;
``total_s`` is the whole run's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402

import blockhess as bh  # noqa: E402
from blockhess.operators import blockwise_eigs, blockwise_slq  # noqa: E402
from blockhess_lab import spectrum_model as SM  # noqa: E402
from blockhess_lab.runtime import environment, git_commit, load_average  # noqa: E402


PHASES = ("W_E", "layers")


def phase(args, name: str, log) -> dict:
    """One phase in this process: ``W_E`` or ``layers`` (``W_E`` alone or the 24 layer tensors together), the
    top-k and then the densities; their wall times, products, columns, peak memory and per-tensor results."""
    cfg, params, family = SM.read_model(SM.preset_model(args.model, args.seed), torch.float32, args.model)
    ids = SM.tokens(None, cfg.vocab, 1, args.seq_len, args.seed, cfg.n_positions)
    names = SM.default_tensors(cfg, family)
    t = time.perf_counter()
    A = bh.hessian_operator(params, ids[:, :-1], cfg, loss="ce", target=ids[:, 1:])
    out = {"operator_s": time.perf_counter() - t}
    log(f"{name}: operator {out['operator_s']:.1f} s; {len(names)} tensors")
    blocks = ["W_E"] if name == "W_E" else [n for n in names if n != "W_E"]
    D = A.block_diagonal(blocks)
    real, state = D.products, {"n": 0, "t": time.perf_counter()}

    def products(X, out=None):
        state["n"] += 1
        if state["n"] % 10 == 0:
            log(f"{name}: {state['n']} products ({time.perf_counter() - state['t']:.0f} s), "
                f"{sum(x.shape[1] for x in X.values())} columns in this one")
        return real(X) if out is None else real(X, out)
    D.products = products
    t = time.perf_counter()
    E = blockwise_eigs(D, k=args.k, tol=args.tol, ncv=args.ncv, check=args.check, check_runs=args.check_runs,
                       seed=args.seed, allow_unconverged=True)
    out["eigs"] = {"seconds": time.perf_counter() - t, "products": E.products, "matvecs": dict(E.matvecs),
                   "product_bytes": E.product_bytes}
    log(f"{name}: top-{args.k} {out['eigs']['seconds']:.0f} s, {E.products} products")
    t = time.perf_counter()
    S = blockwise_slq(D, n_probes=args.probes, n_iter=args.steps, seed=args.seed, reorth=args.reorth, probes=E)
    out["slq"] = {"seconds": time.perf_counter() - t, "products": S.products, "matvecs": dict(S.matvecs),
                  "product_bytes": S.product_bytes}
    log(f"{name}: densities {out['slq']['seconds']:.0f} s, {S.products} products")
    out.update({"seconds": out["eigs"]["seconds"] + out["slq"]["seconds"], "products": E.products + S.products,
                "matvecs": {b: E.matvecs[b] + S.matvecs[b] for b in blocks},
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    tensors = {}
    for i, b in enumerate(blocks):
        r, d = E[b], S[b]
        tensors[b] = {"n": int(D.sizes[i]), "eigenvalues": r.eigenvalues.double().tolist(),
                      "residuals": r.residuals.double().tolist(), "converged": bool(r.converged),
                      "miss_probability": float(r.miss_probability), "method": r.method, "matvecs": int(r.matvecs),
                      "check_matvecs": int(r.check_matvecs),
                      "probes_kept": sum(1 for q in r.probes if q.covers(args.steps)),
                      "density": {"grid": d.grid.double().tolist(), "density": d.density.double().tolist(),
                                  "sigma": float(d.sigma), "matvecs": int(d.matvecs)}}
    return {"phase": out, "tensors": tensors}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-small", help="a GPT-2 preset of blockhess spectrum --model")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--ncv", type=int, default=40)
    p.add_argument("--check", type=int, default=30, help="each check run's fewest products")
    p.add_argument("--check-runs", type=int, default=3)
    p.add_argument("--probes", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--reorth", default="none", choices=("full", "none"))
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, each in a fresh process: {PHASES}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # a worker: one phase, its JSON to --out
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    if args.phase:
        with open(args.out, "w") as f:
            json.dump(phase(args, args.phase, log), f)
        return 0
    settings = {k: v for k, v in vars(args).items() if k != "phase"}
    rep = {"benchmark": "run_of_record", "commit": git_commit(), "environment": environment(), "settings": settings,
           "load_average_at_start": load_average(), "phases": {}, "tensors": {}}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items() if k not in ("phases", "out")]
    for name in args.phases.split(","):
        part = f"{args.out}.{name}.part"
        t = time.perf_counter()
        done = subprocess.run([sys.executable, os.path.abspath(__file__), *flags, f"--phase={name}", f"--out={part}"])
        if done.returncode != 0:  # the phases before it are kept, the failure named
            rep.update(failed=name, returncode=done.returncode, total_s=time.perf_counter() - t0,
                       load_average_at_end=load_average())
            with open(args.out, "w") as f:
                json.dump(rep, f, indent=1)
            log(f"{name}: the worker exited with {done.returncode}; the phases before it written to {args.out}")
            return 1
        with open(part) as f:
            got = json.load(f)
        os.remove(part)
        got["phase"]["process_s"] = time.perf_counter() - t
        rep["phases"][name] = got["phase"]
        for b, v in got["tensors"].items():
            rep["tensors"].setdefault(b, {}).update(v)
    rep["total_s"] = time.perf_counter() - t0
    rep["columns"] = sum(sum(ph["matvecs"].values()) for ph in rep["phases"].values())
    rep["peak_rss_bytes"] = max(ph["peak_rss_bytes"] for ph in rep["phases"].values())
    rep["load_average_at_end"] = load_average()
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
    log(f"total {rep['total_s']:.0f} s, {rep['columns']} tensor-columns, peak {rep['peak_rss_bytes'] / 2**30:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
