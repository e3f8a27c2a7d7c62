r"""A block's dense loss Hessian assembled from its exact matrix-free products: the path of the
options the Kronecker-factor kernels do not take (RMSNorm, the gated FFN, grouped-query attention,
a free value width, RoPE; :attr:`~blockhess.config.BlockConfig.llama_options`, docs/derivations.md §20).

Column ``j`` of the Hessian is :math:`H e_j`, the product of :func:`~blockhess.block.directional.hvp`
along the ``j``-th canonical direction (a weight's entry, or an entry of the input ``X`` with
``wrt_input``): each layer's tangent forward and second-order adjoint back, in closed form, no
autograd. The columns are taken ``k`` at a time (``k`` directions ride one product); the outer
(Gauss–Newton, :math:`J^\top\Omega J e_j`) and functional (:math:`\dot g_Z = 0`) parts by their own
products, so ``outer + functional == full`` is a check, not a definition. The cost is ``n`` products,
each about ``L·n`` multiply-adds for a block of ``n`` weights (a product touches every weight once per
token): the order of the Kronecker-factor assembly, ``L·n²``, without its factor structure.
"""

from __future__ import annotations

import math

import torch

from .. import losses
from ..result import HessianBlocks
from ..validation import check_fits, check_result
from . import directional
from .forward_pass import check_forward, forward_cache, variable_shapes

__all__ = ["hessian", "assemble", "diagonal", "jacobian", "input_jacobian", "CHUNK_BYTES"]

#: the most bytes one product of ``k`` columns may hold (``directional.work_entries``): ``k`` is the
#: largest number of columns within it (at least one)
CHUNK_BYTES = 64 << 20


