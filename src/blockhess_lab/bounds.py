r"""``blockhess bounds``: Theorems 1 and 6 beside the exact spectral norms they bound.

What is computed (the bounds themselves live in :mod:`blockhess.bounds`):

1. **Random weights** (``init_params``, ``X, T ~ N(0, 1)``, one sequence, digits size
   ``d_model = d_k = 16, d_ff = 32, L = 16``): the table of every Hessian block for the bare
   attention layer (Theorem 1) and the post-LN block (Theorem 6, ``ln_eps = 0``), with the
   ingredient checks (each ingredient bound beside its exact value).
2. **A sweep** over input scales ``σ ∈ {0.1, 0.3, 1, 3, 10}``, ``L ∈ {1, 8}``, weights ×{1, 0.1},
   seeds and two targets (random ``T ~ N(0, 1)``, and the zero-residual ``T = output``, the
   paper's minimiser setting) on a smaller config: the bound/norm ratios of the whole
   Hessian, every valid-bound violation (there must be none) and every row where the
   printed constants fail.
3. **Trained digits weights** (:func:`blockhess_lab.vit.load_for_command`; a batch of
   training images embedded by the model): MSE with a fixed random target ``T ~ N(0, 1)``
   (the paper's loss, so Theorem 6 and its printed constants apply), and the model's own
   cross-entropy through the head (general-loss Theorem 6 with the exact ``‖∇²ℓ‖₂``, ``‖∇ℓ‖₂``;
   the printed bound does not apply); the same at the initial weights of that model.
   The digits model uses ``ln_eps = 1e-5``; the valid bound includes it, the printed
   constants ignore it (paper: ``eps = 0``).

Writes ``bounds.json``, ``bounds.md`` and ``bounds.png`` into ``--out``; exits with status 1
(after writing them) if a valid bound is below its exact norm anywhere.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from .outputs import atomic_dir, check_out, out_help, write_json
from .runtime import add_quiet_argument, add_threads_argument, environment, load_average, progress, torch_threads

HELP = "spectral-norm bounds (Theorems 1, 6) beside the exact norms, random and trained digits weights (table, figure; about 25 s)"

RANDOM_SIZE = {"d_model": 16, "d_k": 16, "d_ff": 32, "L": 16}
SWEEP_SIZE = {"d_model": 8, "d_k": 4, "d_ff": 16, "L": 8}
SWEEP_SCALES = (0.1, 0.3, 1.0, 3.0, 10.0)
#: sequence lengths of the sweep (L = 1: a single token, where the LayerNorm lemma is weakest)
SWEEP_LENGTHS = (1, 8)
#: multipliers of the init_params weights in the sweep
SWEEP_WEIGHT_SCALES = (1.0, 0.1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bounds", metavar="DIR", help=out_help("bounds"))
    p.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="digits ViT checkpoint to read; a path given here must exist (default: checkpoints/digits_vit.pt under the "
                        "current folder, trained and saved there when absent)")
    p.add_argument("--no-trained", action="store_true", help="skip the trained digits model (random weights only)")
    p.add_argument("--batch", type=int, default=8, metavar="N", help="training images in the trained-model Hessian (default: 8)")
    p.add_argument("--seeds", type=int, default=3, metavar="N", help="seeds per point of the sweep (default: 3)")
    add_threads_argument(p)
    add_quiet_argument(p)


def _table(name, rows, **meta) -> dict:
    fails = [r["block"] for r in rows if r["paper_holds"] is False]
    viol = [r["block"] for r in rows if not (r["bound"] >= r["norm"] * (1 - 1e-9))]
    return {"name": name, **meta, "rows": rows, "paper_failures": fails, "valid_violations": viol}


def _random_tables(quiet: bool) -> tuple[list[dict], list[dict]]:
    import blockhess as bh
    from blockhess import bounds

    S = RANDOM_SIZE
    tables, ingr = [], []
    for kind, thm in (("attention", "Theorem 1"), ("block", "Theorem 6")):
        cfg = bh.BlockConfig(d_model=S["d_model"], d_k=S["d_k"], d_ff=S["d_ff"], kind=kind)
        params = bh.init_params(cfg, seed=0)
        g = torch.Generator().manual_seed(0)
        X = torch.randn(S["L"], S["d_model"], generator=g, dtype=torch.float64)
        T = torch.randn(S["L"], S["d_model"], generator=g, dtype=torch.float64)
        rows = bounds.spectral_bounds(params, X, cfg, "mse", T)
        tables.append(_table(f"random weights, {kind} ({thm})", rows, weights="random (init_params seed 0)",
                             kind=kind, theorem=thm, loss="mse", target="T ~ N(0,1)", config=dict(S), ln_eps=0.0))
        ingr.append({"name": f"random weights, {kind}", "rows": bounds.ingredient_checks(params, X, cfg, T)})
    return tables, ingr


def _sweep(seeds: int, quiet: bool) -> dict:
    import blockhess as bh
    from blockhess import bounds

    S = SWEEP_SIZE
    pts = []
    jobs = [(k, L, ws, s, sd, t) for k in ("attention", "block") for L in SWEEP_LENGTHS for ws in SWEEP_WEIGHT_SCALES
            for s in SWEEP_SCALES for sd in range(seeds) for t in ("random", "zero-residual")]
    for kind, L, ws, sigma, seed, tgt in progress(jobs, quiet, desc="bounds sweep"):
        cfg = bh.BlockConfig(d_model=S["d_model"], d_k=S["d_k"], d_ff=S["d_ff"], kind=kind)
        params = {k: ws * v for k, v in bh.init_params(cfg, seed=seed).items()}
        g = torch.Generator().manual_seed(500 + seed)
        X = sigma * torch.randn(L, S["d_model"], generator=g, dtype=torch.float64)
        T = torch.randn(L, S["d_model"], generator=g, dtype=torch.float64)
        if tgt == "zero-residual":
            T = bh.forward(params, X, cfg)
        rows = bounds.spectral_bounds(params, X, cfg, "mse", T)
        pts.append({"kind": kind, "L": L, "weight_scale": ws, "sigma": sigma, "seed": seed, "target": tgt,
                    "rows": rows})
    meta = ("kind", "L", "weight_scale", "sigma", "seed", "target")
    violations = [{**{m: p[m] for m in meta}, **r}
                  for p in pts for r in p["rows"] if not (r["bound"] >= r["norm"] * (1 - 1e-9))]
    paper_fail = [{**{m: p[m] for m in meta}, **r} for p in pts for r in p["rows"] if r["paper_holds"] is False]
    n_rows = sum(len(p["rows"]) for p in pts)
    return {"config": dict(S), "scales": list(SWEEP_SCALES), "lengths": list(SWEEP_LENGTHS),
            "weight_scales": list(SWEEP_WEIGHT_SCALES), "seeds": seeds, "points": pts, "n_rows": n_rows,
            "valid_violations": violations, "paper_failures": paper_fail}


def _trained_tables(args, vit) -> tuple[list[dict], list[dict], dict]:
    from blockhess import bounds

    info = {"checkpoint": vit.checkpoint, "test_accuracy": vit.test_accuracy, "arch": vit.arch,
            "batch": args.batch, "train_info": {k: v for k, v in vit.train_info.items() if isinstance(v, (int, float, str, bool))}}
    imgs, labels = vit.train_images[: args.batch], vit.train_labels[: args.batch]
    tables, ingr = [], []
    for which, model in (("trained", vit), ("init", vit.at_init())):
        params = model.block_params(torch.float64)
        X = model.embed(imgs, torch.float64)
        g = torch.Generator().manual_seed(1)
        T = torch.randn(X.shape, generator=g, dtype=torch.float64)
        meta = {"weights": f"digits ViT, {which}", "kind": "block", "config": {"L": X.shape[1], **model.arch},
                "ln_eps": model.cfg.ln_eps, "batch": X.shape[0]}
        rows = bounds.spectral_bounds(params, X, model.cfg, "mse", T)
        tables.append(_table(f"digits ViT ({which} weights), MSE, Theorem 6", rows, theorem="Theorem 6",
                             loss="mse", target="T ~ N(0,1), fixed", **meta))
        rows = bounds.spectral_bounds(params, X, model.cfg, model.head_loss, labels)
        tables.append(_table(f"digits ViT ({which} weights), model CE through the head, general-loss Theorem 6",
                             rows, theorem="Theorem 6 (general loss: exact ‖∇²ℓ‖, ‖∇ℓ‖)", loss="head CE",
                             target="labels", **meta))
        if which == "trained":
            ingr.append({"name": "digits ViT (trained weights), first image",
                         "rows": bounds.ingredient_checks(params, X[0], model.cfg, T[0])})
    return tables, ingr, info


# --------------------------------------------------------------------------- output


def _set(v) -> str:
    return "{" + ", ".join(f"{x:g}" for x in v) + "}"


def _e(v) -> str:
    return "—" if v is None else f"{v:.3g}"


def _cancellation(tables: list[dict]) -> str:
    """A sentence on the block whose larger part most exceeds the block itself (the parts cancel), or ""."""
    rows = [(max(r["outer_norm"], r["functional_norm"]) / r["norm"], t["name"], r) for t in tables for r in t["rows"]
            if r["norm"] > 0]
    if not rows or max(rows, key=lambda x: x[0])[0] < 2:
        return ""
    k, name, r = max(rows, key=lambda x: x[0])
    return (f" The parts can each be far larger than the block ({name}, {r['block']}: {_e(r['outer_norm'])} and "
            f"{_e(r['functional_norm'])} against {_e(r['norm'])}): they cancel in the sum; with a random target the "
            "residual Z − T, which scales the functional part, is large. outer + functional = full is checked to "
            "rounding by the tests.")


def markdown(res: dict) -> str:
    """Tables, sweep summary and failures of the printed constants as markdown."""
    L = ["# Spectral-norm bounds beside exact Hessian norms (Theorems 1 and 6)", "",
         f"Run time {res['runtime_s']:.1f} s. `bound`: valid constants (docs/bounds.md); "
         "`bound_paper`: constants as printed.", "",
         "Whole Hessian (row `all`): the valid bound is the spectral norm of the m × m matrix whose entries are the "
         "valid block bounds (m = 3 weight matrices W_Q, W_K, W_V for the attention layer, m = 5 with W₁, W₂ for "
         "the block). The printed bound is the paper's: √(m·n) times the largest printed block bound, with "
         "m = n = the number of weight matrices, i.e. 3 × the largest block bound for the attention layer and "
         "5 × the largest block bound for the block. For a batch of sequences each bound is the mean of the "
         "per-sequence bounds.", "",
         "`norm` is the spectral norm ‖H_ab‖₂ of the exact block; `outer norm` and `functional norm` are those "
         "of the same block of the Gauss–Newton and functional parts." + _cancellation(res["tables"]), ""]
    for t in res["tables"]:
        L += [f"## {t['name']}", "",
              f"Weights: {t['weights']}; loss {t['loss']}, target {t['target']}; ln_eps {t['ln_eps']}.", "",
              "| block | norm | bound | bound/norm | bound_paper | paper/norm | paper holds | outer norm | functional norm |",
              "|---|---|---|---|---|---|---|---|---|"]
        for r in t["rows"]:
            holds = "—" if r["paper_holds"] is None else ("yes" if r["paper_holds"] else "**NO**")
            L.append(f"| {r['block']} | {_e(r['norm'])} | {_e(r['bound'])} | {_e(r['ratio'])} | {_e(r['bound_paper'])} "
                     f"| {_e(r['ratio_paper'])} | {holds} | {_e(r['outer_norm'])} | {_e(r['functional_norm'])} |")
        L.append("")
    sw = res.get("sweep")
    if sw:
        L += ["## Sweep: whole-Hessian bound/norm ratio", "",
              f"Config {sw['config']} with L in {sw['lengths']}, weights × {sw['weight_scales']}, σ in "
              f"{sw['scales']}, {sw['seeds']} seeds per point, targets random and zero-residual; "
              f"{sw['n_rows']} rows checked: {len(sw['valid_violations'])} valid-bound violations, "
              f"{len(sw['paper_failures'])} rows where the printed bound is below the exact norm. "
              f"Ratios below: L = {sw['config']['L']}, weights × 1, median over seeds. σ is the input scale "
              "(X has independent N(0, σ²) entries); the zero-residual target is the block's own output "
              "(T = Z, so ∇_Z ℓ = 0 and the Hessian is its outer part).", "",
              "| kind | σ | target | bound/norm (median) | paper/norm (median) |", "|---|---|---|---|---|"]
        for row in res["sweep_summary"]:
            L.append(f"| {row['kind']} | {row['sigma']:g} | {row['target']} | {_e(row['ratio_median'])} | "
                     f"{_e(row['ratio_paper_median'])} |")
        L.append("")
    L += ["## Ingredient checks (printed ingredient bounds that fail)", "",
          "| case | ingredient | exact | valid bound | printed bound | note |", "|---|---|---|---|---|---|"]
    for case in res["ingredients"]:
        for r in case["rows"]:
            if r["paper_holds"] is False:
                L.append(f"| {case['name']} | {r['ingredient']} | {_e(r['exact'])} | {_e(r['bound'])} | "
                         f"{_e(r['bound_paper'])} | {r['note']} |")
    L += ["", "## Rows where the printed bound is below the exact norm", ""]
    fails = res["paper_failures"]
    if not fails:
        L.append("None: in every table and sweep point the printed (Theorem 1 / 6) bound is above the exact norm, "
                 "although some printed ingredients fail (above): their looseness elsewhere masks it.")
    else:
        merged: dict[tuple, list] = {}  # rows equal but for σ, in order
        for f in fails:
            if f["table"] == "sweep":
                key = ("sweep", f["kind"], f["L"], f"{f['weight_scale']:g}", f["seed"], f["target"], f["block"],
                       _e(f["norm"]), _e(f["bound_paper"]), _e(f["ratio_paper"]))
                merged.setdefault(key, []).append(f"{f['sigma']:g}")
            else:
                merged.setdefault((f["table"], "", "", "", "", "", f["block"], "", "", ""), [])
        L += [f"{len(fails)} rows; rows that differ only in σ are merged ({len(merged)} left): at L = 1 the exact "
              "Hessian does not depend on σ (one token's attention weight is 1, and LayerNorm with ε = 0 removes the "
              "scale); where a σ is missing from a row, the printed bound, which grows with ‖X‖, held there.", "",
              "| where | kind | L | weights × | σ | seed | target | block | exact norm | printed bound | printed/exact |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
        for key, sigmas in merged.items():
            cells = list(key)
            cells.insert(4, ", ".join(sigmas))
            L.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(L) + "\n"


def _median(v):
    v = sorted(x for x in v if x is not None)
    return v[len(v) // 2] if v else None


def _summary(sw: dict) -> list[dict]:
    """Whole-Hessian ratios per (kind, σ, target) at the sweep's own L and weight scale 1."""
    out = []
    L0 = sw["config"]["L"]
    for kind in ("attention", "block"):
        for s in sw["scales"]:
            for tgt in ("random", "zero-residual"):
                allr = [next(r for r in p["rows"] if r["block"] == "all") for p in sw["points"]
                        if p["kind"] == kind and p["sigma"] == s and p["target"] == tgt and p["L"] == L0
                        and p["weight_scale"] == 1.0]
                out.append({"kind": kind, "sigma": s, "target": tgt,
                            "ratio_median": _median([r["ratio"] for r in allr]),
                            "ratio_min": min((r["ratio"] for r in allr if r["ratio"] is not None), default=None),
                            "ratio_paper_median": _median([r["ratio_paper"] for r in allr])})
    return out


