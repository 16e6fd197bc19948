"""Fuzz the server with schemathesis from its own OpenAPI document: no input may produce a 5xx.

Runs in-process (ASGI) on a tiny random-weight model so that hundreds of generated requests,
including huge max_tokens and odd prompts, finish quickly; the engine thread is the real one.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from kvdrive.runtime.server.app import create_app
from kvdrive.runtime.server.state import ServerState


@pytest.fixture(scope="module")
def app(tiny_state: ServerState) -> object:
    return create_app(tiny_state)


def test_no_input_gives_a_server_error(app: object) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/admin/tiers"}
    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case: schemathesis.Case) -> None:
            if isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = "tiny"  # past the 404 check, into validation and generation
            response = case.call()
            assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {response.status_code}"

        check()
