"""What leaves the syncer core: fragment versions for learners, wake-ups for watch streams, events for observers.

Owns `Publisher` (what learners will hold of a new version, with the error-fed delta of a lossy
download codec; each version's exact float32 encoding, one encode shared by concurrent watchers;
the cached delta for a learner one version behind), `Downloads` (which owned version a watcher is
sent, as a delta or exact values, and whether it may leave yet: --commit-before-broadcast holds a
version until a committed checkpoint has it), `Watchers` (the change counter and the waiters every
watch stream waits on) and `Observers` (the passive listeners: metrics, history).
Must not: decide what a version holds; the core calls `next_published` under the fragment's lock.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.wire import codec as codec_lib
from . import slots as slots_lib
from . import state as state_lib
from . import versions as versions_lib


class Publisher:
    """Encodings of the published fragment values, in the run's download codec."""

    def __init__(self, *, download_codec: str, block_size: int, zstd_level: int) -> None:
        self.download_codec = download_codec
        # A lossy download codec sends each new version as a delta (error-fed, see FragmentSlot).
        self.delta_downloads = download_codec != "fp32"
        self._block_size = block_size
        self._zstd_level = zstd_level

    def settings(self) -> dict:
        """What decides the published values (the ledger records it: `ddiloco audit replay`)."""
        return {"codec": self.download_codec, "block_size": self._block_size, "zstd_level": self._zstd_level}

    def error_fed_delta(self, published: np.ndarray, new_params: np.ndarray,
                        ) -> tuple[np.ndarray, codec_lib.EncodedPayload]:
        """Encodes new_params - published in the download codec; returns what learners will hold
        after applying it (computed exactly as they compute it) and the encoding."""
        # One fragment-sized temporary at a time (the merge's peak): the difference, dropped once
        # encoded, then the decoded step, which becomes the new values in place (apply_delta's
        # out=: the same bits as the learners' allocating form).
        difference = fragments_lib.version_step(published, new_params)
        encoded = codec_lib.encode(
            difference, self.download_codec, block_size=self._block_size, zstd_level=self._zstd_level,
            min_zstd_ratio=codec_lib.FANOUT_MIN_ZSTD_RATIO,  # encoded once, sent to every learner
        )
        del difference
        step = versions_lib.decode_step(encoded)  # fresh and writable (codec.decode)
        return fragments_lib.apply_delta(published, step, out=step), encoded

    async def next_published(self, slot: slots_lib.FragmentSlot, new_params: np.ndarray) -> np.ndarray:
        """What learners will hold of the slot's next version (`new_params` itself when downloads
        are lossless); caches that version's delta on the slot. Call under the slot's lock."""
        if not self.delta_downloads:
            return new_params
        published, delta_encoded = await asyncio.to_thread(self.error_fed_delta, slot.published, new_params)
        slot.delta_encoded = (slot.version + 1, delta_encoded)
        return published

    @staticmethod
    def delta_payload(slot: slots_lib.FragmentSlot, from_version: int,
                      ) -> tuple[int, codec_lib.EncodedPayload] | None:
        """The current version as a delta from `from_version`, if one is cached for exactly that step."""
        cached = slot.delta_encoded
        if cached is None or cached[0] != slot.version or from_version != slot.version - 1:
            return None
        return cached

    def _exact_encoding(self, published: np.ndarray) -> codec_lib.EncodedPayload:
        """`published` encoded as exact float32. Uncompressed, those bytes are the values'
        own: the payload is then a read-only view of `published` (never written again: the outer
        step's pool reuses only arrays nobody references, and the view does), not a second copy
        of the fragment held for as long as the version is current."""
        encoded = codec_lib.encode(published, "fp32", zstd_level=self._zstd_level,
                                   min_zstd_ratio=codec_lib.FANOUT_MIN_ZSTD_RATIO)
        view = memoryview(published).cast("B").toreadonly()
        if encoded.compression == "none" and encoded.payload == view:
            return dataclasses.replace(encoded, payload=view)
        view.release()
        return encoded

    async def encoded_payload(self, slot: slots_lib.FragmentSlot) -> tuple[int, codec_lib.EncodedPayload]:
        """The current published values of a fragment as exact float32 (cached per version).

        Concurrent callers share one encode: at start (and after a restore) every watcher asks
        for the same uncached version at once, and one encode and one copy each per watcher made
        the syncer's peak memory grow with the number of learners."""
        cached = slot.encoded  # one read: a weakly held encoding (slots.FragmentSlot.encoded) may go
        if cached is None:
            version = slot.version
            if slot.encoding is None or slot.encoding[0] != version:
                slot.encoding = (version, asyncio.ensure_future(asyncio.to_thread(
                    self._exact_encoding, slot.published)))
            pending = slot.encoding[1]
            try:
                encoded = await asyncio.shield(pending)  # a watcher that goes away leaves it to the others
            finally:
                if slot.encoding is not None and slot.encoding[1] is pending and pending.done():
                    slot.encoding = None
            if slot.version == version:
                slot.encoded = encoded
            return version, encoded
        return slot.version, cached


