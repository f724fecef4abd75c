"""The provider as Airflow discovers it: the entry point, the provider
info, and the ``newsnack`` connection type with its form."""

from __future__ import annotations

from importlib.metadata import entry_points

from newsnack_provider import CONNECTION_FORM, get_provider_info
from newsnack_provider.hooks.newsnack import NewsnackHook


def test_the_entry_point_names_get_provider_info() -> None:
    found = [e for e in entry_points(group="apache_airflow_provider") if e.value.startswith("newsnack_provider")]
    assert len(found) == 1
    assert found[0].load() is get_provider_info


def test_the_connection_type_is_registered_with_its_form() -> None:
    info = get_provider_info()
    assert info["package-name"] == "airflow-provider-newsnack"
    (conn,) = info["connection-types"]
    assert conn["connection-type"] == NewsnackHook.conn_type == "newsnack"
    assert conn["hook-class-name"] == "newsnack_provider.hooks.newsnack.NewsnackHook"
    assert conn["ui-field-behaviour"]["hidden-fields"] == ["login", "extra"]
    assert NewsnackHook.get_ui_field_behaviour() == CONNECTION_FORM
    assert NewsnackHook.default_conn_name == "newsnack_default"
