"""The user's own model read by tracing: ``bh.from_torch(model, example_inputs)`` (adapters/traced.py).

Each model below is written the way its users write it (from the public descriptions of nanoGPT, of a
notebook ViT, of a Llama decoder, of a classifier around a Hugging Face backbone), tiny, random weights,
float64. Each: the forward read equals the module's to 1e-12, the Hessian equals double backward through the
module itself (``torch.autograd.functional.hessian(vectorize=True)`` on ``torch.func.functional_call``, fused
SDPA forced to ``SDPBackend.MATH``) to 1e-10 on a subset of parameters, mapped back by ``H.to_module(model)``.
Modules a class-name reader takes read the same by tracing. Parts the closed form does not cover (a
LayerScale, an ALiBi bias, a custom ``torch.autograd.Function``, ...) are refused with the node named; a
seeded fuzzer composes supported parts, optionally with one unsupported part, and checks both outcomes.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import blockhess as bh

from conftest import assert_close, fro, rounding

DT = torch.float64
FORWARD_TOL = 1e-12
B, L = 2, 5


def randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    """float64, eval, weights N(0, 0.4²) (matrices) / 1 + N(0, 0.3²) (norm scales) / N(0, 0.2²) (vectors)."""
    g = torch.Generator().manual_seed(seed)
    model = model.double().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=DT)
            scale = n.rsplit(".", 1)[-1] == "weight" and p.ndim == 1
            p.copy_(1 + 0.3 * noise if scale else (0.4 if p.ndim > 1 else 0.2) * noise)
    return model


def module_hessian(model: nn.Module, names, loss, x) -> torch.Tensor:
    """Double backward of ``loss(model(x))`` w.r.t. the module parameters ``names`` (flattened, in that order)."""
    named = dict(model.named_parameters())
    sizes = [named[n].numel() for n in names]

    def f(flat):
        q = {n: c.reshape(named[n].shape) for n, c in zip(names, flat.split(sizes))}
        return loss(torch.func.functional_call(model, q, (x,)))

    with sdpa_kernel(SDPBackend.MATH):
        return torch.autograd.functional.hessian(f, torch.cat([named[n].detach().reshape(-1) for n in names]),
                                                 vectorize=True)


def check(model, x, loss_name, target, module_names, ours, module_loss):
    """Read by tracing; forward to 1e-12; Hessian over ``ours`` mapped to ``module_names`` vs double backward."""
    cfg, p = bh.from_torch(model, x)
    with torch.no_grad():
        out = model(x)
    assert_close(bh.forward(p, x, cfg), out, tol=FORWARD_TOL, what="forward")
    H = bh.hessian(p, x, cfg, loss=loss_name, target=target, wrt=ours)
    Hm = H.to_module(model)
    assert list(Hm.names) == [n for n in dict(model.named_parameters()) if n in module_names]
    D = Hm.dense()
    assert fro(D - D.T) <= rounding(D) * fro(D)
    R = module_hessian(model, list(Hm.names), module_loss, x)
    assert_close(D, R, what=f"{type(model).__name__} Hessian")
    return cfg, p, H


def ids(vocab, seed=1, shape=(B, L)):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- nanoGPT

class GPTConfig:
    def __init__(self, **kw):
        self.block_size, self.vocab_size, self.n_layer, self.n_head, self.n_embd = 8, 11, 2, 2, 8
        self.dropout, self.bias, self.flash = 0.0, True, True
        self.__dict__.update(kw)


class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm with an optional bias."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout
        self.flash = config.flash
        if not self.flash:
            self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                                 .view(1, 1, config.block_size, config.block_size))

    def scores(self, q, k, T):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        return att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                               is_causal=True)
        else:
            att = F.softmax(self.scores(q, k, T), dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}, block size is only " \
                                            f"{self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)  # the training path's logits, every position


def ce(vocab, y):
    return lambda out: F.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))


@pytest.mark.parametrize("flash,bias", [(True, True), (False, False)])
def test_nanogpt(flash, bias):
    model = randomise(GPT(GPTConfig(flash=flash, bias=bias)))
    x, y = ids(11), ids(11, seed=2)
    names = ["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_proj.weight"]
    if bias:
        names.insert(2, "transformer.h.0.ln_2.bias")
    ours = ["W_E", "blocks.0.W_Q", "blocks.0.W_K", "blocks.0.W_V", "blocks.1.W_O"] + (["blocks.0.beta_2"] if bias else [])
    cfg, p, H = check(model, x, "ce", y, names, ours, ce(11, y))
    assert cfg.tied and cfg.embedding == "token" and cfg.positions == "learned" and cfg.n_positions == 8
    assert all(b.causal and b.norm == "pre" and b.bias == bias and b.activation == "gelu" for b in cfg.blocks)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_nanogpt_inference_logits_are_refused_by_name():
    class Inference(GPT):
        def forward(self, idx):
            x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
            for block in self.transformer.h:
                x = block(x)
            return self.lm_head(self.transformer.ln_f(x)[:, [-1], :])

    with pytest.raises(ValueError, match=r"node index .*aten::index.*\[:, \[-1\], :\]"):
        bh.from_torch(randomise(Inference(GPTConfig(n_layer=1))), ids(11))


# ---------------------------------------------------------------------------------------------- a notebook ViT

class PatchEmbed(nn.Module):
    def __init__(self, img, patch, chans, dim):
        super().__init__()
        self.proj = nn.Conv2d(chans, dim, kernel_size=patch, stride=patch)
        self.n_patches = (img // patch) ** 2

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, N, D)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class ViTBlock(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=2, mha=False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True) if mha else Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim))

    def forward(self, x):
        if isinstance(self.attn, nn.MultiheadAttention):
            h = self.norm1(x)
            x = x + self.attn(h, h, h)[0]
        else:
            x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, img=8, patch=4, chans=3, classes=3, dim=8, depth=2, heads=2, pool="cls", mha=False):
        super().__init__()
        self.patch_embed = PatchEmbed(img, patch, chans, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.n_patches + 1, dim))
        self.blocks = nn.ModuleList([ViTBlock(dim, heads, mha=mha) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)
        self.pool = pool

    def forward(self, x):
        x = self.patch_embed(x)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat((cls, x), dim=1)
        x = x + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        x = x[:, 0] if self.pool == "cls" else x.mean(dim=1)
        return self.head(x)


@pytest.mark.parametrize("pool,mha", [("cls", False), ("mean", True)])
def test_notebook_vit(pool, mha):
    model = randomise(ViT(pool=pool, mha=mha))
    x = torch.randn(B, 3, 8, 8, generator=torch.Generator().manual_seed(3), dtype=DT)
    y = torch.tensor([0, 2])
    qkv = "blocks.1.attn.in_proj_bias" if mha else "blocks.1.attn.qkv.bias"
    names = ["patch_embed.proj.weight", "cls_token", qkv, "head.weight"]
    ours = ["W_E", "cls", "blocks.1.b_Q", "blocks.1.b_K", "blocks.1.b_V", "W_H"]
    cfg, _, _ = check(model, x, "ce", y, names, ours, lambda out: F.cross_entropy(out, y))
    assert cfg.embedding == "patch" and cfg.cls_token and cfg.patch == 4 and cfg.image == (3, 8, 8)
    assert cfg.pool == {"cls": "first", "mean": "mean"}[pool] and cfg.final_norm and cfg.head == 3


# ---------------------------------------------------------------------------------------------- a Llama of one's own

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    def __init__(self, head_dim, theta=500.0):
        super().__init__()
        # float64 frequencies: a float64 reference needs exact tables (float32 ones are refused as other tables)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, T):
        t = torch.arange(T, dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class LlamaAttention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, head_dim):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.rotary = Rotary(head_dim)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(T)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim=8, n_heads=4, n_kv_heads=2, head_dim=4, hidden=12):
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = LlamaAttention(dim, n_heads, n_kv_heads, head_dim)
        self.post_attention_layernorm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, vocab=11, dim=8, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([LlamaBlock(dim) for _ in range(layers)])
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def test_llama_block_of_ones_own():
    block = randomise(LlamaBlock())
    X = torch.randn(B, L, 8, generator=torch.Generator().manual_seed(4), dtype=DT)
    T = torch.randn(B, L, 8, generator=torch.Generator().manual_seed(5), dtype=DT)
    names = ["input_layernorm.weight", "self_attn.k_proj.weight", "mlp.gate_proj.weight"]
    ours = ["gamma_1", "W_K", "W_G"]
    cfg, p, H = check(block, X, "mse", T, names, ours, lambda out: ((out - T) ** 2).mean())
    assert isinstance(cfg, bh.BlockConfig)
    A = bh.hessian_operator(p, X, cfg, loss="mse", target=T, wrt=ours).to_module(block)  # module layout
    assert_close(A.dense(), H.to_module(block).dense(), what="A.to_module(block)")
    assert (cfg.norm_type, cfg.gated, cfg.activation, cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.rope, cfg.causal) == \
        ("rms", True, "silu", 4, 2, 4, True, True)
    assert cfg.rope_theta == pytest.approx(500.0, rel=1e-12) and cfg.ln_eps == 1e-6 and cfg.norm == "pre"


def test_llama_decoder_of_ones_own():
    """The whole decoder: embedding, two Llama blocks, the final RMSNorm, an untied head; CE on the logits."""
    model = randomise(Llama())
    x, y = ids(11), ids(11, seed=12)
    names = ["embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.1.mlp.up_proj.weight", "norm.weight",
             "lm_head.weight"]
    ours = ["W_E", "blocks.0.W_Q", "blocks.1.W_1", "gamma_F", "W_H"]
    cfg, p, H = check(model, x, "ce", y, names, ours,
                      lambda out: torch.nn.functional.cross_entropy(out.reshape(-1, 11), y.reshape(-1)))
    assert isinstance(cfg, bh.ModelConfig) and cfg.final_norm and cfg.norm_type == "rms" and not cfg.tied


def test_float32_rotary_tables_are_refused():
    block = LlamaBlock(n_heads=2, n_kv_heads=1, head_dim=8)  # d_k = 8: four frequencies, over-determining theta
    rotary = block.self_attn.rotary
    rotary.inv_freq = rotary.inv_freq.float().double()  # the usual float32 frequencies, in a float64 model
    with pytest.raises(ValueError, match=r"rotary tables other than"):
        bh.from_torch(randomise(block), torch.randn(B, L, 8, dtype=DT))


# ---------------------------------------------------------------------------------------------- HF backbone + head

def test_classifier_around_a_hugging_face_backbone():
    tf = pytest.importorskip("transformers")

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            config = tf.BertConfig(vocab_size=13, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=16, max_position_embeddings=8, attn_implementation="sdpa")
            self.backbone = tf.BertModel(config)
            self.dropout = nn.Dropout(0.1)
            self.classifier = nn.Linear(8, 3)

        def forward(self, input_ids):
            h = self.backbone(input_ids).last_hidden_state
            return self.classifier(self.dropout(h[:, 0]))

    model = randomise(Classifier())
    x, y = ids(13), torch.tensor([1, 2])
    names = ["backbone.encoder.layer.0.attention.self.query.weight", "classifier.weight", "classifier.bias"]
    cfg, _, _ = check(model, x, "ce", y, names, ["blocks.0.W_Q", "W_H", "b_H"], lambda out: F.cross_entropy(out, y))
    assert cfg.pool == "first" and cfg.head == 3 and cfg.embed_norm and cfg.token_types == 2


# ---------------------------------------------------------------------------------------------- class-name readers

class Output(nn.Module):
    """A Hugging Face model's one output tensor (its forward returns a ModelOutput; the traced reader reads one
    tensor)."""

    def __init__(self, m, field):
        super().__init__()
        self.m, self.field = m, field

    def forward(self, x):
        return getattr(self.m(x), self.field)


def _same_reading(model, x, loss, target, wrapped=None):
    """``from_torch(model)`` and ``from_torch(wrapped or model, x)``: the same cfg, params and Hessian (1e-12)."""
    cfg_n, p_n = bh.from_torch(model)
    cfg_t, p_t = bh.from_torch(wrapped or model, x)
    assert cfg_t == cfg_n and list(p_t) == list(p_n)
    assert all(torch.equal(p_t[k], p_n[k]) for k in p_n)
    wrt = list(p_n)[:4]
    Hn = bh.hessian(p_n, x, cfg_n, loss=loss, target=target, wrt=wrt).dense()
    Ht = bh.hessian(p_t, x, cfg_t, loss=loss, target=target, wrt=wrt).dense()
    assert_close(Ht, Hn, tol=1e-12, what="traced vs class-name Hessian")


def test_class_name_families_read_the_same_by_tracing():
    tf = pytest.importorskip("transformers")
    gpt2 = randomise(tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=8, n_head=2, n_layer=1, vocab_size=13, n_positions=8,
                                                       n_inner=16, attn_implementation="sdpa", bos_token_id=0,
                                                       eos_token_id=0)))
    _same_reading(gpt2, ids(13), "ce", ids(13, seed=2), Output(gpt2, "logits"))
    enc = randomise(nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2,
                                          enable_nested_tensor=False))
    X = torch.randn(B, L, 8, generator=torch.Generator().manual_seed(6), dtype=DT)
    _same_reading(enc, X, "mse", torch.randn(B, L, 8, dtype=DT, generator=torch.Generator().manual_seed(7)))
    vit = randomise(tf.ViTForImageClassification(tf.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=8,
                                                              num_hidden_layers=1, num_attention_heads=2,
                                                              intermediate_size=16, num_labels=3,
                                                              attn_implementation="sdpa")))
    img = torch.randn(B, 3, 8, 8, generator=torch.Generator().manual_seed(8), dtype=DT)
    _same_reading(vit, img, "ce", torch.tensor([0, 2]), Output(vit, "logits"))


@pytest.mark.parametrize("flash", [True, False])
def test_nanogpt_traced_reads_as_hugging_face_gpt2(flash):
    """A cross-check of the tracer's own recognition against a class-name reader: a nanoGPT holding exactly
    a ``GPT2LMHeadModel``'s weights (GELU erf in both; ``Conv1D`` weights transposed into ``nn.Linear``) is
    read by tracing as ``from_torch`` reads the Hugging Face model: the same config, parameters and Hessian."""
    tf = pytest.importorskip("transformers")
    hf = randomise(tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=8, n_head=2, n_layer=2, vocab_size=11, n_positions=8,
                                                     activation_function="gelu", attn_implementation="sdpa",
                                                     bos_token_id=0, eos_token_id=0)))
    nano = GPT(GPTConfig(flash=flash)).double().eval()
    with torch.no_grad():
        for name, q in nano.named_parameters():
            src = dict(hf.named_parameters())[name if name != "lm_head.weight" else "transformer.wte.weight"]
            q.copy_(src if q.ndim < 2 or name.startswith(("transformer.wte", "transformer.wpe")) else src.T)  # Conv1D: (in, out)
    x, y = ids(11), ids(11, seed=2)
    cfg_h, p_h = bh.from_torch(hf)
    cfg_n, p_n = bh.from_torch(nano, x)
    assert cfg_n == cfg_h and list(p_n) == list(p_h)
    assert all(torch.equal(p_n[k], p_h[k]) for k in p_h)
    wrt = ["W_E", "W_P", "blocks.0.W_Q", "blocks.0.W_K", "blocks.0.W_V", "blocks.1.W_1", "gamma_F"]
    Hh = bh.hessian(p_h, x, cfg_h, loss="ce", target=y, wrt=wrt).dense()
    Hn = bh.hessian(p_n, x, cfg_n, loss="ce", target=y, wrt=wrt)
    assert_close(Hn.dense(), Hh, tol=1e-12, what="nanoGPT traced vs GPT2LMHeadModel")
    R = module_hessian(nano, list(Hn.to_module(nano).names), ce(11, y), x)
    assert_close(Hn.to_module(nano).dense(), R, what="nanoGPT (HF weights) Hessian vs double backward")


class SinusoidalLM(nn.Module):
    """A notebook-style model: token embedding plus the fixed sinusoidal table (a buffer, built in ``dtype``),
    one block of the fuzzer's parts, a linear head."""

    def __init__(self, dtype, d=8, vocab=7, max_len=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        t = torch.arange(max_len, dtype=dtype)[:, None]
        div = torch.exp(torch.arange(0, d, 2, dtype=dtype) * (-math.log(10000.0) / d))
        pe = torch.zeros(max_len, d, dtype=dtype)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(t * div), torch.cos(t * div)
        self.register_buffer("pe", pe)
        self.block = FuzzBlock(d, 2, random.Random(0), None)
        self.head = nn.Linear(d, 3)

    def forward(self, idx):
        return self.head(self.block(self.emb(idx) + self.pe[: idx.shape[1]]))


def test_sinusoidal_positions_by_hand():
    model = randomise(SinusoidalLM(torch.float64))
    x, y = ids(7), ids(3, seed=5)
    cfg, p, _ = check(model, x, "ce", y, ["emb.weight", "block.attn.o.weight"], ["W_E", "blocks.0.W_O"],
                      lambda out: F.cross_entropy(out.reshape(-1, 3), y.reshape(-1)))
    assert cfg.positions == "sinusoidal"
    with pytest.raises(ValueError, match=r"sinusoidal position table off by .* \(a table computed in float32\)"):
        bh.from_torch(randomise(SinusoidalLM(torch.float32)), x)


def test_weights_shared_between_blocks_are_refused():
    model = GPT(GPTConfig())
    model.transformer.h[1] = model.transformer.h[0]  # one block applied twice (ALBERT-style sharing)
    with pytest.raises(ValueError, match=r"parameter 'transformer.h.0.attn.c_attn.weight' is used as .*blocks.0.W_Q"
                                         r".*blocks.1.W_Q"):
        bh.from_torch(randomise(model), ids(11))


# ---------------------------------------------------------------------------------------------- refusals

class LayerScale(nn.Module):
    def __init__(self, dim, init=1e-1):
        super().__init__()
        self.gamma = nn.Parameter(init * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma


class CaiTBlock(ViTBlock):
    def __init__(self, dim, heads):
        super().__init__(dim, heads)
        self.ls1, self.ls2 = LayerScale(dim), LayerScale(dim)

    def forward(self, x):
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class ALiBiAttention(CausalSelfAttention):
    def __init__(self, config):
        super().__init__(config)
        slopes = torch.tensor([2.0 ** (-8 * (h + 1) / config.n_head) for h in range(config.n_head)])
        pos = torch.arange(config.block_size)
        self.register_buffer("alibi", (slopes[:, None, None] * (pos[None, :] - pos[:, None])[None])[None])

    def scores(self, q, k, T):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att + self.alibi[:, :, :T, :T]
        return att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))


class SquaredReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.relu(x) ** 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * torch.relu(x) * g


class CustomAct(nn.Module):
    def forward(self, x):
        return SquaredReLU.apply(x)


def test_layer_scale_is_refused_by_name():
    block = randomise(CaiTBlock(8, 2))
    with pytest.raises(ValueError, match=r"node mul\w* .*'ls1'.*x \* self\.gamma.*'ls1\.gamma'.*LayerScale"):
        bh.from_torch(block, torch.randn(B, L, 8, dtype=DT))


def test_alibi_is_refused_by_name():
    model = GPT(GPTConfig(flash=False, n_layer=1))
    model.transformer.h[0].attn = ALiBiAttention(model.config)
    with pytest.raises(ValueError, match=r"node add\w* \(aten::add.Tensor\) in 'transformer.h.0.attn'.*ALiBi"):
        bh.from_torch(randomise(model), ids(11))


def test_custom_autograd_function_is_refused_by_name():
    model = GPT(GPTConfig(n_layer=1))
    model.transformer.h[0].mlp.gelu = CustomAct()
    with pytest.raises(ValueError, match=r"custom torch.autograd.Function SquaredReLU applied at .*test_traced.py"):
        bh.from_torch(randomise(model), ids(11))
    assert "refuse" not in repr(torch.autograd.Function.apply)  # restored


