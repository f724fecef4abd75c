#!/usr/bin/env python3
"""The DAG's flow without Airflow, for trying it out: claim -> one blocking
smart wait -> briefing, through the provider's plain client
(``newsnack_provider.api``).

    python3 run_briefing.py [--base-url URL] [--timeout-s S] [--min-completion N] ID [ID ...]

The ids are the targets in reading order. Prints one JSON object,
``{"targets", "claim", "wait", "briefing"}`` (``briefing`` null when the
wait skipped), or ``{"error", "step", "status"}`` with the message on
stderr. Exit codes: 0 published, 3 the wait skipped, 1 an error.
Configuration: ``--base-url`` or ``NEWSNACK_BASE_URL`` (default
``http://127.0.0.1:8080``), ``NEWSNACK_API_TOKEN`` for the token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

from newsnack_provider.api import NewsnackError, Service

EXIT_PUBLISHED, EXIT_ERROR, EXIT_SKIP = 0, 1, 3


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("NEWSNACK_BASE_URL") or "http://127.0.0.1:8080")
    parser.add_argument("--timeout-s", type=float)
    parser.add_argument("--min-completion", type=int)
    parser.add_argument("ids", type=int, nargs="+")
    args = parser.parse_args(argv)
    service = Service(args.base_url, os.environ.get("NEWSNACK_API_TOKEN") or None)
    report: Dict[str, Any] = {"targets": args.ids, "claim": None, "wait": None, "briefing": None}
    step = "claim"
    try:
        report["claim"] = service.claim(args.ids)
        step = "wait"
        report["wait"] = wait = service.wait(args.ids, args.timeout_s, args.min_completion)
        if wait["outcome"] == "skip":
            print(json.dumps(report))
            return EXIT_SKIP
        step = "briefing"
        # The briefing keeps the targets' order; the wait lists ids in id order.
        completed = set(wait["completed"])
        report["briefing"] = service.briefing([i for i in args.ids if i in completed])
    except NewsnackError as e:
        print(json.dumps({**report, "error": e.message, "step": step, "status": e.status}))
        print(f"run_briefing: {e.message}", file=sys.stderr)
        return EXIT_ERROR
    print(json.dumps(report))
    return EXIT_PUBLISHED


if __name__ == "__main__":
    sys.exit(main())
