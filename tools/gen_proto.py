"""Regenerate engine/proto/caffe_pb2.py from engine/proto/caffe.proto.

Run from anywhere (needs grpcio-tools, whose bundled protoc matches the
installed protobuf runtime):

    pip install grpcio-tools
    python tools/gen_proto.py            # writes engine/proto/caffe_pb2.py
    python tools/gen_proto.py OUT_DIR    # writes OUT_DIR/caffe_pb2.py instead

Commit the regenerated module together with the .proto edit; tests/engine/test_proto.py
fails when the two disagree.
"""
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parents[1] / "engine" / "proto"


def generate(out_dir=PROTO_DIR):
    """Run protoc on caffe.proto; return the path of the generated module."""
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}",
                      str(PROTO_DIR / "caffe.proto")])
    if rc != 0:
        raise SystemExit(f"protoc failed on {PROTO_DIR / 'caffe.proto'} (exit {rc})")
    return out_dir / "caffe_pb2.py"


if __name__ == "__main__":
    print(generate(*sys.argv[1:2]))
