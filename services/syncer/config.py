"""Syncer configuration: one frozen dataclass, parsed once from flags and environment in __main__."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

from ddiloco.cli import flags
from ddiloco.wire import codec as codec_lib

_RULES = ("rda", "mean")


@dataclasses.dataclass(frozen=True)
class SyncerConfig:
    """Everything the syncer needs; each field is a flag and a DDILOCO_SYNCER_* variable."""

    bind: str = "0.0.0.0:50051"  # host:port to serve on; port 0 picks a free port
    ready_file: str = ""  # if set, JSON {address, pid} is written here once serving
    run_id: str = "default"  # names the run in the checkpoint store; keep it across restarts
    checkpoint_target: str = ""  # host:port of the checkpoint store; empty disables checkpoints
    checkpoint_every_merges: int = 16  # checkpoint after this many merges (and on SIGTERM)
    checkpoint_timeout_s: float = 30.0  # overall bound for one checkpoint write, retries included
    restore_timeout_s: float = 30.0  # how long to wait for the store at start before giving up
    model: str = "transformer"  # model registry name
    model_config: str = '{"preset": "small"}'  # JSON overrides of the model's configuration
    seed: int = 0  # seed of the initial global parameters
    num_fragments: int = 4  # P
    sync_period_steps: int = 8  # H
    overlap_steps: int = 2  # tau
    min_quorum: int = 1  # K
    grace_gamma: float = 0.8  # safety factor of the adaptive grace window
    max_grace_s: float = 10.0  # upper bound on the grace window, whatever the measurements say
    upload_codec: str = "int4"
    upload_block_size: int = 128
    download_codec: str = "fp32"
    zstd_level: int = 3
    chunk_size_bytes: int = 512 * 1024
    max_staleness_versions: int = 4  # versions kept to correct stale contributions
    mixing_alpha: float = 0.0  # 0 = overwrite on arrival
    merge_rule: str = "rda"  # non-embedding tensors
    embedding_merge_rule: str = "mean"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    liveness_timeout_s: float = 15.0  # a learner silent this long no longer counts as expected
    max_concurrent_uploads: int = 64
    merge_history: int = 256  # merge records kept for the training state
    grace_s: float = 5.0  # shutdown: in-flight RPCs get this long to finish
    metrics_bind: str = ""  # host:port for Prometheus /metrics (port 0: any free port); empty disables
    log_level: str = "INFO"
    json_logs: bool = False

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"SyncerConfig.{field}={getattr(self, field)!r}: {why}")

        for name in ("num_fragments", "sync_period_steps", "min_quorum", "checkpoint_every_merges",
                     "upload_block_size", "chunk_size_bytes", "max_concurrent_uploads", "merge_history"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.max_staleness_versions < 0 or self.overlap_steps < 0:
            raise bad("max_staleness_versions" if self.max_staleness_versions < 0 else "overlap_steps", "must be >= 0")
        if not 0.0 <= self.grace_gamma <= 1.0:
            raise bad("grace_gamma", "must be in [0, 1]")
        if not 0.0 <= self.mixing_alpha < 1.0:
            raise bad("mixing_alpha", "must be in [0, 1); 0 overwrites the local fragment")
        for name in ("upload_codec", "download_codec"):
            if getattr(self, name) not in codec_lib.CODECS:
                raise bad(name, f"must be one of {codec_lib.CODECS}")
        for name in ("merge_rule", "embedding_merge_rule"):
            if getattr(self, name) not in _RULES:
                raise bad(name, f"must be one of {_RULES}")
        if self.chunk_size_bytes > 4 * 1024 * 1024:
            raise bad("chunk_size_bytes", "must be <= 4 MiB (gRPC message limit); 256 KiB-1 MiB is fastest")
        try:
            parsed = json.loads(self.model_config)
        except json.JSONDecodeError as exc:
            raise bad("model_config", f"is not valid JSON ({exc})") from None
        if not isinstance(parsed, dict):
            raise bad("model_config", "must be a JSON object")
        if ":" not in self.bind:
            raise bad("bind", "must be host:port")

    @property
    def model_overrides(self) -> dict:
        return json.loads(self.model_config)


def parse_config(argv: Sequence[str], environ: Mapping[str, str]) -> SyncerConfig:
    """Parses flags (with DDILOCO_SYNCER_* environment defaults) into a SyncerConfig."""
    helps = {
        "bind": "host:port to serve gRPC on (port 0: any free port)",
        "ready_file": "write {address, pid} JSON here once serving",
        "run_id": "run name in the checkpoint store; the same id restores the same run",
        "checkpoint_target": "checkpoint store host:port (empty: no checkpoints)",
        "checkpoint_every_merges": "checkpoint after this many merges (and on SIGTERM)",
        "checkpoint_timeout_s": "overall bound for writing one checkpoint, retries included",
        "restore_timeout_s": "wait this long for the checkpoint store at start, then exit non-zero",
        "model": "model registry name",
        "model_config": "JSON object overriding the model configuration",
        "seed": "seed of the initial global parameters",
        "num_fragments": "P: number of fragments (balanced bin-packing of whole tensors)",
        "sync_period_steps": "H: each fragment is synchronized every H local steps, staggered",
        "overlap_steps": "tau: local steps a fragment's communication may overlap (grace window)",
        "min_quorum": "K: contributions needed before a fragment is merged",
        "grace_gamma": "gamma: grace window = gamma*(tau*step_time - quorum_time - sync_time)",
        "max_grace_s": "cap on the grace window in seconds",
        "upload_codec": f"learner upload codec, one of {codec_lib.CODECS}",
        "upload_block_size": "values per quantization block for int8/int4 uploads",
        "download_codec": f"codec of global fragments sent to learners, one of {codec_lib.CODECS}",
        "zstd_level": "zstd level for uploads and downloads",
        "chunk_size_bytes": "payload chunk size for streams (256 KiB-1 MiB is fastest)",
        "max_staleness_versions": "refuse contributions based more than this many versions back",
        "mixing_alpha": "0: learners overwrite a fragment on arrival; else local*alpha + global*(1-alpha)",
        "merge_rule": "merge of non-embedding tensors: rda (radial-directional) or mean",
        "embedding_merge_rule": "merge of embedding tensors: mean or rda",
        "outer_lr": "outer Nesterov SGD learning rate",
        "outer_momentum": "outer Nesterov SGD momentum",
        "liveness_timeout_s": "a learner silent this long stops counting towards a round's expected size",
        "max_concurrent_uploads": "uploads in flight at once, over all learners (RESOURCE_EXHAUSTED above)",
        "merge_history": "merge records kept for the training state",
        "grace_s": "on shutdown, in-flight RPCs get this many seconds to finish",
        "metrics_bind": "serve Prometheus metrics on host:port (e.g. 0.0.0.0:9091); empty: no metrics endpoint",
        "log_level": "DEBUG, INFO, WARNING or ERROR",
        "json_logs": "log one JSON object per line",
    }
    return flags.parse_dataclass(
        SyncerConfig,
        prog="ddiloco syncer",
        description="The Decoupled DiLoCo syncer: merges pseudo-gradient fragments from learners "
        "and streams new global fragments back.",
        env_prefix="DDILOCO_SYNCER_",
        helps=helps,
        argv=argv,
        environ=environ,
    )
