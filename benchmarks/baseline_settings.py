"""How the baselines of ``blockhess bench`` group (m) were set: their speed against their free settings.

``python benchmarks/baseline_settings.py --only m/vit/B8 [--threads 1] --out FILE.json``

For each whole-model case (the bench's problems, :func:`blockhess_lab.bench.model_cases`), in one
process after a warm-up call of each:

* curvlinops ``HessianLinearOperator @ I``: the column block (1,024, 256, 64 identity columns per
  product) with the whole batch as one mini-batch, and 256 columns with mini-batches of 4
  sequences; timed on the identity's first 1,024 columns (a quarter or less of ``n``), twice in
  rotated order, the faster kept;
* ``torch.func.hessian``: of the whole batch's loss, and summed over chunks of 4 sequences
  (weighted by their share of the batch); one call each.

Each setting's output is compared with the closed form's (relative Frobenius error). The bench
uses the fastest column block (docs/results.md, "Whole models").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as Fn

import blockhess as bh
from blockhess.linalg import rel_error
from blockhess_lab import bench
from blockhess_lab.bench_worker import make_problem
from blockhess_lab.runtime import environment, git_commit, load_average

COLUMNS = 1024  # identity columns each curvlinops setting is timed on


def _timed(call):
    t0 = time.perf_counter()
    out = call()
    return time.perf_counter() - t0, out


def curvlinops_settings(P, H_ref) -> dict:
    from curvlinops import HessianLinearOperator

    names, y = P.names, P.target.reshape(-1)
    per = y.numel() // P.X.shape[0]  # loss rows per sequence

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = torch.nn.ParameterList([torch.nn.Parameter(P.params[k].clone()) for k in names])

        def forward(self, X):
            return P.logits(dict(zip(names, self.weights)), X)

    model = Wrapped()
    B = P.X.shape[0]
    eye = torch.eye(P.n, dtype=P.dtype)[:, :COLUMNS]

    def operator(mb):
        data = [(P.X[s : s + mb], y[s * per : (s + mb) * per]) for s in range(0, B, mb)]
        return HessianLinearOperator(model, torch.nn.CrossEntropyLoss(), list(model.weights), data,
                                     check_deterministic=False, progressbar=False)

    settings = [(cols, B) for cols in (1024, 256, 64)] + [(256, 4)]
    ops = {mb: operator(mb) for mb in {mb for _, mb in settings}}

    def call(cols, mb):
        return torch.cat([ops[mb] @ eye[:, s : s + cols] for s in range(0, COLUMNS, cols)], dim=1)

    call(256, B)  # warm-up
    out = {}
    for rep in range(2):
        for cols, mb in settings[rep:] + settings[:rep]:
            t, M = _timed(lambda: call(cols, mb))
            key = f"columns={cols},minibatch={mb}"
            e = out.setdefault(key, {"columns": cols, "minibatch": mb, "times_s": [], "rel_err": rel_error(M, H_ref[:, :COLUMNS])})
            e["times_s"].append(t)
    for e in out.values():
        e["best_s"] = min(e["times_s"])
        e["per_n_columns_s"] = e["best_s"] * P.n / COLUMNS  # the whole H @ I at this rate
    return out


def func_hessian_settings(P, H_ref) -> dict:
    theta, y = P.theta(), P.target.reshape(-1)
    B = P.X.shape[0]
    per = y.numel() // B

    def f(th, X, t):
        return Fn.cross_entropy(P.logits(P.unflatten(th), X), t)

    hess = torch.func.hessian(f)

    def chunked(ch):
        H = None
        for s in range(0, B, ch):
            w = min(ch, B - s) / B
            Hc = hess(theta, P.X[s : s + ch], y[s * per : (s + ch) * per])
            H = Hc.mul_(w) if H is None else H.add_(Hc, alpha=w)
        return H

    hess(theta, P.X[:1], y[:per])  # warm-up
    out = {}
    for ch in (B, 4):
        t, M = _timed(lambda: chunked(ch))
        out[f"chunk={ch}"] = {"chunk": ch, "time_s": t, "rel_err": rel_error(M, H_ref)}
        del M
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated substrings of the case ids (default: every case)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--skip-func", action="store_true", help="curvlinops only")
    p.add_argument("--out", required=True, help="the JSON file to write; an existing one gets these cases added (each run under a few minutes)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = bench.matching(bench.model_cases(quick=False, mem=False), args.only)
    if not cases:
        p.error(f"--only {args.only!r} matches no case")
    commit = git_commit()
    run = {"command": " ".join(["python benchmarks/baseline_settings.py", *(argv if argv is not None else sys.argv[1:])]),
           "commit": commit, "threads": args.threads, "env": environment("cpu")}
    out = Path(args.out)
    res = json.loads(out.read_text()) if out.exists() else {"columns_timed": COLUMNS, "runs": [], "cases": {}}
    res["runs"].append(run)
    for c in cases:
        print(f"{c['id']}", file=sys.stderr, flush=True)
        P = make_problem(c["problem"])
        loss, target = P.bh_loss()
        H = bh.hessian(P.params, P.X, P.cfg, loss=loss, target=target).dense()
        entry = {"n": P.n, "load_average_before": load_average(), "curvlinops": curvlinops_settings(P, H)}
        if not args.skip_func:
            entry["func_hessian"] = func_hessian_settings(P, H)
        entry["load_average_after"] = load_average()
        entry["run"] = len(res["runs"]) - 1
        res["cases"][c["id"]] = entry
    out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
