"""Bad input -> ValueError naming the argument and what was expected, before any work."""

import dataclasses
import json
import math

import pytest
import torch

import blockhess as bh

from conftest import TOL, assert_close, make_case, rel_err
from settings import DTYPES, LAYERNORM_TINY_EPS, NORMS


@pytest.fixture
def case():
    cfg, p, X, g = make_case(3, 4, 2, 5, 2, 1.0)
    return cfg, p, X, torch.randn(X.shape, generator=g, dtype=torch.float64)


def test_shapes_dtypes_devices(case):
    cfg, p, X, T = case
    with pytest.raises(ValueError, match=r"X must have shape \(L, 4\)"):
        bh.hessian(p, X[..., :3], cfg, target=T)
    with pytest.raises(ValueError, match="X must have 2 or 3 dimensions"):
        bh.forward(p, X[None], cfg)
    with pytest.raises(ValueError, match=r"params\['W_Q'\] must have shape"):
        bh.hessian({**p, "W_Q": p["W_Q"].T}, X, cfg, target=T)
    with pytest.raises(ValueError, match=r"params\['W_1'\] has dtype torch.float32"):
        bh.jacobian({**p, "W_1": p["W_1"].float()}, X, cfg)
    with pytest.raises(ValueError, match="missing \\['W_2'\\]"):
        bh.forward({k: v for k, v in p.items() if k != "W_2"}, X, cfg)
    with pytest.raises(ValueError, match="must be float32 or float64"):
        bh.forward(p, X.long(), cfg)
    for empty in ((0, 4), (2, 0, 4), (0, 3, 4)):
        with pytest.raises(ValueError, match=r"with L >= 1 and B >= 1, got \(" + ", ".join(map(str, empty))):
            bh.forward(p, X.new_zeros(empty), cfg)
    for half in (torch.float16, torch.bfloat16):  # accepted before, and 0.2% / 5% off
        with pytest.raises(ValueError, match=f"X must be float32 or float64, got {half}"):
            bh.hessian({k: v.to(half) for k, v in p.items()}, X.to(half), cfg, loss="mse", target=X.to(half))
        with pytest.raises(ValueError, match="init_params: dtype must be a floating dtype, float32 or float64"):
            bh.init_params(cfg, dtype=half)
    with pytest.raises(ValueError, match="cfg must be a BlockConfig"):
        bh.forward(p, X, {"d_model": 4})


def test_nan_inf(case):
    cfg, p, X, T = case
    Xn = X.clone()
    Xn[0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="X contains NaN or Inf"):
        bh.hessian(p, Xn, cfg, target=T)
    with pytest.raises(ValueError, match=r"params\['W_V'\] contains NaN or Inf"):
        bh.hessian({**p, "W_V": p["W_V"] * float("inf")}, X, cfg, target=T)
    with pytest.raises(ValueError, match="target contains NaN"):
        bh.hessian(p, X, cfg, target=T * float("nan"))


def test_finite_check_names_the_tensor_and_tolerates_overflowing_sums():
    from blockhess.validation import check_finite

    big = torch.full((4,), 3e38)  # finite, but its sum overflows float32
    check_finite({"a": big, "b": big})
    bad = big.clone()
    bad[2] = float("-inf")
    with pytest.raises(ValueError, match="^b contains NaN or Inf"):
        check_finite({"a": big, "b": bad})


def test_overflow_inside_the_block_is_an_error(case):
    cfg, p, X, T = case
    p32 = {k: v.float() for k, v in p.items()}
    with pytest.raises(ValueError, match=r"LayerNorm-1 input X \+ SA\(X\) contains NaN or Inf: the forward pass overflowed"):
        bh.hessian(p32, X.float() * 1e19, cfg, target=T.float())  # finite inputs, attention scores overflow float32


