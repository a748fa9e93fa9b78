"""Durable JSONL histories: what the syncer and the learners record for the invariant checkers.

Each record is one JSON object on its own line, written with a single `write(2)` on a file opened
with O_APPEND, before the action it records is acknowledged: a process killed with SIGKILL right
after loses nothing it has acknowledged (the kernel holds the bytes), and a torn last line can
only be the one being written when the process died (`read` skips it).

Syncer records (`--history-file` of the syncer), every one with `instance` (the syncer's life):
  start       {restored, outer_steps, min_quorum, fragments: {fid: [version, sha256, params_sha256]}}
  accepted    {learner, incarnation, fragment, base_version, tokens}   (before the ack is sent)
  merged      {fragment, version, sha256 (what learners hold), params_sha256, reason,
               contributors: [[learner, incarnation, base_version, tokens], ...]}
  checkpoint  {outer_step, versions: {fid: version}}                   (committed in the store)
  shutdown    {pending: [[fragment, learner, incarnation, base_version], ...]}  (graceful exit)
Learner records (`--history-file` of a learner):
  ack         {learner, incarnation, instance, fragment, base_version, result, sent_at}
              result: accepted | duplicate (the syncer's acknowledgement of the upload)
  refused     {..., code}   the syncer refused the upload (a status code)
  failed      {...}         retries exhausted (no acknowledgement)
  version     {instance, fragment, version, epoch}  a global version folded in (leader epochs)
Every record also has `event` and `t` (unix seconds).
"""

from __future__ import annotations

import json
import os
import pathlib
import threading
import time


class HistoryWriter:
    """Appends records to a JSONL file; safe from several threads; never raises on write errors
    after opening (a full disk must not stop training, it only makes the history incomplete)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()
        self.errors = 0

    def write(self, event: str, **fields) -> None:
        line = (json.dumps({"event": event, "t": round(time.time(), 6), **fields}, separators=(",", ":")) + "\n").encode()
        with self._lock:
            try:
                os.write(self._fd, line)
            except OSError:
                self.errors += 1

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read(path: str | os.PathLike) -> list[dict]:
    """All complete records of a history file ([] if it does not exist); a torn line is skipped."""
    p = pathlib.Path(path)
    if not p.exists():
        return []
    records = []
    for line in p.read_text(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
