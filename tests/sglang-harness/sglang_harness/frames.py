"""A tap on the ZMQ frames SGLang's KV managers, senders and receivers exchange over TCP: every
`send_multipart` / `recv_multipart` on a tcp:// socket of the scheduler process is recorded in
the truth log (`zmq_send` / `zmq_recv`), as SGLang's code called it.

Frames are recorded as text when short printable ASCII (tags, rooms, addresses, statuses,
session ids), else as their length (packed pointers, page indices, aux data). They never hold
prompt text: prompts do not travel over these sockets.
"""

import threading
import time

import zmq

_MAX_TEXT = 64


def _frame(f) -> object:
    b = bytes(f.bytes if isinstance(f, zmq.Frame) else f)
    if len(b) <= _MAX_TEXT:
        try:
            s = b.decode("ascii")
        except UnicodeDecodeError:
            return {"len": len(b)}
        if s.isprintable():
            return s
    return {"len": len(b)}


def _endpoint(sock) -> str:
    try:
        ep = sock.getsockopt(zmq.LAST_ENDPOINT)
    except zmq.ZMQError:
        return ""
    return ep.decode() if isinstance(ep, bytes) else str(ep)


def install(truth) -> None:
    """Wraps pyzmq's Socket.send_multipart / recv_multipart in this process."""
    send = zmq.Socket.send_multipart
    recv = zmq.Socket.recv_multipart
    local = threading.local()

    def send_multipart(self, msg_parts, *args, **kwargs):
        ep = _endpoint(self)
        # Stamped before the send: the peer may read the message before this thread runs again.
        ts = time.time_ns()
        result = send(self, msg_parts, *args, **kwargs)
        if ep.startswith("tcp://"):
            truth.emit(
                "zmq_send",
                ts_ns=ts,
                endpoint=ep,
                thread=threading.current_thread().name,
                frames=[_frame(f) for f in msg_parts],
            )
        return result

    def recv_multipart(self, *args, **kwargs):
        if getattr(local, "inside", False):
            return recv(self, *args, **kwargs)
        local.inside = True
        try:
            msg = recv(self, *args, **kwargs)
        finally:
            local.inside = False
        ep = _endpoint(self)
        if ep.startswith("tcp://"):
            truth.emit(
                "zmq_recv",
                endpoint=ep,
                thread=threading.current_thread().name,
                frames=[_frame(f) for f in msg],
            )
        return msg

    zmq.Socket.send_multipart = send_multipart
    zmq.Socket.recv_multipart = recv_multipart
