"""`ddiloco up`: a local multi-learner run on 127.0.0.1 with live progress and a summary.

Starts a checkpoint store, a syncer, an evaluator and N learners as separate processes (logs
under <workdir>/logs), shows the training state live, and when the learners finish evaluates the
final global model, prints a summary and shuts everything down (the syncer writes a last
checkpoint). Ctrl-C stops everything cleanly at any time.

With `--syncer-shards N` (N > 1) the syncer is N processes, each owning every N-th fragment
(fragment shards, docs/deploy.md): the learners and the evaluator are given shard 0 and find the
others in its answers; the live table and the summary show the run over every shard.

With `--syncer-replicas N` (N > 1) the syncer is N instances of one run with failover
(docs/failover.md): `up` starts a single-member etcd for the run (logs/etcd-0.log, data under
<workdir>/etcd), the instances elect their leader through it, and the learners and the evaluator
are given every instance and follow the leader. Both together: every shard has N instances and
its own leader (`syncer`, `syncer-b` for shard 0, `syncer-1`, `syncer-1-b` for shard 1, ...), and
learners are given shard 0's instances. With `--tls` etcd serves https only to client
certificates of its own CA (<workdir>/certs/etcd-ca.pem, `ddiloco certs --etcd-names`) and its
peer URL over TLS; the syncers get the etcd client certificate (--coord-tls-*).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
from rich.console import Console
from rich.live import Live
from rich.markup import escape

from ddiloco.cli import service_names
from ddiloco.cli import cluster as cluster_lib
from ddiloco.cli import render
from ddiloco.cli import report as report_lib
from ddiloco.cli import run_view
from ddiloco import models
from ddiloco import run_description
from ddiloco import training_state as status_derived
from ddiloco.data import corpus
from ddiloco.data import sources as data_sources


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--learners", type=int, default=4, help="number of learner processes")
    parser.add_argument("--steps", type=int, default=160, help="inner steps per learner")
    parser.add_argument("--preset", default="small", help="transformer preset (small, tiny)")
    parser.add_argument("--model", default="transformer",
                        help="the model: transformer, an installed ddiloco.models plugin, or package.module:factory "
                             "(imported from the current directory or PYTHONPATH; docs/models.md)")
    parser.add_argument("--model-config", default="",
                        help="the model's config as a JSON object (transformer: merged over --preset)")
    parser.add_argument("--num-fragments", type=int, default=4, help="P")
    parser.add_argument("--sync-period-steps", type=int, default=8, help="H")
    parser.add_argument("--min-quorum", type=int, default=1, help="K")
    parser.add_argument("--upload-codec", default="int4", help="fp32, bf16, int8, int4 or int2")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per inner step")
    parser.add_argument("--eval-interval-s", type=float, default=20.0, help="seconds between held-out evaluations")
    parser.add_argument("--workdir", default="", help="logs, store and summaries (default runs/<time>)")
    parser.add_argument("--compilation-cache-dir", default="runs/jax-cache",
                        help="the learners' shared XLA compilation cache (the next run starts faster); empty: off")
    parser.add_argument("--summary-json", default="", help="also write the summary here")
    parser.add_argument("--no-live", action="store_true", help="print one status line every few seconds instead")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="give up after this long")
    parser.add_argument("--tls", action="store_true",
                        help="mutual TLS everywhere: a development CA and certificates under <workdir>/certs")
    parser.add_argument("--checkpoint-stores", type=int, default=1,
                        help="checkpoint store processes; 2 or more: every checkpoint is replicated to all of them "
                             "(write quorum 2) and a store that loses its data is repaired from the others")
    parser.add_argument("--syncer-shards", type=int, default=1,
                        help="syncer processes splitting the fragments between them (fragment shards: shard i owns "
                             "fragments f with f mod N = i; at most --num-fragments); 1: one syncer")
    parser.add_argument("--syncer-replicas", type=int, default=1,
                        help="syncer instances of the run with failover: a local etcd is started and one instance "
                             "leads, the others stand by and take over when it goes (with --tls, etcd requires "
                             "client certificates); with --syncer-shards, this many instances of every shard, each "
                             "shard electing its own leader; 1: one syncer, no etcd")
    parser.add_argument("--dashboard", action="store_true", help="also serve the live web dashboard (prints its URL)")
    parser.add_argument("--dashboard-bind", default="127.0.0.1:8080",
                        help="HOST:PORT of the dashboard (a free port is used if this one is taken)")
    data = parser.add_argument_group("data", "what the learners train on and the evaluator measures (docs/data.md)")
    data.add_argument("--data-dir", default="",
                      help="a directory of text files (recursive, any extension; binary and hidden files skipped), "
                           "a .bin token file, or a nanoGPT directory with train.bin (+ val.bin, meta.json); "
                           "empty: the Python standard library sources")
    data.add_argument("--data-source", default="",
                      help="instead of --data-dir: package.module:factory returning an iterable of texts or token-id "
                           "arrays (imported from the current directory or PYTHONPATH)")
    data.add_argument("--heldout-dir", default="",
                      help="evaluate on this held-out data (a directory of text files, or a .bin token file) instead "
                           "of --heldout-fraction of the data")
    data.add_argument("--heldout-fraction", type=float, default=0.05,
                      help="fraction of the documents (of the tokens, for a token file without val.bin) held out")
    data.add_argument("--token-dtype", default="",
                      help="uint16 or uint32: the element type of .bin token files; empty: meta.json's dtype, else uint16")
    data.add_argument("--max-corpus-bytes", type=int, default=corpus.DEFAULT_MAX_BYTES,
                      help="read at most this many bytes of training data (a warning says when it truncates)")
    data.add_argument("--vocab-size", type=int, default=0,
                      help="the model's vocabulary; 0: from the data (256 for text; for tokens the largest id + 1, or "
                           "meta.json's vocab_size, rounded up to a multiple of 64)")


def _prepare_data(console: Console, args: argparse.Namespace) -> tuple[list[str], int, data_sources.DataSpec, str]:
    """Loads the data here once, as each learner and the evaluator will: bad flags or unusable data
    are refused before any process starts, and the user sees what each shard holds and any warning.

    Returns the services' data flags, the model's vocabulary size, the spec and the loss unit.
    Raises ValueError or OSError with the reason.
    """
    # The services run in the workdir: they get absolute paths.
    spec = data_sources.DataSpec(
        data_dir=os.path.abspath(args.data_dir) if args.data_dir else "", data_source=args.data_source,
        heldout_dir=os.path.abspath(args.heldout_dir) if args.heldout_dir else "", token_dtype=args.token_dtype,
        max_bytes=args.max_corpus_bytes, heldout_fraction=args.heldout_fraction, num_shards=args.learners,
    )
    if spec.data_source and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as the services will import it (see _services_env)
    logging.getLogger("ddiloco.data").setLevel(logging.ERROR)  # its warnings are printed below, once
    split = data_sources.load(spec)
    vocab_size = args.vocab_size or data_sources.suggested_vocab_size(split)
    data_sources.check_vocabulary(split, vocab_size)
    # soft_wrap: paths are printed whole (copyable), not folded at the terminal width.
    console.print(f"data: {escape(split.source)}" + ("" if split.byte_level else f"; model vocab_size {vocab_size:,}"),
                  soft_wrap=True)
    for line in split.summary_lines():
        console.print(f"  {escape(line)}", soft_wrap=True)
    for warning in split.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)
    flags = ["--max-corpus-bytes", str(spec.max_bytes), "--heldout-fraction", repr(spec.heldout_fraction)]
    for name in ("data_dir", "data_source", "heldout_dir", "token_dtype"):
        if getattr(spec, name):
            flags += ["--" + name.replace("_", "-"), getattr(spec, name)]
    return flags, vocab_size, spec, "nats/byte" if split.byte_level else "nats/token"


def _model_config(args: argparse.Namespace, vocab_size: int) -> str:
    """The syncer's --model-config: for the built-in transformer the preset, the vocabulary the
    data needs (256: bytes, the preset's) and the user's overrides; for a plugin, the user's."""
    overrides = run_description.model_config_from_json(args.model_config, "--model-config")
    if args.model != "transformer":
        return json.dumps(overrides)
    return json.dumps({"preset": args.preset, **({"vocab_size": vocab_size} if vocab_size != 256 else {}), **overrides})


def _check_model(args: argparse.Namespace, vocab_size: int) -> None:
    """Builds the model here once, as every service will: an unknown name, a plugin that does not
    import or a bad config fails before anything starts."""
    if ":" in args.model and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as the services will import it (see _services_env)
    models.get_model(args.model, json.loads(_model_config(args, vocab_size)))


def _services_env(spec: data_sources.DataSpec, model: str = "transformer") -> dict[str, str] | None:
    """The services' environment: a --data-source module or a `module:factory` model is importable
    from the directory `up` runs in (the services run in the workdir)."""
    if not spec.data_source and ":" not in model:
        return None
    env = dict(os.environ)
    env["PYTHONPATH"] = os.getcwd() + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _view(reader: run_view.RunReader) -> run_view.RunView | None:
    """The run's state over every syncer shard (None while shard 0, the one asked, does not answer)."""
    try:
        return reader.read()
    except grpc.RpcError:
        return None


def _final_eval(cluster: cluster_lib.LocalCluster, args, data_flags: list[str]) -> float | None:
    """Evaluates the final global parameters once (a separate evaluator process, bounded)."""
    cmd = [sys.executable, "-m", service_names.module("services.learner.evaluator"), "--once", "--syncer",
           cluster.syncer_target(), "--num-shards", str(args.learners), "--log-level", "WARNING",
           *data_flags, *cluster.tls_args("evaluator")]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cluster.env, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])["heldout_loss"]
    except (subprocess.SubprocessError, ValueError, IndexError, KeyError):
        return None


