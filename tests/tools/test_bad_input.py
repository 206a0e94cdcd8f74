"""Bad input everywhere (docs/errors.md): each case runs `python -m poseidon.tools.cli ...` as a user would,
and must end with a non-zero exit, no traceback, and one short error line on stderr that names what
is wrong (file:line, layer, key or flag) and says what to do. A few cases are warnings (Caffe skips
them) and must exit 0 with one warning line.

All the cases run first, four subprocesses at a time (each takes about half a second), then one test
per case checks its result, and `test_print_summary_table` prints case -> message.
"""
import concurrent.futures
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

ROOT = Path(__file__).resolve().parents[2]

# ----- small files the cases are made of ---------------------------------------------------------
INPUT = 'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }\n'
IMAGE_INPUT = ('layer { name: "data" type: "Input" top: "data"\n'
               '  input_param { shape { dim: 2 dim: 1 dim: 3 dim: 3 } } }\n')
IP_NET = ('name: "tiny"\n' + INPUT +
          'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"\n'
          '  inner_product_param { num_output: 4 } }\n')
SOLVER = ('net: "{net}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 1\n'
          'snapshot_after_train: false\n')
IP2_NET = IP_NET + ('layer { name: "ip2" type: "InnerProduct" bottom: "ip" top: "ip2"\n'
                    '  inner_product_param { num_output: 2 } }\n')


def data_net(source, num_output=3, transform="", test_source=None):
    """Data -> InnerProduct -> SoftmaxWithLoss; a TEST Data layer too when test_source is given."""
    phase = ' include { phase: TRAIN }' if test_source else ''
    text = (f'name: "d"\n'
            f'layer {{ name: "data" type: "Data" top: "data" top: "label"{phase}\n'
            f'  {transform}data_param {{ source: "{source}" batch_size: 2 backend: LMDB }} }}\n')
    if test_source:
        text += (f'layer {{ name: "data" type: "Data" top: "data" top: "label" '
                 f'include {{ phase: TEST }}\n'
                 f'  data_param {{ source: "{test_source}" batch_size: 2 backend: LMDB }} }}\n')
    return text + (f'layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"\n'
                   f'  inner_product_param {{ num_output: {num_output} '
                   f'weight_filler {{ type: "xavier" }} }} }}\n'
                   f'layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" '
                   f'top: "loss" }}\n')


def write_lmdb(path, shapes, corrupt_at=None):
    """An LMDB of uint8 Datum records of the given (C, H, W) shapes; record corrupt_at is junk."""
    import lmdb
    from poseidon.engine.io.datum import array_to_datum
    env = lmdb.open(str(path), map_size=1 << 22)
    with env.begin(write=True) as txn:
        for i, shape in enumerate(shapes):
            value = (b"\x0a\xff\xff\xff\xff garbage" if i == corrupt_at else
                     array_to_datum(numpy.full(shape, i, numpy.uint8), i % 3).SerializeToString())
            txn.put(b"%08d" % i, value)
    env.close()


