"""The optional parts of ddiloco (pyproject.toml's extras) and the error that names the one to install.

Owns: ``missing()``, the ImportError a module raises when a package of an extra is absent, and
``require()`` / ``pyplot()``, which import one and raise it. Why: a wheel installed without an
extra must fail at the feature that needs it with the command that fixes it, not with a bare
``No module named 'matplotlib'`` from deep inside a plot.
Must not: import any optional package at its own import.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# extra -> what it is for, as the error message says it (keep in step with pyproject.toml).
EXTRAS = {
    "plots": "PNG plots (`ddiloco report`, `ddiloco bench`, `ddiloco simulate`)",
    "certificates": "making certificates (`ddiloco certs`, `ddiloco up --tls`) and --tls-deny-list",
    "numba": "compiled codec and outer-step kernels (without it the same kernels run in numpy)",
    "etcd": "leader election and fenced commits on etcd (--coord-etcd)",
    "examples": "the model plugins under examples/ (Flax, Equinox)",
}


class MissingExtra(ImportError):
    """A package of an optional extra is not installed; the message says which extra to install."""


def missing(package: str, extra: str) -> MissingExtra:
    """The error for `package` (of `extra`) being absent; raise it `from` the original ImportError."""
    return MissingExtra(f"{EXTRAS[extra]} needs the package {package!r}, which is not installed: "
                        f"pip install 'ddiloco[{extra}]'", name=package)


def require(module: str, extra: str) -> ModuleType:
    """`importlib.import_module(module)`, or MissingExtra naming `extra`."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise missing(module.split(".")[0], extra) from exc


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend (files only: servers have no display)."""
    matplotlib = require("matplotlib", "plots")
    matplotlib.use("Agg")
    return require("matplotlib.pyplot", "plots")
