"""BlobStore on a tmp_path: atomic blobs and manifests, retention, GC, corruption, failpoints;
plus the service's config parsing."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import time

import pytest

from ddiloco import failpoints
from ddiloco.rpc import errors
from services.checkpoint import config as config_lib
from services.checkpoint import store as store_lib

pytestmark = pytest.mark.timeout(30)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tmp_files(root: pathlib.Path) -> list[pathlib.Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name]


def _blob_files(root: pathlib.Path) -> set[str]:
    return {p.name for p in (root / "blobs").glob("??/*")}


def _manifest(run_id: str, step: int, blobs: dict[str, bytes], **metadata: str) -> dict:
    refs = [{"name": n, "digest": _sha(d), "size_bytes": len(d)} for n, d in blobs.items()]
    return {"run_id": run_id, "step": step, "blobs": refs, "metadata": metadata}


@pytest.fixture
def store(tmp_path: pathlib.Path) -> store_lib.BlobStore:
    return store_lib.BlobStore(tmp_path / "root")


def test_blob_round_trip_in_chunks(store: store_lib.BlobStore) -> None:
    data = os.urandom(300_000)
    with store.begin_blob(_sha(data), len(data)) as writer:
        for offset in range(0, len(data), 65536):
            writer.write(data[offset : offset + 65536])
        assert writer.commit() is False

    assert b"".join(store.read_blob(_sha(data), chunk_bytes=100_000)) == data
    assert store.stat([_sha(data), _sha(b"other")]) == {_sha(data)}
    assert _tmp_files(store.root) == []
    assert (store.root / "blobs" / _sha(data)[:2] / _sha(data)).is_file()


def test_existing_blob_is_a_no_op(store: store_lib.BlobStore) -> None:
    assert store.put_blob(b"abc") == (_sha(b"abc"), False)
    assert store.put_blob(b"abc") == (_sha(b"abc"), True)
    assert _blob_files(store.root) == {_sha(b"abc")}


def test_blob_deleted_during_a_reupload_is_stored_again(store: store_lib.BlobStore) -> None:
    digest, _ = store.put_blob(b"abc")
    with store.begin_blob(digest, 3) as writer:
        writer.write(b"abc")
        (store.root / "blobs" / digest[:2] / digest).unlink()  # e.g. garbage-collected meanwhile
        assert writer.commit() is False
    assert b"".join(store.read_blob(digest)) == b"abc"


def test_empty_blob(store: store_lib.BlobStore) -> None:
    digest, _ = store.put_blob(b"")
    assert b"".join(store.read_blob(digest)) == b""


@pytest.mark.parametrize(
    "chunks, declared_size",
    [
        pytest.param([b"hello", b"world"], 10, id="digest-mismatch"),
        pytest.param([b"hello"], 10, id="too-few-bytes"),
        pytest.param([b"helloworld", b"!"], 10, id="too-many-bytes"),
    ],
)
def test_bad_upload_leaves_nothing(store, chunks: list[bytes], declared_size: int) -> None:
    digest = _sha(b"goodbyeall")  # what the client claimed; the data never matches it
    writer = store.begin_blob(digest, declared_size)
    with pytest.raises(errors.InvalidArgument):
        for chunk in chunks:
            writer.write(chunk)
        writer.commit()
    assert _tmp_files(store.root) == []
    assert store.stat([digest]) == set()


def test_abort_removes_the_temp_file(store: store_lib.BlobStore) -> None:
    writer = store.begin_blob(_sha(b"xy"), 2)
    writer.write(b"x")
    assert len(_tmp_files(store.root)) == 1
    writer.abort()
    writer.abort()  # idempotent
    assert _tmp_files(store.root) == []
    assert _blob_files(store.root) == set()


@pytest.mark.parametrize(
    "digest", ["", "ABC", "A" * 64, "g" * 64, "../" + "a" * 61, "a" * 63, "a" * 65, "a" * 63 + "/"]
)
def test_malformed_digest_is_invalid_argument(store: store_lib.BlobStore, digest: str) -> None:
    with pytest.raises(errors.InvalidArgument):
        store.begin_blob(digest, 1)
    with pytest.raises(errors.InvalidArgument):
        store.open_blob(digest)
    with pytest.raises(errors.InvalidArgument):
        store.stat([digest])


def test_oversized_blob_is_resource_exhausted(tmp_path: pathlib.Path) -> None:
    small = store_lib.BlobStore(tmp_path, max_blob_bytes=10)
    with pytest.raises(errors.ResourceExhausted):
        small.begin_blob(_sha(b"x" * 11), 11)


def test_missing_blob_is_not_found(store: store_lib.BlobStore) -> None:
    with pytest.raises(errors.NotFound):
        next(store.read_blob(_sha(b"never stored")))


def test_corrupted_blob_is_data_loss_before_any_byte(store: store_lib.BlobStore) -> None:
    data = os.urandom(200_000)
    digest, _ = store.put_blob(data)
    path = store.root / "blobs" / digest[:2] / digest
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped at the end

    chunks = store.read_blob(digest, chunk_bytes=1024)
    with pytest.raises(errors.DataLoss):
        next(chunks)  # the whole blob is verified before the first chunk is handed out


def test_blob_changing_while_read_is_data_loss_at_the_end(store: store_lib.BlobStore) -> None:
    digest, _ = store.put_blob(b"a" * 4096)
    with store.open_blob(digest) as reader:
        (store.root / "blobs" / digest[:2] / digest).write_bytes(b"b" * 4096)  # same inode
        with pytest.raises(errors.DataLoss):
            while reader.read(1024):
                pass


def test_temp_files_are_removed_at_start(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    first = store_lib.BlobStore(root)
    digest, _ = first.put_blob(b"keep me")
    (root / "blobs" / "ab").mkdir()
    (root / "blobs" / "ab" / ("ab" + "0" * 62 + ".tmp-1f2e")).write_bytes(b"partial")
    (root / "manifests" / "run").mkdir()
    (root / "manifests" / "run" / f"{7:020d}.json.tmp-00ff").write_bytes(b"{")

    reopened = store_lib.BlobStore(root)

    assert reopened.removed_tmp_files == 2
    assert _tmp_files(root) == []
    assert b"".join(reopened.read_blob(digest)) == b"keep me"
    assert reopened.latest_manifest("run") is None


def test_manifest_round_trip(store: store_lib.BlobStore) -> None:
    store.put_blob(b"params")
    store.put_blob(b"opt")
    manifest = _manifest("run-1", 3, {"params": b"params", "opt": b"opt"}, config="{}")
    assert store.commit_manifest(manifest) == (3, 0)

    latest = store.latest_manifest("run-1")
    assert latest is not None
    assert latest["step"] == 3 and latest["metadata"] == {"config": "{}"}
    assert latest["blobs"] == manifest["blobs"]
    assert latest["created_unix_s"] > 0
    assert store.list_manifests("run-1") == [latest]
    assert store.latest_manifest("other-run") is None
    assert store.list_manifests("other-run") == []


def test_manifest_requires_its_blobs(store: store_lib.BlobStore) -> None:
    store.put_blob(b"present")
    with pytest.raises(errors.FailedPrecondition, match="missing|not in the store"):
        store.commit_manifest(_manifest("run", 1, {"a": b"present", "b": b"absent"}))
    assert store.latest_manifest("run") is None


def test_manifest_blob_size_must_match(store: store_lib.BlobStore) -> None:
    digest, _ = store.put_blob(b"four")
    ref = {"name": "a", "digest": digest, "size_bytes": 5}
    manifest = {"run_id": "run", "step": 1, "blobs": [ref]}
    with pytest.raises(errors.InvalidArgument):
        store.commit_manifest(manifest)


def test_step_must_increase_but_an_identical_retry_is_accepted(store) -> None:
    store.put_blob(b"a")
    store.put_blob(b"b")
    assert store.commit_manifest(_manifest("run", 5, {"p": b"a"}))[0] == 5
    # A retried commit whose response was lost: same step, same content.
    assert store.commit_manifest(_manifest("run", 5, {"p": b"a"})) == (5, 0)
    with pytest.raises(errors.FailedPrecondition, match="not after"):
        store.commit_manifest(_manifest("run", 5, {"p": b"b"}))
    with pytest.raises(errors.FailedPrecondition, match="not after"):
        store.commit_manifest(_manifest("run", 4, {"p": b"a"}))
    assert [m["step"] for m in store.list_manifests("run")] == [5]


@pytest.mark.parametrize("run_id", ["", ".", "..", "../etc", "a/b", ".hidden", "x" * 129, "a b"])
def test_unsafe_run_id_is_invalid_argument(store: store_lib.BlobStore, run_id: str) -> None:
    with pytest.raises(errors.InvalidArgument):
        store.commit_manifest({"run_id": run_id, "step": 1, "blobs": []})
    with pytest.raises(errors.InvalidArgument):
        store.latest_manifest(run_id)
    with pytest.raises(errors.InvalidArgument):
        store.list_manifests(run_id)


def test_duplicate_blob_names_are_invalid(store: store_lib.BlobStore) -> None:
    digest, _ = store.put_blob(b"x")
    ref = {"name": "p", "digest": digest, "size_bytes": 1}
    with pytest.raises(errors.InvalidArgument):
        store.commit_manifest({"run_id": "run", "step": 1, "blobs": [ref, ref]})


@pytest.mark.parametrize(
    "n, steps, expected",
    [
        (3, [], []),
        (3, [1, 2], [1, 2]),
        (3, [0, 1, 2, 3, 4], [2, 3, 4]),
        (1, [7, 9], [9]),
    ],
)
def test_latest_n_policy(n: int, steps: list[int], expected: list[int]) -> None:
    keep = store_lib.LatestN(n).should_preserve(steps)
    assert [s for s, k in zip(steps, keep) if k] == expected


def test_latest_n_rejects_zero() -> None:
    with pytest.raises(ValueError, match="n=0"):
        store_lib.LatestN(0)


def test_retention_and_gc_remove_only_unreferenced_old_blobs(tmp_path: pathlib.Path) -> None:
    store = store_lib.BlobStore(tmp_path, retention=store_lib.LatestN(2), gc_grace_s=60)
    names = ["s1", "s2", "s3", "shared", "orphan", "other", "wip"]
    blobs = {name: store.put_blob(name.encode())[0] for name in names}
    store.commit_manifest(_manifest("other-run", 1, {"p": b"other"}))
    store.commit_manifest(_manifest("run", 1, {"p": b"s1", "q": b"shared"}))
    store.commit_manifest(_manifest("run", 2, {"p": b"s2", "q": b"shared"}))
    assert _blob_files(tmp_path) == set(blobs.values())  # all young: GC removed nothing
    old_s = time.time() - 3600
    for name in names[:-1]:  # everything ages past the grace period except "wip", a blob of a
        path = store.root / "blobs" / blobs[name][:2] / blobs[name]  # checkpoint in progress
        os.utime(path, (old_s, old_s))

    _, pruned = store.commit_manifest(_manifest("run", 3, {"p": b"s3", "q": b"shared"}))

    assert pruned == 1
    assert [m["step"] for m in store.list_manifests("run")] == [2, 3]
    assert _blob_files(tmp_path) == {blobs[n] for n in ["s2", "s3", "shared", "other", "wip"]}
    assert [m["step"] for m in store.list_manifests("other-run")] == [1]


def test_stat_protects_an_old_unreferenced_blob_from_gc(tmp_path: pathlib.Path) -> None:
    store = store_lib.BlobStore(tmp_path, retention=store_lib.LatestN(1), gc_grace_s=60)
    digest, _ = store.put_blob(b"reused")
    old_s = time.time() - 3600
    os.utime(store.root / "blobs" / digest[:2] / digest, (old_s, old_s))
    assert store.stat([digest]) == {digest}  # a client decides to skip uploading it
    store.put_blob(b"other")
    store.commit_manifest(_manifest("run", 1, {"p": b"other"}))  # runs GC
    assert store.commit_manifest(_manifest("run", 2, {"p": b"reused"}))[0] == 2


def test_enospc_on_blob_write_is_resource_exhausted_and_leaves_nothing(tmp_path) -> None:
    root = tmp_path / "root"
    healthy = store_lib.BlobStore(root)
    healthy.put_blob(b"v1")
    healthy.commit_manifest(_manifest("run", 1, {"p": b"v1"}))

    full = store_lib.BlobStore(root, failpoints="store.write=enospc")
    writer = full.begin_blob(_sha(b"v2"), 2)
    with pytest.raises(errors.ResourceExhausted):
        writer.write(b"v2")
    assert _tmp_files(root) == []
    assert full.stat([_sha(b"v2")]) == set()
    assert full.latest_manifest("run")["step"] == 1
    assert b"".join(full.read_blob(_sha(b"v1"))) == b"v1"


@pytest.mark.parametrize("point", ["store.write", "store.after_tmp_write", "store.before_rename"])
def test_enospc_on_manifest_commit_keeps_the_earlier_checkpoint(tmp_path, point: str) -> None:
    root = tmp_path / "root"
    healthy = store_lib.BlobStore(root)
    healthy.put_blob(b"v1")
    healthy.put_blob(b"v2")
    healthy.commit_manifest(_manifest("run", 1, {"p": b"v1"}))

    full = store_lib.BlobStore(root, failpoints=f"{point}=enospc")
    with pytest.raises(errors.ResourceExhausted):
        full.commit_manifest(_manifest("run", 2, {"p": b"v2"}))

    assert _tmp_files(root) == []
    assert [m["step"] for m in healthy.list_manifests("run")] == [1]
    assert b"".join(healthy.read_blob(_sha(b"v1"))) == b"v1"


def test_store_failpoints_parse_and_refuse_typos_and_other_services_points(tmp_path) -> None:
    assert failpoints.parse("", prefix="store.") == {}
    assert failpoints.parse("store.after_tmp_write=crash, store.write=enospc", prefix="store.") == {
        "store.after_tmp_write": ("crash", 1),
        "store.write": ("enospc", 1),
    }
    for bad in ["store.nope=crash", "store.write=explode", "store.write", "store.write=stall",
                "syncer.after_quorum=crash"]:
        with pytest.raises(ValueError):
            failpoints.parse(bad, prefix="store.")
    with pytest.raises(ValueError):  # a store's failure mode at a syncer point
        failpoints.parse("syncer.after_quorum=enospc", prefix="syncer.")
    with pytest.raises(ValueError, match="unknown failpoint"):
        store_lib.BlobStore(tmp_path, failpoints="store.nope=crash")


def test_enospc_from_the_nth_write_on_stays_full(tmp_path) -> None:
    # A disk that fills up stays full: the 2nd write fails and so does every later one.
    store = store_lib.BlobStore(tmp_path / "root", failpoints="store.write=enospc@2")
    store.put_blob(b"first")
    for data in (b"second", b"third"):
        with pytest.raises(errors.ResourceExhausted):
            store.put_blob(data)
    assert store.stat([_sha(b"first"), _sha(b"second"), _sha(b"third")]) == {_sha(b"first")}
    assert _tmp_files(tmp_path / "root") == []


# --- config -----------------------------------------------------------------------------------


def test_config_flags_override_env_which_overrides_defaults(tmp_path: pathlib.Path) -> None:
    environ = {
        "DDILOCO_CHECKPOINT_ROOT": str(tmp_path),
        "DDILOCO_CHECKPOINT_KEEP_LATEST": "3",
        "DDILOCO_CHECKPOINT_JSON_LOGS": "true",
        "DDILOCO_FAILPOINTS": "store.write=enospc",
    }
    cfg = config_lib.parse_config(["--keep-latest", "7", "--bind", "127.0.0.1:0"], environ)
    assert cfg.root == tmp_path and cfg.keep_latest == 7 and cfg.bind == "127.0.0.1:0"
    assert cfg.json_logs is True and cfg.failpoints == "store.write=enospc"
    assert cfg.chunk_size_bytes == 512 * 1024 and cfg.ready_file is None


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--keep-latest", "0"], "keep_latest"),
        (["--bind", "nohost"], "bind"),
        (["--chunk-size-bytes", str(64 * 1024 * 1024)], "chunk_size_bytes"),
        (["--gc-grace-s", "-1"], "gc_grace_s"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(argv, field, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        config_lib.parse_config(["--root", str(tmp_path), *argv], {})
    assert field in capsys.readouterr().err


def test_config_help_mentions_every_env_var(capsys) -> None:
    with pytest.raises(SystemExit):
        config_lib.parse_config(["--help"], {})
    out = " ".join(capsys.readouterr().out.split())
    for field in [f.name for f in dataclasses.fields(config_lib.CheckpointConfig)]:
        env = config_lib.FAILPOINTS_ENV if field == "failpoints" else config_lib._env(field)
        assert env in out


def test_restore_manifest_fills_a_step_below_the_latest(tmp_path: pathlib.Path) -> None:
    store = store_lib.BlobStore(tmp_path, retention=store_lib.LatestN(3))
    blobs = {f"b{i}": os.urandom(100) for i in range(6)}
    for data in blobs.values():
        store.put_blob(data)
    for step in (1, 3, 4):
        store.commit_manifest(_manifest("run", step, {"p": blobs[f"b{step}"]}))
    with pytest.raises(errors.FailedPrecondition):  # a writer may not go back ...
        store.commit_manifest(_manifest("run", 2, {"p": blobs["b2"]}))
    # ... a repair may: its peer committed step 2 while this replica was down.
    assert store.restore_manifest(_manifest("run", 2, {"p": blobs["b2"]})) == (True, True)
    assert [m["step"] for m in store.list_manifests("run")] == [2, 3, 4]  # LatestN(3) dropped 1
    assert store.restore_manifest(_manifest("run", 2, {"p": blobs["b2"]})) == (False, True)
    with pytest.raises(errors.AlreadyExists, match="step 3"):
        store.restore_manifest(_manifest("run", 3, {"p": blobs["b5"]}))
    # Older than every retained step: written, then dropped by retention at once.
    assert store.restore_manifest(_manifest("run", 0, {"p": blobs["b0"]})) == (True, False)
    with pytest.raises(errors.FailedPrecondition, match="copy the blobs"):
        store.restore_manifest(_manifest("run", 9, {"p": b"not stored"}))
    assert store.latest_manifest("run")["step"] == 4
