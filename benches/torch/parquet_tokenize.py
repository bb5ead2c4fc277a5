#!/usr/bin/env python3
"""Tokenizing a FineWeb-shaped Parquet corpus: `headroom data build` against nanoGPT's way.

Writes a synthetic corpus with FineWeb's columns (datatrove's layout: `text` plus eight
metadata columns, Snappy, row groups of 2 048 rows) and the same documents as a text file
joined by `<|endoftext|>`, then times, alternating the four in each round:

- `headroom data build --tokenizer gpt2 corpus.parquet` (each row a document and its
  `<|endoftext|>`; only the `text` column decoded, a row group at a time);
- `headroom data build --tokenizer gpt2 --separator '<|endoftext|>' corpus.txt`, the same
  documents from text: what the Parquet reading costs on top;
- nanoGPT's `fineweb.py` way in one process (it runs `cpu_count() // 2` of them, one here):
  pyarrow's batches of the `text` column, tiktoken's `encode_ordinary` per document, then
  `<|endoftext|>`, written as uint16;
- pyarrow reading the `text` column into Python strings alone (the decoding's share);
- `headroom data build` of the same records as JSON lines: plain, gzip'd, and zstd'd by
  `pzstd` (several frames with skippable frames between them), streamed;
- with `datasets` installed, `headroom data build` of the same rows as `datasets` keeps them
  on disk: the directory `Dataset.save_to_disk(num_shards=2)` writes (Arrow IPC streams, its
  default record batches of 1 000 rows), and `datasets.load_from_disk` reading that
  directory's `text` column into Python strings (the decoding's share, as above);
- the same rows as a directory of four Parquet files (a Hub split's shards) built into
  llm.c's shards (`--shard-tokens`, `--val-shards 1`, `--document-token start`), and, with
  `--llmc PATH` (a checkout of karpathy/llm.c), llm.c's own `dev/data/fineweb.py` writing
  shards of the same size from the same rows (its `load_dataset` streams the four files'
  `text` column with pyarrow; it runs `cpu_count() - 2` processes, at least one: one here).
  The two sets of shards must be byte-identical.

Each is a process of its own under `/usr/bin/time` (wall seconds and peak RSS). The token
streams of headroom's Parquet build and of the tiktoken baseline must be equal, and the text
build's must be the same less the final `<|endoftext|>`; the script fails otherwise.

tiktoken's GPT-2 ranks are read from tiktoken-rs's `r50k_base.tiktoken` (the file headroom's
BPE is built from; this machine reaches no download), with tiktoken's own r50k pattern.

Usage, from the workspace root, after `cargo build --release -p headroom-trainer`:

    python3 benches/torch/parquet_tokenize.py [--docs 40000] [--runs 3] [--out DIR] [--llmc PATH]

Prints one JSON record per measurement and a markdown table. Not a paired bench:
`cargo xtask bench` runs every script here with `--quick`, which exits 3 ("skipped").
"""

import glob
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

if "--quick" in sys.argv:
    print("a standalone measurement; run it without --quick", file=sys.stderr)
    sys.exit(3)

try:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
except ImportError as e:
    print(f"needs numpy, pyarrow and tiktoken: {e}", file=sys.stderr)
    sys.exit(3)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOT = 50256
R50K_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def arg(name, default):
    if name in sys.argv:
        return type(default)(sys.argv[sys.argv.index(name) + 1])
    return default


def gpt2():
    ranks_file = glob.glob(os.path.expanduser(
        "~/.cargo/registry/src/*/tiktoken-rs-*/assets/r50k_base.tiktoken"))
    if not ranks_file:
        print("tiktoken-rs's r50k_base.tiktoken is not in ~/.cargo (build headroom first)",
              file=sys.stderr)
        sys.exit(3)
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=R50K_PATTERN,
        mergeable_ranks=load_tiktoken_bpe(sorted(ranks_file)[-1]),
        special_tokens={"<|endoftext|>": EOT},
    )


WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "more no out so said what up its about into than them can only other new some could time "
    "these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three"
).split() + ["café", "naïve", "2024", "3.5%", "U.S.", "e-mail", "(see", "below)", "—", "東京"]


