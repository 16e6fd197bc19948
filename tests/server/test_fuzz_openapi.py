"""Fuzz the server with schemathesis from its own OpenAPI document: no input may produce a 5xx.

Runs in-process (ASGI) on a tiny random-weight model so that hundreds of generated requests,
including huge max_tokens and odd prompts, finish quickly; the engine thread is the real one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from kvdrive.runtime.engine import SchedulerConfig
from kvdrive.runtime.server.app import create_app
from kvdrive.runtime.server.serve import ServeOptions, build_state


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "runtime" / "conftest.py"
    spec = importlib.util.spec_from_file_location("runtime_test_models", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    make_hf_model = module.make_hf_model

    d = tmp_path_factory.mktemp("tiny")
    make_hf_model(d, arch="llama", max_position_embeddings=256)
    state = build_state(ServeOptions(model=str(d), served_model_name="tiny", progress=False,
                                     scheduler=SchedulerConfig(max_waiting=8)))
    state.engine.start()
    yield create_app(state)
    state.engine.shutdown()


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
