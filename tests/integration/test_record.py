"""`ddiloco record` as a user runs it, against a real syncer process on 127.0.0.1:0, then `ddiloco report`
on the recording.

A small client drives the syncer the way learners and an evaluator do (Join, ReportProgress,
a restart with a higher incarnation, ReportEval) while the recorder runs as a subprocess; it is
stopped by SIGINT, SIGTERM or --duration-s and must leave the run directory `ddiloco report`
draws, with every life of the restarted learner counted. A syncer restart is recorded through;
syncers that do not answer end it with a clear message after bounded retries: exit 2 when the
syncer never answered, 1 when it stopped answering. Every wait has a
timeout; only processes started here are signalled, by PID.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest
from google.protobuf import json_format

from ddiloco.chaos import observe
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import serde
from tests.integration.conftest import TINY, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

_DDILOCO = [sys.executable, "-m", "ddiloco.cli.main"]
PV = serde.PROTOCOL_VERSION


def _records(path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _start_recorder(address: str, out, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*_DDILOCO, "record", "--target", address, "--out", str(out), "--interval-s", "0.2",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, sig: int | None, timeout_s: float = 30.0) -> tuple[int, str]:
    """Signals the recorder (if `sig`) and waits for it; kills it if it does not exit in time."""
    try:
        if sig is not None:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return proc.returncode, out + err


class _Learners:
    """Learner-shaped calls to the syncer (no training): progress, restarts, evaluations."""

    def __init__(self, address: str) -> None:
        self.channel = channel_lib.sync_channel(address)
        self.stub = syncer_pb2_grpc.SyncerStub(self.channel)

    def join(self, learner_id: str, incarnation: int) -> None:
        self.stub.Join(syncer_pb2.JoinRequest(protocol_version=PV, learner_id=learner_id, incarnation=incarnation,
                                              region="region-a", tokens_per_step=100), timeout=10)

    def progress(self, learner_id: str, incarnation: int, step: int) -> None:
        self.stub.ReportProgress(syncer_pb2.ReportProgressRequest(
            protocol_version=PV, learner_id=learner_id, incarnation=incarnation, local_step=step,
            tokens_total=100 * step, step_time_s=0.05, inner_loss=5.0 - 0.01 * step), timeout=10)

    def evaluate(self, loss: float) -> None:
        self.stub.ReportEval(syncer_pb2.ReportEvalRequest(protocol_version=PV, evaluator_id="test", heldout_loss=loss),
                             timeout=10)

    def close(self) -> None:
        self.channel.close()


def test_record_any_cluster_then_report_counts_every_life(cluster, tmp_path):
    syncer = cluster.start_syncer(run_id="record-test", extra=TINY)
    out = tmp_path / "recording"
    recorder = _start_recorder(syncer.address, out)
    learners = _Learners(syncer.address)
    try:
        wait_until(lambda: _records(out / "state.jsonl"), timeout_s=60, what="the first recorded snapshot")
        learners.join("learner-a", 1)
        learners.join("learner-b", 1)
        learners.evaluate(5.5)
        for step in range(1, 11):  # life 1 of learner-a: 10 steps, 1000 tokens
            learners.progress("learner-a", 1, step)
            learners.progress("learner-b", 1, step)
            time.sleep(0.1)
        # The recorder sees what the snapshots show: let it see the end of learner-a's first life.
        wait_until(lambda: any(m["id"] == "learner-a" and m["tokens"] == 1000
                               for r in _records(out / "state.jsonl") for m in r["members"]),
                   timeout_s=30, what="learner-a's first life at 1000 tokens in the recording")
        learners.join("learner-a", 2)  # learner-a restarts: its counters begin again at 0
        for step in range(1, 4):
            learners.progress("learner-a", 2, step)
            time.sleep(0.1)
        learners.evaluate(5.0)

        def restarted_life_recorded():
            last = (_records(out / "state.jsonl") or [{"members": []}])[-1]
            return last.get("heldout_loss") == 5.0 and any(
                m["id"] == "learner-a" and m["inc"] == 2 and m["tokens"] == 300 for m in last["members"])

        wait_until(restarted_life_recorded, timeout_s=30, what="the restarted learner and the last evaluation recorded")
    finally:
        learners.close()
        code, output = _finish(recorder, signal.SIGINT)
    assert code == 0, output
    assert "Traceback" not in output and "ddiloco report" in output
    records = _records(out / "state.jsonl")
    assert {r["run"] for r in records} == {"record-test"}
    assert records[-1]["tokens_processed"] == 1000 + 300 + 1000  # the syncer's count: every life
    final = json_format.Parse((out / "final_state.json").read_text(), syncer_pb2.TrainingState())
    assert final.run_id == "record-test" and [e.heldout_loss for e in final.evals] == [5.5, 5.0]

    report = subprocess.run([*_DDILOCO, "report", str(out)], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stdout + report.stderr
    for name in ("loss.png", "bytes.png", "versions.png", "work_merged.png"):
        assert (out / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    index = (out / "report" / "index.md").read_text()
    assert "run `record-test`" in index and "tokens processed (every life of every learner): 2,300" in index
    assert "| learner-a | 2 | 2 | 13 | 1,300 |" in index and "| learner-b | 1 | 1 | 10 | 1,000 |" in index

    # An existing recording is continued only when asked; SIGTERM and --duration-s stop cleanly too.
    again = subprocess.run([*_DDILOCO, "record", "--target", syncer.address, "--out", str(out)],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "--append" in again.stderr
    appended = _start_recorder(syncer.address, out, "--append")
    wait_until(lambda: len(_records(out / "state.jsonl")) > len(records), timeout_s=30, what="appended snapshots")
    code, output = _finish(appended, signal.SIGTERM)
    assert code == 0, output
    timed = subprocess.run([*_DDILOCO, "record", "--target", syncer.address, "--out", str(tmp_path / "timed"),
                            "--interval-s", "0.2", "--duration-s", "2"], capture_output=True, text=True, timeout=60)
    assert timed.returncode == 0, timed.stdout + timed.stderr
    assert _records(tmp_path / "timed" / "state.jsonl") and (tmp_path / "timed" / "final_state.json").exists()



def test_record_goes_through_a_syncer_restart_and_gives_up_on_a_syncer_gone(cluster, tmp_path):
    syncer = cluster.start_syncer(run_id="record-restarts", extra=TINY)
    # A syncer restart is recorded through: the recorder retries (bounded) until the new life answers.
    through = _start_recorder(syncer.address, tmp_path / "through")
    try:
        wait_until(lambda: _records(tmp_path / "through" / "state.jsonl"), timeout_s=30, what="a snapshot")
        syncer.stop()
        syncer.start()
        syncer.wait_ready(120)
        wait_until(lambda: len({r["instance"] for r in _records(tmp_path / "through" / "state.jsonl")}) == 2,
                   timeout_s=60, what="snapshots of the restarted syncer")
    finally:
        code, output = _finish(through, signal.SIGINT)
    assert code == 0 and "retrying" in output and "Traceback" not in output, output
    report = subprocess.run([*_DDILOCO, "report", str(tmp_path / "through")], capture_output=True, text=True,
                            timeout=120)
    assert report.returncode == 0 and "2 syncer lives" in (tmp_path / "through" / "report" / "index.md").read_text()

    # The syncer goes away mid-recording: the recorder retries for --retry-for-s, then exits 1
    # keeping what it recorded.
    lost = _start_recorder(syncer.address, tmp_path / "lost", "--retry-for-s", "3", "--timeout-s", "1")
    try:
        wait_until(lambda: _records(tmp_path / "lost" / "state.jsonl"), timeout_s=30, what="a snapshot")
    finally:
        syncer.stop()
    code, output = _finish(lost, None, timeout_s=60)
    assert code == 1, output
    assert "no answer since the last snapshot" in output and "Traceback" not in output
    assert _records(tmp_path / "lost" / "state.jsonl") and (tmp_path / "lost" / "final_state.json").exists()

    # Nobody answers at all: a bounded wait, a clear message, exit 2, no files.
    started = time.monotonic()
    never = subprocess.run([*_DDILOCO, "record", "--target", syncer.address, "--out", str(tmp_path / "never"),
                            "--retry-for-s", "2", "--timeout-s", "1"], capture_output=True, text=True, timeout=60)
    assert never.returncode == 2, never.stdout + never.stderr
    assert "no answer from syncer" in never.stderr and "unavailable" in never.stderr
    assert "Traceback" not in never.stdout + never.stderr and time.monotonic() - started < 30
    assert not (tmp_path / "never" / "state.jsonl").exists()
    short = subprocess.run([*_DDILOCO, "record", "--target", syncer.address, "--out", str(tmp_path / "short"),
                            "--duration-s", "1.5"], capture_output=True, text=True, timeout=60)
    assert short.returncode == 2 and "no answer from syncer" in short.stderr and "within --duration-s" in short.stderr


def test_a_syncer_that_accepts_connections_but_never_answers_is_given_up_on(tmp_path):
    # A listening socket that never speaks gRPC: a hung syncer, or a proxy with nothing behind it.
    # The recorder's watchdog cancels each silent stream, and the retries end with --retry-for-s.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        result = subprocess.run([*_DDILOCO, "record", "--target", address, "--out", str(tmp_path / "silent"),
                                 "--retry-for-s", "3", "--timeout-s", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no answer from syncer" in result.stderr and "sent nothing within --timeout-s 1" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr and time.monotonic() - started < 30


def test_record_a_run_split_into_two_fragment_shards_through_either_shard_records_both(cluster, tmp_path):
    """Pointed at shard 1 of 2, the recording holds the run: both shards' fragments and instances,
    and the learner's progress as both shards count it. Before run_view was used here, only shard
    1's fragments (1 and 3) were recorded. The chaos harness's poller reads the run the same way."""
    shards = cluster.start_syncer_shards(2, run_id="record-shards", extra=TINY)
    out = tmp_path / "recording"
    recorder = _start_recorder(shards[1].address, out)
    learners = [_Learners(s.address) for s in shards]
    try:
        for shard in learners:  # as a learner does: every shard
            shard.join("learner-a", 1)
        for step in range(1, 6):
            for shard in learners:
                shard.progress("learner-a", 1, step)
        wait_until(lambda: any(m["tokens"] == 500 for r in _records(out / "state.jsonl") for m in r["members"]),
                   timeout_s=60, what="learner-a at 500 tokens in the recording")
        poller = observe.Poller(shards[1].address, interval_s=0.2)
        poller.start()
        try:
            wait_until(lambda: poller.lives.get(("learner-a", 1), {}).get("tokens") == 500, timeout_s=30,
                       what="the chaos poller seeing learner-a")
            assert sorted(f.fragment_id for f in poller.state().fragments) == [0, 1, 2, 3]
        finally:
            poller.stop()
    finally:
        for shard in learners:
            shard.close()
        code, output = _finish(recorder, signal.SIGINT)
    assert code == 0, output
    records = _records(out / "state.jsonl")
    assert len(records[-1]["versions"]) == 4 and records[-1]["instance"].count("+") == 1, records[-1]
    final = json_format.Parse((out / "final_state.json").read_text(), syncer_pb2.TrainingState())
    assert sorted(f.fragment_id for f in final.fragments) == [0, 1, 2, 3]
    assert final.syncer_instance == "+".join(json.loads(s.ready_file.read_text())["instance"] for s in shards)
    assert [m.learner_id for m in final.members] == ["learner-a"]
