"""The invariant checkers I1-I5, over the recorded histories (ddiloco/history.py) and final state.

Pure functions over plain data (lists of history records, summaries, decoded checkpoints), so each
can be unit-tested with a hand-written history.

Vocabulary. A syncer *life* is one `instance` (one process start). An upload's key is
(instance, learner, incarnation, fragment, base_version): the syncer's idempotency key plus its
life, because versions restart from a checkpoint after a syncer restart and the same numbers then
name different contributions. A merge *survives* unless the next life restored that fragment at
an older version (the merge was applied, but lost with the crashed life before a checkpoint
covered it): such a merge is *rolled back*.

I1  Every upload a learner saw acknowledged (ACCEPTED or DUPLICATE) is in exactly one merge.
    Acknowledged uploads that are not applied are classified, never hidden:
      * lost_on_syncer_crash: accepted into an open round of a syncer life that then crashed
        (the round's accumulator is in memory; by design the syncer acknowledges on acceptance,
        and a crash drops the open rounds);
      * rolled_back: merged, but the merge was rolled back (see above);
      * pending: still in an open round when the syncer shut down gracefully (below quorum);
      * lost: none of these: a violation. So is an acknowledgement the syncer never recorded,
        and a merge contributor the syncer never accepted.
    double_applied (a violation): one key in two merges.
I2  Within a syncer life each fragment's versions go up by exactly one per merge, from the
    version it started at; every merge has at least K (min_quorum) distinct contributors, except a
    merge the syncer recorded as "quorum_unreachable" (every learner that could still contribute
    had, and too few remained, the others having finished or left: counted, not a violation); a new
    life starts from a state that really existed (a merged or restored version with the same
    parameter hash) and from at least the newest checkpoint the previous lives committed.
I3  After recovery every learner holds the syncer's bytes: for every fragment, the sha256 of the
    values the learner holds equals the syncer's published sha256 for that (life, version), and
    the learner is on the syncer's final life.
I4  Every committed checkpoint the store retains loads, its fragments hash to the recorded
    sha256, are finite, and each (version, sha256) is a state the syncer really had.
I5  The final held-out loss is at most (1 + margin) x the fault-free run's with the same seed.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from ddiloco.algo import fragments as fragments_lib

# A fragment whose last merge is this much older than the newest merge of any fragment stalled.
STALL_S = 15.0


@dataclasses.dataclass
class Check:
    """One invariant's verdict: `ok`, the figures, and every violation spelled out."""

    name: str
    ok: bool = True
    figures: dict = dataclasses.field(default_factory=dict)
    violations: list[str] = dataclasses.field(default_factory=list)
    skipped: str = ""  # why the check could not run (then ok is True but it proves nothing)

    def fail(self, message: str) -> None:
        self.ok = False
        if len(self.violations) < 50:
            self.violations.append(message)


@dataclasses.dataclass
class SyncerLife:
    instance: str
    start: dict
    records: list[dict] = dataclasses.field(default_factory=list)
    shutdown: dict | None = None  # None: the life ended in a crash (or is still running)

    @property
    def crashed(self) -> bool:
        return self.shutdown is None


def syncer_lives(records: Iterable[dict]) -> list[SyncerLife]:
    """Groups a syncer history by life, in start order."""
    lives: dict[str, SyncerLife] = {}
    order: list[SyncerLife] = []
    for rec in records:
        inst = rec.get("instance", "")
        if rec["event"] == "start":
            life = SyncerLife(instance=inst, start=rec)
            lives[inst] = life
            order.append(life)
            continue
        life = lives.get(inst)
        if life is None:  # a record without its start (a torn history): keep it in an anonymous life
            life = lives[inst] = SyncerLife(instance=inst, start={"fragments": {}, "min_quorum": 1})
            order.append(life)
        if rec["event"] == "shutdown":
            life.shutdown = rec
        else:
            life.records.append(rec)
    return order


def _params_sha(start_fragment: Sequence) -> str:
    """A start record's [version, published sha256, params sha256] -> the params sha256."""
    return start_fragment[2] if len(start_fragment) > 2 else start_fragment[1]


def _key(instance: str, learner: str, incarnation: int, fragment: int, base: int) -> tuple:
    return (instance, learner, int(incarnation), int(fragment), int(base))


