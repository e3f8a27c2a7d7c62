r"""``blockhess spectrum``: per-block top eigenvalues, spectral density and trace of a model's exact
Hessian and of its outer (Gauss–Newton) and functional parts, matrix-free.

Everything runs on :func:`blockhess.hessian_operator` (exact Hessian-vector products, never the
``n × n`` matrix) and the estimators of :mod:`blockhess.operators.estimators`
(docs/derivations.md §17–§18), for each chosen parameter block ``b`` (the view ``A[b, b]``) and
each part (``full``, ``outer``, ``functional``):

1. the ``--k`` extreme eigenvalues (``--which``) by :func:`~blockhess.operators.lanczos_eigs` to
   the relative residual ``--tol`` of each eigenvalue (each value within its residual of an eigenvalue of
   the block);
   a block of at most ``--dense-below`` parameters by the dense eigendecomposition of ``A[b, b] @ I``
   (method ``"dense"`` in the output, with the reason);
2. the spectral density by stochastic Lanczos quadrature (``--density PROBES,ITERATIONS``), with
   its sampling and quadrature errors, of every block or of those of ``--density-blocks`` (e.g. only
   ``all``, the whole model's: ``--blocks weights,all --density-blocks all``);
3. the trace by Hutch++ (``--trace PRODUCTS``), with its standard error (exact from the columns
   when the block has at most that many parameters);
4. the check: for every block of at most ``--validate-below`` parameters, the eigenvalues against
   the dense eigendecomposition of the dense closed form's block (:func:`blockhess.hessian` with
   ``wrt`` the block's parameters, ``[b, b]``), the trace against its exact trace and the density
   against the exact broadened density. In float64 the eigenvalues pass when each differs from the
   dense one by at most the block residual ``‖A X − X Θ‖_F`` (Kahan's bound: the Ritz values lie that
   close to ``k`` eigenvalues, the extreme ones with probability one) plus ``n·ε·‖A‖₂`` (the rounding
   of the dense eigendecomposition); the agreement relative to ``‖A‖₂`` is reported beside it;
5. with ``--series`` (the digits ViT's training snapshots kept in its checkpoint, then the trained
   weights) or several ``--checkpoint`` files: the top eigenvalues at each point, Lanczos
   warm-started from the previous point's eigenvectors, and the same run cold, with both products
   counts.

Presets (``--preset``): ``digits`` (default): the trained digits ViT of ``make run``
(:mod:`~blockhess_lab.vit`, its default checkpoint as the report loads it), cross-entropy on a
batch of training images; ``gpt2-block``: one GPT-2-small-sized block (pre-LN, d = 768, 12 heads,
d_ff = 3072, GELU-tanh, biases, ``W_O``, affine LayerNorm, causal) with random weights on random
inputs, L = 256, MSE against a random target; ``cifar100-vit``: the paper's CIFAR-100-sized ViT
as the paper's code builds it (8 post-LN blocks, d = 128, d_ff = 512, one head with ``W_O``, biases,
affine LayerNorms, GELU; 4×4 patches of a 3×32×32 image: 64 tokens, 100 classes; 1.6M weights),
random weights on random images and labels, cross-entropy.

With ``--model`` (a causal LM: a preset ``gpt2-small``, ``llama-160m``, ``gpt2-tiny``, ``llama-tiny`` or a
``save_pretrained`` folder) or ``--checkpoints``: per-tensor spectra in lock-step instead,
:mod:`.spectrum_model`.

Writes ``spectrum.json`` (every eigenvalue, residual, products count, method and time; the density
with its errors; the trace with its error; the check; the series), ``spectrum.md`` and the figures
``eigenvalues.png``, ``density.png``, ``trace.png`` (and ``series.png``) into ``--out``, atomically.
Exit status: 0; 1 when the results are written but a check fails, a series' warm-started eigenvalues
disagree with the cold ones beyond their bounds, or an eigenvalue did not converge within
``--max-matvecs``; 2 with one line on stderr for bad input (an unknown block name,
a bad list, options of another preset).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import blockhess as bh
from blockhess import linalg
from blockhess.config import BlockConfig, ModelConfig, init_params, param_shapes
from blockhess.operators import (HessianOperator, NotConvergedError, head_views, hutchpp_trace, lanczos_eigs,
                                 mean_operator, slq_density)
from . import plots
from .bench_worker import peak_bytes
from . import spectrum_model
from . import vit as vitmod
from .outputs import atomic_dir, check_out, out_help, write_json
from .runtime import add_quiet_argument, add_threads_argument, environment, load_average, progress, torch_threads

HELP = ("per-block top eigenvalues, spectral density and trace of a model's exact Hessian and its outer/functional "
        "parts, matrix-free (Lanczos, SLQ, Hutch++), checked against dense eigh where the block fits")

PRESETS = ("digits", "gpt2-block", "cifar100-vit")
PARTS = ("full", "outer", "functional")
WHICH = ("LA", "SA", "LM")
_DTYPES = {"float64": torch.float64, "float32": torch.float32}
#: the block name of the whole operator (every parameter)
ALL = "all"
#: the ``--blocks`` entry that stands for the default blocks, every 2-d parameter
WEIGHTS = "weights"
#: the eigenvalues --which asks for, in words
WANTED = {"LA": "largest", "SA": "smallest", "LM": "largest-magnitude"}
#: points of the density grid stored in the JSON
GRID = 200
#: the agreement with dense eigh the issue asks for (float64), reported beside the check's own bound
AGREEMENT = 1e-8

#: GPT-2 small's block (docs/models.md, "GPT2Block"): random weights, L = 256, batch 8, MSE
GPT2_BLOCK = BlockConfig(d_model=768, d_ff=3072, d_k=64, n_heads=12, norm="pre", activation="gelu_tanh", bias=True,
                         out_proj=True, ln_affine=True, ln_eps=1e-5, causal=True)
GPT2_TOKENS = 256
#: the paper's CIFAR-100-sized ViT as its code builds it (docs/paper reconstruction §5.1): 8 post-LN blocks at
#: d = 128, d_ff = 512, one head with W_O, biases, affine LayerNorms, GELU; 64 tokens; 100 classes (1.6M weights)
CIFAR_BLOCK = BlockConfig(d_model=128, d_ff=512, d_k=128, n_heads=1, norm="post", activation="gelu", bias=True,
                          out_proj=True, ln_affine=True, ln_eps=1e-5)
CIFAR_VIT = ModelConfig(blocks=(CIFAR_BLOCK,) * 8, embedding="patch", image=(3, 32, 32), patch=4,
                        positions="sinusoidal", pool="mean", head=100, head_bias=True)
PRESET_BATCH = {"digits": 128, "gpt2-block": 8, "cifar100-vit": 8}
PRESET_DTYPE = {"digits": "float64", "gpt2-block": "float32", "cifar100-vit": "float32"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="spectrum", metavar="DIR",
                   help=out_help("spectrum", "spectrum.json, spectrum.md, PNG figures"))
    p.add_argument("--preset", choices=PRESETS, default="digits",
                   help="the model: digits (the trained digits ViT of make run), gpt2-block (a GPT-2-small-sized block, "
                        "random weights and inputs, L = 256), cifar100-vit (the paper's CIFAR-100-sized 8-block ViT, "
                        "random weights and images) (default: digits)")
    p.add_argument("--checkpoint", nargs="+", default=None, metavar="PATH",
                   help=f"digits ViT checkpoint(s) to read, each must exist; several: a series over them, the spectra of "
                        f"the last (default: {vitmod.DEFAULT_CHECKPOINT} under the current folder, trained and saved there "
                        "when absent)")
    p.add_argument("--series", action="store_true",
                   help="also the top eigenvalues at each training snapshot the checkpoint keeps and at the trained "
                        "weights, Lanczos warm-started from the previous point's eigenvectors and cold (digits only)")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="sequences per batch (default: 128 training images for digits, 8 for the random presets, "
                        f"{spectrum_model.DEFAULTS['batch']} random sequence with --model)")
    p.add_argument("--batches", type=int, default=1, metavar="N",
                   help="batches: the Hessian of the mean loss over N disjoint batches (blockhess.operators.mean_operator) "
                        "(default: 1)")
    p.add_argument("--blocks", default=None, metavar="LIST",
                   help="comma-separated parameter blocks: parameter names (blocks.0.W_Q), heads (blocks.0.W_Q#1), "
                        "several joined by + as one block (W_E+b_E), all (every parameter), or weights (every weight "
                        "matrix, the blocks' W_* with the embedding W_E and the head W_H) (default: weights)")
    p.add_argument("--parts", default=",".join(PARTS), metavar="LIST",
                   help="comma-separated parts of the Hessian among full, outer, functional (default: all three)")
    p.add_argument("--k", type=int, default=5, metavar="K", help="eigenvalues per block (default: 5)")
    p.add_argument("--which", choices=WHICH, default="LA",
                   help="LA largest, SA smallest (algebraic), LM largest magnitude (default: LA)")
    p.add_argument("--tol", type=float, default=1e-4, metavar="TOL",
                   help="Lanczos relative residual ||Av - lv|| <= TOL * |l| for each eigenvalue l (TOL * the largest "
                        "|Ritz value| s where |l| < TOL * s; default: 1e-4)")
    p.add_argument("--max-matvecs", type=int, default=5000, metavar="N",
                   help="products per Lanczos run before it stops unconverged (default: 5000)")
    p.add_argument("--dense-below", type=int, default=128, metavar="N",
                   help="blocks of at most N parameters take the dense eigendecomposition of A[b,b] @ I (N products) "
                        "instead of Lanczos (default: 128)")
    p.add_argument("--density", default="8,32", metavar="P,M",
                   help="spectral density by SLQ with P probes of M Lanczos steps each, or 0 for none (default: 8,32)")
    p.add_argument("--density-blocks", default=None, metavar="LIST",
                   help="comma-separated entries of --blocks whose density is computed (e.g. all: the whole model's "
                        "alone, with --blocks weights,all) (default: every block)")
    p.add_argument("--trace", type=int, default=30, metavar="N",
                   help="trace by Hutch++ with N products (>= 4), or 0 for none (default: 30)")
    p.add_argument("--validate-below", type=int, default=1024, metavar="N",
                   help="check every block of at most N parameters against the dense closed form's block, or 0 for "
                        "none (default: 1024)")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default=None,
                   help="dtype of the products (default: float64 for digits, float32 for the random presets and --model); the "
                        "dense check is float64")
    p.add_argument("--seed", type=int, default=0, metavar="SEED",
                   help="seed of the batch choice (digits: and of the model when training it), of the random presets' "
                        "weights and inputs, and of the estimators (default: 0)")
    spectrum_model.add_arguments(p)
    add_threads_argument(p)
    add_quiet_argument(p)


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """The estimators' settings of a run (from the command line, checked by :func:`settings`)."""

    parts: tuple[str, ...]
    k: int
    which: str
    tol: float
    max_matvecs: int
    dense_below: int
    density: tuple[int, int] | None
    trace: int
    validate_below: int
    seed: int
    density_blocks: tuple[str, ...] | None = None  # the blocks given a density (None: every block)


