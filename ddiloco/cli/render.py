"""Renders a TrainingState for humans (rich tables) and for machines (JSON)."""

from __future__ import annotations

import time

import json

from google.protobuf import json_format
from rich.console import Group
from rich.table import Table

from ddiloco import training_state as status_derived
from ddiloco.v1 import syncer_pb2

_STATUS = {
    syncer_pb2.MemberState.STATUS_ACTIVE: "[green]active[/]",
    syncer_pb2.MemberState.STATUS_SILENT: "[yellow]silent[/]",
    syncer_pb2.MemberState.STATUS_LEFT: "[dim]left[/]",
}


def to_json(state: syncer_pb2.TrainingState) -> str:
    """The TrainingState alone, in proto JSON (json_format.Parse reads it back)."""
    return json_format.MessageToJson(state, preserving_proto_field_name=True, indent=None)


def status_json(state: syncer_pb2.TrainingState, shards=()) -> str:
    """`ddiloco status --json`: the TrainingState in proto JSON (uint64 as strings), every fragment
    with its `round` and `round_open` even when 0/false, plus `derived` (status_derived.derived:
    tokens_processed, work_merged as a 0-1 share, merge_participation). For a sharded syncer
    `state` is the merged run view and `shards` (run_view.ShardView) adds `shard_status`, one entry
    per shard (up or down, its instance, epoch, outer steps, checkpoint)."""
    out = json_format.MessageToDict(state, preserving_proto_field_name=True)
    for f in out.get("fragments", []):
        f.setdefault("round", "0")
        f.setdefault("round_open", False)
    for m in out.get("members", []):
        if m.get("num_data_shards"):  # shard 0 is a shard (proto JSON leaves zeros out)
            m.setdefault("data_shard", 0)
            m.setdefault("data_shard_assigned", False)
    out["derived"] = status_derived.derived(state)
    if shards:
        out["shard_status"] = [s.as_dict() for s in shards]
        # Totals (and work merged) over the shards that answered only: how many did not.
        out["derived"]["shards_down"] = sum(1 for s in shards if not s.up)
    return json.dumps(out, separators=(",", ":"))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def influence_cells(influence: syncer_pb2.LearnerInfluence | None) -> tuple[str, str, str]:
    """The learners table's share, capped and clipped cells (TrainingState.influence)."""
    if influence is None or not influence.merges:
        return "-", "-", "-"
    capped = f"[yellow]{influence.share_capped}[/]" if influence.share_capped else "0"
    return (f"{influence.mean_share:.2f} ({influence.max_share:.2f})", capped, str(influence.clipped))


def shards_table(shards) -> Table:
    """One line per fragment shard (run_view.ShardView): where it is, what it owns, up or down."""
    table = Table(title="syncer shards")
    for col in ("shard", "address", "fragments", "state", "instance", "epoch", "outer steps", "checkpoint"):
        table.add_column(col)
    for s in shards:
        frags = ",".join(str(f) for f in s.fragment_ids)
        if s.state is None:
            table.add_row(str(s.index), " | ".join(s.addresses), frags, "[red]down[/]", "-", "-", "-",
                          s.error[:60])
            continue
        st = s.state
        table.add_row(str(s.index), s.address, frags, "[green]up[/]", st.syncer_instance[:8], str(st.epoch),
                      str(st.outer_steps),
                      f"@ {st.last_checkpoint_outer_step}" + (" (restored)" if st.restored_from_checkpoint else ""))
    return table


