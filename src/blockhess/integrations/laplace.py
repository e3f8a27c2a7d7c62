r"""Exact curvature for laplace-torch: :class:`BlockhessGGN` (the Gauss–Newton matrix) and
:class:`BlockhessHessian` (the Hessian), backends of ``laplace.Laplace(..., backend=...)``.

Install: ``pip install --no-deps -r requirements-laplace.txt`` (docs/guide/laplace.md: laplace-torch
and backpack-for-pytorch declare torchvision, which none of them imports here). This module is
imported only by its user; nothing in blockhess imports it.

*The model laplace-torch is handed* is a module whose ``forward`` takes a batch (a tensor, or a dict
as Hugging Face's datasets give) and returns the logits ``(B, C)``, wrapping a model
:func:`blockhess.from_torch` reads (``ViTForImageClassification``, ``GPT2ForSequenceClassification``;
:func:`find_model`). Each call reads that model's weights as they are, feeds it the batch's input
(the tensor, or ``batch[dict_key_x]``) and checks that the wrapper's output equals our forward pass
(:func:`check_output`), so the curvature is that of the function laplace-torch sees, or the call
raises ``ValueError``.

*laplace-torch's conventions* (``laplace/curvature/curvature.py``): the loss is summed over the data
(``CrossEntropyLoss(reduction="sum")``, ``MSELoss(reduction="sum")``) and a backend returns
``(factor · loss, factor · H)``, ``factor = 1`` for classification and ``½`` for regression
(:math:`-\log \mathcal N(y; f, I) = \tfrac12\|f - y\|^2 + \text{const}`). blockhess's losses are means
(``"ce"`` over the ``B`` sequences, ``"mse"`` over the ``B·C`` entries), so

.. math::
    H_\text{laplace} = B\, H_\text{ce}, \qquad H_\text{laplace} = \tfrac12\, B C\, H_\text{mse}

(docs/derivations.md, "laplace-torch's factors"). The parameters are laplace-torch's: those of the
model (or, for ``subset_of_weights="last_layer"``, of its last layer) that require grad, in
``parameters()`` order, each flattened row-major as ``parameters_to_vector`` does; a SubnetLaplace's
``subnetwork_indices`` index that vector.

Structures: ``full`` (exact, dense), ``eig_lowrank`` (LowRankLaplace: converged top eigenpairs by
:func:`blockhess.operators.lanczos_eigs`, residuals in :attr:`ExactCurvature.eig_result`); ``diag``
and ``kron`` raise ``NotImplementedError`` saying which structure to use; ``jacobians`` and
``gradients`` (the GLM predictive) are laplace-torch's own, by ``torch.func`` through the wrapper.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

try:
    from laplace.curvature.curvature import CurvatureInterface, GGNInterface
except ImportError as e:  # an optional integration: the library runs without laplace-torch
    raise ImportError("blockhess.integrations.laplace needs laplace-torch: pip install --no-deps -r "
                      "requirements-laplace.txt (docs/guide/laplace.md says why --no-deps)") from e

from ..adapters import from_torch, hf
from ..config import ModelConfig
from ..model import forward
from ..model.walk import hessian as model_hessian
from ..operators import hessian_operator, lanczos_eigs, mean_operator

__all__ = ["ExactCurvature", "BlockhessGGN", "BlockhessHessian", "find_model", "check_output", "OUTPUT_TOL"]

#: Largest relative difference (max-abs, against the largest logit) allowed between the wrapper's
#: output and blockhess's forward pass of the model read, by dtype.
OUTPUT_TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def find_model(wrapper: nn.Module) -> tuple[str, nn.Module]:
    """``(name, module)`` of the one model inside ``wrapper`` that :func:`blockhess.from_torch` reads:
    the outermost submodule (``wrapper`` itself included, name ``""``) of a Hugging Face class it reads
    that is a model, not a block (:data:`blockhess.adapters.hf.BLOCKS`).

    Raises ``ValueError`` naming what was found when there is none, or more than one outside each other."""
    found = []
    for name, m in wrapper.named_modules():
        if any(name == f or name.startswith(f + ".") or f == "" for f, _ in found):
            continue
        if hf.reads(m) and type(m).__name__ not in hf.BLOCKS:
            found.append((name, m))
    if not found:
        raise ValueError(f"the model laplace-torch is handed ({type(wrapper).__name__}) holds no model from_torch reads "
                         f"as a whole ({hf.SUPPORTED}, blocks aside): wrap one, e.g. a module whose forward returns "
                         "model(**batch).logits")
    if len(found) > 1:
        raise ValueError(f"the model laplace-torch is handed ({type(wrapper).__name__}) holds several models from_torch "
                         f"reads: {[(n, type(m).__name__) for n, m in found]}; the curvature is that of one")
    return found[0]


def check_output(f, ours: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` unless the wrapper's output ``f`` is a tensor of ``ours``' shape ``(B, C)``
    within :data:`OUTPUT_TOL` of it (max-abs, relative to ``ours``' largest entry); ``what`` names the model."""
    if not isinstance(f, torch.Tensor):
        raise ValueError(f"the model laplace-torch is handed must return the logits as a tensor (e.g. "
                         f"model(**batch).logits), got {type(f).__name__}")
    if tuple(f.shape) != tuple(ours.shape) or f.dtype != ours.dtype:
        raise ValueError(f"the model laplace-torch is handed returns {f.dtype} {tuple(f.shape)}, but {what}'s logits "
                         f"on the batch are {ours.dtype} {tuple(ours.shape)}: it must return them as they are")
    tol = OUTPUT_TOL[ours.dtype]
    err, scale = float((f - ours).abs().max()), float(ours.abs().max())
    if not err <= tol * scale:
        raise ValueError(f"the model laplace-torch is handed returns logits {err:.3g} away from {what}'s on the batch "
                         f"(largest {scale:.3g}; allowed {tol:g} relative): its forward must return the logits of "
                         f"{what} on the batch's input, unchanged (no padding, no extra layers)")


