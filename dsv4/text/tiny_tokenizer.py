"""A tiny, deterministic byte-level BPE tokenizer with the DeepSeek-V4 special tokens.

Tests and the embedded tiny model need a real `tokenizers.Tokenizer` without downloading the
~130k-token DSV4 vocabulary. This one has the same *shape* as the released tokenizer
(DSV4_FACTS section 6): byte-level BPE, BOS at id 0, EOS at id 1, and every special string the
chat encoding writes recognised as one token. The id layout is fixed:

    0 .. 7          special tokens, in `SPECIAL_TOKENS` order (BOS, EOS, then the others)
    8 .. 263        the 256 byte symbols, in byte order (id = 8 + byte value)
    264 .. V-1      BPE merges, trained on `_CORPUS` (an embedded English text) in merge order

DSML markup is tokenized as ordinary text around the special piece `｜DSML｜`, e.g.
`<｜DSML｜invoke` is `<`, `｜DSML｜`, `invoke`, so any markup round-trips through encode/decode.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"

SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜latest_reminder｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
)
NUM_BYTE_SYMBOLS = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + NUM_BYTE_SYMBOLS

# Written for this project: plain English with varied words, digits and punctuation, so the
# merges look like those of a real tokenizer (" the", "ing", " and", ...).
_CORPUS = """\
The old lighthouse keeper woke before dawn every morning, long before the fishing boats left
the harbour. He climbed the one hundred and twelve steps of the tower, checked the lamp, wiped
the salt from the windows and wrote the weather in a thick leather book. On calm days the sea
was flat and grey like a sheet of metal; on stormy days the waves threw white spray over the
rocks and the whole tower seemed to shiver in the wind.

In the village below, the baker was already working. She mixed flour, water, salt and yeast in
a wooden bowl, folded the dough twelve times, and left it to rise near the warm oven. By seven
o'clock the smell of fresh bread filled the narrow streets, and children stopped at her window
on their way to school. Some of them counted their coins twice before choosing between a sweet
roll and a loaf of dark rye bread.

The school itself was a small building with three classrooms and a garden. The teacher, a
patient man who had travelled through many countries, liked to begin each lesson with a
question. "Why does the moon change its shape?" he asked one morning. A girl in the front row
answered that the moon does not really change; we only see the part that the sun is lighting.
He smiled, drew a circle on the board, and spent the next hour explaining orbits, shadows and
the long history of people who watched the sky and tried to understand it.

Computers arrived in the village much later than in the cities. The first one was installed in
the library, and for months people queued to use it. They searched for recipes, for train
times, for news about relatives living abroad. The librarian kept a notebook of the questions
people asked, and she noticed that the same questions returned again and again: how to write a
letter, how to read a map, how to find a number, how to fix something that was broken.

Programming came next. A group of students met every Thursday evening to learn how to write
simple programs. They started with loops and conditions, printing numbers from 1 to 100 and
replacing every multiple of three with a word. Then they built a small program that read the
lighthouse keeper's weather book and drew a chart of the wind speed over the year. The chart
showed that the strongest winds came in November and the calmest days in June, which surprised
nobody but pleased everybody.

Later the students trained a tiny language model on the stories their grandparents told. The
model was not very clever. It repeated words, forgot the beginning of a sentence before it
reached the end, and sometimes invented places that did not exist. Still, the students were
proud of it, because they understood every part: the tokenizer that split text into pieces,
the table of numbers that turned each piece into a vector, the layers that mixed information
between positions, and the final step that chose the next piece from a list of probabilities.

"A model is only as good as the data and the care that go into it," the teacher told them.
"Measure everything. Compare your results with something you trust. When a number looks too
good, check it again." The students wrote these sentences on a card and pinned it above the
computer, where it stayed for many years, slowly fading in the afternoon sun.

