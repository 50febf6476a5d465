"""The Batch API through the official `openai` client, against a real server on loopback.

Reference for results: the live /v1/completions route of the same server with
the same bodies (greedy), so a batch line must answer exactly what the live
API answers.
"""

import asyncio
import io
import json
import random
import time

import openai
import pytest
from aiohttp.test_utils import TestServer

from engine.serving.async_engine import AsyncEngine
from engine.core.config import EngineConfig
from engine.loading.demo_model import write_demo_model
from gateway.app import create_app
from gateway.config import GatewayConfig
from tenants.migrate import upgrade
from tenants.store import TenantStore
from tests.gateway.loop_lag import loop_lag_while
from tests.gateway.tenant_keys import new_tenant_key


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("demo"))
    write_demo_model(path, seed=random.randrange(1000))
    return path


async def _tenants(url: str, quota: dict | None = None) -> dict[str, str]:
    """Tenants acme (with ``quota``) and other, each with a key."""
    return {"acme": await new_tenant_key(url, "acme", **(quota or {})), "other": await new_tenant_key(url, "other")}


def _server(demo_dir, tmp_path, **config):
    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)
    engine = AsyncEngine(EngineConfig(model=demo_dir, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=256))
    cfg = GatewayConfig(served_model_name="demo", database_url=url, data_dir=str(tmp_path / "data"), **config)
    return url, TestServer(create_app(cfg, engine), host="127.0.0.1")


def _client(server, key):
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=key, max_retries=0)


def _jsonl(lines: list[dict]) -> bytes:
    return ("\n".join(json.dumps(l) for l in lines) + "\n").encode()


def _line(custom_id: str, prompt: str, max_tokens: int, url: str = "/v1/completions") -> dict:
    body = {"model": "demo", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body.update({"prompt": prompt} if url == "/v1/completions" else {"messages": [{"role": "user", "content": prompt}]})
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


async def _wait(client, batch_id: str, statuses=("completed", "failed", "expired", "cancelled"), timeout_s=90):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        b = await client.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        await asyncio.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {b.status}")


def test_upload_create_poll_download_list_and_isolation(demo_dir, tmp_path):
    rng = random.Random()
    url, server = _server(demo_dir, tmp_path)

    async def scenario():
        keys = await _tenants(url)
        async with server:
            acme, other = _client(server, keys["acme"]), _client(server, keys["other"])
            lines = [_line(f"req-{i}", f"prompt {rng.randrange(10**6)} number {i}", rng.randint(2, 8))
                     for i in range(7)]
            rng.shuffle(lines)
            f = await acme.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
            assert f.purpose == "batch" and f.bytes == len(_jsonl(lines))
            assert (await acme.files.content(f.id)).content == _jsonl(lines)
            batch = await acme.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                              completion_window="24h", metadata={"job": "eval"})
            assert batch.status == "in_progress" and batch.request_counts.total == 7
            done = await _wait(acme, batch.id)
            assert done.status == "completed" and done.request_counts.completed == 7 and done.error_file_id is None
            assert done.metadata == {"job": "eval"} and done.completed_at >= done.created_at
            out = [json.loads(l) for l in (await acme.files.content(done.output_file_id)).text.splitlines()]
            assert sorted(o["custom_id"] for o in out) == sorted(l["custom_id"] for l in lines)
            by_id = {o["custom_id"]: o for o in out}
            for line in lines[:3]:  # a batch line answers what the live API answers
                body = dict(line["body"])
                live = await acme.completions.create(extra_body={"ignore_eos": body.pop("ignore_eos")}, **body)
                got = by_id[line["custom_id"]]["response"]
                assert got["status_code"] == 200
                assert got["body"]["choices"][0]["text"] == live.choices[0].text
                assert got["body"]["usage"]["completion_tokens"] == line["body"]["max_tokens"]

            # tenant isolation: another tenant's ids are simply not there
            for call in (other.files.retrieve(f.id), other.files.content(f.id), other.files.delete(f.id),
                         other.batches.retrieve(batch.id), other.batches.cancel(batch.id)):
                with pytest.raises(openai.NotFoundError):
                    await call
            assert [x.id async for x in other.files.list()] == []
            assert [x.id async for x in other.batches.list()] == []

            # pagination: more batches (failed validation is cheap) listed two at a time, newest first
            bad = await acme.files.create(file=("bad.jsonl", io.BytesIO(b"{nope\n")), purpose="batch")
            ids = [batch.id] + [(await acme.batches.create(input_file_id=bad.id, endpoint="/v1/completions",
                                                           completion_window="24h")).id for _ in range(4)]
            page = await acme.batches.list(limit=2)
            assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
            assert [b.id async for b in await acme.batches.list(limit=2)] == ids[::-1]  # the client follows `after`
            files = [x.id async for x in acme.files.list()]
            assert {f.id, bad.id, done.output_file_id} == set(files)
            assert (await acme.files.delete(bad.id)).deleted
            with pytest.raises(openai.NotFoundError):
                await acme.files.retrieve(bad.id)

        store = TenantStore.open(url)
        try:
            rows = await store.usage_summary("acme", by="tenant")
        finally:
            await store.close()
        batch_rows = [r for r in rows if r["kind"] == "batch"]
        assert batch_rows[0]["requests"] == 7
        tokens = batch_rows[0]["prompt_tokens"] + batch_rows[0]["completion_tokens"]
        assert tokens // 2 <= batch_rows[0]["billed_tokens"] <= tokens // 2 + 7  # half price, rounded up per line
        assert [r for r in rows if r["kind"] == "live"][0]["requests"] == 3

    asyncio.run(scenario())


