"""IncrementalDetokenizer against whole-sequence decoding, and stop strings end to end on the demo model.

Tokenizers: the demo model's byte-level BPE, a byte-level BPE trained here with a
tiny vocabulary (so accented letters, CJK and emoji are split across tokens), and
a SentencePiece-style one (Metaspace "▁" + byte fallback, as Mixtral's) whose
decoder strips a leading space, which the prompt context must compensate.
"""

import functools
import json
import random

import pytest

from engine import LLM, SamplingParams
from engine.core.outputs import OutputProcessor
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import RequestUpdate
from engine.loading.demo_model import write_demo_model
from engine.text.tokenizer import IncrementalDetokenizer

SEED = random.randrange(2**31)  # fresh draws each run; every message names the seed

WORDS = (
    "the a lighthouse keeper sea bread river garden model token engine héllo wörld naïve café crème brûlée "
    "Straße Ελληνικά русский текст 日本語 東京 中文字符 한국어 🙂 🎉 👍🏽 ∑ → ½ — “quoted” 12 3.5 , . ! ? :"
).split()
SEPARATORS = [" ", " ", " ", " ", "\n", ", ", "  ", "\t"]


def random_text(rng: random.Random, n_words: int) -> str:
    out = [rng.choice(WORDS)]
    for _ in range(n_words - 1):
        out.append(rng.choice(SEPARATORS))
        out.append(rng.choice(WORDS))
    return "".join(out)


def _wrap(tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )


def byte_level_tokenizer(corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return _wrap(tok)


def metaspace_tokenizer(corpus: list[str]):
    """BPE over "▁"-marked words; characters outside a small alphabet fall back to <0xNN> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=250, limit_alphabet=40, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return _wrap(tok)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("demo"))
    write_demo_model(path, seed=SEED)
    return LLM(model=path, max_num_batched_tokens=64, dtype="float32", device="cpu", num_kv_blocks=64)


@pytest.fixture(scope="module", params=["demo", "bytelevel", "metaspace"])
def tokenizer(request):
    if request.param == "demo":
        return request.getfixturevalue("demo").tokenizer
    rng = random.Random(SEED)
    corpus = [random_text(rng, 12) for _ in range(300)]
    return byte_level_tokenizer(corpus) if request.param == "bytelevel" else metaspace_tokenizer(corpus)


def stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=True, rng=None):
    """Feed output_ids as the engine does (one per step; in random chunks if rng): deltas and the flush."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas, i = [], 0
    while i < len(output_ids):
        n = rng.randint(1, 4) if rng else 1
        deltas.append(detok.add(output_ids[i:i + n]))
        i += n
    return deltas, detok.flush()


def expected_text(tokenizer, prompt_ids, output_ids, skip=True) -> str:
    """The output's text as the continuation of the prompt (what decode(prompt + output) adds)."""
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=skip)
    full = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=skip)
    assert full.startswith(prompt_text)
    return full[len(prompt_text):]


CONTEXT = IncrementalDetokenizer._CONTEXT_TOKENS


def mid_character_case():
    """A prompt ending in byte-fallback characters, continued by more of them.

    The detokenizer seeds its window with the prompt's last tokens; here they
    start inside "中" (<0xE4><0xB8><0xAD>). Byte fallback decodes a run of byte
    tokens all or nothing, so the stray <0xAD> turns the whole run, including
    the output's own complete characters, into U+FFFD.
    """
    tok = metaspace_tokenizer(["the lighthouse keeper woke before the sun and climbed the stairs"] * 20)
    prompt_ids = tok.encode("the keeper 中文")
    output_ids = tok.encode("the 字符")[-6:]  # the six byte tokens of "字符"
    return tok, prompt_ids, output_ids


def test_mid_character_case_is_what_it_claims():
    tok, prompt_ids, output_ids = mid_character_case()
    assert tok.convert_ids_to_tokens(prompt_ids[-CONTEXT:])[0] == "<0xAD>"
    assert tok.convert_ids_to_tokens(output_ids) == ["<0xE5>", "<0xAD>", "<0x97>", "<0xE7>", "<0xAC>", "<0xA6>"]
    assert expected_text(tok, prompt_ids, output_ids) == tok.decode(output_ids) == "字符"


def test_byte_fallback_context_starting_mid_character():
    tok, prompt_ids, output_ids = mid_character_case()
    deltas, tail = stream(tok, prompt_ids, output_ids)
    assert "".join(deltas) + tail == "字符"


def test_multibyte_characters_are_split_across_tokens(tokenizer):
    # Otherwise the tests below would not exercise held-back partial characters.
    ids = tokenizer.encode("日本語 🙂 👍🏽 𝄞")  # 𝄞 is in no training text: it must be split
    assert any("\ufffd" in tokenizer.decode(ids[:k]) for k in range(1, len(ids)))


