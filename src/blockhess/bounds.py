r"""Spectral-norm bounds of the loss Hessian: Theorem 1 (attention) and Theorem 6 (block).

For one sequence ``X`` (``L × d``), weights ``W`` and the paper's MSE
:math:`\ell = \frac{1}{Ld}\|\mathrm{out} - T\|_F^2`, every Hessian block splits (eq. 3 / eq. 10)
into an outer and a functional term, and each is bounded by

.. math::
    \|H_o(W_i,W_j)\|_2 \le \lambda\,\|J_i\|\,\|J_j\|,\qquad
    \|H_f(W_i,W_j)\|_2 \le \gamma\,\zeta_{ij},

with :math:`\lambda \ge \|\nabla^2\ell\|_2`, :math:`\gamma \ge \|\nabla\ell\|_2`, :math:`J_i` the
Jacobian of the output w.r.t. :math:`W_i` and :math:`\zeta_{ij}` the norm of the output's
second derivative as a bilinear map (directions of unit Frobenius norm, value in Frobenius
norm). The whole Hessian is bounded by the spectral norm of the matrix of block bounds,
:math:`\|H\|_2 \le \|[b_{ij}]\|_2` (sharper than the paper's :math:`\sqrt{mn}\max_{ij} b_{ij}`).

Two versions are computed side by side:

* ``bound``: every ingredient re-derived so that it holds for any weights and inputs
  (softmax Jacobian :math:`\le 1/2`, softmax second derivative :math:`\le 1/\sqrt 2`,
  :math:`\|A\|_2\le\sqrt L`, LayerNorm with the true row std, Φ without the spurious
  :math:`2/(Ld)`, ...); derived here, see docs/bounds.md.
* ``bound_paper``: the constants as printed in the paper (Theorem 1 main text; Theorem 6
  with the printed ingredient bounds and the paper's LayerNorm lemma). It can
  be smaller than the exact norm; such rows are flagged (``paper_holds = False``).

For a batch ``(B, L, d)`` (whose loss is the mean over sequences) both bounds are the mean
of the per-sequence bounds, which bounds the norm of the mean Hessian by the triangle
inequality.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from . import losses
from .block import check_forward, check_inputs, forward_cache, jacobian, second_derivative
from .result import HessianBlocks, pairs
from .layers import ffn, layernorm, softmax
from .config import SHORT_NAMES, BlockConfig, pair_key, param_shapes
from .hessian import hessian as loss_hessian
from .linalg import eigvalsh, norm2
from .validation import check_fits, check_ln_variance, detached

__all__ = [
    "SOFTMAX_JACOBIAN_BOUND",
    "SOFTMAX_HESSIAN_BOUND",
    "layernorm_bounds",
    "ingredients",
    "block_bounds",
    "exact_norms",
    "PairNorms",
    "spectral_bounds",
    "ingredient_checks",
    "check_setting",
]

#: ‖diag(a) − a aᵀ‖₂ ≤ 1/2 for any probability vector a (variance of a unit vector, Popoviciu).
SOFTMAX_JACOBIAN_BOUND = 0.5
#: ‖∂²softmax(t)[h, h']‖₂ ≤ (1/√2)‖h‖‖h'‖ for any t (docs/bounds.md §softmax; the sharp value,
#: found numerically, is √6/9 ≈ 0.272).
SOFTMAX_HESSIAN_BOUND = 1.0 / math.sqrt(2.0)

#: Relative slack when flagging ``bound_paper < norm``: a printed bound that is attained
#: (e.g. the V–V block at L = 1) is not a failure because of the last bit of rounding.
PAPER_TIE_RTOL = 1e-10

# ----------------------------------------------------------------------------- helpers


def _sym_spec(M: torch.Tensor) -> float:
    """Spectral norm of a symmetric matrix, via its eigenvalues (in float64, :mod:`blockhess.linalg`)."""
    if M.numel() == 0:
        return 0.0
    return float(eigvalsh(M).abs().max())


def _perron(N: list[list[float]]) -> float:
    """Spectral norm of a small non-negative symmetric matrix (the matrix of block bounds)."""
    M = torch.tensor(N, dtype=torch.float64)
    return _sym_spec(0.5 * (M + M.T))


def _row_std(U: torch.Tensor, eps: float) -> torch.Tensor:
    m = U - U.mean(-1, keepdim=True)
    return torch.sqrt((m * m).mean(-1) + eps)


def _check_numbers(what: str, obj, path: str = "") -> None:
    """Every float in ``obj`` (nested dicts, lists, tuples; ``None`` skipped) must be finite: the
    bounds are products of norms and of ``1/sigma`` of the LayerNorm rows, which can overflow
    float64 on finite inputs. Raises ``ValueError`` naming ``what`` and the entry."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_numbers(what, v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_numbers(what, v, f"{path}[{i}]")
    elif isinstance(obj, float) and not math.isfinite(obj):
        raise ValueError(f"{what}: {path or 'the result'} is {obj} on finite inputs: a value overflowed float64 (e.g. "
                         "LayerNorm rows of tiny var + ln_eps: 1/sigma of both LayerNorms enters the bounds up to four "
                         "times); rescale X or the weights, or use a larger ln_eps")


