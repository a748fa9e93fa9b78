"""Which data a run trains and evaluates on: the data flags, resolved into a ``CorpusSplit``.

Owns: ``DataSpec`` (the flags every learner and the evaluator of a run must share: --data-dir,
--data-source, --heldout-dir, --token-dtype, --max-corpus-bytes, --heldout-fraction,
--num-shards), what a path holds (a text directory, a token file, a nanoGPT directory with an
optional ``meta.json``), the ``package.module:factory`` iterator hook for any other source, the
named held-out split, and the check that the model's vocabulary covers the data.
Must not: read environment variables or touch JAX.

Every process of a run (each learner, the evaluator, ``ddiloco up``) loads the same spec on its
own and gets the same split: files are read in sorted path order, documents are held out by a
hash of their name and dealt to shards in the ``corpus.SHARD_SEED`` permutation; a
``--data-source`` factory must yield the same items in the same order in every process.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
from collections.abc import Callable, Mapping

import numpy as np

from ddiloco.data import corpus

_LOG = logging.getLogger("ddiloco.data")

# Next to train.bin (or a .bin file): {"dtype": "uint16" | "uint32", "vocab_size": N}, both optional.
META_FILE = "meta.json"
DEFAULT_TOKEN_DTYPE = "uint16"  # nanoGPT's
# Token documents from --data-source are kept as uint32: 4 bytes each against the size cap.
_SOURCE_TOKEN_BYTES = 4
# ddiloco up gives a tokenized corpus's model a vocabulary rounded up to a multiple of this
# (GPT-2's 50,257 ids become 50,304, as in nanoGPT, for efficient matrix shapes).
_VOCAB_MULTIPLE = 64
_END = object()  # an exhausted iterator's next()


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The data flags of a run; equal specs give equal splits in every process."""

    data_dir: str = ""  # text directory, .bin token file or nanoGPT directory; empty: the stdlib (or data_source)
    data_source: str = ""  # "package.module:factory" returning an iterable of texts or token arrays
    heldout_dir: str = ""  # held-out data (text directory or .bin file) instead of a fraction of the data
    token_dtype: str = ""  # "uint16" or "uint32"; empty: meta.json's dtype, else uint16
    max_bytes: int = corpus.DEFAULT_MAX_BYTES  # read at most this much training data
    heldout_fraction: float = 0.05  # used when no held-out split is named
    num_shards: int = 4

    def __post_init__(self) -> None:
        if self.data_dir and self.data_source:
            raise ValueError(f"data_dir={self.data_dir!r} and data_source={self.data_source!r}: pass one of them")
        if self.token_dtype and self.token_dtype not in corpus.TOKEN_DTYPES:
            raise ValueError(f"token_dtype={self.token_dtype!r} is unknown: use one of {', '.join(corpus.TOKEN_DTYPES)} "
                             "(the numpy dtype the token file was written with), or leave it empty")
        if self.data_source:
            _parse_factory_name(self.data_source)
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes={self.max_bytes}: use a positive byte count")
        if self.num_shards < 1:
            raise ValueError(f"num_shards={self.num_shards}: use at least 1")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction={self.heldout_fraction}: use a value in [0, 1)")

    def describe(self) -> str:
        """What the training data is, for messages: the path, the factory, or the stdlib."""
        return self.data_dir or self.data_source or corpus.STDLIB_SOURCE_NAME


