"""What a solver reports of its nets' outputs, in Caffe's log lines (Caffe's log parsers read
them): the train net's outputs at a display, and a test pass, which runs test_iter batches of a
test net and logs the mean of each output (over the processes too, when the hooks combine them)."""
import logging
from collections import OrderedDict

import numpy

from .. import backend
from .logs import g as _g

log = logging.getLogger("poseidon")


def log_train_outputs(net):
    """`    Train net output #k: name = value` for every element of the net's output blobs."""
    k = 0
    for name in net.output_names:
        weight = net.blob_loss_weights.get(name, 0)
        for value in backend.to_numpy(net.blobs[name].data).reshape(-1):
            log.info(f"    Train net output #{k}: {name} = {_g(value)}{_loss_suffix(weight, value)}")
            k += 1


def test_net(solver, i):
    """test_iter[i] forward passes of the solver's test net i; logs and returns {output blob: mean
    value} (a float for one-element blobs, else an array averaged element by element). The hooks
    may run a share of the batches here and combine the means with other processes'."""
    p, hooks = solver.param, solver.hooks
    net = solver.test_nets[i]
    hooks.before_test(solver, i)
    n = hooks.test_batches(solver, i, p.test_iter[i])
    log.info(f"Iteration {solver.iter}, Testing net (#{i})")
    sums = None
    loss = 0.0
    for _ in range(n):
        iter_loss = net.Forward()
        if p.test_compute_loss:
            loss += iter_loss
        if sums is None:
            sums = [net.blobs[name].data.astype(numpy.float64) for name in net.output_names]
        else:
            for acc, name in zip(sums, net.output_names):
                acc += net.blobs[name].data
    if solver.on_device:
        net.check_deferred()                # the test net's own label checks
    if not n:
        return OrderedDict()
    local = numpy.concatenate([[loss]] + [backend.to_numpy(acc).reshape(-1) for acc in sums])
    means = hooks.reduce_test(solver, i, local / n)
    if p.test_compute_loss:
        log.info(f"Test loss: {_g(means[0])}")
    results = OrderedDict()
    k, off = 0, 1
    for acc, name in zip(sums, net.output_names):
        mean = means[off:off + acc.size]
        off += acc.size
        weight = net.blob_loss_weights.get(name, 0)
        for value in mean:
            log.info(f"    Test net output #{k}: {name} = {_g(value)}{_loss_suffix(weight, value)}")
            k += 1
        results[name] = float(mean[0]) if mean.size == 1 else mean.reshape(acc.shape)
    return results


def _loss_suffix(weight, value):
    return f" (* {_g(weight)} = {_g(weight * value)} loss)" if weight else ""
