"""The import contract: three layers, each importing only downward (issue 22).

    tools     ddiloco.cli, ddiloco.chaos, ddiloco.bench, ddiloco.dashboard, ddiloco.sim
      |
    services  services.syncer, services.learner, services.checkpoint
      |
    library   every other module of ddiloco (algo, wire, rpc, models, data, v1, flags, failpoints, ...)

A module lands in a layer by its name alone, so a new library module is covered without editing
this file. The graph comes from grimp (the engine of import-linter), which reads every import
statement of every module, those inside functions and under `if TYPE_CHECKING` included.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOLS = ("ddiloco.cli", "ddiloco.chaos", "ddiloco.bench", "ddiloco.dashboard", "ddiloco.sim")
RANK = {"library": 0, "services": 1, "tools": 2}

# Prints every forbidden import of the tree in the working directory, one per line; exit 0 always.
CHECK = textwrap.dedent(f"""
    import grimp
    TOOLS = {TOOLS!r}
    RANK = {RANK!r}

    def layer(module):
        if module == "services" or module.startswith("services."):
            return "services"
        if any(module == t or module.startswith(t + ".") for t in TOOLS):
            return "tools"
        return "library"

    graph = grimp.build_graph("ddiloco", "services", cache_dir=None)
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if RANK[layer(imported)] > RANK[layer(importer)]:
                for detail in graph.get_import_details(importer=importer, imported=imported):
                    print(f"{{layer(importer)}} -> {{layer(imported)}}: {{importer}} imports {{imported}} "
                          f"(line {{detail['line_number']}}: {{detail['line_contents']}})")
""")


def forbidden_imports(tree: pathlib.Path) -> list[str]:
    """Every upward import in the `ddiloco` and `services` packages under `tree`."""
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=tree, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if line]


def test_every_import_points_down_a_layer():
    assert forbidden_imports(ROOT) == []


def test_every_service_directory_is_a_package_the_graph_sees():
    # A service folder without __init__.py is a namespace package: grimp (and setuptools'
    # find_packages) skip it, and its imports would escape the contract.
    for service in ("syncer", "learner", "checkpoint"):
        assert (ROOT / "services" / service / "__init__.py").is_file(), service


def test_the_contract_catches_an_upward_import_inside_a_function(tmp_path):
    # The negative case: a copy of the tree in which a library module imports a service lazily,
    # inside a function, and a service imports a tool at the top: both are reported.
    for package in ("ddiloco", "services"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    grace = tmp_path / "ddiloco" / "algo" / "grace.py"
    grace.write_text(grace.read_text() + "\n\ndef _sneaky():\n    from services.syncer import core\n    return core\n")
    loop = tmp_path / "services" / "learner" / "loop.py"
    loop.write_text("from ddiloco.chaos import schedule  # noqa\n" + loop.read_text())
    found = forbidden_imports(tmp_path)
    assert any(line.startswith("library -> services: ddiloco.algo.grace imports services.syncer.core") for line in found)
    assert any(line.startswith("services -> tools: services.learner.loop imports ddiloco.chaos.schedule")
               for line in found)
    assert len(found) == 2, found


# docs/architecture.md holds the package-level import table between these markers; the test below
# regenerates it from the graph, so the drawing of the house stays true.
TABLE_BEGIN, TABLE_END = "<!-- imports:begin -->", "<!-- imports:end -->"
PACKAGE_GRAPH = textwrap.dedent("""
    import collections, grimp
    def package(module):
        parts = module.split(".")
        return ".".join(parts[:2])
    graph = grimp.build_graph("ddiloco", "services", cache_dir=None)
    edges = collections.defaultdict(set)
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            if package(importer) != package(imported) and package(imported) != "ddiloco":
                edges[package(importer)].add(package(imported))
    print("| package | imports |")
    print("|---|---|")
    for importer in sorted(edges):
        print(f"| `{importer}` | " + ", ".join(f"`{i}`" for i in sorted(edges[importer])) + " |")
""")


def test_the_architecture_doc_shows_the_imports_as_they_are():
    out = subprocess.run([sys.executable, "-c", PACKAGE_GRAPH], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    doc = (ROOT / "docs" / "architecture.md").read_text()
    shown = doc.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip()
    assert shown == out.stdout.strip(), f"docs/architecture.md is stale; the table now reads:\n{out.stdout}"
