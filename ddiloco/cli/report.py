"""`ddiloco report RUN_DIR`: turns a run's recorded training state into PNG plots.

`ddiloco up` records one compact snapshot of the training state per poll in `state.jsonl` and
the final state in `final_state.json`; this module owns that record format and the plots:
held-out loss of the global model and inner loss per learner against tokens, bytes on the wire,
fragment versions and work merged (tokens merged / (P x tokens processed)) over time.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from ddiloco.v1 import syncer_pb2


def snapshot_record(state: syncer_pb2.TrainingState) -> dict:
    """The compact per-poll record written to state.jsonl."""
    return {
        "t": state.now_unix_s,
        "outer_steps": state.outer_steps,
        "tokens_merged": state.tokens_merged,
        "tokens_processed": state.tokens_processed,
        "bytes_in": state.bytes_in,
        "bytes_out": state.bytes_out,
        "versions": [f.version for f in state.fragments],
        "members": [
            {"id": m.learner_id, "region": m.region, "status": int(m.status), "step": m.local_step,
             "tokens": m.tokens_total, "loss": m.inner_loss}
            for m in state.members
        ],
        "heldout_loss": state.evals[-1].heldout_loss if state.evals else None,
    }


def load_run(run_dir: pathlib.Path) -> tuple[list[dict], dict | None]:
    path = run_dir / "state.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a `ddiloco up` run directory?")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    final = run_dir / "final_state.json"
    return records, json.loads(final.read_text()) if final.exists() else None


def make_plots(run_dir: pathlib.Path, out_dir: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Writes the PNG plots (and an index.md) and returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    records, final = load_run(run_dir)
    if not records:
        raise ValueError(f"{run_dir / 'state.jsonl'} has no records")
    out_dir = out_dir or run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = records[0]["t"]
    times = [r["t"] - t0 for r in records]
    written = []

    def save(fig, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    # 1. Loss against tokens: the global model (held-out) and each learner's inner loss.
    fig, ax = plt.subplots(figsize=(7, 4.5))
    learners = sorted({m["id"] for r in records for m in r["members"]})
    for lid in learners:
        pts = [(m["tokens"], m["loss"]) for r in records for m in r["members"] if m["id"] == lid and m["loss"] > 0]
        if pts:
            ax.plot(*zip(*pts), lw=1, alpha=0.7, label=f"{lid} (inner, its tokens)")
    evals = (final or {}).get("evals", [])
    if evals:
        ax.plot([float(e.get("tokens_merged", 0)) for e in evals], [e["heldout_loss"] for e in evals], "k-o", ms=3,
                lw=2, label="global model, held-out (tokens merged)")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("Loss against tokens")
    ax.legend(fontsize=7)
    save(fig, "loss.png")

    # 2. Bytes on the wire.
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(times, [r["bytes_in"] / 2**20 for r in records], label="in (uploads)")
    ax.plot(times, [r["bytes_out"] / 2**20 for r in records], label="out (global fragments)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB (cumulative)")
    ax.set_title("Bytes on the wire at the syncer")
    ax.legend()
    save(fig, "bytes.png")

    # 3. Fragment versions over time.
    fig, ax = plt.subplots(figsize=(7, 4))
    for fid in range(len(records[-1]["versions"])):
        ax.step(times, [r["versions"][fid] if fid < len(r["versions"]) else 0 for r in records], where="post",
                label=f"fragment {fid}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("version")
    ax.set_title("Global fragment versions")
    ax.legend(fontsize=7)
    save(fig, "versions.png")

    # 4. Work merged: the share of the learners' work merged into the global model (not the paper's
    # goodput, a share of wall time). Each of the P fragments' contributions carries that
    # fragment's tokens, so fully merged work sums to P x tokens processed. Tokens processed are the
    # syncer's count over every learner life; records without it (older syncers) sum the members'.
    fig, ax = plt.subplots(figsize=(7, 4))
    share = []
    for r in records:
        processed = r.get("tokens_processed") or sum(m["tokens"] for m in r["members"])
        share.append(100 * r["tokens_merged"] / (processed * max(1, len(r["versions"]))) if processed else float("nan"))
    ax.plot(times, share)
    ax.set_ylim(0, max([105.0, *(v + 5 for v in share if v == v)]))
    ax.set_xlabel("seconds")
    ax.set_ylabel("tokens merged / (P x tokens processed), %")
    ax.set_title("Work merged")
    save(fig, "work_merged.png")

    index = out_dir / "index.md"
    index.write_text(f"# ddiloco run {run_dir.name}\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in written) + "\n")
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a `ddiloco up` run directory (with state.jsonl)")
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
