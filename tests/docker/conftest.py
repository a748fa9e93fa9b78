"""Fixtures for the container tier: a private Docker engine (scripts/docker_env.sh) and a compose
project with a unique name that is always torn down (`down -v --remove-orphans`).

If the set-up script fails, tests FAIL with its output: a broken environment must never pass as
green. Developers without root (or without a Docker-capable Linux host) skip the tier explicitly
with DDILOCO_SKIP_DOCKER_TESTS=1; CI never sets it.

Every subprocess has a timeout; on a timeout its whole process group (started here) is killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence

import pytest

from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import security as security_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
SETUP_SCRIPT = REPO / "scripts" / "docker_env.sh"
SKIP_ENV = "DDILOCO_SKIP_DOCKER_TESTS"
PROJECT_LABEL = "com.docker.compose.project"

# Timings of the end-to-end scenario, printed in the terminal summary (no -s needed).
TIMINGS: list[dict] = []
TIMINGS_FILE: list[pathlib.Path] = []


class SyncerProbe:
    """Reads a syncer's training state through its published port on 127.0.0.1 (gRPC errors propagate:
    callers poll through tests.waits.wait_for_rpc, which counts them as "not yet")."""

    def __init__(self, address: str, *, timeout_s: float = 5.0,
                 security: security_lib.ClientSecurity | None = None) -> None:
        self.channel = channel_lib.sync_channel(address, security)
        self.stub = syncer_pb2_grpc.SyncerStub(self.channel)
        self.timeout_s = timeout_s

    def state(self) -> syncer_pb2.TrainingState:
        request = syncer_pb2.GetTrainingStateRequest(recent_merges=256)
        return self.stub.GetTrainingState(request, timeout=self.timeout_s).state

    def close(self) -> None:
        self.channel.close()


def record_timing(label: str, step: str, *, digits: int = 1, **fields) -> None:
    """One timed step of a container test: kept for the terminal summary (and the timings file, when
    the test has one) and printed as it happens."""
    entry = {"step": step, **{k: (round(v, digits) if isinstance(v, float) else v) for k, v in fields.items()}}
    TIMINGS.append(entry)
    if TIMINGS_FILE:
        TIMINGS_FILE[-1].write_text(json.dumps(TIMINGS, indent=2))
    print(f"[{label}] {step}: " + " ".join(f"{k}={v}" for k, v in entry.items() if k != "step"), flush=True)


def report_logs(project_name: str, logs: str, tmp_path: pathlib.Path, *, last_lines: int = 80) -> None:
    """A failed scenario's compose logs: all of them into tmp_path/compose.log, the last lines printed."""
    log_file = tmp_path / "compose.log"
    log_file.write_text(logs)
    print(f"--- last lines of the logs of {project_name} (all of them: {log_file}) ---")
    print("\n".join(logs.splitlines()[-last_lines:]))


def run(cmd: Sequence[str], *, env: dict[str, str] | None = None, timeout: float, check: bool = True,
        input_text: str | None = None) -> subprocess.CompletedProcess:
    """Runs cmd with a bound; on timeout kills its process group (ours) and fails with its output."""
    proc = subprocess.Popen(
        list(cmd), env=env, cwd=REPO, text=True, start_new_session=True,
        stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        out, err = proc.communicate(input_text, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"{' '.join(cmd)} did not finish within {timeout:.0f} s:\n{out}\n{err}") from None
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}:\n{out}\n{err}")
    return done


