r"""The matrix-free Hessian operator: products with vectors over named parameters, sub-block views,
the SciPy export, and the mean over batches.

A :class:`HessianOperator` is the symmetric ``n × n`` matrix :math:`H` over named parameters (canonical
order, each flattened by ``vec_r``) given only by its products. What computes them, the *engine*, is
plugged in (:class:`Product`, :class:`Diagonal`); the operator does the bookkeeping around it: it
splits a vector ``V`` of shape ``(n,)`` or ``(n, k)`` into the parameters' slices, passes the engine only
the parameters a view needs (and the rows it wants back), and concatenates the result. It follows
curvlinops' minimal operator contract (``@`` on ``(n,)``/``(n, k)`` tensors and on tensor lists, ``shape``,
``dtype``, ``device``, ``adjoint()``, ``to_scipy()``), so SciPy's and curvlinops' estimators run on it;
:mod:`blockhess.operators.estimators` holds this package's own (docs/derivations.md, "Estimators on operators").
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Protocol, Sequence

import numpy as np
import torch

from ..config import BlockConfig, ModelConfig, block_prefix
from ..heap import OutputPool
from ..result import HessianBlocks, head_split
from ..validation import FLOAT_DTYPES, check_bool, check_fits, check_int

__all__ = ["HessianOperator", "BlockDiagonalOperator", "Product", "Products", "Diagonal", "mean_operator", "head_views",
           "module_operator"]

#: columns of the identity multiplied at a time by :meth:`HessianOperator.dense` (without ``max_columns``)
DENSE_COLUMNS = 512

Split = dict[str, tuple[str, tuple[int, ...], tuple]]


class Product(Protocol):
    """The engine's product: ``product(V, wanted_out) -> dict``.

    ``V``: ``{parameter name: tensor (k, *shape)}`` over *some* of the operator's parameters (an absent
    parameter's entries are zero), all of one ``k >= 1``, the operator's dtype and device; not to be
    modified. ``wanted_out``: a tuple of parameter names, the rows wanted. Returns a dict holding, for
    every name ``a`` of ``wanted_out``, ``(H V)[a] = Σ_b H[a, b] V[b]`` of shape ``(k, *shape_a)``
    (other keys are ignored). A view ``A[a, b]`` passes only ``b``'s parameters and asks only for
    ``a``'s, so an engine can skip everything else."""

    def __call__(self, V: dict[str, torch.Tensor], wanted_out: tuple[str, ...]) -> dict[str, torch.Tensor]: ...


class Diagonal(Protocol):
    """The engine's exact diagonal: ``diagonal(wanted) -> dict``: for each parameter name of the tuple
    ``wanted``, the diagonal of its block ``H[a, a]`` as a tensor of the parameter's shape."""

    def __call__(self, wanted: tuple[str, ...]) -> dict[str, torch.Tensor]: ...


class Products(Protocol):
    """The engine's products of several groups at once: ``products(groups) -> list``: ``groups`` a list of
    ``(V, wanted_out)``, each as for :class:`Product` with its own ``k``; returns one dict per group, each
    ``product(V, wanted_out)``, computed in one pass that shares what the groups have in common
    (:meth:`HessianOperator.block_diagonal`)."""

    def __call__(self, groups: list) -> list[dict[str, torch.Tensor]]: ...


def head_views(cfg) -> Split:
    """Per-head sub-variables of a block's (:class:`~blockhess.config.BlockConfig`) or a model's
    (:class:`~blockhess.config.ModelConfig`, names prefixed ``blocks.{i}.``) parameters: name
    ``W_Q#h`` → ``(parameter, refined shape, index)``, :func:`blockhess.result.head_split`; empty for
    one head or ``None``; ``ValueError`` for anything else. ``b_Q#h`` is included; :class:`HessianOperator` drops the entries of
    parameters it does not have."""
    if isinstance(cfg, BlockConfig):
        return dict(head_split(cfg))
    if isinstance(cfg, ModelConfig):
        out = {}
        for i, block in enumerate(cfg.blocks):
            pre = block_prefix(i)
            out.update({pre + k: (pre + p, ref, idx) for k, (p, ref, idx) in head_split(block).items()})
        return out
    if cfg is None:
        return {}
    raise ValueError(f"head_views takes a BlockConfig, a ModelConfig or None, got {type(cfg).__name__}")


def _numel(shape) -> int:
    return int(math.prod(shape))


def _scipy_operator(shape, matmat, rmatmat, torch_dtype, device, dtype=None):
    """A ``scipy.sparse.linalg.LinearOperator`` of ``shape`` whose products are ``matmat`` (and ``rmatmat`` for
    the adjoint) on ``(n, k)`` tensors of ``torch_dtype`` on ``device`` (:meth:`HessianOperator.to_scipy`)."""
    try:
        from scipy.sparse.linalg import LinearOperator
    except ImportError as e:  # the library runs without SciPy; only this export needs it
        raise ImportError("to_scipy needs SciPy: pip install scipy (or blockhess[lab])") from e
    np_dtype = np.dtype(dtype) if dtype is not None else np.dtype("float64" if torch_dtype == torch.float64 else "float32")

    def wrap(mm, rows):
        def f(x):
            x = np.asarray(x)
            if np.iscomplexobj(x):
                raise ValueError(f"x must be real ({np_dtype}), got {x.dtype}: the operator is real; multiply the "
                                 "real and imaginary parts separately")
            X = torch.as_tensor(x.reshape(x.shape[0], -1)).to(dtype=torch_dtype, device=device)
            return mm(X).cpu().numpy().astype(np_dtype, copy=False).reshape(rows, *x.shape[1:])
        return f

    return LinearOperator(shape, matvec=wrap(matmat, shape[0]), rmatvec=wrap(rmatmat, shape[1]),
                          matmat=wrap(matmat, shape[0]), rmatmat=wrap(rmatmat, shape[1]), dtype=np_dtype)


