"""Fixtures for the provider's tests: the real ``newsnack serve`` they run
against, issues added to it over its API, the connections that name it, and
a recording relay in front of it.

The service is started by ``tests/airflow_provider.rs`` (``cargo test
--test airflow_provider``), which passes its address and token in
``NEWSNACK_TEST_URL`` and ``NEWSNACK_TEST_TOKEN``; without them the tests
fail and say so. Its writer writes every article at once, except for issues
whose title starts with ``refuse``: those fail for good.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any, Callable, Dict, Iterator, List
from urllib.parse import urlsplit

import airflow
import pytest

from newsnack_provider.api import Service
from relay import Relay

try:  # Airflow 3
    from airflow.sdk.exceptions import TaskDeferred
except ImportError:  # Airflow 2.10
    from airflow.exceptions import TaskDeferred  # type: ignore[no-redef,attr-defined]

__all__ = ["TaskDeferred"]

#: Airflow 2.10's task-span ids (``test_airflow2_trace.py``) exist on
#: Airflow 2 only; Airflow 3 makes the task's span current instead.
collect_ignore = [] if airflow.__version__.startswith("2.") else ["test_airflow2_trace.py"]


@pytest.fixture(scope="session")
def service() -> Service:
    url = os.environ.get("NEWSNACK_TEST_URL")
    token = os.environ.get("NEWSNACK_TEST_TOKEN")
    if not url or not token:
        pytest.fail(
            "NEWSNACK_TEST_URL and NEWSNACK_TEST_TOKEN are not set: run these tests with "
            "`cargo test --test airflow_provider`, which starts `newsnack serve` for them"
        )
    return Service(url, token)


@pytest.fixture
def add_issues(service: Service) -> Callable[..., List[int]]:
    """Adds issues with these titles (scores falling in order) over
    ``POST /issues``; their ids."""

    def add(*titles: str) -> List[int]:
        issues = [
            {"title": f"{title} {os.urandom(6).hex()}", "body": "It happened. Then more happened.", "score": 10.0 - i}
            for i, title in enumerate(titles)
        ]
        return [int(i) for i in service.post("/issues", {"issues": issues})["ids"]]

    return add


def connection_env(conn_id: str, fields: Dict[str, Any]) -> tuple[str, str]:
    return f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(fields)


@pytest.fixture
def connection(service: Service, monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """Defines the connection `conn_id` (in the environment, as Airflow
    reads it) to the service, of type `conn_type`, with `token` (default:
    the right one); its id."""

    def define(conn_id: str = "newsnack_default", conn_type: str = "newsnack", **overrides: Any) -> str:
        address = urlsplit(service.base_url)
        fields: Dict[str, Any] = {
            "conn_type": conn_type,
            "host": address.hostname,
            "port": address.port,
            "schema": address.scheme,
            "password": service.token,
        }
        fields.update(overrides)
        monkeypatch.setenv(*connection_env(conn_id, fields))
        return conn_id

    return define


@pytest.fixture
def relay(service: Service) -> Iterator[Relay]:
    """A :class:`relay.Relay` in front of the service, passing every
    request on until a test sets its ``unavailable``."""
    relay = Relay(service.base_url.rstrip("/"))
    yield relay
    relay.close()


@pytest.fixture
def unused_port() -> Iterator[int]:
    """A port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    yield port
