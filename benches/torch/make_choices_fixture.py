"""Write the multiple-choice fixture that crates/trainer/tests/choices.rs reads.

EleutherAI's lm-evaluation-harness scores multiple-choice questions (HellaSwag, ARC, PIQA, MMLU
as log-likelihoods) by the log-likelihood of each choice after the question: every request is
`(context, target_delimiter + choice)`, tokenised as its `HFLM` tokenises it (the context's
trailing spaces moved into the continuation; the whole text encoded with the tokenizer's own
special tokens and the continuation taken after the context's tokens; an empty context
replaced by the prefix token, BOS or else EOS; inputs longer than the model's context cut from
the left), and the question's `acc`, `acc_norm` (log-likelihood per character of the choice),
`acc_bytes` (per UTF-8 byte) and `exact_match` (the gold choice is the greedy continuation)
follow from them.

This script runs lm-eval 0.4.13's `simple_evaluate` with `HFLM` (float32, CPU, batch size 1)
on a task defined over `fixtures/choices/questions.jsonl` (written here: hand-made questions
for every case above, plus questions whose right answer is the model's own greedy
continuation) for two committed transformers models, each with a tokenizer written here:

- `llama`: `fixtures/hf-llama-gqa-untied` with `fixtures/sft/llama-tokenizer.json` (adds `<s>`
  before a sequence; BOS `<s>`, EOS `</s>`), target delimiter " " and "";
- `gpt2`: `fixtures/hf-gpt2-sharded` with the story tokenizer (adds nothing; no BOS, so the
  prefix token is EOS `</s>`), target delimiter " ".

With lm-eval's `gen_prefix` (the answer's start after each question and before each example's
answer): in plain text, and through the chat template (examples as turns or in one user
message), where the prefix is the assistant's turn continued.

Winogrande's documents (`choices/winogrande.jsonl`), scored as lm-eval's multiple input with
its `winogrande` task's split (each option filling the blank is a context, the rest of the
sentence is scored after each): zero-shot with both pairs, and one example drawn from the
documents themselves.

And lm-eval's `loglikelihood_rolling` perplexity (word and byte perplexity, bits per byte)
of `fixtures/choices/documents.jsonl` with both pairs: each document's log-likelihood over
windows of the context, its words and bytes, and the aggregates.

Both models have a context of 32 tokens, so long questions are cut and long documents take
several windows. The fixture holds, per
question, lm-eval's requests (context and continuation text), their log-likelihoods and
greedy flags, the question's metrics, and each run's aggregate metrics and standard errors.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

    python benches/torch/make_choices_fixture.py --write    # needs lm_eval, transformers, torch
    python benches/torch/make_choices_fixture.py --check    # the committed fixture is lm-eval's
"""

import json
import os
import shutil
import sys
import tempfile

FIXTURES = os.path.join("crates", "trainer", "tests", "fixtures")
OUT = os.path.join(FIXTURES, "choices")

# The story grammar's words: determiner, adjective, noun, verb, preposition.
QUESTIONS = [
    {"context": "the small cat sat on the", "choices": ["mat.", "red log.", "big"], "gold": 0},
    # Trailing spaces move into every continuation.
    {"context": "the old dog ran under a  ", "choices": ["tree.", "box."], "gold": 1},
    # An empty context: the prefix token stands for it.
    {"context": "", "choices": ["the cat.", "a dog ran."], "gold": 0},
    # The gold answer as the choice's text.
    {"context": "the bird", "choices": ["sat", "ran near"], "gold": "ran near"},
    # Longer than the 32-token context: cut from the left.
    {
        "context": "the big cat sat on a mat. a small dog ran under the old tree. the red bird "
        "slept near a big box. the old fox jumped on the small log. a big",
        "choices": ["cat", "dog slept", "bird."],
        "gold": 1,
    },
    # Characters the vocabulary lacks, and choices whose lengths in characters and in bytes
    # rank differently.
    {"context": "the café cat", "choices": ["sat", "naïve ran", "東京"], "gold": 2},
    # A context that starts with the prefix token's text: no special tokens added.
    {"context": "<s>the small", "choices": ["dog", "cat"], "gold": 0},
    {"context": "</s>the old", "choices": ["bird", "fox ran"], "gold": 1},
    # Lines, as a question and answer prompt writes them.
    {"context": "Question: what sat on the mat?\nAnswer:", "choices": ["the cat", "a log"], "gold": 0},
]
# Questions with several right answers: lm-eval takes a task's kind of target from its first
# question, so these are a task of their own.
SEVERAL_GOLD = [
    {"context": "a red fox", "choices": ["jumped", "slept", "sat"], "gold": [0, 2]},
    {"context": "the small", "choices": ["cat", "dog", "box."], "gold": [1]},
    {"context": "a big dog", "choices": ["ran", "slept"], "gold": [0, 1]},
]
# Contexts whose right answer is made the model's greedy continuation (`exact_match`).
GREEDY_CONTEXTS = ["the small dog", "a big red", "the old tree"]

