"""CUDA graphs for the stretches of a GPU training step between its GEMMs.

A cifar10_quick step on a GPU is a few hundred small kernels; each costs the host a few
microseconds to launch, which is as long as many of them run. A CUDA graph launches a recorded
sequence of kernels in one call. CuPy captures one with `stream.begin_capture()` ...
`stream.end_capture()` on a non-blocking stream, but its cuBLAS wrapper refuses to run during a
capture, so a step with GEMMs in it cannot be one graph. Here a step's forward and backward are
cut into *calls* (each layer's forward, the clearing of the gradients, the loss, each layer's
backward: what Solver.forward_backward runs) and the calls into *segments*: a maximal run of
calls that may be captured becomes one graph, captured once and replayed every iteration after;
the other calls run eagerly between the graphs. A call runs eagerly when it

- launches a GEMM (counted through engine/gemm.py, and by the stand-in's GEMM count);
- keeps an array it allocated (its memory would be the graph's, and a step that allocates anew
  each time would see its new array ignored by the replay); then the layer's other call too,
  which may read that array (the softmax loss keeps label indices its backward reads). The
  loss, a fresh 0-d array the step returns, is eager by declaration;
- belongs to a layer with no bottoms (a data layer copies from the host, whose buffer the graph
  would keep) or a Python layer, or is the forward of a layer that draws from the host's random
  stream (a replay would repeat the captured draw; Dropout's backward reads the draw from a
  device buffer, so it may be captured).

How it goes: `warmup` eager iterations (the first allocates the buffers), the last of them
watched call by call (GEMMs, and bytes kept through a pool of the graphs' own); then each
segment is captured (the captured kernels do not run: the graph is launched right after) and
replayed. Before a replay the arrays the segment was captured on are compared with those now:
every blob its layers touch, and the arrays its layers hold in their attributes (following the
layers' own objects, such as a BatchNorm + Scale pair's shared state). A reshape (or any blob
given a new array) drops the graphs and the solver warms up and captures again; a layer that
holds a new array (another call keeps replacing it) finishes that step eagerly, is named in one
log line and runs eagerly from then on. A capture that fails (a GEMM or a host read nobody
planned for, a kept allocation) is ended, the segment's calls rerun eagerly, and the offending
call is planned eagerly from then on, with one log line naming its layer.

Memory: captures allocate through a CuPy MemoryPool of the graphs' own, so the temporaries a
graph's kernels use are never handed to code outside the graphs (the default pool would give
them to the next eager allocation on the stream, which a replay would then overwrite).

On with `poseidon train --cuda-graphs on`, POSEIDON_CUDA_GRAPHS=on or
settings.configure(cuda_graphs=True) (engine/settings.py); off by default until a device run
shows a gain. It applies to a solver training alone on one device with iter_size 1 and no layer
updated from its sufficient factors; any other step runs Solver.forward_backward unchanged.
poseidon/testing/fake_graphs.py gives the counting stand-in the same capture API, so
tests/engine/test_cuda_graphs.py checks all this on the CPU.
"""
import logging
import weakref

from . import gemm, settings

log = logging.getLogger("poseidon")

ENV = settings.VARIABLES["cuda_graphs"]
WARMUP = 2              # eager steps before a capture: the first allocates, the last is watched
MAX_RESETS = 8          # recaptures before the graphs give up on a solver whose blobs keep moving
_EAGER_TYPES = ("Python",)
KEEPS = "keeps an array it allocated"
_LAYER_MODULES = __name__.rsplit(".", 1)[0] + ".layers"     # whose objects held_arrays follows


def enabled():
    """Whether the settings ask for graphs (POSEIDON_CUDA_GRAPHS=on; default off)."""
    return settings.current().cuda_graphs


_graphs = weakref.WeakKeyDictionary()     # solver -> its StepGraphs or OFF (a cache)
OFF = "off"


def forward_backward(solver):
    """Solver.forward_backward(), its segments replayed as CUDA graphs when graphs are on and
    the step is one they apply to; the mean loss either way."""
    graphs = _graphs.get(solver)
    if graphs is None:          # decided once per solver (OFF: the environment is not read again)
        on = enabled() and solver.on_device and StepGraphs.supported(solver.net.xp)
        graphs = _graphs[solver] = StepGraphs(solver) if on else OFF
    if graphs is OFF:
        return solver.forward_backward()
    return graphs.forward_backward()


