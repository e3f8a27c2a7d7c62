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

A part that is exactly zero at every point (the bare layer's functional V,V block: ``F`` is
linear in ``W_V``) has no exponent: its fit has ``"zero": true`` and ``exponent``/``ci`` ``None``.

Writes ``scaling.json`` (``"fits"``: ``{setting, block, part, variable, norm, exponent, ci,
theory, theory_source, theory_zero, zero, n, window}``; ``"records"``: every measured norm), ``scaling.md``
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

from blockhess import linalg
from blockhess.config import pair_key
from .outputs import atomic_dir, check_out, out_help, write_json
from .runtime import add_quiet_argument, add_threads_argument, environment, load_average, progress, torch_threads

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

PARTS = ("outer", "functional", "full")
ORM = "Ormaniec et al. (2410.10986), small σ"
ZERO_SRC = "identically zero: F is linear in W_V (Ormaniec et al.)"
DER = "derived here (docs/bounds.md §9)"
PAPER_L3 = "paper §3.3 (1/L³ at fixed ‖X‖₂), uniform-attention regime"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="scaling", metavar="DIR", help=out_help("scaling"))
    p.add_argument("--quick", action="store_true", help="small sizes, 3 seeds (well under a minute on 2 cores)")
    p.add_argument("--seeds", type=int, default=None, metavar="N", help="number of seeds (default: 3 quick, 8 full)")
    add_threads_argument(p)
    add_quiet_argument(p, "summary lines (fitted exponents, files written)")


# --------------------------------------------------------------------------- theory


