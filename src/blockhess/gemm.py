r"""Products of token rows by a weight: :math:`aB` and :math:`c + aB`, and the same for each of
``k`` directions' weights, on the faster of torch's two float32 matrix-product kernels on the CPU.

The tangent and second-order adjoint passes multiply a few hundred token rows by a weight:
:math:`\dot xW`, :math:`x\dot W`, :math:`\dot gW^\top`, :math:`g\dot W^\top` in every affine map,
:math:`\dot hW_E^\top` and :math:`\dot gW_E` in the head (:mod:`blockhess.layers.linear`,
:mod:`blockhess.model.stages`). On the CPU torch's float32 ``mm`` calls MKL; oneDNN's float32 matrix
product, which torch reaches through ``mkldnn::_linear_pointwise`` (the kernel of a frozen ``nn.Linear``
under ``torch.compile``), :math:`y = xW^\top`, and ``mkldnn::_linear_pointwise.binary`` with ``"add"``,
:math:`y = xW^\top + c`, runs such short-sided products (tens to a few thousand rows against a weight)
faster (docs/results.md, "oneDNN for the token products").

Where that op is usable — torch built with oneDNN, float32 operands on the CPU, none tracked by
autograd (the op has no derivative), and oneDNN's float32 matmul precision left at IEEE
(``torch.backends.mkldnn.matmul.fp32_precision`` ``"none"``/``"ieee"``: not bf16 or tf32 rounding) — the
products here call it (float32 throughout: only the order of the sums differs); elsewhere (float64,
another device, a differentiated operand, a build without oneDNN or with it disabled)
``torch.mm``/``addmm``/``baddbmm``, an untracked result's row of an odd length written on cache lines
(:func:`~blockhess.heap.aligned_rows`). The weights' operands are read through views: no copy of a
weight is made.

Results are fresh tensors except where documented (``c`` may be overwritten: the caller's own).
No checks beyond torch's (kernels)."""

from __future__ import annotations

import functools

import torch
from torch.autograd import forward_ad

from .heap import aligned_rows

__all__ = ["mm", "addmm", "mm_each", "onednn"]


@functools.cache
def _onednn_built() -> bool:
    """Whether this torch has oneDNN and its linear op (checked once)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _precision_ieee() -> bool:
    """Whether oneDNN's float32 matmul keeps float32 arithmetic (read at each call: a user may set it)."""
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    return getattr(matmul, "fp32_precision", "none") in ("none", "ieee")


def onednn(*ts: torch.Tensor) -> bool:
    """Whether the products of ``ts`` go to oneDNN: every tensor float32 on the CPU with no element
    count zero, none differentiated (:func:`_tracked`), this torch built with oneDNN and it enabled
    (``torch.backends.mkldnn.enabled``, e.g. not inside ``torch.backends.mkldnn.flags(enabled=False)``),
    its float32 precision IEEE."""
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.numel() > 0 for t in ts):
        return False
    return (not _tracked(*ts) and _onednn_built() and bool(torch.backends.mkldnn.enabled)
            and _precision_ieee())


def _tracked(*ts: torch.Tensor) -> bool:
    """Whether a product of ``ts`` is differentiated: autograd records it (grad mode on, one of them
    requiring grad), one carries a forward-mode tangent (``torch.autograd.forward_ad``), or one is
    torch.func's (``jvp``, ``grad``, ``vmap``). Then torch's own products (oneDNN's op has no
    derivative), and no ``out=`` (which autograd refuses)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return True
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in ts):
        return True
    return any(forward_ad.unpack_dual(t).tangent is not None for t in ts)


def _linear(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's ``a @ b`` (``+ c``), a new tensor: ``b`` given to the op as the linear layer's weight ``bᵀ``."""
    if c is None:
        return torch.ops.mkldnn._linear_pointwise(a, b.T, None, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(a, c, b.T, None, "add")


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``a`` ``(m, p)``, ``b`` ``(p, q)``: a new ``(m, q)`` (on the untracked fallback on
    the CPU its rows on cache lines: read it with ``reshape``, not ``view``, where ``q`` is odd)."""
    if onednn(a, b):
        return _linear(a, b)
    if _tracked(a, b):  # out= has no autograd
        return a @ b
    return torch.mm(a, b, out=aligned_rows((a.shape[0], b.shape[1]), a))


def addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``c + a @ b`` for ``c`` ``(m, q)``, ``a`` ``(m, p)``, ``b`` ``(p, q)``: a new tensor, or ``c``
    itself with the product added in place (the fallback; ``c`` is the caller's own to overwrite)."""
    if onednn(a, b, c):
        return _linear(a, b, c)
    return c.addmm_(a, b)


def mm_each(a: torch.Tensor, B: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ B[i]`` for each of ``k`` weights, plus ``c[i]`` when ``c`` is given: ``a`` ``(m, p)``
    shared, ``B`` ``(k, p, q)``, ``c`` ``(k, m, q)`` (the caller's own: for ``k > 1`` the sums are
    written into it and it is returned; a ``c`` that is not contiguous goes to torch's ``baddbmm_``,
    which refuses one whose slices overlap); ``(k, m, q)``, its rows as :func:`mm`'s. Beyond the result,
    at most one ``(m, q)`` product is held at a time."""
    k = B.shape[0]
    if onednn(a, B, *(() if c is None else (c,))) and (c is None or c.is_contiguous()):
        if k == 1:
            return _linear(a, B[0], None if c is None else c[0])[None]
        out = a.new_empty((k, a.shape[0], B.shape[2])) if c is None else c
        for i in range(k):  # each direction's product written into its slice: one (m, q) more at a time
            out[i].copy_(_linear(a, B[i], None if c is None else c[i]))
        return out
    if c is None:
        if _tracked(a, B):  # out= has no autograd
            return torch.matmul(a, B)
        return torch.bmm(a.expand(k, -1, -1), B, out=aligned_rows((k, a.shape[0], B.shape[2]), a))
    return c.baddbmm_(a.expand(k, -1, -1), B)
