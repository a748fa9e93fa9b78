"""The self-describing record of a run that every syncer checkpoint carries (its `run` blob).

Owns: the record's JSON format (``FORMAT``): the run configuration learners adopt, the model's
name, complete configuration and fingerprint, the syncer's training hyperparameters, and the
fragment plan with every tensor's name, shape, dtype and offset in its fragment's flat vector;
building it (``describe``), reading it back (``RunDescription.from_json``) and turning a
checkpoint's fragment vectors into the model's own named tensors (``RunDescription.tensors``); and
parsing a model configuration given as JSON (``model_config_from_json``, also for `ddiloco up`).
Must not: do I/O, or need the model's code: with this record alone a reader can name and shape
every tensor (that is what `ddiloco export` relies on).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from google.protobuf import json_format

from ddiloco.algo import fragments as fragments_lib
from ddiloco.v1 import syncer_pb2

FORMAT = "ddiloco.run/1"
# The checkpoint blob holding the record. Identical for every checkpoint of one run, so the
# content-addressed store keeps it once.
BLOB_NAME = "run"
# Fragment vectors are float32 (ddiloco.algo.fragments); the only dtype this format knows.
FRAGMENT_DTYPE = "float32"
# RunConfig fields the record holds elsewhere (model, plan) or that name the run.
_HOISTED = ("run_id", "model_name", "model_config_json", "model_fingerprint", "fragments")


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """Where one tensor lives in its fragment's flat vector (elements, C order)."""

    name: str
    shape: tuple[int, ...]
    offset_elements: int
    dtype: str = FRAGMENT_DTYPE
    is_embedding: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class FragmentLayout:
    """One fragment: the tensors of its flat vector, in order."""

    fragment_id: int
    numel: int
    tensors: tuple[TensorLayout, ...]


