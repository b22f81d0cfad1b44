"""Regenerate the committed gRPC stubs from the ``.proto`` files:
``python -m matformer.protocol.generate``.

The stubs are committed so that installing Matformer needs no code generator; a test
regenerates them into a temporary directory and compares byte for byte. Output depends on
the generator's version, so the ``dev`` extra pins ``grpcio-tools`` to ``GENERATOR_VERSION``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

GENERATOR_VERSION = "1.85.1"  # grpcio-tools that generated the committed stubs
REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = ("protocol/matformer/v1/coordinator.proto",)  # relative to the repository root
NAMESPACE = "matformer"  # the folders install as matformer.protocol, matformer.server, ...


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` for every proto under ``out_dir``.

    protoc names the modules a stub imports after the proto's path below its include root, so
    it runs on a root where the protocol folder sits at ``matformer/protocol``: the stubs then
    import ``matformer.protocol.matformer.v1`` as installed, and need no rewriting.
    """
    from grpc_tools import protoc  # dev-only dependency

    with tempfile.TemporaryDirectory() as scratch:
        root, made = Path(scratch, "root"), Path(scratch, "out")
        (root / NAMESPACE).mkdir(parents=True)
        (root / NAMESPACE / "protocol").symlink_to(REPO_ROOT / "protocol")
        made.mkdir()
        protos = [f"{NAMESPACE}/{proto}" for proto in PROTO_FILES]
        args = ["grpc_tools.protoc", f"-I{root}", f"--python_out={made}", f"--pyi_out={made}",
                f"--grpc_python_out={made}", *protos]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {', '.join(PROTO_FILES)}; see its message "
                               "above.")
        written = []
        for proto in PROTO_FILES:
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                name = proto.removesuffix(".proto") + suffix
                target = out_dir / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(made / NAMESPACE / name, target)
                written.append(target)
        return written


def main() -> None:
    for path in generate():
        print(path.relative_to(REPO_ROOT), file=sys.stderr)


if __name__ == "__main__":
    main()
