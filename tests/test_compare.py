"""``blockhess compare`` on a tiny GPT-2 read from a ``save_pretrained`` folder: every reported number of
one module recomputed here from its definition (KFAC's and EKFAC's from curvlinops' own dense matrices on
the model's own logits, GPTQ's proxy from the layer's inputs, Sophia's diagonal from Hugging Face's
gradients, Hutchinson's from its probes, each against the dense closed form :func:`blockhess.hessian`),
the index map and the loss scale checked by curvlinops' exact GGN (on the GPT-2 and on a tiny
``LlamaForCausalLM`` read from its folder, its RMSNorms and rotary tables made float64 on the instance),
exact against exact, Hutchinson's error shrinking with more probes, and the one-line errors of bad input."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import blockhess as bh
from blockhess_lab import compare as C
from blockhess_lab.cli import main

transformers = pytest.importorskip("transformers")
curvlinops = pytest.importorskip("curvlinops")

PNG = b"\x89PNG\r\n\x1a\n"
TOL = 1e-10
SIZES = dict(n_embd=8, n_head=2, n_layer=1, n_inner=8, vocab_size=8, n_positions=8)
ARGS = ["--batch", "3", "--seq-len", "3", "--sophia-samples", "1,4", "--hutchinson-samples", "2,8", "--seed", "1",
        "--kronfluence-draws", "2"]
#: kronfluence_ekfac's column: present where kronfluence is installed (requirements-laplace.txt), else recorded not run
KRONFLUENCE = importlib.util.find_spec("kronfluence") is not None


def _tiny_gpt2():
    torch.manual_seed(0)
    c = transformers.GPT2Config(**SIZES, tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(c).double().eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny model's folder, the command's JSON and the output folder."""
    root = tmp_path_factory.mktemp("cmp")
    _tiny_gpt2().save_pretrained(root / "model")
    out = root / "out"
    assert main(["compare", "--model", str(root / "model"), "--out", str(out), "--quiet", *ARGS]) == 0
    return root / "model", json.loads((out / "compare.json").read_text()), out


def _settings(model_dir) -> C.Settings:
    return C.Settings(None, str(model_dir), 3, 3, (1, 4), (2, 8), 0.01, 1, 2)


def _logits(model, ids):
    with sdpa_kernel(SDPBackend.MATH):
        return model(ids).logits


def test_outputs_and_structure(run):
    _, rep, out = run
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        ["compare.json", "compare.md"] + rep["figures"])
    assert all((out / f).read_bytes().startswith(PNG) for f in rep["figures"])
    assert rep["whole"] == [n for n in rep["modules"] if n.startswith("blocks.") or n == "W_H"]
    assert ("not_run" in rep["methods"]["kronfluence_ekfac"]) is not KRONFLUENCE
    for part in C.PARTS:
        res = rep["results"][part]
        assert list(res) == [*rep["modules"], C.WHOLE]
        for row in ("blocks.0.W_Q", "W_H", C.WHOLE):  # layers: every method
            assert set(res[row]) == {"kfac", "ekfac", "gptq_raw", "gptq_best", "sophia_1", "sophia_4", "hutchinson_2",
                                     "hutchinson_8"} | ({"kronfluence_ekfac"} if KRONFLUENCE else set())
        assert set(res["W_E"]) == {"sophia_1", "sophia_4", "hutchinson_2", "hutchinson_8"}  # a token table
    md = (out / "compare.md").read_text()
    assert "## Against the exact GGN" in md and "| `blocks.0.W_V` |" in md
    assert ("| kronfluence_ekfac |" in md) is KRONFLUENCE and ("kronfluence_ekfac`: not run" in md) is not KRONFLUENCE


