"""Write the prompt-template fixture: what lm-eval makes of a task's `doc_to_text`,
`doc_to_target` and `doc_to_choice` for a document.

EleutherAI's lm-evaluation-harness describes a task in YAML. Its `doc_to_text`,
`doc_to_target` and `doc_to_choice` are each a feature name (the document's field, returned
as it is, whatever its type), a Jinja2 template rendered over the document's fields (lm-eval's
`utils.apply_template`: `jinja2.Environment(undefined=StrictUndefined,
keep_trailing_newline=True)` plus a `regex_replace` filter; not sandboxed, so Python methods
such as `.split()`, `.index()` and `.format()` work), an int, a list or a dict, or Python code
(`!function`). What comes out is then retyped by `ConfigurableTask`:

- `doc_to_text`: a rendered text that is all digits (`str.isdigit`, Unicode digits included)
  goes through `ast.literal_eval` when the task has a `doc_to_choice` (an int: the index of a
  choice, "multiple input"); an int setting is returned as it is; any other setting (a list,
  a dict, nothing) raises `TypeError`.
- `doc_to_target`: the same digits rule, and besides a rendered text of at least two
  characters that starts with "[" and ends with "]" goes through `ast.literal_eval` (a
  `SyntaxError` or `ValueError` keeps the text); an int or a list setting is returned as it is.
- `doc_to_choice`: a rendered text always goes through `ast.literal_eval` (its errors are not
  caught); a list setting is returned as it is, a dict as the list of its values.

This script calls lm-eval 0.4.13's own `ConfigurableTask.doc_to_text`, `doc_to_target` and
`doc_to_choice` (the methods its `fewshot_context` and `construct_requests` call for every
document), on a task made without `__init__` (so no dataset is downloaded):
`object.__new__(ConfigurableTask)` with `_config` (what the `config` property returns) a
`TaskConfig` built from the case's settings, `features` the document's keys (lm-eval's are the
dataset's columns) and `prompt = None` (no promptsource prompt); those are everything the three
methods read. `doc_to_choice` is called only when the case sets it.

Cases:

- real tasks: the three settings of installed lm-eval task YAML files, loaded by lm-eval's own
  `load_yaml` (includes merged), over hand-written documents shaped like the Hugging Face
  datasets those tasks read (after the task's `process_docs`, where it has one). A task whose
  settings are Python code (`!function`) is listed under "skipped" with the reason instead;
- hand-made edge cases that pin down Jinja2's and Python's semantics (how Jinja2 prints bools,
  None, floats, lists and dicts; filters; string methods; errors; the retyping rules above).

The fixture (`crates/trainer/tests/fixtures/doc_templates.json`) holds:

    {"lm_eval": version, "jinja2": version,
     "skipped": [{"task", "file", "reason"}],
     "cases": [{"name", "why", "doc_to_text"?, "doc_to_target"?, "doc_to_choice"?,
                "docs": [{"doc", "text", "target", "choice"?}]}]}

A case's settings are as lm-eval's YAML holds them (a string, an int, a list or a dict; absent
when the YAML does not set one). Each result keeps its Python type: `{"str": "..."}`,
`{"int": 3}`, `{"float": 1.5}`, `{"bool": true}`, `{"none": null}`, `{"list": [...]}`,
`{"tuple": [...]}`, `{"dict": {...}}` (elements recorded the same way), or, when the call
raised, `{"error": "ExceptionClassName"}` (each call caught on its own). Documents are plain
JSON: a JSON number with a fraction or an exponent is a Python float, one without is an int.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

    python benches/torch/make_doc_template_fixture.py --write    # needs lm_eval (and datasets)
    python benches/torch/make_doc_template_fixture.py --check    # the committed fixture is lm-eval's
"""

import contextlib
import io
import json
import logging
import os
import sys

FIXTURE = os.path.join("crates", "trainer", "tests", "fixtures", "doc_templates.json")

SETTINGS = ("doc_to_text", "doc_to_target", "doc_to_choice")

# ---------------------------------------------------------------------------------------------
# Real tasks: (name, YAML file under lm_eval/tasks, why, documents). Documents are shaped like
# the task's Hugging Face dataset rows; `None` documents for a task expected to be skipped.

MMLU_DOCS = [
    {
        "question": "Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q.",
        "subject": "abstract_algebra",
        "choices": ["0", "4", "2", "6"],
        "answer": 1,
    },
    {
        "question": "  Which value is closest to √2 ≈ ?\n",
        "subject": "high_school_mathematics",
        "choices": ["1.414", "1.732", "2.236", "π/2"],
        "answer": 0,
    },
    {
        "question": "Statement 1 | Every group of order 4 is cyclic. Statement 2 | Z_2 × Z_2 isn't.",
        "subject": "abstract_algebra",
        "choices": ["True, True", "False, False", "True, False", "False, True"],
        "answer": 3,
    },
]

GSM8K_DOCS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
        "many clips to her friends in May. How many clips did Natalia sell altogether in April "
        "and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
        "<<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "Zoë pays €1,200 rent and 15% of that for électricité. What does she pay?",
        "answer": "1200 * 0.15 = <<1200*0.15=180>>180.\n1200 + 180 = <<1200+180=1380>>1380\n#### 1,380",
    },
]

ARC_DOCS = [
    {
        "id": "Mercury_SC_405487",
        "question": "Which tool is best for measuring the mass of a 250 g rock?",
        "choices": {
            "text": ["a balance", "a thermometer", "a metric ruler", "a graduated cylinder"],
            "label": ["A", "B", "C", "D"],
        },
        "answerKey": "A",
    },
    {
        "id": "NYSEDREGENTS_2015_4_8",
        "question": "Water freezes at 0 °C. At which temperature — in °F — does it boil?",
        "choices": {"text": ["32 °F", "100 °F", "212 °F", "½ of 424 °F"], "label": ["1", "2", "3", "4"]},
        "answerKey": "3",
    },
    {
        "id": "MCAS_2004_8_27",
        "question": "What makes an apple fall to the ground?",
        "choices": {
            "text": ["the Sun’s heat", "Earth's gravity", 'the Moon\'s "pull"', "friction", "magnetism"],
            "label": ["A", "B", "C", "D", "E"],
        },
        "answerKey": "B",
    },
]

HELLASWAG_RAW = [
    {
        "ind": 24,
        "activity_label": "Roof shingle removal",
        "ctx_a": "A man is sitting on a roof.",
        "ctx_b": "he",
        "ctx": "A man is sitting on a roof. he",
        "endings": ["is using wrap to wrap skis.", "is ripping tiles off.", "is holding a rubik's cube.", "starts pulling up roofing."],
        "source_id": "activitynet~v_-JhWjGDPHMY",
        "split": "val",
        "split_type": "indomain",
        "label": "3",
    },
    {
        "ind": 4050,
        "activity_label": "Home and Garden",
        "ctx_a": "[header] Clean a café  terrace [title] Sweep.",
        "ctx_b": "[step] use a broom",
        "ctx": "[header] Clean a café  terrace [title] Sweep. [step] use a broom",
        "endings": ["and sweep. [substeps] Corners too.", "[title] Paint it “red”.", "to brush.", "and wait."],
        "source_id": "wikihow~63015",
        "split": "val",
        "split_type": "zeroshot",
        "label": "0",
    },
]

