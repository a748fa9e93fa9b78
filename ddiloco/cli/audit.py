"""`ddiloco audit`: who influenced the global model, and by how much, from the syncer's merge ledger.

    ddiloco audit --ledger runs/merges.jsonl [--run-id RUN] [--fragment P] [--from-version A] [--to-version B]
    ddiloco audit --store HOST:PORT --run-id RUN [--fragment P] [--from-version A] [--to-version B] [--merges]
    ddiloco audit replay --store HOST:PORT --run-id RUN [--from-step N]     (ddiloco/cli/audit_replay.py)

Owns reading a merge ledger (`--merge-ledger` of the syncer, format `ddiloco.ledger/1`: see
services/syncer/influence.py), verifying its hash chain (each record's `prev` is the sha256 of
the line before; a rotated `<file>.1` is read first), and summing it per identity over a version
range: merges contributed to, mean and largest share of the merge's weight, claims clipped, shares
capped, mean cosine with the merged update, persistent residual, refusals and quarantines. An identity is flagged as an
outlier when its share was capped in most of its merges of three or more, its norm was clipped (or
refused as marginally beyond the bound) in most of its contributions, its batch or step rate was
clipped, its mean cosine is far below the others', its residual against the others keeps its
direction across rounds far more than theirs do (a bias added every round: `residual_persistent`,
PERSISTENT_RATIO), it sent the same contribution to more than one
merge (a replay: equal contribution hashes), or any of its contributions was refused for what it was.
Honest learners are capped and clipped now and then (bench/results/hostile.md: one with unusual
data in up to 28 % of its contributions), hence "most", not "any".
With `--store` the ledger is the checkpoint store's copy of the run (every record since the run's
first, so its chain must start at the genesis hash); `--merges` lists each merge of the selection
with its epoch, published hash and every contributor's share and contribution hash.
Exit status: 0 intact and nothing flagged, 1 something flagged, 2 a broken chain or unreadable ledger.
Must not: change the ledger; it talks to nothing but the store (ReadLedger, as a reader).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import statistics
import sys
from collections.abc import Iterable, Sequence

from ddiloco.algo import coherence as coherence_lib
from ddiloco.cli import status as status_lib

FORMAT = "ddiloco.ledger/1"
GENESIS = "0" * 64
# A mean cosine this far below the median of the other identities' means is an outlier: honest
# learners' mean cosines with the merged update differ by less (see docs/security.md). An honest
# learner with unusual data (the hostile matrix's learner-2, its own data shard) was measured up to
# 0.35 below the others' median on a loaded machine, so 0.25 named it.
COSINE_GAP = 0.5


# Refusals that judge a contribution (staleness, fencing and load do not). "norm_bound_marginal"
# (less than twice the bound) is counted with the norm clips: honest learners with unusual data
# produce a few.
JUDGED_REFUSALS = frozenset({"norm_bound", "direction", "replay_mismatch", "malformed",
                             "nonfinite", "corrupt", "checksum", "chunks", "size", "steps", "quarantined"})
# Norms clipped (or refused as marginal), or shares capped in merges of three or more, in more than
# this share of an identity's contributions: an outlier. The share cap and the norm clip bound what
# any contribution can do; an honest learner meets them now and then (a contribution spanning more
# steps than the others', data unusual enough to be clipped in 28 % of its contributions in the
# hostile matrix's replay case), an inflating or scaling one nearly always (60 of 60, 82 of 84).
NORM_CLIP_SHARE = 0.5
MIN_OUTLIER_EVENTS = 3  # fewer caps or clips than this never flag (1 of 2 merges is not a pattern)
# A bias kept up round after round (ddiloco.algo.coherence: `residual_persistent`, the squared norm of
# the part of a learner's residual against the others that keeps its direction across rounds, per
# unit contribution). Honest learners on their own data shards have such a part too (measured,
# median over fragments, 0.06-0.13; see the module), so only an outlier flags: the median over the
# learner's fragments (each fragment's last score in the selection, from RESIDUAL_MIN_ROUNDS or more
# residuals) at least PERSISTENT_RATIO times the median of the other learners' and at least
# PERSISTENT_FLOOR. Twice the others' median: the learner's residual holds a fixed part as large
# again as an honest one's, on top of its own (the honest medians measured were within 1.7 x of each
# other). The floor: a fixed part under a third of a contribution's norm (0.1 = 0.32^2) is not called
# a bias whatever the others have. The median over fragments: one fragment with an early burst does
# not flag (an honest learner measured 0.52 on one fragment, 0.06-0.19 on the others).
PERSISTENT_RATIO = 2.0
PERSISTENT_FLOOR = 0.1
RESIDUAL_MIN_ROUNDS = coherence_lib.MIN_ROUNDS  # with fewer residuals in the sums the score is mostly noise
MIN_PERSISTENT_PEERS = 2  # other learners with a score needed to compare with


class LedgerError(ValueError):
    """The ledger does not parse or its hash chain is broken."""


def read_ledger(path: str) -> list[dict]:
    """Every record of the ledger at `path` (and its rotated `<path>.1`, read first), oldest first,
    with the chain verified. LedgerError on a broken chain, a bad line or no file."""
    lines: list[bytes] = []
    found = False
    for candidate in (path + ".1", path):
        try:
            with open(candidate, "rb") as f:
                lines += [line for line in f.read().splitlines() if line.strip()]
            found = True
        except FileNotFoundError:
            continue
    if not found:
        raise LedgerError(f"no merge ledger at {path} (the syncer writes it with --merge-ledger)")
    return verify_lines(lines)


def verify_lines(lines: Sequence[bytes], *, from_genesis: bool = False) -> list[dict]:
    """The records of ledger `lines`, oldest first, with the hash chain verified (from the genesis
    hash when `from_genesis`: a ledger known to be whole). LedgerError names the first bad line and
    the merge of the record before it (the one changed, when a link breaks)."""
    records: list[dict] = []
    prev: str | None = GENESIS if from_genesis else None
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LedgerError(f"line {number}: not JSON ({exc.msg}): a truncated or edited ledger") from None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise LedgerError(f"line {number}: not a {FORMAT} record")
        # The first record kept may follow rotated-away ones: its `prev` is taken on trust.
        if prev is not None and record.get("prev") != prev:
            before = (f" (fragment {records[-1].get('fragment')} version {records[-1].get('version')})"
                      if records else "")
            raise LedgerError(f"line {number}: hash chain broken (prev {str(record.get('prev'))[:12]}..., expected "
                              f"{prev[:12]}...): the record before it{before} was changed, or records were "
                              "removed or reordered")
        prev = hashlib.sha256(line).hexdigest()
        records.append(record)
    return records


def select(records: Iterable[dict], *, run_id: str = "", fragment: int | None = None,
           from_version: int = 0, to_version: int | None = None) -> list[dict]:
    """The records of a run (all when empty), fragment and version range [from, to]."""
    return [r for r in records
            if (not run_id or r.get("run_id") == run_id) and (fragment is None or r.get("fragment") == fragment)
            and r.get("version", 0) >= from_version and (to_version is None or r.get("version", 0) <= to_version)]


def influence(records: Sequence[dict]) -> dict[str, dict]:
    """Per identity: merges, mean/max share, mean cosine, clipped claims, capped shares, refusals."""
    per: dict[str, dict] = collections.defaultdict(lambda: {
        "merges": 0, "shares": [], "cosines": [], "clipped": collections.Counter(), "refused": collections.Counter(),
        "quarantined": 0, "replayed": 0})
    # (learner, contribution hash) -> the base version it was first merged on. The same work on the
    # same base may be merged again (a syncer's successor re-merging it); on another base it is a replay.
    seen: dict[tuple[str, str], int | None] = {}
    for record in records:
        for c in record.get("contributors", ()):
            entry = per[c["learner"]]
            entry["merges"] += 1
            digest = c.get("contribution_sha256")
            if digest and seen.setdefault((c["learner"], digest), c.get("base_version")) != c.get("base_version"):
                entry["replayed"] += 1
            entry["shares"].append(float(c.get("share") or 0.0))
            if c.get("cosine") is not None:
                entry["cosines"].append(float(c["cosine"]))
            entry["clipped"].update(c.get("clipped", ()))
        for r in record.get("refused", ()):
            entry = per[r["learner"]]
            entry["refused"][r.get("reason", "")] += 1
            entry["quarantined"] += r.get("outcome") == "quarantined"
    out = {}
    for learner, e in per.items():
        out[learner] = {
            "merges": e["merges"],
            "mean_share": statistics.fmean(e["shares"]) if e["shares"] else 0.0,
            "max_share": max(e["shares"], default=0.0),
            "mean_cosine": statistics.fmean(e["cosines"]) if e["cosines"] else None,
            "clipped": dict(e["clipped"]), "refused": dict(e["refused"]), "quarantined_refusals": e["quarantined"],
            "replayed": e["replayed"],
        }
    persistent = persistent_scores(records)
    for learner, e in out.items():
        e["residual_persistent"] = persistent.get(learner)
    for learner, e in out.items():
        others = [o["mean_cosine"] for lid, o in out.items() if lid != learner and o["mean_cosine"] is not None]
        reasons = []
        # Capped in merges of three or more, mostly: in a merge of two the heavier of two honest
        # learners is capped too (at 0.5 both weigh the same), and now and then an honest learner
        # whose contribution spans many more steps than the others'.
        large = [c for r in records if len(r.get("contributors", ())) >= 3 for c in r["contributors"]
                 if c["learner"] == learner]
        capped = sum(1 for c in large if "share" in (c.get("clipped") or ()))
        if _often(capped, len(large)):
            reasons.append(f"share capped in {capped} of {len(large)} merges of 3 or more")
        if e["mean_cosine"] is not None and others and e["mean_cosine"] < statistics.median(others) - COSINE_GAP:
            reasons.append(f"mean cosine {e['mean_cosine']:+.2f} vs others' median {statistics.median(others):+.2f}")
        # Claims are clipped for a reason (an honest learner's claims match what the syncer
        # observes); norms of honest learners are clipped now and then, so only mostly is an outlier.
        marginal = e["refused"].get("norm_bound_marginal", 0)
        norm_clips = e["clipped"].get("norm", 0) + e["clipped"].get("norm_in_merge", 0) + marginal
        if any(k in e["clipped"] for k in ("batch", "step_rate")) or _often(norm_clips, e["merges"] + marginal):
            what = [f"{k} {v}" for k, v in sorted(e["clipped"].items())]
            what += [f"refused as marginally beyond the norm bound {marginal}"] if marginal else []
            reasons.append("claims or norms clipped: " + ", ".join(what))
        if e["replayed"]:
            reasons.append(f"replayed: {e['replayed']} contributions equal to one it sent to an earlier merge")
        drift = _persistent_outlier(learner, persistent)
        if drift:
            reasons.append(drift)
        judged = {k: v for k, v in e["refused"].items() if k in JUDGED_REFUSALS}
        if judged:
            reasons.append("refused: " + ", ".join(f"{k} {v}" for k, v in sorted(judged.items())))
        e["flags"] = reasons
    return out


def persistent_scores(records: Sequence[dict]) -> dict[str, float]:
    """Per identity: the median over fragments of its last `residual_persistent` in `records` (from
    RESIDUAL_MIN_ROUNDS or more rounds); identities without one are left out."""
    last: dict[tuple[str, int], float] = {}
    for record in records:
        for c in record.get("contributors", ()):
            if c.get("residual_persistent") is not None and (c.get("residual_rounds") or 0) >= RESIDUAL_MIN_ROUNDS:
                last[(c["learner"], record.get("fragment"))] = float(c["residual_persistent"])
    per: dict[str, list[float]] = collections.defaultdict(list)
    for (learner, _), value in last.items():
        per[learner].append(value)
    return {learner: statistics.median(values) for learner, values in per.items()}


def _persistent_outlier(learner: str, scores: dict[str, float]) -> str:
    """The flag of a learner whose residual keeps its direction far more than the others' (see
    PERSISTENT_RATIO), or ""."""
    own = scores.get(learner)
    others = [v for lid, v in scores.items() if lid != learner]
    if own is None or len(others) < MIN_PERSISTENT_PEERS:
        return ""
    reference = statistics.median(others)
    if own >= PERSISTENT_FLOOR and own >= PERSISTENT_RATIO * reference:
        return (f"persistent residual {own:.2f} vs others' median {reference:.2f}: a bias kept up across rounds "
                "(ddiloco.algo.coherence)")
    return ""


def _often(events: int, out_of: int) -> bool:
    """More than NORM_CLIP_SHARE of `out_of`, and at least MIN_OUTLIER_EVENTS."""
    return events >= MIN_OUTLIER_EVENTS and events > NORM_CLIP_SHARE * max(1, out_of)


def _table(summary: dict[str, dict], records: Sequence[dict]) -> str:
    versions = sorted({(r["fragment"], r["version"]) for r in records})
    head = (f"{len(records)} merges over {len({f for f, _ in versions})} fragments"
            + (f", versions {min(v for _, v in versions)}-{max(v for _, v in versions)}" if versions else ""))
    rows = [head, f"{'identity':<22} {'merges':>6} {'mean share':>10} {'max share':>9} {'mean cos':>8} "
                  f"{'persist':>7}  flags"]
    for learner, e in sorted(summary.items()):
        cos = "-" if e["mean_cosine"] is None else f"{e['mean_cosine']:+.3f}"
        persist = "-" if e.get("residual_persistent") is None else f"{e['residual_persistent']:.3f}"
        rows.append(f"{learner:<22} {e['merges']:>6} {e['mean_share']:>10.3f} {e['max_share']:>9.3f} {cos:>8} "
                    f"{persist:>7}  "
                     + ("; ".join(e["flags"]) or "-"))
    return "\n".join(rows)


def _merges(records: Sequence[dict]) -> str:
    """One line per merge: who influenced it, by how much, with what (contribution hashes)."""
    rows = []
    for r in records:
        who = ", ".join(f"{c['learner']} {float(c.get('share') or 0):.3f} {str(c.get('contribution_sha256', ''))[:12]}"
                        for c in r.get("contributors", ()))
        rows.append(f"fragment {r.get('fragment')} v{r.get('version')} epoch {r.get('epoch', 0)} "
                    f"sha256 {str(r.get('fragment_sha256', ''))[:12]}: {who}")
    return "\n".join(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ledger", help="the syncer's --merge-ledger file")
    source.add_argument("--store", help="a checkpoint store holding the run's ledger (HOST:PORT; replicas: a comma "
                                        "list, read from the one holding the longest)")
    parser.add_argument("--run-id", default="", help="only this run's merges (default: every run in the file; "
                                                     "required with --store)")
    parser.add_argument("--merges", action="store_true", help="also list every merge selected, with its contributors")
    parser.add_argument("--fragment", type=int, default=None, help="only this fragment")
    parser.add_argument("--from-version", type=int, default=0, help="first fragment version to count")
    parser.add_argument("--to-version", type=int, default=None, help="last fragment version to count")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    status_lib.add_security_arguments(parser)


def _read(args: argparse.Namespace) -> tuple[list[dict], str]:
    """The verified records and where they came from."""
    if args.ledger:
        return read_ledger(args.ledger), f"ledger {args.ledger}"
    if not args.run_id:
        raise LedgerError("--store needs --run-id (the store keeps one ledger per run)")
    from ddiloco.cli import audit_replay  # the store's client: only when asked for

    lines = audit_replay.fetch_ledger_lines(args.store, args.run_id, status_lib.client_security(args))
    if not lines:
        raise LedgerError(f"the store holds no ledger for run {args.run_id!r}")
    return verify_lines(lines, from_genesis=True), f"store {args.store} run {args.run_id}"


def run(args: argparse.Namespace) -> int:
    try:
        records, source = _read(args)
    except (LedgerError, OSError, ValueError) as exc:
        print(f"ddiloco audit: {exc}", file=sys.stderr)
        return 2
    chosen = select(records, run_id=args.run_id, fragment=args.fragment, from_version=args.from_version,
                    to_version=args.to_version)
    summary = influence(chosen)
    if args.json:
        print(json.dumps({"records": len(chosen), "chain": "intact", "identities": summary}, indent=2,
                         default=lambda v: None if isinstance(v, float) and not math.isfinite(v) else v))
    else:
        print(f"{source}: {len(records)} records, hash chain intact")
        print(_table(summary, chosen))
        if args.merges:
            print(_merges(chosen))
    return 1 if any(e["flags"] for e in summary.values()) else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["replay"]:
        from ddiloco.cli import audit_replay

        return audit_replay.main(argv[1:])
    parser = argparse.ArgumentParser(prog="ddiloco audit", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
