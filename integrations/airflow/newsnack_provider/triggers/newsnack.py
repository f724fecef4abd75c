"""``NewsnackWaitTrigger``: the smart wait, run in Airflow's triggerer.

It sends ``POST /waits`` with the absolute ``deadline`` the operator
computed when the task first deferred, and yields one ``TriggerEvent`` with
the answer. The deadline lives in the trigger's arguments, so a trigger
started again (the triggerer killed, the trigger moved to another one) or
run twice at once after a failover asks for the same deadline and gets the
same answer: the service decides by the same rule at the same moment, and a
deadline already past is decided at once.

Its request carries the trigger's current span's trace context (Airflow 3
makes ``trigger.<task_id>`` current), or when none is current the task's,
which the operator passes as ``trace_context`` when it defers (Airflow 2.10's
triggerer knows no task). A trigger serialised without it sends none.

It never blocks the triggerer's loop (``aiohttp``; the connection through
Airflow's async lookup). When the service is unreachable or answers 503 it
asks again with backoff (:data:`FIRST_RETRY_S` doubling up to
:data:`MAX_RETRY_S`) until :data:`GIVE_UP_AFTER_S` past the deadline, then
yields an error. Any other refusal (401, 404, 422, ...) is an error at once.

The event's payload is ``{"status": "success", "wait": <the wait's JSON>,
"deadline": ..., "answered_at": <when the answer came, RFC 3339>}`` or ``{"status": "error", "message": "...", "http_status": <int or None>}``.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional, Tuple

import aiohttp

from newsnack_provider._compat import BaseTrigger, TriggerEvent
from newsnack_provider.api import WAIT_MARGIN_S, NewsnackError, parse_rfc3339, rfc3339, wait_body
from newsnack_provider.hooks.newsnack import NewsnackHook

#: The first pause before asking an unreachable or busy service again.
FIRST_RETRY_S = 0.5
#: The longest pause between two asks.
MAX_RETRY_S = 10.0
#: How long past the deadline an unreachable service is still asked.
GIVE_UP_AFTER_S = 10.0


class NewsnackWaitTrigger(BaseTrigger):
    """Waits for `issue_ids` until `deadline` (RFC 3339) by the
    `min_completion` rule (None: the service's setting), through the
    connection `newsnack_conn_id`; `trace_context` (``traceparent`` and
    perhaps ``tracestate``) is sent when no span is current."""

    def __init__(
        self,
        issue_ids: List[int],
        deadline: str,
        min_completion: Optional[int] = None,
        newsnack_conn_id: str = NewsnackHook.default_conn_name,
        give_up_after_s: float = GIVE_UP_AFTER_S,
        trace_context: Optional[Mapping[str, str]] = None,
    ) -> None:
        super().__init__()
        self.issue_ids = [int(i) for i in issue_ids]
        self.deadline = deadline
        parse_rfc3339(deadline)
        self.min_completion = min_completion
        self.newsnack_conn_id = newsnack_conn_id
        self.give_up_after_s = give_up_after_s
        self.trace_context = dict(trace_context) if trace_context else None

    def serialize(self) -> Tuple[str, Dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "issue_ids": self.issue_ids,
                "deadline": self.deadline,
                "min_completion": self.min_completion,
                "newsnack_conn_id": self.newsnack_conn_id,
                "give_up_after_s": self.give_up_after_s,
                "trace_context": self.trace_context,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(await self.outcome())

    async def outcome(self) -> Dict[str, Any]:
        """The event's payload (see the module docs)."""
        try:
            service = await NewsnackHook(self.newsnack_conn_id).aget_conn()
            service = replace(service, fallback_trace=self.trace_context or {})
        except Exception as e:  # unknown connection, or one newsnack cannot read
            return error(f"connection {self.newsnack_conn_id!r}: {e}", None)
        deadline = parse_rfc3339(self.deadline)
        body = {**wait_body(self.issue_ids, self.min_completion), "deadline": self.deadline}
        pause = FIRST_RETRY_S
        async with aiohttp.ClientSession() as session:
            while True:
                left = (deadline - now()).total_seconds()
                try:
                    report = await service.apost(session, "/waits", body, max(left, 0.0) + WAIT_MARGIN_S)
                    return {"status": "success", "wait": report, "deadline": self.deadline, "answered_at": rfc3339(now())}
                except NewsnackError as e:
                    if not e.retryable:
                        return error(e.message, e.status)
                    until_give_up = (deadline - now()).total_seconds() + self.give_up_after_s
                    if until_give_up <= 0:
                        return error(
                            f"{e.message}; still failing {self.give_up_after_s:g} s after the "
                            f"wait's deadline {self.deadline}, giving up",
                            e.status,
                        )
                    self.log.warning("%s; asking again in %.1f s", e.message, pause)
                    await asyncio.sleep(min(pause, until_give_up))
                    pause = min(pause * 2, MAX_RETRY_S)


def now() -> datetime:
    return datetime.now(timezone.utc)


def error(message: str, status: Optional[int]) -> Dict[str, Any]:
    return {"status": "error", "message": message, "http_status": status}
