"""Inner optimizer config, the jitted train step and held-out evaluation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddiloco.data import BatchSampler, heldout_batches, load_stdlib_documents, split_corpus
from ddiloco.models import get_model
from services.learner.train import InnerOptConfig, TrainStep, make_eval_fn, make_inner_optimizer


@pytest.fixture(scope="module")
def tiny():
    return get_model("transformer", {"preset": "tiny"})


@pytest.fixture(scope="module")
def corpus():
    return split_corpus(load_stdlib_documents(max_bytes=2 * 2**20), num_shards=2)


@pytest.fixture(scope="module")
def train_step(tiny):
    return TrainStep(tiny, make_inner_optimizer(InnerOptConfig()))


@pytest.mark.parametrize(
    "field, value",
    [
        ("learning_rate", 0.0),
        ("warmup_steps", -1),
        ("weight_decay", -0.1),
        ("b1", 1.0),
        ("b2", -0.5),
        ("grad_clip_norm", 0.0),
        ("decay_steps", -1),
        ("final_lr_fraction", 1.5),
    ],
)
def test_inner_opt_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        InnerOptConfig(**{field: value})


def test_weight_decay_applies_to_matrices_only(tiny):
    params = tiny.init(jax.random.key(0))
    optimizer = make_inner_optimizer(InnerOptConfig(learning_rate=0.1, warmup_steps=0, weight_decay=0.5))
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(optimizer.update)(zero_grads, optimizer.init(params), params)
    for name, update in updates.items():
        expected = -0.1 * 0.5 * params[name] if params[name].ndim >= 2 else 0.0
        np.testing.assert_allclose(update, expected, rtol=1e-6, err_msg=name)


def test_learning_rate_warms_up_linearly_then_stays_constant(tiny):
    params = tiny.init(jax.random.key(0))
    optimizer = make_inner_optimizer(InnerOptConfig(learning_rate=0.01, warmup_steps=3, weight_decay=0.0))
    state = optimizer.init(params)
    # With constant gradients Adam's normalized step is exactly 1, so |update| == LR.
    grads = jax.tree.map(jnp.ones_like, params)
    update, step_sizes = jax.jit(optimizer.update), []
    for _ in range(6):
        updates, state = update(grads, state, params)
        step_sizes.append(float(jnp.abs(updates["head"]).max()))
    np.testing.assert_allclose(step_sizes, [0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01], rtol=1e-4)


def test_learning_rate_decays_along_a_cosine_to_the_final_fraction(tiny):
    params = tiny.init(jax.random.key(0))
    cfg = InnerOptConfig(learning_rate=0.01, warmup_steps=2, weight_decay=0.0, decay_steps=6, final_lr_fraction=0.1)
    optimizer = make_inner_optimizer(cfg)
    state = optimizer.init(params)
    grads = jax.tree.map(jnp.ones_like, params)  # Adam's normalized step is 1: |update| == LR
    update, step_sizes = jax.jit(optimizer.update), []
    for _ in range(9):
        updates, state = update(grads, state, params)
        step_sizes.append(float(jnp.abs(updates["head"]).max()))
    # warm-up to the peak at step 2, a cosine over the 4 steps after it, then the floor
    cosine = [0.001 + 0.009 * 0.5 * (1 + np.cos(np.pi * k / 4)) for k in range(5)]
    np.testing.assert_allclose(step_sizes, [0.01 / 3, 0.02 / 3, *cosine, 0.001, 0.001], rtol=1e-4)


def test_decay_must_end_after_the_warmup():
    with pytest.raises(ValueError, match="decay_steps=5 must exceed warmup_steps=5"):
        InnerOptConfig(warmup_steps=5, decay_steps=5)


def test_train_step_is_deterministic_and_leaves_inputs_intact(tiny, corpus, train_step):
    params = tiny.init(jax.random.key(0))
    before = {name: np.array(p) for name, p in params.items()}
    results = []
    for _ in range(2):
        p, opt_state = params, train_step.init_opt_state(params)
        sampler = BatchSampler(corpus.shards[0], 16, tiny.seq_len, seed=0)
        for _ in range(3):
            p, opt_state, loss = train_step(p, opt_state, sampler.next())
        results.append((p, loss))
    assert isinstance(results[0][1], float) and np.isfinite(results[0][1])
    assert results[0][1] == results[1][1]
    assert all(np.array_equal(results[0][0][n], results[1][0][n]) for n in params)
    assert all(np.array_equal(params[n], before[n]) for n in params)


def test_eval_fn_is_mean_batch_loss(tiny, corpus):
    params = tiny.init(jax.random.key(0))
    batches = heldout_batches(corpus.heldout, 4, tiny.seq_len, num_batches=3)
    loss_fn = jax.jit(tiny.loss)
    expected = np.mean([float(loss_fn(params, batch)) for batch in batches])
    assert make_eval_fn(tiny)(params, batches) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="batches"):
        make_eval_fn(tiny)(params, [])


def test_training_lowers_heldout_loss(tiny, corpus, train_step):
    params = tiny.init(jax.random.key(0))
    opt_state = train_step.init_opt_state(params)
    sampler = BatchSampler(corpus.shards[0], 16, tiny.seq_len, seed=0)
    eval_fn = make_eval_fn(tiny)
    batches = heldout_batches(corpus.heldout, 16, tiny.seq_len, num_batches=8)
    initial = eval_fn(params, batches)
    for _ in range(60):
        params, opt_state, _ = train_step(params, opt_state, sampler.next())
    assert eval_fn(params, batches) < initial - 0.5
