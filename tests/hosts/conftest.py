"""Fixtures of the emulated-host tests: the skip where namespaces cannot be made, networks that are
always torn down, the data, and the undisturbed run the fault scenarios are compared with."""
import pytest

from poseidon.tools import netns as net

from ..dist.helpers import make_lmdb
from . import REPORT
from .jobs import Job


@pytest.fixture(scope="session", autouse=True)
def _needs_namespaces():
    """Skip every test here, saying why, where namespaces cannot be made (session scope: before
    the module and session fixtures that make them)."""
    reason = net.why_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def networks(request):
    """make(count, impaired=None) -> a Network; every one made is closed when the test ends,
    passed or failed (and at interpreter exit, should the finaliser itself be skipped)."""
    made = []

    def make(count, impaired=None):
        network = net.Network(count, impaired=impaired)
        made.append(network)
        line = _qdisc_line(network)
        if line not in REPORT:
            REPORT.append(line)
        return network

    def close_all():
        for network in made:
            network.close()
    request.addfinalizer(close_all)
    return make


def _qdisc_line(network):
    kinds = network.qdiscs
    have = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in kinds.items())
    impair = ("netem would serve; the tap forwarder is used all the same" if kinds.get("netem")
              else "no netem: delay, loss and reordering by the userspace tap forwarder")
    return f"qdiscs here: {have}. Rate caps: tbf on both ends of a link; counters: tc -s; {impair}"


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("hosts-db") / "train")


@pytest.fixture(scope="session")
def reference(data, tmp_path_factory):
    """The undisturbed run of the fault scenarios' job (2 workers, 2 servers, float32, hybrid,
    snapshots every 4 iterations) on 4 hosts: its final parameters."""
    job = Job(tmp_path_factory.mktemp("reference"), data, snapshot=4)
    with net.Network(job.size) as network:
        job.wait(job.start(network))
    return job.final_params()


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("emulated hosts")
        for line in REPORT:
            terminalreporter.write_line(line)
