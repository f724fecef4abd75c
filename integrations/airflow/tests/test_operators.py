"""The operators against a real ``newsnack serve``: the wait defers with its
deadline and ``execute_complete`` maps each outcome; the blocking wait, the
claim and the briefing; ``issue_ids`` from a list or a step's JSON; and a
bad connection or token failing clearly."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Dict, List, Optional

import pytest

from conftest import TaskDeferred
from newsnack_provider._compat import AirflowException, AirflowSkipException
from newsnack_provider.api import Service, parse_rfc3339
from newsnack_provider.operators.newsnack import (
    CLAIMED_AT_XCOM,
    NewsnackBriefingOperator,
    NewsnackClaimOperator,
    NewsnackWaitOperator,
    issue_ids_from,
)
from newsnack_provider.triggers.newsnack import NewsnackWaitTrigger

CONTEXT: Dict[str, Any] = {}


def test_issue_ids_from_a_list_or_a_steps_json() -> None:
    assert issue_ids_from([3, "1"]) == [3, 1]
    assert issue_ids_from({"claimed": [4, 5], "skipped": [6]}) == [4, 5]
    assert issue_ids_from({"outcome": "all_pass", "completed": [7], "failed": [8]}) == [7]
    assert issue_ids_from('{"completed": [9, 10]}') == [9, 10]
    assert issue_ids_from("[11]") == [11]
    for bad in ["eleven", {"ids": [1]}, [True], [1.5, "x"], None]:
        with pytest.raises(AirflowException, match="issue_ids"):
            issue_ids_from(bad)


def test_the_wait_defers_with_an_absolute_deadline(connection: Callable[..., str]) -> None:
    operator = NewsnackWaitOperator(
        task_id="wait", issue_ids={"claimed": [1, 2]}, timeout_s=90, min_completion=1, newsnack_conn_id=connection()
    )
    before = datetime.now(timezone.utc)
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute(CONTEXT)
    trigger = deferred.value.trigger
    assert isinstance(trigger, NewsnackWaitTrigger)
    assert deferred.value.method_name == "execute_complete"
    assert trigger.issue_ids == [1, 2]
    assert trigger.min_completion == 1
    assert trigger.newsnack_conn_id == "newsnack_default"
    ahead = (parse_rfc3339(trigger.deadline) - before).total_seconds()
    assert 89 < ahead < 92, ahead


class TaskInstanceXComs:
    """The XCom half of a task instance, kept across a task's tries as
    Airflow keeps upstream steps' XComs when a task is retried."""

    def __init__(self) -> None:
        self.pushed: Dict[tuple[str, str], Any] = {}
        self.task_id = ""

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[(self.task_id, key)] = value

    def xcom_pull(self, task_ids: List[str], key: str) -> List[Optional[Any]]:
        return [self.pushed.get((task_id, key)) for task_id in task_ids]


def test_a_retried_wait_keeps_the_deadline_the_claim_started(
    service: Service, add_issues: Callable[..., List[int]], connection: Callable[..., str]
) -> None:
    ids = add_issues("First", "Second")
    conn_id = connection()
    ti = TaskInstanceXComs()
    ti.task_id = "claim"
    claim = NewsnackClaimOperator(task_id="claim", issue_ids=ids, newsnack_conn_id=conn_id).execute({"ti": ti})
    claimed_at = parse_rfc3339(ti.pushed[("claim", CLAIMED_AT_XCOM)])
    assert abs((datetime.now(timezone.utc) - claimed_at).total_seconds()) < 5
    # The wait's tries come later: as if the claim had answered 30 s ago.
    claimed_at -= timedelta(seconds=30)
    ti.pushed[("claim", CLAIMED_AT_XCOM)] = claimed_at.isoformat()
    ti.task_id = "wait"
    deadlines = []
    for _try in range(2):  # the first try, then a retry
        wait = NewsnackWaitOperator(task_id="wait", issue_ids=claim, timeout_s=90, newsnack_conn_id=conn_id)
        wait.upstream_task_ids.add("claim")
        with pytest.raises(TaskDeferred) as deferred:
            wait.execute({"ti": ti})
        deadlines.append(parse_rfc3339(deferred.value.trigger.deadline))
    assert deadlines == [claimed_at + timedelta(seconds=90)] * 2


