"""LoRA adapters through the HTTP API (official `openai` client, in-process server on the demo checkpoint): an
adapter registered with ``moegate admin adapter add`` is a ``model`` its owner and the tenants granted it may use,
with transformers + PEFT's greedy tokens; for anyone else it is the unknown-model 404. /v1/models, usage rows,
/metrics and grants that change while the server runs."""

import asyncio
import io
import json
import random
import time

import openai
import pytest
import torch

from gateway.cli import main as moegate
from gateway.metrics import METRICS
from tenants.store import TenantStore
from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(300)

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
POLICY_TTL_S = 0.3  # how long a grant or revoke takes to apply (the gateway's policy cache)
ADMIN_TOKEN = "operator-" + "".join(random.choices("abcdef0123456789", k=16))


def _make_adapter(base_dir: str, out_dir: str, rank: int = 4) -> None:
    """A PEFT adapter on attention and the routed experts with random, non-zero A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(random.randrange(2**31))
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(init_lora_weights=False, r=rank, lora_alpha=4 * rank, target_modules=["q_proj", "v_proj", "o_proj"],
                        target_parameters=EXPERTS)
    get_peft_model(model, config).save_pretrained(out_dir)


async def _admin(root: str, path: str, body: dict, token: str | None = ADMIN_TOKEN) -> tuple[int, dict]:
    """POST ``body`` to the admin endpoint ``path`` of the server at ``root``: (status, JSON answer)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http:
        async with http.post(root + path, json=body, headers=headers) as r:
            return r.status, await r.json()


async def _adapter_names(database_url: str) -> list[str]:
    """The adapters the policy database holds, by name."""
    from tenants.adapters import AdapterStore

    store = TenantStore.open(database_url)
    try:
        return [a.name for a in await AdapterStore(store).list()]
    finally:
        await store.close()


