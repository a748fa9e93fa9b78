"""Every command line of the fenced shell blocks of README.md and docs/*.md is checked against the
repository's real artifacts (issue 22: "every command in the README and docs/ is exercised by a
test or by CI"). Each simple command goes to the checker of its kind; a kind without a checker
fails the test, so a new kind of command cannot slip in unchecked.

- `ddiloco ...`, `python -m services.*` and `make ...`: parsed against the real argparse parsers
  and the Makefile by tests/unit/test_docs.py's machinery (shared, not copied).
- `docker compose ...`: the -f files exist; the sub-command and its options are Compose's; every
  service, `--scale` service and `--profile` named is defined in those files; `run SERVICE ARGS`
  through a `ddiloco` entrypoint parses as that `ddiloco` command; a `VAR=` prefix is a variable
  the files read. `docker build`: the context, the Dockerfile and every `--build-arg` ARG exist.
  `docker run` of the project's image: its arguments parse as the `ddiloco` command the image's
  ENTRYPOINT runs. `docker exec/kill/...`: the container is one the compose files name
  (container_name or <project>-<service>-<N>); `docker network`: <project>_<network>.
- `helm`: the chart directory, the -f values files, every key of those files and every `--set`
  key exist in the chart's values.schema.json (which admits exactly the chart's keys); the release
  is the one scripts/render_k8s.py renders. `kubectl`: -k overlays and -f files exist, `kind/name`
  resources are in the rendered manifests (k8s/kustomize/), port-forward ports are the Service's,
  namespaces are the manifests', and `create secret --from-file=KEY=` keys are read by the chart.
  The chart and the manifests themselves are rendered and validated by tests/k8s and
  `scripts/render_k8s.py --check`; the compose stack is run by tests/docker.
- `pip install`: `.[extras]` name extras of pyproject.toml, paths exist, anything else is a
  dependency pyproject.toml declares.
- `python`: `-c` code compiles; `-m pytest` paths exist; a script or `-m` module exists and the
  flags shown parse against its own argparse parser (built in a child process, never run).

No other kind appears in the docs' shell blocks today (no curl, grpcurl or promtool): one that
appears fails as "no checker" until a checker is written for it. Commands in inline code spans
are checked by test_docs.py for `ddiloco` and `make`; the others are mostly fragments in prose
(`docker kill`, `helm test`) and are not checked here.

Fenced blocks without a shell language (diagrams, output: `text` or none) must not hold a line
that starts like a command: a command in an untagged block would escape every check.
"""

from __future__ import annotations

import os
import pathlib
import textwrap

import pytest
import yaml

from tests.unit import test_docs as docs
from tests.unit.doc_commands import (_REPO, _SHELL_LANGUAGES, _UNCHECKED_LANGUAGES, Findings, Line, check_ddiloco,
                                     check_make, check_pip, check_python, describe_programs, fenced_blocks, head,
                                     split_assignments)
from tests.unit.doc_commands_deploy import _CHART, chart_schema, check_docker, check_helm, check_kubectl, schema_problems


def shell_lines(paths: list[pathlib.Path]) -> tuple[list[Line], list[str]]:
    """Every simple command of every shell block, and the problems of the other blocks: a line of
    a block without a shell language that starts like a command."""
    lines, problems = [], []
    for path in paths:
        for language, block in fenced_blocks(path):
            for number, text in block:
                where = f"{path.name}:{number}"
                commands = docs._shell_commands(text)
                if language in _SHELL_LANGUAGES:
                    lines.extend(Line(where, tuple(tokens)) for tokens in commands)
                elif language not in _UNCHECKED_LANGUAGES and commands and head(commands[0]) in _CHECKERS.keys() - {""}:
                    problems.append(f"{where}: `{text.strip()}` is a command in a ```{language} block: "
                                    "tag the block bash (or sh) so that it is checked")
    return lines, problems


# ---------------------------------------------------------------------------------------------
# Dispatch, and the parsers of the programs shown


def check_variables_only(line: Line, out: Findings, root: pathlib.Path) -> None:
    """`TLS="--tls-ca ca.pem"`: a shell variable the lines below expand; nothing runs."""


_CHECKERS = {"ddiloco": check_ddiloco, "make": check_make, "docker": check_docker, "helm": check_helm,
             "kubectl": check_kubectl, "pip": check_pip, "python": check_python, "": check_variables_only}


