"""Serializes the syncer's snapshot into content-addressed blobs and back.

Layout of one checkpoint (a manifest in the checkpoint store):
  - `fragment/<id>`: safetensors with `params` (float32) and `opt/<i>` (outer optimizer state);
    unchanged fragments produce identical bytes, so the store keeps them once.
  - `state`: JSON with versions, counters, membership (for fencing) and the eval history.
  - `run` (ddiloco.run_description): what the bytes mean -- run configuration, model name and
    configuration, fragment plan with tensor names, shapes and offsets -- so that `ddiloco export`
    needs no flags. Checkpoints written before it existed lack it; restoring never needs it.
Bit-exactness: float32 arrays are stored as raw little-endian bytes, and each fragment's sha256
is recorded in `state` and checked again by `SyncerCore.restore`.
The snapshot itself is typed (services/syncer/state.py); this module stores its checkpoint form.
"""

from __future__ import annotations

import json

import numpy as np
from safetensors import numpy as st_numpy

from ddiloco import run_description as run_description_lib
from ddiloco.algo import fragments as fragments_lib
from . import state as state_lib

FORMAT_VERSION = "1"
# The syncer's own hyperparameters recorded with the run (learners' inner ones are theirs); an
# allow-list, so that no address, path or credential setting ever lands in a checkpoint.
_TRAINING_FIELDS = ("sync_mode", "seed", "outer_lr", "outer_momentum", "outer_step_fraction", "grace_gamma",
                    "max_grace_s", "token_budget", "norm_bound_factor", "norm_bound_action", "direction_check",
                    "dp_learning_rate", "dp_warmup_steps", "dp_decay_steps", "dp_weight_decay")


def describe_run(cfg, run_config, plan: fragments_lib.FragmentPlan) -> run_description_lib.RunDescription:
    """The `run` blob's record for a syncer started with `cfg` (a SyncerConfig); `run_config` is the
    RunConfig learners adopt (wire_views.run_config), passed through to the library unread."""
    training = {name: getattr(cfg, name) for name in _TRAINING_FIELDS if hasattr(cfg, name)}
    return run_description_lib.describe(run_config, plan, training)


def encode_snapshot(snapshot: state_lib.SyncerSnapshot,
                    description: run_description_lib.RunDescription | None = None,
                    ) -> tuple[dict[str, bytes], dict]:
    """Returns ({blob name: bytes}, metadata) for a snapshot from SyncerCore.snapshot(), with the
    `run` blob when a description is given."""
    if not isinstance(snapshot, state_lib.SyncerSnapshot):
        raise TypeError(f"encode_snapshot takes a SyncerSnapshot, not {type(snapshot).__name__}")
    snapshot = snapshot.to_dict()
    blobs: dict[str, bytes] = {}
    fragments_meta = []
    for frag in snapshot["fragments"]:
        tensors = {"params": np.ascontiguousarray(frag["params"], dtype=np.float32)}
        for i, arr in enumerate(frag["opt_state"]):
            tensors[f"opt/{i:03d}"] = np.ascontiguousarray(arr)
        blobs[f"fragment/{frag['fragment_id']}"] = st_numpy.save(tensors)
        fragments_meta.append(
            {
                "fragment_id": frag["fragment_id"],
                "version": frag["version"],
                "params_sha256": frag["params_sha256"],
                "opt_state_len": len(frag["opt_state"]),
                "merged_marks": frag.get("merged_marks", {}),
            }
        )
    state = {k: v for k, v in snapshot.items() if k != "fragments"}
    state["fragments"] = fragments_meta
    state["format"] = FORMAT_VERSION
    blobs["state"] = json.dumps(state, sort_keys=True).encode()
    metadata = {"format": FORMAT_VERSION, "kind": "syncer"}
    if description is not None:
        blobs[run_description_lib.BLOB_NAME] = description.to_json()
        metadata["model"] = description.model_name
    return blobs, metadata


def load_snapshot(blobs: dict[str, bytes]) -> state_lib.SyncerSnapshot:
    """Inverse of encode_snapshot: the typed snapshot SyncerCore.restore takes, and the tools read
    without a syncer (the chaos invariants, tests); ValueError when the checkpoint is malformed."""
    return state_lib.SyncerSnapshot.from_dict(_checkpoint_form(blobs))


def _checkpoint_form(blobs: dict[str, bytes]) -> dict:
    """The blobs as SyncerSnapshot.to_dict's form, the arrays loaded."""
    try:
        state = json.loads(blobs["state"])
    except (KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"checkpoint has no readable state blob: {exc}") from None
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint format {state.get('format')!r} is not {FORMAT_VERSION!r}")
    fragments = []
    for meta in state["fragments"]:
        name = f"fragment/{meta['fragment_id']}"
        if name not in blobs:
            raise ValueError(f"checkpoint is missing blob {name!r}")
        tensors = st_numpy.load(blobs[name])
        fragments.append(
            {
                **meta,
                "params": tensors["params"],
                "opt_state": [tensors[f"opt/{i:03d}"] for i in range(meta["opt_state_len"])],
            }
        )
    state["fragments"] = fragments
    return state
