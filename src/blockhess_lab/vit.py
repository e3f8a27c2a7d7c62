r"""A post-LN Vision Transformer (one block by default) on scikit-learn's digits: data, model, training, checkpoint.

The paper's experiments (arXiv 2510.16927, §5.1–5.4) train a 1-block post-LN ViT on MNIST and
study the Hessian of its block. Here the same model runs on the 1,797 handwritten 8×8 digits
that ship with scikit-learn (``sklearn.datasets.load_digits``: nothing is downloaded):

.. math::
    X = \mathrm{patches}(x)\,W_E + b_E + P,\qquad
    Z = \mathrm{Block}(X;\,W_Q, W_K, W_V, W_1, W_2),\qquad
    \mathrm{logits} = \Big(\frac1L \sum_t z_t\Big) W_H + b_H,

* ``patches``: non-overlapping ``p×p`` patches (``p = 2``: ``L = 16`` tokens of 4 pixels), patch
  order and pixel order row-major; pixels scaled to ``[0, 1]``;
* ``P``: fixed sinusoidal positions (base 10000), as in the paper's code;
* ``Block``: one :mod:`blockhess` block in the paper's setting (one head, ReLU, no biases, no
  ``W_O``, LayerNorm without affine), ``ln_eps = 1e-5`` (the paper's theory uses 0; a small
  eps keeps LayerNorm smooth for any input). The forward pass uses the plain ops of
  :func:`blockhess.reference.forward` (faster to train through than :func:`blockhess.forward`,
  which also builds the derivative caches: docs/results.md, "The digits ViT's training"); both
  compute the same function;
* mean-pool over tokens, linear head (with bias) to 10 classes, cross-entropy.

Row vectors act on the right throughout (as in the block, docs/derivations.md): ``W_E`` is ``(p², d_model)``, ``W_H``
is ``(d_model, 10)``.

The model is exactly :class:`blockhess.config.ModelConfig` ``(blocks=(cfg,) * n_blocks, embedding="patch",
image=(1, 8, 8), patch=p, positions="sinusoidal", pool="mean", head=10)`` (:func:`model_config`; the row-major
pixel order of :func:`patchify` is the model's channel-major patch order for one channel), its weights are
that config's parameters under its names (``W_E, b_E, blocks.0.W_Q, ..., W_H, b_H``), and the training's
forward pass is :func:`blockhess.reference.forward` of that config. So the exact Hessian of the whole
model's loss is ``bh.hessian(vit.params, vit.model_inputs(images), vit.model_cfg, loss="ce", target=labels)``.
``arch["n_blocks"]`` (default 1) stacks more blocks of the same recipe.

For one block, everything after it is a function of the block output ``Z`` alone, so the model's loss
*is* a loss ``ℓ(Z)`` of the block, and :func:`blockhess.hessian` with
``loss=vit.head_loss, target=labels`` gives the exact Hessian of the model's cross-entropy
w.r.t. the block's weights, with the embedded patches ``vit.embed(images)`` as the block's
input ``X``.

The interface used by the ``report``, ``bounds`` and ``convergence`` commands (they read
``--checkpoint``, or keep the model in :func:`default_checkpoint` under the current folder:
:func:`load_for_command`):

>>> vit = load_or_train("checkpoints/digits_vit.pt")   # doctest: +SKIP
>>> X = vit.embed(vit.train_images[:128])          # (128, 16, 16) float64, the block's input
>>> y = vit.train_labels[:128]
>>> H = bh.hessian(vit.block_params(), X, vit.cfg, loss=vit.head_loss, target=y)   # doctest: +SKIP
>>> Hm = bh.hessian(vit.params, vit.model_inputs(vit.train_images[:128]), vit.model_cfg, loss="ce", target=y)  # doctest: +SKIP

Seeds: one ``seed`` fixes the train/test split, the initial weights and the order of the
training batches, each drawn from its own private generator (the global RNGs are untouched).
Training keeps snapshots of the weights at :func:`snapshot_steps` (``0, 200, ..., 1000`` for the
default 2,000 steps) for the report's training-dynamics figure (:meth:`TrainedViT.at_step`).
Training is float32 on CPU; every analysis method works in the dtype it is asked for
(float64 by default) from a float64 master copy of the weights.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as Fn

from blockhess.config import BlockConfig, ModelConfig, block_prefix, init_params, model_param_shapes, sinusoidal_positions
from blockhess.reference import forward as plain_forward
from .runtime import load_saved, progress, torch_threads

__all__ = [
    "DEFAULT_CHECKPOINT",
    "DEFAULT_STEPS",
    "default_checkpoint",
    "BLOCK_NAMES",
    "TrainedViT",
    "load_data",
    "split_data",
    "check_batch",
    "patchify",
    "sinusoidal_positions",
    "model_config",
    "snapshot_steps",
    "init_model",
    "train",
    "train_like",
    "save",
    "load",
    "load_or_train",
    "load_for_command",
]

#: Where the commands keep the model when no ``--checkpoint`` is given (relative to the current folder; :func:`default_checkpoint`).
DEFAULT_CHECKPOINT = "checkpoints/digits_vit.pt"
#: Training steps (batches of 128) when :func:`load_or_train` has to train and none are given.
DEFAULT_STEPS = 2000
#: The block's weights, canonical order (in the model: ``blocks.{i}.`` before each).
BLOCK_NAMES = ("W_Q", "W_K", "W_V", "W_1", "W_2")
#: Training snapshots: six, evenly spaced over the first ``SNAPSHOT_SPAN`` steps (or all of a shorter run).
SNAPSHOT_SPAN = 1000
N_SNAPSHOTS = 6

N_CLASSES = 10
IMAGE_SIZE = 8
TEST_FRACTION = 0.2
FORMAT = "blockhess-digits-vit"
#: 2: the model's parameter names (``blocks.0.W_Q``), ``arch["n_blocks"]`` and the training snapshots;
#: 1 (read too): one block, its weights under the block's names, no snapshots.
FORMAT_VERSION = 2

#: The model used by ``make run`` (d_ff = 32, not the paper's 64: see docs in README / report).
DEFAULT_ARCH = {"patch": 2, "d_model": 16, "d_ff": 32, "d_k": 16, "ln_eps": 1e-5, "n_blocks": 1}

#: Optimiser settings: the paper's experimental setup except the learning rate and no augmentation.
DEFAULT_OPTIM = {
    "lr": 3e-3,
    "betas": (0.9, 0.95),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "grad_clip": 1.0,
    "warmup_steps": 100,
    "batch_size": 128,
}


# ----------------------------------------------------------------------------- data


def load_data() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits: images ``(N, 8, 8)`` float64 in ``[0, 1]`` (pixel / 16) and labels ``(N,)`` int64."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = torch.as_tensor(d.images, dtype=torch.float64) / 16.0
    labels = torch.as_tensor(d.target, dtype=torch.int64)
    return images, labels


def split_data(labels: torch.Tensor, seed: int = 0, test_fraction: float = TEST_FRACTION):
    """A stratified train/test split: ``(train_index, test_index)``, int64, each sorted.

    Per class, a seeded permutation (private generator) puts ``round(test_fraction · n_c)``
    images into the test set.
    """
    gen = torch.Generator().manual_seed(int(seed))
    train, test = [], []
    for c in range(int(labels.max()) + 1):
        idx = torch.nonzero(labels == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=gen)]
        k = int(round(test_fraction * len(idx)))
        test.append(idx[:k])
        train.append(idx[k:])
    return torch.cat(train).sort().values, torch.cat(test).sort().values


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """``(N, H, W)`` images -> ``(N, (H/p)(W/p), p²)`` non-overlapping patches, both orders row-major."""
    N, H, W = images.shape
    if H % patch or W % patch:
        raise ValueError(f"patch size {patch} must divide the image size {H}x{W}")
    x = images.reshape(N, H // patch, patch, W // patch, patch).permute(0, 1, 3, 2, 4)
    return x.reshape(N, (H // patch) * (W // patch), patch * patch)


# ----------------------------------------------------------------------------- model


def _block_config(arch: dict) -> BlockConfig:
    return BlockConfig(d_model=arch["d_model"], d_ff=arch["d_ff"], d_k=arch["d_k"], ln_eps=arch["ln_eps"])


def model_config(arch: dict) -> ModelConfig:
    """The digits ViT of ``arch`` as a :class:`~blockhess.config.ModelConfig`: ``arch["n_blocks"]``
    (default 1) blocks of :func:`_block_config`, a patch embedding of the one-channel 8×8 image with
    bias, sinusoidal positions, mean pooling and a 10-class head with bias."""
    return ModelConfig(blocks=(_block_config(arch),) * int(arch.get("n_blocks", 1)), embedding="patch",
                       image=(1, IMAGE_SIZE, IMAGE_SIZE), patch=arch["patch"], positions="sinusoidal", pool="mean",
                       head=N_CLASSES, head_bias=True)


def snapshot_steps(steps: int) -> list[int]:
    """The steps at which :func:`train` keeps the weights (after that many updates; 0 is the
    initialisation): :data:`N_SNAPSHOTS` evenly spaced over ``min(steps, SNAPSHOT_SPAN)``, rounded,
    each once (``[0, 200, 400, 600, 800, 1000]`` for 2,000 steps, ``[0, 2, 4, 6, 8, 10]`` for 10)."""
    span = min(int(steps), SNAPSHOT_SPAN)
    return sorted({round(i * span / (N_SNAPSHOTS - 1)) for i in range(N_SNAPSHOTS)})


def init_model(arch: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Initial weights (float64) under the model's names: :func:`blockhess.init_params` of
    :func:`model_config` with ``seed`` (block ``i`` from ``seed + i``; patch embedding and head
    ``N(0, 1/fan_in)``, zero biases, from a generator seeded ``seed + n_blocks``)."""
    return init_params(model_config(arch), seed=int(seed), dtype=torch.float64)


