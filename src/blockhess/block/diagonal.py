r"""The exact diagonal of a block's loss Hessian in closed form, no sampling (docs/derivations.md §19).

For a weight entry :math:`w`, :math:`\mathrm{diag}(H)_w = e_w^\top H e_w`. Every map after the attention
scores acts token by token and the loss of MSE and CE is a sum over tokens, so the Hessian of the loss
w.r.t. any per-token node ``N`` of the chain (LN_2's input, the FFN's pre-activation, the attention
output, ...) is block-diagonal over tokens: one ``d × d`` matrix :math:`M^N_t` per token, walked down
the stages as in :mod:`.second_order`,

.. math::
    M^{in}_t = E_t^\top M^{out}_t E_t + \Gamma_t ,

``E_t`` the stage's per-token Jacobian and :math:`\Gamma_t` its curvature contracted with the cached
adjoint (:func:`blockhess.block.directional.adjoints`). A weight that enters a node linearly with a
per-token factor, ``N_t = x_t W`` (so :math:`\partial N_{t,j}/\partial W_{ij} = x_{t,i}`), has
:math:`\mathrm{diag}(H)_{ij} = \sum_t x_{t,i}^2\, M^N_{t,jj}`: one GEMM over tokens. The attention's
weights reach token ``t``'s output only through its own attention row, so their diagonal is
:math:`\sum_t J_{t,w}^\top M^O_t J_{t,w}` with the per-token Jacobians of the heads' output ``O`` (the
softmax Jacobian :math:`S_t = \mathrm{diag}(a_t) - a_t a_t^\top`: :math:`V^\top S_t K` for ``W_Q``,
:math:`V^\top S_t X` for ``W_K``, :math:`(AX)_t` for ``W_V``), plus the attention's own second derivative
along :math:`e_w` (the softmax curvature, and for the pre-LN ``gamma_1, beta_1`` the bilinear ``Q K^T``
and ``A V`` terms), each a sum over the key tokens written as GEMMs. ``outer`` alone starts the walk with
the loss Hessian and drops every :math:`\Gamma` and own term (Gauss–Newton); ``functional`` alone starts
it with zero: outer + functional = full exactly, as for :func:`blockhess.hessian`.

The per-token matrices are formed in chunks of query tokens of one sequence at a time
(:func:`work_entries`, checked before any allocation). Cost and memory: docs/derivations.md §19.
"""

from __future__ import annotations


import torch

from .. import losses
from ..config import param_shapes
from ..layers import layernorm
from ..layers.linear import add
from ..validation import check_bool, check_fits
from . import assembled
from .forward_pass import Cache, pre_ln, refuse_llama

__all__ = ["block_diagonal", "diagonal", "work_entries"]

#: the tokens of one chunk hold at most this many bytes of per-token matrices (or one token's worth)
CHUNK_BYTES = 256 << 20

_ATTN = ("W_Q", "b_Q", "W_K", "b_K", "W_V", "b_V", "W_O", "b_O")


def work_entries(cfg, L: int, n: int) -> int:
    r"""An upper estimate of the tensor entries :func:`diagonal` holds at once for a chunk of ``n``
    query tokens of a sequence of ``L`` tokens (its results and the caller's cache and adjoints not
    included). Per token, with ``d`` the width, ``d_ff`` the FFN width and ``d_v = d / H``: a dozen
    ``d × d`` matrices (the curvatures at each level, ``G = W_1 diag(a') W_2``, its products, the
    pre-LN ``gamma_1, beta_1`` Jacobians and their products) and two ``d × d_ff`` (``W_1 diag(a')`` and
    ``W_2 M_S``); per head ``V^T S_t X`` and its product (``2 d_v d``) and six rows of ``L``; per sequence
    the key-side Khatri–Rao products ``V_s ⊗ X_s`` (``L d_v d``) and ``V_s ⊗ K_s``, and eight rows of ``d``
    per key for the pre-LN ``gamma_1`` terms."""
    d, H = cfg.d_model, cfg.n_heads
    dv, dk = d // H, cfg.head_dim
    ff = cfg.d_ff if cfg.kind == "block" else 0
    per = 12 * d * d + 2 * d * ff + 2 * dv * d + 6 * L + 4 * d
    return n * per + L * dv * (d + dk) + 8 * L * d


