"""Write the conversational fine-tuning fixture that crates/trainer/tests/sft_trl.rs reads.

TRL's own `SFTTrainer` prepares conversational examples (its prepared train dataset's
`input_ids` and `labels`, -100 where a token does not count; no truncation, no packing):

- prompt-completion, `{"prompt": [messages], "completion": [messages]}`: the prompt rendered
  with the generation prompt, the whole conversation rendered, the completion starting where
  the two tokenisations diverge (`completion_only_loss`, TRL's default);
- language modelling, `{"messages": [...]}`: every token counts.

The tokenizer is make_sft_fixture.py's Llama-style one (`<s> $A`, end of text `</s>`) with three
turn tokens added, and a chat template (in `tokenizer_config.json`, as transformers reads it)
that uses what real templates use: the special-token variables, a default system message,
slicing, `.strip()`, `loop.last`, whitespace control, `raise_exception` and the generation
prompt. Both files go to `fixtures/sft/chat/`; the fixture also holds transformers' rendered
text of every conversation (`apply_chat_template(tokenize=False)`).

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

    python benches/torch/make_chat_sft_fixture.py --write    # needs trl, transformers, tokenizers
    python benches/torch/make_chat_sft_fixture.py --check    # the committed fixture is TRL's
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_sft_fixture import FIXTURES, trl_columns  # noqa: E402

OUT = os.path.join(FIXTURES, "sft", "chat")

TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set turns = messages[1:] %}"
    "{%- else %}"
    "{%- set system = 'You are a careful assistant.' %}{%- set turns = messages %}"
    "{%- endif %}"
    "{{- '<|system|>\\n' + system.strip() + eos_token + '\\n' }}"
    "{%- for message in turns %}"
    "{%- if message['role'] not in ['user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{%- if not (loop.last and message['role'] == 'assistant' and message['content'] == '') %}"
    "{{- eos_token + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

PROMPT_COMPLETION = [
    {
        "prompt": [{"role": "user", "content": "Where did the small dog go?"}],
        "completion": [{"role": "assistant", "content": "It ran to the park."}],
    },
    {
        "prompt": [
            {"role": "system", "content": "  Answer in one line.  "},
            {"role": "user", "content": "Count to three."},
            {"role": "assistant", "content": "One, two, three."},
            {"role": "user", "content": "Now backwards."},
        ],
        "completion": [{"role": "assistant", "content": "Three, two, one."}],
    },
    {
        "prompt": [{"role": "user", "content": "naïve café 東京 🙂"}],
        "completion": [{"role": "assistant", "content": "Bonjour\n\nand a gap"}],
    },
    # Special-token text inside a message is mapped to its id, as transformers does.
    {
        "prompt": [{"role": "user", "content": "Say <|user|> once."}],
        "completion": [{"role": "assistant", "content": "<|user|>"}],
    },
    # An empty completion.
    {
        "prompt": [{"role": "user", "content": "Nothing to add?"}],
        "completion": [{"role": "assistant", "content": ""}],
    },
]
MESSAGES = [
    {
        "messages": [
            {"role": "user", "content": "What is memory?"},
            {"role": "assistant", "content": "Finite."},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
        ]
    },
]


def chat_tokenizer(tmp):
    """The Llama-style tokenizer with turn tokens, and its directory with the template."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tok = Tokenizer.from_file(os.path.join(FIXTURES, "tokenizer", "story", "tokenizer.json"))
    tok.add_special_tokens(["<s>", "<|system|>", "<|user|>", "<|assistant|>"])
    tok.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    directory = os.path.join(tmp, "chat")
    os.makedirs(directory)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": TEMPLATE,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
        f.write("\n")
    return directory, AutoTokenizer.from_pretrained(directory)


def make():
    import tokenizers
    import transformers
    import trl

    with tempfile.TemporaryDirectory() as tmp:
        directory, tok = chat_tokenizer(tmp)
        rendered = {
            "prompt_completion": [
                {
                    "prompt": tok.apply_chat_template(
                        ex["prompt"], tokenize=False, add_generation_prompt=True
                    ),
                    "whole": tok.apply_chat_template(
                        ex["prompt"] + ex["completion"], tokenize=False
                    ),
                }
                for ex in PROMPT_COMPLETION
            ],
            "messages": [
                tok.apply_chat_template(ex["messages"], tokenize=False) for ex in MESSAGES
            ],
        }
        fixture = {
            "about": "TRL's SFTTrainer on conversational examples (make_chat_sft_fixture.py)",
            "versions": {
                "trl": trl.__version__,
                "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
            },
            "prompt_completion": PROMPT_COMPLETION,
            "messages": MESSAGES,
            "rendered": rendered,
            "trl": {
                "prompt_completion": trl_columns(tok, PROMPT_COMPLETION, tmp),
                "messages": trl_columns(tok, MESSAGES, tmp),
            },
        }
        files = {}
        for name in ("tokenizer.json", "tokenizer_config.json"):
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                files[name] = f.read()
    return fixture, files


def main():
    if "--quick" in sys.argv:
        sys.exit(3)
    fixture, files = make()
    fixture_path = os.path.join(OUT, "trl_chat_sft.json")
    if "--write" in sys.argv:
        os.makedirs(OUT, exist_ok=True)
        with open(fixture_path, "w", encoding="utf-8") as f:
            json.dump(fixture, f, ensure_ascii=False, indent=1)
            f.write("\n")
        for name, text in files.items():
            with open(os.path.join(OUT, name), "w", encoding="utf-8") as f:
                f.write(text)
        print(f"wrote {fixture_path} and the tokenizer beside it")
    elif "--check" in sys.argv:
        with open(fixture_path, encoding="utf-8") as f:
            committed = json.load(f)
        same = committed["trl"] == fixture["trl"] and committed["rendered"] == fixture["rendered"]
        print("the committed fixture is TRL's" if same else "the committed fixture differs from TRL's")
        sys.exit(0 if same else 1)
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main()
