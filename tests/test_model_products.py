"""A model's matrix-free Hessian–vector products (``blockhess.model.directional``, each stage's tangent
and second-order adjoint, the blocks' by ``blockhess.block.hvp``) against its dense closed-form Hessian."""

from __future__ import annotations

import math

import pytest
import torch

import blockhess as bh
from blockhess.block.directional import hvp
from blockhess.config import ModelConfig, model_param_shapes
from blockhess.model.directional import ModelProduct, fold_tied, unfold_tied
from blockhess.model.forward_pass import trace
from blockhess.model.stages import TIED_HEAD
from blockhess.model.walk import stages_of
from blockhess import losses
from blockhess.model.forward_pass import sequence_loss

from conftest import assert_close


def product(params, inputs, cfg, loss, target):
    inputs = inputs
    t = trace(params, inputs, cfg, derivatives=False)
    loss3, target3 = sequence_loss(cfg, loss, target, t.z)
    target3 = losses.check(loss3, target3, t.z)
    st, top = stages_of(t, loss3, target3, inputs.shape[0], 0, dense=False)
    return ModelProduct(st, top, cfg.d_model, hvp)


BLK = bh.BlockConfig(d_model=4, d_ff=6, n_heads=2, norm="pre", bias=True, out_proj=True, ln_affine=True, ln_eps=1e-5,
                     activation="gelu", causal=True)
POST = bh.BlockConfig(d_model=4, d_ff=5, d_k=3, bias=True, ln_affine=True, ln_eps=1e-5)
CASES = {
    "lm-tied": (ModelConfig(blocks=(BLK, BLK), embedding="token", vocab=5, positions="learned", n_positions=4,
                            final_norm=True, head=5, tied=True, head_bias=False), "tokens", "ce-token"),
    "vit": (ModelConfig(blocks=(BLK,), embedding="patch", image=(1, 4, 4), patch=2, cls_token=True, positions="learned",
                        n_positions=5, final_norm=True, pool="first", head=3), "images", "ce"),
    "bert-mse": (ModelConfig(blocks=(POST, POST), embedding="token", vocab=6, positions="learned", n_positions=4,
                             token_types=2, embed_norm=True), "tokens", "mse"),
    "linear-mean-callable": (ModelConfig(blocks=(POST,), embedding="linear", d_in=3, positions="sinusoidal",
                                         pool="mean", head=3), "features", "callable"),
}


def _case(name):
    cfg, kind, loss = CASES[name]
    gen = torch.Generator().manual_seed(0)
    B, L = 2, 3
    params = {k: v + 0.1 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in bh.init_params(cfg, 1).items()}
    if kind == "tokens":
        x = torch.randint(0, cfg.vocab, (B, L), generator=gen)
    elif kind == "images":
        x = torch.rand(B, *cfg.image, generator=gen, dtype=torch.float64)
    else:
        x = torch.randn(B, L, cfg.d_in, generator=gen, dtype=torch.float64)
    P = 1 if cfg.pool != "none" else L + int(cfg.cls_token)
    if loss == "ce":
        target = torch.randint(0, cfg.n_out, (B,), generator=gen)
    elif loss == "ce-token":
        loss, target = "ce", torch.randint(0, cfg.n_out, (B, P), generator=gen)
    elif loss == "mse":
        target = torch.randn(B, P, cfg.n_out, generator=gen, dtype=torch.float64)
    else:
        loss, target = (lambda z, t: (z.softmax(-1) * t).sum() ** 2), torch.randn(B, cfg.n_out, generator=gen,
                                                                                    dtype=torch.float64)
    return cfg, params, x, loss, target


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("part", ["full", "outer", "functional"])
def test_products_equal_dense_hessian(name, part):
    cfg, params, x, loss, target = _case(name)
    H = bh.hessian(params, x, cfg, loss=loss, target=target)
    D = {"full": H, "outer": H.outer, "functional": H.functional}[part].dense()
    shapes = model_param_shapes(cfg)
    gen = torch.Generator().manual_seed(1)
    k = 3
    Vflat = torch.randn(D.shape[0], k, generator=gen, dtype=torch.float64)
    V, off = {}, 0
    for n, s in shapes.items():
        size = math.prod(s)
        V[n] = Vflat[off:off + size].T.reshape(k, *s)
        off += size
    prod = product(params, x, cfg, loss, target)
    names = tuple(shapes) + ((TIED_HEAD,) if cfg.tied else ())
    internal = dict(shapes, **({TIED_HEAD: shapes["W_E"][::-1]} if cfg.tied else {}))
    HV = unfold_tied(prod(fold_tied(V, internal), names, outer=part != "functional", functional=part != "outer"))
    got = torch.cat([HV[n].reshape(k, -1) for n in shapes], 1).T
    assert_close(got, D @ Vflat, what=f"{name} {part} H @ V")
