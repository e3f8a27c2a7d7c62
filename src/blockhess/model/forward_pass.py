"""A whole model's forward pass: input checks, the embedding, the blocks, the top (final LayerNorm,
pooling, head), and the trace the curvature walk reads (docs/derivations.md §16).

Inputs are what the model's own ``forward`` takes first: features ``(B, L, d_in)``, images
``(B, C, H, W)``, token ids ``(B, L)``, or ``X_0`` ``(B, L, d_model)`` (``embedding="none"``); one
sequence without the batch axis is a batch of one.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import losses
from ..block import check_forward, forward_cache
from ..config import ModelConfig, block_prefix, check_window, model_param_shapes, sinusoidal_positions
from ..layers import layernorm
from ..layers.attention import allowed
from ..validation import check_finite, check_ln_variance, check_params, check_tensor, warn_tf32

__all__ = ["Batch", "Trace", "attention_mask", "block_params", "check_counted", "check_model_inputs", "embed_scale",
           "forward", "last_tokens", "live_rows", "model_input", "n_tokens", "norm_scale", "patches", "pooled", "trace"]


def patches(images: torch.Tensor, p: int) -> torch.Tensor:
    """``(B, C, H, W)`` images -> ``(B, (H/p)(W/p), C·p²)``: non-overlapping ``p × p`` patches in
    row-major order, each flattened channel-major ``(c, i, j)`` (a convolution with stride = kernel = ``p``)."""
    B, C, H, W = images.shape
    x = images.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // p) * (W // p), C * p * p)


def n_tokens(cfg: ModelConfig, inputs) -> int:
    """Tokens per sequence of the blocks (the ``cls`` token included) for batched ``inputs`` (a :class:`Batch`
    or its tensor)."""
    x = inputs.x if isinstance(inputs, Batch) else inputs
    if cfg.embedding == "patch":
        L = (cfg.image[1] // cfg.patch) * (cfg.image[2] // cfg.patch)
    else:
        L = x.shape[1]
    return L + int(cfg.cls_token)


def block_params(params: dict, cfg: ModelConfig, i: int) -> dict:
    """Block ``i``'s parameters under the block's own names (``W_Q``, not ``blocks.0.W_Q``)."""
    pre = block_prefix(i)
    return {k[len(pre):]: v for k, v in params.items() if k.startswith(pre)}


def _integer(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


@dataclasses.dataclass(frozen=True)
class Batch:
    """A model's batched inputs, as :func:`model_input` reads them from the forward's keyword arguments.

    ``x``: token ids ``(B, L)`` (int64), features ``(B, L, d_in)``, images ``(B, C, H, W)`` or ``X_0``;
    ``keys``: ``(B, L)`` bool, True where a key may be attended (``attention_mask != 0``; ``None``: every
    key); ``positions``: ``(B, L)`` int64 position ids (``None``: ``0..L-1``, what GPT-2 and BERT compute
    without them); ``types``: ``(B, L)`` int64 token types (``None``: type 0 everywhere)."""

    x: torch.Tensor
    keys: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    types: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, rows) -> "Batch":
        """The sequences ``rows`` (a slice) of every field."""
        return Batch(*(None if t is None else t[rows] for t in (self.x, self.keys, self.positions, self.types)))

    def clone(self) -> "Batch":
        return Batch(*(None if t is None else t.clone() for t in (self.x, self.keys, self.positions, self.types)))


#: the keyword arguments a model's forward takes, by embedding: the first is the input itself
_KEYS = {"token": ("input_ids", "attention_mask", "position_ids", "token_type_ids"),
         "patch": ("pixel_values",), "linear": ("src", "src_key_padding_mask"), "none": ("src", "src_key_padding_mask")}


def _as_mask(name: str, m, like: torch.Tensor, pad: bool = False) -> torch.Tensor:
    """``m`` as a ``(B, L)`` bool of the keys attended: ``attention_mask`` (1 attend, 0 padding; bool,
    integer or float of 0s and 1s, as Hugging Face's) or, ``pad``, PyTorch's ``src_key_padding_mask``
    (bool, True = padding). Raises ``ValueError`` naming ``name``."""
    want = (f"a bool tensor of shape {tuple(like.shape[:2])} (True = padding)" if pad else
            f"a tensor of shape {tuple(like.shape[:2])} of 1 (attend) and 0 (padding), bool, integer or float")
    if not isinstance(m, torch.Tensor) or m.dtype.is_complex or (pad and m.dtype != torch.bool):
        got = m.dtype if isinstance(m, torch.Tensor) else type(m).__name__
        raise ValueError(f"inputs[{name!r}] must be {want}, got {got}")
    if tuple(m.shape) != tuple(like.shape[:2]):
        raise ValueError(f"inputs[{name!r}] must be {want} (one entry per token; a 4-D mask is not taken), got shape "
                         f"{tuple(m.shape)}")
    if m.device != like.device:
        raise ValueError(f"inputs[{name!r}] is on {m.device} but the inputs are on {like.device}")
    if m.dtype != torch.bool:
        ok = (m == 0) | (m == 1)
        if m.numel() and not bool(ok.all()):
            bad = tuple((~ok).nonzero()[0].tolist())
            raise ValueError(f"inputs[{name!r}] must hold only 0 and 1, got {m[bad].item()} at {bad}")
        m = m != 0
    return ~m if pad else m


def _index(name: str, t, like: torch.Tensor, hi: int | None, what: str) -> torch.Tensor:
    """``t`` as ``(B, L)`` int64 in ``[0, hi)`` (``hi`` ``None``: ``>= 0``). Raises ``ValueError`` naming ``name``."""
    if not isinstance(t, torch.Tensor) or not _integer(t):
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"inputs[{name!r}] must be an integer tensor of {what}, got {got}")
    if tuple(t.shape) != tuple(like.shape[:2]):
        raise ValueError(f"inputs[{name!r}] must have the shape of the tokens {tuple(like.shape[:2])}, got {tuple(t.shape)}")
    if t.device != like.device:
        raise ValueError(f"inputs[{name!r}] is on {t.device} but the inputs are on {like.device}")
    t = t.long()
    bad = (t < 0) if hi is None else (t < 0) | (t >= hi)
    if t.numel() and bool(bad.any()):
        at = tuple(bad.nonzero()[0].tolist())
        rng = "[0, inf)" if hi is None else f"[0, {hi})"
        raise ValueError(f"inputs[{name!r}]: {int(t[at])} at {at} is out of range {rng} ({what})")
    return t


def model_input(cfg: ModelConfig, inputs) -> tuple[Batch, bool]:
    """``inputs`` as a :class:`Batch` with a batch axis, and whether one was added (one sequence given).

    ``inputs``: the tensor the model's forward takes first, or a dict of the forward's keyword arguments:
    token models ``{"input_ids", "attention_mask", "position_ids", "token_type_ids"}`` (Hugging Face's
    names and meanings; ``position_ids`` where the model has learned or rotary positions,
    ``token_type_ids`` where it has a token-type table), patch models ``{"pixel_values"}``, feature models
    (``nn.TransformerEncoder``) ``{"src", "src_key_padding_mask"}`` (PyTorch's: True = padding). Token ids
    of any integer dtype as int64 (indexing takes no other: ``uint8`` would be read as a mask).

    Raises ``ValueError`` for another key (``inputs_embeds``: the lookup is part of the model), the input
    missing, a mask of the wrong shape, dtype or values or one masking every key of a sequence, position
    ids or token types of the wrong shape or dtype or out of range (learned positions: ``[0, n_positions)``;
    rotary: ``>= 0``; types: ``[0, token_types)``); the input itself is checked by :func:`check_model_inputs`."""
    if not isinstance(inputs, dict) or not isinstance(cfg, ModelConfig):
        x = inputs
        if isinstance(cfg, ModelConfig) and cfg.embedding == "token" and isinstance(x, torch.Tensor) and _integer(x):
            x = x.long()
        single = {"token": 1, "patch": 3}.get(getattr(cfg, "embedding", None), 2)
        if isinstance(x, torch.Tensor) and x.ndim == single:
            return Batch(x[None]), True
        return Batch(x), False
    keys = _KEYS[cfg.embedding]
    unknown = [k for k in inputs if k not in keys]
    if unknown:
        hint = ("; inputs_embeds is not taken: pass input_ids (W_E's lookup is part of the model)"
                if "inputs_embeds" in unknown else "")
        if cfg.embedding == "patch" and {"attention_mask", "src_key_padding_mask", "bool_masked_pos"} & set(unknown):
            hint += "; a patch model takes no mask (every patch attends to every patch)"
        raise ValueError(f"inputs: unknown key{'s' if len(unknown) > 1 else ''} {unknown!r}; this model's forward "
                         f"takes {list(keys)}{hint}")
    if keys[0] not in inputs:
        raise ValueError(f"inputs must hold {keys[0]!r} (the model's input), got the keys {list(inputs)}")
    x = inputs[keys[0]]
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"inputs[{keys[0]!r}] must be a torch.Tensor, got {type(x).__name__}")
    if cfg.embedding == "token" and _integer(x):
        x = x.long()
    one = x.ndim == {"token": 1, "patch": 3}.get(cfg.embedding, 2)
    if one:
        x = x[None]
    rest = {k: v for k, v in inputs.items() if k != keys[0] and v is not None}
    rest = {k: (v[None] if one and isinstance(v, torch.Tensor) else v) for k, v in rest.items()}
    if rest and (x.ndim != (2 if cfg.embedding == "token" else 3) or x.shape[1] < 1):  # B = 0: a rank's empty shard
        want = "(B, L) or (L,)" if cfg.embedding == "token" else "(B, L, d) or (L, d)"
        raise ValueError(f"inputs[{keys[0]!r}] must have shape {want} with L >= 1, got {tuple(x.shape)}")
    if rest and cfg.cls_token:
        raise ValueError(f"inputs: {list(rest)} are not taken by a model with a cls token (its tokens are one more "
                         "than the inputs')")
    mask = pos = types = None
    for k in ("attention_mask", "src_key_padding_mask"):
        if k in rest:
            mask = _as_mask(k, rest[k], x, pad=k == "src_key_padding_mask")
            empty = ~mask.any(1)
            if bool(empty.any()):
                raise ValueError(f"inputs[{k!r}]: sequence {int(empty.nonzero()[0])} has every key masked "
                                 "(no token to attend to)")
            if bool(mask.all()):
                mask = None  # pads nothing
    if "position_ids" in rest:
        learned = cfg.positions == "learned"
        if not learned and not any(b.rope for b in cfg.blocks):
            raise ValueError("inputs['position_ids']: this model has no learned or rotary positions to take them "
                             f"(ModelConfig.positions={cfg.positions!r}, no block with rope)")
        pos = _index("position_ids", rest["position_ids"], x, cfg.n_positions if learned else None,
                     f"rows of W_P, {cfg.n_positions} of them" if learned else "rotary positions")
    if "token_type_ids" in rest:
        if not cfg.token_types:
            raise ValueError("inputs['token_type_ids']: this model has no token-type table (ModelConfig.token_types "
                             "is 0; GPT-2's token types, rows of its word embedding, are not taken)")
        types = _index("token_type_ids", rest["token_type_ids"], x, cfg.token_types, "rows of W_T")
    return Batch(x, mask, pos, types), one


def _like(params: dict) -> torch.Tensor:
    return next(iter(params.values())) if isinstance(params, dict) and params else None


def check_model_inputs(params: dict, inputs, cfg: ModelConfig) -> None:
    """Validate ``inputs`` (a :class:`Batch` from :func:`model_input`, or its tensor) against ``cfg``
    (shape; finite features; token ids integer, on the parameters' device, in ``[0, vocab)`` and none the ``pad_token``; the
    sequence no longer than the positions; masks, positions, types as :func:`model_input` read them) and
    ``params`` (names, shapes, one floating dtype and device, finite). Raises ``ValueError`` naming the
    argument and what was expected; ``NotImplementedError`` for a sequence longer than a block's
    ``sliding_window`` (:func:`~blockhess.config.check_window`)."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    batch = inputs if isinstance(inputs, Batch) else Batch(inputs)
    inputs = batch.x
    if not isinstance(inputs, torch.Tensor):
        raise ValueError(f"inputs must be a torch.Tensor or a dict of the forward's keyword arguments, got "
                         f"{type(inputs).__name__}")
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
        if cfg.pad_token is not None and inputs.numel() and bool((inputs == cfg.pad_token).all(1).any()):
            b = int((inputs == cfg.pad_token).all(1).nonzero()[0])
            raise ValueError(f"inputs: sequence {b} holds only the padding id {cfg.pad_token} (ModelConfig.pad_token): "
                             "pool='last' pools at a sequence's last token that is not padding, and it has none")
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
    if cfg.positions == "learned" and batch.positions is None and L > cfg.n_positions:
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
    keys: torch.Tensor | None  # (B, L) bool: the keys attended (Batch.keys); None: every key
    positions: torch.Tensor | None  # (B, L) int64: the position ids (learned rows of W_P, rotary angles); None: 0..L-1
    types: torch.Tensor | None  # (B, L) int64: the token types (rows of W_T); None: type 0
    X0: torch.Tensor  # (B, L, d) the embedding's output before LN_E (the blocks' input without LN_E)
    blocks: tuple  # block caches (blockhess.block.Cache), the input of block 0 being LN_E(X0) or X0
    XN: torch.Tensor  # (B, L, d) the last block's output
    u: torch.Tensor  # (B, L, d) LN_F(XN) (XN without LN_F)
    h: torch.Tensor  # (B, P, d) the pooled rows (P = 1 pooled, L otherwise)
    z: torch.Tensor  # (B, P, n_out) the output (h without a head)


def _embed(p: dict, x: torch.Tensor, cfg: ModelConfig, positions=None, types=None) -> torch.Tensor:
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
        X = X + (p["W_P"][:L] if positions is None else p["W_P"][positions])
    elif cfg.positions == "sinusoidal":
        X = X + sinusoidal_positions(L, d, X.dtype, X.device)
    if cfg.token_types:
        X = X + (p["W_T"][0] if types is None else p["W_T"][types])
    return X


def last_tokens(cfg: ModelConfig, x: torch.Tensor, L: int):
    """Where ``pool="last"`` pools among the blocks' ``L`` tokens: ``L − 1`` (an ``int``) without a
    ``pad_token``, or where no sequence of the token ids ``x`` ``(B, L')`` ends in it; else ``(B,)`` int64,
    each sequence's last position whose id is not ``pad_token`` (``GPT2ForSequenceClassification``'s rule,
    which reads the ids, not the attention mask), a ``cls`` token counted."""
    if cfg.pad_token is None or not bool((x[:, -1] == cfg.pad_token).any()):
        return L - 1
    return (torch.arange(x.shape[1], device=x.device) * (x != cfg.pad_token)).argmax(1) + int(cfg.cls_token)


def pooled(u: torch.Tensor, at) -> torch.Tensor:
    """``u`` ``(B, L, d)`` at the token ``at`` (an ``int``, or ``(B,)`` per sequence), ``(B, 1, d)``."""
    if isinstance(at, int):
        return u[:, at:at + 1]
    return u[torch.arange(u.shape[0], device=u.device), at][:, None]


def embed_scale(cfg: ModelConfig, like: torch.Tensor) -> torch.Tensor:
    """The token embedding's scale ``s`` as a 0-d tensor in ``like``'s dtype and device (rounded to it)."""
    return torch.tensor(cfg.embed_scale, dtype=like.dtype, device=like.device)


def norm_scale(p: dict, cfg: ModelConfig, s: str):
    """The model norm ``s``'s (``"E"`` or ``"F"``) scale as the forward uses it, ``rms_offset + gamma_s``
    (``None`` without a scale)."""
    g = p.get(f"gamma_{s}")
    return g + cfg.rms_offset if g is not None and cfg.rms_offset else g


def attention_mask(keys: torch.Tensor | None, L: int) -> torch.Tensor | None:
    """The key padding ``keys`` ``(B, L)`` (True = attended; ``None``: every key) as the blocks' boolean
    ``(B, L, L)`` of the pairs attended (each block adds its causal mask); ``None`` for ``None``."""
    return None if keys is None else keys[:, None, :].expand(keys.shape[0], L, L)


def live_rows(cfg: ModelConfig, keys: torch.Tensor | None, L: int) -> torch.Tensor | None:
    """``(B, L)`` bool: the tokens whose attention row has a key to attend to in every block (a row with
    none has a zero attention output, docs/derivations.md §22: left padding under a causal mask);
    ``None`` where every row does."""
    if keys is None:
        return None
    live = None
    for bc in cfg.blocks:
        rows = allowed(L, bc.causal, attention_mask(keys, L), keys.device).any(-1)
        live = rows if live is None else live & rows
    return None if bool(live.all()) else live


def _norm(p: dict, X: torch.Tensor, cfg: ModelConfig, s: str) -> torch.Tensor:
    y = layernorm.normalise(X, cfg.norm_eps, center=cfg.norm_type == "layer")[0]
    return layernorm.affine(y, norm_scale(p, cfg, s), p.get(f"beta_{s}"))


def _check_norm(name: str, X: torch.Tensor, cfg: ModelConfig, first: int) -> None:
    stats = layernorm.rms_stats(X) if cfg.norm_type == "rms" else None
    check_ln_variance(name, X, cfg.norm_eps, stats=stats, computed=True, first=first)


def trace(params: dict, inputs, cfg: ModelConfig, derivatives: bool = True, first: int = 0,
          wrt_input: bool = True) -> Trace:
    """The forward pass over batched, checked ``inputs`` (a :class:`Batch`, or its tensor); every LayerNorm input row is checked
    (:func:`~blockhess.validation.check_ln_variance`), the blocks' too (:func:`~blockhess.block.check_forward`),
    and the output must be finite. ``derivatives``: the blocks' caches keep their per-token Jacobians
    and, with ``wrt_input``, the input ``X`` as a variable (``False``: a plain forward). ``first``: the
    batch index of the first sequence (for the rows errors name). Raises ``ValueError``."""
    batch = inputs if isinstance(inputs, Batch) else Batch(inputs)
    x = patches(batch.x, cfg.patch) if cfg.embedding == "patch" else batch.x
    X0 = _embed(params, x, cfg, batch.positions, batch.types)
    mask = attention_mask(batch.keys, X0.shape[1])
    X = X0
    if cfg.embed_norm:
        _check_norm("the embedding norm input", X0, cfg, first)
        X = _norm(params, X0, cfg, "E")
    caches = []
    for i, bc in enumerate(cfg.blocks):
        c = forward_cache(block_params(params, cfg, i), X, bc, wrt_input=derivatives and wrt_input, plain=not derivatives,
                          mask=mask, positions=batch.positions if bc.rope else None)
        check_forward(c, first=first)
        caches.append(c)
        X = c.out
    u = X
    if cfg.final_norm:
        _check_norm("the final norm input (the last block's output)", X, cfg, first)
        u = _norm(params, X, cfg, "F")
    h = u.mean(1, keepdim=True) if cfg.pool == "mean" else u[:, :1] if cfg.pool == "first" else \
        pooled(u, last_tokens(cfg, x, u.shape[1])) if cfg.pool == "last" else u
    z = h
    if cfg.head is not None:
        z = h @ (params["W_E"].T if cfg.tied else params["W_H"])
        if "b_H" in params:
            z = z + params["b_H"]
    check_finite({"the model output": z}, f": the forward pass overflowed {z.dtype} on finite inputs; "
                 "rescale the inputs or the weights")
    return Trace(cfg=cfg, params=params, inputs=x, keys=batch.keys, positions=batch.positions, types=batch.types, X0=X0, blocks=tuple(caches), XN=X, u=u, h=h, z=z)


def output(cfg: ModelConfig, z: torch.Tensor, single: bool) -> torch.Tensor:
    """The model output as returned: ``(B, n_out)`` pooled, ``(B, L, n_out)`` per token (no batch axis for one sequence)."""
    out = z[:, 0] if cfg.pool != "none" else z
    return out[0] if single else out


def forward(params: dict, inputs, cfg: ModelConfig) -> torch.Tensor:
    """The model's output: ``(B, n_out)`` with a pooling, ``(B, L, n_out)`` without (``n_out`` the
    head's width, or ``d_model``); no batch axis for one sequence. dtype and device of the params.
    ``inputs``: the tensor the model takes first or its forward's keyword arguments (:func:`model_input`);
    a query with no key to attend to gets a zero attention output (docs/derivations.md §22).

    Raises ``ValueError`` as :func:`model_input`, :func:`check_model_inputs` and :func:`trace` (a LayerNorm input row it
    cannot take, an overflow).
    """
    inputs, single = model_input(cfg, inputs)
    check_model_inputs(params, inputs, cfg)
    return output(cfg, trace(params, inputs, cfg, derivatives=False).z, single)


def check_counted(cfg: ModelConfig, batch: Batch, loss, target) -> None:
    """Every token whose output the loss counts must have a key to attend to in every block
    (:func:`live_rows`): per token, all of them for MSE and a callable, those with a target other than
    ``-100`` for CE; pooled, the first token (``pool="first"``) or all (``"mean"``). ``target`` as
    :func:`sequence_loss` returns it. Raises ``ValueError`` naming the first such token."""
    live = live_rows(cfg, batch.keys, n_tokens(cfg, batch))
    if live is None:
        return
    counted = torch.ones_like(live)
    if cfg.pool == "first":
        counted[:, 1:] = False
    elif cfg.pool == "none" and loss == "ce" and isinstance(target, torch.Tensor) and target.shape == live.shape:
        counted = target != losses.IGNORE
    bad = counted & ~live
    if bool(bad.any()):
        b, t = bad.nonzero()[0].tolist()
        raise ValueError(f"inputs['attention_mask']: token {t} of sequence {b} has no key to attend to (padding "
                         "before it under a causal mask) but the loss counts its output; give it the target -100 "
                         "(loss='ce' ignores it) or attend to it")


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
