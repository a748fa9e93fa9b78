"""The dashboard server against a fake syncer (a real gRPC server on 127.0.0.1:0)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent import futures

import grpc
import pytest

from ddiloco.dashboard import Dashboard, parse_bind
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from tests.waits import wait_until

pytestmark = pytest.mark.timeout(120)


class FakeSyncer(syncer_pb2_grpc.SyncerServicer):
    """Answers GetTrainingState with a state that advances by one merge per call."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def GetTrainingState(self, request, context):  # noqa: N802 (gRPC naming)
        with self.lock:
            self.calls += 1
            n = self.calls
        state = syncer_pb2.TrainingState(
            run_id="fake-run", syncer_instance="f" * 32, started_at_unix_s=time.time() - 60, now_unix_s=time.time(),
            outer_steps=n, tokens_merged=4 * 100 * n, bytes_in=1000 * n, bytes_out=3000 * n,
            tokens_processed=250 * n,  # every life: more than the members' 2 x 100n (a restarted learner)
            config=syncer_pb2.RunConfig(num_fragments=4),
            uploads={"accepted": n, "rejected_stale": 1},
        )
        for i in range(2):
            state.members.add(
                learner_id=f"learner-{i}", incarnation=7, region="region-a", status=syncer_pb2.MemberState.STATUS_ACTIVE,
                last_seen_unix_s=time.time(), local_step=10 * n, tokens_total=100 * n, inner_loss=float("nan") if i else 2.5,
                uploads_accepted=n, uploads_rejected=0, joins=1, bytes_in=11_000 * n, bytes_out=130_000 * n,
            )
        for f in range(4):
            state.fragments.add(fragment_id=f, version=n, numel=1000, params_sha256="ab" * 32, round=n + 1,
                                round_open=f == 0)
        state.recent_merges.add(fragment_id=1, version=n, merged_at_unix_s=time.time(), reason="quorum_grace",
                                contributors=[syncer_pb2.Contribution(learner_id="learner-0", weight=1.0)],
                                expected_contributors=2, round=n)
        state.recent_merges.add(fragment_id=0, version=n, merged_at_unix_s=time.time(), reason="all_contributed",
                                contributors=[syncer_pb2.Contribution(learner_id="learner-0", weight=3.0),
                                              syncer_pb2.Contribution(learner_id="learner-1", weight=1.0)],
                                expected_contributors=2, round=n)
        state.evals.add(at_unix_s=1000.0 + n, heldout_loss=5.0 - 0.1 * n, tokens_merged=400 * n, outer_steps=n)
        return syncer_pb2.GetTrainingStateResponse(state=state)


def _serve(port: int = 0) -> tuple[grpc.Server, int, FakeSyncer]:
    fake = FakeSyncer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    syncer_pb2_grpc.add_SyncerServicer_to_server(fake, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    assert bound, f"could not bind 127.0.0.1:{port}"
    server.start()
    return server, bound, fake


def _get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), resp.read()


def _json(url: str) -> dict:
    def no_nan(name):
        raise AssertionError(f"invalid JSON constant {name}")

    return json.loads(_get(url)[2], parse_constant=no_nan)


@pytest.fixture
def fake_syncer():
    server, port, fake = _serve()
    try:
        yield server, port, fake
    finally:
        server.stop(grace=None)


