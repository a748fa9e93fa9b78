"""Corpus loading, deterministic split, batch sampling and held-out batches."""

import os
import random

import numpy as np
import pytest

from ddiloco.data import corpus

from ddiloco.data import (
    DOCUMENT_SEPARATOR,
    BatchSampler,
    heldout_batches,
    is_heldout,
    load_stdlib_documents,
    load_text_directory,
    split_corpus,
)


def _documents(count=200):
    # Each document's bytes are unique to it, so its position can be checked in a shard.
    return [(f"pkg/mod{i:03d}.py", f"# module {i}\n".encode() * (1 + i % 7)) for i in range(count)]


def _joined(documents):
    return b"".join(data + DOCUMENT_SEPARATOR for _, data in documents)


def test_split_is_deterministic():
    first, second = split_corpus(_documents(), 4), split_corpus(_documents(), 4)
    assert first.source == second.source
    assert np.array_equal(first.heldout, second.heldout)
    assert all(np.array_equal(a, b) for a, b in zip(first.shards, second.shards))


def _pieces(split):
    """The documents the shards hold, in shard order (the last one may be cut short)."""
    return b"".join(shard.tobytes() for shard in split.shards).split(DOCUMENT_SEPARATOR)


@pytest.mark.parametrize("shard_seed", [0, 1, 7])
def test_heldout_documents_never_reach_shards(shard_seed):
    documents = _documents()
    split = split_corpus(documents, num_shards=3, heldout_fraction=0.1, shard_seed=shard_seed)
    heldout = [doc for doc in documents if is_heldout(doc[0], 0.1)]
    assert 0 < len(heldout) < len(documents) // 2
    # The held-out set is the held-out documents in the given order, whatever the shard seed.
    assert split.heldout.tobytes() == _joined(heldout)
    heldout_data = {data for _, data in heldout}
    assert not heldout_data & set(_pieces(split))
    for shard in split.shards:
        assert not any(shard.tobytes().find(data) >= 0 for data in heldout_data)
    assert "200 files" in split.source


@pytest.mark.parametrize("num_shards", [1, 3, 4, 7])
def test_shards_are_disjoint_and_cover_the_training_documents(num_shards):
    documents = _documents()
    train = [data for path, data in documents if not is_heldout(path, 0.1)]
    split = split_corpus(documents, num_shards=num_shards, heldout_fraction=0.1)
    *whole, last = _pieces(split)
    # Every training document once (no byte in two shards), but for the tail of fewer than
    # num_shards bytes: the last document may be cut short.
    assert len(whole) == len(set(whole)) and set(whole) <= set(train)
    (missing,) = set(train) - set(whole) or {last}
    assert missing.startswith(last) and len(missing) + 1 - len(last) <= num_shards
    assert sum(map(len, whole)) + len(whole) + len(last) == sum(len(s) for s in split.shards)
    # Whole documents per shard: at most num_shards - 1 are cut at a shard boundary.
    cut = sum(1 for shard in split.shards[:-1] if shard[-1] != DOCUMENT_SEPARATOR[0])
    assert cut <= num_shards - 1


def test_shards_are_a_seeded_shuffle_not_the_path_order():
    documents = _documents()
    train = [data for path, data in documents if not is_heldout(path, 0.05)]
    first = split_corpus(documents, 4)
    assert _pieces(first)[:-1] != train[: len(_pieces(first)) - 1]  # not the given (sorted) order
    again = split_corpus(documents, 4, shard_seed=corpus.SHARD_SEED)
    other = split_corpus(documents, 4, shard_seed=corpus.SHARD_SEED + 1)
    assert all(np.array_equal(a, b) for a, b in zip(first.shards, again.shards))
    assert not any(np.array_equal(a, b) for a, b in zip(first.shards, other.shards))
    assert np.array_equal(first.heldout, other.heldout)  # the seed never moves held-out documents


def _unigram(tokens):
    return np.bincount(tokens, minlength=256) / len(tokens)


def _jensen_shannon_bits(p, q):
    m = (p + q) / 2
    return sum(0.5 * float(np.sum(a[a > 0] * np.log2(a[a > 0] / m[a > 0]))) for a in (p, q))


