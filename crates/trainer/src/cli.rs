//! The `headroom` command: [`main_with`] parses the arguments and runs a subcommand. The
//! `headroom` binary calls it with no hooks; a build that links MPI (`crates/trainer-mpi`)
//! passes one that connects the ranks of `train --dist mpi`.

use std::fmt;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::engine::ComputeDevice;
use crate::ladder::{ladder_table, run_ladder, standard_rungs, suggest_fitting};
use crate::model::{Family, FinetuneSpec, ModelConfig, Precision, QuantSpec};
use crate::techniques::{CheckpointChoice, OptimizerChoice, OptimizerPlacement};
use crate::train::{
    train, DataSource, EvalOptions, LrSchedule, MemoryOutputs, StepLog, TrainOptions,
};
use clap::{Args, Parser, Subcommand, ValueEnum};
use headroom_attn::AttentionConfig;
use headroom_mmap_data::{
    BuildSpec, InspectOptions, LlmcFlavor, SynthSpec, TokenFileFormat, TokenType,
};
use headroom_offload::StatePrecision;
use headroom_profiler::MemoryTracker;
use headroom_profiler::{confirm_boundary, search_max_fit, MaxFit, OutOfBudget};
use headroom_tensor::MemoryCategory;

type CliResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// Set when stdout's reader went away (`headroom train | head`): nothing more is printed and a
/// training run stops as if interrupted, then the command exits quietly.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);
/// The first stdout error other than a broken pipe (a full disk under `> file`), reported at
/// exit.
static STDOUT_ERROR: Mutex<Option<std::io::Error>> = Mutex::new(None);
/// Set by SIGINT/SIGTERM and by a closed stdout: the training loop saves and stops.
static STOP: std::sync::LazyLock<Arc<AtomicBool>> =
    std::sync::LazyLock::new(|| Arc::new(AtomicBool::new(false)));

/// Print one line to stdout; a broken pipe stops output (and training) instead of panicking.
fn say_line(args: fmt::Arguments<'_>) {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.write_all(b"\n")) {
        STDOUT_CLOSED.store(true, Ordering::Relaxed);
        STOP.store(true, Ordering::SeqCst);
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            let mut slot = STDOUT_ERROR.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert(e);
        }
    }
}

macro_rules! say {
    () => { say_line(format_args!("")) };
    ($($t:tt)*) => { say_line(format_args!($($t)*)) };
}

/// A line to stderr; a closed stderr is ignored rather than a panic (`eprintln!` would).
macro_rules! esay {
    ($($t:tt)*) => {{
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

#[derive(Parser)]
#[command(
    name = "headroom",
    version,
    about = "Train GPTs that do not fit in memory, and see what each technique saves"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Train the reference GPT (default: `tiny` on the synthetic source, CPU).
    Train(Box<TrainArgs>),
    /// Train the same model under a memory budget with techniques added one at a time.
    Ladder(LadderArgs),
    /// Predict peak memory per category for a config and technique set, without running.
    Estimate(EstimateArgs),
    /// The largest batch that fits a budget for a technique set.
    MaxBatch(MaxBatchArgs),
    /// Make, tokenise or describe token files.
    #[command(subcommand)]
    Data(DataCommand),
    /// Generate text from a checkpoint (headroom's or a Hugging Face model directory).
    Sample(SampleArgs),
    /// The loss of a checkpoint on the leading windows of a token file.
    Eval(Box<EvalArgs>),
    /// Merge a PEFT LoRA adapter into its base model and write a Hugging Face directory
    /// (PEFT's `merge_and_unload()` + `save_pretrained`, the base's tokenizer saved beside).
    Merge(MergeArgs),
    /// Work on checkpoints.
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
    /// What this machine offers: the instruction set and the path each kernel takes on it,
    /// memory, CUDA devices, NVRTC and the MPI build (for bug reports and set-up checks).
    Env,
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// Write a ZeRO checkpoint (one shard per rank) as one ordinary checkpoint: the same
    /// parameters and AdamW moments, for `sample`, `eval`, transformers, or a resume without
    /// --zero.
    Consolidate {
        /// The ZeRO checkpoint: a step directory, or a root (its newest step).
        src: PathBuf,
        /// The checkpoint root to write `step-N` into. Nothing in it is removed; a root that
        /// already holds step N (the source's own root, say) is refused.
        out: PathBuf,
    },
    /// Check a checkpoint without loading it — the checks a resume makes before reading any
    /// weight, then every file's size and checksum against the manifest — and show what it
    /// holds: step, model, the run's settings (what a resume must repeat), data position.
    /// Exits non-zero, naming the first file that disagrees, when anything is wrong.
    Verify {
        /// A step directory, or a root (its newest step).
        path: PathBuf,
        /// Every step under the root, one line each (a damaged one does not stop the others;
        /// the exit status says whether any was).
        #[arg(long)]
        all: bool,
    },
}

#[derive(Args)]
struct EstimateArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Per-rank memory under ZeRO stage 0–3 (data parallel over --ranks; --batch is the global
    /// batch, as for `train --zero`), and with --budget-mib the most layers of this width that
    /// fit per rank.
    #[arg(long, value_name = "STAGE", value_parser = clap::value_parser!(u8).range(0..=3))]
    zero: Option<u8>,
    /// Data-parallel ranks for --zero.
    #[arg(long, default_value_t = 1, requires = "zero")]
    ranks: usize,
}

#[derive(Args)]
struct MergeArgs {
    /// The base model: a Hugging Face directory or a headroom run or checkpoint.
    #[arg(long, value_name = "DIR")]
    base: PathBuf,
    /// The adapter: `adapter_config.json` + `adapter_model.safetensors` (PEFT's format).
    #[arg(long, value_name = "DIR")]
    adapter: PathBuf,
    /// Where to write the merged model (must not exist).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Split the model into safetensors shards of at most this many MiB.
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..))]
    max_shard_mib: Option<u64>,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("prompted").args(["choices", "generate"])))]
#[command(group(clap::ArgGroup::new("templated").args(["choices", "generate", "completions"]).multiple(true)))]
#[command(group(clap::ArgGroup::new("with_presets").args(["choices", "generate", "documents"]).multiple(true)))]
struct EvalArgs {
    /// A headroom run or checkpoint directory, or a Hugging Face model directory.
    #[arg(long, value_name = "DIR")]
    from: PathBuf,
    /// Token file (any mmap-data format); window w is tokens w·SEQ ..= w·SEQ + SEQ.
    #[arg(long, required_unless_present_any = ["choices", "documents", "completions", "generate"])]
    data: Option<PathBuf>,
    /// Multiple-choice questions (JSONL, Parquet or Arrow rows: `context`, `choices`, `gold` as an index, the
    /// choice's text or a list of indices) scored as lm-evaluation-harness scores them: each
    /// choice's log-likelihood after the context; prints acc, acc_norm, acc_bytes and
    /// exact_match with their standard errors. Multiple input (Winogrande): `choices` as
    /// contexts and a `continuation` scored after each, or Winogrande's own `sentence`,
    /// `option1`, `option2`, `answer`. A dataset's own rows (MMLU's `question`, `choices`,
    /// `answer`) are read through --doc-to-text, --doc-to-choice and --doc-to-target. Needs
    /// a tokenizer; --batch, --seq, --batches and --loss-chunk are --data's.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["data", "document_attention"])]
    choices: Option<PathBuf>,
    /// Documents (JSONL: `text`) whose perplexity is measured as lm-evaluation-harness's
    /// `loglikelihood_rolling` measures it (WikiText): each document over windows of the
    /// model's context; prints word perplexity, byte perplexity and bits per byte. Needs a
    /// tokenizer.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["data", "choices", "document_attention"])]
    documents: Option<PathBuf>,
    /// Documents whose target is scored after their context (JSONL, Parquet or Arrow rows, or a
    /// dataset's own through --doc-to-text and --doc-to-target: `context` and `target`,
    /// or `text`, whose last word is the target, as lm-evaluation-harness's LAMBADA splits
    /// it); prints acc (the target is the greedy continuation) and perplexity with lm-eval's
    /// bootstrap standard error. Needs a tokenizer.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["data", "choices", "documents", "document_attention"])]
    completions: Option<PathBuf>,
    /// Documents (JSONL, Parquet or Arrow rows: `context`, and `target` as a text or a list of
    /// texts; `choices` for a multi_choice_regex filter; or a dataset's own rows through
    /// --doc-to-text and --doc-to-target, which --preset sets) answered by
    /// greedy generation as lm-evaluation-harness runs its `generate_until` tasks (GSM8K):
    /// each context continued until --until or --max-gen-toks, the answer taken by
    /// --filters, and exact_match printed per filter with its standard error. Needs a
    /// tokenizer.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["data", "choices", "documents", "completions", "document_attention"])]
    generate: Option<PathBuf>,
    /// With --choices, --completions or --generate: lm-eval's `doc_to_text`, the prompt of
    /// each document: the name of one of its fields, or a Jinja template over them
    /// (`"Question: {{question}}\nAnswer:"`), so that the documents can be a dataset's own
    /// rows (a Hugging Face split, as Parquet, Arrow or JSONL) rather than `context` lines. All
    /// digits (with --doc-to-choice) is lm-eval's multiple input: the gold context's index.
    #[arg(long, value_name = "TEMPLATE", requires = "templated")]
    doc_to_text: Option<String>,
    /// With --choices, --completions or --generate: lm-eval's `doc_to_target`, each
    /// document's answer: a field's name or a template; with --doc-to-choice, all digits is
    /// the right choice's index (`"{{choices.label.index(answerKey)}}"`), and a Python list
    /// (`[0, 2]`) several.
    #[arg(long, value_name = "TEMPLATE", requires = "templated")]
    doc_to_target: Option<String>,
    /// With --choices: lm-eval's `doc_to_choice`, each document's choices: a field's name,
    /// or a template whose text is a Python list (`"{{choices.text}}"`, `"{{[sol1,
    /// sol2]}}"`, `"['A', 'B', 'C', 'D']"`).
    #[arg(long, value_name = "TEMPLATE", requires = "choices")]
    doc_to_choice: Option<String>,
    /// With --choices: a multiple-choice task's settings as lm-eval's YAML writes them, so
    /// that the questions can be its dataset's own rows (a Hugging Face split, as Parquet or
    /// JSONL): `arc_easy`, `arc_challenge`, `boolq`, `commonsense_qa`, `hellaswag` (with its
    /// preprocessing), `openbookqa`, `piqa`, `sciq`, `social_iqa`, `mmlu` or `mmlu_<subject>` (with the subject's
    /// description and first-n examples: give the dev split as --fewshot-file).
    ///
    /// With --generate: a task's settings as lm-eval's YAML writes them: `gsm8k` (its stop
    /// strings, strict-match and flexible-extract filters, exact_match settings and 5
    /// examples), `gsm8k_cot` (eight chain-of-thought examples, greedy), `gsm8k_cot_zeroshot`,
    /// `gsm8k_cot_self_consistency` (its eight chain-of-thought examples, 64
    /// samples per question at temperature 0.2, the first answer and the majority of 64 and
    /// of 8), `gpqa_main_cot_zeroshot` (also `_diamond_`, `_extended_`) or
    /// `mmlu_flan_cot_zeroshot` (or `mmlu_flan_cot_zeroshot_<subject>`, with its
    /// description; zero-shot chain of thought, the answer letter taken by
    /// multi_choice_regex from the documents' `choices`), or a translation task
    /// (`wmt14-en-fr`, `wmt14-fr-en`, `wmt16-de-en`, `wmt16-en-de`, `wmt16-en-ro`,
    /// `wmt16-ro-en`, `iwslt2017-en-ar`, `iwslt2017-ar-en`: one line, BLEU, TER and chrF), or
    /// `triviaqa` or `nq_open` (one line, exact_match in lower case without punctuation); an
    /// option given as well replaces the preset's. A preset's lm-eval doc_to_text and
    /// doc_to_target read the documents that are its dataset's own rows (GSM8K's `question`
    /// and `answer`, WMT's `translation`; not GPQA's, which lm-eval makes in Python), and
    /// leave those with a `context` as they are.
    ///
    /// With --documents: `wikitext` (lm-eval's, on `EleutherAI/wikitext_document_level`'s
    /// rows: each `page` detokenized as its `wikitext_detokenizer` does and scored, its
    /// words and bytes counted before, as its `process_results` counts them).
    #[arg(long, value_name = "TASK", requires = "with_presets")]
    preset: Option<String>,
    /// With --generate: a stop string (lm-eval's `until`; repeat for several) [default:
    /// --fewshot-delimiter, as lm-eval's default]. The tokenizer's end-of-sequence text is
    /// always one.
    #[arg(long, value_name = "TEXT", requires = "generate")]
    until: Vec<String>,
    /// With --generate: the most tokens generated per document (lm-eval's `max_gen_toks`);
    /// the prompt keeps the model's context less these, cut from the left.
    #[arg(long, value_name = "N", requires = "generate", default_value_t = crate::generation::DEFAULT_MAX_GEN_TOKS)]
    max_gen_toks: usize,
    /// With --generate: documents generated together (lm-eval's `--batch_size`), longest
    /// prompts first as lm-eval batches them: their shared prompt start runs once, each row's
    /// own tail is padded on the left, and every decode step reads the weights once for the
    /// whole batch. Each document computes what it computes alone up to the summation order
    /// of the batched products; results are printed and written in document order.
    #[arg(long, value_name = "N", requires = "generate", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    batch_size: u16,
    /// With --generate: generations per document (lm-eval's `repeats`), all seen by the
    /// filters (`majority_vote`, `take_first_k`) [default: 1, or the preset's]. Greedy
    /// repeats are one generation copied.
    #[arg(long, value_name = "N", requires = "generate", value_parser = clap::value_parser!(u16).range(1..))]
    repeats: Option<u16>,
    /// With --generate: sample (`true`) or take the argmax (`false`), lm-eval's
    /// `do_sample` [default: false, or the preset's; unset with a --temperature above 0, the
    /// model's generation_config.json decides, as transformers does].
    #[arg(long, value_name = "BOOL", requires = "generate", action = clap::ArgAction::Set)]
    do_sample: Option<bool>,
    /// With --generate: the sampling temperature (`temperature`) [default: 0, or the
    /// preset's]. Top-k, top-p, min-p and the repetition penalty not given come from the
    /// model's generation_config.json, else transformers' defaults (top-k 50).
    #[arg(long, requires = "generate")]
    temperature: Option<f32>,
    /// With --generate and sampling: keep the K most likely tokens (`top_k`; 0 is no cut).
    #[arg(long, value_name = "K", requires = "generate")]
    top_k: Option<usize>,
    /// With --generate and sampling: nucleus sampling's P (`top_p`), in (0, 1].
    #[arg(long, value_name = "P", requires = "generate")]
    top_p: Option<f32>,
    /// With --generate and sampling: `min_p`, in [0, 1].
    #[arg(long, value_name = "P", requires = "generate")]
    min_p: Option<f32>,
    /// With --generate: the seed of the sampler. Each document's repeat draws from its own
    /// generator seeded from this, the document and the repeat, so the draws do not depend
    /// on --batch-size.
    #[arg(
        long,
        value_name = "SEED",
        requires = "generate",
        default_value_t = 1234
    )]
    seed: u64,
    /// With --generate: the task's `filter_list` as JSON (a file, or the JSON itself), each
    /// filter a name and its steps (`regex` with `regex_pattern`, `group_select`,
    /// `fallback`; `multi_choice_regex` with those and `ignore_case`, `ignore_punctuation`,
    /// `regexes_to_ignore`, over the document's `choices`; `remove_whitespace`,
    /// `lowercase`, `uppercase`; `take_first_k` with `k`,
    /// `majority_vote`; `map` with `mapping_dict` and `default_value`; then `take_first`)
    /// [default: lm-eval's `none`, the whole answer].
    #[arg(long, value_name = "FILE|JSON", requires = "generate")]
    filters: Option<String>,
    /// With --generate: a metric of the filtered answers (lm-eval's `metric_list`; repeat for
    /// several): `exact_match` per document, or over the corpus sacreBLEU's `bleu` (13a
    /// tokens, exponential smoothing), `chrf`, `chrf++` or `ter` against each document's one
    /// target, with lm-eval's bootstrap standard error [default: exact_match, or the
    /// preset's].
    #[arg(long = "metric", value_name = "NAME", requires = "generate")]
    metrics: Vec<String>,
    /// With --generate: exact_match compares in lower case (`ignore_case`).
    #[arg(long, requires = "generate")]
    ignore_case: bool,
    /// With --generate: exact_match ignores ASCII punctuation (`ignore_punctuation`).
    #[arg(long, requires = "generate")]
    ignore_punctuation: bool,
    /// With --generate: exact_match ignores digits (`ignore_numbers`).
    #[arg(long, requires = "generate")]
    ignore_numbers: bool,
    /// With --generate: a Python regex whose matches exact_match removes from the answer and
    /// the target first (`regexes_to_ignore`; repeat for several, applied in order).
    #[arg(long, value_name = "REGEX", requires = "generate")]
    regexes_to_ignore: Vec<String>,
    /// With --choices or --generate: the text between the context and each choice, or
    /// each few-shot example's answer (lm-eval's `target_delimiter`).
    #[arg(long, value_name = "TEXT", default_value = " ", requires = "prompted")]
    target_delimiter: String,
    /// With --choices or --generate: solved questions before each question (lm-eval's `--num_fewshot`),
    /// each its context, the target delimiter, its gold choice and --fewshot-delimiter;
    /// from --fewshot-file, else from the questions themselves (each left out of its own).
    #[arg(long, value_name = "N", requires = "prompted")]
    num_fewshot: Option<usize>,
    /// With --num-fewshot: the questions the examples come from (lm-eval's `fewshot_split`,
    /// such as MMLU's dev split or GSM8K's train split), JSONL as --choices or --generate.
    #[arg(long, value_name = "FILE", requires = "num_fewshot")]
    fewshot_file: Option<PathBuf>,
    /// With --num-fewshot: `random` (lm-eval's default sampler: Python's
    /// `random.Random(--fewshot-seed).sample`, question after question) or `first-n` (the
    /// first N, as MMLU's tasks take them).
    /// [default: random, or the --choices preset's]
    #[arg(long, value_name = "SAMPLER", requires = "num_fewshot")]
    fewshot_sampler: Option<String>,
    /// With --fewshot-sampler random: the seed (lm-eval's `--fewshot_random_seed`).
    #[arg(
        long,
        value_name = "SEED",
        default_value_t = 1234,
        requires = "num_fewshot"
    )]
    fewshot_seed: u64,
    /// With --num-fewshot: the text after each example (lm-eval's `fewshot_delimiter`)
    /// [default: "\n\n", or the preset's].
    #[arg(long, value_name = "TEXT", requires = "num_fewshot")]
    fewshot_delimiter: Option<String>,
    /// With --choices or --generate: text before every context (a task's `description`, such as MMLU's
    /// "The following are multiple choice questions (with answers) about …\n\n").
    #[arg(long, value_name = "TEXT", requires = "prompted")]
    description: Option<String>,
    /// With --choices or --generate: the text each answer starts with (lm-eval's
    /// `gen_prefix`, such as "The best answer is"): the prompt ends with it (as the start of
    /// the assistant's turn under --apply-chat-template) and each few-shot example's answer
    /// begins with it.
    #[arg(long, value_name = "TEXT", requires = "prompted")]
    gen_prefix: Option<String>,
    /// With --choices or --generate: a system prompt before the description (lm-eval's
    /// `--system_instruction`; the system message under --apply-chat-template).
    #[arg(long, value_name = "TEXT", requires = "prompted")]
    system_instruction: Option<String>,
    /// With --choices or --generate: render each prompt with the tokenizer's chat template and its
    /// generation prompt, each choice scored (or the answer generated) right after it (lm-eval's
    /// `--apply_chat_template`: no target delimiter before the choice), as a chat model is
    /// evaluated.
    #[arg(long, requires = "prompted")]
    apply_chat_template: bool,
    /// With --apply-chat-template: each few-shot example as a user and an assistant turn
    /// (lm-eval's `--fewshot_as_multiturn`, its default); `false` writes them all into one
    /// user message.
    #[arg(long, requires = "apply_chat_template", default_value_t = true, action = clap::ArgAction::Set)]
    fewshot_as_multiturn: bool,
    /// With --apply-chat-template: further template variables as a JSON object (lm-eval's
    /// `chat_template_args`, such as `{"enable_thinking": false}`).
    #[arg(long, value_name = "JSON", requires = "apply_chat_template")]
    chat_template_kwargs: Option<String>,
    /// With --choices, --documents, --completions or --generate: each question's
    /// log-likelihoods, greedy flags and metrics, each document's log-likelihood, or each
    /// generation and its filtered answers, as a JSON line in this file (lm-eval's
    /// `--log_samples`).
    #[arg(long, value_name = "FILE", conflicts_with = "data")]
    samples: Option<PathBuf>,
    /// With --choices, --documents, --completions or --generate: `gpt2` or a tokenizer.json [default: the model
    /// directory's, or the checkpoint's]
    #[arg(long, value_name = "gpt2|FILE", conflicts_with = "data")]
    tokenizer: Option<String>,
    /// Windows per batch.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per window, at most the model's context [default: 64, or the context if shorter]
    #[arg(long)]
    seq: Option<usize>,
    /// Batches.
    #[arg(long, default_value_t = 4)]
    batches: usize,
    /// A PEFT LoRA adapter: merged into the weights at fp32, applied unmerged beside a bf16,
    /// fp16 or 4-bit base (PEFT's `PeftModel`, the numerics a QLoRA run trained with).
    #[arg(long, value_name = "DIR")]
    adapter: Option<PathBuf>,
    /// Compute the loss this many token rows at a time, so the f32 logits exist one chunk at
    /// a time, never as a whole `[BATCH, SEQ, vocab]` [default: the rows whose logits fit
    /// 64 MiB]
    #[arg(long, value_name = "ROWS", value_parser = clap::value_parser!(u64).range(1..))]
    loss_chunk: Option<u64>,
    /// Score the windows as packed documents, as `train --document-attention` trains them
    /// (the file's Megatron index, or --document-separator).
    #[arg(long)]
    document_attention: bool,
    /// With --document-attention: each document ends with this token, as in `train`.
    #[arg(long, value_name = "TOKEN", requires = "document_attention")]
    document_separator: Option<u32>,
    #[command(flatten)]
    weights: InferenceArgs,
}

