"""Generate the Python stubs for proto/*.proto: `python proto/generate.py` (needs grpcio-tools,
the `dev` extra). The stubs are committed and never hand-edited.

The .proto files are compiled as if they lived at mxserve/proto/, so the generated modules import
each other as `mxserve.proto.<name>_pb2` (the installed package name), not as top-level modules.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc


def main() -> int:
    here = pathlib.Path(__file__).resolve().parent
    protos = sorted(here.glob("*.proto"))
    with tempfile.TemporaryDirectory() as out:
        include = pathlib.Path(protoc.__file__).parent / "_proto"  # well-known types
        args = ["protoc", f"-Imxserve/proto={here}", f"-I{include}", f"--python_out={out}",
                f"--pyi_out={out}", f"--grpc_python_out={out}"]
        args += [f"mxserve/proto/{p.name}" for p in protos]
        if protoc.main(args) != 0:
            print("protoc failed", file=sys.stderr)
            return 1
        for path in sorted((pathlib.Path(out) / "mxserve" / "proto").iterdir()):
            shutil.copy(path, here / path.name)
            print(f"wrote proto/{path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
