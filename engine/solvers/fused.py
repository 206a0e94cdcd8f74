"""Each update rule as one CUDA kernel over a flat range of parameters (the CuPy path of rules.py).

Why: the numpy rule is a handful of in-place ufuncs per parameter; on a GPU each is a kernel
launch and a pass over the parameter in device memory (about nine per parameter blob for
Nesterov or Adam). Here one `cupy.ElementwiseKernel` per rule reads the value, the gradient and
the history once and writes the value and history once, for any number of parameters: each
element finds its parameter's lr_mult and decay_mult by a binary search of the slice offsets
(`SliceMults`, a few dozen entries, held in cache), so a whole layer or the whole net is one
launch.

The rate, the gradient scale and the rule's constants are 0-d device arrays: a rate that changes
every iteration is one small fill, never a recompilation or a read back to the host, and a
gradient scale computed on the device (clip_gradients' factor) is passed as it is.

The kernel bodies are plain strings (`kernel_parts`), so a test can wrap them in a __global__
function and compile them with nvcc where CuPy is absent (`ptx_source`). The arithmetic follows
rules.py operation by operation, in the parameter's dtype.
"""
import functools

import numpy

from .. import backend

# Per element: find the slice (binary search of `off`), then the scaled, regularised gradient `gr`
# and the local rate `lr` (Caffe's local_rate = rate * lr_mult).
_PROLOGUE = """
int lo_ = 0;
int hi_ = nslices - 1;
while (lo_ < hi_) {
  int mid_ = (lo_ + hi_ + 1) >> 1;
  if (off[mid_] <= (long long)i) lo_ = mid_; else hi_ = mid_ - 1;
}
const T local_decay = weight_decay * decay_mult[lo_];
const T lr = rate * lr_mult[lo_];
T gr = g * scale;
"""
_REGULARIZE = {   # skipped at zero decay, as rules.py does (0 * inf would be NaN)
    "L2": "if (local_decay != (T)0) gr = gr + local_decay * w;\n",
    "L1": "if (local_decay != (T)0) gr = gr + local_decay * (T)((w > (T)0) - (w < (T)0));\n",
}

# (rule constants beyond weight_decay, history names, body): the body reads gr, lr and the
# constants, and updates w and the history in place; the comments give rules.py's formulas.
_RULES = {
    "SGD": (("momentum",), ("h",), """
const T hn = momentum * h + lr * gr;        // h = momentum*h + lr*g
h = hn;
w = w - hn;
"""),
    "Nesterov": (("momentum",), ("h",), """
const T hn = momentum * h + lr * gr;        // h = momentum*h_old + lr*g
const T u = -momentum * h + ((T)1 + momentum) * hn;   // (1+m)*h - m*h_old
h = hn;
w = w - u;
"""),
    "AdaGrad": (("delta",), ("h",), """
const T hn = h + gr * gr;                   // h += g^2
h = hn;
w = w - (gr / (sqrt(hn) + delta)) * lr;
"""),
    "RMSProp": (("delta", "rms_decay"), ("h",), """
const T hn = h * rms_decay + (gr * gr) * ((T)1 - rms_decay);
h = hn;
w = w - (gr / (sqrt(hn) + delta)) * lr;
"""),
    "AdaDelta": (("delta", "momentum"), ("hg", "hu"), """
const T hgn = hg * momentum + (gr * gr) * ((T)1 - momentum);
const T u = gr * sqrt((hu + delta) / (hgn + delta));
hg = hgn;
hu = hu * momentum + (u * u) * ((T)1 - momentum);
w = w - u * lr;
"""),
    "Adam": (("delta", "momentum", "momentum2", "correction"), ("m", "v"), """
const T mn = m * momentum + gr * ((T)1 - momentum);
const T vn = v * momentum2 + (gr * gr) * ((T)1 - momentum2);
m = mn;
v = vn;
w = w - (mn / (sqrt(vn) + delta)) * (lr * correction);
"""),
}


def rule_names():
    return sorted(_RULES)


def kernel_parts(rule_type, regularization="L2"):
    """(in_params, out_params, body, constants) of the kernel for a rule, in ElementwiseKernel's
    notation: the constants are the rule's scalars after rate, scale and weight_decay."""
    constants, history, body = _RULES[rule_type]
    scalars = ("rate", "scale", "weight_decay") + constants
    in_params = ", ".join(["T g", "raw int64 off", "raw T lr_mult", "raw T decay_mult",
                           "int32 nslices"] + [f"T {name}" for name in scalars])
    out_params = ", ".join(f"T {name}" for name in ("w",) + history)
    return in_params, out_params, _PROLOGUE + _REGULARIZE[regularization] + body, constants


