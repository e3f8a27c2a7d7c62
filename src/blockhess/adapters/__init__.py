"""Real modules in, names back: ``from_torch(module)`` reads a PyTorch or Hugging Face Transformer (a
layer, a block or a whole model) in eval mode into ``(cfg, params)`` in this library's conventions,
and ``to_module(H, module)`` (also ``H.to_module(module)``) maps a
:class:`~blockhess.result.HessianBlocks` back to the module's own parameter names and storage layouts.

* :mod:`.pytorch`: ``nn.TransformerEncoderLayer``, ``nn.MultiheadAttention``, ``nn.TransformerEncoder``;
* :mod:`.hf`: ``transformers``' GPT-2, ViT and BERT models and blocks (``transformers`` is optional and
  never imported by blockhess);
* :mod:`.layout`: how a stored tensor holds our parameters (transposed, stacked, reshaped), and the
  two maps built from it.

Nothing in the core imports this package; it registers :func:`to_module` on
:func:`blockhess.result.relabel` and :func:`operator_to_module` on
:func:`blockhess.operators.operator.module_operator` for ``torch.nn.Module``. The mapping table is in docs/models.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..operators.operator import HessianOperator, module_operator
from ..result import HessianBlocks, relabel
from ..validation import FLOAT_DTYPES
from . import hf
from . import pytorch
from . import traced
from .layout import difference, positions, read, shapes_of, structure
from .mode import check_deterministic
from .layout import relabel as relabel_blocks

__all__ = ["from_torch", "to_module", "operator_to_module", "block_input"]


def _describe(module, is_causal: bool = False) -> tuple:
    if hf.reads(module):
        return hf.describe(module)
    if pytorch.reads(module):
        return pytorch.describe(module, is_causal)
    if traced.description(module) is not None:  # read by tracing before (from_torch(module, example_inputs))
        return traced.description(module)
    where = f" ({type(module).__module__})" if hf.is_hf(module) else ""
    raise ValueError(f"from_torch supports {pytorch.SUPPORTED} and {hf.SUPPORTED} by class (any other module of "
                     f"supported parts by tracing: from_torch(module, example_inputs)), got {type(module).__name__}{where}")


def from_torch(module: nn.Module, example_inputs=None, *, src_mask: torch.Tensor | None = None, is_causal: bool = False,
               src_key_padding_mask: torch.Tensor | None = None, dtype: torch.dtype | None = None):
    """``(cfg, params)`` of a PyTorch or Hugging Face Transformer module, in eval mode.

    ``params`` are detached copies in this library's names and layouts (``nn.Linear`` weights
    transposed, ``in_proj_weight`` and GPT-2's ``c_attn`` split into ``W_Q, W_K, W_V``, a patch
    ``Conv2d`` kernel flattened channel-major, ...), canonical order, in ``dtype`` if given, else the
    module's. ``cfg`` is a :class:`~blockhess.config.BlockConfig` for a layer or block, a
    :class:`~blockhess.config.ModelConfig` for a model; ``bh.forward(params, inputs, cfg)`` is then the
    module's output for ``inputs`` as its ``forward`` takes them first (token ids ``(B, L)``, images
    ``(B, C, H, W)``, hidden states ``(B, L, d)``).

    Modules read (docs/models.md; docs/derivations.md §14):

    * ``nn.TransformerEncoderLayer`` (or ``nn.MultiheadAttention``): ``d_model``, ``nhead``,
      ``dim_feedforward``, ``norm_first`` (``norm="pre"``), the activation (``"relu"``/``"gelu"``,
      ``F.relu``/``F.gelu``, ``nn.ReLU()``, ``nn.GELU(approximate=...)``,
      ``functools.partial(F.gelu, approximate=...)``), ``bias``, ``layer_norm_eps``, the LayerNorm
      scales (``ln_affine``); attention always has its output projection, ``d_k = d_model / nhead``.
    * ``nn.TransformerEncoder``: its layers as blocks ``blocks.{i}``, its optional final ``norm`` as
      ``final_norm``; ``embedding="none"`` (inputs are ``X_0``), no pooling, no head.
    * Hugging Face ``GPT2LMHeadModel``, ``GPT2ForSequenceClassification`` (the last token, ``pool="last"``;
      inputs holding its ``pad_token_id`` refused), ``GPT2Model``, ``GPT2Block``, ``ViTForImageClassification``,
      ``ViTModel``, ``ViTLayer``, ``BertModel``, ``BertLayer`` (:mod:`.hf`). GPT-2's blocks are causal
      (called alone with no ``attention_mask``, transformers' eager attention masks nothing, sdpa
      masks causally); BERT's and ViT's are not (BERT with ``is_decoder=True``: causal). Parameters
      that do not affect the output read (BERT's and ``ViTModel``'s pooler, ``ViTModel``'s
      ``mask_token``) are not in ``params``; :func:`to_module` gives them zero blocks.

    * Hugging Face ``LlamaForCausalLM``, ``LlamaModel``, ``LlamaDecoderLayer`` and the same three of Qwen2,
      Mistral and Gemma (:mod:`.hf`): RMSNorm blocks with RoPE, a gated FFN (SwiGLU; Gemma's GeGLU) and
      grouped-query attention, a final RMSNorm, Gemma's scaled embedding and tied head; their inputs
      token ids or ``{"input_ids": ids, "attention_mask": ones}`` (a padded batch is refused at the call).

    For PyTorch's layers and ``nn.TransformerEncoder``, a causal mask (``is_causal=True``, or
    ``src_mask`` equal to ``nn.Transformer.generate_square_subsequent_mask(L)`` or its boolean form)
    gives ``causal=True`` (for the encoder, every block), at whatever length the input has later;
    ``is_causal=True`` alone applies the mask here, whereas PyTorch's layer takes it only as a hint
    about a ``src_mask`` it must also be given. A key padding mask that pads nothing is accepted here,
    one that pads is refused: a batch's padding is not part of the module but of its inputs, passed
    with them (``inputs={"src": X, "src_key_padding_mask": pad}``, ``{"input_ids": ids,
    "attention_mask": mask}``; docs/models.md, "Padded batches"). ``batch_first=False`` only changes the
    input layout (:func:`block_input`).

    Raises ``ValueError`` naming the module and the setting for what the closed form does not cover:
    dropout > 0 in training mode in any submodule, by its qualified name and ``p``, whatever mode the
    module itself is in (:func:`.mode.check_deterministic`: dropout modules, attention dropout
    probabilities such as ``nn.MultiheadAttention.dropout``, ViT's ``attention_dropout``, GPT-2's and
    BERT's attention dropout applied while the attention trains), a custom activation (or one of transformers' other than relu,
    gelu, gelu_new, gelu_pytorch_tanh, silu), a rotary embedding other than the default one (rope variants,
    ``partial_rotary_factor``), a bias pattern the block does not have (Llama's ``attention_bias`` alone), logit
    softcapping, ``kdim``/``vdim`` != ``d_model``, ``add_bias_kv``,
    ``add_zero_attn``, a mask other than the causal one, a key padding mask that pads (and any mask
    argument given for a Hugging Face module, which applies its own), LayerNorms with different eps
    or affine settings within a block, biases on some layers only, cross-attention
    (``add_cross_attention``), relative or rotary positions (BERT's ``position_embedding_type`` other
    than ``"absolute"``), GPT-2's ``scale_attn_weights=False``, ``scale_attn_by_inverse_layer_idx``
    or ``reorder_and_upcast_attn``, an attention implementation other than ``"eager"`` or
    ``"sdpa"``, a module laid out otherwise than the one read (an unknown parameter or attribute),
    any other module; and for ``dtype`` other than ``None``, float32 or float64.

    With ``example_inputs`` (the tensor ``forward`` takes first, or a 1-tuple of it), the module, of any class, is
    read by tracing its forward (:mod:`.traced`; docs/models.md, "Your own model"): the parts the closed form
    covers are recognised node by node, any other node is refused (``ValueError`` naming the node, its operator,
    module and source line), and the config's forward is checked against the module's in float64 before
    returning. The reading is remembered for ``module``, so that :func:`to_module` and
    :func:`operator_to_module` map back to it. The mask arguments do not apply (the traced forward has its own).
    """
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ValueError(f"from_torch: dtype must be float32 or float64, got {dtype}")
    if example_inputs is not None:
        if src_mask is not None or is_causal is not False or src_key_padding_mask is not None:
            raise ValueError("src_mask, is_causal and src_key_padding_mask do not apply with example_inputs: the traced "
                             "forward applies its own mask")
        check_deterministic(module)
        cfg, spec = traced.describe(module, example_inputs)
    elif hf.reads(module):
        if src_mask is not None or is_causal is not False or src_key_padding_mask is not None:
            raise ValueError(f"src_mask, is_causal and src_key_padding_mask apply to PyTorch's layers; "
                             f"{type(module).__name__} applies its own mask (GPT-2's is causal)")
        cfg, spec = hf.describe(module)
    elif pytorch.reads(module):
        causal = pytorch.causal_from_masks(src_mask, is_causal, src_key_padding_mask)
        cfg, spec = pytorch.describe(module, causal)
    else:
        cfg, spec = _describe(module)  # raises: a module no reader takes
    check_deterministic(module)  # every reader's: no submodule whose forward is random
    return cfg, read(module, cfg, spec, dtype)


def to_module(H: HessianBlocks, module: nn.Module) -> HessianBlocks:
    """``H`` re-keyed by ``module``'s parameter names, each in its storage layout.

    Returns a :class:`~blockhess.result.HessianBlocks` whose ``names`` are the module's parameter
    names (``named_parameters`` order: a tied tensor, GPT-2's ``wte``/``lm_head``, once, its block
    holding both uses) that ``H`` covers, with their shapes (``self_attn.in_proj_weight`` ``(3d, d)``,
    ``linear1.weight`` ``(d_ff, d)``, GPT-2's ``c_attn.weight`` ``(d, 3d)`` as stored, ViT's patch
    kernel ``(d, C, p, p)``, ``cls_token`` ``(1, 1, d)``, ``position_embeddings`` ``(1, n+1, d)``, BERT's
    full ``token_type_embeddings`` table, whose rows past 0 have zero blocks), so ``Hm[a, b]`` is
    ``(numel_a, numel_b)`` in row-major order of the stored tensors and ``Hm.dense()`` is the Hessian
    of the loss through ``torch.func.functional_call(module, ...)``, flattened. ``.outer`` and
    ``.functional`` map likewise; the input block ``"X"`` (``wrt_input``) is left out. A parameter
    the model read does not use (BERT's pooler) appears, with zero blocks, when ``H`` covers every
    parameter of the model; a Hessian over a subset (``wrt=``) gives the module parameters it covers.
    (Autograd through the module itself needs ``sdpa_kernel(SDPBackend.MATH)``: the fused kernels have
    no second derivative; use ``torch.autograd.functional.hessian``: ``torch.func.hessian`` is wrong
    through ``F.layer_norm`` with a weight in torch 2.13, docs/derivations.md §9.)

    Raises ``ValueError`` if ``H`` is of another architecture than ``module`` (``H.cfg``, when it has
    one, against :func:`from_torch`'s reading of ``module``; the mask and dropout aside), covers
    none of its parameters, or covers a stored tensor only in part (``in_proj_weight`` and
    ``c_attn`` hold ``W_Q, W_K, W_V``: compute the Hessian with all three in ``wrt``); the errors of
    :func:`from_torch` for a module it cannot read.
    """
    cfg, spec = _describe(module)
    return relabel_blocks(H, module, cfg, spec)


def operator_to_module(A: HessianOperator, module: nn.Module) -> HessianOperator:
    r"""The operator ``A`` in ``module``'s own parameters (also ``A.to_module(module)``): the
    :class:`~blockhess.operators.HessianOperator` :math:`P^\top A P` over ``module.named_parameters()``
    (that order, which is ``module.parameters()``'s; a tied tensor, GPT-2's ``wte``/``lm_head``, once),
    each in its stored shape (``nn.Linear``'s ``(out, in)``, GPT-2's fused ``c_attn`` ``(d, 3d)``,
    ``in_proj_weight`` ``(3d, d)``, ViT's patch kernel ``(d, C, p, p)``), where :math:`P` is the permutation
    of :func:`.layout.positions` (a gather of entries by index, no matrix).

    So ``M = A.to_module(model)`` takes what autograd and laplace-torch give: ``M @ [t_1, ..., t_P]``
    for tensors shaped like ``list(model.parameters())``, each with an optional trailing ``k`` (a list
    back), and ``M @ v`` for ``v`` ``(m,)`` or ``(m, k)`` in ``torch.nn.utils.parameters_to_vector``'s
    order (a tensor back); ``M[a, b]`` by module names, ``M.dense()``, ``M.to_scipy()``, the estimators
    and :func:`~blockhess.operators.solve` as on ``A``. A parameter our model does not use (BERT's and
    ``ViTModel``'s pooler, ``ViTModel``'s ``mask_token``) has exact zero rows and columns, present when
    ``A`` covers every parameter of the model. dtype, device, ``count`` and ``max_columns`` of ``A``
    (inputs must have ``A``'s dtype, not necessarily the module's); the diagonal, where ``A`` has one,
    is ``A``'s permuted. Each product multiplies ``A``'s engine once, on only the parameters the
    columns touch and for only the rows wanted.

    Views: ``A`` may be the operator or a square view ``A[names, names]`` of whole parameters; its
    module operator covers the module parameters whose stored tensors the view covers (as a Hessian
    over ``wrt=names``). Refused (``ValueError``, before any product): an off-diagonal view (take the
    view of the module operator instead, ``A.to_module(model)[a, b]``), a view over a head ``W_Q#h``
    (a head is part of a stored tensor), a view that covers a stored tensor only in part (``c_attn``
    holds ``W_Q, W_K, W_V``), an ``A`` of another architecture than ``module`` (``A.cfg`` against
    :func:`from_torch`'s reading, the mask aside), a parameter or shape of ``A`` the module does not
    have, and the errors of :func:`from_torch` for a module it cannot read.
    """
    if not isinstance(A, HessianOperator):
        raise ValueError(f"operator_to_module maps a HessianOperator, got {type(A).__name__}")
    cfg, spec = _describe(module)
    what = type(module).__name__
    if not A.is_square_view:
        raise ValueError(f"to_module maps the operator or a square view A[names, names]; this is the off-diagonal "
                         f"view with rows {list(A.names)} and columns {list(A.in_names)}: take the view of the "
                         "module operator instead, A.to_module(model)[a, b]")
    heads = [v for v in A.names if A._vars[v][0] != v]
    if heads:
        raise ValueError(f"to_module maps views of whole parameters; {heads} are heads, parts of a stored tensor: "
                         "take a view of the module operator's stored tensor instead")
    if A.cfg is not None and structure(A.cfg) != structure(cfg):
        raise ValueError(f"A is the Hessian operator of another architecture than module {what} (A's vs the module's: "
                         f"{difference(A.cfg, cfg)}): its products would not be this module's")
    ours = shapes_of(cfg)
    wrong = [v for v in A.names if tuple(ours.get(v, ())) != A.param_shapes[v] or v not in ours]
    if wrong:
        raise ValueError(f"A's parameters {[(v, A.param_shapes[v]) for v in wrong]} are not parameters of {what} "
                         f"as from_torch reads it ({cfg})")
    shapes = {v: A.param_shapes[v] for v in A.names}
    names, stored, perm = positions(module, cfg, spec, shapes, what="this operator")
    # every entry of ours lies in exactly one stored tensor (positions: a permutation): its index there
    sizes = {a: math.prod(stored[a]) for a in names}
    numel = {v: math.prod(shapes[v]) for v in A.names}
    n = sum(numel.values())
    where = torch.full((n,), -1, dtype=torch.long)  # entry of ours -> its index within its stored tensor
    tensor_of = torch.full((n,), -1, dtype=torch.long)  # entry of ours -> its stored tensor, by position in names
    off = 0
    for i, a in enumerate(names):
        p = perm[off:off + sizes[a]]
        off += sizes[a]
        used = p >= 0
        where[p[used]] = torch.arange(sizes[a])[used]
        tensor_of[p[used]] = i
    if bool((where < 0).any()):  # cannot happen for parameters of cfg: each is held by a stored tensor
        raise ValueError(f"the module {what} holds only part of A's parameters {list(A.names)}")
    owner, local, holds, o = {}, {}, {a: [] for a in names}, 0
    for v in A.names:
        owner[v] = names[int(tensor_of[o])]
        holds[owner[v]].append(v)
        local[v] = where[o:o + numel[v]].to(A.device)
        o += numel[v]
    engine, dtype, device = A._product, A.dtype, A.device

    def product(V, wanted_out):
        k = next(iter(V.values())).shape[0]
        cols = {v: V[owner[v]].reshape(k, -1).index_select(1, local[v]).reshape(k, *shapes[v])
                for v in A.names if owner[v] in V}
        rows = tuple(v for a in wanted_out for v in holds[a])
        out = {}
        Y = engine(cols, rows) if cols and rows else {}
        for a in wanted_out:
            y = torch.zeros(k, sizes[a], dtype=dtype, device=device)
            for v in holds[a]:
                if cols:
                    y.index_copy_(1, local[v], Y[v].reshape(k, -1))
            out[a] = y.reshape(k, *stored[a])
        return out

    diagonal = None
    if A._diagonal is not None:
        def diagonal(wanted):
            d = A._diagonal(tuple(v for a in wanted for v in holds[a]))
            out = {}
            for a in wanted:
                y = torch.zeros(sizes[a], dtype=dtype, device=device)
                for v in holds[a]:
                    y.index_copy_(0, local[v], d[v].reshape(-1))
                out[a] = y.reshape(stored[a])
            return out

    return HessianOperator(product, names, stored, dtype, device, diagonal=diagonal, count=A.count,
                           max_columns=A.max_columns)


def block_input(module: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """A block's (or an ``nn.TransformerEncoder``'s) input ``X`` in the product's layout ``(B, L, d)``
    (or ``(L, d)`` unbatched): ``(L, B, d)`` is transposed for ``batch_first=False`` (a view, same
    dtype and device); Hugging Face's blocks are batch-first (``X`` itself).

    Raises ``ValueError`` for a module that is not one of ``nn.TransformerEncoderLayer``,
    ``nn.MultiheadAttention``, ``nn.TransformerEncoder``, ``GPT2Block``, ``ViTLayer``, ``BertLayer``, a Llama-family
    decoder layer (:data:`.hf.BLOCKS`).
    """
    if hf.is_hf(module) and type(module).__name__ in hf.BLOCKS:
        return X
    return pytorch.block_input(module, X)


@relabel.register(nn.Module)
def _relabel_module(module: nn.Module, H: HessianBlocks) -> HessianBlocks:
    return to_module(H, module)


@module_operator.register(nn.Module)
def _module_operator(module: nn.Module, A: HessianOperator) -> HessianOperator:
    return operator_to_module(A, module)
