"""Your own model through the real services: the Flax NNX and Equinox examples (examples/) trained
by a checkpoint store, a syncer, a learner and an evaluator that all resolve `module:factory`,
then exported and reloaded with safetensors alone (issue 25)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from ddiloco import models
from ddiloco.cli import cluster as cluster_lib
from ddiloco.data import corpus
from services.learner import config as learner_config
from services.learner import train as train_lib
from tests.integration.conftest import LEARNER_PACE, SyncerProbe
from tests.integration.test_export import _idle_state
from tests.waits import TEARDOWN_CLIENTS_S

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
_CORPUS = ["--max-corpus-bytes", str(2 * 2**20), "--num-shards", "1"]
_EVAL = [*_CORPUS, "--eval-batches", "4", "--batch-size", "8"]


@pytest.mark.parametrize("name, optimizer", [("flax_lm:build", "adamw"), ("equinox_lm:build", "model")])
def test_a_plugin_model_trains_exports_and_reloads(tmp_path, monkeypatch, name, optimizer):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES)}  # every process resolves the same name
    cluster = cluster_lib.LocalCluster(tmp_path / "cluster", env=env)
    run_id = name.split(":")[0].replace("_", "-")
    try:
        store = cluster.start_store()
        syncer = cluster.start_syncer(run_id=run_id, extra=[
            "--model", name, "--model-config", json.dumps({"depth": 1}), "--num-fragments", "4",
            "--sync-period-steps", "4", "--download-codec", "fp32", "--checkpoint-every-merges", "6"])
        learner = cluster.start_learner(0, region="r", extra=["--steps", "40", *_CORPUS, *LEARNER_PACE,
                                                              "--log-every-steps", "10"])
        assert learner.wait(420) == 0, learner.log_tail()
        assert f"inner_optimizer={optimizer}" in learner.log_path.read_text(), learner.log_tail()
        probe = SyncerProbe(syncer.address)
        try:
            state = _idle_state(probe)
        finally:
            probe.close()
        assert state.config.model_name == name and state.tokens_merged > 0
        evaluated = subprocess.run(
            [sys.executable, "-m", "services.learner.evaluator", "--once", "--syncer", syncer.address, *_EVAL,
             "--log-level", "WARNING", "--timeout-s", "60"],
            capture_output=True, text=True, timeout=180, env=cluster.env, check=True).stdout
        evaluation = json.loads(evaluated.strip().splitlines()[-1])
        assert syncer.stop(30) == 0, syncer.log_tail()
        out = tmp_path / "export"
        exported = subprocess.run([sys.executable, "-m", "ddiloco.cli.main", "export", "--store", store.address,
                                   "--run-id", run_id, "--out", str(out)],
                                  capture_output=True, text=True, timeout=120, env=cluster.env)
        assert exported.returncode == 0, exported.stderr
    finally:
        cluster.stop_all(timeout_s=10.0, clients_timeout_s=TEARDOWN_CLIENTS_S)

    # The export holds the model's own tensor names and shapes, readable with safetensors alone.
    tensors = load_file(out / "model.safetensors")
    model = models.get_model(name, {"depth": 1})
    own = model.init(jax.random.PRNGKey(0))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {k: tuple(v.shape) for k, v in own.items()}
    assert json.loads((out / "config.json").read_text())["model_name"] == name

    # Its held-out loss is the evaluator's last figure, and it trained.
    params = {k: jnp.asarray(v) for k, v in tensors.items()}
    cfg = learner_config.parse_evaluator_config(_EVAL, {})
    split = corpus.load_split(cfg.data_dir, cfg.max_corpus_bytes, cfg.num_shards, cfg.heldout_fraction)
    batches = corpus.heldout_batches(split.heldout, cfg.batch_size, model.seq_len, cfg.eval_batches)
    evaluate = train_lib.make_eval_fn(model)
    # To float32 rounding: another process's XLA:CPU may order a reduction differently (one ulp
    # seen in test_export under load).
    assert evaluate(params, batches) == pytest.approx(evaluation["heldout_loss"], rel=1e-6)
    initial = float(np.mean([float(model.loss(own, b)) for b in batches]))
    assert evaluation["heldout_loss"] < initial - 0.3, (evaluation, initial)
