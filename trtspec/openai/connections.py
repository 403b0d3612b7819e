"""The OpenAI front's HTTP connections, which uvicorn leaves unbounded: how long a request's
head (request line and headers) may take to arrive, and how many connections the server holds.

A connection waits for a head from when it is made and again from each answer's end (keep-alive);
one whose head has not arrived whole ``head_timeout_s`` later is closed, with a 408 in OpenAI's
error shape where part of a head came (a client dribbling header bytes, a slow loris), silently
where none did. At ``max_connections`` a new connection closes the one that has waited longest for
a head, so a flood of slow or idle clients cannot crowd out one that sends its request; where every
held connection is inside a request, the new one is closed at once (the client retries). The
server speaks HTTP/1.1 through h11 (whose limit on a head's size, 16 KiB, stays), never websockets.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

from trtspec.openai.app import ApiError, error_body


@dataclass(frozen=True)
class ConnectionBounds:
    # The most a request's head may take to arrive whole, from the connection's start or the
    # previous answer's end.
    head_timeout_s: float = 10.0
    # The most connections held at once: room for far more clients than the deployment serves at a
    # time, under the common limit of 1024 open files.
    max_connections: int = 512


def server_options(bounds: ConnectionBounds) -> dict:
    """uvicorn.Config's (and uvicorn.run's) keyword arguments that enforce ``bounds``."""
    return {"http": bounded_protocol(bounds), "ws": "none"}


def bounded_protocol(bounds: ConnectionBounds) -> type[H11Protocol]:
    """uvicorn's h11 protocol with ``bounds``; one class per server (its connections share the count)."""
    held: set[H11Protocol] = set()
    waiting: dict[H11Protocol, None] = {}  # connections waiting for a head, longest first

    class Bounded(H11Protocol):
        limits = bounds
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            held.add(self)
            self._await_head()
            if len(held) > bounds.max_connections:
                next(iter(waiting))._drop()  # this one itself where no other waits

        def data_received(self, data: bytes) -> None:
            self._head_bytes += len(data)
            super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's head arrived
                self._stop_waiting()

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._await_head()  # before uvicorn reads a pipelined head, which stops the wait
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._stop_waiting()
            held.discard(self)
            super().connection_lost(exc)

        def _await_head(self) -> None:
            self._stop_waiting()
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(bounds.head_timeout_s, self._head_too_slow)
            waiting[self] = None

        def _stop_waiting(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            waiting.pop(self, None)

        def _head_too_slow(self) -> None:
            self._drop(head_timeout_answer(bounds.head_timeout_s) if self._head_bytes else b"")

        def _drop(self, answer: bytes = b"") -> None:
            self._stop_waiting()
            held.discard(self)
            if not self.transport.is_closing():
                self.transport.write(answer)
                self.transport.close()

    return Bounded


def head_timeout_answer(timeout_s: float) -> bytes:
    """The whole HTTP answer to a head that did not arrive in time: 408, OpenAI's error shape."""
    err = ApiError(408, f"the request head did not arrive whole within {timeout_s:g} s; send it at once", code="request_timeout")
    body = json.dumps(error_body(err.message, err.kind, err.param, err.code)).encode()
    head = f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    return head.encode() + body
