"""A small fluent helper that appends Caffe LayerParameter messages to a NetParameter.

Every model family in this package is written with it, so the definitions in ``prototxt/`` are
generated from code rather than copied. Each layer method appends one ``caffe.LayerParameter`` and
returns the name of its top blob, so graphs compose as ordinary expressions::

    from poseidon.models.builder import NetBuilder
    n = NetBuilder("tiny")
    x = n.input("data", (64, 3, 32, 32))
    x = n.conv("conv1", x, 32, 5, pad=2)
    x = n.relu("relu1", x)
    x = n.fc("ip1", x, 10)
    n.softmax_loss("loss", x, "label")
    print(n.to_text())

Conventions (those of the BVLC reference models):

* Convolution / InnerProduct carry two ``param`` specs, weights ``lr_mult 1 decay_mult 1`` and bias
  ``lr_mult 2 decay_mult 0``; a layer without bias carries only the first. With
  ``decay_mults=False`` (Caffe's cifar10 files) only the lr_mults 1 and 2 are written.
* ReLU, Dropout, BatchNorm and Scale run in place (top == bottom).
* ``data`` layers set ``backend: LMDB`` explicitly (Caffe's default is LEVELDB) and an include rule
  for the phase they serve.
"""

from google.protobuf import text_format

from poseidon.engine.proto import caffe_pb2

TRAIN = caffe_pb2.TRAIN
TEST = caffe_pb2.TEST

_POOL = {"MAX": caffe_pb2.PoolingParameter.MAX, "AVE": caffe_pb2.PoolingParameter.AVE}
_ELTWISE = {"PROD": caffe_pb2.EltwiseParameter.PROD, "SUM": caffe_pb2.EltwiseParameter.SUM,
            "MAX": caffe_pb2.EltwiseParameter.MAX}


def _pair(v):
    """An int or an (h, w) pair as (h, w)."""
    if isinstance(v, (tuple, list)):
        h, w = v
        return int(h), int(w)
    return int(v), int(v)


def _filler(msg, spec):
    """Fill a FillerParameter from a dict such as {"type": "gaussian", "std": 0.01}."""
    for key, value in spec.items():
        setattr(msg, key, value)


