"""`ddiloco audit replay`: re-applies a run's retained contributions and checks every published hash.

    ddiloco audit replay --store HOST:PORT --run-id RUN [--from-step N] [--json]

Owns reading a run's merge ledger and checkpoints from the checkpoint store (the `--store` form of
`ddiloco audit` reads the ledger through here too) and the replay: from a checkpoint (its global
fragments and outer optimizer state; `--from-step`; the default 0 rebuilds the run's initial
values from the run description, model and seed, as the syncer built them), every later merge of
the ledger is computed again with the library's merge (ddiloco.algo.merge.MergeAccumulator) and
outer optimizer (ddiloco.algo.outer), from the contributions the syncer retained
(`--retain-contributions`), added in the order the record gives (`fold.index`), with the record's
weights, norms, steps and merge inputs; the accumulator then sums them in the order the syncer's
did (`fold.summed`: held-back contributions last), which is checked too. Each new fragment's
sha256 must equal the record's `params_sha256`, and what learners were sent (the values, or with a
lossy download codec their error-fed reconstruction, computed again from the previous one) its
`fragment_sha256`, bit for bit. The reconstruction is known from version 0 and after a syncer
restart; from a live syncer's checkpoint only the values are.

A syncer that restarted from a checkpoint starts a new lineage: its first record of a fragment
names the checkpoint (`restored_step`), which the replay loads again when the store retains it.
Merges before the starting checkpoint are skipped; a merge that cannot be replayed (no retained
contributions, a gap in the versions, a restart from a checkpoint no longer retained) is counted
as unverifiable and ends that fragment's replay.
A merge whose blobs the store no longer holds (NOT_FOUND: the store's retention,
`--ledger-retain-merges`, collected them) is unverifiable too: its blobs were not retained.
Exit status: 0 every replayed hash matches; 1 a mismatch, or a retained contribution that is
unreadable or corrupt (the first one is printed with its merge); 2 a broken ledger chain, no ledger
or no checkpoint to start from.
Must not: write to the store (it reads as a `reader` or `model-reader`: GetBlob needs the latter).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import sys
from collections.abc import Sequence

import numpy as np
from safetensors import numpy as st_numpy

from ddiloco import checkpoint_client as checkpoint_client_lib
from ddiloco import checkpoint_replicas as replicas_lib
from ddiloco import run_description as run_description_lib
from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import merge as merge_lib
from ddiloco.algo import outer as outer_lib
from ddiloco.cli import audit as audit_lib
from ddiloco.cli import status as status_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.wire import codec as codec_lib

_CALL_TIMEOUT = datetime.timedelta(seconds=30)


class Mismatch(Exception):
    """A replayed merge that does not reproduce what the ledger says was published."""


class _Pruned(Exception):
    """A merge's retained blob the store no longer holds (its retention collected it)."""


def _not_found(exc: BaseException) -> bool:
    """The store answered NOT_FOUND (replicated stores: every one did; BlobUnavailable.not_found)."""
    code = getattr(exc, "code", None)
    return getattr(code(), "name", "") == "NOT_FOUND" if callable(code) else bool(getattr(exc, "not_found", False))


# ------------------------------------------------------------------------------ the store


class _Store:
    """A read-only client of one store, or of replicas (a comma list): a context manager."""

    def __init__(self, targets: str, security) -> None:
        self._targets = [t.strip() for t in targets.split(",") if t.strip()]
        self._security = security
        self._channels: list = []
        self.client = None

    async def __aenter__(self):
        clients = {}
        for target in self._targets:
            channel = channel_lib.aio_channel(target, self._security)
            self._channels.append(channel)
            clients[target] = checkpoint_client_lib.CheckpointClient(
                channel, timeout=_CALL_TIMEOUT, retry_timeout=datetime.timedelta(seconds=10))
        self.client = (clients[self._targets[0]] if len(clients) == 1
                       else replicas_lib.ReplicatedCheckpointClient(clients, write_quorum=1, quorum_wait_s=10.0))
        return self.client

    async def __aexit__(self, *exc) -> None:
        for channel in self._channels:
            await channel.close()


