"""Library: quantities derived from a TrainingState, shared by `ddiloco status`, `ddiloco up`'s summary, the
dashboard and the syncer's Prometheus metrics (one definition, so they all agree).

Work merged: the share of the learners' work that reached the global model,
tokens_merged / (P x tokens processed). Each inner step trains all P fragments, and a fragment's
contribution carries that fragment's tokens, so a run in which every contribution is merged has
tokens_merged = P x tokens processed (100 %). This is not the paper's goodput (a share of wall
time); it counts tokens. Tokens processed come from TrainingState.tokens_processed (every life of
every learner, kept across syncer restarts); a syncer that predates the field reports 0 there, and
the sum of the current members' tokens_total (this life only: it undercounts restarted learners)
stands in for it.

Contributors per merge relative to the learners the round waited for
(MergeRecord.expected_contributors): for the recent merges, the mean number of contributors, the
mean expected, and the mean of contributors / expected per merge (1.0: every merge held every live
learner it waited for). Merges from syncers that predate the field (expected 0) count in the
contributors' mean only.
"""

from __future__ import annotations

from collections.abc import Iterable

from ddiloco.v1 import syncer_pb2


def num_fragments(state: syncer_pb2.TrainingState) -> int:
    """P: the run's configured fragment count (or the fragments listed, or 1)."""
    return state.config.num_fragments or len(state.fragments) or 1


def tokens_processed(state: syncer_pb2.TrainingState) -> tuple[int, str]:
    """(tokens processed, source): "syncer" for TrainingState.tokens_processed, or "members" (the
    sum of the members' tokens_total) for a syncer that does not report the field."""
    if state.tokens_processed:
        return state.tokens_processed, "syncer"
    return sum(m.tokens_total for m in state.members), "members"


def work_merged(tokens_merged: int, fragments: int, processed: int) -> float | None:
    """tokens_merged / (fragments x processed); None before any token is processed."""
    if processed <= 0:
        return None
    return tokens_merged / (max(1, fragments) * processed)


def merge_participation(merges: Iterable[syncer_pb2.MergeRecord]) -> dict:
    """Contributors per merge against the learners each round waited for, over `merges`.

    Keys: merges (count), merges_with_expected (those reporting expected_contributors), contributors_mean, expected_contributors_mean and
    contributors_per_expected (mean over merges of contributors / expected), and complete (merges
    holding at least every learner expected). Means are None when no merge (or, for the expected
    ones, no merge reporting expected_contributors) is given.
    """
    merges = list(merges)
    held = [len(r.contributors) for r in merges]
    known = [(len(r.contributors), r.expected_contributors) for r in merges if r.expected_contributors > 0]
    return {
        "merges": len(merges),
        "contributors_mean": sum(held) / len(held) if held else None,
        "expected_contributors_mean": sum(e for _, e in known) / len(known) if known else None,
        "contributors_per_expected": sum(c / e for c, e in known) / len(known) if known else None,
        "merges_with_expected": len(known),
        "complete": sum(1 for c, e in known if c >= e),
    }


def derived(state: syncer_pb2.TrainingState, processed: int | None = None, source: str | None = None) -> dict:
    """Everything above as one JSON-ready dict. `processed`/`source` override the tokens processed
    (the dashboard's fallback sums every life it has seen rather than the current members)."""
    if processed is None:
        processed, source = tokens_processed(state)
    fragments = num_fragments(state)
    return {
        "tokens_processed": processed,
        "tokens_processed_source": source,
        "num_fragments": fragments,
        "work_merged": work_merged(state.tokens_merged, fragments, processed),
        "merge_participation": merge_participation(state.recent_merges),
    }


def fmt_share(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f} %"


def fmt_participation(p: dict) -> str:
    """'3.9 of 4.0 expected (98 %, 7/8 complete)', or a shorter text when less is known."""
    if p["contributors_mean"] is None:
        return "-"
    if p["expected_contributors_mean"] is None:
        return f"{p['contributors_mean']:.1f} (expected unknown)"
    return (f"{p['contributors_mean']:.1f} of {p['expected_contributors_mean']:.1f} expected "
            f"({100 * p['contributors_per_expected']:.0f} %, {p['complete']}/{p['merges_with_expected']} complete)")