def _start_dashboard(console: Console, target: str, bind: str, security=None):
    """The web dashboard in background threads of this process (reading with `security`, the
    cluster's read-only credential under --tls); None if it cannot start."""
    import logging

    from ddiloco.dashboard import Dashboard

    # The page shows the syncer's availability; warnings on stderr would garble the live table.
    logging.getLogger("ddiloco.dashboard").setLevel(logging.ERROR)
    try:
        dashboard = Dashboard(target, bind=bind, security=security)
        try:
            url = dashboard.start()
        except OSError as exc:
            host = bind.rpartition(":")[0] or "127.0.0.1"
            console.print(f"[yellow]dashboard: cannot bind {bind} ({exc.strerror or exc}); using a free port[/]")
            dashboard = Dashboard(target, bind=f"{host}:0", security=security)
            url = dashboard.start()
    except (OSError, ValueError) as exc:
        console.print(f"[red]dashboard not started: {exc}[/]")
        return None
    console.print(f"dashboard on [bold]{url}[/]")
    return dashboard


class _Interrupt:
    """SIGINT/SIGTERM handler: Ctrl-C while starting aborts the start; during training it ends the
    loop, and the summary is printed before everything is shut down."""

    def __init__(self) -> None:
        self.interrupted = False
        self.in_main_loop = False

    def __call__(self, *_) -> None:
        self.interrupted = True
        if not self.in_main_loop:
            raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        data_flags, vocab_size, data_spec, loss_unit = _prepare_data(console, args)
    except (ValueError, OSError) as exc:
        console.print(f"[red]data: {escape(str(exc))}[/]", soft_wrap=True)
        return 2
    try:
        _check_model(args, vocab_size)
    except ValueError as exc:
        console.print(f"[red]model: {escape(str(exc))}[/]", soft_wrap=True)
        return 2
    workdir = pathlib.Path(args.workdir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    cluster = cluster_lib.LocalCluster(workdir, env=_services_env(data_spec, args.model), tls=getattr(args, "tls", False))
    run_id = f"up-{time.strftime('%Y%m%d-%H%M%S')}"
    interrupt = _Interrupt()
    dashboard = None
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    started = time.monotonic()
    try:
        console.print(f"[bold]ddiloco up[/]: {args.learners} learners x {args.steps} steps; logs in {workdir}/logs")
        _start_syncer(console, args, cluster, run_id, vocab_size)
        if args.dashboard:
            dashboard = _start_dashboard(console, cluster.syncer_target(), args.dashboard_bind, cluster.client_security())
        _start_workers(args, cluster, data_flags)
        reader = run_view.RunReader(cluster.syncer_target(), cluster.client_security(), recent_merges=8)
        interrupt.in_main_loop = True
        _follow(console, args, cluster, reader, cluster.syncer_target(), workdir, started, interrupt)
        failed = [s.name for s in cluster.learners() if s.proc.returncode not in (0, None)]
        final_loss = None if interrupt.interrupted else _final_eval(cluster, args, data_flags)
        view = _view(reader)
        reader.close()
        state = view.state if view is not None else None
        if state is not None:
            (workdir / "final_state.json").write_text(render.to_json(state))
        summary = _summary(state, final_loss, cluster, time.monotonic() - started)
        summary["data"], summary["loss_unit"] = data_spec.describe(), loss_unit
        _print_summary(console, summary, interrupt.interrupted, failed)
        if args.summary_json:
            pathlib.Path(args.summary_json).write_text(json.dumps(summary, indent=2))
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        console.print(f"plots: ddiloco report {workdir}")
        return 1 if failed or interrupt.interrupted else 0
    except cluster_lib.ServiceStartError as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    except KeyboardInterrupt:
        console.print("interrupted while starting; shutting down")
        return 130
    finally:
        if dashboard is not None:
            dashboard.stop()
        cluster.stop_all()


def _start_syncer(console: Console, args: argparse.Namespace, cluster: cluster_lib.LocalCluster, run_id: str,
                  vocab_size: int):
    """Starts the checkpoint stores and the syncer (or its fragment shards), and says how to watch
    it; returns the syncer (shard 0)."""
    if args.checkpoint_stores < 1:
        raise cluster_lib.ServiceStartError("--checkpoint-stores must be 1 or more")
    shards = getattr(args, "syncer_shards", 1)
    if not 1 <= shards <= args.num_fragments:
        raise cluster_lib.ServiceStartError(
            f"--syncer-shards must be between 1 and --num-fragments ({args.num_fragments}): every shard owns a fragment")
    replicas = getattr(args, "syncer_replicas", 1)
    if replicas < 1:
        raise cluster_lib.ServiceStartError(f"--syncer-replicas must be 1 or more, got {replicas}")
    for index in range(args.checkpoint_stores):
        cluster.start_store(index=index)
    extra = ["--model", args.model, "--model-config", _model_config(args, vocab_size),
             "--num-fragments", str(args.num_fragments),
             "--sync-period-steps", str(args.sync_period_steps), "--min-quorum", str(args.min_quorum),
             "--upload-codec", args.upload_codec]
    if replicas > 1:
        etcd = cluster.start_etcd()
        syncers = cluster.start_syncer_replicas(replicas, run_id=run_id, shards=shards, extra=extra)
        console.print(f"etcd on {'https' if etcd.tls else 'http'}://{etcd.endpoint}"
                      + (" (client certificates of etcd's own CA: certs/etcd-ca.pem)" if etcd.tls else "")
                      + (f"; {replicas} syncer instances elect their leader through it" if shards == 1 else
                         f"; each of {shards} syncer shards has {replicas} instances electing the shard's leader"))
    else:
        syncers = cluster.start_syncer_shards(shards, run_id=run_id, extra=extra)
    syncer = syncers[0]
    target = cluster.syncer_target()
    tls_hint = ""
    if cluster.tls_dir is not None:
        certs = cluster.tls_dir
        tls_hint = f" --tls-ca {certs}/ca.pem --tls-cert {certs}/operator.pem --tls-key {certs}/operator.key"
    console.print(f"syncer listening on [bold]{target}[/]{' (mutual TLS)' if tls_hint else ''}  "
                  # --watch streams from one address: with failover, status reads the leader of the list.
                  f"(watch it from another terminal: ddiloco status {'--watch ' if replicas == 1 else ''}"
                  f"--target {target}{tls_hint})")
    if shards > 1:
        console.print(f"{shards} syncer shards (fragment f on shard f mod {shards}): " + ", ".join(
            f"{i}: {'|'.join(s.address for s in syncers[i * replicas:(i + 1) * replicas])}" for i in range(shards)))
    return syncer


def _start_workers(args: argparse.Namespace, cluster: cluster_lib.LocalCluster, data_flags: list[str]) -> None:
    """Starts the evaluator and the learners."""
    cluster.start_evaluator(extra=["--interval-s", str(args.eval_interval_s), "--num-shards", str(args.learners),
                                   *data_flags])
    for i in range(args.learners):
        cluster.start_learner(i, region="region-a" if i % 2 == 0 else "region-b", extra=[
            "--steps", str(args.steps), "--num-shards", str(args.learners), "--batch-size", str(args.batch_size),
            *data_flags,
            # Resolved where `up` runs (the learners run in the workdir): the next run finds it.
            *(["--compilation-cache-dir", os.path.abspath(args.compilation_cache_dir)]
              if args.compilation_cache_dir else []),
            # Each learner's resume state (docs/operations.md), kept with the run's other files.
            "--state-dir", str(cluster.workdir / "state" / f"learner-{i}"),
        ])


def _follow(console: Console, args: argparse.Namespace, cluster: cluster_lib.LocalCluster,
            reader: run_view.RunReader, target: str,
            workdir: pathlib.Path, started: float, interrupt: _Interrupt) -> None:
    """Shows the training state (and appends it to state.jsonl) until the learners exit, Ctrl-C, or
    --timeout-s from `started` (then `interrupt.interrupted` is set); with failover, restarts a
    syncer instance that lost its leadership as a standby."""
    # Live table on a terminal; plain progress lines otherwise (CI logs, pipes).
    live = None if args.no_live or not console.is_terminal else Live(console=console, refresh_per_second=2)
    history = open(workdir / "state.jsonl", "a")
    if live:
        live.start()
    last_line = 0.0
    try:
        while not interrupt.interrupted and any(s.alive() for s in cluster.learners()):
            if time.monotonic() - started > args.timeout_s:
                console.print(f"[red]timed out after {args.timeout_s:.0f} s[/]")
                interrupt.interrupted = True
                break
            for name in cluster.revive_syncer_replicas():
                console.print(f"{name} lost its leadership (exit {cluster_lib.EXIT_LOST_LEADERSHIP}): "
                              "restarted as a standby")
            view = _view(reader)
            state = view.state if view is not None else None
            if state is not None:
                history.write(json.dumps(report_lib.snapshot_record(state)) + "\n")
                history.flush()
            if state is not None and live:
                live.update(render.state_renderable(state, target=target, shards=view.shards))
            elif state is not None and time.monotonic() - last_line > 5:
                last_line = time.monotonic()
                steps = [m.local_step for m in state.members]
                console.print(f"outer steps {state.outer_steps}, learner steps {steps}, "
                              f"held-out {state.evals[-1].heldout_loss if state.evals else float('nan'):.4f}")
            time.sleep(0.5)
    finally:
        history.close()
        if live:
            live.stop()


def _summary(state, final_loss, cluster, wall_s: float) -> dict:
    learner_summaries = []
    for svc in cluster.learners():
        path = cluster.workdir / f"{svc.name}.summary.json"
        if path.exists():
            learner_summaries.append(json.loads(path.read_text()))
    evals = [e.heldout_loss for e in state.evals] if state else []
    derived = status_derived.derived(state) if state else None
    return {
        "wall_s": round(wall_s, 1),
        "heldout_loss_start": evals[0] if evals else None,
        "heldout_loss_end": final_loss if final_loss is not None else (evals[-1] if evals else None),
        "merges": state.outer_steps if state else None,
        "tokens_merged": state.tokens_merged if state else None,
        # Work merged = tokens_merged / (num_fragments x tokens_processed) (status_derived).
        "tokens_processed": derived["tokens_processed"] if derived else None,
        "num_fragments": derived["num_fragments"] if derived else None,
        "work_merged": derived["work_merged"] if derived else None,
        "merge_participation": derived["merge_participation"] if derived else None,
        "bytes_in": state.bytes_in if state else None,
        "bytes_out": state.bytes_out if state else None,
        "uploads": dict(state.uploads) if state else {},
        "learners": learner_summaries,
    }


def _print_summary(console: Console, s: dict, interrupted: bool, failed: list[str]) -> None:
    console.rule("summary" + (" (interrupted)" if interrupted else ""))
    start, end = s["heldout_loss_start"], s["heldout_loss_end"]
    if start is not None and end is not None:
        console.print(f"held-out loss of the global model: {start:.4f} -> [bold]{end:.4f}[/] "
                      f"{s.get('loss_unit', 'nats/byte')}")
    console.print(f"merges (outer steps): {s['merges']}   tokens merged: {s['tokens_merged']:,}" if s["merges"] is not None
                  else "syncer state unavailable")
    if s["merges"] is not None:
        console.print(f"work merged: {status_derived.fmt_share(s['work_merged'])} (tokens merged / ({s['num_fragments']} "
                      f"fragments x {s['tokens_processed']:,} tokens processed)); contributors per recent merge: "
                      f"{status_derived.fmt_participation(s['merge_participation'])}")
    if s["bytes_in"] is not None:
        console.print(f"bytes on the wire: in {render.human_bytes(s['bytes_in'])}, out {render.human_bytes(s['bytes_out'])}")
    for ls in s["learners"]:
        console.print(f"  {ls['learner_id']}: {ls['steps']} steps, train loss {ls['first_loss']:.3f} -> "
                      f"{ls['last_loss_ema']:.3f}, {ls['client']['uploads_accepted']} uploads accepted")
    if failed:
        console.print(f"[red]learners that failed: {failed}[/]")
    console.print(f"wall time {s['wall_s']} s")
