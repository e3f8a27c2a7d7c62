r"""``blockhess compare``: the exact Gauss–Newton matrix and Hessian of a model against the curvature
approximations the field ships, per module and for the whole model.

The exact side: the dense GGN (``part="outer"``) and Hessian (``part="full"``) over every weight matrix,
from :func:`blockhess.hessian`; its damped inverse products and influence scores by its
eigendecomposition. The loss is ours: cross-entropy, the mean over every token (GPT-2,
Llama) or image (ViT) of the batch.

The approximations (each ``Ĥ`` a matrix in the same canonical ``vec_r`` order as the exact block):

* ``kfac``, ``ekfac``: curvlinops' ``KFACLinearOperator`` and ``EKFACLinearOperator`` (``fisher_type="type-2"``:
  the exact output Hessian, no sampling; ``kfac_approx="expand"``: tokens as independent examples;
  ``CrossEntropyLoss(reduction="mean")``: the mean over tokens, our scale), built on the model with
  GPT-2's ``Conv1D`` layers replaced by the equal ``nn.Linear`` (curvlinops supports ``Linear`` and
  ``Conv2d``), dense by ``K @ I``. Block-diagonal over the model's layers: GPT-2's fused ``c_attn`` is
  one layer holding ``W_Q, W_K, W_V``.
* ``kronfluence_ekfac``: kronfluence's EK-FAC (:func:`kronfluence_ekfac`; ``strategy="ekfac"``, float64) on the
  same batch, each sequence (image) one of its examples with the loss summed over its tokens, labels sampled
  from the model's softmax (its true Fisher, ``use_empirical_fisher=False``; kronfluence has no exact
  expectation over labels, so ``--kronfluence-draws`` draws per example, the batch repeated), which
  estimates the per-sequence GGN's EK-FAC: divided by the tokens per sequence it is at our GGN's scale.
  Dense from its factors (both covariances' eigenvectors and the corrected eigenvalues), block-diagonal over
  the same layers as curvlinops' (layers with a bias tracked without it, so it covers our weights only).
  The whole model's ``spearman`` is of kronfluence's own pairwise influence scores (damping ``λ`` at its
  scale); a weight matrix's, as for the others, of its block of the dense matrix. Not run (recorded in the
  JSON) without kronfluence.
* ``gptq_raw``, ``gptq_best``: the GPTQ/SparseGPT layer proxy ``P = (2/S) XᵀX ⊗ I`` of each layer
  (``X`` the layer's inputs, one row per token, ``S`` the number of sequences, as GPTQ accumulates it;
  for ``Conv2d`` the patches), block-diagonal over layers: ``raw`` is ``P`` itself, ``best`` its best scalar
  multiple ``c P`` with ``c = ⟨P, H⟩_F / ‖P‖_F²`` fitted to each row's exact block (the whole model's
  to the whole) and to each reference separately.
* ``sophia_S``: Sophia's Gauss–Newton–Bartlett diagonal (Liu et al. 2023, Alg. 2) averaged over ``S``
  draws: labels sampled from the model's softmax, ``T · ∇L̂ ⊙ ∇L̂`` with ``L̂`` the mean loss of the
  sampled labels and ``T`` the number of loss terms it averages (tokens, or images), which makes it an
  unbiased estimate of the GGN's diagonal (docs/derivations.md §23).
* ``hutchinson_N``: Hutchinson's diagonal (:func:`blockhess.operators.hutchinson_diagonal`, ``N``
  Rademacher probes over every weight matrix at once, sliced per module) of the reference itself
  (GGN or Hessian), and its trace (the sum of the estimated diagonal: Hutchinson's trace estimator).

Metrics of each approximation against each reference ``H`` (docs/derivations.md, "Comparing
approximations", §23): ``rel_fro`` ``‖Ĥ − H‖_F / ‖H‖_F``; ``top_cos`` ``‖Qᵀv‖``, ``v`` the unit eigenvector of the largest
eigenvalue of ``H`` and ``Q`` an orthonormal basis of the eigenspace of the largest eigenvalue of ``Ĥ`` (the
``|cos|`` of the two top eigenvectors where that eigenvalue is simple; the proxy ``XᵀX ⊗ I`` repeats each
eigenvalue); ``inverse_cos`` the cosine of ``(H + λI)⁻¹ g`` and
``(Ĥ + λI)⁻¹ g`` for ``g`` the batch gradient; ``spearman`` the Spearman rank correlation of the
influence scores ``g_iᵀ (H + λI)⁻¹ g_test`` of the batch's training sequences on a test sequence,
exact against approximate; for the diagonal methods ``diag_rel`` ``‖d̂ − diag H‖ / ‖diag H‖``; for
Hutchinson ``trace_rel`` ``|t̂ − tr H| / |tr H|``. A cosine of a zero vector or a rank correlation of constant scores
is undefined: ``null`` in the JSON, "undefined" in the tables. ``λ = --damping · λ_max(G)``, ``G`` the exact GGN of the
whole model (the same ``λ`` everywhere).

Presets (``--preset``, random weights from ``--seed``, float64): ``gpt2`` a two-layer
``GPT2LMHeadModel`` (d = 16, 2 heads, d_ff = 32, vocabulary 32, untied head), next-token targets of
random tokens; ``vit`` a two-layer ``ViTForImageClassification`` (8×8 images, 4×4 patches, d = 16,
2 heads, d_ff = 32, 4 classes) on random images and labels; ``llama`` a two-layer ``LlamaForCausalLM``
(d = 16, 4 query heads on 2 key/value heads of d_k = 4, SwiGLU FFN with d_ff = 32, RoPE with θ = 10⁴,
RMSNorm pre-norm blocks and final RMSNorm, untied head, vocabulary 32; matrices N(0, 0.5²), RMSNorm weights
1 + N(0, 0.3²)), next-token targets of random tokens. ``--model DIR``: a ``save_pretrained`` folder of a
``GPT2LMHeadModel``, ``ViTForImageClassification`` or ``LlamaForCausalLM`` read offline. A
``LlamaForCausalLM``'s RMSNorms and rotary tables are made to compute in float64 on that instance
(:func:`float64_llama`); every model's logits must equal :func:`blockhess.forward`'s to
:data:`FORWARD_TOL` (:func:`check_forward`) before anything is compared.

The batch: random (``--batch`` sequences of ``--seq-len`` tokens with next-token targets, or images and
labels, from ``--seed``) and a random test sequence; or ``--data FILE`` (:func:`load_data`): a language
model's token ids ``(N, L+1)`` (``.pt`` or ``.npy``; inputs ``ids[:, :-1]``, targets ``ids[:, 1:]``), a ViT's
``images`` and ``labels`` (``.npz``); the last row is the test sequence, the others the batch.

Writes ``compare.json`` (every number, the settings and seeds that reproduce it), ``compare.md`` (per
reference a table per metric: rows modules, columns approximations) and ``rel_fro.png``,
``inverse_cos.png`` into ``--out``, atomically. Exit status 0; 2 with one line on stderr for bad input
(an unknown preset, a bad sample count or damping, a ``--model`` folder that cannot be read, a module
whose logits are not :func:`blockhess.forward`'s, a ``--data`` file :func:`load_data` refuses).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import blockhess as bh
from blockhess.config import ModelConfig
from blockhess.operators import hutchinson_diagonal
from . import plots
from .bench_worker import peak_bytes
from .outputs import atomic_dir, check_out, out_help, write_json
from .runtime import (add_quiet_argument, add_threads_argument, environment, load_average, load_saved, progress,
                      read_pretrained, torch_threads)

HELP = ("exact GGN and Hessian blocks of a model against KFAC, EKFAC (curvlinops), EK-FAC (kronfluence), the GPTQ "
        "proxy, Sophia's "
        "Gauss-Newton-Bartlett and Hutchinson diagonals: errors, eigenvector alignment, inverse products, influence")

PRESETS = ("gpt2", "vit", "llama")
#: the architectures --model reads (transformers' class names)
READS = ("GPT2LMHeadModel", "ViTForImageClassification", "LlamaForCausalLM")
PARTS = ("outer", "full")
REFERENCE = {"outer": "exact GGN", "full": "exact Hessian"}
METRICS = ("rel_fro", "top_cos", "inverse_cos", "spearman", "diag_rel", "trace_rel")
#: the whole model's row key
WHOLE = "whole"
#: curvlinops' settings (the JSON records them)
KFAC_SETTINGS = {"fisher_type": "type-2", "kfac_approx": "expand", "loss": "CrossEntropyLoss(reduction='mean')"}
#: kronfluence's settings (the JSON records them with the draws and the seed)
KRONFLUENCE_SETTINGS = {"strategy": "ekfac", "use_empirical_fisher": False, "dtype": "float64",
                        "loss": "cross-entropy summed over each example's loss terms and the batch",
                        "scale": "divided by the loss terms per example (tokens per sequence, 1 per image)",
                        "spearman": "whole: kronfluence's own pairwise scores; a weight matrix: its block of the matrix"}
KRONFLUENCE_MISSING = "kronfluence is not installed: pip install --no-deps -c constraints.txt -r requirements-laplace.txt"

GPT2_SIZES = dict(n_embd=16, n_head=2, n_layer=2, n_inner=32, vocab_size=32)
VIT_SIZES = dict(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=32, num_labels=4)
LLAMA_SIZES = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, pad_token_id=None,
                   bos_token_id=None, eos_token_id=None, use_cache=False)
#: the preset's random weights: matrices N(0, LLAMA_STD[0]²), RMSNorm weights 1 + N(0, LLAMA_STD[1]²)
LLAMA_STD = (0.5, 0.3)
#: --data's file types: token ids (language models), images and labels (ViT)
DATA_SUFFIXES = (".pt", ".npy", ".npz")
#: the largest relative Frobenius difference of the module's logits from blockhess.forward's accepted
FORWARD_TOL = 1e-12


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="compare", metavar="DIR", help=out_help("compare", "compare.json, compare.md, PNG figures"))
    p.add_argument("--preset", default=None, metavar="NAME",
                   help=f"the model, random weights from --seed: {', '.join(PRESETS)} (default: gpt2)")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="a save_pretrained folder (GPT2LMHeadModel, ViTForImageClassification or LlamaForCausalLM) read "
                        "offline, instead of --preset")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="the batch from a file instead of random tokens or images: for a language model a .pt "
                        "(a saved tensor) or .npy integer array (N, L+1) of token ids, inputs ids[:, :-1], targets "
                        "the next tokens ids[:, 1:]; for a ViT an .npz with images (N, C, H, W) and integer labels "
                        "(N,); the last row is the test sequence (image), the first N-1 (N >= 3) the batch. "
                        "Replaces --batch and --seq-len")
    p.add_argument("--batch", type=int, default=8, metavar="N", help="training sequences (or images) (default: 8)")
    p.add_argument("--seq-len", type=int, default=8, metavar="L", help="tokens per sequence, text models (default: 8)")
    p.add_argument("--sophia-samples", default="1,10,100", metavar="LIST",
                   help="label draws averaged by Sophia's estimator, comma-separated integers >= 1 (default: 1,10,100)")
    p.add_argument("--hutchinson-samples", default="2,10,100", metavar="LIST",
                   help="Hutchinson probes, comma-separated integers >= 2 (default: 2,10,100)")
    p.add_argument("--kronfluence-draws", type=int, default=100, metavar="N",
                   help="label draws per example from the model's softmax for kronfluence's EK-FAC (its true "
                        "Fisher), N >= 1 (default: 100)")
    p.add_argument("--damping", type=float, default=0.01, metavar="R",
                   help="damping of the inverse products and influence, relative: λ = R · λ_max of the whole "
                        "model's exact GGN, R > 0 (default: 0.01)")
    p.add_argument("--seed", type=int, default=0, metavar="SEED",
                   help="seed of the weights, the batch, the test sequence and the estimators (default: 0)")
    add_threads_argument(p)
    add_quiet_argument(p)


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """A run's settings (checked by :func:`settings`)."""

    preset: str | None
    model_dir: str | None
    batch: int
    seq_len: int
    sophia: tuple[int, ...]
    hutchinson: tuple[int, ...]
    damping: float
    seed: int
    kronfluence_draws: int = 100
    data: str | None = None


