"""docker-compose.replicated.yml, checked from the files alone (no Docker engine): merged over
docker-compose.yml, the syncer writes to both stores, which share no network with each other but
each one with the syncer, and each keeps its own volume."""

from __future__ import annotations

import pathlib

import yaml

from services.syncer import config as syncer_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
OVERRIDE = yaml.safe_load((ROOT / "docker-compose.replicated.yml").read_text())


def _merged_service(name: str) -> dict:
    """Compose's merge for the keys used here: mappings merge, sequences (networks) are unioned."""
    base, over = dict(BASE["services"].get(name, {})), OVERRIDE["services"].get(name, {})
    merged = dict(base)
    merged["environment"] = {**base.get("environment", {}), **over.get("environment", {})}
    merged["networks"] = sorted(set(base.get("networks", [])) | set(over.get("networks", [])))
    merged["depends_on"] = {**base.get("depends_on", {}), **over.get("depends_on", {})}
    for key in ("volumes", "command"):
        merged[key] = over.get(key, base.get(key))
    return merged


def test_the_syncer_replicates_to_two_stores_on_separate_networks() -> None:
    syncer = _merged_service("syncer")
    targets = syncer["environment"]["DDILOCO_SYNCER_CHECKPOINT_TARGET"].split(",")
    assert targets == ["checkpoint:50052", "checkpoint-b:50052"]
    stores = [_merged_service(t.split(":")[0]) for t in targets]
    for target, store in zip(targets, stores):
        assert store["command"] == ["checkpoint"]
        assert store["environment"]["DDILOCO_CHECKPOINT_BIND"].endswith(":50052")
        assert set(store["networks"]) & set(syncer["networks"]), "the syncer cannot reach a store"
        assert syncer["depends_on"][target.split(":")[0]]["condition"] == "service_healthy"
    assert not set(stores[0]["networks"]) & set(stores[1]["networks"]), "the stores share a network"
    assert stores[0]["volumes"] != stores[1]["volumes"]
    assert set(OVERRIDE["networks"]) | set(BASE["networks"]) >= set(syncer["networks"])


def test_the_override_sets_only_flags_the_syncer_has() -> None:
    fields = {f.name.upper() for f in syncer_config.dataclasses.fields(syncer_config.SyncerConfig)}
    for key in OVERRIDE["services"]["syncer"]["environment"]:
        assert key.removeprefix("DDILOCO_SYNCER_") in fields, key
