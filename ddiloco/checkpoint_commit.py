"""The commit pointer: which checkpoint of a run is the latest committed one, and under which leader epoch.

Blobs and manifests are content-addressed and may be written to several stores (replicas); which
manifest counts is a separate, small decision, made through a `CommitPointer`. Keeping the two apart
lets the pointer live in a coordination engine (etcd, fenced by the leader's lease) while the bytes
live in the stores, and lets a deposed leader write bytes that nobody will ever restore from.

This module only declares the contract shared by the stores' client and the coordination layer.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class CommitFenced(Exception):
    """A commit carried an epoch older than the pointer's: the writer is no longer the leader."""


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """One committed checkpoint: the run, its manifest's step, and the epoch of the leader that wrote it."""

    run_id: str
    step: int
    epoch: int


class CommitPointer(Protocol):
    """Where the latest committed checkpoint of each run is recorded.

    `commit` is atomic and fenced: it raises `CommitFenced` when `record.epoch` is older than the
    epoch the pointer currently holds for that run (a newer leader has committed or been elected),
    and it never moves a run's pointer to a smaller step under the same epoch.
    """

    async def latest(self, run_id: str) -> CommitRecord | None: ...

    async def commit(self, record: CommitRecord) -> None: ...
