"""One run from a syncer split into fragment shards (issue 21): ddiloco.training_state's
merge_shard_states, cli.run_view (following TrainingState.shards to every shard, a down shard
shown down) and `ddiloco status` against two fake shard servers on 127.0.0.1:0.

Before the shard view, `ddiloco status` given one shard showed only that shard's fragments,
merges and uploads (half the run for two shards), and nothing said there were other shards.
"""

from __future__ import annotations

import argparse
import io
import json
from concurrent import futures

import grpc
import pytest
from rich.console import Console

from ddiloco import training_state as status_derived
from ddiloco.cli import render, run_view
from ddiloco.cli import status as status_cli
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc

pytestmark = pytest.mark.timeout(120)

ACTIVE = syncer_pb2.MemberState.STATUS_ACTIVE


def _map(addresses: list[list[str]], num_fragments: int = 4) -> list[syncer_pb2.SyncerShard]:
    n = len(addresses)
    return [syncer_pb2.SyncerShard(index=i, addresses=a, fragment_ids=list(range(i, num_fragments, n)))
            for i, a in enumerate(addresses)]


def _shard_state(index: int, shards, *, seen: float, step: int, accepted: int, merged_at: list[float]):
    """Shard `index` of 2 over 4 fragments: its own fragments, merges and uploads; the learners'
    progress (reported to every shard) as of `seen`."""
    owned = [f for f in range(4) if f % 2 == index]
    state = syncer_pb2.TrainingState(
        run_id="run", syncer_instance=f"inst{index}" * 4, started_at_unix_s=100.0 + index, now_unix_s=200.0 + index,
        outer_steps=10 * (index + 1), tokens_merged=1000 * (index + 1), bytes_in=5000 * (index + 1),
        bytes_out=7000 * (index + 1), tokens_processed=800 + index, token_budget=0,
        config=syncer_pb2.RunConfig(num_fragments=4), last_checkpoint_outer_step=4 * (index + 1),
        last_checkpoint_unix_s=150.0 + 10 * index, restored_from_checkpoint=index == 1,
        uploads={"accepted": accepted, "rejected_stale": index}, grace_window_s=1.0 + index, epoch=index,
        shards=shards, shard_index=index, quarantines=index,
    )
    for f in owned:
        state.fragments.add(fragment_id=f, version=5 + f, numel=100, params_sha256=f"{f}" * 64)
    for t, f in zip(merged_at, owned * 4):
        state.recent_merges.add(fragment_id=f, version=1, merged_at_unix_s=t, reason="quorum_grace",
                                contributors=[syncer_pb2.Contribution(learner_id="learner-0", weight=1.0)],
                                expected_contributors=2)
    state.members.add(learner_id="learner-0", incarnation=3, region="a", status=ACTIVE, last_seen_unix_s=seen,
                      local_step=step, tokens_total=400 + step, inner_loss=2.0 + step / 100, joins=1 + index,
                      uploads_accepted=accepted, uploads_rejected=index, bytes_in=100 * accepted,
                      bytes_out=10 * accepted, flags=1 << index, rejections={"stale": 1},
                      direction_agreement=0.2 if index == 0 else 0.6,
                      num_data_shards=2 if index == 0 else 0, data_shard=1 if index == 0 else 0)
    state.influence.add(learner_id="learner-0", merges=4, mean_share=0.5 if index == 0 else 0.25, max_share=0.5,
                        share_capped=index, clipped=0, window_merges=8)
    # The evaluator reports every evaluation to every shard: the same record on both.
    state.evals.add(at_unix_s=120.0 + index * 0.01, heldout_loss=3.0, tokens_merged=3000, outer_steps=30)
    return state


def _two_shards(shards=None):
    shards = shards if shards is not None else _map([["h:1"], ["h:2"]])
    s0 = _shard_state(0, shards, seen=190.0, step=40, accepted=6, merged_at=[110.0, 130.0, 150.0])
    s1 = _shard_state(1, shards, seen=195.0, step=42, accepted=2, merged_at=[120.0, 140.0, 160.0])
    return s0, s1


def test_merge_adds_what_each_shard_owns_and_keeps_the_progress_every_shard_shares():
    s0, s1 = _two_shards()
    run = status_derived.merge_shard_states([s1, s0])  # any order
    assert [f.fragment_id for f in run.fragments] == [0, 1, 2, 3]
    assert (run.outer_steps, run.tokens_merged, run.bytes_in, run.bytes_out) == (30, 3000, 15000, 21000)
    assert dict(run.uploads) == {"accepted": 8, "rejected_stale": 1}
    assert run.tokens_processed == 801  # the same work on every shard: never summed
    assert run.last_checkpoint_outer_step == 12 and run.last_checkpoint_unix_s == 150.0  # the oldest
    assert run.restored_from_checkpoint and run.quarantines == 1
    assert run.grace_window_s == pytest.approx(1.5)
    assert [r.merged_at_unix_s for r in run.recent_merges] == [140.0, 150.0, 160.0]
    assert [e.heldout_loss for e in run.evals] == [3.0]  # one evaluation, reported to both shards
    assert run.syncer_instance == "inst0inst0inst0inst0+inst1inst1inst1inst1"
    (m,) = run.members
    assert (m.local_step, m.tokens_total) == (42, 442)  # the freshest progress report (shard 1's)
    assert (m.uploads_accepted, m.uploads_rejected, m.bytes_in, m.bytes_out) == (8, 1, 800, 80)
    assert m.joins == 2 and m.flags == 3 and dict(m.rejections) == {"stale": 2}
    assert m.direction_agreement == pytest.approx((0.2 * 6 + 0.6 * 2) / 8)
    assert (m.num_data_shards, m.data_shard) == (2, 1)  # shard 0 assigns data shards
    (i,) = run.influence
    assert (i.merges, i.window_merges, i.share_capped) == (8, 16, 1) and i.mean_share == pytest.approx(0.375)
    # Work merged = tokens merged / (P x processed): 3000 / (4 x 801), not either shard's alone.
    assert status_derived.derived(run)["work_merged"] == pytest.approx(3000 / (4 * 801))


