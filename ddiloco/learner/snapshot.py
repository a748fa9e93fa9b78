"""A learner's durable local state, so that a restarted learner (same --learner-id) resumes.

Owns: ``LearnerSnapshot`` (what is kept), ``SnapshotStore`` (``--state-dir``: the snapshot file,
written atomically, loaded and validated; and the journal of fragments contributed since it),
``run_identity`` (what a snapshot must match) and the conversion of the inner optimizer's state to
named host arrays and back.
Must not: decide what a resumed learner does with the state (``LearnerLoop.resume``) or talk to
the syncer.

The file is ``<state-dir>/snapshot.safetensors``: every array (the local parameters, the global
fragments the learner held, the optimizer state's leaves by tree path, the per-fragment
counters, the pending contributions' values) as a named tensor, and a JSON header
(``__metadata__["ddiloco"]``) with the run id, the model fingerprint, the fragment plan's digest,
the step, the held versions and the data sampler's position. It is written to a temporary file,
fsynced, renamed over the previous one and the directory fsynced: a crash leaves the previous
snapshot or the new one, never a mix. A snapshot that does not load, or belongs to another run,
model or fragment plan, is reported with a warning and ignored (the learner starts from the
global model); it is overwritten by this run's first snapshot.

Work done after the snapshot is not in it. A contribution sent after the snapshot may have been
merged (the syncer's receipts speak only for the life that sent it), so before each contribution
the learner appends the fragment to ``sent.jsonl`` (fsynced before the upload starts): on
resume, those fragments' snapshot progress is dropped rather than sent twice (see
``LearnerLoop.resume``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

_LOG = logging.getLogger("ddiloco.learner")

FORMAT = "ddiloco-learner-snapshot/1"
SNAPSHOT_FILE = "snapshot.safetensors"
JOURNAL_FILE = "sent.jsonl"
_HEADER_KEY = "ddiloco"


class SnapshotMismatch(ValueError):
    """The snapshot cannot be used by this learner (another run, model, plan, or unreadable)."""


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """What a snapshot must match to be resumed from."""

    run_id: str
    model_fingerprint: str
    plan_digest: str
    learner_id: str


def run_identity(run_config, learner_id: str) -> RunIdentity:
    """The identity of this learner in the run the syncer describes (a ``RunConfig``)."""
    digest = hashlib.sha256(str(run_config.sync_period_steps).encode())
    for info in run_config.fragments:
        digest.update(info.SerializeToString(deterministic=True))
    return RunIdentity(run_id=run_config.run_id, model_fingerprint=run_config.model_fingerprint,
                       plan_digest=digest.hexdigest(), learner_id=learner_id)


@dataclasses.dataclass
class PendingRecord:
    """An uploaded contribution whose fate was unknown when the snapshot was taken."""

    mark_step: int
    steps: int
    tokens: int
    values: np.ndarray  # what the syncer merges if it merges it (decoded, else as uploaded)


@dataclasses.dataclass
class LearnerSnapshot:
    """Everything a learner needs to continue where it was (see LearnerLoop.export / resume)."""

    identity: RunIdentity
    step: int
    tokens_total: int  # tokens of every life up to this snapshot (information only)
    params: dict[str, np.ndarray]
    opt_leaves: dict[str, np.ndarray]  # the optimizer state's leaves by tree path (opt_state_to_host)
    held: dict[int, tuple[str, int]]  # fragment -> (syncer instance, version)
    global_copy: dict[int, np.ndarray]
    c_steps: np.ndarray
    c_tokens: np.ndarray
    pending: dict[int, PendingRecord]
    sampler: dict  # BatchSampler.position()
    data_shard: int
    written_at_unix_s: float = 0.0


def opt_state_to_host(opt_state) -> dict[str, np.ndarray]:
    """The optimizer state's leaves as host arrays, keyed by their tree path."""
    leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def leaves_sha256(leaves: dict[str, np.ndarray]) -> str:
    """sha256 over named arrays (names, dtypes, shapes and bytes, in name order): the resume log line
    states the restored optimizer state's, so it can be checked against the snapshot file."""
    digest = hashlib.sha256()
    for name in sorted(leaves):
        value = np.asarray(leaves[name])
        digest.update(f"{name}:{value.dtype.str}:{list(value.shape)};".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


def opt_state_from_host(template, leaves: dict[str, np.ndarray]):
    """Rebuilds an optimizer state shaped like ``template`` (a fresh init of the same optimizer)
    from named host leaves, each placed like the template's leaf. SnapshotMismatch when the trees
    differ (another optimizer, another model)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    names = [jax.tree_util.keystr(path) for path, _ in flat]
    if set(names) != set(leaves):
        raise SnapshotMismatch(f"the optimizer state differs: {len(leaves)} saved leaves, {len(names)} expected "
                               f"(first difference: {sorted(set(names) ^ set(leaves))[:1]})")
    out = []
    for name, (_, like) in zip(names, flat):
        value = leaves[name]
        if tuple(value.shape) != tuple(np.shape(like)) or value.dtype != np.asarray(like).dtype:
            raise SnapshotMismatch(f"optimizer leaf {name}: saved {value.dtype}{list(value.shape)}, "
                                   f"expected {np.asarray(like).dtype}{list(np.shape(like))}")
        # Placed as the template's leaf is, committed to its devices or not: a committed state with
        # one device made the jitted step's outputs committed, and each fragment folded in (an
        # uncommitted array, as TrainStep.place makes without a mesh) then a new argument pattern:
        # a recompilation at nearly every step of a resumed learner (2.9 s per step under load).
        if getattr(like, "committed", False):
            out.append(jax.device_put(value, like.sharding))
        else:
            out.append(jnp.asarray(value) if isinstance(like, jax.Array) else value)
    return jax.tree_util.tree_unflatten(treedef, out)


def _contiguous(value, dtype=None) -> np.ndarray:
    # Not np.ascontiguousarray: it turns a 0-d leaf (AdamW's step count) into shape (1,).
    return np.array(value, dtype=dtype, order="C", copy=None)


def _encode(snap: LearnerSnapshot) -> bytes:
    tensors: dict[str, np.ndarray] = {"c_steps": snap.c_steps.astype(np.int64), "c_tokens": snap.c_tokens.astype(np.int64)}
    tensors.update({f"param/{k}": _contiguous(v) for k, v in snap.params.items()})
    tensors.update({f"opt/{k}": _contiguous(v) for k, v in snap.opt_leaves.items()})
    tensors.update({f"held/{f}": _contiguous(v, np.float32) for f, v in snap.global_copy.items()})
    tensors.update({f"pending/{f}": _contiguous(p.values, np.float32) for f, p in snap.pending.items()})
    header = {
        "format": FORMAT, **dataclasses.asdict(snap.identity), "step": snap.step, "tokens_total": snap.tokens_total,
        "held": {str(f): [inst, v] for f, (inst, v) in snap.held.items()},
        "pending": {str(f): [p.mark_step, p.steps, p.tokens] for f, p in snap.pending.items()},
        "sampler": snap.sampler, "data_shard": snap.data_shard, "written_at_unix_s": snap.written_at_unix_s,
    }
    return safetensors.numpy.save(tensors, metadata={_HEADER_KEY: json.dumps(header)})


def _decode(blob: bytes) -> LearnerSnapshot:
    # The header first: safetensors checks the layout when it loads.
    tensors = safetensors.numpy.load(blob)
    header_len = int.from_bytes(blob[:8], "little")
    header = json.loads(json.loads(blob[8:8 + header_len])["__metadata__"][_HEADER_KEY])
    if header.get("format") != FORMAT:
        raise SnapshotMismatch(f"format {header.get('format')!r}, this learner reads {FORMAT!r}")

    def group(prefix: str) -> dict[str, np.ndarray]:
        return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

    held_values = group("held/")
    pending_values = group("pending/")
    return LearnerSnapshot(
        identity=RunIdentity(**{f.name: header[f.name] for f in dataclasses.fields(RunIdentity)}),
        step=int(header["step"]), tokens_total=int(header["tokens_total"]),
        params=group("param/"), opt_leaves=group("opt/"),
        held={int(f): (inst, int(v)) for f, (inst, v) in header["held"].items()},
        global_copy={int(f): v for f, v in held_values.items()},
        c_steps=tensors["c_steps"], c_tokens=tensors["c_tokens"],
        pending={int(f): PendingRecord(mark, steps, tokens, pending_values[f])
                 for f, (mark, steps, tokens) in header["pending"].items()},
        sampler=header["sampler"], data_shard=int(header["data_shard"]),
        written_at_unix_s=float(header["written_at_unix_s"]),
    )


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class WriteStats:
    bytes: int
    seconds: float


class SnapshotStore:
    """``--state-dir``: one learner's snapshot and its journal of later contributions."""

    def __init__(self, state_dir: str | os.PathLike) -> None:
        self.dir = pathlib.Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / SNAPSHOT_FILE
        self.journal_path = self.dir / JOURNAL_FILE

    def write(self, snap: LearnerSnapshot) -> WriteStats:
        """Replaces the snapshot atomically (tmp + fsync + rename + directory fsync), then empties
        the journal (its entries concern the previous snapshot)."""
        started = time.monotonic()
        snap.written_at_unix_s = time.time()
        blob = _encode(snap)
        tmp = self.path.with_name(f".{SNAPSHOT_FILE}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.dir)
        # Entries name the step they were sent at: any left by a crash here are before snap.step
        # and ignored, so emptying the journal need not be atomic with the rename.
        with open(self.journal_path, "w"):
            pass
        return WriteStats(bytes=len(blob), seconds=time.monotonic() - started)

    def load(self) -> LearnerSnapshot | None:
        """The snapshot, or None when there is none. SnapshotMismatch when it cannot be read."""
        try:
            blob = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return _decode(blob)
        except SnapshotMismatch:
            raise
        except Exception as exc:  # a damaged file: safetensors, JSON or a missing key
            raise SnapshotMismatch(f"{self.path} is unreadable ({type(exc).__name__}: {exc})") from None

    def load_matching(self, identity: RunIdentity) -> LearnerSnapshot | None:
        """The snapshot if it belongs to this run, model, plan and learner; None (with a warning
        saying why and that the learner starts from the global model) otherwise."""
        try:
            snap = self.load()
        except SnapshotMismatch as exc:
            _LOG.warning(f"not resuming: {exc}; starting from the global model (the next snapshot replaces it)")
            return None
        if snap is None:
            return None
        for field in dataclasses.fields(RunIdentity):
            mine, saved = getattr(identity, field.name), getattr(snap.identity, field.name)
            if mine != saved:
                _LOG.warning(
                    f"not resuming: the snapshot in {self.dir} is of another {field.name.replace('_', ' ')} "
                    f"({str(saved)[:16]!r}, this learner's is {str(mine)[:16]!r}); starting from the global model "
                    "(the next snapshot replaces it)")
                return None
        return snap

    def note_sent(self, fragment_id: int, step: int) -> None:
        """Records, durably and before the upload starts, that a fragment is contributed at `step`."""
        with open(self.journal_path, "a") as f:
            f.write(json.dumps({"fragment": fragment_id, "step": step}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def sent_since(self, step: int) -> set[int]:
        """Fragments contributed after `step` by any life (a torn last line is ignored: its upload
        had not started)."""
        try:
            lines = self.journal_path.read_text().splitlines()
        except FileNotFoundError:
            return set()
        sent = set()
        for line in lines:
            try:
                entry = json.loads(line)
                if int(entry["step"]) > step:
                    sent.add(int(entry["fragment"]))
            except (ValueError, KeyError, TypeError):
                continue
        return sent


class Snapshotter:
    """When to write: every `every_steps` inner steps or `interval_s` seconds, whichever comes
    first (0 turns a trigger off); and what the writes cost (for the summary and the docs)."""

    def __init__(self, store: SnapshotStore, identity: RunIdentity, *, every_steps: int, interval_s: float,
                 clock=time.monotonic) -> None:
        self.store = store
        self.identity = identity
        self._every_steps = every_steps
        self._interval_s = interval_s
        self._clock = clock
        self._last_step = 0
        self._last_s = clock()
        self.writes = 0
        self.last_bytes = 0
        self.total_s = 0.0
        self.max_s = 0.0

    def restart_from(self, step: int) -> None:
        self._last_step = step

    def due(self, step: int) -> bool:
        if self._every_steps and step - self._last_step >= self._every_steps:
            return True
        return bool(self._interval_s) and self._clock() - self._last_s >= self._interval_s

    def write(self, capture) -> WriteStats:
        """Writes ``capture()`` (a LearnerSnapshot; its host copies are counted in the cost)."""
        started = self._clock()
        snap = capture()
        written = self.store.write(snap)
        seconds = self._clock() - started
        self._last_step, self._last_s = snap.step, self._clock()
        self.writes += 1
        self.last_bytes = written.bytes
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)
        log = _LOG.info if self.writes == 1 else _LOG.debug
        log("snapshot written", extra={"fields": {"step": snap.step, "bytes": written.bytes,
                                                  "seconds": round(seconds, 4), "path": str(self.store.path)}})
        return WriteStats(bytes=written.bytes, seconds=seconds)

    def summary(self) -> dict:
        return {"writes": self.writes, "last_bytes": self.last_bytes, "max_s": round(self.max_s, 4),
                "mean_s": round(self.total_s / self.writes, 4) if self.writes else 0.0}
