"""The pure parts of `ddiloco bench perf`'s scale and sizes sections: model sizes from a parameter
count, each fragment's upload routed to its owner shard by a replay learner (fake stubs, no
network), figures added up over shards, and the model-size table beside a previous run's.
"""

from __future__ import annotations

import asyncio
import types

import pytest

from ddiloco.bench import perf_report, perf_scale
from ddiloco.bench.perf_workers import replay
from ddiloco.learner import client as client_lib
from ddiloco.learner import progress
from ddiloco.v1 import syncer_pb2


def test_parameter_counts_parse_and_name_rows():
    assert [perf_scale.parse_params(x) for x in ("0.5M", "100M", "1B", "30k", "4e6")] == [
        500_000, 100_000_000, 1_000_000_000, 30_000, 4_000_000]
    assert [perf_scale.params_label(n) for n in (478_464, 99_400_000, 1_019_000_000, 30_000)] == [
        "0.5M", "99M", "1.0B", "30k"]
    for bad in ("", "-1M", "0", "xM", "nanB"):
        with pytest.raises(ValueError):
            perf_scale.parse_params(bad)


@pytest.mark.parametrize("size, low, high", [("30k", 20e3, 40e3), ("0.5M", 0.4e6, 0.6e6), ("100M", 95e6, 105e6),
                                             ("1B", 1.0e9, 1.1e9)])
def test_a_synthetic_model_has_about_the_parameters_asked_for(size, low, high):
    # Shapes only (no parameters are built): the 1B row is at least 1B parameters.
    numels = perf_scale.fragment_numels(perf_scale.model_for_params(perf_scale.parse_params(size)))
    assert len(numels) == perf_scale.NUM_FRAGMENTS
    assert low <= sum(numels.values()) <= high


def test_the_default_model_is_the_half_million_row():
    assert perf_scale.model_for_params(perf_scale.parse_params("0.5M")) == {"preset": "small"}


class _FakeStub:
    """A syncer shard's Join: answers with `shards` (the map) and its own index; records who joined."""

    def __init__(self, index: int, shards: list) -> None:
        self.index, self.shards, self.joined = index, shards, []

    async def Join(self, request, timeout):  # noqa: N802 - the gRPC method's name
        self.joined.append(request.learner_id)
        return syncer_pb2.JoinResponse(syncer_instance=f"life-{self.index}", shards=self.shards,
                                       shard_index=self.index)


def _shard_map() -> list:
    return [syncer_pb2.SyncerShard(index=0, addresses=["a:1"], fragment_ids=[0, 2]),
            syncer_pb2.SyncerShard(index=1, addresses=["b:1", "b2:1"], fragment_ids=[1, 3])]


def test_a_replay_learner_joins_every_shard_and_sends_each_fragment_to_its_owner():
    shards = _shard_map()
    first, second = _FakeStub(0, shards), _FakeStub(1, shards)
    asked = []

    def stub_for(address):
        asked.append(address)
        return second

    learner = replay.ShardedLearner(first, "replay-7", stub_for)
    asyncio.run(learner.join(5))
    assert asked == ["b:1"]  # the owner's first address, once
    assert first.joined == second.joined == ["replay-7"]  # the same learner on both shards
    assert [learner.of(f).stub for f in range(4)] == [first, second, first, second]
    assert [learner.of(f).shard_index for f in range(4)] == [0, 1, 0, 1]
    assert learner.of(1).instance == "life-1"  # its uploads name the owner's life, not shard 0's
    assert [i.shard_index for i in learner.identities] == [0, 1]  # both watched and told the progress


def test_an_unsharded_syncer_gets_every_fragment_from_one_identity():
    only = _FakeStub(0, [])
    learner = replay.ShardedLearner(only, "replay-0", lambda address: pytest.fail(f"asked for {address}"))
    asyncio.run(learner.join(5))
    assert replay.owner_map([]) == {}
    assert {learner.of(f).stub for f in range(4)} == {only}
    assert len(learner.identities) == 1


def test_owner_map_is_the_join_answers_map():
    assert replay.owner_map(_shard_map()) == {0: 0, 2: 0, 1: 1, 3: 1}


def _state(outer_steps: int, merges: list[float], uploads: dict):
    return types.SimpleNamespace(
        outer_steps=outer_steps, sync_time_s=0.5, uploads=uploads, tokens_merged=0,
        recent_merges=[types.SimpleNamespace(quorum_wait_s=m, grace_used_s=0.0) for m in merges])


