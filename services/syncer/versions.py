"""The versions of one fragment that learners may still base contributions on (`VersionHistory`).

Owns what a stale contribution is re-anchored from (ddiloco.algo.reanchor): with lossless
downloads, each kept version's published values (float32 arrays, as learners hold them); with a
lossy download codec, only the current version's values plus the delta encodings learners applied
to reach it (the error-fed steps the Publisher made, ~0.5 bytes per value each with int4). An
earlier version is then an `EarlierVersion`: the steps from it to the current version, which
re-anchoring adds up (current - base = the sum of the steps learners added). Four float32 copies
of the fragment (4 x 4 bytes per owned parameter at the default --max-staleness-versions) became
four int4 encodings (4 x ~0.5 bytes).
Must not: decide which versions to keep (the caller passes keep_versions) or encode.

The sum of the decoded steps differs from the float32 difference of the two versions only by the
rounding of each float32 addition learners made (at most half an ulp of the values per version):
bench/results/perf-memory-s35.md measures it against the quantization error of the steps.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Iterator, Mapping

import numpy as np

from ddiloco.wire import codec as codec_lib


def decode_step(encoded: codec_lib.EncodedPayload) -> np.ndarray:
    """The float32 values of a delta encoding (what learners add to the version they hold): a
    fresh, writable array (codec.decode)."""
    return codec_lib.decode(
        encoded.payload, codec=encoded.codec, numel=encoded.numel, raw_size_bytes=encoded.raw_size_bytes,
        checksum=encoded.checksum, block_size=encoded.block_size,
    )


class _Step:
    """The delta encoding from version `version - 1` to `version`, and (weakly) the values it
    produced: the chain's walk stops at the values re-anchoring is asked to reach."""

    __slots__ = ("version", "encoded", "values_ref", "next")

    def __init__(self, version: int, encoded: codec_lib.EncodedPayload, values: np.ndarray) -> None:
        self.version = version
        self.encoded = encoded
        self.values_ref = weakref.ref(values)
        self.next: _Step | None = None


class EarlierVersion:
    """An earlier version of a fragment, as the steps from it onwards (a contribution pinned to it
    keeps those steps, and the later ones, alive: ~0.5 bytes per value each with int4)."""

    dtype = np.dtype(np.float32)

    def __init__(self, version: int, first_step: _Step) -> None:
        self.version = version
        self._first = first_step
        self.shape = (first_step.encoded.numel,)

    def difference_to(self, current: np.ndarray) -> np.ndarray:
        """current - this version, as the sum of the steps learners added (a new float32 array).
        ValueError when `current` is not a version the steps reach (never: the slot's lock)."""
        total = None
        step = self._first
        while step is not None:
            values = decode_step(step.encoded)
            if total is None:
                total = values
            else:
                np.add(total, values, out=total)
                del values
            if step.values_ref() is current:
                return total
            step = step.next
        raise ValueError(f"version {self.version}'s steps do not reach the current values")


class VersionHistory(Mapping):
    """version -> the values (or `EarlierVersion`) a contribution based on it is re-anchored from;
    the current version maps to the published array itself (re-anchoring then returns the delta
    untouched: reanchor's `base is current`)."""

    def __init__(self, version: int | None = None, values: np.ndarray | None = None) -> None:
        self._arrays: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._steps: collections.OrderedDict[int, _Step] = collections.OrderedDict()  # by the version reached
        self._current: tuple[int, np.ndarray] | None = None
        if version is not None and values is not None:
            self._arrays[version] = values
            self._current = (version, values)

    def advance(self, version: int, values: np.ndarray, keep_versions: int,
                step: codec_lib.EncodedPayload | None) -> None:
        """`values` (what learners hold) are version `version`, reached from the current one by
        the delta encoding `step` (None: learners downloaded the values whole). At most
        `keep_versions` versions are kept, the current one included."""
        previous = self._current
        self._current = (version, values)
        if step is not None and previous is not None and previous[0] == version - 1:
            new = _Step(version, step, values)
            last = self._steps.get(previous[0])
            if last is not None:
                last.next = new
            self._steps[version] = new
            # Earlier versions need no arrays now: the steps lead from them to this one.
            self._arrays = collections.OrderedDict({version: values})
        else:  # lossless downloads (or no step to this version): whole arrays, no chain
            self._steps.clear()
            self._arrays[version] = values
        while len(self) > keep_versions:
            oldest = next(iter(self))
            self._arrays.pop(oldest, None)
            self._steps.pop(oldest + 1, None)

    def _versions(self) -> list[int]:
        if self._current is None:
            return []
        chained = [v - 1 for v in self._steps]  # each step's starting version
        return sorted(set(chained) | set(self._arrays))

    def __iter__(self) -> Iterator[int]:
        return iter(self._versions())

    def __len__(self) -> int:
        return len(self._versions())

    def __contains__(self, version: object) -> bool:
        return version in self._arrays or (isinstance(version, int) and version + 1 in self._steps)

    def __getitem__(self, version: int):
        if version in self._arrays:
            return self._arrays[version]
        step = self._steps.get(version + 1) if isinstance(version, int) else None
        if step is None:
            raise KeyError(version)
        return EarlierVersion(version, step)
