"""`ddiloco bench NAME [ARGS]`: dispatches to one benchmark module.

Each module (ddiloco/bench/<name>.py) exposes `add_arguments(parser)` and `run(args) -> int` and
is imported only when asked for, so one benchmark's heavy imports never slow another.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "quality": ("ddiloco.bench.quality", "held-out loss and bytes on the wire: decoupled vs DiLoCo vs data-parallel"),
    "perf": ("ddiloco.bench.perf", "codec, merge, transport and scale throughput against measured machine limits"),
    "goodput": ("ddiloco.bench.goodput", "goodput under one seeded failure schedule: decoupled vs DiLoCo vs dp"),
    "checkpoint": ("ddiloco.bench.checkpoint_cost", "one checkpoint's cost with 1 and 2 stores: commit-before-broadcast "
                   "vs the default cadence"),
    "failover": ("ddiloco.bench.failover", "time without a leading syncer after SIGKILL of the leader (leader election)"),
    "snapshot": ("ddiloco.bench.snapshot", "size and write time of a learner's resume snapshot (--state-dir)"),
    "resume": ("ddiloco.bench.resume", "held-out loss cost of a learner restart, with and without resume"),
    "hostile": ("ddiloco.bench.hostile", "3 honest + 1 hostile learner per behaviour of the chaos tool, shipped defaults"),
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco bench", description="Benchmarks; results under bench/results/.")
    sub = parser.add_subparsers(dest="benchmark", required=True)
    if argv and argv[0] in BENCHMARKS:
        module = importlib.import_module(BENCHMARKS[argv[0]][0])
        p = sub.add_parser(argv[0], help=BENCHMARKS[argv[0]][1], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(p)
        args = parser.parse_args(argv)
        return module.run(args)
    for name, (_, help_text) in BENCHMARKS.items():
        sub.add_parser(name, help=help_text)
    parser.parse_args(argv)  # prints usage / the error
    return 2
