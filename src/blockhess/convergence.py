r"""Loss-landscape convergence with dataset size: Theorem 7 of the paper, with exact Hessians.

With per-sample losses :math:`l_i(w)` and the empirical loss over the first ``k`` samples
:math:`L_k(w) = \frac1k\sum_{i\le k} l_i(w)` (paper §4.1, after Kiselev & Grabovoy 2024):

* **running-mean identity** (exact, derived from the definition):
  :math:`L_{k+1}(w) - L_k(w) = \big(l_{k+1}(w) - L_k(w)\big)/(k+1)`;
* **second-order model** at a minimiser :math:`w^*`, :math:`\delta = w - w^*`:
  :math:`l_i(w) \approx l_i(w^*) + g_i^\top\delta + \tfrac12\delta^\top H_i\delta` with exact
  per-sample gradients :math:`g_i` and Hessians :math:`H_i` (closed form). The running mean is
  linear, so the predicted difference is the running-mean difference of the predicted
  per-sample losses; equivalently the paper's form
  :math:`\frac{l_{k+1}(w^*) - L_k(w^*)}{k+1} + \tfrac12\delta^\top(H^{(k+1)} - H^{(k)})\delta`,
  :math:`H^{(k+1)} - H^{(k)} = (H_{k+1} - \frac1k\sum_{i\le k}H_i)/(k+1)`, plus the gradient term
  :math:`(g_{k+1} - \bar g_k)^\top\delta/(k+1)` that the paper drops (Assumption 1);
* **Theorem 7**: if :math:`0 \le l_i(w^*) \le L` and :math:`\|H_i(w^*)\|_2 \le M` for all ``i``,
  :math:`|L_{k+1}(w) - L_k(w)| \le (2L + M\|w - w^*\|_2^2)/(k+1)`.

What the ``1/k`` slope measures: for losses taken in a random order,
:math:`l_{k+1} - L_k` has a spread that tends to a constant (the spread of the per-sample
losses), so :math:`\mathbb E|L_{k+1} - L_k| \sim c/k` follows from the running-mean identity
alone, for any model; the network enters only through ``c``. The bound's interest is in its
constants (``L``, ``M``), which the closed form computes exactly (docs/convergence.md).

Per-sample Hessians are computed by the closed form (Theorem 5 / eq. 10, assembled as
:func:`blockhess.hessian` assembles a batch of one, in place in one ``(B, n, n)`` buffer),
never by autograd. Functions here take ``torch`` tensors; the statistics are returned in float64.

>>> import torch, blockhess as bh
>>> cfg = bh.BlockConfig(d_model=4, d_ff=6)
>>> p = bh.init_params(cfg, seed=0)
>>> X, T = torch.randn(5, 3, 4, dtype=torch.float64), torch.randn(5, 3, 4, dtype=torch.float64)
>>> H = bh.convergence.per_sample_hessians(p, X, cfg, loss="mse", target=T)   # (5, 96, 96)
>>> bool(torch.allclose(H[2], bh.hessian(p, X[2], cfg, loss="mse", target=T[2]).dense()))
True
>>> l = bh.convergence.per_sample_losses(p, X, cfg, loss="mse", target=T)       # (5,)
>>> d = bh.convergence.loss_differences(l)                                    # L_{k+1} - L_k, (4,)
>>> bool((d.abs() <= bh.convergence.theorem7_bound(torch.arange(1, 5), l.max(), 0.0)).all())
True
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from . import linalg, losses
from .block import check_forward, check_inputs, forward_cache, jacobian_factors, select_wrt
from .config import BlockConfig, param_shapes
from .hessian import assemble
from .validation import check_fits, check_int, check_result, check_tensor, detached

__all__ = [
    "running_mean",
    "loss_differences",
    "random_orderings",
    "ordering_differences",
    "batch_running_mean",
    "ema",
    "log_ema",
    "loglog_slope",
    "theorem7_bound",
    "taylor_losses",
    "taylor_difference_paper",
    "per_sample_losses",
    "per_sample_gradients",
    "per_sample_hessians",
    "spectral_norm",
    "SpectralNorm",
    "PerSampleStats",
    "per_sample_statistics",
    "gradient_norms",
    "unit_directions",
    "perturb",
]


# ----------------------------------------------------------------------------- sequences


def _f64(x, name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if not (t.dtype.is_floating_point or t.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"{name} must be a real array, got dtype {t.dtype}")
    t = t.to(torch.float64)
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN or Inf")
    return t


def running_mean(values, dim: int = -1) -> torch.Tensor:
    r"""Running means :math:`L_k = \frac1k\sum_{i\le k} v_i`, ``k = 1..N``, along ``dim``.

    ``values``: array of shape ``(..., N, ...)`` with ``N >= 1`` along ``dim`` (losses, or a
    stack of Hessians ``(N, n, n)`` with ``dim=0``). Returns float64 of the same shape.
    Source: paper §4.1 (definition of :math:`L_k`).

    Raises ``ValueError`` for an empty axis or NaN/Inf.
    """
    v = _f64(values, "values")
    if v.ndim == 0 or v.shape[dim] < 1:
        raise ValueError(f"values must have at least one entry along dim {dim}, got shape {tuple(v.shape)}")
    N = v.shape[dim]
    shape = [1] * v.ndim
    shape[dim] = N
    k = torch.arange(1, N + 1, dtype=torch.float64, device=v.device).reshape(shape)
    return v.cumsum(dim) / k


def loss_differences(losses_in_order, dim: int = -1) -> torch.Tensor:
    r"""Signed differences :math:`L_{k+1} - L_k` for ``k = 1..N-1`` along ``dim``.

    ``losses_in_order``: per-sample values in the order they are added, shape ``(..., N)``
    (``N >= 2``); returns float64 ``(..., N-1)``, entry ``k-1`` for step ``k -> k+1``. Computed
    as :math:`(l_{k+1} - L_k)/(k+1)` (the running-mean identity, paper §4.1), which equals the
    difference of the running means (tested). Raises ``ValueError`` if ``N < 2``.
    """
    v = _f64(losses_in_order, "losses_in_order").movedim(dim, -1)
    N = v.shape[-1]
    if N < 2:
        raise ValueError(f"need at least 2 samples for a difference, got {N}")
    L = running_mean(v)
    k = torch.arange(1, N, dtype=torch.float64, device=v.device)
    return ((v[..., 1:] - L[..., :-1]) / (k + 1)).movedim(-1, dim)


def random_orderings(n_samples: int, n_orderings: int, seed: int = 0) -> torch.Tensor:
    """``n_orderings`` independent random permutations of ``range(n_samples)``.

    Returns int64 ``(n_orderings, n_samples)``, drawn from a private ``torch.Generator``
    seeded with ``seed`` (global RNG untouched). Raises ``ValueError`` unless both sizes are
    ints >= 1.
    """
    check_int("n_samples", n_samples, 1)
    check_int("n_orderings", n_orderings, 1)
    gen = torch.Generator().manual_seed(check_int("seed", seed, 0))
    return torch.stack([torch.randperm(int(n_samples), generator=gen) for _ in range(int(n_orderings))])


def ordering_differences(per_sample, orderings: torch.Tensor) -> torch.Tensor:
    r"""Signed :math:`L_{k+1} - L_k` of ``per_sample`` values taken in each ordering.

    ``per_sample``: ``(N,)``; ``orderings``: int ``(R, N)`` permutations (or ``(R, K)`` index
    subsets, ``K >= 2``). Returns float64 ``(R, K-1)``. Derived here (the running-mean identity
    per ordering). Raises ``ValueError`` on a shape mismatch or an index out of range.
    """
    v = _f64(per_sample, "per_sample")
    if v.ndim != 1:
        raise ValueError(f"per_sample must have shape (N,), got {tuple(v.shape)}")
    o = torch.as_tensor(orderings)
    if o.ndim != 2 or o.dtype.is_floating_point:
        raise ValueError(f"orderings must be an integer tensor (R, K), got {tuple(o.shape)} {o.dtype}")
    if o.numel() and (int(o.min()) < 0 or int(o.max()) >= v.shape[0]):
        raise ValueError(f"orderings index outside [0, {v.shape[0] - 1}]")
    return loss_differences(v[o])


def batch_running_mean(per_sample, batch_size: int, epochs: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The paper's batch-wise running-mean estimate (§4.2), on fixed per-sample losses.

    Each epoch shuffles the ``N`` samples (private generator, ``seed``) and adds them in
    batches of ``batch_size`` to a running sum ``S`` with count ``n``; for every batch after
    the first, :math:`\Delta = |S_{after}/n_{after} - S_{before}/n_{before}|` is recorded
    against :math:`n_{after}`, the number of samples seen (repeats across epochs count, as in
    the paper; the last short batch of an epoch is kept). Returns float64 ``(n_seen (S,),
    delta (S,))``. With the paper's augmentation every epoch sees new losses; here
    the losses are those of the fixed samples. Raises ``ValueError`` for sizes < 1.
    """
    v = _f64(per_sample, "per_sample")
    if v.ndim != 1 or v.shape[0] < 1:
        raise ValueError(f"per_sample must have shape (N,) with N >= 1, got {tuple(v.shape)}")
    check_int("batch_size", batch_size, 1)
    check_int("epochs", epochs, 1)
    N, b = v.shape[0], int(batch_size)
    gen = torch.Generator().manual_seed(check_int("seed", seed, 0))
    sums, counts = [], []
    for _ in range(int(epochs)):
        perm = v[torch.randperm(N, generator=gen)]
        for start in range(0, N, b):
            chunk = perm[start : start + b]
            sums.append(chunk.sum())
            counts.append(chunk.numel())
    S = torch.stack(sums).cumsum(0)
    n = torch.tensor(counts, dtype=torch.float64, device=v.device).cumsum(0)
    means = S / n
    return n[1:], (means[1:] - means[:-1]).abs()


