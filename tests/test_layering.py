"""The package's structure, read from its source: the import layering of DESIGN.md, no private
names imported across modules, no module-level mutable state where it was banned, and every
runtime import a declared dependency."""

import ast
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fmoe"

# DESIGN.md: ops <- layers <- model <- parallel/optim/train <- examples. Among the three
# siblings, parallel may use optim (DistributedMuon builds on Muon, the gradient norm lives in
# optim); optim and train use neither of the others.
ALLOWED = {
    "fmoe.ops": {"fmoe.ops"},
    "fmoe.layers": {"fmoe.ops"},
    "fmoe.model": {"fmoe.ops", "fmoe.layers"},
    "fmoe.optim": {"fmoe.ops", "fmoe.optim"},
    "fmoe.parallel": {"fmoe.ops", "fmoe.layers", "fmoe.model", "fmoe.optim", "fmoe.parallel"},
    "fmoe.train": {"fmoe", "fmoe.ops", "fmoe.layers", "fmoe.model", "fmoe.train"},
    "fmoe.hf": {"fmoe.ops", "fmoe.layers", "fmoe.model"},  # released checkpoints: beside train, above the model
}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        yield name, path, ast.parse(path.read_text(), filename=str(path))


def _imports(tree):
    """(module, names) of every import, top-level or inside functions (lazy imports count)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [alias.name for alias in node.names]


def _layer(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def test_imports_follow_the_layering():
    bad = []
    for name, path, tree in _modules():
        if name == "fmoe":
            continue
        allowed = ALLOWED[_layer(name)]
        for module, _ in _imports(tree):
            if module.split(".")[0] == "fmoe" and _layer(module) not in allowed:
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, bad


def test_no_private_name_is_imported_from_another_module():
    bad = []
    for name, path, tree in _modules():
        for module, names in _imports(tree):
            if module.split(".")[0] != "fmoe":
                continue
            if any(part.startswith("_") for part in module.split(".")):
                bad.append(f"{path.relative_to(ROOT)} imports the private module {module}")
            bad += [f"{path.relative_to(ROOT)} imports {module}.{n}" for n in names if n.startswith("_")]
    assert not bad, bad


def test_no_exit_hooks_or_module_level_pending_state():
    """Pending work (async checkpoint saves) is a handle its caller keeps, not module state."""
    for name, path, tree in _modules():
        text = path.read_text()
        assert "atexit" not in text, path
        for node in tree.body:  # module-level empty containers: state waiting to be filled
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            empty_literal = isinstance(value, (ast.Dict, ast.List, ast.Set)) and not getattr(value, "keys", getattr(value, "elts", None))
            empty_call = isinstance(value, ast.Call) and ast.unparse(value.func) in ("dict", "list", "set") and not (value.args or value.keywords)
            if empty_literal or empty_call:
                targets = [ast.unparse(t) for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
                pytest.fail(f"{path.relative_to(ROOT)}: module-level mutable {targets} (state belongs to its caller)")


def _declared() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)\]", text, re.S | re.M).group(1)
    return {m.lower() for m in re.findall(r'^\s*"([A-Za-z0-9_.-]+)', deps, re.M)}


def _optional() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return {m.lower() for m in re.findall(r'"([A-Za-z0-9_.-]+)', section)}


# import names that differ from the name of the package that provides them
DISTRIBUTION = {"pynvml": "nvidia-ml-py"}


def test_every_runtime_import_is_a_declared_dependency():
    """Top-level imports of third-party packages are dependencies; an import inside a
    function (a feature that needs an extra) is an optional dependency."""
    stdlib = set(sys.stdlib_module_names)
    declared, optional = _declared(), _optional()
    missing = []
    for name, path, tree in _modules():
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or (isinstance(node, ast.ImportFrom) and node.level):
                continue
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for module in modules:
                root = module.split(".")[0]
                if root in stdlib or root in ("fmoe", "__future__"):
                    continue
                needed = declared if id(node) in top_level else declared | optional
                if DISTRIBUTION.get(root, root).lower() not in needed:
                    missing.append(f"{path.relative_to(ROOT)}: {module}")
    assert not missing, f"imports that pyproject.toml does not declare: {missing}"
