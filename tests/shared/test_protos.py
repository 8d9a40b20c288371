"""The committed gRPC stubs match protos/kv_transfer.proto."""

from __future__ import annotations

import filecmp
import os

from protos import gen


def test_generated_stubs_match_proto(tmp_path):
    gen.generate(str(tmp_path))
    for name in ("kv_transfer_pb2.py", "kv_transfer_pb2.pyi", "kv_transfer_pb2_grpc.py"):
        committed = os.path.join(gen.HERE, name)
        assert filecmp.cmp(committed, tmp_path / name, shallow=False), (
            f"protos/{name} is stale: run `python -m protos.gen`"
        )
