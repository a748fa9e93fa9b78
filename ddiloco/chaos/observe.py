"""Watching a chaos run as it goes: `HistoryTail` counts merges in the syncer's history file as it
grows, `Poller` polls the syncer's training state and keeps each learner life's progress."""

from __future__ import annotations

import json
import pathlib
import threading
import time

import grpc

from ddiloco.chaos.report import InjectedFault
from ddiloco.cli import run_view
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc


class HistoryTail:
    """Counts merges in the syncer's history file as it grows (for `at_merge` and warm-up)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.merges = 0
        self.learners_merged: set[str] = set()
        self.last_merge_with: dict[str, float] = {}  # learner -> unix s of its latest merge
        self.last_merge = 0.0
        self.last_checkpoint = 0.0

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            merged, checkpoint = b'"event":"merged"' in line, b'"event":"checkpoint"' in line
            if not (merged or checkpoint):
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if checkpoint:
                self.last_checkpoint = rec["t"]
                continue
            self.merges += 1
            self.last_merge = rec["t"]
            for c in rec["contributors"]:
                self.learners_merged.add(c[0])
                self.last_merge_with[c[0]] = rec["t"]

    def recovered(self, fault: InjectedFault) -> bool:
        """The faulted component made progress after the fault healed (as `report.mark_recoveries` reads it)."""
        if fault.healed_at is None:
            return False
        if fault.target.startswith("learner-"):
            return self.last_merge_with.get(fault.target, 0.0) > fault.healed_at
        if fault.target.startswith("syncer"):
            return self.last_merge > fault.healed_at
        return self.last_checkpoint > fault.healed_at


_STATUS = {1: "ACTIVE", 2: "SILENT", 3: "LEFT"}


class Poller(threading.Thread):
    """Polls the syncer's training state (in its own thread: a stopped syncer must not stall the
    scheduler) and keeps, per learner life, the most steps and tokens it reported. A syncer split
    into fragment shards is read as one run (every shard, merged: ddiloco.cli.run_view)."""

    def __init__(self, address: str, interval_s: float = 0.5) -> None:
        super().__init__(name="chaos-poller", daemon=True)
        self._channel = channel_lib.sync_channel(address)
        self._stub = syncer_pb2_grpc.SyncerStub(self._channel)
        self._shards = run_view.RunReader(address, recent_merges=0)  # the other shards' channels, when sharded
        self._interval_s = interval_s
        self._halt = threading.Event()
        self.lock = threading.Lock()
        self.lives: dict[tuple[str, int], dict] = {}  # (learner, incarnation) -> {steps, tokens}
        self.samples: list[tuple[float, dict[str, str]]] = []  # (unix s, {learner: ACTIVE|SILENT|LEFT})
        self.quarantined: dict[str, float] = {}  # learner -> unix s it was first seen quarantined (I7)
        self.errors = 0

    def state(self, timeout_s: float = 3.0):
        first = self._stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(recent_merges=0), timeout=timeout_s).state
        self._shards.timeout_s = timeout_s
        return self._shards.complete(first).state  # unsharded: `first` itself

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                st = self.state(2.0)
                with self.lock:
                    self.samples.append((time.time(), {m.learner_id: _STATUS.get(m.status, "?") for m in st.members}))
                    for m in st.members:
                        if m.quarantined:
                            self.quarantined.setdefault(m.learner_id, time.time())
                        life = self.lives.setdefault((m.learner_id, m.incarnation), {"steps": 0, "tokens": 0})
                        life["steps"] = max(life["steps"], m.local_step)
                        life["tokens"] = max(life["tokens"], m.tokens_total)
            except grpc.RpcError:
                self.errors += 1
            self._halt.wait(self._interval_s)

    def record_summary(self, summary: dict) -> None:
        with self.lock:
            life = self.lives.setdefault((summary["learner_id"], summary["incarnation"]), {"steps": 0, "tokens": 0})
            life["steps"] = max(life["steps"], summary["steps"])
            life["tokens"] = max(life["tokens"], summary["tokens"])

    def steps_done(self, learner: str) -> int:
        with self.lock:
            return sum(v["steps"] for (lid, _), v in self.lives.items() if lid == learner)

    def tokens_processed(self) -> int:
        with self.lock:
            return sum(v["tokens"] for v in self.lives.values())

    def stop(self) -> None:
        self._halt.set()
        self.join(5.0)
        self._channel.close()
        self._shards.close()
