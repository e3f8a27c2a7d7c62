"""The shape of the distribution: the library ``blockhess`` needs torch, numpy and psutil only and
never imports the research harness ``blockhess_lab`` (the drivers and the command line) or the
harness's extra (matplotlib, scikit-learn, SciPy, tqdm); the harness imports only what the
core and the ``lab`` (or ``bench``) extra install; without the extra the command line says so."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
CORE = {"torch", "numpy", "psutil"}
LAB = {"matplotlib", "sklearn", "scipy", "tqdm"}  # import names of the lab extra
BENCH = {"jax", "jaxlib", "curvlinops"}  # import names of the bench extra (bench's own baselines)
HF = {"transformers"}  # the hf extra: compare's models (it says which extras it needs when they are missing)
#: optional packages the core imports inside the one function that needs them, never at import time:
#: the operators' SciPy export (HessianOperator.to_scipy) and the dataset mean's progress bar
LAZY = {"blockhess/operators/operator.py": {"scipy", "tqdm"}}
#: the integrations with other libraries (blockhess.integrations), each imported only by its user: their
#: library at module level; nothing else in blockhess imports them
INTEGRATIONS = {"blockhess/integrations/laplace.py": {"laplace"}}
#: packages of requirements-laplace.txt (installed --no-deps, no extra) the harness imports inside the one
#: function that needs them, never at import time; without them that column is reported not run
NO_DEPS = {"blockhess_lab/compare.py": {"kronfluence"}}


def _python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter on this checkout's sources, on one thread."""
    env = {"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PATH": ""}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def _without_lab(code: str) -> str:
    """``code`` in an interpreter where the lab extra's packages cannot be imported (as in an
    install without it): a ``None`` in ``sys.modules`` makes ``import`` raise ImportError and
    ``importlib.util.find_spec`` return None."""
    return f"import sys\nfor _m in {sorted(LAB)!r}:\n    sys.modules[_m] = None\n{code}"


