"""Learner and evaluator configuration: frozen dataclasses parsed once from flags and environment."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ddiloco.cli import flags

# `--learner-id auto` (or an empty value): `<region>-<hostname>`, resolved in parse_learner_config.
# In a container the hostname is the container id, so every replica of a scaled compose service
# gets its own identity, and keeps it when the same container restarts.
AUTO_LEARNER_ID = "auto"


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """Each field is a flag and a DDILOCO_LEARNER_* environment variable."""

    syncer: str = "127.0.0.1:50051"  # syncer host:port
    learner_id: str = "learner-0"  # stable identity; a restarted learner keeps it; "auto": <region>-<hostname>
    incarnation: int = 0  # 0: the start time in ns (grows with each life)
    region: str = "local"
    steps: int = 0  # inner steps to run; 0 runs until SIGTERM
    batch_size: int = 16
    seed: int = 0
    data_dir: str = ""  # directory of text files; empty: the Python standard library's sources
    max_corpus_bytes: int = 24 * 2**20
    num_shards: int = 4
    shard_index: int = -1  # -1: the trailing number of learner_id, modulo num_shards
    heldout_fraction: float = 0.05
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    join_timeout_s: float = 120.0  # wait this long for the syncer at start, then exit non-zero
    call_timeout_s: float = 10.0
    retry_bound_s: float = 30.0
    progress_interval_s: float = 0.25
    step_delay_s: float = 0.0  # extra seconds per step: simulates slower hardware
    step_jitter: float = 0.0  # relative jitter of step_delay_s
    log_every_steps: int = 25
    summary_file: str = ""  # write a JSON summary here at exit
    metrics_bind: str = ""  # host:port for Prometheus /metrics; empty disables
    log_level: str = "INFO"
    json_logs: bool = False

    def __post_init__(self) -> None:
        for name in ("batch_size", "num_shards", "log_every_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"LearnerConfig.{name}={getattr(self, name)!r}: must be >= 1")
        for name in ("steps", "incarnation", "step_delay_s", "step_jitter"):
            if getattr(self, name) < 0:
                raise ValueError(f"LearnerConfig.{name}={getattr(self, name)!r}: must be >= 0")
        if not self.learner_id:
            raise ValueError("LearnerConfig.learner_id must not be empty")

    @property
    def resolved_shard_index(self) -> int:
        if self.shard_index >= 0:
            return self.shard_index % self.num_shards
        digits = ""
        for ch in reversed(self.learner_id):
            if not ch.isdigit():
                break
            digits = ch + digits
        return int(digits or 0) % self.num_shards


@dataclasses.dataclass(frozen=True)
class EvaluatorConfig:
    """Each field is a flag and a DDILOCO_EVAL_* environment variable."""

    syncer: str = "127.0.0.1:50051"
    evaluator_id: str = "evaluator"
    interval_s: float = 15.0  # evaluate the global parameters this often
    once: bool = False  # evaluate once, print JSON, exit
    eval_batches: int = 8
    batch_size: int = 16
    data_dir: str = ""
    max_corpus_bytes: int = 24 * 2**20
    num_shards: int = 4
    heldout_fraction: float = 0.05
    timeout_s: float = 120.0  # bound on waiting for the syncer / the global parameters
    call_timeout_s: float = 10.0
    log_level: str = "INFO"
    json_logs: bool = False


_HELP = {
    "syncer": "syncer host:port",
    "learner_id": "stable learner identity (keep it across restarts); 'auto' or empty: <region>-<hostname>",
    "incarnation": "life counter; 0 uses the start time in ns",
    "region": "region label shown in the training state",
    "steps": "inner steps to run; 0 runs until SIGTERM",
    "batch_size": "sequences per inner step",
    "seed": "data-order seed (combined with the shard index and incarnation)",
    "data_dir": "directory of text files to train on; empty uses the Python standard library sources",
    "max_corpus_bytes": "read at most this many bytes of corpus",
    "num_shards": "number of data shards (normally the number of learners)",
    "shard_index": "this learner's shard; -1 derives it from learner_id's trailing number",
    "heldout_fraction": "fraction of documents held out for evaluation (never trained on)",
    "learning_rate": "inner AdamW peak learning rate",
    "warmup_steps": "inner learning-rate warmup steps",
    "weight_decay": "inner AdamW weight decay",
    "join_timeout_s": "wait this long for the syncer at start, then exit with status 3",
    "call_timeout_s": "deadline of each unary call to the syncer",
    "retry_bound_s": "overall bound on retrying one call",
    "progress_interval_s": "how often progress metadata is sent (coalesced)",
    "step_delay_s": "extra seconds per inner step, to simulate slower hardware",
    "step_jitter": "relative jitter of step_delay_s (0.1 = +-10%)",
    "log_every_steps": "log a progress line every this many steps",
    "summary_file": "write a JSON summary of the run here at exit",
    "metrics_bind": "serve Prometheus metrics on host:port (e.g. 0.0.0.0:9093); empty: no metrics endpoint",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "json_logs": "log one JSON object per line",
    "evaluator_id": "name shown with the reported losses",
    "interval_s": "seconds between evaluations",
    "once": "evaluate once, print a JSON line and exit",
    "eval_batches": "held-out batches per evaluation",
    "timeout_s": "bound on waiting for the syncer and the global parameters",
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
    cfg = flags.parse_dataclass(
        LearnerConfig, prog="ddiloco learner",
        description="A Decoupled DiLoCo learner: inner AdamW steps on its data shard, fragments synced in the background.",
        env_prefix="DDILOCO_LEARNER_", helps=_HELP, argv=argv, environ=environ,
    )
    if cfg.learner_id == AUTO_LEARNER_ID:
        cfg = dataclasses.replace(cfg, learner_id=auto_learner_id(cfg.region, hostname))
    return cfg


def parse_evaluator_config(argv: Sequence[str], environ: Mapping[str, str]) -> EvaluatorConfig:
    return flags.parse_dataclass(
        EvaluatorConfig, prog="ddiloco evaluate",
        description="Evaluates the syncer's global parameters on the held-out split and reports the loss.",
        env_prefix="DDILOCO_EVAL_", helps=_HELP, argv=argv, environ=environ,
    )