REAL_TASKS = [
    (
        "arc_easy",
        "arc/arc_easy.yaml",
        "arc_challenge (arc/arc_challenge.yaml) includes it and shares the three settings; "
        "the target is the gold label's index, digits that become an int",
        ARC_DOCS,
    ),
    (
        "piqa",
        "piqa/piqa.yaml",
        "a list literal of two features as choices; the target is the feature `label`",
        [
            {
                "goal": "How do I ready a guinea pig cage for it's new occupants?",
                "sol1": "Line the cage with bedding made of ripped paper strips.",
                "sol2": "Line the cage with bedding made of ripped jeans material.",
                "label": 0,
            },
            {
                "goal": "To make crème brûlée crisp on top,",
                "sol1": "sprinkle sugar and torch it until it's golden.",
                "sol2": "sprinkle salt and freeze it for 2–3 hours.",
                "label": 0,
            },
            {
                "goal": 'Write a Windows path in a "quoted" string',
                "sol1": "type C:\\Users\\me with doubled backslashes",
                "sol2": "type it as 'C:/Users/me'\n",
                "label": 1,
            },
        ],
    ),
    (
        "sciq",
        "sciq/sciq.yaml",
        "doc_to_target is the int 3; `support.lstrip()`, an empty support",
        [
            {
                "question": "What type of organism is commonly used in preparation of foods such "
                "as cheese and yogurt?",
                "distractor3": "viruses",
                "distractor1": "protozoa",
                "distractor2": "gymnosperms",
                "correct_answer": "mesophilic organisms",
                "support": "Mesophiles grow best between 25°C and 40°C (77°F and 104°F).",
            },
            {
                "question": "What is the SI unit of force?",
                "distractor3": "joule",
                "distractor1": "watt",
                "distractor2": "pascal",
                "correct_answer": "newton",
                "support": "",
            },
            {
                "question": "Où se trouve l'ADN ?",
                "distractor3": "ribosome",
                "distractor1": "membrane",
                "distractor2": "vacuole",
                "correct_answer": "noyau",
                "support": "\n \tDans le noyau.  \n",
            },
        ],
    ),
    (
        "openbookqa",
        "openbookqa/openbookqa.yaml",
        "doc_to_text is the feature `question_stem`; the target uses `answerKey.lstrip()`",
        [
            {
                "id": "7-980",
                "question_stem": "The sun is responsible for",
                "choices": {
                    "text": [
                        "puppies learning new tricks",
                        "children growing up and getting old",
                        "flowers wilting in a vase",
                        "plants sprouting, blooming and wilting",
                    ],
                    "label": ["A", "B", "C", "D"],
                },
                "answerKey": "D",
            },
            {
                "id": "8-376",
                "question_stem": "A magnet will stick to",
                "choices": {
                    "text": ["a wooden spoon", "an iron nail", "a glass jar", "a café’s paper cup"],
                    "label": ["A", "B", "C", "D"],
                },
                "answerKey": " B",
            },
        ],
    ),
    (
        "mmlu_abstract_algebra",
        "mmlu/default/mmlu_abstract_algebra.yaml",
        "mmlu/default/_default_template_yaml through a subject's file: doc_to_choice a YAML "
        "list, doc_to_target the feature `answer` (an int)",
        MMLU_DOCS,
    ),
    (
        "boolq",
        "super_glue/boolq/default.yaml",
        "YAML list choices, the feature `label` as target",
        [
            {
                "question": "do iran and afghanistan speak the same language",
                "passage": "Persian (/ˈpɜːrʒən/), also known by its endonym Farsi (فارسی fārsi), is "
                "a Western Iranian language.",
                "idx": 0,
                "label": 1,
            },
            {
                "question": "is the café open on sundays",
                "passage": "Café Müller — opening hours: Mon–Sat.\n",
                "idx": 1,
                "label": 0,
            },
        ],
    ),
    ("gsm8k", "gsm8k/gsm8k.yaml", "generation: the target is the whole answer text", GSM8K_DOCS),
    (
        "gsm8k_cot_zeroshot",
        "gsm8k/gsm8k-cot-zeroshot.yaml",
        "generation, zero-shot chain of thought",
        GSM8K_DOCS[:1],
    ),
    (
        "gsm8k_cot",
        "gsm8k/gsm8k-cot.yaml",
        "`answer.split('####')[-1].strip() if answer is defined else target`; the last "
        "document is the YAML's second few-shot sample (question, target)",
        GSM8K_DOCS[1:],  # the first fewshot_config sample is appended at run time
    ),
    (
        "triviaqa",
        "triviaqa/default.yaml",
        "the target renders a list of aliases, which `literal_eval` makes a list",
        [
            {
                "question": "Which Lloyd Webber musical premiered in the US on 10th December 1993",
                "question_id": "tc_33",
                "question_source": "http://www.triviacountry.com/",
                "entity_pages": {"doc_source": [], "filename": [], "title": [], "wiki_context": []},
                "search_results": {
                    "description": [],
                    "filename": [],
                    "rank": [],
                    "title": [],
                    "url": [],
                    "search_context": [],
                },
                "answer": {
                    "aliases": ["Sunset Blvd", "Sunset Boulevard", "Sunset Blvd."],
                    "normalized_aliases": ["sunset blvd", "sunset boulevard"],
                    "matched_wiki_entity_name": "",
                    "normalized_matched_wiki_entity_name": "",
                    "normalized_value": "sunset boulevard",
                    "type": "WikipediaEntity",
                    "value": "Sunset Boulevard",
                },
            },
            {
                "question": "Which Swiss city hosts FIFA's headquarters",
                "question_id": "qz_1042",
                "question_source": "http://www.quizballs.com/",
                "entity_pages": {"doc_source": [], "filename": [], "title": [], "wiki_context": []},
                "search_results": {
                    "description": [],
                    "filename": [],
                    "rank": [],
                    "title": [],
                    "url": [],
                    "search_context": [],
                },
                "answer": {
                    "aliases": ["Zürich", "Zurich", "O'Neill's \"Züri\"", "Zürich\\CH"],
                    "normalized_aliases": ["zürich", "zurich"],
                    "matched_wiki_entity_name": "",
                    "normalized_matched_wiki_entity_name": "",
                    "normalized_value": "zürich",
                    "type": "WikipediaEntity",
                    "value": "Zürich",
                },
            },
        ],
    ),
    (
        "nq_open",
        "nq_open/nq_open.yaml",
        "the target renders the answer list, which `literal_eval` makes a list",
        [
            {"question": "where did they film hot tub time machine", "answer": ["Fernie Alpine Resort"]},
            {"question": "who sang \"it's a man's man's world\"", "answer": ["James Brown", "Brown's “band”"]},
        ],
    ),
    (
        "lambada_openai",
        "lambada/lambada_openai.yaml",
        "`text.split(' ')[:-1]|join(' ')` and `' '+text.split(' ')[-1]`: single spaces only",
        [
            {"text": "She looked at the café  menu and ordered a crème brûlée"},
            {"text": "He ended the sentence with a space "},
            {"text": "oneword"},
            {"text": "line one\nline two\tand a tab"},
        ],
    ),
    (
        "wmt16-de-en",
        "translation/wmt16_de-en.yaml",
        "translation: a dict feature indexed by a quoted key; the target starts with a space",
        [
            {"translation": {"de": "Die Katze saß auf der Matte – schön, oder?", "en": "The cat sat on the mat – nice, right?"}},
            {"translation": {"de": "Größe: „groß“", "en": 'Size: "large"'}},
        ],
    ),
    (
        "commonsense_qa",
        "commonsense_qa/default.yaml",
        "`choices['text'][4]`; the target is the feature `answerKey` (a letter, returned as it is)",
        [
            {
                "id": "075e483d21c29a511267ef62bedc0461",
                "question": "The sanctions against the school were a punishing blow, and they seemed "
                "to what?",
                "question_concept": "punishing",
                "choices": {
                    "label": ["A", "B", "C", "D", "E"],
                    "text": ["ignore", "enforce", "authoritarian", "yell at", "avoid"],
                },
                "answerKey": "A",
            },
            {
                "id": "61fe6e879ff18686d7552425a36344c8",
                "question": " Where would you put a crème caramel? ",
                "question_concept": "crème caramel",
                "choices": {
                    "label": ["A", "B", "C", "D", "E"],
                    "text": ["fridge", "oven", "the chef's bag", "café", "東京"],
                },
                "answerKey": "A",
            },
        ],
    ),
    (
        "social_iqa",
        "siqa/siqa.yaml",
        "a list literal of three features as choices; target `(label|int) - 1` from a string label",
        [
            {
                "context": "Cameron decided to have a barbecue and gathered her friends together.",
                "question": "How would Others feel as a result?",
                "answerA": "like attending",
                "answerB": "like staying home",
                "answerC": "a good friend to have",
                "label": "1",
            },
            {
                "context": "Zoë couldn't find her keys, so she asked Li for help.",
                "question": "What will Li want to do next?",
                "answerA": 'say "no"',
                "answerB": "help look for them",
                "answerC": "leave for 東京",
                "label": "2",
            },
        ],
    ),
    (
        "french_bench_vocab",
        "french_bench/french_bench_vocab.yaml",
        "a list literal of `.replace()` calls as choices, `[...].index('answer' + answer)` as "
        "target, a plain text doc_to_text (only the fields the templates read)",
        [
            {
                "question": "Le chat <...> sur le tapis.",
                "answerA": "dort",
                "answerB": "mange",
                "answerC": "l'arbre",
                "answerD": "éléphant",
                "answer": "A",
            },
            {
                "question": "Il a « <...> » la porte.",
                "answerA": "ouvert",
                "answerB": "fermé",
                "answerC": "peint",
                "answerD": 'dit "non" à',
                "answer": "C",
            },
        ],
    ),
    (
        "french_bench_fquadv2_bool",
        "french_bench/french_bench_fquadv2_bool.yaml",
        "`[False, True].index(is_impossible)` on a bool feature (only the fields the templates read)",
        [
            {"context": "La tour Eiffel mesure 330 m.", "question": "Combien mesure la tour ?", "is_impossible": False},
            {"context": "Le café ouvre à 8 h.", "question": "Qui l'a fondé ?", "is_impossible": True},
        ],
    ),
    (
        "hellaswag",
        "hellaswag/hellaswag.yaml",
        "documents after its process_docs (Python: lm_eval.tasks.hellaswag.utils.process_docs, "
        "run here): the target renders the string label, digits that become an int; "
        "doc_to_choice the feature `choices`",
        None,  # made at run time from HELLASWAG_RAW
    ),
    (
        "bigbench_strategyqa_multiple_choice",
        "bigbench/multiple_choice/strategyqa.yaml",
        "bigbench/multiple_choice_template_b_yaml (its process_docs only filters): doc_to_text "
        "the feature `inputs`, target `multiple_choice_targets.index(targets[0])`",
        [
            {
                "idx": 0,
                "inputs": "Q: Could a llama birth twice during the War in Vietnam (1945-46)?\nA:",
                "targets": ["No. So the answer is no."],
                "multiple_choice_targets": ["Yes. So the answer is yes.", "No. So the answer is no."],
                "multiple_choice_scores": [0, 1],
            },
            {
                "idx": 1,
                "inputs": "Q: Is “naïve” spelled with a diaeresis?\nA:",
                "targets": ["Yes."],
                "multiple_choice_targets": ["Yes.", "No."],
                "multiple_choice_scores": [1, 0],
            },
        ],
    ),
    (
        "mmlu_flan_cot_zeroshot_abstract_algebra",
        "mmlu/flan_cot_zeroshot/mmlu_abstract_algebra.yaml",
        "mmlu/flan_cot_zeroshot/_mmlu_flan_cot_zeroshot_template_yaml through a subject's file: "
        "a list literal indexed by the int feature `answer`",
        MMLU_DOCS[:2],
    ),
    ("logiqa", "logiqa/logiqa.yaml", "", None),
    ("logiqa2", "logiqa2/logiqa2.yaml", "", None),
    ("winogrande", "winogrande/default.yaml", "", None),
]

