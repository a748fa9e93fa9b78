"""The versions a syncer keeps for stale contributions (services/syncer/versions.py): with a lossy
download codec, earlier versions are the delta encodings learners applied since, not float32
copies of the fragment, and a contribution based on one is re-anchored by adding those steps up.

Before versions.py the history held one float32 array per kept version (the first test fails
there: 4 arrays of the fragment instead of 1).
"""

from __future__ import annotations

import asyncio

import numpy as np

from ddiloco.algo import reanchor as reanchor_lib
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.syncer import publishing
from services.syncer import versions as versions_lib
from services.syncer import wire_views
from tests.fakes import FakeClock, join, make_core, settle_until


def _upload(core, learner_id: str, base: int, values: np.ndarray):
    enc = codec_lib.encode(np.asarray(values, np.float32), "fp32")
    header = syncer_pb2.UploadHeader(
        protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=1, fragment_id=0,
        base_version=base, syncer_instance=core.instance, steps=2, tokens=200,
        payload=serde.payload_info_to_proto(enc))
    return core.validate_upload_header(wire_views.upload_header(header)), enc.payload


def _array_bytes(history) -> int:
    """Bytes of the distinct float32 arrays the history hands out for its versions."""
    arrays = {id(v): v.nbytes for v in (history[k] for k in history) if isinstance(v, np.ndarray)}
    return sum(arrays.values())


def test_earlier_versions_are_kept_as_steps_and_a_stale_contribution_is_reanchored_by_them():
    async def run():
        core = make_core(FakeClock(), min_quorum=2, max_staleness_versions=3, grace_gamma=0.0, download_codec="int4")
        for lid in ("a", "b", "late"):
            join(core, lid)
        slot = core.slots[0]
        n = slot.fragment.numel
        held = {0: slot.published.copy()}
        for version in range(1, 5):
            for lid, value in (("a", 0.01 * version), ("b", -0.003)):
                ticket, payload = _upload(core, lid, version - 1, np.full(n, value))
                await core.accept_upload(ticket, payload, 0)
            await settle_until(lambda v=version: slot.version == v)
            assert slot.version == version
            held[version] = slot.published.copy()
        assert list(slot.history) == [1, 2, 3, 4]
        # One float32 array (the current version's, what learners hold), not four.
        assert _array_bytes(slot.history) == slot.published.nbytes
        assert slot.history[4] is slot.published
        assert isinstance(slot.history[1], versions_lib.EarlierVersion)
        delta = np.linspace(-0.1, 0.1, n).astype(np.float32)
        ticket, payload = _upload(core, "late", 1, delta)
        await core.accept_upload(ticket, payload, 0)
        assert slot.round is not None and slot.round.learners == {"late"}
        # The learner holds version 1 - delta; against version 4 its outer gradient is the
        # difference (float32 rounding of the learners' additions aside: a few ulps of the values).
        want = held[4].astype(np.float64) - (held[1].astype(np.float64) - delta)
        np.testing.assert_allclose(slot.round.accumulator.result(), want, rtol=0, atol=4e-7)

    asyncio.run(run())


def test_the_steps_add_up_to_the_float32_difference_within_the_additions_rounding():
    rng = np.random.default_rng(1)
    n = 4096
    publisher = publishing.Publisher(download_codec="int4", block_size=128, zstd_level=3)
    params = (rng.standard_normal(n) * 0.02).astype(np.float32)
    held = [params.copy()]
    history = versions_lib.VersionHistory(0, held[0])
    for version in range(1, 5):
        params = params - (rng.standard_normal(n) * 1e-3).astype(np.float32)
        published, step = publisher.error_fed_delta(held[-1], params)
        history.advance(version, published, 5, step)
        held.append(published)
    delta = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    for base in range(4):
        got = reanchor_lib.reanchor(delta, history[base], held[-1])
        exact = reanchor_lib.reanchor(delta, held[base], held[-1])
        # Half an ulp of the values per learner addition since `base`, plus the sums' own
        # rounding: ~1e-9 here, against int4's error of ~1e-4 per step.
        ulp = np.spacing(np.float32(max(np.abs(h).max() for h in held)))
        assert np.abs(got - exact).max() <= ulp * (0.5 * (4 - base) + 1)
        assert np.abs(got - exact).max() < 1e-5 * np.abs(exact - delta).max()
    assert list(history) == [0, 1, 2, 3, 4]
    history.advance(5, publisher.error_fed_delta(held[-1], params)[0], 3, None)
    # A version without a step (downloaded whole): the steps lead no further, only arrays remain.
    assert list(history) == [4, 5]
