"""Every reader refuses a module whose forward is random (issue 26; blockhess.adapters.mode): any
submodule in training mode with dropout ``p > 0``, named by its qualified name and ``p``, whatever mode
the module read is in: PyTorch's layer, bare attention and encoder, GPT-2, ViT and BERT models and
their single blocks. Each refused set-up is first shown to be random (two calls of the module's own
forward, gradients on as when it is differentiated, differ), each accepted one (``p = 0`` in training
mode, everything in eval) deterministic and read.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import blockhess as bh

DT = torch.float64
B, L = 2, 5


def _out(y) -> torch.Tensor:
    return y if isinstance(y, torch.Tensor) else y[0]  # a tuple or a transformers ModelOutput


def forward_twice(module: nn.Module, x) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's output for ``x`` twice, other seeds, gradients on (PyTorch's layers take an
    inference fast path, which skips dropout, only without them)."""
    outs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        outs.append(_out(module(x)).detach())
    return outs[0], outs[1]


def assert_refused_and_random(module: nn.Module, x, name: str, p: float) -> None:
    a, b = forward_twice(module, x)
    assert not torch.equal(a, b), "the set-up refused must be random"
    with pytest.raises(ValueError, match=rf"{type(module).__name__}: dropout {re.escape(name)}={p} in training mode is "
                                         "not supported"):
        bh.from_torch(module)


def assert_accepted_and_deterministic(module: nn.Module, x) -> None:
    a, b = forward_twice(module, x)
    assert torch.equal(a, b)
    bh.from_torch(module)


# ---------------------------------------------------------------------------------------------- PyTorch

def _layer(p: float = 0.1) -> nn.TransformerEncoderLayer:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(8, 2, 12, dropout=p, batch_first=True, dtype=DT).eval()


def _encoder(p: float = 0.1) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 12, dropout=p, batch_first=True, dtype=DT), 2,
                                 enable_nested_tensor=False).eval()


def _train(module: nn.Module, path: str) -> nn.Module:
    module.get_submodule(path).train()
    return module


def _swap(module: nn.Module, path: str, new: nn.Module) -> nn.Module:
    parent, _, child = path.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, child, new)
    return module


X = torch.randn(B, L, 8, generator=torch.Generator().manual_seed(1), dtype=DT)

TORCH_REFUSED = {  # the module (in eval but the part named), its random part's name and p
    "layer: dropout1 in train": (lambda: _train(_layer(), "dropout1"), "dropout1.p", 0.1),
    "layer: the FFN's dropout in train": (lambda: _train(_layer(), "dropout"), "dropout.p", 0.1),
    "layer: self_attn in train": (lambda: _train(_layer(), "self_attn"), "self_attn.dropout", 0.1),
    "layer: an AlphaDropout child in train": (lambda: _swap(_layer(0.0), "dropout2", nn.AlphaDropout(0.3).train()),
                                              "dropout2.p", 0.3),
    "layer in train": (lambda: _layer().train(), "self_attn.dropout", 0.1),
    "encoder: one layer's dropout1 in train": (lambda: _train(_encoder(), "layers.1.dropout1"), "layers.1.dropout1.p", 0.1),
    "encoder: one layer's self_attn in train": (lambda: _train(_encoder(), "layers.0.self_attn"),
                                                "layers.0.self_attn.dropout", 0.1),
    "encoder: a layer in train": (lambda: _train(_encoder(), "layers.1"), "layers.1.self_attn.dropout", 0.1),
}


@pytest.mark.parametrize("case", list(TORCH_REFUSED))
def test_pytorch_random_submodule_is_refused_by_name(case):
    make, name, p = TORCH_REFUSED[case]
    assert_refused_and_random(make(), X, name, p)


def test_pytorch_bare_attention_in_train_is_refused():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, dropout=0.2, batch_first=True, dtype=DT).train()
    a, b = (mha(X, X, X, need_weights=False)[0].detach() for _ in range(2))
    assert not torch.equal(a, b)
    with pytest.raises(ValueError, match=r"MultiheadAttention: dropout dropout=0.2 in training mode is not supported"):
        bh.from_torch(mha)
    assert bh.from_torch(nn.MultiheadAttention(8, 2, dropout=0.0, dtype=DT).train())[0].kind == "attention"


def test_every_random_part_is_listed():
    with pytest.raises(ValueError, match=r"dropout layers.0.self_attn.dropout=0.1 in training mode is not supported "
                                         r"\(also layers.0.dropout.p=0.1, layers.0.dropout1.p=0.1, .*layers.1.dropout2.p=0.1\)"):
        bh.from_torch(_encoder().train())


@pytest.mark.parametrize("make", [lambda: _layer(0.0).train(), lambda: _encoder(0.0).train(),
                                  lambda: _train(_encoder(0.0), "layers.0.dropout1"), lambda: _encoder(0.1)],
                         ids=["layer p=0 in train", "encoder p=0 in train", "encoder p=0, a child in train", "eval"])
