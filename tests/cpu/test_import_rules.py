"""The layers' import rules (docs/architecture.md, "Layout and import rules"): router/ and worker/
never import each other, what both speak lives in api/, and api/ and router/ load no torch."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# folder -> the mxserve packages its modules must not import
FORBIDDEN = {
    "api": ("worker", "router", "cluster", "kernels"),
    "router": ("worker", "cluster", "kernels"),
    "worker": ("router", "cluster"),
    "kernels": ("worker", "router", "cluster", "api"),
}


def _imports(folder: str):
    """(file, absolute module name) for every import in the folder's modules."""
    for path in sorted((ROOT / folder).rglob("*.py")):
        package = ["mxserve", *path.relative_to(ROOT).parent.parts]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                yield from ((path, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                yield path, ".".join([*base, node.module or ""]).rstrip(".")


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_layers_import_one_way(folder):
    found = list(_imports(folder))
    assert found  # the scan sees the folder's imports
    bad = [f"{path.relative_to(ROOT)} imports {module}" for path, module in found
           for other in FORBIDDEN[folder]
           if module == f"mxserve.{other}" or module.startswith(f"mxserve.{other}.")]
    assert not bad, "\n".join(bad)


def test_the_contracts_and_the_router_load_no_torch():
    modules = sorted(f"mxserve.{p.parent.name}.{p.stem}" for folder in ("api", "router")
                     for p in (ROOT / folder).glob("*.py") if p.stem != "__init__")
    code = (f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
            "print(sorted(m for m in ('torch', 'triton', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "mxserve.api.stream" in modules and "mxserve.router.ingress" in modules
    assert done.stdout.strip() == "[]"


def test_a_router_replica_loads_no_torch(tiny_checkpoint):
    """What a router replica's process imports and reads (the Serve wiring, then the model's
    config, tokenizer and generation defaults) loads no torch: only worker replicas do."""
    model = str(tiny_checkpoint("llama"))
    code = ("import sys\nimport mxserve.cluster.deployments\n"
            "from mxserve.worker.model.loader import open_checkpoint\n"
            f"for model in ({model!r}, None):  # a Hugging Face directory, the packaged GGUF\n"
            "    checkpoint = open_checkpoint(model)\n"
            "    assert checkpoint.tokenizer.encode('hi') and checkpoint.config.vocab_size\n"
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_no_module_imports_another_modules_private_names():
    """What one module needs from another is public: no `from x import _name` across modules
    of the library (a module's own `_alias` of a public name is fine)."""
    bad = []
    for folder in ("api", "router", "worker", "kernels", "cluster"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (node.level or (
                        node.module or "").startswith("mxserve")):
                    bad += [f"{path.relative_to(ROOT)}: {alias.name}" for alias in node.names
                            if alias.name.startswith("_")]
    assert not bad, "\n".join(bad)


def _module_imports(path: pathlib.Path) -> set[str]:
    """What a module imports: each `import m`, and `from m import n` as both m and m.n (n may
    be a module: `from mxserve.kernels import gemv`)."""
    package = ["mxserve", *path.relative_to(ROOT).parent.parts]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module or ""]).rstrip(".")
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_no_two_modules_import_each_other():
    """Imports run one way between any two modules of the library (a lazy import counts too):
    shared pieces live in a third module both import."""
    imports = {}
    for folder in ("api", "router", "worker", "kernels", "cluster"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            module = "mxserve." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
            imports[module.removesuffix(".__init__")] = _module_imports(path)
    assert "mxserve.kernels.gemv" in imports["mxserve.worker.model.llama"]
    loops = sorted(f"{a} <-> {b}" for a in imports for b in imports
                   if a < b and b in imports[a] and a in imports[b])
    assert not loops, "\n".join(loops)