@pytest.mark.parametrize("kind", ["pre-LN", "attention"])
def test_overflow_after_the_last_layernorm_is_an_error(kind):
    """Pre-LN's output S = Y + FFN(Y) and the bare attention layer have no LayerNorm after them:
    the output itself is checked."""
    cfg = bh.BlockConfig(d_model=4, d_ff=5, norm="pre") if kind == "pre-LN" else bh.BlockConfig(d_model=4, kind="attention")
    p = {k: v.float() for k, v in bh.init_params(cfg).items()}
    for n in ("W_1", "W_2") if kind == "pre-LN" else ("W_V",):
        p[n] = p[n] * 1e20  # finite weights whose products overflow float32
    X = torch.randn(3, 4) * (1.0 if kind == "pre-LN" else 1e20)
    with pytest.raises(ValueError, match="the block output contains NaN or Inf: the forward pass overflowed torch.float32"):
        bh.hessian(p, X, cfg, target=torch.zeros(3, 4))


@pytest.mark.parametrize("dtype, scale", [(torch.float64, 1e-155), (torch.float32, 1e-20)])
def test_underflowing_variance_is_an_error(case, dtype, scale):
    """Rows so small that 1/sigma^2 overflows: an error, not a Hessian of NaN (and not 'zero variance')."""
    cfg, p, X, T = case
    q = {k: v.to(dtype) for k, v in p.items()}
    with pytest.raises(ValueError, match=r"LayerNorm-1 input X \+ SA\(X\): the variance of LayerNorm input row .* below"):
        bh.hessian(q, (X * scale).to(dtype), cfg, target=T.to(dtype))
    H = bh.hessian(q, (X * scale * 1e12).to(dtype), cfg, target=T.to(dtype))  # small but representable
    assert torch.isfinite(H.dense()).all()


def test_zero_variance_layernorm_row():
    cfg = bh.BlockConfig(d_model=4, d_ff=5, kind="block")
    p = bh.init_params(cfg)
    p["W_V"] = torch.zeros(4, 4, dtype=torch.float64)  # X + SA(X) = X
    X = torch.randn(3, 4, dtype=torch.float64)
    X[1] = 0.7  # a constant token row: LN_1 input has zero variance
    with pytest.raises(ValueError, match=r"LayerNorm-1 input X \+ SA\(X\): LayerNorm input row \(1,\) has zero variance.*Assumption 2"):
        bh.hessian(p, X, cfg, target=torch.zeros_like(X))
    Xb = torch.randn(3, 3, 4, dtype=torch.float64)
    Xb[2, 1] = 0.7  # in a batch the row is named by (sequence, token), as in X
    with pytest.raises(ValueError, match=r"LayerNorm input row \(2, 1\) has zero variance"):
        bh.hessian(p, Xb, cfg, target=torch.zeros_like(Xb))
    cfg_eps = bh.BlockConfig(d_model=4, d_ff=5, ln_eps=1e-5)
    bh.hessian(p, X, cfg_eps, target=torch.zeros_like(X))  # eps > 0 makes it well defined


def _constant_row(dtype, eps, c, norm="post"):
    """The block with ``W_V = 0`` (post-LN: LN_1's input is X) and token row 1 of X constant at ``c``;
    float64 inputs and weights, and ``dtype``'s copies."""
    cfg = bh.BlockConfig(d_model=4, d_ff=5, ln_eps=eps, norm=norm)
    p = bh.init_params(cfg, seed=0)
    p["W_V"] = torch.zeros_like(p["W_V"])
    X = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    X[1] = c
    T = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return cfg, p, X, T, {k: v.to(dtype) for k, v in p.items()}, X.to(dtype), T.to(dtype)


def _entry_points(p, X, cfg, T):
    return {"forward": lambda: bh.forward(p, X, cfg), "jacobian": lambda: bh.jacobian(p, X, cfg),
            "input_jacobian": lambda: bh.input_jacobian(p, X, cfg),
            "second_derivative": lambda: bh.second_derivative(p, X, cfg, "W_Q", "W_V"),
            "hessian": lambda: bh.hessian(p, X, cfg, target=T).dense()}


