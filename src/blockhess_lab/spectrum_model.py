r"""``blockhess spectrum --model``: per-tensor spectra of a real causal language model, in lock-step.

The model is a Hugging Face ``GPT2LMHeadModel`` or Llama-family causal LM (``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``MistralForCausalLM``, ``GemmaForCausalLM``), from a ``save_pretrained`` folder read
offline (``from_pretrained(..., local_files_only=True)``) or a preset with random weights
(:data:`PRESETS`: ``gpt2-small``, ``llama-160m``, and the test sizes ``gpt2-tiny``, ``llama-tiny``), read
by :func:`blockhess.from_torch`. The loss is the mean next-token cross-entropy of a batch of token ids
``(B, L + 1)`` (inputs ``ids[:, :-1]``, targets ``ids[:, 1:]``): from ``--data`` (a ``.pt`` file holding
one 2-d integer tensor, ``torch.save(ids, path)``, or a ``.npy`` file of one 2-d integer array, every
id in ``[0, vocab)``), else ``--batch`` × ``--seq-len`` uniform random ids (``--seed``).

For the tensors of ``--tensors`` (default :func:`default_tensors`: Zhang et al.'s set, ``W_E`` and
``W_Q, W_K, W_V, W_O, W_1, W_2`` (GPT-2's ``c_fc``, ``c_proj``) of layers 0, 3, 7, 11, or for Llama
``W_E`` and ``W_Q, W_K, W_V, W_O, W_G, W_1, W_2``, the layers clipped to the model's), on the exact
Hessian operator's block-diagonal part ``D = A.block_diagonal(tensors)`` (one ``D @ V`` per step for all
tensors, :mod:`blockhess.operators.lockstep`):

1. every tensor's ``--k`` extreme eigenvalues by :func:`~blockhess.operators.blockwise_eigs` (Lanczos to
   the relative residual ``--tol``, each converged value within its residual of an eigenvalue of the
   tensor's block ``A[b, b]``; an unconverged one recorded as such, exit 1);
2. every tensor's spectral density by :func:`~blockhess.operators.blockwise_slq` (``--probes`` ×
   ``--slq-steps``), taking the top-k's own runs from random starts as probes: its first run (where
   ``--ncv`` leaves it ``--slq-steps`` steps) and its ``--probes`` − 1 checks of at least ``--slq-steps``
   products each, so that only the probes still missing are multiplied (docs/derivations.md §17, "Probes
   kept from the eigensolver");
3. the Jensen–Shannon distance (base 2) between every two tensors' densities,
   :func:`~blockhess.operators.js_distance`, both broadened with the wider of their two widths (a narrow
   density on the pair's grid would fall between its points), and its heat map;
4. with ``--checkpoints DIR1,DIR2,...``: the same at each folder of the series, the top-k Lanczos
   warm-started from the previous folder's eigenvectors, and cold beside it (both products counted).

Writes ``spectrum.json``, ``spectrum.md`` and ``eigenvalues.png``, ``density.png``, ``js.png`` (and
``series.png``) into ``--out`` with :mod:`.spectrum`'s figure helpers and output writing. Raises
``ValueError`` (one line: the command exits 2) for an unknown preset, a missing or unreadable folder,
an architecture not read, a token file torch cannot read safely, of another format or with ids outside the
vocabulary, an unknown tensor, ``--k`` above a tensor's size, options of the other presets.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

import blockhess as bh
from blockhess.operators import blockwise_eigs, blockwise_slq, js_distance
from blockhess.operators.estimators import CHECK_COLUMNS
from . import plots
from .bench_worker import peak_bytes
from .compare import float64_llama
from .outputs import atomic_dir, write_json
from .runtime import environment, load_average, load_saved, read_pretrained

#: presets: (family, config sizes); random weights from transformers' own initialisation under ``--seed``
PRESETS = {
    "gpt2-small": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)),
    "gpt2-tiny": ("gpt2", dict(n_embd=16, n_layer=4, n_head=2, n_inner=32, vocab_size=32, n_positions=64)),
    "llama-160m": ("llama", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                                 intermediate_size=3072, vocab_size=32000, max_position_embeddings=2048)),
    "llama-tiny": ("llama", dict(hidden_size=16, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=24, vocab_size=32, max_position_embeddings=64)),
}
#: the causal LMs read from a folder (their class names in config.json's ``architectures``)
ARCHITECTURES = ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "GemmaForCausalLM")
#: Zhang et al.'s layers (GPT-2 small's 0, 3, 7, 11)
LAYERS = (0, 3, 7, 11)
#: the per-layer tensors of the default set, GPT-2 (c_attn's W_Q, W_K, W_V; c_proj of attention W_O; c_fc W_1,
#: the MLP's c_proj W_2) and Llama (q/k/v/o, gate W_G, up W_1, down W_2)
LAYER_TENSORS = {"gpt2": ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2"),
                 "llama": ("W_Q", "W_K", "W_V", "W_O", "W_G", "W_1", "W_2")}
DEFAULTS = {"batch": 1, "seq_len": 128, "slq_steps": 30, "probes": 4}
#: how each pair's Jensen-Shannon distance is taken
JS_RULE = ("js_distance (base 2) of the two SLQ densities broadened with the wider of their two Gaussian widths, on "
           "512 points from the lower of their grids' first points to the higher of their last")
_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--model`` options of ``blockhess spectrum`` (the others are :mod:`.spectrum`'s)."""
    p.add_argument("--model", default=None, metavar="NAME|DIR",
                   help=f"a causal LM: a preset with random weights ({', '.join(PRESETS)}) or a save_pretrained folder "
                        f"({', '.join(ARCHITECTURES)}) read offline; per-tensor spectra in lock-step (--preset not used)")
    p.add_argument("--checkpoints", default=None, metavar="DIR1,DIR2,...",
                   help="a series of save_pretrained folders over training (one architecture): the spectra at each, "
                        "top-k warm-started from the previous folder's eigenvectors (and cold beside it)")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="token ids: a .pt (torch.save of one 2-d integer tensor) or .npy (one 2-d integer array) of "
                        "shape (B, L + 1): inputs ids[:, :-1], next-token targets ids[:, 1:] (default: random ids)")
    p.add_argument("--seq-len", type=int, default=None, metavar="L",
                   help=f"random tokens per sequence with --model (default: {DEFAULTS['seq_len']}, or the model's "
                        "learned positions where fewer)")
    p.add_argument("--tensors", default=None, metavar="LIST",
                   help="comma-separated whole parameters in blockhess's names (W_E, blocks.3.W_Q, ...; no heads or "
                        "groups: those are --blocks of the --preset models, or A.block_diagonal in Python) (default: W_E "
                        "and the attention and MLP weights of layers 0, 3, 7, 11 that the model has)")
    p.add_argument("--slq-steps", type=int, default=None, metavar="M",
                   help=f"Lanczos steps per SLQ probe with --model (default: {DEFAULTS['slq_steps']})")
    p.add_argument("--probes", type=int, default=None, metavar="P",
                   help=f"SLQ probes with --model (default: {DEFAULTS['probes']})")
    p.add_argument("--reorth", choices=("full", "none"), default=None,
                   help="SLQ's reorthogonalisation with --model: full (each probe's basis kept, probes x steps vectors "
                        "per tensor) or none (the three-term recurrence, 3 x probes vectors per tensor) (default: full)")
    p.add_argument("--ncv", type=int, default=None, metavar="N",
                   help="Lanczos basis vectors per tensor with --model (default: lanczos_eigs's, max(3k + 2, 60)); "
                        "the bases of every tensor are held at once, checked against the memory before any work")


