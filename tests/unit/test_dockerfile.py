"""The Dockerfile's JAX_ACCELERATOR build argument, checked without building (CUDA wheels cannot be
downloaded offline): CPU stays the default everywhere, and the RUN step's shell logic installs the
CUDA plugin of exactly the installed JAX version for cuda12/cuda13, nothing for cpu, and refuses
anything else. The step runs here with stand-ins for the image's pip and python."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in DOCKERFILE.splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line[:-1] if line.endswith("\\") else line  # Docker drops backslash-newline
        if not line.endswith("\\"):
            if current.strip():
                keyword, _, rest = current.strip().partition(" ")
                out.append((keyword.upper(), rest))
            current = ""
    return out


def _accelerator_step() -> str:
    (step,) = [args for kw, args in _instructions() if kw == "RUN" and "JAX_ACCELERATOR" in args]
    return step


def test_cpu_is_the_default_in_the_dockerfile_and_the_compose_build():
    args = [a for kw, a in _instructions() if kw == "ARG" and a.startswith("JAX_ACCELERATOR")]
    assert args and all(a == "JAX_ACCELERATOR=cpu" for a in args)  # every stage that declares it
    env = " ".join(a for kw, a in _instructions() if kw == "ENV")
    assert "JAX_PLATFORMS=cpu" in env  # CUDA images too: GPU learners opt in with JAX_PLATFORMS=cuda
    compose = (ROOT / "docker-compose.yml").read_text()
    assert "JAX_ACCELERATOR: ${DDILOCO_JAX_ACCELERATOR:-cpu}" in compose
    # The accelerator step follows the dependency install, so the CPU layer stays cached.
    kinds = [(kw, a) for kw, a in _instructions()]
    install = next(i for i, (kw, a) in enumerate(kinds) if kw == "RUN" and "--requirement" in a)
    assert kinds.index(("RUN", _accelerator_step())) == install + 2  # ARG, then the step


@pytest.mark.parametrize("accelerator, expected", [
    ("cpu", None),
    ("cuda12", "install --no-cache-dir jax[cuda12]==0.10.2"),
    ("cuda13", "install --no-cache-dir jax[cuda13]==0.10.2"),
    ("rocm", "exit 2"),
    ("", "exit 2"),
])
def test_accelerator_step_installs_the_matching_plugin(tmp_path, accelerator, expected):
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    calls = tmp_path / "pip-calls"
    (bin_dir / "pip").write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n")
    (bin_dir / "python").write_text("#!/bin/sh\necho 0.10.2\n")  # the image's `import jax; jax.__version__`
    for shim in bin_dir.iterdir():
        shim.chmod(0o755)
    script = _accelerator_step().replace("/opt/venv/bin/", f"{bin_dir}/")
    done = subprocess.run(["/bin/sh", "-ec", script], env={"JAX_ACCELERATOR": accelerator, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30)
    pip_calls = calls.read_text().splitlines() if calls.exists() else []
    if expected is None:
        assert done.returncode == 0 and not pip_calls, done.stderr
    elif expected == "exit 2":
        assert done.returncode == 2 and not pip_calls and "not one of cpu, cuda12, cuda13" in done.stderr
    else:
        assert done.returncode == 0 and pip_calls == [expected], (done.stderr, pip_calls)


def test_documented_where_users_look():
    header = DOCKERFILE.split("ARG BASE_IMAGE", 1)[0]
    assert re.search(r"JAX_ACCELERATOR\s+cpu \(default\)", header)
    assert "--build-arg JAX_ACCELERATOR=cuda12" in header
    assert "JAX_ACCELERATOR=cuda12" in (ROOT / "docs" / "gpu.md").read_text()
