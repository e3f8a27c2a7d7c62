"""Public docstrings of ``blockhess`` give shapes, dtypes, errors and sources, not measurements: a timing,
a memory figure, a speed factor, a machine, a run name or a date belongs in docs/results.md (history
and reasons in docs/derivations.md). Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

#: what a measurement looks like in prose
MARKERS = re.compile(
    r"\b\d+(?:[.,]\d+)?\s*(?:ms|µs|us|s|min|GiB|MiB|KiB|GB|MB|kB)\b(?![\\^_{])"  # a time or a memory figure (not a symbol in TeX)
    r"|\bmeasured\b"
    r"|\brun\d+\b"  # a stored benchmark run
    r"|\b\d+(?:\.\d+)?\s*×\s*(?:faster|slower|longer)\b"  # a speed factor
    r"|\b\d+\s+(?:CPU\s+)?cores?\b"  # a machine
    r"|\b20\d\d-\d\d-\d\d\b"  # a date
    r"|\bbefore this change\b",
    re.IGNORECASE,
)

BEING_MOVED: dict[str, str] = {}  # none: every module of the core is checked


def _modules() -> dict[str, Path]:
    root = Path(importlib.util.find_spec("blockhess").submodule_search_locations[0])
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = ["blockhess", *f.relative_to(root).with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _excepted(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in BEING_MOVED)


def _public_docstrings(tree: ast.Module):
    """``(qualified name, line, docstring)`` of the module and of every public class, function and
    method (a name without a leading underscore, inside public classes only)."""
    doc = ast.get_docstring(tree, clean=False)
    if doc:
        yield "<module>", 1, doc

    def walk(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                d = ast.get_docstring(node, clean=False)
                if d:
                    yield f"{prefix}{node.name}", node.body[0].lineno, d
                if isinstance(node, ast.ClassDef):
                    yield from walk(node.body, f"{prefix}{node.name}.")

    yield from walk(tree.body, "")


def _hits(source: str) -> list[str]:
    found = []
    for name, line, doc in _public_docstrings(ast.parse(source)):
        for i, text in enumerate(doc.splitlines()):
            if MARKERS.search(text):
                found.append(f"{name} (line {line + i}): {text.strip()}")
    return found


MODULES = _modules()
CHECKED = [m for m in MODULES if not _excepted(m)]


def test_the_modules_are_found():
    assert {"blockhess", "blockhess.hessian", "blockhess.losses", "blockhess.validation"} <= set(CHECKED)


@pytest.mark.parametrize("text", [
    "at n = 28,672 on 2 CPU cores, 1.2 s instead of 2.7 s for a fresh call",
    "about 20 ms per sequence",
    "passes of as many sequences as fit in 64 MiB",
    "calibrated on measured peaks",
    "the thresholds of run18",
    "a step took 50× longer",
    "on 30 Nov, 2026-11-30",
])
def test_a_measurement_is_caught(text):  # the check below can fail
    assert _hits(f'r"""{text}"""')


@pytest.mark.parametrize("text", [
    "Blocks of shape ``(numel_a, numel_b)``, an ``(n, n)`` tensor, ``(B, L·d, R)``, float32 or float64",
    "a matrix below ``512 × 512``; Theorem 5 / eq. 10; docs/derivations.md §1",
    r":math:`\Gamma = -\frac{1}{d\sigma^2}\big(s\,C - 3 s\, y y^\top/d\big)`",
    "Raises ``InsufficientMemoryError`` with the bytes needed and available",
])
def test_shapes_and_sources_pass(text):
    assert not _hits(f'r"""{text}"""')


def test_a_private_docstring_is_not_read():
    assert not _hits('def _kernel():\n    """took 3 ms"""\n') and _hits('def kernel():\n    """took 3 ms"""\n')


@pytest.mark.parametrize("module", CHECKED)
def test_no_measurement_in_public_docstrings(module):
    hits = _hits(MODULES[module].read_text(encoding="utf-8"))
    assert not hits, (f"{module}: measurements belong in docs/results.md (reasons and history in "
                      "docs/derivations.md), not in docstrings:\n" + "\n".join(hits))