def corpus(docs, seed=1501):
    rng = random.Random(seed)
    rows = []
    for i in range(docs):
        target = int(rng.lognormvariate(7.3, 0.8))  # median ~1.5 KB, a long tail
        paragraphs, size = [], 0
        while size < target:
            sentences = []
            for _ in range(rng.randint(1, 5)):
                words = [rng.choice(WORDS) for _ in range(rng.randint(5, 25))]
                sentences.append(" ".join(words).capitalize() + rng.choice([".", ".", "?", "!"]))
            paragraphs.append(" ".join(sentences))
            size += len(paragraphs[-1])
        text = "\n\n".join(paragraphs)
        rows.append({
            "text": text,
            "id": f"<urn:uuid:{rng.getrandbits(128):032x}>",
            "dump": "CC-MAIN-2024-10",
            "url": f"https://example.com/{i}",
            "date": "2024-02-21T12:00:00Z",
            "file_path": f"s3://commoncrawl/crawl-data/CC-MAIN-2024-10/{i % 97:05d}.warc.gz",
            "language": "en",
            "language_score": rng.uniform(0.65, 1.0),
            "token_count": len(text) // 4,
        })
    return rows


def timed(command):
    """Wall seconds and peak RSS (MiB) of `command` under /usr/bin/time."""
    out = subprocess.run(["/usr/bin/time", "-f", "%e %M"] + command,
                         capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stdout, out.stderr, file=sys.stderr)
        raise SystemExit(f"{command[0]} failed")
    seconds, kib = out.stderr.strip().splitlines()[-1].split()
    return float(seconds), int(kib) / 1024


def baseline_tokenize(parquet, out):
    """nanoGPT's fineweb.py in one process: each document's ids, then <|endoftext|>."""
    enc = gpt2()
    chunks = []
    for batch in pq.ParquetFile(parquet).iter_batches(columns=["text"]):
        for text in batch.column(0).to_pylist():
            ids = enc.encode_ordinary(text)
            ids.append(EOT)
            chunks.append(np.array(ids, dtype=np.uint16))
    np.concatenate(chunks).tofile(out)