@pytest.mark.parametrize("chunked", [False, True], ids=["one_by_one", "chunks"])
def test_real_text_streams_like_full_decode(tokenizer, chunked):
    rng = random.Random(SEED + chunked)
    byte_level = "▁" not in "".join(tokenizer.convert_ids_to_tokens(tokenizer.encode("a b")))
    for case in range(40):
        # A string prompt ends on a character boundary: split the text where the prefix decodes cleanly.
        ids = tokenizer.encode(random_text(rng, rng.randint(2, 25)))
        cuts = [k for k in range(1, len(ids)) if "\ufffd" not in tokenizer.decode(ids[:k])]
        k = rng.choice(cuts) if cuts else 0
        if rng.random() < 0.2:
            k = 0  # no prompt context at all
        prompt_ids, output_ids = ids[:k], ids[k:]
        full = tokenizer.decode(ids)
        assert "\ufffd" not in full
        want = expected_text(tokenizer, prompt_ids, output_ids)
        if byte_level:  # byte-level decoding is plain concatenation: the output decodes on its own
            assert want == tokenizer.decode(output_ids)
        deltas, tail = stream(tokenizer, prompt_ids, output_ids, rng=rng if chunked else None)
        msg = f"seed={SEED} case={case} prompt={prompt_ids} output={output_ids} deltas={deltas}"
        text = ""
        for d in deltas:
            assert "\ufffd" not in d, msg
            text += d
            assert want.startswith(text), msg
        assert tail == "", msg  # the last token completed the text: nothing left to flush
        assert text == want, msg


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
def test_random_tokens_concatenate_to_full_decode(tokenizer, skip):
    """Any ids (stray bytes, special tokens): deltas + flush == what decoding adds to the prompt's text; a
    prompt's bytes of a character it does not complete are left out of that (the output's text is its own)."""
    rng = random.Random(SEED + 7 + skip)
    vocab = tokenizer.get_vocab()
    byte_ids = {vocab[f"<0x{b:02X}>"] for b in range(256) if f"<0x{b:02X}>" in vocab}
    # Byte fallback decodes a run of byte tokens all or nothing: one invalid byte turns the whole
    # run (even a complete character before it) into U+FFFD, so no prefix of it is ever final.
    # There, draw whole characters as byte runs and other tokens at random; elsewhere, any id.
    ids = [i for i in range(len(tokenizer)) if i not in byte_ids]
    chars = sorted({c for w in WORDS for c in w if len(c.encode()) > 1})
    byte_tok = [vocab[f"<0x{b:02X}>"] for b in range(256)] if byte_ids else byte_level_ids(tokenizer)
    for case in range(40):
        prompt_ids = tokenizer.encode(random_text(rng, rng.randint(1, 6))) if rng.random() < 0.8 else []
        cut = []
        if prompt_ids and rng.random() < 0.4:  # a token-id prompt that ends inside a character keeps those bytes
            prompt_ids = tokenizer.encode(random_text(rng, rng.randint(1, 6)) + " the")
            raw = rng.choice(chars).encode()
            cut = [byte_tok[b] for b in raw[:rng.randint(1, len(raw) - 1)]]
        output_ids, n = [], rng.randint(1, 30)
        while len(output_ids) < n:
            if byte_ids and rng.random() < 0.3:
                output_ids += [vocab[f"<0x{b:02X}>"] for b in rng.choice(chars).encode()]
            else:
                output_ids.append(rng.choice(ids))
        want = expected_text(tokenizer, prompt_ids, output_ids, skip)
        if not byte_ids:  # byte-level: that is simply the output's own decode
            assert want == tokenizer.decode(output_ids, skip_special_tokens=skip)
        deltas, tail = stream(tokenizer, prompt_ids + cut, output_ids, skip, rng=rng if case % 2 else None)
        msg = f"seed={SEED} case={case} prompt={prompt_ids}+{cut} output={output_ids}"
        assert "".join(deltas) + tail == want, msg
        if "\ufffd" not in want:
            assert "\ufffd" not in "".join(deltas) + tail, msg


# ---- stop strings, end to end -------------------------------------------------------------

PROMPT = "The river runs through the valley and"


def greedy(max_tokens: int, stop=None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop=stop)


