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

The learner may be given any shard's address, or a list of them (tried in turn): the shard that
answers first tells the map. Shard 0 is then joined first, as data shards are assigned by shard 0
alone (a first answer from another shard is closed and that shard joined again after shard 0,
pinned); the other sessions pin what shard 0 assigned. A shard that does not answer at the start
does not fail the join (issue 21): the learner trains on, its fragments from the learner's own
initial values, and that shard's session keeps re-joining in the background (SyncClient's capped
backoff, each call with its deadline); once it joins, the loop rebases the kept work onto the
shard's copy and answers its first call with all of it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
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

    def __init__(self, cfg: client_lib.ClientConfig, session_factory: SessionFactory = client_lib.SyncClient, *,
                 shard_join_wait_s: float = 10.0) -> None:
        self.cfg = cfg
        self._factory = session_factory
        self._first = session_factory(cfg)
        self._sessions: dict[int, client_lib.SyncClient] = {0: self._first}  # shard index -> session
        self._owner: dict[int, int] = {}  # fragment -> shard index (empty: unsharded)
        # How long the start waits for a shard other than the one that answered first; a shard not joined
        # by then is left to its session, which keeps re-joining in the background (capped backoff).
        self._shard_join_wait_s = shard_join_wait_s
        self._data_shard: int | None = None  # the data shard every session pins (None: the first's)
        self._provisional: list[client_lib.GlobalFragment] = []  # bases of a down shard's fragments
        self._missing: set[int] = set()  # shards not joined at the start (their sessions keep trying)

    # ------------------------------------------------------------------ life cycle (like SyncClient)

    def start(self, timeout_s: float) -> syncer_pb2.RunConfig:
        """Joins the syncer (or shard) the learner was given; with a shard map in its answer, every
        shard, shard 0 first (it alone assigns data shards). A shard that does not answer within
        `shard_join_wait_s` (and what is left of `timeout_s`) does not fail the start: its session
        keeps re-joining in the background, and its fragments are trained from this learner's own
        initial values (ClientConfig.initial_values) until the shard's copy arrives, which the loop
        rebases onto (the work is kept, and goes out at the shard's first call). Raises as
        SyncClient.start when the first syncer or every shard fails."""
        deadline = time.monotonic() + timeout_s
        run_config = self._first.start(timeout_s)
        shards = {shard.index: shard for shard in self._first.shards}
        if not shards:
            return run_config
        self._owner = {fid: shard.index for shard in shards.values() for fid in shard.fragment_ids}
        missing = sorted(set(range(run_config.num_fragments)) - set(self._owner))
        if missing:
            raise ValueError(f"the syncer's shard map leaves fragments {missing} without an owner")
        wait_s = lambda: max(0.1, min(self._shard_join_wait_s, deadline - time.monotonic()))  # noqa: E731
        given = [t.strip() for t in self.cfg.target.split(",") if t.strip()]
        pinned = None
        if self._first.shard_index != 0 and 0 in shards:
            # Given another shard's address: it told the map. Shard 0 is joined first (its data-shard
            # assignment is the one every shard records); this shard is joined again, pinned, below.
            reopen = f"shard {self._first.shard_index} answered first; joining shard 0 first"
        elif len(given) > 1 and given != list(shards[0].addresses):
            # Given a list naming several shards: on a failure this session would fail over to another
            # shard. Shard 0 is joined again with its own addresses, keeping the data shard it assigned.
            reopen = "given several shards' addresses; joining shard 0 at its own"
            pinned = self._first.data_shard if self.cfg.num_data_shards else None
        else:
            reopen = ""
        if reopen:
            _LOG.info(reopen)
            self._first.close(leave=False)
            self._sessions = {0: self._session_for(shards[0], pinned, keep_failpoints=True)}
            if self._start_all(self._sessions, wait_s()):
                self._first = self._sessions[0]
        else:
            self._sessions = {self._first.shard_index: self._first}
        self._data_shard = pinned if pinned is not None else self._pinned(0 not in self._missing)
        for session in self._sessions.values():
            session.data_shard = self._data_shard  # a late join of shard 0 pins, as the others do
        others = {s.index: self._session_for(s, self._data_shard) for s in shards.values() if s.index not in self._sessions}
        self._sessions.update(others)
        self._start_all(others, wait_s())
        joined = [index for index in sorted(self._sessions) if index not in self._missing]
        if not joined:
            raise TimeoutError(f"no syncer shard answered within {timeout_s:.0f} s")
        if all(self._first is not session for session in self._sessions.values()):
            self._first = self._sessions[joined[0]]  # the session closed above, shard 0 down: another speaks
        if self._missing:
            self._provisional = self._provisional_bases(run_config)
        _LOG.info(f"joined {len(joined)} of {len(shards)} syncer shards", extra={"fields": {
            "shards": {s.index: list(s.addresses) for s in shards.values()}, "retrying": sorted(self._missing)}})
        return run_config

    def _session_for(self, shard: syncer_pb2.SyncerShard, data_shard: int | None, *,
                     keep_failpoints: bool = False) -> client_lib.SyncClient:
        cfg = dataclasses.replace(self.cfg, target=",".join(shard.addresses))
        if data_shard is not None:
            cfg = dataclasses.replace(cfg, data_shard=data_shard)
        if not keep_failpoints:
            cfg = dataclasses.replace(cfg, failpoints="")  # crash points fire once per learner: the first session's
        return self._factory(cfg)

    def _start_all(self, sessions: dict[int, client_lib.SyncClient], wait_s: float) -> bool:
        """Starts the sessions at once, each bounded by `wait_s`; those not joined by then are noted
        in `_missing` (their sessions keep trying). True when all joined. A fence is raised."""
        errors: dict[int, BaseException | None] = {}

        def start(index: int, session: client_lib.SyncClient) -> None:
            try:
                session.start(wait_s)
                errors[index] = None
            except BaseException as exc:  # noqa: BLE001 - sorted out below, in the caller's thread
                errors[index] = exc

        threads = [threading.Thread(target=start, args=item, name=f"join-shard-{item[0]}", daemon=True)
                   for item in sessions.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(wait_s + 5.0)  # start() is bounded by wait_s; the margin covers its last poll
        fenced = next((e for e in errors.values() if isinstance(e, client_lib.FencedError)), None)
        if fenced is not None:
            raise fenced
        down = {index for index in sessions if errors.get(index, TimeoutError()) is not None}
        for index in sorted(down):
            _LOG.warning(f"syncer shard {index} did not answer within {wait_s:.1f} s ({errors.get(index)!r}); "
                         "training on, its session keeps re-joining in the background")
        self._missing |= down
        return not down

    def _pinned(self, shard_zero_joined: bool) -> int:
        """The data shard every session pins: shard 0's answer, else the learner's own choice."""
        if not self.cfg.num_data_shards:
            return self.cfg.data_shard
        if shard_zero_joined:
            return self._sessions[0].data_shard
        return self.cfg.data_shard if self.cfg.data_shard >= 0 else self.cfg.fallback_data_shard

    def _provisional_bases(self, run_config: syncer_pb2.RunConfig) -> list[client_lib.GlobalFragment]:
        """The down shards' fragments as this learner initializes them (version 0 of no syncer life):
        what the loop trains them from until the shard's own copy arrives."""
        fids = sorted(fid for fid, index in self._owner.items() if index in self._missing)
        if self.cfg.initial_values is None:
            raise TimeoutError(f"syncer shards {sorted(self._missing)} did not answer, and this learner has no "
                               "initial values of their fragments to train from")
        values = self.cfg.initial_values(run_config)
        return [client_lib.GlobalFragment(fid, 0, "", np.asarray(values[fid], dtype=np.float32)) for fid in fids]

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
        return self._first.data_shard if self._data_shard is None else self._data_shard

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
        provisional, self._provisional = self._provisional, []  # once, ahead of any copy of the shard's
        return provisional + [update for s in self._sessions.values() for update in s.take_updates()]

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
