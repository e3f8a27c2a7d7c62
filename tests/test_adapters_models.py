"""Whole models and Hugging Face blocks through the adapters: ``bh.from_torch(model)`` reproduces the
module's own forward to 1e-12, and ``bh.hessian(...).to_module(model)`` equals autograd's Hessian of
the module's own loss through ``torch.func.functional_call`` on its flattened ``named_parameters``
(double backward, ``torch.autograd.functional.hessian(vectorize=True)``, under
``sdpa_kernel(SDPBackend.MATH)``: the fused kernels have no second derivative; not ``torch.func.hessian``,
whose second derivative through ``F.layer_norm`` with a weight is wrong in torch 2.13,
docs/derivations.md §9) to 1e-10. Models are built from tiny configs with random weights (nothing
downloaded), float64, eval mode, ``attn_implementation="sdpa"`` (ViT's eager attention takes its
softmax in float32). The settings refused are each named.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import blockhess as bh

from conftest import assert_close, fro, rounding

tf = pytest.importorskip("transformers")

DT = torch.float64
FORWARD_TOL = 1e-12  # a forward pass: the module's operations in another order, rounding only
B, L = 2, 5


def randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    """Weights away from transformers' initialisation (std 0.02 leaves attention near uniform and the
    model near linear): matrices and tables N(0, 0.4²), LayerNorm scales 1 + N(0, 0.3²), every other
    vector N(0, 0.2²); float64, eval mode."""
    g = torch.Generator().manual_seed(seed)
    model = model.double().eval()
    lns = {n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)}
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=DT)
            if n.rsplit(".", 1)[0] in lns and n.endswith("weight"):
                p.copy_(1 + 0.3 * noise)
            else:
                p.copy_((0.4 if p.ndim > 1 or n.endswith(("cls_token", "position_embeddings")) else 0.2) * noise)
    return model


def gpt2_config(**kw):
    base = dict(n_embd=16, n_head=2, n_layer=2, vocab_size=32, n_positions=8, n_inner=16, attn_implementation="sdpa",
                bos_token_id=0, eos_token_id=0)
    return tf.GPT2Config(**{**base, **kw})


def vit_config(**kw):
    base = dict(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=32, num_labels=3, attn_implementation="sdpa")
    return tf.ViTConfig(**{**base, **kw})


def bert_config(**kw):
    base = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=16, attn_implementation="sdpa")
    return tf.BertConfig(**{**base, **kw})


def module_hessian(model: nn.Module, loss, inputs, *args) -> torch.Tensor:
    """Autograd's Hessian of ``loss(model(inputs, *args))`` w.r.t. the flattened ``named_parameters``
    (a tied tensor once), by double backward through ``functional_call``."""
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    sizes = [p.numel() for _, p in named]

    def f(flat):
        q = {n: c.reshape(p.shape) for (n, p), c in zip(named, flat.split(sizes))}
        return loss(torch.func.functional_call(model, q, (inputs, *args)))

    with sdpa_kernel(SDPBackend.MATH):
        return torch.autograd.functional.hessian(f, torch.cat([p.reshape(-1) for _, p in named]), vectorize=True)


def check_hessian(model, Hm, R):
    assert list(Hm.names) == [n for n, _ in model.named_parameters()]
    assert all(Hm.shapes[n] == tuple(p.shape) for n, p in model.named_parameters())
    D = Hm.dense()
    assert_close(D, R, what=f"{type(model).__name__} Hessian")
    assert fro(D - D.T) <= rounding(D) * fro(D)


def token_ids(cfg, seed=1, low=0):
    return torch.randint(low, cfg.vocab, (B, L), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- models

def test_gpt2_lm_head_model():
    model = randomise(tf.GPT2LMHeadModel(gpt2_config()))
    cfg, p = bh.from_torch(model)
    assert cfg.tied and cfg.head == 32 and not cfg.head_bias and cfg.embedding == "token" and cfg.final_norm
    assert all(b.causal and b.norm == "pre" and b.activation == "gelu_tanh" for b in cfg.blocks)
    assert model.lm_head.weight is model.transformer.wte.weight  # one tensor, listed once
    ids, y = token_ids(cfg), token_ids(cfg, seed=2)
    with torch.no_grad():
        logits = model(ids).logits
    assert_close(bh.forward(p, ids, cfg), logits, tol=FORWARD_TOL, what="forward")
    H = bh.hessian(p, ids, cfg, loss="ce", target=y)
    R = module_hessian(model, lambda out: F.cross_entropy(out.logits.reshape(-1, 32), y.reshape(-1)), ids)
    check_hessian(model, H.to_module(model), R)


def test_gpt2_model_and_a_callable_loss():
    model = randomise(tf.GPT2Model(gpt2_config(n_embd=8, n_inner=16, vocab_size=16)), seed=3)
    cfg, p = bh.from_torch(model)
    assert cfg.head is None and cfg.pool == "none"
    ids = token_ids(cfg)
    with torch.no_grad():
        hidden = model(ids).last_hidden_state
    assert_close(bh.forward(p, ids, cfg), hidden, tol=FORWARD_TOL, what="forward")
    T = torch.randn(B, L, 8, generator=torch.Generator().manual_seed(4), dtype=DT)

    def loss(Z, t):  # one sequence's hidden states (L, d)
        return (torch.tanh(Z) * t).sum() + (Z ** 2).mean()

    H = bh.hessian(p, ids, cfg, loss=loss, target=T)
    R = module_hessian(model, lambda out: sum(loss(out.last_hidden_state[b], T[b]) for b in range(B)) / B, ids)
    Hm = H.to_module(model)
    check_hessian(model, Hm, R)
    assert_close(Hm.outer.dense() + Hm.functional.dense(), Hm.dense(), what="outer + functional")


def test_gpt2_untied_head():
    model = randomise(tf.GPT2LMHeadModel(gpt2_config(n_embd=8, n_inner=16, vocab_size=16, n_layer=1,
                                                     tie_word_embeddings=False)), seed=5)
    assert model.lm_head.weight is not model.transformer.wte.weight
    cfg, p = bh.from_torch(model)
    assert not cfg.tied and cfg.head == 16 and "W_H" in p
    ids, y = token_ids(cfg), token_ids(cfg, seed=2)
    with torch.no_grad():
        assert_close(bh.forward(p, ids, cfg), model(ids).logits, tol=FORWARD_TOL, what="forward")
    H = bh.hessian(p, ids, cfg, loss="ce", target=y)
    R = module_hessian(model, lambda out: F.cross_entropy(out.logits.reshape(-1, 16), y.reshape(-1)), ids)
    check_hessian(model, H.to_module(model), R)


def test_vit_for_image_classification():
    model = randomise(tf.ViTForImageClassification(vit_config()), seed=6)
    cfg, p = bh.from_torch(model)
    assert cfg.embedding == "patch" and cfg.image == (3, 8, 8) and cfg.patch == 4 and cfg.cls_token
    assert cfg.pool == "first" and cfg.head == 3 and cfg.head_bias and cfg.n_positions == 5
    g = torch.Generator().manual_seed(7)
    images = torch.randn(B, 3, 8, 8, generator=g, dtype=DT)
    y = torch.randint(0, 3, (B,), generator=g)
    with torch.no_grad():
        logits = model(images).logits
    assert_close(bh.forward(p, images, cfg), logits, tol=FORWARD_TOL, what="forward")
    H = bh.hessian(p, images, cfg, loss="ce", target=y)
    R = module_hessian(model, lambda out: F.cross_entropy(out.logits, y), images)
    check_hessian(model, H.to_module(model), R)


def test_vit_model_one_channel_pooler_and_mask_token_are_zero():
    model = randomise(tf.ViTModel(vit_config(num_channels=1, hidden_size=8, intermediate_size=16, num_hidden_layers=1),
                                  use_mask_token=True), seed=8)
    cfg, p = bh.from_torch(model)
    assert cfg.image == (1, 8, 8) and cfg.pool == "none" and cfg.head is None
    images = torch.randn(B, 1, 8, 8, generator=torch.Generator().manual_seed(9), dtype=DT)
    T = torch.randn(B, 5, 8, generator=torch.Generator().manual_seed(10), dtype=DT)
    with torch.no_grad():
        hidden = model(images).last_hidden_state
    assert_close(bh.forward(p, images, cfg), hidden, tol=FORWARD_TOL, what="forward")
    H = bh.hessian(p, images, cfg, loss="mse", target=T)
    R = module_hessian(model, lambda out: ((out.last_hidden_state - T) ** 2).mean(), images)
    Hm = H.to_module(model)
    check_hessian(model, Hm, R)
    for n in ("embeddings.mask_token", "pooler.dense.weight", "pooler.dense.bias"):
        assert not Hm[n, n].any() and not Hm[n, "embeddings.cls_token"].any()


def test_bert_model_and_its_pooler():
    model = randomise(tf.BertModel(bert_config()), seed=11)
    cfg, p = bh.from_torch(model)
    assert cfg.token_types == 2 and cfg.embed_norm and cfg.norm_eps == 1e-12 and not cfg.final_norm
    assert all(b.norm == "post" and not b.causal and b.activation == "gelu" for b in cfg.blocks)
    assert not any(k.startswith("pooler") for k in p)
    ids = token_ids(cfg, low=1)  # not the padding id 0: test_bert_padding_row
    T = torch.randn(B, L, 16, generator=torch.Generator().manual_seed(12), dtype=DT)
    with torch.no_grad():
        hidden = model(ids).last_hidden_state
    assert_close(bh.forward(p, ids, cfg), hidden, tol=FORWARD_TOL, what="forward")
    H = bh.hessian(p, ids, cfg, loss="mse", target=T)
    R = module_hessian(model, lambda out: ((out.last_hidden_state - T) ** 2).mean(), ids)
    Hm = H.to_module(model)
    check_hessian(model, Hm, R)
    tt = "embeddings.token_type_embeddings.weight"
    assert Hm.shapes[tt] == (2, 16) and not Hm[tt, tt][16:].any() and Hm[tt, tt][:16, :16].any()  # type 1 unused
    assert not Hm["pooler.dense.weight", "pooler.dense.weight"].any()
    # a Hessian over some parameters: only those module parameters, no pooler
    part = bh.hessian(p, ids, cfg, loss="mse", target=T, wrt=["W_T", "blocks.1.W_1", "blocks.1.b_1"]).to_module(model)
    assert part.names == (tt, "encoder.layer.1.intermediate.dense.weight", "encoder.layer.1.intermediate.dense.bias")
    a, b = tt, "encoder.layer.1.intermediate.dense.weight"
    assert_close(part[a, b], Hm[a, b], what="wrt subset")


def test_bert_padding_row():
    """``word_embeddings`` has ``padding_idx`` (the pad token, 0): PyTorch gives that row no gradient, so
    autograd's Hessian has zero rows there, while ours is the derivative of the function (docs/models.md)."""
    model = randomise(tf.BertModel(bert_config(num_hidden_layers=1, hidden_size=8, intermediate_size=8,
                                               max_position_embeddings=8, vocab_size=8), add_pooling_layer=False), 13)
    cfg, p = bh.from_torch(model)
    ids = torch.tensor([[0, 3, 1, 0, 5], [2, 7, 0, 4, 6]])
    T = torch.randn(B, L, 8, generator=torch.Generator().manual_seed(14), dtype=DT)
    Hm = bh.hessian(p, ids, cfg, loss="mse", target=T).to_module(model)
    R = module_hessian(model, lambda out: ((out.last_hidden_state - T) ** 2).mean(), ids)
    D = Hm.dense()
    pad = torch.zeros(D.shape[0], dtype=torch.bool)
    pad[:8] = True  # row 0 of word_embeddings.weight, the first parameter
    assert not R[pad].any() and D[pad].norm() > 1e-3 * D.norm()
    assert_close(D[~pad][:, ~pad], R[~pad][:, ~pad], scale=fro(R), what="away from the padding row")


