"""What a learner does with a new global fragment: fold it in without losing un-merged work.

Owns: ``ON_ARRIVAL_RULES``, ``PendingContribution`` and ``fold_in``, the pure rule that turns
(local fragment, the global fragment the learner held, the new global fragment, whether the new
version holds the learner's latest contribution) into the new local fragment and counters.
Must not: do I/O or know about the network; callers pass flat float32 vectors.

A learner's progress on fragment p is ``held - local`` (what it has learned since the global
version it holds); a contribution uploads that progress as its pseudo-gradient and records it as
pending until the learner learns (from the syncer's MergeReceipt) whether a new global version
holds it. The rules:

* ``rebase`` (default): nothing is thrown away. If the new version ``new`` holds the pending
  contribution ``d`` (the decoded values the syncer merged), the learner keeps only the work it
  did after taking it: ``local' = local + (new - held) + d``, so its progress becomes
  ``new - local' = (held - local) - d``; the quantization error of ``d`` stays in the progress and
  goes out with the next contribution (error feedback for free). If it does not (the round closed
  without it, the upload was refused, the syncer restarted), ``local' = local + (new - held)``:
  the whole progress is kept for the next contribution, and so are the step/token counters.
* ``overwrite`` (the paper's rule, §1.2): ``local' = new``; counters reset. Work not in ``new``
  (a late or refused contribution, and the steps taken while the merge was in flight) is lost.
* ``mix``: ``local' = alpha * local + (1 - alpha) * new`` (Streaming DiLoCo's blend); counters
  reset.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ON_ARRIVAL_RULES = ("rebase", "overwrite", "mix")


@dataclasses.dataclass
class PendingContribution:
    """An uploaded contribution whose fate the learner does not know yet.

    Attributes:
        mark_step: the learner's local step when it was taken (UploadHeader.local_step).
        delta: the pseudo-gradient as uploaded (held - local at that step), float32.
        steps, tokens: the counters it carried.
        sent: the values the syncer decodes (``delta`` through the upload codec), once known;
            what the global model receives when it is merged.
        accepted: the syncer acknowledged it, at version ``accepted_version``: the version after
            that one holds it, unless its round was dropped.
    """

    mark_step: int
    delta: np.ndarray
    steps: int
    tokens: int
    sent: np.ndarray | None = None
    accepted: bool = False
    accepted_version: int = 0
    syncer_instance: str = ""

    def resolved_unmerged(self, version: int, syncer_instance: str, merged_through_step: int) -> bool:
        """True when a new global version shows this contribution will never be merged: it was
        accepted at an earlier version of the same syncer life and this later version does not hold
        it (its round was dropped), or the version is from another syncer life that does not hold it
        (the syncer restarted from a checkpoint taken before it was merged)."""
        if merged_through_step >= self.mark_step:
            return False
        if syncer_instance != self.syncer_instance:
            return True
        return self.accepted and version > self.accepted_version

    @property
    def merged_values(self) -> np.ndarray:
        return self.delta if self.sent is None else self.sent


@dataclasses.dataclass(frozen=True)
class Folded:
    """The result of folding in a new global version.

    Attributes:
        local: the new local fragment (float32).
        merged: the pending contribution the new version holds, if any (its counters are done).
        reset_counters: the rule resets the fragment's step/token counters (overwrite, mix).
    """

    local: np.ndarray
    merged: PendingContribution | None
    reset_counters: bool


def fold_in(
    *,
    rule: str,
    local: np.ndarray,
    held: np.ndarray,
    new: np.ndarray,
    pending: PendingContribution | None,
    merged_through_step: int,
    alpha: float = 0.0,
) -> Folded:
    """Folds a new global version of one fragment into the learner's local fragment.

    Args:
        rule: one of ON_ARRIVAL_RULES.
        local: the learner's current local fragment.
        held: the global fragment it held until now (what its progress is measured against).
        new: the new global fragment.
        pending: the learner's uploaded, unresolved contribution of this fragment, if any.
        merged_through_step: the MergeReceipt's mark: the highest local step of this learner's
            contributions that ``new`` holds (0: none).
        alpha: the ``mix`` rule's weight of the local fragment, in [0, 1).

    Returns:
        The new local fragment and what it resolved.

    Raises:
        ValueError: on an unknown rule, mismatched sizes, or alpha outside [0, 1).
    """
    if rule not in ON_ARRIVAL_RULES:
        raise ValueError(f"rule={rule!r} is not one of {ON_ARRIVAL_RULES}")
    if not local.shape == held.shape == new.shape:
        raise ValueError(f"fragment shapes differ: local {local.shape}, held {held.shape}, new {new.shape}")
    # The receipt alone decides: an upload whose acknowledgement was lost may still have been merged.
    merged = pending if pending is not None and merged_through_step >= pending.mark_step else None
    if rule == "overwrite":
        return Folded(local=np.array(new, dtype=np.float32, copy=True), merged=merged, reset_counters=True)
    if rule == "mix":
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha={alpha} is invalid: must be in [0, 1)")
        mixed = (np.float32(alpha) * local + np.float32(1.0 - alpha) * new).astype(np.float32)
        return Folded(local=mixed, merged=merged, reset_counters=True)
    shifted = (local + (new - held)).astype(np.float32)
    if merged is not None:
        shifted += merged.merged_values
    return Folded(local=shifted, merged=merged, reset_counters=False)
