"""Schemathesis against the service's own OpenAPI document, in-process (ASGI): generated valid
and invalid requests on every operation; no response is a 5xx, every response (status, content
type, headers, body) conforms to the schema, and invalid requests are refused. Bounded: a few
examples per operation. "Schema-valid data is accepted" is not checked: the schema cannot say
everything `Memory` validates (the filter grammar, the range of times), which answers 422.

(The operations are driven by hand with hypothesis rather than `schema.parametrize()`, whose
fixture-backed mode does not run on this pytest.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from engram.config import Config
from engram.providers.embedders import MiniLM
from engram.server import ServiceLimits, create_app
from engram.server.keys import SQLiteKeyStore

EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 15}
# POST /v1/import takes JSON lines: sent as the generated text.
schemathesis.serializer.alias("application/x-ndjson", "text/plain")


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
def test_api_conforms_to_its_schema(mode: GenerationMode, tmp_path: Path, embedder: MiniLM) -> None:
    keys = SQLiteKeyStore(tmp_path / "keys.db")
    headers = {"Authorization": f"Bearer {keys.create('fuzz', 'admin')[1]}"}
    app = create_app(Config(path=tmp_path / "engram.db"), embedder=embedder, keys=keys,
                     limits=ServiceLimits(rate=100_000, burst=100_000))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    # The key is the test's own (headers= below): generated Authorization values, invalid ones in
    # the negative mode, would be replaced by it and then wrongly count as accepted bad input.
    # Bad keys have their own tests (test_server.py).
    schema.config.generation.update(with_security_parameters=False)
    # A body over the service's size limit is refused too, with 413.
    rejection = schema.config.checks.negative_data_rejection
    rejection.expected_statuses = [*rejection.expected_statuses, "413"]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 19
    tried: list[str] = []
    try:
        for operation in operations:
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES[mode], deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case: Any) -> None:
                case.call_and_validate(headers=headers, excluded_checks=[positive_data_acceptance])

            try:
                run()
            except Unsatisfiable:
                # No invalid request exists for an operation without inputs (GET /health).
                assert mode is GenerationMode.NEGATIVE, operation.label
                continue
            tried.append(operation.label)
    finally:
        keys.close()
    assert len(tried) >= len(operations) - 3, sorted(set(o.label for o in operations) - set(tried))
