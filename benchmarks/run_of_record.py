"""``python benchmarks/run_of_record.py --out FILE``: issue 29's run of record. On a GPT-2-small-sized
``GPT2LMHeadModel`` (the ``gpt2-small`` preset of ``blockhess spectrum --model``: random weights, vocabulary
50,257), one sequence of 128 random tokens, mean next-token cross-entropy, float32, one thread: the top-5
eigenvalues (``blockwise_eigs``, Lanczos to ``--tol``, its check included) and the SLQ density
(``blockwise_slq``, ``--probes`` × ``--steps``) of Zhang et al.'s 25 tensors, in lock-step.

Memory: the 25 tensors hold 66.9M entries, 38.6M of them ``W_E``'s. Every lock-step block keeps its own
Lanczos basis and, once its residuals are met, its check's, which grows until it certifies the block: at
``ncv`` 20 the 25 at once went past this machine's 24 GB. So the top-5 runs as two lock-step calls, the 24
layer tensors together and ``W_E`` alone (``--eigs-groups``), each on the same operator; the densities run as
one lock-step call over all 25, without reorthogonalisation (``--reorth none``: 3 vectors per probe and
tensor; with ``full`` 32 GB). The log prints every 10 lock-step products; the JSON keeps each phase's wall
time, products and columns per tensor, the eigenvalues, residuals, checks and densities, ``os.getloadavg()``
at start and end, and the peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-small", help="a GPT-2 preset of blockhess spectrum --model")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--ncv", type=int, default=20)
    p.add_argument("--probes", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--reorth", default="none", choices=("full", "none"))
    p.add_argument("--eigs-groups", default="layers,W_E", help="lock-step calls of the top-k: layers (the 24), W_E, all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    rep = {"benchmark": "run_of_record", "commit": git_commit(), "environment": environment(), "settings": vars(args),
           "load_average_at_start": load_average(), "phases": {}}
    cfg, params, family = SM.read_model(SM.preset_model(args.model, args.seed), torch.float32, args.model)
    ids = SM.tokens(None, cfg.vocab, 1, args.seq_len, args.seed, cfg.n_positions)
    names = SM.default_tensors(cfg, family)
    t = time.perf_counter()
    A = bh.hessian_operator(params, ids[:, :-1], cfg, loss="ce", target=ids[:, 1:])
    rep["operator_s"] = time.perf_counter() - t
    log(f"operator {rep['operator_s']:.1f} s; {len(names)} tensors")

    def counted(D, label):
        real = D.products
        state = {"n": 0, "t": time.perf_counter()}

        def products(X, out=None):
            state["n"] += 1
            if state["n"] % 10 == 0:
                log(f"{label}: {state['n']} products ({time.perf_counter() - state['t']:.0f} s), "
                    f"{sum(x.shape[1] for x in X.values())} columns in this one")
            return real(X) if out is None else real(X, out)
        D.products = products
        return D

    groups = {"layers": [n for n in names if n != "W_E"], "W_E": ["W_E"], "all": names}
    eigs = {}
    for g in args.eigs_groups.split(","):
        D = counted(A.block_diagonal(groups[g]), f"top-{args.k} {g}")
        t = time.perf_counter()
        E = blockwise_eigs(D, k=args.k, tol=args.tol, ncv=args.ncv, seed=args.seed, allow_unconverged=True)
        rep["phases"][f"eigs_{g}"] = {"seconds": time.perf_counter() - t, "products": E.products,
                                      "matvecs": dict(E.matvecs), "product_bytes": E.product_bytes,
                                      "peak_rss_bytes_so_far": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        eigs.update(E.results)
        log(f"top-{args.k} {g}: {rep['phases'][f'eigs_{g}']['seconds']:.0f} s, {E.products} products")
        del D, E
    D = counted(A.block_diagonal(names), "SLQ")
    t = time.perf_counter()
    S = blockwise_slq(D, n_probes=args.probes, n_iter=args.steps, seed=args.seed, reorth=args.reorth)
    rep["phases"]["slq"] = {"seconds": time.perf_counter() - t, "products": S.products, "matvecs": dict(S.matvecs),
                            "product_bytes": S.product_bytes}
    log(f"SLQ: {rep['phases']['slq']['seconds']:.0f} s, {S.products} products")
    rep["tensors"] = {b: {"n": int(D.sizes[i]), "eigenvalues": eigs[b].eigenvalues.double().tolist(),
                          "residuals": eigs[b].residuals.double().tolist(), "converged": bool(eigs[b].converged),
                          "miss_probability": float(eigs[b].miss_probability), "method": eigs[b].method,
                          "matvecs": int(eigs[b].matvecs), "check_matvecs": int(eigs[b].check_matvecs),
                          "density": {"grid": S[b].grid.double().tolist(), "density": S[b].density.double().tolist(),
                                      "sigma": float(S[b].sigma)}}
                      for i, b in enumerate(names)}
    rep["total_s"] = time.perf_counter() - t0
    rep["columns"] = sum(sum(ph["matvecs"].values()) for ph in rep["phases"].values())
    rep["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rep["load_average_at_end"] = load_average()
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
    log(f"total {rep['total_s']:.0f} s, {rep['columns']} tensor-columns, peak {rep['peak_rss_bytes'] / 2**30:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
