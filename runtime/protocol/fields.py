"""The strict field types of request bodies: a number is not a string or a boolean, floats are finite,
unknown fields are refused."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Strict

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # an int is a number too; a bool or a string is not
Bool = Annotated[bool, Strict()]
REQUEST = ConfigDict(extra="forbid", allow_inf_nan=False)
