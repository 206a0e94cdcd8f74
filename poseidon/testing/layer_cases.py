"""One small case of each layer type, run forward and backward on an array module, so a GPU's
results can be compared with numpy's (tests/engine/test_gpu.py, the bench's GPU probe)."""
import numpy as np
from google.protobuf import text_format

from poseidon.engine import TRAIN, backend
from poseidon.engine.blob import Blob
from poseidon.engine.factory import create_layer
from poseidon.engine.proto import caffe_pb2


def layer_param(text):
    """A LayerParameter from prototxt text, e.g. 'type: "ReLU" relu_param { negative_slope: 0.1 }'."""
    param = caffe_pb2.LayerParameter()
    text_format.Parse(text, param)
    if not param.name:
        param.name = "under_test"
    return param


def make_layer(text, phase=TRAIN, dtype=np.float64, xp=np):
    return create_layer(layer_param(text), phase, dtype, xp)


def blobs_from(arrays, dtype=np.float64, xp=np):
    blobs = []
    for a in arrays:
        b = Blob(np.shape(a), dtype, xp)
        b.data[...] = xp.asarray(a)
        blobs.append(b)
    return blobs


def run_forward(layer, bottom_arrays, n_tops=1, dtype=np.float64, xp=np):
    """Set up the layer on copies of the arrays and run forward; returns (bottom, top) blobs."""
    bottom = blobs_from(bottom_arrays, dtype, xp)
    top = [Blob((), dtype, xp) for _ in range(n_tops)]
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return bottom, top


CONFIGS = [
    ('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2 '
     'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } }', [(2, 3, 7, 7)], 1),
    ('type: "Convolution" convolution_param { num_output: 4 kernel_h: 3 kernel_w: 2 group: 2 dilation: 2 '
     'weight_filler { type: "gaussian" std: 0.5 } }', [(2, 4, 8, 8)], 1),
    ('type: "Deconvolution" convolution_param { num_output: 3 kernel_size: 3 stride: 2 pad: 1 '
     'weight_filler { type: "gaussian" std: 0.5 } }', [(2, 2, 4, 4)], 1),
    ('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }', [(2, 3, 7, 7)], 1),
    ('type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }', [(2, 3, 7, 7)], 1),
    ('type: "Pooling" pooling_param { pool: AVE global_pooling: true }', [(2, 3, 5, 5)], 1),
    ('type: "InnerProduct" inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 } '
     'bias_filler { type: "gaussian" std: 0.5 } }', [(3, 2, 2, 2)], 1),
    ('type: "InnerProduct" inner_product_param { num_output: 5 transpose: true '
     'weight_filler { type: "gaussian" std: 0.5 } }', [(3, 6)], 1),
    ('type: "ReLU" relu_param { negative_slope: 0.1 }', [(2, 3, 4)], 1),
    ('type: "Sigmoid"', [(2, 5)], 1),
    ('type: "TanH"', [(2, 5)], 1),
    ('type: "PReLU"', [(2, 3, 2, 2)], 1),
    ('type: "LRN" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 }', [(2, 5, 3, 3)], 1),
    ('type: "LRN" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL }', [(2, 2, 5, 5)], 1),
    ('type: "BatchNorm" batch_norm_param { use_global_stats: false }', [(4, 3, 2, 2)], 1),
    ('type: "Scale" scale_param { bias_term: true filler { type: "gaussian" std: 0.5 } '
     'bias_filler { type: "gaussian" std: 0.5 } }', [(2, 3, 2, 2)], 1),
    ('type: "Bias" bias_param { filler { type: "gaussian" std: 0.5 } }', [(2, 3, 2)], 1),
    ('type: "Softmax"', [(3, 4)], 1),
    ('type: "Concat"', [(2, 3, 2), (2, 1, 2)], 1),
    ('type: "Slice" slice_param { slice_point: 1 }', [(2, 3, 2)], 2),
    ('type: "Eltwise" eltwise_param { operation: SUM coeff: 0.5 coeff: -2 }', [(2, 3), (2, 3)], 1),
    ('type: "Eltwise" eltwise_param { operation: PROD }', [(2, 3), (2, 3)], 1),
    ('type: "Eltwise" eltwise_param { operation: MAX }', [(2, 3), (2, 3)], 1),
    ('type: "Flatten"', [(2, 3, 2)], 1),
    ('type: "Reshape" reshape_param { shape { dim: 0 dim: -1 } }', [(2, 3, 2)], 1),
    ('type: "Crop" crop_param { axis: 2 offset: 1 }', [(2, 2, 5, 5), (2, 2, 3, 3)], 1),
    ('type: "Split"', [(2, 3)], 2),
    ('type: "EuclideanLoss"', [(3, 4), (3, 4)], 1),
    ('type: "SoftmaxWithLoss"', [(4, 5), (4,)], 1),
    ('type: "SoftmaxWithLoss" loss_param { ignore_label: 2 normalization: BATCH_SIZE }',
     [(3, 4, 2, 2), (3, 1, 2, 2)], 1),
    # shapes large enough for the batch-wide blocks and several window rows a call
    ('type: "Convolution" convolution_param { num_output: 32 kernel_size: 5 pad: 2 '
     'weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "gaussian" std: 0.1 } }',
     [(4, 3, 32, 32)], 1),
    ('type: "Convolution" convolution_param { num_output: 16 kernel_size: 3 pad: 1 group: 2 '
     'weight_filler { type: "gaussian" std: 0.1 } }', [(3, 8, 12, 12)], 1),
    ('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }', [(4, 8, 16, 16)], 1),
    ('type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 }', [(4, 8, 15, 15)], 1),
    ('type: "LRN" lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 }', [(2, 16, 8, 8)], 1),
    ('type: "InnerProduct" inner_product_param { num_output: 64 '
     'weight_filler { type: "gaussian" std: 0.1 } }', [(8, 32, 4, 4)], 1),
]

# layers whose label input takes no gradient; its values are class indices
LABELLED = ("SoftmaxWithLoss",)


def labelled(text):
    return any(t in text for t in LABELLED)


def run_case(text, arrays, n_tops, xp, params=None, top_diffs=None):
    propagate = [True] * len(arrays)
    if labelled(text):
        propagate[-1] = False
    from poseidon.engine import rng
    rng.seed(7)
    layer = make_layer(text, TRAIN, np.float64, xp)
    bottom, top = run_forward(layer, arrays, n_tops, np.float64, xp)
    if params is not None:
        for blob, value in zip(layer.blobs, params):
            blob.data[...] = xp.asarray(value)
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
    for t, d in zip(top, top_diffs or []):
        t.diff[...] = xp.asarray(d)
    for p in layer.blobs:
        p.diff[...] = 0
    layer.backward(top, propagate, bottom)
    as_np = backend.to_numpy
    return ([as_np(t.data) for t in top],
            [as_np(b.diff) for b, down in zip(bottom, propagate) if down],
            [as_np(p.data) for p in layer.blobs], [as_np(p.diff) for p in layer.blobs])
