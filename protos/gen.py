"""Regenerate the committed gRPC stubs: ``python -m protos.gen`` (CI checks they match)."""

from __future__ import annotations

import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def generate(out_dir: str = HERE) -> None:
    from grpc_tools import protoc

    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{HERE}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            os.path.join(HERE, "kv_transfer.proto"),
        ]
    )
    if rc != 0:
        sys.exit(f"protoc failed with {rc}")
    # protoc emits `import kv_transfer_pb2`; make it a package-relative import.
    grpc_file = os.path.join(out_dir, "kv_transfer_pb2_grpc.py")
    with open(grpc_file) as f:
        src = f.read()
    src = re.sub(
        r"^import kv_transfer_pb2 as", "from protos import kv_transfer_pb2 as", src, flags=re.M
    )
    with open(grpc_file, "w") as f:
        f.write(src)


if __name__ == "__main__":
    generate()
