"""The HTTP client against the stub: timings match the stub's known delays, failures are recorded as what they are."""

import asyncio
import statistics
import time

import aiohttp
from aiohttp.test_utils import TestServer

from loadgen.client import RequestOptions, Target, retry_after_seconds, send_request
from loadgen.datasets import RequestSpec
from loadgen.records import RequestRecord
from tests.loadgen.stub_server import Behaviour, StubState, make_app


def _send_all(behaviours: dict[str, Behaviour], calls: list[tuple[str, RequestSpec, RequestOptions]]):
    """Run the calls concurrently against a fresh stub; returns (records, stub state)."""
    state = StubState(behaviours)

    async def go():
        async with TestServer(make_app(state), host="127.0.0.1") as server, aiohttp.ClientSession() as session:
            start = time.monotonic()
            clock = lambda: time.monotonic() - start  # noqa: E731
            base = str(server.make_url("/v1"))
            records = [RequestRecord(i, key) for i, (key, _, _) in enumerate(calls)]
            await asyncio.gather(*(send_request(session, Target(base, key), spec, opts, rec, clock)
                                   for (key, spec, opts), rec in zip(calls, records)))
            return records

    return asyncio.run(go()), state


SPEC = RequestSpec("one two three four", 4, 10)


def test_ttft_itl_tpot_match_the_stub_delays():
    b = Behaviour(first_token_s=0.1, interval_s=0.02)
    records, _ = _send_all({"k": b}, [("k", SPEC, RequestOptions())] * 4)
    for r in records:
        assert r.ok and r.status == 200 and r.error is None, r
        assert r.usage_source == "usage" and r.completion_tokens == 10 and r.prompt_tokens == 4
        assert 0.095 <= r.ttft_s <= 0.2, r.ttft_s
        assert len(r.itl_s) == 9
        assert 0.018 <= statistics.median(r.itl_s) <= 0.04, r.itl_s
        assert 0.018 <= r.tpot_s <= 0.04
        assert abs(r.e2e_s - (r.ttft_s + sum(r.itl_s))) < 0.01  # the last chunk ends the request
        assert 0.27 <= r.e2e_s <= 0.4


def test_non_streaming_ttft_is_the_whole_response_and_chat_is_parsed():
    b = Behaviour(first_token_s=0.05, interval_s=0.01)
    records, state = _send_all({"k": b}, [("k", SPEC, RequestOptions(stream=False)),
                                          ("k", RequestSpec("hi there", 2, 5, system="be brief"), RequestOptions(api="chat"))])
    plain, chat = records
    assert plain.ok and plain.itl_s == [] and plain.completion_tokens == 10
    assert abs(plain.ttft_s - plain.e2e_s) < 0.005 and 0.14 <= plain.e2e_s <= 0.25  # 0.05 + 9 * 0.01
    assert chat.ok and chat.completion_tokens == 5 and len(chat.itl_s) == 4 and chat.prompt_tokens == 4
    sent = {("chat" if "messages" in body else "completion"): body for _, body in state.bodies}
    assert sent["chat"]["messages"][0] == {"role": "system", "content": "be brief"}
    assert sent["chat"]["stream_options"] == {"include_usage": True} and "stream" not in sent["completion"]


def test_tokens_counted_from_chunks_without_usage_and_from_usage_with_multi_token_chunks():
    records, _ = _send_all({"plain": Behaviour(usage=False), "multi": Behaviour(multi_token_chunks=3, cached_tokens=2)},
                           [("plain", SPEC, RequestOptions()), ("multi", SPEC, RequestOptions())])
    plain, multi = records
    assert plain.ok and plain.usage_source == "chunks" and plain.completion_tokens == 10 and plain.prompt_tokens is None
    assert multi.ok and multi.usage_source == "usage" and multi.completion_tokens == 10 and multi.cached_tokens == 2
    assert len(multi.itl_s) == 3  # 4 chunks of up to 3 tokens


def test_errors_429_retry_after_and_dropped_streams():
    behaviours = {
        "down": Behaviour(status=500),
        "limited": Behaviour(status=429, retry_after="7"),
        "retry": Behaviour(reject_first=2, retry_after_ms="150", retry_after="1"),
        "cut": Behaviour(interval_s=0.01, cut_after=3),
        "sse": Behaviour(sse_error_after=2),
    }
    honour = RequestOptions(honour_retry_after=True)
    records, state = _send_all(behaviours, [("down", SPEC, RequestOptions()), ("limited", SPEC, RequestOptions()),
                                            ("retry", SPEC, honour), ("cut", SPEC, RequestOptions()),
                                            ("sse", SPEC, RequestOptions())])
    down, limited, retry, cut, sse = records
    assert not down.ok and down.status == 500 and "stub_500" in down.error and down.retry_after_s == []
    assert not limited.ok and limited.status == 429 and limited.retry_after_s == [7.0] and limited.retries == 0
    # Honoured: two 429s (retry-after-ms wins over Retry-After), then a success; latency includes the waits.
    assert retry.ok and retry.retries == 2 and retry.retry_after_s == [0.15, 0.15] and retry.attempt_statuses == [429, 429, 200]
    assert retry.ttft_s >= 0.3 and state.seen["retry"] == 3
    assert not cut.ok and cut.status == 200 and cut.completion_tokens == 3 and cut.error
    assert cut.e2e_s is None and cut.tpot_s is None  # a failed request has no e2e/tpot
    assert not sse.ok and "engine_unavailable" in sse.error and sse.completion_tokens == 2


def test_retries_stop_at_max_retries():
    records, state = _send_all({"k": Behaviour(status=503, retry_after="0")},
                               [("k", SPEC, RequestOptions(honour_retry_after=True, max_retries=2))])
    (r,) = records
    assert not r.ok and r.status == 503 and r.retries == 2 and state.seen["k"] == 3 and r.attempt_statuses == [503] * 3


def test_connection_refused_and_timeout_are_records_not_exceptions():
    async def go():
        async with aiohttp.ClientSession() as session:
            # Port 9 (discard) on loopback: nothing listens there in a test box.
            r = RequestRecord(0, "t")
            await send_request(session, Target("http://127.0.0.1:9/v1"), SPEC, RequestOptions(), r, time.monotonic)
            return r

    r = asyncio.run(go())
    assert not r.ok and r.status == 0 and r.error and r.end_s is not None

    records, _ = _send_all({"slow": Behaviour(first_token_s=2.0)}, [("slow", SPEC, RequestOptions(timeout_s=0.2))])
    assert not records[0].ok and "timeout" in records[0].error


def test_retry_after_header_forms():
    assert retry_after_seconds({"Retry-After": "3"}) == 3.0
    assert retry_after_seconds({"retry-after-ms": "250", "Retry-After": "3"}) == 0.25
    assert retry_after_seconds({}) is None
    assert retry_after_seconds({"Retry-After": "soon"}) is None
    import email.utils

    date = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= retry_after_seconds({"Retry-After": date}) <= 31
