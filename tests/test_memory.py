"""Memory guards: every allocation that grows with n², (L·d)² or tokens × width² is estimated
and refused (InsufficientMemoryError, with the bytes needed and available) before it is made;
the work is taken in chunks where it can be (batches, a callable loss's Hessians, the
contractions of a dense second derivative), and a chunked result is the unchunked one.

The refusals are proved without allocating: the available memory is replaced
(``psutil.virtual_memory`` as blockhess.validation reads it) and the computation that would
follow the check is replaced by one that fails the test."""

import importlib

import psutil
import pytest
import torch

import blockhess as bh
from blockhess import losses, reference
from blockhess.validation import saved_bytes

from conftest import assert_close, make_case
from settings import LOSSES

hess_mod = importlib.import_module("blockhess.hessian")  # the module (bh.hessian is the function)
block_mod = importlib.import_module("blockhess.block.forward_pass")
GiB = 2**30


def _available(monkeypatch, nbytes):
    class Memory:
        available = nbytes

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)


def _must_not_run(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran: the memory check came too late")

    return fail


def head_loss(classes, d, seed=0):
    """Cross-entropy of a linear classifier over the mean-pooled sequence (the digits ViT's head)."""
    W = torch.randn(d, classes, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) / d**0.5

    def loss(Z, y):
        return torch.nn.functional.cross_entropy((Z.mean(0) @ W)[None], y[None])

    return loss


def test_forward_forms_no_derivative_caches(monkeypatch):
    """bh.forward is a plain forward: no per-token LayerNorm or FFN Jacobian is formed."""
    from blockhess.layers import ffn, layernorm

    for norm in ("post", "pre"):
        cfg = bh.BlockConfig(d_model=6, d_ff=10, n_heads=2, norm=norm, bias=True, ln_affine=True, out_proj=True,
                             ln_eps=1e-5, activation="gelu")
        p = bh.init_params(cfg, seed=1)
        X = torch.randn(3, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        expected = bh.reference.forward(p, X, cfg)
        with monkeypatch.context() as m:
            m.setattr(layernorm, "per_token_jacobian", _must_not_run("a LayerNorm Jacobian"))
            m.setattr(ffn, "input_jacobian", _must_not_run("J_SY"))
            Z = bh.forward(p, X, cfg)
            c = block_mod.forward_cache(p, X, cfg, plain=True)
        assert_close(Z, expected, what=f"plain forward, {norm}-LN")
        assert c.E_Y is None and c.E_Z is None and c.J_SY is None and c.fc.J_n is None


def test_forward_refuses_scores_that_do_not_fit(monkeypatch):
    """A plain forward still holds every head's L × L scores and weights: 4 sequences of 16,384
    tokens with 4 heads need 64 GiB, refused before the forward pass."""
    cfg = bh.BlockConfig(d_model=16, d_ff=32, n_heads=4)
    p = bh.init_params(cfg)
    X = torch.zeros(4, 16384, 16, dtype=torch.float64)
    _available(monkeypatch, 16 * GiB)
    monkeypatch.setattr(block_mod, "forward_cache", _must_not_run("the forward pass"))
    with pytest.raises(bh.InsufficientMemoryError, match=r"the forward pass over 65536 tokens would need [\d,]+ bytes \(64\.\d\d GiB\)"):
        bh.forward(p, X, cfg)


def test_hessian_refuses_one_long_sequence_before_its_forward(monkeypatch):
    """One 512-token sequence of a d_model = 512 block: its dense Hessian (n = 2,883,584) is
    refused at once, before the forward pass (which used to run first, for 24 s and 7 GiB)."""
    cfg = bh.BlockConfig(d_model=512, d_ff=2048)
    p = bh.init_params(cfg, dtype=torch.float32)
    X = torch.randn(512, 512)
    monkeypatch.setattr(hess_mod, "forward_cache", _must_not_run("the forward pass"))
    with pytest.raises(bh.InsufficientMemoryError, match=r"the dense 2883584x2883584 Hessian would need [\d,]+ bytes .* available"):
        bh.hessian(p, X, cfg, target=torch.zeros_like(X))


def test_hessian_refuses_a_pass_whose_factors_do_not_fit(monkeypatch):
    """A GPT-2-small-sized block (d_model 768, d_ff 3,072, 12 heads) at 1,024 tokens: the dense
    Hessian over b_2 is small, but the forward cache and per-token factors are hundreds of GiB
    (each head's W_K factor alone is 768² entries per token and level): refused before the
    forward pass, with the bytes needed (it used to die in the allocator)."""
    cfg = bh.BlockConfig(d_model=768, d_ff=3072, n_heads=12, bias=True, out_proj=True, ln_affine=True,
                         activation="gelu_tanh", ln_eps=1e-5)
    p = bh.init_params(cfg, dtype=torch.float32)
    X = torch.randn(1024, 768)
    _available(monkeypatch, 16 * GiB)
    monkeypatch.setattr(hess_mod, "forward_cache", _must_not_run("the forward pass"))
    with pytest.raises(bh.InsufficientMemoryError,
                       match=r"the dense 768x768 Hessian with a pass of the closed form over 1 sequence of 1024 tokens "
                             r"\(forward cache, per-token factors, work space\) would need [\d,]+ bytes") as err:
        bh.hessian(p, X, cfg, target=torch.zeros_like(X), wrt="b_2")
    needed = int(str(err.value).split(" would need ")[1].split(" bytes")[0].replace(",", ""))
    assert needed > 100 * GiB


def test_hessian_checks_the_pass_with_out_and_the_parts(monkeypatch):
    """With out= the result is not counted but the pass is; the parts are checked before their
    own passes; small requests are not checked at all (SMALL_BYTES)."""
    cfg, p, X, g = make_case(3, 4, 2, 5, 2, 1.0)
    T = torch.zeros_like(X)
    n = sum(v.numel() for v in p.values())
    H = bh.hessian(p, X, cfg, target=T)  # under 64 MiB: not checked
    monkeypatch.setattr(bh.validation, "SMALL_BYTES", 0)
    _available(monkeypatch, 1000)
    with pytest.raises(bh.InsufficientMemoryError, match=r"Hessian \(into out=\) with a pass .* over 2 sequences of 3 tokens"):
        bh.hessian(p, X, cfg, target=T, out=torch.empty(n, n, dtype=X.dtype))
    with pytest.raises(bh.InsufficientMemoryError, match=r"the outer part of the Hessian \(72x72, in blocks\) would need 41,472 bytes"):
        H.outer


def test_batch_passes_follow_the_estimate():
    """The passes of a batch hold about PASS_BYTES (or half the result) each, by the pass
    estimate of block.work_entries: 6 passes for the digits batch (B = 128), one per sequence
    for long sequences."""
    cfg = bh.BlockConfig(d_model=16, d_ff=32, ln_eps=1e-5)
    names = tuple(bh.param_shapes(cfg))
    X = torch.zeros(128, 16, 16, dtype=torch.float64)
    chunks = hess_mod._chunks(cfg, X, head_loss(10, 16), names)
    assert [c.start for c in chunks] == list(range(0, 128, chunks[0].stop)) and chunks[-1].stop == 128
    per_pass = 8 * chunks[0].stop * hess_mod._sequence_entries(cfg, X, head_loss(10, 16), names)
    assert per_pass <= hess_mod.PASS_BYTES < per_pass + 8 * hess_mod._sequence_entries(cfg, X, head_loss(10, 16), names)
    long = torch.zeros(4, 512, 16, dtype=torch.float64)  # 3·512² entries per token for the attention stage
    assert len(hess_mod._chunks(cfg, long, "mse", names)) == 4


def test_dense_jacobians_and_second_derivatives_are_checked_before_the_forward(monkeypatch):
    """bh.jacobian, bh.input_jacobian and bh.second_derivative count their result with the
    forward cache and factors, and refuse before the forward pass."""
    cfg, p, X, g = make_case(3, 4, 2, 5, 2, 1.0)
    monkeypatch.setattr(bh.validation, "SMALL_BYTES", 0)
    _available(monkeypatch, 10**9)
    J = bh.jacobian(p, X, cfg)  # fits
    n = sum(v.numel() for v in p.values())
    _available(monkeypatch, X.numel() * n * 8 + 100)  # the result alone fits, with the factors it does not
    monkeypatch.setattr(block_mod, "forward_cache", _must_not_run("the forward pass"))
    with pytest.raises(bh.InsufficientMemoryError, match=r"the dense Jacobians \(24 x 72\) with the forward cache and factors "
                                                         r"of 6 tokens would need"):
        bh.jacobian(p, X, cfg)
    _available(monkeypatch, 2 * 12**2 * 8 + 100)
    with pytest.raises(bh.InsufficientMemoryError, match=r"the 2 dense input Jacobians \(12x12\) with the forward cache and "
                                                         r"factors of 6 tokens would need"):
        bh.input_jacobian(p, X, cfg)
    _available(monkeypatch, 12 * 8 * 8 * 8 + 100)
    with pytest.raises(bh.InsufficientMemoryError, match=r"the dense d2/dW_QdW_K with the forward cache and factors would need"):
        bh.second_derivative(p, X[0], cfg, "W_Q", "W_K")
    assert J["W_Q"].shape == (2, 12, 8)


def test_second_derivative_in_chunks_of_contractions(monkeypatch):
    """The contractions of a dense second derivative are vmapped in chunks into one buffer: the
    same matrix as in one vmap, and as autograd's."""
    blocks = importlib.import_module("blockhess.block.second_order")
    cfg, p, X, g = make_case(3, 4, 2, 5, None, 1.0, ln_eps=1e-5)
    whole = bh.second_derivative(p, X, cfg, "W_K", "W_1")
    monkeypatch.setattr(blocks, "CONTRACT_BYTES", 0)  # one contraction per vmap
    parts = bh.second_derivative(p, X, cfg, "W_K", "W_1")
    assert torch.equal(parts, whole) or bool(((parts - whole).abs() <= 1e-15 * whole.abs().max()).all())
    # autograd: d2 Z_o / dW_K dW_1 for each output entry o (rows (o, i), o-major)
    def z_of(wk, w1):
        return bh.reference.forward({**p, "W_K": wk, "W_1": w1}, X, cfg).reshape(-1)

    ref = torch.func.jacrev(torch.func.jacrev(z_of, 0), 1)(p["W_K"], p["W_1"])  # (N, 4, 2, 4, 5)
    assert_close(parts, ref.reshape(12 * 8, 20), scale=ref.norm().item(), what="chunked d2Z/dW_K dW_1")


def test_reference_refuses_the_batch_that_the_kernel_killed(monkeypatch):
    """The reference on d = 64, d_ff = 128, B = 8, L = 32 w.r.t. W_Q, W_K, W_V (n = 12,288), which
    torch.func took to 24.3 GB in one call: now taken a sequence at a time, and refused before any
    derivative where even that does not fit (here: 4 GiB available)."""
    cfg = bh.BlockConfig(d_model=64, d_ff=128)
    p = bh.init_params(cfg)
    X = torch.randn(8, 32, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    _available(monkeypatch, 4 * GiB)
    monkeypatch.setattr(reference, "_add_chunk", _must_not_run("torch.func"))
    with pytest.raises(bh.InsufficientMemoryError, match=r"torch.func.hessian of the loss over 12288 variables, 1 of the 8 "
                                                         r"sequences at a time, .* would need [\d,]+ bytes \([\d.]+ GiB\) but only "
                                                         r"4,294,967,296 bytes"):
        reference.hessian(p, X, cfg, target=torch.zeros_like(X), wrt=["W_Q", "W_K", "W_V"])


def test_reference_takes_the_digits_batch_in_chunks(monkeypatch):
    """The README's digits batch (128 images, n = 1,792, a classifier head as the callable loss)
    needed more than 14 GB in one torch.func call; the reference now takes it in chunks whose
    estimate is a few hundred MiB (here the chunks are recorded, not computed)."""
    cfg = bh.BlockConfig(d_model=16, d_ff=32, ln_eps=1e-5)
    p = bh.init_params(cfg)
    X = torch.randn(128, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (128,), generator=torch.Generator().manual_seed(1))
    checked, rows = [], []
    monkeypatch.setattr(reference, "check_fits", lambda nbytes, what, device: checked.append(nbytes))
    monkeypatch.setattr(reference, "_add_chunk", lambda *args: rows.append(args[9]))
    reference.hessian(p, X, cfg, loss=head_loss(10, 16), target=y)
    assert rows[0].start == 0 and rows[-1].stop == 128 and all(a.stop == b.start for a, b in zip(rows, rows[1:]))
    assert len(rows) > 1 and checked[-1] < GiB / 2


@pytest.mark.parametrize("loss", LOSSES)  # "custom": a pooled head here (its own target)
def test_reference_in_chunks_is_the_reference_in_one(loss, monkeypatch):
    """A sequence per chunk (CHUNK_BYTES = 0) gives the Hessian and parts of one call, and of the
    closed form; the Jacobians likewise."""
    cfg, p, X, g = make_case(3, 4, 2, 5, 5, 1.0, ln_eps=1e-5)
    target = {"mse": torch.randn(X.shape, generator=g, dtype=X.dtype), "ce": torch.randint(0, 4, (5, 3), generator=g),
              "custom": torch.randint(0, 3, (5,), generator=g)}[loss]
    fn = head_loss(3, 4) if loss == "custom" else loss
    one = reference.hessian(p, X, cfg, loss=fn, target=target, wrt=["W_Q", "W_1"])
    monkeypatch.setattr(reference, "CHUNK_BYTES", 0)
    chunked = reference.hessian(p, X, cfg, loss=fn, target=target, wrt=["W_Q", "W_1"])
    closed = bh.hessian(p, X, cfg, loss=fn, target=target, wrt=["W_Q", "W_1"])
    s = one.dense().norm().item()
    for part in (lambda h: h, lambda h: h.outer, lambda h: h.functional):
        assert_close(part(chunked).dense(), part(one).dense(), scale=s, what="chunks vs one call")
        assert_close(part(closed).dense(), part(chunked).dense(), scale=s, what="closed form vs chunks")
    if loss == "mse":
        J = reference.jacobian(p, X, cfg)
        for k, v in bh.jacobian(p, X, cfg).items():
            assert_close(J[k], v, what=f"dZ/d{k}, chunked jacrev")
        assert_close(reference.input_jacobian(p, X, cfg), bh.input_jacobian(p, X, cfg), what="dZ/dX, chunked jacrev")


def test_callable_loss_hessians_in_groups_of_sequences(monkeypatch):
    """A wide classifier head's per-sequence Hessians are taken a group of sequences at a time,
    the group sized by the loss's own saved intermediates: a 4,096-class head counts far more
    work per sequence than a 10-class one, the groups give the one-call result, and a group that
    does not fit is refused before torch.func runs."""
    Z = torch.randn(6, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(1))
    wide, narrow = head_loss(4096, 8), head_loss(10, 8)
    assert losses.hessian_work_bytes(wide, y, Z) > 50 * losses.hessian_work_bytes(narrow, y, Z)
    assert losses.saved_loss_bytes(wide, y, Z) == 4096 * 8  # its log-probabilities, not its weights
    whole = losses.derivatives(wide, y, Z)
    monkeypatch.setattr(losses, "WORK_BYTES", 0)  # one sequence per group
    grouped = losses.derivatives(wide, y, Z)
    assert_close(grouped.hess, whole.hess, what="grouped loss Hessians")
    assert_close(grouped.grad, whole.grad, what="grouped loss gradients")
    monkeypatch.setattr(bh.validation, "SMALL_BYTES", 0)
    _available(monkeypatch, 6 * 32**2 * 8 + 1000)  # the Hessians fit, with a group's work space they do not
    monkeypatch.setattr(torch.func, "hessian", _must_not_run("torch.func.hessian"))
    with pytest.raises(bh.InsufficientMemoryError, match=r"the 6 per-sequence \(32x32\) Hessians of the loss and torch.func's "
                                                         r"work space for 1 of them at a time"):
        losses.derivatives(wide, y, Z)


def test_saved_bytes_counts_what_depends_on_the_inputs():
    """saved_bytes: what autograd keeps for the backward pass that depends on an input requiring
    grad (exp's output), each storage once; a constant weight (W) does not count."""
    W = torch.randn(4, 5, dtype=torch.float64)
    z = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out, nbytes = saved_bytes(lambda x: (x @ W).exp().sum(), z)
    assert nbytes == 3 * 5 * 8 and out.ndim == 0
    assert saved_bytes(lambda x: (x @ W).exp().sum(), z.detach())[1] == 0  # nothing requires grad


def test_bounds_check_their_dense_copies(monkeypatch):
    """exact_norms counts the float64 copies its eigenvalues take; ingredient_checks its dense
    ingredient matrices; both before computing them."""
    bounds = importlib.import_module("blockhess.bounds")
    cfg, p, X, g = make_case(3, 4, 2, 5, None, 1.0)
    H = bh.hessian(p, X, cfg, target=torch.zeros_like(X))
    seen = []
    monkeypatch.setattr(bounds, "check_fits", lambda nbytes, what, device: seen.append((nbytes, what)))
    bounds.exact_norms(H)
    assert seen[0] == (3 * 72 * 72 * 8, "the symmetrised float64 copies of the 72x72 Hessian for its eigenvalues")
    seen.clear()
    bounds.ingredient_checks(p, X, cfg)
    assert seen[0][0] == 16 * 3 * 4 * 4 * (5 + 2 * 4) and "B_1" in seen[0][1]


def _live_peak_bytes(call) -> int:
    """The most tensor bytes ``call`` holds at once beyond what existed before it (torch.profiler's
    allocation events, summed in order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("layout", ["the model's own", "a walk pass per sequence, the weight pairs in one"])
@pytest.mark.parametrize("name", ["vit", "gpt", "encoder"])
def test_model_passes_hold_no_more_than_the_estimate(name, layout, monkeypatch):
    """A whole model's Hessian holds at most the dense result, the fixed part and its largest pass as
    estimated (model.walk: _fixed_entries, _sequence_entries, _weight_entries), measured as live
    tensor bytes; also with the batch forced into one walk pass per sequence."""
    from blockhess.model import walk
    from blockhess.model.forward_pass import n_tokens
    from conftest import make_model_case
    from settings import NAMED_MODELS

    cfg, p, x, loss, T = make_model_case(*NAMED_MODELS[name])
    B, L, n = x.shape[0], n_tokens(cfg, x), sum(v.numel() for v in p.values())
    chunks = walk._chunks(cfg, B, L, n, loss, 8)
    if layout != "the model's own":
        chunks = ([slice(b, b + 1) for b in range(B)], [slice(0, B)])
        monkeypatch.setattr(walk, "_chunks", lambda *args: chunks)
    rows = max(c.stop - c.start for c in chunks[0])
    pairs = max((c.stop - c.start for c in chunks[1]), default=0)
    need = n * n + walk._fixed_entries(cfg, n, 8) + max(rows * walk._sequence_entries(cfg, L, n, loss),
                                                     pairs * walk._weight_entries(cfg, L, loss))
    peak = _live_peak_bytes(lambda: bh.hessian(p, x, cfg, loss=loss, target=T).dense())
    assert n * n * 8 < peak <= need * 8, (peak, need * 8)


def test_headroom_is_kept_free_and_needs_are_recorded(monkeypatch):
    """``keeping_free``: every check in the thread (below ``SMALL_BYTES`` too) asks for the headroom's bytes
    more, and the refusal names what they are kept for; ``recording_needs``: the largest request plus what
    the stretch had taken by then (the fall in available memory since it began)."""
    from blockhess.validation import SMALL_BYTES, Headroom, InsufficientMemoryError, check_fits, keeping_free, recording_needs

    _available(monkeypatch, 1000)
    room = Headroom("the products beside it", 400)
    with keeping_free(room):
        check_fits(600, "a basis")  # 600 + 400 <= 1000
        with pytest.raises(InsufficientMemoryError, match=r"a basis would need 601 .* 400 bytes are kept free for the products"):
            check_fits(601, "a basis")
        room.bytes = 0
        check_fits(1000, "a basis")
    check_fits(10**6, "a small request")  # outside: below SMALL_BYTES, not checked
    big = SMALL_BYTES
    _available(monkeypatch, 10 * GiB)
    with recording_needs() as need:
        check_fits(big, "one")
        assert need.peak == big
        _available(monkeypatch, 9 * GiB)  # the stretch has taken 1 GiB since it began
        check_fits(big, "two")
        assert need.peak == big + GiB
        _available(monkeypatch, 11 * GiB)  # freed: nothing taken
        check_fits(2 * big, "three")
        assert need.peak == big + GiB
    check_fits(4 * big, "after")
    assert need.peak == big + GiB  # no longer recorded