def _finite(result) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in (result.values() if isinstance(result, dict) else [result]))


@pytest.mark.parametrize("dtype, eps", LAYERNORM_TINY_EPS)
def test_tiny_ln_eps_on_a_constant_row_is_refused_or_exact(dtype, eps):
    """A constant row at 0.7 (its centred entries are rounding, which 1/sigma = eps^-1/2 blows up) is
    refused up front by every entry point; a row of zeros is exact, refused only where var + eps is
    below tiny/e (float64 1e-300); otherwise the results are finite and right, and the post-LN
    Hessian, whose true entries (~1/eps^2) overflow, is a named error, not a matrix of NaN."""
    cfg, p, X, T, q, Xq, Tq = _constant_row(dtype, eps, 0.7)
    for name, f in _entry_points(q, Xq, cfg, Tq).items():
        with pytest.raises(ValueError, match=r"LayerNorm-1 input X \+ SA\(X\): LayerNorm input row \(1,\) is constant to the "
                                             r"rounding of its values .* use ln_eps > "):
            f()
    cfg, p, X, T, q, Xq, Tq = _constant_row(dtype, eps, 0.0)
    if eps == 1e-300:
        for name, f in _entry_points(q, Xq, cfg, Tq).items():
            with pytest.raises(ValueError, match=r"the variance of LayerNorm input row \(1,\) plus ln_eps is 1e-300, below 1e-292"):
                f()
        return
    for name, f in _entry_points(q, Xq, cfg, Tq).items():
        if name == "hessian":
            with pytest.raises(ValueError, match=f"the Hessian contains NaN or Inf: a value overflowed {dtype}"):
                f()
        else:
            assert _finite(f()), name
    assert _beyond(dtype, bh.reference.hessian(p, X, cfg, target=T).dense())  # a true overflow
    _assert_jacobian_right(q, Xq, p, X, cfg)  # entries of 1/eps in row 1


def _assert_jacobian_right(q, Xq, p, X, cfg):
    """All weights' Jacobians side by side against autograd's: float64 to the rule, float32 within 3x
    of float32 autograd's own error."""
    J, R, R32 = (torch.cat([v.double() for v in f(*a, cfg).values()], -1)
                 for f, a in ((bh.jacobian, (q, Xq)), (bh.reference.jacobian, (p, X)), (bh.reference.jacobian, (q, Xq))))
    J, R, R32 = (M / R.abs().max() for M in (J, R, R32))  # entries up to 1e200: their squares would overflow the norm
    # float32: 3x autograd's error, or 3 roundings where autograd's is below one (1e-30: 2e-8; the chain J_Z J_SY J_Y
    # of row 1, entries ~1/eps, is four float32 products, 8e-8 off)
    tol = TOL if Xq.dtype == torch.float64 else 3 * max(rel_err(R32, R), torch.finfo(torch.float32).eps)
    assert_close(J, R, tol=tol, what="Jacobian")


