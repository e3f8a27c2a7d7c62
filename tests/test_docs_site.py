"""The documentation site's contract (mkdocs.yml, docs/): every public name is in the API reference,
the README stays short and keeps its two commands, CI runs them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import blockhess
import blockhess.distributed
import blockhess.operators

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"


def _api_text() -> str:
    return "\n".join(p.read_text() for p in sorted(API.glob("*.md")))


@pytest.mark.parametrize("module", [blockhess, blockhess.operators, blockhess.distributed], ids=lambda m: m.__name__)
def test_every_public_name_is_in_the_api_reference(module):
    """Each name of the module's ``__all__`` is written in the API pages (as a word: in a ``:::``
    directive's path, a members list or the text), so that the reference covers the public API."""
    text = _api_text()
    missing = [n for n in module.__all__ if not re.search(rf"(?<![\w]){re.escape(n)}(?![\w])", text)]
    assert not missing, f"{module.__name__}: not in docs/api/*.md: {missing}"


def test_the_api_pages_are_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(f"api/{p.name}" in nav for p in API.glob("*.md"))


def test_readme_is_short_and_keeps_its_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "make run" in readme and "make test" in readme
    assert sum(1 for _ in re.finditer(r"^```python\n", readme, flags=re.M)) <= 5


def test_ci_runs_the_tests_the_linter_the_docs_and_the_wheel():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    for step in ("make test", "ruff check", "mkdocs build --strict", "python -m build", "--version"):
        assert step in ci, step
