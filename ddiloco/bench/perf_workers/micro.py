"""The codec and merge micro-benchmarks' process (`ddiloco.bench.perf_micro.micro_worker`),
pinned to the one core the spec names before numpy and JAX start their threads."""

from __future__ import annotations

import os

from ddiloco.bench import perf_workers


def _pinned_micro(spec: dict) -> dict:
    if spec.get("cpu", -1) >= 0:
        os.sched_setaffinity(0, {spec["cpu"]})
    # Imported after pinning: the threads numpy, BLAS and XLA start inherit this core.
    from ddiloco.bench import perf_micro

    return perf_micro.micro_worker(spec)


if __name__ == "__main__":
    perf_workers.run_job(_pinned_micro)
