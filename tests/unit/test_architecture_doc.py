"""docs/architecture.md's layer drawing names every top-level module and package of `ddiloco` and
every service package, and nothing that does not exist (its import table is checked by
tests/unit/test_layers.py). A module added without a place in the drawing fails here."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
# Module names as the drawing spells them; capitalised names (ddiloco.Learner) are classes.
_NAME = re.compile(r"\b(ddiloco|services)\.([a-z_][a-z0-9_]*)")


def drawing(text: str) -> str:
    """The doc's first fenced block: the layer drawing."""
    match = re.search(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    assert match, "docs/architecture.md has no fenced drawing"
    return match.group(1)


def top_level(root: pathlib.Path) -> set[str]:
    """ddiloco.<x> for every module and package directly in ddiloco/, services.<x> for every service."""
    names = set()
    for package in ("ddiloco", "services"):
        for path in (root / package).iterdir():
            if path.suffix == ".py" and path.name != "__init__.py":
                names.add(f"{package}.{path.stem}")
            elif path.is_dir() and (path / "__init__.py").exists():
                names.add(f"{package}.{path.name}")
    return names


def mismatch(text: str, modules: set[str]) -> tuple[set[str], set[str]]:
    """(modules the drawing of `text` leaves out, names it shows that are not modules)."""
    named = {f"{package}.{name}" for package, name in _NAME.findall(drawing(text))}
    return modules - named, named - modules


def test_the_drawing_names_every_top_level_module():
    modules = top_level(ROOT)
    assert {"ddiloco.algo", "ddiloco._jit", "ddiloco.healthcheck", "services.syncer"} <= modules  # the scan works
    missing, unknown = mismatch(DOC.read_text(encoding="utf-8"), modules)
    assert not missing, f"name these in docs/architecture.md's drawing, in their layer: {sorted(missing)}"
    assert not unknown, f"docs/architecture.md's drawing names modules that do not exist: {sorted(unknown)}"


def test_a_module_left_out_or_a_stale_name_is_caught():
    # The negative case, on a modified copy of the text: one module dropped, one renamed away.
    text = DOC.read_text(encoding="utf-8")
    assert ", ddiloco._jit (numba)" in text and "ddiloco.runtime," in text
    changed = text.replace(", ddiloco._jit (numba)", "", 1).replace("ddiloco.runtime,", "ddiloco.runtime_old,", 1)
    assert mismatch(changed, top_level(ROOT)) == ({"ddiloco._jit", "ddiloco.runtime"}, {"ddiloco.runtime_old"})
    # Outside the drawing a name does not count: the import table below it names ddiloco._jit too.
    assert "`ddiloco._jit`" in text.split("```", 2)[2]
