"""Write the Parquet fixtures that crates/parquet/tests read, each with the rows it must yield.

headroom-parquet reads a Parquet file as JSON objects, one per row. Every fixture here is
written by pyarrow (the writer behind Hugging Face `datasets` and datatrove), and beside each
`NAME.parquet` lies `NAME.jsonl`: the rows pyarrow itself reads back, converted to JSON by the
rules below, which the Rust reader follows too.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

Usage, from the workspace root, with a Python that has pyarrow (written with 26.0.1):

    python3 benches/torch/make_parquet_fixture.py --write   # (re)write the committed fixtures
    python3 benches/torch/make_parquet_fixture.py --check   # re-read them, compare, write nothing

With `--verbose`, either also prints each file's codecs and pages, as the manifest records them.
Writing twice with one pyarrow gives the same bytes.

Written under `crates/parquet/tests/fixtures/` (about 640 KB, 340 KB of it distinct: the
thirteen `.jsonl` of the types table are one file, which git stores once):
- `types_{none,snappy,gzip,zstd,lz4}.parquet`: one table of 40 rows holding every column type
  the reader supports (booleans, signed and unsigned integers of every width with their
  extremes, float32/float64 with NaN, infinities, -0.0 and subnormals, string, large_string,
  binary, fixed_size_binary(4), date32, timestamp[ms], lists of strings and of integers,
  a nullable struct, a list of structs (chat messages), a list of lists, and two required
  columns), nulls in every nullable column and at every nesting level, under each codec.
  pyarrow's "lz4" is LZ4_RAW (the manifest records what each file holds).
- the same table as `types_snappy` written other ways: `plain` (no dictionary),
  `pages_v2` (data page v2), `pages_v2_plain_zstd`, `small_pages` (pages of about five rows,
  row groups of seven), `delta` and `delta_v2` (DELTA_BINARY_PACKED, DELTA_LENGTH_BYTE_ARRAY,
  DELTA_BYTE_ARRAY and BYTE_STREAM_SPLIT columns), `dict_fallback` (a dictionary that
  overflows mid column chunk, so dictionary pages are followed by PLAIN ones, as pyarrow does
  with large string columns) and `format_1_0` (Parquet format 1.0: PLAIN_DICTIONARY, and
  unsigned 32-bit integers stored as INT64, as older files have them);
- `fineweb_like`, `mmlu_like`, `ultrachat_like`: the columns, types and layout of FineWeb
  (datatrove), MMLU and UltraChat as the Hub serves them; `empty`: MMLU's schema, no rows;
- `dict_repeated`: one long string dictionary-encoded in every row, a file far smaller than
  what it expands to, for the reader's bound;
- `sft_messages`, `sft_prompt_completion`: TRL's two dataset shapes (trl-lib/Capybara's
  `messages`, trl-lib/tldr's `prompt` and `completion`) in ASCII words, which the trainer's
  tests build into token files from the Parquet file and from its `.jsonl` alike;
- `unsupported_{map,decimal,int96,brotli}.parquet`: files the reader must refuse with a typed
  error that names the column (no `.jsonl`);
- `MANIFEST.json`: every file, what it covers, and, read from the files' own page headers,
  each column chunk's codec, page kinds and encodings; for the unsupported files, the column
  and the reason.

The expected rows: `table.to_pylist()`, keys in schema order, one `json.dumps(row,
ensure_ascii=False)` a line, after: date32 as its day count and timestamps as their stored
int64 (the columns cast to integers first), float NaN and infinities as null (JSON has
neither), binary and fixed_size_binary as lists of byte values, float32 as the double equal
to it, structs as objects in field order.

`--check` re-reads every committed file, derives its rows again and compares them (parsed
JSON) with the committed `.jsonl` and with the table this script builds, checks the layout
recorded in the manifest against the files' page headers, and that the manifest lists
exactly the files present.
"""

import decimal
import hashlib
import json
import math
import os
import random
import struct
import sys

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"pyarrow is needed: {e}", file=sys.stderr)
    sys.exit(3)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT_DIR = os.path.join(ROOT, "crates", "parquet", "tests", "fixtures")
MANIFEST = "MANIFEST.json"

# Words for generated text: ASCII, accents, CJK, right-to-left, emoji (a ZWJ family and a
# skin-tone modifier are several code points each) and characters JSON must escape.
WORDS = (
    "the model reads data from a file and writes tokens to the batch while every step of "
    "training loss falls slowly over time with each epoch"
).split() + [
    "café", "naïve", "Ångström", "Straße", "東京", "数据集", "模型", "学习", "한국어", "日本語",
    "שלום", "مرحبا", "Привет", "🦀", "🚀", "👍🏽", "👨‍👩‍👧‍👦", "😀", "∑", "x²", "e\u0301",
]
ODD_STRINGS = [
    "",
    "🦀 Rust",
    "東京タワー",
    'quote " backslash \\ tab \t newline \n end',
    "nul \x00 and \x1f controls",
    "u\u0308 combining",
    "👨‍👩‍👧‍👦",
    "\U0010ffff last code point",
    " ",
]


