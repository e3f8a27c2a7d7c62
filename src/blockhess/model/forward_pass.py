"""A whole model's forward pass: input checks, the embedding, the blocks, the top (final LayerNorm,
pooling, head), and the trace the curvature walk reads (docs/derivations.md §16).

Inputs are what the model's own ``forward`` takes first: features ``(B, L, d_in)``, images
``(B, C, H, W)``, token ids ``(B, L)``, or ``X_0`` ``(B, L, d_model)`` (``embedding="none"``); one
sequence without the batch axis is a batch of one.
"""

from __future__ import annotations

import dataclasses

import torch

from ..block import check_forward, forward_cache
from ..config import ModelConfig, block_prefix, check_window, model_param_shapes, sinusoidal_positions
from ..layers import layernorm
from ..validation import check_finite, check_ln_variance, check_params, check_tensor, warn_tf32

__all__ = ["Trace", "block_params", "check_model_inputs", "forward", "model_input", "patches", "trace", "n_tokens",
           "embed_scale", "norm_scale"]


def patches(images: torch.Tensor, p: int) -> torch.Tensor:
    """``(B, C, H, W)`` images -> ``(B, (H/p)(W/p), C·p²)``: non-overlapping ``p × p`` patches in
    row-major order, each flattened channel-major ``(c, i, j)`` (a convolution with stride = kernel = ``p``)."""
    B, C, H, W = images.shape
    x = images.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // p) * (W // p), C * p * p)


