"""Shared settings and the comparison rule of the suite.

Every closed form is compared with ``torch.func`` in float64 by the relative Frobenius
error ``‖A − B‖_F / ‖B‖_F <= 1e-10`` (DESIGN.md §4). Where the reference is exactly zero
(e.g. the query/key derivatives at ``L = 1``, where softmax is constant), the closed form
must be zero too, up to ``1e-10`` times the given ``scale``.
"""

from __future__ import annotations

import pytest
import torch

import blockhess as bh
from blockhess.linalg import rel_error

TOL = 1e-10


def rel_err(A: torch.Tensor, B: torch.Tensor, scale: float | None = None) -> float:
    """:func:`blockhess.linalg.rel_error` ``‖A − B‖_F / ‖B‖_F``; ``‖A − B‖_F / scale`` when ``‖B‖_F``
    is below ``1e-12·scale`` (a reference that is zero up to rounding)."""
    assert A.shape == B.shape, f"shape {tuple(A.shape)} != reference {tuple(B.shape)}"
    ref = B.norm().item()
    if ref <= 1e-12 * (scale if scale is not None else 0.0):
        assert scale, "reference is exactly zero: give a scale"
        return rel_error(A, B, scale)
    return rel_error(A, B)


def assert_close(A, B, scale=None, tol=TOL, what=""):
    err = rel_err(A, B, scale)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


def make_case(L, d, d_k, d_ff, batch, scale, kind="block", seed=0, ln_eps=0.0):
    """Config, float64 params and inputs ``X`` (``(L, d)`` if ``batch`` is None) at ``scale``."""
    cfg = bh.BlockConfig(d_model=d, d_ff=d_ff, d_k=d_k, kind=kind, ln_eps=ln_eps)
    params = bh.init_params(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    shape = (L, d) if batch is None else (batch, L, d)
    X = scale * torch.randn(shape, generator=g, dtype=torch.float64)
    return cfg, params, X, g


# (L, d_model, d_k, d_ff, batch, input scale): L = 1, d_k != d_model, odd sizes, batches
# of one and of several, tiny and large inputs.
GRID = [
    (3, 4, 2, 5, None, 1.0),
    (1, 4, 4, 6, None, 1.0),
    (5, 3, 5, 7, None, 1.0),
    (4, 6, 3, 5, 1, 1.0),
    (3, 5, 2, 4, 3, 1.0),
    (4, 4, 2, 6, 2, 1e-2),
    (3, 4, 3, 5, None, 10.0),
    (2, 3, 1, 3, 4, 10.0),
]
GRID_IDS = [f"L{c[0]}-d{c[1]}-dk{c[2]}-ff{c[3]}-B{c[4]}-s{c[5]:g}" for c in GRID]


@pytest.fixture(params=GRID, ids=GRID_IDS)
def grid_case(request):
    return request.param


def randomize_vectors(params: dict, seed: int = 0) -> dict:
    """Biases and LayerNorm shifts drawn ``0.3·N(0, 1)``, scales ``1 + 0.5·N(0, 1)``: nothing hides
    behind the usual initial zeros and ones (``bh.init_params`` gives those)."""
    g = torch.Generator().manual_seed(seed + 7)
    out = dict(params)
    for k, v in params.items():
        if v.ndim == 1:
            r = torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.dtype)
            out[k] = 1 + 0.5 * r if k.startswith("gamma") else 0.3 * r
    return out