def _replay_result(accepted_by_shard: dict) -> dict:
    n = sum(accepted_by_shard.values())
    return {"latencies": [0.01, 0.02], "refusals": {}, "offered": n, "accepted": n, "refused": 0, "skipped": 0,
            "accepted_by_shard": accepted_by_shard, "offered_steps": 8 * n, "accepted_steps": 8 * n,
            "merged_steps": 8 * n, "pending_steps_end": 0, "unmerged_steps_end": 0, "slowed": 0, "final_sent": 0}


def test_a_levels_figures_add_up_over_its_shards():
    s0s = [_state(10, [], {}), _state(20, [], {})]
    s1s = [_state(30, [0.1, 0.2], {}), _state(60, [0.3], {})]
    finals = [_state(0, [], {"accepted": 5}), _state(0, [], {"accepted": 7, "rejected_stale": 1})]
    level = perf_scale._level(8, s0s, s1s, 2.0, finals, [_replay_result({"0": 3, "1": 4}),
                                                          _replay_result({"0": 2, "1": 3})])
    assert level["shards"] == 2
    assert level["merges_per_s_by_shard"] == [10.0, 20.0] and level["merges_per_s"] == 30.0
    assert level["uploads_accepted_by_shard"] == {"0": 5, "1": 7}
    assert level["syncer_uploads"] == {"accepted": 12, "rejected_stale": 1}
    assert level["merge_latency_p99_s"] == pytest.approx(0.3, abs=0.01)  # every shard's merges


def test_speedup_is_n_shards_over_one_at_the_same_learner_count():
    levels = [{"learners": 8, "shards": 1, "merges_per_s": 10.0}, {"learners": 8, "shards": 2, "merges_per_s": 18.0},
              {"learners": 64, "shards": 1, "merges_per_s": 20.0}, {"learners": 64, "shards": 2, "merges_per_s": 36.0}]
    assert [(s["learners"], s["shards"], s["ratio"]) for s in perf_scale.shard_speedups(levels)] == [
        (8, 2, 1.8), (64, 2, 1.8)]
    head = perf_report._scale_headline({"levels": levels, "speedups": perf_scale.shard_speedups(levels)})
    assert [(f["name"], f["ratio"], f.get("meets_target")) for f in head] == [
        ("merges/s, 2 syncer shards, 64 replay learners, default schedule", 1.8, True),  # no saturation levels
        ("uploads accepted, 2 syncer shards, 64 replay learners", 0.0, None)]  # no upload counts given


def _row(label: str, params: int, model: dict, shards: int, learners: int, merges: float, rss: list[int]) -> dict:
    return {"label": label, "params": params, "model": model, "shards": shards, "learners": learners,
            "merges_per_s": merges, "merge_latency_p50_s": 0.1, "merge_latency_p99_s": 0.2,
            "upload_latency_p50_s": 0.01, "upload_latency_p99_s": 0.02, "offered_steps": 100, "accepted_steps": 99,
            "shard_peak_rss_bytes": rss, "syncer_peak_rss_bytes": max(rss)}


def test_the_size_table_puts_the_previous_committed_runs_figures_beside_each_row():
    # The committed run of before the model-size rows: its scale section only (one syncer, the
    # default model, several learner counts); the 0.5M row is matched by model, at the nearest count.
    legacy = {"provenance": {"commit": "36f2b8c627e7", "started_utc": "2026-11-25T11:20:53+00:00", "dirty": False},
              "scale": {"model": {"preset": "small"}, "levels": [
                  {"learners": n, "merges_per_s": m, "merge_latency_p50_s": 0.15, "merge_latency_p99_s": 0.16,
                   "upload_latency_p50_s": 0.004, "upload_latency_p99_s": 0.008,
                   "syncer_peak_rss_bytes": 500 * 2**20, "syncer_rss_before_learners_bytes": 480 * 2**20}
                  for n, m in ((8, 10.78), (64, 23.5))]}}
    previous = perf_report.previous_summary(legacy, "bench/results/perf.json")
    sizes = {"shards": 4, "learners": 4, "step_s": 0.1, "rows": [
        _row("0.5M", 478_464, {"preset": "small"}, 4, 4, 12.5, [400 * 2**20] * 4),
        _row("1.0B", 1_019_000_000, {"preset": "small", "d_model": 2304}, 4, 4, 0.4, [9000 * 2**20] * 4)]}
    md = "\n".join(perf_report.md_sizes(sizes, previous))
    lines = [line for line in md.splitlines() if line.startswith("| 0.5M") or line.startswith("| 1.0B")]
    assert len(lines) == 2
    assert "12.50 (prev 10.78)" in lines[0]  # the 8-learner level is nearest to 4 learners
    assert "1 x 8" in lines[0] and "500" in lines[0]  # the previous run's setup and peak RSS beside
    assert "400 + 400 + 400 + 400" in lines[0]  # this run: one peak per shard
    assert "0.40 (prev -)" in lines[1]  # not measured then
    assert "commit 36f2b8c627e7" in md


