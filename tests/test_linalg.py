"""blockhess.linalg: eigendecompositions and 2-norms in float64 for any input dtype, on the
float32 matrix where LAPACK's float32 eigh fails to converge (a block's functional term,
two thirds exact zeros), with results in the input's dtype."""

from __future__ import annotations

import math

import pytest
import torch

import blockhess as bh
from blockhess import linalg

from conftest import assert_close, rounding


def _functional_term_float32() -> torch.Tensor:
    """The symmetrised float32 functional term on which ``torch.linalg.eigh`` raises (seed 1)."""
    cfg = bh.BlockConfig(d_model=4, d_ff=6, kind="block")
    params = bh.init_params(cfg, seed=1, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    X, T = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    D = bh.hessian(params, X, cfg, loss="mse", target=T).functional.dense()
    return 0.5 * (D + D.T)


def test_eigh_and_eigvalsh_in_float64():
    S = _functional_term_float32()
    assert (S == 0).float().mean() > 0.6
    ref = torch.linalg.eigvalsh(S.double())
    lam = linalg.eigvalsh(S)
    assert lam.dtype == torch.float32
    eps32 = torch.finfo(torch.float32).eps
    assert_close(lam, ref.float(), tol=eps32, what="eigvalsh")  # float64's eigenvalues, rounded to float32
    lam, U = linalg.eigh(S)
    assert lam.dtype == U.dtype == torch.float32
    assert_close(lam, ref.float(), tol=eps32, what="eigh values")
    # products of n float32 factors: conftest.rounding
    assert_close(U @ torch.diag(lam) @ U.T, S, tol=rounding(S), what="eigh reconstruction")
    assert_close(U.T @ U, torch.eye(S.shape[0]), tol=rounding(S), what="orthonormal eigenvectors")


def test_norm2_in_float64():
    M = torch.randn(7, 5, generator=torch.Generator().manual_seed(2))  # float32
    want = float(torch.linalg.matrix_norm(M.double(), ord=2))
    assert abs(linalg.norm2(M) - want) <= 1e-15 * want  # float32 arithmetic would be ~1e-7 off
    assert linalg.norm2(M[:0]) == 0.0


def test_rel_error_is_the_relative_frobenius_error():
    g = torch.Generator().manual_seed(3)
    A, B = torch.randn(4, 3, 2, generator=g, dtype=torch.float64), torch.randn(4, 3, 2, generator=g, dtype=torch.float64)
    want = float(torch.sqrt(((A - B) ** 2).sum() / (B**2).sum()))
    assert abs(linalg.rel_error(A, B) - want) <= 1e-15 * want
    assert abs(linalg.rel_error(A, B, scale=2.0) - float(torch.sqrt(((A - B) ** 2).sum())) / 2.0) <= 1e-15 * want
    Z = torch.zeros(3, 3)
    assert linalg.rel_error(Z, Z) == 0.0 and linalg.rel_error(B, B) == 0.0
    assert linalg.rel_error(torch.ones(3, 3), Z) == math.inf
    assert linalg.rel_error(torch.ones(3, 3), Z, scale=3.0) == 1.0


def test_rel_error_sums_in_float64():
    # float32 entries of size 1e20: their squares overflow float32 (inf), not float64
    B = torch.full((4,), 1e20, dtype=torch.float32)
    A = B * 1.5
    assert linalg.rel_error(A, B) == 0.5


def test_rel_error_refuses_mismatched_shapes_and_bad_scales():
    with pytest.raises(ValueError, match=r"shape \(2, 3\).*\(3, 2\)"):
        linalg.rel_error(torch.zeros(2, 3), torch.zeros(3, 2))
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="scale"):
            linalg.rel_error(torch.zeros(2), torch.zeros(2), scale=bad)
