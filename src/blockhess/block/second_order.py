r"""Theorem 5: the block's second derivatives contracted with an output weight, by a backward walk.

Every second derivative contracted with an output weight ``g`` (eq. 9, what the loss Hessian needs)
is a sum over the nodes of the block of (node input Jacobian)ᵀ (node's second derivative contracted
with its back-propagated gradient) (node input Jacobian). The block is a chain of *stages*
(attention, LN_1, FFN, LN_2 for post-LN; attention, FFN for pre-LN); walking it backwards with the
loss Hessian at each level, :math:`\Omega_{k-1} = E_k^\top\Omega_k E_k + \Gamma_k` (``E_k`` the stage's
per-token Jacobian, ``Γ_k`` its contracted input curvature, from the layer's ``contract_hessian``:
:mod:`blockhess.layers.protocol`), the Hessian block of a pair ``(θ, φ)`` whose later member ``φ``
enters at stage ``k`` is one Kronecker sandwich at the stage's output,
:math:`\sum_t F_{θ,t}^\top \Omega_k F_{φ,t}`, plus the stage's own cross term
:math:`\sum_t F^{in}_{θ,t}{}^\top \partial^2_{v\varphi}` (or its own second derivative when both
enter there). The outer (Gauss–Newton) term rides on the same pass (:func:`contract_output`).
Contracting with every basis vector gives the paper's dense layouts (:func:`second_derivative`,
:func:`dense_second_derivative`). Derivations and the paper's typos: docs/derivations.md §6, §10.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from ..config import BlockConfig, param_shapes
from ..kronecker import TokenKron
from ..layers import attention, ffn, layernorm
from ..layers.protocol import Contraction
from ..result import BlockSum, HeadSplitSum, InputSplitSum
from ..validation import check_fits, check_result
from . import forward_pass  # forward_pass.forward_cache looked up when called: one forward pass to replace in checks
from .first_order import Factors, attention_input_jacobian, jacobian_factors
from .forward_pass import Cache, check_forward, check_inputs, pre_ln, work_entries

__all__ = ["CONTRACT_BYTES", "Stage", "contract_output", "dense_second_derivative", "second_derivative"]


class Stage(NamedTuple):
    """One stage of the chain (docs/derivations.md §10)."""

    kind: str  # "attn", "ln1", "ffn", "ln2"
    inp: str | None  # level of the stage input
    out: str  # level of the stage output
    new: tuple[str, ...]  # internal names of the variables entering here
    E: torch.Tensor | None  # per-token Jacobian out/in (None: identity)


def _attn_internal(cfg: BlockConfig, names: tuple[str, ...]) -> tuple[str, ...]:
    """Internal names of the attention stage's variables, in processing order."""
    H = cfg.n_heads
    out = ["X"] if "X" in names else []
    for h in range(H):
        nm = attention.head_names(H, h)
        out += [nm["W_Q"]] + ([nm["b_Q"]] if "b_Q" in names else []) + [nm["W_K"]]
    out += [attention.head_names(H, h)["W_V"] for h in range(H)]
    out += [n for n in ("b_V", "W_O", "b_O") if n in names]
    if pre_ln(cfg):
        out += [n for n in ("gamma_1", "beta_1") if n in names]
    return tuple(out)


def _stages(c: Cache) -> list[Stage]:
    """The chain of stages of the block (post-LN: attention, LN_1, FFN, LN_2; pre-LN: attention, FFN)."""
    cfg, names = c.cfg, c.names
    st = [Stage("attn", None, "R", _attn_internal(cfg, names), None)]
    if cfg.kind == "attention":
        return st
    if cfg.norm == "post":
        st.append(Stage("ln1", "R", "Y", tuple(n for n in ("gamma_1", "beta_1") if n in names), c.E_Y))
        st.append(Stage("ffn", "Y", "S", tuple(n for n in ("W_1", "b_1", "W_2", "b_2") if n in names), c.J_SY))
        st.append(Stage("ln2", "S", "Z", tuple(n for n in ("gamma_2", "beta_2") if n in names), c.E_Z))
    else:
        st.append(Stage("ffn", "R", "Z", tuple(n for n in ("gamma_2", "beta_2", "W_1", "b_1", "W_2", "b_2") if n in names),
                        c.J_SY))
    return st