def test_a_previous_run_with_size_rows_is_matched_by_label_shards_and_learners():
    rows = [_row("1.0B", 1, {}, 2, 4, 1.0, [1]), _row("1.0B", 1, {}, 4, 8, 2.0, [1]), _row("1.0B", 1, {}, 4, 4, 3.0, [1])]
    current = _row("1.0B", 1, {"d_model": 2304}, 4, 4, 0.0, [1])
    assert perf_report.previous_match(current, rows)["merges_per_s"] == 3.0
    assert perf_report.previous_match(_row("100M", 1, {"d_model": 768}, 4, 4, 0.0, [1]), rows) is None
    assert perf_report.size_rows({"sizes": {"rows": rows}}) == rows
    assert perf_report.previous_summary(None, "x") is None


def test_a_size_the_machine_cannot_hold_is_not_started_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(perf_scale, "_mem_available_bytes", lambda: 24 * 2**30)

    def no_level(*args, **kwargs):
        raise AssertionError("a level was started")

    monkeypatch.setattr(perf_scale, "_run_level", no_level)
    # 1B parameters on 4 shards: every shard holds every fragment (4 GB each), beyond 24 GiB.
    sizes = perf_scale.run_sizes(tmp_path, ["1B"], shards=4, learners=4, seconds=1.0, step_s=0.25, processes=2)
    (row,) = sizes["rows"]
    assert row["label"] == "1.0B" and row["params"] >= 1e9 and row["shards"] == 4
    assert "GiB available" in row["not_run"]
    md = "\n".join(perf_report.md_sizes(sizes, None))
    assert "not run: needs about" in md
    # A previous run's row that did not run is no figure to print beside this one's.
    assert perf_report.previous_match(_row("1.0B", 1, {}, 4, 4, 0.0, [1]), [row]) is None


def test_the_memory_estimate_grows_with_shards_and_model_size():
    # Shards split the model's state: more shards add only their start-up.
    two, four = perf_scale.memory_needed_bytes(100_000_000, 2), perf_scale.memory_needed_bytes(100_000_000, 4)
    assert four - two == 2 * perf_scale.SHARD_BASE_BYTES
    assert perf_scale.memory_needed_bytes(1_000_000_000, 4) > 8 * perf_scale.memory_needed_bytes(100_000_000, 4)  # ~linear in size
    # Measured: 100M x 4 shards fits this machine; 1B x 4 does not yet (~77 bytes per owned parameter at the peak).
    assert four < 24 * 2**30 < perf_scale.memory_needed_bytes(1_000_000_000, 4)


def test_the_scale_report_shows_each_shards_peak_memory_at_the_fewest_and_most_learners():
    def level(learners, shards, peaks):
        return {"learners": learners, "shards": shards, "shard_peak_rss_bytes": [p * 2**20 for p in peaks]}

    md = perf_report._rss_growth([level(8, 1, [500]), level(64, 1, [520]), level(8, 2, [400, 410]),
                                  level(64, 2, [405, 430])])
    assert md == ["\nPeak RSS per shard, 1 shard(s): 500 MiB at 8 learners, 520 MiB at 64.",
                  "\nPeak RSS per shard, 2 shard(s): 400 + 410 MiB at 8 learners, 405 + 430 MiB at 64."]


# ---------------------------------------------------------------- replay learners: the end of a run