def check_lines(lines: list[Line], root: pathlib.Path = _REPO) -> Findings:
    out = Findings()
    for line in lines:
        kind = head(line.tokens)
        out.kinds[kind] = out.kinds.get(kind, 0) + 1
        checker = _CHECKERS.get(kind)
        if checker is None:
            out.bad(line, f"no checker for `{kind}` commands: add one to {pathlib.Path(__file__).name}")
        else:
            checker(line, out, root)
        variables, _ = split_assignments(line.tokens)
        for path in filter(None, variables.get("PYTHONPATH", "").split(os.pathsep)):
            if not (root / path).is_dir():
                out.bad(line, f"PYTHONPATH names no directory {path}")
    return out


def finish(out: Findings, root: pathlib.Path = _REPO) -> list[str]:
    """The problems of `out`, with its `ddiloco` commands, make calls and programs parsed."""
    problems = list(out.problems)
    make_problems, expanded = docs.expand_make_calls(out.makes, docs.make_targets(root / "Makefile"))
    commands = out.ddiloco + expanded
    problems += make_problems + docs.command_problems(commands, docs.describe_parsers([c.words for c in commands]))
    options = describe_programs(sorted({(kind, target) for _, kind, target, _ in out.programs}))
    for where, kind, target, flags in out.programs:
        known = options[f"{kind}:{target}"]
        if isinstance(known, str):
            problems.append(f"{where}: {target}: {known}")
        else:
            problems += [f"{where}: {flag} is not a flag of {target}" for flag in flags if flag not in known]
    return problems


# ---------------------------------------------------------------------------------------------
# The tests

_NEGATIVE_DOC = """# Mistakes

```bash
frobnicate --x
docker compose -f docker-compose.yml -f no-such.yml up -d
docker compose --profile no-such-profile up -d
docker compose up -d --scale learner-region-z=3
docker compose frob
docker compose kill syncer no-such-service
docker compose -f docker-compose.yml -f docker-compose.tls.yml run --rm certs-revoke --no-such-flag x
NO_SUCH_VARIABLE=1 docker compose build
docker build --build-arg NO_SUCH_ARG=1 -t ddiloco:x .
docker run other/image:1 learner
docker exec ddiloco-nowhere-1 true
docker network disconnect ddiloco_region-z ddiloco-learner-region-b-1
helm upgrade --install ddiloco k8s/chart/nowhere -f k8s/values-hub.yaml
helm upgrade --install ddiloco k8s/chart/ddiloco --set syncer.noSuchKey=1 -f k8s/no-such-values.yaml
kubectl apply -k k8s/kustomize/overlays/no-such-region
kubectl -n ddiloco port-forward svc/ddiloco-syncer 50051:50099
kubectl -n ddiloco rollout status deploy/ddiloco-nothing
pip install '.[no-such-extra]'
pip install left-pad
python scripts/no_such_script.py
python scripts/bench_devices.py --no-such-flag 3
python -m pytest tests/unit/no_such_test.py
```

```
docker compose up -d
```

```bash
docker compose up -d --scale learner-region-a=3
helm upgrade --install ddiloco k8s/chart/ddiloco -n ddiloco -f k8s/values-region-a.yaml --set syncer.replicas=2
kubectl --context hub -n ddiloco port-forward svc/ddiloco-syncer 50051:50051 &
pip install '.[plots,numba]'
python scripts/bench_devices.py --repeat 3
docker compose run --rm --no-deps syncer status --target syncer:50051
docker network disconnect ddiloco_region-b ddiloco-learner-region-b-2
docker kill ddiloco-syncer-1
kubectl -n ddiloco get svc/ddiloco-syncer
```
"""

_EXPECTED_NEGATIVE = [
    "no checker for `frobnicate` commands", "no compose file no-such.yml", "has profile 'no-such-profile'",
    "no service 'learner-region-z'", "frob is not a docker compose sub-command", "no service 'no-such-service'",
    "--no-such-flag is not a flag of `ddiloco certs revoke`", "never read NO_SUCH_VARIABLE",
    "declares no ARG NO_SUCH_ARG", "other/image:1 is not an image this repository builds",
    "no compose file defines a container 'ddiloco-nowhere-1'", "no compose file defines a network 'ddiloco_region-z'",
    "k8s/chart/nowhere is not a chart directory",
    "the chart has no value syncer.noSuchKey", "no values file k8s/no-such-values.yaml",
    "k8s/kustomize/overlays/no-such-region is not a kustomization", "svc/ddiloco-syncer has no port 50099",
    "no deploy/ddiloco-nothing in the rendered manifests", "no extra [no-such-extra]",
    "left-pad is not a dependency", "no script scripts/no_such_script.py",
    "--no-such-flag is not a flag of scripts/bench_devices.py", "no test path tests/unit/no_such_test.py",
    "is a command in a ``` block",
]


