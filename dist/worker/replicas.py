"""Every worker's replica from worker 0's state, at the start of a run (and again after a restore).

Worker 0 gives the servers the values and solver history of the parameters they keep (PS), and
every other worker its values, with the history of those the workers update themselves (SFB and any
scheme without servers), and the convolution routes it runs: with POSEIDON_CONV=auto worker 0
alone times the candidate routes (or takes them from its snapshot), so every replica computes
with the same algorithms and a resumed job with the ones it had. Then, on one host, a PS parameter whose KV pairs sit back to back in one
server's shared memory is placed there, so that its syncs move headers only.
"""
import logging

import numpy

from poseidon.engine import backend

from ..errors import DistError
from ..schemes import scheme_class
from ..transport import Msg

log = logging.getLogger("poseidon")


def host_flat(array):
    return numpy.ascontiguousarray(backend.to_numpy(array)).reshape(-1)


def _kept_by_workers(book, pid, it):
    """Whether the workers update parameter pid themselves at iteration it (so each keeps its
    solver history)."""
    name = book.scheme_of_param(pid, it)
    return name is not None and not scheme_class(name).uses_servers


def init_servers(kv, net, history, it):
    """Worker 0: the servers' KV pairs from this replica's values and history."""
    kv.init(it, lambda pid: [host_flat(net.learnable_params[pid].data)] +
            [host_flat(h) for h in history[pid]])


def send_state(transport, roles, book, net, history, it):
    """Worker 0: every other worker's parameters (and the history the workers keep), and the
    convolution routes."""
    receipts = []
    routes = net.conv_routes()                  # measured here if not yet chosen
    for peer in roles.worker_ranks()[1:]:
        transport.send(peer, Msg.ROUTES, iteration=it, obj={"routes": routes})
        for pid, blob in enumerate(net.learnable_params):
            arrays = [host_flat(blob.data)]
            if _kept_by_workers(book, pid, it):
                arrays += [host_flat(h) for h in history[pid]]
            receipts.append(transport.send(peer, Msg.WEIGHTS, iteration=0, key=pid, aux=it,
                                           arrays=arrays))
    for r in receipts:
        r.wait()


def receive_state(transport, name, net, history, it, timeout):
    """Another worker: worker 0's parameters and routes into this replica (refused if it starts
    elsewhere)."""
    routes = transport.receive(Msg.ROUTES, 0, it, timeout=timeout, senders=[0],
                               what="worker 0's convolution routes")[0].obj["routes"]
    net.set_conv_routes(routes)
    for pid, blob in enumerate(net.learnable_params):
        msg = transport.receive(Msg.WEIGHTS, pid, 0, timeout=timeout, senders=[0],
                                what=f"worker 0's initial value of parameter "
                                     f"'{net.learnable_param_specs[pid].name}'")[0]
        if msg.aux != it:
            raise DistError(f"{name} starts at iteration {it} but worker 0 at iteration "
                            f"{msg.aux}: resume every worker from the same snapshot (each worker "
                            f"needs its own cursor file)")
        xp = backend.get_array_module(blob.data)
        blob.data[...] = backend.to_xp(msg.arrays[0].reshape(blob.data.shape), xp)
        for h, value in zip(history[pid], msg.arrays[1:]):
            h[...] = backend.to_xp(value.reshape(h.shape), xp)


def _kv_spot(book, transport, kv, net, rank, pid):
    """(values, gradient) views of parameter pid in a server's shared memory, or None."""
    p = book.params[pid]
    if p.scheme is None or not scheme_class(p.scheme).uses_servers:
        return None
    if book.switchable(p.layer):
        return None          # it may leave the servers: its arrays must stay the worker's own
    owner = net.layers[p.owner[0]]
    if owner.holds_param_arrays:
        return None          # user code may keep the blob's arrays: their storage stays
    pairs = sorted(book.pairs_of_param(pid), key=lambda rec: rec.offset)
    if not pairs or len({rec.server for rec in pairs}) != 1:
        return None
    segment = transport.kv_segment(kv.server_rank(pairs[0].server))
    if segment is None:
        return None
    slots = [segment.layout.slots[rec.id] for rec in pairs]
    start = slots[0][0]
    if any(off != start + rec.offset for (off, _), rec in zip(slots, pairs)):
        return None                          # not back to back
    count = net.learnable_params[pid].count
    if sum(n for _, n in slots) != count:
        return None
    region = segment.layout.region
    grads_at = (1 + rank) * region + start
    return (segment.array[start:start + count], segment.array[grads_at:grads_at + count])


def place_in_kv_memory(book, transport, kv, rank, net, test_nets, placed):
    """Put each PS parameter whose KV pairs all sit, back to back, in the shared memory of one
    server of this host (dist/transport/onehost/kvshm.py) there: its values in the server's
    values, its gradient in this worker's region. The backward then writes the gradient where
    the server reads it and the server updates the values the forward reads; a sync moves
    headers only. Adds them to `placed`.

    After the start barrier the server's values are this worker's (worker 0 initialised them, the
    others took worker 0's), so nothing is copied but the gradient. CPU nets only (a GPU's
    parameters live on the device), and not a Python layer's parameters (user code may hold on to
    the arrays); blobs that shared the storage (weight sharing, the test nets) follow it."""
    if net.xp is not numpy:
        return
    for pid, blob in enumerate(net.learnable_params):
        if pid in placed:
            continue
        spot = _kv_spot(book, transport, kv, net, rank, pid)
        if spot is None:
            continue
        values, grads = spot
        numpy.copyto(grads, blob.diff.reshape(-1))
        sharers = [b for n in [net] + list(test_nets) for layer in n.layers for b in layer.blobs
                   if b is not blob and b.shares_storage_with(blob)]
        blob.place(values, grads)
        for b in sharers:
            b.follow(blob)
        placed.add(pid)
    if placed and rank == 0:
        params = net.learnable_params
        mb = sum(params[pid].count * params[pid].dtype.itemsize for pid in placed) / 1e6
        log.info(f"{len(placed)} of {len(params)} parameters ({mb:.2f} MB) live in the KV "
                 f"servers' shared memory: their syncs move headers only")
