"""Ports, addresses, interfaces and routes: where a process binds and what it tells its peers.

Apart from the transport because the launcher and the session need them before there is one (a free
port for a local job's coordinator, the address --coordinator names), and because each turns a
user's text into one clear error naming the flag to fix.
"""
import socket
import struct

from ..errors import DistError


def free_port(host="127.0.0.1"):
    """A TCP port free right now on host (for the coordinator of a local job)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def split_address(address):
    """'tcp://HOST:PORT' -> (HOST, PORT)."""
    if not address.startswith("tcp://") or ":" not in address[6:]:
        raise DistError(f"--coordinator takes tcp://HOST:PORT, got '{address}'")
    host, port = address[6:].rsplit(":", 1)
    try:
        return host, int(port)
    except ValueError:
        raise DistError(f"--coordinator takes tcp://HOST:PORT, got '{address}'") from None


def interface_address(interface):
    """The IPv4 address of a network interface name (e.g. eth0), or the argument itself when it is
    already an address or a host name."""
    if not interface:
        return None
    try:
        socket.inet_aton(interface)
        return interface
    except OSError:
        pass
    try:
        import fcntl
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915,      # SIOCGIFADDR
                                 struct.pack("256s", interface[:15].encode()))
            return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError):
        pass
    try:
        return socket.gethostbyname(interface)
    except OSError:
        raise DistError(f"--interface '{interface}' is neither a network interface of this host "
                        f"nor an address or host name") from None


def coordinator_bind_address(host):
    """The address worker 0 binds the coordinator on: the one --coordinator names (not every
    interface), which must be an address of this machine."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        raise DistError(f"cannot resolve the coordinator host '{host}'") from None


def route_address(toward_host):
    """This host's address on the route toward `toward_host` (what peers can reach us at)."""
    try:
        target = socket.gethostbyname(toward_host)
    except OSError:
        raise DistError(f"cannot resolve the coordinator host '{toward_host}'") from None
    if target.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())
