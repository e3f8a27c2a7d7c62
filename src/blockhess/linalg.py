"""Symmetric eigensolvers (dense, low-rank, Lanczos), the matrix 2-norm and the relative
Frobenius error; the dense ones computed in float64 whatever the input's dtype.

LAPACK's float32 routines behind ``torch.linalg.eigh``/``eigvalsh`` on the CPU can fail to
converge on the block-sparse, rank-deficient matrices this package produces; float64 converges
on the same matrices (docs/derivations.md §8). Every eigendecomposition and spectral norm in the package goes through here; results come back in
the input's dtype (the 2-norm as a Python float). :func:`eig_lowrank` finds the eigenpairs of
a batch of symmetric matrices that stand above rounding by a randomised range finder (a callable
loss's Hessians w.r.t. the block output); :func:`lanczos_norm` estimates the spectral norms of a
batch of symmetric operators given by their products (the per-sample Hessians of
:mod:`blockhess.convergence`). :func:`rel_error` is the one measure every check against the
autograd reference uses (tests, ``blockhess validate``, ``report``, ``bench``).

LAPACK's eigensolvers and SVD do a matrix-vector product per column (each its own OpenMP
parallel region, of about ``m·n`` multiply-adds), so a matrix below ``512 × 512`` is
factorised on one thread (:func:`blockhess.threads.threads_for`), a larger one on the
caller's thread count.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .threads import threads_for

__all__ = ["eigh", "eigvalsh", "norm2", "rel_error", "eig_lowrank", "lanczos_norm", "batched_matvec"]


def eigh(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (ascending, ``(..., n)``) and eigenvectors (``(..., n, n)``) of symmetric
    ``M`` ``(..., n, n)`` (lower triangle read, as ``torch.linalg.eigh``), in ``M``'s dtype."""
    with threads_for(macs=M.shape[-1] ** 2):
        lam, U = torch.linalg.eigh(M.to(torch.float64))
    return lam.to(M.dtype), U.to(M.dtype)


def eigvalsh(M: torch.Tensor) -> torch.Tensor:
    """Eigenvalues (ascending, ``(..., n)``) of symmetric ``M`` ``(..., n, n)``, in ``M``'s dtype."""
    with threads_for(macs=M.shape[-1] ** 2):
        return torch.linalg.eigvalsh(M.to(torch.float64)).to(M.dtype)


def norm2(M: torch.Tensor) -> float:
    """The spectral norm (largest singular value) of a matrix ``(m, n)``; 0.0 for an empty one."""
    if M.numel() == 0:
        return 0.0
    with threads_for(macs=M.shape[-2] * M.shape[-1]):
        return float(torch.linalg.matrix_norm(M.to(torch.float64), ord=2))


def rel_error(A: torch.Tensor, B: torch.Tensor, scale: float | None = None) -> float:
    """``‖A − B‖_F / scale``, ``scale`` defaulting to ``‖B‖_F``: the relative Frobenius error of
    ``A`` against the reference ``B`` (tensors of the same shape, any number of dimensions, any
    floating dtypes; the norms are accumulated in float64). Give ``scale`` to measure against
    another norm, e.g. a block's error against the whole matrix's norm.

    Returns 0.0 when ``A`` equals ``B`` (two zero tensors included) and ``inf`` when the scale is 0
    and they differ. Raises ``ValueError`` when the shapes differ, or for a negative or non-finite
    ``scale``.
    """
    if A.shape != B.shape:
        raise ValueError(f"rel_error: A has shape {tuple(A.shape)} and the reference B {tuple(B.shape)}; expected the same")
    if scale is not None and not (math.isfinite(scale) and scale >= 0):
        raise ValueError(f"rel_error: scale must be a finite number >= 0, got {scale!r}")
    diff = float(torch.linalg.vector_norm(A - B, dtype=torch.float64))
    den = float(torch.linalg.vector_norm(B, dtype=torch.float64)) if scale is None else float(scale)
    if den == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / den


# ----------------------------------------------------------------------------- low rank


RANGE_PROBE, CHECK_PROBE = 16, 8  # first width of the random range sketch, and the columns that check it
RANGE_SLACK = 4  # a sketch of p columns is trusted only if it finds at most p - RANGE_SLACK directions


