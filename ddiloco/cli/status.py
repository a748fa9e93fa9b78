"""`ddiloco status`: polls (or watches) a syncer's training state from another terminal.

Given any shard of a syncer split into fragment shards, it reads every shard (cli.run_view) and
shows one run, plus a line per shard (a shard that does not answer is shown down).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import grpc
from rich.console import Console
from rich.markup import escape
from rich.live import Live

from ddiloco.cli import render
from ddiloco.cli import run_view
from ddiloco.rpc import security as security_lib
from ddiloco.v1 import syncer_pb2


def add_arguments(parser: argparse.ArgumentParser, default_target: str) -> None:
    parser.add_argument("--target", default=default_target, help="syncer host:port [env: DDILOCO_TARGET]")
    parser.add_argument("--watch", action="store_true", help="keep watching (streams WatchTrainingState)")
    parser.add_argument("--json", action="store_true", help="print JSON (one line per snapshot)")
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between snapshots with --watch")
    parser.add_argument("--merges", type=int, default=8, help="recent merges to include")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="deadline of each call")
    add_security_arguments(parser)


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """TLS and token flags of the read-only tools (plaintext when no CA is given)."""
    env = os.environ
    parser.add_argument("--tls-ca", default=env.get("DDILOCO_TLS_CA", ""),
                        help="TLS: CA bundle to verify the syncer (empty: plaintext) [env: DDILOCO_TLS_CA]")
    parser.add_argument("--tls-cert", default=env.get("DDILOCO_TLS_CERT", ""),
                        help="mutual TLS: a read-only (reader) certificate, e.g. certs/operator.pem "
                             "[env: DDILOCO_TLS_CERT]")
    parser.add_argument("--tls-key", default=env.get("DDILOCO_TLS_KEY", ""), help="its key [env: DDILOCO_TLS_KEY]")
    parser.add_argument("--tls-server-name", default=env.get("DDILOCO_TLS_SERVER_NAME", ""),
                        help="name expected in the syncer's certificate [env: DDILOCO_TLS_SERVER_NAME]")
    parser.add_argument("--auth-token-file", default=env.get("DDILOCO_AUTH_TOKEN_FILE", ""),
                        help="file holding a bearer token (a reader token) [env: DDILOCO_AUTH_TOKEN_FILE]")
    parser.add_argument("--insecure", action="store_true",
                        help="plaintext, explicitly (also what no --tls-ca means; refused together with --tls-*)")


def client_security(args: argparse.Namespace) -> security_lib.ClientSecurity:
    """TLS when --tls-ca is given; otherwise plaintext (a local tool reading a local syncer).
    ValueError for contradictory flags (--insecure with --tls-*, a certificate without its key)."""
    return security_lib.ClientSecurity(
        tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_server_name=args.tls_server_name,
        insecure=args.insecure or not args.tls_ca, auth_token_file=args.auth_token_file,
    )


def _handshake_failed(details: str) -> bool:
    # What grpc-core reports when the TCP connection succeeded but TLS did not (the peer closed
    # it mid-handshake, or the handshake itself failed) -- as opposed to "Connection refused".
    lowered = details.lower()
    return any(s in lowered for s in ("socket closed", "handshake", "ssl", "tls", "certificate", "verification"))


def credentials_problem(exc: grpc.RpcError) -> bool:
    """True when a call failed because of credentials or transport security, not because the
    syncer is down: retrying will not help, the flags must change."""
    code = exc.code()
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return True
    return code == grpc.StatusCode.UNAVAILABLE and _handshake_failed(exc.details() or "")


def explain(exc: grpc.RpcError, security: security_lib.ClientSecurity, target: str) -> str:
    """A one-paragraph message for a failed call, with what to change when it is the credentials."""
    code, details = exc.code(), exc.details() or ""
    state = "unavailable" if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) else "refused"
    text = f"syncer {target} {state}: {code.name} {details}"
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return (f"{text}\nThe syncer refused these credentials. Reading the training state needs a reader "
                "identity: a reader certificate (`ddiloco certs` writes operator.pem/operator.key) via --tls-ca, "
                "--tls-cert and --tls-key, or a reader token via --auth-token-file.")
    if code == grpc.StatusCode.UNAVAILABLE and _handshake_failed(details):
        if security.insecure:
            hint = ("the syncer closed a plaintext connection: it probably serves mutual TLS. Pass --tls-ca, "
                    "--tls-cert and --tls-key with a reader certificate (e.g. certs/operator.pem from `ddiloco certs`)")
        elif not security.tls_cert:
            hint = ("the TLS handshake failed without a client certificate: the syncer requires mutual TLS. Pass "
                    "--tls-cert and --tls-key with a reader certificate")
        else:
            hint = ("the TLS handshake failed: check that the certificate is signed by the syncer's CA and still "
                    "valid, that --tls-server-name matches the syncer's certificate, or use --insecure if the "
                    "syncer serves plaintext")
        return f"{text}\nTLS: {hint}."
    return text


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        security = client_security(args)
        security.check_files()
    except ValueError as exc:
        console.print(f"[red]ddiloco status: {exc}[/]")
        return 2
    reader = run_view.RunReader(args.target, security, timeout_s=args.timeout_s, recent_merges=args.merges)
    if not args.watch:
        try:
            view = reader.read()
        except grpc.RpcError as exc:
            console.print(f"[red]{escape(explain(exc, security, args.target))}[/]")
            return 2
        finally:
            reader.close()
        if args.json:
            print(render.status_json(view.state, view.shards), flush=True)
        else:
            console.print(render.state_renderable(view.state, target=args.target, shards=view.shards))
        return 0
    return _watch(args, console, security, reader)


def _watch(args: argparse.Namespace, console: Console, security: security_lib.ClientSecurity,
           reader: run_view.RunReader) -> int:
    # --watch: stream snapshots; on failure say so and reconnect with capped backoff (no traceback).
    backoff_s = 0.5
    live = None if args.json else Live(console=console, refresh_per_second=4)
    if live is not None:
        live.start()
    try:
        while True:
            try:
                stream = reader.stub(args.target).WatchTrainingState(
                    syncer_pb2.WatchTrainingStateRequest(min_interval_s=args.interval_s, recent_merges=args.merges),
                    timeout=3600.0,
                )
                for response in stream:
                    backoff_s = 0.5
                    view = reader.complete(response.state)  # the other shards, when sharded
                    if args.json:
                        print(render.status_json(view.state, view.shards), flush=True)
                    else:
                        live.update(render.state_renderable(view.state, target=args.target, shards=view.shards))
            except grpc.RpcError as exc:
                if credentials_problem(exc):  # retrying will not help: say what to change and stop
                    if args.json:
                        print(json.dumps({"error": exc.code().name, "target": args.target}), flush=True)
                    else:
                        live.stop()
                        live = None
                    console.print(f"[red]{escape(explain(exc, security, args.target))}[/]")
                    return 2
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
        reader.close()
        if live is not None:
            live.stop()
