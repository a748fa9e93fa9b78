"""`--version` on every entry point, and the build (version + commit) in the syncer's training state.

The version comes from the installed package's metadata; the commit from the BUILD_COMMIT file a
build writes (the Dockerfile's GIT_COMMIT), else the git checkout, else "unknown".
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import subprocess
import sys

import pytest

from ddiloco import build_info
from services.syncer import wire_views
from tests import fakes

_SHA = re.compile(r"[0-9a-f]{40}|unknown")


@pytest.fixture
def fresh_build_info():
    build_info.version.cache_clear()
    build_info.commit.cache_clear()
    yield build_info
    build_info.version.cache_clear()
    build_info.commit.cache_clear()


@pytest.mark.parametrize("module,prog", [
    ("services.learner.__main__", "ddiloco learner"),
    ("services.learner.evaluator", "ddiloco evaluate"),
    ("services.syncer.__main__", "ddiloco syncer"),
    ("services.checkpoint.__main__", "ddiloco checkpoint"),
])
def test_every_service_prints_its_version_and_commit(module, prog, capsys):
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(module).main(["--version"])  # before any required flag is checked
    assert exited.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"{prog} {importlib.metadata.version('ddiloco')} (commit {build_info.commit()})"
    assert _SHA.fullmatch(build_info.commit())


def test_the_ddiloco_command_prints_its_version():
    out = subprocess.run([sys.executable, "-m", "ddiloco.cli.main", "--version"], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == f"ddiloco {importlib.metadata.version('ddiloco')} (commit {build_info.commit()})"


def test_the_commit_a_build_recorded_wins_and_unknown_is_said_when_nothing_knows(fresh_build_info, tmp_path,
                                                                                  monkeypatch):
    recorded = tmp_path / "BUILD_COMMIT"
    recorded.write_text("ab" * 20 + "\n")
    monkeypatch.setattr(build_info, "COMMIT_FILE", recorded)
    assert build_info.commit() == "ab" * 20
    build_info.commit.cache_clear()
    recorded.write_text("unknown\n")  # the Dockerfile's default: a build without GIT_COMMIT

    def no_git(*_args, **_kwargs):
        raise OSError("no git here")

    monkeypatch.setattr(build_info.subprocess, "run", no_git)
    assert build_info.commit() == "unknown"


def test_the_training_state_carries_the_syncers_build():
    state = wire_views.training_state(fakes.make_core(), 0)
    assert state.build_version == importlib.metadata.version("ddiloco")
    assert state.build_commit == build_info.commit() and _SHA.fullmatch(state.build_commit)
