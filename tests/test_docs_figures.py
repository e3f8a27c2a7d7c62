"""The figures the docs quote from ``blockhess validate``, ``bounds``, ``scaling``, ``convergence``
and ``report`` are those of the runs stored in ``docs/data/`` (written by ``docs/data/refresh.py``).

Each check finds the quoted figure in the markdown, next to the words around it (a table row, or a
sentence written here as a template with ``{}`` for each number), and compares it with the stored
JSON at the precision shown: ``1.6e-11`` must be within 0.05e-11 of the JSON's value, ``−3.02``
within 0.005, ``8,176`` within 0.5. A template that no longer matches the doc fails too, so a
quote cannot be reworded out of the check. The few figures no stored run backs (history, a search
script outside the package, a fresh clone's install) are listed in ``UNSTORED`` at the end.

After ``python docs/data/refresh.py`` the timings change: a failure here then names each quote to
update (docs/results.md, "Where the JSON is").
"""

from __future__ import annotations

import functools
import json
import math
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"


@functools.cache
def data(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


@functools.cache
def doc(name: str) -> str:
    return (ROOT / name).read_text()


# --------------------------------------------------------------------------- numbers as shown

_SUP = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺", "0123456789-+")
_SUPS = "⁰¹²³⁴⁵⁶⁷⁸⁹"
#: a number as the docs write it: −1.5, 1,438, 1.6e-11, 3.06·10¹¹, 10⁻³
NUMBER = rf"[−-]?(?:(?:\d{{1,3}}(?:,\d{{3}})+|\d+)(?:\.\d+)?(?:·10[⁻⁺]?[{_SUPS}]+|e[+-]?\d+)?|10[⁻⁺]?[{_SUPS}]+)"


def shown(text: str) -> tuple[float, float]:
    """The value of a number as written in the docs and half a unit of its last digit."""
    t = text.strip().replace("−", "-").replace(",", "")
    m = re.fullmatch(rf"(-?)(?:(\d+)(?:\.(\d+))?)?(?:(?:·|^-?)10([⁻⁺]?[{_SUPS}]+)|e([+-]?\d+))?", t)
    assert m and (m.group(2) or m.group(4)), f"not a number: {text!r}"
    sign, whole, frac, sup, e = m.groups()
    exp = int(sup.translate(_SUP)) if sup else int(e) if e else 0
    mantissa = float(f"{whole or 1}.{frac or 0}")
    decimals = len(frac or "")
    value = (-1 if sign else 1) * mantissa * 10.0 ** exp
    return value, 0.5 * 10.0 ** (exp - decimals)


def assert_shown(text: str, value: float, what: str) -> None:
    """``value`` rounds to ``text`` at the precision ``text`` shows."""
    v, half = shown(text)
    assert value is not None, f"{what}: the doc shows {text}, the JSON has no value"
    assert abs(value - v) <= half * (1 + 1e-9), f"{what}: the doc shows {text}, the stored JSON gives {value!r}"


class AtMost(float):
    """A value a quote bounds from above ('within 0.004', '±0.01'): it must not exceed the shown number
    (rounded at its last digit)."""


def _pattern(template: str) -> str:
    pieces = template.split("{}")
    out = []
    for i, piece in enumerate(pieces):
        out += [r"\s+" if tok.isspace() else re.escape(tok) for tok in re.split(r"(\s+)", piece) if tok]
        if i < len(pieces) - 1:
            out.append(f"({NUMBER})")
    return "".join(out)


def check_quotes(name: str, quotes: list[tuple[str, object]]) -> None:
    """Every template of ``quotes`` occurs in ``name`` and its numbers equal the values, as shown."""
    text = doc(name)
    errors = []
    for template, values in quotes:
        found = list(re.finditer(_pattern(template), text))
        if not found:
            errors.append(f"not in {name} (reworded? update the template and check its numbers): {template!r}")
            continue
        values = values if isinstance(values, (list, tuple)) else [values]
        for m in found:
            assert len(m.groups()) == len(values), template
            for txt, v in zip(m.groups(), values):
                for x in v if isinstance(v, list) else [v]:  # a list: each of its values is shown as txt
                    try:
                        if isinstance(x, AtMost):
                            bound, half = shown(txt)
                            assert x <= bound + half, f"{name}: {template!r}: {x!r} is over the {txt} the doc shows"
                        else:
                            assert_shown(txt, x, f"{name}: {template!r}")
                    except AssertionError as exc:
                        errors.append(str(exc))
    assert not errors, "\n".join(errors)


def table(name: str, header: str, start: str | None = None, end: str | None = None) -> list[list[str]]:
    """The body rows (cells stripped) of the one markdown table of ``name`` whose header row starts with
    ``header``, looked for between the anchors ``start`` and ``end`` (each must occur once) if given."""
    text = section(name, start, end) if start else doc(name)
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(header)]
    assert len(starts) == 1, f"{name}: {len(starts)} tables with a header starting {header!r}"
    rows = []
    for line in lines[starts[0] + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    assert rows, f"{name}: empty table {header!r}"
    return rows


def section(name: str, start: str, end: str | None = None) -> str:
    """The text of ``name`` from the anchor ``start`` to the anchor ``end`` (or the end)."""
    text = doc(name)
    assert text.count(start) == 1, f"{name}: anchor {start!r} found {text.count(start)} times"
    i = text.index(start)
    if end is None:
        return text[i:]
    assert text.count(end) == 1, f"{name}: anchor {end!r} found {text.count(end)} times"
    return text[i:text.index(end)]


def test_shown_precision():
    assert shown("1.6e-11") == (1.6e-11, 0.5e-12)
    assert shown("−3.02") == (-3.02, 0.005)
    assert shown("8,176") == (8176, 0.5)
    assert shown("3.06·10¹¹")[0] == pytest.approx(3.06e11) and shown("3.06·10¹¹")[1] == pytest.approx(0.005e11)
    assert shown("10⁻³")[0] == pytest.approx(1e-3)
    with pytest.raises(AssertionError):
        assert_shown("1.6e-11", 1.66e-11, "rounding")
    assert_shown("1.6e-11", 1.649e-11, "rounding")
    with pytest.raises(AssertionError):
        check_quotes("docs/results.md", [("a sentence that is not in the doc {}", 1.0)])
    check_quotes("docs/results.md", [("over {} cases", AtMost(75.4))])
    with pytest.raises(AssertionError):
        check_quotes("docs/results.md", [("over {} cases", AtMost(75.6))])


# --------------------------------------------------------------------------- the stored runs


def run(name: str) -> dict:
    return data("runs")[name]


def test_stored_runs_are_complete_and_small():
    """Every run of the refresh script is stored, with its record in runs.json, and no file is large."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("refresh", DATA / "refresh.py")
    refresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(refresh)
    assert set(data("runs")) == set(refresh.RUNS)
    for name in refresh.RUNS:
        assert (DATA / f"{name}.json").stat().st_size < 400_000, name
        assert run(name)["command"].startswith("blockhess " + " ".join(refresh.RUNS[name][0]))
        assert "--threads 1" in run(name)["command"]
        assert not run(name)["src_changed"], f"{name} ran on uncommitted code"


# --------------------------------------------------------------------------- validate (docs/results.md)


def _validate_worst(setting: str) -> dict:
    cases = [c for c in data("validate-full")["cases"] if c["setting"] == setting]
    assert cases, setting
    own = [v for c in cases for v in c["rel_error_own_norm"].values() if v is not None]
    return {"full": max(c["rel_error"]["full"] for c in cases),
            "parts": max(max(c["rel_error"]["outer"], c["rel_error"]["functional"]) for c in cases),
            "jacobian": max(c["rel_error"]["jacobian"] for c in cases), "own": max(own)}


def test_validate_table():
    rows = table("docs/results.md", "| setting | full Hessian | outer / functional |")
    settings = {c["setting"] for c in data("validate-full")["cases"]}
    assert {r[0] for r in rows} == settings
    for setting, full, parts, jac, own in rows:
        w = _validate_worst(setting)
        for txt, key in ((full, "full"), (parts, "parts"), (jac, "jacobian"), (own, "own")):
            assert_shown(txt, w[key], f"validate table, {setting}, {key}")


def test_validate_worst_cases():
    """'The largest errors are all the paper's attention layer at input scale 10'."""
    cases = data("validate-full")["cases"]
    columns = {"full": lambda c: c["rel_error"]["full"],
               "outer / functional": lambda c: max(c["rel_error"]["outer"], c["rel_error"]["functional"]),
               "Jacobian": lambda c: c["rel_error"]["jacobian"],
               "own norm": lambda c: max(v or 0 for v in c["rel_error_own_norm"].values())}
    for column, err in columns.items():
        worst = max(cases, key=err)
        assert (worst["setting"], worst["input_scale"]) == ("attention (paper)", 10.0), column
    assert "The largest errors are all the paper's attention layer at input scale 10" in doc("docs/results.md")


def test_validate_quotes():
    full, quick = data("validate-full"), data("validate-quick")
    check_quotes("docs/results.md", [
        ("full grid: {} cases, {} s; `--quick`: {} cases, {} s;",
         [len(full["cases"]), run("validate-full")["wall_s"], len(quick["cases"]), run("validate-quick")["wall_s"]]),
        ("over {} cases: five block settings", len(full["cases"])),
    ])
    paper = _validate_worst("attention (paper)")
    check_quotes("docs/derivations.md", [
        ("the attention layer at input scale 10 (saturated softmax), functional term, {} (the full Hessian {})",
         [paper["own"], paper["full"]]),
    ])
    assert f"`blockhess validate` (core `{run('validate-full')['commit']}`;" in doc("docs/results.md")
    assert run("validate-full")["commit"] == run("validate-quick")["commit"]
    assert full["passed"] and quick["passed"]
    assert len({c["setting"] for c in full["cases"]}) == 5
    assert {c["loss"] for c in full["cases"]} == {"mse", "ce", "custom"}


# --------------------------------------------------------------------------- bounds (docs/results.md, docs/bounds.md)

#: the whole-Hessian table's rows, in the order of bounds.json's tables
_BOUNDS_TABLES = ["random weights, attention (Theorem 1)", "random weights, block (Theorem 6)",
                  "digits ViT (trained weights), MSE, Theorem 6",
                  "digits ViT (trained weights), model CE through the head, general-loss Theorem 6",
                  "digits ViT (init weights), MSE, Theorem 6",
                  "digits ViT (init weights), model CE through the head, general-loss Theorem 6"]


def _btable(name: str) -> dict:
    return next(t for t in data("bounds")["tables"] if t["name"] == name)


def _brow(name: str, block: str) -> dict:
    return next(r for r in _btable(name)["rows"] if r["block"] == block)


def _range(cell: str) -> list[str]:
    parts = [p.strip() for p in cell.split(" – ")]
    assert len(parts) == 2, cell
    return parts


def test_bounds_whole_hessian_table():
    rows = table("docs/results.md", "| case | ‖H‖₂ | valid bound / ‖H‖₂ |")
    assert [t["name"] for t in data("bounds")["tables"]] == _BOUNDS_TABLES
    assert len(rows) == len(_BOUNDS_TABLES)
    for (case, norm, ratio, ratio_paper, blocks, blocks_paper), name in zip(rows, _BOUNDS_TABLES):
        t = _btable(name)
        a = _brow(name, "all")
        others = [r for r in t["rows"] if r["block"] != "all"]
        assert_shown(norm, a["norm"], f"{case}: ‖H‖₂")
        assert_shown(ratio, a["ratio"], f"{case}: valid ratio")
        lo, hi = _range(blocks)
        assert_shown(lo, min(r["ratio"] for r in others), f"{case}: smallest block ratio")
        assert_shown(hi, max(r["ratio"] for r in others), f"{case}: largest block ratio")
        if t["loss"] == "mse":
            assert_shown(ratio_paper, a["ratio_paper"], f"{case}: printed ratio")
            lo, hi = _range(blocks_paper)
            assert_shown(lo, min(r["ratio_paper"] for r in others), f"{case}: smallest printed block ratio")
            assert_shown(hi, max(r["ratio_paper"] for r in others), f"{case}: largest printed block ratio")
        else:
            assert ratio_paper == blocks_paper == "n/a" and a["bound_paper"] is None


def test_bounds_ingredient_table():
    rows = table("docs/results.md", "| ingredient | exact | printed | where |")
    ingr = {c["name"]: {r["ingredient"]: r for r in c["rows"]} for c in data("bounds")["ingredients"]}
    rnd, trained = ingr["random weights, attention"], ingr["digits ViT (trained weights), first image"]
    assert ingr["random weights, block"]["Phi_VQ"] == rnd["Phi_VQ"]  # the block's attention is the same layer
    (_, exact, printed, _), (_, e_vq, p_vq, _), (_, e_vk, p_vk, _) = rows
    lo, hi = _range(exact)
    assert_shown(lo, min(c["dA/dT"]["exact"] for c in ingr.values()), "‖∂A/∂T‖, smallest")
    assert_shown(hi, max(c["dA/dT"]["exact"] for c in ingr.values()), "‖∂A/∂T‖, largest")
    assert_shown(printed.split(" ")[0], rnd["dA/dT"]["bound_paper"], "printed ‖∂A/∂T‖")
    for cell, cellp, key in ((e_vq, p_vq, "Phi_VQ"), (e_vk, p_vk, "Phi_VK")):
        nums = re.findall(NUMBER, cell)
        assert_shown(nums[0], rnd[key]["exact"], f"{key} random")
        assert_shown(nums[1], trained[key]["exact"], f"{key} trained")
        p = re.findall(NUMBER, cellp)
        assert_shown(p[0], rnd[key]["bound_paper"], f"{key} printed, random")
        assert_shown(p[1], trained[key]["bound_paper"], f"{key} printed, trained")
    # "three printed ingredients fail in every case"
    for c in ingr.values():
        assert {k for k, r in c.items() if r["paper_holds"] is False} == {"dA/dT", "Phi_VQ", "Phi_VK"}


def _sweep_median(kind: str, sigma: float) -> float:
    return next(r["ratio_median"] for r in data("bounds")["sweep_summary"]
                if r["kind"] == kind and r["sigma"] == sigma and r["target"] == "random")


def _failures(blocks: tuple[str, ...]) -> list[float]:
    v = [f["ratio_paper"] for f in data("bounds")["paper_failures"] if f["block"] in blocks]
    return [min(v), max(v)]


def test_bounds_sweep_and_failures():
    b = data("bounds")
    sw = b["sweep"]
    tight = min(sw["points"], key=lambda p: p["tightest"]["ratio"])
    assert (tight["kind"], tight["L"], tight["tightest"]["block"]) == ("attention", 1, "W_V,W_V")
    fails = b["paper_failures"]
    assert {(f["kind"], f["L"], f["weight_scale"], f["target"]) for f in fails} == {("block", 1, 0.1, "zero-residual")}
    assert {f["block"] for f in fails} == {"W_V,W_V", "W_V,W_1", "W_V,W_2", "W_1,W_1", "W_1,W_2", "W_2,W_2", "all"}
    per_sigma = {}
    for f in fails:  # 'identical for every σ'
        per_sigma.setdefault((f["seed"], f["block"]), []).append(f["ratio_paper"])
    assert all(max(v) - min(v) <= 1e-9 * max(v) for v in per_sigma.values())
    n_points = len(sw["scales"]) * sw["seeds"]
    check_quotes("docs/results.md", [
        ("σ ∈ {0.1, 0.3, 1, 3, 10}; {} seeds; random and zero-residual targets): **{} rows, {} valid-bound violations**",
         [sw["seeds"], sw["n_rows"], len(b["valid_violations"])]),
        ("attention {} (σ=0.1), {} (σ=1), {} (σ=10); block {}, {}, {}.",
         [_sweep_median(k, s) for k in ("attention", "block") for s in (0.1, 1.0, 10.0)]),
        ("The valid bound is attained (ratio {})", tight["tightest"]["ratio"]),
        ("(`paper_holds = False`): {} rows", len(fails)),
        ("blocks V–V (printed/exact {}–{}), V–W₁, V–W₂ ({}–{}), W₁–W₁, W₁–W₂, W₂–W₂ ({}–{}) and the whole Hessian in "
         "{} of {} points ({}–{})",
         [*_failures(("W_V,W_V",)), *_failures(("W_V,W_1", "W_V,W_2")), *_failures(("W_1,W_1", "W_1,W_2", "W_2,W_2")),
          sum(f["block"] == "all" for f in fails), n_points, *_failures(("all",))]),
        ("printed ‖J_Z‖ = 1/√d + 1/d = {} against the exact {} (d = {})",
         [1 / math.sqrt(8) + 1 / 8, 1.0, sw["config"]["d_model"]]),
    ])
    assert not b["valid_violations"] and not sw["valid_violations"]


def _cancel(block: str) -> list[float]:
    r = _brow(_BOUNDS_TABLES[2], block)
    return [r["outer_norm"], r["functional_norm"], r["norm"]]


def test_bounds_cancellation_and_looseness():
    a = _cancel("all")
    check_quotes("docs/results.md", [
        ("each ~{}× the full Hessian (whole Hessian: {} and {} against {}; V–V: {} and {} against {})",
         [statistics.mean(a[:2]) / a[2], *a, *_cancel("W_V,W_V")]),
    ])
    ingr = [{r["ingredient"]: r for r in c["rows"]} for c in data("bounds")["ingredients"]]
    printed_over = [c[k]["exact"] / c[k]["bound_paper"] for c in ingr for k in ("Phi_VQ", "Phi_VK")]
    check_quotes("docs/bounds.md", [
        ("(exact values {}–{} in `blockhess bounds`,",
         [min(c["dA/dT"]["exact"] for c in ingr), max(c["dA/dT"]["exact"] for c in ingr)]),
        ("the exact layout norms are {}–{} times the printed values in `blockhess bounds`,",
         [min(printed_over), max(printed_over)]),
        ("block Hessian are each ~{}× the full Hessian", statistics.mean(a[:2]) / a[2]),
        ("sweep: weights ×0.1, every σ; printed/exact down to {} for V–V, {}–{} for the whole Hessian",
         [_failures(("W_V,W_V",))[0], *_failures(("all",))]),
        ("`‖J_Z‖ = 1/(√d σ) + 1/(d σ)` ({} for d = {}) is below the exact `1/σ` ({})",
         [1 / math.sqrt(8) + 1 / 8, data("bounds")["sweep"]["config"]["d_model"], 1.0]),
    ])
    # 'valid bound / exact norm for the whole Hessian: 10¹–10² at small σ for the bare attention layer, 10³–10⁷
    # at σ ≥ 1, and 10³–10⁹ for the block; printed bounds 10²–10⁴ times looser still for attention, up to 10¹⁵
    # for the block': the sweep's medians (L = 8, weights ×1) and the tables, as orders of magnitude
    summ = data("bounds")["sweep_summary"]
    tables = data("bounds")["tables"]
    order = lambda x: math.floor(math.log10(x))  # noqa: E731
    att = [r for r in summ if r["kind"] == "attention"]
    assert {order(r["ratio_median"]) for r in att if r["sigma"] < 0.3} <= {1, 2}
    assert {order(r["ratio_median"]) for r in att if r["sigma"] >= 1} <= set(range(3, 8))
    assert {order(r["ratio_median"]) for r in summ if r["kind"] == "block"} <= set(range(3, 10))
    looser_att = [r["ratio_paper_median"] / r["ratio_median"] for r in att]
    looser_att += [_brow(t["name"], "all")["ratio_paper"] / _brow(t["name"], "all")["ratio"]
                   for t in tables if t["kind"] == "attention"]
    assert {order(x) for x in looser_att} <= {2, 3, 4}
    looser_block = [r["ratio_paper_median"] / r["ratio_median"] for r in summ if r["kind"] == "block"]
    looser_block += [_brow(t["name"], "all")["ratio_paper"] / _brow(t["name"], "all")["ratio"]
                     for t in tables if t["kind"] == "block" and t["loss"] == "mse"]
    assert order(max(looser_block)) == 15
    text = doc("docs/bounds.md")
    for quote in ("10¹–10² at small σ for the", "10³–10⁷ at σ ≥ 1, and 10³–10⁹ for the block",
                  "10²–10⁴ times looser still for attention and up to 10¹⁵ for the block"):
        assert quote in " ".join(text.split()), quote


# --------------------------------------------------------------------------- scaling (docs/results.md, docs/bounds.md)

_SYM = {"Q": "W_Q", "K": "W_K", "V": "W_V", "W₁": "W_1", "W₂": "W_2"}


def _blocks(cell: str) -> list[str]:
    """'Q,V  K,V  Q/K with W₁, W₂' -> ['W_Q,W_V', 'W_K,W_V', 'W_Q,W_1', 'W_Q,W_2', 'W_K,W_1', 'W_K,W_2']."""
    cell = cell.replace("Q/K with W₁, W₂", "Q,W₁ Q,W₂ K,W₁ K,W₂").replace("V with W₁, W₂", "V,W₁ V,W₂")
    pairs = re.findall(r"(W₁|W₂|[QKV]),(W₁|W₂|[QKV])", cell)
    assert pairs, cell
    return [f"{_SYM[a]},{_SYM[b]}" for a, b in pairs]


def _fit(run_name: str, variable: str, setting: str, block: str, part: str, norm: str = "spectral") -> dict:
    found = [f for f in data(run_name)["fits"] if (f["variable"], f["setting"], f["block"], f["part"], f["norm"])
             == (variable, setting, block, part, norm)]
    assert len(found) == 1, (run_name, variable, setting, block, part, norm)
    return found[0]


def _check_exponent_cell(cell: str, fits: list[dict], what: str) -> None:
    """'6.00 ± <0.01', '−3.02 ± 0.02', '≡ 0' or a range '−1.16 … −1.28' over the fits of a group."""
    if cell == "≡ 0":
        assert all(f["zero"] and f["exponent"] is None for f in fits), what
        return
    assert not any(f["zero"] for f in fits), what
    if "…" in cell:
        lo, hi = sorted(shown(x)[0] for x in cell.split("…"))
        ex = [f["exponent"] for f in fits]
        assert_shown(f"{lo:.2f}", min(ex), what + " (smallest)")
        assert_shown(f"{hi:.2f}", max(ex), what + " (largest)")
        assert re.fullmatch(r"−?\d\.\d\d … −?\d\.\d\d", cell), cell
        return
    value, hw = (x.strip() for x in cell.split("±"))
    for f in fits:
        assert_shown(value, f["exponent"], what)
        half = (f["ci"][1] - f["ci"][0]) / 2
        if hw.startswith("<"):
            assert half < shown(hw[1:])[0], f"{what}: half-width {half}"
        else:
            assert_shown(hw, half, what + " (CI half-width)")


def _check_theory_cell(cell: str, fits: dict, what: str) -> None:
    """'**6 / 5** / 5 (Ormaniec et al.)', '−2 / — / —', '−½', '—' against each part's theory."""
    cell = re.sub(r"\s*\([^)]*\)", "", cell.replace("**", "")).replace("½", "0.5").replace("−", "-")
    parts = [p.strip() for p in cell.split("/")]
    if len(parts) == 1:
        parts = parts * 3
    for p, part in zip(parts, ("outer", "functional", "full")):
        for f in fits[part]:
            if p == "—":
                assert f["theory"] is None and not f["theory_zero"], what
            elif p == "≡ 0":
                assert f["theory_zero"], what
            else:
                assert f["theory"] == float(p), f"{what}: theory {f['theory']} against {p}"


_SCALING = {  # variable -> the anchors of its part of results.md, whether its table has a setting column
    "input_scale": ("**(a) Input scale", "**(b) Sequence length", True),
    "seq_len": ("**(b) Sequence length", "**(c) LayerNorm-1 input variance", True),
    "ln_variance": ("**(c) LayerNorm-1 input variance", "## Loss-landscape convergence", False),
}


@pytest.mark.parametrize("variable", list(_SCALING))
def test_scaling_table(variable):
    start, end, with_setting = _SCALING[variable]
    header = "| setting | block | outer |" if with_setting else "| block | outer |"
    rows = table("docs/results.md", header, start, end)
    for row in rows:
        setting, rest = (row[0], row[1:]) if with_setting else ("block", row)
        blocks = _blocks(rest[0])
        fits = {part: [_fit("scaling-full", variable, setting, b, part) for b in blocks]
                for part in ("outer", "functional", "full")}
        for cell, part in zip(rest[1:4], ("outer", "functional", "full")):
            _check_exponent_cell(cell, fits[part], f"scaling {variable}, {setting} {rest[0]}, {part}")
        _check_theory_cell(rest[4], fits, f"scaling {variable}, {setting} {rest[0]}, theory")
    covered = {(row[0] if with_setting else "block", b) for row in rows for b in _blocks(row[1 if with_setting else 0])}
    fitted = {(f["setting"], f["block"]) for f in data("scaling-full")["fits"] if f["variable"] == variable}
    assert covered == fitted, f"{variable}: blocks fitted but not in the table: {sorted(fitted - covered)}"


def _exp(run_name: str, variable: str, setting: str, block: str, part: str) -> list[float]:
    """A fit's exponent and its interval, [e, lo, hi]."""
    f = _fit(run_name, variable, setting, block, part)
    return [f["exponent"], *f["ci"]]


def _max_quick_diff(variable: str, parts: tuple[str, ...]) -> float:
    full = {(f["setting"], f["block"], f["part"]): f for f in data("scaling-full")["fits"]
            if f["variable"] == variable and f["norm"] == "spectral" and f["part"] in parts and not f["zero"]}
    quick = {(f["setting"], f["block"], f["part"]): f for f in data("scaling-quick")["fits"]
             if f["variable"] == variable and f["norm"] == "spectral" and f["part"] in parts and not f["zero"]}
    assert full.keys() == quick.keys()
    return max(abs(full[k]["exponent"] - quick[k]["exponent"]) for k in full)


def _ci_widening() -> list[float]:
    """Quick's interval widths over the full run's, for (b): [smallest, median, largest]."""
    def width(f):
        return f["ci"][1] - f["ci"][0]
    full = {(f["setting"], f["block"], f["part"]): f for f in data("scaling-full")["fits"]
            if f["variable"] == "seq_len" and f["norm"] == "spectral" and not f["zero"]}
    quick = {(f["setting"], f["block"], f["part"]): f for f in data("scaling-quick")["fits"]
             if f["variable"] == "seq_len" and f["norm"] == "spectral" and not f["zero"]}
    r = [width(quick[k]) / width(full[k]) for k in full]
    return [min(r), statistics.median(r), max(r)]


def test_scaling_quotes():
    sf, sq = data("scaling-full"), data("scaling-quick")
    Q, K, V = "W_Q", "W_K", "W_V"
    frob = [abs(_fit("scaling-full", f["variable"], f["setting"], f["block"], f["part"], "frobenius")["exponent"]
                - f["exponent"])
            for f in sf["fits"] if f["norm"] == "spectral" and f["variable"] in ("input_scale", "ln_variance")
            and not f["zero"]]
    check_quotes("docs/results.md", [
        ("(Frobenius exponents agree to within {} for (a) and (c);", AtMost(max(frob))),
        ("Full preset, {} seeds.", sf["config"]["seeds"]),
        ("geometric mean over the {} seeds", sf["config"]["seeds"]),
        ("`blockhess scaling --quick` (d={}, d_k={}, d_ff={}, L={}, {} seeds, {} s)",
         [sq["config"][k] for k in ("d_model", "d_k", "d_ff", "L", "seeds")] + [run("scaling-quick")["wall_s"]]),
        ("agrees with the full run to within {} on every outer and functional exponent of (a)",
         AtMost(_max_quick_diff("input_scale", ("outer", "functional")))),
        ("(e.g. Q–Q outer {} [{}, {}], Q–Q functional {} [{}, {}], V–V outer {} [{}, {}])",
         [*_exp("scaling-quick", "input_scale", "attention", f"{Q},{Q}", "outer"),
          *_exp("scaling-quick", "input_scale", "attention", f"{Q},{Q}", "functional"),
          *_exp("scaling-quick", "input_scale", "attention", f"{V},{V}", "outer")]),
        ("K–K full {} [{}, {}] quick against {} [{}, {}] full, Q–Q full {} [{}, {}] against {} [{}, {}]",
         [*_exp("scaling-quick", "input_scale", "attention", f"{K},{K}", "full"),
          *_exp("scaling-full", "input_scale", "attention", f"{K},{K}", "full"),
          *_exp("scaling-quick", "input_scale", "attention", f"{Q},{Q}", "full"),
          *_exp("scaling-full", "input_scale", "attention", f"{Q},{Q}", "full")]),
        ("— each within {} of the theory {}, with intervals that do not overlap",
         [AtMost(max(abs(_exp(r, "input_scale", "attention", b, "full")[0] - 5) for r in ("scaling-full", "scaling-quick")
                     for b in (f"{Q},{Q}", f"{K},{K}"))), 5]),
        ("The block's Q–V/K–V outer ({}, CI excluding −2)",
         _exp("scaling-full", "seq_len", "block", f"{Q},{V}", "outer")[0]),
        ("has intervals {}–{}× (median {}×) wider and differs from it by up to {}:",
         [_ci_widening()[0], _ci_widening()[2], _ci_widening()[1],
          _max_quick_diff("seq_len", ("outer", "functional", "full"))]),
        ("attention Q–Q outer {} [{}, {}], Q–K functional {} [{}, {}], V–V outer {} [{}, {}], K–V outer {} [{}, {}] "
         "(full {}); block Q–Q outer {} [{}, {}], K–K full {} [{}, {}] (full {}), V–V outer {} [{}, {}]",
         [*_exp("scaling-quick", "seq_len", "attention", f"{Q},{Q}", "outer"),
          *_exp("scaling-quick", "seq_len", "attention", f"{Q},{K}", "functional"),
          *_exp("scaling-quick", "seq_len", "attention", f"{V},{V}", "outer"),
          *_exp("scaling-quick", "seq_len", "attention", f"{K},{V}", "outer"),
          _exp("scaling-full", "seq_len", "attention", f"{K},{V}", "outer")[0],
          *_exp("scaling-quick", "seq_len", "block", f"{Q},{Q}", "outer"),
          *_exp("scaling-quick", "seq_len", "block", f"{K},{K}", "full"),
          _exp("scaling-full", "seq_len", "block", f"{K},{K}", "full")[0],
          *_exp("scaling-quick", "seq_len", "block", f"{V},{V}", "outer")]),
        ("fitted on the points with τ ≤ {}, i.e. v ≈ {} … {}):",
         [sf["config"]["fit_tau_max"], *(_fit("scaling-full", "ln_variance", "block", "W_V,W_V", "full")["window"][k]
                                          for k in ("min", "max"))]),
        ("`--quick` (τ = {} … {}, fitted on v ≈ {} … {}) gives the same to within {}:",
         [sq["config"]["taus"][0], sq["config"]["taus"][-1],
          *(_fit("scaling-quick", "ln_variance", "block", "W_V,W_V", "full")["window"][k] for k in ("min", "max")),
          AtMost(_max_quick_diff("ln_variance", ("outer", "functional", "full")))]),
        ("V–V {} [{}, {}] (full), Q–V {} [{}, {}] (outer), Q–Q {} [{}, {}] (full) and {} [{}, {}] (functional), "
         "FFN–FFN {}.",
         [*_exp("scaling-quick", "ln_variance", "block", f"{V},{V}", "full"),
          *_exp("scaling-quick", "ln_variance", "block", f"{Q},{V}", "outer"),
          *_exp("scaling-quick", "ln_variance", "block", f"{Q},{Q}", "full"),
          *_exp("scaling-quick", "ln_variance", "block", f"{Q},{Q}", "functional"),
          max((abs(f["exponent"]) for f in sq["fits"] if f["variable"] == "ln_variance" and f["norm"] == "spectral"
               and f["block"] in ("W_1,W_1", "W_1,W_2", "W_2,W_2")))]),
    ])
    # the same blocks, full run: the block's Q–V/K–V outer CI excludes −2
    for b in (f"{Q},{V}", f"{K},{V}"):
        assert _exp("scaling-full", "seq_len", "block", b, "outer")[2] < -1.5 and \
            _exp("scaling-full", "seq_len", "block", b, "outer")[1] > -2
    # 'Valid Theorem-6 bound against the same variance: −1.00 for every attention–attention block, −0.50 for
    # FFN–attention, 0.00 for FFN–FFN'
    groups = {"attention–attention": [], "FFN–attention": [], "FFN–FFN": []}
    for f in sf["fits"]:
        if f["variable"] == "ln_variance" and f["norm"] == "bound":
            a, b = (x in ("W_1", "W_2") for x in f["block"].split(","))
            groups["FFN–FFN" if a and b else "FFN–attention" if a or b else "attention–attention"].append(f["exponent"])
    check_quotes("docs/results.md", [
        ("Valid Theorem-6 bound against the same variance: {} for every attention–attention block (Q–Q, Q–V, V–V), "
         "{} for FFN–attention, {} for FFN–FFN.", list(groups.values())),
    ])


def test_scaling_quotes_bounds_md():
    """bounds.md §9: 'All are recovered to ±0.01 (results.md)', the input-scale exponents against theory."""
    fits = [f for f in data("scaling-full")["fits"] if f["variable"] == "input_scale" and f["norm"] == "spectral"]
    dev = [abs(f["exponent"] - f["theory"]) for f in fits if f["theory"] is not None]
    assert len(dev) == len(fits) - 1  # all but the identically zero V–V functional part
    check_quotes("docs/bounds.md", [("All are recovered to ±{} (results.md).", AtMost(max(dev)))])


def test_scaling_and_bounds_run_times():
    b, sf, sq = data("bounds"), data("scaling-full"), data("scaling-quick")
    loads = [run(n)["load_average_start"][0] for n in ("bounds", "scaling-quick", "scaling-full")]
    check_quotes("docs/results.md", [
        ("Run times (wall clock on the {} shared cores, load average {}–{} at the start of each run;",
         [run("bounds")["cpus"], min(loads), max(loads)]),
        ("`blockhess bounds` {} s ({} s inside the command, {} s of it the trained digits model; CPU {} s)",
         [run("bounds")["wall_s"], b["runtime_s"], b["trained_runtime_s"], run("bounds")["cpu_s"]]),
        ("`blockhess scaling --quick` {} s ({} s inside the command, of which {} s exact Hessians and the rest the "
         "three figures; CPU {} s)",
         [run("scaling-quick")["wall_s"], sq["total_runtime_s"], sq["runtime_s"], run("scaling-quick")["cpu_s"]]),
        ("`blockhess scaling` (full preset: d_model {}, d_k {}, d_ff {}, L {}, {} seeds, {} Hessians) {} min wall "
         "({} s exact Hessians + {} s figures; CPU {} min)",
         [*(sf["config"][k] for k in ("d_model", "d_k", "d_ff", "L", "seeds")), 584, run("scaling-full")["wall_s"] / 60,
          sf["runtime_s"], sf["total_runtime_s"] - sf["runtime_s"], run("scaling-full")["cpu_s"] / 60]),
    ])
    # 584 Hessians: input scale (attention and block) and sequence length (both) per seed, variance (block)
    per_seed = 2 * len(sf["config"]["sigmas"]) + 2 * len(sf["config"]["seq_lens"]) + len(sf["config"]["taus"])
    assert per_seed * sf["config"]["seeds"] == 584


# --------------------------------------------------------------------------- convergence (docs/results.md, convergence.md)


def _t7_row(run_name: str, delta: float) -> dict:
    return next(r for r in data(run_name)["theorem7"]["rows"] if math.isclose(r["delta_rel"], delta, abs_tol=1e-15))


def _path(run_name: str, delta: float) -> dict:
    return next(r for r in data(run_name)["theorem7"]["spectral_norm_at_w_star_plus_delta"]
                if math.isclose(r["delta_rel"], delta))


def _taylor(run_name: str, delta: float, key: str) -> float:
    return next(r for r in data(run_name)["taylor"]["rows"] if math.isclose(r["delta_rel"], delta))[key]["median"]


def _grad(n: int) -> float:
    a = data("convergence-full")["assumption1"]
    return a["grad_norm_mean"][a["N"].index(float(n))]


def test_convergence_tables():
    rows = table("docs/results.md", "| ‖δ‖/‖w*‖ | max (k+1)·\\|ΔL(w)\\| |")
    assert len(rows) == 6
    for delta, measured, bound, margin, margin6 in rows:
        r = _t7_row("convergence-full", shown(delta)[0])
        what = f"Theorem 7 table, δ {delta}"
        assert_shown(measured, r["max_measured_times_k_plus_1"], what)
        assert_shown(bound, r["bound_times_k_plus_1"]["exact"], what + ", bound")
        assert_shown(margin, r["margin"]["exact"], what + ", margin")
        assert_shown(margin6, r["margin"]["theorem6"], what + ", margin (Theorem 6)")
    rows = table("docs/results.md", "| ‖δ‖/‖w*‖ | 2nd order (g + H) |")
    assert [shown(r[0])[0] for r in rows] == pytest.approx([r["delta_rel"] for r in data("convergence-full")["taylor"]["rows"]])
    for delta, *cells in rows:
        for cell, key in zip(cells, ("second_order", "assumption1", "first_order")):
            change, whole = re.fullmatch(rf"({NUMBER}) \(({NUMBER})\)", cell).groups()
            assert_shown(change, _taylor("convergence-full", shown(delta)[0], f"rel_error_change_{key}"),
                         f"Taylor table, δ {delta}, {key}")
            assert_shown(whole, _taylor("convergence-full", shown(delta)[0], f"rel_error_{key}"),
                         f"Taylor table, δ {delta}, {key} (whole difference)")


def test_convergence_quotes():
    c, q = data("convergence-full"), data("convergence-quick")
    t7, sf, ls, a1 = c["theorem7"], c["slope_fit"], c["losses"], c["assumption1"]
    mo = c["model"]
    words = " ".join(section("docs/results.md", "## Loss-landscape convergence").split())
    for env in (c["environment"], q["environment"]):
        assert f"torch {env['torch']}, Python {env['python']}" in words and env["threads"] == 1
        assert f"float64, {env['date'][:10]}." in words
    check_quotes("docs/results.md", [
        ("test accuracy {}; {} training images, L = {} tokens, d = {}, d_ff = {})",
         [mo["test_accuracy"], mo["n_train"], mo["tokens"], mo["cfg"]["d_model"], mo["cfg"]["d_ff"]]),
        ("(n = {}, ‖w*‖ = {});", [mo["n_params"], mo["w_star_norm"]]),
        ("Full run: exact Hessians of all {} training images, {} orderings, {} directions, {} orderings for the bound "
         "rows and the Taylor errors, {} images for the ratios along δ, {} epochs; {} s wall clock, {} s computing "
         "(load average {}–{} on the {} shared cores;",
         [t7["hessian_samples"], c["settings"]["orderings"], c["settings"]["directions"],
          c["settings"]["taylor_orderings"], c["settings"]["path_samples"], c["settings"]["epochs"],
          run("convergence-full")["wall_s"], c["timing"]["total_s"],
          *sorted([run("convergence-full")["load_average_start"][0], run("convergence-full")["load_average_end"][0]]),
          run("convergence-full")["cpus"]]),
        ("exact Hessians of only {} images (so `M` = {} and the bound rows' L_max = {} come from those {}), {} "
         "orderings, {} directions, no {} step, {} epochs, {} orderings for the Taylor errors and only {} images for "
         "the ratios along δ.",
         [q["theorem7"]["hessian_samples"], q["theorem7"]["M_exact"], q["theorem7"]["loss_max_hessian_set"],
          q["theorem7"]["hessian_samples"], q["settings"]["orderings"], q["settings"]["directions"],
          next(x for x in c["settings"]["deltas"] if x not in q["settings"]["deltas"]), q["settings"]["epochs"],
          q["settings"]["taylor_orderings"], q["settings"]["path_samples"]]),
        ("(e.g. median ratio {} instead of {} at {}; 2nd-order error {} instead of {} at {}).",
         [_path("convergence-quick", 0.1)["ratio_median"], _path("convergence-full", 0.1)["ratio_median"], 0.1,
          _taylor("convergence-quick", 0.03, "rel_error_change_second_order"),
          _taylor("convergence-full", 0.03, "rel_error_change_second_order"), 0.03]),
        ("Quick: {} s wall clock, {} s computing, on the shared cores; slope {}, bound holds (smallest margin {}).",
         [run("convergence-quick")["wall_s"], q["timing"]["total_s"], q["slope"], q["bound_margin"]]),
        ("Slope **{}** (r² = {}) over k ∈ [{}, {}].", [sf["slope"], sf["r2"], sf["k_min"], sf["k_max"]]),
        ("That is the mean over {} orderings,", c["settings"]["orderings"]),
        ("Unsmoothed the slope is {}. A single ordering gives {}, and the paper's batch procedure (batches of {}, {} "
         "epochs, N up to {}) gives {}.",
         [sf["slope_unsmoothed"], sf["slope_single_ordering"], c["batch"]["batch_size"], c["batch"]["epochs"],
          c["batch"]["fit"]["k_max"], sf["slope_batch"]]),
        ("where MAD = {} is the mean absolute deviation of the per-sample losses (mean {}, median {}, max {}).",
         [ls["mad_loss"], ls["mean"], ls["median"], ls["max"]]),
        ("The paper's index EMA (α = {}, drawn for comparison) lags by about {} samples.",
         [c["settings"]["paper_ema_alpha"], 1 / c["settings"]["paper_ema_alpha"]]),
        ("figure use L_max = {}, the largest loss of all {} images.", [t7["loss_max_all"], mo["n_train"]]),
        ("(at every multiple of {} samples seen): {} = {}·{} + {}, so each epoch's last batch has {} images, not {}, "
         "and its summed bound is {}/{} of its neighbours'.",
         [mo["n_train"], mo["n_train"], mo["n_train"] // 16, 16, mo["n_train"] % 16, mo["n_train"] % 16, 16,
          mo["n_train"] % 16, 16]),
        ("The smallest ratio of bound to measured is **{}**, at w\\*, over all {} images and {} orderings",
         [c["bound_margin"], mo["n_train"], c["settings"]["orderings"]]),
        ("There the bound is 2·L_max/(k+1) with L_max = {}. The largest measured `(k+1)|ΔL|` is {}:",
         # the bound (k+1)·bound = 2·L_max is the same at every k, so the margin is 2·L_max over the largest (k+1)|ΔL|
         [t7["loss_max_all"], 2 * t7["loss_max_all"] / t7["margin_w_star_all_samples"]]),
        ("whose exact Hessians give `M`, with {} orderings.", c["settings"]["taylor_orderings"]),
        ("In the full run the set is all {} images (δ = 0 margin {}). With `--quick` it is {} images with L_max = {}, "
         "so the δ = 0 panel of the bound figure starts at {}, not at the {} of the differences figure.",
         [t7["hessian_samples"], _t7_row("convergence-full", 0.0)["margin"]["exact"], q["theorem7"]["hessian_samples"],
          q["theorem7"]["loss_max_hessian_set"], q["theorem7"]["loss_max_hessian_set"], t7["loss_max_all"]]),
        ("`M` exact = max over the {} images of ‖H_i(w*)‖₂ = **{}**. The per-sample norms spread over five decades: "
         "median {}, mean {}, min {}. Lanczos residuals are ≤ {}. The largest Frobenius norm ({}) is within {} % of "
         "the largest spectral norm,",
         [t7["hessian_samples"], t7["M_exact"], t7["spectral_norm"]["median"], t7["spectral_norm"]["mean"],
          t7["spectral_norm"]["min"], [t7["spectral_norm"]["max_lanczos_residual"], 5e-8],
          t7["frobenius_norm"]["max"], 100 * (t7["frobenius_norm"]["max"] / t7["spectral_norm"]["max"] - 1)]),
        ("within its bound (smallest ratio {}).", c["batch"]["bound_margin"]),
        ("= max over the images of the per-sample bound = **{}**, **{} times** the exact `M`.",
         [t7["M_theorem6"], t7["theorem6_over_exact"]]),
        ("On {} images, ‖H_i(w*+δ)‖/‖H_i(w*)‖ has median {}, {}, {} and {} at ‖δ‖/‖w*‖ = {}, {}, {}, {}.",
         [c["settings"]["path_samples"], *(_path("convergence-full", d)["ratio_median"] for d in (1e-3, 1e-2, 3e-2, 0.1)),
          1e-3, 1e-2, 3e-2, 0.1]),
        ("For single images it reaches {}× ({}) and {}× ({}):",
         [_path("convergence-full", 0.03)["ratio_max"], 0.03, _path("convergence-full", 0.1)["ratio_max"], 0.1]),
        ("`--quick` measures only {} images (medians {}, {}, {}, {}),",
         [q["settings"]["path_samples"], *(_path("convergence-quick", d)["ratio_median"] for d in (1e-3, 1e-2, 3e-2, 0.1))]),
        ("over {} directions of ‖pred − actual‖ over all k and {} orderings of all {} images.",
         [c["settings"]["directions"], c["settings"]["taylor_orderings"], t7["hessian_samples"]]),
        ("`--quick` uses {} directions and {} orderings of {} images: 2nd-order errors {}, {}, {}, {} and {} at {} … {}.",
         [q["settings"]["directions"], q["settings"]["taylor_orderings"], q["theorem7"]["hessian_samples"],
          *(_taylor("convergence-quick", d, "rel_error_change_second_order") for d in q["settings"]["deltas"]),
          q["settings"]["deltas"][0], q["settings"]["deltas"][-1]]),
        ("up to ‖δ‖ ≈ {}‖w*‖ ({} in absolute norm). It fails beyond {}.",
         [0.01, _path("convergence-full", 0.01)["delta_norm"], 0.03]),
        ("(mean of {} orderings, seeds {}/{}/{}). N = {}: {}; N = {}: {}; N = {}: {}; N = {}: {}; all {} images: **{}**. "
         "The mean per-sample gradient norm is {}, so the full-data gradient is {} % of it.",
         [len(a1["seeds"]), *a1["seeds"], 1, _grad(1), 10, _grad(10), 98, _grad(98), 997, _grad(997), mo["n_train"],
          a1["full_gradient_norm"], a1["mean_per_sample_gradient_norm"], 100 * a1["ratio_full_to_per_sample"]]),
        ("down to the floor ‖∇L_full‖ = {}.", a1["full_gradient_norm"]),
    ])
    assert c["bound_holds"] and q["bound_holds"] and c["bound_margin"] == t7["margin_w_star_all_samples"]
    # 'the 2nd-order model describes the difference to a few per cent up to 10⁻²‖w*‖'
    assert _taylor("convergence-full", 0.01, "rel_error_change_second_order") < 0.1


def test_convergence_md_quotes():
    c, q = data("convergence-full"), data("convergence-quick")
    check_quotes("docs/convergence.md", [
        ("creates it): {} s wall clock, {} s computing, measured on {} cores",
         [run("convergence-quick")["wall_s"], q["timing"]["total_s"], run("convergence-quick")["cpus"]]),
        ("which adds a few seconds ({} s measured).", data("bounds")["trained"]["train_info"]["train_seconds"]),
        ("exact Hessians of all {} training images: 2–4 minutes ({} s wall clock, {} s computing,",
         [c["theorem7"]["hessian_samples"], run("convergence-full")["wall_s"], c["timing"]["total_s"]]),
        ("(their centres run from {} to {} in the default run;", [c["slope_fit"]["k_min"], c["slope_fit"]["k_max"]]),
        ("`--quick` uses a random {}.", q["theorem7"]["hessian_samples"]),
        ("(the largest residual: {} in the full run, {} with `--quick`;",
         [c["theorem7"]["spectral_norm"]["max_lanczos_residual"], q["theorem7"]["spectral_norm"]["max_lanczos_residual"]]),
        ("about {} s per per-sample Hessian (n = {}), Lanczos included, with **one thread** (the full run: {} s for all "
         "{}; `--quick`: {} Hessians in {} s, the whole command {} s with a trained checkpoint).",
         [c["timing"]["per_sample_hessian_s"], c["model"]["n_params"], c["timing"]["hessians_s"],
          c["theorem7"]["hessian_samples"], q["theorem7"]["hessian_samples"], q["timing"]["hessians_s"],
          run("convergence-quick")["wall_s"]]),
    ])
    assert 2 <= run("convergence-full")["wall_s"] / 60 <= 4  # '2–4 minutes'
    assert c["environment"]["threads"] == q["environment"]["threads"] == 1


# --------------------------------------------------------------------------- report (docs/guide/experiments.md, from the README)


def _report_range(key: str, cpu: bool) -> list[float]:
    t = data("report")["timings"]
    v = [t[p]["cpu_s"][key] if cpu else t[p][f"{key}_s"] for p in ("init", "trained")]
    return [min(v), max(v)]


def _model_range(f) -> list[float]:
    m = data("report")["model_hessian"]
    v = [f(m[p]) for p in ("init", "trained")]
    return [min(v), max(v)]


def test_readme_report_quotes():
    r = data("report")
    blocks = r["validation"]["trained"]["by_part"]["full"]["blocks"]
    m, dyn, two = r["model_hessian"], r["training_dynamics"], r["two_blocks"]
    check_quotes("docs/guide/experiments.md", [
        ("the 1,797 8×8 handwritten digits ({} AdamW steps, seed {}: {} % test accuracy in {} s in the stored run;",
         [r["training"]["steps"], r["seeds"]["model"], 100 * r["test_accuracy"], r["training"]["train_seconds"]]),
        ("The stored run of the report\nalone (`docs/data/report.json`, `runs.json`) took {} s at load average {}: the whole model's "
         "closed form {}–{} s of CPU for its full Hessian and both parts on the batch of {} images ({}–{} s of it the full "
         "Hessian; each part a pass of its own), the training snapshots' six Hessians {} s, and the block's autograd "
         "reference {}–{} s of CPU against {}–{} s for its closed form",
         [run("report")["wall_s"], run("report")["load_average_start"][0],
          *_model_range(lambda ph: ph["timings"]["cpu_s"]["closed_form_full"] + ph["timings"]["cpu_s"]["closed_form_parts"]),
          r["batch"], *_model_range(lambda ph: ph["timings"]["cpu_s"]["closed_form_full"]), dyn["cpu_s"],
          *_report_range("reference", True), *_report_range("closed_form_total", True)]),
        ("for a fixed\nbatch of {} training images", r["batch"]),
        ("the exact {} × {} Hessian of the mean cross-entropy", [m["trained"]["n_params"], m["trained"]["n_params"]]),
        ("on the first {} images of the batch (largest relative Frobenius error {} at init and {}\n  trained, the run fails "
         "above {};", [m["validation_images"], m["init"]["validation"]["max_rel_error"],
                       m["trained"]["validation"]["max_rel_error"], r["validation"]["tolerance"]]),
        ("against the block's own Hessian on the whole batch ({}, {});",
         [m["init"]["validation"]["block_agreement_rel_error"], m["trained"]["validation"]["block_agreement_rel_error"]]),
        ("parameter norm at steps 0, 200, …, 1,000", []),
        ("trained in the run ({} % test\n  accuracy), its {} × {} Hessian", [100 * two["test_accuracy"], two["n_params"],
                                                                          two["n_params"]]),
        ("on the first {} images, checked against the reference there ({});", [two["images"], two["validation"]["max_rel_error"]]),
        ("the exact {} × {} Hessian w.r.t. `W_Q, W_K, W_V, W_1, W_2` on its own", [r["n_params"], r["n_params"]]),
        ("relative Frobenius error over all {} block pairs, the three parts and both weight settings:\n  {});",
         [len(blocks), max(r["validation"][p]["max_rel_error"] for p in ("init", "trained"))]),
        ("`validation.max_rel_error`, the largest error of all these checks: about {} (every check\n  passes at {};",
         [r["validation"]["max_rel_error"], r["validation"]["tolerance"]]),
        ("`--model-ref-batch N` (the images of the whole model's check, default {}), `--two-block-batch N`\n(default {})",
         [m["validation_images"], two["images"]]),
    ])
    assert dyn["steps"] == [0, 200, 400, 600, 800, 1000] and len(dyn["snapshots"]) == 6  # 'six Hessians', 'steps 0, 200, …'
    assert r["validation"]["passed"] and r["environment"]["threads"] == 1
    assert "--threads 1" in run("report")["command"] and r["batch"] == 128 and r["dtype"] == "float64"


def test_readme_headline_figures():
    """The README's two headline figures: run16's dense Hessians (benchmarks/results) and the report's
    whole-model check (docs/data/report.json)."""
    r16 = json.loads((ROOT / "benchmarks" / "results" / "run16-hessians.json").read_text())
    cases = {c["id"]: c["methods"] for c in r16["cases"]}
    small, large = cases["b/mse/8x16x32"], cases["b/mse/32x64x128"]
    m = data("report")["model_hessian"]
    check_quotes("README.md", [
        ("`benchmarks/results/run16-hessians.json`: {} AMD EPYC cores, torch 2.13.0, load average {} at the\n  start)",
         [r16["env"]["logical_cpus"], r16["env"]["load_average_at_start"][0]]),
        ("n = 1,792 in {} ms, against {} ms for `torch.func.hessian` and {} ms for jitted\n  `jax.hessian`; n = 28,672 in {} s, "
         "where JAX needs {} s.",
         [1e3 * small["closed_form"]["median_s"], 1e3 * small["func_hessian"]["median_s"], 1e3 * small["jax"]["median_s"],
          large["closed_form"]["median_s"], large["jax"]["median_s"]]),
        ("{} × {} Hessian w.r.t. every parameter agrees with `torch.func` in float64 to a relative\n  Frobenius error of {} "
         "at init and {} trained.",
         [m["trained"]["n_params"], m["trained"]["n_params"], m["init"]["validation"]["max_rel_error"],
          m["trained"]["validation"]["max_rel_error"]]),
    ])
    assert r16["env"]["torch"].startswith("2.13.0") and "AMD EPYC" in r16["env"]["cpu_model"]
    assert [c["n"] for c in r16["cases"] if c["id"] in ("b/mse/8x16x32", "b/mse/32x64x128")] == [1792, 28672]


def test_guide_run_times():
    """The guide's table of run times and the spectrum run's time are the stored runs' (runs.json)."""
    rows = table("docs/guide/experiments.md", "| command | wall clock | CPU | load average at the start |")
    by_command = {r["command"].replace(" --threads 1 --quiet", ""): r for r in data("runs").values()}
    assert len(rows) == len(by_command)
    for command, wall, cpu, load in rows:
        r = by_command[command.strip("`")]
        assert_shown(wall.removesuffix(" s"), r["wall_s"], f"{command} wall clock")
        assert_shown(cpu.removesuffix(" s"), r["cpu_s"], f"{command} CPU")
        assert_shown(load, r["load_average_start"][0], f"{command} load average")
    check_quotes("docs/guide/operators.md", [
        ("The\nstored digits run took {} s on a busy machine (load average {} at the start, {} s of CPU;",
         [run("spectrum")["wall_s"], run("spectrum")["load_average_start"][0], run("spectrum")["cpu_s"]]),
    ])


def test_results_report_section():
    """docs/results.md's report section: the checks table, the training-dynamics table and the quotes."""
    r = data("report")
    m, dyn, two = r["model_hessian"], r["training_dynamics"], r["two_blocks"]
    start = "## The report (`blockhess report`)"
    rows = table("docs/results.md", "| Hessian | images checked |", start)
    assert [row[0] for row in rows] == ["whole model, n = 2,042", "the block, n = 1,792 (callable head loss)",
                                        "two-block model, n = 3,834"]
    assert m["trained"]["n_params"] == 2042 and r["n_params"] == 1792 and two["n_params"] == 3834
    expected = [(m["validation_images"], m["init"]["validation"]["max_rel_error"], m["trained"]["validation"]["max_rel_error"]),
                (r["batch"], r["validation"]["init"]["max_rel_error"], r["validation"]["trained"]["max_rel_error"]),
                (two["images"], None, two["validation"]["max_rel_error"])]
    for row, values in zip(rows, expected):
        for txt, value in zip(row[1:], values):
            if value is None:
                assert txt == "—"
            else:
                assert_shown(txt, value, f"results.md checks table, {row[0]}")
    rows = table("docs/results.md", "| step | loss | test acc. % |", start)
    groups = list(dyn["groups"])
    assert len(rows) == len(dyn["snapshots"])
    for row, snap in zip(rows, dyn["snapshots"]):
        values = [snap["step"], snap["loss"], 100 * snap["test_accuracy"], *(snap["hessian_spectral_norm"][g] for g in groups),
                  *(snap["param_norm"][g] for g in groups)]
        for txt, value in zip(row, values):
            assert_shown(txt, value, f"results.md dynamics table, step {snap['step']}")
    h = {g: [s["hessian_spectral_norm"][g] for s in dyn["snapshots"]] for g in groups}
    pn = {g: [s["param_norm"][g] for s in dyn["snapshots"]] for g in groups}
    ratio_qk = [v / min(q, k) for v, q, k in zip(h["W_V"], h["W_Q"], h["W_K"])] + [v / max(q, k) for v, q, k in zip(h["W_V"], h["W_Q"], h["W_K"])]
    t = {p: m[p]["timings"]["cpu_s"] for p in ("init", "trained")}
    check_quotes("docs/results.md", [
        ("the stored run `docs/data/report.json` (`runs.json`: {} s wall clock, {} s\nof CPU, load average {})",
         [run("report")["wall_s"], run("report")["cpu_s"], run("report")["load_average_start"][0]]),
        ("(`checkpoints/digits_vit.pt`, test\naccuracy {})", r["test_accuracy"]),
        ("The batch: {} training images (seed {}).", [r["batch"], r["seeds"]["batch"]]),
        ("equals the block's Hessian on all {} images to {} (init)\nand {} (trained)",
         [r["batch"], m["init"]["validation"]["block_agreement_rel_error"], m["trained"]["validation"]["block_agreement_rel_error"]]),
        ("({} on `blocks.1.W_Q`)", two["validation"]["by_part"]["full"]["blocks"]["blocks.1.W_Q,blocks.1.W_Q"]),
        ("the closed form (whose diagonal blocks are not mirrored) by {}.", two["validation"]["symmetry_rel_error"]),
        ("grow {}–{}× over the first 1,000 steps", [min(h["W_V"][-1] / h["W_V"][0], h["embedding"][-1] / h["embedding"][0]),
                                                    max(h["W_V"][-1] / h["W_V"][0], h["embedding"][-1] / h["embedding"][0])]),
        ("the query and key blocks stay {}–{}× below `W_V`'s;", [min(ratio_qk), max(ratio_qk)]),
        ("the head's curvature falls {}× as the loss falls and its parameter norm grows {}×",
         [h["head"][0] / h["head"][-1], pn["head"][-1] / pn["head"][0]]),
        ("images {}–{} s (the full Hessian {}–{} s,",
         [min(v["closed_form_full"] + v["closed_form_parts"] for v in t.values()),
          max(v["closed_form_full"] + v["closed_form_parts"] for v in t.values()),
          min(v["closed_form_full"] for v in t.values()), max(v["closed_form_full"] for v in t.values())]),
        ("the six snapshots' full Hessians {} s; on the {} validation images the closed form {} s against\n{} s for "
         "`torch.func` ({}×;",
         [dyn["cpu_s"], m["validation_images"], m["trained"]["validation"]["timings"]["cpu_s"]["closed_form"],
          m["trained"]["validation"]["timings"]["cpu_s"]["reference"],
          m["trained"]["validation"]["timings"]["cpu_s"]["reference"] / m["trained"]["validation"]["timings"]["cpu_s"]["closed_form"]]),
        ("(callable loss) takes {}–{} s for the same batch with both parts", _report_range("closed_form_total", True)),
        ("about {} ms per image per pass in the stored run", 1000 * max(m[p]["timings"]["cpu_s"]["closed_form_full"] for p in m if p != "validation_images") / r["batch"]),
    ])
    # 'a few per cent to 30 %': the embedding's and W_V's parameter norms over the same steps
    assert 0.01 <= pn["embedding"][-1] / pn["embedding"][0] - 1 <= pn["W_V"][-1] / pn["W_V"][0] - 1 <= 0.30


def test_results_spectrum_section():
    """docs/results.md's spectrum section: the per-block table, the check, the series and the cost quotes."""
    sp, rep = data("spectrum"), data("report")
    blocks, ops = sp["spectra"]["blocks"], sp["spectra"]["operators"]
    start = "## Spectra per block, matrix-free (`blockhess spectrum`)"
    rows = table("docs/results.md", "| block | n | products (full, outer, functional) |", start)
    keys = ["W_E", "blocks.0.W_Q", "blocks.0.W_K", "blocks.0.W_V", "blocks.0.W_1", "blocks.0.W_2", "W_H"]
    assert [row[0] for row in rows] == [f"`{k.removeprefix('blocks.0.')}`" for k in keys] and list(blocks) == keys
    for row, key in zip(rows, keys):
        b = blocks[key]
        assert_shown(row[1], b["full"]["n"], f"spectrum table {key} n")
        counts = row[2].removesuffix(" (dense)").split(", ")
        assert row[2].endswith(" (dense)") == (b["full"]["method"] == "dense") and len(counts) == 3
        for txt, part in zip(counts, ("full", "outer", "functional")):
            assert_shown(txt, b[part]["matvecs"], f"spectrum table {key} {part} products")
        for txt, part in zip(row[3:6], ("full", "outer", "functional")):
            assert_shown(txt, b[part]["eigenvalues"][0], f"spectrum table {key} {part} top eigenvalue")
        value, se = row[6].split(" ± ")
        assert_shown(value, b["full"]["trace"]["value"], f"spectrum table {key} trace")
        assert_shown(se, b["full"]["trace"]["stderr"], f"spectrum table {key} trace stderr")
    assert [blocks[k]["full"]["method"] for k in keys] == ["dense"] + ["lanczos"] * 6
    ratio = [b["outer"]["eigenvalues"][0] / b["functional"]["eigenvalues"][0] for b in blocks.values()
             if b["functional"]["eigenvalues"][0] > 0]
    assert blocks["W_H"]["functional"]["eigenvalues"] == [0.0] * 5
    assert all(b["functional"]["matvecs"] == max(b[p]["matvecs"] for p in b) for k, b in blocks.items() if k != "W_H")
    v = sp["validation"]
    parts = [p for rec in v["blocks"].values() for p in rec["parts"].values()]
    z = [p["trace_z"] for p in parts if p["trace_z"] is not None]
    ser = sp["series"]
    tops = {k: [row["eigenvalues"][0] for row in ser["blocks"][k]["full"]] for k in ser["blocks"]}
    steps = [max(a / b, b / a) for parts_ in ser["blocks"].values() for rows_ in parts_.values()
             for a, b in zip([r["eigenvalues"][0] for r in rows_], [r["eigenvalues"][0] for r in rows_[1:]])
             if a > 0 and b > 0]
    t = ser["matvecs_after_the_first"]
    check_quotes("docs/results.md", [
        ("`blockhess spectrum --series --tol 1e-8`\n(`runs.json`: {} s wall clock, {} s of CPU, load average {} at the start "
         "and {} at the end)", [run("spectrum")["wall_s"], run("spectrum")["cpu_s"], run("spectrum")["load_average_start"][0],
                                run("spectrum")["load_average_end"][0]]),
        ("(the digits ViT of `make run`, n = {}; {} training images,\nseed {})", [sp["n_params"], sp["sequences"], sp["settings"]["seed"]]),
        ("(8 probes × 32 steps) and the Hutch++ trace (30 products)", []),
        ("functional part's top eigenvalues are\n{}–{}× smaller than the outer part's", [min(ratio), max(ratio)]),
        ("float64), each part: the largest difference is {}\nof `‖A‖₂` ({} of {} pass", [v["max_rel_diff"], len(parts), len(parts)]),
        ("(z from {} to {}; 10 samples", [min(z), max(z)]),
        ("after the first point, {} products warm-started against {}\ncold ({} % fewer)",
         [t["warm"], t["cold"], 100 * (1 - t["warm"] / t["cold"])]),
        ("move by factors of\nup to {} between them (`W_V`: {} → {} → {} → {} → {} → {} → {})",
         [max(steps), *tops["blocks.0.W_V"]]),
        ("(`W_V` at step 1,000: {} in both)", [[tops["blocks.0.W_V"][5], rep["training_dynamics"]["snapshots"][5]["hessian_spectral_norm"]["W_V"]]]),
        ("on 128 images: {} s (full), {} s (outer), {} s (functional)",
         [ops["full"]["product_seconds"], ops["outer"]["product_seconds"], ops["functional"]["product_seconds"]]),
    ])
    assert v["passed"] and all(p["passed"] for p in parts) and v["max_rel_diff"] <= 1e-8 and len(v["blocks"]) == 7
    assert all(abs(x) <= 4.5 for x in z) and sp["settings"]["trace"] == 30 and sp["settings"]["density"] == [8, 32]
    assert ser["steps"] == [0, 200, 400, 600, 800, 1000, 2000] and sp["settings"]["tol"] == 1e-8
    # the series' top eigenvalues at the snapshots equal the report's Fig. 5 spectral norms (dense, eigvalsh)
    for key, group in (("blocks.0.W_Q", "W_Q"), ("blocks.0.W_K", "W_K"), ("blocks.0.W_V", "W_V")):
        dense = [s_["hessian_spectral_norm"][group] for s_ in rep["training_dynamics"]["snapshots"]]
        assert all(abs(a - b) <= 1e-8 * b for a, b in zip(tops[key], dense)), key


def test_readme_thread_quotes():
    """The thread advice (docs/getting-started.md, from the README) quotes the stored threads run next to a
    busy process pinned to one CPU."""
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "run18-threads-busy-pinned.json"
    med = json.loads(path.read_text())["ab"]["median_ms"]
    check_quotes("docs/getting-started.md", [
        ("the block example of the [user guide](guide/dense.md) with both parts took {} ms on 2 threads against {} ms on 1, "
         "and\n`exact_norms` {} ms against {} ms",
         [med["readme/current/2"], med["readme/current/1"], med["norms/current/2"], med["norms/current/1"]]),
    ])


def _bench_run(name: str) -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())


