"""Poseidon-py's layer engine: Caffe's model files, layers, nets and solvers on numpy or CuPy."""
from .layer import TRAIN, TEST, Layer, register, registered_types  # noqa: F401
from .blob import Blob  # noqa: F401
from .errors import PoseidonError, ModelError, LayerError, DataError  # noqa: F401
from .backend import set_mode_cpu, set_mode_gpu  # noqa: F401
