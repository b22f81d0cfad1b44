"""The coordinator's parts own their state (docs/architecture.md, "The coordinator"): read
from the source, the rules that keep them so.

- Only the transport edges (the HTTP API and broadcast) and ``main`` import ``Coordinator``;
  the gRPC service speaks to the member API, which the coordinator and the relay offer.
- No import circle among the modules of ``server/`` and ``relay/``, type-only imports
  included.
- No part reaches into the coordinator's private fields.
- One class serves the member RPCs, for root and relay; the relay's core touches no message
  type and no status code.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "relay")
COORDINATOR_EDGES = {"matformer.server.api", "matformer.server.blobs", "matformer.server.http",
                     "matformer.server.main"}


def modules() -> dict[str, ast.Module]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(("matformer", *parts)).removesuffix(".__init__")
            found[name] = ast.parse(path.read_text(), str(path))
    return found


def imported(tree: ast.Module) -> set[str]:
    """Every ``matformer.`` module and name the tree imports (``module.Name`` for a name)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("matformer."):
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("matformer.")}
    return names


def test_only_the_transport_edges_and_main_import_the_coordinator():
    importers = {name for name, tree in modules().items()
                 if "matformer.server.coordinator.Coordinator" in imported(tree)}
    assert importers == COORDINATOR_EDGES


def test_no_import_circle_among_the_server_and_relay_modules():
    trees = modules()
    graph = {name: {m for m in imported(tree) if m in trees and m != name}
             for name, tree in trees.items()}
    circles = []

    def visit(name: str, path: list[str], done: set[str]) -> None:
        for following in graph[name]:
            if following in path:
                circles.append([*path[path.index(following):], following])
            elif following not in done:
                visit(following, [*path, following], done)
        done.add(name)

    done: set[str] = set()
    for name in graph:
        if name not in done:
            visit(name, [name], done)
    assert circles == []


def test_no_part_reads_the_coordinators_private_fields():
    reached = []
    for name, tree in modules().items():
        if name == "matformer.server.coordinator":
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                    and node.value.id in {"c", "coordinator"}):
                reached.append(f"{name}: {node.value.id}.{node.attr}")
    assert reached == []


def test_one_servicer_serves_root_and_relay_and_the_relay_core_holds_records():
    trees = modules()
    servicers = [f"{name}.{node.name}" for name, tree in trees.items()
                 for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                 and any(ast.unparse(base).endswith("CoordinatorServicer") for base in node.bases)]
    assert servicers == ["matformer.server.service.CoordinatorService"]
    assert "matformer.server.service.CoordinatorService" in imported(trees["matformer.relay.main"])
    core = imported(trees["matformer.relay.relay"]) | imported(trees["matformer.relay.rounds"])
    assert not any("coordinator_pb2" in name for name in core)
    plain = {a.name for tree in (trees["matformer.relay.relay"], trees["matformer.relay.rounds"])
             for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert "grpc" not in plain
