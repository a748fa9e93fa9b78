"""Model registry: maps a model name plus a config mapping to a ``Model``.

Owns: ``get_model`` and ``MODEL_NAMES``. Architectures live in sibling modules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ddiloco.models import transformer
from ddiloco.models.base import Model, Params, model_fingerprint

_FACTORIES: dict[str, Callable[[Mapping[str, Any] | None], Model]] = {
    "transformer": transformer.from_config,
}
MODEL_NAMES: tuple[str, ...] = tuple(sorted(_FACTORIES))

__all__ = ["MODEL_NAMES", "Model", "Params", "get_model", "model_fingerprint"]


def get_model(name: str, config: Mapping[str, Any] | None = None) -> Model:
    """Builds a registered model.

    Args:
        name: one of ``MODEL_NAMES``.
        config: model-specific overrides, e.g. ``{"preset": "tiny", "n_layers": 2}``
            for ``"transformer"``; ``None`` uses the model's defaults. A model's own
            ``config`` passed back here rebuilds the same model.

    Returns:
        The model.

    Raises:
        ValueError: on an unknown name, or (from the factory) an invalid config.
    """
    if name not in _FACTORIES:
        raise ValueError(f"model name={name!r} is unknown: use one of {list(MODEL_NAMES)}")
    return _FACTORIES[name](config)
