"""Training data: the byte-level corpus, its deterministic split and batch samplers."""

from ddiloco.data.corpus import (
    DEFAULT_MAX_BYTES,
    DOCUMENT_SEPARATOR,
    STDLIB_SOURCE_NAME,
    BatchSampler,
    CorpusSplit,
    heldout_batches,
    is_heldout,
    load_stdlib_documents,
    load_text_directory,
    split_corpus,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DOCUMENT_SEPARATOR",
    "STDLIB_SOURCE_NAME",
    "BatchSampler",
    "CorpusSplit",
    "heldout_batches",
    "is_heldout",
    "load_stdlib_documents",
    "load_text_directory",
    "split_corpus",
]