def test_every_validation_failure_is_listed_and_nothing_runs(demo_dir, tmp_path):
    url, server = _server(demo_dir, tmp_path, batch_max_lines=20, batch_max_file_bytes=4096)

    async def scenario():
        keys = await _tenants(url, quota={"max_batch_queue_tokens": 100})
        async with server:
            acme = _client(server, keys["acme"])
            good = _line("a", "hello", 4)
            lines = [
                json.dumps(good),
                "{not json",
                json.dumps(good),  # duplicate custom_id
                json.dumps({**_line("b", "x", 4), "url": "/v1/chat/completions"}),  # mixed endpoints
                json.dumps({**_line("c", "x", 4), "body": {"model": "other", "prompt": "x"}}),  # mixed/unknown model
                json.dumps({**_line("d", "x", 4), "body": {"model": "demo", "prompt": "x", "temperature": 9}}),
                json.dumps({**_line("e", "x", 4), "body": {"model": "demo", "prompt": 12}}),  # wrong type
                json.dumps({**_line("f", "x", 4), "method": "GET"}),
            ]
            f = await acme.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
            b = await acme.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
            assert b.status == "failed" and b.request_counts.total == 0 and b.failed_at
            found = {(e.code, e.line) for e in b.errors.data}
            assert {("invalid_json_line", 2), ("duplicate_custom_id", 3), ("mismatched_endpoint", 4),
                    ("mismatched_model", 5), ("model_not_found", 5), ("invalid_request", 6),
                    ("invalid_request", 7), ("invalid_method", 8)} <= found
            assert all(e.message for e in b.errors.data)

            many = await acme.files.create(file=("m.jsonl", io.BytesIO(_jsonl([_line(f"x{i}", "p", 1)
                                                                                 for i in range(21)]))),
                                           purpose="batch")
            b = await acme.batches.create(input_file_id=many.id, endpoint="/v1/completions", completion_window="24h")
            assert b.status == "failed" and b.errors.data[0].code == "too_many_lines"
            with pytest.raises(openai.APIStatusError) as big:
                await acme.files.create(file=("big.jsonl", io.BytesIO(b"x" * 5000)), purpose="batch")
            assert big.value.status_code == 413
            with pytest.raises(openai.BadRequestError):
                await acme.files.create(file=("a.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
            with pytest.raises(openai.NotFoundError):
                await acme.batches.create(input_file_id="file-nope", endpoint="/v1/completions",
                                          completion_window="24h")
            with pytest.raises(openai.BadRequestError):
                await acme.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")
            # the queue limit: 100 tokens; this batch would hold about 4 x (1 + 40)
            heavy = await acme.files.create(file=("h.jsonl", io.BytesIO(_jsonl([_line(f"h{i}", "p", 40)
                                                                                  for i in range(4)]))),
                                            purpose="batch")
            with pytest.raises(openai.RateLimitError):
                await acme.batches.create(input_file_id=heavy.id, endpoint="/v1/completions", completion_window="24h")
            assert [b.status async for b in acme.batches.list()] == ["failed", "failed"]  # nothing ran

    asyncio.run(scenario())


def test_cancel_keeps_finished_results_and_expiry_fails_the_rest(demo_dir, tmp_path):
    url, server = _server(demo_dir, tmp_path, batch_max_inflight=1, batch_completion_window_s=600)

    async def scenario():
        keys = await _tenants(url)
        async with server:
            acme = _client(server, keys["acme"])
            lines = [_line(f"c{i}", f"cancel me {i}", 12) for i in range(30)]
            f = await acme.files.create(file=("c.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
            b = await acme.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
            while (await acme.batches.retrieve(b.id)).request_counts.completed < 2:
                await asyncio.sleep(0.05)
            cancelling = await acme.batches.cancel(b.id)
            assert cancelling.status in ("cancelling", "cancelled")
            done = await _wait(acme, b.id)
            assert done.status == "cancelled" and done.cancelled_at
            kept = [json.loads(l) for l in (await acme.files.content(done.output_file_id)).text.splitlines()]
            errors = [json.loads(l) for l in (await acme.files.content(done.error_file_id)).text.splitlines()]
            assert len(kept) == done.request_counts.completed >= 2
            assert all(e["error"]["code"] == "batch_cancelled" and e["response"] is None for e in errors)
            assert sorted(x["custom_id"] for x in kept + errors) == sorted(l["custom_id"] for l in lines)
            assert len(errors) >= 30 - 2 - 1 - 1  # at most the lines in flight at cancel time also finished
            assert (await acme.batches.cancel(b.id)).status == "cancelled"  # cancelling again changes nothing

    asyncio.run(scenario())

    (tmp_path / "expiry").mkdir()
    url2, server2 = _server(demo_dir, tmp_path / "expiry", batch_max_inflight=1, batch_completion_window_s=1.5)

    async def expiry():
        keys = await _tenants(url2)
        async with server2:
            acme = _client(server2, keys["acme"])
            lines = [_line(f"e{i}", f"expire me {i}", 24) for i in range(40)]
            f = await acme.files.create(file=("e.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
            b = await acme.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
            done = await _wait(acme, b.id)
            assert done.status == "expired" and done.expired_at
            errors = [json.loads(l) for l in (await acme.files.content(done.error_file_id)).text.splitlines()]
            assert errors and all(e["error"]["code"] == "batch_expired" for e in errors)
            assert len(errors) + done.request_counts.completed == 40
            with pytest.raises(openai.BadRequestError):
                await acme.batches.cancel(b.id)  # a finished batch cannot be cancelled

    asyncio.run(expiry())


def test_expiry_policies_the_openai_client_sends(demo_dir, tmp_path):
    """``output_expires_after`` on batch create and ``expires_after`` on upload, as the openai client sends them
    (JSON, and multipart fields ``expires_after[anchor]`` / ``expires_after[seconds]``): taken within OpenAI's
    bounds (anchor created_at, 3600 to 2592000 seconds) and the batch runs; anything else is a 400 naming the
    field. Files here are kept until deleted, so no file reports an expiry. ``seconds`` written as a whole-number
    float (``3600.0``) is taken for both, as integers are in every JSON body; a fraction is refused."""
    url, server = _server(demo_dir, tmp_path)
    seconds = random.randint(3600, 2592000)

    async def scenario():
        keys = await _tenants(url)
        async with server:
            acme = _client(server, keys["acme"])
            data = _jsonl([_line("x", f"expiry {random.randrange(10**6)}", 2)])
            f = await acme.files.create(file=("x.jsonl", io.BytesIO(data)), purpose="batch",
                                        expires_after={"anchor": "created_at", "seconds": seconds})
            assert f.expires_at is None and (await acme.files.content(f.id)).content == data
            g = await acme.files.create(file=("g.jsonl", io.BytesIO(data)), purpose="batch",
                                        expires_after={"anchor": "created_at", "seconds": float(seconds)})
            refused = {}
            for name, policy in (("anchor", {"anchor": "last_active_at", "seconds": seconds}),
                                 ("low", {"anchor": "created_at", "seconds": 3599}),
                                 ("fraction", {"anchor": "created_at", "seconds": seconds + 0.5}),
                                 ("high", {"anchor": "created_at", "seconds": 2592001}),
                                 ("missing", {"seconds": seconds})):
                with pytest.raises(openai.BadRequestError) as err:
                    await acme.files.create(file=("y.jsonl", io.BytesIO(data)), purpose="batch",
                                            expires_after=policy)
                refused["upload " + name] = err.value.body
                with pytest.raises(openai.BadRequestError) as err:
                    await acme.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                              completion_window="24h", output_expires_after=policy)
                refused["batch " + name] = err.value.body
            with pytest.raises(openai.BadRequestError) as err:
                await acme.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                                          extra_body={"output_expires_after": {"anchor": "created_at",
                                                                               "seconds": str(seconds)}})
            refused["batch text"] = err.value.body
            assert sorted([x.id async for x in acme.files.list()]) == sorted([f.id, g.id])  # no refused one stored
            batch = await acme.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                                              output_expires_after={"anchor": "created_at", "seconds": seconds})
            done = await _wait(acme, batch.id)
            output = await acme.files.retrieve(done.output_file_id)
            batch = await acme.batches.create(input_file_id=g.id, endpoint="/v1/completions", completion_window="24h",
                                              output_expires_after={"anchor": "created_at", "seconds": float(seconds)})
            return refused, [done, await _wait(acme, batch.id)], output

    refused, done, output = asyncio.run(scenario())
    assert all(d.status == "completed" and d.request_counts.completed == 1 for d in done) and output.expires_at is None
    for where, field in (("upload", "expires_after"), ("batch", "output_expires_after")):
        for name, part in (("anchor", "anchor"), ("low", "seconds"), ("high", "seconds"), ("missing", "anchor"),
                           ("fraction", "seconds")):
            body = refused[f"{where} {name}"]
            assert body["param"] == f"{field}.{part}", (where, name, body)
        assert "3600" in refused[f"{where} low"]["message"] and "2592000" in refused[f"{where} high"]["message"]
        assert "created_at" in refused[f"{where} anchor"]["message"], refused[f"{where} anchor"]
    assert refused["batch text"]["param"] == "output_expires_after.seconds"


def test_upload_form_fields_are_the_clients_only(demo_dir, tmp_path):
    """An upload takes the multipart fields the openai client's ``files.create`` sends (``file``, ``purpose``,
    ``expires_after[anchor]``, ``expires_after[seconds]``) and nothing else: another field (sent with the
    client's ``extra_body``, or by hand), a part without a name, or a field given twice is a 400 naming it, and
    nothing is stored."""
    import inspect

    import aiohttp

    sent = set(inspect.signature(openai.resources.files.AsyncFiles.create).parameters) - {
        "self", "extra_headers", "extra_query", "extra_body", "timeout"}
    assert sent == {"file", "purpose", "expires_after"}, sent  # the fields the server takes, in the client's terms
    url, server = _server(demo_dir, tmp_path)
    data = _jsonl([_line("x", f"fields {random.randrange(10**6)}", 2)])
    extra = random.choice(["filename", "expires_at", "mime_type", f"x_{random.randrange(10**6)}"])

    async def scenario():
        keys = await _tenants(url)
        async with server:
            acme = _client(server, keys["acme"])
            plain = await acme.files.create(file=("a.jsonl", io.BytesIO(data)), purpose="batch")
            timed = await acme.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch",
                                            expires_after={"anchor": "created_at", "seconds": 3600})
            refused = {}
            with pytest.raises(openai.BadRequestError) as err:
                await acme.files.create(file=("c.jsonl", io.BytesIO(data)), purpose="batch",
                                        extra_body={extra: "1"})
            refused["client"] = err.value.body
            headers = {"Authorization": f"Bearer {keys['acme']}"}
            async with aiohttp.ClientSession(headers=headers) as http:
                for name, fields in (
                        ("unknown", [("purpose", "batch", None), ("Purpose", "batch", None),
                                     ("file", data, "d.jsonl")]),
                        ("nameless", [("purpose", "batch", None), (None, "x", None), ("file", data, "e.jsonl")]),
                        ("twice", [("purpose", "batch", None), ("file", data, "f.jsonl"), ("file", data, "g.jsonl")]),
                        ("purpose twice", [("purpose", "batch", None), ("purpose", "batch", None),
                                           ("file", data, "h.jsonl")])):
                    # Written by hand: aiohttp's own form writer refuses a part without a name.
                    body = b"".join(b"--B0undary\r\nContent-Disposition: form-data" + (
                        f'; name="{field}"' if field else "").encode() + (
                        f'; filename="{filename}"' if filename else "").encode() + b"\r\n\r\n" + (
                        value if isinstance(value, bytes) else value.encode()) + b"\r\n"
                        for field, value, filename in fields) + b"--B0undary--\r\n"
                    async with http.post(server.make_url("/v1/files"), data=body, headers={
                            "Content-Type": "multipart/form-data; boundary=B0undary"}) as r:
                        refused[name] = (r.status, (await r.json())["error"])
            stored = sorted([x.id async for x in acme.files.list()])
            return plain, timed, refused, stored

    plain, timed, refused, stored = asyncio.run(scenario())
    assert stored == sorted([plain.id, timed.id])  # no refused upload was stored
    assert refused["client"]["param"] == extra and extra in refused["client"]["message"], refused["client"]
    assert refused["unknown"] == (400, refused["unknown"][1]) and refused["unknown"][1]["param"] == "Purpose"
    for name, param in (("nameless", None), ("twice", "file"), ("purpose twice", "purpose")):
        status, error = refused[name]
        assert status == 400 and error["param"] == param, (name, status, error)
    assert "twice" in refused["twice"][1]["message"] and "name" in refused["nameless"][1]["message"]


def test_an_oversized_upload_form_field_is_a_413_naming_it(demo_dir, tmp_path):
    """A text field of an upload (``purpose``, ``expires_after[anchor]``, ``expires_after[seconds]``, as the openai
    client sends them) longer than the server's request limit is a 413 whose ``param`` names the field (as a JSON
    body's errors name ``expires_after.seconds``), and nothing is stored; the file itself may be larger."""
    limit = random.randint(1024, 4096)
    url, server = _server(demo_dir, tmp_path, max_request_bytes=limit)
    data = _jsonl([_line(f"x{i}", f"big field {random.randrange(10**6)}", 2) for i in range(limit // 80 + 2)])
    assert len(data) > limit
    big = "b" * random.randint(limit + 1, 3 * limit)
    cases = {"purpose": {"purpose": big},
             "expires_after.anchor": {"purpose": "batch", "expires_after": {"anchor": big, "seconds": 3600}},
             "expires_after.seconds": {"purpose": "batch", "expires_after": {"anchor": "created_at",
                                                                             "seconds": "9" * len(big)}}}

    async def scenario():
        keys = await _tenants(url)
        async with server:
            acme = _client(server, keys["acme"])
            kept = await acme.files.create(file=("a.jsonl", io.BytesIO(data)), purpose="batch")
            refused = {}
            for field, fields in random.sample(list(cases.items()), len(cases)):
                with pytest.raises(openai.APIStatusError) as err:
                    await acme.files.create(file=("b.jsonl", io.BytesIO(data)), **fields)
                refused[field] = err.value
            return kept, refused, [x.id async for x in acme.files.list()]

    kept, refused, stored = asyncio.run(scenario())
    for field, err in refused.items():
        assert err.status_code == 413 and err.body["param"] == field, (field, err.body)
        assert str(limit) in err.body["message"], err.body
    assert stored == [kept.id]


def test_upload_with_a_nested_multipart_part_is_a_400(demo_dir, tmp_path):
    """A part of the upload's form that is itself a multipart body (``multipart/mixed``, as old HTML forms sent
    several files under one field) is no field the upload takes: a 400 naming its field, not a 500, and nothing
    is stored."""
    import aiohttp

    url, server = _server(demo_dir, tmp_path)
    data = _jsonl([_line("x", f"nested {random.randrange(10**6)}", 2)])
    field = random.choice(["file", "purpose"])
    body = (b'--OUTER\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b"--OUTER\r\nContent-Type: multipart/mixed; boundary=INNER\r\n"
            b'Content-Disposition: form-data; name="' + field.encode() + b'"\r\n\r\n'
            b'--INNER\r\nContent-Disposition: file; filename="a.jsonl"\r\n\r\n' + data + b"\r\n--INNER--\r\n"
            b"\r\n--OUTER--\r\n")

    async def scenario():
        keys = await _tenants(url)
        async with server:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {keys['acme']}"}) as http:
                async with http.post(server.make_url("/v1/files"), data=body, headers={
                        "Content-Type": "multipart/form-data; boundary=OUTER"}) as r:
                    refused = r.status, (await r.json())["error"]
            return refused, [x.id async for x in _client(server, keys["acme"]).files.list()]

    (status, error), stored = asyncio.run(scenario())
    assert status == 400 and error["param"] == field and "multipart" in error["message"], (status, error)
    assert stored == []


def test_chat_batch_answers_what_live_chat_answers(demo_dir, tmp_path):
    rng = random.Random()
    url, server = _server(demo_dir, tmp_path)

    async def scenario():
        keys = await _tenants(url)
        async with server:
            acme = _client(server, keys["acme"])
            lines = [_line(f"chat-{i}", f"question {rng.randrange(10**6)} about {i}", rng.randint(2, 6),
                           url="/v1/chat/completions") for i in range(4)]
            f = await acme.files.create(file=("chat.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
            batch = await acme.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                              completion_window="24h")
            done = await _wait(acme, batch.id)
            assert done.status == "completed" and done.request_counts.completed == 4, done
            out = {o["custom_id"]: o for o in
                   (json.loads(l) for l in (await acme.files.content(done.output_file_id)).text.splitlines())}
            assert set(out) == {l["custom_id"] for l in lines}
            for line in lines:
                body = dict(line["body"])
                live = await acme.chat.completions.create(extra_body={"ignore_eos": body.pop("ignore_eos")}, **body)
                got = out[line["custom_id"]]["response"]
                assert got["status_code"] == 200 and got["body"]["object"] == "chat.completion"
                message = got["body"]["choices"][0]["message"]
                assert message["role"] == "assistant" and message["content"] == live.choices[0].message.content
                usage = got["body"]["usage"]  # cached_tokens differ: the live call hits the batch's prefix
                assert (usage["prompt_tokens"], usage["completion_tokens"]) == (live.usage.prompt_tokens,
                                                                                line["body"]["max_tokens"])

    asyncio.run(scenario())


def test_names_longer_than_the_database_keeps_are_a_400(demo_dir, tmp_path):
    """A custom_id or a file name past what the database's column holds (512 characters): PostgreSQL refused the
    write, which the client saw as a 503 'database unavailable, retry' it could retry forever (SQLite kept it);
    now a validation error naming the line and ``custom_id``, and a 400 naming ``file``, on either backend."""
    url, server = _server(demo_dir, tmp_path)
    longest = "é" * 512  # characters, not bytes, as PostgreSQL's varchar counts them
    too_long = "c" * random.randrange(513, 2000)

    async def scenario():
        keys = await _tenants(url)
        async with server:
            acme = _client(server, keys["acme"])
            data = _jsonl([_line(longest, "hello", 1), _line(too_long, "hello", 1)])
            f = await acme.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
            b = await acme.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
            assert b.status == "failed" and b.request_counts.total == 0
            assert [(e.code, e.line, e.param) for e in b.errors.data] == [("invalid_custom_id", 2, "custom_id")]
            assert "512" in b.errors.data[0].message
            ok = await acme.files.create(file=("in.jsonl", io.BytesIO(_jsonl([_line(longest, "hello", 1)]))),
                                         purpose="batch")
            assert (await acme.batches.create(input_file_id=ok.id, endpoint="/v1/completions",
                                              completion_window="24h")).status == "in_progress"

            named = await acme.files.create(file=(longest, io.BytesIO(data)), purpose="batch")
            assert named.filename == longest
            before = [f.id async for f in acme.files.list()]
            with pytest.raises(openai.BadRequestError) as refused:
                await acme.files.create(file=(too_long + ".jsonl", io.BytesIO(data)), purpose="batch")
            assert refused.value.body["param"] == "file" and "rename" in refused.value.body["message"]
            assert [f.id async for f in acme.files.list()] == before  # nothing stored

    asyncio.run(scenario())


def test_a_large_input_file_is_checked_off_the_event_loop(demo_dir, tmp_path):
    """Checking every line of a large input file took the event loop (every other tenant's streams) about 80 us a
    line, seconds for the 50,000 lines a batch may hold; it runs on a worker thread. The file's last line names
    another model, so the whole file is read and the batch fails validation with that line, and nothing runs."""
    url, server = _server(demo_dir, tmp_path, batch_max_lines=50_000, batch_max_file_bytes=64 * 2**20)
    count = random.randrange(12_000, 15_000)
    lines = [_line(f"c{i}", "hello there " * 60, 2, url="/v1/chat/completions") for i in range(count)]
    lines[-1]["body"]["model"] = "elsewhere"

    async def scenario():
        keys = await _tenants(url)
        async with server:
            acme = _client(server, keys["acme"])
            f = await acme.files.create(file=("big.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
            return await loop_lag_while(acme.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                            completion_window="24h"))

    worst, b = asyncio.run(scenario())
    assert b.status == "failed" and b.request_counts.total == 0
    assert [(e.code, e.line) for e in b.errors.data] == [("mismatched_model", count), ("model_not_found", count)]
    assert worst < 0.2, f"the event loop was held {worst:.2f} s"
