"""The evaluator: held-out loss of the syncer's GLOBAL parameters, reported to the syncer.

It watches the global fragments as an observer (no membership, never counted in a quorum),
assembles the full model whenever it evaluates, and reports the loss with the evaluated versions
(`ReportEval`), so the training state and `ddiloco status` show the curve.
A syncer split into fragment shards streams each fragment from its owner only: the evaluator
follows the shard map of the first syncer's training state (TrainingState.shards), watches every
shard (one leader link each, over the shard's failover addresses) and reports every evaluation to
every shard that answers, with the tokens merged over all of them.
Run it with `python -m services.learner.evaluator` or `ddiloco evaluate` (`--once` for one number).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time

import grpc
import jax
import numpy as np

from ddiloco import logs, models
from ddiloco.algo import fragments as fragments_lib
from ddiloco.data import corpus
from ddiloco.data import sources as data_sources
from ddiloco.learner import targets as targets_lib
from ddiloco.rpc import security as security_lib
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import serde
from . import config as config_lib
from . import leader_link
from . import train as train_lib

_LOG = logging.getLogger("ddiloco.evaluator")


class DataError(ValueError):
    """The data flags name data that cannot be evaluated on (exit status 2)."""


class GlobalModelWatcher:
    """Keeps the newest version of every global fragment, from WatchFragments streams on the leader."""

    def __init__(self, link: leader_link.LeaderLink, num_fragments: int) -> None:
        self._link = link
        self.values: dict[int, np.ndarray] = {}
        self.versions: dict[int, int] = {}
        self.instance = ""
        self._num = num_fragments
        self.complete = asyncio.Event()

    async def run(self, stream_timeout_s: float) -> None:
        """Consumes one watch stream until it ends or reaches its deadline; after a failure the next
        stream goes to the syncer the failure points at (leader_link)."""
        generation = await self._link.ensure()
        held = serde.versions_to_proto(self.versions)
        call = None
        try:
            call = self._link.stub.WatchFragments(
                syncer_pb2.WatchFragmentsRequest(protocol_version=serde.PROTOCOL_VERSION, syncer_instance=self.instance,
                                                 held=held),
                timeout=stream_timeout_s,
            )
            # Beside the link's leader watch: a stream hanging at a silent syncer (its host gone, no
            # TCP reset) ends once another syncer leads, not at its deadline (or HTTP/2 keepalive's).
            await self._link.guarded(self._consume(call, generation))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                retry_now = await self._link.failed(exc, generation)
                raise StreamEnded(exc.code().name, retry_now) from None
        except targets_lib.NotLeader as exc:  # LeaderMoved: the leader watch names the new leader
            raise StreamEnded(str(exc), await self._link.failed(exc, generation)) from None
        finally:
            if call is not None:
                call.cancel()

    async def _consume(self, call, generation: int) -> None:
        header, assembler = None, None
        async for msg in call:
            if msg.WhichOneof("kind") == "header":
                header = msg.header
                assembler = serde.ChunkAssembler(header.payload.payload_size_bytes)
                continue
            assembler.add(msg.chunk)
            if assembler.done:
                if not self._link.check_epoch(header.epoch):  # a deposed leader's version: find the new one
                    cause = targets_lib.NotLeader(f"fragment {header.fragment_id} of epoch {header.epoch}, older "
                                                  f"than {self._link.epoch}")
                    raise StreamEnded(str(cause), await self._link.failed(cause, generation))
                self._link.joined()
                self.values[header.fragment_id] = serde.decode_payload(header.payload, assembler.payload())
                self.versions[header.fragment_id] = header.version
                self.instance = header.syncer_instance
                if len(self.values) == self._num:
                    self.complete.set()

    async def keep_watching(self, stop: asyncio.Event, *, stream_timeout_s: float = 600.0,
                            pause_s: float = 1.0) -> None:
        """Watch streams one after the other until `stop`, pausing after a failure not redirected."""
        while not stop.is_set():
            try:
                await self.run(stream_timeout_s=stream_timeout_s)
            except StreamEnded as exc:
                _LOG.info(f"watch stream ended ({exc}); reconnecting to {self._link.current or 'the next syncer'}")
                if exc.retry_now:
                    continue
            except Exception as exc:  # noqa: BLE001 - a bad message: reconnect with a pause, as before
                _LOG.info(f"watch stream ended ({exc.__class__.__name__}); reconnecting")
            await asyncio.sleep(pause_s)


class StreamEnded(Exception):
    """A watch stream failed; `retry_now` when the next one may start at once (a named leader)."""

    def __init__(self, message: str, retry_now: bool) -> None:
        super().__init__(message)
        self.retry_now = retry_now


async def fetch_state(link: leader_link.LeaderLink, deadline_s: float) -> syncer_pb2.TrainingState:
    """The leader's training state, or TimeoutError once `deadline_s` (time.monotonic()) passed."""
    return (await link.call("GetTrainingState", syncer_pb2.GetTrainingStateRequest(), deadline_s=deadline_s)).state


