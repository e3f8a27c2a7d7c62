"""blockhess.config: BlockConfig's defaults (the paper's setting), the parameter names and shapes it
gives, and the options it refuses."""

import pytest
import torch

import blockhess as bh


def test_defaults_are_the_papers_setting():
    cfg = bh.BlockConfig(d_model=4, d_ff=6)
    assert cfg.is_paper and tuple(bh.param_shapes(cfg)) == ("W_Q", "W_K", "W_V", "W_1", "W_2")
    assert tuple(bh.param_shapes(bh.BlockConfig(kind="attention"))) == ("W_Q", "W_K", "W_V")
    full = bh.BlockConfig(d_model=4, d_ff=6, n_heads=2, bias=True, out_proj=True, ln_affine=True)
    assert tuple(bh.param_shapes(full)) == ("W_Q", "b_Q", "W_K", "b_K", "W_V", "b_V", "W_O", "b_O", "gamma_1", "beta_1",
                                             "W_1", "b_1", "W_2", "b_2", "gamma_2", "beta_2")
    p0, p1 = bh.init_params(cfg, seed=3), bh.init_params(full, seed=3)
    for n in p0:  # the matrices are drawn in canonical order: the paper's weights do not move
        if n in ("W_Q", "W_K", "W_V"):
            assert torch.equal(p0[n], p1[n])
    assert torch.equal(p1["gamma_1"], torch.ones(4, dtype=torch.float64)) and torch.count_nonzero(p1["b_Q"]) == 0


def test_config_errors():
    with pytest.raises(ValueError, match="activation must be one of"):
        bh.BlockConfig(activation="swish")
    with pytest.raises(ValueError, match="norm must be one of"):
        bh.BlockConfig(norm="sandwich")
    with pytest.raises(ValueError, match="divisible by n_heads"):
        bh.BlockConfig(d_model=6, n_heads=4)
    with pytest.raises(ValueError, match="norm='pre' has no meaning for kind='attention'"):
        bh.BlockConfig(kind="attention", norm="pre")
    with pytest.raises(ValueError, match="causal must be True or False"):
        bh.BlockConfig(causal=1)
    cfg = bh.BlockConfig(d_model=4, d_ff=5, norm="pre")
    p = bh.init_params(cfg)
    X = torch.randn(3, 4, dtype=torch.float64)
    X[1] = 0.5
    with pytest.raises(ValueError, match=r"X \(the LayerNorm-1 input, pre-LN\): LayerNorm input row \(1,\) has zero variance"):
        bh.hessian(p, X, cfg, target=torch.zeros_like(X))
    with pytest.raises(ValueError, match="wrt must be a non-empty subset .*; the input X is a variable with wrt_input=True"):
        bh.hessian(p, X + torch.arange(4.0, dtype=torch.float64), cfg, target=torch.zeros_like(X), wrt="X")