def check_setting(cfg: BlockConfig) -> None:
    """Theorems 1 and 6 cover the paper's block: one head, post-LN, ReLU, no biases, no
    ``W_O``, no LayerNorm affine, no causal mask (``ln_eps >= 0`` is allowed: the valid
    bound includes it), a LayerNorm (not RMSNorm), an ungated FFN, no RoPE, no per-projection biases. Raises ``ValueError`` naming the first option outside that setting."""
    if not isinstance(cfg, BlockConfig):
        raise ValueError(f"cfg must be a BlockConfig, got {type(cfg).__name__}")
    checks = (("n_heads", cfg.n_heads != 1, "1"), ("norm", cfg.norm != "post", "'post'"),
              ("activation", cfg.activation != "relu", "'relu'"), ("bias", cfg.bias, "False"),
              ("out_proj", cfg.out_proj, "False"), ("ln_affine", cfg.ln_affine, "False"),
              ("causal", cfg.causal, "False"), ("norm_type", cfg.norm_type != "layer", "'layer'"),
              ("gated", cfg.gated, "False"), ("qkv_bias", cfg.qkv_bias, "False"), ("rope", cfg.rope, "False"),
              ("n_kv_heads", cfg.kv_heads != cfg.n_heads, "None (n_heads)"))
    for name, bad, want in checks:
        if bad:
            raise ValueError(f"bounds: Theorems 1 and 6 cover the paper's setting; BlockConfig.{name} must be "
                             f"{want}, got {getattr(cfg, name)!r}")


# ----------------------------------------------------------------------------- LayerNorm


def layernorm_bounds(X: torch.Tensor, eps: float = 0.0) -> dict[str, float]:
    r"""Bounds on LayerNorm's Jacobian and second derivative at ``X`` (``(L, d)``), valid and printed.

    Returns a dict of floats:

    * ``jacobian`` :math:`= 1/\sigma_{\min}` — equal to :math:`\|J_{LN}\|_2` for ``d >= 3``
      (at ``d = 2`` an upper bound only: LayerNorm maps every row to ``±(1, -1)``, and its
      Jacobian vanishes with ``eps = 0``);
    * ``hessian`` :math:`= 2/(\sqrt{3d}\,\sigma_{\min}^2)` — bounds the second derivative as a
      bilinear map, :math:`\|D^2\mathrm{LN}[H, H']\|_F \le` ``hessian`` :math:`\|H\|_F\|H'\|_F`
      (sharp);
    * ``jacobian_paper``, ``hessian_paper``: the paper's lemma as printed (§3.4), with
      :math:`\sigma_{\min}` the minimum *row norm* of the centred input and ``‖X‖₂`` of ``X``;
      ``None`` where that row norm is 0 (a constant row, possible with ``eps > 0``: the printed
      lemma divides by it);
    * ``sigma_min`` (true row std, :math:`\sqrt{\mathrm{var}+\varepsilon}`), ``row_norm_min``.

    ``sigma_min`` includes ``eps``, so the valid bounds hold for any ``eps >= 0``. ``X`` is
    any floating dtype (computed in float64). Source: derived here, docs/bounds.md §LayerNorm;
    the paper's LayerNorm lemma (its typo 11, docs/derivations.md §15).

    Raises ``ValueError`` if ``X`` is not a finite floating ``(L, d)`` tensor, ``eps < 0``, a
    row's ``var + eps`` does not stand above its values' rounding and ``tiny/e``
    (:func:`~blockhess.validation.check_ln_variance`; with ``eps = 0``: zero variance,
    Assumption 2), or a value overflows float64.
    """
    if not isinstance(X, torch.Tensor) or X.ndim != 2 or not X.dtype.is_floating_point:
        raise ValueError(f"X must be a floating (L, d) tensor, got {getattr(X, 'shape', type(X))}")
    if not torch.isfinite(X).all():
        raise ValueError("X contains NaN or Inf")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    check_ln_variance("X", X, eps)
    X = X.double()
    L, d = X.shape
    sig = float(_row_std(X, eps).min())
    m = X - X.mean(-1, keepdim=True)
    rn = float(m.norm(dim=-1).min())
    xn = norm2(X)
    out = {
        "sigma_min": sig,
        "row_norm_min": rn,
        "jacobian": 1.0 / sig,
        "hessian": 2.0 / (math.sqrt(3.0 * d) * sig**2),
    }
    if rn > 0:
        out["jacobian_paper"] = 1.0 / rn + xn**2 / (math.sqrt(d) * rn**3)
        out["hessian_paper"] = (
            xn / rn**3 * (1.0 + math.sqrt(L / d)) + xn**2 / (math.sqrt(d) * rn**3) + 3.0 * xn**3 / (d * rn**5)
        )
    else:
        out["jacobian_paper"] = out["hessian_paper"] = None
    _check_numbers("layernorm_bounds", out)
    return out


