"""The syncer's state as a restart needs it: the typed snapshot, in plain Python values.

Owns `SyncerSnapshot` (with `FragmentSnapshot`, `MemberSnapshot`, `EvalSnapshot`): what a checkpoint
keeps, and its conversion to and from the checkpoint's JSON-friendly form
(services/syncer/checkpointing.py stores that form); and the plain form of a ReportEvalRequest
(`EvalReport`). The protobuf views of this state (the TrainingState rows, EvalRecord) live in
services/syncer/wire_views.py, next to the servicer, which also makes these plain forms.
Must not: import generated protobuf code; take locks or mutate the core (snapshots.Snapshots calls
these under the fragments' locks, on the core's loop).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from . import membership as membership_lib
from . import slots as slots_lib


@dataclasses.dataclass(frozen=True)
class FragmentSnapshot:
    fragment_id: int
    version: int
    params: np.ndarray  # float32, a copy
    opt_state: list  # np.ndarray per outer optimizer state leaf, copies
    params_sha256: str
    # learner_id -> (incarnation, merged local_step mark) that this version holds: MergeReceipts
    # survive a restart.
    merged_marks: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, slot: slots_lib.FragmentSlot, members: Mapping[str, membership_lib.Member]) -> FragmentSnapshot:
        """A copy of the slot's values; call under its lock so that values and marks agree."""
        fid = slot.fragment.fragment_id
        return cls(fragment_id=fid, version=slot.version, params=slot.params.copy(),
                   opt_state=[np.array(a, copy=True) for a in slot.opt_state], params_sha256=slot.params_sha256,
                   merged_marks={m.learner_id: (m.incarnation, m.mark_at(fid, slot.version))
                                 for m in members.values() if m.mark_at(fid, slot.version)})

    def to_dict(self) -> dict:
        return {"fragment_id": self.fragment_id, "version": self.version, "params": self.params,
                "opt_state": self.opt_state, "params_sha256": self.params_sha256,
                "merged_marks": {lid: [inc, mark] for lid, (inc, mark) in self.merged_marks.items()}}

    @classmethod
    def from_dict(cls, frag: Mapping) -> FragmentSnapshot:
        return cls(fragment_id=int(frag["fragment_id"]), version=int(frag["version"]), params=frag["params"],
                   opt_state=list(frag["opt_state"]), params_sha256=frag["params_sha256"],
                   merged_marks={lid: (int(inc), int(mark))
                                 for lid, (inc, mark) in frag.get("merged_marks", {}).items()})


@dataclasses.dataclass(frozen=True)
class MemberSnapshot:
    """What a restart keeps of a learner: fencing, the security record, tokens, steps and its data shard."""

    learner_id: str
    incarnation: int
    region: str = ""
    joins: int = 1
    flags: int = 0
    rejections: dict[str, int] = dataclasses.field(default_factory=dict)
    tokens_total: int = 0  # this life's
    tokens_prev_lives: int = 0
    steps_total: int = 0  # this life's last reported local_step
    steps_prev_lives: int = 0
    num_data_shards: int = 0
    data_shard: int = -1
    data_shard_assigned: bool = False
    # The quarantine time left, so a restart keeps it (quarantines "until restart" end).
    quarantine_remaining_s: float = 0.0
    # This life finished its steps or left: restored as finished, so that a learner gone before a
    # restart neither is waited for nor keeps a quorum reachable (Membership.quorum_reachable).
    ended: bool = False

    @classmethod
    def of(cls, m: membership_lib.Member, now_s: float) -> MemberSnapshot:
        """The member's record at `now_s` (clock())."""
        remaining_s = m.quarantined_until_s - now_s
        return cls(learner_id=m.learner_id, incarnation=m.incarnation, region=m.region, joins=m.joins,
                   flags=m.flags, rejections=dict(m.rejections), tokens_total=m.tokens_this_life(),
                   tokens_prev_lives=m.tokens_prev_lives, steps_total=m.local_step,
                   steps_prev_lives=m.steps_prev_lives, num_data_shards=m.num_data_shards,
                   data_shard=m.data_shard, data_shard_assigned=m.data_shard_assigned,
                   quarantine_remaining_s=remaining_s if 0 < remaining_s < math.inf else 0.0,
                   ended=m.finished or m.left)

    def to_dict(self) -> dict:
        fields = dataclasses.asdict(self)
        del fields["learner_id"]  # the key it is stored under
        return fields

    @classmethod
    def from_dict(cls, learner_id: str, m: Mapping) -> MemberSnapshot:
        """Tolerates the fields older checkpoints lack."""
        return cls(learner_id=learner_id, incarnation=int(m["incarnation"]), region=m.get("region", ""),
                   joins=int(m.get("joins", 1)), flags=int(m.get("flags", 0)),
                   rejections=dict(m.get("rejections", {})), tokens_total=int(m.get("tokens_total", 0)),
                   tokens_prev_lives=int(m.get("tokens_prev_lives", 0)),
                   steps_total=int(m.get("steps_total", 0)), steps_prev_lives=int(m.get("steps_prev_lives", 0)),
                   num_data_shards=int(m.get("num_data_shards", 0)), data_shard=int(m.get("data_shard", -1)),
                   data_shard_assigned=bool(m.get("data_shard_assigned", False)),
                   quarantine_remaining_s=float(m.get("quarantine_remaining_s", 0.0)),
                   ended=bool(m.get("ended", False)))

    def restore(self, fragments: list[FragmentSnapshot], *, now_s: float, now_unix_s: float) -> membership_lib.Member:
        """The member as a restarted syncer knows it: not seen yet, fenced at this incarnation (a
        learner must come back with one at least as new), with its marks, record and quarantine."""
        member = membership_lib.Member(
            learner_id=self.learner_id, incarnation=self.incarnation, region=self.region, tokens_per_step=0,
            last_seen_s=-math.inf, last_seen_unix_s=0.0, joins=self.joins, flags=self.flags,
            rejections=collections.Counter(self.rejections), tokens_total=self.tokens_total,
            tokens_prev_lives=self.tokens_prev_lives, local_step=self.steps_total,
            steps_prev_lives=self.steps_prev_lives,
            # A returning learner id is given its shard again (Membership._place_on_data_shard).
            num_data_shards=self.num_data_shards, data_shard=self.data_shard,
            data_shard_assigned=self.data_shard_assigned, finished=self.ended,
        )
        for frag in fragments:
            incarnation, mark = frag.merged_marks.get(self.learner_id, (-1, 0))
            if incarnation == member.incarnation and mark:
                member.merged_marks[frag.fragment_id] = collections.deque(
                    [(frag.version, mark)], maxlen=membership_lib.RECEIPT_HISTORY)
        if self.quarantine_remaining_s > 0:
            member.quarantined_until_s = now_s + self.quarantine_remaining_s
            member.quarantined_until_unix_s = now_unix_s + self.quarantine_remaining_s
        return member


