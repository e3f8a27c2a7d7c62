"""``HessianBlocks``: a symmetric block matrix over named parameters, and block arithmetic.

A Hessian over parameters ``names`` (sizes ``sizes``) is kept as one tensor per unordered
pair ``(a, b)`` with ``a`` not after ``b`` in ``names``: each pair is computed once, and
``H[b, a]`` is the transpose of ``H[a, b]``.
"""

from __future__ import annotations

from typing import Callable

import torch

from .validation import check_fits

__all__ = ["HessianBlocks", "add_block", "dense_second_derivative"]

Key = tuple[str, str]


def add_block(blocks: dict[Key, torch.Tensor], names: tuple[str, ...], a: str, b: str, value: torch.Tensor) -> None:
    """Accumulate ``value`` (``(n_a, n_b)``, or a batch ``(..., n_a, n_b)``) into the stored
    pair ``(a, b)``, transposing when ``b`` comes before ``a`` in ``names``."""
    if names.index(a) > names.index(b):
        a, b, value = b, a, value.transpose(-1, -2)
    blocks[(a, b)] = blocks[(a, b)] + value if (a, b) in blocks else value


class HessianBlocks:
    """The Hessian of a scalar w.r.t. named parameters, block by block.

    Attributes
    ----------
    names : tuple[str, ...]
        Parameter names, canonical (forward) order.
    shapes : dict[str, tuple[int, ...]]
        Shape of each parameter.
    sizes : tuple[int, ...]
        ``numel`` of each parameter; ``H[a, b]`` has shape ``(sizes[a], sizes[b])`` in the
        row-wise vectorisation ``vec_r``.
    outer, functional : HessianBlocks or None
        The Gauss–Newton (outer-product) and functional terms (paper eq. 10); ``None`` for
        those parts themselves.

    ``H[a, b]`` returns the block (a view for stored pairs, a transpose otherwise; a zero
    block for pairs known to vanish). ``H.dense()`` returns the ``(n, n)`` matrix, blocks in
    ``names`` order.
    """

    def __init__(self, names, shapes, blocks: dict[Key, torch.Tensor], outer=None, functional=None):
        self.names = tuple(names)
        self.shapes = {n: tuple(shapes[n]) for n in self.names}
        self.sizes = tuple(int(torch.Size(self.shapes[n]).numel()) for n in self.names)
        self._blocks = blocks
        self.outer = outer
        self.functional = functional
        ref = next(iter(blocks.values()))
        self.dtype, self.device = ref.dtype, ref.device

    def __getitem__(self, key: Key) -> torch.Tensor:
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

    def __add__(self, other: "HessianBlocks") -> "HessianBlocks":
        keys = set(self._blocks) | set(other._blocks)
        return HessianBlocks(self.names, self.shapes, {k: self[k] + other[k] for k in keys})

    def dense(self) -> torch.Tensor:
        """The full ``(n, n)`` matrix, ``n = sum(sizes)``, blocks in ``names`` order.

        Raises ``InsufficientMemoryError`` (a ``MemoryError`` and ``ValueError``) before
        allocating if the matrix would not fit in available memory.
        """
        n = sum(self.sizes)
        check_fits(n * n * torch.finfo(self.dtype).bits // 8, f"the dense {n}x{n} Hessian", self.device)
        out = torch.empty(n, n, dtype=self.dtype, device=self.device)
        offsets = [0]
        for s in self.sizes:
            offsets.append(offsets[-1] + s)
        for i, a in enumerate(self.names):
            for j in range(i, len(self.names)):
                blk = self[a, self.names[j]]
                out[offsets[i] : offsets[i + 1], offsets[j] : offsets[j + 1]] = blk
                if j != i:
                    out[offsets[j] : offsets[j + 1], offsets[i] : offsets[i + 1]] = blk.T
        return out

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}{list(s)}" for n, s in self.shapes.items())
        return f"HessianBlocks({parts}; n={sum(self.sizes)}, dtype={self.dtype})"


def dense_second_derivative(
    contract: Callable[[torch.Tensor], dict[Key, torch.Tensor]],
    out_shape: tuple[int, int],
    names: tuple[str, ...],
    sizes: dict[str, int],
    a: str,
    b: str,
    like: torch.Tensor,
) -> torch.Tensor:
    r"""The paper's layout of a second derivative :math:`\partial^2 N/\partial W_a \partial W_b`.

    ``contract(G)`` must return the blocks of :math:`\sum_o G_o \nabla^2 N_o` for an output
    weight ``G`` of shape ``out_shape``; contracting with every basis vector gives the
    ``(N.numel()·n_a, n_b)`` matrix with rows ``(o, i)`` o-major (paper §1.1).
    """
    n_out = out_shape[0] * out_shape[1]
    check_fits(n_out * sizes[a] * sizes[b] * like.element_size(), f"the dense d2/d{a}d{b}", like.device)
    basis = torch.eye(n_out, dtype=like.dtype, device=like.device).reshape(n_out, *out_shape)
    blocks = torch.func.vmap(contract)(basis)
    if names.index(a) > names.index(b):
        key, transpose = (b, a), True
    else:
        key, transpose = (a, b), False
    if key not in blocks:
        return like.new_zeros(n_out * sizes[a], sizes[b])
    blk = blocks[key].transpose(1, 2) if transpose else blocks[key]
    return blk.reshape(n_out * sizes[a], sizes[b])