def test_state_history_page_and_health(fake_syncer):
    _, port, _ = fake_syncer
    with Dashboard(f"127.0.0.1:{port}", bind="127.0.0.1:0", interval_s=0.05, timeout_s=5) as dash:
        assert dash.url.startswith("http://127.0.0.1:") and dash.port != 0
        base = dash.url.rstrip("/")
        state = wait_until(lambda: (s := _json(base + "/api/state"))["available"] and s, timeout_s=20,
                           what="a first state")
        assert state["target"] == f"127.0.0.1:{port}" and isinstance(state["fetched_at"], float)
        assert state["run_id"] == "fake-run" and state["error"] == ""
        assert isinstance(state["outer_steps"], int) and state["outer_steps"] >= 1  # uint64 as a number
        assert [m["learner_id"] for m in state["members"]] == ["learner-0", "learner-1"]
        assert state["members"][0]["status"] == "STATUS_ACTIVE" and state["members"][0]["inner_loss"] == 2.5
        assert len(state["fragments"]) == 4 and state["recent_merges"][1]["contributors"][1]["weight"] == 1.0
        assert state["fragments"][0]["round_open"] is True and state["fragments"][1]["round_open"] is False
        assert state["fragments"][1]["round"] == state["outer_steps"] + 1
        assert state["recent_merges"][1]["expected_contributors"] == 2
        assert state["evals"] and state["uploads"]["rejected_stale"] == 1
        # Work merged: tokens merged / (P * tokens processed) = 4*100n / (4 * 250n), with the syncer's
        # tokens_processed (every life), not the members' tokens_total (2 * 100n).
        derived = state["derived"]
        assert derived["tokens_processed"] == state["tokens_processed"] == 250 * state["outer_steps"]
        assert derived["tokens_processed_source"] == "syncer" and derived["num_fragments"] == 4
        assert derived["work_merged"] == pytest.approx(0.4) and "goodput" not in derived
        # Contributors per merge against the learners each round waited for: 1 of 2, then 2 of 2.
        participation = derived["merge_participation"]
        assert participation["merges"] == 2 and participation["complete"] == 1
        assert participation["contributors_mean"] == pytest.approx(1.5)
        assert participation["expected_contributors_mean"] == pytest.approx(2.0)
        assert participation["contributors_per_expected"] == pytest.approx(0.75)
        assert state["sample"]["work_merged"] == pytest.approx(0.4)
        first = state["outer_steps"]
        wait_until(lambda: _json(base + "/api/state")["outer_steps"] > first, timeout_s=20, what="a newer state")

        history = _json(base + "/api/history")
        n = len(history["samples"])
        assert n >= 2 and history["max_samples"] == 3600 and history["run_id"] == "fake-run"
        sample = history["samples"][-1]
        assert {"t", "outer_steps", "tokens_merged", "tokens_processed", "work_merged", "contributors_per_expected",
                "bytes_in", "bytes_out", "inner_loss", "syncer_instance"} <= set(sample)
        assert sample["inner_loss"]["learner-1"] is None  # NaN is not JSON: null
        assert [s["t"] for s in history["samples"]] == sorted(s["t"] for s in history["samples"])
        assert len(history["evals"]) >= 2  # accumulated across polls, not only the syncer's last list
        wait_until(lambda: len(_json(base + "/api/history")["samples"]) > n, timeout_s=20, what="the history to grow")

        status, ctype, body = _get(base + "/")
        assert status == 200 and ctype == "text/html; charset=utf-8"
        html = body.decode()
        for needed in ('id="outer-steps"', 'id="learners"', 'id="plot-heldout"', 'id="plot-work-merged"',
                       'id="work-merged"', 'id="contributors-per-merge"', 'id="plot-bandwidth"', "/api/state",
                       "/api/history", ">work merged<", "held / expected"):
            assert needed in html
        assert ">goodput<" not in html.lower()  # the KPI is not the paper's goodput (a share of wall time)
        # Self-contained: no external scripts, styles, fonts or images (the SVG namespace is a name, not a fetch).
        html = html.replace("http://www.w3.org/2000/svg", "")
        assert "http://" not in html and "https://" not in html and "src=" not in html and "<link" not in html

        health = _json(base + "/healthz")
        assert health == {"ok": True, "syncer_available": True, "target": f"127.0.0.1:{port}"}
        with pytest.raises(urllib.error.HTTPError) as err:
            _get(base + "/nope")
        assert err.value.code == 404


