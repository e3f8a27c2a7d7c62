"""``blockhess report`` end to end on a tiny checkpoint, and its one-line errors (no partial report)."""

from __future__ import annotations

import json

import pytest
import torch

import blockhess as bh
from blockhess_lab.cli import main
from blockhess_lab import vit as V
from blockhess_lab.outputs import atomic_dir

from conftest import FLOAT32_FACTOR, ROUND, fro

TINY = {"patch": 4, "d_model": 8, "d_ff": 8, "d_k": 4, "ln_eps": 1e-5}
PNG = b"\x89PNG\r\n\x1a\n"
EPS32, EPS64 = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    vit = V.train(0, steps=60, quiet=True, arch=TINY, optim={"warmup_steps": 5, "lr": 1e-2})
    return str(V.save(vit, tmp_path_factory.mktemp("ck") / "tiny.pt"))


def _report(tmp_path, checkpoint, *extra):
    out = tmp_path / "rep"
    rc = main(["report", "--checkpoint", checkpoint, "--out", str(out), "--batch", "5", "--quiet", "--repeats", "1", *extra])
    return rc, out


def _leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


def test_report_end_to_end(tmp_path, checkpoint, capsys):
    rc, out = _report(tmp_path, checkpoint)
    assert rc == 0
    assert capsys.readouterr().out == ""  # --quiet
    rep = json.loads((out / "report.json").read_text())
    v = rep["validation"]
    assert v["max_rel_error"] <= 1e-10 and v["passed"] and v["tolerance"] == 1e-10
    for phase in ("init", "trained"):
        assert v[phase]["by_part"]["full"]["max_over_blocks"] <= 1e-10
        assert len(v[phase]["by_part"]["outer"]["blocks"]) == 15
        assert v[phase]["outer_plus_functional_rel_error"] <= rep["n_params"] * EPS64  # separate assemblies: conftest.rounding
        t = rep["timings"][phase]
        assert t["closed_form_full_s"] > 0 and t["reference_s"] > 0 and t["speedup_total"] > 0
        e = rep["eigenvalues"][phase]
        n = rep["n_params"]
        for part in ("full", "outer", "functional"):
            assert e[part]["n_negative"] + e[part]["n_positive"] + e[part]["n_near_zero"] == n
            assert e[part]["min"] <= e[part]["max"]
        assert e["outer"]["n_negative"] == 0  # Gauss-Newton term is PSD
        assert e["functional"]["n_negative"] > 0  # the functional term brings the non-convexity
        blk = rep["norms"][phase]["blocks"]["W_Q,W_V"]
        for part in ("full", "outer", "functional"):
            assert 0 < blk[part]["spectral"] <= blk[part]["fro"] * (1 + 1e-12)
    assert rep["n_params"] == 2 * 8 * 4 + 8 * 8 + 2 * 8 * 8
    assert rep["model"]["tokens"] == 4 and rep["batch"] == 5 and len(rep["batch_indices"]) == 5
    assert rep["dtype"] == "float64" and rep["environment"]["torch"] == torch.__version__
    assert rep["checkpoint"] == checkpoint and rep["training"]["trained_in_this_run"] is False
    assert 0 <= rep["test_accuracy"] <= 1 and rep["seeds"]["model"] == 0
    for name in rep["figures"]:
        assert (out / name).read_bytes()[:8] == PNG
    assert set(rep["figures"]) == {"hessian_init.png", "hessian_trained.png", "block_norms.png", "spectrum.png",
                                   "model_hessian.png", "model_group_norms.png", "training_dynamics.png",
                                   "two_block_hessian.png"}
    _assert_whole_model(checkpoint, rep)
    md = (out / "report.md").read_text()
    for name in rep["figures"]:
        assert f"({name})" in md
    assert f"{v['max_rel_error']:.2e}" in md
    assert _leftovers(tmp_path) == []

    # a second run replaces the report as a whole; float32 closed form against the float64 reference
    (out / "stale.txt").write_text("old")
    rc, out = _report(tmp_path, checkpoint, "--seed", "1", "--dtype", "float32")
    assert rc == 0 and not (out / "stale.txt").exists()
    rep2 = json.loads((out / "report.json").read_text())
    assert rep2["batch_indices"] != rep["batch_indices"]
    assert rep2["dtype"] == "float32" and rep2["reference_dtype"] == "float64"
    assert rep2["validation"]["max_rel_error"] > 1e-12  # float32 rounding, not float64's
    assert rep2["validation"]["passed"] and rep2["validation"]["tolerance"] is None
    for section in (rep2["model_hessian"]["init"], rep2["model_hessian"]["trained"], rep2["two_blocks"]):
        f32 = section["validation"]["float32"]
        assert set(f32) == {"full", "outer", "functional"}
        for part in f32.values():  # judged by float32 autograd's own error, which is float32's, not float64's
            assert part["passed"] and part["error"] <= part["allowed"] and part["autograd_error"] > 1e-12
    _assert_float32_like_autograd(checkpoint, rep2)
    assert _leftovers(tmp_path) == []


