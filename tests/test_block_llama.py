"""The Llama-family block options (RMSNorm with Gemma's offset, the gated FFN, grouped-query and
multi-query attention, a free value width, RoPE, per-projection biases) against torch.func on the
plain-ops forward of blockhess.reference, in float64 (docs/derivations.md §20).

The options are crossed by a 2-wise covering design (every pair of option values in some
configuration), each run on a shape from a cycle with ``L = 1``, odd widths, unbatched inputs and
batches of 1 and many, tiny and large input scales. Each configuration checks the forward, the full
Hessian and its outer and functional parts w.r.t. every weight and the input ``X`` (relative
Frobenius error <= 1e-10, conftest.TOL), the identities (symmetry, outer + functional = full, outer
PSD for MSE and CE), the operator's products, its per-head views and its exact diagonal. The
functions that need the Kronecker factors refuse each option by name, before any work.
"""

import pytest
import torch

import blockhess as bh
from blockhess import reference

from conftest import (TOL, assert_blocks_close, assert_close, assert_identities, autograd_defect, blocks_of, fro, rel_err,
                      rounding)
from settings import covering_design, make_target

# every Llama-family option, the paper's value first where it has one
LLAMA_OPTIONS = {
    "norm_type": ["layer", "rms"],
    "rms_offset": [0.0, 1.0],
    "gated": [False, True],
    "activation": ["relu", "silu", "gelu_tanh", "gelu"],
    "heads": ["one", "mha", "gqa", "mqa"],
    "d_v": ["default", "free"],
    "rope": [False, True],
    "qkv_bias": [False, True],
    "bias": [False, True],
    "norm": ["post", "pre"],
    "causal": [False, True],
    "ln_affine": [False, True],
}


def llama_valid(row: dict) -> bool:
    """Gemma's offset is added to the RMSNorm scales: it needs both."""
    return row.get("rms_offset", 0.0) == 0.0 or (row.get("norm_type") == "rms" and row.get("ln_affine") is True)


LLAMA_DESIGN = covering_design(2, options=LLAMA_OPTIONS, valid=llama_valid)
# (L, d_model, d_ff, batch, input scale): L = 1, odd widths, unbatched, batches of 1 and many, tiny and large X
LLAMA_SIZES = [(3, 5, 3, None, 1.0), (1, 4, 3, 2, 1.0), (4, 6, 5, 1, 1e-3), (2, 4, 4, 3, 30.0), (3, 6, 3, None, 1.0),
               (1, 5, 2, None, 1.0)]
HEADS = {"one": (1, None), "mha": (2, None), "gqa": (4, 2), "mqa": (2, 1)}


def llama_config(row: dict, d: int, d_ff: int, i: int) -> bh.BlockConfig:
    """The :class:`blockhess.BlockConfig` of a design row at width ``d`` (``i``: the case's index, for
    the choices a row leaves open: ``out_proj`` where ``d_v`` does not force it, odd ``d_k`` without RoPE)."""
    H, G = HEADS[row["heads"]]
    d_k = 2 if row["rope"] else (3 if i % 2 else 2)
    d_v = 3 if row["d_v"] == "free" else None
    if d_v is None and d % H:
        d_v = d // H + 1  # the default width needs n_heads | d_model: a free one instead
    out_proj = (d_v is not None and H * d_v != d) or i % 3 == 0  # W_O maps H·d_v to d where they differ
    eps = 1e-6 if row["norm_type"] == "rms" else (1e-5 if i % 2 else 0.0)
    opts = {k: v for k, v in row.items() if k not in ("heads", "d_v")}
    return bh.BlockConfig(d_model=d, d_ff=d_ff, d_k=d_k, n_heads=H, n_kv_heads=G, d_v=d_v, out_proj=out_proj, ln_eps=eps,
                          **opts)


def randomize(params: dict, seed: int) -> dict:
    """Vectors drawn: biases ``0.3·N(0,1)``, scales around their effective 1 (``rms_offset`` apart)."""
    g = torch.Generator().manual_seed(seed + 7)
    out = dict(params)
    for k, v in params.items():
        if v.ndim == 1:
            r = torch.randn(v.shape, generator=g, dtype=torch.float64)
            out[k] = v + 0.5 * r if k.startswith("gamma") else 0.3 * r
    return out


def case(i: int):
    row = LLAMA_DESIGN[i]
    L, d, d_ff, B, scale = LLAMA_SIZES[i % len(LLAMA_SIZES)]
    cfg = llama_config(row, d, d_ff, i)
    params = randomize(bh.init_params(cfg, seed=i), i)
    g = torch.Generator().manual_seed(100 + i)
    X = scale * torch.randn((L, d) if B is None else (B, L, d), generator=g, dtype=torch.float64)
    loss = ("mse", "ce")[i % 2]
    return cfg, params, X, make_target(loss, X, g, d), loss


