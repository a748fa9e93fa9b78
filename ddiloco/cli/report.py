"""`ddiloco report RUN_DIR`: turns a run's recorded training state into PNG plots.

A run directory holds one compact snapshot of the training state per poll in `state.jsonl` and
the final state in `final_state.json`; `ddiloco up` writes one for its own run and `ddiloco record`
(record.py) for any running cluster. This module owns that record format, the counting of learner
lives across it, and the plots: held-out loss of the global model and inner loss per learner
against tokens, bytes on the wire, fragment versions and work merged (tokens merged / (P x tokens
processed)) over time.

A learner's `local_step` and `tokens_total` count from 0 again in each of its lives (a restart
joins with a higher incarnation), so every per-learner and fleet work figure here sums each
life's highest count over every life seen (`LifeCounter`), never only the current life's.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from ddiloco import training_state as status_derived
from ddiloco.v1 import syncer_pb2


def snapshot_record(state: syncer_pb2.TrainingState) -> dict:
    """The compact per-poll record written to state.jsonl."""
    return {
        "t": state.now_unix_s,
        "run": state.run_id,
        "instance": state.syncer_instance,
        "outer_steps": state.outer_steps,
        "tokens_merged": state.tokens_merged,
        "tokens_processed": state.tokens_processed,
        "bytes_in": state.bytes_in,
        "bytes_out": state.bytes_out,
        "versions": [f.version for f in state.fragments],
        "members": [
            {"id": m.learner_id, "inc": m.incarnation, "joins": m.joins, "region": m.region,
             "status": int(m.status), "step": m.local_step, "tokens": m.tokens_total, "loss": m.inner_loss}
            for m in state.members
        ],
        "heldout_loss": state.evals[-1].heldout_loss if state.evals else None,
    }


class LifeCounter:
    """Every life of every learner in a sequence of records, fed oldest first with `add`.

    A life is (learner id, incarnation); its work is the highest step and token counts it
    reported. Records that predate the recorded incarnation ("inc" absent): a count below the
    current life's highest starts a new life, since both only grow within a life.
    """

    def __init__(self) -> None:
        self._lives: dict[str, list[dict]] = {}  # learner id -> its lives, oldest first
        self._joins: dict[str, int] = {}  # learner id -> the syncer's count of its lives (MemberState.joins)

    def add(self, record: dict) -> None:
        for m in record["members"]:
            lives = self._lives.setdefault(m["id"], [])
            inc = m.get("inc")
            if inc is not None:
                life = next((life for life in reversed(lives) if life["inc"] == inc), None)
            else:
                life = lives[-1] if lives else None
                if life is not None and (m["tokens"] < life["tokens"] or m["step"] < life["steps"]):
                    life = None
            if life is None:
                life = {"inc": inc, "steps": 0, "tokens": 0}
                lives.append(life)
            life["steps"] = max(life["steps"], m["step"])
            life["tokens"] = max(life["tokens"], m["tokens"])
            self._joins[m["id"]] = max(self._joins.get(m["id"], 0), m.get("joins", 0))

    def learner_tokens(self, learner_id: str) -> int:
        """Tokens this learner processed over every life seen so far."""
        return sum(life["tokens"] for life in self._lives.get(learner_id, []))

    def tokens_processed(self) -> int:
        """Tokens processed by every life of every learner seen so far."""
        return sum(self.learner_tokens(lid) for lid in self._lives)

    def learners(self) -> dict[str, dict]:
        """learner id -> lives (the lives seen, or the syncer's count when it saw more: lives
        before the recording began), lives_seen, steps and tokens over the lives seen."""
        return {
            lid: {"lives": max(len(lives), self._joins.get(lid, 0)), "lives_seen": len(lives),
                  "steps": sum(life["steps"] for life in lives), "tokens": sum(life["tokens"] for life in lives)}
            for lid, lives in sorted(self._lives.items())
        }


def work_series(records: list[dict]) -> tuple[list[int], list[float | None], LifeCounter]:
    """Per record, tokens processed and work merged (tokens merged / (P x tokens processed), None
    before any token), plus the lives counted over all records.

    Tokens processed are the syncer's count (every life of every learner, kept across syncer
    restarts); records without it (syncers that predate the field) sum every life seen up to that
    record, not the current members' counts, which restart at 0 with each life.
    """
    lives = LifeCounter()
    processed_series, share_series = [], []
    for r in records:
        lives.add(r)
        processed = r.get("tokens_processed") or lives.tokens_processed()
        processed_series.append(processed)
        share_series.append(status_derived.work_merged(r["tokens_merged"], len(r["versions"]), processed))
    return processed_series, share_series, lives


def load_run(run_dir: pathlib.Path) -> tuple[list[dict], dict | None]:
    path = run_dir / "state.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory of `ddiloco up` or `ddiloco record`?")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    final = run_dir / "final_state.json"
    return records, json.loads(final.read_text()) if final.exists() else None


def make_plots(run_dir: pathlib.Path, out_dir: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Writes the PNG plots (and an index.md) and returns their paths."""
    from ddiloco import extras

    plt = extras.pyplot()  # the plots extra, Agg backend

    records, final = load_run(run_dir)
    if not records:
        raise ValueError(f"{run_dir / 'state.jsonl'} has no records")
    out_dir = out_dir or run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = records[0]["t"]
    times = [r["t"] - t0 for r in records]
    written = []

    def save(fig, ax, name: str, *, xlabel: str, ylabel: str, title: str, legend: dict | None = None) -> None:
        """Labels the plot, adds a legend (``legend``: its keyword arguments; None: none) and writes it."""
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if legend is not None:
            ax.legend(**legend)
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    # 1. Loss against tokens: the global model (held-out) and each learner's inner loss, against
    # the tokens of every life of that learner (a restarted learner's line goes on, not back to 0).
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for lid, pts in learner_loss_points(records).items():
        if pts:
            ax.plot(*zip(*pts), lw=1, alpha=0.7, label=f"{lid} (inner, its tokens)")
    evals = (final or {}).get("evals", [])
    if evals:
        ax.plot([float(e.get("tokens_merged", 0)) for e in evals], [e["heldout_loss"] for e in evals], "k-o", ms=3,
                lw=2, label="global model, held-out (tokens merged)")
    save(fig, ax, "loss.png", xlabel="tokens", ylabel="loss (nats/token)", title="Loss against tokens",
         legend={"fontsize": 7})

    # 2. Bytes on the wire.
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(times, [r["bytes_in"] / 2**20 for r in records], label="in (uploads)")
    ax.plot(times, [r["bytes_out"] / 2**20 for r in records], label="out (global fragments)")
    save(fig, ax, "bytes.png", xlabel="seconds", ylabel="MiB (cumulative)", title="Bytes on the wire at the syncer",
         legend={})

    # 3. Fragment versions over time.
    fig, ax = plt.subplots(figsize=(7, 4))
    for fid in range(len(records[-1]["versions"])):
        ax.step(times, [r["versions"][fid] if fid < len(r["versions"]) else 0 for r in records], where="post",
                label=f"fragment {fid}")
    save(fig, ax, "versions.png", xlabel="seconds", ylabel="version", title="Global fragment versions",
         legend={"fontsize": 7})

    # 4. Work merged: the share of the learners' work merged into the global model (not the paper's
    # goodput, a share of wall time). Each of the P fragments' contributions carries that
    # fragment's tokens, so fully merged work sums to P x tokens processed, counted over every
    # learner life (work_series).
    fig, ax = plt.subplots(figsize=(7, 4))
    processed_series, share_series, lives = work_series(records)
    share = [float("nan") if v is None else 100 * v for v in share_series]
    ax.plot(times, share)
    ax.set_ylim(0, max([105.0, *(v + 5 for v in share if v == v)]))
    save(fig, ax, "work_merged.png", xlabel="seconds", ylabel="tokens merged / (P x tokens processed), %",
         title="Work merged")

    index = out_dir / "index.md"
    index.write_text(f"# ddiloco run {run_dir.name}\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in written) + "\n\n"
                     + work_summary(records, processed_series[-1], share_series[-1], lives))
    return written


