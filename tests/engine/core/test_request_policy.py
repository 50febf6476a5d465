"""RequestPolicy crosses the engine's pipe unchanged and is checked again on the far side; the gateway builds it
from the caller's tenant and priority class."""

import datetime
import random
import secrets

import msgspec
import pytest

from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.serving.protocol import AddRequest, encoder, to_engine_decoder
from gateway.auth import Principal
from tenants.policy import PREEMPT_GRACE_SHARE, ClassInfo
from tenants.store import TenantInfo


def _random_policy(rng: random.Random) -> RequestPolicy:
    return RequestPolicy(priority=rng.randint(0, 5), order_in_class=rng.randint(0, 9), tenant=f"t{rng.random()}",
                         weight=rng.uniform(0.1, 8), preemptible=rng.random() < 0.5, may_preempt=rng.random() < 0.5,
                         background=rng.random() < 0.5, cache_salt=rng.choice([None, f"s{rng.random()}"]),
                         cache_share=rng.choice([None, rng.uniform(0.01, 1)]),
                         preempt_grace_ms=rng.choice([None, rng.uniform(0, 500)]))


def test_policy_crosses_the_pipe_unchanged_and_is_checked_there():
    rng = random.Random()
    for _ in range(20):
        policy = _random_policy(rng)
        msg = AddRequest("r", [1, 2], SamplingParams(max_tokens=3), policy, rng.random() < 0.5)
        back = to_engine_decoder.decode(encoder.encode(msg))
        assert back == msg and back.policy == policy and back.policy is not policy
    for field, bad in (("weight", 0.0), ("priority", -1), ("order_in_class", -2), ("cache_share", 0.0),
                       ("cache_share", 1.5), ("preempt_grace_ms", -1.0)):
        with pytest.raises(ValueError, match=field):
            RequestPolicy(**{field: bad})
        wire = msgspec.msgpack.encode({"type": "AddRequest", "request_id": "r", "prompt": [1],
                                       "sampling_params": {}, "policy": {field: bad}})
        with pytest.raises(msgspec.ValidationError, match=field):
            to_engine_decoder.decode(wire)


def test_the_gateway_builds_it_from_the_tenant_and_its_class():
    rng = random.Random()
    now = datetime.datetime.now(datetime.timezone.utc)
    cls = ClassInfo("c", rng.randint(0, 4), 1.0, rng.random() < 0.5, rng.random() < 0.5)
    tenant = TenantInfo(rng.randint(1, 10**6), "acme", "c", rng.uniform(0.5, 4), "active", now, now)
    salt = secrets.token_hex(32)
    principal = Principal(tenant, None, cls, salt)  # type: ignore[arg-type]  # the key plays no part
    order = rng.randint(0, 9)
    assert principal.policy(order) == RequestPolicy(
        priority=cls.priority, order_in_class=order, tenant=str(tenant.id), weight=tenant.weight,
        preemptible=cls.preemptible, may_preempt=cls.may_preempt, background=False, cache_salt=salt)
    share = rng.uniform(0.01, 1)
    assert principal.policy(order, cache_share=share).cache_share == share


def test_a_class_with_a_first_token_objective_gives_its_requests_a_grace_before_preempting():
    rng = random.Random()
    now = datetime.datetime.now(datetime.timezone.utc)
    tenant = TenantInfo(rng.randint(1, 10**6), "acme", "c", 1.0, "active", now, now)
    ttft = rng.randint(1, 5000)
    for cls, grace in ((ClassInfo("c", 0, 1.0, True, True, ttft_slo_ms=ttft), PREEMPT_GRACE_SHARE * ttft),
                       (ClassInfo("c", 0, 1.0, True, True, itl_slo_ms=ttft), None),
                       (ClassInfo("c", 0, 1.0, True, True), None)):
        principal = Principal(tenant, None, cls, "salt")  # type: ignore[arg-type]  # the key plays no part
        assert principal.policy().preempt_grace_ms == grace
