"""Several replicas of the train net behind one leader: Caffe's multi-GPU training in one process,
and the G devices of one node of a distributed job.

    solver = get_solver("solver.prototxt", replicas=2)                   # two CPU replicas
    solver = get_solver("solver.prototxt", replicas=2, devices=[0, 1])   # one per GPU (GPU mode)

Each replica is the same net reading its own share of the data (batch_size per replica; replica g
of a process that reads shard (r, n) reads shard (r·G + g, n·G), so P1 processes of G replicas
read what P1·G single replicas would). Replica 0 is the leader: the solver's `net`, whose
parameters the update (or a distributed sync) changes, which the test nets share and snapshots
save. The Solver's loop drives the group layer by layer:

    forward_layer(l)      the leader's parameters of layer l copied into every other replica
                          (the first forward of l in an iteration: an update may have changed
                          them), then layer l's forward on every replica
    loss()                the mean of the replicas' losses
    backward_layer(l)     layer l's backward on every replica, then (at the iteration's last pass)
                          the mean of their gradients of the parameters that are complete at l,
                          written into the leader's diffs, before the solver's after_backward(l)
                          hook: a distributed worker syncs the node's gradient layer by layer,
                          while the replicas run the layers below (wait-free backpropagation)
    factors(l, layer)     an InnerProduct's sufficient factors of every replica, stacked
                          (K·G rows, G scaled by 1/G), for an update made from factors

Why the mean: each replica's loss is normalised over its own batch, so the mean of the G gradients
is the gradient of one net on the G batches together (Caffe's P2PSync scales its sum by 1/G too).

A layer whose forward draws from the process's random stream (Dropout: `draws_random`) runs on
the replicas one after the other, in replica order, so a run draws the same numbers every time.
The other replicas take the leader's convolution routes before their first forward, so no two
replicas time routes at once, and all compute alike.

Why threads only on the CPU: numpy blocks the calling thread for each op but releases the GIL in
BLAS, copies and ufuncs, so the other replicas' work for a layer runs on threads of their own
while the calling thread runs the leader's. On GPUs the calling thread launches each replica's
kernels on its device in turn; launches return at once, so the devices compute together.
"""
from concurrent.futures import ThreadPoolExecutor, wait

import numpy

from . import backend
from .errors import PoseidonError
from .parallel import BufferCache


def replica_shard(shard, index, count):
    """The data shard (rank, size) replica `index` of `count` reads in a process reading `shard`."""
    rank, size = shard
    return (rank * count + index, size * count)


def plan_devices(gpu=None, count=None):
    """Each replica's device from Caffe's --gpu and --devices-per-node G: a GPU id per replica
    (a list of G ids, or G replicas on one id), or None per replica on the CPU. Bad flags raise a
    PoseidonError of one line."""
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise PoseidonError(f"--devices-per-node {count}: give a whole number of replicas per "
                            f"node, at least 1")
    ids = backend.gpu_ids(gpu)
    if ids is None:
        return [None] * (count or 1)
    if len(ids) == 1:
        return ids * (count or 1)
    if count is not None and count != len(ids):
        raise PoseidonError(f"--devices-per-node {count} but --gpu {gpu} lists {len(ids)} "
                            f"devices: give one GPU id per replica, or one id for all {count} "
                            f"replicas, or drop --devices-per-node (the list's length is G)")
    return ids