def test_an_unsharded_state_passes_through_untouched():
    state = syncer_pb2.TrainingState(run_id="r", outer_steps=3, config=syncer_pb2.RunConfig(num_fragments=2))
    state.fragments.add(fragment_id=0, version=3)

    def no_fetch(address):
        raise AssertionError(f"an unsharded syncer has no other shard to read ({address})")

    view = run_view.assemble(state, "h:1", no_fetch)
    assert view.state is state and view.shards == [] and not view.sharded
    assert status_derived.merge_shard_states([state]) is state
    assert "shard_status" not in json.loads(render.status_json(view.state, view.shards))
    assert _text(render.state_renderable(state, target="h:1")) == _text(
        render.state_renderable(view.state, target="h:1", shards=view.shards))
    assert "syncer shards" not in _text(render.state_renderable(state, target="h:1"))


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


def _text(renderable) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(renderable)
    return out.getvalue()


def test_a_down_shard_is_shown_down_and_the_run_is_made_of_the_others():
    s0, _ = _two_shards()

    def fetch(address):
        raise _Unavailable()

    view = run_view.assemble(s0, "h:1", fetch)
    assert [s.up for s in view.shards] == [True, False]
    assert view.shards[1].error == "h:2: UNAVAILABLE"
    assert [f.fragment_id for f in view.state.fragments] == [0, 2]
    text = _text(render.state_renderable(view.state, target="h:1", shards=view.shards))
    assert "2 shards, 1 up" in text and "down" in text and "syncer shards" in text
    assert "partial: 1 shard(s) down" in text  # the totals miss shard 1's part
    out = json.loads(render.status_json(view.state, view.shards))
    assert out["derived"]["shards_down"] == 1
    shard_status = out["shard_status"]
    assert [(s["index"], s["up"]) for s in shard_status] == [(0, True), (1, False)]
    assert shard_status[0]["fragment_ids"] == [0, 2] and shard_status[0]["address"] == "h:1"


def test_a_shard_with_failover_addresses_is_read_from_its_leader():
    shards = _map([["h:1"], ["s1a:1", "s1b:1"]])
    s0, s1 = _two_shards(shards)
    standby = syncer_pb2.TrainingState(run_id="run", epoch=0, shards=shards, shard_index=1)
    s1.epoch = 4
    answers = {"s1a:1": standby, "s1b:1": s1}
    view = run_view.assemble(s0, "h:1", answers.__getitem__)
    assert view.shards[1].address == "s1b:1" and view.shards[1].state is s1
    assert [f.fragment_id for f in view.state.fragments] == [0, 1, 2, 3]


class _FakeShard(syncer_pb2_grpc.SyncerServicer):
    def __init__(self) -> None:
        self.state = syncer_pb2.TrainingState()

    def GetTrainingState(self, request, context):  # noqa: N802 (gRPC naming)
        return syncer_pb2.GetTrainingStateResponse(state=self.state)


def _serve(fake: _FakeShard) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    syncer_pb2_grpc.add_SyncerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _status(address: str, capsys) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    status_cli.add_arguments(parser, default_target=address)
    rc = status_cli.run(parser.parse_args(["--json", "--timeout-s", "3"]))
    out = capsys.readouterr().out.strip().splitlines()
    return rc, json.loads(out[-1]) if out else {}


def test_status_given_one_shard_shows_the_whole_run_and_a_down_shard(capsys, monkeypatch):
    for name in ("DDILOCO_TLS_CA", "DDILOCO_TLS_CERT", "DDILOCO_TLS_KEY", "DDILOCO_AUTH_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    fakes = [_FakeShard(), _FakeShard()]
    servers = [_serve(f) for f in fakes]
    try:
        shards = _map([[servers[0][1]], [servers[1][1]]])
        fakes[0].state, fakes[1].state = _two_shards(shards)
        rc, out = _status(servers[1][1], capsys)  # any shard will do
        assert rc == 0
        assert [f.get("fragment_id", 0) for f in out["fragments"]] == [0, 1, 2, 3]
        assert out["outer_steps"] == "30" and [s["up"] for s in out["shard_status"]] == [True, True]
        servers[0][0].stop(None)
        rc, out = _status(servers[1][1], capsys)
        assert rc == 0 and [s["up"] for s in out["shard_status"]] == [False, True]
        assert [f.get("fragment_id", 0) for f in out["fragments"]] == [1, 3]
    finally:
        for server, _ in servers:
            server.stop(None)


def test_the_dashboard_shows_the_run_over_every_shard():
    from ddiloco.dashboard import Dashboard
    from tests.waits import wait_until

    fakes = [_FakeShard(), _FakeShard()]
    servers = [_serve(f) for f in fakes]
    try:
        shards = _map([[servers[0][1]], [servers[1][1]]])
        fakes[0].state, fakes[1].state = _two_shards(shards)
        with Dashboard(servers[0][1], bind="127.0.0.1:0", interval_s=0.1, timeout_s=2.0) as dashboard:
            wait_until(lambda: dashboard.state_json().get("available"), timeout_s=30, what="the dashboard's first poll")
            state = dashboard.state_json()
            assert [f["fragment_id"] for f in state["fragments"]] == [0, 1, 2, 3]
            assert state["outer_steps"] == 30 and [s["up"] for s in state["shard_status"]] == [True, True]
    finally:
        for server, _ in servers:
            server.stop(None)