def fetch_ledger_lines(targets: str, run_id: str, security, timeout_s: float = 300.0) -> list[bytes]:
    """The run's ledger lines as the store holds them (`ddiloco audit --store`)."""

    async def fetch() -> list[bytes]:
        async with _Store(targets, security) as client:
            return [line.encode() for line in await client.read_ledger(run_id)]

    return asyncio.run(asyncio.wait_for(fetch(), timeout_s))


# ----------------------------------------------------------------------------- the replay


@dataclasses.dataclass
class _Fragment:
    layout: fragments_lib.Fragment
    version: int
    params: np.ndarray | None  # None: this fragment's replay stopped (unverifiable from here)
    opt_state: list
    params_sha256: str = ""
    # What learners hold (error-fed reconstruction with a lossy download codec); None: unknown (a
    # checkpoint of a live syncer), then only the values' hash is checked.
    published: np.ndarray | None = None
    instance: str | None = None  # the syncer life whose lineage the values follow (None: the first seen)
    anchor: int = -1  # ledger index of the record that published the starting values (-1: none)


@dataclasses.dataclass
class Outcome:
    replayed: int = 0
    published_checked: int = 0  # of those, merges whose published hash was checked too
    skipped: int = 0  # merges before the starting checkpoint
    unverifiable: list = dataclasses.field(default_factory=list)
    mismatch: str = ""


