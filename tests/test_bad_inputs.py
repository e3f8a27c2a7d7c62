"""The bad-input table of docs/bad_inputs.md: every row is a case here, and the page is
rendered from these rows (``python tests/test_bad_inputs.py > docs/bad_inputs.md``), so the
page and the tests cannot drift apart."""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Callable

import pytest
import torch

import blockhess as bh
from blockhess.layers import layernorm, softmax

DT = torch.float64
PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "bad_inputs.md"


@dataclasses.dataclass(frozen=True)
class Case:
    """A small post-LN block (d_model 4, d_ff 5) and a batch of 2 sequences of 3 tokens."""

    cfg: bh.BlockConfig
    p: dict
    X: torch.Tensor
    T: torch.Tensor


def make() -> Case:
    cfg = bh.BlockConfig(d_model=4, d_ff=5)
    g = torch.Generator().manual_seed(3)
    return Case(cfg, bh.init_params(cfg, seed=0), torch.randn(2, 3, 4, generator=g, dtype=DT),
                torch.randn(2, 3, 4, generator=g, dtype=DT))


def nan_at(X: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    X = X.clone()
    X.view(-1)[5] = value
    return X


def const_row(X: torch.Tensor) -> torch.Tensor:
    """``X`` with its first token a constant row (zero LayerNorm variance for a pre-LN block's LN_1)."""
    X = X.clone()
    X[..., 0, :] = 0.5
    return X


PRE = bh.BlockConfig(d_model=4, d_ff=5, norm="pre")


def pre(c: Case) -> dict:
    return bh.init_params(PRE, seed=0)


# models of that block: token ids with a cls token, 4 learned positions and the cls token into a
# 3-class head (2 blocks); 4x4 one-channel images in 2x2 patches, mean-pooled into a 3-wide head;
# features of width 3 per token into a 2-wide head
_BLOCK = bh.BlockConfig(d_model=4, d_ff=5)
TOKENS = bh.ModelConfig(blocks=(_BLOCK, _BLOCK), embedding="token", vocab=5, cls_token=True, positions="learned",
                        n_positions=4, pool="first", head=3)
IMAGES = bh.ModelConfig(blocks=(_BLOCK,), embedding="patch", image=(1, 4, 4), patch=2, pool="mean", head=3)
LAST = bh.ModelConfig(blocks=(_BLOCK,), embedding="token", vocab=5, pool="last", head=3, pad_token=4)  # GPT-2's classifier
FEATURES = bh.ModelConfig(blocks=(_BLOCK,), embedding="linear", d_in=3, head=2)
IDS = torch.tensor([[1, 2, 3], [0, 4, 2]])  # 2 sequences of 3 tokens
CLASSES = torch.tensor([0, 2])


# a padded batch's model: token ids, a causal block, 4 learned positions, 2 token types, a 3-class head per token
PADDED = bh.ModelConfig(blocks=(bh.BlockConfig(d_model=4, d_ff=5, causal=True),), embedding="token", vocab=5,
                        positions="learned", n_positions=4, token_types=2, head=3)
LEFT = torch.tensor([[0, 1, 1], [1, 1, 1]])  # the first sequence left-padded
LABELS = torch.tensor([[-100, 1, 2], [0, 2, 1]])


def padded(target=LABELS, **inputs):
    """The padded model's CE Hessian on ``{"input_ids": IDS, "attention_mask": LEFT, **inputs}`` (``None``: dropped)."""
    inputs = {k: v for k, v in {"input_ids": IDS, "attention_mask": LEFT, **inputs}.items() if v is not None}
    return bh.hessian(weights(PADDED), inputs, PADDED, loss="ce", target=target)


def weights(cfg: bh.ModelConfig, **changed) -> dict:
    """The model's parameters (seed 0), with ``changed`` ones."""
    return {**bh.init_params(cfg, seed=0), **changed}


def tokens(ids=IDS, target=CLASSES, **kw):
    return bh.hessian(weights(TOKENS), ids, TOKENS, loss="ce", target=target, **kw)


def features(X: torch.Tensor, loss="mse", target=None):
    """The feature model's Hessian on the first 3 features of ``X``."""
    return bh.hessian(weights(FEATURES), X[..., :3], FEATURES, loss=loss, target=target)


def model_config(**options):
    return bh.ModelConfig(**{"blocks": (_BLOCK,), **options})


@dataclasses.dataclass(frozen=True)
class Row:
    entry: str  # the public entry point
    kind: str  # the kind of bad input (the page's sections)
    given: str  # what is wrong, in words
    call: Callable[[Case], object]
    error: type
    says: str  # a part of the message


ROWS = [
    # shapes
    Row("bh.hessian", "shape", "X of another width than d_model", lambda c: bh.hessian(c.p, c.X[..., :3], c.cfg, target=c.T),
        ValueError, "X must have shape (L, 4) or (B, L, 4)"),
    Row("bh.forward", "shape", "X with 4 dimensions", lambda c: bh.forward(c.p, c.X[None], c.cfg),
        ValueError, "X must have 2 or 3 dimensions"),
    Row("bh.jacobian", "shape", "an empty sequence (L = 0)", lambda c: bh.jacobian(c.p, c.X[:, :0], c.cfg),
        ValueError, "with L >= 1 and B >= 1"),
    Row("bh.hessian", "shape", "a weight of the wrong shape", lambda c: bh.hessian({**c.p, "W_Q": c.p["W_Q"][:, :3]}, c.X, c.cfg, target=c.T),
        ValueError, "params['W_Q'] must have shape (4, 4)"),
    Row("bh.hessian", "shape", "a weight missing", lambda c: bh.hessian({k: v for k, v in c.p.items() if k != "W_2"}, c.X, c.cfg,
                                                                        target=c.T),
        ValueError, "missing ['W_2']"),
    Row("bh.reference.hessian", "shape", "X of another width than d_model",
        lambda c: bh.reference.hessian(c.p, c.X[..., :3], c.cfg, target=c.T), ValueError, "X must have shape (L, 4)"),
    Row("bh.second_derivative", "shape", "a batch where one sequence is needed",
        lambda c: bh.second_derivative(c.p, c.X, c.cfg, "W_Q", "W_K"), ValueError, "X must be one sequence"),
    Row("bh.layernorm.jacobian", "shape", "gamma of the wrong length",
        lambda c: layernorm.jacobian(c.X[0], gamma=torch.ones(3, dtype=DT)), ValueError, "gamma must have shape (4,)"),
    Row("bh.hessian", "shape", "out= of the wrong shape",
        lambda c: bh.hessian(c.p, c.X, c.cfg, target=c.T, out=torch.empty(3, 3, dtype=DT)),
        ValueError, "out must be a contiguous (88, 88) tensor"),
    # dtypes
    Row("bh.forward", "dtype", "integer X", lambda c: bh.forward(c.p, c.X.long(), c.cfg),
        ValueError, "X must be float32 or float64, got torch.int64"),
    Row("bh.hessian", "dtype", "float16 X and weights",
        lambda c: bh.hessian({k: v.half() for k, v in c.p.items()}, c.X.half(), c.cfg, target=c.T.half()),
        ValueError, "X must be float32 or float64, got torch.float16"),
    Row("bh.jacobian", "dtype", "a weight in float32 beside float64 X",
        lambda c: bh.jacobian({**c.p, "W_1": c.p["W_1"].float()}, c.X, c.cfg),
        ValueError, "params['W_1'] has dtype torch.float32 but X has torch.float64"),
    Row("bh.hessian", "dtype", "an MSE target in float32 beside float64 X",
        lambda c: bh.hessian(c.p, c.X, c.cfg, target=c.T.float()), ValueError, "target has dtype torch.float32"),
    Row("bh.init_params", "dtype", "bfloat16", lambda c: bh.init_params(c.cfg, dtype=torch.bfloat16),
        ValueError, "dtype must be a floating dtype, float32 or float64"),
    # devices (the meta device stands for a second device on a machine without a GPU)
    Row("bh.forward", "device", "X on another device than the weights", lambda c: bh.forward(c.p, c.X.to("meta"), c.cfg),
        ValueError, "params['W_Q'] is on cpu but X is on meta"),
    Row("bh.hessian", "device", "the weights on another device than X",
        lambda c: bh.hessian({k: v.to("meta") for k, v in c.p.items()}, c.X, c.cfg, target=c.T),
        ValueError, "params['W_Q'] is on meta but X is on cpu"),
    # NaN and Inf
    Row("bh.hessian", "NaN/Inf", "a NaN in X", lambda c: bh.hessian(c.p, nan_at(c.X), c.cfg, target=c.T),
        ValueError, "X contains NaN or Inf"),
    Row("bh.hessian", "NaN/Inf", "an Inf in a weight",
        lambda c: bh.hessian({**c.p, "W_V": nan_at(c.p["W_V"], float("inf"))}, c.X, c.cfg, target=c.T),
        ValueError, "params['W_V'] contains NaN or Inf"),
    Row("bh.hessian", "NaN/Inf", "a NaN in the MSE target", lambda c: bh.hessian(c.p, c.X, c.cfg, target=nan_at(c.T)),
        ValueError, "target contains NaN or Inf"),
    Row("bh.hessian", "NaN/Inf", "finite inputs whose forward pass overflows float32",
        lambda c: bh.hessian({k: v.float() for k, v in c.p.items()}, c.X.float() * 1e30, c.cfg, target=c.T.float()),
        ValueError, "overflow"),
    Row("bh.hessian", "NaN/Inf", "a callable loss with a NaN value",
        lambda c: bh.hessian(c.p, c.X, c.cfg, loss=lambda Z, t: Z.sum() * float("nan")),
        ValueError, "loss has a NaN or Inf value, gradient or Hessian w.r.t. Z at sequence 0"),
    Row("A @ V (bh.hessian_operator)", "NaN/Inf", "an Inf in V",
        lambda c: bh.hessian_operator(c.p, c.X, c.cfg, target=c.T) @ nan_at(torch.zeros(sum(v.numel() for v in c.p.values()),
                                                                                      dtype=c.X.dtype), float("inf")),
        ValueError, "V contains NaN or Inf (in the entries of 'W_Q')"),
    Row("bh.input_jacobian", "NaN/Inf", "a NaN in X", lambda c: bh.input_jacobian(c.p, nan_at(c.X[0]), c.cfg),
        ValueError, "X contains NaN or Inf"),
    Row("bh.reference.hessian", "NaN/Inf", "a NaN in X", lambda c: bh.reference.hessian(c.p, nan_at(c.X), c.cfg, target=c.T),
        ValueError, "X contains NaN or Inf"),
    Row("bh.softmax.jacobian", "NaN/Inf", "a NaN in the probabilities", lambda c: softmax.jacobian(nan_at(c.X[0])),
        ValueError, "A contains NaN or Inf"),
    Row("bh.bounds.block_bounds", "NaN/Inf", "a NaN in X", lambda c: bh.bounds.block_bounds(c.p, nan_at(c.X), c.cfg, "mse", c.T),
        ValueError, "X contains NaN or Inf"),
    Row("bh.convergence.per_sample_statistics", "NaN/Inf", "a NaN in X",
        lambda c: bh.convergence.per_sample_statistics(c.p, nan_at(c.X), c.cfg, "mse", c.T), ValueError, "X contains NaN or Inf"),
    # degenerate LayerNorm rows
    Row("bh.hessian", "LayerNorm row", "a constant row into a pre-LN block's LN_1 with ln_eps = 0",
        lambda c: bh.hessian(pre(c), const_row(c.X), PRE, target=c.T), ValueError,
        "LayerNorm input row (0, 0) has zero variance and ln_eps=0"),
    Row("bh.layernorm.jacobian", "LayerNorm row", "a constant row with eps = 0",
        lambda c: layernorm.jacobian(const_row(c.X[0])), ValueError, "LayerNorm input row (0,) has zero variance"),
    Row("bh.hessian", "LayerNorm row", "a row whose variance underflows float64 (entries near 1e-160), ln_eps = 0",
        lambda c: bh.hessian(pre(c), c.X * 1e-160, PRE, target=c.T), ValueError, "below"),
    Row("bh.hessian", "LayerNorm row", "a row whose variance overflows float64 (entries near 1e160)",
        lambda c: bh.hessian(pre(c), c.X * 1e160, PRE, target=c.T), ValueError, "overflows torch.float64"),
    # eps
    Row("bh.BlockConfig", "eps", "a negative ln_eps", lambda c: bh.BlockConfig(d_model=4, ln_eps=-1e-5),
        ValueError, "BlockConfig.ln_eps must be a finite float >= 0"),
    Row("bh.BlockConfig", "eps", "an infinite ln_eps", lambda c: bh.BlockConfig(d_model=4, ln_eps=float("inf")),
        ValueError, "BlockConfig.ln_eps must be a finite float >= 0"),
    Row("bh.layernorm.hessian", "eps", "a NaN eps", lambda c: layernorm.hessian(c.X[0], eps=float("nan")),
        ValueError, "eps must be a finite float >= 0"),
    Row("bh.layernorm.jacobian", "eps", "eps = 1e-300 on a constant row (float64)",
        lambda c: layernorm.jacobian(torch.full((3, 4), 0.7, dtype=DT), eps=1e-300), ValueError,
        "LayerNorm input row (0,) is constant to the rounding of its values (variance 0) and ln_eps=1e-300"),
    Row("bh.layernorm.hessian", "eps", "eps = 1e-30 on a constant row (float32)",
        lambda c: layernorm.hessian(torch.full((3, 4), 0.7), eps=1e-30), ValueError, "ln_eps=1e-30 is below"),
    Row("bh.hessian", "eps", "ln_eps = 1e-200 and W_V = 0 with a constant row: a constant LN_1 input row",
        lambda c: bh.hessian({**c.p, "W_V": torch.zeros(4, 4, dtype=DT)}, const_row(c.X),
                             bh.BlockConfig(d_model=4, d_ff=5, ln_eps=1e-200), target=c.T), ValueError,
        "the LayerNorm-1 input X + SA(X): LayerNorm input row (0, 0) is constant to the rounding"),
    # targets and losses
    Row("bh.hessian", "target", "no MSE target", lambda c: bh.hessian(c.p, c.X, c.cfg, loss="mse"),
        ValueError, "target is required for loss='mse'"),
    Row("bh.hessian", "target", "an MSE target of another shape", lambda c: bh.hessian(c.p, c.X, c.cfg, target=c.T[:1]),
        ValueError, "target must have the shape of the output (2, 3, 4)"),
    Row("bh.hessian", "target", "float CE targets", lambda c: bh.hessian(c.p, c.X, c.cfg, loss="ce", target=c.T),
        ValueError, "target must be an integer tensor of class indices for loss='ce'"),
    Row("bh.hessian", "target", "a CE class outside [0, d_model)",
        lambda c: bh.hessian(c.p, c.X, c.cfg, loss="ce", target=torch.full((2, 3), 7)),
        ValueError, "target classes must lie in [0, 3]"),
    Row("bh.hessian", "target", "CE targets of another shape",
        lambda c: bh.hessian(c.p, c.X, c.cfg, loss="ce", target=torch.zeros(2, 4, dtype=torch.long)),
        ValueError, "target must have shape (2, 3) for loss='ce'"),
    Row("bh.hessian", "target", "an unknown loss name", lambda c: bh.hessian(c.p, c.X, c.cfg, loss="l1", target=c.T),
        ValueError, "loss must be 'mse', 'ce' or a callable"),
    Row("bh.hessian", "target", "a callable loss that returns a tensor, not a scalar",
        lambda c: bh.hessian(c.p, c.X, c.cfg, loss=lambda Z, t: Z), ValueError, "loss must return a scalar (0-dim) tensor"),
    Row("bh.hessian", "target", "a callable's batch target without one entry per sequence",
        lambda c: bh.hessian(c.p, c.X, c.cfg, loss=lambda Z, t: (t * Z).sum(), target=torch.ones(3, dtype=DT)),
        ValueError, "target must have a leading axis of size 2"),
    Row("bh.hessian", "target", "a callable loss torch.func cannot differentiate (.item())",
        lambda c: bh.hessian(c.p, c.X, c.cfg, loss=lambda Z, t: Z.sum() * float(Z.sum().item() > 0)),
        ValueError, "loss could not be differentiated by torch.func"),
    # other arguments
    Row("bh.hessian", "argument", "an empty wrt", lambda c: bh.hessian(c.p, c.X, c.cfg, target=c.T, wrt=[]),
        ValueError, "wrt must be a non-empty subset of"),
    Row("bh.hessian", "argument", "a PyTorch layer name in wrt",
        lambda c: bh.hessian(c.p, c.X, c.cfg, target=c.T, wrt=["linear1.weight"]), ValueError, "W_1"),
    Row("bh.hessian", "argument", "wrt_input given as 1", lambda c: bh.hessian(c.p, c.X, c.cfg, target=c.T, wrt_input=1),
        ValueError, "wrt_input must be True or False"),
    Row("bh.hessian", "argument", "out= that requires grad",
        lambda c: bh.hessian(c.p, c.X, c.cfg, target=c.T, out=torch.empty(88, 88, dtype=DT, requires_grad=True)),
        ValueError, "out must not require grad"),
    Row("bh.hessian", "argument", "out= sharing memory with X", lambda c: _shared_out(c),
        ValueError, "out shares memory with X"),
    Row("bh.BlockConfig", "argument", "d_model not divisible by n_heads", lambda c: bh.BlockConfig(d_model=4, n_heads=3),
        ValueError, "BlockConfig.d_model=4 must be divisible by n_heads=3"),
    Row("bh.BlockConfig", "argument", "an unknown activation", lambda c: bh.BlockConfig(d_model=4, activation="tanh"),
        ValueError, "BlockConfig.activation must be one of"),
    Row("bh.init_params", "argument", "a string seed", lambda c: bh.init_params(c.cfg, seed="a"),
        ValueError, "seed must be an int >= 0"),
    Row("bh.from_torch", "argument", "a module it cannot read (nn.Linear)", lambda c: bh.from_torch(torch.nn.Linear(3, 3)),
        ValueError, "from_torch supports"),
    Row("bh.from_torch", "argument", "example_inputs of two tensors (read by tracing)",
        lambda c: bh.from_torch(torch.nn.Linear(3, 3), (c.X, c.X)), ValueError, "example_inputs must be one tensor"),
    Row("bh.from_torch", "argument", "a mask argument with example_inputs",
        lambda c: bh.from_torch(torch.nn.Linear(3, 3), c.X, is_causal=True), ValueError,
        "do not apply with example_inputs"),
    Row("bh.from_torch", "argument", "a module that is no Transformer, read by tracing (nn.Linear)",
        lambda c: bh.from_torch(torch.nn.Linear(4, 4), c.X), ValueError, "expected the output of a Transformer block"),
    Row("bh.from_torch", "argument", "dropout in training mode",
        lambda c: bh.from_torch(torch.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.1, batch_first=True)),
        ValueError, "dropout=0.1 in training mode is not supported"),
    Row("bh.from_torch", "argument", "an encoder in eval with one layer's dropout1 put back in train",
        lambda c: bh.from_torch(_one_in_train("layers.1.dropout1")), ValueError,
        "TransformerEncoder: dropout layers.1.dropout1.p=0.1 in training mode is not supported"),
    Row("bh.from_torch", "argument", "an encoder in eval with one layer's self_attn put back in train",
        lambda c: bh.from_torch(_one_in_train("layers.0.self_attn")), ValueError,
        "TransformerEncoder: dropout layers.0.self_attn.dropout=0.1 in training mode is not supported"),
    Row("H[a, b]", "argument", "an unknown parameter name",
        lambda c: bh.hessian(c.p, c.X, c.cfg, target=c.T)["W_Q", "W_9"], KeyError, "unknown parameter 'W_9'"),
    Row("bh.bounds.exact_norms", "argument", "something other than a full Hessian", lambda c: bh.bounds.exact_norms(3),
        ValueError, "H must be a full Hessian from blockhess.hessian"),
    # model inputs
    Row("bh.hessian", "model input", "a sequence longer than a block's sliding_window (Mistral's)",
        lambda c: bh.hessian(weights(WINDOWED), IDS, WINDOWED, loss="ce", target=IDS), NotImplementedError,
        "a sequence of 3 tokens is longer than blocks[0].sliding_window=2"),
    Row("bh.hessian", "model input", "a negative token id", lambda c: tokens(IDS - 1), ValueError,
        "inputs: token id -1 at (1, 0) is out of range [0, 5)"),
    Row("bh.hessian", "model input", "a token id >= vocab", lambda c: tokens(IDS + 1), ValueError,
        "inputs: token id 5 at (1, 1) is out of range [0, 5)"),
    Row("bh.hessian", "model input", "a sequence of padding ids only in a last-token model's inputs",
        lambda c: bh.hessian(weights(LAST), torch.tensor([[0, 1], [4, 4]]), LAST, loss="ce", target=CLASSES), ValueError,
        "inputs: sequence 1 holds only the padding id 4 (ModelConfig.pad_token)"),
    Row("bh.forward", "model input", "float token ids", lambda c: bh.forward(weights(TOKENS), IDS.double(), TOKENS),
        ValueError, "inputs must be integer token ids of shape (B, L) or (L,), got torch.float64"),
    Row("bh.forward", "model input", "token ids on another device than the weights",
        lambda c: bh.forward(weights(TOKENS), IDS.to("meta"), TOKENS), ValueError, "inputs is on meta but params['W_E'] is on cpu"),
    Row("bh.hessian", "model input", "4 tokens and the cls token for 4 learned positions",
        lambda c: tokens(torch.zeros(2, 4, dtype=torch.long)), ValueError,
        "inputs: 5 tokens (the cls token included) exceed the 4 learned positions (W_P rows)"),
    Row("bh.hessian", "model input", "images of another size than the config's",
        lambda c: bh.hessian(weights(IMAGES), torch.randn(2, 1, 4, 6, dtype=DT), IMAGES, loss="ce", target=CLASSES),
        ValueError, "inputs must have shape (B, 1, 4, 4) (or without the batch axis)"),
    Row("bh.hessian", "model input", "features of another width than d_in",
        lambda c: bh.hessian(weights(FEATURES), c.X, FEATURES, loss="mse", target=c.T[..., :2]), ValueError,
        "inputs must have shape (B, L, 3)"),
    Row("bh.hessian", "model input", "a NaN in the features", lambda c: features(nan_at(c.X), target=c.T[..., :2]),
        ValueError, "inputs contains NaN or Inf"),
    Row("bh.hessian", "model input", "a NaN in the token embedding",
        lambda c: bh.hessian(weights(TOKENS, W_E=nan_at(weights(TOKENS)["W_E"])), IDS, TOKENS, loss="ce", target=CLASSES),
        ValueError, "params['W_E'] contains NaN or Inf"),
    Row("bh.hessian", "model input", "an Inf in a block's weight",
        lambda c: bh.hessian(weights(TOKENS, **{"blocks.1.W_V": nan_at(weights(TOKENS)["blocks.1.W_V"], float("inf"))}),
                             IDS, TOKENS, loss="ce", target=CLASSES), ValueError, "params['blocks.1.W_V'] contains NaN or Inf"),
    Row("bh.hessian", "model input", "a block's parameters for a model",
        lambda c: bh.hessian(c.p, IDS, TOKENS, loss="ce", target=CLASSES), ValueError, "missing ['W_E', 'cls', 'W_P',"),
    Row("bh.reference.hessian", "model input", "a token id >= vocab",
        lambda c: bh.reference.hessian(weights(TOKENS), IDS + 1, TOKENS, loss="ce", target=CLASSES), ValueError,
        "is out of range [0, 5)"),
    # padded batches
    Row("bh.hessian", "padded batch", "an attention mask of another shape than the ids",
        lambda c: padded(attention_mask=LEFT[:, :2]), ValueError,
        "inputs['attention_mask'] must be a tensor of shape (2, 3) of 1 (attend) and 0 (padding), bool, integer or "
        "float (one entry per token; a 4-D mask is not taken), got shape (2, 2)"),
    Row("bh.hessian", "padded batch", "an attention mask of 0.5s", lambda c: padded(attention_mask=LEFT * 0.5),
        ValueError, "inputs['attention_mask'] must hold only 0 and 1, got 0.5 at (0, 1)"),
    Row("bh.hessian", "padded batch", "a complex attention mask", lambda c: padded(attention_mask=LEFT.to(torch.cfloat)),
        ValueError, "inputs['attention_mask'] must be a tensor of shape (2, 3) of 1 (attend) and 0 (padding)"),
    Row("bh.hessian", "padded batch", "an attention mask on another device than the ids",
        lambda c: padded(attention_mask=LEFT.to("meta")), ValueError,
        "inputs['attention_mask'] is on meta but the inputs are on cpu"),
    Row("bh.hessian", "padded batch", "a sequence whose every key is masked",
        lambda c: padded(attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]])), ValueError,
        "inputs['attention_mask']: sequence 1 has every key masked (no token to attend to)"),
    Row("bh.hessian", "padded batch", "a counted token with no key to attend to (left padding, causal)",
        lambda c: padded(target=LABELS.clamp(min=0)), ValueError,
        "inputs['attention_mask']: token 0 of sequence 0 has no key to attend to (padding before it under a causal "
        "mask) but the loss counts its output; give it the target -100"),
    Row("bh.hessian", "padded batch", "labels that are all -100", lambda c: padded(target=torch.full((2, 3), -100)),
        ValueError, "target: every token is -100 (ignored) for loss='ce': the mean over counted tokens has no token"),
    Row("bh.hessian", "padded batch", "a token id >= vocab in the dict", lambda c: padded(input_ids=IDS + 1),
        ValueError, "inputs: token id 5 at (1, 1) is out of range [0, 5)"),
    Row("bh.hessian", "padded batch", "a token type outside the 2 of W_T",
        lambda c: padded(token_type_ids=torch.tensor([[0, 1, 2], [0, 0, 0]])), ValueError,
        "inputs['token_type_ids']: 2 at (0, 2) is out of range [0, 2) (rows of W_T)"),
    Row("bh.hessian", "padded batch", "a position id beyond the 4 learned positions",
        lambda c: padded(position_ids=torch.tensor([[0, 1, 4], [0, 1, 2]])), ValueError,
        "inputs['position_ids']: 4 at (0, 2) is out of range [0, 4) (rows of W_P, 4 of them)"),
    Row("bh.hessian", "padded batch", "float position ids", lambda c: padded(position_ids=torch.zeros(2, 3)),
        ValueError, "inputs['position_ids'] must be an integer tensor of rows of W_P, 4 of them, got torch.float32"),
    Row("bh.forward", "padded batch", "position ids for a model without positions",
        lambda c: bh.forward(weights(model_config(embedding="token", vocab=5)), {"input_ids": IDS, "position_ids": IDS},
                             model_config(embedding="token", vocab=5)), ValueError,
        "inputs['position_ids']: this model has no learned or rotary positions to take them"),
    Row("bh.forward", "padded batch", "token types for a model without a token-type table",
        lambda c: bh.forward(weights(model_config(embedding="token", vocab=5)), {"input_ids": IDS, "token_type_ids": IDS},
                             model_config(embedding="token", vocab=5)), ValueError,
        "inputs['token_type_ids']: this model has no token-type table"),
    Row("bh.hessian", "padded batch", "inputs_embeds in place of input_ids",
        lambda c: padded(input_ids=None, inputs_embeds=c.X), ValueError,
        "inputs: unknown key ['inputs_embeds']; this model's forward takes ['input_ids', 'attention_mask', "
        "'position_ids', 'token_type_ids']; inputs_embeds is not taken: pass input_ids"),
    Row("bh.forward", "padded batch", "an attention mask for a patch model",
        lambda c: bh.forward(weights(IMAGES), {"pixel_values": torch.randn(2, 1, 4, 4, dtype=DT),
                                               "attention_mask": LEFT}, IMAGES), ValueError,
        "a patch model takes no mask"),
    Row("bh.forward", "padded batch", "a mask for a model with a cls token",
        lambda c: bh.forward(weights(TOKENS), {"input_ids": IDS, "attention_mask": LEFT}, TOKENS), ValueError,
        "are not taken by a model with a cls token"),
    Row("bh.forward", "padded batch", "a float src_key_padding_mask",
        lambda c: bh.forward(weights(FEATURES), {"src": c.X[..., :3], "src_key_padding_mask": torch.zeros(2, 3)},
                             FEATURES), ValueError,
        "inputs['src_key_padding_mask'] must be a bool tensor of shape (2, 3) (True = padding), got torch.float32"),
    Row("bh.hessian", "padded batch", "a target of -100 for a block (not a model)",
        lambda c: bh.hessian(c.p, c.X, c.cfg, loss="ce", target=torch.full((2, 3), -100)), ValueError,
        "targets of -100 (ignored) are taken by a model's blockhess.hessian and hessian_operator"),
    # model targets
    Row("bh.hessian", "model target", "a pooled model's CE target with one class per token",
        lambda c: tokens(target=torch.zeros(2, 3, dtype=torch.long)), ValueError,
        "target must have shape (2,) for loss='ce' (one class per sequence: the model is pooled), got (2, 3)"),
    Row("bh.hessian", "model target", "a CE class outside the head's [0, 3)", lambda c: tokens(target=torch.tensor([0, 3])),
        ValueError, "target classes must lie in [0, 2] (3 logits: the output's last axis)"),
    Row("bh.hessian", "model target", "a pooled model's MSE target shaped per token",
        lambda c: bh.hessian(weights(IMAGES), torch.randn(2, 1, 4, 4, dtype=DT), IMAGES, loss="mse",
                             target=torch.zeros(2, 4, 3, dtype=DT)), ValueError,
        "target must have the shape of the model output (2, 3) for loss='mse', got (2, 4, 3)"),
    Row("bh.hessian", "model target", "a per-token MSE target without the output axis",
        lambda c: features(c.X, target=c.T[..., 0]), ValueError,
        "target must have the shape of the model output (2, 3, 2) for loss='mse', got (2, 3)"),
    Row("bh.hessian", "model target", "a per-token CE target with one class per sequence",
        lambda c: features(c.X, loss="ce", target=torch.zeros(2, dtype=torch.long)), ValueError,
        "target must have shape (2, 3) for loss='ce' (one class per token), got (2,)"),
    Row("bh.hessian", "model target", "no MSE target", lambda c: features(c.X), ValueError,
        "target is required for loss='mse' (a tensor shaped like the model output (2, 3, 2))"),
    # model arguments
    Row("bh.hessian", "model argument", "a block's name in wrt, without its block", lambda c: tokens(wrt="W_Q"),
        ValueError, "'W_Q' is a block's name: a model names each block's own, 'blocks.0.W_Q', 'blocks.1.W_Q'"),
    Row("bh.hessian", "model argument", "the input X in wrt", lambda c: tokens(wrt=["X"]), ValueError,
        "a model's input is not a variable"),
    Row("bh.hessian", "model argument", "wrt_input=True", lambda c: tokens(wrt_input=True), ValueError,
        "wrt_input and out apply to a block; for a model (ModelConfig) leave them out"),
    Row("bh.hessian", "model argument", "out=", lambda c: tokens(out=torch.empty(4, 4, dtype=DT)), ValueError,
        "wrt_input and out apply to a block; for a model (ModelConfig) leave them out"),
    Row("bh.reference.hessian", "model argument", "wrt_input=True",
        lambda c: bh.reference.hessian(weights(TOKENS), IDS, TOKENS, loss="ce", target=CLASSES, wrt_input=True),
        ValueError, "wrt_input applies to a block; a model's input is not a variable"),
    # model configurations
    Row("bh.ModelConfig", "model config", "an RMSNorm final norm with norm_bias=True",
        lambda c: model_config(d_in=3, final_norm=True, norm_type="rms"), ValueError,
        "an RMSNorm (norm_type='rms') has no shift beta"),
    Row("bh.ModelConfig", "model config", "rms_offset with a LayerNorm", lambda c: model_config(d_in=3, rms_offset=1.0),
        ValueError, "rms_offset=1.0 needs norm_type='rms' and norm_affine=True"),
    Row("bh.ModelConfig", "model config", "embed_scale without a token embedding",
        lambda c: model_config(d_in=3, embed_scale=2.0), ValueError, "embed_scale=2.0 scales a token embedding"),
    Row("bh.BlockConfig", "argument", "sliding_window without causal", lambda c: bh.BlockConfig(d_model=4, sliding_window=2),
        ValueError, "sliding_window=2 needs causal=True"),
    Row("bh.from_torch", "argument", "a LlamaForCausalLM with rope_type='linear' (any scaled rope)",
        lambda c: bh.from_torch(_llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})),
        ValueError, "rope_type='linear' is not supported"),
    Row("bh.from_torch", "argument", "a LlamaForCausalLM with partial_rotary_factor=0.5",
        lambda c: bh.from_torch(_llama(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                        "partial_rotary_factor": 0.5})),
        ValueError, "partial_rotary_factor=0.5 is not supported"),
    Row("bh.from_torch", "argument", "a LlamaForCausalLM with attention_bias=True alone (an o_proj bias)",
        lambda c: bh.from_torch(_llama(attention_bias=True)), ValueError, "an o_proj bias without the MLP's"),
    Row("bh.from_torch", "argument", "a GemmaForCausalLM with logit softcapping (Gemma 2's)",
        lambda c: bh.from_torch(_llama("Gemma", final_logit_softcapping=30.0)), ValueError,
        "final_logit_softcapping=30.0 is not supported"),
    Row("bh.ModelConfig", "model config", "no blocks", lambda c: model_config(blocks=(), d_in=3), ValueError,
        "ModelConfig.blocks must be a non-empty tuple of BlockConfig"),
    Row("bh.ModelConfig", "model config", "a bare attention layer as a block",
        lambda c: model_config(blocks=(bh.BlockConfig(d_model=4, kind="attention"),), d_in=3), ValueError,
        "ModelConfig.blocks must have kind='block'"),
    Row("bh.ModelConfig", "model config", "blocks of different widths",
        lambda c: model_config(blocks=(_BLOCK, bh.BlockConfig(d_model=6)), d_in=3), ValueError,
        "ModelConfig.blocks must share one d_model, got [4, 6]"),
    Row("bh.ModelConfig", "model config", "an unknown embedding", lambda c: model_config(embedding="conv"), ValueError,
        "ModelConfig.embedding must be one of ('linear', 'patch', 'token', 'none'), got 'conv'"),
    Row("bh.ModelConfig", "model config", "unknown positions", lambda c: model_config(d_in=3, positions="rope"),
        ValueError, "ModelConfig.positions must be one of ('none', 'sinusoidal', 'learned'), got 'rope'"),
    Row("bh.ModelConfig", "model config", "an unknown pooling", lambda c: model_config(d_in=3, pool="max"), ValueError,
        "ModelConfig.pool must be one of ('none', 'mean', 'first', 'last'), got 'max'"),
    Row("bh.ModelConfig", "model config", "a padding id without pool='last'",
        lambda c: model_config(embedding="token", vocab=5, pool="first", head=3, pad_token=0), ValueError,
        "ModelConfig.pad_token=0 has meaning only with pool='last' and embedding='token'"),
    Row("bh.ModelConfig", "model config", "a flag given as 1", lambda c: model_config(d_in=3, cls_token=1), ValueError,
        "ModelConfig.cls_token must be True or False"),
    Row("bh.ModelConfig", "model config", "a negative norm_eps", lambda c: model_config(d_in=3, norm_eps=-1e-5), ValueError,
        "ModelConfig.norm_eps must be a finite float >= 0"),
    Row("bh.ModelConfig", "model config", "negative token_types", lambda c: model_config(d_in=3, token_types=-1),
        ValueError, "ModelConfig.token_types must be an int >= 0"),
    Row("bh.ModelConfig", "model config", "a head of width 0", lambda c: model_config(d_in=3, head=0), ValueError,
        "ModelConfig.head must be an int >= 1"),
    Row("bh.ModelConfig", "model config", "a linear embedding without d_in", lambda c: model_config(), ValueError,
        "ModelConfig.d_in (the feature width) is needed with embedding='linear'"),
    Row("bh.ModelConfig", "model config", "a token embedding without vocab", lambda c: model_config(embedding="token"),
        ValueError, "ModelConfig.vocab is needed with embedding='token'"),
    Row("bh.ModelConfig", "model config", "vocab with a linear embedding", lambda c: model_config(d_in=3, vocab=5),
        ValueError, "ModelConfig.vocab=5 has no meaning with embedding='linear' (only with 'token')"),
    Row("bh.ModelConfig", "model config", "a patch embedding without an image",
        lambda c: model_config(embedding="patch", patch=2), ValueError,
        "ModelConfig.image (C, H, W) and patch are needed with embedding='patch', got image=None, patch=2"),
    Row("bh.ModelConfig", "model config", "an image given as one number",
        lambda c: model_config(embedding="patch", image=4, patch=2), ValueError,
        "ModelConfig.image (C, H, W) and patch are needed with embedding='patch', got image=4"),
    Row("bh.ModelConfig", "model config", "an image of height 0",
        lambda c: model_config(embedding="patch", image=(1, 0, 4), patch=2), ValueError, "ModelConfig.image must be an int >= 1"),
    Row("bh.ModelConfig", "model config", "a patch that does not divide the image",
        lambda c: model_config(embedding="patch", image=(1, 4, 6), patch=4), ValueError,
        "ModelConfig.patch=4 must divide the image size 4x6"),
    Row("bh.ModelConfig", "model config", "d_in other than C·patch² with patches",
        lambda c: model_config(embedding="patch", image=(1, 4, 4), patch=2, d_in=7), ValueError,
        "ModelConfig.d_in=7 contradicts the patches: C·patch² = 4"),
    Row("bh.ModelConfig", "model config", "a cls token without an embedding",
        lambda c: model_config(embedding="none", cls_token=True), ValueError,
        "ModelConfig.cls_token and token_types need an embedding"),
    Row("bh.ModelConfig", "model config", "learned positions without n_positions",
        lambda c: model_config(d_in=3, positions="learned"), ValueError,
        "ModelConfig.n_positions (rows of W_P) is needed with positions='learned'"),
    Row("bh.ModelConfig", "model config", "n_positions without learned positions",
        lambda c: model_config(d_in=3, n_positions=8), ValueError,
        "ModelConfig.n_positions=8 has no meaning with positions='none' (only with 'learned')"),
    Row("bh.ModelConfig", "model config", "fewer learned positions than an image's patches and cls token",
        lambda c: model_config(embedding="patch", image=(1, 4, 4), patch=2, cls_token=True, positions="learned",
                               n_positions=4), ValueError, "ModelConfig.n_positions=4 is less than the 5 tokens of an image"),
    Row("bh.ModelConfig", "model config", "sinusoidal positions with an odd d_model",
        lambda c: model_config(blocks=(bh.BlockConfig(d_model=3),), d_in=3, positions="sinusoidal"), ValueError,
        "ModelConfig.positions='sinusoidal' needs an even d_model, got 3"),
    Row("bh.ModelConfig", "model config", "a tied head without a token embedding",
        lambda c: model_config(d_in=3, head=3, tied=True), ValueError,
        "ModelConfig.tied needs embedding='token' and head == vocab"),
    Row("bh.ModelConfig", "model config", "a tied head of another width than vocab",
        lambda c: model_config(embedding="token", vocab=5, head=3, tied=True), ValueError,
        "ModelConfig.tied needs embedding='token' and head == vocab"),
    # estimators (blockhess.operators): symmetric ones refuse what is not symmetric, before any product
    Row("slq_density", "estimator", "a square off-diagonal view A['W_Q', 'W_K'] of bh.hessian_operator",
        lambda c: bh.operators.slq_density(_operator(c)["W_Q", "W_K"]), ValueError,
        "slq_density assumes a symmetric operator, but A is not symmetric: the off-diagonal view A['W_Q', 'W_K']"),
    Row("hutchpp_trace", "estimator", "a square off-diagonal view A['W_Q', 'W_K'] of bh.hessian_operator",
        lambda c: bh.operators.hutchpp_trace(_operator(c)["W_Q", "W_K"]), ValueError,
        "hutchpp_trace assumes a symmetric operator, but A is not symmetric: the off-diagonal view A['W_Q', 'W_K']"),
    Row("per_block", "estimator", "pairs=True with hutchpp_trace (the pairs' views are not symmetric)",
        lambda c: bh.operators.per_block(_operator(c), bh.operators.hutchpp_trace, blocks=["W_Q", "W_K"], pairs=True),
        ValueError, "hutchpp_trace (per_block, pairs=True) assumes a symmetric operator"),
    Row("hutchpp_trace", "estimator", "a dense tensor that is not symmetric to rounding",
        lambda c: bh.operators.hutchpp_trace(torch.arange(16, dtype=DT).reshape(4, 4)), ValueError,
        "a dense tensor with ||A - A^T||_F = 19 > n·eps·||A||_F"),
    Row("hutchpp_trace", "estimator", "a confidence of 1 (an interval of everything)",
        lambda c: bh.operators.hutchpp_trace(torch.eye(8, dtype=DT), 4, confidence=1.0), ValueError,
        "confidence must be a float in [0.5, 1), got 1.0"),
    Row("frobenius_norm", "estimator", "a budget of 3 products",
        lambda c: bh.operators.frobenius_norm(_operator(c)["W_Q", "W_1"], 3), ValueError,
        "n_matvecs must be an int >= 4, got 3"),
    Row("lanczos_eigs", "estimator", "a square off-diagonal view A['W_Q', 'W_K'] of bh.hessian_operator",
        lambda c: bh.operators.lanczos_eigs(_operator(c)["W_Q", "W_K"]), ValueError,
        "lanczos_eigs assumes a symmetric operator, but A is not symmetric: the off-diagonal view A['W_Q', 'W_K']"),
    Row("lanczos_eigs", "estimator", "a failure_probability of 0 (a check that could never stop)",
        lambda c: bh.operators.lanczos_eigs(torch.eye(8, dtype=DT), failure_probability=0.0), ValueError,
        "failure_probability must be a float in (0, 1), got 0.0"),
    Row("lanczos_eigs", "estimator", "a check that cannot rule out a missed eigenvalue within the budget",
        lambda c: bh.operators.lanczos_eigs(torch.diag(torch.linspace(0, 1, 400, dtype=DT)), k=1, tol=1e-8,
                                            v0=torch.eye(400, dtype=DT)[:, -1], max_matvecs=30),
        bh.operators.NotConvergedError,
        "the check could not rule out an eigenvalue beyond the k-th value"),
    Row("operators.solve", "estimator", "a square off-diagonal view A['W_Q', 'W_K'] of bh.hessian_operator",
        lambda c: bh.operators.solve(_operator(c)["W_Q", "W_K"], torch.ones(16, dtype=DT)), ValueError,
        "solve assumes a symmetric operator, but A is not symmetric: the off-diagonal view A['W_Q', 'W_K']"),
    Row("operators.solve", "estimator", "b of another length than the operator's",
        lambda c: bh.operators.solve(_operator(c), torch.ones(3, dtype=DT)), ValueError,
        "b must have shape (88,) or (88, k) with k >= 1, got (3,)"),
    Row("operators.solve", "estimator", "b float32 for a float64 operator",
        lambda c: bh.operators.solve(_operator(c), torch.ones(88)), ValueError,
        "b must have A's dtype torch.float64, got torch.float32"),
    Row("operators.solve", "estimator", "b with a NaN",
        lambda c: bh.operators.solve(_operator(c), nan_at(torch.ones(88, dtype=DT))), ValueError,
        "b contains NaN or Inf"),
    Row("operators.solve", "estimator", "a negative damping",
        lambda c: bh.operators.solve(_operator(c), torch.ones(88, dtype=DT), damping=-0.1), ValueError,
        "damping must be a finite real number in [0, inf), got -0.1"),
    Row("operators.solve", "estimator", "CG on an indefinite Hessian (breakdown, p^T (A + λI) p <= 0)",
        lambda c: bh.operators.solve(_operator(c), torch.ones(88, dtype=DT), damping=1e-3, method="cg"),
        bh.operators.IndefiniteError, "use method='minres'"),
    Row("operators.solve", "estimator", "a budget of 5 products for a tolerance of 1e-10",
        lambda c: bh.operators.solve(_operator(c), torch.ones(88, dtype=DT), damping=0.1, tol=1e-10, max_matvecs=5),
        bh.operators.NotConvergedError, "solve (minres) did not reach tol=1e-10"),
    Row("operators.influence", "estimator", "one training gradient as a vector (n,), not a column (n, 1)",
        lambda c: bh.operators.influence(_operator(c), torch.ones(88, dtype=DT), torch.ones(88, dtype=DT), 0.1),
        ValueError, "train_grads must be a tensor (88, m) with m >= 1"),
    Row("HessianOperator.block_diagonal", "estimator", "an unknown block name",
        lambda c: _operator(c).block_diagonal(["W_Q", "W_X"]), KeyError, "unknown variable 'W_X'"),
    Row("HessianOperator.block_diagonal", "estimator", "two blocks sharing a parameter (W_Q, and W_Q within a tuple)",
        lambda c: _operator(c).block_diagonal(["W_Q", ("W_K", "W_Q")]), ValueError,
        "blocks must not share entries: block ('W_K', 'W_Q') overlaps an earlier block in 'W_Q'"),
    Row("HessianOperator.block_diagonal", "estimator", "no blocks",
        lambda c: _operator(c).block_diagonal([]), ValueError, "blocks must hold at least one block"),
    Row("HessianOperator.block_diagonal", "estimator", "an off-diagonal view A['W_Q', 'W_K']",
        lambda c: _operator(c)["W_Q", "W_K"].block_diagonal(), ValueError, "block_diagonal needs a square view"),
    Row("D @ V (BlockDiagonalOperator)", "NaN/Inf", "a NaN in V",
        lambda c: _operator(c).block_diagonal(["W_Q", "W_1"]) @ nan_at(torch.zeros(36, dtype=DT)), ValueError,
        "V contains NaN or Inf (in the entries of block 'W_Q')"),
    Row("D @ V (BlockDiagonalOperator)", "estimator", "V of another length than D's",
        lambda c: _operator(c).block_diagonal(["W_Q", "W_1"]) @ torch.zeros(5, dtype=DT), ValueError,
        "V must have shape (36,) or (36, k)"),
    Row("operators.blockwise_eigs", "estimator", "an operator that is not a BlockDiagonalOperator",
        lambda c: bh.operators.blockwise_eigs(_operator(c)), ValueError, "D must be a BlockDiagonalOperator"),
    Row("operators.blockwise_eigs", "estimator", "a warm start for a block D does not have",
        lambda c: bh.operators.blockwise_eigs(_operator(c).block_diagonal(["W_Q"]), v0={"W_K": torch.ones(16, dtype=DT)}),
        ValueError, "v0 names a block 'W_K' that D does not have"),
    Row("operators.blockwise_eigs", "estimator", "k above a block's size",
        lambda c: bh.operators.blockwise_eigs(_operator(c).block_diagonal(["W_1", "W_Q"]), k=17), ValueError,
        "k must be at most every block's size: block 'W_Q' has n = 16, got k = 17"),
    Row("operators.js_distance", "estimator", "weights with a negative entry",
        lambda c: bh.operators.js_distance(torch.tensor([0.5, -0.1, 0.6], dtype=DT), torch.ones(3, dtype=DT)),
        ValueError, "p must hold finite non-negative weights"),
    Row("operators.js_distance", "estimator", "weights of unequal lengths",
        lambda c: bh.operators.js_distance(torch.ones(3, dtype=DT), torch.ones(4, dtype=DT)), ValueError,
        "p and q must have equal lengths"),
    # memory
    Row("bh.hessian", "memory", "a dense result larger than the memory available",
        lambda c: bh.hessian(*_huge(), loss="ce", target=torch.zeros(2, dtype=torch.long)),
        bh.InsufficientMemoryError, "would need"),
]