def figure(res: dict, path: Path) -> None:
    """Per-block exact norm beside the valid and printed bounds for every table (random weights,
    trained and initial digits weights), and the sweep's whole-Hessian ratios against σ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    tables = res["tables"]
    groups = [tables[:2], [t for t in tables if "trained weights" in t["name"]],
              [t for t in tables if "init weights" in t["name"]]]
    fig, axes = plt.subplots(3, 3, figsize=(16, 12.5))
    # rows: random weights | trained digits weights | initial digits weights; right column: the sweep
    layout = [(axes[i, j], g[j] if j < len(g) else None) for i, g in enumerate(groups) for j in range(2)]
    for ax, t in layout:
        if t is None:
            ax.axis("off")
            if ax is axes[1, 0]:
                ax.text(0.02, 0.9, "digits ViT tables (trained and initial weights) not computed (--no-trained)",
                        transform=ax.transAxes, fontsize=9)
            continue
        rows = t["rows"]
        x = range(len(rows))
        ax.semilogy(x, [r["norm"] if r["norm"] > 0 else float("nan") for r in rows], "ko")
        ax.semilogy(x, [r["bound"] for r in rows], "b^")
        has_paper = any(r["bound_paper"] is not None for r in rows)
        if has_paper:
            ax.semilogy(x, [r["bound_paper"] if r["bound_paper"] is not None else float("nan") for r in rows], "rx")
        ax.set_xticks(list(x))
        ax.set_xticklabels([r["block"].replace("W_", "") for r in rows], rotation=60, fontsize=7)
        ax.set_xlabel("Hessian block (weight pair; all = whole Hessian)", fontsize=8)
        ax.set_ylabel("exact ‖H_block‖₂ and its bounds", fontsize=9)
        ax.set_title(t["name"] + ("" if has_paper else "\n(printed bound: MSE only, not applicable)"), fontsize=8)
        ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], ls="", marker="o", color="k", label="exact ‖H_block‖₂"),
               Line2D([], [], ls="", marker="^", color="b", label="valid bound (constants re-derived, docs/bounds.md)"),
               Line2D([], [], ls="", marker="x", color="r", label="printed bound (paper's constants; MSE only)")]
    fig.legend(handles=handles, loc="upper center", ncol=3, fontsize=9, frameon=False, bbox_to_anchor=(0.5, 1.0))
    sw, swc = res.get("sweep_summary"), res.get("sweep")
    for ax, kind in zip((axes[0, 2], axes[1, 2]), ("attention", "block")):
        if not sw:
            ax.axis("off")
            continue
        for tgt, mk in (("random", "-"), ("zero-residual", "--")):
            rs = [r for r in sw if r["kind"] == kind and r["target"] == tgt]
            ax.loglog([r["sigma"] for r in rs], [r["ratio_median"] for r in rs], "b" + mk, marker="^",
                      label=f"valid / exact ({tgt} T)")
            ax.loglog([r["sigma"] for r in rs], [r["ratio_paper_median"] for r in rs], "r" + mk, marker="x",
                      label=f"printed / exact ({tgt} T)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xlabel("input scale σ")
        ax.set_ylabel("bound / ‖H‖₂ (whole Hessian)", fontsize=9)
        L0 = swc["config"]["L"] if swc else "?"
        nseeds = swc["seeds"] if swc else "?"
        ax.set_title(f"sweep, {'attention layer' if kind == 'attention' else 'post-LN block'}: looseness of the "
                     f"whole-Hessian bounds\nshown: L = {L0}, weights ×1 only; median over {nseeds} seeds "
                     f"(all points: bounds.json)", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[2, 2]
    ax.axis("off")
    if swc:
        note = (f"Sweep (d_model = {swc['config']['d_model']}, d_k = {swc['config']['d_k']}, d_ff = {swc['config']['d_ff']}):\n"
                f"L ∈ {_set(swc['lengths'])}, weights × {_set(swc['weight_scales'])},\nσ ∈ {_set(swc['scales'])}, "
                f"{swc['seeds']} seeds, "
                f"random and zero-residual T.\n\n{swc['n_rows']} rows checked: {len(swc['valid_violations'])} valid-bound "
                f"violations,\n{len(swc['paper_failures'])} rows where the printed bound is below the exact norm.\n"
                f"The two panels above show only L = {swc['config']['L']}, weights ×1;\nevery point is in bounds.json.")
        ax.text(0.02, 0.95, note, transform=ax.transAxes, va="top", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.975))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    check_out(args.out)
    t0 = time.perf_counter()
    with torch_threads(args.threads):
        vit = None
        if not args.no_trained:  # first: a --batch larger than its training set is refused before any work
            from . import vit as vitmod

            plan = vitmod.would_train(args.checkpoint)  # checked before a model is trained, too
            if plan:
                vitmod.check_batch("--batch", args.batch, plan["n_train"])
            vit = vitmod.load_for_command(args.checkpoint, quiet=args.quiet)
            vitmod.check_batch("--batch", args.batch, len(vit.train_labels))
        env = environment()  # inside: it records the thread count the work runs on
        tables, ingr = _random_tables(args.quiet)
        sw = _sweep(args.seeds, args.quiet)
        trained_info, t_trained = None, None
        if not args.no_trained:
            t1 = time.perf_counter()
            tt, ti, trained_info = _trained_tables(args, vit)
            tables += tt
            ingr += ti
            t_trained = time.perf_counter() - t1
    fails = [{"table": t["name"], "block": b} for t in tables for b in t["paper_failures"]]
    fails += [{"table": "sweep", **{m: f[m] for m in ("kind", "L", "weight_scale", "sigma", "seed", "target", "block")},
               "norm": f["norm"], "bound_paper": f["bound_paper"], "ratio_paper": f["ratio_paper"]}
              for f in sw["paper_failures"]]
    viol = [{"table": t["name"], "block": b} for t in tables for b in t["valid_violations"]] + sw["valid_violations"]
    res = {
        "tables": tables, "sweep": sw, "sweep_summary": _summary(sw), "ingredients": ingr,
        "paper_failures": fails, "valid_violations": viol, "trained": trained_info,
        "environment": {**env, "load_average_at_end": load_average()},
        "trained_runtime_s": t_trained,
    }
    res["runtime_s"] = time.perf_counter() - t0
    with atomic_dir(args.out) as tmp:
        figure(res, tmp / "bounds.png")
        (tmp / "bounds.md").write_text(markdown(res))
        write_json(tmp / "bounds.json", res)
    out = args.out
    if not args.quiet:
        print(f"{sum(len(t['rows']) for t in tables) + sw['n_rows']} rows: {len(viol)} valid-bound violations, "
              f"{len(fails)} rows where the printed bound fails; wrote {out}/bounds.json, bounds.md, bounds.png "
              f"in {res['runtime_s']:.1f} s")
    if viol:  # a failed check, not bad input: the results are written, the exit status says it (as validate's)
        print(f"blockhess bounds: {len(viol)} rows where the valid bound is below the exact norm (a bug in blockhess's "
              f"bounds or closed forms): see valid_violations in {out}/bounds.json", file=sys.stderr)
        return 1
    return 0
