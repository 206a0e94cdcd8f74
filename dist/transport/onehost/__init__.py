"""The fast paths between processes of one job that share a host, behind one boundary.

Between hosts every message goes through ZeroMQ over TCP with CURVE. Between processes of one host
and one user that costs what nothing needs: encryption the file system already makes needless, and
wake-ups of I/O and receive threads on cores that training keeps busy. Three paths avoid it, each
a step further than the one before, and each used only where a peer proves it shares this host,
boot and user (nothing is decided from the host name):

- localipc.py, Unix-socket inboxes: every process also binds its ZeroMQ inbox on a Unix socket in
  a private 0700 folder, and a peer of the same host connects there without CURVE. Gains: no
  encryption and decryption of every byte, and no TCP stack.
- directlink.py, direct links: a worker's KV push of up to directlink.MAX_BYTES goes on a Unix
  socket of the pushing thread's own, and that thread reads the server's answer from it while it
  waits. Gains: neither ZeroMQ's I/O threads nor the receive thread stand between the push and
  its answer, so the sync after the last backward waits for no extra wake-ups.
- kvshm.py, shared KV memory: a server's values and its workers' gradients live in one shared
  mapping, and a worker's parameters are views of the values. Gains: a push and its answer are
  headers alone; no byte of a parameter or gradient is copied through a socket. Only under BSP,
  with the server's `update` handler and without --bandwidth (whose experiments emulate a network
  the bytes must cross).

One flag turns them on or off, `--ipc` (dist/job/options.py); the session turns it into the
transport's local_ipc, direct_links and shared_memory arguments (dist/job/session.py):
  auto   (default) all three;
  links  inboxes and direct links, the arrays on the links (no shared memory);
  zmq    the Unix-socket inboxes only, every message through ZeroMQ;
  off    none: TCP with CURVE between every pair, as between hosts.

Nothing here knows the message format: the ZeroMQ transport decides which message takes which
path (transport/zmq_onehost.py). Wherever a path cannot be set up, or a link closes, the message
goes through ZeroMQ instead: these paths change how fast a message arrives, never whether it does.
The rest of dist reaches them only through this package.
"""
from . import directlink, kvshm, localipc
from .directlink import SPIN_SECONDS

__all__ = ["directlink", "kvshm", "localipc", "SPIN_SECONDS"]
