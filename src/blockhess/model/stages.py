r"""The stages of a model and their derivatives, as the curvature walk (:mod:`.walk`) reads them.

A stage maps its input ``x`` (``m_in`` entries per sequence) and its variables ``θ`` to its output
``y`` (``m_out`` entries). Rows ``W`` ``(B, R, m_out)`` are ``R`` vectors per sequence at the output:

* ``vjp(W, names, summed=False)``: :math:`J_\theta^\top w` for each row, ``{name: (B, R, n_θ)}``, or
  with ``summed`` their sum over the sequences, ``{name: (R, n_θ)}`` (one contraction over every token);
  ``vjps(W, names, summed=False, into=None)`` the same one variable at a time, ``(name, value)``
  (a block's rows laid out once for all of them, and written where ``into(name)`` says);
* ``back(W)``: :math:`J_x^\top w` for each row, ``(B, R, m_in)`` (the embedding has no input);
* ``fwd(G)``: :math:`J_x G` for tangents ``G`` ``(B, m_in, n)`` at the input, ``(B, m_out, n)``;
* ``curv(g, names, acc=None)``: the stage's second derivatives with its input contracted with the
  gradient ``g`` ``(B, m_out)`` at its output: ``(XX, Xθ)`` with ``XX`` ``(B, m_in, m_in)`` or ``None``,
  ``Xθ`` ``{name: (B, m_in, n_θ)}``. Only a block's variables have second derivatives among themselves:
  with ``acc`` (the model's dense :class:`~blockhess.result.BlockSum`) the block adds them there in
  the same contraction, else :meth:`BlockStage.weight_pairs` does, in passes of their own (the
  head's with its cross-entropy are :class:`SoftmaxHead`'s).

A block is a stage through :mod:`blockhess.block` (its factors, its input Jacobian and its
contracted second derivatives w.r.t. ``(X, θ)``: Theorems 4–5 with the input as a variable); the
embedding, LayerNorm, pooling and head stages are written here. The loss sits on top
(:class:`OutputLoss`, or :class:`SoftmaxHead`: the head and its cross-entropy in closed form,
:math:`\nabla^2_{z_t}\ell = \mathrm{diag}(p_t) - p_t p_t^\top`, never formed). Derivations:
docs/derivations.md §16.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import gemm, losses
from ..block import contract_output, jacobian_factors
from ..block.directional import vjp
from ..config import param_shapes
from ..heap import ROW_ALIGN_BYTES
from ..kronecker import SplitKron, TokenKron, token_rows, vjp_rows
from ..layers import layernorm
from ..result import BlockSum, HeadSplitSum, InputSplitSum
from ..validation import check_fits
from .forward_pass import embed_scale

__all__ = ["BlockStage", "EmbeddingStage", "NormStage", "PoolStage", "HeadStage", "OutputLoss", "SoftmaxHead",
           "TIED_HEAD"]

#: the bytes of logit tangents :meth:`SoftmaxHead.through` holds at a time (a chunk of the vocabulary's columns)
THROUGH_CHUNK_BYTES = 16 << 20

#: the block rows :meth:`SoftmaxHead.gram` splits ``d`` into, forming the upper block triangle only
GRAM_BLOCKS = 4


def _gram_share(d: int) -> float:
    """The share of the full ``d × d`` products that :meth:`SoftmaxHead.gram`'s upper block triangle costs."""
    b = -(-d // GRAM_BLOCKS)
    return sum(min(b, d - i) * (d - i) for i in range(0, d, b)) / d**2


#: the internal name of the token embedding's second use, as the tied head ``W_H = W_E^T`` ``(d, vocab)``
TIED_HEAD = "W_E@head"
HEAD_STACK_MAX_ROWS = 32  # the head's weight rows ġᵀh + gᵀḣ from at most this many rows: one product over the
# rows stacked twice; from more, two products into one result (derivations §18)


def _none_curv(g, names, acc=None):
    return None, {}


def _token_leaves(F) -> list:
    """The :class:`~blockhess.kronecker.TokenKron` factors of a block's factor ``F`` (a head-split weight's parts)."""
    return list(F.parts) if isinstance(F, SplitKron) else [F] if isinstance(F, TokenKron) else []


def _each_vjp(self, W: torch.Tensor, names, summed: bool = False, into=None):
    """``vjps``: the stage's ``vjp`` one variable at a time, ``(name, value)`` as each is asked for
    (as :meth:`BlockStage.vjps`, which lays the rows out once for all of them; ``into`` is not used)."""
    for n in names:
        yield n, self.vjp(W, [n], summed)[n]


class EmbeddingStage:
    """``X_0 = embed(x) [+ cls] + P [+ W_T[types]]`` (no LayerNorm; ``P`` the rows of ``W_P`` at the
    positions, ``W_T``'s at the token types: 0 without them): linear in every variable, no input.
    A token embedding's scale ``s`` (``embed_scale``) multiplies ``W_E``'s rows, its tangents and adjoints."""

    def __init__(self, t, names: tuple[str, ...]):
        self.cfg, self.p, self.x = t.cfg, t.params, t.inputs
        self.positions, self.types = t.positions, t.types  # (B, L) rows of W_P, W_T; None: 0..L-1, 0
        self.names = names
        self.s = embed_scale(t.cfg, t.X0) if t.cfg.embedding == "token" and t.cfg.embed_scale != 1.0 else None
        self.B, self.L, self.d = t.X0.shape
        self.curv = _none_curv
        self.back = None

    vjps = _each_vjp

    def vjp(self, W: torch.Tensor, names, summed: bool = False) -> dict:
        B, R = W.shape[:2]
        w = W.reshape(B, R, self.L, self.d)
        if summed:  # every variable here is linear and shared by the sequences: sum the rows first where it can
            per_sequence = self.positions is not None or self.types is not None  # each sequence's own rows
            w = w.sum(0, keepdim=True) if not per_sequence and (self.cfg.embedding == "none" or
                                                                not ({"W_E"} & set(names))) else w
        lead = (R,) if summed else (B, R)
        o = 1 if self.cfg.cls_token else 0
        tok = w[:, :, o:]
        out = {}
        for n in names:
            if n == "W_E":
                if self.cfg.embedding == "token":  # a gather's adjoint: each token's row added to its id's
                    v = w.new_zeros(1 if summed else w.shape[0], R, self.cfg.vocab, self.d)
                    for b in range(w.shape[0]):
                        v[0 if summed else b].index_add_(1, self.x[b], tok[b])
                    if self.s is not None:
                        v *= self.s
                elif summed:
                    v = torch.einsum("blp,brlq->rpq", self.x, tok)[None]
                else:
                    v = torch.einsum("blp,brlq->brpq", self.x, tok)
            elif n == "b_E":
                v = tok.sum(2)
            elif n == "cls":
                v = w[:, :, 0]
            elif n == "W_P":
                v = w.new_zeros(w.shape[0], R, self.cfg.n_positions, self.d)
                if self.positions is None:
                    v[:, :, : self.L] = w
                else:  # a gather's adjoint, as W_E's
                    for b in range(w.shape[0]):
                        v[0 if summed else b].index_add_(1, self.positions[b], w[b])
            elif n == "W_T":
                v = w.new_zeros(w.shape[0], R, self.cfg.token_types, self.d)
                if self.types is None:
                    v[:, :, 0] = w.sum(2)
                else:
                    for b in range(w.shape[0]):
                        v[0 if summed else b].index_add_(1, self.types[b], w[b])
            else:
                raise KeyError(n)
            out[n] = ((v[0] if v.shape[0] == 1 else v.sum(0)) if summed else v).reshape(*lead, -1)
        return out

    def tangent(self, dx, V: dict, k: int) -> torch.Tensor:
        """``J_θ θ̇`` of the embedding for ``k`` directions ``V`` ``{name: (k, *shape)}``: ``(k, B, L, d)``
        (no input: ``dx`` is not read)."""
        cfg = self.cfg
        out = self.p[self.names[0]].new_zeros(k, self.B, self.L, self.d)
        o = 1 if cfg.cls_token else 0
        for n, v in V.items():
            if n == "W_E":
                if cfg.embedding == "token":
                    out[:, :, o:] += v[:, self.x] if self.s is None else v[:, self.x] * self.s
                else:
                    out[:, :, o:] += torch.einsum("blp,kpq->kblq", self.x, v)
            elif n == "b_E":
                out[:, :, o:] += v[:, None, None]
            elif n == "cls":
                out[:, :, 0] += v[:, None]
            elif n == "W_P":
                out += v[:, None, : self.L] if self.positions is None else v[:, self.positions]
            elif n == "W_T":
                out += v[:, None, None, 0] if self.types is None else v[:, self.types]
        return out

    def adjoint2(self, g, dx, V: dict, dg: torch.Tensor, names, functional: bool = True, into=None):
        """``(None, {name: (k, *shape)})``: ``J_θᵀ ġ`` (the embedding is linear: no second-order term).
        ``into``: ``{"W_E": (k, vocab, d)}`` a tensor the token embedding's rows are *added* into (each
        token's row to its id's; the tied head's rows already there, or zeros) and returned as."""
        k = dg.shape[0]
        acc = (into or {}).get("W_E")
        if acc is None or "W_E" not in names or self.cfg.embedding != "token":
            out = self.vjp(dg.transpose(0, 1).reshape(self.B, k, -1), names, summed=True)
            return None, {n: v.reshape(k, *self.p[n].shape) for n, v in out.items()}
        rest = [n for n in names if n != "W_E"]
        out = self.vjp(dg.transpose(0, 1).reshape(self.B, k, -1), rest, summed=True) if rest else {}
        tok = dg[:, :, 1:] if self.cfg.cls_token else dg
        if self.s is not None:
            tok = tok * self.s
        for b in range(self.B):
            acc.index_add_(1, self.x[b], tok[:, b])
        out["W_E"] = acc
        return None, {n: v.reshape(k, *self.p[n].shape) for n, v in out.items()}



class NormStage:
    """A LayerNorm over the rows of ``x`` ``(B, L, d)`` with optional ``gamma``, ``beta`` (``names``);
    ``center=False``: an RMSNorm (no centring, no ``beta``). ``gamma`` is the scale as the forward uses
    it (``rms_offset + gamma``: the derivatives w.r.t. the stored ``gamma`` are those w.r.t. it)."""

    def __init__(self, x: torch.Tensor, eps: float, gamma, beta, names: tuple[str, ...], center: bool = True):
        self.x, self.eps, self.gamma, self.center = x, eps, gamma, center
        self.names = names  # (gamma name or absent, beta name or absent), in that order
        self.g_name = names[0] if gamma is not None else None
        self.b_name = names[-1] if beta is not None else None
        y, r = layernorm.normalise(x, eps, center=center)
        self.y, self.r = y, r  # normalised rows, their 1/sigma (B, L, 1)
        self._Jn = None

    @property
    def Jn(self) -> torch.Tensor:
        """The per-token Jacobians of the normalisation, unscaled, ``(B, L, d, d)`` (Theorem 2), formed on first
        use by the dense walk's :meth:`curv` (its ``γ`` cross term is ``d`` wide per token anyway); the
        products, :meth:`back` and :meth:`fwd` take them in closed form per token (:meth:`_n_dot`)."""
        if self._Jn is None:
            self._Jn = layernorm.per_token_jacobian(self.y, self.r, center=self.center)
        return self._Jn

    vjps = _each_vjp

    def vjp(self, W: torch.Tensor, names, summed: bool = False) -> dict:
        B, R = W.shape[:2]
        w = W.reshape(B, R, *self.x.shape[1:])
        o = "r" if summed else "br"
        return {n: torch.einsum(f"bli,brli->{o}i", self.y, w) if n == self.g_name else
                torch.einsum(f"brli->{o}i", w) for n in names}

    def back(self, W: torch.Tensor) -> torch.Tensor:
        """``J_xᵀ w`` per row, ``(B, R, L·d)``: ``J_nᵀ (γ ⊙ w) = J_n (γ ⊙ w)`` per token (``J_n`` symmetric), in
        closed form (:meth:`_n_dot`), no ``(B, L, d, d)`` Jacobians."""
        B, R = W.shape[:2]
        w = W.reshape(B, R, *self.x.shape[1:]).transpose(0, 1)  # (R, B, L, d): the rows as directions
        if self.gamma is not None:
            w = w * self.gamma
        return self._n_dot(w).transpose(0, 1).reshape(B, R, -1)

    def fwd(self, G: torch.Tensor) -> torch.Tensor:
        """``J_x G`` ``(B, L·d, n)`` for ``G`` ``(B, L·d, n)``: ``γ ⊙ (J_n g)`` per token and column (Theorem 2),
        in closed form (:meth:`_n_dot`), no ``(B, L, d, d)`` Jacobians."""
        B, _, n = G.shape
        L, d = self.x.shape[1:]
        out = self._n_dot(G.reshape(B, L, d, n).permute(3, 0, 1, 2))  # (n, B, L, d): the columns as directions
        if self.gamma is not None:
            out.mul_(self.gamma)
        return out.permute(1, 2, 3, 0).reshape(B, L * d, n)

    def _c(self, t: torch.Tensor) -> torch.Tensor:
        """``C t`` per row: ``t − mean t`` (LayerNorm), ``t`` itself (RMSNorm)."""
        return t - t.mean(-1, keepdim=True) if self.center else t

    def _n_dot(self, dx: torch.Tensor) -> torch.Tensor:
        """``J_n ẋ`` per token: ``r (C ẋ − n (n·ẋ)/d)``, ``dx`` ``(k, B, L, d)``."""
        d = dx.shape[-1]
        return torch.addcmul(self._c(dx), self.y, (self.y * dx).sum(-1, keepdim=True) / d, value=-1).mul_(self.r)

    def tangent(self, dx, V: dict, k: int) -> torch.Tensor:
        """``u̇ = γ ⊙ J_n ẋ + γ̇ ⊙ n + β̇`` ``(k, B, L, d)``; ``dx`` ``(k, B, L, d)`` or ``None``."""
        out = self.x.new_zeros(k, *self.x.shape)
        if dx is not None:
            n_dot = self._n_dot(dx)
            out += n_dot if self.gamma is None else n_dot * self.gamma
        if self.g_name in V:
            out += V[self.g_name][:, None, None] * self.y
        if self.b_name in V:
            out += V[self.b_name][:, None, None]
        return out

    def adjoint2(self, g, dx, V: dict, dg: torch.Tensor, names, functional: bool = True, into=None):
        r"""``(ġ_x, {name: (Hv)_name})``: :math:`\dot g_x = J_x^\top \dot g + \Gamma(g)\,\dot x + J_n^\top(\dot\gamma \odot g)`,
        :math:`(Hv)_\gamma = \sum_t n \odot \dot g + (J_n \dot x) \odot g`, :math:`(Hv)_\beta = \sum_t \dot g`
        (the terms in ``g`` only with ``functional``); ``g`` ``(B, L, d)``, ``dx``, ``dg`` ``(k, B, L, d)``."""
        d = self.x.shape[-1]
        gam = self.gamma
        dgn = dg if gam is None else dg * gam  # the adjoint tangent at n
        if functional and self.g_name in V:
            dgn = dgn + V[self.g_name][:, None, None] * g
        out = {}
        if self.g_name in names:
            hv = (self.y * dg).sum((1, 2))
            if functional and dx is not None:
                hv = hv + (self._n_dot(dx) * g).sum((1, 2))
            out[self.g_name] = hv
        if self.b_name in names:
            out[self.b_name] = dg.sum((1, 2))
        gx = self._n_dot(dgn)  # J_n is symmetric
        if functional and dx is not None:  # Γ(g_n) ẋ, the contracted norm Hessian along ẋ (Theorem 3; C = I: RMSNorm)
            gn = g if gam is None else g * gam
            gh = self._c(gn)
            c = self.r ** 2 / d  # (B, L, 1): the factor of every term, folded into the per-token numbers
            u = (gn * self.y).sum(-1, keepdim=True) * c
            ydx = (self.y * dx).sum(-1, keepdim=True)
            t = gh * (ydx * c)
            t.addcmul_(self.y, (gh * dx).sum(-1, keepdim=True) * c).addcmul_(self._c(dx), u)
            gx = gx.sub_(t.addcmul_(self.y, ydx * (u * (-3 / d))))
        return gx, out

    def curv(self, g: torch.Tensor, names, acc=None):
        B, L, d = self.x.shape
        gt = g.reshape(B, L, d)
        Gam = layernorm.contract_hessian_unchecked(self.x, gt, self.eps, self.gamma, center=self.center)  # (B, L, d, d)
        eye = torch.eye(L, dtype=g.dtype, device=g.device)
        XX = torch.einsum("blij,lm->blimj", Gam, eye).reshape(B, L * d, L * d)
        Xt = {}
        if self.g_name in names:  # d2(g.u)/dx_t dgamma = J_n,t^T diag(g_t)
            Xt[self.g_name] = (self.Jn * gt[..., :, None]).transpose(-1, -2).reshape(B, L * d, d)
        return XX, Xt


class PoolStage:
    """``h = mean_t u_t`` (``"mean"``), ``h = u_0`` (``"first"``) or ``h = u_{L-1}`` (``"last"``; with a
    ``pad_token``, ``at`` per sequence: its last token that is not padding) over ``L`` tokens of width ``d``."""

    names: tuple[str, ...] = ()

    def __init__(self, kind: str, L: int, d: int, at=None):
        self.kind, self.L, self.d = kind, L, d
        # the token picked ("first", "last"): an int, or (B,) per sequence (forward_pass.last_tokens)
        self.at = (L - 1 if kind == "last" else 0) if at is None else at
        self.curv = _none_curv

    vjps = _each_vjp

    def vjp(self, W, names, summed: bool = False) -> dict:
        return {}

    def back(self, W: torch.Tensor) -> torch.Tensor:
        B, R = W.shape[:2]
        if self.kind == "mean":
            return (W[:, :, None, :] / self.L).expand(B, R, self.L, self.d).reshape(B, R, -1)
        out = W.new_zeros(B, R, self.L, self.d)
        if isinstance(self.at, int):
            out[:, :, self.at] = W
        else:
            out[torch.arange(B, device=W.device), :, self.at] = W
        return out.reshape(B, R, -1)

    def fwd(self, G: torch.Tensor) -> torch.Tensor:
        B, _, n = G.shape
        G = G.reshape(B, self.L, self.d, n)
        if self.kind == "mean":
            return G.mean(1)
        return G[:, self.at] if isinstance(self.at, int) else G[torch.arange(B, device=G.device), self.at]

    def tangent(self, dx, V: dict, k: int) -> torch.Tensor:
        """``(k, B, 1, d)`` from ``(k, B, L, d)``."""
        if self.kind == "mean":
            return dx.mean(2, keepdim=True)
        if isinstance(self.at, int):
            return dx[:, :, self.at:self.at + 1]
        return dx[:, torch.arange(dx.shape[1], device=dx.device), self.at][:, :, None]

    def adjoint2(self, g, dx, V, dg: torch.Tensor, names, functional: bool = True, into=None):
        """``(ġ_x (k, B, L, d), {})``: linear, no variables."""
        k, B = dg.shape[:2]
        if self.kind == "mean" or isinstance(self.at, int):
            return self.back(dg.reshape(k * B, 1, -1)).reshape(k, B, self.L, self.d), {}
        out = dg.new_zeros(k, B, self.L, self.d)
        out[:, torch.arange(B, device=dg.device), self.at] = dg.reshape(k, B, self.d)
        return out, {}


class HeadStage:
    """``z = h W + b`` per row, ``h`` ``(B, P, d)``, ``W`` ``(d, C)`` (named ``names[0]``; the tied
    head's :data:`TIED_HEAD`), ``b`` ``(C,)`` if named. The products (:meth:`tangent`, :meth:`adjoint2`)
    take the tied head's direction and give its rows in ``W_E``'s own layout ``(C, d)``, so that the
    two uses of ``W_E`` meet without a transpose of the table (:func:`~.directional.unfold_tied`)."""

    def __init__(self, h: torch.Tensor, W: torch.Tensor, names: tuple[str, ...]):
        self.h, self.W, self.names = h, W, names
        self.tied = names[0] == TIED_HEAD

    vjps = _each_vjp

    def vjp(self, W: torch.Tensor, names, summed: bool = False) -> dict:
        B, R = W.shape[:2]
        P, C = self.h.shape[1], self.W.shape[1]
        w = W.reshape(B, R, P, C)
        o, lead = ("r", (R,)) if summed else ("br", (B, R))
        return {n: (torch.einsum(f"bpi,brpc->{o}ic", self.h, w).reshape(*lead, -1) if n == self.names[0] else
                    torch.einsum(f"brpc->{o}c", w)) for n in names}

    def back(self, W: torch.Tensor) -> torch.Tensor:
        B, R = W.shape[:2]
        P, C = self.h.shape[1], self.W.shape[1]
        return (W.reshape(B, R, P, C) @ self.W.T).reshape(B, R, -1)

    def fwd(self, G: torch.Tensor) -> torch.Tensor:
        B, _, n = G.shape
        P, d = self.h.shape[1:]
        return torch.einsum("bpin,ic->bpcn", G.reshape(B, P, d, n), self.W).reshape(B, -1, n)

    def _dW_T(self, dW: torch.Tensor) -> torch.Tensor:
        """A direction of the weight as ``Ẇᵀ`` ``(k, C, d)`` (the tied head's is given so)."""
        return dW if self.tied else dW.transpose(1, 2)

    def tangent(self, dx, V: dict, k: int) -> torch.Tensor:
        """``ż = ḣ W + h Ẇ + ḃ`` ``(k, B, P, C)``; ``dx`` ``(k, B, P, d)`` or ``None``; the tied head's
        ``Ẇᵀ`` ``(k, C, d)``. The products are :mod:`blockhess.gemm`'s: the rows may be padded (not
        contiguous where ``C`` elements are not whole cache lines: read it with ``reshape``, not ``view``)."""
        w, b = self.names[0], self.names[1] if len(self.names) > 1 else None
        B, P, d = self.h.shape
        C = self.W.shape[1]
        out = None if dx is None else gemm.mm(dx.reshape(k * B * P, d), self.W).view(k, B * P, C)
        if w in V:  # h Ẇ: one product per direction over the batch's rows
            out = gemm.mm_each(self.h.reshape(B * P, d), self._dW_T(V[w]).transpose(1, 2), out)
        elif out is None:
            out = self.h.new_zeros((k, B * P, C))
        out = out.reshape(k, B, P, C)
        if b in V:
            out += V[b][:, None, None]
        return out

    def adjoint2(self, g, dx, V: dict, dg: torch.Tensor, names, functional: bool = True, into=None):
        """``(ġ_h, {W: ḣᵀ g + hᵀ ġ, b: Σ ġ})``, ``ġ_h = ġ Wᵀ + g Ẇᵀ`` (the terms in ``g`` only with ``functional``);
        ``g`` ``(B, P, C)``; the tied head's rows as ``(ḣᵀ g + hᵀ ġ)ᵀ`` ``(k, C, d)``. ``into``: name → a
        contiguous destination of the weight's rows (``(k, C, d)`` tied, ``(k, d, C)`` else), written and
        returned."""
        w, b = self.names[0], self.names[1] if len(self.names) > 1 else None
        k = dg.shape[0]
        B, P, d = self.h.shape
        C = self.W.shape[1]
        dgf, gf, hf = dg.reshape(k, B * P, C), g.reshape(B * P, C), self.h.reshape(B * P, d)
        gh = gemm.mm(dgf.reshape(k * B * P, C), self.W.T).view(k, B * P, d)
        if functional and w in V:
            gh = gemm.mm_each(gf, self._dW_T(V[w]), gh)
        out = {}
        if w in names:  # ġᵀ h + gᵀ ḣ as (k, C, d) (the tied layout) or its transpose (k, d, C), in one product
            dest = (into or {}).get(w)
            both = functional and dx is not None
            if both and B * P <= HEAD_STACK_MAX_ROWS:  # few rows: [ġ; g]ᵀ [h; ḣ], one product, rows written once
                L = torch.cat([dgf, gf.expand(k, -1, -1)], 1)
                R = torch.cat([hf.expand(k, -1, -1), dx.reshape(k, B * P, d)], 1)
                out[w] = torch.matmul(L.mT, R, out=dest) if self.tied else torch.matmul(R.mT, L, out=dest)
            else:
                out[w] = torch.matmul(dgf.mT, hf, out=dest) if self.tied else torch.matmul(hf.T, dgf, out=dest)
                if both:  # + gᵀ ḣ: a second product into the first's (no stacked copies)
                    dxf, gk = dx.reshape(k, B * P, d), gf.expand(k, -1, -1)
                    out[w].baddbmm_(*((gk.mT, dxf) if self.tied else (dxf.mT, gk)))
        if b in names:
            out[b] = dgf.sum(1)
        return gh.reshape(k, B, P, d), out

    def curv(self, g: torch.Tensor, names, acc=None):
        B, P, d = self.h.shape
        C = self.W.shape[1]
        Xt = {}
        if self.names[0] in names:  # d2(g.z)/dh_ti dW_jc = delta_ij g_tc
            eye = torch.eye(d, dtype=g.dtype, device=g.device)
            Xt[self.names[0]] = torch.einsum("ij,btc->btijc", eye, g.reshape(B, P, C)).reshape(B, P * d, d * C)
        return None, Xt


class BlockStage:
    """Block ``c`` (a :class:`blockhess.block.Cache` with the input ``X`` a variable), its variables
    named ``prefix + name``."""

    def __init__(self, c, prefix: str, dense: bool = True):
        self.c, self.prefix = c, prefix
        self.names = tuple(prefix + n for n in c.names if n != "X")
        self.B, self.L, self.d = c.out.shape
        self._f = self.Jx = None
        if dense:  # the walk's input Jacobian (B, L·d, L·d), from the input's factors alone; products need none
            self.Jx = jacobian_factors(dataclasses.replace(c, names=("X",))).J["X"].dense()

    @property
    def f(self):
        """The block's :class:`~blockhess.block.Factors` (every variable of the cache's), formed on
        first use and kept until :meth:`release`."""
        if self._f is None:
            self._f = jacobian_factors(self.c)
        return self._f

    def release(self) -> None:
        """Drop the factors (the walk is done with this stage's variables; ``Jx`` is kept)."""
        self._f = None

    def grad_in(self, g: torch.Tensor) -> torch.Tensor:
        """The gradient at the block's input, :math:`J_x^\top g` ``(B, L, d)``, for ``g`` ``(B, L, d)``
        at its output: the block's pass back :func:`blockhess.block.directional.vjp` of one adjoint,
        no weight's rows (no Jacobian formed)."""
        return vjp(self.c, g[None], wanted=(), input_adjoint=True)[1][0]

    def vjp(self, W: torch.Tensor, names, summed: bool = False) -> dict:
        return dict(self.vjps(W, names, summed))

    def vjps(self, W: torch.Tensor, names, summed: bool = False, into=None):
        """:meth:`vjp` one variable at a time, ``(name, value)`` in the order of ``names`` as each is
        asked for: the rows are laid out token-major once for all of them
        (:func:`blockhess.kronecker.token_rows`) and taken through the factors in chunks
        (:func:`blockhess.kronecker.vjp_rows`); a later, no larger variable whose factors share every
        per-token matrix with this one's (its bias) is formed with it and kept until its turn.
        ``into(name)``: ``None`` or ``(view, add)`` where the value goes
        (:meth:`blockhess.result.BlockSum.slot`); a value written there is yielded as ``None``."""
        B, R = W.shape[:2]
        wt = token_rows(W.reshape(B, R, self.L, self.d))
        k = len(self.prefix)
        F = {n: self.f.J[n[k:]] for n in names}
        mats = {n: {id(leaf.mat) for leaf in _token_leaves(F[n])} for n in names}
        kept = {}
        for i, n in enumerate(names):
            if n not in kept:
                group = [n] + [m for m in names[i + 1:] if m not in kept and mats[m] and mats[m] <= mats[n]
                               and F[m].numel <= F[n].numel]
                outs = [None if into is None else into(m) for m in group]
                vals = vjp_rows([F[m] for m in group], wt, B, summed, outs)
                kept.update((m, None if o is not None else v) for m, o, v in zip(group, outs, vals))
            yield n, kept.pop(n)

    def back(self, W: torch.Tensor) -> torch.Tensor:
        return W @ self.Jx

    def fwd(self, G: torch.Tensor) -> torch.Tensor:
        return self.Jx @ G

    def curv(self, g: torch.Tensor, names, acc=None):
        """``(XX, Xθ)`` of the block: the second derivatives with its input ``X``, per sequence
        (:func:`blockhess.block.contract_output` with ``X`` a variable); with ``acc`` its weights'
        pairs too, summed over the batch and written there where they lie (as :meth:`weight_pairs`)."""
        k = len(self.prefix)
        local = ("X",) + tuple(n[k:] for n in names)
        shapes = {"X": (self.B, self.L, self.d), **param_shapes(self.c.cfg)}
        xs = BlockSum(("X",) + tuple(n[k:] for n in self.names), shapes, wanted=local, per_sequence=True)
        with_x = InputSplitSum(HeadSplitSum(xs, self.c.cfg),
                               None if acc is None else HeadSplitSum(acc, self.c.cfg, self.prefix))
        contract_output(self.c, g.reshape(self.B, self.L, self.d), self.f, with_x)
        with_x.finish()
        m = self.L * self.d
        XX = xs.blocks.get(("X", "X"))
        Xt = {self.prefix + b: v.reshape(self.B, m, -1) for (a, b), v in xs.blocks.items() if a == "X" and b != "X"}
        return XX, Xt

    def weight_pairs(self, g: torch.Tensor, names, acc) -> None:
        """Add the block's second derivatives among its variables (those of ``names`` that ``acc``
        wants), contracted with the gradient ``g`` ``(B, L·d)`` at its output and summed over the
        batch (Theorem 5, :func:`blockhess.block.contract_output`), to ``acc`` (the model's dense
        :class:`~blockhess.result.BlockSum` over the public names), each block where it lies. The
        block's factors are formed for it (:attr:`f`) and dropped after."""
        if not names:
            return
        weights = InputSplitSum(None, HeadSplitSum(acc, self.c.cfg, self.prefix))
        contract_output(self.c, g.reshape(self.B, self.L, self.d), self.f, weights)
        weights.finish()
        self.release()


class OutputLoss:
    """The loss at the output ``z`` ``(B, P, C)`` with its gradient and Hessian from
    :func:`blockhess.losses.derivatives` (per-token, or a callable's dense ``(P·C)²`` per sequence)."""

    names: tuple[str, ...] = ()

    def __init__(self, ld: losses.LossDerivatives):
        self.ld = ld

    def omega(self, dz: torch.Tensor) -> torch.Tensor:
        """The loss Hessian along output tangents ``dz`` ``(k, B, P, C)``: ``Ω ż``, same shape."""
        k, B, P, C = dz.shape
        if self.ld.per_token:
            return torch.einsum("btac,kbtc->kbta", self.ld.hess.reshape(B, P, C, C), dz)
        return torch.einsum("bij,kbj->kbi", self.ld.hess, dz.reshape(k, B, P * C)).reshape(dz.shape)

    def gradient(self) -> torch.Tensor:
        """The loss gradient at the output, ``(B, P·C)``."""
        return self.ld.grad.reshape(self.ld.grad.shape[0], -1)

    def start(self, names, outer: bool, functional: bool):
        """``(Psi (B, m, m), {}, g (B, m))`` at the output: the loss Hessian (``outer``) or zero."""
        g = self.ld.grad
        B, P, C = g.shape
        m = P * C
        if not outer:
            Psi = g.new_zeros(B, m, m)
        elif self.ld.per_token:
            eye = torch.eye(P, dtype=g.dtype, device=g.device)
            Psi = torch.einsum("btac,ts->btasc", self.ld.hess.reshape(B, P, C, C), eye).reshape(B, m, m)
        else:
            Psi = self.ld.hess
        return Psi, [], {}, self.gradient()


class SoftmaxHead:
    r"""The head ``z_t = h_t W + b`` with the cross-entropy on top, in closed form per row ``t``:
    :math:`p_t = \mathrm{softmax}(z_t)`, :math:`g_t = (p_t - e_{y_t})/N`,
    :math:`\Omega_t = (\mathrm{diag}\,p_t - p_t p_t^\top)/N` (``N`` rows counted in the batch mean), applied
    through :math:`W\Omega_t = p_t \odot (W - W p_t)/N` so that no ``C × C`` matrix is formed. A row of
    target ``-100`` is not counted: its ``p_t`` and ``e_{y_t}`` are taken as zero, so are its ``g_t`` and ``Ω_t``.
    ``h`` ``(B, P, d)``, ``W`` ``(d, C)`` (named ``names[0]``), ``b`` ``(C,)`` or ``None``, ``y`` ``(B, P)``."""

    def __init__(self, h, W, b, y, count: int, names: tuple[str, ...]):
        self.h, self.W, self.names = h, W, names
        z = h @ W + (b if b is not None else 0)
        self.p = torch.softmax(z, -1)
        self.N = count
        keep = y != losses.IGNORE
        onehot = torch.nn.functional.one_hot(y.clamp(min=0), W.shape[1]).to(h.dtype)
        if not bool(keep.all()):  # an ignored row's p zeroed: its g and Ω (linear and quadratic in p) vanish
            w = keep.to(h.dtype)[..., None]
            self.p, onehot = self.p * w, onehot * w
        self.g = (self.p - onehot) / count  # (B, P, C)
        self._qs = self._gram = None  # W p_t and the per-row W Ω_t Wᵀ, when first needed (:meth:`through`)
        self._through_columns, self._gram_refused = 0, False
        self._through_promised = 0  # the columns through the head known to come in all (:meth:`expect`)

    def expect(self, columns: int) -> None:
        """A hint that at least ``columns`` more columns will cross the head by :meth:`through` (a lock-step
        estimator's plan): the break-even of :meth:`_gram_due` is judged on the larger of the columns through
        so far and those plus the promised, so that a plan past it forms the per-row matrices at the first
        pass instead of after ``f·d/2`` columns on the chunked pass. Results do not depend on it beyond the
        two paths' rounding."""
        self._through_promised = max(self._through_promised, self._through_columns + int(columns))

    def omega(self, dz: torch.Tensor) -> torch.Tensor:
        """``Ω ż = (p ⊙ ż − p (p·ż))/N`` per row for logit tangents ``dz`` ``(k, B, P, C)`` (three passes:
        ``u = (p/N) ⊙ ż``, its row sums, ``u − p Σu``)."""
        u = torch.mul(dz, self.p).div_(self.N)
        return u.addcmul_(self.p, u.sum(-1, keepdim=True), value=-1)

    def through(self, dx: torch.Tensor) -> torch.Tensor:
        r"""The head's part of the outer product for tangents ``dx`` ``(k, B, P, d)`` at ``h`` that carry no
        direction of the head's own variables: :math:`\dot g_h = W\Omega_t W^\top \dot h_t` per row, ``(k, B,
        P, d)``. Without forming the logit tangents' ``(k, B, P, C)`` tensor: :math:`\dot h W` is taken ``C``
        by ``C`` (a column chunk at a time, about :data:`THROUGH_CHUNK_BYTES` of it, scaled by ``p/N`` and
        multiplied back by ``Wᵀ`` into the sum), and the rank-one term in ``h``'s space, :math:`p_t\cdot\dot
        z_t = \dot h_t\cdot q_t` with :math:`q_t = W p_t` (docs/derivations.md §18, "The head's pass").
        Once the columns through it have cost as much as forming them would, or :meth:`expect` has promised
        that many, the per-row ``d × d`` matrices :math:`W\Omega_t W^\top` are formed (where they fit in
        memory) and used from then on (:meth:`gram`)."""
        k, B, P, d = dx.shape
        C = self.W.shape[1]
        rows = dx.reshape(k, B * P, d)
        if self._gram is None and self._gram_due(k):
            self._gram = self.gram()
        if self._gram is not None:  # (B P, d, d) per row, symmetric
            return torch.einsum("tij,ktj->kti", self._gram, rows).reshape(k, B, P, d)
        q = self._q()
        # −(ḣ·q) q / N, contiguous (from contiguous factors): the rows' sum below starts from it
        out = torch.mul(torch.einsum("ktd,td->kt", rows, q).contiguous()[..., None], q).div_(-self.N)
        pN = self.p.reshape(B * P, C) / self.N
        R = k * B * P
        step = max(256, min(C, THROUGH_CHUNK_BYTES // max(1, R * dx.element_size())))
        if step < C:  # the chunk's rows a whole number of cache lines (as heap.aligned_rows': the GEMM's stores)
            step -= step % max(1, ROW_ALIGN_BYTES // dx.element_size())
        flat = rows.reshape(R, d)
        acc = out.view(R, d)
        for c0 in range(0, C, step):
            c1 = min(C, c0 + step)
            Wc = self.W[:, c0:c1]
            buf = gemm.mm(flat, Wc)
            buf.view(k, B * P, c1 - c0).mul_(pN[:, c0:c1])
            acc = gemm.addmm(acc, buf, Wc.T)
        return acc.view(k, B, P, d)

    def _q(self) -> torch.Tensor:
        """``q_t = W p_t`` ``(B P, d)``, once."""
        if self._qs is None:
            self._qs = self.p.reshape(-1, self.W.shape[1]) @ self.W.T
        return self._qs

    def _gram_due(self, k: int) -> bool:
        """Whether the per-row matrices should be formed now: the columns through the head so far (``k`` of
        them now) have cost ``2·C·d`` multiply-adds a row each, forming them costs ``f·C·d²`` a row (``f`` =
        :func:`_gram_share`, their upper block triangle: 5/8 where :data:`GRAM_BLOCKS` divides ``d``; the
        break-even at ``f·d/2``
        columns: never more than twice the cheaper choice's cost, whatever the number of products to come;
        at once where :meth:`expect` promised that many), and ``(B P, d, d)`` of the dtype fits in half the
        memory available."""
        self._through_columns += k
        d = self.W.shape[0]
        if max(self._through_columns, self._through_promised) < _gram_share(d) * d / 2 or self._gram_refused:
            return False
        nbytes = self.p.shape[0] * self.p.shape[1] * d * d * self.p.element_size()
        try:
            check_fits(2 * nbytes, "the head's per-row matrices", self.p.device)
        except MemoryError:
            self._gram_refused = True
            return False
        return True

    def gram(self) -> torch.Tensor:
        r"""The per-row matrices :math:`W\Omega_tW^\top = (W\,\mathrm{diag}(p_t)\,W^\top - q_tq_t^\top)/N`
        ``(B P, d, d)`` (symmetric; rows of target ``-100`` are zero), summed over column chunks of ``C``: the
        products for the upper block triangle only (:data:`GRAM_BLOCKS` block rows), the lower mirrored."""
        d, C = self.W.shape
        p = self.p.reshape(-1, C)
        q = self._q()
        M = torch.einsum("ti,tj->tij", q, -q)
        bs = -(-d // GRAM_BLOCKS)
        step = max(256, min(C, THROUGH_CHUNK_BYTES // (d * self.p.element_size())))
        for c0 in range(0, C, step):
            Wc = self.W[:, c0:c0 + step]
            for t in range(p.shape[0]):
                S = Wc * p[t, c0:c0 + step]
                for i0 in range(0, d, bs):  # block row i0: its diagonal block and those right of it
                    M[t, i0:i0 + bs, i0:].addmm_(S[i0:i0 + bs], Wc[i0:].T)
        for i0 in range(bs, d, bs):  # the blocks left of the diagonal: the transposes of those above it
            M[:, i0:i0 + bs, :i0] = M[:, :i0, i0:i0 + bs].transpose(1, 2)
        return M.div_(self.N)

    def head(self) -> "HeadStage":
        """The head as a plain stage (for products: its tangents and second-order adjoints)."""
        return HeadStage(self.h, self.W, self.names)

    def gradient(self) -> torch.Tensor:
        """The loss gradient at the head's input ``h``, ``(B, P·d)``: ``g Wᵀ`` per row."""
        return torch.einsum("btc,ic->bti", self.g, self.W).reshape(self.h.shape[0], -1)

    def start(self, names, outer: bool, functional: bool):
        r"""``(Psi_h, later, H, g_h)`` at the head's input: ``Psi_h`` ``(B, P·d, P·d)``, the rows of
        :math:`\partial^2\ell/\partial h\,\partial\theta` for the head's variables in ``names``
        (``[(name, rows (B, n, P·d))]``), their Hessian blocks ``{(a, b): block}`` and the gradient at ``h``."""
        h, W, p, g, N = self.h, self.W, self.p, self.g, self.N
        B, P, d = h.shape
        C = W.shape[1]
        w_name = self.names[0]
        b_name = self.names[1] if len(self.names) > 1 else None
        A = p[:, :, None, :] * (W - torch.einsum("ic,btc->bti", W, p)[..., None]) / N  # (B, P, d, C): W Omega_t
        eye_t = torch.eye(P, dtype=h.dtype, device=h.device)
        Psi = (torch.einsum("btic,jc,ts->btisj", A, W, eye_t).reshape(B, P * d, P * d) if outer
               else h.new_zeros(B, P * d, P * d))
        rows, H = [], {}
        if w_name in names:
            Kw = h.new_zeros(B, d, C, P, d)
            if outer:
                Kw += torch.einsum("btic,btj->bjcti", A, h)
            if functional:
                Kw += torch.einsum("ij,btc->bjcti", torch.eye(d, dtype=h.dtype, device=h.device), g)
            rows.append((w_name, Kw.reshape(B, d * C, P * d)))
        if b_name in names:
            rows.append((b_name, (A.permute(0, 3, 1, 2) if outer else A.new_zeros(B, C, P, d)).reshape(B, C, P * d)))
        if outer:
            pf, hf = p.reshape(B * P, C), h.reshape(B * P, d)
            if w_name in names:
                Hw = h.new_zeros(d, C, d, C)
                torch.diagonal(Hw, 0, 1, 3).copy_(torch.einsum("ti,tj,ta->ija", hf, hf, pf) / N)
                u = (hf[:, :, None] * pf[:, None, :]).reshape(B * P, d * C)
                H[(w_name, w_name)] = Hw.reshape(d * C, d * C) - u.T @ u / N
            if b_name in names:
                H[(b_name, b_name)] = torch.diag(pf.sum(0) / N) - pf.T @ pf / N
            if w_name in names and b_name in names:
                Hwb = h.new_zeros(d, C, C)
                torch.diagonal(Hwb, 0, 1, 2).copy_(hf.T @ pf / N)
                H[(w_name, b_name)] = (Hwb - torch.einsum("ti,ta,tc->iac", hf, pf, pf) / N).reshape(d * C, C)
        return Psi, rows, H, self.gradient()
