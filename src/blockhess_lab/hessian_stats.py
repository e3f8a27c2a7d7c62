"""What the report measures on a dense Hessian laid out in named blocks, the same for a block's
Hessian and a whole model's: block slices, errors against a reference, the float32 verdict,
norms per block pair and eigenvalue summaries.

A layout is the parameter names in the Hessian's order and their sizes (``H.names``,
``H.sizes``); matrices are dense ``(n, n)`` tensors in that order, and a *part* is one of
``"full"``, ``"outer"``, ``"functional"`` (paper eq. 10).
"""

from __future__ import annotations

import torch

from blockhess import linalg
from blockhess.linalg import rel_error
from blockhess.result import pairs

__all__ = ["PARTS", "FLOAT32_FACTOR", "BLOCK_FLOOR", "offsets", "block", "group_block", "compare", "float32_verdict", "pair_norms",
           "eig_summary"]

PARTS = ("full", "outer", "functional")
#: A float32 closed form passes within this factor of float32 autograd's own error on the same inputs
#: (the rule of the test suite, tests/conftest.py).
FLOAT32_FACTOR = 3.0
EPS32 = torch.finfo(torch.float32).eps


def _fro(t: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(t.to(torch.float64)))


def offsets(sizes) -> list[int]:
    """Where each block starts, and the total: ``[0, s0, s0 + s1, ...]``."""
    off = [0]
    for s in sizes:
        off.append(off[-1] + int(s))
    return off


def block(D: torch.Tensor, names, sizes, a: str, b: str) -> torch.Tensor:
    """The ``(a, b)`` block of ``D`` (a view)."""
    off, names = offsets(sizes), list(names)
    i, j = names.index(a), names.index(b)
    return D[off[i]:off[i + 1], off[j]:off[j + 1]]


def group_block(D: torch.Tensor, names, sizes, group) -> torch.Tensor:
    """The diagonal block of the parameters ``group`` together (in the layout's order; a copy)."""
    off, names = offsets(sizes), list(names)
    idx = torch.cat([torch.arange(off[names.index(g)], off[names.index(g) + 1]) for g in group])
    return D[idx][:, idx]


#: A block pair is measured against its own norm, or against this fraction of its whole part's
#: rounding scale where that is larger: ``ROUND·ε64 / 1e-10`` (``ROUND = 4``), so that a block the
#: reference holds only as rounding at the whole's scale passes at 1e-10 exactly when the test suite's
#: rule ``‖C − R‖ <= 1e-10 ‖R_block‖ + ROUND·ε·‖R_whole‖`` (tests/conftest.py) passes it, within a
#: factor 2. The whole's scale is the part's norm, and for the functional part, which the reference
#: forms as full − outer, ``‖R_full‖ + ‖R_outer‖`` (its rounding is theirs): a functional block that is
#: exactly zero (a model's (W_H, W_H) block) is only rounding there.
BLOCK_FLOOR = 4.0 * torch.finfo(torch.float64).eps / 1e-10


def compare(closed: dict, ref: dict, names, sizes) -> dict:
    """Relative Frobenius errors of the closed form against the reference, per part: of the whole
    matrix, of each block pair (against ``max(‖R_block‖, BLOCK_FLOOR · the part's scale)``,
    :data:`BLOCK_FLOOR`) and the largest over the pairs; ``max_rel_error`` the largest of all."""
    norm = {part: _fro(ref[part]) for part in ref}
    out = {}
    for part in closed:
        whole = norm[part] or 1.0
        scale_whole = norm["full"] + norm["outer"] if part == "functional" and {"full", "outer"} <= set(norm) else whole
        per = {}
        for a, b in pairs(names):
            R = block(ref[part], names, sizes, a, b)
            scale = max(_fro(R), BLOCK_FLOOR * scale_whole)
            per[f"{a},{b}"] = rel_error(block(closed[part], names, sizes, a, b), R, scale)
        out[part] = {"whole": rel_error(closed[part], ref[part], whole), "max_over_blocks": max(per.values()),
                     "blocks": per}
    return {"max_rel_error": max(e["max_over_blocks"] for e in out.values()), "by_part": out}


def float32_verdict(closed: dict, autograd32: dict, ref: dict, factor: float = FLOAT32_FACTOR) -> dict:
    """A float32 closed form judged by float32 autograd's own error, per part (whole matrices).

    ``closed``, ``autograd32``: float32 matrices per part, the closed form's and
    :func:`blockhess.reference.hessian`'s on the same float32 inputs; ``ref``: the float64 reference.
    A part passes when ``‖C − R‖ <= factor · max(‖A − R‖, ‖fl32(R) − R‖, terms)``, ``terms`` for the
    full Hessian ``max(ε32 (‖R_outer‖ + ‖R_functional‖), ‖A_outer − R_outer‖ + ‖A_functional − R_functional‖)``
    (the closed form assembles it from its two parts, and their rounding stays where they cancel),
    the rule of the test suite (tests/conftest.py, ``assert_float32_close``). Every error is given
    relative to ``‖R‖``."""
    out = {}
    for part in closed:
        R = ref[part].to(torch.float64)
        den = _fro(R) or 1.0
        err = _fro(closed[part].double() - R)
        own = _fro(autograd32[part].double() - R)
        rounding = _fro(R.float().double() - R)
        terms = 0.0
        if part == "full" and "outer" in ref and "functional" in ref:
            terms = max(EPS32 * (_fro(ref["outer"]) + _fro(ref["functional"])),
                        sum(_fro(autograd32[p].double() - ref[p].double()) for p in ("outer", "functional")))
        allowed = factor * max(own, rounding, terms)
        out[part] = {"error": err / den, "autograd_error": own / den, "rounding_error": rounding / den,
                     "terms_error": terms / den, "allowed": allowed / den, "passed": err <= allowed}
    return out


def pair_norms(parts: dict, names, sizes, spectral: bool = True) -> dict:
    """Per block pair ``"a,b"`` and part: Frobenius norm, spectral norm (with ``spectral``) and the
    largest absolute entry."""
    out = {}
    for a, b in pairs(names):
        entry = {}
        for part, D in parts.items():
            M = block(D, names, sizes, a, b)
            entry[part] = {"fro": _fro(M), "max_abs": float(M.abs().max())}
            if spectral:
                entry[part]["spectral"] = linalg.norm2(M)
        out[f"{a},{b}"] = entry
    return out


def eig_summary(lam: torch.Tensor, eps: float) -> dict:
    """Extremes and sign counts of the eigenvalues ``lam``; counts beyond ``n·eps·max|λ|``."""
    lam = lam.to(torch.float64)
    n = lam.numel()
    big = float(lam.abs().max())
    tol = n * eps * big
    return {
        "n": n,
        "min": float(lam.min()),
        "max": float(lam.max()),
        "max_abs": big,
        "n_negative": int((lam < -tol).sum()),
        "n_positive": int((lam > tol).sum()),
        "n_near_zero": int((lam.abs() <= tol).sum()),
        "negative_tolerance": tol,
        "sum_negative": float(lam[lam < -tol].sum()),
        "sum_positive": float(lam[lam > tol].sum()),
    }