/// `--document-attention` and `--document-separator` as the documents they name.
fn document_boundaries(
    attention: bool,
    separator: Option<u32>,
) -> Option<headroom_mmap_data::DocumentBoundaries> {
    use headroom_mmap_data::DocumentBoundaries::{EndsWith, Index};
    attention.then_some(separator.map_or(Index, EndsWith))
}

/// The f32 logits `headroom eval` holds at once by default (`--loss-chunk`): a batch of 8×2048
/// tokens over Llama 3's 128 256-token vocabulary would otherwise hold 8 GiB of them.
const EVAL_LOGITS_BYTES: u64 = 64 << 20;
/// `headroom eval`'s window length when `--seq` is not given (capped by the model's context).
const EVAL_DEFAULT_SEQ: usize = 64;

#[derive(Args)]
struct SampleArgs {
    /// A headroom run or checkpoint directory, or a Hugging Face model directory.
    #[arg(long, value_name = "DIR")]
    from: PathBuf,
    /// Text to continue (needs a tokenizer), encoded as transformers' `tokenizer(prompt)`
    /// encodes it: with the special tokens the tokenizer adds around a sequence (a Llama
    /// tokenizer's `<s>`; GPT-2's adds none), as `data build --jsonl` encodes prompts.
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Token ids to continue, comma-separated (for a model without a tokenizer).
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// A user message for a chat model to answer: one user turn rendered with the tokenizer's
    /// chat template (`chat_template.jinja` or `tokenizer_config.json` beside it) and the
    /// assistant's turn header, as transformers' `apply_chat_template(…,
    /// add_generation_prompt=True)`; generation stops at the template's end-of-sequence token.
    #[arg(long, value_name = "MESSAGE", conflicts_with_all = ["prompt", "prompt_ids"])]
    chat: Option<String>,
    /// A system message before `--chat`'s user turn (or `--interactive`'s first).
    #[arg(long, value_name = "TEXT")]
    system: Option<String>,
    /// A conversation so far for a chat model to continue: a JSON file holding a list of
    /// messages, or an object as a `data build --jsonl` line (`messages`, and `tools` and
    /// `chat_template_kwargs` if any), rendered with the chat template and the assistant's
    /// turn header; `--chat MESSAGE` then adds a user turn after it. A conversation that ends
    /// with the assistant's message is continued (`--continue-final-message`).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["prompt", "prompt_ids", "system"])]
    conversation: Option<PathBuf>,
    /// The start of the assistant's answer ("prefill"), which the model continues: an
    /// assistant message after `--chat`'s user turn (or the conversation), left open.
    #[arg(long, value_name = "TEXT")]
    prefill: Option<String>,
    /// Chat turn by turn (as `transformers chat`): each line read from standard input is a
    /// user message, answered through the chat template (after `--system`, a `--conversation`
    /// and `--chat`'s first message, if given) and kept in the conversation; an empty input
    /// ends it. Only the answers are printed, without their end-of-turn token.
    #[arg(long, conflicts_with_all = ["prompt", "prompt_ids", "prefill", "continue_final_message"])]
    interactive: bool,
    /// Whether the model continues the conversation's final message rather than starting a
    /// new assistant turn after it (transformers' `continue_final_message`): the text ends
    /// where the message's text ends, without the template's end of turn. Default, as
    /// transformers' text-generation pipeline: true when the final message is the
    /// assistant's.
    #[arg(long, value_name = "BOOL")]
    continue_final_message: Option<bool>,
    /// A Jinja chat template file for `--chat` or `--conversation`, in place of the
    /// tokenizer's.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// Further variables for the chat template, a JSON object (transformers'
    /// `apply_chat_template(**kwargs)`, TRL's `chat_template_kwargs`), such as
    /// `{"enable_thinking": false}`; they replace a `--conversation` file's of the same name.
    #[arg(long, value_name = "JSON")]
    chat_template_kwargs: Option<String>,
    /// New tokens to generate.
    #[arg(long, default_value_t = 100)]
    tokens: usize,
    /// Softmax temperature; 0 is greedy (the argmax after the repetition penalty). The
    /// settings apply in transformers' order: repetition penalty, temperature, top-k, top-p,
    /// min-p. Default 1, or what the model directory's `generation_config.json` sets: with one,
    /// generation starts from transformers' `generate` settings (greedy unless it sets
    /// `do_sample`; sampling at its temperature, top-k (default 50), top-p and min-p), each flag
    /// given replaces its value, and a temperature above 0, a top-k, top-p or min-p samples.
    #[arg(long)]
    temperature: Option<f32>,
    /// Sample among the K most likely tokens only (and any tied with the K-th); 0 is no cut.
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    /// Nucleus sampling: the most likely tokens whose probabilities add up to P, in (0, 1].
    #[arg(long, value_name = "P")]
    top_p: Option<f32>,
    /// Drop tokens less than P times as likely as the most likely one, P in [0, 1].
    #[arg(long, value_name = "P")]
    min_p: Option<f32>,
    /// Divide the logit of every token already in the prompt or the output by R (multiply
    /// when negative), as transformers' `repetition_penalty`; 1 is none, 1.1–1.3 is usual.
    #[arg(long, value_name = "R")]
    repetition_penalty: Option<f32>,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// `gpt2` or a tokenizer.json (default: the tokenizer.json of the model directory or of
    /// the checkpoint's step, which a run from a Hugging Face directory carries; without one,
    /// token ids are printed).
    #[arg(long, value_name = "gpt2|FILE")]
    tokenizer: Option<String>,
    /// Stop once the text holds this string (repeatable), as transformers' `stop_strings`:
    /// after the token that completes it, even when that token runs past the string's end
    /// (the text is printed as generated, that token whole). Needs a tokenizer.
    #[arg(long, value_name = "TEXT")]
    stop: Vec<String>,
    /// Keep generating past the end-of-text tokens (the tokenizer's or chat template's, and
    /// the `eos_token_id`s of the model's `generation_config.json`).
    #[arg(long)]
    ignore_eot: bool,
    /// A PEFT LoRA adapter: merged into the weights at fp32, applied unmerged beside a bf16,
    /// fp16 or 4-bit base (PEFT's `PeftModel`, the numerics a QLoRA run trained with).
    #[arg(long, value_name = "DIR")]
    adapter: Option<PathBuf>,
    #[command(flatten)]
    weights: InferenceArgs,
}

#[derive(Clone, Copy, ValueEnum)]
enum AttentionKind {
    Naive,
    Chunked,
    Flash,
}

/// How `sample` and `eval` hold the weights.
#[derive(Args)]
struct InferenceArgs {
    /// Format of the weights and activations: fp32 as stored, or bf16/fp16 rounded copies
    /// only (half the memory; transformers' `torch_dtype`).
    #[arg(long, value_enum, default_value = "fp32")]
    precision: PrecisionArg,
    /// Hold every block linear in 4 bits (bitsandbytes' `load_in_4bit`): about a quarter of
    /// bf16's bytes for those weights.
    #[arg(long, value_enum)]
    quantize: Option<QuantArg>,
    /// Quantize the 4-bit scales too (bitsandbytes' compress_statistics).
    #[arg(long, requires = "quantize")]
    double_quant: bool,
    /// Weights per 4-bit scale block (a power of two, 32…4096).
    #[arg(long, default_value_t = 64, requires = "quantize")]
    quant_blocksize: usize,
}

impl InferenceArgs {
    /// `weights 44.2 MiB (bf16, block linears nf4), peak 120.3 MiB`: the model's weight bytes
    /// now and the command's tracked peak (loading included).
    fn summary(&self, tracker: &MemoryTracker) -> String {
        let snap = tracker.snapshot();
        let Some(d) = snap.device(headroom_tensor::Device::Cpu) else {
            return String::new();
        };
        let w = self.weights();
        let mut format = match w.precision {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
        .to_owned();
        if let Some(q) = &w.quantize {
            format += &format!(
                ", block linears {}{}",
                q.quant_type,
                if q.double_quant {
                    " + double quant"
                } else {
                    ""
                }
            );
        }
        format!(
            "weights {:.1} MiB ({format}), peak {:.1} MiB",
            mib(d.live[MemoryCategory::Parameters]),
            mib(d.peak_total)
        )
    }

    fn weights(&self) -> crate::sample::InferenceWeights {
        crate::sample::InferenceWeights {
            precision: precision_of(self.precision),
            quantize: self
                .quantize
                .map(|q| quant_spec(q, self.quant_blocksize, self.double_quant)),
        }
    }
}

fn precision_of(p: PrecisionArg) -> Precision {
    match p {
        PrecisionArg::Fp32 => Precision::Fp32,
        PrecisionArg::Bf16 => Precision::Bf16,
        PrecisionArg::Fp16 => Precision::Fp16,
    }
}

fn quant_spec(q: QuantArg, blocksize: usize, double_quant: bool) -> QuantSpec {
    QuantSpec {
        quant_type: match q {
            QuantArg::Nf4 => "nf4",
            QuantArg::Fp4 => "fp4",
        }
        .into(),
        blocksize,
        double_quant,
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum PrecisionArg {
    Fp32,
    Bf16,
    Fp16,
}

#[derive(Clone, Copy, ValueEnum)]
enum ModelPreset {
    /// GPT-2 shape, 2 layers, width 64 (tests, seconds).
    Tiny,
    /// GPT-2 shape, 6 layers, 6 heads, width 384, context 256.
    Small,
    /// GPT-2 124M.
    Gpt2,
    /// Llama shape, 2 layers, 4 query heads over 2 key/value heads, width 64.
    LlamaTiny,
    /// Llama shape of about small's size: 6 layers, 6 heads over 2, width 384, SwiGLU 1024.
    LlamaSmall,
}

impl ModelPreset {
    /// The preset's shape with `vocab`.
    fn config(self, vocab: usize) -> ModelConfig {
        match self {
            ModelPreset::Tiny => ModelConfig::tiny(vocab),
            ModelPreset::Small => ModelConfig::small(vocab),
            ModelPreset::Gpt2 => ModelConfig {
                vocab,
                ..ModelConfig::gpt2()
            },
            ModelPreset::LlamaTiny => ModelConfig::llama_tiny(vocab),
            ModelPreset::LlamaSmall => ModelConfig::llama_small(vocab),
        }
    }

    /// The run defaults of the preset (steps, learning rate, data): tiny's or small's.
    fn defaults(self) -> TrainOptions {
        let mut o = match self {
            ModelPreset::Tiny | ModelPreset::LlamaTiny => TrainOptions::tiny_default(),
            _ => TrainOptions::small_default(),
        };
        let vocab = o.model.vocab;
        o.model = self.config(vocab);
        o
    }

    fn is_tiny(self) -> bool {
        matches!(self, ModelPreset::Tiny | ModelPreset::LlamaTiny)
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum OffloadArg {
    /// Optimizer state on the device.
    None,
    /// Optimizer state (and fp32 masters in bf16/fp16) in host RAM.
    Ram,
    /// Optimizer state in a memory-mapped file (see --offload-file).
    File,
}

#[derive(Clone, Copy, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

/// Model, data and technique options shared by train, estimate and max-batch.
#[derive(Args, Clone)]
struct RunArgs {
    /// Start from a Hugging Face model directory (config.json + safetensors, GPT2LMHeadModel,
    /// LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
    /// SmolLM3ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration's text model,
    /// Olmo2ForCausalLM, Olmo3ForCausalLM, GraniteForCausalLM),
    /// or a headroom run (its newest checkpoint): its shape and weights replace --model and
    /// its size options.
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Model: GPT-2 tiny (tests, seconds), small (6L/6H/384, context 256), gpt2 (124M); or
    /// Llama llama-tiny, llama-small (RMSNorm, rotary, SwiGLU, grouped-query attention).
    #[arg(long, value_enum, default_value = "tiny")]
    model: ModelPreset,
    /// Llama: key/value heads (a divisor of --heads; fewer is grouped-query attention).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Llama: width of the SwiGLU MLP.
    #[arg(long)]
    ffn: Option<usize>,
    /// Llama: base of the rotary embedding.
    #[arg(long)]
    rope_theta: Option<f32>,
    /// Llama: tie the output head to the token embedding.
    #[arg(long)]
    tied_head: bool,
    /// Vocabulary of a model trained from scratch (default: the synthetic source's, or GPT-2's
    /// 50257 for a token file). Use the tokenizer's size for a file `data build --tokenizer`
    /// made; a token at or above it is refused.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    vocab: Option<u64>,
    /// Override the layer count of the preset.
    #[arg(long)]
    layers: Option<usize>,
    /// Override the heads of the preset.
    #[arg(long)]
    heads: Option<usize>,
    /// Override the width of the preset.
    #[arg(long)]
    channels: Option<usize>,
    /// Override the context (longest sequence) of the preset.
    #[arg(long)]
    context: Option<usize>,
    /// Sequences per step.
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per sequence (default: the model's context, 64 for tiny).
    #[arg(long)]
    seq: Option<usize>,
    /// Numeric precision of working weights and activations (fp32 masters either way).
    #[arg(long, value_enum, default_value = "fp32")]
    precision: PrecisionArg,
    /// Attention algorithm.
    #[arg(long, value_enum, default_value = "flash")]
    attention: AttentionKind,
    /// Checkpoint schedule: none, every-K (e.g. every-2), sqrt-n, selective, optimal.
    #[arg(long, default_value = "none")]
    checkpoint: String,
    /// Compute the loss this many token rows at a time (fused head; no `[B,T,V]` logits).
    #[arg(long)]
    loss_chunk: Option<usize>,
    /// Where the optimizer state lives.
    #[arg(long, value_enum, default_value = "none")]
    offload: OffloadArg,
    /// File for --offload file. A run holds it locked: a second run given the same file is
    /// refused, so two runs in one directory need two names.
    #[arg(long, default_value = "optimizer-state.bin")]
    offload_file: PathBuf,
    /// Blockwise 8-bit optimizer moments (about 2 bytes/param instead of 8; small-float codes,
    /// see headroom-offload's `StatePrecision::Float8`).
    #[arg(long)]
    adam_8bit: bool,
    /// Sequences per micro-batch (gradients accumulated exactly, token-weighted).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    micro_batch: Option<u64>,
    /// Device memory budget in MiB: allocations beyond it fail with the tracker's report.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_BUDGET_MIB))]
    budget_mib: Option<u64>,
    /// Train on this token file (any format headroom data inspect recognises: a file, a
    /// directory or a glob of shards) instead of the synthetic source. Several files are one
    /// dataset (every window of each once per epoch); with a weight before each, a blend as
    /// Megatron-LM's --data-path: `--data 0.7 web.bin 0.3 code.bin` draws 70% of the windows
    /// from web.bin and 30% from code.bin, each shuffled through its own epochs (weights need
    /// not sum to 1; a file smaller than its share is repeated).
    #[arg(long, num_args = 1.., allow_negative_numbers = true, value_name = "[WEIGHT] PATH")]
    data: Vec<PathBuf>,
    /// Where to run. cuda (built with the `cuda` feature): bf16 with flash attention only;
    /// masters and AdamW on the GPU unless an offload placement moves them to the host; without
    /// a GPU it fails with the typed "no CUDA device" error.
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    /// LoRA: freeze the base model and train rank-R adapters (PEFT's initialisation; the
    /// checkpoints are PEFT adapter directories). Usually with --init-from.
    #[arg(long, value_name = "R", value_parser = clap::value_parser!(u64).range(1..=65536))]
    lora_rank: Option<u64>,
    /// LoRA's alpha: the update is scaled by alpha/R (alpha/√R with --rslora) [default: 8,
    /// PEFT's].
    #[arg(long, requires = "lora_rank")]
    lora_alpha: Option<f32>,
    /// Modules that get adapters, by PEFT's name-or-suffix rule, comma-separated, or
    /// `all-linear` (every block linear) [default: q_proj,v_proj for Llama, c_attn for GPT-2 —
    /// PEFT's defaults].
    #[arg(
        long,
        value_name = "NAMES",
        value_delimiter = ',',
        requires = "lora_rank"
    )]
    lora_targets: Option<Vec<String>>,
    /// rsLoRA scaling (alpha/√R).
    #[arg(long, requires = "lora_rank")]
    rslora: bool,
    /// Dropout probability on the adapters' input (PEFT's lora_dropout); masks are keyed by
    /// the seed, the step, the micro-batch and the module, so a resume or a recomputation
    /// drops the same elements.
    #[arg(long, value_name = "P", requires = "lora_rank")]
    lora_dropout: Option<f32>,
    /// QLoRA: store every frozen block linear in 4 bits (bitsandbytes' layout).
    #[arg(long, value_enum, requires = "lora_rank")]
    quantize: Option<QuantArg>,
    /// QLoRA: quantize the 4-bit scales too (bitsandbytes' compress_statistics).
    #[arg(long, requires = "quantize")]
    double_quant: bool,
    /// QLoRA: weights per 4-bit scale block (a power of two, 32…4096).
    #[arg(long, default_value_t = 64, requires = "quantize")]
    quant_blocksize: usize,
}

#[derive(Clone, Copy, ValueEnum)]
enum QuantArg {
    /// NormalFloat4 (QLoRA's).
    Nf4,
    /// 4-bit float.
    Fp4,
}

/// The largest `--budget-mib` (2⁴⁴ MiB = 16 EiB would overflow the byte count).
const MAX_BUDGET_MIB: u64 = (u64::MAX >> 20) - 1;

// Per-preset defaults, as `--help` shows them; a test checks them against `TrainOptions`.
const HELP_STEPS: &str = "Optimizer steps [default: 600 for tiny, 20 for small and gpt2]";
const HELP_LR: &str = "Peak learning rate [default: 3e-3 for tiny, 6e-4 for small and gpt2]";
const HELP_WARMUP: &str =
    "Linear warmup steps before the decay [default: 20 for tiny, 2 for small and gpt2]";
const HELP_MIN_LR: &str = "Learning rate at the end of the decay (not with --lr-schedule \
     constant) [default: 0.1 × the peak learning rate]";
const HELP_BETA1: &str = "AdamW's β1, the first moment's decay [default: 0.9]";
const HELP_BETA2: &str = "AdamW's β2, the second moment's decay [default: 0.95, GPT-2/GPT-3 \
     practice as nanoGPT and llm.c; PyTorch's and transformers' default is 0.999]";
const HELP_ADAM_EPS: &str = "AdamW's ε, added to the square root of v [default: 1e-8]";
const HELP_WEIGHT_DECAY: &str =
    "Decoupled weight decay of matrices and embeddings (none on biases and norms) [default: 0.1]";
const HELP_GRAD_CLIP: &str =
    "Clip the global gradient norm to this (inf: no clipping) [default: 1.0]";

/// `--lr-schedule`'s choices.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ScheduleArg {
    /// Half a cosine down to --min-lr (nanoGPT's, llm.c's default)
    Cosine,
    /// A straight line down to --min-lr (the shape of transformers' Trainer's default)
    Linear,
    /// The peak learning rate to the end (llm.c's has no warmup: add --warmup 0)
    Constant,
    /// Warmup-stable-decay: the peak rate until 80% of --steps, then 1 − √t down to --min-lr
    Wsd,
}

impl From<ScheduleArg> for LrSchedule {
    fn from(a: ScheduleArg) -> Self {
        match a {
            ScheduleArg::Cosine => LrSchedule::Cosine,
            ScheduleArg::Linear => LrSchedule::Linear,
            ScheduleArg::Constant => LrSchedule::Constant,
            ScheduleArg::Wsd => LrSchedule::Wsd,
        }
    }
}

#[derive(Parser)]
struct TrainArgs {
    #[command(flatten)]
    run: RunArgs,
    #[arg(long, help = HELP_STEPS)]
    steps: Option<usize>,
    #[arg(long, help = HELP_LR)]
    lr: Option<f64>,
    #[arg(long, help = HELP_WARMUP)]
    warmup: Option<usize>,
    #[arg(long, help = HELP_MIN_LR)]
    min_lr: Option<f64>,
    /// The learning rate after the warmup, as llm.c's schedulers
    #[arg(long, value_enum, default_value_t = ScheduleArg::Cosine)]
    lr_schedule: ScheduleArg,
    #[arg(long, help = HELP_BETA1)]
    beta1: Option<f64>,
    #[arg(long, help = HELP_BETA2)]
    beta2: Option<f64>,
    #[arg(long, help = HELP_ADAM_EPS)]
    adam_eps: Option<f64>,
    #[arg(long, help = HELP_WEIGHT_DECAY)]
    weight_decay: Option<f64>,
    #[arg(long, help = HELP_GRAD_CLIP)]
    grad_clip: Option<f64>,
    /// fp16: the dynamic loss scale never backs off below this [default: no floor, as
    /// PyTorch's GradScaler].
    #[arg(long)]
    min_loss_scale: Option<f32>,
    /// Seed for initialisation and data order.
    #[arg(long)]
    seed: Option<u64>,
    /// LoRA: after training, merge the adapters into the base and write a Hugging Face model
    /// directory here (refused if it exists), with the base's tokenizer and generation config.
    #[arg(long, value_name = "DIR", requires = "lora_rank")]
    merge_into: Option<PathBuf>,
    /// A Hugging Face tokenizer (its tokenizer.json, or the directory) whose files every
    /// checkpoint carries (transformers Trainer's `processing_class`): the one the data was
    /// built with, for `sample --from` and `AutoTokenizer.from_pretrained(step_dir)`. In place
    /// of --init-from's tokenizer files; its ids must fit the model's vocabulary.
    #[arg(long, value_name = "FILE|DIR")]
    tokenizer: Option<PathBuf>,
    /// The token `data build --eos-token` ended the examples with (TRL's `eos_token`): the
    /// checkpoints' tokenizer takes it as its `eos_token`, config.json's `eos_token_id`
    /// becomes its id, and the generation config stops at it too, so sampling ends where the
    /// model learnt to end.
    #[arg(long, value_name = "TOKEN")]
    eos_token: Option<String>,
    /// The Jinja chat template `data build --chat-template` rendered the conversations with
    /// (TRL's `chat_template_path`): it becomes the checkpoints' tokenizer's chat template, in
    /// place of the base's.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// Packed examples train as if padded one per row: each token attends only within its
    /// document, positions restart at each document, and a target that starts one is not
    /// counted (TRL's padding-free packing; Megatron's --reset-attention-mask,
    /// --reset-position-ids and --eod-mask-loss). The documents are those of the data's
    /// Megatron index (`data build --format megatron`), or see --document-separator; on the
    /// CPU only (ZeRO's ranks included).
    #[arg(long)]
    document_attention: bool,
    /// With --document-attention: each document ends with this token and the next begins
    /// after it, instead of the data's index: the end-of-text separator of nanoGPT, llm.c
    /// and `data build` text files (GPT-2's <|endoftext|> is 50256; a Hugging Face
    /// tokenizer's is its EOS id).
    #[arg(long, value_name = "TOKEN", requires = "document_attention")]
    document_separator: Option<u32>,
    /// ZeRO stage 0–3 over --ranks data-parallel ranks (threads of this process): 0 all-reduces
    /// gradients, 1 shards the optimizer state, 2 also the gradients, 3 also the parameters.
    /// --batch is the global batch (each rank runs batch/ranks sequences a step).
    #[arg(long, value_name = "STAGE", value_parser = clap::value_parser!(u8).range(0..=3))]
    zero: Option<u8>,
    /// Data-parallel ranks for --zero.
    #[arg(long, default_value_t = 1, requires = "zero")]
    ranks: usize,
    /// Where the --zero ranks run: threads of this process (--ranks of them), or one per
    /// process of an `mpirun` job (a build without MPI hands the run to the MPI build,
    /// `headroom-mpi` from crates/trainer-mpi, found beside it, on the PATH or in HEADROOM_MPI),
    /// or one per GPU process with NCCL collectives (--device cuda, --nccl-id-file; started by
    /// mpirun, srun or torchrun, whose environment gives each process its rank).
    #[arg(long, value_enum, default_value_t = Dist::Threads, requires = "zero")]
    dist: Dist,
    /// --dist nccl: where rank 0 writes the NCCL communicator's id for the others to read (a
    /// file system every rank sees; it must not exist yet, and rank 0 removes it once every
    /// rank has joined).
    #[arg(long, value_name = "FILE", requires = "zero")]
    nccl_id_file: Option<PathBuf>,
    /// Save checkpoints under this directory (one `step-N` directory each, published
    /// atomically; the run's last step is always saved, and on SIGINT/SIGTERM).
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints (0: only at the end and on a signal).
    #[arg(long, default_value_t = 100)]
    checkpoint_every: usize,
    /// Checkpoints to keep (the newest).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    keep_checkpoints: u64,
    /// Split a checkpoint's model into safetensors shards of at most this many MiB, with
    /// transformers' index (default: transformers' 50 GB).
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..))]
    max_shard_mib: Option<u64>,
    /// Continue bit for bit from a checkpoint: a step directory, or a checkpoint directory
    /// (its newest complete checkpoint).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Stop after this many steps without a final save, as a crash would (the schedule stays
    /// that of --steps).
    #[arg(long)]
    stop_after: Option<usize>,
    /// Write one JSON line of metrics per step to this file (appended to when resuming).
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// No progress bar: print step lines instead (the default when stdout is not a terminal).
    #[arg(long)]
    no_progress: bool,
    /// Print a step line every N steps when there is no progress bar [default: 1].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    log_every: Option<u64>,
    /// Validation token file: a mean loss over fixed windows of it (the same every time).
    /// Several files or a blend as for --data (`--val-data 0.7 web_val.bin 0.3 code_val.bin`:
    /// one loss over windows drawn by the weights, as Megatron-LM blends its validation sets).
    /// Given again, another set with its own loss (`--val-data web_val.bin --val-data
    /// code_val.bin`), and the loss over all of them.
    #[arg(long, num_args = 1.., allow_negative_numbers = true, value_name = "[WEIGHT] PATH")]
    val_data: Vec<PathBuf>,
    /// `--val-data`'s values occurrence by occurrence (clap's derive flattens them into
    /// `val_data`): filled by [`parse_cli`].
    #[arg(skip)]
    val_sets: Vec<Vec<PathBuf>>,
    /// Steps between validations (0: only after the last step).
    #[arg(long, default_value_t = 0)]
    eval_every: usize,
    /// Batches (of the run's batch × seq) in the validation set.
    #[arg(long, default_value_t = 8)]
    eval_batches: usize,
    /// Write the device memory timeline as a Chrome/Perfetto trace (open in ui.perfetto.dev).
    #[arg(long)]
    memory_trace: Option<PathBuf>,
    /// Write the device memory timeline as a stacked SVG plot by category.
    #[arg(long)]
    memory_svg: Option<PathBuf>,
    /// The SVG's x axis: wall time, or allocation event (backward and the peak stay visible).
    #[arg(long, value_enum, default_value = "event")]
    memory_svg_axis: SvgAxis,
    /// Write PyTorch's memory snapshot (pickle; open at pytorch.org/memory_viz).
    #[arg(long)]
    memory_snapshot: Option<PathBuf>,
}

