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
from blockhess import cli
from blockhess.experiments import bench


def _args(tmp_path, *extra):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(["--out", str(tmp_path), *extra])


def test_bench_is_a_subcommand():
    assert cli.COMMANDS["bench"] == "bench"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = _args(out, "--quick", "--disable", "jax,curvlinops")
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
    assert {c["group"] for c in res["cases"]} == {"a", "b", "c"}
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


def test_quick_outputs_agree_with_closed_form(quick):
    _, res = quick
    checked = 0
    for case in res["cases"]:
        if case["group"] == "c":
            continue
        tol = 1e-4 if case["problem"]["dtype"] == "float32" else 1e-10
        for m, e in case["methods"].items():
            for key in ("rel_err", "sketch_rel_err"):
                if e.get(key) is not None:
                    assert e[key] < tol, (case["id"], m, key, e[key])
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

    from blockhess.experiments import bench_jax

    cfg = bh.BlockConfig(d_model=4, d_ff=6, d_k=3)
    params = bh.init_params(cfg, seed=3)
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
    theta = np.concatenate([v.reshape(-1).numpy() for v in params.values()])
    shapes = [(k, tuple(v.shape)) for k, v in params.items()]
    for loss, target in (("mse", torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)), ("ce", torch.randint(0, 4, (2, 5), generator=gen))):
        ours = bh.hessian(params, X, cfg, loss=loss, target=target).dense()
        theirs = torch.from_numpy(np.array(bench_jax.make_hessian(shapes, loss)(theta, X.numpy(), target.numpy(), None)))
        err = torch.linalg.matrix_norm(theirs - ours) / torch.linalg.matrix_norm(ours)
        assert err < 1e-10, (loss, float(err))


def test_device_cuda_is_refused_clearly_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda: torch sees no CUDA device"):
        bench.run(_args(tmp_path, "--device", "cuda", "--quick"))
    with pytest.raises(ValueError, match="groups a and b only"):
        bench.build_plan(_args(tmp_path, "--device", "cuda", "--cases", "c"))
    plan = bench.build_plan(_args(tmp_path, "--device", "cuda", "--quick"))
    assert {c["group"] for c in plan} == {"a", "b"}


def test_out_of_other_files_is_refused_before_any_case(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OSError, match="holds files that are not blockhess results"):
        bench.run(_args(tmp_path, "--quick", "--disable", "jax,curvlinops"))
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_results_folder_is_marked(quick):
    from blockhess.experiments.outputs import MARKER

    out, _ = quick
    assert (out / MARKER).is_file()
