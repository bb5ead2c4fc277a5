"""Write the Arrow IPC fixtures that crates/parquet/tests/arrow_ipc.rs reads, with the rows each must yield.

Hugging Face `datasets` keeps every dataset it loads or builds as Arrow IPC streams: the cache's
`*.arrow` files and `save_to_disk`'s `data-0000N-of-0000M.arrow`. headroom-parquet's
`ArrowFile` reads them as JSON rows by the rules `make_parquet_fixture.py` states (its
`rows_of`), so an Arrow file and a Parquet file of one table read alike.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

Usage, from the workspace root, with a Python that has pyarrow and datasets (written with
pyarrow 26.0.1 and datasets 5.2.0):

    python3 benches/torch/make_arrow_fixture.py --write   # (re)write the committed fixtures
    python3 benches/torch/make_arrow_fixture.py --check   # re-read them, compare, write nothing

Written under `crates/parquet/tests/fixtures/arrow/` (about 360 KB, the expected rows included):
- the Parquet fixtures' types table (every supported column type, nulls at every level) in
  batches of 7 rows, as: `types_stream.arrow` (the stream format, as `datasets` writes),
  `types_file.arrow` (the file format, Feather v2), `types_zstd.arrow` and `types_lz4.arrow`
  (buffers compressed with ZSTD and LZ4_FRAME), `types_v4.arrow` (metadata version V4) and
  `types_legacy.arrow` (the stream format before Arrow 0.15: no continuation markers); all
  read as `types.jsonl`, which is the Parquet fixtures' `types_none.jsonl`, byte for byte;
- `dict_delta.arrow`, `dict_replace.arrow`, `dict_file.arrow`: dictionary-encoded string
  columns whose dictionary grows between batches (delta batches), is replaced between
  batches (the stream format allows it), or is one for the whole file;
- `sft_prompt_completion.arrow` and `mmlu_like.arrow`: the Parquet fixtures' tables of those
  names, which the trainer's tests build into the same token files and score alike from
  either format;
- `unsupported.arrow`: map, decimal, float16, dense union and string_view columns between
  readable ones; the reader refuses each unsupported column by name and reads the others;
- `hf_save_to_disk/`: `Dataset.save_to_disk(num_shards=2)` of a FineWeb-like text table
  (two `.arrow` shards, `dataset_info.json`, `state.json`), and `hf_cache_map.arrow`: the cache
  file `Dataset.map` wrote when tokenizing it (`input_ids` as list<int32>, as tokenized
  datasets are), copied out of the cache;
- `MANIFEST.json`: every file, what it covers, its expected rows, and for the unsupported
  file which column is refused and why.

`--check` re-reads every committed file with pyarrow, derives its rows again and compares
them with the committed `.jsonl`, and checks that the manifest lists exactly the files present.
"""

import json
import os
import random
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

try:
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import make_parquet_fixture as pf
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"pyarrow is needed: {e}", file=sys.stderr)
    sys.exit(3)

ROOT = os.path.dirname(os.path.dirname(HERE))
OUT_DIR = os.path.join(ROOT, "crates", "parquet", "tests", "fixtures", "arrow")
PARQUET_TYPES_JSONL = os.path.join(ROOT, "crates", "parquet", "tests", "fixtures", "types_none.jsonl")
MANIFEST = "MANIFEST.json"
BATCH_ROWS = 7


def write_stream(path, table, **options):
    with ipc.new_stream(path, table.schema, options=ipc.IpcWriteOptions(**options)) as w:
        for batch in table.to_batches(max_chunksize=BATCH_ROWS):
            w.write_batch(batch)


def write_file(path, table, **options):
    with ipc.new_file(path, table.schema, options=ipc.IpcWriteOptions(**options)) as w:
        for batch in table.to_batches(max_chunksize=BATCH_ROWS):
            w.write_batch(batch)


def read_any(path):
    with open(path, "rb") as f:
        head = f.read(6)
    if head == b"ARROW1":
        return ipc.open_file(path).read_all()
    return ipc.open_stream(path).read_all()


DICT_SCHEMA = pa.schema([("n", pa.int32()), ("label", pa.dictionary(pa.int8(), pa.string()))])


def dict_batch(ns, labels, dictionary):
    indices = pa.array([None if x is None else dictionary.index(x) for x in labels], pa.int8())
    return pa.record_batch(
        [pa.array(ns, pa.int32()), pa.DictionaryArray.from_arrays(indices, pa.array(dictionary, pa.string()))],
        schema=DICT_SCHEMA,
    )


def dictionary_batches_with(dictionary):
    return DICT_SCHEMA, dict_batch([9, 10, 11], ["東京", None, "cat"], dictionary)


def dictionary_batches():
    """Three batches of a dictionary-encoded `label` (and a plain `n`): the second's dictionary
    extends the first's, the third's is another one altogether."""
    schema = DICT_SCHEMA
    batch = dict_batch
    return schema, [
        batch([0, 1, 2], ["cat", None, "dog"], ["cat", "dog"]),
        batch([3, 4, 5, 6], ["dog", "東京", "cat", "東京"], ["cat", "dog", "東京"]),
        batch([7, 8], ["zebra", None], ["zebra"]),
    ]