def _columns(cfg, B: int, L: int, n: int, e: int) -> int:
    """Columns per product: the most ``k <= n`` whose working set fits :data:`CHUNK_BYTES` (at least 1)."""
    per = max(directional.work_entries(cfg, B, L, 1) * e, 1)
    return max(1, min(n, CHUNK_BYTES // per))


def assemble(product, names, sizes: dict, like: torch.Tensor, step: int, out=None, lower: bool = False,
             order=None) -> torch.Tensor:
    """The ``(n, n)`` matrix whose column ``j`` is ``product`` along the ``j``-th canonical direction over
    ``names`` (sizes ``sizes``), ``step`` columns at a time, symmetrised (the mean with its transpose, one
    ``n × n`` temporary: the exact matrix is symmetric, the two triangles differ by rounding only).
    ``product(V, rows)`` takes ``{name: (k, numel)}`` (the names the chunk's columns touch; the others' are
    zero) and returns the rows ``{name: (k, ...)}`` of ``numel`` entries each of the names ``rows``: every
    name, or with ``lower`` those from the chunk's first name on in ``order`` (the columns are taken in
    ``order``, a permutation of ``names``, default ``names``; ``H e_j`` is row ``j`` too, so the blocks of a
    name with those before it in ``order`` are the transposes of blocks formed already, and the diagonal
    blocks the mean of theirs). ``order`` is how the work goes, not the layout: a model's columns taken in
    its layers' forward order ask each chunk's products for the rows of its own layer and those above only,
    and the pass back stops there. ``out``: the buffer written, else a new one in ``like``'s dtype and
    device. Used for a block (:func:`hessian`) and for a model (:func:`blockhess.model.walk.hessian`)."""
    order = tuple(names) if order is None else tuple(order)
    if sorted(order) != sorted(names):
        raise ValueError(f"order must be a permutation of names; got {order} for {tuple(names)}")
    n = sum(sizes[k] for k in names)
    buf = out if out is not None else like.new_empty(n, n)
    offsets, o = {}, 0
    for k in names:
        offsets[k] = o
        o += sizes[k]
    starts, o = {}, 0  # each name's first position in the work's order
    for k in order:
        starts[k] = o
        o += sizes[k]
    for j0, j1 in _spans(n, step, sorted(starts[k] + sizes[k] for k in order)):
        k = j1 - j0
        V, pieces = {}, []
        for name in order:
            lo, hi = starts[name], starts[name] + sizes[name]
            a0, a1 = max(lo, j0), min(hi, j1)
            if a0 >= a1:
                continue
            basis = like.new_zeros(k, sizes[name])
            basis[a0 - j0:a1 - j0, a0 - lo:a1 - lo].diagonal().fill_(1.0)
            V[name] = basis
            pieces.append((a0 - j0, a1 - j0, offsets[name] + a0 - lo))  # chunk rows -> the buffer's rows
        wanted = tuple(order[order.index(next(iter(V))):]) if lower else tuple(names)
        rows = product(V, wanted)
        for name in wanted:  # H e_j is row j too (H symmetric): written as rows, contiguous
            r = rows[name].reshape(k, -1)
            for q0, q1, b0 in pieces:
                buf[b0:b0 + q1 - q0, offsets[name]:offsets[name] + sizes[name]] = r[q0:q1]
        del rows, V
    if not lower:
        buf.add_(buf.T.clone()).mul_(0.5)
        return buf
    for i, a in enumerate(order):  # the blocks formed: the diagonal blocks' mean, the rest mirrored (runs at once)
        lo, hi = offsets[a], offsets[a] + sizes[a]
        D = buf[lo:hi, lo:hi]
        D.add_(D.T.clone()).mul_(0.5)
        for r0, r1 in _runs(sorted((offsets[b], offsets[b] + sizes[b]) for b in order[i + 1:])):
            buf[r0:r1, lo:hi] = buf[lo:hi, r0:r1].T
    return buf


def _runs(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ascending ``[(lo, hi)]`` ranges with the adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _spans(n: int, step: int, ends: list[int]) -> list[tuple[int, int]]:
    """The column chunks ``[(j0, j1)]`` covering ``0..n``, each at most ``step`` wide and ending where a variable
    ends (``ends``, ascending) when one ends within it: a chunk then starts at a variable's first column, and its
    restricted rows (``lower``) start at that variable, not at one whose columns it shares with the chunk before."""
    out, j0 = [], 0
    while j0 < n:
        fit = [e for e in ends if j0 < e <= j0 + step]
        j1 = fit[-1] if fit else min(n, j0 + step)
        out.append((j0, j1))
        j0 = j1
    return out


def _assemble(c, a, omega, names, shapes, which: str, out=None) -> torch.Tensor:
    """The ``(n, n)`` matrix of ``which`` part of a block over ``names`` (``"X"`` first when present),
    from :func:`~blockhess.block.directional.hvp` (:func:`assemble`)."""
    sizes = {k: math.prod(shapes[k]) for k in names}
    n = sum(sizes.values())
    B, L, d = c.X.shape
    weights = tuple(k for k in names if k != "X")
    has_x = "X" in names
    outer, functional = which in ("full", "outer"), which in ("full", "functional")

    def product(V, rows):
        k = next(iter(V.values())).shape[0]
        dX = V.pop("X").reshape(k, B, L, d) if "X" in V else None
        V = {name: v.reshape(k, *shapes[name]) for name, v in V.items()}
        HV, dgX = directional.hvp(c, a if functional else None, V, omega=omega, dX=dX, outer=outer,
                                  functional=functional, input_adjoint=has_x, wanted=weights)
        if has_x:
            HV["X"] = dgX
        return HV

    return assemble(product, names, sizes, c.X, _columns(c.cfg, B, L, n, c.X.element_size()), out)


def hessian(params: dict, X: torch.Tensor, cfg, loss, target, names: tuple[str, ...], out=None) -> HessianBlocks:
    r"""The dense loss Hessian of a block over ``names`` (canonical order, ``"X"`` first when the input
    is a variable), column by column from exact products (module docstring); ``.outer`` and
    ``.functional`` by their own products on first access. Called by :func:`blockhess.hessian` for a
    config with :attr:`~blockhess.config.BlockConfig.llama_options` after its argument checks
    (``params``, ``X`` detached copies; ``target`` with the batch axis); the same result type, shapes,
    dtype and device.

    Raises ``ValueError`` as :func:`blockhess.hessian` (the forward pass's rows, the target, a
    non-finite result), ``InsufficientMemoryError`` before the work when the ``n × n`` result (unless
    ``out``) and one product's working set would not fit.
    """
    c = forward_cache(params, X, cfg, wrt_input="X" in names, plain=True)
    check_forward(c)
    B, L, d = c.X.shape
    target = losses.check(loss, target, c.out, single=X.ndim == 2)
    shapes = variable_shapes(c)
    n = sum(math.prod(shapes[k]) for k in names)
    e = X.element_size()
    step = _columns(cfg, B, L, n, e)
    check_fits(((n * n if out is None else 0) + n * n + directional.work_entries(cfg, B, L, step) + 2 * n * step) * e,
               f"the dense {n}x{n} Hessian from {n} exact products, {step} at a time", X.device)
    g, omega = losses.directional(loss, target, c.out)
    a = directional.adjoints(c, g)

    def part(which: str) -> HessianBlocks:
        check_fits(n * n * e + directional.work_entries(cfg, B, L, step) * e,
                   f"the {which} part of the Hessian ({n}x{n})", X.device)
        H = HessianBlocks.from_buffer(names, shapes, _assemble(c, a, omega, names, shapes, which), cfg=cfg)
        check_result({f"the Hessian's {which} part": H.dense()})
        return H

    H = HessianBlocks.from_buffer(names, shapes, _assemble(c, a, omega, names, shapes, "full", out), part, cfg=cfg)
    check_result({"the Hessian": H.dense()})
    return H


def diagonal(c, a, loss, target, wanted, outer: bool = True, functional: bool = True) -> dict:
    r"""The exact diagonal of a block's loss Hessian (or of its outer or functional part) w.r.t. each
    weight of ``wanted``, in its own shape, from exact products: entry ``j`` of weight ``w`` is
    :math:`(H e_j)_j`, each product forming ``w``'s rows only (``hvp(..., wanted=(w,))``). The path of
    :func:`blockhess.block.diagonal.block_diagonal` for a config with
    :attr:`~blockhess.config.BlockConfig.llama_options` (docs/derivations.md §20): ``n`` products, not
    the closed-form per-token walk. ``c``, ``a`` (``None`` without ``functional``), ``loss``, ``target``
    (with the batch axis) as there; any loss :func:`blockhess.losses.directional` takes."""
    B, L, _ = c.X.shape
    _, omega = losses.directional(loss, target, c.out)
    shapes = variable_shapes(c)
    out = {}
    for name in wanted:
        m = math.prod(shapes[name])
        step = _columns(c.cfg, B, L, m, c.X.element_size())
        diag = c.X.new_empty(m)
        for j0 in range(0, m, step):
            j1 = min(m, j0 + step)
            idx = torch.arange(j1 - j0, device=c.X.device)
            basis = c.X.new_zeros(j1 - j0, m)
            basis[idx, idx + j0] = 1.0
            HV, _ = directional.hvp(c, a if functional else None, {name: basis.reshape(-1, *shapes[name])}, omega=omega,
                                    outer=outer, functional=functional, input_adjoint=False, wanted=(name,))
            diag[j0:j1] = HV[name].reshape(j1 - j0, m)[idx, idx + j0]
        out[name] = diag.reshape(shapes[name])
    return out


def _basis(like: torch.Tensor, k: int, m: int, j0: int) -> torch.Tensor:
    """Rows ``j0 .. j0+k-1`` of the ``m × m`` identity, ``(k, m)``."""
    out = like.new_zeros(k, m)
    idx = torch.arange(k, device=like.device)
    out[idx, idx + j0] = 1.0
    return out


def jacobian(params: dict, X: torch.Tensor, cfg, names: tuple[str, ...]) -> dict:
    r"""The dense Jacobians of the block output w.r.t. the weights ``names``, column ``j`` the exact
    tangent :math:`J e_j` (:func:`~blockhess.block.directional.jvp`), ``k`` columns per pass: ``(B, L·d,
    numel)`` each (the caller drops the batch axis of an unbatched ``X``). The path of
    :func:`blockhess.jacobian` for :attr:`~blockhess.config.BlockConfig.llama_options`, after its checks."""
    c = forward_cache(params, X, cfg, plain=True)
    check_forward(c)
    B, L, d = c.X.shape
    shapes = variable_shapes(c)
    out = {}
    for name in names:
        m = math.prod(shapes[name])
        J = c.X.new_empty(B, L * d, m)
        step = _columns(cfg, B, L, m, c.X.element_size())
        for j0 in range(0, m, step):
            k = min(m, j0 + step) - j0
            dZ = directional.jvp(c, {name: _basis(c.X, k, m, j0).reshape(k, *shapes[name])})
            J[:, :, j0:j0 + k] = dZ.reshape(k, B, L * d).permute(1, 2, 0)
        out[name] = J
    return out


def input_jacobian(params: dict, X: torch.Tensor, cfg) -> torch.Tensor:
    r"""``dZ/dX`` per sequence, ``(B, L·d, L·d)``: column ``(m, a)`` the exact tangent along the unit
    ``X_{b,m,a}`` of every sequence ``b`` at once (sequences do not mix). The path of
    :func:`blockhess.input_jacobian` for :attr:`~blockhess.config.BlockConfig.llama_options`."""
    c = forward_cache(params, X, cfg, plain=True)
    check_forward(c)
    B, L, d = c.X.shape
    n = L * d
    J = c.X.new_empty(B, n, n)
    step = _columns(cfg, B, L, n, c.X.element_size())
    for j0 in range(0, n, step):
        k = min(n, j0 + step) - j0
        dX = _basis(c.X, k, n, j0).reshape(k, 1, L, d).expand(k, B, L, d)
        J[:, :, j0:j0 + k] = directional.jvp(c, {}, dX=dX).reshape(k, B, n).permute(1, 2, 0)
    return J
