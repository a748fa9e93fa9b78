"""The `ddiloco` command as a user runs it: up (to the end, and interrupted), status, --help."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.integration.conftest import TINY, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

_DDILOCO = [sys.executable, "-m", "ddiloco.cli.main"]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is not running.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _session_cache(path) -> list[str]:
    """`up`'s learners on the session's compilation cache (tests/conftest.py). Its default,
    runs/jax-cache, is relative to the run's workdir, so every test's run compiled the learner's
    programs from scratch (~65 s to the first step at a load of 13, 3-5 s from the cache)."""
    return ["--compilation-cache-dir", str(path)]


def test_up_trains_and_prints_a_summary(tmp_path):
    workdir = tmp_path / "run"
    result = subprocess.run(
        [*_DDILOCO, "up", "--preset", "tiny", "--learners", "2", "--steps", "60", "--sync-period-steps", "4",
         "--no-live", "--eval-interval-s", "3", "--workdir", str(workdir), "--summary-json", str(tmp_path / "s.json"),
         "--compilation-cache-dir", "jax-cache"],  # relative: where `up` runs, not the workdir
        capture_output=True, text=True, timeout=280, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "syncer listening on 127.0.0.1:" in result.stdout
    assert "held-out loss of the global model" in result.stdout
    assert "work merged: " in result.stdout
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["heldout_loss_end"] < summary["heldout_loss_start"] - 0.5, summary
    assert summary["merges"] > 0 and summary["tokens_merged"] > 0 and summary["bytes_in"] > 0
    assert summary["work_merged"] == pytest.approx(
        summary["tokens_merged"] / (summary["num_fragments"] * summary["tokens_processed"]))
    assert [ls["steps"] for ls in summary["learners"]] == [60, 60]
    assert list((tmp_path / "jax-cache").glob("*-cache")), "the learners wrote no compiled programs"
    pids = json.loads((workdir / "pids.json").read_text())
    assert set(pids) == {"checkpoint", "syncer", "evaluator", "learner-0", "learner-1"}
    assert not [p for ps in pids.values() for p in ps if _pid_alive(p)], "up left processes behind"
    # The recorded run turns into plots.
    report = subprocess.run([*_DDILOCO, "report", str(workdir)], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stdout + report.stderr
    for name in ("loss.png", "bytes.png", "versions.png", "work_merged.png"):
        data = (workdir / "report" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    missing = subprocess.run([*_DDILOCO, "report", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "not found" in missing.stdout


def test_up_with_two_syncer_shards_trains_one_run(tmp_path, learner_compilation_cache):
    """`ddiloco up --syncer-shards 2` (issue 21): two syncer processes each merge their own
    fragments, the learners and the evaluator find both from shard 0, and the summary is one run
    over both (work merged counts every fragment's merges)."""
    workdir = tmp_path / "run"
    result = subprocess.run(
        [*_DDILOCO, "up", "--preset", "tiny", "--learners", "2", "--steps", "60", "--sync-period-steps", "4",
         "--syncer-shards", "2", "--no-live", "--eval-interval-s", "3", "--workdir", str(workdir),
         "--summary-json", str(tmp_path / "s.json"), *_session_cache(learner_compilation_cache)],
        capture_output=True, text=True, timeout=280,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 syncer shards" in result.stdout
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["heldout_loss_end"] < summary["heldout_loss_start"] - 0.5, summary
    # tokens_merged sums both shards: near-full work merged needs both shards' merges
    assert summary["work_merged"] > 0.9, summary
    for name in ("syncer", "syncer-1"):  # each shard merged its own fragments
        assert "merged" in (workdir / "logs" / f"{name}.log").read_text(), name
    pids = json.loads((workdir / "pids.json").read_text())
    assert {"syncer", "syncer-1"} <= set(pids)
    assert not [p for ps in pids.values() for p in ps if _pid_alive(p)], "up left processes behind"


def test_up_interrupted_shuts_everything_down(tmp_path, learner_compilation_cache):
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        [*_DDILOCO, "up", "--preset", "tiny", "--learners", "2", "--steps", "100000", "--no-live",
         "--workdir", str(workdir), *_session_cache(learner_compilation_cache)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        # Interrupt once the learners are training and the syncer has merged something.
        syncer_log = workdir / "logs" / "syncer.log"
        wait_until(lambda: syncer_log.exists() and "merged" in syncer_log.read_text(), timeout_s=180, what="a merge")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "summary (interrupted)" in out, out[-3000:]
    assert "Traceback" not in out
    pids = json.loads((workdir / "pids.json").read_text())
    assert not [p for ps in pids.values() for p in ps if _pid_alive(p)], "up left processes behind"
    # The syncer wrote a final checkpoint on the way down (SIGTERM path).
    assert "checkpoint committed" in (workdir / "logs" / "syncer.log").read_text()


def test_status_json_human_watch_and_unreachable(cluster):
    syncer = cluster.start_syncer(run_id="cli-status", extra=TINY)
    target = ["--target", syncer.address]
    one = subprocess.run([*_DDILOCO, "status", "--json", *target], capture_output=True, text=True, timeout=60)
    assert one.returncode == 0, one.stderr
    state = json.loads(one.stdout)
    assert state["run_id"] == "cli-status" and len(state["fragments"]) == 4
    assert all("round" in f and "round_open" in f for f in state["fragments"])
    assert {"tokens_processed", "work_merged", "merge_participation"} <= set(state["derived"])
    human = subprocess.run([*_DDILOCO, "status", *target], capture_output=True, text=True, timeout=60)
    assert human.returncode == 0 and "fragments" in human.stdout and "cli-status" in human.stdout
    assert "work merged" in human.stdout and "contributors/merge" in human.stdout
    watch = subprocess.Popen([*_DDILOCO, "status", "--watch", "--json", "--interval-s", "0.2", *target],
                             stdout=subprocess.PIPE, text=True)
    try:
        lines = [watch.stdout.readline() for _ in range(3)]
    finally:
        watch.kill()
        watch.wait(10)
    assert all(json.loads(line)["run_id"] == "cli-status" for line in lines)
    syncer.stop()
    down = subprocess.run([*_DDILOCO, "status", *target, "--timeout-s", "2"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 2 and "unavailable" in down.stdout and "Traceback" not in down.stdout + down.stderr


@pytest.mark.parametrize("service, env_var", [
    ("syncer", "DDILOCO_SYNCER_MIN_QUORUM"),
    ("learner", "DDILOCO_LEARNER_SYNCER"),
    ("checkpoint", "DDILOCO_CHECKPOINT_ROOT"),
    ("evaluate", "DDILOCO_EVAL_INTERVAL_S"),
])
def test_every_service_explains_its_options(service, env_var):
    result = subprocess.run([*_DDILOCO, service, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert env_var in result.stdout


def test_bad_configuration_is_a_clear_usage_error():
    result = subprocess.run([*_DDILOCO, "syncer", "--min-quorum", "0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "min_quorum" in result.stderr and "Traceback" not in result.stderr
    env = {**os.environ, "DDILOCO_SYNCER_UPLOAD_CODEC": "int3"}
    result = subprocess.run([*_DDILOCO, "syncer"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2 and "upload_codec" in result.stderr

