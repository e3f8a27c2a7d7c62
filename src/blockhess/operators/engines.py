r"""The closed-form engines of :class:`~.operator.HessianOperator`: the exact Hessian-vector
products of a block (:func:`blockhess.block.directional.hvp`) and of a model
(:class:`blockhess.model.directional.ModelProduct`), and :func:`hessian_operator`, their constructor.

The forward pass, the loss's derivatives at the output and every first-order adjoint are computed
once, when the operator is made; each product then costs a tangent pass and a second-order adjoint
pass (docs/derivations.md §18). The operator is that of the call: it keeps copies of the parameters,
the inputs and a tensor target, and a callable loss's derivatives taken then (the callable is not
called again), so changing any of them in place afterwards (an optimizer step, the next batch written
into the same tensors, a head the loss closes over) does not change its products (docs/models.md,
"A snapshot of the call"). Memory: the forward activations and ``k`` tangents of them per
product of ``k`` columns; never ``n²``.
"""

from __future__ import annotations

import torch

from .. import losses
from ..block import check_forward, check_inputs, forward_cache, select_wrt
from ..block.diagonal import block_diagonal
from ..block.directional import adjoints, hvp
from ..config import ModelConfig, param_shapes
from ..model.directional import ModelProduct, fold_tied, unfold_tied
from ..model.stages import TIED_HEAD, SoftmaxHead
from ..model.walk import ce_tokens, prepare, stages_of
from ..validation import detached
from .operator import HessianOperator, head_views

__all__ = ["hessian_operator"]

_PARTS = ("full", "outer", "functional")


def _block_engine(params, X, cfg, loss, target, names, outer, functional):
    check_inputs(params, X, cfg)
    if X.ndim == 2 and isinstance(target, torch.Tensor):
        target = target[None]
    params, X, target = detached(params, X, target)
    params, X = {k: v.clone() for k, v in params.items()}, (X[None] if X.ndim == 2 else X).clone()
    c = forward_cache(params, X, cfg, plain=True)
    check_forward(c)
    target = losses.check(loss, target, c.out)
    if isinstance(target, torch.Tensor):  # the operator at the call: a target changed in place after it changes nothing
        target = target.clone()
    g, omega = losses.directional(loss, target, c.out)
    a = adjoints(c, g) if functional else None

    def product(V, wanted_out, into=None):  # V is never empty: a view has columns
        HV, _ = hvp(c, a, V, omega=omega, outer=outer, functional=functional, wanted=wanted_out, into=into)
        return HV

    def diagonal(wanted):
        return block_diagonal(c, a, loss, target, wanted, outer, functional)

    def kronecker(view):
        r"""``W_2``'s block of a pre-LN block under MSE at its output: ``Z = Y + h W_2 + b_2`` is affine in
        ``W_2`` with :math:`\partial Z_t/\partial W_2 = h_t \otimes I_d` and the loss Hessian ``(2/(B L d)) I``,
        so :math:`H_{W_2W_2} = \frac{2}{BLd}\sum_t h_t^\top h_t \otimes I_d` exactly, full and outer alike (the
        functional term is zero: ``Z`` is linear in ``W_2``); ``None`` for any other view or setting."""
        if view != ("W_2",) or loss != "mse" or not outer or cfg.kind != "block" or cfg.norm != "pre":
            return None
        B, L, d = c.out.shape
        h = c.fc.h.reshape(-1, c.fc.h.shape[-1])
        return (2.0 / (B * L * d)) * (h.T @ h), d

    return product, X.shape[0], X.dtype, X.device, diagonal, kronecker, None, None


