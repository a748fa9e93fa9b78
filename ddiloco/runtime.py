"""Process-wide tuning of native libraries for the services (BLAS threads, malloc arenas) and the
process's age (how long a start took).

Both were measured in `ddiloco bench perf`'s scale section (one syncer, 8-64 replay learners,
2 cores):

* numpy's OpenBLAS splits even small level-1 calls (a dot product or `np.linalg.norm` of 64k
  float64 values) across one thread per core and waits for all of them. On a busy machine that
  wait is a scheduling quantum: the syncer's norm of a direction sample took ~8 ms instead of
  ~15 us, and the waiting threads spin. The syncer already runs numpy in threads of its own.
* glibc gives each thread that allocates concurrently its own arena (up to 8 per core) and keeps
  freed memory in it. gRPC's and the syncer's worker threads allocate and free uploads and
  downloads all the time: with 64 learners, arenas held ~100 MiB more at the peak than with 8;
  two arenas bring the syncer's peak to within ~5% of the 8-learner one.

Called from a service's entry point (never on import); each function is a no-op returning False
where the library is not there (no BLAS loaded, another libc). BLAS threads go through
threadpoolctl (what scikit-learn uses for the same job). No environment variables.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import pathlib

import numpy as np  # noqa: F401 - loads numpy's BLAS, so that threadpoolctl can find it
from threadpoolctl import threadpool_info, threadpool_limits

_M_ARENA_MAX = -8  # glibc malloc.h


def blas_threads() -> int | None:
    """Threads one BLAS call may use now; None when no BLAS library is loaded."""
    counts = [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]
    return max(counts) if counts else None


def set_blas_threads(count: int) -> bool:
    """Lets one BLAS call use at most `count` (>= 1) threads, for the rest of the process (through
    threadpoolctl); False when no BLAS library is loaded."""
    if count < 1:
        raise ValueError(f"count={count} must be >= 1")
    if blas_threads() is None:
        return False
    threadpool_limits(limits=count, user_api="blas")
    return True


def limit_malloc_arenas(count: int) -> bool:
    """Caps glibc's malloc arenas at `count` (>= 1) for arenas created from now on (call it early);
    False where the C library has no mallopt or refuses."""
    if count < 1:
        raise ValueError(f"count={count} must be >= 1")
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt(_M_ARENA_MAX, count) == 1


def process_age_s() -> float | None:
    """Seconds since this process started, from the kernel's record (Linux /proc, 10 ms ticks): it
    includes the interpreter's start and the imports, which no timer started in Python sees. None
    where /proc is not there."""
    try:
        uptime_s = float(pathlib.Path("/proc/uptime").read_text().split()[0])
        stat = pathlib.Path("/proc/self/stat").read_text()
    except (OSError, ValueError, IndexError):
        return None
    # Field 22 (starttime, clock ticks after boot); the command name before it may hold spaces.
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
    return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))


def freeze_start_up_objects() -> None:
    """Moves every object alive now out of the cyclic garbage collector's reach (``gc.freeze``):
    called once a service has started, when what is alive is mostly the imported libraries (JAX,
    numba, gRPC) and the service's long-lived state. Full collections then no longer traverse
    them, and neither does the one the interpreter runs at exit: a syncer's exit after SIGTERM,
    its state already written, spent ~0.7-1.4 s (2 busy cores) in that collection, 0.2-0.4 s with
    the start-up objects frozen. Reference counting still frees them; a reference cycle among
    them is never collected (what start-up leaves, once)."""
    gc.freeze()
