r"""The loss ℓ(Z) and its first and second derivatives w.r.t. the block output Z.

The loss of a batch is the mean of the per-sequence losses, so its Hessian is the mean of
the per-sequence Hessians. Per sequence ``Z`` of shape ``(L, d)``:

* ``"mse"``: :math:`\ell = \frac{1}{Ld}\|Z - T\|_F^2` (the paper's normalisation, §1.4):
  :math:`\nabla\ell = \frac{2}{Ld}(Z - T)`, :math:`\nabla^2\ell = \frac{2}{Ld} I`;
* ``"ce"``: rows of ``Z`` are logits over ``d`` classes, integer targets ``(L,)``, mean over
  tokens: :math:`\nabla_{z_t}\ell = (p_t - e_{y_t})/L`, :math:`\nabla^2_{z_t}\ell = (\mathrm{diag}\,p_t - p_t p_t^\top)/L`;
  where the caller allows it (``check(..., ignore=True)``), targets of :data:`IGNORE` (``-100``) are
  not counted and the batch loss is the mean over the ``N`` counted tokens of the whole batch, as
  ``torch.nn.functional.cross_entropy(ignore_index=-100)``: each counted token's ``1/L`` above becomes
  ``1/N`` over the batch (``N = B·L`` without ignored tokens: the mean over sequences), an ignored
  token's derivatives are zero (docs/derivations.md §22);
* a callable ``loss(Z, target) -> scalar`` applied to one sequence, twice differentiable
  in ``Z``: gradient and Hessian from ``torch.func`` on the loss alone (cheap; not the
  paper's subject), vmapped over the batch.

MSE and CE have a Hessian that is block-diagonal over tokens (``per_token``); a callable's
is a general ``(L·d, L·d)`` matrix per sequence.
"""

from __future__ import annotations

import math

from typing import NamedTuple

import torch

from .validation import check_fits, check_tensor, saved_bytes

__all__ = ["IGNORE", "LossDerivatives", "counted", "check", "derivatives", "directional", "value", "hessian_work_bytes", "saved_loss_bytes"]


#: the cross-entropy target of a token the loss does not count (Hugging Face's and PyTorch's ``ignore_index``)
IGNORE = -100


def counted(target) -> int:
    """The tokens a cross-entropy ``target`` counts: its entries other than :data:`IGNORE`."""
    return int((target != IGNORE).sum())


class LossDerivatives(NamedTuple):
    """Derivatives of the batch loss (mean over sequences) w.r.t. ``Z`` of shape ``(B, L, d)``.

    ``grad``: ``(B, L, d)``. ``hess``: ``(B·L, d, d)`` when ``per_token`` else ``(B, L·d, L·d)``.
    Both already include the ``1/batch`` of the batch mean (:func:`derivatives`). ``eig``: for a
    general loss, the eigenpairs ``(lam (B, R), W (B, L·d, R))`` of ``hess`` that stand above
    rounding (:func:`blockhess.linalg.eig_lowrank`), kept in its place (``hess`` then ``None``).
    """

    grad: torch.Tensor
    hess: torch.Tensor | None
    per_token: bool
    eig: tuple | None = None

    def sequence(self, b: int) -> "LossDerivatives":
        """The derivatives of sequence ``b``'s own loss (a batch of one): its slices times ``B``
        (for derivatives of a whole batch, ``batch`` = ``B``, with ``hess``)."""
        B, L = self.grad.shape[:2]
        hess = self.hess[b * L : (b + 1) * L] if self.per_token else self.hess[b : b + 1]
        return LossDerivatives(self.grad[b : b + 1] * B, hess * B, self.per_token)


