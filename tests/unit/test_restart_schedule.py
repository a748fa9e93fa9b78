"""A restarted learner's inner LR schedule: the same compiled step in every life, and the schedule
goes on from the steps its earlier lives ran (issue 20: a per-life decay horizon baked into the
step made every restart compile a new one, ~6 s under load, and warm up again)."""

from __future__ import annotations

import asyncio
import hashlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ddiloco.algo import inner as inner_lib
from ddiloco.models import get_model
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import serde
from services.learner import __main__ as learner_main
from services.learner import config as config_lib
from services.learner import train as train_lib
from services.syncer import checkpointing
from services.syncer import wire_views
from tests.fakes import FakeClock, join, make_core

TOTAL_STEPS = 300


@pytest.fixture(scope="module")
def tiny():
    return get_model("transformer", {"preset": "tiny"})


def _life(model, steps: int, start_step: int):
    """A learner life's train step and optimizer state, wired as services/learner/__main__ does."""
    cfg = config_lib.LearnerConfig(steps=steps, warmup_steps=20)
    step = train_lib.TrainStep(model, train_lib.make_inner_optimizer(cfg.inner_optimizer(schedule_offset=start_step)))
    params = jax.jit(model.init)(jax.random.PRNGKey(0))
    loop = types.SimpleNamespace(opt_state=step.init_opt_state(params),
                                 stats=types.SimpleNamespace(resumed_from_step=0, steps=0))
    assert learner_main._continue_schedule(cfg, loop, start_step) == start_step
    return cfg, step, params, loop.opt_state


def _lowered_sha256(model, step, params, opt_state) -> str:
    batch = np.zeros((2, model.seq_len + 1), np.int32)
    return hashlib.sha256(step._step.lower(params, opt_state, batch).as_text().encode()).hexdigest()


def _lr(state) -> float:
    """The LR the state's next step uses: the schedule transformation's own update of a gradient of 1."""
    sched = next(s for s in state if isinstance(s, inner_lib.InnerScheduleState))
    updates, _ = inner_lib.scale_by_inner_schedule(inner_lib.InnerOptConfig()).update({"w": jnp.ones(())}, sched)
    return -float(updates["w"])


def test_every_life_of_a_learner_lowers_the_same_step_and_continues_the_schedule(tiny):
    _, step1, params, state1 = _life(tiny, TOTAL_STEPS, 0)
    # Life 2 after a kill at step 120 (the harness passes the remaining steps); life 3 with a start
    # the syncer counted 2 steps short of the harness (the last progress report was lost): another
    # decay horizon, still the same program.
    cfg2, step2, _, state2 = _life(tiny, TOTAL_STEPS - 120, 120)
    _, step3, _, state3 = _life(tiny, TOTAL_STEPS - 200, 198)
    # A fresh state too: jit annotates committed inputs in the program, so the continued schedule's
    # leaves must be placed as a fresh init's are, or the cache key differs from the first life's.
    fresh = step1.init_opt_state(params)
    hashes = {_lowered_sha256(tiny, s, params, st)
              for s, st in ((step1, fresh), (step1, state1), (step2, state2), (step3, state3))}
    assert len(hashes) == 1

    # The schedule goes on: life 2's first LR is life 1's at step 120, on the same cosine to step 300.
    life1_lr = inner_lib.lr_schedule(config_lib.LearnerConfig(steps=TOTAL_STEPS, warmup_steps=20).inner_optimizer())
    assert cfg2.inner_optimizer(schedule_offset=120).decay_steps == TOTAL_STEPS
    assert _lr(state2) == pytest.approx(float(life1_lr(120)), rel=1e-6)
    # (not a second warm-up, which would start at peak / 21 as life 1 did)
    assert _lr(state1) == pytest.approx(float(life1_lr(0)), rel=1e-6) and _lr(state2) > 10 * _lr(state1)
    # Adam's moments are fresh, so its bias-correction count starts at 0; the schedule's does not.
    adam = next(s for s in state2 if isinstance(s, optax.ScaleByAdamState))
    assert int(adam.count) == 0 and inner_lib.schedule_count(state2) == 120


