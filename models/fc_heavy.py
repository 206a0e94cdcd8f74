"""fc_heavy: a fully-connected-heavy benchmark net (AlexNet's classifier head on its own).

Input "data" (32, 9216) and Input "label" (32,) -> fc6 4096 -> ReLU -> fc7 4096 -> ReLU ->
fc8 1000 -> SoftmaxWithLoss; 58,631,144 learnable parameters, all in InnerProduct layers, so that
PS-versus-SFB communication dominates a step. Both files are the same net (random inputs, a loss
to back-propagate), since it exists for benchmarks, not for training on data.
"""

from poseidon.models.builder import NetBuilder


def fc_heavy(deploy=False, batch=32, in_dim=9216, hidden=4096, num_classes=1000):
    n = NetBuilder("fc_heavy")
    x = n.input("data", (batch, in_dim))
    n.input("label", (batch,))
    g = lambda std: {"type": "gaussian", "std": std}  # noqa: E731
    c = {"type": "constant", "value": 0.1}
    for i in (6, 7):
        x = n.fc(f"fc{i}", x, hidden, weight_filler=g(0.005), bias_filler=c)
        x = n.relu(f"relu{i}", x)
    x = n.fc("fc8", x, num_classes, weight_filler=g(0.01), bias_filler={"type": "constant"})
    n.softmax_loss("loss", x, "label")
    return n.net
