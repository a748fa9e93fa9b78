"""Fragment shards as real processes (docs/architecture.md, "Fragment shards"; issue 21, item 4).

A checkpoint store, two syncer shard processes (the same flags but --fragment-shard; 4 fragments:
shard 0 owns 0 and 2, shard 1 owns 1 and 3) and two learners pointed at shard 0, which learn the
map at their join and open a session to shard 1 themselves. Every fragment merges, on its owner
only. Then shard 1 is SIGKILLed: shard 0's fragments keep merging while it is down (counted in a
window, with the longest gap between merges), and the learners keep stepping. Restarted with the
same flags, shard 1 restores its own checkpoint (restored_from_checkpoint, versions not reset)
and its fragments merge again, with the same learners.

Without the shards code the shard flags do not exist (the syncers do not start); with a learner
that does not follow the map, fragments 1 and 3 never merge.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from ddiloco.cli import processes
from tests.integration.conftest import LEARNER_PACE, TINY, SyncerProbe, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]  # 513 s on this 2-core machine at a load of 56

OWNED = {0: {0, 2}, 1: {1, 3}}
DOWN_WINDOW_S = 8.0


def _start_shard(cluster, index: int, shard_map: str, port: int, store: str):
    svc = cluster.add(f"syncer-{index}", "services.syncer", [
        "--bind", f"127.0.0.1:{port}", "--run-id", "shards", "--ready-file",
        str(cluster.workdir / f"syncer-{index}.ready.json"), "--checkpoint-target", store,
        "--checkpoint-every-merges", "2", "--fragment-shard", str(index), "--fragment-shards", shard_map, *TINY])
    svc.start()
    svc.wait_ready(120)
    return svc


def _start_learner(cluster, index: int, syncer: str, name: str = ""):
    """learner-<index>, or `name` (an id without a number: shard 0 assigns its data shard)."""
    name = name or f"learner-{index}"
    svc = cluster.add(name, "services.learner", [
        "--syncer", syncer, "--learner-id", name, "--region", f"region-{index}", "--steps", "0",
        "--num-shards", "2", "--health-bind", "127.0.0.1:0", *LEARNER_PACE])
    svc.start()
    return svc


def _versions(probe: SyncerProbe) -> dict[int, int]:
    return {f.fragment_id: f.version for f in probe.state(0).fragments}


def _steps(probe: SyncerProbe) -> dict[str, int]:
    return {m.learner_id: m.local_step for m in probe.state(0).members}


def test_each_shard_merges_its_fragments_and_a_killed_shard_restores_while_the_other_merges_on(cluster):
    store = cluster.start_store()
    ports = [processes.preset_port(), processes.preset_port()]
    shard_map = ",".join(f"127.0.0.1:{p}" for p in ports)
    shards = [_start_shard(cluster, i, shard_map, ports[i], store.address) for i in range(2)]
    learners = [_start_learner(cluster, i, shards[0].address) for i in range(2)]
    probes = [SyncerProbe(s.address) for s in shards]
    try:
        # Every fragment merges, each on its owner; each shard shows only its own fragments.
        wait_until(lambda: all(v >= 3 for p in probes for v in _versions(p).values()), timeout_s=300,
                   what="every fragment merged 3 times on its shard")
        for index, probe in enumerate(probes):
            state = probe.state()
            assert set(_versions(probe)) == OWNED[index] and state.shard_index == index
            assert [list(s.fragment_ids) for s in state.shards] == [[0, 2], [1, 3]]
            assert {r.fragment_id for r in state.recent_merges} == OWNED[index]
            assert {m.learner_id for m in state.members} == {"learner-0", "learner-1"}
        wait_until(lambda: probes[1].state(0).last_checkpoint_outer_step > 0, timeout_s=120,
                   what="shard 1's first checkpoint")
        checkpointed = probes[1].state(0).last_checkpoint_outer_step

        # SIGKILL shard 1: shard 0 merges on, without a pause, and the learners keep stepping.
        before_versions, before_steps = _versions(probes[0]), _steps(probes[0])
        shards[1].signal(signal.SIGKILL)
        assert shards[1].wait(60) is not None  # a starved low-priority cgroup can take seconds to reap it
        killed_at = time.time()
        time.sleep(DOWN_WINDOW_S)
        state = probes[0].state()
        merged_in_window = sorted(r.merged_at_unix_s for r in state.recent_merges if r.merged_at_unix_s > killed_at)
        merged_before = [r for r in state.recent_merges if killed_at - DOWN_WINDOW_S < r.merged_at_unix_s <= killed_at]
        gaps = [b - a for a, b in zip([killed_at, *merged_in_window], merged_in_window + [time.time()])]
        after_versions, after_steps = _versions(probes[0]), _steps(probes[0])
        print(f"shard 0 while shard 1 was down: {len(merged_in_window)} merges in {DOWN_WINDOW_S:.0f} s, "
              f"longest gap {max(gaps):.2f} s ({len(merged_before)} in the {DOWN_WINDOW_S:.0f} s before); versions {before_versions} -> {after_versions}; "
              f"learner steps {before_steps} -> {after_steps}")
        assert all(after_versions[f] >= before_versions[f] + 2 for f in OWNED[0]), (before_versions, after_versions)
        assert max(gaps) < DOWN_WINDOW_S / 2, gaps  # no pause for the length of the outage
        assert all(after_steps[name] > before_steps[name] for name in before_steps), (before_steps, after_steps)
        assert all(learner.alive() for learner in learners)

        # Restarted with the same flags (and port): shard 1 restores its own checkpoint, and its
        # fragments merge again with the same learners.
        shards[1].start()
        shards[1].wait_ready(120)
        ready = json.loads(shards[1].ready_file.read_text())
        restored = {int(f): v["version"] for f, v in ready["fragments"].items()}
        assert ready["restored"] and ready["outer_steps"] >= checkpointed, ready
        assert set(restored) == OWNED[1] and all(v > 0 for v in restored.values()), restored  # not reset
        print(f"shard 1 restarted: restored outer step {ready['outer_steps']} (checkpointed >= {checkpointed}), "
              f"versions {restored}")
        probes[1].close()
        probes[1] = SyncerProbe(shards[1].address)
        assert probes[1].state(0).restored_from_checkpoint
        wait_until(lambda: all(_versions(probes[1])[f] >= restored[f] + 2 for f in OWNED[1]), timeout_s=180,
                   what="shard 1's fragments merging again after its restart")
        assert all(learner.alive() for learner in learners)
        assert {m.learner_id for m in probes[1].state(0).members} == {"learner-0", "learner-1"}
    finally:
        for probe in probes:
            probe.close()
        for learner in learners:  # before the shards: a learner leaving a dead syncer waits out its retries
            learner.stop(15.0)
