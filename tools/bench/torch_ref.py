"""PyTorch CPU reference: the same architecture as a bench net, built from its NetParameter, so the
two sides cannot drift apart. A benchmark-only reference: nothing in the engine imports torch.

Supported layer types are those of the bench nets (Input, Convolution, Pooling, ReLU, InnerProduct,
Dropout, SoftmaxWithLoss); Caffe's CEIL rounding of pooling is torch's ceil_mode=True. Training step:
zero_grad, forward, cross-entropy, backward, SGD (momentum, weight decay) step. `layer_times` times
each layer's modules alone on their real input (part b sets them beside the engine's layers).
"""
import time


def available():
    try:
        import torch  # noqa: F401
        return True, None
    except Exception as e:
        return False, f"torch is not importable ({type(e).__name__}: {e}); install the CPU build " \
                      f"(pip install torch) to get the PyTorch columns"


def set_precision(torch, tf32):
    """PyTorch CUDA's float32 math as the engine's: full FP32 unless `tf32` (cuDNN and cuBLAS
    then both may use TF32 tensor cores; PyTorch's own defaults differ between the two, so both
    are set). Returns 'tf32' or 'fp32' for the bench's output."""
    torch.backends.cudnn.allow_tf32 = bool(tf32)
    torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    return "tf32" if tf32 else "fp32"


class TorchNet:
    def __init__(self, bench_net, threads, device="cpu", tf32=False):
        import torch
        from torch import nn
        self.torch = torch
        self.device = device
        if device == "cpu":
            torch.set_num_threads(threads)
        else:
            self.precision = set_precision(torch, tf32)
        torch.manual_seed(0)
        layers, self.named = _modules(torch, bench_net.param)
        self.model = nn.Sequential(*layers).to(device)
        self.model.train()
        sol = bench_net.solver
        self.opt = torch.optim.SGD(self.model.parameters(), lr=sol["base_lr"],
                                   momentum=sol["momentum"], weight_decay=sol["weight_decay"])
        self.loss = nn.CrossEntropyLoss()
        self.x = None
        self.y = None

    def set_batch(self, data, label):
        torch = self.torch
        self.x = torch.from_numpy(data).to(self.device)
        self.y = torch.from_numpy(label.astype("int64")).to(self.device)

    def step(self, iterations=1):
        for _ in range(iterations):
            self.opt.zero_grad(set_to_none=False)
            loss = self.loss(self.model(self.x), self.y)
            loss.backward()
            self.opt.step()
        if self.device != "cpu":
            self.torch.cuda.synchronize()

    def layer_times(self, runs, iterations):
        """{engine layer name: ([forward ms per run], [backward ms per run])} on the CPU: each
        layer's modules timed alone on the input they get in the net, backward with a gradient of
        ones; the first layer's input (the data) needs no gradient, as in training. In-place
        ReLUs run out of place here (an in-place op on a leaf cannot be differentiated)."""
        torch = self.torch
        modules = list(self.model)
        inputs = []
        x = self.x
        with torch.no_grad():
            for _, first, count in self.named:
                inputs.append(x)
                for m in modules[first:first + count]:
                    x = m(x)
        out = {}
        for k, ((name, first, count), xin) in enumerate(zip(self.named, inputs)):
            mods = modules[first:first + count]
            inplace = [m for m in mods if getattr(m, "inplace", False)]
            for m in inplace:
                m.inplace = False
            fw, bw = [], []
            for run in range(runs + 1):          # run 0 warms up (allocations, first touches)
                f = b = 0.0
                for _ in range(iterations):
                    xi = xin.detach().requires_grad_(k > 0)
                    t0 = time.perf_counter()
                    y = xi
                    for m in mods:
                        y = m(y)
                    t1 = time.perf_counter()
                    grad = torch.ones_like(y)
                    t2 = time.perf_counter()
                    if y.requires_grad:
                        y.backward(grad)
                    f += t1 - t0
                    b += time.perf_counter() - t2
                if run:
                    fw.append(f / iterations * 1e3)
                    bw.append(b / iterations * 1e3)
            for m in inplace:
                m.inplace = True
            out[name] = (fw, bw)
        self.model.zero_grad(set_to_none=False)
        return out

    def timed(self, iterations):
        t = time.perf_counter()
        self.step(iterations)
        return time.perf_counter() - t


def _modules(torch, param):
    """The bench net's layers as torch modules in order, and for each engine layer (name, index
    of its first module, how many): layer_times times each layer's modules alone."""
    nn = torch.nn
    layers = []
    named = []                   # (engine layer name, index of its first module, count)
    shape = None
    for lp in param.layer:
        t = lp.type
        first = len(layers)
        if t == "Input":
            if lp.top[0] == "data":
                shape = tuple(lp.input_param.shape[0].dim)[1:]
            continue
        if t == "Convolution":
            cp = lp.convolution_param
            k = cp.kernel_size[0] if len(cp.kernel_size) else cp.kernel_h
            s = cp.stride[0] if len(cp.stride) else 1
            p = cp.pad[0] if len(cp.pad) else 0
            conv = nn.Conv2d(shape[0], cp.num_output, k, stride=s, padding=p,
                             groups=cp.group or 1, bias=cp.bias_term)
            layers.append(conv)
            h = (shape[1] + 2 * p - k) // s + 1
            w = (shape[2] + 2 * p - k) // s + 1
            shape = (cp.num_output, h, w)
        elif t == "Pooling":
            pp = lp.pooling_param
            k, s, p = pp.kernel_size, pp.stride or 1, pp.pad
            ceil = pp.round_mode == 0
            if pp.pool == 0:
                layers.append(nn.MaxPool2d(k, s, p, ceil_mode=ceil))
            else:
                layers.append(nn.AvgPool2d(k, s, p, ceil_mode=ceil, count_include_pad=True))
            with torch.no_grad():
                shape = tuple(layers[-1](torch.zeros((1,) + shape)).shape[1:])
        elif t == "ReLU":
            layers.append(nn.ReLU(inplace=lp.bottom[0] == lp.top[0]))
        elif t == "Dropout":
            layers.append(nn.Dropout(lp.dropout_param.dropout_ratio))
        elif t == "InnerProduct":
            n_in = 1
            for d in shape:
                n_in *= d
            if len(shape) > 1:
                layers.append(nn.Flatten())
            layers.append(nn.Linear(n_in, lp.inner_product_param.num_output,
                                    bias=lp.inner_product_param.bias_term))
            shape = (lp.inner_product_param.num_output,)
        elif t == "SoftmaxWithLoss":
            continue
        else:
            raise ValueError(f"torch reference: layer type {t} is not supported")
        named.append((lp.name, first, len(layers) - first))
    return layers, named