# ---------------------------------------------------------------------------------------------
# Hand-made cases: (name, why, settings, documents).

TRICKY_STRINGS = [
    {"a": "it's", "b": 'say "hi"'},
    {"a": "both ' and \"", "b": "back\\slash"},
    {"a": "new\nline\ttab\rcr", "b": "naïve 東京 😀"},
    {"a": "\xa0nbsp\u200bzwsp\x1besc\x7fdel", "b": ""},
]

HAND_CASES = [
    (
        "scalars",
        "Jinja2 prints Python's str(): True/False/None, shortest-repr floats with exponents "
        "from 1e16 and below 1e-4, negative ints",
        {
            "doc_to_text": "{{ flag }}|{{ nothing }}|{{ n }}|{{ neg }}|{{ f1 }}|{{ f2 }}|{{ f3 }}|{{ f4 }}",
            "doc_to_target": "{{ true }} {{ false }} {{ none }} {{ True }} {{ None }} {{ 1.0 }} "
            "{{ 0.1 }} {{ 1e20 }} {{ 1e-7 }} {{ -3 }} {{ 0.1 + 0.2 }} {{ 2**64 }} {{ -0.0 }}",
        },
        [
            {"flag": True, "nothing": None, "n": 3, "neg": -12, "f1": 1.0, "f2": 0.1, "f3": 1e20, "f4": 1e-7},
            {"flag": False, "nothing": None, "n": 0, "neg": -1, "f1": 1e15, "f2": 1e16, "f3": 1e-4, "f4": 1e-5},
            {"flag": True, "nothing": None, "n": 2**53 + 1, "neg": -(2**63), "f1": 123456789.125, "f2": 2.5, "f3": 3.0, "f4": -1.5e-10},
        ],
    ),
    (
        "arithmetic",
        "/ gives a float, // and % floor toward minus infinity, ** and %-formatting; a zero "
        "divisor raises",
        {
            "doc_to_text": "{{ a / b }} {{ a // b }} {{ a % b }} {{ -a // b }} {{ a ** 2 }} {{ a * 1.5 }}",
            "doc_to_target": "{{ '%d' % a }}|{{ '%05.2f' % x }}|{{ '%s=%r' % (s, s) }}|{{ '%x' % a }}|{{ '%d' % x }}",
        },
        [
            {"a": 7, "b": 2, "x": 3.14159, "s": "é'"},
            {"a": -7, "b": 3, "x": -0.5, "s": 'q"'},
            {"a": 9, "b": 0, "x": 2.675, "s": "\n"},
        ],
    ),
    (
        "list_repr_text",
        "a list printed inside text is Python's repr (quote choice, escapes, non-printables); "
        "as a target it starts with [ and ends with ] so literal_eval gives the list back",
        {"doc_to_text": "Choices: {{ [a, b] }}", "doc_to_target": "{{ [a, b] }}"},
        TRICKY_STRINGS,
    ),
    (
        "list_repr_choice",
        "the same lists as doc_to_choice: literal_eval of the repr",
        {"doc_to_text": "{{ a }}", "doc_to_target": 0, "doc_to_choice": "{{ [a, b] }}"},
        TRICKY_STRINGS,
    ),
    (
        "list_repr_values",
        "a list feature of mixed values printed in text and literal_eval'd as choices",
        {"doc_to_text": "{{ nums }} / {{ nums|join(', ') }}", "doc_to_target": "{{ nums[0] }}", "doc_to_choice": "{{ nums }}"},
        [
            {"nums": [1, -2, 2.5, 1e20, True, None]},
            {"nums": [[1, 2], ["a", ["b"]], [], {"k": "v"}]},
            {"nums": [0.1, -1e-7, 1e16, 0.30000000000000004]},
            {"nums": ["x"]},
        ],
    ),
    (
        "choice_literals",
        "list, nested list, tuple and number literals in a template as choices",
        {
            "doc_to_text": "{{ (1, x) }} {{ [x] + [1] }} {{ [[1, 2], [x]] }}",
            "doc_to_target": "{{ (1, x) }}",
            "doc_to_choice": "{{ [1, 2.5, -3, [x, [4]]] }}",
        },
        [{"x": "é"}, {"x": "it's"}],
    ),
    (
        "choice_tuple",
        "a rendered tuple as doc_to_choice stays a tuple",
        {"doc_to_text": "{{ x }}", "doc_to_target": "{{ x }}", "doc_to_choice": "{{ (x, 1) }}"},
        [{"x": "a"}, {"x": "東京"}],
    ),
    (
        "dict_render",
        "a dict printed is Python's repr; as doc_to_choice literal_eval gives a dict; a "
        "dictsort'ed dict is a list of tuples",
        {
            "doc_to_text": "{{ {'a': 1, 'b': [x]} }} {{ d }}",
            "doc_to_target": "{{ d|dictsort }}",
            "doc_to_choice": "{{ {'a': 1, 'b': x} }}",
        },
        [
            {"x": "é", "d": {"z": 1, "a": None}},
            {"x": "it's", "d": {"k'": "v\"", "東": [1.5]}},
        ],
    ),
    (
        "choice_yaml_dict",
        "doc_to_choice a YAML mapping: lm-eval takes its values",
        {"doc_to_text": "{{ q }}", "doc_to_target": "{{ ans }}", "doc_to_choice": {"A": "yes", "B": "no", "C": "maybe"}},
        [{"q": "Is it?", "ans": "1"}, {"q": "Vraiment ?", "ans": "B"}],
    ),
    (
        "choice_yaml_list_mixed",
        "doc_to_choice a YAML list of mixed scalars, returned as it is",
        {"doc_to_text": "{{ q }}", "doc_to_target": "{{ ans }}", "doc_to_choice": [1, 2.5, "x", True]},
        [{"q": "a", "ans": "0"}, {"q": "b", "ans": "02"}],
    ),
    (
        "choice_feature",
        "doc_to_choice a feature name: the feature as it is, even a string",
        {"doc_to_text": "{{ q }}", "doc_to_target": "{{ gold }}", "doc_to_choice": "options"},
        [
            {"q": "x", "options": ["a", "b"], "gold": 1},
            {"q": "y", "options": "abc", "gold": "0"},
            {"q": "z", "options": [1, [2]], "gold": "[1]"},
        ],
    ),
    (
        "choice_not_literal",
        "a doc_to_choice rendering that is not a Python literal raises; leading blanks and "
        "newlines are accepted",
        {"doc_to_text": "{{ s }}", "doc_to_target": "0", "doc_to_choice": "{{ s }}"},
        [{"s": "hello"}, {"s": "hello world"}, {"s": "  ['ok']"}, {"s": "\n[1]\n"}],
    ),
    (
        "choice_not_literal_2",
        "more doc_to_choice renderings: an empty text, an int, a string literal",
        {"doc_to_text": "{{ s }}", "doc_to_target": "0", "doc_to_choice": "{{ s }}"},
        [{"s": ""}, {"s": "3"}, {"s": "'abc'"}, {"s": "[1, 2"}],
    ),
    (
        "choice_empty_list",
        "doc_to_choice an empty YAML list still counts as set: digits text becomes an int",
        {"doc_to_text": "{{ n }}", "doc_to_target": "{{ n }}", "doc_to_choice": []},
        [{"n": 5}, {"n": "x"}],
    ),
    (
        "text_digits_with_choice",
        "a doc_to_text rendering digits with doc_to_choice set is literal_eval'd: an int "
        "(multiple input); leading zeros raise",
        {"doc_to_text": "{{ n }}", "doc_to_target": "0", "doc_to_choice": ["a", "b", "c", "d"]},
        [{"n": 3}, {"n": "12"}, {"n": "007"}, {"n": "0"}],
    ),
    (
        "text_unicode_digits_with_choice",
        "str.isdigit is true for superscripts, Arabic-Indic, fullwidth and circled digits, "
        "which literal_eval rejects; signs and blanks are not digits",
        {"doc_to_text": "{{ n }}", "doc_to_target": "{{ n }}", "doc_to_choice": ["a", "b"]},
        [{"n": "²"}, {"n": "٣"}, {"n": "３"}, {"n": "①"}],
    ),
    (
        "text_not_digits_with_choice",
        "negative numbers, blanks, a trailing newline and floats are not isdigit: text stays",
        {"doc_to_text": "{{ n }}", "doc_to_target": "{{ n }}", "doc_to_choice": ["a", "b"]},
        [{"n": -1}, {"n": " 3"}, {"n": "3\n"}, {"n": 1.0}],
    ),
    (
        "text_digits_without_choice",
        "without doc_to_choice digits stay text",
        {"doc_to_text": "{{ n }}", "doc_to_target": "{{ n }}"},
        [{"n": 3}, {"n": "007"}, {"n": "²"}],
    ),
    (
        "text_plain_007_with_choice",
        "doc_to_text the plain text 007 (not a feature): literal_eval raises",
        {"doc_to_text": "007", "doc_to_target": "12", "doc_to_choice": ["a", "b"]},
        [{"q": "x"}],
    ),
    (
        "text_plain_007_without_choice",
        "doc_to_text the plain text 007 without doc_to_choice; target 12 stays text",
        {"doc_to_text": "007", "doc_to_target": "12"},
        [{"q": "x"}],
    ),
    (
        "text_plain_12_with_choice",
        "plain digits doc_to_text with doc_to_choice: an int; a target of plain digits: an int",
        {"doc_to_text": "12", "doc_to_target": "12", "doc_to_choice": ["a", "b"]},
        [{"q": "x"}],
    ),
    (
        "text_feature_raw",
        "doc_to_text and doc_to_target feature names return the feature as it is",
        {"doc_to_text": "n", "doc_to_target": "t"},
        [
            {"n": 5, "t": "x"},
            {"n": [1, "a"], "t": 3},
            {"n": "12", "t": ["a", "b"]},
            {"n": None, "t": True},
        ],
    ),
    (
        "text_feature_raw_with_choice",
        "feature names are returned as they are with doc_to_choice set too (no digits rule)",
        {"doc_to_text": "n", "doc_to_target": "t", "doc_to_choice": "c"},
        [{"n": "12", "t": "1", "c": ["a", "b"]}, {"n": 1, "t": 0, "c": ["a", "b"]}],
    ),
    (
        "target_digits_with_choice",
        "a target rendering digits with doc_to_choice: an int",
        {"doc_to_text": "q", "doc_to_target": "{{ t }}", "doc_to_choice": ["a", "b"]},
        [{"q": "x", "t": "12"}, {"q": "x", "t": 3}, {"q": "x", "t": "007"}, {"q": "x", "t": "1.5"}],
    ),
    (
        "target_digits_without_choice",
        "a target rendering digits without doc_to_choice stays text",
        {"doc_to_text": "q", "doc_to_target": "{{ t }}"},
        [{"q": "x", "t": "12"}, {"q": "x", "t": 3}, {"q": "x", "t": "007"}],
    ),
    (
        "target_brackets",
        "a target [ ... ] is literal_eval'd; SyntaxError or ValueError keeps the text",
        {"doc_to_text": "q", "doc_to_target": "{{ t }}"},
        [{"q": "x", "t": "[1, 2]"}, {"q": "x", "t": "[not python]"}, {"q": "x", "t": "[]"}, {"q": "x", "t": "[x]"}],
    ),
    (
        "target_brackets_2",
        "more [ ... ] targets: quotes, unclosed, a lone bracket, True/None",
        {"doc_to_text": "q", "doc_to_target": "{{ t }}"},
        [
            {"q": "x", "t": "['a', \"b\"]"},
            {"q": "x", "t": "[1, 2"},
            {"q": "x", "t": "["},
            {"q": "x", "t": "[True, None, -1.5]"},
        ],
    ),
    (
        "target_brackets_with_choice",
        "[ ... ] targets with doc_to_choice set; a trailing newline stops the rule",
        {"doc_to_text": "q", "doc_to_target": "{{ t }}", "doc_to_choice": ["a", "b"]},
        [{"q": "x", "t": "[1, 2]"}, {"q": "x", "t": "[0]\n"}, {"q": "x", "t": "[(1, 2)]"}],
    ),
    (
        "setting_int_and_list",
        "doc_to_text an int and doc_to_target a list are returned as they are",
        {"doc_to_text": 1, "doc_to_target": ["a", "b"], "doc_to_choice": ["x", "y"]},
        [{"q": "x"}],
    ),
    (
        "setting_bad_types",
        "doc_to_text a list, doc_to_target a dict, doc_to_choice an int: TypeError",
        {"doc_to_text": ["a"], "doc_to_target": {"a": 1}, "doc_to_choice": 3},
        [{"q": "x"}],
    ),
    (
        "setting_absent",
        "no doc_to_text and no doc_to_target: TypeError",
        {},
        [{"q": "x"}],
    ),
    (
        "undefined_errors",
        "StrictUndefined: a missing variable, a missing attribute or key, and an index out "
        "of range raise UndefinedError when printed",
        {"doc_to_text": "{{ nope }}", "doc_to_target": "{{ d.nope }}", "doc_to_choice": "{{ l[5] }}"},
        [{"d": {"a": 1}, "l": [1]}],
    ),
    (
        "undefined_in_list",
        "an undefined value inside a list literal prints as Undefined without raising (its "
        "repr); literal_eval then rejects the text",
        {"doc_to_text": "{{ [nope] }}", "doc_to_target": "{{ [d.nope, 1] }}", "doc_to_choice": "{{ [d['nope']] }}"},
        [{"d": {"a": 1}}],
    ),
    (
        "undefined_tests",
        "`is defined`, `default`, and `if` on a missing variable (raises)",
        {
            "doc_to_text": "{{ nope is defined }}|{{ d is defined }}|{{ nope|default('dflt') }}|{{ d.a|default(0) }}",
            "doc_to_target": "{% if nope %}x{% endif %}",
        },
        [{"d": {"a": 1}}],
    ),
    (
        "syntax_errors",
        "template syntax errors raise TemplateSyntaxError",
        {"doc_to_text": "{{ q ", "doc_to_target": "{% if %}x{% endif %}", "doc_to_choice": "{{ [q }}"},
        [{"q": "x"}],
    ),
    (
        "trailing_newline",
        "keep_trailing_newline: a template's final newline(s) are kept",
        {"doc_to_text": "Q: {{q}}\n", "doc_to_target": "\n{{q}}\n\n"},
        [{"q": "x"}, {"q": "東京\n"}],
    ),
    (
        "whitespace_control",
        "{%- -%} strips blanks and newlines around a tag; without it (no trim_blocks) the "
        "newline after a block tag stays",
        {
            "doc_to_text": "A {%- if q %} {{ q }} {% endif -%}  B\n{% for c in choices -%}\n {{ c }}\n{%- endfor %}",
            "doc_to_target": "{% if q %}\nX\n{% endif %}\nY{# a comment #}  ",
        },
        [{"q": "x", "choices": ["a", "b"]}, {"q": "", "choices": []}],
    ),
    (
        "for_loop",
        "loop.index, loop.index0, loop.first, loop.last, loop.length; an empty loop",
        {
            "doc_to_text": "{% for c in choices %}{{ loop.index }}. {{ c }}\n{% endfor %}Answer:",
            "doc_to_target": "{% for c in choices %}{% if not loop.first %}, {% endif %}{{ loop.index0 }}={{ c }}"
            "{% if loop.last %} ({{ loop.length }}){% endif %}{% endfor %}",
            "doc_to_choice": "{{ choices }}",
        },
        [{"choices": ["a", "b", "c"]}, {"choices": []}, {"choices": ["東京"]}],
    ),
    (
        "range_and_else",
        "range(), for-else, and range(...)|list as target (a [ ... ] text, so a list)",
        {
            "doc_to_text": "{% for i in range(n) %}{{ i }}{% else %}none{% endfor %}|{{ range(1, n, 2)|list|length }}",
            "doc_to_target": "{{ range(n)|list }}",
        },
        [{"n": 3}, {"n": 0}],
    ),
    (
        "filters_text",
        "join, upper, lower, trim (Unicode blanks), length (code points), replace, first, last",
        {
            "doc_to_text": "{{ choices|join(', ') }}|{{ q|upper }}|{{ q|lower }}|{{ pad|trim }}|"
            "{{ choices|length }}|{{ q|length }}|{{ q|replace('a', 'A') }}|{{ choices|first }}|"
            "{{ choices|last }}|{{ q|first }}",
            "doc_to_target": "{{ nums|join(', ') }}|{{ nums|join }}|{{ pad|trim('. ') }}",
        },
        [
            {"q": "straße naïve o'neil-smith", "pad": "\xa0 x. \u3000\n", "choices": ["a", "b", "c"], "nums": [1, 2.5, None]},
            {"q": "ǆemal İstanbul ﬁx 😀", "pad": "  .y.", "choices": ["東京"], "nums": []},
        ],
    ),
    (
        "filters_convert",
        "int (Python int(): underscores, blanks, Unicode digits; else via float; else 0), "
        "float, string, round, abs",
        {
            "doc_to_text": "{{ s|int }}|{{ s|float }}|{{ n|string }}|{{ n|float }}|{{ x|int }}|{{ x|round }}|{{ x|abs }}",
            "doc_to_target": "{{ [s|int, n|string, x|round(1)] }}",
        },
        [
            {"s": "3.7", "n": 5, "x": -2.55},
            {"s": "abc", "n": -2, "x": 2.5},
            {"s": "1_000", "n": 0, "x": 1e20},
            {"s": " ٣٤ ", "n": 7, "x": 0.5},
        ],
    ),
    (
        "filters_case",
        "Jinja2's title and capitalize filters against str.title() and str.capitalize()",
        {
            "doc_to_text": "{{ q|title }}|{{ q.title() }}|{{ q|capitalize }}|{{ q.capitalize() }}",
            "doc_to_target": "{{ q.upper() }}|{{ q.lower() }}|{{ q.swapcase() }}",
        },
        [{"q": "hello o'neil-smith (x) [y]"}, {"q": "ǆemal İSTANBUL straße ﬁx"}, {"q": "ÉCOLE à 2pm"}],
    ),
    (
        "filters_more",
        "sum, sort, unique, reverse, map(attribute) and map(filter), list of a string, "
        "regex_replace (lm-eval's filter: Python re.sub), tojson (HTML-safe, ASCII), e (escape)",
        {
            "doc_to_text": "{{ nums|sum }}|{{ nums|sort|list }}|{{ words|unique|list }}|{{ words|reverse|list }}|"
            "{{ words|map('upper')|join('+') }}|{{ 'ab'|list }}",
            "doc_to_target": "{{ q|regex_replace('\\\\s+', ' ') }}|{{ q|regex_replace('(\\\\w+)', '<\\\\1>', 1) }}|"
            "{{ d|tojson }}|{{ q|e }}",
        },
        [
            {"nums": [3, 1, 2], "words": ["b", "a", "b"], "q": "naïve  café\t<x> & y", "d": {"b": "<é>", "a": 1}},
            {"nums": [0.5, -1], "words": [], "q": "", "d": {}},
        ],
    ),
    (
        "indexing",
        "negative indexing, slicing by code points, a step, indexing a string",
        {
            "doc_to_text": "{{ choices[-1] }}|{{ choices[0] }}|{{ q[:5] }}|{{ q[-3:] }}|{{ q[::2] }}|{{ q[1] }}|{{ choices[1:] }}",
            "doc_to_target": "{{ choices[-1] }}",
        },
        [{"q": "naïve 😀 café", "choices": ["a", "b", "c"]}, {"q": "ab", "choices": ["x"]}],
    ),
    (
        "string_methods_strip_split",
        "strip/lstrip/rstrip (Unicode blanks, and with characters), split() on Unicode blanks, "
        "split(sep), split('####')[-1]",
        {
            "doc_to_text": "[{{ q.strip() }}]|[{{ q.lstrip() }}]|[{{ q.rstrip() }}]|{{ q.split() }}|"
            "{{ q.strip(' .') }}|{{ q.split(' ') }}",
            "doc_to_target": "{{ answer.split('####')[-1] }}|{{ answer.split('####')[-1].strip() }}|{{ answer.split('####') }}",
        },
        [
            {"q": " \t a\xa0b\u3000c. \n", "answer": "work\n#### 72"},
            {"q": "x", "answer": "no hashes"},
            {"q": "", "answer": "a #### b ####c"},
        ],
    ),
    (
        "string_methods_other",
        "replace, startswith/endswith, count, find, zfill, isdigit/isnumeric/isdecimal/isalpha",
        {
            "doc_to_text": "{{ q.replace(' ', '_') }}|{{ q.startswith('na') }}|{{ q.endswith(('x', 'é')) }}|"
            "{{ q.count('a') }}|{{ q.find('café') }}|{{ n.zfill(4) }}|{{ n.isdigit() }}|"
            "{{ n.isnumeric() }}|{{ n.isdecimal() }}|{{ q.isalpha() }}",
            "doc_to_target": "{{ q.replace('a', 'A', 1) }}",
        },
        [{"q": "naïve café", "n": "²"}, {"q": "x", "n": "٣"}, {"q": "été", "n": "½"}],
    ),
    (
        "index_methods",
        ".index() on a list (ValueError when absent) and on a string (a code-point index); "
        "with doc_to_choice set the text's digits become an int",
        {
            "doc_to_text": "{{ q.index(sub) }}",
            "doc_to_target": "{{ labels.index(key) }}",
            "doc_to_choice": "{{ labels }}",
        },
        [
            {"q": "naïve café", "sub": "café", "labels": ["A", "B", "C"], "key": "C"},
            {"q": "東京 tower", "sub": "tower", "labels": ["1", "2"], "key": "3"},
            {"q": "abc", "sub": "z", "labels": [True, 1], "key": 1},
        ],
    ),
    (
        "format_methods",
        "str.format works (Jinja2's environment is not sandboxed); the format filter",
        {
            "doc_to_text": "{{ '{} and {}'.format(a, b) }}|{{ '{0!r}/{1:.2f}'.format(a, b) }}|{{ '%s-%s'|format(a, b) }}",
            "doc_to_target": "{{ ['{}'.format(a)] }}",
        },
        [{"a": "x", "b": 1.5}, {"a": "it's", "b": -2}],
    ),
    (
        "concatenation",
        "~ stringifies both sides; + adds strings, lists or numbers and raises on str + int",
        {
            "doc_to_text": "{{ a ~ b }}|{{ a ~ n }}|{{ a + b }}|{{ n ~ none }}|{{ l + [n] }}|{{ n + 1.5 }}",
            "doc_to_target": "{{ a + n }}",
        },
        [{"a": "x", "b": "y", "n": 1, "l": ["z"]}, {"a": "", "b": "東京", "n": -2, "l": []}],
    ),
    (
        "tests_and_logic",
        "in / not in, is tests, and/or returning an operand, inline if, comparisons",
        {
            "doc_to_text": "{{ 'a' in choices }}|{{ 'é' in q }}|{{ 'k' in d }}|{{ 1 in nums }}|"
            "{{ q is string }}|{{ n is number }}|{{ n is even }}|{{ 'x' not in q }}",
            "doc_to_target": "{{ q or 'empty' }}|{{ n and q }}|{{ 'yes' if flag else 'no' }}|{{ n > 1 }}|{{ q == 'café' }}",
        },
        [
            {"choices": ["a", "b"], "q": "café", "d": {"k": 1}, "nums": [1.0], "n": 2, "flag": True},
            {"choices": [], "q": "", "d": {}, "nums": [True], "n": 0, "flag": None},
        ],
    ),
    (
        "dict_access",
        "attribute access falls back to items, items() in a loop, keys()/values() as lists",
        {
            "doc_to_text": "{{ d.a }}|{{ d['b'] }}|{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|{{ d|length }}",
            "doc_to_target": "{{ d.values()|list }}",
            "doc_to_choice": "{{ d.keys()|list }}",
        },
        [{"d": {"a": 1, "b": "é"}}, {"d": {"b": [1], "a": None, "c": 0.5}}],
    ),
    (
        "set_and_raw",
        "{% set %}, {% raw %}, a literal {{ in a string, no autoescaping of < > &",
        {
            "doc_to_text": "{% set x = q|upper %}{{ x }}|{% raw %}{{ q }}{% endraw %}|{{ '{{' }}|{{ q }}",
            "doc_to_target": "{{ q }}",
        },
        [{"q": "<b>&amp;</b>"}, {"q": "naïve"}],
    ),
]


