"""Who influenced each merge, and by how much: the syncer's influence record and merge ledger.

Owns `Influence` (per-identity counts the metrics read: weight shares, clipped claims, refused
contributions, capped shares; each identity's part in the last RECENT_MERGES merges as plain
`LearnerInfluence` rows, which services/syncer/wire_views.py turns into `TrainingState.influence`;
the refusals waiting for their fragment's next merge) and
`MergeLedger` (the append-only, hash-chained JSONL file of `--merge-ledger`: one record per
merge). Admission notes what it clipped or refused here; the merging part hands every merge over.
Must not: decide anything about a contribution (admission.py and ddiloco.algo.robust do).

A ledger record (format `ddiloco.ledger/1`, one JSON object per line) holds the merge (run,
syncer instance, fragment, version, round, reason, the published fragment's sha256, the merged
update's norm and total weight), every contribution merged (learner, incarnation, base version,
claimed steps and tokens, credited steps, claimed and accepted weight, share of the total,
norm, norm per step over the other learners' median, cosine with the merged update, outcome
`merged` or `clipped` with what was clipped) and every contribution refused since the fragment's
previous merge (outcome `refused` or `quarantined`, with the reason). `prev` is the sha256 of the
previous line, so `ddiloco audit` can tell a truncated, edited or reordered ledger from an intact
one. The file is rotated to `<path>.1` when it grows past `max_bytes`; the chain goes on across
the rotation. The same records go to the checkpoint store's ledger (services/syncer/ledger_sink.py),
each sink with its own chain.

Accountability (issue 24): each record also names the syncer's leader `epoch`, the new values'
`params_sha256`, the syncer's `outer_step` after the merge (a checkpoint's step), the checkpoint
step this syncer life restored (`restored_step`, None for a fresh start) and the merge's inputs
(`merge_inputs`: rules, share cap, norm clip, outer step fraction, delta scale and optimizer); each
contributor its `contribution_sha256` (sha256 of the decoded contribution's float32 bytes) and its fold-in
(`fold`: `index`, its position in the order contributions were added to the merge; `summed`, its
position in the order the accumulator summed them, held-back ones last; its weight as added, before
the share cap; per-tensor norms if given; steps; `claims_unverified`, whether admission clipped its
claimed steps or batch or had no other learners' history to check them against, which subjects it
to the share cap in a merge of any size). The merge
inputs include `share_cap_min_count` (the cap applies in merges of that many or more) and
`step_scaling` (how the in-merge norm clip compares contributions of different step counts). With retention on, `fold.blob` is the digest of
the values folded in (re-anchored and clipped) stored as a blob, and the record's `blobs` lists
them: `ddiloco audit replay` re-runs the merge from them in the recorded order, bit for bit.
A contributor scored by the cross-round residual coherence (ddiloco.algo.coherence: the direction
check on, two or more other learners' recent directions on the fragment) also carries
`residual_coherence`, `residual_persistent` and `residual_rounds`: a bias kept up across rounds
shows there (`ddiloco audit` flags an outlier), where norms, cosines and claims do not.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable

import numpy as np

from ddiloco.algo import coherence as coherence_lib
from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import merge as merge_lib
from ddiloco.algo import robust as robust_lib

_LOG = logging.getLogger("ddiloco.syncer")

FORMAT = "ddiloco.ledger/1"
GENESIS = "0" * 64  # `prev` of a ledger's first record
_REFUSALS_KEPT = 64  # refusals remembered per fragment between two merges (the ledger is bounded)
RECENT_MERGES = 64  # merges (all fragments) TrainingState.influence is taken over


@dataclasses.dataclass(frozen=True)
class LearnerInfluence:
    """One identity's part in the recent merges (`Influence.summary`; wire_views.learner_influence
    builds the TrainingState.influence row)."""

    learner_id: str
    merges: int  # recent merges it contributed to
    mean_share: float
    max_share: float
    share_capped: int  # of those merges, how many capped its share
    clipped: int  # ... and how many clipped it in any other way
    window_merges: int  # the merges (all fragments) the window holds


def line_sha256(line: bytes) -> str:
    """The chain hash of one ledger line (without its newline)."""
    return hashlib.sha256(line.rstrip(b"\n")).hexdigest()


def fold_record(learner: str, weight: float, norms: np.ndarray | None, steps: int, contribution_sha256: str,
                decoded: np.ndarray, folded: np.ndarray, *, retain: bool, claims_unverified: bool = False) -> dict:
    """What the ledger keeps of one fold-in (MergeAccumulator.add's inputs, in the order of the
    adds), in exactly the form replay passes back. `contribution_sha256`: fragments.fragment_sha256(decoded),
    taken before the fragment's lock. With `retain` a copy of the values folded in (and their
    hash when they differ from the decoded ones): call it in a worker thread."""
    out = {"learner": learner, "weight": float(weight), "steps": max(1, int(steps)),
           "norms": None if norms is None else [float(n) for n in np.asarray(norms, np.float64)],
           "contribution_sha256": contribution_sha256, "claims_unverified": bool(claims_unverified)}
    if retain:
        out["data"] = np.ascontiguousarray(folded, dtype="<f4").tobytes()
        out["blob"] = contribution_sha256 if folded is decoded else fragments_lib.fragment_sha256(np.frombuffer(out["data"], "<f4"))
    return out


class MergeLedger:
    """Appends hash-chained records to a JSONL file; see the module docstring."""

    def __init__(self, path: str, *, max_bytes: int = 64 << 20) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._prev = self._last_hash()
        self.records = 0

    def _last_hash(self) -> str:
        """The hash of the last line already in the ledger (a restarted syncer continues the chain)."""
        for candidate in (self.path, self.path + ".1"):
            try:
                with open(candidate, "rb") as f:
                    lines = [line for line in f.read().splitlines() if line.strip()]
            except FileNotFoundError:
                continue
            if lines:
                return line_sha256(lines[-1])
        return GENESIS

    def append(self, record: dict, blobs: dict | None = None) -> str:
        """Writes one record (adds `format` and `prev`); returns its chain hash. `blobs` (retained
        contributions) are for the store's ledger only."""
        line = json.dumps({"format": FORMAT, **record, "prev": self._prev}, sort_keys=True,
                          separators=(",", ":")).encode()
        try:
            if self.max_bytes and os.path.getsize(self.path) + len(line) + 1 > self.max_bytes:
                os.replace(self.path, self.path + ".1")
        except FileNotFoundError:
            pass
        with open(self.path, "ab") as f:
            f.write(line + b"\n")
        self._prev = line_sha256(line)
        self.records += 1
        return self._prev