def test_bert_decoder_is_causal():
    model = randomise(tf.BertModel(bert_config(is_decoder=True, num_hidden_layers=1)), seed=15)
    cfg, p = bh.from_torch(model)
    assert all(b.causal for b in cfg.blocks)
    ids = token_ids(cfg, low=1)
    with torch.no_grad():
        assert_close(bh.forward(p, ids, cfg), model(ids, use_cache=False).last_hidden_state, tol=FORWARD_TOL,
                     what="forward")


@pytest.mark.parametrize("norm_first,batch_first,final", [(True, True, True), (False, False, False)])
def test_transformer_encoder(norm_first, batch_first, final):
    d = 8
    layer = nn.TransformerEncoderLayer(d, 2, 12, dropout=0.1, activation="gelu", batch_first=batch_first,
                                       norm_first=norm_first, dtype=DT)
    model = randomise(nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(d, dtype=DT) if final else None,
                                            enable_nested_tensor=False), seed=16)
    cfg, p = bh.from_torch(model)
    assert cfg.embedding == "none" and cfg.n_layers == 2 and cfg.final_norm == final
    g = torch.Generator().manual_seed(17)
    Xm = torch.randn((B, 4, d) if batch_first else (4, B, d), generator=g, dtype=DT)
    T = torch.randn(Xm.shape, generator=g, dtype=DT)
    X = bh.block_input(model, Xm)
    with torch.no_grad():
        assert_close(bh.forward(p, X, cfg), bh.block_input(model, model(Xm)), tol=FORWARD_TOL, what="forward")
    H = bh.hessian(p, X, cfg, loss="mse", target=bh.block_input(model, T))
    check_hessian(model, H.to_module(model), module_hessian(model, lambda out: ((out - T) ** 2).mean(), Xm))


