"""What every model of the CR's spec shares: camelCase aliases, no unknown fields, frozen; and cross-field
errors that name the field they are about (``spec.parse_cr`` turns them into ``spec.<path>: message``)."""

from __future__ import annotations

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
