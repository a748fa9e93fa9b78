"""Data parallelism inside a learner unit: the train step and the loop over a mesh of devices.

The scenarios need several (virtual CPU) devices, and JAX fixes the device count when its backend
starts, so each one runs in a child process started with
`XLA_FLAGS=--xla_force_host_platform_device_count=4` (`python -m tests.unit.test_sharded_train
SCENARIO`); the child asserts and prints a JSON line. Configuration and mesh checks that need no
extra device run in this process.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 8
BATCH = 8


def _run_child(scenario: str, devices: int = 4, timeout_s: float = 240.0) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.unit.test_sharded_train", scenario],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s,
    )
    assert proc.returncode == 0, f"{scenario} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- in the child


def _setup():
    import jax

    from ddiloco.models import get_model
    from services.learner.train import InnerOptConfig, make_inner_optimizer

    assert len(jax.devices()) >= 4, jax.devices()
    model = get_model("transformer", {"preset": "tiny"})
    optimizer = make_inner_optimizer(InnerOptConfig(learning_rate=3e-3, warmup_steps=2))
    init = {k: np.asarray(v) for k, v in model.init(jax.random.key(0)).items()}
    tokens = np.random.default_rng(0).integers(0, 256, size=20_000).astype(np.int32)
    return model, optimizer, init, tokens


def _meshes():
    import jax

    from services.learner.train import make_mesh

    devices = jax.devices()[:4]
    return {
        "1-device": None,
        "4-data": make_mesh(devices),  # replicated params
        "4-fsdp": make_mesh(devices, (1, 4)),  # params and moments sharded 4 ways
        "2x2": make_mesh(devices, (2, 2)),  # 2 data-parallel groups of 2-way FSDP
    }


def scenario_train_step() -> dict:
    """The same global batches on 1 device and on 4 (replicated, FSDP, hybrid) give the same params."""
    import jax
    from jax.sharding import NamedSharding

    from ddiloco.data import BatchSampler
    from services.learner.train import TrainStep

    model, optimizer, init, tokens = _setup()
    results, losses = {}, {}
    for label, mesh in _meshes().items():
        step = TrainStep(model, optimizer, mesh)
        params = step.place_params(dict(init))
        opt_state = step.init_opt_state(params)
        sampler = BatchSampler(tokens, BATCH, model.seq_len, seed=1)
        losses[label] = []
        for _ in range(STEPS):
            params, opt_state, loss = step(params, opt_state, sampler.next())
            losses[label].append(loss)
        if mesh is not None:
            for name, value in params.items():
                assert value.sharding == step.param_shardings[name], (label, name, value.sharding)
                assert isinstance(value.sharding, NamedSharding)
            assert len(params["head"].sharding.device_set) == 4
            # Adam's moments follow their parameter's sharding (sharded too under FSDP).
            moments = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state)
                       if getattr(path[-1], "key", None) == "head"]
            assert len(moments) == 2 and all(m.sharding == step.param_shardings["head"] for m in moments)
        results[label] = {k: step.to_host(v) for k, v in params.items()}
    # FSDP: the 32x256 head is split 4 ways along its first axis, 8 rows per device.
    head = TrainStep(model, optimizer, _meshes()["4-fsdp"]).place("head", init["head"])
    assert {s.data.shape for s in head.addressable_shards} == {(8, 256)}
    diffs = {}
    for label, params in results.items():
        diffs[label] = max(float(np.max(np.abs(params[k] - results["1-device"][k]))) for k in init)
        np.testing.assert_allclose(losses[label], losses["1-device"], rtol=1e-5, err_msg=label)
        assert diffs[label] < 1e-5, (label, diffs[label])
    moved = max(float(np.max(np.abs(results["1-device"][k] - init[k]))) for k in init)
    assert moved > 1e-3  # the comparison is not vacuous: training changed the params
    return {"max_abs_diff": diffs, "moved": moved}


def scenario_loop() -> dict:
    """The learner loop over a mesh: same uploads and params as on 1 device; a fragment's extraction
    brings only that fragment to the host; fold-ins keep the step's shardings."""
    from ddiloco.algo import fragments as fragments_lib
    from ddiloco.data import BatchSampler
    from ddiloco.learner import client as client_lib
    from ddiloco.learner import loop as loop_lib
    from services.learner.train import TrainStep
    from tests import fakes

    model, optimizer, init, tokens = _setup()
    plan = fragments_lib.plan_fragments(model.tensor_specs(), 4, 4)
    model_numel = sum(f.numel for f in plan.fragments)
    out = {}
    for alpha in (0.0, 0.5):
        runs = {}
        for label, mesh in _meshes().items():
            if label == "2x2":
                continue
            step = TrainStep(model, optimizer, mesh)
            fetched: list[int] = []

            def counting_to_host(value, _inner=step.to_host, _fetched=fetched):
                host = _inner(value)
                _fetched.append(host.size)
                return host

            step.to_host = counting_to_host
            client = fakes.RecordingSyncClient()  # scripted global fragments, uploads recorded
            globals_ = {f.fragment_id: fragments_lib.flatten_fragment(init, f) for f in plan.fragments}
            client.inbox = [client_lib.GlobalFragment(fid, 1, "inst", v) for fid, v in globals_.items()]
            zeros = {k: np.zeros_like(v) for k, v in init.items()}
            loop = loop_lib.LearnerLoop(
                plan=plan, params=zeros, train_step=step, sampler=BatchSampler(tokens, BATCH, model.seq_len, seed=2),
                client=client, learner_id="l", incarnation=1, mixing_alpha=alpha,
                round_trigger="upload",  # due by the local counter: this fake syncer calls no rounds
            )
            loop.apply_updates()
            per_step_fetch = []
            for t in range(1, 13):
                if t == 6:  # a new global version of fragment 2 arrives mid-run
                    values = globals_[2] + 0.01
                    client.inbox = [client_lib.GlobalFragment(2, 2, "inst", values)]
                fetched.clear()
                loop.step()
                due = [f for f in plan.due(t)]
                per_step_fetch.append((sum(fetched), sum(plan.fragments[f].numel for f in due), t))
            for total, due_numel, t in per_step_fetch:
                # Only the fragments due at that step come to the host (the loss scalar aside);
                # with alpha-mixing the arriving fragment too (t == 6, fragment 2).
                extra = plan.fragments[2].numel if (alpha and t == 6) else 0
                assert total <= due_numel + extra + 1, (label, t, total, due_numel)
                assert total < model_numel or due_numel + extra >= model_numel
            if mesh is not None:
                for name, value in loop.params.items():
                    assert value.sharding == step.param_shardings[name], (label, name)
            assert len(client.uploads) >= 4
            runs[label] = (
                {k: step.to_host(v) for k, v in loop.params.items()},
                [(u.fragment_id, u.base_version, u.steps, u.tokens, u.delta) for u in client.uploads],
            )
        ref_params, ref_uploads = runs["1-device"]
        for label, (params, uploads) in runs.items():
            assert [u[:4] for u in uploads] == [u[:4] for u in ref_uploads], label
            for u, r in zip(uploads, ref_uploads, strict=True):
                np.testing.assert_allclose(u[4], r[4], atol=1e-5, err_msg=f"{label} upload {u[:4]}")
            for k in init:
                np.testing.assert_allclose(params[k], ref_params[k], atol=1e-5, err_msg=f"{label} {k}")
        # Tokens count the whole global batch (all devices), per step.
        assert all(u[3] == u[2] * BATCH * model.seq_len for u in ref_uploads)
        out[f"alpha={alpha}"] = {"uploads": len(ref_uploads)}
    return out