def _diag(M, n: int, d: int, like: torch.Tensor):
    """The diagonals ``(n, d)`` of per-token curvatures ``M``: ``None`` (zero), a float (``M·I``) or
    ``(n, d, d)``."""
    if M is None:
        return None
    if isinstance(M, float):
        return like.new_full((n, d), M)
    return torch.diagonal(M, dim1=-2, dim2=-1)


def _dense(M, n: int, d: int, like: torch.Tensor):
    """Per-token curvatures ``M`` as ``(n, d, d)`` (a float ``M·I`` formed; ``None`` and tensors as they are)."""
    if M is None or not isinstance(M, float):
        return M
    return torch.diag_embed(like.new_full((n, d), M))


def _ln_left(y: torch.Tensor, r: torch.Tensor, gamma, X: torch.Tensor, scale: float = 1.0,
             inplace: bool = False) -> torch.Tensor:
    r"""``J^T X`` for LayerNorm's per-token Jacobian :math:`J = \mathrm{diag}(\gamma)\,r\,(C - y y^\top/d)`
    (``y`` ``(n, d)`` the normalised rows, ``r`` ``(n, 1)``), ``X`` ``(n, d, m)``, without forming ``J``:
    :math:`C - yy^\top/d` is symmetric, so :math:`J^\top X = r\,(X' - \mathbf 1\bar x'^\top - y (y^\top X')/d)`
    with :math:`X' = \mathrm{diag}(\gamma) X` (``Σ y = 0``), times ``scale``. A new tensor, or ``X``
    overwritten with ``inplace``."""
    d = y.shape[-1]
    if inplace:
        P = X if gamma is None else X.mul_(gamma[:, None])
    else:
        P = gamma[:, None] * X if gamma is not None else X.clone()
    P.sub_(P.mean(-2, keepdim=True))
    P.baddbmm_(y[:, :, None], y[:, None, :] @ P, alpha=-1.0 / d)
    return P.mul_(r[:, :, None] * scale)


def _ln_sandwich(y, r, gamma, M, inplace: bool = False):
    """``J^T M J`` for LayerNorm's per-token Jacobian (:func:`_ln_left`) and symmetric ``M`` ``(n, d, d)``
    (overwritten with ``inplace``)."""
    left = _ln_left(y, r, gamma, M, inplace=inplace)
    return _ln_left(y, r, gamma, left.transpose(1, 2), inplace=True).transpose(1, 2)


#: row blocks of a symmetric product computed (its lower block triangle, mirrored): (1 + 1/SYM_BLOCKS)/2 of the work
SYM_BLOCKS = 8


def _rows_product(left, right) -> torch.Tensor:
    """``left @ right`` for ``left`` ``(n, d, m)`` given as a callable ``rows -> left[:, rows]`` (formed
    block by block, in cache) and ``right`` ``(m, d)``, in the row blocks of :func:`_sym`."""
    d = right.shape[-1]
    edges = [round(i * d / SYM_BLOCKS) for i in range(SYM_BLOCKS + 1)]
    out = None
    for r0, r1 in zip(edges, edges[1:]):
        if r1 > r0:
            blk = left(slice(r0, r1)) @ right
            if out is None:
                out = blk.new_empty(blk.shape[0], d, d)
            out[:, r0:r1] = blk
    return out


def _sym(left, right) -> torch.Tensor:
    """``left @ right`` for ``left`` ``(n, d, m)`` (a tensor, or a callable ``rows -> left[:, rows]``,
    contiguous) and ``right`` ``(m, d)`` or ``(n, m, d)`` whose product is known to be symmetric: the
    row blocks' products with the columns up to the block's end, the rest mirrored."""
    rows = left if callable(left) else (lambda sl: left[:, sl])
    d = right.shape[-1]
    edges = [round(i * d / SYM_BLOCKS) for i in range(SYM_BLOCKS + 1)]
    out = None
    for i in range(SYM_BLOCKS):
        r0, r1 = edges[i], edges[i + 1]
        if r1 == r0:
            continue
        blk = rows(slice(r0, r1)) @ right[..., :r1]
        if out is None:
            out = blk.new_empty(blk.shape[0], d, d)
        out[:, r0:r1, :r1] = blk
        out[:, :r0, r0:r1] = blk[:, :, :r0].transpose(1, 2)
    return out


