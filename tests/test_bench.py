"""Smoke test of ``blockhess bench --quick``: every path runs, outputs agree, nothing is timed.

Works without the ``bench`` extra: JAX and curvlinops are disabled here (as if not
installed) and must be reported as skipped with a reason. No assertion is about speed.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import blockhess as bh
from blockhess_lab import cli
from blockhess_lab import bench

from conftest import FLOAT32_FACTOR, TOL, assert_close, assert_float32_close, fro, to_dtype


def _args(tmp_path, *extra):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(["--out", str(tmp_path), *extra])


def test_bench_is_a_subcommand():
    assert cli.COMMANDS["bench"] == "bench"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # one case of each group, layout and problem kind (the other quick cases run the same code on other sizes)
    args = _args(out, "--quick", "--disable", "jax,curvlinops",
                 "--only", "a/block/,b/ce/,b/mse/4x8x16/paired,b/mse/torch-layer,m/,c/")
    assert bench.run(args) == 0
    with open(out / "bench.json") as f:
        return out, json.load(f)


def test_quick_writes_json_markdown_plot(quick):
    out, res = quick
    assert (out / "bench.md").read_text().count("|") > 50
    assert (out / "bench.png").stat().st_size > 1000
    env = res["env"]
    for key in ("torch", "torch_threads", "cpu_model", "logical_cpus", "memory_total_gib", "load_average_at_start"):
        assert env[key] is not None
    assert {c["group"] for c in res["cases"]} == {"a", "b", "c", "m"}
    assert res["targets"]


def test_quick_every_method_measured_or_explained(quick):
    _, res = quick
    for case in res["cases"]:
        if case["group"] == "c":
            assert case["closed_form"] and case["closed_form"][0]["ok"], case
            continue
        for m, e in case["methods"].items():
            if m in ("jax", "curvlinops"):
                assert e["available"] is False and "disabled" in e["skip_reason"]
                continue
            # measured, or a reason is given (skip / error), never silently missing
            assert e.get("median_s") is not None or e.get("skip_reason") or e.get("error"), (case["id"], m, e)


def _float32_agreement(spec: dict) -> float:
    """The most a float32 baseline may differ from the float32 closed form on the bench's problem
    ``spec``, relative to the closed form: ``‖C − M‖ <= ‖C − R‖ + ‖M − R‖ <= (3 + 1) x`` float32
    autograd's own error against the float64 reference ``R`` of the same inputs (conftest's rule,
    itself asserted here on the closed form)."""
    from blockhess_lab import bench_worker as W

    P = W.Problem(spec)
    outs = {name: canon(call()) for name, (call, canon, _) in
            ((m, getattr(W, f"setup_{m}")(P)) for m in ("closed_form", "autograd", "jacrev", "jacfwd"))}
    P.params, P.X = to_dtype(P.params, torch.float64), P.X.double()  # the same numbers, in float64
    call, canon, _ = W.setup_jacrev(P)
    R = canon(call())
    C = outs.pop("closed_form").reshape(R.shape)
    autograd = [M.reshape(R.shape) for M in outs.values()]
    assert_float32_close(C, autograd, R, what=spec["of"])
    worst = max(max(fro(M.double() - R) for M in autograd), fro(R.float().double() - R))
    return (FLOAT32_FACTOR + 1) * worst / fro(C)


def test_quick_outputs_agree_with_closed_form(quick):
    _, res = quick
    checked = 0
    for case in res["cases"]:
        if case["group"] == "c":
            continue
        # the rule in float64; float32 by its own autograd's error (an 8-column sketch: the same measure, of the sketch)
        tol = TOL if case["problem"]["dtype"] == "float64" else _float32_agreement(case["problem"])
        for m, e in case["methods"].items():
            for key in ("rel_err", "sketch_rel_err"):
                if e.get(key) is not None:
                    assert e[key] <= tol, (case["id"], m, key, e[key], tol)
                    checked += 1
    assert checked >= 10


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="--cases"):
        bench.run(_args(tmp_path, "--cases", "x"))
    with pytest.raises(ValueError, match="--mem-cap-gb"):
        bench.run(_args(tmp_path, "--mem-cap-gb", "0"))


def test_jax_block_matches_closed_form():
    """The JAX mirror of the block (the JAX baseline) has our Hessian, MSE and CE."""
    pytest.importorskip("jax")
    import numpy as np

    from blockhess_lab import bench_jax

    cfg = bh.BlockConfig(d_model=4, d_ff=6, d_k=3)
    params = bh.init_params(cfg, seed=3)
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
    theta = np.concatenate([v.reshape(-1).numpy() for v in params.values()])
    shapes = [(k, tuple(v.shape)) for k, v in params.items()]
    for loss, target in (("mse", torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)), ("ce", torch.randint(0, 4, (2, 5), generator=gen))):
        ours = bh.hessian(params, X, cfg, loss=loss, target=target).dense()
        theirs = torch.from_numpy(np.array(bench_jax.make_hessian(shapes, loss)(theta, X.numpy(), target.numpy(), None)))
        assert_close(theirs, ours, what=f"JAX {loss}")


def test_device_cuda_is_refused_clearly_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda: torch sees no CUDA device"):
        bench.run(_args(tmp_path, "--device", "cuda", "--quick"))
    with pytest.raises(ValueError, match="groups a, b and m only"):
        bench.build_plan(_args(tmp_path, "--device", "cuda", "--cases", "c"))
    plan = bench.build_plan(_args(tmp_path, "--device", "cuda", "--quick"))
    assert {c["group"] for c in plan} == {"a", "b", "m"}


def test_out_of_other_files_is_refused_before_any_case(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OSError, match="holds files that are not blockhess results"):
        bench.run(_args(tmp_path, "--quick", "--disable", "jax,curvlinops"))
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_results_folder_is_marked(quick):
    from blockhess_lab.outputs import MARKER

    out, _ = quick
    assert (out / MARKER).is_file()


def _paired(jax_pair: dict, floor: bool = True) -> dict:
    """A (32, 64, 128)-like paired case in the shape run_paired stores (numbers made up)."""
    methods = {"closed_form": {"median_s": 2.0, "median_over_pairs_s": 3.0},
               "jax": {"median_s": 20.0, "samples": 2, "p25_s": 19.0, "p75_s": 21.0},
               "func_hessian": {"error": "out of memory: resident memory passed the cap"}}
    pairs = {"jax": jax_pair}
    if floor:
        methods["floor"] = {"median_s": 1.0}
        pairs["floor"] = {"ratio": 0.5, "closed_form_median_s": 2.0}
    return {"id": "b/mse/32x64x128", "group": "b", "layout": "paired", "methods": methods, "pairs": pairs,
            "out_bytes": 2**20, "problem": {"L": 32, "d": 64, "d_ff": 128, "loss": "mse"}}


def _targets(case):
    return {t["target"].split(": ", 1)[1]: t for t in bench.evaluate_targets({"cases": [case]})}


def test_targets_say_how_each_ratio_was_measured():
    """Beside JAX the same-process ratio; when the closed form could not run again there, JAX's
    warm median over the closed form's table median (another process), never the first calls
    while warm medians exist; a missing floor is 'not measured', not a dropped row."""
    same = _targets(_paired({"ratio": 8.0}))[">= 5× faster than jax.jit(jax.hessian)"]
    assert (same["measured"], same["met"], same["note"]) == (8.0, True, "")
    other = _targets(_paired({"ratio_first_calls": 30.0}))[">= 5× faster than jax.jit(jax.hessian)"]
    assert other["measured"] == 10.0 and "another process" in other["note"]
    assert bench._x(_paired({"ratio_first_calls": 30.0}), "jax") == "10.0× (warm, other runs)"
    cold = _paired({"ratio_first_calls": 30.0})
    del cold["methods"]["jax"]["median_s"]
    assert _targets(cold)[">= 5× faster than jax.jit(jax.hessian)"]["measured"] == 30.0
    assert bench._x(cold, "jax") == "30.0× (first calls)"
    t = _targets(_paired({"ratio": 8.0}))
    assert t["within 3× of the floor (allocate + fill n×n)"]["measured"] == 2.0
    assert t[">= 20× faster than torch.func.hessian"]["met"] is None
    missing = _targets(_paired({"ratio": 8.0}, floor=False))["within 3× of the floor (allocate + fill n×n)"]
    assert missing["measured"] is None and missing["met"] is None


def test_memory_target_covers_every_hessian_case_and_few_samples_are_counted():
    small = {"id": "b/digits/B128", "group": "b", "layout": "interleaved", "out_bytes": 10 * 2**20,
             "methods": {"closed_form": {"median_s": 1.0, "memory": {"peak_delta_bytes": 40 * 2**20}}}}
    t = _targets(small)["closed-form peak memory <= 1.5× the dense Hessian"]
    assert (t["measured"], t["met"]) == (4.0, False) and "40.0 MiB for a 10.0 MiB output" in t["note"]
    assert bench._fmt_spread({"median_s": 2.0, "samples": 1, "p25_s": 2.0, "p75_s": 2.0}) == " (1 sample)"
    assert bench._fmt_spread({"median_s": 2.0, "samples": 5, "p25_s": 1.5, "p75_s": 2.5}) == " [1.50 s–2.50 s]"


def test_model_targets_per_baseline_and_memory():
    """Group (m): a 5× target per baseline from the same-process ratio, the memory target from the
    closed form's fresh peak (the floor's process in the paired layout)."""
    case = {"id": "m/gpt2/B8", "group": "m", "layout": "paired", "out_bytes": 100 * 2**20, "pairs": {
                "func_hessian": {"ratio": 6.0, "closed_form_median_s": 1.0}, "curvlinops": {"ratio": 4.0, "closed_form_median_s": 1.0}},
            "methods": {"closed_form": {"median_s": 1.0, "memory": {"peak_delta_bytes": 120 * 2**20}},
                        "func_hessian": {"median_s": 6.0}, "curvlinops": {"median_s": 4.0}}}
    t = _targets(case)
    assert (t[">= 5× faster than torch.func.hessian"]["met"], t[">= 5× faster than curvlinops H @ I"]["met"]) == (True, False)
    mem = t["closed-form peak memory <= 1.5× the dense Hessian"]
    assert (mem["measured"], mem["met"]) == (1.2, True)


def test_model_problems_are_the_benchmarked_models():
    """The models of group (m) as ModelConfig builds them: the 2-block digits ViT and the
    2-layer GPT-2 of d = 16, 2 heads, vocabulary 32, 8 positions (7,232 parameters)."""
    import math

    from blockhess.config import model_param_shapes
    from blockhess_lab import bench_worker as W
    from blockhess_lab.vit import DEFAULT_ARCH

    vit = W.model_config({"model": "vit", "blocks": 2})
    assert len(vit.blocks) == 2 and vit.blocks[0].d_model == DEFAULT_ARCH["d_model"] and vit.blocks[0].d_ff == DEFAULT_ARCH["d_ff"]
    assert (vit.embedding, vit.patch, vit.pool, vit.head, vit.positions) == ("patch", 2, "mean", 10, "sinusoidal")
    gpt = W.model_config({"model": "gpt2", "blocks": 2, **bench.GPT2})
    assert gpt.tied and gpt.final_norm and gpt.blocks[0].causal and gpt.blocks[0].n_heads == 2
    assert sum(math.prod(s) for s in model_param_shapes(gpt).values()) == 7232
    with pytest.raises(ValueError, match="model"):
        W.model_config({"model": "bert"})


def test_curvlinops_column_blocks_agree_with_closed_form():
    pytest.importorskip("curvlinops")
    from blockhess.linalg import rel_error
    from blockhess_lab import bench_worker as W

    P = W.make_problem({"kind": "model", "model": "gpt2", "B": 2, "blocks": 1, "dtype": "float64", "seed": 0,
                        "columns": 300, **bench.GPT2_QUICK})
    call, canon, extra = W.setup_curvlinops(P)
    assert extra["columns"] == 300 < P.n  # more than one block, the last one short
    ref, _, _ = W.setup_closed_form(P)
    assert rel_error(canon(call()), ref()) <= TOL
