"""Engine-process entry points that fail on a marked request, to test what a failure does.

``run_with_failing_step``: the step that has a request whose prompt begins with
``POISON_TOKEN`` in the engine raises, as a bug in a kernel or the sampler would.
``run_with_failing_detokenizer``: turning the output of a request whose prompt ends
with ``POISON_TAIL`` into text raises, as a tokenizer bug would.
``run_then_linger``: the engine ends slowly once its gateway has gone.
"""

POISON_TOKEN = 7
POISON_TAIL = [7, 7, 7, 7]


def run_with_failing_step(config, requests, replies) -> None:
    from engine.serving.engine_process import run_engine_process
    from engine.llm_engine import LLMEngine

    real_step = LLMEngine.step

    def step(self):
        if any(r.prompt_token_ids[:1] == [POISON_TOKEN] for r in self.scheduler.requests.values()):
            raise RuntimeError("device-side assert triggered (a test's failing step)")
        return real_step(self)

    LLMEngine.step = step
    run_engine_process(config, requests, replies)


def run_with_failing_detokenizer(config, requests, replies) -> None:
    from engine.serving.engine_process import run_engine_process
    from engine.text.tokenizer import IncrementalDetokenizer

    real_add = IncrementalDetokenizer.add

    def add(self, token_ids):
        if self.ids[:len(POISON_TAIL)] == POISON_TAIL:  # seeded with the prompt's last tokens
            raise UnicodeError("a tokenizer bug (a test's failing detokenizer)")
        return real_add(self, token_ids)

    IncrementalDetokenizer.add = add
    run_engine_process(config, requests, replies)


LINGER_S = 12.0  # longer than a remote gateway's connect timeout


def run_then_linger(config, requests, replies) -> None:
    """An engine that takes ``LINGER_S`` to end once its gateway has gone (as one stuck in a collective would)."""
    import time

    from engine.serving.engine_process import run_engine_process

    try:
        run_engine_process(config, requests, replies)
    finally:
        time.sleep(LINGER_S)
