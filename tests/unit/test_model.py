"""Model registry, transformer shapes, init loss, fingerprint and causality."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddiloco.models import MODEL_NAMES, get_model, model_fingerprint

TINY = {"preset": "tiny"}


@pytest.fixture(scope="module")
def tiny():
    model = get_model("transformer", TINY)
    return model, model.init(jax.random.key(0))


def _random_batch(model, batch_size=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, model.vocab_size, (batch_size, model.seq_len + 1), dtype=np.int32)


def test_registry_lists_transformer_and_rejects_unknown_names():
    assert "transformer" in MODEL_NAMES
    with pytest.raises(ValueError, match="transformer"):
        get_model("gpt9")


@pytest.mark.parametrize(
    "config, match",
    [
        ({"preset": "huge"}, "preset"),
        ({"preset": "tiny", "dropout": 0.1}, "dropout"),
        ({"preset": "tiny", "n_heads": 3}, "n_heads"),
        ({"preset": "tiny", "n_layers": 0}, "n_layers"),
        ({"preset": "tiny", "init_std": -1.0}, "init_std"),
    ],
)
def test_invalid_config_names_the_field(config, match):
    with pytest.raises(ValueError, match=match):
        get_model("transformer", config)


def test_default_is_small_preset_and_overrides_apply():
    assert get_model("transformer").config == get_model("transformer", {"preset": "small"}).config
    model = get_model("transformer", {"preset": "tiny", "n_layers": 2})
    assert model.config["n_layers"] == 2
    assert model.config["d_model"] == get_model("transformer", TINY).config["d_model"]


def test_tiny_tensor_names_are_stable(tiny):
    model, _ = tiny
    block = ["ln1.scale", "ln1.bias", "attn.wqkv", "attn.wo", "ln2.scale", "ln2.bias",
             "mlp.w_in", "mlp.b_in", "mlp.w_out", "mlp.b_out"]  # fmt: skip
    expected = ["embed", "pos_embed", *(f"block0.{n}" for n in block),
                "ln_f.scale", "ln_f.bias", "head"]  # fmt: skip
    assert [spec.name for spec in model.tensor_specs()] == expected
    embeddings = {spec.name for spec in model.tensor_specs() if spec.is_embedding}
    assert embeddings == {"embed", "pos_embed"}


def test_init_matches_tensor_specs(tiny):
    model, params = tiny
    specs = model.tensor_specs()
    assert list(params) == [spec.name for spec in specs]
    for spec in specs:
        assert params[spec.name].shape == spec.shape, spec.name
        assert params[spec.name].dtype == jnp.float32, spec.name
        assert params[spec.name].size == spec.numel


def test_init_is_deterministic_per_key(tiny):
    model, params = tiny
    again, other = model.init(jax.random.key(0)), model.init(jax.random.key(1))
    assert all(np.array_equal(params[n], again[n]) for n in params)
    assert not np.array_equal(params["embed"], other["embed"])


def test_small_preset_splits_into_enough_tensors():
    specs = get_model("transformer").tensor_specs()
    assert len(specs) >= 8
    assert sum(spec.numel for spec in specs) > 100_000


def test_loss_at_init_is_near_uniform(tiny):
    model, params = tiny
    loss = float(jax.jit(model.loss)(params, _random_batch(model)))
    assert abs(loss - math.log(model.vocab_size)) < 0.3


def test_round_tripped_config_rebuilds_the_same_model(tiny):
    model, _ = tiny
    rebuilt = get_model(model.name, model.config)
    assert rebuilt.config == model.config
    assert model_fingerprint(rebuilt) == model_fingerprint(model)


def test_fingerprint_is_stable_and_config_sensitive():
    first = model_fingerprint(get_model("transformer", TINY))
    assert first == model_fingerprint(get_model("transformer", TINY))
    assert len(first) == 64 and int(first, 16) >= 0
    assert first != model_fingerprint(get_model("transformer", {**TINY, "n_layers": 2}))
    assert first != model_fingerprint(get_model("transformer", {**TINY, "init_std": 0.01}))


def test_future_tokens_do_not_change_earlier_outputs(tiny):
    model, params = tiny
    batch = _random_batch(model, batch_size=2)
    changed_at = 10
    altered = batch.copy()
    altered[:, changed_at] = (altered[:, changed_at] + 1) % model.vocab_size

    # jit: op-by-op dispatch would compile every primitive separately.
    logits_fn, token_losses_fn = jax.jit(model.logits), jax.jit(model.token_losses)
    logits = logits_fn(params, batch[:, :-1])
    altered_logits = logits_fn(params, altered[:, :-1])
    np.testing.assert_array_equal(logits[:, :changed_at], altered_logits[:, :changed_at])
    assert not np.allclose(logits[:, changed_at:], altered_logits[:, changed_at:])

    # Loss term t predicts batch[:, t+1], so terms before changed_at-1 are untouched.
    losses = token_losses_fn(params, batch)
    altered_losses = token_losses_fn(params, altered)
    np.testing.assert_array_equal(losses[:, : changed_at - 1], altered_losses[:, : changed_at - 1])


def test_loss_accepts_short_batches_and_rejects_long_ones(tiny):
    model, params = tiny
    batch = _random_batch(model)
    loss_fn = jax.jit(model.loss)
    assert np.isfinite(loss_fn(params, batch[:, :9]))
    too_long = np.concatenate([batch, batch[:, :1]], axis=1)
    with pytest.raises(ValueError, match="seq_len"):
        loss_fn(params, too_long)
