"""The suite's settings, in one place: every list of cases a test is parametrized over.

A plain module (imported as ``from settings import ...``; pytest puts ``tests/`` on the path
through ``tests/conftest.py``). Each list is named and documented here, with its ids where pytest
would otherwise print tuples; a test file keeps a list of its own only for a case that is
special to it, with a one-line reason there. The builders of a case from these settings
(``make_case``, ``randomize_vectors``) and the comparison rules are in ``conftest.py``.
"""

from __future__ import annotations

import itertools
import random

import torch

# ----------------------------------------------------------------------------- sizes
# (L, d_model, d_k, d_ff, batch, input scale): L = 1 (softmax constant, the query/key parts zero),
# d_k != d_model, odd sizes, unbatched and batches of one and of several, tiny and large inputs.
SIZES = [
    (3, 4, 2, 5, None, 1.0),
    (1, 4, 4, 6, None, 1.0),
    (5, 3, 5, 7, None, 1.0),
    (4, 6, 3, 5, 1, 1.0),
    (3, 5, 2, 4, 3, 1.0),
    (4, 4, 2, 6, 2, 1e-2),
    (3, 4, 3, 5, None, 10.0),
    (2, 3, 1, 3, 4, 10.0),
]
SIZE_IDS = [f"L{c[0]}-d{c[1]}-dk{c[2]}-ff{c[3]}-B{c[4]}-s{c[5]:g}" for c in SIZES]
# the head of SIZES that the dense second-derivative tests take, run unbatched (jacfwd(jacrev) of
# every pair is the suite's slowest reference): still L = 1, d_k != d_model and odd sizes
SECOND_ORDER_SIZES, SECOND_ORDER_SIZE_IDS = SIZES[:4], SIZE_IDS[:4]

# ----------------------------------------------------------------------------- kinds, losses, dtypes
KINDS = ["block", "attention"]  # the post-LN block and the bare attention layer
DTYPES = [torch.float64, torch.float32]


def smooth_coupled(Z, T):
    """A custom loss whose Z-Hessian couples all tokens (full rank): exercises the general path."""
    return torch.log1p(((Z - T) ** 2).sum()) + 0.1 * torch.tanh(Z.sum()) ** 2


# the built-in losses and a callable one; the name is the test id
LOSSES = {"mse": "mse", "ce": "ce", "custom": smooth_coupled}


def make_target(loss: str, X: torch.Tensor, g: torch.Generator, d: int) -> torch.Tensor:
    """A target for ``loss`` (a name of :data:`LOSSES`) on inputs ``X``: CE's classes in
    ``[0, d)``, one per token; otherwise standard normal of ``X``'s shape and dtype."""
    if loss == "ce":
        return torch.randint(0, d, X.shape[:-1], generator=g)
    return torch.randn(X.shape, generator=g, dtype=X.dtype)


# ----------------------------------------------------------------------------- block options
ACTIVATIONS = ["relu", "gelu", "gelu_tanh"]
NORMS = ["post", "pre"]
# every option of BlockConfig beyond the sizes, the paper's value first
BLOCK_OPTIONS = {
    "n_heads": [1, 2],
    "bias": [False, True],
    "out_proj": [False, True],
    "ln_affine": [False, True],
    "ln_eps": [0.0, 1e-3],
    "activation": ACTIVATIONS,
    "norm": NORMS,
    "causal": [False, True],
}


def covered(row: dict, t: int) -> set:
    """The ``t``-tuples of ``(option, value)`` that the configuration ``row`` covers."""
    return {tuple((k, repr(row[k])) for k in ks) for ks in itertools.combinations(BLOCK_OPTIONS, t)}


def covering_design(t: int = 3, seed: int = 0) -> list[dict]:
    """A deterministic greedy ``t``-wise covering array over :data:`BLOCK_OPTIONS` (every
    combination of any ``t`` option values appears in some row; first rows: all first values =
    the paper's setting; all last values)."""
    need = set()
    for ks in itertools.combinations(BLOCK_OPTIONS, t):
        for vs in itertools.product(*(BLOCK_OPTIONS[k] for k in ks)):
            need.add(tuple((k, repr(v)) for k, v in zip(ks, vs)))
    rng = random.Random(seed)
    rows = [{k: v[0] for k, v in BLOCK_OPTIONS.items()}, {k: v[-1] for k, v in BLOCK_OPTIONS.items()}]
    for r in rows:
        need -= covered(r, t)
    while need:
        cands = [{k: rng.choice(v) for k, v in BLOCK_OPTIONS.items()} for _ in range(200)]
        best = max(cands, key=lambda r: len(covered(r, t) & need))
        rows.append(best)
        need -= covered(best, t)
    return rows


