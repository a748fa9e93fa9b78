"""A chaos run's configuration: `Scenario` (everything but the faults, serialized into
faults.jsonl with them) and the syncer flags it implies. The catalogue of named scenarios is
`scenarios`; the run itself is `harness`."""

from __future__ import annotations

import dataclasses
import json

TINY_MODEL = json.dumps({"preset": "tiny"})


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A chaos run's configuration (everything but the faults). Serialized into faults.jsonl."""

    name: str = "custom"
    seed: int = 1
    learners: int = 3
    min_quorum: int = 2
    steps: int = 300  # inner steps per learner identity, over all its lives
    step_delay_s: float = 0.03  # pacing only: wall time per step, not the math
    num_fragments: int = 4
    sync_period_steps: int = 4
    model_config: str = TINY_MODEL
    store: bool = True
    proxy: bool = True  # a FaultProxy between each learner and the syncer (needed for link faults)
    checkpoint_every_merges: int = 4
    # The syncer's liveness timeout and grace cap. Fault scenarios shorten them (3 s, 2 s) so a run
    # sees a dead learner dropped within its few minutes; None passes no flag: the syncer's shipped
    # defaults (bench goodput).
    liveness_timeout_s: float | None = 3.0
    max_grace_s: float | None = 2.0
    chunk_size_bytes: int = 0  # 0: the syncer's default; small values make uploads multi-chunk
    syncer_failpoints: str = ""  # armed for the syncer's first life only
    store_failpoints: str = ""  # store.*=crash|enospc, first life only
    learner_failpoints: tuple[tuple[str, str], ...] = ()  # (learner name, spec), first life only
    call_timeout_s: float = 3.0  # learners: unary deadline (detects a dead link quickly)
    retry_bound_s: float = 8.0
    restart_delay_s: float = 1.0  # a process that died on its own is restarted after this
    max_corpus_bytes: int = 2_000_000
    loss_margin: float = 0.15  # I5: final loss <= (1 + margin) x the fault-free run's
    warmup_timeout_s: float = 180.0
    # Once a learner finished its steps, the others get this long, then are SIGTERMed (they exit
    # cleanly): in the synchronous modes a learner with steps left would wait at a barrier forever.
    finish_grace_s: float = 90.0
    max_wall_s: float = 300.0
    # Learners share <workdir>/jax-cache (--compilation-cache-dir): a restart loads its compiled
    # programs instead of spending seconds of CPU compiling, CPU the other learners on this machine
    # would lose (a deployment keeps the cache on the node or a volume).
    compilation_cache: bool = True
    syncer_args: tuple[str, ...] = ()
    learner_args: tuple[str, ...] = ()
    # What a learner's kill takes down. "learner": that process only; it restarts and rejoins (the
    # others go on, or wait at a barrier). "job": every learner, all restarting after the kill's
    # delay, as a synchronous SPMD job is torn down and relaunched when one worker dies (the
    # paper's "DP, no elasticity" baseline; the syncer, standing for the checkpoint, survives).
    kill_scope: str = "learner"
    # The hub region under fire (ddiloco/chaos/hub.py): two syncers elected on a 3-member etcd,
    # two replicated stores, learners following the leader.
    hub: bool = False
    # The hub's etcd behind TLS (hub only): clients over https with client certificates, peers over
    # https with peer certificates, all of etcd's own CA (`ddiloco certs --etcd-names`, written to
    # <workdir>/cluster/etcd-pki); the syncers get --coord-tls-*.
    hub_tls: bool = False

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["learner_failpoints"] = [list(p) for p in self.learner_failpoints]
        d["syncer_args"], d["learner_args"] = list(self.syncer_args), list(self.learner_args)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Scenario:
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        if "learner_failpoints" in d:
            d["learner_failpoints"] = tuple(tuple(p) for p in d["learner_failpoints"])
        for k in ("syncer_args", "learner_args"):
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d)

    def fault_free(self) -> Scenario:
        """The same run without failpoints (for the I5 baseline; give it no schedule)."""
        return dataclasses.replace(self, name=f"{self.name}-baseline", syncer_failpoints="", store_failpoints="",
                                   learner_failpoints=())


def timeout_args(sc: Scenario) -> list[str]:
    """The syncer flags of the scenario's liveness timeout and grace cap (none for a None: shipped default)."""
    args: list[str] = []
    if sc.liveness_timeout_s is not None:
        args += ["--liveness-timeout-s", str(sc.liveness_timeout_s)]
    if sc.max_grace_s is not None:
        args += ["--max-grace-s", str(sc.max_grace_s)]
    return args
