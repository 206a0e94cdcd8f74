"""Unix-socket inboxes for processes of one job that share a host (`--ipc auto`, the default).

Why: on one host, CURVE protects nothing the file system cannot, and it costs a full encryption
and decryption of every byte, on the same cores that train; for a net with large parameters
that is most of the sync's cost (docs/performance.md, "The distributed path on one host"). So
each process also binds its inbox on a Unix socket, `inbox` in a directory of its own made with
mode 0700, and a peer on the same host connects there with ZeroMQ's NULL mechanism instead of
CURVE over TCP.

Who can connect: only processes of this user (and root): the kernel checks the search permission
on the 0700 directory before it lets anyone reach the socket. That is the boundary CURVE draws on
loopback too (the loopback key lives in a 0700 folder of this user). The path is told to the
other members through the coordinator, over CURVE.

When a peer takes the Unix socket (`reachable`): the advertised boot id is this kernel's, and the
path, seen from here, is a socket owned by this user with the advertised device and inode, in a
directory of this user that nobody else may enter. A peer in another container or mount namespace
fails one of these and talks over TCP with CURVE, as a peer on another host does. Nothing is ever
decided from the host name alone.
"""
import atexit
import os
import shutil
import stat
import tempfile
import threading

SOCKET_NAME = "inbox"
DIRECT_NAME = "direct"    # the listening socket of the direct links (directlink.py)
MAX_PATH = 100            # sun_path holds 108 bytes on Linux; stay clear of it

_live = set()             # the inboxes of this process not yet removed (remove_all)
_live_lock = threading.Lock()


def boot_id():
    """This host's identity as the one-host paths see it: the kernel's boot id and this process's
    network namespace ('BOOT/net:DEV:INODE'), or None without a boot id.

    Why the namespace: containers, or hosts emulated in network namespaces, share the kernel and
    so its boot id, and often a file system; without the namespace their processes took each
    other for one host and moved their data over Unix sockets and shared memory, so a job meant
    to cross links did not. Processes in different network namespaces are different hosts to
    the job and talk over TCP. (Namespace inodes are unique while the namespace lives; the
    device of /proc/self/ns/net is compared too, as namespaces are identified by both.)"""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        return None
    if not boot:
        return None
    try:
        net = os.stat("/proc/self/ns/net")
    except OSError:          # no namespace to read (an old kernel, a locked-down /proc): the boot
        return boot          # alone, as every process of such a host sees it
    return f"{boot}/net:{net.st_dev}:{net.st_ino}"


def supported():
    """Whether Unix-socket inboxes can be used here (Linux, with a boot id to compare)."""
    return hasattr(os, "geteuid") and boot_id() is not None


def _base_dir():
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base) and os.access(base, os.W_OK):
        return base
    return tempfile.gettempdir()


class LocalInbox:
    """The private directory and socket path of one process's Unix-socket inbox."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="poseidon-", dir=_base_dir())   # mode 0700
        with _live_lock:
            _live.add(self)
        self.path = os.path.join(self.dir, SOCKET_NAME)
        if len(self.path.encode()) > MAX_PATH:
            self.close()
            raise OSError(f"the socket path {self.path} is too long for a Unix socket")

    @property
    def direct_path(self):
        return os.path.join(self.dir, DIRECT_NAME)

    @property
    def endpoint(self):
        return f"ipc://{self.path}"

    def describe(self):
        """What peers need to find and verify this inbox (call after the bind made the socket)."""
        return dict(socket_info(self.path), boot=boot_id())

    def close(self):
        """Remove the folder and socket file (connections already made keep working)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        with _live_lock:
            _live.discard(self)


def socket_info(path):
    """The path, device and inode of a bound socket: what a peer checks it against."""
    st = os.stat(path)
    return {"path": path, "dev": st.st_dev, "ino": st.st_ino}


def remove_all():
    """Remove every inbox folder of this process: at exit, and before an os._exit (which runs
    no atexit hooks) when a process is stopped."""
    with _live_lock:
        inboxes = list(_live)
    for inbox in inboxes:
        inbox.close()


atexit.register(remove_all)


def reachable(info):
    """The ipc:// endpoint of a peer's advertised inbox when this process may take it, else None
    (see the module docstring for the checks)."""
    path = _checked_socket(info, info)
    return None if path is None else f"ipc://{path}"


def reachable_direct(info):
    """The path of a peer's direct-link socket (advertised beside its inbox as info['direct'])
    when this process may take it, under the same checks, else None."""
    direct = info.get("direct") if isinstance(info, dict) else None
    return _checked_socket(info, direct)


def _checked_socket(info, sock):
    """sock['path'] when it is a socket of this user with the advertised device and inode, in
    a folder nobody else may enter, on this boot (info['boot']), else None."""
    if not isinstance(info, dict) or not isinstance(sock, dict) or not hasattr(os, "geteuid"):
        return None
    path, mine = sock.get("path"), boot_id()
    if not isinstance(path, str) or not os.path.isabs(path) or len(path.encode()) > MAX_PATH:
        return None
    if mine is None or info.get("boot") != mine:
        return None
    uid = os.geteuid()
    try:
        st = os.stat(path)
        parent = os.stat(os.path.dirname(path))
    except (OSError, ValueError):
        return None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != uid:
        return None
    if (st.st_dev, st.st_ino) != (sock.get("dev"), sock.get("ino")):
        return None
    if not stat.S_ISDIR(parent.st_mode) or parent.st_uid != uid or parent.st_mode & 0o077:
        return None
    return path
