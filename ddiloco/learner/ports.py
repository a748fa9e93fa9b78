"""The sync-client interface the learner loop depends on (`SyncClientLike`), and a null client.

The loop (loop.py) talks to its client through these members and no others: client.py's
SyncClient implements them over gRPC, distributed.py's UnitClient for a multi-process learner
unit, `NullSyncClient` for a loop that never hears from a syncer (the benchmarks' baseline, the
base of test fakes). tests/unit/test_learner_ports.py checks that the loop uses exactly these
members and that every implementation has them with the same parameters.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

import numpy as np

from ddiloco.v1 import syncer_pb2
from ddiloco.learner import client as client_lib


@runtime_checkable
class SyncClientLike(Protocol):
    """What the learner loop needs of its connection to the syncer. Every call is non-blocking
    except `wait_for_arrivals`; the `take_*` calls hand over what arrived since the last call."""

    def instance_of(self, fragment_id: int) -> str | None:
        """The syncer life the client is joined to for this fragment ("" before the join): the
        syncer's, or with fragment shards the owning shard's (each restarts alone); None when the
        client cannot name it (a multi-process unit's followers only see the leader's tag)."""

    @property
    def fenced(self) -> client_lib.FencedError | None:
        """Set once a newer life of this learner joined: the loop stops waiting and sending."""

    def take_updates(self) -> list[client_lib.GlobalFragment]:
        """The newest received version of each fragment since the last call."""

    def take_outcomes(self) -> list[client_lib.UploadOutcome]:
        """What became of submitted uploads since the last call, in order."""

    def take_calls(self) -> dict[int, syncer_pb2.RoundCall]:
        """The syncer's round calls since the last call (the newest per fragment)."""

    def take_refused(self) -> set[tuple[int, str, int]]:
        """(fragment, syncer instance, base version) of uploads refused, not taken, since the last call."""

    def submit_upload(self, job: client_lib.UploadJob) -> None:
        """Queues an upload (a queued, unsent one of the same fragment is replaced)."""

    def set_progress(self, request: syncer_pb2.ReportProgressRequest) -> None:
        """The latest progress snapshot, sent coalesced."""

    def arrivals(self) -> dict[int, int]:
        """How many versions of each fragment arrived so far (for `wait_for_arrivals`)."""

    def wait_for_arrivals(self, after: dict[int, int], timeout_s: float) -> bool:
        """Blocks until each fragment of `after` got a version beyond the count there; False on
        timeout, when fenced or closing."""

    def held_values(self) -> dict[int, tuple[int, np.ndarray]]:
        """fragment -> (version, values) of the newest version held from the current syncer life."""

    def agree_any(self, flag: bool) -> bool:
        """True when `flag` is True on any process of the learner (a unit agrees; one process is alone)."""


class NullSyncClient:
    """A client that never hears from a syncer: nothing arrives, uploads go nowhere, never fenced.
    The loop then does no communication work (the overlap benchmark's baseline); test fakes
    override what their scenario delivers."""

    instance: str | None = None
    fenced: client_lib.FencedError | None = None

    def instance_of(self, fragment_id: int) -> str | None:
        return self.instance  # one syncer life for every fragment (fakes set `instance`)

    def take_updates(self) -> list[client_lib.GlobalFragment]:
        return []

    def take_outcomes(self) -> list[client_lib.UploadOutcome]:
        return []

    def take_calls(self) -> dict[int, syncer_pb2.RoundCall]:
        return {}

    def take_refused(self) -> set[tuple[int, str, int]]:
        return set()

    def submit_upload(self, job: client_lib.UploadJob) -> None:
        pass

    def set_progress(self, request: syncer_pb2.ReportProgressRequest) -> None:
        pass

    def arrivals(self) -> dict[int, int]:
        return {}

    def wait_for_arrivals(self, after: dict[int, int], timeout_s: float) -> bool:
        if not after:
            return True  # nothing to wait for (as SyncClient)
        time.sleep(timeout_s)  # nothing ever arrives: the wait runs to its timeout
        return False

    def held_values(self) -> dict[int, tuple[int, np.ndarray]]:
        return {}

    def agree_any(self, flag: bool) -> bool:
        return flag
