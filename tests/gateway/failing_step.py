"""An engine-process entry point whose step fails on a marked request, to test what a failed step does.

The marked request is one whose prompt begins with ``POISON_TOKEN``: the step that
has it in the engine raises, as a bug in a kernel or the sampler would.
"""

POISON_TOKEN = 7


def run_with_failing_step(config, requests, replies) -> None:
    from engine.engine_process import run_engine_process
    from engine.llm_engine import LLMEngine

    real_step = LLMEngine.step

    def step(self):
        if any(r.prompt_token_ids[:1] == [POISON_TOKEN] for r in self.scheduler.requests.values()):
            raise RuntimeError("device-side assert triggered (a test's failing step)")
        return real_step(self)

    LLMEngine.step = step
    run_engine_process(config, requests, replies)
