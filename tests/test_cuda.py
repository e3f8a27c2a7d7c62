"""The library on a CUDA device gives the CPU's numbers (skipped without a GPU).

Every other test runs on the CPU; these repeat the device-sensitive paths on ``cuda`` and
compare with the CPU's results (themselves tested against ``torch.func`` elsewhere): the
dense assembly (sandwiches into one buffer, the mirror of the lower triangle), ``out=``, the
matrix-free operator (products, restricted views, the exact diagonal; a model's, with Lanczos
and SLQ on it),
a callable loss's randomised eigen-factorisation, the per-sample statistics' Lanczos, the
bounds, the convergence helpers, the digits ViT's loss, real PyTorch layers, the memory
check and the TF32 warning. Run by ``benchmarks/gpu_check.sh`` on a GPU machine;
``BLOCKHESS_TEST_DEVICE=cpu`` runs the comparisons CPU against CPU, to check the tests
themselves where there is no GPU (the TF32 and GPU-memory tests are then skipped).
"""

import math
import os
import warnings

import pytest
import torch
import torch.nn as nn

import blockhess as bh
from blockhess.linalg import rel_error
from blockhess_lab import vit as V

from conftest import assert_close, assert_float32_close, fro, rounding, to_dtype
from settings import LOSSES, NAMED_CONFIGS

