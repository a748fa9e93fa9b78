"""`ddiloco chaos`: run, replay and generate fault-injection scenarios; run a fault proxy by hand.

    ddiloco chaos list                                         the named scenarios
    ddiloco chaos run --scenario soak --seed 1 --out runs/chaos
    ddiloco chaos replay runs/chaos/soak-seed1/faults.jsonl    the same faults, same configuration
    ddiloco chaos schedule --seed 7 --duration-s 120 --mtbf-s 5 --out faults.jsonl
    ddiloco chaos proxy --upstream 127.0.0.1:50051 --listen 127.0.0.1:50061 --latency-ms 200

`run` and `replay` first run the fault-free twin of the scenario (same seed and training, no
faults) for I5 unless `--no-baseline` or `--baseline-loss X` is given, print one report line
per run, write report.json / report.txt / faults.jsonl / histories / logs under --out, and exit 0
when every invariant held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import pathlib
import signal
import sys


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/chaos", help="directory for the run's files (one sub-directory per run)")
    p.add_argument("--baseline-loss", type=float, default=None,
                   help="I5 reference: the fault-free final held-out loss (skips running the baseline)")
    p.add_argument("--no-baseline", action="store_true", help="do not run the fault-free twin (I5 is skipped)")
    p.add_argument("--steps", type=int, default=None, help="override inner steps per learner")
    p.add_argument("--jax-cache", default="", help="JAX compilation cache shared by the services "
                   "(default: <out>/.jax-cache)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the report lines")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="list the named scenarios")
    run = sub.add_parser("run", help="run a named scenario", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run.add_argument("--scenario", default="soak", help="scenario name (`ddiloco chaos list`)")
    run.add_argument("--seed", type=int, default=1)
    _add_run_options(run)
    replay = sub.add_parser("replay", help="replay a faults.jsonl (its header holds the scenario)",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    replay.add_argument("faults", help="a faults.jsonl written by a run or by `schedule`")
    _add_run_options(replay)
    sched = sub.add_parser("schedule", help="write a seeded kill-loop schedule (faults.jsonl) without running it",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sched.add_argument("--seed", type=int, default=1)
    sched.add_argument("--duration-s", type=float, default=120.0)
    sched.add_argument("--mtbf-s", type=float, default=5.0, help="mean time between failures")
    sched.add_argument("--learners", type=int, default=3)
    sched.add_argument("--no-network", action="store_true", help="process faults only (no link faults)")
    sched.add_argument("--scenario", default="soak", help="the scenario configuration to store in the header")
    sched.add_argument("--out", default="-", help="file to write, or - for stdout")
    proxy = sub.add_parser("proxy", help="run a FaultProxy in the foreground (Ctrl-C stops it)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    proxy.add_argument("--upstream", required=True, help="host:port to forward to")
    proxy.add_argument("--listen", default="127.0.0.1:0", help="host:port to listen on")
    proxy.add_argument("--latency-ms", type=float, default=0.0)
    proxy.add_argument("--jitter-ms", type=float, default=0.0)
    proxy.add_argument("--bandwidth-bytes-per-s", type=float, default=0.0, help="0: unlimited")
    proxy.add_argument("--slice-bytes", type=int, default=0)
    proxy.add_argument("--flap-down-s", type=float, default=0.0)
    proxy.add_argument("--flap-up-s", type=float, default=0.0)


def _run_one(scenario, events, out: pathlib.Path, args, *, baseline_loss: float | None):
    from ddiloco.chaos import harness

    jax_cache = pathlib.Path(args.jax_cache) if args.jax_cache else out.parent / ".jax-cache"
    on_event = (lambda line: None) if args.quiet else (lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    result = harness.run_scenario(scenario, events, out, baseline_loss=baseline_loss, jax_cache_dir=jax_cache,
                                  on_event=on_event)
    print(result.report_line, flush=True)
    for violation in result.violations()[:20]:
        print(f"  violation: {violation}", flush=True)
    return result


def _run(scenario, events, args) -> int:
    out_root = pathlib.Path(args.out)
    if args.steps:
        scenario = dataclasses.replace(scenario, steps=args.steps)
    baseline_loss = args.baseline_loss
    if baseline_loss is None and not args.no_baseline:
        # The fault-free twin: the same training and pacing, no faults.
        twin = scenario.fault_free()
        base = _run_one(twin, [], out_root / f"{twin.name}-seed{twin.seed}", args, baseline_loss=None)
        if not base.ok or base.loss is None:
            print("the fault-free baseline failed; not running the scenario", file=sys.stderr)
            return 1
        baseline_loss = base.loss
    result = _run_one(scenario, events, out_root / f"{scenario.name}-seed{scenario.seed}", args,
                      baseline_loss=baseline_loss)
    return 0 if result.ok else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco chaos", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from ddiloco.chaos import scenarios
    from ddiloco.chaos import schedule as schedule_lib

    if args.action == "list":
        for name in scenarios.SCENARIOS:
            print(f"{name:22s} {scenarios.describe(name)}")
        return 0
    if args.action == "run":
        try:
            scenario, events = scenarios.build(args.scenario, args.seed)
        except ValueError as exc:
            parser.error(str(exc))
        return _run(scenario, events, args)
    if args.action == "replay":
        from ddiloco.chaos.config import Scenario

        loaded = schedule_lib.FaultSchedule.load(args.faults)
        if not loaded.scenario:
            parser.error(f"{args.faults} has no header with the scenario; it cannot be replayed")
        return _run(Scenario.from_dict(loaded.scenario), loaded.events, args)
    if args.action == "schedule":
        scenario, _ = scenarios.build(args.scenario, args.seed)
        scenario = dataclasses.replace(scenario, learners=args.learners)
        events = schedule_lib.kill_loop(seed=args.seed, duration_s=args.duration_s, mtbf_s=args.mtbf_s,
                                        learners=args.learners, network=not args.no_network)
        sched = schedule_lib.FaultSchedule(events=events, seed=args.seed, scenario=scenario.to_dict())
        if args.out == "-":
            print(json.dumps({"kind": "header", "seed": sched.seed, "scenario": sched.scenario}, sort_keys=True))
            for e in sched.events:
                print(json.dumps(e.to_json(), sort_keys=True))
        else:
            sched.save(args.out)
            print(f"{len(events)} faults ({', '.join(f'{k} {v}' for k, v in sorted(sched.counts().items()))}) "
                  f"-> {args.out}")
        return 0
    return _proxy(args)


def _proxy(args) -> int:
    from ddiloco.chaos.proxy import FaultProxy

    up_host, _, up_port = args.upstream.rpartition(":")
    host, _, port = args.listen.rpartition(":")

    async def serve() -> None:
        proxy = FaultProxy(host or "127.0.0.1", up_host or "127.0.0.1", int(up_port), listen_port=int(port or 0))
        await proxy.start()
        proxy.set(latency_s=args.latency_ms / 1000, jitter_s=args.jitter_ms / 1000,
                  bandwidth_bytes_per_s=args.bandwidth_bytes_per_s, slice_bytes=args.slice_bytes,
                  flap_down_s=args.flap_down_s, flap_up_s=args.flap_up_s)
        print(f"fault proxy {proxy.address} -> {args.upstream} ({proxy.toxics})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await proxy.stop()
        print(f"stats: {dataclasses.asdict(proxy.stats)}", flush=True)

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
