"""`pip install` of the wheel into a fresh virtual environment, next to a user's own package named
`services` (issue 25, must-show 5): no top-level `services` from ddiloco, the services run as
`ddiloco.services.*`, `ddiloco --version` prints the version, and the user's `services` still imports.

No network: the wheel is built with this interpreter's setuptools (--no-build-isolation), and the
new environment sees this one's installed dependencies through a .pth file pointing at a view of
its site-packages (symlinks to every entry but ddiloco's own), so pip there finds no ddiloco
installed and installs the wheel with --no-deps.
"""

from __future__ import annotations

import email.parser
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = ("ddiloco", "services", "pyproject.toml", "setup.py", "README.md")
OPTIONAL = {"matplotlib": "plots", "cryptography": "certificates", "numba": "numba", "aetcd": "etcd"}
USER_MARK = "the user's own services package"


def _run(cmd: list, *, env: dict, cwd: pathlib.Path, timeout_s: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{cmd}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _offline_env(tmp: pathlib.Path, venv: pathlib.Path | None = None) -> dict:
    # No PYTHONPATH: nothing of the checkout may leak in. No index: pip must not reach the network.
    path = ([str(venv / "bin")] if venv else []) + ["/usr/bin", "/bin"]
    return {"PATH": os.pathsep.join(path), "HOME": str(tmp), "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "JAX_PLATFORMS": "cpu"}


def _dependency_view(tmp: pathlib.Path) -> pathlib.Path:
    """A folder of symlinks to this environment's installed packages, ddiloco's own excluded
    (an editable install's finder and metadata, a top-level services)."""
    view = tmp / "deps-view"
    view.mkdir()
    for lib in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")):
        for entry in pathlib.Path(lib).iterdir():
            own = entry.name.lower().startswith(("ddiloco", "__editable__")) or entry.name == "services"
            if not own and not entry.name.endswith(".pth") and not (view / entry.name).exists():
                (view / entry.name).symlink_to(entry)
    return view


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    tmp = tmp_path_factory.mktemp("build")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:  # a copy: the build leaves build/ and *.egg-info behind
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "BUILD_COMMIT"))
        else:
            shutil.copy2(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", tmp / "dist", src],
         env=_offline_env(tmp), cwd=tmp, timeout_s=180)
    (built,) = (tmp / "dist").glob("ddiloco-*.whl")
    return built


def test_the_wheel_ships_the_services_under_ddiloco_and_the_optional_parts_as_extras(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(zf.read(metadata).decode())
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"ddiloco", metadata.split("/", 1)[0]}, tops  # no top-level services/, tests/ or examples/
    for service in ("syncer", "learner", "checkpoint"):
        assert f"ddiloco/services/{service}/__main__.py" in names
    assert "ddiloco/services/__init__.py" in names and "ddiloco/v1/syncer_pb2.py" in names
    requires = meta.get_all("Requires-Dist")
    for package, extra in OPTIONAL.items():
        mine = [r for r in requires if r.lower().startswith(package)]
        assert mine and all(f'extra == "{extra}"' in r for r in mine), (package, mine)
    assert {"plots", "certificates", "numba", "etcd", "examples", "server", "dev"} <= set(meta.get_all("Provides-Extra"))


def test_installs_next_to_a_users_own_services_package(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], env=_offline_env(tmp_path), cwd=tmp_path)
    env = _offline_env(tmp_path, venv)
    python = venv / "bin" / "python"
    site = pathlib.Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             env=env, cwd=tmp_path).stdout.strip())
    (site / "ddiloco-test-deps.pth").write_text(f"{_dependency_view(tmp_path)}\n")
    # The user's own project, with a top-level package named services.
    user = tmp_path / "user-project"
    (user / "services").mkdir(parents=True)
    (user / "services" / "__init__.py").write_text(f"MARK = {USER_MARK!r}\n")
    (user / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\nbuild-backend = '
                                         '"setuptools.build_meta"\n\n[project]\nname = "user-services"\n'
                                         'version = "1.0"\n\n[tool.setuptools]\npackages = ["services"]\n')
    pip = [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet"]
    _run([*pip, user], env=env, cwd=tmp_path, timeout_s=180)
    _run([*pip, wheel], env=env, cwd=tmp_path, timeout_s=180)

    version = _run([venv / "bin" / "ddiloco", "--version"], env=env, cwd=tmp_path).stdout
    assert version.startswith("ddiloco 0.1.0 "), version
    where = _run([python, "-c", "import ddiloco, services; from ddiloco.cli import service_names as n; "
                  "print(services.MARK); print(ddiloco.__file__); print(n.PACKAGE)"], env=env, cwd=tmp_path)
    mark, ddiloco_file, package = where.stdout.strip().splitlines()
    assert mark == USER_MARK
    assert pathlib.Path(ddiloco_file).is_relative_to(site) and package == "ddiloco.services"
    # The services, by module and through the console script's dispatch.
    syncer = _run([python, "-m", "ddiloco.services.syncer", "--help"], env=env, cwd=tmp_path)
    assert "--run-id" in syncer.stdout
    store = _run([venv / "bin" / "ddiloco", "checkpoint", "--help"], env=env, cwd=tmp_path)
    assert "--root" in store.stdout
    # Nothing of ddiloco's at the top level of site-packages: the only services there is the user's.
    (record,) = site.glob("ddiloco-*.dist-info/RECORD")
    assert not [line for line in record.read_text().splitlines() if line.startswith("services/")]
    assert (site / "services" / "__init__.py").read_text() == f"MARK = {USER_MARK!r}\n"
