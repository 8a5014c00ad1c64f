import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from sage_infer.core.sampling_params import SamplingParams
from sage_infer.engine.detokenizer import IncrementalDetokenizer
from sage_infer.models.tokenizer import Tokenizer

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog. STOP here. The end!",
    "你好，世界！我们今天学习中文。汉字很有意思。",
    "Emoji time 🙂🚀🎉👍🏽 and café naïve résumé",
]
SPECIALS = ["<|endoftext|>", "<|im_end|>"]


def build(tmp_path, metaspace=False):
    tok = HFTokenizer(models.BPE())
    if metaspace:  # SentencePiece-style: "▁" marks word starts, the decoder drops the first one
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS)
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=alphabet)
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return Tokenizer.from_dir(tmp_path)


@pytest.fixture
def tokenizer(tmp_path):
    return build(tmp_path)


def stream(tokenizer, ids, **params):
    """Feeds `ids` one by one; returns (deltas including the flush, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], SamplingParams(**params))
    deltas = [detok.step(i) for i in ids]
    deltas.append(detok.flush())
    return deltas, detok


@pytest.mark.parametrize("metaspace", [False, True])
def test_random_sequences_stream_to_the_plain_decode(tmp_path, metaspace):
    tokenizer = build(tmp_path, metaspace)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        deltas, detok = stream(tokenizer, ids)
        assert "".join(deltas) == detok.text == tokenizer.decode(ids), ids


@pytest.mark.parametrize("text", CORPUS)
def test_real_text_streams_back_exactly(tokenizer, text):
    deltas, detok = stream(tokenizer, tokenizer.encode(text))
    assert "".join(deltas) == detok.text == text


def test_multibyte_characters_never_stream_as_replacement_char(tokenizer):
    text = "汉字 🙂🚀🎉👍🏽 naïve"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # tokens really split characters
    deltas, _ = stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_incomplete_character_is_held_back_until_flush(tokenizer):
    emoji_ids = tokenizer.encode("🙂")
    partial = emoji_ids[:-1] if len(emoji_ids) > 1 else None
    assert partial, "the tokenizer should split the emoji into several byte tokens"
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert [detok.step(i) for i in partial] == [""] * len(partial)
    assert detok.flush() == tokenizer.decode(partial)  # the lone bytes come out as U+FFFD at the end


def test_stop_string_spanning_two_tokens(tokenizer):
    text = "Hello world, the quick brown fox"
    ids = tokenizer.encode(text)
    stop = "d, the q"
    assert not any(stop in tokenizer.decode([i]) for i in ids)
    deltas, detok = stream(tokenizer, ids, stop=[stop])
    assert detok.stopped_by == stop
    assert "".join(deltas) == detok.text == "Hello worl"


def test_nothing_after_the_stop_string_appears(tokenizer):
    ids = tokenizer.encode("The end! Hello world")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["end!"]))
    emitted = "".join(detok.step(i) for i in ids) + detok.flush()
    assert emitted == detok.text == "The "
    assert detok.step(tokenizer.encode(" more")[0]) == "" and detok.text == "The "


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode("The end! Hello world")
    deltas, detok = stream(tokenizer, ids, stop="end!", include_stop_str_in_output=True)
    assert "".join(deltas) == detok.text == "The end!"
    assert detok.stopped_by == "end!"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    deltas, detok = stream(tokenizer, tokenizer.encode("the quick brown fox"), stop=["fox", "quick"])
    assert detok.stopped_by == "quick" and "".join(deltas) == "the "


def test_possible_stop_prefix_is_held_back_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP!"]))
    emitted, held = "", False
    for i in tokenizer.encode("Hello STOP here"):
        emitted += detok.step(i)
        if detok.text.endswith("STOP"):
            held = True
            assert emitted == detok.text[: -len("STOP")]
    assert held
    assert emitted + detok.flush() == "Hello STOP here" and detok.stopped_by is None


def test_random_sequences_cut_at_first_stop_occurrence(tokenizer):
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(2, 40))]
        full = tokenizer.decode(ids)
        start = rng.randrange(len(full)) if full else 0
        stop = full[start : start + rng.randrange(1, 6)] or "x"
        deltas, detok = stream(tokenizer, ids, stop=[stop])
        expected = full[: full.find(stop)] if stop in full else full
        assert "".join(deltas) == detok.text == expected, (ids, stop)


def test_text_without_stop_prefix_is_not_held_back(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["zzz"]))
    emitted = "".join(detok.step(i) for i in tokenizer.encode("Hello world"))
    assert emitted == "Hello world"


def test_stop_string_split_across_multibyte_tokens(tokenizer):
    deltas, detok = stream(tokenizer, tokenizer.encode("你好，世界！我们"), stop=["世界"])
    assert detok.stopped_by == "世界" and "".join(deltas) == "你好，"


def test_skip_special_tokens(tokenizer):
    eos = tokenizer.token_to_id("<|im_end|>")
    ids = [*tokenizer.encode("Hello"), eos, *tokenizer.encode(" world")]
    assert "".join(stream(tokenizer, ids)[0]) == "Hello world"
    assert "".join(stream(tokenizer, ids, skip_special_tokens=False)[0]) == "Hello<|im_end|> world"


def test_metaspace_first_token_matches_plain_decode(tmp_path):
    tokenizer = build(tmp_path, metaspace=True)
    ids = tokenizer.encode("Hello world, the quick brown fox")
    deltas, detok = stream(tokenizer, ids)
    assert deltas[0] == tokenizer.decode(ids[:1]) and not deltas[0].startswith(" ")
    assert "".join(deltas) == "Hello world, the quick brown fox"
