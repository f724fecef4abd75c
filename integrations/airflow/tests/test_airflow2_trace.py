"""Inside a task on Airflow 2.10, which makes no span current but (with
``[traces] otel_on``) exports one per task instance with ids it derives from
the run and the try: the hook sends that span's ids, and a deferred wait
hands them to its trigger, whose triggerer knows no task; with tracing off
nothing is sent. Real task instances of a DAG run in Airflow's database (a
throwaway SQLite in ``AIRFLOW_HOME``) run as a worker runs them
(``ti.run()``), against the real service behind the recording relay; the
wait's trigger is made from its database row as the triggerer makes it.

Collected on Airflow 2 only (``conftest.py``): Airflow 3 makes the task's
span current (``test_trace_context.py``)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Dict, List, Optional

import pytest
from airflow import DAG
from airflow.models.trigger import Trigger
from airflow.traces.utils import gen_span_id, gen_trace_id
from airflow.utils import db
from airflow.utils.module_loading import import_string
from airflow.utils.session import create_session
from airflow.utils.state import DagRunState, TaskInstanceState
from airflow.utils.types import DagRunType

from newsnack_provider.operators.newsnack import NewsnackClaimOperator, NewsnackWaitOperator
from relay import Relay


@pytest.fixture(scope="module")
def airflow_db() -> None:
    """Airflow's metadata database, made in the throwaway ``AIRFLOW_HOME``."""
    db.initdb()


class Ran:
    """A DAG run of a claim and a deferred wait: what the wait's trigger
    answered and the ``traceparent`` of the span Airflow exports for each
    task instance (``gen_trace_id``, ``gen_span_id``)."""

    def __init__(self, event: Dict[str, Any], kwargs: Dict[str, Any], exported: Dict[str, str]) -> None:
        self.event = event
        self.trigger_kwargs = kwargs
        self.exported = exported


def claim_and_deferred_wait(dag_id: str, ids: List[int], conn_id: str) -> Ran:
    """Runs a claim of `ids` and a wait on it, deferred; then its trigger."""
    now = datetime.now(timezone.utc)
    with DAG(dag_id, schedule=None, start_date=now - timedelta(days=1)) as dag:
        claim = NewsnackClaimOperator(task_id="claim", issue_ids=ids, newsnack_conn_id=conn_id)
        wait = NewsnackWaitOperator(
            task_id="wait", issue_ids=claim.output, timeout_s=30, min_completion=1, newsnack_conn_id=conn_id
        )
        claim >> wait
    dag.sync_to_db()
    run = dag.create_dagrun(
        run_id=f"{dag_id}-run",
        run_type=DagRunType.MANUAL,
        state=DagRunState.RUNNING,
        execution_date=now,
        data_interval=(now, now),
        start_date=now,
        external_trigger=True,
    )
    tis = {ti.task_id: ti for ti in run.get_task_instances()}
    for ti in tis.values():
        ti.task = dag.get_task(ti.task_id)
    tis["claim"].run()
    tis["wait"].run()
    assert (tis["claim"].state, tis["wait"].state) == (TaskInstanceState.SUCCESS, TaskInstanceState.DEFERRED)
    with create_session() as session:
        row = session.get(Trigger, tis["wait"].trigger_id)
        assert row is not None
        classpath, kwargs = row.classpath, dict(row.kwargs)
        stored = session.merge(run)
        exported = {
            ti.task_id: f"00-{gen_trace_id(stored)}-{gen_span_id(ti)}-01"
            for ti in stored.get_task_instances(session=session)
        }
    trigger = import_string(classpath)(**kwargs)

    async def first_event() -> Dict[str, Any]:
        event = await trigger.run().__anext__()
        return dict(event.payload)

    return Ran(asyncio.run(asyncio.wait_for(first_event(), 60)), kwargs, exported)


def trace_of(traceparent: Optional[str]) -> Optional[str]:
    return traceparent.split("-")[1] if traceparent else None


def test_with_otel_on_a_task_sends_the_ids_of_the_span_airflow_exports_for_it(
    airflow_db: None,
    relay: Relay,
    add_issues: Callable[..., List[int]],
    connection: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AIRFLOW__TRACES__OTEL_ON", "True")
    ids = add_issues("Traced on 2.10")
    conn_id = connection("nn_airflow2_traced", host="127.0.0.1", port=relay.port, schema="http")
    ran = claim_and_deferred_wait("newsnack_airflow2_traced", ids, conn_id)
    assert ran.event["status"] == "success", ran.event
    claim, wait = ran.exported["claim"], ran.exported["wait"]
    assert trace_of(claim) == trace_of(wait) and claim != wait
    assert [(e.path, e.sent) for e in relay.exchanges] == [
        ("/ai-articles", {"traceparent": claim, "tracestate": None}),
        ("/waits", {"traceparent": wait, "tracestate": None}),
    ]
    assert ran.trigger_kwargs["trace_context"] == {"traceparent": wait}
    # newsnack answered each in the run's trace.
    assert [trace_of(e.answered) for e in relay.exchanges] == [trace_of(claim)] * 2


def test_with_otel_off_a_task_sends_no_trace_context(
    airflow_db: None,
    relay: Relay,
    add_issues: Callable[..., List[int]],
    connection: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AIRFLOW__TRACES__OTEL_ON", "False")
    ids = add_issues("Untraced on 2.10")
    conn_id = connection("nn_airflow2_untraced", host="127.0.0.1", port=relay.port, schema="http")
    ran = claim_and_deferred_wait("newsnack_airflow2_untraced", ids, conn_id)
    assert ran.event["status"] == "success", ran.event
    assert [(e.path, e.sent) for e in relay.exchanges] == [
        ("/ai-articles", {"traceparent": None, "tracestate": None}),
        ("/waits", {"traceparent": None, "tracestate": None}),
    ]
    assert ran.trigger_kwargs["trace_context"] is None
    assert [e.answered for e in relay.exchanges] == [None, None]