def test_models_bench_section():
    """docs/results.md's whole-model section: its tables are the rows ``blockhess bench`` writes from the
    stored run of record, and its figures of the earlier runs and of the baselines' settings are those
    of their stored JSON."""
    from blockhess_lab import bench

    text = section("docs/results.md", "### Whole models", "## Memory estimates")
    rows = [line for line in bench.markdown(_bench_run("run20-models-9fd4425")).splitlines() if line.startswith("| m/")]
    assert len(rows) == 3 + 3 + 9
    missing = [r for r in rows if r not in text.splitlines()]
    assert not missing, f"docs/results.md, Whole models: rows that differ from the stored run: {missing}"
    record = [line for line in bench.markdown(_bench_run("run24-models-b72210c")).splitlines() if line.startswith("| m/")]
    assert len(record) == 3 + 3 + 9
    missing = [r for r in record if r not in text.splitlines()]
    assert not missing, f"docs/results.md, the run of record: rows that differ from the stored run24: {missing}"

    def ratios(name):
        cases = {c["id"]: c for c in _bench_run(name)["cases"]}
        out = {}
        for cid, c in cases.items():
            out[cid] = [bench._ratio(c, "func_hessian"), bench._ratio(c, "curvlinops"),
                        bench._peak_delta(c, "closed_form") / c["out_bytes"]]
        return cases, out

    ca, a = ratios("run20-models-8c91a4d")
    cb, b = ratios("run20-models-b8f63f6")
    check_quotes("docs/results.md", [
        ("load average {} at the start): ViT B = 8 {} s,\n{}× `torch.func.hessian`, {}× curvlinops; ViT B = 32 {}× and {}×; "
         "GPT-2 {}× and {}×;\npeaks {}×, {}× and {}× the Hessian.",
         [_bench_run("run20-models-8c91a4d")["env"]["load_average_at_start"][0], ca["m/vit/B8"]["methods"]["closed_form"]["median_s"],
          *a["m/vit/B8"][:2], *a["m/vit/B32"][:2], *a["m/gpt2/B8"][:2], a["m/vit/B8"][2], a["m/vit/B32"][2], a["m/gpt2/B8"][2]]),
        ("load average {} at the start): ViT B = 8 {} ms, {}× and {}×; ViT B = 32 {}× and\n{}×; GPT-2 {} s, {}× and {}×; "
         "peaks {}×, {}×, {}×.",
         [_bench_run("run20-models-b8f63f6")["env"]["load_average_at_start"][0], 1e3 * cb["m/vit/B8"]["methods"]["closed_form"]["median_s"],
          *b["m/vit/B8"][:2], *b["m/vit/B32"][:2], cb["m/gpt2/B8"]["methods"]["closed_form"]["median_s"], *b["m/gpt2/B8"][:2],
          b["m/vit/B8"][2], b["m/vit/B32"][2], b["m/gpt2/B8"][2]]),
    ])
    rd = _bench_run("run20-models-870b317")
    cd, d = ratios("run20-models-870b317")
    loads = [w["load_before"][0] for c in cd.values() for e in c["methods"].values() if (w := e.get("watch"))]
    check_quotes("docs/results.md", [
        ("the same plan at load average {} at the start\nand {} at the end ({}–{} before each job; {} minutes): every time 2–3× "
         "those above (ViT B = 8\n{} s, GPT-2 {} s),",
         [rd["env"]["load_average_at_start"][0], rd["env"]["load_average_at_end"][0], min(loads), max(loads), rd["total_s"] / 60,
          cd["m/vit/B8"]["methods"]["closed_form"]["median_s"], cd["m/gpt2/B8"]["methods"]["closed_form"]["median_s"]]),
        ("against\n`torch.func.hessian` {}×, {}×, {}× (ViT B = 8, B = 32, GPT-2), against curvlinops {}×,\n{}×, {}×; peaks {}×, {}×, {}×.",
         [d["m/vit/B8"][0], d["m/vit/B32"][0], d["m/gpt2/B8"][0], d["m/vit/B8"][1], d["m/vit/B32"][1], d["m/gpt2/B8"][1],
          d["m/vit/B8"][2], d["m/vit/B32"][2], d["m/gpt2/B8"][2]]),
    ])
    st = _bench_run("run20-baseline-settings")["cases"]

    def curv(cid, cols, mb=None):  # the whole batch (B, from the id) as one mini-batch unless mb
        return st[cid]["curvlinops"][f"columns={cols},minibatch={mb or int(cid.rsplit('B', 1)[1])}"]["per_n_columns_s"]

    def func(cid, ch):
        return st[cid]["func_hessian"][f"chunk={ch}"]["time_s"]

    check_quotes("docs/results.md", [
        ("setting: whole H @ I at 1,024 / 256 / 64 columns per product took {} / {} / {} s (ViT B = 8),\n{} / {} / {} s "
         "(GPT-2 B = 8), {} / {} / {} s (ViT B = 32,",
         [curv("m/vit/B8", c) for c in (1024, 256, 64)] + [curv("m/gpt2/B8", c) for c in (1024, 256, 64)]
         + [curv("m/vit/B32", c) for c in (1024, 256, 64)]),
        ("mini-batches of 4 sequences at 256\ncolumns {}, {} and {} s.",
         [curv("m/vit/B8", 256, 4), curv("m/gpt2/B8", 256, 4), curv("m/vit/B32", 256, 4)]),
        ("summed over chunks of 4 sequences of the batch it took {} s against {} s for the\nwhole batch (ViT B = 8), {} s against {} s "
         "(GPT-2), {} s against {} s (ViT B = 32)",
         [func("m/vit/B8", 4), func("m/vit/B8", 8), func("m/gpt2/B8", 4), func("m/gpt2/B8", 8), func("m/vit/B32", 4), func("m/vit/B32", 32)]),
    ])


