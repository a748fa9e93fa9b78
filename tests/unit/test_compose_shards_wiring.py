"""docker-compose.shards.yml, checked from the files alone (no Docker engine): merged over
docker-compose.yml, two syncer shards with the same settings but their index, one shard map
naming both (in index order, at the port each binds), every learner and the evaluator pointed
at shard 0 and started once both shards serve, and both shards reachable from every network
their clients sit on (issue 21, fragment shards)."""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import yaml

from services.syncer import config as syncer_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
OVERRIDE = yaml.safe_load((ROOT / "docker-compose.shards.yml").read_text())
CLIENTS = {"learner-region-a": "DDILOCO_LEARNER_SYNCER", "learner-region-b": "DDILOCO_LEARNER_SYNCER",
           "chaos-learner": "DDILOCO_LEARNER_SYNCER", "evaluator": "DDILOCO_EVAL_SYNCER"}


def _merged_service(name: str) -> dict:
    """Compose's merge for the keys used here: mappings merge, sequences (networks) are unioned."""
    base, over = dict(BASE["services"].get(name, {})), OVERRIDE["services"].get(name, {})
    merged = {**base, **{k: v for k, v in over.items() if k not in ("environment", "networks", "depends_on")}}
    merged["environment"] = {**base.get("environment", {}), **over.get("environment", {})}
    merged["networks"] = sorted(set(base.get("networks", [])) | set(over.get("networks", [])))
    merged["depends_on"] = {**base.get("depends_on", {}), **over.get("depends_on", {})}
    return merged


def _shards() -> list[tuple[str, dict]]:
    """(service, merged definition) of every syncer shard, in the map's order."""
    shard_map = _merged_service("syncer")["environment"]["DDILOCO_SYNCER_FRAGMENT_SHARDS"].split(",")
    return [(entry.split(":")[0], _merged_service(entry.split(":")[0])) for entry in shard_map]


def test_two_shards_with_one_map_their_own_index_and_the_same_settings() -> None:
    shards = _shards()
    assert [name for name, _ in shards] == ["syncer", "syncer-1"]
    maps = {svc["environment"]["DDILOCO_SYNCER_FRAGMENT_SHARDS"] for _, svc in shards}
    (shard_map,) = maps
    for index, (name, svc) in enumerate(shards):
        env = svc["environment"]
        assert env["DDILOCO_SYNCER_FRAGMENT_SHARD"] == str(index)
        assert svc["command"] == ["syncer"]
        port = env["DDILOCO_SYNCER_BIND"].rsplit(":", 1)[1]
        assert shard_map.split(",")[index] == f"{name}:{port}"
        assert svc["healthcheck"]["test"][-1].endswith(f":{port}")
        assert svc["depends_on"]["checkpoint"]["condition"] == "service_healthy"
    # The shards differ in their index only: another model, run id or fragment count on one of
    # them would be another run.
    envs = [{k: v for k, v in svc["environment"].items() if k != "DDILOCO_SYNCER_FRAGMENT_SHARD"} for _, svc in shards]
    assert envs[0] == envs[1]
    assert len(shards) <= int(envs[0]["DDILOCO_SYNCER_NUM_FRAGMENTS"].split(":-")[1].rstrip("}"))
    assert "ports" not in OVERRIDE["services"]["syncer-1"]  # only shard 0 is published on the host


def test_clients_are_given_shard_0_reach_every_shard_and_wait_for_all() -> None:
    shards = _shards()
    first = _merged_service("syncer")["environment"]["DDILOCO_SYNCER_FRAGMENT_SHARDS"].split(",")[0]
    for client, variable in CLIENTS.items():
        svc = _merged_service(client)
        assert svc["environment"][variable] == first, client
        for name, shard in shards:
            assert set(svc["networks"]) & set(shard["networks"]), f"{client} cannot reach {name}"
            assert svc["depends_on"][name]["condition"] == "service_healthy", client
    status = _merged_service("status")
    assert status["entrypoint"][-1] == first and status["profiles"] == ["tools"]
    for name, shard in shards:
        assert set(status["networks"]) & set(shard["networks"]), f"status cannot reach {name}"


def test_the_override_sets_only_flags_the_syncer_has() -> None:
    """Syncer flags, or the fragment-shard flags the Helm chart wires too (scripts/render_k8s.py)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import render_k8s
    finally:
        sys.path.pop(0)
    fields = {f.name.upper() for f in dataclasses.fields(syncer_config.SyncerConfig)}
    fields |= {name.upper() for name in render_k8s.WIRED_SHARDS["syncer"]}
    for service in ("syncer", "syncer-1"):
        for key in OVERRIDE["services"][service]["environment"]:
            if key.startswith("DDILOCO_SYNCER_"):
                assert key.removeprefix("DDILOCO_SYNCER_") in fields, key


def test_the_compose_header_names_the_override() -> None:
    header = (ROOT / "docker-compose.yml").read_text().split("\nname:", 1)[0]
    assert "docker-compose.shards.yml" in header
