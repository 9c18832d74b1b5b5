"""Tokenizer loading, the tiny DSV4-style tokenizer, and incremental UTF-8 detokenization."""

from __future__ import annotations

import json
import time

import pytest
import tokenizers
from tokenizers import AddedToken, models

from dsv4.text import IncrementalDetokenizer, Tokenizer, build_tiny_tokenizer, write_tiny_tokenizer
from dsv4.text.tiny_tokenizer import BOS_TOKEN, EOS_TOKEN, MIN_VOCAB_SIZE, SPECIAL_TOKENS

MIXED_TEXT = (
    "<｜begin▁of▁sentence｜>You are terse.<｜User｜>Weather in 東京 🌧️? Café naïve.<｜Assistant｜>"
    "<think>need a tool</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"w\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">東京</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok"), 512)


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


# ---------------------------------------------------------------- tiny tokenizer


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE, 300, 512, 1000])
def test_tiny_tokenizer_exact_vocab_size(vocab_size):
    t = build_tiny_tokenizer(vocab_size)
    assert t.get_vocab_size(with_added_tokens=True) == vocab_size
    assert sorted(t.get_vocab(with_added_tokens=True).values()) == list(range(vocab_size))


def test_tiny_tokenizer_id_layout():
    t = build_tiny_tokenizer(512)
    assert t.token_to_id(BOS_TOKEN) == 0 and t.token_to_id(EOS_TOKEN) == 1
    for i, special in enumerate(SPECIAL_TOKENS):
        assert t.token_to_id(special) == i
    for name in ["<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>", "<think>", "</think>", "｜DSML｜"]:
        assert name in SPECIAL_TOKENS
    # byte symbols follow the specials in byte order: "A" (0x41) and " " (0x20, shown as "Ġ")
    assert t.token_to_id("A") == len(SPECIAL_TOKENS) + 0x41
    assert t.token_to_id("Ġ") == len(SPECIAL_TOKENS) + 0x20
    # merges come after, so common English words are single tokens
    assert t.encode(" the", add_special_tokens=False).ids[0] >= MIN_VOCAB_SIZE


def test_tiny_tokenizer_deterministic_and_fast():
    start = time.perf_counter()
    a = build_tiny_tokenizer(512)
    assert time.perf_counter() - start < 1.0
    assert a.to_str() == build_tiny_tokenizer(512).to_str()


def test_tiny_tokenizer_bad_sizes():
    with pytest.raises(ValueError, match="vocab_size must be >="):
        build_tiny_tokenizer(MIN_VOCAB_SIZE - 1)
    with pytest.raises(ValueError, match="too large"):
        build_tiny_tokenizer(100_000)


def test_padded_tiny_tokenizer_covers_a_real_vocabulary():
    """pad=True reaches a real geometry's 129280 ids: encoding matches the unpadded tokenizer
    (fillers are never produced), every id decodes, and the fillers are distinct."""
    padded, plain = build_tiny_tokenizer(129_280, pad=True), build_tiny_tokenizer(1_000)
    assert padded.get_vocab_size() == 129_280
    text = "The lighthouse keeper wrote 42 lines. ünïcödé"
    assert padded.encode(text).ids == build_tiny_tokenizer(1_223).encode(text).ids
    assert max(padded.encode(text).ids) < 1_223 and plain.encode(text).ids
    assert isinstance(padded.decode([129_279, 1_223, 70_000]), str)
    assert len(set(padded.get_vocab())) == 129_280


def test_write_tiny_tokenizer_files(tok_dir):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == BOS_TOKEN and cfg["eos_token"] == EOS_TOKEN
    assert tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size() == 512


# ---------------------------------------------------------------- Tokenizer


def test_tokenizer_properties(tok):
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 512)
    assert tok.special_id("<｜User｜>") == 2
    assert tok.special_id("</think>") == 6
    with pytest.raises(KeyError, match="<｜nope｜>"):
        tok.special_id("<｜nope｜>")


def test_special_strings_encode_to_single_ids(tok):
    for special in SPECIAL_TOKENS:
        assert tok.encode(f"a{special}b") == tok.encode("a") + [tok.special_id(special)] + tok.encode("b")
    assert tok.encode("hi", add_bos=True) == [tok.bos_id] + tok.encode("hi")


