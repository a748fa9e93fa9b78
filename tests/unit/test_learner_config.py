"""`--learner-id auto`: every replica of a scaled (compose) learner service gets its own identity."""

from __future__ import annotations

import collections
import hashlib
import random

import pytest

from services.learner import config as config_lib


def _sha256_shard(learner_id: str, num_shards: int) -> int:
    return int.from_bytes(hashlib.sha256(learner_id.encode()).digest()[:8], "big") % num_shards


def test_explicit_id_is_kept():
    cfg = config_lib.parse_learner_config(["--learner-id", "learner-3", "--region", "eu"], {}, "abc123")
    assert cfg.learner_id == "learner-3"


@pytest.mark.parametrize("argv, environ", [
    (["--learner-id", "auto"], {}),
    (["--learner-id", ""], {}),
    (["--learner-id="], {}),
    ([], {"DDILOCO_LEARNER_LEARNER_ID": "auto"}),
    ([], {"DDILOCO_LEARNER_LEARNER_ID": ""}),
])
def test_auto_id_is_region_and_hostname(argv, environ):
    cfg = config_lib.parse_learner_config([*argv, "--region", "region-a"], environ, "3f2a9c1b0e12.example")
    assert cfg.learner_id == "region-a-3f2a9c1b0e12"
    # A hex container id is not a number, even where it ends in digits: the shard is a sha256 of
    # the id (not 12 % 4 == 0, the old reading of its trailing digits).
    assert cfg.resolved_shard_index == _sha256_shard("region-a-3f2a9c1b0e12", cfg.num_shards) == 3


def test_distinct_hostnames_give_distinct_ids():
    ids = {config_lib.parse_learner_config(["--learner-id", "auto"], {}, h).learner_id for h in ("c1", "c2", "c3")}
    assert len(ids) == 3


def test_flag_wins_over_auto_env():
    cfg = config_lib.parse_learner_config(["--learner-id", "x-1"], {"DDILOCO_LEARNER_LEARNER_ID": "auto"}, "h")
    assert cfg.learner_id == "x-1"


def test_auto_without_hostname_fails():
    with pytest.raises(ValueError, match="hostname"):
        config_lib.parse_learner_config(["--learner-id", "auto"], {}, "")


def test_upload_encoder_is_host_unless_jax_is_asked_for():
    base = ["--learner-id", "l0"]
    assert config_lib.parse_learner_config(base, {}).upload_encoder == "host"
    assert config_lib.parse_learner_config([*base, "--upload-encoder", "jax"], {}).upload_encoder == "jax"
    with pytest.raises((ValueError, SystemExit)):
        config_lib.parse_learner_config([*base, "--upload-encoder", "gpu"], {})


@pytest.mark.parametrize("learner_id, num_shards, shard", [
    ("learner-3", 4, 3), ("learner-6", 4, 2), ("ddiloco-learner-12", 8, 4), ("node_5", 4, 1), ("host.7", 4, 3),
    ("9", 4, 1), ("learner-0", 1, 0),
])
def test_a_numbered_id_trains_the_shard_of_its_number(learner_id, num_shards, shard):
    assert config_lib.LearnerConfig(learner_id=learner_id, num_shards=num_shards).resolved_shard_index == shard


def test_an_explicit_shard_index_wins():
    cfg = config_lib.LearnerConfig(learner_id="learner-3", num_shards=4, shard_index=6)
    assert cfg.resolved_shard_index == 2


def test_auto_ids_spread_evenly_over_the_shards():
    # Issue 26: `region-<hex container id>` ids took their shard from trailing decimal digits, so
    # every id ending in a letter (6 of 16 hex digits) trained shard 0, about half of them in all.
    rng = random.Random(26)
    for num_shards, learners in ((4, 40), (4, 400), (8, 400)):
        ids = {f"region-{rng.getrandbits(48):012x}" for _ in range(learners)}
        counts = collections.Counter(
            config_lib.LearnerConfig(learner_id=i, num_shards=num_shards).resolved_shard_index for i in ids)
        share = len(ids) / num_shards
        assert set(counts) == set(range(num_shards))
        assert max(counts.values()) <= (2.0 if learners < 100 else 1.35) * share, counts


def test_hashed_shard_is_stable_across_processes():
    # sha256, not the per-process salted hash(): every process of a learner unit (and a restart)
    # must pick the same shard. Pinned values.
    shards = [config_lib.LearnerConfig(learner_id=f"region-a-{h}", num_shards=4).resolved_shard_index
              for h in ("3f2a9c1b0e1a", "c0ffee000abc", "deadbeefcafe")]
    assert shards == [1, 2, 1]


def test_only_explicit_and_numbered_ids_pin_a_shard_others_ask_the_syncer():
    """`--shard-index` and numbered ids (learner-3, StatefulSet ordinals) pin their shard as before;
    an auto id (a container id) pins none (-1) and takes the shard the syncer assigns at join."""
    assert config_lib.LearnerConfig(learner_id="learner-6", num_shards=4).pinned_shard_index == 2
    assert config_lib.LearnerConfig(learner_id="region-a-3f2a9c1b0e1a", num_shards=4, shard_index=5).pinned_shard_index == 1
    auto = config_lib.parse_learner_config(["--learner-id", "auto", "--region", "region-a"], {}, "3f2a9c1b0e12")
    assert auto.pinned_shard_index == -1
    assert auto.resolved_shard_index == _sha256_shard("region-a-3f2a9c1b0e12", 4)  # only for a syncer that assigns none
    # A container id can be all digits (about 1 in 280): still a container id, not an ordinal.
    digits = config_lib.parse_learner_config(["--learner-id", "auto", "--region", "region-a"], {}, "123456789012")
    assert digits.pinned_shard_index == -1


@pytest.mark.parametrize("flags, decay_steps", [
    ([], 0),  # no step budget: nothing to decay against, constant after the warm-up
    (["--steps", "500"], 500),  # the default decays over the learner's steps
    (["--steps", "500", "--lr-decay-steps", "0"], 0),
    (["--steps", "500", "--lr-decay-steps", "300"], 300),
    (["--steps", "10"], 0),  # a run shorter than its warm-up has nothing to decay
])
def test_the_inner_lr_decays_over_the_learners_steps_by_default(flags, decay_steps):
    cfg = config_lib.parse_learner_config(["--learner-id", "l0", *flags], {})
    assert cfg.inner_optimizer().decay_steps == decay_steps
    assert cfg.inner_optimizer().final_lr_fraction == 0.1


def test_a_decay_ending_inside_the_warmup_is_refused_at_start(capsys):
    with pytest.raises(SystemExit):
        config_lib.parse_learner_config(["--learner-id", "l0", "--lr-decay-steps", "5", "--warmup-steps", "20"], {})
    assert "decay_steps=5 must exceed warmup_steps=20" in capsys.readouterr().err
