"""`ddiloco.Learner`: a Decoupled DiLoCo learner inside the user's own JAX training loop.

    with ddiloco.Learner(syncer="127.0.0.1:50051", params=params, learner_id="a", insecure=True) as sync:
        params = sync.params                 # the global model: every learner starts from it
        opt_state = optimizer.init(params)
        for batch in data:
            params, opt_state, loss = my_step(params, opt_state, batch)
            params = sync.after_step(params, tokens=batch[:, 1:].size, loss=loss)

This is the service learner's own machinery, not a second implementation: `services/learner` runs
the same `SyncClient` (joins, watches fragments, uploads on its background thread, re-joins after a
syncer restart) and the same `LearnerLoop` fragment logic (answers the syncer's round calls with
each fragment's pseudo-gradient, folds arriving global fragments in by the run's on-arrival rule,
rebase by default, so un-merged local work is kept). The service's loop runs its own `TrainStep`
and data sampler; here the user's step replaces them and `after_step` is the rest of the loop's
step (`LearnerLoop.end_step`, then `apply_updates`). In the decoupled mode it never waits on the
network: a fragment due goes to the client's queue and an arrival is folded in at the next call.
Leaving the block contributes what is left of every fragment and waits, at most
`finish_timeout_s`, until the global model holds it (`all_merged` says whether it did).

Parameters are a flat dict {tensor name: float32 array} named and shaped as the syncer's model
(`ddiloco.models.base.Params`; the syncer owns the model choice, `--model`). One process, on the
devices where the user's arrays live: a folded-in tensor goes back to the sharding of the array it
replaces. The syncer's `dp` baseline (gradients, not parameters) is refused; `diloco` works and
blocks in `after_step` at each sync, as that baseline does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import rounds as rounds_lib
from ddiloco.learner import client as client_lib
from ddiloco.learner import sharded as sharded_lib
from ddiloco.learner import loop as loop_lib
from ddiloco.rpc import security as security_lib
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import serde

PARAM_DTYPE = np.dtype(np.float32)  # ddiloco.models.base.PARAM_DTYPE: fragments travel as float32


def params_problems(params: Mapping[str, Any], plan: fragments_lib.FragmentPlan) -> list[str]:
    """What keeps `params` (flat {name: array}) from being the model the syncer's fragment plan
    describes: missing and unknown tensors, wrong shapes or dtypes. Empty when they match."""
    expected = {t.name: tuple(t.shape) for frag in plan.fragments for t in frag.tensors}
    problems = []
    missing = sorted(set(expected) - set(params))
    unknown = sorted(set(params) - set(expected))
    if missing:
        problems.append(f"missing {len(missing)} tensor(s) of the syncer's model: {', '.join(missing[:8])}")
    if unknown:
        problems.append(f"{len(unknown)} tensor(s) the syncer's model does not have: {', '.join(unknown[:8])}")
    for name in sorted(set(expected) & set(params)):
        shape, dtype = tuple(np.shape(params[name])), np.dtype(getattr(params[name], "dtype", PARAM_DTYPE))
        if shape != expected[name]:
            problems.append(f"{name}: shape {shape}, the syncer's is {expected[name]}")
        elif dtype != PARAM_DTYPE:
            problems.append(f"{name}: dtype {dtype}, the syncer's parameters are {PARAM_DTYPE}")
    return problems


class _Placement:
    """The loop's view of where the user's parameters live (the part of a TrainStep it uses when
    the user runs the step): host copies out, folded-in values back to the replaced array's
    sharding, no optimizer state (the user keeps theirs)."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        self._shardings = {name: v.sharding for name, v in params.items() if isinstance(v, jax.Array)}

    def place(self, name: str, value: np.ndarray) -> jax.Array:
        sharding = self._shardings.get(name)
        value = np.asarray(value, PARAM_DTYPE)
        return jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)

    def place_params(self, params: dict) -> dict:
        return params

    @staticmethod
    def to_host(value) -> np.ndarray:
        return np.asarray(value)

    def init_opt_state(self, params: dict) -> None:
        return None