/// Where ZeRO's ranks run.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Dist {
    /// Threads of this process.
    Threads,
    /// One rank per MPI process.
    Mpi,
    /// One rank per GPU process, the collectives on NCCL.
    Nccl,
}

#[derive(Clone, Copy, ValueEnum)]
enum SvgAxis {
    Time,
    Event,
}

#[derive(Parser)]
struct LadderArgs {
    /// Model size.
    #[arg(long, value_enum, default_value = "small")]
    model: ModelPreset,
    /// Device budget in MiB (the wall).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=MAX_BUDGET_MIB))]
    budget_mib: u64,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence (default: the model's context).
    #[arg(long)]
    seq: Option<usize>,
    /// Steps per rung.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Where to run.
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    /// The fine-tuning ladder: full fine-tuning fp32 → bf16 → LoRA → QLoRA (NF4 + double
    /// quantization) → +checkpointing → +fused loss.
    #[arg(long)]
    finetune: bool,
    /// The ZeRO ladder: one process, then stages 1–3 on 2, 4 and 8 in-process ranks at the
    /// same global batch; each rank's peak against the budget and the estimator.
    #[arg(long, conflicts_with = "finetune")]
    zero: bool,
}

#[derive(Parser)]
struct MaxBatchArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Largest batch to consider.
    #[arg(long, default_value_t = 4096)]
    limit: usize,
    /// Confirm the answer (and its neighbour) with real one-step runs under the budget.
    #[arg(long)]
    measure: bool,
}

// Parsed once per run and matched by value: `Build`'s many options cost nothing to keep inline.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum DataCommand {
    /// Write a token file from a random Markov chain (the trainer's synthetic source).
    Synth {
        /// Output file.
        out: PathBuf,
        /// Vocabulary.
        #[arg(long, default_value_t = 64)]
        vocab: u32,
        /// Successors per token.
        #[arg(long, default_value_t = 4)]
        branching: u32,
        /// Tokens to write.
        #[arg(long, default_value_t = 1 << 20)]
        tokens: u64,
        /// Seed (the trainer's default data uses 1337).
        #[arg(long, default_value_t = 1337)]
        seed: u64,
        /// File format: raw-u16, raw-u32, llmc, megatron.
        #[arg(long, default_value = "llmc")]
        format: String,
    },
    /// Tokenise a text file into a token file: one token per byte, or GPT-2's BPE or a
    /// Hugging Face tokenizer.json (`--tokenizer`). With `--tokenizer`, the input may be a
    /// corpus of records: a Parquet file (FineWeb as Hugging Face publishes it), an Arrow file
    /// (a `datasets` cache file or `save_to_disk` shard) or JSON lines (`.jsonl`, or gzip- or
    /// zstd-compressed: Dolma's `.json.gz`, DCLM's `.jsonl.zst`), each record's `text` (or
    /// `--dataset-text-field`) one document, ended by the end-of-text token; and it may be
    /// several files or directories of them (a dataset's shards), read in order as one
    /// stream, written as one file or as shards (`--shard-tokens`).
    Build {
        /// Input text: one file, or with `--tokenizer` several (and directories, each read as
        /// its corpus files in path order, subdirectories included: a Hub dataset's
        /// snapshot), tokenized in the order given.
        #[arg(required = true, num_args = 1..)]
        inputs: Vec<PathBuf>,
        /// Output file; with `--shard-tokens`, the name its shards are numbered after
        /// (`data/fineweb.bin`: `data/fineweb_000000.bin`, …).
        out: PathBuf,
        /// File format: raw-u16, raw-u32, llmc, megatron.
        #[arg(long, default_value = "llmc")]
        format: String,
        /// Document separator in the text (becomes one end-of-text token).
        #[arg(long)]
        separator: Option<String>,
        /// With `--tokenizer`: write shards of N tokens each (the last one shorter) instead of
        /// one file, cut as llm.c's `fineweb.py` cuts them (10^8 there): a document that
        /// straddles a cut continues in the next shard. Shards are named `OUT-STEM_000000.EXT`
        /// on; `train --data 'DIR/STEM_*.bin'` reads them as one dataset. An llm.c file holds
        /// at most 2^31 - 1 tokens, so a larger corpus needs shards. An earlier set of the
        /// same name is removed first, and a build that dies keeps only whole shards.
        #[arg(
            long,
            value_name = "N",
            requires = "tokenizer",
            conflicts_with = "jsonl"
        )]
        shard_tokens: Option<u64>,
        /// With `--shard-tokens`: the first K shards are the validation split, named
        /// `STEM_val_000000` on, and the rest `STEM_train_…` (llm.c's names; its `fineweb.py`
        /// sets aside one shard): `train --data 'DIR/STEM_train_*.bin' --val-data
        /// 'DIR/STEM_val_*.bin'`.
        #[arg(long, value_name = "K", requires = "shard_tokens")]
        val_shards: Option<u64>,
        /// With `--shard-tokens`: continue the build of the same inputs and settings that
        /// died (a crash, a kill, a job's time limit) from its last finished shard, instead of
        /// starting over: the shards are written as one uninterrupted build would have
        /// written them. Its progress is the hidden `.OUT.build.json` beside the shards,
        /// saved at every finished shard and removed when the build completes.
        #[arg(long, requires = "shard_tokens")]
        resume: bool,
        /// With `--tokenizer`: where each document's delimiting token goes: `end` (the
        /// end-of-text token after each document: nanoGPT's prepare.py, Megatron's
        /// --append-eod) or `start` (the tokenizer's beginning-of-sequence token before each
        /// document, as llm.c's fineweb.py writes FineWeb: GPT-2's <|endoftext|>, Llama 3's
        /// <|begin_of_text|>).
        #[arg(
            long,
            value_name = "WHERE",
            default_value = "end",
            requires = "tokenizer",
            conflicts_with = "jsonl"
        )]
        document_token: String,
        /// The input is JSONL examples (plain, or gzip- or zstd-compressed; or a Parquet or Arrow file
        /// of them: a Hugging Face dataset's split, each row read as a line; or several such
        /// files, their examples one after the other) for supervised fine-tuning in TRL's
        /// formats:
        /// prompt-completion lines (`{"prompt": …, "completion": …}`; only the completion
        /// counts in the loss) or `{"text": …}` lines (every token counts), and their
        /// conversational forms (prompt and completion as lists of `{"role", "content"}`
        /// messages, or `{"messages": […]}`), rendered with the tokenizer's chat template
        /// (`chat_template.jinja` or `tokenizer_config.json` beside it). Writes the token file and its loss mask beside
        /// it (`OUT.lossmask`), which `train` and `eval` then apply. Needs `--tokenizer`.
        /// Conversational lines may carry `tools` and `chat_template_kwargs`, which the
        /// template receives, as in TRL.
        #[arg(long, conflicts_with = "separator", requires = "tokenizer")]
        jsonl: bool,
        /// With `--jsonl`: count only the assistant's tokens, those the chat template's
        /// `{% generation %}` blocks write (TRL's `assistant_only_loss`; of a prompt-completion
        /// line, only the completion's). Every line must be conversational.
        #[arg(long, requires = "jsonl")]
        assistant_only_loss: bool,
        /// With `--jsonl`: whether only a prompt-completion line's completion counts (TRL's
        /// `completion_only_loss`, default true); `false` counts the prompt too.
        #[arg(long, requires = "jsonl", default_value_t = true, action = clap::ArgAction::Set)]
        completion_only_loss: bool,
        /// With `--jsonl`: cut each example to at most N tokens and leave out those left with
        /// no counted token (TRL's `max_length`; TRL's default is 1024, headroom's no cut, as
        /// `train --seq` windows the packed examples anyway).
        #[arg(long, value_name = "N", requires = "jsonl")]
        max_length: Option<usize>,
        /// With `--max-length`: keep-start (TRL's default) or keep-end.
        #[arg(
            long,
            value_name = "MODE",
            requires = "max_length",
            default_value = "keep-start"
        )]
        truncation_mode: String,
        /// With `--jsonl`: the key of a language-modelling line's text, in place of `text`
        /// (TRL's `dataset_text_field`, such as `content` of code datasets). With a Parquet or
        /// JSONL corpus and no `--jsonl`: the field each record's document is read from
        /// (default `text`, FineWeb's and Dolma's); naming one reads any file as JSON lines.
        #[arg(long, value_name = "KEY")]
        dataset_text_field: Option<String>,
        /// With `--jsonl`: the token that ends each example, in place of the tokenizer's
        /// `eos_token` (TRL's `eos_token`); chat templates render it as `eos_token` too.
        #[arg(long, value_name = "TOKEN", requires = "jsonl")]
        eos_token: Option<String>,
        /// With `--max-length N`: pad every example to N tokens (never counted), so that
        /// `train --seq N` reads each example alone in its own window from position 0, as
        /// TRL's padded batches: no attention across examples, at the cost of computing the
        /// padding.
        #[arg(long, requires = "max_length")]
        pad: bool,
        /// With `--max-length N --format megatron`: pack whole examples into rows of N tokens
        /// by best-fit decreasing (TRL's `packing=True`, its default `bfd` strategy, in TRL's
        /// row order), each row's room one uncounted padding document, so that `train --seq N
        /// --document-attention` reads one row per window and no example is cut across rows:
        /// TRL's padding-free packed batches. Holds the examples in memory (about 5 bytes a
        /// token) until they are placed.
        #[arg(long, requires = "max_length", conflicts_with = "pad")]
        pack: bool,
        /// With `--pack`: what an example longer than --max-length becomes (TRL's
        /// `packing_strategy`): `bfd` keeps its first --max-length tokens; `bfd_split` splits
        /// it into pieces of --max-length tokens, each packed as an example of its own.
        #[arg(
            long,
            value_name = "STRATEGY",
            default_value = "bfd",
            requires = "pack"
        )]
        packing_strategy: String,
        /// With `--jsonl`: render conversations with this Jinja chat template file instead of
        /// the tokenizer's (TRL's `chat_template_path`), such as a training template with
        /// `{% generation %}` blocks; the special tokens still come from the tokenizer's
        /// `tokenizer_config.json`.
        #[arg(long, value_name = "FILE", requires = "jsonl")]
        chat_template: Option<PathBuf>,
        /// Tokenize with `gpt2` (GPT-2's BPE, built in) or a Hugging Face tokenizer.json (or
        /// a model directory holding one) instead of one token per byte; the format's token
        /// type is chosen to fit its vocabulary (raw: u16 up to 65 536 ids, else u32).
        #[arg(long)]
        tokenizer: Option<String>,
        /// No progress bar.
        #[arg(long)]
        quiet: bool,
    },
    /// Describe a token file: format, dtype, tokens, id range; or a set of shards, a directory
    /// or a glob (quoted: `'data/fineweb_train_*.bin'`) read as `train --data` reads it.
    Inspect {
        /// The file, or a directory or glob of shards.
        path: PathBuf,
        /// Token type of a headerless raw file (guessed when absent).
        #[arg(long)]
        dtype: Option<String>,
        /// Also decode the first N tokens with `--tokenizer`, the targets the loss mask counts
        /// between `[[` and `]]`: what a chat template and `--assistant-only-loss` made of the
        /// examples (TRL users decode their labels for the same check).
        #[arg(long, value_name = "N", requires = "tokenizer")]
        show: Option<usize>,
        /// The tokenizer the file was built with (`gpt2`, or a tokenizer.json or its directory).
        #[arg(long)]
        tokenizer: Option<String>,
        /// With a Parquet or Arrow file (a Hugging Face split, as the Hub serves it or as
        /// `datasets` saved it): print its first N rows as the JSON lines `eval` and
        /// `data build --jsonl` read, to see the fields to name.
        #[arg(long, value_name = "N")]
        rows: Option<usize>,
    },
}

/// `data inspect FILE.parquet` (or `.arrow`): its format and writer, rows, row groups or
/// record batches, and fields (those that cannot be read with why), and with `--rows N` its
/// first N rows as JSON lines.
fn inspect_table(path: &Path, kind: crate::tokenize::CorpusKind, rows: Option<usize>) -> CliResult {
    // Mapped, not read: a `datasets` cache file is often many gigabytes, and only its
    // metadata and the first rows are looked at.
    let bytes = crate::tokenize::map_file(path)?;
    let file = crate::tokenize::table_file(&bytes, kind)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    say!("{:<13}{}", "format", file.describe());
    say!(
        "{:<13}{} in {} {}",
        "rows",
        file.num_rows(),
        file.num_groups(),
        file.groups_name()
    );
    say!("{:<13}{}", "fields", file.fields().join(", "));
    for (_, why) in file.unreadable_fields() {
        say!("{:<13}{why}", "not read");
    }
    if let Some(n) = rows {
        let readable: Vec<String> = file
            .fields()
            .iter()
            .filter(|f| !file.unreadable_fields().iter().any(|(u, _)| u == *f))
            .cloned()
            .collect();
        let options = headroom_parquet::ReadOptions {
            columns: Some(readable),
            ..headroom_parquet::ReadOptions::default()
        };
        let mut shown = 0;
        for g in 0..file.num_groups() {
            if shown == n {
                break;
            }
            let group = file
                .group(g, &options)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            for row in group.into_iter().take(n - shown) {
                say!("{}", serde_json::Value::Object(row));
                shown += 1;
            }
        }
    }
    Ok(())
}

fn model_config(run: &RunArgs, vocab: usize) -> CliResult<ModelConfig> {
    let mut cfg = run.model.config(vocab);
    match &mut cfg.family {
        Family::Llama(shape) => {
            if let Some(k) = run.kv_heads {
                shape.kv_heads = k;
            }
            if let Some(f) = run.ffn {
                shape.ffn = f;
            }
            if let Some(t) = run.rope_theta {
                shape.rope_theta = t;
            }
            shape.tied_head |= run.tied_head;
        }
        Family::Gpt2 => {
            if run.kv_heads.is_some()
                || run.ffn.is_some()
                || run.rope_theta.is_some()
                || run.tied_head
            {
                return Err(
                    "--kv-heads, --ffn, --rope-theta and --tied-head are Llama options: use \
                     --model llama-tiny or llama-small"
                        .into(),
                );
            }
        }
    }
    if let Some(l) = run.layers {
        cfg.layers = l;
    }
    if let Some(h) = run.heads {
        cfg.heads = h;
    }
    if let Some(c) = run.channels {
        cfg.channels = c;
    }
    if let Some(t) = run.context {
        cfg.max_seq = t;
    }
    Ok(cfg)
}

fn parse_checkpoint(s: &str) -> CliResult<CheckpointChoice> {
    Ok(match s {
        "none" => CheckpointChoice::None,
        "sqrt-n" | "sqrt" => CheckpointChoice::SqrtN,
        "selective" => CheckpointChoice::Selective,
        "optimal" => CheckpointChoice::Optimal(None),
        other => match other.strip_prefix("every-").map(str::parse::<usize>) {
            Some(Ok(k)) if k > 0 => CheckpointChoice::EveryK(k),
            _ => {
                return Err(format!(
                "unknown --checkpoint {other:?}: use none, every-K, sqrt-n, selective or optimal"
            )
                .into())
            }
        },
    })
}

/// The compute device: the CPU, or CUDA device 0 after probing it (a machine without a GPU
/// gets the typed "no CUDA device" error here, whatever the build).
fn compute_device(d: DeviceArg) -> CliResult<ComputeDevice> {
    match d {
        DeviceArg::Cpu => Ok(ComputeDevice::Cpu),
        DeviceArg::Cuda => {
            headroom_cuda::Cuda::new(0)?;
            Ok(ComputeDevice::Cuda { ordinal: 0 })
        }
    }
}

