"""The checkpoint store service: durable, content-addressed blobs plus per-run manifests that
commit a checkpoint atomically, served over gRPC (`ddiloco.v1.CheckpointStore`).

`store` owns the disk (no grpc), `servicer` maps RPCs onto it, `config` parses flags and
environment variables, and `__main__` wires them together: `python -m services.checkpoint`.
"""
