"""``blockhess spectrum`` end to end on a tiny digits ViT checkpoint: the JSON's fields, the check
against dense eigh (and that it can fail), the series with warm starts, the presets' blocks, and the
one-line errors of bad input."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import blockhess as bh
from blockhess.config import param_shapes
from blockhess_lab import spectrum
from blockhess_lab import vit as V
from blockhess_lab.cli import main

TINY = {"patch": 4, "d_model": 8, "d_ff": 8, "d_k": 4, "ln_eps": 1e-5}
PNG = b"\x89PNG\r\n\x1a\n"
EPS64 = torch.finfo(torch.float64).eps


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    vit = V.train(0, steps=60, quiet=True, arch=TINY, optim={"warmup_steps": 5, "lr": 1e-2})
    return str(V.save(vit, tmp_path_factory.mktemp("ck") / "tiny.pt"))


def _spectrum(out, checkpoint, *extra):
    return main(["spectrum", "--checkpoint", checkpoint, "--out", str(out), "--batch", "6", "--quiet", *extra])


def test_spectrum_end_to_end(tmp_path, checkpoint, capsys):
    out = tmp_path / "sp"
    # W_V (64) and W_E+b_E (136) by Lanczos, b_H (10) dense, all (482) by Lanczos; a tight tol: agreement to 1e-8
    rc = _spectrum(out, checkpoint, "--blocks", "blocks.0.W_V,W_E+b_E,b_H,all", "--dense-below", "40", "--k", "3",
                   "--tol", "1e-9", "--density", "4,12", "--trace", "12")
    assert rc == 0 and capsys.readouterr() == ("", "")
    rep = json.loads((out / "spectrum.json").read_text())
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        ["spectrum.json", "spectrum.md", "eigenvalues.png", "density.png", "trace.png"])
    assert all((out / f).read_bytes().startswith(PNG) for f in rep["figures"])
    assert rep["converged"] and rep["n_params"] == sum(rep["sizes"].values()) == 482
    blocks = rep["spectra"]["blocks"]
    assert list(blocks) == ["blocks.0.W_V", "W_E+b_E", "b_H", "all"]
    for key, n in (("blocks.0.W_V", 64), ("W_E+b_E", 136), ("b_H", 10), ("all", 482)):
        for part in ("full", "outer", "functional"):
            r = blocks[key][part]
            assert r["n"] == n and r["k"] == 3 and len(r["eigenvalues"]) == len(r["residuals"]) == 3
            assert r["method"] == ("dense" if n <= 40 else "lanczos")
            assert r["method_reason"].startswith(f"n = {n} <= --dense-below 40" if n <= 40 else "block Lanczos")
            assert r["converged"] and max(r["relative_residuals"]) <= 1e-9
            assert r["matvecs"] >= 3 and r["seconds"] > 0 and r["eigenvalues"] == sorted(r["eigenvalues"], reverse=True)
            d = r["density"]
            assert (d["probes"], d["iterations"]) == (4, min(12, n)) and d["matvecs"] > 0 and d["sigma"] > 0
            assert len(d["grid"]) == len(d["density"]) == len(d["stderr"]) == len(d["quadrature_error"]) == spectrum.GRID
            t = r["trace"]
            assert t["matvecs"] == min(12, n) and t["exact"] == (n <= 12)  # exact from the columns when n <= products
        outer = blocks[key]["outer"]
        assert min(outer["eigenvalues"]) >= -outer["n"] * EPS64 * outer["scale"]  # Gauss-Newton: PSD
    v = rep["validation"]
    assert v["passed"] is True and set(v["blocks"]) == set(blocks) and v["skipped"] == []
    assert v["max_rel_diff"] <= spectrum.AGREEMENT
    for key, rec in v["blocks"].items():
        assert rec["seconds_closed_form"] > 0
        for part, p in rec["parts"].items():
            got = sorted(blocks[key][part]["eigenvalues"])
            assert max(abs(a - b) for a, b in zip(got, p["dense_eigenvalues"])) <= p["bound"]
            if p["trace_z"] is None:  # exact from the columns
                assert p["trace_abs_error"] <= 1e-12 * max(1.0, abs(p["trace_exact"]))
    ops = rep["spectra"]["operators"]
    assert set(ops) == {"full", "outer", "functional"} and all(o["product_seconds"] > 0 for o in ops.values())
    md = (out / "spectrum.md").read_text()
    assert "| `W_E+b_E` | 136 | lanczos |" in md and "| `b_H` | 10 | dense |" in md and ": passed;" in md
    peak = rep["timings"]["peak_rss_bytes"]
    assert peak > 0 and f"peak resident memory {peak / 2**30:.2f} GiB." in md
    acc = rep["model"]["test_accuracy"]  # a float of the model's line, shown to 4 significant digits
    assert f"test_accuracy {acc:.4g}," in md
    assert f"{acc:.4g}" == repr(acc) or repr(acc) not in md


def test_the_dense_check_fails_on_a_wrong_eigenvalue(tmp_path, checkpoint, monkeypatch, capsys):
    real = spectrum.lanczos_eigs

    def off(*a, **k):  # as if Lanczos returned eigenvalues 1e-6 too high, residuals unchanged
        r = real(*a, **k)
        return type(r)(**{**r.__dict__, "eigenvalues": r.eigenvalues * (1 + 1e-6)})

    monkeypatch.setattr(spectrum, "lanczos_eigs", off)
    out = tmp_path / "sp"
    rc = _spectrum(out, checkpoint, "--blocks", "blocks.0.W_V", "--parts", "full", "--k", "2", "--tol", "1e-10",
                   "--density", "0", "--trace", "0", "--dense-below", "0")
    assert rc == 1
    assert "the check against dense eigh FAILED" in capsys.readouterr().err
    rep = json.loads((out / "spectrum.json").read_text())  # written first
    assert rep["validation"]["passed"] is False and not rep["validation"]["blocks"]["blocks.0.W_V"]["parts"]["full"]["passed"]


def test_series_warm_starts(tmp_path, checkpoint):
    out = tmp_path / "sp"
    rc = _spectrum(out, checkpoint, "--series", "--blocks", "blocks.0.W_V,blocks.0.W_1", "--parts", "full", "--k", "3",
                   "--tol", "1e-10", "--density", "0", "--trace", "0", "--dense-below", "0", "--validate-below", "0")
    assert rc == 0
    rep = json.loads((out / "spectrum.json").read_text())
    ser = rep["series"]
    assert ser["kind"] == "snapshots" and ser["steps"] == [0, 12, 24, 36, 48, 60]  # 60 steps: the last is a snapshot
    assert (out / "series.png").read_bytes().startswith(PNG)
    vit = V.load(rep["checkpoint"][0])
    for key in ("blocks.0.W_V", "blocks.0.W_1"):
        rows = ser["blocks"][key]["full"]
        assert "matvecs_warm" not in rows[0] and all("matvecs_warm" in r for r in rows[1:])
        for row in rows[1:]:  # warm and cold agree to their residuals
            assert row["converged"] and row["agree"] and row["max_abs_diff_warm_cold"] <= row["diff_bound"]
        assert not ser["disagreements"]
        # the second snapshot's top eigenvalue is that of its own Hessian (not the previous point's)
        m = vit.at_step(12)
        idx = torch.randperm(len(vit.train_labels), generator=torch.Generator().manual_seed(3))[:6].sort().values
        H = bh.hessian(m.params, m.model_inputs(m.train_images[idx]), m.model_cfg, loss="ce",
                       target=m.train_labels[idx], wrt=[key])
        top = float(torch.linalg.eigvalsh(H[key, key])[-1])
        assert abs(rows[1]["eigenvalues"][0] - top) <= rows[1]["residuals"][0] + 64 * EPS64 * abs(top)
    t = ser["matvecs_after_the_first"]
    rows = [r for k in ser["blocks"] for r in ser["blocks"][k]["full"][1:]]
    assert t == {"warm": sum(r["matvecs_warm"] for r in rows), "cold": sum(r["matvecs_cold"] for r in rows)}
    # warm or cold is measured, not asserted: these snapshots are 12 steps of lr 1e-2 apart, and the counts were equal


def test_a_warm_start_that_disagrees_with_the_cold_one_fails_the_series(tmp_path, checkpoint, monkeypatch, capsys):
    """A warm-started result off by more than the two results' bounds (here a warm run made to return its
    eigenvalues shifted by 1e-3, as a warm start at a non-extreme eigenvector once did): exit 1, the
    disagreement named on stderr and listed in the JSON; the point's row says ``agree: false``."""
    real = spectrum.lanczos_eigs

    def shifted(A, *args, v0=None, **kw):
        r = real(A, *args, v0=v0, **kw)
        return r if v0 is None else dataclasses.replace(r, eigenvalues=r.eigenvalues + 1e-3)

    monkeypatch.setattr(spectrum, "lanczos_eigs", shifted)
    out = tmp_path / "sp"
    rc = _spectrum(out, checkpoint, "--series", "--blocks", "blocks.0.W_V", "--parts", "full", "--k", "2",
                   "--tol", "1e-8", "--density", "0", "--trace", "0", "--dense-below", "0", "--validate-below", "0")
    assert rc == 1
    err = capsys.readouterr().err
    assert "the warm-started and the cold eigenvalues disagree at 5 point(s) (first: blocks.0.W_V full at" in err
    ser = json.loads((out / "spectrum.json").read_text())["series"]
    assert len(ser["disagreements"]) == 5 and all(not r["agree"] for r in ser["blocks"]["blocks.0.W_V"]["full"][1:])
    assert "FAILED (series.disagreements)" in (out / "spectrum.md").read_text()


