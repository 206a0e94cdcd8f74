"""The points at which the Solver's one training loop calls out: the seam distribution plugs into.

The Solver runs Caffe's loop for everyone. A hooks object sees each iteration at fixed points and may
take over what must change when the same loop runs on one of several workers (a distributed
trainer's hooks, e.g. Algorithm 2 of the Poseidon paper). With the base class, which does
nothing, the Solver is the single-process solver. Layer indices are the net's; `it` is the iteration
being computed (the solver's `iter` before it advances).

One iteration, in order:

    begin(solver)                            each step() call, before its first iteration
    begin_iteration(solver, it)              the iteration begins; which weight gradients come
                                             from sufficient factors
    (a test or display may run here)
    for each of iter_size passes:
        before_forward(solver, it, l)        layer l's forward may need something first
        before_backward(solver, it)          first pass only: the gradients are cleared next
        after_forward(solver, it, p, loss)   pass p's loss is known; backward starts next
        after_backward(solver, it, l, p, event)   layer l's gradient of pass p is complete
    loss(solver, it, loss)                   the loss the solver displays and checks
    before_update(solver, it, loss)          wait for what the update needs; check it
    (the solver applies the update unless `updates_parameters`)

and after the iterations of each step() call, end_step(solver) (not after an error); around
them: before_test / test_batches / reduce_test for each test, snapshot /
snapshot_files / restore for snapshots, end(solver) when solve() is done.
"""


class SolverHooks:
    """No-op hooks: the solver trains alone. Subclass and override the points you need."""

    #: True when the hooks leave each parameter at its updated value themselves (a parameter
    #: server or the sufficient-factor peers did the update) and check each gradient's finiteness
    #: before it leaves: the solver then applies no update and checks only the loss.
    updates_parameters = False

    #: True when after_backward wants the device event recorded after each layer's backward (a
    #: copy on another stream must wait for it); on the CPU the event is always None.
    wants_backward_events = False

    @property
    def passive(self):
        """True when these hooks override none of the calls within a step (the single-process
        solver's): the solver may then keep the loss on the device and replay whole steps as
        CUDA graphs, since nothing outside the engine needs to see inside one."""
        return all(getattr(type(self), name) is getattr(SolverHooks, name) for name in _STEP_CALLS)

    def begin(self, solver):
        """Before the iterations of a step() call (called again after a restore)."""

    def begin_iteration(self, solver, it):
        """Iteration `it` begins (before its forward). Returns the layer indices whose weight
        gradient it makes from sufficient factors instead of the layer's own backward (the hooks
        then make it), or None to let the solver choose."""
        return None

    def before_forward(self, solver, it, layer):
        """Before layer `layer`'s forward of every pass."""

    def before_backward(self, solver, it):
        """After the first pass's forward, before the solver zeroes the parameter gradients and
        the first backward writes them: whatever still reads the last iteration's gradients (or
        anything else a backward overwrites) must be done with them when this returns."""

    def after_forward(self, solver, it, pass_index, loss):
        """After pass `pass_index`'s forward, whose loss is `loss`, before its backward."""

    def after_backward(self, solver, it, layer, pass_index, event):
        """Right after layer `layer`'s backward of pass `pass_index` (for every layer, also those
        with no backward to run). `event`: a device event recorded after it, or None."""

    def loss(self, solver, it, loss):
        """The iteration's loss as the solver displays and checks it (mean of the passes here)."""
        return loss

    def before_update(self, solver, it, loss):
        """Before the update: wait for what it needs, and raise if the iteration must stop."""

    def before_test(self, solver, index):
        """Before test net `index` runs (its shared parameters are the train net's)."""

    def test_batches(self, solver, index, batches):
        """How many of test net `index`'s `batches` (test_iter) this process runs."""
        return batches

    def reduce_test(self, solver, index, means):
        """The test outputs to report, from this process's means (a float64 vector: the loss,
        then every output blob's values)."""
        return means

    def snapshot(self, solver, write):
        """Take a snapshot; `write()` writes this process's files and returns the solverstate path."""
        return write()

    def snapshot_files(self, solver, state_file):
        """Extra files (written here) that the snapshot's manifest must cover."""
        return []

    def restore(self, solver, path, read):
        """Resume from `path`; `read(path)` loads it into this process's solver."""
        read(path)

    def end_step(self, solver):
        """After the last iteration of a step() call (also after an early exit): the caller may
        read the parameters next, so whatever is still changing them must be done."""

    def end(self, solver):
        """After solve() has trained, tested and snapshotted."""


# the calls made within a step (between begin_iteration and before_update)
_STEP_CALLS = ("begin_iteration", "before_forward", "before_backward", "after_forward",
               "after_backward", "loss", "before_update")
