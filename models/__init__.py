"""Model definitions generated from code: builders for every net in prototxt/.

``MODELS`` maps each folder name under prototxt/ to a :class:`Model`: the module that builds it, a
``build(deploy)`` returning a ``caffe.NetParameter`` and a ``solver()`` returning a
``caffe.SolverParameter``. ``python -m poseidon.models.write_all`` writes them all (see models/write_all.py);
edit the builders, never the generated files.

    from poseidon.models import MODELS
    net = MODELS["vgg19_22k"].build(deploy=True)
"""

from dataclasses import dataclass
from functools import partial
from typing import Callable

from poseidon.models import alexnet, cifar, fc_heavy, googlenet, inception_v3, resnet, solvers, vgg


@dataclass(frozen=True)
class Model:
    name: str          # folder under prototxt/
    module: str        # source file that builds it, for the header of the generated files
    build: Callable    # build(deploy: bool, **builder options) -> caffe_pb2.NetParameter
    solver: Callable   # solver() -> caffe_pb2.SolverParameter


def _model(name, module, fn):
    return Model(name, f"models/{module.__name__.rsplit('.', 1)[-1]}.py",
                 lambda deploy=False, **options: fn(deploy=deploy, **options),
                 getattr(solvers, name))


MODELS = {m.name: m for m in (
    _model("cifar10_quick", cifar, cifar.cifar10_quick),
    _model("digits_quick", cifar, cifar.digits_quick),
    _model("alexnet", alexnet, alexnet.alexnet),
    _model("vgg19", vgg, vgg.vgg19),
    _model("vgg19_22k", vgg, vgg.vgg19_22k),
    _model("googlenet", googlenet, googlenet.googlenet),
    _model("inception_v3", inception_v3, inception_v3.inception_v3),
    _model("resnet50", resnet, partial(resnet.resnet, 50)),
    _model("resnet101", resnet, partial(resnet.resnet, 101)),
    _model("resnet152", resnet, partial(resnet.resnet, 152)),
    _model("fc_heavy", fc_heavy, fc_heavy.fc_heavy),
)}

__all__ = ["MODELS", "Model"]
