"""The dashboard server: polls a syncer's GetTrainingState and serves a live page and JSON.

One background thread polls the syncer (blocking stub, a deadline on every call; while the
syncer is unreachable it keeps polling with capped exponential backoff and reports
`available: false` instead of failing). A ThreadingHTTPServer serves:

- `GET /`             the page (page.py): one HTML document, inline CSS and JavaScript, no
                      external assets; it fetches /api/history once and /api/state every second.
- `GET /api/state`    the latest TrainingState as JSON (MessageToDict, proto field names, every
                      field present, uint64 as numbers) plus `available`, `target`, `fetched_at`
                      (unix s of the last poll), `last_ok_at`, `error`, `derived`
                      (tokens_processed and its source, num_fragments, work_merged,
                      merge_participation: see ddiloco.training_state) and `sample` (this
                      poll's entry of the history). While the syncer is unreachable the state
                      fields are the last ones seen. For a syncer split into fragment shards the
                      state is the run's one view over every shard (cli.run_view) and
                      `shard_status` lists the shards, each up or down.
- `GET /api/history`  the recorded series (a bounded ring of per-poll samples, oldest first) and
                      the held-out evaluations seen so far, so a freshly opened page has curves.
- `GET /healthz`      200 while the server runs, with the syncer's availability.

Work merged is the share of the work done by the learners that ended up in the global model:
tokens_merged / (P * tokens processed). Each inner step trains all P fragments and a fragment's
contribution carries that fragment's tokens, so a run in which every contribution is merged has
tokens_merged = P * tokens processed (work merged 1). It is not the paper's goodput, which is a
share of wall time. Tokens processed are the syncer's TrainingState.tokens_processed (every life
of every learner, kept across syncer restarts); for a syncer that predates the field (0 there) the
dashboard sums every life (learner id, incarnation) it has seen, so a restarted learner, whose
counter starts again at 0, does not make the ratio jump.
"""

from __future__ import annotations

import collections
import json
import logging
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from google.protobuf import json_format

from ddiloco import training_state as status_derived
from ddiloco.cli import run_view
from ddiloco.dashboard import page
from ddiloco.v1 import syncer_pb2

_LOG = logging.getLogger(__name__)

# The page runs only inline code and talks only to this server.
_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'")


