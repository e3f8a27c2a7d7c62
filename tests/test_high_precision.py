"""The closed form against a 40-digit oracle, where float64 autograd is itself inexact.

At large input scales the softmax saturates and the loss Hessian becomes ill-conditioned in
its inputs: there the closed form and ``torch.func`` differ by ~1e-10 (relative to the
functional term), and the question is which one is right: the 40-digit oracle of
tests/oracle.py (mpmath hyper-dual numbers, the float64 inputs taken exactly) is the truth.
"""

import pytest
import torch

import blockhess as bh

from oracle import along


@pytest.mark.parametrize("kind, scale", [("attention", 10.0), ("block", 10.0), ("block", 1.0)])
def test_closed_form_against_a_40_digit_oracle(kind, scale):
    """Each part along random directions is as close to the truth as torch.func's, in units of
    the full Hessian's norm times the directions' norms."""
    L, d, dk, B = 4, 6, 3, 2
    cfg = bh.BlockConfig(d_model=d, d_ff=5, d_k=dk, kind=kind)
    params = bh.init_params(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    X = scale * torch.randn(B, L, d, generator=g, dtype=torch.float64)
    T = torch.randn(B, L, d, generator=g, dtype=torch.float64)
    H = bh.hessian(params, X, cfg, loss="mse", target=T)
    R = bh.reference.hessian(params, X, cfg, loss="mse", target=T)
    parts = {"full": (H.dense(), R.dense()), "outer": (H.outer.dense(), R.outer.dense()),
             "functional": (H.functional.dense(), R.functional.dense())}
    norm = float(H.dense().norm())
    worst = {"closed form": 0.0, "torch.func": 0.0}
    for _ in range(3):
        v = torch.randn(sum(H.sizes), generator=g, dtype=torch.float64)
        w = torch.randn(sum(H.sizes), generator=g, dtype=torch.float64)
        unit = norm * float(v.norm() * w.norm())
        for (ours, ref), true in zip(parts.values(), along(params, X, T, cfg, v, w)):
            worst["closed form"] = max(worst["closed form"], abs(float(v @ ours @ w) - float(true)) / unit)
            worst["torch.func"] = max(worst["torch.func"], abs(float(v @ ref @ w) - float(true)) / unit)
    # at least as close to the truth as float64 autograd (up to 2x), and at float64 rounding
    # times this problem's conditioning: measured 2.7e-13 (torch.func 3.0e-13) for attention
    # at scale 10, where the softmax saturates; 5e-16 and 2e-17 for the block
    assert worst["closed form"] <= max(2 * worst["torch.func"], 1e-15), worst
    assert worst["closed form"] <= 1e-12, worst