def test_unknown_class_without_example_inputs():
    with pytest.raises(ValueError, match=r"from_torch\(module, example_inputs\)"):
        bh.from_torch(ViT())
    with pytest.raises(ValueError, match=r"example_inputs must be one tensor"):
        bh.from_torch(ViT(), (torch.zeros(1, 3, 8, 8), torch.zeros(1)))
    with pytest.raises(ValueError, match=r"do not apply with example_inputs"):
        bh.from_torch(ViT(), torch.zeros(1, 3, 8, 8), is_causal=True)


def test_dropout_in_training_is_refused():
    model = GPT(GPTConfig(n_layer=1, dropout=0.1))
    with pytest.raises(ValueError, match=r"dropout .* in training mode"):
        bh.from_torch(model.double().train(), ids(11))


# ---------------------------------------------------------------------------------------------- fuzzer

class FuzzNorm(nn.Module):
    def __init__(self, d, how):
        super().__init__()
        self.how = how
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if how != "rms" else None

    def forward(self, x):
        if self.how == "F":
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, 1e-5)
        if self.how == "hand":
            mu = x.mean(-1, keepdim=True)
            var = ((x - mu) ** 2).mean(-1, keepdim=True)
            return (x - mu) * torch.rsqrt(var + 1e-5) * self.weight + self.bias
        if self.how == "var":
            return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5) \
                * self.weight + self.bias
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class FuzzAttention(nn.Module):
    def __init__(self, d, h, fused, sdpa, bad):
        super().__init__()
        self.h, self.fused, self.sdpa, self.bad = h, fused, sdpa, bad
        if fused:
            self.qkv = nn.Linear(d, 3 * d)
        else:
            self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1) if self.fused else (self.q(x), self.k(x), self.v(x))
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        if self.sdpa == "sdpa" and self.bad != "scale":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = q @ k.transpose(-2, -1) / (math.sqrt(q.shape[-1]) if self.bad != "scale" else q.shape[-1])
            if self.sdpa == "additive":  # a causal mask added
                s = s + torch.full((T, T), float("-inf")).triu(1)
            else:
                s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
            y = s.softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class FuzzFFN(nn.Module):
    def __init__(self, d, act, gated, bad):
        super().__init__()
        self.act, self.gated, self.bad = act, gated, bad
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.gate = nn.Linear(d, 2 * d) if gated else None

    def forward(self, x):
        act = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh, "silu_hand": lambda t: t * t.sigmoid(),
               "custom": SquaredReLU.apply}["tanh" if self.bad == "tanh" else "custom" if self.bad == "custom"
                                             else self.act]
        h = act(self.gate(x)) * self.up(x) if self.gated else act(self.up(x))
        if self.bad == "detach":
            h = h.detach()
        return self.down(h)


