"""What a chaos run left in the checkpoint store: every retained checkpoint loaded and decoded
(for invariant I4), and the held-out loss of one (I5), computed in this process."""

from __future__ import annotations

import asyncio
import datetime
import json


def heldout_loss(snapshot, run_config, *, max_corpus_bytes: int, num_shards: int, heldout_fraction: float = 0.05,
                 data_dir: str = "", batches: int = 8, batch_size: int = 16) -> float:
    """The held-out loss of a checkpoint's global parameters (`snapshot`: a SyncerSnapshot), the
    evaluator's computation, in process."""
    import jax
    import numpy as np

    from ddiloco import models
    from ddiloco.algo import fragments as fragments_lib
    from ddiloco.data import corpus
    from ddiloco.wire import serde

    model = models.get_model(run_config.model_name, json.loads(run_config.model_config_json))
    plan = serde.plan_from_proto(run_config.fragments, run_config.sync_period_steps)
    by_id = {f.fragment_id: np.asarray(f.params, dtype=np.float32) for f in snapshot.fragments}
    params = {}
    for frag in plan.fragments:
        params.update(fragments_lib.unflatten_fragment(by_id[frag.fragment_id], frag))
    split = corpus.load_split(data_dir, max_corpus_bytes, num_shards, heldout_fraction)
    held = corpus.heldout_batches(split.heldout, batch_size, model.seq_len, batches)
    key = (run_config.model_name, run_config.model_config_json)
    if key not in _LOSS_FNS:  # one compilation per model in this process
        _LOSS_FNS[key] = jax.jit(model.loss)
    loss_fn = _LOSS_FNS[key]
    return float(sum(float(loss_fn(params, b)) for b in held) / len(held))


_LOSS_FNS: dict = {}


def load_checkpoints(address: str, run_id: str) -> list[tuple[int, object]]:
    """Every checkpoint of `run_id` the store at `address` retains, oldest first, as (step, its
    SyncerSnapshot), or (step, the exception) when one does not load (I4 reports it)."""
    from ddiloco import checkpoint_client
    from ddiloco.rpc import channel as channel_lib
    from ddiloco.cli import service_names

    checkpointing = service_names.load("services.syncer.checkpointing")  # the checkpoint layout is the syncer's

    async def load():
        channel = channel_lib.aio_channel(address)
        try:
            client = checkpoint_client.CheckpointClient(
                channel, timeout=datetime.timedelta(seconds=10), retry_timeout=datetime.timedelta(seconds=20))
            out = []
            for manifest in await client.list_manifests(run_id):
                try:
                    blobs = {ref.name: await client.get_blob(ref.digest) for ref in manifest.blobs}
                    out.append((manifest.step, checkpointing.load_snapshot(blobs)))
                except Exception as exc:  # noqa: BLE001 - reported by I4
                    out.append((manifest.step, exc))
            return out
        finally:
            await channel.close()

    return asyncio.run(load())
