"""Work merged (tokens merged / (P x tokens processed)) and contributors per merge against the
learners each round waited for, as `ddiloco status` (table and --json), `ddiloco up`'s summary and
the syncer's Prometheus metrics report them, from synthetic TrainingStates."""

from __future__ import annotations

import asyncio
import json
import pathlib
import threading

import prometheus_client
import pytest
from rich.console import Console

from ddiloco import training_state as status_derived
from ddiloco.cli import render
from ddiloco.cli import up as up_lib
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import serde
from services.syncer import influence as influence_lib
from services.syncer import metrics as syncer_metrics


def _state(tokens_processed: int = 10_000) -> syncer_pb2.TrainingState:
    """P = 4, 10,000 tokens processed (every life), 30,000 merged: 75 %. The current members' own
    counters sum to 6,000 (learner-1 restarted), which would wrongly read 125 %."""
    s = syncer_pb2.TrainingState(run_id="synthetic", syncer_instance="s" * 32, now_unix_s=100.0, outer_steps=3,
                                 tokens_merged=30_000, tokens_processed=tokens_processed,
                                 config=syncer_pb2.RunConfig(num_fragments=4, upload_codec=serde.codec_to_proto("int4"),
                                                             download_codec=serde.codec_to_proto("fp32")))
    s.members.add(learner_id="learner-0", incarnation=1, tokens_total=5_000, local_step=50)
    s.members.add(learner_id="learner-1", incarnation=2, tokens_total=1_000, local_step=10)
    for f in range(4):
        s.fragments.add(fragment_id=f, version=3, numel=10, round=4 if f == 2 else 3, round_open=f == 2)

    def merge(fragment: int, held: int, expected: int, rnd: int) -> None:
        s.recent_merges.add(fragment_id=fragment, version=rnd, round=rnd, expected_contributors=expected,
                            reason="quorum_grace", contributors=[
                                syncer_pb2.Contribution(learner_id=f"learner-{i}", weight=1.0) for i in range(held)])

    merge(0, 2, 2, 1)
    merge(1, 1, 2, 1)
    merge(2, 2, 2, 3)
    return s


def test_derived_share_and_participation():
    d = status_derived.derived(_state())
    assert d["tokens_processed"] == 10_000 and d["tokens_processed_source"] == "syncer" and d["num_fragments"] == 4
    assert d["work_merged"] == pytest.approx(30_000 / (4 * 10_000))
    p = d["merge_participation"]
    assert p == {"merges": 3, "merges_with_expected": 3, "contributors_mean": pytest.approx(5 / 3),
                 "expected_contributors_mean": pytest.approx(2.0),
                 "contributors_per_expected": pytest.approx((1 + 0.5 + 1) / 3), "complete": 2}
    assert status_derived.fmt_participation(p) == "1.7 of 2.0 expected (83 %, 2/3 complete)"
    assert status_derived.fmt_share(d["work_merged"]) == "75.0 %"


def test_older_syncer_falls_back_to_the_members_tokens():
    state = _state(tokens_processed=0)
    del state.recent_merges[:]
    state.recent_merges.add(fragment_id=0, version=1, contributors=[syncer_pb2.Contribution(learner_id="a")])
    d = status_derived.derived(state)
    assert d["tokens_processed"] == 6_000 and d["tokens_processed_source"] == "members"
    assert d["work_merged"] == pytest.approx(30_000 / (4 * 6_000))
    p = d["merge_participation"]  # expected_contributors 0: unknown, not "0 expected"
    assert p["contributors_mean"] == 1 and p["expected_contributors_mean"] is None
    assert p["contributors_per_expected"] is None and p["merges_with_expected"] == 0
    assert status_derived.fmt_participation(p) == "1.0 (expected unknown)"
    empty = status_derived.derived(syncer_pb2.TrainingState())
    assert empty["work_merged"] is None and empty["merge_participation"]["contributors_mean"] is None


def test_status_json_reports_work_merged_and_rounds():
    out = json.loads(render.status_json(_state()))
    assert out["run_id"] == "synthetic" and out["tokens_processed"] == "10000"  # proto JSON: uint64 as a string
    assert out["derived"]["work_merged"] == pytest.approx(0.75)
    assert out["derived"]["tokens_processed"] == 10_000
    assert out["derived"]["merge_participation"]["contributors_per_expected"] == pytest.approx(2.5 / 3)
    assert out["derived"]["merge_participation"]["expected_contributors_mean"] == pytest.approx(2.0)
    # Every fragment carries its round and whether it is open, defaults included.
    assert [(f["round"], f["round_open"]) for f in out["fragments"]] == [
        ("3", False), ("3", False), ("4", True), ("3", False)]
    assert out["recent_merges"][1]["expected_contributors"] == 2 and out["recent_merges"][1]["round"] == "1"