def test_encode_decode_round_trip(tok):
    ids = tok.encode(MIXED_TEXT)
    assert tok.decode(ids) == MIXED_TEXT
    assert ids.count(tok.special_id("｜DSML｜")) == 6
    plain = tok.decode(ids, skip_special_tokens=True)
    assert "<｜User｜>" not in plain and "東京 🌧️" in plain


def test_special_ids_are_looked_up_not_hard_coded(tmp_path):
    # A vocabulary where BOS/EOS are not 0/1: ids must come from the file.
    vocab = {"[UNK]": 0, "hello": 1, "<｜end▁of▁sentence｜>": 2, "<｜begin▁of▁sentence｜>": 3}
    hf = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.add_special_tokens([AddedToken(BOS_TOKEN, special=True), AddedToken(EOS_TOKEN, special=True)])
    hf.save(str(tmp_path / "tokenizer.json"))
    t = Tokenizer.from_dir(tmp_path)
    assert (t.bos_id, t.eos_id) == (3, 2)
    assert t.encode("hello", add_bos=True) == [3, 1]


def test_config_added_token_dicts(tmp_path):
    write_tiny_tokenizer(tmp_path, 300)
    cfg = {"bos_token": {"__type": "AddedToken", "content": "<｜User｜>"}, "eos_token": "</think>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_dir(tmp_path)
    assert (t.bos_token, t.bos_id, t.eos_token, t.eos_id) == ("<｜User｜>", 2, "</think>", 6)


def test_missing_config_uses_default_strings(tmp_path):
    write_tiny_tokenizer(tmp_path, 300)
    (tmp_path / "tokenizer_config.json").unlink()
    t = Tokenizer.from_dir(tmp_path)
    assert (t.bos_id, t.eos_id) == (0, 1)


def test_from_dir_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    write_tiny_tokenizer(tmp_path, 300)
    (tmp_path / "tokenizer_config.json").write_text("[oops")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<｜missing｜>"}))
    with pytest.raises(ValueError, match="<｜missing｜>"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": 5}))
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------- IncrementalDetokenizer


def _stream(tok, ids, **kwargs):
    det = IncrementalDetokenizer(tok, **kwargs)
    deltas = [det.push(i) for i in ids]
    return deltas, det.flush()


@pytest.mark.parametrize("text", ["東京は雨です", "emoji 🌧️👩‍👩‍👧 ok", "mixé 中文 and 😀😀 end", MIXED_TEXT])
def test_detokenizer_never_splits_characters(tok, text):
    ids = tok.encode(text)
    assert len(ids) > len(text.encode("utf-8")) // 4  # multi-byte chars really span several ids
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == text
    assert tail == ""
    assert all("\ufffd" not in d for d in deltas)


def test_detokenizer_holds_bytes_until_character_completes(tok):
    ids = tok.encode("中")  # three byte-level tokens, one per UTF-8 byte
    assert len(ids) == 3
    deltas, tail = _stream(tok, ids)
    assert deltas == ["", "", "中"] and tail == ""


def test_detokenizer_flush_emits_incomplete_tail(tok):
    ids = tok.encode("ok 😀")[:-1]  # cut inside the emoji
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) == "ok " and tail == "\ufffd"


def test_detokenizer_with_prompt_and_special_tokens(tok):
    prompt = tok.encode("<｜User｜>hi<｜Assistant｜></think>", add_bos=True)
    out = tok.encode("Sure: 東京<｜end▁of▁sentence｜>")
    deltas, tail = _stream(tok, out, prompt_ids=prompt)
    assert "".join(deltas) + tail == "Sure: 東京<｜end▁of▁sentence｜>"
    deltas, tail = _stream(tok, out, prompt_ids=prompt, skip_special_tokens=True)
    assert "".join(deltas) + tail == "Sure: 東京"


class _CountingTokenizer:
    """Wraps a Tokenizer and records the length of every decoded window."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.windows = inner, []

    def decode(self, ids, skip_special_tokens=False):
        self.windows.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_detokenizer_decodes_a_bounded_window(tok):
    text = "The tower light turns every nine seconds. 灯台 🌊 " * 60
    ids = tok.encode(text)
    counting = _CountingTokenizer(tok)
    det = IncrementalDetokenizer(counting, prompt_ids=list(range(100, 400)))
    out = "".join(det.push(i) for i in ids) + det.flush()
    assert out == text
    assert len(ids) > 1000 and max(counting.windows) <= 12


def test_detokenizer_gives_up_on_invalid_bytes(tok):
    stray = tok.hf.token_to_id("Ģ")  # the symbol of the lone continuation byte 0x80
    assert stray == 8 + 0x80
    det = IncrementalDetokenizer(tok)
    deltas = [det.push(i) for i in [stray] * 40 + tok.encode("ok")] + [det.flush()]
    assert "".join(deltas) == "\ufffd" * 40 + "ok"
    assert len(det._ids) <= IncrementalDetokenizer.MAX_HELD_IDS + 1


# ---------------------------------------------------------------- encode cache (dsv4/text/encode_cache.py)


def _plain(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.hf.encode(text, add_special_tokens=False).ids)


def test_encode_cache_reuses_conversation_turns_and_gives_the_same_ids(tok):
    """Each turn of a conversation (rendered by the DSV4 chat encoding, thinking kept or dropped,
    tool results, special-token strings and near-misses inside messages) encodes to exactly the ids
    of a plain encode, while reusing most of the previous turn's."""
    import random

    from dsv4.text.chat import encode_messages
    rng = random.Random(0)
    pieces = ["hello ", "東京 ", "🌧️", " <｜User｜>", "<｜Us", "er｜>", "<think>", "</think>", "\n\n", "  ",
              "<｜end▁of▁sentence｜>x", "｜DSML｜", "naïve ", "a" * 40, "\u2028", "def f(x):\n    return x\n"]
    cache = tok.cache
    reused = cache.reused_chars
    for thinking in (True, False):
        messages = [{"role": "system", "content": "You are terse. " * 200}]
        for turn in range(6):
            messages.append({"role": "user", "content": "".join(rng.choice(pieces) for _ in range(60))})
            text = encode_messages(messages, thinking=thinking)
            assert tok.encode(text) == _plain(tok, text), (thinking, turn)
            answer = "".join(rng.choice(pieces) for _ in range(40))
            messages.append({"role": "assistant", "content": answer,
                             **({"reasoning_content": "hmm " * 10} if thinking else {})})
    assert cache.reused_chars - reused > 20000          # later turns reused the earlier ones


def test_encode_cache_on_texts_that_extend_each_other_anywhere(tok):
    """Texts built from a pool of pieces (special-token strings, parts of them, spaces, newlines,
    multi-byte characters), each a random earlier text cut anywhere plus more: ids always equal a
    plain encode, also from several threads at once."""
    import random
    from concurrent.futures import ThreadPoolExecutor
    rng = random.Random(1)
    specials = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜end▁of▁sentence｜>", "｜DSML｜"]
    pool = specials + ["<｜", "｜>", "<｜Ass", " ", "\n", "é", "字", "ab", "  x", "\t"] + [s[:-1] for s in specials]
    texts = ["".join(rng.choice(pool) for _ in range(900))]
    for _ in range(60):
        base = rng.choice(texts)
        cut = rng.randrange(len(base) + 1)
        texts.append(base[:cut] + "".join(rng.choice(pool) for _ in range(rng.randrange(1, 300))))
    for t in texts:
        assert tok.encode(t) == _plain(tok, t)
    with ThreadPoolExecutor(4) as pool_:
        for t, ids in zip(texts, pool_.map(tok.encode, texts * 3)):
            assert ids == _plain(tok, t)


def test_encode_cache_cuts_only_after_tokens_that_isolate_the_same_way():
    """No cut after an added token that strips whitespace, is normalized, or lies inside a longer
    added token; a tokenizer with a normalizer gets no cuts at all."""
    from tokenizers import normalizers, pre_tokenizers

    from dsv4.text.encode_cache import _cut_ids
    t = build_tiny_tokenizer(512)
    t.add_special_tokens([AddedToken("<strip>", rstrip=True), AddedToken("<a>"), AddedToken("<a>b"),
                          AddedToken("<norm>", normalized=True)])
    cut = set(_cut_ids(t).values())
    assert "<｜User｜>" in cut and not cut & {"<strip>", "<a>", "<norm>"} and "<a>b" in cut
    t.normalizer = normalizers.NFKC()
    assert _cut_ids(t) == {}
    t = build_tiny_tokenizer(512)
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert _cut_ids(t) == {}
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    assert _cut_ids(t) == {}
