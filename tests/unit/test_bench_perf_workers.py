"""The job protocol of `ddiloco bench perf`'s workers (ddiloco/bench/perf_common.py): a worker that
fails is reported with its log, and one that runs over its time is stopped, not left behind.

Starts worker processes (`python -m ddiloco.bench.perf_workers.replay`) with no syncer behind them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ddiloco.bench import perf_common

REPLAY = "ddiloco.bench.perf_workers.replay"


def test_a_failing_worker_is_reported_with_the_tail_of_its_log(tmp_path):
    # No "captured" in the spec: the worker fails on its first line of work.
    with pytest.raises(RuntimeError, match=r"(?s)benchmark worker replay-bad failed \(1\).*KeyError: 'captured'"):
        perf_common.run_worker(tmp_path, "replay-bad", REPLAY, {}, timeout_s=120)
    assert not (tmp_path / "replay-bad.result.json").exists()


def test_a_worker_over_its_time_is_stopped_and_its_pid_recorded(tmp_path):
    np.savez(tmp_path / "captured.npz", f0_0=np.zeros(256, np.float32))
    # Nothing listens on the address; the replay sleeps through its `seconds` whatever its learners do.
    spec = {"address": "127.0.0.1:1", "captured": str(tmp_path / "captured.npz"), "ids": 1, "first": 0,
            "seconds": 600.0, "step_s": 0.25, "sync_period_steps": 8, "chunk_size": 1024, "flush_s": 0.0}
    svc = perf_common.start_worker(tmp_path, "replay-slow", REPLAY, spec)
    with pytest.raises(RuntimeError, match="did not finish within 5 s"):
        perf_common.worker_result(svc, timeout_s=5)
    assert not svc.alive()
    assert json.loads((tmp_path / "pids.json").read_text()) == {"replay-slow": [svc.pid]}
