"""The offline API: ``LLM(model=PATH, ...).generate(prompts, sampling_params)``."""

import weakref
from collections.abc import Sequence

from engine.core.config import EngineConfig, KernelChoice
from engine.llm_engine import LLMEngine
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams


class LLM:
    """Batch generation in-process. Keyword arguments are ``EngineConfig`` fields; ``kernel_choice`` overrides
    what ``kernels`` resolves to (to compare one part's kernels, see ``engine.core.config.KernelChoice``).

    An engine over several processes (``tensor_parallel_size``, ``data_parallel_size``) holds its other
    ranks and the process group until it is closed: by ``close()``, at the end of a ``with LLM(...) as
    llm:`` block, when the object is collected, or when the interpreter exits, whichever comes first. So
    a second ``LLM`` in the same process can form its own group once the first is closed or dropped.
    """

    def __init__(self, model: str, kernel_choice: KernelChoice | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), kernel_choice)
        # Holds the engine, not this object: it runs once, at close(), collection or interpreter exit.
        self._finalizer = weakref.finalize(self, self.engine.close)

    def close(self) -> None:
        """Stop the engine's other ranks and leave its process group (nothing to do for one process);
        calling it again does nothing. The object generates no more afterwards."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        images: Sequence[Sequence] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        ``prompts`` is one prompt or a list; a prompt is a string or a list of
        token ids. ``sampling_params`` is one for all or one per prompt. A prompt
        whose params ask for ``n`` > 1 gives its n choices, by ``index``, in its place.
        ``images``: for a model that reads them, each prompt's images (``LLMEngine.add_request``), one list per
        prompt.
        """
        if self.closed:
            raise RuntimeError("this LLM is closed; make a new one")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        # Validate everything before queueing anything, so a bad prompt leaves no half-run batch.
        token_prompts = [self.engine.prepare_prompt(p) for p in prompts]
        images = [()] * len(prompts) if images is None else list(images)
        if len(images) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(images)} lists of images")
        images = [self.engine.prompt_images(p, im) for p, im in zip(token_prompts, images)]
        ids = [self.engine.add_request(p, sp, images=im) for p, sp, im in zip(token_prompts, params, images)]
        whole: dict[tuple[str, int], RequestOutput] = {}  # each choice's outputs so far, merged
        while self.engine.step_needed():  # with data-parallel peers, until none of them has work
            for out in self.engine.step():
                so_far = whole.get((out.request_id, out.index))
                whole[(out.request_id, out.index)] = out if so_far is None else so_far.merge(out)
        return [whole[(i, j)] for i, sp in zip(ids, params) for j in range(sp.n)]
