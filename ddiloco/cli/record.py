"""`ddiloco record --target HOST:PORT --out DIR`: records the training state of any running cluster.

Owns the recorder: it watches a syncer's training state over gRPC (WatchTrainingState, the
read-only API `ddiloco status` uses, so a reader identity suffices) and writes the run directory
`ddiloco up` writes and `ddiloco report` draws (report.py owns the format): one
`report.snapshot_record` per snapshot appended to DIR/state.jsonl (flushed line by line), and
DIR/final_state.json, the last state with every held-out evaluation seen while recording (the
syncer keeps a bounded history). It works the same on compose, Helm or hand-started clusters.
A syncer split into fragment shards is recorded as one run: each snapshot of the shard watched
(--target, any shard) is completed with every other shard's state and merged (run_view.py), as
`ddiloco status` shows it; a shard that does not answer leaves its fragments out of that snapshot.

It records until SIGINT/SIGTERM or `--duration-s`, then writes final_state.json and exits 0.
While the syncer does not answer (not up yet, restarting, unreachable) it retries with capped
backoff for at most `--retry-for-s` since its last answer, then gives up: exit 2 if the syncer
never answered (also when `--duration-s` ends first), 1 if it stopped answering (what was recorded
is kept and can be drawn).
Refused credentials or a failed TLS handshake end it at once (exit 2): retrying cannot help.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable

import grpc

from ddiloco.cli import render
from ddiloco.cli import report as report_lib
from ddiloco.cli import run_view
from ddiloco.cli import status as status_cli
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc

# A watch stream is re-opened at least this often, so that no call is without a deadline.
STREAM_DEADLINE_S = 600.0
_MAX_BACKOFF_S = 5.0
# final_state.json is rewritten this often while recording, so that a recorder killed without
# a chance to flush (SIGKILL, a lost node) still leaves a complete run directory.
_FINAL_EVERY_S = 30.0


def add_arguments(parser: argparse.ArgumentParser, default_target: str) -> None:
    parser.description = (
        "Record the training state of any running cluster (compose, Helm, by hand) from its syncer into a run "
        "directory, the format `ddiloco up` writes; draw it with `ddiloco report DIR`. Runs until SIGINT/SIGTERM "
        "or --duration-s (exit 0 after writing final_state.json). Needs a reader identity under TLS/tokens. "
        "Exit 2 when the syncer never answers (within --retry-for-s or --duration-s) or refuses the credentials, 1 when it stops "
        "answering for --retry-for-s (the snapshots recorded are kept).")
    parser.add_argument("--target", default=default_target, help="syncer host:port [env: DDILOCO_TARGET]")
    parser.add_argument("--out", required=True,
                        help="run directory to write (state.jsonl, final_state.json); draw it with `ddiloco report`")
    parser.add_argument("--append", action="store_true",
                        help="continue a recording already in --out (otherwise a non-empty state.jsonl is refused)")
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between snapshots (at least 0.1)")
    parser.add_argument("--duration-s", type=float, default=0.0,
                        help="stop after this many seconds (0: until SIGINT/SIGTERM)")
    parser.add_argument("--retry-for-s", type=float, default=60.0,
                        help="while the syncer does not answer, keep retrying this long since its last answer, "
                             "then give up (exit 2 if it never answered, 1 otherwise)")
    parser.add_argument("--timeout-s", type=float, default=5.0,
                        help="deadline of a snapshot: a stream silent for this long past --interval-s is re-opened")
    parser.add_argument("--merges", type=int, default=8, help="recent merges to include in final_state.json")
    status_cli.add_security_arguments(parser)


class Recorder:
    """Watches one syncer's training state and appends every snapshot to a run directory.

    `run()` is the watch loop (a worker thread); `check_stalled()`, `stop()` and `close()` are
    called from the main thread, which handles signals and the duration.
    """

    def __init__(self, stub: syncer_pb2_grpc.SyncerStub, out_dir: pathlib.Path, *, target: str,
                 security, interval_s: float, timeout_s: float, retry_for_s: float, merges: int,
                 log=None, clock=time.monotonic,
                 complete: Callable[[syncer_pb2.TrainingState], syncer_pb2.TrainingState] | None = None) -> None:
        self.stub = stub
        # The run's state around a snapshot of the watched syncer (the other fragment shards read and merged).
        self.complete = complete or (lambda state: state)
        self.out_dir = out_dir
        self.target = target
        self.security = security
        self.interval_s = max(interval_s, 0.1)
        self.timeout_s = timeout_s
        self.retry_for_s = retry_for_s
        self.merges = merges
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.clock = clock
        self.records = 0
        self.error: str | None = None  # why recording ended early, if it did
        self.last_problem: str | None = None  # why the syncer did not answer the last time it did not
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the files, the last state and the current call
        self._history = None  # state.jsonl, opened at the first snapshot (none: no empty file left)
        self._closed = False
        self._last_state: syncer_pb2.TrainingState | None = None
        self._evals: dict[float, syncer_pb2.EvalRecord] = {}  # at_unix_s -> evaluation, this run's
        self._call = None
        self._stalled_call = None  # the call check_stalled cancelled (its CANCELLED is a timeout)
        self._started_s = clock()
        self._last_answer_s: float | None = None  # clock() of the last snapshot received
        self._call_opened_s = clock()
        self._final_written_s = clock()

    # --- the watch loop (worker thread) -------------------------------------------------------

    def run(self) -> None:
        backoff_s = 0.5
        while not self._stop.is_set():
            request = syncer_pb2.WatchTrainingStateRequest(min_interval_s=self.interval_s, recent_merges=self.merges)
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    call = self._call = self.stub.WatchTrainingState(request, timeout=STREAM_DEADLINE_S)
                    self._call_opened_s = self.clock()
                for response in call:
                    self._write(self.complete(response.state))
                    backoff_s = 0.5
                # The stream ended without a status (a proxy closing it): re-open, paced like a failure.
                reason, problem = "stream ended", f"syncer {self.target} ended the stream"
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                if status_cli.credentials_problem(exc):  # retrying will not help: the flags must change
                    self.error = status_cli.explain(exc, self.security, self.target)
                    self._stop.set()
                    return
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self._answered_within(STREAM_DEADLINE_S):
                    continue  # the stream's own deadline: re-open at once
                with self._lock:
                    stalled = self._stalled_call is not None and self._stalled_call is self._call
                if stalled:
                    reason = "no snapshot in time"
                    problem = (f"syncer {self.target} unavailable: sent nothing within --timeout-s "
                               f"{self.timeout_s:g} past the interval")
                else:
                    reason, problem = exc.code().name, status_cli.explain(exc, self.security, self.target)
            except OSError as exc:  # the run directory is not writable (disk full, permissions)
                self.error = f"cannot write to {self.out_dir}: {exc}"
                self._stop.set()
                return
            finally:
                with self._lock:
                    self._call = None
            if self._stop.is_set():
                return
            self.last_problem = problem
            silent_s = self.clock() - (self._last_answer_s if self._last_answer_s is not None else self._started_s)
            if silent_s >= self.retry_for_s:
                never = self._last_answer_s is None
                self.error = (f"{'no answer' if never else 'no answer since the last snapshot'} from syncer "
                              f"{self.target} for {silent_s:.0f} s (--retry-for-s {self.retry_for_s:g}); "
                              f"giving up.\n{problem}")
                self._stop.set()
                return
            # The last wait ends when the retry budget does, for one last attempt.
            wait_s = min(backoff_s, self.retry_for_s - silent_s)
            self.log(f"syncer {self.target} unavailable ({reason}); retrying in {wait_s:.1f} s "
                     f"(giving up after {self.retry_for_s:g} s without an answer)")
            self._stop.wait(wait_s)
            backoff_s = min(backoff_s * 2, _MAX_BACKOFF_S)

    def _answered_within(self, seconds: float) -> bool:
        return self._last_answer_s is not None and self.clock() - self._last_answer_s < seconds

    def _write(self, state: syncer_pb2.TrainingState) -> None:
        with self._lock:
            if self._closed:
                return
            if self._history is None:
                self._history = open(self.out_dir / "state.jsonl", "a")
            if self._last_state is None:
                self.log(f"recording run {state.run_id!r} (syncer instance {state.syncer_instance}) from "
                         f"{self.target} into {self.out_dir}")
            elif state.run_id != self._last_state.run_id:
                self.log(f"the syncer at {self.target} now serves run {state.run_id!r}")
                self._evals.clear()  # another run's evaluations do not continue this one's
            self._history.write(json.dumps(report_lib.snapshot_record(state)) + "\n")
            self._history.flush()
            self.records += 1
            self._last_state = state
            self._last_answer_s = self.clock()
            for e in state.evals:
                self._evals.setdefault(e.at_unix_s, e)
            if self.clock() - self._final_written_s >= _FINAL_EVERY_S:
                self._write_final()

    # --- main thread --------------------------------------------------------------------------

    def check_stalled(self) -> None:
        """Cancels a stream that sent nothing for --timeout-s past the interval (a hung syncer, a
        connection to a host that never answers): the watch loop then retries, bounded."""
        bound_s = self.timeout_s + self.interval_s
        with self._lock:
            if self._call is None or self._call is self._stalled_call:
                return
            since = max(self._call_opened_s, self._last_answer_s or 0.0)
            if self.clock() - since > bound_s:
                self._stalled_call = self._call
                self._call.cancel()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()

    def close(self) -> None:
        """Writes final_state.json (when any state was seen) and closes state.jsonl."""
        with self._lock:
            self._write_final()
            self._closed = True
            if self._history is not None:
                self._history.close()

    def _write_final(self) -> None:
        if self._last_state is None:
            return
        final = syncer_pb2.TrainingState()
        final.CopyFrom(self._last_state)
        del final.evals[:]
        final.evals.extend(self._evals[t] for t in sorted(self._evals))
        path = self.out_dir / "final_state.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(render.to_json(final))
        os.replace(tmp, path)  # a reader never sees half a file
        self._final_written_s = self.clock()


def _existing_records(path: pathlib.Path) -> bool:
    return path.exists() and path.stat().st_size > 0


def run(args: argparse.Namespace) -> int:
    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        security = status_cli.client_security(args)
        security.check_files()
    except ValueError as exc:
        say(f"ddiloco record: {exc}")
        return 2
    out_dir = pathlib.Path(args.out)
    if _existing_records(out_dir / "state.jsonl") and not args.append:
        say(f"ddiloco record: {out_dir / 'state.jsonl'} already holds a recording; pass --append to continue it "
            "or choose another --out")
        return 2
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        say(f"ddiloco record: cannot create {out_dir}: {exc}")
        return 2
    channel = channel_lib.sync_channel(args.target, security)
    shards = run_view.RunReader(args.target, security, timeout_s=args.timeout_s, recent_merges=args.merges)
    recorder = Recorder(syncer_pb2_grpc.SyncerStub(channel), out_dir, target=args.target, security=security,
                        interval_s=args.interval_s, timeout_s=args.timeout_s, retry_for_s=args.retry_for_s,
                        merges=args.merges, log=say, complete=lambda state: shards.complete(state).state)
    interrupted = threading.Event()

    def _on_signal(signum, _frame):
        # Only set a flag: the main loop below stops the recorder and flushes.
        interrupted.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    worker = threading.Thread(target=recorder.run, name="record-watch", daemon=True)
    worker.start()
    started_s = time.monotonic()
    try:
        while worker.is_alive() and not interrupted.is_set():
            if args.duration_s > 0 and time.monotonic() - started_s >= args.duration_s:
                break
            recorder.check_stalled()
            interrupted.wait(0.2)
    finally:
        recorder.stop()
        worker.join(timeout=args.timeout_s + 5.0)
        try:
            recorder.close()
        except OSError as exc:
            recorder.error = recorder.error or f"cannot write {out_dir / 'final_state.json'}: {exc}"
        channel.close()
        shards.close()
        if created and not recorder.records:
            with contextlib.suppress(OSError):
                out_dir.rmdir()  # nothing recorded: leave no empty run directory behind
    if recorder.error is None and not recorder.records and not interrupted.is_set():
        # --duration-s ran out before the syncer ever answered: that is not a recording.
        recorder.error = (f"no answer from syncer {args.target} within --duration-s {args.duration_s:g}"
                          + (f"\n{recorder.last_problem}" if recorder.last_problem else ""))
    if recorder.error is not None:
        say(f"ddiloco record: {recorder.error}")
        if recorder.records:
            say(f"ddiloco record: kept {recorder.records} snapshots in {out_dir}")
        return 1 if recorder.records else 2
    print(f"recorded {recorder.records} snapshots in {out_dir}; plots: ddiloco report {out_dir}", flush=True)
    return 0