# --------------------------------------------------------------------------- figures with no stored run

#: figures these docs quote that no stored run backs: earlier code or machines (history), a fresh clone's
#: install, a search script outside the package, one-off timings. Listed (each must still be in its doc) so
#: that a reader of this file sees every quote the checks above do not cover.
UNSTORED = {
    "docs/guide/experiments.md": [
        "the report command in a fresh folder (training included, the\ninstalled environment reused) took 3 min 49 s at "
        "load average 2.6, 151 s of CPU, against\n1 min 3 s and 57 s of CPU before",  # a fresh folder's run: training and all
        "it measured 1.6× slower per image at `d_ff = 64`",
        "two threads made a training step 50× and the closed\nform 10× slower",
        "a fresh clone on another machine gave 95.5 % (and 96.1 % for the two-block model",  # a user's report, float32 training
        "measured `blockhess convergence --quick` at 106 s and `blockhess bench --quick` at 256 s",  # a user's loaded machine
        "its full run about 40 minutes on 2 quiet\ncores, `--quick` about 2 minutes there",  # benchmarks/README.md
    ],
    "docs/getting-started.md": [
        "in about 4 minutes on 2 cores, in two pytest-xdist workers (2 Dec 2026, not stored)",  # the whole suite, one run
    ],
    "docs/results.md": [
        "(2.7e-13 and 3.0e-13 along random directions",  # tests/test_high_precision.py, not a command
        "122 s on quieter ones before)",
        "An adversarial random search (640 configs",
        "with L = 1 (74 rows) and L = 2 (3 rows)",
        "exceeded up to 24× (‖∂A/∂T‖), 285× (Φ_VK), 117× (Φ_QK), 1.14× (‖G_K‖, L = 48,\nweights ×10), 2–3.3×",
        "64 digits 5.3 s → 1.3 s, the full command 623 s → 122 s",  # the benchmarks' history of the assembly
        "a training step took 575 ms against 11 ms on one",  # moved from vit.train's docstring
        "5–8× faster to train through than `blockhess.forward`",  # moved from blockhess_lab.vit's docstring
        "95 s and 10.7 GB for\nall 128 images in a one-off measurement",  # the reason for checking the model on 16
        "a sequence's work space, 12.7 M entries at the\nstored run's commit and 4.4 M after",  # model.walk._sequence_entries
        "its reference is asymmetric\nby 7.9e-14 of its norm",  # measured once on the stored run's 8 images
        # blockhess spectrum: a run at the default tol, and the presets' one-block runs (one-off, not stored)
        "agreed to 9.0e-8 of `‖A‖₂` in an earlier run",
        "the load average was\n3.4–4.6 during both",
        "| `gpt2-block` (float32, B = 8, L = 256, MSE) | 7,087,872 | 1.44 s | 2.82 s | `W_O` top eigenvalue: 51 products, 85 s |",
        "| `cifar100-vit` (float32, B = 8, 64 tokens, CE) | 1,460,964 | 1.36 s | 0.34 s | `blocks.0.W_V` top eigenvalue: 11 "
        "products, 2.9 s |",
        "(97 s wall clock in all)",
        "(1.7 s per `W_O` product against 2.8 s)",
    ],
    "docs/bounds.md": [
        "up to ~0.45 in the search",
        "up to 285 in the search (`Φ_QK` up to 117 times)",
        "exceeded 1.14 times at L = 48",
        "up to 2–3.3 times below the exact values; L = 2: up\n    to 1.6 times",
        "(block, zero residual, weights ×0.1: 3 rows)",
    ],
    "docs/convergence.md": [
        "64 digits 5.3 s against 1.3 s now, 2 threads",
        "the\nsame work ran 3–4× slower, and `bounds.block_bounds` ran 200× slower (7 s against 0.03 s per\nsample)",
        "took about 20 ms per sequence at n = 1,792 on 2 cores",  # moved from per_sample_hessians' docstring
    ],
}