class _Acc:
    """The diagonals being summed: name -> tensor of the parameter's shape, for the wanted names."""

    def __init__(self, shapes: dict, wanted: tuple, like: torch.Tensor):
        self.out = {n: like.new_zeros(shapes[n]) for n in wanted}
        self.sums = None

    def wants(self, *names) -> bool:
        return any(n in self.out for n in names)

    def beta_sums(self, S0, S1, S2):
        """Add to the sums over tokens of ``M^O_t``, ``M^O_t C_t`` and ``C_tᵀ M^O_t C_t`` (``C_t`` the heads'
        ``s Vᵀ S_t K`` block-diagonal): pre-LN ``beta_1``'s outer-like part, finished by :meth:`finish`."""
        if self.sums is None:
            self.sums = [S0, S1, S2]
        else:
            for acc, v in zip(self.sums, (S0, S1, S2)):
                acc += v

    def finish(self, p: dict) -> dict:
        r"""The diagonals, ``beta_1``'s with :math:`\mathrm{diag}(W_V S_0 W_V^\top + 2 W_V S_1 W_Q^\top + W_Q S_2 W_Q^\top)`."""
        if self.sums is not None:
            S0, S1, S2 = self.sums
            W_Q, W_V = p["W_Q"], p["W_V"]
            self.out["beta_1"] += ((W_V @ S0) * W_V).sum(1) + 2 * ((W_V @ S1) * W_Q).sum(1) + ((W_Q @ S2) * W_Q).sum(1)
        return self.out

    def add(self, name: str, value, index=None):
        if value is None or name not in self.out:
            return
        if index is None:
            self.out[name] += value
        else:
            self.out[name][index] += value


def _sq_gemm(x: torch.Tensor, m) -> torch.Tensor | None:
    r""":math:`\sum_t x_{t,i}^2 m_{t,j}`: ``(x²)ᵀ m``, ``x`` ``(n, a)``, ``m`` ``(n, b)`` or ``None``."""
    return None if m is None else (x * x).T @ m


def _ffn_stage(c: Cache, a, acc: _Acc, s: slice, M_S, fun: bool, eps: float, below: bool):
    """The FFN (and pre-LN LN_2) weights' diagonals from the curvature ``M_S`` at the FFN's output
    for tokens ``s``; with ``below``, returns the curvature at its input ``Y`` (pre-LN: the residual
    sum ``U``), else ``None``."""
    p, fc = c.params, c.fc
    pre = pre_ln(c.cfg)
    D = fc.D[s]
    n, d = D.shape[0], c.cfg.d_model
    like = D
    W_1, W_2 = p["W_1"], p["W_2"]
    dMS = _diag(M_S, n, d, like)
    acc.add("W_2", _sq_gemm(fc.h[s], dMS))
    acc.add("b_2", None if dMS is None else dMS.sum(0))
    psi = a.fc.g_h[s] * fc.D2[s] if fun and fc.D2 is not None else None
    if M_S is None:
        dMh = None
    elif isinstance(M_S, float):
        dMh = (M_S * (W_2 * W_2).sum(1)).expand(n, -1)
    else:
        dMh = ((W_2 @ M_S) * W_2).sum(-1)  # diag(W_2 M_S W_2^T), (n, d_ff)
    dMH = add(None if dMh is None else D * D * dMh, psi)
    acc.add("W_1", _sq_gemm(fc.Yf[s], dMH))
    acc.add("b_1", None if dMH is None else dMH.sum(0))
    if not below:
        return None
    # the curvature at the FFN input: J_SY = I + G^T J_f, G = W_1 diag(a') W_2 (J_f = LN_2's, pre-LN; I post-LN)
    G = GM = M_Yf = None
    scalar = isinstance(M_S, float)
    if M_S is not None:
        G = _rows_product(lambda rows: W_1[None, rows] * D[:, None, :], W_2)
        GM = G if scalar else G @ M_S  # times M_S (a float: applied below)
        M_Yf = _sym(GM, G.transpose(1, 2))
        if scalar:
            M_Yf.mul_(M_S)
    if psi is not None:  # the activation's curvature W_1 diag(ψ) W_1^T
        gW = _sym(lambda rows: W_1[None, rows] * psi[:, None, :], W_1.T)
        M_Yf = gW if M_Yf is None else M_Yf.add_(gW)
    if pre:
        n2, r2, g2 = fc.n[s], fc.r[s], p.get("gamma_2")
        _ln_weights(acc, 2, n2, M_Yf)
        cross = None if GM is None else _ln_left(n2, r2, g2, GM, M_S if scalar else 1.0, inplace=True)
        inner = None if M_Yf is None else _ln_sandwich(n2, r2, g2, M_Yf, inplace=True)
        gam = layernorm.contract_hessian_unchecked(fc.Y[s], a.fc.g_Yf[s], eps, g2) if fun else None
    else:
        cross, inner, gam = (GM.mul_(M_S) if scalar else GM) if GM is not None else None, M_Yf, None
    M_Y = gam if inner is None else (inner if gam is None else inner.add_(gam))  # new tensors: the rest added in place
    if cross is not None:
        M_Y = cross + cross.transpose(1, 2) if M_Y is None else M_Y.add_(cross).add_(cross.transpose(1, 2))
    if isinstance(M_S, float):
        M_Y.diagonal(dim1=1, dim2=2).add_(M_S)
    else:
        M_Y = add(M_Y, M_S)
    return M_Y