def _paper_ln_lemma(L: int, d: int, xn: float, rn: float) -> tuple[float, float]:
    """The paper's LayerNorm lemma (§3.4) with ``‖X‖₂ <= xn`` and ``σ_min = rn > 0`` (row norm)."""
    J = 1.0 / rn + xn**2 / (math.sqrt(d) * rn**3)
    H = xn / rn**3 * (1.0 + math.sqrt(L / d)) + xn**2 / (math.sqrt(d) * rn**3) + 3.0 * xn**3 / (d * rn**5)
    return J, H


# ----------------------------------------------------------------------------- ingredients


def _loss_constants(loss, target, out: torch.Tensor) -> tuple[float, float]:
    """Exact ``(‖∇²ℓ‖₂, ‖∇ℓ‖₂)`` at the output ``out`` (``(L, d)``) of one sequence."""
    tgt = target[None] if isinstance(target, torch.Tensor) else target
    ld = losses.derivatives(loss, tgt, out[None])
    check_fits(3 * ld.hess[0].numel() * 8, f"the symmetrised float64 copies of the loss Hessian {tuple(ld.hess[0].shape)} "
               "for its eigenvalues", out.device)
    lam = max(_sym_spec(0.5 * (h + h.T)) for h in ld.hess)
    return lam, float(ld.grad.norm())