@pytest.mark.parametrize("name", list(UNSTORED))
def test_unstored_figures_are_listed(name):
    text = " ".join(doc(name).split())
    missing = [q for q in UNSTORED[name] if " ".join(q.split()) not in text]
    assert not missing, f"{name}: no longer in the doc (remove from UNSTORED, or check it above): {missing}"


def _set(values) -> str:
    return "{" + ", ".join(f"{v:g}" for v in values) + "}"


def test_settings_quoted():
    """The settings the sections name (sizes, seeds, grids) are those of the stored runs."""
    text = " ".join(doc("docs/results.md").split())
    v = data("validate-full")["cases"]
    assert sorted({c["input_scale"] for c in v}) == [0.01, 1.0, 10.0] and "input scales 0.01, 1 and 10" in text
    assert sorted({c["batch"] for c in v if c["batch"]}) == [2, 3] and "batches of 2 and 3" in text
    assert min(c["L"] for c in v) == 1
    sw = data("bounds")["sweep"]
    c = sw["config"]
    assert (f"Sweep (d={c['d_model']}, d_k={c['d_k']}, d_ff={c['d_ff']}; L ∈ {_set(sw['lengths'])}; weights "
            f"×{_set(sw['weight_scales'])}; σ ∈ {_set(sw['scales'])};") in text
    assert f"(median over {sw['seeds']} seeds)" in text
    tr = data("bounds")["trained"]
    assert f"digits ViT, trained (test acc. {tr['test_accuracy']:.3f}), {tr['batch']} images, MSE" in text
    rnd = next(t for t in data("bounds")["tables"] if t["kind"] == "attention")["config"]
    assert f"random weights, attention, d=d_k={rnd['d_model']}, L={rnd['L']}, σ=1 (Thm 1)" in text
    assert rnd["d_model"] == rnd["d_k"] and rnd["d_ff"] == 32 and "block, d_ff=32 (Thm 6)" in text
    f, q = data("scaling-full")["config"], data("scaling-quick")["config"]
    assert f["sigmas"][0] == 1e-3 and f["fit_sigma_max"] == pytest.approx(10 ** -1.5)
    assert "fitted on σ ∈ [10⁻³, 10⁻¹·⁵]" in text
    assert f"L ∈ {_set(f['seq_lens'])} at fixed ‖X‖₂ = {f['rho']:g}" in text
    assert f"`--quick` (L ∈ {{{q['seq_lens'][0]}, …, {q['seq_lens'][-1]}}}, d={q['d_model']}, {q['seeds']} seeds)" in text
    assert (f["taus"][0], f["taus"][-1]) == pytest.approx((1e-6, 1.0)) and "τ = 10⁻⁶ … 1" in text


