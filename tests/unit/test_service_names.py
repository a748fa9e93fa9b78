"""The services under two names (ddiloco/cli/service_names.py): `services.*` in the checkout,
`ddiloco.services.*` in an installed wheel. Their code works under either only if no module names
the package absolutely: services import their own package relatively, tools go through
service_names. tests/integration/test_packaging.py runs the installed side."""

from __future__ import annotations

import ast
import pathlib

from ddiloco.cli import service_names

ROOT = pathlib.Path(__file__).resolve().parents[2]


def absolute_services_imports(tree: pathlib.Path) -> list[str]:
    """Every `import services...` / `from services... import` under tree's ddiloco/ and services/."""
    found = []
    for folder in ("ddiloco", "services"):
        for path in sorted((tree / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                if any(n == "services" or n.startswith("services.") for n in names):
                    found.append(f"{path.relative_to(tree)}:{node.lineno}")
    return found


def test_no_module_imports_services_by_an_absolute_name():
    assert absolute_services_imports(ROOT) == [], (
        "services import their own package relatively (from . import x); tools use "
        "ddiloco.cli.service_names.load('services.x.y')")


def test_the_check_catches_an_absolute_import(tmp_path):
    for folder, text in (("ddiloco", "def f():\n    from services.syncer import core\n"),
                         ("services", "import services.learner.loop\nfrom . import fine\n")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "m.py").write_text(text)
    assert absolute_services_imports(tmp_path) == ["ddiloco/m.py:2", "services/m.py:1"]


def test_the_checkout_launches_and_loads_services_by_their_folder_name():
    # This test runs from the repository: no ddiloco/services folder, so the services are `services`.
    assert not service_names.INSTALLED and service_names.PACKAGE == "services"
    assert service_names.SOURCE_ROOT == str(ROOT)
    assert service_names.module("services.learner.evaluator") == "services.learner.evaluator"
    assert service_names.module("ddiloco.chaos.hostile_learner") == "ddiloco.chaos.hostile_learner"
    from services.syncer import config

    assert service_names.load("services.syncer.config") is config  # one copy of each module


def test_an_installed_wheel_maps_services_under_ddiloco(monkeypatch):
    monkeypatch.setattr(service_names, "PACKAGE", "ddiloco.services")
    assert service_names.module("services.syncer") == "ddiloco.services.syncer"
    assert service_names.module("services.learner.evaluator") == "ddiloco.services.learner.evaluator"
    assert service_names.module("services") == "ddiloco.services"
    assert service_names.module("servicesx.y") == "servicesx.y"  # only the package itself is renamed