def encode(value):
    """A Python value with its type kept: {"str": ...}, {"int": ...}, {"list": [...]}, ..."""
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"an int outside i64 would not read back as an int: {value}")
        return {"int": value}
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"a non-finite float has no JSON form: {value!r}")
        return {"float": value}
    if isinstance(value, str):
        return {"str": value}
    if value is None:
        return {"none": None}
    if isinstance(value, list):
        return {"list": [encode(v) for v in value]}
    if isinstance(value, tuple):
        return {"tuple": [encode(v) for v in value]}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"a dict with non-string keys has no JSON object form: {value!r}")
        return {"dict": {k: encode(v) for k, v in value.items()}}
    raise TypeError(f"no encoding for {type(value).__name__}: {value!r}")


def make_task(name, config):
    """A ConfigurableTask without its __init__ (which would load the dataset): the attributes
    that doc_to_text, doc_to_target and doc_to_choice read."""
    from lm_eval.api.task import ConfigurableTask, TaskConfig

    task = object.__new__(ConfigurableTask)
    task._config = TaskConfig(**{"task": name, **config})
    task.prompt = None
    task.features = []
    return task


def call(method, doc):
    """One of the task's methods on the document: its result, or the exception's class name.
    (doc_to_text prints the setting's type before raising TypeError; that print is dropped.)"""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            result = method(doc)
    except Exception as e:  # noqa: BLE001 - every exception is a result here
        return {"error": type(e).__name__}
    return encode(result)


