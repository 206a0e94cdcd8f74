"""Fuzzing: mutated copies of the real Caffe files never crash the loader with a traceback.

Every failure must be a PoseidonError (the command line prints those as one line). Small nets are
built and run forward; the big ones are parsed, upgraded, filtered and split without allocating.
"""
import random
import re

from poseidon.engine import TEST, TRAIN, PoseidonError
from poseidon.engine.net import Net
from poseidon.engine import prototxt

from tests.conftest import CAFFE_MODELS, needs_caffe_models

SMALL = ["cifar10/cifar10_quick.prototxt", "cifar10/cifar10_quick_train_test.prototxt",
         "mnist/lenet_train_test.prototxt", "cifar10/cifar10_full_train_test.prototxt"]
BIG = ["bvlc_alexnet/deploy.prototxt", "bvlc_googlenet/deploy.prototxt",
       "resnet/ResNet-152-deploy.prototxt", "inception/deploy_inception-v3.prototxt",
       "vgg/VGG_ILSVRC_19_layers_deploy.prototxt"]
NUMBERS = ["0", "-1", "1", "2", "3", "7", "1000000000", "2.5", "-3", "1e30", "65536"]
WORDS = ['""', '"bogus"', '"data"', '"conv1"', '"label"', '"ReLU"', '"Pooling"', "MAX", "AVE", "TEST",
         "TRAIN", "true", "nonsense"]


def mutate(text, rs):
    lines = text.split("\n")
    for _ in range(rs.randint(1, 3)):
        op = rs.randrange(7)
        i = rs.randrange(len(lines))
        if op == 0 and len(lines) > 1:
            del lines[i]
        elif op == 1:
            lines.insert(i, lines[rs.randrange(len(lines))])
        elif op == 2:
            nums = list(re.finditer(r"-?\d+(\.\d+)?(e-?\d+)?", lines[i]))
            if nums:
                m = rs.choice(nums)
                lines[i] = lines[i][:m.start()] + rs.choice(NUMBERS) + lines[i][m.end():]
        elif op == 3:
            words = list(re.finditer(r'"[^"]*"|\b[A-Z]{2,}\b', lines[i]))
            if words:
                m = rs.choice(words)
                lines[i] = lines[i][:m.start()] + rs.choice(WORDS) + lines[i][m.end():]
        elif op == 4:
            j = rs.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == 5 and lines[i]:
            k = rs.randrange(len(lines[i]))
            lines[i] = lines[i][:k] + rs.choice("{}:\"#x9 ") + lines[i][k:]
        else:
            text = "\n".join(lines)
            return text[:rs.randrange(len(text) + 1)]
    return "\n".join(lines)


def load_small(path, phase):
    net = Net(str(path), phase)
    try:
        if not any(layer.type == "Data" for layer in net.layers):
            net.Forward()
    finally:
        net.shutdown()


def load_big(path):
    param = prototxt.read_net(str(path))
    for phase in (TRAIN, TEST):
        prototxt.insert_splits(prototxt.filter_net(param, prototxt.caffe_pb2.NetState(phase=phase)))


@needs_caffe_models
def test_mutated_caffe_files_never_give_a_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rs = random.Random(1234)
    sources = {name: (CAFFE_MODELS / name).read_text() for name in SMALL + BIG}
    counts = {"clean": 0, "error": 0}
    crashes = []
    n_cases = 1000
    for case in range(n_cases):
        name = SMALL[case % len(SMALL)] if case % 5 else BIG[(case // 5) % len(BIG)]
        text = mutate(sources[name], rs)
        path = tmp_path / f"case{case % 10}.prototxt"
        path.write_text(text)
        try:
            if name in SMALL:
                load_small(path, TRAIN if case % 2 else TEST)
            else:
                load_big(path)
            counts["clean"] += 1
        except PoseidonError as e:
            assert str(e), "an error must say what is wrong"
            counts["error"] += 1
        except Exception as e:  # noqa: BLE001 - the point of the test
            crashes.append((case, name, f"{type(e).__name__}: {e}"[:300], text))
    print(f"\nfuzzed {n_cases} mutated prototxt files: {counts['clean']} loaded, "
          f"{counts['error']} refused with a clear error, {len(crashes)} tracebacks")
    assert not crashes, "\n".join(f"case {c} ({n}): {m}" for c, n, m, _ in crashes[:10])