def baseline_llmc(llmc, shard_dir, shard_tokens, out):
    """llm.c's fineweb.py over the Parquet files of `shard_dir`, writing into `out`."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import make_llmc_shards_fixture as environment

    files = sorted(glob.glob(os.path.join(shard_dir, "*.parquet")))

    def rows():
        for f in files:
            for batch in pq.ParquetFile(f).iter_batches(columns=["text"]):
                for text in batch.column(0).to_pylist():
                    yield {"text": text}

    environment.install_environment(rows())
    args = ["-t", "classic", "-v", "10B", "-m", "gpt-2", "-s", str(shard_tokens)]
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    with tempfile.TemporaryDirectory() as work:
        for shard in environment.run_fineweb(llmc, work, args):
            shutil.move(shard, os.path.join(out, os.path.basename(shard)))


def baseline_read(parquet):
    texts = pq.read_table(parquet, columns=["text"]).column("text").to_pylist()
    assert texts


def baseline_read_saved(saved):
    import datasets

    texts = datasets.load_from_disk(saved).data.column("text").to_pylist()
    assert texts


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--baseline-tokenize":
        return baseline_tokenize(sys.argv[2], sys.argv[3])
    if len(sys.argv) > 1 and sys.argv[1] == "--baseline-read":
        return baseline_read(sys.argv[2])
    if len(sys.argv) > 1 and sys.argv[1] == "--baseline-read-saved":
        return baseline_read_saved(sys.argv[2])
    if len(sys.argv) > 1 and sys.argv[1] == "--baseline-llmc":
        return baseline_llmc(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    docs = arg("--docs", 40000)
    runs = arg("--runs", 3)
    out = arg("--out", "/tmp/headroom-parquet-bench")
    headroom = arg("--headroom", os.path.join(ROOT, "target", "release", "headroom"))
    os.makedirs(out, exist_ok=True)
    parquet = os.path.join(out, "corpus.parquet")
    text_file = os.path.join(out, "corpus.txt")
    start = time.perf_counter()
    rows = corpus(docs)
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, parquet, row_group_size=2048, compression="snappy")
    with open(text_file, "w", encoding="utf-8") as f:
        f.write("<|endoftext|>".join(r["text"] for r in rows))
    # The same records as JSON lines, plain, gzip'd and zstd'd (pzstd: several frames with
    # skippable ones between them, as it writes for parallel decompression).
    jsonl = os.path.join(out, "corpus.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    with open(jsonl, "rb") as src, gzip.open(jsonl + ".gz", "wb", compresslevel=6) as dst:
        dst.write(src.read())
    zstd = shutil.which("pzstd") or shutil.which("zstd")
    if zstd:
        subprocess.run([zstd, "-q", "-f", "-p", "2", jsonl, "-o", jsonl + ".zst"]
                       if zstd.endswith("pzstd") else [zstd, "-q", "-f", jsonl, "-o", jsonl + ".zst"],
                       check=True)
    # A Hub split's shards: the rows in four files, in order.
    shard_dir = os.path.join(out, "hub_split")
    shutil.rmtree(shard_dir, ignore_errors=True)
    os.makedirs(shard_dir)
    quarter = (len(rows) + 3) // 4
    for k in range(4):
        pq.write_table(pa.Table.from_pylist(rows[k * quarter:(k + 1) * quarter]),
                       os.path.join(shard_dir, f"{k:03d}_00000.parquet"),
                       row_group_size=2048, compression="snappy")
    # The rows as `datasets` keeps them: save_to_disk's Arrow shards.
    saved = None
    try:
        import datasets

        saved = os.path.join(out, "saved")
        shutil.rmtree(saved, ignore_errors=True)
        datasets.Dataset(table).save_to_disk(saved, num_shards=2)
    except ImportError:
        print("datasets is not installed: no save_to_disk run", file=sys.stderr)
    shard_tokens = arg("--shard-tokens", 5_000_000)
    llmc = arg("--llmc", "")
    text_bytes = sum(len(r["text"].encode()) for r in rows)
    print(f"corpus: {docs} documents, {text_bytes / 1e6:.1f} MB of text, Parquet "
          f"{os.path.getsize(parquet) / 1e6:.1f} MB ({time.perf_counter() - start:.0f} s to write)",
          file=sys.stderr)
    py = sys.executable
    me = os.path.abspath(__file__)
    commands = {
        "headroom_parquet": [headroom, "data", "build", "--quiet", "--tokenizer", "gpt2",
                             parquet, os.path.join(out, "parquet.bin")],
        "headroom_text": [headroom, "data", "build", "--quiet", "--tokenizer", "gpt2",
                          "--separator", "<|endoftext|>", text_file, os.path.join(out, "text.bin")],
        "headroom_jsonl": [headroom, "data", "build", "--quiet", "--tokenizer", "gpt2",
                           jsonl, os.path.join(out, "jsonl.bin")],
        "headroom_jsonl_gz": [headroom, "data", "build", "--quiet", "--tokenizer", "gpt2",
                              jsonl + ".gz", os.path.join(out, "jsonl_gz.bin")],
        "nanogpt_tiktoken": [py, me, "--baseline-tokenize", parquet, os.path.join(out, "tiktoken.u16")],
        "pyarrow_read_text": [py, me, "--baseline-read", parquet],
    }
    ours_dir = os.path.join(out, "headroom_shards")
    theirs_dir = os.path.join(out, "llmc_shards")
    commands["headroom_dir_to_llmc_shards"] = [
        headroom, "data", "build", "--quiet", "--tokenizer", "gpt2", "--shard-tokens",
        str(shard_tokens), "--val-shards", "1", "--document-token", "start", shard_dir,
        os.path.join(ours_dir, "fineweb.bin")]
    os.makedirs(ours_dir, exist_ok=True)
    if llmc:
        commands["llmc_fineweb_py"] = [py, me, "--baseline-llmc", llmc, shard_dir,
                                       str(shard_tokens), theirs_dir]
    if saved:
        commands["headroom_arrow_saved"] = [headroom, "data", "build", "--quiet", "--tokenizer",
                                            "gpt2", saved, os.path.join(out, "arrow_saved.bin")]
        commands["datasets_read_saved_text"] = [py, me, "--baseline-read-saved", saved]
    if zstd:
        commands["headroom_jsonl_zst"] = [headroom, "data", "build", "--quiet", "--tokenizer",
                                          "gpt2", jsonl + ".zst", os.path.join(out, "jsonl_zst.bin")]
    times = {name: [] for name in commands}
    for r in range(runs):
        for name, command in commands.items():
            seconds, mib = timed(command)
            times[name].append((seconds, mib))
            print(f"round {r + 1}: {name} {seconds:.2f} s, {mib:.0f} MiB", file=sys.stderr)
    # The token streams agree.
    ours = np.fromfile(os.path.join(out, "parquet.bin"), dtype=np.uint16)[512:]
    text_ids = np.fromfile(os.path.join(out, "text.bin"), dtype=np.uint16)[512:]
    theirs = np.fromfile(os.path.join(out, "tiktoken.u16"), dtype=np.uint16)
    if not np.array_equal(ours, theirs):
        raise SystemExit(f"headroom's Parquet build differs from tiktoken's ({len(ours)} vs "
                         f"{len(theirs)} tokens)")
    if not np.array_equal(ours[:-1], text_ids):
        raise SystemExit("the Parquet build is not the text build and a final <|endoftext|>")
    for name in ("jsonl", "jsonl_gz", "jsonl_zst", "arrow_saved"):
        path = os.path.join(out, f"{name}.bin")
        if os.path.exists(path) and not np.array_equal(
                np.fromfile(path, dtype=np.uint16)[512:], ours):
            raise SystemExit(f"the {name} build differs from the Parquet build")
    # The shards: their tokens are the Parquet build's with <|endoftext|> moved to the front
    # of each document, and llm.c's fineweb.py wrote the same files.
    ours_shards = sorted(glob.glob(os.path.join(ours_dir, "fineweb_*.bin")),
                         key=lambda p: int(p[-10:-4]))
    sharded = np.concatenate([np.fromfile(p, dtype=np.uint16)[512:] for p in ours_shards])
    if not np.array_equal(sharded, np.concatenate([[EOT], ours[:-1]]).astype(np.uint16)):
        raise SystemExit("the sharded build is not the Parquet build with each document's "
                         "<|endoftext|> first")
    if llmc:
        names = sorted(os.listdir(theirs_dir))
        if names != sorted(os.path.basename(p) for p in ours_shards):
            raise SystemExit(f"llm.c wrote other shards: {names}")
        for name in names:
            with open(os.path.join(theirs_dir, name), "rb") as a, \
                    open(os.path.join(ours_dir, name), "rb") as b:
                if a.read() != b.read():
                    raise SystemExit(f"{name} differs from llm.c's")
        print(f"{len(names)} shards byte-identical to llm.c's fineweb.py", file=sys.stderr)
    print(f"token streams equal: {len(ours)} tokens", file=sys.stderr)
    print("| run | median wall | MB/s of text | peak RSS | vs headroom Parquet |")
    print("|---|---:|---:|---:|---:|")
    base = sorted(s for s, _ in times["headroom_parquet"])[runs // 2]
    for name, measured in times.items():
        median = sorted(s for s, _ in measured)[runs // 2]
        rss = max(m for _, m in measured)
        print(json.dumps({"bench": f"trainer/parquet_tokenize/{name}/{docs}", "metric": "seconds",
                          "value": median, "unit": "s", "better": "lower",
                          "runs": [s for s, _ in measured], "peak_rss_mib": rss}),
              file=sys.stderr)
        print(f"| {name} | {median:.2f} s | {text_bytes / 1e6 / median:.1f} | {rss:.0f} MiB | "
              f"{median / base:.2f}× |")


if __name__ == "__main__":
    main()
