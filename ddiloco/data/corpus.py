"""The training corpus: which tokens exist, how they split, how batches are drawn.

Owns: loading documents (the Python stdlib's own sources by default, or any user directory of
text files, binary files skipped), pre-tokenized uint16/uint32 token files (the nanoGPT
``train.bin`` / ``val.bin`` convention), the deterministic held-out/shard split with its per-shard
counts and warnings, and batch sampling. Which of these a run uses is decided by
``ddiloco.data.sources`` (the data flags).
Must not: tokenize (text is bytes: token id == byte value; token files come tokenized), or
touch JAX.

Documents are ``(name, data)`` pairs, ``data`` being ``bytes`` (text) or a 1-D integer array
(tokens). A document's split is decided by a hash of its name alone, so adding or removing other
files never moves it between the training and held-out sets. The training documents are dealt to
the learners' shards in a permutation drawn from ``SHARD_SEED`` (the same for every learner of a
run, so shards are disjoint and together cover the training split): each shard is a random sample
of the corpus, not a run of neighbouring paths (in the stdlib, sorted paths put e.g. every
``encodings/`` codec table in one shard).
"""

from __future__ import annotations

import codecs
import functools
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
# Appended after every text document. 0x00 never occurs in Python source or plain
# text, so the model can learn it as an unambiguous "end of document" token.
DOCUMENT_SEPARATOR = b"\x00"
# A file of a text directory is read only if its first BINARY_SNIFF_BYTES hold no NUL byte and
# decode as UTF-8 (git looks for a NUL in the first 8000 bytes; the UTF-8 test also catches
# compressed data and images, which rarely contain a NUL that early). A NUL would also collide
# with DOCUMENT_SEPARATOR.
BINARY_SNIFF_BYTES = 8192
# The element types of token files (nanoGPT writes uint16; vocabularies beyond 65,536 ids need uint32).
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
TOKEN_FILE_SUFFIX = ".bin"
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

    shards: tuple[np.ndarray, ...]  # uint8 (text: bytes) or uint16/uint32 (tokens), read-only, equal length
    heldout: np.ndarray  # same kind, read-only; from documents (or tokens) no shard contains
    source: str  # e.g. "python3.11 stdlib: 601 files, 10.6 MiB (571 train, 30 held out)"
    # Documents starting in each shard (one cut at a shard boundary counts where it starts) and
    # in the held-out set; None for token files, which have no document boundaries.
    shard_documents: tuple[int, ...] | None = None
    heldout_documents: int | None = None
    # What the user should know about the data: a size cap that truncated it, skipped binary files.
    warnings: tuple[str, ...] = ()
    # The vocabulary the data declares (a token file's meta.json vocab_size); 0: none declared.
    declared_vocab_size: int = 0

    @property
    def byte_level(self) -> bool:
        """Whether tokens are bytes (text), as opposed to ids from a tokenizer."""
        return self.shards[0].dtype == np.uint8

    @functools.cached_property  # a scan of every token: done once (cached_property works on frozen dataclasses)
    def max_token(self) -> int:
        """The largest token id in the data (the model's vocabulary must exceed it)."""
        if self.byte_level:
            return 255
        return int(max(max(int(s.max()) for s in self.shards), int(self.heldout.max()) if len(self.heldout) else 0))

    def shard_summary(self, index: int) -> str:
        """E.g. ``"shard 2 of 4: 143 documents, 2,601,237 bytes"``."""
        docs = "" if self.shard_documents is None else f"{self.shard_documents[index]:,} documents, "
        return f"shard {index} of {len(self.shards)}: {docs}{len(self.shards[index]):,} {self._unit}"

    def heldout_summary(self) -> str:
        """E.g. ``"held out: 30 documents, 514,093 bytes"``."""
        docs = "" if self.heldout_documents is None else f"{self.heldout_documents:,} documents, "
        return f"held out: {docs}{len(self.heldout):,} {self._unit}"

    def summary_lines(self) -> list[str]:
        """One line per shard, then the held-out set: what `ddiloco up` prints at start."""
        return [self.shard_summary(i) for i in range(len(self.shards))] + [self.heldout_summary()]

    @property
    def _unit(self) -> str:
        return "bytes" if self.byte_level else "tokens"


