"""The `docker`, `docker compose`, `helm` and `kubectl` checkers of the docs' command check
(tests/unit/test_docs_commands.py says what each one checks): they read the compose files, the
Dockerfile, the chart's values schema and the rendered manifests, and run nothing.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re

import yaml

from tests.unit import test_docs as docs
from tests.unit.doc_commands import Findings, Line, options_anywhere, split_assignments, split_options

_COMPOSE_DEFAULT = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}")
# The release name and namespace scripts/render_k8s.py renders k8s/kustomize/ with: resource
# names such as deploy/ddiloco-syncer hold only for this release.
_RELEASE = "ddiloco"
_CHART = pathlib.Path("k8s/chart/ddiloco")
_MANIFESTS = pathlib.Path("k8s/kustomize")  # rendered by scripts/render_k8s.py

# Docker Compose v2: sub-commands; per sub-command its options without and with a value.
_COMPOSE_GLOBAL_VALUED = {"-f", "--file", "-p", "--project-name", "--profile", "--env-file", "--project-directory",
                          "--parallel", "--progress", "--ansi"}
_COMPOSE_OPTIONS: dict[str, tuple[set[str], set[str]]] = {
    "up": ({"-d", "--detach", "--build", "--no-build", "--wait", "--no-deps", "--force-recreate", "--remove-orphans",
            "--abort-on-container-exit", "--no-recreate", "-V", "--renew-anon-volumes"},
           {"--scale", "-t", "--timeout", "--pull", "--exit-code-from", "--attach", "--no-attach", "--wait-timeout"}),
    "down": ({"-v", "--volumes", "--remove-orphans"}, {"--rmi", "-t", "--timeout"}),
    "ps": ({"-a", "--all", "-q", "--quiet", "--services"}, {"--format", "--status", "--filter"}),
    "logs": ({"-f", "--follow", "-t", "--timestamps", "--no-color", "--no-log-prefix"}, {"--tail", "--since", "--until"}),
    "run": ({"--rm", "--no-deps", "-d", "--detach", "-T", "--build", "--service-ports", "--use-aliases", "-i"},
            {"-e", "--env", "--entrypoint", "-v", "--volume", "-p", "--publish", "--name", "-u", "--user", "-w",
             "--workdir", "-l", "--label"}),
    "exec": ({"-d", "--detach", "-T", "--privileged"}, {"-e", "--env", "-u", "--user", "-w", "--workdir", "--index"}),
    "kill": ({"--remove-orphans"}, {"-s", "--signal"}),
    "start": (set(), set()),
    "stop": (set(), {"-t", "--timeout"}),
    "restart": ({"--no-deps"}, {"-t", "--timeout"}),
    "build": ({"--no-cache", "--pull", "-q", "--quiet", "--push"}, {"--build-arg", "--ssh", "--progress"}),
    "pull": ({"-q", "--quiet", "--ignore-pull-failures", "--include-deps"}, {"--policy"}),
    "config": ({"-q", "--quiet", "--services", "--volumes", "--profiles", "--images"}, {"--format", "-o", "--output"}),
    "rm": ({"-f", "--force", "-s", "--stop", "-v", "--volumes"}, set()),
    "pause": (set(), set()), "unpause": (set(), set()), "top": (set(), set()), "images": ({"-q", "--quiet"}, set()),
}
_COMPOSE_SERVICE_ARGS = {"up", "ps", "logs", "kill", "start", "stop", "restart", "build", "pull", "config", "rm",
                         "pause", "unpause", "top", "images"}  # every positional is a service
_DOCKER_CONTAINER_COMMANDS = {"exec", "kill", "stop", "start", "restart", "logs", "inspect", "pause", "unpause"}
_KUBECTL_KINDS = {"deploy": "Deployment", "deployment": "Deployment", "svc": "Service", "service": "Service",
                  "sts": "StatefulSet", "statefulset": "StatefulSet", "cm": "ConfigMap", "configmap": "ConfigMap",
                  "netpol": "NetworkPolicy", "networkpolicy": "NetworkPolicy"}


# ---------------------------------------------------------------------------------------------
# docker and docker compose


def _resolve(value: str) -> str:
    return _COMPOSE_DEFAULT.sub(lambda m: m.group(1), value)  # ${VAR:-default} -> default


@functools.cache
def _compose_model(root: pathlib.Path, files: tuple[str, ...]) -> dict:
    """Services (merged over the files in order), networks, profiles, project name and raw text."""
    services: dict[str, dict] = {}
    networks: set[str] = set()
    project, text = root.name, ""
    for name in files:
        raw = (root / name).read_text(encoding="utf-8")
        text += raw
        data = yaml.safe_load(raw) or {}
        project = data.get("name", project)
        networks |= set(data.get("networks") or {})
        for service, spec in (data.get("services") or {}).items():
            services.setdefault(service, {}).update(spec or {})
    profiles = {p for spec in services.values() for p in spec.get("profiles", [])}
    return {"services": services, "networks": networks, "profiles": profiles, "project": project, "text": text}


@functools.cache
def _dockerfile(path: pathlib.Path) -> tuple[set[str], list[str]]:
    """The ARG names and the last ENTRYPOINT (exec form) of a Dockerfile."""
    text = path.read_text(encoding="utf-8")
    build_args = set(re.findall(r"^ARG\s+([A-Za-z_][A-Za-z0-9_]*)", text, re.MULTILINE))
    entrypoints = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.MULTILINE)
    return build_args, json.loads(entrypoints[-1]) if entrypoints else []


def _image_entrypoint(root: pathlib.Path, image: str) -> list[str] | None:
    """The ENTRYPOINT of an image this repository builds: repository `ddiloco`, from ./Dockerfile
    (compose's ddiloco:local, `docker build -t ddiloco:TAG .`). None for any other image."""
    if _resolve(image).split(":")[0] != "ddiloco":
        return None
    return _dockerfile(root / "Dockerfile")[1]


def _run_in_ddiloco(line: Line, out: Findings, argv: list[str]) -> None:
    command = docs._ddiloco_command(line.where, argv)
    if command is not None and command.words:
        out.ddiloco.append(command)


def _check_compose_run(line: Line, out: Findings, root: pathlib.Path, model: dict, rest: list[str], options) -> None:
    service, args = rest[0], rest[1:]
    spec = model["services"].get(service, {})
    if any(name == "--entrypoint" for name, _ in options):
        return  # the line replaces the entrypoint: it runs what it says
    entrypoint = spec.get("entrypoint") or _image_entrypoint(root, spec.get("image", "")) or []
    if entrypoint[:1] == ["ddiloco"]:
        _run_in_ddiloco(line, out, [*entrypoint, *(args or spec.get("command") or [])])


def check_compose(line: Line, out: Findings, root: pathlib.Path, variables: dict[str, str], args: list[str]) -> None:
    options, unknown, rest = split_options(args, set(), _COMPOSE_GLOBAL_VALUED)
    for name in unknown:
        out.bad(line, f"{name} is not an option of `docker compose` this check knows")
    files = tuple(str(v) for n, v in options if n in ("-f", "--file")) or ("docker-compose.yml",)
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        return out.bad(line, f"no compose file {', '.join(missing)}")
    model = _compose_model(root, files)
    for name, value in options:
        if name == "--profile" and value not in model["profiles"]:
            out.bad(line, f"no service of {', '.join(files)} has profile {value!r}")
    for variable in variables:
        if not re.search(r"\$\{" + re.escape(variable) + r"\b", model["text"]):
            out.bad(line, f"{', '.join(files)} never read {variable}")
    if not rest or rest[0] not in _COMPOSE_OPTIONS:
        return out.bad(line, f"{rest[0] if rest else 'nothing'} is not a docker compose sub-command this check knows")
    command, (flags, valued) = rest[0], _COMPOSE_OPTIONS[rest[0]]
    sub_options, unknown, positionals = split_options(rest[1:], flags, valued)
    for name in unknown:
        out.bad(line, f"{name} is not an option of `docker compose {command}` this check knows")
    services = [v.split("=")[0] for n, v in sub_options if n == "--scale" and v]
    if command in _COMPOSE_SERVICE_ARGS:
        services += positionals
    elif command in ("run", "exec") and positionals:
        services.append(positionals[0])
    elif command in ("run", "exec"):
        out.bad(line, f"`docker compose {command}` names no service")
    for service in services:
        if service not in model["services"]:
            out.bad(line, f"no service {service!r} in {', '.join(files)}")
    if command == "run" and positionals and positionals[0] in model["services"]:
        _check_compose_run(line, out, root, model, positionals, sub_options)


@functools.cache
def _all_compose(root: pathlib.Path) -> tuple[set[str], set[str]]:
    """Container and network names the repository's compose files can create."""
    containers, networks = set(), set()
    for path in sorted(root.glob("docker-compose*.yml")):
        model = _compose_model(root, (path.name,))
        project = model["project"]
        for service, spec in model["services"].items():
            containers |= {spec.get("container_name", ""), f"{project}-{service}-1"}
        networks |= {f"{project}_{network}" for network in model["networks"]}
    return containers - {""}, networks


def _container_known(name: str, containers: set[str]) -> bool:
    # <project>-<service>-<N>: any replica number of a service the files define.
    return name in containers or re.sub(r"-[0-9]+$", "-1", name) in containers


def check_docker(line: Line, out: Findings, root: pathlib.Path) -> None:
    variables, tokens = split_assignments(line.tokens)
    command, args = (tokens[1], tokens[2:]) if len(tokens) > 1 else ("", [])
    if command == "compose":
        return check_compose(line, out, root, variables, args)
    if command == "build":
        return _check_docker_build(line, out, root, args)
    if command == "run":
        options, unknown, rest = split_options(args, {"--rm", "-d", "-i", "-t", "-it"},
                                          {"--gpus", "-e", "--env", "-v", "-p", "--name", "--network"})
        if unknown or not rest:
            return out.bad(line, f"`docker run`: {', '.join(unknown) or 'no image'}")
        entrypoint = _image_entrypoint(root, rest[0])
        if entrypoint is None:
            return out.bad(line, f"{rest[0]} is not an image this repository builds")
        return _run_in_ddiloco(line, out, [*entrypoint, *rest[1:]])
    containers, networks = _all_compose(root)
    if command in _DOCKER_CONTAINER_COMMANDS:
        for name in split_options(args, {"-it", "-i", "-t", "-f", "-d"}, {"-s", "--signal", "-e", "-u", "-w"})[2][:1]:
            if not _container_known(name, containers):
                out.bad(line, f"no compose file defines a container {name!r}")
        return
    if command == "network" and len(args) >= 2 and args[0] in ("connect", "disconnect", "inspect"):
        if args[1] not in networks:
            out.bad(line, f"no compose file defines a network {args[1]!r} (<project>_<network>)")
        for name in args[2:3]:
            if not _container_known(name, containers):
                out.bad(line, f"no compose file defines a container {name!r}")
        return
    out.bad(line, f"`docker {command}` is not a docker command this check knows")


def _check_docker_build(line: Line, out: Findings, root: pathlib.Path, args: list[str]) -> None:
    options, unknown, rest = split_options(args, {"--no-cache", "--pull", "-q"}, {"-t", "--tag", "-f", "--file",
                                                                              "--build-arg", "--target", "--platform"})
    if unknown or len(rest) != 1:
        return out.bad(line, f"`docker build`: {', '.join(unknown) or 'needs one context'}")
    context = root / rest[0]
    dockerfile = next((context / v for n, v in options if n in ("-f", "--file")), context / "Dockerfile")
    if not dockerfile.is_file():
        return out.bad(line, f"no Dockerfile {dockerfile.relative_to(root)}")
    declared, _ = _dockerfile(dockerfile)
    for name, value in options:
        if name == "--build-arg" and str(value).split("=")[0] not in declared:
            out.bad(line, f"{dockerfile.name} declares no ARG {str(value).split('=')[0]}")


# ---------------------------------------------------------------------------------------------
# helm and kubectl


def schema_problems(values: object, schema: dict, path: str = "") -> list[str]:
    """Keys of `values` that a JSON schema closed with additionalProperties: false does not admit."""
    if not isinstance(values, dict) or "properties" not in schema:
        return []
    problems = []
    for key, value in values.items():
        if key in schema["properties"]:
            problems += schema_problems(value, schema["properties"][key], f"{path}{key}.")
        elif schema.get("additionalProperties") is False:
            problems.append(f"{path}{key}")
    return problems


@functools.cache
def chart_schema(chart: pathlib.Path) -> dict:
    return json.loads((chart / "values.schema.json").read_text(encoding="utf-8"))


def check_helm(line: Line, out: Findings, root: pathlib.Path) -> None:
    tokens = docs._command_start(list(line.tokens))
    command = tokens[1] if len(tokens) > 1 else ""
    options, positionals = options_anywhere(
        line, out, tokens[2:], {"--install", "--create-namespace", "--wait", "--atomic", "--dry-run", "--debug"},
        {"-n", "--namespace", "--kube-context", "-f", "--values", "--set", "--set-string", "--timeout", "--version"})
    if command not in ("upgrade", "install", "template", "test", "status", "uninstall", "lint"):
        return out.bad(line, f"`helm {command}` is not a helm command this check knows")
    if command in ("upgrade", "install", "template", "test", "status", "uninstall") and positionals[:1] != [_RELEASE]:
        out.bad(line, f"release {positionals[:1]} is not {_RELEASE!r}, the one k8s/kustomize/ and the docs' names assume")
    charts = positionals[1:2] if command in ("upgrade", "install", "template") else positionals[:1] if command == "lint" else []
    for chart in charts:
        if not (root / chart / "Chart.yaml").is_file():
            return out.bad(line, f"{chart} is not a chart directory (no Chart.yaml)")
    if command == "test" and not (root / _CHART / "templates" / "tests").is_dir():
        out.bad(line, "the chart has no templates/tests for `helm test` to run")
    schema = chart_schema(root / charts[0]) if charts else chart_schema(root / _CHART)
    for name, value in options:
        if name in ("-f", "--values"):
            if not (root / str(value)).is_file():
                out.bad(line, f"no values file {value}")
                continue
            bad = schema_problems(yaml.safe_load((root / str(value)).read_text(encoding="utf-8")), schema)
            out.problems.extend(f"{line.where}: {value}: the chart has no value {key}" for key in bad)
        elif name in ("--set", "--set-string"):
            for pair in str(value).split(","):
                nested: object = None
                for part in reversed(pair.split("=", 1)[0].split(".")):
                    nested = {part: nested}
                out.problems.extend(f"{line.where}: --set {pair}: the chart has no value {key}"
                                    for key in schema_problems(nested, schema))


@functools.cache
def _manifests(root: pathlib.Path) -> list[dict]:
    return [doc for path in sorted((root / _MANIFESTS).rglob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if isinstance(doc, dict) and "kind" in doc]


def _resource(root: pathlib.Path, reference: str) -> dict | None:
    kind, _, name = reference.partition("/")
    return next((d for d in _manifests(root) if d["kind"] == _KUBECTL_KINDS.get(kind.lower())
                 and d.get("metadata", {}).get("name") == name), None)


def check_kubectl(line: Line, out: Findings, root: pathlib.Path) -> None:
    tokens = docs._command_start(list(line.tokens))
    options, words = options_anywhere(line, out, tokens[1:], set(), {
        "--context", "-n", "--namespace", "-k", "--kustomize", "-f", "--filename", "--from-file", "--from-literal"})
    namespaces = {d.get("metadata", {}).get("namespace") for d in _manifests(root)} - {None}
    for name, value in options:
        if name in ("-k", "--kustomize") and not (root / value / "kustomization.yaml").is_file():
            out.bad(line, f"{value} is not a kustomization (no kustomization.yaml)")
        elif name in ("-f", "--filename") and not (root / value).exists():
            out.bad(line, f"no file {value}")
        elif name in ("-n", "--namespace") and value not in namespaces:
            out.bad(line, f"namespace {value} is not the rendered manifests' ({', '.join(sorted(namespaces))})")
        elif name == "--from-file" and "=" in value and not _chart_reads(root, value.split("=")[0]):
            out.bad(line, f"the chart never reads a Secret key {value.split('=')[0]}")
    _check_kubectl_words(line, out, root, words, namespaces)


def _chart_reads(root: pathlib.Path, key: str) -> bool:
    return any(key in path.read_text(encoding="utf-8") for path in (root / "k8s" / "chart").rglob("*")
               if path.is_file() and path.suffix in (".yaml", ".tpl"))


def _check_kubectl_words(line: Line, out: Findings, root: pathlib.Path, words: list[str], namespaces: set) -> None:
    verb = words[0] if words else ""
    if verb == "apply" or words[:2] == ["create", "secret"]:
        return
    if words[:2] == ["create", "namespace"]:
        if words[2:3] and words[2] not in namespaces:
            out.bad(line, f"namespace {words[2]} is not the rendered manifests' ({', '.join(sorted(namespaces))})")
        return
    if verb == "rollout" and len(words) == 3 and words[1] in ("status", "restart", "undo", "history"):
        references, ports = words[2:], []
    elif verb == "port-forward" and len(words) >= 3:
        references, ports = words[1:2], words[2:]
    elif verb in ("get", "describe", "delete", "logs") and len(words) >= 2 and "/" in words[1]:
        references, ports = words[1:2], []
    else:
        return out.bad(line, f"`kubectl {' '.join(words[:2])}` is not a kubectl command this check knows")
    for reference in references:
        resource = _resource(root, reference)
        if resource is None:
            out.bad(line, f"no {reference} in the rendered manifests (k8s/kustomize/)")
            continue
        declared = {str(p.get("port")) for p in resource.get("spec", {}).get("ports", [])}
        for port in ports:
            if port.rsplit(":", 1)[-1] not in declared:
                out.bad(line, f"{reference} has no port {port.rsplit(':', 1)[-1]} ({', '.join(sorted(declared))})")
