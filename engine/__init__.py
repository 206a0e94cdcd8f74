"""Poseidon's layer engine: Caffe's model files, layers, nets and solvers on numpy or CuPy.

Its top level reads like pycaffe, so a pycaffe script needs only its import changed:

    from poseidon import engine as caffe
    caffe.set_mode_cpu()                     # or caffe.set_device(0); caffe.set_mode_gpu()
    net = caffe.Net("deploy.prototxt", caffe.TEST, weights="w.caffemodel")
    out = net.forward(data=images)
    solver = caffe.get_solver("solver.prototxt")     # or caffe.SGDSolver(...), caffe.AdamSolver(...)
    solver.step(100)
"""
from functools import partial

from . import io  # noqa: F401
from .backend import set_device, set_mode_cpu, set_mode_gpu  # noqa: F401
from .blob import Blob  # noqa: F401
from .errors import PoseidonError, ModelError, LayerError, DataError  # noqa: F401
from .factory import registered_types  # noqa: F401
from .layer import TRAIN, TEST, Layer  # noqa: F401
from .registry import register  # noqa: F401
from .net import Net  # noqa: F401
from .solvers import Solver, get_solver  # noqa: F401

SGDSolver = partial(Solver, solver_type="SGD")
NesterovSolver = partial(Solver, solver_type="Nesterov")
AdaGradSolver = partial(Solver, solver_type="AdaGrad")
RMSPropSolver = partial(Solver, solver_type="RMSProp")
AdaDeltaSolver = partial(Solver, solver_type="AdaDelta")
AdamSolver = partial(Solver, solver_type="Adam")
