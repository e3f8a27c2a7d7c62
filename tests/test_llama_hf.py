"""Evidence that the Llama-family options follow Hugging Face's conventions: a ``transformers``
``LlamaDecoderLayer``, ``Qwen2DecoderLayer`` and ``GemmaDecoderLayer`` (tiny configs, random weights, float64, eager
attention) have the forward of :func:`blockhess.forward` with the mapped parameters, to 1e-12.

Hugging Face computes three things in float32 even in a float64 model: the RMSNorm
(``hidden_states.to(torch.float32)``), the rotary tables (``inv_freq`` and the angles) and the eager
softmax (``dtype=torch.float32``). For a float64 reference the test runs the first in the input's
dtype (the same formula), passes float64 rotary tables built HF's way (``cat(freqs, freqs)``) as the
layer's ``position_embeddings``, and drops the softmax's float32 ``dtype``; projections,
``rotate_half``, ``apply_rotary_pos_emb``, ``repeat_kv``, the gated MLP and the residuals are HF's own
code. ``GemmaDecoderLayer`` checks Gemma's ``(1 + weight)`` scale (``rms_offset=1.0``) and GeGLU
(``gelu_pytorch_tanh``). The mapping (``nn.Linear`` stores ``(out, in)``: transposed) is a helper here until the model
adapters take it (docs/derivations.md §20).
"""

import pytest
import torch

import blockhess as bh

transformers = pytest.importorskip("transformers")


def hf_params(layer, cfg: bh.BlockConfig) -> dict:
    """Our parameters from an HF Llama-family decoder layer: ``W = linear.weight.T``; ``b`` its bias."""
    a, m = layer.self_attn, layer.mlp
    src = {"W_Q": a.q_proj.weight, "b_Q": a.q_proj.bias, "W_K": a.k_proj.weight, "b_K": a.k_proj.bias,
           "W_V": a.v_proj.weight, "b_V": a.v_proj.bias, "W_O": a.o_proj.weight, "b_O": a.o_proj.bias,
           "gamma_1": layer.input_layernorm.weight, "W_G": m.gate_proj.weight, "b_G": m.gate_proj.bias,
           "W_1": m.up_proj.weight, "b_1": m.up_proj.bias, "W_2": m.down_proj.weight, "b_2": m.down_proj.bias,
           "gamma_2": layer.post_attention_layernorm.weight}
    out = {}
    for name in bh.param_shapes(cfg):
        t = src[name].detach()
        out[name] = t.T.contiguous() if t.ndim == 2 else t.clone()
    return out


def rope_float64(rotary, hf_cfg, L: int, head_dim: int):
    """HF's default rotary tables at positions 0..L-1 in float64 (``emb = cat(freqs, freqs)``), from the
    HF config's own ``rope_theta``; checked against HF's rotary module's float32 tables first."""
    theta = hf_cfg.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.arange(L, dtype=torch.float64)[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None], emb.sin()[None]
    x = torch.zeros(1, L, 1, dtype=torch.float32)
    hf_cos, hf_sin = rotary(x, torch.arange(L)[None])
    assert float((hf_cos.double() - cos).abs().max()) < 1e-5 and float((hf_sin.double() - sin).abs().max()) < 1e-5
    return cos, sin


@pytest.fixture
def float64_hf(monkeypatch):
    """HF's RMSNorm in the input's dtype and its eager softmax without the float32 cast (module docstring)."""
    def rms_forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    softmax = torch.nn.functional.softmax

    def softmax_native(x, dim=None, dtype=None, **kw):
        return softmax(x, dim=dim, **kw)

    def gemma_rms_forward(self, x):  # HF's own _norm, in the input's dtype, times (1 + weight)
        return self._norm(x) * (1.0 + self.weight)

    from transformers.models.gemma import modeling_gemma
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_forward)
    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", rms_forward)
    monkeypatch.setattr(modeling_gemma.GemmaRMSNorm, "forward", gemma_rms_forward)
    monkeypatch.setattr(torch.nn.functional, "softmax", softmax_native)


