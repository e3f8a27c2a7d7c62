r"""The block's forward pass, its cache and its checks (paper §1.3; options: docs/derivations.md §10–§13).

:func:`forward_cache` is the one forward pass of the closed form: it keeps, in a :class:`Cache` built
by keyword, every quantity the derivatives need (:mod:`.first_order`, Theorem 4; :mod:`.second_order`,
Theorem 5). :func:`check_inputs` runs before it, :func:`check_forward` after it; :func:`work_entries`
sizes it (and the derivatives' work) before any of it is computed. :func:`forward` is the public
plain forward pass.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch

from ..config import BlockConfig, check_window, name_hint, param_shapes
from ..layers import attention, ffn, layernorm
from ..validation import check_finite, check_fits, check_ln_variance, check_params, check_tensor, warn_tf32

__all__ = ["Cache", "FFN_NAMES", "as_batch", "check_forward", "check_inputs", "forward", "forward_cache", "levels",
           "pre_ln", "select_wrt", "variable_shapes", "work_entries", "effective_params", "refuse_llama"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cache:
    """Forward quantities of a batch, built by keyword (:func:`forward_cache`); token axes merged to
    ``T = B·L`` where noted. ``dataclasses.replace(c, names=...)`` narrows the variables."""

    cfg: BlockConfig
    names: tuple[str, ...]  # public names of the variables (``"X"`` first with wrt_input)
    att: attention.Cache
    out: torch.Tensor  # (B, L, d): Z (block) or P (attention)
    params: dict  # the weights, RMSNorm scales as their effective rms_offset + gamma (effective_params)
    X: torch.Tensor  # (B, L, d) block input
    P: torch.Tensor  # (T, d) attention output after W_O
    x_shape: tuple  # shape of X as given: (L, d) or (B, L, d)
    U: torch.Tensor | None = None  # (T, d) LN_1 input, post-LN (the residual sum R); the LN_2 input pre-LN
    fc: ffn.Cache | None = None
    E_Y: torch.Tensor | None = None  # (T, d, d) J_Y per token (post-LN; None pre-LN: Y = R)
    E_Z: torch.Tensor | None = None  # (T, d, d) J_Z per token (identity pre-LN: Z = S)
    J_SY: torch.Tensor | None = None  # (T, d, d)
    ln1: tuple | None = None  # post: (y_1, J_y1) of R; pre: (n_1, J_n1) of X (unscaled)
    ln2: tuple | None = None  # post: (y_2, J_y2) of S
    r1: torch.Tensor | None = None  # (T, 1) LN_1's inverse std 1/σ of its input (post: R; pre: X); None for attention
    r2: torch.Tensor | None = None  # (T, 1) LN_2's of S (post-LN; pre-LN: fc.r)


def as_batch(X: torch.Tensor) -> torch.Tensor:
    """``X`` with a leading batch axis: ``(L, d) -> (1, L, d)``; a batch as it is (a view)."""
    return X[None] if X.ndim == 2 else X


def check_inputs(params: dict, X: torch.Tensor, cfg: BlockConfig) -> None:
    """Validate ``X`` (``(L, d_model)`` or ``(B, L, d_model)``, finite, floating) and ``params``.

    Raises ``ValueError`` naming the argument on a wrong shape, dtype, device, NaN/Inf;
    ``NotImplementedError`` for a sequence longer than ``cfg.sliding_window`` (:func:`~blockhess.config.check_window`);
    warns for float32 on CUDA with TF32 matrix products (:func:`~blockhess.validation.warn_tf32`).
    """
    if not isinstance(cfg, BlockConfig):
        raise ValueError(f"cfg must be a BlockConfig, got {type(cfg).__name__}")
    check_tensor("X", X, ndim=(2, 3), finite=False)  # finite: checked with params
    if X.shape[-1] != cfg.d_model or X.shape[-2] < 1 or (X.ndim == 3 and X.shape[0] < 1):
        raise ValueError(f"X must have shape (L, {cfg.d_model}) or (B, L, {cfg.d_model}) with L >= 1 and B >= 1, "
                         f"got {tuple(X.shape)}")
    check_window(cfg, X.shape[-2])
    check_params(params, param_shapes(cfg), X)
    warn_tf32(X.dtype, X.device)


def pre_ln(cfg: BlockConfig) -> bool:
    """Whether ``cfg`` is a pre-LN block (LayerNorm before each sub-layer)."""
    return cfg.kind == "block" and cfg.norm == "pre"


FFN_NAMES = frozenset(("W_1", "b_1", "W_2", "b_2", "gamma_2", "beta_2"))  # the variables entering at the FFN stage or later


def levels(cfg: BlockConfig, name: str) -> int:
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
      (:func:`levels`): ``d·q`` for ``W_Q``, ``b_Q``; ``H·d²`` for ``W_K`` (each head's rows padded
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

    The coefficients are counts of the tensors the code forms, checked against the peaks
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
    factors = sum(width.get(k, d * d) * levels(cfg, k) for k in names if k in shapes)
    x_terms = wrt_input or (pre_ln(cfg) and any(k in names for k in ("gamma_1", "beta_1")))
    if wrt_input:
        factors += L * d * d * (levels(cfg, "X") + 3)
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
    p = effective_params(params, cfg)
    plain = plain or bool(cfg.llama_options)  # only the matrix-free path reads these: no per-token Jacobians
    Xb = as_batch(X)
    names = tuple(param_shapes(cfg))
    if wrt_input:
        names = ("X",) + names
    d, eps = cfg.d_model, cfg.ln_eps
    upstream = upstream and not plain
    center = cfg.norm_type == "layer"
    ln1 = None
    Xa = Xb
    if pre_ln(cfg):
        n1, r1 = layernorm.normalise(Xb, eps, center=center)
        ln1 = (n1.reshape(-1, d), layernorm.per_token_jacobian(n1, r1, center=center).reshape(-1, d, d)
               if upstream else None)
        Xa = layernorm.affine(n1, p.get("gamma_1"), p.get("beta_1"))
    rope = cfg.rope_theta if cfg.rope else None
    att = attention.forward(Xa, p["W_Q"], p["W_K"], p["W_V"], p.get("b_Q"), p.get("b_K"), p.get("b_V"),
                            cfg.n_heads, cfg.causal, cfg.kv_heads, rope)
    P = att.F
    if cfg.out_proj:
        P = P @ p["W_O"]
        if "b_O" in p:
            P = P + p["b_O"]
    if cfg.kind == "attention":
        return Cache(cfg=cfg, names=names, att=att, out=P, params=p, X=Xb, P=P.reshape(-1, d), x_shape=tuple(X.shape))
    U = (Xb + P).reshape(-1, d)
    g1, g2 = p.get("gamma_1"), p.get("gamma_2")
    gate = {"W_G": p.get("W_G"), "b_G": p.get("b_G"), "center": center}
    if cfg.norm == "post":
        y1, r1 = layernorm.normalise(U, eps, center=center)
        fc = ffn.forward(layernorm.affine(y1, g1, p.get("beta_1")), p["W_1"], p["W_2"], p.get("b_1"), p.get("b_2"),
                         cfg.activation, **gate)
        y2, r2 = layernorm.normalise(fc.S, eps, center=center)
        Z = layernorm.affine(y2, g2, p.get("beta_2"))
        J1 = layernorm.per_token_jacobian(y1, r1, center=center) if upstream else None
        J2 = None if plain else layernorm.per_token_jacobian(y2, r2, center=center)
        E_Y = J1 if g1 is None or J1 is None else g1[:, None] * J1
        E_Z = J2 if g2 is None or J2 is None else g2[:, None] * J2
        ln1, ln2 = (y1, J1), (y2, J2)
        J_SY = ffn.input_jacobian(fc) if upstream else None
        return Cache(cfg=cfg, names=names, att=att, out=Z.reshape(Xb.shape), params=p, X=Xb, P=P.reshape(-1, d),
                     x_shape=tuple(X.shape), U=U, fc=fc, E_Y=E_Y, E_Z=E_Z, J_SY=J_SY, ln1=ln1, ln2=ln2,
                     r1=r1.reshape(-1, 1), r2=r2.reshape(-1, 1))
    fc = ffn.forward(U, p["W_1"], p["W_2"], p.get("b_1"), p.get("b_2"), cfg.activation, pre_ln=True, ln_eps=eps,
                     gamma=g2, beta=p.get("beta_2"), jacobian=not plain, **gate)
    eye = None if plain else torch.eye(d, dtype=X.dtype, device=X.device).expand(U.shape[0], d, d)
    J_SY = ffn.input_jacobian(fc) if upstream else None
    return Cache(cfg=cfg, names=names, att=att, out=fc.S.reshape(Xb.shape), params=p, X=Xb, P=P.reshape(-1, d),
                 x_shape=tuple(X.shape), U=U, fc=fc, E_Z=eye, J_SY=J_SY, ln1=ln1, r1=r1.reshape(-1, 1))


def effective_params(params: dict, cfg: BlockConfig) -> dict:
    """``params`` with each RMSNorm scale as the forward uses it, ``rms_offset + gamma`` (Gemma's
    ``1 + gamma``); ``params`` itself when ``rms_offset`` is 0. The derivatives w.r.t. ``gamma`` are
    those w.r.t. the effective scale (a shift), so every kernel reads the effective one."""
    if not cfg.rms_offset:
        return params
    return {k: (v + cfg.rms_offset if k in ("gamma_1", "gamma_2") else v) for k, v in params.items()}


def check_forward(c: Cache, first: int = 0) -> None:
    """The forward pass on checked inputs: every LayerNorm input row (``check_ln_variance``: finite,
    ``var + ln_eps`` above its values' rounding and ``tiny/e``; Assumption 2 with ``ln_eps = 0``),
    and the output finite (one sum): an overflow inside, e.g. of float32 attention scores or of
    a post-LN output ``gamma * y``, is an error, not a Hessian of NaN. ``first``: the batch index
    of ``c``'s first sequence (a pass over part of a batch), for the rows the errors name."""
    eps, shape = c.cfg.ln_eps, c.x_shape  # rows named as X's: (t,) or (b, t)
    rms = c.cfg.norm_type == "rms"  # RMSNorm: mean(x²) + eps in place of var + eps

    def rows(name, U, **kw):
        U = U.reshape(shape)
        check_ln_variance(name, U, eps, stats=layernorm.rms_stats(U) if rms else None, first=first, rms=rms, **kw)

    norm = "RMSNorm" if rms else "LayerNorm"
    if c.cfg.kind == "block" and c.cfg.norm == "post":
        rows(f"the {norm}-1 input X + SA(X)", c.U, computed=True)
        rows(f"the {norm}-2 input Y + FFN(Y)", c.fc.S, computed=True)
    elif c.cfg.kind == "block":
        rows(f"X (the {norm}-1 input, pre-LN)", c.X)
        rows(f"the {norm}-2 input Y = X + SA(LN_1(X)), pre-LN", c.U, computed=True)
    check_finite({"the block output": c.out}, f": the forward pass overflowed {c.out.dtype} on finite inputs; "
                 "rescale X or the weights")



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
    B, L = as_batch(X).shape[:2]
    check_fits(work_entries(cfg, B, L, "forward") * X.element_size(), f"the forward pass over {B * L} tokens", X.device)
    c = forward_cache(params, X, cfg, plain=True)
    check_forward(c)
    return c.out.reshape(X.shape)


def select_wrt(names: tuple[str, ...], wrt) -> tuple[str, ...]:
    """The names of ``wrt`` (``None``: all; a name; or an iterable of names) in the canonical order of
    ``names``. Raises ``ValueError`` for another type, an empty ``wrt`` or a name not in ``names``
    (with :func:`~blockhess.config.name_hint` for a PyTorch parameter name, a block's name in a model, ``X``)."""
    if wrt is None:
        return names
    given = wrt
    wrt = (wrt,) if isinstance(wrt, str) else tuple(wrt) if isinstance(wrt, Iterable) else None
    if wrt is None or not all(isinstance(w, str) for w in wrt):
        raise ValueError(f"wrt must be None, a parameter name or a list of names from {list(names)}, got {given!r}")
    unknown = [w for w in wrt if w not in names]
    if unknown or not wrt:
        hint = name_hint(unknown, names)
        raise ValueError(f"wrt must be a non-empty subset of {list(names)}, got {list(wrt)}{hint}")
    return tuple(n for n in names if n in wrt)


def variable_shapes(c: Cache) -> dict[str, tuple[int, ...]]:
    """Shapes of the variables of ``c`` (``X`` first when present)."""
    shapes = dict(param_shapes(c.cfg))
    return {"X": c.x_shape, **shapes} if "X" in c.names else shapes


def refuse_llama(cfg, what: str) -> None:
    """Raise ``NotImplementedError`` naming ``what`` and the options of ``cfg`` it does not take
    (:attr:`~blockhess.config.BlockConfig.llama_options`; docs/derivations.md §20), before any work."""
    options = getattr(cfg, "llama_options", ())
    if options:
        raise NotImplementedError(f"{what} does not take {', '.join(options)} yet (docs/derivations.md §20): "
                                  "blockhess.hessian and blockhess.hessian_operator's products do")