# Documents for `loglikelihood_rolling` (perplexity): longer than the 32-token context (so
# several windows), whitespace runs at the ends and inside, characters outside the vocabulary,
# and one that starts with the prefix token's text.
DOCUMENTS = [
    {"text": "the small cat sat on the mat."},
    {
        "text": "the big cat sat on a mat. a small dog ran under the old tree. the red bird "
        "slept near a big box. the old fox jumped on the small log. a big dog sat near the "
        "red box. the small bird ran under a big tree."
    },
    {"text": "  the old dog ran.\n\nthe red fox slept  "},
    {"text": "naïve café 東京 the cat"},
    {"text": "<s>the bird sat"},
    {"text": "a"},
]

# Solved questions few-shot examples are drawn from (lm-eval's `fewshot_split`), the gold
# as an index or as the choice's text.
FEWSHOT_POOL = [
    {"context": "the cat sat on the", "choices": ["mat.", "tree."], "gold": 0},
    {"context": "a small dog ran", "choices": ["under", "mat"], "gold": "under"},
    {"context": "the red bird", "choices": ["box.", "slept"], "gold": 1},
    {"context": "a big fox jumped on", "choices": ["the log.", "ran"], "gold": 0},
    {"context": "the old tree", "choices": ["near", "cat"], "gold": 0},
    {"context": "Question: what ran?\nAnswer:", "choices": ["a dog", "a mat"], "gold": "a dog"},
]
# Questions with copies of one another: lm-eval leaves every copy of the question out of its
# own examples, and draws again when that leaves too few.
DUPLICATES = [
    {"context": "the cat sat", "choices": ["on", "box"], "gold": 0},
    {"context": "the cat sat", "choices": ["on", "box"], "gold": 0},
    {"context": "a dog ran", "choices": ["under", "red"], "gold": 0},
    {"context": "the bird slept", "choices": ["near", "mat"], "gold": 0},
]

# name, model, tokenizer, target delimiter, questions, few-shot settings (None: zero-shot).
# Documents for `loglikelihood` (LAMBADA): the last word after the rest, split on single
# spaces as lm-eval's lambada_openai splits them.
COMPLETIONS = [
    {"text": "the small cat sat on the mat."},
    {"text": "a big dog ran under the old tree"},
    {"text": "the red bird slept  near"},
    {"text": "fox"},
    {"text": "the café cat sat near 東京"},
    {
        "text": "the big cat sat on a mat. a small dog ran under the old tree. the red bird "
        "slept near a big box. the old fox jumped on the small log. a big dog"
    },
]

# Winogrande's documents (lm-eval's multiple input): each option fills the blank, and the
# text after the blank is scored after each filled-in context.
WINOGRANDE = [
    {"sentence": "the cat sat on the _ near the old tree.", "option1": "mat", "option2": "dog", "answer": "1"},
    {"sentence": "a big _ ran under the box.", "option1": "dog", "option2": "bird", "answer": "2"},
    {"sentence": "_ slept near a red log.", "option1": "the fox", "option2": "a cat", "answer": "1"},
    {"sentence": "the small bird jumped on _ and sat.", "option1": "the mat", "option2": "a log", "answer": "2"},
    # Longer than the 32-token context: cut from the left.
    {
        "sentence": "the big cat sat on a mat. a small dog ran under the old tree. the red bird "
        "slept near a big box. the old _ jumped on the small log.",
        "option1": "fox", "option2": "cat", "answer": "1",
    },
    {"sentence": "the café _ ran near 東京.", "option1": "cat", "option2": "naïve dog", "answer": "2"},
]