def ingredients(params: dict, X: torch.Tensor, cfg: BlockConfig, loss="mse", target=None) -> dict[str, Any]:
    r"""The ingredient bounds of Theorem 1 / Theorem 6 for one sequence, valid and as printed.

    ``X``: one sequence ``(L, d_model)``; ``params`` as :func:`~blockhess.config.param_shapes`;
    ``loss``/``target`` as :func:`blockhess.hessian` (one sequence). Returns a dict with

    * ``"valid"``: ``{"lam", "gam", "J": {W: ‖∂out/∂W‖ bound}, "zeta": {"QK": bilinear norm
      bound of ∂²out/∂W_Q∂W_K, ...}, "G", "Phi"`` (attention) and for the block ``"B", "xi",
      "J_Y", "eta_Y", "J_Z", "eta_Z", "J_SY"}``; ``lam >= ‖∇²ℓ‖₂``, ``gam >= ‖∇ℓ‖₂`` (for MSE
      in terms of ``‖X‖₂``, ``‖W‖₂`` and ``‖T‖_F``; for another loss their exact values);
    * ``"paper"``: the printed counterparts (MSE only; ``None`` for another loss, or when a
      LayerNorm input row is constant, possible with ``ln_eps > 0``: the printed lemma divides
      by its centred row norm), with the per-block printed bounds under ``"block"``;
    * ``"primitives"``: the norms they are built from (``x = ‖X‖₂``, ``w_Q = ‖W_Q‖₂``, ...);
    * ``"names"``: the parameter names, canonical order. For the block ``"valid"`` also holds
      ``"sigma_U"``, ``"sigma_S"``: the smallest row ``sqrt(var + eps)`` of the two LayerNorm
      inputs.

    Everything is computed in float64. Source: Theorem 1 and its lemmas, Theorem 6 and the
    LayerNorm lemma; valid constants derived here (docs/bounds.md).

    Raises ``ValueError`` on bad inputs (as :func:`blockhess.hessian`: a LayerNorm input row
    as :func:`~blockhess.validation.check_ln_variance`), or when a bound overflows float64;
    ``InsufficientMemoryError`` as :func:`blockhess.losses.derivatives` for a callable loss's Hessian, or
    before the symmetrised float64 copies of it that its eigenvalues take.
    """
    check_setting(cfg)
    check_inputs(params, X, cfg)
    params, X, target = detached(params, X, target)
    if X.ndim != 2:
        raise ValueError(f"ingredients: X must be one sequence (L, d_model), got {tuple(X.shape)}")
    X64 = X.double()
    p = {k: v.double() for k, v in params.items()}
    L, d = X.shape
    dk = p["W_Q"].shape[1]
    s = 1.0 / math.sqrt(dk)
    c2, c1 = SOFTMAX_HESSIAN_BOUND, SOFTMAX_JACOBIAN_BOUND
    x = norm2(X64)
    w = {k: norm2(v) for k, v in p.items()}
    wq, wk, wv = w["W_Q"], w["W_K"], w["W_V"]
    prim = {"L": L, "d": d, "d_k": dk, "x": x, **{f"w_{SHORT_NAMES[k]}": v for k, v in w.items()}}

    c = forward_cache(p, X64, cfg, plain=True)  # the block's own forward pass, in float64

    # attention layer: valid (derived here) and printed (Theorem 1 / §3.5)
    G = {"W_Q": c1 * s * wv * wk * x**3, "W_K": c1 * s * wv * wq * x**3, "W_V": math.sqrt(L) * x}
    Phi = {
        "QQ": c2 * s**2 * wv * wk**2 * x**5,
        "KK": c2 * s**2 * wv * wq**2 * x**5,
        "QK": c2 * s**2 * wv * wq * wk * x**5 + c1 * s * wv * x**3,
        "QV": c1 * s * wk * x**3,
        "KV": c1 * s * wq * x**3,
        "VV": 0.0,
    }
    Gp = {"W_Q": wv * wk * x**3 / (L * math.sqrt(dk)), "W_K": wv * wq * x**3 / (L * math.sqrt(dk)), "W_V": L * x}
    Phip = {
        "QQ": 12.0 / (L * d * dk) * wv * wk**2 * x**5,
        "KK": 12.0 / (L * d * dk) * wv * wq**2 * x**5,
        "QK": 12.0 / (L * d * dk) * wv * wk * wq * x**5 + 2.0 / (L**2 * math.sqrt(d * dk)) * wv * x**3,
        "QV": 2.0 / (L**2 * math.sqrt(d * dk)) * wk * x**3,
        "KV": 2.0 / (L**2 * math.sqrt(d * dk)) * wq * x**3,
        "VV": 0.0,
    }
    names = tuple(param_shapes(cfg))
    target = losses.check(loss, target[None] if isinstance(target, torch.Tensor) else target, X[None], single=True)
    target = target[0] if isinstance(target, torch.Tensor) else target
    is_mse = isinstance(loss, str) and loss == "mse"
    tF = float(target.double().norm()) if is_mse else None
    t2 = norm2(target.double()) if is_mse else None
    r = math.sqrt(min(L, d))

    if cfg.kind == "attention":
        out = c.out[0]
        if is_mse:
            lam = 2.0 / (L * d)
            gam = 2.0 / (L * d) * (r * math.sqrt(L) * x * wv + tF)
        else:
            lam, gam = _loss_constants(loss, target, out.to(X.dtype))
        valid = {"lam": lam, "gam": gam, "G": G, "Phi": Phi, "J": dict(G), "zeta": dict(Phi)}
        paper = None
        if is_mse:
            rho = r * (L * x * wv + t2)
            bp = {
                "VV": 2.0 * L / d * x**2,
                "QQ": 8.0 / (L**3 * d * dk) * wk**2 * wv**2 * x**6 + 12.0 / (d * dk) * rho * wv * wk**2 * x**5,
                "KK": 8.0 / (L**3 * d * dk) * wq**2 * wv**2 * x**6 + 12.0 / (d * dk) * rho * wv * wq**2 * x**5,
                "QV": 4.0 / (L * d * math.sqrt(dk)) * wv * wk * x**4
                + 4.0 * r / (L**2 * math.sqrt(dk)) * (L * x * wv + t2) * wk * x**3,
                "KV": 4.0 / (L * d * math.sqrt(dk)) * wv * wq * x**4
                + 4.0 * r / (L**2 * math.sqrt(dk)) * (L * x * wv + t2) * wq * x**3,
                "QK": 8.0 / (L**3 * d * dk) * wk * wq * wv**2 * x**6
                + 4.0 * rho / (L * d * math.sqrt(dk)) * wv * (3.0 * L * wk * wq * x**5 + d / L * x**3),
            }
            paper = {"G": Gp, "Phi": Phip, "block": bp, "all_factor": 3.0}
        _check_numbers("ingredients", {"valid": valid, "paper": paper, "primitives": prim})
        return {"valid": valid, "paper": paper, "primitives": prim, "names": names}

    # post-LN block (Theorem 6)
    eps = cfg.ln_eps
    w1, w2 = w["W_1"], w["W_2"]
    dff = p["W_1"].shape[1]
    check_forward(c)  # both LayerNorm inputs (check_ln_variance) and the output
    U, P, S, Z = c.U, c.fc.h, c.fc.S, c.out[0]  # X + SA(X), relu(Y W_1), Y + FFN(Y), LN(S)
    lnU, lnS = layernorm_bounds(U, eps), layernorm_bounds(S, eps)
    jY, eY, jZ, eZ = lnU["jacobian"], lnU["hessian"], lnS["jacobian"], lnS["hessian"]
    jSY = 1.0 + w1 * w2
    ynorm = math.sqrt(L * d)  # ‖Y‖₂ <= ‖Y‖_F <= √(L d): every row of LN has norm <= √d
    B = {"W_1": ynorm * w2, "W_2": ynorm * w1}
    B.update({k: jSY * jY * G[k] for k in ("W_Q", "W_K", "W_V")})
    xi = {"11": 0.0, "22": 0.0, "12": ynorm}
    att = ("W_Q", "W_K", "W_V")
    for k in att:
        xi["1" + SHORT_NAMES[k]] = w2 * jY * G[k]
        xi["2" + SHORT_NAMES[k]] = w1 * jY * G[k]
    for k, l in pairs(att):
        kl = pair_key(k, l)
        xi[kl] = jSY * (jY * Phi[kl] + eY * G[k] * G[l])
    zeta = {}
    for a, b in pairs(names):
        ab = pair_key(a, b)
        zeta[ab] = jZ * xi[_xi_key(ab)] + eZ * B[a] * B[b]
    J = {a: jZ * B[a] for a in names}
    if is_mse:
        lam = 2.0 / (L * d)
        gam = 2.0 / (L * d) * (math.sqrt(L * d) + tF)
    else:
        lam, gam = _loss_constants(loss, target, Z.to(X.dtype))
    valid = {
        "lam": lam, "gam": gam, "G": G, "Phi": Phi, "B": B, "xi": xi, "zeta": zeta, "J": J,
        "J_Y": jY, "eta_Y": eY, "J_Z": jZ, "eta_Z": eZ, "J_SY": jSY,
        "sigma_U": lnU["sigma_min"], "sigma_S": lnS["sigma_min"],
    }
    paper = None
    if is_mse and lnU["row_norm_min"] > 0 and lnS["row_norm_min"] > 0:  # the printed lemma divides by them
        Un = x + L * x * wv  # ‖X + F‖ <= ‖X‖ + ‖A‖‖X‖‖W_V‖ with the paper's ‖A‖ <= L
        Sn = math.sqrt(L * d) * (1.0 + math.sqrt(min(L, dff)) * w1 * w2)  # Proposition, §3.4
        jYp, hYp = _paper_ln_lemma(L, d, Un, lnU["row_norm_min"])
        jZp, hZp = _paper_ln_lemma(L, d, Sn, lnS["row_norm_min"])
        Bp = {"W_1": w2 * ynorm, "W_2": norm2(P)}
        Bp.update({k: jSY * jYp * Gp[k] for k in att})
        xip = {"11": 0.0, "22": 0.0, "12": math.sqrt(d) * ynorm}
        for k in att:
            xip["1" + SHORT_NAMES[k]] = math.sqrt(dff) * w2 * jYp * Gp[k]
            xip["2" + SHORT_NAMES[k]] = math.sqrt(d) * w1 * jYp * Gp[k]
        for k, l in pairs(att):
            kl = pair_key(k, l)
            xip[kl] = jSY * (Gp[k] * hYp * Gp[l] + jYp * Phip[kl])
        resid = float((Z - target.double()).norm())  # ‖R^tr‖₂ = ‖Z − T‖_F (not expanded in the paper)
        bp = {}
        for a, b in pairs(names):
            ab = pair_key(a, b)
            Htr = jZp * xip[_xi_key(ab)] + Bp[a] * hZp * Bp[b]
            # printed: (2/(L d))‖∂Z/∂W_i‖‖∂Z/∂W_j‖ + ‖R^tr‖‖H_tr‖ (no 2/(L d) on the second term)
            bp[ab] = 2.0 / (L * d) * (jZp * Bp[a]) * (jZp * Bp[b]) + resid * Htr
        paper = {
            "G": Gp, "Phi": Phip, "B": Bp, "xi": xip, "J_Y": jYp, "H_Y": hYp, "J_Z": jZp, "H_Z": hZp,
            "block": bp, "all_factor": 5.0,
        }
    prim.update({"d_ff": dff, "ln_eps": eps, "sigma_U": lnU["sigma_min"], "sigma_S": lnS["sigma_min"],
                 "T_fro": tF, "T_spec": t2})
    _check_numbers("ingredients", {"valid": valid, "paper": paper, "primitives": prim})
    return {"valid": valid, "paper": paper, "primitives": prim, "names": names}


