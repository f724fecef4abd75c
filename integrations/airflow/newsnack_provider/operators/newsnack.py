"""The operators for the briefing's three steps: claim, wait, briefing.

Each takes ``issue_ids`` (templated) as a list of ids, or as the previous
step's JSON: the claim's (its ``claimed`` ids) or the wait's (its
``completed`` ids), also as rendered JSON text. Each talks to the service
through the connection ``newsnack_conn_id`` (:class:`NewsnackHook`).

``NewsnackWaitOperator`` defers to :class:`NewsnackWaitTrigger` by default,
with an absolute deadline: `timeout_s` after the upstream claim step
answered (it records when under the XCom key :data:`CLAIMED_AT_XCOM`), so a
retried wait task keeps the first try's deadline; with no claim step
upstream, `timeout_s` after the task first defers. ``deferrable=False``
sends one blocking ``POST /waits`` from the worker instead. A deferred wait
hands the task's trace context to the trigger (Airflow 2.10's triggerer
knows no task). ``all_pass`` and ``timeout_pass`` return the wait's JSON (its ``completed`` ids go on to the
briefing; a deferred wait also records its deadline and when the service
answered under the XCom key :data:`DECISION_XCOM`), ``skip`` raises ``AirflowSkipException``, an error
``AirflowException`` with the service's message.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Dict, List, Optional, Sequence

from newsnack_provider._compat import AirflowException, AirflowSkipException, BaseOperator, Context
from newsnack_provider.api import NewsnackError, parse_rfc3339, rfc3339
from newsnack_provider.hooks.newsnack import NewsnackHook
from newsnack_provider.triggers.newsnack import GIVE_UP_AFTER_S, NewsnackWaitTrigger

#: A deferred wait's timeout when none is given: the service's default
#: ``content_gen_timeout_s``. A deferred wait needs its deadline when it
#: first defers, and the API does not publish the setting.
DEFAULT_TIMEOUT_S = 600.0
#: The XCom key under which a deferred wait records its deadline and
#: when the service answered.
DECISION_XCOM = "wait_decision"
#: The XCom key under which the claim step records when the service
#: answered it: the anchor of the wait's deadline.
CLAIMED_AT_XCOM = "claimed_at"
#: The longest wait the service accepts.
MAX_TIMEOUT_S = 86_400.0


def issue_ids_from(value: Any) -> List[int]:
    """The ids `value` names (see the module docs), or an
    ``AirflowException`` saying what it got."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise AirflowException(f"issue_ids: not a list of ids or a step's JSON: {value!r}") from None
    if isinstance(value, dict):
        for key in ("completed", "claimed"):
            if key in value:
                return issue_ids_from(value[key])
        raise AirflowException(f"issue_ids: a JSON object without 'completed' or 'claimed': {value!r}")
    if isinstance(value, (list, tuple)) and all(
        isinstance(i, (int, str)) and not isinstance(i, bool) for i in value
    ):
        try:
            return [int(i) for i in value]
        except ValueError:
            pass
    raise AirflowException(f"issue_ids: not a list of ids or a step's JSON: {value!r}")


def _number(name: str, value: Any, kind: Callable[[Any], Any]) -> Any:
    """`value` (perhaps rendered text) as `kind`; None for none."""
    if value is None or value == "" or value == "None":
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise AirflowException(f"{name} must be a number, got {value!r}") from None


def _service_call(what: str, call: Any) -> Dict[str, Any]:
    try:
        return dict(call())
    except NewsnackError as e:
        raise AirflowException(f"{what}: {e.message}") from None


