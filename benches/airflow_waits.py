"""The Python side of ``cargo bench --bench airflow_waits``: many waits in
one asyncio loop, as one Airflow triggerer runs them.

    python airflow_waits.py MODE DEADLINE < ids.json

MODE ``trigger`` runs one ``NewsnackWaitTrigger.run()`` per id (the
connection from ``AIRFLOW_CONN_NEWSNACK_DEFAULT``); ``raw`` sends the same
``POST /waits`` with aiohttp alone, for comparison. It warms up on the
first five ids (a deadline already past), prints ``warm`` and waits for a
line on stdin, opens every other wait, then prints one JSON object: the
wall-clock time (``time.time()``) each wait's answer arrived, by id.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Dict, List

import aiohttp

from newsnack_provider.api import Service
from newsnack_provider.hooks.newsnack import NewsnackHook
from newsnack_provider.triggers.newsnack import NewsnackWaitTrigger

PAST = "2000-01-01T00:00:00+00:00"


async def by_trigger(issue_id: int, deadline: str) -> str:
    event = await NewsnackWaitTrigger([issue_id], deadline, 1).run().asend(None)
    return str(event.payload["wait"]["outcome"])


async def by_request(service: Service, issue_id: int, deadline: str) -> str:
    async with aiohttp.ClientSession() as session:
        body = {"issue_ids": [issue_id], "min_completion": 1, "deadline": deadline}
        return str((await service.apost(session, "/waits", body, 600.0))["outcome"])


async def main(mode: str, deadline: str, ids: List[int]) -> None:
    service = await NewsnackHook().aget_conn()

    async def one(issue_id: int, deadline: str) -> str:
        if mode == "trigger":
            return await by_trigger(issue_id, deadline)
        return await by_request(service, issue_id, deadline)

    for issue_id in ids[:5]:
        await one(issue_id, PAST)
    print("warm", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    answered: Dict[int, float] = {}

    async def timed(issue_id: int) -> None:
        outcome = await one(issue_id, deadline)
        answered[issue_id] = time.time()
        assert outcome == "all_pass", outcome

    await asyncio.gather(*(timed(i) for i in ids[5:]))
    print(json.dumps({"answered": answered}), flush=True)


if __name__ == "__main__":
    ids = json.loads(sys.stdin.readline())
    asyncio.run(main(sys.argv[1], sys.argv[2], ids))
