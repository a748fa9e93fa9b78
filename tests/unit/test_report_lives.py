"""`ddiloco report` counts every learner life: a restarted learner (a new incarnation, its step and
token counters back at 0) adds its earlier lives' work to the fleet's tokens processed, to its own
tokens in the loss plot and to the index's work figures, whether or not the records carry the
incarnation or the syncer's own tokens_processed."""

from __future__ import annotations

import json

import pytest

from ddiloco.cli import report
from ddiloco.v1 import syncer_pb2

P = 4


def _rec(t: float, members: list[dict], *, tokens_merged: int, tokens_processed: int | None = None,
         with_inc: bool = True) -> dict:
    r = {"t": t, "run": "r", "instance": "i1", "outer_steps": 1, "tokens_merged": tokens_merged, "bytes_in": 0,
         "bytes_out": 0, "versions": [1] * P, "heldout_loss": None,
         "members": [{"id": m["id"], "region": "x", "status": 1, "step": m["step"], "tokens": m["tokens"],
                      "loss": m.get("loss", 2.0), **({"inc": m["inc"], "joins": m.get("joins", 1)} if with_inc else {})}
                     for m in members]}
    if tokens_processed is not None:
        r["tokens_processed"] = tokens_processed
    return r


def _restart_records(*, with_inc: bool, syncer_count: bool = False) -> list[dict]:
    """Learner a: life 1 reaches 1000 tokens, then restarts and reaches 300; learner b reaches 500."""
    lives = [
        ([{"id": "a", "inc": 1, "step": 5, "tokens": 500}, {"id": "b", "inc": 7, "step": 2, "tokens": 200}], 1000),
        ([{"id": "a", "inc": 1, "step": 10, "tokens": 1000}, {"id": "b", "inc": 7, "step": 3, "tokens": 300}], 2000),
        ([{"id": "a", "inc": 2, "step": 1, "tokens": 100, "joins": 2}, {"id": "b", "inc": 7, "step": 4, "tokens": 400}],
         4000),
        ([{"id": "a", "inc": 2, "step": 3, "tokens": 300, "joins": 2}, {"id": "b", "inc": 7, "step": 5, "tokens": 500}],
         3600),
    ]
    totals = [700, 1300, 1500, 1800]  # every life of every learner at each record
    return [_rec(float(i), members, tokens_merged=merged, with_inc=with_inc,
                 tokens_processed=totals[i] if syncer_count else None)
            for i, (members, merged) in enumerate(lives)]


@pytest.mark.parametrize("with_inc", [True, False], ids=["incarnation recorded", "older records"])
def test_work_merged_counts_the_lives_before_a_restart(with_inc):
    processed, share, lives = report.work_series(_restart_records(with_inc=with_inc))
    # The current members alone hold 300 + 500 = 800 tokens at the end; a's first life adds 1000.
    assert processed == [700, 1300, 1500, 1800]
    assert share[-1] == pytest.approx(3600 / (P * 1800))
    assert lives.learners()["a"] == {"lives": 2, "lives_seen": 2, "steps": 13, "tokens": 1300}
    assert lives.learners()["b"] == {"lives": 1, "lives_seen": 1, "steps": 5, "tokens": 500}


def test_the_syncers_own_count_is_used_when_recorded():
    records = _restart_records(with_inc=True, syncer_count=True)
    records[-1]["tokens_processed"] = 5000  # lives before the recording began: only the syncer knows them
    processed, share, _ = report.work_series(records)
    assert processed[-1] == 5000 and share[-1] == pytest.approx(3600 / (P * 5000))


def test_lives_before_the_recording_come_from_the_syncers_join_count():
    records = _restart_records(with_inc=True)
    records[-1]["members"][0]["joins"] = 3  # the syncer saw a life of `a` before the recording began
    lives = report.work_series(records)[2].learners()
    assert lives["a"]["lives"] == 3 and lives["a"]["lives_seen"] == 2


def test_a_restarted_learners_loss_goes_on_against_its_tokens_over_every_life():
    points = report.learner_loss_points(_restart_records(with_inc=True))
    assert [x for x, _ in points["a"]] == [500, 1000, 1100, 1300]
    assert [x for x, _ in points["b"]] == [200, 300, 400, 500]


def test_snapshot_records_carry_the_incarnation_and_the_report_draws_them(tmp_path):
    state = syncer_pb2.TrainingState(run_id="r", syncer_instance="i1", now_unix_s=10.0, tokens_merged=8,
                                     fragments=[syncer_pb2.FragmentState(fragment_id=0, version=3)])
    state.members.add(learner_id="a", incarnation=1234567890123456789, joins=2, local_step=4, tokens_total=64,
                      inner_loss=2.5)
    rec = report.snapshot_record(state)
    assert rec["members"][0]["inc"] == 1234567890123456789 and rec["members"][0]["joins"] == 2
    assert rec["run"] == "r" and rec["instance"] == "i1"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "state.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _restart_records(with_inc=True)))
    paths = report.make_plots(run_dir)
    assert {p.name for p in paths} == {"loss.png", "bytes.png", "versions.png", "work_merged.png"}
    index = (run_dir / "report" / "index.md").read_text()
    assert "tokens processed (every life of every learner): 1,800" in index
    assert f"{100 * 3600 / (P * 1800):.1f} %" in index
    assert "| a | 2 | 2 | 13 | 1,300 |" in index and "| b | 1 | 1 | 5 | 500 |" in index


def test_every_plot_is_labelled_and_the_multi_line_ones_have_a_legend(tmp_path, monkeypatch):
    from ddiloco import extras

    plt = extras.pyplot()
    closed = []
    real_close = plt.close

    def close(fig):  # read the figure's labels before it goes
        ax = fig.axes[0]
        closed.append((ax.get_title(), ax.get_xlabel(), ax.get_ylabel(), ax.get_legend() is not None))
        real_close(fig)

    monkeypatch.setattr(plt, "close", close)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "state.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _restart_records(with_inc=True)))
    report.make_plots(run_dir)
    assert closed == [
        ("Loss against tokens", "tokens", "loss (nats/token)", True),
        ("Bytes on the wire at the syncer", "seconds", "MiB (cumulative)", True),
        ("Global fragment versions", "seconds", "version", True),
        ("Work merged", "seconds", "tokens merged / (P x tokens processed), %", False),
    ]
