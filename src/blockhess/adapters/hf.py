"""Hugging Face ``transformers`` models: GPT-2, ViT, BERT and the Llama family (and their blocks) read into a config and
a spec (:mod:`.layout`); docs/models.md has the mapping table.

Modules are recognised by their class name and module (``type(m).__name__``,
``type(m).__module__.startswith("transformers.")``): ``transformers`` is never imported here, so
blockhess imports without it. The layouts read are transformers 5's (checked against 5.x's
``modeling_gpt2.py``, ``modeling_vit.py``, ``modeling_bert.py``); a module whose attributes or
parameters are laid out otherwise is refused by name, never guessed at.

* GPT-2 (``GPT2LMHeadModel``, ``GPT2Model``, ``GPT2Block``): pre-LN (``ln_1``, ``ln_2``), causal,
  ``Conv1D`` weights stored ``(in, out)`` (not transposed), ``c_attn`` = ``[W_Q | W_K | W_V]``
  column-stacked, ``c_proj`` = ``W_O``, ``mlp.c_fc`` = ``W_1``, ``mlp.c_proj`` = ``W_2``; token
  embedding ``wte`` = ``W_E``, learned positions ``wpe`` = ``W_P``, ``ln_f`` the final LayerNorm; the
  LM head tied to ``wte`` (``tied=True``: ``named_parameters`` lists the shared tensor once, as
  ``transformer.wte.weight``, and its Hessian has both uses).
  ``GPT2ForSequenceClassification``: the same stack, ``score`` = ``W_H`` on the last token
  (``pool="last"``; ``pad_token`` = ``config.pad_token_id``: each sequence pooled at its last token
  that is not padding, as the module does).
* ViT (``ViTForImageClassification``, ``ViTModel``, ``ViTLayer``): the patch ``Conv2d`` ``(d, C, p, p)``
  = ``W_E^T`` reshaped, ``cls_token`` ``(1, 1, d)`` = ``cls``, ``position_embeddings`` ``(1, n+1, d)``
  = ``W_P``; pre-LN (``layernorm_before``, ``layernorm_after``), ``attention.q_proj/k_proj/v_proj/o_proj``,
  ``mlp.fc1/fc2``; ``vit.layernorm`` final; the classifier on the CLS token (``pool="first"``).
* BERT (``BertModel``, ``BertLayer``): word, position and token-type embeddings (``token_types =
  type_vocab_size``; the rows of ``token_type_ids`` passed with the inputs, row 0 without them),
  ``embeddings.LayerNorm`` = ``embed_norm``; post-LN
  layers (``attention.self.query/key/value``, ``attention.output.dense`` + ``.LayerNorm``,
  ``intermediate.dense``, ``output.dense`` + ``.LayerNorm``); the output is ``last_hidden_state``, so
  the pooler's parameters do not affect it: they are read as parameters our model does not use
  (zero Hessian blocks; ``ViTModel``'s pooler and ``mask_token`` likewise).
* Llama, Qwen2, Mistral, Gemma (``{F}ForCausalLM``, ``{F}Model``, ``{F}DecoderLayer``, checked against 5.x's
  ``modeling_llama.py`` and the others): pre-norm RMSNorm blocks (``input_layernorm``,
  ``post_attention_layernorm``; Gemma's ``GemmaRMSNorm`` is ``(1 + weight) · x̂``: ``rms_offset=1.0``),
  ``self_attn.q_proj/k_proj/v_proj/o_proj`` (``nn.Linear``, transposed; ``num_key_value_heads`` K/V heads of
  ``head_dim``), the default rotary embedding (``rope_parameters["rope_theta"]``), causal, the gated
  ``mlp.gate_proj/up_proj/down_proj`` = ``W_G, W_1, W_2``; biases none, q/k/v only (Qwen2) or every
  projection's (Llama's ``attention_bias`` with ``mlp_bias``); Mistral's ``sliding_window`` and Qwen2's
  sliding layers as ``BlockConfig.sliding_window``; ``embed_tokens`` = ``W_E`` (Gemma's scaled by its
  ``embed_scale`` buffer's value), ``norm`` the final RMSNorm, ``lm_head`` untied ``W_H`` or tied to ``W_E``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config import BlockConfig, ModelConfig, block_prefix, param_shapes
from .layout import Stored
from .pytorch import activation

__all__ = ["is_hf", "reads", "describe", "SUPPORTED", "BLOCKS", "FAMILIES"]

#: The Llama-family decoders read (:func:`_llama_layer`): each family's class-name prefix.
FAMILIES = ("Llama", "Qwen2", "Mistral", "Gemma")
#: The Hugging Face blocks: their inputs are ``(B, L, d)`` hidden states.
BLOCKS = ("GPT2Block", "ViTLayer", "BertLayer") + tuple(f"{f}DecoderLayer" for f in FAMILIES)
#: What this reader takes, for error messages.
SUPPORTED = "Hugging Face GPT2LMHeadModel, GPT2ForSequenceClassification, GPT2Model, GPT2Block, " \
            "ViTForImageClassification, ViTModel, ViTLayer, BertModel, BertLayer, and LlamaForCausalLM, LlamaModel, " \
            "LlamaDecoderLayer and the same three of Qwen2, Mistral and Gemma"

# transformers' activation modules (transformers.activations) -> ours; others are refused
_ACTIVATIONS = {"GELUActivation": "gelu", "NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh",
                "PytorchGELUTanh": "gelu_tanh", "SiLUActivation": "silu"}


def is_hf(module) -> bool:
    """Whether ``module``'s class is defined in ``transformers``."""
    return type(module).__module__.startswith("transformers.")


