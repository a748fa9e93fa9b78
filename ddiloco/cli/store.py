"""`ddiloco store repair`: brings replicated checkpoint stores up to date with each other, once.

Each `--store` gets every blob its peers' retained manifests of `--run-id` reference, then those
manifests (ddiloco.checkpoint_replicas); what was copied is printed per store. The same pass the
syncer runs in the background with several --checkpoint-target stores; this one is for an
operator who rebuilt a store's volume, or for runs whose syncer is stopped. Writing manifests
needs the `syncer` identity (its certificate or token) under mutual TLS or tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys

from ddiloco import checkpoint_client as checkpoint_client_lib
from ddiloco import checkpoint_replicas as replicas_lib
from ddiloco.cli import status as status_lib
from ddiloco.rpc import channel as channel_lib


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="store_command", required=True)
    repair = sub.add_parser("repair", help="copy what each store misses from its peers (blobs, then manifests)",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    repair.add_argument("--store", action="append", required=True, metavar="HOST:PORT",
                        help="a checkpoint store (repeat, at least twice; or one comma list)")
    repair.add_argument("--run-id", action="append", required=True, help="a run to repair (repeat for several)")
    repair.add_argument("--max-bytes", type=int, default=0,
                        help="copy at most this many blob bytes per store (0: everything; run again to continue)")
    repair.add_argument("--timeout-s", type=float, default=600.0, help="give up after this long")
    status_lib.add_security_arguments(repair)


def run(args: argparse.Namespace) -> int:
    targets = [t.strip() for entry in args.store for t in entry.split(",") if t.strip()]
    if len(targets) < 2:
        print("ddiloco store repair: give at least two --store addresses (a store repairs from its peers)",
              file=sys.stderr)
        return 2
    try:
        security = status_lib.client_security(args)
        reports = asyncio.run(asyncio.wait_for(_repair(targets, args, security), args.timeout_s))
    except ValueError as exc:
        print(f"ddiloco store repair: {exc}", file=sys.stderr)
        return 2
    except asyncio.TimeoutError:
        print(f"ddiloco store repair: not done after {args.timeout_s:.0f} s; run it again to continue",
              file=sys.stderr)
        return 1
    for report in reports:
        print(report.summary())
    return 0 if all(r.complete and not r.errors for r in reports) else 1


async def _repair(targets: list[str], args: argparse.Namespace, security) -> list[replicas_lib.RepairReport]:
    channels = {t: channel_lib.aio_channel(t, security) for t in targets}
    try:
        stores = {t: checkpoint_client_lib.CheckpointClient(
            ch, timeout=datetime.timedelta(seconds=10), retry_timeout=datetime.timedelta(seconds=5))
            for t, ch in channels.items()}
        client = replicas_lib.ReplicatedCheckpointClient(stores, write_quorum=1)
        return await client.repair(args.run_id, max_bytes=args.max_bytes or None)
    finally:
        for ch in channels.values():
            await ch.close()