def run_case(name, why, settings, docs, config=None):
    """A case: its settings, and each document's text, target and (when set) choices."""
    task = make_task(name, config if config is not None else settings)
    case = {"name": name, "why": why}
    for key in SETTINGS:
        if key in settings:
            case[key] = settings[key]
    case["docs"] = []
    for doc in docs:
        task.features = list(doc.keys())
        row = {
            "doc": doc,
            "text": call(task.doc_to_text, doc),
            "target": call(task.doc_to_target, doc),
        }
        if "doc_to_choice" in settings:
            row["choice"] = call(task.doc_to_choice, doc)
        case["docs"].append(row)
    return case


def tasks_dir():
    import lm_eval.tasks

    return os.path.dirname(os.path.abspath(lm_eval.tasks.__file__))


def load_task_config(rel_path):
    """The task's YAML as lm-eval's TaskManager reads it (includes merged; tag, group and
    task_list dropped as its factory drops them), with `!function` values left as the path
    strings lm-eval's loader gives them when not importing."""
    from lm_eval.tasks._yaml_loader import load_yaml

    cfg = load_yaml(os.path.join(tasks_dir(), rel_path), resolve_func=False)
    for key in ("tag", "group", "task_list"):
        cfg.pop(key, None)
    return cfg


def function_fields(cfg, base):
    """The settings that are `!function` (Python code): lm-eval's non-importing loader makes
    them the path base_dir/module.function."""
    return [
        key
        for key in (*SETTINGS, "process_docs")
        if isinstance(cfg.get(key), str) and cfg[key].startswith(base + os.sep)
    ]


