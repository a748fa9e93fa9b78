"""`ddiloco dashboard`: serves the live web dashboard of a syncer until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from ddiloco import logs
from ddiloco.dashboard.server import Dashboard, parse_bind


def add_arguments(parser: argparse.ArgumentParser, default_target: str) -> None:
    parser.add_argument("--target", default=default_target, help="syncer host:port [env: DDILOCO_TARGET]")
    parser.add_argument("--bind", default="127.0.0.1:8080",
                        help="HOST:PORT of the web server (port 0 picks a free port; 0.0.0.0 exposes it)")
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between polls of the syncer")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="deadline of each GetTrainingState call")
    parser.add_argument("--merges", type=int, default=16, help="recent merges to fetch")
    parser.add_argument("--history", type=int, default=3600, help="snapshots kept for the plots (one per poll)")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR")


def run(args: argparse.Namespace) -> int:
    logs.setup_logging(args.log_level)
    try:
        parse_bind(args.bind)
        dashboard = Dashboard(args.target, bind=args.bind, interval_s=args.interval_s, timeout_s=args.timeout_s,
                              recent_merges=args.merges, history=args.history)
        url = dashboard.start()
    except ValueError as exc:
        print(f"ddiloco dashboard: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"ddiloco dashboard: cannot bind {args.bind}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"dashboard: {url}  (syncer {args.target}; Ctrl-C stops)", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    finally:
        dashboard.stop()
        logging.getLogger(__name__).info("dashboard stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco dashboard", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser, default_target="127.0.0.1:50051")
    return run(parser.parse_args(argv))
