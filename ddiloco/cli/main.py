"""The `ddiloco` console script: dispatches to `up`, `status`, `record`, `report`, `dashboard`, `bench`, `simulate`, `export`, `generate` and the services.

`ddiloco syncer|learner|checkpoint|evaluate ARGS` runs the same code as
`python -m services.<name> ARGS` in a checkout, `python -m ddiloco.services.<name> ARGS` in an
installed wheel (each service parses its own flags; `--help` explains them). Services are imported
lazily by name (ddiloco/cli/service_names.py): the library never imports `services`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

_SERVICES = {
    "syncer": "services.syncer.__main__",
    "learner": "services.learner.__main__",
    "checkpoint": "services.checkpoint.__main__",
    "evaluate": "services.learner.evaluator",
}
# Sub-commands with their own argument parsers (imported lazily): benchmarks, the simulator, export.
_TOOLS = {
    "bench": ("ddiloco.bench.cli", "run a benchmark: quality, perf or goodput (`ddiloco bench --help`)"),
    "simulate": ("ddiloco.sim.cli", "the paper's chaos-engineering goodput simulation (`ddiloco simulate --help`)"),
    "chaos": ("ddiloco.chaos.cli", "fault injection: run or replay a seeded chaos scenario (`ddiloco chaos --help`)"),
    "export": ("ddiloco.cli.export", "write a run's checkpointed global model as model.safetensors + config.json"),
    "generate": ("ddiloco.cli.generate", "print text sampled from a `ddiloco export` directory"),
    "audit": ("ddiloco.cli.audit", "who influenced each merge, from the syncer's --merge-ledger (`ddiloco audit --help`)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--version":
        from ddiloco import build_info

        print(build_info.describe())
        return 0
    if argv and argv[0] in _SERVICES:
        from ddiloco.cli import service_names

        return service_names.load(_SERVICES[argv[0]]).main(argv[1:])
    if argv and argv[0] in _TOOLS:
        return importlib.import_module(_TOOLS[argv[0]][0]).main(argv[1:])
    # Imported here: rich and grpc only when needed; certs imports cryptography (the certificates extra)
    # only when it makes a certificate.
    from ddiloco.cli import certs, record, report, status, store, up
    from ddiloco.dashboard import cli as dashboard

    parser = argparse.ArgumentParser(prog="ddiloco", description="Decoupled DiLoCo as gRPC services.")
    sub = parser.add_subparsers(dest="command", required=True)
    up.add_arguments(sub.add_parser("up", help="run a local multi-learner training on 127.0.0.1",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    status.add_arguments(sub.add_parser("status", help="show a syncer's training state",
                                        formatter_class=argparse.ArgumentDefaultsHelpFormatter),
                         default_target=os.environ.get("DDILOCO_TARGET", "127.0.0.1:50051"))
    record.add_arguments(sub.add_parser("record", help="record any running cluster's training state into a run "
                                        "directory for `ddiloco report` (until Ctrl-C or --duration-s)",
                                        formatter_class=argparse.ArgumentDefaultsHelpFormatter),
                         default_target=os.environ.get("DDILOCO_TARGET", "127.0.0.1:50051"))
    report.add_arguments(sub.add_parser("report", help="plot a run directory of `ddiloco up` or `ddiloco record` "
                                        "(loss, bytes, versions, work merged over every learner life)"))
    dashboard.add_arguments(sub.add_parser("dashboard", help="serve a live web dashboard of a syncer",
                                           formatter_class=argparse.ArgumentDefaultsHelpFormatter),
                            default_target=os.environ.get("DDILOCO_TARGET", "127.0.0.1:50051"))
    certs.add_arguments(sub.add_parser("certs", help="write a development CA plus per-service and per-learner "
                                       "certificates (mutual TLS)", formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    store.add_arguments(sub.add_parser("store", help="operate replicated checkpoint stores: `ddiloco store repair "
                                       "--store A --store B --run-id RUN` copies what each store misses"))
    for name in _SERVICES:
        sub.add_parser(name, help=f"run the {name} service (see `ddiloco {name} --help`)", add_help=False)
    for name, (_, help_text) in _TOOLS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args = parser.parse_args(argv)
    commands = {"up": up, "dashboard": dashboard, "report": report, "record": record, "certs": certs, "store": store}
    return commands.get(args.command, status).run(args)


if __name__ == "__main__":
    sys.exit(main())