class Replay:
    """Replays ledger records against a store client (see the module docstring)."""

    def __init__(self, client, run_id: str) -> None:
        self._client = client
        self.run_id = run_id
        self._manifests: dict[int, checkpoint_client_lib.Manifest] = {}
        self._steppers: dict[tuple, outer_lib.OuterStepper] = {}
        self.fragments: dict[int, _Fragment] = {}

    async def start(self, from_step: int) -> int:
        """Loads the starting state (step 0: the run's initial values); returns its step.
        ValueError when there is no such checkpoint (or none at all: the run description is in each)."""
        manifests = await self._client.list_manifests(self.run_id)
        self._manifests = {m.step: m for m in manifests}
        if not manifests:
            raise ValueError(f"the store retains no checkpoint of run {self.run_id!r} (each describes the run)")
        if from_step == 0 and 0 not in self._manifests:
            self.fragments = await self._initial(manifests[-1])
            return 0
        if from_step not in self._manifests:
            raise ValueError(f"no checkpoint at step {from_step}; retained: {sorted(self._manifests)} (or 0: the "
                             "initial values)")
        self.fragments = await self._load(from_step)
        return from_step

    async def _description(self, manifest) -> run_description_lib.RunDescription:
        return run_description_lib.RunDescription.from_json(
            await self._client.get_blob(manifest.blob(run_description_lib.BLOB_NAME).digest))

    async def _initial(self, manifest) -> dict[int, _Fragment]:
        """Version 0 of every fragment, rebuilt as the syncer builds it: the model of the run
        description initialised with the run's seed, and a fresh outer optimizer state."""
        import jax  # only this path needs the model

        from ddiloco import models

        description = await self._description(manifest)
        model = models.get_model(description.model_name, description.model_config)
        if description.model_fingerprint and models.model_fingerprint(model) != description.model_fingerprint:
            raise ValueError("the run's model cannot be rebuilt here (fingerprint differs): replay from a checkpoint")
        seed = int(description.training.get("seed", 0))
        params = {k: np.asarray(v, dtype=np.float32) for k, v in model.init(jax.random.PRNGKey(seed)).items()}
        stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(
            float(description.training.get("outer_lr", 0.7)), float(description.training.get("outer_momentum", 0.9))))
        out = {}
        for fid in range(len(description.fragments)):
            fragment = _layout(description, fid)
            values = fragments_lib.flatten_fragment(params, fragment)
            out[fid] = _Fragment(fragment, 0, values, stepper.init(values),
                                 params_sha256=fragments_lib.fragment_sha256(values), published=values)
        return out

    async def _load(self, step: int) -> dict[int, _Fragment]:
        manifest = self._manifests[step]
        description = await self._description(manifest)
        state = json.loads(await self._client.get_blob(manifest.blob("state").digest))
        out = {}
        for meta in state["fragments"]:
            fid = int(meta["fragment_id"])
            tensors = st_numpy.load(await self._client.get_blob(manifest.blob(f"fragment/{fid}").digest))
            fragment = _layout(description, fid)
            params = np.asarray(tensors["params"], np.float32)
            version = int(meta["version"])
            out[fid] = _Fragment(fragment, version, params,
                                 [tensors[f"opt/{i:03d}"] for i in range(int(meta["opt_state_len"]))],
                                 params_sha256=str(meta.get("params_sha256", "")),
                                 published=params if version == 0 else None)  # version 0 is sent as it is
        return out

    def anchor(self, records: Sequence[dict]) -> None:
        """Finds each fragment's starting record: the last one that published the checkpoint's values.
        Its syncer life is the lineage replayed; other lives' records before it are skipped (merges
        before the checkpoint, or of a life that died before it restarted)."""
        for index, record in enumerate(records):
            frag = self.fragments.get(record.get("fragment"))
            if (frag is not None and record.get("version") == frag.version
                    and record.get("params_sha256") == frag.params_sha256):
                frag.instance, frag.anchor = record.get("syncer_instance", ""), index

    async def apply(self, index: int, record: dict, outcome: Outcome) -> None:
        """Replays record `index` of the ledger (or says why it cannot); raises Mismatch."""
        fid, version = record.get("fragment"), record.get("version", 0)
        frag = self.fragments.get(fid)
        what = f"merge of fragment {fid} version {version} (epoch {record.get('epoch', 0)})"
        if frag is None:
            outcome.unverifiable.append(f"{what}: the fragment is not in the checkpoint")
            return
        if index <= frag.anchor:
            outcome.skipped += 1
            return
        instance = record.get("syncer_instance", "")
        if frag.instance is None:
            frag.instance = instance
        elif instance != frag.instance:  # a later syncer life: it continues the checkpoint it restored
            restored = record.get("restored_step")
            if restored not in self._manifests:
                outcome.unverifiable.append(f"{what}: its syncer restarted from checkpoint {restored}, not retained")
                frag.params, frag.instance = None, instance
                return
            frag = self.fragments[fid] = (await self._load(restored))[fid]
            frag.instance, frag.published = instance, frag.params  # a restore publishes the values themselves
        if version <= frag.version:
            outcome.skipped += 1
            return
        why = self._unreplayable(record, frag)
        if why:
            outcome.unverifiable.append(f"{what}: {why}")
            frag.params = None
            return
        try:
            params, opt_state = await self._merge(record, frag, what)
        except _Pruned as pruned:  # a blob the store's retention collected: not a mismatch
            outcome.unverifiable.append(f"{what}: {pruned.args[0]}")
            frag.params = None
            return
        digest = fragments_lib.fragment_sha256(params)
        expected = record.get("params_sha256")
        if digest != expected:
            raise Mismatch(f"{what}: replayed values hash to {digest[:16]}..., the ledger says "
                           f"{str(expected)[:16]}...; contributors {[c['learner'] for c in record.get('contributors', ())]}, "
                           f"inputs {record.get('merge_inputs')}")
        expected_state = record.get("outer_state_sha256")
        if expected_state and fragments_lib.state_sha256(opt_state) != expected_state:
            raise Mismatch(f"{what}: the values match, but the outer optimizer state (momentum) hashes to "
                           f"{fragments_lib.state_sha256(opt_state)[:16]}..., the ledger says {expected_state[:16]}... "
                           f"(a changed merge whose difference rounded away in the values)")
        published = _published(record, frag.published, params)
        if published is not None and fragments_lib.fragment_sha256(published) != record.get("fragment_sha256"):
            raise Mismatch(f"{what}: the values match, but what learners were sent hashes to "
                           f"{fragments_lib.fragment_sha256(published)[:16]}..., the ledger says "
                           f"{str(record.get('fragment_sha256'))[:16]}...")
        outcome.published_checked += published is not None
        frag.version, frag.params, frag.opt_state, frag.published = version, params, opt_state, published
        outcome.replayed += 1

    @staticmethod
    def _unreplayable(record: dict, frag: _Fragment) -> str:
        if frag.params is None:
            return "an earlier merge of this fragment could not be replayed"
        if record.get("version") != frag.version + 1:
            return f"follows version {frag.version}, not {record.get('version', 0) - 1}"
        inputs = record.get("merge_inputs") or {}
        if not inputs.get("outer") or "fraction" not in inputs:
            return "the record has no merge inputs (a syncer without the ledger's replay fields, or not Nesterov SGD)"
        for c in record.get("contributors", ()):
            if not (c.get("fold") or {}).get("blob"):
                return f"the contribution of {c.get('learner')} was not retained (--retain-contributions)"
        return ""

    async def _merge(self, record: dict, frag: _Fragment, what: str) -> tuple[np.ndarray, list]:
        inputs = record["merge_inputs"]
        # Records from before the cap's minimum merge size and the step scaling: the cap applied in
        # every merge and norms were compared per step.
        accumulator = merge_lib.MergeAccumulator(
            frag.layout, rule=inputs["rule"], embedding_rule=inputs["embedding_rule"],
            max_share=inputs["max_share"], max_norm_ratio=inputs["max_norm_ratio"],
            share_cap_min_count=inputs.get("share_cap_min_count", 1), step_scaling=inputs.get("step_scaling", "per_step"),
            unverified_norm_ratio=inputs.get("unverified_norm_ratio", 0.0))
        for c in sorted(record["contributors"], key=lambda c: c["fold"]["index"]):
            fold = c["fold"]
            try:
                data = await self._client.get_blob(fold["blob"])
            except Exception as exc:
                if _not_found(exc):
                    raise _Pruned(f"its blobs were not retained (blob {fold['blob'][:16]}... of {c['learner']} "
                                  "was pruned by the store's retention, --ledger-retain-merges)") from None
                raise Mismatch(f"{what}: the retained contribution of {c['learner']} (blob {fold['blob'][:16]}...) "
                               f"cannot be read intact: {exc}") from None
            values = np.frombuffer(data, dtype="<f4").astype(np.float32)
            norms = None if fold.get("norms") is None else np.asarray(fold["norms"], np.float64)
            try:
                accumulator.add(values, fold["weight"], norms=norms, key=c["learner"], steps=fold["steps"],
                                claims_unverified=fold.get("claims_unverified", False))
            except ValueError as exc:  # a blob of the wrong size or values: not what the syncer folded in
                raise Mismatch(f"{what}: the retained contribution of {c['learner']} cannot be folded in: "
                               f"{exc}") from None
        # The merged delta as the syncer stepped on it: scaled by the learners' share (records before that
        # field: 1).
        merged = outer_lib.scale_delta(accumulator.scaled_result(), inputs.get("delta_scale", 1.0))
        recorded = [c["learner"] for c in sorted(record["contributors"], key=lambda c: c["fold"].get("summed") or 0)]
        if all(c["fold"].get("summed") is not None for c in record["contributors"]) and \
                accumulator.fold_order != recorded:
            raise Mismatch(f"{what}: the library sums the contributions in the order {accumulator.fold_order}, the "
                           f"syncer summed them in the order {recorded}")
        outer = inputs["outer"]
        key = (outer["lr"], outer["momentum"], outer.get("nesterov", True))
        stepper = self._steppers.get(key)
        if stepper is None:
            stepper = self._steppers[key] = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(*key))
        stepped = stepper.step_scaled(frag.params, frag.opt_state, *merged, write_grad=False,
                                      fraction=inputs["fraction"])
        return stepped.params, list(stepped.state)


