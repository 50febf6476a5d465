"""Text-only streams' inter-token latency while requests with images arrive: the per-step encoder budget at work,
with the images prepared on the loop that steps the engine or off it.

    python -m benchmarks.image_itl [--streams 8] [--seconds 20] [--rounds 1] [--every 0.5] [--images 4]
                                   [--side 448] [--max-batched-tokens 256] [--vision-depth 4] [--text-layers 8]
                                   [--threads 1] [--token-blocks N [N ...]] [--no-budget] [--weights-only]
                                   [--loops on off]
                                   [--profile] [--clock wall|cpu] [--device cpu|cuda] [--dtype float32|bfloat16]

One process, one checkpoint written at start (transformers' ``Qwen3VLMoeForConditionalGeneration`` of small
shapes, its own random init; ``benchmarks.encoder_cache.write_checkpoint``), an engine per arm built once, then
``rounds`` rounds of ``seconds`` each arm, the arms taking turns within a round (so a busy shared host's drift
falls on every arm alike); each round's image requests are new (no image is ever seen twice), the same for every
arm of that round. The arms: text streams alone; with image requests under the default layer-chunked budget (the
tower work worth a quarter of a ``max_num_batched_tokens`` prompt chunk: ``engine.models.encoder_budget``); with
whole images (``max_num_encoder_token_blocks`` 0: a step encodes at most ``max_num_batched_tokens`` image tokens,
each image whole); under each ``--token-blocks`` budget (a step runs that much of the tower, in token-blocks;
below one block a block is split over the image's rows);
with ``--no-budget`` also with no encoder budget at all (every image a prompt chunk
reaches encoded in that step); with ``--weights-only`` also under the default budget with the tower's attention
left uncharged (each pass of a block costing one half token-block whatever the image's size, as the weights
count it: what the scheduler did before it charged a block's attention over the image). Each image arm twice (``--loops``: only the ones named): *on the loop*, the
request's encoded images handed to
``LLMEngine.add_request`` on the thread that steps the engine (decoded, preprocessed and hashed there, as the
engine process did before ``engine.serving.image_preparation``), and *off the loop*, held by that module's
``ImagePreparation`` while the engine's image worker prepares them, as the engine process's loop does.

Workload: ``streams`` text-only requests decoding for the whole round (32-token prompts, ``ignore_eos``); once
their prompts are computed (and 2 s in) the round is measured for ``seconds``, and every ``every`` seconds one
request with ``images`` distinct random images of ``side`` x ``side`` pixels (noise: a
PNG as large as the side allows) and a little text, 4 generated tokens. Steps are chunked at
``max_batched_tokens`` tokens, so an image request's text is prefilled over several steps either way; what the
encoder budget bounds is the vision tower's work in one step.

The shape keeps a served model's proportions where they decide the result: the vision tower a fraction of the
text model's per-step work (``--vision-depth`` blocks of width 256 against ``--text-layers`` MoE layers over the
batch). Printed per arm (all rounds' measured gaps together): the streams' inter-token
gaps p50, p99 and max, the steps, the image requests served and their time to first token (p50, of those that
got one within the round; from when the request arrived); then each image arm's p99 over the text-only
arm's, on and off the loop side by side. Twice: in wall-clock time, and in the stepping thread's CPU time
(``time.thread_time``: what the loop itself computed between two tokens, without the time other processes of a
shared host take from it; on the CPU with ``--threads 1``, where torch runs every op on that thread: on a GPU it
leaves the device's time out, so read the wall clock there).

``--profile``: what the slowest 1% of the loop's iterations (and the median one) spent their time on: adding
requests (with their images, on the loop), scheduling, the vision tower (layer-chunked pieces and whole images),
the rest of the step (the forward, sampling, outputs), and the prompt tokens they prefilled (measured iterations
only), in ``--clock``'s time; and the tower's time (p50, p99) in the iterations that ran it, what the encoder
budget bounds. Nothing is asserted.
"""

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch

