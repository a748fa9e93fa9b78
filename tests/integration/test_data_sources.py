"""User data end to end: learners and the evaluator on a pre-tokenized uint16 file (nanoGPT's .bin).

The held-out tail of the file is never trained on; the evaluator measures the global model on it.
A model whose vocabulary is smaller than the data's token ids is refused with a clear error.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from tests.integration.conftest import SyncerProbe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

VOCAB = 512


def _token_file(path) -> str:
    # A learnable sequence over 512 ids: a fixed random cycle of 97 tokens with 10% noise.
    rng = np.random.default_rng(0)
    cycle = rng.integers(0, VOCAB, size=97)
    tokens = np.resize(cycle, 200_000)
    noise = rng.random(len(tokens)) < 0.1
    tokens[noise] = rng.integers(0, VOCAB, size=int(noise.sum()))
    tokens.astype("<u2").tofile(path)
    return str(path)


def test_learners_and_evaluator_train_on_a_uint16_token_file(cluster, tmp_path):
    data = _token_file(tmp_path / "tokens.bin")
    model_config = json.dumps({"preset": "tiny", "vocab_size": VOCAB})
    syncer = cluster.start_syncer(run_id="tokens", extra=["--model-config", model_config, "--num-fragments", "4",
                                                          "--sync-period-steps", "4"])
    for i in range(2):
        cluster.start_learner(i, region="r", extra=["--steps", "60", "--num-shards", "2", "--data-dir", data,
                                                    "--log-every-steps", "100"])
    for svc in cluster.learners():
        assert svc.wait(240) == 0, svc.log_tail()
    out = subprocess.run(
        [sys.executable, "-m", "services.learner.evaluator", "--once", "--syncer", syncer.address, "--data-dir", data,
         "--num-shards", "2", "--log-level", "WARNING", "--timeout-s", "60"],
        capture_output=True, text=True, timeout=120, env=cluster.env, check=True,
    ).stdout
    loss = json.loads(out.strip().splitlines()[-1])["heldout_loss"]
    assert loss < math.log(VOCAB) - 1.0, loss  # ln(512) = 6.24 at initialization
    probe = SyncerProbe(syncer.address)
    try:
        assert probe.state(0).outer_steps > 0
    finally:
        probe.close()


def test_a_model_vocabulary_smaller_than_the_data_is_refused(cluster, tmp_path):
    data = _token_file(tmp_path / "tokens.bin")
    cluster.start_syncer(run_id="tokens-bad", extra=["--model-config", json.dumps({"preset": "tiny"})])
    learner = cluster.start_learner(0, region="r", extra=["--steps", "5", "--data-dir", data])
    assert learner.wait(120) == 2
    assert "vocab_size" in learner.log_tail()