def parse_bind(bind: str) -> tuple[str, int]:
    """'HOST:PORT' (or '[v6]:PORT', or ':PORT' for 127.0.0.1) -> (host, port); port 0 is allowed."""
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--bind must be HOST:PORT, got {bind!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a slow client never holds up shutdown
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class Dashboard:
    """Polls `target` every `interval_s` and serves the dashboard on `bind` once started.

    `security` is passed to the channel factory (TLS and/or a token towards the syncer); the
    dashboard needs only read access (GetTrainingState).
    """

    def __init__(self, target: str, *, bind: str = "127.0.0.1:0", interval_s: float = 1.0,
                 timeout_s: float = 5.0, recent_merges: int = 16, history: int = 3600,
                 max_backoff_s: float = 5.0, security=None) -> None:
        if interval_s <= 0 or timeout_s <= 0 or history < 2:
            raise ValueError("interval_s and timeout_s must be > 0 and history >= 2")
        self.target = target
        self.host, self.port = parse_bind(bind)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.recent_merges = recent_merges
        self.max_samples = history
        self.max_backoff_s = max(max_backoff_s, interval_s)
        self.security = security  # client security for the syncer channel (None: plaintext)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._samples: collections.deque[dict] = collections.deque(maxlen=history)
        self._evals: collections.OrderedDict[float, dict] = collections.OrderedDict()
        self._lives: dict[tuple[str, int], int] = {}  # (learner id, incarnation) -> tokens seen
        self._state: dict | None = None  # MessageToDict of the last state seen
        self._run_id: str | None = None
        self._available = False
        self._fetched_at: float | None = None
        self._last_ok_at: float | None = None
        self._error = "not polled yet"
        self._polls = 0
        self._reader: run_view.RunReader | None = None
        self._httpd: _Server | None = None
        self._threads: list[threading.Thread] = []

    # --- lifecycle ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("not started")
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/"

    def start(self) -> str:
        """Binds (OSError if the address is taken), starts polling and serving; returns the URL."""
        server_cls = _Server6 if ":" in self.host else _Server
        self._httpd = server_cls((self.host, self.port), _handler_for(self))
        self.port = self._httpd.server_address[1]
        # Reads every shard of a sharded syncer through the one target (an unsharded one: just it).
        self._reader = run_view.RunReader(self.target, self.security, timeout_s=self.timeout_s,
                                          recent_merges=self.recent_merges)
        self._threads = [
            threading.Thread(target=self._poll_loop, args=(self._reader,), name="dashboard-poll", daemon=True),
            threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.25},
                             name="dashboard-http", daemon=True),
        ]
        for t in self._threads:
            t.start()
        _LOG.info("dashboard serving", extra={"fields": {"url": self.url, "syncer": self.target}})
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        for t in self._threads:
            t.join(timeout_s)
        if self._reader is not None:
            self._reader.close()

    def __enter__(self) -> Dashboard:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- polling --------------------------------------------------------------------------------

    def _poll_loop(self, reader: run_view.RunReader) -> None:
        backoff_s = self.interval_s
        while not self._stop.is_set():
            started = time.monotonic()
            fetched_at = time.time()
            try:
                view = reader.read()
                self._record(view.state, fetched_at, view.shards)
                backoff_s = self.interval_s
                wait_s = self.interval_s - (time.monotonic() - started)
            except grpc.RpcError as exc:
                self._record_error(f"{exc.code().name}: {exc.details()}", fetched_at)
                wait_s, backoff_s = backoff_s, min(backoff_s * 2, self.max_backoff_s)
            except Exception as exc:  # never let the poller die: report it and keep polling
                _LOG.exception("dashboard poll failed")
                self._record_error(f"{type(exc).__name__}: {exc}", fetched_at)
                wait_s, backoff_s = backoff_s, min(backoff_s * 2, self.max_backoff_s)
            self._stop.wait(max(0.0, wait_s))

    def _record(self, state: syncer_pb2.TrainingState, fetched_at: float, shards=()) -> None:
        as_dict = json_format.MessageToDict(
            state, preserving_proto_field_name=True, always_print_fields_with_no_presence=True,
            unquote_int64_if_possible=True,
        )
        with self._lock:
            if self._run_id is not None and state.run_id != self._run_id:
                # Another run behind the same address: its series do not continue this one's.
                self._samples.clear()
                self._evals.clear()
                self._lives.clear()
            self._run_id = state.run_id
            for m in state.members:
                key = (m.learner_id, m.incarnation)
                self._lives[key] = max(self._lives.get(key, 0), m.tokens_total)
            for e in state.evals:
                if e.at_unix_s not in self._evals:
                    self._evals[e.at_unix_s] = {
                        "t": e.at_unix_s, "heldout_loss": e.heldout_loss,
                        "tokens_merged": e.tokens_merged, "outer_steps": e.outer_steps,
                    }
            while len(self._evals) > self.max_samples:
                self._evals.popitem(last=False)
            if state.tokens_processed:
                tokens_processed, source = state.tokens_processed, "syncer"
            else:  # a syncer without the field: every life seen by this dashboard
                tokens_processed, source = sum(self._lives.values()), "members"
            derived = status_derived.derived(state, tokens_processed, source)
            participation = derived["merge_participation"]
            sample = {
                "t": fetched_at, "syncer_instance": state.syncer_instance, "outer_steps": state.outer_steps,
                "tokens_merged": state.tokens_merged, "tokens_processed": tokens_processed,
                "work_merged": derived["work_merged"],
                "contributors_per_expected": participation["contributors_per_expected"],
                "bytes_in": state.bytes_in, "bytes_out": state.bytes_out,
                "inner_loss": {m.learner_id: m.inner_loss for m in state.members if m.local_step > 0},
            }
            self._samples.append(sample)
            as_dict["derived"] = derived
            as_dict["sample"] = sample
            if shards:
                as_dict["shard_status"] = [s.as_dict() for s in shards]
            self._state = as_dict
            if not self._available:
                _LOG.info("syncer available", extra={"fields": {"syncer": self.target}})
            self._available = True
            self._fetched_at = self._last_ok_at = fetched_at
            self._error = ""
            self._polls += 1

    def _record_error(self, error: str, fetched_at: float) -> None:
        with self._lock:
            if self._available or self._polls == 0:
                _LOG.warning("syncer unavailable", extra={"fields": {"syncer": self.target, "error": error}})
            self._available = False
            self._fetched_at = fetched_at
            self._error = error
            self._polls += 1

    # --- views ----------------------------------------------------------------------------------

    def state_json(self) -> dict:
        with self._lock:
            out = dict(self._state or {})
            out.update(available=self._available, target=self.target, fetched_at=self._fetched_at,
                       last_ok_at=self._last_ok_at, error=self._error)
            return out

    def history_json(self) -> dict:
        with self._lock:
            return {
                "target": self.target, "run_id": self._run_id, "interval_s": self.interval_s,
                "max_samples": self.max_samples, "samples": list(self._samples), "evals": list(self._evals.values()),
            }

    def health_json(self) -> dict:
        with self._lock:
            return {"ok": True, "syncer_available": self._available, "target": self.target}


def _handler_for(dashboard: Dashboard) -> type[BaseHTTPRequestHandler]:
    page_bytes = page.HTML.encode("utf-8")

    class Handler(BaseHTTPRequestHandler):
        server_version = "ddiloco-dashboard"

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, "text/html; charset=utf-8", page_bytes)
            elif path == "/api/state":
                self._send_json(dashboard.state_json())
            elif path == "/api/history":
                self._send_json(dashboard.history_json())
            elif path == "/healthz":
                self._send_json(dashboard.health_json())
            else:
                self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found\n")

        def _send_json(self, obj: dict) -> None:
            # allow_nan=False would fail on a NaN loss: non-finite numbers become null instead.
            body = json.dumps(_finite(obj), separators=(",", ":")).encode("utf-8")
            self._send(HTTPStatus.OK, "application/json", body)

        def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Content-Type-Options", "nosniff")
                self.send_header("Content-Security-Policy", _CSP)
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the browser went away

        def log_message(self, format: str, *args) -> None:  # noqa: A002
            _LOG.debug("http %s", format % args)

    return Handler


def _finite(obj):
    """JSON has no NaN or Infinity: replaces them by None (recursively)."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj
