r"""Per-token Kronecker factors: the structure every block Jacobian has.

Every sub-layer of the block after the attention scores acts token by token, so the
Jacobian of a per-token quantity ``o_t`` (``r`` entries) w.r.t. a weight ``W`` of shape
``(p, q)`` has, for each token ``t``, one of two Kronecker shapes (DESIGN.md §5):

* ``left``:  :math:`J_t = u_t^\top \otimes N_t`, entry ``[c, (a, b)] = u_t[a] N_t[c, b]``
  (``W_Q``: ``u = x_t``; ``W_V``: ``u = (AX)_t``; ``W_1``: ``u = y_t``; ``W_2``: ``u = relu_t``);
* ``right``: :math:`J_t = N_t \otimes v_t^\top`, entry ``[c, (a, b)] = N_t[c, a] v_t[b]``
  (``W_K``: ``v = q_t``).

A Hessian term :math:`\sum_t J_{i,t}^\top \Omega_t J_{j,t}` then costs one small product
``C_t = N_i^T Ω_t N_j`` per token and one GEMM over the token index — about
``T·n_i·n_j`` multiply-adds instead of the ``T·r·n_i·n_j`` of a dense ``J^T Ω J`` — and no
Kronecker product or commutation matrix is ever formed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TokenKron", "sandwich"]


@dataclass(frozen=True)
class TokenKron:
    """Jacobian rows of ``T`` tokens w.r.t. one ``(p, q)`` weight, in Kronecker form.

    Attributes
    ----------
    side : str
        ``"left"`` (``J_t = u_t^T ⊗ N_t``) or ``"right"`` (``J_t = N_t ⊗ v_t^T``).
    vec : Tensor
        ``u``, shape ``(T, p)`` (left) or ``v``, shape ``(T, q)`` (right).
    mat : Tensor
        ``N``, shape ``(T, r, q)`` (left) or ``(T, r, p)`` (right); ``r`` = rows per token.
    """

    side: str
    vec: torch.Tensor
    mat: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """``(p, q)``, the shape of the weight."""
        if self.side == "left":
            return self.vec.shape[-1], self.mat.shape[-1]
        return self.mat.shape[-1], self.vec.shape[-1]

    @property
    def numel(self) -> int:
        p, q = self.shape
        return p * q

    def premul(self, E: torch.Tensor) -> "TokenKron":
        """Chain rule through a per-token map: rows ``E_t J_t``; ``E`` of shape ``(T, r', r)``."""
        return TokenKron(self.side, self.vec, E @ self.mat)

    def dense(self) -> torch.Tensor:
        """The Jacobian rows as a dense tensor ``(T, r, p*q)``."""
        T, r = self.mat.shape[:2]
        if self.side == "left":
            J = self.vec[:, None, :, None] * self.mat[:, :, None, :]
        else:
            J = self.mat[:, :, :, None] * self.vec[:, None, None, :]
        return J.reshape(T, r, self.numel)

    def vjp(self, w: torch.Tensor) -> torch.Tensor:
        r"""Per sequence :math:`\sum_{t \in b} J_t^\top w_{b,k,t}`: ``w`` of shape ``(B, K, L, r)``
        (``K`` weights per sequence; the factor's tokens are ordered ``(B, L)``); returns
        ``(B, K, p*q)``."""
        B, K, L, r = w.shape
        mat = self.mat.reshape(B, L, r, self.mat.shape[-1])
        vec = self.vec.reshape(B, L, self.vec.shape[-1])
        Nw = torch.einsum("blrq,bklr->bklq", mat, w)
        if self.side == "left":
            out = torch.einsum("blp,bklq->bkpq", vec, Nw)
        else:
            out = torch.einsum("bklp,blq->bkpq", Nw, vec)
        return out.reshape(B, K, self.numel)


def sandwich(F1: TokenKron, F2: TokenKron, omega: torch.Tensor | None = None) -> torch.Tensor:
    r"""The Hessian block :math:`\sum_t J_{1,t}^\top \Omega_t J_{2,t}` as a 4-D tensor ``(p1, q1, p2, q2)``.

    ``omega`` has shape ``(T, r, r)`` (one matrix per token); ``None`` means the identity.
    Cost: ``T·(r²·q + r·q²)`` for the per-token cores plus one GEMM with ``T·n_1·n_2``
    multiply-adds; nothing of size ``T·r·n`` is formed. The result is usually a permuted
    view of the GEMM output (``reshape(p1*q1, p2*q2)`` gives the 2-D block); writing it
    into its place costs one pass.
    """
    M2 = F2.mat if omega is None else omega @ F2.mat
    C = F1.mat.transpose(1, 2) @ M2  # (T, x1, x2): x = q (left) or p (right)
    u1, u2 = F1.vec, F2.vec
    if F1.side == "left" and F2.side == "left":
        out = torch.einsum("ta,tc,tbd->abcd", u1, u2, C)
    elif F1.side == "left":
        out = torch.einsum("ta,td,tbc->abcd", u1, u2, C)
    elif F2.side == "left":
        out = torch.einsum("tb,tc,tad->abcd", u1, u2, C)
    else:
        out = torch.einsum("tb,td,tac->abcd", u1, u2, C)
    return out
