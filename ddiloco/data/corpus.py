"""The training corpus: which bytes exist, how they split, how batches are drawn.

Owns: loading documents (the Python stdlib's own sources by default, or any user
directory), pre-tokenized uint16 token files (the nanoGPT ``train.bin`` / ``val.bin``
convention), the deterministic held-out/shard split, and batch sampling.
Must not: tokenize (text is bytes: token id == byte value; token files come tokenized), or
touch JAX.

Documents are ``(relative_path, bytes)`` pairs. A document's split is decided by
a hash of its path alone, so adding or removing other files never moves it
between the training and held-out sets. The training documents are dealt to the
learners' shards in a permutation drawn from ``SHARD_SEED`` (the same for every
learner of a run, so shards are disjoint and together cover the training split):
each shard is a random sample of the corpus, not a run of neighbouring paths (in
the stdlib, sorted paths put e.g. every ``encodings/`` codec table in one shard).
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# ~24 MiB bounds memory and load time (well under a second from page cache);
# the stdlib's own sources are ~10 MiB, so by default the cap does not bite.
DEFAULT_MAX_BYTES = 24 * 2**20
# Appended after every document. 0x00 never occurs in Python source or plain
# text, so the model can learn it as an unambiguous "end of document" token.
DOCUMENT_SEPARATOR = b"\x00"
# Third-party, test-suite and legacy-tool code that would skew the corpus.
_EXCLUDED_STDLIB_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
STDLIB_SOURCE_NAME = f"python{sys.version_info.major}.{sys.version_info.minor} stdlib"
# Seed of the permutation that deals training documents to shards. Fixed: every learner and the
# evaluator of a run must draw the same permutation, or shards would overlap and miss documents.
SHARD_SEED = 0


@dataclass(frozen=True, eq=False)  # eq=False: ndarray fields make == ambiguous
class CorpusSplit:
    """The training shards (one per learner) and the held-out set."""

    shards: tuple[np.ndarray, ...]  # uint8 (text) or uint16 (token files), read-only, equal length
    heldout: np.ndarray  # same dtype, read-only; from documents (or tokens) no shard contains
    source: str  # e.g. "python3.11 stdlib: 601 files, 10.6 MiB (571 train, 30 held out)"

    @property
    def max_token(self) -> int:
        """The largest token id in the data (the model's vocabulary must exceed it)."""
        if self.shards[0].dtype == np.uint8:
            return 255
        return int(max(max(int(s.max()) for s in self.shards), int(self.heldout.max()) if len(self.heldout) else 0))


def _read_capped(root: str | os.PathLike, rel_paths: Iterable[str], max_bytes: int) -> list[tuple[str, bytes]]:
    """Reads files in the given order until ``max_bytes``, truncating the last."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes}: use a positive byte count")
    documents, remaining_bytes = [], max_bytes
    for rel_path in rel_paths:
        with open(os.path.join(root, rel_path), "rb") as f:
            data = f.read(remaining_bytes)
        if data:
            documents.append((rel_path, data))
            remaining_bytes -= len(data)
        if remaining_bytes == 0:
            break
    return documents


def _walk_files(root: str, skip_dirs: frozenset[str] = frozenset()) -> list[str]:
    """Sorted POSIX-style relative paths of the regular files under ``root``."""
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        for filename in filenames:
            path = os.path.join(dirpath, filename)
            # Symlinks are skipped: they can escape the tree or duplicate a file.
            if os.path.isfile(path) and not os.path.islink(path):
                rel_paths.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return sorted(rel_paths)


def load_stdlib_documents(max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[str, bytes]]:
    """Loads this interpreter's standard-library ``.py`` sources as documents.

    Args:
        max_bytes: total byte cap; files are read in sorted path order and the
            last one is truncated to fit.

    Returns:
        ``(relative_path, bytes)`` pairs in sorted path order.

    Raises:
        ValueError: if ``max_bytes`` is not positive or no source file is found.
    """
    root = sysconfig.get_paths()["stdlib"]
    rel_paths = [p for p in _walk_files(root, _EXCLUDED_STDLIB_DIRS) if p.endswith(".py")]
    if not rel_paths:
        raise ValueError(f"no .py files under stdlib path {root!r}: pass a text directory instead")
    return _read_capped(root, rel_paths, max_bytes)


def load_text_directory(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[str, bytes]]:
    """Loads every regular file under ``path`` as a document (bytes, any content).

    Args:
        path: directory to walk recursively; symlinks are skipped.
        max_bytes: total byte cap; files are read in sorted path order and the
            last one is truncated to fit.

    Returns:
        ``(relative_path, bytes)`` pairs in sorted path order.

    Raises:
        ValueError: if ``path`` is not a directory, holds no non-empty file, or
            ``max_bytes`` is not positive.
    """
    root = os.fspath(path)
    if not os.path.isdir(root):
        raise ValueError(f"text directory path={root!r} is not a directory: pass a directory")
    documents = _read_capped(root, _walk_files(root), max_bytes)
    if not documents:
        raise ValueError(f"text directory path={root!r} has no non-empty files: add some text")
    return documents


def _heldout_position(rel_path: str) -> float:
    """A stable uniform value in [0, 1) derived from the path alone (not ``hash()``,
    which is salted per process)."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_heldout(rel_path: str, heldout_fraction: float) -> bool:
    """Whether ``split_corpus`` puts the document at ``rel_path`` in the held-out set."""
    return _heldout_position(rel_path) < heldout_fraction


def _concat(documents: Sequence[tuple[str, bytes]]) -> np.ndarray:
    """Documents joined, each followed by the separator; read-only (views ``bytes``)."""
    return np.frombuffer(b"".join(data + DOCUMENT_SEPARATOR for _, data in documents), np.uint8)


def split_corpus(
    documents: Sequence[tuple[str, bytes]],
    num_shards: int,
    heldout_fraction: float = 0.05,
    *,
    shard_seed: int = SHARD_SEED,
    source_name: str = "documents",
) -> CorpusSplit:
    """Splits documents into a held-out set and ``num_shards`` equal training shards.

    A document is held out when a sha256 of its path falls in the first
    ``heldout_fraction`` of the hash range; the held-out set keeps the given order.
    The remaining documents are put in a seeded random order (a permutation drawn
    from ``shard_seed``), each followed by ``DOCUMENT_SEPARATOR``, concatenated and
    cut into ``num_shards`` shards of equal length (the last ``< num_shards`` bytes
    are dropped). So each shard holds whole documents drawn at random from the
    training split, except that at most ``num_shards - 1`` documents are cut at a
    shard boundary (their two parts go to neighbouring shards; no byte is in two
    shards). Shards are zero-copy views of one buffer.

    Args:
        documents: ``(relative_path, bytes)`` pairs, e.g. from ``load_stdlib_documents``.
        num_shards: number of learner shards.
        heldout_fraction: expected fraction of documents held out, in [0, 1).
        shard_seed: seed of the document permutation; every learner of a run must use
            the same one (the default), or shards overlap.
        source_name: label for ``CorpusSplit.source``, e.g. ``STDLIB_SOURCE_NAME``.

    Returns:
        The split.

    Raises:
        ValueError: on bad arguments, an empty corpus, no held-out document when
            ``heldout_fraction > 0``, or fewer training bytes than shards.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: use at least 1")
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction={heldout_fraction}: use a value in [0, 1)")
    if not any(data for _, data in documents):
        raise ValueError("the corpus is empty: pass at least one non-empty document")
    train, heldout = [], []
    for doc in documents:
        (heldout if is_heldout(doc[0], heldout_fraction) else train).append(doc)
    if heldout_fraction > 0 and not heldout:
        raise ValueError(
            f"no document of {len(documents)} fell in heldout_fraction={heldout_fraction}: "
            "add documents or raise heldout_fraction"
        )
    order = np.random.default_rng(shard_seed).permutation(len(train))
    train_tokens = _concat([train[i] for i in order])
    shard_bytes = len(train_tokens) // num_shards
    if shard_bytes == 0:
        raise ValueError(f"{len(train_tokens)} training bytes cannot fill num_shards={num_shards}: add data")
    shards = tuple(train_tokens[i * shard_bytes : (i + 1) * shard_bytes] for i in range(num_shards))
    total_mib = sum(len(data) for _, data in documents) / 2**20
    source = f"{source_name}: {len(documents)} files, {total_mib:.1f} MiB ({len(train)} train, {len(heldout)} held out)"
    return CorpusSplit(shards=shards, heldout=_concat(heldout), source=source)


def _check_window(tokens: np.ndarray, batch_size: int, seq_len: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: use at least 1")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: use at least 1")
    if tokens.ndim != 1:
        raise ValueError(f"tokens.shape={tokens.shape}: pass a 1-D token array")
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"token array has {len(tokens)} tokens but a window needs seq_len+1={seq_len + 1}: "
            f"add at least {seq_len + 1 - len(tokens)} bytes of data or lower seq_len"
        )


class BatchSampler:
    """Random (B, T+1) windows from one token array, seeded; deterministic for a given seed."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> None:
        """Prepares sampling; no data is copied.

        Args:
            tokens: 1-D token array (e.g. one ``CorpusSplit`` shard).
            batch_size: windows per batch (B).
            seq_len: predicted tokens per window (T); windows are T+1 long.
            seed: numpy PCG64 seed; equal seeds give equal batch sequences.

        Raises:
            ValueError: on a non-positive size, or fewer than ``seq_len + 1`` tokens.
        """
        _check_window(tokens, batch_size, seq_len)
        self._tokens = tokens
        self._batch_size = batch_size
        self._offsets = np.arange(seq_len + 1)
        self._rng = np.random.default_rng(seed)

    def next(self) -> np.ndarray:
        """Returns the next int32 ``(B, T+1)`` batch of windows at uniform random starts."""
        max_start = len(self._tokens) - len(self._offsets)
        starts = self._rng.integers(0, max_start, size=self._batch_size, endpoint=True)
        return self._tokens[starts[:, None] + self._offsets].astype(np.int32)

    @property
    def tokens_per_batch(self) -> int:
        """Tokens predicted per batch: B*T."""
        return self._batch_size * (len(self._offsets) - 1)


def heldout_batches(tokens: np.ndarray, batch_size: int, seq_len: int, num_batches: int) -> list[np.ndarray]:
    """Deterministic evaluation batches of evenly spaced windows across ``tokens``.

    Args:
        tokens: 1-D token array, normally ``CorpusSplit.heldout``.
        batch_size: windows per batch (B).
        seq_len: predicted tokens per window (T); windows are T+1 long.
        num_batches: number of batches; windows may overlap if ``tokens`` is short.

    Returns:
        ``num_batches`` int32 ``(B, T+1)`` arrays.

    Raises:
        ValueError: on a non-positive size, or fewer than ``seq_len + 1`` tokens.
    """
    _check_window(tokens, batch_size, seq_len)
    if num_batches < 1:
        raise ValueError(f"num_batches={num_batches}: use at least 1")
    starts = np.linspace(0, len(tokens) - (seq_len + 1), batch_size * num_batches).round()
    windows = tokens[starts.astype(np.int64)[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return list(windows.reshape(num_batches, batch_size, seq_len + 1))


TOKEN_FILE_SUFFIX = ".bin"


def load_token_file(path: str | os.PathLike, max_tokens: int | None = None) -> np.ndarray:
    """A flat little-endian uint16 token file (nanoGPT's ``.bin``), memory-mapped read-only.

    Raises:
        ValueError: if the file is missing, empty or not a whole number of uint16 values.
    """
    path = os.fspath(path)
    size_bytes = os.path.getsize(path) if os.path.isfile(path) else -1
    if size_bytes <= 0 or size_bytes % 2:
        raise ValueError(f"token file {path!r} must be a non-empty flat array of little-endian uint16 "
                         f"tokens ({'missing' if size_bytes < 0 else f'{size_bytes} bytes'})")
    tokens = np.memmap(path, dtype="<u2", mode="r")
    return tokens[:max_tokens] if max_tokens else tokens


def split_tokens(
    tokens: np.ndarray, num_shards: int, heldout_fraction: float = 0.05, *,
    heldout: np.ndarray | None = None, source_name: str = "tokens",
) -> CorpusSplit:
    """Splits a flat token array: the held-out set is ``heldout`` when given (nanoGPT's
    ``val.bin``), else the last ``heldout_fraction`` of the tokens; the rest is cut into
    ``num_shards`` contiguous equal shards (zero-copy views of the memory map). A token file
    has no document boundaries to shuffle by: its preparation is expected to have shuffled
    the documents (nanoGPT's ``prepare.py`` does)."""
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: use at least 1")
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction={heldout_fraction}: use a value in [0, 1)")
    if heldout is None:
        cut = len(tokens) - int(len(tokens) * heldout_fraction)
        train, heldout = tokens[:cut], tokens[cut:]
    else:
        train = tokens
    shard_tokens = len(train) // num_shards
    if shard_tokens == 0:
        raise ValueError(f"{len(train)} training tokens cannot fill num_shards={num_shards}: add data")
    shards = tuple(train[i * shard_tokens:(i + 1) * shard_tokens] for i in range(num_shards))
    source = f"{source_name}: {len(train):,} training tokens, {len(heldout):,} held out"
    return CorpusSplit(shards=shards, heldout=heldout, source=source)


def load_split(data_path: str, max_bytes: int, num_shards: int, heldout_fraction: float) -> CorpusSplit:
    """The deterministic split shared by learners and the evaluator, from ``data_path``:

    * empty: the Python standard library's sources (bytes);
    * a ``.bin`` file: uint16 tokens, the last ``heldout_fraction`` held out;
    * a directory holding ``train.bin`` (and optionally ``val.bin``, then the held-out set);
    * any other directory: its files as text documents (bytes), held out by path hash, dealt
      to shards in the ``SHARD_SEED`` permutation.

    ``max_bytes`` caps what is read (for token files: ``max_bytes // 2`` tokens of train.bin).
    """
    if not data_path:
        docs = load_stdlib_documents(max_bytes=max_bytes)
        return split_corpus(docs, num_shards, heldout_fraction, source_name=STDLIB_SOURCE_NAME)
    train_bin = os.path.join(data_path, "train" + TOKEN_FILE_SUFFIX)
    if data_path.endswith(TOKEN_FILE_SUFFIX) or os.path.isfile(train_bin):
        is_file = data_path.endswith(TOKEN_FILE_SUFFIX)
        tokens = load_token_file(data_path if is_file else train_bin, max_tokens=max_bytes // 2)
        val_bin = os.path.join(data_path, "val" + TOKEN_FILE_SUFFIX)
        heldout = None if is_file or not os.path.isfile(val_bin) else load_token_file(val_bin)
        return split_tokens(tokens, num_shards, heldout_fraction, heldout=heldout, source_name=data_path)
    docs = load_text_directory(data_path, max_bytes=max_bytes)
    return split_corpus(docs, num_shards, heldout_fraction, source_name=data_path)

