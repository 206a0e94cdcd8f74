"""A host on the bridge without the job's secret key: it connects and sends to each port of the job.

Run by tests/hosts/test_failures.py inside the intruder's namespace, from the repository root:
    python -m tests.hosts.intruder --public KEY --coordinator tcp://A:P --inbox tcp://B:Q ...
It knows the job's public key (as anyone who saw the key file's first line might) but not its
secret. Through tests/dist/strangers.py it opens, per port, a plain ZeroMQ socket, a CURVE socket
with a key pair of its own, and a raw TCP connection speaking ZMTP with the NULL mechanism, and
sends well-formed registrations, pushes, aborts, heartbeats and factors. It prints one JSON line:
what it tried, which connections the job did not refuse, and what it got back.
"""
import argparse
import json

from ..dist.strangers import Stranger

REFUSAL_WAIT_S = 20.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--public", required=True, help="the job's public key (Z85)")
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--inbox", action="append", default=[])
    args = ap.parse_args(argv)
    stranger = Stranger(args.public.encode("ascii"))
    try:
        ports = [(args.coordinator, True)] + [(a, False) for a in args.inbox]
        for address, coordinator in ports:
            stranger.connect(address, coordinator)
            stranger.raw(address)
        stranger.send_all()
        not_refused = stranger.refused_everywhere(REFUSAL_WAIT_S)
        stranger.send_all()
        print(json.dumps({"ports": len(ports), "sockets": len(stranger.sockets),
                          "attempted": stranger.attempted, "not_refused": not_refused,
                          "raw_closed": stranger.raw_closed,
                          "raw_received": stranger.raw_received,
                          "messages_received": stranger.messages_received()}), flush=True)
    finally:
        stranger.close()


if __name__ == "__main__":
    main()
