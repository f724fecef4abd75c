"""``NewsnackHook``: the ``newsnack`` connection turned into a
:class:`~newsnack_provider.api.Service`, and the service's three calls.

The connection (``newsnack_default`` unless told otherwise) gives host,
port, schema (``http`` or ``https``, default ``http``) and the API token as
its password. A host written as a full URL is used as it is. A connection of
type ``http`` (the HTTP provider's) is read the same way.

Its requests carry the current span's trace context, or inside a task on
Airflow 2.10 (which makes no span current) that of the span Airflow exports
for the task instance (:func:`~newsnack_provider._compat.task_trace_headers`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Optional

from newsnack_provider import CONNECTION_FORM
from newsnack_provider._compat import AirflowException, BaseHook, async_get_connection, task_trace_headers
from newsnack_provider.api import Service

#: The connection types this hook reads.
CONN_TYPES = ("newsnack", "http")


def service_of(conn: Any) -> Service:
    """The service a connection names, or an ``AirflowException`` saying
    what is missing."""
    conn_id = getattr(conn, "conn_id", "?")
    conn_type = getattr(conn, "conn_type", None)
    if conn_type and conn_type not in CONN_TYPES:
        raise AirflowException(
            f"connection {conn_id!r} is of type {conn_type!r}; newsnack reads types {list(CONN_TYPES)}"
        )
    host = (conn.host or "").strip()
    if not host:
        raise AirflowException(f"connection {conn_id!r} has no host: set the newsnack service's host")
    if "://" not in host:
        scheme = (conn.schema or "http").strip() or "http"
        if scheme not in ("http", "https"):
            raise AirflowException(
                f"connection {conn_id!r} has schema {scheme!r}; use http or https"
            )
        host = f"{scheme}://{host}"
        if conn.port:
            host = f"{host}:{conn.port}"
    return Service(base_url=host, token=conn.password or None)


class NewsnackHook(BaseHook):
    """Talks to the newsnack service named by the connection
    `newsnack_conn_id`."""

    conn_name_attr = "newsnack_conn_id"
    default_conn_name = "newsnack_default"
    conn_type = "newsnack"
    hook_name = "newsnack"

    def __init__(self, newsnack_conn_id: str = default_conn_name) -> None:
        super().__init__()
        self.newsnack_conn_id = newsnack_conn_id

    @classmethod
    def get_ui_field_behaviour(cls) -> Dict[str, Any]:
        """The connection form: host, port, schema and the token."""
        return dict(CONNECTION_FORM)

    def get_conn(self) -> Service:
        """The service, from the connection (looked up each call), sending
        the running task's trace context when no span is current."""
        service = service_of(self.get_connection(self.newsnack_conn_id))
        return replace(service, fallback_trace=task_trace_headers())

    async def aget_conn(self) -> Service:
        """:meth:`get_conn` without blocking an event loop."""
        return service_of(await async_get_connection(self.newsnack_conn_id))

    def claim(self, issue_ids: List[int], priority: str = "briefing") -> Dict[str, Any]:
        return self.get_conn().claim(issue_ids, priority)

    def wait(
        self, issue_ids: List[int], timeout_s: Optional[float] = None, min_completion: Optional[int] = None
    ) -> Dict[str, Any]:
        return self.get_conn().wait(issue_ids, timeout_s, min_completion)

    def briefing(self, issue_ids: List[int]) -> Dict[str, Any]:
        return self.get_conn().briefing(issue_ids)