@pytest.fixture(scope="module")
def documented() -> tuple[Findings, list[str]]:
    lines, problems = shell_lines(docs.doc_files())
    out = check_lines(lines)
    return out, problems + finish(out)


def test_every_documented_command_has_a_checker_and_passes_it(documented) -> None:
    out, problems = documented
    assert not problems, "\n".join(problems)
    # If extraction broke, the check above would pass vacuously: each kind the docs use is seen.
    assert {"ddiloco", "make", "docker", "helm", "kubectl", "pip", "python"} <= set(out.kinds), out.kinds
    assert sum(out.kinds.values()) >= 90, out.kinds
    assert len(out.ddiloco) >= 55 and len(out.programs) >= 2, (len(out.ddiloco), out.programs)


def test_docker_commands_reach_the_ddiloco_parser(documented) -> None:
    out, _ = documented
    words = {c.words for c in out.ddiloco}
    assert ("certs", "revoke") in words  # security.md: `docker compose ... run --rm certs-revoke --identity ...`
    assert ("status",) in words and ("learner",) in words


def test_every_mistake_is_reported(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text(_NEGATIVE_DOC, encoding="utf-8")
    lines, problems = shell_lines([page])
    out = check_lines(lines)
    problems += finish(out)
    text = "\n".join(problems)
    missing = [expected for expected in _EXPECTED_NEGATIVE if expected not in text]
    assert not missing, f"not reported: {missing}\n{text}"
    assert len(problems) == len(_EXPECTED_NEGATIVE), text  # the good lines of the last block pass
    assert not [p for p in problems if "page.md:4" in p and "frobnicate" not in p], text


def test_blocks_and_continuations_are_read_as_the_shell_reads_them(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```sh\nA=1 docker compose \\\n  up -d  # comment\n```\n\n```python\nimport os\n```\n",
                    encoding="utf-8")
    (shell, (number, text)), python = (fenced_blocks(page)[0][0], *fenced_blocks(page)[0][1]), fenced_blocks(page)[1]
    assert (shell, number, text.split(), python) == ("sh", 2, "A=1 docker compose up -d # comment".split(),
                                                     ("python", [(7, "import os")]))
    lines, problems = shell_lines([page])
    assert lines == [Line("page.md:2", ("A=1", "docker", "compose", "up", "-d"))] and not problems


def chart_value_snippets(paths: list[pathlib.Path]) -> list[tuple[str, dict]]:
    """(file:line, values) of every ```yaml block whose top-level keys are all chart values: the
    values snippets a reader copies into a values file (docs/deploy.md, gpu.md, failover.md)."""
    top = set(chart_schema(_REPO / _CHART)["properties"])
    found = []
    for path in paths:
        for language, block in fenced_blocks(path):
            values = yaml.safe_load(textwrap.dedent("\n".join(text for _, text in block))) if language == "yaml" else None
            if block and isinstance(values, dict) and set(values) <= top:
                found.append((f"{path.name}:{block[0][0]}", values))
    return found


def test_every_chart_values_snippet_names_values_the_chart_has(tmp_path) -> None:
    snippets = chart_value_snippets(docs.doc_files())
    assert len(snippets) >= 3, snippets  # deploy.md (etcd TLS), failover.md (replicas), gpu.md (learners.gpu)
    schema = chart_schema(_REPO / _CHART)
    problems = [f"{where}: the chart has no value {key}" for where, values in snippets
                for key in schema_problems(values, schema)]
    assert not problems, "\n".join(problems)
    page = tmp_path / "page.md"
    page.write_text("```yaml\nsyncer:\n  replicas: 2\n  settings: {coordEtcdd: x}\n```\n", encoding="utf-8")
    [(where, values)] = chart_value_snippets([page])
    assert schema_problems(values, schema) == ["syncer.settings.coordEtcdd"]
