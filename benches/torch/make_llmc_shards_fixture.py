"""Writes the fixture that pins `headroom data build --shard-tokens` to llm.c's FineWeb shards.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

Usage, from the workspace root, with numpy, pyarrow, tiktoken and tqdm, and a checkout (or an
exported tree) of karpathy/llm.c:

    python3 benches/torch/make_llmc_shards_fixture.py --llmc PATH --write   # (re)write it
    python3 benches/torch/make_llmc_shards_fixture.py --llmc PATH --check   # compare only

`--commit SHA` records llm.c's commit when PATH is not a git checkout of it.

What it runs: llm.c's own `dev/data/fineweb.py` and `data_common.py`, unchanged, copied from
PATH into a temporary directory (nothing of llm.c is copied into this repository), with
`-t classic -v 10B -m gpt-2 -s 3000`. Three things of its environment are replaced, since this
machine reaches no Hugging Face Hub and no tiktoken download:

- `datasets.load_dataset` returns the rows of headroom's `fineweb_like` Parquet fixture (read
  with pyarrow) followed by the rows of its `.jsonl` twin: 60 FineWeb-shaped documents, as
  if they were the Hub's `sample-10BT` split. headroom's test passes the same two files, so
  the fixture also pins reading several inputs, of two kinds, as one stream;
- `tiktoken.get_encoding("gpt2")` is built from tiktoken-rs's `r50k_base.tiktoken` with
  tiktoken's r50k pattern (r50k_base and gpt2 are the same encoding);
- `transformers` is a stub: only `-m llama-3` would use it.

Output: `crates/trainer/tests/fixtures/llmc_fineweb/`: the shards fineweb.py wrote
(`fineweb_val_000000.bin`, `fineweb_train_000001.bin`, …; 3000 tokens each, the last
shorter) and `MANIFEST.json` (llm.c's commit, the arguments, each shard's tokens and
sha256). `crates/trainer/tests/tokenize.rs` builds the same inputs with
`--shard-tokens 3000 --val-shards 1 --document-token start` and compares the files byte for
byte. `--check` runs fineweb.py again and compares its shards with the committed ones.
"""
import glob
import hashlib
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "crates", "parquet", "tests", "fixtures")
OUT = os.path.join(ROOT, "crates", "trainer", "tests", "fixtures", "llmc_fineweb")
SHARD_SIZE = 3000
ARGS = ["-t", "classic", "-v", "10B", "-m", "gpt-2", "-s", str(SHARD_SIZE)]
R50K_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def rows():
    import pyarrow.parquet as pq

    parquet = pq.read_table(os.path.join(FIXTURES, "fineweb_like.parquet")).to_pylist()
    with open(os.path.join(FIXTURES, "fineweb_like.jsonl"), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return parquet + lines


def install_environment(documents):
    """Stand in for the Hub and tiktoken's download: `load_dataset` returns `documents` (any
    iterable of rows), `tiktoken.get_encoding("gpt2")` the r50k ranks."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = sorted(glob.glob(os.path.expanduser(
        "~/.cargo/registry/src/*/tiktoken-rs-*/assets/r50k_base.tiktoken")))
    if not ranks:
        print("tiktoken-rs's r50k_base.tiktoken is not in ~/.cargo (build headroom first)",
              file=sys.stderr)
        sys.exit(3)
    encoding = tiktoken.Encoding(
        name="gpt2",
        pat_str=R50K_PATTERN,
        mergeable_ranks=load_tiktoken_bpe(ranks[-1]),
        special_tokens={"<|endoftext|>": 50256},
    )
    real_get_encoding = tiktoken.get_encoding
    tiktoken.get_encoding = lambda name: encoding if name == "gpt2" else real_get_encoding(name)

    datasets = types.ModuleType("datasets")

    def load_dataset(path, name=None, split=None):
        assert (path, name, split) == ("HuggingFaceFW/fineweb", "sample-10BT", "train"), \
            (path, name, split)
        return documents

    datasets.load_dataset = load_dataset
    sys.modules["datasets"] = datasets
    transformers = types.ModuleType("transformers")

    class AutoTokenizer:
        @staticmethod
        def from_pretrained(*_):
            raise RuntimeError("only -m gpt-2 is run here")

    transformers.AutoTokenizer = AutoTokenizer
    sys.modules["transformers"] = transformers


def run_fineweb(llmc, work, args=ARGS):
    """llm.c's fineweb.py with `args`, copied into `work`; the shards it wrote, by name."""
    for name in ("fineweb.py", "data_common.py"):
        shutil.copy(os.path.join(llmc, "dev", "data", name), work)
    sys.path.insert(0, work)
    sys.argv = ["fineweb.py"] + args
    # fineweb.py's pool forks: the children inherit the stubs and the run's __main__.
    runpy.run_path(os.path.join(work, "fineweb.py"), run_name="__main__")
    return sorted(glob.glob(os.path.join(work, "fineweb10B", "*.bin")))


def llmc_commit(llmc, args):
    if "--commit" in args:
        return args[args.index("--commit") + 1]
    git = subprocess.run(
        ["git", "-C", llmc, "rev-parse", "--verify", "HEAD"], capture_output=True, text=True
    )
    return git.stdout.strip() if git.returncode == 0 else "unknown"


def main():
    if "--quick" in sys.argv or not ({"--write", "--check"} & set(sys.argv)):
        print("writes a fixture: run with --llmc PATH --write or --check", file=sys.stderr)
        sys.exit(3)
    args = sys.argv[1:]
    if "--llmc" not in args:
        print("--llmc PATH: a checkout of karpathy/llm.c", file=sys.stderr)
        sys.exit(2)
    llmc = args[args.index("--llmc") + 1]
    documents = rows()
    install_environment(documents)
    with tempfile.TemporaryDirectory() as work:
        shards = run_fineweb(llmc, work)
        written = {os.path.basename(p): open(p, "rb").read() for p in shards}
    if not written:
        raise SystemExit("fineweb.py wrote no shards")
    manifest = {
        "llmc_commit": llmc_commit(llmc, args),
        "script": "dev/data/fineweb.py",
        "arguments": ARGS,
        "inputs": ["crates/parquet/tests/fixtures/fineweb_like.parquet",
                   "crates/parquet/tests/fixtures/fineweb_like.jsonl"],
        "documents": len(documents),
        "shards": [
            {"file": name, "tokens": int.from_bytes(data[8:12], "little"),
             "sha256": hashlib.sha256(data).hexdigest()}
            # In the order fineweb.py wrote them (by index: "train" sorts before "val").
            for name, data in sorted(written.items(), key=lambda kv: int(kv[0][-10:-4]))
        ],
    }
    if "--check" in args:
        committed = sorted(f for f in os.listdir(OUT) if f.endswith(".bin"))
        if committed != sorted(written):
            raise SystemExit(f"shards differ: committed {committed}, fineweb.py {sorted(written)}")
        for name, data in written.items():
            with open(os.path.join(OUT, name), "rb") as f:
                if f.read() != data:
                    raise SystemExit(f"{name} differs from fineweb.py's")
        print(f"{len(written)} shards equal fineweb.py's")
        return
    os.makedirs(OUT, exist_ok=True)
    for old in glob.glob(os.path.join(OUT, "*.bin")):
        os.remove(old)
    for name, data in written.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    with open(os.path.join(OUT, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print(f"wrote {len(written)} shards to {OUT}")


if __name__ == "__main__":
    main()
