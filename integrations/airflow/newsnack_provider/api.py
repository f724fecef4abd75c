"""The newsnack HTTP API as plain Python: no Airflow import.

The hook, the trigger and ``examples/airflow/run_briefing.py`` all speak to
the service through this module. Blocking calls use the standard library
(``urllib``); the trigger's wait uses ``aiohttp``, which Airflow itself
depends on, so the triggerer's loop is never blocked.

Every request carries the W3C trace context of the current OpenTelemetry
span, or when none is current the one the caller gives
(:attr:`Service.fallback_trace`; :func:`trace_headers`), so a task's trace
continues into newsnack's.

Every refusal the service sends is ``{"error": "..."}`` with a 4xx/5xx
status; it becomes a :class:`NewsnackError` subclass carrying the status and
the message. :attr:`NewsnackError.retryable` says whether asking again can
help (the service was unreachable or answered 503 before acting).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Dict, List, Mapping, Optional

import aiohttp

#: Seconds an ordinary request (not a wait) may take.
REQUEST_TIMEOUT_S = 30.0
#: Seconds a wait's answer may take beyond its deadline.
WAIT_MARGIN_S = 30.0


class NewsnackError(Exception):
    """A request that did not get the answer it needed."""

    #: True when the same request may succeed later and cannot do harm.
    retryable = False

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class NewsnackUnreachable(NewsnackError):
    """No answer: refused, reset or timed out before the service answered."""

    retryable = True


class NewsnackUnavailable(NewsnackError):
    """503: the database is out of reach or the service is stopping; the
    service answers it before acting."""

    retryable = True


class NewsnackUnauthorized(NewsnackError):
    """401: the bearer token is missing or wrong. Nothing happened."""


class NewsnackNotFound(NewsnackError):
    """404: unknown issue ids."""


class NewsnackRefused(NewsnackError):
    """Another 4xx or 5xx: the request is wrong or failed, and stays so."""


def error_for(status: int, message: str, what: str) -> NewsnackError:
    """The error for an answer of `status` with the service's `message`."""
    text = f"{what} failed (HTTP {status}): {message}"
    if status == 401:
        return NewsnackUnauthorized(text + " (check the connection's password: the API token)", status)
    if status == 404:
        return NewsnackNotFound(text, status)
    if status == 503:
        return NewsnackUnavailable(text, status)
    return NewsnackRefused(text, status)


def rfc3339(moment: datetime) -> str:
    """`moment` (timezone-aware) as the RFC 3339 text the API reads."""
    if moment.tzinfo is None:
        raise ValueError(f"a deadline needs a timezone, got {moment!r}")
    return moment.astimezone(timezone.utc).isoformat()


def parse_rfc3339(text: str) -> datetime:
    """The instant `text` (RFC 3339, as :func:`rfc3339` writes it) names."""
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        raise ValueError(f"a deadline needs a timezone, got {text!r}")
    return moment


@dataclass(frozen=True)
class Service:
    """Where the service listens, the token it wants (None: none), and the
    trace context to send when no span is current (``traceparent`` and
    perhaps ``tracestate``; on Airflow 2.10 the task's, which Airflow does
    not make current)."""

    base_url: str
    token: Optional[str] = None
    fallback_trace: Mapping[str, str] = field(default_factory=dict, hash=False)

    def trace_headers(self) -> Dict[str, str]:
        """What :func:`trace_headers` sends for this service's requests."""
        return trace_headers(self.fallback_trace)

    def headers(self) -> Dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json", **self.trace_headers()}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    def post(
        self, path: str, body: Dict[str, Any], timeout_s: float = REQUEST_TIMEOUT_S, conflict_ok: bool = False
    ) -> Dict[str, Any]:
        """POST `body` to `path`; the JSON answer of a 2xx (or of a 409 when
        `conflict_ok`), else the error the answer (or its absence) means."""
        request = urllib.request.Request(
            self.url(path), data=json.dumps(body).encode(), headers=self.headers(), method="POST"
        )
        what = f"POST {path}"
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return dict(json.loads(response.read()))
        except urllib.error.HTTPError as answer:
            payload = _json_or_text(answer.read())
            if conflict_ok and answer.code == 409 and isinstance(payload, dict):
                return payload
            raise error_for(answer.code, _message(payload), what) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise NewsnackUnreachable(f"{what}: cannot reach {self.base_url}: {reason}") from None

    async def apost(
        self, session: aiohttp.ClientSession, path: str, body: Dict[str, Any], timeout_s: float
    ) -> Dict[str, Any]:
        """:meth:`post`, asynchronously on `session`."""
        what = f"POST {path}"
        try:
            async with session.post(
                self.url(path),
                json=body,
                headers=self.headers(),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                payload = _json_or_text(await response.read())
                if response.status < 300 and isinstance(payload, dict):
                    return payload
                raise error_for(response.status, _message(payload), what)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise NewsnackUnreachable(f"{what}: cannot reach {self.base_url}: {e or type(e).__name__}") from None

    def claim(self, issue_ids: List[int], priority: str = "briefing") -> Dict[str, Any]:
        """``POST /ai-articles``: ``{"claimed", "skipped"}`` (a 409, nothing
        claimable, answers the same fields)."""
        return self.post("/ai-articles", {"issue_ids": issue_ids, "priority": priority}, conflict_ok=True)

    def wait(
        self, issue_ids: List[int], timeout_s: Optional[float] = None, min_completion: Optional[int] = None
    ) -> Dict[str, Any]:
        """``POST /waits``, blocking until the outcome."""
        body = wait_body(issue_ids, min_completion)
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        read_s = (timeout_s if timeout_s is not None else 86_400.0) + WAIT_MARGIN_S
        return self.post("/waits", body, timeout_s=read_s)

    def briefing(self, issue_ids: List[int]) -> Dict[str, Any]:
        """``POST /today-newsnack``: ``{"briefing_id", "issue_ids"}``."""
        return self.post("/today-newsnack", {"issue_ids": issue_ids})


def trace_headers(fallback: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``traceparent`` (and ``tracestate``) of the current OpenTelemetry
    span: in Airflow 3 the task's span (``worker.<task_id>``) or the
    trigger's (``trigger.<task_id>``), which Airflow makes current while it
    runs them with tracing on, or any span the DAG's code made current.
    When there is none, the span is not valid (tracing off) or
    ``opentelemetry-api`` is missing: those of `fallback` (Airflow 2.10 makes
    no span current in a task; the hook passes the ids of the span it
    exports for the task), else nothing."""
    carrier: Dict[str, str] = {}
    try:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        pass
    else:
        # Injects nothing when the current span's context is not valid.
        TraceContextTextMapPropagator().inject(carrier)
    if not carrier.get("traceparent"):
        carrier = dict(fallback or {})
    return {key: carrier[key] for key in ("traceparent", "tracestate") if carrier.get(key)}


def wait_body(issue_ids: List[int], min_completion: Optional[int]) -> Dict[str, Any]:
    """The common part of a ``POST /waits`` body."""
    body: Dict[str, Any] = {"issue_ids": issue_ids}
    if min_completion is not None:
        body["min_completion"] = min_completion
    return body


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _message(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), str):
        return str(payload["error"])
    return str(payload)[:500]
