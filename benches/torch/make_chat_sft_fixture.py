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
import time

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


# Templates in the style of widely used models' (written for this fixture, using the constructs
# theirs use): Llama 3.1's system turn with strftime_now's date and `| trim`, Qwen 2.5's
# `loop.first` and attribute access, Mistral's namespace, alternation check and
# raise_exception, Gemma's role renaming, `is string` and `-%}` trimming, and one of filters and
# Python methods. transformers renders each conversation with each, with and without the
# generation prompt, its clock frozen at FROZEN_TIME.
STYLE_TEMPLATES = {
    "llama3": (
        "{{- bos_token }}\n"
        "{%- if not date_string is defined %}\n"
        "    {%- if strftime_now is defined %}\n"
        "        {%- set date_string = strftime_now(\"%d %b %Y\") %}\n"
        "    {%- else %}\n"
        "        {%- set date_string = \"26 Jul 2024\" %}\n"
        "    {%- endif %}\n"
        "{%- endif %}\n"
        "{%- if messages[0]['role'] == 'system' %}\n"
        "    {%- set system_message = messages[0]['content']|trim %}\n"
        "    {%- set messages = messages[1:] %}\n"
        "{%- else %}\n"
        "    {%- set system_message = \"\" %}\n"
        "{%- endif %}\n"
        "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
        "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
        "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
        "{{- system_message }}\n"
        "{{- \"<|eot_id|>\" }}\n"
        "{%- for message in messages %}\n"
        "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
        " + message['content'] | trim + '<|eot_id|>' }}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}\n"
        "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
        "{%- endif %}\n"
    ),
    "qwen2": (
        "{%- if messages[0]['role'] == 'system' %}\n"
        "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
        "{%- else %}\n"
        "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
        "{%- endif %}\n"
        "{%- for message in messages %}\n"
        "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first)"
        " or (message.role == \"assistant\" and not message.tool_calls) %}\n"
        "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
        "    {%- endif %}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}\n"
        "    {{- '<|im_start|>assistant\\n' }}\n"
        "{%- endif %}\n"
    ),
    "mistral": (
        "{%- if messages[0]['role'] == 'system' %}\n"
        "    {%- set system_message = messages[0]['content'] %}\n"
        "    {%- set loop_messages = messages[1:] %}\n"
        "{%- else %}\n"
        "    {%- set loop_messages = messages %}\n"
        "{%- endif %}\n"
        "{{- bos_token }}\n"
        "{%- set ns = namespace(users=0) %}\n"
        "{%- for message in loop_messages %}\n"
        "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
        "        {{- raise_exception('Conversation roles must alternate user/assistant') }}\n"
        "    {%- endif %}\n"
        "    {%- if message['role'] == 'user' %}\n"
        "        {%- set ns.users = ns.users + 1 %}\n"
        "        {%- if loop.first and system_message is defined %}\n"
        "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
        "        {%- else %}\n"
        "            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
        "        {%- endif %}\n"
        "    {%- elif message['role'] == 'assistant' %}\n"
        "        {{- ' ' + message['content'] + eos_token }}\n"
        "    {%- endif %}\n"
        "{%- endfor %}\n"
        "{{- '' if ns.users else raise_exception('no user turn') }}\n"
    ),
    "gemma": (
        "{{ bos_token }}\n"
        "{%- if messages[0]['role'] == 'system' -%}\n"
        "    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
        "    {%- set loop_messages = messages[1:] -%}\n"
        "{%- else -%}\n"
        "    {%- set first_user_prefix = \"\" -%}\n"
        "    {%- set loop_messages = messages -%}\n"
        "{%- endif -%}\n"
        "{%- for message in loop_messages -%}\n"
        "    {%- if (message['role'] == 'assistant') -%}\n"
        "        {%- set role = \"model\" -%}\n"
        "    {%- else -%}\n"
        "        {%- set role = message['role'] -%}\n"
        "    {%- endif -%}\n"
        "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
        "    {%- if message['content'] is string -%}\n"
        "        {{ message['content'] | trim }}\n"
        "    {%- endif -%}\n"
        "    {{ '<end_of_turn>\\n' }}\n"
        "{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}\n"
        "    {{'<start_of_turn>model\\n'}}\n"
        "{%- endif -%}\n"
    ),
    "filters": (
        "{{ messages | map(attribute='role') | join(',') }}|"
        "{{ messages | selectattr('role', 'equalto', 'user') | list | length }}|"
        "{% for m in messages %}{{ loop.index }}/{{ loop.length }}:{{ loop.revindex0 }}"
        "{{ m.content.lower().replace('a', 'A').split(' ')[0] ~ '!' }}"
        "{{ '^' if m.content.startswith('Hi') else '' }}"
        "{{ m.content[:3] | upper }}{{ ' ' }}{% endfor %}"
        "{% for k, v in messages[0].items() %}{{ k }}={{ v | length }};{% endfor %}"
        "{{ (messages | last).role | capitalize }}{{ messages | length > 2 }}"
        "{% if add_generation_prompt %}{{ eos_token | default('none') }}{% endif %}"
    ),
}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "  A answer.  "}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Count to two, naïvely"},
        {"role": "assistant", "content": "One, two."},
        {"role": "user", "content": "again?"},
    ],
]
# 2026-11-30 09:05:07 UTC: the clock transformers' strftime_now reads while the fixture is made.
FROZEN_TIME = 1796029507
# time.strftime of these (format, seconds since the epoch, UTC) pins headroom's strftime.
STRFTIME_CASES = [
    ("%d %b %Y", FROZEN_TIME),
    ("%a %A %b %B %d %H %I %j %m %M %p %S %y %Y %%", 0),
    ("%a %A %b %B %d %H %I %j %m %M %p %S %y %Y", 951782400 + 13 * 3600),  # 2000-02-29
    ("%a %A %B %d %I %j %p %y", 4102444799),  # 2099-12-31 23:59:59
    ("%Y-%m-%d %H:%M:%S", 1709210096),  # 2024-02-29
]


def style_renders():
    """transformers' rendering of every conversation with every style template."""
    import datetime as real_datetime

    import transformers.utils.chat_template_utils as ctu
    from transformers import PreTrainedTokenizerFast

    class Frozen(real_datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return real_datetime.datetime.fromtimestamp(FROZEN_TIME, real_datetime.timezone.utc)

    ctu.datetime = Frozen
    tok = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(FIXTURES, "sft", "llama-tokenizer.json"),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    out = {}
    for name, template in STYLE_TEMPLATES.items():
        out[name] = [
            [
                tok.apply_chat_template(
                    conv, chat_template=template, tokenize=False, add_generation_prompt=g
                )
                for g in (False, True)
            ]
            for conv in CONVERSATIONS
        ]
    return out


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
            "styles": {
                "templates": STYLE_TEMPLATES,
                "special_tokens": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
                "conversations": CONVERSATIONS,
                "frozen_time": FROZEN_TIME,
                "rendered": style_renders(),
            },
            "strftime": [
                [fmt, t, time.strftime(fmt, time.gmtime(t))] for fmt, t in STRFTIME_CASES
            ],
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
        same = all(committed[k] == fixture[k] for k in ("trl", "rendered", "styles", "strftime"))
        print("the committed fixture is TRL's" if same else "the committed fixture differs from TRL's")
        sys.exit(0 if same else 1)
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main()
