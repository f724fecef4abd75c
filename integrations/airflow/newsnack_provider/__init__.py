"""airflow-provider-newsnack: Apache Airflow operators, a hook and a
deferrable wait for the newsnack service. Airflow finds the provider through
the ``apache_airflow_provider`` entry point, which names
:func:`get_provider_info`."""

from __future__ import annotations

from typing import Any, Dict

__version__ = "0.1.0"

#: The ``newsnack`` connection's form: what each field means and shows.
CONNECTION_FORM: Dict[str, Any] = {
    "hidden_fields": ["login", "extra"],
    "relabeling": {"password": "API token", "schema": "Scheme (http or https)"},
    "placeholders": {
        "host": "newsnack.internal",
        "port": "8080",
        "schema": "http",
        "password": "NEWSNACK_API_TOKEN",
    },
}


def get_provider_info() -> Dict[str, Any]:
    """What Airflow's providers manager reads: the modules, and the
    ``newsnack`` connection type with its form."""
    return {
        "package-name": "airflow-provider-newsnack",
        "name": "newsnack",
        "description": "Claim, smart-wait (deferrable) and publish a newsnack briefing.",
        "versions": [__version__],
        "integrations": [
            {"integration-name": "newsnack", "tags": ["service"]},
        ],
        "operators": [
            {"integration-name": "newsnack", "python-modules": ["newsnack_provider.operators.newsnack"]}
        ],
        "hooks": [{"integration-name": "newsnack", "python-modules": ["newsnack_provider.hooks.newsnack"]}],
        "triggers": [
            {"integration-name": "newsnack", "python-modules": ["newsnack_provider.triggers.newsnack"]}
        ],
        "connection-types": [
            {
                "hook-class-name": "newsnack_provider.hooks.newsnack.NewsnackHook",
                "hook-name": "newsnack",
                "connection-type": "newsnack",
                "ui-field-behaviour": {key.replace("_", "-"): value for key, value in CONNECTION_FORM.items()},
            }
        ],
    }