def load(spec: DataSpec) -> corpus.CorpusSplit:
    """Loads and splits the data ``spec`` names.

    * ``data_source``: the factory's items (texts as bytes, token arrays as uint32), held out by
      ``heldout_fraction`` unless the factory returned ``{"train": ..., "heldout": ...}``;
    * ``data_dir`` a ``.bin`` file, or a directory with ``train.bin``: tokens of ``token_dtype``,
      held out: ``val.bin`` next to ``train.bin``, else the last ``heldout_fraction``; cut into
      contiguous shards;
    * ``data_dir`` any other directory: its text files (recursively, binary files skipped);
    * neither: the Python standard library's sources.

    Text documents are held out by a hash of their path (``heldout_fraction``) and dealt to shards
    in the ``corpus.SHARD_SEED`` permutation. ``heldout_dir`` (a text directory, or a ``.bin``
    file for token data) replaces any other held-out split; inside ``data_dir`` it is left out of
    the training data. Warnings (a size cap that truncated the data, skipped binary files) are
    logged and returned in ``CorpusSplit.warnings``.

    Raises:
        ValueError: on data that cannot be used, with what to do about it.
    """
    warnings: list[str] = []
    declared_vocab = 0
    heldout = _load_heldout_dir(spec, warnings) if spec.heldout_dir else None
    if spec.data_source:
        documents, source_heldout = _from_source(spec, warnings)
        label = spec.data_source + (f" (held out: {spec.heldout_dir})" if heldout is not None else "")
        split = corpus.split_corpus(documents, spec.num_shards, spec.heldout_fraction, source_name=label,
                                    heldout=heldout if heldout is not None else source_heldout)
    elif spec.data_dir and _token_files(spec.data_dir) is not None:
        split, declared_vocab = _from_token_files(spec, heldout, warnings)
    elif spec.data_dir:
        loaded = corpus.read_text_directory(spec.data_dir, spec.max_bytes, exclude=_nested_heldout(spec))
        warnings += loaded.warnings
        label = spec.data_dir + (f" (held out: {spec.heldout_dir})" if heldout is not None else "")
        split = corpus.split_corpus(loaded.documents, spec.num_shards, spec.heldout_fraction, source_name=label,
                                    heldout=heldout)
    else:
        loaded = corpus.read_stdlib_documents(spec.max_bytes)
        warnings += loaded.warnings
        split = corpus.split_corpus(loaded.documents, spec.num_shards, spec.heldout_fraction,
                                    source_name=corpus.STDLIB_SOURCE_NAME, heldout=heldout)
    for warning in warnings:
        _LOG.warning(warning)
    return dataclasses.replace(split, warnings=tuple(warnings), declared_vocab_size=declared_vocab)


# --------------------------------------------------------------------------------- vocabulary


def required_vocab_size(split: corpus.CorpusSplit) -> int:
    """The smallest vocabulary that covers the data: its largest id + 1, or what its meta.json declares."""
    return max(split.max_token + 1, split.declared_vocab_size)


