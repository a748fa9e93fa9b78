"""Back-pressure from a saturated syncer reaches a real learner client, which keeps its work.

A real syncer process (`python -m services.syncer` on 127.0.0.1:0, shipped defaults) is saturated
by taking its CPU away: SIGSTOP/SIGCONT cycles (stopped two thirds of the time, as on a machine
whose cores are taken), which its event loop sees as lag (services.syncer.backpressure), while
other learners' uploads are in flight (two streams that sent their header and wait: without
uploads contending, lag is the machine's, not the syncer's, and nobody is slowed). The
learner's real SyncClient uploads through it: the accepted upload's response asks it to wait,
the client holds its next upload of that fragment for that long, and a newer pseudo-gradient
queued meanwhile replaces the held one (the periods in between go out as one contribution: its
work is kept), which the syncer accepts after the hold. Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from ddiloco.bench import perf, perf_common
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import security
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from ddiloco.learner import client as client_lib
from tests.waits import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STEP_TIME_S = 0.25  # what the learner reports: the syncer's period for a fragment is 8 steps of it


class _Starver:
    """Stops and continues one process (by PID) in cycles until `stop`; leaves it running."""

    def __init__(self, pid: int, stopped_s: float = 0.1, running_s: float = 0.05) -> None:
        self._pid, self._stopped_s, self._running_s = pid, stopped_s, running_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self._pid, signal.SIGSTOP)
                time.sleep(self._stopped_s)
                os.kill(self._pid, signal.SIGCONT)
                self._done.wait(self._running_s)
        finally:
            os.kill(self._pid, signal.SIGCONT)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(10)


class _Trainer:
    """Reports a learner's progress as its training loop does: one step every STEP_TIME_S."""

    def __init__(self, client) -> None:
        self._client = client
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        step = 0
        while not self._done.wait(STEP_TIME_S):
            step += 1
            self._client.set_progress(syncer_pb2.ReportProgressRequest(
                protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-0", incarnation=1, local_step=step,
                step_time_s=STEP_TIME_S))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(10)


def _contending_uploads(address: str, numel: int, release: threading.Event) -> tuple:
    """Two other learners' uploads held open after their header (they count as in flight)."""
    channel = channel_lib.sync_channel(address)
    stub = syncer_pb2_grpc.SyncerStub(channel)
    enc = codec_lib.encode(np.zeros(numel, np.float32), "int4")
    calls = []
    for i in range(2):
        learner_id = f"contender-{i}"
        join = stub.Join(syncer_pb2.JoinRequest(protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id,
                                                incarnation=1), timeout=10)
        header = syncer_pb2.UploadHeader(
            protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=1, fragment_id=1,
            base_version=0, syncer_instance=join.syncer_instance, steps=8, tokens=512,
            payload=serde.payload_info_to_proto(enc))

        def requests(header=header):
            yield syncer_pb2.UploadFragmentRequest(header=header)
            release.wait(60)

        calls.append(stub.UploadFragment.future(requests(), timeout=60))
    return channel, calls


def _job(client, fid: int, base: int, steps: int, local_step: int, numel: int) -> client_lib.UploadJob:
    delta = (np.random.default_rng(local_step).standard_normal(numel) * 1e-4).astype(np.float32)
    return client_lib.UploadJob(fragment_id=fid, base_version=base, syncer_instance=client.instance, steps=steps,
                                tokens=steps * 64, delta=delta, local_step=local_step)


def test_a_saturated_syncer_slows_a_real_learner_which_keeps_its_work(tmp_path):
    with perf_common.running_syncer(tmp_path, "backpressure", perf.QUICK_MODEL, ["--liveness-timeout-s", "120"]) as syncer:
        client = client_lib.SyncClient(client_lib.ClientConfig(
            target=syncer.address, learner_id="learner-0", incarnation=1, region="r", tokens_per_step=64,
            call_timeout_s=30.0, retry_bound_s=60.0, security=security.ClientSecurity(insecure=True)))
        starver = _Starver(syncer.pid)
        trainer = _Trainer(client)
        release = threading.Event()
        channel, contenders = None, []
        try:
            client.start(60.0)
            numel = client.run_config.fragments[0].numel
            trainer.start()
            channel, contenders = _contending_uploads(syncer.address, client.run_config.fragments[1].numel, release)
            starver.start()
            time.sleep(3.0)  # the syncer's loop lags for a while: it counts as saturated
            client.submit_upload(_job(client, 0, 0, steps=8, local_step=8, numel=numel))
            outcomes = []
            wait_until(lambda: outcomes.extend(client.take_outcomes()) or outcomes, timeout_s=60,
                       what="the first upload's outcome")
            starver.stop()
            release.set()
            for call in contenders:
                call.cancel()
            assert [o.result for o in outcomes] == [client_lib.OUTCOME_ACCEPTED], outcomes
            assert client.stats.uploads_slowed == 1, vars(client.stats)
            hold_s = client.stats.last_upload_hold_s
            accepted_at = time.monotonic()
            assert hold_s > 1.0, vars(client.stats)  # more than the fragment's period is folded in
            # The merged version arrives; the next periods' work is based on it.
            wait_until(lambda: client.held_values().get(0, (0, None))[0] >= 1, timeout_s=60,
                       what="fragment 0's next version")
            base = client.held_values()[0][0]
            client.submit_upload(_job(client, 0, base, steps=8, local_step=16, numel=numel))
            time.sleep(min(0.5, hold_s / 3))
            assert client.stats.uploads_accepted == 1 and not client.take_outcomes()  # held, not sent
            # The next period's pseudo-gradient, holding both periods' work, replaces the held one.
            client.submit_upload(_job(client, 0, base, steps=16, local_step=24, numel=numel))
            wait_until(lambda: outcomes.extend(client.take_outcomes()) or len(outcomes) >= 3, timeout_s=90,
                       what="the held and the merged contributions' outcomes")
            assert [(o.local_step, o.result) for o in outcomes[1:]] == [
                (16, client_lib.OUTCOME_NOT_TAKEN), (24, client_lib.OUTCOME_ACCEPTED)], outcomes
            assert time.monotonic() - accepted_at >= hold_s - 0.2  # sent no sooner than the syncer asked
            assert client.stats.uploads_refused == 0 and client.stats.uploads_accepted == 2, vars(client.stats)
            state = syncer_pb2_grpc.SyncerStub(channel).GetTrainingState(
                syncer_pb2.GetTrainingStateRequest(), timeout=10).state
            assert state.uploads["accepted"] == 2 and state.uploads["slowed"] >= 1, dict(state.uploads)
            # The only refusals: the two contending streams, cancelled before their last chunk.
            assert {k: v for k, v in state.uploads.items() if k.startswith("rejected_") and v} == {
                "rejected_chunks": 2}, dict(state.uploads)
        finally:
            release.set()
            starver.stop()
            trainer.stop()
            for call in contenders:
                call.cancel()
            if channel is not None:
                channel.close()
            client.close(leave=True)
