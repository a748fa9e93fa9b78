"""A Decoupled DiLoCo learner inside a plain JAX training loop (docs/python-api.md).

Start a syncer of the same model first (`ddiloco syncer --insecure --model-config '{"preset": "tiny"}'`), then
    python examples/embedded_learner.py --syncer 127.0.0.1:PORT --learner-id a --steps 200
"""
import argparse
import json
import pathlib
import time

import jax
import numpy as np
import optax

import ddiloco
from ddiloco import models

args = argparse.ArgumentParser()
args.add_argument("--syncer", required=True)
args.add_argument("--learner-id", required=True)
args.add_argument("--steps", type=int, default=200)
args.add_argument("--step-delay-s", type=float, default=0.0)  # simulated slower hardware (the tests)
args = args.parse_args()

model = models.get_model("transformer", {"preset": "tiny"})  # the model the syncer runs
optimizer = optax.adamw(3e-3)


@jax.jit
def my_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(model.loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


text = np.frombuffer(pathlib.Path(__file__).read_bytes(), np.uint8).astype(np.int32)  # any bytes: this file
rng = np.random.default_rng(list(args.learner_id.encode()))  # each learner its own batches
with ddiloco.Learner(syncer=args.syncer, params=model.init(jax.random.PRNGKey(0)), learner_id=args.learner_id,
                     insecure=True) as sync:
    params = sync.params  # the global model: every learner starts from it
    opt_state = optimizer.init(params)
    for _ in range(args.steps):
        batch = np.stack([text[s:s + model.seq_len + 1] for s in rng.integers(0, len(text) - model.seq_len - 1, 8)])
        params, opt_state, loss = my_step(params, opt_state, batch)
        params = sync.after_step(params, tokens=batch[:, 1:].size, loss=loss)
        time.sleep(args.step_delay_s)
print(json.dumps({"loss": float(loss), **sync.summary()}))