def ptx_source(rule_type, regularization="L2", ctype="float", host=False):
    """The kernel body wrapped in a plain C function, for compiling without CuPy: a __global__
    function (one thread per element) for `nvcc --ptx`, or with `host` a loop over the elements
    that a C++ compiler builds for the CPU (so a test can run the body's arithmetic against the
    numpy rule where there is no GPU). The body must be valid CUDA C++ as written."""
    constants, history, _ = _RULES[rule_type]
    _, _, body, _ = kernel_parts(rule_type, regularization)
    scalars = ("rate", "scale", "weight_decay") + constants
    args = (["const T* g_", "const long long* off", "const T* lr_mult", "const T* decay_mult",
             "int nslices"] + [f"const T* {name}_" for name in scalars]
            + [f"T* {name}_" for name in ("w",) + history] + ["long long n"])
    refs = "\n".join([f"  const T {name} = {name}_[0];" for name in scalars]
                     + ["  const T g = g_[i];"]
                     + [f"  T& {name} = {name}_[i];" for name in ("w",) + history])
    name = f"{rule_type}_{regularization}_{ctype}".lower()
    if host:
        head = (f"void update_{name}({', '.join(args)}) {{\n"
                f"  for (long long i = 0; i < n; ++i) {{\n")
        tail = "}}\n"
    else:
        head = (f"__global__ void update_{name}({', '.join(args)}) {{\n"
                f"  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
                f"  if (i >= n) return;\n")
        tail = "}\n"
    return (f"namespace {name} {{\ntypedef {ctype} T;\n"   # several in one file, each its own T
            f"{'using std::sqrt;' if host else ''}\nextern \"C\" {head}{refs}\n{body}{tail}}}\n")


@functools.lru_cache(maxsize=None)
def _kernel(rule_type, regularization):
    in_params, out_params, body, _ = kernel_parts(rule_type, regularization)
    return backend.cupy.ElementwiseKernel(
        in_params, out_params, body, f"poseidon_{rule_type.lower()}_{regularization.lower()}")


class DeviceScalars:
    """0-d device arrays of the rule's scalars, one set per device and dtype, refilled only when
    a value changes (a fill is queued on the stream, so the host never waits)."""

    def __init__(self):
        self._sets = {}

    def get(self, like, values):
        device = getattr(like, "device", None)
        # one set per stream: a fill is ordered before the later kernels of its own stream only
        stream = backend.cupy.cuda.get_current_stream().ptr
        key = (getattr(device, "id", device), like.dtype.str, stream)
        held = self._sets.setdefault(key, {})
        xp = backend.get_array_module(like)
        out = []
        for name, value in values:
            if not isinstance(value, (int, float, numpy.floating, numpy.integer)):
                # already a device scalar (e.g. a clip factor computed on the device)
                out.append(value if value.dtype == like.dtype else value.astype(like.dtype))
                continue
            entry = held.get(name)
            if entry is None:
                entry = held[name] = [xp.zeros((), like.dtype), None]
            if entry[1] != float(value):
                entry[0].fill(like.dtype.type(value))
                entry[1] = float(value)
            out.append(entry[0])
        return out


def apply(rule, value, grad, state, mults, grad_scale, rate, constants, scalars):
    """One launch of the rule's kernel over `value`, `grad` and `state` (arrays of one shape; the
    gradient is only read), with per-slice multipliers `mults` (engine/flat_params.SliceMults).
    `constants`: {name: value} of the rule's own scalars; `scalars`: the rule's DeviceScalars."""
    xp = backend.get_array_module(value)
    device = getattr(value, "device", None)
    off, lr_mult, decay_mult = mults.on_device(xp, value.dtype, getattr(device, "id", device))
    names = _RULES[rule.type][0]
    values = [("rate", rate), ("scale", grad_scale), ("weight_decay", rule.weight_decay)]
    values += [(name, constants[name]) for name in names]
    kernel = _kernel(rule.type, rule.regularization if rule.weight_decay else "L2")
    kernel(grad, off, lr_mult, decay_mult, numpy.int32(len(mults.lr_mult)),
           *scalars.get(value, values), value, *state)