def _beyond(dtype, R: torch.Tensor) -> bool:
    """Whether the float64 reference ``R`` has entries beyond ``dtype``'s range (or overflows float64 itself)."""
    return not _finite(R) or float(R.abs().max()) > torch.finfo(dtype).max


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
def test_ln_eps_just_either_side_of_the_constant_row_threshold(dtype, norm):
    """A row constant at 1.0 needs var + ln_eps above its values' squared rounding e^2 (plus tiny/e):
    just below it is refused, just above the Hessian is finite and right."""
    fi = torch.finfo(dtype)
    threshold = fi.tiny / fi.eps + fi.eps**2
    cfg, p, X, T, q, Xq, Tq = _constant_row(dtype, 0.9 * threshold, 1.0, norm)
    with pytest.raises(ValueError, match=r"LayerNorm input row \(1,\) is constant to the rounding of its values"):
        bh.hessian(q, Xq, cfg, target=Tq)
    cfg, p, X, T, q, Xq, Tq = _constant_row(dtype, 1.1 * threshold, 1.0, norm)
    H, R = bh.hessian(q, Xq, cfg, target=Tq).dense().double(), bh.reference.hessian(p, X, cfg, target=T).dense()
    own = rel_err(bh.reference.hessian(q, Xq, cfg, target=Tq).dense().double(), R)
    assert_close(H, R, tol=TOL if dtype == torch.float64 else 3 * own, what="Hessian")  # float32: 3x float32 autograd


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
def test_ln_eps_just_either_side_of_the_overflow_threshold(dtype, norm):
    """A row of zeros needs ln_eps >= tiny/e (1/sigma^2 representable with 4/e to spare): just below it
    is refused; just above, Jacobians are finite and right, and the Hessian is finite (pre-LN) or, where
    its true entries overflow (post-LN: ~1/ln_eps^2, autograd's too), a named error."""
    fi = torch.finfo(dtype)
    threshold = fi.tiny / fi.eps
    cfg, p, X, T, q, Xq, Tq = _constant_row(dtype, 0.9 * threshold, 0.0, norm)
    for name, f in _entry_points(q, Xq, cfg, Tq).items():
        with pytest.raises(ValueError, match=r"the variance of LayerNorm input row \(1,\) plus ln_eps is .*, below "):
            f()
    cfg, p, X, T, q, Xq, Tq = _constant_row(dtype, 1.1 * threshold, 0.0, norm)
    _assert_jacobian_right(q, Xq, p, X, cfg)
    if norm == "post":
        with pytest.raises(ValueError, match=f"the Hessian contains NaN or Inf: a value overflowed {dtype}"):
            bh.hessian(q, Xq, cfg, target=Tq)
        assert _beyond(dtype, bh.reference.hessian(p, X, cfg, target=T).dense())
    else:  # autograd's Hessian is NaN here (it forms 1/sigma^3 = inf times a zero), so it is taken at ln_eps = 1e-20:
        # row 1's LN_2 output is 0 and ReLU's derivative there 0, so only the other rows see ln_eps, 1e-20 of their variance
        H = bh.hessian(q, Xq, cfg, target=Tq).dense().double()
        ref = bh.BlockConfig(d_model=4, d_ff=5, ln_eps=1e-20, norm=norm)
        R, R32 = bh.reference.hessian(p, X, ref, target=T).dense(), bh.reference.hessian(q, Xq, ref, target=Tq).dense()
        assert_close(H, R, tol=TOL if dtype == torch.float64 else 3 * rel_err(R32.double(), R), what="Hessian")


