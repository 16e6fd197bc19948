"""What every model of the CR's spec shares: camelCase aliases, no unknown fields, frozen; cross-field
errors that name the field they are about (``cr.parse_cr`` turns them into ``spec.<path>: message``); and
the markers and rule shapes the CRD is generated with (``scripts/gen_crd.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

FIELD_MARK = "@field:"


class Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, strict=False
    )


def cross(field: str, message: str) -> ValueError:
    """A cross-field error reported against ``field`` of the model that raised it."""
    return ValueError(f"{FIELD_MARK}{field}:{message}")


@dataclass(frozen=True)
class IntOrString:
    """Annotation marker: the CRD types the field as int-or-string, its strings matching ``pattern``."""

    pattern: str


def cel(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict[str, str]:
    """One CEL rule of the CRD (``x-kubernetes-validations``), beside the validator that checks the same."""
    found = {"rule": rule, "message": message}
    if field_path is not None:
        found["fieldPath"] = field_path
    if reason is not None:
        found["reason"] = reason
    return found


def rules(*found: dict[str, str], **extra: Any) -> dict[str, Any]:
    """A ``json_schema_extra`` holding CEL rules (and other extensions)."""
    return {"x-kubernetes-validations": list(found), **extra}