/// A step line's validation part: `  val L`, and each set's loss when there are several.
fn val_text(s: &StepLog) -> String {
    match (s.val_loss, s.val_losses.as_slice()) {
        (None, _) => String::new(),
        (Some(v), [] | [_]) => format!("  val {v:.4}"),
        (Some(v), sets) => {
            let sets: Vec<String> = sets.iter().map(|l| format!("{l:.4}")).collect();
            format!("  val {v:.4} [{}]", sets.join(" "))
        }
    }
}

/// A metrics line with each validation set's loss by name (`val_losses`), when the step was
/// evaluated on several sets; as it was otherwise.
fn with_set_losses(
    mut line: serde_json::Value,
    s: &StepLog,
    o: &TrainOptions,
) -> serde_json::Value {
    let sets = o.eval.as_ref().map_or(&[][..], |e| &e.sets[..]);
    if s.val_losses.len() > 1 && s.val_losses.len() == sets.len() {
        let by_name: serde_json::Map<String, serde_json::Value> = sets
            .iter()
            .zip(&s.val_losses)
            .map(|(set, &loss)| (crate::train::data_name(set), serde_json::json!(loss)))
            .collect();
        line["val_losses"] = serde_json::Value::Object(by_name);
    }
    line
}

/// The values of `option` (`--data`, `--val-data`): one path; several paths, one dataset of
/// them all; or Megatron-LM's `WEIGHT PATH WEIGHT PATH …` for a blend. `None` without the
/// option.
fn data_source(values: &[PathBuf], option: &str) -> Result<Option<DataSource>, String> {
    let usage = format!(
        "{option}: several files are paths (one dataset of them all) or weight-path pairs, as \
         Megatron-LM's --data-path: `{option} 0.7 web.bin 0.3 code.bin`"
    );
    let weight = |v: &PathBuf| v.to_str().and_then(|t| t.parse::<f64>().ok());
    match values {
        [] => Ok(None),
        [path] => Ok(Some(DataSource::File(path.clone()))),
        paths if paths.iter().all(|v| weight(v).is_none()) => {
            Ok(Some(DataSource::Files(paths.to_vec())))
        }
        pairs if pairs.len() % 2 == 1 => {
            Err(format!("{usage}; {} values are neither", pairs.len()))
        }
        pairs => {
            let parts = pairs
                .chunks_exact(2)
                .map(|pair| match weight(&pair[0]) {
                    // A directory named 2024 would otherwise be read as a weight in silence.
                    Some(_) if pair[0].exists() => Err(format!(
                        "{option}: `{}` is both a number and a file here: write it as ./{} to \
                         read it as a file",
                        pair[0].display(),
                        pair[0].display()
                    )),
                    Some(w) if w.is_finite() && w > 0.0 => Ok((w, pair[1].clone())),
                    _ => Err(format!(
                        "{usage}; `{}` (before {}) is not a positive weight",
                        pair[0].display(),
                        pair[1].display()
                    )),
                })
                .collect::<Result<Vec<_>, String>>()?;
            Ok(Some(DataSource::Blend(parts)))
        }
    }
}

/// Options for a run from the shared arguments; `probe` checks that a CUDA device exists
/// (not needed to estimate).
fn options(run: &RunArgs, probe: bool) -> CliResult<TrainOptions> {
    let device = if probe {
        compute_device(run.device)?
    } else {
        match run.device {
            DeviceArg::Cpu => ComputeDevice::Cpu,
            DeviceArg::Cuda => ComputeDevice::Cuda { ordinal: 0 },
        }
    };
    let mut o = run.model.defaults();
    o.device = device;
    // A token file may hold any GPT-2-tokenised text: its model gets GPT-2's vocabulary
    // unless --vocab says otherwise.
    if let Some(data) = data_source(&run.data, "--data")? {
        o.data = data;
    }
    let vocab = match (run.vocab, &o.data) {
        (Some(v), _) => usize::try_from(v).map_err(|_| "--vocab is too large")?,
        (None, DataSource::Synthetic(d)) => d.vocab as usize,
        (None, _) => 50257,
    };
    match &run.init_from {
        Some(dir) => {
            let sized = run.vocab.is_some()
                || run.layers.is_some()
                || run.heads.is_some()
                || run.channels.is_some()
                || run.context.is_some()
                || run.kv_heads.is_some()
                || run.ffn.is_some()
                || run.rope_theta.is_some()
                || run.tied_head;
            if sized {
                return Err(
                    "--init-from takes the model's shape from its config.json: drop \
                            --vocab, --layers, --heads, --channels, --context and the Llama size \
                            options"
                        .into(),
                );
            }
            // A headroom run directory stands for its newest checkpoint, as for `--resume`
            // and `sample --from`; anything else is read as given (and its errors say why).
            let dir = if dir.join("config.json").is_file() {
                dir.clone()
            } else {
                crate::checkpoint::resolve(dir).unwrap_or_else(|_| dir.clone())
            };
            let dir = &dir;
            o.model = crate::hf::read_config(dir)?;
            // The synthetic source draws ids below the model's vocabulary.
            if let DataSource::Synthetic(d) = &mut o.data {
                d.vocab = u32::try_from(o.model.vocab).unwrap_or(u32::MAX);
            }
            o.init_from = Some(dir.clone());
            o.seq = run.seq.unwrap_or(o.seq.min(o.model.max_seq));
        }
        None => {
            o.model = model_config(run, vocab)?;
            // A smaller --vocab narrows the synthetic source to it.
            if let DataSource::Synthetic(d) = &mut o.data {
                d.vocab = d
                    .vocab
                    .min(u32::try_from(o.model.vocab).unwrap_or(u32::MAX));
            }
            o.seq = run.seq.unwrap_or(if run.model.is_tiny() {
                o.seq
            } else {
                o.model.max_seq
            });
        }
    }
    if let Some(b) = run.batch {
        o.batch = b;
    }
    let t = &mut o.techniques;
    t.model.precision = precision_of(run.precision);
    t.model.attention = match run.attention {
        AttentionKind::Naive => AttentionConfig::naive(),
        AttentionKind::Chunked => AttentionConfig::chunked(),
        AttentionKind::Flash => AttentionConfig::flash(),
    };
    t.checkpoint = parse_checkpoint(&run.checkpoint)?;
    t.model.loss_chunk = run.loss_chunk;
    t.optimizer = OptimizerChoice {
        state: if run.adam_8bit {
            StatePrecision::Float8
        } else {
            StatePrecision::F32
        },
        placement: match run.offload {
            OffloadArg::None => OptimizerPlacement::Resident,
            OffloadArg::Ram => OptimizerPlacement::HostRam,
            OffloadArg::File => OptimizerPlacement::File(run.offload_file.clone()),
        },
    };
    if let Some(r) = run.lora_rank {
        let r = usize::try_from(r).map_err(|_| "--lora-rank is too large")?;
        let targets = match run.lora_targets.as_deref() {
            // PEFT's keyword for every linear layer but the output head.
            Some([all]) if all == "all-linear" => {
                crate::model::finetune::all_linear_targets(&o.model)
                    .into_iter()
                    .map(String::from)
                    .collect()
            }
            Some(names) => names.to_vec(),
            None => match o.model.family {
                Family::Gpt2 => vec!["c_attn".into()],
                Family::Llama(_) => vec!["q_proj".into(), "v_proj".into()],
            },
        };
        let mut lora = headroom_lora::LoraConfig::new(r, run.lora_alpha.unwrap_or(8.0), targets);
        lora.use_rslora = run.rslora;
        lora.dropout = run.lora_dropout.unwrap_or(0.0);
        lora.base_model_name_or_path = run.init_from.as_ref().map(|d| d.display().to_string());
        t.finetune = Some(FinetuneSpec {
            lora,
            quantize: run
                .quantize
                .map(|q| quant_spec(q, run.quant_blocksize, run.double_quant)),
        });
    }
    t.micro_batch = run
        .micro_batch
        .map(|m| usize::try_from(m).map_err(|_| format!("--micro-batch {m} is too large")))
        .transpose()?;
    o.budget = run.budget_mib.map(mib_to_bytes).transpose()?;
    Ok(o)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// `--budget-mib` in bytes, checked (clap's range already keeps it below 2⁴⁴).
fn mib_to_bytes(m: u64) -> CliResult<u64> {
    m.checked_mul(1 << 20)
        .ok_or_else(|| format!("--budget-mib {m} overflows a byte count").into())
}

/// Stop on SIGINT/SIGTERM: the first sets [`STOP`] (the run saves and returns), a second one
/// exits at once (checkpoints are crash-consistent, so that loses nothing saved). Returns the
/// cell that records which signal arrived.
fn install_signal_handlers() -> CliResult<Arc<AtomicUsize>> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let which = Arc::new(AtomicUsize::new(0));
    for sig in [SIGINT, SIGTERM] {
        // Order matters: the conditional shutdown sees the flag before this signal sets it.
        signal_hook::flag::register_conditional_shutdown(sig, 128 + sig, STOP.clone())?;
        signal_hook::flag::register(sig, STOP.clone())?;
        signal_hook::flag::register_usize(sig, which.clone(), sig as usize)?;
    }
    Ok(which)
}

/// Keep the first failed write of the metrics file (a full disk) in `first`, for the run's
/// final error, and say it at once rather than only when the run ends: training goes on, as
/// the metrics are not what the run is for.
fn metrics_failed(path: &Path, first: &mut Option<std::io::Error>, e: std::io::Error) {
    if first.is_none() {
        let _ = writeln!(
            std::io::stderr(),
            "warning: writing metrics to {} failed ({e}); training goes on, and the run ends \
             with this error",
            path.display()
        );
        *first = Some(e);
    }
}

fn open_metrics(path: &Path, append: bool) -> CliResult<std::io::BufWriter<std::fs::File>> {
    let mut o = std::fs::OpenOptions::new();
    if append {
        o.append(true).create(true);
    } else {
        o.write(true).create(true).truncate(true);
    }
    let f = o
        .open(path)
        .map_err(|e| format!("cannot open metrics file {}: {e}", path.display()))?;
    Ok(std::io::BufWriter::new(f))
}

