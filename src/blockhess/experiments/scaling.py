r"""``blockhess scaling``: curvature scaling laws measured on exact Hessians.

Three sweeps, every Hessian exact (:func:`blockhess.hessian`, closed form), MSE with a target
``T`` drawn once per seed and held fixed while the input changes (as Ormaniec et al., whose
targets are fixed one-hot tokens):

(a) ``input_scale``: ``X -> σX``, σ log-spaced over ``[1e-3, 10]``, several seeds, for the
    bare attention layer (Theorem 1) and the post-LN block (Theorem 6);
(b) ``seq_len``: ``L`` doubling, ``X = ρ·Q`` with ``Q`` Haar-random orthonormal columns, so
    ``‖X‖₂ = ρ`` (and ``XᵀX = ρ²I``) is fixed: the variable of the paper's ``1/L³`` claim;
(c) ``ln_variance`` (block): rows driven towards constant, ``X = c𝟙ᵀ + τ Z`` with a random
    constant ``c_t`` per token, and a value projection with zero column sums (``𝟙ᵀW_V = 0``, so
    ``F`` maps constant rows to zero and the LayerNorm-1 input ``U = X + F`` has row variance
    ``∝ τ²``; with a generic ``W_V`` the variance of ``U`` cannot collapse). The variable is the
    measured ``min_t var(U_t)``.

For each Hessian block pair and each part (outer, functional, full) the spectral and the
Frobenius norms are recorded, with the valid Theorem-1/6 bound (:mod:`blockhess.bounds`).
Exponents are least-squares slopes in log-log over a window where the asymptotics hold,
pooled over seeds with one intercept per seed; the confidence interval is the slope's
standard error times the 97.5% t quantile (``n − seeds − 1`` degrees of freedom).

Writes ``scaling.json`` (``"fits"``: ``{setting, block, part, variable, norm, exponent, ci,
theory, theory_source, n, window}``; ``"records"``: every measured norm), ``scaling.md``
(the fit table), ``scaling_input_scale.png``, ``scaling_seq_len.png`` and
``scaling_ln_variance.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch

from .. import linalg
from .outputs import atomic_dir, check_out, out_help, write_json
from .runtime import add_threads_argument, environment, progress, torch_threads

HELP = "curvature scaling laws on exact Hessians: input scale, sequence length, LayerNorm variance (fits, plots)"

PRESETS = {
    "quick": {
        "d_model": 8, "d_k": 4, "d_ff": 16, "L": 8, "seeds": 3,
        "sigmas": [float(s) for s in np.logspace(-3, 1, 17)], "fit_sigma_max": 10 ** -1.5,
        "seq_lens": [16, 32, 64, 128], "rho": 1.0,
        "taus": [float(s) for s in np.logspace(-5, 0, 11)], "fit_tau_max": 1e-2,
    },
    "full": {
        "d_model": 16, "d_k": 8, "d_ff": 32, "L": 16, "seeds": 8,
        "sigmas": [float(s) for s in np.logspace(-3, 1, 25)], "fit_sigma_max": 10 ** -1.5,
        "seq_lens": [16, 32, 64, 128, 256], "rho": 1.0,
        "taus": [float(s) for s in np.logspace(-6, 0, 13)], "fit_tau_max": 1e-2,
    },
}

SHORT = {"W_Q": "Q", "W_K": "K", "W_V": "V", "W_1": "1", "W_2": "2"}
PARTS = ("outer", "functional", "full")
ORM = "Ormaniec et al. (2410.10986), small σ"
DER = "derived here (docs/bounds.md §9)"
PAPER_L3 = "paper §3.3 (1/L³ at fixed ‖X‖₂), uniform-attention regime"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="scaling", metavar="DIR", help=out_help("scaling"))
    p.add_argument("--quick", action="store_true", help="small sizes, 3 seeds (well under a minute on 2 cores)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default: 3 quick, 8 full)")
    add_threads_argument(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


# --------------------------------------------------------------------------- theory


def _key(a: str, b: str) -> str:
    return "".join(sorted((SHORT[a], SHORT[b]), key="QKV12".index))


def theory(setting: str, variable: str, block: str, part: str, norm: str) -> tuple[float | None, str | None]:
    """Predicted exponent (and its source) of a Hessian block's norm; ``(None, None)`` if none.

    ``block`` as ``"W_Q,W_K"``; ``part`` outer/functional/full; ``norm`` spectral, frobenius
    (same asymptotic exponent) or bound (the valid Theorem-1/6 bound; only for ``ln_variance``).
    Source of each value: :data:`ORM`, :data:`PAPER_L3` or derived here (docs/bounds.md).
    """
    a, b = block.split(",")
    k = _key(a, b)
    if norm == "bound":
        if setting == "block" and variable == "ln_variance":
            n_att = sum(c in "QKV" for c in k)
            return {2: -1.0, 1: -0.5, 0: 0.0}[n_att], "Theorem 6 bound: ‖J_Y‖ ∝ σ_min⁻¹, ‖H_Y‖ ∝ σ_min⁻²"
        return None, None
    if variable == "input_scale":
        if setting == "attention":
            table = {
                "outer": {"QQ": 6, "QK": 6, "KK": 6, "QV": 4, "KV": 4, "VV": 2},
                "functional": {"QQ": 5, "KK": 5, "QK": 3, "QV": 3, "KV": 3, "VV": 0},
                "full": {"QQ": 5, "KK": 5, "QK": 3, "QV": 3, "KV": 3, "VV": 2},
            }
            src = ORM if k in ("QQ", "VV") else DER
            return float(table[part][k]), src
        # post-LN block: LN_1 removes the input scale, J_Y ∝ 1/σ, H_Y ∝ 1/σ²
        qk = {"QQ": 4, "KK": 4, "QK": 4 if part == "outer" else 2}
        if k in qk:
            return float(qk[k]), DER
        if k in ("QV", "KV", "Q1", "Q2", "K1", "K2"):
            return 2.0, DER
        return 0.0, DER
    if variable == "seq_len":
        if setting == "attention":
            if part == "outer":
                if k in ("QQ", "QK", "KK"):
                    return -3.0, PAPER_L3
                return (-3.0 if k in ("QV", "KV") else -2.0), DER
            if k in ("QK", "QV", "KV"):
                return -2.0, DER
            if k == "VV":
                return (None, None) if part == "functional" else (-2.0, DER)
            return None, None
        if part != "outer":
            return None, None
        if k in ("QQ", "QK", "KK", "QV", "KV"):
            return -2.0, DER
        if k == "VV":
            return -1.0, DER
        return None, None
    if variable == "ln_variance":
        if k == "VV":
            return -1.0, DER
        if k in ("QV", "KV", "V1", "V2"):
            return -0.5, DER
        return 0.0, DER
    return None, None


# --------------------------------------------------------------------------- measuring


def _norms(H, bb, pairs) -> list[dict]:
    """Spectral and Frobenius norms of every pair and part, with the valid bound."""
    out = []
    parts = {"full": H, "outer": H.outer, "functional": H.functional}
    for part in PARTS:
        P = parts[part]
        for a, b in pairs:
            M = P[a, b]
            out.append({
                "block": f"{a},{b}", "part": part,
                "spectral": linalg.norm2(M),
                "frobenius": float(M.norm()),
                "bound": float(bb[part][(a, b)]),
            })
    return out


def _measure(params, X, cfg, T):
    import blockhess as bh
    from blockhess import bounds

    H = bh.hessian(params, X, cfg, loss="mse", target=T)
    bb = bounds.block_bounds(params, X, cfg, loss="mse", target=T)
    return _norms(H, bb, H.pairs())


def _att(params: dict) -> dict:
    return {k: params[k] for k in ("W_Q", "W_K", "W_V")}


SWEEPS = ("input_scale", "seq_len", "ln_variance")


def _jobs(cfgs: dict, P: dict, sweeps=SWEEPS):
    """Yield ``(setting, variable, x, seed, params, X, cfg, T[, extra])`` lazily."""
    import blockhess as bh

    d, L = P["d_model"], P["L"]
    for seed in range(P["seeds"]):
        for setting in ("attention", "block"):
            cfg = cfgs[setting]
            params = bh.init_params(cfg, seed=seed)
            g = torch.Generator().manual_seed(1000 + seed)
            X0 = torch.randn(L, d, generator=g, dtype=torch.float64)
            T = torch.randn(L, d, generator=g, dtype=torch.float64)
            for s in (P["sigmas"] if "input_scale" in sweeps else ()):
                yield setting, "input_scale", s, seed, params, s * X0, cfg, T
            for Ln in (P["seq_lens"] if "seq_len" in sweeps else ()):
                gl = torch.Generator().manual_seed(10_000 * (seed + 1) + Ln)
                Qm, _ = torch.linalg.qr(torch.randn(Ln, d, generator=gl, dtype=torch.float64))
                Tl = torch.randn(Ln, d, generator=gl, dtype=torch.float64)
                yield setting, "seq_len", float(Ln), seed, params, P["rho"] * Qm, cfg, Tl
        # (c) LayerNorm-1 input variance -> 0 (block only)
        if "ln_variance" not in sweeps:
            continue
        cfg = cfgs["block"]
        params = bh.init_params(cfg, seed=seed)
        C = torch.eye(d, dtype=torch.float64) - 1.0 / d
        params["W_V"] = C @ params["W_V"]  # 1ᵀ W_V = 0: constant rows map to 0 through the value path
        g = torch.Generator().manual_seed(2000 + seed)
        c = 2.0 * torch.randn(L, 1, generator=g, dtype=torch.float64)
        Zn = torch.randn(L, d, generator=g, dtype=torch.float64)
        T = torch.randn(L, d, generator=g, dtype=torch.float64)
        acfg = cfgs["attention"]
        for tau in P["taus"]:
            X = c + tau * Zn
            U = X + bh.forward(_att(params), X, acfg)
            var = float(U.var(-1, unbiased=False).min())
            yield "block", "ln_variance", var, seed, params, X, cfg, T, {"tau": tau}


def _n_jobs(P: dict, sweeps=SWEEPS) -> int:
    n = {"input_scale": 2 * len(P["sigmas"]), "seq_len": 2 * len(P["seq_lens"]), "ln_variance": len(P["taus"])}
    return P["seeds"] * sum(n[s] for s in sweeps)


# --------------------------------------------------------------------------- fitting


def fit_exponent(x: np.ndarray, y: np.ndarray, groups: np.ndarray) -> dict:
    """Slope of ``log10 y`` on ``log10 x`` with one intercept per group (seed).

    ``x, y > 0`` and ``groups`` are 1-D arrays of equal length. Returns ``{"exponent", "ci",
    "se", "n", "df"}``; ``ci`` is ``[b − t·se, b + t·se]`` with the 97.5% t quantile on
    ``n − groups − 1`` degrees of freedom (``None`` when there are none left). Raises
    ``ValueError`` on fewer than two distinct ``x`` values.
    """
    from scipy import stats

    lx, ly = np.log10(x), np.log10(y)
    xt, yt = lx.copy(), ly.copy()
    ug = np.unique(groups)
    for g in ug:
        m = groups == g
        xt[m] -= lx[m].mean()
        yt[m] -= ly[m].mean()
    sxx = float((xt * xt).sum())
    if sxx <= 0:
        raise ValueError("fit_exponent: need at least two distinct x values")
    b = float((xt * yt).sum() / sxx)
    n, df = len(lx), len(lx) - len(ug) - 1
    if df <= 0:
        return {"exponent": b, "ci": None, "se": None, "n": n, "df": df}
    resid = yt - b * xt
    se = math.sqrt(float((resid * resid).sum()) / df / sxx)
    t = float(stats.t.ppf(0.975, df))
    return {"exponent": b, "ci": [b - t * se, b + t * se], "se": se, "n": n, "df": df}


def _window(variable: str, P: dict) -> tuple[float, float]:
    if variable == "input_scale":
        return (min(P["sigmas"]), P["fit_sigma_max"])
    if variable == "seq_len":
        return (min(P["seq_lens"]), max(P["seq_lens"]))
    return (0.0, math.inf)  # ln_variance: selected by tau below


def fits(records: list[dict], P: dict) -> list[dict]:
    """The exponent fits of every (setting, variable, block, part, norm) in ``records``."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["setting"], r["variable"], r["block"], r["part"]), []).append(r)
    out = []
    for (setting, variable, block, part), rs in groups.items():
        lo, hi = _window(variable, P)
        if variable == "ln_variance":
            sel = [r for r in rs if r["tau"] <= P["fit_tau_max"]]
            window = {"tau_max": P["fit_tau_max"]}
        else:
            sel = [r for r in rs if lo * (1 - 1e-9) <= r["x"] <= hi * (1 + 1e-9)]
            window = {"min": lo, "max": hi}
        for norm in ("spectral", "frobenius", "bound"):
            th, src = theory(setting, variable, block, part, norm)
            if norm == "bound" and th is None and variable != "input_scale":
                continue
            vals = np.array([r[norm] for r in sel])
            row = {"setting": setting, "block": block, "part": part, "variable": variable, "norm": norm,
                   "theory": th, "theory_source": src, "window": window}
            if len(vals) and np.all(vals == 0):
                row.update({"exponent": 0.0, "ci": [0.0, 0.0], "n": len(vals), "zero": True,
                            "note": "identically zero at every point (exact): the norm does not grow"})
                out.append(row)
                continue
            pos = vals > 0
            if pos.sum() < 3:
                continue
            x = np.array([r["x"] for r in sel])[pos]
            gs = np.array([r["seed"] for r in sel])[pos]
            f = fit_exponent(x, vals[pos], gs)
            row.update({"exponent": f["exponent"], "ci": f["ci"], "se": f["se"], "n": f["n"], "zero": False})
            out.append(row)
    order = {"attention": 0, "block": 1}
    var_order = {"input_scale": 0, "seq_len": 1, "ln_variance": 2}
    canon = ("W_Q", "W_K", "W_V", "W_1", "W_2")

    def pair_rank(block):
        a, b = block.split(",")
        return canon.index(a), canon.index(b)

    out.sort(key=lambda r: (var_order[r["variable"]], order[r["setting"]], r["norm"] != "spectral", r["norm"],
                            pair_rank(r["block"]), PARTS.index(r["part"])))
    return out


