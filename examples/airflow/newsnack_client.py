"""A small client for the newsnack HTTP API, standard library only.

The Airflow DAG in this directory (``newsnack_daily.py``) and the command-line
driver (``run_briefing.py``) both go through this module, so the HTTP side of
the integration can be exercised and tested without Airflow installed.

It covers the calls an orchestrator needs:

* ``add_issues``  -> ``POST /issues``          201/200 ``{"ids": [..], "existing": [..]}``
* ``claim``       -> ``POST /ai-articles``     202 ``{"claimed": [..], "skipped": [..]}``,
                                               409 with the same fields when nothing
                                               was claimable (not an error here)
* ``wait``        -> ``POST /waits``           200 ``{"outcome", "completed", "failed",
                                               "unfinished", "waited_ms"}``
* ``assemble``    -> ``POST /today-newsnack``  201 ``{"briefing_id", "issue_ids"}``,
                                               409 ``{"not_done": [..]}``
* ``get_issue``, ``latest_briefing``, ``briefing``, ``ready``: reads.

Every error the service sends is ``{"error": "..."}`` with a 4xx/5xx status;
it becomes a ``NewsnackError`` subclass carrying the status, the message, the
parsed body and the ``x-request-id`` (the service tags its log lines with it).
Each error also says whether the request may safely be sent again
(``retryable``) and whether the service may have acted on it
(``maybe_applied``), so callers can decide between retrying and failing.

Configuration from the environment (used by ``NewsnackClient.from_env``):

* ``NEWSNACK_BASE_URL``  where the service listens (default ``http://127.0.0.1:8080``)
* ``NEWSNACK_API_TOKEN`` the bearer token, when the service was started with one
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

DEFAULT_BASE_URL = "http://127.0.0.1:8080"
ENV_BASE_URL = "NEWSNACK_BASE_URL"
ENV_API_TOKEN = "NEWSNACK_API_TOKEN"

#: Seconds an ordinary request (not a wait) may take.
DEFAULT_TIMEOUT_S = 30.0
#: The longest wait the service accepts (``timeout_s`` at most one day).
MAX_WAIT_S = 86_400.0
#: Extra seconds a wait's HTTP read may take beyond the wait itself.
WAIT_MARGIN_S = 30.0

OUTCOMES = ("all_pass", "timeout_pass", "skip")
# The classes of LLM calls, first to last.
PRIORITIES = ("briefing", "feed")


class NewsnackError(Exception):
    """A request that did not get the answer it needed."""

    #: True when sending the same request again may succeed and cannot do
    #: harm (the service did not act on it, or acting again is harmless).
    retryable = False
    #: True when the service may have carried out the request although no
    #: answer arrived (a broken connection after the request was sent).
    maybe_applied = False

    def __init__(
        self,
        message: str,
        status: Optional[int] = None,
        body: Any = None,
        request_id: Optional[str] = None,
        method: str = "",
        path: str = "",
    ):
        self.message = message
        self.status = status
        self.body = body
        self.request_id = request_id
        self.method = method
        self.path = path
        where = f"{method} {path}".strip()
        status_text = f" -> HTTP {status}" if status is not None else ""
        rid = f" [x-request-id {request_id}]" if request_id else ""
        super().__init__(f"{where}{status_text}: {message}{rid}")


class NewsnackUnreachable(NewsnackError):
    """No connection could be made: the request never reached the service."""

    retryable = True


class NewsnackTimeout(NewsnackError):
    """The connection broke or timed out after the request was sent."""

    retryable = True
    maybe_applied = True


class NewsnackUnauthorized(NewsnackError):
    """401: the bearer token is missing or wrong. Nothing happened."""


class NewsnackNotFound(NewsnackError):
    """404: an unknown issue or briefing id."""


class NewsnackConflict(NewsnackError):
    """409: e.g. assembling from issues that are not DONE (see ``not_done``)."""

    @property
    def not_done(self) -> list:
        return list(self.body.get("not_done", [])) if isinstance(self.body, dict) else []


class NewsnackRejected(NewsnackError):
    """Another 4xx: the request is wrong and will stay wrong. Nothing happened."""


class NewsnackUnavailable(NewsnackError):
    """503: the database is busy or unreachable, or the service is stopping.

    The service answers 503 before acting, so sending again is safe.
    """

    retryable = True


class NewsnackServerError(NewsnackError):
    """Another 5xx: the service failed while handling the request."""

    retryable = True
    maybe_applied = True


@dataclass(frozen=True)
class ClaimResult:
    """What ``POST /ai-articles`` did: ``claimed`` are now IN_PROGRESS and
    being generated by the instance that answered; ``skipped`` were in
    progress elsewhere, already DONE, or unknown. ``conflict`` is True when
    the answer was 409 (nothing was claimable)."""

    claimed: list
    skipped: list
    conflict: bool = False

    def as_dict(self) -> dict:
        return {"claimed": self.claimed, "skipped": self.skipped, "conflict": self.conflict}


@dataclass(frozen=True)
class WaitReport:
    """The smart wait's answer (``POST /waits``)."""

    outcome: str
    completed: list
    failed: list
    unfinished: list
    waited_ms: int
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def passed(self) -> bool:
        return self.outcome in ("all_pass", "timeout_pass")

    def as_dict(self) -> dict:
        return {
            "outcome": self.outcome,
            "completed": self.completed,
            "failed": self.failed,
            "unfinished": self.unfinished,
            "waited_ms": self.waited_ms,
        }