# ----------------------------------------------------------------------------- options


#: the :mod:`.spectrum` preset options, which do not apply with ``--model``
PRESET_OPTIONS = ("--checkpoint", "--series", "--blocks", "--density-blocks", "--batches", "--preset", "--density",
                  "--trace", "--parts", "--dense-below", "--validate-below")


def _other_options(args: argparse.Namespace, default) -> list[str]:
    """The preset options (:data:`PRESET_OPTIONS`) given with ``--model``: those whose value is not the
    parser's default (``default``: destination -> :mod:`.spectrum`'s parser's default)."""
    dests = [(o, o.lstrip("-").replace("-", "_")) for o in PRESET_OPTIONS]
    return [o for o, d in dests if getattr(args, d) != default(d)]


def wanted(args: argparse.Namespace, default) -> bool:
    """Whether the run is the model path (``--model`` or ``--checkpoints``); raises ``ValueError`` for its
    options without it, or the presets' options with it (``default``: an option's default by destination,
    ``argparse.ArgumentParser.get_default`` of the command's parser)."""
    mine = [o for o, v in (("--data", args.data), ("--seq-len", args.seq_len), ("--tensors", args.tensors),
                           ("--slq-steps", args.slq_steps), ("--probes", args.probes), ("--reorth", args.reorth),
                           ("--ncv", args.ncv)) if v is not None]
    if args.model is None and args.checkpoints is None:
        if mine:
            raise ValueError(f"{mine[0]} applies with --model or --checkpoints (a causal LM)")
        return False
    bad = _other_options(args, default)
    if bad:
        raise ValueError(f"{bad[0]} is an option of the --preset models; with --model use --tensors, --data, "
                         "--checkpoints, --probes, --slq-steps, --reorth, --ncv (the full Hessian's top-k and density)")
    return True


