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

__all__ = ["BlockConfig", "ModelConfig", "param_shapes", "init_params", "model_param_shapes", "init_model_params",
           "sinusoidal_positions", "block_prefix", "check_window", "SHORT_NAMES", "pair_key", "TORCH_NAMES", "name_hint"]

_KINDS = ("block", "attention")
_NORMS = ("post", "pre")
_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
_NORM_TYPES = ("layer", "rms")


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
        ``"gelu"`` (exact, erf), ``"gelu_tanh"`` (the tanh approximation; Gemma's GeGLU gate) or
        ``"silu"`` (``x·sigmoid(x)``; Llama's SwiGLU gate).
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
    norm_type : str
        ``"layer"`` (LayerNorm, the paper's) or ``"rms"`` (RMSNorm, Llama/Qwen2/Mistral/Gemma:
        ``x · (mean(x²) + ln_eps)^(-1/2) · (rms_offset + gamma)``; no centring and no shift ``beta``,
        even with ``bias=True``). The scales keep the names ``gamma_1``, ``gamma_2`` (HF's
        ``input_layernorm.weight``, ``post_attention_layernorm.weight``), present with ``ln_affine=True``.
    rms_offset : float
        The constant added to the RMSNorm scale: ``0.0`` (Llama: ``gamma · x̂``) or ``1.0`` (Gemma:
        ``(1 + gamma) · x̂``, its stored weight being ``gamma``); ``norm_type="rms"`` with
        ``ln_affine=True`` only.
    gated : bool
        A gated FFN (GLU): ``FFN(Y) = (act(Y W_G + b_G) ⊙ (Y W_1 + b_1)) W_2 + b_2``; ``W_G``
        ``(d_model, d_ff)`` is HF's ``gate_proj.weight`` transposed, ``W_1`` its ``up_proj``, ``W_2`` its
        ``down_proj`` (SwiGLU: ``activation="silu"``; GeGLU: ``"gelu_tanh"``); ``b_G`` with ``bias``.
    n_kv_heads : int or None
        Key/value heads (grouped-query attention; ``1``: multi-query); ``None`` means ``n_heads``.
        Must divide ``n_heads``; query head ``h`` uses key/value head ``h // (n_heads / n_kv_heads)``
        (HF's ``repeat_kv``). ``W_K`` is ``(d_model, n_kv_heads·d_k)``, ``W_V``
        ``(d_model, n_kv_heads·d_v)``.
    d_v : int or None
        Value width per head; ``None`` means ``d_model // n_heads`` (then ``n_heads`` must divide
        ``d_model``). HF's ``head_dim`` is ``d_k = d_v = head_dim``. The attention output has
        ``n_heads·d_v`` columns, which must be ``d_model`` unless ``out_proj`` (``W_O`` is
        ``(n_heads·d_v, d_model)``).
    qkv_bias : bool
        Add the biases ``b_Q, b_K, b_V`` of the three projections whatever ``bias`` says (Qwen2:
        ``qkv_bias=True, bias=False``).
    rope : bool
        Rotary position embeddings on the queries and keys of every head, HF's rotate-half
        convention: ``q ↦ q ⊙ cos_l + rotate_half(q) ⊙ sin_l`` at token ``l = 0..L-1``,
        ``rotate_half(q) = (-q[d_k/2:], q[:d_k/2])``, angles ``l · rope_theta^(-2i/d_k)`` for
        ``i < d_k/2``, each used for entries ``i`` and ``i + d_k/2``. ``d_k`` must be even.
        Applied after the bias: ``Q_l = (x_l W_Q + b_Q) R_l``.
    rope_theta : float
        The RoPE base (HF's ``rope_theta``), finite and ``> 0``.
    sliding_window : int or None
        Mistral's (and Qwen2's) sliding-window attention, with ``causal=True``: token ``l`` attends to
        ``m`` with ``0 <= l - m < sliding_window`` (HF's ``sliding_window``). A sequence of at most
        ``sliding_window`` tokens is plain causal, the only case the closed form takes: a longer one is
        refused by name (:func:`check_window`) before any work. ``None``: no window.
    kind : str
        ``"block"`` (Transformer block) or ``"attention"`` (the bare self-attention layer of
        Theorem 1: ``F = SA(X)``, params ``W_Q, W_K, W_V`` and, with the options above,
        ``b_Q, b_K, b_V, W_O, b_O``; it has no LayerNorm and no FFN).

    The defaults are the paper's exact setting: one head, no biases, no ``W_O``, ReLU,
    LayerNorm without affine and with ``eps = 0``, post-LN, no mask.

    The Llama block is ``BlockConfig(norm="pre", norm_type="rms", ln_affine=True, ln_eps=1e-6,
    gated=True, activation="silu", n_kv_heads=..., d_k=head_dim, d_v=head_dim, out_proj=True,
    rope=True, causal=True)``: ``Y = X + Attn(RMSNorm_1(X))``, ``Z = Y + FFN(RMSNorm_2(Y))``
    (docs/derivations.md §20). Which functions take which option: :attr:`llama_options`.

    Raises
    ------
    ValueError
        On a size that is not an int >= 1 (``d_k`` may be ``None``), an unknown
        ``kind``/``norm``/``activation``, ``ln_eps`` not a finite float >= 0, a flag that is not a
        bool, ``n_heads`` not dividing ``d_model``, or a LayerNorm/FFN option (``norm``,
        ``ln_affine``, ``ln_eps``, ``activation``, ``norm_type``, ``rms_offset``, ``gated``) changed from
        its default with ``kind="attention"`` (each named in the message); ``d_ff`` is unused there;
        ``n_kv_heads`` not dividing ``n_heads``; ``d_k`` odd with ``rope``; ``rope_theta`` not a finite
        float ``> 0``; ``rms_offset`` other than 0 without ``norm_type="rms"`` and ``ln_affine``;
        ``n_heads·d_v != d_model`` without ``out_proj``; ``sliding_window`` not an int ``>= 1`` or without
        ``causal``.
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
    norm_type: str = "layer"
    rms_offset: float = 0.0
    gated: bool = False
    n_kv_heads: int | None = None
    d_v: int | None = None
    qkv_bias: bool = False
    rope: bool = False
    rope_theta: float = 10000.0
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        optional = tuple(n for n in ("d_k", "n_kv_heads", "d_v", "sliding_window") if getattr(self, n) is not None)
        for name in ("d_model", "d_ff", "n_heads") + optional:  # stored as int
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
        for flag in ("bias", "out_proj", "ln_affine", "causal", "gated", "qkv_bias", "rope"):
            check_bool(f"BlockConfig.{flag}", getattr(self, flag))
        if self.norm_type not in _NORM_TYPES:
            raise ValueError(f"BlockConfig.norm_type must be one of {_NORM_TYPES}, got {self.norm_type!r}")
        for name in ("rms_offset", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"BlockConfig.{name} must be a finite float, got {v!r}")
            object.__setattr__(self, name, float(v))
        if self.rope_theta <= 0:
            raise ValueError(f"BlockConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.rope and self.rope_theta != 10000.0:
            raise ValueError(f"BlockConfig.rope_theta={self.rope_theta!r} has no meaning without rope=True")
        if self.rms_offset != 0.0 and not (self.norm_type == "rms" and self.ln_affine):
            raise ValueError(f"BlockConfig.rms_offset={self.rms_offset!r} needs norm_type='rms' and ln_affine=True "
                             "(it is added to the RMSNorm scales gamma_1, gamma_2)")
        if self.kind == "attention":
            for name, default in (("norm", "post"), ("ln_affine", False), ("ln_eps", 0.0), ("activation", "relu"),
                                  ("norm_type", "layer"), ("rms_offset", 0.0), ("gated", False)):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"BlockConfig.{name}={getattr(self, name)!r} has no meaning for kind='attention' "
                        "(the bare attention layer has no LayerNorm and no FFN); use kind='block'"
                    )
        if self.d_v is None and self.d_model % self.n_heads:
            raise ValueError(
                f"BlockConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                "(or give the value width d_v)"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(f"BlockConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.sliding_window is not None and not self.causal:
            raise ValueError(f"BlockConfig.sliding_window={self.sliding_window} needs causal=True (the window bounds "
                             "how far back a token attends)")
        if self.rope and self.head_dim % 2:
            raise ValueError(f"BlockConfig.rope needs an even d_k (rotate-half pairs entries i and i + d_k/2), "
                             f"got d_k={self.head_dim}")
        if self.n_heads * self.value_dim != self.d_model and not self.out_proj:
            raise ValueError(f"BlockConfig: the attention output has n_heads*d_v = {self.n_heads * self.value_dim} "
                             f"columns, not d_model={self.d_model}: it needs out_proj=True (W_O maps it to d_model)")

    @property
    def head_dim(self) -> int:
        """Query/key width per head, ``d_k`` (defaults to ``d_model // n_heads``)."""
        return self.d_k if self.d_k is not None else self.d_model // self.n_heads

    @property
    def value_dim(self) -> int:
        """Value/output width per head, ``d_v`` (defaults to ``d_model // n_heads``)."""
        return self.d_v if self.d_v is not None else self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads, ``n_kv_heads`` (defaults to ``n_heads``)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def has_qkv_bias(self) -> bool:
        """Whether the projections carry ``b_Q, b_K, b_V`` (``bias`` or ``qkv_bias``)."""
        return self.bias or self.qkv_bias

    @property
    def llama_options(self) -> tuple[str, ...]:
        """The options of this config that only the matrix-free path takes (docs/derivations.md §20),
        each as ``name=value``: RMSNorm, the gated FFN, grouped-query attention (``n_kv_heads`` below
        ``n_heads``), a value width other than ``d_model/n_heads``, RoPE. Empty for the configs the
        Kronecker-factor kernels take (those and ``qkv_bias``, ``activation="silu"``). :func:`blockhess.hessian`,
        :func:`blockhess.jacobian` and :func:`blockhess.input_jacobian` assemble these from exact products
        and tangents, :func:`blockhess.hessian_operator` takes them; the functions that need the factors
        (``block.jacobian_factors``, ``block.second_derivative``, a model's dense Hessian) raise
        ``NotImplementedError`` naming them, the bounds ``ValueError``."""
        out = []
        if self.norm_type != "layer":
            out.append(f"norm_type={self.norm_type!r}")
        if self.gated:
            out.append("gated=True")
        if self.kv_heads != self.n_heads:
            out.append(f"n_kv_heads={self.n_kv_heads}")
        if self.d_v is not None and self.d_v * self.n_heads != self.d_model:
            out.append(f"d_v={self.d_v}")
        if self.rope:
            out.append("rope=True")
        return tuple(out)

    @property
    def is_paper(self) -> bool:
        """Whether this is the paper's exact setting (the defaults, any sizes and ``d_k``)."""
        return (self.n_heads == 1 and self.norm == "post" and self.activation == "relu" and not self.bias
                and not self.out_proj and not self.ln_affine and self.ln_eps == 0 and not self.causal)


def param_shapes(cfg: BlockConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the parameters of ``cfg``, in canonical order (docs/derivations.md §8).

    The order is ``W_Q, b_Q, W_K, b_K, W_V, b_V, W_O, b_O, gamma_1, beta_1, W_G, b_G, W_1, b_1, W_2,
    b_2, gamma_2, beta_2``, restricted to the names ``cfg`` has: ``W_Q`` is ``(d_model, n_heads*d_k)``,
    ``W_K`` ``(d_model, n_kv_heads*d_k)``, ``W_V`` ``(d_model, n_kv_heads*d_v)``, ``W_O``
    ``(n_heads*d_v, d_model)`` (all ``d_model`` wide by default), ``W_G``, ``W_1`` ``(d_model, d_ff)``,
    ``W_2`` ``(d_ff, d_model)``, vectors ``(n,)``. The paper's setting gives
    ``W_Q, W_K, W_V, W_1, W_2`` (``kind="block"``) or ``W_Q, W_K, W_V`` (``kind="attention"``).
    A :class:`ModelConfig` gives the model's (:func:`model_param_shapes`).
    """
    if isinstance(cfg, ModelConfig):
        return model_param_shapes(cfg)
    d, dk, ff = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.d_ff
    kk, kv, o = cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.value_dim, cfg.n_heads * cfg.value_dim
    b, block, qb = cfg.bias, cfg.kind == "block", cfg.has_qkv_bias
    nb = block and b and cfg.norm_type == "layer"  # RMSNorm has no shift
    spec = [
        ("W_Q", (d, dk), True), ("b_Q", (dk,), qb), ("W_K", (d, kk), True), ("b_K", (kk,), qb),
        ("W_V", (d, kv), True), ("b_V", (kv,), qb), ("W_O", (o, d), cfg.out_proj), ("b_O", (d,), b and cfg.out_proj),
        ("gamma_1", (d,), block and cfg.ln_affine), ("beta_1", (d,), nb),
        ("W_G", (d, ff), block and cfg.gated), ("b_G", (ff,), block and b and cfg.gated),
        ("W_1", (d, ff), block), ("b_1", (ff,), block and b), ("W_2", (ff, d), block), ("b_2", (d,), block and b),
        ("gamma_2", (d,), block and cfg.ln_affine), ("beta_2", (d,), nb),
    ]
    return {name: shape for name, shape, present in spec if present}


#: One-character names of the paper's weights (Theorems 1 and 6), the one table of abbreviations:
#: the bounds key their ingredients by them (:func:`pair_key`), the scaling study and the report's
#: figures label blocks with them.
SHORT_NAMES = {"W_Q": "Q", "W_K": "K", "W_V": "V", "W_1": "1", "W_2": "2"}  # no W_G: the paper's bounds have none


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


def name_hint(names, known=()) -> str:
    """A note for ``names`` given where this library's names ``known`` are expected: for each that is a
    PyTorch parameter name (``linear1.weight``, ``self_attn.in_proj_weight``, ``in_proj_weight``
    of a bare attention layer; :data:`TORCH_NAMES`), what it is called here; for a block's name
    where ``known`` are a model's (``W_Q`` for ``blocks.0.W_Q``, :func:`block_prefix`), the model's;
    for ``X``, how the input becomes a variable (a block's ``wrt_input``; a model's never does);
    ``""`` if none applies."""
    model = any(k.startswith("blocks.") for k in known)
    hints, torch_names = [], False
    for name in names:
        parts = TORCH_NAMES.get(name) or TORCH_NAMES.get(f"self_attn.{name}")
        per_block = [k for k in known if k.startswith("blocks.") and k.split(".", 2)[2] == name]
        if per_block:
            hints.append(f"{name!r} is a block's name: a model names each block's own, {', '.join(map(repr, per_block))}")
        elif parts:
            ours = ", ".join(n for n, _ in parts) + (" stacked" if len(parts) > 1 else "")
            turned = (" (each transposed)" if len(parts) > 1 else ", transposed") if parts[0][1] else ""
            hints.append(f"{name!r} is PyTorch's {ours}{turned}")
            torch_names = True
        elif name == "X":
            hints.append("a model's input is not a variable" if model else "the input X is a variable with wrt_input=True")
    if not hints:
        return ""
    return "; " + "; ".join(hints) + (" (from_torch reads a layer's weights under these names; "
                                       "H.to_module(layer) maps a Hessian back to the layer's)" if torch_names else "")


def init_params(
    cfg: BlockConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Random parameters for ``cfg``: a ``dict`` of tensors in canonical order.

    Each matrix ``W`` of shape ``(fan_in, fan_out)`` is drawn i.i.d. ``N(0, 1/fan_in)`` from a
    private ``torch.Generator`` seeded with ``seed`` (the global RNG is left untouched). The
    paper's matrices ``W_Q, W_K, W_V, W_1, W_2`` are drawn first, then ``W_G``, then ``W_O``: options that
    add weights (biases, ``W_G``, ``W_O``, affine LayerNorm) leave the paper's matrices unchanged.
    Vectors take the usual initial values: biases and ``beta`` zero, ``gamma`` one (the effective
    scale: ``1 - rms_offset``, so Gemma's stored ``gamma`` starts at zero).

    A :class:`ModelConfig` gives the model's (:func:`init_model_params`).

    Raises
    ------
    ValueError
        If ``dtype`` is not float32 or float64, or ``seed`` is not an int >= 0.
    """
    if isinstance(cfg, ModelConfig):
        return init_model_params(cfg, seed, dtype, device)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"init_params: dtype must be a floating dtype, float32 or float64, got {dtype}")
    gen = torch.Generator().manual_seed(check_int("seed", seed, 0))
    shapes = param_shapes(cfg)
    drawn = {}
    late = {"W_G": 1, "W_O": 2}  # after the paper's matrices: W_G, then W_O
    for name in sorted((k for k, s in shapes.items() if len(s) == 2), key=lambda k: late.get(k, 0)):
        drawn[name] = torch.randn(shapes[name], generator=gen, dtype=torch.float64) / math.sqrt(shapes[name][0])
    params = {}
    for name, shape in shapes.items():
        if name in drawn:
            w = drawn[name]
        else:
            w = torch.full(shape, 1.0 - cfg.rms_offset, dtype=torch.float64) if name.startswith("gamma") \
                else torch.zeros(shape, dtype=torch.float64)
        params[name] = w.to(dtype=dtype, device=device)
    return params


# ----------------------------------------------------------------------------------------------
# whole models: embedding -> N blocks -> final LayerNorm -> pooling -> head

_EMBEDDINGS = ("linear", "patch", "token", "none")
_POSITIONS = ("none", "sinusoidal", "learned")
_POOLS = ("none", "mean", "first", "last")


@dataclass(frozen=True)
class ModelConfig:
    r"""Architecture of a whole Transformer: embedding, positions, ``N`` blocks, an optional final
    LayerNorm, a pooling and a linear head (docs/derivations.md §16).

    .. math::
        X_0 = \mathrm{LN}_E(\mathrm{embed}(x) + P),\quad X_i = \mathrm{Block}_i(X_{i-1}),\quad
        u = \mathrm{LN}_F(X_N),\quad h = \mathrm{pool}(u),\quad z = h\,W_H + b_H,

    each of ``LN_E``, ``LN_F``, the head and ``P`` optional. Row vectors act on the right, as in the
    block. Parameters (:func:`param_shapes`, canonical order): ``W_E``, ``b_E``, ``cls``, ``W_P``,
    ``W_T``, ``gamma_E``, ``beta_E``, then block ``i``'s names prefixed ``blocks.{i}.``, then
    ``gamma_F``, ``beta_F``, ``W_H``, ``b_H`` — each where the config has it.

    Attributes
    ----------
    blocks : tuple of BlockConfig
        ``N >= 1`` blocks (``kind="block"``), each any setting :class:`BlockConfig` supports,
        all of one ``d_model``.
    embedding : str
        ``"linear"``: inputs ``(B, L, d_in)`` features, ``embed(x)_t = x_t W_E + b_E`` with
        ``W_E`` of shape ``(d_in, d_model)``; ``"patch"``: inputs images ``(B, C, H, W)`` (``image``),
        cut into non-overlapping ``patch × patch`` patches in row-major order, each flattened
        channel-major (``(c, i, j)``; a convolution with stride = kernel = ``patch``) and embedded
        linearly as ``"linear"`` with ``d_in = C·patch²``; ``"token"``: integer ids ``(B, L)`` in
        ``[0, vocab)``, ``embed(x)_t = W_E[x_t]``, ``W_E`` of shape ``(vocab, d_model)``;
        ``"none"``: inputs are ``X_0`` itself, ``(B, L, d_model)`` (an encoder stack).
    d_in : int or None
        Feature width of ``"linear"`` (derived for ``"patch"``).
    vocab : int or None
        Vocabulary size of ``"token"``.
    image : tuple (C, H, W) or None
        Image shape of ``"patch"``.
    patch : int or None
        Patch size of ``"patch"`` (dividing ``H`` and ``W``).
    embed_bias : bool
        ``b_E`` for ``"linear"`` and ``"patch"``.
    cls_token : bool
        Prepend a learned token ``cls`` ``(d_model,)`` before the embedded tokens (ViT).
    positions : str
        ``"none"``, ``"sinusoidal"`` (fixed, :func:`sinusoidal_positions`) or ``"learned"``
        (``W_P`` of shape ``(n_positions, d_model)``; row ``t`` added to token ``t``, the
        ``cls`` token being token 0).
    n_positions : int or None
        Rows of ``W_P`` (the longest sequence, ``cls`` included); required for ``"learned"``.
    token_types : int
        ``> 0``: a token-type table ``W_T`` ``(token_types, d_model)`` whose row 0 is added to
        every token (BERT with every token type 0); ``0``: none.
    embed_norm, final_norm : bool
        A LayerNorm after the embedding (``gamma_E``, ``beta_E``; BERT) / after the last block
        (``gamma_F``, ``beta_F``; pre-LN stacks).
    norm_affine, norm_bias : bool
        Whether those two LayerNorms have a scale ``gamma`` / a shift ``beta``.
    norm_eps : float
        Their ``eps >= 0``.
    norm_type : str
        Those two norms' kind: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm, as
        :class:`BlockConfig`'s: ``u = x (mean(x²) + norm_eps)^(-1/2) (rms_offset + gamma)``, no
        shift: ``norm_bias`` must be ``False``; Llama's final ``norm``).
    rms_offset : float
        The constant added to an RMSNorm scale: ``0.0`` (Llama) or ``1.0`` (Gemma's ``1 + gamma``);
        needs ``norm_type="rms"`` and ``norm_affine``.
    embed_scale : float
        A token embedding's scale ``s``: ``embed(x)_t = s · W_E[x_t]`` (Gemma: ``√d_model``), ``s``
        rounded to the parameters' dtype before the product (as Hugging Face multiplies by its
        ``embed_scale`` buffer cast to the weight's dtype). ``1.0``: none; any other value needs
        ``embedding="token"``; finite and ``> 0``.
    pool : str
        ``"none"`` (per-token outputs ``(B, L, ·)``), ``"mean"`` over tokens, ``"first"``
        (token 0, the ``cls`` token) or ``"last"`` (token ``L − 1``, GPT-2's sequence classifier):
        outputs ``(B, ·)``.
    pad_token : int or None
        With ``pool="last"`` and ``embedding="token"``: the padding id (GPT-2's ``pad_token_id``).
        ``"last"`` then pools each sequence at its last token whose id is not ``pad_token``, as
        ``GPT2ForSequenceClassification`` does (:func:`~blockhess.model.forward_pass.last_tokens`);
        a sequence of padding ids only is refused (``ValueError``).
    head : int or None
        Output width of the linear head ``W_H`` ``(d_model, head)`` (classes, or the vocabulary);
        ``None``: no head, the output is ``h`` itself.
    head_bias : bool
        ``b_H`` ``(head,)``.
    tied : bool
        The head is the token embedding: ``z = h W_E^T`` (a language model; ``W_E`` is used
        twice and its Hessian has both uses); needs ``embedding="token"`` and ``head = vocab``.

    Raises
    ------
    ValueError
        On an unknown option, an inconsistent one (a ``"token"`` embedding without ``vocab``,
        ``tied`` without a token embedding and ``head = vocab``, blocks of different widths, a bare
        attention layer among the blocks, ``"learned"`` positions without ``n_positions`` or, for
        ``"patch"``, with fewer rows than an image's tokens, a patch that does not divide the image,
        a ``d_in`` other than ``C·patch²``, odd ``d_model`` with ``"sinusoidal"``, a cls token or
        token types without an embedding) or one that has no meaning with the others (``d_in``,
        ``vocab``, ``image``, ``patch`` for another embedding, ``n_positions`` without ``"learned"``,
        ``norm_bias`` or ``rms_offset`` that an RMSNorm / a LayerNorm does not have, ``embed_scale`` without a
        token embedding), each named in the message.
    """

    blocks: tuple = (BlockConfig(),)
    embedding: str = "linear"
    d_in: int | None = None
    vocab: int | None = None
    image: tuple | None = None
    patch: int | None = None
    embed_bias: bool = True
    cls_token: bool = False
    positions: str = "none"
    n_positions: int | None = None
    token_types: int = 0
    embed_norm: bool = False
    final_norm: bool = False
    norm_affine: bool = True
    norm_bias: bool = True
    norm_eps: float = 1e-5
    pool: str = "none"
    head: int | None = None
    head_bias: bool = True
    tied: bool = False
    norm_type: str = "layer"
    rms_offset: float = 0.0
    embed_scale: float = 1.0
    pad_token: int | None = None

    def __post_init__(self) -> None:
        blocks = tuple(self.blocks) if isinstance(self.blocks, (list, tuple)) else (self.blocks,)
        object.__setattr__(self, "blocks", blocks)
        if not blocks or not all(isinstance(b, BlockConfig) for b in blocks):
            raise ValueError(f"ModelConfig.blocks must be a non-empty tuple of BlockConfig, got {self.blocks!r}")
        if any(b.kind != "block" for b in blocks):
            raise ValueError("ModelConfig.blocks must have kind='block' (a bare attention layer is not a stage of a model)")
        if len({b.d_model for b in blocks}) > 1:
            raise ValueError(f"ModelConfig.blocks must share one d_model, got {[b.d_model for b in blocks]}")
        for name, value, options in (("embedding", self.embedding, _EMBEDDINGS), ("positions", self.positions, _POSITIONS),
                                     ("pool", self.pool, _POOLS)):
            if value not in options:
                raise ValueError(f"ModelConfig.{name} must be one of {options}, got {value!r}")
        for flag in ("embed_bias", "cls_token", "embed_norm", "final_norm", "norm_affine", "norm_bias", "head_bias", "tied"):
            check_bool(f"ModelConfig.{flag}", getattr(self, flag))
        object.__setattr__(self, "norm_eps", check_eps("ModelConfig.norm_eps", self.norm_eps))
        object.__setattr__(self, "token_types", check_int("ModelConfig.token_types", self.token_types, 0))
        for name in ("d_in", "vocab", "patch", "n_positions", "head"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_int(f"ModelConfig.{name}", getattr(self, name), 1))
        if self.embedding == "linear" and self.d_in is None:
            raise ValueError("ModelConfig.d_in (the feature width) is needed with embedding='linear'")
        if self.embedding == "token" and self.vocab is None:
            raise ValueError("ModelConfig.vocab is needed with embedding='token'")
        for name, used in (("d_in", ("linear", "patch")), ("vocab", ("token",)), ("image", ("patch",)), ("patch", ("patch",))):
            if getattr(self, name) is not None and self.embedding not in used:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} has no meaning with "
                                 f"embedding={self.embedding!r} (only with {' or '.join(map(repr, used))})")
        if self.embedding == "patch":
            try:
                image = tuple(self.image) if self.image is not None else ()
            except TypeError:
                image = ()
            if len(image) != 3 or self.patch is None:
                raise ValueError(f"ModelConfig.image (C, H, W) and patch are needed with embedding='patch', got "
                                 f"image={self.image!r}, patch={self.patch!r}")
            image = tuple(check_int("ModelConfig.image", v, 1) for v in image)
            object.__setattr__(self, "image", image)
            if image[1] % self.patch or image[2] % self.patch:
                raise ValueError(f"ModelConfig.patch={self.patch} must divide the image size {image[1]}x{image[2]}")
            d_in = image[0] * self.patch ** 2
            if self.d_in is not None and self.d_in != d_in:
                raise ValueError(f"ModelConfig.d_in={self.d_in} contradicts the patches: C·patch² = {d_in} "
                                 "(leave d_in out with embedding='patch')")
            object.__setattr__(self, "d_in", d_in)
        if self.embedding == "none" and (self.cls_token or self.token_types):
            raise ValueError("ModelConfig.cls_token and token_types need an embedding (embedding='none' takes X_0 itself)")
        if self.positions == "learned" and self.n_positions is None:
            raise ValueError("ModelConfig.n_positions (rows of W_P) is needed with positions='learned'")
        if self.positions != "learned" and self.n_positions is not None:
            raise ValueError(f"ModelConfig.n_positions={self.n_positions} has no meaning with positions={self.positions!r} "
                             "(only with 'learned')")
        if self.positions == "learned" and self.embedding == "patch":
            L = (self.image[1] // self.patch) * (self.image[2] // self.patch) + int(self.cls_token)
            if L > self.n_positions:
                raise ValueError(f"ModelConfig.n_positions={self.n_positions} is less than the {L} tokens of an image "
                                 f"(its patches{' and the cls token' if self.cls_token else ''})")
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"ModelConfig.positions='sinusoidal' needs an even d_model, got {self.d_model}")
        if self.pad_token is not None:
            if self.pool != "last" or self.embedding != "token":
                raise ValueError(f"ModelConfig.pad_token={self.pad_token!r} has meaning only with pool='last' and "
                                 f"embedding='token', got pool={self.pool!r}, embedding={self.embedding!r}")
            object.__setattr__(self, "pad_token", check_int("ModelConfig.pad_token", self.pad_token, 0))
        if self.tied:
            if self.embedding != "token" or self.head != self.vocab:
                raise ValueError("ModelConfig.tied needs embedding='token' and head == vocab (z = h W_E^T)")
        if self.norm_type not in _NORM_TYPES:
            raise ValueError(f"ModelConfig.norm_type must be one of {_NORM_TYPES}, got {self.norm_type!r}")
        for name in ("rms_offset", "embed_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"ModelConfig.{name} must be a finite float, got {v!r}")
            object.__setattr__(self, name, float(v))
        has_norm = self.embed_norm or self.final_norm
        if self.norm_type == "rms" and has_norm and self.norm_bias:
            raise ValueError("ModelConfig.norm_bias=True: an RMSNorm (norm_type='rms') has no shift beta; "
                             "set norm_bias=False")
        if self.rms_offset != 0.0 and not (self.norm_type == "rms" and self.norm_affine):
            raise ValueError(f"ModelConfig.rms_offset={self.rms_offset!r} needs norm_type='rms' and norm_affine=True "
                             "(it is added to the RMSNorm scales gamma_E, gamma_F)")
        if self.embed_scale <= 0:
            raise ValueError(f"ModelConfig.embed_scale must be > 0, got {self.embed_scale!r}")
        if self.embed_scale != 1.0 and self.embedding != "token":
            raise ValueError(f"ModelConfig.embed_scale={self.embed_scale!r} scales a token embedding; "
                             f"embedding={self.embedding!r} has none")

    @property
    def d_model(self) -> int:
        """Width of the token rows, shared by every block."""
        return self.blocks[0].d_model

    @property
    def n_layers(self) -> int:
        """Number of blocks ``N``."""
        return len(self.blocks)

    @property
    def n_out(self) -> int:
        """Width of the output: ``head``, or ``d_model`` without a head."""
        return self.head if self.head is not None else self.d_model


def sinusoidal_positions(L: int, d: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """Fixed positions ``(L, d)``: ``P[t, 2i] = sin(t / 10000^{2i/d})``, ``P[t, 2i+1] = cos(·)``
    (computed in float64 on the CPU, then cast)."""
    t = torch.arange(L, dtype=torch.float64)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float64) / d)
    P = torch.zeros(L, d, dtype=torch.float64)
    P[:, 0::2] = torch.sin(t * freq)
    P[:, 1::2] = torch.cos(t * freq[: d // 2])
    return P.to(dtype=dtype, device=device)


def check_window(cfg, L: int) -> None:
    """Refuse a sequence of ``L`` tokens longer than a block's ``sliding_window`` (``cfg`` a
    :class:`BlockConfig` or a :class:`ModelConfig`): up to the window, sliding-window attention is
    plain causal attention; beyond it the band is not in the closed form. Raises
    ``NotImplementedError`` naming the block and the window."""
    blocks = cfg.blocks if isinstance(cfg, ModelConfig) else (cfg,)
    for i, b in enumerate(blocks):
        w = b.sliding_window
        if w is not None and L > w:
            where = f"blocks[{i}]." if isinstance(cfg, ModelConfig) else "cfg."
            raise NotImplementedError(f"a sequence of {L} tokens is longer than {where}sliding_window={w}: beyond the "
                                      f"window the attention is banded, not plain causal, and the closed form takes "
                                      f"sequences of at most {w} tokens")


def block_prefix(i: int) -> str:
    """The prefix of block ``i``'s parameter names in a model: ``"blocks.{i}."``."""
    return f"blocks.{i}."


def model_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a model's parameters in canonical (forward) order (:class:`ModelConfig`)."""
    d = cfg.d_model
    out: dict[str, tuple[int, ...]] = {}
    if cfg.embedding in ("linear", "patch"):
        out["W_E"] = (cfg.d_in, d)
        if cfg.embed_bias:
            out["b_E"] = (d,)
    elif cfg.embedding == "token":
        out["W_E"] = (cfg.vocab, d)
    if cfg.cls_token:
        out["cls"] = (d,)
    if cfg.positions == "learned":
        out["W_P"] = (cfg.n_positions, d)
    if cfg.token_types:
        out["W_T"] = (cfg.token_types, d)
    for suffix, norm in (("E", cfg.embed_norm), ("F", None)):
        if suffix == "F":
            for i, b in enumerate(cfg.blocks):
                out.update({block_prefix(i) + k: v for k, v in param_shapes(b).items()})
            norm = cfg.final_norm
        if norm:
            if cfg.norm_affine:
                out[f"gamma_{suffix}"] = (d,)
            if cfg.norm_bias and cfg.norm_type == "layer":
                out[f"beta_{suffix}"] = (d,)
    if cfg.head is not None and not cfg.tied:
        out["W_H"] = (d, cfg.head)
    if cfg.head is not None and cfg.head_bias:
        out["b_H"] = (cfg.head,)
    return out


def init_model_params(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float64,
                      device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Random parameters of a model, canonical order: block ``i`` from :func:`init_params` with
    seed ``seed + i``; ``W_E`` (``N(0, 1/d_in)``, or ``N(0, 1)`` rows for tokens), ``W_P``, ``W_T``,
    ``cls`` (``N(0, 0.02²)``) and ``W_H`` (``N(0, 1/d_model)``) from a private generator seeded
    ``seed + N``; biases and ``beta`` zero, ``gamma`` one. Raises ``ValueError`` as :func:`init_params`."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"init_params: dtype must be a floating dtype, float32 or float64, got {dtype}")
    seed = check_int("seed", seed, 0)
    gen = torch.Generator().manual_seed(seed + cfg.n_layers)
    params = {}
    for name, shape in model_param_shapes(cfg).items():
        if name.startswith("blocks."):
            continue
        if name == "W_E":
            scale = 1.0 if cfg.embedding == "token" else 1 / math.sqrt(shape[0])
        elif name in ("W_P", "W_T", "cls"):
            scale = 0.02
        elif name == "W_H":
            scale = 1 / math.sqrt(shape[0])
        else:
            scale = None
        if scale is not None:
            w = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
        else:
            w = torch.full(shape, 1.0 - cfg.rms_offset, dtype=torch.float64) if name.startswith("gamma") \
                else torch.zeros(shape, dtype=torch.float64)
        params[name] = w
    for i, b in enumerate(cfg.blocks):
        params.update({block_prefix(i) + k: v for k, v in init_params(b, seed=seed + i).items()})
    return {k: params[k].to(dtype=dtype, device=device) for k in model_param_shapes(cfg)}