def hellaswag_docs():
    """HELLASWAG_RAW through lm-eval's own hellaswag process_docs (datasets.map: the raw
    columns, then query, choices and gold)."""
    from pathlib import Path

    import datasets
    from lm_eval.tasks._yaml_loader import _import_func_in_yml

    datasets.disable_progress_bars()
    process_docs = _import_func_in_yml("utils.process_docs", Path(tasks_dir()) / "hellaswag")
    return [dict(d) for d in process_docs(datasets.Dataset.from_list(HELLASWAG_RAW))]


# WikiText pages (EleutherAI/wikitext_document_level's `page`) that meet every rule of
# lm-eval's wikitext_detokenizer: @-@ @,@ @.@ separators, spaced punctuation, brackets and
# quotes with inner spaces, `= = =` headings, " N ", " 's", "s '", the degree sign, spaces
# around newlines, and text none of it touches.
WIKITEXT_PAGES = [
    " = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : Unrecorded Chronicles ( Japanese : 戦場のヴァルキュリア3 , lit . Valkyria of the Battlefield 3 ) , commonly referred to as Valkyria Chronicles III outside Japan , is a tactical role @-@ playing video game . \n \n = = Gameplay = = \n \n The game 's battle system , the BliTZ system , is carried over directly from Valkyria Chronicles . \n",
    " = = = Reception = = = \n It sold 1 @,@ 024 @,@ 000 copies at 3 @.@ 5 % of N units ; critics ' scores were \" mixed \" and [ 12 ] reviews { braces } said ' fine ' ! Was it ? Yes . \n The temperature was 30 ° C. Players ' guide /' 5/ notes . \n",
    "= = = = Deep heading = = = =\n No rule touches this line , except the comma .\n\n\n",
    "plain text with no tokenized spacing at all",
    " ( nested ( inner ) text ) and \" a quote \" then ' single ' and a lone ' apostrophe",
]