@dataclass(frozen=True)
class LoadedDocuments:
    """Documents read from a directory, with what was left out and why."""

    documents: list[tuple[str, bytes]]  # (relative POSIX path, bytes) in sorted path order
    skipped_binary: tuple[str, ...] = ()  # relative paths of files skipped as binary
    warnings: tuple[str, ...] = ()  # the size cap truncated the data; binary files were skipped


def _is_text(head: bytes, whole_file: bool) -> bool:
    """Whether a file's first bytes look like text: no NUL, and UTF-8 (unless ``head`` is the
    whole file, a multi-byte character cut at its end is fine: the decoder waits for the rest)."""
    if DOCUMENT_SEPARATOR in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=whole_file)
    except UnicodeDecodeError:
        return False
    return True


def _read_documents(root: str, rel_paths: Sequence[str], max_bytes: int, *, skip_binary: bool,
                    name: str) -> LoadedDocuments:
    """Reads files in the given order until ``max_bytes`` (the last one truncated to fit),
    skipping binary files if asked, and says in a warning what the cap left out."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes}: use a positive byte count")
    documents, skipped, remaining_bytes = [], [], max_bytes
    stopped_at, cut = len(rel_paths), False
    for index, rel_path in enumerate(rel_paths):
        if remaining_bytes == 0:
            stopped_at = index
            break
        path = os.path.join(root, rel_path)
        with open(path, "rb") as f:
            head = f.read(BINARY_SNIFF_BYTES if skip_binary else remaining_bytes)
            if skip_binary and not _is_text(head, whole_file=len(head) < BINARY_SNIFF_BYTES):
                skipped.append(rel_path)
                continue
            data = head + f.read(max(0, remaining_bytes - len(head)))
            cut = len(data) > remaining_bytes or (len(data) == remaining_bytes and f.read(1) != b"")
            data = data[:remaining_bytes]
        if data:
            documents.append((rel_path, data))
            remaining_bytes -= len(data)
    warnings = []
    unread = rel_paths[stopped_at:]
    if unread or cut:
        unread_mib = sum(os.path.getsize(os.path.join(root, p)) for p in unread) / 2**20
        left_out = [f"{len(unread):,} more files (~{unread_mib:.1f} MiB)"] if unread else []
        if cut:
            left_out.insert(0, f"the rest of {documents[-1][0]}")
        warnings.append(
            f"{name}: the size cap max_corpus_bytes={max_bytes:,} truncated the data after {len(documents):,} files "
            f"in path order; not read: {' and '.join(left_out)}. Raise --max-corpus-bytes to train on all of it"
        )
    if skipped:
        examples = ", ".join(skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        files = "1 binary file" if len(skipped) == 1 else f"{len(skipped):,} binary files"
        warnings.append(f"{name}: skipped {files} (a NUL byte or not UTF-8 in the first "
                        f"{BINARY_SNIFF_BYTES // 1024} KiB): {examples}")
    return LoadedDocuments(documents=documents, skipped_binary=tuple(skipped), warnings=tuple(warnings))


def _walk_files(root: str, skip_dirs: frozenset[str] = frozenset(), *, skip_hidden: bool = False,
                exclude: frozenset[str] = frozenset()) -> list[str]:
    """Sorted POSIX-style relative paths of the regular files under ``root``, without the
    ``exclude``d relative paths (files, or directories with everything below them)."""
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not (skip_hidden and d.startswith("."))
                       and prefix + d not in exclude]
        for filename in filenames:
            path = os.path.join(dirpath, filename)
            if (skip_hidden and filename.startswith(".")) or prefix + filename in exclude:
                continue
            # Symlinks are skipped: they can escape the tree or duplicate a file.
            if os.path.isfile(path) and not os.path.islink(path):
                rel_paths.append(prefix + filename)
    return sorted(rel_paths)


def read_stdlib_documents(max_bytes: int = DEFAULT_MAX_BYTES) -> LoadedDocuments:
    """``load_stdlib_documents``, with a warning if the cap truncated the sources."""
    root = sysconfig.get_paths()["stdlib"]
    rel_paths = [p for p in _walk_files(root, _EXCLUDED_STDLIB_DIRS) if p.endswith(".py")]
    if not rel_paths:
        raise ValueError(f"no .py files under stdlib path {root!r}: pass a text directory instead")
    return _read_documents(root, rel_paths, max_bytes, skip_binary=False, name=STDLIB_SOURCE_NAME)


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
    return read_stdlib_documents(max_bytes).documents


def read_text_directory(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES, *,
                        exclude: Iterable[str] = ()) -> LoadedDocuments:
    """Reads every text file under ``path`` (recursively, any extension) as a document.

    Skipped: binary files (see ``BINARY_SNIFF_BYTES``; counted in a warning), hidden files and
    directories (``.git``, ``.DS_Store``), symlinks, empty files and the ``exclude``d relative
    paths (e.g. a held-out directory inside ``path``).

    Args:
        path: directory to walk.
        max_bytes: total byte cap; files are read in sorted path order and the last one is
            truncated to fit; a warning says what was left out.
        exclude: POSIX-style paths relative to ``path`` (files or directories) not to read.

    Returns:
        The documents, in sorted path order, with the skipped files and warnings.

    Raises:
        ValueError: if ``path`` is not a directory, holds no non-empty text file, or
            ``max_bytes`` is not positive.
    """
    root = os.fspath(path)
    if not os.path.isdir(root):
        raise ValueError(f"text directory path={root!r} is not a directory: pass a directory")
    loaded = _read_documents(root, _walk_files(root, skip_hidden=True, exclude=frozenset(exclude)), max_bytes,
                             skip_binary=True, name=root)
    if not loaded.documents:
        binary = f" ({len(loaded.skipped_binary):,} binary files skipped)" if loaded.skipped_binary else ""
        raise ValueError(f"text directory path={root!r} has no non-empty text files{binary}: add some text")
    return loaded


def load_text_directory(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[str, bytes]]:
    """The documents of ``read_text_directory`` (without its warnings)."""
    return read_text_directory(path, max_bytes).documents


def _heldout_position(rel_path: str) -> float:
    """A stable uniform value in [0, 1) derived from the path alone (not ``hash()``,
    which is salted per process)."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_heldout(rel_path: str, heldout_fraction: float) -> bool:
    """Whether ``split_corpus`` puts the document at ``rel_path`` in the held-out set."""
    return _heldout_position(rel_path) < heldout_fraction