class Call:
    """One call of a step: `run()` does it; `layer` names the layer for the log and `way` says
    'forward' or 'backward'; `eager`, when given, says why it never goes into a graph."""

    def __init__(self, label, layer, run, eager=None, way=None):
        self.label, self.layer, self.run, self.eager, self.way = label, layer, run, eager, way

    def __repr__(self):
        return self.label


class Segment:
    """Calls replayed as one graph, and the arrays it was captured on (StepGraphs._arrays)."""

    def __init__(self, indices):
        self.indices = indices
        self.graph = None
        self.arrays = None


class StepGraphs:
    """A solver's step as segments of captured calls between eager ones (module docstring)."""

    def __init__(self, solver, warmup=WARMUP):
        self.solver, self.net, self.xp = solver, solver.net, solver.net.xp
        cuda = self.xp.cuda
        self.stream = cuda.Stream(non_blocking=True)
        self.pool = cuda.MemoryPool()
        self.warmup = max(1, int(warmup))
        self.forced = {}             # call index -> why it runs eagerly whatever the plan says
        self.resets = 0
        self.disabled = False
        self._loss = None
        self.calls = self._calls()
        self._drop("start")

    @staticmethod
    def supported(xp):
        cuda = getattr(xp, "cuda", None)
        return (hasattr(cuda, "Stream") and hasattr(cuda, "MemoryPool")
                and hasattr(cuda, "using_allocator"))

    # ----- the calls of one step, in Solver.forward_backward's order --------------------------
    def _calls(self):
        solver, net = self.solver, self.net
        group, last = solver.replicas, len(net.layers) - 1
        calls = []
        for li, layer in enumerate(net.layers):
            calls.append(Call(f"forward of layer '{layer.name}'", layer,
                              lambda li=li: group.forward_layer(li, alone=li == last),
                              way="forward"))
        calls.append(Call("clearing the gradients", None, solver._clear_gradients))
        calls.append(Call("the loss", None, self._take_loss,
                          eager="returns the step's loss (a new array each step)"))
        for li in range(last, -1, -1):
            calls.append(Call(f"backward of layer '{net.layers[li].name}'", net.layers[li],
                              lambda li=li: self._backward(li), way="backward"))
        return calls

    def _take_loss(self):
        self._loss = self.solver.replicas.loss()

    def _backward(self, li):
        self.solver.replicas.backward_layer(li, False, reduce=True)

    def applies(self):
        """Whether this iteration's step is one the graphs replay (else the solver's own)."""
        s = self.solver
        return (not self.disabled and s.hooks.passive and s.param.iter_size == 1
                and s.replicas.count == 1 and not s._factored)

    # ----- the step -------------------------------------------------------------------------------
    def forward_backward(self):
        if not self.applies():
            return self.solver.forward_backward()
        null = self.xp.cuda.Stream.null
        self.stream.wait_event(null.record())         # after the last update, on the null stream
        with self.stream:
            if self.seen < self.warmup - 1:
                self._run_eagerly(range(len(self.calls)))
            elif self.plan is None:
                self._observe()
            else:
                self._run_plan()
            self.seen += 1
            done = self.stream.record()
        null.wait_event(done)                          # the update waits for the step
        loss, self._loss = self._loss, None
        return loss

    def _run_eagerly(self, indices):
        for i in indices:
            self.calls[i].run()

    def _observe(self):
        """An eager iteration that watches each call: GEMMs, and arrays it keeps (allocated
        through the graphs' pool and alive when it returns). Then the plan."""
        eager = dict(self.forced)
        for i, call in enumerate(self.calls):
            why = self.forced.get(i) or self._static_reason(call)
            before_gemms, before_bytes = self._gemms(), self.pool.used_bytes()
            with self.xp.cuda.using_allocator(self.pool.malloc):
                call.run()
            if why is None and self._gemms() != before_gemms:
                why = "GEMM"
            if why is None and self.pool.used_bytes() > before_bytes:
                why = KEEPS
                if call.layer is not None:
                    log.info(f"CUDA graphs: the {call.label} {KEEPS} in a warmed-up step; "
                             f"the layer runs eagerly")
            if why is not None:
                eager.setdefault(i, why)
        self._with_partners(eager)
        self.plan = self._segments(eager)
        self._eager = eager
        kept = [c for seg in self.plan if isinstance(seg, Segment) for c in seg.indices]
        log.info(f"CUDA graphs: {sum(isinstance(s, Segment) for s in self.plan)} segments of "
                 f"{len(kept)} calls captured, {len(eager)} calls eager")

    def _with_partners(self, eager):
        """A layer that keeps a new array from one of its calls may read it in the other (a
        loss layer's forward keeps the label indices its backward reads): a graph would read
        the array of the step it was captured in, so both calls of that layer run eagerly."""
        for i, why in list(eager.items()):
            if self.calls[i].layer is None or KEEPS not in why:
                continue
            for j, other in enumerate(self.calls):
                if other.layer is self.calls[i].layer and j not in eager:
                    eager[j] = f"its {self.calls[i].way} {why}"

    def _static_reason(self, call):
        layer = call.layer
        if layer is None:
            return call.eager
        if not self.net.bottom_vecs[self.net.layers.index(layer)]:
            return "a source layer (host data)"
        if layer.type in _EAGER_TYPES:
            return f"a {layer.type} layer"
        if call.way == "forward" and getattr(layer, "draws_random", False):
            return "draws from the host's random stream"
        return None

    def _gemms(self):
        count = gemm.calls_made()
        return count + getattr(self.xp, "by_kind", {}).get("gemm", 0)

    def _segments(self, eager):
        """The plan: call indices that run eagerly, and Segments of the runs between them."""
        plan, run = [], []
        for i in range(len(self.calls)):
            if i in eager:
                if run:
                    plan.append(Segment(run))
                    run = []
                plan.append(i)
            else:
                run.append(i)
        if run:
            plan.append(Segment(run))
        return plan

    def _run_plan(self):
        for k, item in enumerate(self.plan):
            if not isinstance(item, Segment):
                self.calls[item].run()
            elif item.graph is None:
                if not self._capture(item):
                    self._replan_after(k)
                    return
            else:
                moved = self._moved(item)
                if moved is None:
                    item.graph.launch(self.stream)
                else:
                    self._run_rest_eagerly(k, *moved)
                    return

    def _capture(self, segment):
        """Capture the segment's calls and launch the graph (a capture runs nothing). False when
        the capture failed: the calls then ran eagerly and the culprit is forced eager."""
        failed = None
        self.stream.begin_capture()
        try:
            with self.xp.cuda.using_allocator(self.pool.malloc):
                for i in segment.indices:
                    before = self.pool.used_bytes()
                    try:
                        self.calls[i].run()
                    except Exception as e:            # cuBLAS or a host read refused in capture
                        failed = (i, f"cannot be captured ({type(e).__name__}: {e})")
                        break
                    if self.pool.used_bytes() > before:
                        failed = (i, KEEPS)
                        break
        finally:
            try:
                graph = self.stream.end_capture()
            except Exception as e:                    # a refused host read invalidates a capture
                if failed is None:
                    failed = (segment.indices[-1], f"ended its capture with {type(e).__name__}")
        if failed is not None:
            i, why = failed
            log.warning(f"CUDA graphs: the {self.calls[i].label} {why}; it runs eagerly")
            self.forced[i] = why
            self._with_partners(self.forced)
            self._run_eagerly(segment.indices)
            return False
        segment.graph = graph
        segment.arrays = self._arrays(segment)
        graph.launch(self.stream)
        return True

    def _replan_after(self, k):
        """A capture failed at plan item k (its calls ran eagerly): finish the step eagerly and
        plan again from the next iteration's watched step."""
        for item in self.plan[k + 1:]:
            self._run_eagerly(item.indices if isinstance(item, Segment) else [item])
        self.plan, self.seen = None, self.warmup - 2

    def _run_rest_eagerly(self, k, layer, what):
        """An array segment k was captured on is elsewhere now: finish the step eagerly and
        capture again; an array a layer holds that moved makes that layer eager for good."""
        for item in self.plan[k:]:
            self._run_eagerly(item.indices if isinstance(item, Segment) else [item])
        if layer is None:
            self._drop("a blob has a new array or shape")
            return
        why = f"holds a new array in '{what}' each step"
        log.warning(f"CUDA graphs: layer '{layer.name}' {why}; its calls run eagerly")
        for j, call in enumerate(self.calls):
            if call.layer is layer:
                self.forced[j] = why
        self._drop(f"layer '{layer.name}' {why}")

    # ----- the arrays a segment touches -----------------------------------------------------------
    def _blobs(self, segment):
        net, blobs = self.net, {}
        for i in segment.indices:
            layer = self.calls[i].layer
            if layer is None:                   # clearing the gradients: the parameters
                for blob in net.learnable_params:
                    blobs[id(blob)] = blob
                continue
            li = net.layers.index(layer)
            for blob in list(net.bottom_vecs[li]) + list(net.top_vecs[li]) + list(layer.blobs):
                blobs[id(blob)] = blob
        return list(blobs.values())

    def _arrays(self, segment):
        """{key: (layer, what, where)} of the arrays the segment was captured on: its blobs'
        data and diff (layer None), and the arrays its layers hold (saved state, a pair's)."""
        touched = {}
        for blob in self._blobs(segment):
            touched[("data", id(blob))] = (None, "a blob", _where(blob.data))
            touched[("diff", id(blob))] = (None, "a blob", _where(blob.diff))
        layers = {id(c.layer): c.layer for c in (self.calls[i] for i in segment.indices)
                  if c.layer is not None}
        for layer in layers.values():
            for what, array in held_arrays(layer, self.xp.ndarray):
                touched[(id(layer), what)] = (layer, what, _where(array))
        return touched

    def _moved(self, segment):
        """(layer, what) of the first array the segment was captured on that is elsewhere (or
        shaped otherwise) now; None when all are where they were."""
        now = self._arrays(segment)
        for key, (layer, what, where) in segment.arrays.items():
            if key not in now or now[key][2] != where:
                return layer, what
        return None

    def _drop(self, why):
        """Forget the graphs; warm up and capture again."""
        if getattr(self, "plan", None) is not None:
            self.resets += 1
            if self.resets > MAX_RESETS:
                self.disabled = True
                log.warning(f"CUDA graphs: off for this run ({why} at every capture)")
            else:
                log.info(f"CUDA graphs: capturing again ({why})")
        self.plan, self.seen, self._eager = None, 0, {}

    # ----- what tests and the probe read ----------------------------------------------------------
    def describe(self):
        """(segments, eager calls as {label: why}) of the current plan; None before it."""
        if self.plan is None:
            return None
        segments = [[self.calls[i].label for i in s.indices]
                    for s in self.plan if isinstance(s, Segment)]
        return segments, {self.calls[i].label: why for i, why in self._eager.items()}


def held_arrays(layer, array_type, depth=3):
    """(path, array) of the device arrays a layer holds in its attributes, following the
    objects of the layers' own modules (a BatchNorm + Scale pair's state) a few levels down."""
    found, seen = [], set()

    def walk(value, path, left):
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, array_type):
            found.append((path, value))
            return
        if left == 0:
            return
        if isinstance(value, (list, tuple)):
            items = enumerate(value)
        elif isinstance(value, dict):
            items = value.items()
        elif type(value).__module__.startswith(_LAYER_MODULES):
            items = getattr(value, "__dict__", {}).items()
        else:
            return
        for key, item in list(items):
            walk(item, f"{path}.{key}" if path else str(key), left - 1)
    walk(layer, "", depth)
    return found


def _where(array):
    """Where an array's memory is and how it is laid out: a replay needs the same."""
    if array is None:
        return None
    ptr = getattr(getattr(array, "data", None), "ptr", None)
    if ptr is None:
        ptr = array.__array_interface__["data"][0]
    return ptr, array.shape, array.strides


def graphs_of(solver):
    """The solver's StepGraphs, if graphs ran for it (else None)."""
    graphs = _graphs.get(solver)
    return None if graphs is OFF else graphs
