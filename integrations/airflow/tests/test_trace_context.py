"""The task's trace continues into newsnack: the hook and the trigger send
the current OpenTelemetry span's ``traceparent`` and ``tracestate``, and the
real ``newsnack serve`` answers in that trace. Between them, the recording
relay (``relay.Relay``, the fixture ``relay``) keeps what went each way. Without a current span
nothing is sent."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Callable, Dict, List, Optional

import pytest
from opentelemetry.context import Context as TraceContext
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from newsnack_provider.api import Service, rfc3339
from newsnack_provider.hooks.newsnack import NewsnackHook
from newsnack_provider.triggers.newsnack import NewsnackWaitTrigger
from relay import Relay

#: The context the task's span continues (as Airflow's scheduler would
#: hand it down), with a vendor's ``tracestate``.
UPSTREAM = "00-8a3c60f7d188f8fa79d48a391a778fa6-53995c3f42cd8ad8-01"
STATE = "airflow=task"


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
    trigger = NewsnackWaitTrigger(issue_ids=ids, deadline=deadline, min_completion=1, newsnack_conn_id=conn_id)

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