def _model_reference(model, images, labels):
    return bh.reference.hessian(model.params, model.model_inputs(images), model.model_cfg, loss="ce", target=labels)


def _assert_whole_model(checkpoint, rep):
    """The whole-model sections against numbers recomputed here by autograd: each phase's
    per-parameter norms, the training snapshots' group spectral norms, the two-block model's
    cross-layer norms (the report's batch of 5 is its validation batch too)."""
    vit = V.load(checkpoint)
    idx = torch.tensor(rep["batch_indices"])
    images, labels = vit.train_images[idx], vit.train_labels[idx]
    m = rep["model_hessian"]
    assert m["validation_images"] == 5 and rep["validation"]["model"]["trained"]["passed"]
    names = list(bh.config.model_param_shapes(vit.model_cfg))
    for tag, model in (("init", vit.at_init()), ("trained", vit)):
        ph = m[tag]
        assert ph["names"] == names and ph["n_params"] == sum(p.numel() for p in vit.params.values())
        v = ph["validation"]
        assert v["passed"] and v["max_rel_error"] <= 1e-10 and v["block_agreement_rel_error"] <= 1e-10
        assert len(v["by_part"]["full"]["blocks"]) == len(names) * (len(names) + 1) // 2
        assert ph["eigenvalues"]["outer"]["n_negative"] == 0
        R = _model_reference(model, images, labels)
        for part in ("full", "outer", "functional"):
            Rp = R if part == "full" else getattr(R, part)
            for a in ("W_E", "blocks.0.W_V", "W_H"):
                got = ph["norms"]["blocks"][f"{a},{a}"][part]["fro"]
                assert abs(got - fro(Rp[a, a])) <= 1e-9 * max(fro(Rp[a, a]), fro(Rp.dense()) * 1e-5), (tag, part, a)
        assert ph["norms"]["blocks"]["W_H,W_H"]["functional"]["fro"] == 0.0  # the logits are linear in W_H
    dyn = rep["training_dynamics"]
    assert dyn["steps"] == V.snapshot_steps(60) == [0, 12, 24, 36, 48, 60] and list(dyn["groups"]) == [
        "embedding", "W_Q", "W_K", "W_V", "FeedForward", "head"]
    row = dyn["snapshots"][2]
    model = vit.at_step(row["step"])
    R = _model_reference(model, images, labels)
    ff = ["blocks.0.W_1", "blocks.0.W_2"]
    D = torch.cat([torch.cat([R[a, b] for b in ff], 1) for a in ff], 0)
    assert abs(row["hessian_spectral_norm"]["FeedForward"] - float(torch.linalg.eigvalsh(D).abs().max())) <= 1e-9 * row[
        "hessian_spectral_norm"]["FeedForward"]
    assert row["param_norm"]["head"] == pytest.approx(float(torch.cat([model.params["W_H"].reshape(-1), model.params["b_H"]]).norm()), rel=1e-12)
    assert dyn["snapshots"][0]["hessian_spectral_norm"]["W_Q"] == pytest.approx(
        m["init"]["norms"]["blocks"]["blocks.0.W_Q,blocks.0.W_Q"]["full"]["spectral"], rel=1e-12)  # step 0 is the initialisation
    two = rep["two_blocks"]
    assert two["trained_in_this_run"] and two["steps"] == 60 and two["validation"]["passed"] and two["images"] == 5
    assert len(two["norms"]["cross_layer"]) == 25
    model2 = V.train_like(vit, n_blocks=2, quiet=True)
    R2 = _model_reference(model2, images, labels)
    got = two["norms"]["cross_layer"]["blocks.0.W_V,blocks.1.W_Q"]["full"]["fro"]
    assert got == pytest.approx(fro(R2["blocks.0.W_V", "blocks.1.W_Q"]), rel=1e-9)