def test_transformer_encoder_causal():
    d, n = 8, 4
    model = randomise(nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 2, 6, dropout=0.0, batch_first=True, dtype=DT),
                                            2, enable_nested_tensor=False), seed=18)
    mask = nn.Transformer.generate_square_subsequent_mask(n, dtype=DT)
    cfg, p = bh.from_torch(model, src_mask=mask)
    assert all(b.causal for b in cfg.blocks)
    X = torch.randn(B, n, d, generator=torch.Generator().manual_seed(19), dtype=DT)
    with torch.no_grad():
        assert_close(bh.forward(p, X, cfg), model(X, mask=mask, is_causal=True), tol=FORWARD_TOL, what="forward")


# ---------------------------------------------------------------------------------------------- blocks

def _gpt2_block():
    return randomise(tf.GPT2Model(gpt2_config(n_layer=1))).h[0]


def _vit_layer():
    return randomise(tf.ViTModel(vit_config(num_hidden_layers=1), add_pooling_layer=False)).layers[0]


def _bert_layer():
    return randomise(tf.BertModel(bert_config(num_hidden_layers=1), add_pooling_layer=False)).encoder.layer[0]


@pytest.mark.parametrize("make,norm,causal", [(_gpt2_block, "pre", True), (_vit_layer, "pre", False),
                                              (_bert_layer, "post", False)], ids=["GPT2Block", "ViTLayer", "BertLayer"])
