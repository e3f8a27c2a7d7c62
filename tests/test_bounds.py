"""Theorems 1 and 6: every valid bound is >= the exact spectral norm it bounds.

Exact norms come from the closed-form Hessian (bh.hessian); the grid covers the bare
attention layer and the post-LN block, d_k != d_model, L = 1, eps > 0, input scales
0.1 ... 10, several seeds, MSE, CE and a callable loss, and a batch.
"""

import math

import pytest
import torch

import blockhess as bh
from blockhess import bounds
from blockhess_lab.runtime import torch_threads

from settings import BOUND_CASES, BOUND_SCALES, KINDS

TOL = 1e-9  # relative slack for rounding in the exact norms


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny problems: one thread is faster (and far faster on a loaded machine)."""
    with torch_threads(1):
        yield


def _rows_ok(rows):
    for r in rows:
        assert r["bound"] >= r["norm"] * (1 - TOL), r
        assert r["bound_outer"] >= r["outer_norm"] * (1 - TOL), r
        assert r["bound_functional"] >= r["functional_norm"] * (1 - TOL), r
        if r["bound_paper"] is not None:
            assert r["paper_holds"] == (r["bound_paper"] >= r["norm"] * (1 - bounds.PAPER_TIE_RTOL))


@pytest.mark.parametrize("kind,d,dff,dk,L,eps", BOUND_CASES)
def test_valid_bound_holds_on_grid(kind, d, dff, dk, L, eps):
    cfg = bh.BlockConfig(d_model=d, d_ff=dff, d_k=dk, kind=kind, ln_eps=eps)
    for seed in range(2):
        params = bh.init_params(cfg, seed=seed)
        g = torch.Generator().manual_seed(100 + seed)
        for sigma in BOUND_SCALES:
            X = sigma * torch.randn(L, d, generator=g, dtype=torch.float64)
            T = torch.randn(L, d, generator=g, dtype=torch.float64)
            rows = bounds.spectral_bounds(params, X, cfg, loss="mse", target=T)
            names = bh.param_shapes(cfg)
            n = len(names)
            assert len(rows) == n * (n + 1) // 2 + 1 and rows[-1]["block"] == "all"
            _rows_ok(rows)
            # a zero-residual target (the paper's minimiser setting) too
            _rows_ok(bounds.spectral_bounds(params, X, cfg, loss="mse", target=bh.forward(params, X, cfg)))


def test_row_format_and_vv_functional_zero():
    cfg = bh.BlockConfig(d_model=4, d_k=3, kind="attention")
    params = bh.init_params(cfg, seed=0)
    X = torch.randn(5, 4, dtype=torch.float64)
    rows = bounds.spectral_bounds(params, X, cfg, "mse", torch.zeros(5, 4, dtype=torch.float64))
    keys = {"block", "norm", "bound", "bound_paper", "outer_norm", "functional_norm"}
    assert all(keys <= set(r) for r in rows)
    assert [r["block"] for r in rows] == ["W_Q,W_Q", "W_Q,W_K", "W_Q,W_V", "W_K,W_K", "W_K,W_V", "W_V,W_V", "all"]
    vv = rows[5]
    assert vv["functional_norm"] == 0.0 and vv["bound_functional"] == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_general_losses_and_batch(kind):
    cfg = bh.BlockConfig(d_model=4, d_ff=6, d_k=2, kind=kind)
    params = bh.init_params(cfg, seed=3)
    g = torch.Generator().manual_seed(7)
    X = 1.5 * torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (3, 4), generator=g)
    rows = bounds.spectral_bounds(params, X, cfg, loss="ce", target=y)
    _rows_ok(rows)
    assert all(r["bound_paper"] is None for r in rows)

    def pooled(Z, t):  # pooled logits, CE: a loss whose Hessian couples tokens
        return torch.nn.functional.cross_entropy(Z.mean(0, keepdim=True), t[None])

    rows = bounds.spectral_bounds(params, X, cfg, loss=pooled, target=y[:, 0])
    _rows_ok(rows)
    T = torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    _rows_ok(bounds.spectral_bounds(params, X, cfg, loss="mse", target=T))


@pytest.mark.parametrize("seed", [0, 1, 175, 242])
def test_float32_inputs(seed):
    """Seeds 1, 175 and 242 give float32 functional terms (two thirds exact zeros) on which
    LAPACK's float32 eigh fails to converge; the norms are taken in float64 (blockhess.linalg)."""
    cfg = bh.BlockConfig(d_model=4, d_ff=6, kind="block")
    params = bh.init_params(cfg, seed=1, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    X, T = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    rows = bounds.spectral_bounds(params, X, cfg, "mse", T)
    for r in rows:
        assert r["bound"] >= r["norm"] * (1 - 1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_ingredients_hold(kind):
    cfg = bh.BlockConfig(d_model=5, d_ff=7, d_k=3, kind=kind)
    for seed, sigma in ((0, 0.3), (1, 1.0), (2, 3.0)):
        params = bh.init_params(cfg, seed=seed)
        X = sigma * torch.randn(4, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        rows = bounds.ingredient_checks(params, X, cfg, torch.zeros(4, 5, dtype=torch.float64))
        for r in rows:
            if r["exact"] is not None:
                assert r["bound"] >= r["exact"] * (1 - TOL), r
        names = [r["ingredient"] for r in rows]
        assert "dA/dT" in names and "Phi_VQ" in names
        if kind == "block":
            assert {"J_Y", "H_Z", "B_V"} <= set(names)


def test_softmax_constants_against_random_directions():
    g = torch.Generator().manual_seed(0)
    for L in (2, 3, 7):
        for _ in range(50):
            t = 4 * torch.randn(L, generator=g, dtype=torch.float64)
            h = torch.randn(L, generator=g, dtype=torch.float64)
            h2 = torch.randn(L, generator=g, dtype=torch.float64)
            a = torch.softmax(t, 0)
            S = torch.diag(a) - torch.outer(a, a)
            assert float(torch.linalg.matrix_norm(S, 2)) <= bounds.SOFTMAX_JACOBIAN_BOUND + 1e-15
            Hs = bh.softmax.hessian(a[None], compact=True)[0]  # (L, L, L): [j, k, l]
            v = torch.einsum("jkl,k,l->j", Hs, h, h2)
            assert float(v.norm()) <= bounds.SOFTMAX_HESSIAN_BOUND * float(h.norm() * h2.norm()) + 1e-14


def test_layernorm_bounds_sharp_and_valid():
    g = torch.Generator().manual_seed(1)
    for eps in (0.0, 0.5):
        X = torch.randn(3, 6, generator=g, dtype=torch.float64)
        lb = bounds.layernorm_bounds(X, eps)
        J = bh.layernorm.jacobian(X, eps, compact=True)
        assert max(float(torch.linalg.matrix_norm(j, 2)) for j in J) <= lb["jacobian"] * (1 + 1e-12)
        if eps == 0.0:  # sharp for eps = 0
            assert max(float(torch.linalg.matrix_norm(j, 2)) for j in J) == pytest.approx(lb["jacobian"], rel=1e-10)
        H = bh.layernorm.hessian(X, eps, compact=True)  # (L, a, b, c)
        for _ in range(20):
            U, V = torch.randn(2, 3, 6, generator=g, dtype=torch.float64)
            val = torch.einsum("tabc,tb,tc->ta", H, U, V).norm()
            assert float(val) <= lb["hessian"] * float(U.norm() * V.norm()) * (1 + 1e-12)
    with pytest.raises(ValueError):
        bounds.layernorm_bounds(torch.ones(2, 3, dtype=torch.float64), 0.0)


def test_functional_bilinear_bound_random_contractions():
    """‖Σ_o g_o ∇²out_o‖ <= ‖g‖ ζ for random output weights g (the bilinear bounds ζ)."""
    for kind in ("attention", "block"):
        cfg = bh.BlockConfig(d_model=4, d_ff=5, d_k=3, kind=kind)
        params = bh.init_params(cfg, seed=5)
        g = torch.Generator().manual_seed(9)
        X = torch.randn(3, 4, generator=g, dtype=torch.float64)
        Z = bh.forward(params, X, cfg)
        ing = bounds.ingredients(params, X, cfg, "mse", torch.zeros_like(X))["valid"]
        for _ in range(5):
            G = torch.randn(3, 4, generator=g, dtype=torch.float64)
            # the MSE functional term with target Z - G·(L d / 2) is exactly Σ_o G_o ∇²Z_o
            H = bh.hessian(params, X, cfg, loss="mse", target=Z - G * (3 * 4 / 2)).functional
            for (a, b), block in H.items():
                nrm = float(torch.linalg.matrix_norm(block, 2))
                assert nrm <= ing["zeta"][bh.config.pair_key(a, b)] * float(G.norm()) * (1 + TOL)


def test_bad_inputs_raise():
    cfg = bh.BlockConfig(d_model=4, kind="attention")
    params = bh.init_params(cfg)
    X = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError):
        bounds.spectral_bounds(params, X, cfg, "mse", None)
    with pytest.raises(ValueError):
        bounds.spectral_bounds(params, X[:, :3], cfg, "mse", torch.zeros(3, 3, dtype=torch.float64))
    with pytest.raises(ValueError):
        bounds.ingredients(params, X[None].expand(2, 3, 4), cfg, "mse", torch.zeros(2, 3, 4, dtype=torch.float64))
    bcfg = bh.BlockConfig(d_model=4, d_ff=4)
    with pytest.raises(ValueError):  # constant rows: zero LayerNorm variance with eps = 0
        bp = bh.init_params(bcfg)
        bp["W_V"] = torch.zeros_like(bp["W_V"])
        bounds.spectral_bounds(bp, torch.ones(3, 4, dtype=torch.float64), bcfg, "mse",
                               torch.zeros(3, 4, dtype=torch.float64))
    assert math.isfinite(bounds.SOFTMAX_HESSIAN_BOUND)
    for opt in ({"n_heads": 2}, {"activation": "gelu"}, {"norm": "pre"}, {"bias": True}, {"ln_affine": True}):
        c = bh.BlockConfig(d_model=4, d_ff=4, **opt)
        with pytest.raises(ValueError, match="paper's setting"):
            bounds.spectral_bounds(bh.init_params(c), X, c, "mse", torch.zeros(3, 4, dtype=torch.float64))


def test_bounds_command_random_part(tmp_path, monkeypatch):
    import argparse
    import json

    from blockhess_lab import bounds as cmd

    monkeypatch.setattr(cmd, "RANDOM_SIZE", {"d_model": 4, "d_k": 2, "d_ff": 6, "L": 3})
    monkeypatch.setattr(cmd, "SWEEP_SIZE", {"d_model": 4, "d_k": 2, "d_ff": 6, "L": 3})
    monkeypatch.setattr(cmd, "SWEEP_SCALES", (0.1, 10.0))
    monkeypatch.setattr(cmd, "SWEEP_LENGTHS", (3,))
    monkeypatch.setattr(cmd, "SWEEP_WEIGHT_SCALES", (1.0,))
    p = argparse.ArgumentParser()
    cmd.add_arguments(p)
    out = tmp_path / "b"
    assert cmd.run(p.parse_args(["--out", str(out), "--no-trained", "--seeds", "1", "--quiet"])) == 0
    res = json.loads((out / "bounds.json").read_text())
    assert res["valid_violations"] == [] and len(res["tables"]) == 2
    assert res["sweep"]["n_rows"] == 2 * 2 * (7 + 16)
    assert (out / "bounds.png").stat().st_size > 0 and "Theorem 1" in (out / "bounds.md").read_text()
    with pytest.raises(ValueError):
        cmd.run(p.parse_args(["--out", str(out), "--batch", "0"]))


def test_exact_norms_needs_the_parts():
    cfg = bh.BlockConfig(d_model=4, d_ff=6)
    p = bh.init_params(cfg)
    X, T = torch.randn(2, 3, 4, dtype=torch.float64).unbind(0)
    H = bh.hessian(p, X, cfg, target=T)
    norms = bh.bounds.exact_norms(H)
    assert set(norms) == {"full", "outer", "functional"}
    assert list(norms["outer"]) == H.pairs() + ["all"]
    assert norms["outer"]["W_V", "W_Q"] == norms["outer"]["W_Q", "W_V"] == norms["outer"].get(("W_V", "W_Q"))
    assert ("W_V", "W_Q") in norms["outer"] and ("W_O", "W_Q") not in norms["outer"] and norms["outer"].get(("W_O", "W_Q")) is None
    bb = bh.bounds.block_bounds(p, X, cfg, target=T)
    assert bb["full"]["W_2", "W_Q"] == bb["full"]["W_Q", "W_2"] and bb["paper"]["W_2", "W_1"] == bb["paper"]["W_1", "W_2"]
    # the same block's 2-norm by another routine: the eigen-solvers' rounding
    assert norms["outer"]["W_V", "W_Q"] == pytest.approx(float(torch.linalg.matrix_norm(H.outer["W_V", "W_Q"], 2)), rel=1e-12)
    with pytest.raises(KeyError):
        norms["full"]["W_Q", "W_O"]
    with pytest.raises(ValueError, match="without parts"):
        bh.bounds.exact_norms(H.outer)
    with pytest.raises(ValueError, match="got Tensor"):
        bh.bounds.exact_norms(H.dense())


def test_bounds_md_names_the_largest_cancellation_from_the_run():
    from blockhess_lab.bounds import _cancellation

    row = lambda b, n, o, f: {"block": b, "norm": n, "outer_norm": o, "functional_norm": f}  # noqa: E731
    tables = [{"name": "A", "rows": [row("W_Q,W_Q", 1.0, 3.0, 2.5), row("W_V,W_V", 0.0, 0.0, 0.0)]},
              {"name": "B", "rows": [row("W_1,W_1", 0.5, 0.6, 4.0)]}]
    s = _cancellation(tables)
    assert "(B, W_1,W_1: 0.6 and 4 against 0.5)" in s
    assert _cancellation([{"name": "A", "rows": [row("W_Q,W_Q", 1.0, 1.5, 0.6)]}]) == ""  # no real cancellation


def test_constant_layernorm_row_with_tiny_eps():
    """ln_eps > 0 and a row of zeros (W_V = 0: LN_1's input is X): the printed LayerNorm lemma divides by
    the row's norm, so the printed bounds are None; the valid bounds are finite while they fit in float64
    (ln_eps 1e-100: 1/sigma^4 = 1e200) and a named error where they do not (1e-200, as the Hessian)."""
    X = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    X[1] = 0.0
    lb = bounds.layernorm_bounds(X, 1e-100)
    assert lb["jacobian_paper"] is None and lb["hessian_paper"] is None and lb["jacobian"] == pytest.approx(1e50)
    T = torch.zeros_like(X)
    for eps in (1e-100, 1e-200):
        cfg = bh.BlockConfig(d_model=4, d_ff=5, ln_eps=eps)
        p = bh.init_params(cfg, seed=0)
        p["W_V"] = torch.zeros_like(p["W_V"])
        if eps == 1e-100:
            bd = bounds.block_bounds(p, X, cfg, "mse", T)
            assert all(math.isfinite(v) for k in ("outer", "functional", "full") for v in bd[k].values())
            assert all(v is None for v in bd["paper"].values())
            rows = bounds.spectral_bounds(p, X, cfg, "mse", T)
            assert all(r["bound"] >= r["norm"] * (1 - TOL) and r["bound_paper"] is None for r in rows)
            checks = bounds.ingredient_checks(p, X, cfg, T)  # printed values from the lemmas: None; dA/dT, A, J_SY: not
            assert all((r["bound_paper"] is None) == (r["ingredient"] not in ("dA/dT", "A", "J_SY")) for r in checks)
            assert all(math.isfinite(r["exact"]) and math.isfinite(r["bound"]) for r in checks if r["exact"] is not None)
            continue
        for f in (bounds.block_bounds, bounds.ingredients):
            with pytest.raises(ValueError, match=r"ingredients: \['valid'\]\['zeta'\]\['VV'\] is inf on finite inputs"):
                f(p, X, cfg, "mse", T)
        with pytest.raises(ValueError, match="the Hessian contains NaN or Inf"):
            bounds.spectral_bounds(p, X, cfg, "mse", T)
