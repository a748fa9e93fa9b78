"""Pure Decoupled DiLoCo algorithm code: fragments, merge rules, outer optimizer, grace window.

No gRPC, no I/O, no clocks (times are passed in). Import the modules, not their names:
``from ddiloco.algo import merge as merge_lib``.
"""
