"""Caffe-compatible protobuf schema: ``caffe.proto`` and its generated ``caffe_pb2``.

Field numbers equal BVLC Caffe's, so real .caffemodel/.prototxt files load as-is.
After editing caffe.proto, regenerate with ``python tools/gen_proto.py``.
"""