CUDA = os.environ.get("BLOCKHESS_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(CUDA == "cuda" and not torch.cuda.is_available(), reason="no CUDA device")
on_gpu = pytest.mark.skipif(CUDA != "cuda", reason="a CUDA-only behaviour")
DT = torch.float64


def _to(tree, device):
    return {k: v.to(device) for k, v in tree.items()} if isinstance(tree, dict) else tree.to(device)


def _rel(a, b):
    return rel_error(a.cpu(), b)


# The CPU's own closed form, on another device: the same sums in another order (cuBLAS's blocking,
# the randomised range finder's sketch on the device), so rounding, well inside the 1e-10 rule.
SAME_SUMS = 1e-12


@pytest.mark.parametrize("setting", NAMED_CONFIGS)
@pytest.mark.parametrize("loss", LOSSES)
def test_hessian_and_parts_match_the_cpu(setting, loss):
    cfg = bh.BlockConfig(d_model=8, d_ff=12, **NAMED_CONFIGS[setting])
    p = bh.init_params(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(3, 5, 8, generator=g, dtype=DT)
    T = torch.randint(0, 8, (3, 5), generator=g) if loss == "ce" else torch.randn(3, 5, 8, generator=g, dtype=DT)
    fn = LOSSES[loss]
    H = bh.hessian(p, X, cfg, loss=fn, target=T, wrt_input=True)
    G = bh.hessian(_to(p, CUDA), X.to(CUDA), cfg, loss=fn, target=T.to(CUDA), wrt_input=True)
    assert G.dense().device.type == torch.device(CUDA).type
    for part in ("dense", "outer", "functional"):
        ours = G.dense() if part == "dense" else getattr(G, part).dense()
        ref = H.dense() if part == "dense" else getattr(H, part).dense()
        assert _rel(ours, ref) < SAME_SUMS, part


def test_large_dense_assembly_and_out_buffer():
    """n = 7,168: the sandwiches straight into the buffer, the one-copy mirror, ``out=``."""
    cfg = bh.BlockConfig(d_model=32, d_ff=64)
    p = bh.init_params(cfg, seed=0)
    X, T = torch.randn(2, 16, 32, dtype=DT), torch.randn(2, 16, 32, dtype=DT)
    ref = bh.hessian(p, X, cfg, target=T).dense()
    pc, Xc, Tc = _to(p, CUDA), X.to(CUDA), T.to(CUDA)
    D = bh.hessian(pc, Xc, cfg, target=Tc).dense()
    assert _rel(D, ref) < SAME_SUMS
    assert fro(D - D.T) <= rounding(D) * fro(D)  # mirrored; diagonal blocks to rounding
    buf = torch.empty_like(D)
    assert bh.hessian(pc, Xc, cfg, target=Tc, out=buf).dense().data_ptr() == buf.data_ptr()
    assert _rel(buf, ref) < SAME_SUMS


@on_gpu
def test_float32_without_tf32_and_the_tf32_warning():
    cfg = bh.BlockConfig(d_model=16, d_ff=32)
    X, T = torch.randn(8, 16, dtype=DT), torch.randn(8, 16, dtype=DT)
    p32, X32, T32 = _to(bh.init_params(cfg, seed=0, dtype=torch.float32), CUDA), X.float().to(CUDA), T.float().to(CUDA)
    ref = bh.reference.hessian(_to(p32, "cpu"), X32.cpu(), cfg, target=T32.cpu())  # float32 autograd, its inputs
    ref64 = bh.reference.hessian(to_dtype(_to(p32, "cpu"), DT), X32.cpu().double(), cfg, target=T32.cpu().double())
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            H32 = bh.hessian(p32, X32, cfg, target=T32).dense().cpu()
            terms = [(ref.outer.dense(), ref64.outer.dense()), (ref.functional.dense(), ref64.functional.dense())]
            assert_float32_close(H32, ref.dense(), ref64.dense(), terms=terms, what="float32 on the device")
        torch.backends.cuda.matmul.allow_tf32 = True
        with pytest.warns(UserWarning, match="TF32"):
            bh.hessian(p32, X32, cfg, target=T32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_per_sample_statistics_and_lanczos_match_the_cpu():
    cfg = bh.BlockConfig(d_model=8, d_ff=12)
    p = bh.init_params(cfg, seed=0)
    X, T = torch.randn(5, 4, 8, dtype=DT), torch.randn(5, 4, 8, dtype=DT)
    U = torch.randn(3, sum(v.numel() for v in p.values()), dtype=DT)
    kw = dict(loss=LOSSES["custom"], target=T, chunk_size=2, lanczos_iters=40)
    a = bh.convergence.per_sample_statistics(p, X, cfg, directions=U, **kw)
    b = bh.convergence.per_sample_statistics(_to(p, CUDA), X.to(CUDA), cfg, directions=U.to(CUDA), **{**kw, "target": T.to(CUDA)})
    for name in ("loss", "spectral", "frobenius", "grad_norm", "grad_dot", "quad"):
        assert_close(getattr(b, name).cpu(), getattr(a, name), what=name)  # Lanczos on each device: the rule


def test_bounds_and_convergence_helpers_on_cuda():
    cfg = bh.BlockConfig(d_model=6, d_ff=10)
    p = bh.init_params(cfg, seed=0)
    X, T = torch.randn(4, 6, dtype=DT), torch.randn(4, 6, dtype=DT)
    a = bh.bounds.block_bounds(p, X, cfg, target=T)
    b = bh.bounds.block_bounds(_to(p, CUDA), X.to(CUDA), cfg, target=T.to(CUDA))
    assert all(b["full"][k] == pytest.approx(v, rel=1e-10) for k, v in a["full"].items())
    rows = bh.bounds.ingredient_checks(_to(p, CUDA), X.to(CUDA), cfg, T.to(CUDA))
    assert [r["exact"] for r in rows] == pytest.approx([r["exact"] for r in bh.bounds.ingredient_checks(p, X, cfg, T)], rel=1e-10)
    k = torch.arange(1, 201, dtype=DT, device=CUDA)
    k_s, y_s = bh.convergence.log_ema(k, 3.0 / k)
    assert y_s.device == k_s.device
    assert bh.convergence.loglog_slope(k_s, y_s)["slope"] == pytest.approx(-1.0, abs=0.05)  # the EMA smoothing bends 3/k a little


def test_digits_vit_loss_on_cuda():
    vit = V.train(0, steps=20, quiet=True, arch={"patch": 2, "d_model": 8, "d_ff": 8, "d_k": 4, "ln_eps": 1e-5},
                  optim={"warmup_steps": 5, "lr": 1e-2})
    images, labels = vit.train_images[:4], vit.train_labels[:4]
    X = vit.embed(images)
    H = bh.hessian(vit.block_params(), X, vit.cfg, loss=vit.head_loss, target=labels).dense()
    G = bh.hessian(_to(vit.block_params(), CUDA), vit.embed(images.to(CUDA)), vit.cfg, loss=vit.head_loss,
                   target=labels.to(CUDA)).dense()
    assert_close(G.cpu(), H, what="digits ViT")  # the rule: the callable's range finder draws its own sketch per device


def test_torch_layer_on_cuda():
    layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True, norm_first=True).double().eval()
    cfg, p = bh.from_torch(layer)
    X, T = torch.randn(2, 4, 8, dtype=DT), torch.randn(2, 4, 8, dtype=DT)
    H = bh.hessian(p, X, cfg, target=T).to_module(layer).dense()
    cfg_c, p_c = bh.from_torch(layer.to(CUDA))
    G = bh.hessian(p_c, X.to(CUDA), cfg_c, target=T.to(CUDA)).to_module(layer).dense()
    assert _rel(G, H) < SAME_SUMS


@on_gpu
def test_memory_check_on_cuda():
    free, _ = torch.cuda.mem_get_info()
    d = math.ceil((2 * free / (49 * 8)) ** 0.25) + 1  # n = 7 d²: a dense float64 Hessian of over twice the free memory
    cfg = bh.BlockConfig(d_model=d, d_ff=2 * d)
    with pytest.raises(bh.InsufficientMemoryError, match="on cuda"):
        bh.hessian(_to(bh.init_params(cfg, seed=0), CUDA), torch.randn(4, d, dtype=DT, device=CUDA), cfg,
                   target=torch.zeros(4, d, dtype=DT, device=CUDA))


@pytest.mark.parametrize("setting", NAMED_CONFIGS)
@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_operator_products_views_and_diagonal_match_the_cpu(setting, loss):
    """``bh.hessian_operator`` on the device: every part's products, a view's (restricted) product and the
    exact closed-form diagonal give the CPU's."""
    cfg = bh.BlockConfig(d_model=8, d_ff=12, **NAMED_CONFIGS[setting])
    p = bh.init_params(cfg, seed=0)
    g = torch.Generator().manual_seed(2)
    X = torch.randn(3, 5, 8, generator=g, dtype=DT)
    T = torch.randint(0, 8, (3, 5), generator=g) if loss == "ce" else torch.randn(3, 5, 8, generator=g, dtype=DT)
    for part in ("full", "outer", "functional"):
        A = bh.hessian_operator(p, X, cfg, loss=loss, target=T, part=part)
        B = bh.hessian_operator(_to(p, CUDA), X.to(CUDA), cfg, loss=loss, target=T.to(CUDA), part=part)
        assert B.device.type == torch.device(CUDA).type
        V = torch.randn(A.shape[0], 2, generator=g, dtype=DT)
        assert _rel(B @ V.to(CUDA), A @ V) <= SAME_SUMS, part
        v = torch.randn(A["W_V", "W_V"].shape[0], generator=g, dtype=DT)
        assert _rel(B["W_V", "W_V"] @ v.to(CUDA), A["W_V", "W_V"] @ v) <= SAME_SUMS, part
        assert _rel(B.diagonal(), A.diagonal()) <= SAME_SUMS, part


def test_model_hessian_operator_and_estimators_match_the_cpu():
    """A 2-block model on the device: the dense Hessian, the operator's products, Lanczos' top eigenvalues
    and the SLQ density give the CPU's."""
    from blockhess.config import ModelConfig
    from blockhess.operators import lanczos_eigs, slq_density

    blk = bh.BlockConfig(d_model=8, d_ff=12, n_heads=2, norm="pre", bias=True, out_proj=True, ln_affine=True,
                         ln_eps=1e-5, causal=True)
    cfg = ModelConfig(blocks=(blk, blk), embedding="token", vocab=11, positions="learned", n_positions=6,
                      final_norm=True, pool="none", head=11, tied=True)
    p = bh.init_params(cfg, seed=0)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 11, (3, 6), generator=g)
    y = torch.randint(0, 11, (3, 6), generator=g)
    H = bh.hessian(p, x, cfg, loss="ce", target=y)
    G = bh.hessian(_to(p, CUDA), x.to(CUDA), cfg, loss="ce", target=y.to(CUDA))
    assert _rel(G.dense(), H.dense()) <= SAME_SUMS
    A = bh.hessian_operator(p, x, cfg, loss="ce", target=y)
    B = bh.hessian_operator(_to(p, CUDA), x.to(CUDA), cfg, loss="ce", target=y.to(CUDA))
    V = torch.randn(A.shape[0], 2, generator=g, dtype=DT)
    assert _rel(B @ V.to(CUDA), A @ V) <= SAME_SUMS
    top_cpu, top_dev = lanczos_eigs(A, 3, tol=1e-10, seed=0), lanczos_eigs(B, 3, tol=1e-10, seed=0)
    assert _rel(top_dev.eigenvalues, top_cpu.eigenvalues) <= 1e-9  # both to residual 1e-10 |λ|: Weyl
    d_cpu, d_dev = slq_density(A, n_probes=4, n_iter=12, seed=0), slq_density(B, n_probes=4, n_iter=12, seed=0)
    # the same probes, fully reorthogonalised: the Ritz values and weights move by rounding times the
    # conditioning of 12 Lanczos steps, far inside 1e-8
    assert _rel(d_dev.density, d_cpu.density) <= 1e-8
