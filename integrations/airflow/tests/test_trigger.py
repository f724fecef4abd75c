"""``NewsnackWaitTrigger`` against a real ``newsnack serve``: its
serialisation, the event ``run()`` yields for each outcome, a deadline kept
across a restart and shared by two copies, retries with backoff while the
service is unreachable or answers 503 (through ``relay.Relay``), and the
errors that end it: at once, or past the deadline."""

from __future__ import annotations

import asyncio
import importlib
import math
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Dict, List, Tuple

import pytest

from newsnack_provider.api import Service, parse_rfc3339, rfc3339
from newsnack_provider.triggers.newsnack import FIRST_RETRY_S, NewsnackWaitTrigger
from relay import UNAVAILABLE, Relay


def deadline_in(seconds: float) -> str:
    return rfc3339(datetime.now(timezone.utc) + timedelta(seconds=seconds))


async def first_event(trigger: NewsnackWaitTrigger) -> Dict[str, Any]:
    """The payload of the first event `trigger.run()` yields."""
    event = await trigger.run().asend(None)
    return dict(event.payload)


def event_of(trigger: NewsnackWaitTrigger, within_s: float = 60) -> Dict[str, Any]:
    return asyncio.run(asyncio.wait_for(first_event(trigger), within_s))


def claimed_and_done(service: Service, ids: List[int]) -> None:
    """Claims `ids` and waits until the writer has written each."""
    service.claim(ids)
    report = service.wait(ids, timeout_s=30, min_completion=len(ids))
    assert report["outcome"] == "all_pass", report


def test_serialize_round_trip() -> None:
    trigger = NewsnackWaitTrigger(issue_ids=[3, 1], deadline=deadline_in(60), min_completion=1, newsnack_conn_id="nn")
    classpath, kwargs = trigger.serialize()
    assert classpath == "newsnack_provider.triggers.newsnack.NewsnackWaitTrigger"
    module, name = classpath.rsplit(".", 1)
    again = getattr(importlib.import_module(module), name)(**kwargs)
    assert again.serialize() == (classpath, kwargs)
    assert kwargs == {
        "issue_ids": [3, 1],
        "deadline": trigger.deadline,
        "min_completion": 1,
        "newsnack_conn_id": "nn",
        "give_up_after_s": 10.0,
        "trace_context": None,
    }


def test_all_pass_yields_the_completed_ids(service: Service, add_issues: Callable[..., List[int]], connection: Callable[..., str]) -> None:
    ids = add_issues("One", "Two")
    service.claim(ids)
    started = time.monotonic()
    event = event_of(NewsnackWaitTrigger(issue_ids=ids, deadline=deadline_in(120), newsnack_conn_id=connection()))
    assert event["status"] == "success", event
    assert event["wait"]["outcome"] == "all_pass"
    assert event["wait"]["completed"] == sorted(ids)
    assert time.monotonic() - started < 30


def test_timeout_pass_and_skip_are_decided_at_the_deadline(
    service: Service, add_issues: Callable[..., List[int]], connection: Callable[..., str]
) -> None:
    done, pending = add_issues("Done", "Never claimed")
    claimed_and_done(service, [done])
    conn_id = connection()
    for min_completion, outcome in [(1, "timeout_pass"), (2, "skip")]:
        deadline = deadline_in(1.5)
        event = event_of(NewsnackWaitTrigger([done, pending], deadline, min_completion, conn_id))
        late = (datetime.now(timezone.utc) - parse_rfc3339(deadline)).total_seconds()
        assert event["status"] == "success", event
        assert event["wait"]["outcome"] == outcome
        assert event["wait"]["completed"] == [done]
        assert event["wait"]["unfinished"] == [pending]
        assert 0 <= late < 1.0, f"decided {late:.2f} s after the deadline"


def test_a_deadline_already_past_decides_at_once(
    service: Service, add_issues: Callable[..., List[int]], connection: Callable[..., str]
) -> None:
    (pending,) = add_issues("Never claimed")
    started = time.monotonic()
    event = event_of(NewsnackWaitTrigger([pending], deadline_in(-60), 1, connection()))
    assert event["status"] == "success", event
    assert event["wait"]["outcome"] == "skip"
    assert time.monotonic() - started < 2


def test_a_restarted_trigger_keeps_the_deadline_and_two_copies_agree(
    service: Service, add_issues: Callable[..., List[int]], connection: Callable[..., str]
) -> None:
    done, pending = add_issues("Done", "Never claimed")
    claimed_and_done(service, [done])
    first = NewsnackWaitTrigger([done, pending], deadline_in(4), 1, connection())
    classpath, kwargs = first.serialize()

    async def killed_then_twice() -> Tuple[Dict[str, Any], Dict[str, Any]]:
        # The first copy is killed halfway through its wait, as a triggerer
        # that dies; two copies made from its serialised form run at once.
        # Copies that started the wait's time again would decide 2 s late.
        running = asyncio.ensure_future(first_event(first))
        done_soon, _ = await asyncio.wait([running], timeout=2.0)
        assert not done_soon, "still waiting"
        running.cancel()
        a, b = await asyncio.gather(
            first_event(NewsnackWaitTrigger(**kwargs)), first_event(NewsnackWaitTrigger(**kwargs))
        )
        return a, b

    a, b = asyncio.run(asyncio.wait_for(killed_then_twice(), 60))
    late = (datetime.now(timezone.utc) - parse_rfc3339(kwargs["deadline"])).total_seconds()
    assert a["status"] == b["status"] == "success", (a, b)
    assert a["wait"]["outcome"] == b["wait"]["outcome"] == "timeout_pass"
    assert a["wait"]["completed"] == b["wait"]["completed"] == [done]
    assert 0 <= late < 1.0, f"decided {late:.2f} s after the original deadline"


