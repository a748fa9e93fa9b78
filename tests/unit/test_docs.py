"""The README and docs/*.md as a reader follows them (issue 22): the README stays short, every
relative link resolves (file and heading anchor), every `ddiloco ...` command shown parses with
the flags it shows, every `make` target named exists, and every dependency is explained.

Commands are taken from fenced code blocks and inline code spans. The argparse parsers are built
the way `ddiloco` builds them (`ddiloco.cli.main.main`), in a child process that stops each one at
`parse_args`: nothing runs, and whatever a service does before parsing (malloc and BLAS limits)
stays out of the test process. Run as a script, this module is that child.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

_REPO = pathlib.Path(__file__).resolve().parents[2]
_README_MAX_LINES = 250
_CHILD_TIMEOUT_S = 180

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); link text may hold one level of brackets.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)
_LONG_FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")
_SHELL_OPERATORS = {"|", "||", "&", "&&", ";", ";;", "(", ")", ">", ">>", "<", "<<", ">&", "<&", "&>", "|&"}
_PREFIX_COMMANDS = {"sudo", "env", "exec", "time", "nohup"}
_EVERY_FLAG = "*"  # the child's answer key for the flags of every command
# What prose may write as a code span that starts with `--` without naming a flag of ddiloco's.
_GENERIC_FLAGS = {"--flag"}


def doc_files(root: pathlib.Path = _REPO) -> list[pathlib.Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


# ---------------------------------------------------------------------------------------------
# Markdown structure: prose lines, code, headings


def _split_fences(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(prose lines, fenced code lines), each as (1-based line number, line)."""
    prose: list[tuple[int, str]] = []
    code: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if match and (fence is None or match.group(1) == fence):
            fence = match.group(1) if fence is None else None
            continue
        (prose if fence is None else code).append((number, line))
    return prose, code


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: rendered text, lower case, punctuation dropped (but `-`
    and `_`), spaces as `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    prose, _ = _split_fences(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose:
        found.update(_HTML_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")  # GitHub numbers repeated headings
    return found


# ---------------------------------------------------------------------------------------------
# (2) links


def relative_links(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, target) of every link of `path` that is not a URL or a code span."""
    prose, _ = _split_fences(path.read_text(encoding="utf-8"))
    links = []
    for number, line in prose:
        line = _INLINE_CODE.sub("", line)  # `[x](y)` inside a code span is not a link
        targets = _LINK.findall(line)
        reference = _REFERENCE_DEF.match(line)
        if reference:
            targets.append(reference.group(1))
        links.extend((number, target) for target in targets if not _EXTERNAL.match(target))
    return links


def broken_links(path: pathlib.Path, root: pathlib.Path = _REPO) -> list[str]:
    """Every relative link of `path` whose file (or heading anchor, in a Markdown file) is missing."""
    problems = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        if not file_part:
            resolved = path
        elif file_part.startswith("/"):  # GitHub resolves these from the repository's root
            resolved = root / file_part.lstrip("/")
        else:
            resolved = path.parent / file_part
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not resolved.exists():
            problems.append(f"{where}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where}: no heading with anchor #{anchor} in {resolved.name}")
    return problems


# ---------------------------------------------------------------------------------------------
# (3) commands: `ddiloco ...` and `make ...` shown in code


@dataclasses.dataclass(frozen=True)
class Command:
    where: str
    words: tuple[str, ...]  # `ddiloco` sub-command words, up to the first flag (may include positionals)
    flags: tuple[str, ...]  # every --long-flag of the command line


@dataclasses.dataclass(frozen=True)
class MakeCall:
    where: str
    target: str
    args: str | None  # the ARGS= value, if given


def _code_lines(path: pathlib.Path) -> list[tuple[str, str]]:
    """(file:line, shell text) for every logical line of every fenced block and inline code span."""
    text = path.read_text(encoding="utf-8")
    prose, code = _split_fences(text)
    out: list[tuple[str, str]] = []
    pending = ""
    start = 0
    for number, line in code:
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((f"{path.name}:{start}", pending + line))
        pending = ""
    if pending:
        out.append((f"{path.name}:{start}", pending))
    for number, line in prose:
        for _, span in _INLINE_CODE.findall(line):
            out.append((f"{path.name}:{number}", span))
    return out


def _shell_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line: split at operators, comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: prose in a code span, not a command
        return []
    commands: list[list[str]] = [[]]
    for token in tokens:
        if token in _SHELL_OPERATORS or token == "$":
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def _command_start(tokens: list[str]) -> list[str]:
    """Drops what runs a command rather than being it: `VAR=x`, `sudo`, `env`, `nice -n 19`."""
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", token) or token in _PREFIX_COMMANDS:
            i += 1
        elif token == "nice":
            i += 3 if i + 1 < len(tokens) and tokens[i + 1] == "-n" else 1
        else:
            break
    return tokens[i:]


def _service_names() -> dict[str, str]:
    """`python -m <module>` -> the `ddiloco` sub-command running the same program."""
    from ddiloco.cli import main as cli_main

    names = {}
    for name, module in cli_main._SERVICES.items():
        names[module] = name
        names[module.removesuffix(".__main__")] = name
    return names


def _ddiloco_command(where: str, tokens: list[str]) -> Command | None:
    """The `ddiloco` command a simple shell command runs (`ddiloco`, `.venv/bin/ddiloco`,
    `python -m services.syncer`, ...), or None when it runs something else."""
    tokens = _command_start(tokens)
    if not tokens:
        return None
    head = tokens[0]
    if head == "ddiloco" or head.endswith("/ddiloco"):
        rest = tokens[1:]
    elif re.search(r"(^|/)python[0-9.]*$", head) and len(tokens) > 2 and tokens[1] == "-m":
        module = tokens[2]
        if module in ("ddiloco", "ddiloco.cli.main"):
            rest = tokens[3:]
        elif module in _service_names():
            rest = [_service_names()[module], *tokens[3:]]
        else:
            return None
    else:
        return None
    words = []
    for token in rest:
        if token.startswith("-"):
            break
        words.append(token)
    flags = tuple(t.split("=", 1)[0] for t in rest if t.startswith("--") and t != "--")
    # `--tls-*` in prose names a family of flags, not one: only plain flag names are checked.
    return Command(where, tuple(words), tuple(f for f in flags if _LONG_FLAG.match(f)))


def _make_calls(where: str, tokens: list[str]) -> list[MakeCall]:
    tokens = _command_start(tokens)
    if not tokens or tokens[0] != "make":
        return []
    args = next((t.split("=", 1)[1] for t in tokens[1:] if t.startswith("ARGS=")), None)
    targets = [t for t in tokens[1:] if not t.startswith("-") and "=" not in t]
    return [MakeCall(where, target, args) for target in targets]


def collect(paths: list[pathlib.Path]) -> tuple[list[Command], list[MakeCall]]:
    commands: list[Command] = []
    makes: list[MakeCall] = []
    for path in paths:
        for where, line in _code_lines(path):
            for tokens in _shell_commands(line):
                command = _ddiloco_command(where, tokens)
                if command is not None and command.words:
                    commands.append(command)
                makes.extend(_make_calls(where, tokens))
    return commands, makes


def make_targets(makefile: pathlib.Path) -> dict[str, tuple[str, ...] | None]:
    """Makefile target -> the `ddiloco` words its recipe runs with `$(ARGS)` appended (or None)."""
    targets: dict[str, tuple[str, ...] | None] = {}
    current: list[str] = []
    for line in makefile.read_text(encoding="utf-8").splitlines():
        if line.startswith("\t"):
            match = re.search(r"(?:^|[\s/])ddiloco((?:\s+[a-z][a-z0-9-]*)*)\s+\$\(ARGS\)", line)
            if match:
                for target in current:
                    targets[target] = tuple(match.group(1).split())
            continue
        match = re.match(r"^([A-Za-z0-9_.%/$()-][A-Za-z0-9_.%/$() -]*?)\s*:(?!=)", line)
        current = []
        if match and not match.group(1).startswith("."):
            current = match.group(1).split()
            for target in current:
                targets.setdefault(target, None)
    return targets


def expand_make_calls(makes: list[MakeCall], targets: dict[str, tuple[str, ...] | None]) -> tuple[list[str], list[Command]]:
    """Problems with unknown targets, and the `ddiloco` commands that `make X ARGS=...` runs."""
    problems, commands = [], []
    for call in makes:
        if call.target not in targets:
            problems.append(f"{call.where}: `make {call.target}`: no such target in the Makefile")
        elif targets[call.target] is not None and call.args is not None:
            expanded = _ddiloco_command(call.where, ["ddiloco", *targets[call.target], *shlex.split(call.args)])
            if expanded is not None:
                commands.append(expanded)
    return problems, commands


def _path_key(words: tuple[str, ...]) -> str:
    return json.dumps(list(words))


def command_problems(commands: list[Command], parsers: dict[str, dict]) -> list[str]:
    problems = []
    for command in commands:
        info = parsers[_path_key(command.words)]
        shown = "ddiloco " + " ".join(command.words)
        if info.get("error"):
            problems.append(f"{command.where}: `{shown}`: {info['error']}")
            continue
        if command.flags and info["sub_commands"]:
            problems.append(f"{command.where}: `{shown}`: needs a sub-command of `ddiloco {info['path']}`: "
                            f"{', '.join(info['sub_commands'])}")
            continue
        accepted = set(info["options"])
        for flag in command.flags:
            if flag not in accepted:
                problems.append(f"{command.where}: `{shown}`: {flag} is not a flag of `ddiloco {info['path']}`")
    return problems


def describe_parsers(word_lists: list[tuple[str, ...]]) -> dict[str, dict]:
    """Runs this module as a child process that builds each command's parser (see `_child`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDILOCO_")}  # defaults, not this shell's
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(sorted(set(word_lists))),
                          capture_output=True, text=True, cwd=_REPO, env=env, timeout=_CHILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    marker = "\n@@parsers@@"
    assert marker in proc.stdout, proc.stdout[-3000:]
    return json.loads(proc.stdout.rsplit(marker, 1)[1])


# ---------------------------------------------------------------------------------------------
# The child: argparse parsers as `ddiloco` builds them, stopped before they parse


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _stop_at_parse(self: argparse.ArgumentParser, args=None, namespace=None):
    raise _Built(self)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _built_by_main(argv: list[str]) -> argparse.ArgumentParser:
    from ddiloco.cli import main as cli_main

    try:
        cli_main.main(argv)
    except _Built as built:
        return built.parser
    raise AssertionError(f"ddiloco {' '.join(argv)} returned without parsing its arguments")


@functools.cache
def _top_level() -> argparse._SubParsersAction:
    top = _subparsers(_built_by_main([]))
    assert top is not None
    return top


def _parser_for(words: list[str]) -> argparse.ArgumentParser:
    # main() hands a tool's or a service's arguments to that module's own parser; below it, each
    # word that names a sub-parser selects it (`up`, `chaos run`, `bench quality`).
    parser = _built_by_main(words)
    for word in words:
        sub = _subparsers(parser)
        if sub is not None and word in sub.choices:
            parser = sub.choices[word]
    return parser


def _describe(words: list[str]) -> dict:
    top = _top_level()
    if words[0] not in top.choices:
        return {"error": f"no sub-command {words[0]!r} (there are: {', '.join(sorted(top.choices))})"}
    parser = _parser_for(words)
    sub = _subparsers(parser)
    return {
        "path": parser.prog.removeprefix("ddiloco").strip(),
        "options": sorted({s for action in parser._actions for s in action.option_strings}),
        "sub_commands": sorted(sub.choices) if sub is not None and sub.required else [],
    }


def _every_command() -> list[list[str]]:
    """Every `ddiloco` sub-command, and every sub-command of those (`chaos run`, `certs revoke`)."""
    paths = []
    for name in sorted(_top_level().choices):
        paths.append([name])
        sub = _subparsers(_parser_for([name]))
        if sub is not None:
            paths.extend([name, choice] for choice in sorted(sub.choices))
    return paths


def _child() -> None:
    argparse.ArgumentParser.parse_known_args = _stop_at_parse  # this process only builds parsers
    out = {_path_key(tuple(words)): _describe(words) for words in json.load(sys.stdin)}
    every = sorted({flag for words in _every_command() for flag in _describe(words).get("options", [])})
    out[_EVERY_FLAG] = {"options": every}
    print("\n@@parsers@@" + json.dumps(out))


# ---------------------------------------------------------------------------------------------
# The tests

_NEGATIVE_DOC = """# A page with mistakes

See [the missing page](no-such-page.md), [a missing heading](#nowhere) and [this one](#a-page-with-mistakes).

```bash
ddiloco up --learners 2 --steps 400
ddiloco up --no-such-flag 3
ddiloco frobnicate --x
make no-such-target
make up ARGS="--learners 2 --dashboard-typo"
ddiloco chaos --seed 1
```
"""


@pytest.fixture(scope="module")
def negative_doc(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("docs-root")
    path = root / "page.md"
    path.write_text(_NEGATIVE_DOC, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def documented() -> tuple[list[Command], list[str]]:
    commands, makes = collect(doc_files())
    problems, expanded = expand_make_calls(makes, make_targets(_REPO / "Makefile"))
    return commands + expanded, problems


@pytest.fixture(scope="module")
def parsers(documented, negative_doc) -> dict[str, dict]:
    commands, _ = documented
    neg_commands, neg_makes = collect([negative_doc])
    _, neg_expanded = expand_make_calls(neg_makes, make_targets(_REPO / "Makefile"))
    return describe_parsers([c.words for c in commands + neg_commands + neg_expanded])


def test_readme_is_short() -> None:
    lines = (_REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= _README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/*.md"


def test_readme_starts_with_the_two_commands() -> None:
    _, code = _split_fences((_REPO / "README.md").read_text(encoding="utf-8"))
    first = [line.split("#")[0].strip() for _, line in code[:2]]
    assert first == ["make up", "make test"], first


def test_every_relative_link_resolves() -> None:
    assert sum(len(relative_links(path)) for path in doc_files()) >= 30  # the parsing found the links
    problems = [p for path in doc_files() for p in broken_links(path)]
    assert not problems, "\n".join(problems)


def test_a_broken_link_is_reported(negative_doc) -> None:
    problems = broken_links(negative_doc, root=negative_doc.parent)
    assert len(problems) == 2, problems
    assert problems[0].endswith("no-such-page.md: no such file"), problems
    assert "no heading with anchor #nowhere" in problems[1]


def test_slugs_match_githubs() -> None:
    assert github_slug("Deploy on Kubernetes across regions") == "deploy-on-kubernetes-across-regions"
    assert github_slug("`ddiloco record` and `report`: plots") == "ddiloco-record-and-report-plots"
    assert github_slug("Where to go next") == "where-to-go-next"


def test_the_docs_show_commands() -> None:
    commands, makes = collect(doc_files())
    shown = {c.words[0] for c in commands}
    # If extraction broke, every later check would pass vacuously.
    assert {"up", "status", "syncer", "learner", "chaos"} <= shown, shown
    assert {"up", "test"} <= {m.target for m in makes}


def test_every_make_target_named_exists(documented) -> None:
    _, problems = documented
    assert not problems, "\n".join(problems)


def test_every_ddiloco_command_shown_parses(documented, parsers) -> None:
    commands, _ = documented
    problems = command_problems(commands, parsers)
    assert not problems, "\n".join(problems)


def test_unknown_flags_commands_and_targets_are_reported(negative_doc, parsers) -> None:
    commands, makes = collect([negative_doc])
    make_problems, expanded = expand_make_calls(makes, make_targets(_REPO / "Makefile"))
    problems = command_problems(commands + expanded, parsers) + make_problems
    text = "\n".join(problems)
    assert "--no-such-flag is not a flag of `ddiloco up`" in text
    assert "--dashboard-typo is not a flag of `ddiloco up`" in text
    assert "no sub-command 'frobnicate'" in text
    assert "`make no-such-target`: no such target" in text
    assert "needs a sub-command of `ddiloco chaos`" in text
    assert not [p for p in problems if "--learners" in p or "--steps" in p], text  # the good line passes
    assert len(problems) == 5, text


def prose_flags(path: pathlib.Path) -> list[tuple[str, str]]:
    """(file:line, flag) of every code span in the prose that starts with a flag (`--max-grace-s`)."""
    prose, _ = _split_fences(path.read_text(encoding="utf-8"))
    found = []
    for number, line in prose:
        for _, span in _INLINE_CODE.findall(line):
            flag = span.split()[0].split("=", 1)[0] if span.startswith("--") else ""
            if _LONG_FLAG.match(flag) and flag not in _GENERIC_FLAGS:
                found.append((f"{path.name}:{number}", flag))
    return found


def test_every_flag_named_in_prose_exists(parsers) -> None:
    named = [item for path in doc_files() for item in prose_flags(path)]
    assert len(named) >= 50, named  # the parsing found them
    every = set(parsers[_EVERY_FLAG]["options"])
    unknown = [f"{where}: {flag} is not a flag of any ddiloco command" for where, flag in named if flag not in every]
    assert not unknown, "\n".join(unknown)


def test_an_unknown_flag_in_prose_is_reported(tmp_path, parsers) -> None:
    page = tmp_path / "page.md"
    page.write_text("Set `--max-grace-s 5` and `--max-grace-secs 5`; `--flag` is generic.\n", encoding="utf-8")
    named = prose_flags(page)
    assert [flag for _, flag in named] == ["--max-grace-s", "--max-grace-secs"]
    assert [flag for _, flag in named if flag not in set(parsers[_EVERY_FLAG]["options"])] == ["--max-grace-secs"]


def test_every_dependency_is_explained_in_the_readme() -> None:
    project = tomllib.loads((_REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]

    def name(requirement: str) -> str:
        return re.split(r"[\s<>=!~;\[]", requirement.strip(" `"), maxsplit=1)[0].lower().replace("_", "-")

    requirements = project["dependencies"] + [r for group in project["optional-dependencies"].values() for r in group
                                              if name(r) != project["name"]]  # `ddiloco[plots]`: an extra of its own

    readme = (_REPO / "README.md").read_text(encoding="utf-8")
    listed = {name(cell) for row in re.findall(r"^\|([^|]+)\|", readme, re.MULTILINE)
              for cell in row.replace("(", ",").split(",") if cell.strip()}
    missing = sorted({name(r) for r in requirements} - listed)
    assert not missing, f"pyproject.toml dependencies without a line in README.md's dependency list: {missing}"


if __name__ == "__main__":
    _child()
