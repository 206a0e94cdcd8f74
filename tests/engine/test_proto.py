"""The Caffe schema: generated module in sync, real model files parse, Caffe's field numbers.

Run: python -m pytest tests/engine/test_proto.py -q
"""
import ast
from pathlib import Path

import pytest
from google.protobuf import text_format

from poseidon.engine.proto import caffe_pb2

from tests.conftest import CAFFE_MODELS, caffe_model_files, needs_caffe_models

PROTO_DIR = Path(__file__).resolve().parents[2] / "engine" / "proto"
MODEL_FILES = caffe_model_files("*.prototxt")


def _embedded_descriptor(source):
    """The serialized FileDescriptorProto a *_pb2.py passes to AddSerializedFile."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile":
            return ast.literal_eval(node.args[0])
    raise AssertionError("no AddSerializedFile call in generated module")


def test_generated_module_matches_proto(tmp_path):
    protoc = pytest.importorskip(
        "grpc_tools.protoc", reason="grpcio-tools not installed: cannot regenerate caffe_pb2")
    rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={tmp_path}",
                      str(PROTO_DIR / "caffe.proto")])
    assert rc == 0
    fresh = (tmp_path / "caffe_pb2.py").read_text()
    committed = (PROTO_DIR / "caffe_pb2.py").read_text()
    # Compare protoc's own bytes (the runtime's DESCRIPTOR.serialized_pb is a
    # re-serialization that spells float defaults differently).
    assert _embedded_descriptor(fresh) == _embedded_descriptor(committed), \
        "engine/proto/caffe_pb2.py is stale: run python tools/gen_proto.py"


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: str(p.relative_to(CAFFE_MODELS)))
def test_real_prototxt_parses(path):
    msg = caffe_pb2.SolverParameter() if "solver" in path.name else caffe_pb2.NetParameter()
    text_format.Parse(path.read_text(), msg)
    if isinstance(msg, caffe_pb2.NetParameter):
        assert len(msg.layer) + len(msg.layers) > 0


@needs_caffe_models
def test_legacy_v1_file_uses_layers_field():
    text = (CAFFE_MODELS / "vgg" / "VGG_ILSVRC_19_layers_deploy.prototxt").read_text()
    net = text_format.Parse(text, caffe_pb2.NetParameter())
    assert not net.layer and net.layers
    assert net.layers[0].type == caffe_pb2.V1LayerParameter.CONVOLUTION
    assert list(net.input_dim) == [10, 3, 224, 224]


@pytest.mark.parametrize("message, field, number", [
    ("NetParameter", "layer", 100), ("NetParameter", "layers", 2),
    ("NetParameter", "input_dim", 4), ("NetParameter", "input_shape", 8),
    ("LayerParameter", "convolution_param", 106), ("LayerParameter", "blobs", 7),
    ("LayerParameter", "transform_param", 100), ("LayerParameter", "batch_norm_param", 139),
    ("LayerParameter", "input_param", 143), ("LayerParameter", "clip_param", 148),
    ("LayerParameter", "swish_param", 147), ("LayerParameter", "window_data_param", 129),
    ("LayerParameter", "propagate_down", 11), ("LayerParameter", "phase", 10),
    ("BlobProto", "shape", 7), ("BlobProto", "data", 5), ("BlobProto", "double_data", 8),
    ("BlobProto", "num", 1), ("Datum", "encoded", 7), ("Datum", "float_data", 6),
    ("SolverState", "history", 3), ("SolverParameter", "weights", 42),
    ("SolverParameter", "layer_wise_reduce", 41), ("SolverParameter", "type", 40),
    ("ConvolutionParameter", "dilation", 18), ("PoolingParameter", "round_mode", 13),
    ("V1LayerParameter", "layer", 1), ("V1LayerParameter", "param", 1001),
    ("V1LayerParameter", "loss_param", 42), ("V0LayerParameter", "hdf5_output_param", 1001),
    ("InfogainLossParameter", "axis", 2), ("ImageDataParameter", "root_folder", 12),
])
def test_field_numbers(message, field, number):
    assert getattr(caffe_pb2, message).DESCRIPTOR.fields_by_name[field].number == number


LAYER_PARAMS = """transform_param loss_param accuracy_param argmax_param batch_norm_param
bias_param clip_param concat_param contrastive_loss_param convolution_param crop_param
data_param dropout_param dummy_data_param eltwise_param elu_param embed_param exp_param
flatten_param hdf5_data_param hdf5_output_param hinge_loss_param image_data_param
infogain_loss_param inner_product_param input_param log_param lrn_param memory_data_param
mvn_param parameter_param pooling_param power_param prelu_param python_param recurrent_param
reduction_param relu_param reshape_param scale_param sigmoid_param softmax_param spp_param
slice_param swish_param tanh_param threshold_param tile_param window_data_param""".split()


def test_layer_parameter_has_every_caffe_param():
    fields = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    assert [p for p in LAYER_PARAMS if p not in fields] == []
    numbers = [f.number for f in caffe_pb2.LayerParameter.DESCRIPTOR.fields]
    assert len(numbers) == len(set(numbers)) == 11 + len(LAYER_PARAMS)


def test_defaults_and_enums():
    assert caffe_pb2.FillerParameter().type == "constant"
    assert caffe_pb2.FillerParameter().sparse == -1
    assert caffe_pb2.NetState().phase == caffe_pb2.TEST
    assert caffe_pb2.DataParameter().backend == caffe_pb2.DataParameter.LEVELDB
    assert caffe_pb2.PoolingParameter().round_mode == caffe_pb2.PoolingParameter.CEIL
    assert caffe_pb2.LossParameter().normalization == caffe_pb2.LossParameter.VALID
    assert caffe_pb2.BatchNormParameter().moving_average_fraction == pytest.approx(0.999)
    sp = caffe_pb2.SolverParameter()
    assert (sp.type, sp.solver_mode, sp.random_seed) == ("SGD", caffe_pb2.SolverParameter.GPU, -1)
    assert sp.snapshot_format == caffe_pb2.SolverParameter.BINARYPROTO
    assert caffe_pb2.V1LayerParameter.SOFTMAX_LOSS == 21
    assert caffe_pb2.V1LayerParameter.DECONVOLUTION == 39
    assert not caffe_pb2.BatchNormParameter().HasField("use_global_stats")


def test_packed_fields_encode_packed():
    # BlobShape.dim is packed: one tag 0x0a, a length, then the varints.
    assert caffe_pb2.BlobShape(dim=[1, 300]).SerializeToString() == b"\x0a\x03\x01\xac\x02"
    # Datum.float_data is *not* packed in Caffe: one tag (0x35) per value.
    assert caffe_pb2.Datum(float_data=[1.0, 2.0]).SerializeToString() == \
        b"\x35\x00\x00\x80\x3f\x35\x00\x00\x00\x40"
