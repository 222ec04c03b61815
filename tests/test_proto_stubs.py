"""The committed gRPC stubs are exactly what grpcio-tools generates from proto/ today."""

from __future__ import annotations

import filecmp
import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_committed_stubs_match_the_protos(tmp_path):
    protos = sorted(glob.glob(os.path.join(ROOT, "proto", "pdserve", "v1", "*.proto")))
    assert protos, "no .proto files found"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{os.path.join(ROOT, 'proto')}",
         f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *protos],
        check=True,
    )  # fmt: skip
    generated = sorted(os.listdir(tmp_path / "pdserve" / "v1"))
    assert generated, "protoc generated nothing"
    for name in generated:
        committed = os.path.join(ROOT, "pdserve", "v1", name)
        assert os.path.exists(committed), f"{name} is not committed: run `make proto`"
        assert filecmp.cmp(tmp_path / "pdserve" / "v1" / name, committed, shallow=False), (
            f"pdserve/v1/{name} is stale: run `make proto`"
        )
