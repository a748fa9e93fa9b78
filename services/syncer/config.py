"""Syncer configuration: one frozen dataclass, parsed once from flags and environment in __main__."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

from ddiloco.algo import choices
from ddiloco.algo import robust as robust_lib
from ddiloco.algo import rounds as rounds_lib
from ddiloco.algo import shards as shards_lib
from ddiloco import failpoints as failpoints_lib
from ddiloco import flags
from ddiloco.coord import etcd as etcd_lib
from ddiloco.rpc import security
from ddiloco.wire import codec as codec_lib

# The merge rules and outer step fractions from ddiloco.algo.choices: this module stays free of the
# kernels (numba, jax) that ddiloco.algo.merge and ddiloco.algo.outer load.
_RULES, OUTER_STEP_FRACTIONS = choices.RULES, choices.OUTER_STEP_FRACTIONS


@dataclasses.dataclass(frozen=True)
class SyncerConfig:
    """Everything the syncer needs; each field is a flag and a DDILOCO_SYNCER_* variable."""

    bind: str = "0.0.0.0:50051"  # host:port to serve on; port 0 picks a free port
    # decoupled (Decoupled DiLoCo), or a baseline for comparisons: diloco (synchronous DiLoCo) or
    # dp (data-parallel through the syncer). The baselines fix some knobs: see apply_sync_mode.
    sync_mode: str = rounds_lib.DECOUPLED
    ready_file: str = ""  # if set, JSON {address, pid} is written here once serving
    run_id: str = "default"  # names the run in the checkpoint store; keep it across restarts
    # Fragment shards (docs/architecture.md, "Fragment shards"): this process's index in the shard
    # map, and the map (one entry per shard in index order, comma-separated; failover addresses of
    # one shard joined by '|'). Empty map: unsharded, this process owns every fragment.
    fragment_shard: int = 0
    fragment_shards: str = ""
    checkpoint_target: str = ""  # host:port of the checkpoint store; empty disables checkpoints
    # Replicated stores (--checkpoint-target a,b[,c]): stores that must take each blob and manifest;
    # 0: 2 with two or more stores (a checkpoint survives losing any one store), else 1.
    checkpoint_write_quorum: int = 0
    checkpoint_repair_interval_s: float = 30.0  # replicated stores: background repair pass period
    checkpoint_every_merges: int = 16  # checkpoint after this many merges (and on SIGTERM)
    checkpoint_timeout_s: float = 30.0  # overall bound for one checkpoint write, retries included
    # Every merge committed in a checkpoint before its version is sent (commit_gate.py): a crash or
    # failover then loses no merge a learner received, for one checkpoint per merge.
    commit_before_broadcast: bool = False
    restore_timeout_s: float = 30.0  # how long to wait for the store at start before giving up
    model: str = "transformer"  # model registry name
    model_config: str = '{"preset": "small"}'  # JSON overrides of the model's configuration
    seed: int = 0  # seed of the initial global parameters
    num_fragments: int = 4  # P
    sync_period_steps: int = 8  # H
    overlap_steps: int = 4  # tau: steps a round may take from its call to the broadcast (grace window)
    min_quorum: int = 1  # K
    grace_gamma: float = 0.8  # safety factor of the adaptive grace window
    max_grace_s: float = 10.0  # upper bound on the grace window, whatever the measurements say
    upload_codec: str = "int4"
    upload_block_size: int = 128
    # int4: each new version goes down as an error-fed int4 delta (learners hold exactly what the
    # syncer reconstructs); as good as fp32 on held-out loss and 4x fewer bytes down
    # (bench/results/quality.md). fp32 sends every version whole.
    download_codec: str = "int4"
    zstd_level: int = 3
    chunk_size_bytes: int = 512 * 1024
    max_staleness_versions: int = 4  # versions kept to correct stale contributions
    mixing_alpha: float = 0.0  # the "mix" on-arrival rule's weight of the local fragment
    # What learners do with a new global version (ddiloco.algo.arrival): rebase keeps their
    # un-merged work; overwrite is the paper's rule; mix blends with mixing_alpha.
    on_arrival: str = "rebase"
    # schedule: the syncer opens rounds and calls every learner (ddiloco.algo.rounds); upload: a
    # round opens with its first contribution, learners follow their own counters (the old design).
    round_trigger: str = "schedule"
    merge_rule: str = "rda"  # non-embedding tensors
    embedding_merge_rule: str = "mean"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    # work (the default): a merge is the fraction s x q of a Nesterov step on the merged delta x q
    # (ddiloco.algo.outer.merge_share), s = (token-weighted mean inner steps) / H and q =
    # contributors / expected learners: learners a round expected but did not get count as zero
    # pseudo-gradients, so lone merges of desynchronised learners add up to one step per round of
    # work. A merge of every expected learner is the same as with steps.
    # steps: s of a step on the whole delta whatever the learners (a short round adds no whole
    # momentum push; many rounds' work at once feeds the momentum one round's rate). Each lone
    # merge then takes a whole round's step, and a stale contribution re-anchored by the syncer's
    # own last move sends that move back amplified: the loop diverges in pure loop tests
    # (tests/unit/test_partial_merges.py), and `ddiloco up` with 2 unpaced learners on a loaded
    # machine failed to lower its held-out loss by 0.5 in 3 of 10 runs (0 of 4 with work;
    # docs/internals.md). bench/results' goodput (abd07e4) and quality-work (92289c0) are measured
    # with work; bench quality's outer-steps ablation runs steps.
    # whole: every merge is one step; the baselines always use it.
    outer_step_fraction: str = "work"
    # The data-parallel baseline's optimizer (AdamW on the syncer, ddiloco.algo.inner); the
    # defaults are the learners' inner defaults.
    dp_learning_rate: float = 2e-3
    dp_warmup_steps: int = 20
    dp_decay_steps: int = 0  # cosine-decay the dp LR until this step (0: none), as learners do over --steps
    dp_weight_decay: float = 0.1
    liveness_timeout_s: float = 15.0  # a learner silent this long no longer counts as expected
    # The run ends once the learners processed this many tokens, all of them together (0: each
    # learner runs its own --steps). Learners hear it in their progress reports, contribute their
    # remaining work and leave; a learner that was down does not hold the end of the run back.
    token_budget: int = 0
    max_concurrent_uploads: int = 64
    merge_history: int = 256  # merge records kept for the training state
    grace_s: float = 5.0  # shutdown: in-flight RPCs get this long to finish
    metrics_bind: str = ""  # host:port for Prometheus /metrics (port 0: any free port); empty disables
    # Transport security and identity (ddiloco.rpc.security): mutual TLS, or explicit plaintext.
    tls_ca: str = ""  # CA bundle that signed every client certificate
    tls_cert: str = ""  # this syncer's certificate (also its client certificate towards the store)
    tls_key: str = ""
    insecure: bool = False  # plaintext, no client certificates: local runs and trusted networks only
    auth_tokens_file: str = ""  # bearer tokens -> identities, with revocations (TLS terminated elsewhere)
    tls_deny_list: str = ""  # revoked client certificates: serials or identities, one a line (re-read on change)
    checkpoint_auth_token_file: str = ""  # bearer token presented to the checkpoint store
    checkpoint_tls_server_name: str = ""  # name expected in the store's certificate, if not its host
    health_bind: str = ""  # also serve the health service alone, in plaintext, here (probes)
    # Leader election (docs/failover.md): etcd endpoints; empty runs one syncer, as before.
    coord_etcd: str = ""
    coord_lease_s: int = 3  # the leader's lease: a dead leader is replaced within about this long
    coord_prefix: str = "/ddiloco"  # etcd key prefix of this deployment's election and commit keys
    coord_advertise: str = ""  # host:port learners reach this syncer at (default: its bound address)
    coord_call_timeout_s: float = 1.0  # deadline of one etcd call
    # TLS towards etcd (https:// endpoints; an etcd with --client-cert-auth needs the cert and key):
    # etcd's CA, this syncer's etcd client certificate and key, the name in etcd's certificate.
    coord_tls_ca: str = ""
    coord_tls_cert: str = ""
    coord_tls_key: str = ""
    coord_tls_server_name: str = ""
    # Bad input and hostile learners.
    max_concurrent_uploads_per_learner: int = 4
    upload_idle_timeout_s: float = 60.0  # an upload stream silent this long is refused
    # Concurrent watch streams, in total and per authenticated identity (servicer.StreamCap).
    max_state_watchers: int = 64
    max_state_watchers_per_identity: int = 16
    max_fragment_watchers: int = 1024
    max_fragment_watchers_per_identity: int = 8
    norm_bound_factor: float = 20.0  # k: contribution norm <= k x median of other learners'; 0 disables
    norm_bound_action: str = "reject"  # reject or clip contributions beyond the bound
    norm_bound_min_history: int = 3  # other learners' contributions needed before per-tensor bounds
    quarantine_after: int = 3  # suspicious uploads within the window that quarantine a learner; 0 never
    quarantine_window_s: float = 600.0
    quarantine_s: float = 3600.0  # how long a quarantine lasts; 0 until restart
    direction_check: str = "reject"  # off, or reject contributions pointing away from other learners'
    direction_min_cosine: float = -0.25  # reject below this cosine with other learners' (and recent mean)
    direction_judge_wait_s: float = 8.0  # a contribution with < 2 others to compare with waits this long for them
    # Bounded influence (docs/security.md#bounded-influence, robust.NormBoundPolicy).
    max_merge_share: float = 0.5  # no contribution above this share of a merge's total weight; 1: no cap
    max_batch_ratio: float = 4.0  # claimed tokens per step clipped to this x the other learners' median
    norm_clip_factor: float = 4.0  # per-step norm clipped to this x the other learners' median; 0: off
    unverified_clip_factor: float = 2.0  # the merge's clip of contributions with unverified claims or norms; 0: off
    merge_ledger: str = ""  # append one JSON record per merge (hash-chained) here; empty: off
    merge_ledger_max_bytes: int = 64 << 20  # rotate to <file>.1 beyond this (at most twice this on disk)
    store_ledger: bool = True  # with a checkpoint store: every merge record goes to its ledger too
    retain_contributions: bool = False  # store each merged contribution as a blob (`ddiloco audit replay`)
    # Fault tests only (ddiloco.chaos): crash points and the durable history the checkers read.
    failpoints: str = ""  # e.g. "syncer.after_quorum=crash@3"; empty in production
    history_file: str = ""  # append accepted uploads, merges, checkpoints (JSONL) here; empty: off
    log_level: str = "INFO"
    json_logs: bool = False

    def __post_init__(self) -> None:
        # Two named halves, checked in this order (the first bad field is the one reported).
        self._check_protocol()
        self._check_service()

    def _bad(self, field: str, why: str) -> ValueError:
        return ValueError(f"SyncerConfig.{field}={getattr(self, field)!r}: {why}")

    def _check_protocol(self) -> None:
        """The algorithm and wire settings: sizes, rules, codecs, the model and the bind address."""
        bad = self._bad
        for name in ("num_fragments", "sync_period_steps", "min_quorum", "checkpoint_every_merges",
                     "upload_block_size", "chunk_size_bytes", "max_concurrent_uploads", "merge_history"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.max_staleness_versions < 0 or self.overlap_steps < 0:
            raise bad("max_staleness_versions" if self.max_staleness_versions < 0 else "overlap_steps", "must be >= 0")
        if not 0.0 <= self.grace_gamma <= 1.0:
            raise bad("grace_gamma", "must be in [0, 1]")
        if not 0.0 <= self.mixing_alpha < 1.0:
            raise bad("mixing_alpha", "must be in [0, 1)")
        if self.on_arrival not in ("rebase", "overwrite", "mix"):
            raise bad("on_arrival", "must be rebase, overwrite or mix")
        if self.on_arrival == "mix" and self.mixing_alpha == 0.0:
            raise bad("on_arrival", "mix needs --mixing-alpha in (0, 1)")
        if self.round_trigger not in ("schedule", "upload"):
            raise bad("round_trigger", "must be schedule or upload")
        for name in ("upload_codec", "download_codec"):
            if getattr(self, name) not in codec_lib.CODECS:
                raise bad(name, f"must be one of {codec_lib.CODECS}")
        if self.outer_step_fraction not in OUTER_STEP_FRACTIONS:
            raise bad("outer_step_fraction", f"must be one of {OUTER_STEP_FRACTIONS}")
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

    def _check_service(self) -> None:
        """Limits, coordination, robustness, the dp baseline, checkpoints and failpoints."""
        bad = self._bad
        for name in ("max_concurrent_uploads_per_learner", "norm_bound_min_history", "max_state_watchers",
                     "max_state_watchers_per_identity", "max_fragment_watchers", "max_fragment_watchers_per_identity"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.coord_etcd:
            try:
                etcd_lib.parse_endpoints(self.coord_etcd)
            except ValueError as exc:
                raise bad("coord_etcd", str(exc)) from None
            if self.coord_lease_s < 2:
                raise bad("coord_lease_s", "must be >= 2 (etcd grants no shorter lease)")
            if self.coord_call_timeout_s <= 0 or self.coord_call_timeout_s >= self.coord_lease_s / 2:
                raise bad("coord_call_timeout_s", "must be > 0 and below half of --coord-lease-s")
        self._check_coord_tls()
        for name in ("norm_bound_factor", "quarantine_after", "quarantine_window_s", "quarantine_s"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        if not 0.5 <= self.max_merge_share <= 1.0:
            raise bad("max_merge_share", "must be in [0.5, 1] (1: no cap)")
        for name in ("max_batch_ratio", "norm_clip_factor", "unverified_clip_factor", "merge_ledger_max_bytes"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        if self.upload_idle_timeout_s <= 0:
            raise bad("upload_idle_timeout_s", "must be > 0")
        if self.token_budget < 0:
            raise bad("token_budget", "must be >= 0 (0: no budget)")
        if self.sync_mode not in rounds_lib.SYNC_MODES:
            raise bad("sync_mode", f"must be one of {rounds_lib.SYNC_MODES}")
        if self.dp_decay_steps and self.dp_decay_steps <= self.dp_warmup_steps:
            raise bad("dp_decay_steps", "dp_decay_steps must be 0 (no decay) or exceed dp_warmup_steps")
        if not self.dp_learning_rate > 0 or self.dp_warmup_steps < 0 or self.dp_weight_decay < 0:
            raise bad("dp_learning_rate", "dp_learning_rate must be > 0, dp_warmup_steps and dp_weight_decay >= 0")
        if self.commit_before_broadcast and not self.checkpoint_target:
            raise bad("commit_before_broadcast", "needs --checkpoint-target (the checkpoints it commits go there)")
        if self.retain_contributions and not (self.checkpoint_target and self.store_ledger):
            raise bad("retain_contributions", "needs --checkpoint-target and --store-ledger (the blobs go there)")
        if self.norm_bound_action not in robust_lib.ACTIONS:
            raise bad("norm_bound_action", f"must be one of {robust_lib.ACTIONS}")
        if self.direction_check not in robust_lib.DIRECTION_MODES:
            raise bad("direction_check", f"must be one of {robust_lib.DIRECTION_MODES}")
        if not -1.0 <= self.direction_min_cosine <= 1.0:
            raise bad("direction_min_cosine", "must be in [-1, 1]")
        if not self.direction_judge_wait_s >= 0:
            raise bad("direction_judge_wait_s", "must be >= 0")
        if self.health_bind and ":" not in self.health_bind:
            raise bad("health_bind", "must be host:port")
        if not 0 <= self.checkpoint_write_quorum <= max(1, len(self.checkpoint_targets)):
            raise bad("checkpoint_write_quorum", f"must be 0 (default) or 1..{len(self.checkpoint_targets)}, the "
                      "number of --checkpoint-target stores")
        if not self.checkpoint_repair_interval_s > 0:
            raise bad("checkpoint_repair_interval_s", "must be > 0")
        try:
            self.shard_layout  # noqa: B018 - parses and checks the map against the fragments
        except ValueError as exc:
            raise bad("fragment_shards", str(exc)) from None
        try:
            failpoints_lib.parse(self.failpoints, prefix="syncer.")
        except ValueError as exc:
            raise bad("failpoints", str(exc)) from None

    def _check_coord_tls(self) -> None:
        """--coord-tls-*: only with --coord-etcd, agreeing with the endpoints' scheme, cert with key."""
        bad = self._bad
        given = [n for n in ("coord_tls_ca", "coord_tls_cert", "coord_tls_key", "coord_tls_server_name")
                 if getattr(self, n)]
        if given and not self.coord_etcd:
            raise bad(given[0], "is TLS towards etcd: it needs --coord-etcd")
        if not self.coord_etcd:
            return
        try:
            scheme = etcd_lib.endpoints_scheme(self.coord_etcd)
        except ValueError as exc:
            raise bad("coord_etcd", str(exc)) from None
        if given and not self.coord_tls_ca:
            raise bad(given[0], "needs --coord-tls-ca, the CA that signed etcd's server certificate")
        if scheme == "https" and not self.coord_tls_ca:
            raise bad("coord_etcd", "https:// endpoints need --coord-tls-ca (etcd's CA), and --coord-tls-cert/"
                      "--coord-tls-key when etcd requires client certificates (--client-cert-auth)")
        if scheme == "http" and self.coord_tls_ca:
            raise bad("coord_etcd", "http:// endpoints contradict --coord-tls-ca: write them https://")
        if bool(self.coord_tls_cert) != bool(self.coord_tls_key):
            raise bad("coord_tls_cert" if self.coord_tls_cert else "coord_tls_key",
                      "--coord-tls-cert and --coord-tls-key go together")

    def coord_security(self) -> security.ClientSecurity:
        """How the syncer reaches etcd: TLS with --coord-tls-ca (its own etcd client certificate when
        given), else plaintext."""
        return security.ClientSecurity(tls_ca=self.coord_tls_ca, tls_cert=self.coord_tls_cert,
                                       tls_key=self.coord_tls_key, tls_server_name=self.coord_tls_server_name,
                                       insecure=not self.coord_tls_ca)

    def _own_tls(self) -> dict[str, str | bool]:
        """The syncer's own CA, certificate and key (or plaintext): its server's, and its client
        certificate towards the store."""
        return {"tls_ca": self.tls_ca, "tls_cert": self.tls_cert, "tls_key": self.tls_key, "insecure": self.insecure}

    def server_security(self) -> security.ServerSecurity:
        """ValueError unless mutual TLS is fully configured or plaintext was asked for."""
        return security.ServerSecurity(**self._own_tls(), auth_tokens_file=self.auth_tokens_file,
                                       tls_deny_list=self.tls_deny_list)

    def checkpoint_security(self) -> security.ClientSecurity:
        """How the syncer reaches the store: its own certificate as the client certificate."""
        return security.ClientSecurity(**self._own_tls(), tls_server_name=self.checkpoint_tls_server_name,
                                       auth_token_file=self.checkpoint_auth_token_file)

    @property
    def shard_layout(self) -> shards_lib.ShardLayout:
        """Which fragments this process owns (--fragment-shard of --fragment-shards)."""
        return shards_lib.ShardLayout(num_fragments=self.num_fragments, index=self.fragment_shard,
                                      addresses=shards_lib.parse_shard_map(self.fragment_shards))

    @property
    def store_run_id(self) -> str:
        """The run's name in the checkpoint store for this shard's checkpoints, ledger and election."""
        return self.shard_layout.store_run_id(self.run_id)

    @property
    def checkpoint_targets(self) -> list[str]:
        """The checkpoint stores: --checkpoint-target split at commas (one store: today's single store)."""
        return [t.strip() for t in self.checkpoint_target.split(",") if t.strip()]

    @property
    def norm_bound(self) -> robust_lib.NormBoundPolicy:
        return robust_lib.NormBoundPolicy(factor=self.norm_bound_factor, action=self.norm_bound_action,
                                          min_history=self.norm_bound_min_history,
                                          history=max(16, self.norm_bound_min_history),
                                          batch_factor=self.max_batch_ratio, clip_factor=self.norm_clip_factor,
                                          unverified_clip_factor=self.unverified_clip_factor,
                                          max_share=self.max_merge_share)

    @property
    def direction_policy(self) -> robust_lib.DirectionPolicy:
        return robust_lib.DirectionPolicy(mode=self.direction_check, min_cosine=self.direction_min_cosine,
                                          judge_wait_s=self.direction_judge_wait_s,
                                          max_age_versions=max(1, self.max_staleness_versions))

    @property
    def model_overrides(self) -> dict:
        return json.loads(self.model_config)


