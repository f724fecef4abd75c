"""The task's trace continues into newsnack: the hook and the trigger send
the current OpenTelemetry span's ``traceparent`` and ``tracestate``, and the
real ``newsnack serve`` answers in that trace. Between them, the recording
relay (``relay.Relay``, the fixture ``relay``) keeps what went each way. Without a current span
nothing is sent. A deferring wait hands the task's context to its trigger,
which sends it when no span is current in the triggerer and keeps it when
serialised. (Inside a task on Airflow 2.10: ``test_airflow2_trace.py``.)"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone
from typing import Callable, Dict, List, Optional

import pytest
from opentelemetry.context import Context as TraceContext
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from conftest import TaskDeferred
from newsnack_provider.api import Service, rfc3339
from newsnack_provider.hooks.newsnack import NewsnackHook
from newsnack_provider.operators.newsnack import NewsnackWaitOperator
from newsnack_provider.triggers.newsnack import NewsnackWaitTrigger
from relay import Relay

#: The context the task's span continues (as Airflow's scheduler would
#: hand it down), with a vendor's ``tracestate``.
UPSTREAM = "00-8a3c60f7d188f8fa79d48a391a778fa6-53995c3f42cd8ad8-01"
STATE = "airflow=task"
#: Another task's context, handed to a trigger that runs inside a span.
HANDED = "00-0b1c2d3e4f5a69788796a5b4c3d2e1f0-1a2b3c4d5e6f7a8b-01"


@pytest.fixture
def tracer() -> Tracer:
    """A tracer of the OpenTelemetry SDK (Airflow's own dependency); its
    spans are made current by ``start_as_current_span``, as Airflow makes a
    task's."""
    return TracerProvider().get_tracer("newsnack-provider-tests")


def upstream_context() -> TraceContext:
    return TraceContextTextMapPropagator().extract({"traceparent": UPSTREAM, "tracestate": STATE})


def traceparent_of(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


def trace_of(traceparent: Optional[str]) -> Optional[str]:
    return traceparent.split("-")[1] if traceparent else None


def test_the_hook_sends_the_current_spans_context_and_newsnack_continues_its_trace(
    relay: Relay, tracer: Tracer, add_issues: Callable[..., List[int]], connection: Callable[..., str]
) -> None:
    ids = add_issues("Traced")
    conn_id = connection("nn_traced", host="127.0.0.1", port=relay.port, schema="http")
    with tracer.start_as_current_span("worker.claim", context=upstream_context()) as span:
        claim = NewsnackHook(conn_id).claim(ids)
        context = span.get_span_context()
    assert claim["claimed"] == ids
    [exchange] = relay.exchanges
    assert exchange.path == "/ai-articles"
    assert exchange.sent == {
        "traceparent": traceparent_of(context.trace_id, context.span_id),
        "tracestate": STATE,
    }
    assert trace_of(exchange.answered) == trace_of(UPSTREAM), exchange.answered


def test_the_trigger_sends_the_current_spans_context_and_newsnack_continues_its_trace(
    relay: Relay, tracer: Tracer, service: Service, add_issues: Callable[..., List[int]], connection: Callable[..., str]
) -> None:
    ids = add_issues("Traced wait")
    service.claim(ids)
    conn_id = connection("nn_traced_wait", host="127.0.0.1", port=relay.port, schema="http")
    deadline = rfc3339(datetime.now(timezone.utc) + timedelta(seconds=30))
    # The span current in the triggerer wins over the context the task handed on.
    trigger = NewsnackWaitTrigger(
        issue_ids=ids, deadline=deadline, min_completion=1, newsnack_conn_id=conn_id, trace_context={"traceparent": HANDED}
    )

    async def first_event() -> Dict[str, object]:
        event = await trigger.run().__anext__()
        return dict(event.payload)

    # As the triggerer runs it: inside the trigger's current span.
    with tracer.start_as_current_span("trigger.wait", context=upstream_context()) as span:
        payload = asyncio.run(asyncio.wait_for(first_event(), 60))
        context = span.get_span_context()
    assert payload["status"] == "success", payload
    [exchange] = relay.exchanges
    assert exchange.path == "/waits"
    assert exchange.sent["traceparent"] == traceparent_of(context.trace_id, context.span_id)
    assert exchange.sent["tracestate"] == STATE
    assert trace_of(exchange.answered) == trace_of(UPSTREAM), exchange.answered


def test_without_a_current_span_no_context_is_sent(
    relay: Relay, add_issues: Callable[..., List[int]], connection: Callable[..., str]
) -> None:
    ids = add_issues("Untraced")
    conn_id = connection("nn_untraced", host="127.0.0.1", port=relay.port, schema="http")
    claim = NewsnackHook(conn_id).claim(ids)
    assert claim["claimed"] == ids
    [exchange] = relay.exchanges
    assert exchange.sent == {"traceparent": None, "tracestate": None}
    assert exchange.answered is None


def test_without_a_current_span_the_trigger_sends_the_context_the_task_handed_it(
    relay: Relay, service: Service, add_issues: Callable[..., List[int]], connection: Callable[..., str]
) -> None:
    ids = add_issues("Handed wait")
    service.claim(ids)
    conn_id = connection("nn_handed_wait", host="127.0.0.1", port=relay.port, schema="http")
    deadline = rfc3339(datetime.now(timezone.utc) + timedelta(seconds=30))
    trigger = NewsnackWaitTrigger(
        issue_ids=ids,
        deadline=deadline,
        min_completion=1,
        newsnack_conn_id=conn_id,
        trace_context={"traceparent": UPSTREAM, "tracestate": STATE},
    )

    async def first_event() -> Dict[str, object]:
        event = await trigger.run().__anext__()
        return dict(event.payload)

    payload = asyncio.run(asyncio.wait_for(first_event(), 60))
    assert payload["status"] == "success", payload
    [exchange] = relay.exchanges
    assert exchange.sent == {"traceparent": UPSTREAM, "tracestate": STATE}
    assert trace_of(exchange.answered) == trace_of(UPSTREAM), exchange.answered


def test_the_trigger_keeps_its_trace_context_when_serialised_and_loads_one_serialised_without_it() -> None:
    deadline = rfc3339(datetime.now(timezone.utc) + timedelta(seconds=30))
    handed = {"traceparent": UPSTREAM, "tracestate": STATE}
    classpath, kwargs = NewsnackWaitTrigger(issue_ids=[1], deadline=deadline, trace_context=handed).serialize()
    assert kwargs["trace_context"] == handed
    # Stored as JSON, and made again from what was stored, as the triggerer makes it.
    stored = json.loads(json.dumps(kwargs))
    again = NewsnackWaitTrigger(**stored)
    assert again.trace_context == handed
    assert again.serialize() == (classpath, kwargs)
    # A trigger serialised before it had the argument.
    older = {key: value for key, value in stored.items() if key != "trace_context"}
    assert NewsnackWaitTrigger(**older).trace_context is None
    assert NewsnackWaitTrigger(**older).serialize()[1]["trace_context"] is None


def test_a_deferring_wait_hands_the_tasks_trace_context_to_its_trigger(
    tracer: Tracer, connection: Callable[..., str]
) -> None:
    operator = NewsnackWaitOperator(task_id="wait", issue_ids=[1], timeout_s=60, newsnack_conn_id=connection())
    with tracer.start_as_current_span("worker.wait", context=upstream_context()) as span:
        with pytest.raises(TaskDeferred) as traced:
            operator.execute({})
        context = span.get_span_context()
    assert traced.value.trigger.trace_context == {
        "traceparent": traceparent_of(context.trace_id, context.span_id),
        "tracestate": STATE,
    }
    with pytest.raises(TaskDeferred) as untraced:
        operator.execute({})
    assert untraced.value.trigger.trace_context is None
