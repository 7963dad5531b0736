"""The import arrows between our packages, checked on the source with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rtc_server", "signaling", "musetalk_core", "benchmarks")


def _imports(package: str) -> dict[str, set[str]]:
    """Module path -> the full names of our packages' modules it imports."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = {n for n in names if n.split(".")[0] in PACKAGES}
    return found


def _violations(package: str, allowed: tuple[str, ...]) -> list[str]:
    bad = []
    for module, names in _imports(package).items():
        for name in names:
            top = name.split(".")[0]
            if top != package and not any(name == a or name.startswith(a + ".") for a in allowed):
                bad.append(f"{module} imports {name}")
    return bad


def test_musetalk_core_imports_none_of_the_others() -> None:
    assert _violations("musetalk_core", ()) == []


def test_signaling_imports_only_musetalk_core_types() -> None:
    assert _violations("signaling", ("musetalk_core.types",)) == []


def test_rtc_server_never_imports_benchmarks() -> None:
    # The bench subcommand loads benchmarks lazily, inside a function.
    bad = _violations("rtc_server", ("signaling", "musetalk_core"))
    lazy = {"rtc_server/cli.py imports benchmarks.cli"}
    assert set(bad) <= lazy
    tree = ast.parse((ROOT / "rtc_server/cli.py").read_text())
    top_level = {
        n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module is not None
    }
    assert "benchmarks.cli" not in top_level
