r"""Per-token Kronecker factors: the structure every block Jacobian has.

Every sub-layer of the block after the attention scores acts token by token, so the
Jacobian of a per-token quantity ``o_t`` (``r`` entries) w.r.t. a weight ``W`` of shape
``(p, q)`` has, for each token ``t``, one of two Kronecker shapes (docs/derivations.md §1):

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

from .threads import threads_for

__all__ = ["TokenKron", "SeqFactor", "SplitKron", "ZeroKron", "sandwich", "sandwich_into", "swap", "choose_method",
           "workspace_need", "token_rows", "vjp_rows"]


#: entries of one chunk's per-token products in :func:`vjp_rows` (``T·k·x``, 512 KiB in float64):
#: chunks of this size stay in cache; the rows' products over whole ``(T, K, x)`` went through memory at
#: a third of the speed (docs/derivations.md §16, "Cost and memory")
ROWS_CHUNK_ENTRIES = 1 << 16


def token_rows(w: torch.Tensor) -> torch.Tensor:
    """Rows ``w`` ``(B, K, L, r)`` (``K`` per sequence, at ``L`` tokens of ``r`` entries) token-major,
    ``(B·L, K, r)``, as :func:`vjp_rows` takes them (a copy unless already so laid out)."""
    B, K, L, r = w.shape
    return w.transpose(1, 2).reshape(B * L, K, r)


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
        with threads_for(entries=T * r * self.numel):
            if self.side == "left":
                J = self.vec[:, None, :, None] * self.mat[:, :, None, :]
            elif self.side == "right":
                J = self.mat[:, :, :, None] * self.vec[:, None, None, :]
            else:
                J = self.mat
            return J.reshape(T, r, self.numel)

    def vjp(self, w: torch.Tensor, summed: bool = False) -> torch.Tensor:
        r"""Per sequence :math:`\sum_{t \in b} J_t^\top w_{b,k,t}`: ``w`` of shape ``(B, K, L, r)``
        (``K`` weights per sequence; the factor's tokens are ordered ``(B, L)``); returns
        ``(B, K, numel)``, or with ``summed`` the sum over the sequences, ``(K, numel)`` (one
        contraction over every token: no per-sequence results)."""
        B, K, L, r = w.shape
        mat = self.mat.reshape(B, L, r, self.mat.shape[-1])
        o = "k" if summed else "bk"
        if self.side == "vector":
            return torch.einsum(f"blrq,bklr->{o}q", mat, w)
        vec = self.vec.reshape(B, L, self.vec.shape[-1])
        Nw = torch.einsum("blrq,bklr->bklq", mat, w)
        if self.side == "left":
            out = torch.einsum(f"blp,bklq->{o}pq", vec, Nw)
        else:
            out = torch.einsum(f"bklp,blq->{o}pq", Nw, vec)
        return out.reshape(K, self.numel) if summed else out.reshape(B, K, self.numel)


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

    def vjp(self, w: torch.Tensor, summed: bool = False) -> torch.Tensor:
        return self._merge([p.vjp(w, summed) for p in self.parts])


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

    def vjp(self, w: torch.Tensor, summed: bool = False) -> torch.Tensor:
        return w.new_zeros(*((w.shape[1],) if summed else w.shape[:2]), self.numel)


def _leaves(F, out: torch.Tensor, add: bool) -> list:
    """``(TokenKron, out view, add)`` for each Kronecker factor of ``F`` (a :class:`SplitKron`'s heads
    into their column groups of ``out``, ``lead + F.shape``); a :class:`ZeroKron` has none (and
    zeroes ``out`` unless adding)."""
    if isinstance(F, SplitKron):
        c = F.shape[-1] // len(F.parts)
        return [(p, out[..., h * c : (h + 1) * c], add) for h, p in enumerate(F.parts)]
    if isinstance(F, ZeroKron):
        if not add:
            out.zero_()
        return []
    return [(F, out, add)]


def vjp_rows(factors, wt: torch.Tensor, B: int, summed: bool = False, outs=None) -> list[torch.Tensor]:
    r""":meth:`TokenKron.vjp` of many rows through several factors (:class:`TokenKron`,
    :class:`SplitKron`, :class:`ZeroKron`), in place: ``wt`` the rows token-major, ``(T, K, r)``
    (:func:`token_rows`; any strides with a unit last one), ``T = B·L``. Returns one tensor per
    factor, ``(K, numel)`` with ``summed`` (over every token), else ``(B, K, numel)``; ``outs``: for
    each factor ``None`` (a fresh tensor) or ``(out, add)``, a view of that shape (or ``lead +
    F.shape``; any strides with unit ones within a row: a block of the dense Hessian) that the
    products are written into, or with ``add`` added to (then returned as given).

    The rows go in chunks whose :math:`w_t N_t` (``(T, k, x)``) holds about ``ROWS_CHUNK_ENTRIES``
    entries, so that each chunk's work stays in cache, and factors that share their per-token
    matrix ``N`` (a weight and its bias: :func:`blockhess.block.first_order.jacobian_factors` keeps
    them shared) share its products, each then contracted with its own vector (left:
    :math:`\sum_t u_t \otimes w_t N_t`, one GEMM over the tokens; right: :math:`\sum_t w_t N_t \otimes v_t`;
    vector: :math:`\sum_t w_t N_t`). Not for ``vmap`` (it writes in place): :meth:`TokenKron.vjp` is.
    Derived here, docs/derivations.md §16 ("Cost and memory")."""
    T, K, r = wt.shape
    lead = (K,) if summed else (B, K)
    outs = [(wt.new_empty(*lead, *F.shape), False) if o is None else (o[0].view(*lead, *F.shape), o[1])
            for F, o in zip(factors, outs or [None] * len(factors))]
    groups: dict[int, list] = {}
    for F, (out, add) in zip(factors, outs):
        for leaf in _leaves(F, out, add):
            groups.setdefault(id(leaf[0].mat), []).append(leaf)
    for group in groups.values():
        _vjp_group(group, wt, B, summed)
    return [o.view(*lead, -1) for o, _ in outs]


def _vjp_group(group: list, wt: torch.Tensor, B: int, summed: bool) -> None:
    """:func:`vjp_rows` for ``group``, ``[(TokenKron, out view, add)]`` sharing one per-token matrix."""
    T, K, r = wt.shape
    L = T // B
    mat = group[0][0].mat
    x = mat.shape[-1]
    k = max(1, ROWS_CHUNK_ENTRIES // (T * x))
    for s in range(0, K, k):
        Nw = torch.bmm(wt[:, s : s + k], mat)  # (T, k, x): w_t N_t, token by token
        kk = Nw.shape[1]
        for F, out, add in group:
            o = out[s : s + k] if summed else out[:, s : s + k]
            if F.side == "vector":
                v = Nw.sum(0) if summed else Nw.view(B, L, kk, x).sum(1)
            elif F.side == "left":  # (p, k, x)
                p = F.vec.shape[1]
                if summed:
                    v = (F.vec.T @ Nw.view(T, kk * x)).view(p, kk, x).transpose(0, 1)
                else:
                    v = torch.bmm(F.vec.view(B, L, p).transpose(1, 2), Nw.view(B, L, kk * x)).view(B, p, kk, x).transpose(1, 2)
            else:  # (k, x, q)
                q = F.vec.shape[1]
                if summed:
                    v = (Nw.view(T, kk * x).T @ F.vec).view(kk, x, q)
                else:
                    v = torch.bmm(Nw.view(B, L, kk * x).transpose(1, 2), F.vec.view(B, L, q)).view(B, kk, x, q)
            if add:
                o.add_(v)
            else:
                o.copy_(v)


def _cmat(F1, F2, omega, core):
    """``C_t = N_1^T Ω_t N_2 (+ core_t)``; ``omega`` ``None`` = identity, ``False`` = zero."""
    if omega is False:
        return core
    T, r, x1 = F1.mat.shape
    with threads_for(macs=T * r * x1 * F2.mat.shape[-1]):  # a contiguous bmm: one parallel region
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
    multiply-adds (:func:`_khatri_rao`); nothing of size ``T·r·n`` is formed. The result is
    a permuted view of the GEMM output; writing it into its place costs one pass.

    For a :class:`SeqFactor` (the input ``X``) the result is per sequence: ``(B, n) + shape_2``
    against a weight, ``(B, n, n)`` against ``X`` itself (the cross-sequence blocks are zero).
    """
    if isinstance(F1, SeqFactor) or isinstance(F2, SeqFactor):
        return _seq_sandwich(F1, F2, omega)
    return _khatri_rao(F1, F2, _cmat(F1, F2, omega, core))


def swap(F1, F2, omega=None, core=None) -> tuple:
    """The arguments of the transposed sandwich: ``sandwich(*swap(F1, F2, omega, core))`` is
    ``sandwich(F1, F2, omega, core)`` transposed (``omega``, ``core`` transposed per token)."""
    omega = omega if omega is None or omega is False else omega.transpose(-1, -2)
    return F2, F1, omega, None if core is None else core.transpose(-1, -2)


_AXES = {"left": "ix", "right": "xi", "vector": "x"}  # a factor's parameter axes: i its vector's, x its core's


def _khatri_rao(F1, F2, C: torch.Tensor, rows: slice = slice(None), scratch: torch.Tensor | None = None) -> torch.Tensor:
    r""":math:`G[i, j, x, y] = \sum_t u_1[t, i]\, u_2[t, j]\, C_t[x, y]` laid out as the block,
    ``F1.shape + F2.shape`` (a permuted view), for the entries ``rows`` of ``F1``'s vector.

    ``u`` is a factor's vector (``u`` left, ``v`` right; a vector factor has no such axis).
    One GEMM over the tokens, :math:`P^\top C` with :math:`P[t, (i, j)] = u_1[t,i] u_2[t,j]`
    (the row-wise Khatri–Rao product, ``T·n_{u_1}·n_{u_2}``) and ``C`` as ``(T, x_1·x_2)``:
    a well-shaped GEMM whatever ``T``, whose output needs one permuted pass to reach the
    block's ``vec_r`` layout. ``P`` and the output go into the flat ``scratch`` when given
    (:func:`_khatri_rao_need` entries per row of ``F1``'s vector).
    """
    T, x1, x2 = C.shape
    u1 = None if F1.side == "vector" else F1.vec[:, rows]
    u2 = None if F2.side == "vector" else F2.vec
    dims = [u.shape[1] for u in (u1, u2) if u is not None]
    m, N = math.prod(dims), x1 * x2
    with threads_for(macs=m * T * N, entries=T * m):
        if scratch is None:  # out-of-place (vmap-friendly)
            P = u1[:, :, None] * u2[:, None, :] if len(dims) == 2 else (u1 if u2 is None else u2) if dims else C.new_ones(T)
            G = P.reshape(T, m).T @ C.reshape(T, N)
        else:
            P, G = scratch[: T * m].view(T, *dims), scratch[T * m : m * (T + N)].view(m, N)
            if len(dims) == 2:
                torch.mul(u1[:, :, None], u2[:, None, :], out=P)
            elif dims:
                P.copy_(u1 if u2 is None else u2)
            else:
                P.fill_(1)
            torch.mm(P.view(T, m).T, C.reshape(T, N), out=G)
    have = ("i" if u1 is not None else "") + ("j" if u2 is not None else "") + "xy"
    want = _AXES[F1.side] + _AXES[F2.side].replace("i", "j").replace("x", "y")
    return G.view(*dims, x1, x2).permute(*(have.index(a) for a in want))


def _khatri_rao_need(F1, F2) -> int:
    """Scratch entries :func:`_khatri_rao` needs per entry of ``F1``'s vector (all of a vector ``F1``)."""
    T, x1 = F1.mat.shape[0], F1.mat.shape[-1]
    n_u2 = 1 if F2.side == "vector" else F2.vec.shape[1]
    return n_u2 * (T + x1 * F2.mat.shape[-1])


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
    with threads_for(entries=R.numel()):
        torch.mul(a, b, out=R)
    return R.view(k, T, -1)


SCRATCH_BYTES = 4 << 20  # default scratch of sandwich_into: a few R_x (or Khatri–Rao rows) at a time, in cache


def workspace_need(F1: TokenKron, F2: TokenKron, method: str | None = None) -> int:
    """The fewest scratch entries :func:`sandwich_into` needs for this pair: ``T·n_2`` (one
    ``R_x``) for ``"rows"``, one entry of ``F1``'s vector for ``"khatri_rao"``, the larger for ``None``."""
    rows, kr = F1.mat.shape[0] * F2.numel, _khatri_rao_need(F1, F2)
    return {"rows": rows, "khatri_rao": kr}.get(method, max(rows, kr))


def choose_method(F1: TokenKron, F2: TokenKron) -> str:
    """``"khatri_rao"`` or ``"rows"`` for :func:`sandwich_into`. The row GEMMs build
    ``T/rows`` times the block's size in ``R_x`` (``rows``: the length of ``F1``'s vector, 1
    for a vector) and write in place; the Khatri–Rao GEMM builds almost nothing but passes
    over the block once more, permuted. The permuted pass is cheaper from ``T >= 4·rows``
    on (many tokens per row: batches); the crossovers: docs/derivations.md §1, "Where the GEMM writes"."""
    rows = 1 if F1.side == "vector" else F1.vec.shape[1]
    return "khatri_rao" if F1.mat.shape[0] >= 4 * rows else "rows"


def sandwich_into(out: torch.Tensor, F1: TokenKron, F2: TokenKron, omega=None, core=None,
                  accumulate: bool = False, workspace: torch.Tensor | None = None, method: str | None = None) -> None:
    r"""Write (or with ``accumulate`` add) :func:`sandwich` ``(F1, F2, omega, core)`` into ``out``.

    Two ways, with the same ``T·n_1·n_2`` multiply-adds (docs/derivations.md §1):

    * ``"rows"``: GEMMs that write straight into ``out``: for each core row ``x`` of ``F1``
      (the ``q`` index of a left factor, the ``p`` index of a right one, the entry of a
      vector) the rows of ``out`` it owns are :math:`w_1^\top R_x`, with :math:`w_1 = u_1`
      (left), :math:`v_1` (right) or :math:`\mathbf 1` (vector), ``(·, T)``, and :math:`R_x`
      the ``(T, n_2)`` matrix of :func:`_rows`; no permuted temporary and no copy.
    * ``"khatri_rao"``: :func:`_khatri_rao` for a few entries of ``F1``'s vector at a time,
      each result added or copied into its place: one permuted pass over the block, but no
      ``R_x`` (``T/rows`` times the block's size); any strides of ``out`` will do.

    Parameters
    ----------
    out : Tensor
        ``(F1.numel, F2.numel)`` or shaped ``F1.shape + F2.shape``, dtype and device of the
        factors; for ``"rows"`` with unit column stride and columns that flatten to one
        unit-stride run (a block of the dense Hessian, or a head's rows of one), any row strides.
    F1, F2 : TokenKron
        The two factors, ``T`` tokens each.
    omega, core
        As :func:`sandwich`: ``(T, r, r)`` or ``None`` (identity) or ``False`` (none);
        ``(T, x_1, x_2)`` or ``None``.
    accumulate : bool
        Add to ``out`` instead of overwriting it.
    workspace : Tensor or None
        Flat scratch of ``out``'s dtype with at least :func:`workspace_need` entries (for the
        method used); as much work as fits is done per GEMM. Reusing one across calls spares
        fresh memory (page faults). Without it, one of ``max(SCRATCH_BYTES, workspace_need)``
        bytes is allocated for this call.
    method : "rows", "khatri_rao" or None
        ``None``: :func:`choose_method`, or ``"khatri_rao"`` where ``out``'s columns are not
        one run.

    Raises
    ------
    ValueError
        A factor that is not a :class:`TokenKron`; ``out`` of the wrong shape, dtype or
        device, or (``method="rows"``) whose columns are not one unit-stride run; a
        ``workspace`` that is too small or of another dtype; an unknown ``method``.
    """
    if not (isinstance(F1, TokenKron) and isinstance(F2, TokenKron)):
        raise ValueError(f"sandwich_into: F1 and F2 must be TokenKron factors, got {type(F1).__name__}, {type(F2).__name__}")
    if method not in (None, "rows", "khatri_rao"):
        raise ValueError(f"sandwich_into: method must be 'rows', 'khatri_rao' or None, got {method!r}")
    n1, n2 = F1.numel, F2.numel
    if tuple(out.shape) not in ((n1, n2), (*F1.shape, *F2.shape)):
        raise ValueError(f"sandwich_into: out must be ({n1}, {n2}) or {(*F1.shape, *F2.shape)}, got shape {tuple(out.shape)}")
    if out.dtype != F1.mat.dtype or out.device != F1.mat.device:
        raise ValueError(f"sandwich_into: out is {out.dtype} on {out.device}, the factors {F1.mat.dtype} on {F1.mat.device}")
    out = out.view(*F1.shape, *F2.shape) if out.ndim == 2 else out
    V = out if F1.side == "right" else (out.unsqueeze(0) if F1.side == "vector" else out).transpose(0, 1)  # (x1, rows) + F2.shape
    try:
        V = V.view(V.shape[0], V.shape[1], n2) if out.stride(-1) == 1 else None
    except RuntimeError:
        V = None
    if method == "rows" and V is None:
        raise ValueError(f"sandwich_into: for method='rows' the columns of out (the last {len(F2.shape)} axes, strides "
                         f"{out.stride()[-len(F2.shape):]}) must flatten to one run of unit stride")
    method = method or ("khatri_rao" if V is None else choose_method(F1, F2))
    need = workspace_need(F1, F2, method)
    if workspace is None:
        workspace = out.new_empty(max(SCRATCH_BYTES // out.element_size(), need))
    elif workspace.numel() < need or workspace.dtype != out.dtype:
        raise ValueError(f"sandwich_into: workspace must hold at least {need} entries of {out.dtype} "
                         f"(workspace_need for {method!r}), got {workspace.numel()} of {workspace.dtype}")
    C = _cmat(F1, F2, omega, core)
    if method == "khatri_rao":
        _khatri_rao_into(out, F1, F2, C, accumulate, workspace)
        return
    T, x1 = C.shape[:2]
    A = C.new_ones(1, T) if F1.side == "vector" else F1.vec.transpose(0, 1)  # w_1^T, (rows, T)
    k = workspace.numel() // (T * n2)
    for s in range(0, x1, k):
        R = _rows(F2, C[:, s : s + k], workspace)
        Ak = A.expand(R.shape[0], A.shape[0], T)
        with threads_for(macs=A.shape[0] * T * n2):  # the output is strided: one product per matrix of the batch
            if accumulate:
                V[s : s + k].baddbmm_(Ak, R)
            else:
                torch.bmm(Ak, R, out=V[s : s + k])


def _khatri_rao_into(out: torch.Tensor, F1, F2, C: torch.Tensor, accumulate: bool, workspace: torch.Tensor) -> None:
    """The ``"khatri_rao"`` way of :func:`sandwich_into`: ``out`` shaped ``F1.shape + F2.shape``,
    a chunk of ``F1``'s vector entries per GEMM (as many as ``workspace`` holds)."""
    per = _khatri_rao_need(F1, F2)
    if F1.side == "vector":
        chunks, axis = [slice(None)], 0
    else:
        k, n = max(1, workspace.numel() // per), F1.vec.shape[1]
        chunks, axis = [slice(s, s + k) for s in range(0, n, k)], 0 if F1.side == "left" else 1
    for sl in chunks:
        G = _khatri_rao(F1, F2, C, sl, workspace)
        target = out if F1.side == "vector" else out.narrow(axis, sl.start, G.shape[axis])
        with threads_for(entries=G.numel()):
            if accumulate:
                target.add_(G)
            else:
                target.copy_(G)


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