def _counts(option: str, text: str, low: int) -> tuple[int, ...]:
    try:
        items = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(f"{option} must be comma-separated integers >= {low}, got {text!r}") from None
    if any(n < low for n in items):
        raise ValueError(f"{option}: every sample count must be >= {low}, got {text!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"{option} names a sample count twice: {text!r}")
    return items


def settings(args: argparse.Namespace) -> Settings:
    """The run's :class:`Settings`; raises ``ValueError`` (one line, naming the option) on a bad one."""
    if args.model is not None and args.preset is not None:
        raise ValueError("--preset and --model exclude each other: the model is one or the other")
    preset = "gpt2" if args.preset is None else args.preset
    if args.model is None and preset not in PRESETS:
        raise ValueError(f"--preset: unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    if args.model is not None and not Path(args.model, "config.json").is_file():
        raise ValueError(f"--model {args.model}: not a save_pretrained folder (no config.json in it)")
    if args.data is not None:
        defaults = argparse.ArgumentParser()
        add_arguments(defaults)
        for option in ("batch", "seq_len"):
            if getattr(args, option) != defaults.get_default(option):
                raise ValueError(f"--{option.replace('_', '-')}: with --data the batch is the file's rows")
        if Path(args.data).suffix not in DATA_SUFFIXES:
            raise ValueError(f"--data {args.data}: expected a {', '.join(DATA_SUFFIXES)} file")
        if not Path(args.data).is_file():
            raise ValueError(f"--data {args.data}: no such file")
    for option, value, low in (("--batch", args.batch, 2), ("--seq-len", args.seq_len, 2), ("--seed", args.seed, 0),
                               ("--kronfluence-draws", args.kronfluence_draws, 1)):
        if value < low:
            raise ValueError(f"{option} must be >= {low}, got {value}")
    if not (math.isfinite(args.damping) and args.damping > 0):
        raise ValueError(f"--damping must be a finite number > 0, got {args.damping:g}")
    return Settings(None if args.model else preset, args.model, args.batch, args.seq_len,
                    _counts("--sophia-samples", args.sophia_samples, 1),
                    _counts("--hutchinson-samples", args.hutchinson_samples, 2), float(args.damping), args.seed,
                    args.kronfluence_draws, args.data)


# ----------------------------------------------------------------------------- the problem


@dataclass
class Problem:
    """A model we read and its batch: ``cfg``, ``params`` (canonical), the training ``inputs`` and
    ``target``, a test sequence ``test`` (``(inputs, target)`` of one sequence), and, for a torch model,
    ``module`` (its layers as ``nn.Linear``/``nn.Conv2d``, the model curvlinops and the GPTQ proxy run
    on), ``layers`` (those layers' weights, in order) and ``index`` (for each of our weight matrices,
    its entries' positions in the concatenated flat weights of ``layers``, ``vec_r`` order)."""

    name: str
    description: dict
    cfg: ModelConfig
    params: dict
    inputs: torch.Tensor
    target: torch.Tensor
    test: tuple
    module: torch.nn.Module | None = None
    layers: list = field(default_factory=list)
    layer_names: list = field(default_factory=list)
    index: dict = field(default_factory=dict)


def linearized(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` with every Hugging Face ``Conv1D`` (``y = x W + b``, ``W`` ``(in, out)``)
    replaced by the equal ``nn.Linear`` (weight ``Wᵀ``): the same function, in layers curvlinops knows."""
    from transformers.pytorch_utils import Conv1D

    out = copy.deepcopy(model)
    for name, mod in list(out.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, Conv1D):
                d_in, d_out = child.weight.shape
                lin = torch.nn.Linear(d_in, d_out, bias=child.bias is not None, dtype=child.weight.dtype)
                with torch.no_grad():
                    lin.weight.copy_(child.weight.T)
                    if child.bias is not None:
                        lin.bias.copy_(child.bias)
                setattr(mod, child_name, lin)
    return out


def _layer_weights(module: torch.nn.Module) -> tuple[list[str], list]:
    named = [(n, m) for n, m in module.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    return [n for n, _ in named], [m.weight for _, m in named]


def positions(model: torch.nn.Module, weights: list[str]) -> dict:
    """For each of our parameters in ``weights``, the positions of its ``vec_r`` entries in the flat
    concatenation of the weights of :func:`linearized` ``(model)``'s ``Linear``/``Conv2d`` layers, found by
    reading (:func:`blockhess.from_torch`) a copy of ``model`` whose every entry holds its own serial
    number. A parameter of ours not held by those layers is left out."""
    tagged = copy.deepcopy(model).double()
    with torch.no_grad():
        start = 0
        for p in tagged.parameters():
            p.copy_(torch.arange(start, start + p.numel(), dtype=torch.float64).reshape(p.shape))
            start += p.numel()
    _, ours = bh.from_torch(tagged)
    _, layer_w = _layer_weights(linearized(tagged))
    serial = torch.cat([w.detach().reshape(-1) for w in layer_w]).long()
    where = torch.full((start,), -1, dtype=torch.long)
    where[serial] = torch.arange(serial.numel())
    out = {}
    for name in weights:
        pos = where[ours[name].reshape(-1).long()]
        if bool((pos >= 0).all()):
            out[name] = pos
    return out


class _Logits(torch.nn.Module):
    """The model's logits as rows ``(B·L, C)`` (or ``(B, C)``), a row per loss term, as curvlinops' KFAC and
    EKFAC take them (EKFAC only 2-d outputs), with SDPA's math backend (the fused kernels have no second
    derivative). With the targets flattened alike, ``CrossEntropyLoss(reduction="mean")`` is our loss."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            z = self.model(x).logits
        return z.reshape(-1, z.shape[-1])


def _hf_preset(name: str, seed: int):
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(attn_implementation="sdpa")
    if name == "gpt2":
        c = tf.GPT2Config(**GPT2_SIZES, n_positions=64, tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **common)
        return tf.GPT2LMHeadModel(c)
    if name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA_SIZES, **common)).double()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                r = torch.randn(p.shape, generator=gen, dtype=torch.float64)
                p.copy_(1.0 + LLAMA_STD[1] * r if "norm" in n else LLAMA_STD[0] * r)
        return model
    c = tf.ViTConfig(**VIT_SIZES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common)
    return tf.ViTForImageClassification(c)


def float64_llama(model: torch.nn.Module) -> torch.nn.Module:
    r"""Make a ``LlamaForCausalLM`` instance compute its RMSNorms and rotary tables in the input's dtype
    (Hugging Face's compute them in float32 even in a float64 model): each ``LlamaRMSNorm``'s forward
    becomes ``w ⊙ x / √(mean(x²) + ε)`` and each ``LlamaRotaryEmbedding``'s ``cos, sin`` of
    ``position · θ^(−2i/d_k)`` with the frequencies recomputed in the input's dtype from the config's
    ``rope_theta``. Only this instance (and its deep copies) changes, in place; returns it. Raises
    ``ValueError`` for a rotary embedding other than ``rope_type="default"``."""
    import types

    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

    def rms(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        c = self.config
        d_k = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        inv = 1.0 / (c.rope_parameters["rope_theta"] ** (torch.arange(0, d_k, 2, dtype=x.dtype) / d_k))
        emb = torch.cat((position_ids[..., None].to(x.dtype) * inv,) * 2, -1)
        return emb.cos(), emb.sin()

    for m in model.modules():
        if isinstance(m, LlamaRMSNorm):
            m.forward = types.MethodType(rms, m)
        elif isinstance(m, LlamaRotaryEmbedding):
            rope = (getattr(m.config, "rope_parameters", None) or {}).get("rope_type", "default")
            if rope != "default":
                raise ValueError(f"a LlamaForCausalLM with rope_type {rope!r}; compare reads rope_type 'default'")
            m.forward = types.MethodType(rotary, m)
    return model


def check_forward(model: torch.nn.Module, cfg: ModelConfig, params: dict, inputs: torch.Tensor, where: str) -> float:
    """The relative Frobenius difference of the module's logits on ``inputs`` (SDPA's math kernel) from
    :func:`blockhess.forward`'s; raises ``ValueError`` naming ``where`` when it exceeds :data:`FORWARD_TOL`
    (the module then does not compute what our closed forms differentiate)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        z = model(inputs).logits
        ours = bh.forward(params, inputs, cfg)
    err = float((z - ours).norm() / ours.norm())
    if not err <= FORWARD_TOL:
        raise ValueError(f"{where}: the module's logits differ from blockhess.forward's by {err:.2g} "
                         f"(relative Frobenius), more than {FORWARD_TOL:g}")
    return err


def _batch(cfg: ModelConfig, n: int, L: int, gen: torch.Generator, dtype=torch.float64) -> tuple:
    """``n`` random sequences (tokens: ``L + 1`` ids, next-token targets) or images with labels."""
    if cfg.embedding == "token":
        if cfg.positions == "learned" and L > cfg.n_positions:
            raise ValueError(f"--seq-len {L} exceeds the model's {cfg.n_positions} positions")
        ids = torch.randint(0, cfg.vocab, (n, L + 1), generator=gen)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    images = torch.randn((n, *cfg.image), generator=gen, dtype=dtype)
    return images, torch.randint(0, cfg.head, (n,), generator=gen)


def load_data(cfg: ModelConfig, path: str, dtype=torch.float64) -> tuple:
    """The batch of a ``--data`` file (see the option's help): ``(inputs, target, test)``, ``test`` the last
    row as ``(inputs, target)`` of one sequence (image). Token files (``.pt``: a saved integer tensor,
    ``.npy``: an integer array) of shape ``(N, L+1)``, ``N >= 3``, ``L >= 2``, ids in ``[0, vocab)``, ``L`` at
    most a learned position table's length; image files (``.npz``) with ``images`` ``(N, C, H, W)`` of the
    model's image shape, finite floats (cast to ``dtype``), and integer ``labels`` ``(N,)`` in ``[0, classes)``.
    Raises ``ValueError`` naming ``--data`` and the file for anything else."""

    import numpy as np

    where = f"--data {path}"
    suffix = Path(path).suffix
    tokens = cfg.embedding == "token"
    if tokens != (suffix in (".pt", ".npy")):
        raise ValueError(f"{where}: a {'language model' if tokens else 'ViT'} reads "
                         + ("a .pt or .npy array of token ids" if tokens else "an .npz of images and labels"))
    if suffix == ".pt":
        try:
            arrays = {"token ids": load_saved(path)}
        except ValueError as exc:  # load_saved's one-line reason
            raise ValueError(f"{where}: cannot read it: {exc}") from None
    else:
        try:
            if suffix == ".npy":
                arrays = {"token ids": np.load(path, allow_pickle=False)}
            else:
                with np.load(path, allow_pickle=False) as f:
                    arrays = {k: f[k] for k in f.files}
        except Exception as exc:  # np.load raises many kinds (KeyError among them) for a file it cannot read
            raise ValueError(f"{where}: cannot read it: {type(exc).__name__}: "
                             f"{(str(exc) or '-').splitlines()[0]}") from None
    if not tokens:
        missing = [k for k in ("images", "labels") if k not in arrays]
        if missing:
            raise ValueError(f"{where}: no {' and no '.join(missing)} array in it")
    for k, a in arrays.items():
        if not isinstance(a, torch.Tensor | np.ndarray):
            raise ValueError(f"{where}: expected an array of {k}, got {type(a).__name__}")
        arrays[k] = torch.as_tensor(a)
    if tokens:
        ids = arrays["token ids"]
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"{where}: token ids must be integers, got {ids.dtype}")
        if ids.ndim != 2 or ids.shape[0] < 3 or ids.shape[1] < 3:
            raise ValueError(f"{where}: token ids must have shape (N, L+1) with N >= 3 and L >= 2, got {tuple(ids.shape)}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= cfg.vocab:
            raise ValueError(f"{where}: token ids must lie in [0, {cfg.vocab}) (the vocabulary), got [{lo}, {hi}]")
        L = ids.shape[1] - 1
        if cfg.positions == "learned" and L > cfg.n_positions:
            raise ValueError(f"{where}: {L} tokens per sequence exceed the model's {cfg.n_positions} positions")
        ids = ids.long()
        x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    else:
        x, y = arrays["images"], arrays["labels"]
        if not x.dtype.is_floating_point:
            raise ValueError(f"{where}: images must be floating point, got {x.dtype}")
        if x.ndim != 4 or tuple(x.shape[1:]) != tuple(cfg.image) or x.shape[0] < 3:
            raise ValueError(f"{where}: images must have shape (N, {', '.join(map(str, cfg.image))}) with N >= 3, "
                             f"got {tuple(x.shape)}")
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{where}: images must be finite")
        if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
            raise ValueError(f"{where}: labels must be integers, got {y.dtype}")
        if tuple(y.shape) != (x.shape[0],):
            raise ValueError(f"{where}: labels must have shape ({x.shape[0]},), one per image, got {tuple(y.shape)}")
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= cfg.head:
            raise ValueError(f"{where}: labels must lie in [0, {cfg.head}) (the classes), got [{lo}, {hi}]")
        x, y = x.to(dtype).contiguous(), y.long()
    return x[:-1], y[:-1], (x[-1:], y[-1:])


def problem(s: Settings, quiet: bool = False) -> Problem:
    """The model and batch of ``s`` (see the module docstring); ``quiet``: transformers silent while a
    folder is read."""
    gen = torch.Generator().manual_seed(s.seed)
    where = f"--preset {s.preset}" if s.preset else f"--model {s.model_dir}"
    model = _hf_preset(s.preset, s.seed) if s.preset else read_pretrained(s.model_dir, "--model", READS, "compare", quiet)
    model = model.double().eval()
    if type(model).__name__ == "LlamaForCausalLM":
        try:
            float64_llama(model)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    try:
        cfg, params = bh.from_torch(model)
    except NotImplementedError as exc:
        raise ValueError(f"{where}: blockhess.from_torch cannot read it: {exc}") from None
    module = model
    desc = {"kind": type(model).__name__, "config": {k: v for k, v in model.config.to_diff_dict().items()
                                                     if isinstance(v, (int, float, str, bool))}}
    if s.data is not None:
        inputs, target, test = load_data(cfg, s.data)
    else:
        inputs, target = _batch(cfg, s.batch, s.seq_len, gen)
        test = _batch(cfg, 1, s.seq_len, gen)
    desc["forward_rel_diff"] = check_forward(module, cfg, params, inputs, where)
    name = s.preset or Path(s.model_dir).name
    pr = Problem(name, desc, cfg, params, inputs, target, test)
    if module is not None:
        weights = [n for n, v in params.items() if v.ndim == 2]
        pr.index = positions(module, weights)
        pr.module = _Logits(linearized(module))
        pr.layer_names, pr.layers = _layer_weights(pr.module)
    return pr


def modules_of(pr: Problem) -> list[str]:
    """The rows: every weight matrix of ours (2-d parameter), canonical order."""
    return [n for n, v in pr.params.items() if v.ndim == 2]


def whole_of(pr: Problem) -> list[str]:
    """The whole model's rows: the weights of linear maps (the blocks' ``W_*``, the head ``W_H``, and a
    patch embedding's ``W_E``), which every approximation covers; token and position tables are left
    out of the whole (KFAC and GPTQ have no layer for them)."""
    return [n for n in modules_of(pr) if n.startswith("blocks.") or n == "W_H"
            or (n == "W_E" and pr.cfg.embedding == "patch")]


# ----------------------------------------------------------------------------- the exact side


def loss_fn(pr: Problem, params: dict, inputs, target) -> torch.Tensor:
    """Our loss: cross-entropy, the mean over every token (or image)."""
    z = bh.forward(params, inputs, pr.cfg)
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), target.reshape(-1))


def gradients(pr: Problem, names: list[str], inputs, target) -> torch.Tensor:
    """The gradient ``(n,)`` of the mean loss over ``names`` (canonical order)."""
    p = {k: v.detach().clone().requires_grad_(k in names) for k, v in pr.params.items()}
    g = torch.autograd.grad(loss_fn(pr, p, inputs, target), [p[n] for n in names])
    return torch.cat([t.reshape(-1) for t in g])


def exact_dense(pr: Problem, names: list[str]) -> dict:
    """The exact dense GGN (``"outer"``) and Hessian (``"full"``) over ``names``, ``(n, n)`` float64:
    :func:`blockhess.hessian` (the Kronecker walk, or for Llama-family blocks the assembly from exact
    products, docs/derivations.md §16, §20.1)."""
    H = bh.hessian(pr.params, pr.inputs, pr.cfg, loss="ce", target=pr.target, wrt=list(names))
    return {"outer": H.outer.dense(), "full": H.dense()}


# ----------------------------------------------------------------------------- approximations


def curvlinops_dense(pr: Problem, kind: str) -> torch.Tensor:
    """curvlinops' ``KFACLinearOperator`` (``kind="kfac"``) or ``EKFACLinearOperator`` (``"ekfac"``) over
    the weights of ``pr.layers``, dense, in their flat order (:data:`KFAC_SETTINGS`)."""
    from curvlinops import EKFACLinearOperator, KFACLinearOperator

    cls = {"kfac": KFACLinearOperator, "ekfac": EKFACLinearOperator}[kind]
    K = cls(pr.module, torch.nn.CrossEntropyLoss(reduction="mean"), pr.layers, [(pr.inputs, pr.target.reshape(-1))],
            fisher_type="type-2", kfac_approx="expand", check_deterministic=False, num_data=pr.inputs.shape[0])
    n = K.shape[1]
    return K @ torch.eye(n, dtype=torch.float64)


def gptq_dense(pr: Problem) -> torch.Tensor:
    """The GPTQ proxy ``(2/S) XᵀX ⊗ I`` of every layer of ``pr.layers`` (``X`` its inputs, a row per token;
    a ``Conv2d``'s patches), block-diagonal, in their flat order (``nn.Linear``'s ``(out, in)``: ``I ⊗ XᵀX``)."""
    inputs = {}
    mods = dict(pr.module.named_modules())
    hooks = [mods[n].register_forward_pre_hook(lambda m, a, n=n: inputs.__setitem__(n, a[0].detach()))
             for n in pr.layer_names]
    try:
        with torch.no_grad():
            pr.module(pr.inputs)
    finally:
        for h in hooks:
            h.remove()
    S = pr.inputs.shape[0]
    blocks = []
    for n, w in zip(pr.layer_names, pr.layers):
        m, x = mods[n], inputs[n]
        if isinstance(m, torch.nn.Conv2d):
            x = F.unfold(x, m.kernel_size, stride=m.stride).transpose(1, 2)
        X = x.reshape(-1, x.shape[-1])
        blocks.append(torch.kron(torch.eye(w.shape[0], dtype=X.dtype), 2.0 / S * X.T @ X))
    return torch.block_diag(*blocks)


class _Biased(torch.nn.Module):
    """``layer(x) + bias`` for a bias-free ``nn.Linear`` or ``nn.Conv2d`` ``layer``: the same function as the
    layer with that bias, its weight alone in ``layer`` (kronfluence then tracks the weight without the bias)."""

    def __init__(self, layer: torch.nn.Module, bias: torch.Tensor):
        super().__init__()
        self.layer, self.bias = layer, torch.nn.Parameter(bias)
        self.shape = (-1, 1, 1) if isinstance(layer, torch.nn.Conv2d) else (-1,)  # kronfluence wraps the layer

    @property
    def weight(self) -> torch.Tensor:  # read by Hugging Face's forwards (ViT's patch embedding: its dtype)
        return self.layer.weight

    def forward(self, x):
        y = self.layer(x)
        return y + self.bias.reshape(self.shape)


def debiased(module: torch.nn.Module) -> tuple[torch.nn.Module, list[str]]:
    """A deep copy of ``module`` whose every ``nn.Linear``/``nn.Conv2d`` with a bias is a :class:`_Biased` of the
    bias-free layer (the same function), and the names of the bias-free layers in :func:`_layer_weights`'s
    order of ``module``'s layers."""
    out = copy.deepcopy(module)
    names = []
    for n, m in list(out.named_modules()):
        if not isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) or m.bias is None:
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
                names.append(n)
            continue
        bias = m.bias.detach().clone()
        m.bias = None
        parent, _, child = n.rpartition(".")
        setattr(out.get_submodule(parent), child, _Biased(m, bias))
        names.append(f"{n}.layer")
    return out, names


def kronfluence_ekfac(pr: Problem, draws: int, lam: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    r"""kronfluence's EK-FAC (``FactorArguments(strategy="ekfac", use_empirical_fisher=False)``, every factor and
    score in float64) over the weights of ``pr.layers`` on ``pr``'s batch, each sequence (or image) an example
    of kronfluence's, its loss the cross-entropy summed over the example's ``T_s`` loss terms (kronfluence's
    convention: the batch's loss is the sum over examples), labels sampled from the model's softmax
    (generator seeded ``seed``), the batch repeated ``draws`` times (``draws`` label draws per example).

    Returns ``(M, scores)``: ``M`` the dense matrix ``(n, n)``, block-diagonal over the layers in
    :func:`curvlinops_dense`'s flat order, per layer ``(Q_S ⊗ Q_A) diag(vec_r Λ) (Q_S ⊗ Q_A)ᵀ / T_s``
    (``Q_A``, ``Q_S`` the eigenvectors of kronfluence's activation and output-gradient covariances, ``Λ`` its
    corrected eigenvalues divided by its example count; ``(out, in)`` weight order), at our scale: kronfluence
    estimates the mean over examples of the per-example Fisher, which with sampled labels has expectation
    ``T_s`` times our GGN of the mean over tokens (docs/derivations.md §23); and ``scores`` ``(B,)``
    kronfluence's own pairwise influence scores of the training examples (true labels) on ``pr.test``
    (its summed loss), damping ``T_s · lam`` (our ``lam`` at its scale). Layers with a bias are tracked
    without it (:func:`debiased`), so both cover exactly our weights. Raises ``ValueError`` for ``draws < 1``."""
    import logging
    import tempfile
    import warnings

    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task

    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    model, tracked = debiased(pr.module)
    gen = torch.Generator().manual_seed(seed)
    per_example = pr.target[0].numel()

    class _CE(Task):
        def compute_train_loss(self, batch, model, sample=False):
            x, y = batch
            z = model(x)
            if sample:
                with torch.no_grad():
                    y = torch.multinomial(torch.softmax(z.detach(), -1), 1, generator=gen).reshape(-1)
            return F.cross_entropy(z, y.reshape(-1), reduction="sum")

        def compute_measurement(self, batch, model):
            return self.compute_train_loss(batch, model)

        def get_influence_tracked_modules(self):
            return tracked

    task = _CE()
    model = prepare_model(model, task)
    f64 = torch.float64
    fargs = FactorArguments(strategy="ekfac", use_empirical_fisher=False, covariance_max_examples=None,
                            lambda_max_examples=None, activation_covariance_dtype=f64, gradient_covariance_dtype=f64,
                            per_sample_gradient_dtype=f64, lambda_dtype=f64)
    sargs = ScoreArguments(damping_factor=per_example * lam, per_sample_gradient_dtype=f64, precondition_dtype=f64,
                           score_dtype=f64)
    B = pr.inputs.shape[0]
    fit = torch.utils.data.TensorDataset(pr.inputs.repeat(draws, *[1] * (pr.inputs.ndim - 1)),
                                         pr.target.repeat(draws, *[1] * (pr.target.ndim - 1)))
    train = torch.utils.data.TensorDataset(pr.inputs, pr.target)
    query = torch.utils.data.TensorDataset(*pr.test)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*GradScaler", category=FutureWarning)  # its CPU AMP scaler, off
        an = Analyzer("compare", model, task, cpu=True, log_level=logging.WARNING, disable_tqdm=True, output_dir=tmp)
        an.fit_all_factors("ekfac", fit, per_device_batch_size=B, factor_args=fargs, overwrite_output_dir=True)
        factors = an.load_all_factors("ekfac")
        an.compute_pairwise_scores("scores", "ekfac", query, train, per_device_query_batch_size=1,
                                   per_device_train_batch_size=B, score_args=sargs, overwrite_output_dir=True)
        scores = an.load_pairwise_scores("scores")["all_modules"][0].to(f64)
    blocks = []
    for n in tracked:
        QA = factors["activation_eigenvectors"][n].to(f64)
        QS = factors["gradient_eigenvectors"][n].to(f64)
        Lam = factors["lambda_matrix"][n].to(f64) / factors["num_lambda_processed"][n].to(f64)
        Q = torch.kron(QS, QA)
        blocks.append((Q * Lam.reshape(-1)) @ Q.T / per_example)
    return torch.block_diag(*blocks), scores


def sophia_diagonal(pr: Problem, names: list[str], samples: int, gen: torch.Generator) -> torch.Tensor:
    """Sophia's Gauss–Newton–Bartlett diagonal over ``names``, averaged over ``samples`` draws: labels
    from the model's softmax, ``T · ĝ ⊙ ĝ`` with ``ĝ`` the gradient of the mean loss of the sampled
    labels and ``T`` the number of loss terms (tokens, or images)."""
    with torch.no_grad():
        z = bh.forward(pr.params, pr.inputs, pr.cfg)
    probs = torch.softmax(z.reshape(-1, z.shape[-1]), -1)
    T = probs.shape[0]
    acc = 0.0
    for _ in range(samples):
        y = torch.multinomial(probs, 1, generator=gen).reshape(pr.target.shape)
        g = gradients(pr, names, pr.inputs, y)
        acc = acc + T * g * g
    return acc / samples


# ----------------------------------------------------------------------------- metrics


def _components(M: torch.Tensor) -> list[torch.Tensor]:
    """The index sets of the diagonal blocks of a symmetric matrix that is block-diagonal up to a
    permutation (the connected components of its nonzero pattern): a layer-wise approximation's layers."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import connected_components

    k, labels = connected_components(csr_matrix((M != 0).numpy()), directed=False)
    labels = torch.from_numpy(labels)
    return [torch.nonzero(labels == c).reshape(-1) for c in range(k)]


#: eigenvalues within this fraction of the largest magnitude of the largest one count as one top eigenspace
TIES = 1e-8


def _top(M: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis ``(n, m)`` of the eigenspace of the largest eigenvalue of a symmetric matrix (by
    the eigendecomposition of each of its diagonal blocks, :func:`_components`), or of a diagonal ``(n,)``:
    the eigenvectors whose eigenvalues are within :data:`TIES` ``· max|λ|`` of the largest (``m > 1`` for
    ties, e.g. the proxy ``XᵀX ⊗ I``, each of whose eigenvalues is repeated)."""
    if M.ndim == 1:
        keep = M >= M.max() - TIES * M.abs().max()
        return torch.eye(M.shape[0], dtype=M.dtype)[:, keep]
    pairs = []
    for c in _components(M):
        w, U = torch.linalg.eigh(M[c][:, c])
        pairs.append((c, w, U))
    top = max(float(w[-1]) for _, w, _ in pairs)
    scale = max(float(w.abs().max()) for _, w, _ in pairs)
    cols = []
    for c, w, U in pairs:
        for j in torch.nonzero(w >= top - TIES * scale).reshape(-1).tolist():
            v = torch.zeros(M.shape[0], dtype=M.dtype)
            v[c] = U[:, j]
            cols.append(v)
    return torch.stack(cols, 1)


def _inv(M: torch.Tensor, lam: float, B: torch.Tensor) -> torch.Tensor:
    """``(M + λI)⁻¹ B`` for a dense symmetric ``M`` (block by block, :func:`_components`) or a diagonal ``(n,)``."""
    if M.ndim == 1:
        return B / (M + lam).reshape(-1, *([1] * (B.ndim - 1)))
    X = torch.empty_like(B)
    for c in _components(M):
        X[c] = torch.linalg.solve(M[c][:, c] + lam * torch.eye(c.numel(), dtype=M.dtype), B[c])
    return X


def _cos(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """The cosine of ``a`` and ``b``; ``None`` (undefined) where either is zero."""
    if not (a.norm() > 0 and b.norm() > 0):
        return None
    return float(a @ b / (a.norm() * b.norm()))


def spearman(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Spearman's rank correlation of two score vectors (SciPy's, average ranks for ties); ``None``
    (undefined, written ``null`` and "undefined") where either vector is constant: it has no ranks to correlate."""
    from scipy.stats import spearmanr

    if bool((a == a[0]).all()) or bool((b == b[0]).all()):
        return None
    return float(spearmanr(a.numpy(), b.numpy()).statistic)


def metrics(H: torch.Tensor, Hhat: torch.Tensor, lam: float, g: torch.Tensor, G: torch.Tensor, g_test: torch.Tensor,
            exact: dict | None = None) -> dict:
    """Every metric of the approximation ``Hhat`` (dense ``(n, n)`` or a diagonal ``(n,)``) against the exact
    ``H`` ``(n, n)``: ``rel_fro``, ``top_cos``, ``inverse_cos`` (of ``(· + λI)⁻¹ g``), ``spearman`` (of the
    scores ``Gᵀ (· + λI)⁻¹ g_test``, ``G`` ``(n, m)`` the training sequences' gradients), and for a diagonal
    ``diag_rel``. ``exact``: the exact side's ``top``, ``inverse`` and ``scores`` when already known."""
    e = exact or {}
    top = e["top"] if "top" in e else torch.linalg.eigh(H)[1][:, -1]
    x = e["inverse"] if "inverse" in e else _inv(H, lam, g)
    scores = e["scores"] if "scores" in e else G.T @ _inv(H, lam, g_test)
    D = torch.diag(Hhat) if Hhat.ndim == 1 else Hhat
    Y = _inv(Hhat, lam, torch.stack([g, g_test], 1))
    out = {"rel_fro": float((D - H).norm() / H.norm()), "top_cos": float((_top(Hhat).T @ top).norm() / top.norm()),
           "inverse_cos": _cos(x, Y[:, 0]), "spearman": spearman(scores, G.T @ Y[:, 1])}
    if Hhat.ndim == 1:
        d = torch.diagonal(H)
        out["diag_rel"] = float((Hhat - d).norm() / d.norm())
    return out


def best_scale(P: torch.Tensor, H: torch.Tensor) -> float:
    """``c = ⟨P, H⟩_F / ‖P‖_F²``, the scalar minimising ``‖c P − H‖_F``."""
    return float((P * H).sum() / (P * P).sum())


# ----------------------------------------------------------------------------- the run


def _slices(names: list[str], sizes: dict) -> dict:
    out, start = {}, 0
    for n in names:
        out[n] = slice(start, start + sizes[n])
        start += sizes[n]
    return out


def compare(pr: Problem, s: Settings, quiet: bool = False) -> dict:
    """Every number of the report (see the module docstring) for ``pr``; returns the ``results``,
    ``exact`` and ``methods`` sections of ``compare.json``."""
    mods, whole = modules_of(pr), whole_of(pr)
    sizes = {n: pr.params[n].numel() for n in mods}
    sl = _slices(mods, sizes)
    widx = torch.cat([torch.arange(sl[n].start, sl[n].stop) for n in whole])
    g = gradients(pr, mods, pr.inputs, pr.target)
    G = torch.stack([gradients(pr, mods, pr.inputs[i:i + 1], pr.target[i:i + 1]) for i in range(pr.inputs.shape[0])], 1)
    g_test = gradients(pr, mods, *pr.test)
    bar = progress(total=len(PARTS) + 6, quiet=quiet, desc=f"compare {pr.name}")
    ops = {part: bh.hessian_operator(pr.params, pr.inputs, pr.cfg, loss="ce", target=pr.target, part=part)
           for part in PARTS}
    exact = exact_dense(pr, mods)
    bar.update(2)
    eig = {part: torch.linalg.eigh(exact[part][widx][:, widx]) for part in PARTS}  # the whole model's
    lam = s.damping * float(eig["outer"][0][-1])

    # approximations, each over every module it covers: {key: (dense over mods or diag (n,), covered names)}
    approx, methods = {}, {}
    if pr.module is not None:
        covered = [n for n in mods if n in pr.index]
        idx = torch.cat([pr.index[n] for n in covered])
        pos = torch.cat([torch.arange(sl[n].start, sl[n].stop) for n in covered])

        def to_canonical(K: torch.Tensor) -> torch.Tensor:
            M = torch.zeros(sum(sizes.values()), sum(sizes.values()), dtype=torch.float64)
            M[pos.unsqueeze(1), pos.unsqueeze(0)] = K[idx.unsqueeze(1), idx.unsqueeze(0)]
            return M

        for kind in ("kfac", "ekfac"):
            approx[kind] = (to_canonical(curvlinops_dense(pr, kind)), covered)
            methods[kind] = {"source": f"curvlinops {kind.upper()}LinearOperator", **KFAC_SETTINGS}
            bar.update()
        if importlib.util.find_spec("kronfluence") is None:
            methods["kronfluence_ekfac"] = {"not_run": KRONFLUENCE_MISSING}
        else:
            M, kf_scores = kronfluence_ekfac(pr, s.kronfluence_draws, lam, s.seed)
            approx["kronfluence_ekfac"] = (to_canonical(M), covered)
            methods["kronfluence_ekfac"] = {"source": "kronfluence EK-FAC", **KRONFLUENCE_SETTINGS,
                                            "draws": s.kronfluence_draws, "seed": s.seed}
        bar.update()
        approx["gptq_raw"] = (to_canonical(gptq_dense(pr)), covered)
        methods["gptq_raw"] = {"source": "(2/S) X^T X ⊗ I per layer, S sequences"}
        methods["gptq_best"] = {"source": "c · gptq_raw, c = <P, H>_F / ||P||_F^2 per row and reference"}
        bar.update()
    gen = torch.Generator().manual_seed(s.seed)
    for S in s.sophia:
        approx[f"sophia_{S}"] = (sophia_diagonal(pr, mods, S, gen), mods)
        methods[f"sophia_{S}"] = {"source": "Gauss-Newton-Bartlett, T * g_hat^2 of sampled labels", "samples": S,
                                  "seed": s.seed}
    hutch = {part: {N: hutchinson_diagonal(ops[part][tuple(mods), tuple(mods)], N, seed=s.seed).value for N in s.hutchinson}
             for part in PARTS}
    for N in s.hutchinson:
        methods[f"hutchinson_{N}"] = {"source": "blockhess.operators.hutchinson_diagonal of the reference itself",
                                      "probes": N, "seed": s.seed}
    bar.update()

    results, exact_out = {}, {}
    for part in PARTS:
        H = exact[part]
        rows = {n: [n] for n in mods}
        rows[WHOLE] = whole
        res, ex = {}, {}
        for row, names in rows.items():
            ii = widx if row == WHOLE else torch.arange(sl[row].start, sl[row].stop)
            Hb = H[ii][:, ii]
            w, U = eig[part] if row == WHOLE else torch.linalg.eigh(Hb)
            inv = U @ ((U.T @ torch.stack([g[ii], g_test[ii]], 1)) / (w + lam).unsqueeze(1))
            e = {"top": U[:, -1], "inverse": inv[:, 0], "scores": G[ii].T @ inv[:, 1]}
            ex[row] = {"n": int(ii.numel()), "fro": float(Hb.norm()), "trace": float(torch.trace(Hb)),
                       "eig_max": float(w[-1]), "eig_min": float(w[0])}
            r = {}
            args = (lam, g[ii], G[ii], g_test[ii], e)
            for key, (M, cov) in approx.items():
                if not set(names) <= set(cov):
                    continue
                Mb = M[ii] if M.ndim == 1 else M[ii][:, ii]
                r[key] = metrics(Hb, Mb, *args)
                if key == "kronfluence_ekfac" and row == WHOLE:  # its own scores over the same weights
                    r[key]["spearman"] = spearman(e["scores"], kf_scores)
                if key == "gptq_raw":
                    c = best_scale(Mb, Hb)
                    r["gptq_best"] = {**metrics(Hb, c * Mb, *args), "scale": c}
            for N, d in hutch[part].items():
                db = d[ii]
                r[f"hutchinson_{N}"] = {**metrics(Hb, db, *args),
                                        "trace_rel": float(abs(db.sum() - torch.trace(Hb)) / abs(torch.trace(Hb)))}
            res[row] = r
        results[part], exact_out[part] = res, ex
        bar.update()
    bar.close()
    return {"results": results, "exact": exact_out, "methods": methods, "damping": lam, "modules": sizes,
            "whole": whole, "kfac_layers": pr.layer_names}


# ----------------------------------------------------------------------------- output


def _order(methods: dict) -> list[str]:
    return [k for k in methods if "not_run" not in methods[k]]


def markdown(rep: dict) -> str:
    """``compare.md``: the settings, then per reference a table per metric (rows modules, columns methods)."""
    s = rep["settings"]
    lines = [f"# blockhess compare: {rep['name']}", "",
             f"Model: {rep['model'].get('kind')}; {sum(rep['modules'].values()):,} weights in {len(rep['modules'])} "
             f"matrices (whole model: {len(rep['whole'])} matrices of linear maps). Batch {s['batch']}"
             + (f" x {s['seq_len']} tokens" if rep["tokens"] else " images")
             + f", seed {s['seed']}, float64, loss: cross-entropy, mean over "
             + ("tokens" if rep["tokens"] else "images") + f". Damping λ = {s['damping']:g} · λ_max(GGN) = "
             f"{rep['damping']:.4g}.", ""]
    for k, m in rep["methods"].items():
        if "not_run" in m:
            lines.append(f"- `{k}`: not run: {m['not_run']}")
    lines.append("")
    cols = _order(rep["methods"])
    for part in PARTS:
        res = rep["results"][part]
        lines += [f"## Against the {REFERENCE[part]} (`part=\"{part}\"`)", ""]
        for metric in METRICS:
            used = [c for c in cols if any(metric in r.get(c, {}) for r in res.values())]
            if not used:
                continue
            lines += [f"### {metric}", "", "| module | " + " | ".join(used) + " |", "|---" * (len(used) + 1) + "|"]
            for row, r in res.items():
                cells = [("undefined" if r[c][metric] is None else f"{r[c][metric]:.3g}") if c in r and metric in r[c]
                         else "–" for c in used]
                lines.append(f"| `{row}` | " + " | ".join(cells) + " |")
            lines.append("")
    lines += ["Figures: " + ", ".join(f"`{f}`" for f in rep["figures"]) + ".", "",
              f"Run time {rep['timings']['total_s']:.1f} s.", ""]
    return "\n".join(lines)


def figures(tmp: Path, rep: dict) -> list[str]:
    out = []
    for metric in ("rel_fro", "inverse_cos"):
        panels = {}
        for part in PARTS:
            res = rep["results"][part]
            rows = list(res)
            panels[REFERENCE[part]] = {c: [res[r].get(c, {}).get(metric, float("nan")) for r in rows]
                                       for c in _order(rep["methods"])}
        plots.per_module_metric(tmp / f"{metric}.png", rows, panels, metric, f"{rep['name']}: {metric} per module and "
                                "method", log=metric == "rel_fro")
        out.append(f"{metric}.png")
    return out


def run(args: argparse.Namespace) -> int:
    missing = [m for m in ("transformers", "curvlinops") if importlib.util.find_spec(m) is None]
    if missing:  # the models come from transformers (the hf extra), KFAC and EKFAC from curvlinops (requirements-laplace.txt)
        raise ValueError(f"blockhess compare needs {' and '.join(missing)}: pip install 'blockhess[hf]' and "
                         "pip install --no-deps -r requirements-laplace.txt")
    s = settings(args)
    check_out(args.out)
    with torch_threads(args.threads):
        return _run(args, s)


def _run(args: argparse.Namespace, s: Settings) -> int:
    t0 = time.perf_counter()
    out = Path(args.out)
    with atomic_dir(out) as tmp:
        env = environment()
        pr = problem(s, bool(args.quiet))
        body = compare(pr, s, bool(args.quiet))
        rep = {"command": "blockhess compare", "name": pr.name, "model": pr.description,
               "tokens": pr.cfg.embedding == "token",
               "settings": {"preset": s.preset, "model_dir": s.model_dir, "data": s.data,
                            "batch": int(pr.inputs.shape[0]),
                            "seq_len": int(pr.inputs.shape[1]) if pr.cfg.embedding == "token" else s.seq_len,
                            "sophia_samples": list(s.sophia), "hutchinson_samples": list(s.hutchinson),
                            "damping": s.damping, "seed": s.seed, "kronfluence_draws": s.kronfluence_draws,
                            "dtype": "float64"},
               **body, "environment": env}
        rep["environment"]["load_average_at_end"] = load_average()
        rep["figures"] = []
        rep["timings"] = {"total_s": time.perf_counter() - t0, "peak_rss_bytes": peak_bytes()}
        rep["figures"] = figures(tmp, rep)
        write_json(tmp / "compare.json", rep)
        (tmp / "compare.md").write_text(markdown(rep))
    if not args.quiet:
        print(f"blockhess compare: wrote {out}/ ({pr.name}: {len(rep['modules'])} modules, "
              f"{len(_order(rep['methods']))} approximations; {rep['timings']['total_s']:.1f} s)")
    return 0
