"""Prometheus metrics of the running services, scraped over HTTP from real processes.

Each service's exposition must pass `promtool check metrics` without a lint message (promtool from
scripts/promtool_env.sh; none fails the test)."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import promtool
from tests.integration.conftest import LEARNER_PACE, TINY, SyncerProbe, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def scrape_text(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return response.read().decode()


def scrape(address: str, *, check_as: str | None = None) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from a /metrics endpoint; with `check_as`, the
    exposition must also pass `promtool check metrics`."""
    text = scrape_text(address)
    if check_as is not None:
        promtool.check_metrics(text, check_as)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name: str, **labels) -> float:
    want = tuple(sorted(labels.items()))
    matches = [v for (n, ls), v in samples.items() if n == name and all(item in ls for item in want)]
    assert matches, f"{name}{labels} not exported"
    return sum(matches)


def test_syncer_store_and_learner_export_prometheus_metrics(cluster):
    store = cluster.start_store()
    syncer = cluster.start_syncer(run_id="metrics", extra=[*TINY, "--checkpoint-every-merges", "4"])
    learner = cluster.start_learner(0, region="eu", extra=["--num-shards", "1", "--metrics-bind", "127.0.0.1:0",
                                                            *LEARNER_PACE])
    probe = SyncerProbe(syncer.address)
    try:
        wait_until(lambda: probe.state(0).last_checkpoint_outer_step >= 8, timeout_s=150, what="merges + a checkpoint")
    finally:
        probe.close()
    syncer_metrics = json.loads(syncer.ready_file.read_text())["metrics_address"]
    s = scrape(syncer_metrics, check_as="the syncer's /metrics")
    assert value(s, "ddiloco_syncer_merges_total") >= 8
    assert value(s, "ddiloco_syncer_outer_steps_total") >= 8
    assert value(s, "ddiloco_syncer_fragment_version", fragment="0") >= 1
    assert value(s, "ddiloco_syncer_uploads_total", result="accepted") >= 8
    assert value(s, "ddiloco_wire_bytes_total", direction="in") > 0
    # Fragment transfers by the codec each used: int4 uploads and deltas (the defaults; the learner
    # seeds version 0 from its own initialization, so no whole fp32 version is sent here).
    assert value(s, "ddiloco_syncer_fragment_wire_bytes_total", direction="in", codec="int4") > 0
    assert value(s, "ddiloco_syncer_fragment_wire_bytes_total", direction="out", codec="int4") > 0
    assert value(s, "ddiloco_syncer_merge_contributors_count") >= 8
    assert value(s, "ddiloco_syncer_grace_used_seconds_count") >= 8
    assert value(s, "ddiloco_syncer_contribution_staleness_versions_count") >= 8
    # int4 with block-128 scales is ~4.25 bits/value: more than 5x smaller than fp32 after zstd.
    ratio = value(s, "ddiloco_syncer_upload_compression_ratio_sum") / value(s, "ddiloco_syncer_upload_compression_ratio_count")
    assert ratio > 5.0, ratio
    assert value(s, "ddiloco_syncer_checkpoint_write_seconds_count") >= 1
    assert value(s, "ddiloco_learners", status="active") == 1
    assert value(s, "ddiloco_learner_inner_steps_total", learner="learner-0", region="eu") > 0
    assert value(s, "ddiloco_learner_tokens_total", learner="learner-0", region="eu") > 0
    # Never above 1, although progress reports lag the uploads (it once read 1.028 before merged
    # contributions bounded the tokens processed from below).
    assert 0 < value(s, "ddiloco_goodput_ratio") <= 1
    # Work merged = tokens merged / (P x tokens processed), from the syncer's tokens processed (every life).
    processed = value(s, "ddiloco_syncer_tokens_processed_total")
    assert processed > 0
    assert value(s, "ddiloco_work_merged_ratio") == pytest.approx(
        value(s, "ddiloco_syncer_tokens_merged_total") / (4 * processed), rel=0.05)
    assert value(s, "ddiloco_syncer_merge_contributors_expected_ratio_count") >= 8
    assert value(s, "ddiloco_syncer_last_merge_contributors", fragment="0") >= 1
    assert value(s, "ddiloco_syncer_last_merge_expected_contributors", fragment="0") >= 1
    assert value(s, "grpc_server_handled_total", grpc_service="ddiloco.v1.Syncer", grpc_method="UploadFragment",
                 grpc_type="client_stream", grpc_code="OK") >= 8
    assert value(s, "ddiloco_build_info", component="syncer") == 1
    # Series that the dashboard's security panel and the alerts read exist at 0 before any refusal.
    assert value(s, "ddiloco_syncer_auth_failures_total", reason="wrong_role") == 0
    assert value(s, "ddiloco_syncer_uploads_total", result="rejected_norm_bound") == 0

    st = scrape(json.loads(store.ready_file.read_text())["metrics_address"], check_as="the store's /metrics")
    assert value(st, "ddiloco_checkpoint_latest_step", run="metrics") >= 4
    assert value(st, "ddiloco_checkpoint_blobs") >= 2
    assert value(st, "ddiloco_checkpoint_auth_failures_total", reason="invalid_token", method="PutBlob") == 0
    assert value(st, "grpc_server_handled_total", grpc_method="CommitManifest", grpc_code="OK") >= 1

    learner_log = learner.log_path.read_text()
    address = learner_log.split("metrics on http://", 1)[1].split("/metrics", 1)[0]
    ls = scrape(address, check_as="the learner's /metrics")
    assert value(ls, "ddiloco_learner_inner_steps_total", learner="learner-0") > 0
    assert value(ls, "ddiloco_learner_tokens_total", learner="learner-0") > 0
    assert value(ls, "ddiloco_learner_inner_loss", learner="learner-0") > 0  # the syncer's name for it too
    assert value(ls, "ddiloco_learner_uploads_total", result="accepted") > 0
    assert value(ls, "ddiloco_wire_bytes_total", direction="out") > 0
