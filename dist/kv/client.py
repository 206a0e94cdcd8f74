"""The worker's side of the KV store (ps-lite's KVWorker): init, push, pull, and the state fetch.

Every exchange between a worker and the servers goes through here, whoever starts it: the PS scheme
pushes a layer's gradient and pulls its new values each iteration; worker 0 initialises the servers
when the job starts and fetches the solver state they keep for a snapshot. The book says which KV
pairs exist (a parameter cut into slices of at most --kv-pair-bytes) and on which server each lives;
a bundle is the pairs of one layer on one server that travel as one message.
"""
import numpy

from ..transport import Msg


def bundle_text(key, count):
    """'KV pair 7', or 'KV pair 7 (+2 more in its message)', for waits and errors."""
    if count == 1:
        return f"KV pair {key}"
    return f"KV pair {key} (+{count - 1} more in its message)"


class KVClient:
    """One worker's handle on the servers of a job. `slow`: the seconds start-up and snapshot
    exchanges may take (they wait on every server at once)."""

    def __init__(self, transport, book, roles, slow):
        self.transport, self.book, self.roles = transport, book, roles
        self.slow = slow
        self._get_seq = 0

    def server_rank(self, index):
        return self.roles.server_rank(index)

    # ----- every iteration (the PS scheme) -----------------------------------------------------------
    def push(self, server, key, it, arrays=None, shared=False):
        """Send bundle `key`'s gradients of iteration it: its arrays (sent zero-copy), or with
        shared=True a header alone (the gradients are already in the server's shared memory).
        Returns the send's receipt."""
        if shared:
            return self.transport.send(server, Msg.KV_PUSH, iteration=it, key=key, shared=True)
        return self.transport.send(server, Msg.KV_PUSH, iteration=it, key=key, arrays=arrays)

    def pull(self, server, key, it, what, spin=0.0):
        """The server's answer to bundle `key`'s push of iteration it: the new values."""
        return self.transport.receive(Msg.KV_VALUE, key, it, senders=[server], what=what,
                                      spin=spin)[0]

    # ----- start and snapshots (worker 0) ------------------------------------------------------------
    def init(self, it, values_of, pairs=None):
        """Give every KV pair (or those of `pairs`: a layer that moves onto the servers) its value
        and solver history, for iteration it. values_of(param id): the flat host arrays [value,
        history...] of that parameter (asked once a parameter). Waits until every server has
        acknowledged."""
        t, cache = self.transport, {}
        for pair in self.book.pairs if pairs is None else pairs:
            pid = pair.param
            if pid not in cache:
                cache[pid] = values_of(pid)
            off, n = pair.offset, pair.length
            t.send(self.server_rank(pair.server), Msg.KV_INIT, iteration=it, key=pair.id,
                   arrays=[a[off:off + n] for a in cache[pid]])
        servers = self.roles.server_ranks()
        for r in servers:
            t.send(r, Msg.KV_INIT_DONE, iteration=it)
        for index, r in enumerate(servers):
            t.receive(Msg.KV_INIT_ACK, index, it, timeout=self.slow, senders=[r],
                      what="the acknowledgement of the parameter initialisation")

    def fetch_state(self, counts, dtype, history_len, pids=None):
        """The value and solver history the servers keep, per parameter (every one on the
        servers, or those of `pids`): {param id: [value, history...]} as flat host arrays.
        counts[pid]: the parameter's size; history_len(pid): how many history arrays its rule
        keeps."""
        t = self.transport
        seq = self._get_seq
        self._get_seq += 1
        pairs = [p for p in self.book.pairs if pids is None or p.param in pids]
        for pair in pairs:
            t.send(self.server_rank(pair.server), Msg.KV_GET, iteration=seq, key=pair.id)
        hosts = {}
        for pair in pairs:
            pid = pair.param
            msg = t.receive(Msg.KV_GET_REPLY, pair.id, seq, timeout=self.slow,
                            senders=[self.server_rank(pair.server)],
                            what=f"the solver state of KV pair {pair.id} for the snapshot")[0]
            if pid not in hosts:
                hosts[pid] = [numpy.empty(counts[pid], dtype) for _ in range(history_len(pid) + 1)]
            off, n = pair.offset, pair.length
            for k, h in enumerate(hosts[pid]):
                h[off:off + n] = msg.arrays[k]
        return hosts

    def shutdown(self):
        """Tell every server the job is over (worker 0, at the end)."""
        for r in self.roles.server_ranks():
            self.transport.send(r, Msg.KV_SHUTDOWN)