def rolled_back_merges(lives: Sequence[SyncerLife]) -> set[tuple[str, int, int]]:
    """(instance, fragment, version) of merges lost because the next life restored an older version."""
    out = set()
    for life, nxt in zip(lives, lives[1:]):
        restored = {int(f): int(v[0]) for f, v in nxt.start.get("fragments", {}).items()}
        for rec in life.records:
            if rec["event"] == "merged" and rec["version"] > restored.get(int(rec["fragment"]), math.inf):
                out.add((life.instance, int(rec["fragment"]), int(rec["version"])))
    return out


def _fate(key: tuple, life: SyncerLife | None, merged_in: Mapping[tuple, list[tuple]], rolled: set[tuple],
          pending: set[tuple]) -> str:
    """Where an accepted upload ended (I1's classes): applied, or rolled_back when its first merge
    is in `rolled`; else lost_on_syncer_crash, pending, or lost (a violation)."""
    if key in merged_in:
        return "rolled_back" if merged_in[key][0] in rolled else "applied"
    if life is not None and life.crashed:
        return "lost_on_syncer_crash"
    return "pending" if key in pending else "lost"


def check_uploads(syncer_records: Sequence[dict], learner_records: Mapping[str, Sequence[dict]]) -> Check:
    """I1: every acknowledged upload in exactly one merge (with the classification above)."""
    check = Check("I1 acked uploads applied exactly once")
    lives = syncer_lives(syncer_records)
    by_instance = {life.instance: life for life in lives}
    rolled = rolled_back_merges(lives)
    accepted: dict[tuple, dict] = {}
    merged_in: dict[tuple, list[tuple]] = collections.defaultdict(list)
    pending: set[tuple] = set()
    for life in lives:
        for rec in life.records:
            if rec["event"] == "accepted":
                accepted[_key(life.instance, rec["learner"], rec["incarnation"], rec["fragment"], rec["base_version"])] = rec
            elif rec["event"] == "merged":
                for learner, incarnation, base, *_ in rec["contributors"]:
                    key = _key(life.instance, learner, incarnation, rec["fragment"], base)
                    merged_in[key].append((life.instance, int(rec["fragment"]), int(rec["version"])))
        if life.shutdown is not None:
            for fragment, learner, incarnation, base in life.shutdown.get("pending", []):
                pending.add(_key(life.instance, learner, incarnation, fragment, base))
    double = 0
    for key, merges in merged_in.items():
        if len(merges) > 1:
            double += len(merges) - 1
            check.fail(f"upload {key} applied {len(merges)} times: merges {merges}")
        if key not in accepted:
            check.fail(f"merge {merges[0]} has contributor {key} that the syncer never recorded as accepted")
    acked: set[tuple] = set()
    for records in learner_records.values():
        for rec in records:
            if rec["event"] == "ack":
                acked.add(_key(rec["instance"], rec["learner"], rec["incarnation"], rec["fragment"], rec["base_version"]))
    counts = collections.Counter()
    for key in sorted(acked):
        if key not in accepted:
            counts["lost"] += 1
            check.fail(f"upload {key} was acknowledged but the syncer has no record of accepting it")
            continue
        fate = _fate(key, by_instance.get(key[0]), merged_in, rolled, pending)
        counts[fate] += 1
        if fate == "lost":
            check.fail(f"upload {key} was acknowledged, the syncer life ended gracefully, and it is in no merge "
                       "and not pending")
    # Accepted by the syncer but never acknowledged to the learner (it died or the link broke
    # before the response): the same rules, reported separately (a merge counts as applied here,
    # rolled back or not).
    unacked = collections.Counter()
    for key in accepted:
        if key in acked:
            continue
        fate = _fate(key, by_instance[key[0]], merged_in, set(), pending)
        unacked[fate] += 1
        if fate == "lost":
            check.fail(f"upload {key} was accepted by a syncer life that ended gracefully but is in no merge "
                       "and not pending")
    check.figures = {
        "acked": len(acked), "applied": counts["applied"], "lost": counts["lost"],
        "lost_on_syncer_crash": counts["lost_on_syncer_crash"], "rolled_back": counts["rolled_back"],
        "pending": counts["pending"], "double_applied": double, "accepted_unacked": dict(unacked),
        "merges": sum(1 for life in lives for r in life.records if r["event"] == "merged"),
        "rolled_back_merges": len(rolled),
    }
    return check