class _MatmulBase:
    """What :class:`HessianOperator` and :class:`BlockDiagonalOperator` share: ``@`` on a NumPy array or a
    tensor ``(n,)``/``(n, k)`` (shape checked, then the subclass's ``_check_tensor``) and the columns taken
    ``max_columns`` at a time (``_matmat`` calls the subclass's ``_matmat_columns`` on each chunk)."""

    def _matmul_array(self, V):
        if isinstance(V, np.ndarray):
            if V.ndim not in (1, 2) or V.shape[0] != self.shape[1]:
                raise ValueError(f"V must have shape ({self.shape[1]},) or ({self.shape[1]}, k), got {V.shape}")
            return (self @ torch.as_tensor(V).to(dtype=self.dtype, device=self.device)).cpu().numpy()
        if not isinstance(V, torch.Tensor):
            return NotImplemented
        if V.ndim not in (1, 2) or V.shape[0] != self.shape[1]:
            raise ValueError(f"V must have shape ({self.shape[1]},) or ({self.shape[1]}, k), got {tuple(V.shape)}")
        self._check_tensor(V)
        return self._matmat(V[:, None])[:, 0] if V.ndim == 1 else self._matmat(V)

    def matvec(self, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``self @ v`` for one vector ``v`` ``(n_in,)``, written into ``out`` ``(n_out,)`` where given (then
        returned): the product's rows go straight into it, so a caller multiplying many vectors can keep one
        output whose memory it manages itself (without ``out``, a large output takes the memory of the last
        one the caller dropped: :class:`blockhess.heap.OutputPool`; docs/results.md, "Into a kept output",
        "A pooled output"). The numbers are those of ``self @ v`` to rounding (BLAS
        kernels round by the operands' alignment, so two products of one ``v`` into differently aligned
        outputs can differ in the last bits). Raises ``ValueError`` for a ``v`` not ``(n_in,)`` of the
        operator's dtype and device or not finite, and an ``out`` not a contiguous ``(n_out,)`` tensor of
        that dtype and device, overlapping ``v`` in memory, or requiring grad."""
        if not isinstance(v, torch.Tensor) or v.ndim != 1 or v.shape[0] != self.shape[1]:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"v must be a tensor of shape ({self.shape[1]},), got {got}")
        self._check_tensor(v)
        if out is None:
            return self._matmat(v[:, None])[:, 0]
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (self.shape[0],) or not out.is_contiguous():
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"out must be a contiguous tensor of shape ({self.shape[0]},), got {got}")
        if out.dtype != self.dtype or out.device != self.device:
            raise ValueError(f"out must be {self.dtype} on {self.device} like the operator, got {out.dtype} on "
                             f"{out.device}")
        if out.requires_grad:
            raise ValueError("out must not require grad (the product is written into it in place)")
        lo = v.data_ptr()  # the bytes v spans (a strided column of a matrix spans its stride's gaps too)
        hi = lo + ((v.numel() - 1) * v.stride(0) + 1) * v.element_size()
        if out.data_ptr() < hi and lo < out.data_ptr() + out.numel() * out.element_size():
            raise ValueError("out must not overlap v in memory (the product reads v while it writes out)")
        self._matmat_columns(v[:, None], out=out[:, None])
        return out

    def _matmat(self, X: torch.Tensor) -> torch.Tensor:
        """``self @ X`` for ``X`` ``(n_in, k)`` of the operator's dtype and device: ``(n_out, k)``."""
        k = X.shape[1]
        if k == 0:
            return X.new_zeros(self.shape[0], 0)
        if self.max_columns is not None and k > self.max_columns:
            return torch.cat([self._matmat_columns(X[:, j : j + self.max_columns]) for j in range(0, k, self.max_columns)], 1)
        return self._matmat_columns(X)


class HessianOperator(_MatmulBase):
    r"""A symmetric ``n × n`` matrix over named parameters, given by an engine's products.

    Parameters
    ----------
    product : Product
        ``product(V, wanted_out)``: the engine (:class:`Product`).
    names : sequence of str
        The parameters, canonical order; ``vec_r`` of each, concatenated, is a vector's layout.
    shapes : dict
        ``name -> shape`` of each parameter.
    dtype : torch.float32 or torch.float64
        Of every product (inputs must have it).
    device : torch.device or str
        Of every product.
    diagonal : Diagonal, optional
        The engine's exact diagonal (:class:`Diagonal`); without it :meth:`diagonal` raises
        ``NotImplementedError``.
    split : dict, optional
        Sub-variables addressable in views, ``name -> (parameter, refined shape, index)``
        (:func:`head_views`: each head's column groups ``W_Q#h``); entries of parameters not in
        ``names`` are dropped. Sub-variables of one parameter must not overlap.
    count : int, optional
        The number of sequences this operator averages over (the weight of :func:`mean_operator`).
    max_columns : int, optional
        At most this many columns are passed to the engine at once (a product with more is split).
    kronecker : callable, optional
        ``kronecker(names) -> (M, d) | None``: the engine's rule for a square view over the parameters
        ``names`` whose Hessian is exactly ``M ⊗ I_d`` (:meth:`kronecker_factors`).
    writes_into : bool, optional
        The engine also takes ``product(V, wanted_out, into=...)``: ``into`` maps a parameter to a
        contiguous ``(1, *shape)`` slice of the output of a one-column product, which the engine may
        write that parameter's rows into (and return); rows returned elsewhere are copied there.
    products : Products, optional
        The engine's products of several groups of directions in one pass (:class:`Products`); without it
        a group's product is ``product``'s, one group after another.
    cfg : BlockConfig or ModelConfig, optional
        The architecture whose parameters these are (:func:`~blockhess.operators.hessian_operator` sets
        it); :meth:`to_module` checks a module against it.

    Attributes
    ----------
    shape : tuple (n_out, n_in)
        ``(n, n)`` for the operator and a diagonal view ``A[a, a]``.
    names, shapes, sizes
        The rows' variables (canonical order for the operator; a view's in the order asked),
        ``name -> shape`` and the tuple of their ``numel``.
    in_names, in_shapes, in_sizes
        The same for the columns (equal to the rows' except in an off-diagonal view).
    is_symmetric, SELF_ADJOINT : bool
        Whether the view is symmetric (rows and columns the same variables, in the same order); curvlinops
        spells it ``SELF_ADJOINT``.
    params : tuple of str
        All parameters of the engine (canonical order).
    dtype, device, count, max_columns, cfg

    ``A @ V``: ``V`` a tensor ``(n_in,)`` or ``(n_in, k)`` of the operator's dtype and device (a NumPy
    array is converted and the result returned as NumPy), or a list of tensors of the column
    variables' shapes, each with an optional trailing ``k`` (curvlinops' tensor-list format; the result
    in that format). ``A[a, b]`` is the sub-block view (``a``, ``b`` a name, a head's name ``W_Q#h``, or a
    sequence of them). ``A.T`` / ``A.adjoint()``: the transpose (``A`` itself where rows and columns
    agree). ``A.matvec(v, out=y)``: one vector's product written into a kept output (:meth:`matvec`).
    Products raise ``ValueError`` for an input of another shape, dtype or device, and ``RuntimeError``
    when the engine returns a tensor of the wrong shape.
    """

    def __init__(self, product: Product, names: Sequence[str], shapes: dict, dtype: torch.dtype,
                 device: torch.device | str, *, diagonal: Diagonal | None = None, split: Split | None = None,
                 count: int | None = None, max_columns: int | None = None, writes_into: bool = False,
                 cfg=None, kronecker=None, products: Products | None = None, expect=None):
        if not callable(product):
            raise ValueError(f"product must be callable as product(V, wanted_out), got {type(product).__name__}")
        if diagonal is not None and not callable(diagonal):
            raise ValueError(f"diagonal must be None or callable as diagonal(wanted), got {type(diagonal).__name__}")
        names = tuple(names)
        if not names or len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"names must be a non-empty sequence of distinct strings, got {names!r}")
        if not isinstance(shapes, dict) or set(names) - set(shapes):
            raise ValueError(f"shapes must be a dict with a shape for each of {list(names)}")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype!r}")
        self._product = product
        self._writes_into = check_bool("writes_into", writes_into)
        self._diagonal = diagonal
        if kronecker is not None and not callable(kronecker):
            raise ValueError(f"kronecker must be None or callable as kronecker(names), got {type(kronecker).__name__}")
        self._kronecker = kronecker
        if products is not None and not callable(products):
            raise ValueError(f"products must be None or callable as products(groups), got {type(products).__name__}")
        self._products = products
        if expect is not None and not callable(expect):
            raise ValueError(f"expect must be None or callable as expect(groups), got {type(expect).__name__}")
        self._expect = expect
        self._outputs = OutputPool()  # one-vector products' outputs (a view shares its operator's)
        self.params = names
        self.param_shapes = {n: tuple(int(s) for s in shapes[n]) for n in names}
        self.dtype = dtype
        self.device = torch.device(device)
        self.count = None if count is None else check_int("count", count, 1)
        self.max_columns = None if max_columns is None else check_int("max_columns", max_columns, 1)
        self.cfg = cfg
        self._vars = {n: (n, s, tuple(slice(None) for _ in s)) for n, s in self.param_shapes.items()}
        for name, (param, ref, idx) in (split or {}).items():
            if param not in self.param_shapes:
                continue
            if name in self._vars:
                raise ValueError(f"split: sub-variable {name!r} has a parameter's name")
            if _numel(ref) != _numel(self.param_shapes[param]) or len(idx) != len(ref):
                raise ValueError(f"split[{name!r}]: refined shape {tuple(ref)} with index {idx!r} does not fit "
                                 f"{param!r} of shape {self.param_shapes[param]}")
            self._vars[name] = (param, tuple(int(r) for r in ref), tuple(idx))
        self._check_split()
        self._set(names, names)

    # ------------------------------------------------------------------ bookkeeping

    def _check_split(self) -> None:
        """Sub-variables of one parameter must be disjoint (each entry in at most one)."""
        masks: dict[str, torch.Tensor] = {}
        for name, (param, ref, idx) in self._vars.items():
            if name == param:
                continue
            mask = masks.setdefault(param, torch.zeros(ref, dtype=torch.int32))
            mask.view(ref)[idx] += 1
            if int(mask.max()) > 1:
                raise ValueError(f"split: sub-variable {name!r} overlaps another of {param!r}")

    def _sub_shape(self, var: str) -> tuple[int, ...]:
        _, ref, idx = self._vars[var]
        return tuple(len(range(*i.indices(r))) for r, i in zip(ref, idx) if not isinstance(i, numbers.Integral))

    def _set(self, rows: tuple[str, ...], cols: tuple[str, ...]) -> None:
        self.names, self.in_names = rows, cols
        self.shapes = {v: self._sub_shape(v) for v in rows}
        self.in_shapes = {v: self._sub_shape(v) for v in cols}
        self.sizes = tuple(_numel(self.shapes[v]) for v in rows)
        self.in_sizes = tuple(_numel(self.in_shapes[v]) for v in cols)
        self.shape = (sum(self.sizes), sum(self.in_sizes))

    @property
    def is_square_view(self) -> bool:
        """Whether rows and columns are the same variables (the operator, or a view ``A[a, a]``): then
        the view is symmetric and ``A.T`` is ``A``."""
        return self.names == self.in_names

    @property
    def is_symmetric(self) -> bool:
        """Whether this view is a symmetric matrix: its rows and columns are the same variables in the same
        order (the operator, or a view ``A[a, a]``; ``H`` is symmetric). ``False`` for an off-diagonal view
        ``A[a, b]``, square or not, and for ``A[(a, b), (b, a)]`` (a permutation of a symmetric block is not
        symmetric). The estimators that assume a symmetric operator (:func:`~blockhess.operators.lanczos_eigs`,
        :func:`~blockhess.operators.slq_density`, :func:`~blockhess.operators.hutchpp_trace`) refuse a view
        where it is ``False``."""
        return self.is_square_view

    @property
    def SELF_ADJOINT(self) -> bool:
        """curvlinops' name for :attr:`is_symmetric` (its operators' class attribute; here per view)."""
        return self.is_square_view

    def _select(self, key, within: tuple[str, ...], what: str) -> tuple[str, ...]:
        names = (key,) if isinstance(key, str) else tuple(key) if isinstance(key, (tuple, list)) else None
        if not names or not all(isinstance(n, str) for n in names):
            raise KeyError(f"{what} of A[a, b] must be a name or a non-empty sequence of names, got {key!r}")
        for n in names:
            if n not in self._vars:
                raise KeyError(f"unknown variable {n!r}; this operator has {list(self._vars)}")
            if n not in within and self._vars[n][0] not in within:
                raise KeyError(f"{n!r} is not among this view's {what}, {list(within)}")
        covered: dict[str, set[str]] = {}
        for n in names:
            param = self._vars[n][0]
            seen = covered.setdefault(param, set())
            if n in seen or param in seen or (n == param and seen):
                raise KeyError(f"{what} of A[a, b] name overlapping variables of {param!r}: {list(names)}")
            seen.add(n)
        return names

    def __getitem__(self, key) -> "HessianOperator":
        """The sub-block view ``A[a, b]`` (``n_a × n_b``): ``a``, ``b`` a variable name (a parameter
        or a head's ``W_Q#h``) or a sequence of non-overlapping ones, among this view's rows and
        columns. Its products take vectors over ``b``'s entries only and return ``a``'s rows only.
        Raises ``KeyError`` for another key."""
        if not (isinstance(key, tuple) and len(key) == 2):
            raise KeyError(f"index a HessianOperator by a pair, e.g. A[{self.names[0]!r}, {self.names[0]!r}]; got {key!r}")
        rows = self._select(key[0], self.names, "rows")
        cols = self._select(key[1], self.in_names, "columns")
        view = object.__new__(HessianOperator)
        view.__dict__.update(self.__dict__)
        view._set(rows, cols)
        return view

    @property
    def T(self) -> "HessianOperator":
        """The transpose: ``A`` itself for a square view (``H`` is symmetric), else the view ``A[b, a]``."""
        return self.adjoint()

    def adjoint(self) -> "HessianOperator":
        """The adjoint (transpose; real entries), as :attr:`T` (curvlinops' method name)."""
        if self.is_square_view:
            return self
        view = object.__new__(HessianOperator)
        view.__dict__.update(self.__dict__)
        view._set(self.in_names, self.names)
        return view

    # ------------------------------------------------------------------ products

    def _columns_to_params(self, X: torch.Tensor) -> dict[str, torch.Tensor]:
        """``X`` ``(n_in, k)`` split into the column variables and embedded into their parameters: ``(k, *shape)``."""
        k = X.shape[1]
        V: dict[str, torch.Tensor] = {}
        off = 0
        for var, size in zip(self.in_names, self.in_sizes):
            block = X[off : off + size].T  # (k, size)
            off += size
            param, ref, idx = self._vars[var]
            if var == param:
                V[param] = block.reshape(k, *ref)
                continue
            if param not in V:
                V[param] = X.new_zeros(k, *self.param_shapes[param])
            V[param].view(k, *ref)[(slice(None), *idx)] = block.reshape(k, *self.in_shapes[var])
        return V

    def _matmat_columns(self, X: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``H_view @ X`` for ``X`` ``(n_in, k)``, ``1 <= k <= max_columns``: ``(n_out, k)``; ``out`` (one
        column): ``(n_out, 1)``, written and returned."""
        k = X.shape[1]
        wanted = tuple(dict.fromkeys(self._vars[v][0] for v in self.names))
        if X.requires_grad:  # (out= has no autograd: a tracked X's rows are assembled, then copied)
            self._outputs.clear()
            Y = self._stacked(self._product(self._columns_to_params(X), wanted), k)
            return Y if out is None else out.copy_(Y)
        if k == 1 and out is None:
            out = self._outputs.empty(self.shape[0], X.dtype, X.device)[:, None]
        elif out is None:
            self._outputs.clear()  # no output from the pool: its memory is not held through this product
        if k == 1 and self._writes_into:
            return self._vector(X, wanted, out)
        return self._stacked(self._product(self._columns_to_params(X), wanted), k, out)

    def _stacked(self, out: dict, k: int, dest: torch.Tensor | None = None) -> torch.Tensor:
        """An engine's rows ``out`` (over parameters, ``k`` directions each) as this view's ``(n_out, k)``,
        written into ``dest`` (then returned) where given."""
        rows = [self._row(out, var, k).reshape(k, -1).T for var in self.names]
        if dest is not None:
            return torch.cat(rows, 0, out=dest) if len(rows) > 1 else dest.copy_(rows[0])
        return torch.cat(rows, 0) if len(rows) > 1 else rows[0].contiguous()

    def _row(self, out, var: str, k: int) -> torch.Tensor:
        """The engine's rows of column variable ``var`` ``(k, *var's shape)``, checked."""
        param, ref, idx = self._vars[var]
        y = out.get(param) if isinstance(out, dict) else None
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != (k, *self.param_shapes[param]):
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise RuntimeError(f"the operator's product returned {got} for {param!r}, expected a tensor of shape "
                               f"{(k, *self.param_shapes[param])}")
        return y if var == param else y.reshape(k, *ref)[(slice(None), *idx)]

    def _vector(self, X: torch.Tensor, wanted: tuple, flat: torch.Tensor) -> torch.Tensor:
        """``H_view @ x`` for one column ``X`` ``(n_in, 1)`` into ``flat`` ``(n_out, 1)`` (returned), the engine
        writing a whole parameter's rows straight into their slice where it can (``into``), the rest copied
        there."""
        out = self._product(self._columns_to_params(X), wanted, into=self._into(flat[:, 0]))
        self._collect(out, flat[:, 0])
        return flat

    def _into(self, dest: torch.Tensor) -> dict:
        """The engine's destinations (``into``) of a one-column product in ``dest`` ``(n_out,)``: each whole
        parameter's slice, as ``(1, *shape)``."""
        into, off = {}, 0
        for var, size in zip(self.names, self.sizes):
            if self._vars[var][0] == var:
                into[var] = dest[off : off + size].view(1, *self.param_shapes[var])
            off += size
        return into

    def _collect(self, out, dest: torch.Tensor) -> None:
        """The rows of a one-column product ``out`` into ``dest`` ``(n_out,)``, copying those the engine did
        not write there."""
        off = 0
        for var, size in zip(self.names, self.sizes):
            y, d = self._row(out, var, 1), dest[off : off + size]
            if y.data_ptr() != d.data_ptr() or not y.is_contiguous():  # not written in place
                d.copy_(y.reshape(-1))
            off += size

    def _check_tensor(self, V: torch.Tensor, what: str = "V", var: str | None = None) -> None:
        """``V`` of the operator's dtype and device, and finite; a non-finite entry is named by its column
        variable (``var`` for a list's tensor; else found from the row of a flat ``V``)."""
        if V.dtype != self.dtype or V.device != self.device:
            raise ValueError(f"{what} must be {self.dtype} on {self.device} like the operator, got {V.dtype} on {V.device}")
        if V.numel() and bool(torch.isfinite(V.reshape(V.shape[0], -1).sum(0)).all()):
            return  # finite sums: every entry finite (a NaN or Inf makes its column's sum NaN or Inf), in one pass
        bad = ~torch.isfinite(V)  # else look (a sum can also overflow from finite entries)
        if bool(bad.any()):
            if var is None:
                row, off = int(bad.reshape(V.shape[0], -1).any(1).nonzero()[0, 0]), 0
                for var, size in zip(self.in_names, self.in_sizes):
                    if row < off + size:
                        break
                    off += size
            raise ValueError(f"{what} contains NaN or Inf (in the entries of {var!r})")

    def __matmul__(self, V):
        """``A @ V``; see the class docstring for the formats."""
        if isinstance(V, list):
            return self._matmul_list(V)
        return self._matmul_array(V)

    def _matmul_list(self, V: list):
        shapes = [self.in_shapes[v] for v in self.in_names]
        if len(V) != len(shapes) or not all(isinstance(t, torch.Tensor) for t in V):
            raise ValueError(f"a list V must hold {len(shapes)} tensors, one per column variable {list(self.in_names)}")
        for t, var in zip(V, self.in_names):
            self._check_tensor(t, "each tensor of V", var)
        if all(tuple(t.shape) == s for t, s in zip(V, shapes)):
            X = torch.cat([t.reshape(-1, 1) for t in V], 0)
            vector = True
        elif all(t.ndim == len(s) + 1 and tuple(t.shape[:-1]) == s for t, s in zip(V, shapes)) \
                and len({t.shape[-1] for t in V}) == 1:
            X = torch.cat([t.reshape(-1, t.shape[-1]) for t in V], 0)
            vector = False
        else:
            raise ValueError(f"a list V must hold tensors of shapes {shapes}, each with an optional trailing k, "
                             f"got {[tuple(t.shape) for t in V]}")
        Y = self._matmat(X)
        out, off = [], 0
        for var, size in zip(self.names, self.sizes):
            y = Y[off : off + size]
            off += size
            out.append(y.reshape(self.shapes[var]) if vector else y.reshape(*self.shapes[var], Y.shape[1]))
        return out

    def dense(self) -> torch.Tensor:
        """The view as a dense ``(n_out, n_in)`` matrix, ``A @ I`` (the identity's columns in chunks of
        ``max_columns``, or ``DENSE_COLUMNS``). Raises ``InsufficientMemoryError`` before allocating if it
        would not fit."""
        n_out, n_in = self.shape
        chunk = self.max_columns or DENSE_COLUMNS
        check_fits((n_out * n_in + n_in * min(chunk, n_in)) * torch.finfo(self.dtype).bits // 8,
                   f"the dense {n_out}x{n_in} matrix", self.device)
        M = torch.empty(n_out, n_in, dtype=self.dtype, device=self.device)
        for j in range(0, n_in, chunk):
            c = min(chunk, n_in - j)
            E = torch.zeros(n_in, c, dtype=self.dtype, device=self.device)
            E[j : j + c].fill_diagonal_(1)
            M[:, j : j + c] = self._matmat(E)
        return M

    def diagonal(self) -> torch.Tensor:
        """The exact diagonal ``(n,)`` of a square view, from the engine's closed form (:class:`Diagonal`).

        Raises ``ValueError`` for an off-diagonal view and ``NotImplementedError`` when the engine offers
        no closed-form diagonal (:func:`~blockhess.operators.estimators.hutchinson_diagonal` estimates one
        by sampling), ``RuntimeError`` when the engine returns a tensor of the wrong shape."""
        if not self.is_square_view:
            raise ValueError(f"the diagonal is defined for a square view A[a, a]; this view's rows are "
                             f"{list(self.names)} and columns {list(self.in_names)}")
        if self._diagonal is None:
            raise NotImplementedError("this operator's engine offers no closed-form diagonal; "
                                      "blockhess.operators.hutchinson_diagonal estimates it by sampling")
        wanted = tuple(dict.fromkeys(self._vars[v][0] for v in self.names))
        d = self._diagonal(wanted)
        parts = []
        for var in self.names:
            param, ref, idx = self._vars[var]
            y = d.get(param) if isinstance(d, dict) else None
            if not isinstance(y, torch.Tensor) or tuple(y.shape) != self.param_shapes[param]:
                raise RuntimeError(f"the operator's diagonal returned no tensor of shape {self.param_shapes[param]} "
                                   f"for {param!r}")
            parts.append((y if var == param else y.reshape(ref)[idx]).reshape(-1))
        return torch.cat(parts)

    def kronecker_factors(self):
        """``(M, d)`` where the engine's closed form shows this square view's Hessian to be exactly
        ``M ⊗ I_d`` (``M`` ``(m, m)``, ``n = m·d``, in ``vec_r`` order: the slow index ``M``'s), else ``None``
        (an engine without the rule, an off-diagonal or head view, a block without that structure).
        :func:`~blockhess.operators.lanczos_eigs` reads it: the spectrum from ``M``'s, each value ``d`` times."""
        if self._kronecker is None or not self.is_square_view or any(self._vars[v][0] != v for v in self.names):
            return None
        return self._kronecker(tuple(self.names))

    def _grouped(self, groups: list, into: list | None = None) -> list[dict]:
        """The engine's products of ``groups`` ``[(V, wanted_out)]`` (:class:`Products`), in one pass where the
        engine has one, else one group after another; ``into`` (one-column groups of an engine that
        ``writes_into``): one destination dict per group."""
        if self._products is not None:
            return self._products(groups) if into is None else self._products(groups, into=into)
        if into is None:
            return [self._product(V, wanted) for V, wanted in groups]
        return [self._product(V, wanted, into=i) for (V, wanted), i in zip(groups, into)]

    def _params_of(self, names) -> tuple[str, ...]:
        """The parameters that variables ``names`` lie in, in order, once each."""
        return tuple(dict.fromkeys(self._vars[v][0] for v in names))

    def expect_columns(self, columns: int) -> None:
        r"""A hint that at least ``columns`` more columns of this view's products will follow (an estimator's
        plan), for engines that trade a setup against work per product: a model's softmax head then forms its
        per-row matrices :math:`W\Omega_tW^\top` at once where the columns reach their break-even, instead of
        after that many columns on the chunked pass (docs/derivations.md §18, "The head's pass"). The products
        are the same with or without it, to the rounding of the two paths. Raises ``ValueError`` for a
        negative or non-integer ``columns``."""
        columns = check_int("columns", columns, 0)
        if self._expect is not None and columns:  # the parameters the columns carry or want rows of
            self._expect([(self._params_of(self.in_names + self.names), columns)])

    def block_diagonal(self, blocks=None) -> "BlockDiagonalOperator":
        """The block-diagonal part ``D = diag(A[b_1, b_1], ..., A[b_m, b_m])`` of this square view over
        ``blocks`` (default: its variables, one block each; each block a name, a head's ``W_Q#h`` or a tuple
        of them, as :func:`~blockhess.operators.per_block` takes them): a
        :class:`BlockDiagonalOperator`, whose ``D @ V`` gives every block's ``A[b, b] @ V_b`` in one pass.
        Raises ``ValueError`` for an off-diagonal view, no blocks or blocks sharing an entry, ``KeyError`` for
        a block ``A[b, b]`` does not take (an unknown name, names overlapping within it)."""
        return BlockDiagonalOperator(self, blocks)

    def to_scipy(self, dtype=None):
        """A ``scipy.sparse.linalg.LinearOperator`` of this view (products in PyTorch, in the operator's
        dtype and device; inputs converted to it, results returned as NumPy of ``dtype``, default the
        operator's: float64 or float32; a complex input raises ``ValueError``). SciPy is imported here only;
        ``ImportError`` without it."""
        adj = self.adjoint()
        return _scipy_operator(self.shape, self._matmat, adj._matmat, self.dtype, self.device, dtype)

    def to_module(self, module) -> "HessianOperator":
        """This operator in ``module``'s own parameters and storage layouts (:func:`module_operator`, which
        :func:`blockhess.adapters.operator_to_module` implements for a ``torch.nn.Module``): a
        :class:`HessianOperator` over ``module.named_parameters()`` (their order, each in its stored shape,
        a tied tensor once), so ``A.to_module(model) @ [t_1, ..., t_P]`` takes and returns lists shaped like
        ``list(model.parameters())`` and ``@`` on a flat ``(m,)``/``(m, k)`` tensor takes
        ``parameters_to_vector``'s order. Raises ``ValueError`` as that function."""
        return module_operator(module, self)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_dense(cls, H, names=None, shapes=None, split=None) -> "HessianOperator":
        """The operator of a dense Hessian: ``H`` a :class:`~blockhess.result.HessianBlocks` (its blocks,
        names and shapes; heads from its ``cfg``, :func:`head_views`), or a symmetric ``(n, n)`` tensor
        with ``names``/``shapes`` (default one variable ``"x"`` of shape ``(n,)``). Products are the blocks'
        matrix products (``Σ_b H[a, b] V_b``), the diagonal exact. For checks and small problems: the
        dense matrix is what a matrix-free engine avoids. Raises ``ValueError`` for another ``H``, a tensor
        that is not symmetric to rounding (``‖H − Hᵀ‖_F > n ε ‖H‖_F``) or ``shapes`` of another size."""
        if isinstance(H, HessianBlocks):
            blocks = {(a, b): H[a, b] for a in H.names for b in H.names}
            names, shapes = H.names, H.shapes
            split = head_views(H.cfg) if split is None else split
            dtype, device, cfg = H.dtype, H.device, H.cfg
        elif isinstance(H, torch.Tensor) and H.ndim == 2 and H.shape[0] == H.shape[1] and H.dtype in FLOAT_DTYPES:
            n = H.shape[0]
            asym = float(torch.linalg.matrix_norm(H - H.T))
            if asym > n * torch.finfo(H.dtype).eps * float(torch.linalg.matrix_norm(H)):
                raise ValueError(f"H must be symmetric (to rounding): ||H - H^T||_F = {asym:.3g}")
            names = ("x",) if names is None else tuple(names)
            shapes = {"x": (n,)} if shapes is None else shapes
            sizes = [_numel(shapes[a]) for a in names]
            if sum(sizes) != n:
                raise ValueError(f"shapes {shapes} hold {sum(sizes)} entries, H has {n}")
            offs = np.cumsum([0, *sizes])
            blocks = {(a, b): H[offs[i]:offs[i + 1], offs[j]:offs[j + 1]]
                      for i, a in enumerate(names) for j, b in enumerate(names)}
            dtype, device, cfg = H.dtype, H.device, None
        else:
            raise ValueError(f"H must be a HessianBlocks or a square float32/float64 2-d tensor, got "
                             f"{type(H).__name__}{tuple(H.shape) if isinstance(H, torch.Tensor) else ''}")
        flat = {n: _numel(shapes[n]) for n in names}

        def product(V, wanted_out):
            k = next(iter(V.values())).shape[0] if V else 0
            out = {}
            for a in wanted_out:
                acc = torch.zeros(k, flat[a], dtype=dtype, device=device)
                for b, v in V.items():
                    acc = acc + v.reshape(k, -1) @ blocks[(a, b)].T
                out[a] = acc.reshape(k, *shapes[a])
            return out

        def diagonal(wanted):
            return {a: torch.diagonal(blocks[(a, a)]).reshape(shapes[a]) for a in wanted}

        return cls(product, names, shapes, dtype, device, diagonal=diagonal, split=split, cfg=cfg)

    def __repr__(self) -> str:
        rows = ", ".join(f"{n}{list(self.shapes[n])}" for n in self.names)
        cols = "" if self.is_square_view else " x " + ", ".join(f"{n}{list(self.in_shapes[n])}" for n in self.in_names)
        return f"HessianOperator({rows}{cols}; shape={self.shape}, dtype={self.dtype}, device={self.device})"


