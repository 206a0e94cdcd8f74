"""Poseidon: a Caffe-style layer engine on numpy or CuPy with Poseidon's distributed training built in.

The repository keeps its folders at the top (engine/, dist/, models/, prototxt/, tools/); setup.cfg
installs them under this one namespace:

    poseidon.engine   layers, Net, solvers, Caffe's file formats (reads like pycaffe)
    poseidon.dist     wait-free backpropagation, parameter server, sufficient-factor broadcasting
    poseidon.models   the builders that write prototxt/
    poseidon.tools    the `poseidon` command line and the benchmark

    from poseidon import engine as caffe
    net = caffe.Net("deploy.prototxt", caffe.TEST, weights="w.caffemodel")
"""
__version__ = "0.2.0"
