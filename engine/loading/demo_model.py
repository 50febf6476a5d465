"""A tiny random-weight Qwen3-MoE checkpoint with a real tokenizer, for trying moegate without downloads.

THE WEIGHTS ARE RANDOM: the model has never been trained, so whatever it
generates is random text (random words and byte fragments). It exists so
that ``LLM(model=DIR)``, the gateway and the load generator can be exercised
end to end with string prompts, streaming text and stop strings, on a CPU,
in seconds. The tokenizer is a genuine byte-level BPE trained in-process on a
short built-in English text, so any Unicode string round-trips.

The output is a complete Hugging Face checkpoint directory: ``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json`` and
``tokenizer_config.json`` (with a Qwen3-style chat template: tools, tool calls and
``<think>`` blocks); transformers loads it too. The same seed writes
byte-identical weights.
"""

import json
import os

# Marks a config.json written here, so a later run may overwrite that directory.
DEFAULT_DEMO_MODEL_DIR = ".moegate/demo-model"  # the Makefile's DEMO_MODEL: `make run` and `moegate serve` agree
DEMO_MARKER = "moegate_demo_model"
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
# Markup of the chat template that is part of the model's text (kept when special tokens are skipped),
# one token each as in the Qwen3 family: reasoning, tool calls and tool results.
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TARGET_VOCAB_SIZE = 1536

# A Qwen3-style chat template (ChatML turns; tools listed in the system turn as JSON, calls written as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, results sent back in <tool_response> blocks of a
# user turn; enable_thinking=false opens the answer with an empty <think> block).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role in ['user', 'system', 'developer'] %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

MODEL_SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    intermediate_size=512,  # dense MLP size; unused since every layer is MoE
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    max_position_embeddings=4096,
    # Larger than the usual 0.02 so logits are spread out: clearer greedy choices, livelier samples.
    initializer_range=0.08,
    tie_word_embeddings=False,
)

# Training text for the tokenizer (original prose written for this file).
CORPUS = """\
The lighthouse keeper woke before the sun, as he had done for thirty years. He climbed the spiral stairs,
counted the one hundred and twelve steps, and wiped the salt from the great glass lens. Outside, the sea
was grey and quiet, and a small fishing boat was already heading out past the rocks.
In the village below, the baker opened her shop at six o'clock. She sold bread, apple cakes, honey buns
and a dark rye loaf that the old sailors liked with butter and cheese. On Saturdays there was a queue
that reached the corner of the market square, where children played near the fountain.
A river runs through the valley and turns an old mill wheel. The miller's daughter keeps a notebook in
which she writes the height of the water every morning: on Monday it was low, on Tuesday it rose after
the rain, and by Friday the meadow by the bridge was a shallow lake full of ducks.
Good soup starts with an onion, a carrot and a stick of celery, cut small and cooked slowly in oil until
they are soft and sweet. Add water or stock, a handful of lentils, salt, pepper and a bay leaf, then let
it simmer for forty minutes. Serve it hot with fresh bread and a little lemon juice.
The garden was planted in April. Tomatoes went along the south wall, beans climbed the wooden poles,
and rows of lettuce, radish and spinach filled the beds near the path. By July the bees were busy in the
lavender and the first strawberries were red enough to pick.
Every winter the school held a science fair. One student built a model volcano, another measured how fast
snow melts in the shade and in the sun, and a third taught a small robot to follow a black line on the
floor. The judges asked careful questions and wrote their notes on yellow cards.
A train leaves the northern station at nine fifteen and arrives in the capital just after noon. The
journey passes forests, frozen lakes and long empty fields. Travellers read books, drink coffee from
paper cups, look out of the window and sometimes fall asleep before the second stop.
Computers follow instructions one step at a time. A program reads its input, keeps some state in memory,
makes decisions with simple tests, repeats work in loops and writes its output. When a program is wrong,
a programmer reads the code again, adds a test that fails, fixes the mistake and runs the tests once more.
A language model reads a sequence of tokens and predicts the next one. A serving engine batches many
requests together, keeps a cache of keys and values for every sequence, and schedules work so that the
processor stays busy. A mixture of experts sends each token to only a few of its expert networks, which
makes a large model cheaper to run than its size suggests.
The weather report said clouds in the morning, sunshine in the afternoon and strong wind from the west
in the evening. Temperatures would stay between twelve and eighteen degrees. Tomorrow will be warmer, with
a chance of thunder late at night.
My grandmother kept letters in a tin box under her bed. They were written in blue ink on thin paper,
some from her brother at sea, some from a friend who moved to another country, and a few from a young man
who later became my grandfather. She read them again every spring and smiled at the same lines.
Numbers appear everywhere: 1, 2, 3, 10, 42, 100, 256, 1024 and 2024. A recipe needs 250 grams of flour,
2 eggs and 0.5 litres of milk. The meeting is at 14:30 in room 7B, and the report is due on 3 March.
Questions are useful. Why is the sky blue? How do birds know where to fly in autumn? What makes bread rise?
Where does the river go after the mill? Who planted the old oak tree on the hill, and when?
The cat slept on the warm windowsill while the dog waited by the door. When the postman came, the dog
barked twice, the cat opened one eye, and a letter with a foreign stamp fell onto the mat.
Learning to play the piano takes patience. First you learn the names of the keys, then simple scales,
then short pieces with both hands. After many months the fingers move on their own, and music becomes a
way of thinking rather than a list of notes.
"""