def test_every_number_of_one_module_from_its_definition(run):
    """blocks.0.W_V (a third of GPT-2's fused c_attn) and W_H against the dense closed form."""
    model_dir, rep, _ = run
    s = _settings(model_dir)
    model = transformers.GPT2LMHeadModel.from_pretrained(model_dir).double().eval()
    cfg, params = bh.from_torch(model)
    gen = torch.Generator().manual_seed(s.seed)
    ids = torch.randint(0, 8, (3, 4), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    test_ids = torch.randint(0, 8, (1, 4), generator=gen)
    mods = [n for n, v in params.items() if v.ndim == 2]
    H = bh.hessian(params, x, cfg, loss="ce", target=y, wrt=mods)
    dense = {"outer": H.outer.dense(), "full": H.dense()}
    sizes = {n: params[n].numel() for n in mods}
    start = {n: sum(sizes[m] for m in mods[:mods.index(n)]) for n in mods}
    d = SIZES["n_embd"]

    def grad(inp, tgt):  # Hugging Face's own gradient, in our layout: W = weight (Conv1D) / weight.T (Linear)
        model.zero_grad()
        z = _logits(model, inp)
        torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), tgt.reshape(-1)).backward()
        a = model.transformer.h[0].attn.c_attn.weight.grad
        return {"blocks.0.W_V": a[:, 2 * d:].reshape(-1).clone(), "W_H": model.lm_head.weight.grad.T.reshape(-1).clone()}

    g = grad(x, y)
    gt = grad(test_ids[:, :-1], test_ids[:, 1:])
    Gs = [grad(x[i:i + 1], y[i:i + 1]) for i in range(3)]
    whole = rep["whole"]
    ww = torch.cat([torch.arange(start[n], start[n] + sizes[n]) for n in whole])
    lam = s.damping * float(torch.linalg.eigvalsh(dense["outer"][ww][:, ww])[-1])
    assert abs(rep["damping"] - lam) <= TOL * lam

    # curvlinops on the model as it is, its c_attn a Conv1D replaced here by hand: W_V's rows of the Linear
    lin = C.linearized(model)
    net = C._Logits(lin)
    kf = {}
    for kind, cls in (("kfac", curvlinops.KFACLinearOperator), ("ekfac", curvlinops.EKFACLinearOperator)):
        Wqkv = lin.transformer.h[0].attn.c_attn.weight
        K = cls(net, torch.nn.CrossEntropyLoss(), [Wqkv, lin.lm_head.weight], [(x, y.reshape(-1))],
                fisher_type="type-2", kfac_approx="expand", check_deterministic=False, num_data=3)
        M = K @ torch.eye(K.shape[1], dtype=torch.float64)
        n_attn = Wqkv.numel()
        # Linear weight (3d, d): W_V = weight[2d:, :].T, vec_r index (i, o) -> flat (2d + o) * d + i
        iv = torch.tensor([(2 * d + o) * d + i for i in range(d) for o in range(d)])
        V = lin.lm_head.weight.shape[0]  # W_H = weight.T, (d, V): index (i, o) -> n_attn + o * d + i
        ih = torch.tensor([n_attn + o * d + i for i in range(d) for o in range(V)])
        kf[kind] = {"blocks.0.W_V": M[iv][:, iv], "W_H": M[ih][:, ih]}

    # GPTQ: the inputs of c_attn are ln_1's outputs, of lm_head ln_f's
    seen = {}
    hooks = [model.transformer.h[0].attn.c_attn.register_forward_pre_hook(lambda m, a: seen.__setitem__("v", a[0])),
             model.lm_head.register_forward_pre_hook(lambda m, a: seen.__setitem__("h", a[0]))]
    with torch.no_grad():
        _logits(model, x)
    for h in hooks:
        h.remove()
    P = {row: torch.kron(2 / 3 * seen[k].reshape(-1, d).T @ seen[k].reshape(-1, d), torch.eye(n, dtype=torch.float64))
         for row, k, n in (("blocks.0.W_V", "v", d), ("W_H", "h", V))}

    # Sophia: one draw from the model's softmax (the command's first use of its generator)
    with torch.no_grad():
        probs = torch.softmax(_logits(model, x).reshape(-1, V), -1)
    ys = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(s.seed)).reshape(y.shape)
    gs = grad(x, ys)

    for part in C.PARTS:
        A = bh.hessian_operator(params, x, cfg, loss="ce", target=y, part=part)
        hutch = bh.operators.hutchinson_diagonal(A[tuple(mods), tuple(mods)], 2, seed=s.seed).value
        for row in ("blocks.0.W_V", "W_H"):
            ii = torch.arange(start[row], start[row] + sizes[row])
            Hb = dense[part][ii][:, ii]
            w, U = torch.linalg.eigh(Hb)
            lamI = lam * torch.eye(len(ii), dtype=torch.float64)
            x_ex = torch.linalg.solve(Hb + lamI, g[row])
            sc_ex = torch.stack([Gi[row] for Gi in Gs]) @ torch.linalg.solve(Hb + lamI, gt[row])
            approx = {"kfac": kf["kfac"][row], "ekfac": kf["ekfac"][row], "gptq_raw": P[row],
                      "gptq_best": float((P[row] * Hb).sum() / (P[row] * P[row]).sum()) * P[row],
                      "sophia_1": torch.diag(9 * gs[row] ** 2), "hutchinson_2": torch.diag(hutch[ii])}
            for key, M in approx.items():
                got = rep["results"][part][row][key]
                wm, Um = torch.linalg.eigh(M)
                xm = torch.linalg.solve(M + lamI, g[row])
                sc = torch.stack([Gi[row] for Gi in Gs]) @ torch.linalg.solve(M + lamI, gt[row])
                want = {"rel_fro": float((M - Hb).norm() / Hb.norm()),
                        "top_cos": float((Um[:, wm >= wm[-1] - 1e-8 * wm.abs().max()].T @ U[:, -1]).norm()),
                        "inverse_cos": float(x_ex @ xm / (x_ex.norm() * xm.norm()))}
                for k, v in want.items():
                    assert abs(got[k] - v) <= 1e-8 * max(1.0, abs(v)), (part, row, key, k, got[k], v)
                r_ex, r_m = sc_ex.argsort().argsort(), sc.argsort().argsort()  # three distinct scores: ranks
                assert got["spearman"] == pytest.approx(1 - 6 * float(((r_ex - r_m) ** 2).sum()) / (3 * 8), abs=1e-12)
                if key.startswith(("sophia", "hutchinson")):
                    dd = torch.diagonal(Hb)
                    assert got["diag_rel"] == pytest.approx(float((torch.diagonal(M) - dd).norm() / dd.norm()),
                                                            rel=1e-10)
            t = float(torch.trace(Hb))
            assert rep["results"][part][row]["hutchinson_2"]["trace_rel"] == pytest.approx(
                abs(float(hutch[ii].sum()) - t) / abs(t), rel=1e-10)
            assert rep["exact"][part][row]["eig_max"] == pytest.approx(float(w[-1]), rel=1e-10)


