"""Training data: text or token corpora, their deterministic split and batch samplers (``sources``: the data flags)."""

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
from ddiloco.data.sources import DataSpec, check_vocabulary

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DOCUMENT_SEPARATOR",
    "STDLIB_SOURCE_NAME",
    "BatchSampler",
    "CorpusSplit",
    "DataSpec",
    "check_vocabulary",
    "heldout_batches",
    "is_heldout",
    "load_stdlib_documents",
    "load_text_directory",
    "split_corpus",
]