from benchmarks.encoder_cache import IMAGE_TOKEN, VISION_END, VISION_START, random_png, write_checkpoint
from engine.core.config import EngineConfig
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.serving.image_preparation import ImagePreparation
from engine.serving.protocol import AddRequest

WARMUP_S = 2.0
STREAM = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
POLICY = RequestPolicy(tenant="t", cache_salt="t")
PARTS = ("add", "schedule", "tower", "rest")


@dataclass
class Arm:
    name: str
    engine: LLMEngine
    images: bool
    off_loop: bool = False
    gaps: list[float] = field(default_factory=list)  # wall clock
    cpu_gaps: list[float] = field(default_factory=list)  # the stepping thread's CPU time
    steps: int = 0
    sent: int = 0
    served: int = 0
    ttfts: list[float] = field(default_factory=list)  # image requests' first token, wall clock from arrival
    iterations: list[dict] = field(default_factory=list)  # --profile: each loop iteration's parts (ms)


class StepProbe:
    """Host time of the parts of each loop iteration of one engine, by wrapping its scheduler's ``schedule`` and
    its model's tower entry points (``encode_pieces``, ``encode``)."""

    def __init__(self, engine: LLMEngine, clock) -> None:
        self.now: dict = {}
        scheduler, model = engine.scheduler, engine.model

        def timed(part: str, fn):
            def wrapper(*args):
                start = clock()
                try:
                    return fn(*args)
                finally:
                    self.now[part] = self.now.get(part, 0.0) + (clock() - start) * 1e3
            return wrapper

        schedule = timed("schedule", scheduler.schedule)

        def scheduling():
            plan = schedule()
            self.now["prefill"] = sum(p.num_new_tokens for p in plan.scheduled if p.num_new_tokens > 1)
            return plan

        scheduler.schedule = scheduling
        model.encode_pieces = timed("tower", model.encode_pieces)
        model.encode = timed("tower", model.encode)

    def begin(self) -> None:
        self.now = {}

    def end(self, add_ms: float, step_ms: float) -> dict:
        parts = {"add": add_ms, "schedule": self.now.get("schedule", 0.0), "tower": self.now.get("tower", 0.0),
                 "prefill": self.now.get("prefill", 0)}
        parts["rest"] = step_ms - parts["schedule"] - parts["tower"]
        parts["total"] = add_ms + step_ms
        return parts


def image_requests(rng: random.Random, args) -> list[tuple[list[int], list[bytes]]]:
    """(prompt ids, images) for every arrival of a round: distinct images, text around each."""
    tokens = (args.side // 32) ** 2
    out = []
    for _ in range(int(args.seconds / args.every) + 1):
        prompt, images = [], []
        for _ in range(args.images):
            prompt += [rng.randrange(1, VISION_START) for _ in range(8)]
            prompt += [VISION_START] + [IMAGE_TOKEN] * tokens + [VISION_END]
            images.append(random_png(rng, args.side))
        out.append((prompt + [rng.randrange(1, VISION_START) for _ in range(8)], images))
    return out


def build(path: str, args, encoder_tokens: int | None, token_blocks: int | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device=args.device, dtype=args.dtype, block_size=16, num_kv_blocks=2048,
                                  max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.streams + 16,
                                  max_num_encoder_tokens=encoder_tokens, max_num_encoder_token_blocks=token_blocks,
                                  encoder_cache_gb=0.0, cpu_threads=args.threads))