def phrase(rng, lo=0, hi=6):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def column(rng, n, specials, draw, nulls=3):
    """`n` values: the special ones, `nulls` nulls and the rest drawn, shuffled together, so
    every fixture has its edge cases and nulls at places the generator picks."""
    values = list(specials) + [None] * nulls
    values += [draw() for _ in range(n - len(values))]
    rng.shuffle(values)
    return values


# The types table: (name, arrow type, nullable).
TYPES_SCHEMA = pa.schema(
    [
        pa.field("bool", pa.bool_()),
        pa.field("int8", pa.int8()),
        pa.field("int16", pa.int16()),
        pa.field("int32", pa.int32()),
        pa.field("int64", pa.int64()),
        pa.field("uint8", pa.uint8()),
        pa.field("uint16", pa.uint16()),
        pa.field("uint32", pa.uint32()),
        pa.field("uint64", pa.uint64()),
        pa.field("float32", pa.float32()),
        pa.field("float64", pa.float64()),
        pa.field("string", pa.string()),
        pa.field("large_string", pa.large_string()),
        pa.field("binary", pa.binary()),
        pa.field("fixed4", pa.binary(4)),
        pa.field("date32", pa.date32()),
        pa.field("timestamp_ms", pa.timestamp("ms")),
        pa.field("choices", pa.list_(pa.string())),
        pa.field("int64_list", pa.list_(pa.int64())),
        pa.field("pair", pa.struct([("a", pa.int32()), ("b", pa.string())])),
        pa.field(
            "messages",
            pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
        ),
        pa.field("nested", pa.list_(pa.list_(pa.int32()))),
        pa.field("required_int64", pa.int64(), nullable=False),
        pa.field("required_string", pa.string(), nullable=False),
    ]
)
TYPES_ROWS = 40


def types_table():
    rng = random.Random(20240611)
    n = TYPES_ROWS
    nan, inf = float("nan"), float("inf")

    def int_draw(lo, hi):
        # Small values most of the time (what dictionaries and delta blocks see in practice),
        # the full range now and then.
        return lambda: rng.randint(max(lo, -1000), min(hi, 1000)) if rng.random() < 0.6 else rng.randint(lo, hi)

    def byte_string(lo, hi):
        return bytes(rng.randrange(256) for _ in range(rng.randint(lo, hi)))

    def conversation():
        return [
            {"role": ("user", "assistant")[i % 2], "content": phrase(rng, 1, 2)} for i in range(rng.randint(1, 2))
        ]

    def nested():
        return [
            None if rng.random() < 0.1 else [rng.randint(-50, 50) for _ in range(rng.randint(0, 3))]
            for _ in range(rng.randint(0, 2))
        ]

    i64 = (-(2**63), 2**63 - 1)
    cols = {
        "bool": column(rng, n, [True, False], lambda: rng.random() < 0.5),
        "int8": column(rng, n, [-128, 127, 0, -1], int_draw(-128, 127)),
        "int16": column(rng, n, [-32768, 32767, 0], int_draw(-32768, 32767)),
        "int32": column(rng, n, [-(2**31), 2**31 - 1, 0, -1], int_draw(-(2**31), 2**31 - 1)),
        # Extremes next to each other make DELTA_BINARY_PACKED's deltas wrap around.
        "int64": column(
            rng, n, [i64[0], i64[1], 2**62, -(2**62), 2**62 + 1, -(2**62) - 1, 0], int_draw(*i64)
        ),
        "uint8": column(rng, n, [0, 255, 128], int_draw(0, 255)),
        "uint16": column(rng, n, [0, 65535, 32768], int_draw(0, 65535)),
        # Above 2^31: negative as the stored INT32, which the reader must not show.
        "uint32": column(rng, n, [0, 2**31, 2**32 - 1, 2**31 - 1], int_draw(0, 2**32 - 1)),
        "uint64": column(rng, n, [0, 2**63, 2**64 - 1, 2**63 - 1], int_draw(0, 2**64 - 1)),
        "float32": column(
            rng,
            n,
            [nan, inf, -inf, -0.0, 0.0, 0.1, 3.4028234663852886e38, 1.401298464324817e-45, 1.1754943508222875e-38],
            lambda: rng.uniform(-1e4, 1e4),
        ),
        "float64": column(
            rng,
            n,
            [nan, inf, -inf, -0.0, 1e-300, 5e-324, 1.7976931348623157e308, 0.1, -2.5],
            lambda: rng.gauss(0, 1e3),
        ),
        "string": column(rng, n, ODD_STRINGS, lambda: phrase(rng, 0, 2)),
        "large_string": column(rng, n, ["", "数据集 🚀", "a" * 64], lambda: phrase(rng, 0, 3)),
        "binary": column(rng, n, [b"", b"\x00", b"\xff\xfe\x00\x80", b"\xc3\x28"], lambda: byte_string(0, 6)),
        "fixed4": column(rng, n, [b"\x00" * 4, b"\xff" * 4], lambda: byte_string(4, 4)),
        # 0001-01-01, 9999-12-31, the epoch and the day before it.
        "date32": column(rng, n, [-719162, 2932896, 0, -1], lambda: rng.randint(-30000, 30000)),
        "timestamp_ms": column(
            rng, n, [0, -1, -62135596800000, 253402300799999], lambda: rng.randint(-(2**40), 2**41)
        ),
        # MMLU's `choices`: empty lists, null lists and null elements.
        "choices": column(
            rng,
            n,
            [[], [], ["A", None, "C", "D"], [None], ["", "🦀"]],
            lambda: [rng.choice(WORDS) for _ in range(4)],
        ),
        "int64_list": column(
            rng,
            n,
            [[], [None], [i64[1], i64[0]], [0, None, 0]],
            lambda: [rng.randint(*i64) if rng.random() < 0.2 else rng.randint(-9, 9) for _ in range(rng.randint(0, 3))],
        ),
        "pair": column(
            rng,
            n,
            [{"a": None, "b": None}, {"a": 1, "b": None}, {"a": None, "b": "東京"}, {"a": -(2**31), "b": ""}],
            lambda: {"a": rng.randint(-(2**31), 2**31 - 1), "b": phrase(rng, 0, 2)},
        ),
        "messages": column(
            rng,
            n,
            [
                [],
                [None],
                [{"role": "user", "content": None}],
                [{"role": None, "content": "🦀"}, {"role": "assistant", "content": ""}],
            ],
            conversation,
        ),
        "nested": column(
            rng,
            n,
            [[], [[]], [None], [[None]], [[1, None, 3], [], None, [4]], [[], []]],
            nested,
        ),
        "required_int64": column(rng, n, [i64[0], i64[1], 0], int_draw(*i64), nulls=0),
        "required_string": column(rng, n, ["", "🚀", "東京"], lambda: phrase(rng, 0, 2), nulls=0),
    }
    return pa.table({name: pa.array(cols[name], type=TYPES_SCHEMA.field(name).type) for name in cols}, schema=TYPES_SCHEMA)