class EvalReport(NamedTuple):
    """A ReportEvalRequest's fields the core reads (wire_views.eval_report)."""

    protocol_version: int
    evaluator_id: str
    heldout_loss: float
    tokens_merged: int
    outer_steps: int  # the sum of the evaluated fragments' versions


@dataclasses.dataclass(frozen=True)
class EvalSnapshot:
    at_unix_s: float = 0.0
    heldout_loss: float = 0.0
    tokens_merged: int = 0
    outer_steps: int = 0


@dataclasses.dataclass(frozen=True)
class SyncerSnapshot:
    """Everything a restart needs, copied consistently (SyncerCore.snapshot, services/syncer/snapshots.py)."""

    fragments: list[FragmentSnapshot]
    outer_steps: int
    tokens_merged: int
    bytes_in: int = 0
    bytes_out: int = 0
    uploads: dict[str, int] = dataclasses.field(default_factory=dict)
    members: dict[str, MemberSnapshot] = dataclasses.field(default_factory=dict)
    evals: list[EvalSnapshot] = dataclasses.field(default_factory=list)
    quorum_time_s: float | None = None  # the grace window's smoothed inputs (None: not measured)
    sync_time_s: float | None = None
    global_step: float = 0.0  # the round schedule's position (ddiloco.algo.rounds)
    rounds_opened: list[int] = dataclasses.field(default_factory=list)  # per fragment

    def to_dict(self) -> dict:
        """The checkpoint form: plain JSON-friendly values, the fragments' arrays as they are."""
        return {
            "fragments": [f.to_dict() for f in self.fragments],
            "outer_steps": self.outer_steps,
            "tokens_merged": self.tokens_merged,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "uploads": dict(self.uploads),
            "members": {lid: m.to_dict() for lid, m in self.members.items()},
            "evals": [dataclasses.asdict(e) for e in self.evals],
            "quorum_time_s": self.quorum_time_s,
            "sync_time_s": self.sync_time_s,
            "global_step": self.global_step,
            "rounds_opened": list(self.rounds_opened),
        }

    @classmethod
    def from_dict(cls, state: Mapping) -> SyncerSnapshot:
        """The inverse of `to_dict` (checkpointing.load_snapshot reads a checkpoint with it); tolerates
        the fields older checkpoints lack."""
        return cls(
            fragments=[FragmentSnapshot.from_dict(f) for f in state["fragments"]],
            outer_steps=int(state["outer_steps"]),
            tokens_merged=int(state["tokens_merged"]),
            bytes_in=int(state.get("bytes_in", 0)),
            bytes_out=int(state.get("bytes_out", 0)),
            uploads=dict(state.get("uploads", {})),
            members={lid: MemberSnapshot.from_dict(lid, m) for lid, m in state.get("members", {}).items()},
            evals=[EvalSnapshot(**e) for e in state.get("evals", [])],
            quorum_time_s=state.get("quorum_time_s"),
            sync_time_s=state.get("sync_time_s"),
            global_step=float(state.get("global_step", 0.0)),
            rounds_opened=[int(n) for n in state.get("rounds_opened", ())],
        )