/// `headroom train --zero S --ranks N` (threads) or `mpirun -n N headroom train --zero S --dist
/// mpi` (processes): a line per step, then each rank's bytes by category and what went
/// through its collective. Under MPI only rank 0 prints (its own row of the table).
#[allow(clippy::too_many_arguments)]
fn cmd_train_zero(
    o: &TrainOptions,
    stage: u8,
    ranks: usize,
    dist: Dist,
    nccl_id_file: Option<&Path>,
    metrics: Option<&Path>,
    hooks: &CliHooks<'_>,
    signal: &AtomicUsize,
) -> CliResult<ExitCode> {
    use crate::zero_train::{train_zero, train_zero_dist, ZeroOptions};
    let stage = headroom_zero::Stage::from_index(stage).map_err(|e| e.to_string())?;
    let zero = ZeroOptions::new(stage, ranks);
    if dist != Dist::Nccl && nccl_id_file.is_some() {
        return Err("--nccl-id-file is for --dist nccl".into());
    }
    let comm = match dist {
        Dist::Threads => None,
        Dist::Mpi => {
            // A build without MPI handed the run over before getting here.
            let connect = hooks
                .mpi
                .ok_or("this headroom was built without MPI (crates/trainer-mpi has it)")?;
            let comm = connect(zero.timeout)?;
            let world = comm.world_size();
            if ranks != 1 && ranks != world {
                return Err(
                    format!("--ranks {ranks}, but the MPI job has {world} processes").into(),
                );
            }
            Some(comm)
        }
        Dist::Nccl => {
            let file = nccl_id_file.ok_or(
                "--dist nccl needs --nccl-id-file FILE: a path every rank sees, where rank 0 \
                 writes the NCCL id",
            )?;
            let comm = crate::zero_train::connect_nccl(o, file, zero.timeout)?;
            let world = comm.world_size();
            if ranks != 1 && ranks != world {
                return Err(format!("--ranks {ranks}, but the job has {world} processes").into());
            }
            Some(comm)
        }
    };
    let (rank, world) = comm
        .as_ref()
        .map_or((0, ranks), |c| (c.rank(), c.world_size()));
    let speak = rank == 0;
    if speak {
        say!(
            "headroom train: {}; global batch {}×{} over {world} ranks{}, {stage}, {} steps; {}; cpu kernels {}",
            o.model.shape_name(),
            o.batch,
            o.seq,
            match dist {
                Dist::Threads => "",
                Dist::Mpi => " (MPI processes)",
                Dist::Nccl => " (GPU processes, NCCL)",
            },
            o.steps,
            o.techniques.describe(),
            headroom_tensor::isa::describe()
        );
        say!("optimizer: {}", o.describe_optimizer());
        if let Some(line) = crate::train::describe_blend(o) {
            say!("{line}");
        }
        if let Some(line) = crate::train::describe_loss_mask(o) {
            say!("{line}");
        }
        if let Some(line) = crate::train::describe_documents(o) {
            say!("{line}");
        }
    }
    let metrics_path = metrics.unwrap_or(Path::new(""));
    let mut metrics = match metrics {
        Some(p) if speak => Some(open_metrics(p, o.resume_from.is_some())?),
        _ => None,
    };
    let mut metrics_err: Option<std::io::Error> = None;
    let log = |s: &StepLog| {
        if let Some(w) = metrics.as_mut() {
            let line = serde_json::json!({
                "step": s.step, "loss": s.loss, "lr": s.lr, "grad_norm": s.grad_norm,
                "seconds": s.seconds, "tokens_per_s": s.tokens_per_s,
                "live_bytes": s.live_bytes, "peak_bytes": s.peak_bytes, "val_loss": s.val_loss,
                "counted_targets": s.counted_targets,
            });
            let line = with_set_losses(line, s, o);
            if let Err(e) = writeln!(w, "{line}").and_then(|()| w.flush()) {
                metrics_failed(metrics_path, &mut metrics_err, e);
            }
        }
        if speak {
            let val = val_text(s);
            say!(
                "step {:>5}  loss {}{val}  {:>6.0} tok/s  largest rank: live {:.1} MiB  peak {:.1} MiB",
                s.step,
                loss_text(s),
                s.tokens_per_s,
                mib(s.live_bytes),
                mib(s.peak_bytes)
            );
        }
    };
    let report = match comm {
        None => train_zero(o, zero, log)?,
        Some(c) => train_zero_dist(o, zero, c, log)?,
    };
    if let Some(e) = metrics_err {
        return Err(format!("writing metrics to {}: {e}", metrics_path.display()).into());
    }
    if report.stopped {
        let done = report.steps.last().map_or(0, |s| s.step + 1);
        let sig = signal.load(Ordering::SeqCst);
        if speak {
            esay!(
                "stopped by signal {sig} after step {done}; {}",
                if o.save.is_some() {
                    "every rank's shard saved"
                } else {
                    "no checkpoint (no --checkpoint-dir)"
                }
            );
        }
        return Ok(ExitCode::from(u8::try_from(128 + sig).unwrap_or(1)));
    }
    if !speak {
        return Ok(ExitCode::SUCCESS);
    }
    let k = report.steps.len().min(20);
    let tail = &report.steps[report.steps.len() - k..];
    let last = tail.iter().map(|s| s.loss as f64).sum::<f64>() / k.max(1) as f64;
    say!("final loss (mean of last {k} steps) {last:.4} nats/token");
    say!("rank  parameters  gradients  optimizer  activations  workspace  peak (MiB)  sent/step (MiB)  host (MiB)");
    for r in &report.ranks {
        // The rank's compute device: the CPU, or its GPU (whose engine is on the host).
        let Some(d) = r.memory.devices.first() else {
            continue;
        };
        let host = r
            .host_memory
            .device(headroom_tensor::Device::Cpu)
            .map_or(0, |h| h.peak_total);
        say!(
            "{:>4}  {:>10.1}  {:>9.1}  {:>9.1}  {:>11.1}  {:>9.1}  {:>10.1}  {:>15.1}  {:>10.1}",
            r.rank,
            mib(d.peak[MemoryCategory::Parameters]),
            mib(d.peak[MemoryCategory::Gradients]),
            mib(d.peak[MemoryCategory::OptimizerState]),
            mib(d.peak[MemoryCategory::Activations]),
            mib(d.peak[MemoryCategory::Workspace]),
            mib(d.peak_total),
            mib(r.last_step_comm.sent_bytes()),
            mib(host)
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn cmd_train(args: TrainArgs, hooks: &CliHooks<'_>) -> CliResult<ExitCode> {
    let mut o = options(&args.run, true)?;
    if let Some(s) = args.steps {
        o.steps = s;
    }
    if let Some(lr) = args.lr {
        o.lr = lr;
    }
    if let Some(w) = args.warmup {
        o.warmup = w;
    }
    if let Some(min_lr) = args.min_lr {
        if args.lr_schedule == ScheduleArg::Constant {
            return Err(
                "--min-lr: the constant schedule does not decay (choose another --lr-schedule)"
                    .into(),
            );
        }
        o.min_lr_frac = min_lr / o.lr;
    }
    o.lr_schedule = args.lr_schedule.into();
    if let Some(b) = args.beta1 {
        o.beta1 = b;
    }
    if let Some(b) = args.beta2 {
        o.beta2 = b;
    }
    if let Some(e) = args.adam_eps {
        o.eps = e;
    }
    if let Some(wd) = args.weight_decay {
        o.weight_decay = wd;
    }
    if let Some(c) = args.grad_clip {
        o.grad_clip = c;
    }
    o.min_loss_scale = args.min_loss_scale;
    if let Some(s) = args.seed {
        o.seed = s;
    }
    if let Some(f) = &mut o.techniques.finetune {
        // PEFT draws A from its own seed; headroom's adapters follow the run's.
        f.lora.seed = o.seed;
    }
    o.merge_into = args.merge_into;
    o.eos_token = args.eos_token;
    o.chat_template = args.chat_template;
    if let Some(path) = args.tokenizer {
        // Refused now, not at the first save after hours of steps.
        if path.as_os_str() == "gpt2" {
            return Err(
                "--tokenizer gpt2: GPT-2's BPE is built in and has no files for a \
                        checkpoint to carry; give a Hugging Face tokenizer.json"
                    .into(),
            );
        }
        let tok = crate::tokenize::Tokenizer::from_name(&path.to_string_lossy())?;
        if tok.vocab_size() > o.model.vocab {
            return Err(format!(
                "--tokenizer {}: {} ids, more than the model's vocabulary of {}",
                path.display(),
                tok.vocab_size(),
                o.model.vocab
            )
            .into());
        }
        crate::companions::Companions::of_tokenizer(&path)?;
        o.tokenizer = Some(path);
    }
    o.documents = document_boundaries(args.document_attention, args.document_separator);
    o.save = args.checkpoint_dir.map(|d| (d, args.checkpoint_every));
    o.keep_checkpoints = usize::try_from(args.keep_checkpoints).unwrap_or(usize::MAX);
    if let Some(mib) = args.max_shard_mib {
        o.max_shard_bytes = mib.saturating_mul(1 << 20);
    }
    o.resume_from = args.resume;
    o.stop_after = args.stop_after;
    // One set per --val-data; all its values as one set when the occurrences are unknown
    // (arguments not parsed by `parse_cli`).
    let occurrences = if args.val_sets.is_empty() && !args.val_data.is_empty() {
        vec![args.val_data.clone()]
    } else {
        args.val_sets.clone()
    };
    let sets = occurrences
        .iter()
        .filter_map(|values| data_source(values, "--val-data").transpose())
        .collect::<Result<Vec<_>, String>>()?;
    o.eval = (!sets.is_empty()).then_some(EvalOptions {
        sets,
        every: args.eval_every,
        batches: args.eval_batches,
    });
    o.memory_outputs = MemoryOutputs {
        trace: args.memory_trace,
        svg: args.memory_svg,
        svg_by_event: matches!(args.memory_svg_axis, SvgAxis::Event),
        snapshot: args.memory_snapshot,
    };
    o.validate()?;
    if let Some(stage) = args.zero {
        let signal = install_signal_handlers()?;
        o.stop = Some(STOP.clone());
        return cmd_train_zero(
            &o,
            stage,
            args.ranks,
            args.dist,
            args.nccl_id_file.as_deref(),
            args.metrics.as_deref(),
            hooks,
            &signal,
        );
    }
    let signal = install_signal_handlers()?;
    o.stop = Some(STOP.clone());
    say!(
        "headroom train: {}, context {}, vocab {}; batch {}×{}, {} steps; {}; cpu kernels {}",
        o.model.shape_name(),
        o.model.max_seq,
        o.model.vocab,
        o.batch,
        o.seq,
        o.steps,
        o.techniques.describe(),
        headroom_tensor::isa::describe()
    );
    say!("optimizer: {}", o.describe_optimizer());
    if let Some(line) = crate::train::describe_blend(&o) {
        say!("{line}");
    }
    if let Some(line) = crate::train::describe_loss_mask(&o) {
        say!("{line}");
    }
    if let Some(line) = crate::train::describe_documents(&o) {
        say!("{line}");
    }
    // A resumed run continues the metrics of the run it resumes.
    let metrics_path = args.metrics.as_deref().unwrap_or(Path::new(""));
    let mut metrics = match &args.metrics {
        Some(p) => Some(open_metrics(p, o.resume_from.is_some())?),
        None => None,
    };
    let total = o.stop_after.map_or(o.steps, |s| s.min(o.steps)) as u64;
    let interactive = std::io::stdout().is_terminal() && std::io::stderr().is_terminal();
    let bar = if args.no_progress || !interactive {
        None
    } else {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30} {pos}/{len} {msg} [{elapsed_precise}<{eta_precise}]",
            )
            .map_err(|e| e.to_string())?,
        );
        Some(b)
    };
    let every = args.log_every.unwrap_or(1) as usize;
    let mut metrics_err: Option<std::io::Error> = None;
    let result = train(&o, |s: &StepLog| {
        if let Some(w) = metrics.as_mut() {
            let line = serde_json::json!({
                "step": s.step, "loss": s.loss, "lr": s.lr, "grad_norm": s.grad_norm,
                "applied": s.applied, "loss_scale": s.loss_scale,
                "block_forwards": s.block_forwards, "seconds": s.seconds,
                "tokens_per_s": s.tokens_per_s, "live_bytes": s.live_bytes,
                "peak_bytes": s.peak_bytes, "val_loss": s.val_loss,
                "counted_targets": s.counted_targets,
            });
            let line = with_set_losses(line, s, &o);
            // Flushed per line: a killed run's file ends at a whole line.
            if let Err(e) = writeln!(w, "{line}").and_then(|()| w.flush()) {
                metrics_failed(metrics_path, &mut metrics_err, e);
            }
        }
        let val = val_text(s);
        let msg = format!(
            "loss {}{val}  {:>6.0} tok/s  live {:.1} MiB  peak {:.1} MiB",
            loss_text(s),
            s.tokens_per_s,
            mib(s.live_bytes),
            mib(s.peak_bytes)
        );
        match &bar {
            Some(b) => {
                b.set_position(s.step as u64 + 1);
                b.set_message(msg);
            }
            None => {
                if s.step.is_multiple_of(every) || s.step + 1 == o.steps || s.val_loss.is_some() {
                    say!("step {:>5}  {msg}", s.step);
                }
            }
        }
    });
    if let Some(b) = bar {
        b.finish();
    }
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            if let Some(oob) = OutOfBudget::find(&e) {
                explain_out_of_budget(&o, oob);
            }
            return Err(e.into());
        }
    };
    if let Some(e) = metrics_err {
        return Err(format!("writing metrics to {}: {e}", metrics_path.display()).into());
    }
    if report.stopped {
        let done = report.steps.last().map_or(0, |s| s.step + 1);
        let saved = match &report.last_checkpoint {
            Some(d) => format!("checkpoint {}", d.display()),
            None => "no checkpoint (no --checkpoint-dir)".into(),
        };
        if STDOUT_CLOSED.load(Ordering::Relaxed) {
            return Ok(ExitCode::SUCCESS);
        }
        let sig = signal.load(Ordering::SeqCst);
        esay!("stopped by signal {sig} after step {done}; {saved}");
        return Ok(ExitCode::from(u8::try_from(128 + sig).unwrap_or(1)));
    }
    let k = report.steps.len().min(20);
    let last = report.final_loss(20);
    match report.entropy_floor {
        Some(floor) => say!(
            "final loss (mean of last {k} steps) {last:.4} nats/token; entropy floor of the source {floor:.4}; gap {:.1}%",
            100.0 * (last - floor) / floor
        ),
        None => say!("final loss (mean of last {k} steps) {last:.4} nats/token"),
    }
    if let Some((v, tokens)) = report.val_loss {
        say!("validation loss {v:.4} nats/token ({tokens} tokens)");
        if report.val_losses.len() > 1 {
            for (name, v, tokens) in &report.val_losses {
                say!("  {name}: {v:.4} nats/token ({tokens} tokens)");
            }
        }
    }
    if let Some(d) = &report.last_checkpoint {
        say!("checkpoint: {}", d.display());
    }
    say!("{}", report.memory_table);
    if let Some(h) = report.host_memory.device(headroom_tensor::Device::Cpu) {
        if h.peak_total > 0 {
            say!(
                "host (offloaded): {:.1} MiB peak (masters {:.1}, optimizer {:.1})",
                mib(h.peak_total),
                mib(h.peak[MemoryCategory::Parameters]),
                mib(h.peak[MemoryCategory::OptimizerState])
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// After an out-of-budget failure: what was live when the tracker refused, and the technique
/// changes the estimator predicts would fit (on stderr, before the error chain).
fn explain_out_of_budget(o: &TrainOptions, oob: &OutOfBudget) {
    esay!("{}", oob.summary(10));
    let Some(budget) = o.budget else { return };
    match suggest_fitting(o, budget) {
        Ok(s) if s.is_empty() => esay!(
            "no single technique change is predicted to fit {:.1} MiB; try a smaller --batch \
             or --seq (headroom max-batch finds the largest)",
            mib(budget)
        ),
        Ok(s) => {
            esay!("predicted to fit {:.1} MiB:", mib(budget));
            for f in s.iter().take(8) {
                esay!(
                    "  {:<50} predicted peak {:>9.1} MiB",
                    f.flags,
                    mib(f.predicted_peak)
                );
            }
        }
        Err(e) => esay!("(no suggestions: {e})"),
    }
    if o.memory_outputs.any() {
        esay!("the memory reports asked for were written up to the failure");
    }
}

fn cmd_ladder(a: LadderArgs) -> CliResult {
    let device = compute_device(a.device)?;
    let mut base = a.model.defaults();
    base.device = device;
    base.batch = a.batch;
    base.seq = a.seq.unwrap_or(base.model.max_seq);
    base.steps = a.steps.max(2);
    let budget = mib_to_bytes(a.budget_mib)?;
    if a.zero {
        // The single-device techniques first (bf16, flash, √n checkpointing, fused loss), so
        // the training state is what remains to shard.
        base.techniques.model.precision = Precision::Bf16;
        base.techniques.model.attention = AttentionConfig::flash();
        base.techniques.model.loss_chunk = Some(128);
        base.techniques.checkpoint = CheckpointChoice::SqrtN;
        return zero_ladder(&base, budget, a.budget_mib);
    }
    let rungs = if a.finetune {
        crate::ladder::finetune_rungs(&base.model)
    } else {
        standard_rungs(base.batch)
    };
    say!(
        "headroom ladder: {} vocab {}, batch {}×{}, {} steps per rung, budget {} MiB",
        base.model.shape_name(),
        base.model.vocab,
        base.batch,
        base.seq,
        base.steps,
        a.budget_mib
    );
    let results = run_ladder(&base, &rungs, budget, |r| {
        say!(
            "  {:<22} peak {:>8.1} MiB (estimate {:>8.1})  step {:.2} s  {}",
            r.name,
            mib(r.peak_total),
            mib(r.estimated_peak),
            r.step_seconds,
            if r.fits { "fits" } else { "does not fit" }
        );
    })?;
    say!();
    say!("{}", ladder_table(&results, budget));
    if let (Some(first), Some(last)) = (results.first(), results.last()) {
        say!(
            "{}: device peak {:.1} MiB vs {:.1} MiB for {}: {:.2}× less",
            last.name,
            mib(last.peak_total),
            mib(first.peak_total),
            first.name,
            first.peak_total as f64 / last.peak_total.max(1) as f64
        );
    }
    Ok(())
}

/// `headroom ladder --zero`.
fn zero_ladder(base: &TrainOptions, budget: u64, budget_mib: u64) -> CliResult {
    use crate::ladder::{run_zero_ladder, zero_ladder_table, zero_rungs};
    say!(
        "headroom ladder --zero: {} vocab {}, global batch {}×{}, {} steps per rung, {} MiB per rank; {}",
        base.model.shape_name(),
        base.model.vocab,
        base.batch,
        base.seq,
        base.steps,
        budget_mib,
        base.techniques.describe()
    );
    let results = run_zero_ladder(base, &zero_rungs(), budget, |r| {
        say!(
            "  {} × {} ranks: per-rank peak {:>8.1} MiB (estimate {:>8.1})  step {:.2} s  {}",
            r.stage,
            r.ranks,
            mib(r.peak_total),
            mib(r.estimate.device_peak),
            r.step_seconds,
            if r.fits { "fits" } else { "does not fit" }
        );
    })?;
    say!();
    say!("{}", zero_ladder_table(&results, budget));
    Ok(())
}

fn cmd_estimate(args: EstimateArgs) -> CliResult {
    let run = args.run;
    let o = options(&run, false)?;
    if let Some(stage) = args.zero {
        return zero_estimate_report(&o, stage, args.ranks);
    }
    o.validate()?;
    let e = crate::train::estimate_with_data(&o, o.micro_batch()?, &o.techniques)?;
    say!(
        "estimate for {} vocab {} ({} parameters), batch {}×{}: {}; for this machine's cpu kernels ({})",
        o.model.shape_name(),
        o.model.vocab,
        e.parameter_count,
        o.batch,
        o.seq,
        o.techniques.describe(),
        headroom_tensor::isa::describe()
    );
    say!("| category | device MiB | host MiB |\n|---|---|---|");
    for c in MemoryCategory::ALL {
        if e.device[c] > 0 || e.host[c] > 0 {
            say!(
                "| {c:?} | {:.1} | {:.1} |",
                mib(e.device[c]),
                mib(e.host[c])
            );
        }
    }
    say!(
        "| total (sum of category peaks) | {:.1} | {:.1} |",
        mib(e.device_total()),
        mib(e.host.total())
    );
    say!("simultaneous device peak: {:.1} MiB", mib(e.device_peak));
    let mut need = e.device_peak;
    if let ComputeDevice::Cuda { .. } = o.device {
        // Nothing runs, so no GPU is needed: the tracker's peak as the CUDA model makes it
        // (Hopper's cuBLASLt workspace), then what the tracker does not see.
        let micro = o.techniques.micro_batch.unwrap_or(o.batch);
        let tracked = crate::estimate::cuda_device_peak(
            &o.model,
            o.seq,
            micro,
            o.batch,
            &o.techniques,
            crate::estimate::CUBLASLT_WORKSPACE_HOPPER,
        )?;
        need = tracked + CUDA_CONTEXT_BYTES;
        // The stream-ordered pool rounds each allocation up to 2 MiB pages at worst.
        let rounding = need / 20;
        need += rounding;
        say!(
            "CUDA (no GPU probed): tracked peak {:.1} MiB (parameter state and the head's \
             buffers the CUDA model's, exact; a block's the CPU model's, with cuBLASLt's \
             {:.0} MiB workspace), + allowances: CUDA context {:.0} MiB, allocator rounding \
             {:.1} MiB (5%) = {:.1} MiB",
            mib(tracked),
            mib(crate::estimate::CUBLASLT_WORKSPACE_HOPPER),
            mib(CUDA_CONTEXT_BYTES),
            mib(rounding),
            mib(need)
        );
        if let Err(e) = crate::estimate::cuda_runs(&o.model, &o.techniques.model) {
            say!("note: train --device cuda refuses this run: {e}");
        }
    }
    if let Some(b) = o.budget {
        say!(
            "budget {:.1} MiB: {}",
            mib(b),
            if need <= b { "fits" } else { "does not fit" }
        );
    }
    Ok(())
}

fn zero_estimate_report(o: &TrainOptions, stage: u8, ranks: usize) -> CliResult {
    use crate::zero_estimate::largest_fitting_depth;
    use crate::zero_train::ZeroOptions;
    use headroom_zero::Stage;
    let stage = [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3][usize::from(stage)];
    // The run's own checks and split: --batch is the global batch, as for `train --zero`.
    let (e, micro) = crate::zero_train::estimate_run(o, &ZeroOptions::new(stage, ranks))?;
    let per_rank = o.batch / ranks;
    say!(
        "{stage} over {ranks} ranks, per rank: {} vocab {} ({} parameters), \
         batch {}×{} per rank in micro-batches of {micro} (global batch {}): {}",
        o.model.shape_name(),
        o.model.vocab,
        e.parameter_count,
        per_rank,
        o.seq,
        o.batch,
        o.techniques.describe()
    );
    say!("| per rank | kept between steps, MiB | peak, MiB |\n|---|---|---|");
    let rows = [
        ("parameters", MemoryCategory::Parameters, e.state.parameters),
        ("gradients", MemoryCategory::Gradients, e.state.gradients),
        (
            "optimizer state (+ fp32 masters)",
            MemoryCategory::OptimizerState,
            e.state.optimizer_state,
        ),
        ("activations", MemoryCategory::Activations, 0),
        ("workspace", MemoryCategory::Workspace, 0),
        ("batch", MemoryCategory::Data, 0),
    ];
    for (name, c, kept) in rows {
        say!("| {name} | {:.1} | {:.1} |", mib(kept), mib(e.device[c]));
    }
    say!(
        "| the categories' peaks added | | {:.1} |",
        mib(e.per_rank_peak())
    );
    say!(
        "| **simultaneous peak** (bound: every transient at each moment) | | {:.1} |",
        mib(e.device_peak)
    );
    if e.host.total() > 0 {
        say!(
            "| on the host (ZeRO-Offload: optimizer shard and fp32 masters) | | {:.1} |",
            mib(e.host.total())
        );
    }
    if let Some(b) = o.budget {
        say!(
            "budget {:.1} MiB per rank: {}",
            mib(b),
            if e.device_peak <= b {
                "fits"
            } else {
                "does not fit"
            }
        );
        match largest_fitting_depth(
            &o.model,
            o.seq,
            micro,
            per_rank,
            &o.techniques,
            stage,
            ranks,
            b,
        )? {
            Some((layers, best)) => say!(
                "largest model of this width that fits: {layers} layers, {} parameters \
                 ({:.1} MiB per rank)",
                best.parameter_count,
                mib(best.device_peak)
            ),
            None => say!("not even one layer of this width fits"),
        }
    }
    Ok(())
}

/// What a CUDA context takes on an H100 with CUDA 12/13 before any allocation (the driver's
/// code, the kernels' modules, the per-thread stacks): about 500 MiB, measured by PyTorch users
/// as the first `torch.cuda.init()`'s `nvidia-smi` delta. An allowance, not a measurement of ours.
const CUDA_CONTEXT_BYTES: u64 = 512 << 20;

fn cmd_max_batch(a: MaxBatchArgs) -> CliResult {
    let o = options(&a.run, a.measure)?;
    let budget = o
        .budget
        .ok_or("max-batch needs --budget-mib (the memory to fit)")?;
    // Accumulating: the batch is the user's, the question is the largest micro-batch that
    // divides it and fits. Otherwise: the largest batch of one micro-batch.
    let accumulating = o.techniques.micro_batch.is_some();
    let what = if accumulating { "micro-batch" } else { "batch" };
    let limit = if accumulating {
        a.limit.min(o.batch)
    } else {
        a.limit
    };
    // Sizes are searched as the k-th valid size, so that a micro-batch search only sees
    // divisors of the batch (the fit is monotone in them).
    let sizes: Vec<usize> = if accumulating {
        (1..=limit).filter(|m| o.batch % m == 0).collect()
    } else {
        (1..=limit).collect()
    };
    if sizes.is_empty() {
        return Err(format!("--limit {} leaves nothing to try", a.limit).into());
    }
    let setup = |size: usize| -> TrainOptions {
        let mut m = o.clone();
        if accumulating {
            m.techniques.micro_batch = Some(size);
        } else {
            m.batch = size;
            m.techniques.micro_batch = None;
        }
        m
    };
    let predicted = |size: usize| -> CliResult<u64> {
        let m = setup(size);
        Ok(crate::train::estimate_with_data(&m, m.micro_batch()?, &m.techniques)?.device_peak)
    };
    let report = search_max_fit(1, sizes.len(), |k| -> CliResult<bool> {
        Ok(predicted(sizes[k - 1])? <= budget)
    })?;
    let describe = o.techniques.describe();
    let estimated = match report.outcome {
        MaxFit::Found { largest_fit, .. } => sizes[largest_fit - 1],
        MaxFit::LimitReached { .. } => {
            say!(
                "every {what} up to the limit {limit} is predicted to fit {:.1} MiB with \
                 {describe}: raise --limit to find the largest",
                mib(budget)
            );
            sizes[sizes.len() - 1]
        }
        MaxFit::NoneFits { .. } => {
            return Err(format!(
                "no {what} fits {:.1} MiB with {describe}: even 1 sequence of {} tokens is \
                 predicted to need {:.1} MiB",
                mib(budget),
                o.seq,
                mib(predicted(1)?)
            )
            .into())
        }
    };
    say!(
        "largest {what} predicted to fit {:.1} MiB: {estimated} × {} tokens, predicted peak \
         {:.1} MiB, with {describe}",
        mib(budget),
        o.seq,
        mib(predicted(estimated)?)
    );
    if !a.measure {
        return Ok(());
    }
    // Measure one step at a time until a fit and the next size's refusal are both seen.
    let start_k = sizes
        .iter()
        .position(|&s| s == estimated)
        .map_or(1, |i| i + 1);
    let check = confirm_boundary(start_k, sizes.len(), 24, |k| -> CliResult<bool> {
        let size = sizes[k - 1];
        let mut m = setup(size);
        m.steps = 1;
        m.check_machine_memory = true;
        let verdict = match train(&m, |_| {}) {
            Ok(r) => {
                let peak = r
                    .memory
                    .device(m.device.tracked())
                    .map_or(0, |d| d.peak_total);
                say!(
                    "  measured {what} {size}: fits (peak {:.1} MiB, predicted {:.1})",
                    mib(peak),
                    mib(predicted(size)?)
                );
                true
            }
            Err(e) if OutOfBudget::find(&e).is_some() => {
                say!("  measured {what} {size}: does not fit (the tracker refused)");
                false
            }
            Err(e) => return Err(e.into()),
        };
        Ok(verdict)
    })?;
    match check.outcome {
        Some(MaxFit::Found {
            largest_fit,
            smallest_refused,
        }) => say!(
            "largest {what} that fits {:.1} MiB, measured: {} ({} does not fit)",
            mib(budget),
            sizes[largest_fit - 1],
            sizes[smallest_refused - 1]
        ),
        Some(MaxFit::LimitReached { .. }) => say!(
            "measured: the limit {} fits; raise --limit to find the largest",
            sizes[sizes.len() - 1]
        ),
        Some(MaxFit::NoneFits { .. }) => {
            return Err(format!("measured: no {what} fits {:.1} MiB", mib(budget)).into())
        }
        None => {
            return Err(format!(
                "the measurements did not converge in {} trials (largest measured fit {:?})",
                check.trials.len(),
                check.largest_fit.map(|k| sizes[k - 1])
            )
            .into())
        }
    }
    Ok(())
}

fn parse_format(s: &str) -> CliResult<TokenFileFormat> {
    Ok(match s {
        "raw-u16" | "nanogpt" => TokenFileFormat::Raw(TokenType::U16),
        "raw-u32" => TokenFileFormat::Raw(TokenType::U32),
        "llmc" => TokenFileFormat::Llmc(LlmcFlavor::Gpt2),
        "megatron" => TokenFileFormat::Megatron {
            token_type: TokenType::U16,
            document_len: 1024,
        },
        other => {
            return Err(
                format!("unknown format {other:?}: use raw-u16, raw-u32, llmc or megatron").into(),
            )
        }
    })
}

fn cmd_data(c: DataCommand) -> CliResult {
    match c {
        DataCommand::Synth {
            out,
            vocab,
            branching,
            tokens,
            seed,
            format,
        } => {
            let spec = SynthSpec {
                vocab,
                branching,
                tokens,
                chain_seed: seed,
                stream_seed: seed ^ 0x5eed,
                format: parse_format(&format)?,
            };
            let s = headroom_mmap_data::synthesize(&spec, &out)?;
            say!("{s}");
        }
        DataCommand::Build {
            inputs,
            out,
            format,
            tokenizer: Some(name),
            quiet,
            jsonl: true,
            assistant_only_loss,
            completion_only_loss,
            chat_template,
            max_length,
            truncation_mode,
            dataset_text_field,
            eos_token,
            pad,
            pack,
            packing_strategy,
            ..
        } => {
            let inputs = crate::tokenize::corpus_inputs(&inputs)?;
            let tok = crate::tokenize::Tokenizer::from_name(&name)?;
            let format = crate::tokenize::format_for(&format, tok.vocab_size())?;
            let options = crate::tokenize::SftOptions {
                assistant_only_loss,
                chat_template: chat_template
                    .map(|file| tok.chat_template_from(&file))
                    .transpose()?,
                count_prompts: !completion_only_loss,
                max_length,
                text_field: dataset_text_field,
                eos_token,
                pad,
                pack: match (pack, packing_strategy.as_str()) {
                    (false, _) => None,
                    (true, "bfd") => Some(crate::tokenize::PackStrategy::Bfd),
                    (true, "bfd_split" | "bfd-split") => {
                        Some(crate::tokenize::PackStrategy::BfdSplit)
                    }
                    (true, other) => {
                        return Err(format!(
                            "--packing-strategy {other}: expected bfd or bfd_split (TRL's \
                             wrapped ignores example boundaries: train without \
                             --document-attention reads any file that way)"
                        )
                        .into())
                    }
                },
                truncation: match truncation_mode.as_str() {
                    "keep-start" | "keep_start" => crate::tokenize::Truncation::KeepStart,
                    "keep-end" | "keep_end" => crate::tokenize::Truncation::KeepEnd,
                    other => {
                        return Err(format!(
                            "--truncation-mode {other}: expected keep-start or keep-end"
                        )
                        .into())
                    }
                },
            };
            let r = crate::tokenize::build_examples(&inputs, &tok, format, &out, !quiet, &options)?;
            for (path, bytes) in &r.files {
                say!("{:<13}{} ({bytes} bytes)", "wrote", path.display());
            }
            say!("{:<13}{}", "format", r.format);
            say!("{:<13}{}", "examples", r.examples);
            say!("{:<13}{}", "tokens", r.tokens);
            let counted = match (assistant_only_loss, completion_only_loss) {
                (true, true) => {
                    "the assistant's turns, of prompt-completion lines the completion's"
                }
                (true, false) => "the assistant's turns",
                (false, true) => "the completions, their ends and whole text or messages examples",
                (false, false) => "every token",
            };
            say!(
                "{:<13}{} ({:.1}%: {counted})",
                "counted",
                r.counted,
                100.0 * r.counted as f64 / r.tokens.max(1) as f64
            );
            if let Some(max) = max_length {
                if options.pack == Some(crate::tokenize::PackStrategy::BfdSplit) {
                    say!(
                        "{:<13}{} examples split into pieces of {max} tokens, each packed as \
                         an example; {} pieces packed with no counted token (as TRL's packing)",
                        "split",
                        r.truncated,
                        r.packed_uncounted
                    );
                } else if pack {
                    say!(
                        "{:<13}{} examples cut to {max} tokens (keep-start, as TRL's packing), \
                         {} packed with no counted token (TRL's packing keeps them)",
                        "truncated",
                        r.truncated,
                        r.packed_uncounted
                    );
                } else {
                    say!(
                        "{:<13}{} examples cut to {max} tokens ({truncation_mode}), {} left out \
                         with no counted token",
                        "truncated",
                        r.truncated,
                        r.dropped
                    );
                }
                if pad {
                    say!(
                        "{:<13}every example to {max} tokens: train with --seq {max} to read \
                         one example per window",
                        "padded"
                    );
                }
                if let Some(p) = r.packed {
                    say!(
                        "{:<13}{} rows of {max} tokens, best-fit decreasing as TRL's bfd ({} \
                         padding tokens, {:.1}%): train with --seq {max} --document-attention \
                         to read one row per window, each example attending only to itself",
                        "packed",
                        p.rows,
                        p.padding,
                        100.0 * p.padding as f64 / (p.rows * max as u64).max(1) as f64
                    );
                }
            }
            if r.stop_token_counted == Some(false) {
                say!(
                    "{:<13}the chat template's generation blocks leave out the assistant's end \
                     of turn, so the model is not trained to stop (TRL warns of the same); put \
                     the end-of-turn token inside {{% generation %}} … {{% endgeneration %}}",
                    "warning"
                );
            }
            if r.boundary_merges > 0 {
                say!(
                    "{:<13}{} examples' prompts merge into their completions' first token, or \
                     their chat template renders the prompt alone differently (the completion \
                     starts where the two tokenisations diverge, as TRL's); end prompts on a \
                     token boundary to avoid it",
                    "note",
                    r.boundary_merges
                );
            }
        }
        DataCommand::Build {
            inputs,
            out,
            format,
            separator,
            tokenizer: Some(name),
            quiet,
            jsonl: false,
            dataset_text_field,
            shard_tokens,
            val_shards,
            document_token,
            resume,
            ..
        } => {
            let tok = crate::tokenize::Tokenizer::from_name(&name)?;
            let format = crate::tokenize::format_for(&format, tok.vocab_size())?;
            let start = std::time::Instant::now();
            let inputs = crate::tokenize::corpus_inputs(&inputs)?;
            let options = crate::tokenize::CorpusOptions {
                separator,
                fields_named: dataset_text_field.is_some(),
                text_field: dataset_text_field,
                document_token: match document_token.as_str() {
                    "end" => crate::tokenize::DocumentToken::End,
                    "start" => crate::tokenize::DocumentToken::Start,
                    other => {
                        return Err(
                            format!("--document-token {other}: expected end or start").into()
                        )
                    }
                },
                sharding: shard_tokens.map(|shard_tokens| {
                    headroom_mmap_data::formats::shards::Sharding {
                        shard_tokens,
                        val_shards: val_shards.unwrap_or(0),
                    }
                }),
                resume,
                stop_after_shards: None,
            };
            let r = crate::tokenize::build_corpus(&inputs, &tok, format, &options, &out, !quiet)?;
            let secs = start.elapsed().as_secs_f64();
            for path in &r.removed {
                say!(
                    "{:<13}{} (an earlier build's shard)",
                    "removed",
                    path.display()
                );
            }
            if resume {
                say!(
                    "{:<13}after the {} shards an earlier run finished",
                    "resumed",
                    r.kept_shards
                );
            }
            // The rows of the byte-level build's summary, and the text and speed. A set of
            // many shards is summed up by its first and last.
            if r.shards.len() > 6 {
                let bytes: u64 = r.files.iter().map(|(_, n)| n).sum();
                say!(
                    "{:<13}{} shards, {} … {} ({bytes} bytes)",
                    "wrote",
                    r.shards.len(),
                    r.shards[0].display(),
                    r.shards[r.shards.len() - 1].display()
                );
            } else {
                for (path, bytes) in &r.files {
                    say!("{:<13}{} ({bytes} bytes)", "wrote", path.display());
                }
            }
            if options.sharding.is_none() {
                if let Some(file) = r.shards.first() {
                    remove_stale_loss_mask(file)?;
                }
            }
            say!("{:<13}{}", "format", r.format);
            say!("{:<13}{}", "tokens", r.tokens);
            say!("{:<13}{}", "documents", r.documents);
            if let Some(s) = options.sharding {
                say!(
                    "{:<13}{} of {} tokens ({} validation), {} cuts inside a document",
                    "shards",
                    r.shards.len(),
                    s.shard_tokens,
                    s.val_shards.min(r.shards.len() as u64),
                    r.cuts_inside_documents
                );
            }
            if inputs.len() > 1 {
                say!("{:<13}{} files", "inputs", inputs.len());
            }
            say!("{:<13}{} ids ({name})", "vocabulary", r.vocab);
            say!(
                "{:<13}{} bytes at {:.2} MB/s",
                "text read",
                r.text_bytes,
                r.text_bytes as f64 / 1e6 / secs.max(1e-9)
            );
        }
        DataCommand::Build {
            inputs,
            out,
            format,
            separator,
            tokenizer: None,
            dataset_text_field,
            ..
        } => {
            let input = one_input(&inputs, "one token per byte (no --tokenizer)")?;
            let kind = crate::tokenize::CorpusKind::of(input, dataset_text_field.is_some())?;
            if kind != crate::tokenize::CorpusKind::Text {
                return Err(
                    "a Parquet, Arrow or JSONL corpus needs --tokenizer: one token per byte \
                            reads a text file"
                        .into(),
                );
            }
            let format = parse_format(&format)?;
            let mut spec = BuildSpec::new(format);
            spec.document_separator = separator.map(String::into_bytes);
            let s = headroom_mmap_data::build_from_text(input, &spec, &out)?;
            remove_stale_loss_mask(&headroom_mmap_data::formats::token_file_path(&out, format))?;
            say!("{s}");
        }
        DataCommand::Inspect { path, rows, .. }
            if path.is_file()
                && matches!(
                    crate::tokenize::CorpusKind::of(&path, false)?,
                    crate::tokenize::CorpusKind::Parquet | crate::tokenize::CorpusKind::Arrow
                ) =>
        {
            let kind = crate::tokenize::CorpusKind::of(&path, false)?;
            inspect_table(&path, kind, rows)?;
        }
        DataCommand::Inspect { rows: Some(_), .. } => {
            return Err(
                "--rows: the file is neither Parquet nor Arrow (token files show --show N \
                 tokens)"
                    .into(),
            );
        }
        DataCommand::Inspect {
            path,
            dtype,
            show,
            tokenizer,
            ..
        } => {
            let mut opts = InspectOptions::default();
            if let Some(d) = dtype {
                opts.raw_token_type = Some(d.parse::<TokenType>()?);
            }
            if let Some(n) = show {
                opts.preview_tokens = n;
            }
            let d = headroom_mmap_data::inspect(&path, &opts)?;
            say!("{d}");
            if let (Some(n), Some(name)) = (show, tokenizer) {
                let tok = crate::tokenize::Tokenizer::from_name(&name)?;
                let mask = match &d.loss_mask {
                    Some((file, _)) => Some(headroom_mmap_data::LossMask::open(file)?),
                    None => None,
                };
                say!(
                    "{:<13}the first {} of {n} tokens{}:",
                    "decoded",
                    d.first_tokens.len(),
                    if mask.is_some() {
                        ", the counted targets between [[ and ]]"
                    } else {
                        ""
                    }
                );
                say!("{}", marked_text(&tok, &d.first_tokens, mask.as_ref())?);
            }
        }
    }
    Ok(())
}

/// `ids` decoded run by run, the runs `mask` counts between `[[` and `]]` (a character split
/// across two runs shows as U+FFFD).
fn marked_text(
    tok: &crate::tokenize::Tokenizer,
    ids: &[u32],
    mask: Option<&headroom_mmap_data::LossMask>,
) -> CliResult<String> {
    let counted = |i: usize| mask.is_some_and(|m| m.get(i).unwrap_or(false));
    let mut text = String::new();
    let mut start = 0;
    while start < ids.len() {
        let on = counted(start);
        let end = (start..ids.len())
            .find(|&i| counted(i) != on)
            .unwrap_or(ids.len());
        let piece = tok.decode(&ids[start..end])?;
        if on {
            text += &format!("[[{piece}]]");
        } else {
            text += &piece;
        }
        start = end;
    }
    Ok(text)
}

/// A step's loss as the progress lines show it: a batch its loss mask left no target in has
/// none (the step was skipped).
fn loss_text(s: &StepLog) -> String {
    if s.counted_targets == 0 {
        "-- (no counted target: skipped)".into()
    } else {
        format!("{:.4}", s.loss)
    }
}

/// A token file just rewritten without a loss mask must not keep the mask of the file it
/// replaced (it would apply to the new tokens).
/// The one input of a build that reads one file (`what` says which kind).
fn one_input<'a>(inputs: &'a [PathBuf], what: &str) -> Result<&'a Path, String> {
    match inputs {
        [one] => Ok(one),
        _ => Err(format!(
            "{what} reads one input file, not {} (several are read with --tokenizer)",
            inputs.len()
        )),
    }
}

fn remove_stale_loss_mask(token_file: &Path) -> CliResult {
    let mask = headroom_mmap_data::loss_mask_path(token_file);
    if mask.is_file() {
        std::fs::remove_file(&mask)
            .map_err(|e| format!("{}: removing the old loss mask: {e}", mask.display()))?;
        say!(
            "{:<13}{} (it described the file replaced)",
            "removed",
            mask.display()
        );
    }
    Ok(())
}

/// This process's command line, as `Cli::parse` reads it (exiting with clap's message on a
/// usage error or after `--help`), and with `train`'s `--val-data` kept occurrence by
/// occurrence: each is a validation set of its own.
fn parse_cli() -> Cli {
    use clap::{CommandFactory, FromArgMatches};
    let matches = Cli::command().get_matches();
    let mut cli =
        Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.format(&mut Cli::command()).exit());
    if let (Some(Command::Train(args)), Some(("train", sub))) =
        (cli.command.as_mut(), matches.subcommand())
    {
        args.val_sets = sub
            .get_occurrences::<PathBuf>("val_data")
            .map(|sets| sets.map(|set| set.cloned().collect()).collect())
            .unwrap_or_default();
    }
    cli
}

