"""The merge ledger (services/syncer/influence.py) and `ddiloco audit` (ddiloco/cli/audit.py):
records chain by hash, across rotation and restarts; an edited, removed or reordered record breaks
the chain (exit status 2); the per-identity summary flags a learner whose share was capped, whose
direction is unlike the others' or whose contributions were refused."""

from __future__ import annotations

import json

import pytest

from ddiloco.cli import audit as audit_lib
from services.syncer import influence as influence_lib


def _record(version: int, contributors, refused=()) -> dict:
    return {"run_id": "r", "syncer_instance": "i", "fragment": 0, "version": version, "round": version,
            "merged_at_unix_s": 1.0, "reason": "quorum", "fragment_sha256": "00", "merged_norm": 1.0,
            "total_weight": 1.0, "contributors": list(contributors), "refused": list(refused)}


def _c(learner: str, share: float, cosine: float, clipped=()) -> dict:
    return {"learner": learner, "share": share, "cosine": cosine, "clipped": list(clipped), "norm": 1.0}


def _ledger(path, count: int = 6, **kwargs) -> influence_lib.MergeLedger:
    ledger = influence_lib.MergeLedger(str(path), **kwargs)
    for v in range(1, count + 1):
        ledger.append(_record(v, [_c("a", 0.25, 0.8), _c("b", 0.25, 0.7), _c("c", 0.25, 0.75),
                                  _c("x", 0.5 if v > 3 else 0.25, -0.1 if v > 3 else 0.7,
                                     ["share", "batch"] if v > 3 else [])],
                              [{"learner": "x", "reason": "norm_bound", "outcome": "refused"}] if v == 2 else []))
    return ledger


def test_audit_verifies_the_chain_and_flags_the_learner_that_took_over(tmp_path, capsys):
    path = tmp_path / "merges.jsonl"
    _ledger(path)
    assert audit_lib.main(["--ledger", str(path)]) == 1  # something flagged
    out = capsys.readouterr().out
    assert "hash chain intact" in out
    summary = audit_lib.influence(audit_lib.read_ledger(str(path)))
    assert {lid for lid, e in summary.items() if e["flags"]} == {"x"}
    assert summary["x"]["max_share"] == 0.5 and summary["x"]["refused"] == {"norm_bound": 1}
    # A version range: before the take-over only the refusal is there.
    early = audit_lib.influence(audit_lib.select(audit_lib.read_ledger(str(path)), to_version=1))
    assert all(not e["flags"] for e in early.values())


def test_audit_flags_a_replay_but_not_an_honest_learner_capped_or_clipped_now_and_then():
    # The hostile matrix's false flags before this rule (bench hostile, cases scaled, replay,
    # huge-batch): an honest learner capped in 1 of 8 merges of three, or clipped in norm in about a
    # quarter of its contributions, once refused as marginally beyond the bound. And the replaying
    # learner, whose equal contribution hashes on new bases the audit did not look at, went unnamed.
    def c(learner, base, digest, clipped=()):
        return {**_c(learner, 0.3, 0.9, clipped), "base_version": base, "contribution_sha256": digest}

    records = []
    for v in range(1, 9):
        honest_clips = ["share"] if v == 1 else ["norm"] if v in (2, 5) else []
        records.append(_record(v, [c("a", v - 1, f"a{v}"), c("b", v - 1, f"b{v}", honest_clips),
                                   c("r", v - 1, "same-every-time")],
                               [{"learner": "b", "reason": "norm_bound_marginal", "outcome": "refused"}]
                               if v == 3 else []))
    records.append(_record(9, [c("a", 7, "a8-again")]))  # the same work on the same base again: no replay
    records.append(_record(9, [c("a", 7, "a8-again")]))
    summary = audit_lib.influence(records)
    assert {lid for lid, e in summary.items() if e["flags"]} == {"r"}, summary
    assert summary["r"]["replayed"] == 7 and summary["a"]["replayed"] == 0
    # Mostly capped, or clipped in most contributions, is an outlier.
    mostly = [_record(v, [_c("a", 0.25, 0.9), _c("b", 0.25, 0.9), _c("y", 0.5, 0.9, ["share", "norm"])])
              for v in range(1, 5)]
    flags = audit_lib.influence(mostly)["y"]["flags"]
    assert any("share capped in 4 of 4" in f for f in flags) and any("norm 4" in f for f in flags), flags


@pytest.mark.parametrize("tamper", ["edit", "drop", "swap"])
def test_an_edited_removed_or_reordered_record_breaks_the_chain(tmp_path, capsys, tamper):
    path = tmp_path / "merges.jsonl"
    _ledger(path)
    lines = path.read_text().splitlines()
    if tamper == "edit":
        record = json.loads(lines[3])
        record["contributors"][3]["share"] = 0.25  # hide the take-over
        lines[3] = json.dumps(record, sort_keys=True, separators=(",", ":"))
    elif tamper == "drop":
        del lines[2]
    else:
        lines[2], lines[3] = lines[3], lines[2]
    path.write_text("\n".join(lines) + "\n")
    assert audit_lib.main(["--ledger", str(path)]) == 2
    assert "hash chain broken" in capsys.readouterr().err


def test_rotation_keeps_the_size_bounded_and_the_chain_whole_across_restarts(tmp_path):
    path = tmp_path / "merges.jsonl"
    _ledger(path, count=4, max_bytes=2000)
    _ledger(path, count=4, max_bytes=2000)  # a restarted syncer continues the chain
    assert (tmp_path / "merges.jsonl.1").exists()
    for candidate in (path, tmp_path / "merges.jsonl.1"):
        assert candidate.stat().st_size <= 2000
    records = audit_lib.read_ledger(str(path))  # verifies the chain over both files
    assert len(records) >= 2 and records[-1]["version"] == 4
