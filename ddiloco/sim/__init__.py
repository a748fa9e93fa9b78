"""`ddiloco simulate`: a seeded discrete-event simulation of the paper's chaos-engineering goodput study.

`model` owns the failure/recovery model, its calibrated constants and the goodput tables (pure:
no I/O, no clock); `cli` owns the flags, the report files and the plot.
"""
