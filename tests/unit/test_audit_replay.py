"""`ddiloco audit replay` against a SyncerCore's own merges (no gRPC: an in-memory store): with
contributions retained, every merge is recomputed bit for bit, including the held-back ones
(share cap, norm clip in the merge), a stale (re-anchored) one and lossy downloads; the recorded
fold order is what makes it so, and a record whose order or a blob that was changed is named."""

from __future__ import annotations

import asyncio
import hashlib
import json

import grpc
import numpy as np

from ddiloco import checkpoint_client
from ddiloco import run_description as run_description_lib
from ddiloco.cli import audit as audit_lib
from ddiloco.cli import audit_replay
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.syncer import checkpointing
from services.syncer import ledger_sink
from services.syncer import wire_views
from tests.fakes import accept, join, make_core, settle
from tests.waits import wait_until_async

GENESIS = "0" * 64
LEARNERS = ("a", "b", "c", "d", "heavy", "loud")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class MemoryStore:
    """The calls the ledger sink and the replay make of a checkpoint store, held in memory."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.lines: list[str] = []
        self.manifests: list[checkpoint_client.Manifest] = []

    async def put_blob(self, data: bytes) -> str:
        self.blobs[_sha(data)] = bytes(data)
        return _sha(data)

    async def get_blob(self, digest: str) -> bytes:
        data = self.blobs[digest]
        if _sha(data) != digest:
            raise checkpoint_client.BlobVerificationError(f"blob {digest}: bytes changed")
        return data

    async def ledger_head(self, run_id: str) -> tuple[int, str]:
        return len(self.lines), _sha(self.lines[-1].encode()) if self.lines else GENESIS

    async def append_ledger(self, run_id: str, lines) -> tuple[int, str]:
        for line in lines:
            assert json.loads(line)["prev"] == (await self.ledger_head(run_id))[1]
            self.lines.append(line)
        return await self.ledger_head(run_id)

    async def read_ledger(self, run_id: str, from_index: int = 0) -> list[str]:
        return self.lines[from_index:]

    async def list_manifests(self, run_id: str) -> list[checkpoint_client.Manifest]:
        return self.manifests

    async def checkpoint(self, run_id: str, step: int, blobs: dict[str, bytes]) -> None:
        refs = tuple([checkpoint_client.BlobRef(name, await self.put_blob(data), len(data))
                      for name, data in blobs.items()])
        self.manifests.append(checkpoint_client.Manifest(run_id, step, 0.0, refs, {}))

    def rewrite(self, index: int, change) -> None:
        """Changes record `index` with `change(record)` and chains every later record again (an
        attacker who rewrites the whole ledger from there on: the chain alone cannot tell)."""
        records = [json.loads(line) for line in self.lines]
        change(records[index])
        prev = _sha(self.lines[index - 1].encode()) if index else GENESIS
        for i in range(index, len(records)):
            records[i]["prev"] = prev
            self.lines[i] = json.dumps(records[i], sort_keys=True, separators=(",", ":"))
            prev = _sha(self.lines[i].encode())


async def _upload(core, learner_id: str, fid: int, base: int, delta: np.ndarray, *, tokens_per_step: int,
                  incarnation: int = 1) -> None:
    enc = codec_lib.encode(delta.astype(np.float32), "fp32")
    header = syncer_pb2.UploadHeader(
        protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=incarnation, fragment_id=fid,
        base_version=base, syncer_instance=core.instance, steps=2, tokens=2 * tokens_per_step,
        payload=serde.payload_info_to_proto(enc))
    await accept(core, header, enc.payload, wire_bytes=len(enc.payload))


async def _ledgered(core) -> tuple[MemoryStore, ledger_sink.StoreLedger]:
    """An in-memory store holding the core's initial checkpoint, and the core's ledger sink to it,
    contributions retained."""
    store = MemoryStore()
    run_id = core.run.run_id
    description = run_description_lib.describe(wire_views.run_config(core.run, core.plan), core.plan,
                                               {"outer_lr": 0.7, "outer_momentum": 0.9})
    await store.checkpoint(run_id, 0, checkpointing.encode_snapshot(await core.snapshot(), description)[0])
    sink = ledger_sink.StoreLedger(store, run_id)
    await sink.resume()
    sink.start()
    core.influence.store_ledger, core.influence.retain_contributions = sink, True
    return store, sink


async def _seeded_run(clock, *, idle: bool = False) -> tuple[MemoryStore, str]:
    """Four merges of each of two fragments; `heavy` claims a 20x batch (held back, share capped),
    `loud` sends 10x the others' norm (held back, clipped in the merge); in the last round `b` is
    one version behind (re-anchored). Downloads are lossy (int8, error-fed). `idle`: a seventh
    learner joins and never contributes, and merges take the learners' share ("work": Δ x 6/7)."""
    knobs = {"outer_step_fraction": "work"} if idle else {}
    core = make_core(clock, min_quorum=len(LEARNERS), download_codec="int8", **knobs)
    run_id = core.run.run_id
    store, sink = await _ledgered(core)
    for lid in LEARNERS + (("idle",) if idle else ()):
        join(core, lid)
    rng = np.random.default_rng(7)
    for version in range(4):
        for fid in (0, 1):
            n = core.plan.fragments[fid].numel
            common = rng.normal(size=n)
            for lid in LEARNERS:
                stale = lid == "b" and version == 3  # a restarted b sends work based on the version before
                if stale and fid == 0:
                    join(core, "b", incarnation=2)
                scale = 0.1 if lid == "loud" else 0.01
                await _upload(core, lid, fid, version - 1 if stale else version,
                              scale * (common + 0.5 * rng.normal(size=n)),
                              tokens_per_step=2000 if lid == "heavy" else 100, incarnation=2 if stale else 1)
            await settle()
            await wait_until_async(lambda f=fid, v=version: core.slots[f].version == v + 1, timeout_s=30.0,
                                   what="the round merged")  # the first merge compiles the outer step
    assert await sink.drain(10.0)
    await sink.close()
    return store, run_id


