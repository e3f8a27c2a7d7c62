"""Llama, Qwen2, Mistral and Gemma read from ``transformers`` modules (tiny configs, random weights, 2 layers,
float64; nothing downloaded): ``bh.from_torch(model)`` reproduces the module's forward to 1e-12, and
``bh.hessian(...).to_module(model)`` equals double backward through the module's own forward
(``torch.autograd.functional.hessian(vectorize=True)`` on ``functional_call``, SDPA under the MATH kernel) to
1e-10 relative Frobenius error over a subset of parameters holding every kind (the embedding, q/k/v/o,
gate/up/down, both RMSNorms of a layer, the final norm, the head; Qwen2's q/k/v biases); the operator's
products match to 1e-12; ``outer + functional == full``; grouped-query (Llama) and multi-query (Qwen2,
Mistral, Gemma) attention. Every setting the readers refuse is refused by name.

Hugging Face computes the RMSNorm and the rotary tables in float32 even in a float64 model (and its
``inv_freq`` buffer was made in float32): :func:`float64_hf` patches both to the input's dtype with the same
formulas (the rotary frequencies recomputed in float64 from the config's ``rope_theta``) for a float64
reference. Token ids avoid nothing: ``pad_token_id=None`` (an ``nn.Embedding`` ``padding_idx`` row has no
gradient in PyTorch; docs/models.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import blockhess as bh

from conftest import TOL, assert_close, fro

tf = pytest.importorskip("transformers")

DT = torch.float64
FORWARD_TOL = 1e-12
PRODUCT_TOL = 1e-12
B, L, V = 2, 4, 7
NO_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)


def _config(family: str, **kw):
    base = dict(vocab_size=V, hidden_size=8, intermediate_size=6, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-6, attn_implementation="sdpa",
                rope_parameters={"rope_type": "default", "rope_theta": 500.0}, **NO_TOKENS)
    if family == "Llama":  # grouped-query: 4 query heads, 2 K/V heads, head_dim 2
        base.update(num_attention_heads=4, num_key_value_heads=2, head_dim=2, tie_word_embeddings=False)
    elif family == "Qwen2":  # q, k, v biases; multi-query
        base.update(tie_word_embeddings=False)
    elif family == "Mistral":
        base.update(sliding_window=4, tie_word_embeddings=False)
    elif family == "Gemma":  # GeGLU, (1 + w) RMSNorm, √d embedding scale, tied head
        base.update(hidden_act="gelu_pytorch_tanh")
    return getattr(tf, f"{family}Config")(**{**base, **kw})


def build(family: str, kind: str = "ForCausalLM", seed: int = 0, **kw):
    """A ``{family}{kind}`` of :func:`_config` with weights away from the initialisation (matrices N(0, 0.5²),
    RMSNorm weights 1 + N(0, 0.3²) (Gemma's N(0, 0.3²): its scale is 1 + w), biases N(0, 0.2²)), float64, eval."""
    torch.manual_seed(seed)
    model = getattr(tf, f"{family}{kind}")(_config(family, **kw)).double().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=DT)
            if "norm" in n:
                p.copy_((0.0 if family == "Gemma" else 1.0) + 0.3 * r)
            else:
                p.copy_(0.5 * r if p.ndim > 1 else 0.2 * r)
    return model


@pytest.fixture
def float64_hf(monkeypatch):
    """The families' RMSNorm and rotary tables in the input's dtype (module docstring)."""
    from transformers.models.gemma import modeling_gemma

    def rms(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def gemma_rms(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    def rotary(self, x, position_ids):
        c = self.config
        dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        inv = 1.0 / (c.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=x.dtype) / dim))
        freqs = position_ids[..., None].to(x.dtype) * inv
        emb = torch.cat((freqs, freqs), -1)
        return emb.cos(), emb.sin()

    for family in ("Llama", "Qwen2", "Mistral", "Gemma"):
        mod = getattr(tf.models, family.lower())
        module = getattr(mod, f"modeling_{family.lower()}")
        monkeypatch.setattr(getattr(module, f"{family}RMSNorm"), "forward", gemma_rms if family == "Gemma" else rms)
        monkeypatch.setattr(getattr(module, f"{family}RotaryEmbedding"), "forward", rotary)
    assert modeling_gemma.GemmaRMSNorm.forward is gemma_rms


def module_hessian(model, loss, args: dict, names) -> torch.Tensor:
    """Double backward's Hessian of ``loss(model(**args))`` w.r.t. the module parameters ``names``
    (flattened, that order), the rest fixed, under the MATH SDPA kernel."""
    named = dict(model.named_parameters())
    sizes = [named[n].numel() for n in names]
    fixed = {n: p.detach() for n, p in named.items() if n not in names}

    def f(flat):
        q = {n: c.reshape(named[n].shape) for n, c in zip(names, flat.split(sizes))}
        return loss(torch.func.functional_call(model, {**fixed, **q}, (), {**args, "use_cache": False}))

    x = torch.cat([named[n].detach().reshape(-1) for n in names])
    with sdpa_kernel(SDPBackend.MATH):
        return torch.autograd.functional.hessian(f, x, vectorize=True)


def ids_and_labels(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, L), generator=g), torch.randint(0, V, (B, L), generator=g)


