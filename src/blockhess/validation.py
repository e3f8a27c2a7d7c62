"""Input checks shared by the public entry points: clear errors, raised before any work.

Every check names the argument and what was expected. The closed-form kernels themselves
do not validate (they must stay traceable by ``torch.func.vmap``); the public functions
call these first.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import sys
import threading
import warnings

import psutil
import torch

__all__ = ["InsufficientMemoryError", "check_tensor", "check_finite", "check_result", "check_params", "check_fits",
           "check_ln_variance", "check_int", "check_eps", "check_bool", "saved_bytes", "Headroom", "keeping_free",
           "recording_needs"]


FLOAT_DTYPES = (torch.float32, torch.float64)  # float16/bfloat16 are too coarse for these sums (docs/derivations.md §8)


class InsufficientMemoryError(MemoryError, ValueError):
    """A requested dense result would not fit in the memory available right now."""


def check_int(name: str, value, minimum: int) -> int:
    """``value`` must be an integer (Python or NumPy; not a bool, not a float) ``>= minimum``;
    returns it as ``int``. Raises ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_bool(name: str, value) -> bool:
    """``value`` must be a bool (not a string or a number). Raises ``ValueError`` naming ``name``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_eps(name: str, value) -> float:
    """``value`` must be a finite real number ``>= 0`` (not a bool), e.g. a LayerNorm ``eps``;
    returns it as ``float``. Raises ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")
    return float(value)


