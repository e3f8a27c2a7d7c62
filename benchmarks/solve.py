"""``python benchmarks/solve.py --out FILE``: ``blockhess.operators.solve`` on a Hugging Face ``GPT2Block``
(benchmarks/operators.py's problem: ``bh.hessian_operator`` on ``bh.from_torch(block)``, MSE against a
random target, float32, one thread by default) against the same solver run on autograd's products
(double backward through the module on a graph kept from one ``create_graph=True`` gradient, under
``sdpa_kernel(SDPBackend.MATH)``): the same recurrences (CG and MINRES of ``solve``) on two operators, so
the products each needs and the time each takes are compared at the same residual. The budget is
``--matvecs`` products (``allow_unconverged=True``); the true relative residual ``‖b − (A + λI)x‖/‖b‖``
that each reaches is reported, and the two solutions are compared (docs/results.md, "Solves").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import blockhess as bh  # noqa: E402
from blockhess.operators import IndefiniteError, solve  # noqa: E402
from operators import Problem  # noqa: E402
from blockhess_lab.runtime import environment  # noqa: E402


class Autograd:
    """``H @ V`` by double backward through the module (one product per column), in our vector order
    (the module's parameters gathered by ``A.to_module``'s permutation: the same operator)."""

    def __init__(self, prob, M):
        self.shape, self.dtype, self.device = M.shape, prob.dtype, torch.device("cpu")
        self.params = prob.hf_params
        out = prob.net(prob.X)
        loss = ((out - prob.Y) ** 2).mean()
        self.g = torch.autograd.grad(loss, self.params, create_graph=True)

    def __matmul__(self, V):
        cols = []
        for j in range(V.shape[1]):
            vs, off = [], 0
            for p in self.params:
                vs.append(V[off:off + p.numel(), j].reshape(p.shape))
                off += p.numel()
            hv = torch.autograd.grad(self.g, self.params, grad_outputs=vs, retain_graph=True)
            cols.append(torch.cat([h.reshape(-1) for h in hv]))
        return torch.stack(cols, 1)


def run(A, b, damping, tol, method, budget):
    t = time.perf_counter()
    try:
        r = solve(A, b, damping=damping, tol=tol, method=method, max_matvecs=budget, allow_unconverged=True)
    except IndefiniteError as e:
        r = e.result
        return dict(seconds=time.perf_counter() - t, matvecs=r.matvecs, iterations=r.iterations, breakdown=True,
                    relative_residual=float(r.relative_residual), converged=False), r
    return dict(seconds=time.perf_counter() - t, matvecs=r.matvecs, iterations=r.iterations, breakdown=False,
                relative_residual=float(r.relative_residual), converged=r.converged), r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--damping", type=float, default=1e-2)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--matvecs", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    prob = Problem(a.size, k=1)
    A = bh.hessian_operator(prob.params, prob.X, prob.cfg, loss="mse", target=prob.Y)
    M = A.to_module(prob.net.block)  # the module's order: the same vector layout as autograd's
    ag = Autograd(prob, M)
    b = prob.v / prob.v.norm()
    rows = {}
    for method in ("minres", "cg"):
        ours, x1 = run(M, b, a.damping, a.tol, method, a.matvecs)
        theirs, x2 = run(ag, b, a.damping, a.tol, method, a.matvecs)
        diff = float((x1.x - x2.x).norm() / x2.x.norm()) if x2.x.norm() > 0 else None
        rows[method] = dict(ours=ours, double_backward=theirs, solution_rel_diff=diff,
                            time_ratio=theirs["seconds"] / ours["seconds"])
        print(method, json.dumps(rows[method]), flush=True)
    out = dict(problem=dict(size=a.size, dims=prob.dims, n=prob.n, dtype=str(prob.dtype), loss="mse"),
               damping=a.damping, tol=a.tol, max_matvecs=a.matvecs, threads=a.threads, results=rows,
               environment=environment())
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
