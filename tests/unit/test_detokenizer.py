import random

import pytest

from pagedserve.replicas.core.detokenizer import (
    IncrementalDetokenizer, TokenDecoder, find_stop_string,
)
from tests.tiny_models import build_tokenizer

WORDS = ["hello", "world", "the", "quick", "é", "ü", "日本", "語", "🙂", "naïve", "code",
         "Paris", "stop", "STOP", "4", "\n", "  ", "ok."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def random_text(rng: random.Random, num_words: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(num_words))


def random_ids(rng: random.Random, tokenizer, num_words: int, specials: bool) -> list[int]:
    ids = []
    for _ in range(rng.randint(1, 4)):
        ids += tokenizer.encode(random_text(rng, num_words // 4 + 1), add_special_tokens=False)
        if specials:
            ids.append(rng.choice(tokenizer.all_special_ids))
    return ids


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Feed ids in random-sized chunks; returns the pieces append() returned."""
    pieces, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        pieces.append(detok.append(ids[i:i + n]))
        i += n
    return pieces


# ---- incremental decoding -------------------------------------------------------------------

@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("spaces_between_special_tokens", [True, False])
def test_streamed_text_equals_full_decode(tokenizer, skip_special_tokens,
                                          spaces_between_special_tokens):
    rng = random.Random(int(skip_special_tokens) * 2 + int(spaces_between_special_tokens))
    for _ in range(60):
        prompt = random_ids(rng, tokenizer, 6, specials=True)
        output = random_ids(rng, tokenizer, 12, specials=True)
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens,
                                       spaces_between_special_tokens)
        pieces = stream(detok, output, rng)
        expected = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) == detok.text == expected
        assert all("\ufffd" not in piece for piece in pieces)
        assert detok.num_output_tokens == len(output)


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("日🙂", add_special_tokens=False)
    assert len(ids) > 2  # byte-level pieces of multi-byte characters
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("say", add_special_tokens=False))
    pieces = [detok.append([token_id]) for token_id in ids]
    assert [p for p in pieces if p] == ["日", "🙂"]
    assert pieces[-1] == "🙂"


def test_random_bytes_never_emit_a_broken_tail(tokenizer):
    rng = random.Random(7)
    vocab = range(3, len(tokenizer))
    for _ in range(100):
        output = [rng.choice(vocab) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tokenizer, random_ids(rng, tokenizer, 4, specials=False))
        stream(detok, output, rng)
        full = tokenizer.decode(output)
        assert full.startswith(detok.text)
        assert full == detok.text or full.endswith("\ufffd")


def test_long_output_keeps_working_past_the_window_trim(tokenizer):
    text = "hello 日本 world 🙂 naïve " * 60
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    assert "".join(detok.append([t]) for t in ids) == text


def test_stop_terminated_leaves_out_the_stop_token(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("hello world", add_special_tokens=False) + [eos]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    detok.append(ids[:-1])
    assert detok.append(ids[-1:], stop_terminated=True) == ""
    assert detok.text == "hello world" and detok.num_output_tokens == len(ids)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False,
                                   include_stop_str_in_output=True)
    detok.append(ids, stop_terminated=True)
    assert detok.text == "hello world<|im_end|>"


def test_decode_token_matches_single_id_decode(tokenizer):
    decoder = TokenDecoder(tokenizer)
    for token_id in [0, 2, 50, 165, 300, len(tokenizer) - 1]:
        assert decoder.decode_token(token_id) == tokenizer.decode([token_id])
    assert decoder(tokenizer.eos_token_id) == "<|im_end|>"


# ---- stop strings ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,num_new,stop,include,expected", [
    ("hello world", 5, ["wor"], False, ("wor", 6)),
    ("hello world", 5, ["wor"], True, ("wor", 9)),
    ("hello world", 5, ["lo w"], False, ("lo w", 3)),  # spans old and new text
    ("hello world", 3, ["hello"], False, None),  # entirely in old text: already searched
    ("hello world", 3, ["o w"], False, None),  # completed before the new text
    ("abcdef", 6, ["cd", "ab"], False, ("ab", 0)),  # earliest wins, not list order
    ("abcdef", 6, ["bcd", "abcde"], False, ("bcd", 1)),  # completes first
    ("abcdef", 6, ["bc", "abc"], True, ("abc", 3)),  # same end: the longer one
    ("abc", 0, ["abc"], False, None),
    ("abc", 3, [], False, None),
])
def test_find_stop_string(text, num_new, stop, include, expected):
    assert find_stop_string(text, num_new, stop, include) == expected


def test_stop_string_spanning_tokens_cuts_exactly(tokenizer):
    ids = tokenizer.encode("hello world the quick", add_special_tokens=False)
    assert not any("o w" in tokenizer.decode([t]) for t in ids)  # spans two tokens
    for include, expected in [(False, "hell"), (True, "hello w")]:
        detok = IncrementalDetokenizer(tokenizer, [], stop=["o w", "quick"],
                                       include_stop_str_in_output=include)
        for token_id in ids:
            detok.append([token_id])
        assert detok.stop_str == "o w" and detok.text == expected
        assert detok.visible_text(finished=False) == expected


def test_stop_string_in_one_multi_token_append(tokenizer):
    ids = tokenizer.encode("the quick 日本 fox", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["fox", "日本"])
    assert detok.append(ids) == "the quick "
    assert detok.stop_str == "日本" and detok.append(ids) == ""


def test_min_tokens_defers_stop_strings(tokenizer):
    ids = tokenizer.encode("stop stop", add_special_tokens=False)
    first = len(tokenizer.encode("stop", add_special_tokens=False))
    detok = IncrementalDetokenizer(tokenizer, [], stop=["stop"], min_tokens=first)
    for token_id in ids:
        detok.append([token_id])
    assert detok.stop_str == "stop" and detok.text == "stop "


@pytest.mark.parametrize("include", [False, True])
def test_hold_back_never_streams_what_is_later_cut(tokenizer, include):
    rng = random.Random(int(include))
    for trial in range(150):
        text = random_text(rng, 15)
        start = rng.randrange(len(text))
        stop = [text[start:start + rng.randint(1, 6)], rng.choice(WORDS).strip() or "x"]
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, [], stop=stop, include_stop_str_in_output=include)
        seen = []
        for token_id in ids:
            detok.append([token_id])
            seen.append(detok.visible_text(finished=False))
            if detok.stop_str is not None:
                break
        final = detok.visible_text(finished=True)
        assert all(final.startswith(s) for s in seen)
        if detok.stop_str is None:
            assert final == text
        elif include:
            assert final.endswith(detok.stop_str)
            assert not any(s in final[:-1] for s in stop)
        else:
            assert not any(s in final for s in stop) and text.startswith(final)
            assert text[len(final):].startswith(detok.stop_str)


def test_no_spaces_between_consecutive_special_tokens():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.decoder = decoders.WordPiece()  # joins words with spaces, specials included
    wordpiece.add_special_tokens(["[CLS]", "[SEP]"])
    ids = [3, 1, 2, 4, 5, 2]
    texts = {}
    for spaces in (True, False):
        detok = IncrementalDetokenizer(wordpiece, [3], skip_special_tokens=False,
                                       spaces_between_special_tokens=spaces)
        texts[spaces] = "".join(detok.append([t]) for t in ids)
    assert texts == {True: " hello [CLS] [SEP] worlds [SEP]",
                     False: " hello [CLS][SEP] worlds [SEP]"}


# ---- many tokens at once (a coalesced stream's delta, decoded in the ingress) -----------------

def _sentencepiece_like():
    """Llama-2's decoding: "▁" for spaces, bytes for characters outside the vocabulary, the
    window's first leading space stripped."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz.", "lo", "wo", "wor"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("l", "o"), ("w", "o"), ("wo", "r")],
                               byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def _wordpiece_like():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(
        ["hello", "world", "the", "quick", "##s", "##ing", ".", ",", "stop", "na", "##ive"])}}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return tok


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece", "wordpiece"])
def test_many_tokens_at_once_give_the_token_by_token_text(tokenizer, kind):
    tok = {"byte-level": tokenizer, "sentencepiece": _sentencepiece_like(),
           "wordpiece": _wordpiece_like()}[kind]
    texts = [random_text(random.Random(i), 12) for i in range(40)]
    if kind == "wordpiece":
        texts = ["the quick hellos, naive world. stop walking" * 3, "hello.world,the"]
    rng = random.Random(3)
    for text in texts:
        encode = (tok.encode(text, add_special_tokens=False) if kind == "byte-level"
                  else tok.encode(text).ids)
        cut = 3  # a prompt made from text ends on a character's edge
        while (kind == "sentencepiece" and cut < len(encode)
               and 0x80 <= _byte(tok, encode[cut]) < 0xC0):
            cut += 1
        prompt, output = encode[:cut], encode[cut:]
        one = IncrementalDetokenizer(tok, prompt)
        by_one = [one.append([t]) for t in output]
        many = IncrementalDetokenizer(tok, prompt)
        pieces, i = [], 0
        while i < len(output):
            n = rng.randint(2, 9)
            pieces.append(many.append(output[i:i + n]))
            i += n
        assert "".join(pieces) == many.text == one.text == "".join(by_one)
        assert all(not p.endswith("\ufffd") for p in pieces)
        assert many.num_output_tokens == len(output)


def _byte(tok, token_id: int) -> int:
    piece = tok.id_to_token(token_id)
    return int(piece[3:5], 16) if piece.startswith("<0x") else -1


def test_many_tokens_at_once_match_token_by_token_on_random_ids(tokenizer):
    """What a random model writes: byte pieces of no character, special tokens."""
    rng = random.Random(11)
    for _ in range(300):
        prompt = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(0, 6))]
        output = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        skip = rng.random() < 0.5
        one = IncrementalDetokenizer(tokenizer, prompt, skip)
        for token_id in output:
            one.append([token_id])
        many = IncrementalDetokenizer(tokenizer, prompt, skip)
        i = 0
        while i < len(output):
            n = rng.randint(1, 9)
            many.append(output[i:i + n])
            i += n
        assert many.text == one.text


def test_many_tokens_at_once_hold_an_unfinished_character(tokenizer):
    ids = tokenizer.encode("ab日🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.append(ids[:-1]) == "ab日"  # the emoji's last byte is still to come
    assert detok.append(ids[-1:]) == "🙂"