def _compare(layer, rotary, cfg, hf_cfg, L: int, B: int, seed: int):
    torch.manual_seed(seed)
    layer = layer.double().eval()
    with torch.no_grad():
        for name, prm in layer.named_parameters():  # nothing hides behind HF's ones and zeros
            r = torch.randn_like(prm)
            prm.copy_(1 + 0.5 * r if "norm" in name else 0.3 * r if prm.ndim == 1 else r * prm.shape[1] ** -0.5)
    X = torch.randn(B, L, cfg.d_model, dtype=torch.float64)
    mask = torch.full((L, L), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    cos, sin = rope_float64(rotary, hf_cfg, L, cfg.head_dim)
    with torch.no_grad():
        out = layer(X, attention_mask=mask, position_embeddings=(cos, sin))
    out = out[0] if isinstance(out, tuple) else out
    Z = bh.forward(hf_params(layer, cfg), X, cfg)
    err = float((Z - out).norm() / out.norm())
    assert err <= 1e-12, f"relative forward error {err:.3e}"


@pytest.mark.parametrize("n_kv", [1, 2, 4])
@pytest.mark.parametrize("L,B", [(1, 1), (5, 2)])
def test_llama_decoder_layer_forward(float64_hf, n_kv, L, B):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    hf_cfg = LlamaConfig(hidden_size=8, intermediate_size=12, num_attention_heads=4, num_key_value_heads=n_kv, head_dim=6,
                         rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, mlp_bias=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    hf_cfg._attn_implementation = "eager"
    cfg = bh.BlockConfig(d_model=8, d_ff=12, n_heads=4, n_kv_heads=n_kv, d_k=6, d_v=6, out_proj=True, norm="pre",
                         norm_type="rms", ln_affine=True, ln_eps=1e-6, gated=True, activation="silu", rope=True,
                         rope_theta=500.0, causal=True)
    _compare(LlamaDecoderLayer(hf_cfg, layer_idx=0), LlamaRotaryEmbedding(hf_cfg), cfg, hf_cfg, L, B, seed=n_kv + L)


def test_qwen2_decoder_layer_forward(float64_hf):
    """Qwen2: biases on q, k, v only (``qkv_bias=True``, ``bias=False``)."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding
    hf_cfg = Qwen2Config(hidden_size=8, intermediate_size=10, num_attention_heads=4, num_key_value_heads=2,
                         rms_norm_eps=1e-6, hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    hf_cfg._attn_implementation = "eager"
    cfg = bh.BlockConfig(d_model=8, d_ff=10, n_heads=4, n_kv_heads=2, d_k=2, out_proj=True, norm="pre", norm_type="rms",
                         ln_affine=True, ln_eps=1e-6, gated=True, activation="silu", rope=True, rope_theta=1e4,
                         causal=True, qkv_bias=True)
    layer = Qwen2DecoderLayer(hf_cfg, layer_idx=0)
    assert layer.self_attn.q_proj.bias is not None and layer.self_attn.o_proj.bias is None
    _compare(layer, Qwen2RotaryEmbedding(hf_cfg), cfg, hf_cfg, 4, 2, seed=0)


def test_gemma_decoder_layer_forward(float64_hf):
    """Gemma: RMSNorm scale ``1 + weight`` (``rms_offset=1.0``, ``gamma_*`` HF's stored weight), GeGLU, MQA."""
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer, GemmaRotaryEmbedding
    hf_cfg = GemmaConfig(hidden_size=8, intermediate_size=10, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                         rms_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    hf_cfg._attn_implementation = "eager"
    cfg = bh.BlockConfig(d_model=8, d_ff=10, n_heads=2, n_kv_heads=1, d_k=4, d_v=4, out_proj=True, norm="pre",
                         norm_type="rms", rms_offset=1.0, ln_affine=True, ln_eps=1e-6, gated=True, activation="gelu_tanh",
                         rope=True, rope_theta=1e4, causal=True)
    _compare(GemmaDecoderLayer(hf_cfg, layer_idx=0), GemmaRotaryEmbedding(hf_cfg), cfg, hf_cfg, 5, 2, seed=1)