def test_an_unreachable_service_is_asked_again_until_it_answers(
    service: Service, add_issues: Callable[..., List[int]], connection: Callable[..., str], unused_port: int
) -> None:
    (pending,) = add_issues("Never claimed")
    target = service.base_url.split("://", 1)[1]
    host, port = target.rsplit(":", 1)
    dropped: List[int] = []

    async def cut_then_pass(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # The first two connections are cut before any answer: the service
        # is out of reach for a while.
        if len(dropped) < 2:
            dropped.append(1)
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection(host, int(port))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def through_relay() -> Dict[str, Any]:
        server = await asyncio.start_server(cut_then_pass, "127.0.0.1", unused_port)
        async with server:
            trigger = NewsnackWaitTrigger([pending], deadline_in(20), 0, connection(port=unused_port, schema="http"))
            return await first_event(trigger)

    event = asyncio.run(asyncio.wait_for(through_relay(), 60))
    assert len(dropped) == 2
    assert event["status"] == "success", event
    assert event["wait"]["outcome"] == "timeout_pass"


def test_a_service_answering_503_is_asked_again_with_backoff_and_keeps_the_deadline(
    relay: Relay, service: Service, add_issues: Callable[..., List[int]], connection: Callable[..., str]
) -> None:
    done, pending = add_issues("Done", "Never claimed")
    claimed_and_done(service, [done])
    relay.unavailable = 3
    conn_id = connection("nn_busy", host="127.0.0.1", port=relay.port, schema="http")
    deadline = deadline_in(8)
    event = event_of(NewsnackWaitTrigger([done, pending], deadline, 1, conn_id))
    late = (datetime.now(timezone.utc) - parse_rfc3339(deadline)).total_seconds()
    assert [(e.path, e.status) for e in relay.exchanges] == [("/waits", 503)] * 3 + [("/waits", 200)]
    pauses = [b.at - a.at for a, b in zip(relay.exchanges, relay.exchanges[1:])]
    assert all(pause >= FIRST_RETRY_S * 2**i for i, pause in enumerate(pauses)), pauses
    assert event["status"] == "success", event
    assert event["wait"]["outcome"] == "timeout_pass"
    assert event["wait"]["completed"] == [done]
    assert event["wait"]["unfinished"] == [pending]
    assert 0 <= late < 1.0, f"decided {late:.2f} s after the deadline"


def test_a_503_lasting_past_the_deadline_ends_with_a_clear_error(
    relay: Relay, add_issues: Callable[..., List[int]], connection: Callable[..., str]
) -> None:
    (pending,) = add_issues("Never claimed")
    relay.unavailable = math.inf
    conn_id = connection("nn_unavailable", host="127.0.0.1", port=relay.port, schema="http")
    deadline = deadline_in(1)
    event = event_of(NewsnackWaitTrigger([pending], deadline, 1, conn_id, give_up_after_s=0.5))
    assert event["status"] == "error", event
    assert event["http_status"] == 503
    assert f"POST /waits failed (HTTP 503): {UNAVAILABLE}" in event["message"], event
    assert "0.5 s after the wait's deadline" in event["message"] and "giving up" in event["message"], event
    assert (datetime.now(timezone.utc) - parse_rfc3339(deadline)).total_seconds() >= 0.5
    assert len(relay.exchanges) >= 2 and {e.status for e in relay.exchanges} == {503}


def test_a_service_down_for_the_whole_wait_ends_with_an_error(connection: Callable[..., str], unused_port: int) -> None:
    conn_id = connection(port=unused_port)
    deadline = deadline_in(1)
    event = event_of(NewsnackWaitTrigger([1], deadline, None, conn_id, give_up_after_s=0.5))
    assert event["status"] == "error"
    assert f"cannot reach http://127.0.0.1:{unused_port}" in event["message"]
    assert "giving up" in event["message"]
    assert (datetime.now(timezone.utc) - parse_rfc3339(deadline)).total_seconds() >= 0.5


@pytest.mark.parametrize(
    "case, status, message",
    [
        ("wrong token", 401, "missing or wrong bearer token"),
        ("unknown ids", 404, "unknown issue ids"),
        ("unknown connection", None, "connection 'no_such_connection'"),
    ],
)
def test_errors_end_the_trigger_at_once_with_a_clear_message(
    case: str, status: Any, message: str, add_issues: Callable[..., List[int]], connection: Callable[..., str]
) -> None:
    (pending,) = add_issues("Never claimed")
    ids, conn_id = [pending], connection()
    if case == "wrong token":
        conn_id = connection(password="not-the-token")
    elif case == "unknown ids":
        ids = [pending, 987_654_321]
    else:
        conn_id = "no_such_connection"
    started = time.monotonic()
    event = event_of(NewsnackWaitTrigger(ids, deadline_in(600), None, conn_id))
    assert event["status"] == "error", event
    assert event["http_status"] == status
    assert message in event["message"], event
    assert time.monotonic() - started < 10
