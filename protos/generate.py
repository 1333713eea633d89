"""Regenerate the Python gRPC stubs beside the .proto files (``make protos``).

    python protos/generate.py            # in place: protos/pagoda/v1/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi
    python protos/generate.py --out DIR  # elsewhere (the drift test compares the two)

The stubs are committed; ``tests/test_protos.py`` fails when they drift from the .proto files.
They depend on the grpcio-tools version, which pyproject.toml pins for that reason.
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("pagoda/**/*.proto"))


def generate(out_dir: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc (from grpcio-tools) over every .proto; return the files written under out_dir."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = str(resources.files("grpc_tools") / "_proto")
    protos = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    # protoc resolves relative .proto names against -I; run it from the root so the names match.
    cwd = os.getcwd()
    os.chdir(PROTO_ROOT)
    try:
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
    finally:
        os.chdir(cwd)
    return sorted(p for p in out_dir.glob("pagoda/**/*") if p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default: beside the protos)")
    args = ap.parse_args()
    for path in generate(args.out.resolve()):
        print(path, file=sys.stderr)


if __name__ == "__main__":
    main()
