"""Fragment shards: the shard map of a syncer split over several processes.

Owns: parsing and checking the shard map (`parse_shard_map`), `ShardLayout` (which shard owns
which fragment, with algo.fragments.shard_fragments: fragment f belongs to shard f mod N) and the
namespace a shard's checkpoints live under (`store_run_id`).
Must not: do I/O or talk to the network.

The map is written the way `--fragment-shards` takes it: one entry per shard, in shard-index
order, separated by commas; an entry is one address, or several failover addresses of the same
shard joined by `|` (e.g. "a:1|a2:1,b:1"). An empty map is an unsharded syncer (one process owns
every fragment, as before shards existed).
"""

from __future__ import annotations

import dataclasses

from ddiloco.algo import fragments as fragments_lib


def parse_shard_map(text: str) -> tuple[tuple[str, ...], ...]:
    """The shard map's entries (each a tuple of host:port addresses), in shard-index order; () for
    an empty map. ValueError on an empty entry or an address without a port."""
    if not text.strip():
        return ()
    shards = []
    for index, entry in enumerate(text.split(",")):
        addresses = tuple(a.strip() for a in entry.split("|") if a.strip())
        if not addresses:
            raise ValueError(f"shard {index} of the shard map {text!r} has no address: give one host:port per "
                             "shard, failover addresses of one shard joined by '|'")
        for address in addresses:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"shard {index} of the shard map has address {address!r}: must be host:port")
        shards.append(addresses)
    return tuple(shards)


def served_fragments(shards, shard_index: int, run_config) -> list[int]:
    """The fragment ids a syncer that answered a Join with `shards` (JoinResponse.shards: entries
    with `index` and `fragment_ids`) and `shard_index` serves: every fragment of `run_config`
    (`num_fragments`; None: none known yet) when the map is empty."""
    for shard in shards:
        if shard.index == shard_index:
            return list(shard.fragment_ids)
    return list(range(run_config.num_fragments if run_config is not None else 0))


def format_shard_map(shards) -> str:
    """The inverse of parse_shard_map (a learner's session target list uses commas instead of '|')."""
    return ",".join("|".join(addresses) for addresses in shards)


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Which syncer shard owns which fragment. `addresses` empty: unsharded (index 0 of 1, owns all)."""

    num_fragments: int
    index: int = 0
    addresses: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.num_fragments < 1:
            raise ValueError(f"num_fragments={self.num_fragments} must be >= 1")
        if not self.addresses:
            if self.index != 0:
                raise ValueError(f"shard index {self.index} without a shard map: an unsharded syncer is shard 0")
            return
        # shard_fragments checks the index and that every shard owns at least one fragment.
        fragments_lib.shard_fragments(self.num_fragments, self.count, self.index)

    @property
    def sharded(self) -> bool:
        return bool(self.addresses)

    @property
    def count(self) -> int:
        """N, the number of shards (1 when unsharded)."""
        return max(1, len(self.addresses))

    def fragments_of(self, shard_index: int) -> tuple[int, ...]:
        """The fragment ids shard `shard_index` owns."""
        return tuple(fragments_lib.shard_fragments(self.num_fragments, self.count, shard_index))

    @property
    def owned(self) -> tuple[int, ...]:
        """The fragment ids this shard owns (every one when unsharded)."""
        return self.fragments_of(self.index)

    def owner_of(self, fragment_id: int) -> int:
        """The index of the shard that owns a fragment."""
        return fragment_id % self.count

    def store_run_id(self, run_id: str) -> str:
        """The name this shard's checkpoints (and ledger, election) live under in the store: the run's
        own id when unsharded, else `<run_id>.shard-<I>-of-<N>`, so that each shard commits and
        restores its own, and a different layout finds nothing of another's."""
        return f"{run_id}.shard-{self.index}-of-{self.count}" if self.sharded else run_id

    def describe(self) -> str:
        return f"shard {self.index} of {self.count}" if self.sharded else "unsharded"
