"""Caffe's smoothed loss: the displayed loss, averaged over the last average_loss iterations.

On numpy it is updated every iteration as Caffe does (Solver::UpdateSmoothedLoss). On a GPU each
iteration's loss is a device scalar, and reading it would make the host wait for the step: the
window keeps the scalars themselves and averages them when the value is read (the display, the
progress bar at a display), equal to Caffe's running update up to rounding.
"""
import numpy

from .. import backend


class SmoothedLoss:
    def __init__(self, xp=numpy):
        self.xp = xp
        self.reset()

    def reset(self, value=0.0):
        self.losses = []
        self._value = value
        self._pending = False          # device losses added since the value was computed

    def add(self, loss, index, window):
        """The loss of the index-th iteration since the reset, averaged over `window`
        (average_loss, read each time as Caffe does)."""
        losses = self.losses
        if self.xp is not numpy:
            if len(losses) < window:
                losses.append(loss)
            else:
                losses[index % window] = loss
            self._pending = True
            return
        if len(losses) < window:
            losses.append(loss)
            size = len(losses)
            self._value = (self._value * (size - 1) + loss) / size
        else:
            idx = index % window
            self._value += (loss - losses[idx]) / window
            losses[idx] = loss

    @property
    def value(self):
        if self._pending:
            xp = self.xp
            values = backend.to_numpy(xp.stack([xp.asarray(v).reshape(()) for v in self.losses]))
            self._value = float(numpy.mean(values.astype(numpy.float64)))
            self._pending = False
        return self._value