class _QuietIdentity:
    """A replay identity against no syncer: uploads are accepted at once (send_upload patched);
    its watch moves every fragment's version on only once the run has stopped (`stopped`), so
    that at the stop the learner holds work on a base it has already contributed on."""

    def __init__(self, stopped: asyncio.Event) -> None:
        self.stub, self.shard_index, self.pipeline_bytes = object(), 0, 0
        self.versions: dict[int, int] = {}
        self.sent_base: dict[int, int] = {}
        self.stopped = stopped
        self.intervals: list[tuple[float, float]] = []
        self.finished_reported = False

    async def watch(self, until: asyncio.Event, stream_s: float) -> None:
        while True:  # as Identity.watch: ends as soon as `until` is set
            await asyncio.sleep(0.02)
            if until.is_set():
                return
            if self.stopped.is_set():
                for fid in range(4):
                    self.versions[fid] = self.versions.get(fid, 0) + 1

    async def report_progress(self, until, interval_s, steps, timeout_s, step_time_s=None, finished=None) -> None:
        self.intervals.append((interval_s, step_time_s))
        while not until.is_set():
            self.finished_reported |= finished is not None and finished()
            await asyncio.sleep(0.01)

    def messages(self, fid, base, *args, **kwargs) -> list:
        return [(fid, base)]  # what the patched send_upload answers on


class _QuietLearner:
    def __init__(self, ident: _QuietIdentity) -> None:
        self.ident, self.identities, self.owner = ident, [ident], {}

    async def join(self, timeout_s: float) -> None:
        pass

    def of(self, fid: int) -> _QuietIdentity:
        return self.ident


def test_work_held_on_an_already_sent_base_goes_out_in_the_finish(monkeypatch):
    # Before the flush kept the watch open, the watch ended with the run: the versions never moved
    # again, and the steps trained after each fragment's last contribution stayed pending (1128
    # learner-steps at 64 learners, the whole gap to 100 % merged).
    async def accepted(stub, msgs, timeout, pipeline_bytes=0):
        (_fid, base), = msgs  # accepted into the round gathering on its base
        return types.SimpleNamespace(next_upload_after_s=0.0, current_version=base)

    monkeypatch.setattr(replay.client_lib, "send_upload", accepted)

    async def run() -> tuple[dict, _QuietIdentity]:
        stop = asyncio.Event()
        ident = _QuietIdentity(stop)
        monkeypatch.setattr(replay, "ShardedLearner", lambda stub, learner_id, stub_for: _QuietLearner(ident))
        spec = {"address": "x", "ids": 1, "first": 0, "step_s": 0.01, "sync_period_steps": 8, "flush_s": 3.0}
        payloads = {fid: (None, []) for fid in range(4)}
        ctx = replay.make_context(spec, payloads, lambda address: object())
        task = asyncio.create_task(replay._learner(ctx, spec, 0, stop))
        await asyncio.sleep(0.5)  # ~50 steps: every fragment sent once on base 0, then more work
        stop.set()
        await asyncio.wait_for(task, 10)
        return ctx, ident

    ctx, ident = asyncio.run(run())
    work = ctx["work"]
    assert work["offered_steps"] >= 4 * 8 * 2  # each fragment trained after its first contribution
    assert work["final_sent"] >= 1
    assert work["pending_steps_end"] == work["unmerged_steps_end"] == 0
    assert work["accepted_steps"] == work["merged_steps"] == work["offered_steps"]
    assert ident.finished_reported  # the syncer is told, as by a real learner's finish
    # Progress at the real client's interval (twice per round slot, at least 20 ms), with the step time.
    assert ident.intervals == [(0.02, 0.01)]


def test_an_idle_replay_learner_reports_progress_and_never_uploads(monkeypatch):
    async def never(*args, **kwargs):
        raise AssertionError("an idle learner uploaded")

    monkeypatch.setattr(replay.client_lib, "send_upload", never)

    async def run() -> dict:
        stop = asyncio.Event()
        ident = _QuietIdentity(stop)
        monkeypatch.setattr(replay, "ShardedLearner", lambda stub, learner_id, stub_for: _QuietLearner(ident))
        spec = {"address": "x", "ids": 1, "first": 0, "step_s": 0.01, "sync_period_steps": 8, "flush_s": 30.0,
                "uploads": False}
        ctx = replay.make_context(spec, {fid: (None, []) for fid in range(4)}, lambda address: object())
        task = asyncio.create_task(replay._learner(ctx, spec, 0, stop))
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.wait_for(task, 5)  # no flush to wait for
        return ctx

    ctx = asyncio.run(run())
    assert ctx["work"]["offered_steps"] > 0 and ctx["work"]["accepted_steps"] == 0 == ctx["work"]["final_sent"]


