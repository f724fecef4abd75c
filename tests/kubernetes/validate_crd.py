"""Validates rendered custom resources against their CRD's own schema.

`python validate_crd.py SCHEMA_DIR MANIFEST...`: every object in the
manifests whose API group has a schema in SCHEMA_DIR (`KIND.VERSION.json`
files holding a CRD version's `openAPIV3Schema`, see keda/NOTICE) is
checked with jsonschema, and strictly, as the API server's strict field
validation does: a field the schema does not declare is an error, unless
the schema preserves unknown fields there. Prints `valid KIND/NAME` for
each object checked, and each error; exits 1 on any error, or when an
object of such a group has no schema of its kind and version.
"""

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import yaml


def load_schemas(directory: Path) -> dict[tuple[str, str, str], dict[str, Any]]:
    """The schemas by (group, version, kind)."""
    schemas = {}
    for path in sorted(directory.glob("*.json")):
        crd = json.loads(path.read_text())
        schemas[(crd["group"], crd["version"], crd["kind"])] = crd["openAPIV3Schema"]
    return schemas


def unknown_fields(value: Any, schema: dict[str, Any], at: str) -> Iterator[str]:
    """The paths of fields `schema` does not declare, below `at`."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict):
        properties = schema.get("properties")
        additional = schema.get("additionalProperties")
        for key, item in value.items():
            if properties is not None and key in properties:
                yield from unknown_fields(item, properties[key], f"{at}.{key}")
            elif isinstance(additional, dict):
                yield from unknown_fields(item, additional, f"{at}.{key}")
            elif properties is not None and at != "$.metadata":
                yield f"{at}.{key}"
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from unknown_fields(item, schema["items"], f"{at}[{index}]")


def check(document: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Every problem of one object: schema errors, then unknown fields."""
    validator = jsonschema.Draft7Validator(schema)
    problems = [
        f"{'.'.join(str(p) for p in error.absolute_path) or '(root)'}: {error.message}"
        for error in validator.iter_errors(document)
    ]
    problems += [f"{path}: not a field of this kind" for path in unknown_fields(document, schema, "$")]
    return problems


def main(argv: list[str]) -> int:
    schemas = load_schemas(Path(argv[1]))
    groups = {group for group, _, _ in schemas}
    failed = False
    for manifest in argv[2:]:
        for document in yaml.safe_load_all(Path(manifest).read_text()):
            if not document:
                continue
            group, _, version = document.get("apiVersion", "").rpartition("/")
            if group not in groups:
                continue
            kind = document.get("kind", "")
            name = f"{kind}/{document.get('metadata', {}).get('name', '?')}"
            schema = schemas.get((group, version, kind))
            if schema is None:
                print(f"{manifest}: {name}: no schema for {group}/{version} {kind}")
                failed = True
                continue
            problems = check(document, schema)
            for problem in problems:
                print(f"{manifest}: {name}: {problem}")
            failed = failed or bool(problems)
            if not problems:
                print(f"valid {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
