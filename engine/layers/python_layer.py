"""Layers written in Python by the user: two routes.

1. Caffe's `type: "Python"` (pycaffe style), for existing Caffe models and code::

       layer { name: "mine" type: "Python" bottom: "data" top: "out"
               python_param { module: "my_layers" layer: "MyLayer" param_str: "3.5" } }

   `my_layers` must be importable (its directory on sys.path / PYTHONPATH, as with Caffe). The
   class derives from `engine.Layer` (where pycaffe code says `caffe.Layer`) and implements pycaffe's
   four methods::

       from poseidon import engine

       class MyLayer(engine.Layer):
           exact_bottoms = 1                     # optional blob-count declarations, checked first
           def setup(self, bottom, top):         # once; self.param_str and self.phase are set
               self.factor = float(self.param_str)
               self.blobs.add_blob(3)            # learnable blob (pycaffe's call), or add_param()
           def reshape(self, bottom, top):       # before every forward
               top[0].reshape(*bottom[0].shape)
           def forward(self, bottom, top):
               top[0].data[...] = self.factor * bottom[0].data
           def backward(self, top, propagate_down, bottom):
               if propagate_down[0]:
                   bottom[0].diff[...] = self.factor * top[0].diff

   The layer object the net holds *is* an instance of that class (with `type == "Python"`), so
   `net.layers[i]` reaches its attributes as in pycaffe. Its `setup` is the one-time set-up, and is
   run wrapped in the base class's checks: blob counts first, then the class's `setup`, `reshape`,
   and the loss weights. A class that instead overrides `layer_setup` (route 2's style) works too.
   As in Caffe a Python layer is not a loss layer: give `loss_weight: 1` for a loss top. Blob arrays
   are numpy arrays on the CPU and CuPy arrays on the GPU: use `self.xp` for one code path (Caffe
   runs Python layers on the CPU only). Do not override `__init__`, or accept and pass on its
   arguments `(param, phase, dtype, xp)`.

2. Register a type of your own, with the engine's contract (see engine/layer.py)::

       from poseidon import engine

       @engine.register("MyType")
       class MyType(engine.Layer):
           exact_bottoms = 1
           def layer_setup(self, bottom, top): ...   # read self.param, add_param(...)
           def reshape(self, bottom, top): ...
           def forward(self, bottom, top): ...
           def backward(self, top, propagate_down, bottom): ...

   and write `type: "MyType"` in the prototxt; the module must be imported before the net is built.
"""
import importlib
import inspect
import sys
import types

from ..errors import LayerError
from ..layer import Layer
from ..registry import register


class BlobVec(list):
    """`self.blobs` of a Python layer: a list of Blobs with pycaffe's `add_blob(*shape)`."""

    def __init__(self, layer, blobs=()):
        super().__init__(blobs)
        self._layer = layer

    def add_blob(self, *shape):
        """A new zero-filled learnable blob of this shape (returned; pycaffe returns None)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        blob = self._layer.new_blob(tuple(int(s) for s in shape))
        self.append(blob)
        return blob


def _python_setup(self, bottom, top):
    """Setup for a Python layer: the base class's checks around the class's own `setup`."""
    cls_setup = type(self).setup
    if cls_setup is Layer.setup:
        Layer.setup(self, bottom, top)  # engine-style class: layer_setup and the rest
        return
    self._check_counts(bottom, top)
    cls_setup(self, bottom, top)
    self.reshape(bottom, top)
    self._set_loss_weights(top)
    if not isinstance(self.param_propagate_down, list):
        self.param_propagate_down = list(self.param_propagate_down)
    while len(self.param_propagate_down) < len(self.blobs):
        self.param_propagate_down.append(True)


def _import_module(where, name):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing == name or name.startswith(missing + "."):
            shown = [p or "(current directory)" for p in sys.path[:6]]
            more = f", ... ({len(sys.path)} entries)" if len(sys.path) > 6 else ""
            raise LayerError(where, f"python_param module '{name}' cannot be imported: no such "
                                    f"module on sys.path. Put the directory holding "
                                    f"{name.replace('.', '/')}.py on PYTHONPATH (or sys.path), or "
                                    f"fix the name. sys.path: {', '.join(shown)}{more}") from e
        raise LayerError(where, f"importing python_param module '{name}' failed: it needs module "
                                f"'{missing}', which is not installed ({e})") from e
    except Exception as e:
        raise LayerError(where, f"importing python_param module '{name}' failed: "
                                f"{type(e).__name__}: {e}") from e


@register("Python")
class PythonLayer(Layer):
    """Factory for `type: "Python"`: constructing it returns an instance of the user's class."""

    def __new__(cls, param, phase=0, dtype=None, xp=None):
        import numpy
        dtype = numpy.float32 if dtype is None else dtype
        xp = numpy if xp is None else xp
        where = types.SimpleNamespace(name=param.name, type="Python")
        pp = param.python_param
        if not pp.module:
            raise LayerError(where, "python_param { module } is missing: name the Python module "
                                    "that defines the layer class")
        if not pp.layer:
            raise LayerError(where, f"python_param {{ layer }} is missing: name the class in module "
                                    f"'{pp.module}'")
        module = _import_module(where, pp.module)
        user_cls = getattr(module, pp.layer, None)
        origin = getattr(module, "__file__", None) or pp.module
        if user_cls is None:
            found = sorted(n for n, v in vars(module).items()
                           if inspect.isclass(v) and issubclass(v, Layer) and v is not Layer)
            hint = f"; its Layer classes: {', '.join(found)}" if found else \
                "; it defines no engine.Layer subclass"
            raise LayerError(where, f"module '{pp.module}' ({origin}) has no class "
                                    f"'{pp.layer}'{hint}")
        if not (inspect.isclass(user_cls) and issubclass(user_cls, Layer)):
            raise LayerError(where, f"'{pp.module}.{pp.layer}' is not a subclass of engine.Layer: "
                                    f"derive it from engine.Layer (where pycaffe code uses "
                                    f"caffe.Layer)")
        try:
            layer = user_cls(param, phase, dtype, xp)
        except LayerError:
            raise
        except Exception as e:
            raise LayerError(where, f"creating '{pp.module}.{pp.layer}' failed ({type(e).__name__}: "
                                    f"{e}); a Python layer's __init__, if it has one, must accept "
                                    f"(param, phase, dtype, xp) and call super().__init__ "
                                    f"with them") from e
        if not hasattr(layer, "blobs"):
            raise LayerError(where, f"'{pp.module}.{pp.layer}.__init__' does not call "
                                    f"super().__init__(param, phase, dtype, xp)")
        layer.type = "Python"
        layer.holds_param_arrays = True
        layer.blobs = BlobVec(layer, layer.blobs)
        # Caffe sets these right before calling the class's setup.
        layer.param_str = pp.param_str
        layer.phase = int(phase)
        layer.setup = types.MethodType(_python_setup, layer)
        return layer
