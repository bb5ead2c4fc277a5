"""Write the supervised fine-tuning fixture that crates/trainer/tests/sft_trl.rs reads.

TRL's own `SFTTrainer` prepares prompt-completion examples and plain-text examples (the
`input_ids` and `labels` columns of its prepared train dataset, -100 where a token does not
count; no truncation, no packing) with two tokenizers that the `tokenizers` library builds here from the committed
fixtures:

- `bpe`: the byte-level BPE of `fixtures/tokenizer/tokenizer.json` (end of text
  `<|endoftext|>`, no special tokens added around a sequence, as GPT-2's);
- `llama`: the Metaspace BPE of `fixtures/tokenizer/story/tokenizer.json` with a `<s>` token
  and a `TemplateProcessing` post-processor `<s> $A` (a Llama tokenizer's start of sequence),
  end of text `</s>`; saved as `fixtures/sft/llama-tokenizer.json`;
- `eos_config`: that tokenizer with `<|im_end|>` added and a `tokenizer_config.json` naming it
  `eos_token` (an instruct model's end of turn, beside the vocabulary's `</s>`), loaded with
  `AutoTokenizer`; saved in `fixtures/sft/eos-config/`.

And with `dataset_text_field="content"`, text examples under another key.

The Rust test feeds the same examples as JSONL to `headroom data build --jsonl`'s builder and
requires TRL's ids and masks, example after example (headroom packs them back to back).

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

    python benches/torch/make_sft_fixture.py --write    # needs trl, transformers, tokenizers
    python benches/torch/make_sft_fixture.py --check    # the committed fixture is what TRL gives
"""

import json
import os
import sys
import tempfile

FIXTURES = os.path.join("crates", "trainer", "tests", "fixtures")
OUT = os.path.join(FIXTURES, "sft")

PROMPT_COMPLETION = [
    {"prompt": "the small dog", "completion": " sees a red ball"},
    {"prompt": "Once upon a time", "completion": " the robot counted memory."},
    # Tokens that merge across the boundary: TRL starts the completion where the prompt's
    # and the whole example's ids diverge.
    {"prompt": "Hello wor", "completion": "ld and more"},
    {"prompt": "", "completion": "an empty prompt"},
    {"prompt": "no completion", "completion": ""},
    {"prompt": "naïve café ", "completion": "東京 🙂 99"},
    {"prompt": "Two lines\n\n", "completion": "and a gap\n"},
]
TEXT = [
    {"text": "plain text counts whole"},
    {"text": "Memory is finite; gradients are not free."},
]
# Language modelling from another key (TRL's `dataset_text_field`): the `text` beside it is an
# ignored column.
CONTENT = [
    {"content": "def step(): return 1", "text": "not this"},
    {"content": "Memory is finite.", "id": 7},
]


def tokenizers_under_test(tmp):
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    bpe_file = os.path.join(FIXTURES, "tokenizer", "tokenizer.json")
    llama = Tokenizer.from_file(os.path.join(FIXTURES, "tokenizer", "story", "tokenizer.json"))
    llama.add_special_tokens(["<s>"])
    llama.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", llama.token_to_id("<s>"))]
    )
    llama_file = os.path.join(tmp, "llama-tokenizer.json")
    llama.save(llama_file)
    # An instruct model's kind: its tokenizer_config.json names an end of turn as eos_token,
    # while the vocabulary also has the document separator `</s>`; TRL ends examples with the
    # configured one.
    from transformers import AutoTokenizer

    eos_dir = os.path.join(tmp, "eos-config")
    os.makedirs(eos_dir)
    llama.add_special_tokens(["<|im_end|>"])
    llama.save(os.path.join(eos_dir, "tokenizer.json"))
    with open(os.path.join(eos_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "eos_token": "<|im_end|>", "unk_token": "<unk>"}, f, indent=1)
        f.write("\n")
    return {
        "bpe": (
            bpe_file,
            PreTrainedTokenizerFast(tokenizer_file=bpe_file, eos_token="<|endoftext|>"),
        ),
        "llama": (
            llama_file,
            PreTrainedTokenizerFast(
                tokenizer_file=llama_file, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
            ),
        ),
        "eos_config": (eos_dir, AutoTokenizer.from_pretrained(eos_dir)),
    }


def trl_columns(tokenizer, examples, tmp, **config):
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
        )
    )
    config = {"max_length": None, **config}
    args = SFTConfig(
        output_dir=os.path.join(tmp, "out"),
        packing=False,
        report_to="none",
        use_cpu=True,
        **config,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(examples),
        processing_class=tokenizer,
    )
    # TRL folds the completion mask into `labels`: -100 where a token does not count.
    return [
        {"input_ids": list(row["input_ids"]), "labels": list(row["labels"])}
        for row in trainer.train_dataset
    ]


def make():
    import tokenizers
    import transformers
    import trl

    with tempfile.TemporaryDirectory() as tmp:
        fixture = {
            "about": "TRL's SFTTrainer tokenisation of these examples (make_sft_fixture.py)",
            "versions": {
                "trl": trl.__version__,
                "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
            },
            "prompt_completion": PROMPT_COMPLETION,
            "text": TEXT,
            "content": CONTENT,
            "tokenizers": {},
        }
        files = {}
        for name, (path, tok) in tokenizers_under_test(tmp).items():
            if os.path.isdir(path):
                for file in ("tokenizer.json", "tokenizer_config.json"):
                    with open(os.path.join(path, file), encoding="utf-8") as f:
                        files[os.path.join("eos-config", file)] = f.read()
            else:
                with open(path, encoding="utf-8") as f:
                    files[name] = f.read()
            fixture["tokenizers"][name] = {
                "eos": tok.eos_token,
                "prompt_completion": trl_columns(tok, PROMPT_COMPLETION, tmp),
                "text": trl_columns(tok, TEXT, tmp),
                "content": trl_columns(tok, CONTENT, tmp, dataset_text_field="content"),
            }
            if name == "eos_config":
                # TRL's eos_token setting in place of the configured one (a fresh tokenizer:
                # TRL sets it on the one it is given).
                from transformers import AutoTokenizer

                fixture["tokenizers"][name]["text_eos_token"] = trl_columns(
                    AutoTokenizer.from_pretrained(path), TEXT, tmp, eos_token="</s>"
                )
    return fixture, files


def main():
    if "--quick" in sys.argv:
        sys.exit(3)
    fixture, files = make()
    fixture_path = os.path.join(OUT, "trl_sft.json")
    tokenizer_path = os.path.join(OUT, "llama-tokenizer.json")
    if "--write" in sys.argv:
        os.makedirs(OUT, exist_ok=True)
        with open(fixture_path, "w", encoding="utf-8") as f:
            json.dump(fixture, f, ensure_ascii=False, indent=1)
            f.write("\n")
        with open(tokenizer_path, "w", encoding="utf-8") as f:
            f.write(files["llama"])
        for name in ("tokenizer.json", "tokenizer_config.json"):
            path = os.path.join(OUT, "eos-config", name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(files[os.path.join("eos-config", name)])
        print(f"wrote {fixture_path} and {tokenizer_path}")
    elif "--check" in sys.argv:
        with open(fixture_path, encoding="utf-8") as f:
            committed = json.load(f)
        same = committed["tokenizers"] == fixture["tokenizers"]
        print("the committed fixture is TRL's" if same else "the committed fixture differs from TRL's")
        sys.exit(0 if same else 1)
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main()