def _covered(pr):
    covered = [n for n in C.modules_of(pr) if n in pr.index]
    return covered, torch.cat([pr.index[n] for n in covered])


def test_kronfluence_ekfac_dense_against_its_own_scores(run):
    """compare's dense EK-FAC from kronfluence's factors, moved by the index map and at our scale, gives
    kronfluence's own pairwise scores: ``T · Gᵀ (M + λI)⁻¹ g_test`` (``G``, ``g_test`` our gradients of mean
    losses, kronfluence's of losses summed over ``T`` tokens, its damping ``T λ``) to 1e-10; the JSON's
    whole-model numbers are this matrix's and these scores'."""
    pytest.importorskip("kronfluence")
    model_dir, rep, _ = run
    s = _settings(model_dir)
    pr = C.problem(s)
    lam = rep["damping"]
    M, scores = C.kronfluence_ekfac(pr, s.kronfluence_draws, lam, s.seed)
    covered, idx = _covered(pr)
    assert covered == rep["whole"]
    Mc = M[idx][:, idx]
    G = torch.stack([C.gradients(pr, covered, pr.inputs[i:i + 1], pr.target[i:i + 1]) for i in range(3)], 1)
    g, g_test = C.gradients(pr, covered, pr.inputs, pr.target), C.gradients(pr, covered, *pr.test)
    I = torch.eye(Mc.shape[0], dtype=torch.float64)
    want = 3 * G.T @ torch.linalg.solve(Mc + lam * I, g_test)
    assert float((scores - want).norm() / want.norm()) <= TOL
    Hw = bh.hessian(pr.params, pr.inputs, pr.cfg, loss="ce", target=pr.target, wrt=covered).outer.dense()
    got = rep["results"]["outer"][C.WHOLE]["kronfluence_ekfac"]
    assert got["rel_fro"] == pytest.approx(float((Mc - Hw).norm() / Hw.norm()), rel=1e-10)
    x, xm = torch.linalg.solve(Hw + lam * I, g), torch.linalg.solve(Mc + lam * I, g)
    assert got["inverse_cos"] == pytest.approx(float(x @ xm / (x.norm() * xm.norm())), abs=1e-10)
    assert got["spearman"] == pytest.approx(C.spearman(G.T @ torch.linalg.solve(Hw + lam * I, g_test), scores), abs=1e-12)