def check(args: argparse.Namespace) -> dict:
    """The model run's settings from ``args``, checked before any work; raises ``ValueError`` (one line)."""
    if args.model is not None and args.checkpoints is not None:
        raise ValueError("--model and --checkpoints: give one (the series' folders are the model)")
    if args.model is not None and args.model not in PRESETS and not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model}: neither a preset ({', '.join(PRESETS)}) nor a folder")
    dirs = []
    if args.checkpoints is not None:
        dirs = [s.strip() for s in args.checkpoints.split(",")]
        if any(not d for d in dirs):
            raise ValueError(f"--checkpoints must be a comma-separated list of folders, got {args.checkpoints!r}")
        for d in dirs:
            if not (Path(d) / "config.json").is_file():
                raise ValueError(f"--checkpoints: {d} is not a save_pretrained folder (no config.json in it)")
    if args.model is not None and args.model not in PRESETS and not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"--model {args.model}: not a save_pretrained folder (no config.json in it)")
    for option, value in (("--batch", args.batch), ("--seq-len", args.seq_len), ("--slq-steps", args.slq_steps),
                          ("--probes", args.probes)):
        if value is not None and value < (2 if option in ("--slq-steps", "--probes") else 1):
            raise ValueError(f"{option} must be >= {2 if option in ('--slq-steps', '--probes') else 1}, got {value}")
    if args.data is not None:
        if args.batch is not None or args.seq_len is not None:
            raise ValueError("--batch and --seq-len size the random tokens; --data gives the tokens")
        if Path(args.data).suffix not in (".pt", ".npy") or not Path(args.data).is_file():
            raise ValueError(f"--data {args.data}: expected an existing .pt or .npy file of token ids")
    if args.ncv is not None and args.ncv < args.k + 2:
        raise ValueError(f"--ncv must be at least --k + 2 = {args.k + 2}, got {args.ncv}")
    for option, value, least in (("--k", args.k, 1), ("--max-matvecs", args.max_matvecs, 1), ("--seed", args.seed, 0)):
        if value < least:
            raise ValueError(f"{option} must be >= {least}, got {value}")
    if not (math.isfinite(args.tol) and 0 < args.tol < 1):
        raise ValueError(f"--tol must be in (0, 1), got {args.tol:g}")
    dtype = _DTYPES[args.dtype or "float32"]
    if args.tol <= torch.finfo(dtype).eps:
        raise ValueError(f"--tol must be above the dtype's epsilon {torch.finfo(dtype).eps:.3g}, got {args.tol:g}")
    return {"model": args.model, "checkpoints": dirs, "dtype": dtype, "k": args.k, "which": args.which,
            "tol": float(args.tol), "max_matvecs": args.max_matvecs, "seed": args.seed,
            "probes": args.probes or DEFAULTS["probes"], "slq_steps": args.slq_steps or DEFAULTS["slq_steps"],
            "batch": args.batch or DEFAULTS["batch"], "seq_len": args.seq_len,
            "reorth": args.reorth or "full", "ncv": args.ncv}


# ----------------------------------------------------------------------------- the model and the tokens


