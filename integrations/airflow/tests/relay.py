"""The recording relay the trace and retry tests put in front of the real
``newsnack serve``: a local HTTP server passing each POST on to the service
with its headers and body and answering with the service's answer, or
answering it with a 503 itself for a while, as newsnack does when its
database is out of reach. It keeps an :class:`Exchange` per request."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple

#: The message of the relay's own 503s.
UNAVAILABLE = "the database is out of reach"


class Exchange:
    """One request the relay took: its path, the trace headers it came
    with, the status it was answered, newsnack's ``traceparent`` (None when
    the relay answered itself), and when it came (``time.monotonic()``)."""

    def __init__(
        self, path: str, sent: Dict[str, Optional[str]], status: int, answered: Optional[str], at: float
    ) -> None:
        self.path = path
        self.sent = sent
        self.status = status
        self.answered = answered
        self.at = at


class Relay:
    """The relay in front of `upstream` (the service's base URL). It
    answers the first :attr:`unavailable` requests with a 503 of its own
    (``float("inf")``: every request) and passes the others on."""

    def __init__(self, upstream: str) -> None:
        self.exchanges: List[Exchange] = []
        self.unavailable = 0.0
        self.lock = threading.Lock()
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                at = time.monotonic()
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                sent = {"traceparent": self.headers.get("traceparent"), "tracestate": self.headers.get("tracestate")}
                with relay.lock:
                    refuse = len(relay.exchanges) < relay.unavailable
                if refuse:
                    status, content_type, answered = 503, "application/json", None
                    payload = json.dumps({"error": UNAVAILABLE}).encode()
                else:
                    status, content_type, answered, payload = relay.pass_on(upstream, self.path, self.headers, body)
                with relay.lock:
                    relay.exchanges.append(Exchange(self.path, sent, status, answered, at))
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                if refuse:
                    self.send_header("Retry-After", "1")
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @staticmethod
    def pass_on(upstream: str, path: str, headers: Message, body: bytes) -> Tuple[int, str, Optional[str], bytes]:
        """The service's answer to the request: its status, content type,
        ``traceparent`` and body."""
        passed = {k: v for k, v in headers.items() if k.lower() not in ("host", "content-length")}
        request = urllib.request.Request(upstream + path, data=body, headers=passed, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                status, answer_headers, payload = answer.status, answer.headers, answer.read()
        except urllib.error.HTTPError as refusal:
            status, answer_headers, payload = refusal.code, refusal.headers, refusal.read()
        content_type = answer_headers.get("Content-Type", "application/json")
        return status, content_type, answer_headers.get("traceparent"), payload

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