def test_execute_complete_maps_each_outcome() -> None:
    operator = NewsnackWaitOperator(task_id="wait", issue_ids=[1, 2, 3])
    report = {"outcome": "timeout_pass", "completed": [1, 2], "failed": [], "unfinished": [3], "waited_ms": 5}
    assert operator.execute_complete(CONTEXT, {"status": "success", "wait": report}) == report
    all_pass = {**report, "outcome": "all_pass", "completed": [1, 2, 3], "unfinished": []}
    assert operator.execute_complete(CONTEXT, {"status": "success", "wait": all_pass}) == all_pass
    skip = {**report, "outcome": "skip", "completed": [1]}
    with pytest.raises(AirflowSkipException, match="skip: 1 of 3 DONE, fewer than the minimum"):
        operator.execute_complete(CONTEXT, {"status": "success", "wait": skip})
    with pytest.raises(AirflowException, match="wait: POST /waits failed \\(HTTP 404\\): unknown"):
        operator.execute_complete(
            CONTEXT, {"status": "error", "message": "POST /waits failed (HTTP 404): unknown issue ids", "http_status": 404}
        )


def test_claim_blocking_wait_and_briefing_publish_the_completed_ids(
    service: Service, add_issues: Callable[..., List[int]], connection: Callable[..., str]
) -> None:
    ids = add_issues("Hot", "refuse: the model will not write this", "Warm")
    conn_id = connection(conn_type="http")  # the HTTP provider's type is read too
    claim = NewsnackClaimOperator(task_id="claim", issue_ids=ids, newsnack_conn_id=conn_id).execute(CONTEXT)
    assert claim == {"claimed": ids, "skipped": []}
    wait = NewsnackWaitOperator(
        task_id="wait", issue_ids=claim, timeout_s=60, min_completion=2, deferrable=False, newsnack_conn_id=conn_id
    ).execute(CONTEXT)
    assert wait is not None
    assert wait["outcome"] == "timeout_pass"
    assert wait["completed"] == [ids[0], ids[2]]
    assert wait["failed"] == [ids[1]]
    briefing = NewsnackBriefingOperator(task_id="brief", issue_ids=wait, newsnack_conn_id=conn_id).execute(CONTEXT)
    assert briefing["issue_ids"] == [ids[0], ids[2]]
    assert isinstance(briefing["briefing_id"], int)


def test_a_blocking_wait_that_skips_raises_skip(
    service: Service, add_issues: Callable[..., List[int]], connection: Callable[..., str]
) -> None:
    ids = add_issues("refuse one", "refuse two")
    service.claim(ids)
    operator = NewsnackWaitOperator(
        task_id="wait", issue_ids=ids, timeout_s=60, min_completion=1, deferrable=False, newsnack_conn_id=connection()
    )
    with pytest.raises(AirflowSkipException, match="skip: 0 of 2 DONE"):
        operator.execute(CONTEXT)
    with pytest.raises(AirflowSkipException, match="no completed ids"):
        NewsnackBriefingOperator(task_id="brief", issue_ids={"completed": []}).execute(CONTEXT)


def test_an_unknown_connection_fails_before_deferring() -> None:
    operator = NewsnackWaitOperator(task_id="wait", issue_ids=[1], newsnack_conn_id="no_such_connection")
    with pytest.raises(Exception, match="no_such_connection"):
        operator.execute(CONTEXT)


def test_bad_connections_and_tokens_fail_clearly(
    add_issues: Callable[..., List[int]], connection: Callable[..., str], unused_port: int
) -> None:
    (issue,) = add_issues("One")
    cases = [
        (connection("wrong_token", password="not-the-token"), "claim: POST /ai-articles failed \\(HTTP 401\\): missing or wrong bearer token"),
        (connection("no_host", host=""), "connection 'no_host' has no host"),
        (connection("ftp", schema="ftp"), "connection 'ftp' has schema 'ftp'; use http or https"),
        (connection("postgres", conn_type="postgres"), "connection 'postgres' is of type 'postgres'"),
        (connection("down", port=unused_port), f"claim: POST /ai-articles: cannot reach http://127.0.0.1:{unused_port}"),
    ]
    for conn_id, message in cases:
        with pytest.raises(AirflowException, match=message):
            NewsnackClaimOperator(task_id="claim", issue_ids=[issue], newsnack_conn_id=conn_id).execute(CONTEXT)
    started = time.monotonic()
    with pytest.raises(AirflowException, match="wait: POST /waits failed \\(HTTP 404\\): unknown issue ids"):
        NewsnackWaitOperator(
            task_id="wait", issue_ids=[issue, 987_654_321], deferrable=False, newsnack_conn_id=connection()
        ).execute(CONTEXT)
    assert time.monotonic() - started < 10