def test_report_of_a_format_one_checkpoint_says_it_has_no_snapshots(tmp_path, checkpoint):
    old = tmp_path / "old.pt"
    blob = torch.load(checkpoint, weights_only=True)
    flat = lambda p: {k.removeprefix("blocks.0."): v for k, v in p.items()}  # noqa: E731
    blob.update(version=1, params=flat(blob["params"]), init_params=flat(blob["init_params"]))
    del blob["snapshots"], blob["arch"]["n_blocks"]
    torch.save(blob, old)
    rc, out = _report(tmp_path, str(old), "--batch", "3", "--two-block-batch", "2", "--model-ref-batch", "2")
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert "no training snapshots (format 1" in rep["training_dynamics"]["skipped"]
    assert "training_dynamics.png" not in rep["figures"] and rep["model_hessian"]["validation_images"] == 2
    assert "Not shown: the checkpoint" in (out / "report.md").read_text()


def _assert_float32_like_autograd(checkpoint, rep):
    """Each block's float32 error in the report (against the float64 reference, relative to the
    block's norm) within 3x of float32 autograd's on the same batch and weights, block by block
    (the floors of conftest.assert_float32_close: the rounding of the answer, and for the full
    Hessian its outer and functional terms')."""
    vit = V.load(checkpoint)
    idx = torch.tensor(rep["batch_indices"])
    images, labels = vit.train_images[idx], vit.train_labels[idx]
    for tag, model in (("init", vit.at_init()), ("trained", vit)):
        R64, A32 = (bh.reference.hessian(model.block_params(dt), model.embed(images, dt), model.cfg, loss=model.head_loss,
                                         target=labels) for dt in (torch.float64, torch.float32))
        for part, got in rep["validation"][tag]["by_part"].items():
            R, A = (H if part == "full" else getattr(H, part) for H in (R64, A32))
            whole = fro(R.dense())
            for key, rel in got["blocks"].items():
                a, b = key.split(",")
                den = fro(R[a, b]) or whole  # the report's denominator: the block's norm, the whole's for a zero block
                terms = [(A32.outer[a, b], R64.outer[a, b]), (A32.functional[a, b], R64.functional[a, b])] if part == "full" else []
                floor = max(fro(A[a, b].double() - R[a, b]), fro(R[a, b].float().double() - R[a, b]),
                            EPS32 * sum(fro(r) for _, r in terms), sum(fro(t.double() - r) for t, r in terms))
                assert rel * den <= FLOAT32_FACTOR * floor + ROUND * EPS32 * whole, (tag, part, key, rel, floor / den)


def _error(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("blockhess report: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("kind", ["missing", "corrupt"])
def test_bad_checkpoint_is_one_line_error_and_no_report(tmp_path, capsys, kind):
    ck = tmp_path / "ck.pt"
    if kind == "corrupt":
        ck.write_bytes(b"garbage" * 100)
    out = tmp_path / "rep"
    err = _error(capsys, ["report", "--checkpoint", str(ck), "--out", str(out), "--quiet"])
    assert str(ck) in err
    assert not out.exists() and _leftovers(tmp_path) == []


def test_batch_larger_than_data(tmp_path, checkpoint, capsys):
    out = tmp_path / "rep"
    with atomic_dir(out) as tmp:
        (tmp / "keep.txt").write_text("previous report")
    err = _error(capsys, ["report", "--checkpoint", checkpoint, "--out", str(out), "--batch", "5000", "--quiet"])
    assert "5000" in err and "training images" in err
    assert (out / "keep.txt").read_text() == "previous report"  # an older report stays intact
    assert _leftovers(tmp_path) == []
    _error(capsys, ["report", "--checkpoint", checkpoint, "--out", str(out), "--batch", "0", "--quiet"])
    for option in ("--model-ref-batch", "--two-block-batch"):
        err = _error(capsys, ["report", "--checkpoint", checkpoint, "--out", str(out), option, "0", "--quiet"])
        assert f"{option} must be >= 1, got 0" in err
    err = _error(capsys, ["report", "--checkpoint", checkpoint, "--out", str(out), "--steps", "10", "--quiet"])
    assert "--steps has no effect with --checkpoint" in err


def test_unwritable_out(tmp_path, checkpoint, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    err = _error(capsys, ["report", "--checkpoint", checkpoint, "--out", str(afile / "rep"), "--quiet"])
    assert "--out" in err
    err = _error(capsys, ["report", "--checkpoint", checkpoint, "--out", str(afile), "--quiet"])
    assert "not a folder" in err
    assert afile.read_text() == "x"


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    text = capsys.readouterr().out
    for opt in ("--out", "--checkpoint", "--batch", "--dtype", "--quiet"):
        assert opt in text