async def report(link: leader_link.LeaderLink, cfg: config_lib.EvaluatorConfig, versions: dict[int, int],
                 loss: float, heldout_tokens: int) -> dict:
    """Reports one evaluation to the leader (within cfg.timeout_s over every syncer tried); the result."""
    deadline_s = time.monotonic() + cfg.timeout_s
    st = await fetch_state(link, deadline_s)
    await link.call("ReportEval", syncer_pb2.ReportEvalRequest(
        protocol_version=serde.PROTOCOL_VERSION, evaluator_id=cfg.evaluator_id,
        evaluated=serde.versions_to_proto(versions), heldout_loss=float(loss),
        tokens_merged=st.tokens_merged, heldout_tokens=heldout_tokens,
    ), deadline_s=deadline_s)
    return {"heldout_loss": float(loss), "versions": versions, "tokens_merged": st.tokens_merged}


async def report_to_shards(links: list[leader_link.LeaderLink], cfg: config_lib.EvaluatorConfig,
                           versions: dict[int, int], loss: float, heldout_tokens: int) -> dict:
    """`report` for fragment shards: the tokens merged summed over the shards that answer, and the
    evaluation reported to each of them (a down shard misses it). One link: `report` itself.
    Raises the first shard's error when no shard took the report."""
    if len(links) == 1:
        return await report(links[0], cfg, versions, loss, heldout_tokens)
    deadline_s = time.monotonic() + cfg.timeout_s
    states = await asyncio.gather(*(fetch_state(link, deadline_s) for link in links), return_exceptions=True)
    answered = [(link, st) for link, st in zip(links, states) if not isinstance(st, BaseException)]
    if not answered:
        raise states[0]
    tokens_merged = sum(st.tokens_merged for _, st in answered)
    request = syncer_pb2.ReportEvalRequest(
        protocol_version=serde.PROTOCOL_VERSION, evaluator_id=cfg.evaluator_id,
        evaluated=serde.versions_to_proto(versions), heldout_loss=float(loss), tokens_merged=tokens_merged,
        heldout_tokens=heldout_tokens)
    sent = await asyncio.gather(*(link.call("ReportEval", request, deadline_s=deadline_s) for link, _ in answered),
                                return_exceptions=True)
    errors = [r for r in sent if isinstance(r, BaseException)]
    if len(errors) == len(sent):
        raise errors[0]
    return {"heldout_loss": float(loss), "versions": versions, "tokens_merged": tokens_merged,
            "shards_reported": len(sent) - len(errors), "shards": len(links)}


def shard_watchers(cfg: config_lib.EvaluatorConfig, link: leader_link.LeaderLink, state: syncer_pb2.TrainingState,
                   num_fragments: int) -> tuple[list[leader_link.LeaderLink], list[GlobalModelWatcher]]:
    """One link and one watcher per fragment shard of `state`'s shard map (`link`, already open to
    the syncer that answered, serves its own shard); just `link` for an unsharded syncer."""
    if not state.shards:
        return [link], [GlobalModelWatcher(link, num_fragments)]
    links, watchers = [], []
    for shard in state.shards:
        own = link if shard.index == state.shard_index else leader_link.LeaderLink(
            ",".join(shard.addresses), cfg.client_security(), call_timeout_s=cfg.call_timeout_s)
        links.append(own)
        watchers.append(GlobalModelWatcher(own, len(shard.fragment_ids)))
    return links, watchers


