"""transformers' rendering of the chat templates TRL ships (`trl/chat_templates/*.jinja`:
templates of released models, Qwen, Llama, Gemma, DeepSeek, gpt-oss, Nemotron, Phi, …, and TRL's
training versions with `{% generation %}` blocks) over conversations with system turns, tools,
tool calls (arguments as objects and as JSON text), tool results, reasoning and
`enable_thinking`, and with the final message (or its reasoning) continued, for the agreement check `crates/trainer/tests/chat_template_corpus.rs`. The
templates are not ours to commit, so the cases stay local:

    python benches/torch/dump_chat_template_corpus.py OUT.json   # needs transformers, trl
    HEADROOM_CHAT_TEMPLATE_CASES=OUT.json cargo test -p headroom-trainer \
        --test chat_template_corpus -- --ignored

Each case holds the template, the request, and transformers' text and generation spans (in
characters), or its error. Not a comparison bench: with `--quick` it exits 3 ("skipped").
"""
import datetime as real_datetime
import glob
import json
import os
import sys

if "--quick" in sys.argv:
    sys.exit(3)
if len(sys.argv) != 2:
    print(__doc__)
    sys.exit(2)
import transformers.utils.chat_template_utils as ctu
import trl
from transformers import PreTrainedTokenizerFast

FROZEN = 1796029507
class Frozen(real_datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return real_datetime.datetime.fromtimestamp(FROZEN, real_datetime.timezone.utc)
ctu.datetime = Frozen

tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "crates", "trainer", "tests", "fixtures", "tokenizer", "tokenizer.json"),
                              bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & 'here'.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Città"},
                         "days": {"type": "integer"}}, "required": ["city"]}}}]
CONVS = {
    "simple": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    "multi": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3 naïve 東京?"},
              {"role": "assistant", "content": "6"}],
    "tools": [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "call_1",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
              {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": "18C"},
              {"role": "assistant", "content": "It is 18C."}],
    "string_args": [{"role": "system", "content": "You can call tools."}, {"role": "user", "content": "Weather in Oslo and Rome?"},
              {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
              {"role": "tool", "content": "-3C"}, {"role": "tool", "content": "21C"},
              {"role": "assistant", "content": "Oslo -3C, Rome 21C."}],
    "reasoning": [{"role": "user", "content": "Why?"},
                  {"role": "assistant", "content": "Because.", "reasoning_content": "It is so."}],
}
cases = []
for path in sorted(glob.glob(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "*.jinja"))):
    name = os.path.basename(path)
    template = open(path, encoding="utf-8").read()
    for cname, conv in CONVS.items():
        for gp, msgs, kw in ((False, conv, {}), (True, conv[:1], {}), (True, conv[:2], {"enable_thinking": False})):
            tools = TOOLS if cname in ("tools", "string_args") else None
            case = {"template_name": name, "template": template, "conversation": cname,
                    "messages": msgs, "tools": tools, "add_generation_prompt": gp, "kwargs": kw}
            try:
                out = tok.apply_chat_template(msgs, chat_template=template, tools=tools, tokenize=False,
                                              add_generation_prompt=gp, **kw)
                case["text"] = out
                if "generation" in template:
                    rendered, idx = ctu.render_jinja_template(conversations=[msgs], tools=tools, documents=None,
                        chat_template=template, return_assistant_tokens_mask=True, add_generation_prompt=gp,
                        **tok.special_tokens_map, **kw)
                    case["spans"] = [list(s) for s in idx[0]]
            except Exception as e:
                case["error"] = f"{type(e).__name__}: {e}"[:200]
            cases.append(case)
        # The final message continued (transformers' continue_final_message), and the reasoning.
        fields = ["content"] + (["reasoning_content"] if cname == "reasoning" else [])
        for field in fields:
            tools = TOOLS if cname in ("tools", "string_args") else None
            case = {"template_name": name, "template": template, "conversation": cname,
                    "messages": conv, "tools": tools, "add_generation_prompt": False, "kwargs": {},
                    "continue_final_message": field}
            try:
                case["text"] = tok.apply_chat_template(conv, chat_template=template, tools=tools, tokenize=False,
                                                       continue_final_message=True if field == "content" else field)
            except Exception as e:
                case["error"] = f"{type(e).__name__}: {e}"[:200]
            cases.append(case)
with open(sys.argv[1], "w", encoding="utf-8") as f:
    json.dump({"trl": trl.__version__, "cases": cases}, f, ensure_ascii=False)
print(len(cases), "cases,", sum("error" in c for c in cases), "of them errors in transformers")
