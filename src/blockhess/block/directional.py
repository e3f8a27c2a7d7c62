r"""The block's exact Hessian-vector product, matrix-free: a tangent pass forward and a second-order
adjoint pass back, each layer's product rule in closed form (no autograd; docs/derivations.md §18).

For the loss :math:`\ell(Z(\theta, X))` of a block, directions :math:`v = (\dot\theta, \dot X)` and the
first-order adjoints :math:`g_\bullet` (the gradient back-propagated to every node, once per operator:
:func:`adjoints`), the product :math:`Hv` is the tangent of the gradient along ``v``:

* forward, every node's tangent :math:`\dot n = \partial_{in} f\,\dot{in} + \partial_\theta f\,\dot\theta`
  (each layer's ``tangent``), up to the output's :math:`\dot Z`;
* at the output, :math:`\dot g_Z = \Omega\,\dot Z` (``omega``: the loss Hessian applied, or the Hessian
  of whatever lies above a block inside a model);
* back, every node's adjoint tangent :math:`\dot g_{in} = J^\top\dot g_{out} + [\dot J^\top g_{out}]` and
  every weight's :math:`(Hv)_\theta = \dot g_\theta` (each layer's ``second_adjoint``), down to the
  input's :math:`\dot g_X`.

The bracketed terms, linear in the cached adjoints ``g``, are the functional part; without them
(``functional=False``) the pass is :math:`J^\top\Omega J v` (Gauss–Newton), and with
:math:`\dot g_Z = 0` (``outer=False``) it is the functional part alone: outer + functional = full
exactly, as for :func:`blockhess.hessian`. ``k`` directions ride along a leading axis: every
product is a batched matrix product, memory ``O(k ×`` the forward activations) (:func:`work_entries`).
A product can be restricted to the rows it needs (``hvp(..., wanted=)``: only those rows are formed,
and the pass back stops below the lowest of them); :func:`vjp` is the pass back alone, for a block
with no direction (docs/derivations.md §18, "Restricted products").
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..config import param_shapes
from ..layers import attention, ffn, layernorm, linear
from ..layers.linear import add
from ..validation import check_bool, check_finite, check_fits, check_tensor
from .forward_pass import Cache, pre_ln

__all__ = ["Adjoints", "adjoints", "hvp", "vjp", "jvp", "work_entries"]


class Adjoints(NamedTuple):
    """The first-order adjoints of one output adjoint ``g`` through a block (:func:`adjoints`): what
    the second-order terms of every product read, computed once per operator. Tokens flattened
    ``(T, d)`` unless noted; ``None`` where a setting has no such node."""

    gZ: torch.Tensor  # (T, d) at the output
    gS: torch.Tensor | None  # (T, d) at LN_2's input S (post-LN; pre-LN: gZ itself)
    fc: ffn.Adjoint | None  # the FFN's, of gS
    gU: torch.Tensor | None  # (T, d) at the residual sum R (LN_1's input post-LN; the FFN's input pre-LN)
    gP: torch.Tensor  # (B, L, d) at the attention's output after W_O
    gF: torch.Tensor  # (B, L, d) at the heads' concatenated output O (W_O's input)
    att: attention.Adjoint
    gX1: torch.Tensor | None  # (T, d) pre-LN: LN_1's input adjoint of the attention's input adjoint
    gX: torch.Tensor | None = None  # (B, L, d) pre-LN: the block's input adjoint gU + gX1 (the gradient at X)


def _center(cfg) -> bool:
    """Whether the block's norms centre their rows: LayerNorm (``True``) or RMSNorm (``False``)."""
    return getattr(cfg, "norm_type", "layer") == "layer"


def _none_adjoints() -> Adjoints:
    """Adjoints that are never read: the Gauss–Newton product (``functional=False``) needs none."""
    return Adjoints(gZ=None, gS=None, fc=ffn.Adjoint(*(None,) * len(ffn.Adjoint._fields)), gU=None, gP=None,
                    gF=None, att=attention.Adjoint(*(None,) * len(attention.Adjoint._fields)), gX1=None)


