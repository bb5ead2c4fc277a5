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

A second tokenizer directory, `fixtures/sft/chat-jinja/`, is the same tokenizer saved by
transformers 5 with two named templates: `chat_template.jinja` (the default, whose assistant
turns are `{% generation %}` blocks) and `additional_chat_templates/tool_use.jinja` (tools,
tool calls, `tojson`). With it the fixture holds:

- TRL's ids and labels with `assistant_only_loss=True` (language modelling and
  prompt-completion), with `completion_only_loss=False` (with and without it), with
  `max_length=16` (`keep_start`, `keep_end`: cut examples, and examples left with no counted
  token dropped), and for examples with `tools` and `chat_template_kwargs` columns;
- transformers' `return_assistant_tokens_mask` (ids and mask) of conversations under templates
  whose generation tags use every kind of whitespace control, and TRL's
  `is_chat_template_stop_token_trained` of each, also with `eos_token` set to a plain word;
- transformers' `tojson` of assorted values with each of its arguments.

And transformers' `continue_final_message` ("prefill") of conversations under the style
templates and one that writes reasoning and content blocks: the text, or that it refused.

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
# Final messages for transformers' `continue_final_message` (a "prefill" the model continues):
# the conversations above (one ends with the user's turn), an answer begun with trailing space
# (which the templates that trim it lose, so the cut falls before the space), an answer that
# is a list of content blocks, and reasoning continued under each of its names. With each
# style template, and with a template that writes reasoning and content blocks.
CONTINUE_TEMPLATES = {
    "think": (
        "{%- for m in messages %}<|{{ m.role }}|>"
        "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
        "{%- if m.content is string %}{{ m.content }}"
        "{%- else %}{% for b in m.content %}{% if b.type == 'text' %}{{ b.text }}{% endif %}"
        "{% endfor %}{% endif %}{{ eos_token }}\n"
        "{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    ),
}
PREFILLED = [
    {"role": "user", "content": "Reply in JSON"},
    {"role": "assistant", "content": "{\"answer\": "},
]
BLOCKS = [
    {"role": "user", "content": "Describe it"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "It shows "},
            {"type": "text", "text": " a cat"},
            {"type": "image"},
        ],
    },
]
THINKING = [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": ""}]
CONTINUE_CASES = (
    [
        (name, conversation, "content")
        for name in STYLE_TEMPLATES
        for conversation in CONVERSATIONS + [PREFILLED]
    ]
    + [
        ("think", PREFILLED, "content"),
        ("think", BLOCKS, "content"),
        ("think", [THINKING[0], {**THINKING[1], "reasoning_content": "Let me see "}], "reasoning_content"),
        ("think", [THINKING[0], {**THINKING[1], "reasoning": "Because"}], "reasoning"),
        ("think", [THINKING[0], {**THINKING[1], "thinking": "Hm"}], "thinking"),
        # Errors: a field the message lacks, a field the template never names.
        ("think", PREFILLED, "reasoning_content"),
        ("llama3", [THINKING[0], {**THINKING[1], "reasoning_content": "x"}], "reasoning_content"),
    ]
)
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


# Templates whose assistant turns are `{% generation %}` blocks, one per kind of whitespace
# control around the tags (lstrip_blocks and trim_blocks on tags alone on their lines, `-`,
# tags inside a line, `+`), and one that leaves the end of turn outside the block.
GENERATION_TEMPLATES = {
    "lines": (
        "{{- bos_token }}\n"
        "{%- for message in messages %}\n"
        "    {%- if message.role == 'assistant' %}\n"
        "{{ '<|assistant|>\\n' }}\n"
        "        {% generation %}\n"
        "{%- if message.reasoning_content is defined %}"
        "{{ '<think>' + message.reasoning_content + '</think>' }}{% endif %}\n"
        "{{ message.content }}{{ eos_token }}\n"
        "        {% endgeneration %}\n"
        "    {%- else %}\n"
        "{{ '<|' + message.role + '|>\\n' + message.content + eos_token + '\\n' }}\n"
        "    {%- endif %}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}\n"
    ),
    "dashes": (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'assistant' %}<|assistant|>\n  {%- generation -%}  \n"
        "{{ m['content'] | trim }}{{ eos_token }}  \n  {%- endgeneration -%}\n\n"
        "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    "inline": (
        "{% for m in messages %}<|{{ m.role }}|>\n"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}"
        "{% endgeneration %}\n{% else %}{{ m.content }}{{ eos_token }}\n{% endif %}"
        "{% endfor %}"
    ),
    "plus": (
        "{% for m in messages %}\n"
        "  {%+ if m.role == 'assistant' %}\n"
        "  {%+ generation +%}\n"
        "<|assistant|> {{ m.content }}{{ eos_token }}\n"
        "  {%+ endgeneration %}\n"
        "  {% else %}<|{{ m.role }}|> {{ m.content }}{{ eos_token }}\n"
        "  {%+ endif %}\n"
        "{% endfor %}"
    ),
    "no_eos": (
        "{% for m in messages %}<|{{ m.role }}|>\n"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}{{ eos_token }}\n{% endfor %}"
    ),
}
GENERATION_CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Count to two, naïvely"},
        {"role": "assistant", "content": "One, two 東京."},
        {"role": "user", "content": "again?"},
        {"role": "assistant", "content": "  One. "},
    ],
    [{"role": "user", "content": "Nothing?"}, {"role": "assistant", "content": ""}],
]
# The tool-use template: tools as transformers' tojson writes them, tool calls, tool results,
# and a variable from chat_template_kwargs.
TOOL_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if tools %}\n"
    "    {{- '<|system|>\\n# Tools\\n' }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- tool | tojson }}\n"
    "        {{- '\\n' }}\n"
    "    {%- endfor %}\n"
    "    {{- tools[0] | tojson(indent=2) }}\n"
    "    {{- eos_token + '\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'assistant' and message.tool_calls is defined %}\n"
    "        {{- '<|assistant|>\\n' }}\n"
    "        {%- for call in message.tool_calls %}\n"
    "            {{- '<call>' + call.function | tojson(sort_keys=true) + '</call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- eos_token + '\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {{- '<|user|>\\n<result>' + message.content + '</result>' + eos_token + '\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|' + message.role + '|>\\n' + message.content + eos_token + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|assistant|>\\n' }}\n"
    "    {%- if enable_thinking is defined and not enable_thinking %}{{- '<think></think>' }}{%- endif %}\n"
    "{%- endif %}\n"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city <today> & 'now'.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "Città"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "a × b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    },
]
# Rows of a TRL dataset with `tools` (as JSON text, the form that survives Arrow's column
# types) and `chat_template_kwargs`: the tool-use template renders them.
TOOL_EXAMPLES = [
    {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": "18 °C"},
            {"role": "assistant", "content": "It is 18 °C."},
        ],
        "tools": json.dumps(TOOLS),
        "chat_template_kwargs": {"enable_thinking": False},
    },
    {
        "prompt": [{"role": "user", "content": "Weather in Oslo?"}],
        "completion": [{"role": "assistant", "content": "Cold."}],
        "tools": json.dumps(TOOLS[:1]),
        "chat_template_kwargs": {"enable_thinking": False},
    },
]
# Examples for assistant_only_loss: only the assistant's turns count (and of a
# prompt-completion example only the completion's). One message carries its reasoning as
# `reasoning`, which transformers offers the template as `reasoning_content`.
AOL_MESSAGES = [
    {"messages": GENERATION_CONVERSATIONS[0]},
    {"messages": GENERATION_CONVERSATIONS[1]},
    {
        "messages": [
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": "Because.", "reasoning": "It is so."},
        ]
    },
]
AOL_PROMPT_COMPLETION = [
    {
        "prompt": GENERATION_CONVERSATIONS[1][:4],
        "completion": GENERATION_CONVERSATIONS[1][4:],
    },
    {
        "prompt": [{"role": "user", "content": "Where did the small dog go?"}],
        "completion": [{"role": "assistant", "content": "It ran to the park."}],
    },
]
# transformers' tojson of each value with each of its arguments.
TOJSON_TEMPLATE = (
    "{%- for x in values %}"
    "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(ensure_ascii=true) }}|"
    "{{ x | tojson(separators=(',', ':')) }}|{{ x | tojson(sort_keys=true, indent='\t') }}|"
    "{{ x | tojson(true, 1) }}|{{ x | tojson(indent=0) }}\n"
    "{%- endfor %}"
)
TOJSON_VALUES = (
    r'[{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": '
    r'{"type": "string", "description": "Citt\u00e0 <b> & \u0027q\u0027 \"x\""}}, "required": ["city"]}},'
    r' [1, 2.0, -0.0, 0.1, 1e16, 1e15, 1e-5, 0.0001, 123456789.125, 1.5e-7, 1e300, 5e-324,'
    r' 12345678901234567890, -7, 100.5e10],'
    r' "tab\t newline\n nul\u0000 del\u007f \u00e9 \u6771 \ud83d\ude42 \\ / \b \f \u001f",'
    r' {"z": 1, "a": {"y": [], "b": {}}, "m": null, "t": true, "f": false, "\u00e9": [{}]},'
    r' [], {}, "", null, 3.5, [[[]]]]'
)


