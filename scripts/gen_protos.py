"""Generates ddiloco/v1 from protos/ddiloco/v1: the project's only protobuf codegen entry point.

Writes *_pb2.py, *_pb2.pyi (mypy-protobuf) and *_pb2_grpc.py(i) beside each other, so that
`import "ddiloco/v1/common.proto"` becomes `from ddiloco.v1 import common_pb2`.
Run with `make protos`; CI runs `make check-protos`, which fails when the committed code is stale.
"""

import pathlib
import shutil
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_PACKAGE = ROOT / "ddiloco" / "v1"


def main() -> int:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "ddiloco" / "v1").glob("*.proto"))
    if not protos:
        print(f"no .proto files under {PROTO_ROOT}", file=sys.stderr)
        return 1
    # Regenerate from scratch so a removed .proto leaves no stale module behind.
    for old in OUT_PACKAGE.glob("*_pb2*"):
        old.unlink()
    well_known = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={ROOT}",
        f"--mypy_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        f"--mypy_grpc_out={ROOT}",
        *protos,
    ]
    if shutil.which("protoc-gen-mypy") is None:
        print("protoc-gen-mypy not found: pip install mypy-protobuf", file=sys.stderr)
        return 1
    code = protoc.main(args)
    if code != 0:
        return code
    init = OUT_PACKAGE / "__init__.py"
    init.write_text('"""Generated gRPC/protobuf code for the ddiloco.v1 API. Do not edit: run `make protos`."""\n')
    return 0


if __name__ == "__main__":
    sys.exit(main())