def ema(values, alpha: float) -> torch.Tensor:
    r"""Exponential moving average :math:`y_0 = x_0`, :math:`y_t = (1-\alpha)y_{t-1} + \alpha x_t`.

    The paper's smoothing (pandas ``ewm(alpha=alpha, adjust=False)``, §4.2). ``values``:
    ``(N,)``; returns float64 ``(N,)``. Note the lag: on a ``c/k`` series the EMA lags by about
    ``1/alpha`` steps, so fit slopes only where ``k >> 1/alpha``. Raises ``ValueError`` unless
    ``0 < alpha <= 1`` and ``values`` is a non-empty vector.
    """
    v = _f64(values, "values")
    if v.ndim != 1 or v.numel() < 1:
        raise ValueError(f"values must have shape (N,) with N >= 1, got {tuple(v.shape)}")
    if not (0 < float(alpha) <= 1):
        raise ValueError(f"alpha must lie in (0, 1], got {alpha!r}")
    a = float(alpha)
    out = [0.0] * v.numel()
    y = 0.0
    for i, x in enumerate(v.tolist()):
        y = x if i == 0 else (1 - a) * y + a * x
        out[i] = y
    return torch.tensor(out, dtype=torch.float64, device=v.device)


def log_ema(k, y, alpha: float = 0.5, per_decade: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    r"""EMA along a geometric grid of ``k``: the smoothing used for the reported slopes.

    ``y`` is first averaged in geometric bins of ``k`` (``per_decade`` bins per decade;
    each integer ``k`` is its own bin while bins are narrower than 1), then smoothed by
    :func:`ema` along the bins. On such a grid a power law :math:`c k^{s}` is a geometric
    sequence, which an EMA maps to a geometric sequence of the same ratio (a constant factor
    after a transient of a few bins): the slope is kept. An EMA along the sample or batch
    index (the paper's, §4.2) instead lags by a fixed *number* of steps, which bends a
    :math:`k^{-1}` line on log-log axes (steeper where ``k`` is within a few ``1/alpha``).
    ``k``: increasing ``(N,)`` positive; ``y``: ``(N,)``. Returns float64 ``(k_bins (G,),
    y_smooth (G,))`` with ``k_bins`` the geometric mean of each bin's ``k``. Derived here.

    Raises ``ValueError`` for mismatched shapes, non-positive or non-increasing ``k``,
    ``per_decade < 1``, or ``alpha`` outside ``(0, 1]``.
    """
    k, y = _f64(k, "k"), _f64(y, "y")
    if k.ndim != 1 or k.shape != y.shape or k.numel() < 1:
        raise ValueError(f"k and y must be non-empty vectors of one shape, got {tuple(k.shape)} and {tuple(y.shape)}")
    if (k <= 0).any() or (k[1:] <= k[:-1]).any():
        raise ValueError("k must be positive and strictly increasing")
    check_int("per_decade", per_decade, 1)
    edges = torch.floor(torch.log10(k) * int(per_decade)).to(torch.int64)
    _, inverse, counts = torch.unique_consecutive(edges, return_inverse=True, return_counts=True)
    G = counts.numel()
    ybin = y.new_zeros(G).index_add_(0, inverse, y) / counts
    kbin = torch.exp(k.new_zeros(G).index_add_(0, inverse, k.log()) / counts)
    return kbin, ema(ybin, alpha)


def loglog_slope(k, y, k_min: float | None = None, k_max: float | None = None, n_points: int = 64) -> dict:
    r"""Least-squares slope of :math:`\log y` against :math:`\log k` over ``[k_min, k_max]``.

    The fit uses up to ``n_points`` entries on a geometric grid of ``k`` (each decade counts
    alike, instead of the dense large-``k`` end dominating). ``k``, ``y``: ``(N,)``, ``k`` ascending,
    ``k > 0`` and ``y > 0`` inside the range. Returns ``{"slope", "intercept", "k_min", "k_max",
    "n_points", "r2"}`` (``y ≈ exp(intercept)·k^slope``). Derived here.

    Raises ``ValueError`` for mismatched shapes, ``k`` not in ascending order, non-positive
    values in range, or fewer than 3 points in range.
    """
    k, y = _f64(k, "k"), _f64(y, "y")
    if k.shape != y.shape or k.ndim != 1:
        raise ValueError(f"k and y must be vectors of one shape, got {tuple(k.shape)} and {tuple(y.shape)}")
    if (k[1:] < k[:-1]).any():
        raise ValueError("k must be in ascending order (sort k and y together)")
    lo = float(k.min()) if k_min is None else float(k_min)
    hi = float(k.max()) if k_max is None else float(k_max)
    inside = ((k >= lo) & (k <= hi)).nonzero().flatten()
    if inside.numel() < 3:
        raise ValueError(f"need at least 3 points with k in [{lo}, {hi}], got {inside.numel()}")
    ks, ys = k[inside], y[inside]
    if (ks <= 0).any() or (ys <= 0).any():
        raise ValueError("k and y must be positive inside the fit range for a log-log fit")
    grid = torch.logspace(math.log10(float(ks.min())), math.log10(float(ks.max())), int(n_points), dtype=torch.float64,
                          device=ks.device)
    idx = torch.searchsorted(ks.contiguous(), grid).clamp(max=ks.numel() - 1).unique()
    if idx.numel() < 3:
        idx = torch.arange(ks.numel(), device=ks.device)
    lx, ly = ks[idx].log(), ys[idx].log()
    A = torch.stack([lx, torch.ones_like(lx)], 1)
    sol = torch.linalg.lstsq(A, ly[:, None]).solution[:, 0]
    resid = ly - A @ sol
    ss = ((ly - ly.mean()) ** 2).sum()
    r2 = float(1 - (resid**2).sum() / ss) if ss > 0 else 1.0
    return {"slope": float(sol[0]), "intercept": float(sol[1]), "k_min": float(ks[idx].min()),
            "k_max": float(ks[idx].max()), "n_points": int(idx.numel()), "r2": r2}


def theorem7_bound(k, loss_max: float, M: float, delta_norm: float = 0.0) -> torch.Tensor:
    r"""Theorem 7's bound :math:`(2L + M\|w - w^*\|_2^2)/(k+1)` on :math:`|L_{k+1}(w) - L_k(w)|`.

    ``k``: array of sample counts (``k >= 1``); ``loss_max`` = ``L`` (a bound on every
    :math:`l_i(w^*) \ge 0`); ``M``: a bound on every per-sample :math:`\|H_i(w^*)\|_2`;
    ``delta_norm`` = :math:`\|w - w^*\|_2`. Returns float64 of ``k``'s shape. Source:
    paper Theorem 7 (§4.1). Raises ``ValueError`` for negative ``loss_max``, ``M`` or
    ``delta_norm``, or ``k < 1``.
    """
    k = _f64(k, "k")
    if (k < 1).any():
        raise ValueError("k must be >= 1")
    for name, val in (("loss_max", loss_max), ("M", M), ("delta_norm", delta_norm)):
        if not (math.isfinite(float(val)) and float(val) >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {val!r}")
    return (2 * float(loss_max) + float(M) * float(delta_norm) ** 2) / (k + 1)


def taylor_losses(loss0, grad_dot=None, quad=None) -> torch.Tensor:
    r"""Second-order model of per-sample losses, :math:`l_i(w^*) + g_i^\top\delta + \tfrac12\delta^\top H_i\delta`.

    ``loss0``: :math:`l_i(w^*)`, ``(N,)``; ``grad_dot``: :math:`g_i^\top\delta` ``(N,)`` or ``None``
    (the paper's Assumption-1 form drops it); ``quad``: :math:`\delta^\top H_i\delta` ``(N,)``
    or ``None``. Returns float64 ``(N,)``. Feed it to :func:`ordering_differences` for the
    predicted :math:`L_{k+1}(w) - L_k(w)` (the running mean is linear, so this equals the
    paper's formula, :func:`taylor_difference_paper`). Source: paper §4.1.
    Raises ``ValueError`` on mismatched shapes.
    """
    out = _f64(loss0, "loss0").clone()
    for name, t in (("grad_dot", grad_dot), ("quad", quad)):
        if t is None:
            continue
        t = _f64(t, name)
        if t.shape != out.shape:
            raise ValueError(f"{name} must have shape {tuple(out.shape)}, got {tuple(t.shape)}")
        out = out + (t if name == "grad_dot" else 0.5 * t)
    return out


def taylor_difference_paper(loss0, hessians, delta, grads=None) -> torch.Tensor:
    r"""The paper's second-order expression for :math:`L_{k+1}(w) - L_k(w)`, ``k = 1..N-1``.

    .. math::
        \frac{l_{k+1}(w^*) - L_k(w^*)}{k+1} + \tfrac12\,\delta^\top\big(H^{(k+1)} - H^{(k)}\big)\delta
        \;[+\; (\nabla L_{k+1} - \nabla L_k)^\top\delta],

    with :math:`H^{(k)} = \frac1k\sum_{i\le k} H_i` formed explicitly (running mean of the
    matrices) — a literal transcription of paper §4.1, for checking :func:`taylor_losses`.
    ``loss0``: ``(N,)``; ``hessians``: ``(N, n, n)``; ``delta``: ``(n,)``; ``grads``:
    ``(N, n)`` or ``None`` (the paper, under Assumption 1, has no gradient term). Samples in
    the given order. Returns float64 ``(N-1,)``. Raises ``ValueError`` on shape mismatch.
    """
    l0 = _f64(loss0, "loss0")
    H = _f64(hessians, "hessians")
    d = _f64(delta, "delta")
    N = l0.shape[0]
    if H.shape != (N, d.shape[0], d.shape[0]):
        raise ValueError(f"hessians must have shape {(N, d.shape[0], d.shape[0])}, got {tuple(H.shape)}")
    Hk = running_mean(H, dim=0)
    quad = torch.einsum("i,kij,j->k", d, Hk, d)
    out = loss_differences(l0) + 0.5 * (quad[1:] - quad[:-1])
    if grads is not None:
        g = _f64(grads, "grads")
        if g.shape != (N, d.shape[0]):
            raise ValueError(f"grads must have shape {(N, d.shape[0])}, got {tuple(g.shape)}")
        gk = running_mean(g, dim=0) @ d
        out = out + (gk[1:] - gk[:-1])
    return out


# ----------------------------------------------------------------------------- per sample, closed form


def _per_sample_values(loss, target, Z: torch.Tensor) -> torch.Tensor:
    """Per-sequence losses ``(B,)`` of ``Z`` ``(B, L, d)`` (no mean over the batch)."""
    B, L, d = Z.shape
    if loss == "mse":
        return ((Z - target) ** 2).mean((1, 2))
    if loss == "ce":
        ce = torch.nn.functional.cross_entropy(Z.reshape(-1, d), target.reshape(-1), reduction="none")
        return ce.reshape(B, L).mean(1)
    in_dims = (0, 0 if isinstance(target, torch.Tensor) else None)
    return torch.func.vmap(loss, in_dims=in_dims)(Z, target)


def _prepare(params, X, cfg, loss, target, wrt):
    """Public checks (as :func:`blockhess.hessian`), and ``params`` and the batch form of ``X``
    and ``target``, detached (:func:`~blockhess.validation.detached`)."""
    check_inputs(params, X, cfg)
    params, X, target = detached(params, X, target)
    Xb = X[None] if X.ndim == 2 else X
    if X.ndim == 2 and isinstance(target, torch.Tensor):
        target = target[None]
    c = forward_cache(params, Xb, cfg, plain=True)
    check_forward(c)
    target = losses.check(loss, target, c.out, single=X.ndim == 2)
    names = select_wrt(c.names, wrt)
    return params, Xb, target, c, names


def _slice_target(target, sl):
    return target[sl] if isinstance(target, torch.Tensor) else target


def per_sample_losses(params: dict, X: torch.Tensor, cfg: BlockConfig, loss="mse", target=None) -> torch.Tensor:
    """Per-sequence losses :math:`l_i(w)` of a batch, shape ``(B,)``, dtype of ``X``.

    Same arguments and errors as :func:`blockhess.hessian` (``X``: ``(B, L, d_model)`` or one
    sequence; the batch mean of the result is the batch loss). Source: the losses of
    :func:`blockhess.hessian` (docs/derivations.md §8).
    """
    params, Xb, target, c, _ = _prepare(params, X, cfg, loss, target, None)
    return _per_sample_values(loss, target, c.out)


def _size(cfg: BlockConfig, names) -> int:
    """Total number of entries of the weights ``names``."""
    return sum(int(torch.Size(s).numel()) for k, s in param_shapes(cfg).items() if k in names)


def _flat_grad(f, g: torch.Tensor, names) -> torch.Tensor:
    r""":math:`(\partial Z/\partial w)^\top g` for one sequence's factors ``f`` and ``g`` ``(1, L, d)``: ``(n,)``."""
    return torch.cat([f.J[k].vjp(g[:, None])[0, 0] for k in names])


def _grad_one(params, cfg, names):
    def one(x, g):
        return _flat_grad(jacobian_factors(forward_cache(params, x[None], cfg)), g[None], names)

    return one


def per_sample_gradients(params: dict, X: torch.Tensor, cfg: BlockConfig, loss="mse", target=None, wrt=None) -> torch.Tensor:
    r"""Per-sequence loss gradients :math:`g_i = (\partial Z/\partial w)^\top \nabla_Z l_i`, shape ``(B, n)``.

    ``n`` = total size of the weights ``wrt`` (default all, canonical order, ``vec_r``).
    Closed form: the Theorem 4 Kronecker factors contracted with :math:`\nabla_Z l_i`,
    vmapped over sequences; valid almost everywhere (ReLU). Same arguments and errors as
    :func:`blockhess.hessian`.
    """
    params, Xb, target, c, names = _prepare(params, X, cfg, loss, target, wrt)
    B = Xb.shape[0]
    g = losses.derivatives(loss, target, c.out).grad * B
    return torch.func.vmap(_grad_one(params, cfg, names))(Xb, g)


def _hessian_chunk(params, Xb, target, cfg, loss, names):
    """``(losses (b,), grads (b, n), hessians (b, n, n))`` of a chunk; inputs already checked.

    The loss derivatives for the whole chunk at once (a callable's NaN/Inf named by its
    sequence in the chunk); then sequence by sequence, each Hessian assembled in place in
    its slice of one ``(b, n, n)`` buffer exactly as :func:`blockhess.hessian` assembles a
    batch of one (whose loss is the sequence's own loss).
    """
    B = Xb.shape[0]
    c = forward_cache(params, Xb, cfg, plain=True)
    values = _per_sample_values(loss, target, c.out)
    ld = losses.derivatives(loss, target, c.out)
    n = _size(cfg, names)
    grads, H = Xb.new_empty(B, n), Xb.new_empty(B, n, n)
    for i in range(B):
        c = forward_cache(params, Xb[i : i + 1], cfg)
        f = jacobian_factors(c)
        ld_i = ld.sequence(i)
        grads[i] = _flat_grad(f, ld_i.grad, names)
        assemble(c, f, ld_i, names, out=H[i])
    check_result({"the per-sample gradients": grads, "the per-sample Hessians": H})
    return values, grads, H


def per_sample_hessians(params: dict, X: torch.Tensor, cfg: BlockConfig, loss="mse", target=None, wrt=None) -> torch.Tensor:
    r"""Exact per-sequence loss Hessians :math:`H_i = \nabla^2_w l_i`, dense, shape ``(B, n, n)``.

    ``H[i]`` equals ``blockhess.hessian(params, X[i], cfg, loss, target[i], wrt).dense()``
    (a batch of one is that sequence's Hessian), and is computed that way, the closed form
    (eq. 10: Gauss–Newton term from the Theorem 4 factors, functional term from Theorem 5
    contracted with :math:`\nabla_Z l_i`) writing each into its slice of the result (cost:
    docs/convergence.md, "Per-sample Hessians"). For a callable loss the
    outer term uses the non-zero eigenpairs of :math:`\nabla^2_Z l_i` (randomised range
    finder, exact up to rounding). Off-diagonal blocks are exact transposes, diagonal blocks
    symmetric to rounding. ``n`` = total size of ``wrt`` (default all weights,
    canonical order, ``vec_r``). dtype/device of ``X``; exact almost everywhere (ReLU).

    Raises ``ValueError`` as :func:`blockhess.hessian`; ``InsufficientMemoryError`` when the
    ``B·n²`` entries would not fit.
    """
    params, Xb, target, _, names = _prepare(params, X, cfg, loss, target, wrt)
    n = _size(cfg, names)
    check_fits(Xb.shape[0] * n * n * Xb.element_size(), f"{Xb.shape[0]} per-sample {n}x{n} Hessians", Xb.device)
    return _hessian_chunk(params, Xb, target, cfg, loss, names)[2]


class SpectralNorm(NamedTuple):
    """``norm``: :math:`\\max_j|\\lambda_j|` estimates ``(B,)``, never above the true value; ``residual``:
    ``(B,)`` Lanczos residuals (some eigenvalue, not necessarily the extreme one, lies within
    ``residual`` of ``±norm``; 0 for a full ``eigvalsh``)."""

    norm: torch.Tensor
    residual: torch.Tensor


def spectral_norm(H: torch.Tensor, iters: int | None = 64, seed: int = 0, tol: float = 1e-12) -> SpectralNorm:
    r"""Spectral norms :math:`\|H_b\|_2 = \max_j |\lambda_j(H_b)|` of symmetric matrices ``(..., n, n)``.

    Lanczos with full reorthogonalisation (:func:`blockhess.linalg.lanczos_norm`), batched over the
    leading axes, for at most ``iters`` steps, stopping early once every extreme Ritz value has a
    residual below ``tol`` times itself (``iters=None``, ``iters >= n`` or ``n <= 64``: exact ``eigvalsh``).
    The extreme Ritz value :math:`\theta` never exceeds :math:`\|H\|_2` (Ritz values lie between
    the extreme eigenvalues). Its residual :math:`|\beta_m y_m|` bounds the distance from
    :math:`\theta` to *some* eigenvalue, not necessarily the extreme one: with too few steps
    :math:`\theta` can settle near an inner eigenvalue with a small residual, so
    ``norm + residual`` is not a guaranteed upper bound (``iters=None`` is exact). Only the
    upper triangle's symmetry is assumed, not checked. Returns float64 :class:`SpectralNorm` with the batch shape.
    Source: standard Lanczos (Golub & Van Loan, *Matrix Computations*, §10.1).

    Raises ``ValueError`` for a non-square or non-finite input or ``iters < 1``.
    """
    check_tensor("H", H)
    if H.ndim < 2 or H.shape[-1] != H.shape[-2]:
        raise ValueError(f"H must have shape (..., n, n), got {tuple(H.shape)}")
    if iters is not None:
        check_int("iters", iters, 1)
    return _spectral_norm(H, iters, seed, tol)


def _exact(iters, n: int) -> bool:
    """Whether :func:`spectral_norm` takes a full ``eigvalsh`` rather than Lanczos."""
    return iters is None or int(iters) >= n or n <= 64


def _spectral_norm(H: torch.Tensor, iters, seed: int, tol: float) -> SpectralNorm:
    """:func:`spectral_norm` without input checks (kernel): a full ``eigvalsh`` where :func:`_exact`,
    else :func:`blockhess.linalg.lanczos_norm` on the products with each matrix."""
    batch, n = H.shape[:-2], H.shape[-1]
    A = H.reshape(-1, n, n)
    if _exact(iters, n):
        ev = linalg.eigvalsh(A)
        norm = ev.abs().amax(-1).to(torch.float64)
        return SpectralNorm(norm.reshape(batch), torch.zeros_like(norm).reshape(batch))
    norm, resid = linalg.lanczos_norm(lambda q: linalg.batched_matvec(A, q), A.shape[0], n, int(iters), seed, tol,
                                      A.dtype, A.device)
    return SpectralNorm(norm.to(torch.float64).reshape(batch), resid.to(torch.float64).reshape(batch))


class PerSampleStats(NamedTuple):
    """Per-sample curvature statistics of ``N`` sequences (all float64, CPU).

    loss: ``(N,)`` :math:`l_i(w)`; spectral: ``(N,)`` :math:`\\|H_i\\|_2` (Lanczos estimate);
    spectral_residual: ``(N,)``; frobenius: ``(N,)`` :math:`\\|H_i\\|_F`; grad_norm: ``(N,)``
    :math:`\\|g_i\\|_2`; grad_dot: ``(N, D)`` :math:`g_i^\\top u_j`; quad: ``(N, D)``
    :math:`u_j^\\top H_i u_j` for the ``D`` given directions ``u_j``; grads: ``(N, n)`` or ``None``.
    """

    loss: torch.Tensor
    spectral: torch.Tensor
    spectral_residual: torch.Tensor
    frobenius: torch.Tensor
    grad_norm: torch.Tensor
    grad_dot: torch.Tensor
    quad: torch.Tensor
    grads: torch.Tensor | None


def per_sample_statistics(
    params: dict,
    X: torch.Tensor,
    cfg: BlockConfig,
    loss="mse",
    target=None,
    directions: torch.Tensor | None = None,
    *,
    wrt=None,
    chunk_size: int = 8,
    lanczos_iters: int | None = 64,
    lanczos_tol: float = 1e-10,
    keep_grads: bool = False,
    progress: Callable[[int], None] | None = None,
) -> PerSampleStats:
    r"""Exact per-sample Hessian statistics of a batch, chunk by chunk (never all ``H_i`` at once).

    For each chunk of ``chunk_size`` sequences the dense per-sample Hessians are formed by
    :func:`per_sample_hessians`' closed form, reduced to their spectral norm
    (:func:`spectral_norm`), Frobenius norm and quadratic forms along ``directions``
    (``(D, n)``, float; usually unit vectors), then freed. The spectral norm is Lanczos with
    at most ``lanczos_iters`` steps, stopped when the residual is below ``lanczos_tol`` times
    the Ritz value (``None``: exact ``eigvalsh``). ``progress(m)`` is called after each chunk
    with its size (e.g. ``tqdm.update``). ``X``: ``(N, L, d_model)``; the statistics are returned
    in float64 on the CPU, see :class:`PerSampleStats`. Peak memory about ``chunk_size·n²``
    entries of ``X``'s dtype (the chunk's Hessians), plus, where the spectral norm is an exact
    ``eigvalsh`` (``lanczos_iters`` ``None`` or ``>= n``, or ``n <= 64``), LAPACK's float64
    copy of them and, for float32, :mod:`blockhess.linalg`'s upcast. Derived here from eq. 10
    and Theorem 5.

    Raises ``ValueError`` as :func:`blockhess.hessian`, for ``directions`` of the wrong shape,
    ``chunk_size < 1`` or ``lanczos_iters < 1``; ``InsufficientMemoryError`` if one chunk would
    not fit.
    """
    check_int("chunk_size", chunk_size, 1)
    if lanczos_iters is not None:
        check_int("lanczos_iters", lanczos_iters, 1)
    params, Xb, target, _, names = _prepare(params, X, cfg, loss, target, wrt)
    n = _size(cfg, names)
    if directions is None:
        directions = Xb.new_zeros(0, n)
    check_tensor("directions", directions, ndim=(2,))
    if directions.shape[1] != n:
        raise ValueError(f"directions must have shape (D, {n}), got {tuple(directions.shape)}")
    U = directions.to(dtype=Xb.dtype, device=Xb.device)
    N = Xb.shape[0]
    entries = min(int(chunk_size), N) * n * n
    copies = (1 + (Xb.dtype != torch.float64)) if _exact(lanczos_iters, n) else 0  # float64 copies for eigvalsh
    check_fits(entries * (Xb.element_size() + 8 * copies), f"a chunk of per-sample {n}x{n} Hessians", Xb.device)
    out = {k: [] for k in PerSampleStats._fields}
    for start in range(0, N, int(chunk_size)):
        sl = slice(start, min(start + int(chunk_size), N))
        vals, grads, H = _hessian_chunk(params, Xb[sl], _slice_target(target, sl), cfg, loss, names)
        sn = _spectral_norm(H, lanczos_iters, start, lanczos_tol)
        out["loss"].append(vals)
        out["spectral"].append(sn.norm)
        out["spectral_residual"].append(sn.residual)
        out["frobenius"].append(H.flatten(1).norm(dim=1))
        out["grad_norm"].append(grads.norm(dim=1))
        out["grad_dot"].append(grads @ U.T)
        out["quad"].append(torch.einsum("dj,bjk,dk->bd", U, H, U))
        out["grads"].append(grads)
        del H
        if progress is not None:
            progress(sl.stop - sl.start)
    cat = {k: torch.cat(v).detach().to(device="cpu", dtype=torch.float64) for k, v in out.items()}
    if not keep_grads:
        cat["grads"] = None
    return PerSampleStats(**cat)


def gradient_norms(grads, orderings: torch.Tensor) -> torch.Tensor:
    r"""Assumption-1 check: :math:`\|\nabla L_N(w^*)\|_2 = \|\frac1N\sum_{i\le N} g_i\|_2` along orderings.

    ``grads``: per-sample gradients ``(N_total, n)``; ``orderings``: int ``(R, K)``. Returns
    float64 ``(R, K)``, entry ``[r, N-1]`` for the first ``N`` samples of ordering ``r``.
    Source: paper App. A.2 (the check of Assumption 1), per sample
    instead of per batch. Raises ``ValueError`` on shape mismatch.
    """
    g = _f64(grads, "grads")
    o = torch.as_tensor(orderings)
    if g.ndim != 2 or o.ndim != 2 or o.dtype.is_floating_point:
        raise ValueError(f"grads must be (N, n) and orderings int (R, K), got {tuple(g.shape)}, {tuple(o.shape)}")
    if o.numel() and (int(o.min()) < 0 or int(o.max()) >= g.shape[0]):
        raise ValueError(f"orderings index outside [0, {g.shape[0] - 1}]")
    return torch.stack([running_mean(g[row], dim=0).norm(dim=1) for row in o])


def _names(params: dict, cfg: BlockConfig, wrt) -> tuple[str, ...]:
    """Canonical names (``param_shapes(cfg)`` order, as :func:`blockhess.hessian`) restricted to ``wrt``."""
    if not isinstance(cfg, BlockConfig):
        raise ValueError(f"cfg must be a BlockConfig, got {type(cfg).__name__}")
    names = select_wrt(tuple(param_shapes(cfg)), wrt)
    missing = [k for k in names if k not in params]
    if missing:
        raise ValueError(f"params is missing {missing} for this cfg")
    return names


def unit_directions(params: dict, cfg: BlockConfig, n_directions: int, seed: int = 0, wrt=None) -> torch.Tensor:
    """``n_directions`` random unit vectors in weight space, ``(D, n)``, dtype/device of ``params``.

    Gaussian, normalised to unit Euclidean norm over all weights ``wrt`` (default all of
    ``cfg``; canonical order and ``vec_r``, the layout of :func:`blockhess.hessian`), from a
    private generator seeded with ``seed``. Raises ``ValueError`` for ``n_directions < 1``,
    an unknown name in ``wrt`` or a missing weight.
    """
    check_int("n_directions", n_directions, 1)
    names = _names(params, cfg, wrt)
    n = sum(params[k].numel() for k in names)
    ref = params[names[0]]
    gen = torch.Generator().manual_seed(check_int("seed", seed, 0))
    U = torch.randn(int(n_directions), n, generator=gen, dtype=torch.float64)
    U = U / U.norm(dim=1, keepdim=True)
    return U.to(dtype=ref.dtype, device=ref.device)


def perturb(params: dict, delta: torch.Tensor, cfg: BlockConfig, wrt=None) -> dict:
    """``w* + δ``: a new params dict with the flat ``delta`` ``(n,)`` added to the weights ``wrt``
    (default all of ``cfg``; canonical order and ``vec_r``, the layout of :func:`blockhess.hessian`);
    the others are copied. Raises ``ValueError`` on a size mismatch or a missing weight."""
    names = _names(params, cfg, wrt)
    n = sum(params[k].numel() for k in names)
    check_tensor("delta", delta)
    if delta.ndim != 1 or delta.shape[0] != n:
        raise ValueError(f"delta must have shape ({n},), got {tuple(delta.shape)}")
    out, off = dict(params), 0
    for k in names:
        m = params[k].numel()
        out[k] = params[k] + delta[off : off + m].reshape(params[k].shape).to(params[k])
        off += m
    return out
