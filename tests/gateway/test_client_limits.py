"""What real clients meet at the API's edges, through the official `openai` client and raw HTTP against an
in-process server on the demo checkpoint: an output limit past the context is a 400 naming it and the numbers
(OpenAI's and vLLM's answer); errors quote what was sent up to a few hundred characters, never megabytes; browser
pages of an allowed origin may call the API (CORS preflight without a key), others get no CORS headers."""

import asyncio
import random

import aiohttp
import openai
import pytest

from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key

pytestmark = pytest.mark.timeout(300)
CONTEXT = 256
ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, API key) of one server for the module, which allows ``ORIGIN``."""
    with in_process_server(tmp_path_factory.mktemp("client_limits"),
                           dict(dtype="float32", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                                max_model_len=CONTEXT),
                           gateway=dict(allowed_origins=(ORIGIN,))) as srv:
        yield srv, srv.run(new_tenant_key(srv.database_url))


def test_an_output_limit_past_the_context_is_a_400_naming_it(served):
    srv, key = served
    prompt = [random.randrange(3, 200) for _ in range(random.randint(20, 100))]
    room = CONTEXT - len(prompt)

    async def go():
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0) as client:
            for field, create in (
                    ("max_tokens", lambda n: client.completions.create(model="demo", prompt=prompt, max_tokens=n)),
                    ("max_tokens", lambda n: client.chat.completions.create(
                        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=n + 300)),
                    ("max_completion_tokens", lambda n: client.chat.completions.create(
                        model="demo", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=n + 300)),
                    ("max_output_tokens", lambda n: client.responses.create(model="demo", input="hi",
                                                                            max_output_tokens=n + 300))):
                with pytest.raises(openai.BadRequestError) as refused:
                    await create(room + 1)
                error = refused.value.body
                assert error["param"] == field and error["code"] == "context_length_exceeded", error
                assert f"{CONTEXT}" in error["message"] and field in error["message"], error
            # Exactly the room left fits, and is generated in full.
            out = await client.completions.create(model="demo", prompt=prompt, max_tokens=room,
                                                  extra_body={"ignore_eos": True})
            assert out.usage.completion_tokens == room and out.usage.prompt_tokens == len(prompt)
            # Left out (chat): the output fills the context.
            chat = await client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                                        extra_body={"ignore_eos": True})
            assert chat.usage.prompt_tokens + chat.usage.completion_tokens == CONTEXT

    srv.run(go())


def test_errors_quote_a_huge_value_by_its_start_and_length(served):
    srv, key = served
    huge = "".join(random.choice("abcdefghij") for _ in range(random.randint(2_000_000, 3_000_000)))

    async def go():
        auth = {"Authorization": f"Bearer {key}"}
        async with aiohttp.ClientSession(headers=auth) as http:
            message = [{"role": "user", "content": "x"}]
            for path, body in (("/v1/chat/completions", {"model": huge, "messages": message}),
                               ("/v1/chat/completions", {"messages": [{"role": huge, "content": "x"}]}),
                               ("/v1/completions", {"prompt": "x", huge: 1})):
                async with http.post(srv.server.make_url(path), json=body) as r:
                    raw = await r.read()
                    assert 400 <= r.status < 500, raw[:300]
                    error = (await r.json())["error"]
                assert len(raw) < 4096, (len(raw), raw[:300])
                assert f"{len(huge)} characters" in error["message"] and huge[:100] in error["message"], error

    srv.run(go())


def test_browsers_of_an_allowed_origin_may_call_the_api(served):
    srv, key = served

    async def go():
        async with aiohttp.ClientSession() as http:
            url = srv.server.make_url("/v1/chat/completions")
            preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                         "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
            async with http.options(url, headers=preflight) as r:  # no key: browsers send none with a preflight
                assert r.status == 204, await r.text()
                assert r.headers["Access-Control-Allow-Origin"] == ORIGIN
                assert "POST" in r.headers["Access-Control-Allow-Methods"]
                assert "authorization" in r.headers["Access-Control-Allow-Headers"].lower()
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
            async with http.post(url, json=body, headers={"Origin": ORIGIN, "Authorization": f"Bearer {key}"}) as r:
                assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
                assert "x-request-id" in r.headers["Access-Control-Expose-Headers"].lower()
                await r.read()
            async with http.post(url, json=body, headers={"Origin": ORIGIN}) as r:  # errors too: the page reads them
                assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
            # Another origin: no preflight answer, no CORS header (a browser then refuses the page the answer).
            other = {**preflight, "Origin": "https://evil.example.com"}
            async with http.options(url, headers=other) as r:
                assert r.status != 204 and "Access-Control-Allow-Origin" not in r.headers
            async with http.post(url, json=body, headers={"Origin": other["Origin"],
                                                          "Authorization": f"Bearer {key}"}) as r:
                assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
                await r.read()

    srv.run(go())


def test_allowed_origins_flag_is_checked(served, capsys):
    from gateway.cli import main

    srv, _ = served
    assert main(["serve", "--model", srv.demo, "--allowed-origins", "app.example.com/path"]) == 2
    assert "--allowed-origins" in capsys.readouterr().err


def test_uploads_count_against_the_request_rate_and_the_storage_cap(served):
    """Uploads through the official client: a tenant limited to a few requests a minute gets a 429 with
    Retry-After for the upload past them (uploads used to bypass the rate); a tenant whose stored files would
    pass its cap gets a 413 naming it, nothing stored, and room again once it deletes a file."""
    srv, _ = served
    rpm = random.randint(2, 4)
    size = random.randint(20_000, 40_000)
    cap = 2 * size + random.randint(0, size // 2)  # two files fit, a third does not

    def content() -> bytes:
        line = b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
        return (line * (size // len(line) + 1))[:size]

    async def go():
        rated = await new_tenant_key(srv.database_url, "rated", requests_per_minute=rpm)
        capped = await new_tenant_key(srv.database_url, "capped", max_stored_file_bytes=cap)
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=rated, max_retries=0) as client:
            for _ in range(rpm):
                await client.files.create(file=("a.jsonl", content()), purpose="batch")
            with pytest.raises(openai.RateLimitError) as limited:
                await client.files.create(file=("a.jsonl", content()), purpose="batch")
            assert int(limited.value.response.headers["Retry-After"]) >= 1
            assert len((await client.files.list()).data) == rpm
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=capped, max_retries=0) as client:
            first = await client.files.create(file=("a.jsonl", content()), purpose="batch")
            await client.files.create(file=("b.jsonl", content()), purpose="batch")
            with pytest.raises(openai.APIStatusError) as full:
                await client.files.create(file=("c.jsonl", content()), purpose="batch")
            error = full.value.body
            assert full.value.status_code == 413 and error["code"] == "storage_limit_exceeded", error
            assert f"{cap:,}" in error["message"] and "DELETE /v1/files" in error["message"], error
            assert len((await client.files.list()).data) == 2  # nothing of it stored
            await client.files.delete(first.id)
            await client.files.create(file=("c.jsonl", content()), purpose="batch")  # room again

    srv.run(go())


def test_tokenize_and_detokenize_count_against_the_request_rate(served):
    """/tokenize renders the chat template and reads images to count tokens: a tenant past its requests a minute gets
    a 429 with Retry-After there as on the generation routes (both used to answer without limit)."""
    srv, _ = served
    rpm = random.randint(2, 4)
    messages = [{"role": "user", "content": f"count me {random.randrange(10**6)}"}]

    async def go():
        rated = await new_tenant_key(srv.database_url, f"rated_tok{random.randrange(10**6)}", requests_per_minute=rpm)
        headers = {"Authorization": f"Bearer {rated}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            async def post(path: str, body: dict) -> tuple[int, dict, dict]:
                async with http.post(srv.server.make_url(path), json=body) as r:
                    return r.status, await r.json(), dict(r.headers)

            statuses = []
            for i in range(rpm):
                status, body, _ = await post("/tokenize", {"model": "demo", "messages": messages})
                statuses.append(status)
            assert statuses == [200] * rpm, statuses
            for path, body in (("/tokenize", {"model": "demo", "messages": messages}),
                               ("/detokenize", {"model": "demo", "tokens": [5, 6, 7]})):
                status, error, headers = await post(path, body)
                assert status == 429, (path, status, error)
                assert int(headers["Retry-After"]) >= 1 and error["error"]["type"] == "rate_limit_error", error

    srv.run(go())
