r"""The exact diagonal of a GPT-2 block's Hessian (``A.diagonal()`` of ``bh.hessian_operator``) against
``k`` products ``A @ v`` (what a Hutchinson estimate of it costs), one thread, float32, MSE.

The block is the one of ``benchmarks/operators.py`` (a Hugging Face ``GPT2Block`` read by ``bh.from_torch``,
its own initialisation, random inputs and target) at one of its sizes. In one process: the operator is
built (forward cache and adjoints, timed apart), one product warms up, then half of ``--products``
products are timed one by one, the diagonal ``--rounds`` times, and the other half of the products (the
load of a shared machine drifts); reported, in wall-clock and in the process's CPU time: the products'
median, the diagonal's median, their ratio to 100 products, the diagonal's float32 error against the float64
diagonal on the same inputs (``--check``), the load average, and the FLOP count of the diagonal
(:func:`diagonal_flops`, docs/derivations.md §19). Notes in ``benchmarks/README.md``.

    python benchmarks/diagonal.py --size small --out benchmarks/results/run23-diagonal-small.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import blockhess as bh  # noqa: E402
from blockhess.block.diagonal import SYM_BLOCKS  # noqa: E402
from blockhess_lab.runtime import environment, load_average  # noqa: E402
from operators import SIZES, Problem  # noqa: E402


def diagonal_flops(cfg, B: int, L: int) -> dict:
    r"""Floating-point operations (2 per multiply-add) of the diagonal's matrix products for a pre-LN
    block with MSE (the per-token ``c·I``), by stage; docs/derivations.md §19. Per token, with
    ``f = (1 + 1/SYM_BLOCKS)/2`` the share of a symmetric product computed: ``G = W_1 diag(a') W_2``
    (``2 d² d_ff``), ``G Gᵀ`` (``2 f d³``), ``W_1 diag(ψ) W_1ᵀ`` (``2 f d² d_ff``), ``W_O M W_O^T``
    (``2 (1 + f) d³``), per head the rows' Jacobians ``V^T S_t K`` and ``V^T S_t X`` over the keys seen
    (``2 L_k d_v (d_k + d)``) and their quadratic forms (``2 d_v² (d_k + d)``), and the pre-LN
    ``gamma_1`` Jacobians (``2 d_v d_k d`` per head) and quadratic forms (``2 d³``), and ``beta_1``'s sums
    over tokens ``M^O C`` and ``Cᵀ M^O C`` (``2 d d_v d_k`` and ``2 d_k d_v H d_k`` per head)."""
    d, H, ff = cfg.d_model, cfg.n_heads, cfg.d_ff
    dv, dk = d // H, cfg.head_dim
    f = (1 + 1 / SYM_BLOCKS) / 2
    keys = (L + 1) / 2 if cfg.causal else L
    per = {
        "G = W_1 diag(a') W_2": 2 * d * d * ff,
        "G G^T (symmetric)": 2 * f * d ** 3,
        "W_1 diag(psi) W_1^T (symmetric)": 2 * f * d * d * ff,
        "W_O M W_O^T": 2 * (1 + f) * d ** 3,
        "attention rows' Jacobians": H * 2 * keys * dv * (dk + d),
        "their quadratic forms": H * 2 * dv * dv * (dk + d),
        "gamma_1": H * 2 * dv * dk * d + 2 * d ** 3,
        "beta_1": H * 2 * d * dv * dk + H * 2 * dk * dv * H * dk,
    }
    T = B * L
    return {"per_token": per, "total": T * sum(per.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--products", type=int, default=100, help="products timed (the baseline is 100 of them)")
    ap.add_argument("--rounds", type=int, default=1, help="diagonals timed")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="float32 error against the float64 diagonal")
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    P = Problem(args.size, seed=args.seed, k=1)
    B, L = P.X.shape[:2]
    out = {"size": args.size, "dims": dict(zip(("B", "L", "d", "heads", "d_ff"), P.dims)), "n": P.n,
           "threads": args.threads, "environment": environment(), "load_start": load_average()}
    t = time.perf_counter()
    A = bh.hessian_operator(P.params, P.X, P.cfg, loss="mse", target=P.Y)
    out["setup_s"] = time.perf_counter() - t
    A @ P.v
    times, cpu, diag, diag_cpu = [], [], [], []

    def products(k):
        for _ in range(k):
            t, c = time.perf_counter(), time.process_time()
            A @ P.v
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)

    products(args.products - args.products // 2)  # half the products before the diagonals, half after: drift of the load
    for _ in range(args.rounds):
        t, c = time.perf_counter(), time.process_time()
        D = A.diagonal()
        diag.append(time.perf_counter() - t)
        diag_cpu.append(time.process_time() - c)
    products(args.products // 2)
    med, med_cpu = statistics.median(times), statistics.median(cpu)
    out.update(product_median_s=med, product_median_cpu_s=med_cpu, products_timed=args.products,
               products_total_s=sum(times), hundred_products_s=100 * med, hundred_products_cpu_s=100 * med_cpu,
               diagonal_s=diag, diagonal_cpu_s=diag_cpu, diagonal_median_s=statistics.median(diag),
               diagonal_median_cpu_s=statistics.median(diag_cpu),
               ratio_to_100_products=statistics.median(diag) / (100 * med),
               ratio_to_100_products_cpu=statistics.median(diag_cpu) / (100 * med_cpu), load_end=load_average(),
               flops=diagonal_flops(P.cfg, B, L))
    out["diagonal_gflop_per_s"] = out["flops"]["total"] / out["diagonal_median_s"] / 1e9
    out["diagonal_gflop_per_cpu_s"] = out["flops"]["total"] / out["diagonal_median_cpu_s"] / 1e9
    if args.check:
        p64 = {k: v.double() for k, v in P.params.items()}
        A64 = bh.hessian_operator(p64, P.X.double(), P.cfg, loss="mse", target=P.Y.double())
        D64 = A64.diagonal()
        out["float32_rel_error"] = float((D.double() - D64).norm() / D64.norm())
        out["float32_worst_parameter"] = max(
            ((n, float((a.double() - b).norm() / b.norm())) for n, a, b in
             zip(A.names, D.split(A.sizes), D64.split(A.sizes)) if float(b.norm()) > 0), key=lambda x: x[1])
        out["diag_min_over_max"] = float(D64.min() / D64.abs().max())
    print(json.dumps({k: v for k, v in out.items() if k not in ("environment",)}, indent=1, default=str))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
