"""What an API server does with a CR before storing it, emulated offline for tests.

Structural defaulting, the openAPIV3Schema (jsonschema, OpenAPI 3.0 ~ draft 4), strict field
validation (unknown fields rejected, as `kubectl apply` does by default), the items of a list of type
set unique, and the CEL
``x-kubernetes-validations`` (cel-python, with the Kubernetes quantity library emulated).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml
from celpy import celtypes

from kvdrive.operator.api.quantity import is_quantity, parse_quantity

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "kvdrivedeployment.yaml"
EXAMPLES = REPO / "examples"


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def version_schema(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural-schema defaulting: missing fields get their default, recursively."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        value = {k: apply_defaults(schema["additionalProperties"], v) for k, v in value.items()}
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], v) for v in value]
    return value


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Add additionalProperties: false where the API server would reject unknown fields."""
    schema = copy.deepcopy(schema)
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        if schema.get("type") == "object" and "additionalProperties" not in schema and schema["properties"]:
            schema["additionalProperties"] = False
        schema["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
    if isinstance(schema.get("items"), dict):
        schema["items"] = _strict(schema["items"])
    if schema.get("x-kubernetes-list-type") == "set":  # the API server refuses a duplicate item of a set
        schema["uniqueItems"] = True
    return schema


def _q(value: celtypes.Value) -> Any:
    return parse_quantity(str(value))


_CEL_FUNCTIONS = {
    "isQuantity": lambda s: celtypes.BoolType(is_quantity(str(s))),
    "quantity": lambda s: celtypes.StringType(str(s)),
    "asInteger": lambda q: celtypes.IntType(int(_q(q))),
    "isGreaterThan": lambda a, b: celtypes.BoolType(_q(a) > _q(b)),
    "isLessThan": lambda a, b: celtypes.BoolType(_q(a) < _q(b)),
    "compareTo": lambda a, b: celtypes.IntType((_q(a) > _q(b)) - (_q(a) < _q(b))),
}


@dataclass(frozen=True)
class Violation:
    path: str  # where the rule sits (plus its fieldPath), e.g. spec.tiers.dram.size
    message: str


def _cel_violations(schema: dict[str, Any], value: Any, path: str) -> list[Violation]:
    found: list[Violation] = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]), functions=_CEL_FUNCTIONS)
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if result is not True and not (isinstance(result, celtypes.BoolType) and bool(result)):
            where = path + rule.get("fieldPath", "")
            found.append(Violation(where.lstrip("."), rule["message"]))
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key in value:
                found += _cel_violations(sub, value[key], f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            found += _cel_violations(schema["items"], item, f"{path}[{index}]")
    return found


def crd_violations(crd: dict[str, Any], cr: dict[str, Any]) -> list[Violation]:
    """Everything the API server would reject in ``cr`` (empty list: accepted)."""
    schema = version_schema(crd)
    defaulted = apply_defaults(schema, cr)
    validator = jsonschema.Draft4Validator(_strict(schema))
    errors = [
        Violation(".".join(str(p) for p in err.absolute_path), err.message) for err in validator.iter_errors(defaulted)
    ]
    if errors:  # the API server runs CEL only on values that passed the schema
        return errors
    return _cel_violations(schema, defaulted, "")


def load_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())