def test_kronfluence_ekfac_estimates_our_ggn_scale(run):
    """With labels drawn from the softmax, the trace of kronfluence's EK-FAC (the mean squared norm of its
    per-sequence gradients) is unbiased for ``T`` times our GGN's trace, so compare's matrix (divided by
    ``T = 3`` tokens) has our trace: within 15% at 50 draws (a wrong scale would be off by 3x)."""
    pytest.importorskip("kronfluence")
    pr = C.problem(_settings(run[0]))
    covered, idx = _covered(pr)
    M, _ = C.kronfluence_ekfac(pr, 50, 0.1, 1)
    H = bh.hessian(pr.params, pr.inputs, pr.cfg, loss="ce", target=pr.target, wrt=covered).outer.dense()
    assert abs(float(torch.trace(M[idx][:, idx]) / torch.trace(H)) - 1) < 0.15
    with pytest.raises(ValueError, match="draws must be >= 1"):
        C.kronfluence_ekfac(pr, 0, 0.1, 1)


def test_index_map_and_scale_by_curvlinops_ggn(run):
    """curvlinops' exact GGN on the linearised model, moved by the index map, is our exact GGN (1e-10):
    the same positions, the same loss (mean over tokens)."""
    model_dir, _, _ = run
    _ggn_check(C.problem(_settings(model_dir)))


LLAMA_SIZES = dict(vocab_size=8, hidden_size=8, intermediate_size=6, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 500.0}, pad_token_id=None,
                   bos_token_id=None, eos_token_id=None)


def _tiny_llama(**kw):
    """Grouped-query (4 query heads on 2 K/V heads), SwiGLU, RoPE, final RMSNorm, untied head; float64 weights
    away from the initialisation (matrices N(0, 0.5²), RMSNorm weights 1 + N(0, 0.3²))."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA_SIZES, **kw}, attn_implementation="sdpa"))
    model = model.double().eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1.0 + 0.3 * r if "norm" in n else 0.5 * r)
    return model


def _ggn_check(pr):
    """curvlinops' GGN moved by ``pr.index`` against ``bh.hessian``'s outer part (compare's exact matrix,
    ``C.exact_dense``) to 1e-10."""
    mods = C.modules_of(pr)
    covered = [n for n in mods if n in pr.index]
    assert covered == C.whole_of(pr)
    idx = torch.cat([pr.index[n] for n in covered])
    Gl = curvlinops.GGNLinearOperator(pr.module, torch.nn.CrossEntropyLoss(), pr.layers, [(pr.inputs, pr.target.reshape(-1))],
                                      check_deterministic=False)
    M = (Gl @ torch.eye(Gl.shape[1], dtype=torch.float64))[idx][:, idx]
    ours = bh.hessian(pr.params, pr.inputs, pr.cfg, loss="ce", target=pr.target, wrt=covered).outer.dense()
    assert float((M - ours).norm() / ours.norm()) <= TOL


def test_llama_index_map_and_scale_by_curvlinops_ggn(tmp_path):
    """A saved LlamaForCausalLM read by --model: its RMSNorms and rotary tables computed in float64 on the
    instance (the class untouched), its logits blockhess.forward's (1e-12), and curvlinops' exact GGN on
    its nn.Linear layers, moved by the index map, our exact GGN (1e-10)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    cls_forward = LlamaRMSNorm.forward
    _tiny_llama().save_pretrained(tmp_path / "llama")
    pr = C.problem(C.Settings(None, str(tmp_path / "llama"), 2, 3, (1,), (2,), 0.01, 1))
    assert LlamaRMSNorm.forward is cls_forward
    assert pr.description["kind"] == "LlamaForCausalLM" and pr.description["forward_rel_diff"] <= 1e-12
    assert pr.cfg.final_norm and len(pr.layer_names) == 8  # q, k, v, o, gate, up, down, the head
    _ggn_check(pr)


