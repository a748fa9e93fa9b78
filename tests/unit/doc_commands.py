"""The reading half of the docs' command check (tests/unit/test_docs_commands.py): fenced blocks
and the simple commands in them, the findings a checker reports, the checkers of `ddiloco`,
`make`, `pip` and `python` lines, and the child process that builds a script's or a module's
argparse parser without running it (run as a script, this module is that child). The `docker`,
`helm` and `kubectl` checkers are in doc_commands_deploy.py.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import os
import pathlib
import re
import runpy
import subprocess
import sys
import tomllib

from tests.unit import test_docs as docs

_REPO = pathlib.Path(__file__).resolve().parents[2]
_CHILD_TIMEOUT_S = 180
_SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
_UNCHECKED_LANGUAGES = {"python", "yaml", "toml", "json"}  # code or data, not commands
_OPEN_FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
_VARIABLE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Line:
    where: str  # file:line
    tokens: tuple[str, ...]  # one simple command, `VAR=x` prefixes included


@dataclasses.dataclass
class Findings:
    problems: list[str] = dataclasses.field(default_factory=list)
    ddiloco: list[docs.Command] = dataclasses.field(default_factory=list)  # parsed by test_docs' child
    makes: list[docs.MakeCall] = dataclasses.field(default_factory=list)
    programs: list[tuple[str, str, str, tuple[str, ...]]] = dataclasses.field(default_factory=list)  # where, kind, target, flags
    kinds: dict[str, int] = dataclasses.field(default_factory=dict)

    def bad(self, line: Line, message: str) -> None:
        self.problems.append(f"{line.where}: `{' '.join(line.tokens)}`: {message}")


# ---------------------------------------------------------------------------------------------
# Extraction


def fenced_blocks(path: pathlib.Path) -> list[tuple[str, list[tuple[int, str]]]]:
    """(language, [(line number, line)]) of every fenced block, continuation lines joined."""
    blocks: list[tuple[str, list[tuple[int, str]]]] = []
    fence = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = _OPEN_FENCE.match(line)
        if match and fence is None:
            fence, lines, pending = match.group(1), [], None
            blocks.append((match.group(2).lower(), lines))
        elif match and line.strip() == fence:
            fence = None
        elif fence is not None:
            if pending is not None:
                pending = (pending[0], pending[1] + " " + line.strip())
            else:
                pending = (number, line)
            if pending[1].rstrip().endswith("\\"):
                pending = (pending[0], pending[1].rstrip()[:-1])
            else:
                lines.append(pending)
                pending = None
    return blocks

def split_assignments(tokens: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    rest = docs._command_start(list(tokens))
    prefix = tokens[: len(tokens) - len(rest)]
    return {m.group(1): m.group(2) for m in map(_VARIABLE.match, prefix) if m}, rest


def head(tokens: list[str] | tuple[str, ...]) -> str:
    rest = docs._command_start(list(tokens))
    if not rest:
        return ""  # only `VAR=value`: a shell variable for the lines below
    if rest[0].endswith("/"):
        return rest[0]  # a directory, as in a tree drawing: no command
    head = rest[0].rsplit("/", 1)[-1]
    return "python" if re.fullmatch(r"python[0-9.]*", head) else head


def split_options(tokens: list[str], flags: set[str], valued: set[str]) -> tuple[list[tuple[str, str | None]], list[str], list[str]]:
    """Splits `tokens` at the first positional: (options with their values, unknown options, rest)."""
    options, unknown, i = [], [], 0
    while i < len(tokens) and tokens[i].startswith("-"):
        name, eq, value = tokens[i].partition("=")
        if name in valued and not eq:
            options.append((name, tokens[i + 1] if i + 1 < len(tokens) else None))
            i += 2
            continue
        (options.append((name, value if eq else None)) if name in flags | valued else unknown.append(name))
        i += 1
    return options, unknown, tokens[i:]


def options_anywhere(line: Line, out: Findings, tokens: list[str], flags: set[str],
                      valued: set[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """(options with their values, positionals) of a command that takes options anywhere (helm,
    kubectl); an option this check does not know is reported."""
    options, words, i = [], [], 0
    while i < len(tokens):
        name, eq, value = tokens[i].partition("=")
        if name in valued:
            options.append((name, value if eq else tokens[i + 1] if i + 1 < len(tokens) else ""))
            i += 1 if eq else 2
            continue
        if name in flags:
            options.append((name, ""))
        elif tokens[i].startswith("-"):
            out.bad(line, f"{name} is not an option of `{line.tokens[0]}` this check knows")
        else:
            words.append(tokens[i])
        i += 1
    return options, words


# ---------------------------------------------------------------------------------------------
# ddiloco, make, python, pip


def check_ddiloco(line: Line, out: Findings, root: pathlib.Path) -> None:
    command = docs._ddiloco_command(line.where, list(line.tokens))
    if command is None or not command.words:
        out.bad(line, "names no `ddiloco` sub-command")
    else:
        out.ddiloco.append(command)


def check_make(line: Line, out: Findings, root: pathlib.Path) -> None:
    calls = docs._make_calls(line.where, list(line.tokens))
    if not calls:
        out.bad(line, "names no make target")
    out.makes.extend(calls)


@functools.cache
def _pyproject(root: pathlib.Path) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def check_pip(line: Line, out: Findings, root: pathlib.Path, args: list[str] | None = None) -> None:
    args = args if args is not None else docs._command_start(list(line.tokens))[1:]
    if not args or args[0] != "install":
        return out.bad(line, "only `pip install` is checked")
    project = _pyproject(root)
    declared = {_requirement_name(r) for r in project["dependencies"]}
    declared |= {_requirement_name(r) for group in project["optional-dependencies"].values() for r in group}
    options, unknown, targets = split_options(args[1:], {"-U", "--upgrade", "--no-deps", "-q"}, {"-e", "--editable", "-r"})
    for name in unknown:
        out.bad(line, f"pip option {name} is not one this check knows")
    for name, value in options:
        if name == "-r" and not (root / str(value)).is_file():
            out.bad(line, f"no requirements file {value}")
        elif name in ("-e", "--editable"):
            targets.append(str(value))
    for target in targets:
        path, _, extras = target.partition("[")
        if path.startswith(".") or "/" in path:
            if not (root / path / "pyproject.toml").is_file():
                out.bad(line, f"{path} holds no pyproject.toml")
            for extra in filter(None, extras.rstrip("]").split(",")):
                if extra.strip() not in project["optional-dependencies"]:
                    out.bad(line, f"no extra [{extra.strip()}] in pyproject.toml's optional-dependencies")
        elif _requirement_name(target) not in declared:
            out.bad(line, f"{_requirement_name(target)} is not a dependency pyproject.toml declares")


def check_python(line: Line, out: Findings, root: pathlib.Path) -> None:
    tokens = docs._command_start(list(line.tokens))
    args = tokens[1:]
    if args[:1] == ["-c"]:
        try:
            ast.parse(args[1] if len(args) > 1 else "")
        except SyntaxError as error:
            out.bad(line, f"the -c code does not compile: {error}")
        return
    if args[:1] == ["-m"] and len(args) > 1:
        module, rest = args[1], args[2:]
        if docs._ddiloco_command(line.where, tokens) is not None:
            return check_ddiloco(line, out, root)
        if module == "pip":
            return check_pip(line, out, root, rest)
        if module == "pytest":
            for path in (a.split("::")[0] for a in rest if not a.startswith("-")):
                if not (root / path).exists():
                    out.bad(line, f"no test path {path}")
            return
        if not (root / (module.replace(".", "/") + ".py")).is_file() and not (root / module.replace(".", "/")).is_dir():
            return out.bad(line, f"no module {module} in the repository")
        out.programs.append((line.where, "module", module, _flags(rest)))
        return
    if not args or not args[0].endswith(".py"):
        return out.bad(line, "only `python -c`, `python -m MODULE` and `python SCRIPT.py` are checked")
    if not (root / args[0]).is_file():
        return out.bad(line, f"no script {args[0]}")
    out.programs.append((line.where, "script", args[0], _flags(args[1:])))


def _flags(args: list[str]) -> tuple[str, ...]:
    return tuple(a.split("=", 1)[0] for a in args if a.startswith("--") and docs._LONG_FLAG.match(a.split("=", 1)[0]))


def describe_programs(targets: list[tuple[str, str]]) -> dict[str, list[str] | str]:
    """Runs this module as a child that builds each program's argparse parser (see `_child`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDILOCO_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(targets), capture_output=True, text=True,
                          cwd=_REPO, env=env, timeout=_CHILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.rsplit("\n@@programs@@", 1)[1])


def _child() -> None:
    docs.argparse.ArgumentParser.parse_known_args = docs._stop_at_parse  # build the parser, run nothing
    out: dict[str, list[str] | str] = {}
    for kind, target in json.load(sys.stdin):
        sys.argv = [target]
        try:
            runpy.run_path(str(_REPO / target), run_name="__main__") if kind == "script" else \
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            out[f"{kind}:{target}"] = "parses no arguments with argparse"
        except docs._Built as built:
            out[f"{kind}:{target}"] = sorted(s for a in built.parser._actions for s in a.option_strings)
    print("\n@@programs@@" + json.dumps(out))


if __name__ == "__main__":
    _child()
