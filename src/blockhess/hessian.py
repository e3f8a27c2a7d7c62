r"""The exact loss Hessian w.r.t. the block's weights: outer + functional term (paper eq. 10).

.. math::
    \frac{\partial^2 \ell(Z)}{\partial W_i \partial W_j}
    = \underbrace{\Big(\frac{\partial Z}{\partial W_i}\Big)^{\!\top} \nabla^2_Z\ell\;
      \frac{\partial Z}{\partial W_j}}_{\text{outer (Gauss–Newton)}}
    + \underbrace{(\nabla_Z \ell \otimes I)\,\frac{\partial^2 Z}{\partial W_i\partial W_j}}_{\text{functional}}.

The outer term uses the per-token Kronecker factors of :mod:`~blockhess.block` (a GEMM over
tokens per block pair) when :math:`\nabla^2_Z\ell` is block-diagonal over tokens (MSE, CE),
and a low-rank eigen-factorisation :math:`\nabla^2_Z\ell = W\Lambda W^\top` otherwise. The
functional term is Theorem 5 contracted with :math:`\nabla_Z\ell` (:func:`blockhess.block.contract_output`).
The paper writes the MSE functional term without its factor :math:`2/(Ld)` (§2.10, typo 10);
it is included here.
"""

from __future__ import annotations

import torch

from . import losses
from .block import _check_variance, _factors, _forward, _select, check_inputs, contract_output
from .blocks import HessianBlocks, add_block
from .config import BlockConfig, param_shapes
from .kronecker import TokenKron, sandwich

__all__ = ["hessian"]


def _outer_lowrank(J: dict[str, TokenKron], hess: torch.Tensor, names, B: int, L: int, d: int) -> dict:
    r"""Outer term for a general per-sequence loss Hessian ``hess`` of shape ``(B, L·d, L·d)``.

    :math:`\sum_b J_b^\top \Omega_b J_b = \sum_{b,r} \lambda_{br} (J_b^\top w_{br})(J_b^\top w_{br})^\top`,
    keeping eigenpairs with :math:`|\lambda| > L d\,\epsilon\max|\lambda|` (the rest are rounding
    noise of a rank-deficient matrix, e.g. a pooled classifier head has rank <= classes).
    """
    lam, W = torch.linalg.eigh(hess)
    tol = L * d * torch.finfo(hess.dtype).eps * lam.abs().amax(-1, keepdim=True)
    lam = torch.where(lam.abs() > tol, lam, torch.zeros_like(lam))
    R = max(int((lam != 0).sum(-1).max()), 1)
    order = lam.abs().argsort(-1, descending=True)[:, :R]
    lam = lam.gather(1, order)  # (B, R)
    W = W.gather(2, order[:, None, :].expand(B, L * d, R))  # (B, L*d, R)
    w = W.transpose(1, 2).reshape(B, R, L, d)
    V = {n: J[n].vjp(w) for n in names}  # (B, R, n_i)
    blocks = {}
    for i, a in enumerate(names):
        Va = (V[a] * lam[..., None]).reshape(B * R, -1)
        for b in names[i:]:
            add_block(blocks, names, a, b, Va.T @ V[b].reshape(B * R, -1))
    return blocks


def hessian(params: dict, X: torch.Tensor, cfg: BlockConfig, loss="mse", target=None, wrt=None) -> HessianBlocks:
    r"""Exact Hessian of the loss of the block's output w.r.t. its weights, by the closed form.

    Parameters
    ----------
    params : dict[str, Tensor]
        Weights as :func:`~blockhess.config.param_shapes` (``W_Q, W_K, W_V[, W_1, W_2]``).
    X : Tensor
        One sequence ``(L, d_model)`` or a batch ``(B, L, d_model)``, float32 or float64.
    cfg : BlockConfig
        ``kind="block"`` (post-LN block, Theorem 5 / eq. 10) or ``"attention"`` (Theorem 1 layer;
        the outer/functional split of Ormaniec et al.).
    loss : "mse" | "ce" | callable
        ``"mse"`` (mean over entries, the paper's), ``"ce"`` (rows of the output are logits
        over ``d_model`` classes, mean over tokens) or ``loss(Z, target) -> scalar`` applied
        to one sequence ``Z`` of shape ``(L, d_model)``. A batch's loss is the mean over
        sequences, so its Hessian is the mean of the per-sequence Hessians.
    target : Tensor or None
        MSE: shaped like ``X``; CE: integer classes ``(L,)`` or ``(B, L)``; callable: anything
        the callable takes, with a leading batch axis when ``X`` is a batch.
    wrt : str or list of str or None
        Restrict to these weights (only their blocks are computed).

    Returns
    -------
    HessianBlocks
        Blocks ``H[a, b]`` of shape ``(numel_a, numel_b)`` in ``vec_r`` order, ``.dense()``
        (``n × n``), ``.outer`` (Gauss–Newton term, PSD for convex losses) and ``.functional``.
        dtype and device of ``X``. Exact almost everywhere (ReLU kinks, Lemma 1).

    Raises
    ------
    ValueError
        Wrong shapes, mixed dtypes/devices, NaN/Inf in ``X``, ``params`` or ``target``; a
        zero-variance LayerNorm input row with ``ln_eps = 0`` (Assumption 2); an unknown loss;
        a target of the wrong shape or class range; an unknown name in ``wrt``.
    """
    check_inputs(params, X, cfg)
    if X.ndim == 2 and isinstance(target, torch.Tensor):
        target = target[None]
    c = _forward(params, X, cfg)
    _check_variance(c)
    losses.check(loss, target, c.out)
    names = _select(c.names, wrt)
    f = _factors(c)
    Bsz, L, d = c.out.shape
    ld = losses.derivatives(loss, target, c.out)
    if ld.per_token:
        outer = {}
        for i, a in enumerate(names):
            for b in names[i:]:
                add_block(outer, names, a, b, sandwich(f.J[a], f.J[b], ld.hess))
    else:
        outer = _outer_lowrank(f.J, ld.hess, names, Bsz, L, d)
    functional = {k: v for k, v in contract_output(c, ld.grad, f).items() if k[0] in names and k[1] in names}
    shapes = {n: s for n, s in param_shapes(cfg).items() if n in names}
    H_o = HessianBlocks(names, shapes, outer)
    H_f = HessianBlocks(names, shapes, functional)
    full = H_o + H_f
    full.outer, full.functional = H_o, H_f
    return full