def wikitext_cases():
    """lm-eval's wikitext_detokenizer on each page, and what its process_results counts: the
    words and UTF-8 bytes of the page before detokenization."""
    import re
    from pathlib import Path

    from lm_eval.tasks._yaml_loader import _import_func_in_yml

    detokenize = _import_func_in_yml(
        "preprocess_wikitext.wikitext_detokenizer", Path(tasks_dir()) / "wikitext"
    )
    return [
        {
            "page": page,
            "detokenized": detokenize({"page": page}),
            "words": len(re.split(r"\s+", page)),
            "bytes": len(page.encode("utf-8")),
        }
        for page in WIKITEXT_PAGES
    ]


def make():
    import importlib.metadata

    import jinja2

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    base = tasks_dir()
    fixture = {
        "lm_eval": importlib.metadata.version("lm_eval"),
        "jinja2": jinja2.__version__,
        "skipped": [],
        "cases": [],
        "wikitext": wikitext_cases(),
    }
    for name, rel_path, why, docs in REAL_TASKS:
        cfg = load_task_config(rel_path)
        functions = function_fields(cfg, base)
        settings_functions = [f for f in functions if f in SETTINGS]
        if settings_functions:
            fixture["skipped"].append(
                {
                    "task": cfg.get("task", name),
                    "file": "lm_eval/tasks/" + rel_path,
                    "reason": ", ".join(settings_functions) + " !function (Python code): "
                    + ", ".join(
                        os.path.relpath(cfg[f], base) for f in settings_functions
                    ),
                }
            )
            continue
        if docs is None and name == "hellaswag":
            docs = hellaswag_docs()
        if docs is None:
            raise SystemExit(f"{name}: no documents and nothing that makes it skipped")
        if name == "arc_easy":
            challenge = load_task_config("arc/arc_challenge.yaml")
            assert all(challenge.get(k) == cfg.get(k) for k in SETTINGS), "arc_challenge differs"
        if name == "gsm8k_cot":
            docs = docs + [dict(cfg["fewshot_config"]["samples"][1])]
        assert cfg.get("task") == name, (cfg.get("task"), name)
        assert "class" not in cfg, f"{name} is a Python task class, not a ConfigurableTask"
        settings = {k: cfg[k] for k in SETTINGS if cfg.get(k) is not None}
        fixture["cases"].append(
            run_case(name, "lm_eval/tasks/" + rel_path + ": " + why, settings, docs, config=cfg)
        )
    for name, why, settings, docs in HAND_CASES:
        fixture["cases"].append(run_case(name, why, settings, docs))
    names = [c["name"] for c in fixture["cases"]]
    assert len(names) == len(set(names)), "case names repeat"
    return fixture