INT_COLUMNS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
               "date32", "timestamp_ms", "required_int64"]
# The encodings asked of each top-level column in the delta fixtures; `delta_encodings`
# drops those pyarrow refuses, and the manifest records them.
DELTA_WANTED = {
    **{c: "DELTA_BINARY_PACKED" for c in INT_COLUMNS},
    "string": "DELTA_LENGTH_BYTE_ARRAY",
    "required_string": "DELTA_LENGTH_BYTE_ARRAY",
    "large_string": "DELTA_BYTE_ARRAY",
    "binary": "DELTA_BYTE_ARRAY",
    "fixed4": "DELTA_BYTE_ARRAY",
    "float32": "BYTE_STREAM_SPLIT",
    "float64": "BYTE_STREAM_SPLIT",
    "bool": "RLE",
}


def delta_encodings(table, v2):
    """DELTA_WANTED less what pyarrow refuses to write, and what it refused, with why."""
    ok, refused = {}, {}
    for name, encoding in DELTA_WANTED.items():
        sink = pa.BufferOutputStream()
        try:
            pq.write_table(
                table.select([name]),
                sink,
                use_dictionary=False,
                column_encoding={name: encoding},
                data_page_version="2.0" if v2 else "1.0",
            )
            ok[name] = encoding
        except Exception as e:  # pyarrow raises ArrowNotImplementedError, ArrowInvalid, ...
            refused[name] = {"encoding": encoding, "error": f"{type(e).__name__}: {e}"}
    return ok, refused


