"""A learner holds the initial global fragments it can compute itself (same seed, same model)
without downloading them: only fragments whose own values hash to the syncer's published sha256."""

from __future__ import annotations

import asyncio

import numpy as np

from ddiloco.v1 import syncer_pb2
from ddiloco.wire import serde
from ddiloco.learner import client as client_lib


def _client(initial_values) -> client_lib.SyncClient:
    return client_lib.SyncClient(client_lib.ClientConfig(
        target="127.0.0.1:1", learner_id="l", incarnation=1, region="r", tokens_per_step=0,
        initial_values=initial_values))


def _join_response(published: dict[int, str], versions: dict[int, int]) -> syncer_pb2.JoinResponse:
    return syncer_pb2.JoinResponse(syncer_instance="s1", published_sha256=published,
                                   fragment_versions=serde.versions_to_proto(versions))


def test_only_fragments_with_the_syncers_hash_are_held_without_download():
    rng = np.random.default_rng(0)
    own = {0: rng.standard_normal(10).astype(np.float32), 1: rng.standard_normal(6).astype(np.float32)}
    client = _client(lambda run_config: own)
    client.instance = "s1"
    # Fragment 0 is still at its initial version; fragment 1 has been merged since (other values).
    response = _join_response({0: serde.params_sha256(own[0]), 1: serde.params_sha256(own[1] + 1)}, {0: 0, 1: 3})
    asyncio.run(client._seed_from_initial_values(response))
    assert client.stats.fragments_seeded == 1
    assert {f: v for f, (v, _) in client.held_values().items()} == {0: 0}
    updates = client.take_updates()
    assert [(u.fragment_id, u.version, u.syncer_instance) for u in updates] == [(0, 0, "s1")]
    np.testing.assert_array_equal(updates[0].values, own[0])
    assert client.arrivals() == {0: 1}


def test_without_hashes_or_with_a_failing_initializer_everything_is_downloaded():
    calls = []

    def failing(run_config):
        calls.append(run_config)
        raise RuntimeError("no such model")

    for client, response in (
        (_client(lambda rc: {0: np.zeros(4, np.float32)}), _join_response({}, {0: 0})),  # an older syncer
        (_client(failing), _join_response({0: serde.params_sha256(np.zeros(4, np.float32))}, {0: 0})),
    ):
        client.instance = "s1"
        asyncio.run(client._seed_from_initial_values(response))
        assert client.stats.fragments_seeded == 0 and client.held_values() == {} and client.take_updates() == []
    assert len(calls) == 1


def test_a_mid_run_join_does_not_compute_the_initial_model():
    """Every fragment merged since the start (version > 0), or already held: the learner's own
    initialization cannot match, so it is not computed (a restart's CPU goes to training)."""
    calls = []

    def initial(run_config):
        calls.append(run_config)
        return {0: np.zeros(4, np.float32), 1: np.zeros(4, np.float32)}

    zeros_sha = serde.params_sha256(np.zeros(4, np.float32))
    client = _client(initial)
    client.instance = "s1"
    asyncio.run(client._seed_from_initial_values(_join_response({0: "a" * 64, 1: "b" * 64}, {0: 5, 1: 2})))
    assert calls == [] and client.stats.fragments_seeded == 0 and client.held_values() == {}
    # One fragment still at version 0: computed, and that fragment is held.
    asyncio.run(client._seed_from_initial_values(_join_response({0: zeros_sha, 1: "b" * 64}, {0: 0, 1: 2})))
    assert len(calls) == 1 and client.stats.fragments_seeded == 1
    assert {f: v for f, (v, _) in client.held_values().items()} == {0: 0}
    # Its only version-0 fragment already held: not computed again.
    asyncio.run(client._seed_from_initial_values(_join_response({0: zeros_sha, 1: "b" * 64}, {0: 0, 1: 2})))
    assert len(calls) == 1
