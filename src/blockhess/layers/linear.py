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
"""

from __future__ import annotations

import torch

__all__ = ["tangent", "adjoint", "second_adjoint", "add"]


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


def tangent(x: torch.Tensor, W: torch.Tensor, dx=None, dW=None, db=None):
    r""":math:`\dot y = \dot x W + x \dot W + \dot b`, ``(k, ..., d_out)``, or ``None`` when every
    direction is ``None``. ``x`` ``(..., d_in)``; ``dx`` ``(k, ..., d_in)``, ``dW`` ``(k, d_in, d_out)``,
    ``db`` ``(k, d_out)``, each optional."""
    d_in, d_out = W.shape
    out = None if dx is None else dx @ W
    if dW is not None:
        xW = torch.einsum("td,kde->kte", _tokens(x, d_in), dW).reshape(dW.shape[0], *x.shape[:-1], d_out)
        out = add(out, xW)
    if db is not None:
        out = add(out, db.reshape(db.shape[0], *([1] * (x.ndim - 1)), d_out))
        out = out.expand(db.shape[0], *x.shape[:-1], d_out)  # a bias alone: the same row for every token
    return out


def adjoint(W: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The input adjoint :math:`g_x = g W^\\top` of the output adjoint ``g`` ``(..., d_out)``: ``(..., d_in)``."""
    return g @ W.T


def second_adjoint(x: torch.Tensor, W: torch.Tensor, g, dg, dx=None, dW=None, second: bool = True,
                   want_input: bool = True, bias: bool = False, weight: bool = True):
    r"""``(dg_x, hv_W, hv_b)``: the tangent of the input adjoint :math:`\dot g W^\top + [g\dot W^\top]`
    ``(k, ..., d_in)`` (``None`` with ``want_input=False`` or when zero), with ``weight`` the weight's
    rows of the product :math:`\sum x^\top\dot g + [\sum\dot x^\top g]` ``(k, d_in, d_out)``, and with
    ``bias`` the bias's :math:`\sum\dot g` ``(k, d_out)`` (each ``None`` when zero or not asked: a row
    not asked costs nothing, its GEMMs are skipped).

    ``x`` ``(..., d_in)`` the cached input, ``g`` ``(..., d_out)`` the cached first-order adjoint at
    the output (only read with ``second``), ``dg`` ``(k, ..., d_out)`` its tangent or ``None``;
    ``dx``, ``dW`` the input's and the weight's directions, as for :func:`tangent`. ``second=False``
    drops the bracketed (functional) terms: the Gauss–Newton product."""
    d_in, d_out = W.shape
    dg_x = hv_W = hv_b = None
    if want_input:
        dg_x = None if dg is None else dg @ W.T
        if second and dW is not None:
            gW = torch.einsum("te,kde->ktd", _tokens(g, d_out), dW).reshape(dW.shape[0], *g.shape[:-1], d_in)
            dg_x = add(dg_x, gW)
    if dg is not None:
        k = dg.shape[0]
        if weight:
            hv_W = torch.einsum("td,kte->kde", _tokens(x, d_in), dg.reshape(k, -1, d_out))
        if bias:
            hv_b = dg.reshape(k, -1, d_out).sum(1)
    if weight and second and dx is not None:
        k = dx.shape[0]
        hv_W = add(hv_W, torch.einsum("ktd,te->kde", dx.reshape(k, -1, d_in), _tokens(g, d_out)))
    return dg_x, hv_W, hv_b