def reads(module) -> bool:
    """Whether ``module`` is one of the Hugging Face classes this reader takes (exactly that class)."""
    return is_hf(module) and type(module).__name__ in _READERS


def _name(module) -> str:
    return type(module).__name__


def _is(module, cls: str) -> bool:
    return type(module).__name__ == cls and is_hf(module)


def _activation(act, where: str) -> str:
    if is_hf(act):
        if type(act).__name__ in _ACTIVATIONS:
            return _ACTIVATIONS[type(act).__name__]
        raise ValueError(f"{where}activation {type(act).__name__} is not supported: the closed form has relu, gelu "
                         "(erf), gelu_tanh and silu (transformers' 'relu', 'gelu', 'gelu_new', 'gelu_pytorch_tanh', "
                         "'silu')")
    if isinstance(act, nn.SiLU):  # transformers' 'swish'
        return "silu"
    try:
        return activation(act)
    except ValueError as e:
        raise ValueError(f"{where}{e}") from None


def _attn_implementation(config, where: str) -> None:
    impl = getattr(config, "_attn_implementation", None)
    if impl not in (None, "eager", "sdpa"):  # None: a block built outside a model runs the eager path
        raise ValueError(f"{where}attn_implementation={impl!r} is not supported: only 'eager' and 'sdpa' compute the "
                         "plain softmax attention the closed form differentiates (load with attn_implementation='sdpa')")


def _scaling(att, d_k: int, where: str) -> None:
    s = getattr(att, "scaling", d_k ** -0.5)
    if s != d_k ** -0.5:
        raise ValueError(f"{where}attention scaling={s}: only 1/sqrt(head_dim) = {d_k ** -0.5} is supported")


def _layernorm(ln, d: int, where: str) -> tuple:
    if not isinstance(ln, nn.LayerNorm) or tuple(ln.normalized_shape) != (d,):
        raise ValueError(f"{where}expected nn.LayerNorm({d}), got {ln!r}")
    return float(ln.eps), ln.weight is not None, ln.bias is not None


def _transposed(lin, where: str) -> bool:
    """``nn.Linear`` stores ``(out, in)`` (transposed here); transformers' ``Conv1D`` ``(in, out)`` (as is)."""
    if isinstance(lin, nn.Linear):
        return True
    if _is(lin, "Conv1D"):
        return False
    raise ValueError(f"{where}expected nn.Linear or transformers' Conv1D, got {type(lin).__name__}")


def _embedding(emb, where: str) -> None:
    if not isinstance(emb, nn.Embedding):
        raise ValueError(f"{where}expected nn.Embedding, got {type(emb).__name__}")
    if emb.max_norm is not None:
        raise ValueError(f"{where}max_norm={emb.max_norm} is not supported (it renormalises rows in the forward pass)")
    if emb.scale_grad_by_freq:
        raise ValueError(f"{where}scale_grad_by_freq=True is not supported (its gradient is not the derivative)")


def _spec(module, table: dict, mprefix: str, oprefix: str) -> dict:
    """``table`` (module name -> :class:`Stored` of our block-level names) where ``module`` has the
    parameter, module names prefixed ``mprefix``, ours ``oprefix``."""
    present = dict(module.named_parameters())
    return {mprefix + k: Stored(tuple(oprefix + n for n in s.names), s.axis, s.transposed)
            for k, s in table.items() if k in present}