def learner_loss_points(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """learner id -> (tokens over every life so far, inner loss) per record that has a loss."""
    lives = LifeCounter()
    points: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        lives.add(r)
        for m in r["members"]:
            if m["loss"] > 0:
                points.setdefault(m["id"], []).append((lives.learner_tokens(m["id"]), m["loss"]))
    return dict(sorted(points.items()))


def work_summary(records: list[dict], processed: int, share: float | None, lives: LifeCounter) -> str:
    """The index's work figures (markdown): the run's totals and one row per learner, every life counted."""
    last = records[-1]
    instances = sorted({r["instance"] for r in records if r.get("instance")})
    lines = [
        "## Work",
        "",
        f"{len(records)} snapshots over {last['t'] - records[0]['t']:.0f} s"
        + (f" of run `{last['run']}`" if last.get("run") else "")
        + (f", {len(instances)} syncer lives" if len(instances) > 1 else "") + ".",
        "",
        f"- outer steps (merges): {last['outer_steps']:,}; tokens merged: {last['tokens_merged']:,}",
        f"- tokens processed (every life of every learner): {processed:,}",
        f"- work merged (tokens merged / ({max(1, len(last['versions']))} fragments x tokens processed)): "
        f"{status_derived.fmt_share(share)}",
        "",
        "| learner | lives | lives recorded | inner steps (lives recorded) | tokens (lives recorded) |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {lid} | {w['lives']} | {w['lives_seen']} | {w['steps']:,} | {w['tokens']:,} |"
              for lid, w in lives.learners().items()]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Draw a run directory written by `ddiloco up` or `ddiloco record` as PNG plots (loss against tokens, bytes "
        "on the wire, fragment versions, work merged) plus index.md with the run's work figures. Every learner "
        "life counts: a restarted learner's earlier lives add to its tokens and to the tokens processed.")
    parser.add_argument("run_dir", help="a run directory (state.jsonl, final_state.json) written by `ddiloco up` "
                                        "or `ddiloco record`")
    parser.add_argument("--out", default="", help="where to write the PNGs (default RUN_DIR/report)")


def run(args: argparse.Namespace) -> int:
    run_dir = pathlib.Path(args.run_dir)
    try:
        paths = make_plots(run_dir, pathlib.Path(args.out) if args.out else None)
    except (FileNotFoundError, ValueError) as exc:
        print(f"ddiloco report: {exc}")
        return 2
    for p in paths:
        print(p)
    return 0