RUNS = [
    ("llama", "hf-llama-gqa-untied", "llama", " ", "questions.jsonl", None),
    ("llama_no_delimiter", "hf-llama-gqa-untied", "llama", "", "questions.jsonl", None),
    ("gpt2", "hf-gpt2-sharded", "story", " ", "questions.jsonl", None),
    ("llama_several_gold", "hf-llama-gqa-untied", "llama", " ", "several_gold.jsonl", None),
    # lm-eval's default sampler over the questions themselves (each left out of its own
    # examples), with a description.
    (
        "llama_fewshot_random",
        "hf-llama-gqa-untied",
        "llama",
        " ",
        "questions.jsonl",
        {"shots": 2, "file": None, "sampler": "default", "seed": 1234,
         "description": "Pick the ending.\n\n", "delimiter": "\n\n"},
    ),
    # From a file of their own: the first three (MMLU's sampler), then drawn with another
    # seed and delimiter.
    (
        "llama_fewshot_first_n",
        "hf-llama-gqa-untied",
        "llama",
        " ",
        "questions.jsonl",
        {"shots": 3, "file": "fewshot.jsonl", "sampler": "first_n", "seed": 1234,
         "description": "", "delimiter": "\n\n"},
    ),
    (
        "gpt2_fewshot_random_file",
        "hf-gpt2-sharded",
        "story",
        " ",
        "questions.jsonl",
        {"shots": 4, "file": "fewshot.jsonl", "sampler": "default", "seed": 7,
         "description": "", "delimiter": "\n"},
    ),
    (
        "llama_fewshot_duplicates",
        "hf-llama-gqa-untied",
        "llama",
        " ",
        "duplicates.jsonl",
        {"shots": 2, "file": None, "sampler": "default", "seed": 1234,
         "description": "", "delimiter": "\n\n"},
    ),
]

# lm-eval's `--apply_chat_template`: prompts rendered by the tokenizer's chat template (its
# generation prompt added, no target delimiter before the choice), examples as turns of their
# own or written into one user message, a system instruction as the system message, the
# template's own variables (HFLM's `chat_template_args`); and a template that refuses a system
# message, which lm-eval's HFLM renders again without it.
CHAT_RUNS = [
    (
        "llama_chat_multiturn",
        "hf-llama-gqa-untied",
        "chat",
        " ",
        "questions.jsonl",
        {"shots": 2, "file": "fewshot.jsonl", "sampler": "first_n", "seed": 1234,
         "description": "", "delimiter": "\n\n", "system_instruction": "You answer briefly.",
         "chat": {"multiturn": True}},
    ),
    (
        "llama_chat_singleturn",
        "hf-llama-gqa-untied",
        "chat",
        " ",
        "questions.jsonl",
        {"shots": 2, "file": None, "sampler": "default", "seed": 1234,
         "description": "Pick the ending.", "delimiter": "\n\n",
         "system_instruction": "You answer briefly.", "chat": {"multiturn": False}},
    ),
    (
        "llama_chat_no_thinking",
        "hf-llama-gqa-untied",
        "chat_no_system",
        " ",
        "questions.jsonl",
        {"shots": 1, "file": "fewshot.jsonl", "sampler": "first_n", "seed": 1234,
         "description": "", "delimiter": "\n\n",
         "chat": {"multiturn": True, "kwargs": {"enable_thinking": False}}},
    ),
    (
        "llama_chat_no_system",
        "hf-llama-gqa-untied",
        "chat_no_system",
        " ",
        "questions.jsonl",
        {"shots": 0, "file": None, "sampler": "default", "seed": 1234,
         "description": "", "delimiter": "\n\n", "system_instruction": "Be brief.",
         "chat": {"multiturn": True}},
    ),
]
# lm-eval's `gen_prefix`: the answer's start after the question (a few-shot example's answer
# starts with it too); through the chat template it is the assistant's turn, continued, and
# the choice follows it after the target delimiter unless it ends with whitespace.
GEN_PREFIX_RUNS = [
    (
        "llama_gen_prefix",
        "hf-llama-gqa-untied",
        "llama",
        " ",
        "questions.jsonl",
        {"shots": 1, "file": "fewshot.jsonl", "sampler": "first_n", "seed": 1234,
         "description": "", "delimiter": "\n\n", "gen_prefix": "The ending is"},
    ),
    (
        "llama_chat_gen_prefix",
        "hf-llama-gqa-untied",
        "chat",
        " ",
        "questions.jsonl",
        {"shots": 1, "file": "fewshot.jsonl", "sampler": "first_n", "seed": 1234,
         "description": "", "delimiter": "\n\n", "gen_prefix": "Answer:",
         "chat": {"multiturn": True}},
    ),
    (
        "llama_chat_single_gen_prefix",
        "hf-llama-gqa-untied",
        "chat",
        " ",
        "questions.jsonl",
        {"shots": 1, "file": None, "sampler": "default", "seed": 1234,
         "description": "", "delimiter": "\n\n", "gen_prefix": "Pick: ",
         "chat": {"multiturn": False}},
    ),
]
RUNS += CHAT_RUNS + GEN_PREFIX_RUNS
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('no system messages') }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)