def test_forward_check_refuses_hugging_face_float32_norms():
    """Unpatched, Hugging Face's float32 RMSNorm and rotary tables move the logits by float32 rounding:
    check_forward refuses the module by name; after float64_llama it passes."""
    model = _tiny_llama()
    cfg, params = bh.from_torch(model)
    ids = torch.randint(0, 8, (2, 3), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="--model m: the module's logits differ from blockhess.forward's"):
        C.check_forward(model, cfg, params, ids, "--model m")
    assert C.check_forward(C.float64_llama(model), cfg, params, ids, "--model m") <= 1e-12
    bad = _tiny_llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})
    with pytest.raises(ValueError, match="rope_type 'linear'; compare reads rope_type 'default'"):
        C.float64_llama(bad)


def test_llama_preset_is_a_module():
    """--preset llama: a LlamaForCausalLM (2 layers, d = 16, 4 query heads on 2 K/V heads, final RMSNorm,
    untied head) whose every weight matrix of a linear map is an nn.Linear curvlinops and the GPTQ proxy see."""
    pr = C.problem(C.Settings("llama", None, 2, 2, (1,), (2,), 0.01, 0))
    assert pr.description["kind"] == "LlamaForCausalLM" and pr.description["forward_rel_diff"] <= 1e-12
    b = pr.cfg.blocks[0]
    assert (len(pr.cfg.blocks), b.d_model, b.n_heads, b.n_kv_heads, b.gated, b.rope, b.norm_type) == (
        2, 16, 4, 2, True, True, "rms")
    assert pr.cfg.final_norm and "W_H" in pr.params and len(pr.layer_names) == 15
    assert [n for n in C.modules_of(pr) if n in pr.index] == C.whole_of(pr)


def test_exact_against_exact():
    gen = torch.Generator().manual_seed(0)
    B = torch.randn(12, 12, generator=gen, dtype=torch.float64)
    H = B @ B.T
    g, g_test = torch.randn(12, generator=gen, dtype=torch.float64), torch.randn(12, generator=gen, dtype=torch.float64)
    G = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    m = C.metrics(H, H.clone(), 0.1, g, G, g_test)
    assert m["rel_fro"] == 0.0 and m["top_cos"] == pytest.approx(1.0, abs=1e-12)
    assert m["inverse_cos"] == pytest.approx(1.0, abs=1e-12) and m["spearman"] == pytest.approx(1.0, abs=1e-12)
    D = torch.diag(torch.diagonal(H))  # a diagonal matrix: as a vector and as a matrix alike, diag_rel 0
    md = C.metrics(D, torch.diagonal(D), 0.1, g, G, g_test)
    assert md["rel_fro"] == 0.0 and md["diag_rel"] == 0.0 and md["top_cos"] == pytest.approx(1.0, abs=1e-12)
    assert md["inverse_cos"] == pytest.approx(1.0, abs=1e-12)
    other = C.metrics(H, torch.diagonal(H), 0.1, g, G, g_test)  # and a wrong one is not 0
    assert other["rel_fro"] > 0.1 and other["diag_rel"] == 0.0


