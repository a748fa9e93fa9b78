"""The checkpoint store's merge ledger bounds the blobs it keeps: garbage collection keeps the
blobs of the last `retain_merges` records of each (run, fragment) and collects older ones, unless
a checkpoint manifest or a kept record names them too; every record stays in the ledger."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import time

import pytest

from services.checkpoint import ledger as ledger_lib
from services.checkpoint import store as store_lib

RUN = "run-1"
GENESIS = "0" * 64


def _age(store: store_lib.BlobStore, digests) -> None:
    old_s = time.time() - 3600
    for digest in digests:
        os.utime(store.root / "blobs" / digest[:2] / digest, (old_s, old_s))


def _blob_files(root: pathlib.Path) -> set[str]:
    return {p.name for p in (root / "blobs").glob("??/*")}


def _append(ledger: ledger_lib.LedgerStore, fragment: int, version: int, blobs: list[str]) -> None:
    head = ledger.head(RUN)[1]
    line = json.dumps({"prev": head, "fragment": fragment, "version": version, "blobs": sorted(blobs)},
                      sort_keys=True, separators=(",", ":"))
    ledger.append(RUN, [line])


def _store(root: pathlib.Path, retain_merges: int) -> tuple[store_lib.BlobStore, ledger_lib.LedgerStore]:
    store = store_lib.BlobStore(root, retention=store_lib.LatestN(1), gc_grace_s=60)
    ledger = ledger_lib.LedgerStore(root, store.stat, retain_merges=retain_merges)
    store.extra_references = ledger.referenced_blobs  # as the servicer wires it
    return store, ledger


def _collect(store: store_lib.BlobStore, step: int, blobs: dict[str, bytes]) -> None:
    """Commits a manifest naming `blobs` (name -> bytes), which runs garbage collection."""
    refs = [{"name": n, "digest": hashlib.sha256(d).hexdigest(), "size_bytes": len(d)} for n, d in blobs.items()]
    store.commit_manifest({"run_id": "ckpt", "step": step, "blobs": refs, "metadata": {}})


def test_only_the_last_merges_of_each_fragment_keep_their_blobs(tmp_path: pathlib.Path) -> None:
    store, ledger = _store(tmp_path, retain_merges=3)
    contribution = {}  # (fragment, version) -> digest
    for version in range(1, 7):
        for fragment in (0, 1):
            contribution[fragment, version] = store.put_blob(f"f{fragment} v{version}".encode())[0]
            shared = [contribution[0, 1]] if (fragment, version) == (1, 6) else []  # content addressing
            _append(ledger, fragment, version, [contribution[fragment, version]] + shared)
    _age(store, set(contribution.values()))

    _collect(store, 1, {"p": b"f0 v2"})  # a checkpoint holds an old merge's bytes: the same blob

    kept = {contribution[f, v] for f in (0, 1) for v in (4, 5, 6)} | {contribution[0, 1], contribution[0, 2]}
    assert _blob_files(tmp_path) == kept
    for gone in (contribution[0, 3], contribution[1, 1], contribution[1, 2], contribution[1, 3]):
        assert store.stat([gone]) == set()
    assert ledger.head(RUN)[0] == 12  # every record stays
    # Reopened (a store restart), the ledger bounds the same records.
    reopened = ledger_lib.LedgerStore(tmp_path, store.stat, retain_merges=3)
    assert reopened.referenced_blobs() == ledger.referenced_blobs() == kept - {contribution[0, 2]}


def test_zero_keeps_every_merges_blobs(tmp_path: pathlib.Path) -> None:
    store, ledger = _store(tmp_path, retain_merges=0)
    digests = [store.put_blob(f"v{v}".encode())[0] for v in range(1, 6)]
    for version, digest in enumerate(digests, start=1):
        _append(ledger, 0, version, [digest])
    _age(store, digests)
    _collect(store, 1, {})
    assert _blob_files(tmp_path) == set(digests)


def test_a_negative_bound_is_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="retain_merges=-1"):
        ledger_lib.LedgerStore(tmp_path, lambda d: set(d), retain_merges=-1)


def test_the_bound_is_a_store_flag_with_an_env_twin() -> None:
    from services.checkpoint import config as config_lib

    assert config_lib.parse_config(["--root", "r"], {}).ledger_retain_merges == ledger_lib.DEFAULT_RETAIN_MERGES
    assert config_lib.parse_config(["--root", "r", "--ledger-retain-merges", "0"], {}).ledger_retain_merges == 0
    env = {"DDILOCO_CHECKPOINT_LEDGER_RETAIN_MERGES": "8"}
    assert config_lib.parse_config(["--root", "r"], env).ledger_retain_merges == 8
