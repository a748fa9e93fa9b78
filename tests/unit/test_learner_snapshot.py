"""The learner's snapshot (ddiloco/learner/snapshot.py) and LearnerLoop.resume.

The file round-trips every array bit for bit; a write that dies before its rename leaves the
previous snapshot usable; a damaged file or one of another run, model or fragment plan is refused
with a warning (never an exception). Resuming keeps the snapshot's un-merged progress by rebasing
it onto the current global fragment, takes a contribution pending at the snapshot as merged, and
drops the progress of fragments the previous life contributed after the snapshot (the journal):
work is never counted twice. numpy fakes stand in for the train step and the SyncClient.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import optax
import pytest

from ddiloco.algo import fragments as fragments_lib
from ddiloco.data import corpus
from ddiloco.v1 import common_pb2, syncer_pb2
from ddiloco.learner import client as client_lib
from ddiloco.learner import loop as loop_lib
from ddiloco.learner import snapshot as snapshot_lib
from tests import fakes

_OPT = optax.adamw(1e-2)
_IDENTITY = snapshot_lib.RunIdentity(run_id="run-a", model_fingerprint="f" * 64, plan_digest="d" * 64,
                                     learner_id="learner-0")


class _Step:
    """A numpy train step with a real optax AdamW state (gradient: the parameters themselves)."""

    def place_params(self, params):
        return {k: np.asarray(v, np.float32) for k, v in params.items()}

    def init_opt_state(self, params):
        return _OPT.init(params)

    def __call__(self, params, opt_state, batch):
        updates, opt_state = _OPT.update(params, opt_state, params)
        return {k: np.asarray(v, np.float32) for k, v in optax.apply_updates(params, updates).items()}, opt_state, 1.0

    def to_host(self, value):
        return np.asarray(value)

    def place(self, name, value):
        return np.asarray(value, np.float32)


def _plan():
    specs = [fragments_lib.TensorSpec("a", (4, 4)), fragments_lib.TensorSpec("b", (8,))]
    return fragments_lib.plan_fragments(specs, 2, 2), specs


def _loop(version: int = 0, instance: str = "life-1", values=None):
    """A two-fragment loop (upload trigger: fragments due every step) holding `version` of every fragment."""
    plan, specs = _plan()
    params = {s.name: np.full(s.shape, 0.5, np.float32) for s in specs}
    client = fakes.RecordingSyncClient()
    loop = loop_lib.LearnerLoop(plan=plan, params=params, train_step=_Step(), sampler=fakes.NullSampler(), client=client,
                                learner_id="learner-0", incarnation=1, on_arrival="rebase", round_trigger="upload")
    return loop, client, plan


def _deliver(loop, client, plan, version, values, instance="life-1"):
    client.inbox = [client_lib.GlobalFragment(f.fragment_id, version, instance, values[f.fragment_id])
                    for f in plan.fragments]
    loop.apply_updates()


def _progress(loop, fid):
    frag = loop.plan.fragments[fid]
    return loop.global_copy[fid] - fragments_lib.flatten_fragment(loop.params, frag)


def _trained_loop(steps: int):
    loop, client, plan = _loop()
    start = {f.fragment_id: fragments_lib.flatten_fragment(loop.params, f) for f in plan.fragments}
    _deliver(loop, client, plan, 0, start)
    for _ in range(steps):
        loop.step()
    return loop, client, plan


def _snapshot(loop) -> snapshot_lib.LearnerSnapshot:
    sampler = corpus.BatchSampler(np.arange(1000, dtype=np.uint16), 2, 8, seed=3)
    sampler.next()
    return loop.export_snapshot(_IDENTITY, sampler.position(), data_shard=0)


def _leaves(opt_state):
    return snapshot_lib.opt_state_to_host(opt_state)


def test_a_snapshot_round_trips_every_array_bit_for_bit(tmp_path):
    loop, _, _ = _trained_loop(5)
    snap = _snapshot(loop)
    assert snap.pending, "the upload trigger leaves contributions in flight: they must be kept too"
    store = snapshot_lib.SnapshotStore(tmp_path)
    written = store.write(snap)
    back = store.load()
    assert written.bytes == os.path.getsize(store.path)
    assert back.identity == _IDENTITY and back.step == 5 and back.held == snap.held
    assert back.sampler == snap.sampler and back.data_shard == 0
    for name in snap.params:
        np.testing.assert_array_equal(back.params[name], snap.params[name])
    assert back.opt_leaves.keys() == snap.opt_leaves.keys()
    for name, leaf in snap.opt_leaves.items():
        assert back.opt_leaves[name].dtype == leaf.dtype and back.opt_leaves[name].shape == leaf.shape
        np.testing.assert_array_equal(back.opt_leaves[name], leaf)
    for fid in snap.global_copy:
        np.testing.assert_array_equal(back.global_copy[fid], snap.global_copy[fid])
    np.testing.assert_array_equal(back.c_steps, snap.c_steps)
    for fid, record in snap.pending.items():
        assert (back.pending[fid].mark_step, back.pending[fid].steps) == (record.mark_step, record.steps)
        np.testing.assert_array_equal(back.pending[fid].values, record.values)


def test_a_write_that_dies_before_its_rename_leaves_the_previous_snapshot(tmp_path, monkeypatch):
    loop, _, _ = _trained_loop(3)
    store = snapshot_lib.SnapshotStore(tmp_path)
    store.write(_snapshot(loop))
    loop.step()

    def crash(*_args):
        raise OSError("killed mid-write")

    monkeypatch.setattr(snapshot_lib.os, "replace", crash)
    with pytest.raises(OSError):
        store.write(_snapshot(loop))
    monkeypatch.undo()
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir())  # the torn new file is there...
    assert store.load_matching(_IDENTITY).step == 3  # ...and ignored: the previous snapshot loads


def test_a_damaged_snapshot_is_refused_with_a_warning_not_an_exception(tmp_path, caplog):
    loop, _, _ = _trained_loop(2)
    store = snapshot_lib.SnapshotStore(tmp_path)
    store.write(_snapshot(loop))
    store.path.write_bytes(store.path.read_bytes()[:-100])  # torn by something other than our writes
    with caplog.at_level(logging.WARNING, logger="ddiloco.learner"):
        assert store.load_matching(_IDENTITY) is None
    assert "not resuming" in caplog.text and "unreadable" in caplog.text


@pytest.mark.parametrize("field", ["run_id", "model_fingerprint", "plan_digest", "learner_id"])
def test_a_snapshot_of_another_run_model_plan_or_learner_is_refused(tmp_path, caplog, field):
    loop, _, _ = _trained_loop(2)
    store = snapshot_lib.SnapshotStore(tmp_path)
    store.write(_snapshot(loop))
    other = snapshot_lib.RunIdentity(**{**_IDENTITY.__dict__, field: "something-else"})
    with caplog.at_level(logging.WARNING, logger="ddiloco.learner"):
        assert store.load_matching(other) is None
    assert f"another {field.replace('_', ' ')}" in caplog.text and "starting from the global model" in caplog.text
    assert store.load_matching(_IDENTITY) is not None  # left in place, for the run it belongs to


def test_the_plan_digest_changes_with_the_fragment_plan():
    def config(num_fragments, period):
        infos = [common_pb2.FragmentInfo(fragment_id=i, numel=10) for i in range(num_fragments)]
        return syncer_pb2.RunConfig(run_id="r", model_fingerprint="f", fragments=infos, sync_period_steps=period)

    digests = {snapshot_lib.run_identity(config(n, h), "l").plan_digest for n, h in [(2, 4), (3, 4), (2, 8)]}
    assert len(digests) == 3
    assert snapshot_lib.run_identity(config(2, 4), "l") == snapshot_lib.run_identity(config(2, 4), "l")


def test_the_journal_names_fragments_sent_after_a_step_and_skips_a_torn_line(tmp_path):
    store = snapshot_lib.SnapshotStore(tmp_path)
    store.note_sent(0, 4)
    store.note_sent(1, 7)
    with open(store.journal_path, "a") as f:
        f.write('{"fragment": 3, "st')  # died while writing: that upload never started
    assert store.sent_since(4) == {1}
    assert store.sent_since(0) == {0, 1}


def test_resume_restores_the_optimizer_state_counters_and_step(tmp_path):
    loop, _, _ = _trained_loop(6)
    snap = _snapshot(loop)
    fresh, _, _ = _loop()
    store = snapshot_lib.SnapshotStore(tmp_path)
    store.write(snap)
    fresh.resume(store.load(), sent_after=set())  # through the file: shapes and dtypes as written
    assert fresh.stats.steps == fresh.stats.resumed_from_step == 6
    for name, leaf in _leaves(loop.opt_state).items():
        np.testing.assert_array_equal(_leaves(fresh.opt_state)[name], leaf, strict=True)
    assert int(_leaves(fresh.opt_state)["[0].count"]) == 6  # AdamW's step count: the LR schedule goes on


def _snapshot_with_progress():
    """A loop with un-merged progress on both fragments, one contribution pending on fragment 0."""
    loop, client, plan = _loop()
    start = {f.fragment_id: fragments_lib.flatten_fragment(loop.params, f) for f in plan.fragments}
    _deliver(loop, client, plan, 0, start)
    loop.step()  # both fragments due: one contribution each, in flight
    del loop.pending[1]  # fragment 1: as if its contribution was refused; its progress is un-merged
    loop.step()
    return loop, plan, _snapshot(loop)


def test_a_restored_optimizer_state_is_placed_like_a_fresh_one_so_the_step_is_not_recompiled():
    import jax
    import jax.numpy as jnp

    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    template = jax.jit(_OPT.init)(params)  # what TrainStep.init_opt_state returns without a mesh
    leaves = snapshot_lib.opt_state_to_host(template)
    restored = snapshot_lib.opt_state_from_host(template, leaves)
    committed = [(x.committed, x.sharding) for x in jax.tree_util.tree_leaves(restored)]
    # Committed leaves (the old device_put) made every step after a fragment arrived recompile.
    assert committed == [(x.committed, x.sharding) for x in jax.tree_util.tree_leaves(template)]
    pinned = jax.tree_util.tree_map(lambda x: jax.device_put(x, x.sharding), template)  # a mesh's placement
    assert all(x.committed for x in jax.tree_util.tree_leaves(snapshot_lib.opt_state_from_host(pinned, leaves)))


def test_resume_rebases_unmerged_progress_onto_the_current_global_fragment():
    loop, plan, snap = _snapshot_with_progress()
    progress = {fid: _progress(loop, fid) for fid in (0, 1)}
    fresh, client, _ = _loop()
    fresh.resume(snap, sent_after=set())
    current = {fid: snap.global_copy[fid] + 0.25 for fid in (0, 1)}  # others' merges since the snapshot
    _deliver(fresh, client, plan, 5, current, instance="life-2")
    # Fragment 1: all of its progress is kept, on top of the new global values, and its counters.
    np.testing.assert_allclose(_progress(fresh, 1), progress[1], atol=1e-6)
    assert fresh.c_steps[1] == loop.c_steps[1] == 2
    # Fragment 0: the pending contribution is taken as merged: only the work after it remains.
    pending = snap.pending[0]
    np.testing.assert_allclose(_progress(fresh, 0), progress[0] - pending.values, atol=1e-6)
    assert fresh.c_steps[0] == max(0, loop.c_steps[0] - pending.steps)


def test_fragments_contributed_after_the_snapshot_restart_from_the_global_model():
    loop, plan, snap = _snapshot_with_progress()
    fresh, client, _ = _loop()
    done = fresh.resume(snap, sent_after={1})
    assert done["contributed_after_snapshot"] == [1] and done["pending_assumed_merged"] == [0]
    current = {fid: snap.global_copy[fid] + 0.25 for fid in (0, 1)}
    _deliver(fresh, client, plan, 5, current, instance="life-2")
    np.testing.assert_array_equal(_progress(fresh, 1), np.zeros_like(current[1]))  # never sent twice
    assert fresh.c_steps[1] == 0 and fresh.c_tokens[1] == 0


def test_resume_refuses_a_snapshot_of_other_tensors_and_changes_nothing():
    loop, _, snap = _snapshot_with_progress()
    snap.params["a"] = np.zeros((2, 2), np.float32)
    fresh, _, _ = _loop()
    before = _leaves(fresh.opt_state)
    with pytest.raises(snapshot_lib.SnapshotMismatch):
        fresh.resume(snap, sent_after=set())
    assert fresh.stats.steps == 0 and not fresh.global_copy
    assert all(np.array_equal(before[k], v) for k, v in _leaves(fresh.opt_state).items())


def test_the_sampler_continues_from_its_position_and_refuses_other_data():
    tokens = np.arange(5000, dtype=np.uint16)
    first = corpus.BatchSampler(tokens, 4, 16, seed=1)
    for _ in range(3):
        first.next()
    position = first.position()
    expected = [first.next() for _ in range(4)]
    other_life = corpus.BatchSampler(tokens, 4, 16, seed=99)  # a new life's seed
    other_life.seek(position)
    for batch in expected:
        np.testing.assert_array_equal(other_life.next(), batch)
    with pytest.raises(ValueError, match="other data"):
        corpus.BatchSampler(tokens[:4000], 4, 16, seed=1).seek(position)
