"""Named failpoints: make a process die at a chosen point of its code (fault tests only).

As in etcd's robustness suite, a failpoint is deterministic where a random `kill -9` is not: it
fires at exactly the named place, e.g. between a merge's quorum and its outer step. A spec is a
comma-separated list of `name=action[@n]`:

    syncer.after_quorum=crash          the first time the point is reached
    learner.after_chunk=crash@3        the third time (earlier hits pass)

`crash` exits at once with status 137 (`os._exit`, no clean-up, no flushing: what SIGKILL does).
`stall` blocks the thread that reached the point until the process ends, while every other
thread (servers, the sync client) goes on: a hung loop, as a wedged device or a deadlocked
collective leaves it; what liveness probes must catch (SIGSTOP would freeze the probe's answer too).
`enospc` (store points only) raises OSError(ENOSPC) at that hit and every later one: a disk
that filled up stays full, and the store answers as it does for a real full disk.
The services arm them with `--failpoints` (env DDILOCO_<SERVICE>_FAILPOINTS; the checkpoint
store's is DDILOCO_FAILPOINTS). This is the one failpoint system of the project: every service
parses and fires its points here.

Known points:

    syncer.after_quorum   a fragment's round reached its quorum and the merge started, before
                          the outer step is applied (services/syncer/merging.py `_merge_locked`)
    learner.after_chunk   an upload stream sent a payload chunk, before the stream ends
                          (ddiloco/learner/uploads.py `Uploader`): a crash mid-upload
    learner.inner_step    the training loop is about to take an inner step
                          (services/learner/__main__.py): with `stall`, a hung loop
    store.write           the checkpoint store is about to write data to a temp file
    store.after_tmp_write             a temp file is complete and fsynced
    store.before_rename               just before the temp file is renamed over its target
    store.after_rename_before_dirsync renamed, the directory not yet fsynced
                          (services/checkpoint/store.py and blob_io.py: every atomic write)
"""

from __future__ import annotations

import errno
import logging
import os
import threading

_LOG = logging.getLogger("ddiloco.failpoints")

KNOWN: dict[str, str] = {
    "syncer.after_quorum": "a round reached quorum, before the outer step is applied",
    "learner.after_chunk": "an upload sent a payload chunk, before the stream ends",
    "learner.inner_step": "the training loop is about to take an inner step",
    "store.write": "the store is about to write data to a temp file",
    "store.after_tmp_write": "a temp file is complete and fsynced",
    "store.before_rename": "just before a temp file is renamed over its target",
    "store.after_rename_before_dirsync": "renamed, the directory not yet fsynced",
}
# The store's points fail the write as a full disk would; the other services' may stall a thread
# (their servers go on answering, which is what a stall is for).
_STORE_ACTIONS = frozenset({"crash", "enospc"})
_SERVICE_ACTIONS = frozenset({"crash", "stall"})
CRASH_EXIT_CODE = 137  # what a SIGKILLed process reports, so a crash failpoint looks like one


def actions_of(name: str) -> frozenset[str]:
    """The actions failpoint `name` accepts."""
    return _STORE_ACTIONS if name.startswith("store.") else _SERVICE_ACTIONS


def parse(spec: str, *, prefix: str = "") -> dict[str, tuple[str, int]]:
    """`"a=crash,b=crash@3"` -> {name: (action, nth hit)}; ValueError naming what is wrong.

    `prefix` ("syncer.", "learner." or "store.") restricts the names a service accepts.
    """
    points: dict[str, tuple[str, int]] = {}
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        name, sep, action = entry.partition("=")
        name, action = name.strip(), action.strip()
        if not sep or not action:
            raise ValueError(f"failpoint {entry!r} has no action; write {name}=crash or {name}=crash@N")
        if name not in KNOWN or not name.startswith(prefix):
            known = sorted(k for k in KNOWN if k.startswith(prefix))
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(known)}")
        action, _, nth = action.partition("@")
        if action not in actions_of(name):
            raise ValueError(f"failpoint {name}={action!r}: the action must be one of {sorted(actions_of(name))}")
        try:
            count = int(nth) if nth else 1
        except ValueError:
            count = 0
        if count < 1:
            raise ValueError(f"failpoint {entry!r}: @N must be a positive integer (the hit that fires)")
        points[name] = (action, count)
    return points


class Failpoints:
    """Armed failpoints of one process; `hit(name)` at each named place. Thread-safe."""

    def __init__(self, spec: str = "", *, prefix: str = "") -> None:
        self.points = parse(spec, prefix=prefix)
        self._hits: dict[str, int] = {}
        self._lock = threading.Lock()
        self._released = threading.Event()  # ends every stall (tests of this module only)
        if self.points:
            _LOG.warning("failpoints armed (fault tests only): %s", spec)

    def __bool__(self) -> bool:
        return bool(self.points)

    def hit(self, name: str) -> None:
        armed = self.points.get(name)
        if armed is None:
            return
        with self._lock:
            self._hits[name] = self._hits.get(name, 0) + 1
            hits = self._hits[name]
        if armed[0] == "enospc" and hits >= armed[1]:  # a full disk stays full
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (failpoint {name})")
        if hits != armed[1]:
            return
        if armed[0] == "stall":
            _LOG.error("failpoint %s fired (hit %d): this thread stalls until the process ends", name, armed[1])
            self._released.wait()
            return
        _LOG.error("failpoint %s fired (hit %d): exiting with %d", name, armed[1], CRASH_EXIT_CODE)
        logging.shutdown()
        os._exit(CRASH_EXIT_CODE)

    def release_stalls(self) -> None:
        """Lets every stalled thread go on (and later stalls pass): for tests of this module."""
        self._released.set()


def no_failpoint(name: str) -> None:
    """The disarmed hook (what production runs)."""