def case_id(i: int) -> str:
    row = LLAMA_DESIGN[i]
    L, d, _, B, _ = LLAMA_SIZES[i % len(LLAMA_SIZES)]
    on = [row["norm_type"], row["norm"], row["heads"], row["activation"]]
    on += [k for k in ("gated", "rope", "qkv_bias", "bias", "causal", "ln_affine") if row[k]]
    if row["rms_offset"]:
        on.append("gemma")
    if row["d_v"] == "free":
        on.append("dv")
    return "-".join(on) + f"-L{L}-d{d}-B{B}"


CASES = range(len(LLAMA_DESIGN))


def test_design_covers_every_pair():
    import itertools
    from settings import covered
    need = set()
    for ks in itertools.combinations(LLAMA_OPTIONS, 2):
        for vs in itertools.product(*(LLAMA_OPTIONS[k] for k in ks)):
            if llama_valid(dict(zip(ks, vs))):
                need.add(tuple((k, repr(v)) for k, v in zip(ks, vs)))
    got = set().union(*(covered(r, 2, LLAMA_OPTIONS) for r in LLAMA_DESIGN))
    assert need <= got
    # the design reaches the paths these options take (the Llama block itself among them)
    assert any(llama_config(r, 6, 3, i).llama_options for i, r in enumerate(LLAMA_DESIGN))


@pytest.mark.parametrize("i", CASES, ids=[case_id(i) for i in CASES])
def test_forward_and_hessian_against_autograd(i):
    cfg, p, X, T, loss = case(i)
    assert_close(bh.forward(p, X, cfg), reference.forward(p, X, cfg), what="forward")
    H = bh.hessian(p, X, cfg, loss=loss, target=T, wrt_input=True)
    R = reference.hessian(p, X, cfg, loss=loss, target=T, wrt_input=True)
    assert H.names == R.names == ("X",) + tuple(bh.param_shapes(cfg))
    for which in ("full", "outer", "functional"):
        h, r = (H, R) if which == "full" else (getattr(H, which), getattr(R, which))
        # each block to its own norm, or to the whole's rounding; and no more than autograd's own error
        # (its asymmetry: where softmax saturates, X at 30x the weights' scale, it is 1e3 ε‖R‖; the
        # products' columns stay symmetric to ~ε‖R‖ there, measured before the symmetrisation)
        whole, allow = fro(r.dense()), autograd_defect(r.dense())
        for (a, b), (x, y) in blocks_of(h, r).items():
            assert_close(x, y, scale=whole, allow=allow, what=f"{case_id(i)} {which} block {(a, b)}")
    assert_identities(H, convex=True, reference=R, what=case_id(i))


