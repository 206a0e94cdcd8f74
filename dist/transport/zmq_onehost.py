"""The ZeroMQ transport's use of the one-host paths (onehost/): which message takes which path.

Why apart: the paths themselves (onehost/) know nothing of messages; this is where the transport
decides, per message, whether it goes through its ZeroMQ sockets or a faster way between processes
of one host, and reads what comes back that way:
- its inbox is also bound on a Unix socket in a private folder, which a peer of this host and user
  connects to without CURVE (`_bind_one_host`, `_inbox_route`);
- a worker's KV push of up to directlink.MAX_BYTES goes on a direct link of the pushing thread's
  own, and the server's answer comes back on it for that thread to read while it waits, so neither
  ZeroMQ's I/O threads nor the receive thread are woken (`_send_direct`, `_pump_for`); messages on
  links get the same checks, counters and handlers as those from ZeroMQ;
- a server's KV values and its workers' gradients may sit in its shared memory (`kv_segment`), the
  push and its answer then being headers alone.
A link that closes, or a path that cannot be set up, leaves the message to ZeroMQ: the fast paths
never decide whether a message arrives, only how quickly.

`ZmqOneHost` is a part of ZmqTransport (its base class), apart only to keep the one-host decisions
behind the onehost/ boundary in one file; `--ipc` (through the transport's local_ipc, direct_links
and shared_memory arguments) turns them on or off.
"""
import logging
import threading

import zmq

from ..errors import DeadlineError
from .onehost import directlink, kvshm, localipc
from .wire import BadMessage, Msg, header_specs


