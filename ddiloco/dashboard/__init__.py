"""A live web dashboard for a syncer: a small HTTP server that polls GetTrainingState.

`Dashboard(target).start()` binds (127.0.0.1, port 0 allowed), polls the syncer in a background
thread and serves a self-contained page (no external assets) plus JSON endpoints; see server.py.
`ddiloco dashboard --target HOST:PORT` and `ddiloco up --dashboard` use it.
"""

from ddiloco.dashboard.server import Dashboard, parse_bind

__all__ = ["Dashboard", "parse_bind"]
