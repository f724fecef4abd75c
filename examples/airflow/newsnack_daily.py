"""newsnack_daily: the daily briefing through the newsnack provider.

    request_articles -> wait_for_completion -> assemble_today_newsnack
    POST /ai-articles   POST /waits, deferred   POST /today-newsnack
                        to the triggerer        (exactly the completed ids)

Trigger it with the day's targets, hottest first:
``{"issue_ids": [..], "timeout_s": 600, "min_completion": 3}`` (the last two
optional). The wait frees its worker slot: the triggerer holds it, with a
deadline fixed when it first defers, so a triggerer restart does not start
the timeout again. ``skip`` skips the briefing; an error fails the task with
the service's message.

Needs ``pip install airflow-provider-newsnack`` (``integrations/airflow``
in the newsnack repository) and the connection ``newsnack_default`` (type
``newsnack``: host, port, schema http/https, the API token as password).
"""

from __future__ import annotations

from datetime import datetime, timezone

from newsnack_provider.operators.newsnack import (
    NewsnackBriefingOperator,
    NewsnackClaimOperator,
    NewsnackWaitOperator,
)

try:  # Airflow 3
    from airflow.sdk import DAG, Param
except ImportError:  # Airflow 2.10
    from airflow import DAG
    from airflow.models.param import Param

with DAG(
    dag_id="newsnack_daily",
    description="claim -> deferred smart wait -> briefing, through the newsnack provider",
    schedule=None,
    start_date=datetime(2025, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    tags=["newsnack"],
    doc_md=__doc__,
    # Templates render to Python values: the params' lists and numbers.
    render_template_as_native_obj=True,
    params={
        "issue_ids": Param([], type="array", description="target issue ids, hottest first"),
        "timeout_s": Param(None, type=["null", "number"], description="wait timeout (default 600 s)"),
        "min_completion": Param(None, type=["null", "integer"], description="DONE needed at the deadline"),
    },
) as dag:
    claim = NewsnackClaimOperator(task_id="request_articles", issue_ids="{{ params.issue_ids }}")
    wait = NewsnackWaitOperator(
        task_id="wait_for_completion",
        issue_ids="{{ params.issue_ids }}",
        timeout_s="{{ params.timeout_s }}",
        min_completion="{{ params.min_completion }}",
    )
    briefing = NewsnackBriefingOperator(task_id="assemble_today_newsnack", issue_ids=wait.output)
    claim >> wait >> briefing
