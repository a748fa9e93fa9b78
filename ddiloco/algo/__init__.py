"""Pure JAX/optax algorithm code for Decoupled DiLoCo: no gRPC, no I/O."""