def test_stdlib_shards_are_alike():
    # Contiguous slices of the sorted stdlib paths put every encodings/ codec table in one shard:
    # its byte unigram distribution was 47.6 mbit (Jensen-Shannon) from the training split's and
    # its entropy 0.43 bit/byte above another shard's. A seeded shuffle gives 0.6 mbit, 0.06 bit.
    documents = load_stdlib_documents()
    split = split_corpus(documents, num_shards=4)
    train = np.concatenate(split.shards)
    entropies = []
    for shard in split.shards:
        p = _unigram(shard)
        assert _jensen_shannon_bits(p, _unigram(train)) < 0.005
        entropies.append(-float(np.sum(p[p > 0] * np.log2(p[p > 0]))))
    assert max(entropies) - min(entropies) < 0.2
    # Documents of one directory are spread over the shards, not all in one.
    encodings = [data for path, data in documents if path.startswith("encodings/") and not is_heldout(path, 0.05)]
    assert len(encodings) >= 40
    per_shard = [sum(shard.tobytes().count(data + DOCUMENT_SEPARATOR) > 0 for data in set(encodings))
                 for shard in split.shards]
    assert max(per_shard) < 0.5 * len(set(encodings))


def test_assignment_depends_only_on_the_path():
    documents = _documents()
    subset = random.Random(0).sample(documents, 50)
    full = {path for path, _ in documents if is_heldout(path, 0.2)}
    assert {path for path, _ in subset if is_heldout(path, 0.2)} == full & {p for p, _ in subset}


def test_shards_are_equal_read_only_uint8():
    split = split_corpus(_documents(), num_shards=4)
    assert len(split.shards) == 4
    assert len({len(shard) for shard in split.shards}) == 1
    for array in (*split.shards, split.heldout):
        assert array.dtype == np.uint8 and not array.flags.writeable


@pytest.mark.parametrize(
    "documents, kwargs, match",
    [
        ([], {"num_shards": 2}, "empty"),
        ([("a.py", b"")], {"num_shards": 2}, "empty"),
        (_documents(), {"num_shards": 0}, "num_shards"),
        (_documents(), {"num_shards": 2, "heldout_fraction": 1.0}, "heldout_fraction"),
        (_documents(2), {"num_shards": 2, "heldout_fraction": 1e-9}, "heldout_fraction"),
        ([("a.py", b"x")], {"num_shards": 5, "heldout_fraction": 0.0}, "num_shards"),
    ],
)
def test_split_rejects_bad_input(documents, kwargs, match):
    with pytest.raises(ValueError, match=match):
        split_corpus(documents, **kwargs)


def test_sampler_is_deterministic_per_seed():
    tokens = np.arange(200, dtype=np.uint8)
    first = [BatchSampler(tokens, 8, 16, seed=3).next() for _ in range(2)]
    sampler = BatchSampler(tokens, 8, 16, seed=3)
    assert np.array_equal(first[0], first[1])
    assert not np.array_equal(sampler.next(), sampler.next())
    assert not np.array_equal(first[0], BatchSampler(tokens, 8, 16, seed=4).next())


def test_sampler_windows_are_contiguous_and_cover_the_range():
    tokens = np.arange(200, dtype=np.uint8)  # token value == position
    sampler = BatchSampler(tokens, batch_size=8, seq_len=16, seed=0)
    assert sampler.tokens_per_batch == 8 * 16
    starts = []
    for _ in range(200):
        batch = sampler.next()
        assert batch.shape == (8, 17) and batch.dtype == np.int32
        np.testing.assert_array_equal(batch - batch[:, :1], np.broadcast_to(np.arange(17), (8, 17)))
        starts.extend(batch[:, 0])
    assert min(starts) == 0 and max(starts) == 200 - 17


def test_too_little_data_says_how_much_is_needed():
    with pytest.raises(ValueError, match="seq_len\\+1=33"):
        BatchSampler(np.zeros(20, np.uint8), batch_size=2, seq_len=32, seed=0)
    with pytest.raises(ValueError, match="seq_len\\+1=33"):
        heldout_batches(np.zeros(20, np.uint8), batch_size=2, seq_len=32, num_batches=1)