# The codes a learner records on a `failed` upload whose call ended without the syncer's verdict
# (ddiloco/learner/client.py _OUTCOME_UNKNOWN: a reset or cancelled stream, a server going away
# mid-write): the upload may or may not have been taken, and the learner sends the same job again
# (idempotent on its key), or drops it once its syncer life is gone.
OUTCOME_UNKNOWN_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"})


def upload_failures(syncer_records: Sequence[dict], learner_records: Mapping[str, Sequence[dict]]) -> dict:
    """Uploads that ended without an acknowledgement, by what that means (figures, not an invariant).

      * gave_up: `failed` without a code: the learner's bounded retries ran out;
      * refused_deadline: the syncer's verdict DEADLINE_EXCEEDED;
      * outcome_unknown: `failed` with an outcome-unknown code. Not a loss by itself: if the syncer
        recorded accepting its key (`taken`), I1 accounts for it like any accepted upload (merged,
        pending, or lost with a crashed life, else a violation); if not (`not_taken`), nothing of it
        was applied and the learner sent it again or, its syncer life gone, dropped it.
      * by_code: outcome_unknown per status code.
    A rolling restart of the syncer may end uploads in flight this way (the server stops mid-write);
    counting them as losses is what made row 5 flaky.
    """
    accepted = {_key(r["instance"], r["learner"], r["incarnation"], r["fragment"], r["base_version"])
                for r in syncer_records if r["event"] == "accepted"}
    out = {"gave_up": 0, "refused_deadline": 0, "outcome_unknown": 0, "taken": 0, "not_taken": 0, "by_code": {}}
    for records in learner_records.values():
        for rec in records:
            code = rec.get("code")
            if rec["event"] == "refused" and code == "DEADLINE_EXCEEDED":
                out["refused_deadline"] += 1
            elif rec["event"] == "failed" and code not in OUTCOME_UNKNOWN_CODES:
                out["gave_up"] += 1
            elif rec["event"] == "failed":
                out["outcome_unknown"] += 1
                out["by_code"][code] = out["by_code"].get(code, 0) + 1
                key = _key(rec["instance"], rec["learner"], rec["incarnation"], rec["fragment"], rec["base_version"])
                out["taken" if key in accepted else "not_taken"] += 1
    return out


def check_versions(syncer_records: Sequence[dict]) -> Check:
    """I2: versions +1 per merge within a life, >= K contributors, restarts from real, durable states."""
    check = Check("I2 versions increase, quorum respected, restarts from durable states")
    lives = syncer_lives(syncer_records)
    known: dict[int, set[tuple[int, str]]] = collections.defaultdict(set)  # fragment -> (version, params sha)
    last_checkpoint = -1
    merges = below = unreachable = 0
    for n, life in enumerate(lives):
        start_fragments = {int(f): v for f, v in life.start.get("fragments", {}).items()}
        if n > 0:
            for f, v in start_fragments.items():
                if (int(v[0]), _params_sha(v)) not in known[f]:
                    check.fail(f"life {life.instance[:8]} restored fragment {f} at version {v[0]} with a state "
                               "(version, sha256) no earlier life had")
            if life.start.get("outer_steps", 0) < last_checkpoint:
                check.fail(f"life {life.instance[:8]} restored outer step {life.start.get('outer_steps')}, older than "
                           f"the committed checkpoint at outer step {last_checkpoint}")
        for f, v in start_fragments.items():
            known[f].add((int(v[0]), _params_sha(v)))
        version = {f: int(v[0]) for f, v in start_fragments.items()}
        quorum = int(life.start.get("min_quorum", 1))
        for rec in life.records:
            if rec["event"] == "checkpoint":
                last_checkpoint = max(last_checkpoint, int(rec["outer_step"]))
            if rec["event"] != "merged":
                continue
            merges += 1
            f = int(rec["fragment"])
            expected = version.get(f, 0) + 1
            if int(rec["version"]) != expected:
                check.fail(f"life {life.instance[:8]} fragment {f}: merged version {rec['version']}, expected {expected}")
            version[f] = int(rec["version"])
            known[f].add((int(rec["version"]), rec.get("params_sha256", rec["sha256"])))
            distinct = len({c[0] for c in rec["contributors"]})
            if distinct < quorum and rec.get("reason") == "quorum_unreachable" and distinct >= 1:
                unreachable += 1  # the last work of a run whose other learners are done
            elif distinct < quorum:
                below += 1
                check.fail(f"life {life.instance[:8]} fragment {f} version {rec['version']}: {distinct} contributors "
                           f"< min_quorum {quorum} (reason {rec.get('reason')})")
    # Liveness (a figure, not an invariant): fragments whose merges stopped well before the others'.
    last: dict[int, float] = {}
    for life in lives:
        for rec in life.records:
            if rec["event"] == "merged":
                last[int(rec["fragment"])] = rec["t"]
    newest = max(last.values(), default=0.0)
    stalled = sorted(f for f, t in last.items() if newest - t > STALL_S)
    check.figures = {"merges": merges, "below_quorum": below, "quorum_unreachable": unreachable, "lives": len(lives),
                     "restarts": max(len(lives) - 1, 0), "stalled_fragments": stalled}
    return check


