"""The `run` record checkpoints carry (ddiloco.run_description) and its place in the syncer's checkpoint blobs."""

from __future__ import annotations

import asyncio
import json

import jax
import numpy as np
import pytest

from ddiloco import models
from ddiloco import run_description as rd
from ddiloco.algo import fragments as fragments_lib
from services.syncer import checkpointing
from services.syncer import config as config_lib
from services.syncer import core as core_lib
from services.syncer import wire_views


def _tiny_run(num_fragments: int = 3):
    model = models.get_model("transformer", {"preset": "tiny"})
    plan = fragments_lib.plan_fragments(model.tensor_specs(), num_fragments, 4)
    cfg = config_lib.SyncerConfig(run_id="unit-run", insecure=True, num_fragments=num_fragments, outer_lr=0.5,
                                  tls_key="/secret/key.pem", auth_tokens_file="/secret/tokens")
    return model, plan, cfg, wire_views.run_config(_run_settings(cfg, model), plan)


def _run_settings(cfg, model):
    return core_lib.make_run_settings(cfg, model_name=model.name, model_config_json=json.dumps(dict(model.config)),
                                      fingerprint=models.model_fingerprint(model))


def test_description_names_every_tensor_of_the_fragment_vectors():
    model, plan, cfg, run_config = _tiny_run()
    description = rd.RunDescription.from_json(checkpointing.describe_run(cfg, run_config, plan).to_json())
    assert description.model_name == "transformer" and dict(description.model_config) == dict(model.config)
    assert description.model_fingerprint == models.model_fingerprint(model)
    assert description.run_id == "unit-run" and description.training["outer_lr"] == 0.5
    assert description.run_config["sync_period_steps"] == 4 and "fragments" not in description.run_config
    params = {k: np.asarray(v) for k, v in model.init(jax.random.PRNGKey(1)).items()}
    vectors = {f.fragment_id: fragments_lib.flatten_fragment(params, f) for f in plan.fragments}
    tensors = description.tensors(vectors)
    assert {k: v.shape for k, v in tensors.items()} == {k: v.shape for k, v in params.items()}
    for name, value in params.items():
        np.testing.assert_array_equal(tensors[name], value)
    # Fragment membership and offsets are the plan's.
    for f, layout in zip(plan.fragments, description.fragments, strict=True):
        assert [t.name for t in layout.tensors] == [t.name for t in f.tensors]
        assert {t.name: t.offset_elements for t in layout.tensors} == {k: s.start for k, s in f.slices().items()}


def test_description_keeps_addresses_paths_and_credentials_out():
    _, plan, cfg, run_config = _tiny_run()
    text = checkpointing.describe_run(cfg, run_config, plan).to_json().decode()
    assert "/secret/" not in text and "tls_key" not in text and "auth_tokens_file" not in text


@pytest.mark.parametrize("mutate, match", [
    (lambda r: r.update(format="ddiloco.run/0"), "format"),
    (lambda r: r["fragments"][0]["tensors"][0].update(dtype="bfloat16"), "dtype"),
    (lambda r: r["fragments"][0]["tensors"][1].update(offset_elements=0), "does not follow"),
    (lambda r: r["fragments"][0].update(numel=r["fragments"][0]["numel"] + 1), "holds"),
    (lambda r: r["fragments"][1]["tensors"].append(dict(r["fragments"][0]["tensors"][0])), "repeated|follow"),
    (lambda r: r.pop("model"), "malformed"),
])
def test_malformed_descriptions_are_refused(mutate, match):
    _, plan, cfg, run_config = _tiny_run()
    record = json.loads(checkpointing.describe_run(cfg, run_config, plan).to_json())
    mutate(record)
    with pytest.raises(ValueError, match=match):
        rd.RunDescription.from_json(json.dumps(record))


def test_tensors_refuses_a_vector_of_the_wrong_size():
    _, plan, cfg, run_config = _tiny_run()
    description = checkpointing.describe_run(cfg, run_config, plan)
    vectors = {f.fragment_id: np.zeros(f.numel, np.float32) for f in plan.fragments}
    vectors[1] = vectors[1][:-1]
    with pytest.raises(ValueError, match="fragment 1"):
        description.tensors(vectors)
    del vectors[1]
    with pytest.raises(ValueError, match="fragment 1 is missing"):
        description.tensors(vectors)


@pytest.mark.parametrize("text, message", [
    ("{", "RunConfig.model_config_json is not JSON: "),
    ("[1]", "RunConfig.model_config_json must be a JSON object"),
])
def test_describe_refuses_a_model_config_that_is_not_a_json_object(text, message):
    _, plan, _, run_config = _tiny_run()
    run_config.model_config_json = text
    with pytest.raises(ValueError, match=message):
        rd.describe(run_config, plan)


def test_model_config_from_json_names_its_source():
    # `ddiloco up --model-config` and RunConfig.model_config_json are parsed by this one function.
    assert rd.model_config_from_json("", "--model-config") == {}
    assert rd.model_config_from_json('{"preset": "tiny"}', "--model-config") == {"preset": "tiny"}
    with pytest.raises(ValueError, match="^--model-config is not JSON: "):
        rd.model_config_from_json("{", "--model-config")
    with pytest.raises(ValueError, match="^--model-config must be a JSON object$"):
        rd.model_config_from_json('"tiny"', "--model-config")


async def _snapshot(run, plan, model):
    params = {k: np.asarray(v) for k, v in model.init(jax.random.PRNGKey(0)).items()}
    core = core_lib.SyncerCore(
        run=run, plan=plan, initial_params={f.fragment_id: fragments_lib.flatten_fragment(params, f)
                                                         for f in plan.fragments},
        settings=core_lib.CoreSettings(outer_lr=0.7, outer_momentum=0.9, grace_gamma=0.8, max_grace_s=1.0,
                                       liveness_timeout_s=30.0, merge_history=8),
        clock=lambda: 0.0, wall_clock=lambda: 0.0)
    return await core.snapshot()


def test_checkpoint_blobs_carry_the_run_blob_and_older_ones_stay_readable():
    model, plan, cfg, run_config = _tiny_run()
    snapshot = asyncio.run(_snapshot(_run_settings(cfg, model), plan, model))
    described, metadata = checkpointing.encode_snapshot(snapshot, checkpointing.describe_run(cfg, run_config, plan))
    legacy, legacy_metadata = checkpointing.encode_snapshot(snapshot)
    assert set(described) == set(legacy) | {rd.BLOB_NAME} and metadata["model"] == "transformer"
    assert legacy_metadata == {"format": "1", "kind": "syncer"}  # what every older checkpoint holds
    for blobs in (described, legacy):
        state = checkpointing.load_snapshot(blobs)
        assert [f.params_sha256 for f in state.fragments] == [f.params_sha256 for f in snapshot.fragments]