# ---------------------------------------------------------------------------------------------- pytest


def test_train_step_on_4_devices_matches_1_device():
    result = _run_child("train_step")
    assert set(result["max_abs_diff"]) == {"1-device", "4-data", "4-fsdp", "2x2"}


def test_loop_on_4_devices_matches_1_device_and_moves_one_fragment_at_a_time():
    result = _run_child("loop")
    assert result["alpha=0.0"]["uploads"] >= 4


def test_mesh_shape_and_config_validation():
    from services.learner import config as config_lib
    from services.learner import distributed

    assert distributed.parse_mesh_shape("") is None
    assert distributed.parse_mesh_shape("2x4") == (2, 4)
    for bad in ("2", "2x", "0x4", "axb", "2x2x2"):
        with pytest.raises(ValueError):
            distributed.parse_mesh_shape(bad)
    cfg = config_lib.parse_learner_config(["--num-devices", "4", "--fsdp", "--mesh-shape", "2x2"], {})
    assert (cfg.num_devices, cfg.fsdp, cfg.mesh_shape) == (4, True, "2x2")
    cfg = config_lib.parse_learner_config(
        ["--num-processes", "2", "--process-id", "1", "--coordinator-address", "h:1234"], {}
    )
    assert (cfg.num_processes, cfg.process_id, cfg.coordinator_address) == (2, 1, "h:1234")
    env = {"DDILOCO_LEARNER_NUM_PROCESSES": "2", "DDILOCO_LEARNER_COORDINATOR_ADDRESS": "h:1",
           "DDILOCO_LEARNER_NUM_DEVICES": "8"}
    cfg = config_lib.parse_learner_config([], env)
    assert (cfg.num_processes, cfg.num_devices) == (2, 8)
    for argv in (["--num-processes", "2"], ["--process-id", "1"], ["--num-devices", "-1"], ["--mesh-shape", "4"]):
        with pytest.raises(SystemExit):
            config_lib.parse_learner_config(argv, {})


def test_one_device_unit_keeps_the_plain_path():
    import jax

    from services.learner import distributed

    unit = distributed.init_unit(batch_size=16)
    assert unit.mesh is None and unit.process_count == 1 and unit.num_devices == len(jax.local_devices())
    if len(jax.local_devices()) == 1:
        with pytest.raises(ValueError, match="num-devices"):
            distributed.init_unit(num_devices=2)
    assert unit.agree_int(2**62 + 5) == 2**62 + 5


def test_batch_must_divide_over_devices():
    result = _run_child("batch_divisibility", devices=4, timeout_s=120)
    assert result["ok"]


def scenario_batch_divisibility() -> dict:
    from services.learner import distributed

    unit = distributed.init_unit(batch_size=8)
    assert unit.num_devices == 4 and unit.mesh_shape == (4, 1)
    assert distributed.init_unit(batch_size=8, fsdp=True).mesh_shape == (1, 4)
    assert distributed.init_unit(batch_size=8, mesh_shape="2x2").mesh_shape == (2, 2)
    assert distributed.init_unit(batch_size=8, num_devices=1).mesh is None
    for kwargs, match in (({"batch_size": 6}, "divisible"), ({"mesh_shape": "2x1"}, "needs 2 devices"),
                          ({"num_devices": 8}, "num-devices")):
        try:
            distributed.init_unit(**kwargs)
        except ValueError as exc:
            assert match in str(exc), (kwargs, str(exc))
        else:
            raise AssertionError(f"no error for {kwargs}")
    return {"ok": True}


if __name__ == "__main__":
    print(json.dumps(globals()[f"scenario_{sys.argv[1]}"]()))