def write_dictionaries(path, fmt, **options):
    schema, batches = dictionary_batches()
    if fmt == "file":
        # A file holds one dictionary for all its batches.
        _, again = dictionary_batches_with(["cat", "dog", "東京"])
        with ipc.new_file(path, schema, options=ipc.IpcWriteOptions(**options)) as w:
            w.write_batch(batches[1])
            w.write_batch(again)
        return
    with ipc.new_stream(path, schema, options=ipc.IpcWriteOptions(**options)) as w:
        for b in batches:
            w.write_batch(b)


def unsupported_table():
    rng = random.Random(505)
    n = 6
    import decimal

    import numpy as np

    union = pa.UnionArray.from_dense(
        pa.array([0, 1, 0, 1, 0, 1], pa.int8()),
        pa.array([0, 0, 1, 1, 2, 2], pa.int32()),
        [pa.array([1, 2, 3], pa.int64()), pa.array(["a", "b", "c"])],
        ["i", "s"],
    )
    return pa.table(
        {
            "id": pa.array(range(n), pa.int32()),
            "scores": pa.array([[("a", 1)], None, [], [("b", 2), ("c", 3)], [("d", 4)], []], pa.map_(pa.string(), pa.int32())),
            "price": pa.array([decimal.Decimal(rng.randint(-999, 999)) / 10 for _ in range(n)], pa.decimal128(6, 1)),
            "half": pa.array(np.array([0.5, -1.0, 2.0, 0.0, 1.5, 3.0], dtype=np.float16), pa.float16()),
            "either": union,
            "view": pa.array(["short", "a string longer than twelve bytes", None, "", "x", "🦀🦀🦀🦀"], pa.string_view()),
            "after": pa.array(["read", "after", "the", "unsupported", "columns", "🦀"]),
        }
    )


UNSUPPORTED = {"scores": "map", "price": "decimal", "half": "float16", "either": "union", "view": "view type"}


def hf_fixtures(out_dir):
    """`save_to_disk` of a FineWeb-like text table in two shards, and the cache file
    `Dataset.map` writes when tokenizing it; returns their paths relative to `out_dir`."""
    import datasets

    table = pf.fineweb_table()
    ds = datasets.Dataset(table.select(["text", "id", "language_score"]))
    saved = os.path.join(out_dir, "hf_save_to_disk")
    shutil.rmtree(saved, ignore_errors=True)
    ds.save_to_disk(saved, num_shards=2)
    with tempfile.TemporaryDirectory() as cache:
        source = datasets.load_from_disk(saved)
        # A stand-in tokenizer (bytes of each word, a few of them): the cache file's layout is
        # what matters, a list<int32> column beside the text.
        mapped = source.map(
            lambda row: {"input_ids": [sum(w.encode()) % 50000 for w in row["text"].split()[:12]]},
            features=datasets.Features({**source.features, "input_ids": datasets.List(datasets.Value("int32"))}),
            cache_file_name=os.path.join(cache, "tokenized.arrow"),
            writer_batch_size=8,
        )
        del mapped
        shutil.copy(os.path.join(cache, "tokenized.arrow"), os.path.join(out_dir, "hf_cache_map.arrow"))
    shards = sorted(f for f in os.listdir(saved) if f.endswith(".arrow"))
    return [os.path.join("hf_save_to_disk", s) for s in shards] + ["hf_cache_map.arrow"]


def fixtures():
    """(file, what it covers, writer) for every generated table file."""
    types = pf.types_table()
    return [
        ("types_stream.arrow", "the types table, stream format, batches of 7 rows", lambda p: write_stream(p, types)),
        ("types_file.arrow", "the types table, file format (Feather v2)", lambda p: write_file(p, types)),
        ("types_zstd.arrow", "the types table, stream format, buffers compressed with ZSTD", lambda p: write_stream(p, types, compression="zstd")),
        ("types_lz4.arrow", "the types table, stream format, buffers compressed with LZ4_FRAME", lambda p: write_stream(p, types, compression="lz4")),
        (
            "types_v4.arrow",
            "the types table, stream format, metadata version V4",
            lambda p: write_stream(p, types, metadata_version=ipc.MetadataVersion.V4),
        ),
        (
            "types_legacy.arrow",
            "the types table, the stream format before Arrow 0.15 (no continuation markers)",
            lambda p: write_stream(p, types, use_legacy_format=True),
        ),
        (
            "dict_delta.arrow",
            "a dictionary-encoded column over three batches: the second batch's dictionary a delta, the third's a replacement",
            lambda p: write_dictionaries(p, "stream", emit_dictionary_deltas=True),
        ),
        (
            "dict_replace.arrow",
            "a dictionary-encoded column over three batches, the dictionary replaced whole before each",
            lambda p: write_dictionaries(p, "stream"),
        ),
        ("dict_file.arrow", "a dictionary-encoded column in the file format", lambda p: write_dictionaries(p, "file")),
        (
            "mmlu_like.arrow",
            "the Parquet fixture mmlu_like's table (MMLU's columns, Features in the schema metadata), file format",
            lambda p: write_file(p, pf.mmlu_table()),
        ),
        (
            "sft_prompt_completion.arrow",
            "TRL's prompt-completion shape, the Parquet fixture's table, batches of 7 rows",
            lambda p: write_stream(p, pf.sft_tables()[1]),
        ),
        (
            "unsupported.arrow",
            "map, decimal, float16, dense union and string_view columns between readable ones",
            lambda p: write_stream(p, unsupported_table()),
        ),
    ]


