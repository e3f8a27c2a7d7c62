r"""LayerNorm over the last axis and its derivatives w.r.t. its input (Theorems 2 and 3).

:math:`\mathrm{LN}(x)_a = \gamma_a\, y_a + \beta_a`, :math:`y = m/\sigma`, :math:`m = Cx`,
:math:`C = I - \mathbf 1\mathbf 1^\top/d`, :math:`\sigma = \sqrt{m^\top m/d + \varepsilon}`
(biased variance). Every token is normalised on its own, so the paper's Jacobian
(Theorem 2, ``(L·d, L·d)``) is block-diagonal over tokens and its Hessian (Theorem 3,
``((L·d)², L·d)``) is non-zero only where output and both inputs share a token. The
per-token closed forms (paper §2.4–2.5, equivalent to the P·M Kronecker forms):

.. math::
    J_t = \mathrm{diag}(\gamma)\,\frac{1}{\sigma_t}\Big(C - \frac{y_t y_t^\top}{d}\Big),\qquad
    \frac{\partial^2 \mathrm{LN}_a}{\partial x_b \partial x_c} = -\frac{\gamma_a}{d\sigma_t^2}
    \Big(y_c C_{ab} + y_b C_{ac} + y_a C_{bc} - \frac{3 y_a y_b y_c}{d}\Big).

Both hold for ``eps >= 0``; with ``eps = 0`` each row needs non-zero variance (Assumption 2).

RMSNorm (Llama; :math:`y = x/\sigma`, :math:`\sigma = \sqrt{x^\top x/d + \varepsilon}`) is the same map
without the centring, :math:`C \to I`: every formula below holds with ``C = I`` (docs/derivations.md
§20). The kernels :func:`normalise`, :func:`tangent`, :func:`adjoint` and :func:`second_adjoint` take it
as ``center=False``.
The public functions check every row as :func:`~blockhess.validation.check_ln_variance` does:
``var + eps`` must stand above the rounding of the row's values (else the normalised entries
carry no correct digit) and above ``tiny/e`` (else ``1/sigma^2`` overflows); and their results
must be finite (:func:`~blockhess.validation.check_result`). Derived in docs/derivations.md §3.
"""

from __future__ import annotations

import functools
import math

import torch

from ..validation import check_eps, check_fits, check_ln_variance, check_result, check_tensor
from .linear import add

__all__ = ["forward", "jacobian", "hessian", "contract_hessian",
           # kernels without checks, for the block (blockhess.block) and the FFN
           "normalise", "affine", "per_token_jacobian", "contract_hessian_unchecked",
           # directional derivatives, for a matrix-free product (docs/derivations.md §18)
           "tangent", "affine_tangent", "adjoint", "second_adjoint"]