def test_a_block(make, norm, causal):
    block = make()
    cfg, p = bh.from_torch(block)
    assert isinstance(cfg, bh.BlockConfig) and cfg.norm == norm and cfg.causal == causal and cfg.n_heads == 2
    g = torch.Generator().manual_seed(20)
    X = torch.randn(B, L, 16, generator=g, dtype=DT)
    T = torch.randn(B, L, 16, generator=g, dtype=DT)
    assert bh.block_input(block, X) is X
    with torch.no_grad():
        out = block(X)
    out = out[0] if isinstance(out, tuple) else out
    assert_close(bh.forward(p, X, cfg), out, tol=FORWARD_TOL, what="forward")

    def loss(out):
        return (((out[0] if isinstance(out, tuple) else out) - T) ** 2).mean()

    check_hessian(block, bh.hessian(p, X, cfg, loss="mse", target=T).to_module(block), module_hessian(block, loss, X))


# ---------------------------------------------------------------------------------------------- maps

def test_fused_and_tied_parameters_in_a_subset():
    model = randomise(tf.GPT2LMHeadModel(gpt2_config(n_embd=8, n_inner=16, vocab_size=16, n_layer=1)), seed=21)
    cfg, p = bh.from_torch(model)
    ids, y = token_ids(cfg), token_ids(cfg, seed=2)
    H = bh.hessian(p, ids, cfg, loss="ce", target=y)
    Hm = H.to_module(model)
    qkv = ["blocks.0.W_Q", "blocks.0.W_K", "blocks.0.W_V"]
    part = bh.hessian(p, ids, cfg, loss="ce", target=y, wrt=["W_E"] + qkv).to_module(model)
    assert part.names == ("transformer.wte.weight", "transformer.h.0.attn.c_attn.weight")
    a, b = part.names
    assert_close(part[a, b], Hm[a, b], what="c_attn and the tied wte")
    # c_attn.weight is (d, 3d) as stored: its column j of block h is W_Q's column (our layout, not transposed)
    i = model.transformer.h[0].attn.c_attn.weight.shape[1]
    assert_close(Hm[b, b].reshape(8, i, 8, i)[:, :8, :, :8].reshape(64, 64), H["blocks.0.W_Q", "blocks.0.W_Q"],
                 what="W_Q inside c_attn")
    with pytest.raises(ValueError, match=r"transformer.h.0.attn.c_attn.weight stores blocks.0.W_Q, blocks.0.W_K, "
                                         r"blocks.0.W_V together, but this Hessian has only blocks.0.W_Q, blocks.0.W_K"):
        bh.hessian(p, ids, cfg, loss="ce", target=y, wrt=qkv[:2]).to_module(model)