@dataclass(frozen=True)
class Assembled:
    """A briefing made by ``POST /today-newsnack``."""

    briefing_id: int
    issue_ids: list

    def as_dict(self) -> dict:
        return {"briefing_id": self.briefing_id, "issue_ids": self.issue_ids}


def briefing_ids(targets: Iterable[int], completed: Iterable[int]) -> list:
    """The ids to assemble: exactly the ``completed`` ones, in the order of
    ``targets`` (hottest first when targets came from a top-K selection).
    The wait lists ``completed`` in id order; the briefing's reading order is
    the caller's. Completed ids that were not targets are not included."""
    done = set(completed)
    ordered = []
    for issue_id in targets:
        if issue_id in done and issue_id not in ordered:
            ordered.append(issue_id)
    return ordered


def _check_ids(name: str, ids: Sequence[int]) -> list:
    ids = list(ids)
    if not ids:
        raise ValueError(f"{name} must not be empty")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i <= 0:
            raise ValueError(f"{name} must hold positive integer ids, got {i!r}")
    return ids


class NewsnackClient:
    """Talks to one newsnack service (any instance behind a load balancer
    will do: claims, waits and assembly work from any of them)."""

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        token: Optional[str] = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        user_agent: str = "newsnack-airflow-example/1",
    ):
        base_url = (base_url or DEFAULT_BASE_URL).strip()
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"base URL must be http(s)://host[:port][/prefix], got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        token = (token or "").strip()
        self.token = token or None
        self.timeout = float(timeout)
        self.user_agent = user_agent

    @classmethod
    def from_env(cls, environ: Optional[dict] = None, **kwargs) -> "NewsnackClient":
        """A client configured by ``NEWSNACK_BASE_URL`` and ``NEWSNACK_API_TOKEN``."""
        env = os.environ if environ is None else environ
        return cls(
            base_url=env.get(ENV_BASE_URL) or DEFAULT_BASE_URL,
            token=env.get(ENV_API_TOKEN) or None,
            **kwargs,
        )

    # -- the calls ---------------------------------------------------------

    def add_issues(self, issues: Sequence[dict]) -> list:
        """``POST /issues``: adds issues (``title`` required; ``body``,
        ``score``, ``collected_at``, ``source_key`` optional); returns their
        ids in order (for a ``source_key`` already there, the existing
        issue's: then nothing may have been added, answered 200)."""
        _, body = self._call("POST", "/issues", {"issues": list(issues)}, expect=(200, 201))
        return list(body["ids"])

    def claim(self, issue_ids: Sequence[int], priority: str = "briefing") -> ClaimResult:
        """``POST /ai-articles``. ``priority`` is the class the articles'
        LLM calls wait in: ``"briefing"`` (the briefing's own articles,
        first on every newsnack instance) or ``"feed"`` (extra articles,
        written when no briefing article waits). A 409 (nothing claimable:
        every id is in progress elsewhere, DONE, or unknown) is returned as
        ``ClaimResult(conflict=True)``, not raised: a wait on the same ids
        still decides correctly. Safe to send again."""
        ids = _check_ids("issue_ids", issue_ids)
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
        status, body = self._call(
            "POST",
            "/ai-articles",
            {"issue_ids": ids, "priority": priority},
            expect=(202, 409),
        )
        return ClaimResult(
            claimed=list(body.get("claimed", [])),
            skipped=list(body.get("skipped", [])),
            conflict=status == 409,
        )

    def wait(
        self,
        issue_ids: Sequence[int],
        timeout_s: Optional[float] = None,
        min_completion: Optional[int] = None,
    ) -> WaitReport:
        """``POST /waits``: one long request that answers the moment the
        outcome is decided. ``None`` leaves ``timeout_s`` and
        ``min_completion`` to the service's settings (``content_gen_timeout_s``,
        ``content_gen_min_completion``). The wait holds no state on the
        service, so it is safe to send again (the timeout starts afresh)."""
        ids = _check_ids("issue_ids", issue_ids)
        payload: dict = {"issue_ids": ids}
        if timeout_s is not None:
            timeout_s = float(timeout_s)
            if not (0 < timeout_s <= MAX_WAIT_S):
                raise ValueError(f"timeout_s must be more than 0 and at most {MAX_WAIT_S:g}")
            payload["timeout_s"] = timeout_s
        if min_completion is not None:
            min_completion = int(min_completion)
            if min_completion < 0:
                raise ValueError("min_completion must not be negative")
            payload["min_completion"] = min_completion
        # The service sends nothing until it decides, so the socket must be
        # allowed to stay silent for the whole wait.
        read_timeout = (timeout_s if timeout_s is not None else MAX_WAIT_S) + WAIT_MARGIN_S
        _, body = self._call("POST", "/waits", payload, expect=(200,), timeout=read_timeout)
        outcome = body.get("outcome")
        if outcome not in OUTCOMES:
            raise NewsnackError(f"unexpected wait outcome {outcome!r}", 200, body, method="POST", path="/waits")
        return WaitReport(
            outcome=outcome,
            completed=list(body.get("completed", [])),
            failed=list(body.get("failed", [])),
            unfinished=list(body.get("unfinished", [])),
            waited_ms=int(body.get("waited_ms", 0)),
            raw=body,
        )

    def assemble(self, issue_ids: Sequence[int]) -> Assembled:
        """``POST /today-newsnack``: a briefing from exactly these issues, in
        this order. Raises ``NewsnackConflict`` (with ``not_done``) when one
        is not DONE. Not idempotent: each success is a new briefing."""
        ids = _check_ids("issue_ids", issue_ids)
        _, body = self._call("POST", "/today-newsnack", {"issue_ids": ids}, expect=(201,))
        return Assembled(briefing_id=int(body["briefing_id"]), issue_ids=list(body["issue_ids"]))

    def get_issue(self, issue_id: int) -> dict:
        """``GET /issues/{id}``."""
        _, body = self._call("GET", f"/issues/{int(issue_id)}", None, expect=(200,))
        return body

    def latest_briefing(self) -> dict:
        """``GET /briefings/latest`` (``NewsnackNotFound`` when there is none)."""
        _, body = self._call("GET", "/briefings/latest", None, expect=(200,))
        return body

    def briefing(self, briefing_id: int) -> dict:
        """``GET /briefings/{id}``."""
        _, body = self._call("GET", f"/briefings/{int(briefing_id)}", None, expect=(200,))
        return body

    def ready(self) -> dict:
        """``GET /readyz``: ``{"database": bool, "listener": bool}``; raises
        ``NewsnackUnavailable`` when the service is not ready."""
        _, body = self._call("GET", "/readyz", None, expect=(200,))
        return body

    # -- plumbing ------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        payload: Any,
        expect: Sequence[int],
        timeout: Optional[float] = None,
    ):
        request_id = str(uuid.uuid4())
        headers = {
            "Accept": "application/json",
            "User-Agent": self.user_agent,
            "x-request-id": request_id,
        }
        data = None
        if payload is not None:
            data = json.dumps(payload).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(
            self.base_url + path, data=data, headers=headers, method=method
        )
        context = dict(request_id=request_id, method=method, path=path)
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                status = response.status
                raw = response.read()
                request_id = response.headers.get("x-request-id") or request_id
        except urllib.error.HTTPError as e:
            status = e.code
            try:
                raw = e.read()
            except (OSError, http.client.HTTPException):
                raw = b""
            request_id = (e.headers.get("x-request-id") if e.headers else None) or request_id
            context["request_id"] = request_id
            body = _parse(raw)
            if status in expect:
                return status, body if isinstance(body, dict) else {}
            raise _http_error(status, body, context) from None
        except urllib.error.URLError as e:
            # urllib wraps what fails while connecting and sending (refused,
            # unresolvable, connect timeout); the service never saw a
            # complete request.
            raise NewsnackUnreachable(
                f"cannot connect to {self.base_url}: {e.reason}", **context
            ) from None
        except (socket.timeout, TimeoutError) as e:
            raise NewsnackTimeout(f"no answer within the timeout ({e})", **context) from None
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            raise NewsnackTimeout(f"the connection broke before an answer: {e!r}", **context) from None
        body = _parse(raw)
        if status not in expect:
            context["request_id"] = request_id
            raise NewsnackError(f"unexpected HTTP {status}", status, body, **context)
        if not isinstance(body, dict):
            raise NewsnackError("the answer is not a JSON object", status, body, **context)
        return status, body


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8")) if raw else None
    except (UnicodeDecodeError, ValueError):
        return raw.decode("utf-8", "replace")


def _http_error(status: int, body: Any, context: dict) -> NewsnackError:
    message = body.get("error") if isinstance(body, dict) else None
    message = message or (body if isinstance(body, str) and body else f"HTTP {status}")
    kind = {
        401: NewsnackUnauthorized,
        404: NewsnackNotFound,
        409: NewsnackConflict,
        503: NewsnackUnavailable,
    }.get(status)
    if kind is None:
        kind = NewsnackServerError if status >= 500 else NewsnackRejected
    return kind(message, status, body, **context)