class NewsnackClaimOperator(BaseOperator):
    """``POST /ai-articles``: claims `issue_ids` at `priority`; returns the
    claim's JSON (``claimed``, ``skipped``; a 409, nothing claimable, is not
    an error)."""

    template_fields: Sequence[str] = ("issue_ids",)

    def __init__(
        self,
        *,
        issue_ids: Any,
        priority: str = "briefing",
        newsnack_conn_id: str = NewsnackHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.issue_ids = issue_ids
        self.priority = priority
        self.newsnack_conn_id = newsnack_conn_id

    def execute(self, context: Context) -> Dict[str, Any]:
        ids = issue_ids_from(self.issue_ids)
        hook = NewsnackHook(self.newsnack_conn_id)
        claim = _service_call("claim", lambda: hook.claim(ids, self.priority))
        self.log.info("claimed %s, skipped %s", claim.get("claimed"), claim.get("skipped"))
        ti = context.get("ti")
        if ti is not None:
            ti.xcom_push(key=CLAIMED_AT_XCOM, value=rfc3339(datetime.now(timezone.utc)))
        return claim


class NewsnackWaitOperator(BaseOperator):
    """The smart wait on `issue_ids` (see the module docs). `timeout_s`
    None: the service's setting when blocking, :data:`DEFAULT_TIMEOUT_S`
    when deferred; `min_completion` None: the service's setting. Both are
    templated too (a run's ``params``)."""

    template_fields: Sequence[str] = ("issue_ids", "timeout_s", "min_completion")

    def __init__(
        self,
        *,
        issue_ids: Any,
        timeout_s: Optional[float] = None,
        min_completion: Optional[int] = None,
        deferrable: bool = True,
        newsnack_conn_id: str = NewsnackHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.issue_ids = issue_ids
        self.timeout_s = timeout_s
        self.min_completion = min_completion
        self.deferrable = deferrable
        self.newsnack_conn_id = newsnack_conn_id

    def execute(self, context: Context) -> Optional[Dict[str, Any]]:
        ids = issue_ids_from(self.issue_ids)
        self.timeout_s = _number("timeout_s", self.timeout_s, float)
        self.min_completion = _number("min_completion", self.min_completion, int)
        if self.timeout_s is not None and not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise AirflowException(f"timeout_s must be more than 0 and at most {MAX_TIMEOUT_S:g}, got {self.timeout_s}")
        hook = NewsnackHook(self.newsnack_conn_id)
        # Reads the connection now: an unknown or unusable one fails here,
        # before any trigger exists.
        service = hook.get_conn()
        if not self.deferrable:
            report = _service_call("wait", lambda: service.wait(ids, self.timeout_s, self.min_completion))
            return self.decided(report, len(ids))
        timeout_s = self.timeout_s if self.timeout_s is not None else DEFAULT_TIMEOUT_S
        claimed_at = self.claimed_at(context)
        deadline = (claimed_at or datetime.now(timezone.utc)) + timedelta(seconds=timeout_s)
        self.log.info(
            "deferring the wait on %s until %s (%s)",
            ids, rfc3339(deadline), f"claimed at {rfc3339(claimed_at)}" if claimed_at else "from now",
        )
        self.defer(
            trigger=NewsnackWaitTrigger(
                issue_ids=ids,
                deadline=rfc3339(deadline),
                min_completion=self.min_completion,
                newsnack_conn_id=self.newsnack_conn_id,
                trace_context=service.trace_headers() or None,
            ),
            method_name="execute_complete",
            # A backstop: the trigger itself ends by GIVE_UP_AFTER_S past the deadline.
            timeout=timedelta(seconds=timeout_s + GIVE_UP_AFTER_S + 60),
        )
        return None

    def claimed_at(self, context: Context) -> Optional[datetime]:
        """When the latest upstream claim step was answered, if the wait
        follows one: it stays the same across the wait task's tries, where
        the moment a try defers does not."""
        ti = context.get("ti")
        upstream = sorted(getattr(self, "upstream_task_ids", ()) or ())
        if ti is None or not upstream:
            return None
        pulled = ti.xcom_pull(task_ids=upstream, key=CLAIMED_AT_XCOM)
        values = pulled if isinstance(pulled, (list, tuple)) else [pulled]
        moments = []
        for value in values:
            if isinstance(value, str):
                try:
                    moments.append(parse_rfc3339(value))
                except ValueError:
                    self.log.warning("ignoring an unreadable %s: %r", CLAIMED_AT_XCOM, value)
        return max(moments, default=None)

    def execute_complete(self, context: Context, event: Dict[str, Any]) -> Dict[str, Any]:
        """The trigger's event, mapped as the module docs say."""
        if event.get("status") != "success":
            raise AirflowException(f"wait: {event.get('message', event)}")
        self.log.info("the service answered at %s; the wait's deadline was %s", event.get("answered_at"), event.get("deadline"))
        ti = context.get("ti")
        if ti is not None:
            ti.xcom_push(key=DECISION_XCOM, value={k: event.get(k) for k in ("deadline", "answered_at")})
        return self.decided(dict(event["wait"]), len(issue_ids_from(self.issue_ids)))

    def decided(self, report: Dict[str, Any], targets: int) -> Dict[str, Any]:
        outcome = report.get("outcome")
        self.log.info(
            "wait: %s after %s ms; completed %s, failed %s, unfinished %s",
            outcome, report.get("waited_ms"), report.get("completed"), report.get("failed"), report.get("unfinished"),
        )
        if outcome == "skip":
            raise AirflowSkipException(
                f"skip: {len(report.get('completed', []))} of {targets} DONE, fewer than the minimum; "
                f"failed {report.get('failed')}, unfinished {report.get('unfinished')}"
            )
        if outcome not in ("all_pass", "timeout_pass"):
            raise AirflowException(f"wait: an answer without a known outcome: {report!r}")
        return report


class NewsnackBriefingOperator(BaseOperator):
    """``POST /today-newsnack``: publishes the briefing from `issue_ids` (the
    wait's ``completed`` ids when given its JSON); returns the briefing's
    JSON. Nothing to publish (no completed ids) skips."""

    template_fields: Sequence[str] = ("issue_ids",)

    def __init__(
        self,
        *,
        issue_ids: Any,
        newsnack_conn_id: str = NewsnackHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.issue_ids = issue_ids
        self.newsnack_conn_id = newsnack_conn_id

    def execute(self, context: Context) -> Dict[str, Any]:
        ids = issue_ids_from(self.issue_ids)
        if not ids:
            raise AirflowSkipException("no completed ids: no briefing")
        hook = NewsnackHook(self.newsnack_conn_id)
        briefing = _service_call("briefing", lambda: hook.briefing(ids))
        self.log.info("briefing %s from %s", briefing.get("briefing_id"), briefing.get("issue_ids"))
        return briefing
