"""Property tests: the request decoder and the Batch file validator answer any input with a result or
a client error (APIError 4xx), never another exception."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.batch.validation import validate_batch_file
from gateway.errors import APIError
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest, decode_body, sampling_params_of

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "stream", "stream_options", "stop", "seed", "ignore_eos", "user", "role", "content"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), inner,
                                                                max_size=5),
    max_leaves=20,
)
bodies = (st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8).map(lambda d: json.dumps(d).encode())
          | st.binary(max_size=200))


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies, chat=st.booleans())
def test_the_request_decoder_answers_anything_with_a_request_or_a_4xx(body, chat):
    try:
        request = decode_body(body, ChatCompletionRequest if chat else CompletionRequest)
        sampling_params_of(request)
    except APIError as e:
        assert 400 <= e.status < 500 and e.message


lines = st.lists(
    st.dictionaries(st.sampled_from(["custom_id", "method", "url", "body"]),
                    json_values | st.sampled_from(["POST", "/v1/completions", "/v1/chat/completions"]),
                    max_size=4).map(json.dumps)
    | st.text(max_size=40),
    max_size=6,
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(file_lines=lines, endpoint=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings"]))
def test_the_batch_validator_answers_any_file_with_a_verdict(file_lines, endpoint):
    data = "\n".join(file_lines).encode()
    checked = validate_batch_file(data, endpoint, "demo", 5, 16)
    assert checked.ok == (not checked.errors)
    for error in checked.errors:
        assert error["code"] and error["message"]