def _ln_stage(c: Cache, st: Stage, g: torch.Tensor) -> Contraction:
    """LN stage (post-LN) as a :class:`~blockhess.layers.protocol.Contraction`: input curvature Γ
    (:func:`blockhess.layers.layernorm.contract_hessian_unchecked`) and the ``(v, gamma)`` cross factor."""
    i = 1 if st.kind == "ln1" else 2
    X_in = c.U if i == 1 else c.fc.S
    gamma = c.params.get(f"gamma_{i}")
    Gam = layernorm.contract_hessian_unchecked(X_in, g, c.cfg.ln_eps, gamma)
    cross = {}
    if f"gamma_{i}" in st.new:
        J = (c.ln1 if i == 1 else c.ln2)[1]
        cross[f"gamma_{i}"] = [TokenKron("vector", None, J * g[:, None, :])]
    return Contraction(gamma=Gam, cross=cross, core={})


class _Later:
    """Stands for ``acc`` in a layer's ``contract_hessian``: the blocks it adds are kept and added
    to ``acc`` (a :class:`~blockhess.result.HeadSplitSum`) by :meth:`replay`, after the stage's
    sandwiches: each block's terms are summed in one fixed order, the walk's."""

    def __init__(self, acc):
        self.acc, self.calls = acc, []
        self.wants = acc.wants

    def add(self, a, b, value):
        self.calls.append((a, b, value, None))

    def add_diagonal(self, a, b, dim1, dim2, value):
        self.calls.append((a, b, value, (dim1, dim2)))

    def replay(self):
        for a, b, value, dims in self.calls:
            self.acc.add(a, b, value, dims)
        self.calls = []


def _walk(c: Cache, f: Factors, acc: HeadSplitSum, g, omega, start: str | None = None) -> None:
    """Add the Hessian blocks to ``acc``: outer term with per-token ``omega`` at the top level
    (``None``: none), functional term with gradient ``g`` (``(T, d)``; ``None``: none)."""
    stages = _stages(c)
    if start is not None:
        stages = stages[: [s.kind for s in stages].index(start) + 1]
    elif g is None:  # the outer term alone: J^T Ω_Z J with the output's factors (docs/derivations.md §10, float32)
        if omega is not None:
            order = tuple(n for s in stages for n in s.new)
            for j, phi in enumerate(order):
                for theta in order[: j + 1]:
                    if acc.wants(theta, phi):
                        acc.add_sandwich(theta, phi, f.lv["Z"][theta], f.lv["Z"][phi], omega)
        return
    earlier = {s.kind: tuple(n for t in stages[:k] for n in t.new) for k, s in enumerate(stages)}
    for st in reversed(stages):
        if st.kind == "attn":
            _attn_stage(c, f, acc, st, g, omega)
            return
        Fo, Fi = f.lv[st.out], f.lv[st.inp]
        Gam, cross, core = None, {}, {}
        own = _Later(acc)  # the blocks among the stage's own weights, added after its sandwiches
        if g is not None:
            con = ffn.contract_hessian(c.fc, g, own, st.new) if st.kind == "ffn" else _ln_stage(c, st, g)
            Gam, cross, core = con
        old = earlier[st.kind]
        for j, phi in enumerate(st.new):
            for theta in old + st.new[: j + 1]:
                if not acc.wants(theta, phi):
                    continue
                cr = core.get((theta, phi))
                if omega is not None or cr is not None:
                    acc.add_sandwich(theta, phi, Fo[theta], Fo[phi], omega if omega is not None else False, cr)
                if theta in old:
                    for part in cross.get(phi, ()):
                        acc.add_sandwich(theta, phi, Fi[theta], part)
        own.replay()
        E = st.E
        if omega is not None and E is not None:
            omega = E.transpose(1, 2) @ omega @ E
        if Gam is not None:
            omega = Gam if omega is None else omega + Gam
        if g is not None and E is not None:
            g = (E.transpose(1, 2) @ g[..., None])[..., 0]


