r"""Per-token Kronecker factors: the structure every block Jacobian has.

Every sub-layer of the block after the attention scores acts token by token, so the
Jacobian of a per-token quantity ``o_t`` (``r`` entries) w.r.t. a weight ``W`` of shape
``(p, q)`` has, for each token ``t``, one of two Kronecker shapes (DESIGN.md §5):

* ``left``:  :math:`J_t = u_t^\top \otimes N_t`, entry ``[c, (a, b)] = u_t[a] N_t[c, b]``
  (``W_Q``: ``u = x_t``; ``W_V``: ``u = (AX)_t``; ``W_1``: ``u = y_t``; ``W_2``: ``u = relu_t``);
* ``right``: :math:`J_t = N_t \otimes v_t^\top`, entry ``[c, (a, b)] = N_t[c, a] v_t[b]``
  (``W_K``: ``v = q_t``);

and a vector parameter (a bias, a LayerNorm scale or shift, shape ``(q,)``) has a plain
per-token matrix, ``vector``: :math:`J_t = N_t` (the left form with ``u_t = 1``).

A Hessian term :math:`\sum_t J_{i,t}^\top \Omega_t J_{j,t}` then costs one small product
``C_t = N_i^T Ω_t N_j`` per token and one GEMM over the token index — about
``T·n_i·n_j`` multiply-adds instead of the ``T·r·n_i·n_j`` of a dense ``J^T Ω J`` — and no
Kronecker product or commutation matrix is ever formed.

Two more factor kinds complete the picture: :class:`SeqFactor`, the Jacobian w.r.t. the
block *input* ``X`` (dense within a sequence: attention mixes tokens), and
:class:`SplitKron`, a weight whose column groups (attention heads) each have their own
Kronecker factor.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch

__all__ = ["TokenKron", "SeqFactor", "SplitKron", "ZeroKron", "sandwich", "sandwich_into", "swap"]


@dataclass(frozen=True)
class TokenKron:
    """Jacobian rows of ``T`` tokens w.r.t. one ``(p, q)`` weight (or ``(q,)`` vector), in Kronecker form.

    Attributes
    ----------
    side : str
        ``"left"`` (``J_t = u_t^T ⊗ N_t``), ``"right"`` (``J_t = N_t ⊗ v_t^T``) or
        ``"vector"`` (``J_t = N_t``; a parameter of shape ``(q,)``).
    vec : Tensor or None
        ``u``, shape ``(T, p)`` (left) or ``v``, shape ``(T, q)`` (right); ``None`` for a vector.
    mat : Tensor
        ``N``, shape ``(T, r, q)`` (left, vector) or ``(T, r, p)`` (right); ``r`` = rows per token.
    """

    side: str
    vec: torch.Tensor | None
    mat: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the parameter: ``(p, q)``, or ``(q,)`` for a vector."""
        if self.side == "left":
            return self.vec.shape[-1], self.mat.shape[-1]
        if self.side == "right":
            return self.mat.shape[-1], self.vec.shape[-1]
        return (self.mat.shape[-1],)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def premul(self, E: torch.Tensor) -> "TokenKron":
        """Chain rule through a per-token map: rows ``E_t J_t``; ``E`` of shape ``(T, r', r)`` or ``(r', r)``."""
        return TokenKron(self.side, self.vec, E @ self.mat)

    def dense(self) -> torch.Tensor:
        """The Jacobian rows as a dense tensor ``(T, r, numel)``."""
        T, r = self.mat.shape[:2]
        if self.side == "left":
            J = self.vec[:, None, :, None] * self.mat[:, :, None, :]
        elif self.side == "right":
            J = self.mat[:, :, :, None] * self.vec[:, None, None, :]
        else:
            J = self.mat
        return J.reshape(T, r, self.numel)

    def vjp(self, w: torch.Tensor) -> torch.Tensor:
        r"""Per sequence :math:`\sum_{t \in b} J_t^\top w_{b,k,t}`: ``w`` of shape ``(B, K, L, r)``
        (``K`` weights per sequence; the factor's tokens are ordered ``(B, L)``); returns
        ``(B, K, numel)``."""
        B, K, L, r = w.shape
        mat = self.mat.reshape(B, L, r, self.mat.shape[-1])
        if self.side == "vector":
            return torch.einsum("blrq,bklr->bkq", mat, w)
        vec = self.vec.reshape(B, L, self.vec.shape[-1])
        Nw = torch.einsum("blrq,bklr->bklq", mat, w)
        if self.side == "left":
            out = torch.einsum("blp,bklq->bkpq", vec, Nw)
        else:
            out = torch.einsum("bklp,blq->bkpq", Nw, vec)
        return out.reshape(B, K, self.numel)