def run_round(arm: Arm, args, arrivals: list, rnd: int, probe: StepProbe | None, clock) -> None:
    """One round of ``arm``: its streams (and image requests), measured ``args.seconds`` from when the streams'
    prompts are computed (and WARMUP_S in); every request ended after."""
    engine, rng = arm.engine, random.Random(args.seed + rnd)
    prep = ImagePreparation(engine)
    streams = [f"r{rnd}s{i}" for i in range(args.streams)]
    for rid in streams:
        engine.add_request([rng.randrange(1, VISION_START) for _ in range(32)], STREAM, request_id=rid, policy=POLICY)
    last: dict[str, tuple[float, float]] = {}  # each stream's last token: wall clock, the thread's CPU time
    sent, started, arrived = 0, [], {}
    start = time.perf_counter()
    measured = None  # from when: WARMUP_S in, and every stream's prompt computed (its first token out)
    while True:
        now = time.perf_counter()
        if measured is None and now - start >= WARMUP_S and len(last) == len(streams):
            measured = now
        if measured is not None and now - measured >= args.seconds:
            break
        began = clock()
        if arm.images and measured is not None and sent < len(arrivals) and now - measured >= sent * args.every:
            prompt, images = arrivals[sent]
            rid = f"r{rnd}i{sent}"
            if arm.off_loop:  # as the engine process's loop: held while the image worker prepares them
                prep.hold(AddRequest(rid, prompt, SHORT, POLICY, images=images))
            else:
                engine.add_request(prompt, SHORT, request_id=rid, policy=POLICY, images=images)
            started.append(rid)
            arrived[rid] = now
            sent += 1
        for msg, error in prep.ready():
            assert error is None, error
            engine.add_request(msg.prompt, SHORT, request_id=msg.request_id, policy=POLICY, images=prep.images_of(msg))
        added = clock()
        if probe is not None:
            probe.begin()
        outputs = engine.step()
        arm.steps += 1
        at, cpu_at = time.perf_counter(), time.thread_time()
        if probe is not None and measured is not None:
            arm.iterations.append(probe.end((added - began) * 1e3, (clock() - added) * 1e3))
        for out in outputs:
            if out.request_id in streams and out.token_ids:
                if measured is not None and last.get(out.request_id, (0.0,))[0] >= measured:
                    arm.gaps.append(at - last[out.request_id][0])
                    arm.cpu_gaps.append(cpu_at - last[out.request_id][1])
                last[out.request_id] = (at, cpu_at)
            else:
                if out.request_id in arrived and out.token_ids:
                    arm.ttfts.append(at - arrived.pop(out.request_id))
                arm.served += out.finished
    while prep:  # images still being prepared: done before the next arm runs, then dropped
        time.sleep(0.01)
        prep.ready()
    for rid in streams + started:
        prep.drop(rid)
        engine.abort(rid)
    arm.sent += sent


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[int(q * (len(values) - 1))]


