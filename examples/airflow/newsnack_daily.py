"""newsnack_daily: the daily briefing, driven through the newsnack HTTP API.

    select_target_issues -> request_articles -> wait_for_completion -> assemble_today_newsnack
                            POST /ai-articles   POST /waits (one)      POST /today-newsnack

* **select_target_issues** takes the targets from the run's configuration:
  ``{"issue_ids": [..]}`` (in reading order), or ``{"issues": [..]}`` (new
  issues, added with ``POST /issues``; the ``top_k`` highest scores are
  kept). Without either it skips the run: the API has no endpoint that
  lists candidates, so the collector that knows the day's issues triggers
  this DAG (see README.md), or newsnack's own scheduler picks them.
* **request_articles** claims them (``FOR NO KEY UPDATE SKIP LOCKED`` on the
  service's side). A 409 (nothing claimable: already in progress elsewhere,
  or DONE) is fine: the wait below decides either way.
* **wait_for_completion** is ONE ``POST /waits`` request, not a polling
  sensor: the service answers the moment the outcome is decided (all DONE,
  or nothing left that can change, or the deadline). ``skip`` becomes
  ``AirflowSkipException``, so the briefing task is skipped too.
* **assemble_today_newsnack** builds the briefing from exactly the ids the
  wait reported as completed, in target order.

Configuration (read when tasks run, so changes need no redeploy):

* Connection ``newsnack_default`` (type HTTP): host/port/schema give the
  base URL, the password is the API token. Without it, the environment
  variables ``NEWSNACK_BASE_URL`` (default ``http://127.0.0.1:8080``) and
  ``NEWSNACK_API_TOKEN``.
* Run configuration or Variables ``newsnack_wait_timeout_s`` and
  ``newsnack_min_completion``; unset, the service's own settings
  ``content_gen_timeout_s`` and ``content_gen_min_completion`` apply.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import datetime, timedelta, timezone

# The client module sits next to this file in the DAGs folder.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from newsnack_client import (  # noqa: E402
    DEFAULT_BASE_URL,
    ENV_API_TOKEN,
    ENV_BASE_URL,
    NewsnackClient,
    NewsnackError,
    NewsnackNotFound,
    NewsnackUnauthorized,
    briefing_ids,
)

try:  # Airflow 3
    from airflow.sdk import BaseHook, Param, Variable, dag, get_current_context, task
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

    def _variable(key: str):
        return Variable.get(key, default=None)

except ImportError:  # Airflow 2.7+
    from airflow.decorators import dag, task
    from airflow.exceptions import AirflowFailException, AirflowSkipException
    from airflow.hooks.base import BaseHook
    from airflow.models import Variable
    from airflow.models.param import Param
    from airflow.operators.python import get_current_context

    def _variable(key: str):
        return Variable.get(key, default_var=None)

log = logging.getLogger(__name__)

CONN_ID = "newsnack_default"
VAR_WAIT_TIMEOUT_S = "newsnack_wait_timeout_s"
VAR_MIN_COMPLETION = "newsnack_min_completion"


def newsnack_client() -> NewsnackClient:
    """The client, configured by the ``newsnack_default`` connection, or by
    ``NEWSNACK_BASE_URL`` / ``NEWSNACK_API_TOKEN`` when there is none."""
    try:
        conn = BaseHook.get_connection(CONN_ID)
    except Exception:  # not defined: fall back to the environment
        conn = None
    if conn is not None and conn.host:
        host = conn.host
        if "://" not in host:
            host = f"{conn.schema or 'http'}://{host}"
            if conn.port:
                host = f"{host}:{conn.port}"
        return NewsnackClient(host, token=conn.password or None)
    return NewsnackClient(
        os.environ.get(ENV_BASE_URL) or DEFAULT_BASE_URL,
        token=os.environ.get(ENV_API_TOKEN) or None,
    )


def _setting(params: dict, name: str, variable: str, kind):
    """A run's value, else the Variable's, else None (the service decides)."""
    value = params.get(name)
    if value is None:
        value = _variable(variable)
    if value is None or value == "":
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise AirflowFailException(f"{name}/{variable} must be a number, got {value!r}")


def _fail_or_retry(step: str, error: NewsnackError, safe_to_repeat: bool):
    """Maps a client error to Airflow's vocabulary: raise the error itself to
    let Airflow retry, or ``AirflowFailException`` when a retry cannot help
    (wrong token, bad ids) or could do something twice."""
    if isinstance(error, NewsnackUnauthorized):
        raise AirflowFailException(
            f"{step}: newsnack refused the API token (check the {CONN_ID} connection's "
            f"password or {ENV_API_TOKEN}): {error}"
        )
    if error.retryable and (safe_to_repeat or not error.maybe_applied):
        log.warning("%s: %s; Airflow will retry", step, error)
        raise error
    if error.maybe_applied:
        raise AirflowFailException(
            f"{step}: no answer, and the request may have been carried out; not retrying "
            f"(look at GET /briefings/latest before re-running): {error}"
        )
    raise AirflowFailException(f"{step}: {error}")


@dag(
    dag_id="newsnack_daily",
    description="claim -> one smart wait -> assemble, through the newsnack HTTP API",
    # Triggered by the collector with the day's issues (TriggerDagRunOperator
    # or the REST API); give it a cron if the conf comes from elsewhere.
    schedule=None,
    start_date=datetime(2025, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    tags=["newsnack"],
    doc_md=__doc__,
    params={
        "issue_ids": Param([], type="array", description="target issue ids, hottest first"),
        "issues": Param([], type="array", description="new issues to add first (POST /issues)"),
        "top_k": Param(5, type="integer", minimum=1, maximum=100, description="with `issues`: how many of the hottest"),
        "timeout_s": Param(None, type=["null", "number"], description="wait timeout; default: Variable, then the service's setting"),
        "min_completion": Param(None, type=["null", "integer"], description="DONE needed at the timeout; default: Variable, then the service's setting"),
    },
    default_args={
        "owner": "newsnack",
        "retries": 2,
        "retry_delay": timedelta(seconds=20),
        "retry_exponential_backoff": True,
        "max_retry_delay": timedelta(minutes=5),
        "execution_timeout": timedelta(minutes=2),
    },
)
def newsnack_daily():
    @task
    def select_target_issues() -> list:
        params = get_current_context()["params"]
        ids = [int(i) for i in (params.get("issue_ids") or [])]
        issues = list(params.get("issues") or [])
        if ids:
            return ids
        if not issues:
            raise AirflowSkipException(
                "no targets: trigger with {\"issue_ids\": [..]} or {\"issues\": [..]}"
            )
        try:
            added = newsnack_client().add_issues(issues)
        except NewsnackError as e:
            # Adding twice would duplicate the issues: retry only if the
            # request never arrived.
            _fail_or_retry("select_target_issues", e, safe_to_repeat=False)
        ranked = sorted(
            zip(added, issues), key=lambda p: (-float(p[1].get("score", 0) or 0), p[0])
        )
        targets = [issue_id for issue_id, _ in ranked[: int(params.get("top_k") or 5)]]
        log.info("added %d issues; targets (hottest first): %s", len(added), targets)
        return targets

    @task(retries=3)
    def request_articles(targets: list) -> dict:
        try:
            # The briefing's own articles: their LLM calls go before any
            # feed article's, on every newsnack instance.
            claim = newsnack_client().claim(targets, priority="briefing")
        except NewsnackError as e:
            # A repeated claim is harmless: what is already claimed is skipped.
            _fail_or_retry("request_articles", e, safe_to_repeat=True)
        if claim.conflict:
            log.info("nothing claimable (in progress elsewhere, or DONE): %s", claim.skipped)
        else:
            log.info("claimed %s, skipped %s", claim.claimed, claim.skipped)
        return claim.as_dict()

    # One long request instead of a sensor. The service bounds it by the
    # wait's timeout (at most a day); execution_timeout is only a backstop.
    @task(execution_timeout=timedelta(hours=25))
    def wait_for_completion(targets: list, claim: dict) -> dict:
        # `claim` orders this task after the claim; the wait covers every
        # target, claimed here or in progress elsewhere.
        params = get_current_context()["params"]
        timeout_s = _setting(params, "timeout_s", VAR_WAIT_TIMEOUT_S, float)
        min_completion = _setting(params, "min_completion", VAR_MIN_COMPLETION, int)
        try:
            report = newsnack_client().wait(
                targets, timeout_s=timeout_s, min_completion=min_completion
            )
        except NewsnackNotFound as e:
            raise AirflowFailException(f"wait_for_completion: unknown issue ids: {e}")
        except NewsnackError as e:
            # The wait holds no state on the service: asking again is safe.
            _fail_or_retry("wait_for_completion", e, safe_to_repeat=True)
        log.info(
            "wait: %s after %d ms; completed %s, failed %s, unfinished %s",
            report.outcome, report.waited_ms, report.completed, report.failed, report.unfinished,
        )
        if report.outcome == "skip":
            raise AirflowSkipException(
                f"skip: {len(report.completed)} of {len(targets)} DONE, fewer than the minimum; "
                f"failed {report.failed}, unfinished {report.unfinished}"
            )
        ids = briefing_ids(targets, report.completed)
        if not ids:
            raise AirflowSkipException(f"{report.outcome} with nothing completed: no briefing")
        return {**report.as_dict(), "briefing_ids": ids}

    @task
    def assemble_today_newsnack(report: dict) -> dict:
        try:
            assembled = newsnack_client().assemble(report["briefing_ids"])
        except NewsnackError as e:
            # Each success is a new briefing: never repeat a request the
            # service may have carried out.
            _fail_or_retry("assemble_today_newsnack", e, safe_to_repeat=False)
        log.info("briefing %d from %s", assembled.briefing_id, assembled.issue_ids)
        return assembled.as_dict()

    targets = select_target_issues()
    claim = request_articles(targets)
    report = wait_for_completion(targets, claim)
    assemble_today_newsnack(report)


newsnack_daily()