class ZmqOneHost:
    """Binding, connecting, sending and waiting on the one-host paths, for ZmqTransport."""

    def _init_one_host(self, router, local_ipc, direct_links, shared_memory):
        self._local_wanted = bool(local_ipc) and not router and localipc.supported()
        self.local = None                            # localipc.LocalInbox once bound
        self.local_info = None                       # what peers need to reach and verify it
        self._direct_wanted = self._local_wanted and (direct_links is None or direct_links)
        self._listener = None                        # directlink.Listener once bound
        self._direct_paths = {}                      # rank -> its listening socket's path
        self._mine = threading.local()               # this thread's links and awaited answers
        self._links = []                             # every link this process opened
        self._answer_links = {}                      # (worker, key) -> (link, iteration of its push)
        self._shared_wanted = self._direct_wanted and shared_memory
        self.kv_memory = None                        # a server's kvshm.ServerMemory
        self._kv_infos = {}                          # server rank -> its advertised kv memory
        self._kv_segments = {}                       # server rank -> kvshm.Segment or None
        self._kv_lock = threading.Lock()             # sync threads look segments up at once

    # ----- set-up ---------------------------------------------------------------------------------
    def _bind_one_host(self):
        """The inbox's Unix socket (before CURVE is set on the inbox: see bind), then the direct
        links' listener beside it, then a server's shared KV memory; each advertised in
        local_info, and each left out, with one logged line, when it cannot be made."""
        if self._local_wanted and self.local is None:
            try:
                self.local = localipc.LocalInbox()
                self._inbox.bind(self.local.endpoint)
                self.local_info = self.local.describe()
            except (OSError, zmq.ZMQError) as e:
                logging.getLogger("poseidon").warning(
                    f"{self.name}: no Unix-socket inbox ({e}); peers on this host use TCP")
                if self.local is not None:
                    self.local.close()
                self.local = self.local_info = None
        if self.local is not None and self._direct_wanted and self._listener is None:
            try:
                self._listener = directlink.Listener(self.local.direct_path, header_specs,
                                                     self._take_in_link, self._bad_link, self.name)
                self.local_info["direct"] = localipc.socket_info(self.local.direct_path)
            except OSError as e:
                logging.getLogger("poseidon").warning(
                    f"{self.name}: no direct links ({e}); KV pushes on this host use ZeroMQ")
        roles = self.rules.roles
        if (self._listener is not None and self._shared_wanted and self.kv_memory is None and
                roles is not None and roles.is_server(self.rank)):
            self.kv_memory = kvshm.ServerMemory.make()
            if self.kv_memory is not None:
                self.local_info["kv_memory"] = self.kv_memory.describe()

    @staticmethod
    def _inbox_route(local):
        """The ipc:// endpoint of a peer's Unix-socket inbox that `local` describes, when
        localipc.reachable admits it (same host, this user), else None (TCP)."""
        return localipc.reachable(local) if local is not None else None

    def _note_direct_link(self, rank, local):
        """Remember rank's direct-link socket (and a server's shared KV memory), when this
        process may take them: its pushes to rank go that way from now on."""
        direct = localipc.reachable_direct(local) if self._direct_wanted else None
        if direct is not None:
            self._direct_paths[rank] = direct
            if self._shared_wanted and isinstance(local.get("kv_memory"), dict):
                self._kv_infos[rank] = local["kv_memory"]

    def kv_segment(self, server):
        """The shared memory of KV server rank `server` (dist/transport/onehost/kvshm.py)
        mapped here, or None: its pushes then carry their arrays. Looked up once (after the start
        barrier, when every server has sized its memory for the book)."""
        with self._kv_lock:
            if server in self._kv_segments:
                return self._kv_segments[server]
            segment = None
            info, book, roles = self._kv_infos.get(server), self.rules.book, self.rules.roles
            if info is not None and book is not None and server in self._direct_paths:
                layout = kvshm.Layout(book, roles.index(server), roles.workers)
                segment = kvshm.open_segment(info, layout)
            self._kv_segments[server] = segment
            return segment

    def direct_links(self):
        """The ranks this process pushes to on direct links (dist/transport/onehost/directlink.py)."""
        return sorted(self._direct_paths)

    # ----- direct links: a KV push and its answer, between processes of a host -------------------
    def _send_direct(self, dest, mtype, header, arrays, key, iteration, payload):
        """Send on a direct link when the message may go on one; returns the trackers of the send
        (empty for a push), or None when it must go through ZeroMQ (no link for it, or the link
        has closed)."""
        link = self._link_for(dest, mtype, key, iteration, payload)
        if link is None:
            return None
        try:
            written = self._send_on_link(link, dest, mtype, header, arrays, key, iteration)
        except directlink.LinkClosed:
            link.open = False        # ZeroMQ from now on: a peer that has really gone is
            return None              # then found as before (heartbeats, the coordinator)
        with self.counters_lock:
            self.direct_sent += 1
        return written

    def _link_for(self, dest, mtype, key, iteration, payload):
        """The link msg goes on, or None for ZeroMQ: a push of at most directlink.MAX_BYTES goes
        on this thread's own link to a server of this host; an answer goes on the link its push
        came on, if that push was of the same iteration (the worker's thread is then reading
        that link for it)."""
        if mtype == Msg.KV_PUSH:
            path = self._direct_paths.get(dest)
            if path is None or payload > directlink.MAX_BYTES:
                return None
            links = self._thread_links()
            link = links.get(dest)
            if link is None or not link.open:
                if len(self._links) >= directlink.MAX_LINKS:
                    return None
                try:
                    link = links[dest] = directlink.Link.connect(path, dest, header_specs)
                except OSError:
                    self._direct_paths.pop(dest, None)      # ZeroMQ from now on
                    return None
                with self._out_lock:
                    self._links.append(link)
            return link
        if mtype == Msg.KV_VALUE and self._answer_links:
            got = self._answer_links.get((dest, key))
            if got is not None and got[1] == iteration and got[0].open:
                return got[0]
        return None

    def _thread_links(self):
        mine = self._mine
        if not hasattr(mine, "links"):
            mine.links, mine.awaiting = {}, {}
        return mine.links

    def _send_on_link(self, link, dest, mtype, header, arrays, key, iteration):
        """A push is written now by this thread (which then reads its answer from the link);
        an answer is queued on the link it goes back on. Returns the trackers of the send;
        raises directlink.LinkClosed when the link has closed (the caller uses ZeroMQ)."""
        try:
            if mtype != Msg.KV_PUSH:
                return [link.post(header, arrays)]
            link.send(header, arrays, self.timeout,
                      lambda msgs: self._take_in_messages(msgs, link))
            self._mine.awaiting[key] = (link, iteration)
            return ()
        except TimeoutError:
            raise DeadlineError(f"{self.name} could not send {Msg(mtype).name} to "
                                f"{self._namer(dest)} within {self.timeout:g} s: is it still "
                                f"running?") from None

    def _take_in_messages(self, msgs, link):
        for head, arrays in msgs:
            self._take_in_link(head, arrays, link)

    def _pump_for(self, mtype, key, iteration, spin=0.0):
        """How this thread waits for (mtype, key, iteration): by reading its own link when the
        answer comes on it, else None (a plain wait). `spin`: seconds its first look may spin
        (directlink.SPIN_SECONDS)."""
        if mtype != Msg.KV_VALUE:
            return None
        awaiting = getattr(self._mine, "awaiting", None)
        if not awaiting:
            return None
        got = awaiting.get(key)
        if got is None or got[1] != iteration:
            return None
        del awaiting[key]
        link = got[0]

        def pump(seconds):
            nonlocal spin
            try:
                msgs = link.read_ready(seconds, spin)
                spin = 0.0
            except directlink.LinkClosed:   # a plain wait from now on: if the peer has gone,
                link.open = False            # heartbeats and the coordinator say so, naming
                return False                 # the process that failed first
            except Exception as e:       # a header that cannot be a member's
                self._bad_link(e)
                link.close()
                return False
            self._take_in_messages(msgs, link)
            return True
        return pump

    def _take_in_link(self, head, arrays, link):
        """A message read from a direct link: the same checks and filing as one from ZeroMQ; a
        push also names the link its answer goes back on."""
        try:
            msg = self._decode_link(head, arrays)
        except BadMessage as e:
            self._refuse(None, str(e))
            return
        if msg.type == Msg.KV_PUSH:
            self._answer_links[(msg.sender, msg.key)] = (link, msg.iteration)
        with self.counters_lock:
            self.direct_received += 1
        self._file(msg)

    def _bad_link(self, error):
        self._refuse(None, f"unreadable message on a direct link ({type(error).__name__}: "
                           f"{error}); the link is closed")


    # ----- closing ---------------------------------------------------------------------------------
    def _remove_inbox_folder(self):
        """Remove the Unix-socket folder: first when closing, so nothing may keep it behind."""
        if self.local is not None:
            self.local.close()

    def _close_links(self):
        """Close the direct links' listener and every link this process opened."""
        if self._listener is not None:
            self._listener.close()
        with self._out_lock:
            links, self._links = self._links, []
        for link in links:
            link.close()