def check_replicas(count, devices, xp):
    """Refuse, in one line, a replica count or device list the solver cannot run."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise PoseidonError(f"replicas={count!r}: give a whole number of replicas, at least 1")
    if devices is None:
        return
    if len(devices) != count:
        raise PoseidonError(f"replicas={count} but {len(devices)} devices {list(devices)}: give "
                            f"one device per replica")
    if any(d is not None for d in devices) and xp is numpy:
        raise PoseidonError(f"replicas on GPUs {list(devices)} need GPU mode: call "
                            f"engine.set_mode_gpu() (the CLI's --gpu) before building the solver")


class ReplicaGroup:
    """The train net's replicas: the leader (replica 0, the solver's net) and count-1 others.

    leader: the train net, built on replica_shard(shard, 0, count). build(shard): a new replica
    of it reading that shard (called in its device's scope). devices: a GPU id per replica (None:
    all where the leader is)."""

    def __init__(self, leader, build, count=1, devices=None, shard=(0, 1)):
        check_replicas(count, devices, leader.xp)
        self.leader, self.count = leader, count
        self.devices = list(devices) if devices is not None else [None] * count
        self.nets = [leader]
        for g in range(1, count):
            with backend.device_scope(self.devices[g]):
                self.nets.append(build(replica_shard(shard, g, count)))
        on_cpu = leader.xp is numpy
        self._threads = (ThreadPoolExecutor(count - 1, thread_name_prefix="replica")
                         if count > 1 and on_cpu else None)
        self._reduced_at = self._completion_layers(leader)
        self._stale, self._skip, self._stacked = set(), set(), {}
        self._buffers = BufferCache()
        self._routes = None

    @staticmethod
    def _completion_layers(net):
        """{layer index: learned parameter ids whose gradient is complete after its backward}:
        a parameter shared by several layers is complete at the lowest of them (the last whose
        backward runs)."""
        users = {}
        for li, specs in enumerate(net.layer_param_specs):
            for spec in specs:
                users.setdefault(spec.name, []).append(li)
        done = {}
        for pid, spec in enumerate(net.learnable_param_specs):
            if spec.lr_mult != 0:
                done.setdefault(min(users[spec.name]), []).append(pid)
        return done

    def _each(self, work, ordered=False):
        """work(g, net) for every replica in its device's scope; the leader's on this thread.
        `ordered`: one after the other in replica order (work that draws random numbers)."""
        if self._threads is None or ordered:
            for g, net in enumerate(self.nets):
                with backend.device_scope(self.devices[g]):
                    work(g, net)
            return
        futures = [self._threads.submit(work, g, net) for g, net in enumerate(self.nets) if g]
        try:
            work(0, self.leader)
        finally:
            wait(futures)
        for f in futures:
            f.result()

    # ----- one iteration ----------------------------------------------------------------------
    def begin_iteration(self, factored_pids=()):
        """A new iteration: parameters to copy again before each layer's forward, the other
        replicas' gradients cleared (the leader's are the solver's), the convolution routes
        the leader runs pinned on the others. factored_pids: weights made from factors, whose
        diffs no backward writes and no reduction needs."""
        if self.count == 1:
            return
        self._stale = set(range(len(self.leader.layers)))
        self._skip = set(factored_pids)
        self._stacked = {}
        routes = self.leader.conv_routes()
        pin, self._routes = routes != self._routes, routes

        def clear(g, net):
            if g:
                net.clear_diffs([b for pid, b in enumerate(net.learnable_params)
                                 if pid not in self._skip])
                if pin:
                    net.set_conv_routes(routes)
        self._each(clear)

    def forward_layer(self, li, alone=True):
        if self.count == 1:
            self.leader.ForwardLayer(li, alone)
            return
        stale = li in self._stale
        self._stale.discard(li)
        leader_blobs = self.leader.layers[li].blobs

        def forward(g, net):
            if g and stale:
                for mine, theirs in zip(net.layers[li].blobs, leader_blobs):
                    mine.data[...] = backend.on_device_of(theirs.data, mine.data)
            net.ForwardLayer(li, alone)
        self._each(forward, ordered=getattr(self.leader.layers[li], "draws_random", False))

    def loss(self):
        """The mean of the replicas' losses (seeding each loss top's diff, as Net.loss does): a
        float on numpy, a device scalar on the leader's GPU, so the step reads nothing back."""
        if self.count == 1:
            return self.leader.loss_on_device()
        losses = [0.0] * self.count

        def loss(g, net):
            losses[g] = net.loss_on_device()
        self._each(loss)
        total = losses[0]
        for other in losses[1:]:
            total = total + backend.on_device_of(other, losses[0])
        return total / self.count

    def backward_layer(self, li, factored=False, reduce=True):
        """Layer li's backward on every replica; with `reduce` (the iteration's last pass), the
        mean of the gradients complete at li into the leader's diffs."""
        if self.count == 1:
            self.leader.BackwardThrough(li, factored)
            return
        self._each(lambda g, net: net.BackwardThrough(li, factored))
        self._stacked.pop(li, None)
        if not reduce:
            return
        with backend.device_scope(self.devices[0]):
            for pid in self._reduced_at.get(li, ()):
                if pid in self._skip:
                    continue
                total = self.leader.learnable_params[pid].diff
                for net in self.nets[1:]:               # replica order: the same sum every time
                    total += backend.on_device_of(net.learnable_params[pid].diff, total)
                total *= 1.0 / self.count

    def factors(self, li, layer):
        """Layer li's sufficient factors (G, X) for the whole group: the replicas' stacked in
        replica order, G scaled by 1/count, so that Gᵀ·X is the mean weight gradient."""
        net = self.leader
        if self.count == 1:
            return layer.sufficient_factors(net.bottom_vecs[li], net.top_vecs[li])
        stacked = self._stacked.get(li)
        if stacked is not None:
            return stacked
        parts = [n.layers[li].sufficient_factors(n.bottom_vecs[li], n.top_vecs[li])
                 for n in self.nets]
        k = parts[0][0].shape[0]
        with backend.device_scope(self.devices[0]):
            G, X = (self._buffers.get((name, li), (k * self.count,) + parts[0][i].shape[1:],
                                      parts[0][i].dtype, net.xp)
                    for i, name in enumerate("GX"))
            for g, (gg, xx) in enumerate(parts):
                G[g * k:(g + 1) * k] = backend.on_device_of(gg, G)
                X[g * k:(g + 1) * k] = backend.on_device_of(xx, X)
            G *= 1.0 / self.count
        self._stacked[li] = (G, X)
        return G, X

    # ----- data positions, and the end ---------------------------------------------------------
    def data_cursors(self):
        """The other replicas' data cursors (the leader's are the solver's own)."""
        return [net.data_cursors() for net in self.nets[1:]]

    def set_data_cursors(self, cursors):
        for net, c in zip(self.nets[1:], cursors or []):
            net.set_data_cursors(c)

    def shutdown(self):
        """Stop the other replicas' data threads and the group's own (the leader is the solver's)."""
        for net in self.nets[1:]:
            net.shutdown()
        if self._threads is not None:
            self._threads.shutdown(wait=True)
