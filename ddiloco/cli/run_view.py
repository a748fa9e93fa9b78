"""Reading one run from a syncer split into fragment shards, for `ddiloco status`, `ddiloco up`
and the dashboard.

Owns: following a TrainingState's shard map (TrainingState.shards) to read every other shard's
state, and `RunView`: the run's one state (ddiloco.training_state.merge_shard_states) plus a line
per shard (its addresses, fragments, and whether it answered). A shard that does not answer is
shown as down; the run view is made of the shards that did. An unsharded syncer's state is passed
through untouched, so everything shows exactly what it showed before shards existed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import grpc

from ddiloco import training_state as status_derived
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc


@dataclasses.dataclass
class ShardView:
    """One shard as the tools show it: `state` is None when no address of it answered (`error`)."""

    index: int
    addresses: list[str]
    fragment_ids: list[int]
    state: syncer_pb2.TrainingState | None = None
    address: str = ""  # the address that answered
    error: str = ""

    @property
    def up(self) -> bool:
        return self.state is not None

    def as_dict(self) -> dict:
        """`ddiloco status --json`'s per-shard entry."""
        out = {"index": self.index, "addresses": self.addresses, "fragment_ids": self.fragment_ids, "up": self.up}
        if self.state is not None:
            s = self.state
            out.update(address=self.address, syncer_instance=s.syncer_instance, epoch=s.epoch,
                       outer_steps=s.outer_steps, last_checkpoint_outer_step=s.last_checkpoint_outer_step,
                       restored_from_checkpoint=s.restored_from_checkpoint)
        else:
            out["error"] = self.error
        return out


@dataclasses.dataclass
class RunView:
    """The run's one state, and its shards (empty for an unsharded syncer)."""

    state: syncer_pb2.TrainingState
    shards: list[ShardView] = dataclasses.field(default_factory=list)

    @property
    def sharded(self) -> bool:
        return bool(self.shards)


StateFetcher = Callable[[str], syncer_pb2.TrainingState]  # address -> state; raises grpc.RpcError


def assemble(first: syncer_pb2.TrainingState, first_address: str, fetch: StateFetcher) -> RunView:
    """The run view given the state `first` read from `first_address`: unchanged when it has no
    shard map; otherwise every other shard is read with `fetch` (each of its addresses in turn,
    keeping the answer with the highest leader epoch, so a shard's standby does not stand in for
    its leader) and the answers are merged."""
    if not first.shards:
        return RunView(first)
    views = []
    for shard in first.shards:
        view = ShardView(index=shard.index, addresses=list(shard.addresses), fragment_ids=list(shard.fragment_ids))
        if shard.index == first.shard_index:
            view.state, view.address = first, first_address
        else:
            errors = []
            for address in shard.addresses:
                try:
                    state = fetch(address)
                except grpc.RpcError as exc:
                    errors.append(f"{address}: {exc.code().name}")
                    continue
                if view.state is None or state.epoch > view.state.epoch:
                    view.state, view.address = state, address
            view.error = "; ".join(errors) if view.state is None else ""
        views.append(view)
    merged = status_derived.merge_shard_states([v.state for v in views if v.state is not None])
    return RunView(merged, views)


class RunReader:
    """Reads a run's state through `target` (any shard, or an unsharded syncer) with one channel per
    address it has needed. `read()` raises grpc.RpcError only when `target` itself does not answer."""

    def __init__(self, target: str, security=None, *, timeout_s: float = 5.0, recent_merges: int = 8) -> None:
        self.target = target
        self.security = security
        self.timeout_s = timeout_s
        self.recent_merges = recent_merges
        self._channels: dict[str, grpc.Channel] = {}

    def stub(self, address: str) -> syncer_pb2_grpc.SyncerStub:
        if address not in self._channels:
            self._channels[address] = (channel_lib.sync_channel(address) if self.security is None
                                       else channel_lib.sync_channel(address, self.security))
        return syncer_pb2_grpc.SyncerStub(self._channels[address])

    def fetch(self, address: str) -> syncer_pb2.TrainingState:
        request = syncer_pb2.GetTrainingStateRequest(recent_merges=self.recent_merges)
        return self.stub(address).GetTrainingState(request, timeout=self.timeout_s).state

    def read(self) -> RunView:
        """The run view through `target`; a target listing several syncer instances of one run
        (failover: `ddiloco up --syncer-replicas`) is read from the one that leads (the highest
        epoch that answers); grpc.RpcError when none answers."""
        addresses = [a.strip() for a in self.target.split(",") if a.strip()]
        if len(addresses) == 1:
            return self.complete(self.fetch(self.target))
        best, best_address, error = None, "", None
        for address in addresses:
            try:
                state = self.fetch(address)
            except grpc.RpcError as exc:
                error = exc
                continue
            if best is None or state.epoch > best.epoch:
                best, best_address = state, address
        if best is None:
            raise error
        return assemble(best, best_address, self.fetch)

    def complete(self, first: syncer_pb2.TrainingState) -> RunView:
        """The run view around a state already read from `target` (a WatchTrainingState snapshot)."""
        return assemble(first, self.target, self.fetch)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