def test_losses_and_targets(case):
    cfg, p, X, T = case
    with pytest.raises(ValueError, match="loss must be 'mse', 'ce' or a callable"):
        bh.hessian(p, X, cfg, loss="mae", target=T)
    with pytest.raises(ValueError, match="target is required"):
        bh.hessian(p, X, cfg, loss="mse")
    with pytest.raises(ValueError, match="target must have the shape of the output"):
        bh.hessian(p, X, cfg, loss="mse", target=T[0])
    with pytest.raises(ValueError, match="integer tensor of class indices"):
        bh.hessian(p, X, cfg, loss="ce", target=T)
    with pytest.raises(ValueError, match=r"target must have shape \(2, 3\)"):
        bh.hessian(p, X, cfg, loss="ce", target=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"classes must lie in \[0, 3\]"):
        bh.hessian(p, X, cfg, loss="ce", target=torch.full((2, 3), 4))
    with pytest.raises(ValueError, match="leading axis of size 2"):
        bh.hessian(p, X, cfg, loss=lambda Z, t: Z.sum(), target=torch.zeros(5))
    with pytest.raises(ValueError, match="wrt must be a non-empty subset"):
        bh.hessian(p, X, cfg, target=T, wrt=["W_O"])
    with pytest.raises(ValueError, match=r"'linear1.weight' is PyTorch's W_1, transposed .*to_module"):
        bh.hessian(p, X, cfg, target=T, wrt=["W_2", "linear1.weight"])
    with pytest.raises(ValueError, match=r"'in_proj_weight' is PyTorch's W_Q, W_K, W_V stacked \(each transposed\)"):
        bh.jacobian(p, X, cfg, wrt="in_proj_weight")
    with pytest.raises(ValueError, match=r"wrt must be None, a parameter name or a list of names from \[.*\], got 3"):
        bh.jacobian(p, X, cfg, wrt=3)
    assert list(bh.jacobian(p, X, cfg, wrt=p.keys())) == list(p)  # any iterable of names
    with pytest.raises(ValueError, match=r"b must be one parameter name of \[.*\], got \['W_2'\]"):
        bh.second_derivative(p, X[0], cfg, "W_1", ["W_2"])
    for f in (bh.hessian, bh.reference.hessian):
        with pytest.raises(ValueError, match="wrt_input must be True or False, got 'yes'"):
            f(p, X, cfg, target=T, wrt_input="yes")
    H = bh.hessian(p, X, cfg, target=T)
    with pytest.raises(KeyError, match="index a HessianBlocks by a pair of names"):
        H["W_Q"]
    with pytest.raises(KeyError, match="unknown parameter 'W_O'"):
        H["W_Q", "W_O"]
    # one sequence: the shapes in the message are the caller's, without the added batch axis
    with pytest.raises(ValueError, match=r"shape of the output \(3, 4\) for loss='mse', got \(4,\)$"):
        bh.hessian(p, X[0], cfg, loss="mse", target=T[0, 0])
    with pytest.raises(ValueError, match=r"target must have shape \(3,\) for loss='ce', got \(2,\)$"):
        bh.hessian(p, X[0], cfg, loss="ce", target=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"scalar \(0-dim\) tensor for one sequence Z of shape \(3, 4\), got shape \(4,\)"):
        bh.hessian(p, X, cfg, loss=lambda Z, t: Z.sum(0))
    with pytest.raises(ValueError, match="NaN or Inf value, gradient or Hessian w.r.t. Z at sequence 1"):
        bh.hessian(p, X, cfg, loss=lambda Z, t: Z.sum() / t, target=torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"loss could not be differentiated by torch.func .*\.item\(\)"):
        bh.hessian(p, X, cfg, loss=lambda Z, t: Z.sum() * Z.max().item(), target=torch.zeros(2))
    # a value that is not finite although its derivatives w.r.t. Z are (log 0 is a constant in Z)
    with pytest.raises(ValueError, match="NaN or Inf value, gradient or Hessian w.r.t. Z at sequence 1"):
        bh.hessian(p, X, cfg, loss=lambda Z, t: (Z**2).sum() + torch.log(t), target=torch.tensor([1.0, 0.0]))


def test_config_errors():
    with pytest.raises(ValueError, match="BlockConfig.d_model must be an int >= 1, got 0"):
        bh.BlockConfig(d_model=0)
    for bad in (True, 4.0):  # a bool or a float is not a size
        with pytest.raises(ValueError, match="BlockConfig.d_model must be an int >= 1"):
            bh.BlockConfig(d_model=bad)
    with pytest.raises(ValueError, match="BlockConfig.d_k must be an int >= 1"):
        bh.BlockConfig(d_k=0)
    with pytest.raises(ValueError, match="BlockConfig.ln_eps must be a finite float >= 0, got True"):
        bh.BlockConfig(ln_eps=True)
    with pytest.raises(ValueError, match="ln_eps=1e-05 has no meaning for kind='attention'"):
        bh.BlockConfig(kind="attention", ln_eps=1e-5)
    with pytest.raises(ValueError, match="seed must be an int >= 0, got None"):
        bh.init_params(bh.BlockConfig(), seed=None)
    with pytest.raises(ValueError, match="kind must be one of"):
        bh.BlockConfig(kind="mlp")
    with pytest.raises(ValueError, match="ln_eps must be a finite float >= 0"):
        bh.BlockConfig(ln_eps=-1e-5)
    with pytest.raises(ValueError, match="init_params: dtype must be a floating dtype"):
        bh.init_params(bh.BlockConfig(), dtype=torch.int32)