def _ln_weights(acc: _Acc, i: int, y: torch.Tensor, M):
    """``gamma_i``, ``beta_i`` of a LayerNorm ``γ ⊙ y + β`` from the curvature ``M`` at its output."""
    dM = _diag(M, y.shape[0], y.shape[1], y)
    if dM is not None:
        acc.add(f"gamma_{i}", (y * y * dM).sum(0))
        acc.add(f"beta_{i}", dM.sum(0))


def _attention_stage(c: Cache, a, acc: _Acc, b: int, t: slice, M_P, fun: bool):
    """The attention weights' diagonals (and pre-LN ``gamma_1, beta_1``) for the query tokens ``t``
    of sequence ``b``, from the curvature ``M_P`` ``(n, d, d)`` (or ``None``) at the attention output."""
    cfg, p, att = c.cfg, c.params, c.att
    H, d = cfg.n_heads, cfg.d_model
    dv, dk = d // H, cfg.head_dim
    s = att.scale
    F = att.F[b, t]
    n = F.shape[0]
    like = F
    dMP = _diag(M_P, n, d, like)
    acc.add("W_O", _sq_gemm(F, dMP))
    acc.add("b_O", None if dMP is None else dMP.sum(0))
    M_P = _dense(M_P, n, d, like)
    M_O = M_P
    if cfg.out_proj and M_P is not None:
        W_O = p["W_O"]
        M_O = _sym((M_P @ W_O.T).transpose(1, 2), W_O.T)  # W_O M_P W_O^T
    pre = pre_ln(cfg)
    want_ln = pre and acc.wants("gamma_1", "beta_1")
    want_qk = acc.wants("W_Q", "b_Q", "W_K") or want_ln
    Xa = att.X[b]  # (L, d): the attention's input
    A4 = att.A if att.A.ndim == 4 else att.A[:, None]
    n1 = c.ln1[0].reshape(c.X.shape)[b] if want_ln else None
    kv = slice(0, t.stop) if cfg.causal else slice(None)  # the keys the queries t see
    Xk, n1k = Xa[kv], None if n1 is None else n1[kv]
    Jg = MC = None
    if want_ln and M_O is not None:
        if "gamma_1" in acc.out:
            Jg = like.new_empty(n, d, d)
        if "beta_1" in acc.out:
            MC, Cs = like.new_empty(n, d, H * dk), []  # M_O C (heads' blocks side by side), each head's C_t
    for h in range(H):
        qk, cols = slice(h * dk, (h + 1) * dk), slice(h * dv, (h + 1) * dv)
        A = A4[b, h, t, kv]  # (n, keys)
        Q, K, V = att.Q[b, :, qk], att.K[b, kv, qk], att.V[b, kv, cols]
        O = F[:, cols]
        AX = A @ Xk
        Moh = None if M_O is None else M_O[:, cols, cols]
        dMo = None if Moh is None else torch.diagonal(Moh, dim1=-2, dim2=-1)
        if dMo is not None:
            acc.add("W_V", _sq_gemm(AX, dMo), (slice(None), cols))
            live = None if att.mask is None else att.mask.expand(*att.A.shape[:1], *att.mask.shape[-2:])[b, t].any(-1)
            acc.add("b_V", (dMo if live is None else dMo * live.to(dMo.dtype)[:, None]).sum(0), cols)  # empty rows: 0
        if not want_qk:
            continue
        L = K.shape[0]  # the keys seen
        w = a.att.gT[b, h, t, kv] if fun else None  # the scores' adjoint A ⊙ (g_A - rowmean): (n, L)
        Ct = None
        eQ = None
        if Moh is not None:  # C_t = s V^T S_t K, (n, d_v, d_k)
            Ct = ((A @ (V[:, :, None] * K[:, None, :]).reshape(L, dv * dk)).reshape(n, dv, dk)
                  - O[:, :, None] * (A @ K)[:, None, :]) * s
            eQ = ((Moh @ Ct) * Ct).sum(-2)
        if w is not None:
            delta = K * s
            eQ = add(eQ, w @ (delta * delta) - 2 * (A @ delta) * (w @ delta))
        if eQ is not None:
            acc.add("W_Q", _sq_gemm(Xa[t], eQ), (slice(None), qk))
            acc.add("b_Q", eQ.sum(0), qk)
        Nn = None
        eK = None
        Xn = n1k if want_ln else Xk  # pre-LN: V^T S_t n_1, and Xa = γ ⊙ n_1 + β gives V^T S_t Xa = (V^T S_t n_1) diag(γ)
        if Moh is not None and (acc.wants("W_K") or want_ln):
            Nn = ((A @ (V[:, :, None] * Xn[:, None, :]).reshape(L, dv * d)).reshape(n, dv, d)
                  - O[:, :, None] * (A @ Xn)[:, None, :])
            N = Nn if not want_ln or "gamma_1" not in p else Nn * p["gamma_1"]
            eK = ((Moh @ N) * N).sum(-2)
        if w is not None and acc.wants("W_K"):
            eK = add(eK, w @ (Xk * Xk) - 2 * AX * (w @ Xk))
        if eK is not None:
            acc.add("W_K", eK.T @ (Q[t] * Q[t] * (s * s)), (slice(None), qk))
        if not want_ln:
            continue
        WQ, WK, WV = p["W_Q"][:, qk], p["W_K"][:, qk], p["W_V"][:, cols]
        beta_t = (Q[t] @ WK.T) * s  # (n, d): q_t · W_K[i] / sqrt(d_k)
        nc = n1[t]
        An = A @ n1k
        if Jg is not None:
            CW = Ct @ WQ.T  # (n, d_v, d)
            Jg[:, cols] = nc[:, None, :] * CW + Nn * beta_t[:, None, :] + An[:, None, :] * WV.T[None]
        if MC is not None:
            MC[:, :, qk] = M_O[:, :, cols] @ Ct
            Cs.append(Ct)
        if w is not None:  # the attention's own second derivative along gamma_1[i], beta_1[i]
            alpha = (K @ WQ.T) * s  # (L, d): k_s · W_Q[i] / sqrt(d_k)
            wa, wn = w @ alpha, w @ n1k
            Aa = A @ alpha
            m = nc * Aa + beta_t * An
            sum_wdz2 = nc * nc * (w @ (alpha * alpha)) + 2 * nc * beta_t * (w @ (alpha * n1k)) + beta_t * beta_t * (w @ (n1k * n1k))
            sum_wdz = nc * wa + beta_t * wn
            t1 = 2 * s * (WQ * WK).sum(1) * nc * wn
            gOW = a.att.gO[b, h, t] @ WV.T
            t3 = 2 * gOW * (nc * (A @ (alpha * n1k)) + beta_t * (A @ (n1k * n1k)) - m * An)
            acc.add("gamma_1", (t1 + sum_wdz2 - 2 * m * sum_wdz + t3).sum(0))
            acc.add("beta_1", (w @ (alpha * alpha) - 2 * Aa * wa).sum(0))
    if Jg is not None:
        acc.add("gamma_1", ((M_O @ Jg) * Jg).sum((0, 1)))
    if MC is not None:  # beta_1: J_t = C_bd,t W_Q^T + W_V^T with fixed outer factors, so the sums over tokens go inside
        acc.beta_sums(M_O.sum(0), MC.sum(0),
                      torch.cat([(Cs[h].transpose(1, 2) @ MC[:, h * dv:(h + 1) * dv]).sum(0) for h in range(H)]))