def test_block_diagonal_eigen_and_solve_by_components():
    """_top and _inv on a block-diagonal matrix (a layer-wise approximation) equal the dense ones."""
    gen = torch.Generator().manual_seed(1)
    blocks = [torch.randn(k, k, generator=gen, dtype=torch.float64) for k in (3, 4, 2)]
    M = torch.block_diag(*[b @ b.T for b in blocks])
    p = torch.randperm(9, generator=gen)
    M = M[p][:, p]
    b = torch.randn(9, 2, generator=gen, dtype=torch.float64)
    assert len(C._components(M)) == 3
    assert torch.allclose(C._inv(M, 0.3, b), torch.linalg.solve(M + 0.3 * torch.eye(9, dtype=torch.float64), b),
                          rtol=1e-12, atol=1e-12)
    v = torch.linalg.eigh(M)[1][:, -1]
    assert C._top(M).shape == (9, 1) and abs(float(C._top(M)[:, 0] @ v)) == pytest.approx(1.0, abs=1e-12)
    P = torch.kron(blocks[0] @ blocks[0].T, torch.eye(2, dtype=torch.float64))  # each eigenvalue twice: a 2-d top space
    Q = C._top(P)
    assert Q.shape == (6, 2) and torch.allclose(Q.T @ Q, torch.eye(2, dtype=torch.float64), atol=1e-12)
    w, U = torch.linalg.eigh(P)
    assert torch.allclose(Q @ Q.T, U[:, -2:] @ U[:, -2:].T, atol=1e-10)
    assert C._top(torch.tensor([1.0, 3.0, 3.0], dtype=torch.float64)).shape == (3, 2)


def test_hutchinson_error_shrinks_with_samples():
    gen = torch.Generator().manual_seed(2)
    B = torch.randn(30, 30, generator=gen, dtype=torch.float64)
    H = B @ B.T
    err = {N: sum(C.metrics(H, bh.operators.hutchinson_diagonal(H, N, seed=k).value, 0.1, H[0], H[:, :4], H[1])
                  ["diag_rel"] for k in range(8)) / 8 for N in (2, 32)}
    assert err[32] < err[2] / 2


@pytest.mark.parametrize("extra, needle", [
    (["--preset", "bert"], "--preset: unknown preset 'bert'"),
    (["--sophia-samples", "0"], "--sophia-samples: every sample count must be >= 1"),
    (["--sophia-samples", "1,x"], "--sophia-samples must be comma-separated integers"),
    (["--hutchinson-samples", "1"], "--hutchinson-samples: every sample count must be >= 2"),
    (["--hutchinson-samples", "4,4"], "--hutchinson-samples names a sample count twice"),
    (["--damping", "0"], "--damping must be a finite number > 0"),
    (["--damping", "nan"], "--damping must be a finite number > 0"),
    (["--batch", "1"], "--batch must be >= 2"),
    (["--kronfluence-draws", "0"], "--kronfluence-draws must be >= 1"),
    (["--model", "/nonexistent/dir"], "--model /nonexistent/dir: not a save_pretrained folder"),
])
def test_bad_inputs_exit_2(tmp_path, capsys, extra, needle):
    assert main(["compare", "--out", str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockhess compare: error: ") and needle in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_seq_len_past_positions_exit_2(run, tmp_path, capsys):
    model_dir, _, _ = run
    assert main(["compare", "--model", str(model_dir), "--seq-len", "9", "--out", str(tmp_path / "o")]) == 2
    assert "--seq-len 9 exceeds the model's 8 positions" in capsys.readouterr().err


def test_missing_extras_exit_2(tmp_path, capsys, monkeypatch):
    """Without curvlinops (requirements-laplace.txt) the command says which package it needs and how to install it, one line."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "curvlinops" else real(name, *a))
    assert main(["compare", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "needs curvlinops: pip install 'blockhess[hf]' and pip install --no-deps -r requirements-laplace.txt" in err
    assert not (tmp_path / "o").exists()


def test_llama_other_rope_exit_2(tmp_path, capsys):
    _tiny_llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}).save_pretrained(tmp_path / "m")
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["compare", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "o")]) == 2
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert last == (f"blockhess compare: error: --model {tmp_path / 'm'}: a LlamaForCausalLM with rope_type 'linear'; "
                    "compare reads rope_type 'default'")
    assert not (tmp_path / "o").exists()


def _random_ids(seed: int) -> torch.Tensor:
    """The fixture's random batch and test sequence (3 then 1 sequences of 4 ids from ``seed``), one array."""
    gen = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randint(0, 8, (3, 4), generator=gen), torch.randint(0, 8, (1, 4), generator=gen)])


