"""The packages' shape, read from their source (``ast``, nothing imported): no import cycle, the core
never imports the adapters, no module uses another module's private (``_underscore``) names, and
the block's forward pass is written only in the block, its layers, the autograd reference and the
JAX baseline."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGES = ("blockhess", "blockhess_lab")
ADAPTERS = "blockhess.adapters"
#: modules outside the core: the adapters (the package and its modules), the package's front (it
#: re-exports them) and its CLI entry
NOT_CORE = {"blockhess", "blockhess.__main__"}
INTEGRATIONS = "blockhess.integrations"  # other libraries' interfaces on top of the public API, adapters included


def _is_adapter(module: str) -> bool:
    return module == ADAPTERS or module.startswith(ADAPTERS + ".")
#: where a forward pass of the block (or of one of its layers) is written
FORWARD_HOMES = {"blockhess.block.forward_pass", "blockhess.model.forward_pass", "blockhess.reference",
                 "blockhess_lab.bench_jax"}
FORWARD_PREFIXES = ("blockhess.layers.",)  # each layer's own forward, which the block calls
#: a softmax or LayerNorm call, or a product with a weight, elsewhere, with its reason
FORWARD_ALLOWED = {
    ("blockhess.losses", "softmax"): "the cross-entropy's probabilities, a loss and not the block",
    ("blockhess.model.stages", "softmax"): "the head's cross-entropy probabilities, the loss at the top of the walk",
    ("blockhess_lab.bench_worker", "layer_norm"): "the LayerNorm Jacobian benchmark's autograd baseline",
    ("blockhess_lab.scaling", "C @ params['W_V']"): "makes a weight (W_V centred), not a forward pass",
    ("blockhess.block.second_order", "g @ p['W_O'].T"): "the gradient back through W_O, not a forward pass",
    ("blockhess_lab.compare", "softmax"): "Sophia's and kronfluence's sampled labels, drawn from the model's output "
                                          "probabilities, not the block",
}
WEIGHTS = {"W_Q", "W_K", "W_V", "W_O", "W_1", "W_2"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of :data:`PACKAGES`: dotted name -> (file, is a package ``__init__``)."""
    out = {}
    for pkg in PACKAGES:
        root = Path(importlib.util.find_spec(pkg).submodule_search_locations[0])
        for f in sorted(root.rglob("*.py")):
            parts = [pkg, *f.relative_to(root).with_suffix("").parts]
            init = parts[-1] == "__init__"
            out[".".join(parts[:-1] if init else parts)] = (f, init)
    return out


MODULES = _modules()
TREES = {m: ast.parse(f.read_text(encoding="utf-8"), str(f)) for m, (f, _) in MODULES.items()}


def _base(module: str, node: ast.ImportFrom) -> str | None:
    """The absolute module a ``from ... import`` names (relative levels resolved)."""
    if node.level == 0:
        return node.module
    parts = module.split(".") if MODULES[module][1] else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _imports(module: str):
    """``(target module, imported name or None, line)`` for every import of a package module in
    ``module``, at any depth (imports inside functions count); ``from m import sub`` of a
    submodule ``m.sub`` is an import of ``m.sub``."""
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node)
            if base not in MODULES:
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                yield (sub, None, node.lineno) if sub in MODULES else (base, a.name, node.lineno)


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in _imports(m) if t != m} for m in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules, or ``None``."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_the_modules_are_found():
    assert {"blockhess.block.forward_pass", "blockhess.adapters", "blockhess.adapters.hf", "blockhess.layers.layernorm",
            "blockhess_lab.cli"} <= set(MODULES)


def test_the_cycle_finder_finds_a_cycle():  # the check below can fail
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    assert _cycle(_graph()) is None


def test_the_core_never_imports_the_adapters():
    graph = _graph()
    for module in sorted(set(MODULES) - NOT_CORE):
        if not module.startswith("blockhess.") or _is_adapter(module) or module.startswith(INTEGRATIONS):
            continue
        seen, todo = set(), [module]
        while todo:  # everything the module imports, directly or through other modules
            for t in graph[todo.pop()] - seen:
                seen.add(t)
                todo.append(t)
        assert not any(_is_adapter(t) for t in seen), f"{module} imports {sorted(t for t in seen if _is_adapter(t))}"
        assert not any(t.startswith(INTEGRATIONS) for t in seen), f"{module} imports an integration"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_of_another_module(module):
    bad = [f"line {line}: from {target} import {name}" for target, name, line in _imports(module)
           if name is not None and _private(name) and target != module]
    aliases = {}  # local name -> package module, for `from . import layernorm`, `import blockhess.x as y`
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ImportFrom) and _base(module, node) in MODULES:
            for a in node.names:
                if f"{_base(module, node)}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{_base(module, node)}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(TREES[module]):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and aliases.get(node.value.id, module) != module):
            bad.append(f"line {node.lineno}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    assert not bad, f"{module} uses private names of other modules: {bad}"


def _is_weight(node: ast.AST) -> bool:
    """``p["W_Q"]`` or ``p["W_Q"].T`` (any dict, any of :data:`WEIGHTS`)."""
    if isinstance(node, ast.Attribute) and node.attr in ("T", "mT"):
        node = node.value
    return (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and node.slice.value in WEIGHTS)


@pytest.mark.parametrize("module", sorted(m for m in MODULES
                                          if m not in FORWARD_HOMES and not m.startswith(FORWARD_PREFIXES)))
def test_no_forward_pass_outside_its_homes(module):
    """Loosely: no softmax or LayerNorm call (but those of :data:`FORWARD_ALLOWED`) and no product
    with a weight of the block (``X @ params["W_Q"]``)."""
    bad = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in ("softmax", "layer_norm") and (module, name) not in FORWARD_ALLOWED:
                bad.append(f"line {node.lineno}: {ast.unparse(f)}(...)")
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult)
              and (_is_weight(node.left) or _is_weight(node.right))
              and (module, ast.unparse(node)) not in FORWARD_ALLOWED):
            bad.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not bad, f"{module} computes (part of) the block's forward pass itself: {bad}"
