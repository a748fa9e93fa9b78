"""SyncerCore under load, without gRPC: what keeps refusals and memory flat as learners grow.

Admission pins the base version (the syncer's own queueing never makes an admitted contribution
stale), concurrent watchers share one encode of a version, the number of decoded contributions
waiting for a fragment's lock is bounded, and the direction check keeps a bounded number of
references. The clock is a fake; every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import threading
import weakref

import numpy as np
import pytest

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import robust as robust_lib
from ddiloco.rpc import errors
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.syncer import admission as admission_lib
from services.syncer import wire_views
from tests.fakes import FakeClock, join, make_core, settle
from tests.waits import wait_until_async


def _header(core, learner_id: str, fid: int, base: int, enc: codec_lib.EncodedPayload) -> admission_lib.UploadHeader:
    """An UploadHeader's plain form, as the servicer passes it to the core."""
    return wire_views.upload_header(syncer_pb2.UploadHeader(
        protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=1, fragment_id=fid,
        base_version=base, syncer_instance=core.instance, steps=2, tokens=200,
        payload=serde.payload_info_to_proto(enc)))


def _encode(values: np.ndarray) -> codec_lib.EncodedPayload:
    return codec_lib.encode(np.asarray(values, np.float32), "fp32")


def test_a_contribution_admitted_within_the_staleness_bound_is_not_refused_when_merges_pass_it(clock):
    async def run():
        core = make_core(clock, min_quorum=1, max_staleness_versions=0, grace_gamma=0.0)
        for lid in ("early", "late"):
            join(core, lid)
        slot = core.slots[0]
        n = slot.fragment.numel
        late = _encode(np.linspace(-0.1, 0.1, n))
        # The late learner's header arrives at version 0 (within the bound: staleness 0)...
        ticket = core.validate_upload_header(_header(core, "late", 0, 0, late))
        # ...then, while its payload streams in, another contribution merges: version 0 leaves
        # the history (staleness 0 keeps only the current version).
        early = _encode(np.full(n, 0.01))
        await core.accept_upload(core.validate_upload_header(_header(core, "early", 0, 0, early)), early.payload, 0)
        await settle()
        assert slot.version == 1 and 0 not in slot.history
        response = await core.accept_upload(ticket, late.payload, 0)
        assert not response.duplicate
        assert core.uploads["rejected_stale"] == 0
        await settle()
        assert slot.version == 2
        assert [c.base_version for c in core.rounds.merges[-1].contributors] == [0]

    asyncio.run(run())


def test_the_correction_uses_the_pinned_base_values(clock):
    async def run():
        core = make_core(clock, min_quorum=2, max_staleness_versions=0, grace_gamma=0.0)
        for lid in ("a", "b", "late"):
            join(core, lid)
        slot = core.slots[0]
        n = slot.fragment.numel
        v0 = slot.published.copy()
        delta = np.linspace(-0.1, 0.1, n).astype(np.float32)
        late = _encode(delta)
        ticket = core.validate_upload_header(_header(core, "late", 0, 0, late))
        for lid, value in (("a", 0.01), ("b", -0.02)):
            enc = _encode(np.full(n, value))
            await core.accept_upload(core.validate_upload_header(_header(core, lid, 0, 0, enc)), enc.payload, 0)
        await settle()
        assert slot.version == 1 and 0 not in slot.history
        v1 = slot.published.copy()
        await core.accept_upload(ticket, late.payload, 0)
        assert slot.round is not None and slot.round.learners == {"late"}
        np.testing.assert_allclose(slot.round.accumulator.result(), v1 - (v0 - delta), rtol=1e-5, atol=1e-6)

    asyncio.run(run())


def test_a_base_already_out_of_the_history_at_admission_is_still_refused():
    async def run():
        core = make_core(FakeClock(), min_quorum=1, max_staleness_versions=0, grace_gamma=0.0)
        join(core, "a")
        join(core, "b")
        n = core.slots[0].fragment.numel
        enc = _encode(np.full(n, 0.01))
        await core.accept_upload(core.validate_upload_header(_header(core, "a", 0, 0, enc)), enc.payload, 0)
        await settle()
        with pytest.raises(errors.FailedPrecondition, match="stale"):
            core.validate_upload_header(_header(core, "b", 0, 0, enc))

    asyncio.run(run())


