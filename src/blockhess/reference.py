"""Ground truth by automatic differentiation (``torch.func``) on a plain forward.

The forward here is written independently of the closed-form kernels (``torch.softmax``,
``torch.nn.functional.layer_norm``, ``torch.nn.functional.gelu``, heads by ``reshape``), so
agreement is a real check. Same signatures as :func:`blockhess.forward`,
:func:`blockhess.jacobian`, :func:`blockhess.input_jacobian` and :func:`blockhess.hessian`;
used by the tests, ``blockhess validate`` and ``blockhess bench``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as Fn

from . import losses
from .block import check_inputs, select_wrt
from .result import BlockSum, HessianBlocks, pairs
from .config import BlockConfig, ModelConfig, block_prefix, model_param_shapes, param_shapes, sinusoidal_positions
from .validation import check_bool, check_fits

__all__ = ["forward", "jacobian", "input_jacobian", "hessian"]


def _rotate(t: torch.Tensor, theta: float, positions=None) -> torch.Tensor:
    """Rotary embedding of ``t`` ``(..., L, d_k)`` at positions ``0..L-1`` (or ``positions`` ``(B, L)``,
    ``t`` then ``(B, H, L, d_k)``), the rotate-half way: ``t cos + cat(-t2, t1) sin``, angles
    ``l · theta^(-2i/d_k)`` repeated over both halves."""
    L, dk = t.shape[-2:]
    inv = theta ** (-torch.arange(0, dk, 2, dtype=torch.float64) / dk)
    pos = torch.arange(L, dtype=torch.float64) if positions is None else positions.double().cpu()[:, None, :]
    ang = pos[..., None] * inv
    ang = torch.cat([ang, ang], -1).to(dtype=t.dtype, device=t.device)
    t1, t2 = t[..., : dk // 2], t[..., dk // 2 :]
    return t * torch.cos(ang) + torch.cat([-t2, t1], -1) * torch.sin(ang)


def _attention(p: dict, X: torch.Tensor, cfg: BlockConfig, keys=None, positions=None) -> torch.Tensor:
    """Multi-head self-attention with optional biases, causal mask, output projection, grouped
    key/value heads (each repeated for its query heads), rotary embeddings and a sliding window; ``keys``
    ``(B, L)`` bool, the keys attended (a query row with none: zero weights), ``positions`` ``(B, L)`` the
    rotary ones."""
    H, dk, G = cfg.n_heads, cfg.head_dim, cfg.kv_heads
    L = X.shape[-2]
    Q = X @ p["W_Q"] + (p["b_Q"] if "b_Q" in p else 0)
    K = X @ p["W_K"] + (p["b_K"] if "b_K" in p else 0)
    V = X @ p["W_V"] + (p["b_V"] if "b_V" in p else 0)
    Qh = Q.reshape(*Q.shape[:-1], H, dk).transpose(-2, -3)  # (..., H, L, dk)
    Kh = K.reshape(*K.shape[:-1], G, dk).transpose(-2, -3)  # (..., G, L, dk)
    Vh = V.reshape(*V.shape[:-1], G, -1).transpose(-2, -3)
    if cfg.rope:
        Qh, Kh = _rotate(Qh, cfg.rope_theta, positions), _rotate(Kh, cfg.rope_theta, positions)
    Kh, Vh = Kh.repeat_interleave(H // G, -3), Vh.repeat_interleave(H // G, -3)
    T = Qh @ Kh.transpose(-1, -2) / math.sqrt(dk)
    masked = torch.zeros(L, L, dtype=torch.bool, device=X.device)
    if cfg.causal:
        masked = torch.ones(L, L, dtype=torch.bool, device=X.device).triu(1)
        if cfg.sliding_window is not None:  # token l attends to m with l - m < window (HF's sliding window)
            masked = masked | torch.ones(L, L, dtype=torch.bool, device=X.device).tril(-cfg.sliding_window)
    if keys is not None:
        masked = masked | ~keys[:, None, None, :]  # (B, 1, L, L): over the heads
    none = masked.all(-1, keepdim=True)  # a query with no key: weights 0 (its scores unmasked, then dropped)
    W = torch.softmax(T.masked_fill(masked & ~none, float("-inf")), dim=-1) * (~none).to(T.dtype)
    O = (W @ Vh).transpose(-2, -3)
    O = O.reshape(*O.shape[:-2], -1)
    if cfg.out_proj:
        O = O @ p["W_O"] + (p["b_O"] if "b_O" in p else 0)
    return O


def _ln(p: dict, t: torch.Tensor, cfg: BlockConfig, i: int) -> torch.Tensor:
    # gamma and beta applied outside F.layer_norm: in torch 2.13 the double backward of
    # layer_norm's *weight* gradient w.r.t. its input is wrong (d/dx of dℓ/dγ; see
    # docs/derivations.md §9), which would corrupt half of the reference's (γ, ·) blocks.
    if cfg.norm_type == "rms":
        y = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.ln_eps)
    else:
        y = Fn.layer_norm(t, (cfg.d_model,), eps=cfg.ln_eps)
    if f"gamma_{i}" in p:
        y = y * (p[f"gamma_{i}"] + cfg.rms_offset)
    return y + p[f"beta_{i}"] if f"beta_{i}" in p else y


def _act(pre: torch.Tensor, cfg: BlockConfig) -> torch.Tensor:
    if cfg.activation == "relu":
        return torch.relu(pre)
    if cfg.activation == "silu":
        return Fn.silu(pre)
    return Fn.gelu(pre, approximate="tanh" if cfg.activation == "gelu_tanh" else "none")


def _ffn(p: dict, Y: torch.Tensor, cfg: BlockConfig) -> torch.Tensor:
    pre = Y @ p["W_1"] + (p["b_1"] if "b_1" in p else 0)
    if cfg.gated:
        h = _act(Y @ p["W_G"] + (p["b_G"] if "b_G" in p else 0), cfg) * pre
    else:
        h = _act(pre, cfg)
    return h @ p["W_2"] + (p["b_2"] if "b_2" in p else 0)


def forward(params: dict, X: torch.Tensor, cfg: BlockConfig, keys=None, positions=None) -> torch.Tensor:
    """Plain forward of the block (paper §1.3, with the options of docs/derivations.md §10–§13) or bare attention layer; no checks.

    ``X``: ``(L, d_model)`` or ``(B, L, d_model)``; returns the same shape. A :class:`ModelConfig`:
    the model's output for batched inputs (a tensor or the forward's keyword arguments), ``(B, P, n_out)``
    (``P = 1`` pooled; :func:`_model_forward`). ``keys``, ``positions``: the attention's keys attended and rotary positions (:func:`_attention`).
    """
    p = params
    if isinstance(cfg, ModelConfig):
        if isinstance(X, dict):  # the forward's keyword arguments, read as the closed form reads them
            from .model.forward_pass import model_input
            X = model_input(cfg, X)[0]
        return _model_forward(p, X, cfg)
    kw = {"keys": keys, "positions": positions}
    if cfg.kind == "attention":
        return _attention(p, X, cfg, **kw)
    if cfg.norm == "post":
        Y = _ln(p, X + _attention(p, X, cfg, **kw), cfg, 1)
        return _ln(p, Y + _ffn(p, Y, cfg), cfg, 2)
    Y = X + _attention(p, _ln(p, X, cfg, 1), cfg, **kw)
    return Y + _ffn(p, _ln(p, Y, cfg, 2), cfg)


def _model_norm(p: dict, t: torch.Tensor, cfg: ModelConfig, s: str) -> torch.Tensor:
    if cfg.norm_type == "rms":
        y = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    else:
        y = Fn.layer_norm(t, (cfg.d_model,), eps=cfg.norm_eps)  # gamma, beta outside: as _ln
    y = y * (p[f"gamma_{s}"] + cfg.rms_offset) if f"gamma_{s}" in p else y
    return y + p[f"beta_{s}"] if f"beta_{s}" in p else y


def _model_forward(p: dict, inputs, cfg: ModelConfig) -> torch.Tensor:
    """Plain forward of a whole model (:class:`~blockhess.config.ModelConfig`) on batched inputs (a
    :class:`~blockhess.model.forward_pass.Batch` or its tensor): ``(B, P, n_out)``. Patches by
    ``Fn.unfold``, tokens, positions and token types by ``Fn.embedding``; no checks."""
    d = cfg.d_model
    x = getattr(inputs, "x", inputs)
    keys, pos, types = (getattr(inputs, k, None) for k in ("keys", "positions", "types"))
    if cfg.embedding == "none":
        X = x
    elif cfg.embedding == "token":
        X = Fn.embedding(x, p["W_E"])
        if cfg.embed_scale != 1.0:
            X = X * torch.tensor(cfg.embed_scale, dtype=X.dtype, device=X.device)
    else:
        if cfg.embedding == "patch":
            x = Fn.unfold(x, kernel_size=cfg.patch, stride=cfg.patch).transpose(1, 2)  # (B, L, C·p·p), (c, i, j)
        X = x @ p["W_E"] + (p["b_E"] if "b_E" in p else 0)
    if cfg.cls_token:
        X = torch.cat([p["cls"].expand(X.shape[0], 1, d), X], 1)
    L = X.shape[1]
    if cfg.positions == "learned":
        X = X + (p["W_P"][:L] if pos is None else Fn.embedding(pos, p["W_P"]))
    elif cfg.positions == "sinusoidal":
        X = X + sinusoidal_positions(L, d, X.dtype, X.device)
    if cfg.token_types:
        X = X + (p["W_T"][0] if types is None else Fn.embedding(types, p["W_T"]))
    if cfg.embed_norm:
        X = _model_norm(p, X, cfg, "E")
    for i, bc in enumerate(cfg.blocks):
        pre = block_prefix(i)
        X = forward({k[len(pre):]: v for k, v in p.items() if k.startswith(pre)}, X, bc, keys, pos)
    if cfg.final_norm:
        X = _model_norm(p, X, cfg, "F")
    if cfg.pool == "last" and cfg.pad_token is not None:  # each sequence's last token that is not padding
        last = [max(t for t in range(x.shape[1]) if int(x[b, t]) != cfg.pad_token) + int(cfg.cls_token)
                for b in range(x.shape[0])]
        h = torch.stack([X[b, t] for b, t in enumerate(last)])[:, None]
    else:
        h = {"mean": lambda: X.mean(1, keepdim=True), "first": lambda: X[:, :1], "last": lambda: X[:, -1:],
             "none": lambda: X}[cfg.pool]()
    if cfg.head is None:
        return h
    return h @ (p["W_E"].T if cfg.tied else p["W_H"]) + (p["b_H"] if "b_H" in p else 0)


def _model_hessian(params: dict, inputs, cfg: ModelConfig, loss, target, wrt) -> HessianBlocks:
    """:func:`hessian` for a model: ``torch.func.hessian`` of the batch loss through
    :func:`_model_forward` w.r.t. the ``wrt`` parameters, the outer term ``J^T (∇²_z ℓ) J`` from
    ``jacrev`` and the functional term as the difference; the whole batch at once (small models)."""
    from .model.forward_pass import check_model_inputs, model_input, sequence_loss  # the checks of the closed form

    inputs, single = model_input(cfg, inputs)
    if single and isinstance(target, torch.Tensor):  # one sequence's target gets the batch axis
        target = target[None]
    check_model_inputs(params, inputs, cfg)
    shapes = model_param_shapes(cfg)
    names = select_wrt(tuple(shapes), wrt)
    n = sum(math.prod(shapes[k]) for k in names)
    like = params[names[0]]
    z0 = _model_forward(params, inputs, cfg)
    loss3, target3 = sequence_loss(cfg, loss, target, z0)
    target3 = losses.check(loss3, target3, z0, ignore=True)
    B, P, C = z0.shape
    check_fits((4 * n * n + 3 * B * P * C * n + B * (P * C) ** 2) * like.element_size(),
               f"torch.func.hessian of the model's loss over {n} variables with the Jacobian and the parts", like.device)
    fixed = {k: v for k, v in params.items() if k not in names}
    sel = {k: params[k] for k in names}

    def out(s):
        return _model_forward({**fixed, **s}, inputs, cfg)

    Hf = torch.func.hessian(lambda s: losses.value(loss3, target3, out(s)))(sel)
    in_dims = (0, 0 if isinstance(target3, torch.Tensor) else None)

    if isinstance(loss3, str) and loss3 == "ce":  # the mean over the batch's counted tokens (-100 ignored)
        N = int((target3 != -100).sum())

        def per_sequence(zb, t):
            return Fn.cross_entropy(zb, t, ignore_index=-100, reduction="sum") / N
    else:
        def per_sequence(zb, t):
            return losses.value(loss3, t[None] if isinstance(t, torch.Tensor) else t, zb[None]) / B

    H_z = torch.func.vmap(torch.func.hessian(per_sequence), in_dims=in_dims)(z0, target3).reshape(B, P * C, P * C)
    J = torch.func.jacrev(out)(sel)
    J = {k: J[k].reshape(B, P * C, -1) for k in names}
    parts = {w: BlockSum(names, shapes) for w in ("full", "outer", "functional")}
    for a, b in pairs(names):
        full = Hf[a][b].reshape(params[a].numel(), params[b].numel())
        outer = torch.einsum("bia,bij,bjc->ac", J[a], H_z, J[b])
        parts["full"].add(a, b, full)
        parts["outer"].add(a, b, outer)
        parts["functional"].add(a, b, full - outer)
    return parts["full"].result(like, cfg, parts=lambda which: parts[which].result(like, cfg))


def _plain_loss(loss, target, Z: torch.Tensor) -> torch.Tensor:
    """Batch loss (mean over sequences) by plain torch ops; ``Z`` is ``(B, L, d)``."""
    return losses.value(loss, target, Z)


CHUNK_BYTES = 64 << 20  # the work space of torch.func on one chunk of the batch may always be this much
LOSS_COPIES = 3  # torch.func.hessian: per weight, copies of what autograd saves for a callable loss


def _tangent_entries(cfg: BlockConfig, L: int) -> int:
    """Entries ``torch.func`` holds per token of the chunk and per tangent of its forward mode
    (a weight of ``torch.func.hessian``), ``150 + 2d + 4 d_ff + 6 H·L``, a fit to peak memory
    (docs/derivations.md §1, *The reference*); the constant is the per-tangent share of the block's
    and the loss's fixed work, ``H·L`` the attention's scores, weights and their derivatives."""
    return 150 + 2 * cfg.d_model + 4 * (cfg.d_ff if cfg.kind == "block" else 0) + 6 * cfg.n_heads * L


def _cotangent_entries(cfg: BlockConfig, L: int) -> int:
    """The same per cotangent of ``jacrev`` (an output entry): ``9 d + d_ff + 2 H·L``, a fit likewise."""
    return 9 * cfg.d_model + (cfg.d_ff if cfg.kind == "block" else 0) + 2 * cfg.n_heads * L


def _chunk(B: int, extra) -> int:
    """The most sequences per chunk, halving from ``B``, whose work space ``extra(rows)`` is
    within ``CHUNK_BYTES`` (at least one)."""
    size = B
    while size > 1 and extra(size) > CHUNK_BYTES:
        size = (size + 1) // 2
    return size


def jacobian(params: dict, X: torch.Tensor, cfg: BlockConfig,
             wrt: str | Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """``torch.func.jacrev`` of :func:`forward`; same shapes as :func:`blockhess.jacobian`.

    Each sequence's output depends on its own input only, so the batch is taken in chunks of as
    many sequences as keep ``jacrev``'s work space (:func:`_cotangent_entries` per token and
    output entry of the chunk) within ``CHUNK_BYTES``. Raises ``InsufficientMemoryError``
    before any derivative if the Jacobians with one chunk's work space would not fit, besides
    the ``ValueError`` of :func:`blockhess.jacobian`."""
    check_inputs(params, X, cfg)
    names = select_wrt(tuple(param_shapes(cfg)), wrt)
    fixed = {k: v for k, v in params.items() if k not in names}
    Xb = X[None] if X.ndim == 2 else X
    B, L, d = Xb.shape
    e, n = X.element_size(), sum(params[k].numel() for k in names)

    def work(rows):
        return rows * L * d * rows * L * _cotangent_entries(cfg, L) * e

    size = _chunk(B, work)
    check_fits(Xb.numel() * n * e + work(size), f"the dense Jacobians ({Xb.numel()} x {n}) by torch.func.jacrev, "
               f"{size} of the {B} sequences at a time", X.device)
    out = {k: Xb.new_empty(B, L * d, params[k].numel()) for k in names}
    for s in range(0, B, size):
        J = torch.func.jacrev(lambda sel: forward({**fixed, **sel}, Xb[s : s + size], cfg))({k: params[k] for k in names})
        for k in names:
            out[k][s : s + size] = J[k].reshape(-1, L * d, params[k].numel())
    return {k: (v[0] if X.ndim == 2 else v) for k, v in out.items()}


def input_jacobian(params: dict, X: torch.Tensor, cfg: BlockConfig) -> torch.Tensor:
    """``torch.func.jacrev`` of :func:`forward` w.r.t. ``X``, per sequence: ``(L·d, L·d)`` or ``(B, L·d, L·d)``;
    vmapped over chunks of sequences as :func:`jacobian`, with the same errors."""
    check_inputs(params, X, cfg)
    Xb = X[None] if X.ndim == 2 else X
    B, L, d = Xb.shape
    e = X.element_size()

    def work(rows):
        return rows * L * d * L * _cotangent_entries(cfg, L) * e

    size = _chunk(B, work)
    check_fits(B * (L * d) ** 2 * e + work(size), f"the {B} dense input Jacobians ({L * d}x{L * d}) by torch.func.jacrev, "
               f"{size} of the sequences at a time", X.device)
    one = lambda x: torch.func.jacrev(lambda y: forward(params, y, cfg))(x).reshape(L * d, L * d)  # noqa: E731
    out = Xb.new_empty(B, L * d, L * d)
    for s in range(0, B, size):
        out[s : s + size] = torch.func.vmap(one)(Xb[s : s + size].clone())
    return out[0] if X.ndim == 2 else out


def _work_bytes(cfg: BlockConfig, n: int, rows: int, chunks: int, L: int, e: int, loss_bytes: int, hz_bytes: int) -> int:
    """Bytes :func:`hessian` holds at once for a chunk of ``rows`` sequences (of ``chunks``):
    the larger of ``torch.func.hessian``'s working set (its result and one and a half more ``n²``,
    :func:`_tangent_entries` per token and weight, ``LOSS_COPIES · loss_bytes`` per sequence and
    weight) and what follows it (that result with the outer and functional parts, ``3n²``; the
    Jacobian of the chunk's ``rows·L·d`` outputs, twice, and ``jacrev``'s
    :func:`_cotangent_entries` per token and output entry; the loss Hessians, ``hz_bytes`` per
    sequence), plus, from the second chunk on, the ``3n²`` of the parts summed so far.
    ``loss_bytes``: what autograd saves for a callable loss on one sequence (0 for MSE and CE,
    counted in the fit); ``n`` variables; ``e`` bytes per entry."""
    T, d = rows * L, cfg.d_model
    hf = (5 * n * n // 2 + n * T * _tangent_entries(cfg, L)) * e + LOSS_COPIES * n * rows * loss_bytes
    after = (3 * n * n + T * d * (2 * n + T * _cotangent_entries(cfg, L))) * e + rows * hz_bytes
    return (3 * n * n * e if chunks > 1 else 0) + max(hf, after)


def hessian(params: dict, X: torch.Tensor, cfg: BlockConfig | ModelConfig, loss: str | Callable = "mse",
            target: Any = None, wrt: str | Sequence[str] | None = None, wrt_input: bool = False) -> HessianBlocks:
    """``torch.func.hessian`` of the loss through :func:`forward`, with the outer term
    ``J^T (∇²_Z ℓ) J`` from ``jacrev`` and the functional term as the difference.

    Same arguments (but no ``out``), shapes and argument errors as :func:`blockhess.hessian`
    (``wrt_input=True`` adds the block input ``X`` as a variable named ``"X"``, first). The
    forward pass itself is not checked: where :func:`blockhess.hessian` refuses a zero-variance
    or overflowing LayerNorm row, this oracle returns what autograd gives (NaN or Inf).

    The batch loss is the mean of the per-sequence losses, so its Hessian is the sum of the
    Hessians of (a chunk's mean loss) · rows / B over chunks of the batch: the batch is taken
    in chunks of as many sequences as keep ``torch.func``'s work space within ``CHUNK_BYTES``
    (:func:`_work_bytes`; its ``jacrev`` grows with the square of a chunk), one chunk with
    ``wrt_input`` (the ``X`` blocks span the batch).

    Raises ``InsufficientMemoryError`` before any derivative when the chunk's estimate would
    not fit in the memory available (with the bytes needed and available), besides the
    ``ValueError`` of :func:`blockhess.hessian`.
    """
    if isinstance(cfg, ModelConfig):
        if wrt_input is not False:
            raise ValueError("wrt_input applies to a block; a model's input is not a variable")
        return _model_hessian(params, X, cfg, loss, target, wrt)
    check_inputs(params, X, cfg)
    check_bool("wrt_input", wrt_input)
    shapes = dict(param_shapes(cfg))
    if wrt_input:
        shapes = {"X": tuple(X.shape), **shapes}
    names = select_wrt(tuple(shapes), wrt)
    Xb = X[None] if X.ndim == 2 else X
    if X.ndim == 2 and isinstance(target, torch.Tensor):
        target = target[None]
    target = losses.check(loss, target, Xb, single=X.ndim == 2)
    B, L, d = Xb.shape
    e = X.element_size()
    n = sum(math.prod(shapes[k]) for k in names)
    fixed = {k: v for k, v in params.items() if k not in names}

    def take(t, rows):  # a tensor target has one entry per sequence; any other target is passed whole
        return t[rows] if isinstance(t, torch.Tensor) else t

    first = take(target, slice(0, 1))
    Z0 = forward(params, Xb[:1], cfg) if callable(loss) else None  # the first sequence's output, for the loss's count
    loss_bytes = losses.saved_loss_bytes(loss, first, Z0) if callable(loss) else 0
    hz = (losses.hessian_work_bytes(loss, first, Z0) if callable(loss) else 3 * (L * d) ** 2 * e)
    hz += (L * d) ** 2 * e  # the Hessian itself

    def need(rows):
        return _work_bytes(cfg, n, rows, -(-B // rows), L, e, loss_bytes, hz)

    size = B if "X" in names else _chunk(B, lambda rows: need(rows) - _work_bytes(cfg, n, 0, 1, L, e, loss_bytes, hz))
    check_fits(need(size), f"torch.func.hessian of the loss over {n} variables, {size} of the {B} sequences at a time, "
               "with the Jacobian and the outer and functional parts", X.device)
    parts = {w: BlockSum(names, shapes) for w in ("full", "outer", "functional")}
    for start in range(0, B, size):
        rows = slice(start, min(start + size, B))
        _add_chunk(parts, params, fixed, Xb[rows], X, take(target, rows), cfg, loss, names, rows, B)
    return parts["full"].result(X, cfg, parts=lambda which: parts[which].result(X, cfg))


def _add_chunk(parts: dict, params: dict, fixed: dict, Xc: torch.Tensor, X: torch.Tensor, target, cfg: BlockConfig,
               loss, names: tuple[str, ...], rows: slice, B: int) -> None:
    """Add the Hessian of the chunk ``Xc`` (sequences ``rows`` of ``B``; ``X`` the input as
    given, whose own entries are the variable ``"X"``) to ``parts``: full, outer, functional."""
    m = Xc.shape[0]
    allv = {**params, "X": X if "X" in names else Xc}
    sel = {k: allv[k] for k in names}

    def out(s):
        q = {**fixed, **s}
        x = q.pop("X", Xc)
        return forward(q, x[None] if x.ndim == 2 else x, cfg)

    def scalar(s):  # this chunk's share of the batch mean
        return _plain_loss(loss, target, out(s)) * (m / B)

    Hf = torch.func.hessian(scalar)(sel)
    Z = out(sel)
    _, L, d = Z.shape
    # the batch loss is the mean of per-sequence losses: its Z-Hessian is block-diagonal over sequences
    in_dims = (0, 0 if isinstance(target, torch.Tensor) else None)

    def per_sequence(z, t):  # a tensor target gets its batch axis back; any other target is passed whole
        return _plain_loss(loss, t[None] if isinstance(t, torch.Tensor) else t, z[None]) / B

    H_Z = torch.func.vmap(torch.func.hessian(per_sequence), in_dims=in_dims)(Z, target).reshape(m, L * d, L * d)
    J = torch.func.jacrev(out)(sel)
    J = {k: J[k].reshape(m, L * d, -1) for k in names}
    for a, b in pairs(names):
        full = Hf[a][b].reshape(allv[a].numel(), allv[b].numel())
        outer = torch.einsum("bia,bij,bjc->ac", J[a], H_Z, J[b])
        parts["full"].add(a, b, full)
        parts["outer"].add(a, b, outer)
        parts["functional"].add(a, b, full - outer)
