"""Write the fixture that crates/trainer/tests/finetune.rs reads for `train --eos-token` and
`train --chat-template`: what TRL's `SFTTrainer` saves with a model when `SFTConfig` sets
`eos_token` and `chat_template_path`.

TRL does more than tokenise with them. At construction it sets the tokenizer's `eos_token`,
the model config's `eos_token_id`, and puts the new id in front of the generation config's eos
ids; a Jinja `chat_template_path` becomes the tokenizer's chat template. `save_model` then
writes all of it beside the weights, so the fine-tuned model stops where it learnt to stop.
headroom's checkpoints must carry the same files.

Each case builds a base directory from committed files: the Llama fixture
(`fixtures/hf-llama-gqa-untied`, whose `config.json` says bos 1, eos 2) and the story
tokenizer (`fixtures/tokenizer/story`, whose `</s>` is id 1), with the tokenizer files named
in `CASES`. It constructs an `SFTTrainer` (no step is needed: TRL changes the tokenizer and
configs at construction) and calls `save_model`. The fixture records, for each case, the
tokenizer and generation files the saved directory holds, the token ids of its `config.json`
and `generation_config.json`, the special tokens of its `tokenizer_config.json` (and whether
a chat template is left in it), and the text of its `chat_template.jinja`.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

    python benches/torch/make_trl_saved_tokenizer_fixture.py --write   # needs trl, transformers
    python benches/torch/make_trl_saved_tokenizer_fixture.py --check   # the committed fixture is TRL's
"""

import json
import os
import shutil
import sys
import tempfile

FIXTURES = os.path.join("crates", "trainer", "tests", "fixtures")
OUT = os.path.join(FIXTURES, "sft", "trl_saved_tokenizer.json")
TRAINING_TEMPLATE = os.path.join(FIXTURES, "sft", "training_template.jinja")

BASE_TEMPLATE = (
    "{% for m in messages %}{{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}the{% endif %}"
)
TOOL_TEMPLATE = "{{ tools | length }} {% for m in messages %}{{ m.content }}{% endfor %}"
# A training template with generation blocks (what `chat_template_path` is for), ending
# each turn with the eos token.
TRAINING = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}{{ m.content }} "
    "{% endif %}{% endfor %}{% if add_generation_prompt %}the{% endif %}"
)

# name → (files of the base beside config.json and model.safetensors, SFTConfig settings).
# File contents: a string, or None for the committed file of that name.
CASES = {
    # An added token that already is the tokenizer's eos: only the model's ids change.
    "added_eos": (
        {
            "generation_config.json": None,
            "tokenizer_config.json": '{"tokenizer_class": "PreTrainedTokenizerFast", '
            '"eos_token": "</s>", "unk_token": "<unk>"}',
        },
        {"eos_token": "</s>"},
    ),
    # A plain word as eos, with a training template replacing the base's two templates.
    "plain_eos_and_template": (
        {
            "generation_config.json": None,
            "tokenizer_config.json": '{"tokenizer_class": "PreTrainedTokenizerFast", '
            '"eos_token": "</s>", "unk_token": "<unk>"}',
            "chat_template.jinja": BASE_TEMPLATE,
            "additional_chat_templates/tool_use.jinja": TOOL_TEMPLATE,
        },
        {"eos_token": "▁near", "chat_template_path": TRAINING_TEMPLATE},
    ),
    # No generation config in the base: the one transformers makes from config.json gains it.
    "no_generation_config": (
        {
            "tokenizer_config.json": '{"tokenizer_class": "PreTrainedTokenizerFast", '
            '"eos_token": "</s>", "unk_token": "<unk>", "chat_template": "'
            + BASE_TEMPLATE.replace('"', '\\"')
            + '"}',
        },
        {"eos_token": "▁near"},
    ),
}

COMPANIONS = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
]
TOKEN_KEYS = ["bos_token_id", "eos_token_id", "pad_token_id"]


def base_dir(root, files):
    base = os.path.join(root, "base")
    os.makedirs(base)
    llama = os.path.join(FIXTURES, "hf-llama-gqa-untied")
    for name in ["config.json", "model.safetensors"]:
        shutil.copy(os.path.join(llama, name), base)
    shutil.copy(os.path.join(FIXTURES, "tokenizer", "story", "tokenizer.json"), base)
    for name, text in files.items():
        path = os.path.join(base, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if text is None:
            shutil.copy(os.path.join(llama, name), path)
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    return base


def saved_by_trl(files, settings):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    with tempfile.TemporaryDirectory() as root:
        base = base_dir(root, files)
        model = AutoModelForCausalLM.from_pretrained(base)
        tokenizer = AutoTokenizer.from_pretrained(base)
        out = os.path.join(root, "out")
        args = SFTConfig(
            output_dir=out, report_to=[], max_steps=1, use_cpu=True, bf16=False, **settings
        )
        data = Dataset.from_list([{"text": "the small cat sat on the mat."}])
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=data, processing_class=tokenizer
        )
        trainer.save_model(out)
        saved = sorted(
            name
            for name in COMPANIONS
            if os.path.isfile(os.path.join(out, name))
        )
        named = os.path.join(out, "additional_chat_templates")
        if os.path.isdir(named):
            saved += sorted("additional_chat_templates/" + n for n in os.listdir(named))

        def read_json(name):
            with open(os.path.join(out, name), encoding="utf-8") as f:
                return json.load(f)

        config = read_json("config.json")
        generation = read_json("generation_config.json")
        tok_config = read_json("tokenizer_config.json")
        template = None
        if os.path.isfile(os.path.join(out, "chat_template.jinja")):
            with open(os.path.join(out, "chat_template.jinja"), encoding="utf-8") as f:
                template = f.read()
        return {
            "files": saved,
            "config": {k: config.get(k) for k in TOKEN_KEYS if k in config},
            "generation_config": {k: generation.get(k) for k in TOKEN_KEYS if k in generation},
            "tokenizer_config": {
                "eos_token": tok_config.get("eos_token"),
                "unk_token": tok_config.get("unk_token"),
                "has_chat_template": "chat_template" in tok_config,
            },
            "chat_template_jinja": template,
        }


def make():
    import transformers
    import trl

    cases = {}
    for name, (files, settings) in CASES.items():
        cases[name] = {
            "base_files": files,
            "settings": {
                k: (os.path.basename(v) if k == "chat_template_path" else v)
                for k, v in settings.items()
            },
            "saved": saved_by_trl(files, settings),
        }
    return {
        "written_by": f"trl {trl.__version__}, transformers {transformers.__version__}",
        "base_template": BASE_TEMPLATE,
        "tool_template": TOOL_TEMPLATE,
        "cases": cases,
    }


def main():
    if "--quick" in sys.argv:
        sys.exit(3)
    if "--write" in sys.argv:
        with open(TRAINING_TEMPLATE, "w", encoding="utf-8") as f:
            f.write(TRAINING)
        fixture = make()
        with open(OUT, "w", encoding="utf-8") as f:
            json.dump(fixture, f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(f"wrote {OUT} and {TRAINING_TEMPLATE}")
    elif "--check" in sys.argv:
        fixture = make()
        with open(OUT, encoding="utf-8") as f:
            committed = json.load(f)
        same = committed["cases"] == fixture["cases"]
        print("the committed fixture is TRL's" if same else "the committed fixture differs from TRL's")
        sys.exit(0 if same else 1)
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main()
