"""``blockhess validate``: the closed forms against ``torch.func`` on a grid of settings.

For each setting (block options, sizes, batch, input scale, loss) it compares, in float64,
the block Jacobian and the loss Hessian's full, outer and functional parts with
:mod:`blockhess.reference` by relative Frobenius error, and records both times. The block
options are the paper's attention layer and post-LN block, and each of them with every
option beyond the paper on (:data:`OPTIONS`: heads, biases, ``W_O``, causal mask; for the
block also affine LayerNorm with ``eps``, GELU, and pre-LN), these also differentiated w.r.t.
the input ``X``. Writes ``validate.json`` and ``validate.md``; exits with status 1 if any
error exceeds ``--tol``.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time

import torch

import blockhess as bh
from blockhess.linalg import rel_error

from .outputs import atomic_dir, out_help, write_json
from .runtime import add_quiet_argument, add_threads_argument, environment, load_average, progress, torch_threads

HELP = ("check bh.jacobian (w.r.t. the weights) and bh.hessian with its outer and functional parts (MSE, CE, a custom "
        "loss) against torch.func, float64, on a grid of block settings and sizes")

# (L, d_model, d_k, d_ff, batch, input scale): L = 1, d_k != d_model, odd sizes, batches
FULL_GRID = [(1, 4, 4, 6, None, 1.0), (3, 4, 2, 5, None, 1.0), (5, 7, 3, 9, None, 1e-2),
             (4, 6, 3, 8, 3, 10.0), (8, 16, 16, 32, 2, 1.0)]
QUICK_GRID = FULL_GRID[:3]

# name -> (BlockConfig options, wrt_input); n_heads=2 becomes 1 where d_model is odd
_RICH = dict(n_heads=2, bias=True, out_proj=True, causal=True)
_RICH_LN = dict(_RICH, ln_affine=True, ln_eps=1e-5)
OPTIONS = {
    "attention (paper)": (dict(kind="attention"), False),
    "attention, all options": (dict(_RICH, kind="attention"), True),
    "post-LN block (paper)": (dict(kind="block"), False),
    "post-LN block, all options, GELU": (dict(_RICH_LN, kind="block", activation="gelu"), True),
    "pre-LN block, all options, tanh-GELU": (dict(_RICH_LN, kind="block", norm="pre", activation="gelu_tanh"), True),
}


def _coupled(Z, T):
    """A custom loss whose Hessian in Z couples every entry of the sequence."""
    return torch.log1p(((Z - T) ** 2).sum()) + 0.1 * torch.tanh(Z.sum()) ** 2


DETAILS = (
    "Compares, in float64 by relative Frobenius error, the block output's Jacobian w.r.t. the weights "
    "(bh.jacobian against torch.func.jacrev) and the loss Hessian with its outer (Gauss-Newton) and functional "
    "parts (bh.hessian against torch.func.hessian), for MSE, CE and a custom loss coupling every entry, in 5 block "
    "settings: the paper's attention layer and post-LN block, and three with every option beyond the paper (2 heads, "
    "biases, W_O, a causal mask; in the blocks also affine LayerNorm with eps): the attention layer, a post-LN block "
    "with GELU and a pre-LN block with tanh-GELU, these three also w.r.t. the input X (wrt_input=True); on 5 sizes (L = 1, d_k != d_model, odd sizes, batches of 2 and 3, input scales "
    "1e-2 to 10). Not covered here (the test suite checks them): the component derivatives, input_jacobian, "
    "second_derivative, float32, out=, from_torch/to_module and the bounds. Writes validate.json and "
    "validate.md; exit status 1 if an error exceeds --tol."
)


def add_arguments(p) -> None:
    p.add_argument("--out", default="validate", metavar="DIR", help=out_help("validate"))
    p.add_argument("--quick", action="store_true",
                   help=f"the first 3 sizes instead of 5, one sequence each (no batch), for the {len(OPTIONS)} block "
                        f"settings with MSE, CE and a custom loss: {len(OPTIONS) * 9} cases instead of {len(OPTIONS) * 15}")
    p.add_argument("--tol", type=float, default=1e-10, help="largest accepted relative error (default: 1e-10)")
    add_threads_argument(p)
    add_quiet_argument(p)


def _case(setting, L, d, dk, dff, batch, scale, loss, seed=0):
    options, wrt_input = OPTIONS[setting]
    heads = options.get("n_heads", 1) if d % options.get("n_heads", 1) == 0 else 1
    cfg = bh.BlockConfig(d_model=d, d_ff=dff, d_k=dk, **{**options, "n_heads": heads})
    params = bh.init_params(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    X = scale * torch.randn((L, d) if batch is None else (batch, L, d), generator=g, dtype=torch.float64)
    if loss == "ce":
        target = torch.randint(0, d, X.shape[:-1], generator=g)
    else:
        target = torch.randn(X.shape, generator=g, dtype=torch.float64)
    fn = _coupled if loss == "custom" else loss
    t0 = time.perf_counter()
    H = bh.hessian(params, X, cfg, loss=fn, target=target, wrt_input=wrt_input)
    t_closed = time.perf_counter() - t0
    t0 = time.perf_counter()
    R = bh.reference.hessian(params, X, cfg, loss=fn, target=target, wrt_input=wrt_input)
    t_ref = time.perf_counter() - t0
    J, J_ref = bh.jacobian(params, X, cfg), bh.reference.jacobian(params, X, cfg)
    Jd = torch.cat([J[n].reshape(-1) for n in J])
    Jr = torch.cat([J_ref[n].reshape(-1) for n in J])
    s = R.dense().norm().item()
    parts = {"outer": (H.outer.dense(), R.outer.dense()), "functional": (H.functional.dense(), R.functional.dense())}
    return {
        "setting": setting, "config": dataclasses.asdict(cfg), "n_heads": heads, "wrt_input": wrt_input,
        "kind": cfg.kind, "L": L, "d_model": d, "d_k": dk, "d_ff": dff if cfg.kind == "block" else None,
        "batch": batch, "input_scale": scale, "loss": loss, "n": sum(H.sizes),
        # a part's error relative to the full Hessian's norm: its rounding is the full's, whatever its own size
        "rel_error": {"jacobian": rel_error(Jd, Jr), "full": rel_error(H.dense(), R.dense()),
                      **{k: rel_error(a, b, s) for k, (a, b) in parts.items()}},
        # None where the part is zero up to rounding (the functional term at L = 1)
        "rel_error_own_norm": {k: rel_error(a, b) if b.norm().item() > 1e-12 * s else None for k, (a, b) in parts.items()},
        "seconds": {"closed_form": t_closed, "torch_func": t_ref},
    }


def run(args) -> int:
    if not args.tol > 0:
        raise ValueError(f"--tol must be positive, got {args.tol}")
    grid = QUICK_GRID if args.quick else FULL_GRID
    settings = list(itertools.product(OPTIONS, grid, ("mse", "ce", "custom")))
    with atomic_dir(args.out) as tmp, torch_threads(args.threads):
        env = environment()
        rows = [_case(setting, *g, loss) for setting, g, loss in progress(settings, args.quiet, desc="validate")]
        worst = max(max(r["rel_error"].values()) for r in rows)
        w_row, w_part = max(((r, k) for r in rows for k in r["rel_error"]), key=lambda rk: rk[0]["rel_error"][rk[1]])
        w_case = (f"{w_part} of {w_row['setting']}, L={w_row['L']}, d={w_row['d_model']}, d_k={w_row['d_k']}"
                  f"{', d_ff=' + str(w_row['d_ff']) if w_row['d_ff'] else ''}{', B=' + str(w_row['batch']) if w_row['batch'] else ''}"
                  f", scale {w_row['input_scale']:g}, loss {w_row['loss']}")
        passed = worst <= args.tol
        result = {"torch": torch.__version__, "dtype": "float64", "tol": args.tol,
                  "max_rel_error": worst, "max_rel_error_case": w_case, "passed": passed, "cases": rows,
                  "environment": {**env, "load_average_at_end": load_average()}}
        write_json(tmp / "validate.json", result)
        lines = ["# blockhess validate", "",
                 f"Closed form vs `torch.func`, float64, torch {torch.__version__}. "
                 f"Largest relative Frobenius error: **{worst:.2e}** ({w_case}); tolerance {args.tol:.0e}: "
                 + ("**passed**." if passed else "**FAILED** (above the tolerance)."), "",
                 "Settings with all options also differentiate w.r.t. the input `X` (`wrt_input=True`); "
                 "`n_heads` is 1 where `d_model` is odd. Errors of the outer and functional parts are relative to the "
                 "full Hessian's norm (their rounding is the full's, whatever their own size; `validate.json` has them "
                 "relative to their own norms too, in `rel_error_own_norm`: up to 1e-10 for the attention layer's functional term "
                 "at input scale 10, where the saturated softmax makes it ill-conditioned and `torch.func` is as far from a "
                 "40-digit evaluation, tests/test_high_precision.py).", "",
                 "Columns: `Jacobian`, the block output's Jacobian w.r.t. the weights against `torch.func.jacrev`; "
                 "`full`, `outer`, `functional`, the loss Hessian and its parts against `torch.func.hessian`; `B`, the "
                 "batch size (`-`: one sequence); `n`, the number of variables. The first `torch.func` time includes its "
                 "one-time set-up in the process.", "",
                 "| setting | heads | L | d | d_k | d_ff | B | scale | loss | n | Jacobian | full | outer | functional | closed form s | torch.func s |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            e, s = r["rel_error"], r["seconds"]
            lines.append(f"| {r['setting']} | {r['n_heads']} | {r['L']} | {r['d_model']} | {r['d_k']} | {r['d_ff'] or '-'} | {r['batch'] or '-'} "
                         f"| {r['input_scale']:g} | {r['loss']} | {r['n']} | {e['jacobian']:.1e} | {e['full']:.1e} "
                         f"| {e['outer']:.1e} | {e['functional']:.1e} | {s['closed_form']:.4f} | {s['torch_func']:.4f} |")
        (tmp / "validate.md").write_text("\n".join(lines) + "\n")
    if not args.quiet:
        print(f"{'passed' if passed else 'FAILED'}: max relative error {worst:.2e} (tolerance {args.tol:.0e}) over "
              f"{len(rows)} settings -> {args.out}/validate.md, validate.json")
    if not passed:  # a failed check, shown with or without --quiet (as bounds' violated bounds)
        print(f"blockhess validate: FAILED: largest relative error {worst:.2e} is above --tol {args.tol:.0e}, in the "
              f"{w_case}: see {args.out}/validate.md", file=sys.stderr)
        return 1
    return 0