# CPython's `random.Random(seed).sample(range(n), k)`, calls in order on one generator: both
# of its algorithms (a pool for small populations, a set of drawn indices for large ones).
PYTHON_RANDOM_CALLS = [
    (1234, [(10, 3), (10, 3), (4, 4), (1, 1), (50, 8), (100, 3), (5000, 10), (7, 0)]),
    (0, [(6, 2), (30, 6), (2 ** 20, 5)]),
    (2 ** 40 + 5, [(22, 21), (3, 1)]),
]


def tokenizer_dirs(tmp):
    """The two tokenizers as transformers saves them: tokenizer.json and tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast

    with open(os.path.join(FIXTURES, "sft", "chat", "tokenizer_config.json"), encoding="utf-8") as f:
        chat_template = json.load(f)["chat_template"]
    chat = os.path.join(FIXTURES, "sft", "chat", "tokenizer.json")
    out = {}
    for name, source, bos, template in [
        ("llama", os.path.join(FIXTURES, "sft", "llama-tokenizer.json"), "<s>", None),
        ("story", os.path.join(FIXTURES, "tokenizer", "story", "tokenizer.json"), None, None),
        ("chat", chat, "<s>", chat_template),
        ("chat_no_system", chat, "<s>", NO_SYSTEM_TEMPLATE),
    ]:
        kwargs = {"eos_token": "</s>", "unk_token": "<unk>"}
        if bos:
            kwargs["bos_token"] = bos
        if template:
            kwargs["chat_template"] = template
        tok = PreTrainedTokenizerFast(tokenizer_file=source, **kwargs)
        directory = os.path.join(tmp, "tokenizer-" + name)
        tok.save_pretrained(directory)
        out[name] = directory
    return out


def model_dir(tmp, model, tokenizer_dir):
    """The model's files and the tokenizer's in one directory, as HFLM loads them."""
    directory = os.path.join(tmp, "model-" + model + "-" + os.path.basename(tokenizer_dir))
    if not os.path.isdir(directory):
        shutil.copytree(os.path.join(FIXTURES, model), directory)
        for f in os.listdir(tokenizer_dir):
            shutil.copy(os.path.join(tokenizer_dir, f), directory)
    return directory


def greedy_questions(directory, count=3):
    """Questions whose gold choice is the model's greedy continuation of the context, one or
    two tokens that re-encode as themselves after " ": the first contexts of the grammar's
    three-word phrases for which there is one."""
    import itertools

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    out = []
    words = [["the", "a"], ["big", "small", "red", "old"], ["cat", "dog", "bird", "fox"]]
    for phrase in itertools.product(*words):
        context = " ".join(phrase)
        ids = tok(context).input_ids
        for new in (2, 1):
            generated = model.generate(
                torch.tensor([ids]), max_new_tokens=new, do_sample=False
            )[0].tolist()
            text = tok.decode(generated, skip_special_tokens=True)
            prefix = tok.decode(ids, skip_special_tokens=True)
            continuation = text[len(prefix) :]
            if (
                text.startswith(prefix)
                and continuation.startswith(" ")
                and continuation[1:].strip() == continuation[1:]
                and continuation[1:]
                and tok(context + continuation).input_ids == generated
            ):
                out.append({"context": context, "choices": ["slept", continuation[1:]], "gold": 1})
                break
        if len(out) == count:
            return out
    raise SystemExit("too few contexts with a greedy continuation that re-encodes as itself")


def evaluate_task(directory, task, task_dir, num_fewshot=0, fewshot_seed=0, chat=None,
                  system_instruction=None):
    """lm-eval's `simple_evaluate` of the task `task` (a task config, written into task_dir)
    with `HFLM` on the model in `directory`, every sample logged."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    with open(os.path.join(task_dir, task["task"] + ".yaml"), "w") as f:
        json.dump(task, f)  # JSON is YAML
    lm = HFLM(
        pretrained=directory,
        backend="causal",
        dtype="float32",
        device="cpu",
        batch_size=1,
        chat_template_args=(chat or {}).get("kwargs"),
    )
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=[task["task"]],
        task_manager=TaskManager(include_path=task_dir),
        log_samples=True,
        num_fewshot=num_fewshot,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=fewshot_seed,
        apply_chat_template=chat is not None,
        fewshot_as_multiturn=bool(chat and chat["multiturn"]),
        system_instruction=system_instruction,
    )