fn run(cli: Cli, hooks: &CliHooks<'_>) -> CliResult<ExitCode> {
    // A misspelt cap would otherwise run the widest kernels the user meant to rule out.
    headroom_tensor::isa::env_cap()?;
    if hooks.mpi.is_none() {
        if let Some(Command::Train(a)) = &cli.command {
            if a.zero.is_some() && a.dist == Dist::Mpi {
                return delegate_to_mpi_build();
            }
        }
    }
    let ok = |r: CliResult| r.map(|()| ExitCode::SUCCESS);
    match cli.command {
        Some(Command::Train(a)) => cmd_train(*a, hooks),
        None => cmd_train(TrainArgs::parse_from(["train"]), hooks),
        Some(Command::Ladder(a)) => ok(cmd_ladder(a)),
        Some(Command::Estimate(a)) => ok(cmd_estimate(a)),
        Some(Command::MaxBatch(a)) => ok(cmd_max_batch(a)),
        Some(Command::Data(c)) => ok(cmd_data(c)),
        Some(Command::Sample(a)) => ok(cmd_sample(a)),
        Some(Command::Eval(a)) => ok(cmd_eval(*a)),
        Some(Command::Merge(a)) => ok(cmd_merge(a)),
        Some(Command::Env) => ok(cmd_env(hooks)),
        Some(Command::Checkpoint(CheckpointCommand::Consolidate { src, out })) => {
            let dir = crate::zero_checkpoint::consolidate(&src, &out)?;
            say!("consolidated {} into {}", src.display(), dir.display());
            Ok(ExitCode::SUCCESS)
        }
        Some(Command::Checkpoint(CheckpointCommand::Verify { path, all: false })) => {
            ok(cmd_verify(&path))
        }
        Some(Command::Checkpoint(CheckpointCommand::Verify { path, all: true })) => {
            cmd_verify_all(&path)
        }
    }
}

fn cmd_verify(path: &Path) -> CliResult {
    use crate::checkpoint::CheckpointKind;
    let v = crate::checkpoint::verify(path)?;
    let kind = match &v.kind {
        CheckpointKind::Full { optimizer } => format!(
            "the model and its {} AdamW moments",
            if optimizer.is_8bit() { "8-bit" } else { "f32" }
        ),
        CheckpointKind::Finetune(f) => format!(
            "fine-tuning adapters (PEFT's files) and their moments: {}; base xxh3 {}",
            f.spec.describe(),
            f.base_xxh3
        ),
        CheckpointKind::Zero { stage, ranks } => {
            format!("ZeRO-{stage}, one file per rank of {ranks}")
        }
    };
    say!(
        "{}: step {} of {}, {kind}",
        v.dir.display(),
        v.step,
        v.run.steps
    );
    let m = &v.config;
    say!(
        "model: {}, context {}, vocab {}, {} parameters",
        m.shape_name(),
        m.max_seq,
        m.vocab,
        m.parameter_count()?
    );
    say!(
        "run: batch {}×{}, seed {}, {}; {}",
        v.run.batch,
        v.run.seq,
        v.run.seed,
        v.run.precision,
        v.run.describe_optimizer()
    );
    if let Some(l) = &v.loader {
        say!(
            "data: next batch {} (epoch {}) of the data whose fingerprint is {:016x}",
            l.next_batch,
            l.epoch,
            l.dataset_fingerprint
        );
    }
    let bytes: u64 = v.files.iter().map(|f| f.bytes).sum();
    say!(
        "{} files match manifest.json ({}):",
        v.files.len(),
        headroom_profiler::human_bytes(bytes)
    );
    for f in &v.files {
        say!(
            "  {:<40} {:>12}  xxh3 {}",
            f.name,
            headroom_profiler::human_bytes(f.bytes),
            f.xxh3
        );
    }
    Ok(())
}

fn cmd_verify_all(root: &Path) -> CliResult<ExitCode> {
    let steps = crate::checkpoint::list(root)?;
    if steps.is_empty() {
        return Err(format!("{}: no step-* directories to verify", root.display()).into());
    }
    let mut damaged = 0;
    for (step, dir) in &steps {
        match crate::checkpoint::verify(dir) {
            Ok(v) => {
                let bytes: u64 = v.files.iter().map(|f| f.bytes).sum();
                say!(
                    "step {step:>8}  ok       {:>2} files  {:>12}",
                    v.files.len(),
                    headroom_profiler::human_bytes(bytes)
                );
            }
            Err(e) => {
                damaged += 1;
                say!("step {step:>8}  DAMAGED  {e}");
            }
        }
    }
    say!(
        "{} of {} checkpoints under {} verified",
        steps.len() - damaged,
        steps.len(),
        root.display()
    );
    Ok(if damaged == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn cmd_env(hooks: &CliHooks<'_>) -> CliResult {
    for line in crate::environment::report_lines() {
        say!("{line}");
    }
    let mpirun = match on_path("mpirun") {
        Some(p) => format!("mpirun at {}", p.display()),
        None => "no mpirun on the PATH".into(),
    };
    if hooks.mpi.is_some() {
        say!("mpi: this build runs ranks under mpirun (`--dist mpi`); {mpirun}");
    } else {
        match find_mpi_build() {
            Some(p) => say!(
                "mpi: this build has none; `--dist mpi` hands runs to {}; {mpirun}",
                p.display()
            ),
            None => say!(
                "mpi: this build has none and no headroom-mpi was found (`cargo install --path \
                 crates/trainer-mpi`, or name it in {MPI_BUILD_ENV}); {mpirun}"
            ),
        }
    }
    Ok(())
}

fn cmd_merge(a: MergeArgs) -> CliResult {
    let cpu = headroom_tensor::Cpu::new();
    let (cfg, mut masters) = crate::sample::load_masters(&a.base, &cpu)?;
    let lora = crate::adapters::load(&cpu, &a.adapter)?;
    let merged = crate::adapters::merge(&cfg, &mut masters, &lora, &a.adapter)?;
    let max_shard = a
        .max_shard_mib
        .map_or(crate::checkpoint::MAX_SHARD_BYTES, |m| {
            m.saturating_mul(1 << 20)
        });
    // transformers' save_pretrained writes the model's generation config beside it, and the
    // tokenizer is what a user saves next: the export loads as the base does.
    let companions =
        crate::companions::Companions::beside(&crate::sample::model_files_dir(&a.base)?)?;
    crate::checkpoint::save_hf_with(&a.out, &cfg, &masters, max_shard, &companions)?;
    say!(
        "{}: {} with {merged} adapted modules merged (rank {}, scaling {})",
        a.out.display(),
        a.base.display(),
        lora.config().r,
        lora.config().scaling()
    );
    Ok(())
}

fn cmd_eval(a: EvalArgs) -> CliResult {
    if let Some(questions) = &a.choices {
        return cmd_eval_choices(&a, questions);
    }
    if let Some(documents) = &a.documents {
        return cmd_eval_documents(&a, documents);
    }
    if let Some(completions) = &a.completions {
        return cmd_eval_completions(&a, completions);
    }
    if let Some(docs) = &a.generate {
        return cmd_eval_generate(&a, docs);
    }
    let data_path = a.data.as_ref().ok_or("--data or --choices")?;
    let (cpu, tracker) = inference_cpu();
    let mut model = crate::sample::load_for_inference(
        &a.from,
        a.adapter.as_deref(),
        &cpu,
        &a.weights.weights(),
    )?;
    let rows = a
        .loss_chunk
        .unwrap_or((EVAL_LOGITS_BYTES / (4 * model.cfg.vocab as u64)).max(1));
    model.opts.loss_chunk = Some(usize::try_from(rows).unwrap_or(usize::MAX));
    let seq = a.seq.unwrap_or(EVAL_DEFAULT_SEQ.min(model.cfg.max_seq));
    let data = headroom_mmap_data::open(data_path, &headroom_mmap_data::OpenOptions::default())?;
    let (loss, tokens) = crate::evaluate::evaluate(
        &model,
        &data,
        a.batch,
        seq,
        a.batches,
        document_boundaries(a.document_attention, a.document_separator),
    )?;
    let masked = if data.has_loss_mask() {
        " kept by its loss mask"
    } else {
        ""
    };
    say!(
        "loss {loss:.6} nats/token over {tokens} tokens{masked} ({} batches of {}×{seq}, from the start of {})",
        a.batches,
        a.batch,
        data_path.display()
    );
    esay!("{}", a.weights.summary(&tracker));
    Ok(())
}

/// `eval --choices` and `--documents`: the tokenizer (`--tokenizer`, else the model
/// directory's), then the model for inference, its vocabulary holding the tokenizer's.
fn scoring_model(
    a: &EvalArgs,
    option: &str,
) -> CliResult<(
    crate::tokenize::Tokenizer,
    crate::model::Model,
    std::sync::Arc<headroom_profiler::MemoryTracker>,
)> {
    use crate::tokenize::Tokenizer;
    let files_dir = crate::sample::model_files_dir(&a.from)?;
    let tok = match &a.tokenizer {
        Some(name) => Tokenizer::from_name(name)?,
        None => Tokenizer::beside(&files_dir).transpose()?.ok_or_else(|| {
            format!(
                "{option} needs a tokenizer: the model directory has no tokenizer.json; pass \
                 --tokenizer gpt2|FILE"
            )
        })?,
    };
    let (cpu, tracker) = inference_cpu();
    let model = crate::sample::load_for_inference(
        &a.from,
        a.adapter.as_deref(),
        &cpu,
        &a.weights.weights(),
    )?;
    if tok.vocab_size() > model.cfg.vocab {
        return Err(format!(
            "the tokenizer has {} ids but the model's vocabulary is {}",
            tok.vocab_size(),
            model.cfg.vocab
        )
        .into());
    }
    Ok((tok, model, tracker))
}

/// A metric as `eval` prints it: the mean, and its standard error where there is one.
fn mean_and_stderr(m: &crate::choices::Metric) -> String {
    match m.stderr {
        Some(se) => format!("{:.4} ± {se:.4}", m.mean),
        None => format!("{:.4}", m.mean),
    }
}

/// `--samples`: a JSON line per question or document (lm-eval's `--log_samples`).
struct SamplesFile<'a> {
    path: &'a Path,
    out: std::io::BufWriter<std::fs::File>,
}

impl SamplesFile<'_> {
    /// `line`, written as one line.
    fn write(&mut self, line: &serde_json::Value) -> crate::Result<()> {
        writeln!(self.out, "{line}")
            .map_err(|e| crate::TrainError::Input(format!("{}: {e}", self.path.display())))
    }

    /// Everything written reaches the file.
    fn finish(mut self) -> CliResult {
        self.out
            .flush()
            .map_err(|e| format!("{}: {e}", self.path.display()).into())
    }
}

/// `--samples`, created.
fn samples_file(a: &EvalArgs) -> CliResult<Option<SamplesFile<'_>>> {
    Ok(match &a.samples {
        Some(p) => Some(SamplesFile {
            path: p.as_path(),
            out: std::io::BufWriter::new(
                std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()))?,
            ),
        }),
        None => None,
    })
}

