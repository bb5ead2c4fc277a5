"""Write the tokenizer fixture that crates/trainer/tests/tokenize.rs reads.

Hugging Face's `tokenizers` trains a small byte-level BPE (GPT-2's pre-tokenizer and decoder,
vocabulary 400 with `<|endoftext|>`) on a fixed text, saves it as `tokenizer.json`, and writes
`expected.json`: the ids it gives for a few test strings (and their decoding). No download.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

    python benches/torch/make_tokenizer_fixture.py --write
"""

import json
import os
import sys

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


if __name__ == "__main__":
    if "--write" not in sys.argv[1:]:
        print("writes fixtures only with --write (not a comparison bench)", file=sys.stderr)
        sys.exit(3)
    main()