def json_task(name, path, output_type, fewshot_path=None, **fields):
    """A task over the JSONL file at `path` (split `test`), and `fewshot_path`'s (split
    `fewshot`) when given."""
    files = {"test": os.path.abspath(path)}
    if fewshot_path:
        files["fewshot"] = os.path.abspath(fewshot_path)
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": files},
        "test_split": "test",
        "output_type": output_type,
        **fields,
    }


def run_rolling(directory, documents_path, tmp):
    """lm-eval's perplexity of the documents: each one's log-likelihood and the aggregates."""
    task_dir = os.path.join(tmp, "rolling-" + str(abs(hash(directory))))
    os.makedirs(task_dir, exist_ok=True)
    task = json_task(
        "headroom_rolling",
        documents_path,
        "loglikelihood_rolling",
        doc_to_text="",
        doc_to_target="text",
        metric_list=[{"metric": m} for m in ["word_perplexity", "byte_perplexity", "bits_per_byte"]],
    )
    results = evaluate_task(directory, task, task_dir)
    samples = sorted(results["samples"]["headroom_rolling"], key=lambda s: s["doc_id"])
    aggregate = results["results"]["headroom_rolling"]
    return {
        "documents": [
            {
                "loglikelihood": s["resps"][0][0],
                "words": s["word_perplexity"][1],
                "bytes": s["byte_perplexity"][1],
            }
            for s in samples
        ],
        "metrics": {
            m: aggregate[m + ",none"] for m in ["word_perplexity", "byte_perplexity", "bits_per_byte"]
        },
    }


def run_completions(directory, path, tmp):
    """lm-eval's lambada_openai task over the documents: each one's request, log-likelihood
    and greedy flag, and acc and perplexity with their standard errors (the perplexity's by
    lm-eval's bootstrap, 100 000 replicates)."""
    task_dir = os.path.join(tmp, "completions-" + str(abs(hash(directory))))
    os.makedirs(task_dir, exist_ok=True)
    task = json_task(
        "headroom_completions",
        path,
        "loglikelihood",
        doc_to_text="{{text.split(' ')[:-1]|join(' ')}}",
        doc_to_target="{{' '+text.split(' ')[-1]}}",
        metric_list=[
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        ],
    )
    results = evaluate_task(directory, task, task_dir)
    samples = sorted(results["samples"]["headroom_completions"], key=lambda s: s["doc_id"])
    aggregate = results["results"]["headroom_completions"]
    return {
        "documents": [
            {
                "request": list(s["arguments"][0]),
                "loglikelihood": s["resps"][0][0][0],
                "is_greedy": s["resps"][0][0][1],
            }
            for s in samples
        ],
        "metrics": {m: aggregate[m + ",none"] for m in ["acc", "perplexity"]},
        "stderr": {m: aggregate[m + "_stderr,none"] for m in ["acc", "perplexity"]},
    }


