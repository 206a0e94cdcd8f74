"""Input layers: Input (shapes given in the model) and Data (records from LMDB)."""
import copy
import json
import os
import queue
import threading
import weakref

import numpy
from numpy.lib.stride_tricks import sliding_window_view

from .. import rng
from ..errors import DataError
from ..io.caffemodel import read_binaryproto
from ..io.batch import decode_batch
from ..io.lmdb_store import ShardedReader
from ..layer import TRAIN, Layer
from ..registry import register


@register("Input")
class InputLayer(Layer):
    """Tops of fixed shapes that the caller fills (net-level `input:` is upgraded to this)."""

    exact_bottoms = 0
    min_tops = 1

    def layer_setup(self, bottom, top):
        shapes = self.param.input_param.shape
        if len(shapes) not in (1, len(top)):
            raise self.error(f"gives {len(shapes)} shapes for {len(top)} tops: give one shape, "
                             f"or one per top")
        for i, t in enumerate(top):
            t.reshape(tuple(shapes[0 if len(shapes) == 1 else i].dim))

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass


# ------------------------------------------------------------------------------------------------
# Data: records from an LMDB source, transformed as Caffe's DataTransformer does
# ------------------------------------------------------------------------------------------------
def _rng_state_to_json(state):
    """numpy bit-generator state -> JSON-able dict (128-bit integers as decimal strings)."""
    def conv(v):
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, bool) or not isinstance(v, (int, numpy.integer)):
            return v
        return str(int(v))
    return conv(state)


def _rng_state_from_json(state):
    def conv(k, v):
        if isinstance(v, dict):
            return {kk: conv(kk, x) for kk, x in v.items()}
        if k != "bit_generator" and isinstance(v, str):
            return int(v)
        return v
    return conv(None, state)


def _prefetch_loop(layer_ref, out_queue, stop):
    """Background producer: prepares batches in order; holds the layer only while producing."""
    while not stop.is_set():
        layer = layer_ref()
        if layer is None:
            return
        try:
            item = layer._produce()
        except BaseException as e:          # handed to forward(), which raises it
            item = e
        del layer
        while not stop.is_set():
            try:
                out_queue.put(item, timeout=0.05)
                break
            except queue.Full:
                if layer_ref() is None:
                    return
        if isinstance(item, BaseException):
            return


