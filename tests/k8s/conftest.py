"""Fixtures of the Kubernetes tier: real helm and kubectl binaries (scripts/k8s_tools.sh), renders
of the chart for every values file (cached for the session), and strict schema validation.

No cluster is needed: everything is rendered and validated offline. If the tools cannot be set
up, the tier FAILS rather than skips, so that CI never passes without having checked the chart.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
CHART = K8S / "chart" / "ddiloco"
RELEASE = "ddiloco"
NAMESPACE = "ddiloco"
# name -> values file on top of the chart's values.yaml (None: the defaults alone)
VALUES = {
    "default": None,
    "hub": K8S / "values-hub.yaml",
    "region-a": K8S / "values-region-a.yaml",
    "region-b": K8S / "values-region-b.yaml",
}
OVERLAYS = ("hub", "region-a", "region-b")
# The oldest Kubernetes the chart supports, and the newest kubernetes-validate ships (added below).
K8S_VERSIONS = ["1.30.0"]


@dataclasses.dataclass(frozen=True)
class Tools:
    helm: str
    kubectl: str
    env: dict

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(args), capture_output=True, text=True, env=self.env, cwd=ROOT, timeout=120)
        if check and proc.returncode != 0:
            pytest.fail(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def helm_run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(self.helm, *args, check=check)

    def kubectl_run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(self.kubectl, *args, check=check)


@pytest.fixture(scope="session")
def tools(tmp_path_factory) -> Tools:
    env = dict(os.environ, PYTHON=sys.executable)
    try:
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "k8s_tools.sh")], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.fail(f"scripts/k8s_tools.sh could not run: {exc!r}")
    if proc.returncode != 0:
        pytest.fail(f"scripts/k8s_tools.sh failed ({proc.returncode}); the k8s tier needs helm, kubectl and "
                    f"kubernetes-validate:\n{proc.stdout}\n{proc.stderr}")
    try:
        import kubernetes_validate  # noqa: F401
        import yaml  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"scripts/k8s_tools.sh ran but {exc.name} is not importable by {sys.executable}")
    home = tmp_path_factory.mktemp("helm-home")
    env = dict(os.environ, HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"),
               HELM_DATA_HOME=str(home / "data"))
    # The script's last line: helm=<path> kubectl=<path>
    paths = dict(item.split("=", 1) for item in proc.stdout.strip().splitlines()[-1].split())
    return Tools(helm=paths["helm"], kubectl=paths["kubectl"], env=env)


def load_docs(text: str) -> list[dict]:
    import yaml

    return [doc for doc in yaml.safe_load_all(text) if doc]


def load_values(name: str) -> dict:
    """The effective values of a values file: the chart's defaults deep-merged with it (as Helm does)."""
    import yaml

    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
        return out

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if VALUES[name] is not None:
        values = merge(values, yaml.safe_load(VALUES[name].read_text()))
    return values


@pytest.fixture(scope="session")
def render(tools):
    """render(name, *extra_args, tests=True) -> parsed docs of `helm template` for VALUES[name]."""

    @functools.lru_cache(maxsize=None)
    def _render(name: str, *extra: str, tests: bool = True) -> tuple:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        if not tests:
            args.append("--skip-tests")
        if VALUES[name] is not None:
            args += ["--values", str(VALUES[name])]
        return tuple(load_docs(tools.helm_run(*args, *extra).stdout))

    return _render


@pytest.fixture(scope="session")
def k8s_versions(tools) -> list[str]:
    import kubernetes_validate

    return [*K8S_VERSIONS, kubernetes_validate.latest_version()]


def _parse_each_schema_once() -> None:
    """kubernetes-validate reads and parses a kind's schema and the version's whole definitions
    file (megabytes of JSON) at every validate() call: ~0.1 s per document and version, most of
    this tier's time, the same files each time. This process keeps each parsed file (the
    validator only reads them); what is validated against what does not change."""
    from kubernetes_validate import utils

    if not hasattr(utils.schema_contents, "cache_info"):
        utils.schema_contents = functools.lru_cache(maxsize=None)(utils.schema_contents)


def validate_strictly(docs, versions: list[str]) -> list[str]:
    """Every problem of every doc against every version's strict schema (unknown kinds are problems)."""
    import kubernetes_validate as kv

    _parse_each_schema_once()
    problems = []
    for doc in docs:
        for version in versions:
            name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                problems.append(f"{name} @ {version}: {path}: {exc.message}")
            except (kv.SchemaNotFoundError, kv.InvalidSchemaError) as exc:
                problems.append(f"{name} @ {version}: no schema: {exc.message}")
    return problems
