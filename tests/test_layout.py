"""The house rules of hf_zero/, read from the source with `ast` (every import counts: module level, inside
functions, under TYPE_CHECKING):

- no import circle anywhere in the package;
- the engine (hf_zero/engine/) and hf_zero/config.py import no Accelerate, Transformers or datasets;
- hf_zero/engine/ and hf_zero/checkpoint/ import nothing from hf_zero/integrations/ or hf_zero/tools/;
- no module imports another module's private (`_name`) names.

The walker is checked on small made-up packages too, so a rule that could never fire would be caught.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_zero"
HF_LIBRARIES = ("accelerate", "transformers", "datasets")


# ----------------------------------------------------------------------------------------------------- the walker
def module_names(package_dir: Path) -> Dict[str, Path]:
    """{dotted module name: file} for every .py file under `package_dir` (packages by their __init__)."""
    base = package_dir.parent
    out = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: Dict[str, Path]) -> List[Tuple[str, str, int]]:
    """Every (imported module, imported name or "", line) in the file, wherever the import statement stands."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, "", node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, is_package, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                # `from pkg import submodule` imports the submodule; `from mod import thing` the module
                out.append((sub, "", node.lineno) if sub in modules else (target, alias.name, node.lineno))
    return out


def import_graph(package_dir: Path) -> Tuple[Dict[str, Set[str]], Dict[str, List[Tuple[str, str, int]]]]:
    """(edges between the package's own modules, every import of every module)."""
    modules = module_names(package_dir)
    edges: Dict[str, Set[str]] = {m: set() for m in modules}
    raw = {}
    for name, path in modules.items():
        raw[name] = imports_of(name, path, modules)
        for target, _, _ in raw[name]:
            while target and target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]  # `import a.b.c` of a non-module name: its module
            if target in modules and target != name:
                edges[name].add(target)
    return edges, raw


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _in(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(package_dir: Path) -> List[str]:
    """Every broken house rule, as one line each."""
    edges, raw = import_graph(package_dir)
    top = package_dir.name
    problems = [f"import circle: {' <-> '.join(c)}" for c in cycles(edges)]
    for name, imports in sorted(raw.items()):
        engine_floor = _in(name, f"{top}.engine") or name == f"{top}.config"
        low_floor = _in(name, f"{top}.engine") or _in(name, f"{top}.checkpoint")
        for target, imported, line in imports:
            if engine_floor and target.split(".")[0] in HF_LIBRARIES:
                problems.append(f"{name}:{line} imports {target} (the engine speaks torch only)")
            if low_floor and (_in(target, f"{top}.integrations") or _in(target, f"{top}.tools")):
                problems.append(f"{name}:{line} imports {target} (integrations and tools sit above it)")
            if _in(target, top) and imported.startswith("_") and not imported.startswith("__"):
                problems.append(f"{name}:{line} imports the private name {imported} of {target}")
    return problems


# ----------------------------------------------------------------------------------------------------- the rules
def test_hf_zero_keeps_the_house_rules():
    problems = violations(PACKAGE)
    assert not problems, "\n".join(problems)


def test_the_walker_sees_every_file_and_function_level_imports():
    modules = module_names(PACKAGE)
    assert "hf_zero.engine.engine" in modules and "hf_zero.checkpoint" in modules and "hf_zero" in modules
    edges, _ = import_graph(PACKAGE)
    # hf_zero/__init__ imports the integrations inside __getattr__ only: a function-level import must count
    assert "hf_zero.integrations.accelerate" in edges["hf_zero"]
    assert "hf_zero.engine.optimizer" in edges["hf_zero.engine.engine"]
    assert "hf_zero.engine" in edges["hf_zero.checkpoint.sharded"]  # under TYPE_CHECKING


def _write(root: Path, files: Dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize("files, expected", [
    ({"pkg/__init__.py": "", "pkg/a.py": "def f():\n    from .b import g\n", "pkg/b.py": "from .a import f\n"},
     "import circle: pkg.a <-> pkg.b"),
    ({"pkg/__init__.py": "", "pkg/engine/__init__.py": "", "pkg/engine/x.py": "import transformers\n"},
     "pkg.engine.x:1 imports transformers"),
    ({"pkg/__init__.py": "", "pkg/config.py": "def f():\n    from accelerate import Accelerator\n"},
     "pkg.config:2 imports accelerate"),
    ({"pkg/__init__.py": "", "pkg/tools/__init__.py": "", "pkg/checkpoint/__init__.py": "",
      "pkg/checkpoint/s.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..tools import bench\n"},
     "pkg.checkpoint.s:3 imports pkg.tools"),
    ({"pkg/__init__.py": "", "pkg/a.py": "_x = 1\n", "pkg/b.py": "from .a import _x\n"},
     "pkg.b:1 imports the private name _x of pkg.a"),
])
def test_the_rules_fire_on_a_package_that_breaks_them(tmp_path, files, expected):
    problems = violations(_write(tmp_path, files))
    assert any(p.startswith(expected) for p in problems), problems


def test_a_clean_made_up_package_passes(tmp_path):
    pkg = _write(tmp_path, {"pkg/__init__.py": "from .engine import run\n", "pkg/engine/__init__.py":
                            "from .core import run\n", "pkg/engine/core.py": "import torch\n\ndef run():\n    pass\n",
                            "pkg/tools/__init__.py": "from ..engine import run\n"})
    assert violations(pkg) == []