def test_a_series_of_checkpoints_warm_starts_from_the_previous_vectors(tmp_path, checkpoint):
    """The same checkpoint twice: the second point's warm start is the first point's eigenvectors of the same
    operator, so its Krylov space holds them after k products, and the run stops near 2k (k more for the final
    residuals) where the cold run takes several times k."""
    out = tmp_path / "sp"
    rc = _spectrum(out, checkpoint, "--checkpoint", checkpoint, checkpoint, "--blocks", "blocks.0.W_V,W_E", "--parts", "full,outer", "--k", "3",
                   "--tol", "1e-10", "--density", "0", "--trace", "0", "--dense-below", "0", "--validate-below", "0")
    assert rc == 0
    ser = json.loads((out / "spectrum.json").read_text())["series"]
    assert ser["kind"] == "checkpoints" and ser["labels"] == [checkpoint, checkpoint] and ser["steps"] == [None, None]
    for key in ("blocks.0.W_V", "W_E"):
        for part in ("full", "outer"):
            first, second = ser["blocks"][key][part]
            # 3k: the previous vectors are eigenvectors to their residual (about tol), one or two products more
            # can be needed to reach tol again (measured: 7 for k = 3); the check's products come on top
            assert second["matvecs_warm"] - second["check_matvecs_warm"] <= 3 * 3 < second["matvecs_cold"]
            assert second["matvecs_cold"] == first["matvecs_cold"]
            assert second["max_abs_diff_warm_cold"] <= second["diff_bound"]