def _xi_key(ab: str) -> str:
    """ξ keys: FFN–attention pairs are stored FFN first (``"1Q"``), others as ordered by QKV12."""
    if ab[0] in "QKV" and ab[1] in "12":
        return ab[1] + ab[0]
    return ab


# ----------------------------------------------------------------------------- bounds


class PairNorms(dict):
    """Norms keyed by pairs ``(a, b)`` (``a`` not after ``b``) and ``"all"``; indexing, ``in``
    and ``get`` take a pair in the other order too (``‖H[b, a]‖ = ‖H[a, b]ᵀ‖``). Indexing
    raises ``KeyError`` for a pair of names it does not hold in either order."""

    def _key(self, key):
        if isinstance(key, tuple) and len(key) == 2 and not dict.__contains__(self, key):
            return key[::-1]
        return key

    def __missing__(self, key):
        if self._key(key) == key or not dict.__contains__(self, self._key(key)):
            raise KeyError(key)
        return dict.__getitem__(self, self._key(key))

    def __contains__(self, key):
        return dict.__contains__(self, self._key(key))

    def get(self, key, default=None):
        return self[key] if key in self else default


def block_bounds(params: dict, X: torch.Tensor, cfg: BlockConfig, loss="mse", target=None) -> dict[str, Any]:
    r"""Per-block and whole-Hessian bounds (valid and printed), averaged over a batch.

    ``X``: ``(L, d_model)`` or ``(B, L, d_model)``; ``loss``/``target`` as
    :func:`blockhess.hessian`. Returns ``{"names", "outer", "functional", "full", "paper"}``:
    each of the first three maps an ordered name pair ``(a, b)`` (``a`` not after ``b``; a
    :class:`PairNorms`, which takes the other order too) to a float and has an ``"all"`` entry (the spectral norm of the symmetric matrix of block
    bounds); ``"paper"`` maps pairs to the printed per-block bound and ``"all"`` to
    ``√(m n)·max`` (``None`` entries for a loss other than MSE). Source: Theorems 1 and 6;
    derived here (docs/bounds.md).

    Raises ``ValueError`` and ``InsufficientMemoryError`` as :func:`ingredients`.
    """
    check_setting(cfg)
    check_inputs(params, X, cfg)
    params, X, target = detached(params, X, target)
    check_forward(forward_cache(params, X, cfg, plain=True))  # the whole batch at once: rows named as in X
    Xb = X[None] if X.ndim == 2 else X
    # a tensor target per sequence; anything else (one sequence's callable target) passed whole
    tb = losses.check(loss, target[None] if X.ndim == 2 and isinstance(target, torch.Tensor) else target, Xb,
                      single=X.ndim == 2)
    names = tuple(param_shapes(cfg))
    keys = pairs(names)
    acc = {k: PairNorms.fromkeys(keys + ["all"], 0.0) for k in ("outer", "functional", "full")}
    pap = PairNorms.fromkeys(keys + ["all"], 0.0)
    has_paper = True
    nB = Xb.shape[0]
    for bi in range(nB):
        ing = ingredients(params, Xb[bi], cfg, loss, tb[bi] if isinstance(tb, torch.Tensor) else tb)
        v = ing["valid"]
        mats = {k: [[0.0] * len(names) for _ in names] for k in ("outer", "functional", "full")}
        for a, b in keys:
            ab = pair_key(a, b)
            o = v["lam"] * v["J"][a] * v["J"][b]
            f = v["gam"] * v["zeta"][ab]
            ia, ib = names.index(a), names.index(b)
            for k, val in (("outer", o), ("functional", f), ("full", o + f)):
                acc[k][(a, b)] += val / nB
                mats[k][ia][ib] = mats[k][ib][ia] = val
        for k in mats:
            acc[k]["all"] += _perron(mats[k]) / nB
        if ing["paper"] is None:
            has_paper = False
        else:
            bp = ing["paper"]["block"]
            for a, b in keys:
                pap[(a, b)] += bp[pair_key(a, b)] / nB
            pap["all"] += ing["paper"]["all_factor"] * max(bp.values()) / nB
    if not has_paper:
        pap = PairNorms.fromkeys(pap)
    _check_numbers("block_bounds", {**acc, "paper": pap})
    return {"names": names, **acc, "paper": pap}