def suggested_vocab_size(split: corpus.CorpusSplit) -> int:
    """The vocabulary ``ddiloco up`` gives the model: 256 for text (bytes), else the required
    size rounded up to a multiple of 64."""
    if split.byte_level:
        return 256
    return -(-required_vocab_size(split) // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE


def check_vocabulary(split: corpus.CorpusSplit, vocab_size: int) -> None:
    """Raises ValueError, saying what to set, unless a model with ``vocab_size`` entries covers the data."""
    needed = required_vocab_size(split)
    if needed <= vocab_size:
        return
    why = (f"its meta.json declares vocab_size={split.declared_vocab_size}" if needed > split.max_token + 1
           else f"it holds token id {split.max_token}")
    hint = ""
    if split.shards[0].dtype == np.uint32 and split.max_token >= 2**16:
        hint = " If the token file holds uint16 tokens, pass --token-dtype uint16 instead."
    suggestion = -(-needed // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE
    raise ValueError(
        f"the data needs a vocabulary of {needed:,} ids ({why}) but the model's vocab_size is {vocab_size:,}: "
        f"give the model a larger one (syncer --model-config '{{\"vocab_size\": {suggestion}}}'; "
        f"ddiloco up --vocab-size {suggestion}).{hint}"
    )


# -------------------------------------------------------------------------------- token files


def _token_files(data_dir: str) -> tuple[str, str | None, str] | None:
    """(train file, val file or None, directory of meta.json) if ``data_dir`` names token data."""
    if data_dir.endswith(corpus.TOKEN_FILE_SUFFIX) and not os.path.isdir(data_dir):
        return data_dir, None, os.path.dirname(os.path.abspath(data_dir))
    train_bin = os.path.join(data_dir, "train" + corpus.TOKEN_FILE_SUFFIX)
    if os.path.isfile(train_bin):
        val_bin = os.path.join(data_dir, "val" + corpus.TOKEN_FILE_SUFFIX)
        return train_bin, val_bin if os.path.isfile(val_bin) else None, data_dir
    return None


def _read_meta(directory: str) -> dict:
    """The ``meta.json`` of a token directory, validated; {} if there is none."""
    path = os.path.join(directory, META_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc}): write {{\"dtype\": \"uint32\", \"vocab_size\": N}}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object such as {{\"dtype\": \"uint32\", \"vocab_size\": N}}")
    if "dtype" in meta and meta["dtype"] not in corpus.TOKEN_DTYPES:
        raise ValueError(f"{path}: dtype={meta['dtype']!r} is unknown: use one of {', '.join(corpus.TOKEN_DTYPES)}")
    vocab = meta.get("vocab_size", 0)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 0:
        raise ValueError(f"{path}: vocab_size={vocab!r}: use a positive integer")
    return meta


def _token_dtype(spec: DataSpec, meta: dict, meta_dir: str) -> str:
    """--token-dtype, else meta.json's dtype, else uint16; a flag that contradicts meta.json is an error."""
    declared = meta.get("dtype", "")
    if spec.token_dtype and declared and spec.token_dtype != declared:
        raise ValueError(f"token_dtype={spec.token_dtype!r} but {os.path.join(meta_dir, META_FILE)} says "
                         f"dtype={declared!r}: drop the flag or fix meta.json")
    return spec.token_dtype or declared or DEFAULT_TOKEN_DTYPE


def _from_token_files(spec: DataSpec, heldout: list | None, warnings: list[str]) -> tuple[corpus.CorpusSplit, int]:
    train_path, val_path, meta_dir = _token_files(spec.data_dir)
    meta = _read_meta(meta_dir)
    dtype = _token_dtype(spec, meta, meta_dir)
    tokens = corpus.load_token_file(train_path, dtype=dtype)
    max_tokens = spec.max_bytes // corpus.TOKEN_DTYPES[dtype].itemsize
    if len(tokens) > max_tokens:
        warnings.append(
            f"{train_path}: the size cap max_corpus_bytes={spec.max_bytes:,} truncated the data: it holds "
            f"{len(tokens):,} {dtype} tokens and only the first {max_tokens:,} ({max_tokens / len(tokens):.1%}) are "
            "read. Raise --max-corpus-bytes to train on all of it"
        )
        tokens = tokens[:max_tokens]
    label = spec.data_dir
    if heldout is not None:
        if any(isinstance(data, bytes) for _, data in heldout):
            raise ValueError(f"heldout_dir={spec.heldout_dir!r} holds text but data_dir={spec.data_dir!r} holds "
                             "tokens: name a .bin token file as the held-out data")
        heldout_tokens = np.concatenate([data for _, data in heldout])
        label += f" (held out: {spec.heldout_dir})"
    elif val_path is not None:
        heldout_tokens = corpus.load_token_file(val_path, dtype=dtype)
        label += " (held out: val.bin)"
    else:
        heldout_tokens = None
    split = corpus.split_tokens(tokens, spec.num_shards, spec.heldout_fraction, heldout=heldout_tokens,
                                source_name=f"{label}, {dtype}")
    return split, int(meta.get("vocab_size", 0))


# ---------------------------------------------------------------------------- held-out split


def _nested_heldout(spec: DataSpec) -> tuple[str, ...]:
    """The held-out path relative to ``data_dir`` if it lies inside (left out of training);
    ValueError if it contains ``data_dir`` (everything would be held out and trained on)."""
    if not spec.heldout_dir:
        return ()
    data, held = os.path.realpath(spec.data_dir), os.path.realpath(spec.heldout_dir)
    if data == held or data.startswith(held + os.sep):
        raise ValueError(f"heldout_dir={spec.heldout_dir!r} contains data_dir={spec.data_dir!r}: the model would "
                         "train on its held-out data; use separate directories")
    if held.startswith(data + os.sep):
        return (os.path.relpath(held, data).replace(os.sep, "/"),)
    return ()


def _load_heldout_dir(spec: DataSpec, warnings: list[str]) -> list[tuple[str, bytes | np.ndarray]]:
    """The named held-out data as documents: a text directory's files, or one token file."""
    path = spec.heldout_dir
    if path.endswith(corpus.TOKEN_FILE_SUFFIX) and not os.path.isdir(path):
        meta_dir = os.path.dirname(os.path.abspath(path))
        tokens = corpus.load_token_file(path, dtype=_token_dtype(spec, _read_meta(meta_dir), meta_dir))
        return [(os.path.basename(path), tokens)]
    loaded = corpus.read_text_directory(path, spec.max_bytes)
    warnings += [f"held-out data: {w}" for w in loaded.warnings]
    return list(loaded.documents)


# ------------------------------------------------------------------------ the iterator hook


def _parse_factory_name(name: str) -> tuple[str, str]:
    module, sep, attr = name.partition(":")
    if not (sep and module.strip() and attr.strip()):
        raise ValueError(f"data_source={name!r}: use package.module:factory (a callable returning an iterable of "
                         "texts or token arrays)")
    return module.strip(), attr.strip()


def resolve_factory(name: str) -> Callable[[], object]:
    """Imports ``package.module:factory`` (the attribute may be dotted: ``module:Class.method``).

    Raises:
        ValueError: if the module cannot be imported or has no such callable.
    """
    module_name, attr = _parse_factory_name(name)
    try:
        target = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"data_source={name!r}: cannot import {module_name!r} ({exc}); it must be importable "
                         "(on PYTHONPATH, or in the directory ddiloco up runs in)") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"data_source={name!r}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"data_source={name!r}: {attr!r} is a {type(target).__name__}, not a callable factory")
    return target


def _as_document(item: object, where: str) -> bytes | np.ndarray:
    """A text (str as UTF-8, or bytes) or a 1-D array of token ids in [0, 2**32)."""
    if isinstance(item, str):
        return item.encode("utf-8")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    array = np.asarray(item)
    if array.ndim != 1 or (array.dtype.kind not in "iu" and not (array.dtype.kind == "f" and len(array) == 0)):
        raise ValueError(f"{where} is a {type(item).__name__} ({array.dtype}, shape {array.shape}): yield str, bytes "
                         "or 1-D integer token arrays (for rows of a dataset, yield row['text'])")
    if len(array) and (int(array.min()) < 0 or int(array.max()) >= 2**32):
        raise ValueError(f"{where} has token ids outside [0, 2**32): {int(array.min())}..{int(array.max())}")
    return array.astype("<u4")


def _read_items(items: object, max_bytes: int, what: str, warnings: list[str]) -> list[tuple[str, bytes | np.ndarray]]:
    """Documents from an iterable until ``max_bytes`` (the last one truncated to fit), named
    ``<what>[<index>]`` (the held-out hash uses the name: the order must be deterministic)."""
    try:
        iterator = iter(items)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"{what} is a {type(items).__name__}, not an iterable of texts or token arrays") from None
    documents, remaining_bytes = [], max_bytes
    for index, item in enumerate(iterator):
        where = f"{what}[{index}]"
        data = _as_document(item, where)
        item_bytes = _SOURCE_TOKEN_BYTES if isinstance(data, np.ndarray) else 1
        keep = remaining_bytes // item_bytes
        if len(data):
            documents.append((where, data[:keep]))
            remaining_bytes -= min(len(data), keep) * item_bytes
        if remaining_bytes < item_bytes:
            if len(data) > keep or next(iterator, _END) is not _END:
                warnings.append(f"{what}: the size cap max_corpus_bytes={max_bytes:,} truncated the data after "
                                f"{len(documents):,} documents (token ids count 4 bytes each). Raise "
                                "--max-corpus-bytes to train on more of it")
            break
    if not documents:
        raise ValueError(f"{what} yielded no non-empty document")
    return documents


