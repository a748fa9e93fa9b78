"""Where the services live: `services.<name>` in a source checkout, `ddiloco.services.<name>` in a wheel.

Why two names: the repository keeps the services in its top-level folders (services/syncer,
services/learner, services/checkpoint), but a wheel holding a top-level `services` package would
collide with any other distribution's, or the user's own, `services`. The wheel ships those
folders as `ddiloco.services` instead (setup.py's package_dir). The services import their own
modules relatively, so their code is the same under either name; the tools (ddiloco.cli,
ddiloco.bench, ddiloco.chaos) name a service as in the repository ("services.syncer") and ask
here for the name to launch (`module`) or import (`load`).
"""

from __future__ import annotations

import importlib
import pathlib
import sys
from types import ModuleType

_DDILOCO = pathlib.Path(__file__).resolve().parents[1]

# A wheel installs ddiloco/services/ as a real folder. A checkout (also under `pip install -e .`,
# whose import hook would map `ddiloco.services` too) has the services beside ddiloco/ instead:
# there the tests and `python -m services.<name>` import them as `services`, and one name per
# process keeps one copy of each module (two copies would register their metrics twice).
INSTALLED = (_DDILOCO / "services" / "__init__.py").is_file()
PACKAGE = "ddiloco.services" if INSTALLED else "services"
# The folder holding services/ in a checkout (put first on the services' PYTHONPATH), else None.
SOURCE_ROOT: str | None = None if INSTALLED else str(_DDILOCO.parent)


def module(name: str) -> str:
    """The importable name of `name`, given as in the repository ("services.syncer",
    "services.learner.evaluator"); any other module name (ddiloco.chaos.hostile_learner) as is."""
    if name == "services" or name.startswith("services."):
        return PACKAGE + name[len("services"):]
    return name


def load(name: str) -> ModuleType:
    """Imports `name` (as in the repository) under the name this install uses."""
    if SOURCE_ROOT is not None and SOURCE_ROOT not in sys.path:
        sys.path.insert(0, SOURCE_ROOT)  # a console script's sys.path lacks the checkout
    return importlib.import_module(module(name))
