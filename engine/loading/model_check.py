"""The model a command is about to serve, checked before any process starts: the demo model written if it is
the one named and missing; a bad checkpoint, a random-weight model its tokenizer does not fit, a model that
cannot be split as the config says, a quantization_config that is not served, or a hybrid model with a setting it is not
served with yet is bad input (ValueError: one line, exit 2)."""

import os

from engine.core.config import EngineConfig


def check_model(config: EngineConfig) -> None:
    """Check ``config``'s model (with ``random_weights``: its spec, and ``tokenizer`` its tokenizer) as laid out
    in its group; writes the demo model on first use."""
    from engine.loading.demo_model import DEFAULT_DEMO_MODEL_DIR, write_demo_model
    from engine.core.model_config import load_model_config

    files = config.tokenizer if config.random_weights is not None else config.model
    if files == DEFAULT_DEMO_MODEL_DIR and not os.path.exists(os.path.join(files, "config.json")):
        print(f"no --model given: writing the random-weight demo model to {files} (its output is random text)")
        write_demo_model(files)
    if config.random_weights is not None:  # the model then only supplies the tokenizer
        from engine.loading.random_weights import random_model_config
        from engine.text.tokenizer import check_vocabulary, load_tokenizer

        model_config = random_model_config(config.random_weights)
        check_vocabulary(load_tokenizer(files), model_config.vocab_size, files)
    else:
        from engine.core.family_support import check_family_support

        model_config = load_model_config(config.model, config.language_model_only)
        # torch (the loader's import) only once the directory holds a model this engine serves: a bad path or
        # architecture is one line without its 2-3 s of CPU.
        from engine.loading.model_loader import checkpoint_files
        from engine.loading.quantization import resolve_scheme

        checkpoint_files(config.model)
        check_family_support(config, model_config)  # a setting the model is not served with yet
        # The checkpoint's quantization_config, and --quantization against it (an INT4 one also against the split).
        resolve_scheme(config.quantization, model_config,
                       expert_split=1 if config.enable_expert_parallel else config.tensor_parallel_size)
    if config.pipeline_parallel_size > 1:  # ValueError when a stage would get no layer
        from engine.distributed.pipeline import stage_layers

        stage_layers(model_config.num_layers, config.pipeline_parallel_size, 0)
    if config.tensor_parallel_size > 1 or config.enable_expert_parallel:
        from engine.loading.split_check import check_split

        check_split(model_config, config)