def lm_loss(y):
    return lambda out: F.cross_entropy(out.logits.reshape(-1, V), y.reshape(-1))


# our names covering every kind of parameter, a subset to keep the reference small
WRT = ["W_E", "blocks.0.W_Q", "blocks.0.W_K", "blocks.0.W_V", "blocks.0.W_O", "blocks.0.gamma_1", "blocks.1.gamma_2",
       "blocks.1.W_G", "blocks.1.W_1", "blocks.1.W_2", "gamma_F", "W_H"]
QWEN_BIASES = ["blocks.0.b_Q", "blocks.0.b_K", "blocks.0.b_V"]


@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Mistral", "Gemma"])
def test_causal_lm(float64_hf, family):
    model = build(family, seed=1)
    cfg, p = bh.from_torch(model)
    gqa = family == "Llama"  # 4 query heads on 2 K/V heads; the others multi-query, 2 on 1
    assert all((b.n_heads, b.kv_heads) == ((4, 2) if gqa else (2, 1)) for b in cfg.blocks)
    assert cfg.tied == (family == "Gemma") and cfg.blocks[0].qkv_bias == (family == "Qwen2")
    if family == "Gemma":
        assert cfg.embed_scale == float(model.model.embed_tokens.embed_scale) and cfg.rms_offset == 1.0
    ids, y = ids_and_labels(2)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert_close(bh.forward(p, {"input_ids": ids, "attention_mask": mask}, cfg), out, tol=FORWARD_TOL, what="forward")
    wrt = [n for n in WRT if n != "W_H" or not cfg.tied] + (QWEN_BIASES if family == "Qwen2" else [])
    H = bh.hessian(p, {"input_ids": ids}, cfg, loss="ce", target=y, wrt=wrt)
    Hm = H.to_module(model)
    assert len(Hm.names) == len(wrt)
    R = module_hessian(model, lm_loss(y), {"input_ids": ids}, list(Hm.names))
    D = Hm.dense()
    assert_close(D, R, tol=TOL, what=f"{family} Hessian vs double backward")
    assert_close(D, D.T, tol=1e-13, what="symmetry")
    Ho, Hf = Hm.outer.dense(), Hm.functional.dense()
    assert_close(Ho + Hf, D, tol=1e-12, scale=fro(D), what="outer + functional")
    assert float(torch.linalg.eigvalsh(Ho).min()) >= -1e-12 * fro(Ho), "outer part not PSD"
    # the operator in the module's layout, over the same parameters
    A = bh.hessian_operator(p, ids, cfg, loss="ce", target=y, wrt=wrt).to_module(model)
    Vs = torch.randn(D.shape[0], 3, generator=torch.Generator().manual_seed(3), dtype=DT)
    assert_close(A @ Vs, D @ Vs, tol=PRODUCT_TOL, what="operator products")


def test_one_part_alone(float64_hf):
    """A Llama's outer part alone (``blockhess.model.walk.hessian(part="outer")``, its exact products only) is the
    full result's ``.outer``."""
    from blockhess.model import walk

    cfg, p = bh.from_torch(build("Llama", seed=1))
    ids, y = ids_and_labels(2)
    wrt = ["blocks.0.W_Q", "blocks.1.W_G", "W_H"]
    H = bh.hessian(p, ids, cfg, loss="ce", target=y, wrt=wrt)
    G = walk.hessian(p, ids, cfg, "ce", y, wrt, part="outer")
    assert not G.has_parts
    assert_close(G.dense(), H.outer.dense(), tol=1e-14, scale=fro(H.dense()), what="outer alone")


