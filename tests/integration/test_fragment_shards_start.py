"""A learner's start against fragment shards, with real processes (issue 21 leftovers 1 and 2).

A checkpoint store and shard 0 of a 2-shard map (4 fragments: shard 0 owns 0 and 2, shard 1 owns
1 and 3); shard 1 is not started yet. Learner "alpha", pointed at shard 0, joins it and trains:
fragments 0 and 2 merge. Its steps on fragments 1 and 3 are kept while shard 1 is down. Shard 1 is
then started: alpha's session to it (re-joining in the background) joins, and its first
contribution to a shard-1 fragment carries every step taken since the learner started (at least
its local step when shard 1 came up): nothing was discarded. Learner "beta" is then given shard
1's address only: it learns the map there, joins shard 0 first, which assigns its data shard
(data_shard_assigned on shard 0, the same data shard recorded by shard 1), and both shards count it.

Before the change alpha's join failed (it waited for shard 1 and exited with status 3), and beta
pinned its fallback data shard: shard 0 recorded it as not assigned.
"""

from __future__ import annotations

import pytest

from ddiloco.cli import processes
from tests.integration.conftest import SyncerProbe, wait_until
from tests.integration.test_fragment_shards import _start_learner, _start_shard

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def _versions(probe: SyncerProbe) -> dict[int, int]:
    return {f.fragment_id: f.version for f in probe.state(0).fragments}


def _member(probe: SyncerProbe, learner_id: str):
    return next((m for m in probe.state(0).members if m.learner_id == learner_id), None)


def _contributions(probe: SyncerProbe, learner_id: str) -> list:
    """(version, fragment, steps, local_step) of the learner's merged contributions, oldest first."""
    return sorted((r.version, r.fragment_id, c.steps, c.local_step) for r in probe.state().recent_merges
                  for c in r.contributors if c.learner_id == learner_id)


def test_a_learner_trains_while_a_shard_is_down_and_a_learner_given_any_shard_joins_shard_zero_first(cluster):
    store = cluster.start_store()
    ports = [processes.preset_port(), processes.preset_port()]
    shard_map = ",".join(f"127.0.0.1:{p}" for p in ports)
    shard0 = _start_shard(cluster, 0, shard_map, ports[0], store.address)
    alpha = _start_learner(cluster, 0, shard0.address, "alpha")
    probes = [SyncerProbe(shard0.address)]
    learners = [alpha]
    try:
        # Shard 1 down: alpha joins shard 0 anyway, trains, and fragments 0 and 2 merge.
        wait_until(lambda: all(v >= 2 for v in _versions(probes[0]).values()), timeout_s=300,
                   what="shard 0's fragments merged twice with shard 1 down")
        assert alpha.alive()
        step_when_up = _member(probes[0], "alpha").local_step
        assert step_when_up > 0

        shard1 = _start_shard(cluster, 1, shard_map, ports[1], store.address)
        probes.append(SyncerProbe(shard1.address))
        wait_until(lambda: _contributions(probes[1], "alpha"), timeout_s=300,
                   what="alpha's first contribution merged on shard 1")
        version, fid, steps, local_step = _contributions(probes[1], "alpha")[0]
        print(f"alpha: local step {step_when_up} when shard 1 started; its first merged contribution on "
              f"shard 1: fragment {fid} v{version}, {steps} steps (mark {local_step})")
        assert fid in (1, 3) and steps >= step_when_up, (steps, step_when_up)  # the whole outage's work

        # beta is given shard 1's address only: it learns the map there and joins shard 0 first.
        beta = _start_learner(cluster, 1, shard1.address, "beta")
        learners.append(beta)
        wait_until(lambda: all(_member(p, "beta") is not None and _member(p, "beta").local_step > 0 for p in probes),
                   timeout_s=300, what="beta joined and reporting on both shards")
        on0, on1 = _member(probes[0], "beta"), _member(probes[1], "beta")
        print(f"beta: data shard {on0.data_shard} (assigned by shard 0: {on0.data_shard_assigned}); shard 1 "
              f"records {on1.data_shard}; alpha's is {_member(probes[0], 'alpha').data_shard}")
        assert on0.data_shard_assigned and not on1.data_shard_assigned
        assert on0.data_shard == on1.data_shard != _member(probes[0], "alpha").data_shard
        assert alpha.alive() and beta.alive()
    finally:
        for probe in probes:
            probe.close()
        for learner in learners:
            learner.stop(15.0)