def _token_ids(choice) -> list[int]:
    """A completion choice's token ids (asked with ``return_tokens_as_token_ids``)."""
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server, the tenants' clients and two adapters: ``support`` (owned by "owner", granted to "granted"),
    added to the database before the start, and ``pinned`` (owned by "pinner"), also named in the engine's own
    configuration (``lora_adapters``), so the engine serves it from its start."""
    root = tmp_path_factory.mktemp("lora_api")
    adapter_dir, pinned_dir = str(root / "support"), str(root / "pinned")
    keys = {}

    def before_start(demo: str, url: str) -> None:
        _make_adapter(demo, adapter_dir)
        _make_adapter(demo, pinned_dir)
        import asyncio

        for tenant in ("owner", "granted", "other", "pinner"):
            keys[tenant] = asyncio.run(new_tenant_key(url, tenant))
        assert moegate(["admin", "adapter", "add", "support", "--path", adapter_dir, "--tenant", "owner",
                        "--database-url", url, "--json"]) == 0
        assert moegate(["admin", "adapter", "grant", "support", "granted", "--database-url", url, "--json"]) == 0
        assert moegate(["admin", "adapter", "add", "pinned", "--path", pinned_dir, "--tenant", "pinner",
                        "--database-url", url, "--json"]) == 0

    with in_process_server(root, dict(dtype="float32", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=256, max_loras=2, max_lora_rank=8,
                                      lora_adapters=f"pinned={pinned_dir}"),
                           gateway=dict(policy_cache_ttl_s=POLICY_TTL_S, auth_cache_ttl_s=POLICY_TTL_S,
                                        batch_poll_s=0.05, admin_token=ADMIN_TOKEN),
                           before_start=before_start) as srv:
        clients = {t: openai.AsyncOpenAI(base_url=srv.base_url, api_key=k, max_retries=0) for t, k in keys.items()}
        yield srv, clients, adapter_dir, pinned_dir
        for c in clients.values():
            srv.run(c.close())


def test_granted_adapter_matches_peft_and_others_get_404(served, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    srv, clients, adapter_dir, _ = served
    base_hf = AutoModelForCausalLM.from_pretrained(srv.demo, dtype=torch.float32).eval()
    rng = random.Random()
    prompt = [rng.randrange(3, base_hf.config.vocab_size) for _ in range(rng.randint(8, 30))]
    want_base = _greedy(base_hf, prompt, 8)
    ref = PeftModel.from_pretrained(base_hf, adapter_dir).eval()
    want_adapter = _greedy(ref, prompt, 8)
    assert want_adapter != want_base  # the adapter changes the greedy tokens: a base-model answer would fail below

    async def complete(client, model):
        return await client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                               extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})

    for tenant in ("owner", "granted"):
        answer = srv.run(complete(clients[tenant], "support"))
        assert answer.model == "support" and _token_ids(answer.choices[0]) == want_adapter, tenant
    base = srv.run(complete(clients["granted"], "demo"))
    assert base.model == "demo" and _token_ids(base.choices[0]) == want_base

    # Streaming chat under the adapter echoes its name in every chunk.
    async def chat(client):
        stream = await client.chat.completions.create(model="support", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4, stream=True)
        return [c async for c in stream]
    chunks = srv.run(chat(clients["granted"]))
    assert chunks and {c.model for c in chunks} == {"support"}

    # Not granted: the very 404 of a model that does not exist (the name aside).
    with pytest.raises(openai.NotFoundError) as refused:
        srv.run(complete(clients["other"], "support"))
    with pytest.raises(openai.NotFoundError) as unknown:
        srv.run(complete(clients["other"], "no-such-model"))
    assert refused.value.body == {**unknown.value.body,
                                  "message": unknown.value.body["message"].replace("no-such-model", "support")}
    assert refused.value.body["code"] == "model_not_found" and refused.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        srv.run(clients["other"].models.retrieve("support"))

    # /v1/models: the base model and the adapters this tenant may use (parent: the base model).
    for tenant, expected in (("owner", ["demo", "support"]), ("granted", ["demo", "support"]), ("other", ["demo"])):
        listed = srv.run(clients[tenant].models.list()).data
        assert [m.id for m in listed] == expected, tenant
        assert all(getattr(m, "parent", None) == ("demo" if m.id == "support" else None) for m in listed)
    assert srv.run(clients["granted"].models.retrieve("support")).parent == "demo"

    # Usage rows carry the adapter; /metrics counts requests and tokens per adapter.
    async def usage_by_adapter():
        store = TenantStore.open(srv.database_url)
        try:
            return await store.usage_summary(by="adapter")
        finally:
            await store.close()
    deadline = time.monotonic() + 10
    while True:
        rows = {r["adapter"]: r for r in srv.run(usage_by_adapter()) if r["kind"] == "live"}
        if rows.get("support", {}).get("requests") == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert rows["support"]["requests"] == 3 and 16 < rows["support"]["completion_tokens"] <= 16 + 4
    assert rows["support"]["prompt_tokens"] >= 2 * len(prompt) and rows[None]["requests"] >= 1
    metrics = srv.server.app[METRICS]
    assert metrics.adapter_requests.labels("support")._value.get() == 3
    assert metrics.adapter_prompt_tokens.labels("support")._value.get() == rows["support"]["prompt_tokens"]

    # The Batch API: a line naming the adapter runs under it (its body says so) and is billed to it; a tenant
    # without the grant cannot even create the batch.
    lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "support", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}}
             for i in range(2)]
    data = ("\n".join(json.dumps(line) for line in lines) + "\n").encode()

    async def batch(client):
        f = await client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        created = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while created.status not in ("completed", "failed") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            created = await client.batches.retrieve(created.id)
        if created.status != "completed":
            return created, None
        return created, [json.loads(x) for x in (await client.files.content(created.output_file_id)).text.splitlines()]
    done, out = srv.run(batch(clients["granted"]))
    assert done.status == "completed" and len(out) == 2
    tok = AutoTokenizer.from_pretrained(srv.demo)
    for line in out:
        body = line["response"]["body"]
        # The answer's text is its tokens' decode with the request's defaults (special tokens skipped); a prompt
        # of random ids may end inside a character, whose bytes the answer's text leaves to the prompt.
        assert body["model"] == "support"
        assert body["choices"][0]["text"] == tok.decode(want_adapter, skip_special_tokens=True), (prompt, want_adapter)
    refused_batch, _ = srv.run(batch(clients["other"]))
    assert refused_batch.status == "failed" and refused_batch.errors.data[0].code == "model_not_found"
    deadline = time.monotonic() + 10
    while True:
        batch_rows = [r for r in srv.run(usage_by_adapter()) if r["adapter"] == "support" and r["kind"] == "batch"]
        if (batch_rows and batch_rows[0]["requests"] == 2) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert batch_rows and batch_rows[0]["requests"] == 2 and batch_rows[0]["completion_tokens"] == 16

    # A revoke applies within the policy cache's TTL: the adapter is then unknown to that tenant.
    url = srv.database_url
    # The CLI in a thread while the server's loop runs: a usage write the loop had begun must finish, or the
    # CLI would wait on SQLite's write lock with the loop (and so the write) paused.
    assert srv.run(asyncio.to_thread(
        moegate, ["admin", "adapter", "revoke", "support", "granted", "--database-url", url, "--json"])) == 0
    time.sleep(POLICY_TTL_S * 1.5)  # a cached entry is never served past its TTL
    with pytest.raises(openai.NotFoundError):
        srv.run(complete(clients["granted"], "support"))
    capsys.readouterr()


def test_tokenize_takes_the_adapters_a_tenant_may_use(served):
    """/tokenize and /detokenize under an adapter's name (the tokenizer is the base model's, as the generation routes
    run it): the owner gets the base model's answer for a prompt, messages and ids; a tenant without the adapter gets
    the very 404 of a model that does not exist (the name aside), as on the generation routes."""
    import aiohttp

    srv, clients, _, _ = served
    rng = random.Random()
    text = "".join(rng.choice("abcdefgh XYZ.,!?") for _ in range(rng.randint(5, 40)))
    ids = [rng.randrange(3, 200) for _ in range(rng.randint(1, 12))]
    bodies = [("/tokenize", {"prompt": text}), ("/detokenize", {"tokens": ids}),
              ("/tokenize", {"messages": [{"role": "user", "content": text}], "add_generation_prompt": False})]

    async def post(tenant, path, body):
        async with aiohttp.ClientSession() as http:
            async with http.post(srv.server.make_url(path), json=body,
                                 headers={"Authorization": f"Bearer {clients[tenant].api_key}"}) as r:
                return r.status, await r.json()

    for path, body in bodies:
        status, base = srv.run(post("owner", path, {"model": "demo", **body}))
        assert status == 200, base
        assert srv.run(post("owner", path, {"model": "support", **body})) == (200, base), path
        refused = srv.run(post("other", path, {"model": "support", **body}))
        unknown = srv.run(post("other", path, {"model": "no-such-model", **body}))
        assert refused[0] == unknown[0] == 404 and refused[1]["error"] == {
            **unknown[1]["error"], "message": unknown[1]["error"]["message"].replace("no-such-model", "support")}


def test_adapter_added_while_serving(served, tmp_path):
    """``adapter add`` while the server runs: the gateway gives each engine the adapter (``add_lora``) on the first
    requests that name it, concurrent ones included, and they get transformers + PEFT's tokens. One the engine
    cannot serve (a rank above its max_lora_rank, which only the engine knows) is a one-line 400 naming
    ``model``, and the engine goes on serving."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    srv, clients, _, _ = served
    late, wide = str(tmp_path / "late"), str(tmp_path / "wide")
    _make_adapter(srv.demo, late)
    _make_adapter(srv.demo, wide, rank=16)  # the server's max_lora_rank is 8
    for name, path in (("late", late), ("wide", wide)):
        assert srv.run(asyncio.to_thread(moegate, ["admin", "adapter", "add", name, "--path", path, "--public",
                                                   "--database-url", srv.database_url, "--json"])) == 0
    time.sleep(POLICY_TTL_S * 1.5)
    rng = random.Random()
    prompt = [rng.randrange(3, 200) for _ in range(12)]

    async def complete(model):
        return await clients["other"].completions.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(srv.demo, dtype=torch.float32), late).eval()
    want = _greedy(ref, prompt, 6)
    async def concurrently():  # three first uses at once: they share the one add_lora call
        return await asyncio.gather(*(complete("late") for _ in range(3)))
    answers = srv.run(concurrently())
    for answer in answers:
        got = [int(t.removeprefix("token_id:")) for t in answer.choices[0].logprobs.tokens]
        assert answer.model == "late" and got == want
    with pytest.raises(openai.BadRequestError) as refused:
        srv.run(complete("wide"))
    body = refused.value.body
    assert body["code"] == "adapter_unavailable" and body["param"] == "model" and "\n" not in body["message"]
    assert "rank" in body["message"]
    assert srv.run(complete("demo")).model == "demo"  # the engine goes on


