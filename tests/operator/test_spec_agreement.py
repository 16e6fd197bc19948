"""The pydantic spec model and the CRD describe the same fields, defaults and enums."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, get_args, get_origin

from crdcheck import apply_defaults, load_crd, load_example, version_schema
from pydantic import BaseModel

from kvdrive.operator.api.cr import parse_cr
from kvdrive.operator.api.spec import KVDriveSpec
from kvdrive.operator.api.status import KVDriveStatus


def _crd_fields(schema: dict[str, Any], path: str = "") -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, sub in schema.get("properties", {}).items():
        here = f"{path}.{key}" if path else key
        out[here] = sub
        if sub.get("type") == "object" and "properties" in sub:
            out.update(_crd_fields(sub, here))
        elif sub.get("type") == "array" and "properties" in sub.get("items", {}):
            out.update(_crd_fields(sub["items"], here + "[]"))
    return out


def _model_class(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) is list:
        return None
    if get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in get_args(annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return None


def _literal(annotation: Any) -> tuple[Any, ...] | None:
    if get_origin(annotation) in (typing.Union, types.UnionType):  # an optional Literal
        args = [arg for arg in get_args(annotation) if arg is not type(None)]
        annotation = args[0] if len(args) == 1 else annotation
    return get_args(annotation) if get_origin(annotation) is Literal else None


def _model_fields(model: type[BaseModel], path: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        key = field.alias or name
        here = f"{path}.{key}" if path else key
        out[here] = field.annotation
        sub = _model_class(field.annotation)
        if sub is not None:
            out.update(_model_fields(sub, here))
        elif get_origin(field.annotation) is list and _model_class(get_args(field.annotation)[0]) is not None:
            out.update(_model_fields(get_args(field.annotation)[0], here + "[]"))
    return out


def test_spec_fields_are_the_same() -> None:
    crd = _crd_fields(version_schema(load_crd())["properties"]["spec"])
    model = _model_fields(KVDriveSpec)
    assert sorted(crd) == sorted(model)


def test_status_fields_are_the_same() -> None:
    crd = set(_crd_fields(version_schema(load_crd())["properties"]["status"])) - {"kopf"}
    model = set(_model_fields(KVDriveStatus))
    assert crd == model
    assert {"pods[].gpuBytes", "pods[].lastChange", "budgets.dram", "autoscaling.desiredReplicas"} <= model
    assert {"pods[].maxRunning", "pods[].hotBytes", "pods[].reserveBytes", "pods[].recommendations[].recommended",
            "maxRunning", "recommendations[].field"} <= model


def test_status_enums_are_the_same() -> None:
    crd = _crd_fields(version_schema(load_crd())["properties"]["status"])
    model = _model_fields(KVDriveStatus)
    enums = {path: sub["enum"] for path, sub in crd.items() if "enum" in sub}
    literals = {path: list(_literal(ann)) for path, ann in model.items() if _literal(ann)}
    # metav1.Condition types are open in the schema; the operator writes only its own
    literals.pop("conditions[].type")
    assert enums == literals
    assert enums["pods[].metrics"] == ["ok", "missing"] and enums["pods[].sharedTier"] == ["ok", "degraded"]
    assert enums["pods[].recommendations[].tier"] == enums["recommendations[].tier"] == ["dram", "ssd"]


def test_enums_are_the_same() -> None:
    crd = _crd_fields(version_schema(load_crd())["properties"]["spec"])
    model = _model_fields(KVDriveSpec)
    enums = {path: sub["enum"] for path, sub in crd.items() if "enum" in sub}
    literals = {path: list(_literal(ann)) for path, ann in model.items() if _literal(ann)}
    assert enums == literals
    assert len(enums) >= 4


def test_defaults_are_the_same() -> None:
    for example in ("minimal.yaml", "full.yaml", "fixed-replicas.yaml", "routing.yaml", "inferencepool.yaml"):
        doc = load_example(example)
        by_crd = apply_defaults(version_schema(load_crd()), doc)["spec"]
        by_model = parse_cr(doc).spec.model_dump(by_alias=True, exclude_none=True)
        assert by_model == by_crd, example


def test_model_defaults_match_crd_defaults_field_by_field() -> None:
    crd = _crd_fields(version_schema(load_crd())["properties"]["spec"])
    defaulted = {path for path, sub in crd.items()
                 if "default" in sub and not (sub.get("type") == "object" and sub["default"] == {})}
    # an optional object (the shared tier, its Secrets) shows its fields' defaults only where it is set
    specs = [{"model": {"source": "demo"}},
             {"model": {"source": "demo"}, "tiers": {"shared": {"service": {"name": "valkey"},
                                                                "authSecretRef": {"name": "auth"}}}},
             {"model": {"source": "demo"}, "tiers": {"shared": {"endpoints": ["valkey:6379"], "tls": {
                 "enabled": True, "caSecretRef": {"name": "ca"}}}}}]
    checked = set()
    for spec in specs:
        dumped = KVDriveSpec.model_validate(spec).model_dump(by_alias=True)
        for path in defaulted:
            node: Any = dumped
            given: Any = spec
            for key in path.split("."):
                node = node.get(key) if isinstance(node, dict) else None
                given = given.get(key) if isinstance(given, dict) else None
            if node is None or given is not None:  # not there in this spec, or not a default
                continue
            assert node == crd[path]["default"], path
            checked.add(path)
    assert checked == defaulted
    assert {"tiers.shared.namespace", "tiers.shared.service.port", "tiers.shared.tls.caSecretRef.key"} <= checked
