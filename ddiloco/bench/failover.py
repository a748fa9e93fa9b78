"""`ddiloco bench failover`: how long a run has no leading syncer when the leader is SIGKILLed.

Real processes on 127.0.0.1 (ddiloco.cli.cluster.LocalCluster): a single-member etcd
(ddiloco/chaos/etcd.py), a checkpoint store, two syncers of one run with leader election
(`--coord-etcd`, every coordination setting at its default: lease 3 s), and learners given both
syncers. Each cycle waits for --merges merges on the leader, SIGKILLs it and measures, from the
kill (wall clock of this process, polling every 50 ms):

  * elected_s: until the standby's training state shows a leader epoch (it won the election and
    restored the committed checkpoint);
  * resumed_s: until the new leader has done --merges merges (learners found it, re-synced and
    contributed again);

then starts the killed syncer again (it comes back as the standby) for the next cycle, which
kills the other one. Results: failover.json and failover.md under --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import signal
import statistics
import time

from ddiloco.bench import results as results_lib
from ddiloco.chaos import etcd as etcd_lib
from ddiloco.cli import cluster as cluster_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from ddiloco.cli import service_names

syncer_config = service_names.load("services.syncer.config")

POLL_S = 0.05
RUN_ID = "bench-failover"
# The tiny transformer, 4 fragments due every 4 steps, learners paced at ~30 ms a step: the
# configuration of the integration tests, so that 2 cores host everything.
SYNCER_ARGS = ["--model-config", json.dumps({"preset": "tiny"}), "--num-fragments", "4", "--sync-period-steps", "4"]
LEARNER_ARGS = ["--step-delay-s", "0.03", "--log-every-steps", "50", "--steps", "1000000"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cycles", type=int, default=5, help="leader kills (the syncers take turns leading)")
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--merges", type=int, default=8, help="merges on the leader before a kill, and after it")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="bound on every wait of a cycle")
    parser.add_argument("--workdir", default="runs/bench-failover", help="processes' logs and data (emptied first)")
    parser.add_argument("--out", default=str(results_lib.DEFAULT_OUT_DIR))


def _state(address: str) -> syncer_pb2.TrainingState | None:
    channel = channel_lib.sync_channel(address)
    try:
        stub = syncer_pb2_grpc.SyncerStub(channel)
        return stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(recent_merges=0), timeout=2).state
    except Exception:  # noqa: BLE001 - a syncer that is down or starting: not yet
        return None
    finally:
        channel.close()


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(POLL_S)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _leader(syncers: list, timeout_s: float):
    def find():
        for svc in syncers:
            state = _state(svc.address) if svc.alive() else None
            if state is not None and state.epoch:
                return svc, state
        return None

    return _wait(find, timeout_s, "a leading syncer")


def _cycle(syncers: list, args: argparse.Namespace) -> dict:
    leader, state = _leader(syncers, args.timeout_s)
    standby = next(s for s in syncers if s is not leader)
    start = state.outer_steps
    _wait(lambda: (s := _state(leader.address)) is not None and s.outer_steps >= start + args.merges,
          args.timeout_s, f"{args.merges} merges on {leader.name}")
    old_epoch = state.epoch
    leader.proc.send_signal(signal.SIGKILL)
    killed = time.time()
    leader.proc.wait(10)
    new_state = _wait(lambda: (s := _state(standby.address)) is not None and s.epoch > old_epoch and s,
                      args.timeout_s, f"{standby.name} leads")
    elected_s = time.time() - killed
    restored = new_state.outer_steps
    _wait(lambda: (s := _state(standby.address)) is not None and s.outer_steps >= restored + args.merges,
          args.timeout_s, f"{args.merges} merges on {standby.name}")
    resumed_s = time.time() - killed
    leader.start()  # back as the standby (it re-binds its port)
    leader.wait_ready(args.timeout_s)
    return {"killed": leader.name, "epoch_before": old_epoch, "epoch_after": new_state.epoch,
            "restored_outer_step": restored, "elected_s": round(elected_s, 3), "resumed_s": round(resumed_s, 3)}


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _markdown(result: dict) -> str:
    rows = [(c["killed"], c["epoch_before"], c["epoch_after"], c["restored_outer_step"], c["elected_s"],
             c["resumed_s"]) for c in result["cycles"]]
    s = result["summary"]
    return "\n".join([
        "# Syncer failover: SIGKILL of the leading syncer",
        "",
        f"{len(rows)} kills, 2 syncers with leader election on a 1-member etcd (lease {result['config']['lease_s']} s, "
        f"the default), {result['config']['learners']} learners, the tiny model. Times are wall clock from the SIGKILL, "
        f"polled every {POLL_S * 1000:.0f} ms: *elected* until the standby leads (won the election, restored the "
        f"committed checkpoint); *resumed* until it has done {result['config']['merges']} merges.",
        "",
        f"Elected: median {s['elected_s']['median']:.2f} s (min {s['elected_s']['min']:.2f}, max "
        f"{s['elected_s']['max']:.2f}); resumed: median {s['resumed_s']['median']:.2f} s (max "
        f"{s['resumed_s']['max']:.2f}). Target: elected < 10 s.",
        "",
        results_lib.markdown_table(["killed", "epoch before", "epoch after", "restored outer step", "elected s",
                                    "resumed s"], rows),
        "",
        results_lib.provenance_markdown(result["provenance"]),
    ])


def run(args: argparse.Namespace) -> int:
    workdir = pathlib.Path(args.workdir).resolve()
    shutil.rmtree(workdir, ignore_errors=True)
    prov = results_lib.provenance()
    cycles = []
    with etcd_lib.running_etcd(workdir / "etcd") as etcd:
        cluster = cluster_lib.LocalCluster(workdir / "cluster")
        try:
            store = cluster.start_store()
            syncers = []
            for name in ("syncer-a", "syncer-b"):
                svc = cluster.add(name, "services.syncer", [
                    "--bind", "127.0.0.1:0", "--run-id", RUN_ID, "--ready-file", str(cluster.workdir / f"{name}.ready.json"),
                    "--checkpoint-target", store.address, "--coord-etcd", etcd.endpoint, *SYNCER_ARGS])
                svc.start()
                svc.wait_ready(args.timeout_s)
                syncers.append(svc)
            targets = ",".join(s.address for s in syncers)
            for i in range(args.learners):
                cluster.add(f"learner-{i}", "services.learner", [
                    "--syncer", targets, "--learner-id", f"learner-{i}", "--region", f"region-{i}",
                    "--num-shards", str(args.learners), "--health-bind", "127.0.0.1:0", *LEARNER_ARGS]).start()
            for i in range(args.cycles):
                cycles.append(_cycle(syncers, args))
                print(f"cycle {i + 1}/{args.cycles}: {cycles[-1]}", flush=True)
        finally:
            cluster.stop_all(timeout_s=15.0)
    result = {
        "provenance": prov,
        "config": {"cycles": args.cycles, "learners": args.learners, "merges": args.merges, "lease_s": syncer_config.SyncerConfig.coord_lease_s,
                   "syncer_args": SYNCER_ARGS, "learner_args": LEARNER_ARGS},
        "cycles": cycles,
        "summary": {"elected_s": _summary([c["elected_s"] for c in cycles]),
                    "resumed_s": _summary([c["resumed_s"] for c in cycles])},
    }
    json_path, md_path = results_lib.write_result(pathlib.Path(args.out), "failover", result, _markdown(result))
    print(f"wrote {json_path} and {md_path}")
    return 0