def test_dense_hessian_too_large_is_refused_before_allocating(monkeypatch):
    import psutil

    class Tiny:
        available = 10_000

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny)
    cfg, p, X, g = make_case(3, 4, 2, 5, None, 1.0)
    bh.hessian(p, X, cfg, target=torch.zeros_like(X))  # under validation.SMALL_BYTES: not checked
    monkeypatch.setattr(bh.validation, "SMALL_BYTES", 0)
    with pytest.raises(bh.InsufficientMemoryError, match=r"the dense 72x72 Hessian would need 41,472 bytes"):
        bh.hessian(p, X, cfg, target=torch.zeros_like(X))
    Tiny.available = 10**6
    bh.jacobian(p, X, cfg)  # 6,912 bytes fit, with the forward cache and factors (tests/test_memory.py)
    Tiny.available = 5_000
    with pytest.raises(bh.InsufficientMemoryError, match=r"the dense Jacobians \(12 x 72\) would need 6,912 bytes"):
        bh.jacobian(p, X, cfg)


def test_init_params_options_keep_the_papers_matrices():
    """Options that add weights (biases, W_O, affine LayerNorm) draw after the paper's matrices."""
    paper = bh.init_params(bh.BlockConfig(d_model=4, d_ff=6), seed=3)
    rich = bh.init_params(bh.BlockConfig(d_model=4, d_ff=6, bias=True, out_proj=True, ln_affine=True), seed=3)
    for k, v in paper.items():
        assert torch.equal(rich[k], v), k
    assert list(rich) == list(bh.param_shapes(bh.BlockConfig(d_model=4, d_ff=6, bias=True, out_proj=True, ln_affine=True)))


def test_dense_layouts_count_their_batch(monkeypatch):
    """The memory check of a dense LayerNorm or softmax derivative counts every sequence of a batch."""
    from blockhess.layers import layernorm, softmax

    seen = []
    for mod in (softmax, layernorm):
        monkeypatch.setattr(mod, "check_fits", lambda n, *a: seen.append(n))
    A = torch.softmax(torch.randn(5, 2, 3, dtype=torch.float64), -1)
    softmax.jacobian(A)
    softmax.hessian(A)
    layernorm.jacobian(torch.randn(5, 2, 3, dtype=torch.float64))
    layernorm.hessian(torch.randn(5, 2, 3, dtype=torch.float64))
    size = 5 * 2 * 3 * 8  # bytes of A and of X: 5 batches of 2 rows of 3
    # each dense layout counted per batch, with its compact row- or token-wise blocks and their temporaries
    assert seen == [3 * size * 3 + 5 * 6**2 * 8, 4 * size * 3**2 + 5 * 6**3 * 8,
                    2 * size * 3 + 5 * 6**2 * 8, 4 * size * 3**2 + 5 * 6**3 * 8]


def test_layernorm_variance_boundaries():
    from blockhess.validation import check_ln_variance

    fi = torch.finfo(torch.float64)
    small = fi.tiny / fi.eps
    ok = torch.tensor([[1.0, -1.0]], dtype=torch.float64) * math.sqrt(1.2 * small)  # variance 1.2 tiny/eps
    check_ln_variance("X", ok, 0.0)
    with pytest.raises(ValueError, match=r"is [^,]+, below "):
        check_ln_variance("X", ok / 2, 0.0)
    with pytest.raises(ValueError, match="variance"):  # its variance overflows (var_mean: -inf)
        check_ln_variance("X", torch.tensor([[fi.max, -fi.max]], dtype=torch.float64), 1e-5)
    with pytest.raises(ValueError, match="variance"):  # a mean of 1e300: the message's own arithmetic must not overflow
        bh.layernorm.jacobian(torch.full((2, 4), 1e300, dtype=torch.float64))
    with pytest.raises(ValueError, match="ln_eps must be a finite float >= 0, got inf"):
        bh.BlockConfig(ln_eps=float("inf"))