def exact_norms(H) -> dict[str, Any]:
    """Exact spectral norms of a :class:`~blockhess.HessianBlocks` and of its outer/functional parts.

    Returns ``{"full"|"outer"|"functional": {(a, b): float, ..., "all": float}}`` over the
    pairs of ``H.names`` (:meth:`~blockhess.HessianBlocks.pairs`; a :class:`PairNorms`, which
    takes a pair in either order); ``"all"`` is the spectral norm of the dense symmetric matrix
    (eigenvalues). Computed in float64 (:mod:`blockhess.linalg`) whatever the dtype of ``H``.

    Raises ``ValueError`` if ``H`` does not carry its outer and functional parts (it must be
    a result of :func:`blockhess.hessian` or :func:`blockhess.reference.hessian`, not one part);
    ``InsufficientMemoryError`` before any norm if three float64 ``n × n`` matrices (the
    symmetrised copy and the eigensolver's) would not fit; the parts are checked as they are made.
    """
    if not isinstance(H, HessianBlocks) or not H.has_parts:
        raise ValueError("H must be a full Hessian from blockhess.hessian (with .outer and .functional), "
                         f"got {type(H).__name__ if not isinstance(H, HessianBlocks) else 'a HessianBlocks without parts'}")
    out = {}
    n = sum(H.sizes)
    check_fits(3 * n * n * 8, f"the symmetrised float64 copies of the {n}x{n} Hessian for its eigenvalues", H.device)
    for key, part in (("full", H), ("outer", H.outer), ("functional", H.functional)):
        vals = PairNorms((pr, norm2(block)) for pr, block in part.items())
        D = part.dense()
        vals["all"] = _sym_spec((D + D.T).mul_(0.5))
        out[key] = vals
    _check_numbers("exact_norms", out)
    return out