def test_replay_reproduces_every_merge_bit_for_bit_in_the_recorded_order(clock):
    async def run() -> None:
        store, run_id = await _seeded_run(clock)
        records = audit_lib.verify_lines([line.encode() for line in store.lines], from_genesis=True)
        assert len(records) == 8
        contributors = [c for r in records for c in r["contributors"]]
        clipped = {what for c in contributors for what in c["clipped"]}
        assert "share" in clipped and clipped & {"norm", "norm_in_merge"}, clipped
        # The accumulator summed the held-back contributions last, not in the order they came.
        assert all([c["learner"] for c in sorted(r["contributors"], key=lambda c: c["fold"]["summed"])][-1] == "heavy"
                   for r in records)
        assert all([c["learner"] for c in sorted(r["contributors"], key=lambda c: c["fold"]["index"])][-1] == "loud"
                   for r in records)
        assert any(c["fold"]["blob"] != c["contribution_sha256"] for c in contributors)  # re-anchored or clipped
        step, outcome = await audit_replay.replay(store, run_id, 0)
        assert (step, outcome.mismatch, outcome.unverifiable) == (0, "", [])
        assert outcome.replayed == 8 and outcome.published_checked == 8

        # The same contributions added in another order (the whole ledger rewritten from there, so
        # the chain holds; the summing order recorded is dropped): other bits. The order matters.
        third = records[2]

        def reversed_order(record: dict) -> None:
            for c in record["contributors"]:
                c["fold"]["index"] = len(LEARNERS) - 1 - c["fold"]["index"]
                c["fold"]["summed"] = None

        store.rewrite(2, reversed_order)
        _, reordered = await audit_replay.replay(store, run_id, 0)
        assert f"fragment {third['fragment']} version {third['version']}" in reordered.mismatch, reordered
        assert "replayed values hash to" in reordered.mismatch and reordered.replayed == 2

    asyncio.run(run())


def test_replay_steps_on_the_delta_scaled_by_the_learners_share(clock):
    """A learner the rounds expected never contributed: each merge stepped on its delta x 6/7 (the
    record's delta_scale), and replay does the same; a record without that field is named."""
    async def run() -> None:
        store, run_id = await _seeded_run(clock, idle=True)
        records = audit_lib.verify_lines([line.encode() for line in store.lines], from_genesis=True)
        assert [r["merge_inputs"]["delta_scale"] for r in records] == [6 / 7] * 8
        _, outcome = await audit_replay.replay(store, run_id, 0)
        assert (outcome.mismatch, outcome.replayed) == ("", 8)

        store.rewrite(1, lambda record: record["merge_inputs"].pop("delta_scale"))
        _, unscaled = await audit_replay.replay(store, run_id, 0)
        assert f"fragment {records[1]['fragment']} version {records[1]['version']}" in unscaled.mismatch, unscaled
        assert unscaled.replayed == 1

    asyncio.run(run())