class BlockDiagonalOperator(_MatmulBase):
    r"""The block-diagonal part of a Hessian, :math:`D = \mathrm{diag}(H_{b_1b_1}, \ldots, H_{b_mb_m})`, over blocks
    of a square :class:`HessianOperator` view (:meth:`HessianOperator.block_diagonal` makes it).

    ``D @ V``: ``V`` a tensor ``(n_D,)`` or ``(n_D, k)`` of the operator's dtype and device (a NumPy array
    is converted and the result returned as NumPy), ``n_D = Σ_j n_{b_j}``, the blocks' entries concatenated
    in the order given (each block's variables in its own order, as its view ``A[b, b]`` lays them out);
    the result is every block's ``A[b_j, b_j] @ V_j`` concatenated the same way. One call computes them
    all: the engine's :class:`Products` where it has one (a model's: one forward's cache, the adjoints
    computed once, each block's tangent starting at its own stage and its rows alone formed, the stages
    above run once for every block; docs/derivations.md §18, "Products of several groups"), else one
    view's product after another. :meth:`products` multiplies some blocks only, each by its own number of
    columns (the lock-step estimators' step, :func:`~blockhess.operators.blockwise_eigs`).

    Attributes: ``blocks`` (the keys: a name, or a tuple of names), ``views`` (each block's ``A[b, b]``),
    ``sizes`` (each ``n_b``), ``offsets`` (each block's first row), ``shape`` ``(n_D, n_D)``, ``dtype``,
    ``device``, ``is_symmetric`` and ``SELF_ADJOINT`` (``True``), ``max_columns`` (``A``'s). ``D.T`` /
    ``D.adjoint()`` is ``D``; ``to_scipy()`` as :meth:`HessianOperator.to_scipy`; ``D.matvec(v, out=y)`` as
    :meth:`HessianOperator.matvec`. Products raise
    ``ValueError`` for an input of another shape, dtype or device, or with NaN or Inf.
    """

    def __init__(self, A: HessianOperator, blocks=None):
        if not isinstance(A, HessianOperator):
            raise ValueError(f"A must be a HessianOperator, got {type(A).__name__}")
        if not A.is_square_view:
            raise ValueError(f"block_diagonal needs a square view A[a, a]; this one's rows are {list(A.names)} and "
                             f"columns {list(A.in_names)}")
        blocks = list(A.names if blocks is None else [blocks] if isinstance(blocks, str) else blocks)
        if not blocks:
            raise ValueError("blocks must hold at least one block (a name, a head's W_Q#h or a tuple of names)")
        self.blocks = tuple(b if isinstance(b, str) else tuple(b) for b in blocks)
        self.views = tuple(A[b, b] for b in self.blocks)  # KeyError for an unknown or self-overlapping block
        seen: dict[str, torch.Tensor] = {}
        for b, view in zip(self.blocks, self.views):
            for var in view.names:
                param, ref, idx = A._vars[var]
                mask = seen.setdefault(param, torch.zeros(_numel(ref), dtype=torch.bool))
                hit = torch.zeros_like(mask)
                hit.view(ref)[idx] = True
                if bool((mask & hit).any()):
                    raise ValueError(f"blocks must not share entries: block {b!r} overlaps an earlier block in "
                                     f"{param!r}")
                mask |= hit
        self.A = A
        self.sizes = tuple(v.shape[0] for v in self.views)
        self.offsets = tuple(int(o) for o in np.cumsum([0, *self.sizes[:-1]]))
        n = sum(self.sizes)
        self.shape = (n, n)
        self.dtype, self.device, self.max_columns = A.dtype, A.device, A.max_columns
        self.is_symmetric = self.SELF_ADJOINT = True
        self._outputs = OutputPool()

    @property
    def T(self) -> "BlockDiagonalOperator":
        """``D`` itself (each block is symmetric)."""
        return self

    def adjoint(self) -> "BlockDiagonalOperator":
        """``D`` itself (curvlinops' method name)."""
        return self

    def products(self, X: dict, out: dict | None = None) -> dict:
        """``{j: A[b_j, b_j] @ X[j]}`` for some blocks only, in one call: ``X`` maps block indices (into
        ``blocks``) to tensors ``(n_{b_j}, k_j)`` of the operator's dtype and device, each its own ``k_j >= 1``
        (not checked further: :meth:`__matmul__` checks its input). Returns ``{j: (n_{b_j}, k_j)}``. ``out``
        (every ``k_j = 1``): ``{j: (n_{b_j},) tensor}``, destinations the rows are written into where the
        engine can (``writes_into``), the returned tensors then views of them."""
        groups, order = [], list(X)
        for j in order:
            view = self.views[j]
            groups.append((view._columns_to_params(X[j]), view._params_of(view.names)))
        if all(X[j].shape[1] == 1 for j in order) and self.A._writes_into and not any(X[j].requires_grad for j in order):
            dest = out or {j: X[j].new_empty(self.views[j].shape[0]) for j in order}  # the engine writes rows there
            out = self.A._grouped(groups, into=[self.views[j]._into(dest[j]) for j in order])
            for j, rows in zip(order, out):
                self.views[j]._collect(rows, dest[j])
            return {j: dest[j][:, None] for j in order}
        out = self.A._grouped(groups)
        return {j: self.views[j]._stacked(rows, X[j].shape[1]) for j, rows in zip(order, out)}

    def expect_columns(self, columns: dict) -> None:
        """A hint that at least ``columns[j]`` more columns of block ``j``'s products will follow (``columns``
        ``{block index: count}``), as :meth:`HessianOperator.expect_columns`; the lock-step estimators give
        their plan here before their first product. Raises ``ValueError`` for a bad index or count."""
        if not isinstance(columns, dict):
            raise ValueError(f"columns must be a dict of block indices to counts, got {type(columns).__name__}")
        groups = []
        for j, c in columns.items():
            if isinstance(j, bool) or not isinstance(j, numbers.Integral) or not 0 <= j < len(self.blocks):
                raise ValueError(f"columns must map block indices in [0, {len(self.blocks)}) to counts, got key {j!r}")
            c = check_int(f"columns[{j}]", c, 0)
            if c:
                groups.append((self.views[int(j)]._params_of(self.views[int(j)].in_names), c))
        if self.A._expect is not None and groups:
            self.A._expect(groups)

    def _matmat_columns(self, X: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        k = X.shape[1]
        cols = {j: X[o : o + s] for j, (o, s) in enumerate(zip(self.offsets, self.sizes))}
        if k == 1:  # one output vector, each block's rows written into its slice
            flat = self._outputs.empty(self.shape[0], X.dtype, X.device) if out is None else out[:, 0]
            Y = self.products(cols, out={j: flat[o : o + s] for j, (o, s) in enumerate(zip(self.offsets, self.sizes))})
            for j, (o, s) in enumerate(zip(self.offsets, self.sizes)):
                if Y[j].data_ptr() != flat[o:].data_ptr():
                    flat[o : o + s].copy_(Y[j][:, 0])
            return flat[:, None]
        self._outputs.clear()  # no output from the pool: its memory is not held through this product
        Y = self.products(cols)
        return torch.cat([Y[j] for j in range(len(self.blocks))], 0, out=out)

    def __matmul__(self, V):
        """``D @ V``; see the class docstring."""
        return self._matmul_array(V)

    def _check_tensor(self, V: torch.Tensor) -> None:
        """``V`` of the operator's dtype and device, and finite (a non-finite entry named by its block)."""
        if V.dtype != self.dtype or V.device != self.device:
            raise ValueError(f"V must be {self.dtype} on {self.device} like the operator, got {V.dtype} on {V.device}")
        finite = not V.numel() or bool(torch.isfinite(V.reshape(V.shape[0], -1).sum(0)).all())  # one pass (a NaN
        if not finite and not bool(torch.isfinite(V).all()):  # or Inf makes its column's sum one), then look
            row = int((~torch.isfinite(V.reshape(V.shape[0], -1))).any(1).nonzero()[0, 0])
            j = int(np.searchsorted(self.offsets, row, side="right")) - 1
            raise ValueError(f"V contains NaN or Inf (in the entries of block {self.blocks[j]!r})")

    def to_scipy(self, dtype=None):
        """A ``scipy.sparse.linalg.LinearOperator`` of ``D`` (as :meth:`HessianOperator.to_scipy`)."""
        return _scipy_operator(self.shape, self._matmat, self._matmat, self.dtype, self.device, dtype)

    def __repr__(self) -> str:
        return (f"BlockDiagonalOperator({len(self.blocks)} blocks {list(self.blocks)}; shape={self.shape}, "
                f"dtype={self.dtype}, device={self.device})")


def mean_operator(parts: Sequence, counts: Sequence[int] | None = None, progress: bool = False) -> HessianOperator:
    r"""The Hessian of the mean loss over a dataset of batches, :math:`\sum_i c_i H_i / \sum_i c_i`
    (each batch operator :math:`H_i` the mean over its :math:`c_i` sequences), as one operator.

    ``parts``: a non-empty sequence of :class:`HessianOperator` (each holds its batch's factors) or of
    callables ``() -> HessianOperator`` (built again for every product: one batch's factors in memory
    at a time, each batch's forward pass recomputed per product), all over the same parameters,
    shapes, dtype and device. ``counts``: each batch's sequence count, default each operator's
    ``count``. ``progress``: a tqdm bar over the batches in each product (tqdm imported here only).
    The result has the parts' views (``A[a, b]`` restricts every batch's product), ``count = Σ c_i``,
    and the exact diagonal :math:`\sum_i c_i\,\mathrm{diag}\,H_i / \sum_i c_i` where every part has one.

    Raises ``ValueError`` for an empty ``parts``, a part of other parameters, shapes, dtype or device
    (named by its index; a callable's when it is built), counts missing or not positive integers, or
    their number unlike the parts'; ``ImportError`` for ``progress=True`` without tqdm.
    """
    check_bool("progress", progress)
    parts = list(parts)
    if not parts:
        raise ValueError("parts must hold at least one operator (or callable returning one)")
    first = parts[0] if isinstance(parts[0], HessianOperator) else parts[0]()
    if not isinstance(first, HessianOperator):
        raise ValueError(f"parts[0] must be a HessianOperator or a callable returning one, got {type(first).__name__}")

    def check(i, op):
        if not isinstance(op, HessianOperator):
            raise ValueError(f"parts[{i}] must be a HessianOperator or a callable returning one, got {type(op).__name__}")
        same = (op.params == first.params and op.param_shapes == first.param_shapes and op.dtype == first.dtype
                and op.device == first.device and op.is_square_view and op.names == op.params)
        if not same:
            raise ValueError(f"parts[{i}] is {op!r}; every part must be a whole operator like parts[0], {first!r}")
        return op

    check(0, first)
    for i, p in enumerate(parts):
        if isinstance(p, HessianOperator):
            check(i, p)
        elif not callable(p):
            raise ValueError(f"parts[{i}] must be a HessianOperator or a callable returning one, got {type(p).__name__}")
    if counts is None:
        counts = [p.count if isinstance(p, HessianOperator) else None for p in parts]
        if any(c is None for c in counts):
            raise ValueError("counts must be given (each batch's sequence count) unless every part is an operator "
                             "with a count")
    counts = list(counts)
    if len(counts) != len(parts):
        raise ValueError(f"counts must have one entry per part ({len(parts)}), got {len(counts)}")
    counts = [check_int(f"counts[{i}]", c, 1) for i, c in enumerate(counts)]
    total = sum(counts)
    weights = [c / total for c in counts]
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm as bar
        except ImportError as e:  # the library runs without tqdm; only the progress bar needs it
            raise ImportError("progress=True needs tqdm: pip install tqdm (or blockhess[lab])") from e

    def each():
        items = enumerate(zip(parts, weights))
        if bar is not None:
            items = bar(items, total=len(parts), desc="batches", leave=False)
        for i, (p, w) in items:
            yield (p if isinstance(p, HessianOperator) else check(i, p())), w

    def product(V, wanted_out):
        out = {}
        for op, w in each():
            y = op._product(V, wanted_out)
            for a in wanted_out:
                out[a] = y[a] * w if a not in out else out[a].add_(y[a], alpha=w)
        return out

    def diagonal(wanted):
        out = {}
        for op, w in each():
            if op._diagonal is None:
                raise NotImplementedError("a batch's operator offers no closed-form diagonal, so the mean has none; "
                                          "blockhess.operators.hutchinson_diagonal estimates it by sampling")
            y = op._diagonal(wanted)
            for a in wanted:
                out[a] = y[a] * w if a not in out else out[a].add_(y[a], alpha=w)
        return out

    def products(groups):
        outs = [{} for _ in groups]
        for op, w in each():
            for out, y, (_, wanted_out) in zip(outs, op._grouped(groups), groups):
                for a in wanted_out:
                    out[a] = y[a] * w if a not in out else out[a].add_(y[a], alpha=w)
        return outs

    def expect(groups):  # every batch's operator given as one (a lazy part's is made anew for each product)
        for p in parts:
            if isinstance(p, HessianOperator) and p._expect is not None:
                p._expect(groups)

    has_diag = all(p._diagonal is not None for p in parts if isinstance(p, HessianOperator))
    split = {v: t for v, t in first._vars.items() if v != t[0]}
    return HessianOperator(product, first.params, first.param_shapes, first.dtype, first.device,
                           diagonal=diagonal if has_diag else None, split=split, count=total,
                           max_columns=first.max_columns, cfg=first.cfg, products=products, expect=expect)


@functools.singledispatch
def module_operator(module, A: HessianOperator) -> HessianOperator:
    """``A`` in ``module``'s own parameter names and storage layouts (:meth:`HessianOperator.to_module`).
    One implementation per kind of module, registered by the adapter that reads it
    (:mod:`blockhess.adapters` registers ``torch.nn.Module``: :func:`~blockhess.adapters.operator_to_module`),
    so that the core imports no adapter. Raises ``ValueError`` for an object no adapter has registered."""
    raise ValueError(f"to_module maps an operator to the parameters of a module an adapter reads (a torch.nn.Module: "
                     f"blockhess.adapters.operator_to_module), got {type(module).__name__}")