def _document_kind(documents: Sequence[tuple[str, bytes | np.ndarray]], what: str) -> type:
    """``bytes`` if every document is text, ``np.ndarray`` if every one is tokens; else ValueError."""
    kinds = {bytes if isinstance(data, bytes) else np.ndarray for _, data in documents}
    if len(kinds) > 1:
        raise ValueError(f"{what} mix text (str/bytes) and token arrays: use one kind")
    return kinds.pop() if kinds else bytes


def _concat(documents: Sequence[tuple[str, bytes | np.ndarray]], kind: type) -> np.ndarray:
    """Documents joined, read-only: text followed by the separator each (a view of ``bytes``);
    token arrays as they are (as uint32: a tokenizer's documents carry their own end-of-text id)."""
    if kind is bytes:
        return np.frombuffer(b"".join(data + DOCUMENT_SEPARATOR for _, data in documents), np.uint8)
    joined = np.concatenate([np.asarray(data, dtype="<u4") for _, data in documents] or [np.zeros(0, "<u4")])
    joined.flags.writeable = False
    return joined


def _length(data: bytes | np.ndarray) -> int:
    return len(data) + (len(DOCUMENT_SEPARATOR) if isinstance(data, bytes) else 0)


def split_corpus(
    documents: Sequence[tuple[str, bytes | np.ndarray]],
    num_shards: int,
    heldout_fraction: float = 0.05,
    *,
    shard_seed: int = SHARD_SEED,
    source_name: str = "documents",
    heldout: Sequence[tuple[str, bytes | np.ndarray]] | None = None,
) -> CorpusSplit:
    """Splits documents into a held-out set and ``num_shards`` equal training shards.

    A document is held out when a sha256 of its name falls in the first
    ``heldout_fraction`` of the hash range (unless ``heldout`` names the held-out documents);
    the held-out set keeps the given order.
    The remaining documents are put in a seeded random order (a permutation drawn
    from ``shard_seed``), each text document followed by ``DOCUMENT_SEPARATOR``, concatenated and
    cut into ``num_shards`` shards of equal length (the last ``< num_shards`` tokens
    are dropped). So each shard holds whole documents drawn at random from the
    training split, except that at most ``num_shards - 1`` documents are cut at a
    shard boundary (their two parts go to neighbouring shards; no token is in two
    shards). Shards are zero-copy views of one buffer.

    Args:
        documents: ``(name, data)`` pairs, ``data`` all ``bytes`` (text, e.g. from
            ``load_stdlib_documents``) or all 1-D integer token arrays (kept as uint32).
        num_shards: number of learner shards.
        heldout_fraction: expected fraction of documents held out, in [0, 1); ignored when
            ``heldout`` is given.
        shard_seed: seed of the document permutation; every learner of a run must use
            the same one (the default), or shards overlap.
        source_name: label for ``CorpusSplit.source``, e.g. ``STDLIB_SOURCE_NAME``.
        heldout: the held-out documents (same kind as ``documents``); then every one of
            ``documents`` is trained on.

    Returns:
        The split.

    Raises:
        ValueError: on bad arguments, an empty corpus, mixed text and tokens, no held-out document
            when ``heldout_fraction > 0`` (or an empty ``heldout``), or fewer training tokens than shards.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: use at least 1")
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction={heldout_fraction}: use a value in [0, 1)")
    if not any(len(data) for _, data in documents):
        raise ValueError("the corpus is empty: pass at least one non-empty document")
    kind = _document_kind(list(documents) + list(heldout or []), "the training and held-out documents")
    if heldout is not None:
        if not any(len(data) for _, data in heldout):
            raise ValueError("the held-out documents are empty: pass at least one non-empty document")
        train, held = list(documents), list(heldout)
    else:
        train, held = [], []
        for doc in documents:
            (held if is_heldout(doc[0], heldout_fraction) else train).append(doc)
        if heldout_fraction > 0 and not held:
            raise ValueError(
                f"no document of {len(documents)} fell in heldout_fraction={heldout_fraction}: "
                "add documents or raise heldout_fraction"
            )
    order = np.random.default_rng(shard_seed).permutation(len(train))
    train = [train[i] for i in order]
    train_tokens = _concat(train, kind)
    shard_len = len(train_tokens) // num_shards
    if shard_len == 0:
        raise ValueError(f"{len(train_tokens)} training tokens cannot fill num_shards={num_shards}: add data")
    shards = tuple(train_tokens[i * shard_len : (i + 1) * shard_len] for i in range(num_shards))
    # A document belongs to the shard its first token falls in (the dropped tail belongs to none).
    lengths = np.array([_length(data) for _, data in train], dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    starts = starts[(lengths > 0) & (starts < shard_len * num_shards)]
    shard_documents = tuple(int(n) for n in np.bincount(starts // shard_len, minlength=num_shards))
    if kind is bytes:
        total = f"{sum(len(data) for _, data in documents) / 2**20:.1f} MiB"
    else:
        total = f"{sum(len(data) for _, data in documents):,} tokens"
    source = f"{source_name}: {len(documents)} files, {total} ({len(train)} train, {len(held)} held out)"
    return CorpusSplit(shards=shards, heldout=_concat(held, kind), source=source, shard_documents=shard_documents,
                       heldout_documents=len(held))


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

    def position(self) -> dict:
        """Where the batch sequence is: the generator's state (JSON-serializable), for a learner's
        snapshot; ``seek`` to it continues with the batches that would have come next."""
        return {"bit_generator": self._rng.bit_generator.state, "batch_size": self._batch_size,
                "window": len(self._offsets), "tokens": len(self._tokens)}

    def seek(self, position: dict) -> None:
        """Continues from ``position()``. ValueError when it was taken on other data or batch shape."""
        mine = {"batch_size": self._batch_size, "window": len(self._offsets), "tokens": len(self._tokens)}
        theirs = {k: position.get(k) for k in mine}
        if theirs != mine:
            raise ValueError(f"the data position is of other data or batches ({theirs}, here {mine})")
        self._rng.bit_generator.state = position["bit_generator"]


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


def _looks_like_uint32(tokens: np.ndarray) -> bool:
    """Whether uint16 values look like little-endian uint32 ids read as uint16: every second value
    (the high halves) zero, the others not. Checked on the first 2**20 values (a memory map reads
    only those); 1,024 values at least, so short legitimate data is not flagged."""
    head = np.asarray(tokens[: 2**20])
    return len(head) >= 1024 and not head[1::2].any() and bool(head[0::2].any())


def load_token_file(path: str | os.PathLike, max_tokens: int | None = None, *, dtype: str = "uint16") -> np.ndarray:
    """A flat little-endian token file (nanoGPT's ``.bin``), memory-mapped read-only.

    Args:
        path: the file.
        max_tokens: read at most this many tokens (a view of the first ones); None: all.
        dtype: ``"uint16"`` (nanoGPT's) or ``"uint32"`` (vocabularies beyond 65,536 ids).

    Raises:
        ValueError: on an unknown dtype; if the file is missing, empty or not a whole number of
            ``dtype`` values; or if it looks like uint32 tokens read as uint16.
    """
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token dtype={dtype!r} is unknown: use one of {', '.join(TOKEN_DTYPES)} "
                         "(the numpy dtype the file was written with)")
    np_dtype = TOKEN_DTYPES[dtype]
    path = os.fspath(path)
    size_bytes = os.path.getsize(path) if os.path.isfile(path) else -1
    if size_bytes <= 0 or size_bytes % np_dtype.itemsize:
        hint = " (a whole number of uint16 values: is it uint16? pass --token-dtype uint16)" if (
            dtype == "uint32" and size_bytes > 0 and size_bytes % 2 == 0) else ""
        raise ValueError(f"token file {path!r} must be a non-empty flat array of little-endian {dtype} "
                         f"tokens ({'missing' if size_bytes < 0 else f'{size_bytes} bytes'}){hint}")
    tokens = np.memmap(path, dtype=np_dtype, mode="r")
    if dtype == "uint16" and _looks_like_uint32(tokens):
        raise ValueError(f"token file {path!r}: every second uint16 value is 0, as when uint32 tokens are read as "
                         "uint16: pass --token-dtype uint32 (or \"dtype\": \"uint32\" in its meta.json)")
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


def load_split(data_path: str, max_bytes: int, num_shards: int, heldout_fraction: float, **spec) -> CorpusSplit:
    """``ddiloco.data.sources.load`` of a ``DataSpec`` with ``data_dir=data_path`` (and any other
    ``DataSpec`` field as a keyword): kept here for existing callers."""
    from ddiloco.data import sources  # sources imports this module: imported at call time

    return sources.load(sources.DataSpec(data_dir=data_path, max_bytes=max_bytes, num_shards=num_shards,
                                         heldout_fraction=heldout_fraction, **spec))
