r"""The FFN with its residual, :math:`S = \mathrm{act}(Y_f W_1 + b_1) W_2 + b_2 + Y`, and its derivatives (§2.6).

``Y_f = Y`` in a post-LN block (the paper's) and :math:`Y_f = \mathrm{LN}_2(Y) = \gamma_2\odot n + \beta_2`
in a pre-LN block. With :math:`H_1 = Y_f W_1 + b_1`, :math:`h = \mathrm{act}(H_1)`,
:math:`a' = \mathrm{act}'(H_1)`, :math:`a'' = \mathrm{act}''(H_1)` (ReLU: :math:`a' = D_t = \mathbb 1[H_1 > 0]`,
:math:`a'' = 0`, Lemma 1: results hold almost everywhere, off the kinks), per token ``t``:

* :math:`B_1 = \partial S/\partial W_1`: rows :math:`y_{f,t}^\top \otimes W_2^\top \mathrm{diag}(a'_t)`
  (paper: :math:`(I_L\otimes W_2^\top) D_\sigma (Y\otimes I_{d_{ff}})`); ``b_1``: :math:`W_2^\top \mathrm{diag}(a'_t)`;
* :math:`B_2 = \partial S/\partial W_2`: rows :math:`h_t^\top \otimes I` (paper: :math:`h \otimes I_{d_V}`); ``b_2``: ``I``;
* pre-LN: ``gamma_2``: :math:`W_2^\top \mathrm{diag}(a'_t) W_1^\top \mathrm{diag}(n_t)`; ``beta_2``: :math:`W_2^\top \mathrm{diag}(a'_t) W_1^\top`;
* :math:`J_{SY} = \partial S/\partial Y`: per token :math:`I + W_2^\top \mathrm{diag}(a'_t) W_1^\top J_f`
  (``J_f`` the LN_2 Jacobian, pre-LN; ``I`` post-LN).

Second derivatives of :math:`\sum_{tc} g_{tc} S_{tc}` (derived here, docs/derivations.md §5):
with :math:`\delta = g W_2^\top`, :math:`g_H = \delta\odot a'`, :math:`\psi = \delta\odot a''`,

* the activation's curvature :math:`\sum_t (\partial H_1/\partial\cdot)^\top \mathrm{diag}(\psi_t) (\partial H_1/\partial\cdot)`
  (zero for ReLU) over ``Y, gamma_2, beta_2, W_1, b_1``;
* the bilinear ``h W_2``: ``(W_1, W_2)``: :math:`\delta_{bb'} \sum_t y_{f,ta} a'_{tb} g_{tc}`;
  ``(Y, W_2)``: per token :math:`J_f^\top W_1\mathrm{diag}(a'_t) \otimes g_t^\top`;
* the bilinear ``Y_f W_1``: ``(Y, W_1)``: per token :math:`J_f^\top \otimes g_{H,t}^\top`;
* pre-LN, LN_2's own curvature: ``(Y, Y)``: :math:`\Gamma_{LN}(\gamma_2\odot g_{Y_f})`; ``(Y, gamma_2)``:
  :math:`J_n^\top \mathrm{diag}(g_{Y_f})`, :math:`g_{Y_f} = g_H W_1^\top`.

The gated FFN (GLU; Llama's SwiGLU, Gemma's GeGLU), :math:`S = (\mathrm{act}(Y_f W_G + b_G)\odot(Y_f W_1 + b_1))W_2
+ b_2 + Y`, and LN_2 an RMSNorm, have the directional derivatives only (:func:`tangent`, :func:`adjoint`,
:func:`second_adjoint`; docs/derivations.md §20); the Kronecker-factor functions refuse them by name.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..kronecker import TokenKron
from . import layernorm, linear
from .linear import add
from .protocol import Contraction

__all__ = ["NAMES", "Cache", "Contraction", "forward", "activation", "weight_jacobians", "input_jacobian",
           "contract_hessian",
           # directional derivatives, for a matrix-free product (docs/derivations.md §18)
           "Tangent", "Adjoint", "tangent", "adjoint", "second_adjoint"]

NAMES = ("W_1", "W_2")


class Cache(NamedTuple):
    """FFN forward quantities over ``T`` tokens (batch and sequence axes merged)."""

    Y: torch.Tensor  # (T, d) input (the residual branch)
    D: torch.Tensor  # (T, d_ff) act'(H_1) (ReLU: 0/1)
    h: torch.Tensor  # (T, d_ff) act(H_1)
    S: torch.Tensor  # (T, d) output
    W_1: torch.Tensor
    W_2: torch.Tensor
    D2: torch.Tensor | None = None  # (T, d_ff) act''(H_1); None for ReLU
    Yf: torch.Tensor | None = None  # (T, d) FFN input (LN_2(Y) pre-LN; Y itself post-LN)
    n: torch.Tensor | None = None  # (T, d) normalised Y (pre-LN)
    J_n: torch.Tensor | None = None  # (T, d, d) Jacobian of the normalisation, without gamma (pre-LN)
    J_f: torch.Tensor | None = None  # (T, d, d) Jacobian of LN_2 with gamma (pre-LN)
    ln_eps: float = 0.0
    gamma: torch.Tensor | None = None  # LN_2's effective scale (rms_offset included)
    r: torch.Tensor | None = None  # (T, 1) inverse std 1/σ of Y (pre-LN)
    center: bool = True  # LN_2 a LayerNorm (True) or an RMSNorm (False), pre-LN
    W_G: torch.Tensor | None = None  # gated FFN: the gate weight (d, d_ff); then D, D2 are the gate's act', act''
    gate: torch.Tensor | None = None  # (T, d_ff) gated: act(H_G), H_G = Y_f W_G + b_G
    up: torch.Tensor | None = None  # (T, d_ff) gated: H_1 = Y_f W_1 + b_1 (h = gate ⊙ up)


def activation(x: torch.Tensor, kind: str = "relu"):
    r"""``(act(x), act'(x), act''(x))`` in closed form; ``act''`` is ``None`` for ReLU (zero a.e.).

    * relu: ``x·1[x>0]``, ``1[x>0]``.
    * gelu (erf): :math:`x\Phi(x)`, :math:`\Phi(x) + x\varphi(x)`, :math:`\varphi(x)(2 - x^2)`.
    * gelu_tanh: :math:`\tfrac12 x(1+t)`, :math:`t = \tanh u`, :math:`u = c(x + 0.044715x^3)`, :math:`c = \sqrt{2/\pi}`:
      :math:`\tfrac12(1+t) + \tfrac12 x(1-t^2)u'`, :math:`(1-t^2)(u' - x t u'^2 + \tfrac12 x u'')`.

    * silu: :math:`x\sigma(x)`, :math:`\sigma(1 + x(1-\sigma))`, :math:`\sigma(1-\sigma)(2 + x(1 - 2\sigma))`.

    Each of ``x``'s shape and dtype. Raises ``ValueError`` for another ``kind``. Source: the
    definitions above, differentiated here (checked against autograd in tests/test_layers_ffn.py).
    """
    if kind == "relu":
        D = (x > 0).to(x.dtype)
        return x * D, D, None
    if kind == "gelu":
        Phi = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        phi = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        return x * Phi, Phi + x * phi, phi * (2 - x * x)
    if kind == "gelu_tanh":
        c, k = math.sqrt(2 / math.pi), 0.044715
        t = torch.tanh(c * (x + k * x ** 3))
        up, upp = c * (1 + 3 * k * x * x), 6 * c * k * x
        sech2 = 1 - t * t
        return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * sech2 * up, sech2 * (up - x * t * up * up + 0.5 * x * upp)
    if kind == "silu":
        sg = torch.sigmoid(x)
        return x * sg, sg * (1 + x * (1 - sg)), sg * (1 - sg) * (2 + x * (1 - 2 * sg))
    raise ValueError(f"activation must be 'relu', 'gelu', 'gelu_tanh' or 'silu', got {kind!r}")


def forward(Y: torch.Tensor, W_1: torch.Tensor, W_2: torch.Tensor, b_1=None, b_2=None, act: str = "relu",
            pre_ln: bool = False, ln_eps: float = 0.0, gamma=None, beta=None, jacobian: bool = True,
            center: bool = True, W_G=None, b_G=None) -> Cache:
    """``S = act(Y_f W_1 + b_1) W_2 + b_2 + Y`` for ``Y`` of shape ``(T, d)``; ``Y_f = LN_2(Y)``
    with ``pre_ln`` (``ln_eps``, ``gamma``, ``beta``; ``center=False``: an RMSNorm), else ``Y``.
    With the gate ``W_G`` ``(d, d_ff)``: ``S = (act(Y_f W_G + b_G) ⊙ (Y_f W_1 + b_1)) W_2 + b_2 + Y``.
    ``jacobian=False`` (a plain forward): LN_2's per-token ``(d, d)`` Jacobians ``J_n``, ``J_f`` are
    not formed. No checks (kernel)."""
    n = J_n = J_f = r = None
    Yf = Y
    if pre_ln:
        n, r = layernorm.normalise(Y, ln_eps, center=center)
        if jacobian:
            J_n = layernorm.per_token_jacobian(n, r, center=center)
            J_f = J_n if gamma is None else gamma[:, None] * J_n
        Yf = layernorm.affine(n, gamma, beta)
    pre = Yf @ W_1
    if b_1 is not None:
        pre = pre + b_1
    gate = None
    if W_G is not None:
        hg = Yf @ W_G
        if b_G is not None:
            hg = hg + b_G
        gate, D, D2 = activation(hg, act)
        h = gate * pre
    else:
        h, D, D2 = activation(pre, act)
    S = h @ W_2 + Y
    if b_2 is not None:
        S = S + b_2
    return Cache(Y=Y, D=D, h=h, S=S, W_1=W_1, W_2=W_2, D2=D2, Yf=Yf, n=n, J_n=J_n, J_f=J_f, ln_eps=ln_eps, gamma=gamma,
                 r=r, center=center, W_G=W_G, gate=gate, up=None if W_G is None else pre)


def _factored(c: Cache, what: str) -> None:
    """Refuse, by name, a Kronecker-factor function on an FFN it does not cover (docs/derivations.md §20)."""
    if c.W_G is not None or not c.center:
        option = "gated=True" if c.W_G is not None else "norm_type='rms'"
        raise NotImplementedError(f"ffn.{what}: the Kronecker factors do not cover {option}; the matrix-free "
                                  "products (ffn.tangent, ffn.second_adjoint) do")


def _M(c: Cache) -> torch.Tensor:
    """``∂S/∂H_1 = W_2^T diag(a')`` per token, ``(T, d, d_ff)``."""
    return c.W_2.T[None] * c.D[:, None, :]


def weight_jacobians(c: Cache, names=("W_1", "W_2")) -> dict[str, TokenKron]:
    """``B_1``, ``B_2`` (paper §2.6) and the biases / LN_2 parameters, for those in ``names``, per token.

    Returns ``{name: TokenKron}``: the Jacobian of ``S_t`` w.r.t. each weight as per-token
    Kronecker factors over the ``T`` tokens of ``c`` (:class:`blockhess.kronecker.TokenKron`;
    ``.dense()`` is the ``(T·d_model, numel)`` matrix, ``vec_r`` columns). Kernel: no checks.
    """
    _factored(c, "weight_jacobians")
    T, d = c.Y.shape
    eye = torch.eye(d, dtype=c.Y.dtype, device=c.Y.device).expand(T, d, d)
    M = _M(c) if {"W_1", "b_1", "gamma_2", "beta_2"} & set(names) else None
    out = {}
    if c.n is not None and ("gamma_2" in names or "beta_2" in names):
        MW = M @ c.W_1.T
        if "gamma_2" in names:
            out["gamma_2"] = TokenKron("vector", None, MW * c.n[:, None, :])
        if "beta_2" in names:
            out["beta_2"] = TokenKron("vector", None, MW)
    if "W_1" in names:
        out["W_1"] = TokenKron("left", c.Y if c.Yf is None else c.Yf, M)
    if "b_1" in names:
        out["b_1"] = TokenKron("vector", None, M)
    if "W_2" in names:
        out["W_2"] = TokenKron("left", c.h, eye)
    if "b_2" in names:
        out["b_2"] = TokenKron("vector", None, eye)
    return out


def input_jacobian(c: Cache) -> torch.Tensor:
    """``J_SY`` per token, shape ``(T, d, d)``: ``I + W_2^T diag(a'_t) W_1^T [J_f]`` (paper §2.6).
    Raises ``NotImplementedError`` for a gated FFN or an RMSNorm LN_2."""
    _factored(c, "input_jacobian")
    d = c.Y.shape[1]
    eye = torch.eye(d, dtype=c.Y.dtype, device=c.Y.device)
    MW = _M(c) @ c.W_1.T
    return eye + (MW if c.J_f is None else MW @ c.J_f)


def contract_hessian(c: Cache, g: torch.Tensor, acc, names=NAMES) -> Contraction:
    r"""Second derivatives of :math:`\sum_{tc} g_{tc} S_{tc}` over ``Y`` and the FFN parameters in ``names``.

    ``g`` has shape ``(T, d)``. The blocks among the FFN's own parameters (the bilinear ``(W_1, W_2)``,
    ``(b_1, W_2)``, pre-LN ``(gamma_2, W_1)`` etc.) are added to ``acc`` (what ``acc.wants``);
    returns the :class:`~blockhess.layers.protocol.Contraction`: ``gamma``, the ``(T, d, d)``
    curvature w.r.t. ``Y`` (``None`` when zero: ReLU, post-LN); ``cross``, the per-token factors of
    ``∂²/∂Y∂W``; ``core``, the activation's curvature added to the cores of the ``B_a, B_b``
    sandwiches. See the module docstring. Derived here (docs/derivations.md §5). No checks (kernel).
    """
    _factored(c, "contract_hessian")
    T, d = c.Y.shape
    pre = c.J_f is not None
    Yf = c.Y if c.Yf is None else c.Yf
    delta = g @ c.W_2.T  # (T, d_ff): gradient w.r.t. h
    g_H = delta * c.D
    psi = None if c.D2 is None else delta * c.D2
    JfT = c.J_f.transpose(1, 2) if pre else None
    WJ_T = (JfT @ c.W_1) if pre else c.W_1.expand(T, *c.W_1.shape)  # (T, d, d_ff): (∂H_1/∂Y)^T
    eye = torch.eye(d, dtype=g.dtype, device=g.device).expand(T, d, d)
    gamma, cross, core = None, {}, {}

    def own(a, b, value, dims):  # a block among the FFN's parameters, added if wanted
        if not acc.wants(a, b):
            return
        if dims is None:
            acc.add(a, b, value())
        else:
            acc.add_diagonal(a, b, *dims, value())

    # the bilinear h W_2 (every FFN) and Y_f W_1
    cross["W_2"] = [TokenKron("right", g, WJ_T * c.D[:, None, :])]
    cross["W_1"] = [TokenKron("right", g_H, JfT if pre else eye)]
    own("W_1", "W_2", lambda: torch.einsum("ta,tcb->acb", Yf, g[:, :, None] * c.D[:, None, :]), (1, 2))
    if "b_1" in names:
        own("b_1", "W_2", lambda: torch.einsum("tb,tc->cb", c.D, g), (0, 1))
    if pre:  # LN_2 inside the FFN (pre-LN)
        g_Yf = g_H @ c.W_1.T
        gamma = layernorm.contract_hessian_unchecked(c.Y, g_Yf, c.ln_eps, c.gamma)
        if "gamma_2" in names:
            cross["gamma_2"] = [TokenKron("vector", None, c.J_n * g_Yf[:, None, :])]  # J_n symmetric
            own("gamma_2", "W_1", lambda: torch.einsum("ta,tb->ba", c.n, g_H), (0, 1))
            own("gamma_2", "W_2",
                lambda: c.W_1[:, :, None] * torch.einsum("ta,tbc->abc", c.n, c.D[:, :, None] * g[:, None, :]), None)
        if "beta_2" in names:
            own("beta_2", "W_1", lambda: g_H.sum(0)[:, None].expand(g_H.shape[1], d), (0, 1))
            own("beta_2", "W_2", lambda: c.W_1[:, :, None] * (c.D.T @ g)[None], None)
    if psi is not None:  # the activation's curvature: (∂H_1/∂·)^T diag(ψ) (∂H_1/∂·)
        WJp = WJ_T * psi[:, None, :]  # (T, d, d_ff)
        gY = WJp @ WJ_T.transpose(1, 2)
        gamma = gY if gamma is None else gamma + gY
        cross["W_1"].append(TokenKron("left", Yf, WJp))
        if "b_1" in names:
            cross["b_1"] = [TokenKron("vector", None, WJp)]
        H1 = {"W_1": None, "b_1": None}  # identity H_1-level factors: the core is diag(ψ) itself
        if pre:  # H_1-level factors of gamma_2, beta_2 (x = d): W_1^T diag(n), W_1^T
            if "gamma_2" in names:
                H1["gamma_2"] = c.W_1.T[None] * c.n[:, None, :]
            if "beta_2" in names:
                H1["beta_2"] = c.W_1.T.expand(T, *c.W_1.T.shape)
            for k, m in (("gamma_2", H1.get("gamma_2")), ("beta_2", H1.get("beta_2"))):
                if m is not None:
                    cross[k] = cross.get(k, []) + [TokenKron("vector", None, WJp @ m)]
        keys = [k for k in ("gamma_2", "beta_2", "W_1", "b_1") if k in H1 and (k in names or k == "W_1")]
        dpsi = torch.diag_embed(psi)
        for i, a in enumerate(keys):
            for b in keys[i:]:
                ma, mb = H1[a], H1[b]
                if ma is None and mb is None:
                    core[(a, b)] = dpsi
                elif ma is None:
                    core[(a, b)] = psi[:, :, None] * mb
                elif mb is None:
                    core[(a, b)] = ma.transpose(1, 2) * psi[:, None, :]
                else:
                    core[(a, b)] = (ma.transpose(1, 2) * psi[:, None, :]) @ mb
    return Contraction(gamma=gamma, cross=cross, core=core)


class Tangent(NamedTuple):
    """The FFN's tangents along ``k`` directions (:func:`tangent`), tokens flattened; ``None`` where zero."""

    dn: torch.Tensor | None  # (k, T, d) pre-LN: LN_2's normalised rows' tangent
    rho: torch.Tensor | None  # (k, T, 1) pre-LN: layernorm.tangent's rho
    dYf: torch.Tensor | None  # (k, T, d) the FFN input's (Y itself post-LN)
    dH1: torch.Tensor | None  # (k, T, d_ff) the pre-activation's
    dh: torch.Tensor | None  # (k, T, d_ff) the activation's
    dS: torch.Tensor | None  # (k, T, d) the output's (residual included)
    dHg: torch.Tensor | None = None  # (k, T, d_ff) gated: the gate's pre-activation's


class Adjoint(NamedTuple):
    """The FFN's first-order adjoints of an output adjoint ``g`` (:func:`adjoint`), ``(T, ·)``."""

    g: torch.Tensor  # (T, d) at S
    g_h: torch.Tensor  # (T, d_ff) at h: g W_2^T
    g_H: torch.Tensor  # (T, d_ff) at H_1: act' ⊙ g_h
    g_Yf: torch.Tensor  # (T, d) at the FFN input Y_f: g_H W_1^T
    g_ln: torch.Tensor | None  # (T, d) pre-LN: LN_2's input adjoint of g_Yf
    g_Y: torch.Tensor  # (T, d) at Y: g + g_Yf (post-LN), g + g_ln (pre-LN)
    psi: torch.Tensor | None = None  # (T, d_ff) act'' ⊙ g_h (gated: ⊙ up too), the activation's curvature weight
    g_Hg: torch.Tensor | None = None  # (T, d_ff) gated: at H_G, act' ⊙ up ⊙ g_h (g_H is then at H_1: gate ⊙ g_h)


def _Yf(c: Cache) -> torch.Tensor:
    return c.Y if c.Yf is None else c.Yf


def tangent(c: Cache, p: dict, dp: dict, dY=None) -> Tangent:
    r"""The tangents of the FFN along ``k`` directions of its input ``dY`` ``(k, T, d)`` and weights
    ``dp`` (name → ``(k, *shape)``: ``W_1, b_1, W_2, b_2``, pre-LN ``gamma_2, beta_2``; absent or
    ``None``: zero), at the cached point ``c`` with weights ``p``:

    .. math::
        \dot Y_f = \gamma_2\odot J_n\dot Y + \dot\gamma_2\odot n + \dot\beta_2\ (\text{pre-LN; } \dot Y \text{ post-LN}),\quad
        \dot H_1 = \dot Y_f W_1 + Y_f\dot W_1 + \dot b_1,\quad \dot h = a'\odot\dot H_1,\quad
        \dot S = \dot h W_2 + h\dot W_2 + \dot b_2 + \dot Y.

    Gated: :math:`\dot H_G = \dot Y_f W_G + Y_f\dot W_G + \dot b_G`,
    :math:`\dot h = (a'\odot\dot H_G)\odot H_1 + \mathrm{act}(H_G)\odot\dot H_1`.
    Returns the :class:`Tangent`. Kernel: no checks."""
    dn = rho = None
    dYf = dY
    if c.n is not None:  # pre-LN: LN_2 inside
        if dY is not None:
            dn, rho = layernorm.tangent(c.n, c.r, dY, center=c.center)
        dYf = layernorm.affine_tangent(c.n, dn, c.gamma, dp.get("gamma_2"), dp.get("beta_2"))
    dH1 = linear.tangent(_Yf(c), c.W_1, dYf, dp.get("W_1"), dp.get("b_1"))
    dHg = None
    if c.W_G is not None:
        dHg = linear.tangent(_Yf(c), c.W_G, dYf, dp.get("W_G"), dp.get("b_G"))
        dh = _fma(None if dH1 is None else dH1 * c.gate, dHg, c.D * c.up)
    else:
        dh = None if dH1 is None else dH1 * c.D
    dS = add(linear.tangent(c.h, c.W_2, dh, dp.get("W_2"), dp.get("b_2")), dY)
    return Tangent(dn=dn, rho=rho, dYf=dYf, dH1=dH1, dh=dh, dS=dS, dHg=dHg)


def adjoint(c: Cache, g: torch.Tensor) -> Adjoint:
    r"""The first-order adjoints of the output adjoint ``g`` ``(T, d)``: :math:`g_h = gW_2^\top`,
    :math:`g_H = a'\odot g_h`, :math:`g_{Y_f} = g_H W_1^\top`, pre-LN LN_2's
    :math:`g_{ln} = J_n(\gamma_2\odot g_{Y_f})`, and :math:`g_Y = g + g_{Y_f}` (post-LN) or
    :math:`g + g_{ln}` (pre-LN), and :math:`\psi = a''\odot g_h` (the activation's curvature weight that
    :func:`second_adjoint` reads). Gated: :math:`g_{H_G} = a'\odot H_1\odot g_h`, :math:`g_{H_1} =
    \mathrm{act}(H_G)\odot g_h`, :math:`g_{Y_f} = g_{H_G}W_G^\top + g_{H_1}W_1^\top`,
    :math:`\psi = a''\odot H_1\odot g_h`. Returns the :class:`Adjoint`. Kernel: no checks."""
    g_h = linear.adjoint(c.W_2, g)
    g_Hg = None
    if c.W_G is not None:
        g_H = g_h * c.gate
        g_Hg = g_h * c.up * c.D
        g_Yf = linear.adjoint(c.W_1, g_H) + linear.adjoint(c.W_G, g_Hg)
        psi = None if c.D2 is None else c.D2 * c.up * g_h
    else:
        g_H = g_h * c.D
        g_Yf = linear.adjoint(c.W_1, g_H)
        psi = None if c.D2 is None else c.D2 * g_h
    g_ln = None if c.n is None else layernorm.adjoint(c.n, c.r, g_Yf, c.gamma, center=c.center)
    return Adjoint(g=g, g_h=g_h, g_H=g_H, g_Yf=g_Yf, g_ln=g_ln, g_Y=g + (g_Yf if g_ln is None else g_ln), psi=psi,
                   g_Hg=g_Hg)


def second_adjoint(c: Cache, p: dict, dp: dict, a: Adjoint, t: Tangent, dg, second: bool = True,
                   want_input: bool = True, wanted=None, into=None) -> tuple:
    r"""``(dg_Y, hv)``: the tangent of the input adjoint ``(k, T, d)`` (``None`` with
    ``want_input=False`` or when zero) and the FFN weights' rows of the Hessian-vector product,
    ``hv`` name → ``(k, *shape)`` for each of ``W_1, b_1, W_2, b_2`` (and pre-LN ``gamma_2, beta_2``)
    in ``p`` and in ``wanted`` (default: all of them; ``None`` where zero; a name not wanted is absent
    and costs nothing: its GEMMs are skipped, and the pass stops below the lowest wanted weight
    when ``want_input`` is ``False``, e.g. ``W_2``'s rows alone are its two GEMMs). With ``[·]`` the
    second-order (functional) terms that ``second=False`` drops (the Gauss–Newton product):

    .. math::
        \dot g_h = \dot g W_2^\top + [g\dot W_2^\top],\quad
        \dot g_H = a'\odot\dot g_h + [a''\odot\dot H_1\odot g_h],\quad
        \dot g_{Y_f} = \dot g_H W_1^\top + [g_H\dot W_1^\top],

        (Hv)_{W_2} = \textstyle\sum h^\top\dot g + [\sum\dot h^\top g],\quad
        (Hv)_{W_1} = \sum Y_f^\top\dot g_H + [\sum\dot Y_f^\top g_H],

    pre-LN LN_2's :func:`~blockhess.layers.layernorm.second_adjoint`, and :math:`\dot g_Y = \dot g +`
    the input adjoint's tangent of the branch. ``a``: the :func:`adjoint` of the cached output
    adjoint; ``t``: the :func:`tangent` along ``dp`` and the input's direction; ``dg``
    ``(k, T, d)`` the output adjoint's tangent or ``None``; ``into``: name → a ``(k, *shape)`` destination for
    ``W_1``'s, ``W_2``'s (``W_G``'s) rows (:func:`~blockhess.layers.linear.second_adjoint`'s ``out``), or
    ``None``. Gated (``W_G``, ``b_G`` rows too):
    :math:`\dot g_{H_G} = a'\odot H_1\odot\dot g_h + [\psi\odot\dot H_G + a'\odot g_h\odot\dot H_1]`,
    :math:`\dot g_{H_1} = \mathrm{act}(H_G)\odot\dot g_h + [a'\odot g_h\odot\dot H_G]`, each through its
    projection's second-order adjoint (docs/derivations.md §20). Derived in docs/derivations.md §18. Kernel."""
    want = {n for n in p if n in NAMES + ("b_1", "b_2", "gamma_2", "beta_2", "W_G", "b_G")} if wanted is None \
        else set(wanted)
    pre = c.n is not None
    ln2 = pre and bool(want & {"gamma_2", "beta_2"})  # LN_2's rows (pre-LN) need the pass through W_1
    need_1 = want_input or ln2 or bool(want & {"W_1", "b_1", "W_G", "b_G"})  # the pass below W_2
    hv = {}
    into = into or {}
    dg_h, hv_W2, hb2 = linear.second_adjoint(c.h, c.W_2, a.g, dg, t.dh, dp.get("W_2"), second, need_1,
                                             bias="b_2" in p and "b_2" in want, weight="W_2" in want,
                                             out=into.get("W_2"))
    for name, v in (("W_2", hv_W2), ("b_2", hb2)):
        if name in p and name in want:
            hv[name] = v
    if not need_1:
        return (dg if want_input else None), hv
    if c.W_G is not None:
        return _gated_second_adjoint(c, p, dp, a, t, dg, dg_h, hv, want, second, want_input, ln2)
    dg_H = None if dg_h is None else dg_h * c.D
    if second and c.D2 is not None and t.dH1 is not None:
        psi = c.D2 * a.g_h if a.psi is None else a.psi
        dg_H = t.dH1 * psi if dg_H is None else dg_H.addcmul_(t.dH1, psi)
    dg_Yf, hv_W1, hb1 = linear.second_adjoint(_Yf(c), c.W_1, a.g_H, dg_H, t.dYf, dp.get("W_1"), second,
                                              want_input or ln2, bias="b_1" in p and "b_1" in want,
                                              weight="W_1" in want, out=into.get("W_1"))
    for name, v in (("W_1", hv_W1), ("b_1", hb1)):
        if name in p and name in want:
            hv[name] = v
    return _ln2_second_adjoint(c, p, dp, a, t, dg, dg_Yf, hv, want, second, want_input, ln2)


def _ln2_second_adjoint(c, p, dp, a, t, dg, dg_Yf, hv, want, second, want_input, ln2):
    """The end of :func:`second_adjoint`: pre-LN LN_2's rows and the input adjoint's tangent."""
    if c.n is not None and (want_input or ln2):
        variables = ("gamma_2" in p and "gamma_2" in want, "beta_2" in p and "beta_2" in want)
        dg_Yf, hg, hb = layernorm.second_adjoint(c.n, c.r, a.g_Yf, a.g_ln, dg_Yf, t.dn, t.rho, c.gamma,
                                                 dp.get("gamma_2"), second, want_input, variables, center=c.center)
        for name, v, on in (("gamma_2", hg, variables[0]), ("beta_2", hb, variables[1])):
            if on:
                hv[name] = v
    return (add(dg, dg_Yf) if want_input else None), hv


def _fma(acc, x, y):
    """``acc + x ⊙ y`` for a tensor ``x`` (``None``: ``acc``), written into ``acc`` (a temporary of the caller's
    own, never a cached or given tensor) where ``acc`` is a tensor of the result's shape, else a new tensor."""
    if x is None:
        return acc
    if acc is None:
        return x * y
    if acc.shape == x.shape and y.dim() <= x.dim():  # y broadcast over x's leading axes (a cached (T, ·) factor)
        return acc.addcmul_(x, y)
    return torch.addcmul(acc, x, y)


def _gated_second_adjoint(c, p, dp, a, t, dg, dg_h, hv, want, second, want_input, ln2):
    """:func:`second_adjoint` below ``W_2`` for a gated FFN: the two branches' adjoint tangents, each
    through its projection (``W_G`` with ``b_G``, ``W_1`` with ``b_1``), summed at ``Y_f``."""
    dg_Hg = None if dg_h is None else dg_h * (c.D * c.up)
    dg_H1 = None if dg_h is None else dg_h * c.gate
    if second:  # the sums formed in place (every term above is this call's own tensor)
        ag = a.g_h * c.D  # a' ⊙ g_h
        if t.dHg is not None:
            if c.D2 is not None:
                dg_Hg = _fma(dg_Hg, t.dHg, c.D2 * c.up * a.g_h if a.psi is None else a.psi)
            dg_H1 = _fma(dg_H1, t.dHg, ag)
        if t.dH1 is not None:
            dg_Hg = _fma(dg_Hg, t.dH1, ag)
    below = want_input or ln2
    dg_Yf = None
    for w, b, g, dgw, dH in (("W_G", "b_G", a.g_Hg, dg_Hg, t.dHg), ("W_1", "b_1", a.g_H, dg_H1, t.dH1)):
        W = c.W_G if w == "W_G" else c.W_1
        if not (below or bool(want & {w, b})):
            continue
        x_in, hv_w, hb = linear.second_adjoint(_Yf(c), W, g, dgw, t.dYf, dp.get(w), second, below,
                                               bias=b in p and b in want, weight=w in want)
        dg_Yf = add(dg_Yf, x_in)
        for name, v in ((w, hv_w), (b, hb)):
            if name in p and name in want:
                hv[name] = v
    return _ln2_second_adjoint(c, p, dp, a, t, dg, dg_Yf, hv, want, second, want_input, ln2)