def _attn_stage(c: Cache, f: Factors, acc: HeadSplitSum, st: Stage, g, omega) -> None:
    """Pairs of attention-stage variables: sandwiches at level R, the attention's own second
    derivatives, the ``(O, W_O)`` cross term, and the ``X`` / pre-LN ``gamma_1, beta_1`` terms."""
    cfg, p = c.cfg, c.params
    Fr, Fo = f.lv["R"], f.lv["O"]
    new = st.new
    if omega is not None:
        for j, phi in enumerate(new):
            for theta in new[: j + 1]:
                if acc.wants(theta, phi):
                    acc.add_sandwich(theta, phi, Fr[theta], Fr[phi], omega)
    if g is None:
        return
    d = cfg.d_model
    B, L = c.X.shape[:2]
    g_O = g @ p["W_O"].T if cfg.out_proj else g
    G = g_O.reshape(B, L, d)
    attention.contract_hessian(c.att, G, acc, c.names)
    if cfg.out_proj:  # P = O W_O: (O, W_O) cross term I ⊗ g_P^T
        T = g.shape[0]
        crossWO = TokenKron("right", g, torch.eye(d, dtype=g.dtype, device=g.device).expand(T, d, d))
        for theta in new:
            if theta in Fo and acc.wants(theta, "W_O"):
                acc.add_sandwich(theta, "W_O", Fo[theta], crossWO)
    pre = pre_ln(cfg)
    has = {n for n in ("X", "gamma_1", "beta_1") if n in new}
    if not has:
        return
    heads = [n for n in new if n not in ("X", "gamma_1", "beta_1", "b_V", "W_O", "b_O")]
    want_w = any(acc.wants(a, w) for a in has for w in heads)
    XX, XW = attention.contract_input_hessian(c.att, G, p["W_Q"], p["W_K"], p["W_V"], c.names, weights=want_w)
    n1 = c.ln1[0].reshape(B, L, d) if pre else None
    if "X" in has:
        if pre:
            J_a = c.ln1[1].reshape(B, L, d, d)
            if "gamma_1" in p:
                J_a = p["gamma_1"][:, None] * J_a
        for w in heads:
            if w in XW and acc.wants("X", w):
                v = XW[w]
                if pre:
                    v = torch.einsum("bmae,bma...->bme...", J_a, v)
                acc.add("X", w, v.reshape(*c.x_shape, *v.shape[3:]))
        if acc.wants("X", "X"):
            v = XX
            if pre:
                v = torch.einsum("bmae,bmanc,bncf->bmenf", J_a, XX, J_a)
                g_Xa = torch.einsum("blcma,blc->bma", attention_input_jacobian(c), G)  # gradient at the attention input
                Gam = layernorm.contract_hessian_unchecked(c.X, g_Xa, cfg.ln_eps, p.get("gamma_1"))  # (B, L, d, d)
                v = v + torch.diag_embed(Gam.permute(0, 2, 3, 1), dim1=1, dim2=3)
            acc.add("X", "X", v)
    if not pre:
        return
    for k in ("gamma_1", "beta_1"):
        if k not in has:
            continue
        for w in heads:
            if w in XW and acc.wants(k, w):
                v = XW[w]
                acc.add(k, w, torch.einsum("bma,bma...->a...", n1, v) if k == "gamma_1" else v.sum((0, 1)))
    XXn = None
    if "gamma_1" in has:
        XXn = torch.einsum("bmanc,bnc->bmac", XX, n1)  # XX diag(n) summed over the second token
        if acc.wants("gamma_1", "gamma_1"):
            acc.add("gamma_1", "gamma_1", torch.einsum("bma,bmac->ac", n1, XXn))
    if "beta_1" in has:
        XX1 = XX.sum(3)  # (B, L, d, d)
        if acc.wants("beta_1", "beta_1"):
            acc.add("beta_1", "beta_1", XX1.sum((0, 1)))
        if "gamma_1" in has and acc.wants("gamma_1", "beta_1"):
            acc.add("gamma_1", "beta_1", torch.einsum("bma,bmac->ac", n1, XX1))
    if "X" in has:
        if "gamma_1" in has and acc.wants("X", "gamma_1"):
            dOdXa = attention_input_jacobian(c)
            g_Xa = torch.einsum("blcma,blc->bma", dOdXa, G)
            v = torch.einsum("bmae,bmac->bmec", J_a, XXn)
            v = v + c.ln1[1].reshape(B, L, d, d) * g_Xa[:, :, None, :]  # LN_1's own (X, gamma_1): J_n^T diag(g)
            acc.add("X", "gamma_1", v.reshape(*c.x_shape, d))
        if "beta_1" in has and acc.wants("X", "beta_1"):
            acc.add("X", "beta_1", torch.einsum("bmae,bmac->bmec", J_a, XX1).reshape(*c.x_shape, d))