def published_states(syncer_records: Sequence[dict]) -> dict[tuple[str, int, int], str]:
    """(instance, fragment, version) -> the sha256 learners should hold for it."""
    out = {}
    for life in syncer_lives(syncer_records):
        for f, v in life.start.get("fragments", {}).items():
            out[(life.instance, int(f), int(v[0]))] = v[1]
        for rec in life.records:
            if rec["event"] == "merged":
                out[(life.instance, int(rec["fragment"]), int(rec["version"]))] = rec["sha256"]
    return out


def check_learner_hashes(syncer_records: Sequence[dict], summaries: Mapping[str, dict | None]) -> Check:
    """I3: each learner's final held fragments hash to the syncer's published bytes for the same
    (life, version); a learner whose last life contributed to the syncer's final life must hold
    that life's fragments (it re-synced). A learner that finished before it could re-sync with a
    restarted syncer is counted (`stale`), not failed: its bytes are still checked."""
    check = Check("I3 learners hold the syncer's bytes")
    states = published_states(syncer_records)
    lives = syncer_lives(syncer_records)
    final = lives[-1] if lives else None
    contributed_final = {(c[0], int(c[1])) for r in (final.records if final else []) if r["event"] == "merged"
                         for c in r["contributors"]}
    equal = stale = 0
    for learner, summary in sorted(summaries.items()):
        if summary is None:
            check.fail(f"{learner}: no final summary (it did not exit cleanly)")
            continue
        instances = summary.get("held_instances", {})
        resynced = (learner, int(summary.get("incarnation", -1))) in contributed_final
        good, on_final = bool(summary.get("held")), True
        if not good:
            check.fail(f"{learner}: holds no fragment")
        for f, held in sorted(summary.get("held", {}).items()):
            inst = instances.get(f, final.instance if final else "")
            expected = states.get((inst, int(f), int(held["version"])))
            if expected is None:
                good = False
                check.fail(f"{learner}: fragment {f} version {held['version']} of syncer life {inst[:8]} is unknown "
                           "to the syncer's history")
            elif expected != held["sha256"]:
                good = False
                check.fail(f"{learner}: fragment {f} version {held['version']} sha256 {held['sha256'][:12]} != "
                           f"syncer's {expected[:12]}")
            if final is not None and inst != final.instance:
                on_final = False
                if resynced:
                    good = False
                    check.fail(f"{learner}: contributed to the final syncer life {final.instance[:8]} but still holds "
                               f"fragment {f} from life {inst[:8]}")
        equal += good
        stale += not on_final
    check.figures = {"learners": len(summaries), "hash_equal": equal, "stale": stale}
    return check


