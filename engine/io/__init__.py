"""Readers and writers for Caffe's on-disk formats (weights, solver state, means, Datum)."""
