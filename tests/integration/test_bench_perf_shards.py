"""`ddiloco bench perf --quick --sections scale,sizes`: the scale section against one syncer and two
fragment shards in one invocation (at the given step and at a saturating one), and the model-size
rows with shards, beside a previous run.

Structure and invariants only (the machine is shared: speed-ups are the benchmark's business).
Starts real syncer shards and replay processes on 127.0.0.1 (hence the integration mark); small
enough for CI: one learner count, a 30k-parameter model row, 3 s per level.
"""

from __future__ import annotations

import json

import pytest

from ddiloco.bench import cli as bench_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("perf-shards")
    previous = out / "previous.json"
    # A committed run of before shards: one syncer, the default model of --quick (tiny), 3 learners.
    previous.write_text(json.dumps({"provenance": {"commit": "0123456789abcdef", "started_utc": "then"},
                                    "scale": {"model": {"preset": "tiny"}, "levels": [{
                                        "learners": 3, "merges_per_s": 1.25, "merge_latency_p50_s": 0.1,
                                        "merge_latency_p99_s": 0.2, "upload_latency_p50_s": 0.01,
                                        "upload_latency_p99_s": 0.02, "syncer_peak_rss_bytes": 300 * 2**20,
                                        "syncer_rss_before_learners_bytes": 290 * 2**20}]}}))
    assert bench_cli.main(["perf", "--quick", "--out-dir", str(out), "--name", "perf", "--sections", "scale,sizes",
                           "--replay-step-s", "0.25", "--learners", "3", "--syncer-shards", "1,2",
                           "--scale-sizes", "30k", "--size-shards", "2", "--size-learners", "2",
                           "--saturation-step-s", "0.01", "--saturation-learners", "3",
                           "--previous", str(previous)]) == 0
    return json.loads((out / "perf.json").read_text()), (out / "perf.md").read_text()


def test_the_scale_section_runs_one_and_two_shards_side_by_side(run):
    result, md = run
    levels = result["scale"]["levels"]
    assert [(lv["learners"], lv["shards"]) for lv in levels] == [(3, 1), (3, 2)]
    one, two = levels
    assert len(one["shard_peak_rss_bytes"]) == 1 and len(two["shard_peak_rss_bytes"]) == 2
    assert all(b > 0 for b in two["shard_peak_rss_bytes"] + two["shard_rss_before_learners_bytes"])
    # The replay learners sent each fragment to its owner: both shards accepted uploads, and
    # no shard refused one for not owning its fragment.
    assert set(two["uploads_accepted_by_shard"]) == {"0", "1"}
    assert min(two["uploads_accepted_by_shard"].values()) > 0
    assert sum(two["uploads_accepted_by_shard"].values()) == two["uploads_accepted"]
    assert "rejected_not_owner" not in two["syncer_uploads"]
    assert len(two["merges_per_s_by_shard"]) == 2
    (speedup,) = result["scale"]["speedups"]
    assert (speedup["learners"], speedup["shards"]) == (3, 2)
    expected = two["merges_per_s"] / one["merges_per_s"] if one["merges_per_s"] > 0 else 0.0
    assert speedup["ratio"] == pytest.approx(expected)
    assert "2 shards against one at 3 learners" in md


def test_the_size_rows_run_with_shards_beside_the_previous_run(run):
    result, md = run
    (row,) = result["sizes"]["rows"]
    assert row["label"] == "30k" and 20_000 <= row["params"] <= 40_000
    assert row["shards"] == 2 and row["learners"] == 2
    assert len(row["shard_peak_rss_bytes"]) == 2
    assert row["uploads_accepted"] > 0
    assert result["previous"]["commit"] == "0123456789abcdef"
    (line,) = [x for x in md.splitlines() if x.startswith("| 30k")]
    assert "(prev 1.25)" in line and "(prev 1 x 3)" in line  # matched by model: the previous run's tiny syncer


def test_the_saturation_levels_measure_every_processs_cpu_against_the_offered_load(run):
    result, md = run
    sat = result["saturation"]
    assert [(lv["learners"], lv["shards"]) for lv in sat["levels"]] == [(3, 1), (3, 2)]
    assert sat["offered_rounds_per_s"] == pytest.approx(4 / (8 * 0.01))
    for lv in sat["levels"]:
        assert len(lv["shard_cpu_share_by_shard"]) == lv["shards"]
        assert all(0.0 < c < 2.5 for c in lv["shard_cpu_share_by_shard"])  # measured, in cores
        assert 0.0 < lv["replay_cpu_share"] < 2.5
        assert lv["window_uploads_accepted"] > 0 and lv["shard_cpu_s_per_upload"] > 0
        assert lv["lost_steps"] == 0  # refused work is sent again, never dropped
        assert len(lv["idle_shard_cpu_share_by_shard"]) == lv["shards"]  # the same learners, no uploads
        assert isinstance(lv["saturated"], bool) and isinstance(lv["cpu_bound"], bool)
    (speedup,) = sat["speedups"]
    assert speedup["shards"] == 2 and "shard_cpu_s_per_merge_ratio" in speedup
    assert "## Scale-out at saturation: 3 replay learners, step 10 ms" in md
    assert any(f["name"].startswith("merges/s, 2 syncer shards, saturation") and f.get("target") == 1.7
               for f in result["headline"])