def fineweb_table():
    """FineWeb's columns as datatrove writes them (every column nullable, as pyarrow infers)."""
    rng = random.Random(1501)
    n = 30
    rows = []
    for i in range(n):
        paragraphs = []
        # Mostly short documents, two of a few thousand characters, to keep the fixture small.
        target = rng.randint(1800, 2400) if i in (4, 17) else rng.randint(80, 400)
        while sum(len(p) for p in paragraphs) < target:
            sentences = [phrase(rng, 4, 14).capitalize() + "." for _ in range(rng.randint(1, 4))]
            paragraphs.append(" ".join(sentences))
        text = "\n\n".join(paragraphs)
        uuid = "%08x-%04x-%04x-%04x-%012x" % tuple(rng.getrandbits(b) for b in (32, 16, 16, 16, 48))
        dump = rng.choice(["CC-MAIN-2013-20", "CC-MAIN-2023-50", "CC-MAIN-2024-10"])
        segment = "%d.%d" % (rng.randint(1700000000000, 1710000000000), rng.randint(10, 99))
        rows.append(
            {
                "text": text,
                "id": f"<urn:uuid:{uuid}>",
                "dump": dump,
                "url": f"https://{rng.choice(['example.com', 'blog.example.org', '例子.测试'])}/{rng.randint(1, 99999)}/{rng.choice(WORDS)}",
                "date": "2024-%02d-%02dT%02d:%02d:%02dZ" % (rng.randint(1, 12), rng.randint(1, 28), rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59)),
                "file_path": f"s3://commoncrawl/crawl-data/{dump}/segments/{segment}/warc/{dump}-{rng.randint(0, 99999):05d}.warc.gz",
                "language": rng.choice(["en", "en", "en", "zh", "ja"]),
                "language_score": rng.uniform(0.65, 1.0),
                "token_count": len(text) // 4,
            }
        )
    # A few nulls, so the reader meets them here too; never in `text`, which FineWeb always
    # has (the trainer tokenizes this file as a corpus, one document a row).
    for column_name in ["url", "language_score", "token_count"]:
        rows[rng.randrange(n)][column_name] = None
    rows[rng.randrange(n)]["text"] = ""
    schema = pa.schema(
        [(c, pa.string()) for c in ["text", "id", "dump", "url", "date", "file_path", "language"]]
        + [("language_score", pa.float64()), ("token_count", pa.int64())]
    )
    return pa.Table.from_pylist(rows, schema=schema)


SUBJECTS = ["abstract_algebra", "anatomy", "astronomy", "college_physics", "world_religions"]
# `datasets` keeps its Features in the Arrow schema's metadata; a reader must skip it.
MMLU_FEATURES = {
    "info": {
        "features": {
            "question": {"dtype": "string", "_type": "Value"},
            "subject": {"dtype": "string", "_type": "Value"},
            "choices": {"feature": {"dtype": "string", "_type": "Value"}, "_type": "Sequence"},
            "answer": {"names": ["A", "B", "C", "D"], "_type": "ClassLabel"},
        }
    }
}
MMLU_SCHEMA = pa.schema(
    [("question", pa.string()), ("subject", pa.string()), ("choices", pa.list_(pa.string())), ("answer", pa.int64())],
    metadata={"huggingface": json.dumps(MMLU_FEATURES)},
)


def mmlu_table():
    rng = random.Random(57)
    rows = []
    for _ in range(20):
        rows.append(
            {
                "question": phrase(rng, 5, 20).capitalize() + "?",
                "subject": rng.choice(SUBJECTS),
                "choices": [phrase(rng, 1, 5) for _ in range(4)],
                "answer": rng.randrange(4),
            }
        )
    rows[3]["question"] = "Which of these is 東京's 🚀 launch site?\n(Choose one.)"
    rows[7]["choices"][2] = ""
    # A null choice (Jinja prints it "None"); no null question, which MMLU never has and
    # its template's `question.strip()` could not take.
    rows[11]["choices"][1] = None
    return pa.Table.from_pylist(rows, schema=MMLU_SCHEMA)


ULTRACHAT_SCHEMA = pa.schema(
    [
        ("prompt", pa.string()),
        ("prompt_id", pa.string()),
        ("messages", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ]
)


def ultrachat_table():
    rng = random.Random(200)
    rows = []
    for _ in range(15):
        prompt = phrase(rng, 3, 12)
        turns = rng.randint(2, 6)
        messages = [{"content": prompt, "role": "user"}]
        for t in range(1, turns):
            messages.append({"content": phrase(rng, 2, 15), "role": ("user", "assistant")[t % 2 == 1]})
        rows.append(
            {"prompt": prompt, "prompt_id": hashlib.sha256(prompt.encode()).hexdigest(), "messages": messages}
        )
    rows[4]["messages"][1]["content"] = "数据集 👍🏽\n\n```python\nprint(\"hi\")\n```"
    rows[9]["messages"][0]["content"] = None
    return pa.Table.from_pylist(rows, schema=ULTRACHAT_SCHEMA)


SFT_MESSAGES_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("messages", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ]
)


