"""Write the tokenizer fixtures that crates/trainer/tests/tokenize.rs reads.

1. Hugging Face's `tokenizers` trains a small byte-level BPE (GPT-2's pre-tokenizer and
   decoder, vocabulary 400 with `<|endoftext|>`) on a fixed text, saves it as
   `tokenizer.json`, and writes `expected.json`: the ids it gives for a few test strings (and
   their decoding).
2. GPT-2's own BPE: `gpt2-ids.json`, the ids of the committed `gpt2-text.txt` by two Python
   implementations that must agree — `tiktoken` with the r50k_base ranks, and transformers'
   `GPT2Tokenizer` on OpenAI's original `encoder.json` and `vocab.bpe`. No download: both
   read the copies the `tiktoken-rs` crate ships (found in cargo's registry, or `--assets DIR`).

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

    python benches/torch/make_tokenizer_fixture.py --write
"""

import glob
import json
import os
import shutil
import sys
import tempfile

OUT = os.path.join("crates", "trainer", "tests", "fixtures", "tokenizer")

TRAIN = [
    "Once upon a time there was a little robot who liked to count tokens.",
    "The robot counted every word, every space and every newline.\n\nThen it slept.",
    "Memory is finite; gradients are not free. Checkpoint, offload, quantise!",
    "Unicode too: naïve café, 東京, emoji 🙂 and numbers 12345 67890.",
] * 20

TESTS = [
    "Once upon a time the robot counted memory.",
    "Two lines\n\nand a gap",
    "naïve 東京 🙂 99 bottles",
    "",
    "unseen words: zyxwv qqq",
]


def main():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TRAIN, trainer)
    os.makedirs(OUT, exist_ok=True)
    tok.save(os.path.join(OUT, "tokenizer.json"))
    cases = []
    for text in TESTS:
        ids = tok.encode(text).ids
        cases.append({"text": text, "ids": ids, "decoded": tok.decode(ids)})
    with open(os.path.join(OUT, "expected.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizers": tokenizers.__version__, "vocab": tok.get_vocab_size(),
                   "eot": tok.token_to_id("<|endoftext|>"), "cases": cases},
                  f, ensure_ascii=False, indent=1)
    print(f"{OUT}: vocab {tok.get_vocab_size()}", file=sys.stderr)
    write_gpt2_ids()
    write_story_tokenizer()


# The words of the toy grammar the fine-tuning test (crates/trainer/tests/finetune.rs) writes
# its text with: determiner adjective noun verb preposition determiner adjective noun.
STORY_WORDS = ["the", "a", "big", "small", "red", "old", "cat", "dog", "bird", "fox", "sat",
               "ran", "slept", "jumped", "on", "under", "near", "mat", "log", "tree", "box"]


def write_story_tokenizer():
    """A SentencePiece-style BPE (Metaspace, as Llama's tokenizers) of at most 90 ids, small
    enough for the 97-id Llama fixture: fine-tuning and sampling print real words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import random

    rng = random.Random(5)
    det, adj, noun = STORY_WORDS[:2], STORY_WORDS[2:6], STORY_WORDS[6:10] + STORY_WORDS[17:]
    verb, prep = STORY_WORDS[10:14], STORY_WORDS[14:17]
    lines = [" ".join([rng.choice(det), rng.choice(adj), rng.choice(noun), rng.choice(verb),
                       rng.choice(prep), rng.choice(det), rng.choice(adj), rng.choice(noun)]) + "."
             for _ in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=90, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(lines, trainer)
    out = os.path.join(OUT, "story")
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    text = "the big cat sat on a red mat."
    assert tok.decode(tok.encode(text).ids) == text
    print(f"{out}: vocab {tok.get_vocab_size()}", file=sys.stderr)


# tiktoken's r50k_base split pattern (GPT-2's).
R50K_PATTERN = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def tiktoken_rs_assets():
    if "--assets" in sys.argv:
        return sys.argv[sys.argv.index("--assets") + 1]
    found = sorted(glob.glob(os.path.expanduser(
        "~/.cargo/registry/src/*/tiktoken-rs-*/assets/r50k_base.tiktoken")))
    if not found:
        sys.exit("tiktoken-rs's assets not found in cargo's registry: build the workspace "
                 "once, or pass --assets DIR")
    return os.path.dirname(found[-1])


def write_gpt2_ids():
    import tiktoken
    import transformers
    from tiktoken.load import load_tiktoken_bpe
    from transformers import GPT2Tokenizer

    assets = tiktoken_rs_assets()
    enc = tiktoken.Encoding(
        name="r50k_base",
        pat_str=R50K_PATTERN,
        mergeable_ranks=load_tiktoken_bpe(os.path.join(assets, "r50k_base.tiktoken")),
        special_tokens={"<|endoftext|>": 50256},
    )
    # OpenAI's encoder.json and vocab.bpe are the hub's vocab.json and merges.txt.
    tmp = tempfile.mkdtemp()
    shutil.copy(os.path.join(assets, "encoder.json"), os.path.join(tmp, "vocab.json"))
    shutil.copy(os.path.join(assets, "vocab.bpe"), os.path.join(tmp, "merges.txt"))
    hf = GPT2Tokenizer.from_pretrained(tmp)
    with open(os.path.join(OUT, "gpt2-text.txt"), encoding="utf-8") as f:
        text = f.read()
    ids = enc.encode_ordinary(text)
    ids_hf = hf.encode(text, add_special_tokens=False, split_special_tokens=True)
    if ids != ids_hf:
        first = next(i for i, (a, b) in enumerate(zip(ids, ids_hf)) if a != b)
        sys.exit(f"tiktoken and transformers disagree at token {first}")
    assert enc.decode(ids) == text
    with open(os.path.join(OUT, "gpt2-ids.json"), "w", encoding="utf-8") as f:
        json.dump({"tiktoken": tiktoken.__version__, "transformers": transformers.__version__,
                   "text": "gpt2-text.txt", "ids": ids}, f)
    print(f"{OUT}/gpt2-ids.json: {len(ids)} ids of {len(text)} characters", file=sys.stderr)


if __name__ == "__main__":
    if "--write" not in sys.argv[1:]:
        print("writes fixtures only with --write (not a comparison bench)", file=sys.stderr)
        sys.exit(3)
    main()
