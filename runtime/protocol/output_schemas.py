"""The request bodies that shape a chat answer's output (pydantic): ``response_format`` (JSON mode, a JSON
schema) and ``tools`` / ``tool_choice``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from kvdrive.runtime.protocol.fields import REQUEST, Bool


class JsonSchemaFormat(BaseModel):
    model_config = REQUEST
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="the schema's name (letters, digits, _ and -)")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema",
                                    description="a JSON Schema object; {} allows any JSON value")
    strict: Bool | None = Field(default=None, description=(
        "accepted either way: the output always follows the schema (it is grammar-constrained)"))


class ResponseFormat(BaseModel):
    model_config = REQUEST
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is 'json_schema'")
        return self


NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDef(BaseModel):
    model_config = REQUEST
    name: str = Field(pattern=NAME, description="the function's name (letters, digits, _ and -)")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}},
                                       description="a JSON Schema of its arguments (an object)")
    strict: Bool | None = Field(default=None, description=(
        "accepted either way: with tool_choice required or a named function the arguments always follow the "
        "schema; with auto they are checked to parse"))


class ToolDef(BaseModel):
    model_config = REQUEST
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = REQUEST
    name: str


class NamedToolChoice(BaseModel):
    model_config = REQUEST
    type: Literal["function"]
    function: NamedFunction


class CallFunction(BaseModel):
    model_config = REQUEST
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class ToolCall(BaseModel):
    """A call the assistant made (in a request's history, and in an answer)."""

    model_config = REQUEST
    id: str
    type: Literal["function"] = "function"
    function: CallFunction