async def evaluate_loop(cfg: config_lib.EvaluatorConfig, stop: asyncio.Event) -> dict | None:
    link = leader_link.LeaderLink(cfg.syncer, cfg.client_security(), call_timeout_s=cfg.call_timeout_s)
    started_s = time.monotonic()
    deadline = started_s + cfg.timeout_s
    try:
        state = await fetch_state(link, deadline)
    except TimeoutError as exc:
        await link.close()
        raise TimeoutError(f"syncer {cfg.syncer} unreachable for {cfg.timeout_s:.0f} s: {exc}") from None
    _LOG.info("reading the run from the leader", extra={"fields": {
        "syncer": link.current, "epoch": state.epoch, "since_start_s": round(time.monotonic() - started_s, 3)}})
    run_config = state.config
    model = models.get_model(run_config.model_name, json.loads(run_config.model_config_json))
    plan = serde.plan_from_proto(run_config.fragments, run_config.sync_period_steps)
    try:
        split = data_sources.load(cfg.data_spec())  # warnings (a truncating size cap, binary files) are logged
        data_sources.check_vocabulary(split, model.vocab_size)
        batches = corpus.heldout_batches(split.heldout, cfg.batch_size, model.seq_len, cfg.eval_batches)
    except (ValueError, OSError) as exc:
        await link.close()
        raise DataError(f"data {cfg.data_spec().describe()}: {exc}") from None
    _LOG.info(f"data {split.source}: {split.heldout_summary()}")
    eval_fn = train_lib.make_eval_fn(model)
    template = model.init(jax.random.PRNGKey(0))
    links, watchers = shard_watchers(cfg, link, state, plan.num_fragments)
    watch_tasks = [asyncio.create_task(w.keep_watching(stop)) for w in watchers]
    result = None
    try:
        await asyncio.wait_for(asyncio.gather(*(w.complete.wait() for w in watchers)),
                               timeout=max(1.0, deadline - time.monotonic()))
        while True:
            versions = {f: v for w in watchers for f, v in w.versions.items()}
            values = {f: v for w in watchers for f, v in w.values.items()}
            params = {}
            for frag in plan.fragments:
                params.update(fragments_lib.unflatten_fragment(values[frag.fragment_id], frag))
            missing = set(template) - set(params)
            if missing:
                raise ValueError(f"global parameters lack tensors {sorted(missing)}")
            loss = await asyncio.to_thread(eval_fn, params, batches)
            result = await report_to_shards(links, cfg, versions, float(loss),
                                            cfg.eval_batches * cfg.batch_size * model.seq_len)
            _LOG.info("evaluated", extra={"fields": {"heldout_loss": round(float(loss), 4), "outer_steps": sum(versions.values())}})
            if cfg.once:
                return result
            try:
                await asyncio.wait_for(stop.wait(), cfg.interval_s)
                return result
            except asyncio.TimeoutError:
                pass
    finally:
        for task in watch_tasks:
            task.cancel()
        for own in links:
            await own.close()


def main(argv: list[str] | None = None) -> int:
    cfg = config_lib.parse_evaluator_config(sys.argv[1:] if argv is None else argv, os.environ)
    # Plaintext must be asked for: refuse to start with neither a CA nor --insecure.
    security_lib.require_choice("ddiloco evaluate", cfg.client_security)
    logs.setup_logging(cfg.log_level, json_lines=cfg.json_logs)

    async def _main() -> dict | None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await evaluate_loop(cfg, stop)

    try:
        result = asyncio.run(_main())
    except TimeoutError as exc:
        _LOG.error(str(exc))
        return 3
    except DataError as exc:
        _LOG.error(str(exc))
        return 2
    if cfg.once and result is not None:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
