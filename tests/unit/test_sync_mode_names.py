"""Sync modes have one spelling (issue 22): library and services code compares a sync mode with
ddiloco.algo.rounds' DECOUPLED / DILOCO / DP, never with a string literal. The tools (cli, chaos,
bench, dashboard, sim) read result files and flags and may spell them out."""

from __future__ import annotations

import ast
import pathlib

from ddiloco.algo import rounds as rounds_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOLS = ("ddiloco/cli/", "ddiloco/chaos/", "ddiloco/bench/", "ddiloco/dashboard/", "ddiloco/sim/", "ddiloco/v1/")


def _literal_modes(node: ast.expr) -> list[str]:
    """The sync-mode string literals `node` is or holds (a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and node.value in rounds_lib.SYNC_MODES:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [m for elt in node.elts for m in _literal_modes(elt)]
    return []


def literal_mode_comparisons(source: str) -> list[str]:
    """`x == "dp"`, `mode in ("diloco", "dp")` and the like in `source`, by line."""
    return [f"{node.lineno}: {mode!r}" for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
            for operand in (node.left, *node.comparators) for mode in _literal_modes(operand)]


def test_the_names_are_the_wire_and_cli_spellings():
    assert (rounds_lib.DECOUPLED, rounds_lib.DILOCO, rounds_lib.DP) == rounds_lib.SYNC_MODES
    assert rounds_lib.SYNC_MODES == ("decoupled", "diloco", "dp")  # RunConfig.sync_mode, --sync-mode


def test_library_and_services_compare_sync_modes_by_name():
    found = {}
    for path in sorted([*(ROOT / "ddiloco").rglob("*.py"), *(ROOT / "services").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(TOOLS) and (hits := literal_mode_comparisons(path.read_text())):
            found[rel] = hits
    assert found == {}, "compare with rounds_lib.DECOUPLED / DILOCO / DP"


def test_the_check_sees_each_literal_comparison():
    # The negative case.
    for source in ('m == "dp"\n', 'if "decoupled" != mode: pass\n', 'x = mode in ("diloco", "dp")\n',
                   'ok = mode not in {"", "decoupled"}\n'):
        assert literal_mode_comparisons(source), source
    assert literal_mode_comparisons('m == rounds_lib.DP\nx = {"dp": 1}\nname == "dpx"\n') == []