def test_stop_string_in_the_middle(demo):
    rng = random.Random(SEED + 11)
    base = demo.generate(PROMPT, greedy(24))[0]
    text = base.text
    assert base.finish_reason == "length" and len(text) >= 6, f"seed={SEED} text={text!r}"
    msg = f"seed={SEED} text={text!r}"
    start = rng.randrange(len(text) // 3, 2 * len(text) // 3)
    stop = text[start:start + rng.randint(2, 4)]
    other = text[-3:]  # a second stop string: the earliest occurrence of either wins
    first = min((text.find(s), s) for s in (stop, other))
    out = demo.generate(PROMPT, greedy(24, stop=[other, stop]))[0]
    assert out.finish_reason == "stop", msg
    assert out.text == text[:first[0]], msg
    assert out.stop_reason == first[1], msg
    assert base.token_ids[:len(out.token_ids)] == out.token_ids, msg
    assert len(out.token_ids) <= len(base.token_ids)


def test_streamed_deltas_never_show_the_stop_string(demo):
    rng = random.Random(SEED + 13)
    text = demo.generate(PROMPT, greedy(24))[0].text
    start = rng.randrange(len(text) // 2, len(text) - 3)
    stop = text[start:start + 3]
    engine = demo.engine
    rid = engine.add_request(PROMPT, greedy(24, stop=stop))
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            deltas.append(out.text)
            final = out if final is None else final.merge(out)
    msg = f"seed={SEED} text={text!r} stop={stop!r} deltas={deltas}"
    assert final.finished and final.finish_reason == "stop", msg
    assert "".join(deltas) == final.text == text[:text.find(stop)], msg
    assert all(stop not in d for d in deltas), msg


def test_stop_string_completed_by_the_last_token(demo):
    """A stop string that appears only with the last allowed token still ends the request as "stop"."""
    base = demo.generate(PROMPT, greedy(16))[0]
    text = base.text
    # The shortest tail that does not occur earlier in the text.
    stop = next((text[-n:] for n in range(1, len(text) + 1) if text.find(text[-n:]) == len(text) - n), None)
    msg = f"seed={SEED} text={text!r} stop={stop!r}"
    assert stop, msg
    out = demo.generate(PROMPT, greedy(16, stop=[stop]))[0]
    assert out.text == text[:len(text) - len(stop)], msg
    assert out.stop_reason == stop, msg
    assert out.finish_reason == "stop", msg


# ---- the demo model's tokenizer on any ids: prompts ending inside a character, stray bytes -------------------

@functools.cache  # once per tokenizer: every random_ids call asks
def byte_level_ids(tokenizer) -> list[int]:
    """The id of each byte's own token in a byte-level BPE: GPT-2's printable spelling of the 256 bytes."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    spelled, extra = [], 0
    for b in range(256):
        if b in printable:
            spelled.append(chr(b))
        else:
            spelled.append(chr(256 + extra))
            extra += 1
    vocab = tokenizer.get_vocab()
    return [vocab[c] for c in spelled]


def random_ids(tokenizer, rng: random.Random, n: int) -> list[int]:
    """``n`` or a few more ids of every kind: lead and continuation bytes alone, whole and cut multi-byte
    characters as byte tokens, special and markup tokens, and any id at all."""
    byte_tok = byte_level_ids(tokenizer)
    chars = sorted({c for w in WORDS for c in w if len(c.encode()) > 1})
    special = tokenizer.all_special_ids + tokenizer.convert_tokens_to_ids(["<think>", "</tool_call>"])
    out = []
    while len(out) < n:
        r = rng.random()
        if r < 0.15:
            out.append(byte_tok[rng.randrange(0xC2, 0xF5)])  # a lead byte
        elif r < 0.3:
            out.append(byte_tok[rng.randrange(0x80, 0xC0)])  # a continuation byte
        elif r < 0.5:
            raw = rng.choice(chars).encode()
            out += [byte_tok[b] for b in raw[:rng.randint(1, len(raw))]]  # a character, whole or cut short
        elif r < 0.6:
            out.append(rng.choice(special))
        else:
            out.append(rng.randrange(len(tokenizer)))
    return out


def test_demo_tokenizer_any_ids_stream_like_decoding_the_output(demo):
    """The served tokenizer (the engine's own, byte-level): deltas + flush are ``decode(output)`` for any prompt
    and output: a prompt ending in an incomplete character keeps its bytes (the output's first continuation
    bytes are U+FFFD, as in the output decoded alone), stray and cut characters anywhere, special tokens
    skipped or kept, tokens added one by one or in chunks."""
    tok = demo.tokenizer
    byte_tok = byte_level_ids(tok)
    assert tok.decode([byte_tok[b] for b in "é€🙂".encode()]) == "é€🙂"  # the byte tokens are what they claim
    assert tok.decode([byte_tok[0xE2]]) == tok.decode([byte_tok[0x82]]) == "\ufffd"
    kinds = set()
    for seed in range(500):
        rng = random.Random(seed)
        prompt = random_ids(tok, rng, rng.randint(0, 12))
        if rng.random() < 0.5:  # the prompt ends inside a character
            raw = rng.choice(["€", "🙂", "日", "é", "👍🏽"]).encode()
            prompt += [byte_tok[b] for b in raw[:rng.randint(1, len(raw) - 1)]]
        output = random_ids(tok, rng, rng.randint(1, 24))
        if rng.random() < 0.5:  # and the output starts with continuation bytes (of that character, maybe)
            output = [byte_tok[rng.randrange(0x80, 0xC0)] for _ in range(rng.randint(1, 3))] + output
        skip = rng.random() < 0.5
        deltas, tail = stream(tok, prompt, output, skip, rng=rng if seed % 2 else None)
        want = tok.decode(output, skip_special_tokens=skip)
        assert "".join(deltas) + tail == want, f"seed={seed} prompt={prompt} output={output} skip={skip} " \
                                               f"deltas={deltas} tail={tail!r} want={want!r}"
        kinds.add((want.startswith("\ufffd"), want.endswith("\ufffd"), tail != ""))
    # Outputs with and without a leading and a trailing U+FFFD, alone and together; a flush gives text exactly
    # when the output ends in U+FFFD (an incomplete character held back until the end).
    assert kinds == {(lead, trail, trail) for lead in (False, True) for trail in (False, True)}


class _Scheduler:
    """What the output processor asks of the scheduler: to end a request (a stop string completed)."""

    def __init__(self) -> None:
        self.finished: list[tuple[str, RequestStatus]] = []

    def finish(self, request_id: str, status: RequestStatus) -> None:
        self.finished.append((request_id, status))


def test_output_processor_text_at_the_end_and_at_stop_strings(demo):
    """The engine's output path (OutputProcessor) on the demo tokenizer, with prompts ending inside a character
    and random outputs fed in steps of one token or several (speculative), ending by length, by EOS or by a
    stop string drawn from the output's own text (U+FFFD of a character cut short included): the streamed
    deltas add up to the output's text, ``decode(output)`` (less an ending EOS) cut before the first stop string,
    and no delta shows a stop string."""
    tok = demo.tokenizer
    byte_tok = byte_level_ids(tok)
    eos = tok.eos_token_id
    seen = set()
    for seed in range(300):
        rng = random.Random(seed)
        prompt = random_ids(tok, rng, rng.randint(1, 10))
        if rng.random() < 0.5:
            raw = rng.choice(["€", "🙂", "日"]).encode()
            prompt += [byte_tok[b] for b in raw[:rng.randint(1, len(raw) - 1)]]
        output = [byte_tok[rng.randrange(0x80, 0xC0)]] * (rng.random() < 0.5)  # a continuation byte first, or not
        output += random_ids(tok, rng, rng.randint(1, 16))
        output = [t for t in output if t != eos] or [byte_tok[0xE2]]
        end = rng.choice(["length", "eos", "stop"])
        if end == "eos":
            output.append(eos)
        text_ids = output[:-1] if end == "eos" else output
        skip = rng.random() < 0.5
        whole = tok.decode(text_ids, skip_special_tokens=skip)
        stop = None
        if end == "stop" and whole:
            i = rng.randrange(len(whole))
            stop = whole[i:i + rng.randint(1, 3)]
        params = SamplingParams(temperature=0, max_tokens=len(output), ignore_eos=end != "eos",
                                skip_special_tokens=skip, stop=[stop] if stop else None)
        request = Request(f"r{seed}", prompt, params, max_tokens=len(output), eos_token_id=eos)
        request.status = RequestStatus.RUNNING
        processor, scheduler = OutputProcessor(tok), _Scheduler()
        processor.add_request(request)
        deltas, final, i = [], None, 0
        while final is None or not final.finished:
            step = output[i:i + (rng.randint(1, 4) if seed % 2 else 1)]
            i += len(step)
            for t in step:
                request.append_output_token(t)
            if i == len(output):
                request.status = RequestStatus.FINISHED_STOPPED if end == "eos" else RequestStatus.FINISHED_LENGTH
            out, = processor.process([RequestUpdate(request, step, i == len(output))], scheduler)
            deltas.append(out.text)
            final = out if final is None else final.merge(out)
        msg = f"seed={seed} prompt={prompt} output={output} skip={skip} stop={stop!r} deltas={deltas}"
        if stop:
            want = whole[:whole.find(stop)]
            assert final.finish_reason == "stop" and final.stop_reason == stop, msg
            assert scheduler.finished == [(request.request_id, RequestStatus.FINISHED_STOPPED)], msg
            kept = final.token_ids  # up to the token that completed the stop string (a step's later ones dropped)
            assert kept == output[:len(kept)] and stop in tok.decode(kept, skip_special_tokens=skip), msg
            assert all(stop not in d for d in deltas), msg
        else:
            want = whole
            assert final.finish_reason == ("stop" if end == "eos" else "length"), msg
        assert "".join(deltas) == final.text == want, msg
        seen.add((end, whole.startswith("\ufffd"), whole.endswith("\ufffd")))
    assert len(seen) == 12  # every ending, with and without a leading and a trailing U+FFFD