def adjoints(c: Cache, g: torch.Tensor) -> Adjoints:
    r"""The first-order adjoints of the output adjoint ``g`` ``(B, L, d)`` (the loss gradient at the
    block's output ``c.out``, batch mean included) at every node of the block: the gradient's
    backward pass, :math:`g_{in} = J^\top g_{out}` layer by layer, from the cache ``c`` of
    :func:`~blockhess.block.forward_cache` (any of its modes). Returns the :class:`Adjoints`, in
    ``g``'s dtype and device. Kernel: no checks (:func:`hvp` checks ``g``)."""
    cfg, p = c.cfg, c.params
    B, L, d = c.X.shape
    gZ = g.reshape(-1, d)
    gS = fc = gU = gX1 = None
    if cfg.kind == "attention":
        gP = g.reshape(B, L, d)
    else:
        if pre_ln(cfg):
            gS = gZ
        else:
            gS = layernorm.adjoint(c.ln2[0], c.r2, gZ, p.get("gamma_2"), center=_center(cfg))
        fc = ffn.adjoint(c.fc, gS)
        gU = fc.g_Y if pre_ln(cfg) else layernorm.adjoint(c.ln1[0], c.r1, fc.g_Y, p.get("gamma_1"), center=_center(cfg))
        gP = gU.reshape(B, L, d)
    gF = linear.adjoint(p["W_O"], gP) if cfg.out_proj else gP
    att = attention.adjoint(c.att, p, gF, want_input=pre_ln(cfg), n=c.ln1[0] if pre_ln(cfg) else None)
    gX = None
    if pre_ln(cfg):
        gX1 = layernorm.adjoint(c.ln1[0], c.r1, att.gX.reshape(-1, d), p.get("gamma_1"), center=_center(cfg))
        gX = (gU + gX1).reshape(B, L, d)
    return Adjoints(gZ=gZ, gS=gS, fc=fc, gU=gU, gP=gP, gF=gF, att=att, gX1=gX1, gX=gX)


