"""The import contract of the installed package (read from the source, nothing imported).

Invariants:
- the product (`sglang_swift`, `radix_ext`, `swift_kernels`) never imports the measuring apparatus
  (`benchmarks`) or the tests;
- the product's packages form layers: each imports only packages below it, so there is no import
  circle between them;
- `radix_ext` imports neither torch nor SGLang at module level (it is bookkeeping);
- the wheel's package list is exactly the product.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("sglang_swift", "radix_ext", "swift_kernels")
APPARATUS = ("benchmarks", "tests")

# Top to bottom: a package may import those listed after it, never one before it.
LAYERS = (
    "sglang_swift.integration",  # the SGLang glue: plugin, cache backend, runtime
    "sglang_swift.layer_stream",  # the layer stream cache
    "sglang_swift.dataplane",  # shared pools, leases held, copies
    "sglang_swift.ctl",  # the operator's status tool
    "sglang_swift.config",  # the one frozen SwiftConfig
    "sglang_swift.control",  # agents, leases, liveness over ZMQ
    "radix_ext",  # the extended radix tree (bookkeeping)
    "swift_kernels",  # copy kernels and their references
    "sglang_swift.cpu_compat",  # the CPU engine's stand-ins
    "sglang_swift.common",  # process and resource helpers
)


def unit_of(module: str) -> str:
    """The layer a module belongs to: `sglang_swift.<sub>` or the top-level package."""
    parts = module.split(".")
    if parts[0] == "sglang_swift" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def module_name(path: Path, root: Path = ROOT) -> tuple[str, bool]:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join(parts), is_pkg


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import in the file."""
    name, is_pkg = module_name(path, root)
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(n) for n in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` and try/except blocks still run at import
        if isinstance(node, (ast.If, ast.Try)):
            top_level |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno, id(node) in top_level))
    return found


def product_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for pkg in PRODUCT for p in (root / pkg).rglob("*.py"))


def apparatus_imports(root: Path = ROOT) -> list[str]:
    return [f"{p.relative_to(root)}:{line} imports {target}"
            for p in product_files(root) for target, line, _ in imports_of(p, root)
            if target.split(".")[0] in APPARATUS]


def upward_imports(root: Path = ROOT) -> list[str]:
    rank = {unit: i for i, unit in enumerate(LAYERS)}
    bad = []
    for p in product_files(root):
        src = unit_of(module_name(p, root)[0])
        for target, line, _ in imports_of(p, root):
            dst = unit_of(target)
            if target.split(".")[0] not in PRODUCT or dst == src or dst == "sglang_swift":
                continue
            if src in rank and dst in rank and rank[dst] < rank[src]:
                bad.append(f"{p.relative_to(root)}:{line}: {src} imports {dst}, a layer above it")
    return bad


def test_product_never_imports_the_apparatus():
    bad = apparatus_imports()
    assert not bad, "the product imports benchmarks/tests:\n" + "\n".join(bad)


def test_every_product_module_has_a_layer():
    units = {unit_of(module_name(p)[0]) for p in product_files()} - {"sglang_swift"}
    missing = units - set(LAYERS)
    assert not missing, f"add these to LAYERS (top to bottom): {sorted(missing)}"


def test_product_packages_import_only_downwards():
    bad = upward_imports()
    assert not bad, "import against the layers (a circle in the making):\n" + "\n".join(bad)


@pytest.mark.parametrize("forbidden", ["torch", "sglang", "triton"])
def test_radix_ext_is_bookkeeping(forbidden):
    bad = [f"{p.relative_to(ROOT)}:{line}"
           for p in sorted((ROOT / "radix_ext").rglob("*.py"))
           for target, line, top in imports_of(p) if top and target.split(".")[0] == forbidden]
    assert not bad, f"radix_ext imports {forbidden} at module level: {bad}"


def test_the_wheel_is_the_product():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = conf["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(include) == sorted(f"{pkg}*" for pkg in PRODUCT)


def test_the_contract_sees_a_violation(tmp_path):
    """The checker itself: a product module importing upwards and the apparatus is caught."""
    for pkg in ("sglang_swift/control", "sglang_swift/integration", "radix_ext", "swift_kernels"):
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "sglang_swift" / "__init__.py").write_text("")
    (tmp_path / "sglang_swift" / "control" / "probe.py").write_text(
        "from ..integration import plugin\nimport benchmarks.simulator\n")
    assert upward_imports(tmp_path) == [
        "sglang_swift/control/probe.py:1: sglang_swift.control imports sglang_swift.integration,"
        " a layer above it"]
    assert apparatus_imports(tmp_path) == [
        "sglang_swift/control/probe.py:2 imports benchmarks.simulator"]
