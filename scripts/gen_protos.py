"""Generates ddiloco/v1 from protos/ddiloco/v1: the project's only protobuf codegen entry point.

Writes *_pb2.py, *_pb2.pyi (mypy-protobuf) and *_pb2_grpc.py(i) beside each other, so that
`import "ddiloco/v1/common.proto"` becomes `from ddiloco.v1 import common_pb2`.
Run with `make protos`; CI runs `make check-protos`, which fails when the committed code is stale.
"""

import argparse
import filecmp
import os
import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_PACKAGE = ROOT / "ddiloco" / "v1"


def generate(out_root: pathlib.Path) -> int:
    """Generates the ddiloco/v1 package under out_root; returns protoc's exit code."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "ddiloco" / "v1").glob("*.proto"))
    if not protos:
        print(f"no .proto files under {PROTO_ROOT}", file=sys.stderr)
        return 1
    out_package = out_root / "ddiloco" / "v1"
    out_package.mkdir(parents=True, exist_ok=True)
    # Regenerate from scratch so a removed .proto leaves no stale module behind.
    for old in out_package.glob("*_pb2*"):
        old.unlink()
    well_known = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *protos,
    ]
    # protoc finds its plugins on PATH. `make` runs this script as .venv/bin/python without activating
    # the venv, so the interpreter's own bin directory (where mypy-protobuf installs protoc-gen-mypy)
    # goes first; CI's PATH has no venv on it.
    bin_dir = str(pathlib.Path(sys.executable).parent)
    os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    if shutil.which("protoc-gen-mypy") is None:
        print(f"protoc-gen-mypy not found in {bin_dir} or on PATH: pip install mypy-protobuf", file=sys.stderr)
        return 1
    code = protoc.main(args)
    if code != 0:
        return code
    init = out_package / "__init__.py"
    init.write_text('"""Generated gRPC/protobuf code for the ddiloco.v1 API. Do not edit: run `make protos`."""\n')
    return 0


def check() -> int:
    """Regenerates into a temporary tree and compares with the committed code."""
    with tempfile.TemporaryDirectory() as tmp:
        code = generate(pathlib.Path(tmp))
        if code != 0:
            return code
        fresh = pathlib.Path(tmp) / "ddiloco" / "v1"
        names = sorted({p.name for p in fresh.iterdir()} | {p.name for p in OUT_PACKAGE.iterdir() if p.is_file()})
        stale = [n for n in names if not (fresh / n).exists() or not (OUT_PACKAGE / n).exists()
                 or not filecmp.cmp(fresh / n, OUT_PACKAGE / n, shallow=False)]
    if stale:
        print(f"generated protobuf code is stale ({', '.join(stale)}): run `make protos` and commit", file=sys.stderr)
        return 1
    print("generated protobuf code is fresh")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args()
    return check() if args.check else generate(ROOT)


if __name__ == "__main__":
    sys.exit(main())