def scored(results, task, metrics):
    """A multiple-choice task's requests, log-likelihoods and metrics per document (in document
    order), and its aggregates and standard errors."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    aggregate = results["results"][task]
    return {
        "scored": [
            {
                "requests": [list(a) for a in s["arguments"]],
                "loglikelihoods": [r[0][0] for r in s["resps"]],
                "is_greedy": [r[0][1] for r in s["resps"]],
                **{m: s[m] for m in metrics},
            }
            for s in samples
        ],
        "metrics": {m: aggregate[m + ",none"] for m in metrics},
        "stderr": {m: aggregate[m + "_stderr,none"] for m in metrics},
    }


def run(directory, questions_path, delimiter, tmp, fewshot=None):
    task_dir = os.path.join(
        tmp, "tasks-" + str(abs(hash((directory, delimiter, questions_path, json.dumps(fewshot)))))
    )
    os.makedirs(task_dir, exist_ok=True)
    metrics = ["acc", "acc_norm", "acc_bytes", "exact_match"]
    fields = {}
    if fewshot:
        fields = {
            "fewshot_split": "fewshot" if fewshot["file"] else "test",
            "fewshot_config": {"sampler": fewshot["sampler"]},
            "description": fewshot["description"],
            "fewshot_delimiter": fewshot["delimiter"],
        }
        if fewshot.get("gen_prefix"):
            fields["gen_prefix"] = fewshot["gen_prefix"]
    task = json_task(
        "headroom_choices",
        questions_path,
        "multiple_choice",
        fewshot_path=os.path.join(tmp, fewshot["file"]) if fewshot and fewshot["file"] else None,
        doc_to_text="context",
        doc_to_choice="choices",
        doc_to_target="gold",
        target_delimiter=delimiter,
        metric_list=[{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in metrics],
        **fields,
    )
    results = evaluate_task(
        directory,
        task,
        task_dir,
        num_fewshot=fewshot["shots"] if fewshot else 0,
        fewshot_seed=fewshot["seed"] if fewshot else 0,
        chat=fewshot.get("chat") if fewshot else None,
        system_instruction=fewshot.get("system_instruction") if fewshot else None,
    )
    return scored(results, "headroom_choices", metrics)


def run_winogrande(directory, path, tmp, shots, seed):
    """lm-eval's multiple-input scoring of Winogrande documents, split as its `winogrande`
    task splits them (its preprocess functions as templates); `shots` examples from the
    documents themselves by the default sampler."""
    task_dir = os.path.join(tmp, "winogrande-" + str(abs(hash((directory, shots)))))
    os.makedirs(task_dir, exist_ok=True)
    metrics = ["acc", "acc_norm", "acc_bytes", "exact_match"]
    blank = "sentence.index('_')"
    task = json_task(
        "headroom_winogrande",
        path,
        "multiple_choice",
        doc_to_text="{{ {'1': 0, '2': 1}[answer] }}",
        doc_to_target="{{ sentence[" + blank + " + 1:].strip() }}",
        doc_to_choice="{{ [sentence[:" + blank + "] + option1, sentence[:" + blank + "] + option2] }}",
        metric_list=[{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in metrics],
        **({"fewshot_split": "test"} if shots else {}),
    )
    results = evaluate_task(directory, task, task_dir, num_fewshot=shots, fewshot_seed=seed)
    return {"shots": shots, "seed": seed, **scored(results, "headroom_winogrande", metrics)}


def python_random():
    """The draws of PYTHON_RANDOM_CALLS, as CPython makes them."""
    import random
    import platform

    out = []
    for seed, calls in PYTHON_RANDOM_CALLS:
        rng = random.Random(seed)
        draws = [{"n": n, "k": k, "sample": rng.sample(range(n), k)} for n, k in calls]
        out.append(
            {
                "seed": seed,
                "draws": draws,
                # Then, on the same generator: floats, and choices with replacement.
                "random": [rng.random() for _ in range(3)],
                "choices": rng.choices(range(7), k=9),
            }
        )
    return {"python": platform.python_version(), "calls": out}


def make():
    import lm_eval
    import transformers

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizers = tokenizer_dirs(tmp)
        files = {}
        for name, directory in tokenizers.items():
            for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                if os.path.isfile(os.path.join(directory, f)):
                    with open(os.path.join(directory, f), encoding="utf-8") as fh:
                        files[os.path.join(name, f)] = fh.read()
        llama = model_dir(tmp, "hf-llama-gqa-untied", tokenizers["llama"])
        greedy = greedy_questions(llama)
        for name, questions in [
            ("questions.jsonl", QUESTIONS + greedy),
            ("several_gold.jsonl", SEVERAL_GOLD),
            ("fewshot.jsonl", FEWSHOT_POOL),
            ("duplicates.jsonl", DUPLICATES),
        ]:
            text = "".join(json.dumps(q, ensure_ascii=False) + "\n" for q in questions)
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
            files[name] = text
        # And documents whose last word is the Llama pair's greedy continuation (`acc`).
        completions = COMPLETIONS + [
            {"text": q["context"] + " " + q["choices"][1]}
            for q in greedy
            if " " not in q["choices"][1]
        ]
        text = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in completions)
        with open(os.path.join(tmp, "completions.jsonl"), "w", encoding="utf-8") as f:
            f.write(text)
        files["completions.jsonl"] = text
        text = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in DOCUMENTS)
        with open(os.path.join(tmp, "documents.jsonl"), "w", encoding="utf-8") as f:
            f.write(text)
        files["documents.jsonl"] = text
        fixture = {
            "lm_eval": lm_eval.__version__,
            "transformers": transformers.__version__,
            "runs": {},
            "rolling": {},
            "completions": {},
        }
        for name, model, tokenizer in [
            ("llama", "hf-llama-gqa-untied", "llama"),
            ("gpt2", "hf-gpt2-sharded", "story"),
        ]:
            directory = model_dir(tmp, model, tokenizers[tokenizer])
            fixture["rolling"][name] = {
                "model": model,
                "tokenizer": tokenizer,
                **run_rolling(directory, os.path.join(tmp, "documents.jsonl"), tmp),
            }
            fixture["completions"][name] = {
                "model": model,
                "tokenizer": tokenizer,
                **run_completions(directory, os.path.join(tmp, "completions.jsonl"), tmp),
            }
        for name, model, tokenizer, delimiter, questions, fewshot in RUNS:
            directory = model_dir(tmp, model, tokenizers[tokenizer])
            result = run(directory, os.path.join(tmp, questions), delimiter, tmp, fewshot)
            fixture["runs"][name] = {
                "model": model,
                "tokenizer": tokenizer,
                "target_delimiter": delimiter,
                "questions": questions,
                **({"fewshot": fewshot} if fewshot else {}),
                **result,
            }
        text = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in WINOGRANDE)
        with open(os.path.join(tmp, "winogrande.jsonl"), "w", encoding="utf-8") as f:
            f.write(text)
        files["winogrande.jsonl"] = text
        fixture["winogrande"] = {}
        for name, model, tokenizer, shots in [
            ("llama", "hf-llama-gqa-untied", "llama", 0),
            ("gpt2", "hf-gpt2-sharded", "story", 0),
            ("llama_fewshot", "hf-llama-gqa-untied", "llama", 1),
        ]:
            directory = model_dir(tmp, model, tokenizers[tokenizer])
            fixture["winogrande"][name] = {
                "model": model,
                "tokenizer": tokenizer,
                **run_winogrande(directory, os.path.join(tmp, "winogrande.jsonl"), tmp, shots, 1234),
            }
        fixture["python_random"] = python_random()
    return fixture, files


def main():
    if "--quick" in sys.argv:
        sys.exit(3)
    fixture, files = make()
    fixture_path = os.path.join(OUT, "lm_eval_choices.json")
    if "--write" in sys.argv:
        for name, text in files.items():
            path = os.path.join(OUT, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        with open(fixture_path, "w", encoding="utf-8") as f:
            json.dump(fixture, f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(f"wrote {fixture_path}, the questions and the tokenizers beside it")
    elif "--check" in sys.argv:
        with open(fixture_path, encoding="utf-8") as f:
            committed = json.load(f)
        same = (
            committed["runs"] == fixture["runs"]
            and committed["rolling"] == fixture["rolling"]
            and committed["completions"] == fixture["completions"]
            and committed["winogrande"] == fixture["winogrande"]
            and committed["python_random"]["calls"] == fixture["python_random"]["calls"]
        )
        print("the committed fixture is lm-eval's" if same else "the committed fixture differs from lm-eval's")
        sys.exit(0 if same else 1)
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main()
