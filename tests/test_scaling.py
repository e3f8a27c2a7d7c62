"""``blockhess scaling``: the bare-attention exponents (Ormaniec et al.) are recovered from
exact Hessians, the fit and its interval are right, and the command writes its outputs."""

import argparse
import json

import numpy as np
import pytest

from blockhess_lab import scaling
from blockhess_lab.outputs import MARKER
from blockhess_lab.runtime import torch_threads


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny problems: one thread is faster (and far faster on a loaded machine)."""
    with torch_threads(1):
        yield


TINY = {"sigmas": [float(s) for s in np.logspace(-3, -1.5, 4)], "seq_lens": [16, 32, 64],
        "taus": [1e-4, 1e-3, 1e-2]}


# a fitted exponent at small sigma against the theory's: measured within 0.013 (input scale) and
# 0.003 (LayerNorm variance) on this preset and seeds; 0.05 leaves room, and sees a wrong law
EXPONENT_TOL = 0.05


def _fit(res, setting, variable, block, part, norm="spectral"):
    (f,) = [f for f in res["fits"] if (f["setting"], f["variable"], f["block"], f["part"], f["norm"])
            == (setting, variable, block, part, norm)]
    return f


def test_bare_attention_exponents_input_scale():
    res = scaling.compute("quick", seeds=2, sweeps=("input_scale",), overrides=TINY)
    expected = {("W_Q,W_Q", "outer"): 6, ("W_Q,W_Q", "functional"): 5, ("W_V,W_V", "outer"): 2}
    for (block, part), th in expected.items():
        for norm in ("spectral", "frobenius"):
            f = _fit(res, "attention", "input_scale", block, part, norm)
            assert f["theory"] == th
            assert abs(f["exponent"] - th) < EXPONENT_TOL, f
            assert f["ci"][0] <= f["exponent"] <= f["ci"][1]
    vv = _fit(res, "attention", "input_scale", "W_V,W_V", "functional")
    # identically zero (F is linear in W_V): no slope, not a sigma^0 law
    assert vv["zero"] and vv["exponent"] is None and vv["ci"] is None and vv["theory"] is None and vv["theory_zero"]
    md = scaling.markdown(res)
    assert "| W_V,W_V | functional | ≡ 0 (identically zero) | — | ≡ 0 | ≡ 0 |" in md
    assert "-0.000" not in md  # a zero slope prints as 0.000
    # every fit that has a theory value agrees with it at small sigma (block included)
    for f in res["fits"]:
        if f["norm"] != "bound" and f["theory"] is not None:
            assert abs(f["exponent"] - f["theory"]) < EXPONENT_TOL, f
    keys = {"setting", "block", "part", "variable", "exponent", "ci", "theory"}
    assert all(keys <= set(f) for f in res["fits"])


def test_ln_variance_blowup_only_through_the_value_path():
    res = scaling.compute("quick", seeds=2, sweeps=("ln_variance",), overrides=TINY)
    assert abs(_fit(res, "block", "ln_variance", "W_V,W_V", "full")["exponent"] + 1.0) < EXPONENT_TOL
    assert abs(_fit(res, "block", "ln_variance", "W_Q,W_V", "outer")["exponent"] + 0.5) < EXPONENT_TOL
    assert abs(_fit(res, "block", "ln_variance", "W_Q,W_Q", "full")["exponent"]) < EXPONENT_TOL
    assert abs(_fit(res, "block", "ln_variance", "W_Q,W_Q", "full", "bound")["exponent"] + 1.0) < EXPONENT_TOL
    # the window is stated in the plotted variable (the measured variance), not only in tau
    w = _fit(res, "block", "ln_variance", "W_V,W_V", "full")["window"]
    assert w["tau_max"] == 1e-2 and 0 < w["min"] < w["max"] < 1e-3
    assert "LayerNorm-1 input variance v = min_t var(U_t) ≤" in scaling.markdown(res)


def test_number_format_has_no_negative_zero():
    assert scaling._num(-1e-6) == "0.000" and scaling._num(-0.0, 2) == "0.00" and scaling._num(-0.0015) == "-0.002"
    assert scaling._num(None) == "—"


def test_fit_exponent_recovers_slope_and_interval():
    rng = np.random.default_rng(0)
    x = np.tile(np.logspace(-2, 0, 9), 3)
    g = np.repeat(np.arange(3), 9)
    y = 10 ** (np.array([0.5, -1.0, 2.0])[g]) * x ** 2.5 * np.exp(0.01 * rng.standard_normal(x.size))
    f = scaling.fit_exponent(x, y, g)
    assert abs(f["exponent"] - 2.5) < 0.02 and f["ci"][0] < 2.5 < f["ci"][1] and f["df"] == 27 - 3 - 1
    with pytest.raises(ValueError):
        scaling.fit_exponent(np.ones(4), np.ones(4), np.zeros(4))


def test_command_writes_outputs(tmp_path, monkeypatch):
    monkeypatch.setitem(scaling.PRESETS, "quick", {**scaling.PRESETS["quick"], **TINY, "seeds": 2})
    p = argparse.ArgumentParser()
    scaling.add_arguments(p)
    out = tmp_path / "sc"
    assert scaling.run(p.parse_args(["--out", str(out), "--quick", "--quiet"])) == 0
    res = json.loads((out / "scaling.json").read_text())
    assert {"fits", "records", "config", "runtime_s", "environment"} <= set(res)
    for name in ("scaling.md", "scaling_input_scale.png", "scaling_seq_len.png", "scaling_ln_variance.png"):
        assert (out / name).stat().st_size > 0
    assert not [q for q in tmp_path.iterdir() if q.name.startswith(".")]  # no temporary left behind
    assert (out / MARKER).is_file()  # a later run may replace these results
    del res["total_runtime_s"]
    assert "Run time" in scaling.markdown(res)  # the table also renders a result of compute() alone
    with pytest.raises(ValueError):
        scaling.run(p.parse_args(["--out", str(out), "--quick", "--seeds", "1", "--quiet"]))