def _embed(params: dict, images: torch.Tensor, patch: int) -> torch.Tensor:
    x = patchify(images, patch)
    P = sinusoidal_positions(x.shape[1], params["W_E"].shape[1], params["W_E"].dtype, params["W_E"].device)
    return x @ params["W_E"] + params["b_E"] + P


def _head(params: dict, Z: torch.Tensor) -> torch.Tensor:
    return Z.mean(-2) @ params["W_H"] + params["b_H"]


def _logits(params: dict, images: torch.Tensor, mc: ModelConfig) -> torch.Tensor:
    """``(B, 10)`` logits of ``(B, 8, 8)`` images by the model's plain forward (:func:`blockhess.reference.forward`)."""
    return plain_forward(params, images.to(params["W_E"].dtype)[:, None], mc)[:, 0]


# ----------------------------------------------------------------------------- the trained model


@dataclass
class TrainedViT:
    """A digits ViT with its data split; the interface of the ``report``, ``bounds`` and ``convergence`` commands.

    Attributes
    ----------
    cfg : blockhess.BlockConfig
        The configuration of each block (``d_model``, ``d_ff``, ``d_k``, ``ln_eps``).
    arch : dict
        ``patch``, ``d_model``, ``d_ff``, ``d_k``, ``ln_eps``, ``n_blocks``.
    params, init_params_ : dict[str, Tensor]
        Every weight under the model's names (``model_param_shapes(vit.model_cfg)``: ``W_E, b_E,
        blocks.0.W_Q, ..., W_H, b_H``), float64: trained, and at initialisation.
    seed : int
        The seed of the split, the initialisation and the batch order.
    test_accuracy : float
        Accuracy of ``params`` on the test split (fraction in ``[0, 1]``).
    train_images, train_labels, test_images, test_labels : Tensor
        The split: images ``(N, 8, 8)`` float64 in ``[0, 1]``, labels ``(N,)`` int64.
    train_index, test_index : Tensor
        Where the split's images sit in :func:`load_data` (int64, sorted).
    train_info : dict
        Steps, optimiser settings, seconds, final training loss, where the model came from.
    checkpoint : str or None
        The file it was loaded from or saved to.
    snapshots : dict[int, dict[str, Tensor]]
        The weights after ``step`` updates, for each step of :func:`snapshot_steps` (float64, the
        model's names); empty for a model read from a format-1 checkpoint.
    """

    cfg: BlockConfig
    arch: dict
    params: dict
    init_params_: dict
    seed: int
    test_accuracy: float
    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    train_index: torch.Tensor | None = None
    test_index: torch.Tensor | None = None
    train_info: dict = field(default_factory=dict)
    checkpoint: str | None = None
    snapshots: dict = field(default_factory=dict)
    _cast: dict = field(default_factory=dict, repr=False)

    # -- weights ---------------------------------------------------------------------------
    @property
    def model_cfg(self) -> ModelConfig:
        """The whole model as a :class:`~blockhess.config.ModelConfig` (:func:`model_config`)."""
        return model_config(self.arch)

    @property
    def n_blocks(self) -> int:
        """Number of blocks."""
        return int(self.arch.get("n_blocks", 1))

    def _weights(self, dtype: torch.dtype, device=None) -> dict:
        key = (dtype, torch.device(device or "cpu"))
        if key not in self._cast:
            self._cast[key] = {n: v.to(dtype=dtype, device=key[1]) for n, v in self.params.items()}
        return self._cast[key]

    def _one_block(self, what: str) -> None:
        if self.n_blocks != 1:
            raise ValueError(f"{what} is the one block's; this model has {self.n_blocks} blocks "
                             "(use params, model_cfg and model_inputs for the whole model)")

    def model_params(self, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
        """Every weight under the model's names, in ``dtype`` (fresh copies)."""
        return {n: v.to(dtype).clone() for n, v in self.params.items()}

    def block_params(self, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
        """The block's weights ``{W_Q, W_K, W_V, W_1, W_2}`` in ``dtype`` (fresh copies); one block only
        (``ValueError`` otherwise)."""
        self._one_block("block_params")
        pre = block_prefix(0)
        return {n: self.params[pre + n].to(dtype).clone() for n in BLOCK_NAMES}

    def at_init(self) -> "TrainedViT":
        """The same model with *every* weight (embedding, block, head) at its initial value.

        Its ``embed``, ``head_loss`` and ``block_params`` describe the untrained model (the
        report's and ``bounds``' "init" numbers); its ``test_accuracy`` is that of the initial
        weights. ``vit.at_init().block_params()`` are the block's initial weights; passed to
        this (trained) model's ``logits`` or ``per_sample_losses`` they give a hybrid: the
        initial block inside the trained embedding and head.
        """
        return self._with(self.init_params_)

    def at_step(self, step: int) -> "TrainedViT":
        """The same model with every weight as it was after ``step`` training updates (a key of
        :attr:`snapshots`; ``ValueError`` naming the steps kept otherwise)."""
        if step not in self.snapshots:
            raise ValueError(f"no snapshot of step {step!r}: this model kept {sorted(self.snapshots) or 'none'}")
        return self._with(self.snapshots[step])

    def _with(self, params: dict) -> "TrainedViT":
        vit = replace(self, params=params, _cast={})
        vit.test_accuracy = vit.accuracy(self.test_images, self.test_labels)
        return vit

    # -- the model, piece by piece ---------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        """Tokens per image, ``(8/p)²``."""
        return (IMAGE_SIZE // self.arch["patch"]) ** 2

    @staticmethod
    def _check_images(images) -> None:
        side = IMAGE_SIZE  # the images are square
        if not isinstance(images, torch.Tensor) or images.ndim not in (2, 3) or tuple(images.shape[-2:]) != (side, side):
            raise ValueError(f"images must be a tensor of shape (B, {side}, {side}) or ({side}, {side}), "
                             f"got {tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__}")
        if images.numel() and not (bool(torch.isfinite(images).all()) and float(images.min()) >= 0 and float(images.max()) <= 1):
            raise ValueError("images must hold pixel values in [0, 1], like the training data (scale raw pixels first)")

    def embed(self, images: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The first block's input: patch embedding plus positions, ``(B, L, d_model)`` in ``dtype``.

        ``images``: ``(B, 8, 8)`` (or one image ``(8, 8)`` -> ``(L, d_model)``), pixel values in
        ``[0, 1]`` like the training data. Raises ``ValueError`` for another shape, NaN/Inf or
        values outside ``[0, 1]`` (e.g. raw 0–255 or 0–16 pixels).
        """
        self._check_images(images)
        one = images.ndim == 2
        X = _embed(self._weights(dtype, images.device), (images[None] if one else images).to(dtype), self.arch["patch"])
        return X[0] if one else X

    def model_inputs(self, images: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """What the whole model (:attr:`model_cfg`) takes: ``(B, 1, 8, 8)`` images in ``dtype`` (one
        image ``(8, 8)`` -> ``(1, 8, 8)``). Raises ``ValueError`` as :meth:`embed`."""
        self._check_images(images)
        return images.to(dtype).unsqueeze(-3)

    def head_loss(self, Z: torch.Tensor, y) -> torch.Tensor:
        r"""Cross-entropy of ``head(mean-pool(Z))`` against the class ``y``: the model's loss as a loss of the last block's output.

        ``Z``: one sequence ``(L, d_model)`` and ``y`` an integer (or 0-d tensor) -> a scalar;
        this is the callable-loss convention of :func:`blockhess.hessian`, so
        ``bh.hessian(params, X, vit.cfg, loss=vit.head_loss, target=labels)`` is the exact
        Hessian of the model's mean cross-entropy over the batch. Also accepts a batch
        ``Z`` ``(B, L, d)`` with ``y`` ``(B,)`` and then returns the mean. Twice
        differentiable in ``Z`` (``torch.func``-traceable, ``vmap``-able); computed in ``Z.dtype``.
        A class outside ``0..9`` makes the value NaN (a check that ``vmap`` can trace; its
        derivatives stay finite), which :func:`blockhess.hessian` refuses, naming the sequence.
        """
        w = self._weights(Z.dtype, Z.device)
        logits = _head(w, Z)  # (..., C)
        y = torch.as_tensor(y, device=Z.device)
        onehot = (torch.arange(N_CLASSES, device=Z.device) == y[..., None]).to(Z.dtype)
        ce = torch.logsumexp(logits, -1) - (logits * onehot).sum(-1)
        return (ce + torch.where(onehot.sum(-1) == 1, 0.0, torch.nan).to(Z.dtype)).mean()

    def logits(self, images: torch.Tensor, block_params: dict | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Class logits ``(B, 10)``; ``block_params`` (one block only) replaces the block's weights (their dtype wins)."""
        if dtype is None:
            dtype = next(iter(block_params.values())).dtype if block_params else torch.float64
        w = dict(self._weights(dtype, images.device))
        if block_params is not None:
            self._one_block("block_params")
            w.update({block_prefix(0) + n: block_params[n] for n in BLOCK_NAMES})
        return _logits(w, images, self.model_cfg)

    def per_sample_losses(self, images: torch.Tensor, labels: torch.Tensor, block_params: dict | None = None) -> torch.Tensor:
        """Cross-entropy of each image, ``(B,)``, in the dtype of ``block_params`` (float64 by default).

        ``block_params`` (``{W_Q, ..., W_2}``) replaces the trained block weights, the embedding
        and head staying as they are; the mean of this equals ``head_loss`` over the embedded batch.
        """
        return Fn.cross_entropy(self.logits(images, block_params), labels, reduction="none")

    def accuracy(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        """Fraction of ``images`` classified as ``labels`` (float64 forward)."""
        with torch.no_grad():
            return float((self.logits(images).argmax(-1) == labels).double().mean())


# ----------------------------------------------------------------------------- training


def train(
    seed: int = 0,
    *,
    steps: int = DEFAULT_STEPS,
    quiet: bool = False,
    arch: dict | None = None,
    optim: dict | None = None,
) -> TrainedViT:
    """Train the digits ViT on CPU in float32 with AdamW and return it (not saved; see :func:`save`).

    Linear warm-up over ``warmup_steps``, then a constant learning rate; gradient clipping;
    batches of ``batch_size`` drawn without replacement, reshuffled each epoch by a private
    generator seeded ``seed + 2``. ``arch`` and ``optim`` override :data:`DEFAULT_ARCH` and
    :data:`DEFAULT_OPTIM` key by key. The weights after each step of :func:`snapshot_steps`
    are kept (``vit.snapshots``). A progress bar shows the loss unless ``quiet``.

    Runs on one thread (restored afterwards): the model is too small for intra-op parallelism
    to pay (docs/results.md, "The digits ViT's training").
    """
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    with torch_threads(1):
        return _train(seed, steps, quiet, arch, optim)


def _train(seed, steps, quiet, arch, optim) -> TrainedViT:
    arch = {**DEFAULT_ARCH, **(arch or {})}
    opt = {**DEFAULT_OPTIM, **(optim or {})}
    mc = model_config(arch)
    images, labels = load_data()
    tr, te = split_data(labels, seed)
    init = init_model(arch, seed)
    w = {n: v.to(torch.float32).clone().requires_grad_(True) for n, v in init.items()}
    Xtr, ytr = images[tr].to(torch.float32), labels[tr]
    optimizer = torch.optim.AdamW(
        list(w.values()), lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"], weight_decay=opt["weight_decay"]
    )
    warm = max(int(opt["warmup_steps"]), 1)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))
    gen = torch.Generator().manual_seed(int(seed) + 2)
    bs = min(int(opt["batch_size"]), len(tr))
    order, pos = torch.randperm(len(tr), generator=gen), 0
    keep = set(snapshot_steps(steps))
    snapshots = {}
    t0 = time.perf_counter()
    losses = []
    bar = progress(range(steps), quiet, desc=f"train digits ViT ({mc.n_layers} block{'s' if mc.n_layers > 1 else ''})",
                   unit="step")
    for step in bar:
        if step in keep:  # step 0: the float64 initialisation itself (training's float32 copy rounds it)
            snapshots[step] = init if step == 0 else {n: v.detach().to(torch.float64) for n, v in w.items()}
        if pos + bs > len(tr):
            order, pos = torch.randperm(len(tr), generator=gen), 0
        idx = order[pos : pos + bs]
        pos += bs
        loss = Fn.cross_entropy(_logits(w, Xtr[idx], mc), ytr[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(w.values()), opt["grad_clip"])
        optimizer.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    seconds = time.perf_counter() - t0
    params = {n: v.detach().to(torch.float64) for n, v in w.items()}
    if steps in keep:
        snapshots[steps] = init if steps == 0 else params
    if not all(torch.isfinite(v).all() for v in params.values()):  # not bad input: the recipe failed (traceback)
        raise RuntimeError(f"training diverged (seed {seed}, {steps} steps, lr {opt['lr']}): the weights contain NaN or Inf")
    info = {
        "steps": steps,
        "optimizer": "AdamW",
        **{k: (list(v) if isinstance(v, tuple) else v) for k, v in opt.items()},
        "precision": "float32",
        "train_seconds": seconds,
        "threads": 1,
        "final_loss_mean_last_50": sum(losses[-50:]) / max(len(losses[-50:]), 1),
        "loss_history": losses[:: max(1, steps // 100)] if steps else [],
        "snapshot_steps": sorted(snapshots),
        "torch_version": str(torch.__version__),
    }
    vit = _assemble(arch, params, init, int(seed), images, labels, tr, te, info, None, snapshots)
    info["test_accuracy"] = vit.test_accuracy
    return vit


def train_like(vit: TrainedViT, *, quiet: bool = False, **arch) -> TrainedViT:
    """A model of ``vit``'s recipe (seed, architecture, optimiser settings, steps) with the
    architecture keys ``arch`` changed (``n_blocks=2``), trained now (:func:`train`; not saved)."""
    info = vit.train_info
    optim = {k: (tuple(info[k]) if k == "betas" else info[k]) for k in DEFAULT_OPTIM if k in info}
    return train(vit.seed, steps=int(info["steps"]), quiet=quiet, arch={**vit.arch, **arch}, optim=optim)


def _assemble(arch, params, init, seed, images, labels, tr, te, info, path, snapshots) -> TrainedViT:
    vit = TrainedViT(
        cfg=_block_config(arch), arch=dict(arch), params=params, init_params_=init, seed=seed, test_accuracy=float("nan"),
        train_images=images[tr], train_labels=labels[tr], test_images=images[te], test_labels=labels[te],
        train_index=tr, test_index=te, train_info=info, checkpoint=path, snapshots=snapshots,
    )
    vit.test_accuracy = vit.accuracy(vit.test_images, vit.test_labels)
    return vit


# ----------------------------------------------------------------------------- checkpoints


def _f64(params: dict) -> dict:
    return {k: v.detach().to(torch.float64).contiguous() for k, v in params.items()}


def save(vit: TrainedViT, path: str | os.PathLike) -> Path:
    """Write ``vit`` to ``path`` as a plain dict (``torch.save``), atomically (temporary file, then rename).

    The dict: ``format``, ``version`` (:data:`FORMAT_VERSION`), ``arch``, ``seed``, ``params``,
    ``init_params`` (float64 tensors under the model's names), ``snapshots`` (``{step: params}``),
    ``train_index``/``test_index`` (the split, int64), ``test_accuracy``, ``train_info``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "arch": dict(vit.arch),
        "seed": vit.seed,
        "params": _f64(vit.params),
        "init_params": _f64(vit.init_params_),
        "snapshots": {int(s): _f64(p) for s, p in vit.snapshots.items()},
        "train_index": vit.train_index,
        "test_index": vit.test_index,
        "n_images": len(vit.train_index) + len(vit.test_index),
        "test_accuracy": float(vit.test_accuracy),
        "train_info": dict(vit.train_info),
    }
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        torch.save(blob, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    vit.checkpoint = str(path)
    return path


def _bad(path, reason: str) -> ValueError:
    return ValueError(f"checkpoint {path} is not a usable digits-ViT checkpoint: {reason} (delete it to retrain)")


def _read_params(path, src, shapes: dict, version: int, what: str) -> dict:
    """The weights of one entry of a checkpoint, checked, float64, under the model's names (a
    format-1 checkpoint's block names ``W_Q`` are the model's ``blocks.0.W_Q``)."""
    if not isinstance(src, dict):
        raise _bad(path, f"{what} is not a dict of weights")
    out = {}
    for name, shape in shapes.items():
        stored = name[len(block_prefix(0)):] if version == 1 and name.startswith(block_prefix(0)) else name
        t = src[stored]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or not t.dtype.is_floating_point:
            raise _bad(path, f"weight {stored} should be a float tensor of shape {shape}")
        if not torch.isfinite(t).all():
            raise _bad(path, f"weight {stored} contains NaN or Inf")
        out[name] = t.to(torch.float64)
    return out


def load(path: str | os.PathLike) -> TrainedViT:
    """Read a checkpoint written by :func:`save` (format 2, or format 1: one block, no snapshots);
    ``ValueError`` (one line) if missing or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint not found: {path}" if not path.exists() else f"checkpoint {path} is not a file")
    try:
        blob = load_saved(path)
    except ValueError as exc:
        raise _bad(path, f"torch.load cannot read it: {exc}") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise _bad(path, f"no '{FORMAT}' format tag")
    version = blob.get("version")
    if version not in (1, FORMAT_VERSION):
        raise _bad(path, f"format version {version!r}, expected {FORMAT_VERSION} (or 1)")
    try:
        arch = {k: blob["arch"].get(k, 1) if k == "n_blocks" else blob["arch"][k] for k in DEFAULT_ARCH}
        if version == 1 and arch["n_blocks"] != 1:
            raise _bad(path, "a format-1 checkpoint holds one block")
        shapes = model_param_shapes(model_config(arch))  # an architecture no config can form is a damaged checkpoint
        seed = int(blob["seed"])
        params = _read_params(path, blob["params"], shapes, version, "params")
        init = _read_params(path, blob["init_params"], shapes, version, "init_params")
        raw = blob.get("snapshots", {}) if version > 1 else {}
        if not isinstance(raw, dict):
            raise _bad(path, "the training snapshots are damaged")
        snapshots = {int(s): _read_params(path, p, shapes, version, f"snapshot {s}") for s, p in raw.items()}
        tr, te = blob["train_index"], blob["test_index"]
        images, labels = load_data()
        if int(blob["n_images"]) != len(labels):
            raise _bad(path, f"made for {blob['n_images']} images, this scikit-learn has {len(labels)}")
        for t in (tr, te):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.ndim != 1 or (len(t) and (t.min() < 0 or t.max() >= len(labels))):
                raise _bad(path, "the data split is damaged")
        if len(tr) + len(te) != len(labels) or len(torch.cat([tr, te]).unique()) != len(labels):
            raise _bad(path, "the data split is damaged")
        info = dict(blob.get("train_info", {}))
    except (KeyError, TypeError, AttributeError) as exc:
        raise _bad(path, f"missing or malformed entry {exc}") from None
    except ValueError as exc:
        if str(exc).startswith("checkpoint "):
            raise
        raise _bad(path, str(exc).splitlines()[0]) from None
    info["trained_in_this_run"] = False
    info["format_version"] = version
    return _assemble(arch, params, init, seed, images, labels, tr, te, info, str(path), snapshots)


def default_checkpoint(seed: int = 0, steps: int = DEFAULT_STEPS) -> Path:
    """Where the commands keep the model of ``seed`` trained for ``steps`` steps when no
    ``--checkpoint`` is given: :data:`DEFAULT_CHECKPOINT` for the defaults, with ``_seed{seed}``
    and ``_steps{steps}`` added for others (a relative path: under the current folder)."""
    tag = (f"_seed{seed}" if seed != 0 else "") + (f"_steps{steps}" if steps != DEFAULT_STEPS else "")
    return Path(DEFAULT_CHECKPOINT.replace(".pt", f"{tag}.pt"))


def load_or_train(checkpoint: str | os.PathLike, *, seed: int = 0, steps: int | None = None,
                  quiet: bool = False) -> TrainedViT:
    """The digits ViT kept in the file ``checkpoint``: read when it exists, else trained and written there.

    Parameters
    ----------
    checkpoint : str or path
        The file (required: nothing is written anywhere the caller did not name). When it
        exists it is read (:func:`load`) and must hold the model of ``seed`` and ``steps``;
        otherwise the model is trained (:func:`train`) and saved
        there (:func:`save`, parent folders created), and a line on stderr says so unless
        ``quiet``. A format-1 file (written before the training snapshots were kept) is trained
        again and replaced, with a line on stderr saying why (the same seed gives the same
        model). ``train_info["trained_in_this_run"]`` records which happened.
    seed : int
        Seed of the split, initialisation and batch order.
    steps : int or None
        Training steps (default :data:`DEFAULT_STEPS`).
    quiet : bool
        No progress bar and no line about training.

    Raises
    ------
    ValueError
        One line: ``checkpoint`` exists but is not a valid checkpoint (a folder, unreadable,
        wrong format, wrong shapes, NaN weights, damaged split), or holds a model of another
        seed or step count (read it with :func:`load` instead, or remove it to train again).
    """
    steps = DEFAULT_STEPS if steps is None else steps
    path = Path(checkpoint)
    if path.exists():
        vit = load(path)
        got = (vit.seed, vit.train_info.get("steps"))
        if got != (seed, steps):  # e.g. written by an earlier version that kept one file for every --steps
            raise ValueError(f"{path} holds a model of seed {got[0]} trained {got[1]} steps, not seed {seed} and "
                             f"{steps} steps: remove it to train again, or read it as it is (--checkpoint, vit.load)")
        if vit.snapshots:
            return vit
        if not quiet:
            print(f"{path} was written by an earlier version (checkpoint format {vit.train_info['format_version']}, "
                  f"no training snapshots): training the digits ViT again (seed {seed}, {steps} steps) and replacing it",
                  file=sys.stderr, flush=True)
    elif not quiet:
        print(f"no checkpoint at {path}: training the digits ViT (seed {seed}, {steps} steps) and saving it there",
              file=sys.stderr, flush=True)
    vit = train(seed, steps=steps, quiet=quiet)
    save(vit, path)
    vit.train_info["trained_in_this_run"] = True
    return vit


def load_for_command(checkpoint=None, *, seed: int = 0, steps: int | None = None, quiet: bool = False) -> TrainedViT:
    """The model of the ``report``, ``bounds`` and ``convergence`` commands.

    A ``checkpoint`` given (``--checkpoint``) must exist and is read as it is (:func:`load`; its
    own seed and steps). ``None``: :func:`load_or_train` on :func:`default_checkpoint` of
    ``seed`` and ``steps`` under the current folder (``checkpoints/digits_vit.pt`` for the
    defaults, as ``make run`` keeps it), so each ``(seed, steps)`` has its own file and a
    run with other steps never reads or overwrites the default model. Raises ``ValueError``
    (one line) as :func:`load` and :func:`load_or_train` do.
    """
    if checkpoint is not None:
        return load(checkpoint)
    steps = DEFAULT_STEPS if steps is None else steps
    return load_or_train(default_checkpoint(seed, steps), seed=seed, steps=steps, quiet=quiet)


def would_train(checkpoint=None, *, seed: int = 0, steps: int | None = None) -> dict | None:
    """What :func:`load_for_command` with these arguments would train, so that a command checks its
    options before it does: ``{"arch": the architecture, "n_train": its training images}`` when no
    checkpoint is there (``checkpoint`` ``None`` and no :func:`default_checkpoint` file), else ``None``
    (a file is read, which is quick, and the options are checked against it then)."""
    if checkpoint is not None:
        return None
    steps = DEFAULT_STEPS if steps is None else steps
    if Path(default_checkpoint(seed, steps)).exists():
        return None
    _, labels = load_data()
    return {"arch": dict(DEFAULT_ARCH), "n_train": len(split_data(labels, seed)[0])}


def check_batch(option: str, n: int, n_train: int) -> None:
    """Raise ``ValueError`` (one line, naming the command-line ``option``) if ``n`` training
    images are more than the ``n_train`` there are (``len(vit.train_labels)``, or
    :func:`would_train`'s before a model is trained)."""
    if n > n_train:
        raise ValueError(f"{option} {n} is larger than the {n_train} training images")
