r"""Dataset-level curvature on ``torch.distributed``: each rank holds a shard of the data, and every
rank gets the result over all of it (docs/distributed.md).

>>> import blockhess.distributed as bhd
>>> rows = bhd.shard(len(X))                   # this rank's contiguous share  # doctest: +SKIP
>>> H = bhd.hessian(params, X[rows], cfg, loss="ce", target=y[rows])   # on every rank  # doctest: +SKIP

A dataset split over the ``W`` ranks of a process group, shard ``r`` holding ``B_r`` sequences, has
the mean loss over all ``N = Σ_r B_r`` sequences (the convention of a batch,
:func:`blockhess.hessian`), so its Hessian is the count-weighted mean of the shards' Hessians

.. math::
    H = \sum_r \frac{B_r}{N}\, H_r,\qquad H_r = \texttt{blockhess.hessian}(\text{params}, X_r, \dots)
    \ \text{(the mean over shard } r\text{)},

each rank scaling its own ``n × n`` buffer by ``B_r / N`` and one ``all_reduce`` (sum) of it in
place; the per-sample functions gather each rank's rows to every rank, in the global order: rank 0's
shard first, then rank 1's, and so on (:func:`shard` cuts a dataset that way). Derived here from the
definition of the batch loss.

Every function here is **collective**: every rank of the group (the default group, or ``group=``)
calls it, with its own shard and the same everything else, and each call goes through four steps:

1. *agree on the inputs, before any work*: each rank checks its shard as the single-process
   function first does (shapes, dtypes, devices, finite values, ``wrt``) and describes what must be
   the same everywhere (a fingerprint: the config, the loss, the ``wrt`` names, the dtype and device
   type, the shape of one sequence and of its target, every parameter's name, shape, dtype and a
   SHA-256 of its values, the function and its options); one ``all_gather_object``
   of these and the shard sizes;
2. the single-process function on the shard (:func:`blockhess.hessian`,
   :mod:`blockhess.convergence`);
3. *agree on the outcome*: one ``all_gather_object`` of each rank's ok or error;
4. the collective of the result (``all_reduce`` of the Hessian, ``all_gather`` of the rows).

So bad input on one rank makes every rank raise :class:`DistributedInputError` (a ``ValueError``)
naming that rank and its message, before the heavy collective and on disagreement before any work;
a rank that exits or stops answering makes every other rank raise :class:`CollectiveError` as soon as
its collective fails: at once where the connection closes (a process that exits, under gloo), else
when the process group's timeout expires (``init_process_group(timeout=...)``; torch's default is 10
minutes for NCCL, 30 for gloo). The timeout also bounds how long a rank may wait for the slowest
one at each step, so it must exceed the spread of the ranks' local work (with equal shards, a
fraction of one shard's time). Nothing is returned after an error (an ``out=`` buffer then holds no
result), and after a :class:`CollectiveError` the group is unusable: destroy it.

A shard may be empty (``X`` of shape ``(0, L, d_model)``, or the model's inputs with 0 sequences): that
rank contributes nothing and counts 0 (its input is checked as one sequence of zeros of its shape);
all shards empty is refused.

Backends: gloo (CPU tensors) and NCCL (CUDA tensors, each rank on its own device:
``torch.cuda.set_device(local_rank)`` before ``init_process_group``); the result's device must be one
the group's backend takes. Results agree with the single process on the concatenated shards to
rounding (the sum over the ranks adds in another order), and are the same on every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from . import convergence as cv
from . import losses
from .block import check_inputs, select_wrt
from .config import BlockConfig, ModelConfig, model_param_shapes, param_shapes
from .hessian import hessian as single_hessian
from .operators import HessianOperator, head_views
from .operators import hessian_operator as single_operator
from .model.forward_pass import check_model_inputs, model_input
from .result import BlockSum, HessianBlocks
from .validation import check_fits, check_int, check_result

__all__ = [
    "hessian_operator",
    "DistributedError",
    "DistributedInputError",
    "CollectiveError",
    "hessian",
    "per_sample_losses",
    "per_sample_gradients",
    "per_sample_hessians",
    "per_sample_statistics",
    "shard",
    "on_every_rank",
    "gather_objects",
]


# ----------------------------------------------------------------------------- errors


class DistributedError(RuntimeError):
    """A collective call of :mod:`blockhess.distributed` failed on some rank; raised on every rank.

    ``failures``: ``{rank: exception}``, what each rank whose own work raised raised (a copy, sent
    pickled; one that cannot be pickled as a ``ValueError`` or ``RuntimeError`` with its type and
    message); empty where the ranks disagreed or a collective failed."""

    def __init__(self, message: str, failures: dict | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})


class DistributedInputError(DistributedError, ValueError):
    """Bad input on some rank (its ``ValueError``, named with the rank and its message), or ranks that
    disagree on what must be the same everywhere (named with the field and the ranks' values);
    raised on every rank before the collective of the result."""


class CollectiveError(DistributedError):
    """A collective did not complete: a rank exited, or did not arrive within the process group's
    timeout. The group is unusable afterwards (``torch.distributed.destroy_process_group``)."""


# ----------------------------------------------------------------------------- the group


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _Group:
    """This rank's view of the process group: rank, size, backend, and the collectives, each
    raising :class:`CollectiveError` when it fails."""

    def __init__(self, group=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("blockhess.distributed needs an initialised process group: call "
                             "torch.distributed.init_process_group first (torchrun sets its environment)")
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of group: call with a group it belongs to")
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))

    def _call(self, what: str, fn: Callable):
        try:
            return fn()
        except RuntimeError as exc:  # DistBackendError, DistNetworkError, gloo's and NCCL's errors
            raise CollectiveError(f"{what} failed on rank {self.rank} of {self.size}: a rank exited or did not arrive "
                                  f"within the process group's timeout ({_first_line(exc)})") from exc

    def gather_objects(self, obj, what: str) -> list:
        out = [None] * self.size
        self._call(what, lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def takes(self, device: torch.device) -> bool:
        """Whether the backend's collectives take tensors on ``device`` (NCCL: CUDA only)."""
        return not ("nccl" in self.backend and "gloo" not in self.backend and device.type != "cuda")

    def gather_device(self) -> torch.device:
        """Where the gathers run: this rank's CUDA device under NCCL alone, else the CPU (gloo)."""
        if "nccl" in self.backend and "gloo" not in self.backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_reduce(self, t: torch.Tensor, what: str) -> None:
        """Sum ``t`` over the ranks in place (nothing for one rank)."""
        if self.size > 1:
            self._call(what, lambda: dist.all_reduce(t, group=self.group))

    def gather_rows(self, rows: torch.Tensor, counts: list[int], what: str) -> torch.Tensor:
        """Every rank's ``rows`` ``(counts[r], ...)`` stacked in rank order, on ``rows``' device: one
        ``all_gather`` of the shards padded to the largest (gloo gathers CPU tensors, NCCL CUDA ones)."""
        if self.size == 1:
            return rows
        comm = self.gather_device()
        tail = tuple(rows.shape[1:])
        padded = rows.new_zeros((max(counts),) + tail, device=comm)
        padded[: rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._call(what, lambda: dist.all_gather(parts, padded, group=self.group))
        return torch.cat([p[:c] for p, c in zip(parts, counts)]).to(rows.device)

    def agree(self, what: str, fn: Callable, fingerprint: Callable | None = None, count: Callable | None = None):
        """Run ``fn()`` on this rank, then agree with every rank (one ``all_gather_object``): return
        ``(value, counts)`` where every rank's ``fn`` returned and their ``fingerprint(value)`` dicts
        agree field by field (``counts``: ``count(value)`` of each rank); else raise, on every rank,
        :class:`DistributedInputError` (every failing rank raised a ``ValueError``, or the ranks
        disagree) or :class:`DistributedError`, naming the ranks and their messages or values."""
        err = mine = value = None
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 — every rank must hear of it, whatever it is
            err, mine = _sendable(exc), exc
        status = {"error": err,
                  "fingerprint": fingerprint(value) if err is None and fingerprint is not None else None,
                  "count": count(value) if err is None and count is not None else 0}
        statuses = self.gather_objects(status, what)
        failures = {r: s["error"] for r, s in enumerate(statuses) if s["error"] is not None}
        if failures:
            lines = "; ".join(f"rank {r} raised {type(e).__name__}: {e}" for r, e in failures.items())
            kind = DistributedInputError if all(isinstance(e, ValueError) for e in failures.values()) else DistributedError
            raise kind(f"{what}: {lines}", failures) from mine
        if fingerprint is not None:
            _compare(what, [s["fingerprint"] for s in statuses], [s["count"] for s in statuses])
        return value, [s["count"] for s in statuses]


def _sendable(exc: Exception) -> Exception:
    """``exc`` if it survives pickling, else a ``ValueError`` (for a ``ValueError``) or ``RuntimeError``
    saying its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 — any failure to pickle or rebuild it
        return (ValueError if isinstance(exc, ValueError) else RuntimeError)(f"{type(exc).__name__}: {exc}")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


def _compare(what: str, fps: list[dict], counts: list[int]) -> None:
    """Raise :class:`DistributedInputError` naming each field on which a rank's fingerprint differs
    from the reference (the first rank holding sequences, else rank 0); a field one of them lacks
    (an empty shard has no target) is not compared."""
    ref = next((r for r, c in enumerate(counts) if c > 0), 0)
    diffs = []
    for r, fp in enumerate(fps):
        for key, v in fp.items():
            if key in fps[ref] and fps[ref][key] != v:
                diffs.append(f"{key}: rank {ref} has {_shown(fps[ref][key])}, rank {r} has {_shown(v)}")
    if diffs:
        raise DistributedInputError(f"{what}: the ranks disagree on " + "; ".join(diffs)
                                    + " (every rank must pass the same everything but its own data)")


def on_every_rank(fn: Callable, *, what: str = "the call", group: dist.ProcessGroup | None = None) -> Any:
    """``fn()`` on this rank, its value returned once every rank of ``group`` has run its own ``fn``
    without an exception (one ``all_gather_object``). Where any rank's raised, every rank raises
    :class:`DistributedInputError` (all were ``ValueError``\\ s) or :class:`DistributedError`, naming
    ``what``, the ranks and their messages; :class:`CollectiveError` where a rank exited or timed out.
    Use it around a rank's own step that the others must not outrun (writing the results on rank 0,
    a checkpoint trained once). Raises ``ValueError`` without an initialised process group."""
    return _Group(group).agree(what, fn)[0]


def gather_objects(obj: Any, *, what: str = "the gather", group: dist.ProcessGroup | None = None) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank: one ``all_gather_object``.
    Raises :class:`CollectiveError` where a rank exited or timed out, ``ValueError`` without an
    initialised process group."""
    return _Group(group).gather_objects(obj, what)


def shard(n: int, *, group: dist.ProcessGroup | None = None) -> slice:
    """This rank's contiguous share of ``n`` items: ``slice(r·n // W, (r+1)·n // W)`` for rank ``r`` of
    ``W`` (sizes differ by at most one; empty shards where ``n < W``). Concatenated in rank order the
    shards are ``range(n)`` in order, the global order of the per-sample results. Not collective.
    Raises ``ValueError`` for ``n`` not an int ``>= 0`` or without an initialised process group."""
    n = check_int("n", n, 0)
    g = _Group(group)
    return slice(g.rank * n // g.size, (g.rank + 1) * n // g.size)


# ----------------------------------------------------------------------------- a rank's shard


class _Shard(NamedTuple):
    count: int  # sequences in this shard
    names: tuple  # the differentiated names, canonical order
    shapes: dict  # name -> shape of every parameter of cfg
    like: torch.Tensor  # dtype and device of the result (X for a block, the parameters for a model)
    fingerprint: dict
    weight: int = 0  # what the shard counts in the global mean: a model's CE targets other than -100, else its sequences


def _digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's values (its bytes on the CPU, contiguous), first 16 hex digits."""
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _loss_name(loss) -> str:
    if isinstance(loss, str):
        return loss
    return f"callable {getattr(loss, '__module__', '?')}.{getattr(loss, '__qualname__', type(loss).__name__)}"


def _target_spec(target, single: bool):
    """dtype and the shape of one sequence's target (``None`` and other objects by their type)."""
    if target is None:
        return None
    try:
        t = target if isinstance(target, torch.Tensor) else torch.as_tensor(target)
    except (TypeError, ValueError, RuntimeError):
        return type(target).__name__
    return str(t.dtype), tuple(t.shape) if single else tuple(t.shape[1:])


def _check_shard(params, X, cfg) -> tuple[int, bool, tuple]:
    """Check this rank's data as the single-process function first does; returns ``(count, single,
    the shape of one sequence)``. An empty shard (a batch of 0 sequences) is checked as one
    sequence of zeros of its shape."""
    if isinstance(cfg, ModelConfig):
        batch, single = model_input(cfg, X)
        x = batch.x
        if isinstance(x, torch.Tensor) and x.ndim >= 1 and x.shape[0] == 0:
            check_model_inputs(params, x.new_zeros((1,) + tuple(x.shape[1:])), cfg)
        else:
            check_model_inputs(params, batch, cfg)
        return x.shape[0], single, tuple(x.shape[1:])
    if not isinstance(cfg, BlockConfig):
        raise ValueError(f"cfg must be a BlockConfig or a ModelConfig, got {type(cfg).__name__}")
    if isinstance(X, torch.Tensor) and X.ndim == 3 and X.shape[0] == 0:
        check_inputs(params, X.new_zeros(X.shape[1:]), cfg)
        return 0, False, tuple(X.shape[1:])
    check_inputs(params, X, cfg)
    return (1, True, tuple(X.shape)) if X.ndim == 2 else (X.shape[0], False, tuple(X.shape[1:]))


def _prepare(g: _Group, function: str, params, X, cfg, loss, target, wrt, options: dict, block_only: bool = False,
             refuse: str | None = None):
    """Step 1 (module docstring): this rank's shard checked and described, agreed with every rank;
    ``refuse``: a ``ValueError`` message of an argument this rank was given and may not be.
    Returns ``(_Shard, counts, weights)`` of every rank (its sequences; its weight): each rank's share of the global mean is its weight over
    their sum (:func:`_weight`: its sequences, or a model's CE targets counted)."""
    def local() -> _Shard:
        if refuse is not None:
            raise ValueError(refuse)
        if block_only and not isinstance(cfg, BlockConfig):
            raise ValueError(f"cfg must be a BlockConfig for {function} (per-sample statistics of a block, as "
                             f"blockhess.convergence), got {type(cfg).__name__}")
        count, single, one = _check_shard(params, X, cfg)
        shapes = model_param_shapes(cfg) if isinstance(cfg, ModelConfig) else param_shapes(cfg)
        names = select_wrt(tuple(shapes), wrt)
        like = params[names[0]] if isinstance(cfg, ModelConfig) else X
        if not g.takes(like.device):
            raise ValueError(f"the process group's backend {g.backend} takes CUDA tensors, and the result would be on "
                             f"{like.device}: use gloo for CPU tensors")
        fp = {"the function and its options": (function, options), "the kind of cfg": type(cfg).__name__,
              **{f"cfg.{f.name}": repr(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)},
              "loss": _loss_name(loss), "wrt (the names differentiated)": names,
              "the dtype": str(like.dtype), "the device type": like.device.type, "the shape of one sequence": one}
        if count:
            fp["the target (dtype, shape for one sequence)"] = _target_spec(target, single)
        for k, v in params.items():
            fp[f"params[{k!r}] (shape, dtype, SHA-256 of its values)"] = (tuple(v.shape), str(v.dtype), _digest(v))
        return _Shard(count, names, shapes, like, fp, _weight(cfg, loss, target, count))

    sh, counts = g.agree(f"blockhess.distributed.{function}: the inputs", local, lambda s: s.fingerprint,
                         lambda s: s.count)
    if sum(counts) == 0:
        raise DistributedInputError(f"blockhess.distributed.{function}: every rank's shard is empty (0 sequences in all)")
    weights = counts
    if isinstance(cfg, ModelConfig) and isinstance(loss, str) and loss == "ce":  # shares by the counted targets
        weights = g.gather_objects(sh.weight, f"blockhess.distributed.{function}: the counted targets")
        if sum(weights) == 0:
            raise DistributedInputError(f"blockhess.distributed.{function}: every rank's targets are -100 (ignored): "
                                        "the mean over counted tokens has no token to count")
    return sh, counts, weights


def _weight(cfg, loss, target, count: int) -> int:
    """What a shard weighs in the global mean: a model's cross-entropy is the mean over the counted targets
    of the whole batch (those other than -100, :func:`blockhess.losses.counted`), so a shard's share is its
    counted targets' (with none ignored, ``L`` per sequence: its sequences'); another loss, its sequences."""
    if not (count and isinstance(cfg, ModelConfig) and isinstance(loss, str) and loss == "ce" and target is not None):
        return count
    try:
        return losses.counted(torch.as_tensor(target))
    except (TypeError, ValueError, RuntimeError):
        return count  # not classes: the local call says so


# ----------------------------------------------------------------------------- the Hessian


def _size(sh: _Shard) -> int:
    return sum(int(torch.Size(sh.shapes[k]).numel()) for k in sh.names)


def _zeros(sh: _Shard, out=None) -> HessianBlocks:
    """The zero dense Hessian over ``sh.names`` (an empty shard's), into ``out`` if given (checked as
    :func:`blockhess.hessian` checks it)."""
    acc = BlockSum(sh.names, sh.shapes, dense=True, dtype=sh.like.dtype, device=sh.like.device, out=out)
    return acc.result(sh.like)


def _wrap(buf: torch.Tensor, sh: _Shard, cfg, parts=None) -> HessianBlocks:
    """A :class:`~blockhess.result.HessianBlocks` over the dense ``buf`` ``(n, n)``: its blocks views of it."""
    return HessianBlocks.from_buffer(sh.names, sh.shapes, buf, parts, cfg=cfg)


def _reduce(g: _Group, buf: torch.Tensor, count: int, total: int, what: str) -> torch.Tensor:
    """Step 4: this rank's mean over its ``count`` sequences, scaled to its share ``count/total`` of
    the global mean, summed over the ranks in place (one ``all_reduce``); checked finite."""
    if count != total:
        buf.mul_(count / total)
    g.all_reduce(buf, f"the all-reduce of {what}")
    check_result({what: buf})
    return buf


def hessian(params: dict, X: torch.Tensor, cfg: BlockConfig | ModelConfig, loss: str | Callable = "mse",
            target: Any = None, wrt: str | Sequence[str] | None = None, wrt_input: bool = False,
            out: torch.Tensor | None = None, *, group: dist.ProcessGroup | None = None) -> HessianBlocks:
    r"""The exact Hessian of the mean loss over every rank's shard: :func:`blockhess.hessian` on the
    shards concatenated in rank order, on every rank of the process group (collective; module docstring).

    Parameters
    ----------
    params, cfg, loss, wrt
        As :func:`blockhess.hessian` (a block's :class:`~blockhess.BlockConfig` or a whole model's
        :class:`~blockhess.config.ModelConfig`), the same on every rank (checked: the parameters'
        values by SHA-256; a callable ``loss`` by its qualified name only: what it closes over, a
        head's weights say, is the caller's to keep the same).
    X, target
        This rank's shard: for a block ``(B_r, L, d_model)`` (or one sequence ``(L, d_model)``), for a
        model what it takes (:func:`blockhess.hessian`), and its targets; ``B_r = 0`` allowed (counts
        0). One sequence's shape (``L``, ``d_model``, an image's) the same on every rank.
    wrt_input : bool
        Must be ``False``: the block input is sharded over the ranks (its blocks would span them).
    out : Tensor or None
        This rank's ``(n, n)`` buffer for the result (a block only), as :func:`blockhess.hessian`;
        after an error it holds no result.
    group : ProcessGroup or None
        The process group (``None``: the default one).

    Returns
    -------
    HessianBlocks
        The same on every rank: blocks ``H[a, b]``, ``.dense()`` (``n × n``), dtype and device of ``X``
        (a block) or the parameters (a model). ``.outer`` and ``.functional`` are made on first access
        and are collective too: **every rank must access them, in the same order** (a rank asking for
        another part than the others raises :class:`DistributedInputError` everywhere; one that never
        asks leaves the others waiting until the group's timeout, then :class:`CollectiveError`). Each
        part is its own local pass and one ``all_reduce`` of ``n²`` entries (the local part, held until
        both parts are made, and its dense copy: ``2 n²`` entries on each rank while it is made).

    Raises
    ------
    DistributedInputError
        (a ``ValueError``) on every rank: a rank's input that :func:`blockhess.hessian` refuses (its
        message, with the rank), ranks that disagree (module docstring, step 1), every shard empty,
        ``wrt_input`` true, a result on a device the backend does not take.
    DistributedError
        On every rank: a rank's local work raised something other than a ``ValueError``.
    CollectiveError
        On every rank still running: a rank exited or did not arrive within the group's timeout.
    ValueError
        Without an initialised process group (not collective).
    """
    g = _Group(group)
    refuse = None if wrt_input is False else ("wrt_input must be False in blockhess.distributed.hessian: the block "
                                              "input is sharded over the ranks (for the Hessian w.r.t. X, call "
                                              "blockhess.hessian in one process)")
    sh, _, weights = _prepare(g, "hessian", params, X, cfg, loss, target, wrt, {}, refuse=refuse)
    total = sum(weights)
    state: dict = {"local": None, "made": set()}  # this rank's own result, for its parts

    def local() -> torch.Tensor:
        if sh.weight == 0:  # no sequence, or every target ignored: no share of the mean
            return _zeros(sh, out).dense()
        kw = {} if out is None else {"out": out}
        state["local"] = single_hessian(params, X, cfg, loss=loss, target=target, wrt=sh.names, **kw)
        return state["local"].dense()

    buf, _ = g.agree("blockhess.distributed.hessian: the local Hessians", local)
    buf = _reduce(g, buf, sh.weight, total, "the Hessian")

    def part(which: str) -> HessianBlocks:
        def local_part() -> torch.Tensor:
            if sh.weight == 0:
                return _zeros(sh).dense()
            return getattr(state["local"], which).dense()

        pb, _ = g.agree(f"blockhess.distributed.hessian: the local {which} parts", local_part,
                        lambda _: {"the part made (every rank must access .outer and .functional in the same order)":
                                   which})
        state["made"].add(which)
        if state["made"] == {"outer", "functional"}:
            state["local"] = None  # both parts made: the local result (and its cached parts) is no longer needed
        return _wrap(_reduce(g, pb, sh.weight, total, f"the Hessian's {which} part"), sh, cfg)

    return _wrap(buf, sh, cfg, part)


# ----------------------------------------------------------------------------- per sample


def _per_sample(function: str, params, X, cfg, loss, target, wrt, options: dict, group, local_rows: Callable,
                row_shape: Callable, dtype: Callable | None = None) -> torch.Tensor:
    """Steps 1–4 for a per-sample function: ``local_rows(sh, N)`` on a non-empty shard (``(B_r, ...)``;
    ``N`` the total count), an empty ``(0, *row_shape(sh))`` of ``dtype(sh)`` (default the result's)
    on ``sh.like``'s device otherwise; every rank's rows gathered in rank order (the padded shards
    and the result: about ``2 N`` rows on each rank)."""
    g = _Group(group)
    sh, counts, _ = _prepare(g, function, params, X, cfg, loss, target, wrt, options, block_only=True)

    def local() -> torch.Tensor:
        if sh.count == 0:
            return torch.empty((0,) + tuple(row_shape(sh)), dtype=(dtype or (lambda s: s.like.dtype))(sh),
                               device=sh.like.device)
        return local_rows(sh, sum(counts))

    rows, _ = g.agree(f"blockhess.distributed.{function}: the local rows", local)
    return g.gather_rows(rows.contiguous(), counts, f"the all-gather of {function}")


def per_sample_losses(params: dict, X: torch.Tensor, cfg: BlockConfig, loss: str | Callable = "mse",
                      target: Any = None, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """:func:`blockhess.cv.per_sample_losses` of every rank's shard, ``(N,)`` in the global order
    (rank 0's sequences first), on every rank (collective; module docstring). Raises as
    :func:`hessian`, and :class:`DistributedInputError` for a :class:`~blockhess.config.ModelConfig`
    (the single-process function takes a block)."""
    return _per_sample("per_sample_losses", params, X, cfg, loss, target, None, {}, group,
                       lambda sh, N: cv.per_sample_losses(params, X, cfg, loss=loss, target=target),
                       lambda sh: ())


def per_sample_gradients(params: dict, X: torch.Tensor, cfg: BlockConfig, loss: str | Callable = "mse",
                         target: Any = None, wrt: str | Sequence[str] | None = None, *,
                         group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """:func:`blockhess.cv.per_sample_gradients` of every rank's shard, ``(N, n)`` in the global
    order, on every rank (collective; module docstring). Raises as :func:`per_sample_losses`."""
    return _per_sample("per_sample_gradients", params, X, cfg, loss, target, wrt, {}, group,
                       lambda sh, N: cv.per_sample_gradients(params, X, cfg, loss=loss, target=target,
                                                                      wrt=sh.names),
                       lambda sh: (_size(sh),))


def per_sample_hessians(params: dict, X: torch.Tensor, cfg: BlockConfig, loss: str | Callable = "mse",
                        target: Any = None, wrt: str | Sequence[str] | None = None, *,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """:func:`blockhess.cv.per_sample_hessians` of every rank's shard, ``(N, n, n)`` in the global
    order, on every rank (collective; module docstring). Raises as :func:`per_sample_losses`, and
    :class:`DistributedInputError` (an ``InsufficientMemoryError`` of a rank) before the local work
    where the ``N·n²`` entries, twice (gathered and stacked), would not fit on that rank."""
    def rows(sh, N):
        n = _size(sh)
        check_fits(2 * N * n * n * sh.like.element_size(), f"the {N} per-sample {n}x{n} Hessians gathered from "
                   "every rank", sh.like.device)
        return cv.per_sample_hessians(params, X, cfg, loss=loss, target=target, wrt=sh.names)

    return _per_sample("per_sample_hessians", params, X, cfg, loss, target, wrt, {}, group, rows,
                       lambda sh: (_size(sh), _size(sh)))


#: the per-sample fields of :class:`blockhess.cv.PerSampleStats` that are one number per sample
_SCALARS = ("loss", "spectral", "spectral_residual", "frobenius", "grad_norm")


def per_sample_statistics(params: dict, X: torch.Tensor, cfg: BlockConfig, loss: str | Callable = "mse",
                          target: Any = None, directions: torch.Tensor | None = None, *,
                          wrt: str | Sequence[str] | None = None, chunk_size: int = 8, lanczos_iters: int | None = 64,
                          lanczos_tol: float = 1e-10, keep_grads: bool = False,
                          progress: Callable[[int], None] | None = None,
                          group: dist.ProcessGroup | None = None) -> cv.PerSampleStats:
    r""":func:`blockhess.cv.per_sample_statistics` of every rank's shard, gathered to every rank
    in the global order (rank 0's sequences first; collective, module docstring): the losses
    :math:`l_i`, gradient norms, spectral and Frobenius norms of the per-sample Hessians and the
    quadratic forms along ``directions`` that Theorem 7 takes (its constants are the maxima:
    ``L = stats.loss.max()``, ``M = (stats.spectral + stats.spectral_residual).max()`` over the whole
    dataset). Arguments as the single-process function, the same on every rank but ``X``, ``target``
    and ``progress`` (called on this rank for its own chunks); float64 on the CPU, one ``all_gather``
    of ``N × (5 + 2D [+ n with keep_grads])`` entries.

    Where the spectral norm is an exact ``eigvalsh`` (``lanczos_iters`` ``None`` or ``>= n``, or
    ``n <= 64``) every field agrees with the single-process function on the concatenated shards to
    rounding; with Lanczos, each rank seeds and stops its chunks as the single-process function does
    its own shard, so ``spectral`` is a Lanczos estimate of the same norm (within its residual), not
    the same estimate. Raises as :func:`per_sample_losses`.
    """
    D = 0 if directions is None else (directions.shape[0] if isinstance(directions, torch.Tensor) and directions.ndim == 2
                                      else -1)
    options = {"directions (shape, SHA-256)": (None if directions is None else
                                                (tuple(directions.shape), _digest(directions))
                                                if isinstance(directions, torch.Tensor) else type(directions).__name__),
               "lanczos_iters": lanczos_iters, "lanczos_tol": lanczos_tol, "keep_grads": keep_grads}

    def width(sh) -> int:
        return len(_SCALARS) + 2 * max(D, 0) + (_size(sh) if keep_grads else 0)

    def rows(sh, N) -> torch.Tensor:
        st = cv.per_sample_statistics(params, X, cfg, loss=loss, target=target, directions=directions,
                                               wrt=sh.names, chunk_size=chunk_size, lanczos_iters=lanczos_iters,
                                               lanczos_tol=lanczos_tol, keep_grads=keep_grads, progress=progress)
        cols = [getattr(st, k)[:, None] for k in _SCALARS] + [st.grad_dot, st.quad] + ([st.grads] if keep_grads else [])
        return torch.cat(cols, 1)

    packed = _per_sample("per_sample_statistics", params, X, cfg, loss, target, wrt, options, group, rows,
                         lambda sh: (width(sh),), lambda sh: torch.float64).to("cpu")
    out = {k: packed[:, i].clone() for i, k in enumerate(_SCALARS)}
    d0 = len(_SCALARS)
    out["grad_dot"] = packed[:, d0 : d0 + D].clone()
    out["quad"] = packed[:, d0 + D : d0 + 2 * D].clone()
    out["grads"] = packed[:, d0 + 2 * D :].clone() if keep_grads else None
    return cv.PerSampleStats(**out)


# ----------------------------------------------------------------------------- the operator


def _all_reduced(g: _Group, like: torch.Tensor, n: int, compute, what: str) -> torch.Tensor:
    """The sum over the ranks of ``compute()`` (a flat ``(n,)`` tensor of ``like``'s dtype; ``None``: a rank
    with nothing to add) by one ``all_reduce`` of ``n`` entries and two flags, so that every rank hears
    of a failure in the same message: :class:`DistributedError` on every rank when ``compute`` raised on
    some rank, ``NotImplementedError`` on every rank when it raised that (an engine without the closed
    form, the same on every rank)."""
    buf = like.new_zeros(n + 2)  # the sum, then the failures and the ranks without a closed form
    mine = None
    try:
        if compute is not None:
            buf[:-2] = compute()
    except NotImplementedError as exc:
        mine = exc
        buf.zero_()
        buf[-1] = 1
    except Exception as exc:  # noqa: BLE001 — every rank must hear of it
        mine = exc
        buf.zero_()
        buf[-2] = 1
    g.all_reduce(buf, f"the all-reduce of {what}")
    if float(buf[-2]) > 0:
        raise DistributedError(f"blockhess.distributed.hessian_operator: {what} failed on {int(buf[-2])} rank(s)"
                               + (f"; on rank {g.rank}: {_first_line(mine)}" if mine else ""),
                               {g.rank: _sendable(mine)} if mine else {}) from mine
    if float(buf[-1]) > 0:
        raise NotImplementedError(f"blockhess.distributed.hessian_operator: {_first_line(mine)}" if mine else
                                  f"blockhess.distributed.hessian_operator: {what} has no closed form here")
    return buf[:-2]


def hessian_operator(params: dict, X: torch.Tensor, cfg: BlockConfig | ModelConfig, loss: str | Callable = "mse",
                     target: Any = None, wrt: str | Sequence[str] | None = None, part: str = "full", *,
                     group: dist.ProcessGroup | None = None) -> HessianOperator:
    r"""The matrix-free Hessian of the mean loss over every rank's shard:
    :func:`blockhess.hessian_operator` on the shards concatenated in rank order, on every rank
    (collective; module docstring).

    Arguments as :func:`hessian` (``part`` as :func:`blockhess.hessian_operator`); the inputs are checked
    and agreed as there before any work. Each product ``A @ V`` is collective: every rank multiplies
    its own shard's operator (:func:`blockhess.hessian_operator`, the forward pass and adjoints kept
    once), scales it by its share ``B_r / N`` and one ``all_reduce`` of the ``n_out × k`` rows sums
    them, so **every rank must make the same products in the same order** (an estimator with the same
    seed on every rank does: the sums are the same bits on every rank, so are its next vectors). A
    product that raises on one rank makes every rank raise :class:`DistributedError` (an error flag
    rides in the same ``all_reduce``); a rank that exits, :class:`CollectiveError`. Views ``A[a, b]``
    are collective the same way, and so is the exact diagonal ``A.diagonal()`` (each rank's closed-form
    diagonal, :mod:`blockhess.block.diagonal`, scaled by its share and all-reduced; ``NotImplementedError``
    on every rank where the engine has none: a model, a callable loss).

    Raises as :func:`hessian` (before any product).
    """
    g = _Group(group)
    sh, counts, weights = _prepare(g, "hessian_operator", params, X, cfg, loss, target, wrt, {"part": part})
    total = sum(weights)

    def local():
        return single_operator(params, X, cfg, loss=loss, target=target, wrt=sh.names, part=part) if sh.weight else None

    op, _ = g.agree("blockhess.distributed.hessian_operator: the local operators", local)
    like = sh.like
    sizes = {k: int(torch.Size(sh.shapes[k]).numel()) for k in sh.names}

    def product(V: dict, wanted_out: tuple) -> dict:
        k = next(iter(V.values())).shape[0] if V else 1
        n_out = sum(sizes[a] for a in wanted_out)

        def local_rows():
            cols_of = tuple(a for a in sh.names if a in V)  # the view's columns: the product skips the rest
            cols = torch.cat([V[a].reshape(k, -1) for a in cols_of], 1)
            return (op[tuple(wanted_out), cols_of] @ cols.T.contiguous() * (sh.weight / total)).reshape(-1)

        rows = _all_reduced(g, like, n_out * k, local_rows if op is not None else None,
                            "a Hessian-vector product").reshape(n_out, k)
        out, off = {}, 0
        for a in wanted_out:
            out[a] = rows[off:off + sizes[a]].T.reshape(k, *sh.shapes[a])
            off += sizes[a]
        return out

    def diagonal(wanted: tuple) -> dict:
        n_out = sum(sizes[a] for a in wanted)

        def local_diagonal():
            return op[tuple(wanted), tuple(wanted)].diagonal() * (sh.weight / total)

        buf = _all_reduced(g, like, n_out, local_diagonal if op is not None else None, "the exact diagonal")
        out, off = {}, 0
        for a in wanted:
            out[a] = buf[off:off + sizes[a]].reshape(sh.shapes[a])
            off += sizes[a]
        return out

    return HessianOperator(product, sh.names, {k: sh.shapes[k] for k in sh.names}, like.dtype, like.device,
                           diagonal=diagonal, split=head_views(cfg), count=sum(counts), cfg=cfg)
