"""The syncer core's configuration in plain values: what it is built with (SyncerCore's `run` and
`settings`).

Owns `RunSettings` (the run's configuration learners adopt: the RunConfig without the fragment
plan; wire_views.run_config gives its protobuf form), `CoreSettings` (the syncer's own knobs: outer
optimizer, grace window, liveness, quarantine, robustness, rounds, budget, shard layout), both made
from a SyncerConfig by their `of`, and `round_settings` (what the rounds read of the run).
Must not: import generated protobuf code, read flags or the environment (services/syncer/config.py
does).
"""

from __future__ import annotations

import dataclasses

from ddiloco.algo import outer as outer_lib
from ddiloco.algo import robust as robust_lib
from ddiloco.algo import shards as shards_lib
from . import merging as merging_lib

ROUND_TRIGGERS = ("schedule", "upload")


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The run's configuration learners adopt, in plain values: the RunConfig without the fragment
    plan (the core holds it beside). Made from the syncer's flags by `of`; wire_views.run_config
    gives the RunConfig of it and the plan."""

    run_id: str
    model_name: str
    model_config_json: str
    model_fingerprint: str
    overlap_steps: int  # tau
    min_quorum: int  # K
    upload_codec: str  # by name (ddiloco.wire.codec), as download_codec
    upload_block_size: int
    download_codec: str
    chunk_size_bytes: int
    max_staleness_versions: int
    mixing_alpha: float
    zstd_level: int
    merge_rule: str
    embedding_merge_rule: str
    sync_mode: str  # "" or "decoupled": the rounds follow the schedule (with round_trigger "schedule")
    init_seed: int
    on_arrival: str
    round_trigger: str

    @classmethod
    def of(cls, cfg, *, model_name: str, model_config_json: str, fingerprint: str) -> RunSettings:
        """The settings of a syncer started with `cfg` (a SyncerConfig) for this model."""
        return cls(
            run_id=cfg.run_id, model_name=model_name, model_config_json=model_config_json,
            model_fingerprint=fingerprint, overlap_steps=cfg.overlap_steps, min_quorum=cfg.min_quorum,
            upload_codec=cfg.upload_codec, upload_block_size=cfg.upload_block_size,
            download_codec=cfg.download_codec, chunk_size_bytes=cfg.chunk_size_bytes,
            max_staleness_versions=cfg.max_staleness_versions, mixing_alpha=cfg.mixing_alpha,
            zstd_level=cfg.zstd_level, merge_rule=cfg.merge_rule, embedding_merge_rule=cfg.embedding_merge_rule,
            sync_mode=cfg.sync_mode, init_seed=cfg.seed, on_arrival=cfg.on_arrival, round_trigger=cfg.round_trigger)


def round_settings(run: RunSettings) -> merging_lib.RoundSettings:
    """What the rounds read of the run."""
    return merging_lib.RoundSettings(
        merge_rule=run.merge_rule, embedding_merge_rule=run.embedding_merge_rule, overlap_steps=run.overlap_steps,
        min_quorum=run.min_quorum, max_staleness_versions=run.max_staleness_versions)


@dataclasses.dataclass(frozen=True)
class CoreSettings:
    """The syncer's own knobs, as the core acts on them (`of` takes them from a SyncerConfig; see
    it for each one's meaning). `quarantine_after` 0 disables quarantine; `quarantine_s` 0
    quarantines until restart. `norm_bound` / `direction`: None is the default bound, and no
    direction check. `max_decoding`: contributions between decode and fold-in at once (None: see
    backpressure.decoding_bound). `round_trigger`: "schedule" (decoupled mode: rounds open on the
    syncer's schedule, ddiloco.algo.rounds) or "upload" (a round opens with its first contribution;
    the synchronous modes, whose learners upload together, always use it). `outer_step_fraction`:
    "steps", "work" or "whole" (ddiloco.algo.outer.merge_share). `token_budget`: the run ends once
    tokens_processed() reaches it (0: never; see budget_reached). `shard_layout`: None, one syncer
    owns every fragment."""

    outer_lr: float
    outer_momentum: float
    grace_gamma: float
    max_grace_s: float
    liveness_timeout_s: float
    merge_history: int
    norm_bound: robust_lib.NormBoundPolicy | None = None
    quarantine_after: int = 3
    quarantine_window_s: float = 600.0
    quarantine_s: float = 3600.0
    direction: robust_lib.DirectionPolicy | None = None
    max_decoding: int | None = None
    round_trigger: str = "schedule"
    outer_step_fraction: str = "whole"
    token_budget: int = 0
    shard_layout: shards_lib.ShardLayout | None = None

    def __post_init__(self) -> None:
        if self.round_trigger not in ROUND_TRIGGERS:
            raise ValueError(f"round_trigger={self.round_trigger!r} is not one of {ROUND_TRIGGERS}")
        if self.outer_step_fraction not in outer_lib.OUTER_STEP_FRACTIONS:
            raise ValueError(f"outer_step_fraction={self.outer_step_fraction!r} is not one of "
                             f"{outer_lib.OUTER_STEP_FRACTIONS}")
        if self.token_budget < 0:
            raise ValueError(f"token_budget={self.token_budget} must be >= 0")

    @classmethod
    def of(cls, cfg) -> CoreSettings:
        """The knobs of a syncer started with `cfg` (a SyncerConfig)."""
        return cls(
            outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum, grace_gamma=cfg.grace_gamma,
            max_grace_s=cfg.max_grace_s, liveness_timeout_s=cfg.liveness_timeout_s, merge_history=cfg.merge_history,
            norm_bound=cfg.norm_bound, quarantine_after=cfg.quarantine_after, quarantine_window_s=cfg.quarantine_window_s,
            quarantine_s=cfg.quarantine_s, direction=cfg.direction_policy, round_trigger=cfg.round_trigger,
            outer_step_fraction=cfg.outer_step_fraction, token_budget=cfg.token_budget, shard_layout=cfg.shard_layout)
