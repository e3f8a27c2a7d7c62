"""``blockhess validate``: the closed forms against ``torch.func`` on a grid of settings.

For each setting (kind, sizes, batch, input scale, loss) it compares, in float64, the
block Jacobian and the loss Hessian's full, outer and functional parts with
:mod:`blockhess.reference` by relative Frobenius error, and records both times. Writes
``validate.json`` and ``validate.md``; exits with status 1 if any error exceeds ``--tol``.
"""

from __future__ import annotations

import itertools
import time

import torch

import blockhess as bh

from .outputs import atomic_dir, out_help, write_json
from .runtime import add_threads_argument, progress, torch_threads

HELP = "check every closed form against torch.func (float64) on a grid of settings"

# (L, d_model, d_k, d_ff, batch, input scale): L = 1, d_k != d_model, odd sizes, batches
FULL_GRID = [(1, 4, 4, 6, None, 1.0), (3, 4, 2, 5, None, 1.0), (5, 7, 3, 9, None, 1e-2),
             (4, 6, 3, 8, 3, 10.0), (8, 16, 16, 32, 2, 1.0)]
QUICK_GRID = FULL_GRID[:3]


def _coupled(Z, T):
    """A custom loss whose Hessian in Z couples every entry of the sequence."""
    return torch.log1p(((Z - T) ** 2).sum()) + 0.1 * torch.tanh(Z.sum()) ** 2


def add_arguments(p) -> None:
    p.add_argument("--out", default="validate", metavar="DIR", help=out_help("validate"))
    p.add_argument("--quick", action="store_true",
                   help="3 size settings instead of 5 (each for the attention layer and the block, with MSE, CE and a "
                        "custom loss: 18 cases instead of 30)")
    p.add_argument("--tol", type=float, default=1e-10, help="largest accepted relative error (default: 1e-10)")
    add_threads_argument(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _rel(A, B, scale: float) -> float:
    """``‖A − B‖/‖B‖``; relative to ``scale`` (the full Hessian's norm) where the reference part
    is exactly zero up to rounding (``‖B‖ <= 1e-12·scale``, e.g. the functional term at L = 1)."""
    ref = B.norm().item()
    return (A - B).norm().item() / (ref if ref > 1e-12 * scale else scale)


def _case(kind, L, d, dk, dff, batch, scale, loss, seed=0):
    cfg = bh.BlockConfig(d_model=d, d_ff=dff, d_k=dk, kind=kind)
    params = bh.init_params(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    X = scale * torch.randn((L, d) if batch is None else (batch, L, d), generator=g, dtype=torch.float64)
    if loss == "ce":
        target = torch.randint(0, d, X.shape[:-1], generator=g)
    else:
        target = torch.randn(X.shape, generator=g, dtype=torch.float64)
    t0 = time.perf_counter()
    H = bh.hessian(params, X, cfg, loss=_coupled if loss == "custom" else loss, target=target)
    t_closed = time.perf_counter() - t0
    t0 = time.perf_counter()
    R = bh.reference.hessian(params, X, cfg, loss=_coupled if loss == "custom" else loss, target=target)
    t_ref = time.perf_counter() - t0
    J, J_ref = bh.jacobian(params, X, cfg), bh.reference.jacobian(params, X, cfg)
    Jd = torch.cat([J[n].reshape(-1) for n in J])
    Jr = torch.cat([J_ref[n].reshape(-1) for n in J])
    s = R.dense().norm().item()
    return {
        "kind": kind, "L": L, "d_model": d, "d_k": dk, "d_ff": dff if kind == "block" else None,
        "batch": batch, "input_scale": scale, "loss": loss, "n": sum(H.sizes),
        "rel_error": {"jacobian": _rel(Jd, Jr, Jr.norm().item()), "full": _rel(H.dense(), R.dense(), s),
                      "outer": _rel(H.outer.dense(), R.outer.dense(), s),
                      "functional": _rel(H.functional.dense(), R.functional.dense(), s)},
        "seconds": {"closed_form": t_closed, "torch_func": t_ref},
    }


def run(args) -> int:
    if not args.tol > 0:
        raise ValueError(f"--tol must be positive, got {args.tol}")
    grid = QUICK_GRID if args.quick else FULL_GRID
    settings = list(itertools.product(("attention", "block"), grid, ("mse", "ce", "custom")))
    with atomic_dir(args.out) as tmp, torch_threads(args.threads):
        rows = [_case(kind, *g, loss) for kind, g, loss in progress(settings, args.quiet, desc="validate")]
        worst = max(max(r["rel_error"].values()) for r in rows)
        result = {"torch": torch.__version__, "dtype": "float64", "tol": args.tol,
                  "max_rel_error": worst, "passed": worst <= args.tol, "cases": rows}
        write_json(tmp / "validate.json", result)
        lines = ["# blockhess validate", "",
                 f"Closed form vs `torch.func`, float64, torch {torch.__version__}. "
                 f"Largest relative Frobenius error: **{worst:.2e}** (tolerance {args.tol:.0e}).", "",
                 "| kind | L | d | d_k | d_ff | B | scale | loss | n | Jacobian | full | outer | functional | closed form s | torch.func s |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            e, s = r["rel_error"], r["seconds"]
            lines.append(f"| {r['kind']} | {r['L']} | {r['d_model']} | {r['d_k']} | {r['d_ff'] or '-'} | {r['batch'] or '-'} "
                         f"| {r['input_scale']:g} | {r['loss']} | {r['n']} | {e['jacobian']:.1e} | {e['full']:.1e} "
                         f"| {e['outer']:.1e} | {e['functional']:.1e} | {s['closed_form']:.4f} | {s['torch_func']:.4f} |")
        (tmp / "validate.md").write_text("\n".join(lines) + "\n")
    print(f"max relative error {worst:.2e} over {len(rows)} settings -> {args.out}/validate.json")
    return 0 if worst <= args.tol else 1