def _imports(path: Path) -> set[str]:
    """Top-level names of every absolute import in ``path``, at any depth (lazy imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_import_blockhess_loads_nothing_of_the_harness():
    # torch itself imports tqdm where it is installed (torch.hub uses it if it can), so the check
    # is what `import blockhess` adds to `import torch, numpy, psutil`
    probe = ("import sys\nimport torch, numpy, psutil\nbefore = set(sys.modules)\nimport blockhess\n"
             f"print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {sorted(LAB | {'blockhess_lab'})!r}))")
    run = _python(probe)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_the_library_works_without_the_lab_extra():
    probe = _without_lab(
        "import torch, blockhess as bh\n"
        "cfg = bh.BlockConfig(d_model=4, d_ff=6)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "p, X, T = bh.init_params(cfg, seed=0), *torch.randn(2, 3, 4, generator=g, dtype=torch.float64)\n"
        "H = bh.hessian(p, X, cfg, loss='mse', target=T)\n"
        "R = bh.reference.hessian(p, X, cfg, loss='mse', target=T)\n"
        "from blockhess.linalg import rel_error\n"
        "assert rel_error(H.dense(), R.dense()) <= 1e-10\n"
        f"print(sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in {sorted(LAB)!r}))")
    run = _python(probe)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_the_adapters_work_without_transformers():
    """transformers (the hf extra) is optional: blockhess never imports it, and reads PyTorch's own
    modules without it."""
    probe = ("import sys\nsys.modules['transformers'] = None\nimport torch, blockhess as bh\n"
             "cfg, p = bh.from_torch(torch.nn.TransformerEncoderLayer(4, 2, 6, batch_first=True).eval())\n"
             "assert cfg.n_heads == 2\n"
             "print(sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] == 'transformers'))")
    run = _python(probe)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


@pytest.mark.parametrize("entry", ["from blockhess_lab.cli import main; sys.exit(main(['--help']))",
                                   "import runpy; runpy.run_module('blockhess', run_name='__main__')"])
def test_the_command_line_without_the_lab_extra_says_what_to_install(entry):
    run = _python(_without_lab(entry))
    assert run.returncode == 2, (run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs the 'lab' extra" in lines[0], run.stderr
    assert "pip install 'blockhess[lab]'" in lines[0]
    assert all(dist in lines[0] for dist in ("matplotlib", "scikit-learn", "scipy", "tqdm"))


@pytest.mark.parametrize("entry", ["from blockhess_lab.cli import main; sys.exit(main(['--version']))",
                                   "sys.argv[1:] = ['--version']; import runpy; runpy.run_module('blockhess', run_name='__main__')"])
def test_version_works_without_the_lab_extra(entry):
    run = _python(_without_lab(entry))
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert re.fullmatch(r"blockhess \S+\n", run.stdout) and run.stderr == ""


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports run when ``path`` is imported (outside any function)."""
    names = set()
    todo = list(ast.parse(path.read_text(), filename=str(path)).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        todo.extend(ast.iter_child_nodes(node))
    return names


def test_the_core_imports_only_torch_numpy_psutil_and_the_standard_library():
    allowed = CORE | set(sys.stdlib_module_names) | {"blockhess"}
    bad = {}
    for path in sorted((SRC / "blockhess").rglob("*.py")):
        if path.name == "__main__.py":  # `python -m blockhess`: the harness's command line (never imported by the library)
            assert _imports(path) - allowed == {"blockhess_lab"}
            continue
        rel = path.relative_to(SRC).as_posix()
        extra = _imports(path) - allowed - LAZY.get(rel, set()) - INTEGRATIONS.get(rel, set())
        eager = _module_level_imports(path) & LAZY.get(rel, set())
        if extra or eager:
            bad[rel] = sorted(extra | eager)
        if not rel.startswith("blockhess/integrations/") and "integrations" in path.read_text():
            tree = ast.parse(path.read_text())
            if any(isinstance(n, ast.ImportFrom) and "integrations" in (n.module or "") for n in ast.walk(tree)):
                bad[rel] = ["blockhess.integrations"]
    assert not bad, bad
    assert all((SRC / rel).exists() for rel in {**LAZY, **INTEGRATIONS})


def test_a_module_level_import_is_told_from_a_lazy_one(tmp_path):  # the check above can fail
    f = tmp_path / "m.py"
    f.write_text("import numpy\ntry:\n    import scipy\nexcept ImportError:\n    pass\n"
                 "def f():\n    import tqdm\n")
    assert _module_level_imports(f) == {"numpy", "scipy"} and _imports(f) == {"numpy", "scipy", "tqdm"}


def test_the_harness_imports_only_what_the_core_and_its_extras_install():
    allowed = CORE | LAB | BENCH | HF | set(sys.stdlib_module_names) | {"blockhess", "blockhess_lab"}
    bad = {str(p.relative_to(SRC)): sorted(_imports(p) - allowed - NO_DEPS.get(str(p.relative_to(SRC)), set()))
           for p in sorted((SRC / "blockhess_lab").rglob("*.py"))
           if _imports(p) - allowed - NO_DEPS.get(str(p.relative_to(SRC)), set())}
    assert not bad, bad
    eager = {f: sorted(_module_level_imports(SRC / f) & names) for f, names in NO_DEPS.items()
             if _module_level_imports(SRC / f) & names}
    assert not eager, eager


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.\-]+(\[[^\]]*\])?", r).group(0).lower() for r in reqs}


def test_pyproject_core_requirements_are_torch_numpy_psutil():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert _requirement_names(project["dependencies"]) == {"torch", "numpy", "psutil"}
    extras = project["optional-dependencies"]
    assert _requirement_names(extras["lab"]) == {"matplotlib", "scikit-learn", "scipy", "tqdm"}
    assert "blockhess[lab,hf]" in _requirement_names(extras["dev"]) and "blockhess[lab,hf]" in _requirement_names(extras["bench"])
    assert _requirement_names(extras["hf"]) == {"transformers"}
    assert project["scripts"] == {"blockhess": "blockhess_lab.cli:main"}