def expected_rows(path, unsupported=False):
    table = read_any(path)
    if unsupported:
        table = table.select([c for c in table.column_names if c not in UNSUPPORTED])
    return pf.rows_of(table)


def write():
    os.makedirs(OUT_DIR, exist_ok=True)
    manifest = {
        "generated_by": "benches/torch/make_arrow_fixture.py",
        "pyarrow": pa.__version__,
        "rules": "rows as make_parquet_fixture.py's rows_of: to_pylist, JSON's conversions",
        "fixtures": [],
    }
    try:
        import datasets

        manifest["datasets"] = datasets.__version__
    except ImportError:
        print("datasets is needed for the hf_ fixtures", file=sys.stderr)
        sys.exit(3)
    for name, covers, writer in fixtures():
        path = os.path.join(OUT_DIR, name)
        writer(path)
        unsupported = name == "unsupported.arrow"
        stem = "types" if name.startswith("types_") else name[: -len(".arrow")]
        expected = stem + ".jsonl"
        with open(os.path.join(OUT_DIR, expected), "w", encoding="utf-8", newline="\n") as f:
            f.write(pf.jsonl(expected_rows(path, unsupported)))
        entry = {"file": name, "covers": covers, "expected": expected, "batches": batches_of(path)}
        if unsupported:
            entry["unsupported"] = UNSUPPORTED
        manifest["fixtures"].append(entry)
    for rel in hf_fixtures(OUT_DIR):
        path = os.path.join(OUT_DIR, rel)
        expected = rel.replace("/", "_")[: -len(".arrow")] + ".jsonl"
        with open(os.path.join(OUT_DIR, expected), "w", encoding="utf-8", newline="\n") as f:
            f.write(pf.jsonl(expected_rows(path)))
        covers = (
            "a shard `datasets` save_to_disk wrote (num_shards=2) of FineWeb-like text"
            if rel.startswith("hf_save_to_disk")
            else "the cache file `datasets` Dataset.map wrote: text, id, language_score and input_ids (list<int32>), batches of 8"
        )
        manifest["fixtures"].append({"file": rel, "covers": covers, "expected": expected, "batches": batches_of(path)})
    with open(os.path.join(OUT_DIR, MANIFEST), "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(manifest, ensure_ascii=False, indent=1) + "\n")


def batches_of(path):
    with open(path, "rb") as f:
        head = f.read(6)
    reader = ipc.open_file(path) if head == b"ARROW1" else ipc.open_stream(path)
    if head == b"ARROW1":
        return reader.num_record_batches
    return sum(1 for _ in reader)


def check():
    with open(os.path.join(OUT_DIR, MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    problems = []
    listed = {MANIFEST, "hf_save_to_disk"}
    for entry in manifest["fixtures"]:
        path = os.path.join(OUT_DIR, entry["file"])
        listed.add(entry["file"].split("/")[0])
        listed.add(entry["expected"])
        rows = expected_rows(path, "unsupported" in entry)
        with open(os.path.join(OUT_DIR, entry["expected"]), encoding="utf-8") as f:
            committed = [json.loads(line) for line in f]
        if rows != committed:
            problems.append(f"{entry['file']} vs {entry['expected']}: {pf.first_difference(rows, committed)}")
        if batches_of(path) != entry["batches"]:
            problems.append(f"{entry['file']}: {batches_of(path)} batches, the manifest says {entry['batches']}")
    with open(os.path.join(OUT_DIR, "types.jsonl"), "rb") as a, open(PARQUET_TYPES_JSONL, "rb") as b:
        if a.read() != b.read():
            problems.append("types.jsonl is not the Parquet fixtures' types_none.jsonl")
    present = set(os.listdir(OUT_DIR))
    for f in sorted(present - listed):
        problems.append(f"{f}: present but not in the manifest")
    for f in sorted(listed - present):
        problems.append(f"{f}: in the manifest but missing")
    return problems


def main():
    if "--quick" in sys.argv:
        print("make_arrow_fixture: a fixture writer, not a bench", file=sys.stderr)
        sys.exit(3)
    if "--write" not in sys.argv and "--check" not in sys.argv:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    if "--write" in sys.argv:
        write()
    problems = check()
    for p in problems:
        print(p, file=sys.stderr)
    print("fixtures match" if not problems else "fixtures DIFFER", file=sys.stderr)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
