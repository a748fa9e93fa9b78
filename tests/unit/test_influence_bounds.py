"""Bounded influence that keeps honest heterogeneous learners whole (issue 24, round two), through
SyncerCore (no gRPC, fake clock) and the pure bounds: a 4x-batch unit keeps its tokens²/steps weight
in a merge of two, a hostile claim is still capped in a merge of three or more (and in a merge of two
once its claims are clipped), a contribution of few steps is not clipped, the norm clip's reference
is other learners' recent contributions, and `TrainingState.influence` shows it all per learner."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from rich.console import Console

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import merge as merge_lib
from ddiloco.algo import robust as robust_lib
from ddiloco.cli import render
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.syncer import config as config_lib
from services.syncer import wire_views
from tests.fakes import accept, join, make_core, settle


async def _upload(core, learner_id: str, base: int, delta: np.ndarray, *, tokens_per_step: int, steps: int = 2):
    enc = codec_lib.encode(delta.astype(np.float32), "fp32")
    header = syncer_pb2.UploadHeader(
        protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=1, fragment_id=0,
        base_version=base, syncer_instance=core.instance, steps=steps, tokens=steps * tokens_per_step,
        payload=serde.payload_info_to_proto(enc))
    await accept(core, header, enc.payload, wire_bytes=len(enc.payload))


async def _rounds(core, batches: dict[str, int], rounds: int) -> list[syncer_pb2.MergeRecord]:
    """`rounds` merges of fragment 0, each with every learner of `batches` (tokens per step) in that
    order, contributions of similar norms; returns the merge records."""
    for lid in batches:
        join(core, lid)
    rng = np.random.default_rng(3)
    n = core.plan.fragments[0].numel
    common = rng.normal(size=n)
    for version in range(rounds):
        for lid, batch in batches.items():
            await _upload(core, lid, version, 0.01 * (common + 0.3 * rng.normal(size=n)), tokens_per_step=batch)
        await settle()
        assert core.slots[0].version == version + 1
    return list(core.rounds.merges)


def _shares(record: syncer_pb2.MergeRecord) -> dict[str, float]:
    total = sum(c.weight for c in record.contributors)
    return {c.learner_id: c.weight / total for c in record.contributors}


def test_a_4x_batch_unit_keeps_its_tokens_squared_per_step_weight_in_a_merge_of_two(clock):
    """16x the weight per step of a 1x learner (tokens² / steps), so 16/17 of a merge of the two:
    the share cap at 1/2 made both weigh the same. Only the first merges, before the other learner's
    history can check the unit's batch, cap it."""
    async def run():
        core = make_core(clock, min_quorum=2)
        merges = await _rounds(core, {"a": 100, "unit": 400}, rounds=5)
        weights = [{c.learner_id: c.weight for c in m.contributors} for m in merges]
        checked = weights[3:]  # the unit's batch is checked once a has 3 contributions in the history
        for w in checked:
            assert w["unit"] == pytest.approx(merge_lib.contribution_weight(2 * 400, 2))
            assert w["unit"] / w["a"] == pytest.approx(16.0)
        assert all(_shares(m)["unit"] == pytest.approx(16 / 17) for m in merges[3:])
        # Unchecked claims (the run's first merges) are capped, as any claim in a larger merge would be.
        assert _shares(merges[0])["unit"] == pytest.approx(0.5)
        influence = {i.learner_id: i for i in wire_views.training_state(core, 0).influence}
        unit = influence["unit"]
        capped_before = sum(_shares(m)["unit"] == pytest.approx(0.5) for m in merges)
        assert (unit.merges, unit.window_merges, unit.share_capped, unit.clipped) == (5, 5, capped_before, 0)
        assert 0 < capped_before < 5 and unit.max_share == pytest.approx(16 / 17, abs=1e-5)
        assert unit.mean_share == pytest.approx(np.mean([_shares(m)["unit"] for m in merges]), abs=1e-5)
        console = Console(width=240, record=True, color_system=None)
        console.print(render.state_renderable(wire_views.training_state(core, 0)))
        text = console.export_text()
        assert "capped" in text and "clipped" in text and "of the last 5 merges" in text
        row = next(line for line in text.splitlines() if "unit" in line)
        assert f"{unit.mean_share:.2f} (0.94)" in row

    asyncio.run(run())


def test_a_hostile_claim_is_capped_in_a_merge_of_three_or_more(clock):
    """A learner that claims a 4x batch (within --max-batch-ratio, not clipped) has 16x an honest
    weight: in a merge of three it is capped at half the total, every time."""
    async def run():
        core = make_core(clock, min_quorum=3)
        merges = await _rounds(core, {"a": 100, "b": 100, "x": 400}, rounds=4)
        for m in merges:
            assert _shares(m)["x"] == pytest.approx(0.5)
            assert _shares(m)["a"] == pytest.approx(0.25)
        influence = wire_views.training_state(core, 0).influence
        assert {i.learner_id: i.share_capped for i in influence} == {"a": 0, "b": 0, "x": 4}

    asyncio.run(run())


