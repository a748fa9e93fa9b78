"""ddiloco: an open implementation of Decoupled DiLoCo as gRPC parameter-server services."""

__version__ = "0.1.0"