@register("Data")
class DataLayer(Layer):
    """Batches of Datum records from an LMDB source (Caffe's Data layer), with prefetching.

    data_param: source, batch_size, backend (LMDB; LEVELDB refused; unset -> LMDB when the source
    is one), rand_skip, prefetch (queue depth of the background thread; 0 reads in forward), and
    the legacy scale/mean_file/crop_size/mirror (used as transform_param fields, as Caffe's
    upgrade moves them). transform_param as Caffe's DataTransformer: per sample, crop (random
    offsets in TRAIN, centre in TEST) -> subtract mean (mean_file at the uncropped source pixel, or
    mean_value per channel) -> multiply by scale; mirror (random, p = 1/2, in every phase when
    enabled) only permutes output columns. Done with array operations on the whole batch.

    Randomness: the layer's own numpy Generator, seeded from engine.rng at setup, used only by the
    producer, in batch order (per batch: rand_skip once at setup, then crop offsets for N samples
    when cropping in TRAIN, then N mirror flags when mirror is on), so results never depend on
    thread timing. Sharding: reads `self.shard` = (rank, size) set by the Net (default (0, 1)); see
    engine.io.lmdb_store.ShardedReader for the rule. get_cursor()/set_cursor() save and restore the
    position and RNG state of the next batch forward() will return.
    """

    exact_bottoms = 0
    min_tops = 1
    max_tops = 2

    def _fail(self, message):
        return DataError(f"layer '{self.name}' (type Data): {message}")

    # ----- set-up -------------------------------------------------------------------------------
    def layer_setup(self, bottom, top):
        from ..proto import caffe_pb2
        dp = self.param.data_param
        tp = caffe_pb2.TransformationParameter()
        tp.CopyFrom(self.param.transform_param)
        for name in ("scale", "mean_file", "crop_size", "mirror"):   # Caffe's upgrade
            if dp.HasField(name):
                setattr(tp, name, getattr(dp, name))
        if not dp.source:
            raise self.error("data_param.source is not set: give the LMDB directory to read")
        if not dp.batch_size:
            raise self.error("data_param.batch_size is not set: give a positive batch size")
        if dp.HasField("backend") and dp.backend == caffe_pb2.DataParameter.LEVELDB:
            raise self._fail(f"backend: LEVELDB is given for '{dp.source}', but LevelDB is not "
                             f"supported: convert the data to LMDB (Caffe's tools with "
                             f"--backend=lmdb, or `poseidon data …`) and set `backend: LMDB`")
        if tp.force_color and tp.force_gray:
            raise self.error("transform_param sets both force_color and force_gray: keep one")
        self.source = dp.source
        self.batch_size = int(dp.batch_size)
        self.prefetch = int(dp.prefetch)
        self.scale = float(tp.scale)
        self.mirror = bool(tp.mirror)
        self.crop_size = int(tp.crop_size)
        self.color = (True if tp.force_color or dp.force_encoded_color
                      else False if tp.force_gray else None)
        self.mean_values = [float(v) for v in tp.mean_value]
        self.mean = None
        if tp.mean_file and self.mean_values:
            raise self.error("transform_param gives both mean_file and mean_value: keep one")
        if tp.mean_file:
            self.mean = self._read_mean(tp.mean_file)

        rank, size = getattr(self, "shard", (0, 1))
        try:
            self._reader = ShardedReader(self.source, int(rank), int(size))
        except DataError as e:
            note = ("" if dp.HasField("backend") else
                    " (no backend given: Caffe's default is LEVELDB; Poseidon reads LMDB only)")
            raise self._fail(f"{e}{note}") from None
        self._gen = numpy.random.Generator(numpy.random.PCG64(
            int(rng.generator().integers(0, 2 ** 63))))
        if dp.rand_skip:
            self._reader.skip(int(self._gen.integers(0, dp.rand_skip)))

        # shape from the first record (as Caffe), checked against the transform
        first, _ = self._decode([self._reader.peek_record()])
        shape = self._out_shape(first.shape[1:], first_key=self._reader.peek_record()[0])
        top[0].reshape((self.batch_size,) + shape)
        if len(top) > 1:
            top[1].reshape((self.batch_size,))
        self._thread = None
        self._error = None
        self._consumed = self._state()
        self._start()

    def _read_mean(self, path):
        if not os.path.exists(path):
            raise self._fail(f"mean_file '{path}' does not exist: compute it from the training "
                             f"data (compute_image_mean, or engine.io.datasets.compute_mean) or "
                             f"fix the path")
        try:
            mean = numpy.asarray(read_binaryproto(path), numpy.float64)
        except ValueError as e:
            raise self._fail(f"mean_file '{path}' cannot be read: {e}") from None
        if mean.ndim == 4 and mean.shape[0] == 1:
            mean = mean[0]
        if mean.ndim != 3:
            raise self._fail(f"mean_file '{path}' holds a blob of shape {mean.shape}; a mean "
                             f"image is (1, C, H, W) or (C, H, W)")
        return mean.astype(self.dtype)

    def _out_shape(self, chw, first_key=b""):
        c, h, w = chw
        if self.mean is not None and tuple(self.mean.shape) != (c, h, w):
            raise self._fail(f"mean_file holds a mean of shape {tuple(self.mean.shape)} but "
                             f"record '{first_key.decode('utf-8', 'replace')}' of "
                             f"'{self.source}' has shape {(c, h, w)}: compute the mean of this "
                             f"data (`poseidon mean`); it has the uncropped data shape")
        if self.mean_values and len(self.mean_values) not in (1, c):
            raise self.error(f"gives {len(self.mean_values)} mean_value entries for {c}-channel "
                             f"data: give one, or one per channel")
        if self.crop_size:
            if self.crop_size > h or self.crop_size > w:
                raise self.error(f"crop_size {self.crop_size} is larger than the data "
                                 f"({h}x{w}) of '{self.source}'")
            return (c, self.crop_size, self.crop_size)
        return (c, h, w)

    # ----- producing batches --------------------------------------------------------------------
    def _state(self):
        return {"reader": self._reader.cursor(),
                "rng": _rng_state_to_json(self._gen.bit_generator.state)}

    def _transform(self, raw):
        """(N, C, H, W) uint8/float32 -> transformed (N, C, H', W') in the layer's dtype."""
        n, c, h, w = raw.shape
        crop, dtype = self.crop_size, self.dtype
        mean = self.mean
        if mean is None and self.mean_values:
            mean = numpy.asarray(self.mean_values if len(self.mean_values) == c
                                 else self.mean_values * c, dtype).reshape(c, 1, 1)
            per_pixel = False
        else:
            per_pixel = mean is not None
        if crop:
            if self.phase == TRAIN:
                h_off = self._gen.integers(0, h - crop + 1, size=n)
                w_off = self._gen.integers(0, w - crop + 1, size=n)
                rows = numpy.arange(n)
                data = sliding_window_view(raw, (crop, crop), axis=(2, 3))[rows, :, h_off, w_off]
                if per_pixel:
                    windows = sliding_window_view(mean, (crop, crop), axis=(1, 2))
                    mean = windows[:, h_off, w_off].transpose(1, 0, 2, 3)
            else:
                ho, wo = (h - crop) // 2, (w - crop) // 2
                data = raw[:, :, ho:ho + crop, wo:wo + crop]
                if per_pixel:
                    mean = mean[:, ho:ho + crop, wo:wo + crop]
        else:
            data = raw
        out = data.astype(dtype)            # a fresh array: the in-place steps below are safe
        if mean is not None:
            out -= mean
        if self.scale != 1:
            out *= dtype.type(self.scale)
        if self.mirror:
            flip = self._gen.random(n) < 0.5
            out[flip] = out[flip][..., ::-1]
        return out

    def _decode(self, records):
        """decode_batch, its errors (corrupt records, mixed shapes) naming this layer."""
        try:
            return decode_batch(records, self.source, self.color, where=self._reader.shard_of)
        except DataError as e:
            raise self._fail(str(e)) from None

    def _produce(self):
        """Read, decode and transform the next batch; returns (data, labels, state after it)."""
        try:
            records = self._reader.read(self.batch_size)
        except DataError as e:           # a damaged database file, found while reading
            raise self._fail(str(e)) from None
        raw, labels = self._decode(records)
        self._out_shape(raw.shape[1:], records[0][0])
        data = self._transform(raw)
        return data, labels.astype(self.dtype), self._state()

    def _start(self):
        self._queue = queue.Queue(maxsize=max(self.prefetch, 1))
        self._stop = threading.Event()
        if self.prefetch <= 0:
            return
        self._thread = threading.Thread(target=_prefetch_loop,
                                        args=(weakref.ref(self), self._queue, self._stop),
                                        name=f"prefetch-{self.name}", daemon=True)
        self._thread.start()

    def _halt(self):
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._thread = None

    def _next(self):
        if self._error is not None:
            raise self._error
        if self._thread is None:
            item = self._produce()
        else:
            while True:
                try:
                    item = self._queue.get(timeout=0.5)
                    break
                except queue.Empty:
                    if not self._thread.is_alive():
                        raise self._fail("the prefetch thread stopped unexpectedly") from None
        if isinstance(item, BaseException):
            self._error = item
            raise item
        return item

    # ----- the contract -------------------------------------------------------------------------
    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        data, labels, state = self._next()
        self._consumed = state
        xp = self.xp
        top[0].reshape(data.shape)
        top[0].data[...] = xp.asarray(data)
        if len(top) > 1:
            top[1].reshape(labels.shape)
            top[1].data[...] = xp.asarray(labels)

    # ----- exact resume -------------------------------------------------------------------------
    def get_cursor(self):
        """JSON-able position + RNG state of the next batch forward() will return."""
        return copy.deepcopy(self._consumed)

    def set_cursor(self, cursor):
        """Restore a get_cursor() dict: the next forward() returns the batch it described."""
        if isinstance(cursor, str):
            cursor = json.loads(cursor)
        self._halt()
        self._reader.set_cursor(cursor["reader"])
        self._gen.bit_generator.state = _rng_state_from_json(cursor["rng"])
        self._error = None
        self._consumed = copy.deepcopy(cursor)
        self._start()

    def shutdown(self):
        """Stop the prefetch thread and close the database (the layer cannot forward after)."""
        self._halt()
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.close()

    def __del__(self):
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
