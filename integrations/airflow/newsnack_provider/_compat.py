"""The Airflow names the provider uses, from Airflow 3's Task SDK where it
has them and from Airflow 2.10's modules otherwise: the one place that
knows which version is installed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable

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


__all__ = [
    "AirflowException",
    "AirflowSkipException",
    "BaseHook",
    "BaseOperator",
    "BaseTrigger",
    "Context",
    "TriggerEvent",
    "async_get_connection",
]
