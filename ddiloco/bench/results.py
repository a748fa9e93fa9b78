"""Where and how benchmark results are written: JSON plus a markdown report, with provenance.

Owns the provenance block every result carries (machine, CPU count, Python/JAX/numpy versions,
git commit and whether the tree was dirty, start time, the exact command line) so a committed
report can be traced back to what produced it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
from collections.abc import Sequence

DEFAULT_OUT_DIR = pathlib.Path("bench/results")


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def provenance(argv: Sequence[str] | None = None) -> dict:
    """Machine, software versions and commit of this invocation."""
    import numpy

    try:
        import jax

        jax_version = jax.__version__
    except ImportError:  # pragma: no cover - jax is a dependency
        jax_version = ""
    mem_bytes = 0
    try:
        mem_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return {
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": mem_bytes,
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "jax": jax_version,
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "argv": list(sys.argv if argv is None else argv),
    }


def _jsonable(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, pathlib.Path):
        return str(value)
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def write_result(out_dir: pathlib.Path, name: str, result: dict, markdown: str) -> tuple[pathlib.Path, pathlib.Path]:
    """Writes `<out_dir>/<name>.json` and `<out_dir>/<name>.md`; returns both paths."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    md_path = out_dir / f"{name}.md"
    json_path.write_text(json.dumps(result, indent=2, sort_keys=False, default=_jsonable) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    return json_path, md_path


def provenance_markdown(prov: dict) -> str:
    """A two-line provenance footer for the markdown reports."""
    dirty = " (uncommitted changes)" if prov.get("dirty") else ""
    return (
        f"Machine: {prov.get('cpu_count')} CPUs ({prov.get('cpu_model')}), "
        f"{(prov.get('memory_bytes') or 0) / 2**30:.0f} GiB; Python {prov.get('python')}, "
        f"JAX {prov.get('jax')}, numpy {prov.get('numpy')}.\n"
        f"Commit {prov.get('commit', '')[:12]}{dirty}, started {prov.get('started_utc')}; "
        f"command: `{' '.join(prov.get('argv', []))}`."
    )


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; floats are shown with 4 significant digits."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
