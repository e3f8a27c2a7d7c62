"""Ground truth by automatic differentiation (``torch.func``) on a plain forward.

The forward here is written independently of the closed-form kernels (``torch.softmax``,
``torch.nn.functional.layer_norm``, ``relu``), so agreement is a real check. Same
signatures as :func:`blockhess.forward`, :func:`blockhess.jacobian` and
:func:`blockhess.hessian`; used by the tests, ``blockhess validate`` and ``blockhess bench``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as Fn

from . import losses
from .block import _select, check_inputs
from .blocks import BlockSum, HessianBlocks
from .config import BlockConfig, param_shapes

__all__ = ["forward", "jacobian", "hessian"]


def forward(params: dict, X: torch.Tensor, cfg: BlockConfig) -> torch.Tensor:
    """Plain forward of the block (paper §1.3) or bare attention layer; no checks.

    ``X``: ``(L, d_model)`` or ``(B, L, d_model)``; returns the same shape.
    """
    p = params
    T = (X @ p["W_Q"]) @ (X @ p["W_K"]).transpose(-1, -2) / math.sqrt(p["W_Q"].shape[1])
    F = torch.softmax(T, dim=-1) @ (X @ p["W_V"])
    if cfg.kind == "attention":
        return F
    ln = lambda t: Fn.layer_norm(t, (cfg.d_model,), eps=cfg.ln_eps)  # noqa: E731
    Y = ln(X + F)
    return ln(Y + torch.relu(Y @ p["W_1"]) @ p["W_2"])


def _plain_loss(loss, target, Z: torch.Tensor) -> torch.Tensor:
    """Batch loss (mean over sequences) by plain torch ops; ``Z`` is ``(B, L, d)``."""
    return losses.value(loss, target, Z)


def jacobian(params: dict, X: torch.Tensor, cfg: BlockConfig, wrt=None) -> dict[str, torch.Tensor]:
    """``torch.func.jacrev`` of :func:`forward`; same shapes as :func:`blockhess.jacobian`."""
    check_inputs(params, X, cfg)
    names = _select(tuple(param_shapes(cfg)), wrt)
    fixed = {k: v for k, v in params.items() if k not in names}
    J = torch.func.jacrev(lambda sel: forward({**fixed, **sel}, X, cfg))({n: params[n] for n in names})
    lead = X.shape[:-2]
    L, d = X.shape[-2:]
    out = {}
    for n in names:
        Jn = J[n].reshape(*lead, L * d, params[n].numel())
        out[n] = Jn
    return out


def hessian(params: dict, X: torch.Tensor, cfg: BlockConfig, loss="mse", target=None, wrt=None) -> HessianBlocks:
    """``torch.func.hessian`` of the loss through :func:`forward`, with the outer term
    ``J^T (∇²_Z ℓ) J`` from ``jacrev`` and the functional term as the difference.

    Same signature, shapes and errors as :func:`blockhess.hessian`.
    """
    check_inputs(params, X, cfg)
    names = _select(tuple(param_shapes(cfg)), wrt)
    Xb = X[None] if X.ndim == 2 else X
    if X.ndim == 2 and isinstance(target, torch.Tensor):
        target = target[None]
    losses.check(loss, target, Xb)
    fixed = {k: v for k, v in params.items() if k not in names}
    sel = {n: params[n] for n in names}

    def scalar(s):
        return _plain_loss(loss, target, forward({**fixed, **s}, Xb, cfg))

    Hf = torch.func.hessian(scalar)(sel)
    Z = forward(params, Xb, cfg)
    B, L, d = Z.shape
    H_Z = torch.func.hessian(lambda z: _plain_loss(loss, target, z))(Z).reshape(B * L * d, B * L * d)
    J = torch.func.jacrev(lambda s: forward({**fixed, **s}, Xb, cfg))(sel)
    J = {n: J[n].reshape(B * L * d, -1) for n in names}
    shapes = param_shapes(cfg)
    parts = {w: BlockSum(names, shapes) for w in ("full", "outer", "functional")}
    for i, a in enumerate(names):
        for b in names[i:]:
            full = Hf[a][b].reshape(params[a].numel(), params[b].numel())
            outer = J[a].T @ H_Z @ J[b]
            parts["full"].add(a, b, full)
            parts["outer"].add(a, b, outer)
            parts["functional"].add(a, b, full - outer)
    H = parts["full"].result(X)
    H._parts = lambda which: parts[which].result(X)
    return H