def _block_config(module, table: dict, where: str, **kw) -> BlockConfig:
    """The :class:`BlockConfig` of a block with the options ``kw``: ``bias`` and ``ln_affine`` from
    the parameters present; ``ValueError`` naming what is missing if they are present on some layers only."""
    present = dict(module.named_parameters())
    ours = {n: k for k, s in table.items() if k in present for n in s.names}
    cfg = BlockConfig(bias=any(n.startswith(("b_", "beta_")) for n in ours),
                      ln_affine=any(n.startswith("gamma_") for n in ours), **kw)
    missing = [n for n in param_shapes(cfg) if n not in ours]
    if missing:
        where_missing = [k for k, s in table.items() if k not in present and set(s.names) & set(missing)]
        raise ValueError(f"{where}{'bias' if missing[0][0] == 'b' else 'LayerNorm affine'}: present on some layers only "
                         f"(no {', '.join(where_missing)}); the closed form needs all or none")
    return cfg


def _no_cross_attention(config, where: str) -> None:
    if getattr(config, "add_cross_attention", False):
        raise ValueError(f"{where}add_cross_attention=True is not supported (cross-attention; the closed form is "
                         "self-attention only)")


# ---------------------------------------------------------------------------------------------- GPT-2

def _gpt2_block(block, where: str = "", mprefix: str = "", oprefix: str = "") -> tuple:
    attn, mlp = block.attn, block.mlp
    config = attn.config
    _no_cross_attention(config, where)
    if hasattr(block, "crossattention") or getattr(attn, "is_cross_attention", False):
        raise ValueError(f"{where}crossattention is not supported (the closed form is self-attention only)")
    if not getattr(config, "scale_attn_weights", True):
        raise ValueError(f"{where}scale_attn_weights=False is not supported (the scores are scaled by 1/sqrt(d_k))")
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        raise ValueError(f"{where}scale_attn_by_inverse_layer_idx=True is not supported (the scores are scaled by "
                         "1/sqrt(d_k) only)")
    if getattr(config, "reorder_and_upcast_attn", False):
        raise ValueError(f"{where}reorder_and_upcast_attn=True is not supported (its scores are taken in float32)")
    _attn_implementation(config, where)
    d, H, dk = attn.embed_dim, attn.num_heads, attn.head_dim
    _scaling(attn, dk, where)
    eps1, _, _ = _layernorm(block.ln_1, d, f"{where}ln_1: ")
    eps2, _, _ = _layernorm(block.ln_2, d, f"{where}ln_2: ")
    if eps1 != eps2:
        raise ValueError(f"{where}layer_norm_epsilon: ln_1.eps={eps1} != ln_2.eps={eps2}; one eps is supported")
    t = {k: _transposed(m, f"{where}{k}: ") for k, m in
         (("attn.c_attn", attn.c_attn), ("attn.c_proj", attn.c_proj), ("mlp.c_fc", mlp.c_fc), ("mlp.c_proj", mlp.c_proj))}
    if t["attn.c_attn"]:
        raise ValueError(f"{where}attn.c_attn: expected transformers' Conv1D (the fused [W_Q | W_K | W_V]), got nn.Linear")
    table = {
        "ln_1.weight": Stored(("gamma_1",)), "ln_1.bias": Stored(("beta_1",)),
        "attn.c_attn.weight": Stored(("W_Q", "W_K", "W_V"), axis=1), "attn.c_attn.bias": Stored(("b_Q", "b_K", "b_V")),
        "attn.c_proj.weight": Stored(("W_O",), transposed=t["attn.c_proj"]), "attn.c_proj.bias": Stored(("b_O",)),
        "ln_2.weight": Stored(("gamma_2",)), "ln_2.bias": Stored(("beta_2",)),
        "mlp.c_fc.weight": Stored(("W_1",), transposed=t["mlp.c_fc"]), "mlp.c_fc.bias": Stored(("b_1",)),
        "mlp.c_proj.weight": Stored(("W_2",), transposed=t["mlp.c_proj"]), "mlp.c_proj.bias": Stored(("b_2",)),
    }
    w1 = mlp.c_fc.weight
    d_ff = w1.shape[0] if t["mlp.c_fc"] else w1.shape[1]
    cfg = _block_config(block, table, where, d_model=d, d_ff=d_ff, d_k=dk, n_heads=H, norm="pre",
                        activation=_activation(mlp.act, f"{where}mlp.act: "), out_proj=True, ln_eps=eps1, causal=True)
    return cfg, _spec(block, table, mprefix, oprefix)


def _gpt2_model(model, mprefix: str = "") -> tuple:
    _embedding(model.wte, f"{mprefix}wte: ")
    _embedding(model.wpe, f"{mprefix}wpe: ")
    blocks, spec = [], {}
    for i, block in enumerate(model.h):
        cfg, s = _gpt2_block(block, f"{mprefix}h.{i}: ", f"{mprefix}h.{i}.", block_prefix(i))
        blocks.append(cfg)
        spec.update(s)
    eps, affine, bias = _layernorm(model.ln_f, blocks[0].d_model, f"{mprefix}ln_f: ")
    spec.update(_spec(model, {"wte.weight": Stored(("W_E",)), "wpe.weight": Stored(("W_P",)),
                              "ln_f.weight": Stored(("gamma_F",)), "ln_f.bias": Stored(("beta_F",))}, mprefix, ""))
    kw = dict(blocks=tuple(blocks), embedding="token", vocab=model.wte.num_embeddings, positions="learned",
              n_positions=model.wpe.num_embeddings, final_norm=True, norm_affine=affine, norm_bias=bias, norm_eps=eps,
              pool="none")
    return kw, spec