def _from_source(spec: DataSpec, warnings: list[str]) -> tuple[list, list | None]:
    """The training documents and, if the factory named them, the held-out ones."""
    factory = resolve_factory(spec.data_source)
    try:
        produced = factory()
    except Exception as exc:  # noqa: BLE001 - the user's code: report it as bad data, with its message
        raise ValueError(f"data_source={spec.data_source!r}: the factory raised {type(exc).__name__}: {exc}") from exc
    heldout_items = None
    if isinstance(produced, Mapping):
        unknown = set(produced) - {"train", "heldout"}
        if unknown or "train" not in produced:
            raise ValueError(f"data_source={spec.data_source!r} returned a mapping with keys {sorted(map(str, produced))}: "
                             "use {'train': iterable, 'heldout': iterable} (heldout optional), or return one iterable")
        produced, heldout_items = produced["train"], produced.get("heldout")
    name = f"data_source {spec.data_source}"
    try:
        train = _read_items(produced, spec.max_bytes, name, warnings)
        heldout = None if heldout_items is None else _read_items(heldout_items, spec.max_bytes, name + " heldout", warnings)
    except ValueError:
        raise  # ours (a bad item), or the user's own: already a data error
    except Exception as exc:  # noqa: BLE001 - an error while iterating the user's iterable
        raise ValueError(f"data_source={spec.data_source!r}: iterating it raised {type(exc).__name__}: {exc}") from exc
    return train, heldout