class NetBuilder:
    """Builds one ``caffe.NetParameter``; every layer method returns its top blob's name."""

    def __init__(self, name, decay_mults=True):
        """``decay_mults=False`` writes only lr_mult in the param specs (Caffe's cifar10 files)."""
        self.net = caffe_pb2.NetParameter(name=name)
        self.decay_mults = decay_mults

    # -- generic -------------------------------------------------------------------------------
    def layer(self, name, type_, bottoms=(), tops=None, phase=None):
        """Append a bare layer (tops default to [name]) and return the message for further edits."""
        lp = self.net.layer.add(name=name, type=type_)
        lp.bottom.extend([bottoms] if isinstance(bottoms, str) else list(bottoms))
        lp.top.extend([name] if tops is None else ([tops] if isinstance(tops, str) else list(tops)))
        if phase is not None:
            lp.include.add(phase=phase)
        return lp

    def _lr(self, lp, bias):
        if self.decay_mults:
            lp.param.add(lr_mult=1, decay_mult=1)
            if bias:
                lp.param.add(lr_mult=2, decay_mult=0)
        else:
            lp.param.add(lr_mult=1)
            if bias:
                lp.param.add(lr_mult=2)

    def to_text(self):
        return text_format.MessageToString(self.net)

    # -- inputs --------------------------------------------------------------------------------
    def input(self, name, shape):
        """Input layer with one top ``name`` of the given shape (e.g. (N, 3, H, W) or (N,))."""
        lp = self.layer(name, "Input")
        lp.input_param.shape.add(dim=list(shape))
        return name

    def data(self, source, batch_size, phase, name="data", tops=("data", "label"), scale=None,
             mean_value=None, mean_file=None, crop_size=None, mirror=None):
        """Data layer reading an LMDB (backend set explicitly) for one phase."""
        lp = self.layer(name, "Data", tops=tops, phase=phase)
        tp = lp.transform_param
        if mirror is not None:
            tp.mirror = mirror
        if crop_size is not None:
            tp.crop_size = crop_size
        if scale is not None:
            tp.scale = scale
        if mean_file is not None:
            tp.mean_file = mean_file
        if mean_value is not None:
            tp.mean_value.extend(mean_value)
        lp.data_param.source = source
        lp.data_param.batch_size = batch_size
        lp.data_param.backend = caffe_pb2.DataParameter.LMDB
        return tops[0]

    # -- learnable layers ----------------------------------------------------------------------
    def conv(self, name, bottom, num_output, kernel, stride=1, pad=0, group=1, bias=True,
             weight_filler=None, bias_filler=None, top=None):
        """Convolution; ``kernel`` and ``pad`` may be ints or (h, w) pairs (e.g. 1x7)."""
        lp = self.layer(name, "Convolution", bottom, top or name)
        self._lr(lp, bias)
        cp = lp.convolution_param
        cp.num_output = num_output
        if not bias:
            cp.bias_term = False
        kh, kw = _pair(kernel)
        ph, pw = _pair(pad)
        if kh == kw:
            cp.kernel_size.append(kh)
        else:
            cp.kernel_h, cp.kernel_w = kh, kw
        if ph == pw:
            if ph:
                cp.pad.append(ph)
        else:
            cp.pad_h, cp.pad_w = ph, pw
        if stride != 1:
            cp.stride.append(stride)
        if group != 1:
            cp.group = group
        if weight_filler:
            _filler(cp.weight_filler, weight_filler)
        if bias and bias_filler:
            _filler(cp.bias_filler, bias_filler)
        return top or name

    def fc(self, name, bottom, num_output, weight_filler=None, bias_filler=None, top=None):
        """InnerProduct with bias."""
        lp = self.layer(name, "InnerProduct", bottom, top or name)
        self._lr(lp, True)
        ip = lp.inner_product_param
        ip.num_output = num_output
        if weight_filler:
            _filler(ip.weight_filler, weight_filler)
        if bias_filler:
            _filler(ip.bias_filler, bias_filler)
        return top or name

    def bn_scale(self, bn_name, scale_name, bottom, use_global_stats=None, eps=None,
                 freeze_stats=False):
        """BatchNorm then Scale(bias_term: true), both in place on ``bottom``.

        ``use_global_stats`` is written only when given (Caffe then picks it from the phase);
        ``freeze_stats`` adds three ``lr_mult: 0 decay_mult: 0`` specs for the stored statistics.
        """
        lp = self.layer(bn_name, "BatchNorm", bottom, bottom)
        if freeze_stats:
            for _ in range(3):
                lp.param.add(lr_mult=0, decay_mult=0)
        bp = lp.batch_norm_param
        if use_global_stats is not None:
            bp.use_global_stats = use_global_stats
        if eps is not None:
            bp.eps = eps
        sp = self.layer(scale_name, "Scale", bottom, bottom)
        sp.scale_param.bias_term = True
        return bottom

    # -- parameter-free layers -----------------------------------------------------------------
    def relu(self, name, bottom):
        self.layer(name, "ReLU", bottom, bottom)
        return bottom

    def dropout(self, name, bottom, ratio):
        lp = self.layer(name, "Dropout", bottom, bottom)
        lp.dropout_param.dropout_ratio = ratio
        return bottom

    def pool(self, name, bottom, method, kernel=None, stride=1, pad=0, global_pooling=False,
             top=None):
        """Pooling, ``method`` "MAX" or "AVE"; Caffe rounds the output size up (ceil)."""
        lp = self.layer(name, "Pooling", bottom, top or name)
        pp = lp.pooling_param
        pp.pool = _POOL[method]
        if global_pooling:
            pp.global_pooling = True
        else:
            pp.kernel_size = kernel
            if stride != 1:
                pp.stride = stride
        if pad:
            pp.pad = pad
        return top or name

    def lrn(self, name, bottom, local_size=5, alpha=0.0001, beta=0.75, top=None):
        lp = self.layer(name, "LRN", bottom, top or name)
        lp.lrn_param.local_size = local_size
        lp.lrn_param.alpha = alpha
        lp.lrn_param.beta = beta
        return top or name

    def concat(self, name, bottoms, top=None):
        self.layer(name, "Concat", bottoms, top or name)
        return top or name

    def eltwise(self, name, bottoms, op="SUM", top=None):
        lp = self.layer(name, "Eltwise", bottoms, top or name)
        if op != "SUM":
            lp.eltwise_param.operation = _ELTWISE[op]
        return top or name

    # -- heads ---------------------------------------------------------------------------------
    def softmax(self, name, bottom):
        self.layer(name, "Softmax", bottom)
        return name

    def softmax_loss(self, name, bottom, label="label", loss_weight=None, top=None):
        lp = self.layer(name, "SoftmaxWithLoss", [bottom, label], top or name)
        if loss_weight is not None:
            lp.loss_weight.append(loss_weight)
        return top or name

    def accuracy(self, name, bottom, label="label", top_k=None, phase=TEST, top=None):
        """Accuracy (TEST phase by default); ``top_k`` 5 for the ImageNet top-5 figure."""
        lp = self.layer(name, "Accuracy", [bottom, label], top or name, phase=phase)
        if top_k is not None:
            lp.accuracy_param.top_k = top_k
        return top or name

    # -- common heads and tails of the model families ------------------------------------------
    def data_pair(self, dataset, train_batch, test_batch, **transform):
        """TRAIN and TEST Data layers reading data/<dataset>/train and data/<dataset>/test.

        ``transform`` holds transform_param settings; ``mirror`` applies to TRAIN only (TEST gets
        ``mirror: false`` whenever TRAIN mirrors, as in the BVLC files).
        """
        mirror = transform.pop("mirror", None)
        self.data(f"data/{dataset}/train", train_batch, TRAIN, mirror=mirror, **transform)
        self.data(f"data/{dataset}/test", test_batch, TEST,
                  mirror=(False if mirror else None), **transform)
        return "data"

    def classifier_tail(self, logits, deploy, top5=True, prefix=""):
        """deploy: Softmax "prob"; train_val: SoftmaxWithLoss + TEST Accuracy (and top-5)."""
        if deploy:
            return self.softmax("prob", logits)
        self.softmax_loss(prefix + "loss", logits)
        self.accuracy(prefix + "accuracy", logits)
        if top5:
            self.accuracy(prefix + "accuracy_top5", logits, top_k=5)
        return prefix + "loss"