def spectral_bounds(params: dict, X: torch.Tensor, cfg: BlockConfig, loss="mse", target=None) -> list[dict]:
    r"""Each Hessian block's exact spectral norm beside its bound (Theorem 1 or 6).

    Parameters
    ----------
    params, X, cfg
        As :func:`blockhess.hessian`: ``X`` is ``(L, d_model)`` or a batch ``(B, L, d_model)``,
        float32 or float64. ``cfg.kind="attention"``: Theorem 1; ``"block"``: Theorem 6 (the
        paper's setting is ReLU, ``ln_eps = 0``, no affine; the valid bound also holds for
        ``ln_eps > 0``).
    loss, target
        ``"mse"`` with a target shaped like ``X`` (the paper's loss, needed for
        ``bound_paper``), or ``"ce"`` / a callable (then the general-loss form of Theorem 6
        with the exact ``‖∇²ℓ‖₂`` and ``‖∇ℓ‖₂`` at the output; ``bound_paper`` is ``None``).

    Returns
    -------
    list of dict
        One row per unordered block pair in canonical order (``"block": "W_Q,W_K"``) and a
        last row ``"block": "all"``, each with floats ``norm`` (exact ‖H_ab‖₂), ``bound``
        (valid), ``bound_paper`` (printed constants, or ``None``), ``outer_norm``,
        ``functional_norm``, ``bound_outer``, ``bound_functional``, ``ratio``
        (``bound / norm``; ``None`` where the norm is 0), ``ratio_paper`` and
        ``paper_holds`` (``bound_paper >= norm`` up to a relative ``PAPER_TIE_RTOL = 1e-10``
        for attained bounds, or ``None``). Norms come from :func:`blockhess.hessian` (closed
        form). Runs on torch's current thread count; where other work shares the cores, call
        ``torch.set_num_threads(1)`` first (the CLI's ``--threads`` default; docs/results.md, "Threads").

    Raises
    ------
    ValueError
        As :func:`blockhess.hessian` (shapes, dtypes, NaN/Inf, target, zero-variance
        LayerNorm input with ``ln_eps = 0``), or a config outside the paper's setting
        (:func:`check_setting`: multi-head, pre-LN, GELU, biases, ``W_O``, affine LN, causal).
    InsufficientMemoryError
        As :func:`blockhess.hessian` and :func:`exact_norms`, before the allocation.

    Source: Theorem 1 and Theorem 6 of arXiv 2510.16927; valid constants
    derived here, see docs/bounds.md.
    """
    check_setting(cfg)
    H = loss_hessian(params, X, cfg, loss=loss, target=target)
    ex = exact_norms(H)
    bd = block_bounds(params, X, cfg, loss=loss, target=target)
    keys = pairs(bd["names"]) + ["all"]
    rows = []
    for k in keys:
        norm = ex["full"][k]
        bp = bd["paper"][k]
        row = {
            "block": "all" if k == "all" else f"{k[0]},{k[1]}",
            "norm": norm,
            "bound": bd["full"][k],
            "bound_paper": bp,
            "outer_norm": ex["outer"][k],
            "functional_norm": ex["functional"][k],
            "bound_outer": bd["outer"][k],
            "bound_functional": bd["functional"][k],
            "ratio": bd["full"][k] / norm if norm > 0 else None,
            "ratio_paper": (bp / norm if norm > 0 else None) if bp is not None else None,
            "paper_holds": (bp >= norm * (1 - PAPER_TIE_RTOL)) if bp is not None else None,
        }
        rows.append(row)
    _check_numbers("spectral_bounds", rows)
    return rows


# ----------------------------------------------------------------------------- ingredient checks

#: Φ blocks in the paper's orientation (∂G_a/∂W_b, rows (output, entry of W_a)).
_PHI_PAIRS = (("W_Q", "W_Q"), ("W_Q", "W_K"), ("W_V", "W_Q"), ("W_K", "W_K"), ("W_V", "W_K"))
_PHI_MAX_ELEMENTS = 2e7