def test_one_step_of_a_continued_life_moves_the_params_at_the_continued_lr(tiny):
    """The compiled step really reads the LR from the state: two states that differ only in the
    schedule's step give updates in the ratio of their LRs (the first Adam step is +-lr per entry)."""
    _, step, params, state0 = _life(tiny, TOTAL_STEPS, 0)
    late = inner_lib.continue_schedule(state0, config_lib.LearnerConfig(steps=TOTAL_STEPS).inner_optimizer(), 250)
    batch = np.random.default_rng(0).integers(0, tiny.vocab_size, (2, tiny.seq_len + 1)).astype(np.int32)
    moved = {}
    for name, state in (("early", state0), ("late", late)):
        new, _, _ = step(params, state, batch)
        # Vectors (scales, biases) have no weight decay: their entries move by exactly +-lr.
        moved[name] = max(float(jnp.max(jnp.abs(new[k] - params[k]))) for k in new if params[k].ndim == 1)
    assert moved["late"] / moved["early"] == pytest.approx(_lr(late) / _lr(state0), rel=0.01)


def test_the_traced_schedule_is_the_warmup_and_cosine_it_replaced():
    cfg = inner_lib.InnerOptConfig(learning_rate=2e-3, warmup_steps=20, decay_steps=300, final_lr_fraction=0.1)
    warmup = lambda s: cfg.learning_rate * jnp.minimum(1.0, (s + 1) / (cfg.warmup_steps + 1))  # noqa: E731
    reference = optax.join_schedules(
        [warmup, optax.cosine_decay_schedule(cfg.learning_rate, cfg.decay_steps - cfg.warmup_steps, alpha=0.1)],
        boundaries=[cfg.warmup_steps])
    steps = np.arange(0, 400)
    np.testing.assert_allclose([float(inner_lib.lr_schedule(cfg)(s)) for s in steps],
                               [float(reference(s)) for s in steps], rtol=1e-5)
    flat = inner_lib.InnerOptConfig(learning_rate=2e-3, warmup_steps=20)  # no decay: the peak after the ramp
    assert float(inner_lib.lr_schedule(flat)(1000)) == pytest.approx(2e-3)
    assert float(inner_lib.lr_schedule(flat)(0)) == pytest.approx(2e-3 / 21)


def test_a_resumed_snapshot_keeps_its_counts_and_a_models_own_schedule_is_moved_too():
    cfg = inner_lib.InnerOptConfig(decay_steps=300)
    params = {"w": jnp.zeros((2, 2))}
    state = inner_lib.make_inner_optimizer(cfg).init(params)
    restored = inner_lib.continue_schedule(state, cfg, 77)
    kept = inner_lib.continue_schedule(restored, inner_lib.InnerOptConfig(decay_steps=500), None)
    assert inner_lib.schedule_count(kept) == 77
    sched = next(s for s in kept if isinstance(s, inner_lib.InnerScheduleState))
    assert float(sched.decay_steps) == 500  # this life's constants, the snapshot's position
    # A model's own optax chain: its schedule's count moves, Adam's count stays.
    own = optax.adamw(inner_lib.lr_schedule(cfg))
    moved = inner_lib.continue_schedule(own.init(params), cfg, 40)
    assert inner_lib.schedule_count(moved) == 40
    assert int(next(s for s in moved if isinstance(s, optax.ScaleByAdamState)).count) == 0
    assert inner_lib.schedule_count(optax.sgd(0.1).init(params)) is None


def _report(core, learner_id: str, incarnation: int, local_step: int) -> None:
    core.report_progress(wire_views.progress(syncer_pb2.ReportProgressRequest(
        protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=incarnation,
        local_step=local_step)), wire_bytes=0)


def test_the_syncer_hands_a_rejoining_learner_the_steps_of_its_earlier_lives():
    async def run():
        core = make_core(FakeClock())
        assert join(core, "a").schedule_start_step == 0  # a first life
        join(core, "b")
        _report(core, "a", 1, 90)
        _report(core, "a", 1, 120)  # its last report before the kill
        _report(core, "b", 1, 500)  # another learner's steps are not a's
        assert join(core, "a", incarnation=2).schedule_start_step == 120
        _report(core, "a", 2, 50)
        assert join(core, "a", incarnation=2).schedule_start_step == 120  # the same life re-joining
        assert join(core, "a", incarnation=3).schedule_start_step == 170
        _report(core, "a", 3, 30)
        # A restarted syncer keeps the count (its checkpoint): a's next life starts at 200.
        blobs, _ = checkpointing.encode_snapshot(await core.snapshot())
        restored = make_core(FakeClock())
        restored.restore(checkpointing.load_snapshot(blobs))
        assert join(restored, "a", incarnation=4).schedule_start_step == 200
        assert join(restored, "c").schedule_start_step == 0

    asyncio.run(run())