def damaged_lmdbs(base):
    """A database whose data.mdb is cut in half (a copy that did not finish), one whose page
    holding the first record is overwritten with garbage, and one holding a Datum of two negative
    sizes (-1 x -1 x 5 has the 5 bytes it holds)."""
    import lmdb
    from poseidon.engine.proto import caffe_pb2
    write_lmdb(base / "whole_lmdb", [(3, 8, 8)] * 250)
    whole = (base / "whole_lmdb" / "data.mdb").read_bytes()
    env = lmdb.open(str(base / "whole_lmdb"), readonly=True, lock=False)
    page = env.stat()["psize"]
    env.close()
    first = whole.index(b"00000000") // page          # the leaf page of the first key
    (base / "cut_lmdb").mkdir()
    (base / "cut_lmdb" / "data.mdb").write_bytes(whole[:len(whole) // 2])
    garbage = bytearray(whole)
    garbage[first * page:(first + 1) * page] = bytes((7 * i + 13) % 256 for i in range(page))
    (base / "garbage_page_lmdb").mkdir()
    (base / "garbage_page_lmdb" / "data.mdb").write_bytes(bytes(garbage))
    env = lmdb.open(str(base / "negative_lmdb"), map_size=1 << 22)
    with env.begin(write=True) as txn:
        for i in range(3):
            datum = caffe_pb2.Datum(channels=-1, height=-1, width=5, data=bytes(5), label=1)
            txn.put(b"%08d" % i, datum.SerializeToString())
    env.close()


def cut_snapshot(base):
    """snap/cut_iter_1: a snapshot whose caffemodel ends at a layer boundary before 'ip' (it
    parses, and holds no weights for 'ip'), without a manifest, as a Caffe snapshot comes."""
    from poseidon.engine.io.caffemodel import read_net_proto
    model = base / "snap" / "cut_iter_1.caffemodel"
    full = read_net_proto(str(model))
    cut = caffe_pb2_net(full.name, [lp for lp in full.layer if lp.name != "ip"][:1])
    assert model.read_bytes().startswith(cut.SerializeToString())    # a byte-level cut
    model.write_bytes(cut.SerializeToString())
    (base / "snap" / "cut_iter_1.manifest.json").unlink()


def caffe_pb2_net(name, layers):
    from poseidon.engine.proto import caffe_pb2
    net = caffe_pb2.NetParameter(name=name)
    for lp in layers:
        net.layer.add().CopyFrom(lp)
    return net


def evil_cifar(folder):
    """A CIFAR-10 python folder whose first batch names numpy.f2py.__main__ (importing it runs
    f2py's command line); the other batches are sound."""
    from tests.engine.test_data import cifar_folder
    cifar_folder(folder, b"cnumpy.f2py.__main__\nndarray\n.")


DISK_FULL = """import errno, os
def _full(fd):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
os.fsync = _full        # every write of the process fails as on a full disk
"""


def make_base(base):
    """Every file the cases share, made once in `base` (the working directory of every case)."""
    from poseidon.engine.io.caffemodel import write_binaryproto
    from poseidon.engine.net import Net
    from poseidon.engine.solvers.solver import Solver

    def write(name, text):
        (base / name).write_text(text)

    write("ip.prototxt", IP_NET)
    write("ip5.prototxt", IP_NET.replace("num_output: 4", "num_output: 5"))
    write("solver.prototxt", SOLVER.format(net="ip.prototxt"))
    write_lmdb(base / "good_lmdb", [(1, 4, 4)] * 6)
    write_lmdb(base / "rgb_lmdb", [(3, 4, 4)] * 6)
    write_lmdb(base / "mixed_lmdb", [(1, 4, 4)] * 3 + [(1, 5, 5)] * 3)
    write_lmdb(base / "corrupt_lmdb", [(1, 4, 4)] * 3, corrupt_at=1)
    write_lmdb(base / "empty_lmdb", [])
    (base / "plain_file_lmdb").write_bytes(os.urandom(256))
    (base / "junk_dir_lmdb").mkdir()
    (base / "junk_dir_lmdb" / "notes.txt").write_text("not a database\n")
    write_binaryproto(numpy.zeros((3, 4, 4), numpy.float32), str(base / "mean_3x4x4.binaryproto"))
    write_lmdb(base / "later_batch_lmdb", [(1, 4, 4)] * 2 + [(1, 5, 5)] * 2)
    write("good_data.prototxt", data_net(str(base / "good_lmdb")))
    damaged_lmdbs(base)
    evil_cifar(base / "evil_cifar")
    (base / "disk_full").mkdir()
    (base / "disk_full" / "sitecustomize.py").write_text(DISK_FULL)
    # weights: a good file, one of another net, one truncated, garbage, an HDF5 one
    Net(str(base / "ip.prototxt"), "TEST").save(str(base / "ip.caffemodel"))
    Net(str(base / "ip5.prototxt"), "TEST").save(str(base / "ip5.caffemodel"))
    whole = (base / "ip.caffemodel").read_bytes()
    (base / "truncated.caffemodel").write_bytes(whole[:len(whole) * 2 // 3])
    (base / "garbage.caffemodel").write_bytes(bytes(range(256)) * 4)
    write("ip2.prototxt", IP2_NET)
    Net(str(base / "ip2.prototxt"), "TEST").save(str(base / "ip2.caffemodel"))
    from poseidon.engine.io.caffemodel import read_net_proto
    full = read_net_proto(str(base / "ip2.caffemodel"))
    cut = caffe_pb2_net(full.name, full.layer[:2]).SerializeToString()    # data and ip, no ip2
    assert (base / "ip2.caffemodel").read_bytes().startswith(cut)
    (base / "ip2_cut.caffemodel").write_bytes(cut)
    (base / "empty.caffemodel").write_bytes(b"")
    write("renamed.prototxt", IP_NET.replace('name: "ip"', 'name: "fc_other"'))
    Net(str(base / "renamed.prototxt"), "TEST").save(str(base / "renamed.caffemodel"))
    Net(str(base / "ip.prototxt"), "TEST").save_hdf5(str(base / "ip.caffemodel.h5"))
    (base / "no_h5py").mkdir()
    (base / "no_h5py" / "h5py.py").write_text('raise ImportError("No module named h5py")\n')
    # snapshots: one of the data net, one of a net with another shape, one whose weights are altered
    cwd = os.getcwd()
    os.chdir(base)
    try:
        for name, net in (("a", "good_data.prototxt"), ("b", "other_data.prototxt"),
                          ("torn", "good_data.prototxt"), ("cut", "good_data.prototxt"),
                          ("shape", "good_data.prototxt")):
            if name == "b":
                write(net, data_net(str(base / "good_lmdb"), num_output=5))
            write(f"train_{name}.prototxt", SOLVER.format(net=net) + f'snapshot_prefix: "snap/{name}"\n')
            solver = Solver(f"train_{name}.prototxt")
            solver.solve()
            solver.snapshot()
            solver.net.shutdown()
    finally:
        os.chdir(cwd)
    torn = base / "snap" / "torn_iter_1.caffemodel"
    raw = bytearray(torn.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    torn.write_bytes(bytes(raw))
    (base / "garbage.solverstate").write_bytes(os.urandom(300))
    cut_snapshot(base)
    (base / "snap" / "shape_iter_1.manifest.json").write_text("[]")    # valid JSON, wrong shape


# ----- the cases ---------------------------------------------------------------------------------
class Case:
    """argv for `poseidon`; files {name: text} written into the case's own folder; patterns the
    message must match (what is concerned); warn: exit 0 with a warning; known_gap: why the message
    is not yet complete (the case is then an expected failure, strict, so a fix shows up)."""

    def __init__(self, name, argv, patterns, files=None, env=None, warn=False, known_gap=None):
        self.name, self.argv, self.patterns = name, argv, patterns
        self.files, self.env, self.warn, self.known_gap = files or {}, env or {}, warn, known_gap


def net_case(name, text, patterns, command="summary"):
    argv = ["summary", "--model", "m.prototxt"] if command == "summary" else \
        ["time", "--model", "m.prototxt", "--iterations", "1"]
    return Case(name, argv, patterns, files={"m.prototxt": text})


def solver_case(name, solver_text, patterns, net=IP_NET, argv=("train", "--solver", "s.prototxt"),
                **kw):
    return Case(name, list(argv), patterns, files={"s.prototxt": solver_text, "net.prototxt": net},
                **kw)


def lmdb_case(name, source, patterns, transform="", test_source=None, command="time", **kw):
    text = data_net(f"../{source}", transform=transform, test_source=test_source)
    if command == "train":
        return Case(name, ["train", "--solver", "s.prototxt"], patterns,
                    files={"m.prototxt": text,
                           "s.prototxt": SOLVER.format(net="m.prototxt") +
                           "test_iter: 1\ntest_interval: 1\n"}, **kw)
    return Case(name, ["time", "--model", "m.prototxt", "--iterations", "1"], patterns,
                files={"m.prototxt": text}, **kw)


def train(*flags, solver="../solver.prototxt"):
    return ["train", "--solver", solver, *flags]


CONV = IMAGE_INPUT + ('layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"\n'
                      '  convolution_param { num_output: 2 kernel_size: 5 } }\n')
POOL = IMAGE_INPUT + ('layer { name: "pool" type: "Pooling" bottom: "data" top: "pool"\n'
                      '  pooling_param { pool: MAX kernel_size: 5 } }\n')
# words of an instruction (argparse's "expected ..." and "choose from ..." included)
WHAT_TO_DO = (r"\b(give|use|fix|check|set(?! up)|remove|add|make|move|rename|pass|install|choose|resume|"
              r"compute|create|re-create|convert|expected|keep|lower|drop|must|should|"
              r"did you mean)\b")

CASES = [
    # -- prototxt files ---------------------------------------------------------------------------
    net_case("net: syntax error", 'name: "x"\n' + INPUT + 'layer {\n  name: "ip"\n  type: "I"\n',
             [r"m\.prototxt:\d+:\d+", "not a valid net file"]),
    net_case("net: unknown layer type", 'name: "x"\n' + INPUT +
             'layer { name: "odd" type: "NoSuchType" bottom: "data" top: "odd" }\n',
             [r"m\.prototxt:3:", "layer 'odd'", "unknown layer type 'NoSuchType'"]),
    net_case("net: unknown field", 'name: "x"\n' + INPUT +
             'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"\n'
             '  inner_product_param { num_outputs: 3 } }\n',
             [r"m\.prototxt:4:\d+", "num_outputs"]),
    net_case("net: conv kernel bigger than input", 'name: "x"\n' + CONV,
             [r"m\.prototxt:4:", "layer 'conv'", "kernel", r"3x3|\b3\b"]),
    net_case("net: pooling kernel bigger than input", 'name: "x"\n' + POOL,
             [r"m\.prototxt:4:", "layer 'pool'", "kernel", r"3x3|\b3\b"]),
    net_case("net: Reshape to the wrong count", 'name: "x"\n' + INPUT +
             'layer { name: "r" type: "Reshape" bottom: "data" top: "r"\n'
             '  reshape_param { shape { dim: 4 dim: 2 } } }\n',
             [r"m\.prototxt:3:", "layer 'r'", r"\b6\b", r"\b8\b"]),
    net_case("net: Concat of mismatched shapes", 'name: "x"\n'
             'layer { name: "a" type: "Input" top: "a" input_param { shape { dim: 2 dim: 3 '
             'dim: 4 dim: 4 } } }\n'
             'layer { name: "b" type: "Input" top: "b" input_param { shape { dim: 2 dim: 3 '
             'dim: 5 dim: 5 } } }\n'
             'layer { name: "cat" type: "Concat" bottom: "a" bottom: "b" top: "c" }\n',
             [r"m\.prototxt:4:", "layer 'cat'", r"\(2, 3, 5, 5\)"]),
    net_case("net: InnerProduct num_output 0", 'name: "x"\n' + INPUT +
             'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"\n'
             '  inner_product_param { num_output: 0 } }\n',
             [r"m\.prototxt:3:", "layer 'ip'", "num_output"]),
    net_case("net: bottom produced only later", 'name: "x"\n' + INPUT +
             'layer { name: "first" type: "ReLU" bottom: "late" top: "r" }\n'
             'layer { name: "second" type: "ReLU" bottom: "data" top: "late" }\n',
             [r"m\.prototxt:3:", "layer 'first'", "'late'", "later", "second"]),
    net_case("net: layer consumes its own top", 'name: "x"\n' + INPUT +
             'layer { name: "loop" type: "Concat" bottom: "data" bottom: "c" top: "c" }\n',
             [r"m\.prototxt:3:", "layer 'loop'", "'c'"]),
    net_case("net: duplicate top (not in place)", 'name: "x"\n' + INPUT +
             'layer { name: "r1" type: "ReLU" bottom: "data" top: "t" }\n'
             'layer { name: "r2" type: "Sigmoid" bottom: "data" top: "t" }\n',
             [r"m\.prototxt:4:", "layer 'r2'", "top 't'"]),
    net_case("net: bottom never produced", 'name: "x"\n' + INPUT +
             'layer { name: "ip" type: "InnerProduct" bottom: "dta" top: "ip"\n'
             '  inner_product_param { num_output: 3 } }\n',
             [r"m\.prototxt:3:", "layer 'ip'", "bottom 'dta'"]),
    Case("net: a solver file given as --model", ["summary", "--model", "../solver.prototxt"],
         [r"solver\.prototxt:1:", "solver", "--solver"]),
    # -- solver files -------------------------------------------------------------------------------
    solver_case("solver: syntax error", 'net: "net.prototxt"\nbase_lr 0.01\n',
                [r"s\.prototxt:2:\d+", "not a valid solver file"]),
    solver_case("solver: unknown field", 'net: "net.prototxt"\nbase_rl: 0.01\n',
                [r"s\.prototxt:2:\d+", "base_rl"]),
    solver_case("solver: net file missing", SOLVER.format(net="no_such_net.prototxt"),
                [r"s\.prototxt", "no_such_net.prototxt", "does not exist"]),
    solver_case("solver: negative base_lr", SOLVER.format(net="net.prototxt").replace(
        "base_lr: 0.01", "base_lr: -0.1"), [r"s\.prototxt:2", "base_lr", "-0.1"]),
    solver_case("solver: unknown lr_policy", SOLVER.format(net="net.prototxt").replace(
        '"fixed"', '"sometimes"'), [r"s\.prototxt:3", "lr_policy", "sometimes", "fixed"]),
    solver_case("solver: unknown type", SOLVER.format(net="net.prototxt") + 'type: "Adamm"\n',
                [r"s\.prototxt:6", "type 'Adamm'", "Adam"]),
    solver_case("solver: HDF5 snapshots without h5py", SOLVER.format(net="net.prototxt") +
                'snapshot_format: HDF5\n', [r"s\.prototxt:6", "snapshot_format", "h5py"],
                env={"PYTHONPATH_FIRST": "no_h5py"}),
    solver_case("solver: net file missing (distributed)", SOLVER.format(net="nonet.prototxt"),
                [r"s\.prototxt", "nonet.prototxt", "does not exist"],
                argv=["train", "--solver", "s.prototxt", "--workers", "2", "--servers", "1"]),
    solver_case("solver: bad net graph (distributed)", SOLVER.format(net="net.prototxt"),
                [r"net\.prototxt:3:", "layer 'ip'", "bottom 'dta'"],
                net=IP_NET.replace('bottom: "data"', 'bottom: "dta"'),
                argv=["train", "--solver", "s.prototxt", "--workers", "2"]),
    Case("solver: a net file given as --solver", ["train", "--solver", "../ip.prototxt"],
         [r"ip\.prototxt:\d+", "net", "--model|net:"]),
    # -- LMDB data --------------------------------------------------------------------------------
    lmdb_case("lmdb: missing path", "no_such_lmdb",
              [r"m\.prototxt:2:", "layer 'data'", "no_such_lmdb", "does not exist"]),
    lmdb_case("lmdb: empty database", "empty_lmdb",
              [r"m\.prototxt:2:", "layer 'data'", "empty_lmdb", "empty"]),
    lmdb_case("lmdb: corrupt Datum record", "corrupt_lmdb",
              [r"m\.prototxt:2:", "layer 'data'", "record '00000001'", "not a valid Datum"]),
    lmdb_case("lmdb: records of another size", "mixed_lmdb",
              [r"m\.prototxt:2:", "layer 'data'", "record '00000003'", r"\(1, 5, 5\)",
               r"\(1, 4, 4\)"]),
    # Caffe reshapes a Data top per batch (fully convolutional nets take any size), so the layer
    # that cannot take the new size is the one to speak
    lmdb_case("lmdb: a later batch of another size", "later_batch_lmdb",
              [r"m\.prototxt:4:", "layer 'ip'", r"\(2, 1, 5, 5\)", r"\b16\b"]),
    lmdb_case("lmdb: TEST data of other channels", "good_lmdb", [
        r"m\.prototxt:\d+:", "layer 'ip'", r"\b48\b", r"\b16\b"],
        test_source="../rgb_lmdb", command="train"),
    lmdb_case("lmdb: a plain file", "plain_file_lmdb",
              [r"m\.prototxt:2:", "layer 'data'", "plain_file_lmdb", "is a file"]),
    lmdb_case("lmdb: a folder of junk", "junk_dir_lmdb",
              [r"m\.prototxt:2:", "layer 'data'", "junk_dir_lmdb", "not an LMDB"]),
    # 200 iterations of batch 2 read every record: the pages past the cut too (SIGBUS before)
    Case("lmdb: data file cut in half", ["train", "--solver", "s.prototxt"],
         [r"m\.prototxt:2:", "layer 'data'", r"cut_lmdb/data\.mdb", "cut short",
          r"needs \d+ bytes but holds \d+", "copy it again", "poseidon data"],
         files={"m.prototxt": data_net("../cut_lmdb"),
                "s.prototxt": SOLVER.format(net="m.prototxt").replace("max_iter: 1\n",
                                                                      "max_iter: 200\n")}),
    lmdb_case("lmdb: a page overwritten with garbage", "garbage_page_lmdb",
              [r"m\.prototxt:2:", "layer 'data'", "garbage_page_lmdb", "MDB_CORRUPTED",
               "copy it again", "poseidon data"], command="train"),
    lmdb_case("lmdb: a Datum of two negative sizes", "negative_lmdb",
              [r"m\.prototxt:2:", "layer 'data'", "record '00000000'", "negative_lmdb",
               r"\(-1, -1, 5\)"], command="train"),
    lmdb_case("lmdb: mean file missing", "good_lmdb",
              [r"m\.prototxt:2:", "layer 'data'", "no_mean.binaryproto", "does not exist"],
              transform='transform_param { mean_file: "no_mean.binaryproto" }\n  '),
    lmdb_case("lmdb: mean file of another shape", "good_lmdb",
              [r"m\.prototxt:2:", "layer 'data'", r"\(3, 4, 4\)", r"\(1, 4, 4\)"],
              transform='transform_param { mean_file: "../mean_3x4x4.binaryproto" }\n  '),
    Case("lmdb: `poseidon mean` of a missing source", ["mean", "no_such_lmdb", "m.binaryproto"],
         ["no_such_lmdb", "does not exist"]),
    Case("data: image list with a bad line", ["data", "images", ".", "list.txt", "out"],
         [r"list\.txt:2", "relative/path label"], files={"list.txt": "a.png 0\nb.png cat\n"}),
    Case("data: CIFAR-10 archive missing", ["data", "cifar10", "cifar.tar.gz", "out"],
         ["cifar.tar.gz", "does not exist"]),
    Case("data: output folder not empty", ["data", "digits", "out"], [r"out/train", "not empty"],
         files={"out/train/notes.txt": "keep me\n"}),
    Case("data: CIFAR-10 batch naming a foreign global", ["data", "cifar10", "../evil_cifar", "out"],
         ["data_batch_1", "evil_cifar", r"numpy\.f2py\.__main__\.ndarray"]),
    # -- weights ----------------------------------------------------------------------------------
    Case("weights: --weights file missing", ["test", "--model", "../ip.prototxt", "--weights",
                                             "nope.caffemodel", "--iterations", "1"],
         ["nope.caffemodel", "does not exist"]),
    Case("weights: train --weights file missing", train("--weights", "nope.caffemodel"),
         ["nope.caffemodel", "does not exist"]),
    Case("weights: not a caffemodel (garbage)", ["test", "--model", "../ip.prototxt", "--weights",
                                                 "../garbage.caffemodel", "--iterations", "1"],
         [r"garbage\.caffemodel", "not a"]),
    Case("weights: truncated caffemodel", ["test", "--model", "../ip.prototxt", "--weights",
                                           "../truncated.caffemodel", "--iterations", "1"],
         [r"truncated\.caffemodel", "not a|truncated|torn"]),
    Case("weights: shape mismatch", ["test", "--model", "../ip.prototxt", "--weights",
                                     "../ip5.caffemodel", "--iterations", "1"],
         [r"ip5\.caffemodel", "layer 'ip'", r"parameter 0", r"\(5, 3\)", r"\(4, 3\)"]),
    Case("weights: no layer name matches (warning)",
         ["test", "--model", "../ip.prototxt", "--weights", "../renamed.caffemodel",
          "--iterations", "1"], [r"renamed\.caffemodel", "fc_other", "ip"], warn=True),
    Case("weights: caffemodel cut at a layer boundary (warning)",
         ["test", "--model", "../ip2.prototxt", "--weights", "../ip2_cut.caffemodel",
          "--iterations", "1"], [r"ip2_cut\.caffemodel", "no weights", "'ip2'"], warn=True),
    Case("weights: empty caffemodel (warning)",
         ["test", "--model", "../ip2.prototxt", "--weights", "../empty.caffemodel",
          "--iterations", "1"], [r"empty\.caffemodel", "no weights", "'ip', 'ip2'"], warn=True),
    Case("weights: HDF5 without h5py", ["test", "--model", "../ip.prototxt", "--weights",
                                        "../ip.caffemodel.h5", "--iterations", "1"],
         [r"ip\.caffemodel\.h5", "h5py"], env={"PYTHONPATH_FIRST": "no_h5py"}),
    # -- snapshots --------------------------------------------------------------------------------
    Case("snapshot: solverstate missing", train("--snapshot", "nope.solverstate",
                                                solver="../train_a.prototxt"),
         ["nope.solverstate", "does not exist"]),
    Case("snapshot: solverstate of another net", train(
        "--snapshot", "../snap/b_iter_1.solverstate", solver="../train_a.prototxt"),
        [r"b_iter_1\.solverstate", "another net", "layer 'ip'", r"\(5, 16\)", r"\(3, 16\)"]),
    Case("snapshot: manifest mismatch (torn)", train(
        "--snapshot", "../snap/torn_iter_1.solverstate", solver="../train_a.prototxt"),
        [r"torn_iter_1\.manifest\.json", r"torn_iter_1\.caffemodel", "checksum"]),
    Case("snapshot: caffemodel cut at a layer boundary", train(
        "--snapshot", "../snap/cut_iter_1.solverstate", solver="../train_a.prototxt"),
        [r"cut_iter_1\.caffemodel", "no weights", "'ip'", "resume from an earlier"]),
    Case("snapshot: manifest of the wrong shape", train(
        "--snapshot", "../snap/shape_iter_1.solverstate", solver="../train_a.prototxt"),
        [r"shape_iter_1\.manifest\.json", "does not list files", "resume from an earlier"]),
    Case("snapshot: disk full", ["train", "--solver", "s.prototxt"],
         [r"snap/full_iter_1\.caffemodel", "disk is full"],
         files={"s.prototxt": SOLVER.format(net="../ip.prototxt").replace(
             "snapshot_after_train: false", 'snapshot_prefix: "snap/full"')},
         env={"PYTHONPATH_FIRST": "disk_full"}),
    Case("snapshot: not a solverstate (garbage)", train(
        "--snapshot", "../garbage.solverstate", solver="../train_a.prototxt"),
        [r"garbage\.solverstate", "not a"]),
    # -- command-line values ----------------------------------------------------------------------
    Case("flag: --iterations 0", ["time", "--model", "../ip.prototxt", "--iterations", "0"],
         ["--iterations", "positive integer", "'0'"]),
    Case("flag: --iterations -3", ["test", "--model", "../ip.prototxt", "--weights",
                                   "../ip.caffemodel", "--iterations", "-3"],
         ["--iterations", "'-3'"]),
    Case("flag: --iterations ten", ["time", "--model", "../ip.prototxt", "--iterations", "ten"],
         ["--iterations", "'ten'"]),
    Case("flag: --gpu garbage", ["time", "--model", "../ip.prototxt", "--gpu", "first"],
         ["--gpu", "'first'"]),
    Case("flag: --gpu 99 (no such device)", ["time", "--model", "../ip.prototxt", "--gpu", "99"],
         ["--gpu|GPU", "99|CuPy"]),
    Case("flag: --workers 0", train("--workers", "0"), ["--workers", "'0'"]),
    Case("flag: --servers -1", train("--workers", "2", "--servers", "-1"), ["--servers", "'-1'"]),
    Case("flag: --bandwidth fast", train("--workers", "2", "--bandwidth", "fast"),
         ["--bandwidth", "'fast'", "1Gbit"]),
    Case("flag: --timeout -3", train("--workers", "2", "--timeout", "-3"), ["--timeout", "'-3'"]),
    Case("flag: --kv-pair-bytes 0", train("--workers", "2", "--kv-pair-bytes", "0"),
         ["--kv-pair-bytes", "'0'"]),
    Case("flag: --slice-bytes 100", train("--workers", "2", "--slice-bytes", "100"),
         ["--slice-bytes", "'100'", "4096"]),
    Case("flag: --credit-bytes 0", train("--workers", "2", "--credit-bytes", "0"),
         ["--credit-bytes", "'0'"]),
    Case("flag: --priority first", train("--workers", "2", "--priority", "first"),
         ["--priority", "'first'", "on"]),
    Case("flag: --sync bogus", train("--workers", "2", "--sync", "bogus"),
         ["--sync", "'bogus'", "hybrid"]),
    Case("flag: --sigint_effect garbage", train("--sigint_effect", "garbage"),
         ["--sigint_effect", "'garbage'", "stop"]),
    Case("flag: --weights with --snapshot", train("--weights", "../ip.caffemodel", "--snapshot",
                                                  "x.solverstate"), ["--weights", "--snapshot"]),
    Case("flag: unknown --phase", ["summary", "--model", "../ip.prototxt", "--phase", "VAL"],
         ["phase", "'VAL'", "TRAIN or TEST"]),
    Case("flag: --bandwidth inf (a cap)", train("--workers", "2", "--bandwidth", "inf"),
         ["--bandwidth", "infinite", "1Gbit"]),
    Case("env: POSEIDON_THREADS=abc", ["train", "--demo", "--workdir", "demo"],
         ["POSEIDON_THREADS", "'abc'", "positive whole number"],
         env={"POSEIDON_THREADS": "abc"}),
    Case("env: POSEIDON_CONV=direct", ["time", "--model", "../ip.prototxt", "--iterations", "1"],
         ["POSEIDON_CONV", "'direct'", "auto, im2col"], env={"POSEIDON_CONV": "direct"}),
]
assert len({c.name for c in CASES}) == len(CASES)


def run_case(case, base):
    folder = base / re.sub(r"\W+", "_", case.name)
    folder.mkdir()
    for name, text in case.files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    env = dict(os.environ)
    paths = [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    if "PYTHONPATH_FIRST" in case.env:
        paths.insert(0, str(base / case.env["PYTHONPATH_FIRST"]))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update({k: v for k, v in case.env.items() if k != "PYTHONPATH_FIRST"})
    return subprocess.run([sys.executable, "-m", "poseidon.tools.cli", *case.argv], cwd=str(folder),
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad_input")
    make_base(base)
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = {case.name: pool.submit(run_case, case, base) for case in CASES}
        return {name: f.result() for name, f in futures.items()}


def message_lines(stderr):
    """The lines a user reads: glog INFO lines (I1123 ...) of the training log left out."""
    return [line for line in stderr.splitlines()
            if line.strip() and not re.match(r"I\d{4} ", line) and not line.startswith("usage:")
            and not line.startswith("  ")]


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.xfail(reason=c.known_gap, strict=True)) if c.known_gap
    else c for c in CASES], ids=[c.name for c in CASES])
def test_bad_input_gives_one_clear_line(case, results):
    result = results[case.name]
    err = result.stderr
    assert "Traceback" not in err, err
    if case.warn:
        assert result.returncode == 0, err
        found = [line for line in message_lines(err) if "warning" in line.lower()
                 or line.startswith("W")]
    else:
        assert result.returncode > 0, f"exit {result.returncode} (< 0: killed by a signal)\n{err}"
        found = [line for line in message_lines(err) if "error:" in line]
    assert len(found) == 1, f"expected one message line, got:\n{err}"
    line = found[0]
    text = re.sub(r"^poseidon \w+: (error|warning): ", "", line)
    assert len(text) <= 400, f"message too long ({len(text)} chars): {line}"
    for pattern in case.patterns:
        assert re.search(pattern, line), f"{pattern!r} not in {line!r}"
    assert re.search(WHAT_TO_DO, line, re.I), f"the message does not say what to do: {line!r}"


def test_print_summary_table(results):
    width = max(len(c.name) for c in CASES)
    print(f"\n{'case':{width}s}  exit  message (first line)")
    clear = 0
    for case in CASES:
        result = results[case.name]
        lines = message_lines(result.stderr)
        wanted = [x for x in lines if ("error:" in x) or ("warning" in x.lower())] or lines or [""]
        first = wanted[0]
        ok = "Traceback" not in result.stderr and (result.returncode != 0) != case.warn
        clear += ok
        print(f"{case.name:{width}s}  {result.returncode:4d}  {first[:160]}")
    print(f"{clear}/{len(CASES)} cases exit as expected without a traceback")
    assert clear == len(CASES)