def test_progress_interval_is_the_real_clients_towards_each_shard():
    fids = [0, 1, 2, 3]
    # Unsharded: the client's rule over all P fragments.
    assert replay.report_interval_s({}, 0, 0.09, 8, fids) == pytest.approx(0.09)  # the default schedule: one per step
    assert replay.report_interval_s({}, 0, 0.005, 8, fids) == pytest.approx(0.02)  # never faster than 50/s
    assert replay.report_interval_s({}, 0, 1.0, 8, fids) == pytest.approx(0.25)  # never slower than 4/s
    # Two shards, each serving 2 of the 4 fragments: each is told twice per ITS round slot (H / 2 steps).
    owner = {0: 0, 1: 1, 2: 0, 3: 1}
    assert replay.report_interval_s(owner, 1, 0.02, 8, fids) == pytest.approx(0.04)
    assert replay.report_interval_s(owner, 0, 0.02, 8, fids) == pytest.approx(
        progress.progress_interval_s(0.02, 8, 2, client_lib.ClientConfig.progress_interval_s))


# ---------------------------------------------------------------- saturation levels


def _win_state(outer_steps: int, accepted: int, slowed: int):
    return types.SimpleNamespace(outer_steps=outer_steps, uploads={"accepted": accepted, "slowed": slowed})


def test_window_figures_are_rates_and_cpu_over_the_window():
    s0s = [_win_state(10, 100, 0), _win_state(20, 200, 10)]
    s1s = [_win_state(30, 150, 25), _win_state(40, 250, 35)]
    cpu = {"shards0": [1.0, 2.0], "shards1": [9.0, 8.0], "replays0": [0.5, 0.5], "replays1": [1.5, 2.5]}
    w = perf_scale.window_figures(s0s, s1s, 10.0, cpu)
    assert w["window_merges"] == 40 and w["window_uploads_accepted"] == 100
    assert w["uploads_accepted_per_s"] == pytest.approx(10.0)
    assert w["slowed_share"] == pytest.approx(0.5)
    assert w["shard_cpu_share_by_shard"] == pytest.approx([0.8, 0.6])
    assert w["replay_cpu_share"] == pytest.approx(0.3)
    assert w["shard_cpu_s_per_merge"] == pytest.approx(14.0 / 40)
    assert w["shard_cpu_s_per_upload"] == pytest.approx(14.0 / 100)
    assert "replay_cpu_share" not in perf_scale.window_figures(s0s, s1s, 10.0, None)


def test_a_level_says_where_the_unmerged_work_is():
    s0s = [_state(10, [], {})]
    s1s = [_state(30, [0.1], {})]
    final = _state(0, [], {"accepted": 5})
    final.tokens_merged = 90 * replay.TOKENS_PER_STEP
    result = _replay_result({"0": 5}) | {"offered_steps": 100, "accepted_steps": 90, "merged_steps": 85,
                                         "pending_steps_end": 8, "unmerged_steps_end": 5}
    level = perf_scale._level(8, s0s, s1s, 2.0, [final], [result])
    assert (level["merged_steps"], level["pending_steps_end"], level["unmerged_steps_end"], level["lost_steps"]) == (
        85, 8, 5, 2)
    assert level["merged_steps_syncer"] == 90 and level["work_merged_share"] == pytest.approx(0.85)
    cell = perf_report._work_cell(level)
    assert cell.startswith("85.0% (85/100; 90 accepted") and "8 pending, 5 unmerged, 2 lost" in cell
    # The headline's figure is the learners' merged count, not what the shards accepted.
    head = perf_report._scale_headline({"levels": [level], "speedups": []})
    assert head[0]["value"] == 85 and head[0]["meets_target"] is False


