"""The import graph points down (docs/architecture.md, "The parts"): a subpackage imports
only those on floors below its own, never one beside or above it, wherever the import sits
(module top or inside a function); the proxy takes only the side channel's value types and
the routers' messengers from the transfer engine, never an endpoint."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvpush"
FLOORS = (  # bottom first
    {"settings"},
    {"logs", "httpclient", "asgi"},
    {"transfer"},
    {"vllm", "proxy"},
    {"launch"},
    {"bench", "ray"},
    {"cli"},
    {"__main__"},
)
PROXY_MAY_USE = {"kvpush.transfer.wire", "kvpush.transfer.router"}


def floor(part: str) -> int:
    return next(i for i, names in enumerate(FLOORS) if part in names)


def imports(path: Path) -> set[str]:
    """Every kvpush module the file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            if base == "kvpush":  # from kvpush import x
                found |= {f"kvpush.{a.name}" for a in node.names}
            elif base.startswith("kvpush."):
                found.add(base)
                folder = PACKAGE / base.removeprefix("kvpush.").replace(".", "/")
                found |= {f"{base}.{a.name}" for a in node.names
                          if (folder / f"{a.name}.py").exists()}  # fmt: skip
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kvpush.")}
    return found


def edges() -> list[tuple[str, str, str]]:
    """(importer's part, imported module, file) for every import between parts."""
    out = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        part = rel.parts[0].removesuffix(".py")
        for module in imports(path):
            target = module.split(".")[1]
            if target != part:
                out.append((part, module, str(rel)))
    return out


def test_every_import_between_parts_points_down():
    found = edges()
    assert any(
        part == "proxy" and module.startswith("kvpush.transfer") for part, module, _ in found
    )
    up = [(f, m) for part, m, f in found if floor(m.split(".")[1]) >= floor(part)]
    assert not up, f"imports that point sideways or up: {up}"


def test_the_proxy_never_imports_an_endpoint():
    used = {m for part, m, _ in edges() if part == "proxy" and m.startswith("kvpush.transfer")}
    assert used, "nothing to check"
    assert used <= PROXY_MAY_USE, used - PROXY_MAY_USE


def test_the_data_plane_ships_no_test_scaffolding():
    transfer = (PACKAGE / "transfer").glob("*.py")
    scaffolding = [
        p.name for p in transfer if "multiprocessing" in p.read_text() or "_sleep" in p.read_text()
    ]
    assert not scaffolding, scaffolding
