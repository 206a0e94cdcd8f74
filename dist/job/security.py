"""The job's keys: who may talk to a socket of a job (ZeroMQ CURVE, checked by a ZAP handler).

Why it is shaped this way:
- One CURVE key pair per job, held by every member. Each inbox (the PULL of a worker or server,
  the coordinator's ROUTER) is a CURVE server with the job's secret key; each outgoing socket
  (PUSH, DEALER) is a CURVE client that presents the job's key pair and expects the job's public
  key from the server. CURVE alone admits ANY client that knows the server's public key, so every
  context also runs a ZAP handler (`Gatekeeper`) that admits only clients presenting the job's
  public key. The CURVE handshake proves that a client holds the secret key of the public key it
  presents, so a peer is admitted exactly when it holds the job's secret key, and a member only
  ever sends to a server that holds it too. Traffic is encrypted (Curve25519 + XSalsa20-Poly1305),
  so the bytes of a job are neither readable nor alterable on the wire.
- One pair per job rather than per role: every member must reach every socket anyway, the file
  the user copies to every host is one secret, and ranks are not authenticated against each other
  (a member could claim another rank's sender field); the wire checks (dist/coord/checks.py) keep a
  buggy member from breaking anything, and strangers never get past the handshake.
- Where the keys come from: `poseidon keys FILE` writes a key file (mode 0600) that a multi-host
  job reads with `--keys FILE` (or POSEIDON_KEYS); the local launcher makes fresh keys per job and
  hands them to its children on their standard input (never on a command line or in the
  environment, where `ps` or /proc would show them). A job on the loopback interface without keys
  (the Python API, the multi-host form on one machine) uses this user's loopback key file, made
  on first use in a private directory, so processes of another user cannot join it. `--insecure`
  turns CURVE off (documented as for experiments only).
"""
import os
import stat
import threading

import zmq
from zmq.utils import z85

from ..errors import DistError

ZAP_DOMAIN = "poseidon"
_HEADER = ("# Poseidon job keys (ZeroMQ CURVE). Keep this file secret: every process of the job "
           "reads it (--keys FILE).\n")


class JobKeys:
    """A job's CURVE key pair (Z85 text, 40 characters each)."""

    __slots__ = ("public", "secret", "source")

    def __init__(self, public, secret, source="fresh keys"):
        self.public = public if isinstance(public, bytes) else public.encode("ascii")
        self.secret = secret if isinstance(secret, bytes) else secret.encode("ascii")
        self.source = source

    def __repr__(self):                                  # never print the secret
        return f"JobKeys(public={self.public.decode()}, from {self.source})"

    def text(self):
        """The key file's contents."""
        return (_HEADER + f"public = {self.public.decode()}\nsecret = {self.secret.decode()}\n")


def make_keys():
    public, secret = zmq.curve_keypair()
    return JobKeys(public, secret)


def parse_keys(text, source):
    """JobKeys from a key file's text; DistError naming source:line for anything malformed."""
    fields = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or name not in ("public", "secret"):
            raise DistError(f"{source}:{n}: expected 'public = KEY' or 'secret = KEY', got "
                            f"'{line[:40]}' (make a new file with `poseidon keys {source}`)")
        if len(value) != 40:
            raise DistError(f"{source}:{n}: the {name} key must be 40 Z85 characters, got "
                            f"{len(value)} (make a new file with `poseidon keys {source}`)")
        try:
            z85.decode(value.encode("ascii"))
        except Exception:
            raise DistError(f"{source}:{n}: the {name} key is not Z85 text (make a new file with "
                            f"`poseidon keys {source}`)") from None
        fields[name] = value.encode("ascii")
    for name in ("public", "secret"):
        if name not in fields:
            raise DistError(f"{source}: no '{name} = KEY' line (make a new file with "
                            f"`poseidon keys {source}`)")
    if zmq.curve_public(fields["secret"]) != fields["public"]:
        raise DistError(f"{source}: the public key does not belong to the secret key (the file "
                        f"was edited or mixed from two files; make a new one with `poseidon keys "
                        f"{source}` and copy it to every host)")
    return JobKeys(fields["public"], fields["secret"], source)


def write_key_file(path, keys=None, overwrite=False):
    """Write keys (fresh ones by default) to path with mode 0600; returns the JobKeys.

    A new file is created exclusively. `overwrite` replaces an existing one atomically: the keys
    go to a new 0600 file in the same folder, renamed over the old one, so the old file's mode
    never applies and no reader sees half a key. A symbolic link at `path` is refused either
    way: writing through it would put the secret wherever it points (docs/decisions.md)."""
    from poseidon.engine.io.caffemodel import write_atomic
    keys = keys or make_keys()
    path = os.fspath(path)
    if os.path.islink(path):
        raise DistError(f"{path} is a symbolic link (to {os.readlink(path)}): a key file is "
                        f"written only as a regular file; remove the link or give another name")
    data = keys.text().encode("ascii")
    try:
        if overwrite:
            write_atomic(path, data, mode=0o600)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.fchmod(fd, 0o600)         # whatever the umask
                os.write(fd, data)
            finally:
                os.close(fd)
    except FileExistsError:
        raise DistError(f"{path} exists: give another name, or --force to replace it (every host "
                        f"of a running job would then need the new file)") from None
    except OSError as e:
        raise DistError(f"cannot write the key file {path}: {e.strerror or e}") from None
    keys.source = str(path)
    return keys


