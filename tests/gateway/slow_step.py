"""An engine-process entry point whose every forward takes at least ``STEP_S`` longer: a measured step time the
tests set, so a queue of prefill predicts (and takes) a known minimum time on any machine."""

STEP_S = 0.02


def run_with_slow_steps(config, requests, replies) -> None:
    import time

    from engine.serving.engine_process import run_engine_process
    from engine.worker.runner import ModelRunner

    real_execute = ModelRunner._execute

    def _execute(self, plan):
        time.sleep(STEP_S)  # inside execute(), so the step's reported time includes it
        return real_execute(self, plan)

    ModelRunner._execute = _execute
    run_engine_process(config, requests, replies)
