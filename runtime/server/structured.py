"""What a request constrains its output to, read from its OpenAI fields: ``response_format`` (JSON mode, a
JSON schema), vLLM's ``guided_choice`` / ``guided_regex``, and a forced tool call (``tool_choice``, written as
``kvdrive.runtime.protocol.tool_prompt`` describes). The engine's grammar (``engine/grammar.py``) then makes every
sampled token continue it. ``OutputConstraints`` compiles it; a constraint that does not compile is a 400 naming
its field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

from kvdrive.runtime.engine.grammar import CompiledGrammar, GrammarError, GrammarSpec
from kvdrive.runtime.protocol import request_schemas as r
from kvdrive.runtime.protocol.output_schemas import ResponseFormat
from kvdrive.runtime.protocol.tool_prompt import CLOSE, OPEN, forced
from kvdrive.runtime.server.errors import ApiError

MAX_CALLS = 8  # calls in one forced answer with parallel_tool_calls (a small model may repeat a call without end)


def grammar_spec(response_format: ResponseFormat | None, guided_choice: list[str] | None,
                 guided_regex: str | None) -> tuple[GrammarSpec, str] | None:
    """The request's constraint and the field it came from, or None. At most one may be given."""
    given = [(name, v) for name, v in (("response_format", response_format if response_format is not None
                                        and response_format.type != "text" else None),
                                       ("guided_choice", guided_choice), ("guided_regex", guided_regex))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of response_format, guided_choice and guided_regex; got "
                         f"{', '.join(n for n, _ in given)}")
    if not given:
        return None
    name, value = given[0]
    if isinstance(value, ResponseFormat):
        if value.type == "json_object":
            return GrammarSpec("json_object"), name
        assert value.json_schema is not None
        return GrammarSpec("json_schema", json.dumps(value.json_schema.schema_ or {})), name
    if isinstance(value, list):
        return GrammarSpec("choice", json.dumps(value)), name
    return GrammarSpec("regex", str(value)), name


def _call_schema(name: str, parameters: dict[str, object]) -> dict[str, object]:
    """A call of one function as a JSON schema; the parameters' ``$defs`` (pydantic puts nested models there)
    move to the root, where their ``#/$defs/...`` references point."""
    arguments = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}
    schema: dict[str, object] = {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
                                 "required": ["name", "arguments"], "additionalProperties": False}
    for key in ("$defs", "definitions"):
        if key in parameters:
            schema[key] = parameters[key]
    return schema


def tool_grammar(body: r.ChatCompletionRequest) -> GrammarSpec | None:
    """The Lark grammar of a forced answer: ``<tool_call>{"name": f, "arguments": <f's schema>}</tool_call>``,
    once or (parallel_tool_calls) up to MAX_CALLS times, one rule per function; None when the model decides."""
    must = forced(body)
    if must is None:
        return None
    tools = [t for t in body.tools or [] if must in ("*", t.function.name)]
    rules = [f"fn{i}: %json {json.dumps(_call_schema(t.function.name, t.function.parameters))}"
             for i, t in enumerate(tools)]
    start = f'start: call ("\\n" call)~0..{MAX_CALLS - 1}' if body.parallel_tool_calls else "start: call"
    body_rule = "body: " + " | ".join(f"fn{i}" for i in range(len(tools)))
    lark = "\n".join([start, f'call: "{OPEN}" body "{CLOSE}"', body_rule, *rules])
    return GrammarSpec("lark", lark)


@dataclass(frozen=True)
class OutputConstraints:
    """A request's output grammar compiled off the event loop (``compile``: ``GrammarCompiler.compile``)."""

    compile: Callable[[GrammarSpec], CompiledGrammar]

    async def of(self, body: r.SamplingFields, response_format: ResponseFormat | None,
                 tool_spec: GrammarSpec | None = None) -> CompiledGrammar | None:
        """The request's output grammar (a format, or a forced tool call: ``tool_spec``); None when its output
        is free. A bad one is a 400 naming its field."""
        try:
            found = grammar_spec(response_format, body.guided_choice, body.guided_regex)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="response_format") from exc
        if tool_spec is not None:
            if found is not None:
                raise ApiError(400, f"a forced tool call (tool_choice) cannot be combined with {found[1]}",
                               param="tool_choice")
            found = (tool_spec, "tools")
        if found is None:
            return None
        spec, field = found
        try:
            return await asyncio.to_thread(self.compile, spec)
        except GrammarError as exc:
            raise ApiError(400, f"{field}: {exc}", param=field) from exc

    async def check_tools(self, body: r.ChatCompletionRequest) -> None:
        """Each function's parameters must be a schema a call can follow (compiled, off the event loop)."""
        for i, tool in enumerate(body.tools or []):
            spec = GrammarSpec("json_schema", json.dumps(tool.function.parameters))
            try:
                await asyncio.to_thread(self.compile, spec)
            except GrammarError as exc:
                raise ApiError(400, f"tools[{i}].function.parameters: {exc}", param="tools") from exc