def test_a_clipped_claim_is_capped_in_a_merge_of_two(clock):
    """A 20x batch claim in a merge of two: the batch is clipped to 4x the other learner's, and the
    contribution whose claims were clipped is capped at half the weight."""
    async def run():
        core = make_core(clock, min_quorum=2)
        merges = await _rounds(core, {"a": 100, "x": 2000}, rounds=5)
        for m in merges:
            assert _shares(m)["x"] == pytest.approx(0.5)
        clipped = {i.learner_id: (i.share_capped, i.clipped) for i in wire_views.training_state(core, 0).influence}
        assert clipped["x"][0] == 5 and clipped["x"][1] >= 2 and clipped["a"] == (0, 0)  # batch clipped once checkable

    asyncio.run(run())


def _fragment() -> fragments_lib.Fragment:
    return fragments_lib.Fragment(fragment_id=0, tensors=(fragments_lib.TensorSpec("w", (64,)),), offset_steps=0)


def _history(records) -> robust_lib.NormHistory:
    """The syncer's default policy; records (learner, steps, norm per step, version)."""
    history = robust_lib.NormHistory(robust_lib.NormBoundPolicy(), _fragment())
    for learner, steps, per_step, version in records:
        history.add(learner, np.array([per_step * steps]), steps, merge_lib.contribution_weight(100 * steps, steps),
                    version)
    return history


def test_a_few_step_honest_contribution_is_not_clipped():
    """Norms grow slower than steps for a contribution of few steps (a restarted learner's first):
    4 steps at 5x the others' per-step norm (others: 8 steps) is 3.5x their norm at √(4 x 8) steps
    and stays whole; per step it was clipped (ratio 5 > 4). Many steps are still compared per step,
    and step counts unlike every reference's (2 against 16: more than 2x apart) are not compared."""
    history = _history([(lid, 8, 1.0, 10) for lid in "abc"])
    assert history.clip_scale("x", 4 * 5.0, 4, version=10) == 1.0
    assert history.norm_ratio("x", 4 * 5.0, 4, version=10) == pytest.approx(20 / np.sqrt(32))
    assert history.clip_scale("x", 8 * 10.0, 8, version=10) == pytest.approx(0.4)  # a scaled update
    assert history.clip_scale("x", 16 * 10.0, 16, version=10) == pytest.approx(0.4)
    per_step = robust_lib.NormHistory(robust_lib.NormBoundPolicy(step_scaling="per_step"), _fragment())
    for lid in "abc":
        per_step.add(lid, np.array([8.0]), 8, 1.0, 10)
    assert per_step.clip_scale("x", 4 * 5.0, 4, version=10) == pytest.approx(0.8)  # the rule before: clipped
    unlike = _history([(lid, 16, 1.0, 10) for lid in "abc"])
    assert unlike.clip_reference("x", 10, steps=2) is None and unlike.clip_scale("x", 2 * 5.0, 2, version=10) == 1.0
    # In the merge itself: the few-step one is the largest per step, held back, and left whole.
    acc = merge_lib.MergeAccumulator(_fragment(), max_share=0.5, max_norm_ratio=4.0, share_cap_min_count=3,
                                     step_scaling="sqrt_below_median")
    unit = np.zeros(64, np.float32)
    unit[0] = 1.0
    for lid in "abc":
        acc.add(unit * 16, 1.0, key=lid, steps=16)
    acc.add(unit * 10, 1.0, key="restarted", steps=2)
    acc.scaled_result()
    assert acc.held_norm_scale == 1.0 and acc.norm_clipped_key == ""
    per_step = merge_lib.MergeAccumulator(_fragment(), max_norm_ratio=4.0)  # the rule before: clipped
    for lid in "abc":
        per_step.add(unit * 16, 1.0, key=lid, steps=16)
    per_step.add(unit * 10, 1.0, key="restarted", steps=2)
    per_step.scaled_result()
    assert per_step.norm_clipped_key == "restarted"


def test_the_clip_reference_is_the_other_learners_recent_contributions():
    """Contributions from early in the run (small per-step norms, mid warm-up) leave the reference
    after 2 versions: a later honest contribution at 3x the recent ones is not clipped against them."""
    history = _history([(lid, 4, 0.1, 0) for lid in "abcab"] + [(lid, 4, 1.0, 10) for lid in "abc"])
    assert history.clip_reference("x", 11) == (pytest.approx(1.0), 4.0)
    assert history.clip_scale("x", 4 * 3.0, 4, version=11) == 1.0
    assert history.clip_scale("x", 4 * 3.0, 4) == pytest.approx(4 * 0.1 / 3.0)  # all kept ones: the median is 0.1
    assert history.clip_reference("x", 13) is None  # nothing recent: no clip (the merge's own clip remains)