@pytest.mark.parametrize("family", ["Qwen2", "Gemma"])
def test_base_model_and_layer(float64_hf, family):
    """``{family}Model`` (the last hidden state, MSE) and ``{family}DecoderLayer`` (one layer, hidden states in;
    its rotary tables from the model's, causal as SDPA masks a layer called alone)."""
    model = build(family, "Model", seed=4)
    cfg, p = bh.from_torch(model)
    assert cfg.head is None and cfg.final_norm and cfg.norm_type == "rms"
    ids, _ = ids_and_labels(5)
    T = torch.randn(B, L, 8, generator=torch.Generator().manual_seed(6), dtype=DT)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).last_hidden_state
    assert_close(bh.forward(p, ids, cfg), out, tol=FORWARD_TOL, what="forward")
    wrt = ["W_E", "blocks.1.W_K", "blocks.1.W_V", "gamma_F"] + (["blocks.1.b_K", "blocks.1.b_V"] if family == "Qwen2" else [])
    Hm = bh.hessian(p, ids, cfg, loss="mse", target=T, wrt=wrt).to_module(model)
    R = module_hessian(model, lambda o: ((o.last_hidden_state - T) ** 2).mean(), {"input_ids": ids}, list(Hm.names))
    assert_close(Hm.dense(), R, tol=TOL, what=f"{family}Model Hessian")

    layer = model.layers[0]
    lcfg, lp = bh.from_torch(layer)
    assert lcfg == cfg.blocks[0]
    X = torch.randn(B, L, 8, generator=torch.Generator().manual_seed(7), dtype=DT)
    pos = model.rotary_emb(X, torch.arange(L)[None])
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        Z = layer(X, position_embeddings=pos)
    assert_close(bh.forward(lp, X, lcfg), Z, tol=FORWARD_TOL, what="layer forward")
    Hl = bh.hessian(lp, X, lcfg, loss="mse", target=T).to_module(layer)
    named = dict(layer.named_parameters())
    names = list(Hl.names)
    sizes = [named[n].numel() for n in names]

    def f(flat):
        q = {n: c.reshape(named[n].shape) for n, c in zip(names, flat.split(sizes))}
        return ((torch.func.functional_call(layer, q, (X,), {"position_embeddings": pos}) - T) ** 2).mean()

    with sdpa_kernel(SDPBackend.MATH):
        Rl = torch.autograd.functional.hessian(f, torch.cat([named[n].detach().reshape(-1) for n in names]),
                                               vectorize=True)
    assert_close(Hl.dense(), Rl, tol=TOL, what=f"{family}DecoderLayer Hessian")


def test_llama_every_bias(float64_hf):
    """Llama's ``attention_bias`` with ``mlp_bias``: every projection's bias (``bias=True``, ``b_O`` included)."""
    model = build("Llama", seed=8, attention_bias=True, mlp_bias=True, num_hidden_layers=1)
    cfg, p = bh.from_torch(model)
    assert cfg.blocks[0].bias and "blocks.0.b_O" in p and "blocks.0.b_G" in p
    ids, y = ids_and_labels(9)
    with torch.no_grad():
        assert_close(bh.forward(p, ids, cfg), model(input_ids=ids, use_cache=False).logits, tol=FORWARD_TOL,
                     what="forward")
    wrt = ["blocks.0.b_Q", "blocks.0.b_O", "blocks.0.b_G", "blocks.0.b_1", "blocks.0.b_2", "W_H"]
    Hm = bh.hessian(p, ids, cfg, loss="ce", target=y, wrt=wrt).to_module(model)
    assert_close(Hm.dense(), module_hessian(model, lm_loss(y), {"input_ids": ids}, list(Hm.names)), tol=TOL,
                 what="biases")


def test_gemma_embed_scale_is_hf_rounded():
    """Gemma's normaliser is HF's ``embed_scale`` buffer, √d rounded to float32 where it was made, cast to the
    weight's dtype: the config holds exactly that value, not √d in float64."""
    model = build("Gemma", "Model", seed=10, hidden_size=12, head_dim=6)
    cfg, _ = bh.from_torch(model)
    buf = model.embed_tokens.embed_scale
    assert cfg.embed_scale == float(buf) == float(torch.tensor(12 ** 0.5, dtype=torch.float32))
    assert cfg.embed_scale != 12 ** 0.5


def test_mistral_window():
    """A sequence no longer than Mistral's ``sliding_window`` is plain causal; a longer one is refused by name."""
    model = build("Mistral", seed=11)
    cfg, p = bh.from_torch(model)
    assert {b.sliding_window for b in cfg.blocks} == {4}
    ids = torch.zeros(1, 5, dtype=torch.long)
    for call in (lambda: bh.forward(p, ids, cfg), lambda: bh.hessian(p, ids, cfg, loss="ce", target=ids),
                 lambda: bh.hessian_operator(p, ids, cfg, loss="ce", target=ids)):
        with pytest.raises(NotImplementedError, match=r"5 tokens is longer than blocks\[0\].sliding_window=4"):
            call()


