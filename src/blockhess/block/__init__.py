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
(``W_Q#h``, ``b_Q#h``, ``W_K#h``, ``W_V#h``), each a plain Kronecker factor;
:class:`~blockhess.result.HeadSplitSum` writes their blocks into the column slices of the public
blocks. The block input ``X`` is a variable too (``wrt_input``): its Jacobian is dense within a
sequence (:class:`~blockhess.kronecker.SeqFactor`).

One module per part, composing the layers (:mod:`blockhess.layers`) only through their contract
(:mod:`blockhess.layers.protocol`):

* :mod:`.forward_pass`: the forward pass with its :class:`Cache` (built by keyword), the input and
  forward checks, the work estimate; public :func:`forward`;
* :mod:`.first_order`: Theorem 4, the per-token :class:`Factors`; public :func:`jacobian`, :func:`input_jacobian`;
* :mod:`.second_order`: Theorem 5, the backward walk (:func:`contract_output`); public :func:`second_derivative`;
* :mod:`.directional`: the exact Hessian-vector product, matrix-free (:func:`hvp`: a tangent pass forward,
  a second-order adjoint pass back, each layer's ``tangent`` and ``second_adjoint``, restricted to the
  wanted rows; :func:`vjp`, its pass back alone; :func:`adjoints`).

(The modules are not named after the functions they hold: a submodule ``block.forward`` would be
shadowed by the function ``block.forward`` this package re-exports.)
"""

from .directional import Adjoints, adjoints, hvp, vjp
from .first_order import Factors, attention_input_jacobian, input_jacobian, jacobian, jacobian_factors
from .forward_pass import (FFN_NAMES, Cache, as_batch, check_forward, check_inputs, forward, forward_cache, pre_ln,
                           select_wrt, variable_shapes, work_entries)
from .second_order import contract_output, dense_second_derivative, second_derivative

__all__ = ["forward", "jacobian", "input_jacobian", "second_derivative", "hvp", "vjp", "adjoints", "Adjoints",
           # the engine the package's other modules share (hessian, convergence, bounds, reference)
           "Cache", "FFN_NAMES", "Factors", "as_batch", "attention_input_jacobian", "check_forward", "check_inputs",
           "contract_output", "dense_second_derivative", "forward_cache", "jacobian_factors", "pre_ln", "select_wrt",
           "variable_shapes", "work_entries"]
