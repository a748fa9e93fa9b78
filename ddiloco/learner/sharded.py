"""ShardedSyncClient: one learner's connection to a syncer split into fragment shards.

Owns the learner side of fragment shards (docs/architecture.md, "Fragment shards"): the first
session joins the syncer the learner was given; when that Join answers with a shard map
(JoinResponse.shards), one more SyncClient session is opened per other shard, each with that
shard's own address list (so failover within a shard works as for an unsharded syncer), and the
loop is shown one `SyncClientLike` (ports.py): each fragment's uploads go to its owner, what the
sessions receive (updates, outcomes, calls, refusals, arrivals, held values) is merged, progress
goes to every shard (each counts tokens for the budget), and `instance_of` names the owner's
life, so that one shard's restart re-syncs only its fragments. Without a shard map the client is
the one session, unchanged.

Data shards: the first session is the one that may be assigned a data shard (shard 0 assigns;
point learners at shard 0); the other sessions pin what it got.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np

from ddiloco.learner import client as client_lib
from ddiloco.v1 import syncer_pb2

_LOG = logging.getLogger("ddiloco.learner")

SessionFactory = Callable[[client_lib.ClientConfig], client_lib.SyncClient]


def _sum_stats(sessions) -> client_lib.ClientStats:
    """The sessions' statistics added up (the last hold: the longest)."""
    total = client_lib.ClientStats()
    for session in sessions:
        for field in dataclasses.fields(total):
            mine, theirs = getattr(total, field.name), getattr(session.stats, field.name)
            setattr(total, field.name, max(mine, theirs) if field.name == "last_upload_hold_s" else mine + theirs)
    return total


class ShardedSyncClient:
    """See the module docstring. Same life cycle as SyncClient: `start()`, then `close()`."""

    def __init__(self, cfg: client_lib.ClientConfig, session_factory: SessionFactory = client_lib.SyncClient) -> None:
        self.cfg = cfg
        self._factory = session_factory
        self._first = session_factory(cfg)
        self._sessions: dict[int, client_lib.SyncClient] = {0: self._first}  # shard index -> session
        self._owner: dict[int, int] = {}  # fragment -> shard index (empty: unsharded)

    # ------------------------------------------------------------------ life cycle (like SyncClient)

    def start(self, timeout_s: float) -> syncer_pb2.RunConfig:
        """Joins the given syncer; with a shard map in its answer, every other shard too (each within
        what is left of `timeout_s`). Raises as SyncClient.start."""
        deadline = time.monotonic() + timeout_s
        run_config = self._first.start(timeout_s)
        shards = list(self._first.shards)
        if not shards:
            return run_config
        first_index = self._first.shard_index
        self._sessions = {first_index: self._first}
        self._owner = {fid: shard.index for shard in shards for fid in shard.fragment_ids}
        missing = sorted(set(range(run_config.num_fragments)) - set(self._owner))
        if missing:
            raise ValueError(f"the syncer's shard map leaves fragments {missing} without an owner")
        pinned = self._first.data_shard if self.cfg.num_data_shards else self.cfg.data_shard
        for shard in shards:
            if shard.index == first_index:
                continue
            cfg = dataclasses.replace(self.cfg, target=",".join(shard.addresses), data_shard=pinned,
                                      failpoints="")  # crash points fire once per learner: the first session's
            self._sessions[shard.index] = self._factory(cfg)
        for _, session in sorted(self._sessions.items(), key=lambda item: item[0]):
            if session is not self._first:
                session.start(max(0.1, deadline - time.monotonic()))
        _LOG.info(f"joined {len(shards)} syncer shards", extra={"fields": {
            "shards": {s.index: list(s.addresses) for s in shards}}})
        return run_config

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all([s.flush(max(0.0, deadline - time.monotonic())) for s in self._sessions.values()])

    def close(self, *, leave: bool, timeout_s: float = 5.0) -> None:
        for session in self._sessions.values():
            session.close(leave=leave, timeout_s=timeout_s)

    def hit_failpoint(self, name: str) -> None:
        self._first.hit_failpoint(name)

    @property
    def run_config(self) -> syncer_pb2.RunConfig | None:
        return self._first.run_config

    @property
    def stats(self) -> client_lib.ClientStats:
        return _sum_stats(self._sessions.values()) if len(self._sessions) > 1 else self._first.stats

    @property
    def data_shard(self) -> int:
        return self._first.data_shard

    @property
    def schedule_start_step(self) -> int:
        return self._first.schedule_start_step

    @property
    def budget_reached(self) -> bool:
        return any(s.budget_reached for s in self._sessions.values())

    @property
    def shards(self) -> list[syncer_pb2.SyncerShard]:
        return self._first.shards

    @property
    def instance(self) -> str:
        """The first session's syncer life (unsharded: the syncer's); see instance_of per fragment."""
        return self._first.instance

    def session_of(self, fragment_id: int) -> client_lib.SyncClient:
        """The session of the shard that owns a fragment (the only one when unsharded)."""
        return self._sessions.get(self._owner.get(fragment_id, -1), self._first)

    # ------------------------------------------------------------------ the loop's interface (ports.py)

    def instance_of(self, fragment_id: int) -> str | None:
        return self.session_of(fragment_id).instance

    @property
    def fenced(self) -> client_lib.FencedError | None:
        return next((s.fenced for s in self._sessions.values() if s.fenced is not None), None)

    def take_updates(self) -> list[client_lib.GlobalFragment]:
        return [update for s in self._sessions.values() for update in s.take_updates()]

    def take_outcomes(self) -> list[client_lib.UploadOutcome]:
        return [outcome for s in self._sessions.values() for outcome in s.take_outcomes()]

    def take_calls(self) -> dict[int, syncer_pb2.RoundCall]:
        return {fid: call for s in self._sessions.values() for fid, call in s.take_calls().items()}

    def take_refused(self) -> set[tuple[int, str, int]]:
        return set().union(*(s.take_refused() for s in self._sessions.values()))

    def submit_upload(self, job: client_lib.UploadJob) -> None:
        self.session_of(job.fragment_id).submit_upload(job)

    def set_progress(self, request: syncer_pb2.ReportProgressRequest) -> None:
        for session in self._sessions.values():  # every shard counts the tokens and advances its schedule
            session.set_progress(request)

    def arrivals(self) -> dict[int, int]:
        return {fid: n for s in self._sessions.values() for fid, n in s.arrivals().items()}

    def wait_for_arrivals(self, after: dict[int, int], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        by_session: dict[int, dict[int, int]] = {}
        for fid, count in after.items():
            by_session.setdefault(self._owner.get(fid, -1), {})[fid] = count
        return all(self.session_of(next(iter(part))).wait_for_arrivals(part, max(0.0, deadline - time.monotonic()))
                   for part in by_session.values())

    def held_values(self) -> dict[int, tuple[int, np.ndarray]]:
        return {fid: held for s in self._sessions.values() for fid, held in s.held_values().items()}

    def agree_any(self, flag: bool) -> bool:
        return flag