def diagonal(c: Cache, a, omega, wanted, outer: bool = True, functional: bool = True) -> dict:
    r"""The exact diagonal of the loss Hessian of a block w.r.t. each of its weights in ``wanted``.

    ``c``: the :class:`~blockhess.block.Cache` of :func:`~blockhess.block.forward_cache` (any mode;
    ``plain=True`` suffices). ``a``: the :class:`~blockhess.block.directional.Adjoints` of the loss
    gradient at the output (:func:`~blockhess.block.directional.adjoints`); may be ``None`` with
    ``functional=False``. ``omega``: the loss Hessian w.r.t. the output, per token: a float ``c`` when it
    is ``c·I`` for every token (MSE), or a callable ``omega(b) -> (L, d, d)`` giving sequence ``b``'s
    per-token blocks (CE; batch mean included, as :func:`blockhess.losses.derivatives`); ignored with
    ``outer=False``. ``wanted``: names of :func:`~blockhess.config.param_shapes`. ``outer``,
    ``functional``: which part (both: the full Hessian's diagonal).

    Returns ``{name: tensor of the parameter's shape}`` in ``c.X``'s dtype and device (``b_K``'s exactly
    zero: softmax is shift-invariant). Exact almost everywhere (ReLU kinks, Lemma 1). Source:
    docs/derivations.md §19.

    Raises ``ValueError`` for a name not of the block, ``outer`` and ``functional`` not bools or both
    ``False``, ``a`` missing with ``functional=True``, ``omega`` neither a float nor callable with
    ``outer=True``; ``InsufficientMemoryError`` before any work if one chunk of tokens (a single token
    at least, :func:`work_entries`), with a sequence's ``omega(b)``, would not fit.
    """
    refuse_llama(c.cfg, "blockhess.block.diagonal.diagonal (the per-token walk; block_diagonal takes them)")
    check_bool("outer", outer)
    check_bool("functional", functional)
    if not (outer or functional):
        raise ValueError("outer and functional are both False: ask for at least one part of the Hessian")
    cfg = c.cfg
    shapes = {k: tuple(v) for k, v in param_shapes(cfg).items()}
    wanted = tuple(wanted)
    bad = [w for w in wanted if w not in shapes]
    if bad:
        raise ValueError(f"wanted must hold names of the block's weights {list(shapes)}, got {bad}")
    if functional and a is None:
        raise ValueError("a (the adjoints of the loss gradient, blockhess.block.adjoints) is required with functional=True")
    if outer and not (isinstance(omega, float) or callable(omega)):
        raise ValueError("omega must be a float (the per-token loss Hessian is omega·I) or a callable omega(b) -> "
                         f"(L, d, d) with outer=True, got {type(omega).__name__}")
    B, L, d = c.X.shape
    e = c.X.element_size()
    per = work_entries(cfg, L, 1) - work_entries(cfg, L, 0)
    n_chunk = max(1, min(L, CHUNK_BYTES // max(1, per * e)))
    seq_omega = L * d * d if outer and callable(omega) else 0  # a sequence's per-token loss Hessians (CE)
    check_fits((work_entries(cfg, L, n_chunk) + seq_omega) * e, f"the exact diagonal's per-token matrices for {n_chunk} "
               "tokens at a time", c.X.device)
    acc = _Acc(shapes, wanted, c.X)
    fun, eps = functional, cfg.ln_eps
    block = cfg.kind == "block"
    pre = pre_ln(cfg)
    needs_attn = acc.wants(*_ATTN) or (pre and acc.wants("gamma_1", "beta_1"))
    needs_ln1_post = block and not pre and acc.wants("gamma_1", "beta_1")
    needs_below_ffn = needs_attn or needs_ln1_post or (pre and acc.wants("gamma_2", "beta_2"))
    for b in range(B):
        om = None
        if outer:
            om = omega if isinstance(omega, float) else omega(b)
        for t0 in range(0, L, n_chunk):
            t = slice(t0, min(L, t0 + n_chunk))
            s = slice(b * L + t.start, b * L + t.stop)
            n = t.stop - t.start
            M = om if om is None or isinstance(om, float) else om[t]
            if block:
                if not pre:  # post-LN: Z = γ_2 ⊙ y_2 + β_2, y_2 = LN(S)
                    y2, r2 = c.ln2[0][s], c.r2[s]
                    _ln_weights(acc, 2, y2, M)
                    Md = _dense(M, n, d, c.X)
                    M = add(None if Md is None else _ln_sandwich(y2, r2, c.params.get("gamma_2"), Md),
                            layernorm.contract_hessian_unchecked(c.fc.S[s], a.gZ[s], eps, c.params.get("gamma_2"))
                            if fun else None)
                if not (needs_below_ffn or acc.wants("W_1", "b_1", "W_2", "b_2")):
                    continue
                M = _ffn_stage(c, a, acc, s, M, fun, eps, needs_below_ffn)
                if not needs_below_ffn:
                    continue
                if not pre:  # post-LN: Y = γ_1 ⊙ y_1 + β_1, y_1 = LN(U)
                    y1, r1 = c.ln1[0][s], c.r1[s]
                    _ln_weights(acc, 1, y1, M)
                    if not needs_attn:
                        continue
                    M = add(None if M is None else _ln_sandwich(y1, r1, c.params.get("gamma_1"), M),
                            layernorm.contract_hessian_unchecked(c.U[s], a.fc.g_Y[s], eps, c.params.get("gamma_1"))
                            if fun else None)
            if needs_attn:
                _attention_stage(c, a, acc, b, t, M, fun)
    return acc.finish(c.params)


def block_diagonal(c: Cache, a, loss, target, wanted, outer: bool = True, functional: bool = True) -> dict:
    """:func:`diagonal` with the loss Hessian of ``loss`` (``"mse"``: a float, the per-token ``c·I``;
    ``"ce"``: each sequence's per-token blocks, :func:`blockhess.losses.derivatives` of that sequence
    with the batch mean) at the output ``c.out``; ``target`` as :func:`blockhess.losses.check` returns
    it, with the batch axis. Raises ``NotImplementedError`` for a callable loss (its Hessian may couple
    tokens, so the per-token walk does not hold), and as :func:`diagonal`. A config with
    :attr:`~blockhess.config.BlockConfig.llama_options` takes :func:`blockhess.block.assembled.diagonal`
    (exact, from products; any loss)."""
    if getattr(c.cfg, "llama_options", ()):
        return assembled.diagonal(c, a, loss, target, wanted, outer, functional)
    B = c.X.shape[0]
    if not isinstance(loss, str):
        raise NotImplementedError("the exact diagonal needs a loss that is a sum over tokens ('mse' or 'ce'); a "
                                  "callable loss's Hessian may couple tokens: "
                                  "blockhess.operators.hutchinson_diagonal estimates it by sampling")
    omega = None
    if outer and loss == "mse":
        omega = float(losses.derivatives(loss, target[:1], c.out[:1], batch=B).hess[0, 0, 0])
    elif outer:
        def omega(b):
            return losses.derivatives(loss, target[b : b + 1], c.out[b : b + 1], batch=B).hess
    return diagonal(c, a, omega, wanted, outer, functional)
