"""`ddiloco export`: writes a committed checkpoint's global model as `model.safetensors` + `config.json`.

Owns: reading one checkpoint of a run from the checkpoint store (the latest, or `--step N`), turning
its fragment vectors into the model's own named tensors with the checkpoint's `run` record
(ddiloco.run_description), and writing an export directory that `safetensors` and `numpy` alone can
load (`ddiloco generate` samples from it). See docs/export.md.

Exit status: 0 written; 1 nothing to export (no such run or step, or a checkpoint written before
checkpoints described their model); 2 bad flags, credentials refused or an existing export in the
way; 3 the store stayed unreachable for --retry-for-s.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import sys
from typing import Any

import grpc
import numpy as np
from safetensors import SafetensorError
from safetensors import numpy as st_numpy

from ddiloco import checkpoint_client as checkpoint_client_lib
from ddiloco import run_description as run_description_lib
from ddiloco.cli import status as status_cli
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import retry as retry_lib

EXPORT_FORMAT = "ddiloco.export/1"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


# Under mutual TLS or bearer tokens the store hands checkpoint blobs (weights) only to these.
_CREDENTIALS_HINT = ("Downloading a checkpoint's weights needs a model-reader identity: `ddiloco certs "
                     "--model-readers NAME` writes NAME.pem/NAME.key (and NAME.token with --tokens); pass them "
                     "with --tls-ca/--tls-cert/--tls-key or --auth-token-file. A plain reader (operator) may not.")


class ExportError(Exception):
    """A reason the export cannot be written, with the exit status to report."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ
    parser.add_argument("--store", default=env.get("DDILOCO_STORE", "127.0.0.1:50052"),
                        help="checkpoint store host:port [env: DDILOCO_STORE]")
    parser.add_argument("--run-id", required=True, help="the run's id (the syncer's --run-id)")
    parser.add_argument("--step", type=int, default=None,
                        help="export this checkpoint (an outer step the store retains); none: the latest")
    parser.add_argument("--out", required=True, help="directory to write model.safetensors and config.json into")
    parser.add_argument("--force", action="store_true", help="replace an export already in --out")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="deadline of each call to the store")
    parser.add_argument("--retry-for-s", type=float, default=20.0,
                        help="keep retrying an unreachable store this long, then exit with status 3")
    # The same TLS/token flags as `ddiloco status`; the identity must be allowed the weights.
    status_cli.add_security_arguments(parser)


async def _pick_manifest(client: checkpoint_client_lib.CheckpointClient, run_id: str, step: int | None,
                         store: str) -> checkpoint_client_lib.Manifest:
    if step is None:
        manifest = await client.latest_manifest(run_id)
        if manifest is None:
            raise ExportError(f"run {run_id!r} has no checkpoint in the store at {store}: check --run-id "
                              "(the syncer's --run-id) and --store", 1)
        return manifest
    manifests = await client.list_manifests(run_id)
    for manifest in manifests:
        if manifest.step == step:
            return manifest
    if not manifests:
        raise ExportError(f"run {run_id!r} has no checkpoint in the store at {store}: check --run-id and --store", 1)
    steps = [m.step for m in manifests]
    raise ExportError(f"run {run_id!r} has no checkpoint at step {step}; the store retains steps {steps}", 1)


