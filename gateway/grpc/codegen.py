"""Build the Python code of ``sessions.proto`` (grpcio-tools), once per proto version.

The generated modules are not committed: they are made under ``gateway/grpc/_generated/``
at install time (``.ci/bootstrap`` runs ``python -m gateway.grpc.codegen``) or, failing that,
on first use, and remade whenever the proto changes (its hash is kept beside them).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
PROTO = HERE / "sessions.proto"
OUT = HERE / "_generated"
_lock = threading.Lock()


def _digest() -> str:
    return hashlib.sha256(PROTO.read_bytes()).hexdigest()[:16]


def generate() -> Path:
    """(Re)generate the modules if the proto changed; return their directory."""
    with _lock:
        stamp = OUT / "PROTO_HASH"
        if stamp.is_file() and stamp.read_text().strip() == _digest():
            return OUT
        from grpc_tools import protoc

        # Made aside and moved in file by file: another process (two gateways starting at
        # once) never imports a half-written module.
        with tempfile.TemporaryDirectory(dir=HERE, prefix="_generated.tmp-") as tmp:
            work = Path(tmp)
            args = ["protoc", f"-I{HERE}", f"--python_out={work}", f"--grpc_python_out={work}", str(PROTO)]
            if protoc.main(args) != 0:
                raise RuntimeError(f"grpc_tools.protoc failed on {PROTO}")
            stub = work / "sessions_pb2_grpc.py"
            # The generated stub imports its messages as a top-level module: make it relative.
            stub.write_text(stub.read_text().replace("import sessions_pb2 as", "from . import sessions_pb2 as"))
            (work / "__init__.py").write_text('"""Generated from gateway/grpc/sessions.proto; not committed."""\n')
            (work / "PROTO_HASH").write_text(_digest() + "\n")
            OUT.mkdir(exist_ok=True)
            for name in ("__init__.py", "sessions_pb2.py", "sessions_pb2_grpc.py", "PROTO_HASH"):
                os.replace(work / name, OUT / name)  # the hash last: it says the rest is complete
        return OUT


def modules() -> tuple[ModuleType, ModuleType]:
    """Return ``(sessions_pb2, sessions_pb2_grpc)``, generating them first if needed."""
    generate()
    importlib.invalidate_caches()
    pb2 = importlib.import_module("gateway.grpc._generated.sessions_pb2")
    pb2_grpc = importlib.import_module("gateway.grpc._generated.sessions_pb2_grpc")
    return pb2, pb2_grpc


if __name__ == "__main__":
    print(generate(), file=sys.stderr)