def report_profile(arm: Arm) -> None:
    rows = sorted(arm.iterations, key=lambda r: r["total"])
    slow = rows[-max(1, len(rows) // 100):]

    def line(picked: list[dict]) -> str:
        mean = {k: statistics.fmean(r[k] for r in picked) for k in (*PARTS, "total", "prefill")}
        return (f"{mean['total']:6.1f} ms = add {mean['add']:5.1f} + schedule {mean['schedule']:4.1f} + tower "
                f"{mean['tower']:5.1f} + rest {mean['rest']:6.1f}; prefill {mean['prefill']:5.1f} tokens")

    kinds = (f"{sum(r['tower'] > 0 for r in slow)} ran the tower, {sum(r['prefill'] > 0 for r in slow)} prefilled, "
             f"{sum(r['add'] > 1 for r in slow)} added images on the loop")
    print(f"{arm.name:>38}: slowest 1% ({len(slow)} of {len(rows)}) {line(slow)}; of them {kinds}")
    print(f"{'':>38}  median iteration   {line([rows[len(rows) // 2]])}")
    tower = sorted(r["tower"] for r in rows if r["tower"] > 0)
    if tower:
        print(f"{'':>38}  tower in the {len(tower)} iterations that ran it: p50 {statistics.median(tower):5.1f} ms, "
              f"p99 {percentile(tower, 0.99):5.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="seconds measured of each arm in each round (after its streams' prompts, and 2 s)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, the arms taking turns within each")
    parser.add_argument("--every", type=float, default=0.5, help="seconds between image requests")
    parser.add_argument("--images", type=int, default=4, help="images per image request")
    parser.add_argument("--side", type=int, default=448, help="image side in pixels (a multiple of 32)")
    parser.add_argument("--max-batched-tokens", type=int, default=256)
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--text-layers", type=int, default=8)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--token-blocks", type=int, nargs="+", default=None,
                        help="more layer-chunked arms: tower work a step, in token-blocks, an arm each")
    parser.add_argument("--loops", nargs="+", choices=("on", "off"), default=["on", "off"],
                        help="image arms with the images prepared on the loop, off it, or both")
    parser.add_argument("--no-budget", action="store_true", help="also run with no encoder budget")
    parser.add_argument("--weights-only", action="store_true",
                        help="also run the default budget with the tower's attention left uncharged")
    parser.add_argument("--profile", action="store_true", help="where the slowest iterations spend their time")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="--profile's clock: wall, or the stepping thread's CPU time")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as path:
        write_checkpoint(path, args.vision_depth, args.text_layers, args.moe_intermediate)
        print(f"{args.streams} text streams; every {args.every} s a request with {args.images} images of "
              f"{args.side}x{args.side} ({(args.side // 32) ** 2} tokens each); steps of {args.max_batched_tokens} "
              f"tokens; {args.threads} thread(s); {args.rounds} round(s) of {args.seconds} s an arm")
        auto = build(path, args, None, None).scheduler.config.max_num_encoder_token_blocks
        budgets = [(f"default ({auto} token-blocks)", None, None, True), ("whole images", None, 0, True)]
        if args.weights_only:
            budgets.append(("default, weights only", None, None, False))
        budgets += [(f"{n} token-blocks", None, n, True) for n in args.token_blocks or ()]
        if args.no_budget:
            budgets.append(("no budget", 10**9, None, True))
        arms = [Arm("text only", build(path, args, None, None), images=False)]
        for name, encoder_tokens, blocks, attention in budgets:
            for off in (False, True):
                if ("off" if off else "on") in args.loops:
                    engine = build(path, args, encoder_tokens, blocks)
                    if not attention:
                        engine.scheduler.encoder_steps.attention_per_patch = 0.0
                    arms.append(Arm(f"images, {name}, {'off' if off else 'on'} the loop", engine, images=True,
                                    off_loop=off))
        clock = time.perf_counter if args.clock == "wall" else time.thread_time
        probes = {arm.name: StepProbe(arm.engine, clock) if args.profile else None for arm in arms}
        for rnd in range(args.rounds):
            arrivals = image_requests(random.Random(args.seed + 1000 + rnd), args)
            for arm in arms:
                run_round(arm, args, arrivals, rnd, probes[arm.name], clock)
        for arm in arms:
            arm.engine.close()
        for label, gaps_of in (("wall clock", lambda a: a.gaps),
                               ("the stepping thread's CPU time", lambda a: a.cpu_gaps)):
            print(f"ITL in {label}:")
            for arm in arms:
                gaps = gaps_of(arm)
                ttft = f"  TTFT p50 {statistics.median(arm.ttfts):5.2f} s ({len(arm.ttfts)})" if arm.ttfts else ""
                print(f"{arm.name:>38}: ITL p50 {statistics.median(gaps) * 1e3:6.1f} ms  "
                      f"p99 {percentile(gaps, 0.99) * 1e3:6.1f} ms  max {max(gaps) * 1e3:6.1f} ms  "
                      f"steps {arm.steps}  image requests {arm.served}/{arm.sent}{ttft}")
            base = percentile(gaps_of(arms[0]), 0.99)
            for name, *_ in budgets:
                ratios = [f"{loop} the loop {percentile(gaps_of(arm), 0.99) / base:.2f}x" for arm in arms[1:]
                          for loop in ("on", "off") if arm.name == f"images, {name}, {loop} the loop"]
                print(f"ITL p99 / text only, {name:>18}: {', '.join(ratios)}")
        if args.profile:
            print(f"iterations in {'wall clock' if args.clock == 'wall' else 'the stepping thread CPU time'}:")
            for arm in arms:
                report_profile(arm)


if __name__ == "__main__":
    main()