def test_data_file_gives_the_same_run(run, tmp_path):
    """--data with the random batch and test sequence written to an .npy file (the last row the test) reruns
    the fixture: the same numbers; a .pt of the same ids reads the same."""
    import numpy as np

    model_dir, rep, _ = run
    ids = _random_ids(1)
    np.save(tmp_path / "ids.npy", ids.numpy().astype(np.int32))
    torch.save(ids, tmp_path / "ids.pt")
    args = [a for i, a in enumerate(ARGS) if a not in ("--batch", "--seq-len") and ARGS[i - 1] not in ("--batch", "--seq-len")]
    assert main(["compare", "--model", str(model_dir), "--data", str(tmp_path / "ids.npy"), "--out", str(tmp_path / "o"),
                 "--quiet", *args]) == 0
    again = json.loads((tmp_path / "o" / "compare.json").read_text())
    assert again["results"] == rep["results"] and again["damping"] == rep["damping"]
    assert again["settings"]["data"] == str(tmp_path / "ids.npy") and again["settings"]["batch"] == 3
    cfg = C.problem(_settings(model_dir)).cfg
    x, y, (xt, yt) = C.load_data(cfg, str(tmp_path / "ids.pt"))
    assert torch.equal(x, ids[:3, :-1]) and torch.equal(y, ids[:3, 1:]) and torch.equal(xt, ids[3:, :-1])
    assert torch.equal(yt, ids[3:, 1:]) and x.dtype == torch.long


def _tiny_vit_cfg():
    c = transformers.ViTConfig(image_size=4, patch_size=2, num_channels=1, hidden_size=4, num_hidden_layers=1,
                               num_attention_heads=1, intermediate_size=4, num_labels=3)
    return bh.from_torch(transformers.ViTForImageClassification(c).double().eval())[0]


def test_data_file_images(tmp_path):
    import numpy as np

    cfg = _tiny_vit_cfg()
    images = np.random.default_rng(0).standard_normal((4, 1, 4, 4)).astype(np.float32)
    labels = np.array([0, 2, 1, 1])
    np.savez(tmp_path / "d.npz", images=images, labels=labels)
    x, y, (xt, yt) = C.load_data(cfg, str(tmp_path / "d.npz"))
    assert x.dtype == torch.float64 and torch.equal(x, torch.from_numpy(images[:3]).double())
    assert y.tolist() == [0, 2, 1] and yt.tolist() == [1] and xt.shape == (1, 1, 4, 4)
    for kw, needle in [(dict(images=images[:, :, :3], labels=labels), "images must have shape (N, 1, 4, 4)"),
                       (dict(images=images, labels=labels + 1), "labels must lie in [0, 3) (the classes), got [1, 3]"),
                       (dict(images=images, labels=labels[:3]), "labels must have shape (4,)"),
                       (dict(images=images, labels=labels * 0.5), "labels must be integers"),
                       (dict(images=images.astype(np.int64), labels=labels), "images must be floating point"),
                       (dict(images=np.full_like(images, np.nan), labels=labels), "images must be finite"),
                       (dict(images=images), "no labels array in it")]:
        np.savez(tmp_path / "bad.npz", **kw)
        with pytest.raises(ValueError, match=f"--data {tmp_path / 'bad.npz'}: " + needle.replace("(", r"\(").replace(
                ")", r"\)").replace("[", r"\[")):
            C.load_data(cfg, str(tmp_path / "bad.npz"))
    with pytest.raises(ValueError, match="a ViT reads an .npz of images and labels"):
        C.load_data(cfg, str(tmp_path / "x.npy"))