def n_tokens(cfg: ModelConfig, inputs: torch.Tensor) -> int:
    """Tokens per sequence of the blocks (the ``cls`` token included) for batched ``inputs``."""
    if cfg.embedding == "patch":
        L = (cfg.image[1] // cfg.patch) * (cfg.image[2] // cfg.patch)
    else:
        L = inputs.shape[1]
    return L + int(cfg.cls_token)


def block_params(params: dict, cfg: ModelConfig, i: int) -> dict:
    """Block ``i``'s parameters under the block's own names (``W_Q``, not ``blocks.0.W_Q``)."""
    pre = block_prefix(i)
    return {k[len(pre):]: v for k, v in params.items() if k.startswith(pre)}


def _integer(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _keyword_inputs(inputs: dict) -> torch.Tensor:
    """A forward's keyword arguments ``{"input_ids": ids, "attention_mask": mask}`` as the ids: a mask
    of ones only (it changes nothing); a mask with a zero (a padded batch) and any other key are
    refused by name (``ValueError``)."""
    unknown = sorted(set(inputs) - {"input_ids", "attention_mask"})
    if unknown or "input_ids" not in inputs:
        raise ValueError(f"inputs as a dict takes the keys 'input_ids' and 'attention_mask' (all ones), got "
                         f"{sorted(inputs)}")
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or not isinstance(ids, torch.Tensor) or mask.shape != ids.shape:
            raise ValueError(f"inputs['attention_mask'] must be a tensor shaped like input_ids "
                             f"{tuple(getattr(ids, 'shape', ()))}, got {getattr(mask, 'shape', type(mask).__name__)}")
        if not bool((mask == 1).all()):
            raise ValueError("inputs['attention_mask'] has zeros: padded batches: not yet for this reader "
                             "(a mask of all ones is taken)")
    return ids


def model_input(cfg: ModelConfig, inputs) -> tuple[torch.Tensor, bool]:
    """``inputs`` with a batch axis, and whether one was added (one sequence given); token ids of
    any integer dtype as int64 (indexing takes no other: ``uint8`` would be read as a mask); a dict of
    the forward's keyword arguments as its ``input_ids`` (:func:`_keyword_inputs`: an ``attention_mask``
    of ones only)."""
    if isinstance(inputs, dict):
        inputs = _keyword_inputs(inputs)
    single = {"token": 1, "patch": 3}.get(cfg.embedding, 2)
    if cfg.embedding == "token" and isinstance(inputs, torch.Tensor) and _integer(inputs):
        inputs = inputs.long()
    if isinstance(inputs, torch.Tensor) and inputs.ndim == single:
        return inputs[None], True
    return inputs, False


def _like(params: dict) -> torch.Tensor:
    return next(iter(params.values())) if isinstance(params, dict) and params else None


def check_model_inputs(params: dict, inputs: torch.Tensor, cfg: ModelConfig) -> None:
    """Validate ``inputs`` against ``cfg`` (shape; finite features; token ids integer, on the
    parameters' device, in ``[0, vocab)`` and none the ``pad_token``; the sequence no longer than the positions) and
    ``params`` (names, shapes, one floating dtype and device, finite). Raises ``ValueError`` naming
    the argument and what was expected; ``NotImplementedError`` for a sequence longer than a block's
    ``sliding_window`` (:func:`~blockhess.config.check_window`)."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if not isinstance(inputs, torch.Tensor):
        raise ValueError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}")
    d = cfg.d_model
    if cfg.embedding == "token":
        if not _integer(inputs) or inputs.ndim != 2:
            raise ValueError(f"inputs must be integer token ids of shape (B, L) or (L,), got {inputs.dtype} of shape "
                             f"{tuple(inputs.shape)}")
        if inputs.numel() == 0:
            raise ValueError(f"inputs must hold at least one token of one sequence, got shape {tuple(inputs.shape)}")
        like = _like(params)
        if like is None:
            raise ValueError("params must be a non-empty dict of tensors")
        like_name = f"params[{next(iter(params))!r}]"
        check_tensor(like_name, like, finite=False)
        if inputs.device != like.device:
            raise ValueError(f"inputs is on {inputs.device} but {like_name} is on {like.device}; use one device throughout")
        lo, hi = int(inputs.min()), int(inputs.max())
        if lo < 0 or hi >= cfg.vocab:
            bad = ((inputs < 0) | (inputs >= cfg.vocab)).nonzero()[0].tolist()
            raise ValueError(f"inputs: token id {int(inputs[tuple(bad)])} at {tuple(bad)} is out of range [0, {cfg.vocab})")
        if cfg.pad_token is not None and bool((inputs == cfg.pad_token).any()):
            at = tuple((inputs == cfg.pad_token).nonzero()[0].tolist())
            raise ValueError(f"inputs: the padding id {cfg.pad_token} (ModelConfig.pad_token) at {at}: padded sequences "
                             "are not supported with pool='last' (the module pools at the last token that is not "
                             "padding); pass unpadded sequences of one length")
    else:
        want = {"patch": f"(B, {', '.join(map(str, cfg.image))})" if cfg.image else "",
                "linear": f"(B, L, {cfg.d_in})", "none": f"(B, L, {d})"}[cfg.embedding]
        check_tensor("inputs", inputs, finite=False)
        ok = (inputs.ndim == 4 and tuple(inputs.shape[1:]) == tuple(cfg.image)) if cfg.embedding == "patch" else (
            inputs.ndim == 3 and inputs.shape[-1] == (cfg.d_in if cfg.embedding == "linear" else d))
        if not ok or inputs.shape[0] < 1 or (cfg.embedding != "patch" and inputs.shape[1] < 1):
            raise ValueError(f"inputs must have shape {want} (or without the batch axis) with B, L >= 1, got "
                             f"{tuple(inputs.shape)}")
        like, like_name = inputs, "inputs"
    L = n_tokens(cfg, inputs)
    check_window(cfg, L)
    if cfg.positions == "learned" and L > cfg.n_positions:
        raise ValueError(f"inputs: {L} tokens{' (the cls token included)' if cfg.cls_token else ''} exceed the "
                         f"{cfg.n_positions} learned positions (W_P rows)")
    check_params(params, model_param_shapes(cfg), like, like_name)  # and the inputs finite
    warn_tf32(like.dtype, like.device)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trace:
    """A forward pass over a batch, kept for the derivatives (:func:`trace`)."""

    cfg: ModelConfig
    params: dict
    inputs: torch.Tensor  # features (B, L, d_in) (patches cut), token ids (B, L), or X_0
    X0: torch.Tensor  # (B, L, d) the embedding's output before LN_E (the blocks' input without LN_E)
    blocks: tuple  # block caches (blockhess.block.Cache), the input of block 0 being LN_E(X0) or X0
    XN: torch.Tensor  # (B, L, d) the last block's output
    u: torch.Tensor  # (B, L, d) LN_F(XN) (XN without LN_F)
    h: torch.Tensor  # (B, P, d) the pooled rows (P = 1 pooled, L otherwise)
    z: torch.Tensor  # (B, P, n_out) the output (h without a head)


def _embed(p: dict, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    d = cfg.d_model
    if cfg.embedding == "none":
        X = x
    elif cfg.embedding == "token":
        X = p["W_E"][x]
        if cfg.embed_scale != 1.0:  # the scale rounded to the weights' dtype first, as HF's buffer .to(weight.dtype)
            X = X * embed_scale(cfg, X)
    else:
        X = x @ p["W_E"]
        if "b_E" in p:
            X = X + p["b_E"]
    if cfg.cls_token:
        X = torch.cat([p["cls"].expand(X.shape[0], 1, d), X], 1)
    L = X.shape[1]
    if cfg.positions == "learned":
        X = X + p["W_P"][:L]
    elif cfg.positions == "sinusoidal":
        X = X + sinusoidal_positions(L, d, X.dtype, X.device)
    if cfg.token_types:
        X = X + p["W_T"][0]
    return X


def embed_scale(cfg: ModelConfig, like: torch.Tensor) -> torch.Tensor:
    """The token embedding's scale ``s`` as a 0-d tensor in ``like``'s dtype and device (rounded to it)."""
    return torch.tensor(cfg.embed_scale, dtype=like.dtype, device=like.device)


def norm_scale(p: dict, cfg: ModelConfig, s: str):
    """The model norm ``s``'s (``"E"`` or ``"F"``) scale as the forward uses it, ``rms_offset + gamma_s``
    (``None`` without a scale)."""
    g = p.get(f"gamma_{s}")
    return g + cfg.rms_offset if g is not None and cfg.rms_offset else g


def _norm(p: dict, X: torch.Tensor, cfg: ModelConfig, s: str) -> torch.Tensor:
    y = layernorm.normalise(X, cfg.norm_eps, center=cfg.norm_type == "layer")[0]
    return layernorm.affine(y, norm_scale(p, cfg, s), p.get(f"beta_{s}"))


def _check_norm(name: str, X: torch.Tensor, cfg: ModelConfig, first: int) -> None:
    stats = layernorm.rms_stats(X) if cfg.norm_type == "rms" else None
    check_ln_variance(name, X, cfg.norm_eps, stats=stats, computed=True, first=first)


def trace(params: dict, inputs: torch.Tensor, cfg: ModelConfig, derivatives: bool = True, first: int = 0,
          wrt_input: bool = True) -> Trace:
    """The forward pass over batched, checked ``inputs``; every LayerNorm input row is checked
    (:func:`~blockhess.validation.check_ln_variance`), the blocks' too (:func:`~blockhess.block.check_forward`),
    and the output must be finite. ``derivatives``: the blocks' caches keep their per-token Jacobians
    and, with ``wrt_input``, the input ``X`` as a variable (``False``: a plain forward). ``first``: the
    batch index of the first sequence (for the rows errors name). Raises ``ValueError``."""
    x = patches(inputs, cfg.patch) if cfg.embedding == "patch" else inputs
    X0 = _embed(params, x, cfg)
    X = X0
    if cfg.embed_norm:
        _check_norm("the embedding norm input", X0, cfg, first)
        X = _norm(params, X0, cfg, "E")
    caches = []
    for i, bc in enumerate(cfg.blocks):
        c = forward_cache(block_params(params, cfg, i), X, bc, wrt_input=derivatives and wrt_input, plain=not derivatives)
        check_forward(c, first=first)
        caches.append(c)
        X = c.out
    u = X
    if cfg.final_norm:
        _check_norm("the final norm input (the last block's output)", X, cfg, first)
        u = _norm(params, X, cfg, "F")
    h = u.mean(1, keepdim=True) if cfg.pool == "mean" else u[:, :1] if cfg.pool == "first" else \
        u[:, -1:] if cfg.pool == "last" else u
    z = h
    if cfg.head is not None:
        z = h @ (params["W_E"].T if cfg.tied else params["W_H"])
        if "b_H" in params:
            z = z + params["b_H"]
    check_finite({"the model output": z}, f": the forward pass overflowed {z.dtype} on finite inputs; "
                 "rescale the inputs or the weights")
    return Trace(cfg=cfg, params=params, inputs=x, X0=X0, blocks=tuple(caches), XN=X, u=u, h=h, z=z)


def output(cfg: ModelConfig, z: torch.Tensor, single: bool) -> torch.Tensor:
    """The model output as returned: ``(B, n_out)`` pooled, ``(B, L, n_out)`` per token (no batch axis for one sequence)."""
    out = z[:, 0] if cfg.pool != "none" else z
    return out[0] if single else out


def forward(params: dict, inputs: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The model's output: ``(B, n_out)`` with a pooling, ``(B, L, n_out)`` without (``n_out`` the
    head's width, or ``d_model``); no batch axis for one sequence. dtype and device of the params.

    Raises ``ValueError`` as :func:`check_model_inputs` and :func:`trace` (a LayerNorm input row it
    cannot take, an overflow).
    """
    inputs, single = model_input(cfg, inputs)
    check_model_inputs(params, inputs, cfg)
    return output(cfg, trace(params, inputs, cfg, derivatives=False).z, single)


def sequence_loss(cfg: ModelConfig, loss, target, z: torch.Tensor):
    """The model's loss as a loss of ``z`` ``(B, P, n_out)`` for :mod:`blockhess.losses`: ``(loss, target)``
    with a pooled model's target given its token axis (``(B,)`` classes -> ``(B, 1)``; MSE ``(B, n_out)`` ->
    ``(B, 1, n_out)``) and a callable taking one sequence's output as the model returns it (``(n_out,)``
    pooled, ``(L, n_out)`` per token).

    Raises ``ValueError`` in the model's terms for a built-in loss's target that is not shaped for the
    model's output (CE: ``(B,)`` pooled, ``(B, L)`` per token; MSE: the output's shape) or an MSE target
    missing; the rest (an unknown loss, a target's dtype, device, classes, finiteness, a callable's
    target) :func:`blockhess.losses.check` checks after."""
    B, P, n = z.shape
    pooled = cfg.pool != "none"
    if callable(loss):
        if not pooled:
            return loss, target

        def first_row(zb, t, _loss=loss):
            return _loss(zb[0], t)
        return first_row, target
    out = (B, n) if pooled else (B, P, n)
    if loss == "mse" and target is None:
        raise ValueError(f"target is required for loss='mse' (a tensor shaped like the model output {out})")
    if loss == "ce" and target is not None and not isinstance(target, torch.Tensor):  # a list or array of classes
        try:
            target = torch.as_tensor(target, device=z.device)
        except (TypeError, ValueError, RuntimeError):
            return loss, target  # not classes: losses.check says so
    if loss in ("mse", "ce") and isinstance(target, torch.Tensor):
        want = out if loss == "mse" else out[:-1]
        if loss == "ce" and pooled and B == 1 and target.ndim == 0:  # one sequence's class as a number
            target = target[None]
        if tuple(target.shape) != want:
            if loss == "ce":
                raise ValueError(f"target must have shape {want} for loss='ce' (one class per "
                                 f"{'sequence: the model is pooled' if pooled else 'token'}), got {tuple(target.shape)}")
            raise ValueError(f"target must have the shape of the model output {want} for loss='mse', got {tuple(target.shape)}")
        if pooled:
            target = target[:, None]
    return loss, target
