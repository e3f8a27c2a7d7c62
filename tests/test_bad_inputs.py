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
    Row("bh.from_torch", "argument", "dropout in training mode",
        lambda c: bh.from_torch(torch.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.1, batch_first=True)),
        ValueError, "dropout=0.1 in training mode is not supported"),
    Row("H[a, b]", "argument", "an unknown parameter name",
        lambda c: bh.hessian(c.p, c.X, c.cfg, target=c.T)["W_Q", "W_9"], KeyError, "unknown parameter 'W_9'"),
    Row("bh.bounds.exact_norms", "argument", "something other than a full Hessian", lambda c: bh.bounds.exact_norms(3),
        ValueError, "H must be a full Hessian from blockhess.hessian"),
    # memory
    Row("bh.hessian", "memory", "a dense result larger than the memory available",
        lambda c: bh.hessian(*_huge(), loss="ce", target=torch.zeros(2, dtype=torch.long)),
        bh.InsufficientMemoryError, "would need"),
]


def _shared_out(c: Case):
    buf = torch.zeros(88 * 88, dtype=DT)
    X = buf[:24].view(2, 3, 4)
    X.copy_(c.X)
    return bh.hessian(c.p, X, c.cfg, target=c.T, out=buf.view(88, 88))


def _huge():
    """A block of d_model 512, d_ff 2048 (2.9M weights: a dense Hessian of 69 TB) and one sequence of 2 tokens."""
    cfg = bh.BlockConfig(d_model=512, d_ff=2048)
    return bh.init_params(cfg, seed=0), torch.randn(2, 512, dtype=DT), cfg


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
    "argument": "Other arguments", "memory": "Requests that would not fit in memory",
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
        "(a pre-LN block for the LayerNorm rows). \"Message says\" is a part of the message.",
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
