"""ddiloco.runtime: the syncer's process-wide BLAS thread count, malloc arena cap and mmap threshold, a
process's age, the start-up objects frozen out of the garbage collector's reach."""

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
    with pytest.raises(ValueError):
        runtime.limit_malloc_arenas(2, mmap_threshold_bytes=0)
    # 8 arenas: what glibc allows on one core anyway; the test process's mmap threshold is left as is.
    assert isinstance(runtime.limit_malloc_arenas(8, mmap_threshold_bytes=None), bool)


# In a child (malloc's settings are the whole process's): a 4 MiB block served by mmap is freed, then
# a 1 MiB one is taken; prints how many of its bytes are mapped on their own (mallinfo2's hblkhd).
_MAPPED_AFTER_A_LARGE_FREE = """
import ctypes, sys
from ddiloco import runtime
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
assert runtime.limit_malloc_arenas(2, **({} if sys.argv[1] == "default" else {"mmap_threshold_bytes": None}))
libc.free(libc.malloc(4 << 20))
before = libc.mallinfo2().hblkhd
block = libc.malloc(1 << 20)
print(libc.mallinfo2().hblkhd - before)
libc.free(block)
"""


def _mapped_after_a_large_free(threshold: str) -> int:
    out = subprocess.run([sys.executable, "-c", _MAPPED_AFTER_A_LARGE_FREE, threshold], capture_output=True,
                         text=True, timeout=60, check=True)
    return int(out.stdout)


def test_freed_large_blocks_do_not_move_later_ones_into_the_heap():
    # glibc alone raises its mmap threshold to the 4 MiB block freed: the 1 MiB block then comes from
    # the heap, whose free space malloc keeps (what grew the syncer's peak with the learners). With
    # the threshold fixed (the default), it is mapped on its own and unmapped when freed.
    assert _mapped_after_a_large_free("dynamic") == 0
    assert _mapped_after_a_large_free("default") >= 1 << 20


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