def theory(setting: str, variable: str, block: str, part: str, norm: str) -> tuple[float | None, str | None]:
    """Predicted exponent (and its source) of a Hessian block's norm; ``(None, None)`` if none.

    ``block`` as ``"W_Q,W_K"``; ``part`` outer/functional/full; ``norm`` spectral, frobenius
    (same asymptotic exponent) or bound (the valid Theorem-1/6 bound; only for ``ln_variance``).
    Source of each value: :data:`ORM`, :data:`PAPER_L3` or derived here (docs/bounds.md). A part
    that is identically zero (:func:`identically_zero`) has no exponent: ``(None, ZERO_SRC)``.
    """
    a, b = block.split(",")
    k = pair_key(a, b)
    if identically_zero(setting, block, part) and norm != "bound":
        return None, ZERO_SRC
    if norm == "bound":
        if setting == "block" and variable == "ln_variance":
            n_att = sum(c in "QKV" for c in k)
            return {2: -1.0, 1: -0.5, 0: 0.0}[n_att], "Theorem 6 bound: ‖J_Y‖ ∝ σ_min⁻¹, ‖H_Y‖ ∝ σ_min⁻²"
        return None, None
    if variable == "input_scale":
        if setting == "attention":
            table = {
                "outer": {"QQ": 6, "QK": 6, "KK": 6, "QV": 4, "KV": 4, "VV": 2},
                "functional": {"QQ": 5, "KK": 5, "QK": 3, "QV": 3, "KV": 3},
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
                return -2.0, DER
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


def identically_zero(setting: str, block: str, part: str) -> bool:
    """Whether a part is zero for every input by construction: the functional V,V block of the
    bare attention layer (``F`` is linear in ``W_V``), so it has no scaling exponent."""
    return setting == "attention" and block == "W_V,W_V" and part == "functional"


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
    """The exponent fits of every (setting, variable, block, part, norm) in ``records``.

    A part whose norm is exactly zero at every point of the window gets ``"zero": True`` and
    ``exponent``/``ci`` ``None`` (there is no slope); ``"theory_zero"`` marks the parts that are
    zero by construction (:func:`identically_zero`). The ``ln_variance`` window is
    ``τ <= fit_tau_max``; its ``"min"``/``"max"`` are the measured variances it spans.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["setting"], r["variable"], r["block"], r["part"]), []).append(r)
    out = []
    for (setting, variable, block, part), rs in groups.items():
        lo, hi = _window(variable, P)
        if variable == "ln_variance":
            sel = [r for r in rs if r["tau"] <= P["fit_tau_max"]]
            xs = [r["x"] for r in sel]
            window = {"tau_max": P["fit_tau_max"], "min": min(xs, default=None), "max": max(xs, default=None)}
        else:
            sel = [r for r in rs if lo * (1 - 1e-9) <= r["x"] <= hi * (1 + 1e-9)]
            window = {"min": lo, "max": hi}
        for norm in ("spectral", "frobenius", "bound"):
            th, src = theory(setting, variable, block, part, norm)
            if norm == "bound" and th is None and variable != "input_scale":
                continue
            vals = np.array([r[norm] for r in sel])
            row = {"setting": setting, "block": block, "part": part, "variable": variable, "norm": norm,
                   "theory": th, "theory_source": src, "window": window,
                   "theory_zero": norm != "bound" and identically_zero(setting, block, part)}
            if len(vals) and np.all(vals == 0):
                row.update({"exponent": None, "ci": None, "n": len(vals), "zero": True,
                            "note": "exactly zero at every point: no exponent (not a σ⁰ law)"})
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

#: the sweeps in words (tables and figures)
VARIABLE_WORDS = {"input_scale": "input scale σ", "seq_len": "sequence length L",
                  "ln_variance": "LayerNorm-1 input variance"}
SETTING_WORDS = {"attention": "attention layer", "block": "post-LN block"}


def _num(v, nd=3) -> str:
    """``v`` with ``nd`` decimals; a value that rounds to zero prints as ``0.000``, never ``-0.000``."""
    if v is None:
        return "—"
    s = f"{v:.{nd}f}"
    return f"{0.0:.{nd}f}" if float(s) == 0 else s


def _theory_s(f: dict, nd=1) -> str:
    return "≡ 0" if f.get("theory_zero") else _num(f["theory"], nd)


def markdown(result: dict) -> str:
    """The fit table (spectral norms; Frobenius and bound fits are in the JSON) as markdown."""
    P = result["config"]
    fits_ = result["fits"]
    lnv = [f for f in fits_ if f["variable"] == "ln_variance" and f["window"].get("max") is not None]
    if lnv:
        w = lnv[0]["window"]
        ln_window = (f"LayerNorm-1 input variance v = min_t var(U_t) ≤ {w['max']:.2g} (measured; the points with "
                     f"τ ≤ {P['fit_tau_max']:g}, where the input rows are X_t = c_t𝟙 + τ z_t and τ is the size of "
                     f"their non-constant part; v ∝ τ², here {w['min']:.2g} … {w['max']:.2g})")
    else:
        ln_window = (f"LayerNorm-1 input variance: the points with τ ≤ {P['fit_tau_max']:g} (input rows "
                     "X_t = c_t𝟙 + τ z_t; τ is the size of their non-constant part)")
    lines = [
        "# Curvature scaling laws (exact Hessians)", "",
        f"Preset `{result['preset']}`: d_model={P['d_model']}, d_k={P['d_k']}, d_ff={P['d_ff']}, "
        f"L={P['L']}, {P['seeds']} seeds; MSE, fixed target T ~ N(0, 1). Run time {result['runtime_s']:.1f} s computing, "
        f"{result.get('total_runtime_s', result['runtime_s']):.1f} s with the figures.",
        "",
        "Exponent = least-squares slope of log‖H_block‖ on log(variable) (one intercept per seed), 95% CI from the "
        "slope's standard error and a t quantile. Fit windows: input scale σ ≤ "
        f"{P['fit_sigma_max']:.3g}; sequence length L = {P['seq_lens'][0]}–{P['seq_lens'][-1]} at ‖X‖₂ = {P['rho']:g}; "
        f"{ln_window}.", "",
        "`≡ 0`: the part is exactly zero at every point (the attention layer's functional V,V block: F is linear "
        "in W_V), so no exponent is fitted: it does not scale like σ⁰ (a nonzero constant), it vanishes.", "",
        "| setting | variable | block | part | exponent (spectral) | 95% CI | exponent (Frobenius) | theory | source |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fro = {(f["setting"], f["variable"], f["block"], f["part"]): f for f in fits_ if f["norm"] == "frobenius"}
    for f in fits_:
        if f["norm"] != "spectral":
            continue
        key = (f["setting"], f["variable"], f["block"], f["part"])
        if f.get("zero"):
            ex, ci = "≡ 0 (identically zero)", "—"
        else:
            ex = _num(f["exponent"])
            ci = f"[{_num(f['ci'][0])}, {_num(f['ci'][1])}]" if f["ci"] else "—"
        fr = fro.get(key)
        fr_s = "—" if fr is None else ("≡ 0" if fr.get("zero") else _num(fr["exponent"]))
        lines.append(f"| {f['setting']} | {VARIABLE_WORDS[f['variable']]} | {f['block']} | {f['part']} | {ex} | {ci} | "
                     f"{fr_s} | {_theory_s(f)} | {f['theory_source'] or ''} |")
    bfits = [f for f in fits_ if f["norm"] == "bound" and f["variable"] == "ln_variance"]
    if bfits:
        lines += ["", "Valid Theorem-6 bound against the LayerNorm-1 input variance:", "",
                  "| block | part | bound exponent | 95% CI | theory |", "|---|---|---|---|---|"]
        for f in bfits:
            ci = f"[{_num(f['ci'][0])}, {_num(f['ci'][1])}]" if f["ci"] else "—"
            lines.append(f"| {f['block']} | {f['part']} | {_num(f['exponent'])} | {ci} | {_num(f['theory'], 1)} |")
    return "\n".join(lines) + "\n"


def _agg(rs: list[dict], variable: str, norm: str):
    """``(x, min, geometric mean, max)`` over seeds of one series' records ``rs``.

    ``ln_variance``: the variance differs per seed, so points are grouped by ``tau`` and ``x`` is
    the geometric mean of the seeds' variances."""
    key = "tau" if variable == "ln_variance" else "x"
    by: dict[float, list[dict]] = {}
    for r in rs:
        by.setdefault(r[key], []).append(r)
    xv, lo, mid, hi = [], [], [], []
    for k in sorted(by):
        g = by[k]
        v = np.array([r[norm] for r in g])
        xv.append(float(np.exp(np.mean(np.log([r["x"] for r in g])))) if key == "tau" else k)
        lo.append(v.min()), mid.append(np.exp(np.mean(np.log(np.maximum(v, 1e-300))))), hi.append(v.max())
    return np.array(xv), np.array(lo), np.array(mid), np.array(hi)


def _block_tex(block: str) -> str:
    a, b = block.split(",")
    return f"$W_{{{a[2:]}}}, W_{{{b[2:]}}}$"


def figures(result: dict, out: Path) -> list[str]:
    """Log-log plots: spectral (solid, markers) and Frobenius (dashed) norms of the Hessian parts,
    geometric mean over seeds with the min–max band of the spectral norm over seeds, theory
    slopes dotted, the fit window shaded; the sequence-length figure also shows the full Hessian."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator, ScalarFormatter

    P = result["config"]
    nseeds = P["seeds"]
    series: dict[tuple, list[dict]] = {}
    for r in result["records"]:
        series.setdefault((r["setting"], r["variable"], r["block"], r["part"]), []).append(r)
    fitmap = {(f["setting"], f["variable"], f["block"], f["part"], f["norm"]): f for f in result["fits"]}
    written = []
    panels = {
        "input_scale": ([("attention", b) for b in ("W_Q,W_Q", "W_Q,W_K", "W_Q,W_V", "W_V,W_V")]
                        + [("block", b) for b in ("W_Q,W_Q", "W_Q,W_K", "W_V,W_V", "W_1,W_1")], 2,
                        "input scale σ  (X → σX)", ("outer", "functional"),
                        f"Exact Hessian block norms against the input scale σ (X → σX; d_model = {P['d_model']}, "
                        f"L = {P['L']})"),
        "seq_len": ([("attention", b) for b in ("W_Q,W_Q", "W_Q,W_K", "W_Q,W_V", "W_V,W_V")]
                    + [("block", b) for b in ("W_Q,W_Q", "W_Q,W_V", "W_V,W_V", "W_1,W_1")], 2,
                    f"sequence length L  (‖X‖₂ = {P['rho']:g} fixed)", ("outer", "functional", "full"),
                    f"Exact Hessian block norms against the sequence length L at fixed ‖X‖₂ = {P['rho']:g} "
                    f"(d_model = {P['d_model']})"),
        "ln_variance": ([("block", b) for b in ("W_Q,W_Q", "W_Q,W_V", "W_V,W_V", "W_1,W_1")], 1,
                        "LayerNorm-1 input variance v = min_t var(U_t)", ("outer", "functional"),
                        "Post-LN block: exact Hessian block norms against the variance of the LayerNorm-1 input "
                        f"U = X + attention(X)\n(input rows X_t = c_t𝟙 + τz_t, τ = {min(P['taus']):.0e} … "
                        f"{max(P['taus']):g}, v ∝ τ²; d_model = {P['d_model']}, L = {P['L']})"),
    }
    colors = {"outer": "tab:blue", "functional": "tab:orange", "full": "tab:green"}
    for variable, (items, nrows, xlabel, parts, title) in panels.items():
        if variable not in result.get("sweeps", SWEEPS):
            continue
        ncols = len(items) // nrows
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.3 * ncols, 3.5 * nrows + 0.9), squeeze=False)
        window = None
        for i, (ax, (setting, block)) in enumerate(zip(axes.ravel(), items)):
            for part in parts:
                rs = series.get((setting, variable, block, part), [])
                for norm, ls in (("spectral", "-"), ("frobenius", "--")):
                    x, lo, mid, hi = _agg(rs, variable, norm)
                    if len(x) == 0 or np.all(hi == 0):
                        if norm == "spectral" and len(x):  # a legend entry, no line: nothing to plot on log axes
                            ax.plot([], [], " ", color=colors[part], label=f"{part}: ≡ 0 (identically zero, not plotted)")
                        continue
                    m = lo > 0
                    f = fitmap.get((setting, variable, block, part, norm))
                    lab = None
                    if norm == "spectral":
                        slope = "" if f is None or f["exponent"] is None else f": slope {_num(f['exponent'], 2)}"
                        th = "" if f is None or f["theory"] is None else f" (theory {_num(f['theory'], 0 if float(f['theory']).is_integer() else 1)})"
                        lab = f"{part}{slope}{th}"
                    ax.loglog(x[m], mid[m], ls, color=colors[part], label=lab, lw=1.4,
                              marker="o" if norm == "spectral" else None, ms=2.5)
                    if norm == "spectral":
                        ax.fill_between(x[m], lo[m], hi[m], color=colors[part], alpha=0.15, lw=0)
                        if f is not None and f["theory"] is not None and not f.get("zero"):
                            x0, y0 = x[m][0], mid[m][0]
                            xr = np.array([x[m][0], x[m][-1]])
                            ax.loglog(xr, y0 * (xr / x0) ** f["theory"], ":", color=colors[part], lw=1.2)
            if variable == "ln_variance":
                x, lo, mid, hi = _agg(series.get((setting, variable, block, "full"), []), variable, "bound")
                ax.loglog(x, mid, "-.", color="gray", lw=1, label="valid Theorem-6 bound (full)")
            # fit window
            fw = next((f for f in result["fits"] if f["variable"] == variable and f["setting"] == setting
                       and f["block"] == block and f["norm"] == "spectral"), None)
            if fw is not None and variable != "seq_len" and fw["window"].get("max") is not None:
                window = fw["window"]
                lo_w = window.get("min") or ax.get_xlim()[0]
                ax.axvspan(lo_w, window["max"], facecolor="none", edgecolor="0.8", hatch="///", lw=0, zorder=0)
            if variable == "seq_len":
                ax.xaxis.set_major_locator(FixedLocator(P["seq_lens"]))
                ax.xaxis.set_major_formatter(ScalarFormatter())
                ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_title(f"{SETTING_WORDS[setting]}: block {_block_tex(block)}", fontsize=10)
            ax.set_xlabel(xlabel, fontsize=9)
            if i % ncols == 0:
                ax.set_ylabel("norm of the Hessian block", fontsize=9)
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(fontsize=7, loc="best")
        handles = [
            Line2D([], [], color="k", ls="-", marker="o", ms=2.5, label=f"spectral norm ‖·‖₂, geometric mean over {nseeds} seeds"),
            Patch(color="tab:blue", alpha=0.15, lw=0, label=f"shaded band (colour of the part): min–max of ‖·‖₂ over the {nseeds} seeds"),
            Line2D([], [], color="k", ls="--", label="Frobenius norm ‖·‖_F (geometric mean)"),
            Line2D([], [], color="k", ls=":", lw=1.2, label="theory slope, drawn through the first point"),
        ]
        if window is not None:
            handles.append(Patch(facecolor="none", edgecolor="0.6", hatch="///", lw=0, label="fit window of the slopes"))
        if variable == "seq_len":
            handles.append(Line2D([], [], color="none", label="slopes fitted over all L shown"))
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
        fig.suptitle(title, fontsize=11)
        fig.tight_layout(rect=(0, 0.05 if nrows == 2 else 0.09, 1, 1))
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
        env = environment()
        t0 = time.perf_counter()
        result = compute("quick" if args.quick else "full", seeds=args.seeds, quiet=args.quiet)
        result["environment"] = {**env, "load_average_at_end": load_average()}
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
            if f.get("zero"):
                print(f"attention {f['block']} {f['part']}: identically zero, no exponent (theory: ≡ 0)")
            else:
                print(f"attention {f['block']} {f['part']}: exponent {_num(f['exponent'])} (theory {_theory_s(f, 0)})")
        print(f"wrote {out}/scaling.json, scaling.md and {len(names)} figures in {result['total_runtime_s']:.1f} s")
    return 0
