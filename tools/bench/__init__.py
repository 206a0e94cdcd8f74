"""`poseidon bench`: one command that measures the engine beside PyTorch CPU and writes the results.

Parts (each a module here, each a function that returns a JSON-able dict):
  a. throughput  - training images/s (forward + backward + update through engine.solvers) for
                   cifar10_quick, fc_heavy and a VGG-style block, interleaved with PyTorch CPU on the
                   same architecture, batch and thread count (torch is a benchmark-only reference);
  b. layers      - per-layer forward/backward times and, for Convolution and InnerProduct, the share
                   of the machine's GEMM peak measured in the same run (gemm.py);
  c-e. dist_parts - single-node overhead of the distributed path, KV-store push+pull versus raw
                   ZeroMQ, scaling under a bandwidth cap (through `poseidon train --workers ...`);
  f. model_ref   - the real networks of prototxt/, forward and backward beside PyTorch;
  g. hosts_part  - part e's jobs with each rank in a network namespace of its own, links capped by
                   tbf (poseidon.tools.netns), beside part e's in-process token bucket.
report.py writes results.json and results.md (the engine's sections from report_engine.py, part g's
from report_hosts.py, part h's from report_schemes.py) and the PNG plots (report_plots.py). env.py
records the machine, the BLAS kernel and threads, and the environment variables that change them.
"""