@pytest.mark.parametrize("argv, msg", [
    (["--blocks", "blocks.0.W_X"], "--blocks: unknown block 'blocks.0.W_X'; this model has W_E, b_E, blocks.0.W_Q"),
    (["--blocks", "W_E,,W_H"], "--blocks must be a comma-separated list without empty entries"),
    (["--blocks", "W_E+W_E"], "--blocks: 'W_E+W_E' joins overlapping variables"),
    (["--parts", "full,gauss"], "--parts: unknown part 'gauss'; expected some of full, outer, functional"),
    (["--density", "8"], "--density must be PROBES,ITERATIONS (two integers) or 0, got '8'"),
    (["--trace", "2"], "--trace must be 0 (none) or at least 4 products, got 2"),
    (["--k", "0"], "--k must be >= 1, got 0"),
    (["--tol", "1e-17"], "--tol must be above the dtype's epsilon"),
    (["--preset", "gpt2-block", "--series"], "--series and --checkpoint are for the digits preset"),
    (["--batch", "2000"], "--batch 2000 is larger than the"),
    (["--density-blocks", "W_E,,W_H"], "--density-blocks must be a comma-separated list without empty entries"),
    (["--density", "0", "--density-blocks", "all"], "--density-blocks chooses the blocks given a density; with --density 0"),
    (["--blocks", "W_E", "--density-blocks", "all"], "--density-blocks: 'all' is not among the blocks of --blocks (W_E)"),
])
def test_bad_input_is_one_line_and_exit_2(argv, msg, tmp_path, checkpoint, capsys):
    out = tmp_path / "sp"
    ck = [] if "--preset" in argv else ["--checkpoint", checkpoint]
    assert main(["spectrum", *ck, "--out", str(out), "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"blockhess spectrum: error: {msg}") and err.count("\n") == 1, err
    assert not out.exists()


def test_the_presets_blocks_and_sizes():
    gpt2 = spectrum.GPT2_BLOCK
    assert (gpt2.d_model, gpt2.n_heads, gpt2.d_ff, gpt2.norm, gpt2.causal) == (768, 12, 3072, "pre", True)
    assert spectrum.block_keys(None, gpt2) == ["W_Q", "W_K", "W_V", "W_O", "W_1", "W_2"]
    assert sum(map(lambda s: torch.Size(s).numel(), param_shapes(gpt2).values())) == 7_087_872
    vit = spectrum.CIFAR_VIT
    keys = spectrum.block_keys(None, vit)
    assert keys[0] == "W_E" and keys[-1] == "W_H" and len(keys) == 8 * 6 + 2  # W_Q, W_K, W_V, W_O, W_1, W_2 per block
    assert sum(map(lambda s: torch.Size(s).numel(), param_shapes(vit).values())) == 1_605_348
    assert param_shapes(vit)["W_E"] == (48, 128) and param_shapes(vit)["W_H"] == (128, 100)
    x = torch.rand(1, *vit.image, dtype=torch.float64)
    assert bh.forward(bh.init_params(vit, seed=0), x, vit).shape == (1, 100)
    assert spectrum.block_keys("W_Q#3,W_O+W_1,all", gpt2) == ["W_Q#3", "W_O+W_1", "all"]
    assert spectrum.block_keys("weights", vit) == keys
    assert spectrum.block_keys("weights,all", gpt2) == ["W_Q", "W_K", "W_V", "W_O", "W_1", "W_2", "all"]
    assert spectrum.block_keys("W_O,weights", gpt2) == ["W_O", "W_Q", "W_K", "W_V", "W_1", "W_2"]  # each once
    for bad in ("W_Q+W_Q#1", "W_Q#1+W_Q#1", "W_Q#12"):  # 12 heads: #0 .. #11
        with pytest.raises(ValueError, match="--blocks: "):
            spectrum.block_keys(bad, gpt2)


def test_heads_and_joined_blocks_are_checked_like_parameters():
    """A two-head model: a head's view (``W_Q#1``) and a joined block (``W_K#0+W_V``) by Lanczos against the
    dense closed form's same views, every part."""
    from blockhess.config import ModelConfig, BlockConfig

    cfg = ModelConfig(blocks=(BlockConfig(d_model=8, d_ff=8, n_heads=2, d_k=4, ln_eps=1e-5),), embedding="linear", d_in=3,
                      pool="mean", head=4)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 5, 3, generator=gen, dtype=torch.float64), torch.randint(0, 4, (3,), generator=gen)
    problem = spectrum.Problem("test", cfg, bh.init_params(cfg, seed=0), [(x, y)], "ce", {})
    keys = spectrum.block_keys("blocks.0.W_Q#1,blocks.0.W_K#0+blocks.0.W_V", cfg)
    s = spectrum.Settings(parts=("full", "outer", "functional"), k=2, which="LA", tol=1e-10, max_matvecs=500,
                          dense_below=0, density=None, trace=0, validate_below=1024, seed=0)
    res = spectrum.spectra(problem, keys, s, quiet=True)
    assert {k: res["blocks"][k]["full"]["n"] for k in keys} == {keys[0]: 8 * 4, keys[1]: 8 * 4 + 8 * 8}  # W_Q, W_K (8, 2·4), W_V (8, 8)
    v = spectrum.validate(problem, keys, res["blocks"], s, torch.float64, quiet=True)
    assert v["passed"] is True and set(v["blocks"]) == set(keys) and v["max_rel_diff"] <= spectrum.AGREEMENT


def test_density_of_chosen_blocks_only(tmp_path, checkpoint):
    """``--density-blocks all`` with ``--blocks weights,all``: every weight matrix's eigenvalues, and the
    density of the whole model's Hessian alone."""
    out = tmp_path / "sp"
    assert _spectrum(out, checkpoint, "--blocks", "weights,all", "--density-blocks", "all", "--parts", "full",
                     "--density", "4,8", "--trace", "0", "--k", "2") == 0
    rep = json.loads((out / "spectrum.json").read_text())
    blocks = rep["spectra"]["blocks"]
    assert list(blocks) == [*spectrum.block_keys(None, V.model_config(TINY)), "all"]
    assert [k for k, r in blocks.items() if "density" in r["full"]] == ["all"]
    assert rep["settings"]["density_blocks"] == ["all"] and "density.png" in rep["figures"]
    assert "steps, of all." in (out / "spectrum.md").read_text()


def test_density_plot_floor_shows_single_eigenvalues(tmp_path, monkeypatch):
    """The log axis reaches the floor asked for (a tenth of one eigenvalue's broadened peak) where it
    lies below 1e-4 of the panel's peak, and stays at 1e-4 of the peak where the asked floor is higher."""
    from blockhess_lab import plots

    figs = []
    monkeypatch.setattr(plots.plt, "close", figs.append)
    grid = np.linspace(-1.0, 1.0, 50)
    dens = np.exp(-grid ** 2 / 0.02) + 1e-9
    panels = {"a": {"full": (grid, dens, 0 * dens)}, "b": {"full": (grid, dens, 0 * dens)}}
    plots.densities(tmp_path / "d.png", panels, "title " * 30, floors={"a": 1e-8, "b": 1e-2})
    (ax_a, ax_b), peak = figs[0].axes[:2], float(dens.max())
    assert ax_a.get_ylim()[0] == pytest.approx(1e-8) and ax_b.get_ylim()[0] == pytest.approx(1e-4 * peak)
    assert "\n" in figs[0]._suptitle.get_text()  # wrapped to two panels' width


def test_a_zero_part_does_not_set_the_density_width(tmp_path, checkpoint):
    """The head's ``W_H`` enters the logits linearly, so its functional part is exactly zero: its SLQ
    nodes are one value, whose default width has no scale. The block's common width comes from the
    parts with a spread (here full and outer, which are equal)."""
    out = tmp_path / "sp"
    assert _spectrum(out, checkpoint, "--blocks", "W_H", "--parts", "full,outer,functional", "--density", "4,8",
                     "--trace", "0", "--k", "2") == 0
    r = json.loads((out / "spectrum.json").read_text())["spectra"]["blocks"]["W_H"]
    assert max(abs(x) for x in r["functional"]["eigenvalues"]) == 0.0
    sigma = r["full"]["density"]["sigma"]
    assert sigma == r["outer"]["density"]["sigma"] == r["functional"]["density"]["sigma"]
    assert 0 < sigma < 1.0 / 8  # not the zero part's scale-free 1 / n_iter
    assert sigma <= 2 * max(r["full"]["eigenvalues"])  # on the scale of the block's own eigenvalues


def test_a_dense_check_that_would_not_fit_is_skipped_with_its_reason(tmp_path, checkpoint, monkeypatch, capsys):
    """A block small enough for ``--validate-below`` whose dense closed form would not fit (the GPT-2
    block's biases: a pass over a sequence of 256 tokens) is reported as not checked, with the
    memory error's message, instead of ending the run after its Lanczos work."""
    def too_big(*a, **k):
        raise bh.InsufficientMemoryError("the dense 6x6 Hessian would need 10 bytes but only 1 are available on cpu")

    monkeypatch.setattr(spectrum.bh, "hessian", too_big)
    out = tmp_path / "sp"
    assert _spectrum(out, checkpoint, "--blocks", "b_H", "--parts", "full", "--density", "0", "--trace", "0",
                     "--k", "2") == 0
    rep = json.loads((out / "spectrum.json").read_text())
    v = rep["validation"]
    assert v["blocks"] == {} and v["skipped"] == ["b_H"] and v["passed"] is None
    assert "would need 10 bytes" in v["skipped_why"]["b_H"]
    assert "Not checked, the dense closed form would not fit in memory: `b_H`" in (out / "spectrum.md").read_text()


def test_an_unconverged_block_says_why_and_is_not_judged(tmp_path, checkpoint, capsys):
    """A budget too small for k = 5 (``--max-matvecs 3``): the block is recorded unconverged with the
    solver's reason, which the one-line message repeats; the dense check does not judge it (no false
    "FAILED"), and the exit status is 1 (after writing the results)."""
    out = tmp_path / "sp"
    rc = _spectrum(out, checkpoint, "--blocks", "blocks.0.W_Q", "--parts", "full", "--density", "0", "--trace", "0",
                   "--max-matvecs", "3", "--dense-below", "0")
    err = capsys.readouterr().err
    rep = json.loads((out / "spectrum.json").read_text())
    r = rep["spectra"]["blocks"]["blocks.0.W_Q"]["full"]
    assert rc == 1 and not rep["converged"] and not r["converged"]
    assert "max_matvecs=3" in r["not_converged_why"] and r["not_converged_why"] in err
    assert "FAILED" not in err and rep["validation"]["passed"] is not False
    assert "not_judged" in rep["validation"]["blocks"]["blocks.0.W_Q"]["parts"]["full"]


def test_the_words_follow_which(tmp_path, checkpoint):
    """``--which SA``: the markdown says smallest, not top; the figure legend names only the methods used."""
    out = tmp_path / "sp"
    assert _spectrum(out, checkpoint, "--blocks", "b_H", "--parts", "full", "--density", "0", "--trace", "0",
                     "--k", "2", "--which", "SA") == 0
    md = (out / "spectrum.md").read_text()
    assert "Smallest 2 eigenvalues (SA; at most n of a block) per block" in md and "| smallest eigenvalues |" in md
    assert "Top 2" not in md and "top eigenvalues" not in md