def _stats(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(var, mean)`` of the rows (biased variance), each ``(..., 1)``."""
    return torch.var_mean(X, -1, correction=0, keepdim=True)


def rms_stats(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean(x²), 0)`` of the rows, each ``(..., 1)``: the :func:`_stats` of RMSNorm (no centring), as
    :func:`~blockhess.validation.check_ln_variance` reads them."""
    ms = X.pow(2).mean(-1, keepdim=True)
    return ms, torch.zeros_like(ms)


def normalise(X: torch.Tensor, eps: float, stats=None, center: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, r)``: the normalised rows ``(..., d)`` of ``X`` ``(..., d)`` and their inverse std
    ``r = 1/sigma = (var + eps)^(-1/2)``, ``(..., 1)`` (biased variance); ``stats``: the rows'
    ``(var, mean)``, each ``(..., 1)``, if already computed. ``center=False``: RMSNorm,
    ``y = x (mean(x²) + eps)^(-1/2)`` (``stats`` then :func:`rms_stats`'s). No checks (kernel)."""
    var, mean = (_stats(X) if center else rms_stats(X)) if stats is None else stats
    r = torch.rsqrt(var + eps if eps else var)
    return (X - mean) * r, r


def _centering(d: int, like: torch.Tensor) -> torch.Tensor:
    """``C = I - 11^T/d`` in ``like``'s dtype and device: one shared tensor, never written to."""
    return _centering_cached(d, like.dtype, like.device)


@functools.lru_cache(maxsize=32)
def _centering_cached(d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # a plain tensor even if first asked for in inference mode
        return torch.eye(d, dtype=dtype, device=device) - 1.0 / d


def forward(X: torch.Tensor, eps: float = 0.0, gamma=None, beta=None) -> torch.Tensor:
    """LayerNorm of the rows of ``X`` (shape ``(..., d)``), same shape and dtype; ``gamma``,
    ``beta`` of shape ``(d,)`` or ``None``.

    Raises ``ValueError`` as :func:`jacobian` (``X`` of any shape ``(..., d)``), for ``beta``
    of the wrong shape, dtype or device, and for an output with a NaN or Inf (``gamma * y``
    overflowing).
    """
    stats = _check(X, eps, gamma, dense=False)
    if beta is not None:
        check_tensor("beta", beta, ndim=(1,), like=X)
        if beta.shape[0] != X.shape[-1]:
            raise ValueError(f"beta must have shape ({X.shape[-1]},), got {tuple(beta.shape)}")
    out = affine(normalise(X, eps, stats)[0], gamma, beta)
    check_result({"the LayerNorm output": out})
    return out


def affine(y: torch.Tensor, gamma=None, beta=None) -> torch.Tensor:
    """``gamma * y + beta`` for ``y`` ``(..., d)``, ``gamma``, ``beta`` ``(d,)`` (either may be ``None``)."""
    if gamma is not None:
        y = y * gamma
    return y if beta is None else y + beta


def per_token_jacobian(y: torch.Tensor, r: torch.Tensor, gamma=None, center: bool = True) -> torch.Tensor:
    """Theorem 2 per token from :func:`normalise`'s ``(y, r)``: ``(..., d, d)``, rows scaled by
    ``gamma`` ``(d,)`` if given; ``center=False``: RMSNorm's, ``r (I - y yᵀ/d)``. No checks (kernel)."""
    d = y.shape[-1]
    C = _centering(d, y) if center else torch.eye(d, dtype=y.dtype, device=y.device)
    J = torch.addcmul(C, y[..., :, None], y[..., None, :], value=-1.0 / d) * r[..., None]
    return J if gamma is None else gamma[:, None] * J


def _compact_jacobian(X, eps, gamma, stats=None):
    return per_token_jacobian(*normalise(X, eps, stats), gamma)


def _compact_hessian(X, eps, gamma, stats=None):
    y, r = normalise(X, eps, stats)
    d = X.shape[-1]
    C = _centering(d, X)
    ya, yb, yc = y[..., :, None, None], y[..., None, :, None], y[..., None, None, :]
    H = yc * C[:, :, None] + yb * C[:, None, :] + ya * C[None, :, :] - 3 * ya * yb * yc / d
    H = H * (r[..., None, None] ** 2 / -d)
    return H if gamma is None else gamma[:, None, None] * H


def contract_hessian_unchecked(X: torch.Tensor, G: torch.Tensor, eps: float = 0.0, gamma=None,
                               center: bool = True) -> torch.Tensor:
    """:func:`contract_hessian` without checks (kernel, ``vmap``-traceable); ``center=False``: RMSNorm's (``C = I``)."""
    y, r = normalise(X, eps, center=center)
    d = X.shape[-1]
    g = G if gamma is None else G * gamma
    g_hat = g - g.mean(-1, keepdim=True) if center else g
    s = (g * y).sum(-1)[..., None, None]
    outer = g_hat[..., :, None] * y[..., None, :]
    C = _centering(d, X) if center else torch.eye(d, dtype=X.dtype, device=X.device)
    Gam = outer + outer.transpose(-1, -2) + s * (C - 3 * y[..., :, None] * y[..., None, :] / d)
    return Gam * (r[..., None] ** 2 / -d)


def _check(X, eps, gamma, dense: bool):
    """Validate the arguments (shapes first, then values); returns :func:`_stats` of ``X``
    (the variance check needs them)."""
    check_tensor("X", X, finite=False)  # a NaN or Inf makes a row's variance non-finite: check_ln_variance
    if X.ndim < (2 if dense else 1) or X.shape[-1] < 1 or (dense and X.shape[-2] < 1):
        raise ValueError(f"X must have shape (..., L, d) with L >= 1 and d >= 1{' for the dense layout' if dense else ''}, "
                         f"got {tuple(X.shape)}")
    check_eps("eps", eps)
    if gamma is not None:
        check_tensor("gamma", gamma, ndim=(1,), like=X)
        if gamma.shape[0] != X.shape[-1]:
            raise ValueError(f"gamma must have shape ({X.shape[-1]},), got {tuple(gamma.shape)}")
    stats = _stats(X)
    check_ln_variance("X", X, eps, stats)
    return stats


def contract_hessian(X: torch.Tensor, G: torch.Tensor, eps: float = 0.0, gamma=None) -> torch.Tensor:
    r"""Per-token contraction :math:`\Gamma_t = \sum_a G_{ta}\,\partial^2\mathrm{LN}_{ta}/\partial x_t^2`.

    ``X`` and ``G`` of shape ``(..., d)``; returns ``(..., d, d)``, symmetric:
    :math:`\Gamma = -\frac{1}{d\sigma^2}\big(\hat g y^\top + y\hat g^\top + s\,C - 3 s\, y y^\top/d\big)`,
    :math:`\tilde g = \gamma\odot G`, :math:`\hat g = C\tilde g`, :math:`s = \tilde g^\top y`.
    Derived here from Theorem 3 (docs/derivations.md).

    Raises ``ValueError`` as :func:`jacobian` for ``X``, ``eps`` and ``gamma`` (``X`` of any
    shape ``(..., d)``), for ``G`` not a finite float tensor of ``X``'s shape, dtype and device,
    and for a result with a NaN or Inf.
    """
    _check(X, eps, gamma, dense=False)
    check_tensor("G", G, like=X)
    if G.shape != X.shape:
        raise ValueError(f"G must have the shape of X {tuple(X.shape)}, got {tuple(G.shape)}")
    Gam = contract_hessian_unchecked(X, G, eps, gamma)
    check_result({"the contracted LayerNorm Hessian": Gam})
    return Gam


def _checked_per_token(X: torch.Tensor, eps, gamma, compact: bool, order: int, what: str) -> torch.Tensor:
    """The checked per-token derivatives of ``order`` 1 (``(..., L, d, d)``) or 2 (``(..., L, d, d, d)``):
    arguments checked, memory checked before they are made (the per-token blocks with one temporary
    of their size for the Jacobian, three for the Hessian, plus the dense ``(..., (L·d)^{order+1})``
    layout unless ``compact``), the result checked finite."""
    stats = _check(X, eps, gamma, dense=not compact)
    d, L, e = X.shape[-1], X.shape[-2], X.element_size()
    per_token = 2 * order * X.numel() * d**order * e
    if compact:
        check_fits(per_token, f"the per-token LayerNorm {what}s", X.device)
    else:
        check_fits(math.prod(X.shape[:-2]) * (L * d) ** (order + 1) * e + per_token, f"the dense LayerNorm {what}",
                   X.device)
    D = (_compact_jacobian if order == 1 else _compact_hessian)(X, eps, gamma, stats)
    check_result({f"the LayerNorm {what}": D})  # the per-token blocks: the dense layout adds only zeros
    return D


def jacobian(X: torch.Tensor, eps: float = 0.0, gamma=None, compact: bool = False) -> torch.Tensor:
    r"""Jacobian of LayerNorm w.r.t. its input ``X`` of shape ``(..., L, d)`` (Theorem 2).

    Returns ``(..., L, d, d)`` with ``[t, a, b] = ∂LN_ta/∂X_tb`` if ``compact``, else the
    paper's dense ``∂vec_r LN/∂vec_r X`` of shape ``(..., L·d, L·d)`` (block-diagonal).
    dtype and device of ``X``. ``gamma`` (shape ``(d,)``) scales the output rows; a shift
    ``beta`` does not enter the derivative.

    Raises
    ------
    ValueError
        ``X`` not floating or with NaN/Inf; ``eps < 0``; ``gamma`` of the wrong shape,
        dtype or device; a row whose ``var + eps`` does not stand above its values' rounding
        and ``tiny/e`` (with ``eps = 0``: zero or underflowing variance, Assumption 2;
        :func:`~blockhess.validation.check_ln_variance`); a result with a NaN or Inf (e.g. a
        large ``gamma`` times ``1/sigma^2``).
    InsufficientMemoryError
        The result would not fit in available memory with the per-token Jacobians and one
        temporary of their size (bytes in the message); checked before they are made.
    """
    J = _checked_per_token(X, eps, gamma, compact, 1, "Jacobian")
    if compact:
        return J
    batch, L, d = X.shape[:-2], X.shape[-2], X.shape[-1]
    J = J.reshape(-1, L, d, d)
    dense = X.new_zeros(J.shape[0], L, d, L, d)
    torch.diagonal(dense, 0, 1, 3).copy_(J.permute(0, 2, 3, 1))  # the token-diagonal blocks
    return dense.reshape(*batch, L * d, L * d)


def hessian(X: torch.Tensor, eps: float = 0.0, gamma=None, compact: bool = False) -> torch.Tensor:
    r"""Second derivative of LayerNorm w.r.t. its input ``X`` of shape ``(..., L, d)`` (Theorem 3).

    Compact: ``(..., L, d, d, d)`` with ``[t, a, b, c] = ∂²LN_ta/∂X_tb∂X_tc`` (all
    cross-token entries are zero). Dense: the paper's layout ``(..., (L·d)², L·d)``, rows
    ``(o, q)`` o-major (``o`` output index, ``q`` first input index), column the second
    input index. dtype and device of ``X``. Same errors as :func:`jacobian` (the per-token
    ``(d, d, d)`` second derivatives counted with three temporaries of their size).
    """
    H = _checked_per_token(X, eps, gamma, compact, 2, "Hessian")
    if compact:
        return H
    batch, L, d = X.shape[:-2], X.shape[-2], X.shape[-1]
    H = H.reshape(-1, L, d, d, d)
    dense = X.new_zeros(H.shape[0], L, d, L, d, L, d)
    t = torch.arange(L, device=X.device)
    dense[:, t, :, t, :, t, :] = H.transpose(0, 1)  # entries where output and both inputs share a token
    return dense.reshape(*batch, (L * d) ** 2, L * d)


def tangent(y: torch.Tensor, r: torch.Tensor, dx: torch.Tensor, center: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(dy, rho)``: the tangent of the normalised rows :math:`\dot y = J\dot x = r(C\dot x) - y\,\rho`
    and :math:`\rho = r\,y^\top\dot x/d` (``= -\dot r/r``, the one number per token that
    :func:`second_adjoint` needs besides ``dy``), for ``dx`` ``(k, ..., d)``; ``y``, ``r`` from
    :func:`normalise` (``(..., d)``, ``(..., 1)``). ``dy`` ``(k, ..., d)``, ``rho`` ``(k, ..., 1)``.
    Any ``eps >= 0`` (it is in ``r``). ``center=False``: RMSNorm (``C = I``). Kernel: no checks."""
    d = y.shape[-1]
    rho = r * (y * dx).sum(-1, keepdim=True) / d
    out = r * ((dx - dx.mean(-1, keepdim=True)) if center else dx)
    return out.addcmul_(y, rho, value=-1), rho


def affine_tangent(y: torch.Tensor, dy=None, gamma=None, dgamma=None, dbeta=None):
    r"""The tangent of :math:`\gamma\odot y + \beta`: :math:`\gamma\odot\dot y + \dot\gamma\odot y + \dot\beta`,
    ``(k, ..., d)``, or ``None`` when every direction is ``None``. ``y`` ``(..., d)``; ``dy``
    ``(k, ..., d)``; ``gamma`` ``(d,)`` or ``None`` (1); ``dgamma``, ``dbeta`` ``(k, d)``. Kernel."""
    lead = (1,) * (y.ndim - 1)  # a direction (k, d) broadcast over the tokens
    out = add(None if dy is None else (dy if gamma is None else dy * gamma),
              None if dgamma is None else dgamma.reshape(-1, *lead, y.shape[-1]) * y,
              None if dbeta is None else dbeta.reshape(-1, *lead, y.shape[-1]))
    return None if out is None else out.expand(out.shape[0], *y.shape)  # a shift alone: every token's


def adjoint(y: torch.Tensor, r: torch.Tensor, g: torch.Tensor, gamma=None, center: bool = True) -> torch.Tensor:
    r"""The input adjoint :math:`g_x = J^\top(\gamma\odot g) = r\,(C g_y - y\,y^\top g_y/d)`,
    :math:`g_y = \gamma\odot g`, of the output adjoint ``g`` (any leading axes, ``y``'s last, ``d``);
    ``J`` is symmetric. ``center=False``: RMSNorm (``C = I``). Kernel: no checks."""
    gy = g if gamma is None else g * gamma
    d = y.shape[-1]
    s = (y * gy).sum(-1, keepdim=True) / d
    return torch.addcmul((gy - gy.mean(-1, keepdim=True)) if center else gy, y, s, value=-1).mul_(r)


def second_adjoint(y: torch.Tensor, r: torch.Tensor, g, g_x, dg, dy=None, rho=None, gamma=None, dgamma=None,
                   second: bool = True, want_input: bool = True, variables: tuple[bool, bool] = (False, False),
                   center: bool = True):
    r"""``(dg_x, hv_gamma, hv_beta)``: the tangent of the input adjoint and the scale's and shift's rows
    of the Hessian-vector product, for :math:`\mathrm{out} = \gamma\odot y + \beta`, :math:`y = \mathrm{norm}(x)`.

    .. math::
        \dot g_y = \gamma\odot\dot g + [\dot\gamma\odot g],\qquad
        \dot g_x = J\dot g_y + [-\rho\, g_x - r\,(\dot y\, y^\top g_y + y\,\dot y^\top g_y)/d],

        (Hv)_\gamma = \textstyle\sum \dot g\odot y + [\sum g\odot\dot y],\qquad (Hv)_\beta = \sum\dot g,

    the bracket :math:`\dot J g_y = \Gamma\dot x` (:func:`contract_hessian`'s curvature applied to
    :math:`\dot x` without forming it; docs/derivations.md §18). ``y``, ``r`` from :func:`normalise`
    (``(T, d)``, ``(T, 1)``, tokens flattened); ``g`` ``(T, d)`` the cached output adjoint and ``g_x``
    its :func:`adjoint` (read only with ``second``); ``dg`` ``(k, T, d)`` or ``None``; ``dy``, ``rho``
    from :func:`tangent` (``None``: no input tangent); ``gamma`` ``(d,)`` or ``None``, ``dgamma``
    ``(k, d)`` or ``None``. ``variables``: whether ``(gamma, beta)`` are variables (else their rows
    are ``None``). ``second=False``: the Gauss–Newton product (no bracketed term). Each result is
    ``None`` when zero (``dg_x`` also with ``want_input=False``). ``center=False``: RMSNorm (``C = I``;
    the bracket is the same, docs/derivations.md §20). Kernel: no checks."""
    d = y.shape[-1]
    dg_y = None if dg is None else (dg if gamma is None else dg * gamma)
    if second and dgamma is not None:
        dg_y = add(dg_y, dgamma[:, None, :] * g)
    dg_x = None
    if want_input:
        dg_x = None if dg_y is None else adjoint(y, r, dg_y, center=center)
        if second and dy is not None:  # the bracket formed in place: r/d folded into the per-token sums
            gy = g if gamma is None else g * gamma
            rd = r / d
            t = dy * ((y * gy).sum(-1, keepdim=True) * rd)
            t.addcmul_(y, (dy * gy).sum(-1, keepdim=True) * rd).addcmul_(rho, g_x)
            dg_x = t.neg_() if dg_x is None else dg_x.sub_(t)
    hv_gamma = hv_beta = None
    if variables[0]:
        hv_gamma = add(None if dg is None else (dg * y).sum(1), (g * dy).sum(1) if second and dy is not None else None)
    if variables[1] and dg is not None:
        hv_beta = dg.sum(1)
    return dg_x, hv_gamma, hv_beta
