"""The comparison rules of the suite, written once here, and the builders of a case;
the lists of cases are in ``settings.py``.

* float64: every closed form against ``torch.func`` by the relative Frobenius error
  ``‖A − B‖_F / ‖B‖_F <= 1e-10`` (:func:`assert_close`). A block of a larger whole (a Hessian
  block, one part of a Jacobian) is judged against its own norm, and where its reference is
  zero (the query/key blocks at ``L = 1``, where softmax is constant) or below the whole's
  rounding, to that rounding: ``‖A − B‖_F <= 1e-10 ‖B‖_F + ROUND · ε · ‖whole‖_F``
  (:func:`assert_blocks_close`, or ``scale=`` = the whole's norm). A part (outer, functional)
  may be judged in units of the whole (:func:`assert_part_close`).
* float32: against the float64 reference on the same (float32) inputs, by the error float32
  autograd itself makes there: at most ``FLOAT32_FACTOR`` = 3 times ``torch.func``'s float32
  error, or than rounding the float64 answer to float32 (:func:`assert_float32_close`,
  :func:`assert_float32_hessian`).
* identities (symmetry, outer + functional = full, PSD outer): to the backward-error bound of a
  sum of ``n`` terms in the dtype, ``n ε`` (:func:`rounding`, :func:`assert_identities`).
* norms by :func:`fro` (no overflow for entries near 1e200).

``make test`` runs the files in ``TEST_WORKERS`` (default 2) pytest-xdist processes, a file's tests in one of them
(``--dist loadfile``: a module's fixtures are built once), each with its share of the cores as torch threads.

Hypothesis profiles (tests/test_hessian_properties.py): ``fast`` (the default, ``make test``: 100
examples, derandomized so CI is reproducible) and ``long`` (``HYPOTHESIS_PROFILE=long``; the
count from ``HYPOTHESIS_EXAMPLES``, default 3000).
"""

from __future__ import annotations

import math
import os
import zlib

# make test runs the suite in pytest-xdist workers (Makefile, TEST_WORKERS): the cores are shared out among
# them, else each worker's torch takes a thread per core and their OpenMP teams wait on each other
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pytest
import torch
from hypothesis import HealthCheck, settings

import blockhess as bh
from blockhess.linalg import rel_error

from settings import LOSSES, MODEL_SIZES, PATCH_IMAGES, SIZE_IDS, SIZES

TOL = 1e-10
# rounding of a whole matrix, in units of ε·‖whole‖_F: a block below it is not resolved by any
# float64 evaluation of the whole (measured: <= 0.1 ε beyond the own-norm rule over settings.OPTION_CASES)
ROUND = 4.0
EPS64 = torch.finfo(torch.float64).eps
FLOAT32_FACTOR = 3.0
AUTOGRAD_FACTOR = FLOAT32_FACTOR  # "within 3x of the error autograd itself makes", float64's measurable part