def test_qwen2_sliding_layers():
    """Qwen2's sliding-window layers (``use_sliding_window``, from ``max_window_layers`` on) carry the window."""
    model = build("Qwen2", seed=12, use_sliding_window=True, sliding_window=3, max_window_layers=1)
    cfg, _ = bh.from_torch(model)
    assert [b.sliding_window for b in cfg.blocks] == [None, 3]


REFUSED = [
    ("Llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type='linear' is not supported"),
    ("Llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "rope_type='dynamic' is not supported"),
    ("Llama", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), "rope_type='yarn' is not supported"),
    ("Llama", dict(rope_parameters={"rope_type": "llama3", "factor": 2.0, "rope_theta": 1e4, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
     "rope_type='llama3' is not supported"),
    ("Llama", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0],
                                    "long_factor": [1.0], "original_max_position_embeddings": 16}),
     "rope_type='longrope' is not supported"),
    ("Llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5"),
    ("Llama", dict(attention_bias=True), "an o_proj bias without the MLP's"),
    ("Llama", dict(mlp_bias=True), "MLP biases alone"),
    ("Llama", dict(hidden_act="sigmoid"), "custom activation"),
    ("Llama", dict(attn_implementation="flex_attention"), "attn_implementation='flex_attention'"),
    ("Gemma", dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
    ("Gemma", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    ("Gemma", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
]


@pytest.mark.parametrize("family,kw,says", REFUSED, ids=[r[2] for r in REFUSED])
def test_refused(family, kw, says):
    heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=4)  # dynamic rope needs head_dim > 2
    model = build(family, seed=0, **{**heads, **kw})
    with pytest.raises(ValueError) as info:
        bh.from_torch(model)
    assert says in str(info.value), str(info.value)


def test_dropout_in_training_refused():
    model = build("Llama", seed=0, attention_dropout=0.1).train()
    with pytest.raises(ValueError, match="attention_dropout=0.1 in training mode"):
        bh.from_torch(model)


@pytest.mark.parametrize("family,side", [("Llama", "left"), ("Qwen2", "right"), ("Mistral", "left"), ("Gemma", "right")])
def test_padded_batch(float64_hf, family, side):
    """A padded batch (``attention_mask`` with zeros, left or right; the padding's labels -100, HF's loss the
    mean over the counted tokens): the forward at the counted tokens, and the Hessian against double backward
    through the module with the same keyword arguments; with ``position_ids`` (left padding's positions
    counted from each sequence's first token) too."""
    model = build(family, seed=7)
    cfg, p = bh.from_torch(model)
    ids, y = ids_and_labels(8)
    mask = torch.ones_like(ids)
    pad = slice(0, 2) if side == "left" else slice(L - 2, L)
    mask[0, pad] = 0
    y = y.masked_fill(mask == 0, -100)
    counted = mask.bool()
    for extra in ({}, {"position_ids": (mask.cumsum(1) - 1).clamp(min=0)}):
        args = {"input_ids": ids, "attention_mask": mask, **extra}
        with torch.no_grad():
            out = model(**args, use_cache=False).logits
        assert_close(bh.forward(p, args, cfg)[counted], out[counted], tol=FORWARD_TOL, what="forward (counted)")
        wrt = ["blocks.0.W_Q", "blocks.0.W_K", "blocks.1.W_V", "blocks.1.W_G", "gamma_F"]
        Hm = bh.hessian(p, args, cfg, loss="ce", target=y, wrt=wrt).to_module(model)
        loss = lambda o: F.cross_entropy(o.logits.reshape(-1, V), y.reshape(-1), ignore_index=-100)
        R = module_hessian(model, loss, args, list(Hm.names))
        D = Hm.dense()
        assert_close(D, R, tol=TOL, what=f"{family} padded ({side}) Hessian vs double backward")
        A = bh.hessian_operator(p, args, cfg, loss="ce", target=y, wrt=wrt).to_module(model)
        Vs = torch.randn(D.shape[0], 2, generator=torch.Generator().manual_seed(9), dtype=DT)
        assert_close(A @ Vs, D @ Vs, tol=PRODUCT_TOL, what="operator products (padded)")
