"""`ddiloco bench hostile`'s judgment (ddiloco/bench/hostile.py): the noise margin calibrated on
repeated 3-honest runs, the share compared with the cap only where the cap applies, and each
hostile case's verdict, stated in the report. Before these, the report gave gaps with no margin
and no pass or fail."""

from __future__ import annotations

import math

import pytest

from ddiloco.bench import hostile


def _case(loss: float, *, flags=None, capped_share: float = 0.5, honest_quarantined: int = 0) -> dict:
    return {"flags": ["--hostile", "x"], "loss": loss, "hostile_max_share": 0.6, "hostile_max_share_capped": capped_share,
            "share_cap": 0.5, "honest_max_share": 0.5, "merged_norm_ratio": 1.0, "honest_cosine": 0.9,
            "hostile_quarantined": False, "honest_quarantined": honest_quarantined, "hostile_accepted": 10,
            "audit_flags": {"learner-3": ["x"]} if flags is None else flags}


def test_the_margin_is_a_prediction_bound_from_the_honest_repeats():
    ref = hostile.noise_reference([2.80, 2.85, 2.90])
    sd = 0.05
    assert ref["mean"] == pytest.approx(2.85) and ref["sd"] == pytest.approx(sd)
    assert ref["margin"] == pytest.approx(4.303 * sd * math.sqrt(1 + 1 / 3))
    assert hostile.noise_reference([2.8])["margin"] is None


def test_each_criterion_can_fail_the_case():
    ref = hostile.noise_reference([2.80, 2.85, 2.90])
    limit = ref["mean"] + ref["margin"]
    assert hostile.verdict(_case(limit - 1e-3), ref)["pass"]
    assert hostile.verdict(_case(2.0), ref)["pass"]  # better than honest is fine
    assert not hostile.verdict(_case(limit + 1e-3), ref)["loss_within_margin"]
    assert not hostile.verdict(_case(2.8, capped_share=0.51), ref)["share_under_cap"]
    assert not hostile.verdict(_case(2.8, flags={}), ref)["named"]
    assert not hostile.verdict(_case(2.8, flags={"learner-3": ["x"], "learner-1": ["y"]}), ref)["honest_untouched"]
    assert not hostile.verdict(_case(2.8, honest_quarantined=1), ref)["pass"]
    assert hostile.verdict(_case(2.8), hostile.noise_reference([2.8]))["pass"] is False  # no margin: not passed


def test_the_cap_is_checked_where_it_applies():
    def record(contributors):
        return {"merge_inputs": {"share_cap_min_count": 3, "max_share": 0.5}, "contributors": contributors}

    def c(learner, share, unverified=False):
        return {"learner": learner, "share": share, "fold": {"claims_unverified": unverified}}

    records = [record([c("learner-3", 0.64), c("learner-0", 0.36)]),  # a merge of two: no cap
               record([c("learner-3", 0.5), c("learner-0", 0.25), c("learner-1", 0.25)]),
               record([c("learner-3", 0.45, True), c("learner-0", 0.55)]),
               record([c("learner-3", 1.0, True)])]  # alone it is the merge: no cap applies
    got = hostile._capped_share(records, "learner-3")
    assert got == {"hostile_max_share_capped": 0.5, "share_cap": 0.5, "hostile_capped_merges": 2}


def test_the_report_states_the_margin_and_each_verdict():
    result = {"steps": 100, "provenance": {}, "cases": {
        "honest3": {**_case(2.80, flags={}), "flags": None}, "honest3-2": {**_case(2.85, flags={}), "flags": None},
        "honest3-3": {**_case(2.90, flags={}), "flags": None},
        "good": _case(2.86), "bad": _case(3.5)}}
    hostile.judge(result)
    assert result["cases"]["good"]["verdict"]["pass"] and not result["cases"]["bad"]["verdict"]["pass"]
    assert "verdict" not in result["cases"]["honest3"]
    md = hostile.render_markdown(result)
    assert "Noise margin, from 3 runs" in md and "| PASS |" in md and "| FAIL |" in md
