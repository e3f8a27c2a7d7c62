"""Matrix-free operators and the estimators that run on them (docs/architecture.md, "Operators").

:class:`HessianOperator` is the symmetric Hessian over named parameters given by an engine's
products (``A @ V``, sub-block views ``A[a, b]``, ``A.to_scipy()``); :func:`mean_operator` is the mean
over a dataset's batches; ``A.block_diagonal(blocks)`` (:class:`BlockDiagonalOperator`) every block's own
product at once, and :mod:`blockhess.operators.lockstep` the blocks' estimators in lock-step on it. The estimators are free functions on any operator with ``@``, ``shape``,
``dtype`` and ``device`` (:mod:`blockhess.operators.estimators`); :func:`solve` and :func:`influence`
(:mod:`blockhess.operators.solve`) give exact damped inverse products by CG or MINRES.
"""

from .estimators import (EigResult, Estimate, KrylovProbe, NotConvergedError, SLQResult, diagonal, frobenius_norm,
                         hutchinson_diagonal, hutchpp_trace, lanczos_eigs, per_block, slq_density)
from .operator import BlockDiagonalOperator, Diagonal, HessianOperator, Product, Products, head_views, mean_operator
from .engines import hessian_operator
from .lockstep import Blockwise, blockwise_eigs, blockwise_slq, js_distance
from .solve import IndefiniteError, InfluenceResult, SolveResult, influence, solve

__all__ = ["hessian_operator", "HessianOperator", "Product", "Diagonal", "mean_operator", "head_views", "NotConvergedError", "EigResult",
           "KrylovProbe", "Estimate", "SLQResult", "lanczos_eigs", "slq_density", "hutchpp_trace", "hutchinson_diagonal",
           "frobenius_norm", "diagonal", "per_block", "solve", "influence", "SolveResult", "InfluenceResult",
           "IndefiniteError", "BlockDiagonalOperator", "Products", "Blockwise", "blockwise_eigs", "blockwise_slq",
           "js_distance"]
