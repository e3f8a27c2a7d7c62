"""The examples in the docstrings, in README.md and in the docs' pages (getting started, the user guide)
run and print what they say."""

import code
import contextlib
import doctest
import io
import re
import sys
from pathlib import Path

import pytest
import torch

import blockhess
from blockhess import convergence
from blockhess_lab import vit

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: the pages whose ```python blocks are run, each alone: the README's and those moved from it into the docs
PAGES = [README, ROOT / "docs" / "index.md", ROOT / "docs" / "getting-started.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


PYTHON_BLOCKS = _python_blocks(README)
#: (page, index, code): the README's blocks each alone; a docs page's after its earlier blocks, as a reader pastes a
#: page in one interpreter (a fragment that needs the reader's own objects is fenced ```py, not run)
ALL_BLOCKS = [(p.relative_to(ROOT).as_posix(), i, b if p == README else "\n".join(_python_blocks(p)[:i + 1]))
              for p in PAGES for i, b in enumerate(_python_blocks(p))]


@pytest.mark.parametrize("module", [blockhess, convergence], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_readme_has_its_python_examples():
    assert len(PYTHON_BLOCKS) >= 3, "README.md's ```python blocks were not found"


class _Paste(code.InteractiveConsole):
    """The interactive interpreter, its error output (syntax errors, tracebacks) collected."""

    def __init__(self):
        super().__init__({"__name__": "__readme__"})
        self.errors = []

    def write(self, data):
        self.errors.append(data)


@pytest.mark.parametrize("index", range(len(ALL_BLOCKS)), ids=lambda i: f"{ALL_BLOCKS[i][0]}-block{ALL_BLOCKS[i][1] + 1}")
def test_readme_python_block_runs_alone(index, tmp_path, monkeypatch):
    """Each ```python block of README.md pasted alone, and of a docs page after the page's earlier blocks, line by
    line into a fresh interactive interpreter, runs without an error, and what it echoes is short."""
    monkeypatch.chdir(tmp_path)  # what a block writes (the digits checkpoint) stays out of the tree
    monkeypatch.setattr(vit, "DEFAULT_STEPS", 20)  # the block runs as written; 20 training steps instead of 2,000 for time
    threads = torch.get_num_threads()  # the first block sets one thread, as it advises
    # the console reports a traceback through sys.excepthook where something has replaced it (an import can):
    # the default hook makes it write to the console, where it is collected
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    try:
        console = _Paste()
        shown = []
        monkeypatch.setattr(sys, "displayhook", lambda value: shown.append(repr(value)) if value is not None else None)
        with contextlib.redirect_stdout(io.StringIO()):
            for line in ALL_BLOCKS[index][2].splitlines() + [""]:
                console.push(line)
        assert not console.errors, "".join(console.errors)
        # a screenful: torch summarises large tensors; a dataclass holding them would print them whole
        assert all(len(text) <= 5000 for text in shown), [text[:200] for text in shown if len(text) > 5000]
    finally:
        torch.set_num_threads(threads)