def _gpt2(model) -> tuple:
    kw, spec = _gpt2_model(model)
    return ModelConfig(head=None, **kw), spec


def _lm_head(kw: dict, spec: dict, head, embedding) -> tuple:
    """A causal LM's ``ModelConfig`` and layout: the base model's ``kw``/``spec`` with ``lm_head`` (an
    ``nn.Linear``, ``W_H`` transposed, or tied to the token ``embedding``'s weight)."""
    if not isinstance(head, nn.Linear):
        raise ValueError(f"lm_head: expected nn.Linear, got {type(head).__name__}")
    tied = head.weight is embedding.weight
    if not tied:
        spec["lm_head.weight"] = Stored(("W_H",), transposed=True)
    if head.bias is not None:
        spec["lm_head.bias"] = Stored(("b_H",))
    return ModelConfig(head=head.out_features, head_bias=head.bias is not None, tied=tied, **kw), spec


def _gpt2_lm(model) -> tuple:
    kw, spec = _gpt2_model(model.transformer, "transformer.")
    return _lm_head(kw, spec, model.lm_head, model.transformer.wte)


def _gpt2_classifier(model) -> tuple:
    kw, spec = _gpt2_model(model.transformer, "transformer.")
    head = model.score
    if not isinstance(head, nn.Linear):
        raise ValueError(f"score: expected nn.Linear, got {type(head).__name__}")
    spec["score.weight"] = Stored(("W_H",), transposed=True)
    if head.bias is not None:
        spec["score.bias"] = Stored(("b_H",))
    kw["pool"] = "last"
    pad = getattr(model.config, "pad_token_id", None)
    return ModelConfig(head=head.out_features, head_bias=head.bias is not None, pad_token=pad, **kw), spec


# ---------------------------------------------------------------------------------------------- ViT

def _vit_layer(layer, where: str = "", mprefix: str = "", oprefix: str = "") -> tuple:
    att, mlp = layer.attention, layer.mlp
    _attn_implementation(att.config, where)
    d = layer.layernorm_before.normalized_shape[0]
    H, dk = att.num_attention_heads, att.head_dim
    if H * dk != d:
        raise ValueError(f"{where}head_dim={dk}: num_attention_heads * head_dim = {H * dk} != hidden_size = {d}; the "
                         "closed form needs d_model = n_heads * d_v")
    _scaling(att, dk, where)
    eps1, _, _ = _layernorm(layer.layernorm_before, d, f"{where}layernorm_before: ")
    eps2, _, _ = _layernorm(layer.layernorm_after, d, f"{where}layernorm_after: ")
    if eps1 != eps2:
        raise ValueError(f"{where}layer_norm_eps: layernorm_before.eps={eps1} != layernorm_after.eps={eps2}")
    lin = {k: _transposed(m, f"{where}{k}: ") for k, m in (("attention.q_proj", att.q_proj), ("attention.k_proj", att.k_proj),
           ("attention.v_proj", att.v_proj), ("attention.o_proj", att.o_proj), ("mlp.fc1", mlp.fc1), ("mlp.fc2", mlp.fc2))}
    table = {"layernorm_before.weight": Stored(("gamma_1",)), "layernorm_before.bias": Stored(("beta_1",)),
             "layernorm_after.weight": Stored(("gamma_2",)), "layernorm_after.bias": Stored(("beta_2",))}
    for k, (w, b) in {"attention.q_proj": ("W_Q", "b_Q"), "attention.k_proj": ("W_K", "b_K"),
                      "attention.v_proj": ("W_V", "b_V"), "attention.o_proj": ("W_O", "b_O"),
                      "mlp.fc1": ("W_1", "b_1"), "mlp.fc2": ("W_2", "b_2")}.items():
        table[f"{k}.weight"] = Stored((w,), transposed=lin[k])
        table[f"{k}.bias"] = Stored((b,))
    w1 = mlp.fc1.weight
    cfg = _block_config(layer, table, where, d_model=d, d_ff=w1.shape[0] if lin["mlp.fc1"] else w1.shape[1], d_k=dk,
                        n_heads=H, norm="pre", activation=_activation(mlp.activation_fn, f"{where}mlp.activation_fn: "),
                        out_proj=True, ln_eps=eps1, causal=bool(getattr(att, "is_causal", False)))
    return cfg, _spec(layer, table, mprefix, oprefix)