/// The `--chat-template-kwargs` JSON object as a template's further variables.
fn chat_template_kwargs(json: &str) -> CliResult<Vec<(String, crate::chat_template::ChatValue)>> {
    let value: crate::chat_template::ChatValue =
        serde_json::from_str(json).map_err(|e| format!("--chat-template-kwargs: not JSON: {e}"))?;
    Ok(crate::tokenize::template_inputs(None, Some(value))
        .map_err(|e| format!("--chat-template-kwargs: {e}"))?
        .extra)
}

/// A perplexity as `eval` prints it: four decimals, or exponent form past 1e6 (a random
/// model's runs to 1e26).
fn shown(x: f64) -> String {
    if x.abs() < 1e6 {
        format!("{x:.4}")
    } else {
        format!("{x:.6e}")
    }
}

/// `eval --completions`: the documents read before the model loads, a line per metric, and
/// with `--samples` each document's log-likelihood and greedy flag as it is done.
fn cmd_eval_completions(a: &EvalArgs, path: &Path) -> CliResult {
    let templates = doc_templates(a, [None, None, None])?;
    let documents = crate::completions::read_completions_with(path, templates.as_ref())?;
    let (tok, model, tracker) = scoring_model(a, "--completions")?;
    let mut samples = samples_file(a)?;
    let started = std::time::Instant::now();
    let report = crate::completions::evaluate(&model, &tok, &documents, |i, s| {
        let Some(samples) = samples.as_mut() else {
            return Ok(());
        };
        let line = serde_json::json!({
            "document": i,
            "loglikelihood": s.loglikelihood,
            "is_greedy": s.is_greedy,
        });
        samples.write(&line)
    })?;
    if let Some(samples) = samples {
        samples.finish()?;
    }
    let with_stderr = |value: f64, stderr: Option<f64>| match stderr {
        Some(se) => format!("{} ± {}", shown(value), shown(se)),
        None => shown(value),
    };
    say!(
        "{:<12} {}",
        "acc",
        with_stderr(report.acc.mean, report.acc.stderr)
    );
    say!(
        "{:<12} {}",
        "perplexity",
        with_stderr(report.perplexity, report.perplexity_stderr)
    );
    say!(
        "{} documents, {} target tokens scored in {:.2} s ({})",
        report.documents,
        report.tokens,
        started.elapsed().as_secs_f64(),
        path.display()
    );
    esay!("{}", a.weights.summary(&tracker));
    Ok(())
}

/// `eval --documents`: the documents read before the model loads, a line per metric, and
/// with `--samples` each document's log-likelihood as it is done.
fn cmd_eval_documents(a: &EvalArgs, path: &Path) -> CliResult {
    let documents: Vec<(String, String)> = match a.preset.as_deref() {
        None => crate::rolling::read_documents(path)?
            .into_iter()
            .map(|text| (text.clone(), text))
            .collect(),
        Some("wikitext") => crate::rolling::read_wikitext(path)?,
        Some(other) => {
            return Err(format!("no --documents preset {other:?} (there is wikitext)").into())
        }
    };
    let documents: Vec<(&str, &str)> = documents
        .iter()
        .map(|(text, counted)| (text.as_str(), counted.as_str()))
        .collect();
    let (tok, model, tracker) = scoring_model(a, "--documents")?;
    let mut samples = samples_file(a)?;
    let started = std::time::Instant::now();
    let report = crate::rolling::evaluate_counting(&model, &tok, &documents, |i, ll| {
        let Some(samples) = samples.as_mut() else {
            return Ok(());
        };
        let line = serde_json::json!({"document": i, "loglikelihood": ll});
        samples.write(&line)
    })?;
    if let Some(samples) = samples {
        samples.finish()?;
    }
    say!(
        "{:<16} {}",
        "word_perplexity",
        shown(report.word_perplexity)
    );
    say!(
        "{:<16} {}",
        "byte_perplexity",
        shown(report.byte_perplexity)
    );
    say!("{:<16} {}", "bits_per_byte", shown(report.bits_per_byte));
    say!(
        "{} documents, {} words, {} bytes, {} tokens scored in {:.2} s ({})",
        report.documents,
        report.words,
        report.bytes,
        report.tokens,
        started.elapsed().as_secs_f64(),
        path.display()
    );
    esay!("{}", a.weights.summary(&tracker));
    Ok(())
}

/// `--num-fewshot`, `--fewshot-file` (read by `read`), `--fewshot-sampler`, `--description`,
/// `--system-instruction` and `--fewshot-delimiter` as lm-eval's few-shot prompt.
/// lm-eval's default `fewshot_delimiter`.
const DEFAULT_FEWSHOT_DELIMITER: &str = "\n\n";

fn fewshot_of<E>(
    a: &EvalArgs,
    default_shots: usize,
    read: impl Fn(&Path) -> crate::Result<Vec<E>>,
) -> CliResult<crate::choices::Fewshot<E>> {
    use crate::choices::{Fewshot, Sampler};
    Ok(Fewshot {
        shots: a.num_fewshot.unwrap_or(default_shots),
        pool: a.fewshot_file.as_deref().map(read).transpose()?,
        sampler: match a.fewshot_sampler.as_deref().unwrap_or("random") {
            "random" | "default" => Sampler::Random {
                seed: a.fewshot_seed,
            },
            "first-n" | "first_n" => Sampler::FirstN,
            other => {
                return Err(format!("--fewshot-sampler {other}: expected random or first-n").into())
            }
        },
        description: a.description.clone().unwrap_or_default(),
        system_instruction: a.system_instruction.clone(),
        delimiter: a
            .fewshot_delimiter
            .clone()
            .unwrap_or_else(|| DEFAULT_FEWSHOT_DELIMITER.to_owned()),
        gen_prefix: a.gen_prefix.clone().filter(|p| !p.is_empty()),
    })
}

/// A chat template's further variables.
type TemplateVariables = Vec<(String, crate::chat_template::ChatValue)>;

/// `--apply-chat-template`'s template (the tokenizer's) and `--chat-template-kwargs`.
fn prompt_template(
    a: &EvalArgs,
    tok: &crate::tokenize::Tokenizer,
) -> CliResult<(
    Option<crate::chat_template::ChatTemplate>,
    TemplateVariables,
)> {
    let template = if a.apply_chat_template {
        Some(tok.chat_template()?.ok_or(
            "--apply-chat-template: the tokenizer has no chat template (chat_template.jinja or \
             tokenizer_config.json beside its tokenizer.json)",
        )?)
    } else {
        None
    };
    let extra = match &a.chat_template_kwargs {
        Some(json) => chat_template_kwargs(json)?,
        None => Vec::new(),
    };
    Ok((template, extra))
}

/// How prompts are rendered: through `template` when there is one.
fn prompt_format<'a>(
    a: &EvalArgs,
    template: Option<&'a crate::chat_template::ChatTemplate>,
    extra: &'a [(String, crate::chat_template::ChatValue)],
) -> crate::choices::PromptFormat<'a> {
    match template {
        Some(template) => crate::choices::PromptFormat::Chat {
            template,
            multiturn: a.fewshot_as_multiturn,
            extra,
        },
        None => crate::choices::PromptFormat::Plain,
    }
}

/// The documents' templates: `--doc-to-text`, `--doc-to-target` and `--doc-to-choice`,
/// each in place of the task's lm-eval settings (`preset`: text, target, choice). A task's
/// settings alone apply only to documents without a `context` (a dataset's own rows), so
/// that documents already in headroom's shape keep working with the task; `None` when
/// there are no settings at all.
fn doc_templates(
    a: &EvalArgs,
    preset: [Option<crate::doc_template::Setting>; 3],
) -> CliResult<Option<crate::doc_template::DocTemplates>> {
    use crate::doc_template::Setting;
    let own = [&a.doc_to_text, &a.doc_to_target, &a.doc_to_choice]
        .map(|o| o.as_deref().map(Setting::from));
    let given = own.iter().any(Option::is_some);
    if !given && preset.iter().all(Option::is_none) {
        return Ok(None);
    }
    let [text, target, choice] = {
        let mut preset = preset.into_iter();
        own.map(|o| o.or(preset.next().flatten()))
    };
    let templates = crate::doc_template::DocTemplates::new(text, target, choice)?;
    Ok(Some(if given {
        templates
    } else {
        templates.only_for_dataset_rows()
    }))
}

/// The largest `--filters` file read (GSM8K's filter list is 0.4 KiB).
const MAX_FILTERS_BYTES: u64 = 1 << 20;

/// `eval --generate`: the documents, prompts and filters made before the model loads, a
/// line per filter, and with `--samples` each document's generation and answers as it is
/// done.
fn cmd_eval_generate(a: &EvalArgs, path: &Path) -> CliResult {
    use crate::generation::{self, ExactMatch, FilterPipeline, PyRegex, TaskPreset};
    let preset = a.preset.as_deref().map(TaskPreset::named).transpose()?;
    let templates = doc_templates(
        a,
        [
            preset.as_ref().and_then(|p| p.doc_to_text.clone()),
            preset.as_ref().and_then(|p| p.doc_to_target.clone()),
            None,
        ],
    )?;
    let read = |p: &Path| generation::read_generation_docs_with(p, templates.as_ref());
    let docs = read(path)?;
    let default_shots = preset.as_ref().map_or(0, |p| p.num_fewshot);
    let mut fewshot = fewshot_of(a, default_shots, read)?;
    if let (None, Some(examples)) = (
        &fewshot.pool,
        preset.as_ref().and_then(|p| p.examples.as_ref()),
    ) {
        // The task's own examples, shown in order (lm-eval's `first_n` over its `samples`).
        fewshot.pool = Some(examples.clone());
        fewshot.sampler = crate::choices::Sampler::FirstN;
    }
    if let Some(p) = &preset {
        if let (None, Some(description)) = (&a.description, &p.description) {
            fewshot.description = description.clone();
        }
        if let (None, Some(delimiter)) = (&a.fewshot_delimiter, &p.fewshot_delimiter) {
            fewshot.delimiter = delimiter.clone();
        }
    }
    let turns = crate::choices::fewshot_turns(&docs, &fewshot, &a.target_delimiter)?;
    let filters = match &a.filters {
        None => preset
            .as_ref()
            .map_or_else(|| vec![FilterPipeline::none()], |p| p.filters.clone()),
        Some(given) => {
            let trimmed = given.trim_start();
            let text = if trimmed.starts_with('[') || trimmed.starts_with('{') {
                given.clone()
            } else {
                let file = Path::new(given);
                let bytes = crate::bounded::read_file(file, MAX_FILTERS_BYTES)
                    .map_err(|why| format!("--filters {}: {why}", file.display()))?;
                String::from_utf8(bytes)
                    .map_err(|e| format!("--filters {}: {e}", file.display()))?
            };
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| format!("--filters: not JSON: {e}"))?;
            FilterPipeline::parse_list(&json)?
        }
    };
    let preset_metric = preset.as_ref().map(|p| &p.metric);
    let metric = ExactMatch {
        regexes_to_ignore: if a.regexes_to_ignore.is_empty() {
            preset_metric.map_or_else(Vec::new, |m| m.regexes_to_ignore.clone())
        } else {
            a.regexes_to_ignore
                .iter()
                .map(|r| PyRegex::new(r))
                .collect::<crate::Result<_>>()?
        },
        ignore_case: a.ignore_case || preset_metric.is_some_and(|m| m.ignore_case),
        ignore_punctuation: a.ignore_punctuation
            || preset_metric.is_some_and(|m| m.ignore_punctuation),
        ignore_numbers: a.ignore_numbers || preset_metric.is_some_and(|m| m.ignore_numbers),
    };
    let mut exact_match_reported =
        a.metrics.is_empty() && preset.as_ref().is_none_or(|p| p.exact_match);
    let mut corpus_metrics = match (&preset, a.metrics.is_empty()) {
        (Some(p), true) => p.corpus_metrics.clone(),
        _ => Vec::new(),
    };
    for name in &a.metrics {
        if name == "exact_match" {
            exact_match_reported = true;
        } else {
            let metric = crate::corpus_metrics::CorpusMetric::named(name)
                .map_err(|e| format!("--metric: {e}"))?;
            if !corpus_metrics.contains(&metric) {
                corpus_metrics.push(metric);
            }
        }
    }
    let until = match (&preset, a.until.is_empty()) {
        (_, false) => a.until.clone(),
        (Some(p), true) => p.until.clone(),
        (None, true) => vec![fewshot.delimiter.clone()],
    };
    let files_dir = crate::sample::model_files_dir(&a.from)?;
    let stop_tokens = generation::generation_eos_ids(&files_dir)?;
    let sampling = generation::lm_eval_sampling(
        &crate::sample::GenerationConfig::beside(&files_dir)?.unwrap_or_default(),
        a.do_sample.or(preset.as_ref().and_then(|p| p.do_sample)),
        &crate::sample::SamplingRequest {
            temperature: a
                .temperature
                .or(preset.as_ref().and_then(|p| p.temperature)),
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            repetition_penalty: None,
        },
    )?;
    let repeats = a
        .repeats
        .map_or_else(|| preset.as_ref().map_or(1, |p| p.repeats), usize::from);
    let (tok, model, tracker) = scoring_model(a, "--generate")?;
    let (template, extra) = prompt_template(a, &tok)?;
    let format = prompt_format(a, template.as_ref(), &extra);
    let contexts = turns
        .iter()
        .map(|t| crate::choices::render_prompt(t, format))
        .collect::<crate::Result<Vec<_>>>()?;
    let settings = generation::GenerationSettings {
        until,
        max_gen_toks: a.max_gen_toks,
        stop_tokens,
        filters,
        metric,
        corpus_metrics,
        batch_size: usize::from(a.batch_size),
        sampling,
        seed: a.seed,
        repeats,
    };
    if sampling != crate::sample::Sampling::greedy() || repeats > 1 {
        say!(
            "{repeats} generation{} per document, {}",
            if repeats == 1 { "" } else { "s" },
            describe_sampling(&sampling)
        );
    }
    let mut samples = samples_file(a)?;
    let started = std::time::Instant::now();
    let report = generation::evaluate(&model, &tok, &docs, &contexts, &settings, |i, g| {
        let Some(samples) = samples.as_mut() else {
            return Ok(());
        };
        let named = |values: Vec<serde_json::Value>| {
            settings
                .filters
                .iter()
                .map(|f| f.name.clone())
                .zip(values)
                .collect::<serde_json::Map<_, _>>()
        };
        let mut line = serde_json::json!({
            "document": i,
            "prompt_tokens": g.prompt_tokens,
            "new_tokens": g.new_tokens,
            "response": g.responses[0],
            "filtered": named(g.filtered.iter().map(|f| f.as_str().into()).collect()),
            "exact_match": named(g.exact_match.iter().map(|&m| m.into()).collect()),
        });
        if g.responses.len() > 1 {
            line["responses"] = g.responses.clone().into();
        }
        samples.write(&line)
    })?;
    if let Some(samples) = samples {
        samples.finish()?;
    }
    if exact_match_reported {
        for (name, m) in &report.exact_match {
            let label = format!("exact_match,{name}");
            say!("{label:<28} {}", mean_and_stderr(m));
        }
    }
    for c in &report.corpus {
        let label = format!("{},{}", c.metric.name(), c.filter);
        match c.stderr {
            Some(se) => say!("{label:<28} {:.4} ± {se:.4}", c.score),
            None => say!("{label:<28} {:.4}", c.score),
        }
    }
    say!(
        "{} documents, {} tokens generated in {:.2} s ({})",
        report.documents,
        report.new_tokens,
        started.elapsed().as_secs_f64(),
        path.display()
    );
    if report.reused_prompt_tokens > 0 {
        let from = if a.batch_size > 1 {
            "the batch's shared start or the batch before"
        } else {
            "the document before"
        };
        say!(
            "{} of {} prompt tokens reused from {from}",
            report.reused_prompt_tokens,
            report.prompt_tokens
        );
    }
    esay!("{}", a.weights.summary(&tracker));
    Ok(())
}

/// `eval --choices`: the questions read before the model loads, a line per metric, and with
/// `--samples` each question's scores as it is done.
fn cmd_eval_choices(a: &EvalArgs, path: &Path) -> CliResult {
    use crate::choices::{self, ChoicesPreset, Outcome};
    let preset = a.preset.as_deref().map(ChoicesPreset::named).transpose()?;
    let templates = doc_templates(
        a,
        [
            preset.as_ref().map(|p| p.doc_to_text.clone()),
            preset.as_ref().map(|p| p.doc_to_target.clone()),
            preset.as_ref().map(|p| p.doc_to_choice.clone()),
        ],
    )?
    .map(|t| t.with_process_docs(preset.as_ref().and_then(|p| p.process_docs)));
    // Prompts are built before the model loads (a bad file or option fails at once), and
    // rendered once the tokenizer (and its chat template) is there.
    let description = preset.as_ref().and_then(|p| p.description.as_ref());
    let prompts = if a.num_fewshot.is_some()
        || a.description.is_some()
        || description.is_some()
        || a.system_instruction.is_some()
        || a.apply_chat_template
        || a.gen_prefix.is_some()
    {
        let docs = choices::read_docs_with(path, templates.as_ref())?;
        if a.gen_prefix.is_some() && docs.iter().any(|d| d.question.continuation.is_some()) {
            return Err(
                "--gen-prefix with multiple-input questions (Winogrande's): lm-eval puts the \
                 prefix after each choice's context, which is not done here"
                    .into(),
            );
        }
        if a.apply_chat_template && docs.iter().any(|d| d.question.continuation.is_some()) {
            return Err(
                "--apply-chat-template with multiple-input questions (Winogrande's): \
                        lm-eval renders each choice's context through the template on its own, \
                        which is not done here"
                    .into(),
            );
        }
        let mut fewshot = fewshot_of(a, 0, |p| choices::read_docs_with(p, templates.as_ref()))?;
        if let Some(p) = &preset {
            if let (None, Some(d)) = (&a.description, &p.description) {
                fewshot.description = d.clone();
            }
            if let (None, Some(sampler)) = (&a.fewshot_sampler, p.sampler) {
                fewshot.sampler = sampler;
            }
        }
        let turns = choices::fewshot_turns(&docs, &fewshot, &a.target_delimiter)?;
        (docs.into_iter().map(|d| d.question).collect(), Some(turns))
    } else {
        (
            choices::read_questions_with(path, templates.as_ref())?,
            None,
        )
    };
    let (tok, model, tracker) = scoring_model(a, "--choices")?;
    let (template, extra) = prompt_template(a, &tok)?;
    let format = prompt_format(a, template.as_ref(), &extra);
    let questions: Vec<choices::Question> = match prompts {
        (questions, None) => questions,
        (questions, Some(turns)) => questions
            .into_iter()
            .zip(&turns)
            .map(|(q, turns)| {
                Ok(choices::Question {
                    context: choices::render_prompt(turns, format)?,
                    ..q
                })
            })
            .collect::<crate::Result<_>>()?,
    };
    // lm-eval scores a choice right after the chat template's generation prompt, or after a
    // gen_prefix continued in the assistant's turn, the target delimiter between them unless
    // the prefix ends with whitespace.
    let prefix = a.gen_prefix.as_deref().unwrap_or("");
    let delimiter =
        if a.apply_chat_template && (prefix.is_empty() || choices::ends_with_whitespace(prefix)) {
            ""
        } else {
            &a.target_delimiter
        };
    let mut samples = samples_file(a)?;
    let started = std::time::Instant::now();
    let report = choices::evaluate(&model, &tok, &questions, delimiter, |i, o: &Outcome| {
        let Some(samples) = samples.as_mut() else {
            return Ok(());
        };
        let line = serde_json::json!({
            "question": i,
            "loglikelihoods": o.scored.iter().map(|s| s.loglikelihood).collect::<Vec<_>>(),
            "is_greedy": o.scored.iter().map(|s| s.is_greedy).collect::<Vec<_>>(),
            "pred": o.pred,
            "acc": o.acc,
            "acc_norm": o.acc_norm,
            "acc_bytes": o.acc_bytes,
            "exact_match": o.exact_match,
        });
        samples.write(&line)
    })?;
    if let Some(samples) = samples {
        samples.finish()?;
    }
    for (name, m) in [
        ("acc", report.acc),
        ("acc_norm", report.acc_norm),
        ("acc_bytes", report.acc_bytes),
        ("exact_match", report.exact_match),
    ] {
        say!("{name:<12} {}", mean_and_stderr(&m));
    }
    let seconds = started.elapsed().as_secs_f64();
    say!(
        "{} questions, {} choices, {} continuation tokens scored in {seconds:.2} s ({})",
        report.questions,
        report.requests,
        report.tokens,
        path.display()
    );
    if report.reused_context_tokens > 0 {
        say!(
            "{} of {} context tokens reused from the question before",
            report.reused_context_tokens,
            report.context_tokens
        );
    }
    esay!("{}", a.weights.summary(&tracker));
    Ok(())
}

/// The sampler in words, for the line that says where its settings came from.
fn describe_sampling(s: &crate::sample::Sampling) -> String {
    let mut parts = vec![if s.temperature == 0.0 {
        "greedy".to_owned()
    } else {
        format!("sampling at temperature {}", s.temperature)
    }];
    if let Some(k) = s.top_k {
        parts.push(format!("top-k {k}"));
    }
    if let Some(p) = s.top_p {
        parts.push(format!("top-p {p}"));
    }
    if let Some(p) = s.min_p {
        parts.push(format!("min-p {p}"));
    }
    if let Some(r) = s.repetition_penalty {
        parts.push(format!("repetition penalty {r}"));
    }
    parts.join(", ")
}

/// A chat message `{"role": role, "content": content}`.
fn chat_message(role: &str, content: &str) -> crate::chat_template::ChatValue {
    crate::chat_template::ChatValue::from(serde_json::json!({"role": role, "content": content}))
}

