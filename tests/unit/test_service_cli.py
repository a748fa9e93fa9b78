"""The services as a user runs them: `ddiloco <service> --help` names the command typed, and
boolean flags such as `--json-logs` work bare on every service (issue 26)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from services.checkpoint import config as checkpoint_config
from services.learner import config as learner_config
from services.syncer import config as syncer_config

_REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("service", ["syncer", "learner", "checkpoint", "evaluate"])
def test_help_through_the_cli_names_the_command_typed(service: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "ddiloco.cli.main", service, "--help"], cwd=_REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: ddiloco {service} "), proc.stdout[:200]


@pytest.mark.parametrize("service, parse", [
    ("syncer", lambda argv: syncer_config.parse_config(argv, {})),
    ("learner", lambda argv: learner_config.parse_learner_config(argv, {}, "host")),
    ("evaluate", lambda argv: learner_config.parse_evaluator_config(argv, {})),
    ("checkpoint", lambda argv: checkpoint_config.parse_config(argv, {})),
])
def test_help_names_the_command_typed(service: str, parse, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: ddiloco {service} ")


def test_checkpoint_json_logs_is_a_bare_flag(tmp_path: pathlib.Path) -> None:
    cfg = checkpoint_config.parse_config(["--root", str(tmp_path), "--json-logs"], {})
    assert cfg.json_logs is True
    # A value still works, and the bare flag may come before another option.
    cfg = checkpoint_config.parse_config(["--json-logs", "--root", str(tmp_path)], {})
    assert cfg.json_logs is True
    cfg = checkpoint_config.parse_config(["--root", str(tmp_path), "--json-logs", "false"], {})
    assert cfg.json_logs is False
    assert checkpoint_config.parse_config(["--root", str(tmp_path)], {}).json_logs is False


@pytest.mark.parametrize("raw, expected", [("true", True), ("1", True), ("yes", True), ("false", False),
                                           ("0", False), ("off", False)])
def test_checkpoint_json_logs_from_the_environment(tmp_path: pathlib.Path, raw: str, expected: bool) -> None:
    environ = {"DDILOCO_CHECKPOINT_ROOT": str(tmp_path), "DDILOCO_CHECKPOINT_JSON_LOGS": raw}
    assert checkpoint_config.parse_config([], environ).json_logs is expected
    # The flag wins over the variable.
    assert checkpoint_config.parse_config(["--json-logs"], environ).json_logs is True
    assert checkpoint_config.parse_config(["--json-logs", "false"], environ).json_logs is False


def test_checkpoint_bad_json_logs_variable_is_a_usage_error(tmp_path: pathlib.Path, capsys) -> None:
    environ = {"DDILOCO_CHECKPOINT_ROOT": str(tmp_path), "DDILOCO_CHECKPOINT_JSON_LOGS": "maybe"}
    with pytest.raises(SystemExit):
        checkpoint_config.parse_config([], environ)
    assert "DDILOCO_CHECKPOINT_JSON_LOGS" in capsys.readouterr().err


@pytest.mark.parametrize("service, parse", [
    ("syncer", lambda argv: syncer_config.parse_config(argv, {})),
    ("learner", lambda argv: learner_config.parse_learner_config(argv, {}, "host")),
])
def test_json_logs_is_bare_for_syncer_and_learner_too(service: str, parse) -> None:
    assert parse(["--json-logs"]).json_logs is True


def test_the_readme_tells_how_ddiloco_up_gives_each_learner_one_xla_thread(tmp_path: pathlib.Path) -> None:
    """Several learners on one host need one XLA compute thread each; `ddiloco up` sets XLA_FLAGS
    for its processes (unless the user set it), and docs/deploy.md's "The services by hand" gives
    the same setting to users who start the services by hand."""
    from ddiloco.cli import cluster

    flags = cluster.LocalCluster(tmp_path / "run", env={}).env["XLA_FLAGS"]
    assert cluster.LocalCluster(tmp_path / "own", env={"XLA_FLAGS": "--mine"}).env["XLA_FLAGS"] == "--mine"
    deploy = (_REPO / "docs" / "deploy.md").read_text()
    section = deploy.split("## The services by hand", 1)[1].split("\n## ", 1)[0]
    assert f"XLA_FLAGS={flags}" in section, flags