def check_tensor(name: str, t, *, ndim: tuple[int, ...] | None = None, like: torch.Tensor | None = None,
                 finite: bool = True, like_name: str = "X") -> None:
    """``t`` must be a float32 or float64 tensor (same dtype and device as ``like``, named
    ``like_name`` in the message, if given), finite unless ``finite=False`` (the caller then
    checks it with others in :func:`check_finite`).

    Raises ``ValueError`` naming ``name`` otherwise.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32 or float64, got {t.dtype}")
    if ndim is not None and t.ndim not in ndim:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndim))} dimensions, got shape {tuple(t.shape)}")
    if like is not None:
        if t.dtype != like.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but {like_name} has {like.dtype}; use one dtype throughout")
        if t.device != like.device:
            raise ValueError(f"{name} is on {t.device} but {like_name} is on {like.device}; use one device throughout")
    if finite:
        check_finite({name: t})


def check_finite(named: dict[str, torch.Tensor], why: str = "") -> None:
    """Every tensor of ``named`` (name → tensor, one dtype and device) must be free of NaN and Inf.

    Fast path: one sum over all entries (a NaN or Inf anywhere makes it non-finite), each
    tensor summed where it lies (a view into a larger buffer is not copied); only then are
    the tensors searched one by one, to name the first offender in the ``ValueError``
    (``why`` appended; a sum that merely overflowed finds none and passes).
    """
    sums = [t.detach().sum() for t in named.values()]
    if math.isfinite(sums[0] if len(sums) == 1 else torch.stack(sums).sum()):
        return
    for name, t in named.items():
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} contains NaN or Inf{why}")


def check_result(named: dict[str, torch.Tensor]) -> None:
    """A result computed from checked, finite inputs must be finite: the last check of the entry
    points (Hessians, Jacobians, LayerNorm derivatives), one sum as :func:`check_finite`.

    A NaN or Inf there means a value overflowed the dtype while the closed form was evaluated
    (the true result overflows, or a product on the way does), e.g. LayerNorm rows of tiny
    ``var + ln_eps``: each LayerNorm multiplies a Jacobian by ``1/sigma`` and its Hessian by
    ``1/sigma^2``, and a block's Hessian carries both LayerNorms' (docs/derivations.md §3).
    Raises ``ValueError`` naming the first non-finite tensor of ``named``; with ``out=`` the
    buffer then holds that partial result.
    """
    t = next(iter(named.values()))
    check_finite(named, f": a value overflowed {t.dtype} while it was computed from finite inputs (e.g. LayerNorm "
                        "rows of tiny var + ln_eps: 1/sigma enters a block's Hessian up to four times); rescale X or "
                        "the weights, or use a larger ln_eps")


def detached(params: dict, X: torch.Tensor, target=None) -> tuple:
    """``(params, X, target)`` without autograd history (views, no copies; a non-tensor
    ``target`` is passed through). The closed forms write into preallocated buffers, which
    autograd cannot record, and their results are not meant to be differentiated again:
    inputs that require grad (weights of a live module, an ``X`` built by autograd) are
    therefore used detached."""
    return ({k: v.detach() for k, v in params.items()}, X.detach(),
            target.detach() if isinstance(target, torch.Tensor) else target)


def check_params(params: dict, shapes: dict[str, tuple[int, ...]], X: torch.Tensor, like_name: str = "X") -> None:
    """``params`` must hold exactly the names of ``shapes`` with those shapes, dtype and device of
    ``X`` (named ``like_name`` in the messages); ``params`` and ``X`` must be finite."""
    if not isinstance(params, dict):
        raise ValueError(f"params must be a dict of tensors, got {type(params).__name__}")
    missing = [n for n in shapes if n not in params]
    extra = [n for n in params if n not in shapes]
    if missing or extra:
        raise ValueError(f"params must have keys {list(shapes)}; missing {missing}, unexpected {extra}")
    for name, shape in shapes.items():
        check_tensor(f"params[{name!r}]", params[name], like=X, finite=False, like_name=like_name)
        if tuple(params[name].shape) != tuple(shape):
            raise ValueError(f"params[{name!r}] must have shape {tuple(shape)}, got {tuple(params[name].shape)}")
    check_finite({like_name: X, **{f"params[{n!r}]": params[n] for n in shapes}})


def check_ln_variance(name: str, U: torch.Tensor, eps: float, stats=None, computed: bool = False, first: int = 0,
                      rms: bool = False) -> None:
    r"""Every LayerNorm input row must have a finite variance ``var``, and its
    :math:`\sigma^2 = \mathrm{var} + \varepsilon` (``eps`` the LayerNorm's ``ln_eps``) must stand
    above the rounding of the row's values by at least ``tiny / e``:

    .. math::
        \mathrm{var} + \varepsilon - e^2(\mathrm{var} + \mathrm{mean}^2) \ge (1 - e^2)\,\mathit{tiny}/e,

    ``e`` the dtype's machine epsilon, ``tiny`` its smallest normal number. Below it the
    normalised entries carry no correct digit (with ``eps = 0``: zero variance to the dtype's
    precision, the paper's Assumption 2), or ``r^2 = 1/sigma^2`` leaves no margin below the
    largest number (derived in docs/derivations.md §3, "Which rows the closed forms can take").

    A non-finite variance is a NaN or Inf in ``U`` (``computed``: ``U`` comes from finite inputs
    inside the block, so the forward pass overflowed), or a row whose spread overflows the dtype.
    A block's Hessian multiplies the ``r`` of two LayerNorms (up to :math:`r_1^2 r_2^2`), which
    no per-row test decides; the entry points check their results as well (:func:`check_result`).

    One test for the whole tensor; the offending row is looked up only to raise. ``stats``:
    ``torch.var_mean(U, -1, correction=0, keepdim=True)`` if the caller has it. Raises
    ``ValueError`` naming ``name`` and the first offending row (of a batch ``U`` of shape
    ``(B, L, d)``: ``(b, t)``, ``b`` counted from ``first``). ``rms``: the rows of an RMSNorm, ``stats``
    its ``(mean(x²), 0)``; the messages then speak of its mean square.
    """
    var, mean = torch.var_mean(U, -1, correction=0, keepdim=True) if stats is None else stats
    fi = torch.finfo(U.dtype)
    small, e2 = fi.tiny / fi.eps, fi.eps**2
    me = mean * fi.eps  # the rounding of the row's values is e sqrt(var + mean^2): e mean, e^2 var folded in below
    q = var + (eps - me * me) / (1 - e2)  # sigma^2 minus that rounding, / (1 - e^2) (inf passes; var <= max apart)
    bad = ~((q >= small) & (var <= fi.max))  # NaN fails both
    if not bool(bad.any()):
        return
    row = tuple(bad[..., 0].nonzero()[0].tolist())
    shown = (row[0] + first, *row[1:]) if len(row) == 2 else row
    norm, variance = ("RMSNorm", "mean square") if rms else ("LayerNorm", "variance")
    where = f"{norm} input row {shown}" if row else f"the {norm} input row"
    if not torch.isfinite(U).all():
        if computed:
            raise ValueError(f"{name} contains NaN or Inf: the forward pass overflowed {U.dtype} on finite inputs; "
                             "rescale X or the weights")
        raise ValueError(f"{name} contains NaN or Inf")
    v, m = var[row].item(), abs(mean[row].item())
    if not math.isfinite(v):
        raise ValueError(f"{name}: the {variance} of {where} overflows {U.dtype} "
                         f"(largest |entry| {U[row].abs().max().item():.3g}); rescale the inputs")
    me = m * fi.eps  # products, not **: a Python float power raises OverflowError where * gives inf
    noise = me * me / (1 - e2)
    if not eps > 0:
        if v <= noise and (v >= small or m * m >= small or v == 0):
            raise ValueError(f"{name}: {where} has zero {variance} and ln_eps=0 "
                             "(the paper's Assumption 2); use ln_eps > 0 or other inputs")
        raise ValueError(f"{name}: the {variance} of {where} is {v:.3g}, below {small:.3g} (plus its mean's rounding), "
                         f"where {U.dtype} loses precision and 1/sigma^2 overflows (ln_eps=0); rescale the inputs or use ln_eps > 0")
    need = (1 - e2) * (small - v) + me * me  # the smallest ln_eps that passes, to rounding
    if v + eps <= noise:
        raise ValueError(f"{name}: {where} is constant to the rounding of its values ({variance} {v:.3g}) and ln_eps={eps:.3g} "
                         f"is below their squared rounding {noise:.3g}: its normalised entries, that rounding times "
                         f"1/sigma, carry no correct digit; use ln_eps > {need:.3g} or other inputs")
    raise ValueError(f"{name}: the {variance} of {where} plus ln_eps is {v + eps:.3g}, below {small + noise:.3g} "
                     f"({small:.3g} plus its values' squared rounding), where {U.dtype} loses precision and 1/sigma^2 "
                     f"overflows; use ln_eps > {need:.3g} or rescale the inputs")


def tf32_enabled() -> bool:
    """Whether CUDA float32 matrix products may run in TF32 (``torch.backends.cuda.matmul.allow_tf32``,
    set by ``torch.set_float32_matmul_precision("high")`` among others)."""
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:  # torch refuses to read a mix of its old and new precision settings
        return True


def warn_tf32(dtype: torch.dtype, device: torch.device | str) -> None:
    """Warn (``UserWarning``) when float32 work on CUDA would run its matrix products in TF32:
    about 1e-3 relative error instead of float32's 1e-7, silently, in every result."""
    if dtype == torch.float32 and torch.device(device).type == "cuda" and tf32_enabled():
        warnings.warn("float32 on CUDA with TF32 matrix products enabled (torch.backends.cuda.matmul.allow_tf32): "
                      "results carry ~1e-3 relative error; call torch.set_float32_matmul_precision('highest') "
                      "for float32 accuracy, or use float64", stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside this package, seen from the function that
    calls this one: a warning then points at the user's line, however deep the library's calls."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


SMALL_BYTES = 64 << 20  # requests below this are not checked: reading the free memory would dominate small calls


_scope = threading.local()  # this thread's Headroom (keeping_free) and Needs (recording_needs), where set


class Headroom:
    """Bytes that :func:`check_fits` keeps free in the threads that hold it (:func:`keeping_free`), for
    work that another thread of the same computation does between their allocations; ``why`` names that
    work in the error. ``bytes`` may be raised at any time (by the other thread)."""

    def __init__(self, why: str, nbytes: int = 0):
        self.why, self.bytes = why, int(nbytes)


@contextlib.contextmanager
def keeping_free(headroom: Headroom):
    """In this thread, every :func:`check_fits` (whatever its size) asks for ``headroom.bytes`` more (the
    thread's earlier headroom, if any, back after the block)."""
    before = getattr(_scope, "headroom", None)
    _scope.headroom = headroom
    try:
        yield headroom
    finally:
        _scope.headroom = before


class Needs:
    """The most memory a stretch of work in one thread needed at once, by its own checks: the largest
    over its :func:`check_fits` calls of the bytes asked plus what the stretch had taken when it asked
    (the fall of the available memory since :func:`recording_needs` began, ``0`` where it rose)."""

    def __init__(self):
        self.peak, self._start = 0, {}

    def note(self, device: torch.device, nbytes: int, available: int) -> None:
        start = self._start.setdefault(str(device), available)
        self.peak = max(self.peak, int(nbytes) + max(0, start - available))


@contextlib.contextmanager
def recording_needs():
    """Record, in this thread, the :class:`Needs` of the checks made inside the block (CPU memory read at
    entry; a device's at its first check; the thread's earlier record, if any, back after the block)."""
    rec, before = Needs(), getattr(_scope, "needs", None)
    rec.note(torch.device("cpu"), 0, _available(torch.device("cpu")))  # the start (a request of 0 bytes)
    _scope.needs = rec
    try:
        yield rec
    finally:
        _scope.needs = before


def _available(device: torch.device) -> int:
    if device.type == "cuda":  # free on the device, plus what PyTorch's allocator holds unused
        return (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                - torch.cuda.memory_allocated(device))
    return psutil.virtual_memory().available


def check_fits(nbytes: int, what: str, device: torch.device | str = "cpu") -> None:
    """Raise ``InsufficientMemoryError`` (a ``MemoryError`` and a ``ValueError``) if ``nbytes``
    exceeds the memory available now on ``device`` (CUDA: the device's free memory plus the
    cached blocks PyTorch's allocator holds unused); the message gives both byte counts.
    Requests under ``SMALL_BYTES`` bytes are not checked: a machine that cannot hold
    them fails in the allocator anyway, and the check would dominate small calls. In a thread
    :func:`keeping_free` a :class:`Headroom`, every request is checked with the headroom's bytes
    added; in one :func:`recording_needs`, each checked request is recorded."""
    keep = getattr(_scope, "headroom", None)
    if nbytes < SMALL_BYTES and keep is None:
        return
    device = torch.device(device)
    available = _available(device)
    rec = getattr(_scope, "needs", None)
    if rec is not None:
        rec.note(device, nbytes, available)
    extra = keep.bytes if keep is not None else 0
    if nbytes + extra > available:
        kept = f", and {extra:,} bytes are kept free for {keep.why}" if extra else ""
        raise InsufficientMemoryError(
            f"{what} would need {nbytes:,} bytes ({nbytes / 2**30:.2f} GiB) but only {available:,} bytes "
            f"({available / 2**30:.2f} GiB) are available on {device}{kept}"
        )


def saved_bytes(fn, *args):
    """``(fn(*args), bytes)``: the result of the call, and the total size of the tensors autograd
    saves for its backward pass that depend on an input requiring grad (each storage once;
    constants such as a classifier head's weights do not count). Those are what
    ``torch.func``'s tangents and cotangents of ``fn`` carry, one copy per tangent, so they
    scale its work space; the call sees inside a user's function (a callable loss's logits,
    an MLP's hidden layer) at the cost of one forward pass with gradients recorded. The
    caller passes inputs that require grad (e.g. ``Z.detach().requires_grad_()``)."""
    sizes = {}

    def pack(t):
        if t.requires_grad:
            storage = t.untyped_storage()
            sizes[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(sizes.values())
