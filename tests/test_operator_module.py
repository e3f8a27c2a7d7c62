"""``A.to_module(model)``: the closed-form Hessian operator in a module's own parameters (the order of
``model.parameters()``, each tensor in its storage layout), so autograd's gradients go in as they are.
Checked against double backward through the module's own forward (``torch.autograd.grad`` twice on
``torch.func.functional_call``, under ``sdpa_kernel(SDPBackend.MATH)``: the fused kernels have no second
derivative) to 1e-12 relative, and against ``H.to_module(model)``'s dense blocks times the vector.
Models as tests/test_adapters_models.py builds them: tiny configs, random weights, float64, eval."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils import parameters_to_vector

import blockhess as bh

from test_adapters_models import B, L, DT, bert_config, gpt2_config, randomise, token_ids, vit_config

tf = pytest.importorskip("transformers")

TOL = 1e-12  # a product against autograd's: the same derivatives summed in another order


def double_backward(model, loss, inputs, V: torch.Tensor) -> torch.Tensor:
    """``H V`` (``V`` ``(m, k)`` in ``parameters_to_vector``'s order) by ``torch.autograd.grad`` twice
    through ``functional_call(model, ...)`` on the flattened parameters (a tied tensor once)."""
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    sizes = [p.numel() for _, p in named]
    flat = torch.cat([p.reshape(-1) for _, p in named]).requires_grad_()
    with sdpa_kernel(SDPBackend.MATH):
        q = {n: c.reshape(p.shape) for (n, p), c in zip(named, flat.split(sizes))}
        g, = torch.autograd.grad(loss(torch.func.functional_call(model, q, (inputs,))), flat, create_graph=True)
        cols = [torch.autograd.grad(g, flat, grad_outputs=V[:, j], retain_graph=True)[0] for j in range(V.shape[1])]
    return torch.stack(cols, 1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def gpt2():
    model = randomise(tf.GPT2LMHeadModel(gpt2_config()))
    cfg, p = bh.from_torch(model)
    ids, y = token_ids(cfg), token_ids(cfg, seed=2)
    return model, cfg, p, ids, "ce", y, lambda out: F.cross_entropy(out.logits.reshape(-1, 32), y.reshape(-1))


def encoder():
    layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, activation="gelu", batch_first=True, dtype=DT)
    model = randomise(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), seed=16)
    cfg, p = bh.from_torch(model)
    g = torch.Generator().manual_seed(17)
    X, T = torch.randn(B, 4, 8, generator=g, dtype=DT), torch.randn(B, 4, 8, generator=g, dtype=DT)
    return model, cfg, p, X, "mse", T, lambda out: ((out - T) ** 2).mean()


def vit():
    model = randomise(tf.ViTForImageClassification(vit_config()), seed=6)
    cfg, p = bh.from_torch(model)
    g = torch.Generator().manual_seed(7)
    images, y = torch.randn(B, 3, 8, 8, generator=g, dtype=DT), torch.randint(0, 3, (B,), generator=g)
    return model, cfg, p, images, "ce", y, lambda out: F.cross_entropy(out.logits, y)


def bert():
    model = randomise(tf.BertModel(bert_config()), seed=11)
    cfg, p = bh.from_torch(model)
    ids = token_ids(cfg, low=1)
    T = torch.randn(B, L, 16, generator=torch.Generator().manual_seed(12), dtype=DT)
    return model, cfg, p, ids, "mse", T, lambda out: ((out.last_hidden_state - T) ** 2).mean()


MODELS = {"GPT2LMHeadModel": gpt2, "TransformerEncoder": encoder, "ViTForImageClassification": vit, "BertModel": bert}


@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_products_in_module_layout_equal_double_backward(make):
    model, cfg, p, inputs, loss, target, module_loss = make()
    A = bh.hessian_operator(p, inputs, cfg, loss=loss, target=target)
    M = A.to_module(model)
    params = list(model.parameters())
    assert list(M.names) == [n for n, _ in model.named_parameters()]
    assert [M.shapes[n] for n in M.names] == [tuple(t.shape) for t in params]
    m = sum(t.numel() for t in params)
    assert M.shape == (m, m)
    g = torch.Generator().manual_seed(5)
    V = torch.randn(m, 2, generator=g, dtype=DT)
    R = double_backward(model, module_loss, inputs, V)
    # a flat (m, k) tensor in parameters_to_vector's order
    assert rel(M @ V, R) <= TOL
    # one flat vector
    v = V[:, 0]
    assert rel(M @ v, R[:, 0]) <= TOL
    # a list shaped like model.parameters(): a list back, each tensor in its stored shape
    vs, off = [], 0
    for t in params:
        vs.append(v[off:off + t.numel()].reshape(t.shape))
        off += t.numel()
    assert torch.equal(parameters_to_vector(vs), v)
    out = M @ vs
    assert isinstance(out, list) and [tuple(o.shape) for o in out] == [tuple(t.shape) for t in params]
    assert rel(parameters_to_vector(out), R[:, 0]) <= TOL
    # a list with a trailing k on each tensor
    outk = M @ [V[o:o + t.numel()].reshape(*t.shape, 2) for t, o in zip(params, _offsets(params))]
    assert rel(torch.cat([o.reshape(-1, 2) for o in outk]), R) <= TOL
    # the dense Hessian in the module's names times V
    Hm = bh.hessian(p, inputs, cfg, loss=loss, target=target).to_module(model)
    assert rel(M @ V, Hm.dense() @ V) <= TOL


def _offsets(params):
    out, o = [], 0
    for t in params:
        out.append(o)
        o += t.numel()
    return out


def test_autograd_gradient_goes_in_as_it_is_and_unused_parameters_have_zero_rows():
    model, cfg, p, ids, loss, T, module_loss = bert()
    M = bh.hessian_operator(p, ids, cfg, loss=loss, target=T).to_module(model)
    with sdpa_kernel(SDPBackend.MATH):
        grads = torch.autograd.grad(module_loss(model(ids)), list(model.parameters()), allow_unused=True,
                                    materialize_grads=True)
    out = M @ list(grads)
    names = list(M.names)
    pooler = [i for i, n in enumerate(names) if n.startswith("pooler")]
    assert pooler and all(torch.equal(out[i], torch.zeros_like(out[i])) for i in pooler)
    assert any(out[i].abs().max() > 0 for i in range(len(out)) if i not in pooler)
    # a direction in the pooler alone changes nothing: exact zeros everywhere
    only = [torch.zeros_like(t) for t in grads]
    only[pooler[0]] = torch.ones_like(only[pooler[0]])
    assert all(not o.any() for o in M @ only)
    # BERT's token type rows past 0 are not used either
    tt = names.index("embeddings.token_type_embeddings.weight")
    assert not out[tt][1:].any() and out[tt][0].any()


def test_views_of_the_module_operator_and_module_operators_of_views():
    model, cfg, p, ids, loss, y, _ = gpt2()
    A = bh.hessian_operator(p, ids, cfg, loss=loss, target=y)
    M = A.to_module(model)
    # a square view of whole parameters: the module parameters whose stored tensors it covers
    ours = ["W_E", "blocks.0.W_Q", "blocks.0.W_K", "blocks.0.W_V"]
    S = A[ours, ours].to_module(model)
    assert S.names == ("transformer.wte.weight", "transformer.h.0.attn.c_attn.weight")
    assert S.cfg is None and S.is_symmetric
    v = torch.randn(S.shape[1], 3, generator=torch.Generator().manual_seed(1), dtype=DT)
    assert rel(S @ v, M[S.names, S.names] @ v) <= TOL
    # the same from a Hessian over wrt=ours
    part = bh.hessian(p, ids, cfg, loss=loss, target=y, wrt=ours).to_module(model)
    assert rel(S @ v, part.dense() @ v) <= TOL
    # in another order the module operator keeps the module's order
    assert A[ours[::-1], ours[::-1]].to_module(model).names == S.names
    with pytest.raises(ValueError, match=r"this is the off-diagonal view with rows \['W_E'\]"):
        A["W_E", "W_P"].to_module(model)
    with pytest.raises(ValueError, match=r"\['blocks.0.W_Q#0'\] are heads, parts of a stored tensor"):
        A["blocks.0.W_Q#0", "blocks.0.W_Q#0"].to_module(model)
    with pytest.raises(ValueError, match=r"c_attn.weight stores blocks.0.W_Q, blocks.0.W_K, blocks.0.W_V together, "
                                         r"but this operator has only blocks.0.W_Q"):
        A["blocks.0.W_Q", "blocks.0.W_Q"].to_module(model)


def test_a_block_and_its_diagonal():
    block = randomise(tf.GPT2Model(gpt2_config(n_layer=1))).h[0]
    cfg, p = bh.from_torch(block)
    g = torch.Generator().manual_seed(20)
    X, T = torch.randn(B, L, 16, generator=g, dtype=DT), torch.randn(B, L, 16, generator=g, dtype=DT)
    M = bh.hessian_operator(p, X, cfg, target=T).to_module(block)
    Hm = bh.hessian(p, X, cfg, target=T).to_module(block)
    assert M.names == Hm.names
    D = Hm.dense()
    assert rel(M.diagonal(), torch.diagonal(D)) <= TOL
    a, b = "attn.c_attn.weight", "mlp.c_fc.weight"
    assert rel(M[a, b].dense(), Hm[a, b]) <= TOL


def test_refusals():
    model, cfg, p, ids, loss, y, _ = gpt2()
    other = randomise(tf.GPT2LMHeadModel(gpt2_config(n_layer=1)))
    A = bh.hessian_operator(p, ids, cfg, loss=loss, target=y)
    with pytest.raises(ValueError, match=r"A is the Hessian operator of another architecture than module GPT2LMHeadModel "
                                         r"\(A's vs the module's: \d+ vs 1 blocks\)"):
        A.to_module(other)
    with pytest.raises(ValueError, match="to_module maps an operator to the parameters of a module"):
        A.to_module("gpt2")
    # an operator without a cfg (a dense one) of parameters the module does not have
    D = bh.operators.HessianOperator.from_dense(torch.eye(3, dtype=DT), names=["W_E"], shapes={"W_E": (3,)})
    with pytest.raises(ValueError, match=r"A's parameters \[\('W_E', \(3,\)\)\] are not parameters of GPT2LMHeadModel"):
        D.to_module(model)
    M = A.to_module(model)
    with pytest.raises(ValueError, match="a list V must hold 28 tensors"):
        M @ list(model.parameters())[:3]