def _model_engine(params, inputs, cfg, loss, target, names, outer, functional):
    params, inputs, loss, target, names, t = prepare(params, inputs, cfg, loss, target, names)
    st, top = stages_of(t, loss, target, len(inputs), 0, dense=False, tokens=ce_tokens(loss, target))
    prod = ModelProduct(st, top, cfg.d_model, hvp)
    shapes = param_shapes(cfg)
    internal = dict(shapes, **({TIED_HEAD: shapes["W_E"][::-1]} if cfg.tied else {}))
    like = params[names[0]]

    def product(V, wanted_out, into=None):  # the rows of wanted_out only; W_E's tied second use when W_E's are wanted
        rows = tuple(wanted_out) + ((TIED_HEAD,) if cfg.tied and "W_E" in wanted_out else ())
        into = fold_tied(into, internal) if into else into  # the tied head writes into W_E's slice
        return unfold_tied(prod(fold_tied(V, internal), rows, outer=outer, functional=functional, into=into))

    def products(groups, into=None):  # several groups in one pass (ModelProduct.columns)
        groups = [(fold_tied(V, internal), tuple(w) + ((TIED_HEAD,) if cfg.tied and "W_E" in w else ()))
                  for V, w in groups]
        into = None if into is None else [fold_tied(i, internal) if i else i for i in into]
        return [unfold_tied(r) for r in prod.columns(groups, outer=outer, functional=functional, into=into)]

    head = {"W_E" if n == TIED_HEAD else n for n in top.names} if isinstance(top, SoftmaxHead) else set()

    def expect(groups):  # [(a group's parameters with directions, columns)]: the head's pass for those without its own
        prod.expect(sum(c for params_, c in groups if not head & set(params_)))

    def diagonal(wanted):
        raise NotImplementedError("a model's operator has no closed-form diagonal: attention in the blocks above a "
                                  "weight mixes the tokens, so the block's per-token walk (docs/derivations.md §19) "
                                  "does not carry over; blockhess.operators.hutchinson_diagonal estimates it by "
                                  "sampling")

    return product, len(inputs), like.dtype, like.device, diagonal, None, products, expect


def hessian_operator(params: dict, inputs, cfg, loss="mse", target=None, wrt=None, part: str = "full") -> HessianOperator:
    r"""The exact Hessian of the loss w.r.t. ``wrt`` (default: every parameter) as a matrix-free
    :class:`~.operator.HessianOperator`: ``A @ V`` for ``V`` ``(n,)`` or ``(n, k)`` (the parameters'
    ``vec_r`` concatenated in canonical order), ``A[a, b]``, ``A.to_scipy()``; the estimators of
    :mod:`blockhess.operators.estimators` run on it.

    ``params``, ``inputs``, ``cfg``, ``loss``, ``target``, ``wrt`` as :func:`blockhess.hessian` for a block
    (``cfg`` a :class:`~blockhess.BlockConfig`, ``inputs`` ``X``) or a model (a
    :class:`~blockhess.config.ModelConfig`). ``part``: ``"full"``, ``"outer"`` (Gauss–Newton) or
    ``"functional"``. ``A.diagonal()`` is exact in closed form for a block with ``"mse"`` or ``"ce"``
    (:func:`blockhess.block.diagonal.block_diagonal`); a model's operator and a callable loss raise
    ``NotImplementedError`` there. The batch's loss is the mean over its sequences (``A.count`` of them; a dataset:
    :func:`~.operator.mean_operator` of per-batch operators). dtype and device of the parameters.
    Exact almost everywhere (ReLU kinks, Lemma 1).

    The operator is that of the call: ``params``, ``inputs`` and a tensor ``target`` are copied, a
    callable loss's gradient and Hessian w.r.t. the output are taken when it is made (the callable is not
    called by any product), so changing them in place afterwards does not change ``A @ V``.

    Raises ``ValueError`` for an unknown ``part`` and as :func:`blockhess.hessian` on bad inputs, before
    any product; the products' own memory check (:func:`blockhess.block.directional.work_entries`)
    raises ``InsufficientMemoryError`` before a product that would not fit.
    """
    if part not in _PARTS:
        raise ValueError(f"part must be one of {_PARTS}, got {part!r}")
    outer, functional = part in ("full", "outer"), part in ("full", "functional")
    names = select_wrt(tuple(param_shapes(cfg)), wrt)
    engine = _model_engine if isinstance(cfg, ModelConfig) else _block_engine
    product, count, dtype, device, diagonal, kronecker, products, expect = engine(params, inputs, cfg, loss, target, names,
                                                                        outer, functional)
    shapes = param_shapes(cfg)

    def restricted(V, wanted_out, into=None):  # the operator over names: other parameters have zero directions
        return product({n: v for n, v in V.items() if n in names}, wanted_out, into)

    def restricted_groups(groups, into=None):
        return products([({n: v for n, v in V.items() if n in names}, w) for V, w in groups], into)

    return HessianOperator(restricted, names, {n: shapes[n] for n in names}, dtype, device, diagonal=diagonal,
                           split=head_views(cfg), count=count, writes_into=True, cfg=cfg, kronecker=kronecker,
                           products=None if products is None else restricted_groups, expect=expect)
