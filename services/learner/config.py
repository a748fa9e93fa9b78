"""Learner and evaluator configuration: frozen dataclasses parsed once from flags and environment."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping, Sequence

from ddiloco.algo.inner import InnerOptConfig
from ddiloco import failpoints as failpoints_lib
from ddiloco import flags
from ddiloco.data import sources as data_sources
from ddiloco.rpc import security

# `--learner-id auto` (or an empty value): `<region>-<hostname>`, resolved in parse_learner_config.
# In a container the hostname is the container id, so every replica of a scaled compose service
# gets its own identity, and keeps it when the same container restarts.
AUTO_LEARNER_ID = "auto"
UPLOAD_ENCODERS = ("host", "jax")
# An id ending in a separator and a decimal number (learner-3, ddiloco-learner-12): that number
# picks the shard. A hex container id (region-a-3f2a9c1b0e12) is not a number, even where it ends
# in digits, nor is one that happens to be all digits (12 of them; ordinals have at most 9).
_NUMBERED_ID = re.compile(r"(?:^|[^0-9A-Za-z])([0-9]{1,9})\Z")


class _ClientFlags:
    """What a learner and the evaluator build alike from their transport-security and data flags.

    The fields themselves are declared on each config (each dataclass's fields are its flags);
    the data flags must be the same on every learner and the evaluator.
    """

    def client_security(self) -> security.ClientSecurity:
        """ValueError unless TLS (a CA, optionally a cert/key pair) or plaintext was asked for."""
        return security.ClientSecurity(tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key,
                                       tls_server_name=self.tls_server_name, insecure=self.insecure,
                                       auth_token_file=self.auth_token_file)

    def data_spec(self) -> data_sources.DataSpec:
        """The data flags; ValueError on a bad combination."""
        return data_sources.DataSpec(data_dir=self.data_dir, data_source=self.data_source, heldout_dir=self.heldout_dir,
                                     token_dtype=self.token_dtype, max_bytes=self.max_corpus_bytes,
                                     heldout_fraction=self.heldout_fraction, num_shards=self.num_shards)

    def _check_data_spec(self) -> None:
        """ValueError, named after the config, on a bad combination of data flags."""
        try:
            self.data_spec()
        except ValueError as exc:
            raise ValueError(f"{type(self).__name__}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class LearnerConfig(_ClientFlags):
    """Each field is a flag and a DDILOCO_LEARNER_* environment variable."""

    syncer: str = "127.0.0.1:50051"  # syncer host:port
    learner_id: str = "learner-0"  # stable identity; a restarted learner keeps it; "auto": <region>-<hostname>
    incarnation: int = 0  # 0: the start time in ns (grows with each life)
    region: str = "local"
    steps: int = 0  # inner steps to run; 0 runs until SIGTERM
    batch_size: int = 16
    seed: int = 0
    data_dir: str = ""  # text directory, .bin token file or train.bin/val.bin directory; empty: stdlib
    # The rest of the data flags (ddiloco.data.sources.DataSpec): the same on every learner and the evaluator.
    data_source: str = ""  # package.module:factory returning texts or token arrays
    heldout_dir: str = ""  # held-out data instead of heldout_fraction of the data
    token_dtype: str = ""  # uint16 or uint32; empty: meta.json's, else uint16
    max_corpus_bytes: int = 24 * 2**20
    num_shards: int = 4
    shard_index: int = -1  # -1: learner_id's number (learner-3: 3), else the syncer assigns one (see pinned_shard_index)
    heldout_fraction: float = 0.05
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    # Cosine decay of the inner LR (ddiloco.algo.inner.lr_schedule) down to lr_final_fraction x
    # the peak at step lr_decay_steps; -1: over --steps (none when steps is 0); 0: no decay.
    lr_decay_steps: int = -1
    lr_final_fraction: float = 0.1
    weight_decay: float = 0.1
    join_timeout_s: float = 120.0  # wait this long for the syncer at start, then exit non-zero
    call_timeout_s: float = 10.0
    retry_bound_s: float = 30.0
    # At the end (or on SIGTERM): how long to wait for the last contributions to be merged.
    finish_timeout_s: float = 30.0
    progress_interval_s: float = 0.25
    step_delay_s: float = 0.0  # extra seconds per step: simulates slower hardware
    step_jitter: float = 0.0  # relative jitter of step_delay_s
    # A learner unit of many devices / hosts (services/learner/distributed.py, docs/gpu.md).
    num_devices: int = 0  # devices of each process to train on; 0: all visible
    mesh_shape: str = ""  # "DATAxFSDP" over the unit's devices; empty: all on the data axis
    fsdp: bool = False  # shard params and optimizer state over the unit's devices
    coordinator_address: str = ""  # jax.distributed coordinator host:port (process 0's), for num_processes > 1
    num_processes: int = 1  # processes (hosts) of this learner unit
    process_id: int = 0  # this process's index in the unit; only 0 talks to the syncer
    log_every_steps: int = 25
    summary_file: str = ""  # write a JSON summary here at exit
    # XLA executables persisted here (JAX's compilation cache): a restarted learner on the same
    # disk loads its compiled step instead of compiling it again. Empty: off.
    compilation_cache_dir: str = ""
    # Which implementation encodes uploads (same bytes): "host" (numba loops, fastest per call,
    # ~0.5 CPU-s to load at each process start), "jax" (jax_codec: ~0.15 CPU-s when its programs
    # are in a warm --compilation-cache-dir, for restart-heavy runs; compiled per fragment size
    # otherwise, which delayed the first uploads of a cold `ddiloco up` by seconds).
    upload_encoder: str = "host"
    metrics_bind: str = ""  # host:port for Prometheus /metrics; empty disables
    # Liveness (ddiloco/liveness.py): a plaintext gRPC health service (Check only) that reports
    # NOT_SERVING once the training loop has gone liveness_timeout_s without progress (the start,
    # the join, every completed inner step), so a hung learner is restarted. On by default, on the
    # port the chart and compose probe; several learners on one host need their own ports (or
    # 127.0.0.1:0, or empty to disable). The bound must cover each start-up stage (the join has its
    # own bound, join_timeout_s; then loading the data and compiling the first step) and the
    # slowest step: minutes, not seconds (a large model compiles for minutes). In the synchronous
    # baselines (sync modes diloco, dp) a barrier wait for the syncer longer than the bound counts
    # as a stall too.
    health_bind: str = "0.0.0.0:8083"
    liveness_timeout_s: float = 300.0
    # Transport security towards the syncer (ddiloco.rpc.security): TLS, or explicit plaintext.
    tls_ca: str = ""  # CA bundle that signed the syncer's certificate
    tls_cert: str = ""  # this learner's certificate (identity spiffe://ddiloco/learner/<learner_id>)
    tls_key: str = ""
    tls_server_name: str = ""  # expected name in the syncer's certificate, if not the --syncer host
    insecure: bool = False  # plaintext: local runs only
    auth_token_file: str = ""  # bearer token bound to this learner id (TLS terminated elsewhere)
    # Fault tests only (ddiloco.chaos): crash points and the durable history of acknowledged uploads.
    failpoints: str = ""  # e.g. "learner.after_chunk=crash@5"; empty in production
    history_file: str = ""  # append each upload's acknowledgement (JSONL) here; empty: off
    log_level: str = "INFO"
    json_logs: bool = False
    # Resume (ddiloco/learner/snapshot.py, docs/operations.md): this learner's state on local disk,
    # written atomically every snapshot_every_steps steps or snapshot_interval_s seconds (whichever
    # first; 0 turns one off) and at exit; a restart with the same --learner-id continues from it.
    # Empty: off (`ddiloco up`, compose and the chart give each learner a directory).
    state_dir: str = ""
    snapshot_every_steps: int = 100
    snapshot_interval_s: float = 60.0

    def inner_optimizer(self, schedule_offset: int = 0) -> InnerOptConfig:
        """The inner AdamW's hyperparameters, with the LR decay resolved against --steps.

        ``schedule_offset``: the LR schedule's step when this life's step counter is 0 (the steps
        the learner's earlier lives ran, JoinResponse.schedule_start_step): the decay then ends
        where this life's --steps end, and every life of a restarted learner sees the same
        schedule (one that ran all its --steps in one life decays over them as before)."""
        decay_steps = self.lr_decay_steps
        if decay_steps == -1:  # over --steps; a run no longer than its warmup has nothing to decay
            horizon = schedule_offset + self.steps
            decay_steps = horizon if self.steps and horizon > self.warmup_steps else 0
        return InnerOptConfig(learning_rate=self.learning_rate, warmup_steps=self.warmup_steps,
                              weight_decay=self.weight_decay, decay_steps=decay_steps,
                              final_lr_fraction=self.lr_final_fraction)

    def __post_init__(self) -> None:
        try:
            failpoints_lib.parse(self.failpoints, prefix="learner.")
        except ValueError as exc:
            raise ValueError(f"LearnerConfig.failpoints={self.failpoints!r}: {exc}") from None
        for name in ("batch_size", "num_shards", "log_every_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"LearnerConfig.{name}={getattr(self, name)!r}: must be >= 1")
        for name in ("steps", "incarnation", "step_delay_s", "step_jitter", "finish_timeout_s", "liveness_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"LearnerConfig.{name}={getattr(self, name)!r}: must be >= 0")
        if not self.learner_id:
            raise ValueError("LearnerConfig.learner_id must not be empty")
        if self.snapshot_every_steps < 0 or self.snapshot_interval_s < 0:
            raise ValueError("LearnerConfig.snapshot_every_steps and snapshot_interval_s must be >= 0")
        self._check_data_spec()
        if self.lr_decay_steps < -1:
            raise ValueError(f"LearnerConfig.lr_decay_steps={self.lr_decay_steps}: -1 (over --steps), 0 (none) or N")
        self.inner_optimizer()  # a decay shorter than the warmup, or a bad fraction, fails at start
        if self.health_bind and ":" not in self.health_bind:
            raise ValueError(f"LearnerConfig.health_bind={self.health_bind!r}: use host:port, e.g. 0.0.0.0:8083")
        if self.upload_encoder not in UPLOAD_ENCODERS:
            raise ValueError(f"LearnerConfig.upload_encoder={self.upload_encoder!r}: one of {', '.join(UPLOAD_ENCODERS)}")
        if self.num_devices < 0:
            raise ValueError(f"LearnerConfig.num_devices={self.num_devices}: must be >= 0 (0: all)")
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"LearnerConfig.process_id={self.process_id}, num_processes={self.num_processes}: "
                "need num_processes >= 1 and 0 <= process_id < num_processes"
            )
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError("LearnerConfig.coordinator_address is required when num_processes > 1")
        if self.mesh_shape:
            parts = self.mesh_shape.lower().split("x")
            if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
                raise ValueError(f"LearnerConfig.mesh_shape={self.mesh_shape!r}: use DATAxFSDP, e.g. '4x1' or '2x2'")

    @property
    def pinned_shard_index(self) -> int:
        """The shard this learner chose itself: ``shard_index``, else the number ending
        ``learner_id`` after a separator (``learner-3``: 3, as a StatefulSet ordinal), modulo
        ``num_shards``; -1 for any other id (``--learner-id auto``: a container id), which asks the
        syncer for a shard at join: it hands out shards no live learner trains, so such learners do
        not collide (``JoinRequest.assign_data_shard``)."""
        if self.shard_index >= 0:
            return self.shard_index % self.num_shards
        numbered = _NUMBERED_ID.search(self.learner_id)
        return int(numbered.group(1)) % self.num_shards if numbered else -1

    @property
    def resolved_shard_index(self) -> int:
        """This learner's data shard: ``shard_index``, else the number ending ``learner_id`` after
        a separator (``learner-3``: 3, as a StatefulSet ordinal), else a sha256 of ``learner_id``
        (uniform over the shards and the same in every process, unlike ``hash()``); modulo
        ``num_shards``. Only used when the syncer does not assign shards (a syncer from before
        ``JoinResponse.data_shard_assigned``): hashed ids can then share a shard."""
        if self.shard_index >= 0:
            return self.shard_index % self.num_shards
        numbered = _NUMBERED_ID.search(self.learner_id)
        if numbered:
            return int(numbered.group(1)) % self.num_shards
        digest = hashlib.sha256(self.learner_id.encode("utf-8")).digest()
        return int.from_bytes(digest[:8], "big") % self.num_shards


@dataclasses.dataclass(frozen=True)
class EvaluatorConfig(_ClientFlags):
    """Each field is a flag and a DDILOCO_EVAL_* environment variable."""

    syncer: str = "127.0.0.1:50051"
    evaluator_id: str = "evaluator"
    interval_s: float = 15.0  # evaluate the global parameters this often
    once: bool = False  # evaluate once, print JSON, exit
    eval_batches: int = 8
    batch_size: int = 16
    data_dir: str = ""  # the data flags: as the learners' (see LearnerConfig)
    data_source: str = ""
    heldout_dir: str = ""
    token_dtype: str = ""
    max_corpus_bytes: int = 24 * 2**20
    num_shards: int = 4
    heldout_fraction: float = 0.05
    timeout_s: float = 120.0  # bound on waiting for the syncer / the global parameters
    call_timeout_s: float = 10.0
    # Transport security (see LearnerConfig); the evaluator's identity is kind `evaluator`.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    insecure: bool = False
    auth_token_file: str = ""
    log_level: str = "INFO"
    json_logs: bool = False

    def __post_init__(self) -> None:
        self._check_data_spec()


_HELP = {
    "syncer": "syncer host:port, or the comma-separated syncers of a run with leader election (the client "
              "follows the leader; docs/failover.md)",
    "learner_id": "stable learner identity (keep it across restarts); 'auto' or empty: <region>-<hostname>",
    "incarnation": "life counter; 0 uses the start time in ns",
    "region": "region label shown in the training state",
    "steps": "inner steps to run; 0 runs until SIGTERM",
    "batch_size": "sequences per inner step: the unit's global batch, split across its devices",
    "seed": "data-order seed (combined with the shard index and incarnation)",
    "data_dir": "training data: a directory of text files (recursive, any extension; binary and hidden files "
                "skipped), a flat token file (.bin), or a directory with nanoGPT's train.bin (+ val.bin, held out; "
                "+ meta.json); empty: the Python standard library sources (docs/data.md)",
    "data_source": "training data from your code instead of --data-dir: package.module:factory, a callable returning "
                   "an iterable of texts (str/bytes) or token-id arrays, or {'train': ..., 'heldout': ...} "
                   "(docs/data.md); it must yield the same items in every process",
    "heldout_dir": "held-out data for evaluation instead of --heldout-fraction: a directory of text files, or a "
                   ".bin token file for token data (inside --data-dir it is left out of training)",
    "token_dtype": "element type of .bin token files: uint16 (nanoGPT's) or uint32 (vocabularies over 65,536 ids); "
                   "empty: the dtype in meta.json next to the file, else uint16",
    "max_corpus_bytes": "read at most this many bytes of training data (a warning says when this truncates it)",
    "num_shards": "number of data shards (normally the number of learners)",
    "shard_index": "this learner's shard; -1: the number ending learner_id (learner-3: 3), modulo num_shards; "
                   "for other ids (--learner-id auto) the syncer assigns a shard no live learner trains",
    "heldout_fraction": "fraction of documents (of tokens, for a token file without val.bin) held out for "
                        "evaluation (never trained on); unused when a held-out split is named",
    "learning_rate": "inner AdamW peak learning rate",
    "warmup_steps": "inner learning-rate warmup steps",
    "lr_decay_steps": "cosine-decay the inner learning rate until this step; -1: over --steps (none if 0); 0: never",
    "lr_final_fraction": "the inner learning rate at the end of the decay, as a fraction of the peak",
    "weight_decay": "inner AdamW weight decay",
    "join_timeout_s": "wait this long for the syncer at start, then exit with status 3",
    "call_timeout_s": "deadline of each unary call to the syncer",
    "retry_bound_s": "overall bound on retrying one call",
    "finish_timeout_s": "at the end of training (or on SIGTERM), how long to wait until the global model holds "
                        "this learner's last contributions",
    "progress_interval_s": "how often progress metadata is sent (coalesced)",
    "step_delay_s": "extra seconds per inner step, to simulate slower hardware",
    "step_jitter": "relative jitter of step_delay_s (0.1 = +-10%)",
    "num_devices": "devices of each process this learner trains on (data-parallel inside the unit); 0: all visible",
    "mesh_shape": "DATAxFSDP mesh over all the unit's devices, e.g. 2x4; empty: all devices on the data axis "
                  "(replicated parameters), or on the fsdp axis with --fsdp",
    "fsdp": "shard parameters and optimizer state across the unit's devices (FSDP) instead of replicating them",
    "coordinator_address": "host:port of process 0 of a multi-host learner unit (jax.distributed coordinator)",
    "num_processes": "processes (hosts) in this learner unit; all run the same flags except --process-id",
    "process_id": "this process's index in the unit, 0..num_processes-1; only process 0 talks to the syncer",
    "log_every_steps": "log a progress line every this many steps",
    "summary_file": "write a JSON summary of the run here at exit",
    "compilation_cache_dir": "persist compiled XLA programs here (JAX's compilation cache, bounded to 512 MiB and "
                             "safe to share between learners): a restart loads them instead of compiling again; "
                             "empty: off",
    "upload_encoder": "host or jax: the implementation that quantizes uploads (same bytes); jax with a warm "
                      "--compilation-cache-dir makes restarts ~0.4 CPU-s cheaper (numba is never loaded)",
    "metrics_bind": "serve Prometheus metrics on host:port (e.g. 0.0.0.0:9093); empty: no metrics endpoint",
    "health_bind": "serve the gRPC health service (plaintext, Check only) on host:port for liveness probes; "
                   "NOT_SERVING once the training loop stalls (--liveness-timeout-s). Several learners on one "
                   "host: give each its own port, or 127.0.0.1:0; empty: off",
    "liveness_timeout_s": "report NOT_SERVING when the training loop has made no progress (start, join, an inner "
                          "step) for this many seconds; covers data loading, compilation of the first step and a "
                          "slow step; 0: never",
    "tls_ca": "TLS: CA bundle (PEM) to verify the syncer's certificate",
    "tls_cert": "mutual TLS: this process's certificate (PEM), whose identity must match its id",
    "tls_key": "mutual TLS: this process's private key (PEM)",
    "tls_server_name": "TLS: the name expected in the syncer's certificate (default: the host of --syncer)",
    "insecure": "talk plaintext to the syncer (local runs only; DDILOCO_INSECURE=1 sets it too)",
    "auth_token_file": "file with a bearer token bound to this identity (when TLS is terminated elsewhere)",
    "failpoints": "TESTS ONLY: crash at named points, e.g. learner.after_chunk=crash@5 (ddiloco.failpoints)",
    "history_file": "TESTS/CHAOS: append each upload's acknowledgement as JSONL here (invariant checks)",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "state_dir": "keep this learner's state here (optimizer state, counters, un-merged work, data position): a "
                 "restart with the same --learner-id resumes from it (docs/operations.md); one directory per "
                 "learner; empty: off",
    "snapshot_every_steps": "write the --state-dir snapshot every this many inner steps (0: only by time)",
    "snapshot_interval_s": "... and at least every this many seconds (0: only by steps); also at exit",
    "json_logs": "log one JSON object per line",
    "evaluator_id": "name shown with the reported losses",
    "interval_s": "seconds between evaluations",
    "once": "evaluate once, print a JSON line and exit",
    "eval_batches": "held-out batches per evaluation",
    "timeout_s": "bound on waiting for the syncer and the global parameters, and on each report (every syncer tried)",
}


def auto_learner_id(region: str, hostname: str) -> str:
    """The identity of `--learner-id auto`: `<region>-<hostname>` (hostname up to its first dot)."""
    host = hostname.split(".", 1)[0].strip()
    if not host:
        raise ValueError("--learner-id auto needs a hostname; set --learner-id explicitly")
    return f"{region}-{host}"


def parse_learner_config(argv: Sequence[str], environ: Mapping[str, str], hostname: str = "") -> LearnerConfig:
    """Parses flags and DDILOCO_LEARNER_* variables; `hostname` resolves `--learner-id auto` (or empty)."""
    # An empty id (flag or variable) means auto; rewritten before parsing, as the dataclass
    # refuses empty ids.
    environ = dict(environ)
    if environ.get("DDILOCO_LEARNER_LEARNER_ID") == "":
        environ["DDILOCO_LEARNER_LEARNER_ID"] = AUTO_LEARNER_ID
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--learner-id=" or (arg == "" and i > 0 and argv[i - 1] == "--learner-id"):
            argv[i] = arg + AUTO_LEARNER_ID
    environ = security.with_shared_insecure(environ, "DDILOCO_LEARNER_")
    cfg = flags.parse_dataclass(
        LearnerConfig, prog="ddiloco learner",
        description="A Decoupled DiLoCo learner: inner AdamW steps on its data shard, fragments synced in the background.",
        env_prefix="DDILOCO_LEARNER_", helps=_HELP, argv=argv, environ=environ,
    )
    if cfg.learner_id == AUTO_LEARNER_ID:
        cfg = dataclasses.replace(cfg, learner_id=auto_learner_id(cfg.region, hostname))
    return cfg


def parse_evaluator_config(argv: Sequence[str], environ: Mapping[str, str]) -> EvaluatorConfig:
    environ = security.with_shared_insecure(environ, "DDILOCO_EVAL_")
    cfg = flags.parse_dataclass(
        EvaluatorConfig, prog="ddiloco evaluate",
        description="Evaluates the syncer's global parameters on the held-out split and reports the loss.",
        env_prefix="DDILOCO_EVAL_", helps=_HELP, argv=argv, environ=environ,
    )
    return cfg