def _train_tokenizer():
    """A byte-level BPE tokenizer trained on CORPUS (deterministic: same corpus, same merges)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def _save_tokenizer(tokenizer, path: str, chat_template: str) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (EOS, no BOS, ``chat_template``) in ``path``."""
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_SHAPE["max_position_embeddings"],
        "chat_template": chat_template,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f, indent=2)
        f.write("\n")


def write_demo_tokenizer(path: str, chat_template: str = CHAT_TEMPLATE) -> tuple[int, int]:
    """Write the demo tokenizer with ``chat_template`` to the directory ``path`` (beside a tiny checkpoint of any
    family, to serve chats with it); returns (its vocabulary size, its EOS id) for that checkpoint's config."""
    tokenizer = _train_tokenizer()
    os.makedirs(path, exist_ok=True)
    _save_tokenizer(tokenizer, path, chat_template)
    return tokenizer.get_vocab_size(with_added_tokens=True), tokenizer.token_to_id(EOS_TOKEN)


def _is_demo_dir(path: str) -> bool:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return bool(json.load(f).get(DEMO_MARKER))
    except (OSError, ValueError, AttributeError):
        return False


def write_demo_model(path: str, seed: int = 0) -> None:
    """Write a small random-weight Qwen3-MoE checkpoint (about 8M parameters, float32) to ``path``.

    The weights are random, so generated text is random: this is a model for
    trying out and testing the serving stack, not for reading its answers.
    The tokenizer is a real byte-level BPE (``<|endoftext|>`` is EOS). The same
    ``seed`` gives the same weights; the global torch RNG is left untouched.

    Raises ValueError if ``path`` is a file, or a non-empty directory that is
    not a previously written demo model (which is overwritten).
    """
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"{path}: exists and is not a directory")
        if os.listdir(path) and not _is_demo_dir(path):
            raise ValueError(f"{path}: directory is not empty and holds no demo model; choose a new or empty directory")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    tokenizer = _train_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=vocab_size, eos_token_id=eos_id, bos_token_id=None, pad_token_id=eos_id, **MODEL_SHAPE
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    setattr(config, DEMO_MARKER, True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None)

    os.makedirs(path, exist_ok=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar for a 30 MB file
    try:
        model.save_pretrained(path)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    _save_tokenizer(tokenizer, path, CHAT_TEMPLATE)