def preset_model(name: str, seed: int) -> torch.nn.Module:
    """The preset ``name``'s model with transformers' random initialisation under ``seed``, eval mode, no
    dropout; raises ``ValueError`` for an unknown name."""
    import transformers as tf

    if name not in PRESETS:
        raise ValueError(f"--model {name}: unknown preset; expected one of {', '.join(PRESETS)} or a folder")
    family, sizes = PRESETS[name]
    torch.manual_seed(seed)
    if family == "gpt2":
        c = tf.GPT2Config(**sizes, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                          attn_implementation="sdpa")
        return tf.GPT2LMHeadModel(c).eval()
    c = tf.LlamaConfig(**sizes, bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation="sdpa")
    return tf.LlamaForCausalLM(c).eval()


def read_model(model: torch.nn.Module, dtype: torch.dtype, where: str) -> tuple:
    """``(cfg, params, family)`` of a causal LM by :func:`blockhess.from_torch` in ``dtype`` (a Llama-family
    model in float64 first made to compute its RMSNorms and rotary tables in float64,
    :func:`.compare.float64_llama`); raises ``ValueError`` naming ``where`` for what it does not read."""
    family = "gpt2" if type(model).__name__ == "GPT2LMHeadModel" else "llama"
    model = model.to(dtype)
    try:
        if family == "llama" and dtype == torch.float64 and type(model).__name__ == "LlamaForCausalLM":
            float64_llama(model)
        cfg, params = bh.from_torch(model, dtype=dtype)
    except (ValueError, NotImplementedError) as exc:
        raise ValueError(f"{where}: blockhess.from_torch cannot read it: {str(exc).splitlines()[0]}") from None
    return cfg, params, family


def tokens(path: str | None, vocab: int, batch: int, seq_len: int, seed: int, n_positions: int | None) -> torch.Tensor:
    """The token ids ``(B, L + 1)`` (int64): read from ``path`` (module docstring) or uniform random;
    raises ``ValueError`` for another format, ids outside ``[0, vocab)`` or more positions than the model's."""
    if path is None:
        ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(seed + 1))
    else:
        if path.endswith(".npy"):
            import numpy as np

            try:
                ids = torch.from_numpy(np.load(path, allow_pickle=False))
            except (OSError, ValueError) as exc:
                raise ValueError(f"--data {path}: cannot read it as .npy: {str(exc).splitlines()[0]}") from None
        else:
            try:
                ids = load_saved(path)
            except ValueError as exc:
                raise ValueError(f"--data {path}: cannot read it as a saved tensor: {exc}") from None
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool \
                or ids.is_complex() or ids.shape[1] < 2 or ids.shape[0] < 1:
            raise ValueError(f"--data {path}: expected one 2-d integer tensor of token ids (B, L + 1) with L >= 1, got "
                             f"{type(ids).__name__}{tuple(ids.shape) if isinstance(ids, torch.Tensor) else ''}"
                             f"{' of ' + str(ids.dtype) if isinstance(ids, torch.Tensor) else ''}")
        ids = ids.to(torch.int64)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"--data {path}: token ids must lie in [0, {vocab}) (the model's vocabulary), got "
                             f"[{lo}, {hi}]")
    if n_positions is not None and ids.shape[1] - 1 > n_positions:
        raise ValueError(f"{'--data ' + str(path) if path is not None else '--seq-len'}: sequences of {ids.shape[1] - 1} "
                         f"tokens exceed the model's {n_positions} positions")
    return ids


def default_tensors(cfg, family: str) -> list[str]:
    """Zhang et al.'s tensors in blockhess's names: ``W_E`` and :data:`LAYER_TENSORS` of the :data:`LAYERS`
    the model has."""
    return ["W_E"] + [f"blocks.{i}.{t}" for i in LAYERS if i < len(cfg.blocks) for t in LAYER_TENSORS[family]]


def tensor_names(spec: str | None, cfg, params: dict, family: str) -> list[str]:
    """``--tensors`` checked against ``params`` (default :func:`default_tensors`); raises ``ValueError``."""
    if spec is None:
        return default_tensors(cfg, family)
    names = [s.strip() for s in spec.split(",")]
    if any(not s for s in names) or len(set(names)) != len(names):
        raise ValueError(f"--tensors must be a comma-separated list of distinct names, got {spec!r}")
    for n in names:
        if n not in params:
            raise ValueError(f"--tensors: unknown tensor {n!r}; this model has {', '.join(list(params)[:12])}, ... "
                             f"({len(params)} in all)")
    return names