@dataclasses.dataclass(frozen=True)
class RunDescription:
    """What a checkpoint's bytes mean. See the module docstring."""

    run_id: str
    model_name: str
    model_config: Mapping[str, Any]
    model_fingerprint: str
    run_config: Mapping[str, Any]  # the RunConfig's other fields, as protobuf JSON
    training: Mapping[str, Any]  # the syncer's own hyperparameters (outer optimizer, ...)
    fragments: tuple[FragmentLayout, ...]

    def to_json(self) -> bytes:
        """Canonical JSON (sorted keys): the same run always gives the same bytes."""
        record = {
            "format": FORMAT,
            "run_id": self.run_id,
            "model": {"name": self.model_name, "config": dict(self.model_config),
                      "fingerprint": self.model_fingerprint},
            "run_config": dict(self.run_config),
            "training": dict(self.training),
            "fragments": [
                {"fragment_id": f.fragment_id, "numel": f.numel,
                 "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype,
                              "offset_elements": t.offset_elements, "is_embedding": t.is_embedding}
                             for t in f.tensors]}
                for f in self.fragments
            ],
        }
        return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> RunDescription:
        """Parses and checks a record; ValueError says what is wrong."""
        try:
            record = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"run description is not JSON: {exc}") from None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            got = record.get("format") if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"run description format {got!r} is not {FORMAT!r}")
        try:
            model = record["model"]
            fragments = tuple(_fragment_from_json(f) for f in record["fragments"])
            description = cls(
                run_id=str(record["run_id"]), model_name=str(model["name"]), model_config=dict(model["config"]),
                model_fingerprint=str(model.get("fingerprint", "")), run_config=dict(record.get("run_config", {})),
                training=dict(record.get("training", {})), fragments=fragments,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"run description is malformed: {exc!r}") from None
        description._check()
        return description

    def _check(self) -> None:
        if [f.fragment_id for f in self.fragments] != list(range(len(self.fragments))):
            raise ValueError("run description: fragment ids must be 0..P-1 in order")
        names: set[str] = set()
        for f in self.fragments:
            end = 0
            for t in f.tensors:
                if t.dtype != FRAGMENT_DTYPE:
                    raise ValueError(f"run description: tensor {t.name!r} has dtype {t.dtype!r}, "
                                     f"only {FRAGMENT_DTYPE} is supported")
                if not t.name or t.name in names:
                    raise ValueError(f"run description: tensor name {t.name!r} is empty or repeated")
                if t.offset_elements != end or any(d < 1 for d in t.shape):
                    raise ValueError(f"run description: tensor {t.name!r} at offset {t.offset_elements} "
                                     f"with shape {t.shape} does not follow the previous tensor (ends at {end})")
                names.add(t.name)
                end += t.numel
            if end != f.numel:
                raise ValueError(f"run description: fragment {f.fragment_id} holds {end} elements, says {f.numel}")

    def tensor_layouts(self) -> list[TensorLayout]:
        """Every tensor, fragment by fragment."""
        return [t for f in self.fragments for t in f.tensors]

    def tensors(self, fragment_vectors: Mapping[int, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's named tensors (fresh C-contiguous arrays) from ``{fragment_id: flat vector}``.

        Raises:
            ValueError: if a fragment is missing or its vector has the wrong size or dtype.
        """
        out: dict[str, np.ndarray] = {}
        for f in self.fragments:
            if f.fragment_id not in fragment_vectors:
                raise ValueError(f"fragment {f.fragment_id} is missing")
            flat = np.asarray(fragment_vectors[f.fragment_id])
            if flat.dtype != np.dtype(FRAGMENT_DTYPE) or flat.shape != (f.numel,):
                raise ValueError(f"fragment {f.fragment_id}: expected {f.numel} {FRAGMENT_DTYPE} values, "
                                 f"got shape {flat.shape} {flat.dtype}")
            for t in f.tensors:
                # A copy: the caller may free or reuse the fragment vector.
                out[t.name] = flat[t.offset_elements:t.offset_elements + t.numel].reshape(t.shape).copy()
        return out


def _fragment_from_json(f: Mapping[str, Any]) -> FragmentLayout:
    tensors = tuple(
        TensorLayout(name=str(t["name"]), shape=tuple(int(d) for d in t["shape"]),
                     offset_elements=int(t["offset_elements"]), dtype=str(t.get("dtype", FRAGMENT_DTYPE)),
                     is_embedding=bool(t.get("is_embedding", False)))
        for t in f["tensors"]
    )
    return FragmentLayout(fragment_id=int(f["fragment_id"]), numel=int(f["numel"]), tensors=tensors)


def model_config_from_json(text: str, source: str) -> dict[str, Any]:
    """A model configuration given as JSON text (empty: ``{}``); ValueError, naming ``source``
    (the flag or field it came from), unless it is a JSON object."""
    try:
        config = json.loads(text or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{source} must be a JSON object")
    return config


def describe(run_config: syncer_pb2.RunConfig, plan: fragments_lib.FragmentPlan,
             training: Mapping[str, Any] | None = None) -> RunDescription:
    """The record of a run, from the RunConfig its learners adopt and its fragment plan.

    Args:
        run_config: the syncer's RunConfig (``model_config_json`` must be a JSON object).
        plan: the fragment plan the syncer's fragment vectors follow.
        training: JSON-serializable hyperparameters only the syncer knows (outer optimizer, ...).

    Raises:
        ValueError: if ``model_config_json`` is not a JSON object.
    """
    model_config = model_config_from_json(run_config.model_config_json, "RunConfig.model_config_json")
    fields = json_format.MessageToDict(run_config, preserving_proto_field_name=True,
                                       always_print_fields_with_no_presence=True)
    fragments = []
    for f in plan.fragments:
        slices = f.slices()
        fragments.append(FragmentLayout(
            fragment_id=f.fragment_id, numel=f.numel,
            tensors=tuple(TensorLayout(name=t.name, shape=tuple(t.shape), offset_elements=slices[t.name].start,
                                       is_embedding=t.is_embedding) for t in f.tensors),
        ))
    description = RunDescription(
        run_id=run_config.run_id, model_name=run_config.model_name, model_config=model_config,
        model_fingerprint=run_config.model_fingerprint,
        run_config={k: v for k, v in fields.items() if k not in _HOISTED},
        training=dict(training or {}), fragments=tuple(fragments),
    )
    description._check()
    return description