@pytest.fixture(scope="session")
def docker_env() -> dict[str, str]:
    """The environment for `docker` and `docker compose` calls against the private engine."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: the docker tier is skipped on request (CI never sets it)")
    started = time.monotonic()
    try:
        done = run(["bash", str(SETUP_SCRIPT)], timeout=1200, check=False)
    except AssertionError as exc:
        pytest.fail(f"scripts/docker_env.sh timed out: {exc}", pytrace=False)
    if done.returncode != 0:
        pytest.fail(
            f"scripts/docker_env.sh failed (exit {done.returncode}). The docker tier needs root on a Linux x86_64 "
            f"host where apt-get and dockerd work; set {SKIP_ENV}=1 to skip it explicitly.\n"
            f"--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}",
            pytrace=False,
        )
    env = dict(os.environ)
    for line in done.stdout.splitlines():
        if line.startswith("export ") and "=" in line:
            key, value = line[len("export "):].split("=", 1)
            env[key] = value
    assert env.get("DOCKER_HOST", "").startswith("unix://"), done.stdout
    TIMINGS.append({"step": "0-setup", "docker_env_s": round(time.monotonic() - started, 1)})
    return env


@dataclasses.dataclass
class ComposeProject:
    """One compose project (unique name) on the private engine."""

    name: str
    env: dict[str, str]
    # Compose files after the top-level one (overrides), e.g. extra service flags for a test.
    overrides: list[pathlib.Path] = dataclasses.field(default_factory=list)

    def compose(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
        files = [arg for path in [COMPOSE_FILE, *self.overrides] for arg in ("-f", str(path))]
        return run(["docker", "compose", "--project-directory", str(REPO), *files, "-p", self.name, *args],
                   env=self.env, timeout=timeout, check=check)

    def docker(self, *args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
        return run(["docker", *args], env=self.env, timeout=timeout, check=check)

    def container_ids(self, service: str) -> list[str]:
        """Full ids of the service's containers, running or not, sorted."""
        out = self.compose("ps", "--all", "--quiet", service, timeout=60).stdout
        return sorted(line.strip() for line in out.splitlines() if line.strip())

    def inspect(self, container: str) -> dict:
        return json.loads(self.docker("inspect", container, timeout=30).stdout)[0]

    def network(self, name: str) -> str:
        return f"{self.name}_{name}"

    def logs(self, tail: int = 60) -> str:
        done = self.compose("logs", "--no-color", "--tail", str(tail), timeout=60, check=False)
        return done.stdout + done.stderr

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes still carrying this project's label."""
        label = f"label={PROJECT_LABEL}={self.name}"
        found = {}
        for kind, cmd in (("containers", ["ps", "--all"]), ("networks", ["network", "ls"]), ("volumes", ["volume", "ls"])):
            out = self.docker(*cmd, "--quiet", "--filter", label, timeout=30).stdout
            found[kind] = [line for line in out.split() if line]
        return found

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "5", timeout=180, check=False)

    @contextlib.contextmanager
    def logs_on_failure(self, tmp_path: pathlib.Path):
        """Runs the body; if it raises, reports the project's logs (report_logs) before the error."""
        try:
            yield
        except BaseException:
            report_logs(self.name, self.logs(tail=100_000), tmp_path)
            raise

    def down_leaving_nothing(self, record: Callable[..., None], step: str) -> None:
        """`down`, timed and recorded as `step` with what remains of the project; then asserts that
        no container, network or volume of it does."""
        started = time.monotonic()
        self.down()
        leftovers = self.leftovers()
        record(step, down_s=time.monotonic() - started, **{k: len(v) for k, v in leftovers.items()})
        assert leftovers == {"containers": [], "networks": [], "volumes": []}, leftovers


@pytest.fixture(scope="module")
def compose_env(request) -> dict[str, str]:
    """An environment whose `docker compose` works (`docker compose config` needs no engine); the
    private engine's set-up only if the host has no compose of its own."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDILOCO_")}  # the files' defaults
    if run(["docker", "compose", "version"], env=env, timeout=30, check=False).returncode == 0:
        return env
    return {k: v for k, v in request.getfixturevalue("docker_env").items() if not k.startswith("DDILOCO_")}


@pytest.fixture
def compose_project(docker_env, tmp_path):
    """A unique project; torn down (containers, networks, volume) whatever the test outcome."""
    project = ComposeProject(name=f"ddiloco-e2e-{uuid.uuid4().hex[:8]}", env=dict(docker_env))
    TIMINGS_FILE.append(tmp_path / "docker_e2e_timings.json")
    try:
        yield project
    finally:
        project.down()


def pytest_terminal_summary(terminalreporter) -> None:
    if not TIMINGS:
        return
    terminalreporter.section("docker end-to-end timings")
    for entry in TIMINGS:
        fields = " ".join(f"{k}={v}" for k, v in entry.items() if k != "step")
        terminalreporter.write_line(f"{entry['step']}: {fields}")
    if TIMINGS_FILE:
        TIMINGS_FILE[-1].write_text(json.dumps(TIMINGS, indent=2))
        terminalreporter.write_line(f"(also in {TIMINGS_FILE[-1]})")
