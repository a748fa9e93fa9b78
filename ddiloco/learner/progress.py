"""How often a learner reports its progress to a syncer (the rule shared by the learner's sync
client and the benchmark's replay learners, so that a benchmark loads a syncer as real learners do)."""

from __future__ import annotations

MIN_PROGRESS_INTERVAL_S = 0.02  # the fastest a learner reports progress


def progress_interval_s(step_time_s: float, sync_period_steps: int, served_fragments: int,
                        longest_s: float) -> float:
    """How often a learner reports progress to a syncer serving `served_fragments` fragments: the
    syncer's round schedule advances with the reports, so at least twice per round slot when steps
    are fast, never more often than every MIN_PROGRESS_INTERVAL_S, and at most every `longest_s`.
    A fragment shard serving F of the P fragments opens a round every H / F steps, not H / P:
    reporting to it at the unsharded rate would cost each shard as much progress work as one syncer
    serving all P (at fast steps, as much CPU as its merges)."""
    slot_s = step_time_s * sync_period_steps / max(1, served_fragments)
    return min(longest_s, max(MIN_PROGRESS_INTERVAL_S, 0.5 * slot_s))
