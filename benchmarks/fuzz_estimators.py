"""A long fuzzing run of the sampled estimators (docs/results.md, "Estimators: coverage and fuzzing").

Two parts, written into one JSON (``benchmarks/results/fuzz-estimators-<commit>.json``):

1. *Coverage*: on each adversarial spectrum family (below), ``--seeds`` (default 400) seeds of
   ``hutchpp_trace`` and ``frobenius_norm`` at each budget of ``--budgets``, ``hutchinson_diagonal`` and
   ``slq_density`` at their defaults: how often the stated interval holds the exact value (an estimator
   without ``ci_low``, as before the intervals, is judged by ``value ± 1.96 stderr``), the largest
   ``|z| = |value − exact| / stderr``, and for SLQ its first two moments (``tr A / n``, ``‖A‖_F² / n``) in
   ``SLQResult.integral``'s intervals, its total mass, and the density against the broadened exact spectrum
   in ``[ci_low, ci_high]`` at the grid points where the exact density is above 1e-3 of its peak (a tree
   from before SLQ's intervals: the moments within Student's t times the probes' sample standard error, the
   density within ``1.96 stderr + quadrature_error``, both also reported for the new tree's ``stderr``).
   ``--slq-only`` measures SLQ alone.
2. *Fuzz*: ``--configs`` random configurations (a family, a size ``n`` of 8–600, float64 or float32, a
   budget, a seed, a dense tensor or a ``HessianOperator``), each run through every estimator with checks
   that must hold on every draw (exact results where the budget covers ``n``, intervals that contain their
   value, finite outputs, SLQ's unit mass) and every named refusal (an off-diagonal view, an asymmetric
   dense tensor, budgets and arguments out of range, ``per_block`` pairs). ``--lanczos`` adds
   ``lanczos_eigs`` (public API only: warm starts at non-extreme eigenvectors; a result must have
   eigenvalues within its residuals of the spectrum, or raise ``NotConvergedError``).

Coverage counts are reported, not asserted (a failure is a broken invariant or an unexpected error).
Run: ``PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/fuzz_estimators.py [--seeds 400] [--configs 2000]``.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import subprocess
import sys
import time
import traceback

import torch

import blockhess as bh
from blockhess.operators import (HessianOperator, NotConvergedError, frobenius_norm, hutchinson_diagonal, hutchpp_trace,
                                 lanczos_eigs, per_block, slq_density)

DT = torch.float64
ROOT = pathlib.Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- spectra


def spectrum(family: str, n: int, gen: torch.Generator) -> torch.Tensor:
    """The eigenvalues ``(n,)`` of one adversarial family (float64)."""
    r = lambda *s: torch.rand(*s, generator=gen, dtype=DT)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=DT)
    k = max(1, min(20, n // 4))
    i = torch.arange(1, k + 1, dtype=DT)
    if family == "lowrank_noise":  # Hessian-like: decaying outliers over a noise bulk of both signs
        return torch.cat([50 / i, 0.05 * rn(n - k)])
    if family == "lowrank_past_sketch":  # 12 outliers: just past the default sketch's 10 columns
        m = min(12, n - 1)
        return torch.cat([10 + r(m), 1e-2 * rn(n - m)])
    if family == "outliers":  # a few large outliers over a bulk
        m = min(3, n - 1)
        return torch.cat([torch.tensor([1e3, 8e2, 5e2], dtype=DT)[:m], r(n - m)])
    if family == "clusters":  # clusters just below values
        c = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0], dtype=DT)
        m = max(1, min(20, n // 10))
        vals = torch.cat([ci - 1e-3 * r(m) for ci in c])[: n]
        return torch.cat([vals, torch.zeros(n - vals.numel(), dtype=DT)])
    if family == "multiplicity":  # one value repeated more often than the sketch has columns
        m = min(30, max(1, n // 3))
        return torch.cat([torch.full((m,), 10.0, dtype=DT), 2 * r(n - m) - 1])
    if family == "decades12":  # twelve decades
        return 10 ** (-12 * r(n))
    if family == "indefinite":  # both signs, outliers of each
        m = min(5, n // 4)
        return torch.cat([5 + 5 * r(m), -5 - 5 * r(m), rn(n - 2 * m)])
    if family == "indefinite_outliers":  # a few large ones of alternating sign over a small bulk
        m = min(4, n - 1)
        return torch.cat([torch.tensor([40.0, -35.0, 30.0, -25.0], dtype=DT)[:m], 0.1 * rn(n - m)])
    if family == "flat":  # no structure for the sketch to take
        return 0.5 + 0.5 * r(n)
    if family == "gn_null":  # a Gauss-Newton-like PSD low rank with a null space
        return torch.cat([10 / i**2, torch.zeros(n - k, dtype=DT)])
    raise ValueError(family)


FAMILIES = ["lowrank_noise", "lowrank_past_sketch", "outliers", "clusters", "multiplicity", "decades12", "indefinite",
            "indefinite_outliers", "flat", "gn_null"]


def matrix(lam: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    n = lam.numel()
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=DT))
    M = (Q * lam) @ Q.T
    return (M + M.T) / 2


def block_hessian() -> tuple[torch.Tensor, HessianOperator]:
    """A real Hessian: a post-LN block (d_model 8, d_ff 16, two heads, biases) under MSE, n = 480."""
    cfg = bh.BlockConfig(d_model=8, d_ff=16, n_heads=2, bias=True, ln_affine=True, ln_eps=1e-5)
    g = torch.Generator().manual_seed(5)
    params = bh.init_params(cfg, seed=5)
    X, T = torch.randn(2, 4, 8, generator=g, dtype=DT), torch.randn(2, 4, 8, generator=g, dtype=DT)
    H = bh.hessian(params, X, cfg, loss="mse", target=T)
    return H.dense(), HessianOperator.from_dense(H)


# ----------------------------------------------------------------------------- coverage


def _t(conf: float, dof: int) -> float:
    try:
        from blockhess.operators.estimators import _t_quantile
    except ImportError:  # a tree from before the intervals (the "before" run): SciPy's
        from scipy import stats
        return float(stats.t.ppf((1 + conf) / 2, dof))
    return _t_quantile(conf, dof)


def _interval(e) -> tuple[float, float]:
    lo, hi = getattr(e, "ci_low", None), getattr(e, "ci_high", None)
    if lo is None:  # before the intervals: value ± 1.96 stderr
        return e.value - 1.96 * e.stderr, e.value + 1.96 * e.stderr
    return lo, hi


def _z(value, exact, se) -> float:
    if se > 0:
        return abs(value - exact) / se
    return 0.0 if abs(value - exact) <= 1e-9 * max(abs(exact), 1e-300) else math.inf


def broadened(lam: torch.Tensor, grid: torch.Tensor, sigma: float) -> torch.Tensor:
    z = (grid[:, None] - lam[None, :]) / sigma
    return torch.exp(-0.5 * z * z).sum(1) / (lam.numel() * sigma * math.sqrt(2 * math.pi))


def _slq_coverage(M: torch.Tensor, lam: torch.Tensor, slq_seeds: int) -> dict:
    """``slq_density`` at its defaults on ``M`` (eigenvalues ``lam``) over ``slq_seeds`` seeds."""
    n = lam.numel()
    moments = (lambda x: x, float(lam.mean())), (lambda x: x * x, float((lam * lam).mean()))
    c, c_sample = [0, 0], [0, 0]
    mass_err = 0.0
    dens_in = dens_196 = dens_all = 0
    zmax_d = 0.0
    widths = []
    P = 16
    q = _t(0.95, P - 1)
    new = None
    for s in range(slq_seeds):
        r = slq_density(M, seed=s)
        new = getattr(r, "ci_low", None) is not None
        w, th = r.weights, r.nodes
        mass_err = max(mass_err, float((w.sum(1) - 1).abs().max()))
        for i, (f, exact) in enumerate(moments):
            p = (w * f(th)).sum(1)
            c_sample[i] += abs(float(p.mean()) - exact) <= q * float(p.std()) / math.sqrt(P)
            if new:
                e = r.integral(f)
                c[i] += e.ci_low <= exact <= e.ci_high
        exact_d = broadened(lam, r.grid, r.sigma)
        err = (r.density - exact_d).abs()
        live = exact_d > 1e-3 * float(exact_d.max())
        if new:
            dens_in += int(((r.ci_low <= exact_d) & (exact_d <= r.ci_high))[live].sum())
            widths.append(float(((r.ci_high - r.ci_low)[live] / exact_d[live]).median()))
        dens_196 += int((err[live] <= 1.96 * r.stderr[live] + r.quadrature_error[live]).sum())
        dens_all += int(live.sum())
        zmax_d = max(zmax_d, float(((err - r.quadrature_error).clamp_min(0)[live] / r.stderr[live].clamp_min(1e-300)).max()))
    rec = {"seeds": slq_seeds, "n": n, "rule": "ci" if new else "sample", "max_mass_error": mass_err,
           "moment1_coverage_sample_t": c_sample[0] / slq_seeds, "moment2_coverage_sample_t": c_sample[1] / slq_seeds,
           "density_pointwise_coverage_1.96_stderr": dens_196 / max(dens_all, 1), "density_points": dens_all,
           "density_max_z": zmax_d}
    if new:
        rec.update({"moment1_coverage": c[0] / slq_seeds, "moment2_coverage": c[1] / slq_seeds,
                    "density_pointwise_coverage": dens_in / max(dens_all, 1),
                    "density_median_rel_width": sorted(widths)[len(widths) // 2]})
    else:
        rec.update({"moment1_coverage": rec["moment1_coverage_sample_t"], "moment2_coverage": rec["moment2_coverage_sample_t"],
                    "density_pointwise_coverage": rec["density_pointwise_coverage_1.96_stderr"]})
    return rec


def coverage(seeds: int, budgets: list[int], n: int, slq_seeds: int, quiet: bool, slq_only: bool = False) -> dict:
    out = {}
    cases = [(f, None) for f in FAMILIES] + [("block_hessian", None)]
    for family, _ in cases:
        t0 = time.perf_counter()
        if family == "block_hessian":
            M, _op = block_hessian()
            lam = torch.linalg.eigvalsh(M)
        else:
            g = torch.Generator().manual_seed(1000 + FAMILIES.index(family))
            lam = spectrum(family, n, g)
            M = matrix(lam, g)
        tr, fro = float(lam.sum()), float(lam.norm())
        rec = {"n": int(M.shape[0]), "trace": tr, "frobenius": fro}
        for N in ([] if slq_only else budgets):
            for name, fn, exact in (("hutchpp_trace", hutchpp_trace, tr), ("frobenius_norm", frobenius_norm, fro)):
                inside = inside196 = 0
                zmax = 0.0
                widths = []
                for s in range(seeds):
                    e = fn(M, N, seed=s)
                    lo, hi = _interval(e)
                    inside += lo <= exact <= hi
                    inside196 += abs(e.value - exact) <= 1.96 * e.stderr
                    zmax = max(zmax, _z(e.value, exact, e.stderr))
                    widths.append((hi - lo) / max(abs(exact), 1e-300))
                rec[f"{name}@{N}"] = {"coverage": inside / seeds, "coverage_1.96_stderr": inside196 / seeds,
                                      "max_abs_z": zmax, "median_rel_width": sorted(widths)[len(widths) // 2]}
        if not slq_only:
            # hutchinson_diagonal at its default budget: every entry, every seed
            d = torch.diagonal(M)
            hits = torch.zeros_like(d)
            hits196 = torch.zeros_like(d)
            for s in range(seeds):
                e = hutchinson_diagonal(M, seed=s)
                lo, hi = _interval(e)
                hits += ((lo <= d) & (d <= hi)).to(DT)
                hits196 += ((e.value - d).abs() <= 1.96 * e.stderr).to(DT)
            rec["hutchinson_diagonal@30"] = {"coverage": float(hits.mean()) / seeds,
                                             "worst_entry_coverage": float(hits.min()) / seeds,
                                             "coverage_1.96_stderr": float(hits196.mean()) / seeds}
        rec["slq_density"] = _slq_coverage(M, lam, slq_seeds)
        rec["seconds"] = time.perf_counter() - t0
        out[family] = rec
        if not quiet:
            line = " ".join(f"{k}={v['coverage']:.3f}" for k, v in rec.items() if isinstance(v, dict) and "coverage" in v)
            sl = rec["slq_density"]
            print(f"[coverage] {family:20s} {line} slq m1={sl['moment1_coverage']:.3f} m2={sl['moment2_coverage']:.3f} "
                  f"dens={sl['density_pointwise_coverage']:.3f} ({rec['seconds']:.0f}s)", file=sys.stderr, flush=True)
    return out


# ----------------------------------------------------------------------------- fuzz


def _expect(fn, error, says: str):
    try:
        fn()
    except error as e:
        if says not in str(e):
            raise AssertionError(f"{error.__name__} without {says!r}: {e}") from None
        return
    raise AssertionError(f"no {error.__name__} ({says!r})")


def one_config(rng: torch.Generator, i: int, lanczos: bool) -> dict:
    family = FAMILIES[int(torch.randint(0, len(FAMILIES), (1,), generator=rng))]
    n = int(torch.randint(8, 601, (1,), generator=rng))
    dtype = torch.float32 if float(torch.rand(1, generator=rng)) < 0.25 else DT
    N = int(torch.randint(4, 121, (1,), generator=rng))
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    as_operator = bool(torch.rand(1, generator=rng) < 0.5)
    g = torch.Generator().manual_seed(seed)
    lam = spectrum(family, n, g)
    M64 = matrix(lam, g)
    M = M64.to(dtype)
    if dtype == torch.float32:
        M = (M + M.T) / 2
    # a symmetric operator with two equal halves: a square off-diagonal view to refuse
    h = n // 2
    op = HessianOperator.from_dense(M, names=("a", "b", "c"), shapes={"a": (h,), "b": (h,), "c": (n - 2 * h,)}) \
        if n - 2 * h > 0 else HessianOperator.from_dense(M, names=("a", "b"), shapes={"a": (h,), "b": (h,)})
    A = op if as_operator else M
    cfg = {"i": i, "family": family, "n": n, "dtype": str(dtype), "n_matvecs": N, "seed": seed, "operator": as_operator}
    tr, fro = float(lam.sum()), float(lam.norm())
    scale = float(lam.abs().max())
    eps = torch.finfo(dtype).eps
    tol = 50 * n * eps  # rounding of sums of n terms (float32: the matrix's own rounding)
    res = {}
    # the trace
    e = hutchpp_trace(A, N, seed=seed)
    assert e.ci_low <= e.value <= e.ci_high and math.isfinite(e.value) and e.stderr >= 0
    if N >= n:
        assert e.exact and abs(e.value - tr) <= tol * fro * math.sqrt(n), (e.value, tr)
    res["trace_in"] = bool(e.ci_low - tol * fro <= tr <= e.ci_high + tol * fro)
    # the norm
    f = frobenius_norm(A, N, seed=seed)
    assert f.ci_low <= f.value <= f.ci_high and math.isfinite(f.value)
    if N >= n:
        assert f.exact and abs(f.value - fro) <= tol * fro
    res["fro_in"] = bool(f.ci_low * (1 - tol) <= fro <= f.ci_high * (1 + tol))
    # the norm of a square off-diagonal view (any operator): exact from its columns, and its interval
    B = op["a", "b"]
    Bd = M64[:h, h : 2 * h]
    fb = frobenius_norm(B, N, seed=seed)
    exact_b = float(torch.linalg.matrix_norm(Bd))
    res["fro_view_in"] = bool(fb.ci_low * (1 - tol) - tol * fro <= exact_b <= fb.ci_high * (1 + tol) + tol * fro)
    # the diagonal
    d = hutchinson_diagonal(A, max(2, N), seed=seed)
    assert bool(torch.isfinite(d.value).all()) and bool((d.ci_low <= d.value).all())
    dd = torch.diagonal(M64).to(d.value.dtype)
    res["diag_in_fraction"] = float(((d.ci_low - tol * scale <= dd) & (dd <= d.ci_high + tol * scale)).double().mean())
    # the density: unit mass per probe, finite, its first moment within its probes' t interval
    P = 2 + int(torch.randint(0, 15, (1,), generator=rng))
    m = 2 + int(torch.randint(0, 60, (1,), generator=rng))
    r = slq_density(A, n_probes=P, n_iter=m, seed=seed)
    assert float((r.weights.sum(1) - 1).abs().max()) <= 1e3 * eps, "SLQ weights do not sum to 1"
    assert bool(torch.isfinite(r.density).all()) and bool((r.stderr >= 0).all())
    assert r.n == n and bool((r.ci_low >= 0).all()) and bool((r.ci_low <= r.density).all()) \
        and bool((r.density <= r.ci_high).all()), "SLQ's interval does not hold its density"
    e1 = r.integral(lambda x: x)
    assert e1.ci_low <= e1.value <= e1.ci_high and math.isfinite(e1.stderr)
    # the float32 matrix is the float64 one rounded: its eigenvalues move by up to ~ n ε ‖M‖ (Weyl)
    res["slq_m1_in"] = bool(e1.ci_low - tol * scale <= tr / n <= e1.ci_high + tol * scale)
    exact_d = broadened(lam, r.grid.double(), r.sigma)
    live = exact_d > 1e-3 * float(exact_d.max())
    slack = tol * scale * float(exact_d.max()) / r.sigma  # the same eigenvalue shift through the Gaussian's slope
    res["slq_density_in_fraction"] = float(((r.ci_low.double() - slack <= exact_d)
                                            & (exact_d <= r.ci_high.double() + slack))[live].double().mean())
    # the refusals, each by name and before any product
    _expect(lambda: hutchpp_trace(op["a", "b"], N), ValueError, "the off-diagonal view A['a', 'b']")
    _expect(lambda: slq_density(op["a", "b"]), ValueError, "slq_density assumes a symmetric operator")
    _expect(lambda: per_block(op, hutchpp_trace, pairs=True), ValueError, "per_block, pairs=True")
    asym = M64.clone()
    asym[0, 1] += 1e-3 * scale + 1e-3
    _expect(lambda: hutchpp_trace(asym, N), ValueError, "a dense tensor with ||A - A^T||_F")
    _expect(lambda: hutchpp_trace(A, 3), ValueError, "n_matvecs")
    _expect(lambda: frobenius_norm(A, 3), ValueError, "n_matvecs")
    _expect(lambda: hutchinson_diagonal(A, 1), ValueError, "n_matvecs")
    _expect(lambda: hutchpp_trace(A, N, confidence=1.0), ValueError, "confidence")
    _expect(lambda: slq_density(A, n_probes=1), ValueError, "n_probes")
    if lanczos:
        k = 1 + int(torch.randint(0, min(5, n - 1), (1,), generator=rng))
        which = ("LA", "SA", "LM")[int(torch.randint(0, 3, (1,), generator=rng))]
        Qe = torch.linalg.eigh(M64).eigenvectors.to(dtype)
        v0 = Qe[:, n // 2] if bool(torch.rand(1, generator=rng) < 0.5) else None  # a non-extreme eigenvector
        tol_l = 1e-4 if dtype == torch.float32 else 1e-8
        try:
            er = lanczos_eigs(A, k=k, which=which, tol=tol_l, rel="scale", seed=seed, v0=v0)
            dist = (er.eigenvalues.double()[:, None] - lam[None, :]).abs().min(1).values
            assert bool((dist <= er.residuals.double() + 1e3 * eps * scale).all()), "an eigenvalue not within its residual"
            want = {"LA": lam.sort(descending=True).values, "SA": lam.sort().values,
                    "LM": lam[lam.abs().argsort(descending=True)]}[which][:k]
            gap = (er.eigenvalues.double() - want).abs().max()
            res["lanczos"] = "ok" if float(gap) <= 10 * float(er.residuals.max()) + 1e3 * eps * scale else "not extreme"
        except NotConvergedError:
            res["lanczos"] = "raised"
    return {**cfg, **res}


def fuzz(configs: int, seed: int, lanczos: bool, quiet: bool) -> dict:
    rng = torch.Generator().manual_seed(seed)
    rows, failures = [], []
    t0 = time.perf_counter()
    for i in range(configs):
        state = rng.get_state()
        try:
            rows.append(one_config(rng, i, lanczos))
        except Exception as e:  # a broken invariant or an unexpected error: the failure, with its traceback
            failures.append({"i": i, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
            rng.set_state(state)
            torch.rand(64, generator=rng)  # move on from the failed draw
        if not quiet and (i + 1) % 100 == 0:
            print(f"[fuzz] {i + 1}/{configs} ({len(failures)} failures, {time.perf_counter() - t0:.0f}s)",
                  file=sys.stderr, flush=True)
    frac = lambda key: sum(r[key] for r in rows) / max(len(rows), 1)
    summary = {"configs": configs, "completed": len(rows), "failures": len(failures), "seconds": time.perf_counter() - t0,
               "trace_in": frac("trace_in"), "fro_in": frac("fro_in"), "fro_view_in": frac("fro_view_in"),
               "diag_in_fraction": frac("diag_in_fraction"), "slq_m1_in": frac("slq_m1_in"),
               "slq_density_in_fraction": frac("slq_density_in_fraction")}
    if lanczos:
        for v in ("ok", "not extreme", "raised"):
            summary[f"lanczos_{v}"] = sum(r.get("lanczos") == v for r in rows)
    return {"summary": summary, "failures": failures, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=400, help="seeds per family and budget (coverage)")
    ap.add_argument("--slq-seeds", type=int, default=100, help="seeds per family for slq_density (coverage)")
    ap.add_argument("--budgets", default="12,30,60", help="n_matvecs of hutchpp_trace and frobenius_norm")
    ap.add_argument("--n", type=int, default=300, help="the families' size (coverage)")
    ap.add_argument("--configs", type=int, default=2000, help="random configurations (fuzz)")
    ap.add_argument("--fuzz-seed", type=int, default=0)
    ap.add_argument("--lanczos", action="store_true", help="also fuzz lanczos_eigs (public API)")
    ap.add_argument("--skip-coverage", action="store_true")
    ap.add_argument("--slq-only", action="store_true", help="coverage of slq_density alone")
    ap.add_argument("--out", default=None, help="the JSON (default benchmarks/results/fuzz-estimators-<commit>.json)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    budgets = [int(b) for b in a.budgets.split(",") if b]
    result = {"commit": commit, "torch": torch.__version__, "python": platform.python_version(),
              "threads": torch.get_num_threads(), "machine": platform.machine(), "argv": sys.argv[1:],
              "confidence": 0.95}
    if not a.skip_coverage:
        result["coverage"] = coverage(a.seeds, budgets, a.n, a.slq_seeds, a.quiet, a.slq_only)
    if a.configs:
        result["fuzz"] = fuzz(a.configs, a.fuzz_seed, a.lanczos, a.quiet)
    out = pathlib.Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"fuzz-estimators-{commit}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    if "fuzz" in result:
        print(json.dumps(result["fuzz"]["summary"]))
    return 1 if result.get("fuzz", {}).get("failures") else 0


if __name__ == "__main__":
    sys.exit(main())