# ----------------------------------------------------------------------------- one point


def spectra(params: dict, cfg, ids: torch.Tensor, names: list[str], s: dict, v0=None, cold: bool = False,
            log=None) -> tuple:
    """Every tensor's top-k, density and the JS matrix at ``params`` in lock-step: ``(record, Blockwise of
    the top-k)``; with ``v0`` (the previous point's :class:`~blockhess.operators.Blockwise`) warm-started, and
    with ``cold`` the cold top-k too, its products in the record."""
    t0 = time.perf_counter()
    A = bh.hessian_operator(params, ids[:, :-1], cfg, loss="ce", target=ids[:, 1:])
    D = A.block_diagonal(names)
    built = time.perf_counter() - t0
    V = torch.randn(D.shape[0], 1, generator=torch.Generator().manual_seed(s["seed"]), dtype=torch.float64).to(D.dtype)
    t = time.perf_counter()
    D @ V
    product = time.perf_counter() - t
    # checks long enough to be the densities' probes (with the first run, where it is kept): docs/derivations.md
    # §17, "Probes kept from the eigensolver"
    kw = dict(which=s["which"], tol=s["tol"], max_matvecs=s["max_matvecs"], seed=s["seed"], allow_unconverged=True,
              ncv=s["ncv"], check=max(CHECK_COLUMNS, s["slq_steps"]), check_runs=max(1, s["probes"] - 1))
    log and log(f"top-{s['k']} of {len(names)} tensors in lock-step" + (" (warm start)" if v0 is not None else ""))
    t = time.perf_counter()
    E = blockwise_eigs(D, k=s["k"], v0=v0, **kw)
    eig_s = time.perf_counter() - t
    rec = {"operator_seconds": built, "product_seconds": product, "tensors": {}}
    if cold:
        log and log("the same cold")
        t = time.perf_counter()
        C = blockwise_eigs(D, k=s["k"], **kw)
        rec["cold"] = {"products": C.products, "matvecs": sum(C.matvecs.values()), "seconds": time.perf_counter() - t,
                       "eigenvalues": {b: C[b].eigenvalues.double().tolist() for b in names},
                       "residuals": {b: C[b].residuals.double().tolist() for b in names},
                       "converged": all(C[b].converged for b in names)}
    log and log(f"SLQ densities, {s['probes']} probes x {s['slq_steps']} steps")
    t = time.perf_counter()
    S = blockwise_slq(D, n_probes=s["probes"], n_iter=s["slq_steps"], seed=s["seed"], reorth=s["reorth"], probes=E)
    slq_s = time.perf_counter() - t
    for b in names:
        r, d = E[b], S[b]
        rec["tensors"][b] = {
            "n": D.views[names.index(b)].shape[0], "eigenvalues": r.eigenvalues.double().tolist(),
            "residuals": r.residuals.double().tolist(), "bounds": r.bounds.double().tolist(),
            "converged": bool(r.converged), "matvecs": E.matvecs[b], "method": r.method,
            "density": {"grid": d.grid.double().tolist(), "density": d.density.double().tolist(),
                        "stderr": d.stderr.double().tolist(), "sigma": float(d.sigma), "matvecs": S.matvecs[b]}}
    js = [[0.0 if i == j else js_distance(S[a], S[b]) for j, b in enumerate(names)] for i, a in enumerate(names)]
    for i in range(len(names)):  # one value per pair: the (i, j) computed, (j, i) the same number
        for j in range(i):
            js[i][j] = js[j][i]
    rec.update(js_distance=js, js_rule=JS_RULE, eigs={"products": E.products, "matvecs": sum(E.matvecs.values()), "seconds": eig_s,
                                     "warm_start": v0 is not None},
               slq={"products": S.products, "matvecs": sum(S.matvecs.values()), "seconds": slq_s},
               converged=all(E[b].converged for b in names))
    return rec, E


# ----------------------------------------------------------------------------- the command


