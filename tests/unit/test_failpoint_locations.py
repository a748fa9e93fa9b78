"""ddiloco.failpoints' docstring says where each known point fires: that file (and the function or
class named in backquotes) must fire it, so the list stays true when code moves between modules."""

from __future__ import annotations

import ast
import pathlib
import re

from ddiloco import failpoints as failpoints_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def stated_locations(doc: str, point: str) -> tuple[list[str], str]:
    """The files (repository paths) and the backquoted name in the first parenthetical naming a
    .py file after `point` in `doc`; a bare file name is in the folder of the path before it."""
    match = re.search(r"\(([^()]*\.py[^()]*)\)", doc[doc.index(f"    {point} "):])
    assert match, f"{point}: no location"
    files, folder = [], ""
    for name in re.findall(r"[\w/]+\.py", match.group(1)):
        folder = name.rpartition("/")[0] or folder
        files.append(name if "/" in name else f"{folder}/{name}")
    named = re.search(r"`(\w+)`", match.group(1))
    return files, named.group(1) if named else ""


def fires_in(source: str, point: str, inside: str = "") -> bool:
    """`source` holds the string literal `point` (inside the def or class `inside`, if given)."""
    tree = ast.parse(source)
    scopes = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                     ast.ClassDef)) and node.name == inside]
    return any(isinstance(node, ast.Constant) and node.value == point
               for scope in (scopes if inside else [tree]) for node in ast.walk(scope))


def test_each_known_point_fires_where_the_docstring_says():
    wrong = {}
    for point in failpoints_lib.KNOWN:
        files, inside = stated_locations(failpoints_lib.__doc__, point)
        if not any(fires_in((ROOT / path).read_text(), point, inside) for path in files):
            wrong[point] = (files, inside)
    assert wrong == {}, "correct the location in ddiloco/failpoints.py's docstring"


def test_the_check_sees_a_moved_point():
    # The negative case: the point fires in another function than the one named.
    source = 'def a(fp):\n    fp.hit("x.y")\n\ndef b(fp):\n    pass\n'
    assert fires_in(source, "x.y", "a") and fires_in(source, "x.y")
    assert not fires_in(source, "x.y", "b") and not fires_in(source, "x.z")
    doc = "    x.y   fires\n          (pkg/one.py and two.py `a`)\n"
    assert stated_locations(doc, "x.y") == (["pkg/one.py", "pkg/two.py"], "a")