# --------------------------------------------------------------------------- compare (docs/results.md)

#: the run of record of ``blockhess compare``, one JSON per preset in benchmarks/results/
COMPARE = {"gpt2": "compare-gpt2-4aa2646", "vit": "compare-vit-4aa2646", "llama": "compare-llama-4aa2646"}
COMPARE_METHODS = ("kfac", "ekfac", "kronfluence_ekfac", "gptq_raw", "gptq_best", "sophia_1", "sophia_100", "hutchinson_2",
                   "hutchinson_100")


@functools.cache
def compare_run(preset: str) -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / f"{COMPARE[preset]}.json").read_text())


@pytest.mark.parametrize("part, header", [("outer", "| GGN: model | method |"), ("full", "| Hessian: model | method |")])
def test_results_compare_tables(part, header):
    """docs/results.md's compare tables: the whole model's row of every method and model, from the stored runs."""
    start = "## Approximations against the exact curvature (`blockhess compare`"
    rows = table("docs/results.md", header, start)
    want = [(p, m) for p in COMPARE for m in COMPARE_METHODS if m in compare_run(p)["results"][part]["whole"]]
    assert [(r[0].strip("`"), r[1].strip("`")) for r in rows] == want
    for r, (p, m) in zip(rows, want):
        got = compare_run(p)["results"][part]["whole"][m]
        for txt, key in zip(r[2:6], ("rel_fro", "top_cos", "inverse_cos", "spearman")):
            assert_shown(txt, got[key], f"compare {p} {part} {m} {key}")
        if m.startswith("hutchinson"):
            assert_shown(r[6], got["trace_rel"], f"compare {p} {part} {m} trace_rel")
        else:
            assert r[6] == "–"


