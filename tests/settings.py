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


def covered(row: dict, t: int, options: dict = BLOCK_OPTIONS) -> set:
    """The ``t``-tuples of ``(option, value)`` of ``options`` that the configuration ``row`` covers."""
    return {tuple((k, repr(row[k])) for k in ks) for ks in itertools.combinations(options, t)}


def covering_design(t: int = 3, seed: int = 0, options: dict = BLOCK_OPTIONS, valid=None) -> list[dict]:
    """A deterministic greedy ``t``-wise covering array over ``options`` (default
    :data:`BLOCK_OPTIONS`): every combination of any ``t`` option values appears in some row;
    first rows: all first values (the paper's setting), all last values. ``valid``: a predicate on
    a partial assignment ``{option: value}``, false where those values contradict each other (such
    rows are not drawn, such combinations not needed); every option value allowed by default."""
    valid = valid or (lambda row: True)
    need = set()
    for ks in itertools.combinations(options, t):
        for vs in itertools.product(*(options[k] for k in ks)):
            if valid(dict(zip(ks, vs))):
                need.add(tuple((k, repr(v)) for k, v in zip(ks, vs)))
    rng = random.Random(seed)
    rows = [r for r in ({k: v[0] for k, v in options.items()}, {k: v[-1] for k, v in options.items()}) if valid(r)]
    for r in rows:
        need -= covered(r, t, options)
    while need:
        cands = [r for r in ({k: rng.choice(v) for k, v in options.items()} for _ in range(200)) if valid(r)]
        best = max(cands, key=lambda r: len(covered(r, t, options) & need))
        rows.append(best)
        need -= covered(best, t, options)
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

# ----------------------------------------------------------------------------- whole models
# every option of ModelConfig, the loss and the sizes that change a model's stages, the simplest
# value first: "tokens" per sequence before the cls token (1: L = 1 without it), "head" none (the
# output is the last LayerNorm's or block's rows), a linear head or the tied token embedding,
# "loss" as in LOSSES (CE pooled or per token, with or without a head); the blocks' own options
# come from OPTION_DESIGN (conftest.make_model_case)
MODEL_OPTIONS = {
    "embedding": ["linear", "patch", "token", "none"],
    "embed_bias": [True, False],
    "cls_token": [False, True],
    "positions": ["none", "sinusoidal", "learned"],
    "token_types": [0, 2],
    "embed_norm": [False, True],
    "final_norm": [False, True],
    "norm_affine": [True, False],
    "norm_bias": [True, False],
    "norm_eps": [1e-5, 0.0],
    "pool": ["none", "mean", "first"],
    "head": ["none", "linear", "tied"],
    "head_bias": [True, False],
    "loss": ["ce", "mse", "custom"],
    "n_blocks": [1, 2, 3, 4],
    "d_model": [4, 6],
    "tokens": [1, 2, 3],
    "batch": [1, 3],
}


def model_valid(row: dict) -> bool:
    """Whether the (partial) :data:`MODEL_OPTIONS` assignment ``row`` is a model: ``embedding="none"``
    takes ``X_0`` itself (no cls token, no token types), and only a token embedding can be the head."""
    emb = row.get("embedding", "token")
    if emb == "none" and (row.get("cls_token") or row.get("token_types")):
        return False
    return not (row.get("head") == "tied" and emb != "token")


# pairwise: every two option values together in some model; its blocks take OPTION_DESIGN's rows in turn
MODEL_DESIGN = covering_design(2, options=MODEL_OPTIONS, valid=model_valid)
# the sizes every model of the design shares: d_ff, d_k per head (alternating over the blocks:
# d_k != d_model / n_heads), d_in of "linear", vocab of "token", the linear head's width, and the
# image (C, H, W) and patch of "patch" for each "tokens" (patches per image)
MODEL_SIZES = dict(d_ff=3, d_k=(2, 3), d_in=3, vocab=5, head=3)
PATCH_IMAGES = {1: ((1, 2, 2), 2), 2: ((2, 2, 4), 2), 3: ((1, 2, 6), 2)}


def model_id(row: dict) -> str:
    """The test id of a :data:`MODEL_DESIGN` row: the options away from their first value."""
    on = [f"{row['embedding']}", f"N{row['n_blocks']}", f"d{row['d_model']}", f"L{row['tokens']}", f"B{row['batch']}",
          row["loss"], f"pool-{row['pool']}", f"head-{row['head']}"]
    on += [k for k in ("cls_token", "embed_norm", "final_norm") if row[k]]
    on += [f"pos-{row['positions']}"] if row["positions"] != "none" else []
    on += ["types"] if row["token_types"] else []
    on += [f"no-{k}" for k in ("embed_bias", "norm_affine", "norm_bias", "head_bias") if not row[k]]
    on += ["eps0"] if row["norm_eps"] == 0 else []
    return "-".join(on)


MODEL_IDS = [model_id(r) for r in MODEL_DESIGN]
# (model row, its blocks' option rows): the blocks of the design's models take OPTION_DESIGN's rows
# in turn (every row of it in some model, a model's blocks of different settings)
MODEL_CASES = []
for _row in MODEL_DESIGN:
    _start = sum(r["n_blocks"] for r, _ in MODEL_CASES)
    MODEL_CASES.append((_row, [OPTION_DESIGN[(_start + i) % len(OPTION_DESIGN)] for i in range(_row["n_blocks"])]))


def model_row(**options) -> dict:
    """A :data:`MODEL_OPTIONS` assignment: each option's first value, but ``options``."""
    assert set(options) <= set(MODEL_OPTIONS), set(options) - set(MODEL_OPTIONS)
    return {**{k: v[0] for k, v in MODEL_OPTIONS.items()}, **options}


_POST = dict(n_heads=2, bias=True, out_proj=True, ln_affine=True, ln_eps=1e-5, activation="gelu")
_PRE = dict(_POST, norm="pre")
_CAUSAL = dict(_PRE, causal=True, activation="gelu_tanh")
# named models (model row, blocks' options), the usual architectures: a ViT (patches, cls token,
# learned positions, pre-LN, final LayerNorm, the cls token into a head), a BERT (tokens, learned
# positions, token types, embedding LayerNorm, post-LN, per-token CE through the tied embedding), a
# GPT (tokens, causal pre-LN blocks, final LayerNorm, tied head) and an encoder stack on X_0
NAMED_MODELS = {
    "vit": (model_row(embedding="patch", cls_token=True, positions="learned", final_norm=True, pool="first",
                      head="linear", loss="ce", n_blocks=2, tokens=2, batch=3), [_PRE, _PRE]),
    "bert": (model_row(embedding="token", positions="learned", token_types=2, embed_norm=True, pool="none",
                       head="tied", loss="ce", n_blocks=2, tokens=3, batch=3), [_POST, _POST]),
    "gpt": (model_row(embedding="token", positions="learned", final_norm=True, head="tied", head_bias=False,
                      loss="ce", n_blocks=2, tokens=3, batch=3), [_CAUSAL, _CAUSAL]),
    "encoder": (model_row(embedding="none", positions="sinusoidal", final_norm=True, pool="mean", loss="mse",
                          n_blocks=3, tokens=3, batch=3), [{}, _POST, _PRE]),
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