def check(loss, target, Z: torch.Tensor, single: bool = False, ignore: bool = False):
    """Validate ``loss`` and ``target`` against the output ``Z`` of shape ``(B, L, d)``; returns
    ``target`` as the kernels take it (``"ce"``: class indices of any integer dtype as int64).

    ``single``: the caller's input was one sequence and ``Z``, ``target`` carry an added
    batch axis of size 1; messages show the shapes as the caller gave them. A callable is
    called once, on the first sequence, and must return a scalar (0-dim) tensor.

    A callable's target for a batch is split per sequence along its first axis, so an
    array-like one (a list, a NumPy array) is made a tensor; for one sequence (``single``) it
    is passed whole, whatever it is.

    Raises ``ValueError``: unknown loss; mse target not shaped like ``Z`` or not finite or of
    another dtype; ce target not integer (a list or NumPy array of ints is made a tensor), of
    the wrong shape, or a class outside ``[0, d)`` (with ``ignore``: or :data:`IGNORE`, and then at least
    one token counted; the callers that pass it normalise by :func:`counted`);
    a callable's batch target that is not a tensor or array-like with one entry per sequence,
    or a callable returning a non-scalar.
    """
    def shown(shape):
        return tuple(shape)[1:] if single else tuple(shape)

    if isinstance(loss, str) and loss not in ("mse", "ce"):
        raise ValueError(f"loss must be 'mse', 'ce' or a callable loss(Z, target) -> scalar, got {loss!r}")
    if loss == "mse":
        if target is None:
            raise ValueError("target is required for loss='mse' (a tensor shaped like the block output)")
        check_tensor("target", target, like=Z)
        if tuple(target.shape) != tuple(Z.shape):
            raise ValueError(f"target must have the shape of the output {shown(Z.shape)} for loss='mse', "
                             f"got {shown(target.shape)}")
    elif loss == "ce":
        if target is not None and not isinstance(target, torch.Tensor):  # a list or NumPy array of classes
            try:
                target = torch.as_tensor(target, device=Z.device)
            except (TypeError, ValueError, RuntimeError):
                raise ValueError("target must be an integer tensor (or array) of class indices for loss='ce', "
                                 f"got {type(target).__name__}") from None
            target = target[None] if single else target
        if (not isinstance(target, torch.Tensor) or target.dtype.is_floating_point or target.dtype.is_complex
                or target.dtype == torch.bool):
            raise ValueError("target must be an integer tensor of class indices for loss='ce'")
        wrapped = target.dtype == torch.uint64  # its classes >= 2**63 turn negative as int64
        target = target.long()  # any integer dtype (uint16/32/64 have no min/max kernels)
        if tuple(target.shape) != tuple(Z.shape[:-1]):
            raise ValueError(f"target must have shape {shown(Z.shape[:-1])} for loss='ce', got {shown(target.shape)}")
        if target.device != Z.device:
            raise ValueError(f"target is on {target.device} but X is on {Z.device}")
        d = Z.shape[-1]
        kept = target[target != IGNORE] if ignore and not wrapped else target
        if kept.numel() and (kept.min() < 0 or kept.max() >= d):
            got = ("a class of 2**63 or more" if wrapped and target.min() < 0
                   else f"range [{int(kept.min())}, {int(kept.max())}]")
            also = (" or -100 (ignored)" if ignore else
                    "; targets of -100 (ignored) are taken by a model's blockhess.hessian and hessian_operator")
            raise ValueError(f"target classes must lie in [0, {d - 1}] ({d} logits: the output's last axis){also} for "
                             f"loss='ce', got {got}")
        if ignore and target.numel() and not kept.numel():
            raise ValueError("target: every token is -100 (ignored) for loss='ce': the mean over counted tokens has "
                             "no token to count")
        return target
    elif callable(loss):
        if target is not None and not isinstance(target, torch.Tensor) and not single:
            try:  # a batch's target is split per sequence along its first axis: it must be a tensor
                given, target = target, torch.as_tensor(target, device=Z.device)
                if target.is_floating_point():  # numbers in the loss's dtype (a list of floats would come out float32)
                    target = torch.as_tensor(given, dtype=Z.dtype, device=Z.device)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise ValueError(f"target for a callable loss over a batch must be a tensor (or array-like) with a leading "
                                 f"axis of size {Z.shape[0]}, one entry per sequence; got {type(target).__name__} ({exc})") from None
        if isinstance(target, torch.Tensor) and (target.ndim == 0 or target.shape[0] != Z.shape[0]):
            raise ValueError(
                f"target must have a leading axis of size {Z.shape[0]} (one entry per sequence) for a callable loss, "
                f"got shape {tuple(target.shape)}"
            )
        v = loss(Z[0], target[0] if isinstance(target, torch.Tensor) else target)
        if not isinstance(v, torch.Tensor) or v.ndim != 0:
            got = f"shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"loss must return a scalar (0-dim) tensor for one sequence Z of shape {tuple(Z.shape[1:])}, got {got}")
    else:
        raise ValueError(f"loss must be 'mse', 'ce' or a callable loss(Z, target) -> scalar, got {loss!r}")
    return target


