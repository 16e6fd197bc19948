"""The ``KVDriveDeployment`` resource as a whole: its group, version, kind and plural, its metadata rules, and
parsing a CR read from YAML or from the API into the models.

Owns what a CR is before its spec means anything: the API identity, the name's limits, and turning
pydantic's errors into one ``field.path: message`` per problem (``SpecError``); also ``routing_of``, the
routing of a raw spec that the model may reject (the status is written even then).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvdrive.operator.api.routingspec import Routing
from kvdrive.operator.api.spec import KVDriveSpec
from kvdrive.operator.api.specbase import FIELD_MARK

GROUP = "kvdrive.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "KVDriveDeployment"
PLURAL = "kvdrivedeployments"
MAX_NAME_LENGTH = 52  # StatefulSet pod names + the controller-revision-hash label must fit 63 chars
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(pattern=NAME_PATTERN, max_length=MAX_NAME_LENGTH)
    namespace: str = Field(default="default", pattern=NAME_PATTERN, max_length=63)
    uid: str | None = None
    generation: int | None = None


class KVDriveDeployment(BaseModel):
    """A whole CR as read from YAML or from the API (status is read separately)."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)
    api_version: Literal["kvdrive.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["KVDriveDeployment"]
    metadata: Metadata
    spec: KVDriveSpec


class SpecError(ValueError):
    """An invalid CR; ``str()`` lists each problem as ``field.path: message``."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _field_path(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        elif item in ("function-after", "function-before") or "[" in str(item):
            continue  # pydantic's validator/union markers are not field names
        else:
            parts.append(str(item))
    return ".".join(parts) or "<root>"


def _problem(prefix: str, err: Any) -> str:
    path = _field_path(tuple(err["loc"]))
    message = str(err["msg"]).removeprefix("Value error, ")
    if message.startswith(FIELD_MARK):
        field, message = message.removeprefix(FIELD_MARK).split(":", 1)
        path = f"{path}.{field}" if path != "<root>" else field
    return f"{prefix}{path}: {message}"


def parse_cr(doc: Any) -> KVDriveDeployment:
    """Validate a CR (a mapping from YAML/JSON) or raise SpecError naming each bad field."""
    if not isinstance(doc, dict):
        raise SpecError(["<root>: a KVDriveDeployment must be a mapping"])
    try:
        return KVDriveDeployment.model_validate(doc)
    except ValidationError as exc:
        raise SpecError([_problem("", err) for err in exc.errors()]) from None


def routing_of(spec: Any) -> Routing:
    """``spec.routing`` of a raw spec as the API server stored it (the status is written even for a spec
    the model rejects): the default when it is missing or invalid."""
    try:
        return Routing.model_validate(((spec or {}) if isinstance(spec, dict) else {}).get("routing") or {})
    except ValidationError:
        return Routing()
