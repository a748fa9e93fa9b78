"""The data flags (ddiloco.data.sources): text directories, uint16/uint32 token files, the
`--data-source` iterator hook, named held-out splits, size-cap warnings, per-shard counts and the
vocabulary check; and how the learner/evaluator configs refuse bad data flags."""

from __future__ import annotations

import gzip
import json
import logging
import sys
import textwrap

import numpy as np
import pytest

from ddiloco.data import corpus, sources
from ddiloco.data.sources import DataSpec
from services.learner import config as config_lib


def _spec(**kwargs) -> DataSpec:
    return DataSpec(**{"num_shards": 2, "heldout_fraction": 0.2, **kwargs})


def _write_texts(root, count=40, size_bytes=600, prefix="doc"):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (root / f"{prefix}{i:02d}.txt").write_text((f"{prefix} {i} says hello. " * 100)[:size_bytes])
    return root


# ------------------------------------------------------------------------------ text directories


def test_text_directory_reads_every_text_file_recursively_and_counts_skipped_binary_files(tmp_path):
    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "notes.md").write_text("# notes\n")
    (tmp_path / "README").write_text("no extension\n")
    (tmp_path / "deep" / "er" / "page.rst").write_text("deep text\n")
    # A multi-byte character cut by the 8 KiB sniff window is still UTF-8 text.
    (tmp_path / "long.txt").write_text("a" + "é" * 5000, encoding="utf-8")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (tmp_path / "notes.txt.gz").write_bytes(gzip.compress(b"compressed text " * 100))
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))  # not UTF-8: skipped as binary
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("[core]\n")
    (tmp_path / ".hidden.txt").write_text("hidden\n")
    loaded = corpus.read_text_directory(tmp_path)
    assert [path for path, _ in loaded.documents] == ["README", "deep/er/page.rst", "long.txt", "notes.md"]
    assert loaded.skipped_binary == ("image.png", "latin1.txt", "notes.txt.gz")
    (warning,) = loaded.warnings
    assert "skipped 3 binary files" in warning and "image.png" in warning


