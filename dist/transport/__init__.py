"""Messages between the processes of a job: the wire format, the transport, and where they go.

    wire.py          message types, the binary header codec, Message, Receipt, BadMessage
    bandwidth.py     --bandwidth: parse_bandwidth and the token bucket senders take from
    slices.py        messages larger than one slice: cut when sent, put together when received
    scheduler.py     --priority: each peer's slices handed out lower layer first, with a window
    mailbox.py       the Mailbox: received messages filed for the threads that wait on them
    zmq_transport.py the Transport interface (bind, connect, send, receive) and ZmqTransport,
                     ZeroMQ with CURVE: set-up and sending
    zmq_receive.py   ZmqTransport's receive side: decode, check, count, file; the heartbeat
    zmq_onehost.py   ZmqTransport's choice of a one-host path for a message
    onehost/         the fast paths between processes of one host, turned on or off by --ipc
    addresses.py     ports, addresses, interfaces and routes

Why a package: each part changes for its own reasons (a new message type, a new wait, another
transport beside ZeroMQ, another one-host path), and each is read apart. The rest of dist imports
the names below from here, not from the modules, so that the parts may move without it noticing.
"""
from .addresses import (coordinator_bind_address, free_port, interface_address, route_address,
                        split_address)
from .bandwidth import TokenBucket, parse_bandwidth
from .mailbox import Mailbox
from .scheduler import URGENT, PeerScheduler, at_priority
from .slices import DEFAULT_SLICE_BYTES, MAX_JSON_BYTES
from .wire import (FIXED_HEADER_BYTES, FLAG_JSON, FLAG_SHARED, FLAG_SLICE, MAX_ARRAYS, MAX_NDIM,
                   MIN_SLICE_BYTES, BadMessage, Message, Msg, Receipt, decode_header, encode_header)
from .zmq_transport import ZERO_COPY_BYTES, Transport, ZmqTransport

__all__ = ["Msg", "Message", "Receipt", "BadMessage", "encode_header", "decode_header",
           "FIXED_HEADER_BYTES", "FLAG_JSON", "FLAG_SHARED", "FLAG_SLICE", "MAX_ARRAYS", "MAX_NDIM",
           "MIN_SLICE_BYTES", "DEFAULT_SLICE_BYTES", "MAX_JSON_BYTES",
           "parse_bandwidth", "TokenBucket", "Mailbox", "at_priority", "PeerScheduler", "URGENT", "Transport", "ZmqTransport",
           "ZERO_COPY_BYTES", "free_port", "split_address", "interface_address",
           "coordinator_bind_address", "route_address"]