def test_status_table_shows_work_merged_contributors_and_rounds():
    console = Console(width=220, record=True, color_system=None)
    console.print(render.state_renderable(_state(), target="127.0.0.1:1"))
    text = console.export_text()
    assert "work merged 75.0 %" in text
    assert "contributors/merge 1.7 of 2.0 expected (83 %, 2/3 complete)" in text
    assert "tokens processed 10,000 x P=4" in text
    assert "4 open" in text and "3 closed" in text  # fragment rounds
    assert "held/expected" in text and "1/2" in text and "2/2" in text
    old = Console(width=220, record=True, color_system=None)
    old.print(render.state_renderable(_state(tokens_processed=0)))
    assert "(members, this life)" in old.export_text()
    assert "budget" not in text  # no budget, none shown
    budget = _state()
    budget.token_budget = 12_000
    with_budget = Console(width=220, record=True, color_system=None)
    with_budget.print(render.state_renderable(budget))
    assert "tokens processed 10,000 x P=4 of budget 12,000" in with_budget.export_text()


def test_up_summary_prints_work_merged(tmp_path):
    class Cluster:
        workdir = tmp_path

        def learners(self):
            return []

    summary = up_lib._summary(_state(), None, Cluster(), 12.0)
    assert summary["work_merged"] == pytest.approx(0.75) and summary["tokens_processed"] == 10_000
    assert summary["merge_participation"]["complete"] == 2
    json.dumps(summary)  # written as summary.json
    console = Console(width=220, record=True, color_system=None)
    up_lib._print_summary(console, summary, False, [])
    assert "work merged: 75.0 %" in console.export_text()
    gone = up_lib._summary(None, None, Cluster(), 1.0)
    assert gone["work_merged"] is None
    up_lib._print_summary(Console(file=open(pathlib.Path(tmp_path) / "out.txt", "w")), gone, True, [])


class _FakeCore:
    """What SyncerMetrics reads: observers, the influence counts and a scrape (metrics.scrape_state,
    patched in the test to read `scrape`: the plain copy of the TrainingState this fake holds)."""

    def __init__(self, state: syncer_pb2.TrainingState) -> None:
        self.observers: list = []
        self.state = state
        self.influence_counts = influence_lib.Influence(run_id="run", instance="fake").counts  # the facade's name

    def observe(self, observer) -> None:
        self.observers.append(observer)

    @property
    def scrape(self) -> syncer_metrics.ScrapeState:
        s = self.state
        members = tuple(syncer_metrics.LearnerRow(
            learner_id=m.learner_id, region=m.region, status="active", quarantined=False, local_step=m.local_step,
            tokens_total=m.tokens_total, inner_loss=m.inner_loss, last_seen_unix_s=m.last_seen_unix_s)
            for m in s.members)
        return syncer_metrics.ScrapeState(
            outer_steps=s.outer_steps, min_quorum=s.config.min_quorum, num_fragments=s.config.num_fragments,
            fragments=tuple((f.fragment_id, f.version, 0) for f in s.fragments), tokens_merged=s.tokens_merged,
            tokens_processed=s.tokens_processed, bytes_in=0, bytes_out=0, uploads={}, auth_failures={},
            quarantines=0, direction_judgments={}, members=members, grace_window_s=0.0, step_time_s=0.0,
            quorum_time_s=0.0, sync_time_s=0.0, heldout_loss=None, last_checkpoint_outer_step=0)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_metrics_export_tokens_processed_work_merged_and_contributors(loop, monkeypatch):
    monkeypatch.setattr(syncer_metrics, "scrape_state", lambda core: core.scrape)
    core = _FakeCore(_state())
    registry = prometheus_client.CollectorRegistry()

    async def attach():
        return syncer_metrics.SyncerMetrics(core, registry)

    metrics = asyncio.run_coroutine_threadsafe(attach(), loop).result(10)
    for record in core.state.recent_merges:
        metrics.merged(record)

    def sample(name: str, **labels) -> float | None:
        return registry.get_sample_value(name, labels)

    assert sample("ddiloco_syncer_tokens_processed_total") == 10_000
    assert sample("ddiloco_work_merged_ratio") == pytest.approx(0.75)
    assert sample("ddiloco_goodput_ratio") == pytest.approx(0.75)  # the deprecated name, same value
    assert sample("ddiloco_syncer_last_merge_contributors", fragment="1") == 1
    assert sample("ddiloco_syncer_last_merge_expected_contributors", fragment="1") == 2
    assert sample("ddiloco_syncer_last_merge_contributors", fragment="2") == 2
    assert sample("ddiloco_syncer_merge_contributors_expected_ratio_count") == 3
    assert sample("ddiloco_syncer_merge_contributors_expected_ratio_sum") == pytest.approx(2.5)
    assert sample("ddiloco_syncer_merge_contributors_expected_ratio_bucket", le="0.5") == 1
    # An older syncer: no tokens_processed, the members' sum stands in; a merge without
    # expected_contributors is not observed as a ratio.
    core.state = _state(tokens_processed=0)
    metrics.merged(syncer_pb2.MergeRecord(fragment_id=3, contributors=[syncer_pb2.Contribution(learner_id="a")]))
    assert sample("ddiloco_syncer_tokens_processed_total") == 0
    assert sample("ddiloco_work_merged_ratio") == pytest.approx(30_000 / (4 * 6_000))
    assert sample("ddiloco_syncer_merge_contributors_expected_ratio_count") == 3
    # Before any token is processed there is no share to export.
    core.state = syncer_pb2.TrainingState(config=_state().config)
    assert sample("ddiloco_work_merged_ratio") is None