class Learner:
    """See the module docstring. Join with `with` (or `start()`), leave by ending the block (or `close()`)."""

    def __init__(
        self,
        syncer: str,
        params: Mapping[str, Any],
        learner_id: str,
        *,
        insecure: bool = False,
        security: security_lib.ClientSecurity | None = None,
        region: str = "embedded",
        incarnation: int = 0,
        join_timeout_s: float = 60.0,
        finish_timeout_s: float = 30.0,
        call_timeout_s: float = 10.0,
        retry_bound_s: float = 30.0,
        num_data_shards: int = 0,
        data_shard: int = -1,
    ) -> None:
        """
        Args:
            syncer: host:port of the syncer (or a comma-separated list of syncers with election).
            params: the model's parameters, flat {tensor name: float32 array}; only their names,
                shapes and placement matter: on joining, `params` becomes the global model.
            learner_id: this learner's id in the run; a later life with the same id fences this one.
            insecure: plaintext, no credentials (local runs); otherwise pass `security`.
            security: TLS / token credentials (ddiloco.rpc.security.ClientSecurity).
            region: reported to the syncer (status, metrics).
            incarnation: this life's number (0: the current time in ns; later lives must be higher).
            join_timeout_s: bound on joining and receiving every global fragment.
            finish_timeout_s: bound on waiting, when the block ends, for the last work to merge.
            call_timeout_s, retry_bound_s: deadline of each call to the syncer; bound of its retries.
            num_data_shards, data_shard: the data split as the service learner reports it; with
                data_shard -1 the syncer assigns a shard (`data_shard` after joining). 0: not reported.
        Raises:
            ValueError: neither `insecure` nor `security`; TypeError: `params` is not a flat dict.
        """
        if security is None and not insecure:
            raise ValueError("ddiloco.Learner: pass security=ClientSecurity(...) for TLS, or insecure=True for "
                             "plaintext (local runs only)")
        if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
            raise TypeError(f"ddiloco.Learner: params must be a flat dict {{tensor name: array}} as the syncer's "
                            f"model names them (ddiloco.models.base.Params), not {type(params).__name__}")
        self._given: Mapping[str, Any] | None = params
        self._stop = threading.Event()  # the syncer said the run's token budget is spent
        self._cfg = client_lib.ClientConfig(
            target=syncer, learner_id=learner_id, incarnation=incarnation or time.time_ns(), region=region,
            tokens_per_step=0, call_timeout_s=call_timeout_s, retry_bound_s=retry_bound_s,
            security=security or security_lib.ClientSecurity(insecure=True), initial_values=self._initial_values,
            on_budget_reached=self._stop.set, num_data_shards=num_data_shards, data_shard=data_shard,
        )
        self._join_timeout_s = join_timeout_s
        self._finish_timeout_s = finish_timeout_s
        self._client: sharded_lib.ShardedSyncClient | None = None
        self._loop: loop_lib.LearnerLoop | None = None
        self._step_started = 0.0
        self.run_config: syncer_pb2.RunConfig | None = None
        self.all_merged: bool | None = None  # set when the block ends: was all of this learner's work merged?

    # ------------------------------------------------------------------------------ the block

    def __enter__(self) -> Learner:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close(finish=exc_type is None)
        return False

    def start(self) -> None:
        """Joins the syncer and waits (bounded by join_timeout_s) for every global fragment;
        afterwards `params` holds the global model.

        Raises:
            TimeoutError: no syncer answered, or the fragments did not arrive, within join_timeout_s.
            ValueError: `params` is not the syncer's model, or the run is the `dp` baseline.
            ddiloco.learner.client.FencedError: the syncer refused this learner (a newer life, credentials).
        """
        client = sharded_lib.ShardedSyncClient(self._cfg)  # one SyncClient, or one per syncer shard
        try:
            run_config = client.start(self._join_timeout_s)
        except TimeoutError as exc:
            client.close(leave=False)
            raise TimeoutError(f"ddiloco.Learner: {exc} (join_timeout_s={self._join_timeout_s:g}); is a syncer "
                               f"listening at {self._cfg.target}?") from None
        except BaseException:  # FencedError (refused), or interrupted: the client's thread stops too
            client.close(leave=False)
            raise
        plan = serde.plan_from_proto(run_config.fragments, run_config.sync_period_steps)
        problems = params_problems(self._given, plan)
        sync_mode = run_config.sync_mode or rounds_lib.DECOUPLED
        if not problems and sync_mode == rounds_lib.DP:
            problems = ["the run is the data-parallel baseline (sync_mode dp), which sends gradients, not "
                        "parameters: an embedded learner joins decoupled and diloco runs"]
        if problems:
            client.close(leave=True)  # joined: leave, so that no round waits for this learner
            raise ValueError(f"ddiloco.Learner: params do not fit the syncer's model "
                             f"{run_config.model_name!r} ({plan.num_fragments} fragments): " + "; ".join(problems))
        self._client, self.run_config = client, run_config
        self._loop = loop_lib.LearnerLoop(
            plan=plan, params=dict(self._given), train_step=_Placement(self._given), sampler=None, client=client,
            learner_id=self._cfg.learner_id, incarnation=self._cfg.incarnation,
            mixing_alpha=run_config.mixing_alpha, sync_mode=sync_mode, should_stop=self._stop.is_set,
            on_arrival=run_config.on_arrival, round_trigger=run_config.round_trigger or "schedule",
        )
        self._given = None  # the loop holds the parameters from here on
        self._loop.apply_updates()  # every fragment arrived: the global model replaces the given values
        self._step_started = time.monotonic()

    def close(self, *, finish: bool = True) -> None:
        """Leaves the run. With `finish` (a block that ended without an exception) the remaining
        progress on every fragment is contributed first, and merged within finish_timeout_s."""
        client, self._client = self._client, None
        if client is None:
            return
        fenced = client.fenced is not None
        try:
            if finish and not fenced:
                self.all_merged = self._loop.finish(timeout_s=self._finish_timeout_s)
                client.flush(timeout_s=min(10.0, self._cfg.retry_bound_s))
        finally:
            client.close(leave=not fenced)

    # ------------------------------------------------------------------------------ each step

    def after_step(self, params: Mapping[str, Any], *, tokens: int, loss: Any = None) -> dict:
        """Call after each inner step with its result; train on the parameters it returns.

        Counts the step (`tokens`: tokens the step trained on, e.g. predicted positions), queues
        the pseudo-gradient of every fragment the syncer's round calls for, reports progress, and
        folds in the global fragments that arrived. Never waits on the network (decoupled mode).

        Args:
            params: the step's new parameters (same names as at joining).
            tokens: tokens processed by the step; the syncer weighs contributions and counts
                the run's work with them.
            loss: the step's training loss (reported to the syncer; converting it waits for the
                step's computation, as the service learner's loop does); None: not reported.

        Returns:
            The parameters to train on next: `params` with arrived global fragments folded in.

        Raises:
            ddiloco.learner.client.FencedError: a newer life of this learner joined.
            RuntimeError: outside the block.
        """
        loop = self._require_joined()
        if self._client is None:
            raise RuntimeError("ddiloco.Learner.after_step: the learner has left the run (closed)")
        if self._client.fenced is not None:
            raise self._client.fenced
        if params.keys() != loop.params.keys():
            raise ValueError("ddiloco.Learner.after_step: params must keep the tensors they had at joining: "
                             + "; ".join(params_problems(params, loop.plan)))
        loop.params = dict(params)
        loop.end_step(None if loss is None else float(loss), int(tokens), started=self._step_started)
        loop.apply_updates()
        self._step_started = time.monotonic()
        return dict(loop.params)

    # ------------------------------------------------------------------------------ reading

    @property
    def params(self) -> dict:
        """The current parameters (after joining: the global model)."""
        return dict(self._require_joined().params)

    @property
    def should_stop(self) -> bool:
        """True once the syncer said the run's token budget is spent, or a newer life joined."""
        return self._stop.is_set() or (self._client is not None and self._client.fenced is not None)

    @property
    def data_shard(self) -> int:
        """The data shard the syncer assigned (or the one given); -1 when none is reported."""
        return self._client.data_shard if self._client is not None else self._cfg.data_shard

    @property
    def stats(self) -> loop_lib.LoopStats:
        """Steps, tokens, uploads queued, fragments applied, own contributions merged, ..."""
        return self._require_joined().stats

    def summary(self) -> dict:
        """A JSON-ready account of this learner's work (as the service learner's summary file)."""
        stats = self.stats
        return {"learner_id": self._cfg.learner_id, "steps": stats.steps, "tokens": stats.tokens,
                "uploads_queued": stats.uploads_queued, "fragments_applied": stats.fragments_applied,
                "merged_contributions": stats.merged_contributions, "all_merged": self.all_merged,
                "held": {str(f): v for f, (_, v) in sorted(self._loop.held.items())}}

    def _require_joined(self) -> loop_lib.LearnerLoop:
        if self._loop is None:
            raise RuntimeError("ddiloco.Learner: not joined; use it in a `with` block (or call start())")
        return self._loop

    def _initial_values(self, run_config: syncer_pb2.RunConfig) -> dict[int, np.ndarray]:
        """The given values per fragment: those equal to the syncer's initial ones (hash-checked by
        the client) are held without being downloaded, as a service learner's own initialization is."""
        given = self._given
        plan = serde.plan_from_proto(run_config.fragments, run_config.sync_period_steps)
        host = {name: np.asarray(given[name], PARAM_DTYPE) for frag in plan.fragments for name in
                (t.name for t in frag.tensors)}
        return {frag.fragment_id: fragments_lib.flatten_fragment(host, frag) for frag in plan.fragments}