def work_entries(cfg, B: int, L: int, k: int, weights=None) -> int:
    r"""An upper estimate of the tensor entries one :func:`hvp` of ``k`` directions holds at once for
    ``B`` sequences of ``L`` tokens, its result included (the forward cache, the :class:`Adjoints` and
    the directions not: they are the operator's and the caller's). Per token and direction, with
    ``d`` the width, ``d_ff`` the FFN width, ``H`` heads, ``q = H·d_k``: the tangents of ``Q, K`` and
    their adjoints' with temporaries (``6q``), of the scores and weights and their adjoints with the
    softmax's temporaries (``10HL``), two dozen rows of ``d`` (or of ``H·d_v`` where wider) and six of
    ``d_ff`` (ten for a gated FFN); per direction,
    four copies of the ``n`` weights (the result, its summands, the directions laid out for one
    matrix product), ``n`` the entries of the weights in ``weights`` (a collection of names: those with a
    direction or wanted rows; empty for a model's tangent passing through the block; ``None``: every
    weight). The coefficients are counts checked against the peaks (docs/derivations.md §18)."""
    d, H = cfg.d_model, cfg.n_heads
    q = H * cfg.head_dim
    w = max(d, H * getattr(cfg, "value_dim", d // H))  # a row of d, or of the heads' H·d_v outputs if wider
    ff = cfg.d_ff if cfg.kind == "block" else 0
    ff_rows = 10 if getattr(cfg, "gated", False) else 6  # a gated FFN: the gate's tangent and adjoints as well
    n = sum(math.prod(s) for name, s in param_shapes(cfg).items() if weights is None or name in weights)
    return k * (B * L * (6 * q + 24 * w + 10 * H * L + ff_rows * ff) + 4 * n)


def _directions(c: Cache, V, dX, shapes: dict) -> tuple[dict, torch.Tensor | None, int]:
    """Check ``V`` and ``dX`` against the cache; returns ``(dp, dX (k, B, L, d) or None, k)``."""
    if not isinstance(V, dict):
        raise ValueError(f"V must be a dict name -> (k, *shape) tensor over the weights {list(shapes)}, "
                         f"got {type(V).__name__}")
    bad = [n for n in V if n not in shapes]
    if bad:
        hint = "; the input's directions go in dX" if "X" in bad else ""
        raise ValueError(f"V must map names of the block's weights {list(shapes)}, got {bad}{hint}")
    k = None
    for n, v in V.items():
        check_tensor(f"V[{n!r}]", v, like=c.X, finite=False)  # finite: with dX below, in one check
        if v.ndim != len(shapes[n]) + 1 or tuple(v.shape[1:]) != tuple(shapes[n]) or v.shape[0] < 1:
            raise ValueError(f"V[{n!r}] must have shape (k, {', '.join(map(str, shapes[n]))}) with k >= 1 "
                             f"(k directions stacked on a leading axis), got {tuple(v.shape)}")
        if k is not None and v.shape[0] != k:
            raise ValueError(f"every V[name] must hold the same number k of directions, got {k} and "
                             f"{v.shape[0]} for {n!r}")
        k = v.shape[0]
    if dX is not None:
        check_tensor("dX", dX, like=c.X, finite=False)
        B, L, d = c.X.shape
        ok = (dX.ndim == 4 and tuple(dX.shape[1:]) == (B, L, d)) or (
            dX.ndim == len(c.x_shape) + 1 and tuple(dX.shape[1:]) == tuple(c.x_shape))
        if not ok or dX.shape[0] < 1 or (k is not None and dX.shape[0] != k):
            want = "k" if k is None else str(k)
            raise ValueError(f"dX must have shape ({want}, {B}, {L}, {d}) (the input's directions, as many as V's), "
                             f"got {tuple(dX.shape)}")
        k = dX.shape[0]
        dX = dX.reshape(k, B, L, d)
    if k is None:
        raise ValueError("hvp needs at least one direction: V must not be empty unless dX is given")
    check_finite({**{f"V[{n!r}]": v for n, v in V.items()}, **({} if dX is None else {"dX": dX})})
    return {n: V.get(n) for n in shapes}, dX, k


#: the block's weights by the layer whose second-order adjoint forms their rows (the pass runs top to bottom)
_ATTENTION = frozenset(("W_Q", "b_Q", "W_K", "b_K", "W_V", "b_V"))
_OUT = frozenset(("W_O", "b_O"))
_LN1, _LN2 = frozenset(("gamma_1", "beta_1")), frozenset(("gamma_2", "beta_2"))
_FFN = frozenset(("W_G", "b_G", "W_1", "b_1", "W_2", "b_2"))


def _wanted(wanted, shapes: dict) -> frozenset:
    """``wanted`` checked: ``None`` (every weight) or a collection of the block's weight names."""
    if wanted is None:
        return frozenset(shapes)
    if isinstance(wanted, str) or not hasattr(wanted, "__iter__"):
        raise ValueError(f"wanted must be None or a collection of the block's weight names {list(shapes)}, "
                         f"got {wanted!r}")
    wanted = tuple(wanted)
    bad = [n for n in wanted if n not in shapes]
    if bad:
        raise ValueError(f"wanted must name weights of the block {list(shapes)}, got {bad}")
    return frozenset(wanted)


class _Tangents(NamedTuple):
    """The tangent pass's nodes that the pass back reads (``None`` where zero)."""

    dXa: torch.Tensor | linear.Scaled | None  # (k, B, L, d) the attention's input (LN_1's output pre-LN; X
    # post-LN); pre-LN without dX or dgX: linear.Scaled (LN_1's rows n_1 fixed, γ̇_1, β̇_1)
    ln1: tuple  # (dy, rho) of LN_1's normalised rows
    ln2: tuple  # (dy, rho) of LN_2's (post-LN)
    ta: attention.Tangent
    tf: ffn.Tangent | None
    dZ: torch.Tensor | None  # (k, T, d) the output's


def _no_tangents(cfg) -> _Tangents:
    """Every tangent zero: the pass back of :func:`vjp` (no direction in the block)."""
    tf = None if cfg.kind == "attention" else ffn.Tangent(*(None,) * len(ffn.Tangent._fields))
    return _Tangents(None, (None, None), (None, None), attention.Tangent(*(None,) * len(attention.Tangent._fields)),
                     tf, None)


def _reshaped(t, *shape):
    """``t`` reshaped to ``shape`` (``(k, T, d)`` tokens, ``(k, B, L, d)`` sequences), or ``None``."""
    return None if t is None else t.reshape(shape)


def _tangents(c: Cache, dp: dict, dX, k: int, scaled: bool, m=None) -> _Tangents:
    """The tangent pass, forward, along the weights' directions ``dp`` and the input's ``dX``
    ``(k, B, L, d)`` or ``None`` (docs/derivations.md §18, "The block"). ``scaled``: pre-LN with ``dX``
    ``None``, the attention's input direction as a :class:`~blockhess.layers.linear.Scaled` (for a
    pass back that needs no input adjoint; docs/derivations.md §18, "A LayerNorm below nothing that
    moves"). ``m``: the softmax's peaks (the attention's :class:`~blockhess.layers.attention.Adjoint`'s)
    or ``None``."""
    cfg, p = c.cfg, c.params
    pre = pre_ln(cfg)
    B, L, d = c.X.shape

    def tokens(t):
        return _reshaped(t, k, B * L, d)

    ln1 = ln2 = (None, None)
    dXa = dX
    if pre and dX is None and scaled:
        dXa = linear.Scaled(c.ln1[0], p.get("gamma_1"), p.get("beta_1"), dp.get("gamma_1"), dp.get("beta_1"))
    elif pre:
        if dX is not None:
            ln1 = layernorm.tangent(c.ln1[0], c.r1, tokens(dX), center=_center(cfg))
        dXa = layernorm.affine_tangent(c.ln1[0], ln1[0], p.get("gamma_1"), dp.get("gamma_1"), dp.get("beta_1"))
        dXa = None if dXa is None else dXa.reshape(k, B, L, d)
    ta = attention.tangent(c.att, p, dp, dXa, m)
    dP = ta.dF
    if cfg.out_proj:
        dP = linear.tangent(c.att.F, p["W_O"], ta.dF, dp.get("W_O"), dp.get("b_O"))
    tf = None
    if cfg.kind == "attention":
        dZ = tokens(dP)
    else:
        dU = tokens(add(dX, dP))
        if pre:
            tf = ffn.tangent(c.fc, p, dp, dU)
            dZ = tf.dS
        else:
            if dU is not None:
                ln1 = layernorm.tangent(c.ln1[0], c.r1, dU, center=_center(cfg))
            dY = layernorm.affine_tangent(c.ln1[0], ln1[0], p.get("gamma_1"), dp.get("gamma_1"), dp.get("beta_1"))
            tf = ffn.tangent(c.fc, p, dp, dY)
            if tf.dS is not None:
                ln2 = layernorm.tangent(c.ln2[0], c.r2, tf.dS, center=_center(cfg))
            dZ = layernorm.affine_tangent(c.ln2[0], ln2[0], p.get("gamma_2"), dp.get("gamma_2"), dp.get("beta_2"))
    return _Tangents(dXa, ln1, ln2, ta, tf, dZ)


def _back(c: Cache, a: Adjoints, dp: dict, tg: _Tangents, dgZ, want: frozenset, want_dgX: bool, second: bool,
          k: int, into=None) -> tuple[dict, torch.Tensor | None]:
    """The second-order adjoint pass, back from the output adjoint's tangent ``dgZ`` ``(k, B, L, d)``
    (or ``None``), restricted: each layer forms the rows of the weights in ``want`` only, and the pass
    stops below the lowest of them unless ``want_dgX``. Returns ``(rows, dgX)``: name → ``(k, *shape)``
    or ``None`` (zero) for the names of ``want``, and the input's ``(k, B, L, d)`` or ``None``."""
    cfg, p = c.cfg, c.params
    pre = pre_ln(cfg)
    B, L, d = c.X.shape
    T = B * L

    def tokens(t):
        return _reshaped(t, k, T, d)

    def seqs(t):
        return _reshaped(t, k, B, L, d)

    def has(group):
        return bool(want & group)

    def ln_vars(i):
        return (f"gamma_{i}" in want, f"beta_{i}" in want)

    hv: dict = {}

    def keep(found: dict):
        hv.update({n: v for n, v in found.items() if n in want})

    ln1, ln2, ta, tf = tg.ln1, tg.ln2, tg.ta, tg.tf
    att_input = want_dgX or (pre and has(_LN1))  # the attention's input adjoint is read below it
    go_att = att_input or has(_ATTENTION)  # the pass reaches the attention
    dgU = None
    if cfg.kind == "attention":
        dgP = dgZ
    else:
        if pre:  # the FFN (LN_2 inside), then the residual sum R
            go = go_att or has(_OUT)
            if go or has(_FFN | _LN2):
                dgU, found = ffn.second_adjoint(c.fc, p, dp, a.fc, tf, tokens(dgZ), second, go, want & (_FFN | _LN2),
                                                into)
                keep(found)
        else:  # LN_2, the FFN, LN_1
            go_l1 = go_att or has(_OUT)
            go_f = go_l1 or has(_LN1)
            go_l2 = go_f or has(_FFN)
            dgS = dgY = None
            if go_l2 or has(_LN2):
                dgS, hg, hb = layernorm.second_adjoint(c.ln2[0], c.r2, a.gZ, a.gS, tokens(dgZ), ln2[0], ln2[1],
                                                       p.get("gamma_2"), dp.get("gamma_2"), second, go_l2, ln_vars(2),
                                                       center=_center(cfg))
                keep({"gamma_2": hg, "beta_2": hb})
            if go_l2:
                dgY, found = ffn.second_adjoint(c.fc, p, dp, a.fc, tf, dgS, second, go_f, want & _FFN, into)
                keep(found)
            if go_f:
                dgU, hg, hb = layernorm.second_adjoint(c.ln1[0], c.r1, a.fc.g_Y, a.gU, dgY, ln1[0], ln1[1],
                                                       p.get("gamma_1"), dp.get("gamma_1"), second, go_l1, ln_vars(1),
                                                       center=_center(cfg))
                keep({"gamma_1": hg, "beta_1": hb})
        dgP = seqs(dgU)
    dgF = dgP
    if cfg.out_proj and (go_att or has(_OUT)):
        dgF, hW, hb = linear.second_adjoint(c.att.F, p["W_O"], a.gP, dgP, ta.dF, dp.get("W_O"), second, go_att,
                                            bias="b_O" in want, weight="W_O" in want, out=(into or {}).get("W_O"))
        keep({"W_O": hW, "b_O": hb})
    dgXa = None
    if go_att:
        dgXa, found = attention.second_adjoint(c.att, p, dp, a.att, ta, dgF, tg.dXa, second, att_input,
                                               want & _ATTENTION, into)
        keep(found)
    if pre and att_input and isinstance(tg.dXa, linear.Scaled):  # LN_1's rows Σ ġ ⊙ n_1, Σ ġ (ṅ_1 = 0)
        hg, hb = (None, None) if dgXa is None else dgXa
        keep({"gamma_1": hg, "beta_1": hb})
        dgXa = None
    elif pre and att_input:
        gX = None if a.att.gX is None else a.att.gX.reshape(T, d)
        dgX1, hg, hb = layernorm.second_adjoint(c.ln1[0], c.r1, gX, a.gX1, tokens(dgXa), ln1[0], ln1[1],
                                                p.get("gamma_1"), dp.get("gamma_1"), second, want_dgX, ln_vars(1),
                                                center=_center(cfg))
        keep({"gamma_1": hg, "beta_1": hb})
        dgXa = seqs(dgX1)
    dgX = None
    if want_dgX:
        dgX = add(seqs(dgU), dgXa)
        if dgX is None:
            dgX = c.X.new_zeros(k, B, L, d)
    return hv, dgX


def _rows(c: Cache, hv: dict, names, shapes: dict, k: int) -> dict:
    """The rows of ``names`` (canonical order), a zero tensor where ``hv`` has ``None`` (an exact zero)."""
    return {n: hv[n] if hv.get(n) is not None else c.X.new_zeros(k, *shapes[n]) for n in shapes if n in names}


def hvp(c: Cache, g, V: dict, omega=None, dX=None, outer: bool = True, functional: bool = True,
        input_adjoint: bool | None = None, wanted=None, into=None) -> tuple[dict, torch.Tensor | None]:
    r"""The exact Hessian-vector products of a block's loss along ``k`` directions at once:
    ``(HV, dgX)``, matrix-free (no ``n × n`` object, no autograd).

    ``c``: the :class:`~blockhess.block.Cache` of :func:`~blockhess.block.forward_cache` (any mode;
    ``plain=True`` forms no per-token Jacobian and suits large blocks), built once and reused by every
    product. ``g``: the loss gradient at the output ``c.out``, ``(B, L, d)`` (batch mean included, as
    :func:`blockhess.losses.derivatives` gives it), or its :func:`adjoints` computed once (reuse them
    across products); may be ``None`` with ``functional=False``. ``V``: weight name → ``k``
    directions ``(k, *shape)`` (names of :func:`~blockhess.config.param_shapes`; an absent name is a
    zero direction). ``omega``: a callable ``omega(dZ) -> dgZ``, ``(k, B, L, d)`` to ``(k, B, L, d)``,
    applying the loss Hessian w.r.t. the output to the output's tangent (MSE: a scaling; CE: per token
    ``(diag p - p pᵀ) dz`` without forming it; inside a model, the Hessian of the stages above);
    required with ``outer=True``, and then called once, with a zero tangent where no direction reaches
    the output (``b_K``'s alone), and also when nothing is wanted back (its value then unread: inside a
    model it runs the stages above). ``dX``: the input's directions ``(k, B, L, d)`` (or ``(k, L, d)``
    for an unbatched input), optional. ``outer``, ``functional``: which part of the Hessian (both: the
    full one; ``outer`` alone: Gauss–Newton :math:`J^\top\Omega J V`; ``functional`` alone:
    :math:`\dot g_Z = 0`). ``input_adjoint``: whether to return ``dgX`` (default: when ``dX`` is given).
    ``wanted``: the weights whose rows are wanted, a collection of names (default ``None``: every
    weight). The pass back forms only those rows (each layer skips the GEMMs of the others) and stops
    below the lowest of them unless ``input_adjoint``: ``W_2``'s rows are its own two GEMMs, ``W_1``'s
    the FFN's, and only the attention's weights (and pre-LN ``LN_1``'s) need the pass through the
    whole block (docs/derivations.md §18, "Restricted products"); the tangent pass always runs from
    the lowest direction up. ``into``: weight name → a contiguous ``(k, *shape)`` tensor of ``c.X``'s dtype
    and device that the layer writes the weight's rows into where it forms them as one product (the
    projections' weights; ``HV[name]`` is then that tensor: an operator's output slice, no copy); the
    other rows are new tensors.

    Returns ``HV``: name → ``(k, *shape)``, the rows of :math:`H\,[V; dX]` of every weight of ``wanted``
    (default: of the block), in canonical order, exactly zero where the product is (``b_K``'s always);
    a weight not wanted has no entry (never a zero stand-in). ``dgX`` ``(k, B, L, d)``: the input's
    rows (the tangent of the input adjoint, for the stages below in a model), or ``None`` when not
    asked. dtype and device of ``c.X``. Results hold almost everywhere for ReLU (off its kinks,
    Lemma 1). Source: each layer's tangent and second-order adjoint (docs/derivations.md §18).

    Raises ``ValueError``: ``c`` not a Cache; ``V`` not a dict of weight names (``"X"``: use ``dX``)
    with tensors ``(k, *shape)`` of ``c.X``'s dtype and device, finite, one ``k``; ``dX`` of another
    shape, dtype, device or ``k``; no direction at all; ``g`` not ``(B, L, d)`` (or missing with
    ``functional=True``); ``omega`` missing or not callable with ``outer=True``, or returning another
    shape, dtype or device, or NaN/Inf (checked where read); ``outer``, ``functional`` not bools or both
    ``False``; ``wanted`` not a collection of the block's weight names. ``InsufficientMemoryError``
    before any work if the products' working set (:func:`work_entries`) would not fit.
    """
    if not isinstance(c, Cache):
        raise ValueError(f"c must be a blockhess.block.Cache (from forward_cache), got {type(c).__name__}")
    check_bool("outer", outer)
    check_bool("functional", functional)
    if not (outer or functional):
        raise ValueError("outer and functional are both False: ask for at least one part of the Hessian")
    if input_adjoint is not None:
        check_bool("input_adjoint", input_adjoint)
    cfg = c.cfg
    shapes = {n: tuple(s) for n, s in param_shapes(cfg).items()}
    want = _wanted(wanted, shapes)
    dp, dX, k = _directions(c, V, dX, shapes)
    want_dgX = dX is not None if input_adjoint is None else input_adjoint
    B, L, d = c.X.shape
    if outer and not callable(omega):
        raise ValueError("omega must be a callable omega(dZ) -> (k, B, L, d) applying the loss Hessian to the "
                         f"output's tangent, required with outer=True; got {type(omega).__name__}")
    if functional:
        if isinstance(g, Adjoints):
            a = g
        else:
            if g is None:
                raise ValueError("g (the loss gradient at the block output, (B, L, d)) is required with functional=True")
            check_tensor("g", g, like=c.X)
            if tuple(g.shape) not in ((B, L, d), tuple(c.x_shape)):
                raise ValueError(f"g must have the output's shape ({B}, {L}, {d}), got {tuple(g.shape)}")
            a = None
    check_fits(work_entries(cfg, B, L, k, weights={n for n, v in dp.items() if v is not None} | want) * c.X.element_size(),
               f"the Hessian-vector products of {k} directions", c.X.device)
    if functional and a is None:
        a = adjoints(c, g.reshape(B, L, d))
    if not functional:
        a = _none_adjoints()

    tg = _tangents(c, dp, dX, k, scaled=not want_dgX, m=a.att.m)
    back = bool(want) or want_dgX
    dgZ = None
    if outer:
        dZ = c.X.new_zeros(k, B, L, d) if tg.dZ is None else tg.dZ.reshape(k, B, L, d)
        dgZ = omega(dZ)
        if back:
            if not isinstance(dgZ, torch.Tensor) or tuple(dgZ.shape) != (k, B, L, d):
                got = tuple(dgZ.shape) if isinstance(dgZ, torch.Tensor) else type(dgZ).__name__
                raise ValueError(f"omega(dZ) must return a tensor of dZ's shape ({k}, {B}, {L}, {d}), got {got}")
            check_tensor("omega(dZ)", dgZ, like=c.X)
    if not back:
        return {}, None
    if into:
        for n, t in into.items():
            if n not in shapes or not isinstance(t, torch.Tensor) or tuple(t.shape) != (k, *shapes[n]) \
                    or t.dtype != c.X.dtype or t.device != c.X.device or not t.is_contiguous():
                raise ValueError(f"into[{n!r}] must be a contiguous ({k}, *{shapes.get(n)}) tensor of {c.X.dtype} "
                                 f"on {c.X.device}")
    hv, dgX = _back(c, a, dp, tg, dgZ, want, want_dgX, functional, k, into)
    return _rows(c, hv, want, shapes, k), dgX


def vjp(c: Cache, W: torch.Tensor, wanted=None, input_adjoint: bool = True) -> tuple[dict, torch.Tensor | None]:
    r"""The vector–Jacobian products of ``k`` output adjoints at once: ``(rows, dgX)`` with
    :math:`J_\theta^\top w` for the weights of ``wanted`` (default ``None``: every one) and
    :math:`J_X^\top w` (``input_adjoint``), for ``W`` ``(k, B, L, d)`` at the block's output.

    The pass back of :func:`hvp` when the block has no direction and no input tangent (every
    second-order term is then zero): inside a model, the block below every direction, or the
    gradient's own pass (``k = 1``). ``c`` as for :func:`hvp`; restricted as there (only ``wanted``'s
    rows, and the pass stops below the lowest of them without ``input_adjoint``). Returns rows
    name → ``(k, *shape)`` for the names of ``wanted`` (canonical order; absent: not wanted) and
    ``dgX`` ``(k, B, L, d)`` or ``None``; dtype and device of ``c.X``. Source: each layer's
    ``second_adjoint`` without its second-order terms (docs/derivations.md §18).

    Raises ``ValueError``: ``c`` not a Cache; ``W`` not a finite tensor ``(k, B, L, d)`` (``k >= 1``)
    of ``c.X``'s dtype and device; ``wanted`` not a collection of the block's weight names;
    ``input_adjoint`` not a bool. ``InsufficientMemoryError`` as :func:`hvp`.
    """
    if not isinstance(c, Cache):
        raise ValueError(f"c must be a blockhess.block.Cache (from forward_cache), got {type(c).__name__}")
    check_bool("input_adjoint", input_adjoint)
    shapes = {n: tuple(s) for n, s in param_shapes(c.cfg).items()}
    want = _wanted(wanted, shapes)
    B, L, d = c.X.shape
    check_tensor("W", W, like=c.X)
    if W.ndim != 4 or tuple(W.shape[1:]) != (B, L, d) or W.shape[0] < 1:
        raise ValueError(f"W must have shape (k, {B}, {L}, {d}) (k >= 1 adjoints at the output), got {tuple(W.shape)}")
    k = W.shape[0]
    check_fits(work_entries(c.cfg, B, L, k) * c.X.element_size(), f"the vector-Jacobian products of {k} adjoints",
               c.X.device)
    hv, dgX = _back(c, _none_adjoints(), {n: None for n in shapes}, _no_tangents(c.cfg), W, want, input_adjoint,
                    False, k)
    return _rows(c, hv, want, shapes, k), dgX


def jvp(c: Cache, V: dict, dX=None) -> torch.Tensor:
    r"""The Jacobian-vector products of ``k`` directions at once: the output's tangent
    :math:`\dot Z = J_\theta V + J_X\,\dot X`, ``(k, B, L, d)``, the tangent pass of :func:`hvp` alone.
    ``c``, ``V``, ``dX`` as for :func:`hvp` (at least one direction); exactly zero where no direction
    reaches the output (``b_K``'s without RoPE). dtype and device of ``c.X``. Source: each layer's
    ``tangent`` (docs/derivations.md §18). Raises ``ValueError`` as :func:`hvp` for ``c``, ``V``,
    ``dX``; ``InsufficientMemoryError`` as :func:`hvp`."""
    if not isinstance(c, Cache):
        raise ValueError(f"c must be a blockhess.block.Cache (from forward_cache), got {type(c).__name__}")
    shapes = {n: tuple(s) for n, s in param_shapes(c.cfg).items()}
    dp, dX, k = _directions(c, V, dX, shapes)
    B, L, d = c.X.shape
    check_fits(work_entries(c.cfg, B, L, k) * c.X.element_size(), f"the Jacobian-vector products of {k} directions",
               c.X.device)
    dZ = _tangents(c, dp, dX, k, scaled=False).dZ
    return c.X.new_zeros(k, B, L, d) if dZ is None else dZ.reshape(k, B, L, d)
