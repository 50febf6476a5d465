"""Host time per step on the critical path, synchronous vs overlapped scheduling, at several batch sizes.

    python -m benchmarks.step_overlap [--batches 1,8,64] [--threads 1] [--rounds 15] [--steps 10] [--model SPEC]
                                      [--asks none,logprobs,penalty]
    python -m benchmarks.step_overlap --device cuda   # on a GPU (bfloat16)

Two engines on the same random-weight model (default: a small Qwen3-MoE, hidden 256, 4 layers, 16 experts,
top-4, Qwen3's vocabulary), one with ``overlap_scheduling`` off and one with it on, each holding ``batch``
requests in steady decode (32-token prompts, outputs long enough never to finish). Rounds alternate the
engines, ``steps`` steps each; each number is a round's mean per step, median over the rounds. Per step:

* ``step``: wall time of ``engine.step()`` (the loop's period);
* ``compute``: on the CPU the forward, logits and sampling themselves (synchronous: ``execute`` minus its
  batch building; overlapped: the worker's time on each step launched); on CUDA the forwards' device time
  (CUDA events around each);
* ``host``: the round's ``step - compute``: the host time on the critical path, what the device (here: the
  thread running the forward) does not hide (the time it sat idle);
* ``sched``, ``prep``: the scheduler's Python (schedule + update) and the batch building, wherever they ran.

``--asks``: what one request of each batch asks besides greedy decoding (``none``: nothing; ``logprobs``: its
5 most likely tokens' logprobs; ``penalty``: a frequency penalty over its history), one table row pair each:
the cost of one such tenant to the whole batch.

On the CPU the overlapped engine runs the forward on a worker thread; ``--threads`` is torch's intra-op
thread count for both engines (the host's own thread needs a core of its own to overlap).
"""

import argparse
import random
import statistics
import time

import torch

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

SMALL = ("qwen3-30b-a3b:hidden_size=256,num_hidden_layers=4,num_experts=16,num_experts_per_tok=4,"
         "moe_intermediate_size=128,intermediate_size=512,num_attention_heads=4,num_key_value_heads=2,head_dim=64")


ASKS = {"none": {}, "logprobs": {"logprobs": 5}, "penalty": {"frequency_penalty": 0.5}}


def build(model: str, batch: int, overlap: bool, threads: int, device: str, ask: str = "none") -> LLMEngine:
    config = EngineConfig(model="bench", random_weights=model, device=device, dtype="float32" if device == "cpu" else "auto",
                          block_size=16, num_kv_blocks=batch * 24 + 8, max_num_seqs=max(batch, 1), cpu_threads=threads,
                          overlap_scheduling=overlap)
    engine = LLMEngine(config)
    rng = random.Random(0)
    for i in range(batch):
        extra = ASKS[ask] if i == 0 else {}
        engine.add_request([rng.randrange(1, 1000) for _ in range(32)],
                           SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, **extra), request_id=str(i))
    for _ in range(4):  # prefill, then a few decode steps (the overlapped pipeline fills)
        engine.step()
    return engine


class CudaForwardTimer:
    """CUDA: events around each forward of ``engine``; ``read`` waits for the device and returns the forwards'
    device time since the last read, milliseconds."""

    def __init__(self, engine: LLMEngine) -> None:
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        forward = engine.runner.forward

        def timed(batch):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            hidden = forward(batch)
            end.record()
            self.pairs.append((start, end))
            return hidden

        engine.runner.forward = timed

    def read(self) -> float:
        torch.cuda.synchronize()
        ms = sum(start.elapsed_time(end) for start, end in self.pairs)
        self.pairs.clear()
        return ms


def timed_round(engine: LLMEngine, steps: int, into: dict[str, list[float]],
                cuda_timer: CudaForwardTimer | None = None) -> None:
    """``steps`` steps; appends this round's means per step. ``host`` is the round's wall time minus the
    compute of the steps it ran, divided by the steps: the time the device (the forward's thread on the
    CPU) sat idle.

    The overlapped engine's last step of a round is waited for inside the round (its compute is the
    round's), so the other engine's round never runs beside it.
    """
    wall = compute = schedule = prepare = 0.0
    launched = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        wall += (time.perf_counter() - start) * 1e3
        if engine._in_flight is not None:  # the overlapped loop: the step this call launched
            launched.append(engine._in_flight)
        elif cuda_timer is None:
            compute += engine.runner.last_execute_ms - engine.runner.last_prepare_ms
        schedule += engine.scheduler.last_step_ms
        prepare += engine.runner.last_prepare_ms
    start = time.perf_counter()
    if cuda_timer is not None:
        compute = cuda_timer.read()  # waits for the round's last step
    elif launched:
        launched[-1].device_tokens()  # the worker's last step of the round
        compute += sum(step.compute_ms for step in launched)
    wall += (time.perf_counter() - start) * 1e3
    for key, total in (("step", wall), ("compute", compute), ("host", wall - compute), ("schedule", schedule),
                       ("prepare", prepare)):
        into[key].append(total / steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default=SMALL, help="a random-weights spec (engine.loading.random_weights)")
    p.add_argument("--asks", default="none", help=f"comma-separated, of {', '.join(ASKS)}")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} intra-op thread(s), model {args.model}")
    print(f"{'batch':>5} {'asks':<9} {'mode':<11} {'step ms':>8} {'compute':>8} {'host':>7} {'sched':>6} {'prep':>6} "
          f"{'tok/s':>8}")
    for batch in [int(b) for b in args.batches.split(",")]:
        for ask in args.asks.split(","):
            engines = {"synchronous": build(args.model, batch, False, args.threads, args.device, ask),
                       "overlapped": build(args.model, batch, True, args.threads, args.device, ask)}
            timers = {name: CudaForwardTimer(e) if args.device == "cuda" else None for name, e in engines.items()}
            times = {name: {k: [] for k in ("step", "compute", "host", "schedule", "prepare")} for name in engines}
            for _ in range(args.rounds):
                for name, engine in engines.items():
                    timed_round(engine, args.steps, times[name], timers[name])
            for name, t in times.items():
                med = {k: statistics.median(v) for k, v in t.items()}
                print(f"{batch:>5} {ask:<9} {name:<11} {med['step']:>8.2f} {med['compute']:>8.2f} {med['host']:>7.2f} "
                      f"{med['schedule']:>6.2f} {med['prepare']:>6.2f} {batch / med['step'] * 1e3:>8.0f}")
            for engine in engines.values():
                engine.close()


if __name__ == "__main__":
    main()
