"""A tenant's image limits (its quota's ``max_images_per_request`` and ``max_image_pixels``) hold for its Batch API
lines as for its live requests: in one batch of chat lines to a tiny random Qwen3-VL-MoE, each line over a limit is
that line's 400 (in the error file, naming the content part, the limit and that it is the tenant's), exactly where
a plain min() of the server's and the tenant's limits says (``image_limit_cases._verdict``), and every other line
is served, with the tokens the live API gives the same chat."""

import json
import random

import openai
import pytest
import torch

from gateway.image_policy import IMAGE_LIMITS
from tests.gateway.batch_runs import run_chat_batch
from tests.gateway.image_limit_cases import _messages, _verdict
from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key
from tests.gateway.test_chat_images import SERVED_ENGINE, with_tokenizer

pytestmark = pytest.mark.timeout(120)
QUOTA = dict(max_images_per_request=1, max_image_pixels=400)
MAX_NEW = 3


def test_batch_lines_over_the_tenants_image_limits_fail_alone(tmp_path, qwen3_vl_checkpoint):
    shared, _, seed = qwen3_vl_checkpoint
    path, _ = with_tokenizer(tmp_path, shared)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    # each limit's edges (400 pixels, 1 image), a text-only line, then random counts and sizes
    cases = {"one": [(16, 16)], "edge": [(20, 20)], "wide": [(21, 20)], "two": [(16, 16)] * 2, "text": []}
    cases |= {f"random-{i}": [(rng.randint(12, 30), rng.randint(12, 30)) for _ in range(rng.randint(1, 2))]
              for i in range(3)}
    with in_process_server(tmp_path, SERVED_ENGINE, checkpoint=path) as srv:
        key = srv.run(new_tenant_key(srv.database_url, "tight", **QUOTA))
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0)
        server = srv.server.app[IMAGE_LIMITS]
        bodies = {cid: {"model": "demo", "messages": _messages(gen, sizes) if sizes else
                        [{"role": "user", "content": "see"}], "max_tokens": MAX_NEW, "temperature": 0,
                        "ignore_eos": True} for cid, sizes in cases.items()}
        out = srv.run(run_chat_batch(client, [json.dumps({"custom_id": cid, "method": "POST",
                                                          "url": "/v1/chat/completions", "body": body})
                                              for cid, body in bodies.items()]))
        assert set(out) == set(cases)
        served = 0
        for cid, sizes in cases.items():
            want, got = _verdict(server, QUOTA, sizes), out[cid]
            where = f"seed={seed} {cid} {sizes}"
            if want is None:
                assert got["status_code"] == 200, (where, got)
                ask = {k: v for k, v in bodies[cid].items() if k != "ignore_eos"}
                live = srv.run(client.chat.completions.create(**ask, extra_body={"ignore_eos": True}))
                body = got["body"]
                assert body["choices"][0]["message"]["content"] == live.choices[0].message.content, where
                assert body["usage"]["prompt_tokens"] == live.usage.prompt_tokens, where
                served += 1
                continue
            at, limit, whose, code = want
            assert got["status_code"] == 400, (where, got)
            error = got["body"]["error"]
            part = f"messages[0].content[{at + 1}]"
            assert (error["param"], error["code"]) == (part, code), (where, error)
            assert error["message"].startswith(part + ": ") and f"{limit:,}" in error["message"], (where, error)
            assert whose == "tenant" and "this API key's tenant's limit" in error["message"], (where, error)
        assert 2 <= served < len(cases)
