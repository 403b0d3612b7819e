"""wait_ready: a server is ready when every endpoint it was told to open answers. Triton opens
its metrics endpoint after the HTTP one, so /v2/health/ready alone can answer before /metrics
listens."""

from __future__ import annotations

import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from trtspec.triton.server.process import ServerCommand, TritonServer, free_ports


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def _serve(port: int) -> ThreadingHTTPServer:
    httpd = ThreadingHTTPServer(("127.0.0.1", port), _Ok)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.fixture
def endpoints():
    http_port, metrics_port = free_ports(2)
    servers = [_serve(http_port)]
    proc = subprocess.Popen(["sleep", "60"])  # stands in for tritonserver: alive, never exits
    yield http_port, metrics_port, servers, proc
    proc.kill()
    proc.wait()
    for s in servers:
        s.shutdown()
        s.server_close()


def _server(http_port: int, metrics_port: int, proc, allow_metrics: bool) -> TritonServer:
    command = ServerCommand(
        binary=Path("/bin/sleep"),
        model_repository=Path("/r"),
        http_port=http_port,
        metrics_port=metrics_port,
        allow_metrics=allow_metrics,
    )
    server = TritonServer(command)
    server._proc, server._started_at = proc, time.monotonic()
    return server


def test_ready_waits_for_the_metrics_endpoint_that_opens_after_http(endpoints):
    http_port, metrics_port, servers, proc = endpoints
    opened = []

    def open_metrics_later():
        time.sleep(0.6)
        servers.append(_serve(metrics_port))
        opened.append(time.monotonic())

    threading.Thread(target=open_metrics_later, daemon=True).start()
    _server(http_port, metrics_port, proc, allow_metrics=True).wait_ready(timeout=10)
    assert opened and time.monotonic() >= opened[0]  # returned only once /metrics listened


def test_ready_without_metrics_does_not_wait_for_them(endpoints):
    http_port, metrics_port, _, proc = endpoints
    seconds = _server(http_port, metrics_port, proc, allow_metrics=False).wait_ready(timeout=10)
    assert seconds < 2  # nothing listens on the metrics port: with metrics on this would time out
