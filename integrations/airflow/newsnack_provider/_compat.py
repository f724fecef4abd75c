"""The Airflow names the provider uses, from Airflow 3's Task SDK where it
has them and from Airflow 2.10's modules otherwise: the one place that
knows which version is installed."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Dict

from airflow.triggers.base import BaseTrigger, TriggerEvent

if TYPE_CHECKING:  # checked against Airflow 3
    from airflow.sdk import BaseHook, BaseOperator, Context
    from airflow.sdk.exceptions import AirflowException, AirflowSkipException
else:
    try:  # Airflow 3
        from airflow.sdk import BaseHook, BaseOperator, Context
        from airflow.sdk.exceptions import AirflowException, AirflowSkipException
    except ImportError:  # Airflow 2.10
        from airflow.exceptions import AirflowException, AirflowSkipException
        from airflow.hooks.base import BaseHook
        from airflow.models import BaseOperator
        from airflow.utils.context import Context


def async_get_connection(conn_id: str) -> Awaitable[Any]:
    """The connection `conn_id`, fetched without blocking the triggerer's
    loop: Airflow 3's ``aget_connection``, or 2.10's blocking lookup in a
    thread."""
    getter: Callable[[str], Awaitable[Any]]
    if hasattr(BaseHook, "aget_connection"):
        getter = BaseHook.aget_connection
    else:
        from asgiref.sync import sync_to_async

        getter = sync_to_async(BaseHook.get_connection)
    return getter(conn_id)


def task_trace_headers() -> Dict[str, str]:
    """Inside a task on Airflow 2.10 with ``[traces] otel_on``: the
    ``traceparent`` of the span Airflow exports for the task instance.
    Airflow does not make that span current; it derives its ids from the run
    and the try (``gen_trace_id(dag_run)``, ``gen_span_id(ti)``, here from
    the instance's key, which loads no relation). Empty on Airflow 3 (its
    task span is current), with tracing off, outside a task, or on any
    error: tracing never fails a task."""
    try:
        import airflow

        if not airflow.__version__.startswith("2."):
            return {}
        from airflow.configuration import conf

        if not conf.getboolean("traces", "otel_on", fallback=False):
            return {}
        from airflow.operators.python import get_current_context
        from airflow.traces.utils import gen_span_id_from_ti_key, gen_trace_id

        context = get_current_context()
        trace_id = gen_trace_id(context["dag_run"])
        span_id = gen_span_id_from_ti_key(context["ti"].key)
    except Exception:  # no task running, or an Airflow that derives no ids
        logging.getLogger(__name__).debug("no task trace context", exc_info=True)
        return {}
    # A run not started yet has no trace id (Airflow's NO_TRACE_ID).
    if not (_hex_id(trace_id, 32) and _hex_id(span_id, 16)):
        return {}
    return {"traceparent": f"00-{trace_id}-{span_id}-01"}


def _hex_id(value: Any, digits: int) -> bool:
    """Whether `value` is a valid (non-zero) W3C id of `digits` hex digits."""
    try:
        return isinstance(value, str) and len(value) == digits and int(value, 16) != 0
    except ValueError:
        return False


__all__ = [
    "AirflowException",
    "AirflowSkipException",
    "BaseHook",
    "BaseOperator",
    "BaseTrigger",
    "Context",
    "TriggerEvent",
    "async_get_connection",
    "task_trace_headers",
]
