"""Sync modes and delta downloads in SyncerCore, without gRPC.

* Lossy download codecs publish each version as a delta from the previous one; the values a
  learner reconstructs (previous + decoded delta) are bit-identical to the syncer's published
  values, and error feedback keeps them within one quantization step of the true parameters.
* dp mode: the syncer's AdamW on the mean of the learners' gradients equals optax AdamW applied
  to that mean directly (the data-parallel baseline is real data parallelism).
* diloco mode: unstaggered plan, no grace window, fp32, and classic DiLoCo's merge: the plain
  mean of the pseudo-gradients with equal weights (rule equal_mean), whatever the tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import inner as inner_lib
from ddiloco.algo import outer as outer_lib
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.syncer import config as config_lib
from services.syncer import core as core_lib
from services.syncer import wire_views
from tests.fakes import SPECS, join, make_core, settle, upload


def _core(clock, cfg: config_lib.SyncerConfig, **overrides) -> core_lib.SyncerCore:
    """The core as the syncer builds it from `cfg`: its outer step and grace window."""
    return make_core(clock, config=cfg, outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum,
                     grace_gamma=cfg.grace_gamma, max_grace_s=cfg.max_grace_s,
                     **({"norm_bound": cfg.norm_bound} | overrides))


def _decode(encoded: codec_lib.EncodedPayload) -> np.ndarray:
    return serde.decode_payload(serde.payload_info_to_proto(encoded), encoded.payload)


@pytest.mark.parametrize("codec", ["int8", "int4", "bf16"])
def test_delta_downloads_reconstruct_published_bit_exactly_with_error_feedback(clock, codec):
    async def run():
        cfg = config_lib.SyncerConfig(num_fragments=2, sync_period_steps=2, upload_codec="fp32", download_codec=codec,
                                      min_quorum=1, grace_gamma=0.0, max_grace_s=0.0)
        core = _core(clock, cfg)
        assert core.publisher.delta_downloads
        join(core, "l1")
        slot = core.slots[0]
        # A learner that received version 0 exactly (the full fp32 download).
        version0, full = await core.publisher.encoded_payload(slot)
        assert version0 == 0 and full.codec == "fp32"
        held = _decode(full)
        rng = np.random.default_rng(1)
        errors = []
        for version in range(1, 9):
            await upload(core, "l1", 0, slot.version, rng.normal(scale=0.05, size=slot.fragment.numel))
            core.tick()
            await settle()
            assert slot.version == version
            assert core.publisher.delta_payload(slot, version - 2) is None  # a gap gets the exact values instead
            delta_version, delta = core.publisher.delta_payload(slot, version - 1)
            assert delta_version == version and delta.codec == codec
            held = fragments_lib.apply_delta(held, _decode(delta))
            assert fragments_lib.fragment_sha256(held) == slot.published_sha256  # bit-identical to the syncer
            errors.append(float(np.max(np.abs(held - slot.params))))
            # The exact download is of the published values, not of the syncer's own parameters.
            _, exact = await core.publisher.encoded_payload(slot)
            assert fragments_lib.fragment_sha256(_decode(exact)) == slot.published_sha256
        state = wire_views.training_state(core, 0)
        assert state.fragments[0].published_sha256 == slot.published_sha256
        assert state.fragments[0].params_sha256 == fragments_lib.fragment_sha256(slot.params)
        # Error feedback: the gap to the true parameters never accumulates past one step's error.
        step_bound = codec_lib.max_abs_error_bound(codec, float(np.max(np.abs(slot.params))) + 1.0)
        assert max(errors) <= step_bound
        assert max(errors) > 0.0  # lossy indeed

    asyncio.run(run())


def test_fp32_downloads_publish_the_parameters_themselves(clock):
    async def run():
        core = _core(clock, config_lib.SyncerConfig(num_fragments=2, sync_period_steps=2, upload_codec="fp32",
                                                    download_codec="fp32"))
        assert not core.publisher.delta_downloads
        join(core, "l1")
        slot = core.slots[1]
        await upload(core, "l1", 1, 0, np.full(slot.fragment.numel, 0.01))
        core.tick()
        await settle()
        assert slot.version == 1 and slot.published is slot.params
        assert core.publisher.delta_payload(slot, 0) is None
        assert slot.published_sha256 == slot.params_sha256

    asyncio.run(run())


def test_dp_mode_applies_adamw_to_the_mean_gradient(clock):
    async def run():
        cfg = config_lib.apply_sync_mode(config_lib.SyncerConfig(sync_mode="dp", min_quorum=2, dp_learning_rate=1e-2,
                                                                 dp_warmup_steps=0))
        assert (cfg.num_fragments, cfg.sync_period_steps, cfg.merge_rule, cfg.upload_codec) == (1, 1, "mean", "fp32")
        opt_cfg = inner_lib.InnerOptConfig(learning_rate=cfg.dp_learning_rate, warmup_steps=0,
                                           weight_decay=cfg.dp_weight_decay)
        optimizer = inner_lib.make_inner_optimizer(opt_cfg)
        factory = lambda frag: outer_lib.OuterStepper(  # noqa: E731
            optimizer, tensors=[(t.name, tuple(t.shape)) for t in frag.tensors])
        core = _core(clock, cfg, stepper_factory=factory)
        frag = core.plan.fragments[0]
        slot = core.slots[0]
        join(core, "l1")
        join(core, "l2")
        params = {k: jnp.asarray(v) for k, v in fragments_lib.unflatten_fragment(slot.params.copy(), frag).items()}
        state = optimizer.init(params)
        rng = np.random.default_rng(2)
        for step in range(3):
            g1, g2 = (rng.normal(scale=0.1, size=frag.numel).astype(np.float32) for _ in range(2))
            await upload(core, "l1", 0, slot.version, g1, steps=1)
            await settle()
            assert slot.version == step  # quorum 2: waits for the second learner
            await upload(core, "l2", 0, slot.version, g2, steps=1)
            core.tick()
            for _ in range(500):  # the first merge compiles the stepper: allow up to 10 s
                if slot.version == step + 1:
                    break
                await asyncio.sleep(0.02)
            assert slot.version == step + 1
            mean = fragments_lib.unflatten_fragment((g1 + g2) / 2, frag)
            updates, state = optimizer.update({k: jnp.asarray(v) for k, v in mean.items()}, state, params)
            params = optax.apply_updates(params, updates)
            expected = fragments_lib.flatten_fragment({k: np.asarray(v) for k, v in params.items()}, frag)
            np.testing.assert_allclose(slot.params, expected, rtol=1e-5, atol=1e-6)

    asyncio.run(run())


def test_diloco_mode_fixes_grace_and_codecs_and_plans_unstaggered():
    cfg = config_lib.apply_sync_mode(config_lib.SyncerConfig(sync_mode="diloco", min_quorum=4, num_fragments=3,
                                                             sync_period_steps=6))
    assert (cfg.grace_gamma, cfg.max_grace_s, cfg.upload_codec, cfg.download_codec) == (0.0, 0.0, "fp32", "fp32")
    assert (cfg.num_fragments, cfg.sync_period_steps, cfg.min_quorum) == (3, 6, 4)  # kept
    # With the quorum at every learner a refused honest learner would stall every round.
    assert cfg.direction_check == "off" and cfg.norm_bound_factor == config_lib.SyncerConfig().norm_bound_factor
    # ... and so would a refused one beyond the norm bound: the bound clips in this mode (shipped
    # default, not a test override), while the decoupled default still refuses.
    assert cfg.norm_bound_action == "clip"
    assert config_lib.apply_sync_mode(config_lib.SyncerConfig()).norm_bound_action == "reject"
    assert config_lib.parse_config(["--sync-mode", "diloco", "--insecure"], {}).norm_bound_action == "clip"
    plan = fragments_lib.plan_fragments(SPECS, 3, 6, staggered=False)
    assert [plan.due(t) for t in (1, 6, 12)] == [[], [0, 1, 2], [0, 1, 2]]
    staggered = fragments_lib.plan_fragments(SPECS, 3, 6)
    assert sorted(f for t in range(1, 7) for f in staggered.due(t)) == [0, 1, 2]
    assert config_lib.apply_sync_mode(dataclasses.replace(cfg, sync_mode="decoupled")) == dataclasses.replace(
        cfg, sync_mode="decoupled")
    with pytest.raises(ValueError, match="sync_mode"):
        config_lib.SyncerConfig(sync_mode="allreduce")


def test_diloco_mode_merges_with_the_equal_weight_mean_whatever_the_flags(capsys):
    for rules in ({}, {"merge_rule": "rda"}, {"merge_rule": "mean", "embedding_merge_rule": "rda"}):
        cfg = config_lib.apply_sync_mode(config_lib.SyncerConfig(sync_mode="diloco", min_quorum=2, **rules))
        assert (cfg.merge_rule, cfg.embedding_merge_rule) == ("equal_mean", "equal_mean")
    assert config_lib.SyncerConfig(merge_rule="equal_mean").merge_rule == "equal_mean"  # valid in any mode
    with pytest.raises(ValueError, match="merge_rule"):
        config_lib.SyncerConfig(merge_rule="median")
    decoupled = config_lib.apply_sync_mode(config_lib.SyncerConfig())
    assert (decoupled.merge_rule, decoupled.embedding_merge_rule) == ("rda", "mean")  # unchanged
    with pytest.raises(SystemExit):
        config_lib.parse_config(["--help"], {})
    assert "equal_mean" in " ".join(capsys.readouterr().out.split())
    parsed = config_lib.parse_config(["--sync-mode", "diloco", "--merge-rule", "rda", "--insecure"], {})
    assert (parsed.merge_rule, parsed.embedding_merge_rule) == ("equal_mean", "equal_mean")


def test_diloco_mode_outer_gradient_is_the_plain_mean_of_very_differently_weighted_contributions(clock):
    async def run():
        cfg = config_lib.apply_sync_mode(config_lib.SyncerConfig(sync_mode="diloco", min_quorum=2, num_fragments=2,
                                                                 sync_period_steps=2, norm_bound_factor=0.0))
        core = _core(clock, cfg, staggered=False)
        join(core, "l1")
        join(core, "l2")
        slot = core.slots[0]
        rng = np.random.default_rng(3)
        d1, d2 = (rng.normal(scale=0.01, size=slot.fragment.numel).astype(np.float32) for _ in range(2))
        # tokens = 100 x steps: weights tokens²/steps of 1e4 and 6.4e5, 64 times apart.
        first = await upload(core, "l1", 0, 0, d1, steps=1)
        second = await upload(core, "l2", 0, 0, d2, steps=64)
        assert second.weight == pytest.approx(64 * first.weight)
        core.tick()
        await settle()
        assert slot.version == 1
        merged, _ = slot.last_outer_grad
        np.testing.assert_allclose(merged.materialize(), (d1.astype(np.float64) + d2) / 2, rtol=1e-5, atol=1e-8)

    asyncio.run(run())
