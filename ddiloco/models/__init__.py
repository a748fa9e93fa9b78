"""Model registry: maps a model name plus a config mapping to a ``Model``.

Owns: ``get_model`` and ``MODEL_NAMES``. Architectures live in sibling modules.

A model that lives outside this repository is named in one of two ways, and every process
(syncer, learners, evaluator, `ddiloco export`/`generate`) resolves the name the same way, since
the syncer hands its name to the others in the run configuration:

* ``package.module:factory``: imported from the Python path; ``factory(config)`` returns the model.
* a name registered by an installed distribution under the entry-point group ``ddiloco.models``
  (``[project.entry-points."ddiloco.models"] mymodel = "mypackage.models:build"``).

The model must satisfy ``Model`` (docs/models.md); it may also define
``inner_optimizer(default: InnerOptConfig) -> optax.GradientTransformation`` to choose the
learners' inner optimizer (any optax chain).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ddiloco.models import transformer
from ddiloco.models.base import Model, Params, model_fingerprint

_FACTORIES: dict[str, Callable[[Mapping[str, Any] | None], Model]] = {
    "transformer": transformer.from_config,
}
MODEL_NAMES: tuple[str, ...] = tuple(sorted(_FACTORIES))

__all__ = ["ENTRY_POINT_GROUP", "MODEL_NAMES", "Model", "Params", "get_model", "init_tensors", "model_fingerprint"]


ENTRY_POINT_GROUP = "ddiloco.models"
# What a model must provide (the Model protocol's members), checked when a plugin is loaded.
_REQUIRED = ("name", "config", "init", "loss", "tensor_specs", "vocab_size", "seq_len")


def get_model(name: str, config: Mapping[str, Any] | None = None) -> Model:
    """Builds a model: a built-in one, an installed plugin or ``module:factory``.

    Args:
        name: one of ``MODEL_NAMES``, a name registered under the ``ddiloco.models`` entry-point
            group, or ``package.module:factory`` (importable from the Python path).
        config: model-specific overrides, e.g. ``{"preset": "tiny", "n_layers": 2}``
            for ``"transformer"``; ``None`` uses the model's defaults. A model's own
            ``config`` passed back here rebuilds the same model.

    Returns:
        The model.

    Raises:
        ValueError: on an unknown name, a factory that cannot be imported or returns something
            that is not a model, or (from the factory) an invalid config.
    """
    factory = _FACTORIES.get(name) or _plugin_factory(name)
    model = factory(config)
    missing = [attr for attr in _REQUIRED if not hasattr(model, attr)]
    if missing:
        raise ValueError(f"model {name!r}: the factory returned {type(model).__name__}, which lacks "
                         f"{', '.join(missing)} (see ddiloco.models.base.Model)")
    if model.name != name:
        # The run configuration carries model.name to the other processes, which rebuild the
        # model from it: it must be the name that built this one.
        raise ValueError(f"model {name!r}: the factory's model says name={model.name!r}; "
                         f"set it to {name!r} so every process rebuilds the same model")
    return model


def init_tensors(model: Model, rng, names: Iterable[str]) -> Params:
    """The initial values of the tensors named, equal to ``model.init(rng)``'s.

    A model may define ``init_tensors(rng, names)`` (the built-in transformer does) to build only
    those tensors; for any other, the whole model is initialized and the rest dropped on return.
    A syncer shard builds its own fragments this way (services/syncer/initial.py).
    """
    names = list(names)
    own = getattr(model, "init_tensors", None)
    if own is not None:
        return own(rng, names)
    params = model.init(rng)
    return {name: params[name] for name in names}


def _plugin_factory(name: str) -> Callable[[Mapping[str, Any] | None], Model]:
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"model {name!r}: cannot import {module_name!r} ({exc}); is it on the "
                             f"Python path (PYTHONPATH) of every process?") from None
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise ValueError(f"model {name!r}: {module_name!r} has no callable {attr!r}")
        return factory
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=name)
    for entry_point in found:
        return entry_point.load()
    raise ValueError(f"model name={name!r} is unknown: use one of {list(MODEL_NAMES)}, a name installed "
                     f"under the {ENTRY_POINT_GROUP!r} entry-point group, or package.module:factory")