@dataclass(frozen=True)
class SeqFactor:
    """Jacobian rows of ``T = B·L`` tokens w.r.t. the block input ``X`` (per sequence, dense).

    ``mat`` has shape ``(T, r, n)``, ``n = L·d``: row block of token ``t`` of sequence ``b``
    w.r.t. the entries of ``X[b]`` (the other sequences do not enter). ``shape`` is the
    shape of ``X`` itself, ``(L, d)`` or ``(B, L, d)``.
    """

    mat: torch.Tensor
    B: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.B * self.mat.shape[-1]

    def premul(self, E: torch.Tensor) -> "SeqFactor":
        return SeqFactor(E @ self.mat, self.B, self.shape)

    def seq(self) -> torch.Tensor:
        """``(B, L, r, n)``."""
        T, r, n = self.mat.shape
        return self.mat.reshape(self.B, T // self.B, r, n)

    def dense(self) -> torch.Tensor:
        """Per sequence ``(B, L·r, n)``: the Jacobian of a sequence's outputs w.r.t. its input."""
        T, r, n = self.mat.shape
        return self.mat.reshape(self.B, (T // self.B) * r, n)

    def vjp(self, w: torch.Tensor) -> torch.Tensor:
        """``(B, K, B·n)``: per sequence ``J_b^T w_bk``, zero outside the sequence's own ``X[b]``."""
        out = torch.einsum("blrn,bklr->bkn", self.seq(), w)
        eye = torch.eye(self.B, dtype=w.dtype, device=w.device)
        return torch.einsum("bkn,bc->bkcn", out, eye).reshape(self.B, w.shape[1], -1)


@dataclass(frozen=True)
class SplitKron:
    """A weight whose last-axis column groups (attention heads) each have their own factor.

    ``parts[h]`` is the factor of columns ``h*c:(h+1)*c`` of the last axis; ``shape`` is the
    full parameter's shape. Offers :meth:`dense` and :meth:`vjp` like :class:`TokenKron`.
    """

    parts: tuple
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def _merge(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        lead = pieces[0].shape[:-1]
        sub = self.parts[0].shape
        pieces = [p.reshape(*lead, *sub) for p in pieces]
        return torch.cat(pieces, -1).reshape(*lead, self.numel)

    def dense(self) -> torch.Tensor:
        return self._merge([p.dense() for p in self.parts])

    def vjp(self, w: torch.Tensor) -> torch.Tensor:
        return self._merge([p.vjp(w) for p in self.parts])


@dataclass(frozen=True)
class ZeroKron:
    """An exactly zero Jacobian (``b_K``: softmax is shift-invariant per row)."""

    shape: tuple[int, ...]
    T: int
    r: int
    like: torch.Tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def dense(self) -> torch.Tensor:
        return self.like.new_zeros(self.T, self.r, self.numel)

    def vjp(self, w: torch.Tensor) -> torch.Tensor:
        return w.new_zeros(w.shape[0], w.shape[1], self.numel)


def _cmat(F1, F2, omega, core):
    """``C_t = N_1^T Ω_t N_2 (+ core_t)``; ``omega`` ``None`` = identity, ``False`` = zero."""
    if omega is False:
        return core
    M2 = F2.mat if omega is None else omega @ F2.mat
    C = F1.mat.transpose(-1, -2) @ M2
    return C if core is None else C + core


def sandwich(F1, F2, omega: torch.Tensor | None = None, core: torch.Tensor | None = None) -> torch.Tensor:
    r"""The Hessian block :math:`\sum_t J_{1,t}^\top \Omega_t J_{2,t}` as a tensor ``shape_1 + shape_2``.

    ``omega`` has shape ``(T, r, r)`` (one matrix per token); ``None`` means the identity.
    ``core`` (``(T, x_1, x_2)``), if given, is added to the per-token core
    ``C_t = N_{1,t}^T Ω_t N_{2,t}`` (a second term with the same ``u``/``v`` vectors, e.g. the
    activation's curvature); with ``omega=False`` the core is used alone.
    Cost: ``T·(r²·x + r·x²)`` for the per-token cores plus one GEMM with ``T·n_1·n_2``
    multiply-adds; nothing of size ``T·r·n`` is formed. The result is usually a permuted
    view of the GEMM output; writing it into its place costs one pass.

    For a :class:`SeqFactor` (the input ``X``) the result is per sequence: ``(B, n) + shape_2``
    against a weight, ``(B, n, n)`` against ``X`` itself (the cross-sequence blocks are zero).
    """
    if isinstance(F1, SeqFactor) or isinstance(F2, SeqFactor):
        return _seq_sandwich(F1, F2, omega)
    C = _cmat(F1, F2, omega, core)
    ops, idx = [], []
    p1 = {"left": "ab", "right": "ab", "vector": "b"}[F1.side]
    p2 = {"left": "cd", "right": "cd", "vector": "d"}[F2.side]
    if F1.side != "vector":
        ops.append(F1.vec)
        idx.append("ta" if F1.side == "left" else "tb")
    if F2.side != "vector":
        ops.append(F2.vec)
        idx.append("tc" if F2.side == "left" else "td")
    x1 = "a" if F1.side == "right" else "b"
    x2 = "c" if F2.side == "right" else "d"
    ops.append(C)
    idx.append("t" + x1 + x2)
    return torch.einsum(",".join(idx) + "->" + p1 + p2, *ops)


def swap(F1, F2, omega=None, core=None) -> tuple:
    """The arguments of the transposed sandwich: ``sandwich(*swap(F1, F2, omega, core))`` is
    ``sandwich(F1, F2, omega, core)`` transposed (``omega``, ``core`` transposed per token)."""
    omega = omega if omega is None or omega is False else omega.transpose(-1, -2)
    return F2, F1, omega, None if core is None else core.transpose(-1, -2)


def _rows(F2, C: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``R[x, t, :]``, the ``vec_r`` of :math:`C_t[x, :]` spread by ``F2``'s vectors: ``(k, T, n_2)``
    from ``C`` of shape ``(T, k, x_2)`` (``u_2[t, c] C[t, x, d]`` for left, ``C[t, x, c] v_2[t, d]``
    for right, ``C[t, x, d]`` itself for a vector); written into the flat scratch ``out``."""
    C = C.transpose(0, 1)
    k, T, x2 = C.shape
    if F2.side == "vector":
        return C
    if F2.side == "left":
        a, b, shape = F2.vec[None, :, :, None], C[:, :, None, :], (k, T, F2.vec.shape[1], x2)
    else:
        a, b, shape = C[..., None], F2.vec[None, :, None, :], (k, T, x2, F2.vec.shape[1])
    R = out[: math.prod(shape)].view(shape)
    torch.mul(a, b, out=R)
    return R.view(k, T, -1)


SCRATCH_BYTES = 4 << 20  # default scratch of sandwich_into: a few R_x at a time, in cache


def sandwich_into(out: torch.Tensor, F1: TokenKron, F2: TokenKron, omega=None, core=None,
                  accumulate: bool = False, workspace: torch.Tensor | None = None) -> None:
    r"""Write (or with ``accumulate`` add) :func:`sandwich` ``(F1, F2, omega, core)`` into ``out``.

    The block is produced by GEMMs that write straight into ``out``: for each core row ``x``
    of ``F1`` (the ``q`` index of a left factor, the ``p`` index of a right one, the entry of
    a vector) the rows of ``out`` it owns are :math:`w_1^\top R_x`, with :math:`w_1 = u_1`
    (left), :math:`v_1` (right) or :math:`\mathbf 1` (vector), ``(·, T)``, and :math:`R_x` the
    ``(T, n_2)`` matrix of :func:`_rows`. Same ``T·n_1·n_2`` multiply-adds as
    :func:`sandwich`, no permuted temporary and no copy (docs/derivations.md §1).

    Parameters
    ----------
    out : Tensor
        ``(F1.numel, F2.numel)`` with unit column stride (a block of the dense Hessian, any
        row stride), or shaped ``F1.shape + F2.shape`` with any row strides and columns that
        flatten to one unit-stride run (a head's rows of a block); dtype and device of the factors.
    F1, F2 : TokenKron
        The two factors, ``T`` tokens each.
    omega, core
        As :func:`sandwich`: ``(T, r, r)`` or ``None`` (identity) or ``False`` (none);
        ``(T, x_1, x_2)`` or ``None``.
    accumulate : bool
        Add to ``out`` instead of overwriting it.
    workspace : Tensor or None
        Flat scratch of ``out``'s dtype with at least ``T·n_2`` entries; as many ``R_x`` as fit
        are built at a time. Reusing one across calls spares fresh memory (page faults).
        Without it, one of ``max(4 MiB, T·n_2 entries)`` is allocated for this call.

    Raises
    ------
    ValueError
        A factor that is not a :class:`TokenKron`; ``out`` of the wrong shape, dtype or
        device, or whose columns are not one unit-stride run; a ``workspace`` that is too
        small or of another dtype.
    """
    if not (isinstance(F1, TokenKron) and isinstance(F2, TokenKron)):
        raise ValueError(f"sandwich_into: F1 and F2 must be TokenKron factors, got {type(F1).__name__}, {type(F2).__name__}")
    n1, n2 = F1.numel, F2.numel
    if tuple(out.shape) not in ((n1, n2), (*F1.shape, *F2.shape)) or out.stride(-1) != 1:
        raise ValueError(f"sandwich_into: out must be ({n1}, {n2}) or {(*F1.shape, *F2.shape)} with unit last stride, "
                         f"got shape {tuple(out.shape)}, strides {out.stride()}")
    if out.dtype != F1.mat.dtype or out.device != F1.mat.device:
        raise ValueError(f"sandwich_into: out is {out.dtype} on {out.device}, the factors {F1.mat.dtype} on {F1.mat.device}")
    C = _cmat(F1, F2, omega, core)
    T, x1 = C.shape[:2]
    if workspace is None:
        workspace = C.new_empty(max(SCRATCH_BYTES // C.element_size(), T * n2))
    elif workspace.numel() < T * n2 or workspace.dtype != C.dtype:
        raise ValueError(f"sandwich_into: workspace must hold at least T·n_2 = {T * n2} entries of {C.dtype}, "
                         f"got {workspace.numel()} of {workspace.dtype}")
    A = C.new_ones(1, T) if F1.side == "vector" else F1.vec.transpose(0, 1)
    rows = A.shape[0]
    if out.ndim == 2:
        out = out.view(*F1.shape, *F2.shape)
    V = out if F1.side == "right" else (out.unsqueeze(0) if F1.side == "vector" else out).transpose(0, 1)  # (x1, rows) + F2.shape
    try:
        V = V.view(x1, rows, n2)
    except RuntimeError as exc:
        raise ValueError(f"sandwich_into: the columns of out (the last {len(F2.shape)} axes, strides "
                         f"{out.stride()[-len(F2.shape):]}) must flatten to one run of unit stride") from exc
    k = workspace.numel() // (T * n2)
    for s in range(0, x1, k):
        R = _rows(F2, C[:, s : s + k], workspace)
        Ak = A.expand(R.shape[0], rows, T)
        if accumulate:
            V[s : s + k].baddbmm_(Ak, R)
        else:
            torch.bmm(Ak, R, out=V[s : s + k])


def _seq_sandwich(F1, F2, omega):
    if not isinstance(F1, SeqFactor):  # (W, X): transpose of (X, W)
        out = _seq_sandwich(F2, F1, None if omega is None else omega.transpose(-1, -2))
        k = len(F1.shape)
        return out.permute(*range(out.ndim - k, out.ndim), *range(out.ndim - k))
    B = F1.B
    M2 = F2.mat if omega is None else omega @ F2.mat
    if isinstance(F2, SeqFactor) or F2.side == "vector":  # one GEMM per sequence over (L, r)
        T, r, n = F1.mat.shape
        out = F1.mat.reshape(B, -1, n).transpose(1, 2) @ M2.reshape(B, -1, M2.shape[-1])
        return out if isinstance(F2, SeqFactor) else out.reshape(*F1.shape, *F2.shape)
    C = F1.mat.transpose(-1, -2) @ M2  # (T, n, x2)
    C = C.reshape(B, -1, *C.shape[1:])  # (B, L, n, x2)
    vec = F2.vec.reshape(B, -1, F2.vec.shape[-1])
    if F2.side == "left":
        out = torch.einsum("blc,blxd->bxcd", vec, C)
    else:
        out = torch.einsum("bld,blxc->bxcd", vec, C)
    return out.reshape(*F1.shape, *F2.shape)
