"""Convolution and Deconvolution, and the routes their arithmetic can take.

- layer.py: the two layers (Caffe's parameters, shapes, errors), which hand the work to a core;
- columns.py: im2col + GEMM in channels-last columns, for any geometry, with planar.py (Caffe's
  own column layout for narrow inputs) and pointwise.py (1x1 kernels, no columns);
- fourier.py: stride-1 layers in the frequency domain, the DFTs as small GEMMs;
- winograd.py: 3x3 stride-1 layers by Winograd's F(2x2, 3x3);
- routes.py: which route a layer takes (POSEIDON_CONV), and the sizes im2col cuts its work into;
- bias.py: the bias gradient every route shares.

Importing this package registers the layer types.
"""
from .layer import ConvolutionLayer, DeconvolutionLayer  # noqa: F401