def test_a_directory_without_text_is_refused_and_says_what_was_skipped(tmp_path):
    with pytest.raises(ValueError, match="no non-empty text files: add some text"):
        sources.load(_spec(data_dir=str(tmp_path)))
    (tmp_path / "a.bin.gz").write_bytes(gzip.compress(b"x" * 100))
    (tmp_path / "b.dat").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match=r"\(2 binary files skipped\)"):
        sources.load(_spec(data_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="not a directory"):
        sources.load(_spec(data_dir=str(tmp_path / "missing")))


def test_a_size_cap_that_truncates_text_is_a_warning_with_what_was_left_out(tmp_path, caplog):
    _write_texts(tmp_path, count=10, size_bytes=1000)
    with caplog.at_level(logging.WARNING, logger="ddiloco.data"):
        split = sources.load(_spec(data_dir=str(tmp_path), max_bytes=2_500, heldout_fraction=0.0))
    (warning,) = split.warnings
    assert "max_corpus_bytes=2,500 truncated the data after 3 files" in warning
    assert "the rest of doc02.txt and 7 more files (~0.0 MiB)" in warning and "--max-corpus-bytes" in warning
    assert warning in caplog.text  # logged, so a learner's log shows it
    assert sum(len(s) for s in split.shards) == 2_500 + 3 - (2_503 % 2)  # bytes + separators, whole shards
    # Exactly enough room: nothing is left out, no warning.
    assert sources.load(_spec(data_dir=str(tmp_path), max_bytes=10_000, heldout_fraction=0.0)).warnings == ()


def test_per_shard_document_and_token_counts(tmp_path):
    _write_texts(tmp_path, count=40)
    split = sources.load(_spec(data_dir=str(tmp_path), num_shards=3))
    assert split.shard_documents is not None and len(split.shard_documents) == 3
    # Every training document starts in exactly one shard (none is shorter than the dropped tail).
    assert sum(split.shard_documents) + split.heldout_documents == 40
    assert all(n > 5 for n in split.shard_documents) and split.heldout_documents > 0
    pieces = [shard.tobytes().count(corpus.DOCUMENT_SEPARATOR) for shard in split.shards]
    assert abs(sum(pieces) - sum(split.shard_documents)) <= 1  # the last document may lose its separator
    lines = split.summary_lines()
    assert lines[0] == f"shard 0 of 3: {split.shard_documents[0]} documents, {len(split.shards[0]):,} bytes"
    assert lines[-1] == f"held out: {split.heldout_documents} documents, {len(split.heldout):,} bytes"


# ---------------------------------------------------------------------------------- token files


def _nanogpt_dir(root, dtype, train, val=None, meta=None):
    root.mkdir(parents=True, exist_ok=True)
    np.asarray(train).astype(dtype).tofile(root / "train.bin")
    if val is not None:
        np.asarray(val).astype(dtype).tofile(root / "val.bin")
    if meta is not None:
        (root / "meta.json").write_text(json.dumps(meta))
    return str(root)


def test_uint32_token_files_hold_ids_beyond_uint16_and_the_vocabulary_must_cover_them(tmp_path):
    train = (np.arange(20_000) * 7919) % 70_001
    train[1234] = 70_000  # the largest id, beyond uint16
    path = _nanogpt_dir(tmp_path / "d", "<u4", train, val=np.arange(500) + 65_000)
    split = sources.load(_spec(data_dir=path, token_dtype="uint32"))
    assert split.shards[0].dtype == np.uint32 and not split.byte_level
    np.testing.assert_array_equal(np.concatenate(split.shards), train)  # val.bin is held out: all of train.bin trains
    np.testing.assert_array_equal(split.heldout, np.arange(500) + 65_000)
    assert split.max_token == 70_000 and "uint32" in split.source and "held out: val.bin" in split.source
    assert split.shard_summary(1) == "shard 1 of 2: 10,000 tokens" and split.heldout_summary() == "held out: 500 tokens"
    assert sources.required_vocab_size(split) == 70_001
    assert sources.suggested_vocab_size(split) == 70_016  # a multiple of 64
    sources.check_vocabulary(split, 70_001)
    with pytest.raises(ValueError, match=r"needs a vocabulary of 70,001 ids \(it holds token id 70000\) but the "
                                         r"model's vocab_size is 65,536.*vocab_size\": 70016"):
        sources.check_vocabulary(split, 65_536)


def test_uint32_tokens_read_as_uint16_are_refused_with_the_flag_to_use(tmp_path):
    path = _nanogpt_dir(tmp_path / "d", "<u4", np.arange(5_000) % 300)
    with pytest.raises(ValueError, match="every second uint16 value is 0.*--token-dtype uint32"):
        sources.load(_spec(data_dir=path))
    # uint16 tokens read as uint32: huge ids, and the vocabulary check says which flag is wrong.
    path16 = _nanogpt_dir(tmp_path / "e", "<u2", np.arange(5_000) % 300 + 1)
    split = sources.load(_spec(data_dir=path16, token_dtype="uint32"))
    with pytest.raises(ValueError, match="pass --token-dtype uint16 instead"):
        sources.check_vocabulary(split, 512)


@pytest.mark.parametrize("dtype, content, match", [
    ("uint32", b"\x01\x00\x02\x00\x03\x00", r"little-endian uint32 tokens \(6 bytes\).*is it uint16"),
    ("uint16", b"\x01\x02\x03", r"little-endian uint16 tokens \(3 bytes\)"),
    ("uint32", b"", r"uint32 tokens \(0 bytes\)"),
])
def test_a_token_file_that_is_not_whole_tokens_of_its_dtype_is_refused(tmp_path, dtype, content, match):
    (tmp_path / "t.bin").write_bytes(content)
    with pytest.raises(ValueError, match=match):
        sources.load(_spec(data_dir=str(tmp_path / "t.bin"), token_dtype=dtype))


def test_bad_dtypes_are_refused_by_the_spec_the_configs_and_meta_json(tmp_path):
    with pytest.raises(ValueError, match="token_dtype='int8' is unknown: use one of uint16, uint32"):
        DataSpec(token_dtype="int8")
    with pytest.raises(ValueError, match="token dtype='float32' is unknown"):
        corpus.load_token_file(tmp_path / "x.bin", dtype="float32")
    for parse in (lambda argv: config_lib.parse_learner_config(["--learner-id", "l0", *argv], {}),
                  lambda argv: config_lib.parse_evaluator_config(argv, {})):
        with pytest.raises(SystemExit):  # a usage error, exit status 2
            parse(["--token-dtype", "uint8"])
        with pytest.raises(SystemExit):
            parse(["--data-dir", "d", "--data-source", "m:f"])
        with pytest.raises(SystemExit):
            parse(["--data-source", "no-colon"])
    with pytest.raises(ValueError, match="LearnerConfig: data_dir='d' and data_source='m:f': pass one of them"):
        config_lib.LearnerConfig(data_dir="d", data_source="m:f")
    cfg = config_lib.parse_evaluator_config(["--data-dir", "d", "--token-dtype", "uint32", "--heldout-dir", "h"], {})
    assert cfg.data_spec() == DataSpec(data_dir="d", token_dtype="uint32", heldout_dir="h")
    path = _nanogpt_dir(tmp_path / "d", "<u2", np.arange(100), meta={"dtype": "int64"})
    with pytest.raises(ValueError, match="meta.json: dtype='int64' is unknown"):
        sources.load(_spec(data_dir=path))


def test_meta_json_names_the_dtype_and_declares_the_vocabulary(tmp_path):
    path = _nanogpt_dir(tmp_path / "d", "<u4", np.arange(4_000) % 500, meta={"dtype": "uint32", "vocab_size": 1_000})
    split = sources.load(_spec(data_dir=path))  # no flag: meta.json's dtype
    assert split.shards[0].dtype == np.uint32 and split.max_token == 499 and split.declared_vocab_size == 1_000
    assert sources.suggested_vocab_size(split) == 1_024
    with pytest.raises(ValueError, match="its meta.json declares vocab_size=1000"):
        sources.check_vocabulary(split, 512)
    with pytest.raises(ValueError, match="token_dtype='uint16' but .*meta.json says dtype='uint32'"):
        sources.load(_spec(data_dir=path, token_dtype="uint16"))


def test_a_size_cap_that_truncates_a_token_file_is_a_warning(tmp_path):
    path = _nanogpt_dir(tmp_path / "d", "<u2", np.arange(10_000) % 300, val=np.arange(100))
    split = sources.load(_spec(data_dir=path, max_bytes=4_000))
    assert sum(len(s) for s in split.shards) == 2_000
    (warning,) = split.warnings
    assert "holds 10,000 uint16 tokens and only the first 2,000 (20.0%) are read" in warning
    assert "--max-corpus-bytes" in warning
    assert sources.load(_spec(data_dir=path, max_bytes=20_000)).warnings == ()


def test_the_text_vocabulary_is_the_256_byte_values(tmp_path):
    split = sources.load(_spec(data_dir=str(_write_texts(tmp_path))))
    assert split.byte_level and sources.suggested_vocab_size(split) == 256
    sources.check_vocabulary(split, 256)
    with pytest.raises(ValueError, match="vocab_size is 128"):
        sources.check_vocabulary(split, 128)


# ------------------------------------------------------------------------------ named held-out split


def test_a_heldout_directory_replaces_the_fraction_and_is_never_trained_on(tmp_path):
    data = _write_texts(tmp_path / "data", count=30, prefix="train")
    heldout = _write_texts(tmp_path / "val", count=5, prefix="val")
    split = sources.load(_spec(data_dir=str(data), heldout_dir=str(heldout)))
    assert split.heldout_documents == 5 and sum(split.shard_documents) == 30  # every data document trains
    assert b"val 3 says" in split.heldout.tobytes() and b"train" not in split.heldout.tobytes()
    assert not any(b"val " in s.tobytes() for s in split.shards)
    assert f"(held out: {heldout})" in split.source
    # Inside the data directory: left out of training.
    nested = _write_texts(data / "heldout", count=4, prefix="val")
    split = sources.load(_spec(data_dir=str(data), heldout_dir=str(nested)))
    assert split.heldout_documents == 4 and sum(split.shard_documents) == 30
    assert not any(b"val " in s.tobytes() for s in split.shards)
    with pytest.raises(ValueError, match="contains data_dir.*use separate directories"):
        sources.load(_spec(data_dir=str(nested), heldout_dir=str(data)))
    with pytest.raises(ValueError, match="contains data_dir"):
        sources.load(_spec(data_dir=str(data), heldout_dir=str(data)))


def test_a_heldout_token_file_for_token_data(tmp_path):
    path = _nanogpt_dir(tmp_path / "d", "<u2", np.arange(4_000) % 300, val=np.full(50, 1))
    np.full(80, 7, dtype="<u2").tofile(tmp_path / "mine.bin")
    split = sources.load(_spec(data_dir=path, heldout_dir=str(tmp_path / "mine.bin")))
    assert split.heldout.tolist() == [7] * 80  # the named split wins over val.bin
    with pytest.raises(ValueError, match="holds text but data_dir=.* holds tokens"):
        sources.load(_spec(data_dir=path, heldout_dir=str(_write_texts(tmp_path / "texts", count=3))))


# ------------------------------------------------------------------------------- the iterator hook


_USER_MODULE = textwrap.dedent('''
    import itertools
    import numpy as np

    def texts():
        return (f"story {i}: " + "once upon a time " * (5 + i % 7) for i in range(60))

    def tokens():
        return [(np.arange(40) + 3 * i) % 97 for i in range(50)]

    def named():
        return {"train": [f"train text {i} " * 20 for i in range(30)], "heldout": ["held-out text " * 20] * 3}

    def endless():
        return (f"line {i}\\n" for i in itertools.count())

    def rows():
        return [{"text": "a dataset row"}]

    def mixed():
        return ["text", np.arange(5)]

    def broken():
        raise KeyError("no such split")

    def empty():
        return []

    class Factories:
        @staticmethod
        def small():
            return ["x" * 100] * 10

    not_callable = 3
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"my_data_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(_USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_factory_of_texts_is_split_like_a_text_directory(user_module):
    split = sources.load(_spec(data_source=f"{user_module}:texts"))
    assert split.byte_level and split.heldout_documents > 0
    assert sum(split.shard_documents) + split.heldout_documents == 60
    again = sources.load(_spec(data_source=f"{user_module}:texts"))
    assert all(np.array_equal(a, b) for a, b in zip(split.shards, again.shards))
    # Dealt to shards in the seeded shuffle, not in the order the factory yielded them.
    first = split.shards[0].tobytes().split(corpus.DOCUMENT_SEPARATOR)[:5]
    assert [int(doc.split(b":")[0].split()[1]) for doc in first] != sorted(
        int(doc.split(b":")[0].split()[1]) for doc in first)


def test_a_factory_of_token_arrays_and_a_dotted_attribute(user_module):
    split = sources.load(_spec(data_source=f"{user_module}:tokens"))
    assert split.shards[0].dtype == np.uint32 and split.max_token == 96
    assert sum(len(s) for s in split.shards) + len(split.heldout) == 50 * 40  # no separator between token documents
    assert sources.suggested_vocab_size(split) == 128
    small = sources.load(_spec(data_source=f"{user_module}:Factories.small", heldout_fraction=0.0))
    assert sum(small.shard_documents) == 10


def test_a_factory_can_name_its_heldout_split(user_module):
    split = sources.load(_spec(data_source=f"{user_module}:named"))
    assert split.heldout_documents == 3 and sum(split.shard_documents) == 30
    assert split.heldout.tobytes().count(b"held-out text") == 60
    assert not any(b"held-out" in s.tobytes() for s in split.shards)


def test_an_endless_factory_stops_at_the_cap_with_a_warning(user_module):
    split = sources.load(_spec(data_source=f"{user_module}:endless", max_bytes=5_000))
    (warning,) = split.warnings
    assert "max_corpus_bytes=5,000 truncated the data after" in warning
    assert sum(len(s) for s in split.shards) + len(split.heldout) <= 5_000 + 5_000 // 7  # bytes + separators


@pytest.mark.parametrize("factory, match", [
    ("rows", r"\[0\] is a dict .*yield str, bytes or 1-D integer token arrays \(for rows of a dataset, yield row\['text'\]\)"),
    ("mixed", "mix text .* and token arrays"),
    ("broken", "the factory raised KeyError: 'no such split'"),
    ("empty", "yielded no non-empty document"),
    ("not_callable", "'not_callable' is a int, not a callable factory"),
    ("missing", "has no attribute 'missing'"),
])
def test_bad_factories_are_refused_clearly(user_module, factory, match):
    with pytest.raises(ValueError, match=match):
        sources.load(_spec(data_source=f"{user_module}:{factory}"))


def test_a_factory_that_cannot_be_imported_or_named_is_refused():
    with pytest.raises(ValueError, match="cannot import 'no_such_module_xyz'.*PYTHONPATH"):
        sources.load(_spec(data_source="no_such_module_xyz:factory"))
    with pytest.raises(ValueError, match="use package.module:factory"):
        DataSpec(data_source="just_a_module")


def test_load_split_keeps_its_signature_for_existing_callers(tmp_path):
    path = _nanogpt_dir(tmp_path / "d", "<u4", np.arange(3_000) % 300)
    split = corpus.load_split(path, 2**20, 2, 0.1, token_dtype="uint32")
    assert split.shards[0].dtype == np.uint32 and len(split.heldout) == 300
