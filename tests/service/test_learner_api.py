"""ddiloco.Learner (the Python API) against a real syncer servicer on 127.0.0.1:0.

The learner runs in a worker thread (its calls block, the server runs in the test's event loop);
its "training" subtracts a constant from the parameters, so no model is compiled. Every wait has
a timeout.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from ddiloco.algo import fragments as fragments_lib
from ddiloco.learner import api
from services.syncer import wire_views
from tests import fakes
from tests.service.conftest import serve_syncer

pytestmark = pytest.mark.timeout(120)

SPECS = [fragments_lib.TensorSpec("w", (16, 16)), fragments_lib.TensorSpec("b", (16,))]


def _core():
    # Two fragments due every 2 steps, one learner is a quorum, rounds called by the syncer's schedule
    # (as a real syncer runs them), random initial values (so the global model differs from the zeros given).
    return fakes.make_core(specs=SPECS, num_fragments=2, sync_period_steps=2, min_quorum=1, round_trigger="schedule")


def _given() -> dict:
    return {s.name: np.zeros(s.shape, np.float32) for s in SPECS}


def _learner(address: str, params: dict, learner_id: str = "embedded-0") -> api.Learner:
    return api.Learner(address, params, learner_id, insecure=True, join_timeout_s=30.0, finish_timeout_s=30.0,
                       call_timeout_s=5.0, retry_bound_s=5.0)


def _train(address: str, steps: int) -> tuple[api.Learner, dict]:
    """Joins, takes `steps` steps of 10 ms, leaves; returns the learner and the parameters at joining."""
    with _learner(address, _given()) as sync:
        params = sync.params
        at_join = {name: np.asarray(v) for name, v in params.items()}
        for _ in range(steps):
            params = {name: v - 1e-3 for name, v in params.items()}  # the user's inner step
            params = sync.after_step(params, tokens=100, loss=2.0)
            time.sleep(0.01)
    return sync, at_join


def test_an_embedded_learner_starts_from_the_global_model_and_all_its_work_is_merged():
    core = _core()

    async def scenario():
        async with serve_syncer(core) as served:
            published = {fid: core.fragment_digest(fid)[1] for fid in range(2)}
            sync, at_join = await asyncio.wait_for(asyncio.to_thread(_train, served.handle.address, 60), 90)
            return published, sync, at_join, wire_views.training_state(core, 0)

    published, sync, at_join, state = asyncio.run(scenario())
    # Joined: the global model replaced the given zeros, fragment by fragment.
    plan = sync._loop.plan
    for frag in plan.fragments:
        assert fragments_lib.fragment_sha256(fragments_lib.flatten_fragment(at_join, frag)) == published[frag.fragment_id]
    assert np.abs(at_join["w"]).sum() > 0
    # Trained: rounds were answered and merged while it stepped, and the last work merged on leaving.
    assert sync.stats.steps == 60 and sync.stats.tokens == 6000
    assert sync.stats.merged_contributions > 2, sync.summary()
    assert sync.all_merged is True, sync.summary()
    assert state.tokens_processed == 6000
    assert state.tokens_merged == plan.num_fragments * 6000  # work merged: 100 %
    with pytest.raises(RuntimeError, match="closed"):
        sync.after_step(sync.params, tokens=1)


def test_a_parameter_tree_that_is_not_the_syncers_model_is_refused_and_the_learner_leaves():
    core = _core()
    wrong = {"w": np.zeros((16, 8), np.float32), "bias": np.zeros(16, np.float32)}

    def join(address: str) -> None:
        with _learner(address, wrong, "embedded-wrong"):
            pytest.fail("joined with the wrong parameters")

    async def scenario():
        async with serve_syncer(core) as served:
            with pytest.raises(ValueError) as caught:
                await asyncio.wait_for(asyncio.to_thread(join, served.handle.address), 60)
            return caught

    caught = asyncio.run(scenario())
    member = core.member("embedded-wrong")
    message = str(caught.value)
    assert "params do not fit the syncer's model" in message, message
    assert "missing 1 tensor(s) of the syncer's model: b" in message, message
    assert "tensor(s) the syncer's model does not have: bias" in message, message
    assert "w: shape (16, 8), the syncer's is (16, 16)" in message, message
    assert member is not None and member.left  # it joined, then left: no round waits for it