class FuzzBlock(nn.Module):
    def __init__(self, d, h, rng, bad):
        super().__init__()
        norm = rng.choice(["F", "hand", "var", "rms"])
        self.pre = rng.random() < 0.5
        self.n1, self.n2 = FuzzNorm(d, norm), FuzzNorm(d, norm)
        self.attn = FuzzAttention(d, h, rng.random() < 0.5, rng.choice(["sdpa", "masked_fill", "additive"]), bad)
        self.ffn = FuzzFFN(d, rng.choice(["relu", "gelu", "silu", "silu_hand"]), rng.random() < 0.5, bad)
        self.ls = LayerScale(d) if bad == "layerscale" else None

    def forward(self, x):
        a = self.attn(self.n1(x)) if self.pre else self.attn(x)
        if self.ls is not None:
            a = self.ls(a)
        x = x + a if self.pre else self.n1(x + a)
        return x + self.ffn(self.n2(x)) if self.pre else self.n2(x + self.ffn(x))


class FuzzModel(nn.Module):
    def __init__(self, rng, bad):
        super().__init__()
        d, h, self.vocab = 8, rng.choice([1, 2]), 7
        self.emb = nn.Embedding(self.vocab, d)
        self.pos = nn.Embedding(8, d) if rng.random() < 0.5 else None
        self.blocks = nn.ModuleList([FuzzBlock(d, h, rng, bad) for _ in range(rng.choice([1, 2]))])
        self.head = nn.Linear(d, 3)

    def forward(self, idx):
        x = self.emb(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(x)


#: each unsupported part and what its refusal names
UNSUPPORTED = {"layerscale": r"node mul.*LayerScale", "tanh": r"node tanh .*aten::tanh", "scale": r"attention scale",
               "custom": r"custom torch.autograd.Function SquaredReLU", "detach": r"node detach .*aten::detach"}


#: seeds 0, 2, 11 compose, together, every supported option of the fuzzer's parts (each norm form, pre and
#: post, fused and apart, SDPA, masked_fill and additive masks, every activation, gated and plain, 1 and 2
#: heads, positions); the others each add one unsupported part
CASES = [(0, None), (2, None), (11, None)] + [(3 + i, bad) for i, bad in enumerate(UNSUPPORTED)]


@pytest.mark.parametrize("seed,bad", CASES)
def test_fuzzer_reads_exactly_or_refuses(seed, bad):
    rng = random.Random(seed)
    model = randomise(FuzzModel(rng, bad), seed=seed)
    x = ids(7, seed=seed)
    if bad is not None:
        with pytest.raises(ValueError, match=UNSUPPORTED[bad]):
            bh.from_torch(model, x)
        return
    cfg, p = bh.from_torch(model, x)
    with torch.no_grad():
        assert_close(bh.forward(p, x, cfg), model(x), tol=FORWARD_TOL, what=f"fuzz {seed} forward")
    assert len(cfg.blocks) == len(model.blocks)
