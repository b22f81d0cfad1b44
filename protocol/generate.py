"""Regenerate the committed gRPC stubs from the ``.proto`` files: ``python -m protocol.generate``.

The stubs are committed so that installing Matformer needs no code generator; a test
regenerates them into a temporary directory and compares byte for byte. Output depends on
the generator's version, so the ``dev`` extra pins ``grpcio-tools`` to ``GENERATOR_VERSION``.
"""

from __future__ import annotations

import sys
from pathlib import Path

GENERATOR_VERSION = "1.85.1"  # grpcio-tools that generated the committed stubs
REPO_ROOT = Path(__file__).resolve().parent.parent
# Paths relative to the repository root, which is protoc's include root: the generated
# imports then read ``from protocol.matformer.v1 import ...`` and need no rewriting.
PROTO_FILES = ("protocol/matformer/v1/coordinator.proto",)


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` for every proto under ``out_dir``."""
    from grpc_tools import protoc  # dev-only dependency

    args = ["grpc_tools.protoc", f"-I{REPO_ROOT}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *PROTO_FILES]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(PROTO_FILES)}; see its message above.")
    return [out_dir / (proto.removesuffix(".proto") + suffix)
            for proto in PROTO_FILES for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def main() -> None:
    for path in generate():
        print(path.relative_to(REPO_ROOT), file=sys.stderr)


if __name__ == "__main__":
    main()
