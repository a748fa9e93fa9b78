"""Benchmarks: `ddiloco bench quality|perf|goodput` (one module each) and the shared result writer.

Every benchmark writes `<out>/<name>.json` (machine, commit, exact configuration, figures) and
`<out>/<name>.md` (a short report with the figures as ratios measured side by side in one run),
by default under `bench/results/`.
"""
