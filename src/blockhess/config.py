"""Block configuration, parameter names and shapes, and parameter initialisation.

The conventions are fixed in DESIGN.md §1: row vectors act on the right (``Q = X @ W_Q``),
parameters are a plain ``dict[str, Tensor]`` in forward order, and the paper's exact
setting (one head, no biases, no output projection, ReLU, LayerNorm without affine and
with ``eps = 0``, post-LN) is the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["BlockConfig", "param_shapes", "init_params"]

_KINDS = ("block", "attention")
_NORMS = ("post",)
_ACTIVATIONS = ("relu",)


@dataclass(frozen=True)
class BlockConfig:
    """Architecture of one Transformer block (or of a bare self-attention layer).

    Attributes
    ----------
    d_model : int
        Width of the token rows of ``X`` (the paper's ``d_V``).
    d_ff : int
        Hidden width of the FFN (``kind="block"`` only).
    d_k : int or None
        Query/key width per head; ``None`` means ``d_model // n_heads``.
    n_heads : int
        Number of attention heads. Only ``1`` (the paper's setting) is implemented.
    norm : str
        ``"post"``: ``Y = LN(X + SA(X))``, ``Z = LN(Y + FFN(Y))`` (paper §1.3).
    activation : str
        FFN activation; ``"relu"`` (Lemma 1: results hold almost everywhere, off the kinks).
    bias, out_proj, ln_affine, causal : bool
        Extensions beyond the paper; not implemented yet, must be ``False``.
    ln_eps : float
        LayerNorm ``eps >= 0``; ``0`` is the paper's setting (Assumption 2 then requires
        every LayerNorm input row to have non-zero variance).
    kind : str
        ``"block"`` (post-LN Transformer block, params ``W_Q, W_K, W_V, W_1, W_2``) or
        ``"attention"`` (the bare layer of Theorem 1, params ``W_Q, W_K, W_V``).

    Raises
    ------
    ValueError
        On a non-positive size, an unknown ``kind``/``norm``/``activation``, ``ln_eps < 0``,
        or an option this version does not implement (named in the message).
    """

    d_model: int = 16
    d_ff: int = 64
    d_k: int | None = None
    n_heads: int = 1
    norm: str = "post"
    activation: str = "relu"
    bias: bool = False
    out_proj: bool = False
    ln_affine: bool = False
    ln_eps: float = 0.0
    causal: bool = False
    kind: str = "block"

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockConfig.{name} must be a positive int, got {value!r}")
        if self.d_k is not None and (not isinstance(self.d_k, int) or self.d_k < 1):
            raise ValueError(f"BlockConfig.d_k must be a positive int or None, got {self.d_k!r}")
        if self.kind not in _KINDS:
            raise ValueError(f"BlockConfig.kind must be one of {_KINDS}, got {self.kind!r}")
        if self.norm not in _NORMS:
            raise ValueError(f"BlockConfig.norm must be one of {_NORMS}, got {self.norm!r}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(
                f"BlockConfig.activation must be one of {_ACTIVATIONS}, got {self.activation!r}"
            )
        if not (isinstance(self.ln_eps, (int, float)) and self.ln_eps >= 0 and math.isfinite(self.ln_eps)):
            raise ValueError(f"BlockConfig.ln_eps must be a finite float >= 0, got {self.ln_eps!r}")
        if self.n_heads != 1:
            raise ValueError("BlockConfig.n_heads: only n_heads=1 (the paper's setting) is implemented")
        for flag in ("bias", "out_proj", "ln_affine", "causal"):
            if getattr(self, flag):
                raise ValueError(f"BlockConfig.{flag}=True is not implemented yet; use False")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"BlockConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}"
            )

    @property
    def head_dim(self) -> int:
        """Query/key width per head, ``d_k`` (defaults to ``d_model // n_heads``)."""
        return self.d_k if self.d_k is not None else self.d_model // self.n_heads


def param_shapes(cfg: BlockConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the parameters of ``cfg``, in canonical (forward) order.

    Returns ``{"W_Q": (d_model, d_k), "W_K": (d_model, d_k), "W_V": (d_model, d_model)}``
    plus ``"W_1": (d_model, d_ff), "W_2": (d_ff, d_model)`` for ``kind="block"``.
    """
    d, dk = cfg.d_model, cfg.n_heads * cfg.head_dim
    shapes = {"W_Q": (d, dk), "W_K": (d, dk), "W_V": (d, d)}
    if cfg.kind == "block":
        shapes.update({"W_1": (d, cfg.d_ff), "W_2": (cfg.d_ff, d)})
    return shapes


def init_params(
    cfg: BlockConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Random parameters for ``cfg``: a ``dict`` of tensors in canonical order.

    Each ``W`` of shape ``(fan_in, fan_out)`` is drawn i.i.d. ``N(0, 1/fan_in)`` from a
    private ``torch.Generator`` seeded with ``seed`` (the global RNG is left untouched).

    Raises
    ------
    ValueError
        If ``dtype`` is not a floating dtype.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"init_params: dtype must be a floating dtype, got {dtype}")
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        w = torch.randn(shape, generator=gen, dtype=torch.float64) / math.sqrt(shape[0])
        params[name] = w.to(dtype=dtype, device=device)
    return params