def first_difference(a, b, path="$"):
    """The path of the first place where two JSON values differ (types compared too), or None."""
    if type(a) is not type(b):
        return f"{path}: {json.dumps(a, ensure_ascii=False)[:200]} != {json.dumps(b, ensure_ascii=False)[:200]}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            d = first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        return None
    if a != b:
        return f"{path}: {json.dumps(a, ensure_ascii=False)[:200]} != {json.dumps(b, ensure_ascii=False)[:200]}"
    return None


def dumps(fixture):
    """The fixture's text: a line per skipped task, per case's field and per document."""

    def one(value):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

    lines = ["{"]
    for key in ("lm_eval", "jinja2"):
        lines.append(f" {one(key)}: {one(fixture[key])},")
    lines.append(' "skipped": [')
    lines.append(",\n".join("  " + one(s) for s in fixture["skipped"]))
    lines.append(" ],")
    lines.append(' "cases": [')
    cases = []
    for case in fixture["cases"]:
        fields = [f"   {one(k)}: {one(v)}" for k, v in case.items() if k != "docs"]
        docs = ",\n".join("    " + one(d) for d in case["docs"])
        cases.append("  {\n" + ",\n".join(fields) + ',\n   "docs": [\n' + docs + "\n   ]\n  }")
    lines.append(",\n".join(cases))
    lines.append(" ],")
    lines.append(' "wikitext": [')
    lines.append(",\n".join("  " + one(w) for w in fixture["wikitext"]))
    lines.append(" ]")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == fixture
    return text


def main():
    if "--quick" in sys.argv:
        sys.exit(3)
    if "--write" not in sys.argv and "--check" not in sys.argv:
        print(__doc__)
        sys.exit(2)
    fixture = make()
    # Through JSON and back, so that the comparison sees what the file holds.
    fixture = json.loads(dumps(fixture))
    if "--write" in sys.argv:
        text = dumps(fixture)
        with open(FIXTURE, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {FIXTURE} ({len(text.encode('utf-8'))} bytes, {len(fixture['cases'])} cases)")
    else:
        with open(FIXTURE, encoding="utf-8") as f:
            committed = json.load(f)
        difference = first_difference(committed, fixture)
        if difference:
            print(f"the committed fixture differs from lm-eval's: {difference} (committed != lm-eval)")
            sys.exit(1)
        print("the committed fixture is lm-eval's")


if __name__ == "__main__":
    main()