/// Writes the text of `ids` past the `printed` bytes already written, once it decodes to
/// whole characters (a character split across tokens waits for its last byte; `finish` writes
/// what there is), and returns that text. Decoding the tokens together keeps the joins as the
/// tokenizer writes them (SentencePiece-style spaces, byte-level characters).
fn print_decoded(
    out: &mut impl Write,
    tok: &crate::tokenize::Tokenizer,
    ids: &[u32],
    printed: &mut usize,
    finish: bool,
) -> crate::Result<String> {
    let text = tok.decode(ids)?;
    if (finish || !text.ends_with('\u{FFFD}')) && text.is_char_boundary(*printed) {
        let _ = write!(out, "{}", &text[*printed..]);
        *printed = text.len();
        let _ = out.flush();
    }
    Ok(text)
}

/// What `sample --interactive` renders each turn with.
struct Chat<'a> {
    template: &'a crate::chat_template::ChatTemplate,
    tools: Option<&'a [crate::chat_template::ChatValue]>,
    extra: &'a [(String, crate::chat_template::ChatValue)],
}

/// `sample --interactive`: each line of `input` (after `first`, if given) is a user message;
/// the conversation so far is rendered with the generation prompt, the answer is generated and
/// printed as it comes (its end-of-turn token left out), and it joins the conversation as the
/// assistant's message (decoded without that token, as transformers' chat keeps it). An empty
/// line or the end of the input ends the chat. Each turn draws with its own seed (the seed
/// plus the turn's number). The keys and values of the conversation so far are kept between
/// turns ([`crate::sample::PromptCache`]), so a turn runs only the prompt positions that are
/// new. Returns what the turns ran.
fn chat_turns(
    model: &crate::model::Model,
    tok: &crate::tokenize::Tokenizer,
    chat: &Chat<'_>,
    mut messages: Vec<crate::chat_template::ChatValue>,
    first: Option<String>,
    mut input: impl std::io::BufRead,
    opts: &crate::sample::SampleOptions,
) -> CliResult<ChatSummary> {
    let mut out = std::io::stdout();
    let mut pending = first;
    let mut summary = ChatSummary::default();
    let mut kept = crate::sample::PromptCache::new();
    loop {
        let message = match pending.take() {
            Some(m) => m,
            None => {
                eprint!("> ");
                let mut line = String::new();
                if input.read_line(&mut line)? == 0 {
                    break;
                }
                let line = line.trim_end_matches(['\n', '\r']);
                if line.is_empty() {
                    break;
                }
                line.to_owned()
            }
        };
        messages.push(chat_message("user", &message));
        let text = chat
            .template
            .render_request(&crate::chat_template::ChatRequest {
                messages: &messages,
                add_generation_prompt: true,
                tools: chat.tools,
                documents: None,
                extra: chat.extra,
                continue_final_message: None,
            })?
            .text;
        let prompt = tok.encode(&text)?;
        if prompt.is_empty() {
            return Err("the conversation encodes to no tokens".into());
        }
        let this_turn = crate::sample::SampleOptions {
            seed: opts.seed.wrapping_add(summary.turns as u64),
            ..opts.clone()
        };
        let mut answer: Vec<u32> = Vec::new();
        let mut printed = 0usize;
        let (_, reused) =
            crate::sample::generate_cached(model, &mut kept, &prompt, &this_turn, |id| {
                if this_turn.stop_tokens.contains(&id) {
                    return Ok(std::ops::ControlFlow::Continue(()));
                }
                answer.push(id);
                print_decoded(&mut out, tok, &answer, &mut printed, false)?;
                Ok(std::ops::ControlFlow::Continue(()))
            })?;
        let text = print_decoded(&mut out, tok, &answer, &mut printed, true)?;
        let _ = writeln!(out);
        messages.push(chat_message("assistant", &text));
        summary.turns += 1;
        summary.prompt_tokens += prompt.len();
        summary.reused += reused;
    }
    Ok(summary)
}

/// What `sample --interactive` ran.
#[derive(Default)]
struct ChatSummary {
    turns: usize,
    /// The turns' prompts (each the whole conversation so far), in tokens.
    prompt_tokens: usize,
    /// Of those, the positions whose keys and values an earlier turn had computed.
    reused: usize,
}

/// A conversation for `sample --conversation`.
#[derive(Default)]
struct Conversation {
    messages: Vec<crate::chat_template::ChatValue>,
    tools: Option<Vec<crate::chat_template::ChatValue>>,
    extra: Vec<(String, crate::chat_template::ChatValue)>,
}

/// The file of `--conversation`: a list of messages, or an object with `messages` and, if any,
/// `tools` (a list, or that list as JSON text) and `chat_template_kwargs`, read as `data build
/// --jsonl` reads a line's.
fn read_conversation(file: &Path) -> CliResult<Conversation> {
    use crate::chat_template::ChatValue;
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum File {
        Messages(Vec<ChatValue>),
        Object {
            messages: Option<Vec<ChatValue>>,
            tools: Option<crate::tokenize::Tools>,
            chat_template_kwargs: Option<ChatValue>,
        },
    }
    let bytes = crate::bounded::read_file(file, crate::chat_template::MAX_CONFIG_BYTES)
        .map_err(|e| format!("{}: {e}", file.display()))?;
    let bad = |why: String| format!("{}: {why}", file.display());
    let parsed: File = serde_json::from_slice(&bytes).map_err(|e| {
        bad(format!(
            "neither a list of messages nor an object with them: {e}"
        ))
    })?;
    Ok(match parsed {
        File::Messages(messages) => Conversation {
            messages,
            ..Default::default()
        },
        File::Object {
            messages,
            tools,
            chat_template_kwargs,
        } => {
            let messages = messages.ok_or_else(|| bad("no \"messages\" list".into()))?;
            let inputs =
                crate::tokenize::template_inputs(tools, chat_template_kwargs).map_err(bad)?;
            Conversation {
                messages,
                tools: inputs.tools,
                extra: inputs.extra,
            }
        }
    })
}

fn cmd_sample(a: SampleArgs) -> CliResult {
    use crate::sample::{generate_until, load_for_inference, GenerationConfig, SampleOptions};
    use crate::sample::{SamplingRequest, GENERATION_CONFIG};
    use crate::tokenize::Tokenizer;
    let asked = SamplingRequest {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
    };
    // Before the model loads: a bad setting is refused at once.
    // A checkpoint's tokenizer and generation config are its step directory's (checked).
    let files_dir = crate::sample::model_files_dir(&a.from)?;
    let generation_config = GenerationConfig::beside(&files_dir)?;
    let sampling = match &generation_config {
        Some(config) => {
            let sampling = config.sampling(&asked)?;
            esay!("{GENERATION_CONFIG}: {}", describe_sampling(&sampling));
            sampling
        }
        None => {
            let sampling = asked.plain();
            sampling.validate()?;
            sampling
        }
    };
    let (cpu, tracker) = inference_cpu();
    let weights = &a.weights;
    let model = load_for_inference(&a.from, a.adapter.as_deref(), &cpu, &a.weights.weights())?;
    let tok = match &a.tokenizer {
        Some(name) => Some(Tokenizer::from_name(name)?),
        None => Tokenizer::beside(&files_dir).transpose()?,
    };
    if let Some(t) = &tok {
        if t.vocab_size() > model.cfg.vocab {
            return Err(format!(
                "the tokenizer has {} ids but the model's vocabulary is {}",
                t.vocab_size(),
                model.cfg.vocab
            )
            .into());
        }
    }
    let mut eot = tok.as_ref().and_then(Tokenizer::end_of_text);
    // The tokens generation stops after: the end of text (the chat template's end of turn in a
    // chat) and the generation config's.
    let stop_tokens = |eot: Option<u32>| {
        if a.ignore_eot {
            return Vec::new();
        }
        let from_config = generation_config.iter().flat_map(|c| &c.eos_token_ids);
        let mut stops: Vec<u32> = eot.into_iter().chain(from_config.copied()).collect();
        stops.sort_unstable();
        stops.dedup();
        stops
    };
    let chat_prompt = if a.chat.is_some() || a.conversation.is_some() || a.interactive {
        if a.prefill.is_some() && a.continue_final_message == Some(false) {
            return Err("--prefill is an assistant message to continue, and \
                        --continue-final-message false would end it"
                .into());
        }
        let t = tok.as_ref().ok_or(
            "--chat, --conversation and --interactive need a tokenizer: pass --tokenizer FILE",
        )?;
        let template = match &a.chat_template {
            Some(file) => t.chat_template_from(file)?,
            None => t.chat_template()?.ok_or(
                "--chat needs a chat template: the tokenizer has none (chat_template.jinja \
                 or tokenizer_config.json beside its tokenizer.json); give one with \
                 --chat-template FILE",
            )?,
        };
        let mut conversation = match &a.conversation {
            Some(file) => read_conversation(file)?,
            None => Conversation::default(),
        };
        if let Some(json) = &a.chat_template_kwargs {
            for (key, value) in chat_template_kwargs(json)? {
                conversation.extra.retain(|(k, _)| *k != key);
                conversation.extra.push((key, value));
            }
        }
        let mut messages = conversation.messages;
        if let Some(system) = &a.system {
            messages.push(chat_message("system", system));
        }
        if a.interactive {
            // The chat model ends its turn with the template's end-of-sequence token.
            if let Some(id) = template
                .special_token("eos_token")
                .and_then(|e| t.token_id(e))
            {
                eot = Some(id);
            }
            let opts = SampleOptions {
                tokens: a.tokens,
                sampling,
                seed: a.seed,
                stop_tokens: stop_tokens(eot),
                vocab_limit: Some(t.vocab_size()),
            };
            let chat = Chat {
                template: &template,
                tools: conversation.tools.as_deref(),
                extra: &conversation.extra,
            };
            let input = std::io::stdin().lock();
            let s = chat_turns(&model, t, &chat, messages, a.chat.clone(), input, &opts)?;
            esay!(
                "{} turns; {} of {} prompt tokens reused from earlier turns; {}",
                s.turns,
                s.reused,
                s.prompt_tokens,
                weights.summary(&tracker)
            );
            return Ok(());
        }
        if let Some(message) = &a.chat {
            messages.push(chat_message("user", message));
        }
        if let Some(text) = &a.prefill {
            messages.push(chat_message("assistant", text));
        }
        let ends_with_assistant = matches!(
            messages.last(),
            Some(crate::chat_template::ChatValue::Object(m))
                if m.iter().any(|(k, v)| k == "role" && *v == crate::chat_template::ChatValue::String("assistant".into()))
        );
        let continue_final = a.continue_final_message.unwrap_or(ends_with_assistant);
        let text = template
            .render_request(&crate::chat_template::ChatRequest {
                messages: &messages,
                add_generation_prompt: !continue_final,
                tools: conversation.tools.as_deref(),
                documents: None,
                extra: &conversation.extra,
                continue_final_message: continue_final.then_some("content"),
            })?
            .text;
        // The chat model ends its turn with the template's end-of-sequence token.
        if let Some(id) = template
            .special_token("eos_token")
            .and_then(|e| t.token_id(e))
        {
            eot = Some(id);
        }
        // The template wrote the special tokens: none is added around the text.
        Some(t.encode(&text)?)
    } else if a.chat_template.is_some() || a.chat_template_kwargs.is_some() {
        return Err(
            "--chat-template and --chat-template-kwargs need --chat or --conversation".into(),
        );
    } else if a.prefill.is_some() || a.continue_final_message.is_some() {
        return Err("--prefill and --continue-final-message need --chat or --conversation".into());
    } else if a.system.is_some() {
        return Err("--system needs --chat or --interactive".into());
    } else {
        None
    };
    let prompt = match (chat_prompt, &a.prompt, a.prompt_ids, &tok) {
        (Some(ids), ..) => ids,
        (None, Some(text), _, Some(t)) => t.encode_sequence(text)?,
        (None, Some(_), _, None) => {
            return Err(
                "--prompt needs a tokenizer: pass --tokenizer gpt2|FILE, or give \
                        --prompt-ids"
                    .into(),
            )
        }
        (None, None, Some(ids), _) => ids,
        // Nothing to continue: start a document, as training data separates them.
        (None, None, None, _) => vec![eot.unwrap_or(0)],
    };
    if prompt.is_empty() {
        return Err("the prompt encodes to no tokens".into());
    }
    // Before anything is printed: the prompt is echoed first.
    if let Some(id) = prompt.iter().find(|&&id| id as usize >= model.cfg.vocab) {
        return Err(format!(
            "the prompt holds token id {id}, outside the model's vocabulary of {} ids",
            model.cfg.vocab
        )
        .into());
    }
    let opts = SampleOptions {
        tokens: a.tokens,
        sampling,
        seed: a.seed,
        stop_tokens: stop_tokens(eot),
        vocab_limit: tok.as_ref().map(Tokenizer::vocab_size),
    };
    // The prompt's text comes first: a stop string may start inside it.
    let mut stops = crate::sample::StopStrings::new(&a.stop)?;
    if !stops.is_empty() {
        let t = tok
            .as_ref()
            .ok_or("--stop needs a tokenizer: pass --tokenizer gpt2|FILE")?;
        for &id in &prompt {
            stops.push(&t.token_bytes(id)?);
        }
    }
    let mut out = std::io::stdout();
    // With a tokenizer the prompt and the new tokens are decoded together, so the joins come
    // out as the tokenizer writes them (spaces of SentencePiece-style pieces, characters split
    // across byte-level tokens); what is printed is the text past what was printed before.
    let mut generated: Vec<u32> = prompt.clone();
    let mut printed = 0usize;
    match &tok {
        Some(t) => {
            let text = t.decode(&generated)?;
            let _ = write!(out, "{text}");
            printed = text.len();
        }
        None => {
            let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
            let _ = write!(out, "{}", ids.join(" "));
        }
    }
    let _ = out.flush();
    let start = std::time::Instant::now();
    let new = generate_until(&model, &prompt, &opts, |id| {
        generated.push(id);
        let stop = match &tok {
            Some(t) if !stops.is_empty() => stops.push(&t.token_bytes(id)?),
            _ => false,
        };
        match &tok {
            Some(t) => {
                print_decoded(&mut out, t, &generated, &mut printed, false)?;
            }
            None => {
                let _ = write!(out, " {id}");
                let _ = out.flush();
            }
        }
        Ok(if stop {
            std::ops::ControlFlow::Break(())
        } else {
            std::ops::ControlFlow::Continue(())
        })
    })?;
    if let Some(t) = &tok {
        print_decoded(&mut out, t, &generated, &mut printed, true)?;
    }
    let _ = writeln!(out);
    let secs = start.elapsed().as_secs_f64();
    esay!(
        "{} tokens in {:.2} s ({:.1} tokens/s), KV cache on; {}",
        new.len(),
        secs,
        new.len() as f64 / secs.max(1e-9),
        weights.summary(&tracker)
    );
    Ok(())
}

/// A CPU backend whose allocations `sample` and `eval` count, for the weights line.
fn inference_cpu() -> (headroom_tensor::Cpu, Arc<MemoryTracker>) {
    let tracker = Arc::new(MemoryTracker::new());
    let cpu = headroom_tensor::Cpu::new()
        .with_alloc_hook(tracker.clone())
        .with_buffer_cache(INFERENCE_BUFFER_CACHE_BYTES);
    (cpu, tracker)
}

/// The freed buffers `sample` and `eval` keep for reuse. A decode step frees each layer's KV
/// cache as it grows it, and the next layer's takes that buffer (a mapping rounded to huge
/// pages), so the cache needs room for about two of them: 32 MiB holds two layers' keys of
/// Llama 3 8B at 8 K positions in bf16. On GPT-2 124M at 900 positions this halved the
/// decode step (12.6 → 6.7 s for 256 tokens) for 25 MiB more RSS; a larger cap only
/// holds more of a model load's freed buffers.
const INFERENCE_BUFFER_CACHE_BYTES: usize = 32 << 20;

/// Names the MPI build of the command to run `train --dist mpi` with; empty turns the hand-over
/// off. Unset, `headroom-mpi` is looked for beside this binary, then on the `PATH`.
const MPI_BUILD_ENV: &str = "HEADROOM_MPI";

/// Set on the MPI build when this command hands a run over to it, so a `HEADROOM_MPI` that
/// names a build without MPI fails instead of handing over to itself forever.
const HANDED_OVER_ENV: &str = "HEADROOM_MPI_HANDED_OVER";

/// `train --dist mpi` in a build without MPI: hand the whole command line to the MPI build
/// (`headroom-mpi`, crates/trainer-mpi), as git hands `git foo` to `git-foo`, so that
/// `mpirun -n N headroom train --zero S --dist mpi` works with both installed. The MPI build
/// lives outside the workspace because it links Open MPI; this build never does. On Unix the
/// process is replaced (same pid, environment and signals, which `mpirun` relies on).
fn delegate_to_mpi_build() -> CliResult<ExitCode> {
    const HOW: &str = "`--dist mpi` needs the MPI build of the command: install it with \
                       `cargo install --path crates/trainer-mpi` (the binary `headroom-mpi`, see \
                       the README) or name it in HEADROOM_MPI";
    if std::env::var_os(HANDED_OVER_ENV).is_some() {
        return Err(format!(
            "this headroom was built without MPI, yet a run was handed to it as the MPI build \
             ({MPI_BUILD_ENV} names the wrong binary); {HOW}"
        )
        .into());
    }
    let exe = find_mpi_build().ok_or_else(|| {
        format!("this headroom was built without MPI and no headroom-mpi was found; {HOW}")
    })?;
    let mut cmd = std::process::Command::new(&exe);
    cmd.args(std::env::args_os().skip(1))
        .env(HANDED_OVER_ENV, "1");
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        let e = cmd.exec();
        Err(format!("running the MPI build {}: {e}", exe.display()).into())
    }
    #[cfg(not(unix))]
    {
        let status = cmd
            .status()
            .map_err(|e| format!("running the MPI build {}: {e}", exe.display()))?;
        Ok(if status.success() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        })
    }
}

/// Where the MPI build is: `HEADROOM_MPI` when set (empty: nowhere), else `headroom-mpi`
/// beside this binary (where `cargo install` and a shared target directory put both), else
/// the first on the `PATH`.
fn find_mpi_build() -> Option<PathBuf> {
    let name = format!("headroom-mpi{}", std::env::consts::EXE_SUFFIX);
    if let Some(named) = std::env::var_os(MPI_BUILD_ENV) {
        return (!named.is_empty()).then(|| PathBuf::from(named));
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join(&name)));
    beside.filter(|p| p.is_file()).or_else(|| on_path(&name))
}

/// The first file called `name` in a directory of the `PATH`.
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Connects this process to the others of an MPI job: its end of the world communicator,
/// whose collectives wait at most the given time for the other ranks.
pub type ConnectMpi<'a> = dyn Fn(std::time::Duration) -> Result<Box<dyn headroom_zero::Collective>, headroom_zero::CommError>
    + 'a;

/// What a build of the command adds to it.
#[derive(Default)]
pub struct CliHooks<'a> {
    /// `train --dist mpi`: how this process joins the job (each process is one rank).
    pub mpi: Option<&'a ConnectMpi<'a>>,
}

/// Run the `headroom` command on this process's arguments, printing the error chain on
/// failure: the exit code to return from `main`.
pub fn main_with(hooks: &CliHooks<'_>) -> ExitCode {
    let result = run(parse_cli(), hooks);
    let _ = std::io::stdout().flush();
    if let Some(e) = STDOUT_ERROR
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
    {
        esay!("error: writing to stdout: {e}");
        return ExitCode::FAILURE;
    }
    match result {
        Ok(code) => code,
        Err(_) if STDOUT_CLOSED.load(Ordering::Relaxed) => ExitCode::SUCCESS,
        Err(e) => {
            for line in error_report(e.as_ref()) {
                esay!("{line}");
            }
            ExitCode::FAILURE
        }
    }
}

/// The lines `headroom` prints for an error: the error, then each cause in turn — except a
/// cause whose text the line above already quotes (many errors, ours and std's wrappers,
/// repeat their source in their own message), which would only say the same thing twice.
fn error_report(e: &(dyn std::error::Error + 'static)) -> Vec<String> {
    let mut above = e.to_string();
    let mut lines = vec![format!("error: {above}")];
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !above.contains(&text) {
            lines.push(format!("  caused by: {text}"));
        }
        above = text;
        source = cause.source();
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::error_report;
    use std::error::Error;
    use std::fmt;

    /// An error with a fixed message and an optional source.
    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl fmt::Display for Layer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }

    impl Error for Layer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.1.as_deref().map(|l| l as &(dyn Error + 'static))
        }
    }

    #[test]
    fn a_cause_the_line_above_quotes_is_not_printed_again() {
        let chain = Layer(
            "adapter run: run/adapter_config.json: No such file or directory",
            Some(Box::new(Layer(
                "run/adapter_config.json: No such file or directory",
                Some(Box::new(Layer("No such file or directory", None))),
            ))),
        );
        assert_eq!(
            error_report(&chain),
            ["error: adapter run: run/adapter_config.json: No such file or directory"]
        );
        let distinct = Layer(
            "ZeRO rank 0",
            Some(Box::new(Layer(
                "invalid input: token id 9",
                Some(Box::new(Layer("token id 9", None))),
            ))),
        );
        assert_eq!(
            error_report(&distinct),
            [
                "error: ZeRO rank 0",
                "  caused by: invalid input: token id 9"
            ]
        );
        // Only the line directly above counts: a cause that repeats an earlier line is kept.
        let skip = Layer(
            "the step failed",
            Some(Box::new(Layer(
                "the optimizer",
                Some(Box::new(Layer("the step failed", None))),
            ))),
        );
        assert_eq!(error_report(&skip).len(), 3);
    }
}