def test_ints_stay_ints_and_flags_stay_flags():
    import numpy as np

    cfg = bh.BlockConfig(d_model=np.int64(4), d_ff=np.int32(6), ln_eps=np.float32(1e-5))
    assert type(cfg.d_model) is int and type(cfg.d_ff) is int and type(cfg.ln_eps) is float  # JSON-serialisable
    json.dumps(dataclasses.asdict(cfg))
    with pytest.raises(ValueError, match="BlockConfig.bias must be True or False, got 1"):
        bh.BlockConfig(bias=1)
    cfg, p, X, g = make_case(3, 4, 2, 5, None, 1.0)
    with pytest.raises(ValueError, match="wrt must be None, a parameter name or a list of names"):
        bh.hessian(p, X, cfg, target=torch.zeros_like(X), wrt=[1])


def test_cuda_memory_check_counts_the_allocators_unused_cache(monkeypatch):
    """On CUDA the memory freed into PyTorch's cache is available to the next request (no GPU
    needed: the device queries are replaced)."""
    from blockhess.validation import check_fits

    GiB = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * GiB)
    check_fits(5 * GiB - 1, "five GiB", "cuda")  # 1 free + 4 cached unused
    with pytest.raises(bh.InsufficientMemoryError, match=r"five GiB would need 5,368,709,121 bytes .* 5,368,709,120 bytes .* on cuda"):
        check_fits(5 * GiB + 1, "five GiB", "cuda")


