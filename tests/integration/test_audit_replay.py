"""Accountable merges end to end (issue 24): a seeded run of a store, a syncer with
--retain-contributions and 3 learners as real processes; `ddiloco audit --store` reads the store's
ledger, `ddiloco audit replay` reproduces every published fragment hash bit for bit from the run's
initial values, and a retained contribution or a ledger record changed on the store's disk is
detected, naming the merge."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from ddiloco.cli import audit as audit_lib
from ddiloco.cli import cluster as cluster_lib
from tests.integration.conftest import LEARNER_PACE, TINY
from tests.waits import TEARDOWN_CLIENTS_S

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

RUN_ID = "replay-run"
_DDILOCO = [sys.executable, "-m", "ddiloco.cli.main"]


def _ddiloco(args: list[str], env, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    return subprocess.run([*_DDILOCO, *args], capture_output=True, text=True, timeout=timeout_s, env=env)


def _flip(path: pathlib.Path, offset: int) -> bytes:
    """Changes one byte of a file in place (same length); returns the original contents."""
    data = path.read_bytes()
    changed = bytearray(data)
    changed[offset] = ord("0") if changed[offset] != ord("0") else ord("1")
    path.write_bytes(bytes(changed))
    return data


def test_replay_reproduces_every_published_hash_and_names_a_tampered_merge(tmp_path):
    cluster = cluster_lib.LocalCluster(tmp_path / "cluster")
    try:
        store = cluster.start_store()
        syncer = cluster.start_syncer(run_id=RUN_ID, extra=[*TINY, "--retain-contributions"])
        for i in range(3):
            cluster.start_learner(i, region=f"region-{i % 2}", extra=[
                "--steps", "40", "--num-shards", "3", "--seed", "1", "--incarnation", "1", *LEARNER_PACE])
        for learner in cluster.learners():
            assert learner.wait(400) == 0, learner.log_tail()
        assert syncer.stop(60) == 0, syncer.log_tail()  # final checkpoint; the ledger's queue drained

        audit = _ddiloco(["audit", "--store", store.address, "--run-id", RUN_ID, "--json"], cluster.env)
        assert audit.returncode in (0, 1), audit.stderr  # 1: an honest learner flagged is not this test's matter
        assert json.loads(audit.stdout)["chain"] == "intact"
        ledger_path = cluster.workdir / "store" / "ledger" / f"{RUN_ID}.jsonl"
        lines = ledger_path.read_bytes().splitlines()
        records = audit_lib.verify_lines(lines, from_genesis=True)
        assert len(records) >= 24, len(records)  # a few dozen merges
        assert all(c["fold"].get("blob") for r in records for c in r["contributors"])
        assert len({c["learner"] for r in records for c in r["contributors"]}) == 3

        replay = _ddiloco(["audit", "replay", "--store", store.address, "--run-id", RUN_ID, "--json"], cluster.env)
        assert replay.returncode == 0, replay.stdout + replay.stderr
        outcome = json.loads(replay.stdout)
        assert outcome["replayed"] == len(records) and outcome["published_checked"] == len(records), outcome
        assert outcome["unverifiable"] == [] and outcome["mismatch"] == ""

        # A retained contribution changed on the store's disk: the merge that used it is named.
        target = records[len(records) // 2]
        digest = target["contributors"][0]["fold"]["blob"]
        first_use = next(r for r in records if any(c["fold"]["blob"] == digest for c in r["contributors"]))
        blob = cluster.workdir / "store" / "blobs" / digest[:2] / digest
        original = _flip(blob, 7)
        tampered = _ddiloco(["audit", "replay", "--store", store.address, "--run-id", RUN_ID], cluster.env)
        assert tampered.returncode == 1, tampered.stdout + tampered.stderr
        assert f"fragment {first_use['fragment']} version {first_use['version']}" in tampered.stderr, tampered.stderr
        blob.write_bytes(original)  # the store moved the corrupt copy aside; the intact bytes are back
        assert _ddiloco(["audit", "replay", "--store", store.address, "--run-id", RUN_ID],
                        cluster.env).returncode == 0

        # A ledger record changed (same length, still JSON): the chain breaks right after it.
        middle = len(lines) // 2
        offset = sum(len(line) + 1 for line in lines[:middle]) + lines[middle].index(b'"fragment_sha256":"') + 20
        _flip(ledger_path, offset)
        for args in (["audit", "replay"], ["audit"]):
            broken = _ddiloco([*args, "--store", store.address, "--run-id", RUN_ID], cluster.env)
            assert broken.returncode == 2, broken.stdout + broken.stderr
            named = f"fragment {records[middle]['fragment']} version {records[middle]['version']}"
            assert named in broken.stderr and "hash chain broken" in broken.stderr, broken.stderr
    finally:
        cluster.stop_all(timeout_s=10.0, clients_timeout_s=TEARDOWN_CLIENTS_S)
