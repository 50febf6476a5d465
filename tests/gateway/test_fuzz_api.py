"""Fuzzing every operation of /openapi.json with schemathesis against a running `moegate serve`:
valid and invalid bodies, parameters and headers, with a tenant's key. The check: never a 5xx.

Bounded: a few dozen examples per operation, a context of 64 tokens (so no request generates for
long), and a hard time limit. Totals are printed at the end (operations, examples, 5xx).
"""

import json
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.gateway.serve_process import demo_server

EXAMPLES_PER_OPERATION = int(os.environ.get("MOEGATE_FUZZ_EXAMPLES", "15"))
_totals = {"examples": 0, "5xx": 0, "operations": set()}


@pytest.fixture(scope="module")
def served():
    """A real `moegate serve` on a free loopback port; yields (base URL, key, process)."""
    try:
        with demo_server("moegate-fuzz-", "--max-model-len", "64") as (url, key, _, proc):
            yield url, key, proc
    finally:
        print(f"\nfuzz totals: {json.dumps({**_totals, 'operations': len(_totals['operations'])})}")


@pytest.mark.timeout(600)
def test_no_operation_answers_5xx(served):
    url, key, proc = served
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    headers = {"Authorization": f"Bearer {key}"}
    failures = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 13  # every route the document lists
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case):
                _totals["operations"].add(operation.label)
                _totals["examples"] += 1
                response = case.call(base_url=url, headers=headers, timeout=60)
                if response.status_code >= 500:
                    _totals["5xx"] += 1
                    failures.append(f"{operation.label} ({mode.value}): {response.status_code} {response.text[:300]}")

            try:
                fuzz()
            except Unsatisfiable:  # nothing invalid to send (an operation with no parameters or body)
                assert mode is GenerationMode.NEGATIVE, operation.label
    tracebacks = [line for line in proc.output_tail if "INFO" not in line][-40:]
    assert not failures, "\n".join(failures[:20]) + "\nserver log:\n" + "".join(tracebacks)