def test_admin_load_and_unload(served, tmp_path):
    """The admin endpoints: load registers an adapter and gives it to the engine (the next request gets
    transformers + PEFT's tokens); unload answers while a request under the adapter still streams, that request
    finishes with PEFT's tokens, new ones get the unknown-model 404 and the engine drops it. Only the admin token
    opens them; a bad directory is a 400 naming ``lora_path`` with nothing written; an unknown adapter a 404.
    An adapter removed with ``moegate admin adapter remove`` leaves the engine too."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    srv, clients, _, _ = served
    hot, spare = str(tmp_path / "hot"), str(tmp_path / "spare")
    _make_adapter(srv.demo, hot)
    _make_adapter(srv.demo, spare)
    root = str(srv.server.make_url(""))
    engine = srv.engine  # the one replica
    rng = random.Random()
    prompt = [rng.randrange(3, 200) for _ in range(10)]
    n_long = 200  # long enough to still stream when the unload answers (asserted below)
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(srv.demo, dtype=torch.float32), hot).eval()
    want = _greedy(ref, prompt, n_long)

    def admin(path, body, token=ADMIN_TOKEN):
        return _admin(root, path, body, token)

    async def complete(model, n=6, client="owner"):
        return await clients[client].completions.create(
            model=model, prompt=prompt, max_tokens=n, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})

    # Who may call: the admin token alone (a tenant's key is a 401 like no key).
    load = {"lora_name": "hot", "lora_path": hot, "tenant": "owner"}
    for token in (None, "wrong", clients["owner"].api_key):
        status, body = srv.run(admin("/admin/load_lora_adapter", load, token))
        assert status == 401 and body["error"]["code"] == "invalid_admin_token"
    # Bad input: one line naming the field, nothing written.
    before = srv.run(_adapter_names(srv.database_url))
    for bad, field in (({**load, "lora_path": str(tmp_path / "nowhere")}, "lora_path"),
                       ({**load, "lora_path": srv.demo}, "lora_path"),  # a directory, but no adapter
                       ({"lora_name": "hot", "lora_path": hot}, "tenant"),
                       ({**load, "tenant": "nobody"}, "tenant"),
                       ({**load, "rank": 4}, "rank")):
        status, body = srv.run(admin("/admin/load_lora_adapter", bad))
        assert 400 <= status < 500 and body["error"]["param"] == field and "\n" not in body["error"]["message"], bad
    assert srv.run(_adapter_names(srv.database_url)) == before
    status, body = srv.run(admin("/admin/unload_lora_adapter", {"lora_name": "no-such-adapter"}))
    assert status == 404 and body["error"]["param"] == "lora_name"

    # Load: served at once, with PEFT's tokens.
    status, body = srv.run(admin("/admin/load_lora_adapter", load))
    assert status == 200 and body["name"] == "hot" and body["engines"] == 1, body
    answer = srv.run(complete("hot"))
    assert _token_ids(answer.choices[0]) == want[:6]
    registered = engine.stats.lora_registered

    # Unload while a request under it streams: it finishes under it; new ones get the 404; the engine drops it.
    async def unload_mid_stream():
        stream = await clients["owner"].completions.create(
            model="hot", prompt=prompt, max_tokens=n_long, temperature=0, logprobs=0, stream=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        got, unloaded_at = [], None
        async for chunk in stream:
            got += [int(t.removeprefix("token_id:")) for t in chunk.choices[0].logprobs.tokens]
            if unloaded_at is None:
                status, _ = await admin("/admin/unload_lora_adapter", {"lora_name": "hot"})
                assert status == 200
                unloaded_at = len(got)
                with pytest.raises(openai.NotFoundError) as refused:
                    await complete("hot")
                assert refused.value.body["code"] == "model_not_found"
        return got, unloaded_at
    got, unloaded_at = srv.run(unload_mid_stream())
    assert unloaded_at < n_long and got == want
    srv.run(complete("demo", n=2))  # a step after the last request under it ended
    assert engine.stats.lora_registered == registered - 1 and "hot" not in srv.run(_adapter_names(srv.database_url))

    # Removed from the database by the CLI: the engine drops it within the policy TTL.
    status, _ = srv.run(admin("/admin/load_lora_adapter", {"lora_name": "spare", "lora_path": spare, "public": True}))
    assert status == 200 and srv.run(complete("spare", client="other")).model == "spare"
    registered = engine.stats.lora_registered
    # On a thread, the server's loop running meanwhile (a paused loop may hold the database).
    cli = ["admin", "adapter", "remove", "spare", "--database-url", srv.database_url, "--json"]
    assert srv.run(asyncio.to_thread(moegate, cli)) == 0

    async def dropped():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            await complete("demo", n=1)
            if engine.stats.lora_registered == registered - 1:
                return True
            await asyncio.sleep(POLICY_TTL_S / 2)
        return False
    assert srv.run(dropped())


def test_admin_load_again_from_another_directory(served, tmp_path):
    """Unload an adapter while a request under it streams, then load the name again from another directory (as a
    vLLM user swaps an adapter's weights): the next request gets transformers + PEFT's tokens for the new directory,
    on the same prompt as the streaming one (whose blocks, cached by the server, the old weights made), and the
    streaming request finishes with the old directory's tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.engine.lora.peft_reference import peft_greedy_tokens

    srv, clients, _, _ = served
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    _make_adapter(srv.demo, first)
    _make_adapter(srv.demo, second)
    root = str(srv.server.make_url(""))
    rng = random.Random()
    prompt = [rng.randrange(3, 200) for _ in range(40)]  # two full blocks of 16, cached under the first directory
    n_long, n_new = 200, 8
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(srv.demo, dtype=torch.float32), first,
                                    adapter_name="first").eval()
    ref.load_adapter(second, adapter_name="second")
    want_first = peft_greedy_tokens(ref, "first", prompt, n_long)
    want_second = peft_greedy_tokens(ref, "second", prompt, n_new)
    assert want_first[:n_new] != want_second  # an answer under the old weights would fail below

    def load(path):
        return _admin(root, "/admin/load_lora_adapter", {"lora_name": "swap", "lora_path": path, "tenant": "owner"})

    async def complete(n, stream=False):
        return await clients["owner"].completions.create(
            model="swap", prompt=prompt, max_tokens=n, temperature=0, logprobs=0, stream=stream,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})

    status, body = srv.run(load(first))
    assert status == 200, body
    assert _token_ids(srv.run(complete(n_new)).choices[0]) == want_first[:n_new]
    registered = srv.engine.stats.lora_registered  # as of that request's last step

    async def swap_mid_stream():
        got, swapped_at, new = [], None, None
        async for chunk in await complete(n_long, stream=True):
            got += _token_ids(chunk.choices[0])
            if swapped_at is None:
                swapped_at = len(got)
                status, body = await _admin(root, "/admin/unload_lora_adapter", {"lora_name": "swap"})
                assert status == 200, body
                status, body = await load(second)
                assert status == 200 and body["path"] == second and body["engines"] == 1, body
                new = await complete(n_new)
        return got, swapped_at, new
    got, swapped_at, new = srv.run(swap_mid_stream())
    assert swapped_at < n_long // 2  # the first directory's request streamed on while the second was loaded
    assert new.model == "swap" and _token_ids(new.choices[0]) == want_second
    assert got == want_first
    assert _token_ids(srv.run(complete(n_new)).choices[0]) == want_second  # and from then on
    assert srv.engine.stats.lora_registered == registered  # the first registration left once its request ended
    status, _ = srv.run(_admin(root, "/admin/unload_lora_adapter", {"lora_name": "swap"}))
    assert status == 200