def _names_list(option: str, text: str) -> list[str]:
    items = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in items):
        raise ValueError(f"{option} must be a comma-separated list without empty entries, got {text!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"{option} names an entry twice: {text!r}")
    return items


def settings(args: argparse.Namespace) -> Settings:
    """The run's :class:`Settings`; raises ``ValueError`` (one line, naming the option) on a bad one."""
    parts = _names_list("--parts", args.parts)
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise ValueError(f"--parts: unknown part {bad[0]!r}; expected some of {', '.join(PARTS)}")
    for option, value, low in (("--k", args.k, 1), ("--max-matvecs", args.max_matvecs, 1), ("--batches", args.batches, 1),
                               ("--dense-below", args.dense_below, 0), ("--validate-below", args.validate_below, 0),
                               ("--seed", args.seed, 0)):
        if value < low:
            raise ValueError(f"{option} must be >= {low}, got {value}")
    if args.batch is not None and args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    if not (math.isfinite(args.tol) and 0 < args.tol < 1):
        raise ValueError(f"--tol must be in (0, 1), got {args.tol:g}")
    eps = torch.finfo(_DTYPES[args.dtype or PRESET_DTYPE[args.preset]]).eps
    if args.tol <= eps:
        raise ValueError(f"--tol must be above the dtype's epsilon {eps:.3g}, got {args.tol:g}")
    density = None
    if args.density.strip() != "0":
        try:
            P, M = (int(s) for s in args.density.split(","))
        except ValueError:
            raise ValueError(f"--density must be PROBES,ITERATIONS (two integers) or 0, got {args.density!r}") from None
        if P < 2 or M < 2:
            raise ValueError(f"--density needs at least 2 probes and 2 iterations, got {args.density!r}")
        density = (P, M)
    if args.trace != 0 and args.trace < 4:
        raise ValueError(f"--trace must be 0 (none) or at least 4 products, got {args.trace}")
    if args.preset != "digits" and (args.series or args.checkpoint):
        raise ValueError(f"--series and --checkpoint are for the digits preset (its training snapshots and "
                         f"checkpoints); --preset {args.preset} has random weights")
    if args.series and args.checkpoint and len(args.checkpoint) > 1:
        raise ValueError("--series is the series over one checkpoint's training snapshots; several --checkpoint paths "
                         "are a series over them: give one or the other")
    density_blocks = None
    if args.density_blocks is not None:
        if density is None:
            raise ValueError("--density-blocks chooses the blocks given a density; with --density 0 there is none")
        density_blocks = tuple(_names_list("--density-blocks", args.density_blocks))
    return Settings(tuple(parts), args.k, args.which, float(args.tol), args.max_matvecs, args.dense_below, density,
                    args.trace, args.validate_below, args.seed, density_blocks)


# ----------------------------------------------------------------------------- the problem


@dataclass
class Problem:
    """What the spectra are of: a config, its parameters, the batches (``(inputs, target)`` each),
    the loss, and a series of other parameter settings (``[(label, step or None, params)]``)."""

    preset: str
    cfg: BlockConfig | ModelConfig
    params: dict
    batches: list
    loss: str
    model: dict
    checkpoint: list | None = None
    series: list = field(default_factory=list)
    series_kind: str | None = None


def _digits(args, dtype, quiet) -> Problem:
    paths = args.checkpoint or [None]
    vits = [vitmod.load_for_command(p, quiet=quiet, seed=args.seed) for p in paths]
    vit = vits[-1]
    for p, other in zip(paths, vits):
        if other.arch != vit.arch:
            raise ValueError(f"--checkpoint {p} holds a digits ViT of another architecture ({other.arch}) than "
                             f"{paths[-1]} ({vit.arch}): a series needs one model")
    batch = PRESET_BATCH["digits"] if args.batch is None else args.batch
    vitmod.check_batch("--batch" if args.batches == 1 else "--batch times --batches", batch * args.batches, len(vit.train_labels))
    gen = torch.Generator().manual_seed(args.seed + 3)  # the report's batch choice for --batches 1
    order = torch.randperm(len(vit.train_labels), generator=gen)
    batches = []
    for i in range(args.batches):
        idx = order[i * batch : (i + 1) * batch].sort().values
        batches.append((vit.model_inputs(vit.train_images[idx], dtype), vit.train_labels[idx]))
    series, kind = [], None
    if len(vits) > 1:
        series = [(str(p), None, v.model_params(dtype)) for p, v in zip(paths, vits)]
        kind = "checkpoints"
    elif args.series:
        if not vit.snapshots:
            raise ValueError(f"--series: the checkpoint {vit.checkpoint} keeps no training snapshots (format "
                             f"{vit.train_info.get('format_version')}); delete it to train again with them")
        steps = sorted(vit.snapshots)
        series = [(f"step {s}", s, vit.at_step(s).model_params(dtype)) for s in steps]
        final = int(vit.train_info.get("steps", -1))
        if final not in vit.snapshots:
            series.append((f"step {final} (trained)", final, vit.model_params(dtype)))
        kind = "snapshots"
    model = {"preset": "digits", **vit.arch, "tokens": vit.n_tokens, "classes": vitmod.N_CLASSES,
             "test_accuracy": vit.test_accuracy, "loss": "cross-entropy of the whole model"}
    return Problem("digits", vit.model_cfg, vit.model_params(dtype), batches, "ce", model,
                   [v.checkpoint for v in vits], series, kind)


def _random(args, dtype) -> Problem:
    batch = PRESET_BATCH[args.preset] if args.batch is None else args.batch
    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = []
    if args.preset == "gpt2-block":
        cfg, L = GPT2_BLOCK, GPT2_TOKENS
        for _ in range(args.batches):
            X = torch.randn(batch, L, cfg.d_model, generator=gen, dtype=torch.float64).to(dtype)
            T = torch.randn(batch, L, cfg.d_model, generator=gen, dtype=torch.float64).to(dtype)
            batches.append((X, T))
        loss = "mse"
        model = {"preset": args.preset, "d_model": cfg.d_model, "d_ff": cfg.d_ff, "n_heads": cfg.n_heads, "tokens": L,
                 "norm": cfg.norm, "activation": cfg.activation, "causal": cfg.causal,
                 "loss": "MSE against a random N(0, 1) target", "inputs": "N(0, 1)"}
    else:
        cfg = CIFAR_VIT
        for _ in range(args.batches):
            x = torch.rand(batch, *cfg.image, generator=gen, dtype=torch.float64).to(dtype)
            y = torch.randint(0, cfg.head, (batch,), generator=gen)
            batches.append((x, y))
        loss = "ce"
        b = cfg.blocks[0]
        model = {"preset": args.preset, "n_blocks": len(cfg.blocks), "d_model": b.d_model, "d_ff": b.d_ff,
                 "tokens": (cfg.image[1] // cfg.patch) * (cfg.image[2] // cfg.patch), "classes": cfg.head,
                 "loss": "cross-entropy against random labels", "inputs": "U(0, 1) images 3x32x32"}
    return Problem(args.preset, cfg, init_params(cfg, seed=args.seed, dtype=dtype), batches, loss, model)


def block_keys(spec: str | None, cfg) -> list[str]:
    """The blocks of ``--blocks`` (default: every 2-d parameter of ``cfg``, canonical order), each a
    variable name, a head's ``W_Q#h``, names joined by ``+``, :data:`ALL`, or :data:`WEIGHTS` (the default
    blocks, in place). Raises ``ValueError``
    (one line) naming an unknown or overlapping name and the known ones."""
    shapes = param_shapes(cfg)
    weights = [n for n, s in shapes.items() if len(s) == 2]
    if spec is None:
        return weights
    split = head_views(cfg)
    known = set(shapes) | {v for v, (p, _, _) in split.items() if p in shapes}
    keys = _names_list("--blocks", spec)
    if WEIGHTS in keys:
        i = keys.index(WEIGHTS)
        keys = keys[:i] + [n for n in weights if n not in keys] + keys[i + 1:]
    for key in keys:
        if key == ALL:
            continue
        members = key.split("+")
        for m in members:
            if m not in known:
                heads = " and heads such as " + next(iter(split)) if split else ""
                names = list(shapes) if len(shapes) <= 24 else [*list(shapes)[:20], f"... ({len(shapes)} in all)"]
                raise ValueError(f"--blocks: unknown block {m!r}; this model has {', '.join(names)}{heads} "
                                 f"(or {ALL}, {WEIGHTS})")
        owners = [split[m][0] if m in split else m for m in members]
        if len(set(members)) != len(members) or any(m in shapes and owners.count(m) > 1 for m in members):
            raise ValueError(f"--blocks: {key!r} joins overlapping variables")
    return keys


def _view(A: HessianOperator, key: str) -> HessianOperator:
    if key == ALL:
        return A
    members = tuple(key.split("+"))
    sel = members[0] if len(members) == 1 else members
    return A[sel, sel]


def _wrt(key: str, cfg) -> list[str] | None:
    """The parameters a block's dense check needs (``None``: all)."""
    if key == ALL:
        return None
    split = head_views(cfg)
    return list(dict.fromkeys(split[m][0] if m in split else m for m in key.split("+")))


def _operator(problem: Problem, params: dict, part: str, quiet: bool) -> HessianOperator:
    ops = [bh.hessian_operator(params, x, problem.cfg, loss=problem.loss, target=y, part=part) for x, y in problem.batches]
    return ops[0] if len(ops) == 1 else mean_operator(ops, progress=not quiet)


# ----------------------------------------------------------------------------- estimators


def _eigs(A: HessianOperator, s: Settings, v0=None) -> tuple[dict, torch.Tensor]:
    """Top eigenvalues of the square view ``A``: ``(record, eigenvectors)``; an unconverged run is
    recorded with ``converged: false`` (never a silent number)."""
    n = A.shape[0]
    k = min(s.k, n)
    t = time.perf_counter()
    try:
        r = lanczos_eigs(A, k=k, which=s.which, tol=s.tol, max_matvecs=s.max_matvecs, seed=s.seed, v0=v0,
                         dense_below=s.dense_below)
    except NotConvergedError as exc:
        r, why = exc.result, str(exc)
    else:
        why = None
    seconds = time.perf_counter() - t
    res = r.residuals.double()
    rec = {
        "n": n, "k": k, "method": r.method,
        "method_reason": (f"n = {n} <= --dense-below {s.dense_below}: dense eigendecomposition of A[b,b] @ I "
                          f"({n} products)" if r.method == "dense" else
                          "the closed form shows A[b,b] = M kron I exactly (a pre-LN block's W_2 under MSE): the "
                          "eigenpairs from M's eigendecomposition, each value with its multiplicity"
                          if r.method == "kronecker" else
                          f"block Lanczos, full reorthogonalisation, Krylov-Schur restarts, to relative residual {s.tol:g} "
                          f"(rel={r.rel!r}: of each |eigenvalue|, or of the scale for one below tol x scale)"),
        "eigenvalues": r.eigenvalues.double().tolist(), "residuals": res.tolist(), "scale": r.scale,
        "bounds": r.bounds.double().tolist(), "rel": r.rel,
        "relative_residuals": (res / (r.bounds.double() / r.tol)).tolist() if r.scale > 0 else res.tolist(),
        "block_residual": float(res.norm()), "converged": r.converged, "matvecs": r.matvecs,
        "check_matvecs": r.check_matvecs, "miss_probability": r.miss_probability,
        "iterations": r.iterations, "restarts": r.restarts, "seconds": seconds, "warm_start": v0 is not None,
    }
    if why is not None:
        rec["not_converged_why"] = why
    return rec, r.eigenvectors


def _density(A: HessianOperator, s: Settings) -> tuple:
    P, M = s.density
    t = time.perf_counter()
    d = slq_density(A, n_probes=P, n_iter=M, seed=s.seed, grid=2)
    return d, time.perf_counter() - t


def _common_densities(parts: dict) -> None:
    """Each part's SLQ density of one block on one grid with one width (the parts' largest default
    width ``spread / iterations``, leaving out parts whose nodes are one value, such as an exactly zero
    functional part, whose default width has no scale; the grid over every part's nodes ± 5 widths), so
    that the parts compare: ``parts[part]["density"]``, from the ``"_slq"`` results."""
    res = {part: r["_slq"][0] for part, r in parts.items() if "_slq" in r}
    if not res:
        return
    used = {part: d.nodes[d.weights > 0] for part, d in res.items()}
    wide = [res[part] for part, u in used.items() if u.max() > u.min()]  # one node value (e.g. exactly zero): no spread
    sigma = max(d.sigma for d in (wide or res.values()))
    lo = min(float(u.min()) for u in used.values()) - 5 * sigma
    hi = max(float(u.max()) for u in used.values()) + 5 * sigma
    grid = torch.linspace(lo, hi, GRID, dtype=torch.float64)
    for part, d in res.items():
        dens, se, quad = d.broaden(grid.to(d.nodes.dtype), sigma)
        parts[part]["density"] = {
            "probes": d.n_probes, "iterations": d.n_iter, "matvecs": d.matvecs, "reorth": d.reorth, "sigma": sigma,
            "sigma_rule": "the block's parts' largest spread of nodes / iterations (parts whose nodes are one value left out)",
            "grid": grid.tolist(),
            "density": dens.double().tolist(), "stderr": se.double().tolist(),
            "quadrature_error": quad.double().tolist(), "seconds": parts[part]["_slq"][1]}


def _trace(A: HessianOperator, s: Settings) -> dict:
    t = time.perf_counter()
    e = hutchpp_trace(A, n_matvecs=s.trace, seed=s.seed)
    return {"value": float(e.value), "stderr": float(e.stderr), "matvecs": e.matvecs, "exact": e.exact,
            "method": "exact (the columns)" if e.exact else "Hutch++", "seconds": time.perf_counter() - t}


def _product_seconds(A: HessianOperator, seed: int) -> float:
    """Wall seconds of one product with one random vector over every parameter, after one untimed
    product (first-call costs kept out)."""
    v = torch.randn(A.shape[0], 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(A.dtype)
    A @ v
    t = time.perf_counter()
    A @ v
    return time.perf_counter() - t


def spectra(problem: Problem, keys: list[str], s: Settings, quiet: bool) -> dict:
    """Every block's and part's eigenvalues, density and trace: ``{"blocks": {key: {part: record}},
    "operators": {part: timings}}``."""
    out = {key: {} for key in keys}
    ops = {}
    bar = progress(None, quiet, total=len(keys) * len(s.parts), desc="spectra", unit="block")
    with bar:
        for part in s.parts:
            t = time.perf_counter()
            A = _operator(problem, problem.params, part, quiet)
            built = time.perf_counter() - t
            ops[part] = {"n": A.shape[0], "operator_seconds": built, "product_seconds": _product_seconds(A, s.seed),
                         "what": "operator_seconds: the forward pass, loss derivatives and adjoints kept; "
                                 "product_seconds: one product with one vector over every parameter (after one "
                                 "untimed)"}
            for key in keys:
                bar.set_postfix_str(f"{part} {key}")
                V = _view(A, key)
                rec, _ = _eigs(V, s)
                if s.density is not None and (s.density_blocks is None or key in s.density_blocks):
                    rec["_slq"] = _density(V, s)
                if s.trace:
                    rec["trace"] = _trace(V, s)
                out[key][part] = rec
                bar.update()
            del A, V  # one part's operator in memory at a time
    for parts in out.values():
        _common_densities(parts)
    return {"blocks": out, "operators": ops}


# ----------------------------------------------------------------------------- the dense check


def _select(lam: torch.Tensor, k: int, which: str) -> torch.Tensor:
    if which == "LA":
        return lam.sort(descending=True).values[:k]
    if which == "SA":
        return lam.sort().values[:k]
    return lam[lam.abs().argsort(descending=True)[:k]]


def validate(problem: Problem, keys: list[str], results: dict, s: Settings, dtype, quiet: bool) -> dict:
    """Every block of at most ``--validate-below`` parameters against the dense closed form's block
    (float64, all batches together: their mean loss is the mean over their sequences)."""
    n_of = {key: next(iter(results[key].values()))["n"] for key in keys}
    todo = [key for key in keys if s.validate_below and n_of[key] <= s.validate_below]
    out = {"below": s.validate_below, "blocks": {}, "skipped": [k for k in keys if k not in todo],
           "rule": "float64: |lanczos - dense| <= ||A X - X Theta||_F (Kahan) + n eps ||A||_2 for each eigenvalue "
                   "(both sorted); trace and density are reported beside their stated errors, not judged (random)",
           "dense": "eigvalsh of the dense closed form's block, bh.hessian(params, inputs, cfg, wrt=the block's "
                    "parameters)[b, b], in float64"}
    if not todo:
        out["passed"] = None
        return out
    params64 = {n: v.to(torch.float64) for n, v in problem.params.items()}
    x = torch.cat([b[0] for b in problem.batches]).to(torch.float64)
    y = torch.cat([b[1] for b in problem.batches])
    if y.is_floating_point():
        y = y.to(torch.float64)
    eps = torch.finfo(dtype).eps
    worst_rel, passed = 0.0, True
    for key in progress(todo, quiet, desc="dense check", unit="block"):
        t = time.perf_counter()
        try:  # raised before any work where the closed form's pass over a sequence does not fit
            H = bh.hessian(params64, x, problem.cfg, loss=problem.loss, target=y, wrt=_wrt(key, problem.cfg))
        except bh.InsufficientMemoryError as e:
            out["skipped"].append(key)
            out.setdefault("skipped_why", {})[key] = str(e)
            continue
        seconds = time.perf_counter() - t
        mats = {"full": H, "outer": H.outer, "functional": H.functional}
        rec = {"seconds_closed_form": seconds, "parts": {}}
        for part, r in results[key].items():
            if not r["converged"]:  # an unconverged run is reported as such, not judged against dense eigh
                rec["parts"][part] = {"not_judged": "the Lanczos run did not converge (its record says why)"}
                continue
            M = _view(HessianOperator.from_dense(mats[part]), key).dense()
            lam = linalg.eigvalsh(M)
            norm = float(lam.abs().max())
            dense = _select(lam, r["k"], s.which).sort().values
            got = torch.tensor(r["eigenvalues"], dtype=torch.float64).sort().values
            diff = (got - dense).abs()
            bound = r["block_residual"] + M.shape[0] * eps * norm
            rel = float(diff.max()) / norm if norm > 0 else float(diff.max())
            ok = bool((diff <= bound).all())
            p = {"dense_eigenvalues": dense.tolist(), "abs_diff": diff.tolist(), "bound": bound, "norm2": norm,
                 "max_rel_diff": rel, f"agrees_to_{AGREEMENT:g}": rel <= AGREEMENT,
                 "passed": ok if dtype == torch.float64 else None}
            if "trace" in r:
                tr = float(lam.sum())
                p["trace_exact"] = tr
                e = r["trace"]
                p["trace_z"] = (e["value"] - tr) / e["stderr"] if e["stderr"] > 0 else None
                p["trace_abs_error"] = abs(e["value"] - tr)
            if "density" in r:
                d = r["density"]
                grid, sigma = torch.tensor(d["grid"], dtype=torch.float64), d["sigma"]
                z = (grid[:, None] - lam[None, :]) / sigma
                exact = torch.exp(-0.5 * z * z).sum(1) / (lam.numel() * sigma * math.sqrt(2 * math.pi))
                err = (torch.tensor(d["density"], dtype=torch.float64) - exact).abs()
                stated = torch.tensor(d["stderr"], dtype=torch.float64) + torch.tensor(d["quadrature_error"],
                                                                                       dtype=torch.float64)
                p["density_max_abs_error"] = float(err.max())
                p["density_max_stated_error"] = float(stated.max())
                p["density_peak"] = float(exact.max())
            rec["parts"][part] = p
            worst_rel = max(worst_rel, rel)
            passed = passed and ok
        out["blocks"][key] = rec
    out["max_rel_diff"] = worst_rel
    out["passed"] = (passed if dtype == torch.float64 else None) if out["blocks"] else None
    if dtype != torch.float64:
        out["not_judged"] = ("float32 products: their rounding is not bounded by the residual rule; the differences are "
                             "reported")
    return out


# ----------------------------------------------------------------------------- the series


def series(problem: Problem, keys: list[str], s: Settings, quiet: bool) -> dict:
    """The top eigenvalues at each point of ``problem.series``, Lanczos warm-started from the previous
    point's eigenvectors (same block, same part) and cold, with both products counts."""
    points = problem.series
    rows = {key: {part: [] for part in s.parts} for key in keys}
    prev = {}
    total = {"warm": 0, "cold": 0}
    disagree = []
    bar = progress(None, quiet, total=len(points) * len(s.parts) * len(keys), desc="series", unit="block")
    with bar:
        for i, (label, step, params) in enumerate(points):
            for part in s.parts:
                A = _operator(problem, params, part, quiet)
                for key in keys:
                    bar.set_postfix_str(f"{label} {part} {key}")
                    V = _view(A, key)
                    cold, vec = _eigs(V, s)
                    row = {"label": label, "step": step, "eigenvalues": cold["eigenvalues"],
                           "residuals": cold["residuals"], "converged": cold["converged"], "method": cold["method"],
                           "matvecs_cold": cold["matvecs"], "seconds_cold": cold["seconds"]}
                    if i > 0:
                        warm, vec = _eigs(V, s, v0=prev[key, part])
                        row.update(eigenvalues=warm["eigenvalues"], residuals=warm["residuals"],
                                   converged=warm["converged"] and cold["converged"],
                                   matvecs_warm=warm["matvecs"], check_matvecs_warm=warm["check_matvecs"],
                                   seconds_warm=warm["seconds"],
                                   eigenvalues_cold=cold["eigenvalues"],
                                   max_abs_diff_warm_cold=max(abs(a - b) for a, b in zip(warm["eigenvalues"],
                                                                                         cold["eigenvalues"])),
                                   diff_bound=_agreement_bound(warm, cold))
                        row["agree"] = not row["converged"] or row["max_abs_diff_warm_cold"] <= row["diff_bound"]
                        if not row["agree"]:
                            disagree.append({"block": key, "part": part, "label": label, "step": step,
                                             "max_abs_diff": row["max_abs_diff_warm_cold"],
                                             "bound": row["diff_bound"]})
                        if cold["method"] == "lanczos":
                            total["warm"] += warm["matvecs"]
                            total["cold"] += cold["matvecs"]
                    prev[key, part] = vec
                    rows[key][part].append(row)
                    bar.update()
                del A, V
    return {"kind": problem.series_kind, "labels": [p[0] for p in points], "steps": [p[1] for p in points],
            "blocks": rows, "matvecs_after_the_first": total, "disagreements": disagree,
            "what": "at each point the top eigenvalues (warm-started from the previous point's eigenvectors after the "
                    "first); matvecs_after_the_first: products of every Lanczos run (dense blocks left out: n products "
                    "either way) after the first point, warm-started and cold; disagreements: the points where both "
                    "converged and the warm and the cold eigenvalues differ by more than diff_bound (each set within "
                    "its k-th bound plus its residuals' norm of the true top k), which fail the run"}


def _agreement_bound(warm: dict, cold: dict) -> float:
    """How far a converged warm-started and a cold set of the same operator's eigenvalues may differ: each
    lies within its ``k``-th bound plus its residuals' Frobenius norm of the wanted eigenvalues (the check's
    statement, :func:`~blockhess.operators.lanczos_eigs`), so their sum."""
    return warm["bounds"][-1] + cold["bounds"][-1] + warm["block_residual"] + cold["block_residual"]


# ----------------------------------------------------------------------------- figures and text


def label(key: str, cfg) -> str:
    """A short figure label: the block's names without ``blocks.0.`` for one block (``blocks.`` for several)."""
    n = len(cfg.blocks) if isinstance(cfg, ModelConfig) else 0
    strip = "blocks.0." if n == 1 else "blocks."
    return "+".join(m.removeprefix(strip) for m in key.split("+"))


def figures(tmp: Path, problem: Problem, res: dict, ser: dict | None, s: Settings) -> list[str]:
    """Write ``eigenvalues.png`` and, where computed, ``density.png``, ``trace.png`` and ``series.png``
    into ``tmp``; returns their names."""
    labels = {key: label(key, problem.cfg) for key in res["blocks"]}
    title = {"digits": "digits ViT (trained)", "gpt2-block": "GPT-2-small-sized block (random)",
             "cifar100-vit": "CIFAR-100-sized ViT (random)"}[problem.preset]
    out = []
    eig = {part: {labels[k]: (r[part]["eigenvalues"], r[part]["method"]) for k, r in res["blocks"].items()}
           for part in s.parts}
    plots.block_eigenvalues(tmp / "eigenvalues.png", eig, f"{title}: {WANTED[s.which]} {s.k} eigenvalues per block "
                                                          f"({s.which}; at most n of a block)")
    out.append("eigenvalues.png")
    dens = {k: r[s.parts[0]]["density"] for k, r in res["blocks"].items()
            if s.density is not None and "density" in r[s.parts[0]]}  # one grid and width per block (_common_densities)
    if dens:
        panel = {k: f"{labels[k]} (σ = {d['sigma']:.2g})" for k, d in dens.items()}
        curves = {panel[k]: {part: tuple(res["blocks"][k][part]["density"][f] for f in ("grid", "density", "stderr"))
                             for part in s.parts} for k in dens}
        one = {panel[k]: 0.1 / (res["blocks"][k][s.parts[0]]["n"] * d["sigma"] * math.sqrt(2 * math.pi))
               for k, d in dens.items()}  # a tenth of one eigenvalue's broadened peak
        plots.densities(tmp / "density.png", curves, f"{title}: spectral density (SLQ, {s.density[0]} probes "
                                                     f"x {s.density[1]} steps; band: ±1 standard error; σ: the "
                                                     "Gaussian width)", floors=one)
        out.append("density.png")
    if s.trace:
        tr = {part: {labels[k]: (r[part]["trace"]["value"], r[part]["trace"]["stderr"]) for k, r in res["blocks"].items()}
              for part in s.parts}
        plots.trace_bars(tmp / "trace.png", tr, f"{title}: trace per block (Hutch++, {s.trace} products; bars: ±2 "
                                                f"standard errors)")
        out.append("trace.png")
    if ser is not None:
        traj = {labels[k]: {part: [row["eigenvalues"] for row in rows] for part, rows in parts.items()}
                for k, parts in ser["blocks"].items()}
        x = ser["steps"] if all(st is not None for st in ser["steps"]) else list(range(len(ser["labels"])))
        warm = [sum(rows[i].get("matvecs_warm", 0) for parts in ser["blocks"].values() for rows in parts.values()
                    if rows[i]["method"] == "lanczos") for i in range(len(x))]
        cold = [sum(rows[i]["matvecs_cold"] for parts in ser["blocks"].values() for rows in parts.values()
                    if rows[i]["method"] == "lanczos") for i in range(len(x))]
        plots.eigenvalue_trajectories(tmp / "series.png", x, traj, {"warm start": warm[1:], "cold": cold[1:]}, x[1:],
                                      "training step" if ser["kind"] == "snapshots" else "checkpoint",
                                      f"{title}: top eigenvalues over {ser['kind']}", ticks=None if
                                      ser["kind"] == "snapshots" else [Path(p).stem for p in ser["labels"]])
        out.append("series.png")
    return out


def _g(x: float) -> str:
    return f"{x:.4g}"


def markdown(rep: dict) -> str:
    """``spectrum.md``: the settings, a table per part, the check, the series' products and the run time."""
    s, res = rep["settings"], rep["spectra"]
    lines = [f"# blockhess spectrum: {rep['preset']}", "",
             f"Model: {', '.join(f'{k} {v:.4g}' if isinstance(v, float) else f'{k} {v}' for k, v in rep['model'].items() if k != 'preset')}. "
             f"{rep['sequences']} sequences ({rep['batches']} batch{'es' if rep['batches'] > 1 else ''} of "
             f"{rep['batch']}), {rep['n_params']:,} parameters, products in {rep['dtype']}.", "",
             f"{WANTED[s['which']].capitalize()} {s['k']} eigenvalue{'s' * (s['k'] != 1)} ({s['which']}; at most n of a "
             f"block) per block: Lanczos to relative residual {s['tol']:g}; blocks of "
             f"at most {s['dense_below']} parameters by dense eigh of A[b,b] @ I (method `dense`). Density: "
             + (f"SLQ, {s['density'][0]} probes x {s['density'][1]} steps"
                + ("" if s["density_blocks"] == s["blocks"] else f", of {', '.join(s['density_blocks'])}")
                if s["density"] else "none")
             + ". Trace: " + (f"Hutch++, {s['trace']} products" if s["trace"] else "none") + ".", ""]
    for part in s["parts"]:
        lines += [f"## {part}", "", f"| block | n | method | {WANTED[s['which']]} eigenvalues | max rel. residual | products | s | "
                  "trace ± se |",
                  "|---|---|---|---|---|---|---|---|"]
        for key, parts in res["blocks"].items():
            r = parts[part]
            tr = f"{_g(r['trace']['value'])} ± {r['trace']['stderr']:.2g}" if "trace" in r else ""
            lines.append(f"| `{key}` | {r['n']:,} | {r['method']}{'' if r['converged'] else ' (NOT converged)'} | "
                         f"{', '.join(_g(v) for v in r['eigenvalues'])} | {max(r['relative_residuals']):.1e} | "
                         f"{r['matvecs']} | {r['seconds']:.2f} | {tr} |")
        op = res["operators"][part]
        lines += ["", f"Operator built in {op['operator_seconds']:.2f} s; one product (one vector, every parameter) "
                      f"{op['product_seconds']:.3f} s.", ""]
    v = rep["validation"]
    lines += ["## Check against dense eigh", ""]
    why = v.get("skipped_why", {})
    if why:
        lines += [f"Not checked, the dense closed form would not fit in memory: {', '.join(f'`{k}`' for k in why)} "
                  f"({next(iter(why.values()))}).", ""]
    if not v["blocks"]:
        lines += [f"No block has at most {v['below']} parameters: nothing checked." if not why else
                  "Nothing checked.", ""]
    else:
        verdict = {True: "passed", False: "FAILED", None: "not judged (float32)"}[v["passed"]]
        nb = len(v["blocks"])
        lines += [f"{nb} block{'s' * (nb != 1)} against the dense closed form's block ({v['dense']}): {verdict}; largest "
                  f"|lanczos - dense| / ||A||_2 = {v['max_rel_diff']:.1e} (rule: {v['rule']}).", ""]
    if rep.get("series"):
        t = rep["series"]["matvecs_after_the_first"]
        lines += ["## Series", "", f"{len(rep['series']['labels'])} points ({rep['series']['kind']}): "
                  f"{', '.join(rep['series']['labels'])}. Lanczos products after the first point: {t['warm']:,} "
                  f"warm-started, {t['cold']:,} cold. Warm and cold agree within their bounds "
                  + ("everywhere." if not rep["series"]["disagreements"] else
                     f"except at {len(rep['series']['disagreements'])} point(s): FAILED (series.disagreements)."), ""]
    lines += ["Figures: " + ", ".join(f"`{f}`" for f in rep["figures"]) + ".", "",
              f"Run time {rep['timings']['total_s']:.1f} s (load average {_load(rep['environment'])}); peak resident "
              f"memory {rep['timings']['peak_rss_bytes'] / 2**30:.2f} GiB.", ""]
    return "\n".join(lines)


def _load(env: dict) -> str:
    a, b = env.get("load_average_at_start"), env.get("load_average_at_end")
    return "n/a" if a is None else f"{a[0]:.2f} at the start, {b[0]:.2f} at the end" if b else f"{a[0]:.2f} at the start"


def _public(x):
    if isinstance(x, dict):
        return {k: _public(v) for k, v in x.items() if not (isinstance(k, str) and k.startswith("_"))}
    if isinstance(x, list):
        return [_public(v) for v in x]
    return x


# ----------------------------------------------------------------------------- the command


def _precheck(args: argparse.Namespace, s: Settings) -> None:
    """The options that depend on the model, checked before any work where the model is known
    without it: the random presets, and the digits ViT that would be trained (no checkpoint yet)."""
    if args.preset == "digits":
        plan = vitmod.would_train(args.checkpoint[-1] if args.checkpoint else None, seed=args.seed)
        if plan is None:
            return  # a checkpoint is read (quick) and the options are checked against it in _run
        cfg = vitmod.model_config(plan["arch"])
        batch = PRESET_BATCH["digits"] if args.batch is None else args.batch
        vitmod.check_batch("--batch" if args.batches == 1 else "--batch times --batches", batch * args.batches,
                           plan["n_train"])
    else:
        cfg = GPT2_BLOCK if args.preset == "gpt2-block" else CIFAR_VIT
    _density_keys(block_keys(args.blocks, cfg), s)


def _density_keys(keys: list[str], s: Settings) -> None:
    extra = [b for b in s.density_blocks or () if b not in keys]
    if extra:
        raise ValueError(f"--density-blocks: {extra[0]!r} is not among the blocks of --blocks ({', '.join(keys)})")


def run(args: argparse.Namespace) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    if spectrum_model.wanted(args, parser.get_default):
        spectrum_model.check(args)
        check_out(args.out)
        with torch_threads(args.threads):
            return spectrum_model.run(args)
    s = settings(args)
    _precheck(args, s)
    check_out(args.out)
    with torch_threads(args.threads):
        return _run(args, s)


def _run(args: argparse.Namespace, s: Settings) -> int:
    quiet = bool(args.quiet)
    dtype = _DTYPES[args.dtype or PRESET_DTYPE[args.preset]]
    out = Path(args.out)
    t0 = time.perf_counter()
    with atomic_dir(out) as tmp:
        env = environment()
        problem = _digits(args, dtype, quiet) if args.preset == "digits" else _random(args, dtype)
        keys = block_keys(args.blocks, problem.cfg)
        _density_keys(keys, s)
        res = spectra(problem, keys, s, quiet)
        val = validate(problem, keys, res["blocks"], s, dtype, quiet)
        ser = series(problem, keys, s, quiet) if problem.series else None
        figs = figures(tmp, problem, res, ser, s)
        converged = all(r["converged"] for parts in res["blocks"].values() for r in parts.values())
        disagree = ser["disagreements"] if ser is not None else []
        if ser is not None:
            converged = converged and all(row["converged"] for parts in ser["blocks"].values()
                                          for rows in parts.values() for row in rows)
        n_seq = sum(b[0].shape[0] for b in problem.batches)
        rep = {
            "command": "blockhess spectrum", "preset": problem.preset, "model": problem.model,
            "checkpoint": problem.checkpoint, "batch": problem.batches[0][0].shape[0], "batches": len(problem.batches),
            "sequences": n_seq, "dtype": str(dtype).removeprefix("torch."),
            "n_params": sum(math.prod(v.shape) for v in problem.params.values()),
            "sizes": {n: math.prod(v.shape) for n, v in problem.params.items()},
            "settings": {"parts": list(s.parts), "blocks": keys, "k": s.k, "which": s.which, "tol": s.tol,
                         "max_matvecs": s.max_matvecs, "dense_below": s.dense_below,
                         "density": list(s.density) if s.density else None, "density_grid": GRID,
                         "density_blocks": list(s.density_blocks or keys) if s.density else [], "trace": s.trace,
                         "validate_below": s.validate_below, "seed": s.seed},
            "spectra": res, "validation": val, "series": ser, "converged": converged,
            "environment": env, "figures": figs,
        }
        rep["environment"]["load_average_at_end"] = load_average()
        rep["timings"] = {"total_s": time.perf_counter() - t0, "peak_rss_bytes": peak_bytes()}
        rep = _public(rep)
        write_json(tmp / "spectrum.json", rep)
        (tmp / "spectrum.md").write_text(markdown(rep))
    failed = val["passed"] is False or bool(disagree)
    if disagree:
        d = disagree[0]
        print(f"blockhess spectrum: --series: the warm-started and the cold eigenvalues disagree at {len(disagree)} "
              f"point(s) (first: {d['block']} {d['part']} at {d['label']}: {d['max_abs_diff']:.3g} > their bound "
              f"{d['bound']:.3g}); see {out}/spectrum.json, series.disagreements", file=sys.stderr)
    if not converged:
        first = next(((k, p, r) for k, parts in res["blocks"].items() for p, r in parts.items() if not r["converged"]),
                     None)  # None: only the series did not converge
        where = f" (first: {first[0]} {first[1]}: {first[2].get('not_converged_why', 'unconverged')})" if first else ""
        print(f"blockhess spectrum: an eigenvalue did not converge{where}; see {out}/spectrum.json, converged: false",
              file=sys.stderr)
    if failed:
        print(f"blockhess spectrum: the check against dense eigh FAILED (see {out}/spectrum.json, validation)",
              file=sys.stderr)
    if not quiet:
        v = ("checked " + (f"{len(val['blocks'])} block{'s' * (len(val['blocks']) != 1)} against dense eigh, largest difference "
                           f"{val['max_rel_diff']:.1e} of ||A||_2" if val["blocks"] else "no block (none small enough)" if
                           not val.get("skipped_why") else "no block (the dense closed form would not fit)"))
        nb, npart = len(keys), len(s.parts)
        what = f"{nb} block{'s' * (nb != 1)} x {npart} part{'s' * (npart != 1)}"
        print(f"blockhess spectrum: wrote {out}/ ({what}, {v}; {rep['timings']['total_s']:.1f} s)")
    return 1 if failed or not converged else 0
