"""The package's import layering (issue 17): the protocol core ``pd/`` stands between
``control/`` + ``engine`` below and ``vllm/`` + ``demo`` above, never the other way.

An AST scan of every module (imports inside functions and TYPE_CHECKING blocks count too), so
a lazy import cannot sneak a framework into the core."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "moriio_native"


def imports_of(path: Path, package: Path = PACKAGE) -> set[str]:
    """Absolute module names ``path`` (a module of ``package``) imports, relative imports
    resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level + (path.name == "__init__.py")]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def modules(sub: str) -> list[Path]:
    root = PACKAGE / sub
    return sorted(root.rglob("*.py")) if root.is_dir() else [root.with_suffix(".py")]


def offending(paths: list[Path], forbidden: tuple[str, ...], package: Path = PACKAGE) -> list[str]:
    out = []
    for path in paths:
        for name in sorted(imports_of(path, package)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(package)} imports {name}")
    return out


def test_the_core_imports_no_framework_and_nothing_above_it() -> None:
    paths = modules("pd")
    assert len(paths) >= 5, paths  # the scan sees the core
    forbidden = ("vllm", "torch", "moriio_native.vllm", "moriio_native.demo", "moriio_native.cli")
    assert offending(paths, forbidden) == []


@pytest.mark.parametrize("below", ["control", "engine", "errors", "layout"])
def test_the_layers_below_never_import_the_core(below: str) -> None:
    assert offending(modules(below), ("moriio_native.pd", "moriio_native.vllm")) == []


def test_the_adapters_use_the_core() -> None:
    for adapter in ("vllm/worker.py", "demo.py"):
        names = imports_of(PACKAGE / adapter)
        assert any(n.startswith("moriio_native.pd") for n in names), adapter


def test_the_scan_catches_a_lazy_import(tmp_path: Path) -> None:
    package = tmp_path / "moriio_native"
    (package / "pd").mkdir(parents=True)
    probe = package / "pd" / "_layering_probe.py"
    probe.write_text("def f():\n    import vllm\n    from ..vllm import worker\n")
    found = offending([probe], ("vllm", "moriio_native.vllm"), package)
    assert found == [
        "pd/_layering_probe.py imports moriio_native.vllm",
        "pd/_layering_probe.py imports moriio_native.vllm.worker",
        "pd/_layering_probe.py imports vllm",
    ]