def test_offered_rates_and_what_counts_as_saturated():
    rates = perf_scale.offered_rates(16, 0.01)
    assert rates["offered_rounds_per_s"] == pytest.approx(50.0)  # P / (H x step) = 4 / 0.08
    assert rates["offered_uploads_per_s"] == pytest.approx(800.0)
    assert perf_scale.saturated({"merges_per_s": 30.0, "slowed_share": 0.4}, 50.0)
    assert not perf_scale.saturated({"merges_per_s": 48.0, "slowed_share": 0.4}, 50.0)  # the schedule's rate
    assert not perf_scale.saturated({"merges_per_s": 30.0, "slowed_share": 0.0}, 50.0)  # no back-pressure
    assert perf_scale.cpu_bound({"shard_cpu_share_by_shard": [0.3, 0.85]})
    assert not perf_scale.cpu_bound({"shard_cpu_share_by_shard": [0.14]})  # starved by the machine's load


def _sat_level(shards: int, merges: float, uploads: float, shard_cores: list[float], replay_cores: float,
               cpu_per_merge: float) -> dict:
    return {"learners": 16, "shards": shards, "merges_per_s": merges, "merges_per_s_by_shard": [merges / shards] * shards,
            "uploads_accepted": int(uploads * 10), "uploads_accepted_per_s": uploads, "slowed_share": 0.5,
            "hint_factor_max": 4.0, "shard_cpu_share_by_shard": shard_cores, "replay_cpu_share": replay_cores,
            "shard_cpu_s_per_merge": cpu_per_merge, "shard_cpu_s_per_upload": cpu_per_merge / 4,
            "saturated": True, "offered_steps": 100, "accepted_steps": 100, "pending_steps_end": 0, "lost_steps": 0}


def test_the_scale_out_target_is_held_to_the_saturation_levels():
    levels = [_sat_level(1, 20.0, 80.0, [0.95], 0.2, 0.05), _sat_level(2, 30.0, 120.0, [0.75, 0.75], 0.3, 0.05)]
    sat = {"learners": 16, "step_s": 0.01, "cores": 2, "offered_rounds_per_s": 50.0, "offered_uploads_per_s": 800.0,
           "levels": levels, "speedups": perf_scale.shard_speedups(levels)}
    default = [{"learners": 64, "shards": 1, "merges_per_s": 5.5}, {"learners": 64, "shards": 2, "merges_per_s": 5.4}]
    head = perf_report._scale_headline({"levels": default, "speedups": perf_scale.shard_speedups(default)}, sat)
    by_name = {f["name"]: f for f in head}
    target = by_name["merges/s, 2 syncer shards, saturation (16 replay learners, step 10 ms)"]
    assert target["ratio"] == pytest.approx(1.5) and target["meets_target"] is False
    assert by_name["uploads accepted/s, 2 syncer shards, saturation (16 replay learners, step 10 ms)"]["ratio"] == (
        pytest.approx(1.5))
    # The default schedule's merges/s is the schedule's rate: shown, held to no target.
    assert "target" not in by_name["merges/s, 2 syncer shards, 64 replay learners, default schedule"]
    # 2 cores less the replays' 0.3 leave the shards 1.7 cores; one shard used 0.95 at the same
    # CPU per merge: at most 1.79x.
    bound = perf_report.cpu_bound_speedup(sat, 2)
    assert bound["cores_left"] == pytest.approx(1.7) and bound["speedup"] == pytest.approx(1.7 / 0.95)
    levels[0] |= {"cpu_bound": True, "idle_shard_cpu_share_by_shard": [0.1]}
    levels[1]["idle_shard_cpu_share_by_shard"] = [0.1, 0.12]
    md = "\n".join(perf_report.md_saturation(sat))
    assert "| 0.75 + 0.75 (0.10 + 0.12) |" in md
    assert "50.0 rounds/s" in md and "| 2 | 30.00 (15.00 + 15.00)" in md
    assert "caps the speed-up at 1.79x" in md and "yes, CPU-bound" in md
    # One shard that the machine's load starved: the speed-up is not the shards' capacity, and says so.
    levels[0] |= {"cpu_bound": False, "shard_cpu_share_by_shard": [0.14]}
    md = "\n".join(perf_report.md_saturation(sat))
    assert "caps the speed-up" not in md and "not bounded by its own CPU (it got 0.14 cores)" in md
    assert "yes, not CPU-bound" in md