settings.register_profile("fast", max_examples=100, deadline=None, derandomize=True, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("long", max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", "3000")), deadline=None,
                          database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fast"))


@pytest.fixture(autouse=True)
def _seeded_global_rng(request):
    """torch's global generator seeded per test from the test's id: a test drawing from it gets the same
    numbers whatever ran before it (the order and the set of tests selected), so a failure reproduces alone."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def spy_calls(monkeypatch, module, name: str) -> list[dict]:
    """Record each call's keyword arguments of ``module.name`` (the call still runs): the list fills as
    the code under test calls it (a restriction's tests count what ran)."""
    seen, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


def rel_err(A: torch.Tensor, B: torch.Tensor, scale: float | None = None) -> float:
    """:func:`blockhess.linalg.rel_error` ``‖A − B‖_F / ‖B‖_F``; ``‖A − B‖_F / scale`` when ``‖B‖_F``
    is below ``1e-12·scale`` (a reference that is zero up to rounding)."""
    assert A.shape == B.shape, f"shape {tuple(A.shape)} != reference {tuple(B.shape)}"
    ref = B.norm().item()
    if ref <= 1e-12 * (scale if scale is not None else 0.0):
        assert scale, "reference is exactly zero: give a scale"
        return rel_error(A, B, scale)
    return rel_error(A, B)


def fro(t: torch.Tensor) -> float:
    """Frobenius norm in float64, without overflow for entries near 1e200 (a tiny LayerNorm eps)."""
    t = t.double()
    m = float(t.abs().max()) if t.numel() else 0.0
    return m * float((t / m).norm()) if m > 0 and math.isfinite(m) else float(t.norm())


def _eps(t: torch.Tensor) -> float:
    return torch.finfo(t.dtype).eps if t.is_floating_point() else torch.finfo(torch.float64).eps


def assert_close(A, B, scale=None, tol=TOL, what="", allow: float = 0.0):
    """``‖A − B‖_F <= tol·‖B‖_F`` (+ ``ROUND·ε·scale`` with ``scale``, the norm of the whole
    ``B`` is a block of: a block at or below that whole's rounding is matched to it; + ``allow``,
    an absolute allowance whose reason the caller gives, e.g. :func:`autograd_defect`). A zero
    reference without either must be matched exactly."""
    assert A.shape == B.shape, f"{what}: shape {tuple(A.shape)} != reference {tuple(B.shape)}"
    diff, ref = fro(A.double() - B.double()), fro(B)
    bound = tol * ref + (ROUND * _eps(B) * scale if scale else 0.0) + allow
    rel = diff / ref if ref else float("inf")
    assert diff <= bound, f"{what}: ‖A − B‖ = {diff:.3e} > {bound:.3e} (‖B‖ = {ref:.3e}, relative {rel:.3e}, tol {tol:.0e})"


def assert_part_close(A, B, whole: float, tol=TOL, what="", allow: float = 0.0):
    """A part of a whole (the outer or functional term) in units of the whole's norm:
    ``‖A − B‖_F <= tol·whole`` (+ ``allow`` as for :func:`assert_close`)."""
    assert A.shape == B.shape, f"{what}: shape {tuple(A.shape)} != reference {tuple(B.shape)}"
    diff = fro(A.double() - B.double())
    assert diff <= tol * whole + allow, f"{what}: ‖A − B‖ = {diff:.3e} > {tol:.0e} x the whole's norm {whole:.3e} + {allow:.3e}"


def autograd_defect(R: torch.Tensor) -> float:
    """``AUTOGRAD_FACTOR · ‖R − Rᵀ‖_F`` of autograd's Hessian ``R`` (``torch.func`` does not
    mirror): the true Hessian is symmetric, so ``R``'s own error is at least half of ``‖R − Rᵀ‖``.
    Rounding level (``~ε‖R‖``) on well-conditioned inputs; where softmax saturates (inputs at ~50x
    the weights' scale) it reaches 1e-10 of ``‖R‖``, the closed form staying symmetric to 1e-17,
    and a comparison cannot ask more of the closed form than autograd's own error."""
    return AUTOGRAD_FACTOR * fro(R - R.mT)


def blocks_of(H, R) -> dict:
    """``{(a, b): (H[a, b], R[a, b])}`` over every ordered pair of ``H.names``."""
    return {(a, b): (H[a, b], R[a, b]) for a in H.names for b in H.names}


def assert_blocks_close(pairs: dict, what: str = "") -> None:
    """``pairs``: ``{key: (A, B)}``, the blocks of one whole. Each block to its own norm, and to the
    rounding of the whole (the Frobenius norm of all the ``B``) where it is zero or below it."""
    whole = fro(torch.stack([torch.tensor(fro(B)) for _, B in pairs.values()]))
    for key, (A, B) in pairs.items():
        assert_close(A, B, scale=whole, what=f"{what} block {key}")


def assert_float32_close(C32: torch.Tensor, A32, R64: torch.Tensor, scale: float | None = None,
                         terms=None, what: str = "", factor: float = FLOAT32_FACTOR, floor: float = 0.0) -> None:
    """A float32 closed form ``C32`` against the float64 reference ``R64`` computed on the same
    float32 inputs (upcast), judged by float32 autograd ``A32`` on those inputs:
    ``‖C32 − R64‖ <= factor · max(‖A32 − R64‖, ‖fl32(R64) − R64‖, terms' floor, floor)``.

    ``A32`` may be a list: float32 autograd's evaluations of the same numbers in different ways (a
    sequence's block in its batch and alone), its error the largest of theirs. The second: no
    float32 result is closer than the exact answer rounded to float32. ``terms``, for a full
    Hessian: ``[(A_outer, R_outer), (A_functional, R_functional)]``, autograd's and the
    reference's eq. 10 terms. The closed form assembles the full Hessian from them, so it is
    allowed the sum of autograd's errors on them, and ``ε32 (‖R_outer‖ + ‖R_functional‖)``: where
    they cancel (``‖H‖ ≪ ‖outer‖ ≈ ‖functional‖``) each one's rounding stays in the sum, which
    autograd's double derivative never forms. ``floor``: a further lower bound of float32's error
    whose reason the caller gives. ``+ ROUND·ε32·scale`` with ``scale`` (the whole's norm, for a
    block that may be zero)."""
    A32 = list(A32) if isinstance(A32, (list, tuple)) else [A32]
    assert C32.dtype == torch.float32 and R64.dtype == torch.float64 and all(a.dtype == torch.float32 for a in A32)
    eps32 = torch.finfo(torch.float32).eps
    err, err_rounding = fro(C32.double() - R64), fro(R64.float().double() - R64)
    err_autograd = max(fro(a.double() - R64) for a in A32)
    err_terms = 0.0
    if terms:
        err_terms = max(eps32 * sum(fro(r) for _, r in terms), sum(fro(a.double() - r) for a, r in terms))
    allowed = max(err_autograd, err_rounding, err_terms, floor)
    bound = factor * allowed + (ROUND * eps32 * scale if scale else 0.0)
    ref = fro(R64) or 1.0
    assert err <= bound, (f"{what}: float32 error {err / ref:.3e} > {factor:g} x max(float32 autograd's {err_autograd / ref:.3e}, "
                          f"rounding of the answer {err_rounding / ref:.3e}, of its terms {err_terms / ref:.3e}, "
                          f"given floor {floor / ref:.3e}), relative to the float64 reference")


def to_dtype(x, dtype):
    """A tensor, a dict of tensors or a float tensor inside a list, in ``dtype`` (integer tensors kept)."""
    if isinstance(x, dict):
        return {k: to_dtype(v, dtype) for k, v in x.items()}
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x


def float32_hessians(params, X, cfg, loss="mse", target=None, **kw):
    """``(closed form, torch.func, float64 reference)`` of :func:`blockhess.hessian` on the float32
    copies of ``params``, ``X`` and a float ``target``; the reference takes those same values in float64."""
    p32, X32, T32 = to_dtype(params, torch.float32), X.float(), to_dtype(target, torch.float32)
    H = bh.hessian(p32, X32, cfg, loss=loss, target=T32, **kw)
    A = bh.reference.hessian(p32, X32, cfg, loss=loss, target=T32, **kw)
    R = bh.reference.hessian(to_dtype(p32, torch.float64), X32.double(), cfg, loss=loss, target=to_dtype(T32, torch.float64), **kw)
    return H, A, R


def assert_float32_hessian(params, X, cfg, loss="mse", target=None, what="float32", **kw):
    """The float32 closed form's full Hessian and both parts by :func:`assert_float32_close`."""
    H, A, R = float32_hessians(params, X, cfg, loss=loss, target=target, **kw)
    assert H.dense().dtype == torch.float32
    terms = [(A.outer.dense(), R.outer.dense()), (A.functional.dense(), R.functional.dense())]
    assert_float32_close(H.dense(), A.dense(), R.dense(), terms=terms, what=f"{what} full")
    for part in ("outer", "functional"):
        assert_float32_close(getattr(H, part).dense(), getattr(A, part).dense(), getattr(R, part).dense(), what=f"{what} {part}")
    return H


def rounding(M: torch.Tensor) -> float:
    """``n ε`` for an ``n × n`` matrix in its dtype: the backward-error bound of a sum of ``n``
    products (Higham's γ_n), the rounding allowed in an identity between two assemblies."""
    return M.shape[-1] * torch.finfo(M.dtype).eps


def assert_identities(H, convex: bool, reference=None, what: str = "") -> None:
    """Symmetry, outer + functional = full (separate assemblies), and a PSD outer term for a loss
    convex in ``Z`` (Gauss–Newton), each to :func:`rounding`.

    With ``reference`` (autograd's result on the same inputs and dtype), each may in addition be
    off by what the closed form's distance to it allows (triangle inequality; Weyl's for
    ``λ_min``), plus autograd's own defect: an ill-conditioned input (a LayerNorm row at 1e-3 of
    the weights' scale, CE near saturation) leaves more than ``n ε`` in every assembly, and the
    comparison with autograd is what judges that."""
    D, O, F = H.dense(), H.outer.dense(), H.functional.dense()
    r = rounding(D)
    sym, split, psd = r * fro(D), r * (fro(O) + fro(F)), 0.0
    if reference is not None:
        Rd, Ro, Rf = reference.dense(), reference.outer.dense(), reference.functional.dense()
        dist = {k: fro(a - b) for k, a, b in (("D", D, Rd), ("O", O, Ro), ("F", F, Rf))}
        sym += 2 * dist["D"] + fro(Rd - Rd.T)
        split += dist["D"] + dist["O"] + dist["F"] + fro(Ro + Rf - Rd)
        if convex:
            psd = dist["O"] - min(float(_eigvalsh(Ro).min()), 0.0)
    got = fro(D - D.T)
    assert got <= sym, f"{what}: not symmetric (‖D − Dᵀ‖ {got:.3e} > {sym:.3e})"
    got = fro(O + F - D)
    assert got <= split, f"{what}: outer + functional != full ({got:.3e} > {split:.3e})"
    if convex:
        lam = _eigvalsh(O)
        floor = r * float(lam.abs().max()) + psd
        assert float(lam.min()) >= -floor, f"{what}: outer term not PSD (λ_min {float(lam.min()):.3e} < -{floor:.3e})"


def _eigvalsh(M: torch.Tensor) -> torch.Tensor:
    """Eigenvalues in float64, scaled to the largest entry first (no overflow near 1e200)."""
    m = float(M.abs().max()) or 1.0
    return torch.linalg.eigvalsh(M.double() / m) * m


def make_case(L, d, d_k, d_ff, batch, scale, kind="block", seed=0, ln_eps=0.0, **options):
    """Config (``options``: further :class:`blockhess.BlockConfig` keywords), float64 params, inputs
    ``X`` (``(L, d)`` if ``batch`` is None) at ``scale``, and the generator that drew ``X``."""
    cfg = bh.BlockConfig(d_model=d, d_ff=d_ff, d_k=d_k, kind=kind, ln_eps=ln_eps, **options)
    params = bh.init_params(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    shape = (L, d) if batch is None else (batch, L, d)
    X = scale * torch.randn(shape, generator=g, dtype=torch.float64)
    return cfg, params, X, g


@pytest.fixture(params=SIZES, ids=SIZE_IDS)
def grid_case(request):
    """Each entry of :data:`settings.SIZES` in turn."""
    return request.param


def randomize_vectors(params: dict, seed: int = 0) -> dict:
    """Biases and LayerNorm shifts drawn ``0.3·N(0, 1)``, scales ``1 + 0.5·N(0, 1)``: nothing hides
    behind the usual initial zeros and ones (``bh.init_params`` gives those)."""
    g = torch.Generator().manual_seed(seed + 7)
    out = dict(params)
    for k, v in params.items():
        if v.ndim == 1:
            r = torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.dtype)
            out[k] = 1 + 0.5 * r if k.startswith("gamma") else 0.3 * r
    return out


def make_model_case(row: dict, block_rows, seed: int = 0, scale: float = 1.0):
    """A model of the :data:`settings.MODEL_OPTIONS` assignment ``row`` (``n_blocks``, ``d_model``,
    ``tokens``, ``batch`` and ``loss`` included) whose block ``i`` takes the options ``block_rows[i]``
    (:class:`blockhess.BlockConfig` keywords beyond the sizes), at the sizes of
    :data:`settings.MODEL_SIZES` and :data:`settings.PATCH_IMAGES` (``n_positions``: one row more than
    the sequence uses). Returns ``(cfg, params, inputs, loss, target)``: float64 params from
    :func:`blockhess.init_params` with their vectors randomized (:func:`randomize_vectors`), batched
    inputs (features and ``X_0`` at ``scale``), the loss as :func:`blockhess.hessian` takes it
    (:data:`settings.LOSSES`) and its target: CE classes ``(B,)`` pooled or ``(B, L)``, otherwise
    standard normal of the output's shape."""
    S, d, n, B = MODEL_SIZES, row["d_model"], row["tokens"], row["batch"]
    blocks = tuple(bh.BlockConfig(d_model=d, d_ff=S["d_ff"], d_k=S["d_k"][i % len(S["d_k"])], **b)
                   for i, b in enumerate(block_rows))
    assert len(blocks) == row["n_blocks"]
    kw = {k: row[k] for k in ("embedding", "embed_bias", "cls_token", "positions", "token_types", "embed_norm",
                              "final_norm", "norm_affine", "norm_bias", "norm_eps", "pool", "head_bias")}
    L = n + int(row["cls_token"])
    if row["embedding"] == "linear":
        kw["d_in"] = S["d_in"]
    elif row["embedding"] == "patch":
        kw["image"], kw["patch"] = PATCH_IMAGES[n]
    elif row["embedding"] == "token":
        kw["vocab"] = S["vocab"]
    if row["positions"] == "learned":
        kw["n_positions"] = L + 1
    if row["head"] == "linear":
        kw["head"] = S["head"]
    elif row["head"] == "tied":
        kw.update(head=S["vocab"], tied=True)
    cfg = bh.ModelConfig(blocks=blocks, **kw)
    params = randomize_vectors(bh.init_params(cfg, seed=seed), seed)
    g = torch.Generator().manual_seed(seed + 100)
    if cfg.embedding == "token":
        inputs = torch.randint(0, cfg.vocab, (B, n), generator=g)
    elif cfg.embedding == "patch":
        inputs = scale * torch.randn((B, *cfg.image), generator=g, dtype=torch.float64)
    else:
        inputs = scale * torch.randn(B, n, cfg.d_in if cfg.embedding == "linear" else d, generator=g, dtype=torch.float64)
    out = (B, cfg.n_out) if cfg.pool != "none" else (B, L, cfg.n_out)
    if row["loss"] == "ce":
        target = torch.randint(0, cfg.n_out, out[:-1], generator=g)
    else:
        target = torch.randn(out, generator=g, dtype=torch.float64)
    return cfg, params, inputs, LOSSES[row["loss"]], target