@pytest.mark.parametrize("make, needle", [
    (lambda p: __import__("numpy").save(p + ".npy", _random_ids(1).double().numpy()), "token ids must be integers"),
    (lambda p: __import__("numpy").save(p + ".npy", _random_ids(1)[0].numpy()), "token ids must have shape (N, L+1)"),
    (lambda p: __import__("numpy").save(p + ".npy", _random_ids(1)[:2].numpy()), "with N >= 3 and L >= 2, got (2, 4)"),
    (lambda p: __import__("numpy").save(p + ".npy", _random_ids(1).numpy() + 1), "must lie in [0, 8) (the vocabulary)"),
    (lambda p: __import__("numpy").save(p + ".npy", torch.zeros(3, 10, dtype=torch.long).numpy()),
     "9 tokens per sequence exceed the model's 8 positions"),
    (lambda p: torch.save({"ids": _random_ids(1)}, p + ".pt"), "expected an array of token ids, got dict"),
    (lambda p: open(p + ".pt", "w").write("not a tensor"), "cannot read it"),
    (lambda p: __import__("numpy").savez(p + ".npz", ids=_random_ids(1).numpy()), "a language model reads a .pt or .npy"),
    (lambda p: open(p + ".txt", "w").write("1 2 3"), "expected a .pt, .npy, .npz file"),
    (lambda p: None, "no such file"),
])
def test_bad_data_file_exit_2(run, tmp_path, capsys, make, needle):
    model_dir, _, _ = run
    stem = str(tmp_path / "d")
    make(stem)
    path = next((str(f) for f in tmp_path.iterdir() if f.name.startswith("d.")), stem + ".npy")
    capsys.readouterr()
    assert main(["compare", "--model", str(model_dir), "--data", path, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert err.startswith(f"blockhess compare: error: --data {path}: ") and needle in err, err
    assert not (tmp_path / "o").exists()


def test_data_with_batch_options_exit_2(run, tmp_path, capsys):
    model_dir, _, _ = run
    import numpy as np

    np.save(tmp_path / "ids.npy", _random_ids(1).numpy())
    assert main(["compare", "--model", str(model_dir), "--data", str(tmp_path / "ids.npy"), "--seq-len", "3",
                 "--out", str(tmp_path / "o")]) == 2
    assert "--seq-len: with --data the batch is the file's rows" in capsys.readouterr().err


def test_identical_training_sequences_give_undefined_rank_correlations(run, tmp_path):
    """Three equal training sequences have equal influence scores under every matrix: their rank correlation is
    undefined, written null and "undefined", and the run still writes every other number."""
    import numpy as np

    model_dir, _, _ = run
    ids = _random_ids(1)
    ids[1:3] = ids[0]
    np.save(tmp_path / "ids.npy", ids.numpy())
    args = [a for i, a in enumerate(ARGS) if a not in ("--batch", "--seq-len") and ARGS[i - 1] not in ("--batch", "--seq-len")]
    assert main(["compare", "--model", str(model_dir), "--data", str(tmp_path / "ids.npy"), "--out", str(tmp_path / "o"),
                 "--quiet", *args]) == 0
    rep = json.loads((tmp_path / "o" / "compare.json").read_text())
    cells = [m for ref in rep["results"].values() for row in ref.values() for m in row.values() if isinstance(m, dict)]
    assert cells and all(m["spearman"] is None for m in cells if "spearman" in m)
    assert all(isinstance(m["rel_fro"], float) for m in cells if "rel_fro" in m)
    assert "undefined" in (tmp_path / "o" / "compare.md").read_text()


def test_spearman_of_constant_scores_is_undefined():
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    assert C.spearman(a, a.flip(0)) == pytest.approx(-1.0) and C.spearman(a, torch.full((3,), 2.0)) is None


def test_a_file_torch_load_fails_on_in_any_way_is_one_line(run, tmp_path, capsys, monkeypatch):
    """torch.load raises many kinds for a corrupt file (a KeyError among them): each is one line naming --data."""
    model_dir, _, _ = run
    torch.save(_random_ids(1), tmp_path / "d.pt")

    def corrupt(*args, **kwargs):
        raise KeyError(101)

    monkeypatch.setattr(torch, "load", corrupt)
    assert main(["compare", "--model", str(model_dir), "--data", str(tmp_path / "d.pt"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"blockhess compare: error: --data {tmp_path / 'd.pt'}: cannot read it: not a whole file written by torch.save (KeyError)", err
    assert not (tmp_path / "o").exists()


def test_preset_and_model_together_exit_2(run, tmp_path, capsys):
    model_dir, _, _ = run
    assert main(["compare", "--model", str(model_dir), "--preset", "vit", "--out", str(tmp_path / "o")]) == 2
    assert "--preset and --model exclude each other" in capsys.readouterr().err and not (tmp_path / "o").exists()