class Downloads:
    """What a watch stream sends of the fragments this syncer owns (`slots.owned_slots`), in
    `publisher`'s encodings; `watchers` wake when a held-back version may leave."""

    def __init__(self, *, publisher: Publisher, slots: slots_lib.Slots, watchers: Watchers) -> None:
        self._publisher = publisher
        self._slots = slots
        self._owned_slots = slots.owned_slots
        self._watchers = watchers
        self.commit_before_broadcast = False  # set by __main__ (--commit-before-broadcast): see sendable

    def sendable(self, slot: slots_lib.FragmentSlot) -> bool:
        """Whether the slot's current version may leave the syncer: always, except with
        --commit-before-broadcast before a committed checkpoint holds it (commit_gate.py)."""
        return not self.commit_before_broadcast or slot.version <= slot.committed_version

    def mark_committed(self, snapshot: state_lib.SyncerSnapshot) -> None:
        """A checkpoint of `snapshot` is committed: its versions may be sent; wakes the watchers."""
        by_id = {f.fragment_id: f.version for f in snapshot.fragments}
        for slot in self._owned_slots:
            slot.committed_version = max(slot.committed_version, by_id.get(slot.fragment.fragment_id, 0))
        if self.commit_before_broadcast:
            self._watchers.notify()

    def owned_fragment_ids(self) -> list[int]:
        """The fragments this syncer (shard) owns, in order: those it streams and calls rounds of."""
        return [s.fragment.fragment_id for s in self._owned_slots]

    def published_sha256(self) -> dict[int, str]:
        """What learners hold of each owned fragment's current version, by digest."""
        return {s.fragment.fragment_id: s.published_sha256 for s in self._owned_slots}

    async def download(self, fragment_id: int, held_version: int, *,
                       accept_delta: bool) -> tuple[int, codec_lib.EncodedPayload, bool] | None:
        """(version, payload, is_delta) of an owned fragment for a watcher holding `held_version`
        (-1: none), None when it holds the current one. A watcher holding the previous version that
        accepts deltas gets the (smaller) delta when the download codec is lossy; anyone else gets
        the exact float32 values."""
        slot = self._slots[fragment_id]
        if slot.version <= held_version or not self.sendable(slot):
            return None
        delta = self._publisher.delta_payload(slot, held_version) if accept_delta else None
        if delta is not None:
            return (*delta, True)
        return (*(await self._publisher.encoded_payload(slot)), False)


class Watchers:
    """The change counter watch streams poll, and the waiters that wake when it moves.

    One future per waiting watch stream, not an asyncio.Condition: Condition.wait re-acquires its
    lock when the wait ends, and a WatchFragments call cancelled inside asyncio.wait_for around it
    could leave `async with` releasing a lock it did not hold (CPython 3.11: "RuntimeError: Lock is
    not acquired", a servicer error instead of the call's end). A future holds no lock: a cancelled
    waiter just leaves. Each future belongs to the loop of its waiter, and leaves with it."""

    def __init__(self) -> None:
        self.counter = 0
        self._waiters: set[asyncio.Future] = set()

    def notify(self) -> None:
        self.counter += 1
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait_for_change(self, seen_counter: int, timeout_s: float) -> int:
        """Waits until the state changed after `seen_counter` (or timeout); returns the counter."""
        if self.counter == seen_counter:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.add(waiter)
            try:
                await asyncio.wait_for(waiter, timeout_s)
            except asyncio.TimeoutError:
                pass
            finally:
                self._waiters.discard(waiter)
        return self.counter


class Observers(list):
    """Passive observers (metrics, history): objects with optional methods merged(record),
    upload_accepted(header), rejoined(learner_id, gap_s) and fragment_bytes(direction, codec,
    wire_bytes). They must not mutate state."""

    def emit(self, event: str, *args) -> None:
        for observer in self:
            handler = getattr(observer, event, None)
            if handler is not None:
                handler(*args)