def test_pytorch_deterministic_is_accepted(make):
    assert_accepted_and_deterministic(make(), X)


# ---------------------------------------------------------------------------------------------- Hugging Face

tf = pytest.importorskip("transformers")
from test_adapters_models import bert_config, gpt2_config, vit_config  # noqa: E402


def _gpt2(**kw):
    torch.manual_seed(0)
    return tf.GPT2Model(gpt2_config(n_layer=1, **kw)).double().eval()


def _vit(cls=None, **kw):
    torch.manual_seed(0)
    return (cls or tf.ViTModel)(vit_config(**{"num_hidden_layers": 1, "attention_probs_dropout_prob": 0.2, **kw})
                                ).double().eval()


def _bert(**kw):
    torch.manual_seed(0)
    return tf.BertModel(bert_config(**{"num_hidden_layers": 1, "attention_probs_dropout_prob": 0.2, **kw})).double().eval()


def _children_eval(module: nn.Module, path: str) -> nn.Module:
    """``path`` in training mode, its children in eval: the attention's own flag alone."""
    sub = module.get_submodule(path).train()
    for c in sub.children():
        c.eval()
    return module


IDS = torch.randint(0, 32, (B, L), generator=torch.Generator().manual_seed(2))
IMAGES = torch.randn(B, 3, 8, 8, generator=torch.Generator().manual_seed(3), dtype=DT)
H16 = torch.randn(B, L, 16, generator=torch.Generator().manual_seed(4), dtype=DT)

HF_REFUSED = {  # the module, its input, the random part's name and p
    # GPT-2's attention hands attn_dropout.p to the kernel while it (not its child) trains
    "GPT2Model: attn in train, its children in eval": (lambda: _children_eval(_gpt2(), "h.0.attn"), IDS,
                                                       "h.0.attn.attn_dropout.p", 0.1),
    "GPT2Model: the MLP's dropout in train": (lambda: _train(_gpt2(), "h.0.mlp.dropout"), IDS, "h.0.mlp.dropout.p", 0.1),
    "GPT2Model: the embedding dropout in train": (lambda: _train(_gpt2(), "drop"), IDS, "drop.p", 0.1),
    "GPT2Block: attn in train, its children in eval": (lambda: _children_eval(_gpt2(), "h.0.attn").h[0], H16,
                                                       "attn.attn_dropout.p", 0.1),
    "GPT2LMHeadModel: attn in train": (lambda: _children_eval(tf.GPT2LMHeadModel(gpt2_config(n_layer=1)).double().eval(),
                                                              "transformer.h.0.attn"), IDS,
                                       "transformer.h.0.attn.attn_dropout.p", 0.1),
    "ViTModel: attention in train": (lambda: _train(_vit(), "layers.0.attention"), IMAGES,
                                     "layers.0.attention.attention_dropout", 0.2),
    "ViTLayer: attention in train": (lambda: _train(_vit(), "layers.0.attention").layers[0], H16,
                                     "attention.attention_dropout", 0.2),
    "ViTForImageClassification: the embedding dropout in train": (
        lambda: _train(_vit(tf.ViTForImageClassification, hidden_dropout_prob=0.1), "vit.embeddings.dropout"), IMAGES,
        "vit.embeddings.dropout.p", 0.1),
    # BERT's self-attention hands its dropout.p to the kernel while it (not its child) trains
    "BertModel: self-attention in train, its dropout in eval": (
        lambda: _children_eval(_bert(), "encoder.layer.0.attention.self"), IDS,
        "encoder.layer.0.attention.self.dropout.p", 0.2),
    "BertModel: an output dropout in train": (lambda: _train(_bert(), "encoder.layer.0.output.dropout"), IDS,
                                              "encoder.layer.0.output.dropout.p", 0.1),
    "BertLayer: self-attention in train, its dropout in eval": (
        lambda: _children_eval(_bert(), "encoder.layer.0.attention.self").encoder.layer[0], H16,
        "attention.self.dropout.p", 0.2),
}


@pytest.mark.parametrize("case", list(HF_REFUSED))
def test_hugging_face_random_submodule_is_refused_by_name(case):
    make, x, name, p = HF_REFUSED[case]
    assert_refused_and_random(make(), x, name, p)


HF_ACCEPTED = {
    "GPT2Model p=0 in train": (lambda: _gpt2(embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0).train(), IDS),
    "GPT2Block: attn in train, p=0": (lambda: _train(_gpt2(attn_pdrop=0.0, resid_pdrop=0.0), "h.0.attn").h[0], H16),
    "ViTModel p=0 in train": (lambda: _vit(attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0).train(), IMAGES),
    "BertModel p=0 in train": (lambda: _bert(attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0).train(), IDS),
    "BertLayer eval": (lambda: _bert().encoder.layer[0], H16),
}


@pytest.mark.parametrize("case", list(HF_ACCEPTED))
def test_hugging_face_deterministic_is_accepted(case):
    make, x = HF_ACCEPTED[case]
    assert_accepted_and_deterministic(make(), x)