class ExactCurvature(CurvatureInterface):
    """The exact curvature backend (:class:`BlockhessGGN`, :class:`BlockhessHessian` set ``part``).

    ``model``, ``likelihood``, ``last_layer``, ``subnetwork_indices``, ``dict_key_x``, ``dict_key_y`` as
    laplace-torch's ``CurvatureInterface``; ``low_rank`` (default 10): the eigenpairs ``eig_lowrank`` asks
    for; ``tol`` (default 1e-8): their relative residual bound (:func:`~blockhess.operators.lanczos_eigs`).

    Raises ``ValueError`` (on each call, before any curvature) for a model :func:`find_model` or
    :func:`check_output` refuses, a parameter that requires grad outside the model read (named), a
    per-token model (one output row per example is what laplace-torch's likelihoods take); the errors of
    :func:`blockhess.hessian` for the batch (a sequence of padding ids only). A dict batch's
    ``attention_mask`` goes with its input to the model read (a padded batch, docs/models.md)."""

    part = "full"

    def __init__(self, model: nn.Module, likelihood, last_layer: bool = False, subnetwork_indices=None,
                 dict_key_x: str = "input_ids", dict_key_y: str = "labels", low_rank: int = 10, tol: float = 1e-8):
        super().__init__(model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y)
        if not (isinstance(low_rank, int) and low_rank >= 1):
            raise ValueError(f"low_rank must be a positive int, got {low_rank!r}")
        self.low_rank, self.tol = low_rank, float(tol)
        self.eig_result = None  # eig_lowrank's EigResult (eigenvalues of the per-example mean; residuals)

    # ------------------------------------------------------------------ reading the model

    def _names(self, inner: nn.Module) -> list[str]:
        """The inner model's names of laplace-torch's parameters (``self.params``, in order)."""
        ours = {id(p): n for n, p in inner.named_parameters()}
        outside = [n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in ours
                   and any(p is q for q in self.params)]
        if outside:
            raise ValueError(f"parameters {outside} require grad but are not parameters of the model read: freeze them "
                             "(requires_grad_(False)) or leave them out of the wrapper")
        return [ours[id(p)] for p in self.params]

    def _read(self, x) -> tuple:
        """``(inner, cfg, params, inputs, f)`` for the batch input ``x``: the model read, its config and
        weights now, its input, and the wrapper's output (checked against ours)."""
        name, inner = find_model(self.model)
        what = f"{type(inner).__name__} {name!r}" if name else type(inner).__name__
        if isinstance(x, Mapping):
            if self.dict_key_x not in x:
                raise ValueError(f"the batch has no key dict_key_x={self.dict_key_x!r} (the model's input); its keys: "
                                 f"{list(x)}")
            inputs = x[self.dict_key_x]
            if x.get("attention_mask") is not None:  # a padded batch: the model's keyword arguments (model_input)
                inputs = {self.dict_key_x: inputs, "attention_mask": x["attention_mask"]}
        else:
            inputs = x
        cfg, params = from_torch(inner)
        if not isinstance(cfg, ModelConfig) or cfg.pool == "none":
            raise ValueError(f"{what} gives per-token outputs; laplace-torch's likelihoods take one output row per "
                             "example (a classifier such as ViTForImageClassification or GPT2ForSequenceClassification)")
        ours = forward(params, inputs, cfg)
        with torch.no_grad():
            f = self.model(x)
        check_output(f, ours, what)
        return inner, cfg, params, inputs, f.detach()

    def _loss(self, cfg: ModelConfig, y: torch.Tensor, B: int) -> tuple[str, float]:
        """``(loss, scale)``: our loss and the factor from its mean to laplace-torch's ``factor ·`` sum."""
        if self.likelihood == "regression":
            return "mse", 0.5 * B * cfg.n_out
        return "ce", float(B)

    def _check_structure(self) -> None:
        if getattr(self, "stochastic", False):
            raise NotImplementedError("stochastic=True (the Monte Carlo Fisher) is not offered: this backend's "
                                      "curvature is exact; use stochastic=False")

    # ------------------------------------------------------------------ structures

    def full(self, x, y: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(factor · loss, factor · H)`` on the batch: ``H`` ``(P, P)`` the exact GGN or Hessian of the
        summed loss over laplace-torch's parameters (``P`` of them, or ``len(subnetwork_indices)``), dtype
        of the model. Errors: the class docstring's, ``InsufficientMemoryError`` before a result that
        would not fit (:func:`blockhess.hessian`). One part's passes only: the GGN alone for
        :class:`BlockhessGGN` (:func:`blockhess.model.walk.hessian`, ``part="outer"``), not the Hessian first."""
        self._check_structure()
        inner, cfg, params, inputs, f = self._read(x)
        names = self._names(inner)
        numel = [p.numel() for p in self.params]
        offs = torch.tensor([0] + numel).cumsum(0)
        idx = self.subnetwork_indices
        if idx is not None:  # only the tensors the subnetwork touches
            idx = torch.as_tensor(idx, dtype=torch.long).cpu()
            keep = [i for i in range(len(numel)) if bool(((idx >= offs[i]) & (idx < offs[i + 1])).any())]
        else:
            keep = list(range(len(numel)))
        _, spec = hf.describe(inner)
        wrt = list(dict.fromkeys(n for i in keep for n in spec[names[i]].names))
        loss, scale = self._loss(cfg, y, len(y))
        dtype, device = f.dtype, f.device
        sizes = [numel[i] for i in keep]
        start = torch.tensor([0] + sizes).cumsum(0).tolist()
        H = torch.zeros(start[-1], start[-1], dtype=dtype, device=device)
        if wrt:  # else every kept tensor is one the model read does not use: its blocks are zero
            Hm = model_hessian(params, inputs, cfg, loss=loss, target=y, wrt=wrt, part=self.part).to_module(inner)
            for a, i in enumerate(keep):
                for b, j in enumerate(keep):
                    if names[i] in Hm.names and names[j] in Hm.names:
                        H[start[a]:start[a + 1], start[b]:start[b + 1]] = Hm[names[i], names[j]]
        H.mul_(scale)
        if idx is not None:  # the subnetwork's entries, in its order
            local = torch.full((int(offs[-1]),), -1, dtype=torch.long)
            for a, i in enumerate(keep):
                local[int(offs[i]):int(offs[i + 1])] = torch.arange(start[a], start[a + 1])
            sel = local[idx].to(device)
            H = H[sel][:, sel]
        return self.factor * self.lossfunc(f, y).detach(), H

    def diag(self, x, y: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(factor · loss, diag)``: the exact diagonal ``(P,)`` of :meth:`full`'s matrix, taken from it. A whole
        model has no closed-form diagonal without its dense block (attention above a weight mixes the tokens,
        docs/derivations.md §19), so the dense matrix over laplace-torch's parameters is formed first: ``P²``
        entries, checked before the allocation (``InsufficientMemoryError`` naming the bytes needed and
        available); the last layer's or a subnetwork's is small. Errors: :meth:`full`'s."""
        loss, H = self.full(x, y, **kwargs)
        return loss, torch.diagonal(H).clone()

    def kron(self, x, y: torch.Tensor, N: int, **kwargs):
        """Refused (``NotImplementedError``): the exact curvature is not a Kronecker product."""
        raise NotImplementedError("hessian_structure='kron': the exact GGN and Hessian are not Kronecker-factored "
                                  "(K-FAC approximates them); use hessian_structure='full' (exact, dense) or "
                                  "'lowrank' (exact top eigenpairs)")

    def eig_lowrank(self, data_loader) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(U, λ, factor · loss)`` for LowRankLaplace over the whole ``data_loader`` (``(x, y)`` batches or
        dicts): the top ``low_rank`` eigenpairs of ``factor ·`` the summed-loss GGN or Hessian over
        laplace-torch's parameters, ``U`` ``(P, r)`` orthonormal, ``λ`` ``(r,)`` descending. Each pair has
        its true residual within ``tol · λ`` and the check found no larger eigenvalue
        (:func:`~blockhess.operators.lanczos_eigs`; the result, residuals included, is kept as
        :attr:`eig_result`); pairs whose eigenvalue is not above its residual bound (zero to the
        tolerance, or negative: a Hessian's, which a precision cannot take) are left out, ``r <= low_rank``.
        Raises :class:`~blockhess.operators.NotConvergedError` if they do not converge, ``ValueError``
        for a subnetwork (SubnetLaplace uses ``full``) and the class docstring's errors."""
        self._check_structure()
        if self.subnetwork_indices is not None:
            raise ValueError("eig_lowrank covers every parameter that requires grad; subnetwork_indices are for "
                             "SubnetLaplace's hessian_structure='full'")
        parts, counts, loss, inner, cfg, scale = [], [], 0.0, None, None, 0.0
        for batch in data_loader:
            x, y = (batch, batch[self.dict_key_y]) if isinstance(batch, Mapping) else batch
            inner, cfg, params, inputs, f = self._read(x)
            name, s = self._loss(cfg, y, len(y))
            parts.append(hessian_operator(params, inputs, cfg, loss=name, target=y, part=self.part))
            counts.append(len(y))
            scale += s
            loss = loss + self.factor * self.lossfunc(f, y).detach()
        if not parts:
            raise ValueError("data_loader gave no batch")
        A = parts[0] if len(parts) == 1 else mean_operator(parts, counts)
        names = self._names(inner)
        M = A.to_module(inner)[names, names]
        res = lanczos_eigs(M, min(self.low_rank, M.shape[0]), which="LA", tol=self.tol)
        self.eig_result = res
        order = {n: i for i, n in enumerate(M.names)}  # the view's rows, in laplace-torch's order
        sizes = [p.numel() for p in self.params]
        starts = torch.tensor([0] + [M.sizes[order[n]] for n in M.names]).cumsum(0).tolist()
        rows = torch.cat([torch.arange(starts[order[n]], starts[order[n]] + s) for n, s in zip(names, sizes)])
        keep = res.eigenvalues > res.bounds
        U = res.eigenvectors[rows.to(res.eigenvectors.device)][:, keep]
        return U, res.eigenvalues[keep] * scale, loss


class BlockhessGGN(ExactCurvature, GGNInterface):
    """laplace-torch's ``GGNInterface`` with the exact Gauss–Newton matrix (blockhess's ``outer`` part:
    :math:`\\sum_i J_i^\\top \\nabla^2_f \\ell_i J_i`). ``stochastic=True`` raises ``NotImplementedError``
    on use. The rest as :class:`ExactCurvature`."""

    part = "outer"

    def __init__(self, model: nn.Module, likelihood, last_layer: bool = False, subnetwork_indices=None,
                 dict_key_x: str = "input_ids", dict_key_y: str = "labels", stochastic: bool = False,
                 low_rank: int = 10, tol: float = 1e-8):
        super().__init__(model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y, low_rank=low_rank,
                         tol=tol)
        self.stochastic = stochastic


class BlockhessHessian(ExactCurvature):
    """laplace-torch's ``CurvatureInterface`` with the exact Hessian (blockhess's ``full``: Gauss–Newton
    plus functional term). As :class:`ExactCurvature`."""

    part = "full"