def ingredient_checks(params: dict, X: torch.Tensor, cfg: BlockConfig, target=None) -> list[dict]:
    r"""Each ingredient of Theorems 1 / 6 next to its exact value, for one sequence.

    Rows ``{"ingredient", "exact", "bound", "bound_paper", "paper_holds", "note"}`` for
    ``dA/dT`` (max over rows of ``‖diag(a) − aaᵀ‖₂``; paper ``1/L``), ``A`` (``‖A‖₂``; paper
    ``L``, valid ``√L``), ``G_Q, G_K, G_V`` (``‖∂F/∂W‖₂``), the attention second derivatives
    ``Phi_QQ, Phi_QK, Phi_VQ, Phi_KK, Phi_VK`` (``‖Φ‖₂`` in the paper's layout; skipped above
    2·10⁷ entries), and for ``kind="block"`` also ``J_Y, J_Z`` (LayerNorm Jacobians),
    ``H_Y, H_Z`` (LayerNorm second derivatives, paper layout), ``J_SY`` and ``B_1, B_2, B_Q,
    B_K, B_V`` (``‖∂S/∂W‖₂``). ``bound`` is the valid bound in the same (layout) norm:
    for Φ and the LayerNorm Hessians the bilinear bound times ``√rank`` (docs/bounds.md).
    ``target`` (MSE, shaped like ``X``) is only needed for the printed Theorem-6 values.

    ``X``: one sequence ``(L, d_model)``; float64 recommended. Exact values come from the
    closed forms (:func:`blockhess.jacobian`, :func:`blockhess.second_derivative`,
    :mod:`blockhess.layernorm`). Source: the paper's auxiliary bounds and LayerNorm lemma
    (Theorems 1 and 6); derived here (docs/bounds.md).

    Raises ``ValueError`` as :func:`ingredients`; ``InsufficientMemoryError`` before any of
    them if the block's dense ingredients (``B_1``, ``L·d × d·d_ff``, and the LayerNorm second
    derivatives, ``L·d³``, each with its float64 copy) would not fit, or as the closed forms
    called (:func:`blockhess.jacobian`, :func:`blockhess.second_derivative`).
    """
    check_setting(cfg)
    check_inputs(params, X, cfg)
    params, X, target = detached(params, X, target)
    if X.ndim != 2:
        raise ValueError(f"ingredient_checks: X must be one sequence (L, d_model), got {tuple(X.shape)}")
    if target is None:
        target = torch.zeros_like(X)
    L, d = X.shape
    if cfg.kind == "block":  # B_1 (L·d × d·d_ff) and the LayerNorm second derivatives (L·d³), each with a float64 copy
        check_fits(16 * L * d * d * (cfg.d_ff + 2 * d), "the dense ingredient matrices of the block (B_1, the LayerNorm "
                   "Hessians) with their float64 copies", X.device)
    ing = ingredients(params, X, cfg, "mse", target)
    v, pp = ing["valid"], ing["paper"]

    def printed(*keys):  # the printed value, or None where ingredients has none (a constant LayerNorm row)
        return None if pp is None else functools.reduce(lambda t, k: t[k], keys, pp)
    rows: list[dict] = []

    def add(name, exact, bound, paper, note=""):
        rows.append({
            "ingredient": name, "exact": exact, "bound": bound, "bound_paper": paper,
            "paper_holds": None if (paper is None or exact is None) else bool(paper >= exact * (1 - PAPER_TIE_RTOL)),
            "note": note,
        })

    acfg = BlockConfig(d_model=cfg.d_model, d_k=cfg.d_k, kind="attention")
    ap = {k: params[k] for k in ("W_Q", "W_K", "W_V")}
    X64 = X.double()
    p64 = {k: t.double() for k, t in params.items()}
    c = forward_cache(p64, X64, cfg, plain=True)  # the block's own forward pass, in float64
    A = c.att.A[0]
    Sm = softmax.row_jacobians(A)
    add("dA/dT", max(_sym_spec(m) for m in Sm), SOFTMAX_JACOBIAN_BOUND, 1.0 / L,
        "paper: 1/L (uniform attention only)")
    add("A", norm2(A), math.sqrt(L), float(L), "row-stochastic: ‖A‖₂ <= √(‖A‖₁‖A‖_∞) <= √L")
    G = jacobian(ap, X, acfg)
    for k in ("W_Q", "W_K", "W_V"):
        add(f"G_{SHORT_NAMES[k]}", norm2(G[k]), v["G"][k], printed("G", k))
    sizes = {k: t.numel() for k, t in params.items()}
    for a, b in _PHI_PAIRS:
        key = pair_key(a, b)
        n_el = L * d * sizes[a] * sizes[b]
        exact = norm2(second_derivative(ap, X, acfg, a, b, of="F")) if n_el <= _PHI_MAX_ELEMENTS else None
        add(f"Phi_{SHORT_NAMES[a]}{SHORT_NAMES[b]}", exact, math.sqrt(min(L * d, sizes[a])) * v["Phi"][key], printed("Phi", key),
            "paper layout; printed bound carries a spurious 2/(L d)")
    if cfg.kind != "block":
        _check_numbers("ingredient_checks", rows)
        return rows
    eps = cfg.ln_eps
    U, Y, Dm, P, S = c.U, c.ln1[0], c.fc.D, c.fc.h, c.fc.S  # X + SA(X), LN_1, relu'(Y W_1), relu(Y W_1), Y + FFN(Y)
    for nm, inp, jv, ev in (("Y", U, v["J_Y"], v["eta_Y"]), ("Z", S, v["J_Z"], v["eta_Z"])):
        Jc = layernorm.jacobian(inp, eps, compact=True)
        Hc = layernorm.hessian(inp, eps, compact=True)
        add(f"J_{nm}", max(norm2(m) for m in Jc), jv, printed(f"J_{nm}"), "paper lemma uses the row norm as σ_min")
        add(f"H_{nm}", max(norm2(h.reshape(d * d, d)) for h in Hc), math.sqrt(d) * ev, printed(f"H_{nm}"),
            "paper layout, per token")
    JSY = ffn.input_jacobian(c.fc)  # I + W_2^T diag(D_t) W_1^T per token
    add("J_SY", max(norm2(m) for m in JSY), v["J_SY"], v["J_SY"])
    dff = p64["W_1"].shape[1]
    # B_1: rows y_t^T ⊗ W_2^T diag(D_t); B_2 = relu(Y W_1) ⊗ I; B_k = J_SY J_Y G_k per token
    B1 = (Y[:, None, :, None] * (p64["W_2"].T[None, :, None, :] * Dm[:, None, None, :])).reshape(L * d, d * dff)
    add("B_1", norm2(B1), v["B"]["W_1"], printed("B", "W_1"))
    add("B_2", norm2(P), v["B"]["W_2"], printed("B", "W_2"))
    EY = layernorm.jacobian(U, eps, compact=True)
    for k in ("W_Q", "W_K", "W_V"):
        Gk = G[k].double().reshape(L, d, -1)
        Bk = (JSY @ EY @ Gk).reshape(L * d, -1)
        add(f"B_{SHORT_NAMES[k]}", norm2(Bk), v["B"][k], printed("B", k))
    _check_numbers("ingredient_checks", rows)
    return rows
