"""Small builders for scheduler tests (no torch, no model), and one request run through an engine."""

import random

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.outputs import RequestOutput
from engine.core.request import Request
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 32, max_model_len: int = 256, caching: bool = True,
                   sliding_window: int | None = None) -> Scheduler:
    """``sliding_window``: a second KV cache group of sliding-window layers with that window."""
    return Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len),
        CacheConfig(block_size, num_blocks, caching, sliding_window),
    )


def make_requests(n: int, rng: random.Random, prompt_len=(1, 40), max_tokens=(1, 20), vocab: int = 50) -> list[Request]:
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))]
        reqs.append(Request(f"r{i}", prompt, SamplingParams(ignore_eos=True), max_tokens=rng.randint(*max_tokens)))
    return reqs


def run_to_completion(scheduler: Scheduler, rng: random.Random, vocab: int = 50, max_steps: int = 10_000, on_step=None):
    """Drive the scheduler with random 'sampled' tokens, as the runner would."""
    steps = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        if on_step:
            on_step(out)
        scheduler.update(out, [rng.randrange(vocab) if s.sample else None for s in out.scheduled])
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def complete(engine, prompt: list[int], params: SamplingParams, policy: RequestPolicy) -> RequestOutput:
    """Run one request through ``engine`` (an ``LLMEngine``) to its end; its whole output."""
    rid = engine.add_request(prompt, params, policy=policy)
    whole = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                whole = o if whole is None else whole.merge(o)
    return whole
