"""``blockhess spectrum --model`` on tiny causal LMs: every tensor's lock-step top-k against dense eigh of its
block of the dense Hessian, the JS matrix, a save_pretrained folder with a token file, a two-checkpoint series
with warm starts, and the one-line errors of bad input."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

import blockhess as bh
from blockhess_lab import spectrum_model as SM
from blockhess_lab.cli import main
from blockhess_lab.runtime import read_pretrained

EPS64 = torch.finfo(torch.float64).eps
PNG = b"\x89PNG\r\n\x1a\n"
FAST = ["--dtype", "float64", "--k", "2", "--tol", "1e-9", "--slq-steps", "6", "--probes", "2", "--quiet"]


def _run(out, *args):
    return main(["spectrum", *args, "--out", str(out), *FAST])


def _report(out) -> dict:
    return json.loads((out / "spectrum.json").read_text())


def _check_eigenvalues(rep: dict, H_of) -> None:
    """Each tensor's converged top-k within its residual (Kahan) plus n eps ||A|| of dense eigh's."""
    for name, t in rep["points"][-1]["tensors"].items():
        assert t["converged"]
        M = H_of(name)
        lam = torch.linalg.eigvalsh(M)
        dense = lam.sort(descending=True).values[: len(t["eigenvalues"])]
        got = torch.tensor(t["eigenvalues"], dtype=torch.float64)
        bound = float(torch.tensor(t["residuals"]).norm()) + M.shape[0] * EPS64 * float(lam.abs().max())
        assert float((got.sort(descending=True).values - dense).abs().max()) <= bound, name


def _check_js_and_markdown(out, rep: dict) -> None:
    for r in rep["points"]:
        js = torch.tensor(r["js_distance"], dtype=torch.float64)
        assert torch.equal(js, js.T) and bool((js.diagonal() == 0).all())
        assert bool((js >= 0).all()) and bool((js <= 1).all())
    md = (out / "spectrum.md").read_text()
    for r in rep["points"]:
        for name, t in r["tensors"].items():
            assert f"`{name}` | {t['n']:,} | {', '.join(f'{v:.4g}' for v in t['eigenvalues'])} |" in md
        assert f"{r['eigs']['products']} lock-step products" in md
        assert "| converged | top-k columns |" in md
    assert f"{rep['products']['total']} lock-step products in all" in md
    assert md.startswith(f"# blockhess spectrum: {', '.join(rep['checkpoints']) if rep['checkpoints'] else rep['model']}\n")
    for f in rep["figures"]:
        assert (out / f).read_bytes()[:8] == PNG


def _problem(model, ids):
    cfg, params, _ = SM.read_model(model, torch.float64, "test")
    return cfg, params


def test_gpt2_tiny_preset_against_dense_eigh(tmp_path):
    out = tmp_path / "sp"
    names = ["W_E", "blocks.0.W_Q", "blocks.3.W_2"]
    assert _run(out, "--model", "gpt2-tiny", "--batch", "2", "--seq-len", "6", "--tensors", ",".join(names)) == 0
    rep = _report(out)
    assert rep["settings"]["tensors"] == names and rep["tokens"] == {"source": "random", "batch": 2, "seq_len": 6}
    cfg, params = _problem(SM.preset_model("gpt2-tiny", 0), None)
    ids = SM.tokens(None, cfg.vocab, 2, 6, 0, cfg.n_positions)
    H = bh.hessian(params, ids[:, :-1], cfg, loss="ce", target=ids[:, 1:], wrt=names)
    _check_eigenvalues(rep, lambda n: H[n, n].reshape(params[n].numel(), params[n].numel()))
    _check_js_and_markdown(out, rep)
    pt = rep["points"][0]
    assert pt["eigs"]["matvecs"] == sum(t["matvecs"] for t in pt["tensors"].values())


def test_default_tensors_are_zhangs_set():
    cfg, params = _problem(SM.preset_model("gpt2-tiny", 0), None)
    got = SM.default_tensors(cfg, "gpt2")
    assert got == ["W_E"] + [f"blocks.{i}.{t}" for i in (0, 3) for t in ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2")]
    assert all(n in params for n in got)
    full = [f"blocks.{i}.{t}" for i in (0, 3, 7, 11) for t in ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2")]
    assert len(["W_E"] + full) == 25
    lcfg, lparams = _problem(SM.preset_model("llama-tiny", 0), None)
    lt = SM.default_tensors(lcfg, "llama")
    assert lt == ["W_E"] + [f"blocks.{i}.{t}" for i in (0, 3) for t in ("W_Q", "W_K", "W_V", "W_O", "W_G", "W_1", "W_2")]
    assert all(n in lparams for n in lt)


def test_llama_folder_with_token_file(tmp_path):
    model = SM.preset_model("llama-tiny", 3)
    folder = tmp_path / "llama"
    model.save_pretrained(folder)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(5))
    np.save(tmp_path / "ids.npy", ids.numpy())
    out = tmp_path / "sp"
    names = ["blocks.1.W_K", "blocks.0.W_G", "W_E"]
    assert _run(out, "--model", str(folder), "--data", str(tmp_path / "ids.npy"), "--tensors", ",".join(names),
                "--reorth", "none", "--ncv", "8") == 0
    rep = _report(out)
    assert rep["settings"]["reorth"] == "none" and rep["settings"]["ncv"] == 8
    assert rep["model_config"]["family"] == "llama" and rep["tokens"]["batch"] == 2 and rep["tokens"]["seq_len"] == 5
    cfg, params = _problem(read_pretrained(str(folder), "--model", SM.ARCHITECTURES, "spectrum"), None)
    A = bh.hessian_operator(params, ids[:, :-1], cfg, loss="ce", target=ids[:, 1:])
    _check_eigenvalues(rep, lambda n: A[n, n].dense())
    _check_js_and_markdown(out, rep)


def test_quiet_reads_a_folder_silently(tmp_path):
    """``--quiet``: nothing on stderr from transformers while the folder is read (this config's
    ``bos_token_id`` outside the vocabulary draws its warning; the weights' loading bar), in a process of
    its own (transformers' log handler keeps the stream it was first given)."""
    import transformers as tf

    folder = tmp_path / "gpt2"
    tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=40, n_positions=16, n_embd=8, n_layer=1, n_head=2)).save_pretrained(folder)
    run = subprocess.run([sys.executable, "-m", "blockhess", "spectrum", "--model", str(folder), "--seq-len", "6",
                          "--tensors", "blocks.0.W_O", "--out", str(tmp_path / "sp"), *FAST],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stderr == "" and run.stdout == "", run.stderr[-2000:]


def test_checkpoint_series_warm_starts(tmp_path):
    model = SM.preset_model("gpt2-tiny", 1)
    dirs = [tmp_path / "c0", tmp_path / "c1"]
    model.save_pretrained(dirs[0])
    with torch.no_grad():
        gen = torch.Generator().manual_seed(2)
        for p in model.parameters():
            p.add_(1e-4 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    model.save_pretrained(dirs[1])
    ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(4))
    torch.save(ids, tmp_path / "ids.pt")
    out = tmp_path / "sp"
    names = "blocks.0.W_V,blocks.0.W_O,blocks.3.W_1"
    assert _run(out, "--checkpoints", f"{dirs[0]},{dirs[1]}", "--data", str(tmp_path / "ids.pt"), "--tensors", names) == 0
    rep = _report(out)
    first, second = rep["points"]
    assert not first["eigs"]["warm_start"] and "cold" not in first
    assert second["eigs"]["warm_start"] and second["cold"]["converged"]
    assert second["eigs"]["matvecs"] <= second["cold"]["matvecs"]
    for name, t in second["tensors"].items():  # warm and cold each within its residuals' norm of the true top k
        bound = float(torch.tensor(t["residuals"]).norm() + torch.tensor(second["cold"]["residuals"][name]).norm())
        assert max(abs(a - b) for a, b in zip(t["eigenvalues"], second["cold"]["eigenvalues"][name])) <= bound
    assert "series.png" in rep["figures"]
    cfg, params = _problem(read_pretrained(str(dirs[1]), "--checkpoints", SM.ARCHITECTURES, "spectrum"), None)
    H = bh.hessian(params, ids[:, :-1], cfg, loss="ce", target=ids[:, 1:], wrt=names.split(","))
    _check_eigenvalues(rep, lambda n: H[n, n].reshape(params[n].numel(), params[n].numel()))
    _check_js_and_markdown(out, rep)


@pytest.mark.parametrize("args, words", [
    (["--model", "gpt3-huge"], "neither a preset"),
    (["--model", "/nonexistent/folder"], "neither a preset"),
    (["--checkpoints", "/nonexistent/a,/nonexistent/b"], "not a save_pretrained folder"),
    (["--model", "gpt2-tiny", "--tensors", "blocks.0.W_X"], "unknown tensor 'blocks.0.W_X'"),
    (["--model", "gpt2-tiny", "--seq-len", "100"], "--seq-len: sequences of 100 tokens exceed the model's 64 positions"),
    (["--model", "gpt2-tiny", "--blocks", "W_E"], "--blocks is an option of the --preset models"),
    (["--tensors", "W_E"], "--tensors applies with --model"),
    (["--model", "gpt2-tiny", "--density", "4,8"], "--density is an option of the --preset models"),
    (["--model", "gpt2-tiny", "--probes", "1"], "--probes must be >= 2"),
    (["--model", "gpt2-tiny", "--ncv", "6"], "--ncv must be at least --k + 2 = 7"),
    (["--reorth", "none"], "--reorth applies with --model"),
    (["--model", "gpt2-tiny", "--data", "x.txt"], "expected an existing .pt or .npy"),
    (["--model", "gpt2-tiny", "--k", "0"], "--k must be >= 1, got 0"),
    (["--model", "gpt2-tiny", "--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--model", "gpt2-tiny", "--tensors", "blocks.0.W_O,W_E", "--k", "100000"],
     "--k 100000 is more than tensor blocks.0.W_O's"),
])
def test_bad_inputs_exit_2(tmp_path, capsys, args, words):
    assert main(["spectrum", *args, "--out", str(tmp_path / "sp"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and not (tmp_path / "sp").exists()


class _Opaque:
    """An object the safe loader refuses (not a tensor or a plain container)."""


def test_token_file_torch_cannot_read(tmp_path, capsys):
    """Files named ``.pt`` that torch.load cannot read safely: text, junk bytes and a plain pickle are not
    torch.save's files, a torch.save of an object holds other objects; never torch's advice to load them with
    ``weights_only=False``."""
    (tmp_path / "text.pt").write_text("hello world")
    (tmp_path / "junk.pt").write_bytes(b"\x00not a checkpoint")
    with open(tmp_path / "pickled.pt", "wb") as f:
        pickle.dump(torch.zeros(2, 3, dtype=torch.int64), f)  # pickle's own format, not torch.save's
    torch.save({"ids": _Opaque()}, tmp_path / "objects.pt")
    for name, words in (("text.pt", "not a whole file written by torch.save"),
                        ("junk.pt", "not a whole file written by torch.save"),
                        ("pickled.pt", "not a whole file written by torch.save"),
                        ("objects.pt", "objects other than tensors")):
        assert main(["spectrum", "--model", "gpt2-tiny", "--data", str(tmp_path / name), "--out",
                     str(tmp_path / "sp"), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert words in err and "weights_only" not in err and err.count("\n") == 1 and not (tmp_path / "sp").exists()


def test_token_file_out_of_vocabulary_and_bad_folder(tmp_path, capsys):
    bad = torch.tensor([[0, 5, 40, 1]])
    torch.save(bad, tmp_path / "ids.pt")
    assert main(["spectrum", "--model", "gpt2-tiny", "--data", str(tmp_path / "ids.pt"), "--out", str(tmp_path / "a"),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "token ids must lie in [0, 32)" in err and err.count("\n") == 1
    torch.save(torch.zeros(3, dtype=torch.int64), tmp_path / "flat.pt")
    assert main(["spectrum", "--model", "gpt2-tiny", "--data", str(tmp_path / "flat.pt"), "--out", str(tmp_path / "b"),
                 "--quiet"]) == 2
    assert "2-d integer tensor" in capsys.readouterr().err
    (tmp_path / "vit").mkdir()
    (tmp_path / "vit" / "config.json").write_text('{"architectures": ["ViTForImageClassification"], "model_type": "vit"}')
    assert main(["spectrum", "--model", str(tmp_path / "vit"), "--out", str(tmp_path / "c"), "--quiet"]) == 2
    assert "architecture 'ViTForImageClassification'" in capsys.readouterr().err


def test_budget_too_small_exits_1_and_says_how_many_were_found(tmp_path):
    """``--max-matvecs`` below what a top-3 needs: exit 1, every tensor marked unconverged in the markdown,
    and a tensor with fewer than ``--k`` values says how many of the ``k`` it lists."""
    out = tmp_path / "sp"
    assert main(["spectrum", "--model", "gpt2-tiny", "--seq-len", "6", "--tensors", "W_E,blocks.0.W_O", "--k", "3",
                 "--max-matvecs", "5", "--dtype", "float64", "--slq-steps", "4", "--probes", "2", "--out", str(out),
                 "--quiet"]) == 1
    rep, md = _report(out), (out / "spectrum.md").read_text()
    assert not rep["converged"]
    assert any(len(t["eigenvalues"]) < 3 for t in rep["points"][0]["tensors"].values())  # the case this is about
    for name, t in rep["points"][0]["tensors"].items():
        row = next(line for line in md.splitlines() if line.startswith(f"| `{name}` |"))
        assert "| NO |" in row
        found = len(t["eigenvalues"])
        assert (f"({found} of 3)" in row) == (found < 3)


def test_default_length_fits_a_small_model(tmp_path):
    """Without ``--seq-len`` a model of fewer learned positions than the default 128 (``gpt2-tiny``: 64) runs on
    sequences of its own length; a length asked for beyond them is refused (``test_bad_inputs_exit_2``)."""
    out = tmp_path / "sp"
    assert _run(out, "--model", "gpt2-tiny", "--tensors", "blocks.0.W_O") == 0
    assert _report(out)["tokens"]["seq_len"] == 64