def _in_dims(target) -> tuple[int, int | None]:
    """vmap axes for ``(Z, target)``: a tensor target has one entry per sequence (axis 0)."""
    return (0, 0 if isinstance(target, torch.Tensor) else None)


WORK_BYTES = 64 << 20  # torch.func's work space for a callable's per-sequence Hessians: this much, or as much as the Hessians
TANGENT_COPIES = 6  # of the loss's saved intermediates, per tangent (docs/derivations.md §1)
SQUARE_COPIES = 3  # (L·d)² entries per sequence beside its Hessian: the tangent basis, the gradients' tangents, a copy


def hessian_work_bytes(loss, target, Z: torch.Tensor) -> int:
    r"""Bytes ``torch.func``'s gradient and Hessian of the callable ``loss`` hold at once for one
    sequence (``Z`` of shape ``(B, L, d)``, ``target`` as for :func:`derivatives`), its Hessian
    not included. The Hessian is forward mode over reverse mode: each of the ``m = L·d``
    tangents carries the intermediates of the loss's forward and backward pass. Those cannot be
    seen from outside (a classifier head's logits, an MLP's hidden layer), so the loss is called
    once on ``Z[0]`` with gradients recorded and what autograd saves is counted
    (:func:`~blockhess.validation.saved_bytes`, ``F`` bytes): ``m·(TANGENT_COPIES·F + SQUARE_COPIES·m·e)``,
    ``e`` the bytes per entry (docs/derivations.md §1, *A callable loss's per-sequence Hessians*).
    The arguments are not checked here."""
    B, L, d = Z.shape
    m = L * d
    return m * (TANGENT_COPIES * saved_loss_bytes(loss, target, Z) + SQUARE_COPIES * m * Z.element_size())


def saved_loss_bytes(loss, target, Z: torch.Tensor) -> int:
    """What autograd saves for the backward pass of the callable ``loss`` on the first sequence
    ``Z[0]`` (``target`` as for :func:`derivatives`): the intermediates that depend on ``Z``
    (:func:`~blockhess.validation.saved_bytes`; a classifier head's logits, not its weights)."""
    z = Z[0].detach().clone().requires_grad_()
    return saved_bytes(loss, z, target[0] if isinstance(target, torch.Tensor) else target)[1]


def _ce_terms(target, Z: torch.Tensor, batch: int | None, tokens: int | None):
    """``(p, y, n)`` of the cross-entropy: the probabilities with an ignored token's row zeroed (so that
    ``diag(p) - p pᵀ`` and ``p - y`` vanish there: the weight is 0 or 1), the one-hot targets likewise, and
    the normaliser: ``tokens`` (the counted tokens of the whole batch; default ``L·batch`` without ignored
    targets, :func:`counted` of ``target`` when it is the whole batch)."""
    B, L, d = Z.shape
    p = torch.softmax(Z, -1)
    keep = target != IGNORE
    every = bool(keep.all())
    if tokens is None:
        if batch is not None and batch != B and not every:
            raise RuntimeError("losses: the counted tokens of the whole batch (tokens=) are needed for a part of it "
                               "with ignored targets")
        tokens = L * (B if batch is None else batch) if every else int(keep.sum())
    if every:
        return p, torch.nn.functional.one_hot(target, d).to(Z.dtype), tokens
    w = keep.to(Z.dtype)[..., None]
    return p * w, torch.nn.functional.one_hot(target.clamp(min=0), d).to(Z.dtype) * w, tokens


