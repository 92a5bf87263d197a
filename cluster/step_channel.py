"""The per-step data plane between the engine and its target ranks: one TCP connection per rank.

Ray places, starts, watches and kills the ranks, and carries every control call (setup, KV cache, snapshots). But a
Ray actor call costs more than a whole decode step of a small model on a CPU node (docs/benchmarks.md), and Ray's
compiled graphs, which cut that, keep every reader spinning on a core while idle. So steps travel on plain sockets
instead: the engine pickles the plan once per step, writes the same bytes to every rank, and reads one reply per
rank. A rank whose process dies closes its socket, which the engine sees at once (:class:`WorkerDiedError`). A rank
whose step raised answers with the error (type, message, traceback, and the request ids it names, if any): that is a
:class:`StepError` when every rank answered (the group is intact and keeps serving), and a WorkerDiedError when the
others never finish the step (stuck in a collective with the rank that raised). Frames are an 8-byte big-endian
length and a pickle. The first frame on a connection is a random token that only the engine got (through Ray) from
the rank, so nothing else can drive it.
"""

from __future__ import annotations

import logging
import pickle
import secrets
import selectors
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from specray.errors import StepError, WorkerDiedError

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")
_OK, _ERROR = "ok", "error"
# After one rank raised, how long the others may take to answer before the group counts as stuck: a rank waiting
# in a collective for the one that raised never answers. Long enough for a large step's real work to finish.
DESYNC_GRACE_S = 30.0


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)))
    sock.sendall(payload)


def recv_frame(sock: socket.socket) -> bytes:
    """One whole frame; ConnectionError when the peer closed the connection."""
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    return _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n
    return bytes(buf)