def test_adapter_named_at_engine_start_unloaded_and_loaded_again(served, tmp_path):
    """An adapter the engine's configuration names (served from its start) that the admin endpoints unload and then
    load again is served again, with transformers + PEFT's tokens: from its own directory, then from another."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.engine.lora.peft_reference import peft_greedy_tokens

    srv, clients, _, pinned = served
    other = str(tmp_path / "other")
    _make_adapter(srv.demo, other)
    root = str(srv.server.make_url(""))
    rng = random.Random()
    prompt = [rng.randrange(3, 200) for _ in range(rng.randint(8, 30))]
    n = 8
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(srv.demo, dtype=torch.float32), pinned,
                                    adapter_name="pinned").eval()
    ref.load_adapter(other, adapter_name="other")
    want = {name: peft_greedy_tokens(ref, name, prompt, n) for name in ("pinned", "other")}
    assert want["pinned"] != want["other"]

    async def complete():
        return await clients["pinner"].completions.create(
            model="pinned", prompt=prompt, max_tokens=n, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})

    assert _token_ids(srv.run(complete()).choices[0]) == want["pinned"]  # as the engine started with it
    for path, expected in ((pinned, want["pinned"]), (other, want["other"])):
        status, body = srv.run(_admin(root, "/admin/unload_lora_adapter", {"lora_name": "pinned"}))
        assert status == 200 and body["engines"] == 1, body
        with pytest.raises(openai.NotFoundError):
            srv.run(complete())
        load = {"lora_name": "pinned", "lora_path": path, "tenant": "pinner"}
        status, body = srv.run(_admin(root, "/admin/load_lora_adapter", load))
        assert status == 200 and body["engines"] == 1, body
        answer = srv.run(complete())
        assert answer.model == "pinned" and _token_ids(answer.choices[0]) == expected, path


def test_adapter_moved_in_the_database_is_served_from_its_new_directory(served, tmp_path):
    """``adapter remove`` and ``adapter add`` of the same name with another directory, from outside the gateway
    (as the command line does), while an engine still serves the first directory: once the tenant's view holds
    the new directory, its next request loads it in place of the old one (transformers + PEFT's tokens for the
    new weights), rather than a 400 until the gateway forgets the removed adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from gateway.lora_adapters import ADAPTERS
    from tests.engine.lora.peft_reference import peft_greedy_tokens

    srv, clients, _, _ = served
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    _make_adapter(srv.demo, first)
    _make_adapter(srv.demo, second)
    rng = random.Random()
    prompt = [rng.randrange(3, 200) for _ in range(12)]
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(srv.demo, dtype=torch.float32), first,
                                    adapter_name="first").eval()
    ref.load_adapter(second, adapter_name="second")
    want = {d: peft_greedy_tokens(ref, d, prompt, 6) for d in ("first", "second")}
    assert want["first"] != want["second"]
    catalog = srv.server.app[ADAPTERS]

    async def complete():
        answer = await clients["owner"].completions.create(
            model="moved", prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        return _token_ids(answer.choices[0])

    async def move():
        await catalog.adapters.add("moved", first, "owner", 4, ["q_proj"])
        catalog.changed()
        before = await complete()  # the engine is given the first directory
        # Moved from outside the gateway, then the tenant's cached view expires (forced here, not waited for):
        # the gateway's periodic forget_removed has not seen the removal.
        await catalog.adapters.remove("moved")
        await catalog.adapters.add("moved", second, "owner", 4, ["q_proj"])
        catalog.changed()
        return before, await complete()
    try:
        before, after = srv.run(move())
        assert before == want["first"] and after == want["second"]
        assert srv.run(complete()) == want["second"]
    finally:
        srv.run(catalog.adapters.remove("moved"))


def _spoil(adapter_dir: str, value: float) -> str:
    """Set one entry of one lora_B of the PEFT adapter at ``adapter_dir`` to ``value``; returns that tensor's name."""
    from safetensors.torch import load_file, save_file

    file = f"{adapter_dir}/adapter_model.safetensors"
    tensors = load_file(file)
    key = random.choice(sorted(k for k in tensors if ".lora_B." in k))
    tensors[key].view(-1)[random.randrange(tensors[key].numel())] = value
    save_file(tensors, file, metadata={"format": "pt"})
    return key


def test_broken_or_lookalike_adapters_are_refused_and_others_unharmed(served, tmp_path, capsys):
    """An adapter whose weights hold NaN, inf or 1e30 is refused when it is added: the admin endpoint's 400 names the
    adapter, ``lora_path`` and the tensor, ``moegate admin adapter add`` exits 2 with one line; so is a name that
    reads as the served model (case, Cyrillic or fullwidth letters, a zero-width space). Nothing is written. An
    adapter whose file went bad after it was added fails its own requests (a 400 naming ``model``), and another
    tenant's base-model requests keep transformers' tokens."""
    from transformers import AutoModelForCausalLM

    srv, clients, _, _ = served
    root = str(srv.server.make_url(""))
    before = srv.run(_adapter_names(srv.database_url))
    for k, value in enumerate((float("nan"), float("inf"), 1e30)):
        bad = str(tmp_path / f"bad{k}")
        _make_adapter(srv.demo, bad)
        key = _spoil(bad, value)
        status, body = srv.run(_admin(root, "/admin/load_lora_adapter", {"lora_name": f"bad{k}", "lora_path": bad,
                                                                        "public": True}))
        message = body["error"]["message"]
        assert status == 400 and body["error"]["param"] == "lora_path", body
        assert f"'bad{k}'" in message and key in message and "\n" not in message, message
        capsys.readouterr()
        cli = ["admin", "adapter", "add", f"bad{k}", "--path", bad, "--public", "--database-url", srv.database_url]
        assert srv.run(asyncio.to_thread(moegate, cli)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and key in err, err
    good = str(tmp_path / "good")
    _make_adapter(srv.demo, good)
    for name in ("demo", "DEMO", "d\u0435mo", "\uff44\uff45\uff4d\uff4f", "de\u200bmo"):
        status, body = srv.run(_admin(root, "/admin/load_lora_adapter", {"lora_name": name, "lora_path": good,
                                                                        "public": True}))
        assert status == 400 and body["error"]["param"] == "lora_name", (name, body)
    assert srv.run(_adapter_names(srv.database_url)) == before

    # Registered while its file was sound (the CLI: no engine reads it yet); spoiled before its first request.
    assert srv.run(asyncio.to_thread(moegate, ["admin", "adapter", "add", "spoiled", "--path", good, "--public",
                                               "--database-url", srv.database_url])) == 0
    key = _spoil(good, float("nan"))
    time.sleep(POLICY_TTL_S * 1.5)
    rng = random.Random()
    prompt = [rng.randrange(3, 200) for _ in range(12)]
    with pytest.raises(openai.BadRequestError) as refused:
        srv.run(clients["other"].completions.create(model="spoiled", prompt=prompt, max_tokens=4))
    assert refused.value.body["param"] == "model" and key in refused.value.body["message"]
    base_hf = AutoModelForCausalLM.from_pretrained(srv.demo, dtype=torch.float32).eval()
    answer = srv.run(clients["owner"].completions.create(
        model="demo", prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}))
    assert _token_ids(answer.choices[0]) == _greedy(base_hf, prompt, 8)
    assert srv.run(asyncio.to_thread(moegate, ["admin", "adapter", "remove", "spoiled", "--database-url",
                                               srv.database_url])) == 0
    capsys.readouterr()