def derivatives(loss, target, Z: torch.Tensor, batch: int | None = None, first: int = 0,
                tokens: int | None = None) -> LossDerivatives:
    """Gradient and Hessian of the mean-over-sequences loss w.r.t. ``Z`` of shape ``(B, L, d)``.

    ``target`` as for :func:`check`, with a leading batch axis matching ``Z``'s (for a
    callable: a tensor with one entry per sequence along axis 0, or ``None``). ``Z`` may be
    the rows ``first, first + 1, …`` of a batch of ``batch`` sequences (default ``B``, the
    whole batch): the mean is over ``batch``, and errors name the sequence in it. A callable's
    per-sequence derivatives are taken by ``torch.func`` (``vmap`` of ``grad_and_value`` and
    ``hessian``) on as many sequences at a time as keep its work space
    (:func:`hessian_work_bytes`) within ``WORK_BYTES`` or the size of the ``B`` Hessians, whichever is
    more (at least one). Raises ``ValueError`` when a callable's value, gradient or Hessian has a
    NaN or Inf (naming the sequence; its derivatives can be finite where its value is not), or
    when ``torch.func`` cannot differentiate it (a ``RuntimeError`` of ``vmap``, e.g. for
    ``.item()``; running out of memory is not re-labelled); ``InsufficientMemoryError`` before a
    callable's ``B`` per-sequence ``(L·d)²`` Hessians and the work space of one group of
    sequences, if they would not fit. The other arguments are not checked here (:func:`check`).
    ``tokens``: CE's counted tokens of the whole batch (:func:`counted`; needed for a part of a batch
    with ignored targets).
    """
    B, L, d = Z.shape
    mean_over = B if batch is None else batch
    if loss == "mse":
        c = 2.0 / (L * d * mean_over)
        eye = torch.eye(d, dtype=Z.dtype, device=Z.device)
        return LossDerivatives(c * (Z - target), (c * eye).expand(B * L, d, d), True)
    if loss == "ce":
        p, onehot, n = _ce_terms(target, Z, batch, tokens)
        p_t = p.reshape(B * L, d)
        hess = (torch.diag_embed(p_t) - p_t[:, :, None] * p_t[:, None, :]) / n
        return LossDerivatives((p - onehot) / n, hess, True)
    in_dims = _in_dims(target)
    m = L * d
    out_bytes = B * m * m * Z.element_size()
    per = hessian_work_bytes(loss, target, Z)
    size = min(B, max(1, max(WORK_BYTES, out_bytes) // max(per, 1)))
    check_fits(out_bytes + size * per, f"the {B} per-sequence ({m}x{m}) Hessians of the loss and torch.func's work space "
               f"for {size} of them at a time (estimated from the loss's own intermediates)", Z.device)
    grad = val = hess = None
    try:
        for s in range(0, B, size):
            rows = slice(s, min(s + size, B))
            t = target[rows] if isinstance(target, torch.Tensor) else target
            z = Z[rows].clone()  # not a view into the batch: torch.func's tangents of a view span its whole storage
            g, v = torch.func.vmap(torch.func.grad_and_value(loss), in_dims=in_dims)(z, t)
            h = torch.func.vmap(torch.func.hessian(loss), in_dims=in_dims)(z, t)
            if hess is None:  # one buffer each, filled group by group
                grad, val, hess = g.new_empty(B, *g.shape[1:]), v.new_empty(B), h.new_empty(B, *h.shape[1:])
            # detached: a loss that closes over tensors requiring grad (a model's downstream layers) gives results with history
            grad[rows], val[rows], hess[rows] = g.detach(), v.detach(), h.detach()
    except RuntimeError as exc:  # e.g. .item() or a Python branch on a value inside the loss
        if isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc):  # the CPU allocator's
            raise  # out of memory is not the loss's fault
        hint = ("call inside torch.nn.attention.sdpa_kernel(SDPBackend.MATH): the fused attention kernels "
                "have no forward-mode derivative, which torch.func.hessian needs" if "scaled_dot_product" in str(exc) else
                "write it in torch ops that vmap can batch (no .item(), no Python branches on values, no in-place "
                "changes of Z)")
        raise ValueError("loss could not be differentiated by torch.func (vmap of grad and hessian): "
                         f"{str(exc).splitlines()[0][:200]}; {hint}") from exc
    if not (math.isfinite(grad.sum()) and math.isfinite(hess.sum()) and math.isfinite(val.sum())):
        # only then search (a sum can overflow)
        ok = torch.isfinite(grad).flatten(1).all(1) & torch.isfinite(hess).flatten(1).all(1) & torch.isfinite(val)
        if not bool(ok.all()):
            b = int((~ok).nonzero()[0])
            raise ValueError(f"loss has a NaN or Inf value, gradient or Hessian w.r.t. Z at sequence {first + b}")
    return LossDerivatives(grad.div_(mean_over), hess.reshape(B, L * d, L * d).div_(mean_over), False)  # our buffers


def directional(loss, target, Z: torch.Tensor, batch: int | None = None, tokens: int | None = None):
    r"""``(grad, omega)``: the gradient of the mean-over-sequences loss w.r.t. ``Z`` ``(B, L, d)`` (as
    :func:`derivatives`) and ``omega(dZ)``, its Hessian applied to tangents ``dZ`` ``(k, B, L, d)``,
    without forming a per-token ``d × d`` matrix for MSE (a scaling) and CE
    (:math:`(p \odot \dot z - p\,(p\cdot\dot z))/(L\,B)` per token); a callable's from its
    per-sequence Hessians (:func:`derivatives`, with its memory check). Arguments as :func:`derivatives`."""
    B, L, d = Z.shape
    mean_over = B if batch is None else batch
    if loss == "mse":
        c = 2.0 / (L * d * mean_over)
        return c * (Z - target), lambda dZ: c * dZ
    if loss == "ce":
        p, onehot, n = _ce_terms(target, Z, batch, tokens)
        return (p - onehot) / n, lambda dZ: (p * dZ - p * (p * dZ).sum(-1, keepdim=True)) / n
    ld = derivatives(loss, target, Z, batch, 0)
    H = ld.hess  # (B, L·d, L·d)
    return ld.grad, lambda dZ: torch.einsum("bij,kbj->kbi", H, dZ.reshape(dZ.shape[0], B, L * d)).reshape(dZ.shape)


def value(loss, target, Z: torch.Tensor) -> torch.Tensor:
    """The batch loss, a 0-dim tensor of ``Z``'s dtype: the mean over sequences of the
    per-sequence loss; ``Z`` is ``(B, L, d)``, ``target`` as :func:`check` returns it (the
    arguments are not checked here). MSE: mean over entries; CE: mean over tokens, those of
    target :data:`IGNORE` not counted (paper §1.3; docs/derivations.md §8, §22)."""
    B, L, d = Z.shape
    if loss == "mse":
        return ((Z - target) ** 2).mean()
    if loss == "ce":
        return torch.nn.functional.cross_entropy(Z.reshape(-1, d), target.reshape(-1), ignore_index=IGNORE)
    in_dims = _in_dims(target)
    return torch.func.vmap(loss, in_dims=in_dims)(Z, target).mean()