def apply_sync_mode(cfg: SyncerConfig) -> SyncerConfig:
    """The effective configuration of a sync mode: what makes each baseline what it is.

    * diloco: classic synchronous DiLoCo as published (Douillard et al., 2023): the outer
      gradient is the plain mean of the learners' pseudo-gradients with equal weights (merge
      rule "equal_mean" for every tensor, embeddings included: no radial-directional averaging,
      no tokens²/steps weights). No grace window (merge as soon as the quorum is in), lossless
      fp32 both ways, overwrite on arrival, every merge a whole outer step; fragments are planned unstaggered (all due together)
      and learners wait for each merge. Set --min-quorum to the number of learners for the
      classic algorithm (all learners every H steps). The merge rules are forced, whatever
      --merge-rule and --embedding-merge-rule say: the earlier variant of this baseline
      (token-weighted RDA with synchronous rounds) is dropped, as the flags cannot tell an
      explicit "--merge-rule rda" from the default.
      No direction check, as in the classic algorithm: with the quorum at every learner, one
      refused or quarantined learner stops every later round, and an honest learner on an
      outlying data shard can point away from the others (a 32-learner run of `ddiloco bench
      goodput` quarantined one, median cosine -0.71 on a fragment of biases and norms, and
      stalled for good). The norm bound stays, but clips instead of refusing (norm_bound_action
      "clip"): a learner sends one contribution per base version and its barrier waits for the
      merge of that version, so a refused honest upload (with the tiny model, a late or
      restarted learner's first pseudo-gradients went beyond the bound) would stall the barrier
      of every learner for good; clipped, it is merged within the bound
      and a gross excess is still a strike towards quarantine. Forced like the merge rules: the
      flags cannot tell an explicit "--norm-bound-action reject" from the default. The influence
      bounds of the decoupled mode (per-step norm clipping against the others' median, the merge
      weight share cap) are off: the weights are equal, and a learner with few steps has a large
      per-step norm without being hostile.
    * dp: one fragment synced every step (P = H = 1, tau = 0), no grace window, fp32, plain mean
      of the gradients, no staleness (a gradient must be on the current parameters), no norm
      bound, no direction check (single-step gradients are too noisy to compare) and no influence
      bounds; the syncer's outer optimizer is AdamW with the dp_* settings. Set --min-quorum to
      the number of learners.
    * decoupled: unchanged.
    """
    if cfg.sync_mode == rounds_lib.DILOCO:
        return dataclasses.replace(cfg, grace_gamma=0.0, max_grace_s=0.0, upload_codec="fp32",
                                   download_codec="fp32", mixing_alpha=0.0, direction_check="off",
                                   merge_rule="equal_mean", embedding_merge_rule="equal_mean",
                                   outer_step_fraction="whole", norm_clip_factor=0.0, max_merge_share=1.0,
                                   unverified_clip_factor=0.0, norm_bound_action="clip")
    if cfg.sync_mode == rounds_lib.DP:
        return dataclasses.replace(cfg, num_fragments=1, sync_period_steps=1, overlap_steps=0, grace_gamma=0.0,
                                   max_grace_s=0.0, upload_codec="fp32", download_codec="fp32", mixing_alpha=0.0,
                                   merge_rule="mean", embedding_merge_rule="mean", max_staleness_versions=0,
                                   norm_bound_factor=0.0, direction_check="off", outer_step_fraction="whole",
                                   norm_clip_factor=0.0, unverified_clip_factor=0.0, max_merge_share=1.0)
    return cfg


