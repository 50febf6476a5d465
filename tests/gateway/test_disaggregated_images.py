"""A chat with an image to a server with disaggregated prefill and decode (a prefill and a decode engine on a tiny
random Qwen3-VL-MoE, the layout ``moegate serve --prefill-replicas 1 --decode-replicas 1`` builds) is refused as
``docs/models.md`` says: a 400 with ``param: "messages"`` and the reason, through the official ``openai`` client,
and neither engine is sent the request. A text-only chat is served by the same server."""

import dataclasses
import random

import openai
import pytest
import torch

from engine.serving.async_engine import AsyncEngine
from gateway.disaggregation import DisaggregatedEngines
from tests.engine.vision.qwen3_vl_checkpoint import random_image
from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key
from tests.gateway.test_chat_images import SERVED_ENGINE, data_url, with_tokenizer

pytestmark = pytest.mark.timeout(120)
REFUSAL = ("images are not served with disaggregated prefill and decode; send this request to a server that runs "
           "both")


def _prefill_and_decode(config):
    return DisaggregatedEngines([AsyncEngine(dataclasses.replace(config, role="prefill"))],
                                [AsyncEngine(dataclasses.replace(config, role="decode"))])


def test_an_image_chat_is_refused_before_any_engine(tmp_path, qwen3_vl_checkpoint):
    shared, _, seed = qwen3_vl_checkpoint
    path, _ = with_tokenizer(tmp_path, shared)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    with in_process_server(tmp_path, SERVED_ENGINE, checkpoint=path, engines=_prefill_and_decode) as srv:
        sent: list[str] = []  # the engine each request reached
        for e in srv.engine.replicas:
            def recording(*args, _e=e, _generate=e.generate, **kwargs):
                sent.append(_e.config.role)
                return _generate(*args, **kwargs)
            e.generate = recording
        key = srv.run(new_tenant_key(srv.database_url))
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0)
        picture = random_image(gen, rng.randint(12, 40), rng.randint(12, 40))
        content = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": data_url(picture)}}]
        with pytest.raises(openai.BadRequestError) as refused:
            srv.run(client.chat.completions.create(model="demo", max_tokens=2,
                                                   messages=[{"role": "user", "content": content}]))
        assert refused.value.status_code == 400
        error = refused.value.body
        assert error["message"] == REFUSAL and error["param"] == "messages", error
        assert sent == [], "an engine was sent the refused request"
        # the same server serves text (a short prompt: its decode engine computes it)
        reply = srv.run(client.chat.completions.create(model="demo", max_tokens=2,
                                                       messages=[{"role": "user", "content": "Hi"}]))
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 2
        assert sent == ["decode"]