def sft_tables():
    """TRL's two dataset shapes as the Hub holds them (trl-lib/Capybara's `messages` with a
    `source` column TRL ignores; trl-lib/tldr's text `prompt` and `completion`), over ASCII
    words so that the trainer's small test tokenizers encode every row."""
    rng = random.Random(300)
    ascii_words = [w for w in WORDS if w.isascii()]

    def words(lo, hi):
        return " ".join(rng.choice(ascii_words) for _ in range(rng.randint(lo, hi)))

    conversations = []
    for i in range(12):
        turns = []
        for t in range(2 * rng.randint(1, 3)):
            turns.append({"content": words(2, 9), "role": ("user", "assistant")[t % 2]})
        conversations.append({"source": f"synthetic-{i % 3}", "messages": turns})
    pairs = [{"prompt": words(3, 10), "completion": " " + words(1, 6)} for _ in range(14)]
    return (
        pa.Table.from_pylist(conversations, schema=SFT_MESSAGES_SCHEMA),
        pa.table({"prompt": pa.array([p["prompt"] for p in pairs]), "completion": pa.array([p["completion"] for p in pairs])}),
    )


def unsupported_tables():
    rng = random.Random(404)
    n = 12
    ids = pa.array(range(n), pa.int32())
    scores = pa.array(
        [None if i == 5 else [(w, rng.randint(0, 100)) for w in rng.sample(WORDS, rng.randint(0, 3))] for i in range(n)],
        pa.map_(pa.string(), pa.int32()),
    )
    prices = pa.array(
        [None if i == 3 else decimal.Decimal(rng.randint(-10**9, 10**9)) / 100 for i in range(n)],
        pa.decimal128(10, 2),
    )
    stamps = pa.array([None if i == 7 else rng.randint(0, 2**40) for i in range(n)], pa.timestamp("ms"))
    return {
        "map": pa.table({"id": ids, "scores": scores}),
        "decimal": pa.table({"id": ids, "price": prices}),
        "int96": pa.table({"id": ids, "ts": stamps}),
    }


def fixtures():
    """Every fixture: (name, what it covers, table, pq.write_table options, extra manifest
    fields). Unsupported ones carry `unsupported` (column, reason) in the extra fields."""
    types = types_table()
    sft_messages, sft_pairs = sft_tables()
    delta_v1, refused_v1 = delta_encodings(types, v2=False)
    delta_v2, refused_v2 = delta_encodings(types, v2=True)
    mmlu = mmlu_table()
    out = []
    for codec in ["none", "snappy", "gzip", "zstd", "lz4"]:
        note = " (pyarrow's 'lz4' writes LZ4_RAW, not the framed LZ4 codec)" if codec == "lz4" else ""
        out.append(
            (f"types_{codec}", f"every supported column type, dictionary pages, data page v1, codec {codec}{note}", types, {"compression": codec}, {})
        )
    out += [
        ("plain", "the types table with no dictionary: every column PLAIN", types, {"use_dictionary": False}, {}),
        ("pages_v2", "the types table in data page v2 (levels uncompressed before the values)", types, {"data_page_version": "2.0"}, {}),
        (
            "pages_v2_plain_zstd",
            "the types table, data page v2, no dictionary, zstd",
            types,
            {"data_page_version": "2.0", "use_dictionary": False, "compression": "zstd"},
            {},
        ),
        (
            "small_pages",
            "the types table in many pages per column chunk (about five values each) and row groups of 7 rows",
            types,
            {"data_page_size": 64, "write_batch_size": 5, "row_group_size": 7},
            {},
        ),
        (
            "delta",
            "the types table, data page v1, no dictionary: DELTA_BINARY_PACKED integers, DELTA_LENGTH_BYTE_ARRAY "
            "and DELTA_BYTE_ARRAY strings and binaries, BYTE_STREAM_SPLIT floats, RLE booleans",
            types,
            {"use_dictionary": False, "column_encoding": delta_v1},
            {"encodings_asked": delta_v1, "encodings_refused": refused_v1},
        ),
        (
            "delta_v2",
            "as delta, in data page v2",
            types,
            {"use_dictionary": False, "column_encoding": delta_v2, "data_page_version": "2.0"},
            {"encodings_asked": delta_v2, "encodings_refused": refused_v2},
        ),
        (
            "dict_fallback",
            "the types table with a 256-byte dictionary limit and small pages: column chunks whose first pages are "
            "RLE_DICTIONARY and later ones PLAIN (pyarrow falls back when the dictionary grows too big)",
            types,
            {"dictionary_pagesize_limit": 256, "data_page_size": 256, "write_batch_size": 8},
            {},
        ),
        (
            "format_1_0",
            "the types table as Parquet format 1.0: PLAIN_DICTIONARY pages, converted types only, uint32 stored as INT64",
            types,
            {"version": "1.0"},
            {},
        ),
        (
            "fineweb_like",
            "FineWeb's columns (datatrove): long multi-paragraph text, 30 rows in row groups of 10, snappy",
            fineweb_table(),
            {"row_group_size": 10, "compression": "snappy"},
            {},
        ),
        ("mmlu_like", "MMLU as `datasets` writes it: question, subject, choices (4 strings), answer; Features in the schema metadata", mmlu, {}, {}),
        ("ultrachat_like", "UltraChat 200k: prompt, prompt_id, messages (list of {content, role}, 2-6 turns)", ultrachat_table(), {}, {}),
        ("sft_messages", "TRL's conversational shape (trl-lib/Capybara): messages and an ignored source column, ASCII words", sft_messages, {"row_group_size": 5}, {}),
        ("sft_prompt_completion", "TRL's prompt-completion shape (trl-lib/tldr): text prompt and completion, ASCII words", sft_pairs, {"row_group_size": 5}, {}),
        (
            "dict_repeated",
            "one 1 KiB string, dictionary-encoded, in 40 rows: each row's value copies the dictionary's text, which the "
            "reader's max_values bound must count (a small file that expands)",
            pa.table({"s": pa.array(["🦀 headroom " * 73 + "end"] * 40)}),
            {},
            {},
        ),
        (
            "empty",
            "MMLU's schema with no rows: one row group of 0 rows whose column chunks hold an empty dictionary page and no data page",
            mmlu.slice(0, 0),
            {},
            {},
        ),
    ]
    bad = unsupported_tables()
    out += [
        ("unsupported_map", "a map<string, int32> column", bad["map"], {}, {"unsupported": ("scores", "map type")}),
        (
            "unsupported_decimal",
            "a decimal128(10, 2) column",
            bad["decimal"],
            {},
            {"unsupported": ("price", "decimal logical type")},
        ),
        (
            "unsupported_int96",
            "a timestamp column stored as INT96 (use_deprecated_int96_timestamps)",
            bad["int96"],
            {"use_deprecated_int96_timestamps": True},
            {"unsupported": ("ts", "INT96 physical type")},
        ),
        (
            "unsupported_brotli",
            "the mmlu_like table compressed with brotli",
            mmlu,
            {"compression": "brotli"},
            {"unsupported": ("question", "BROTLI compression codec (the first column chunk read)")},
        ),
    ]
    return out