# The --help text of each flag (flags.parse_dataclass makes one flag per SyncerConfig field).
_HELPS = {
    "bind": "host:port to serve gRPC on (port 0: any free port)",
    "sync_mode": "decoupled (Decoupled DiLoCo); baselines: diloco (classic synchronous DiLoCo: plain mean of the "
                 "pseudo-gradients with equal weights, i.e. merge rule equal_mean for every tensor whatever "
                 "--merge-rule says, all fragments together, learners wait, no grace, fp32, no direction check, "
                 "contributions beyond the norm bound clipped) "
                 "or dp (data-parallel: gradients every step, AdamW on the syncer, learners wait); set "
                 "--min-quorum to the number of learners for the baselines",
    "dp_learning_rate": "dp mode: AdamW peak learning rate on the syncer",
    "dp_warmup_steps": "dp mode: AdamW linear warmup steps",
    "dp_decay_steps": "dp mode: cosine-decay the AdamW learning rate to 0.1 x until this step (0: no decay)",
    "dp_weight_decay": "dp mode: AdamW weight decay (matrices only)",
    "ready_file": "write {address, pid} JSON here once serving",
    "run_id": "run name in the checkpoint store; the same id restores the same run",
    "fragment_shard": "fragment shards: this process's index in --fragment-shards (0-based)",
    "fragment_shards": "fragment shards: the shard map, one entry per shard in index order, comma-separated; an "
                       "entry is the shard's host:port, or several failover addresses of it joined by '|'; every "
                       "shard gets the same map and owns fragments f with f mod N = its index (checkpoints under "
                       "<run-id>.shard-I-of-N); empty: unsharded, this process owns every fragment",
    "checkpoint_target": "checkpoint store host:port (empty: no checkpoints); a comma list of stores replicates "
                         "every checkpoint (docs/failover-stores.md)",
    "checkpoint_write_quorum": "replicated stores: how many must take each blob and manifest for a checkpoint "
                               "to count (0: 2 with two or more stores, else 1)",
    "checkpoint_repair_interval_s": "replicated stores: seconds between background passes that copy what a "
                                    "store missed from its peers (also run after a commit some store missed)",
    "checkpoint_every_merges": "checkpoint after this many merges (and on SIGTERM)",
    "checkpoint_timeout_s": "overall bound for writing one checkpoint, retries included",
    "commit_before_broadcast": "send a merged fragment version to learners only once a committed checkpoint "
                               "holds it: one checkpoint per merge (instead of every --checkpoint-every-merges), "
                               "and a crash or failover loses no merge a learner received "
                               "(docs/failover-stores.md); needs --checkpoint-target",
    "restore_timeout_s": "wait this long for the checkpoint store at start, then exit non-zero",
    "model": "the model: a built-in name (transformer), an installed ddiloco.models plugin or package.module:factory",
    "model_config": "JSON object overriding the model configuration",
    "seed": "seed of the initial global parameters",
    "num_fragments": "P: number of fragments (balanced bin-packing of whole tensors)",
    "sync_period_steps": "H: each fragment is synchronized every H local steps, staggered",
    "overlap_steps": "tau: local steps a fragment's communication may overlap (grace window)",
    "min_quorum": "K: contributions needed before a fragment is merged",
    "grace_gamma": "gamma: grace window = gamma*(tau*step_time - quorum_time - sync_time)",
    "max_grace_s": "cap on the grace window in seconds",
    "upload_codec": f"learner upload codec, one of {codec_lib.CODECS}",
    "upload_block_size": "values per quantization block for int8/int4/int2 uploads",
    "download_codec": f"codec of global fragments sent to learners, one of {codec_lib.CODECS}",
    "zstd_level": "zstd level for uploads and downloads",
    "chunk_size_bytes": "payload chunk size for upload streams (256 KiB-1 MiB is fastest); downloads use at "
                        "most 128 KiB (gRPC buffers one chunk per watcher)",
    "max_staleness_versions": "refuse contributions based more than this many versions back when their upload "
                              "starts (merges while it streams in and waits do not make it stale)",
    "mixing_alpha": "the mix on-arrival rule: local*alpha + global*(1-alpha)",
    "on_arrival": "what learners do with a new global version: rebase (keep un-merged work; default), "
                  "overwrite (the paper's rule) or mix (alpha-blend, --mixing-alpha)",
    "round_trigger": "schedule: the syncer opens each fragment's rounds and calls every learner (default); "
                     "upload: learners contribute on their own counters and a round opens at its first "
                     "contribution (the previous design, for comparison)",
    "merge_rule": "merge of non-embedding tensors: rda (radial-directional, weighted), mean (weighted by "
                  "tokens^2/steps) or equal_mean (plain mean, weights ignored); diloco mode forces equal_mean",
    "embedding_merge_rule": "merge of embedding tensors: mean, rda or equal_mean; diloco mode forces equal_mean",
    "outer_lr": "outer Nesterov SGD learning rate",
    "outer_momentum": "outer Nesterov SGD momentum",
    "outer_step_fraction": "work (default): a merge is s x q of an outer step on the merged delta x q, s = "
                           "(token-weighted mean inner steps) / H, q = contributors / expected learners (absent "
                           "learners count as zero pseudo-gradients: lone merges add up to one step per round; "
                           "below 1 the momentum decays by mu^s and is carried s times, above 1 it takes delta/s); "
                           "steps: s of a step on the whole merged delta, whatever the learners; whole: every merge "
                           "is one outer step (the diloco and dp baselines always)",
    "token_budget": "end the run once the learners processed this many tokens, all learners and lives together "
                    "(0: no budget, each learner runs its --steps); learners hear it in their progress reports, "
                    "contribute their remaining work and leave",
    "liveness_timeout_s": "a learner silent this long stops counting towards a round's expected size",
    "max_concurrent_uploads": "uploads in flight at once, over all learners (more wait for a slot: back-pressure, "
                              "RESOURCE_EXHAUSTED only at the call's deadline)",
    "merge_history": "merge records kept for the training state",
    "grace_s": "on shutdown, in-flight RPCs get this many seconds to finish",
    "metrics_bind": "serve Prometheus metrics on host:port (e.g. 0.0.0.0:9091); empty: no metrics endpoint",
    "tls_ca": "mutual TLS: CA bundle (PEM) that client certificates must chain to",
    "tls_cert": "mutual TLS: this syncer's certificate chain (PEM); also its client certificate for the store",
    "tls_key": "mutual TLS: this syncer's private key (PEM)",
    "insecure": "serve plaintext without client certificates (local runs only; DDILOCO_INSECURE=1 sets it too)",
    "auth_tokens_file": "JSON {tokens: {token: kind/name}, revoked: [...]}: accept bearer tokens (re-read on change)",
    "tls_deny_list": "mutual TLS: file of revoked client certificates, one a line: a serial number in hex or an "
                     "identity (kind/name); # starts a comment; re-read within a second of a change "
                     "(`ddiloco certs revoke` appends to it)",
    "checkpoint_auth_token_file": "file with the bearer token to present to the checkpoint store",
    "checkpoint_tls_server_name": "mutual TLS: name expected in the store's certificate when it differs from "
                                  "the host of --checkpoint-target (e.g. checkpoint, as `ddiloco certs` names it)",
    "health_bind": "also serve gRPC health alone, in plaintext, on host:port (probes without certificates)",
    "coord_etcd": "leader election among several syncers of this run (docs/failover.md): etcd endpoints "
                  "host:port[,host:port...] (https://host:port: TLS, see --coord-tls-ca); empty: a single "
                  "syncer, no election",
    "coord_lease_s": "leader lease in seconds: a dead leader is replaced, and a leader cut off from etcd "
                     "stops, within about this long",
    "coord_prefix": "etcd key prefix for this deployment's leader and commit keys",
    "coord_advertise": "host:port at which learners reach this syncer, told to them by standbys "
                       "(default: the address it serves on; bound to 0.0.0.0, this host's address)",
    "coord_call_timeout_s": "deadline of one etcd call (below half of --coord-lease-s)",
    "coord_tls_ca": "TLS towards etcd: CA bundle (PEM) that signed etcd's server certificate (etcd's "
                    "--trusted-ca-file when one CA does both); empty: plaintext etcd",
    "coord_tls_cert": "TLS towards etcd: this syncer's etcd client certificate (PEM), for an etcd started with "
                      "--client-cert-auth (`ddiloco certs --etcd-names` writes etcd-client.pem)",
    "coord_tls_key": "TLS towards etcd: the private key (PEM) of --coord-tls-cert",
    "coord_tls_server_name": "TLS towards etcd: name expected in etcd's certificate when it differs from the "
                             "endpoints' hosts",
    "max_concurrent_uploads_per_learner": "uploads in flight at once from one learner (RESOURCE_EXHAUSTED above)",
    "upload_idle_timeout_s": "refuse an upload stream that sends nothing for this long",
    "max_state_watchers": "WatchTrainingState streams open at once, over all callers (RESOURCE_EXHAUSTED above)",
    "max_state_watchers_per_identity": "WatchTrainingState streams open at once per authenticated identity",
    "max_fragment_watchers": "WatchFragments streams open at once, learners and observers together "
                             "(RESOURCE_EXHAUSTED above)",
    "max_fragment_watchers_per_identity": "WatchFragments streams open at once per authenticated identity",
    "norm_bound_factor": "k: refuse/clip a contribution whose per-step norms (whole fragment, and each tensor of "
                         ">= 1024 values) exceed k x the median of other learners' recent ones (until there is "
                         "history: its norm exceeds the global fragment's); also caps a claimed batch (tokens "
                         "per step, which sets the merge weight) at k x the others' median; 0 disables",
    "norm_bound_action": "what to do beyond the norm bound: reject (INVALID_ARGUMENT; the learner keeps the work "
                         "and sends it in a later round) or clip (scale it down to the bound and merge it); "
                         "--sync-mode diloco always clips (its barrier of every learner cannot survive a refusal)",
    "norm_bound_min_history": "other learners' contributions to a fragment needed before per-tensor bounds apply",
    "quarantine_after": "suspicious uploads (malformed, replayed, beyond the norm bound, pointing away) within "
                        "--quarantine-window-s that quarantine a learner; 0 never quarantines",
    "quarantine_window_s": "window for counting suspicious uploads",
    "quarantine_s": "how long a quarantined learner's uploads are refused; 0 until restart",
    "direction_check": "off, or reject (INVALID_ARGUMENT, a strike towards quarantine) a contribution whose median "
                       "cosine with the other learners' latest accepted contributions to the fragment, and the "
                       "learner's mean over its last 8, are both below --direction-min-cosine (sign-flipped "
                       "updates); applies once 2 other learners have recent contributions",
    "direction_judge_wait_s": "how long a contribution with fewer than 2 other learners' recent contributions to "
                              "compare with (the first ones of a run) waits for them while live learners could "
                              "send them, so that first contributions judge each other; 0 merges them unjudged",
    "direction_min_cosine": "threshold of --direction-check (measured: honest learners' recent means >= -0.07, "
                            "sign-flipped <= -0.61)",
    "max_merge_share": "no contribution may have more than this share of a merge's total weight (the heaviest "
                       "is lowered to it) in merges of 3 or more contributions, nor in any merge one the syncer "
                       "cannot vouch for (claimed steps or batch clipped or not checkable yet, or its norm clipped "
                       "against the history); in [0.5, 1], 1: no cap",
    "max_batch_ratio": "a claimed batch (tokens per step, which sets the merge weight) above this x the other "
                       "learners' median is clipped to it; 0: --norm-bound-factor",
    "norm_clip_factor": "median-of-norms clipping: a contribution's norm above this x the other learners' median "
                        "per step over their contributions of the last 2 versions with steps within 2x of its own "
                        "(times its steps, or sqrt(steps x their median steps) below that) is scaled down to it "
                        "(accepted, no strike); 0: off",
    "unverified_clip_factor": "the merge clips its largest contribution (per step) to this x the median of the "
                              "merge's others when the syncer could not vouch for it: claimed steps or batch clipped "
                              "or not checkable yet (a run's first merges), or its norm clipped (--norm-clip-factor "
                              "applies otherwise); 0: off",
    "merge_ledger": "append one hash-chained JSON record per merge here (contributors, claims, weights, shares, "
                    "norms, cosines, refusals); `ddiloco audit --ledger` reads it; empty: off",
    "merge_ledger_max_bytes": "rotate the merge ledger to <file>.1 beyond this size",
    "store_ledger": "with --checkpoint-target: append every merge record to the checkpoint store's durable, "
                    "hash-chained ledger of the run (`ddiloco audit --store`); false: off",
    "retain_contributions": "store every merged contribution (the values folded in) as a blob in the checkpoint "
                            "store, referenced from the ledger, so that `ddiloco audit replay` can reproduce every "
                            "published fragment bit for bit; costs one fragment of store disk per contribution",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "json_logs": "log one JSON object per line",
    "failpoints": "TESTS ONLY: crash at named points, e.g. syncer.after_quorum=crash@3 (ddiloco.failpoints)",
    "history_file": "TESTS/CHAOS: append accepted uploads, merges and checkpoints as JSONL here (invariant checks)",
}


def parse_config(argv: Sequence[str], environ: Mapping[str, str]) -> SyncerConfig:
    """Parses flags (with DDILOCO_SYNCER_* environment defaults) into a SyncerConfig."""
    environ = security.with_shared_insecure(environ, "DDILOCO_SYNCER_")
    cfg = flags.parse_dataclass(
        SyncerConfig,
        prog="ddiloco syncer",
        description="The Decoupled DiLoCo syncer: merges pseudo-gradient fragments from learners "
        "and streams new global fragments back.",
        env_prefix="DDILOCO_SYNCER_",
        helps=_HELPS,
        argv=argv,
        environ=environ,
    )
    return apply_sync_mode(cfg)
