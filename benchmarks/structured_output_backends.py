"""xgrammar vs llguidance for JSON-schema constrained decoding, side by side in one run.

For each library and vocabulary (the demo model's 1.5k-token BPE, a 32k-token BPE trained here on
synthetic text, the size class of Mixtral's tokenizer, and a 150k-token byte-level vocabulary generated as
a list, Qwen's size class), prints:
- compile: the time to turn each schema into something that can mask tokens (cold), and again (cached);
- mask: the time to fill one request's next-token bitmask (and so a whole step of 1, 16, 64 requests),
  while each request walks a random valid path through its schema;
- valid: how many of the walks ended in text that parses and validates against its schema (jsonschema).

    pip install xgrammar==0.2.8   # not a moegate dependency: only this comparison uses it
    python -m benchmarks.structured_output_backends [--steps 60] [--show-invalid]
"""

import argparse
import json
import random
import string
import tempfile
import time

import jsonschema
import torch

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                              "age": {"type": "integer"}, "ok": {"type": "boolean"}},
             "required": ["name", "age", "ok"], "additionalProperties": False},
    "enum+array": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
        "required": ["colour", "tags"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0}, "email": {"type": "string", "maxLength": 20},
            "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}}},
            "required": ["id", "email", "roles"], "additionalProperties": False},
        "score": {"type": "number"}},
        "required": ["user", "score"], "additionalProperties": False},
    "strict-anyOf": {"type": "object", "properties": {
        "result": {"anyOf": [
            {"type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"],
             "additionalProperties": False},
            {"type": "object", "properties": {"error": {"type": "string", "maxLength": 10}}, "required": ["error"],
             "additionalProperties": False}]}},
        "required": ["result"], "additionalProperties": False},
}


def _tokenizers():
    """(name, transformers tokenizer) for the demo vocabulary and a 32k one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from engine.loading.demo_model import write_demo_model

    demo_dir = tempfile.mkdtemp()
    write_demo_model(demo_dir)
    out = [("demo-1.5k", AutoTokenizer.from_pretrained(demo_dir))]

    rng = random.Random(0)
    syllables = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    lines = [" ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(20))
             + rng.choice(['{"a": 1}', "[1, 2]", '"x": "y",', ""]) for _ in range(40000)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=32000, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    big = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    out.append((f"bpe-{len(big) // 1000}k", big))
    out.append(("list-150k", _listed_vocab(150_000, rng)))
    return out


def _listed_vocab(size: int, rng: random.Random):
    """A byte-level vocabulary of ``size`` tokens (Qwen's size class) from a generated list: the 256 bytes,
    JSON punctuation pieces, then random strings of letters, digits and JSON punctuation, half with a
    leading space, as real large vocabularies hold. No merges: only the tokens' bytes matter for masking."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for piece in ['{"', '":', '",', '"}', '},', '[{', '}]', '":"', '":[', '":{', "00", "000", "true", "false", "null"]:
        vocab.setdefault(piece, len(vocab))
    chars = string.ascii_lowercase + string.digits + '_"{}[],:.'
    while len(vocab) < size:
        word = "".join(rng.choice(chars) for _ in range(rng.randint(2, 10)))
        vocab.setdefault(("\u0120" if rng.random() < 0.5 else "") + word, len(vocab))  # U+0120: byte-level space
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self.vocab = len(tokenizer)

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema, any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
        self.vocab = len(tokenizer)
        self.cache: dict[str, str] = {}

    def compile(self, schema: str):
        grammar = self.cache.get(schema)
        if grammar is None:  # llguidance builds its parser lazily; validating is the up-front work
            grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
            error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
            assert not error, error
            self.cache[schema] = grammar
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def matcher(self, compiled):
        return compiled.deep_copy()

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.llg.torch.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matcher, bitmask, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = ((bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]  # [V]
    return bits.nonzero().flatten().tolist()


def run(steps: int, show_invalid: bool) -> None:
    torch.set_num_threads(1)
    print(f"{'library':11} {'vocab':10} {'schema':13} {'compile ms':>10} {'cached ms':>9}")
    walks: list[tuple[str, str, object, list]] = []
    for vocab_name, tokenizer in _tokenizers():
        eos = tokenizer.eos_token_id
        for cls in (XGrammar, LLGuidance):
            lib = cls(tokenizer)
            compiled = {}
            for schema_name, schema in SCHEMAS.items():
                text = json.dumps(schema)
                t0 = time.perf_counter()
                compiled[schema_name] = lib.compile(text)
                cold = (time.perf_counter() - t0) * 1e3
                t0 = time.perf_counter()
                lib.compile(text)
                warm = (time.perf_counter() - t0) * 1e3
                print(f"{lib.name:11} {vocab_name:10} {schema_name:13} {cold:10.2f} {warm:9.3f}")
            walks.append((lib.name, vocab_name, lib, compiled, tokenizer, eos))

    print(f"\n{'library':11} {'vocab':10} {'batch':>5} {'us/row':>10} {'ms/full step':>12} {'valid':>7}")
    for name, vocab_name, lib, compiled, tokenizer, eos in walks:
        for batch in (1, 16, 64):
            rng = random.Random(batch)
            names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(batch)]
            matchers = [lib.matcher(compiled[n]) for n in names]
            texts: list[list[int]] = [[] for _ in range(batch)]
            finished = [False] * batch
            bitmask = lib.bitmask(batch)
            fill_s, fills = 0.0, 0
            for _ in range(steps):
                t0 = time.perf_counter()
                for row, m in enumerate(matchers):
                    if not finished[row]:
                        lib.fill(m, bitmask, row)
                        fills += 1
                fill_s += time.perf_counter() - t0
                for row, m in enumerate(matchers):
                    if finished[row]:
                        continue
                    allowed = _allowed(bitmask[row], lib.vocab)
                    # Prefer ending: EOS when allowed, else a random allowed token (biased towards short ones).
                    token = eos if eos in allowed else rng.choice(allowed)
                    assert lib.accept(m, token), (name, token)
                    if token != eos:
                        texts[row].append(token)
                    finished[row] = token == eos or lib.done(m)
            valid = 0
            for row, n in enumerate(names):
                if not finished[row]:
                    continue
                try:
                    jsonschema.validate(json.loads(tokenizer.decode(texts[row])), SCHEMAS[n])
                    valid += 1
                except (ValueError, jsonschema.ValidationError) as e:
                    if show_invalid:
                        print(f"  invalid ({name}, {n}): {tokenizer.decode(texts[row])!r}: {str(e)[:80]}")
            per_row_us = fill_s / max(fills, 1) * 1e6
            print(f"{name:11} {vocab_name:10} {batch:5d} {per_row_us:10.1f} {per_row_us * batch / 1e3:12.3f} "
                  f"{valid:3d}/{sum(finished):<3d}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="decode steps walked per batch")
    parser.add_argument("--show-invalid", action="store_true", help="print each output that failed validation")
    args = parser.parse_args()
    run(args.steps, args.show_invalid)
