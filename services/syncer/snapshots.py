"""What a restart keeps, taken from the syncer's parts and given back to them.

Owns `Snapshots`: `take` copies the fragments this syncer owns (each under its lock, so values
and merge marks agree), the membership table (fencing, the security record, tokens, the
quarantine time left), the traffic and upload counters, the eval log, and the rounds' counters,
grace-window inputs and schedule position into one typed `state.SyncerSnapshot`; `restore` checks
a snapshot against the fragments this syncer owns and each fragment's sha256, then gives every
part its share back; the restored versions count as committed and the merge ledger names the step
restored. Also the checkpoint bookkeeping the training state shows: the last committed checkpoint
(`note_checkpoint`) and whether this life was restored from one.
Must not: read or write checkpoints (checkpointing.py encodes the snapshot, __main__ stores it),
build protobuf, or decide anything about rounds or members beyond putting their state back.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable

import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import shards as shards_lib
from . import influence as influence_lib
from . import membership as membership_lib
from . import merging as merging_lib
from . import slots as slots_lib
from . import state as state_lib

_LOG = logging.getLogger("ddiloco.syncer")


class Snapshots:
    """Takes and restores the SyncerSnapshot over the parts it is given (see the module docstring).

    `slots`: every planned fragment's slot (an `elsewhere` one for another shard's); `owned_slots`:
    those this syncer owns, which alone are copied and restored. `uploads` and `evals` are the
    core's, shared with the other parts: refilled on restore, never rebound."""

    def __init__(self, *, slots: list[slots_lib.FragmentSlot], owned_slots: list[slots_lib.FragmentSlot],
                 shards: shards_lib.ShardLayout, membership: membership_lib.Membership,
                 rounds: merging_lib.Rounds, influence: influence_lib.Influence, uploads: collections.Counter,
                 evals: collections.deque[state_lib.EvalSnapshot], clock: Callable[[], float],
                 wall_clock: Callable[[], float]) -> None:
        self._slots = slots
        self._owned_slots = owned_slots
        self._shards = shards
        self._membership = membership
        self._rounds = rounds
        self._influence = influence
        self._uploads = uploads
        self._evals = evals
        self._clock = clock
        self._wall = wall_clock
        self.restored_from_checkpoint = False
        # The last committed checkpoint (note_checkpoint; restore too).
        self.last_checkpoint_outer_step, self.last_checkpoint_unix_s = 0, 0.0

    def note_checkpoint(self, outer_step: int, unix_s: float) -> None:
        """A checkpoint of the state at `outer_step` was committed at `unix_s` (__main__'s checkpointer)."""
        self.last_checkpoint_outer_step, self.last_checkpoint_unix_s = outer_step, unix_s

    async def take(self) -> state_lib.SyncerSnapshot:
        """A consistent copy of everything a restart needs, taken while every owned fragment's lock
        is held: a merge advances its fragment's version and the run's counters (outer steps,
        tokens merged) under that fragment's lock, so no merge can fall between the copies and the
        counters. (Copying each fragment under its own lock, one after the other, let a merge land
        between them: a checkpoint then claimed outer step 21 with one fragment a version behind,
        the final checkpoint at shutdown was skipped as already written, and that merge was lost.)"""
        members = self._membership.members
        async with contextlib.AsyncExitStack() as held:
            for slot in self._owned_slots:  # a shard checkpoints only its own fragments; always in order
                await held.enter_async_context(slot.lock)
            fragments = [state_lib.FragmentSnapshot.of(slot, members) for slot in self._owned_slots]
            return self._with_counters(fragments, members)

    def _with_counters(self, fragments: list[state_lib.FragmentSnapshot], members) -> state_lib.SyncerSnapshot:
        rounds = self._rounds
        return state_lib.SyncerSnapshot(
            fragments=fragments,
            outer_steps=rounds.outer_steps,
            tokens_merged=rounds.tokens_merged,
            bytes_in=self._membership.bytes_in,
            bytes_out=self._membership.bytes_out,
            uploads=dict(self._uploads),
            members={m.learner_id: state_lib.MemberSnapshot.of(m, self._clock()) for m in members.values()},
            evals=list(self._evals),
            quorum_time_s=rounds.quorum_time.value,
            sync_time_s=rounds.sync_time.value,
            global_step=rounds.schedule.global_step,
            rounds_opened=[s.rounds_opened for s in self._slots],
        )

    def restore(self, snapshot: state_lib.SyncerSnapshot) -> None:
        """Loads a snapshot as `take` returns it (or checkpointing.load_snapshot reads it back);
        ValueError when it holds other fragments than this syncer owns, or one fails its sha256.
        This life then counts as restored from that (committed) checkpoint."""
        if not isinstance(snapshot, state_lib.SyncerSnapshot):
            raise TypeError(f"restore takes a SyncerSnapshot (checkpointing.load_snapshot), not {type(snapshot).__name__}")
        by_id = {f.fragment_id: f for f in snapshot.fragments}
        owned = sorted(slot.fragment.fragment_id for slot in self._owned_slots)
        if sorted(by_id) != owned:
            raise ValueError(
                f"checkpoint has fragments {sorted(by_id)}, but this syncer ({self._shards.describe()} of a "
                f"{len(self._slots)}-fragment plan) owns {owned}: a checkpoint of a different "
                "fragment plan or shard layout; start with the layout it was written with, or another --run-id")
        for slot in self._owned_slots:
            _restore_slot(slot, by_id[slot.fragment.fragment_id])
        self._rounds.restore(snapshot)
        membership = self._membership
        membership.bytes_in = snapshot.bytes_in
        membership.bytes_out = snapshot.bytes_out
        self._uploads.clear()  # the parts hold this counter: refilled, not replaced
        self._uploads.update(snapshot.uploads)
        # Fencing survives restarts: a learner must come back with an incarnation at least as new.
        for learner_id, m in snapshot.members.items():
            membership.members[learner_id] = m.restore(snapshot.fragments, now_s=self._clock(),
                                                       now_unix_s=self._wall())
            if m.quarantine_remaining_s > 0:  # quarantine survives restarts too
                membership.quarantines += 1
        self._evals.extend(snapshot.evals)
        for slot in self._owned_slots:  # restored from a committed checkpoint
            slot.committed_version = slot.version
        self.restored_from_checkpoint = True
        self.last_checkpoint_outer_step = self._rounds.outer_steps
        self._influence.restored_step = self._rounds.outer_steps  # the ledger's records name the lineage they follow
        _LOG.info("restored", extra={"fields": {
            "outer_step": self._rounds.outer_steps,
            "versions": {s.fragment.fragment_id: s.version for s in self._owned_slots},
            "sha256": [s.params_sha256[:12] for s in self._owned_slots]}})


def _restore_slot(slot: slots_lib.FragmentSlot, frag: state_lib.FragmentSnapshot) -> None:
    params = np.asarray(frag.params, dtype=np.float32)
    if params.shape != (slot.fragment.numel,):
        raise ValueError(f"checkpoint fragment {slot.fragment.fragment_id} has shape {params.shape}")
    digest = fragments_lib.fragment_sha256(params)
    if digest != frag.params_sha256:
        raise ValueError(f"checkpoint fragment {slot.fragment.fragment_id} fails its sha256 check")
    slot.reset(params, [np.asarray(a) for a in frag.opt_state], frag.version, digest)