def test_tf32_warning(monkeypatch):
    """float32 on CUDA with TF32 matrix products warns; float64, the CPU, or TF32 off do not."""
    import warnings

    from blockhess import validation

    monkeypatch.setattr(validation, "tf32_enabled", lambda: True)
    with pytest.warns(UserWarning, match=r"TF32 .*set_float32_matmul_precision\('highest'\)"):
        validation.warn_tf32(torch.float32, "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validation.warn_tf32(torch.float64, "cuda")
        validation.warn_tf32(torch.float32, "cpu")
        monkeypatch.setattr(validation, "tf32_enabled", lambda: False)
        validation.warn_tf32(torch.float32, "cuda")


def test_layernorm_2_rows_are_named_as_in_X():
    """A zero-variance LayerNorm-2 input (post-LN: FFN(Y) = -Y, pre-LN: X + b_O constant) is named
    by (sequence, token) in a batch, by hessian and block_bounds alike; an all-zero row is a
    zero-variance row (Assumption 2), not an underflow."""
    d = 3
    cfg = bh.BlockConfig(d_model=d, d_ff=2 * d)
    p = bh.init_params(cfg, seed=0)
    eye = torch.eye(d, dtype=torch.float64)
    p["W_1"], p["W_2"] = torch.cat([eye, -eye], 1), torch.cat([-eye, eye], 0)  # relu(y) - relu(-y) = y, negated
    X = torch.randn(2, 3, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for f in (bh.hessian, bh.bounds.block_bounds):
        with pytest.raises(ValueError, match=r"LayerNorm-2 input Y \+ FFN\(Y\): LayerNorm input row \(0, 0\) has zero variance"):
            f(p, X, cfg, "mse", torch.zeros_like(X))
    pre = bh.BlockConfig(d_model=d, d_ff=4, norm="pre", bias=True, out_proj=True)
    q = bh.init_params(pre, seed=0)
    q["W_V"] = torch.zeros(d, d, dtype=torch.float64)  # attention output = b_O, so Y = X + b_O
    q["b_V"] = torch.zeros(d, dtype=torch.float64)
    q["b_O"] = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64)
    Xp = torch.randn(2, 3, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    Xp[1, 2] = 5.0 - q["b_O"]  # not constant itself, but X + b_O is
    with pytest.raises(ValueError, match=r"LayerNorm-2 input Y = X \+ SA\(LN_1\(X\)\), pre-LN: LayerNorm input row \(1, 2\) has zero"):
        bh.hessian(q, Xp, pre, target=torch.zeros_like(Xp))
    Xz = X.clone()
    Xz[1, 1] = 0.0
    p["W_V"] = torch.zeros(d, d, dtype=torch.float64)  # LN_1 input = X
    with pytest.raises(ValueError, match=r"LayerNorm-1 input X \+ SA\(X\): LayerNorm input row \(1, 1\) has zero variance"):
        bh.hessian(p, Xz, cfg, target=torch.zeros_like(Xz))


def test_tf32_check_runs_on_every_input_and_points_at_the_callers_line(monkeypatch):
    """check_inputs passes X's dtype and device to warn_tf32; the warning names the user's line."""
    from blockhess import validation
    from blockhess.block import forward_pass as block

    seen = []
    monkeypatch.setattr(block, "warn_tf32", lambda dtype, device: seen.append((dtype, device)))
    cfg = bh.BlockConfig(d_model=4, d_ff=6)
    p = bh.init_params(cfg, dtype=torch.float32)
    X = torch.randn(2, 3, 4)
    bh.hessian(p, X, cfg, target=torch.zeros_like(X))
    assert seen and seen[0] == (torch.float32, X.device)
    monkeypatch.setattr(validation, "tf32_enabled", lambda: True)
    monkeypatch.setattr(block, "warn_tf32", lambda dtype, device: validation.warn_tf32(torch.float32, "cuda"))
    with pytest.warns(UserWarning, match="TF32") as rec:
        bh.hessian(p, X, cfg, target=torch.zeros_like(X))
    assert rec[0].filename == __file__


def test_callable_loss_memory_is_checked_and_out_of_memory_not_relabelled(monkeypatch):
    from blockhess import losses

    cfg = bh.BlockConfig(d_model=4, d_ff=6)
    p = bh.init_params(cfg)
    X = torch.randn(2, 3, 4, dtype=torch.float64)
    seen = []
    monkeypatch.setattr(losses, "check_fits", lambda n, what, device: seen.append((n, what)))
    bh.hessian(p, X, cfg, loss=lambda Z, t: (Z**2).sum(), target=None)
    F = 12 * 8  # what autograd saves for the loss: Z itself (for Z**2), 96 bytes, carried by each of 12 tangents
    per_sequence = 12 * (losses.TANGENT_COPIES * F + losses.SQUARE_COPIES * 12 * 8)
    assert seen == [(2 * 12**2 * 8 + 2 * per_sequence, "the 2 per-sequence (12x12) Hessians of the loss and "
                     "torch.func's work space for 2 of them at a time (estimated from the loss's own intermediates)")]

    def no_memory(*a, **k):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    monkeypatch.setattr(torch.func, "vmap", lambda *a, **k: no_memory)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        bh.hessian(p, X, cfg, loss=lambda Z, t: (Z**2).sum(), target=None)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_an_rmsnorm_zero_row_is_named_as_rmsnorm(norm):
    """A zero input row of an RMSNorm with eps = 0: the message names the RMSNorm and its mean square."""
    cfg = bh.BlockConfig(d_model=4, d_ff=6, n_heads=2, norm=norm, norm_type="rms", ln_eps=0.0, ln_affine=True)
    p = bh.init_params(cfg, seed=0, dtype=torch.float64)
    X = torch.randn(3, 4, dtype=torch.float64)
    X[1] = 0  # pre-LN: LN_1 reads this row itself
    if norm == "post":
        p = {**p, "W_V": torch.zeros_like(p["W_V"])}  # X + SA(X) = X: the zero row reaches LN_1
    with pytest.raises(ValueError, match=r"RMSNorm input row \(1,\) has zero mean square and ln_eps=0"):
        bh.forward(p, X, cfg)