WINDOWED = bh.ModelConfig(blocks=(bh.BlockConfig(d_model=4, d_ff=5, causal=True, sliding_window=2),), embedding="token",
                          vocab=5, head=5)


def _llama(family: str = "Llama", **kw):
    """A 1-layer ``{family}ForCausalLM`` of width 4 (transformers, random weights) with the settings ``kw``."""
    import transformers

    base = dict(vocab_size=5, hidden_size=4, intermediate_size=6, num_hidden_layers=1, num_attention_heads=1,
                num_key_value_heads=1, head_dim=4, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}Config")(**base, **kw)).eval()


def _operator(c: Case):
    return bh.hessian_operator(c.p, c.X, c.cfg, target=c.T)


def _shared_out(c: Case):
    buf = torch.zeros(88 * 88, dtype=DT)
    X = buf[:24].view(2, 3, 4)
    X.copy_(c.X)
    return bh.hessian(c.p, X, c.cfg, target=c.T, out=buf.view(88, 88))


def _huge():
    """A block of d_model 512, d_ff 2048 (2.9M weights: a dense Hessian of 69 TB) and one sequence of 2 tokens."""
    cfg = bh.BlockConfig(d_model=512, d_ff=2048)
    return bh.init_params(cfg, seed=0), torch.randn(2, 512, dtype=DT), cfg


