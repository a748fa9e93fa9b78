"""Cross-round residual coherence (ddiloco/algo/coherence.py) and the audit's drift flag
(ddiloco/cli/audit.py): a constant bias added to one learner's contributions every round stands out,
honest learners on their own data shards (residuals that persist for a while, then turn) do not.
Before the coherence module the ledger held nothing a bias changes and the audit named no one."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import prometheus_client
import pytest

from ddiloco.algo import coherence as coherence_lib
from ddiloco.cli import audit as audit_lib
from services.syncer import influence as influence_lib

DIM = 4096
# Weight of the honest learners' shard direction: their `persistent` medians come out near the
# hostile matrix's (0.06-0.13).
SHARD = 0.35


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x)


class _Learners:
    """Synthetic pseudo-gradients of non-IID learners: a common direction that moves with the model,
    each learner's shard direction turning slowly (a quarter turn over `turn_rounds`), and noise;
    the norms are of the order the hostile matrix measured (learners' cosines 0.3-0.6). `bias`:
    learner -> x, that learner adds x times its norm along one fixed unit vector every round."""

    def __init__(self, learners: int, *, seed: int, bias: dict[int, float] | None = None, turn_rounds: int = 40):
        self.rng = np.random.default_rng(seed)
        self.learners = learners
        self.bias = bias or {}
        self.turn = (np.pi / 2) / turn_rounds
        self.shard = [(self._gauss(), self._gauss()) for _ in range(learners)]
        self.drift = _unit(self._gauss())
        self.common = self._gauss()

    def _gauss(self) -> np.ndarray:
        return _unit(self.rng.standard_normal(DIM))

    def round(self, t: int) -> dict[str, np.ndarray]:
        self.common = _unit(0.7 * self.common + 0.7 * self._gauss())  # the model moves
        out = {}
        for i in range(self.learners):
            p, q = self.shard[i]
            shard = np.cos(self.turn * t) * p + np.sin(self.turn * t) * q
            v = 1.0 * self.common + SHARD * shard + 0.8 * self._gauss()
            if i in self.bias:
                v = v + self.bias[i] * np.linalg.norm(v) * self.drift
            out[f"learner-{i}"] = _unit(v).astype(np.float32)
        return out


def _run(gen: _Learners, rounds: int, *, per_merge: int, seed: int) -> tuple[coherence_lib.ResidualCoherence, list]:
    """Feeds `rounds` rounds to one fragment as merges of `per_merge` contributions (random
    groups, as arrivals make them); returns the coherence state and every (learner, Score)."""
    rng = np.random.default_rng(seed)
    coherence = coherence_lib.ResidualCoherence(dims=1024)
    scores, version = [], 0
    for t in range(rounds):
        directions = gen.round(t)
        names = list(directions)
        rng.shuffle(names)
        for start in range(0, len(names), per_merge):
            version += 1
            group = {k: directions[k] for k in names[start:start + per_merge]}
            scores += list(coherence.observe(0, version, group).items())
    return coherence, scores


@pytest.mark.parametrize("per_merge", [1, 2, 4])
def test_a_constant_bias_stands_out_and_rotating_non_iid_residuals_do_not(per_merge):
    gen = _Learners(4, seed=3, bias={3: 0.5})
    coherence, _ = _run(gen, 40, per_merge=per_merge, seed=1)
    scores = coherence.scores()
    honest = [scores[f"learner-{i}"] for i in range(3)]
    assert scores["learner-3"] >= 2 * max(honest), scores
    assert scores["learner-3"] >= audit_lib.PERSISTENT_FLOOR, scores
    # Honest learners alone: every score is within a factor of 2 of the others' median.
    honest_only, _ = _run(_Learners(4, seed=3), 40, per_merge=per_merge, seed=1)
    values = honest_only.scores()
    for learner, value in values.items():
        others = sorted(v for k, v in values.items() if k != learner)
        assert value < max(audit_lib.PERSISTENT_FLOOR, 2 * others[len(others) // 2]), values


def test_the_score_does_not_grow_with_rounds_for_turning_residuals_but_coherence_does_for_a_bias():
    # |S| / sqrt(Q) grows like sqrt(rounds) for a fixed residual and stays near 1 for independent
    # ones; `persistent` is the rounds-free form of it.
    coherence = coherence_lib.ResidualCoherence(dims=512, decay=1.0)
    rng = np.random.default_rng(0)
    fixed = _unit(rng.standard_normal(DIM))
    for _ in range(25):
        coherence.add("bias", 0, 0.6 * fixed + 0.8 * _unit(rng.standard_normal(DIM)))
        coherence.add("turning", 0, _unit(rng.standard_normal(DIM)))
    bias, turning = coherence.score("bias", 0), coherence.score("turning", 0)
    assert bias.rounds == pytest.approx(25)
    assert bias.coherence > 2.5 and turning.coherence < 1.3
    assert bias.persistent == pytest.approx(0.36, abs=0.08) and turning.persistent < 0.03


def test_memory_is_bounded_and_the_sketch_keeps_norms():
    coherence = coherence_lib.ResidualCoherence(dims=1024, max_states=8)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(65536)
    assert np.linalg.norm(coherence.sketch(x)) == pytest.approx(np.linalg.norm(x), rel=0.1)
    for i in range(20):
        coherence.add(f"l{i}", i % 3, rng.standard_normal(300))
    assert len(coherence._states) == 8 and coherence.score("l19", 19 % 3) is not None
    assert coherence.score("l0", 0) is None  # the least recently updated went first


def _influence_ledger(path, gen: _Learners, rounds: int) -> list[dict]:
    """Merges of two contributions (as the hostile matrix mostly has) through Influence.merged into a
    MergeLedger: the records the syncer writes, with their residual fields."""
    influence = influence_lib.Influence(run_id="r", instance="i", ledger=influence_lib.MergeLedger(str(path)))
    rng = np.random.default_rng(5)
    version = 0
    for t in range(rounds):
        directions = gen.round(t)
        names = list(directions)
        rng.shuffle(names)
        for fragment in range(2):
            for start in range(0, len(names), 2):
                version += 1
                group = names[start:start + 2]
                rnd = types.SimpleNamespace(
                    influence=[{"learner": k, "weight": 1.0, "norm": 1.0, "heading": directions[k]} for k in group],
                    accumulator=types.SimpleNamespace(capped=None, held_norm_scale=1.0, norm_clipped_key=None,
                                                      fold_order=[]),
                    folds=[], merge_inputs=None)
                merged = _unit(sum(directions[k].astype(np.float64) for k in group))
                record = types.SimpleNamespace(fragment_id=fragment, version=version, round=version,
                                               merged_at_unix_s=1.0, reason="quorum", outer_grad_norm=1.0)
                influence.merged(rnd, record, merged, "00")
    return audit_lib.read_ledger(str(path))


def test_the_audit_names_a_drifting_learner_and_no_honest_one(tmp_path):
    drifting = _influence_ledger(tmp_path / "drift.jsonl", _Learners(4, seed=11, bias={2: 0.5}), 40)
    assert all("residual_persistent" in c for r in drifting[-8:] for c in r["contributors"])
    summary = audit_lib.influence(drifting)
    assert {lid for lid, e in summary.items() if e["flags"]} == {"learner-2"}, summary
    assert any("persistent residual" in f for f in summary["learner-2"]["flags"])
    honest = audit_lib.influence(_influence_ledger(tmp_path / "honest.jsonl", _Learners(4, seed=11), 40))
    assert not any(e["flags"] for e in honest.values()), honest
    # Too few rounds in the selection's sums: no score, no flag.
    early = audit_lib.influence(audit_lib.select(drifting, to_version=8))
    assert not any(e["flags"] for e in early.values())


def test_the_syncer_exports_each_learners_persistent_residual(clock):
    from services.syncer import metrics as syncer_metrics
    from tests.fakes import make_core

    async def run():
        core = make_core(clock)
        registry = prometheus_client.CollectorRegistry()
        syncer_metrics.SyncerMetrics(core, registry)
        gen = _Learners(4, seed=3, bias={3: 0.5})
        for t in range(30):
            core.influence.coherence.observe(0, t + 1, gen.round(t))
        expected = core.influence.coherence.scores()
        assert set(expected) == {f"learner-{i}" for i in range(4)}
        # Scraped from another thread, as Prometheus does.
        got = await asyncio.to_thread(lambda: {lid: registry.get_sample_value(
            "ddiloco_syncer_residual_persistent_share", {"learner": lid}) for lid in expected})
        assert got == pytest.approx(expected)
        assert got["learner-3"] > 2 * max(v for k, v in got.items() if k != "learner-3")

    asyncio.run(run())