def contract_output(c: Cache, g, f: Factors, acc, omega_Z: torch.Tensor | None = None) -> None:
    r"""Add the blocks of :math:`\sum_o g_o \nabla^2_W \mathrm{out}_o` (the functional term of eq. 10) to ``acc``.

    ``g`` has the shape of the output, ``(B, L, d)`` (``None``: no functional term). ``omega_Z``
    (``(T, d, d)``, per token) adds the outer term :math:`J^\top \Omega J` on the same pass.
    ``acc`` is a :class:`~blockhess.result.BlockSum` over the public names (or a
    :class:`~blockhess.result.HeadSplitSum` or :class:`~blockhess.result.InputSplitSum` over them,
    finished by the caller). Theorem 5 contracted (docs/derivations.md §6, §10). No checks (kernel)
    but one: ``NotImplementedError`` for :attr:`~blockhess.config.BlockConfig.llama_options`.
    """
    forward_pass.refuse_llama(c.cfg, "contract_output (Theorem 5's per-token walk)")
    wrap = acc if isinstance(acc, (HeadSplitSum, InputSplitSum)) else HeadSplitSum(acc, c.cfg)
    _walk(c, f, wrap, None if g is None else g.reshape(-1, c.cfg.d_model), omega_Z)
    if wrap is not acc:
        wrap.finish()


def _contract_S(c: Cache, f: Factors, g_S: torch.Tensor, acc) -> None:
    r"""Add ξ contracted with ``g_S`` (``(T, d)``): the blocks of :math:`\sum g_S \nabla^2 S` (Theorem 5's ξ_ij)."""
    wrap = HeadSplitSum(acc, c.cfg)
    _walk(c, f, wrap, g_S, None, start="ffn")
    wrap.finish()


CONTRACT_BYTES = 64 << 20  # vmap's work space over the basis vectors may always be this much (or half the result)