def test_the_merge_applies_the_share_cap_by_size_or_unverified_claims():
    fragment = _fragment()
    ones = np.ones(64, np.float32)

    def merge(weights: dict[str, float], unverified: set[str]) -> merge_lib.MergeAccumulator:
        acc = merge_lib.MergeAccumulator(fragment, max_share=0.5, share_cap_min_count=3)
        for key, weight in weights.items():
            acc.add(ones, weight, key=key, claims_unverified=key in unverified)
        acc.scaled_result()
        return acc

    assert merge({"a": 1.0, "unit": 16.0}, set()).capped is None
    assert merge({"a": 1.0, "unit": 16.0}, {"unit"}).capped == ("unit", 16.0, 1.0)
    assert merge({"a": 1.0, "b": 1.0, "x": 16.0}, set()).capped == ("x", 16.0, 2.0)
    assert merge({"a": 1.0, "unit": 16.0}, {"a"}).capped is None  # a is not above the share


def test_the_merge_clips_a_contribution_it_cannot_vouch_for_at_the_tighter_ratio():
    """A contribution whose claims are unverified (or whose norm was clipped) is clipped at
    unverified_norm_ratio x the median of the merge's others when that is below max_norm_ratio; a
    verified one of the same norm is left whole (issue 24: a hostile learner's first contributions,
    before any history, were merged at 4x the honest norm)."""
    unit = np.zeros(64, np.float32)
    unit[0] = 1.0

    def merge(unverified: bool, **ratios) -> merge_lib.MergeAccumulator:
        acc = merge_lib.MergeAccumulator(_fragment(), **ratios)
        for lid in "ab":
            acc.add(unit * 4, 1.0, key=lid, steps=4, claims_unverified=True)
        acc.add(unit * 12, 1.0, key="x", steps=4, claims_unverified=unverified)  # 3x the others per step
        acc.scaled_result()
        return acc

    assert merge(True, max_norm_ratio=4.0, unverified_norm_ratio=2.0).held_norm_scale == pytest.approx(2 / 3)
    assert merge(False, max_norm_ratio=4.0, unverified_norm_ratio=2.0).held_norm_scale == 1.0
    assert merge(True, max_norm_ratio=4.0).held_norm_scale == 1.0  # 0: the same ratio for all
    assert merge(True, unverified_norm_ratio=2.0).norm_clipped_key == "x"  # holds without max_norm_ratio
    assert merge(True, max_norm_ratio=1.5, unverified_norm_ratio=2.0).held_norm_scale == pytest.approx(0.5)  # the lower


def test_a_run_s_first_merge_clips_a_large_unchecked_contribution_to_twice_the_others(clock):
    """Through SyncerCore with the shipped defaults: in the first merge nobody's batch can be checked
    (no history), so a contribution at 3x the others' norm is clipped to 2x their median (the merged
    outer gradient is smaller than without the tighter clip, --unverified-clip-factor 0)."""
    async def first_merge(**overrides) -> tuple[syncer_pb2.MergeRecord, dict]:
        core = make_core(clock, min_quorum=3, **overrides)
        for lid in "abx":
            join(core, lid)
        rng = np.random.default_rng(5)
        n = core.plan.fragments[0].numel
        common = rng.normal(size=n)
        for lid, scale in (("a", 1.0), ("b", 1.0), ("x", 3.0)):
            await _upload(core, lid, 0, 0.01 * scale * (common + 0.1 * rng.normal(size=n)), tokens_per_step=100)
        await settle()
        assert core.slots[0].version == 1
        return core.rounds.merges[0], {i.learner_id: i.clipped for i in wire_views.training_state(core, 0).influence}

    tight, tight_clipped = asyncio.run(first_merge())
    loose, loose_clipped = asyncio.run(first_merge(norm_bound=robust_lib.NormBoundPolicy(unverified_clip_factor=0.0)))
    assert tight_clipped == {"a": 0, "b": 0, "x": 1} and loose_clipped == {"a": 0, "b": 0, "x": 0}
    # RDA's merged norm is the weighted mean of the norms: (1 + 1 + 3) / 3 against (1 + 1 + 2) / 3.
    assert tight.outer_grad_norm / loose.outer_grad_norm == pytest.approx(4 / 5, rel=0.05)


def test_the_unverified_clip_factor_flag_reaches_the_policy_and_the_baselines_turn_it_off():
    assert config_lib.SyncerConfig().norm_bound.unverified_clip_factor == 2.0
    assert config_lib.SyncerConfig(unverified_clip_factor=3.0).norm_bound.unverified_clip_factor == 3.0
    for mode in ("diloco", "dp"):
        assert config_lib.apply_sync_mode(config_lib.SyncerConfig(sync_mode=mode)).unverified_clip_factor == 0.0
    with pytest.raises(ValueError, match="unverified_clip_factor"):
        config_lib.SyncerConfig(unverified_clip_factor=-1.0)
