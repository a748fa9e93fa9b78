"""ddiloco.runtime: the syncer's process-wide BLAS thread count and malloc arena cap, a process's age, the
start-up objects frozen out of the garbage collector's reach."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from ddiloco import runtime


def test_blas_threads_can_be_limited_and_restored():
    before = runtime.blas_threads()
    assert before is not None and before >= 1  # numpy's wheels bundle OpenBLAS
    try:
        assert runtime.set_blas_threads(1)
        assert runtime.blas_threads() == 1
        x = np.arange(1 << 16, dtype=np.float64)
        assert float(np.linalg.norm(x)) == pytest.approx(float(np.sqrt(np.sum(x * x))))
    finally:
        runtime.set_blas_threads(before)
    assert runtime.blas_threads() == before


def test_arguments_are_checked_and_the_arena_cap_reports_whether_it_applied():
    with pytest.raises(ValueError):
        runtime.set_blas_threads(0)
    with pytest.raises(ValueError):
        runtime.limit_malloc_arenas(0)
    assert isinstance(runtime.limit_malloc_arenas(8), bool)  # 8 arenas: what glibc allows on one core anyway


def test_the_process_age_counts_from_the_process_start_not_from_an_import():
    # A child that sleeps before it imports the module: a timer started at import would miss that.
    code = "import time; time.sleep(0.6); from ddiloco import runtime; print(runtime.process_age_s())"
    started_s = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    elapsed_s = time.monotonic() - started_s
    age_s = float(out.stdout)
    assert 0.6 <= age_s <= elapsed_s + 0.02  # /proc counts in 10 ms ticks


def test_start_up_objects_are_frozen_and_new_cycles_are_still_collected():
    # In a child: freezing is for the whole process (the test runner's objects stay as they are).
    code = ("import gc\n"
            "from ddiloco import runtime\n"
            "before = gc.get_freeze_count()\n"
            "runtime.freeze_start_up_objects()\n"
            "frozen = gc.get_freeze_count()\n"
            "assert frozen > before + 1000, (before, frozen)  # the imported libraries' objects\n"
            "class Node: pass\n"
            "a, b = Node(), Node()\n"
            "a.other, b.other = b, a\n"
            "del a, b\n"
            "assert gc.collect() >= 2  # a cycle made after the freeze is collected as before\n"
            "assert gc.get_freeze_count() == frozen\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
