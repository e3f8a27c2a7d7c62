r"""The contract of a layer: the functions each layer module provides and what they return.

The block (:mod:`blockhess.block`) composes its layers only through these functions. There are two
kinds of layer, one :class:`typing.Protocol` each, written down here once:

* :class:`Map`, a map without weights of its own that the block differentiates through, row by row
  or token by token: :mod:`~blockhess.layers.softmax` (evaluated at its output ``A``) and
  :mod:`~blockhess.layers.layernorm` (at its input ``X``; its scale ``gamma`` is an argument).
* :class:`Layer`, a layer with weights: :mod:`~blockhess.layers.attention` (``W_Q, W_K, W_V``
  and biases) and :mod:`~blockhess.layers.ffn` (``W_1, b_1, W_2, b_2``, pre-LN ``gamma_2, beta_2``).

One return convention for every order of derivative:

============================  =====================================================================
``forward``                   a :class:`Map`: the output tensor; a :class:`Layer`: its ``Cache`` (a
                              ``NamedTuple`` built by keyword) holding what every derivative needs
``weight_jacobians``          ``{name: TokenKron}``: ``∂out/∂W`` per token as Kronecker factors
                              (:class:`~blockhess.kronecker.TokenKron`), only for the ``names`` asked for
``jacobian`` /                the Jacobian w.r.t. the layer's input: per row / token / sequence with
``input_jacobian``            ``compact=True`` (what the block uses), else the paper's dense layout
``contract_hessian``          the second derivative contracted with an output weight ``G`` (the
                              back-propagated gradient), :math:`\sum_o G_o \nabla^2 \mathrm{out}_o`:
                              a :class:`Map` returns its input curvature :math:`\Gamma` (softmax's
                              :math:`\Psi`) per row / token, ``(..., d, d)``; a :class:`Layer` adds the
                              blocks among its own weights to ``acc`` (a
                              :class:`~blockhess.result.BlockSum` or
                              :class:`~blockhess.result.HeadSplitSum`, asked ``acc.wants(a, b)`` before
                              each block is computed) and returns a :class:`Contraction`: the parts
                              only the caller can finish, because they need the factors of the
                              variables before the layer
``tangent`` /                 directional derivatives along ``k`` directions on a leading axis, for a
``adjoint`` /                 matrix-free product (docs/derivations.md §18): the tangent of the output
``second_adjoint``            (a :class:`Layer`: its ``Tangent``, every node's); the first-order
                              adjoints of an output adjoint, once per operator (a :class:`Layer`: its
                              ``Adjoint``); the tangent of the input adjoint with the weights' rows of
                              the Hessian-vector product, ``second=False`` dropping the second-order
                              terms (Gauss–Newton); ``None`` is a zero direction throughout
============================  =====================================================================

A :class:`Map`'s result is the :class:`Contraction` of a layer with no weights: its ``gamma`` alone.
Each public function checks its arguments; the kernels the block calls skip the checks
(``*_unchecked``, the directional derivatives, and every function of a :class:`Layer`). The affine
map ``xW + b`` of the projections has only directional derivatives, in :mod:`~blockhess.layers.linear`.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch

__all__ = ["Contraction", "Layer", "Map"]


class Contraction(NamedTuple):
    """A layer's second derivatives contracted with ``G``, the parts its caller finishes.

    ``gamma``: ``(T, d, d)``, the curvature w.r.t. the layer's input, per token (``None`` when zero,
    or, for the attention, formed by ``contract_input_hessian`` only when its input is a variable:
    it is dense within a sequence);
    ``cross``: name → list of per-token factors of :math:`\\partial^2/\\partial\\,\\mathrm{in}\\,\\partial W`
    (rows: the ``d`` entries of the input token), sandwiched with the factors of earlier variables;
    ``core``: ``(a, b)`` → ``(T, x_a, x_b)`` added to the per-token core of the sandwich of the
    output factors of ``a`` and ``b`` (e.g. the FFN activation's curvature, which shares them).
    """

    gamma: torch.Tensor | None
    cross: dict
    core: dict


@runtime_checkable
class Map(Protocol):
    """A weightless row- or token-wise map: softmax, LayerNorm (the module satisfies it)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The map's output, ``x``'s shape, dtype and device."""

    def jacobian(self, x: torch.Tensor, *args, compact: bool = False, **kwargs) -> torch.Tensor:
        """The input Jacobian: per row / token with ``compact=True``, else the paper's dense layout."""

    def hessian(self, x: torch.Tensor, *args, compact: bool = False, **kwargs) -> torch.Tensor:
        """The second derivative w.r.t. the input, compact or in the paper's dense layout."""

    def contract_hessian(self, x: torch.Tensor, G: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """:math:`\\Gamma = \\sum_o G_o \\nabla^2 \\mathrm{out}_o` per row / token, ``(..., d, d)``, checked."""

    def contract_hessian_unchecked(self, x: torch.Tensor, G: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """:meth:`contract_hessian` without checks (the kernel the block calls)."""

    def tangent(self, x: torch.Tensor, *args, **kwargs):
        """The output's tangent along ``k`` input directions (LayerNorm: with the ``rho`` its adjoint needs)."""

    def second_adjoint(self, x: torch.Tensor, *args, **kwargs):
        """The tangent of the input adjoint (LayerNorm: with its ``gamma``, ``beta`` rows)."""


@runtime_checkable
class Layer(Protocol):
    """A layer with weights: attention, FFN (the module satisfies it). ``NAMES``: its default
    weights; ``Cache``: the ``NamedTuple`` type its :meth:`forward` returns."""

    NAMES: tuple[str, ...]
    Cache: type

    def forward(self, X: torch.Tensor, *weights, **options) -> tuple:
        """The forward pass, returning the layer's ``Cache`` (built by keyword)."""

    def weight_jacobians(self, c: tuple, names=None) -> dict:
        """``{name: TokenKron}``: ``∂out/∂W`` per token for the weights in ``names``."""

    def input_jacobian(self, c: tuple, *weights, **options) -> torch.Tensor:
        """The Jacobian w.r.t. the layer's input (per token, or per sequence for the attention)."""

    def contract_hessian(self, c: tuple, G: torch.Tensor, acc, names=None) -> Contraction:
        """Adds the blocks among the layer's own weights to ``acc``; returns the :class:`Contraction`."""

    def tangent(self, c: tuple, p: dict, dp: dict, *args, **kwargs) -> tuple:
        """The layer's ``Tangent`` along ``k`` directions of its input and weights ``dp``."""

    def adjoint(self, c: tuple, *args, **kwargs) -> tuple:
        """The layer's ``Adjoint``: the first-order adjoints of an output adjoint, once per operator."""

    def second_adjoint(self, c: tuple, p: dict, dp: dict, a: tuple, t: tuple, *args, **kwargs) -> tuple:
        """``(dg_in, hv)``: the input adjoint's tangent and the weights' rows of the product."""
