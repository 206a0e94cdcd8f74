"""Unix-socket inboxes between processes of one host (dist/transport/onehost/localipc.py,
`--ipc auto`).

- A peer's advertised inbox is taken only when it is this boot's, a socket of this user with the
  advertised inode, in a directory nobody else may enter; anything else falls back to TCP.
- Two transports with the job's keys talk over the Unix socket (no CURVE), payload intact; the
  directory is 0700 and goes away on close.
- The one inbox keeps CURVE on TCP: a client without the keys gets nothing in over TCP, while the
  same client on the Unix socket (this user) is heard, so the NULL endpoint is the Unix one only.

Run: python -m pytest tests/dist/test_localipc.py -q
"""
import os
import stat
import time

import numpy
import pytest
import zmq

from poseidon.dist.job import security
from poseidon.dist.job.roles import Roles
from poseidon.dist.transport import Msg, ZmqTransport, encode_header
from poseidon.dist.transport.onehost import localipc

pytestmark = pytest.mark.skipif(not localipc.supported(),
                                reason="Unix-socket inboxes need Linux (a boot id to compare)")


@pytest.fixture
def bound():
    """A LocalInbox with a real ZeroMQ socket bound on it, and its description."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    inbox = localipc.LocalInbox()
    sock.bind(inbox.endpoint)
    yield inbox, inbox.describe()
    sock.close(0)
    ctx.term()
    inbox.close()


def test_a_verified_inbox_is_reachable(bound):
    inbox, info = bound
    assert localipc.reachable(info) == f"ipc://{inbox.path}"
    assert stat.S_IMODE(os.stat(inbox.dir).st_mode) == 0o700
    assert stat.S_ISSOCK(os.stat(inbox.path).st_mode)


@pytest.mark.parametrize("change", ["boot", "ino", "dev", "relative", "missing", "not dict",
                                    "path type"])
def test_anything_that_does_not_verify_falls_back_to_tcp(bound, change):
    _, info = bound
    info = dict(info)
    if change == "boot":
        info["boot"] = "another-kernel"
    elif change in ("ino", "dev"):
        info[change] += 1
    elif change == "relative":
        info["path"] = os.path.relpath(info["path"])
    elif change == "missing":
        info["path"] = info["path"] + "-gone"
    elif change == "not dict":
        info = [info["path"]]
    else:
        info["path"] = 7
    assert localipc.reachable(info) is None


def test_a_directory_others_may_enter_is_refused(bound):
    inbox, info = bound
    os.chmod(inbox.dir, 0o755)
    assert localipc.reachable(info) is None
    os.chmod(inbox.dir, 0o700)
    assert localipc.reachable(info) is not None


def test_a_file_that_is_not_a_socket_is_refused(tmp_path):
    os.chmod(tmp_path, 0o700)
    path = tmp_path / "inbox"
    path.write_bytes(b"")
    st = os.stat(path)
    info = {"path": str(path), "boot": localipc.boot_id(), "dev": st.st_dev, "ino": st.st_ino}
    assert localipc.reachable(info) is None


@pytest.fixture
def secured_pair():
    """Rank 0 and rank 2 of a job with keys, each with a Unix-socket inbox, connected by it."""
    roles = Roles(2, 1)
    keys = security.make_keys()
    a = ZmqTransport(0, namer=roles.name, timeout=5.0, keys=keys, local_ipc=True)
    b = ZmqTransport(2, namer=roles.name, timeout=5.0, keys=keys, local_ipc=True)
    for t in (a, b):
        t.bind("127.0.0.1")
        t.start()
    a.connect(2, b.address, b.local_info)
    b.connect(0, a.address, a.local_info)
    yield a, b
    a.close(0)
    b.close(0)


def test_peers_on_one_host_talk_over_the_unix_socket(secured_pair):
    a, b = secured_pair
    assert a.routes == {2: "ipc"} and b.routes == {0: "ipc"}
    assert a.counters()["routes"] == {"server 0 (rank 2)": "ipc"}
    big = numpy.arange(300_000, dtype=numpy.float32)       # zero-copy frame
    a.send(2, Msg.KV_PUSH, iteration=1, key=3, arrays=[big]).wait()
    got = b.receive(Msg.KV_PUSH, 3, 1)[0]
    numpy.testing.assert_array_equal(got.arrays[0], big)
    b.send(0, Msg.KV_VALUE, iteration=1, key=3, arrays=[big[:10]])
    numpy.testing.assert_array_equal(a.receive(Msg.KV_VALUE, 3, 1)[0].arrays[0], big[:10])
    assert a.gatekeeper.refused == 0


def test_the_private_directory_goes_away_on_close():
    t = ZmqTransport(0, timeout=1.0, keys=security.make_keys(), local_ipc=True)
    t.bind("127.0.0.1")
    folder = t.local.dir
    assert os.path.isdir(folder) and t.local_info["path"].startswith(folder)
    t.close(0)
    assert not os.path.exists(folder)


def test_without_local_info_or_with_ipc_off_the_route_is_tcp():
    roles = Roles(2, 1)
    keys = security.make_keys()
    a = ZmqTransport(0, namer=roles.name, timeout=5.0, keys=keys, local_ipc=True)
    b = ZmqTransport(2, namer=roles.name, timeout=5.0, keys=keys, local_ipc=False)
    try:
        for t in (a, b):
            t.bind("127.0.0.1")
            t.start()
        assert b.local is None and b.local_info is None
        a.connect(2, b.address, b.local_info)       # b has no Unix socket: TCP with CURVE
        b.connect(0, a.address)                     # no local info given: TCP with CURVE
        assert a.routes == {2: "tcp"} and b.routes == {0: "tcp"}
        a.send(2, Msg.KV_PUSH, iteration=0, key=1, arrays=[numpy.ones(4)])
        b.send(0, Msg.KV_VALUE, iteration=0, key=1, arrays=[numpy.ones(4)])
        assert b.receive(Msg.KV_PUSH, 1, 0)[0].arrays[0].sum() == 4
        assert a.receive(Msg.KV_VALUE, 1, 0)[0].arrays[0].sum() == 4
        assert a.gatekeeper.admitted >= 1 and b.gatekeeper.admitted >= 1   # CURVE handshakes
    finally:
        a.close(0)
        b.close(0)


def _plain_push(ctx, endpoint, message):
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart(message)
    return sock


def test_the_inbox_keeps_curve_on_tcp_and_null_only_on_the_unix_socket():
    roles = Roles(2, 1)
    t = ZmqTransport(2, namer=roles.name, timeout=5.0, keys=security.make_keys(),
                     local_ipc=True)
    ctx = zmq.Context()
    socks = []
    try:
        t.bind("127.0.0.1")
        t.start()
        vec = numpy.full(8, 5.0)

        def push(key):
            return [encode_header(Msg.KV_PUSH, 0, 0, key, 0, [vec]), vec.tobytes()]
        socks.append(_plain_push(ctx, t.address, push(1)))               # no keys, over TCP
        socks.append(_plain_push(ctx, f"ipc://{t.local_info['path']}", push(2)))
        got = t.receive(Msg.KV_PUSH, 2, 0)[0]                            # the Unix socket: heard
        numpy.testing.assert_array_equal(got.arrays[0], vec)
        time.sleep(0.5)
        assert t.counters()["received_by_type"] == {"KV_PUSH": 1}        # TCP: nothing got in
        assert t.mailbox.next(timeout=0) is None
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        t.close(0)


@pytest.mark.parametrize("how", ["os._exit through dist.process", "interpreter exit"])
def test_a_process_that_exits_without_closing_leaves_no_folder(how):
    """The launcher's children end with os._exit (no atexit hooks) and a stopped one exits from
    its signal handler: both remove the folder first. A Python API user who never closes relies
    on atexit."""
    import subprocess
    import sys
    from pathlib import Path
    end = ("from poseidon.dist.job.process import _exit; _exit(3)" if how.startswith("os._exit")
           else "raise SystemExit(3)")
    code = ("from poseidon.dist.transport import ZmqTransport\n"
            "t = ZmqTransport(0, local_ipc=True)\n"
            "t.bind('127.0.0.1')\n"
            "print(t.local.dir, flush=True)\n" + end)
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=60)
    folder = r.stdout.decode().strip().splitlines()[0]
    assert r.returncode == 3, r.stdout.decode()
    assert "poseidon-" in folder and not os.path.exists(folder)


# ----- the host identity: boot id and network namespace -------------------------------------------
def test_the_host_identity_is_the_boot_and_the_network_namespace():
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        boot = f.read().strip()
    net = os.stat("/proc/self/ns/net")
    assert localipc.boot_id() == f"{boot}/net:{net.st_dev}:{net.st_ino}"


def test_another_network_namespace_gives_another_identity(monkeypatch):
    """The same kernel, another namespace inode: another host to the job (no Unix socket)."""
    mine = localipc.boot_id()
    real_stat = os.stat

    def stat_in_another_namespace(path, *args, **kw):
        st = real_stat(path, *args, **kw)
        if path == "/proc/self/ns/net":
            return os.stat_result((st.st_mode, st.st_ino + 1) + tuple(st)[2:])
        return st
    monkeypatch.setattr(os, "stat", stat_in_another_namespace)
    other = localipc.boot_id()
    assert other != mine and other.split("/")[0] == mine.split("/")[0]


def _unshare_net():
    """A command prefix that runs a child in a new network namespace, or None (needs root)."""
    import shutil
    import subprocess
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("unshare"):
        return None
    probe = subprocess.run(["unshare", "--net", "true"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=30)
    return ["unshare", "--net"] if probe.returncode == 0 else None


def test_an_inbox_in_another_network_namespace_is_not_taken():
    """A real process in a new network namespace binds its inbox on the shared file system: the
    socket passes every other check (this user, 0700 folder, advertised inode), but it is
    another host's, so a peer here talks to it over TCP."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    prefix = _unshare_net()
    if prefix is None:
        pytest.skip("creating a network namespace needs root and unshare(1)")
    code = ("import json, sys, zmq\n"
            "from poseidon.dist.transport.onehost import localipc\n"
            "ctx = zmq.Context(); sock = ctx.socket(zmq.PULL)\n"
            "inbox = localipc.LocalInbox(); sock.bind(inbox.endpoint)\n"
            "print(json.dumps(inbox.describe()), flush=True)\n"
            "sys.stdin.read()\n"
            "sock.close(0); inbox.close()\n")
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(prefix + [sys.executable, "-c", code], cwd=root,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        info = json.loads(child.stdout.readline())
        assert info["boot"] != localipc.boot_id()
        assert info["boot"].split("/")[0] == localipc.boot_id().split("/")[0]   # one kernel
        assert stat.S_ISSOCK(os.stat(info["path"]).st_mode)      # reachable on the file system
        assert localipc.reachable(info) is None
        assert localipc.reachable(dict(info, boot=localipc.boot_id())) is not None
    finally:
        child.stdin.close()
        child.wait(30)
