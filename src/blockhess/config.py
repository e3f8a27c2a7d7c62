"""Block configuration, parameter names and shapes, and parameter initialisation.

The conventions (docs/derivations.md, top and §8): row vectors act on the right (``Q = X @ W_Q``),
parameters are a plain ``dict[str, Tensor]`` in forward order, and the paper's exact
setting (one head, no biases, no output projection, ReLU, LayerNorm without affine and
with ``eps = 0``, post-LN) is the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .validation import FLOAT_DTYPES, check_bool, check_eps, check_int

__all__ = ["BlockConfig", "param_shapes", "init_params", "SHORT_NAMES", "pair_key", "TORCH_NAMES", "name_hint"]

_KINDS = ("block", "attention")
_NORMS = ("post", "pre")
_ACTIVATIONS = ("relu", "gelu", "gelu_tanh")


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
        Number of attention heads; head ``h`` uses the column groups
        ``W_Q[:, h*d_k:(h+1)*d_k]``, ``W_K[:, h*d_k:(h+1)*d_k]`` and ``W_V[:, h*d_v:(h+1)*d_v]``,
        ``d_v = d_model / n_heads`` (which must divide); its output fills columns
        ``h*d_v:(h+1)*d_v`` of the concatenated attention output.
    norm : str
        ``"post"`` (the paper's): ``Y = LN_1(X + SA(X))``, ``Z = LN_2(Y + FFN(Y))``;
        ``"pre"``: ``Y = X + SA(LN_1(X))``, ``Z = Y + FFN(LN_2(Y))``.
    activation : str
        FFN activation: ``"relu"`` (Lemma 1: results hold almost everywhere, off the kinks),
        ``"gelu"`` (exact, erf) or ``"gelu_tanh"`` (the tanh approximation).
    bias : bool
        Add every additive bias: ``b_Q, b_K, b_V`` (and ``b_O`` with ``out_proj``), ``b_1, b_2``
        and the LayerNorm shifts ``beta_1, beta_2`` (as ``nn.TransformerEncoderLayer(bias=...)``).
    out_proj : bool
        Add the attention output projection ``W_O`` (``P = O W_O [+ b_O]``).
    ln_affine : bool
        Add the LayerNorm scales ``gamma_1, gamma_2``.
    ln_eps : float
        LayerNorm ``eps >= 0``; ``0`` is the paper's setting (Assumption 2 then requires
        every LayerNorm input row to have non-zero variance).
    causal : bool
        Mask the attention scores above the diagonal (token ``l`` attends to ``m <= l``).
    kind : str
        ``"block"`` (Transformer block) or ``"attention"`` (the bare self-attention layer of
        Theorem 1: ``F = SA(X)``, params ``W_Q, W_K, W_V`` and, with the options above,
        ``b_Q, b_K, b_V, W_O, b_O``; it has no LayerNorm and no FFN).

    The defaults are the paper's exact setting: one head, no biases, no ``W_O``, ReLU,
    LayerNorm without affine and with ``eps = 0``, post-LN, no mask.

    Raises
    ------
    ValueError
        On a size that is not an int >= 1 (``d_k`` may be ``None``), an unknown
        ``kind``/``norm``/``activation``, ``ln_eps`` not a finite float >= 0, a flag that is not a
        bool, ``n_heads`` not dividing ``d_model``, or a LayerNorm/FFN option (``norm``,
        ``ln_affine``, ``ln_eps``, ``activation``) changed from its default with
        ``kind="attention"`` (each named in the message); ``d_ff`` is unused there.
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
        for name in ("d_model", "d_ff", "n_heads") + (("d_k",) if self.d_k is not None else ()):  # stored as int
            object.__setattr__(self, name, check_int(f"BlockConfig.{name}", getattr(self, name), 1))
        if self.kind not in _KINDS:
            raise ValueError(f"BlockConfig.kind must be one of {_KINDS}, got {self.kind!r}")
        if self.norm not in _NORMS:
            raise ValueError(f"BlockConfig.norm must be one of {_NORMS}, got {self.norm!r}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(
                f"BlockConfig.activation must be one of {_ACTIVATIONS}, got {self.activation!r}"
            )
        object.__setattr__(self, "ln_eps", check_eps("BlockConfig.ln_eps", self.ln_eps))
        for flag in ("bias", "out_proj", "ln_affine", "causal"):
            check_bool(f"BlockConfig.{flag}", getattr(self, flag))
        if self.kind == "attention":
            for name, default in (("norm", "post"), ("ln_affine", False), ("ln_eps", 0.0), ("activation", "relu")):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"BlockConfig.{name}={getattr(self, name)!r} has no meaning for kind='attention' "
                        "(the bare attention layer has no LayerNorm and no FFN); use kind='block'"
                    )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"BlockConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}"
            )

    @property
    def head_dim(self) -> int:
        """Query/key width per head, ``d_k`` (defaults to ``d_model // n_heads``)."""
        return self.d_k if self.d_k is not None else self.d_model // self.n_heads

    @property
    def value_dim(self) -> int:
        """Value/output width per head, ``d_v = d_model // n_heads``."""
        return self.d_model // self.n_heads

    @property
    def is_paper(self) -> bool:
        """Whether this is the paper's exact setting (the defaults, any sizes and ``d_k``)."""
        return (self.n_heads == 1 and self.norm == "post" and self.activation == "relu" and not self.bias
                and not self.out_proj and not self.ln_affine and self.ln_eps == 0 and not self.causal)


def param_shapes(cfg: BlockConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the parameters of ``cfg``, in canonical order (docs/derivations.md §8).

    The order is ``W_Q, b_Q, W_K, b_K, W_V, b_V, W_O, b_O, gamma_1, beta_1, W_1, b_1, W_2,
    b_2, gamma_2, beta_2``, restricted to the names ``cfg`` has: ``W_Q, W_K`` are
    ``(d_model, n_heads*d_k)``, ``W_V, W_O`` ``(d_model, d_model)``, ``W_1`` ``(d_model, d_ff)``,
    ``W_2`` ``(d_ff, d_model)``, vectors ``(n,)``. The paper's setting gives
    ``W_Q, W_K, W_V, W_1, W_2`` (``kind="block"``) or ``W_Q, W_K, W_V`` (``kind="attention"``).
    """
    d, dk, ff = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.d_ff
    b, block = cfg.bias, cfg.kind == "block"
    spec = [
        ("W_Q", (d, dk), True), ("b_Q", (dk,), b), ("W_K", (d, dk), True), ("b_K", (dk,), b),
        ("W_V", (d, d), True), ("b_V", (d,), b), ("W_O", (d, d), cfg.out_proj), ("b_O", (d,), b and cfg.out_proj),
        ("gamma_1", (d,), block and cfg.ln_affine), ("beta_1", (d,), block and b),
        ("W_1", (d, ff), block), ("b_1", (ff,), block and b), ("W_2", (ff, d), block), ("b_2", (d,), block and b),
        ("gamma_2", (d,), block and cfg.ln_affine), ("beta_2", (d,), block and b),
    ]
    return {name: shape for name, shape, present in spec if present}


#: One-character names of the paper's weights (Theorems 1 and 6), the one table of abbreviations:
#: the bounds key their ingredients by them (:func:`pair_key`), the scaling study and the report's
#: figures label blocks with them.
SHORT_NAMES = {"W_Q": "Q", "W_K": "K", "W_V": "V", "W_1": "1", "W_2": "2"}


def pair_key(a: str, b: str) -> str:
    """The key of the unordered pair of weights ``(a, b)``: their :data:`SHORT_NAMES` in the order
    ``Q, K, V, 1, 2`` (``pair_key("W_K", "W_Q") == "QK"``). Raises ``KeyError`` for a name not in
    :data:`SHORT_NAMES`."""
    return "".join(sorted((SHORT_NAMES[a], SHORT_NAMES[b]), key="QKV12".index))


#: The parameters of PyTorch's ``nn.TransformerEncoderLayer`` (names relative to the layer; a bare
#: ``nn.MultiheadAttention`` has the ``self_attn.`` ones without that prefix) and the parameters of
#: this library each stores: ``[(our name, transposed)]``, stacked along the stored tensor's first
#: axis (``in_proj_weight`` is ``[W_Q; W_K; W_V]``). Read by :mod:`blockhess.adapters`; here so that
#: the core can word an error about a PyTorch name (:func:`name_hint`) without importing them.
TORCH_NAMES = {
    "self_attn.in_proj_weight": [("W_Q", True), ("W_K", True), ("W_V", True)],
    "self_attn.in_proj_bias": [("b_Q", False), ("b_K", False), ("b_V", False)],
    "self_attn.out_proj.weight": [("W_O", True)],
    "self_attn.out_proj.bias": [("b_O", False)],
    "linear1.weight": [("W_1", True)],
    "linear1.bias": [("b_1", False)],
    "linear2.weight": [("W_2", True)],
    "linear2.bias": [("b_2", False)],
    "norm1.weight": [("gamma_1", False)],
    "norm1.bias": [("beta_1", False)],
    "norm2.weight": [("gamma_2", False)],
    "norm2.bias": [("beta_2", False)],
}


def name_hint(names) -> str:
    """A note for ``names`` given where this library's names are expected: for each that is a
    PyTorch parameter name (``linear1.weight``, ``self_attn.in_proj_weight``, ``in_proj_weight``
    of a bare attention layer; :data:`TORCH_NAMES`), what it is called here; ``""`` if none is."""
    hints = []
    for name in names:
        parts = TORCH_NAMES.get(name) or TORCH_NAMES.get(f"self_attn.{name}")
        if parts:
            ours = ", ".join(n for n, _ in parts) + (" stacked" if len(parts) > 1 else "")
            turned = (" (each transposed)" if len(parts) > 1 else ", transposed") if parts[0][1] else ""
            hints.append(f"{name!r} is PyTorch's {ours}{turned}")
    if not hints:
        return ""
    return ("; " + "; ".join(hints) + " (from_torch reads a layer's weights under these names; "
            "H.to_module(layer) maps a Hessian back to the layer's)")


def init_params(
    cfg: BlockConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Random parameters for ``cfg``: a ``dict`` of tensors in canonical order.

    Each matrix ``W`` of shape ``(fan_in, fan_out)`` is drawn i.i.d. ``N(0, 1/fan_in)`` from a
    private ``torch.Generator`` seeded with ``seed`` (the global RNG is left untouched). The
    paper's matrices ``W_Q, W_K, W_V, W_1, W_2`` are drawn first, then ``W_O``: options that
    add weights (biases, ``W_O``, affine LayerNorm) leave the paper's matrices unchanged.
    Vectors take the usual initial values: biases and ``beta`` zero, ``gamma`` one.

    Raises
    ------
    ValueError
        If ``dtype`` is not float32 or float64, or ``seed`` is not an int >= 0.
    """
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"init_params: dtype must be a floating dtype, float32 or float64, got {dtype}")
    gen = torch.Generator().manual_seed(check_int("seed", seed, 0))
    shapes = param_shapes(cfg)
    drawn = {}
    for name in sorted((k for k, s in shapes.items() if len(s) == 2), key=lambda k: k == "W_O"):  # W_O last
        drawn[name] = torch.randn(shapes[name], generator=gen, dtype=torch.float64) / math.sqrt(shapes[name][0])
    params = {}
    for name, shape in shapes.items():
        if name in drawn:
            w = drawn[name]
        else:
            w = torch.ones(shape, dtype=torch.float64) if name.startswith("gamma") else torch.zeros(shape, dtype=torch.float64)
        params[name] = w.to(dtype=dtype, device=device)
    return params