def test_a_changed_blob_names_its_merge(clock):
    async def run() -> None:
        store, run_id = await _seeded_run(clock)
        records = audit_lib.verify_lines([line.encode() for line in store.lines], from_genesis=True)
        digest = records[5]["contributors"][1]["fold"]["blob"]
        store.blobs[digest] = b"\x00" + store.blobs[digest][1:]
        first = next(r for r in records if any(c["fold"]["blob"] == digest for c in r["contributors"]))
        _, outcome = await audit_replay.replay(store, run_id, 0)
        assert f"fragment {first['fragment']} version {first['version']}" in outcome.mismatch
        assert "cannot be read intact" in outcome.mismatch

    asyncio.run(run())


def test_a_changed_outer_state_hash_names_its_merge(clock):
    """Each record carries the hash of the fragment's outer optimizer state after the merge, and
    replay compares it: a merge whose difference rounds away in the parameters (its momentum
    keeps it) is named at that merge, not a few merges later."""
    async def run() -> None:
        store, run_id = await _seeded_run(clock)
        records = audit_lib.verify_lines([line.encode() for line in store.lines], from_genesis=True)
        assert all(len(r["outer_state_sha256"]) == 64 for r in records)
        target = records[3]

        def other_state(record: dict) -> None:
            record["outer_state_sha256"] = "0" * 64

        store.rewrite(3, other_state)
        _, outcome = await audit_replay.replay(store, run_id, 0)
        assert f"fragment {target['fragment']} version {target['version']}" in outcome.mismatch, outcome
        assert "outer optimizer state" in outcome.mismatch and outcome.replayed == 3

    asyncio.run(run())


async def _pairs_run(clock) -> tuple[MemoryStore, str]:
    """Merges of two contributions of fragment 0: `unit` with a 4x batch keeps its weight once `a`'s
    history can check it (the share cap applies only from 3 contributions up), capped while its
    claims are unchecked; `x` with a 20x batch has it clipped, so the cap applies to it."""
    core = make_core(clock, min_quorum=2)
    run_id = core.run.run_id
    store, sink = await _ledgered(core)
    rng = np.random.default_rng(11)
    n = core.plan.fragments[0].numel
    for lid in ("a", "unit", "x"):
        join(core, lid)
    for version in range(8):
        other = "unit" if version < 5 else "x"
        for lid in ("a", other):
            await _upload(core, lid, 0, version, 0.01 * rng.normal(size=n),
                          tokens_per_step={"a": 100, "unit": 400, "x": 2000}[lid])
        await settle()
        await wait_until_async(lambda v=version: core.slots[0].version == v + 1, timeout_s=30.0, what="merged")
    assert await sink.drain(10.0)
    await sink.close()
    return store, run_id


def test_the_share_caps_inputs_are_recorded_and_replayed(clock):
    """Whether the share cap applied depends on the merge's size and on the contribution's claims:
    both are in the record (merge_inputs.share_cap_min_count, fold.claims_unverified), replay
    passes them back bit for bit, and a record that changes either is named at its merge."""
    async def run() -> None:
        store, run_id = await _pairs_run(clock)
        records = audit_lib.verify_lines([line.encode() for line in store.lines], from_genesis=True)
        assert len(records) == 8 and all(r["merge_inputs"]["share_cap_min_count"] == 3 for r in records)
        heavy = [{c["learner"]: c for c in r["contributors"]}.get("unit") or
                 {c["learner"]: c for c in r["contributors"]}["x"] for r in records]
        capped = ["share" in c["clipped"] for c in heavy]
        assert capped[0] and not any(capped[3:5]) and all(capped[5:]), capped
        assert [c["fold"]["claims_unverified"] for c in heavy] == capped
        step, outcome = await audit_replay.replay(store, run_id, 0)
        assert (outcome.mismatch, outcome.unverifiable, outcome.replayed) == ("", [], 8)

        def cap_every_merge(record: dict) -> None:
            record["merge_inputs"]["share_cap_min_count"] = 1

        store.rewrite(4, cap_every_merge)  # unit's uncapped merge, replayed as if capped
        _, changed = await audit_replay.replay(store, run_id, 0)
        assert f"fragment 0 version {records[4]['version']}" in changed.mismatch and changed.replayed == 4, changed

    asyncio.run(run())