def run(args: argparse.Namespace) -> int:
    """``blockhess spectrum --model/--checkpoints``: exit 0, 1 when an eigenvalue did not converge;
    ``ValueError`` on bad input (before the estimators run)."""
    s = check(args)
    quiet = bool(args.quiet)

    def log(msg):
        if not quiet:
            print(f"blockhess spectrum: {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    env = environment()
    dtype = s["dtype"]
    points = []  # (label, model loader)
    if s["checkpoints"]:
        points = [(d, lambda d=d: read_pretrained(d, "--checkpoints", ARCHITECTURES, "spectrum", quiet)) for d in s["checkpoints"]]
    elif s["model"] in PRESETS:
        points = [(s["model"], lambda: preset_model(s["model"], s["seed"]))]
    else:
        points = [(s["model"], lambda: read_pretrained(s["model"], "--model", ARCHITECTURES, "spectrum", quiet))]
    log(f"reading {points[0][0]}")
    cfg, params, family = read_model(points[0][1](), dtype, points[0][0])
    names = tensor_names(args.tensors, cfg, params, family)
    for name in names:
        if params[name].numel() < s["k"]:
            raise ValueError(f"--k {s['k']} is more than tensor {name}'s {params[name].numel()} entries")
    positions = cfg.n_positions if cfg.positions == "learned" else None
    seq_len = s["seq_len"] or min(DEFAULTS["seq_len"], positions or DEFAULTS["seq_len"])  # a small model's own length
    ids = tokens(args.data, cfg.vocab, s["batch"], seq_len, s["seed"], positions)
    model_desc = {"family": family, "n_layers": len(cfg.blocks), "d_model": cfg.blocks[0].d_model,
                  "n_heads": cfg.blocks[0].n_heads, "d_ff": cfg.blocks[0].d_ff, "vocab": cfg.vocab,
                  "n_params": sum(v.numel() for v in params.values())}
    results, prev = [], None
    for i, (label_, load) in enumerate(points):
        if i > 0:
            log(f"reading {label_}")
            cfg_i, params, fam_i = read_model(load(), dtype, label_)
            if cfg_i != cfg:
                raise ValueError(f"--checkpoints: {label_} is another architecture than {points[0][0]}")
        rec, prev = spectra(params, cfg, ids, names, s, v0=prev, cold=i > 0, log=log)
        rec["label"] = label_
        results.append(rec)
    out = Path(args.out)
    with atomic_dir(out) as tmp:
        figs = figures(tmp, names, results, s)
        rep = {"command": "blockhess spectrum", "model": s["model"] or s["checkpoints"][-1], "checkpoints": s["checkpoints"],
               "model_config": model_desc, "dtype": str(dtype).removeprefix("torch."),
               "tokens": {"source": args.data or "random", "batch": ids.shape[0], "seq_len": ids.shape[1] - 1},
               "settings": {"tensors": names, "k": s["k"], "which": s["which"], "tol": s["tol"],
                            "max_matvecs": s["max_matvecs"], "probes": s["probes"], "slq_steps": s["slq_steps"],
                            "seed": s["seed"], "reorth": s["reorth"], "ncv": s["ncv"]},
               "points": results, "converged": all(r["converged"] for r in results), "figures": figs,
               "products": {"total": sum(r["eigs"]["products"] + r["slq"]["products"] + r.get("cold", {}).get("products", 0)
                                         for r in results),
                            "what": "calls of D.products (each one pass over every tensor still running)"},
               "environment": env}
        rep["environment"]["load_average_at_end"] = load_average()
        rep["timings"] = {"total_s": time.perf_counter() - t0, "peak_rss_bytes": peak_bytes()}
        write_json(tmp / "spectrum.json", rep)
        (tmp / "spectrum.md").write_text(markdown(rep))
    if not rep["converged"]:
        print(f"blockhess spectrum: an eigenvalue did not converge within --max-matvecs; see {out}/spectrum.json",
              file=sys.stderr)
    log(f"wrote {out}/ ({len(names)} tensors, {len(results)} point(s); {rep['timings']['total_s']:.1f} s)")
    return 0 if rep["converged"] else 1


def figures(tmp: Path, names: list[str], results: list, s: dict) -> list[str]:
    """``eigenvalues.png``, ``density.png``, ``js.png`` of the last point (and ``series.png``)."""
    last = results[-1]["tensors"]
    out = ["eigenvalues.png", "density.png", "js.png"]
    where = f" at {Path(results[-1]['label']).name}" if len(results) > 1 else ""  # a series: its last checkpoint
    plots.block_eigenvalues(tmp / out[0], {"full": {b: (last[b]["eigenvalues"], "lanczos") for b in names}},
                            f"top {s['k']} eigenvalues per tensor ({s['which']}, lock-step Lanczos){where}")
    plots.densities(tmp / out[1], {b: {"full": (last[b]["density"]["grid"], last[b]["density"]["density"],
                                                last[b]["density"]["stderr"])} for b in names},
                    f"spectral density per tensor{where} (lock-step SLQ, {s['probes']} probes x {s['slq_steps']} "
                    "steps; band: ±1 standard error)")
    plots.distance_matrix(tmp / out[2], names, results[-1]["js_distance"],
                          f"Jensen-Shannon distance between the tensors' spectral densities{where}")
    if len(results) > 1:
        x = list(range(len(results)))
        traj = {b: {"full": [r["tensors"][b]["eigenvalues"] for r in results]} for b in names}
        counts = {"warm start": [r["eigs"]["matvecs"] for r in results[1:]],
                  "cold": [r["cold"]["matvecs"] for r in results[1:]]}
        plots.eigenvalue_trajectories(tmp / "series.png", x, traj, counts, x[1:], "checkpoint",
                                      "top eigenvalues over the checkpoints", ticks=[Path(r["label"]).name for r in results])
        out.append("series.png")
    return out


def markdown(rep: dict) -> str:
    """``spectrum.md``: the model, the settings, per point a table of the tensors and the products."""
    s, m = rep["settings"], rep["model_config"]
    title = ", ".join(rep["checkpoints"]) if rep["checkpoints"] else rep["model"]
    lines = [f"# blockhess spectrum: {title}", "",
             f"Model: {m['family']}, {m['n_layers']} layers, d {m['d_model']}, {m['n_heads']} heads, d_ff {m['d_ff']}, "
             f"vocabulary {m['vocab']}, {m['n_params']:,} parameters, products in {rep['dtype']}. Tokens: "
             f"{rep['tokens']['source']}, {rep['tokens']['batch']} x {rep['tokens']['seq_len']}.", "",
             f"Top {s['k']} ({s['which']}) per tensor by lock-step Lanczos to relative residual {s['tol']:g}; "
             f"SLQ {s['probes']} probes x {s['slq_steps']} steps; {len(s['tensors'])} tensors in one "
             "A.block_diagonal. A tensor's top-k columns: the vectors its own block multiplied for its top-k (its "
             "columns of the top-k's lock-step products D @ V; the density's are in the JSON); an unconverged tensor "
             "lists the eigenvalues its budget reached.", ""]
    for r in rep["points"]:
        lines += [f"## {r['label']}", "", "| tensor | n | eigenvalues | max residual | converged | top-k columns |",
                  "|---|---|---|---|---|---|"]
        for b, t in r["tensors"].items():
            found = len(t["eigenvalues"])
            short = f" ({found} of {s['k']})" if found < s["k"] else ""
            lines.append(f"| `{b}` | {t['n']:,} | {', '.join(f'{v:.4g}' for v in t['eigenvalues'])}{short} | "
                         f"{max(t['residuals']):.2g} | {'yes' if t['converged'] else 'NO'} | {t['matvecs']} |")
        js = [v for i, row in enumerate(r["js_distance"]) for j, v in enumerate(row) if j > i]
        lines += ["", f"Top-k: {r['eigs']['products']} lock-step products D @ V ({r['eigs']['matvecs']} columns), "
                      f"{r['eigs']['seconds']:.1f} s" + (" (warm-started)" if r["eigs"]["warm_start"] else "") + "."
                  + (f" Cold: {r['cold']['products']} products ({r['cold']['matvecs']} columns)." if "cold" in r else "")
                  + f" SLQ: {r['slq']['products']} products ({r['slq']['matvecs']} columns), {r['slq']['seconds']:.1f} s."
                  f" One D @ v: {r['product_seconds']:.3f} s."
                  + (f" JS distance between tensors: {min(js):.3f} to {max(js):.3f}." if js else ""), ""]
    lines += ["Figures: " + ", ".join(f"`{f}`" for f in rep["figures"]) + ".", "",
              f"Run time {rep['timings']['total_s']:.1f} s; {rep['products']['total']} lock-step products in all; "
              f"peak resident memory {rep['timings']['peak_rss_bytes'] / 2**30:.2f} GiB.", ""]
    return "\n".join(lines)