def check_checkpoints(syncer_records: Sequence[dict], checkpoints: Sequence[tuple[int, object]]) -> Check:
    """I4: every retained checkpoint loads, hashes right, is finite and is a state the syncer had.

    `checkpoints`: (manifest step, its SyncerSnapshot: checkpointing.load_snapshot) per retained checkpoint, or (step, the error
    raised while loading it).
    """
    check = Check("I4 committed checkpoints load and match their hashes")
    known: dict[int, set[tuple[int, str]]] = collections.defaultdict(set)
    for life in syncer_lives(syncer_records):
        for f, v in life.start.get("fragments", {}).items():
            known[int(f)].add((int(v[0]), _params_sha(v)))
        for rec in life.records:
            if rec["event"] == "merged":
                known[int(rec["fragment"])].add((int(rec["version"]), rec.get("params_sha256", rec["sha256"])))
    loadable = 0
    for step, snapshot in checkpoints:
        if isinstance(snapshot, Exception):
            check.fail(f"checkpoint at step {step} does not load: {snapshot!r}")
            continue
        good = True
        if snapshot.outer_steps != int(step):
            good = False
            check.fail(f"checkpoint at step {step} holds outer step {snapshot.outer_steps}")
        for frag in snapshot.fragments:
            params = np.asarray(frag.params)
            digest = fragments_lib.fragment_sha256(params)
            if digest != frag.params_sha256:
                good = False
                check.fail(f"checkpoint {step} fragment {frag.fragment_id}: sha256 {digest[:12]} != recorded "
                           f"{frag.params_sha256[:12]}")
            if not np.all(np.isfinite(params)):
                good = False
                check.fail(f"checkpoint {step} fragment {frag.fragment_id}: non-finite values")
            if syncer_records and (frag.version, digest) not in known[frag.fragment_id]:
                good = False
                check.fail(f"checkpoint {step} fragment {frag.fragment_id} version {frag.version}: a state the "
                           "syncer's history does not have")
        loadable += good
    if not checkpoints:
        check.skipped = "no committed checkpoint"
    check.figures = {"checkpoints": len(checkpoints), "loadable": loadable}
    return check


def check_loss(loss: float | None, baseline: float | None, margin: float) -> Check:
    """I5: the final held-out loss is at most (1 + margin) x the fault-free baseline's."""
    check = Check("I5 final loss within margin of the fault-free run")
    check.figures = {"loss": loss, "baseline": baseline, "margin": margin}
    if loss is None or baseline is None:
        check.skipped = "no baseline" if baseline is None else "no final loss"
        return check
    delta = (loss - baseline) / baseline
    check.figures["delta"] = delta
    if not math.isfinite(loss) or delta > margin:
        check.fail(f"final loss {loss:.4f} is {100 * delta:+.1f} % from the fault-free {baseline:.4f} "
                   f"(margin {100 * margin:.0f} %)")
    return check


# MemberState.flags: quarantined at least once (protos/ddiloco/v1/syncer.proto).
FLAG_QUARANTINED = 16


def check_quarantines(final_members: Sequence[dict], seen: Mapping[str, float]) -> Check:
    """I7: no learner was quarantined. Every learner of a scenario is honest (its faults are crashes,
    hangs and links, never bad input), and the syncer runs its shipped robustness defaults, so a
    quarantine is a false positive of the defaults (issue 24). `final_members`: the final training
    state's members (MessageToDict: uint64 as strings); `seen`: learners the poller saw quarantined."""
    check = Check("I7 no honest learner quarantined")
    names = set(seen)
    for member in final_members:
        if member.get("quarantined") or int(member.get("flags", 0)) & FLAG_QUARANTINED:
            names.add(member.get("learner_id", "?"))
    check.figures["quarantined"] = sorted(names)
    for name in sorted(names):
        check.fail(f"{name} was quarantined")
    return check


def check_epochs(learner_records: Mapping[str, Sequence[dict]]) -> Check:
    """I6 (leader election): no learner folds in a version of an older leader epoch after one of a
    newer epoch (fencing: a deposed leader broadcasts nothing once a newer one could lead)."""
    check = Check("I6 learners never fold in an older leader epoch after a newer one")
    versions = epochs = 0
    seen: set[int] = set()
    for learner, records in learner_records.items():
        newest = 0
        for rec in records:
            if rec.get("event") != "version":
                continue
            epoch = int(rec.get("epoch", 0))
            versions += 1
            seen.add(epoch)
            if epoch < newest:
                check.fail(f"{learner} folded in fragment {rec['fragment']} version {rec['version']} of epoch {epoch} "
                           f"after a version of epoch {newest}")
            newest = max(newest, epoch)
    epochs = len(seen - {0})
    if not versions:
        check.skipped = "no learner recorded a folded-in version"
    check.figures = {"versions": versions, "epochs": epochs}
    return check