def state_renderable(state: syncer_pb2.TrainingState, *, target: str = "", shards=()):
    """A rich renderable: run summary, learners, fragments and recent merges; for a sharded syncer
    (`state` the merged run view, `shards` its run_view.ShardView lines) the shards too."""
    now = state.now_unix_s or time.time()
    last_eval = f"{state.evals[-1].heldout_loss:.4f}" if state.evals else "-"
    first_eval = f"{state.evals[0].heldout_loss:.4f}" if state.evals else "-"
    d = status_derived.derived(state)
    head = Table.grid(padding=(0, 2))
    syncer = f"syncer {target or state.syncer_instance[:8]}"
    partial = ""  # the run's totals miss a down shard's part
    if shards:
        up = sum(1 for s in shards if s.up)
        syncer += f" ({len(shards)} shards, " + (f"{up} up)" if up == len(shards) else f"[red]{up} up[/])")
        partial = "" if up == len(shards) else f" [red](partial: {len(shards) - up} shard(s) down)[/]"
    head.add_row(
        f"run [bold]{state.run_id}[/]", syncer,
        f"outer steps [bold]{state.outer_steps}[/]", f"tokens merged {state.tokens_merged:,}",
    )
    head.add_row(
        f"work merged [bold]{status_derived.fmt_share(d['work_merged'])}[/]{partial}",
        f"tokens processed {d['tokens_processed']:,} x P={d['num_fragments']}"
        + (" (members, this life)" if d["tokens_processed_source"] == "members" else "")
        + (f" of budget {state.token_budget:,}" if state.token_budget else ""),
        f"contributors/merge {status_derived.fmt_participation(d['merge_participation'])}", "",
    )
    head.add_row(
        f"held-out loss {first_eval} -> [bold]{last_eval}[/]",
        f"bytes in {human_bytes(state.bytes_in)} / out {human_bytes(state.bytes_out)}",
        f"grace {state.grace_window_s:.2f}s (step {state.step_time_s:.2f}s)",
        f"checkpoint @ {state.last_checkpoint_outer_step}" + (" (restored)" if state.restored_from_checkpoint else ""),
    )
    members = Table(title="learners", expand=False)
    window = max((i.window_merges for i in state.influence), default=0)
    for col in ("learner", "region", "status", "shard", "step", "loss", "step s", "accepted", "rejected",
                "share", "capped", "clipped", "last seen"):
        members.add_column(col, justify="right" if col not in ("learner", "region", "status") else "left")
    influence = {i.learner_id: i for i in state.influence}
    for m in state.members:
        members.add_row(
            m.learner_id, m.region, _STATUS.get(m.status, "?"),
            f"{m.data_shard}/{m.num_data_shards}" if m.num_data_shards else "-",  # shard of shards
            str(m.local_step), f"{m.inner_loss:.3f}",
            f"{m.step_time_s:.2f}", str(m.uploads_accepted), str(m.uploads_rejected),
            *influence_cells(influence.get(m.learner_id)),
            f"{max(0.0, now - m.last_seen_unix_s):.1f}s ago" if m.last_seen_unix_s else "-",
        )
    if window:
        members.caption = (f"of the last {window} merges, those a learner was in: share, its mean (largest) "
                           "share of their weight; capped, clipped: how many capped its share, clipped its contribution")
    frags = Table(title="fragments")
    owner = {f: s.index for s in shards for f in s.fragment_ids}  # fragment -> its shard (sharded only)
    for col in ("id", "version", "round", "params", "pending", "sha256", *(("shard",) if shards else ())):
        frags.add_column(col)
    for f in state.fragments:
        rnd = f"{f.round} [green]open[/]" if f.round_open else f"{f.round} [dim]closed[/]"
        frags.add_row(str(f.fragment_id), str(f.version), rnd, f"{f.numel:,}", str(f.pending_contributions),
                      f.params_sha256[:12], *((str(owner.get(f.fragment_id, "-")),) if shards else ()))
    parts = [head, *([shards_table(shards)] if shards else []), members, frags]
    if state.recent_merges:
        merges = Table(title="recent merges")
        for col in ("fragment", "version", "round", "held/expected", "contributors", "quorum s",
                    "grace used/window s", "reason"):
            merges.add_column(col)
        for r in list(state.recent_merges)[-6:]:
            who = ", ".join(f"{c.learner_id}(w={c.weight:.3g})" for c in r.contributors)
            held = f"{len(r.contributors)}/{r.expected_contributors}" if r.expected_contributors else str(len(r.contributors))
            merges.add_row(str(r.fragment_id), str(r.version), str(r.round) if r.round else "-", held, who,
                           f"{r.quorum_wait_s:.2f}", f"{r.grace_used_s:.2f}/{r.grace_window_s:.2f}", r.reason)
        parts.append(merges)
    return Group(*parts)