OPTION_DESIGN = covering_design()
# (L, d_model, d_k per head, d_ff, batch, input scale), cycled over OPTION_DESIGN: L = 1,
# d_k != d_model / n_heads, unbatched and batches
OPTION_SIZES = [(3, 4, 3, 5, None, 1.0), (1, 4, 2, 3, None, 1.0), (3, 6, 2, 5, 2, 1.0), (4, 4, 2, 6, 3, 0.5),
                (2, 6, 3, 4, None, 3.0), (1, 4, 3, 5, 2, 1.0), (5, 4, 2, 3, 1, 1.0)]
# (options row, sizes, loss): every row of the design, MSE and CE in turn
OPTION_CASES = [(row, OPTION_SIZES[i % len(OPTION_SIZES)], ("mse", "ce")[i % 2]) for i, row in enumerate(OPTION_DESIGN)]


def option_id(case) -> str:
    """The test id of an :data:`OPTION_CASES` entry: the options on, ``L``, batch and loss."""
    row, shape, loss = case
    on = [f"H{row['n_heads']}", row["norm"], row["activation"]] + [k for k in ("bias", "out_proj", "ln_affine", "causal") if row[k]]
    if row["ln_eps"]:
        on.append("eps")
    return "-".join(on) + f"-L{shape[0]}-B{shape[4]}-{loss}"


OPTION_IDS = [option_id(c) for c in OPTION_CASES]

# named configurations with many options on at once (BlockConfig keywords beyond the sizes)
NAMED_CONFIGS = {
    "paper": dict(),
    "post, all options": dict(n_heads=2, bias=True, out_proj=True, causal=True, ln_affine=True, ln_eps=1e-5,
                              activation="gelu"),
    "pre, all options": dict(n_heads=2, bias=True, out_proj=True, causal=True, ln_affine=True, ln_eps=1e-5,
                             activation="gelu_tanh", norm="pre"),
    "attention": dict(kind="attention", n_heads=2, bias=True, out_proj=True),
}

# ----------------------------------------------------------------------------- layers
# softmax: (L, L') of the score matrix: one entry, L < L', square, L > 1 with long rows
SOFTMAX_SHAPES = [(1, 1), (3, 4), (4, 4), (2, 5)]

# LayerNorm: (L, d, eps, affine): L = 1, eps 0 and > 0, odd d, with and without gamma
LAYERNORM_CASES = [(1, 4, 0.0, False), (3, 4, 0.0, False), (5, 7, 1e-3, False), (4, 5, 1e-5, True), (2, 3, 0.0, True)]
LAYERNORM_SCALES = [1e-2, 1.0, 10.0]  # input scales: tiny, unit, large
# (dtype, eps) of a constant row with a tiny eps: representable (1e-200, float32's 1e-30) and
# below the overflow threshold tiny/ε (float64's 1e-300)
LAYERNORM_TINY_EPS = [(torch.float64, 1e-200), (torch.float64, 1e-300), (torch.float32, 1e-30)]

# multi-head attention with biases: (batch, L, d_model, n_heads, d_k per head, causal): one head
# with d_k != d_model, two and three heads, causal, L = 1
MULTIHEAD_CASES = [(1, 3, 4, 1, 3, False), (2, 4, 6, 2, 2, True), (2, 3, 6, 3, 3, False), (1, 1, 4, 2, 2, True)]

# ----------------------------------------------------------------------------- bounds
# (kind, d_model, d_ff, d_k, L, ln_eps): both kinds, d_k != d_model (None: d_k = d_model), L = 1,
# eps > 0; each run at every scale of BOUND_SCALES
BOUND_CASES = [
    ("attention", 4, 6, None, 3, 0.0),
    ("attention", 5, 6, 2, 6, 0.0),
    ("attention", 3, 6, 4, 1, 0.0),
    ("block", 4, 6, None, 3, 0.0),
    ("block", 5, 7, 3, 5, 0.0),
    ("block", 3, 5, 2, 1, 0.0),
    ("block", 4, 6, 2, 4, 1e-3),
]
BOUND_SCALES = [0.1, 0.5, 2.0, 10.0]
