"""The result type: ``HessianBlocks``, a symmetric block matrix over named parameters, and its accumulators.

A Hessian over parameters ``names`` (sizes ``sizes``) is assembled once per unordered pair
``(a, b)`` (``a`` not after ``b`` in ``names``); ``H[b, a]`` is the transpose of ``H[a, b]``.
:class:`BlockSum` accumulates contributions either into a dict of blocks (small results,
``vmap``-friendly) or straight into one preallocated ``n × n`` buffer (the full Hessian:
no second copy; the lower triangle is mirrored from the upper one at the end).
:class:`HeadSplitSum` is the head-split bookkeeping in front of a :class:`BlockSum`: the block's
derivatives treat each head's column groups (``W_Q#h``, ``b_Q#h``, ``W_K#h``, ``W_V#h``,
:func:`head_split`) and the input ``X`` as variables of their own, and it writes their blocks
into the column slices of the public blocks.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .config import BlockConfig
from .kronecker import SCRATCH_BYTES, TokenKron, sandwich, sandwich_into, swap, workspace_need
from .layers import attention
from .threads import TRANSPOSE_ENTRIES, threads_for
from .validation import check_fits

__all__ = ["HessianBlocks", "BlockSum", "HeadSplitSum", "InputSplitSum", "head_split", "pairs", "relabel"]

Key = tuple[str, str]


def pairs(names) -> list[Key]:
    """Each unordered pair of ``names`` once, as ``(a, b)`` with ``a`` not after ``b``: the
    blocks a symmetric Hessian over ``names`` stores (row-major over its upper triangle)."""
    names = tuple(names)
    return [(a, b) for i, a in enumerate(names) for b in names[i:]]


class BlockSum:
    """Accumulates Hessian contributions ``(a, b, value)`` over the pairs of ``names``.

    ``wanted`` restricts the pairs to those with both names in it (callers test
    :meth:`wants` before computing a contribution). With ``dense=True`` the blocks live in
    one ``(n, n)`` buffer of ``dtype``/``device`` allocated up front (after a memory check:
    ``InsufficientMemoryError`` with the bytes needed), or in ``out`` when given (a contiguous
    ``(n, n)`` tensor of that dtype and device; ``ValueError`` naming ``out`` otherwise).
    ``per_sequence`` (dict mode, a batched input ``X`` among the names): the ``(X, X)`` block is kept
    per sequence, ``(B, L·d, L·d)`` (the others sequences' blocks are zero), not as ``(B·L·d)²``.
    Derived here (docs/derivations.md §1: each unordered block pair assembled once).
    """

    MIRROR_TILE = 32  # rows of the upper block per transposed-copy tile (6% faster than 64 at n = 28,672)

    def __init__(self, names, shapes, wanted=None, dense: bool = False, dtype=None, device=None, out=None,
                 per_sequence: bool = False):
        self.per_sequence = per_sequence  # dict mode: (X, X) kept per sequence, (B, L·d, L·d) (a block as a model's stage)
        self.all_names = tuple(names)
        self.names = tuple(n for n in self.all_names if wanted is None or n in wanted)
        self.shapes = {n: tuple(shapes[n]) for n in self.names}
        self.sizes = {n: int(torch.Size(s).numel()) for n, s in self.shapes.items()}
        self.blocks: dict[Key, torch.Tensor] = {}
        self.lower: dict[Key, torch.Tensor] = {}  # dense mode: pairs (a, b) added as (b, a), in the lower triangle
        self.buffer = None
        self._workspace = None  # scratch of sandwich_into, reused across pairs
        if dense:
            n = sum(self.sizes.values())
            if out is None:
                check_fits(n * n * torch.finfo(dtype).bits // 8, f"the dense {n}x{n} Hessian", device)
                self.buffer = torch.empty(n, n, dtype=dtype, device=device)
            else:
                if tuple(out.shape) != (n, n) or not out.is_contiguous():
                    raise ValueError(f"out must be a contiguous ({n}, {n}) tensor (the dense Hessian), got shape "
                                     f"{tuple(out.shape)}, contiguous={out.is_contiguous()}")
                if out.dtype != dtype or out.device != torch.device(device):
                    raise ValueError(f"out must be {dtype} on {torch.device(device)} like X, got {out.dtype} on {out.device}")
                self.buffer = out
            off, self.slices = 0, {}
            for name in self.names:
                self.slices[name] = slice(off, off + self.sizes[name])
                off += self.sizes[name]

    def wants(self, a: str, b: str) -> bool:
        """Whether pair ``(a, b)`` is accumulated (both names wanted)."""
        return a in self.sizes and b in self.sizes

    def _view(self, a: str, b: str) -> torch.Tensor:
        """The stored block of pair ``(a, b)`` as a tensor of shape ``shape_a + shape_b`` (a view)."""
        if (a, b) not in self.blocks:
            self.blocks[(a, b)] = self.buffer[self.slices[a], self.slices[b]]
            with threads_for(entries=self.sizes[a] * self.sizes[b]):
                self.buffer[self.slices[a], self.slices[b]].zero_()
        return self.blocks[(a, b)].view(*self.shapes[a], *self.shapes[b])

    def add(self, a: str, b: str, value: torch.Tensor) -> None:
        """Add ``value`` to pair ``(a, b)``: shape ``(n_a, n_b)`` or ``shape_a + shape_b``."""
        if not self.wants(a, b):
            return
        if self.buffer is not None and value.ndim == 2 and self.names.index(a) > self.names.index(b):
            self._add_lower(a, b, value)
            return
        if self.names.index(a) > self.names.index(b):
            value = value.reshape(*self.shapes[a], *self.shapes[b]) if value.ndim == 2 else value
            ra = len(self.shapes[a])
            a, b, value = b, a, value.permute(*range(ra, value.ndim), *range(ra))
        with threads_for(entries=value.numel()):
            if self.buffer is None:
                if self.per_sequence and a == b == "X":
                    B = self.shapes["X"][0]
                    value = value.reshape(B, self.sizes[a] // B, self.sizes[a] // B)
                else:
                    value = value.reshape(self.sizes[a], self.sizes[b])
                self.blocks[(a, b)] = self.blocks[(a, b)] + value if (a, b) in self.blocks else value
            elif (a, b) in self.blocks:
                self._view(a, b).add_(value.view(*self.shapes[a], *self.shapes[b]) if value.ndim == 2 else value)
            else:
                self.blocks[(a, b)] = self.buffer[self.slices[a], self.slices[b]]
                target = self.blocks[(a, b)].view(*self.shapes[a], *self.shapes[b])
                target.copy_(value.view(*self.shapes[a], *self.shapes[b]) if value.ndim == 2 else value)

    def slot(self, a: str, b: str) -> tuple[torch.Tensor, bool]:
        """Dense mode: ``(view, add)``, the ``(n_a, n_b)`` view of the buffer where :meth:`add` puts a
        value of pair ``(a, b)`` (the upper block, or for ``a`` after ``b`` the lower triangle's,
        moved up by :meth:`result`) and whether it holds one already (add to it) or not (write every
        entry). The pair is registered as written: the caller writes it before anything else reads it."""
        view = self.buffer[self.slices[a], self.slices[b]]
        if self.names.index(a) > self.names.index(b):
            add = (b, a) in self.lower
            self.lower.setdefault((b, a), view)
        else:
            add = (a, b) in self.blocks
            self.blocks.setdefault((a, b), view)
        return view, add

    def _add_lower(self, a: str, b: str, value: torch.Tensor) -> None:
        """Add ``value`` ``(n_a, n_b)``, ``a`` after ``b``, where it lies: the lower triangle's
        ``buffer[a, b]`` (no transposed copy); :meth:`result` moves it to the stored upper block."""
        lower = self.lower.get((b, a))
        with threads_for(entries=value.numel()):
            if lower is None:
                self.lower[(b, a)] = self.buffer[self.slices[a], self.slices[b]]
                self.lower[(b, a)].copy_(value)
            else:
                lower.add_(value)

    def add_sandwich(self, a: str, b: str, F1, F2, omega=None, core=None) -> None:
        """Add :func:`~blockhess.kronecker.sandwich` ``(F1, F2, omega, core)`` (the factors of ``a``
        and ``b``) to pair ``(a, b)``. Into a dense buffer, two :class:`~blockhess.kronecker.TokenKron`
        factors are multiplied straight into the block (:func:`~blockhess.kronecker.sandwich_into`:
        no temporary, no copy); a pair out of order is computed as its transpose
        ``sandwich(F2, F1, omega^T, core^T)``."""
        if not self.wants(a, b):
            return
        if self.buffer is None or not (isinstance(F1, TokenKron) and isinstance(F2, TokenKron)):
            self.add(a, b, sandwich(F1, F2, omega, core))
            return
        if self.names.index(a) > self.names.index(b):
            a, b = b, a
            F1, F2, omega, core = swap(F1, F2, omega, core)
        fresh = (a, b) not in self.blocks
        block = self.buffer[self.slices[a], self.slices[b]] if fresh else self.blocks[(a, b)]
        self.write_sandwich(block, F1, F2, omega, core, accumulate=not fresh)
        self.blocks[(a, b)] = block  # registered once written: a failed write leaves no uninitialised block

    def write_sandwich(self, target: torch.Tensor, F1, F2, omega=None, core=None, accumulate: bool = True) -> None:
        """:func:`~blockhess.kronecker.sandwich_into` ``target`` (a view into the buffer: a block,
        or a head's sub-block shaped ``F1.shape + F2.shape``) with this accumulator's reused scratch,
        sized for either way of writing (:func:`~blockhess.kronecker.workspace_need`, at least
        ``SCRATCH_BYTES``); the way is :func:`~blockhess.kronecker.choose_method`'s, or Khatri–Rao where the
        target's columns are not one run (a head × head sub-block)."""
        need = max(workspace_need(F1, F2), SCRATCH_BYTES // self.buffer.element_size())
        if self._workspace is None or self._workspace.numel() < need:
            self._workspace = self.buffer.new_empty(need)
        sandwich_into(target, F1, F2, omega, core, accumulate=accumulate, workspace=self._workspace)

    def free_scratch(self) -> None:
        """Drop the scratch :meth:`write_sandwich` reuses (allocated again by the next one): for a
        caller whose later additions write no sandwiches, or before :meth:`result`."""
        self._workspace = None

    def add_diagonal(self, a: str, b: str, dim1: int, dim2: int, value: torch.Tensor) -> None:
        """Add ``value`` on the diagonal ``(dim1, dim2)`` of pair ``(a, b)`` viewed as ``shape_a + shape_b``
        (``a`` not after ``b``); ``value`` is laid out as :func:`torch.diagonal` returns it.
        Used for Kronecker-with-identity terms such as ``P ⊗ I``: only the diagonal is touched."""
        if not self.wants(a, b):
            return
        if self.buffer is None:
            self.add(a, b, torch.diag_embed(value, 0, dim1, dim2))
        else:
            torch.diagonal(self._view(a, b), 0, dim1, dim2).add_(value)

    def _mirror(self, upper: torch.Tensor, lower: torch.Tensor, tiled: bool | None = None) -> None:
        """``lower = upper.T``: ``tiled`` (default: on the CPU) a tile of ``MIRROR_TILE`` rows of
        ``upper`` at a time (each tile's transpose stays in cache: about 3× faster than one
        strided ``copy_`` of the whole block); else one copy (on a GPU one kernel rather than one
        launch per tile)."""
        if not (upper.device.type == "cpu" if tiled is None else tiled):
            lower.copy_(upper.T)
            return
        t = self.MIRROR_TILE
        with threads_for(entries=TRANSPOSE_ENTRIES * t * upper.shape[1]):
            for i in range(0, upper.shape[0], t):
                lower[:, i : i + t].copy_(upper[i : i + t].T)

    def symmetrise(self, name: str) -> None:
        """Dense mode: replace the diagonal block ``(name, name)``, if written, by the mean of it and
        its transpose (a sum of symmetric terms, symmetric to its rounding); the transpose is formed
        by :meth:`_mirror`'s tiles."""
        blk = self.blocks.get((name, name))
        if blk is None:
            return
        t = torch.empty_like(blk)
        self._mirror(blk, t)
        with threads_for(entries=blk.numel()):
            blk.add_(t).mul_(0.5)

    def result(self, like: torch.Tensor, cfg=None, parts=None) -> "HessianBlocks":
        """The accumulated :class:`HessianBlocks` of the block ``cfg`` (never-touched pairs are zero
        blocks), with ``parts`` (``which -> HessianBlocks``, see :class:`HessianBlocks`) if given."""
        self.free_scratch()  # the sums are done: their scratch goes before the mirror touches the lower triangle
        if self.buffer is not None:
            for i, a in enumerate(self.names):
                for b in self.names[i:]:
                    lower = self.lower.pop((a, b), None)
                    if lower is not None and (a, b) not in self.blocks:  # only added below: moved up
                        self.blocks[(a, b)] = self.buffer[self.slices[a], self.slices[b]]
                        self._mirror(lower, self.blocks[(a, b)])
                        continue
                    self._view(a, b)
                    if lower is not None:  # added on both sides: the lower part into the upper block
                        with threads_for(entries=lower.numel()):
                            self.blocks[(a, b)].add_(lower.T)
                    if a != b:
                        self._mirror(self.blocks[(a, b)], self.buffer[self.slices[b], self.slices[a]])
        return HessianBlocks(self.names, self.shapes, self.blocks, like, self.buffer, parts, cfg=cfg)


class HessianBlocks:
    """The Hessian of a scalar w.r.t. named parameters, block by block.

    Attributes
    ----------
    names : tuple[str, ...]
        Parameter names, canonical (forward) order.
    shapes : dict[str, tuple[int, ...]]
        Shape of each parameter.
    sizes : tuple[int, ...]
        ``numel`` of each parameter; ``H[a, b]`` has shape ``(n_a, n_b)`` in the row-wise
        vectorisation ``vec_r``.
    dtype, device
        Of every block (those of ``X`` in :func:`blockhess.hessian`).
    outer, functional : HessianBlocks
        The Gauss–Newton (outer-product) and functional terms (paper eq. 10): ``parts(which)``
        of the constructor, ``which`` ``"outer"`` or ``"functional"``, called on first access
        (for a result of :func:`blockhess.hessian`, by their own passes); without ``parts``
        (a part has no parts of its own) ``AttributeError``; :attr:`has_parts` tells which.
    cfg : BlockConfig or None
        The block whose Hessian this is (results of :func:`blockhess.hessian`), else ``None``.

    ``H[a, b]`` returns the block (a view where stored, a transposed view otherwise, a zero
    block for pairs never touched). ``H.pairs()`` and ``H.items()`` are methods, as
    ``dict.keys()`` and ``dict.items()``: the list of keys ``(a, b)``, ``a`` not after ``b``,
    and the ``((a, b), H[a, b])`` of each. ``H.dense()`` is the ``(n, n)`` matrix, blocks in
    ``names`` order.
    """

    def __init__(self, names, shapes, blocks: dict[Key, torch.Tensor], like: torch.Tensor, buffer=None,
                 parts: Callable[[str], "HessianBlocks"] | None = None, cfg=None):
        self.names = tuple(names)
        self.cfg = cfg
        self.shapes = {n: tuple(shapes[n]) for n in self.names}
        self.sizes = tuple(int(torch.Size(self.shapes[n]).numel()) for n in self.names)
        self.dtype, self.device = like.dtype, like.device
        self._blocks = blocks
        self._buffer = buffer
        self._parts = parts
        self._cache: dict[str, HessianBlocks] = {}

    @classmethod
    def from_buffer(cls, names, shapes, buf: torch.Tensor, parts: Callable[[str], "HessianBlocks"] | None = None,
                    cfg=None) -> "HessianBlocks":
        """The blocks of the dense ``buf`` ``(n, n)`` (variables ``names`` in that order, ``vec_r`` of each of
        ``shapes``), each a view of it; ``parts`` and ``cfg`` as the constructor's."""
        sl, o = {}, 0
        for k in names:
            m = int(torch.Size(shapes[k]).numel())
            sl[k], o = slice(o, o + m), o + m
        blocks = {(a, b): buf[sl[a], sl[b]] for a, b in pairs(names)}
        return cls(names, {k: tuple(shapes[k]) for k in names}, blocks, buf, buf, parts, cfg=cfg)

    def _part(self, which: str) -> "HessianBlocks":
        if self._parts is None:
            raise AttributeError(f"this HessianBlocks has no {which} part")
        if which not in self._cache:
            self._cache[which] = self._parts(which)
        return self._cache[which]

    @property
    def outer(self) -> "HessianBlocks":
        """Gauss–Newton term :math:`J^\\top \\nabla^2_Z\\ell\\, J` (PSD for a convex loss)."""
        return self._part("outer")

    @property
    def functional(self) -> "HessianBlocks":
        """Functional term :math:`(\\nabla_Z\\ell \\otimes I)\\,\\partial^2 Z/\\partial W^2`."""
        return self._part("functional")

    def __getitem__(self, key: Key) -> torch.Tensor:
        """The block ``H[a, b]`` of shape ``(n_a, n_b)`` for a pair of names ``key = (a, b)``.

        Raises ``KeyError`` for a key that is not a pair of this Hessian's names."""
        if not (isinstance(key, tuple) and len(key) == 2):
            raise KeyError(f"index a HessianBlocks by a pair of names, e.g. H[{self.names[0]!r}, {self.names[-1]!r}]; got {key!r}")
        a, b = key
        for n in (a, b):
            if n not in self.names:
                raise KeyError(f"unknown parameter {n!r}; this Hessian has {list(self.names)}")
        if self.names.index(a) > self.names.index(b):
            return self[b, a].T
        if (a, b) in self._blocks:
            return self._blocks[(a, b)]
        size = dict(zip(self.names, self.sizes))
        return torch.zeros(size[a], size[b], dtype=self.dtype, device=self.device)

    def pairs(self) -> list[Key]:
        """The keys ``(a, b)`` of the blocks, ``a`` not after ``b`` in ``names`` (:func:`pairs`;
        a new list each call, the keys of :meth:`items`); ``H[b, a]`` is ``H[a, b].T``."""
        return pairs(self.names)

    def items(self):
        """``((a, b), H[a, b])`` for each pair of :meth:`pairs`: every block once (the upper
        triangle of :meth:`dense`), zero blocks included."""
        return ((key, self[key]) for key in self.pairs())

    def dense(self) -> torch.Tensor:
        """The full ``(n, n)`` matrix, ``n = sum(sizes)``, blocks in ``names`` order.

        Returns the stored buffer itself when the Hessian was assembled densely (no copy).
        Raises ``InsufficientMemoryError`` (a ``MemoryError`` and ``ValueError``) before
        allocating if a new matrix would not fit in available memory.
        """
        if self._buffer is not None:
            return self._buffer
        acc = BlockSum(self.names, self.shapes, dense=True, dtype=self.dtype, device=self.device)
        for (a, b), block in self.items():
            acc.add(a, b, block)
        return acc.result(self[self.names[0], self.names[0]]).dense()

    @property
    def has_parts(self) -> bool:
        """Whether :attr:`outer` and :attr:`functional` are available (a full result, not a part)."""
        return self._parts is not None

    def to_module(self, module) -> "HessianBlocks":
        """The blocks re-keyed by a PyTorch layer's parameter names in their storage layout
        (:func:`relabel`, which :func:`blockhess.adapters.to_module` implements for PyTorch modules)."""
        return relabel(module, self)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}{list(s)}" for n, s in self.shapes.items())
        return f"HessianBlocks({parts}; n={sum(self.sizes)}, dtype={self.dtype})"


@functools.singledispatch
def relabel(module, H: HessianBlocks) -> HessianBlocks:
    """``H`` re-keyed by ``module``'s own parameter names, each in its storage layout
    (:meth:`HessianBlocks.to_module`). One implementation per kind of module, registered by the
    adapter that reads such modules (``relabel.register``; :mod:`blockhess.adapters` registers
    ``torch.nn.Module``: :func:`~blockhess.adapters.to_module`), so that the core imports no adapter.

    Raises ``ValueError`` for an object no adapter has registered; the adapter's errors otherwise.
    """
    raise ValueError(f"to_module maps a Hessian to the parameters of a module an adapter reads (a torch.nn.Module: "
                     f"blockhess.adapters.to_module), got {type(module).__name__}")


# ----------------------------------------------------------------------------------------------
# the head split: internal names of the heads' column groups, written into the public blocks


def head_split(cfg: BlockConfig) -> dict[str, tuple[str, tuple, tuple]]:
    """Internal head-split name → (public name, refined public shape, index into it). With
    ``n_kv_heads`` below ``n_heads``, ``W_K#g`` and ``W_V#g`` are the ``n_kv_heads`` key/value heads'
    column groups (each used by its group of query heads)."""
    H = cfg.n_heads
    if H == 1:
        return {}
    d, dk, dv = cfg.d_model, cfg.head_dim, cfg.value_dim
    G = getattr(cfg, "kv_heads", H)  # grouped-query attention: W_K#g, W_V#g for the G key/value heads
    out = {}
    for h in range(H):
        nm = attention.head_names(H, h)
        out[nm["W_Q"]] = ("W_Q", (d, H, dk), (slice(None), h, slice(None)))
        out[nm["b_Q"]] = ("b_Q", (H, dk), (h, slice(None)))
        if h < G:
            out[nm["W_K"]] = ("W_K", (d, G, dk), (slice(None), h, slice(None)))
            out[nm["W_V"]] = ("W_V", (d, G, dv), (slice(None), h, slice(None)))
    return out


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


class HeadSplitSum:
    """Adds blocks of internal variables (head column groups, ``X``) into a public :class:`BlockSum`;
    ``prefix``: the public names are ``prefix + name`` in ``acc`` (a block's weights in a model's
    Hessian, ``"blocks.0."``)."""

    def __init__(self, acc: BlockSum, cfg: BlockConfig, prefix: str = ""):
        self.acc = acc
        self.split = head_split(cfg)
        self.prefix = prefix
        self.dense = acc.buffer is not None
        self.pending: dict[tuple[str, str], torch.Tensor] = {}

    def pub(self, n: str) -> str:
        return self.prefix + (self.split[n][0] if n in self.split else n)

    def wants(self, a: str, b: str) -> bool:
        return self.acc.wants(self.pub(a), self.pub(b))

    def _ordered(self, a: str, b: str) -> bool:
        A, B = self.pub(a), self.pub(b)
        return self.acc.names.index(A) <= self.acc.names.index(B)

    def _ref(self, n: str):
        if n in self.split:
            return self.split[n][1], self.split[n][2]
        shape = self.acc.shapes[self.pub(n)]
        return shape, tuple(slice(None) for _ in shape)

    def _sub(self, n: str) -> tuple:
        ref, idx = self._ref(n)
        return tuple(r for r, i in zip(ref, idx) if not isinstance(i, int))

    def add(self, a: str, b: str, value: torch.Tensor, diag: tuple[int, int] | None = None) -> None:
        """Add ``value`` (shape ``sub_a + sub_b``, or a :func:`torch.diagonal` layout of it over ``diag``)."""
        if not self.wants(a, b):
            return
        A, B = self.pub(a), self.pub(b)
        if a == b == "X":
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
                self.acc.add_sandwich(self.pub(a), self.pub(b), F1, F2, omega, core)
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
        X = self.pub("X")
        shape = self.acc.shapes[X]
        if self.acc.per_sequence:
            self.acc.add(X, X, value)
            return
        if len(shape) == 2:
            self.acc.add(X, X, value.reshape(*shape, *shape))
            return
        Bn, L, d = shape
        v = value.reshape(Bn, L, d, L, d)
        if self.dense:
            self.acc.add_diagonal(X, X, 0, 3, v.permute(1, 2, 3, 4, 0))
        else:
            self.acc.add(X, X, torch.diag_embed(v.permute(1, 2, 3, 4, 0), 0, 0, 3))

    def finish(self) -> None:
        for (A, B), v in self.pending.items():
            self.acc.add(A, B, v.reshape(self.acc.sizes[A], self.acc.sizes[B]))
        self.pending = {}


class InputSplitSum:
    """Routes a block's blocks by whether they hold its input: those with ``X`` to ``with_x``, the
    rest to ``weights`` (each a :class:`HeadSplitSum`, or ``None``: those pairs are not wanted). A
    block as a model's stage keeps its input's blocks per sequence, and writes its weights' pairs
    straight into the model's dense Hessian in passes of their own."""

    def __init__(self, with_x: HeadSplitSum | None, weights: HeadSplitSum | None):
        self.with_x, self.weights = with_x, weights

    def _to(self, a: str, b: str) -> HeadSplitSum | None:
        return self.with_x if a == "X" or b == "X" else self.weights

    def wants(self, a: str, b: str) -> bool:
        to = self._to(a, b)
        return to is not None and to.wants(a, b)

    def add(self, a: str, b: str, value: torch.Tensor, diag: tuple[int, int] | None = None) -> None:
        if self.wants(a, b):
            self._to(a, b).add(a, b, value, diag)

    def add_sandwich(self, a: str, b: str, F1, F2, omega=None, core=None) -> None:
        if self.wants(a, b):
            self._to(a, b).add_sandwich(a, b, F1, F2, omega, core)

    def add_diagonal(self, a: str, b: str, dim1: int, dim2: int, value: torch.Tensor) -> None:
        if self.wants(a, b):
            self._to(a, b).add_diagonal(a, b, dim1, dim2, value)

    def finish(self) -> None:
        for side in (self.with_x, self.weights):
            if side is not None:
                side.finish()
