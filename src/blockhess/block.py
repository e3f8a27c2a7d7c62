r"""The Transformer block: forward, Jacobian (Theorem 4), second derivatives (Theorem 5), any setting.

Post-LN (the paper's, §1.3) and pre-LN blocks:

.. math::
    \text{post: } R = X + P(X),\ Y = \mathrm{LN}_1(R),\ S = Y + \mathrm{FFN}(Y),\ Z = \mathrm{LN}_2(S);\qquad
    \text{pre: } R = Y = X + P(\mathrm{LN}_1(X)),\ Z = S = Y + \mathrm{FFN}(\mathrm{LN}_2(Y)),

``P`` the (multi-head, optionally biased, masked and projected) self-attention. Every map after
the attention scores acts token by token, so every Jacobian w.r.t. a weight is, per token, a
Kronecker factor premultiplied by per-token ``d×d`` matrices (Theorem 4):

.. math::
    \frac{\partial Z}{\partial W_i} = J_Z B_i\ (\text{FFN}),\qquad
    \frac{\partial Z}{\partial W_k} = J_Z J_{SY} J_Y G_k\ (\text{attention}),

and every second derivative contracted with an output weight ``g`` (Theorem 5, eq. 9, what the
loss Hessian needs) is a sum over the nodes of the block of
(node input Jacobian)ᵀ (node's second derivative contracted with its back-propagated gradient)
(node input Jacobian). The block is a chain of *stages* (attention, LN_1, FFN, LN_2 for post-LN;
attention, FFN for pre-LN); walking it backwards with the loss Hessian at each level,
:math:`\Omega_{k-1} = E_k^\top\Omega_k E_k + \Gamma_k` (``E_k`` the stage's per-token Jacobian,
``Γ_k`` its contracted input curvature), the Hessian block of a pair ``(θ, φ)`` whose later
member ``φ`` enters at stage ``k`` is one Kronecker sandwich at the stage's output,
:math:`\sum_t F_{θ,t}^\top \Omega_k F_{φ,t}`, plus the stage's own cross term
:math:`\sum_t F^{in}_{θ,t}{}^\top \partial^2_{v\varphi}` (or its own second derivative when both
enter there). The outer (Gauss–Newton) term rides on the same pass. Contracting with every
basis vector gives the paper's dense layouts (:func:`second_derivative`). Derivations and the
paper's typos fixed on the way: docs/derivations.md.

Internally the attention weights of several heads are split into their column groups
(``W_Q#h``, ``b_Q#h``, ``W_K#h``, ``W_V#h``), each a plain Kronecker factor; the accumulator
writes their blocks into the column slices of the public blocks. The block input ``X`` is a
variable too (``wrt_input``): its Jacobian is dense within a sequence (:class:`~blockhess.kronecker.SeqFactor`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch

from .blocks import BlockSum, dense_second_derivative
from .layers import attention, ffn, layernorm
from .config import BlockConfig, name_hint, param_shapes
from .kronecker import SeqFactor, SplitKron, TokenKron, ZeroKron, sandwich, swap
from .threads import serial
from .validation import check_finite, check_fits, check_ln_variance, check_params, check_result, check_tensor, warn_tf32

__all__ = ["forward", "jacobian", "input_jacobian", "second_derivative",
           # the engine the package's other modules share (hessian, convergence, bounds, reference)
           "Cache", "Factors", "check_inputs", "forward_cache", "check_forward", "jacobian_factors", "contract_output",
           "select_wrt", "variable_shapes", "work_entries"]


class Cache(NamedTuple):
    """Forward quantities of a batch; token axes merged to ``T = B·L`` where noted."""

    cfg: BlockConfig
    names: tuple[str, ...]  # public names of the variables (``"X"`` first with wrt_input)
    att: attention.Cache
    U: torch.Tensor | None  # (T, d) LN_1 input, post-LN (the residual sum R)
    fc: ffn.Cache | None
    E_Y: torch.Tensor | None  # (T, d, d) J_Y per token (post-LN; None pre-LN: Y = R)
    E_Z: torch.Tensor | None  # (T, d, d) J_Z per token (identity pre-LN: Z = S)
    J_SY: torch.Tensor | None  # (T, d, d)
    out: torch.Tensor  # (B, L, d): Z (block) or P (attention)
    params: dict | None = None
    X: torch.Tensor | None = None  # (B, L, d) block input
    ln1: tuple | None = None  # post: (y_1, J_y1) of R; pre: (n_1, J_n1) of X (unscaled)
    ln2: tuple | None = None  # post: (y_2, J_y2) of S
    P: torch.Tensor | None = None  # (T, d) attention output after W_O
    x_shape: tuple | None = None  # shape of X as given: (L, d) or (B, L, d)


def _as_batch(X: torch.Tensor) -> torch.Tensor:
    return X[None] if X.ndim == 2 else X


def check_inputs(params: dict, X: torch.Tensor, cfg: BlockConfig) -> None:
    """Validate ``X`` (``(L, d_model)`` or ``(B, L, d_model)``, finite, floating) and ``params``.

    Raises ``ValueError`` naming the argument on a wrong shape, dtype, device, NaN/Inf;
    warns for float32 on CUDA with TF32 matrix products (:func:`~blockhess.validation.warn_tf32`).
    """
    if not isinstance(cfg, BlockConfig):
        raise ValueError(f"cfg must be a BlockConfig, got {type(cfg).__name__}")
    check_tensor("X", X, ndim=(2, 3), finite=False)  # finite: checked with params
    if X.shape[-1] != cfg.d_model or X.shape[-2] < 1 or (X.ndim == 3 and X.shape[0] < 1):
        raise ValueError(f"X must have shape (L, {cfg.d_model}) or (B, L, {cfg.d_model}) with L >= 1 and B >= 1, "
                         f"got {tuple(X.shape)}")
    check_params(params, param_shapes(cfg), X)
    warn_tf32(X.dtype, X.device)


def _pre(cfg: BlockConfig) -> bool:
    return cfg.kind == "block" and cfg.norm == "pre"


FFN_NAMES = frozenset(("W_1", "b_1", "W_2", "b_2", "gamma_2", "beta_2"))  # the variables entering at the FFN stage or later


def _levels(cfg: BlockConfig, name: str) -> int:
    """How many levels of :class:`Factors` hold their own per-token factor of variable ``name``
    (its level of entry and every later one that premultiplies it; ``R`` is ``O`` itself without ``W_O``)."""
    proj = int(cfg.out_proj)
    if name in ("W_O", "b_O"):
        entry = 1
    elif name in ("gamma_1", "beta_1"):
        entry = 2 if cfg.norm == "post" else 0
    elif name in FFN_NAMES:
        entry = 4 if cfg.norm == "post" and name in ("gamma_2", "beta_2") else 3
    else:  # the attention's weights, and X
        entry = 0
    if cfg.kind == "attention":
        return 1 + proj if entry == 0 else 1
    later = (("R", proj), ("Y", cfg.norm == "post"), ("S", 1), ("Z", cfg.norm == "post"))
    return int(entry == 0) + sum(int(on) for k, (_, on) in enumerate(later, 1) if k >= max(entry, 1))


def work_entries(cfg: BlockConfig, B: int, L: int, mode: str = "hessian", wrt_input: bool = False,
                 names=None) -> int:
    r"""An upper estimate of the tensor entries the closed form holds at once for ``B`` sequences
    of ``L`` tokens, before any of it is computed (its results not included: the caller adds
    the ``n²`` Hessian, the Jacobians).

    ``mode``: ``"forward"`` (a plain forward pass), ``"factors"`` (the forward cache with its
    per-token Jacobians, and the Kronecker factors of ``names``, default all weights; ``X`` as
    well with ``wrt_input``) or ``"hessian"`` (those, plus the largest working set of the backward
    walk: the loss Hessian's back-propagation and the per-token cores of one block pair).
    Per token, with ``d`` the width, ``d_ff`` the FFN width, ``H`` heads, ``q = H·d_k``:

    * forward: the scores and weights of every head (``2HL``), ``Q`` and ``K`` (``2q``), a dozen
      rows of ``d`` and four of ``d_ff``;
    * per-token Jacobians: up to seven ``d × d`` (the two LayerNorms', their ``γ``-scaled copies,
      ``J_SY`` and its factor ``W_2^T diag(a') W_1^T``) and one ``d × d_ff``;
    * factors: each variable's ``d``-row matrix per token at every level that holds its own
      (:func:`_levels`): ``d·q`` for ``W_Q``, ``b_Q``; ``H·d²`` for ``W_K`` (each head's rows padded
      to ``d``); ``d·d_ff`` for ``W_1``, ``b_1``; ``d²`` for the rest; ``L·d²`` for ``X``;
    * walk: the larger of the attention stage (a head's contracted softmax curvature, three
      ``L × L`` at once, and eight rows of ``L·d``) and the FFN stage (the ``d_ff × d_ff`` core of
      ``(W_1, W_1)`` or ``(b_1, b_1)``, three of them with a curved activation, and two
      ``d × d_ff``), plus three ``d × d`` for the loss Hessian being back-propagated;
    * with ``X`` a variable, or pre-LN ``γ_1``, ``β_1`` (which enter through the attention's input):
      the attention's input Jacobian and input curvature, eight ``L·d²`` and ``L²·(d + 2)`` (a
      three-operand product contracted left to right, and the softmax Jacobian), its cross derivatives
      with the heads, ``2·d²·(2q + d)``, and for ``X`` the per-token core of ``X`` against a
      weight, ``L·d·max(d, d_ff)``, and two ``d`` rows per token of its block with the largest weight.

    The coefficients are counts of the tensors the code forms, checked against measured peaks
    (docs/derivations.md §1, docs/results.md); ``B``, ``L`` are not checked.
    """
    d, H = cfg.d_model, cfg.n_heads
    q = H * cfg.head_dim
    ff = cfg.d_ff if cfg.kind == "block" else 0
    T = B * L
    fwd = 2 * H * L + 2 * q + 12 * d + 4 * ff
    if mode == "forward":
        return T * fwd
    shapes = param_shapes(cfg)
    names = tuple(shapes) if names is None else tuple(names)
    width = {"W_Q": d * q, "b_Q": d * q, "W_K": H * d * d, "b_K": 0, "W_1": d * ff, "b_1": d * ff}
    factors = sum(width.get(k, d * d) * _levels(cfg, k) for k in names if k in shapes)
    x_terms = wrt_input or (_pre(cfg) and any(k in names for k in ("gamma_1", "beta_1")))
    if wrt_input:
        factors += L * d * d * (_levels(cfg, "X") + 3)
    per_token = fwd + (7 * d * d + d * ff if cfg.kind == "block" else 0) + factors
    if mode == "hessian":
        attn = 3 * L * L + 8 * L * d
        ffn_stage = (3 if cfg.activation != "relu" else 1) * ff * ff + 2 * d * ff
        per_token += max(attn, ffn_stage, 6 * d * d) + 3 * d * d
        if x_terms:
            per_token += 8 * L * d * d + L * L * (d + 2) + 2 * d * d * (2 * q + d)
            if wrt_input:
                per_token += L * d * max(d, ff) + 2 * d * max(math.prod(s) for s in shapes.values())
    elif x_terms:
        per_token += L * d * d
    return T * per_token


def forward_cache(params: dict, X: torch.Tensor, cfg: BlockConfig, wrt_input: bool = False, upstream: bool = True,
                  plain: bool = False) -> Cache:
    """The block's forward pass on ``X`` (``(L, d_model)`` or ``(B, L, d_model)``), keeping what the
    derivatives need: the :class:`Cache` (``.out`` is the output, ``(B, L, d_model)``), in ``X``'s dtype
    and device. The one forward pass of the closed form (:func:`forward`, :func:`blockhess.hessian`,
    the bounds and the per-sample statistics all take it). No checks (kernel: :func:`check_inputs`
    before, :func:`check_forward` after).

    ``upstream=False``: only variables in ``FFN_NAMES`` will be differentiated; the per-token
    Jacobians the chain needs for earlier ones (``J_Y``, ``J_SY``) are not formed (``None``).
    ``plain=True``: nothing will be differentiated; no per-token Jacobian is formed (``E_Y``,
    ``E_Z``, ``J_SY``, the LayerNorm Jacobians are ``None``): the output and what
    :func:`check_forward` reads.
    """
    p = params
    Xb = _as_batch(X)
    names = tuple(param_shapes(cfg))
    if wrt_input:
        names = ("X",) + names
    d, eps = cfg.d_model, cfg.ln_eps
    upstream = upstream and not plain
    ln1 = None
    Xa = Xb
    if _pre(cfg):
        n1, r1 = layernorm.normalise(Xb, eps)
        ln1 = (n1.reshape(-1, d), layernorm.per_token_jacobian(n1, r1).reshape(-1, d, d) if upstream else None)
        Xa = layernorm.affine(n1, p.get("gamma_1"), p.get("beta_1"))
    att = attention.forward(Xa, p["W_Q"], p["W_K"], p["W_V"], p.get("b_Q"), p.get("b_K"), p.get("b_V"),
                            cfg.n_heads, cfg.causal)
    P = att.F
    if cfg.out_proj:
        P = P @ p["W_O"]
        if "b_O" in p:
            P = P + p["b_O"]
    if cfg.kind == "attention":
        return Cache(cfg, names, att, None, None, None, None, None, P, p, Xb, None, None, P.reshape(-1, d), tuple(X.shape))
    U = (Xb + P).reshape(-1, d)
    g1, g2 = p.get("gamma_1"), p.get("gamma_2")
    if cfg.norm == "post":
        y1, r1 = layernorm.normalise(U, eps)
        fc = ffn.forward(layernorm.affine(y1, g1, p.get("beta_1")), p["W_1"], p["W_2"], p.get("b_1"), p.get("b_2"),
                         cfg.activation)
        y2, r2 = layernorm.normalise(fc.S, eps)
        Z = layernorm.affine(y2, g2, p.get("beta_2"))
        J1 = layernorm.per_token_jacobian(y1, r1) if upstream else None
        J2 = None if plain else layernorm.per_token_jacobian(y2, r2)
        E_Y = J1 if g1 is None or J1 is None else g1[:, None] * J1
        E_Z = J2 if g2 is None or J2 is None else g2[:, None] * J2
        ln1, ln2 = (y1, J1), (y2, J2)
        J_SY = ffn.input_jacobian(fc) if upstream else None
        return Cache(cfg, names, att, U, fc, E_Y, E_Z, J_SY, Z.reshape(Xb.shape), p, Xb, ln1, ln2, P.reshape(-1, d),
                     tuple(X.shape))
    fc = ffn.forward(U, p["W_1"], p["W_2"], p.get("b_1"), p.get("b_2"), cfg.activation, pre_ln=True, ln_eps=eps,
                     gamma=g2, beta=p.get("beta_2"), jacobian=not plain)
    eye = None if plain else torch.eye(d, dtype=X.dtype, device=X.device).expand(U.shape[0], d, d)
    J_SY = ffn.input_jacobian(fc) if upstream else None
    return Cache(cfg, names, att, U, fc, None, eye, J_SY, fc.S.reshape(Xb.shape), p, Xb, ln1, None,
                 P.reshape(-1, d), tuple(X.shape))


def check_forward(c: Cache, first: int = 0) -> None:
    """The forward pass on checked inputs: every LayerNorm input row (``check_ln_variance``: finite,
    ``var + ln_eps`` above its values' rounding and ``tiny/e``; Assumption 2 with ``ln_eps = 0``),
    and the output finite (one sum): an overflow inside, e.g. of float32 attention scores or of
    a post-LN output ``gamma * y``, is an error, not a Hessian of NaN. ``first``: the batch index
    of ``c``'s first sequence (a pass over part of a batch), for the rows the errors name."""
    eps, shape = c.cfg.ln_eps, c.x_shape  # rows named as X's: (t,) or (b, t)
    if c.cfg.kind == "block" and c.cfg.norm == "post":
        check_ln_variance("the LayerNorm-1 input X + SA(X)", c.U.reshape(shape), eps, computed=True, first=first)
        check_ln_variance("the LayerNorm-2 input Y + FFN(Y)", c.fc.S.reshape(shape), eps, computed=True, first=first)
    elif c.cfg.kind == "block":
        check_ln_variance("X (the LayerNorm-1 input, pre-LN)", c.X.reshape(shape), eps, first=first)
        check_ln_variance("the LayerNorm-2 input Y = X + SA(LN_1(X)), pre-LN", c.U.reshape(shape), eps, computed=True,
                          first=first)
    check_finite({"the block output": c.out}, f": the forward pass overflowed {c.out.dtype} on finite inputs; "
                 "rescale X or the weights")


# ----------------------------------------------------------------------------------------------
# stages and per-level factors


class Stage(NamedTuple):
    """One stage of the chain (docs/derivations.md §10)."""

    kind: str  # "attn", "ln1", "ffn", "ln2"
    inp: str | None  # level of the stage input
    out: str  # level of the stage output
    new: tuple[str, ...]  # internal names of the variables entering here
    E: torch.Tensor | None  # per-token Jacobian out/in (None: identity)


def _split_names(cfg: BlockConfig) -> dict[str, tuple[str, tuple, tuple]]:
    """Internal head-split name → (public name, refined public shape, index into it)."""
    H = cfg.n_heads
    if H == 1:
        return {}
    d, dk, dv = cfg.d_model, cfg.head_dim, cfg.value_dim
    out = {}
    for h in range(H):
        nm = attention.head_names(H, h)
        out[nm["W_Q"]] = ("W_Q", (d, H, dk), (slice(None), h, slice(None)))
        out[nm["b_Q"]] = ("b_Q", (H, dk), (h, slice(None)))
        out[nm["W_K"]] = ("W_K", (d, H, dk), (slice(None), h, slice(None)))
        out[nm["W_V"]] = ("W_V", (d, H, dv), (slice(None), h, slice(None)))
    return out


def _attn_internal(cfg: BlockConfig, names: tuple[str, ...]) -> tuple[str, ...]:
    """Internal names of the attention stage's variables, in processing order."""
    H = cfg.n_heads
    out = ["X"] if "X" in names else []
    for h in range(H):
        nm = attention.head_names(H, h)
        out += [nm["W_Q"]] + ([nm["b_Q"]] if "b_Q" in names else []) + [nm["W_K"]]
    out += [attention.head_names(H, h)["W_V"] for h in range(H)]
    out += [n for n in ("b_V", "W_O", "b_O") if n in names]
    if _pre(cfg):
        out += [n for n in ("gamma_1", "beta_1") if n in names]
    return tuple(out)


def _stages(c: Cache) -> list[Stage]:
    """The chain of stages of the block (post-LN: attention, LN_1, FFN, LN_2; pre-LN: attention, FFN)."""
    cfg, names = c.cfg, c.names
    st = [Stage("attn", None, "R", _attn_internal(cfg, names), None)]
    if cfg.kind == "attention":
        return st
    if cfg.norm == "post":
        st.append(Stage("ln1", "R", "Y", tuple(n for n in ("gamma_1", "beta_1") if n in names), c.E_Y))
        st.append(Stage("ffn", "Y", "S", tuple(n for n in ("W_1", "b_1", "W_2", "b_2") if n in names), c.J_SY))
        st.append(Stage("ln2", "S", "Z", tuple(n for n in ("gamma_2", "beta_2") if n in names), c.E_Z))
    else:
        st.append(Stage("ffn", "R", "Z", tuple(n for n in ("gamma_2", "beta_2", "W_1", "b_1", "W_2", "b_2") if n in names),
                        c.J_SY))
    return st


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


def _input_jac_O(c: Cache) -> torch.Tensor:
    """``dO/dX_a`` per token, ``(B, L, d, L, d)`` (``X_a`` the attention input)."""
    p = c.params
    return attention.input_jacobian(c.att, p["W_Q"], p["W_K"], p["W_V"], compact=True)


def jacobian_factors(c: Cache) -> Factors:
    """The :class:`Factors` of a forward pass (Theorem 4 in per-token form)."""
    cfg, p = c.cfg, c.params
    d = cfg.d_model
    T = c.P.shape[0]
    B, L = c.X.shape[:2]
    dt, dev = c.P.dtype, c.P.device
    eye = torch.eye(d, dtype=dt, device=dev)
    O = attention.weight_jacobians(c.att, c.names)
    need_x = "X" in c.names or (_pre(cfg) and ("gamma_1" in c.names or "beta_1" in c.names))
    if need_x:
        dOdXa = _input_jac_O(c)  # (B, L, d, L, d)
        if "X" in c.names:
            dOdX = dOdXa
            if _pre(cfg):
                J_a = c.ln1[1].reshape(B, L, d, d)
                if "gamma_1" in p:
                    J_a = p["gamma_1"][:, None] * J_a
                dOdX = torch.einsum("blcma,bmae->blcme", dOdXa, J_a)
            O["X"] = SeqFactor(dOdX.reshape(T, d, L * d), B, c.x_shape)
        if _pre(cfg):
            n1 = c.ln1[0].reshape(B, L, d)
            if "gamma_1" in c.names:
                O["gamma_1"] = TokenKron("vector", None, torch.einsum("blcma,bma->blca", dOdXa, n1).reshape(T, d, d))
            if "beta_1" in c.names:
                O["beta_1"] = TokenKron("vector", None, dOdXa.sum(3).reshape(T, d, d))
    R = dict(O)
    if cfg.out_proj:
        WOt = p["W_O"].T
        R = {k: f.premul(WOt) for k, f in O.items()}
        if "W_O" in c.names:
            R["W_O"] = TokenKron("left", c.att.F.reshape(T, d), eye.expand(T, d, d))
        if "b_O" in c.names:
            R["b_O"] = TokenKron("vector", None, eye.expand(T, d, d))
    if "X" in R and cfg.kind == "block":  # the residual: R_t = X_t + P_t
        ident = (torch.eye(L, dtype=dt, device=dev)[:, None, :, None] * eye[None, :, None, :]).reshape(L, d, L * d)
        R["X"] = SeqFactor(R["X"].mat + ident.repeat(B, 1, 1), B, R["X"].shape)
    lv = {"O": O, "R": R}
    if cfg.kind == "attention":
        lv["Z"] = R
    elif cfg.norm == "post":
        Y = {k: f.premul(c.E_Y) for k, f in R.items()}
        if "gamma_1" in c.names:
            Y["gamma_1"] = TokenKron("vector", None, torch.diag_embed(c.ln1[0]))
        if "beta_1" in c.names:
            Y["beta_1"] = TokenKron("vector", None, eye.expand(T, d, d))
        S = {k: f.premul(c.J_SY) for k, f in Y.items()}
        S.update(ffn.weight_jacobians(c.fc, c.names))
        Z = {k: f.premul(c.E_Z) for k, f in S.items()}
        if "gamma_2" in c.names:
            Z["gamma_2"] = TokenKron("vector", None, torch.diag_embed(c.ln2[0]))
        if "beta_2" in c.names:
            Z["beta_2"] = TokenKron("vector", None, eye.expand(T, d, d))
        lv.update(Y=Y, S=S, Z=Z)
    else:
        S = {k: f.premul(c.J_SY) for k, f in R.items()}
        S.update(ffn.weight_jacobians(c.fc, c.names))
        lv.update(Y=R, S=S, Z=S)
    Zf = lv["Z"]
    split = _split_names(cfg)
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


# ----------------------------------------------------------------------------------------------
# the accumulator over internal names


def _embed(value: torch.Tensor, ref: tuple, idx: tuple) -> torch.Tensor:
    """Zero-pad ``value`` (shape of ``ref`` with the integer-indexed axes removed) into shape ``ref``."""
    dim = 0
    for r, i in zip(ref, idx):
        if isinstance(i, int):
            value = value.unsqueeze(dim)
            shp = list(value.shape)
            parts = []
            if i:
                shp[dim] = i
                parts.append(value.new_zeros(shp))
            parts.append(value)
            if r - i - 1:
                shp[dim] = r - i - 1
                parts.append(value.new_zeros(shp))
            value = torch.cat(parts, dim) if len(parts) > 1 else value
        dim += 1
    return value


class _Acc:
    """Adds blocks of internal variables (head column groups, ``X``) into a public :class:`BlockSum`."""

    def __init__(self, acc: BlockSum, cfg: BlockConfig):
        self.acc = acc
        self.split = _split_names(cfg)
        self.dense = acc.buffer is not None
        self.pending: dict[tuple[str, str], torch.Tensor] = {}

    def pub(self, n: str) -> str:
        return self.split[n][0] if n in self.split else n

    def wants(self, a: str, b: str) -> bool:
        return self.acc.wants(self.pub(a), self.pub(b))

    def _ordered(self, a: str, b: str) -> bool:
        A, B = self.pub(a), self.pub(b)
        return self.acc.names.index(A) <= self.acc.names.index(B)

    def _ref(self, n: str):
        if n in self.split:
            return self.split[n][1], self.split[n][2]
        shape = self.acc.shapes[n]
        return shape, tuple(slice(None) for _ in shape)

    def _sub(self, n: str) -> tuple:
        ref, idx = self._ref(n)
        return tuple(r for r, i in zip(ref, idx) if not isinstance(i, int))

    def add(self, a: str, b: str, value: torch.Tensor, diag: tuple[int, int] | None = None) -> None:
        """Add ``value`` (shape ``sub_a + sub_b``, or a :func:`torch.diagonal` layout of it over ``diag``)."""
        if not self.wants(a, b):
            return
        A, B = self.pub(a), self.pub(b)
        if A == "X" and B == "X":
            self._add_xx(value if diag is None else torch.diag_embed(value, 0, *diag))
            return
        if a not in self.split and b not in self.split:
            if diag is None:
                self.acc.add(A, B, value)
            elif self.dense and self._ordered(a, b):
                self.acc.add_diagonal(A, B, diag[0], diag[1], value)
            else:
                self.acc.add(A, B, torch.diag_embed(value, 0, *diag))
            return
        if not self._ordered(a, b) or (A == B and a != b and diag is not None):
            if diag is not None:
                value, diag = torch.diag_embed(value, 0, *diag), None
            if not self._ordered(a, b):
                ka = len(self._sub(a))
                value = value.permute(*range(ka, value.ndim), *range(ka))
                a, b, A, B = b, a, B, A
        self._add_split(a, b, A, B, value, diag)
        if A == B and a != b:  # a diagonal public block is stored whole: mirror the sub-block
            kb = len(self._sub(a))
            self._add_split(b, a, B, A, value.permute(*range(kb, value.ndim), *range(kb)), None)

    def add_sandwich(self, a: str, b: str, F1, F2, omega=None, core=None) -> None:
        """:meth:`BlockSum.add_sandwich` over internal names. In a dense buffer, a head's
        sub-block of a public block (its rows against another weight or head) is written in
        place (:meth:`BlockSum.write_sandwich`, into the zeroed public block); in a diagonal
        public block, stored whole, both ``(h, g)`` and ``(g, h)``. ``(X, X)``, factors other
        than :class:`TokenKron` and the dict mode go through :meth:`add`."""
        if not self.wants(a, b):
            return
        if not (a in self.split or b in self.split):
            if a == b == "X":
                self.add(a, b, sandwich(F1, F2, omega, core))
            else:
                self.acc.add_sandwich(a, b, F1, F2, omega, core)
            return
        if not self._ordered(a, b):
            a, b = b, a
            F1, F2, omega, core = swap(F1, F2, omega, core)
        if not (self.dense and isinstance(F1, TokenKron) and isinstance(F2, TokenKron)):
            self.add(a, b, sandwich(F1, F2, omega, core))
            return
        block = self.acc._view(self.pub(a), self.pub(b))  # zeroed on first use
        pairs = [(a, b, (F1, F2, omega, core))]
        if a != b and self.pub(a) == self.pub(b):  # a diagonal public block is stored whole: both sub-blocks
            pairs.append((b, a, swap(F1, F2, omega, core)))
        for x, y, args in pairs:
            (rx, ix), (ry, iy) = self._ref(x), self._ref(y)
            self.acc.write_sandwich(block.view(*rx, *ry)[ix + iy], *args)

    def add_diagonal(self, a: str, b: str, dim1: int, dim2: int, value: torch.Tensor) -> None:
        """:meth:`BlockSum.add_diagonal` over internal names."""
        self.add(a, b, value, (dim1, dim2))

    def _add_split(self, a, b, A, B, value, diag):
        (ra, ia), (rb, ib) = self._ref(a), self._ref(b)
        if self.dense:
            view = self.acc._view(A, B).view(*ra, *rb)[ia + ib]
            if diag is None:
                view.add_(value.reshape(view.shape))
            else:
                torch.diagonal(view, 0, *diag).add_(value)
            return
        if diag is not None:
            value = torch.diag_embed(value, 0, *diag)
        sa, sb = self._sub(a), self._sub(b)
        full = _embed(value.reshape(*sa, *sb), ra, ia)  # ra + sb
        full = full.movedim(tuple(range(len(ra), len(ra) + len(sb))), tuple(range(len(sb))))  # sb + ra
        full = _embed(full, rb, ib)  # rb + ra
        full = full.movedim(tuple(range(len(rb), len(rb) + len(ra))), tuple(range(len(ra))))  # ra + rb
        key = (A, B)
        self.pending[key] = self.pending[key] + full if key in self.pending else full

    def _add_xx(self, value: torch.Tensor) -> None:
        shape = self.acc.shapes["X"]
        if len(shape) == 2:
            self.acc.add("X", "X", value.reshape(*shape, *shape))
            return
        Bn, L, d = shape
        v = value.reshape(Bn, L, d, L, d)
        if self.dense:
            self.acc.add_diagonal("X", "X", 0, 3, v.permute(1, 2, 3, 4, 0))
        else:
            self.acc.add("X", "X", torch.diag_embed(v.permute(1, 2, 3, 4, 0), 0, 0, 3))

    def finish(self) -> None:
        for (A, B), v in self.pending.items():
            self.acc.add(A, B, v.reshape(self.acc.sizes[A], self.acc.sizes[B]))
        self.pending = {}


# ----------------------------------------------------------------------------------------------
# the backward walk: outer + functional terms, stage by stage


def _ln_stage(c: Cache, st: Stage, g: torch.Tensor):
    """LN stage (post-LN): input curvature Γ and the ``(v, gamma)`` cross factor."""
    i = 1 if st.kind == "ln1" else 2
    X_in = c.U if i == 1 else c.fc.S
    gamma = c.params.get(f"gamma_{i}")
    Gam = layernorm.contract_hessian_unchecked(X_in, g, c.cfg.ln_eps, gamma)
    cross = {}
    if f"gamma_{i}" in st.new:
        J = (c.ln1 if i == 1 else c.ln2)[1]
        cross[f"gamma_{i}"] = [TokenKron("vector", None, J * g[:, None, :])]
    return Gam, cross


def _walk(c: Cache, f: Factors, acc: _Acc, g, omega, start: str | None = None) -> None:
    """Add the Hessian blocks to ``acc``: outer term with per-token ``omega`` at the top level
    (``None``: none), functional term with gradient ``g`` (``(T, d)``; ``None``: none)."""
    stages = _stages(c)
    if start is not None:
        stages = stages[: [s.kind for s in stages].index(start) + 1]
    elif g is None:  # the outer term alone: J^T Ω_Z J with the output's factors (docs/derivations.md §10, float32)
        if omega is not None:
            order = tuple(n for s in stages for n in s.new)
            for j, phi in enumerate(order):
                for theta in order[: j + 1]:
                    if acc.wants(theta, phi):
                        acc.add_sandwich(theta, phi, f.lv["Z"][theta], f.lv["Z"][phi], omega)
        return
    earlier = {s.kind: tuple(n for t in stages[:k] for n in t.new) for k, s in enumerate(stages)}
    for st in reversed(stages):
        if st.kind == "attn":
            _attn_stage(c, f, acc, st, g, omega)
            return
        Fo, Fi = f.lv[st.out], f.lv[st.inp]
        Gam, cross, core, own = None, {}, {}, []
        if g is not None:
            if st.kind == "ffn":
                con = ffn.contract_hessian(c.fc, g, st.new)
                Gam, cross, core, own = con.gamma, con.cross, con.core, con.own
            else:
                Gam, cross = _ln_stage(c, st, g)
        old = earlier[st.kind]
        for j, phi in enumerate(st.new):
            for theta in old + st.new[: j + 1]:
                if not acc.wants(theta, phi):
                    continue
                cr = core.get((theta, phi))
                if omega is not None or cr is not None:
                    acc.add_sandwich(theta, phi, Fo[theta], Fo[phi], omega if omega is not None else False, cr)
                if theta in old:
                    for part in cross.get(phi, ()):
                        acc.add_sandwich(theta, phi, Fi[theta], part)
        for a, b, value, dims in own:
            acc.add(a, b, value, dims)
        E = st.E
        if omega is not None and E is not None:
            omega = E.transpose(1, 2) @ omega @ E
        if Gam is not None:
            omega = Gam if omega is None else omega + Gam
        if g is not None and E is not None:
            g = (E.transpose(1, 2) @ g[..., None])[..., 0]


def _attn_stage(c: Cache, f: Factors, acc: _Acc, st: Stage, g, omega) -> None:
    """Pairs of attention-stage variables: sandwiches at level R, the attention's own second
    derivatives, the ``(O, W_O)`` cross term, and the ``X`` / pre-LN ``gamma_1, beta_1`` terms."""
    cfg, p = c.cfg, c.params
    Fr, Fo = f.lv["R"], f.lv["O"]
    new = st.new
    if omega is not None:
        for j, phi in enumerate(new):
            for theta in new[: j + 1]:
                if acc.wants(theta, phi):
                    acc.add_sandwich(theta, phi, Fr[theta], Fr[phi], omega)
    if g is None:
        return
    d = cfg.d_model
    B, L = c.X.shape[:2]
    g_O = g @ p["W_O"].T if cfg.out_proj else g
    G = g_O.reshape(B, L, d)
    attention.contract_hessian(c.att, G, acc, c.names)
    if cfg.out_proj:  # P = O W_O: (O, W_O) cross term I ⊗ g_P^T
        T = g.shape[0]
        crossWO = TokenKron("right", g, torch.eye(d, dtype=g.dtype, device=g.device).expand(T, d, d))
        for theta in new:
            if theta in Fo and acc.wants(theta, "W_O"):
                acc.add_sandwich(theta, "W_O", Fo[theta], crossWO)
    pre = _pre(cfg)
    has = {n for n in ("X", "gamma_1", "beta_1") if n in new}
    if not has:
        return
    heads = [n for n in new if n not in ("X", "gamma_1", "beta_1", "b_V", "W_O", "b_O")]
    want_w = any(acc.wants(a, w) for a in has for w in heads)
    XX, XW = attention.contract_input_hessian(c.att, G, p["W_Q"], p["W_K"], p["W_V"], c.names, weights=want_w)
    n1 = c.ln1[0].reshape(B, L, d) if pre else None
    if "X" in has:
        if pre:
            J_a = c.ln1[1].reshape(B, L, d, d)
            if "gamma_1" in p:
                J_a = p["gamma_1"][:, None] * J_a
        for w in heads:
            if w in XW and acc.wants("X", w):
                v = XW[w]
                if pre:
                    v = torch.einsum("bmae,bma...->bme...", J_a, v)
                acc.add("X", w, v.reshape(*c.x_shape, *v.shape[3:]))
        if acc.wants("X", "X"):
            v = XX
            if pre:
                v = torch.einsum("bmae,bmanc,bncf->bmenf", J_a, XX, J_a)
                g_Xa = torch.einsum("blcma,blc->bma", _input_jac_O(c), G)  # gradient at the attention input
                Gam = layernorm.contract_hessian_unchecked(c.X, g_Xa, cfg.ln_eps, p.get("gamma_1"))  # (B, L, d, d)
                v = v + torch.diag_embed(Gam.permute(0, 2, 3, 1), dim1=1, dim2=3)
            acc.add("X", "X", v)
    if not pre:
        return
    for k in ("gamma_1", "beta_1"):
        if k not in has:
            continue
        for w in heads:
            if w in XW and acc.wants(k, w):
                v = XW[w]
                acc.add(k, w, torch.einsum("bma,bma...->a...", n1, v) if k == "gamma_1" else v.sum((0, 1)))
    XXn = None
    if "gamma_1" in has:
        XXn = torch.einsum("bmanc,bnc->bmac", XX, n1)  # XX diag(n) summed over the second token
        if acc.wants("gamma_1", "gamma_1"):
            acc.add("gamma_1", "gamma_1", torch.einsum("bma,bmac->ac", n1, XXn))
    if "beta_1" in has:
        XX1 = XX.sum(3)  # (B, L, d, d)
        if acc.wants("beta_1", "beta_1"):
            acc.add("beta_1", "beta_1", XX1.sum((0, 1)))
        if "gamma_1" in has and acc.wants("gamma_1", "beta_1"):
            acc.add("gamma_1", "beta_1", torch.einsum("bma,bmac->ac", n1, XX1))
    if "X" in has:
        if "gamma_1" in has and acc.wants("X", "gamma_1"):
            dOdXa = _input_jac_O(c)
            g_Xa = torch.einsum("blcma,blc->bma", dOdXa, G)
            v = torch.einsum("bmae,bmac->bmec", J_a, XXn)
            v = v + c.ln1[1].reshape(B, L, d, d) * g_Xa[:, :, None, :]  # LN_1's own (X, gamma_1): J_n^T diag(g)
            acc.add("X", "gamma_1", v.reshape(*c.x_shape, d))
        if "beta_1" in has and acc.wants("X", "beta_1"):
            acc.add("X", "beta_1", torch.einsum("bmae,bmac->bmec", J_a, XX1).reshape(*c.x_shape, d))


def contract_output(c: Cache, g, f: Factors, acc, omega_Z: torch.Tensor | None = None) -> None:
    r"""Add the blocks of :math:`\sum_o g_o \nabla^2_W \mathrm{out}_o` (the functional term of eq. 10) to ``acc``.

    ``g`` has the shape of the output, ``(B, L, d)`` (``None``: no functional term). ``omega_Z``
    (``(T, d, d)``, per token) adds the outer term :math:`J^\top \Omega J` on the same pass.
    ``acc`` is a :class:`~blockhess.blocks.BlockSum` over the public names. Theorem 5 contracted
    (docs/derivations.md §6, §10). No checks (kernel).
    """
    wrap = acc if isinstance(acc, _Acc) else _Acc(acc, c.cfg)
    _walk(c, f, wrap, None if g is None else g.reshape(-1, c.cfg.d_model), omega_Z)
    if wrap is not acc:
        wrap.finish()


def _contract_S(c: Cache, f: Factors, g_S: torch.Tensor, acc) -> None:
    r"""Add ξ contracted with ``g_S`` (``(T, d)``): the blocks of :math:`\sum g_S \nabla^2 S` (Theorem 5's ξ_ij)."""
    wrap = _Acc(acc, c.cfg)
    _walk(c, f, wrap, g_S, None, start="ffn")
    wrap.finish()


# ----------------------------------------------------------------------------------------------
# public functions


def forward(params: dict, X: torch.Tensor, cfg: BlockConfig) -> torch.Tensor:
    """The block's output ``Z`` (or ``P`` for ``kind="attention"``), same shape as ``X``.

    ``X``: ``(L, d_model)`` or ``(B, L, d_model)``, float32/float64; ``params`` as
    :func:`~blockhess.config.param_shapes`. Source: paper §1.3 (notation: docs/derivations.md, top; options §10–§13).

    Raises ``ValueError`` on wrong shapes, dtypes, devices, NaN/Inf, a forward pass that
    overflows the dtype, or a LayerNorm input row whose ``var + ln_eps`` does not stand above
    its values' rounding and ``tiny/e`` (with ``ln_eps = 0``: zero or underflowing variance,
    Assumption 2; :func:`~blockhess.validation.check_ln_variance`, docs/derivations.md §3);
    ``InsufficientMemoryError`` before it if its intermediates (every head's ``L × L`` scores,
    :func:`work_entries`) would not fit. A plain forward: no per-token Jacobian is formed.
    """
    check_inputs(params, X, cfg)
    B, L = _as_batch(X).shape[:2]
    check_fits(work_entries(cfg, B, L, "forward") * X.element_size(), f"the forward pass over {B * L} tokens", X.device)
    c = forward_cache(params, X, cfg, plain=True)
    check_forward(c)
    return c.out.reshape(X.shape)


def select_wrt(names: tuple[str, ...], wrt) -> tuple[str, ...]:
    """The names of ``wrt`` (``None``: all; a name; or an iterable of names) in the canonical order of
    ``names``. Raises ``ValueError`` for another type, an empty ``wrt`` or a name not in ``names``
    (with :func:`~blockhess.config.name_hint` for a PyTorch parameter name)."""
    if wrt is None:
        return names
    given = wrt
    wrt = (wrt,) if isinstance(wrt, str) else tuple(wrt) if isinstance(wrt, Iterable) else None
    if wrt is None or not all(isinstance(w, str) for w in wrt):
        raise ValueError(f"wrt must be None, a parameter name or a list of names from {list(names)}, got {given!r}")
    unknown = [w for w in wrt if w not in names]
    if unknown or not wrt:
        hint = name_hint(unknown) + ("; the input X is a variable with wrt_input=True" if "X" in unknown else "")
        raise ValueError(f"wrt must be a non-empty subset of {list(names)}, got {list(wrt)}{hint}")
    return tuple(n for n in names if n in wrt)


def variable_shapes(c: Cache) -> dict[str, tuple[int, ...]]:
    """Shapes of the variables of ``c`` (``X`` first when present)."""
    shapes = dict(param_shapes(c.cfg))
    return {"X": c.x_shape, **shapes} if "X" in c.names else shapes


@serial()  # many small products: one thread, the large ones the caller's (blockhess.threads)
def jacobian(params: dict, X: torch.Tensor, cfg: BlockConfig, wrt=None) -> dict[str, torch.Tensor]:
    """Jacobian of the block output w.r.t. each weight (Theorem 4), dense in the paper's layout.

    Returns ``{name: J}`` with ``J`` of shape ``(L·d_model, numel)`` for ``X`` of shape
    ``(L, d_model)``, or ``(B, L·d_model, numel)`` for a batch; ``wrt`` (a name or a list)
    restricts the names. dtype and device of ``X``. Holds almost everywhere (ReLU, Lemma 1).

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
    e, (B, L) = X.element_size(), _as_batch(X).shape[:2]
    result = X.numel() * n * e
    check_fits(result, f"the dense Jacobians ({X.numel()} x {n})", X.device)
    work = work_entries(cfg, B, L, "factors", names=names) + X.numel() * max(math.prod(shapes[k]) for k in names)
    check_fits(result + work * e, f"the dense Jacobians ({X.numel()} x {n}) with the forward cache and factors of "
               f"{B * L} tokens", X.device)
    c = forward_cache(params, X, cfg, upstream=not FFN_NAMES.issuperset(names))
    check_forward(c)
    J = jacobian_factors(c._replace(names=names)).J  # only the wanted weights' factors are formed
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
    of ``X``; valid almost everywhere (ReLU, Lemma 1). Derived here (docs/derivations.md §13).

    Raises ``ValueError`` as :func:`forward`, and for a result with a NaN or Inf (an overflow
    on finite inputs, :func:`~blockhess.validation.check_result`); ``InsufficientMemoryError``
    before the forward pass if the ``B`` Jacobians ``(L·d)²``, or they with the forward cache and
    ``X``'s factors (:func:`work_entries`), would not fit in memory.
    """
    check_inputs(params, X, cfg)
    e, (B, L, d) = X.element_size(), _as_batch(X).shape
    result = B * (L * d) ** 2 * e
    check_fits(result, f"the {B} dense input Jacobians ({L * d}x{L * d})", X.device)
    check_fits(result + work_entries(cfg, B, L, "factors", wrt_input=True, names=()) * e,
               f"the {B} dense input Jacobians ({L * d}x{L * d}) with the forward cache and factors of {B * L} tokens",
               X.device)
    c = forward_cache(params, X, cfg, wrt_input=True)
    check_forward(c)
    J = jacobian_factors(c._replace(names=("X",))).J["X"].dense()  # the weights' factors are not needed
    check_result({"the input Jacobian": J})
    return J[0] if X.ndim == 2 else J


def second_derivative(params: dict, X: torch.Tensor, cfg: BlockConfig, a: str, b: str, of: str = "Z") -> torch.Tensor:
    r"""A second derivative of the block in the paper's dense layout, shape ``(N·n_a, n_b)``.

    ``of="Z"``: :math:`H_{tr}^{(a,b)} = \partial^2 Z/\partial W_a \partial W_b` (Theorem 5, eq. 9);
    ``of="S"`` (post-LN): :math:`\xi_{ab} = \partial B_a/\partial W_b`, ``S = Y + FFN(Y)`` (Theorem 5's ξ,
    including ξ_k1, ξ_k2 that the paper leaves out); for ``kind="attention"`` use ``of="F"``:
    :math:`\Phi_{ab} = \partial^2 F/\partial W_a\partial W_b` (§2.3). Rows ``(o, i)`` o-major over
    output entries ``o`` (``N = L·d_model``) and entries ``i`` of ``W_a``; columns entries of
    ``W_b``. ``X`` is one sequence ``(L, d_model)``. Valid almost everywhere (ReLU).

    Raises ``ValueError`` as :func:`forward`, for an unknown name or ``of``, and for a result
    with a NaN or Inf (:func:`~blockhess.validation.check_result`); ``InsufficientMemoryError``
    before the forward pass if the result, or it with the forward cache and factors and the work
    space of the contractions taken at once (:func:`~blockhess.blocks.dense_second_derivative`,
    :func:`work_entries`), would not fit in memory.
    """
    check_inputs(params, X, cfg)
    if X.ndim != 2:
        raise ValueError(f"X must be one sequence (L, d_model) for a dense second derivative, got {tuple(X.shape)}")
    allowed = ("F",) if cfg.kind == "attention" else (("Z", "S") if cfg.norm == "post" else ("Z",))
    if of not in allowed:
        raise ValueError(f"of must be one of {allowed} for kind={cfg.kind!r}, norm={cfg.norm!r}, got {of!r}")
    shapes = param_shapes(cfg)
    for name, n in (("a", a), ("b", b)):
        if not (isinstance(n, str) and n in shapes):
            raise ValueError(f"{name} must be one parameter name of {list(shapes)}, got {n!r}")
    L, e = X.shape[0], X.element_size()
    held, walk = work_entries(cfg, 1, L, "factors"), work_entries(cfg, 1, L, "hessian")
    n_out, (sa, sb) = X.numel(), (math.prod(shapes[a]), math.prod(shapes[b]))
    check_fits(n_out * sa * sb * e, f"the dense d2/d{a}d{b}", X.device)  # the result alone, then with the factors
    check_fits((n_out * sa * sb + held) * e, f"the dense d2/d{a}d{b} with the forward cache and factors", X.device)
    c = forward_cache(params, X, cfg)
    check_forward(c)
    f = jacobian_factors(c)
    if of == "S":
        def contract(g, acc):
            _contract_S(c, f, g, acc)
    else:
        def contract(g, acc):
            contract_output(c, g[None], f, acc)
    D = dense_second_derivative(contract, tuple(X.shape), c.names, shapes, a, b, X, work_bytes=(walk - held) * e)
    check_result({f"the second derivative d2{of}/d{a}d{b}": D})
    return D
