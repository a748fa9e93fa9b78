"""`--learner-id auto`: every replica of a scaled (compose) learner service gets its own identity."""

from __future__ import annotations

import pytest

from services.learner import config as config_lib


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
    # The shard still derives from the id's trailing number.
    assert cfg.resolved_shard_index == 12 % cfg.num_shards


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