def rows_of(table):
    """The expected JSON rows of `table` (the module docstring's rules)."""
    columns = []
    for i, field in enumerate(table.schema):
        col = table.column(i)
        if pa.types.is_timestamp(field.type):
            col = col.cast(pa.int64())
        elif pa.types.is_date32(field.type):
            col = col.cast(pa.int32())
        columns.append(col)
    table = pa.Table.from_arrays(columns, names=table.schema.names)
    return [jsonable(row) for row in table.to_pylist()]


def jsonable(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, bytes):
        return list(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    assert value is None or isinstance(value, (bool, int, str)), type(value)
    return value


def jsonl(rows):
    return "".join(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n" for row in rows)


# ---- the layout, from the files' own page headers (pyarrow's metadata lists a chunk's
# encodings but not which pages use them, nor the page kinds).

# pyarrow's ColumnChunkMetaData.compression names LZ4_RAW "LZ4", so codecs are read from the
# footer too.
CODECS = {0: "UNCOMPRESSED", 1: "SNAPPY", 2: "GZIP", 3: "LZO", 4: "BROTLI", 5: "LZ4", 6: "ZSTD", 7: "LZ4_RAW"}
ENCODINGS = {0: "PLAIN", 2: "PLAIN_DICTIONARY", 3: "RLE", 4: "BIT_PACKED", 5: "DELTA_BINARY_PACKED",
             6: "DELTA_LENGTH_BYTE_ARRAY", 7: "DELTA_BYTE_ARRAY", 8: "RLE_DICTIONARY", 9: "BYTE_STREAM_SPLIT"}
PAGE_KINDS = {0: "DATA_PAGE", 1: "INDEX_PAGE", 2: "DICTIONARY_PAGE", 3: "DATA_PAGE_V2"}


class Compact:
    """Just enough of Thrift's compact protocol to read a PageHeader into {field id: value}."""

    def __init__(self, buf, pos):
        self.buf, self.pos = buf, pos

    def byte(self):
        self.pos += 1
        return self.buf[self.pos - 1]

    def varint(self):
        shift = out = 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return out

    def zigzag(self):
        v = self.varint()
        return (v >> 1) ^ -(v & 1)

    def value(self, t):
        if t in (1, 2):
            return t == 1
        if t == 3:
            return struct.unpack("b", bytes([self.byte()]))[0]
        if t in (4, 5, 6):
            return self.zigzag()
        if t == 7:
            self.pos += 8
            return struct.unpack("<d", self.buf[self.pos - 8 : self.pos])[0]
        if t == 8:
            n = self.varint()
            self.pos += n
            return self.buf[self.pos - n : self.pos]
        if t in (9, 10):
            header = self.byte()
            size, elem = header >> 4, header & 15
            if size == 15:
                size = self.varint()
            return [self.byte() == 1 if elem in (1, 2) else self.value(elem) for _ in range(size)]
        if t == 11:
            size = self.varint()
            kinds = self.byte() if size else 0
            return [(self.value(kinds >> 4), self.value(kinds & 15)) for _ in range(size)]
        if t == 12:
            return self.struct()
        raise ValueError(f"thrift type {t}")

    def struct(self):
        fields, last = {}, 0
        while True:
            header = self.byte()
            if header == 0:
                return fields
            delta, t = header >> 4, header & 15
            last = last + delta if delta else self.zigzag()
            fields[last] = self.value(t)


def pages(buf, chunk):
    """(page kind, encoding, level encodings) of every page of a column chunk."""
    pos = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    end = pos + chunk.total_compressed_size
    out = []
    while pos < end:
        reader = Compact(buf, pos)
        header = reader.struct()
        kind = PAGE_KINDS[header[1]]
        if kind == "DATA_PAGE":
            h = header[5]
            out.append((kind, ENCODINGS[h[2]], f"levels {ENCODINGS[h[3]]}"))
        elif kind == "DATA_PAGE_V2":
            h = header[8]
            out.append((kind, ENCODINGS[h[4]], "compressed" if h.get(7, True) else "uncompressed"))
        elif kind == "DICTIONARY_PAGE":
            out.append((kind, ENCODINGS[header[7][2]], ""))
        else:
            out.append((kind, "", ""))
        pos = reader.pos + header[3]
    if pos != end:
        raise ValueError(f"pages overrun their column chunk: {pos} != {end}")
    return out


def footer_codecs(buf):
    """The codec of every column chunk, as the footer's Thrift FileMetaData stores it."""
    assert buf[-4:] == b"PAR1"
    size = struct.unpack("<I", buf[-8:-4])[0]
    file_meta = Compact(buf, len(buf) - 8 - size).struct()
    # FileMetaData.row_groups (4) -> RowGroup.columns (1) -> ColumnChunk.meta_data (3) -> codec (4)
    return [[CODECS[chunk[3][4]] for chunk in group[1]] for group in file_meta.get(4, [])]


def layout(path, unsupported=False):
    """What the manifest records of a file: codecs, row groups, and per column its pages,
    columns with the same pages grouped under one description."""
    with open(path, "rb") as f:
        buf = f.read()
    meta = pq.ParquetFile(path).metadata
    codecs = footer_codecs(buf)
    seen_codecs, by_column, page_counts, physical = set(), {}, [], {}
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            seen_codecs.add(codecs[g][c])
            found = pages(buf, chunk)
            page_counts.append(sum(k != "DICTIONARY_PAGE" for k, _, _ in found))
            entry = by_column.setdefault(chunk.path_in_schema, set())
            for kind, encoding, extra in found:
                entry.add(f"{kind}[{encoding}{', ' + extra if extra else ''}]")
            # The metadata's own list, to catch a disagreement with the pages.
            entry.update(f"meta:{e}" for e in chunk.encodings)
            physical[chunk.path_in_schema] = chunk.physical_type
    groups = {}
    for column_path, entry in by_column.items():
        desc = " ".join(sorted(e for e in entry if not e.startswith("meta:")))
        desc += " | metadata: " + ",".join(sorted(e[5:] for e in entry if e.startswith("meta:")))
        groups.setdefault(desc, []).append(column_path)
    out = {
        "rows": meta.num_rows,
        "row_groups": meta.num_row_groups,
        "format_version": meta.format_version,
        "codecs": sorted(seen_codecs),
        "data_pages_per_column_chunk": [min(page_counts), max(page_counts)] if page_counts else [],
        "pages": {desc: ", ".join(cols) for desc, cols in sorted(groups.items())},
    }
    if unsupported:
        out["physical_types"] = physical
    return out


def write():
    os.makedirs(OUT_DIR, exist_ok=True)
    manifest = {
        "generated_by": "benches/torch/make_parquet_fixture.py",
        "pyarrow": pa.__version__,
        "defaults": "options not in write_options are pyarrow.parquet.write_table's: snappy, dictionary pages, "
        "data page v1, format 2.6, statistics, the Arrow schema in the key-value metadata",
        "layout_key": "pages: for each group of columns (leaf paths), the kinds of page their chunks hold with each "
        "page's encoding (v1: and its level encoding; v2: whether its values are compressed), read from the page "
        "headers, then the encodings the chunk metadata lists; codecs are read from the footer",
        "fixtures": [],
        "unsupported": [],
    }
    for name, covers, table, options, extra in fixtures():
        path = os.path.join(OUT_DIR, name + ".parquet")
        pq.write_table(table, path, **options)
        entry = {"file": name + ".parquet", "covers": covers}
        unsupported = extra.pop("unsupported", None)
        if unsupported:
            entry["column"], entry["reason"] = unsupported
        else:
            with open(os.path.join(OUT_DIR, name + ".jsonl"), "w", encoding="utf-8", newline="\n") as f:
                f.write(jsonl(rows_of(pq.read_table(path))))
            entry["expected"] = name + ".jsonl"
        entry["write_options"] = {k: v for k, v in options.items() if k != "column_encoding"}
        entry.update(extra)
        entry["layout"] = layout(path, unsupported=bool(unsupported))
        manifest["unsupported" if unsupported else "fixtures"].append(entry)
    with open(os.path.join(OUT_DIR, MANIFEST), "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(manifest, ensure_ascii=False, indent=1) + "\n")
    sizes = {f: os.path.getsize(os.path.join(OUT_DIR, f)) for f in sorted(os.listdir(OUT_DIR))}
    print(f"wrote {len(sizes)} files, {sum(sizes.values())} bytes in all", file=sys.stderr)


def first_difference(ours, theirs):
    if len(ours) != len(theirs):
        return f"{len(ours)} rows against {len(theirs)}"
    i = next(i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y)
    keys = [k for k in ours[i] if ours[i].get(k) != theirs[i].get(k)] or sorted(set(theirs[i]) - set(ours[i]))
    k = keys[0]
    return f"row {i}, column {k!r}: {json.dumps(ours[i].get(k), ensure_ascii=False)} against {json.dumps(theirs[i].get(k), ensure_ascii=False)}"


def check():
    """Differences between the committed fixtures and what this script derives, as text."""
    with open(os.path.join(OUT_DIR, MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    problems = []
    listed = {MANIFEST}
    by_name = {e["file"]: e for e in manifest["fixtures"] + manifest["unsupported"]}
    for name, _, table, options, extra in fixtures():
        path = os.path.join(OUT_DIR, name + ".parquet")
        entry = by_name.get(name + ".parquet")
        if entry is None:
            problems.append(f"{name}.parquet: not in the manifest")
            continue
        listed.add(entry["file"])
        if not os.path.exists(path):
            problems.append(f"{name}.parquet: missing")
            continue
        if ("unsupported" in extra) != ("expected" not in entry):
            problems.append(f"{name}: supported/unsupported differs from the manifest")
        if "expected" in entry:
            listed.add(entry["expected"])
            rows = rows_of(pq.read_table(path))
            with open(os.path.join(OUT_DIR, entry["expected"]), encoding="utf-8") as f:
                committed = [json.loads(line) for line in f]
            if rows != committed:
                problems.append(f"{name}.parquet as pyarrow reads it vs {entry['expected']}: {first_difference(rows, committed)}")
            built = rows_of(table)
            if built != committed:
                problems.append(f"the table this script builds vs {entry['expected']}: {first_difference(built, committed)}")
        seen = layout(path, unsupported="unsupported" in extra)
        if seen != entry["layout"]:
            problems.append(f"{name}: layout differs from the manifest:\n  file:     {json.dumps(seen)}\n  manifest: {json.dumps(entry['layout'])}")
    # Subdirectories hold other scripts' fixtures (arrow/ is make_arrow_fixture.py's).
    present = {f for f in os.listdir(OUT_DIR) if os.path.isfile(os.path.join(OUT_DIR, f))}
    for f in sorted(present - listed):
        problems.append(f"{f}: present but not in the manifest")
    for f in sorted(listed - present):
        problems.append(f"{f}: in the manifest but missing")
    return problems


def summary():
    """One line per file and column group: codecs and pages, as the files hold them."""
    with open(os.path.join(OUT_DIR, MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    for entry in manifest["fixtures"] + manifest["unsupported"]:
        lay = entry["layout"]
        size = os.path.getsize(os.path.join(OUT_DIR, entry["file"]))
        print(f"{entry['file']}: {size} B, {lay['rows']} rows, {lay['row_groups']} row groups, format {lay['format_version']}, "
              f"codecs {','.join(lay['codecs'])}, data pages per chunk {lay['data_pages_per_column_chunk']}")
        for desc, cols in lay["pages"].items():
            print(f"    {desc}: {cols}")


def main():
    if "--quick" in sys.argv:
        print("make_parquet_fixture: a fixture writer, not a bench", file=sys.stderr)
        sys.exit(3)
    if "--write" not in sys.argv and "--check" not in sys.argv:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    if "--write" in sys.argv:
        write()
    problems = check()
    if "--verbose" in sys.argv:
        summary()
    for p in problems:
        print(p, file=sys.stderr)
    print("fixtures match" if not problems else "fixtures DIFFER", file=sys.stderr)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
