"""A plain reference implementation for whole-net tests: direct loops, written from caffe-facts.md.

Deliberately slow and simple, sharing no code with engine/layers, so that agreement means something.
All functions take and return float64 numpy arrays in N, C, H, W layout.
"""
import math

import numpy as np


def pad(x, ph, pw):
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))


def conv_forward(x, w, b, stride=1, p=0):
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    ho = (h + 2 * p - kh) // stride + 1
    wo = (wd + 2 * p - kw) // stride + 1
    xp = pad(x, p, p)
    y = np.zeros((n, o, ho, wo))
    for i in range(ho):
        for j in range(wo):
            patch = xp[:, :, i * stride:i * stride + kh, j * stride:j * stride + kw]  # n,c,kh,kw
            y[:, :, i, j] = np.tensordot(patch, w, axes=([1, 2, 3], [1, 2, 3]))
    if b is not None:
        y += b[None, :, None, None]
    return y


def conv_backward(x, w, dy, stride=1, p=0):
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = pad(x, p, p)
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(w)
    for i in range(dy.shape[2]):
        for j in range(dy.shape[3]):
            patch = xp[:, :, i * stride:i * stride + kh, j * stride:j * stride + kw]
            g = dy[:, :, i, j]                                   # n, o
            dw += np.tensordot(g, patch, axes=([0], [0]))        # o, c, kh, kw
            dxp[:, :, i * stride:i * stride + kh, j * stride:j * stride + kw] += \
                np.tensordot(g, w, axes=([1], [0]))
    dx = dxp[:, :, p:p + h, p:p + wd]
    return dx, dw, dy.sum(axis=(0, 2, 3))


def pool_out(size, k, s, p):
    out = int(math.ceil((size + 2 * p - k) / s)) + 1
    if p and (out - 1) * s >= size + p:
        out -= 1
    return out


def pool_forward(x, k, s, p, mode):
    """Caffe pooling: ceil output; MAX ignores padding; AVE divides by the window clipped to H+pad."""
    n, c, h, w = x.shape
    ho, wo = pool_out(h, k, s, p), pool_out(w, k, s, p)
    y = np.zeros((n, c, ho, wo))
    arg = {}
    for i in range(ho):
        for j in range(wo):
            hs, ws = i * s - p, j * s - p
            he, we = min(hs + k, h + p), min(ws + k, w + p)
            size = (he - hs) * (we - ws)
            hs0, ws0, he0, we0 = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
            win = x[:, :, hs0:he0, ws0:we0].reshape(n, c, -1)
            if mode == "MAX":
                idx = win.argmax(axis=2)
                y[:, :, i, j] = win.max(axis=2)
                arg[i, j] = (hs0, ws0, we0 - ws0, idx)
            else:
                y[:, :, i, j] = win.sum(axis=2) / size
                arg[i, j] = (hs0, ws0, he0, we0, size)
    return y, arg


def pool_backward(x, dy, arg, mode):
    dx = np.zeros_like(x)
    n, c = x.shape[:2]
    for (i, j), info in arg.items():
        if mode == "MAX":
            hs0, ws0, width, idx = info
            for a in range(n):
                for b in range(c):
                    r, q = divmod(int(idx[a, b]), width)
                    dx[a, b, hs0 + r, ws0 + q] += dy[a, b, i, j]
        else:
            hs0, ws0, he0, we0, size = info
            dx[:, :, hs0:he0, ws0:we0] += dy[:, :, i:i + 1, j:j + 1] / size
    return dx


def softmax_loss(scores, labels):
    """Mean cross-entropy over the batch (Caffe's VALID normalisation, no ignore_label); grad too."""
    n = scores.shape[0]
    z = scores - scores.max(axis=1, keepdims=True)
    prob = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    loss = -sum(math.log(max(prob[i, int(labels[i])], 1e-300)) for i in range(n)) / n
    grad = prob.copy()
    for i in range(n):
        grad[i, int(labels[i])] -= 1
    return loss, grad / n


def batchnorm_train(x, eps):
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    var = ((x - mean) ** 2).mean(axis=(0, 2, 3), keepdims=True)
    xhat = (x - mean) / np.sqrt(var + eps)
    return xhat, var


def batchnorm_backward(dy, xhat, var, eps):
    m = dy.shape[0] * dy.shape[2] * dy.shape[3]
    inv = 1.0 / np.sqrt(var + eps)
    sum_dy = dy.sum(axis=(0, 2, 3), keepdims=True)
    sum_dy_xhat = (dy * xhat).sum(axis=(0, 2, 3), keepdims=True)
    return inv * (dy - sum_dy / m - xhat * sum_dy_xhat / m)
