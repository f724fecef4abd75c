"""The provider as users install it: the wheel ``pip wheel --no-deps``
builds from this checkout, installed into a throwaway virtual environment,
holds the modules, the ``py.typed`` marker, the ``apache_airflow_provider``
entry point and the Airflow it needs.

The throwaway environment is made from this one's Python and sees this
one's packages (Airflow) after its own, through a path in a ``.pth`` file:
the ``.pth`` files of a directory named that way are not read, so the
editable install of this checkout stays out, and what it imports is the
wheel's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any, Dict

PROVIDER = Path(__file__).resolve().parents[1]
MODULES = [
    "newsnack_provider",
    "newsnack_provider.api",
    "newsnack_provider.hooks.newsnack",
    "newsnack_provider.operators.newsnack",
    "newsnack_provider.triggers.newsnack",
]
#: Run by the throwaway environment's Python: what it imports and what the
#: installed distribution says of itself, as JSON.
INSPECT = """
import importlib, importlib.metadata, json, sys
dist = importlib.metadata.distribution("airflow-provider-newsnack")
[entry] = [e for e in dist.entry_points if e.group == "apache_airflow_provider"]
print(json.dumps({
    "modules": {name: importlib.import_module(name).__file__ for name in sys.argv[1:]},
    "installed_in": str(dist.locate_file("")),
    "files": [str(f) for f in dist.files or []],
    "metadata": dist.read_text("METADATA"),
    "entry_point": [entry.name, entry.value],
    "provider_info": entry.load()(),
}))
"""


def run(*args: str) -> str:
    """`args` run to their end; their stdout, or a failure showing both outputs."""
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def installed_wheel(tmp_path: Path) -> Dict[str, Any]:
    """Builds the wheel, installs it into a throwaway environment, and
    returns what :data:`INSPECT` reports there, with the wheel's name and
    the environment's ``site-packages``."""
    # A copy of the checkout: a build in place writes build/ into it, where
    # the suites of both Airflow versions build at the same time.
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".*_cache", "tests")
    shutil.copytree(PROVIDER, source, ignore=ignore)
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    run(*pip, "wheel", "--no-deps", "--wheel-dir", str(dist), str(source))
    [wheel] = dist.glob("*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = str(venv / "bin" / "python")
    site_packages = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    Path(site_packages, "airflow_from_the_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(*pip, "--python", python, "install", "--no-deps", "--no-index", str(wheel))
    # Isolated (-I): neither the working directory (this checkout) nor
    # PYTHONPATH comes before the environment's own packages.
    report = json.loads(run(python, "-I", "-c", INSPECT, *MODULES))
    return {**report, "wheel": wheel.name, "site_packages": site_packages}


def test_the_built_wheel_installs_the_modules_types_entry_point_and_requirement(tmp_path: Path) -> None:
    report = installed_wheel(tmp_path)
    site_packages = Path(report["site_packages"])
    assert report["wheel"] == "airflow_provider_newsnack-0.1.0-py3-none-any.whl"
    assert Path(report["installed_in"]) == site_packages
    for name, file in report["modules"].items():
        assert Path(file).is_relative_to(site_packages), f"{name} imported from {file}, not the wheel"
    assert (site_packages / "newsnack_provider" / "py.typed").is_file()
    files = set(report["files"])
    assert {"newsnack_provider/py.typed", "newsnack_provider/triggers/newsnack.py"} <= files, files
    assert not any(f.startswith("tests/") for f in files), files
    assert "Requires-Dist: apache-airflow>=2.10.0" in report["metadata"].splitlines()
    assert report["entry_point"] == ["provider_info", "newsnack_provider:get_provider_info"]
    info = report["provider_info"]
    assert info["package-name"] == "airflow-provider-newsnack"
    assert [t["connection-type"] for t in info["connection-types"]] == ["newsnack"]