def read_key_file(path):
    """JobKeys from a key file; one clear DistError if it is missing, unreadable, open to other
    users or malformed."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DistError(f"the key file {path} does not exist: make one with `poseidon keys "
                        f"{path}` and copy it to every host of the job") from None
    except OSError as e:
        raise DistError(f"cannot read the key file {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise DistError(f"the key file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise DistError(f"the key file {path} can be read by other users (mode "
                        f"{stat.S_IMODE(st.st_mode):04o}): run `chmod 600 {path}`")
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
    except OSError as e:
        raise DistError(f"cannot read the key file {path}: {e.strerror}") from None
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise DistError(f"{path} is not a Poseidon key file (it is not text): make one with "
                        f"`poseidon keys {path}`") from None
    return parse_keys(text, path)


# ------------------------------------------------------------------------------------------------
# the loopback key of this user
# ------------------------------------------------------------------------------------------------
_loopback = None
_loopback_lock = threading.Lock()


def loopback_key_path():
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.access(base, os.W_OK):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "poseidon", "loopback.keys")


def loopback_keys():
    """This user's key pair for loopback jobs started without keys, made once (0600 in a 0700
    folder; several processes starting at once agree on one file)."""
    global _loopback
    with _loopback_lock:
        if _loopback is not None:
            return _loopback
        path = loopback_key_path()
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        except OSError as e:
            raise DistError(f"cannot make {os.path.dirname(path)} for this user's loopback key "
                            f"({e.strerror}): give --keys FILE (from `poseidon keys FILE`)") from None
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
            write_key_file(tmp, overwrite=True)
            try:
                os.link(tmp, path)             # atomic: the first process to get here wins
            except FileExistsError:
                pass
            except OSError as e:
                raise DistError(f"cannot write this user's loopback key {path} ({e.strerror}): "
                                f"give --keys FILE (from `poseidon keys FILE`)") from None
            finally:
                os.unlink(tmp)
        _loopback = read_key_file(path)
        return _loopback


def resolve_keys(keys, insecure, loopback, trusted_network=False):
    """The JobKeys a process uses: keys (JobKeys or a file path), else POSEIDON_KEYS, else on the
    loopback interface this user's loopback key; None with insecure. Refuses a job that reaches
    other hosts without keys, and an insecure one whose network the user has not said is trusted
    (without CURVE anyone who reaches a port can push gradients into the job or abort it)."""
    if insecure:
        if not loopback and not trusted_network:
            raise DistError("--insecure with a coordinator on a routable address: anyone who "
                            "reaches the job's ports could push gradients into it or abort it; "
                            "give --trusted-network too if the network between its hosts is "
                            "private, or drop --insecure and use --keys")
        return None
    if isinstance(keys, JobKeys):
        return keys
    path = keys or os.environ.get("POSEIDON_KEYS")
    if path:
        return read_key_file(path)
    if loopback:
        return loopback_keys()
    raise DistError("a job that spans hosts needs the job's keys: run `poseidon keys job.keys` "
                    "once, copy job.keys to every host (or a shared job folder) and give every "
                    "process --keys job.keys (or set POSEIDON_KEYS); --insecure runs without "
                    "authentication, for experiments on a trusted network only")


# ------------------------------------------------------------------------------------------------
# sockets
# ------------------------------------------------------------------------------------------------
def secure_server(sock, keys):
    """Make a bound (inbox) socket a CURVE server of the job; its Gatekeeper checks clients."""
    sock.curve_server = True
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.zap_domain = ZAP_DOMAIN.encode("ascii")


def secure_client(sock, keys):
    """Make an outgoing socket a CURVE client presenting the job's keys; it talks only to servers
    that hold the job's secret key."""
    sock.curve_serverkey = keys.public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


class Gatekeeper:
    """The ZAP handler of one ZeroMQ context: admits CURVE clients that present the job's public
    key, refuses (and counts) every other. Start it before any socket of the context binds."""

    def __init__(self, ctx, keys):
        from zmq.auth.thread import ThreadAuthenticator
        self.public = keys.public
        self.admitted = 0
        self.refused = 0
        self._lock = threading.Lock()
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, self)

    def callback(self, domain, client_key):
        ok = client_key == self.public
        with self._lock:
            if ok:
                self.admitted += 1
            else:
                self.refused += 1
        return ok

    def stop(self):
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
