"""Real PyTorch layers -> ``(cfg, params)``, and Hessians back in the layer's own parameters.

``from_torch(layer)`` reads an ``nn.TransformerEncoderLayer`` (or a bare
``nn.MultiheadAttention``) in eval mode into a :class:`~blockhess.config.BlockConfig` and a
params dict in this library's conventions (docs/derivations.md: row vectors act on the right, so
every ``nn.Linear`` weight, stored ``(out, in)``, is transposed; ``in_proj_weight`` is
``[W_Q; W_K; W_V]`` stacked along its rows). ``to_module(H, layer)`` (also
``H.to_module(layer)``) maps a :class:`~blockhess.result.HessianBlocks` back to the layer's
parameter names (``self_attn.in_proj_weight``, ``linear1.weight``, ...) in their storage
layout, so that it can be compared with, or used in place of, ``torch.func.hessian`` of the
layer through ``torch.func.functional_call``.

The product takes its input as ``(B, L, d_model)`` (or ``(L, d_model)``): for a layer with
``batch_first=False`` pass ``X.transpose(0, 1)`` (:func:`block_input` does it).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn as nn
import torch.nn.functional as Fn

from .result import HessianBlocks, pairs, relabel
from .config import TORCH_NAMES, BlockConfig, param_shapes
from .validation import FLOAT_DTYPES

__all__ = ["from_torch", "to_module", "block_input"]

def _spec(module: nn.Module) -> dict:
    if isinstance(module, nn.MultiheadAttention):
        return {k[len("self_attn."):]: v for k, v in TORCH_NAMES.items() if k.startswith("self_attn.")}
    return TORCH_NAMES


def _activation(act) -> str:
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


def _is_causal_mask(mask: torch.Tensor, L: int | None) -> bool:
    if mask.ndim != 2 or mask.shape[0] != mask.shape[1] or (L is not None and mask.shape[0] != L):
        return False
    n = mask.shape[0]
    upper = torch.ones(n, n, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, upper))
    return bool(torch.isneginf(mask[upper]).all() and (mask[~upper] == 0).all())


def _check_attention(mha: nn.MultiheadAttention, where: str) -> None:
    if not mha._qkv_same_embed_dim or mha.kdim != mha.embed_dim or mha.vdim != mha.embed_dim:
        raise ValueError(f"{where}kdim/vdim={mha.kdim}/{mha.vdim} != d_model={mha.embed_dim}: only self-attention "
                         "with kdim = vdim = d_model is supported")
    if mha.bias_k is not None or mha.bias_v is not None:
        raise ValueError(f"{where}add_bias_kv=True is not supported")
    if mha.add_zero_attn:
        raise ValueError(f"{where}add_zero_attn=True is not supported")


def _check_dropout(module: nn.Module, names: dict) -> None:
    if not module.training:
        return
    for name, p in names.items():
        if p > 0:
            raise ValueError(f"{name}={p} in training mode is not supported (dropout makes the layer random): "
                             "call module.eval() or set the dropout to 0")


def _module_config(module: nn.Module, is_causal: bool) -> BlockConfig:
    """The :class:`BlockConfig` of ``module`` (structure only: no dropout or mask checks);
    ``ValueError`` for what the closed form does not cover, as :func:`from_torch`."""
    if isinstance(module, nn.MultiheadAttention):
        _check_attention(module, "")
        d, H = module.embed_dim, module.num_heads
        has_b = module.in_proj_bias is not None
        if has_b != (module.out_proj.bias is not None):
            raise ValueError("bias: in_proj_bias and out_proj.bias must both be present or both absent")
        return BlockConfig(d_model=d, n_heads=H, d_k=d // H, bias=has_b, out_proj=True, causal=is_causal,
                           kind="attention")
    if isinstance(module, nn.TransformerEncoderLayer):
        sa = module.self_attn
        _check_attention(sa, "self_attn: ")
        act = _activation(module.activation)
        d, H, dff = sa.embed_dim, sa.num_heads, module.linear1.out_features
        n1, n2 = module.norm1, module.norm2
        if tuple(n1.normalized_shape) != (d,) or tuple(n2.normalized_shape) != (d,):
            raise ValueError(f"norm1/norm2: normalized_shape must be ({d},)")
        if n1.eps != n2.eps:
            raise ValueError(f"layer_norm_eps: norm1.eps={n1.eps} != norm2.eps={n2.eps}; one eps is supported")
        affine = {n1.weight is not None, n2.weight is not None}
        if len(affine) != 1:
            raise ValueError("norm1/norm2: elementwise_affine must be the same for both LayerNorms")
        biases = {"self_attn.in_proj_bias": sa.in_proj_bias is not None,
                  "self_attn.out_proj.bias": sa.out_proj.bias is not None,
                  "linear1.bias": module.linear1.bias is not None, "linear2.bias": module.linear2.bias is not None,
                  "norm1.bias": n1.bias is not None, "norm2.bias": n2.bias is not None}
        if len(set(biases.values())) != 1:
            raise ValueError(f"bias: present on some layers only ({biases}); the closed form needs all or none")
        return BlockConfig(d_model=d, d_ff=dff, n_heads=H, d_k=d // H, norm="pre" if module.norm_first else "post",
                           activation=act, bias=biases["linear1.bias"], out_proj=True, ln_affine=affine.pop(),
                           ln_eps=float(n1.eps), causal=is_causal)
    raise ValueError(f"from_torch supports nn.TransformerEncoderLayer and nn.MultiheadAttention, got {type(module).__name__}")


def from_torch(module: nn.Module, *, src_mask: torch.Tensor | None = None, is_causal: bool = False,
               src_key_padding_mask: torch.Tensor | None = None, dtype: torch.dtype | None = None):
    """``(cfg, params)`` of an ``nn.TransformerEncoderLayer`` (or ``nn.MultiheadAttention``).

    Reads ``d_model``, ``nhead``, ``dim_feedforward``, ``norm_first`` (``norm="pre"``), the
    activation (``"relu"``/``"gelu"``, ``F.relu``/``F.gelu``, ``nn.ReLU()``, ``nn.GELU()``,
    ``nn.GELU(approximate="tanh")``, ``functools.partial(F.gelu, approximate=...)``), ``bias``
    on or off, ``layer_norm_eps``, and whether the LayerNorms have scales (``ln_affine``,
    PyTorch's ``elementwise_affine``); ``batch_first`` only changes the input layout
    (:func:`block_input`). Attention always has its output projection (``out_proj=True``);
    ``d_k = d_model / nhead`` (PyTorch scales by ``1/sqrt(head_dim)``). A causal mask
    (``is_causal=True``, or ``src_mask`` equal to
    ``nn.Transformer.generate_square_subsequent_mask(L)`` or its boolean form) gives
    ``causal=True``: the causal mask of whatever length ``X`` has later (the mask's own ``L``
    is not kept). ``is_causal=True`` alone applies the mask here, whereas PyTorch's layer takes
    it only as a hint about a ``src_mask`` it must also be given (without one it runs
    unmasked, or raises). A key padding mask that pads nothing (all False, or all 0) is
    accepted; one that pads is refused: a padded batch's Hessian is the mean of each
    sequence's Hessian at its own length. ``params`` are detached copies in this library's layout, shapes
    :func:`~blockhess.config.param_shapes` ``(cfg)`` (``nn.Linear`` weights transposed,
    ``in_proj_weight`` split into ``W_Q, W_K, W_V``), in ``dtype`` if given, else the
    module's. Source: docs/derivations.md §14.

    Raises ``ValueError`` naming the setting for what the closed form does not cover:
    dropout > 0 in training mode, a custom activation, ``kdim``/``vdim`` != ``d_model``,
    ``add_bias_kv``, ``add_zero_attn``, a mask other than the causal one, a key padding
    mask that pads, LayerNorms with different eps or affine settings, biases on some layers only; and
    for ``dtype`` other than ``None``, float32 or float64.
    """
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ValueError(f"from_torch: dtype must be float32 or float64, got {dtype}")
    if src_key_padding_mask is not None and bool(torch.as_tensor(src_key_padding_mask).ne(0).any()):
        raise ValueError("src_key_padding_mask: a mask that pads is not supported (only the causal mask is); "
                         "compute each sequence's Hessian at its own length, bh.hessian(params, X[b, :L_b], ...), "
                         "and average them (a batch's loss is the mean over sequences)")
    if src_mask is not None:
        if not isinstance(src_mask, torch.Tensor) or not _is_causal_mask(src_mask, None):
            raise ValueError("src_mask: only the causal mask (-inf or True above the diagonal) is supported")
        is_causal = True
    cfg = _module_config(module, bool(is_causal))
    if isinstance(module, nn.MultiheadAttention):
        _check_dropout(module, {"dropout": module.dropout})
    else:
        _check_dropout(module, {"dropout": module.dropout.p, "dropout1": module.dropout1.p,
                                "dropout2": module.dropout2.p, "self_attn.dropout": module.self_attn.dropout})
    named = dict(module.named_parameters())
    params = {}
    for mname, parts in _spec(module).items():
        if mname not in named:
            continue
        t = named[mname].detach()
        chunks = t.chunk(len(parts), 0)
        for (ours, transposed), chunk in zip(parts, chunks):
            params[ours] = (chunk.T if transposed else chunk).clone().contiguous()
    if dtype is not None:
        params = {k: v.to(dtype) for k, v in params.items()}
    return cfg, {n: params[n] for n in param_shapes(cfg)}


def block_input(module: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """The layer's input ``X`` in the product's layout ``(B, L, d)`` (or ``(L, d)`` unbatched):
    ``(L, B, d)`` is transposed for ``batch_first=False``; a view, same dtype and device.

    Raises ``ValueError`` if ``module`` is not an ``nn.TransformerEncoderLayer`` or
    ``nn.MultiheadAttention``.
    """
    if not isinstance(module, (nn.TransformerEncoderLayer, nn.MultiheadAttention)):
        raise ValueError(f"block_input supports nn.TransformerEncoderLayer and nn.MultiheadAttention, got {type(module).__name__}")
    batch_first = module.batch_first if isinstance(module, nn.MultiheadAttention) else module.self_attn.batch_first
    return X if batch_first or X.ndim == 2 else X.transpose(0, 1)


def _structure(cfg: BlockConfig) -> BlockConfig:
    """``cfg`` with what does not change the parameters' meaning made equal: the mask, ``d_k``
    left to its default, ``d_ff`` of the bare attention layer (unused)."""
    return dataclasses.replace(cfg, causal=False, d_k=cfg.head_dim, d_ff=cfg.d_ff if cfg.kind == "block" else 1)


def to_module(H: HessianBlocks, module: nn.Module) -> HessianBlocks:
    """``H`` re-keyed by ``module``'s parameter names, each in its storage layout.

    Returns a :class:`~blockhess.result.HessianBlocks` whose ``names`` are the module's
    parameter names (``named_parameters`` order) that ``H`` covers, with their shapes
    (``self_attn.in_proj_weight``: ``(3 d, d)``, ``linear1.weight``: ``(d_ff, d)``, ...), so
    ``Hm[a, b]`` is ``(numel_a, numel_b)`` in row-major order of the stored tensors and
    ``Hm.dense()`` is the Hessian of the loss through ``torch.func.functional_call(module, ...)``,
    flattened. (Autograd through the module itself needs ``sdpa_kernel(SDPBackend.MATH)``: the
    CPU flash-attention kernel has no second derivative. There ``torch.autograd.functional.hessian``
    and ``hvp`` agree, ``torch.func.hessian`` only in the upper triangle: its second derivative
    of ``F.layer_norm`` with a weight is wrong in torch 2.13, docs/derivations.md §9; the tests
    use a plain-ops forward.)
    ``.outer`` and ``.functional``
    map likewise. The input block ``"X"`` (``wrt_input``) is not a module parameter and is left out.

    Raises ``ValueError`` if ``H`` is of another block than ``module`` (``H.cfg``, when it has
    one, against :func:`from_torch`'s reading of ``module``; the mask and dropout aside), covers none
    of its parameters, or covers a stored tensor only in part (``in_proj_weight`` holds
    ``W_Q, W_K, W_V``); :func:`from_torch`'s errors for a module it cannot read.
    """
    if H.cfg is not None:
        mine = _module_config(module, False)
        if _structure(H.cfg) != _structure(mine):
            raise ValueError(f"H is the Hessian of {H.cfg}, but module {type(module).__name__} is {mine} "
                             "(up to the mask): its labels would not describe these numbers")
    offsets, off = {}, 0
    for n, s in zip(H.names, H.sizes):
        offsets[n] = off
        off += s
    named = dict(module.named_parameters())
    names, shapes, perm = [], {}, []
    for mname, p in named.items():
        parts = _spec(module).get(mname)
        have = [ours for ours, _ in parts or () if ours in offsets]
        if not have:
            continue
        if len(have) < len(parts):
            need = [ours for ours, _ in parts]
            raise ValueError(f"{mname} stores {', '.join(need)} together, but this Hessian has only {', '.join(have)}: "
                             f"compute it with wrt including all of {need}")
        idx = []
        for ours, transposed in parts:
            shape = H.shapes[ours]
            i = offsets[ours] + torch.arange(int(torch.Size(shape).numel())).reshape(shape)
            idx.append(i.T if transposed else i)
        idx = torch.cat(idx, 0)
        if tuple(idx.shape) != tuple(p.shape):
            raise ValueError(f"{mname}: shape {tuple(p.shape)} does not match the Hessian's {tuple(idx.shape)}")
        names.append(mname)
        shapes[mname] = tuple(p.shape)
        perm.append(idx.reshape(-1))
    if not names:
        raise ValueError(f"this Hessian ({list(H.names)}) covers none of the parameters of {type(module).__name__}")
    perm = torch.cat(perm).to(H.device)
    D = H.dense()
    buf = D.index_select(0, perm).index_select(1, perm)
    o = 0
    sl = {}
    for n in names:
        k = int(torch.Size(shapes[n]).numel())
        sl[n] = slice(o, o + k)
        o += k
    blocks = {(a, b): buf[sl[a], sl[b]] for a, b in pairs(names)}
    parts = None
    if H.has_parts:
        def parts(which):
            return to_module(getattr(H, which), module)
    return HessianBlocks(names, shapes, blocks, buf, buf, parts)


@relabel.register(nn.Module)
def _relabel_module(module: nn.Module, H: HessianBlocks) -> HessianBlocks:
    return to_module(H, module)
