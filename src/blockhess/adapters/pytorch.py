"""PyTorch's own Transformer modules: ``nn.TransformerEncoderLayer``, ``nn.MultiheadAttention`` and
``nn.TransformerEncoder``, read into a config and a spec (:mod:`.layout`).

``nn.Linear`` weights, stored ``(out, in)``, are transposed (row vectors act on the right here);
``in_proj_weight`` is ``[W_Q; W_K; W_V]`` stacked along its rows (:data:`~blockhess.config.TORCH_NAMES`).
The blocks take their input as ``(B, L, d_model)`` (or ``(L, d_model)``): for layers with
``batch_first=False`` pass ``X.transpose(0, 1)`` (:func:`block_input` does it).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as Fn

from ..config import TORCH_NAMES, BlockConfig, ModelConfig, block_prefix
from .layout import Stored

__all__ = ["describe", "causal_from_masks", "activation", "block_input", "reads", "SUPPORTED"]

#: What this reader takes, for error messages.
SUPPORTED = "nn.TransformerEncoderLayer, nn.MultiheadAttention, nn.TransformerEncoder"


def reads(module) -> bool:
    """Whether ``module`` is one of the PyTorch modules this reader takes."""
    return isinstance(module, (nn.TransformerEncoderLayer, nn.MultiheadAttention, nn.TransformerEncoder))


def activation(act) -> str:
    """Our name (``"relu"``, ``"gelu"``, ``"gelu_tanh"``) of a PyTorch activation: the strings
    ``"relu"``/``"gelu"``, ``F.relu``, ``F.gelu``, ``nn.ReLU()``, ``nn.GELU(approximate=...)``,
    ``functools.partial(F.gelu, approximate=...)``. Raises ``ValueError`` for any other."""
    if isinstance(act, str):
        if act in ("relu", "gelu"):
            return act
    elif act is Fn.relu or isinstance(act, nn.ReLU):
        return "relu"
    elif act is Fn.gelu:
        return "gelu"
    elif isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    elif isinstance(act, functools.partial) and act.func is Fn.gelu and not act.args:
        approx = act.keywords.get("approximate", "none")
        if set(act.keywords) <= {"approximate"} and approx in ("none", "tanh"):
            return "gelu_tanh" if approx == "tanh" else "gelu"
    raise ValueError(
        f"activation={act!r}: a custom activation is not supported; use 'relu', 'gelu', F.relu, F.gelu, "
        "nn.ReLU(), nn.GELU() or nn.GELU(approximate='tanh')"
    )


def _is_causal_mask(mask: torch.Tensor) -> bool:
    if mask.ndim != 2 or mask.shape[0] != mask.shape[1]:
        return False
    n = mask.shape[0]
    upper = torch.ones(n, n, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, upper))
    return bool(torch.isneginf(mask[upper]).all() and (mask[~upper] == 0).all())


def causal_from_masks(src_mask, is_causal, src_key_padding_mask) -> bool:
    """Whether the masks :func:`~blockhess.adapters.from_torch` was given make the attention causal.
    Raises ``ValueError`` for a mask other than the causal one and a key padding mask that pads."""
    if src_key_padding_mask is not None and bool(torch.as_tensor(src_key_padding_mask).ne(0).any()):
        raise ValueError("src_key_padding_mask: a mask that pads is a batch's, not the module's: pass it with the "
                         "inputs, bh.hessian(params, {'src': X, 'src_key_padding_mask': mask}, cfg, ...), and give "
                         "from_torch only the causal mask (src_mask or is_causal)")
    if src_mask is not None:
        if not isinstance(src_mask, torch.Tensor) or not _is_causal_mask(src_mask):
            raise ValueError("src_mask: only the causal mask (-inf or True above the diagonal) is supported")
        return True
    return bool(is_causal)


def _check_attention(mha: nn.MultiheadAttention, where: str) -> None:
    if not mha._qkv_same_embed_dim or mha.kdim != mha.embed_dim or mha.vdim != mha.embed_dim:
        raise ValueError(f"{where}kdim/vdim={mha.kdim}/{mha.vdim} != d_model={mha.embed_dim}: only self-attention "
                         "with kdim = vdim = d_model is supported")
    if mha.bias_k is not None or mha.bias_v is not None:
        raise ValueError(f"{where}add_bias_kv=True is not supported")
    if mha.add_zero_attn:
        raise ValueError(f"{where}add_zero_attn=True is not supported")


def _layer_config(module: nn.Module, is_causal: bool, where: str = "") -> BlockConfig:
    """The :class:`BlockConfig` of a layer or a bare attention (structure only: no mask checks; the
    mode is :func:`blockhess.adapters.mode.check_deterministic`'s); ``ValueError`` naming the setting for what the closed form does not cover."""
    if isinstance(module, nn.MultiheadAttention):
        _check_attention(module, where)
        d, H = module.embed_dim, module.num_heads
        has_b = module.in_proj_bias is not None
        if has_b != (module.out_proj.bias is not None):
            raise ValueError(f"{where}bias: in_proj_bias and out_proj.bias must both be present or both absent")
        return BlockConfig(d_model=d, n_heads=H, d_k=d // H, bias=has_b, out_proj=True, causal=is_causal,
                           kind="attention")
    if isinstance(module, nn.TransformerEncoderLayer):
        sa = module.self_attn
        _check_attention(sa, f"{where}self_attn: ")
        act = activation(module.activation)
        d, H, dff = sa.embed_dim, sa.num_heads, module.linear1.out_features
        n1, n2 = module.norm1, module.norm2
        if tuple(n1.normalized_shape) != (d,) or tuple(n2.normalized_shape) != (d,):
            raise ValueError(f"{where}norm1/norm2: normalized_shape must be ({d},)")
        if n1.eps != n2.eps:
            raise ValueError(f"{where}layer_norm_eps: norm1.eps={n1.eps} != norm2.eps={n2.eps}; one eps is supported")
        affine = {n1.weight is not None, n2.weight is not None}
        if len(affine) != 1:
            raise ValueError(f"{where}norm1/norm2: elementwise_affine must be the same for both LayerNorms")
        biases = {"self_attn.in_proj_bias": sa.in_proj_bias is not None,
                  "self_attn.out_proj.bias": sa.out_proj.bias is not None,
                  "linear1.bias": module.linear1.bias is not None, "linear2.bias": module.linear2.bias is not None,
                  "norm1.bias": n1.bias is not None, "norm2.bias": n2.bias is not None}
        if len(set(biases.values())) != 1:
            raise ValueError(f"{where}bias: present on some layers only ({biases}); the closed form needs all or none")
        return BlockConfig(d_model=d, d_ff=dff, n_heads=H, d_k=d // H, norm="pre" if module.norm_first else "post",
                           activation=act, bias=biases["linear1.bias"], out_proj=True, ln_affine=affine.pop(),
                           ln_eps=float(n1.eps), causal=is_causal)
    raise ValueError(f"{where}expected nn.TransformerEncoderLayer, got {type(module).__name__}")


def _layer_spec(module: nn.Module, mprefix: str = "", oprefix: str = "") -> dict:
    """The spec of a layer's (or a bare attention's) parameters, module names prefixed ``mprefix``,
    ours ``oprefix``, from :data:`~blockhess.config.TORCH_NAMES`."""
    table = TORCH_NAMES
    if isinstance(module, nn.MultiheadAttention):
        table = {k[len("self_attn."):]: v for k, v in TORCH_NAMES.items() if k.startswith("self_attn.")}
    present = dict(module.named_parameters())
    return {mprefix + k: Stored(tuple(oprefix + n for n, _ in parts), 0, parts[0][1])
            for k, parts in table.items() if k in present}


def describe(module: nn.Module, is_causal: bool = False) -> tuple:
    """``(cfg, spec)`` of a module :func:`reads` (structure only: the mode is
    :func:`blockhess.adapters.mode.check_deterministic`'s).

    ``nn.TransformerEncoder``: a :class:`ModelConfig` with ``embedding="none"``, one block per layer
    (each read as a layer; ``layers.{i}.`` -> ``blocks.{i}.``), the final ``norm`` (an
    ``nn.LayerNorm`` or none) as ``final_norm`` (``gamma_F``, ``beta_F``), no pooling, no head.
    Raises ``ValueError`` naming the setting for what the closed form does not cover."""
    if isinstance(module, nn.TransformerEncoder):
        blocks, spec = [], {}
        firsts = {layer.self_attn.batch_first for layer in module.layers if isinstance(layer, nn.TransformerEncoderLayer)}
        if len(firsts) > 1:
            raise ValueError("nn.TransformerEncoder: batch_first differs between its layers; one input layout is needed")
        for i, layer in enumerate(module.layers):
            blocks.append(_layer_config(layer, is_causal, f"layers.{i}: "))
            spec.update(_layer_spec(layer, f"layers.{i}.", block_prefix(i)))
        norm = module.norm
        kw = {}
        if norm is not None:
            d = blocks[0].d_model
            if not isinstance(norm, nn.LayerNorm) or tuple(norm.normalized_shape) != (d,):
                raise ValueError(f"nn.TransformerEncoder: norm must be nn.LayerNorm({d}) or None, got {norm!r}")
            kw = dict(final_norm=True, norm_affine=norm.weight is not None, norm_bias=norm.bias is not None,
                      norm_eps=float(norm.eps))
            if norm.weight is not None:
                spec["norm.weight"] = Stored(("gamma_F",))
            if norm.bias is not None:
                spec["norm.bias"] = Stored(("beta_F",))
        return ModelConfig(blocks=tuple(blocks), embedding="none", pool="none", head=None, **kw), spec
    if isinstance(module, (nn.TransformerEncoderLayer, nn.MultiheadAttention)):
        return _layer_config(module, is_causal), _layer_spec(module)
    raise ValueError(f"from_torch supports {SUPPORTED}, got {type(module).__name__}")


def block_input(module: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """``X`` in the product's layout ``(B, L, d)`` (or ``(L, d)`` unbatched) for a PyTorch layer,
    bare attention or ``nn.TransformerEncoder``: ``(L, B, d)`` is transposed for ``batch_first=False``
    (a view). Raises ``ValueError`` for another module."""
    if isinstance(module, nn.TransformerEncoder):
        module = module.layers[0]
    if not isinstance(module, (nn.TransformerEncoderLayer, nn.MultiheadAttention)):
        raise ValueError(f"block_input supports nn.TransformerEncoderLayer and nn.MultiheadAttention, "
                         f"nn.TransformerEncoder and Hugging Face's blocks, got {type(module).__name__}")
    batch_first = module.batch_first if isinstance(module, nn.MultiheadAttention) else module.self_attn.batch_first
    return X if batch_first or X.ndim == 2 else X.transpose(0, 1)
