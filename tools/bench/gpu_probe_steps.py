"""The two sides a device probe part times (tools/bench/gpu_probe_parts.py): the engine's solver
on CuPy and the same net in PyTorch CUDA, each a step and a sync, and their turns at the clock.
Like the parts, nothing here imports pyzmq or lmdb (the GPU image lacks them)."""
import time

import numpy

RUN_S = 0.25          # one timed run of a side; the sides take turns


class EngineStep:
    """The engine's solver on one net (forward, backward, update), on CuPy."""

    def __init__(self, key, batch):
        import cupy
        from poseidon.tools.bench import nets
        self.cupy = cupy
        bench = {"cifar10_quick": nets.cifar10_quick, "fc_heavy": nets.fc_heavy,
                 "vgg_block": nets.vgg_block}
        if key in bench:
            self.bench_net = bench[key](batch)
            self.solver = nets.make_solver(self.bench_net, xp=cupy)
            self.param = self.bench_net.param
        else:
            self.bench_net = None
            self.solver = _real_net_solver(key, batch)
            self.param = self.solver.param.net_param
        self.net = self.solver.net

    def step(self, iterations):
        self.solver.step(iterations)

    def sync(self):
        self.cupy.cuda.Device().synchronize()


def _real_net_solver(model, batch):
    """SGD around a deploy net of prototxt/ as the bench trains it (model_ref.training_param):
    random images and a random gradient on its last top, set once."""
    import cupy
    from poseidon.engine.proto import caffe_pb2
    from poseidon.engine.solvers import get_solver
    from poseidon.tools.bench import model_ref
    sp = caffe_pb2.SolverParameter(base_lr=0.01, momentum=0.9, weight_decay=5e-4,
                                   lr_policy="fixed", max_iter=10 ** 9, display=0, random_seed=1)
    sp.net_param.CopyFrom(model_ref.training_param(model, batch))
    solver = get_solver(sp, xp=cupy)
    net, rs = solver.net, numpy.random.RandomState(0)
    image = next(lp.top[0] for lp in sp.net_param.layer if lp.type == "Input")
    net.blobs[image].data[...] = cupy.asarray(rs.random_sample(net.blobs[image].shape))
    last = net.top_vecs[-1][0]
    last.diff[...] = cupy.asarray(rs.random_sample(last.shape))
    return solver


class TorchStep:
    """The same net in PyTorch CUDA: forward, backward, SGD step."""

    def __init__(self, engine, device):
        import torch
        self.torch = torch
        if engine.bench_net is not None:
            from poseidon.tools.bench import nets, torch_ref
            self.ref = torch_ref.TorchNet(engine.bench_net, 1, device=device)
            self.ref.set_batch(*nets.synthetic_batch(engine.bench_net))
            self._step = lambda: self.ref.step(1)
            return
        from poseidon.tools.bench import model_ref
        shapes = {name: blob.shape for name, blob in engine.net.blobs.items()}
        model = model_ref.torch_graph(engine.param, shapes, 1).to(device)
        image = next(lp.top[0] for lp in engine.param.layer if lp.type == "Input")
        x = torch.rand(*shapes[image], device=device)
        grad = torch.rand_like(model({image: x}))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)

        def step():
            opt.zero_grad(set_to_none=False)
            model({image: x}).backward(grad)
            opt.step()
        self._step = step

    def step(self, iterations):
        for _ in range(iterations):
            self._step()

    def sync(self):
        self.torch.cuda.synchronize()


def timed(side, iterations):
    """Seconds per iteration of a side, synced before and after: the device's time, not the
    launches'."""
    side.sync()
    t = time.perf_counter()
    side.step(iterations)
    side.sync()
    return (time.perf_counter() - t) / iterations


def set_precision(tf32, with_torch):
    """Both sides to TF32 GEMMs or full FP32 alike; returns the engine's own word for it."""
    from poseidon.engine import backend
    engine = backend.set_tf32(tf32)
    if with_torch:
        import torch
        from poseidon.tools.bench import torch_ref
        torch_ref.set_precision(torch, tf32)
    return engine


def compare(engine, torch_side, seconds):
    """ms per iteration of each side, the sides taking turns for `seconds` (at least one turn
    each): {"engine": [...], "torch": [...]}."""
    sides = {"engine": engine, "torch": torch_side}
    runs = {name: [] for name, side in sides.items() if side is not None}
    per = {name: timed(side, 1) for name, side in sides.items() if side is not None}
    iters = {name: max(1, int(RUN_S / max(s, 1e-4))) for name, s in per.items()}
    stop, turn = time.monotonic() + seconds, 0
    while not turn or time.monotonic() < stop:
        order = list(runs) if turn % 2 == 0 else list(reversed(runs))
        for name in order:
            runs[name].append(timed(sides[name], iters[name]) * 1e3)
        turn += 1
    return runs


def free_memory(with_torch):
    """Give back the pools' memory between nets, so that the next net has the whole card."""
    import gc
    import cupy
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    if with_torch:
        import torch
        torch.cuda.empty_cache()
