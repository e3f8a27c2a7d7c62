r"""The affine map :math:`y = xW + b` (the attention's projections ``W_Q, W_K, W_V, W_O``, the FFN's
``W_1, W_2``): its tangent and its second-order adjoint, for a matrix-free Hessian-vector product.

Row vectors act on the right (DESIGN.md §1): ``x`` ``(..., d_in)``, ``W`` ``(d_in, d_out)``, the token
axes ``...`` summed over in the weight's adjoints. Directions carry a leading axis of ``k`` vectors:
``dx`` ``(k, ..., d_in)``, ``dW`` ``(k, d_in, d_out)``, ``db`` ``(k, d_out)``; ``None`` is a zero direction
(nothing is computed for it). The formulas (product rule; docs/derivations.md §18):

.. math::
    \dot y = \dot x W + x\dot W + \dot b;\qquad g_x = g W^\top,\ g_W = \textstyle\sum x^\top g,\ g_b = \sum g;

    \dot g_x = \dot g W^\top + [g\dot W^\top],\qquad (Hv)_W = \textstyle\sum x^\top \dot g + [\sum \dot x^\top g],
    \qquad (Hv)_b = \textstyle\sum \dot g,

``g`` the first-order adjoint at ``y`` (the back-propagated gradient, cached once), :math:`\dot g` its
tangent; the bracketed terms are the second-order (functional) ones, kept with ``second=True``.
The map is linear in ``x`` and in ``W``: its own second derivative is the bilinear cross term alone.
Not a :class:`~blockhess.layers.protocol.Layer` (no cache, no Kronecker factors of its own: the layers
that use it hold its input). No checks (kernels).

An input that is a LayerNorm's output :math:`x = n\odot\gamma + \beta` with fixed normalised rows
``n`` (nothing below the LayerNorm moves: :math:`\dot x = n\odot\dot\gamma + \dot\beta`) can be
passed as a :class:`Scaled` ``dx``: the tangent is then one product
:math:`n(\gamma\odot\dot W + \dot\gamma\odot W) + \beta\dot W + \dot\beta W + \dot b`, the weight's
rows :math:`\gamma\odot(n^\top\dot g) + \beta\otimes\sum\dot g + [\dot\gamma\odot(n^\top g) +
\dot\beta\otimes\sum g]` read the cached :func:`moments` of ``g``, and instead of :math:`\dot g_x`
the second-order adjoint returns the two sums the LayerNorm's rows need, :math:`\sum\dot g_x\odot n`
and :math:`\sum\dot g_x`, without forming :math:`\dot g_x` (docs/derivations.md §18, "A LayerNorm
below nothing that moves").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import gemm

__all__ = ["tangent", "adjoint", "second_adjoint", "add", "Scaled", "moments"]


class Scaled(NamedTuple):
    r"""An input :math:`x = n\odot\gamma + \beta` whose tangent along ``k`` directions is
    :math:`\dot x = n\odot\dot\gamma + \dot\beta` (a LayerNorm's output with nothing moving below
    it), passed as ``dx`` to :func:`tangent` and :func:`second_adjoint`. ``n`` ``(T, d_in)`` (tokens
    flattened, the order of ``x``'s), ``gamma``, ``beta`` ``(d_in,)`` or ``None`` (1, 0),
    ``dgamma``, ``dbeta`` ``(k, d_in)`` or ``None`` (zero; both ``None``: :math:`\dot x = 0`)."""

    n: torch.Tensor
    gamma: torch.Tensor | None
    beta: torch.Tensor | None
    dgamma: torch.Tensor | None
    dbeta: torch.Tensor | None


def add(*terms):
    """The sum of the tensors among ``terms`` that are not ``None`` (``None`` if all are): a sum of
    directions where ``None`` is a zero direction."""
    out = None
    for t in terms:
        if t is not None:
            out = t if out is None else out + t
    return out


def _tokens(x: torch.Tensor, d: int) -> torch.Tensor:
    return x.reshape(-1, d)


def moments(n: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(nᵀg, Σ g)``: ``(d_in, d_out)`` and ``(d_out,)`` for the rows ``n`` ``(T, d_in)`` of a
    :class:`Scaled` input and the map's output adjoint ``g`` (``(..., d_out)``, ``T`` tokens): what
    :func:`second_adjoint` reads for such an input, once per operator."""
    g = g.reshape(-1, g.shape[-1])
    return n.T @ g, g.sum(0)


def _scaled_tangent(s: Scaled, W: torch.Tensor, lead: tuple, dW, db):
    """:func:`tangent` for a :class:`Scaled` input: one product ``n (γ ⊙ Ẇ + γ̇ ⊙ W)`` and a row
    ``β Ẇ + β̇ W + ḃ``."""
    d_in, d_out = W.shape
    M = add(None if dW is None else (dW if s.gamma is None else s.gamma[:, None] * dW),
            None if s.dgamma is None else s.dgamma[:, :, None] * W)
    row = add(None if dW is None or s.beta is None else torch.einsum("d,kde->ke", s.beta, dW),
              None if s.dbeta is None else s.dbeta @ W, db)
    if M is None:
        if row is None:
            return None
        return row.reshape(row.shape[0], *([1] * len(lead)), d_out).expand(row.shape[0], *lead, d_out)
    k = M.shape[0]
    out = torch.matmul(s.n, M) if row is None else torch.baddbmm(row[:, None, :], s.n.expand(k, -1, -1), M)
    return out.reshape(k, *lead, d_out)


def tangent(x: torch.Tensor, W: torch.Tensor, dx=None, dW=None, db=None):
    r""":math:`\dot y = \dot x W + x \dot W + \dot b`, ``(k, ..., d_out)``, or ``None`` when every
    direction is ``None``. ``x`` ``(..., d_in)``; ``dx`` ``(k, ..., d_in)`` or a :class:`Scaled` (``x``
    its :math:`n\odot\gamma + \beta`), ``dW`` ``(k, d_in, d_out)``, ``db`` ``(k, d_out)``, each optional."""
    d_in, d_out = W.shape
    if isinstance(dx, Scaled):
        return _scaled_tangent(dx, W, tuple(x.shape[:-1]), dW, db)
    if dx is None and dW is None:
        if db is None:
            return None
        return db.reshape(db.shape[0], *([1] * (x.ndim - 1)), d_out).expand(db.shape[0], *x.shape[:-1], d_out)
    k = (dx if dx is not None else dW).shape[0]
    out = None
    if dx is not None:  # ẋ W: one GEMM over every direction's rows (the weight is shared)
        out = gemm.mm(dx.reshape(-1, d_in), W).view(k, -1, d_out)
    if dW is not None:  # x Ẇ: one product per direction, added to the first
        out = gemm.mm_each(_tokens(x, d_in), dW, out)
    if db is not None:
        out.add_(db[:, None, :])
    return out.reshape(k, *x.shape[:-1], d_out)


def adjoint(W: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The input adjoint :math:`g_x = g W^\\top` of the output adjoint ``g`` ``(..., d_out)``: ``(..., d_in)``."""
    return g @ W.T


def second_adjoint(x: torch.Tensor, W: torch.Tensor, g, dg, dx=None, dW=None, second: bool = True,
                   want_input: bool = True, bias: bool = False, weight: bool = True, moments=None, out=None):
    r"""``(dg_x, hv_W, hv_b)``: the tangent of the input adjoint :math:`\dot g W^\top + [g\dot W^\top]`
    ``(k, ..., d_in)`` (``None`` with ``want_input=False`` or when zero), with ``weight`` the weight's
    rows of the product :math:`\sum x^\top \dot g + [\sum\dot x^\top g]` ``(k, d_in, d_out)``, and with
    ``bias`` the bias's :math:`\sum\dot g` ``(k, d_out)`` (each ``None`` when zero or not asked: a row
    not asked costs nothing, its GEMMs are skipped).

    ``x`` ``(..., d_in)`` the cached input, ``g`` ``(..., d_out)`` the cached first-order adjoint at
    the output (only read with ``second``), ``dg`` ``(k, ..., d_out)`` its tangent or ``None``;
    ``dx``, ``dW`` the input's and the weight's directions, as for :func:`tangent`. ``second=False``
    drops the bracketed (functional) terms: the Gauss–Newton product. With a :class:`Scaled` ``dx``,
    ``moments`` is :func:`moments` of its ``n`` and ``g`` (read only with ``second``; ``g`` itself is
    not read), and ``dg_x`` is replaced by the pair :math:`(\sum\dot g_x\odot n, \sum\dot g_x)`
    ``(k, d_in)`` each (``None`` where zero; the pair ``None`` with ``want_input=False``). ``out``: a
    contiguous ``(k, d_in, d_out)`` tensor the weight's rows are written into where they are one product
    (then ``hv_W`` is ``out``; a caller's destination, e.g. a slice of an operator's output), else unused."""
    if isinstance(dx, Scaled):
        return _scaled_second_adjoint(dx, W, moments, dg, dW, second, want_input, bias, weight)
    d_in, d_out = W.shape
    dg_x = hv_W = hv_b = None
    if want_input:
        dg_x = None if dg is None else gemm.mm(dg.reshape(-1, d_out), W.T).reshape(*dg.shape[:-1], d_in)
        if second and dW is not None:
            k = dW.shape[0]
            acc = None if dg_x is None else dg_x.reshape(k, -1, d_in)
            dg_x = gemm.mm_each(_tokens(g, d_out), dW.mT, acc).reshape(k, *g.shape[:-1], d_in)
    if dg is not None and bias:
        hv_b = dg.reshape(dg.shape[0], -1, d_out).sum(1)
    if weight:
        both = dg is not None and second and dx is not None
        if both:  # xᵀ ġ + ẋᵀ g: two products into one result, x and g never copied (derivations §18)
            k = dg.shape[0]
            hv_W = torch.matmul(_tokens(x, d_in).T, dg.reshape(k, -1, d_out), out=out)
            hv_W.baddbmm_(dx.reshape(k, -1, d_in).mT, _tokens(g, d_out).expand(k, -1, -1))
        elif dg is not None:
            hv_W = torch.matmul(_tokens(x, d_in).T, dg.reshape(dg.shape[0], -1, d_out), out=out)
        elif second and dx is not None:
            hv_W = torch.matmul(dx.reshape(dx.shape[0], -1, d_in).mT, _tokens(g, d_out), out=out)
    return dg_x, hv_W, hv_b


def _scaled_second_adjoint(s: Scaled, W: torch.Tensor, moments, dg, dW, second: bool, want_input: bool, bias: bool,
                           weight: bool):
    """:func:`second_adjoint` for a :class:`Scaled` input: ``nᵀġ`` is the one product; the rest reads
    the cached ``moments = (nᵀg, Σ g)``."""
    d_in, d_out = W.shape
    second = second and (s.dgamma is not None or s.dbeta is not None or dW is not None)
    if second and moments is None:
        raise ValueError("a Scaled input's second-order terms need the moments (n^T g, sum g) of its output adjoint")
    P, sum_g = moments if second else (None, None)
    ng = sum_dg = None
    if dg is not None:
        k = dg.shape[0]
        dgt = dg.reshape(k, -1, d_out)
        sum_dg = dgt.sum(1)  # (k, d_out)
        if weight or want_input:
            ng = torch.matmul(s.n.T, dgt)  # (k, d_in, d_out): nᵀġ
    hv_W = hv_b = rows = None
    if weight:
        hv_W = None
        if ng is not None:
            hv_W = ng if s.gamma is None else s.gamma[:, None] * ng
            if s.beta is not None:
                hv_W = hv_W + s.beta[:, None] * sum_dg[:, None, :]
        if second:
            hv_W = add(hv_W, None if s.dgamma is None else s.dgamma[:, :, None] * P,
                       None if s.dbeta is None else s.dbeta[:, :, None] * sum_g)
    if bias:
        hv_b = sum_dg
    if want_input:  # Σ_t ġ_x ⊙ n and Σ_t ġ_x, ġ_x = ġ Wᵀ + [g Ẇᵀ], by the sums over t first
        r_n = add(None if ng is None else (ng * W).sum(-1), (dW * P).sum(-1) if second and dW is not None else None)
        r_1 = add(None if sum_dg is None else sum_dg @ W.T, dW @ sum_g if second and dW is not None else None)
        rows = None if r_n is None and r_1 is None else (r_n, r_1)
    return rows, hv_W, hv_b
