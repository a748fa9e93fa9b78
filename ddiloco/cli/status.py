"""`ddiloco status`: polls (or watches) a syncer's training state from another terminal."""

from __future__ import annotations

import argparse
import time

import grpc
from rich.console import Console
from rich.live import Live

from ddiloco.cli import render
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc


def add_arguments(parser: argparse.ArgumentParser, default_target: str) -> None:
    parser.add_argument("--target", default=default_target, help="syncer host:port [env: DDILOCO_TARGET]")
    parser.add_argument("--watch", action="store_true", help="keep watching (streams WatchTrainingState)")
    parser.add_argument("--json", action="store_true", help="print JSON (one line per snapshot)")
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between snapshots with --watch")
    parser.add_argument("--merges", type=int, default=8, help="recent merges to include")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="deadline of each call")


def run(args: argparse.Namespace) -> int:
    console = Console()
    stub = syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(args.target))
    if not args.watch:
        try:
            state = stub.GetTrainingState(
                syncer_pb2.GetTrainingStateRequest(recent_merges=args.merges), timeout=args.timeout_s
            ).state
        except grpc.RpcError as exc:
            console.print(f"[red]syncer {args.target} unavailable:[/] {exc.code().name} {exc.details()}")
            return 2
        if args.json:
            print(render.to_json(state), flush=True)
        else:
            console.print(render.state_renderable(state, target=args.target))
        return 0
    # --watch: stream snapshots; on failure say so and reconnect with capped backoff (no traceback).
    backoff_s = 0.5
    live = None if args.json else Live(console=console, refresh_per_second=4)
    if live is not None:
        live.start()
    try:
        while True:
            try:
                stream = stub.WatchTrainingState(
                    syncer_pb2.WatchTrainingStateRequest(min_interval_s=args.interval_s, recent_merges=args.merges),
                    timeout=3600.0,
                )
                for response in stream:
                    backoff_s = 0.5
                    if args.json:
                        print(render.to_json(response.state), flush=True)
                    else:
                        live.update(render.state_renderable(response.state, target=args.target))
            except grpc.RpcError as exc:
                msg = f"syncer {args.target} unavailable ({exc.code().name}); retrying in {backoff_s:.1f}s"
                if args.json:
                    print(f'{{"error": "{exc.code().name}", "target": "{args.target}"}}', flush=True)
                else:
                    live.update(f"[yellow]{msg}[/]")
                time.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 5.0)
    except KeyboardInterrupt:
        return 0
    finally:
        if live is not None:
            live.stop()