def _pair(v, where: str) -> tuple:
    v = tuple(v) if isinstance(v, (tuple, list)) else (v, v)
    if len(v) != 2:
        raise ValueError(f"{where}expected one size or a pair, got {v!r}")
    return v


def _vit_model(model, mprefix: str = "") -> tuple:
    emb = model.embeddings
    proj = emb.patch_embeddings.projection
    if not isinstance(proj, nn.Conv2d):
        raise ValueError(f"{mprefix}embeddings.patch_embeddings.projection: expected nn.Conv2d, got {type(proj).__name__}")
    k, s = _pair(proj.kernel_size, "projection.kernel_size: "), _pair(proj.stride, "projection.stride: ")
    if k[0] != k[1] or k != s or _pair(proj.padding, "") != (0, 0) or _pair(proj.dilation, "") != (1, 1) \
            or proj.groups != 1:
        raise ValueError(f"{mprefix}embeddings.patch_embeddings.projection: only square non-overlapping patches are supported "
                         f"(kernel = stride, no padding, dilation 1, groups 1), got kernel {k}, stride {s}, "
                         f"padding {proj.padding}, dilation {proj.dilation}, groups {proj.groups}")
    Hi, Wi = _pair(emb.patch_embeddings.image_size, "image_size: ")
    C, d = proj.in_channels, proj.out_channels
    blocks, spec = [], {}
    for i, layer in enumerate(model.layers):
        cfg, sp = _vit_layer(layer, f"{mprefix}layers.{i}: ", f"{mprefix}layers.{i}.", block_prefix(i))
        blocks.append(cfg)
        spec.update(sp)
    eps, affine, bias = _layernorm(model.layernorm, d, f"{mprefix}layernorm: ")
    table = {"embeddings.cls_token": Stored(("cls",)), "embeddings.position_embeddings": Stored(("W_P",)),
             "embeddings.patch_embeddings.projection.weight": Stored(("W_E",), transposed=True),
             "embeddings.patch_embeddings.projection.bias": Stored(("b_E",)),
             "embeddings.mask_token": Stored(()),  # used only with bool_masked_pos (masked image modelling)
             "layernorm.weight": Stored(("gamma_F",)), "layernorm.bias": Stored(("beta_F",)),
             "pooler.dense.weight": Stored(()), "pooler.dense.bias": Stored(())}  # pooler_output is not our output
    spec.update(_spec(model, table, mprefix, ""))
    n_pos = emb.position_embeddings.shape[1]
    kw = dict(blocks=tuple(blocks), embedding="patch", image=(C, Hi, Wi), patch=k[0], embed_bias=proj.bias is not None,
              cls_token=True, positions="learned", n_positions=n_pos, final_norm=True, norm_affine=affine,
              norm_bias=bias, norm_eps=eps)
    if n_pos != (Hi // k[0]) * (Wi // k[0]) + 1:
        raise ValueError(f"{mprefix}embeddings.position_embeddings: {n_pos} rows for {(Hi // k[0]) * (Wi // k[0])} patches "
                         "and the CLS token")
    return kw, spec


def _vit(model) -> tuple:
    kw, spec = _vit_model(model)
    return ModelConfig(pool="none", head=None, **kw), spec


def _vit_classifier(model) -> tuple:
    kw, spec = _vit_model(model.vit, "vit.")
    head = model.classifier
    if isinstance(head, nn.Identity):
        return ModelConfig(pool="first", head=None, **kw), spec
    if not isinstance(head, nn.Linear):
        raise ValueError(f"classifier: expected nn.Linear or nn.Identity, got {type(head).__name__}")
    spec["classifier.weight"] = Stored(("W_H",), transposed=True)
    if head.bias is not None:
        spec["classifier.bias"] = Stored(("b_H",))
    return ModelConfig(pool="first", head=head.out_features, head_bias=head.bias is not None, **kw), spec


# ---------------------------------------------------------------------------------------------- BERT

def _bert_position_type(config, where: str) -> None:
    kind = getattr(config, "position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"{where}position_embedding_type={kind!r} is not supported (only absolute learned positions; "
                         "relative position scores are not in the closed form)")


def _bert_layer(layer, where: str = "", mprefix: str = "", oprefix: str = "") -> tuple:
    sa, out1 = layer.attention.self, layer.attention.output
    config = sa.config
    _no_cross_attention(config, where)
    if hasattr(layer, "crossattention"):
        raise ValueError(f"{where}crossattention is not supported (the closed form is self-attention only)")
    _bert_position_type(config, where)
    _attn_implementation(config, where)
    H, dk = sa.num_attention_heads, sa.attention_head_size
    d = out1.LayerNorm.normalized_shape[0]
    if H * dk != d:
        raise ValueError(f"{where}num_attention_heads * head size = {H * dk} != hidden_size = {d}")
    _scaling(sa, dk, where)
    eps1, _, _ = _layernorm(out1.LayerNorm, d, f"{where}attention.output.LayerNorm: ")
    eps2, _, _ = _layernorm(layer.output.LayerNorm, d, f"{where}output.LayerNorm: ")
    if eps1 != eps2:
        raise ValueError(f"{where}layer_norm_eps: attention.output.LayerNorm.eps={eps1} != output.LayerNorm.eps={eps2}")
    mods = {"attention.self.query": (sa.query, "W_Q", "b_Q"), "attention.self.key": (sa.key, "W_K", "b_K"),
            "attention.self.value": (sa.value, "W_V", "b_V"), "attention.output.dense": (out1.dense, "W_O", "b_O"),
            "intermediate.dense": (layer.intermediate.dense, "W_1", "b_1"), "output.dense": (layer.output.dense, "W_2", "b_2")}
    table = {"attention.output.LayerNorm.weight": Stored(("gamma_1",)), "attention.output.LayerNorm.bias": Stored(("beta_1",)),
             "output.LayerNorm.weight": Stored(("gamma_2",)), "output.LayerNorm.bias": Stored(("beta_2",))}
    lin = {}
    for k, (m, w, b) in mods.items():
        lin[k] = _transposed(m, f"{where}{k}: ")
        table[f"{k}.weight"] = Stored((w,), transposed=lin[k])
        table[f"{k}.bias"] = Stored((b,))
    w1 = layer.intermediate.dense.weight
    act = _activation(layer.intermediate.intermediate_act_fn, f"{where}intermediate.intermediate_act_fn: ")
    causal = bool(getattr(sa, "is_causal", False) or getattr(config, "is_decoder", False))
    cfg = _block_config(layer, table, where, d_model=d, d_ff=w1.shape[0] if lin["intermediate.dense"] else w1.shape[1],
                        d_k=dk, n_heads=H, norm="post", activation=act, out_proj=True, ln_eps=eps1, causal=causal)
    return cfg, _spec(layer, table, mprefix, oprefix)


def _bert(model) -> tuple:
    _no_cross_attention(model.config, "")
    _bert_position_type(model.config, "")
    emb = model.embeddings
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        _embedding(getattr(emb, name), f"embeddings.{name}: ")
    types = getattr(emb, "token_type_ids", None)
    if isinstance(types, torch.Tensor) and bool(types.ne(0).any()):
        raise ValueError("embeddings.token_type_ids: only token type 0 for every token is supported")
    pos = getattr(emb, "position_ids", None)
    if isinstance(pos, torch.Tensor) and not torch.equal(pos.reshape(-1).cpu(), torch.arange(pos.numel())):
        raise ValueError("embeddings.position_ids: only positions 0, 1, ... are supported")
    blocks, spec = [], {}
    for i, layer in enumerate(model.encoder.layer):
        cfg, sp = _bert_layer(layer, f"encoder.layer.{i}: ", f"encoder.layer.{i}.", block_prefix(i))
        blocks.append(cfg)
        spec.update(sp)
    eps, affine, bias = _layernorm(emb.LayerNorm, blocks[0].d_model, "embeddings.LayerNorm: ")
    spec.update(_spec(model, {
        "embeddings.word_embeddings.weight": Stored(("W_E",)), "embeddings.position_embeddings.weight": Stored(("W_P",)),
        "embeddings.token_type_embeddings.weight": Stored(("W_T",)),
        "embeddings.LayerNorm.weight": Stored(("gamma_E",)), "embeddings.LayerNorm.bias": Stored(("beta_E",)),
        "pooler.dense.weight": Stored(()), "pooler.dense.bias": Stored(())}, "", ""))  # pooler_output is not our output
    return ModelConfig(blocks=tuple(blocks), embedding="token", vocab=emb.word_embeddings.num_embeddings,
                       positions="learned", n_positions=emb.position_embeddings.num_embeddings,
                       token_types=emb.token_type_embeddings.num_embeddings, embed_norm=True, norm_affine=affine,
                       norm_bias=bias, norm_eps=eps, pool="none", head=None), spec


# ---------------------------------------------------------------------------------------------- Llama family

def _family(module) -> str:
    return next(f for f in FAMILIES if type(module).__name__.startswith(f))


def _rms_norm(norm, family: str, d: int, where: str) -> tuple:
    """``(eps, rms_offset)`` of a family's RMSNorm: Llama's, Qwen2's, Mistral's ``weight · x̂``
    (``variance_epsilon``), Gemma's ``(1 + weight) · x̂`` (``eps``)."""
    if not _is(norm, f"{family}RMSNorm") or tuple(norm.weight.shape) != (d,):
        raise ValueError(f"{where}expected transformers' {family}RMSNorm({d}), got {type(norm).__name__}")
    if family == "Gemma":
        return float(norm.eps), 1.0
    return float(norm.variance_epsilon), 0.0


def _rope(config, where: str) -> float:
    """``rope_theta`` of the default rotary embedding; every other variant refused by name."""
    rp = getattr(config, "rope_parameters", None) or {}
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind != "default":
        raise ValueError(f"{where}rope_parameters rope_type={kind!r} is not supported: only the default rotary "
                         "embedding (rope_type='default'; not linear, dynamic, yarn, llama3, longrope) is in the "
                         "closed form")
    partial = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial is not None and partial != 1.0:
        raise ValueError(f"{where}partial_rotary_factor={partial} is not supported: the rotary embedding turns every "
                         "entry of a head (factor 1.0)")
    if "rope_theta" not in rp:
        raise ValueError(f"{where}rope_parameters has no rope_theta: cannot read the rotary base")
    return float(rp["rope_theta"])


def _biases(layer, where: str) -> dict:
    """``bias``/``qkv_bias`` from the projections' biases present: none; q, k, v only (Qwen2); or every
    projection's, attention's and the MLP's (Llama's ``attention_bias`` with ``mlp_bias``). Any other
    combination is refused: the closed form has ``b_O`` and the MLP's biases only all together."""
    present = dict(layer.named_parameters())
    has = {k: f"{k}.bias" in present for k in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    qkv, o, mlp = [has[k] for k in list(has)[:3]], has["self_attn.o_proj"], [has[k] for k in list(has)[4:]]
    if not any(has.values()):
        return {}
    if all(qkv) and not o and not any(mlp):
        return {"qkv_bias": True}
    if all(has.values()):
        return {"bias": True}
    shown = ", ".join(f"{k}.bias" for k, v in has.items() if v)
    raise ValueError(f"{where}biases on {shown} only: the closed form takes none, q/k/v only (Qwen2), or every "
                     "projection's with the MLP's (attention_bias=True with mlp_bias=True); an o_proj bias without "
                     "the MLP's (Llama's attention_bias alone) or MLP biases alone are not supported")


def _llama_config_checks(config, where: str) -> None:
    if getattr(config, "use_bidirectional_attention", None):
        raise ValueError(f"{where}use_bidirectional_attention=True is not supported (the decoder is read as causal)")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            raise ValueError(f"{where}{name}={getattr(config, name)} is not supported (logit softcapping, Gemma 2's, "
                             "is not in the closed form)")


def _llama_layer(layer, where: str = "", mprefix: str = "", oprefix: str = "") -> tuple:
    family = _family(layer)
    att, mlp = layer.self_attn, layer.mlp
    config = att.config
    _llama_config_checks(config, where)
    _attn_implementation(config, where)
    d, H, G, dk = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, att.head_dim
    _scaling(att, dk, where)
    if not getattr(att, "is_causal", True):
        raise ValueError(f"{where}self_attn.is_causal=False is not supported (the decoder is read as causal)")
    eps1, off1 = _rms_norm(layer.input_layernorm, family, d, f"{where}input_layernorm: ")
    eps2, off2 = _rms_norm(layer.post_attention_layernorm, family, d, f"{where}post_attention_layernorm: ")
    if eps1 != eps2:
        raise ValueError(f"{where}rms_norm_eps: input_layernorm {eps1} != post_attention_layernorm {eps2}")
    mods = {"self_attn.q_proj": ("W_Q", "b_Q"), "self_attn.k_proj": ("W_K", "b_K"), "self_attn.v_proj": ("W_V", "b_V"),
            "self_attn.o_proj": ("W_O", "b_O"), "mlp.gate_proj": ("W_G", "b_G"), "mlp.up_proj": ("W_1", "b_1"),
            "mlp.down_proj": ("W_2", "b_2")}
    table = {"input_layernorm.weight": Stored(("gamma_1",)), "post_attention_layernorm.weight": Stored(("gamma_2",))}
    for k, (w, b) in mods.items():
        if not isinstance(layer.get_submodule(k), nn.Linear):
            raise ValueError(f"{where}{k}: expected nn.Linear, got {type(layer.get_submodule(k)).__name__}")
        table[f"{k}.weight"] = Stored((w,), transposed=True)
        table[f"{k}.bias"] = Stored((b,))
    window = att.sliding_window if hasattr(att, "sliding_window") else getattr(config, "sliding_window", None)
    cfg = BlockConfig(d_model=d, d_ff=mlp.gate_proj.out_features, n_heads=H, n_kv_heads=G, d_k=dk, d_v=dk,
                      out_proj=True, norm="pre", norm_type="rms", rms_offset=off1, ln_affine=True, ln_eps=eps1,
                      gated=True, activation=_activation(mlp.act_fn, f"{where}mlp.act_fn: "), rope=True,
                      rope_theta=_rope(config, where), causal=True, sliding_window=window, **_biases(layer, where))
    return cfg, _spec(layer, table, mprefix, oprefix)


def _llama_model(model, mprefix: str = "") -> tuple:
    family = _family(model)
    config = model.config
    _llama_config_checks(config, "")
    emb = model.embed_tokens
    scaled = _is(emb, "GemmaTextScaledWordEmbedding")
    if type(emb) is not nn.Embedding and not scaled:
        raise ValueError(f"{mprefix}embed_tokens: expected nn.Embedding, got {type(emb).__name__}")
    _embedding(emb, f"{mprefix}embed_tokens: ")
    if len(model.layers) != config.num_hidden_layers:
        raise ValueError(f"{mprefix}layers: {len(model.layers)} layers but config.num_hidden_layers="
                         f"{config.num_hidden_layers} (the forward runs that many)")
    blocks, spec = [], {}
    for i, layer in enumerate(model.layers):
        if not _is(layer, f"{family}DecoderLayer"):
            raise ValueError(f"{mprefix}layers.{i}: expected {family}DecoderLayer, got {type(layer).__name__}")
        cfg, s = _llama_layer(layer, f"{mprefix}layers.{i}: ", f"{mprefix}layers.{i}.", block_prefix(i))
        blocks.append(cfg)
        spec.update(s)
    rot = model.rotary_emb  # the layers' config read already: this is the module's own state
    if getattr(rot, "rope_type", "default") != "default" or getattr(rot, "attention_scaling", 1.0) != 1.0:
        raise ValueError(f"{mprefix}rotary_emb: rope_type={getattr(rot, 'rope_type', None)!r} with attention_scaling="
                         f"{getattr(rot, 'attention_scaling', None)}: only the default rotary embedding is supported")
    eps, off = _rms_norm(model.norm, family, blocks[0].d_model, f"{mprefix}norm: ")
    spec.update(_spec(model, {"embed_tokens.weight": Stored(("W_E",)), "norm.weight": Stored(("gamma_F",))}, mprefix, ""))
    kw = dict(blocks=tuple(blocks), embedding="token", vocab=emb.num_embeddings, final_norm=True, norm_type="rms",
              norm_affine=True, norm_bias=False, norm_eps=eps, rms_offset=off, pool="none",
              embed_scale=float(emb.embed_scale) if scaled else 1.0)
    return kw, spec


def _llama(model) -> tuple:
    kw, spec = _llama_model(model)
    return ModelConfig(head=None, **kw), spec


def _llama_lm(model) -> tuple:
    kw, spec = _llama_model(model.model, "model.")
    return _lm_head(kw, spec, model.lm_head, model.model.embed_tokens)


_READERS = {"GPT2LMHeadModel": _gpt2_lm, "GPT2ForSequenceClassification": _gpt2_classifier, "GPT2Model": _gpt2,
            "GPT2Block": _gpt2_block,
            "ViTForImageClassification": _vit_classifier, "ViTModel": _vit, "ViTLayer": _vit_layer,
            "BertModel": _bert, "BertLayer": _bert_layer,
            **{f"{f}ForCausalLM": _llama_lm for f in FAMILIES}, **{f"{f}Model": _llama for f in FAMILIES},
            **{f"{f}DecoderLayer": _llama_layer for f in FAMILIES}}


def describe(module) -> tuple:
    """``(cfg, spec)`` of a module :func:`reads` (structure only: the mode is
    :func:`blockhess.adapters.mode.check_deterministic`'s): a
    :class:`~blockhess.config.ModelConfig` for a model, a :class:`~blockhess.config.BlockConfig` for a block.

    Raises ``ValueError`` naming the module and the setting for what the closed form does not
    cover (cross-attention, relative positions, a scaling other than ``1/sqrt(d_k)``, an attention
    implementation other than eager/sdpa, an activation other than relu/gelu/gelu_tanh, biases or
    LayerNorm scales on some layers only, ...) and for a module whose layout is not the one read
    (an attribute missing)."""
    name = _name(module)
    try:
        return _READERS[name](module)
    except AttributeError as e:
        raise ValueError(f"{name}: cannot read its layout ({e}); from_torch reads transformers 5's "
                         f"{name} (docs/models.md)") from None
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