def jinja_tokenizer(tmp):
    """The chat tokenizer saved by transformers 5 with the generation and tool-use templates."""
    from transformers import AutoTokenizer

    directory, _ = chat_tokenizer(os.path.join(tmp, "base"))
    tok = AutoTokenizer.from_pretrained(directory)
    tok.chat_template = {"default": GENERATION_TEMPLATES["lines"], "tool_use": TOOL_TEMPLATE}
    out = os.path.join(tmp, "chat-jinja")
    tok.save_pretrained(out)
    return out, AutoTokenizer.from_pretrained(out)


def generation_masks(chat_tok):
    """transformers' assistant masks and TRL's stop-token check under every generation template,
    with the chat tokenizer and with the byte-level BPE (bos and eos `<|endoftext|>`), whose
    offsets fall inside multi-byte characters and are trimmed of spaces."""
    from transformers import PreTrainedTokenizerFast

    bpe_file = os.path.join(FIXTURES, "tokenizer", "tokenizer.json")
    bpe = PreTrainedTokenizerFast(
        tokenizer_file=bpe_file, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    return {"chat": masks_of(chat_tok), "bpe": masks_of(bpe)}


# The word TRL's eos_token setting names in the stop-token check (in both vocabularies).
PLAIN_EOS = "ree"


def masks_of(tok):
    from trl.chat_template_utils import is_chat_template_stop_token_trained

    import copy

    plain_eos = copy.deepcopy(tok)
    plain_eos.eos_token = PLAIN_EOS
    out = {}
    for name, template in GENERATION_TEMPLATES.items():
        rows = []
        for conv in GENERATION_CONVERSATIONS:
            enc = tok.apply_chat_template(
                conv,
                chat_template=template,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
            rows.append(
                {
                    "text": tok.apply_chat_template(conv, chat_template=template, tokenize=False),
                    "input_ids": list(enc["input_ids"]),
                    "assistant_masks": list(enc["assistant_masks"]),
                }
            )
        out[name] = {
            "renders": rows,
            "stop_token_trained": is_chat_template_stop_token_trained(tok, chat_template=template),
            # Under TRL's eos_token setting, set on the tokenizer before SFTTrainer checks: an
            # ordinary word, which ends no turn.
            "stop_token_trained_with_eos": is_chat_template_stop_token_trained(
                plain_eos, chat_template=template
            ),
        }
    return out


def tool_renders(tok):
    """The tool-use template chosen by transformers when tools are given, and the default without."""
    conv = TOOL_EXAMPLES[0]["messages"]
    return {
        "with_tools": tok.apply_chat_template(
            conv, tools=TOOLS, tokenize=False, add_generation_prompt=True, enable_thinking=False
        ),
        "without_tools": tok.apply_chat_template(conv[:1], tokenize=False),
        "tojson": tok.apply_chat_template(
            [{"role": "user", "content": "x"}],
            chat_template=TOJSON_TEMPLATE,
            tokenize=False,
            values=json.loads(TOJSON_VALUES),
        ),
    }


def style_tokenizer():
    """The Llama-style tokenizer with transformers' clock frozen at FROZEN_TIME."""
    import datetime as real_datetime

    import transformers.utils.chat_template_utils as ctu
    from transformers import PreTrainedTokenizerFast

    class Frozen(real_datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return real_datetime.datetime.fromtimestamp(FROZEN_TIME, real_datetime.timezone.utc)

    ctu.datetime = Frozen
    return PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(FIXTURES, "sft", "llama-tokenizer.json"),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def continued_renders():
    """transformers' `continue_final_message` of each continuation case: the text, or the
    error's type."""
    tok = style_tokenizer()
    templates = {**STYLE_TEMPLATES, **CONTINUE_TEMPLATES}
    out = []
    for name, messages, field in CONTINUE_CASES:
        case = {"template": name, "messages": messages, "field": field}
        try:
            case["text"] = tok.apply_chat_template(
                messages,
                chat_template=templates[name],
                tokenize=False,
                continue_final_message=True if field == "content" else field,
            )
        except Exception as e:  # the type is what the Rust test checks: an error, not a text
            case["error"] = f"{type(e).__name__}: {e}"[:300]
        out.append(case)
    return out


def style_renders():
    """transformers' rendering of every conversation with every style template."""
    tok = style_tokenizer()
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

    os.makedirs(tmp, exist_ok=True)

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
    from transformers import AutoTokenizer

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
            "continued": {"templates": CONTINUE_TEMPLATES, "cases": continued_renders()},
            "strftime": [
                [fmt, t, time.strftime(fmt, time.gmtime(t))] for fmt, t in STRFTIME_CASES
            ],
            "trl": {
                "prompt_completion": trl_columns(tok, PROMPT_COMPLETION, tmp),
                "messages": trl_columns(tok, MESSAGES, tmp),
                # TRL's eos_token setting: examples end with it and the template renders it (a
                # fresh tokenizer each, as TRL sets it on the one it is given).
                "prompt_completion_eos_token": trl_columns(
                    AutoTokenizer.from_pretrained(directory), PROMPT_COMPLETION, tmp,
                    eos_token="<|user|>",
                ),
                "messages_eos_token": trl_columns(
                    AutoTokenizer.from_pretrained(directory), MESSAGES, tmp, eos_token="<|user|>"
                ),
            },
        }
        jinja_dir, jinja_tok = jinja_tokenizer(tmp)
        fixture["jinja"] = {
            "generation": {
                "templates": GENERATION_TEMPLATES,
                "conversations": GENERATION_CONVERSATIONS,
                "rendered": generation_masks(jinja_tok),
            },
            "tools": {"tools": TOOLS, "rendered": tool_renders(jinja_tok)},
            "tojson": {"template": TOJSON_TEMPLATE, "values": TOJSON_VALUES},
            "examples": {
                "assistant_only_loss_messages": AOL_MESSAGES,
                "assistant_only_loss_prompt_completion": AOL_PROMPT_COMPLETION,
                "tools": TOOL_EXAMPLES,
            },
            "trl": {
                "assistant_only_loss_messages": trl_columns(
                    jinja_tok, AOL_MESSAGES, tmp, assistant_only_loss=True
                ),
                "assistant_only_loss_prompt_completion": trl_columns(
                    jinja_tok, AOL_PROMPT_COMPLETION, tmp, assistant_only_loss=True
                ),
                "tools": [
                    trl_columns(jinja_tok, [ex], tmp)[0] for ex in TOOL_EXAMPLES
                ],
                "prompt_completion_counting_prompts": trl_columns(
                    jinja_tok, PROMPT_COMPLETION, tmp, completion_only_loss=False
                ),
                # A TRL dataset holds one format: the two formats run apart, in file order.
                "keep_start_16": [
                    row
                    for examples in (PROMPT_COMPLETION, MESSAGES)
                    for row in trl_columns(jinja_tok, examples, tmp, max_length=16)
                ],
                "keep_end_16": [
                    row
                    for examples in (PROMPT_COMPLETION, MESSAGES)
                    for row in trl_columns(
                        jinja_tok, examples, tmp, max_length=16, truncation_mode="keep_end"
                    )
                ],
                "assistant_only_loss_counting_prompts": trl_columns(
                    jinja_tok,
                    AOL_PROMPT_COMPLETION,
                    tmp,
                    assistant_only_loss=True,
                    completion_only_loss=False,
                ),
            },
        }
        files = {}
        for name in ("tokenizer.json", "tokenizer_config.json"):
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                files[name] = f.read()
        for root, _, names in os.walk(jinja_dir):
            for name in names:
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    files[os.path.join("..", "chat-jinja", os.path.relpath(path, jinja_dir))] = f.read()
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
            path = os.path.normpath(os.path.join(OUT, name))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        print(f"wrote {fixture_path} and the tokenizer beside it")
    elif "--check" in sys.argv:
        with open(fixture_path, encoding="utf-8") as f:
            committed = json.load(f)
        same = all(
            committed[k] == fixture[k]
            for k in ("trl", "rendered", "styles", "continued", "strftime", "jinja")
        )
        print("the committed fixture is TRL's" if same else "the committed fixture differs from TRL's")
        sys.exit(0 if same else 1)
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main()