@pytest.mark.parametrize("i", CASES[::2], ids=[case_id(i) for i in CASES[::2]])
def test_operator_products_views_and_diagonal(i):
    cfg, p, X, T, loss = case(i)
    R = reference.hessian(p, X, cfg, loss=loss, target=T)
    for part, D in (("full", R.dense()), ("outer", R.outer.dense()), ("functional", R.functional.dense())):
        A = bh.hessian_operator(p, X, cfg, loss=loss, target=T, part=part)
        V = torch.randn(A.shape[0], 3, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        assert_close(A @ V, D @ V, what=f"{part} products")
        # bh.hessian symmetrises its columns; the products themselves are symmetric only if the
        # tangent and adjoint passes agree: every column against every row, unsymmetrised
        M = A @ torch.eye(A.shape[0], dtype=torch.float64)
        assert fro(M - M.T) <= rounding(M) * fro(M), f"{part}: products not symmetric ({fro(M - M.T):.3e})"
        assert_close(A.diagonal(), D.diagonal(), what=f"{part} diagonal")
        if cfg.n_heads > 1:  # a query head's view against the last key/value head's: the group's use of it
            G, sl, o = cfg.kv_heads, {}, 0
            for k in R.names:
                sl[k] = slice(o, o + p[k].numel())
                o += p[k].numel()
            h, g = cfg.n_heads - 1, G - 1
            d, dk = cfg.d_model, cfg.head_dim
            want = D[sl["W_K"], sl["W_Q"]].reshape(d, G, dk, d, cfg.n_heads, dk)[:, g, :, :, h, :].reshape(d * dk, d * dk)
            view = A[f"W_K#{g}", f"W_Q#{h}"]
            assert_close(view @ torch.eye(d * dk, dtype=torch.float64), want, what=f"{part} view W_K#{g}, W_Q#{h}")


def test_hessian_of_a_weight_subset_and_out_buffer():
    cfg, p, X, T, loss = case(3)
    names = ("W_K", "W_G") if cfg.gated else ("W_K", "W_1")
    R = reference.hessian(p, X, cfg, loss=loss, target=T, wrt=names)
    n = sum(p[k].numel() for k in names)
    out = torch.empty(n, n, dtype=torch.float64)
    H = bh.hessian(p, X, cfg, loss=loss, target=T, wrt=names, out=out)
    assert H.names == names and H.dense().data_ptr() == out.data_ptr()
    assert rel_err(H.dense(), R.dense()) <= TOL


LLAMA = dict(norm="pre", norm_type="rms", ln_affine=True, ln_eps=1e-6, gated=True, activation="silu", n_heads=4,
             n_kv_heads=2, d_k=2, d_v=2, out_proj=True, rope=True, causal=True)


@pytest.mark.parametrize("option", ["norm_type", "gated", "n_kv_heads", "d_v", "rope"])
def test_jacobians_from_tangents_and_the_factor_paths_refuse_by_name(option):
    """Each option alone: ``bh.jacobian`` and ``bh.input_jacobian`` (columns of exact tangents) against
    torch.func; the functions that need the Kronecker factors raise ``NotImplementedError`` naming it."""
    base = dict(d_model=8, d_ff=5, n_heads=4, d_k=2, norm="pre", ln_eps=1e-5)
    one = {"norm_type": dict(norm_type="rms", ln_affine=True), "gated": dict(gated=True, activation="silu"),
           "n_kv_heads": dict(n_kv_heads=2), "d_v": dict(d_v=3, out_proj=True), "rope": dict(rope=True, qkv_bias=True)}[option]
    cfg = bh.BlockConfig(**base, **one)
    assert [o.split("=")[0] for o in cfg.llama_options] == [option]
    p = randomize(bh.init_params(cfg), 0)
    X = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    J, RJ = bh.jacobian(p, X, cfg), reference.jacobian(p, X, cfg)
    whole = fro(torch.cat([v.reshape(-1) for v in RJ.values()]))
    for k in RJ:
        assert_close(J[k], RJ[k], scale=whole, what=f"Jacobian {k}")
    assert_close(bh.input_jacobian(p, X[0], cfg), reference.input_jacobian(p, X[0], cfg), what="dZ/dX")
    c = bh.block.forward_cache(p, X, cfg, plain=True)
    for f in (bh.block.jacobian_factors, lambda c: bh.block.contract_output(c, None, None, None),
              lambda c: bh.block.diagonal.diagonal(c, None, 1.0, ("W_Q",))):
        with pytest.raises(NotImplementedError, match=f"does not take .*{option}"):
            f(c)
    with pytest.raises(NotImplementedError, match=f"blockhess.block.second_derivative does not take .*{option}"):
        bh.block.second_derivative(p, X[0], cfg, "W_Q", "W_Q")
    layer = {"norm_type": (bh.ffn.weight_jacobians, c.fc), "gated": (bh.ffn.weight_jacobians, c.fc),
             "n_kv_heads": (bh.attention.weight_jacobians, c.att), "d_v": (bh.attention.weight_jacobians, c.att),
             "rope": (bh.attention.weight_jacobians, c.att)}[option]
    with pytest.raises(NotImplementedError, match="the Kronecker factors do not cover"):
        layer[0](layer[1])


@pytest.mark.parametrize("option", ["norm_type", "gated", "rope", "qkv_bias"])
def test_bounds_refuse_each_option_by_name(option):
    """Theorems 1 and 6 cover the paper's one-head block: each new option is named, not bounded."""
    one = {"norm_type": dict(norm_type="rms"), "gated": dict(gated=True), "rope": dict(rope=True),
           "qkv_bias": dict(qkv_bias=True)}[option]
    cfg = bh.BlockConfig(d_model=4, d_ff=5, **one)
    p = bh.init_params(cfg)
    X = torch.randn(3, 4, dtype=torch.float64)
    for f in (bh.bounds.block_bounds, bh.bounds.spectral_bounds, bh.bounds.ingredients):
        with pytest.raises(ValueError, match=f"BlockConfig.{option} must be"):
            f(p, X, cfg, target=torch.zeros_like(X))


def test_qkv_bias_and_silu_take_the_kronecker_path():
    """``qkv_bias`` (Qwen2) and a plain SiLU FFN need no new structure: the Kronecker factors take them."""
    cfg = bh.BlockConfig(d_model=4, d_ff=5, n_heads=2, qkv_bias=True, activation="silu", norm="pre", ln_eps=1e-5)
    assert cfg.llama_options == () and {"b_Q", "b_K", "b_V"} <= set(bh.param_shapes(cfg))
    assert not {"b_1", "b_2", "beta_1"} & set(bh.param_shapes(cfg))
    p = randomize(bh.init_params(cfg), 0)
    X = torch.randn(2, 3, 4, dtype=torch.float64)
    T = torch.randn(2, 3, 4, dtype=torch.float64)
    H, R = bh.hessian(p, X, cfg, target=T), reference.hessian(p, X, cfg, target=T)
    assert_blocks_close(blocks_of(H, R), what="qkv_bias, silu")
    J, RJ = bh.jacobian(p, X, cfg), reference.jacobian(p, X, cfg)
    whole = fro(torch.cat([v.reshape(-1) for v in RJ.values()]))  # b_K's is exactly zero; autograd's is rounding
    for k in J:
        assert_close(J[k], RJ[k], scale=whole, what=f"Jacobian {k}")


def test_config_shapes_and_errors():
    cfg = bh.BlockConfig(d_model=8, d_ff=6, **LLAMA)
    shapes = bh.param_shapes(cfg)
    assert tuple(shapes) == ("W_Q", "W_K", "W_V", "W_O", "gamma_1", "W_G", "W_1", "W_2", "gamma_2")
    assert shapes["W_Q"] == (8, 8) and shapes["W_K"] == shapes["W_V"] == (8, 4) and shapes["W_O"] == (8, 8)
    assert shapes["W_G"] == shapes["W_1"] == (8, 6)
    with_bias = bh.param_shapes(bh.BlockConfig(d_model=8, d_ff=6, bias=True, **LLAMA))
    assert "b_G" in with_bias and "beta_1" not in with_bias  # RMSNorm has no shift
    gemma = bh.init_params(bh.BlockConfig(d_model=8, d_ff=6, rms_offset=1.0, **LLAMA))
    assert torch.count_nonzero(gemma["gamma_1"]) == 0  # effective scale 1 + 0
    plain, gated = bh.init_params(bh.BlockConfig(d_model=8, d_ff=6)), bh.init_params(bh.BlockConfig(d_model=8, d_ff=6, gated=True))
    for k in ("W_Q", "W_K", "W_V", "W_1", "W_2"):  # W_G is drawn after the paper's matrices
        assert torch.equal(plain[k], gated[k])
    for kw, msg in ((dict(n_heads=4, n_kv_heads=3, d_k=2), "n_kv_heads=3 must divide n_heads=4"),
                    (dict(rope=True, d_k=3), "rope needs an even d_k"),
                    (dict(rope_theta=0.0), "rope_theta must be > 0"),
                    (dict(rope=False, rope_theta=500.0), "rope_theta=500.0 has no meaning without rope=True"),
                    (dict(rms_offset=1.0), "rms_offset=1.0 needs norm_type='rms'"),
                    (dict(norm_type="batch"), "norm_type must be one of"),
                    (dict(n_heads=2, d_v=3), "it needs out_proj=True"),
                    (dict(kind="attention", gated=True), "gated=True has no meaning for kind='attention'"),
                    (dict(gated=1), "gated must be True or False")):
        with pytest.raises(ValueError, match=msg):
            bh.BlockConfig(d_model=8, **kw)


def test_rms_rows_checked():
    cfg = bh.BlockConfig(d_model=4, d_ff=3, norm="pre", norm_type="rms", ln_eps=0.0)
    p = bh.init_params(cfg)
    X = torch.randn(3, 4, dtype=torch.float64)
    X[1] = 0.0
    with pytest.raises(ValueError, match=r"X \(the RMSNorm-1 input, pre-LN\)"):
        bh.forward(p, X, cfg)
    X[1] = 0.5  # constant rows have no variance but a mean square: RMSNorm takes them
    cfg = bh.BlockConfig(d_model=4, d_ff=3, norm="pre", norm_type="rms", ln_eps=0.0)
    T = torch.randn(3, 4, dtype=torch.float64)
    assert rel_err(bh.hessian(p, X, cfg, target=T).dense(), reference.hessian(p, X, cfg, target=T).dense()) <= TOL


def test_model_of_llama_blocks_products_and_dense():
    """A stack of Llama blocks: the model operator's products compose the blocks' exact products (against
    torch.func on the model's plain forward); the model's dense Hessian, assembled from those products, and
    its parts match the reference's (outer + functional == full)."""
    from blockhess.config import ModelConfig
    block = bh.BlockConfig(d_model=6, d_ff=5, rms_offset=1.0, **dict(LLAMA, d_k=2, d_v=2))
    cfg = ModelConfig(blocks=(block, block), embedding="none", head=3, final_norm=True)
    p = randomize(bh.init_params(cfg, seed=1), 1)
    X = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    T = torch.randint(0, 3, (2, 3), generator=torch.Generator().manual_seed(4))
    R = reference.hessian(p, X, cfg, loss="ce", target=T)
    A = bh.hessian_operator(p, X, cfg, loss="ce", target=T)
    V = torch.randn(A.shape[0], 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert_close(A @ V, R.dense() @ V, what="model products")
    H = bh.hessian(p, X, cfg, loss="ce", target=T)
    assert_close(H.dense(), R.dense(), what="model dense Hessian")
    assert_close(H.outer.dense(), R.outer.dense(), what="model outer part")
    assert_close(H.functional.dense(), R.functional.dense(), what="model functional part")
    assert_close(H.outer.dense() + H.functional.dense(), H.dense(), scale=fro(H.dense()), tol=1e-12,
                 what="outer + functional")


@pytest.mark.parametrize("embed_norm", [False, True])
def test_model_rms_norms_and_embed_scale(embed_norm):
    """A model's RMSNorms (``norm_type="rms"``, Gemma's ``rms_offset``) and a scaled token embedding with a tied
    head, over blocks the Kronecker-factor walk takes: the walk's dense Hessian and its parts, and the operator's
    products, against the reference (torch.func on the plain forward)."""
    from blockhess.config import ModelConfig
    block = bh.BlockConfig(d_model=4, d_ff=5, n_heads=2, norm="pre", ln_affine=True, ln_eps=1e-5, activation="silu",
                           qkv_bias=True, out_proj=True, causal=True)
    cfg = ModelConfig(blocks=(block, block), embedding="token", vocab=5, embed_norm=embed_norm, final_norm=True,
                      norm_type="rms", norm_bias=False, norm_eps=1e-6, rms_offset=1.0, embed_scale=3.0 ** 0.5, head=5,
                      head_bias=False, tied=True)
    p = randomize(bh.init_params(cfg, seed=2), 2)
    ids = torch.tensor([[1, 2, 3], [0, 4, 2]])
    T = torch.tensor([[1, 0, 3], [2, 2, 4]])
    assert_close(bh.forward(p, ids, cfg), reference.forward(p, ids, cfg), tol=1e-13, what="forward")
    H, R = bh.hessian(p, ids, cfg, loss="ce", target=T), reference.hessian(p, ids, cfg, loss="ce", target=T)
    assert_close(H.dense(), R.dense(), what="dense")
    assert_close(H.functional.dense(), R.functional.dense(), what="functional part")
    A = bh.hessian_operator(p, ids, cfg, loss="ce", target=T)
    V = torch.randn(A.shape[0], 3, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    assert_close(A @ V, R.dense() @ V, what="products")


def test_model_config_llama_fields_refused():
    from blockhess.config import ModelConfig
    block = bh.BlockConfig(d_model=4, d_ff=5)
    with pytest.raises(ValueError, match="an RMSNorm .* has no shift beta"):
        ModelConfig(blocks=(block,), embedding="token", vocab=5, final_norm=True, norm_type="rms")
    with pytest.raises(ValueError, match="rms_offset=1.0 needs norm_type='rms'"):
        ModelConfig(blocks=(block,), embedding="token", vocab=5, final_norm=True, rms_offset=1.0)
    with pytest.raises(ValueError, match="embed_scale=2.0 scales a token embedding"):
        ModelConfig(blocks=(block,), d_in=3, embed_scale=2.0)
    with pytest.raises(ValueError, match="sliding_window=4 needs causal=True"):
        bh.BlockConfig(d_model=4, d_ff=5, sliding_window=4)


def test_model_of_llama_blocks_dense_memory_refused():
    """The dense Hessian of a model of Llama blocks whose n × n result cannot fit is refused before any product."""
    from blockhess.config import ModelConfig
    block = bh.BlockConfig(d_model=4, d_ff=3, **dict(LLAMA, d_k=2, d_v=2))
    cfg = ModelConfig(blocks=(block,), embedding="token", vocab=200_000, head=None)
    p = bh.init_params(cfg, seed=0)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(bh.InsufficientMemoryError, match=r"the dense 800\d+x800\d+ Hessian"):
        bh.hessian(p, ids, cfg, loss="mse", target=torch.zeros(1, 3, 4, dtype=torch.float64))
