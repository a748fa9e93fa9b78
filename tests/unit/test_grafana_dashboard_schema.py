"""The Grafana dashboards of k8s/grafana type-check against Grafana's published schema: npm
@grafana/schema's `Dashboard` (the dashboard JSON model Grafana's own frontend is typed with),
checked by the TypeScript compiler, both pinned and installed by scripts/grafana_schema_env.sh.

Each dashboard becomes a TypeScript file `export const dashboard = <the JSON> satisfies Dashboard;`.
The JSON is written as an object literal rather than imported with resolveJsonModule: an imported
JSON file widens every string to `string`, so no string enum of the schema (panel `type: "row"`,
threshold modes, ...) could be checked, and an object literal also gets TypeScript's excess
property check (a misspelled key is an error). A copy with a wrong-typed or misspelled field must
be refused, so a checker that checks nothing cannot pass. No node/npm or no registry fails the
tests: they never skip.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "grafana_schema_env.sh"
DASHBOARDS = sorted((ROOT / "k8s" / "grafana").glob("*.json"))
TSCONFIG = {
    "compilerOptions": {"strict": True, "noEmit": True, "target": "es2022", "module": "nodenext",
                        "moduleResolution": "nodenext", "skipLibCheck": True, "types": []},
    "files": ["dashboard.ts"],
}


def _install(env: dict[str, str] | None = None) -> tuple[pathlib.Path | None, str]:
    try:
        result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=900, env=env)
    except subprocess.TimeoutExpired:
        return None, "scripts/grafana_schema_env.sh did not finish within 15 minutes"
    if result.returncode != 0 or not result.stdout.strip():
        return None, (f"no @grafana/schema and TypeScript (scripts/grafana_schema_env.sh exited "
                      f"{result.returncode}):\n{result.stderr[-3000:]}")
    return pathlib.Path(result.stdout.strip().splitlines()[-1]), ""


@functools.cache
def _installed() -> tuple[pathlib.Path | None, str]:
    return _install()


def schema_dir(env: dict[str, str] | None = None) -> pathlib.Path:
    """The directory holding node_modules/{@grafana/schema,typescript}; fails the test without it."""
    path, error = _install(env) if env is not None else _installed()
    if path is None:
        pytest.fail(error, pytrace=False)
    return path


def type_check(dashboard: dict, workdir: pathlib.Path) -> subprocess.CompletedProcess:
    """tsc on `<dashboard> satisfies Dashboard` (from @grafana/schema) in workdir."""
    tools = schema_dir()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "node_modules").symlink_to(tools / "node_modules", target_is_directory=True)
    (workdir / "tsconfig.json").write_text(json.dumps(TSCONFIG))
    (workdir / "dashboard.ts").write_text(
        "import type { Dashboard } from '@grafana/schema';\n\n"
        f"export const dashboard = {json.dumps(dashboard, indent=2)} satisfies Dashboard;\n")
    return subprocess.run(["node", str(tools / "node_modules" / "typescript" / "bin" / "tsc"), "-p", str(workdir)],
                          capture_output=True, text=True, timeout=180, cwd=workdir)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_satisfies_grafana_schema(path: pathlib.Path, tmp_path: pathlib.Path) -> None:
    dashboard = json.loads(path.read_text())
    result = type_check(dashboard, tmp_path / "check")
    assert result.returncode == 0, f"{path.relative_to(ROOT)} does not satisfy @grafana/schema's Dashboard:\n" \
                                   f"{result.stdout}{result.stderr}"


def test_there_is_a_dashboard() -> None:
    assert [p.name for p in DASHBOARDS] == ["ddiloco-dashboard.json"], DASHBOARDS


def _gridpos_height_as_string(d: dict) -> None:
    d["panels"][0]["gridPos"]["h"] = str(d["panels"][0]["gridPos"]["h"])


def _refresh_as_number(d: dict) -> None:
    d["refresh"] = 5


def _schema_version_as_string(d: dict) -> None:
    d["schemaVersion"] = str(d["schemaVersion"])


def _misspelled_key(d: dict) -> None:
    d["panels"][0]["titel"] = d["panels"][0].pop("title")


@pytest.mark.parametrize("breakage", [_gridpos_height_as_string, _refresh_as_number, _schema_version_as_string,
                                      _misspelled_key], ids=lambda f: f.__name__.strip("_"))
def test_a_broken_copy_is_refused(breakage, tmp_path: pathlib.Path) -> None:
    dashboard = copy.deepcopy(json.loads((ROOT / "k8s" / "grafana" / "ddiloco-dashboard.json").read_text()))
    breakage(dashboard)
    result = type_check(dashboard, tmp_path / "check")
    assert result.returncode != 0, f"tsc accepted a dashboard with {breakage.__name__}"
    assert "error TS" in result.stdout, result.stdout + result.stderr


def test_no_tools_fails_instead_of_skipping(tmp_path: pathlib.Path) -> None:
    # An empty tools directory and a registry that refuses connections: the install cannot work.
    env = {**os.environ, "DDILOCO_TOOLS_DIR": str(tmp_path / "tools"), "NPM_CONFIG_REGISTRY": "http://127.0.0.1:9/",
           "NPM_CONFIG_FETCH_RETRIES": "0", "NPM_CONFIG_FETCH_TIMEOUT": "5000", "NPM_CONFIG_OFFLINE": "false",
           "NPM_CONFIG_PREFER_OFFLINE": "false"}
    with pytest.raises(pytest.fail.Exception, match="grafana_schema_env.sh exited 1"):
        schema_dir(env)