# --------------------------------------------------------------------------- output


def _fmt(v, nd=2):
    return "—" if v is None else f"{v:.{nd}f}"


def markdown(result: dict) -> str:
    """The fit table (spectral norms; Frobenius and bound fits are in the JSON) as markdown."""
    P = result["config"]
    lines = [
        "# Curvature scaling laws (exact Hessians)", "",
        f"Preset `{result['preset']}`: d_model={P['d_model']}, d_k={P['d_k']}, d_ff={P['d_ff']}, "
        f"L={P['L']}, {P['seeds']} seeds; MSE, fixed target T ~ N(0, 1). Run time {result['runtime_s']:.1f} s computing, {result.get('total_runtime_s', result['runtime_s']):.1f} s with the figures.",
        "",
        "Exponent = least-squares slope in log-log (one intercept per seed), 95% CI from the "
        "slope's standard error and a t quantile. Window: input scale σ ≤ "
        f"{P['fit_sigma_max']:.3g}; sequence length {P['seq_lens'][0]}–{P['seq_lens'][-1]} at ‖X‖₂ = {P['rho']}; "
        f"LayerNorm variance: τ ≤ {P['fit_tau_max']:g}.", "",
        "| setting | variable | block | part | exponent (spectral) | 95% CI | exponent (Frobenius) | theory | source |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fro = {(f["setting"], f["variable"], f["block"], f["part"]): f for f in result["fits"] if f["norm"] == "frobenius"}
    for f in result["fits"]:
        if f["norm"] != "spectral":
            continue
        key = (f["setting"], f["variable"], f["block"], f["part"])
        ci = "exactly 0" if f.get("zero") else (f"[{f['ci'][0]:.3f}, {f['ci'][1]:.3f}]" if f["ci"] else "—")
        ex = "0 (≡ 0)" if f.get("zero") else f"{f['exponent']:.3f}"
        fr = fro.get(key)
        fr_s = "—" if fr is None else ("0 (≡ 0)" if fr.get("zero") else f"{fr['exponent']:.3f}")
        lines.append(f"| {f['setting']} | {f['variable']} | {f['block']} | {f['part']} | {ex} | {ci} | {fr_s} | "
                     f"{_fmt(f['theory'], 1)} | {f['theory_source'] or ''} |")
    bfits = [f for f in result["fits"] if f["norm"] == "bound" and f["variable"] == "ln_variance"]
    if bfits:
        lines += ["", "Valid Theorem-6 bound against the LayerNorm-1 input variance:", "",
                  "| block | part | bound exponent | 95% CI | theory |", "|---|---|---|---|---|"]
        for f in bfits:
            ci = f"[{f['ci'][0]:.3f}, {f['ci'][1]:.3f}]" if f["ci"] else "—"
            lines.append(f"| {f['block']} | {f['part']} | {f['exponent']:.3f} | {ci} | {_fmt(f['theory'], 1)} |")
    return "\n".join(lines) + "\n"


def _agg(records, setting, variable, block, part, norm):
    xs = sorted({r["x"] for r in records if r["setting"] == setting and r["variable"] == variable and r["block"] == block})
    if variable == "ln_variance":  # x differs per seed: aggregate by tau
        taus = sorted({r["tau"] for r in records if r["variable"] == variable})
        xv, lo, mid, hi = [], [], [], []
        for t in taus:
            rs = [r for r in records if r["variable"] == variable and r["block"] == block and r["part"] == part and r["tau"] == t]
            v = np.array([r[norm] for r in rs])
            xv.append(np.exp(np.mean(np.log([r["x"] for r in rs]))))
            lo.append(v.min()), mid.append(np.exp(np.mean(np.log(np.maximum(v, 1e-300))))), hi.append(v.max())
        return np.array(xv), np.array(lo), np.array(mid), np.array(hi)
    lo, mid, hi = [], [], []
    for x in xs:
        v = np.array([r[norm] for r in records if r["setting"] == setting and r["variable"] == variable
                      and r["block"] == block and r["part"] == part and r["x"] == x])
        lo.append(v.min()), mid.append(np.exp(np.mean(np.log(np.maximum(v, 1e-300))))), hi.append(v.max())
    return np.array(xs), np.array(lo), np.array(mid), np.array(hi)


def figures(result: dict, out: Path) -> list[str]:
    """Log-log plots: spectral (solid) and Frobenius (dashed) norms of the outer and functional
    parts, geometric mean over seeds with the min–max band, theory slopes dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    recs = result["records"]
    fitmap = {(f["setting"], f["variable"], f["block"], f["part"], f["norm"]): f for f in result["fits"]}
    written = []
    panels = {
        "input_scale": ([("attention", b) for b in ("W_Q,W_Q", "W_Q,W_K", "W_Q,W_V", "W_V,W_V")]
                        + [("block", b) for b in ("W_Q,W_Q", "W_Q,W_K", "W_V,W_V", "W_1,W_1")], 2, "input scale σ"),
        "seq_len": ([("attention", b) for b in ("W_Q,W_Q", "W_Q,W_K", "W_Q,W_V", "W_V,W_V")]
                    + [("block", b) for b in ("W_Q,W_Q", "W_Q,W_V", "W_V,W_V", "W_1,W_1")], 2, "sequence length L (‖X‖₂ fixed)"),
        "ln_variance": ([("block", b) for b in ("W_Q,W_Q", "W_Q,W_V", "W_V,W_V", "W_1,W_1")], 1,
                        "min LayerNorm-1 input variance"),
    }
    colors = {"outer": "tab:blue", "functional": "tab:orange"}
    for variable, (items, nrows, xlabel) in panels.items():
        if variable not in result.get("sweeps", SWEEPS):
            continue
        ncols = len(items) // nrows
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.6 * nrows), squeeze=False)
        for ax, (setting, block) in zip(axes.ravel(), items):
            for part in ("outer", "functional"):
                for norm, ls in (("spectral", "-"), ("frobenius", "--")):
                    x, lo, mid, hi = _agg(recs, setting, variable, block, part, norm)
                    if len(x) == 0 or np.all(hi == 0):
                        if norm == "spectral" and len(x):
                            ax.text(0.03, 0.04 if part == "functional" else 0.12, f"{part}: ≡ 0", transform=ax.transAxes,
                                    color=colors[part], fontsize=8)
                        continue
                    m = lo > 0
                    f = fitmap.get((setting, variable, block, part, norm))
                    lab = None
                    if norm == "spectral":
                        slope = "" if f is None else f" slope {f['exponent']:.2f}"
                        th = "" if f is None or f["theory"] is None else f" (th. {f['theory']:g})"
                        lab = f"{part}{slope}{th}"
                    ax.loglog(x[m], mid[m], ls, color=colors[part], label=lab, lw=1.4)
                    if norm == "spectral":
                        ax.fill_between(x[m], lo[m], hi[m], color=colors[part], alpha=0.15, lw=0)
                        if f is not None and f["theory"] is not None and not f.get("zero"):
                            x0, y0 = x[m][0], mid[m][0]
                            xr = np.array([x[m][0], x[m][-1]])
                            ax.loglog(xr, y0 * (xr / x0) ** f["theory"], ":", color=colors[part], lw=1)
            if variable == "ln_variance":
                x, lo, mid, hi = _agg(recs, setting, variable, block, "full", "bound")
                ax.loglog(x, mid, "-.", color="gray", lw=1, label="valid bound (full)")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_title(f"{setting}: {block}", fontsize=10)
            ax.set_xlabel(xlabel, fontsize=9)
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(fontsize=7, loc="best")
        fig.suptitle(f"Exact Hessian block norms vs {variable} (solid spectral, dashed Frobenius, dotted theory slope)",
                     fontsize=10)
        fig.tight_layout()
        name = f"scaling_{variable}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written


def compute(preset: str = "quick", seeds: int | None = None, quiet: bool = True, sweeps=SWEEPS,
            overrides: dict | None = None) -> dict:
    """Run the sweeps and the fits; returns the dict written to ``scaling.json``.

    ``preset``: ``"quick"`` or ``"full"`` (:data:`PRESETS`); ``seeds`` overrides the number of
    seeds (>= 2); ``sweeps`` a subset of :data:`SWEEPS`; ``overrides`` replaces preset entries
    (e.g. a shorter ``sigmas`` list). Raises ``ValueError`` on an unknown preset or sweep, or
    fewer than 2 seeds.
    """
    import blockhess as bh

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; use one of {list(PRESETS)}")
    P = dict(PRESETS[preset])
    P.update(overrides or {})
    sweeps = tuple(sweeps)
    bad = [w for w in sweeps if w not in SWEEPS]
    if bad or not sweeps:
        raise ValueError(f"sweeps must be a non-empty subset of {SWEEPS}, got {list(sweeps)}")
    if seeds is not None:
        if seeds < 2:
            raise ValueError(f"--seeds must be >= 2 (confidence intervals need them), got {seeds}")
        P["seeds"] = seeds
    cfgs = {
        "attention": bh.BlockConfig(d_model=P["d_model"], d_k=P["d_k"], kind="attention"),
        "block": bh.BlockConfig(d_model=P["d_model"], d_k=P["d_k"], d_ff=P["d_ff"], kind="block"),
    }
    t0 = time.perf_counter()
    records = []
    for job in progress(_jobs(cfgs, P, sweeps), quiet, total=_n_jobs(P, sweeps), desc="exact Hessians"):
        setting, variable, x, seed, params, X, cfg, T = job[:8]
        extra = job[8] if len(job) > 8 else {}
        for r in _measure(params, X, cfg, T):
            records.append({"setting": setting, "variable": variable, "x": x, "seed": seed, **extra, **r})
    result = {"preset": preset, "config": P, "sweeps": list(sweeps), "records": records}
    result["fits"] = fits(records, P)
    result["runtime_s"] = time.perf_counter() - t0
    return result


def run(args: argparse.Namespace) -> int:
    check_out(args.out)
    with torch_threads(args.threads):
        t0 = time.perf_counter()
        result = compute("quick" if args.quick else "full", seeds=args.seeds, quiet=args.quiet)
        result["environment"] = environment()
        with atomic_dir(args.out) as tmp:
            names = figures(result, tmp)
            result["figures"] = names
            result["total_runtime_s"] = time.perf_counter() - t0
            (tmp / "scaling.md").write_text(markdown(result))
            write_json(tmp / "scaling.json", result)
    out = args.out
    if not args.quiet:
        att = [f for f in result["fits"] if f["setting"] == "attention" and f["variable"] == "input_scale"
               and f["norm"] == "spectral" and f["block"] in ("W_Q,W_Q", "W_V,W_V") and f["part"] != "full"]
        for f in att:
            ex = "≡ 0" if f.get("zero") else f"{f['exponent']:.3f}"
            print(f"attention {f['block']} {f['part']}: exponent {ex} (theory {f['theory']:g})")
        print(f"wrote {out}/scaling.json, scaling.md and {len(names)} figures in {result['total_runtime_s']:.1f} s")
    return 0
