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
The paper writes the MSE functional term without its factor :math:`2/(Ld)` (typo 10, docs/derivations.md §15);
it is included here.
"""

from __future__ import annotations

import math

import torch

from . import linalg, losses
from .block import assembled
from .block import (check_forward, check_inputs, contract_output, forward_cache, jacobian_factors, select_wrt,
                    variable_shapes, work_entries)
from .result import BlockSum, HessianBlocks
from .config import BlockConfig, ModelConfig, param_shapes
from .kronecker import TokenKron
from .model import walk as model_walk
from .threads import serial, threads_for
from .validation import check_bool, check_fits, check_result, detached

__all__ = ["hessian", "assemble"]


def _add_outer_lowrank(J: dict[str, TokenKron], lam: torch.Tensor, W: torch.Tensor, acc: BlockSum, B: int, L: int,
                       d: int) -> None:
    r"""Outer term for a general per-sequence loss Hessian with eigenpairs ``lam`` ``(B, R)``,
    ``W`` ``(B, L·d, R)`` (:func:`blockhess.linalg.eig_lowrank`; a pooled classifier head over
    ``c`` classes has rank <= c - 1):
    :math:`\sum_b J_b^\top \Omega_b J_b = \sum_{b,r} \lambda_{br} (J_b^\top w_{br})(J_b^\top w_{br})^\top`.
    """
    R = lam.shape[1]
    w = W.transpose(1, 2).reshape(B, R, L, d)
    kept = (lam != 0).reshape(B * R)  # a sequence with fewer than R directions is padded with zeros: not multiplied
    V = {n: J[n].vjp(w).reshape(B * R, -1)[kept] for n in acc.names}  # rows J_b^T w_br
    lam = lam.reshape(B * R, 1)[kept]
    for i, a in enumerate(acc.names):
        Va = V[a] * lam
        for b in acc.names[i:]:
            with threads_for(macs=Va.shape[0] * Va.shape[1] * V[b].shape[1]):
                acc.add(a, b, Va.T @ V[b])


def _add_parts(c, f, ld: losses.LossDerivatives, acc: BlockSum, outer: bool, functional: bool) -> None:
    """Add the outer and/or functional term to ``acc``; with both and a per-token loss
    Hessian, the outer term is folded into the functional pass (one sandwich per pair)."""
    Bsz, L, d = c.out.shape
    if ld.per_token:
        contract_output(c, ld.grad if functional else None, f, acc, omega_Z=ld.hess if outer else None)
        return
    if outer:
        lam, W = _eig(ld, f.J, acc.names).eig
        _add_outer_lowrank(f.J, lam, W, acc, Bsz, L, d)
    if functional:
        contract_output(c, ld.grad, f, acc)


VJP_ENTRIES = 1 << 22  # entries of J_b^T e for a chunk of unit vectors e in _cut_scale


def _cut_scale(J: dict, names, lam: torch.Tensor, W: torch.Tensor, L: int, d: int) -> torch.Tensor:
    r"""``rho`` ``(B,)`` in ``(0, 1]``: the factor by which each sequence's eigenvalue cut must shrink so
    that the directions it drops stay at rounding in that sequence's outer term
    :math:`J_b^\top \Omega_b J_b` however ``J_b`` amplifies them (docs/derivations.md §7).

    A dropped :math:`(\lambda, w)` adds at most :math:`|\lambda|\,\|J_b\|_2^2 \le |\lambda|\,F_b`,
    :math:`F_b = \|J_b\|_F^2` over ``names`` (from the vector–Jacobian products of the ``m = L·d`` unit
    vectors, in chunks); the kept ones give the sequence's scale :math:`S_b = \max_r |\lambda_r|\,
    \|J_b^\top w_r\|^2`. With the cut at :math:`\sqrt m\,\epsilon\,s_b\,\rho_b`,
    :math:`\rho_b = S_b/(s_b F_b)`, every dropped direction adds at most :math:`\sqrt m\,\epsilon\,S_b`.
    ``lam`` ``(B, R)``, ``W`` ``(B, m, R)`` from :func:`blockhess.linalg.eig_lowrank`.
    """
    B, R = lam.shape
    m = L * d
    w = W.transpose(1, 2).reshape(B, R, L, d)
    S = (sum(J[n].vjp(w).reshape(B, R, -1).square().sum(-1) for n in names) * lam.abs()).amax(-1)
    n_out = sum(J[n].vjp(w[:, :1]).reshape(B, -1).shape[-1] for n in names)
    F = lam.new_zeros(B)
    eye = torch.eye(m, dtype=lam.dtype, device=lam.device).reshape(m, L, d)
    k = max(1, VJP_ENTRIES // max(1, B * n_out))
    for s0 in range(0, m, k):
        e = eye[s0:s0 + k].expand(B, -1, L, d).contiguous()
        F += sum(J[n].vjp(e).reshape(B, -1).square().sum(-1) for n in names)
    den = lam.abs().amax(-1) * F
    return torch.where(den > 0, S / den.where(den > 0, 1.0), 1.0).clamp(max=1.0)


def _eig(ld: losses.LossDerivatives, J: dict, names) -> losses.LossDerivatives:
    """``ld`` with a general loss's ``(L·d)²`` Hessians replaced by their eigenpairs above
    rounding, each sequence judged at its own scale and its Jacobian's amplification
    (:func:`blockhess.linalg.eig_lowrank`, :func:`_cut_scale` with the factors ``J`` over ``names``);
    as it is if done."""
    if ld.per_token or ld.eig is not None:
        return ld
    L, d = ld.grad.shape[1:]
    lam, W = linalg.eig_lowrank(ld.hess)
    lam, W = linalg.eig_lowrank(ld.hess, rel=_cut_scale(J, names, lam, W, L, d))
    return ld._replace(hess=None, eig=(lam, W))


def assemble(c, f, ld: losses.LossDerivatives, names, out=None) -> HessianBlocks:
    """The dense Hessian (eq. 10, outer + functional) of one forward pass ``c``
    (:func:`~blockhess.block.forward_cache`) with its factors ``f``
    (:func:`~blockhess.block.jacobian_factors`) and loss derivatives ``ld`` of its output, over
    ``names``, in one ``(n, n)`` buffer (``out`` if given, as :class:`~blockhess.result.BlockSum`
    takes it): one pass of :func:`hessian`, a :class:`~blockhess.result.HessianBlocks` without
    parts, dtype and device of ``c.out``. No input checks (kernel)."""
    acc = BlockSum(c.names, variable_shapes(c), wanted=names, dense=True, dtype=c.out.dtype, device=c.out.device, out=out)
    _add_parts(c, f, ld, acc, outer=True, functional=True)
    return acc.result(c.out, c.cfg)


PASS_BYTES = 64 * 2**20  # the working memory a pass over a chunk of the batch may always use


def _sequence_entries(cfg: BlockConfig, X: torch.Tensor, loss, names: tuple[str, ...]) -> int:
    """Entries one sequence adds to a pass (:func:`blockhess.block.work_entries`, every weight's
    factors being formed; for a callable loss its ``(L·d)²`` Hessian twice: itself and its
    eigen-decomposition's work)."""
    L, d = X.shape[-2:]
    return work_entries(cfg, 1, L, "hessian", wrt_input="X" in names) + (2 * (L * d) ** 2 if callable(loss) else 0)


def _chunks(cfg: BlockConfig, X: torch.Tensor, loss, names: tuple[str, ...]) -> list[slice]:
    """The batch's sequences, one slice per pass of the closed form (the whole of ``X`` in one
    when it fits, or ``X`` is one sequence, or ``"X"`` is in ``names``: its blocks span the batch).

    A pass holds the forward cache, the per-token factors and the backward walk's work space of
    its sequences (:func:`_sequence_entries`); it may use ``PASS_BYTES`` or half of the dense
    result over ``names``, whichever is more. Not counted: a callable loss's ``R``
    eigen-directions per sequence, ``R·n`` entries (``R`` at most ``L·d``; 9 for a classifier
    over ten classes), checked when they are made (:func:`blockhess.losses.derivatives`).
    Derived here, docs/derivations.md §1.
    """
    if X.ndim == 2 or "X" in names:
        return [slice(None)]
    B = X.shape[0]
    sizes = {k: math.prod(shape) for k, shape in param_shapes(cfg).items()}
    n_out = sum(sizes[k] for k in names)
    size = max(PASS_BYTES, n_out * n_out * X.element_size() // 2) // (X.element_size() * _sequence_entries(cfg, X, loss, names))
    if size >= B:
        return [slice(None)]
    size = max(int(size), 1)
    return [slice(s, min(s + size, B)) for s in range(0, B, size)]


def _check_memory(cfg: BlockConfig, X: torch.Tensor, loss, names: tuple[str, ...], chunks: list[slice], result: bool,
                  what: str) -> None:
    """Before any pass: the ``n × n`` result over ``names`` (unless ``result`` is false: it goes
    into ``out=``), then that with the largest pass's work space (:func:`_sequence_entries` per
    sequence). ``what`` names the result (``{n}``: its size). Raises ``InsufficientMemoryError`` with the bytes."""
    e = X.element_size()
    n = sum(math.prod(s) for k, s in param_shapes(cfg).items() if k in names) + (X.numel() if "X" in names else 0)
    what = what.format(n=n)
    held = n * n * e if result else 0
    if result:
        check_fits(held, what, X.device)
    B, L = (1, X.shape[0]) if X.ndim == 2 else X.shape[:2]
    rows = max(len(range(B)[c]) for c in chunks)
    check_fits(held + rows * _sequence_entries(cfg, X, loss, names) * e,
               f"{what}{'' if result else ' (into out=)'} with a pass of the closed form over {rows} "
               f"sequence{'s' if rows > 1 else ''} of {L} tokens (forward cache, per-token factors, work space)", X.device)


@serial()  # many small products: one thread, the large ones the caller's (blockhess.threads)
def _passes(params: dict, X: torch.Tensor, cfg: BlockConfig, names: tuple[str, ...], chunks: list[slice], loss,
            target=None, derivs=None, which: str = "full", dense: bool = True, out=None,
            parts=None) -> tuple[HessianBlocks, list]:
    """The Hessian over the batch ``X`` summed over passes, one per slice of ``chunks``
    (:func:`_chunks`), with ``parts`` (:class:`~blockhess.result.HessianBlocks`), and each pass's
    loss derivatives.

    Without ``derivs`` (the call itself) every pass is first checked (its forward pass, and the
    whole ``target`` once) and its loss derivatives taken, before anything is written (an error
    leaves ``out`` untouched; with several passes each forward pass is then computed again);
    ``derivs`` given (the parts, later): those derivatives, so a callable loss is not called
    again and a target changed since does not count.
    """
    B = 1 if X.ndim == 2 else X.shape[0]
    first_pass = acc = None
    if derivs is None:
        derivs = []
        for rows in chunks:
            c = forward_cache(params, X[rows], cfg, wrt_input="X" in names)
            check_forward(c, first=rows.start or 0)
            if acc is None:  # the whole target once (against the output's shape, expanded: no copy); out= checked
                target = losses.check(loss, target, c.out[:1].expand(B, -1, -1) if c.out.shape[0] != B else c.out,
                                      single=X.ndim == 2)
                acc = BlockSum(c.names, variable_shapes(c), wanted=names, dense=dense, dtype=c.out.dtype, device=c.out.device,
                               out=out)
            ld = losses.derivatives(loss, target[rows] if isinstance(target, torch.Tensor) else target, c.out,
                                    batch=B, first=rows.start or 0)
            derivs.append(ld if ld.per_token else _eig(ld, jacobian_factors(c).J, names))
        first_pass = c if len(chunks) == 1 else None
    for rows, ld in zip(chunks, derivs):
        c = first_pass if first_pass is not None else forward_cache(params, X[rows], cfg, wrt_input="X" in names)
        if acc is None:
            acc = BlockSum(c.names, variable_shapes(c), wanted=names, dense=dense, dtype=c.out.dtype, device=c.out.device, out=out)
        _add_parts(c, jacobian_factors(c), ld, acc, outer=which in ("full", "outer"), functional=which in ("full", "functional"))
    H = acc.result(c.out, c.cfg, parts)
    check_result({"the Hessian": H.dense()} if dense else  # one sum over the buffer (faster than over its blocks)
                 {f"the Hessian's {which} part, block {key}": block for key, block in H.items()})
    return H, derivs


def _check_out(out, X: torch.Tensor, params: dict, target) -> None:
    """``out`` must be a tensor that does not require grad and shares no memory with the inputs
    (it is overwritten while they are read); its shape is checked by :class:`BlockSum`."""
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.requires_grad:
        raise ValueError("out must not require grad: the Hessian is written into it in place")
    inputs = {"X": X, "target": target, **{f"params[{k!r}]": v for k, v in params.items()}}
    ptr = out.untyped_storage().data_ptr()
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor) and t.device == out.device and t.untyped_storage().data_ptr() == ptr:
            raise ValueError(f"out shares memory with {name}: it is overwritten while {name} is read; pass a separate buffer")


def hessian(params: dict, X: torch.Tensor, cfg: BlockConfig, loss="mse", target=None, wrt=None,
            wrt_input: bool = False, out: torch.Tensor | None = None) -> HessianBlocks:
    r"""Exact Hessian of the loss of the block's output w.r.t. its weights, by the closed form
    (paper eq. 10: outer + functional term).

    Parameters
    ----------
    params : dict[str, Tensor]
        Weights as :func:`~blockhess.config.param_shapes` (``W_Q, W_K, W_V[, W_1, W_2]``).
    X : Tensor
        One sequence ``(L, d_model)`` or a batch ``(B, L, d_model)``, float32 or float64.
    cfg : BlockConfig
        ``kind="block"`` (post-LN as in Theorem 5 / eq. 10, or pre-LN, with the options of
        :class:`~blockhess.BlockConfig`) or ``"attention"`` (the Theorem 1 layer; the
        outer/functional split of Ormaniec et al.).
    loss : "mse" | "ce" | callable
        ``"mse"`` (mean over entries, the paper's), ``"ce"`` (rows of the output are logits
        over ``d_model`` classes, mean over tokens) or ``loss(Z, target) -> scalar`` applied
        to one sequence ``Z`` of shape ``(L, d_model)``. A batch's loss is the mean over
        sequences, so its Hessian is the mean of the per-sequence Hessians.
    target : Tensor or None
        MSE: shaped like ``X``; CE: integer classes ``(L,)`` or ``(B, L)``; callable: for one
        sequence anything the callable takes; for a batch a tensor (or array-like, made a
        tensor) whose first axis has one entry per sequence, each sequence getting its entry.
    wrt : str or list of str or None
        Restrict to these weights (only their blocks are computed; ``"X"`` too with
        ``wrt_input=True``). The result keeps the canonical order of
        :func:`~blockhess.config.param_shapes` (``H.names``), each name once; the names are
        this library's (``W_1``, not ``linear1.weight``: see :func:`~blockhess.adapters.from_torch`).
    wrt_input : bool
        Also differentiate w.r.t. the block input: a variable named ``"X"`` (first), of
        ``X``'s shape; its blocks with itself (zero across sequences) and with every weight.
    out : Tensor or None
        A contiguous ``(n, n)`` tensor of ``X``'s dtype and device to assemble the dense
        Hessian in (``n`` = the total size of the differentiated variables). It is
        overwritten and becomes the result's storage (``.dense()`` returns it; the next call
        into the same ``out`` overwrites it). Reusing one across calls saves allocating ``n²``
        fresh entries (docs/results.md, "Fresh output against a reused one").

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
        forward pass that overflows the dtype; a LayerNorm input row whose ``var + ln_eps``
        does not stand above its values' rounding and ``tiny/e`` (Assumption 2;
        docs/derivations.md §3); an unknown loss; a target of the wrong shape or class range;
        a callable loss that does not return a scalar, or whose value, gradient or Hessian
        w.r.t. ``Z`` has a NaN or Inf, or that ``torch.func`` cannot differentiate; an empty
        ``wrt`` or an unknown name in it; ``wrt_input`` not a bool; ``out`` of the wrong
        shape, dtype or device, not contiguous, requiring grad or sharing memory with ``X``,
        ``params`` or ``target``; a Hessian with a NaN or Inf (a value overflowed on finite
        inputs; checked once the Hessian is assembled, so ``out`` then holds that partial result).
    InsufficientMemoryError
        (a ``MemoryError`` and a ``ValueError``, with the bytes needed and available) before
        the work it guards: the dense ``n × n`` result (not with ``out``) and it with the
        largest pass (:func:`blockhess.block.work_entries`) before the first forward pass; a
        callable loss's per-sequence ``(L·d)²`` Hessians before they are made
        (:func:`blockhess.losses.derivatives`); ``.outer`` or ``.functional`` before its
        passes (docs/derivations.md §1, "Memory, estimated before the work").

    Notes
    -----
    A batch is assembled in passes into one buffer (docs/derivations.md §1, "A batch in
    passes"). ``.outer`` and ``.functional`` are computed on first access, from copies of
    ``params`` and ``X`` taken at the call and the loss derivatives taken then (a callable
    loss is not called again): changing the inputs in place afterwards does not change them.
    Inputs that require grad are used detached (:func:`~blockhess.validation.detached`).
    The many small products run on one thread, the large ones on torch's thread count
    (:mod:`blockhess.threads`); where other work shares the cores, call
    ``torch.set_num_threads(1)`` first (docs/results.md, "Threads").
    """
    if isinstance(cfg, ModelConfig):
        if wrt_input is not False or out is not None:
            raise ValueError("wrt_input and out apply to a block; for a model (ModelConfig) leave them out")
        return model_walk.hessian(params, X, cfg, loss, target, wrt)
    check_inputs(params, X, cfg)
    check_bool("wrt_input", wrt_input)
    if out is not None:
        _check_out(out, X, params, target)
    if X.ndim == 2 and isinstance(target, torch.Tensor):
        target = target[None]
    # the parts are computed later, on first access: from a snapshot, not from tensors the caller may change in place
    params, X, target = detached(params, X, target)
    params, X = {k: v.clone() for k, v in params.items()}, X.clone()
    names = select_wrt((("X",) if wrt_input else ()) + tuple(param_shapes(cfg)), wrt)  # once: wrt may be an iterator
    if cfg.llama_options:  # no Kronecker factors for these: columns of exact products (docs/derivations.md §20)
        return assembled.hessian(params, X, cfg, loss, target, names, out)
    chunks = _chunks(cfg, X, loss, names)
    _check_memory(cfg, X, loss, names, chunks, out is None, "the dense {n}x{n} Hessian")
    derivs = None  # the call's loss derivatives, from its own passes below: the parts reuse them

    def part(which: str) -> HessianBlocks:
        _check_memory(cfg, X, None, names, chunks, True, f"the {which} part of the Hessian ({{n}}x{{n}}, in blocks)")
        return _passes(params, X, cfg, names, chunks, None, derivs=derivs, which=which, dense=False)[0]

    full, derivs = _passes(params, X, cfg, names, chunks, loss, target, out=out, parts=part)
    return full
