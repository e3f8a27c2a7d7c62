r"""Theorem 4: the Jacobians of the block output w.r.t. its weights and its input, per token.

Every map after the attention scores acts token by token, so every Jacobian w.r.t. a weight is,
per token, a Kronecker factor premultiplied by per-token ``d×d`` matrices:

.. math::
    \frac{\partial Z}{\partial W_i} = J_Z B_i\ (\text{FFN}),\qquad
    \frac{\partial Z}{\partial W_k} = J_Z J_{SY} J_Y G_k\ (\text{attention}).

:func:`jacobian_factors` forms them, level by level (:class:`Factors`), from the layers'
``weight_jacobians`` and ``input_jacobian`` (:mod:`blockhess.layers.protocol`); the input ``X`` has a
factor dense within a sequence (:class:`~blockhess.kronecker.SeqFactor`). :func:`jacobian` and
:func:`input_jacobian` are the public dense layouts. Derivations: docs/derivations.md §13.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from ..config import BlockConfig, param_shapes
from ..kronecker import SeqFactor, SplitKron, TokenKron, ZeroKron
from ..layers import attention, ffn
from ..result import head_split
from ..threads import serial
from ..validation import check_fits, check_result
from . import assembled
from . import forward_pass  # forward_pass.forward_cache looked up when called: one forward pass to replace in checks
from .forward_pass import FFN_NAMES, Cache, as_batch, check_forward, check_inputs, pre_ln, select_wrt, work_entries

__all__ = ["Factors", "attention_input_jacobian", "input_jacobian", "jacobian", "jacobian_factors"]


class Factors(NamedTuple):
    """Per-token Kronecker factors of the Jacobians of the intermediates w.r.t. the variables.

    ``J``: public name → ``∂Z/∂W`` (or ``∂P/∂W`` for ``kind="attention"``): a
    :class:`~blockhess.kronecker.TokenKron`, a :class:`~blockhess.kronecker.SplitKron` (several
    heads), a :class:`~blockhess.kronecker.ZeroKron` (``b_K``) or a
    :class:`~blockhess.kronecker.SeqFactor` (``X``). ``lv``: level → internal name → factor, levels
    ``"O"`` (concatenated heads), ``"R"`` (``X + P``; ``P`` for the bare layer), ``"Y"``, ``"S"``, ``"Z"``.
    """

    J: dict
    lv: dict

    @property
    def G(self) -> dict:  # dR/dW, the paper's G_k (extended)
        return self.lv["R"]

    @property
    def G_Y(self) -> dict:  # dY/dW, the paper's G'_k
        return self.lv.get("Y", {})

    @property
    def B(self) -> dict:  # dS/dW, the paper's B_i
        return self.lv.get("S", {})


def attention_input_jacobian(c: Cache) -> torch.Tensor:
    """``dO/dX_a`` per token, ``(B, L, d, L, d)`` (``X_a`` the attention input)."""
    p = c.params
    return attention.input_jacobian(c.att, p["W_Q"], p["W_K"], p["W_V"], compact=True)


def _premul(factors: dict, E: torch.Tensor) -> dict:
    """Every factor of ``factors`` premultiplied by ``E`` (``(T, r', r)`` or ``(r', r)``), each
    distinct per-token matrix once: a weight and its bias that share one (``W_Q`` and ``b_Q``,
    ``W_O`` and ``b_O``, ``W_1`` and ``b_1``) keep sharing it, so that rows taken through both
    form their per-token products once (:func:`~blockhess.kronecker.vjp_rows`)."""
    done, out = {}, {}
    for k, f in factors.items():
        if isinstance(f, TokenKron):
            if id(f.mat) not in done:
                done[id(f.mat)] = (f.mat, E @ f.mat)  # the source kept: its id is not reused meanwhile
            out[k] = TokenKron(f.side, f.vec, done[id(f.mat)][1])
        else:
            out[k] = f.premul(E)
    return out


def jacobian_factors(c: Cache) -> Factors:
    """The :class:`Factors` of a forward pass (Theorem 4 in per-token form). Raises
    ``NotImplementedError`` for a config with :attr:`~blockhess.config.BlockConfig.llama_options`."""
    forward_pass.refuse_llama(c.cfg, "jacobian_factors (the per-token Kronecker factors)")
    cfg, p = c.cfg, c.params
    d = cfg.d_model
    T = c.P.shape[0]
    B, L = c.X.shape[:2]
    dt, dev = c.P.dtype, c.P.device
    eye = torch.eye(d, dtype=dt, device=dev)
    O = attention.weight_jacobians(c.att, c.names)
    need_x = "X" in c.names or (pre_ln(cfg) and ("gamma_1" in c.names or "beta_1" in c.names))
    if need_x:
        dOdXa = attention_input_jacobian(c)  # (B, L, d, L, d)
        if "X" in c.names:
            dOdX = dOdXa
            if pre_ln(cfg):
                J_a = c.ln1[1].reshape(B, L, d, d)
                if "gamma_1" in p:
                    J_a = p["gamma_1"][:, None] * J_a
                dOdX = torch.einsum("blcma,bmae->blcme", dOdXa, J_a)
            O["X"] = SeqFactor(dOdX.reshape(T, d, L * d), B, c.x_shape)
        if pre_ln(cfg):
            n1 = c.ln1[0].reshape(B, L, d)
            if "gamma_1" in c.names:
                O["gamma_1"] = TokenKron("vector", None, torch.einsum("blcma,bma->blca", dOdXa, n1).reshape(T, d, d))
            if "beta_1" in c.names:
                O["beta_1"] = TokenKron("vector", None, dOdXa.sum(3).reshape(T, d, d))
    R = dict(O)
    if cfg.out_proj:
        R = _premul(O, p["W_O"].T)
        ident = eye.expand(T, d, d)  # one tensor for both: their rows' products are shared (kronecker.vjp_rows)
        if "W_O" in c.names:
            R["W_O"] = TokenKron("left", c.att.F.reshape(T, d), ident)
        if "b_O" in c.names:
            R["b_O"] = TokenKron("vector", None, ident)
    if "X" in R and cfg.kind == "block":  # the residual: R_t = X_t + P_t
        ident = (torch.eye(L, dtype=dt, device=dev)[:, None, :, None] * eye[None, :, None, :]).reshape(L, d, L * d)
        R["X"] = SeqFactor(R["X"].mat + ident.repeat(B, 1, 1), B, R["X"].shape)
    lv = {"O": O, "R": R}
    if cfg.kind == "attention":
        lv["Z"] = R
    elif cfg.norm == "post":
        Y = _premul(R, c.E_Y)
        if "gamma_1" in c.names:
            Y["gamma_1"] = TokenKron("vector", None, torch.diag_embed(c.ln1[0]))
        if "beta_1" in c.names:
            Y["beta_1"] = TokenKron("vector", None, eye.expand(T, d, d))
        S = _premul(Y, c.J_SY)
        S.update(ffn.weight_jacobians(c.fc, c.names))
        Z = _premul(S, c.E_Z)
        if "gamma_2" in c.names:
            Z["gamma_2"] = TokenKron("vector", None, torch.diag_embed(c.ln2[0]))
        if "beta_2" in c.names:
            Z["beta_2"] = TokenKron("vector", None, eye.expand(T, d, d))
        lv.update(Y=Y, S=S, Z=Z)
    else:
        S = _premul(R, c.J_SY)
        S.update(ffn.weight_jacobians(c.fc, c.names))
        lv.update(Y=R, S=S, Z=S)
    Zf = lv["Z"]
    split = head_split(cfg)
    J = {}
    for n in c.names:
        if n == "b_K":
            J[n] = ZeroKron(tuple(p["b_K"].shape), T, d, c.P)
        elif n in ("W_Q", "b_Q", "W_K", "W_V") and split:
            parts = tuple(Zf[k] for k, (pub, _, _) in split.items() if pub == n)
            J[n] = SplitKron(parts, tuple(p[n].shape))
        else:
            J[n] = Zf[n]
    return Factors(J, lv)



@serial()  # many small products: one thread, the large ones the caller's (blockhess.threads)
def jacobian(params: dict, X: torch.Tensor, cfg: BlockConfig, wrt=None) -> dict[str, torch.Tensor]:
    """Jacobian of the block output w.r.t. each weight (Theorem 4), dense in the paper's layout.

    Returns ``{name: J}`` with ``J`` of shape ``(L·d_model, numel)`` for ``X`` of shape
    ``(L, d_model)``, or ``(B, L·d_model, numel)`` for a batch; ``wrt`` (a name or a list)
    restricts the names. dtype and device of ``X``. Holds almost everywhere (ReLU, Lemma 1).

    With :attr:`~blockhess.config.BlockConfig.llama_options` the columns are exact tangents
    (:func:`blockhess.block.assembled.jacobian`; docs/derivations.md §20).

    Raises ``ValueError`` as :func:`forward`, for an unknown name in ``wrt``, and for a
    Jacobian with a NaN or Inf (a value overflowed on finite inputs,
    :func:`~blockhess.validation.check_result`); ``InsufficientMemoryError`` before the forward
    pass if the dense Jacobians, or they with the forward cache and factors (:func:`work_entries`)
    and a copy of the largest one (the heads' merge), would not fit in memory.
    """
    check_inputs(params, X, cfg)
    shapes = param_shapes(cfg)
    names = select_wrt(tuple(shapes), wrt)
    n = sum(math.prod(shapes[k]) for k in names)
    e, (B, L) = X.element_size(), as_batch(X).shape[:2]
    result = X.numel() * n * e
    check_fits(result, f"the dense Jacobians ({X.numel()} x {n})", X.device)
    if cfg.llama_options:  # no Kronecker factors: columns of exact tangents (docs/derivations.md §20)
        out = assembled.jacobian(params, X, cfg, names)
        check_result({f"the Jacobian w.r.t. {n}": v for n, v in out.items()})
        return {n: (v[0] if X.ndim == 2 else v) for n, v in out.items()}
    work = work_entries(cfg, B, L, "factors", names=names) + X.numel() * max(math.prod(shapes[k]) for k in names)
    check_fits(result + work * e, f"the dense Jacobians ({X.numel()} x {n}) with the forward cache and factors of "
               f"{B * L} tokens", X.device)
    c = forward_pass.forward_cache(params, X, cfg, upstream=not FFN_NAMES.issuperset(names))
    check_forward(c)
    J = jacobian_factors(dataclasses.replace(c, names=names)).J  # only the wanted weights' factors are formed
    B, L, d = c.out.shape
    out = {n: J[n].dense().reshape(B, L * d, -1) for n in names}
    check_result({f"the Jacobian w.r.t. {n}": v for n, v in out.items()})
    return {n: (v[0] if X.ndim == 2 else v) for n, v in out.items()}


@serial()
def input_jacobian(params: dict, X: torch.Tensor, cfg: BlockConfig) -> torch.Tensor:
    r"""Jacobian of the block output w.r.t. its input, per sequence: ``(L·d, L·d)`` or ``(B, L·d, L·d)``.

    Rows ``(l, c)`` of ``Z``, columns ``(m, a)`` of ``X`` (``vec_r``); sequences do not mix.
    Closed form: :math:`\partial Z_t/\partial X = J_{Z,t} J_{SY,t} J_{Y,t} (e_t^\top\otimes I + \partial P_t/\partial X)`
    with the attention's ``dF/dX`` (:func:`blockhess.attention.input_jacobian`). dtype and device
    of ``X``; valid almost everywhere (ReLU, Lemma 1). Derived here (docs/derivations.md §13). With
    :attr:`~blockhess.config.BlockConfig.llama_options`: columns of exact tangents
    (:func:`blockhess.block.assembled.input_jacobian`, §20).

    Raises ``ValueError`` as :func:`forward`, and for a result with a NaN or Inf (an overflow
    on finite inputs, :func:`~blockhess.validation.check_result`); ``InsufficientMemoryError``
    before the forward pass if the ``B`` Jacobians ``(L·d)²``, or they with the forward cache and
    ``X``'s factors (:func:`work_entries`), would not fit in memory.
    """
    check_inputs(params, X, cfg)
    e, (B, L, d) = X.element_size(), as_batch(X).shape
    result = B * (L * d) ** 2 * e
    check_fits(result, f"the {B} dense input Jacobians ({L * d}x{L * d})", X.device)
    if cfg.llama_options:  # no Kronecker factors: columns of exact tangents (docs/derivations.md §20)
        J = assembled.input_jacobian(params, X, cfg)
        check_result({"the input Jacobian": J})
        return J[0] if X.ndim == 2 else J
    check_fits(result + work_entries(cfg, B, L, "factors", wrt_input=True, names=()) * e,
               f"the {B} dense input Jacobians ({L * d}x{L * d}) with the forward cache and factors of {B * L} tokens",
               X.device)
    c = forward_pass.forward_cache(params, X, cfg, wrt_input=True)
    check_forward(c)
    J = jacobian_factors(dataclasses.replace(c, names=("X",))).J["X"].dense()  # the weights' factors are not needed
    check_result({"the input Jacobian": J})
    return J[0] if X.ndim == 2 else J
