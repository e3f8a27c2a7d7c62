"""The one mode check every reader makes (:func:`blockhess.adapters.from_torch`, PyTorch's and Hugging
Face's, whole models and single layers or blocks alike): no submodule whose forward is random.

The closed form is the Hessian of the module's deterministic function; dropout with ``p > 0`` in
training mode makes the forward random, and its Hessian would be that of the dropout-free function
without a word. A module's ``training`` flag is its own (``model.eval()`` then ``layer.dropout1.train()``
leaves that one child random), so every submodule is looked at, not the module read:

* a dropout module (``nn.Dropout``, ``nn.Dropout1d/2d/3d``, ``nn.AlphaDropout``,
  ``nn.FeatureAlphaDropout``) in training mode with ``p > 0``;
* a module in training mode with a float dropout probability its forward hands to an attention
  function while it trains (:data:`FLOAT_ATTRS`: ``nn.MultiheadAttention.dropout``, ViT's
  ``attention_dropout``, the ``dropout`` floats of transformers' newer attentions);
* a module in training mode whose forward reads a child dropout's ``p`` under its *own* flag
  (:data:`PARENT_FLAG`: GPT-2's ``attn.attn_dropout.p``, BERT's ``attention.self.dropout.p`` go to the
  attention kernel as ``dropout=p if self.training``), even where that child is in eval mode.

``p = 0`` in training mode is deterministic and accepted.
"""

from __future__ import annotations

import numbers

import torch.nn as nn

__all__ = ["random_parts", "check_deterministic", "DROPOUTS", "FLOAT_ATTRS", "PARENT_FLAG"]

#: The dropout modules: random in training mode with ``p > 0``.
DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
#: Float attributes a module's forward uses as a dropout probability while it trains.
FLOAT_ATTRS = ("dropout", "attention_dropout", "attn_dropout", "dropout_prob", "dropout_p")
#: transformers classes whose forward applies a child dropout's ``p`` under the parent's ``training``
#: (``dropout=self.<child>.p if self.training``): class name -> those children.
PARENT_FLAG = {"GPT2Attention": ("attn_dropout",), "BertSelfAttention": ("dropout",),
               "BertCrossAttention": ("dropout",)}


def _positive(p) -> bool:
    return isinstance(p, numbers.Real) and not isinstance(p, bool) and p > 0


def random_parts(module: nn.Module) -> dict[str, float]:
    """Every random part of ``module``'s forward: ``{qualified name: p}`` in ``named_modules`` order,
    the name that of the probability (``dropout1.p``, ``self_attn.dropout``,
    ``layers.0.attention.attention_dropout``, ``h.0.attn.attn_dropout.p``); empty when its forward is
    deterministic."""
    found: dict[str, float] = {}
    for sub, m in module.named_modules():
        q = f"{sub}." if sub else ""
        if isinstance(m, DROPOUTS):
            if m.training and _positive(m.p):
                found[f"{q}p"] = float(m.p)
            continue
        if not m.training:
            continue
        for attr in FLOAT_ATTRS:
            p = m.__dict__.get(attr)  # a plain attribute (a child module of that name is in _modules)
            if _positive(p):
                found[f"{q}{attr}"] = float(p)
        if type(m).__module__.startswith("transformers."):
            for child in PARENT_FLAG.get(type(m).__name__, ()):
                c = getattr(m, child, None)
                if isinstance(c, DROPOUTS) and _positive(c.p):
                    found.setdefault(f"{q}{child}.p", float(c.p))
    return found


def check_deterministic(module: nn.Module) -> None:
    """Refuse ``module`` if its forward is random (:func:`random_parts`): ``ValueError`` naming the
    module's class, the first random part's qualified name and ``p``, and the others."""
    found = random_parts(module)
    if not found:
        return
    (name, p), *rest = found.items()
    also = f" (also {', '.join(f'{k}={v}' for k, v in rest)})" if rest else ""
    raise ValueError(f"{type(module).__name__}: dropout {name}={p} in training mode is not supported{also}: dropout "
                     "makes the forward random, and the closed form is the Hessian of the dropout-free function; call "
                     "module.eval() (it sets every submodule) or set the dropout to 0")