def test_heldout_batches_are_evenly_spaced_and_deterministic():
    tokens = np.arange(250, dtype=np.uint8)
    batches = heldout_batches(tokens, batch_size=4, seq_len=16, num_batches=3)
    assert len(batches) == 3 and all(b.shape == (4, 17) and b.dtype == np.int32 for b in batches)
    starts = np.concatenate([b[:, 0] for b in batches])
    assert starts[0] == 0 and starts[-1] == 250 - 17
    assert np.all(np.diff(starts) > 0)
    again = heldout_batches(tokens, batch_size=4, seq_len=16, num_batches=3)
    assert all(np.array_equal(a, b) for a, b in zip(batches, again))


def test_text_directory_loads_regular_files_sorted_and_capped(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_bytes(b"22")
    (tmp_path / "a.txt").write_bytes(b"1")
    (tmp_path / "c.txt").write_bytes(b"333")
    (tmp_path / "empty.txt").write_bytes(b"")
    os.symlink(tmp_path / "a.txt", tmp_path / "link.txt")
    assert load_text_directory(tmp_path) == [("a.txt", b"1"), ("b/two.txt", b"22"), ("c.txt", b"333")]
    assert load_text_directory(tmp_path, max_bytes=4) == [("a.txt", b"1"), ("b/two.txt", b"22"), ("c.txt", b"3")]


def test_text_directory_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_text_directory(tmp_path / "missing")
    with pytest.raises(ValueError, match="no non-empty text files"):
        load_text_directory(tmp_path)


def test_stdlib_documents_are_sorted_filtered_and_capped():
    documents = load_stdlib_documents(max_bytes=300_000)
    paths = [path for path, _ in documents]
    assert paths == sorted(paths) and all(p.endswith(".py") for p in paths)
    excluded = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    assert not any(excluded & set(p.split("/")) for p in paths)
    assert sum(len(data) for _, data in documents) == 300_000
    assert documents == load_stdlib_documents(max_bytes=300_000)


# ------------------------------------------------------------------------- token files (nanoGPT)


def test_token_file_split_is_deterministic_disjoint_and_memory_mapped(tmp_path):
    tokens = (np.arange(10_000) * 7919 % 50_000).astype("<u2")
    path = tmp_path / "data.bin"
    tokens.tofile(path)
    split = corpus.load_split(str(path), max_bytes=2**30, num_shards=4, heldout_fraction=0.1)
    assert split.shards[0].dtype == np.uint16 and len(split.shards) == 4
    assert all(len(s) == 9_000 // 4 for s in split.shards)
    np.testing.assert_array_equal(split.heldout, tokens[9_000:])  # the tail is held out
    np.testing.assert_array_equal(np.concatenate(split.shards), tokens[:9_000])
    assert isinstance(split.shards[0].base, np.memmap) or isinstance(split.shards[0], np.memmap)
    assert split.max_token == int(tokens.max())
    again = corpus.load_split(str(path), max_bytes=2**30, num_shards=4, heldout_fraction=0.1)
    np.testing.assert_array_equal(again.shards[3], split.shards[3])
    batch = corpus.BatchSampler(split.shards[0], 2, 16, seed=0).next()
    assert batch.dtype == np.int32 and batch.max() < 50_000


def test_nanogpt_directory_uses_val_bin_as_heldout_and_caps_tokens(tmp_path):
    np.arange(4_000, dtype="<u2").tofile(tmp_path / "train.bin")
    np.full(300, 7, dtype="<u2").tofile(tmp_path / "val.bin")
    split = corpus.load_split(str(tmp_path), max_bytes=2 * 2_000, num_shards=2, heldout_fraction=0.5)
    assert len(split.heldout) == 300 and set(split.heldout.tolist()) == {7}
    assert [len(s) for s in split.shards] == [1_000, 1_000]  # max_bytes // 2 tokens of train.bin, all trained on


@pytest.mark.parametrize("content", [b"", b"\x01\x02\x03"])
def test_bad_token_files_are_refused_clearly(tmp_path, content):
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="uint16"):
        corpus.load_split(str(path), max_bytes=2**20, num_shards=2, heldout_fraction=0.1)


def test_text_directory_still_loads_as_bytes(tmp_path):
    for i in range(40):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i} " * 50)
    split = corpus.load_split(str(tmp_path), max_bytes=2**20, num_shards=2, heldout_fraction=0.2)
    assert split.shards[0].dtype == np.uint8 and split.max_token == 255 and len(split.heldout) > 0