def test_results_compare_quotes():
    g, v, ll = (compare_run(p) for p in COMPARE)
    assert [r["settings"]["seed"] for r in (g, v, ll)] == [0, 0, 0]
    assert all(COMPARE[p].endswith("-" + compare_run(p)["environment"]["blockhess_commit"]) for p in COMPARE)
    mods = {p: compare_run(p)["results"]["outer"] for p in COMPARE}
    kfac = [r["kfac"]["rel_fro"] for p in ("gpt2", "vit") for k, r in mods[p].items() if k != "whole" and "kfac" in r]
    ll_kfac = [r["kfac"]["rel_fro"] for k, r in mods["llama"].items() if k != "whole" and "kfac" in r]
    kf = {p: [r["kronfluence_ekfac"]["rel_fro"] < r["ekfac"]["rel_fro"] for k, r in mods[p].items()
              if k != "whole" and "ekfac" in r] for p in ("gpt2", "llama")}
    check_quotes("docs/results.md", [
        ("closer than curvlinops' EKFAC on {} of GPT-2's {} weight matrices and {} of the Llama model's {}",
         [sum(kf["gpt2"]), len(kf["gpt2"]), sum(kf["llama"]), len(kf["llama"])]),
        ("GPT-2 ({} weights in the whole model's {} matrices)", [sum(g["modules"][n] for n in g["whole"]), len(g["whole"])]),
        ("ViT ({} weights in {} matrices)", [sum(v["modules"][n] for n in v["whole"]), len(v["whole"])]),
        ("`LlamaForCausalLM` ({} weights in {} matrices;", [sum(ll["modules"][n] for n in ll["whole"]), len(ll["whole"])]),
        ("per weight matrix, KFAC's relative error against the GGN block runs from {} to {}", [min(kfac), max(kfac)]),
        ("(`compare-gpt2-4aa2646`: {} s", [g["timings"]["total_s"]]),
        ("`compare-vit-4aa2646`: {} s", [v["timings"]["total_s"]]),
        ("`compare-llama-4aa2646`: {} s", [ll["timings"]["total_s"]]),
        ("as close to the GGN as KFAC over the whole GPT-2 ({} against {})",
         [g["results"]["outer"]["whole"][k]["rel_fro"] for k in ("kronfluence_ekfac", "kfac")]),
        ("(GPT-2's `blocks.0.W_O`: {} against {})", [mods["gpt2"]["blocks.0.W_O"][k]["rel_fro"]
                                                      for k in ("kronfluence_ekfac", "ekfac")]),
        ("(whole model {} against {}; the\n  head, which curvlinops' matches to {}, {} from 800 draws)",
         [v["results"]["outer"]["whole"]["kronfluence_ekfac"]["rel_fro"], v["results"]["outer"]["whole"]["ekfac"]["rel_fro"],
          mods["vit"]["W_H"]["ekfac"]["rel_fro"], mods["vit"]["W_H"]["kronfluence_ekfac"]["rel_fro"]]),
        ("is\n  {} (GPT-2), {} (ViT) and {} (Llama)", [compare_run(p)["results"]["outer"]["whole"]["kronfluence_ekfac"]["spearman"]
                                                 for p in COMPARE]),
        ("Over the\n  whole model its error is {} (GPT-2) and {} (ViT)", [g["results"]["outer"]["whole"]["kfac"]["rel_fro"],
                                                             v["results"]["outer"]["whole"]["kfac"]["rel_fro"]]),
        ("nearly\n  orthogonal to the GGN's (alignment {})", [g["results"]["outer"]["whole"]["kfac"]["top_cos"]]),
        ("on GPT-2 its whole-model error is {} against KFAC's\n  {}", [g["results"]["outer"]["whole"]["ekfac"]["rel_fro"],
                                                                   g["results"]["outer"]["whole"]["kfac"]["rel_fro"]]),
        ("(relative error {} on GPT-2)", [g["results"]["outer"]["whole"]["gptq_raw"]["rel_fro"]]),
        ("error is about 1 ({}, {}), with a good top-eigenvector alignment on GPT-2 ({}) and a poor one\n  on the ViT ({})",
         [g["results"]["outer"]["whole"]["gptq_best"]["rel_fro"], v["results"]["outer"]["whole"]["gptq_best"]["rel_fro"],
          g["results"]["outer"]["whole"]["gptq_best"]["top_cos"], v["results"]["outer"]["whole"]["gptq_best"]["top_cos"]]),
        ("(GPT-2: {} at one draw, {} at 100; Hutchinson {} at 2 probes, {} at 100)",
         [g["results"]["outer"]["whole"][k]["rel_fro"] for k in ("sophia_1", "sophia_100", "hutchinson_2", "hutchinson_100")]),
        ("(GPT-2's inverse-product cosine {} at 100\n  probes)", [g["results"]["outer"]["whole"]["hutchinson_100"]["inverse_cos"]]),
        ("(relative error {} at 100 probes on GPT-2's GGN)", [g["results"]["outer"]["whole"]["hutchinson_100"]["trace_rel"]]),
        ("(the whole GPT-2's `‖H‖_F` {} against the GGN's\n  {})", [g["exact"]["full"]["whole"]["fro"], g["exact"]["outer"]["whole"]["fro"]]),
        ("KFAC's whole-model error is {}\n  and EKFAC's {}; per weight matrix KFAC's runs from {} (the head) to {} (`blocks.0.W_2`)",
         [ll["results"]["outer"]["whole"]["kfac"]["rel_fro"], ll["results"]["outer"]["whole"]["ekfac"]["rel_fro"],
          min(ll_kfac), max(ll_kfac)]),
        ("GPTQ proxy at its best multiple has error {} with a top-eigenvector alignment of {}",
         [ll["results"]["outer"]["whole"]["gptq_best"]["rel_fro"], ll["results"]["outer"]["whole"]["gptq_best"]["top_cos"]]),
        ("(`‖G‖_F` {}, `‖H‖_F` {})", [ll["exact"]["outer"]["whole"]["fro"], ll["exact"]["full"]["whole"]["fro"]]),
    ])
    assert all(r["methods"]["kronfluence_ekfac"]["draws"] * r["settings"]["batch"] == 800 for r in (g, v, ll))
    assert min(ll_kfac) == mods["llama"]["W_H"]["kfac"]["rel_fro"]
    assert max(ll_kfac) == mods["llama"]["blocks.0.W_2"]["kfac"]["rel_fro"]
    hq = [r["hutchinson_2"]["rel_fro"] for k, r in mods["gpt2"].items() if k in ("blocks.0.W_Q", "blocks.0.W_K")]
    assert all(100 <= e < 10_000 for e in hq)  # "relative errors of 10²–10³ there"
    assert max(kfac) == mods["gpt2"]["blocks.0.W_V"]["kfac"]["rel_fro"] and min(kfac) == mods["vit"]["W_H"]["kfac"]["rel_fro"]
