"""ddiloco: an open implementation of Decoupled DiLoCo as gRPC parameter-server services."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `ddiloco.Learner` (docs/python-api.md) imports JAX and gRPC: only when it is asked for, so that
    # `import ddiloco` (the CLI, `ddiloco --version`) stays light.
    if name == "Learner":
        from ddiloco.learner.api import Learner

        return Learner
    raise AttributeError(f"module 'ddiloco' has no attribute {name!r}")