def dense_second_derivative(
    contract: Callable[[torch.Tensor, BlockSum], None],
    out_shape: tuple[int, int],
    names: tuple[str, ...],
    shapes: dict[str, tuple[int, ...]],
    a: str,
    b: str,
    like: torch.Tensor,
    work_bytes: int = 0,
) -> torch.Tensor:
    r"""The paper's layout of a second derivative :math:`\partial^2 N/\partial W_a \partial W_b`.

    ``contract(G, acc)`` must add into ``acc`` the blocks of :math:`\sum_o G_o \nabla^2 N_o`
    for an output weight ``G`` of shape ``out_shape``; contracting with every basis vector
    gives the ``(N.numel()·n_a, n_b)`` matrix with rows ``(o, i)`` o-major (paper §1.1).
    ``work_bytes``: what one contraction holds at once, unbatched; ``vmap`` takes the basis
    vectors in chunks of as many as keep twice that (batched; docs/derivations.md §1),
    with each vector and four copies of its block (the block, its Kronecker GEMM's output, a sum
    and the gathered result), within ``CONTRACT_BYTES`` or half the result, whichever is more,
    each chunk written into the one result buffer.
    Raises ``InsufficientMemoryError`` before any contraction if the result, or the result with
    one chunk's work space, would not fit.
    """
    n_out = out_shape[0] * out_shape[1]
    sizes = {n: int(torch.Size(s).numel()) for n, s in shapes.items()}
    e = like.element_size()
    result = n_out * sizes[a] * sizes[b] * e
    check_fits(result, f"the dense d2/d{a}d{b}", like.device)
    per = 2 * work_bytes + (n_out + 4 * sizes[a] * sizes[b]) * e  # a contraction, its basis vector and its block
    size = min(n_out, max(1, max(CONTRACT_BYTES, result // 2) // per))
    check_fits(result + size * per, f"the dense d2/d{a}d{b} with the work space of {size} of its {n_out} contractions "
               "at a time", like.device)

    def blocks(G):
        acc = BlockSum(names, shapes, wanted=(a, b))
        contract(G, acc)
        return acc.blocks

    swap = names.index(a) > names.index(b)
    key = (b, a) if swap else (a, b)
    out = like.new_zeros(n_out, sizes[a], sizes[b])
    for s in range(0, n_out, size):
        k = min(size, n_out - s)
        basis = like.new_zeros(k, n_out)
        basis[torch.arange(k), torch.arange(s, s + k)] = 1
        got = torch.func.vmap(blocks)(basis.reshape(k, *out_shape))
        if key in got:
            out[s : s + k] = got[key].transpose(1, 2) if swap else got[key]
    return out.reshape(n_out * sizes[a], sizes[b])


def second_derivative(params: dict, X: torch.Tensor, cfg: BlockConfig, a: str, b: str, of: str = "Z") -> torch.Tensor:
    r"""A second derivative of the block in the paper's dense layout, shape ``(N·n_a, n_b)``.

    ``of="Z"``: :math:`H_{tr}^{(a,b)} = \partial^2 Z/\partial W_a \partial W_b` (Theorem 5, eq. 9);
    ``of="S"`` (post-LN): :math:`\xi_{ab} = \partial B_a/\partial W_b`, ``S = Y + FFN(Y)`` (Theorem 5's ξ,
    including ξ_k1, ξ_k2 that the paper leaves out); for ``kind="attention"`` use ``of="F"``:
    :math:`\Phi_{ab} = \partial^2 F/\partial W_a\partial W_b` (§2.3). Rows ``(o, i)`` o-major over
    output entries ``o`` (``N = L·d_model``) and entries ``i`` of ``W_a``; columns entries of
    ``W_b``. ``X`` is one sequence ``(L, d_model)``. Valid almost everywhere (ReLU).

    Raises ``ValueError`` as :func:`forward`, for an unknown name or ``of``, and for a result
    with a NaN or Inf (:func:`~blockhess.validation.check_result`); ``InsufficientMemoryError``
    before the forward pass if the result, or it with the forward cache and factors and the work
    space of the contractions taken at once (:func:`dense_second_derivative`,
    :func:`work_entries`), would not fit in memory.
    """
    forward_pass.refuse_llama(cfg, "blockhess.block.second_derivative")
    check_inputs(params, X, cfg)
    if X.ndim != 2:
        raise ValueError(f"X must be one sequence (L, d_model) for a dense second derivative, got {tuple(X.shape)}")
    allowed = ("F",) if cfg.kind == "attention" else (("Z", "S") if cfg.norm == "post" else ("Z",))
    if of not in allowed:
        raise ValueError(f"of must be one of {allowed} for kind={cfg.kind!r}, norm={cfg.norm!r}, got {of!r}")
    shapes = param_shapes(cfg)
    for name, n in (("a", a), ("b", b)):
        if not (isinstance(n, str) and n in shapes):
            raise ValueError(f"{name} must be one parameter name of {list(shapes)}, got {n!r}")
    L, e = X.shape[0], X.element_size()
    held, walk = work_entries(cfg, 1, L, "factors"), work_entries(cfg, 1, L, "hessian")
    n_out, (sa, sb) = X.numel(), (math.prod(shapes[a]), math.prod(shapes[b]))
    check_fits(n_out * sa * sb * e, f"the dense d2/d{a}d{b}", X.device)  # the result alone, then with the factors
    check_fits((n_out * sa * sb + held) * e, f"the dense d2/d{a}d{b} with the forward cache and factors", X.device)
    c = forward_pass.forward_cache(params, X, cfg)
    check_forward(c)
    f = jacobian_factors(c)
    if of == "S":
        def contract(g, acc):
            _contract_S(c, f, g, acc)
    else:
        def contract(g, acc):
            contract_output(c, g[None], f, acc)
    D = dense_second_derivative(contract, tuple(X.shape), c.names, shapes, a, b, X, work_bytes=(walk - held) * e)
    check_result({f"the second derivative d2{of}/d{a}d{b}": D})
    return D
