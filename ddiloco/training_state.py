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

Fragment shards: `merge_shard_states` makes one run's TrainingState out of the states of the
syncer shards (each covers only its own fragments); see the notes above it for what adds up.
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


# ------------------------------------------------------------------ fragment shards: one run view
#
# A sharded syncer (TrainingState.shards non-empty) answers with the state of its own fragments
# only; `merge_shard_states` makes the run's one state out of the shards' (ddiloco status, the
# dashboard and `ddiloco up` show it). Which figures add up over shards follows from who reports
# them to whom: uploads (and their bytes, rejections, merges, tokens merged, checkpointed outer
# steps) go to a fragment's owner only, so they are summed; progress (local step, tokens, loss,
# step time) and joins go to every shard, so each shard holds the same figure and the freshest
# one is kept (summing would count a learner's work N times).


def _sum_maps(maps) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in maps:
        for key, value in m.items():
            out[key] = out.get(key, 0) + value
    return out


def merge_members(records: list[syncer_pb2.MemberState]) -> syncer_pb2.MemberState:
    """One learner's MemberState over the shards that know it (in shard-index order)."""
    freshest = max(records, key=lambda r: r.last_seen_unix_s)  # progress: the latest report wins
    out = syncer_pb2.MemberState()
    out.CopyFrom(freshest)
    out.uploads_accepted = sum(r.uploads_accepted for r in records)
    out.uploads_rejected = sum(r.uploads_rejected for r in records)
    out.bytes_in = sum(r.bytes_in for r in records)
    out.bytes_out = sum(r.bytes_out for r in records)
    out.joins = max(r.joins for r in records)  # a learner joins every shard once per life
    out.rejections.clear()
    out.rejections.update(_sum_maps(r.rejections for r in records))
    out.quarantined = any(r.quarantined for r in records)  # any shard refusing it is a quarantine
    out.quarantined_until_unix_s = max(r.quarantined_until_unix_s for r in records)
    flags = 0
    for r in records:
        flags |= r.flags
    out.flags = flags
    weighted = [(r.direction_agreement, r.uploads_accepted) for r in records if r.uploads_accepted]
    total = sum(w for _, w in weighted)
    out.direction_agreement = sum(a * w for a, w in weighted) / total if total else freshest.direction_agreement
    assigner = next((r for r in records if r.num_data_shards), None)  # shard 0 assigns data shards
    if assigner is not None:
        out.num_data_shards, out.data_shard = assigner.num_data_shards, assigner.data_shard
        out.data_shard_assigned = assigner.data_shard_assigned
    return out


def _merge_influence(rows: list[syncer_pb2.LearnerInfluence]) -> syncer_pb2.LearnerInfluence:
    merges = sum(r.merges for r in rows)
    return syncer_pb2.LearnerInfluence(
        learner_id=rows[0].learner_id, merges=merges,
        mean_share=sum(r.mean_share * r.merges for r in rows) / merges if merges else 0.0,
        max_share=max(r.max_share for r in rows), share_capped=sum(r.share_capped for r in rows),
        clipped=sum(r.clipped for r in rows), window_merges=sum(r.window_merges for r in rows),
    )


def _group(items, key) -> dict:
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def merge_shard_states(states: list[syncer_pb2.TrainingState]) -> syncer_pb2.TrainingState:
    """The run's one TrainingState from the states of the shards that answered (any order; at least
    one). A single unsharded state is returned as it is.

    Summed: outer_steps, tokens_merged, bytes_in/out, uploads, auth_failures, quarantines,
    direction_judgments, last_checkpoint_outer_step (the outer steps checkpointed over all shards).
    Concatenated: fragments (by id), recent_merges (by time, as many as the longest shard list),
    influence (per learner: merges and counts summed, shares weighted). The same on every shard:
    tokens_processed and token_budget (the largest), config, run_id, build. Evals: the evaluator
    reports each evaluation to every shard; repeats are dropped. Per-shard figures that do not add
    up (grace window and smoothed times: their mean; syncer_instance: the shards' instances joined
    by '+', so any shard's restart changes it; epoch and leader: the lowest shard's;
    last_checkpoint_unix_s: the oldest, as the run is checkpointed only up to it;
    restored_from_checkpoint: any) are shown per shard by the tools."""
    if not states:
        raise ValueError("no shard state to merge")
    states = sorted(states, key=lambda s: s.shard_index)
    if len(states) == 1 and not states[0].shards:
        return states[0]
    first = states[0]
    out = syncer_pb2.TrainingState(
        run_id=first.run_id, syncer_instance="+".join(s.syncer_instance for s in states),
        started_at_unix_s=min(s.started_at_unix_s for s in states), now_unix_s=max(s.now_unix_s for s in states),
        outer_steps=sum(s.outer_steps for s in states), tokens_merged=sum(s.tokens_merged for s in states),
        bytes_in=sum(s.bytes_in for s in states), bytes_out=sum(s.bytes_out for s in states),
        last_checkpoint_outer_step=sum(s.last_checkpoint_outer_step for s in states),
        last_checkpoint_unix_s=min(s.last_checkpoint_unix_s for s in states),
        restored_from_checkpoint=any(s.restored_from_checkpoint for s in states),
        config=first.config, quarantines=sum(s.quarantines for s in states),
        tokens_processed=max(s.tokens_processed for s in states), token_budget=max(s.token_budget for s in states),
        epoch=first.epoch, leader_address=first.leader_address,
        build_version=first.build_version, build_commit=first.build_commit,
        shards=first.shards, shard_index=first.shard_index,
    )
    for name in ("grace_window_s", "step_time_s", "quorum_time_s", "sync_time_s"):
        setattr(out, name, sum(getattr(s, name) for s in states) / len(states))
    for name in ("uploads", "auth_failures", "direction_judgments"):
        getattr(out, name).update(_sum_maps(getattr(s, name) for s in states))
    out.fragments.extend(sorted((f for s in states for f in s.fragments), key=lambda f: f.fragment_id))
    keep = max(len(s.recent_merges) for s in states)
    merges = sorted((r for s in states for r in s.recent_merges), key=lambda r: r.merged_at_unix_s)
    out.recent_merges.extend(merges[len(merges) - keep:])
    members = _group((m for s in states for m in s.members), key=lambda m: m.learner_id)
    out.members.extend(merge_members(records) for records in members.values())
    influence = _group((i for s in states for i in s.influence), key=lambda i: i.learner_id)
    out.influence.extend(_merge_influence(influence[k]) for k in sorted(influence))
    seen: set = set()
    for e in sorted((e for s in states for e in s.evals), key=lambda e: e.at_unix_s):
        key = (e.heldout_loss, e.tokens_merged, e.outer_steps)
        if key not in seen:
            seen.add(key)
            out.evals.append(e)
    return out
