r"""``blockhess convergence``: loss-landscape convergence with dataset size (Theorem 7) on the digits ViT.

The parameters ``w`` are the block's weights (``W_Q, W_K, W_V, W_1, W_2``) of the trained
digits ViT (:mod:`blockhess_lab.vit`); the embedding and the head are fixed, so the
per-sample loss :math:`l_i(w)` is ``vit.head_loss`` of the block output, and its exact
Hessian is the closed form (:func:`blockhess.convergence.per_sample_hessians`, batched).
With :math:`L_k = \frac1k\sum_{i\le k} l_i` (paper §4):

1. **differences at w***: per-sample losses of every training image, :math:`|L_{k+1} - L_k|`
   against ``k`` averaged over random orderings, smoothed by an EMA on a geometric grid of ``k``
   (:func:`~blockhess.convergence.log_ema`), ``c/k`` reference lines and a fitted log-log slope;
   the paper's batch-wise running mean (§4.2) beside it. The ``1/k`` law itself follows from
   the running-mean identity :math:`L_{k+1} - L_k = (l_{k+1} - L_k)/(k+1)` for losses in random
   order; what is model-specific is the constant, predicted by the mean absolute deviation
   of the per-sample losses.
2. **Theorem 7 bound** :math:`(2L_{max} + M\|\delta\|^2)/(k+1)` against every measured difference
   (every ordering, every ``k``) at ``w*`` and at ``w* + δ`` for several ``‖δ‖`` along random
   unit directions, with ``M`` (i) the largest exact per-sample Hessian spectral norm (closed
   form + Lanczos) and (ii) the valid Theorem 6 bound (:func:`blockhess.bounds.block_bounds`;
   for the cross-entropy through the head only the general-loss form exists, the paper's
   printed constants are MSE-only).
3. **Taylor**: :math:`L_{k+1}(w) - L_k(w)` predicted from exact per-sample gradients and
   Hessians at ``w*`` against the actual difference, with and without the gradient term that
   the paper drops (Assumption 1).
4. **Assumption 1**: :math:`\|\nabla L_N(w^*)\|` against ``N`` for three orderings (the paper's
   seeds), with the expectation for random subsets.

Writes ``convergence.json``, ``convergence.md`` (the key numbers) and ``differences.png``,
``bound.png``, ``taylor.png``, ``assumption1.png``, ``spectra.png`` into ``--out`` (atomically).

Image sets: the differences at ``w*`` (1.), the bound's check over all training images
(``margin_w_star_all_samples``) and the batch procedure use every training image, with
``L_max`` their largest loss; the Theorem 7 rows (δ = 0 included), the Taylor errors and ``M``
use the Hessian set (all images in a full run, ``hessian_samples`` of them with ``--quick``),
with ``L_max`` the largest loss of that set.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from blockhess import convergence as cv
from blockhess.linalg import rel_error
from .outputs import atomic_dir, check_out, out_help, write_json
from .runtime import add_quiet_argument, add_threads_argument, environment, load_average, progress, torch_threads

HELP = "loss-landscape convergence with dataset size (Theorem 7): |L_{k+1} - L_k| vs k, bound, Taylor, Assumption 1"


@dataclass(frozen=True)
class Settings:
    """Sizes of one run. ``hessian_samples=None``: every training image gets its exact Hessian."""

    orderings: int = 2000
    hessian_samples: int | None = None
    directions: int = 4
    deltas: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)  # ‖δ‖ / ‖w*‖
    batch_size: int = 16
    epochs: int = 26
    chunk_size: int = 8
    gradient_seeds: tuple[int, ...] = (307, 42, 21)  # the paper's seeds (§4.3)
    k_min: int = 10
    log_ema_alpha: float = 0.5
    paper_ema_alpha: float = 0.02  # the paper's (pandas ewm alpha, §4.2)
    taylor_orderings: int = 200
    lanczos_iters: int = 64
    path_samples: int = 64  # Hessian-set images whose ‖H_i(w* + δ)‖ is also measured, per ‖δ‖
    theorem6: bool = True
    seed: int = 0

    def check(self) -> None:
        """Raise ``ValueError`` (one line) on a setting that cannot run."""
        for name in ("orderings", "directions", "batch_size", "epochs", "chunk_size", "taylor_orderings",
                     "lanczos_iters", "k_min", "path_samples"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.hessian_samples is not None and int(self.hessian_samples) < 3:
            raise ValueError(f"--hessian-samples must be >= 3, got {self.hessian_samples}")
        if not self.deltas or any(not (math.isfinite(d) and d > 0) for d in self.deltas):
            raise ValueError(f"--deltas must be positive numbers, got {list(self.deltas)}")
        if not self.gradient_seeds:
            raise ValueError("need at least one gradient seed")


QUICK = Settings(orderings=500, hessian_samples=96, directions=2, deltas=(1e-3, 1e-2, 3e-2, 1e-1, 3e-1),
                 epochs=10, taylor_orderings=100, path_samples=16)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="convergence", metavar="DIR", help=out_help("convergence"))
    F, Q = Settings(), QUICK
    dropped = ", ".join(f"{x:g}" for x in F.deltas if x not in Q.deltas)
    p.add_argument("--quick", action="store_true",
                   help=f"exact Hessians of {Q.hessian_samples} training images (not all), {Q.orderings} orderings (not "
                        f"{F.orderings}), {Q.directions} directions (not {F.directions}), no {dropped} delta, {Q.epochs} "
                        f"epochs (not {F.epochs}), {Q.taylor_orderings} Taylor orderings (not {F.taylor_orderings}), "
                        f"{Q.path_samples} path images (not {F.path_samples}): about half a minute; M, the path ratios "
                        "and the Taylor errors then differ from a full run's")
    p.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="digits ViT checkpoint to read; a path given here must exist (default: the report's, checkpoints/digits_vit.pt "
                        "under the current folder, trained and saved there when absent)")
    p.add_argument("--orderings", type=int, default=None, metavar="N", help="random orderings averaged (default: 2000; quick 500)")
    p.add_argument("--hessian-samples", type=int, default=None, metavar="N",
                   help="training images whose exact Hessians are computed, at most all (default: all; quick 96)")
    p.add_argument("--directions", type=int, default=None, metavar="N", help="random unit directions for δ (default: 4; quick 2)")
    p.add_argument("--deltas", default=None, metavar="LIST",
                   help="comma-separated ‖δ‖/‖w*‖ (default: 1e-3,3e-3,1e-2,3e-2,1e-1,3e-1; quick the same without 3e-3)")
    p.add_argument("--batch-size", type=int, default=None, metavar="N", help="batch of the paper's running mean (default: 16)")
    p.add_argument("--epochs", type=int, default=None, metavar="N", help="epochs of the paper's running mean (default: 26; quick 10)")
    p.add_argument("--no-theorem6", action="store_true", help="skip the Theorem 6 bound M (per-sample, costly)")
    p.add_argument("--seed", type=int, default=None, metavar="SEED", help="seed of orderings, subsets and directions (default: 0)")
    add_threads_argument(p)
    add_quiet_argument(p)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The :class:`Settings` of the command line (``--quick`` then explicit overrides); checked."""
    s = QUICK if args.quick else Settings()
    over = {}
    for name in ("orderings", "hessian_samples", "directions", "batch_size", "epochs", "seed"):
        v = getattr(args, name, None)
        if v is not None:
            over[name] = v
    if getattr(args, "deltas", None):
        try:
            over["deltas"] = tuple(float(x) for x in str(args.deltas).split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--deltas must be comma-separated numbers, got {args.deltas!r}") from None
    if getattr(args, "no_theorem6", False):
        over["theorem6"] = False
    s = replace(s, **over)
    s.check()
    return s


# --------------------------------------------------------------------------- helpers


def _say(quiet: bool, msg: str) -> None:
    if not quiet:
        print(f"[convergence] {msg}", file=sys.stderr, flush=True)


def _grid(n: int, points: int = 120) -> torch.Tensor:
    """About ``points`` log-spaced indices into ``range(n)`` (unique, sorted, ending at n-1)."""
    if n <= points:
        return torch.arange(n)
    g = torch.logspace(0, math.log10(n), points, dtype=torch.float64).round().long() - 1
    return torch.unique(torch.cat([g.clamp(0, n - 1), torch.tensor([n - 1])]))


def _series(x: torch.Tensor, idx: torch.Tensor) -> list[float]:
    return [float(v) for v in x[idx]]


def _harmonic(n: torch.Tensor) -> torch.Tensor:
    """H(n) = sum_{j<=n} 1/j for real n >= 0 (digamma form)."""
    return torch.special.digamma(n + 1) + 0.5772156649015329


def _finite(x):
    """JSON-safe float (None for NaN/Inf)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


# --------------------------------------------------------------------------- the experiment


def compute(model, settings: Settings, quiet: bool = True) -> tuple[dict, dict]:
    """Run every measurement on ``model`` (a :class:`~blockhess_lab.vit.TrainedViT` or
    anything with its ``cfg``, ``block_params``, ``embed``, ``head_loss``, ``train_images``,
    ``train_labels``). Returns ``(result, arrays)``: the JSON-ready dict and the arrays the
    figures need. Raises ``ValueError`` as the closed form does, and for a ``batch_size`` larger
    than the training set."""
    from .vit import check_batch

    s = settings
    s.check()
    check_batch("--batch-size", s.batch_size, len(model.train_labels))
    env = environment()
    t_start = time.perf_counter()
    timing = {}
    dt = torch.float64
    cfg, loss = model.cfg, model.head_loss
    params = model.block_params(dt)
    labels = model.train_labels
    X = model.embed(model.train_images, dt)
    N = X.shape[0]
    if N < 3:
        raise ValueError(f"need at least 3 training samples, got {N}")
    n_params = sum(v.numel() for v in params.values())
    w_norm = float(torch.sqrt(sum((v**2).sum() for v in params.values())))

    # ---- 1. per-sample losses at w*, differences over orderings
    t = time.perf_counter()
    l0 = cv.per_sample_losses(params, X, cfg, loss=loss, target=labels)
    check = None
    if hasattr(model, "per_sample_losses"):
        check = float((model.per_sample_losses(model.train_images, labels) - l0).abs().max())
    orders = cv.random_orderings(N, s.orderings, seed=s.seed)
    D = cv.ordering_differences(l0, orders).abs()  # (R, N-1)
    k = torch.arange(1, N, dtype=dt)
    mean_abs = D.mean(0)
    max_abs = D.amax(0)
    kb, smooth = cv.log_ema(k, mean_abs, s.log_ema_alpha)
    k_hi = float(N - 1)
    fit = cv.loglog_slope(kb, smooth, s.k_min, k_hi)
    fit_raw = cv.loglog_slope(k, mean_abs, s.k_min, k_hi)
    single = D[0]
    single_paper = cv.ema(single, s.paper_ema_alpha)
    kbs, single_log = cv.log_ema(k, single, s.log_ema_alpha)
    fit_single = cv.loglog_slope(kbs, single_log, s.k_min, k_hi)
    mad = float((l0 - l0.mean()).abs().mean())
    L_max_all = float(l0.max())
    bound0 = cv.theorem7_bound(k, L_max_all, 0.0, 0.0)
    ratio0 = float((bound0[None] / D.clamp_min(1e-300)).min())
    timing["differences_s"] = time.perf_counter() - t

    # ---- paper's batch-wise running mean (§4.2)
    t = time.perf_counter()
    nb, db = cv.batch_running_mean(l0, s.batch_size, s.epochs, seed=s.seed)
    db_paper = cv.ema(db, s.paper_ema_alpha)
    kbb, db_log = cv.log_ema(nb, db, s.log_ema_alpha)
    fit_batch = cv.loglog_slope(kbb, db_log, max(s.k_min, 2 * s.batch_size), float(nb.max()))
    n_prev = torch.cat([nb.new_tensor([float(min(s.batch_size, N))]), nb[:-1]])
    bound_batch = 2 * L_max_all * (_harmonic(nb) - _harmonic(n_prev))  # sum_{k=n_prev}^{n-1} 2L/(k+1)
    ratio_batch = float((bound_batch / db.clamp_min(1e-300)).min())
    timing["batch_s"] = time.perf_counter() - t

    # ---- 2. exact per-sample Hessians of the Hessian set
    t = time.perf_counter()
    gen = torch.Generator().manual_seed(s.seed + 1)
    m = N if s.hessian_samples is None else min(int(s.hessian_samples), N)
    if s.hessian_samples is not None and int(s.hessian_samples) > N:
        _say(quiet, f"--hessian-samples {s.hessian_samples} is more than the {N} training images: all {N} are used")
    hidx = torch.arange(N) if m == N else torch.randperm(N, generator=gen)[:m].sort().values
    U = cv.unit_directions(params, cfg, s.directions, seed=s.seed + 2)
    bar = progress(total=m, quiet=quiet, desc="exact per-sample Hessians", unit="sample")
    stats = cv.per_sample_statistics(params, X[hidx], cfg, loss=loss, target=labels[hidx], directions=U,
                                     chunk_size=s.chunk_size, lanczos_iters=s.lanczos_iters, progress=bar.update)
    bar.close()
    M_exact = float((stats.spectral + stats.spectral_residual).max())
    timing["hessians_s"] = time.perf_counter() - t
    timing["per_sample_hessian_s"] = timing["hessians_s"] / m

    # ---- Theorem 6 bound per sample (valid constants; the printed ones are MSE-only)
    t = time.perf_counter()
    thm6 = {"available": False, "M": None, "M_paper": None, "note": ""}
    if s.theorem6:
        try:
            from blockhess import bounds

            vals = []
            bar = progress(total=m, quiet=quiet, desc="Theorem 6 bounds", unit="sample")
            for i in hidx.tolist():
                bd = bounds.block_bounds(params, X[i], cfg, loss=loss, target=labels[i])
                vals.append((bd["full"]["all"], bd["paper"]["all"]))
                bar.update(1)
            bar.close()
            M6 = torch.tensor([v[0] for v in vals], dtype=dt)
            paper_vals = [v[1] for v in vals]
            thm6 = {
                "available": True,
                "M": float(M6.max()),
                "M_paper": None if any(v is None for v in paper_vals) else float(max(paper_vals)),
                "per_sample": M6,
                "note": ("valid re-derived constants, general-loss form of Theorem 6 (exact ‖∇²ℓ‖₂ and ‖∇ℓ‖₂ "
                         "of the head loss at the block output); the paper's printed constants are for MSE only"),
            }
        except (ImportError, AttributeError, NotImplementedError, ValueError) as exc:
            thm6["note"] = f"Theorem 6 bound unavailable: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    else:
        thm6["note"] = "skipped (--no-theorem6)"
    timing["theorem6_s"] = time.perf_counter() - t

    # ---- 3./2. Taylor prediction and the bound at w* + δ, on the Hessian set
    t = time.perf_counter()
    l0h = stats.loss
    L_max = float(l0h.max())
    t_orders = cv.random_orderings(m, s.taylor_orderings, seed=s.seed + 3)
    kh = torch.arange(1, m, dtype=dt)
    Ms = {"exact": M_exact}
    if thm6["available"]:
        Ms["theorem6"] = thm6["M"]
    taylor_rows, bound_rows, curves, path_rows = [], [], [], []
    pidx = torch.arange(min(s.path_samples, m))  # within the Hessian set
    spec0 = stats.spectral[pidx]
    D0 = cv.ordering_differences(l0h, t_orders)
    Dh0 = D0.abs()
    bound_rows.append(_bound_row(0.0, 0.0, Dh0, kh, L_max, Ms))
    curve0 = {"delta_rel": 0.0, "actual": Dh0.mean(0), "max_actual": Dh0.amax(0)}
    for rel in s.deltas:
        eps = rel * w_norm
        errs = {"second_order": [], "assumption1": [], "first_order": [], "change_second_order": [],
                "change_assumption1": [], "change_first_order": [], "loss_second_order": [], "loss_assumption1": []}
        worst = None
        for j in range(s.directions):
            delta = eps * U[j]
            actual = cv.per_sample_losses(cv.perturb(params, delta, cfg), X[hidx], cfg, loss=loss, target=labels[hidx])
            preds = {
                "second_order": cv.taylor_losses(l0h, eps * stats.grad_dot[:, j], eps**2 * stats.quad[:, j]),
                "assumption1": cv.taylor_losses(l0h, None, eps**2 * stats.quad[:, j]),
                "first_order": cv.taylor_losses(l0h, eps * stats.grad_dot[:, j]),
            }
            Da = cv.ordering_differences(actual, t_orders)
            shift = float((Da - D0).norm())  # the part of the difference that δ causes
            for key, pred in preds.items():
                Dp = cv.ordering_differences(pred, t_orders)
                errs[key].append(rel_error(Dp, Da))
                errs[f"change_{key}"].append(rel_error(Dp, Da, shift))
            change = float((actual - l0h).norm())
            errs["loss_second_order"].append(rel_error(preds["second_order"], actual, change))
            errs["loss_assumption1"].append(rel_error(preds["assumption1"], actual, change))
            if j == 0:  # per-sample Hessian norms at w* + δ (direction 0), on the path subset
                sp = cv.per_sample_statistics(cv.perturb(params, delta, cfg), X[hidx][pidx], cfg, loss=loss,
                                              target=labels[hidx][pidx], chunk_size=s.chunk_size,
                                              lanczos_iters=s.lanczos_iters)
                ratio = sp.spectral / spec0
                path_rows.append({"delta_rel": rel, "delta_norm": eps, "samples": int(pidx.numel()),
                                  "max_spectral_norm": float((sp.spectral + sp.spectral_residual).max()),
                                  "max_spectral_norm_at_w_star": float(spec0.max()),
                                  "ratio_median": float(ratio.median()), "ratio_min": float(ratio.min()),
                                  "ratio_max": float(ratio.max())})
                curves.append({
                    "delta_rel": rel, "actual": Da.abs().mean(0),
                    "second_order": cv.ordering_differences(preds["second_order"], t_orders).abs().mean(0),
                    "assumption1": cv.ordering_differences(preds["assumption1"], t_orders).abs().mean(0),
                    "max_actual": Da.abs().amax(0),
                })
            row = _bound_row(rel, eps, Da.abs(), kh, L_max, Ms)
            if worst is None or row["margin"]["exact"] < worst["margin"]["exact"]:
                worst = row
        bound_rows.append(worst)
        taylor_rows.append({
            "delta_rel": rel, "delta_norm": eps,
            **{f"rel_error_{key}": _stat(v) for key, v in errs.items()},
        })
    timing["taylor_bound_s"] = time.perf_counter() - t

    # ---- 4. Assumption 1: ‖∇L_N(w*)‖ against N
    t = time.perf_counter()
    G = cv.per_sample_gradients(params, X, cfg, loss=loss, target=labels)
    g_orders = torch.stack([torch.randperm(N, generator=torch.Generator().manual_seed(sd)) for sd in s.gradient_seeds])
    gn = cv.gradient_norms(G, g_orders)  # (S, N)
    g_mean = G.mean(0)
    tr_sigma = float(((G - g_mean) ** 2).sum(1).mean())
    Ns = torch.arange(1, N + 1, dtype=dt)
    # E‖mean of a random N-subset‖² = ‖ḡ‖² + (tr Σ / N)(N_tot − N)/(N_tot − 1): sampling without replacement
    expected = torch.sqrt(float(g_mean @ g_mean) + tr_sigma / Ns * (N - Ns) / max(N - 1, 1))
    timing["assumption1_s"] = time.perf_counter() - t

    bound_holds = ratio0 >= 1 and ratio_batch >= 1 and all(all(v >= 1 for v in r["margin"].values()) for r in bound_rows)
    margin = min([ratio0, ratio_batch] + [v for r in bound_rows for v in r["margin"].values()])
    timing["total_s"] = time.perf_counter() - t_start

    idx = _grid(N - 1)
    idxg = _grid(N)
    ib = _grid(nb.numel())
    result = {
        "slope": fit["slope"],
        "bound_holds": bool(bound_holds),
        "bound_margin": margin,
        "slope_fit": {
            **fit,
            "series": "mean over orderings of |L_{k+1} - L_k| at w*, EMA on a geometric grid of k (log_ema)",
            "slope_unsmoothed": fit_raw["slope"],
            "slope_single_ordering": fit_single["slope"],
            "slope_batch": fit_batch["slope"],
            "interpretation": (
                "E|L_{k+1} - L_k| = E|l_{k+1} - L_k|/(k+1) (running-mean identity); for losses in random "
                "order E|l_{k+1} - L_k| tends to the mean absolute deviation of the per-sample losses, so "
                "slope -1 holds for any model and says nothing about curvature; the model enters through the "
                "constant (mad_loss) and through the bound's L_max and M."
            ),
        },
        "model": {
            "cfg": {k_: getattr(cfg, k_) for k_ in ("d_model", "d_ff", "d_k", "ln_eps", "kind")},
            "n_params": n_params, "w_star_norm": w_norm, "n_train": N, "tokens": int(X.shape[1]),
            "test_accuracy": _finite(getattr(model, "test_accuracy", None)),
            "per_sample_loss_check_max_abs": check,
        },
        "losses": {"mean": float(l0.mean()), "max": L_max_all, "min": float(l0.min()), "mad_loss": mad,
                   "median": float(l0.median())},
        "series": {
            "k": _series(k, idx), "mean_abs_diff": _series(mean_abs, idx), "max_abs_diff": _series(max_abs, idx),
            "single_ordering_abs_diff": _series(single, idx), "single_ordering_paper_ema": _series(single_paper, idx),
            "smoothed_k": [float(v) for v in kb], "smoothed": [float(v) for v in smooth],
            "mad_over_k_plus_1": _series(mad / (k + 1), idx), "bound_w_star": _series(bound0, idx),
        },
        "batch": {
            "batch_size": s.batch_size, "epochs": s.epochs, "paper_ema_alpha": s.paper_ema_alpha,
            "n_seen": _series(nb, ib), "delta": _series(db, ib), "paper_ema": _series(db_paper, ib),
            "smoothed_n": [float(v) for v in kbb], "smoothed": [float(v) for v in db_log],
            "fit": fit_batch, "bound_margin": ratio_batch,
            "bound_note": (
                f"Theorem 7 at w* summed over the k of each batch: 2 * loss_max_all * (H(n_after) - H(n_before)), all "
                f"{N} training images. "
                + (f"Each epoch's last batch has {N % s.batch_size} images, not {s.batch_size}: fewer k are summed, "
                   "so its bound is smaller by about that ratio: the dips of the bound at every multiple of "
                   f"{N} samples seen are genuine, not an artefact." if N % s.batch_size and N > s.batch_size else "")
            ).strip(),
        },
        "theorem7": {
            "loss_max_all": L_max_all, "loss_max_hessian_set": L_max,
            "hessian_samples": m, "hessian_indices_all": m == N,
            "M_exact": M_exact,
            "M_exact_note": "max over the Hessian set of the Lanczos spectral norm plus its residual (the residual bounds the distance to some eigenvalue)",
            "spectral_norm": {"max": float(stats.spectral.max()), "median": float(stats.spectral.median()),
                              "mean": float(stats.spectral.mean()), "min": float(stats.spectral.min()),
                              "max_lanczos_residual": float(stats.spectral_residual.max())},
            "frobenius_norm": {"max": float(stats.frobenius.max()), "median": float(stats.frobenius.median())},
            "M_theorem6": thm6["M"], "M_theorem6_paper": thm6["M_paper"], "theorem6_note": thm6["note"],
            "theorem6_over_exact": (thm6["M"] / M_exact) if thm6["M"] else None,
            "spectral_norm_at_w_star_plus_delta": path_rows,
            "spectral_norm_at_w_star_plus_delta_note": (
                "per-sample ‖H_i(w* + δ)‖₂ (direction 0) on the first path_samples images of the Hessian set; "
                "ratio = ‖H_i(w* + δ)‖ / ‖H_i(w*)‖. Theorem 7 uses M at w* only (its Taylor step drops the "
                "remainder); a rigorous remainder bound would need M along the segment."),
            "margin_w_star_all_samples": ratio0,
            "margin_w_star_all_samples_note": (
                f"delta 0 over all {N} training images and {s.orderings} orderings, bound 2 * loss_max_all / (k+1) "
                "(the curve series.bound_w_star and the Theorem 7 line of differences.png)"),
            "rows": bound_rows,
            "note": ("margin = min over orderings, k and directions of bound(k) / |L_{k+1}(w) - L_k(w)|; "
                     ">= 1 means the bound holds. Every row, delta 0 (rows[0]) included, is on the Hessian set "
                     f"({m} of the {N} training images; {s.taylor_orderings} orderings of them): its bound uses "
                     "L_max = loss_max_hessian_set and M, a max over that set (the curves of bound.png). The check "
                     "over all training images at delta 0 is margin_w_star_all_samples."),
        },
        "taylor": {
            "rows": taylor_rows,
            "note": ("rel_error_X = ||pred - actual|| / ||actual|| over all orderings and k of L_{k+1}(w) - L_k(w); "
                     "rel_error_change_X = ||pred - actual|| / ||actual - (the same at w*)||, relative to the part of "
                     "the difference that delta causes (the stricter measure: at small delta the difference is "
                     "dominated by its delta-free part, known exactly); "
                     "second_order: l_i + g_i.delta + delta^T H_i delta / 2 (exact g_i, H_i at w*); assumption1: the "
                     "paper's form without the gradient term; first_order: without the Hessian term; loss_*: the "
                     "same for the per-sample loss change l_i(w) - l_i(w*). Median and max over directions."),
        },
        "assumption1": {
            "seeds": list(s.gradient_seeds), "N": _series(Ns, idxg),
            "grad_norm_mean": _series(gn.mean(0), idxg), "grad_norm_std": _series(gn.std(0) if gn.shape[0] > 1 else gn[0] * 0, idxg),
            "expected_random_subset": _series(expected, idxg),
            "full_gradient_norm": float(g_mean.norm()),
            "mean_per_sample_gradient_norm": float(G.norm(dim=1).mean()),
            "ratio_full_to_per_sample": float(g_mean.norm() / G.norm(dim=1).mean()),
        },
        "settings": {**asdict(s), "deltas": list(s.deltas), "gradient_seeds": list(s.gradient_seeds)},
        "timing": timing,
        "environment": {**env, "load_average_at_end": load_average()},
    }
    arrays = {"k": k, "mean_abs": mean_abs, "max_abs": max_abs, "single": single, "single_paper": single_paper,
              "kb": kb, "smooth": smooth, "fit": fit, "mad": mad, "bound0": bound0, "nb": nb, "db": db,
              "db_paper": db_paper, "kbb": kbb, "db_log": db_log, "fit_batch": fit_batch, "bound_batch": bound_batch,
              "kh": kh, "curves": curves, "curve0": curve0, "bound_rows": bound_rows, "taylor_rows": taylor_rows, "Ms": Ms, "L_max": L_max,
              "w_norm": w_norm, "gn": gn, "expected": expected, "Ns": Ns, "g_full": float(g_mean.norm()),
              "g_each": float(G.norm(dim=1).mean()), "spectral": stats.spectral,
              "thm6": thm6.get("per_sample"), "M_exact": M_exact, "n_train": N, "hessian_samples": m,
              "L_max_all": L_max_all, "batch_size": s.batch_size, "orderings": s.orderings,
              "taylor_orderings": s.taylor_orderings, "directions": s.directions}
    return result, arrays


def _stat(values: list[float]) -> dict:
    v = torch.tensor(values, dtype=torch.float64)
    return {"median": float(v.median()), "max": float(v.max())}


def _bound_row(rel: float, eps: float, Dabs: torch.Tensor, k: torch.Tensor, L_max: float, Ms: dict) -> dict:
    """The Theorem 7 check for one ‖δ‖: margins (min bound/measured) for each M."""
    out = {"delta_rel": rel, "delta_norm": eps, "max_measured_times_k_plus_1": float((Dabs * (k + 1)).max()),
           "margin": {}, "bound_times_k_plus_1": {}}
    for name, M in Ms.items():
        b = cv.theorem7_bound(k, L_max, M, eps)
        out["margin"][name] = float((b[None] / Dabs.clamp_min(1e-300)).min())
        out["bound_times_k_plus_1"][name] = float(b[0] * 2)
    return out


# --------------------------------------------------------------------------- figures


def _image_set(a: dict) -> str:
    """Which images the Hessian-set curves use, in words."""
    m, N = a["hessian_samples"], a["n_train"]
    return f"all {N} training images" if m == N else f"{m} of the {N} training images"


def figures(arrays: dict, out: Path) -> list[str]:
    """Write the PNG figures into ``out``; returns their file names. Labels use mathtext; every
    Theorem 7 curve says which images its ``L_max`` (and ``M``) come from."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = arrays
    names = []
    N, b = a["n_train"], a["batch_size"]
    LMAX = r"$L_{\max}$"

    def refs(ax, x, y_at, decades=(-2, -1, 0, 1, 2)):
        x0 = float(x[0])
        for j in decades:
            c = y_at * 10.0**j
            ax.plot([x0, float(x[-1])], [c / x0, c / float(x[-1])], color="0.7", ls="--", lw=0.8,
                    label=r"$c/k$ references" if j == decades[0] else None)

    # differences (all training images)
    fig, axes = plt.subplots(1, 2, figsize=(13, 7.2))
    ax = axes[0]
    k = a["k"]
    ax.loglog(k, a["single"], color="C1", alpha=0.15, lw=0.6, label="|ΔL|, one ordering")
    ax.loglog(k, a["single_paper"], color="C1", lw=1.0, label="one ordering, index EMA as the paper (α=0.02; lags ~1/α steps)")
    ax.loglog(k, a["mean_abs"], color="C0", alpha=0.35, lw=1.0, label=f"mean over {a['orderings']} orderings")
    ax.loglog(a["kb"], a["smooth"], color="C0", lw=2, label="mean, EMA on log-k grid")
    f = a["fit"]
    kk = torch.logspace(math.log10(f["k_min"]), math.log10(f["k_max"]), 20, dtype=torch.float64)
    ax.loglog(kk, math.exp(f["intercept"]) * kk ** f["slope"], "r--", lw=1.2,
              label=f"fit: slope {f['slope']:.3f} (k ∈ [{f['k_min']:.0f}, {f['k_max']:.0f}])")
    ax.loglog(k, a["mad"] / (k + 1), color="C2", ls=":", lw=1.5, label="MAD(l)/(k+1) (identity)")
    ax.loglog(k, a["bound0"], color="k", lw=1.2,
              label=f"Theorem 7 at w*: $2L_{{\\max}}/(k+1)$, {LMAX} = {a['L_max_all']:.3g}\n(largest loss of all {N} images)")
    refs(ax, k, float(a["mean_abs"][0]))
    ax.set_xlabel("k (samples)")
    ax.set_ylabel(r"$|L_{k+1}(w^*) - L_k(w^*)|$")
    ax.set_title(f"per-sample running mean at w*, random orderings of all {N} images", fontsize=11)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12))  # below the axes, clear of the data
    ax = axes[1]
    ax.loglog(a["nb"], a["db"], color="C0", alpha=0.25, lw=0.6, label="|ΔL| per batch")
    ax.loglog(a["nb"], a["db_paper"], color="C1", lw=1.2, label="index EMA as the paper (α=0.02; lags ~1/α batches)")
    ax.loglog(a["kbb"], a["db_log"], color="C0", lw=2, label="EMA on log-N grid")
    fb = a["fit_batch"]
    kk = torch.logspace(math.log10(fb["k_min"]), math.log10(fb["k_max"]), 20, dtype=torch.float64)
    ax.loglog(kk, math.exp(fb["intercept"]) * kk ** fb["slope"], "r--", lw=1.2, label=f"fit: slope {fb['slope']:.3f}")
    short = N % b if N > b else 0
    dips = (f";\ndips: each epoch's last batch has {short} images, not {b} (genuine: fewer k are summed)" if short else "")
    ax.loglog(a["nb"], a["bound_batch"], color="k", lw=1.0,
              label=f"Theorem 7 summed over the batch's k, {LMAX} of all {N} images{dips}")
    refs(ax, a["nb"], float(a["db"][0]) * float(a["nb"][0]))
    ax.set_xlabel("N (samples seen, repeats across epochs)")
    ax.set_ylabel(r"$|L_{\mathrm{after}} - L_{\mathrm{before}}|$ (one batch added)")
    ax.set_title(f"paper's batch-wise running mean (§4.2), batches of {b}", fontsize=11)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12))  # below the axes, clear of the data
    fig.tight_layout()
    fig.savefig(out / "differences.png", dpi=120)
    plt.close(fig)
    names.append("differences.png")

    # bound (Hessian set)
    curves = a["curves"]
    ncol = min(3, len(curves) + 1)
    nrow = math.ceil((len(curves) + 1) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.4 * ncol, 3.5 * nrow + 1.0), squeeze=False)
    kh = a["kh"]
    m_label = {"exact": r"M = max exact $\Vert H_i(w^*)\Vert_2$", "theorem6": "M = Theorem 6 bound"}
    for ax, cur in zip(axes.flat, [a["curve0"]] + curves):
        rel = cur["delta_rel"]
        eps = rel * a["w_norm"]
        ax.loglog(kh, cur["max_actual"], color="C3", lw=1, label=f"measured, max over {a['taylor_orderings']} orderings")
        ax.loglog(kh, cur["actual"], color="C0", lw=1.5, label="measured, mean over orderings")
        for name, M in a["Ms"].items():
            ax.loglog(kh, cv.theorem7_bound(kh, a["L_max"], M, eps), lw=1.2, ls="-" if name == "exact" else "--",
                      color="k" if name == "exact" else "C4", label=f"Theorem 7 bound, {m_label.get(name, name)} = {M:.3g}")
        ax.set_title(f"‖δ‖/‖w*‖ = {rel:g} (direction 0)" if rel else "at w* (δ = 0)", fontsize=9)
        ax.set_xlabel("k")
        ax.set_ylabel(r"$|L_{k+1}(w) - L_k(w)|$", fontsize=9)
    for ax in list(axes.flat)[len(curves) + 1:]:
        ax.axis("off")
    h, lab = axes.flat[0].get_legend_handles_labels()
    fig.legend(h, lab, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(f"Theorem 7: $(2L_{{\\max}} + M\\Vert\\delta\\Vert^2)/(k+1)$ against measured $|L_{{k+1}}(w) - L_k(w)|$, "
                 f"w = w* + δ, on the Hessian set:\n{_image_set(a)}, {LMAX} = {a['L_max']:.3g} (largest loss of this set"
                 + (f"; all {N} images: {a['L_max_all']:.3g}" if a["hessian_samples"] < N else ", as in differences.png")
                 + "), M a max over this set", fontsize=10)
    fig.tight_layout(rect=(0, 0.5 / (3.5 * nrow + 1.0), 1, 1))
    fig.savefig(out / "bound.png", dpi=110)
    plt.close(fig)
    names.append("bound.png")

    # taylor (Hessian set)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    ax = axes[0]
    rows = a["taylor_rows"]
    x = [r["delta_rel"] for r in rows]
    for key, lab, st in (("second_order", "2nd order (g + H)", "o-"), ("assumption1", "paper: H only (Assumption 1)", "s--"),
                         ("first_order", "1st order (g only)", "^:")):
        ax.loglog(x, [max(r[f"rel_error_change_{key}"]["median"], 1e-17) for r in rows], st, label=lab)
        ax.loglog(x, [max(r[f"rel_error_{key}"]["median"], 1e-17) for r in rows], st, alpha=0.35, ms=3,
                  color=ax.lines[-1].get_color())
    ax.set_xlabel("‖δ‖ / ‖w*‖")
    ax.set_ylabel("error / δ-induced change of $L_{k+1}(w) - L_k(w)$\n(faint: error / whole difference)")
    ax.set_title(f"Taylor prediction vs actual, median over {a['directions']} directions", fontsize=11)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    ax = axes[1]
    show = sorted({0, len(curves) // 2, len(curves) - 1})
    for j in show:
        cur = curves[j]
        c = f"C{j}"
        ax.loglog(kh, cur["actual"], color=c, lw=1.8, label=f"actual, ‖δ‖/‖w*‖={cur['delta_rel']:g}")
        ax.loglog(kh, cur["second_order"], color=c, ls="--", lw=1.2, label="2nd-order prediction")
        ax.loglog(kh, cur["assumption1"], color=c, ls=":", lw=1.2, label="paper's (no gradient term)")
    ax.set_xlabel("k")
    ax.set_ylabel(r"mean $|L_{k+1}(w) - L_k(w)|$")
    ax.set_title(f"{_image_set(a)}, {a['taylor_orderings']} orderings, direction 0", fontsize=11)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "taylor.png", dpi=120)
    plt.close(fig)
    names.append("taylor.png")

    # assumption 1 (all training images)
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    Ns, gn = a["Ns"], a["gn"]
    for r in range(gn.shape[0]):
        ax.loglog(Ns, gn[r], color="C0", lw=0.6, alpha=0.5,
                  label=r"$\Vert\nabla L_N(w^*)\Vert$, one ordering each" if r == 0 else None)
    ax.loglog(Ns, gn.mean(0), color="C0", lw=1.8, label=f"mean over {gn.shape[0]} orderings")
    ax.loglog(Ns, a["expected"], color="C2", ls="--", label="expected for random subsets")
    ax.axhline(a["g_full"], color="k", lw=1, label=rf"$\Vert\nabla L_{{\mathrm{{full}}}}(w^*)\Vert$ = {a['g_full']:.3g}")
    ax.axhline(a["g_each"], color="C3", lw=1, ls=":", label=rf"mean $\Vert\nabla l_i(w^*)\Vert$ = {a['g_each']:.3g}")
    ax.set_xlabel("N (samples)")
    ax.set_ylabel("gradient norm")
    ax.set_title(rf"Assumption 1: $\Vert\nabla L_N(w^*)\Vert$ against N (all {N} images)", fontsize=11)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "assumption1.png", dpi=120)
    plt.close(fig)
    names.append("assumption1.png")

    # spectra (Hessian set); the legend sits right of the axes, clear of the bars
    fig, ax = plt.subplots(figsize=(8.8, 4.2))
    sp = a["spectral"]
    lo, hi = float(sp.min()), float(sp.max())
    if a["thm6"] is not None:
        hi = max(hi, float(a["thm6"].max()))
    bins = torch.logspace(math.log10(max(lo, 1e-12)) - 0.05, math.log10(hi) + 0.05, 40).numpy()
    ax.hist(sp.numpy(), bins=bins, color="C0", alpha=0.7, label=r"exact $\Vert H_i(w^*)\Vert_2$")
    ax.axvline(a["M_exact"], color="k", lw=1, label=f"M exact = {a['M_exact']:.3g}\n(max + Lanczos residual)")
    if a["thm6"] is not None:
        ax.hist(a["thm6"].numpy(), bins=bins, color="C4", alpha=0.6, label="Theorem 6 bound per image")
        ax.axvline(float(a["thm6"].max()), color="C4", lw=1, ls="--", label=f"M Theorem 6 = {float(a['thm6'].max()):.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("spectral norm")
    ax.set_ylabel("images")
    ax.set_title(f"Per-image Hessian spectral norms at w*, {_image_set(a)}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(out / "spectra.png", dpi=120)
    plt.close(fig)
    names.append("spectra.png")
    return names


# --------------------------------------------------------------------------- markdown

_SETTING_WORDS = {
    "orderings": "random orderings of the differences at w* (all images)",
    "hessian_samples": "Hessian set: images with exact Hessians (M, Theorem 7 rows, Taylor)",
    "directions": "random unit directions of δ",
    "deltas": "‖δ‖/‖w*‖",
    "epochs": "epochs of the paper's batch procedure",
    "taylor_orderings": "orderings of the Hessian set (Theorem 7 rows, Taylor errors)",
    "path_samples": "Hessian-set images of the ratios ‖H_i(w*+δ)‖/‖H_i(w*)‖",
}


def _plain(v):
    return list(v) if isinstance(v, tuple) else v


def describe_run(settings: Settings) -> dict:
    """``{"preset": "quick" | "full", "overrides": {setting: value}}``: the preset nearest to
    ``settings`` (``--quick`` or the defaults) and the settings that differ from it."""
    names = [f.name for f in fields(Settings)]

    def diff(base):
        return {n: _plain(getattr(settings, n)) for n in names if getattr(settings, n) != getattr(base, n)}

    dq, df = diff(QUICK), diff(Settings())
    preset = "full" if not df else "quick" if not dq else ("quick" if len(dq) < len(df) else "full")
    return {"preset": preset, "overrides": dq if preset == "quick" else df}


def _show(name, v, n_train=None) -> str:
    if name == "hessian_samples" and v is None:
        return "all" if n_train is None else f"all {n_train}"
    if name == "deltas":
        return ", ".join(f"{x:g}" for x in v)
    return str(v)


def _g(v, digits: int = 3) -> str:
    return "—" if v is None else f"{v:.{digits}g}"


def markdown(res: dict) -> str:
    """The key numbers of ``convergence.json`` as markdown (``convergence.md``)."""
    mo, t7, st, run = res["model"], res["theorem7"], res["settings"], res["run"]
    N, m = mo["n_train"], t7["hessian_samples"]
    hset = f"all {N} training images" if m == N else f"{m} of the {N} training images, a random subset (`--seed {st['seed']}`)"
    over = run["overrides"]
    over_s = "" if not over else " with " + ", ".join(f"`{k} = {_show(k, v, N)}`" for k, v in over.items())
    tm = res["timing"]
    acc = mo.get("test_accuracy")
    L = ["# Loss-landscape convergence with dataset size (Theorem 7)", "",
         f"Run: **{'`--quick`' if run['preset'] == 'quick' else 'full (defaults)'}**{over_s}; "
         f"{tm['total_s']:.1f} s computing. Model: the digits ViT's block, n = {mo['n_params']} parameters, "
         f"‖w*‖ = {mo['w_star_norm']:.4g}, {N} training images of {mo['tokens']} tokens"
         + (f", test accuracy {acc:.3f}" if acc is not None else "") + "; float64.", "",
         "## What was run", "",
         "| measurement | images | orderings / repeats |", "|---|---|---|",
         f"| differences at w*, slope, Theorem 7 at w* (all samples) | all {N} | {st['orderings']} orderings |",
         f"| paper's batch running mean (§4.2) | all {N} | batches of {st['batch_size']}, {st['epochs']} epochs |",
         f"| exact Hessians: M, Theorem 7 rows (δ = 0 included), Taylor | {hset} | {st['taylor_orderings']} orderings, "
         f"{st['directions']} directions |",
         f"| ‖H_i(w*+δ)‖/‖H_i(w*)‖ (direction 0) | first {min(st['path_samples'], m)} of the Hessian set | — |",
         f"| Assumption 1, ‖∇L_N(w*)‖ | all {N} | seeds {', '.join(str(x) for x in st['gradient_seeds'])} |", "",
         f"‖δ‖/‖w*‖ ∈ {{{_show('deltas', st['deltas'])}}}. Theorem 6 bound: "
         + ("computed per image" if st["theorem6"] else "skipped (`--no-theorem6`)") + ".", "",
         "`--quick` against a full run (defaults):", "",
         "| setting | `--quick` | full | this run |", "|---|---|---|---|"]
    full = Settings()
    for name, words in _SETTING_WORDS.items():
        q, f_ = getattr(QUICK, name), getattr(full, name)
        if q != f_:
            L.append(f"| {words} | {_show(name, q)} | {_show(name, f_, N)} | {_show(name, st[name], N)} |")
    L += ["", "So M (a max over the Hessian set), L_max of the Theorem 7 rows, the margins at w* + δ, the path "
          "ratios and the Taylor errors of a `--quick` run differ from a full run's; the slope, the all-sample "
          "margin at w* and Assumption 1 use every training image in both (quick with fewer orderings and epochs).", ""]

    sf, ls = res["slope_fit"], res["losses"]
    L += ["## `|L_{k+1} − L_k|` against k at w*", "",
          f"Slope **{sf['slope']:.3f}** (r² = {sf['r2']:.5f}) over k ∈ [{sf['k_min']:.0f}, {sf['k_max']:.0f}]: mean over "
          f"{st['orderings']} orderings of all {N} images, EMA on a geometric grid of k. Unsmoothed "
          f"{sf['slope_unsmoothed']:.3f}; one ordering {sf['slope_single_ordering']:.3f}; the paper's batch procedure "
          f"{sf['slope_batch']:.3f}. Per-sample losses: mean {ls['mean']:.3g}, median {ls['median']:.3g}, max "
          f"{ls['max']:.4g}, mean absolute deviation {ls['mad_loss']:.3g} (the curve is MAD/(k+1), the running-mean "
          "identity: the −1 slope holds for any losses in random order).", ""]

    Ms = [("exact", "M exact"), ("theorem6", "M Theorem 6")] if t7["M_theorem6"] is not None else [("exact", "M exact")]
    L += ["## Theorem 7: (2 L_max + M‖δ‖²)/(k+1)", "",
          f"Bound holds everywhere: **{'yes' if res['bound_holds'] else 'NO'}**; smallest margin (bound / measured) "
          f"**{res['bound_margin']:.5g}**.", "",
          f"- At w*, all {N} images, {st['orderings']} orderings: L_max = {t7['loss_max_all']:.4g}, margin "
          f"**{t7['margin_w_star_all_samples']:.5g}** (the Theorem 7 line of `differences.png`).",
          f"- Paper's batch procedure, all {N} images, bound summed over each batch: margin {res['batch']['bound_margin']:.4g}.",
          f"- Hessian set, {hset}; {st['taylor_orderings']} orderings, worst of {st['directions']} directions: "
          f"L_max = {t7['loss_max_hessian_set']:.4g} (its largest loss), M exact = **{t7['M_exact']:.4g}** "
          "(max ‖H_i(w*)‖₂ + Lanczos residual)"
          + (f", M Theorem 6 = **{t7['M_theorem6']:.4g}** ({t7['theorem6_over_exact']:.3g} × M exact)"
             if t7["M_theorem6"] is not None else f"; Theorem 6: {t7['theorem6_note']}") + ". The rows below and "
          "`bound.png` use these.", "",
          "| ‖δ‖/‖w*‖ | ‖δ‖ | max (k+1)·\\|ΔL\\| | " + " | ".join(f"bound·(k+1), {lab} | margin, {lab}" for _, lab in Ms) + " |",
          "|---|---|---|" + "---|---|" * len(Ms)]
    for r in t7["rows"]:
        L.append(f"| {r['delta_rel']:g} | {_g(r['delta_norm'])} | {_g(r['max_measured_times_k_plus_1'])} | "
                 + " | ".join(f"{_g(r['bound_times_k_plus_1'][k_])} | {_g(r['margin'][k_])}" for k_, _ in Ms) + " |")
    sn = t7["spectral_norm"]
    L += ["", f"Per-image ‖H_i(w*)‖₂ on the Hessian set: median {sn['median']:.3g}, mean {sn['mean']:.3g}, min "
          f"{sn['min']:.3g}, max {sn['max']:.4g}; largest Lanczos residual {sn['max_lanczos_residual']:.2g}; largest "
          f"Frobenius norm {t7['frobenius_norm']['max']:.4g}.", "",
          "## Along δ: ‖H_i(w* + δ)‖₂ / ‖H_i(w*)‖₂", "",
          "Theorem 7 uses M at w* only; per image, direction 0:", "",
          "| ‖δ‖/‖w*‖ | images | median | min | max | max ‖H_i(w*+δ)‖₂ |", "|---|---|---|---|---|---|"]
    for r in t7["spectral_norm_at_w_star_plus_delta"]:
        L.append(f"| {r['delta_rel']:g} | {r['samples']} | {_g(r['ratio_median'])} | {_g(r['ratio_min'])} | "
                 f"{_g(r['ratio_max'])} | {_g(r['max_spectral_norm'])} |")
    L += ["", "## Taylor prediction of `L_{k+1}(w) − L_k(w)` from exact g_i, H_i at w*", "",
          f"Median over {st['directions']} directions of ‖pred − actual‖ over all k and {st['taylor_orderings']} orderings "
          f"of the Hessian set, relative to the part of the difference that δ causes (in parentheses: relative to the "
          "whole difference).", "",
          "| ‖δ‖/‖w*‖ | 2nd order (g + H) | paper's form, H only (Assumption 1) | 1st order (g only) |", "|---|---|---|---|"]
    for r in res["taylor"]["rows"]:
        L.append(f"| {r['delta_rel']:g} | " + " | ".join(
            f"{_g(r[f'rel_error_change_{k_}']['median'], 2)} ({_g(r[f'rel_error_{k_}']['median'], 2)})"
            for k_ in ("second_order", "assumption1", "first_order")) + " |")
    a1 = res["assumption1"]
    picks = []
    for want in (1, 10, 100, 1000, N):
        if want <= N:
            i = min(range(len(a1["N"])), key=lambda j: abs(a1["N"][j] - want))
            if not picks or picks[-1][0] != a1["N"][i]:
                picks.append((a1["N"][i], a1["grad_norm_mean"][i]))
    L += ["", f"## Assumption 1: ‖∇L_N(w*)‖ against N (all {N} images, mean of {len(a1['seeds'])} orderings)", "",
          "; ".join(f"N = {n:.0f}: {v:.3g}" for n, v in picks)
          + f". Full-data gradient {a1['full_gradient_norm']:.3g}; mean per-image gradient norm "
          f"{a1['mean_per_sample_gradient_norm']:.3g} (ratio {a1['ratio_full_to_per_sample']:.2f}).", "",
          "## Files", "",
          f"`convergence.json` (every number), `differences.png` (all {N} images), `bound.png` (Hessian set), "
          f"`taylor.png` (Hessian set), `assumption1.png` (all {N} images), `spectra.png` (Hessian set)."]
    b = st["batch_size"]
    if N > b and N % b:
        L += ["", f"In `differences.png` (right) the Theorem 7 line dips once per epoch, at every multiple of {N} samples "
              f"seen: each epoch's last batch has {N % b} images, not {b}, so the bound summed over its k is about "
              f"{N % b}/{b} of its neighbours' (genuine: fewer k are summed; not an artefact of the plot)."]
    return "\n".join(L) + "\n"


def run_experiment(model, out, settings: Settings, quiet: bool = True) -> dict:
    """Compute, then write ``convergence.json``, ``convergence.md`` and the figures into ``out`` atomically;
    returns the JSON dict."""
    with atomic_dir(out) as tmp:
        result, arrays = compute(model, settings, quiet=quiet)
        _say(quiet, "writing figures")
        result["run"] = describe_run(settings)
        result["figures"] = figures(arrays, tmp)
        (tmp / "convergence.md").write_text(markdown(result))
        write_json(tmp / "convergence.json", result)
    return result


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    check_out(args.out)
    t0 = time.perf_counter()
    from . import vit as vit_mod

    _say(args.quiet, "loading the digits ViT (trained first if there is no checkpoint)")
    plan = vit_mod.would_train(args.checkpoint)  # the options checked before a model is trained
    if plan:
        vit_mod.check_batch("--batch-size", settings.batch_size, plan["n_train"])
    with torch_threads(args.threads):
        vit = vit_mod.load_for_command(args.checkpoint, quiet=args.quiet)
        res = run_experiment(vit, args.out, settings, quiet=args.quiet)
    if not args.quiet:
        t7 = res["theorem7"]
        m6 = "skipped" if t7["M_theorem6"] is None else f"{t7['M_theorem6']:.4g}"
        print(f"slope {res['slope']:.3f} (k in [{res['slope_fit']['k_min']:.0f}, {res['slope_fit']['k_max']:.0f}]), "
              f"bound holds: {res['bound_holds']} (margin {res['bound_margin']:.3g}), "
              f"M exact {t7['M_exact']:.4g}, M Theorem 6 {m6}, "
              f"{time.perf_counter() - t0:.0f} s -> {Path(args.out) / 'convergence.json'}, convergence.md")
    return 0
