"""Ground truth by automatic differentiation (``torch.func``) on a plain forward.

The forward here is written independently of the closed-form kernels (``torch.softmax``,
``torch.nn.functional.layer_norm``, ``torch.nn.functional.gelu``, heads by ``reshape``), so
agreement is a real check. Same signatures as :func:`blockhess.forward`,
:func:`blockhess.jacobian`, :func:`blockhess.input_jacobian` and :func:`blockhess.hessian`;
used by the tests, ``blockhess validate`` and ``blockhess bench``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as Fn

from . import losses
from .block import _select, check_inputs
from .blocks import BlockSum, HessianBlocks, pairs
from .config import BlockConfig, param_shapes
from .validation import check_bool

__all__ = ["forward", "jacobian", "input_jacobian", "hessian"]


def _attention(p: dict, X: torch.Tensor, cfg: BlockConfig) -> torch.Tensor:
    """Multi-head self-attention with optional biases, causal mask and output projection."""
    H, dk = cfg.n_heads, cfg.head_dim
    L = X.shape[-2]
    Q = X @ p["W_Q"] + (p["b_Q"] if "b_Q" in p else 0)
    K = X @ p["W_K"] + (p["b_K"] if "b_K" in p else 0)
    V = X @ p["W_V"] + (p["b_V"] if "b_V" in p else 0)
    Qh = Q.reshape(*Q.shape[:-1], H, dk).transpose(-2, -3)  # (..., H, L, dk)
    Kh = K.reshape(*K.shape[:-1], H, dk).transpose(-2, -3)
    Vh = V.reshape(*V.shape[:-1], H, -1).transpose(-2, -3)
    T = Qh @ Kh.transpose(-1, -2) / math.sqrt(dk)
    if cfg.causal:
        mask = torch.ones(L, L, dtype=torch.bool, device=X.device).triu(1)
        T = T.masked_fill(mask, float("-inf"))
    O = (torch.softmax(T, dim=-1) @ Vh).transpose(-2, -3).reshape(X.shape)
    if cfg.out_proj:
        O = O @ p["W_O"] + (p["b_O"] if "b_O" in p else 0)
    return O


def _ln(p: dict, t: torch.Tensor, cfg: BlockConfig, i: int) -> torch.Tensor:
    # gamma and beta applied outside F.layer_norm: in torch 2.13 the double backward of
    # layer_norm's *weight* gradient w.r.t. its input is wrong (d/dx of dℓ/dγ; see
    # docs/derivations.md §9), which would corrupt half of the reference's (γ, ·) blocks.
    y = Fn.layer_norm(t, (cfg.d_model,), eps=cfg.ln_eps)
    if f"gamma_{i}" in p:
        y = y * p[f"gamma_{i}"]
    return y + p[f"beta_{i}"] if f"beta_{i}" in p else y


def _ffn(p: dict, Y: torch.Tensor, cfg: BlockConfig) -> torch.Tensor:
    pre = Y @ p["W_1"] + (p["b_1"] if "b_1" in p else 0)
    if cfg.activation == "relu":
        h = torch.relu(pre)
    else:
        h = Fn.gelu(pre, approximate="tanh" if cfg.activation == "gelu_tanh" else "none")
    return h @ p["W_2"] + (p["b_2"] if "b_2" in p else 0)


def forward(params: dict, X: torch.Tensor, cfg: BlockConfig) -> torch.Tensor:
    """Plain forward of the block (paper §1.3, with the options of docs/derivations.md §10–§13) or bare attention layer; no checks.

    ``X``: ``(L, d_model)`` or ``(B, L, d_model)``; returns the same shape.
    """
    p = params
    if cfg.kind == "attention":
        return _attention(p, X, cfg)
    if cfg.norm == "post":
        Y = _ln(p, X + _attention(p, X, cfg), cfg, 1)
        return _ln(p, Y + _ffn(p, Y, cfg), cfg, 2)
    Y = X + _attention(p, _ln(p, X, cfg, 1), cfg)
    return Y + _ffn(p, _ln(p, Y, cfg, 2), cfg)


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
    return {n: J[n].reshape(*lead, L * d, params[n].numel()) for n in names}


def input_jacobian(params: dict, X: torch.Tensor, cfg: BlockConfig) -> torch.Tensor:
    """``torch.func.jacrev`` of :func:`forward` w.r.t. ``X``, per sequence: ``(L·d, L·d)`` or ``(B, L·d, L·d)``."""
    check_inputs(params, X, cfg)
    L, d = X.shape[-2:]
    one = lambda x: torch.func.jacrev(lambda y: forward(params, y, cfg))(x).reshape(L * d, L * d)  # noqa: E731
    return one(X) if X.ndim == 2 else torch.func.vmap(one)(X)


def hessian(params: dict, X: torch.Tensor, cfg: BlockConfig, loss="mse", target=None, wrt=None,
            wrt_input: bool = False) -> HessianBlocks:
    """``torch.func.hessian`` of the loss through :func:`forward`, with the outer term
    ``J^T (∇²_Z ℓ) J`` from ``jacrev`` and the functional term as the difference.

    Same arguments (but no ``out``), shapes and argument errors as :func:`blockhess.hessian`
    (``wrt_input=True`` adds the block input ``X`` as a variable named ``"X"``, first). The
    forward pass itself is not checked: where :func:`blockhess.hessian` refuses a zero-variance
    or overflowing LayerNorm row, this oracle returns what autograd gives (NaN or Inf).
    """
    check_inputs(params, X, cfg)
    check_bool("wrt_input", wrt_input)
    shapes = dict(param_shapes(cfg))
    if wrt_input:
        shapes = {"X": tuple(X.shape), **shapes}
    names = _select(tuple(shapes), wrt)
    Xb = X[None] if X.ndim == 2 else X
    if X.ndim == 2 and isinstance(target, torch.Tensor):
        target = target[None]
    target = losses.check(loss, target, Xb, single=X.ndim == 2)
    allv = {**params, "X": X}
    fixed = {k: v for k, v in allv.items() if k not in names}
    sel = {n: allv[n] for n in names}

    def out(s):
        q = {**fixed, **s}
        x = q.pop("X")
        return forward(q, x[None] if x.ndim == 2 else x, cfg)

    def scalar(s):
        return _plain_loss(loss, target, out(s))

    Hf = torch.func.hessian(scalar)(sel)
    Z = out(sel)
    B, L, d = Z.shape
    # the batch loss is the mean of per-sequence losses: its Z-Hessian is block-diagonal over sequences
    in_dims = (0, 0 if isinstance(target, torch.Tensor) else None)

    def per_sequence(z, t):  # a tensor target gets its batch axis back; any other target is passed whole
        return _plain_loss(loss, t[None] if isinstance(t, torch.Tensor) else t, z[None]) / B

    H_Z = torch.func.vmap(torch.func.hessian(per_sequence), in_dims=in_dims)(Z, target).reshape(B, L * d, L * d)
    J = torch.func.jacrev(out)(sel)
    J = {n: J[n].reshape(B, L * d, -1) for n in names}
    parts = {w: BlockSum(names, shapes) for w in ("full", "outer", "functional")}
    for a, b in pairs(names):
        full = Hf[a][b].reshape(allv[a].numel(), allv[b].numel())
        outer = torch.einsum("bia,bij,bjc->ac", J[a], H_Z, J[b])
        parts["full"].add(a, b, full)
        parts["outer"].add(a, b, outer)
        parts["functional"].add(a, b, full - outer)
    H = parts["full"].result(X, cfg)
    H._parts = lambda which: parts[which].result(X, cfg)
    return H
