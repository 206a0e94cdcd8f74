"""A solver's nets, from its solver file (Caffe's Solver::InitTrainNet and InitTestNets): the train
net from exactly one of its net fields, the test nets from test_net_param, test_net or the shared
net, each in its phase with Caffe's merge of NetStates. Paths are resolved against the solver
file's folder, and errors name the file."""
import logging

from .. import prototxt
from ..errors import ModelError
from ..layer import TEST, TRAIN
from ..net import Net
from ..proto import caffe_pb2
from ..replicas import replica_shard
from . import solverfile

log = logging.getLogger("poseidon")


class NetBuilder:
    """Builds the nets a SolverParameter names, in float type `dtype` on array module `xp`;
    `source` is the solver file the parameter came from (None for a message)."""

    def __init__(self, param, source, dtype, xp):
        self.param, self.source, self.dtype, self.xp = param, source, dtype, xp

    def _where(self):
        return self.source or "solver"

    def _resolve(self, path, what):
        return solverfile.resolve(path, what, self.source)

    def build(self, model, phase, state, shard):
        """A Net in `phase` whose NetState is Caffe's merge: phase < the net's own state < `state`."""
        param = prototxt.read_net(model) if isinstance(model, str) else model
        merged = caffe_pb2.NetState(phase=phase)
        merged.MergeFrom(param.state)
        if state is not None:
            merged.MergeFrom(state)
        merged.phase = phase
        return Net(model, phase, level=merged.level, stages=list(merged.stage), dtype=self.dtype,
                   xp=self.xp, shard=shard, state=merged)

    def train_net(self, shard, replicas=1):
        """The train net (the leader of `replicas`, on its part of data shard `shard`), and a
        function that builds another replica of it on a given data shard."""
        p = self.param
        fields = ("net", "net_param", "train_net", "train_net_param")
        given = [f for f in fields if p.HasField(f)]
        if len(given) != 1:
            raise ModelError(f"{self._where()}: give exactly one of {', '.join(fields)} for the "
                             f"train net (found {', '.join(given) or 'none'})")
        source = given[0]
        if source.endswith("param"):
            log.info(f"Creating training net specified in {source}.")
            model = getattr(p, source)
        else:
            model = self._resolve(getattr(p, source), "net file")
            log.info(f"Creating training net from {source} file: {model}")
        state = p.train_state if p.HasField("train_state") else None
        net = self.build(model, TRAIN, state, replica_shard(shard, 0, replicas))
        for entry in p.weights:
            for path in entry.split(","):
                if path:
                    path = self._resolve(path, "weights file")
                    log.info(f"Finetuning from {path}")
                    net.copy_from(path)
        return net, lambda replica: self.build(model, TRAIN, state, replica)

    def test_nets(self, shard, train_net):
        """The test nets, each on data shard `shard` and sharing train_net's parameters."""
        p = self.param
        generic = p.HasField("net") + p.HasField("net_param")
        specific = len(p.test_net_param) + len(p.test_net)
        if (generic and len(p.test_iter) < specific) or (not generic and len(p.test_iter) != specific):
            raise ModelError(f"{self._where()}: test_iter must be given once for each test net "
                             f"({specific} test nets, {len(p.test_iter)} test_iter values)")
        count = len(p.test_iter) if generic else specific
        if len(p.test_state) and len(p.test_state) != count:
            raise ModelError(f"{self._where()}: test_state must be unspecified or given once per "
                             f"test net ({count} test nets, {len(p.test_state)} test_state)")
        if count and p.test_interval <= 0:
            raise ModelError(f"{self._where()}: there are {count} test nets but test_interval is "
                             f"{p.test_interval}; set test_interval > 0")
        models = [(m, "test_net_param") for m in p.test_net_param]
        models += [(self._resolve(f, "test net file"), f"test_net file: {f}") for f in p.test_net]
        rest = count - len(models)
        if p.HasField("net_param"):
            models += [(p.net_param, "net_param")] * rest
        elif p.HasField("net"):
            models += [(self._resolve(p.net, "net file"), f"net file: {p.net}")] * rest
        nets = []
        for i, (model, described) in enumerate(models):
            log.info(f"Creating test net (#{i}) specified by {described}")
            state = p.test_state[i] if len(p.test_state) else None
            net = self.build(model, TEST, state, shard)
            net.share_with(train_net)
            nets.append(net)
        return nets