def test_a_compressed_whole_version_is_kept_only_while_someone_holds_it():
    # Gaussian float32 values shrink ~1.08x with zstd: the whole version is a compressed copy of
    # the fragment, which the slot kept until the next merge (4 bytes per parameter at the peak).
    async def run():
        core = make_core(FakeClock(), specs=[fragments_lib.TensorSpec("w", (50_000,))], num_fragments=1)
        slot = core.slots[0]
        version, encoded = await core.publisher.encoded_payload(slot)
        assert version == 0 and encoded.compression == "zstd"
        assert slot.encoded is encoded and (await core.publisher.encoded_payload(slot))[1] is encoded  # shared while held
        held = weakref.ref(encoded)
        del encoded
        await settle()  # the encode's finished futures leave the loop's queue
        assert held() is None and slot.encoded is None

    asyncio.run(run())


def test_watchers_asking_at_once_share_one_encode():
    async def run():
        core = make_core(FakeClock())
        slot = core.slots[1]
        assert slot.encoded is None
        results = await asyncio.gather(*(core.publisher.encoded_payload(slot) for _ in range(8)))
        assert {version for version, _ in results} == {0}
        assert len({id(encoded) for _, encoded in results}) == 1
        assert results[0][1] is slot.encoded
        values = codec_lib.decode(slot.encoded.payload, codec="fp32", numel=slot.fragment.numel,
                                  raw_size_bytes=slot.encoded.raw_size_bytes, checksum=slot.encoded.checksum)
        np.testing.assert_array_equal(values, slot.published)

    asyncio.run(run())


def test_decoded_contributions_waiting_at_once_are_bounded(monkeypatch):
    decoding, most, release = [0], [0], threading.Event()
    lock = threading.Lock()
    real_decode = serde.decode_described

    def slow_decode(info, payload, **kwargs):
        with lock:
            decoding[0] += 1
            most[0] = max(most[0], decoding[0])
        try:
            assert release.wait(20), "the test never released the decodes"
            return real_decode(info, payload, **kwargs)
        finally:
            with lock:
                decoding[0] -= 1

    # What admission decodes a header's plain payload description with (services/syncer/admission.py).
    monkeypatch.setattr(serde, "decode_described", slow_decode)

    async def run():
        core = make_core(FakeClock(), min_quorum=10, grace_gamma=0.0, max_decoding=2)
        learners = [f"l{i}" for i in range(5)]
        uploads = []
        for i, lid in enumerate(learners):
            join(core, lid)
            fid = i % 2
            enc = _encode(np.full(core.slots[fid].fragment.numel, 0.01 * (i + 1)))
            ticket = core.validate_upload_header(_header(core, lid, fid, 0, enc))
            uploads.append(asyncio.ensure_future(core.accept_upload(ticket, enc.payload, 0)))
        await wait_until_async(lambda: decoding[0] == 2, timeout_s=10, what="two decodes at once")
        # The others had every chance to start decoding too (as settle() does).
        await asyncio.sleep(0.2)
        assert decoding[0] == 2
        release.set()
        responses = await asyncio.wait_for(asyncio.gather(*uploads), 20)
        assert not any(r.duplicate for r in responses)
        assert most[0] == 2
        assert sum(len(s.round.contributions) for s in core.slots if s.round) == 5

    try:
        asyncio.run(run())
    finally:
        release.set()


def _unit(numel: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(numel)
    return (v / np.linalg.norm(v)).astype(np.float32)


def test_direction_references_are_bounded_and_age_out():
    frag = fragments_lib.plan_fragments([fragments_lib.TensorSpec("w", (64,))], 1, 1).fragments[0]
    policy = robust_lib.DirectionPolicy(max_references=4, max_age_versions=2)
    history = robust_lib.DirectionHistory(policy, frag)
    for i in range(10):
        history.add(f"l{i}", _unit(64, i), version=10)
    assert history.references("someone", 10) == 4  # the 4 most recently accepted
    assert history.references("l9", 10) == 3 and history.references("l5", 10) == 4  # l5 was evicted
    history.add("l0", _unit(64, 0), version=13)  # versions 10 are now older than 13 - 2
    assert history.references("someone", 13) == 1
    with pytest.raises(ValueError, match="max_references"):
        robust_lib.DirectionPolicy(max_references=1, min_others=2)


def test_direction_compare_is_the_upper_median_cosine():
    frag = fragments_lib.plan_fragments([fragments_lib.TensorSpec("w", (3,))], 1, 1).fragments[0]
    history = robust_lib.DirectionHistory(robust_lib.DirectionPolicy(), frag)
    for lid, vec in (("a", [1, 0, 0]), ("b", [0, 1, 0]), ("c", [-1, 0, 0]), ("d", [0.6, 0.8, 0])):
        history.add(lid, np.asarray(vec, np.float32), version=1)
    cosine, others = history.compare("x", np.asarray([1, 0, 0], np.float32), version=1)
    assert others == 4 and cosine == pytest.approx(0.6)  # sorted -1, 0, 0.6, 1: the upper middle