async def read_export(client: checkpoint_client_lib.CheckpointClient, run_id: str, step: int | None,
                      store: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Downloads one checkpoint; returns ({tensor name: array}, config.json contents)."""
    manifest = await _pick_manifest(client, run_id, step, store)
    try:
        run_ref = manifest.blob(run_description_lib.BLOB_NAME)
    except KeyError:
        raise ExportError(
            f"run {run_id!r} step {manifest.step} was written before checkpoints recorded their model and "
            "fragment plan, so its tensors cannot be named. Restart the syncer on this run with this version "
            "and let it merge once: its next checkpoint can be exported.", 1) from None
    try:
        description = run_description_lib.RunDescription.from_json(await client.get_blob(run_ref.digest))
    except ValueError as exc:
        raise ExportError(f"run {run_id!r} step {manifest.step}: {exc}", 1) from None
    vectors = {}
    for frag in description.fragments:
        name = f"fragment/{frag.fragment_id}"
        try:
            data = await client.get_blob(manifest.blob(name).digest)
            vectors[frag.fragment_id] = st_numpy.load(data)["params"]
        except (KeyError, SafetensorError):
            raise ExportError(f"run {run_id!r} step {manifest.step} has no readable blob {name!r}", 1) from None
    try:
        tensors = description.tensors(vectors)
    except ValueError as exc:
        raise ExportError(f"run {run_id!r} step {manifest.step}: {exc}", 1) from None
    state = await _state(client, manifest)
    config = {
        "format": EXPORT_FORMAT,
        "model_name": description.model_name,
        "model_config": dict(description.model_config),
        "model_fingerprint": description.model_fingerprint,
        "run_id": manifest.run_id,
        "step": manifest.step,  # the syncer's outer steps (merges) at this checkpoint
        "created_unix_s": manifest.created_unix_s,
        # Known from the checkpoint's state; None if it could not be read.
        "tokens_merged": state.get("tokens_merged"),
        "fragment_versions": {str(f["fragment_id"]): f["version"] for f in state.get("fragments", [])},
        "tensors": {t.name: {"shape": list(t.shape), "dtype": t.dtype} for t in description.tensor_layouts()},
        "run_config": dict(description.run_config),
        "training": dict(description.training),
    }
    return tensors, config


async def _state(client: checkpoint_client_lib.CheckpointClient, manifest: checkpoint_client_lib.Manifest) -> dict:
    try:
        state = json.loads(await client.get_blob(manifest.blob("state").digest))
    except (KeyError, ValueError):  # counters are informative; the weights do not need them
        return {}
    return state if isinstance(state, dict) else {}


def write_export(out_dir: pathlib.Path, tensors: dict[str, np.ndarray], config: dict[str, Any], *,
                 force: bool) -> None:
    """Writes both files, each atomically (a reader never sees half a file)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"cannot create --out {out_dir}: {exc}", 2) from None
    existing = [name for name in (WEIGHTS_FILE, CONFIG_FILE) if (out_dir / name).exists()]
    if existing and not force:
        raise ExportError(f"{out_dir} already holds {existing}: pass --force to replace them", 2)
    metadata = {"format": "np", "run_id": str(config["run_id"]), "step": str(config["step"]),
                "model_name": str(config["model_name"])}
    _atomic(out_dir / WEIGHTS_FILE, lambda path: st_numpy.save_file(tensors, path, metadata=metadata))
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    _atomic(out_dir / CONFIG_FILE, lambda path: pathlib.Path(path).write_text(text))


def _atomic(path: pathlib.Path, write) -> None:
    # Created by `write` itself (not mkstemp's 0600), so the export gets the user's usual mode.
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


async def _run(args: argparse.Namespace, security) -> dict[str, Any]:
    channel = channel_lib.aio_channel(args.store, security)
    try:
        client = checkpoint_client_lib.CheckpointClient(
            channel, timeout=datetime.timedelta(seconds=args.timeout_s),
            retry_timeout=datetime.timedelta(seconds=args.retry_for_s),
        )
        tensors, config = await read_export(client, args.run_id, args.step, args.store)
    finally:
        await channel.close()
    write_export(pathlib.Path(args.out), tensors, config, force=args.force)
    config["num_params"] = int(sum(t.size for t in tensors.values()))
    return config


def run(args: argparse.Namespace) -> int:
    def fail(message: str, status: int) -> int:
        print(f"ddiloco export: {message}", file=sys.stderr)
        return status

    if args.step is not None and args.step < 0:
        return fail(f"--step {args.step}: steps are >= 0", 2)
    try:
        security = status_cli.client_security(args)
        security.check_files()
    except ValueError as exc:
        return fail(str(exc), 2)
    try:
        config = asyncio.run(_run(args, security))
    except ExportError as exc:
        return fail(str(exc), exc.status)
    except retry_lib.RetriesExhausted as exc:
        last = exc.last
        why = f"{last.code().name} {last.details()}" if isinstance(last, grpc.RpcError) else repr(last)
        return fail(f"checkpoint store {args.store} unreachable for {args.retry_for_s:.0f} s "
                    f"({exc.attempts} attempts): {why}", 3)
    except grpc.RpcError as exc:
        hint = ""
        if status_cli.credentials_problem(exc):
            hint = "\n" + _CREDENTIALS_HINT
        return fail(f"checkpoint store {args.store} refused: {exc.code().name} {exc.details()}{hint}", 2)
    except checkpoint_client_lib.BlobVerificationError as exc:
        return fail(f"a downloaded blob is corrupt: {exc}", 1)
    tokens = config["tokens_merged"]
    print(f"exported run {config['run_id']} step {config['step']} (model {config['model_name']}, "
          f"{len(config['tensors'])} tensors, {config['num_params']:,} parameters, "
          f"tokens merged {'unknown' if tokens is None else f'{tokens:,}'}) to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco export", description=__doc__.split("\n\n")[0],
                                     epilog=_CREDENTIALS_HINT + " See docs/export.md.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