def _one_in_train(path: str) -> torch.nn.Module:
    """A 2-layer ``nn.TransformerEncoder`` with dropout 0.1, in eval but the submodule ``path``."""
    layer = torch.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.1, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    model.get_submodule(path).train()
    return model


def _id(r: Row) -> str:
    return f"{r.entry}: {r.given}"


@pytest.mark.parametrize("row", ROWS, ids=[_id(r) for r in ROWS])
def test_row(row: Row):
    with pytest.raises(row.error) as info:
        row.call(make())
    assert row.says in str(info.value), f"message {str(info.value)!r} lacks {row.says!r}"


SECTIONS = {
    "shape": "Shapes", "dtype": "Dtypes", "device": "Devices", "NaN/Inf": "NaN and Inf",
    "LayerNorm row": "Degenerate LayerNorm rows", "eps": "LayerNorm eps", "target": "Losses and targets",
    "argument": "Other arguments", "model input": "Model inputs and weights", "model target": "Model targets",
    "model argument": "Model arguments", "model config": "Model configurations",
    "padded batch": "Padded batches: masks, ignored targets, positions, token types",
    "estimator": "Estimators on operators", "memory": "Requests that would not fit in memory",
}


def render() -> str:
    lines = [
        "# Bad input and the errors it gets",
        "",
        "Every public entry point checks its input before any work and raises an error that names the",
        "argument and what was expected: `ValueError`, `KeyError` for an unknown block of a result, and",
        "`blockhess.InsufficientMemoryError` (a `MemoryError` and a `ValueError`) for a request that would",
        "not fit, with the bytes needed and available. Each row below is a test (`tests/test_bad_inputs.py`,",
        "from which this page is rendered: `python tests/test_bad_inputs.py > docs/bad_inputs.md`). The",
        "inputs are a post-LN block with `d_model = 4`, `d_ff = 5` and a batch of 2 sequences of 3 tokens",
        "(a pre-LN block for the LayerNorm rows). The model rows take models of such blocks: token ids",
        "with a cls token, 4 learned positions and a 3-class head on the cls token; 4x4 images in 2x2",
        "patches, mean-pooled into a 3-wide head; features of width 3 into a 2-wide head per token. The",
        "padded batches take a causal block on token ids with 4 learned positions, 2 token types and a",
        "3-class head per token; its first sequence left-padded (`attention_mask` `[[0, 1, 1], [1, 1, 1]]`).",
        "\"Message says\" is a part of the message.",
        "",
    ]
    for kind, title in SECTIONS.items():
        rows = [r for r in ROWS if r.kind == kind]
        if not rows:
            continue
        lines += [f"## {title}", "", "| entry point | bad input | error | message says |", "|---|---|---|---|"]
        lines += [f"| `{r.entry}` | {r.given} | `{r.error.__name__}` | `{r.says}` |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def test_page_is_rendered_from_the_rows():
    assert {r.kind for r in ROWS} <= set(SECTIONS)
    assert PAGE.read_text() == render(), "docs/bad_inputs.md is stale: python tests/test_bad_inputs.py > docs/bad_inputs.md"


if __name__ == "__main__":
    sys.stdout.write(render())