def _no_delay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class StepServer:
    """The rank's end: a thread that accepts the engine's one connection and answers ``handler(*message)`` for
    every frame, until the connection closes. ``thread_init`` runs first in that thread (per-thread settings
    such as torch's CPU thread count and CUDA device)."""

    def __init__(self, handler: Callable[..., Any], host: str, thread_init: Callable[[], None] | None = None):
        self.handler, self.thread_init = handler, thread_init
        self.token = secrets.token_bytes(16)
        self._listener = socket.create_server((host, 0))
        self.address = (host, self._listener.getsockname()[1], self.token)
        self._conn: socket.socket | None = None
        self._thread = threading.Thread(target=self._serve, name="specray-steps", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        if self.thread_init is not None:
            self.thread_init()
        with self._listener:
            while True:
                conn, _ = self._listener.accept()
                _no_delay(conn)
                try:
                    if secrets.compare_digest(recv_frame(conn), self.token):
                        break
                except ConnectionError:
                    pass
                conn.close()  # not the engine: wait for the right one
        self._conn = conn
        with conn:
            self._answer_until_closed(conn)

    def close(self) -> None:
        """Hang up on the engine (it sees the rank as gone)."""
        if self._conn is not None:
            self._conn.shutdown(socket.SHUT_RDWR)

    def _answer_until_closed(self, conn: socket.socket) -> None:
        while True:
            try:
                message = pickle.loads(recv_frame(conn))
            except (ConnectionError, OSError):
                return  # the engine closed the channel (shutdown or restart)
            start = time.perf_counter()
            try:
                reply = (_OK, self.handler(*message))
            except Exception as err:  # handed to the engine, which raises it as a StepError
                reply = (_ERROR, error_payload(err))
            reply += (time.perf_counter() - start,)
            try:
                send_frame(conn, pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:
                return  # the engine gave up on this step and closed the channel


def error_payload(err: BaseException) -> dict:
    """What travels back for an exception raised by the handler: plain strings (the exception object itself may
    not unpickle on the engine's side), and the request ids it names (a ``req_ids`` attribute), if any."""
    return {"type": type(err).__name__, "message": str(err), "traceback": traceback.format_exc(),
            "req_ids": [str(r) for r in getattr(err, "req_ids", None) or ()]}


class StepClient:
    """The engine's end: one connection per rank (rank order). ``step`` sends each rank its message and returns
    the reply of rank ``driver`` (the one that answers for the group). It raises :class:`WorkerDiedError` as soon as
    any rank goes away, and :class:`StepError` when a rank raised and every rank answered. After each step,
    ``last_busy_s`` holds how long each rank's handler ran (the rest of the step's time is the channel's). ``peer``
    names the ranks in errors and logs."""

    def __init__(self, addresses: list[tuple[str, int, bytes]], connect_timeout: float = 30.0,
                 peer: str = "target rank", driver: int = 0):
        self.peer, self.driver = peer, driver
        self.socks: list[socket.socket] = []
        self.last_busy_s: list[float] = []
        try:
            for host, port, token in addresses:
                sock = _no_delay(socket.create_connection((host, port), timeout=connect_timeout))
                sock.settimeout(None)  # a step may take long; step() keeps the deadline
                send_frame(sock, token)
                self.socks.append(sock)
        except OSError as err:
            self.close()
            raise WorkerDiedError(f"cannot reach a {self.peer}'s step channel: {err}") from err

    def step(self, messages: list[tuple], timeout: float, what: str) -> Any:
        """``messages[i]`` goes to rank i (arguments of its handler); the driver's answer comes back."""
        self.send(messages, what)
        return self.receive(timeout, what)

    def send(self, messages: list[tuple], what: str) -> None:
        """The first half of ``step``: the ranks start working; ``receive`` collects the answers (answers come
        back in the order the messages went)."""
        payloads: dict[int, bytes] = {}
        try:
            for rank, (sock, message) in enumerate(zip(self.socks, messages)):
                key = id(message)  # ranks that get the same message share one pickle
                payload = payloads.get(key) or payloads.setdefault(key, pickle.dumps(message, protocol=5))
                send_frame(sock, payload)
        except OSError as err:
            raise WorkerDiedError(f"{what}: {self.peer} {rank} is gone ({err})") from err

    def receive(self, timeout: float, what: str) -> Any:
        """The driver's answer to the oldest message not yet received (every rank's answer is read)."""
        return self._replies(timeout, what)[self.driver]

    def _replies(self, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        replies: dict[int, tuple] = {}
        with selectors.DefaultSelector() as sel:
            for rank, sock in enumerate(self.socks):
                sel.register(sock, selectors.EVENT_READ, rank)
            while len(replies) < len(self.socks):
                ready = sel.select(max(deadline - time.monotonic(), 0))
                if not ready:
                    raise self._no_answer(replies, timeout, what)
                for key, _ in ready:
                    rank = key.data
                    replies[rank] = self._reply(rank, what)
                    sel.unregister(key.fileobj)
                    if replies[rank][0] == _ERROR:  # the others finish the step, or are stuck with this rank
                        deadline = min(deadline, time.monotonic() + DESYNC_GRACE_S)
        self.last_busy_s = [replies[rank][2] for rank in range(len(self.socks))]
        failed = [(rank, value) for rank, (status, value, _) in sorted(replies.items()) if status == _ERROR]
        if failed:
            rank, error = failed[0]
            raise StepError(what, rank, error["type"], error["message"], error["traceback"], error["req_ids"])
        return [replies[rank][1] for rank in range(len(self.socks))]

    def _no_answer(self, replies: dict[int, tuple], timeout: float, what: str) -> WorkerDiedError:
        """The error for ranks that did not answer in time: lost, or stuck after another rank raised."""
        missing = sorted(set(range(len(self.socks))) - set(replies))
        failed = [(rank, value) for rank, (status, value, _) in sorted(replies.items()) if status == _ERROR]
        if not failed:
            return WorkerDiedError(f"{what}: no answer from {self.peer}s {missing} in {timeout:.0f}s")
        rank, error = failed[0]
        err = WorkerDiedError(f"{what}: {self.peer} {rank} raised {error['type']}: {error['message']}, and "
                              f"{self.peer}s {missing} did not finish the step within {DESYNC_GRACE_S:.0f}s "
                              "(waiting in a collective for it): the group is out of step")
        err.remote_traceback = error["traceback"]
        return err

    def _reply(self, rank: int, what: str) -> tuple:
        """(status, value, busy seconds) of one rank's answer; a closed connection is a dead rank."""
        try:
            return pickle.loads(recv_frame(self.socks[rank]))
        except (ConnectionError, OSError) as err:
            raise WorkerDiedError(f"{what}: {self.peer} {rank} died ({err})") from err

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.socks = []
