"""Decode throughput with a JSON schema vs without, side by side in one run, and the time to prepare a schema.

    python -m benchmarks.structured_output_throughput [--requests 64] [--tokens 96] [--rounds 3]
        [--device cpu|cuda] [--dtype float32|bfloat16]

The offline engine on the random-weight demo checkpoint (by default the CPU, float32, 1 torch thread; on CUDA
the token bitmask is applied on the device) decodes --requests
concurrent requests of --tokens tokens each, alternately free and constrained by a schema whose shortest
valid output is longer than --tokens (an array of at least 100 strict-mode objects), so both runs produce
exactly the same number of tokens and differ only in the grammar work: the host walking llguidance's
parser for each row's mask, the mask's copy and application, and each sampled token's advance. Prints each
round's tokens/s and the constrained/free throughput ratio by wall time and by this process's CPU time
(steadier on a shared machine), their medians (goal: >= 90%), and the schema's preparation time: the grammar cold (built
and validated) and cached, the engine's untouched matcher for it (both paid at admission, once per schema),
and the copy of it each request starts from.
"""

import argparse
import json
import random
import statistics
import tempfile
import time

import torch

from engine import LLM, SamplingParams
from engine.core.structured_output_spec import StructuredOutput
from engine.loading.demo_model import write_demo_model
from engine.structured_output import grammar

ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "role": {"enum": ["admin", "user", "guest"]},
    "score": {"type": "number", "minimum": 0, "maximum": 100},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
    "required": ["name", "role", "score", "tags"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 100}},
          "required": ["items"], "additionalProperties": False}


def _decode(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, float, int]:
    """(wall s, this process's CPU s, tokens generated)."""
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, time.process_time() - c0, sum(len(o.token_ids) for o in outs)


def run(requests: int, tokens: int, rounds: int, device: str = "cpu", dtype: str = "float32") -> None:
    torch.set_num_threads(1)
    model_dir = tempfile.mkdtemp()
    write_demo_model(model_dir, seed=0)
    llm = LLM(model=model_dir, dtype=dtype, device=device, max_num_seqs=requests,
              num_kv_blocks=requests * 8, max_num_batched_tokens=2048)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1300) for _ in range(16)] for _ in range(requests)]
    text = json.dumps(SCHEMA)

    grammar._GRAMMARS.clear()
    t0 = time.perf_counter()
    grammar.grammar_of(StructuredOutput(json_schema=text))
    cold_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    grammar.grammar_of(StructuredOutput(json_schema=text))
    cached_ms = (time.perf_counter() - t0) * 1e3
    matchers = llm.engine.runner.sampler.grammars
    t0 = time.perf_counter()
    matchers.prepare(StructuredOutput(json_schema=text))  # the engine's untouched matcher for this schema
    matcher_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    matchers._prototypes.get(StructuredOutput(json_schema=text).cache_key).deep_copy()
    copy_ms = (time.perf_counter() - t0) * 1e3

    def params(constrained: bool, round_: int) -> list[SamplingParams]:
        so = StructuredOutput(json_schema=text) if constrained else None
        # Sampled (temperature 1) both ways; free requests ignore EOS so they too run the full length.
        return [SamplingParams(temperature=1.0, seed=round_ * 1000 + i, max_tokens=tokens, ignore_eos=not constrained,
                               structured_output=so) for i in range(requests)]

    _decode(llm, prompts, params(True, -1))  # warm-up: first steps, allocations, the matcher's lexer
    _decode(llm, prompts, params(False, -1))
    print(f"{requests} requests x {tokens} tokens, demo model, {device} {dtype}, 1 torch thread")
    print(f"{'round':>5} {'free tok/s':>11} {'schema tok/s':>13} {'wall ratio':>10} {'CPU-time ratio':>14}")
    walls, cpus = [], []
    for r in range(rounds):
        # Alternate which goes first, so a neighbour's load drifting during the run favours neither.
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {constrained: _decode(llm, prompts, params(constrained, r)) for constrained in order}
        (free_s, free_cpu, free_n), (json_s, json_cpu, json_n) = got[False], got[True]
        assert free_n == json_n == requests * tokens, (free_n, json_n)
        walls.append(free_s / json_s)
        cpus.append(free_cpu / json_cpu)
        print(f"{r:5d} {free_n / free_s:11.0f} {json_n / json_s:13.0f} {walls[-1]:10.1%} {cpus[-1]:14.1%}")
    print(f"median schema/free throughput: wall {statistics.median(walls):.1%}, CPU time "
          f"{statistics.median(cpus):.1%} (goal >= 90%)")
    print(f"schema preparation: grammar cold {cold_ms:.2f} ms, cached {cached_ms:.3f} ms; the engine's matcher "
          f"for it {matcher_ms:.2f} ms (both at admission, once per schema); each request's copy {copy_ms:.4f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    run(args.requests, args.tokens, args.rounds, args.device, args.dtype)