def _layout(description: run_description_lib.RunDescription, fid: int) -> fragments_lib.Fragment:
    layout = description.fragments[fid]
    return fragments_lib.Fragment(fid, tuple(
        fragments_lib.TensorSpec(t.name, t.shape, t.is_embedding) for t in layout.tensors), 0)


def _published(record: dict, held: np.ndarray | None, params: np.ndarray) -> np.ndarray | None:
    """What learners hold after the merge, computed as the syncer computes it (publishing.Publisher):
    the values themselves with fp32 downloads; else the last published values plus the quantized
    delta (error feedback), known only when the last ones are (None otherwise)."""
    download = (record.get("merge_inputs") or {}).get("download") or {}
    if download.get("codec", "fp32") == "fp32":
        return params
    if held is None:
        return None
    encoded = codec_lib.encode((params - held).astype(np.float32), download["codec"],
                               block_size=download["block_size"], zstd_level=download["zstd_level"])
    step = codec_lib.decode(encoded.payload, codec=encoded.codec, numel=encoded.numel,
                            raw_size_bytes=encoded.raw_size_bytes, checksum=encoded.checksum,
                            block_size=encoded.block_size)
    return fragments_lib.apply_delta(held, step)


async def replay(client, run_id: str, from_step: int = 0) -> tuple[int, Outcome]:
    """The replay of a run: (starting step, outcome). LedgerError, ValueError, Mismatch."""
    lines = [line.encode() for line in await client.read_ledger(run_id)]
    if not lines:
        raise audit_lib.LedgerError(f"the store holds no ledger for run {run_id!r}")
    records = audit_lib.verify_lines(lines, from_genesis=True)
    job = Replay(client, run_id)
    step = await job.start(from_step)
    job.anchor(records)
    outcome = Outcome()
    for index, record in enumerate(records):
        try:
            await job.apply(index, record, outcome)
        except Mismatch as exc:
            outcome.mismatch = str(exc)
            break
    return step, outcome


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", required=True, help="the checkpoint store (HOST:PORT; replicas: a comma list)")
    parser.add_argument("--run-id", required=True, help="the run to replay")
    parser.add_argument("--from-step", type=int, default=0,
                        help="the checkpoint (outer step) to start from; 0: the run's initial values, rebuilt from "
                             "the run description (model and seed) when no checkpoint of step 0 is retained")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="give up after this long")
    parser.add_argument("--json", action="store_true", help="print the outcome as JSON")
    status_lib.add_security_arguments(parser)


def run(args: argparse.Namespace) -> int:
    async def go() -> tuple[int, Outcome]:
        async with _Store(args.store, status_lib.client_security(args)) as client:
            return await replay(client, args.run_id, args.from_step)

    try:
        step, outcome = asyncio.run(asyncio.wait_for(go(), args.timeout_s))
    except (audit_lib.LedgerError, ValueError, asyncio.TimeoutError) as exc:
        print(f"ddiloco audit replay: {exc or 'timed out'}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"from_step": step, **dataclasses.asdict(outcome)}, indent=2))
    else:
        print(f"replayed {outcome.replayed} merges of run {args.run_id} from step {step} "
              f"({outcome.published_checked} published hashes checked, {outcome.skipped} merges before it, "
              f"{len(outcome.unverifiable)} unverifiable)")
        for line in outcome.unverifiable[:20]:
            print(f"  unverifiable: {line}")
    if outcome.mismatch:
        print(f"MISMATCH: {outcome.mismatch}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco audit replay", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