def test_to_module_refuses_another_architecture():
    model = randomise(tf.GPT2Model(gpt2_config(n_embd=8, n_inner=16, vocab_size=16, n_layer=1)))
    cfg, p = bh.from_torch(model)
    H = bh.hessian(p, token_ids(cfg), cfg, loss="mse", target=torch.zeros(B, L, 8, dtype=DT), wrt="W_P")
    other = tf.GPT2Model(gpt2_config(n_embd=8, n_inner=16, vocab_size=16, n_layer=2)).double()
    with pytest.raises(ValueError, match=r"another architecture than module GPT2Model \(H's vs the module's: 1 vs 2 blocks\)"):
        H.to_module(other)
    with pytest.raises(ValueError, match=r"than module GPT2Block \(H's vs the module's: a ModelConfig vs a BlockConfig\)"):
        H.to_module(model.h[0])


# ---------------------------------------------------------------------------------------------- refusals

def _add_parameter(m):
    m.h[0].extra = nn.Parameter(torch.zeros(3, dtype=DT))
    return m.eval()


def _subclass():
    class MyGPT2(tf.GPT2Model):  # its forward may differ from GPT-2's: not read
        pass

    return MyGPT2(gpt2_config(n_layer=1)).eval()


def _attn_impl(m, impl):
    m.config._attn_implementation = impl
    return m