def _rounded(value: float | None, digits: int = 6) -> float | None:
    return None if value is None or not math.isfinite(value) else round(float(value), digits)


class Influence:
    """Per-identity influence of contributions on merges. See the module docstring."""

    def __init__(self, *, run_id: str, instance: str, directions: robust_lib.DirectionGuard | None = None,
                 ledger: MergeLedger | None = None) -> None:
        self.run_id = run_id
        self.instance = instance
        self.directions = directions
        self.ledger = ledger
        self.store_ledger = None  # services/syncer/ledger_sink.StoreLedger: the checkpoint store's ledger
        self.retain_contributions = False  # --retain-contributions: each fold-in's values go to the store
        self.epoch: Callable[[], int] = lambda: 0  # the syncer's leader epoch (leadership.py)
        self.restored_step: int | None = None  # the checkpoint this syncer life restored
        self.clipped_claims: collections.Counter = collections.Counter()  # what -> contributions clipped
        self.refused: collections.Counter = collections.Counter()  # learner -> contributions refused
        self.share_capped: collections.Counter = collections.Counter()  # learner -> merges its share was capped in
        self.last_share: dict[str, float] = {}  # learner -> its share of the last merge it was in
        self.max_share: dict[str, float] = {}  # learner -> the largest share it ever had (this syncer's life)
        self._refusals: dict[int, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=_REFUSALS_KEPT))
        # Per recent merge: {learner: (share, share capped, clipped in any way)}.
        self._recent: collections.deque = collections.deque(maxlen=RECENT_MERGES)
        # Cross-round coherence of each learner's residual (ddiloco.algo.coherence): the ledger's
        # `residual_*` fields and ddiloco_syncer_residual_persistent_share; a constant bias shows there.
        self.coherence = coherence_lib.ResidualCoherence()

    def attach(self, *, ledger=None, store_ledger=None, retain_contributions: bool = False,
               epoch: Callable[[], int] | None = None) -> None:
        """Where the merges' records go: a local MergeLedger file, and/or the checkpoint store's ledger
        with the contributions retained or not, and the leader's epoch (__main__ gives them)."""
        if ledger is not None:
            self.ledger = ledger
        if store_ledger is not None:
            self.store_ledger, self.retain_contributions = store_ledger, retain_contributions
        if epoch is not None:
            self.epoch = epoch

    def note_refused(self, learner_id: str, fragment_id: int, reason: str, exc: BaseException | None = None) -> None:
        """A contribution was refused (admission or its checks); the fragment's next record names it.
        `exc`: the refusal, noted once however many layers report it."""
        if not learner_id or reason in ("busy", "busy_learner", "already_pending"):
            return  # load and protocol pacing, not a judgment of the contribution
        if exc is not None:
            if getattr(exc, "influence_noted", False):
                return
            exc.influence_noted = True
        self.refused[learner_id] += 1
        outcome = "quarantined" if reason == "quarantined" else "refused"
        self._refusals[fragment_id].append({"learner": learner_id, "reason": reason, "outcome": outcome})

    @property
    def audit_mode(self) -> str:
        """What a fold-in records (fold_record): "" nothing (no ledger), "hash", or "retain"."""
        if self.ledger is None and self.store_ledger is None:
            return ""
        return "retain" if self.retain_contributions and self.store_ledger is not None else "hash"

    def note_clipped(self, what: str) -> None:
        self.clipped_claims[what] += 1

    def merged(self, rnd, record, merged_direction: np.ndarray | None, published_sha256: str,
               params_sha256: str = "", *, outer_step: int | None = None, outer_state_sha256: str = "") -> dict:
        """Accounts for one merge (call under the fragment's lock, after the outer step): shares,
        cosines with the merged update (`merged_direction`, from `merged_direction`); appends the
        ledger record. Returns the record."""
        entries = list(getattr(rnd, "influence", ()))
        uncapped_total = sum(e["weight"] for e in entries)
        for entry in entries:  # the share the contribution would have had without the cap (calibration)
            entry["share_uncapped"] = _rounded(entry["weight"] / uncapped_total if uncapped_total > 0 else None)
        capped = rnd.accumulator.capped
        if capped is not None:
            for entry in entries:
                if entry["learner"] == capped[0]:
                    entry["weight"] = capped[2]
                    entry.setdefault("clipped", []).append("share")
            self.share_capped[capped[0]] += 1
        scale = rnd.accumulator.held_norm_scale
        if scale < 1.0:  # the largest, clipped against the norms of the merge's others
            for entry in entries:
                if entry["learner"] == rnd.accumulator.norm_clipped_key:
                    entry.setdefault("clipped", []).append("norm_in_merge")
                    entry["norm"] = round(entry["norm"] * scale, 9)
            self.clipped_claims["norm_in_merge"] += 1
        total = sum(e["weight"] for e in entries)
        scores = self._coherence(record.fragment_id, record.version, entries)
        contributors = []
        for entry in entries:
            share = entry["weight"] / total if total > 0 else 1.0 / max(1, len(entries))
            self.last_share[entry["learner"]] = share
            self.max_share[entry["learner"]] = max(share, self.max_share.get(entry["learner"], 0.0))
            heading = entry.pop("heading", None)
            cosine = (float(np.dot(heading, merged_direction))
                      if heading is not None and merged_direction is not None else None)
            clipped = entry.get("clipped", [])
            contributors.append({**{k: v for k, v in entry.items() if k != "clipped"},
                                 "weight": _rounded(entry["weight"], 9), "share": _rounded(share),
                                 "cosine": _rounded(cosine), "clipped": clipped,
                                 "outcome": "clipped" if clipped else "merged",
                                 **scores.get(entry["learner"], {})})
        out = {
            "run_id": self.run_id, "syncer_instance": self.instance, "fragment": record.fragment_id,
            "version": record.version, "round": record.round, "merged_at_unix_s": round(record.merged_at_unix_s, 3),
            "reason": record.reason, "fragment_sha256": published_sha256,
            "merged_norm": _rounded(record.outer_grad_norm), "total_weight": _rounded(total, 9),
            "contributors": contributors, "refused": list(self._refusals.pop(record.fragment_id, ())),
        }
        self._recent.append({c["learner"]: (c["share"] or 0.0, "share" in c["clipped"],
                                               any(what != "share" for what in c["clipped"]))
                             for c in contributors})
        blobs = self._accountability(rnd, out, params_sha256, outer_step)
        if outer_state_sha256:  # replay compares it: see ddiloco.algo.fragments.state_sha256
            out["outer_state_sha256"] = outer_state_sha256
        if self.ledger is not None:
            try:
                self.ledger.append(out)
            except OSError as exc:  # the merge stands; the gap shows as a missing version in the audit
                _LOG.error("merge ledger write failed", extra={"fields": {"path": self.ledger.path, "error": str(exc)}})
        if self.store_ledger is not None:
            self.store_ledger.append(out, blobs)  # queued: shipped in the background, never blocks a merge
        return out

    def _coherence(self, fragment_id: int, version: int, entries: list[dict]) -> dict[str, dict]:
        """Folds each contribution's residual into its learner's cross-round sums (with the direction
        check on: its sample is what is compared); the record's `residual_coherence`, `residual_persistent`
        (the squared norm of the residual's part that keeps its direction across rounds) and `residual_rounds`."""
        scores = self.coherence.observe(fragment_id, version, {e["learner"]: e.get("heading") for e in entries})
        out = {}
        for learner, score in scores.items():
            out[learner] = {"residual_coherence": _rounded(score.coherence, 4),
                            "residual_persistent": _rounded(score.persistent, 4),
                            "residual_rounds": _rounded(score.rounds, 2)}
        return out

    def _accountability(self, rnd, out: dict, params_sha256: str, outer_step: int | None) -> dict[str, bytes]:
        """Adds the epoch, hashes and fold-ins (module docstring) to a record; returns the retained
        contributions' bytes by digest."""
        folds = list(getattr(rnd, "folds", ()))
        out.update(epoch=int(self.epoch()), params_sha256=params_sha256, restored_step=self.restored_step,
                   outer_step=outer_step,
                   merge_inputs=getattr(rnd, "merge_inputs", None))
        by_learner = {f["learner"]: (index, f) for index, f in enumerate(folds)}
        summed = {key: position for position, key in enumerate(rnd.accumulator.fold_order)} if folds else {}
        blobs: dict[str, bytes] = {}
        for c in out["contributors"]:
            index, f = by_learner.get(c["learner"], (None, None))
            if f is None:
                continue
            c["contribution_sha256"] = f["contribution_sha256"]
            c["fold"] = {"index": index, "summed": summed.get(c["learner"]), "weight": f["weight"],
                         "norms": f["norms"], "steps": f["steps"], "claims_unverified": f["claims_unverified"]}
            if "blob" in f:
                c["fold"]["blob"] = f["blob"]
                blobs[f["blob"]] = f.pop("data")
        if blobs:
            out["blobs"] = sorted(blobs)
        return blobs

    def counts(self) -> dict:
        """Copies of the influence counts the metrics export (metrics._influence_families): shares,
        capped shares, clipped claims, refusals and persistent-direction scores, per identity.
        Call on the core's loop."""
        return {"share": dict(self.last_share), "max_share": dict(self.max_share),
                "capped": dict(self.share_capped), "clipped": dict(self.clipped_claims),
                "refused": dict(self.refused), "persistent": self.coherence.scores()}

    def summary(self) -> list[LearnerInfluence]:
        """Each identity's part in the recent merges (TrainingState.influence), by learner id."""
        parts: dict[str, list[tuple[float, bool, bool]]] = collections.defaultdict(list)
        for merge in self._recent:
            for learner, part in merge.items():
                parts[learner].append(part)
        return [LearnerInfluence(
            learner_id=learner, merges=len(p), mean_share=sum(s for s, _, _ in p) / len(p),
            max_share=max(s for s, _, _ in p), share_capped=sum(c for _, c, _ in p),
            clipped=sum(c for _, _, c in p), window_merges=len(self._recent))
            for learner, p in sorted(parts.items())]

    def merged_direction(self, fragment_id: int, merged: merge_lib.ScaledResult | None) -> np.ndarray | None:
        """The merged update's unit vector over the direction check's sample (None when it is off).
        One pass over the fragment: call it in a worker thread."""
        if merged is None or self.directions is None or not self.directions.policy.enabled:
            return None
        return self.directions.direction(fragment_id, merged.materialize())