def test_a_changed_claims_flag_names_its_merge(clock):
    async def run() -> None:
        store, run_id = await _pairs_run(clock)
        records = audit_lib.verify_lines([line.encode() for line in store.lines], from_genesis=True)

        def trusted(record: dict) -> None:
            for c in record["contributors"]:
                c["fold"]["claims_unverified"] = False

        store.rewrite(6, trusted)  # x's clipped claim, replayed as trusted: not capped, other bits
        _, changed = await audit_replay.replay(store, run_id, 0)
        assert f"fragment 0 version {records[6]['version']}" in changed.mismatch and changed.replayed == 6, changed

    asyncio.run(run())


def test_a_merge_whose_blob_the_store_pruned_is_unverifiable_not_a_mismatch(clock):
    """The store's retention (--ledger-retain-merges) collects old merges' blobs: GetBlob answers
    NOT_FOUND, and replay says the merge's blobs were not retained instead of failing."""

    class NotFound(Exception):
        def code(self):
            return grpc.StatusCode.NOT_FOUND

    async def run() -> None:
        store, run_id = await _seeded_run(clock)
        records = audit_lib.verify_lines([line.encode() for line in store.lines], from_genesis=True)
        digest = records[0]["contributors"][0]["fold"]["blob"]
        del store.blobs[digest]
        held = store.get_blob

        async def get_blob(d: str) -> bytes:
            if d not in store.blobs:
                raise NotFound(f"blob {d} not found")
            return await held(d)

        store.get_blob = get_blob
        _, outcome = await audit_replay.replay(store, run_id, 0)
        assert outcome.mismatch == ""
        pruned = [u for u in outcome.unverifiable if "pruned by the store's retention" in u]
        assert len(pruned) == 1 and f"fragment {records[0]['fragment']} version 1" in pruned[0]
        assert "its blobs were not retained" in pruned[0]
        assert outcome.replayed > 0  # the other fragment still replays

    asyncio.run(run())


def test_the_merge_s_tighter_clip_of_an_unvouched_contribution_is_recorded_and_replayed(clock):
    """The first merge of a run: no history checks anyone's batch, so `loud` (3x the others' norm)
    is clipped in the merge at unverified_norm_ratio (2) x their median. The ratio is a merge input:
    replay reproduces the merge with it, and a record that drops it (the 4x clip) is named."""
    async def run() -> None:
        core = make_core(clock, min_quorum=3)
        run_id = core.run.run_id
        store, sink = await _ledgered(core)
        rng = np.random.default_rng(5)
        n = core.plan.fragments[0].numel
        common = rng.normal(size=n)
        for lid, scale in (("a", 1.0), ("b", 1.0), ("loud", 3.0)):
            join(core, lid)
            await _upload(core, lid, 0, 0, 0.01 * scale * (common + 0.1 * rng.normal(size=n)), tokens_per_step=100)
        await settle()
        await wait_until_async(lambda: core.slots[0].version == 1, timeout_s=30.0, what="merged")
        assert await sink.drain(10.0)
        await sink.close()
        record = audit_lib.verify_lines([line.encode() for line in store.lines], from_genesis=True)[0]
        assert record["merge_inputs"]["unverified_norm_ratio"] == 2.0
        loud = {c["learner"]: c for c in record["contributors"]}["loud"]
        assert "norm_in_merge" in loud["clipped"] and loud["fold"]["claims_unverified"]
        _, outcome = await audit_replay.replay(store, run_id, 0)
        assert (outcome.mismatch, outcome.replayed) == ("", 1)

        def without(record: dict) -> None:
            del record["merge_inputs"]["unverified_norm_ratio"]

        store.rewrite(0, without)
        _, changed = await audit_replay.replay(store, run_id, 0)
        assert f"fragment 0 version {record['version']}" in changed.mismatch, changed

    asyncio.run(run())