REFUSED = [
    ("training", lambda: tf.GPT2Model(gpt2_config(n_layer=1)).train(), r"GPT2Model: dropout drop.p=0.1 in training mode"),
    ("vit training", lambda: tf.ViTModel(vit_config(attention_probs_dropout_prob=0.2, num_hidden_layers=1)).train(),
     r"ViTModel: dropout layers.0.attention.attention_dropout=0.2 in training mode"),
    ("cross-attention", lambda: tf.GPT2Model(gpt2_config(n_layer=1, add_cross_attention=True)),
     r"GPT2Model: h.0: add_cross_attention=True is not supported"),
    ("bert cross-attention", lambda: tf.BertModel(bert_config(is_decoder=True, add_cross_attention=True)),
     r"BertModel: add_cross_attention=True is not supported"),
    ("relative positions", lambda: tf.BertModel(bert_config(position_embedding_type="relative_key")),
     r"BertModel: position_embedding_type='relative_key' is not supported"),
    ("inverse layer idx", lambda: tf.GPT2Model(gpt2_config(n_layer=1, scale_attn_by_inverse_layer_idx=True)),
     r"GPT2Model: h.0: scale_attn_by_inverse_layer_idx=True is not supported"),
    ("upcast", lambda: tf.GPT2Model(gpt2_config(n_layer=1, reorder_and_upcast_attn=True)),
     r"GPT2Model: h.0: reorder_and_upcast_attn=True is not supported"),
    ("unscaled", lambda: tf.GPT2Model(gpt2_config(n_layer=1, scale_attn_weights=False)),
     r"GPT2Model: h.0: scale_attn_weights=False is not supported"),
    ("attention implementation", lambda: _attn_impl(tf.GPT2LMHeadModel(gpt2_config(n_layer=1)), "flash_attention_2"),
     r"GPT2LMHeadModel: transformer.h.0: attn_implementation='flash_attention_2' is not supported"),
    ("activation", lambda: tf.GPT2Model(gpt2_config(n_layer=1, activation_function="gelu_fast")),
     r"GPT2Model: h.0: mlp.act: activation FastGELUActivation is not supported"),
    ("bert activation", lambda: tf.BertModel(bert_config(hidden_act="quick_gelu")),
     r"BertModel: encoder.layer.0: intermediate.intermediate_act_fn: activation QuickGELUActivation is not supported"),
    ("head_dim", lambda: tf.ViTModel(vit_config(head_dim=4)),
     r"ViTModel: layers.0: head_dim=4: num_attention_heads \* head_dim = 8 != hidden_size = 16"),
    ("some biases", lambda: tf.ViTForImageClassification(vit_config(qkv_bias=False)),
     r"ViTForImageClassification: vit.layers.0: bias: present on some layers only \(no attention.q_proj.bias, "
     r"attention.k_proj.bias, attention.v_proj.bias\)"),
    ("unknown parameter", lambda: _add_parameter(tf.GPT2Model(gpt2_config(n_layer=1))),
     r"GPT2Model: cannot read parameter\(s\) \['h.0.extra'\]"),
    ("subclass", _subclass, r"from_torch supports .* got MyGPT2$"),
    ("unknown model", lambda: tf.GPT2DoubleHeadsModel(gpt2_config(n_layer=1)),
     r"from_torch supports .* got GPT2DoubleHeadsModel \(transformers.models.gpt2.modeling_gpt2\)"),
]


@pytest.mark.parametrize("make,match", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_settings_are_named(make, match):
    model = make()
    with pytest.raises(ValueError, match=match):
        bh.from_torch(model)


def test_what_is_accepted_around_the_refusals():
    model = tf.GPT2Model(gpt2_config(n_layer=1, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)).train()
    assert bh.from_torch(model)[0].n_layers == 1  # dropout 0 in training mode is fine
    for impl in ("eager", "sdpa"):
        assert bh.from_torch(_attn_impl(tf.GPT2Model(gpt2_config(n_layer=1)).eval(), impl))[0].blocks[0].causal
    assert bh.from_torch(tf.BertModel(bert_config(hidden_act="relu")).eval())[0].blocks[0].activation == "relu"
    block = tf.GPT2Model(gpt2_config(n_layer=1)).double().eval().h[0]
    with pytest.raises(ValueError, match="src_mask, is_causal and src_key_padding_mask apply to PyTorch's layers; "
                                         "GPT2Block applies its own mask"):
        bh.from_torch(block, is_causal=True)
    with pytest.raises(ValueError, match="from_torch: dtype must be float32 or float64, got torch.float16"):
        bh.from_torch(block, dtype=torch.float16)
    cfg, p = bh.from_torch(block, dtype=torch.float32)
    assert all(v.dtype == torch.float32 for v in p.values()) and next(block.parameters()).dtype == DT
    with pytest.raises(ValueError, match="block_input supports .* got GPT2Model"):
        bh.block_input(tf.GPT2Model(gpt2_config(n_layer=1)), torch.zeros(1, 2, 16))
