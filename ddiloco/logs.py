"""Logging set-up shared by the services: one line per event, human-readable or JSON.

Services call `setup_logging` once from `__main__`; modules log through `logging.getLogger`
and pass structured fields in `extra={"fields": {...}}` (learner id, fragment id, version...).
"""

from __future__ import annotations

import json
import logging
import sys
import time


class _HumanFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = getattr(record, "fields", None) or {}
        tail = "".join(f" {k}={v}" for k, v in fields.items())
        line = f"{ts}.{int(record.msecs):03d} {record.levelname[0]} {record.name}: {record.getMessage()}{tail}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **(getattr(record, "fields", None) or {}),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "INFO", *, json_lines: bool = False, component: str = "") -> None:
    """Configures the root logger to write one line per event to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if json_lines else _HumanFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if component:
        logging.getLogger(component).setLevel(level.upper())
    # JAX logs its backend probing (no TPU/GPU here) at INFO; that is noise for operators.
    logging.getLogger("jax").setLevel(max(logging.WARNING, root.level))
