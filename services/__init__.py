"""The services: syncer, learner and checkpoint store, each a package run with `python -m`.

In the repository this folder is the top-level package `services`; the wheel ships it as
`ddiloco.services` (setup.py), so an installed ddiloco never shadows another `services`. The
modules import their own package relatively, which works under either name
(ddiloco/cli/service_names.py picks the name tools launch and import).
"""
