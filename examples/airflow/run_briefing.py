#!/usr/bin/env python3
"""One briefing through the newsnack HTTP API, the way the Airflow DAG does
it, without Airflow: claim -> one smart wait -> assemble.

    python3 run_briefing.py [--base-url URL] [--timeout-s S] [--min-completion N] ID [ID ...]
    python3 run_briefing.py --issues-file issues.json [--top-k K]

The ids are the targets in reading order (hottest first). With
``--issues-file`` (a JSON list of ``{"title", "body", "score"}`` objects, or
``{"issues": [...]}``; ``-`` for stdin) the issues are added first with
``POST /issues`` and the ``--top-k`` highest scores become the targets.

Prints one JSON object on stdout:

    {"targets": [..], "claim": {"claimed": [..], "skipped": [..], "conflict": false},
     "wait": {"outcome": "all_pass", "completed": [..], "failed": [..], "unfinished": [..], "waited_ms": n},
     "briefing": {"briefing_id": n, "issue_ids": [..]}}

``briefing`` is null when the wait skipped. On failure it prints
``{"error": "..", "step": "claim", "status": 401, ...}`` instead and a one-line
message on stderr.

Exit codes: 0 a briefing was published; 3 the wait decided ``skip`` (nothing
published; the same code ``newsnack wait`` and ``newsnack run-pipeline`` use);
1 an error (unreachable service, wrong token, unknown ids, ...); 2 bad usage.

Configuration: ``--base-url`` or ``NEWSNACK_BASE_URL`` (default
``http://127.0.0.1:8080``), and ``NEWSNACK_API_TOKEN`` for the bearer token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Run from a checkout: leave no __pycache__ behind next to the sources.
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from newsnack_client import (  # noqa: E402  (after the path set-up)
    DEFAULT_BASE_URL,
    ENV_API_TOKEN,
    ENV_BASE_URL,
    NewsnackClient,
    NewsnackError,
    briefing_ids,
)

EXIT_PUBLISHED = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_SKIP = 3


def load_issues(path: str) -> list:
    text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    data = json.loads(text)
    issues = data.get("issues") if isinstance(data, dict) else data
    if not isinstance(issues, list) or not issues:
        raise ValueError(f"{path}: expected a non-empty JSON list of issues or {{\"issues\": [..]}}")
    return issues


def top_k_by_score(ids: list, issues: list, k: int) -> list:
    """The ``k`` ids with the highest score (ties: the earlier issue first)."""
    ranked = sorted(
        zip(ids, issues), key=lambda pair: (-float(pair[1].get("score", 0) or 0), pair[0])
    )
    return [issue_id for issue_id, _ in ranked[:k]]


def run_once(
    client: NewsnackClient,
    targets: list,
    timeout_s=None,
    min_completion=None,
) -> dict:
    """claim -> wait -> assemble; returns the report printed on stdout."""
    report: dict = {"targets": targets, "claim": None, "wait": None, "briefing": None}
    step = "claim"
    try:
        claim = client.claim(targets, priority="briefing")
        report["claim"] = claim.as_dict()
        step = "wait"
        wait = client.wait(targets, timeout_s=timeout_s, min_completion=min_completion)
        report["wait"] = wait.as_dict()
        ids = briefing_ids(targets, wait.completed)
        if wait.outcome == "skip" or not ids:
            return report
        step = "assemble"
        report["briefing"] = client.assemble(ids).as_dict()
        return report
    except NewsnackError as e:
        report.update(
            error=e.message,
            step=step,
            status=e.status,
            kind=type(e).__name__,
            request_id=e.request_id,
            retryable=e.retryable,
        )
        return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="claim -> smart wait -> assemble, through the newsnack HTTP API"
    )
    parser.add_argument("ids", nargs="*", type=int, help="target issue ids, in reading order")
    parser.add_argument(
        "--base-url",
        default=os.environ.get(ENV_BASE_URL) or DEFAULT_BASE_URL,
        help=f"the service (default: ${ENV_BASE_URL} or {DEFAULT_BASE_URL})",
    )
    parser.add_argument("--timeout-s", type=float, help="wait timeout (default: the service's content_gen_timeout_s)")
    parser.add_argument("--min-completion", type=int, help="DONE needed at the timeout (default: the service's content_gen_min_completion)")
    parser.add_argument("--issues-file", help="add these issues first (POST /issues); '-' reads stdin")
    parser.add_argument("--top-k", type=int, default=5, help="with --issues-file: how many of the hottest to use (default 5)")
    args = parser.parse_args(argv)
    if bool(args.ids) == bool(args.issues_file):
        parser.error("give either issue ids or --issues-file")
    if args.top_k < 1:
        parser.error("--top-k must be at least 1")

    try:
        client = NewsnackClient(args.base_url, token=os.environ.get(ENV_API_TOKEN))
        if args.issues_file:
            issues = load_issues(args.issues_file)
            ids = client.add_issues(issues)
            targets = top_k_by_score(ids, issues, args.top_k)
        else:
            targets = args.ids
        report = run_once(client, targets, args.timeout_s, args.min_completion)
    except NewsnackError as e:
        report = {"error": e.message, "step": "add_issues", "status": e.status, "kind": type(e).__name__}
    except (OSError, ValueError) as e:
        print(f"run_briefing: {e}", file=sys.stderr)
        return EXIT_USAGE

    print(json.dumps(report), flush=True)
    if "error" in report:
        status = f" (HTTP {report['status']})" if report.get("status") else ""
        print(f"run_briefing: {report['step']} failed{status}: {report['error']}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_PUBLISHED if report["briefing"] else EXIT_SKIP


if __name__ == "__main__":
    sys.exit(main())