def test_syncer_down_then_back():
    server, port, _ = _serve()
    dash = Dashboard(f"127.0.0.1:{port}", bind="127.0.0.1:0", interval_s=0.05, timeout_s=2, max_backoff_s=0.3)
    dash.start()
    try:
        base = dash.url.rstrip("/")
        wait_until(lambda: _json(base + "/api/state")["available"], timeout_s=20, what="available")
        server.stop(grace=None).wait(10)
        down = wait_until(lambda: (s := _json(base + "/api/state"))["available"] is False and s, timeout_s=20,
                          what="unavailable")
        assert down["error"] and down["run_id"] == "fake-run"  # the last state seen stays visible
        assert down["last_ok_at"] <= down["fetched_at"]
        assert _json(base + "/healthz")["syncer_available"] is False
        assert _get(base + "/")[0] == 200  # the page is still served
        polls = dash._polls
        wait_until(lambda: dash._polls > polls + 2, timeout_s=20, what="polling to continue while the syncer is down")
        server, _, _ = _serve(port)  # the syncer comes back at the same address
        wait_until(lambda: _json(base + "/api/state")["available"], timeout_s=20, what="available again")
    finally:
        dash.stop()
        server.stop(grace=None)


def test_never_reachable_syncer_reports_unavailable():
    with Dashboard("127.0.0.1:1", bind="127.0.0.1:0", interval_s=0.05, timeout_s=1, max_backoff_s=0.2) as dash:
        state = wait_until(lambda: (s := _json(dash.url + "api/state"))["fetched_at"] and s, timeout_s=20,
                           what="a failed poll")
        assert state["available"] is False and "UNAVAILABLE" in state["error"] and state["last_ok_at"] is None
        assert len(_json(dash.url + "api/history")["samples"]) == 0


def test_work_merged_without_the_syncers_count_sums_every_life_of_a_learner():
    """A syncer that predates TrainingState.tokens_processed (0): every life seen is summed."""
    dash = Dashboard("127.0.0.1:1")  # not started: _record is fed directly

    def state(incarnation: int, tokens: int, merged: int) -> syncer_pb2.TrainingState:
        s = syncer_pb2.TrainingState(run_id="r", tokens_merged=merged, config=syncer_pb2.RunConfig(num_fragments=2))
        s.members.add(learner_id="learner-0", incarnation=incarnation, tokens_total=tokens, local_step=1)
        return s

    dash._record(state(1, 1000, 1000), 1.0)
    dash._record(state(2, 100, 2000), 2.0)  # restarted: its counter began again at 0
    samples = dash.history_json()["samples"]
    assert [s["tokens_processed"] for s in samples] == [1000, 1100]
    assert samples[-1]["work_merged"] == pytest.approx(2000 / (2 * 1100))
    assert dash.state_json()["derived"]["tokens_processed_source"] == "members"
    dash._record(syncer_pb2.TrainingState(run_id="another"), 3.0)  # another run: series start again
    assert len(dash.history_json()["samples"]) == 1 and dash.history_json()["samples"][0]["work_merged"] is None


def test_work_merged_uses_the_syncers_tokens_processed():
    dash = Dashboard("127.0.0.1:1")
    s = syncer_pb2.TrainingState(run_id="r", tokens_merged=3000, tokens_processed=2000,
                                 config=syncer_pb2.RunConfig(num_fragments=2))
    s.members.add(learner_id="learner-0", incarnation=2, tokens_total=100, local_step=1)  # this life only
    dash._record(s, 1.0)
    derived = dash.state_json()["derived"]
    assert derived["tokens_processed"] == 2000 and derived["tokens_processed_source"] == "syncer"
    assert derived["work_merged"] == pytest.approx(3000 / (2 * 2000))
    assert derived["merge_participation"]["contributors_mean"] is None  # no merge yet


def test_parse_bind():
    assert parse_bind("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_bind("0.0.0.0:8080") == ("0.0.0.0", 8080)
    assert parse_bind("[::1]:9000") == ("::1", 9000)
    assert parse_bind(":8080") == ("127.0.0.1", 8080)
    for bad in ("8080", "host:", "host:x", "host:70000"):
        with pytest.raises(ValueError):
            parse_bind(bad)
