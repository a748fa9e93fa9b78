"""`ddiloco dashboard`: serves the live web dashboard of a syncer until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

import grpc

from ddiloco import logs
from ddiloco.cli import status as status_cli
from ddiloco.dashboard.server import Dashboard, parse_bind
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc


def add_arguments(parser: argparse.ArgumentParser, default_target: str) -> None:
    parser.add_argument("--target", default=default_target, help="syncer host:port [env: DDILOCO_TARGET]")
    parser.add_argument("--bind", default="127.0.0.1:8080",
                        help="HOST:PORT of the web server (port 0 picks a free port; 0.0.0.0 exposes it)")
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between polls of the syncer")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="deadline of each GetTrainingState call")
    parser.add_argument("--merges", type=int, default=16, help="recent merges to fetch")
    parser.add_argument("--history", type=int, default=3600, help="snapshots kept for the plots (one per poll)")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR")
    status_cli.add_security_arguments(parser)


def check_credentials(target: str, security, timeout_s: float) -> str | None:
    """One GetTrainingState call: an explanation if the syncer refuses these credentials (or the
    transport), None if it answers or is merely unreachable (the dashboard then waits for it)."""
    channel = channel_lib.sync_channel(target, security)
    try:
        syncer_pb2_grpc.SyncerStub(channel).GetTrainingState(
            syncer_pb2.GetTrainingStateRequest(recent_merges=0), timeout=timeout_s)
    except grpc.RpcError as exc:
        return status_cli.explain(exc, security, target) if status_cli.credentials_problem(exc) else None
    finally:
        channel.close()
    return None


def run(args: argparse.Namespace) -> int:
    logs.setup_logging(args.log_level)
    try:
        parse_bind(args.bind)
        security = status_cli.client_security(args)
        security.check_files()
        # Wrong credentials never fix themselves: refuse to serve a page that could only say so.
        problem = check_credentials(args.target, security, args.timeout_s)
        if problem is not None:
            print(f"ddiloco dashboard: {problem}", file=sys.stderr)
            return 2
        dashboard = Dashboard(args.target, bind=args.bind, interval_s=args.interval_s, timeout_s=args.timeout_s,
                              recent_merges=args.merges, history=args.history, security=security)
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