In summer the harbour was busy with visitors. They walked along the stone wall, bought ice
cream and postcards, and asked the fishermen about the boats. The fishermen answered politely,
mending their nets and sorting their catch into boxes of ice: cod, mackerel, crab and, on lucky
days, a few lobsters. In the evening the visitors gathered on the beach to watch the sunset,
and the light from the tower began to turn, sweeping across the water every nine seconds.

Autumn brought rain and quiet. The baker made soup as well as bread, the library opened later,
and the students moved their meetings to Tuesday afternoons. They improved their model, added
tests, fixed mistakes, and wrote down what they learned so that the next group could start
where they had stopped. Nothing they built was perfect, but everything was a little better
than the year before, and that, they agreed, was the whole point.
"""


def _train_merges(num_merges: int, at_most: bool = False) -> list[tuple[str, str]]:
    """Train `num_merges` BPE merges on `_CORPUS` with the byte-level alphabet.

    Raises ValueError if the corpus cannot provide that many merges, unless `at_most`.
    """
    scratch = Tokenizer(models.BPE())
    scratch.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=NUM_BYTE_SYMBOLS + num_merges,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    scratch.train_from_iterator([_CORPUS], trainer)
    merges = [tuple(m) for m in json.loads(scratch.to_str())["model"]["merges"]]
    if len(merges) < num_merges and not at_most:
        raise ValueError(
            f"vocab_size too large for the tiny tokenizer: its corpus yields only {len(merges)} "
            f"merges (max vocab_size {MIN_VOCAB_SIZE + len(merges)})"
        )
    return merges[:num_merges]


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins ByteLevel uses for bytes, in byte order 0..255."""
    # GPT-2's byte -> unicode map: printable latin-1 bytes map to themselves, the rest to
    # code points from 256 upwards, in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols, extra = {}, 0
    for b in range(NUM_BYTE_SYMBOLS):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(NUM_BYTE_SYMBOLS + extra)
            extra += 1
    assert set(symbols.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    return [symbols[b] for b in range(NUM_BYTE_SYMBOLS)]


def _fillers(taken: dict[str, int], count: int):
    """`count` three-byte tokens not in `taken`, in a fixed order: ids that decode to bytes but
    that no merge produces, so encoding never emits them."""
    symbols = _byte_symbols()
    made = 0
    for a in symbols:
        for b in symbols:
            for c in symbols:
                if made == count:
                    return
                if a + b + c not in taken:
                    made += 1
                    yield a + b + c


def build_tiny_tokenizer(vocab_size: int = 512, pad: bool = False) -> Tokenizer:
    """Build the deterministic tiny DSV4-style tokenizer with exactly `vocab_size` ids.

    Args:
        vocab_size: total number of ids, specials and bytes included; at least
            `MIN_VOCAB_SIZE` (264) and at most what the embedded corpus can merge to.
        pad: allow any larger `vocab_size` by filling the ids past the corpus' merges with
            three-byte tokens that encoding never produces but decoding renders (for a random
            model of a real geometry's vocabulary, e.g. 129280 ids, whose samples must decode).
    Returns:
        A `tokenizers.Tokenizer` (byte-level BPE, no post-processor: BOS is added by the caller).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (specials + 256 bytes), got {vocab_size}")
    merges = _train_merges(vocab_size - MIN_VOCAB_SIZE, at_most=pad)
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *_byte_symbols()):
        vocab[token] = len(vocab)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    if pad:
        for token in list(_fillers(vocab, vocab_size - len(vocab))):
            vocab[token] = len(vocab)
    if len(vocab) != vocab_size:  # two merges producing the same string would shrink the vocab
        raise ValueError(f"tiny tokenizer built {len(vocab)} ids, expected {vocab_size}")

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def write_tiny_tokenizer(directory: str | Path, vocab_size: int = 512, pad: bool = False) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` for the tiny tokenizer into `directory`.

    Returns the directory, created if needed, ready for `Tokenizer.from_dir`.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(vocab_size, pad).save(str(directory / "tokenizer.json"))
    config = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "model_max_length": 1 << 20}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    return directory