def _kept(lam: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """Which eigenvalues ``lam`` ``(B, k)`` stand above ``tol`` ``(B, 1)`` times their own matrix's largest."""
    return lam.abs() > tol * lam.abs().amax(-1, keepdim=True)


def eig_lowrank(M: torch.Tensor, rel: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Eigenpairs ``(lam (B, R), W (B, m, R))`` of the symmetric matrices ``M`` ``(B, m, m)``
    (float32 or float64; results in ``M``'s dtype and device) that stand above rounding, each
    matrix judged on its own. Used for a callable loss's per-sequence Hessians w.r.t. the block
    output (:func:`blockhess.hessian`). Derived here, docs/derivations.md §7.

    Kept: :math:`|\lambda_{br}| > \sqrt m\,\epsilon\,s_b`, :math:`s_b` the largest :math:`|\lambda|`
    of matrix ``b`` (up to the range finder's blind spot below): :math:`\sqrt m\,\epsilon\,s_b` is
    the spectral norm of an ``m × m`` rounding error of relative size :math:`\epsilon` in
    :math:`M_b`. So the dropped part :math:`D_b` has :math:`\|D_b\|_2 \le \sqrt m\,\epsilon\,s_b`,
    and any sum :math:`\sum_b J_b^\top M_b J_b` built from the eigenpairs is off by at most
    :math:`\sqrt m\,\epsilon\sum_b s_b\|J_b\|_2^2`: each matrix's term to its own rounding,
    whatever the other matrices' scales or the ``J_b`` (a batch gives the mean of its
    single-sequence results to rounding, however it is split into passes). Cost, not
    error: a matrix that carries rounding noise above its own
    :math:`\sqrt m\,\epsilon\,s_b` (an absolute noise, e.g. a confidently classified sequence's
    ``diag p - p pᵀ``) keeps those noise directions. ``R`` is the largest count over the batch
    (at least 1); a matrix with fewer has zero ``lam`` in the rest.

    The range comes first, by a randomised range finder: ``Q = orth(M @ G)`` for a fixed
    Gaussian ``G`` of ``p = RANGE_PROBE`` columns, accepted when ``CHECK_PROBE`` further
    Gaussian columns ``g`` leave :math:`\|(I - QQ^\top)M_b g\| \le m\epsilon\,\|M_b\|_F`
    for every matrix, and when the small :math:`S_b = Q^\top M_b Q`, diagonalised (:func:`eigh`),
    keeps at most ``p - RANGE_SLACK`` directions in every matrix; then :math:`M_b = Q S_b Q^\top` to
    rounding. Otherwise ``p`` doubles (the wider sketch keeps the columns already multiplied,
    the check columns included, and adds fresh ones, the last ``CHECK_PROBE`` of which check it);
    from ``2p > m`` on, the full ``m × m`` eigendecomposition (why both tests, and the case they
    miss: docs/derivations.md §7). The Gaussians come from a generator seeded with 0 on the
    CPU: the same sketch on every device, and the same result on every call.
    """
    B, m, _ = M.shape
    eps = torch.finfo(M.dtype).eps
    rel = M.new_ones(B) if rel is None else rel.to(M.dtype)
    tol = math.sqrt(m) * eps * rel[:, None]  # relative size of the rounding noise's spectral norm, (B, 1)
    norms = torch.linalg.matrix_norm(M) * rel  # (B,) Frobenius, scaled
    gen = torch.Generator().manual_seed(0)  # on the CPU: the same sketch on every device
    lam = W = None
    p = RANGE_PROBE
    Y = M.new_empty(B, m, 0)  # the sketch so far: a wider one keeps its columns and adds fresh ones
    while lam is None and 2 * p <= m:
        G = torch.randn(m, p + CHECK_PROBE - Y.shape[-1], generator=gen, dtype=M.dtype).to(M.device)
        Y = torch.cat([Y, M @ G], -1)
        Q = torch.linalg.qr(Y[..., :p]).Q  # (B, m, p)
        P = Y[..., p:]  # the newest columns, independent of Q
        missed = (P - Q @ (Q.mT @ P)).norm(dim=1).amax(-1)  # (B,)
        if bool((missed <= m * eps * norms).all()):
            lam, U = eigh(Q.mT @ (M @ Q))
            keep = _kept(lam, tol)
            if int(keep.sum(-1).max()) <= p - RANGE_SLACK:
                W = Q @ U
            else:
                lam = None
        p *= 2
    if lam is None:
        lam, W = eigh(M)
        keep = _kept(lam, tol)
    R = max(int(keep.sum(-1).max()), 1)
    order = (lam.abs() * keep).argsort(-1, descending=True)[:, :R]
    return (lam * keep).gather(1, order), W.gather(2, order[:, None, :].expand(B, m, R))


# ----------------------------------------------------------------------------- Lanczos


def batched_matvec(A: torch.Tensor, q: torch.Tensor, per_sample: bool | None = None) -> torch.Tensor:
    """``A[b] @ q[b]`` for ``A`` ``(B, n, n)``, ``q`` ``(B, n)``: ``(B, n)``. ``per_sample`` (default: on
    the CPU) one GEMV each, faster there than a batched ``bmm``; else one ``bmm`` (on a GPU one
    kernel, not one launch per matrix)."""
    if A.device.type == "cpu" if per_sample is None else per_sample:
        return torch.stack([A[b] @ q[b] for b in range(A.shape[0])])
    return torch.bmm(A, q[:, :, None])[..., 0]


def lanczos_norm(matvec: Callable[[torch.Tensor], torch.Tensor], batch: int, n: int, iters: int, seed: int = 0,
                 tol: float = 1e-12, dtype: torch.dtype = torch.float64,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Spectral-norm estimates of ``batch`` symmetric ``n × n`` operators given by their products:
    ``(theta (batch,), residual (batch,))`` in ``dtype`` on ``device``.

    ``matvec(Q)`` returns ``A_b q_b`` for each row ``q_b`` of ``Q`` ``(batch, n)`` (e.g.
    :func:`batched_matvec` of a stack of matrices). Lanczos with full reorthogonalisation (twice,
    Kahan), batched, from a Gaussian start (a CPU generator seeded with ``seed``: the same draws
    on every device), for at most ``iters`` steps, stopping early once every extreme Ritz value has
    a residual below ``tol`` times itself (checked every 4 steps from the 8th). An invariant
    subspace found early is continued from a fresh vector orthogonal to it. ``theta`` is the
    largest :math:`|\theta|` over the Ritz values, never above :math:`\|A_b\|_2`; ``residual``
    :math:`|\beta_m y_m|` bounds the distance from :math:`\theta` to *some* eigenvalue, not
    necessarily the extreme one. No input checks (kernel: ``iters >= 1``, ``n >= 1``).
    Source: standard Lanczos (Golub & Van Loan, *Matrix Computations*, §10.1).
    """
    m, Bn = int(iters), int(batch)
    tiny = torch.finfo(dtype).tiny
    gen = torch.Generator().manual_seed(int(seed))  # on the CPU: the same draws on every device

    def draw():
        return torch.randn(Bn, n, generator=gen, dtype=dtype).to(device)

    def orth(w, Qj):  # twice is enough (Kahan)
        for _ in range(2):
            w = w - (Qj.transpose(1, 2) @ (Qj @ w[..., None]))[..., 0]
        return w

    q = draw()
    Q = torch.zeros(Bn, m + 1, n, dtype=dtype, device=device)
    Q[:, 0] = q / q.norm(dim=1, keepdim=True)
    alpha = torch.zeros(Bn, m, dtype=dtype, device=device)
    beta = torch.zeros(Bn, m, dtype=dtype, device=device)
    scale = torch.zeros(Bn, dtype=dtype, device=device)  # running max of |alpha|, beta: ~ ||A||

    def ritz(j):  # extreme Ritz value and its residual after j steps
        T = torch.diag_embed(alpha[:, :j]) + torch.diag_embed(beta[:, : j - 1], 1) + torch.diag_embed(beta[:, : j - 1], -1)
        theta, Y = eigh(T)
        idx = theta.abs().argmax(-1, keepdim=True)
        return theta.abs().gather(1, idx)[:, 0], (beta[:, j - 1] * Y[:, -1, :].gather(1, idx)[:, 0]).abs()

    for j in range(m):
        w = matvec(Q[:, j])
        alpha[:, j] = (w * Q[:, j]).sum(1)
        w = orth(w, Q[:, : j + 1])
        bj = w.norm(dim=1)
        scale = torch.maximum(scale, torch.maximum(alpha[:, j].abs(), bj))
        dead = bj <= n * torch.finfo(dtype).eps * scale
        if bool(dead.any()):  # invariant subspace found: continue with a fresh orthogonal vector
            r = orth(draw(), Q[:, : j + 1])
            w = torch.where(dead[:, None], r / r.norm(dim=1, keepdim=True).clamp_min(tiny), w / bj.clamp_min(tiny)[:, None])
            bj = torch.where(dead, torch.zeros_like(bj), bj)
        else:
            w = w / bj[:, None]
        beta[:, j] = bj
        Q[:, j + 1] = w
        if j + 1 >= 8 and (j + 1) % 4 == 0 and j + 1 < m:
            theta, res = ritz(j + 1)
            if bool((res <= tol * theta.clamp_min(tiny)).all()):
                m = j + 1
                break
    return ritz(m)