def test_a_replay_learner_honours_a_hold_as_the_real_client_does(monkeypatch):
    # The hint alone asks for up to 31 periods (22 s at the default step, most of a timed run);
    # a real learner honours at most 8 periods (ddiloco.learner.uploads.honoured_hold_s).
    async def slowed(stub, msgs, timeout, pipeline_bytes=0):
        return types.SimpleNamespace(next_upload_after_s=31 * 8 * 0.09, current_version=0)

    monkeypatch.setattr(replay.client_lib, "send_upload", slowed)

    async def run() -> tuple[float, float, dict]:
        spec = {"address": "x", "ids": 1, "step_s": 0.09, "sync_period_steps": 8}
        ctx = replay.make_context(spec, {0: (None, [])}, lambda address: object())
        ident = _QuietIdentity(asyncio.Event())
        state = {"pending": {0: 8}, "hold": {}, "sending": {}, "unmerged": {0: []}}
        t0 = asyncio.get_running_loop().time()
        await replay._send(ctx, ident, 0, 0, 8, state, final=False)
        return state["hold"][0] - t0, ctx["hint_factor_max"], ctx["work"]

    hold_s, factor, work = asyncio.run(run())
    assert 8 * 8 * 0.09 - 0.5 <= hold_s <= 8 * 8 * 0.09 + 0.5  # 5.8 s, not 22 s
    assert factor == pytest.approx(32.0) and work["slowed"] == 1


def test_the_honoured_hold_is_capped_by_periods_and_a_minute():
    from ddiloco.learner import uploads

    assert uploads.honoured_hold_s(1.0, 8, 0.09) == pytest.approx(1.0)
    assert uploads.honoured_hold_s(100.0, 8, 0.09) == pytest.approx(8 * 8 * 0.09)
    assert uploads.honoured_hold_s(100.0, 8, 10.0) == pytest.approx(60.0)
    assert uploads.honoured_hold_s(5.0, 8, 0.0) == 0.0  # no step time measured yet: no hold


def test_saturation_levels_on_a_synthetic_model_send_that_models_fragments(monkeypatch, tmp_path):
    # --saturation-params: the shards run the synthetic model and the replay learners send
    # pseudo-gradients of its fragments (sizes by fragment id), idle level and timed level alike.
    calls = []

    def level(workdir, model, payload, count, seconds, step_s, processes, shards, one_at_a_time=False):
        calls.append((model, payload, shards))
        return _sat_level(shards, 2.0 * shards, 4.0 * shards, [0.9] * shards, 0.1, 0.5)

    monkeypatch.setattr(perf_scale, "_run_level", level)
    sat = perf_scale.run_saturation(tmp_path, {"preset": "small"}, tmp_path / "captured.npz", 4, 0.08, 30.0, 2,
                                    [1, 2], params=perf_scale.parse_params("25M"))
    model = perf_scale.model_for_params(25_000_000)
    numels = perf_scale.fragment_numels(model)
    assert all(m == model for m, _, _ in calls) and [s for _, _, s in calls] == [1, 1, 2, 2]
    assert [p.get("uploads", True) for _, p, _ in calls] == [False, True, False, True]
    assert all(p["synthetic_numels"] == {str(f): n for f, n in numels.items()} and "captured" not in p
               for _, p, _ in calls)
    assert sat["params"] == sum(numels.values()) and min(sat["fragment_numels"]) > 6e6
    md = "\n".join(perf_report.md_saturation(sat))
    assert "step 80 ms, synthetic 25.1M-parameter model (fragments of 6.29M/" in md
    # Without a size: the scale section's model and the captured pseudo-gradients, as before.
    calls.clear()
    sat = perf_scale.run_saturation(tmp_path, {"preset": "small"}, tmp_path / "captured.npz", 4, 0.08, 30.0, 2, [1])
    assert calls[1] == ({"preset": "small"}, {"captured": str(tmp_path / "captured.npz")}, 1) and "params" not in sat


def test_a_replay_upload_is_the_header_then_the_fragments_chunks_built_once():
    chunks = [b"a" * 5, b"b" * 3, b"c"]
    ident = replay.perf_identity.Identity(object(), "replay-0")
    whole = ident.messages(2, 7, None, chunks, steps=8, tokens=8 * replay.TOKENS_PER_STEP, final=True)
    built = ident.messages(2, 7, None, [], steps=8, tokens=8 * replay.TOKENS_PER_STEP, final=True)
    built += replay.chunk_messages(chunks)
    assert [m.SerializeToString() for m in built] == [m.SerializeToString() for m in whole]
    assert [m.chunk.last for m in built[1:]] == [False, False, True]
