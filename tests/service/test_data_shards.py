"""Data shards assigned at join, through a real in-process syncer on 127.0.0.1:0 and the learners'
real sync clients (no JAX, no training).

Learners whose ids carry no shard number (`--learner-id auto`: `<region>-<container id>` in compose)
ask the syncer for a shard; it hands out the ones no live learner trains, so they never collide as
sha256(id) % shards did. The assignment is visible in the training state, which is where the
compose end-to-end test and `ddiloco status` read it. Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from ddiloco.algo import fragments as fragments_lib
from ddiloco.cli import render
from ddiloco.rpc import security
from ddiloco.v1 import syncer_pb2
from ddiloco.learner import client as client_lib
from services.learner import config as learner_config
from services.syncer import config as config_lib
from tests.fakes import make_core
from tests.service.conftest import serve_syncer

pytestmark = pytest.mark.timeout(120)

SPECS = [fragments_lib.TensorSpec("w", (64, 32))]
NUM_SHARDS = 6
# Three learners per region, ids as `--learner-id auto` makes them in compose (hex container ids,
# some ending in letters, some in digits).
AUTO_IDS = [f"region-{r}-{h}" for r, h in (("a", "3f2a9c1b0e1a"), ("a", "77c0ffee00b2"), ("a", "0d15ea5e0c30"),
                                           ("b", "c0ffee123abc"), ("b", "deadbeef0042"), ("b", "0badf00d000f"))]


def _client(address: str, learner_id: str, incarnation: int = 1) -> client_lib.SyncClient:
    """A sync client configured as `ddiloco learner` configures it (services/learner/__main__.py)."""
    cfg = learner_config.LearnerConfig(learner_id=learner_id, num_shards=NUM_SHARDS, insecure=True)
    return client_lib.SyncClient(client_lib.ClientConfig(
        target=address, learner_id=learner_id, incarnation=incarnation, region=learner_id.split("-")[1],
        tokens_per_step=0, call_timeout_s=5.0, retry_bound_s=10.0, security=security.ClientSecurity(insecure=True),
        num_data_shards=cfg.num_shards, data_shard=cfg.pinned_shard_index,
        fallback_data_shard=cfg.resolved_shard_index))


def test_learners_with_container_ids_train_distinct_shards_and_keep_them_across_restarts():
    async def run():
        cfg = config_lib.SyncerConfig(num_fragments=1, sync_period_steps=1, upload_codec="fp32")
        core = make_core(config=cfg, specs=SPECS, initial_std=0.0, grace_gamma=0.0, max_grace_s=0.0)
        async with serve_syncer(core, auth=False) as served:
            clients: list[client_lib.SyncClient] = []
            try:
                for learner_id in AUTO_IDS + ["learner-9"]:  # learner-9: a numbered id pins shard 9 % 6 = 3
                    client = _client(served.handle.address, learner_id)
                    clients.append(client)
                    await asyncio.wait_for(asyncio.to_thread(client.start, 20.0), 30)
                state = (await served.stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(), timeout=10)).state
                shards = {m.learner_id: (m.data_shard, m.data_shard_assigned, m.num_data_shards)
                          for m in state.members}
                auto = [shards[lid] for lid in AUTO_IDS]
                # Every learner with a container id trains its own shard, chosen by the syncer, and
                # trains the one the state shows.
                assert sorted(s for s, _, _ in auto) == list(range(NUM_SHARDS)), shards
                assert all(assigned and n == NUM_SHARDS for _, assigned, n in auto), shards
                assert [c.data_shard for c in clients[:len(AUTO_IDS)]] == [s for s, _, _ in auto]
                # The numbered id keeps its own shard (existing behaviour), recorded as pinned.
                assert shards["learner-9"] == (3, False, NUM_SHARDS) and clients[-1].data_shard == 3
                # `ddiloco status --json` shows every shard, shard 0 included (proto JSON omits zeros).
                listed = {m["learner_id"]: m["data_shard"]
                          for m in json.loads(render.status_json(state))["members"]}
                assert listed == {lid: s for lid, (s, _, _) in shards.items()}
                # A learner restarts (a new life, as a restarted container): it gets its shard back.
                before = clients[1].data_shard
                await asyncio.to_thread(clients[1].close, leave=False)
                clients[1] = _client(served.handle.address, AUTO_IDS[1], incarnation=2)
                await asyncio.wait_for(asyncio.to_thread(clients[1].start, 20.0), 30)
                assert clients[1].data_shard == before
            finally:
                for client in clients:
                    await asyncio.to_thread(client.close, leave=True)

    asyncio.run(run())
