//! The prefetching loader: worker threads fill reused batch buffers ahead of the consumer.
//!
//! Batch `b` is the windows at sampler positions `b·B .. (b+1)·B`. Worker `w` of `W` fills
//! batches `start + w, start + w + W, …` into buffers it owns, and sends them down its own
//! bounded channel; the consumer reads the channels round-robin, so batches arrive in order
//! without a reorder buffer. A buffer goes back to its worker's free list when the consumer
//! drops the [`Batch`]. Giving each worker its own buffers (rather than one shared pool) is
//! what rules out the deadlock where a fast worker holds every buffer while the consumer waits
//! for a slow one.

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};
use headroom_tensor::{AllocHook, DType, Device, MemoryCategory, TrackedAllocation};
use serde::{Deserialize, Serialize};

use crate::dataset::{
    positions_after_separator, try_with_capacity, DocumentBoundaries, TokenDataset,
};
use crate::sampler::{SamplerConfig, Window, WindowSampler};
use crate::tokens::{OutputToken, OutputType};
use crate::{DataError, Result};

/// Token storage of one side (inputs or targets) of a batch.
#[derive(Debug)]
enum TokenBuf {
    U32(Vec<u32>),
    I64(Vec<i64>),
}

/// One batch's memory: `B × T` inputs and `B × T` targets (the inputs shifted by one token),
/// row-major, allocated once and refilled for every batch it carries.
#[derive(Debug)]
pub struct BatchBuffer {
    inputs: TokenBuf,
    targets: TokenBuf,
    batch_size: usize,
    seq_len: usize,
    index: u64,
    epoch: u64,
    /// Loss-masked data only: whether each target counts (`B × T`, row-major).
    target_flags: Option<(Vec<bool>, TrackedAllocation)>,
    /// Per-document batches only: each input's position id (`B × T`, row-major).
    /// The position ids, their allocation, and where the documents they restart at begin.
    positions: Option<(Vec<u32>, TrackedAllocation, DocumentBoundaries)>,
    _tracked: TrackedAllocation,
}

/// `n` zeros, or [`DataError::Allocation`] when the memory cannot be had.
fn zeroed<T: Clone + Default>(n: usize) -> Result<Vec<T>> {
    let mut v = try_with_capacity(n)?;
    v.resize(n, T::default());
    Ok(v)
}

impl BatchBuffer {
    /// Allocate a buffer for `batch_size × seq_len` tokens of `output`, reported to `hook` as
    /// [`MemoryCategory::Data`] (the hook may refuse it: a memory budget).
    pub fn new(
        batch_size: usize,
        seq_len: usize,
        output: OutputType,
        hook: Option<&Arc<dyn AllocHook>>,
    ) -> Result<Self> {
        let n = batch_size
            .checked_mul(seq_len)
            .filter(|&n| n > 0 && n.checked_mul(2 * output.width()).is_some())
            .ok_or_else(|| {
                DataError::InvalidConfig(format!("batch of {batch_size} × {seq_len} tokens"))
            })?;
        let tracked = TrackedAllocation::register_as(
            hook,
            2 * n * output.width(),
            output.dtype(),
            Device::Cpu,
            MemoryCategory::Data,
        )?;
        // Fallible: the size comes from a sampler configuration that may have been read
        // from a saved position, and a failed allocation must be an error, not an abort.
        let make = || -> Result<TokenBuf> {
            Ok(match output {
                OutputType::U32 => TokenBuf::U32(zeroed(n)?),
                OutputType::I64 => TokenBuf::I64(zeroed(n)?),
            })
        };
        Ok(BatchBuffer {
            inputs: make()?,
            targets: make()?,
            batch_size,
            seq_len,
            index: 0,
            epoch: 0,
            target_flags: None,
            positions: None,
            _tracked: tracked,
        })
    }

    /// This buffer with room for the targets' loss-mask flags (`B × T` bytes, reported to
    /// `hook` as [`MemoryCategory::Data`]): what a dataset with a loss mask is loaded into.
    pub fn with_target_flags(mut self, hook: Option<&Arc<dyn AllocHook>>) -> Result<Self> {
        let n = self.batch_size * self.seq_len;
        let tracked =
            TrackedAllocation::register_as(hook, n, DType::U8, Device::Cpu, MemoryCategory::Data)?;
        self.target_flags = Some((zeroed(n)?, tracked));
        Ok(self)
    }

    /// This buffer with room for each input's position id within its document (`B × T`
    /// u32, reported to `hook` as [`MemoryCategory::Data`]) and for the target flags (see
    /// [`BatchBuffer::with_target_flags`]), the documents begun by `boundaries`: what a
    /// [`LoaderConfig::documents`] loader fills.
    pub fn with_positions(
        mut self,
        boundaries: DocumentBoundaries,
        hook: Option<&Arc<dyn AllocHook>>,
    ) -> Result<Self> {
        let n = self.batch_size * self.seq_len;
        let bytes = n.checked_mul(4).ok_or_else(|| {
            DataError::InvalidConfig(format!("{n} position ids overflow a byte count"))
        })?;
        let tracked = TrackedAllocation::register_as(
            hook,
            bytes,
            DType::U32,
            Device::Cpu,
            MemoryCategory::Data,
        )?;
        self.positions = Some((zeroed(n)?, tracked, boundaries));
        if self.target_flags.is_none() {
            self = self.with_target_flags(hook)?;
        }
        Ok(self)
    }

    /// For a [`LoaderConfig::documents`] loader: each input's position id, `B × T` row-major
    /// beside [`BatchBuffer::inputs_u32`] — 0 at the start of each row and of each document,
    /// else the previous input's + 1. `None` otherwise.
    pub fn positions(&self) -> Option<&[u32]> {
        self.positions.as_ref().map(|(p, _, _)| &p[..])
    }

    /// For loss-masked data: whether each target's loss counts (`true`), `B × T` row-major
    /// beside [`BatchBuffer::targets_u32`]; `None` for data without a mask (every target
    /// counts). With [`BatchBuffer::positions`], a target that starts a document never counts
    /// (the row's previous document cannot predict it: a padded batch has no such target).
    pub fn target_flags(&self) -> Option<&[bool]> {
        self.target_flags.as_ref().map(|(f, _)| &f[..])
    }

    /// Rows B.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Columns T.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Which batch of the stream this is.
    pub fn index(&self) -> u64 {
        self.index
    }

    /// Epoch of the batch's first window (0 in random mode).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Element type of inputs and targets.
    pub fn output_type(&self) -> OutputType {
        match self.inputs {
            TokenBuf::U32(_) => OutputType::U32,
            TokenBuf::I64(_) => OutputType::I64,
        }
    }

    /// Bytes of inputs plus targets.
    pub fn bytes(&self) -> usize {
        2 * self.batch_size * self.seq_len * self.output_type().width()
    }

    /// Inputs as `u32`, if that is the output type.
    pub fn inputs_u32(&self) -> Option<&[u32]> {
        match &self.inputs {
            TokenBuf::U32(v) => Some(v),
            TokenBuf::I64(_) => None,
        }
    }

    /// Targets as `u32`, if that is the output type.
    pub fn targets_u32(&self) -> Option<&[u32]> {
        match &self.targets {
            TokenBuf::U32(v) => Some(v),
            TokenBuf::I64(_) => None,
        }
    }

    /// Inputs as `i64`, if that is the output type.
    pub fn inputs_i64(&self) -> Option<&[i64]> {
        match &self.inputs {
            TokenBuf::I64(v) => Some(v),
            TokenBuf::U32(_) => None,
        }
    }

    /// Targets as `i64`, if that is the output type.
    pub fn targets_i64(&self) -> Option<&[i64]> {
        match &self.targets {
            TokenBuf::I64(v) => Some(v),
            TokenBuf::U32(_) => None,
        }
    }

    /// Input token at `(row, col)` whatever the output type; `None` out of range.
    pub fn input(&self, row: usize, col: usize) -> Option<u64> {
        self.at(&self.inputs, row, col)
    }

    /// Target token at `(row, col)` whatever the output type; `None` out of range.
    pub fn target(&self, row: usize, col: usize) -> Option<u64> {
        self.at(&self.targets, row, col)
    }

    fn at(&self, buf: &TokenBuf, row: usize, col: usize) -> Option<u64> {
        if col >= self.seq_len {
            return None;
        }
        let i = row.checked_mul(self.seq_len)?.checked_add(col)?;
        match buf {
            TokenBuf::U32(v) => v.get(i).map(|&t| t.to_token()),
            TokenBuf::I64(v) => v.get(i).map(|&t| t.to_token()),
        }
    }

    /// Pointer to the input storage (to check buffer reuse in tests and tools).
    pub fn inputs_ptr(&self) -> *const u8 {
        match &self.inputs {
            TokenBuf::U32(v) => v.as_ptr().cast(),
            TokenBuf::I64(v) => v.as_ptr().cast(),
        }
    }
}

/// Fill `out` with batch `batch_index` of `sampler`'s stream over `dataset`.
///
/// This is the whole data path (the loader's workers call it too): for each row, find the
/// window, decode `T` input tokens and the `T` targets one token later straight from the map
/// into the output type, checking every token against the dataset's vocabulary.
pub fn fill_batch(
    dataset: &TokenDataset,
    sampler: &WindowSampler,
    batch_index: u64,
    out: &mut BatchBuffer,
) -> Result<()> {
    let t = out.seq_len;
    if t as u64 != sampler.config().seq_len {
        return Err(DataError::InvalidConfig(format!(
            "buffer has seq_len {t}, sampler {}",
            sampler.config().seq_len
        )));
    }
    // The positions of all rows must be representable (a saved position can hold any value).
    let rows = out.batch_size as u64;
    let first = batch_index
        .checked_mul(rows)
        .filter(|f| f.checked_add(rows).is_some())
        .ok_or_else(|| DataError::InvalidConfig(format!("batch index {batch_index} overflows")))?;
    out.index = batch_index;
    out.epoch = sampler.epoch_of(first);
    // The rows first: a separator's documents are read from the decoded inputs.
    match (&mut out.inputs, &mut out.targets) {
        (TokenBuf::U32(x), TokenBuf::U32(y)) => fill_rows(dataset, sampler, first, t, x, y)?,
        (TokenBuf::I64(x), TokenBuf::I64(y)) => fill_rows(dataset, sampler, first, t, x, y)?,
        _ => {
            return Err(DataError::InvalidConfig(
                "inputs and targets differ in type".into(),
            ))
        }
    }
    if dataset.has_loss_mask() || out.positions.is_some() {
        let Some((flags, _)) = out.target_flags.as_mut() else {
            return Err(DataError::InvalidConfig(
                "the dataset has a loss mask but the batch buffer has no room for its flags \
                 (BatchBuffer::with_target_flags)"
                    .into(),
            ));
        };
        fill_target_flags(dataset, sampler, first, t, flags)?;
        match out.positions.as_mut() {
            Some((positions, _, DocumentBoundaries::EndsWith(separator))) => match &out.inputs {
                TokenBuf::U32(x) => positions_after(*separator, t, x, positions, flags),
                TokenBuf::I64(x) => positions_after(*separator, t, x, positions, flags),
            },
            Some((positions, _, DocumentBoundaries::Index)) => {
                fill_positions(dataset, sampler, first, t, positions, flags)?
            }
            None => {}
        }
    }
    Ok(())
}

/// Position ids of documents that end with `separator`, from the batch's decoded inputs (one
/// pass over memory the copy just wrote, by [`positions_after_separator`]); a target whose
/// input is a separator starts a document, so its flag is cleared.
fn positions_after<O: OutputToken>(
    separator: u32,
    t: usize,
    inputs: &[O],
    positions: &mut [u32],
    flags: &mut [bool],
) {
    for ((row_inputs, row_positions), row_flags) in inputs
        .chunks_exact(t)
        .zip(positions.chunks_exact_mut(t))
        .zip(flags.chunks_exact_mut(t))
    {
        let ids = row_inputs.iter().map(|&x| x.to_token());
        positions_after_separator(ids.clone(), separator, row_positions);
        for (id, f) in ids.zip(row_flags) {
            *f &= id != u64::from(separator);
        }
    }
}

/// Each row's targets' flags: the window `[s, s + T]` predicts tokens `s + 1 ..= s + T`.
fn fill_target_flags(
    dataset: &TokenDataset,
    sampler: &WindowSampler,
    first: u64,
    t: usize,
    flags: &mut [bool],
) -> Result<()> {
    for (row, out) in flags.chunks_exact_mut(t).enumerate() {
        let window = sampler.window(first + row as u64);
        let segment = dataset.segments().get(window.segment);
        let copied = match segment.map(|s| s.loss_mask()) {
            Some(Some(mask)) => usize::try_from(window.start)
                .ok()
                .and_then(|s| s.checked_add(1))
                .and_then(|s| mask.copy_to(s, out)),
            Some(None) => {
                out.fill(true);
                Some(())
            }
            None => None,
        };
        if copied.is_none() {
            return Err(DataError::InvalidConfig(format!(
                "window {window:?} lies outside the dataset's loss mask"
            )));
        }
    }
    Ok(())
}

/// Each row's position ids from the documents of its segment's index, and the flags of the
/// targets that start a document cleared.
fn fill_positions(
    dataset: &TokenDataset,
    sampler: &WindowSampler,
    first: u64,
    t: usize,
    positions: &mut [u32],
    flags: &mut [bool],
) -> Result<()> {
    // The window's T inputs and the one token past them: its last target.
    let mut row_positions = try_with_capacity::<u32>(t + 1)?;
    row_positions.resize(t + 1, 0);
    for (row, (out, row_flags)) in positions
        .chunks_exact_mut(t)
        .zip(flags.chunks_exact_mut(t))
        .enumerate()
    {
        let window = sampler.window(first + row as u64);
        let filled = dataset.segments().get(window.segment).and_then(|segment| {
            segment.document_positions(DocumentBoundaries::Index, window.start, &mut row_positions)
        });
        if filled.is_none() {
            return Err(DataError::InvalidConfig(format!(
                "window {window:?}: no document positions for it from the data's index"
            )));
        }
        out.copy_from_slice(&row_positions[..t]);
        for (flag, &p) in row_flags.iter_mut().zip(&row_positions[1..]) {
            *flag &= p != 0;
        }
    }
    Ok(())
}

fn fill_rows<O: OutputToken>(
    dataset: &TokenDataset,
    sampler: &WindowSampler,
    first: u64,
    t: usize,
    inputs: &mut [O],
    targets: &mut [O],
) -> Result<()> {
    let vocab = dataset.vocab_size();
    let rows = inputs.len() / t.max(1);
    // Each row's window is computed once per batch (a blend's schedule lookup or a random
    // draw), for up to CHUNK rows at a time on the stack: the touch pass and the copy pass
    // below both read it.
    const CHUNK: usize = 64;
    let mut windows = [Window {
        segment: 0,
        start: 0,
    }; CHUNK];
    let tokens_of = |window: &Window| {
        let segment = dataset.segments().get(window.segment);
        let start = usize::try_from(window.start).ok();
        let tokens = segment
            .zip(start)
            .and_then(|(s, start)| s.tokens().sub(start, t + 1));
        (segment, tokens)
    };
    for chunk_start in (0..rows).step_by(CHUNK) {
        let chunk = CHUNK.min(rows - chunk_start);
        for (i, w) in windows[..chunk].iter_mut().enumerate() {
            *w = sampler.window(first + (chunk_start + i) as u64);
        }
        // Random windows of a large file miss the TLB and the caches. Touching one byte per
        // cache line of every window first issues all those misses back to back, so the
        // memory system serves them in parallel; the copy pass below then runs on cached
        // lines.
        let mut touched = 0u8;
        for window in &windows[..chunk] {
            if let (_, Some(tokens)) = tokens_of(window) {
                for &b in tokens.as_bytes().iter().step_by(64) {
                    touched ^= b;
                }
            }
        }
        std::hint::black_box(touched);
        let span = chunk_start * t..(chunk_start + chunk) * t;
        for ((window, x), y) in windows[..chunk]
            .iter()
            .zip(inputs[span.clone()].chunks_exact_mut(t))
            .zip(targets[span].chunks_exact_mut(t))
        {
            let (Some(segment), Some(tokens)) = tokens_of(window) else {
                return Err(DataError::InvalidConfig(format!(
                    "window {window:?} lies outside the dataset (sampler built for other data?)"
                )));
            };
            // Targets are the inputs shifted by one: decode the T inputs once, copy T - 1 of
            // them (cache-hot, already converted and checked), and decode only the last target.
            let last = tokens.sub(t, 1).unwrap_or(tokens);
            let checked = tokens.decode_into(x, vocab).and_then(|()| {
                let (head, tail) = y.split_at_mut(t - 1);
                head.copy_from_slice(x.get(1..).unwrap_or(&[]));
                last.decode_into(tail, vocab).map_err(|(_, v)| (t, v))
            });
            if let Err((i, value)) = checked {
                return Err(DataError::TokenOutOfRange {
                    what: segment.name().to_string(),
                    position: window.start + i as u64,
                    value: i128::from(value),
                    vocab_size: vocab,
                });
            }
        }
    }
    Ok(())
}

/// How a [`Loader`] runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderConfig {
    /// Rows per batch B.
    pub batch_size: usize,
    /// Element type of inputs and targets.
    pub output: OutputType,
    /// Worker threads; 0 fills batches on the calling thread (no prefetch).
    pub workers: usize,
    /// Most batches allocated at once (filled, queued or held by the consumer).
    pub max_buffered_batches: usize,
    /// Optional memory cap on batch buffers; the buffer count is lowered to fit it.
    pub max_buffered_bytes: Option<usize>,
    /// Fill each batch's [`BatchBuffer::positions`] from the documents these boundaries begin,
    /// and leave out the targets that start a document: what packed training with attention
    /// inside each document reads. [`DocumentBoundaries::Index`] refuses data without a
    /// Megatron index; [`DocumentBoundaries::EndsWith`] a separator outside the vocabulary.
    #[serde(default)]
    pub documents: Option<DocumentBoundaries>,
}

impl LoaderConfig {
    /// `batch_size` rows of `i64`, two workers, four buffers, no byte cap.
    pub fn new(batch_size: usize) -> Self {
        LoaderConfig {
            batch_size,
            output: OutputType::I64,
            workers: 2,
            max_buffered_batches: 4,
            max_buffered_bytes: None,
            documents: None,
        }
    }
}

/// A loader's complete position: enough to rebuild it and continue the identical stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// The sampler (mode, sequence length, seed, shard).
    pub sampler: SamplerConfig,
    /// Rows per batch.
    pub batch_size: u64,
    /// The next batch `next_batch` will return.
    pub next_batch: u64,
    /// Epoch of that batch (informative: it follows from `next_batch`).
    pub epoch: u64,
    /// [`TokenDataset::fingerprint`] of the data the position refers to.
    pub dataset_fingerprint: u64,
}

struct Filled {
    result: Result<()>,
    buffer: BatchBuffer,
}

enum Mode {
    Inline {
        free_tx: Sender<BatchBuffer>,
        free_rx: Receiver<BatchBuffer>,
    },
    Workers {
        filled: Vec<Receiver<Filled>>,
        free: Vec<Sender<BatchBuffer>>,
        handles: Vec<JoinHandle<()>>,
    },
}

/// A batch lent by the loader; its buffer returns to the loader when this is dropped.
#[derive(Debug)]
pub struct Batch<'a> {
    buffer: Option<BatchBuffer>,
    home: &'a Sender<BatchBuffer>,
}

impl std::ops::Deref for Batch<'_> {
    type Target = BatchBuffer;
    fn deref(&self) -> &BatchBuffer {
        // Only `drop` takes the buffer out.
        self.buffer
            .as_ref()
            .unwrap_or_else(|| unreachable!("batch buffer taken before drop"))
    }
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.buffer.take() {
            // Fails only when the loader is shutting down; then the buffer is simply freed.
            let _ = self.home.send(b);
        }
    }
}

/// Hands out batches in order, prefetched by worker threads into a bounded set of reused
/// buffers.
pub struct Loader {
    dataset: Arc<TokenDataset>,
    sampler: Arc<WindowSampler>,
    config: LoaderConfig,
    start_batch: u64,
    next_batch: u64,
    buffers: usize,
    mode: Option<Mode>,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("config", &self.config)
            .field("next_batch", &self.next_batch)
            .field("buffers", &self.buffers)
            .finish()
    }
}

impl Loader {
    /// A loader over `dataset` from batch 0. Batch buffers are reported to `hook`.
    pub fn new(
        dataset: Arc<TokenDataset>,
        sampler: SamplerConfig,
        config: LoaderConfig,
        hook: Option<Arc<dyn AllocHook>>,
    ) -> Result<Self> {
        Self::start(dataset, sampler, config, hook, 0)
    }

    /// A loader that continues exactly where `state` was saved.
    pub fn resume(
        dataset: Arc<TokenDataset>,
        state: &LoaderState,
        config: LoaderConfig,
        hook: Option<Arc<dyn AllocHook>>,
    ) -> Result<Self> {
        if state.dataset_fingerprint != dataset.fingerprint() {
            return Err(DataError::ResumeMismatch(
                "the saved position belongs to a different dataset".into(),
            ));
        }
        if state.batch_size != config.batch_size as u64 {
            return Err(DataError::ResumeMismatch(format!(
                "saved with batch size {}, resumed with {}",
                state.batch_size, config.batch_size
            )));
        }
        // Every row of the next batch needs a position that fits in u64.
        let end = state
            .next_batch
            .checked_add(1)
            .and_then(|n| n.checked_mul(state.batch_size));
        if end.is_none() {
            return Err(DataError::ResumeMismatch(format!(
                "saved position (batch {} of {} rows) is past the last representable window",
                state.next_batch, state.batch_size
            )));
        }
        Self::start(
            dataset,
            state.sampler.clone(),
            config,
            hook,
            state.next_batch,
        )
    }

    fn start(
        dataset: Arc<TokenDataset>,
        sampler: SamplerConfig,
        config: LoaderConfig,
        hook: Option<Arc<dyn AllocHook>>,
        start_batch: u64,
    ) -> Result<Self> {
        let seq_len = usize::try_from(sampler.seq_len)
            .map_err(|_| DataError::InvalidConfig("seq_len exceeds usize".into()))?;
        match config.documents {
            Some(DocumentBoundaries::Index) => {
                if let Some(s) = dataset
                    .segments()
                    .iter()
                    .find(|s| s.sequence_index().is_none())
                {
                    return Err(DataError::InvalidConfig(format!(
                        "{}: positions per document need the data's document boundaries, and \
                         this file has none: a Megatron .bin/.idx pair has them (`headroom data \
                         build --format megatron`), and a file whose documents each end with a \
                         separator token can name it (DocumentBoundaries::EndsWith)",
                        s.name()
                    )));
                }
            }
            Some(DocumentBoundaries::EndsWith(separator))
                if u64::from(separator) >= dataset.vocab_size() =>
            {
                return Err(DataError::InvalidConfig(format!(
                    "documents ending with token {separator}: the data's vocabulary has {} ids, \
                     so no document would ever end",
                    dataset.vocab_size()
                )));
            }
            Some(DocumentBoundaries::EndsWith(_)) | None => {}
        }
        let sampler = Arc::new(WindowSampler::new(&dataset, sampler)?);
        let batch_bytes = config
            .batch_size
            .saturating_mul(seq_len)
            .saturating_mul(2 * config.output.width());
        let by_bytes = config
            .max_buffered_bytes
            .map_or(usize::MAX, |cap| cap / batch_bytes.max(1));
        let buffers = config.max_buffered_batches.min(by_bytes);
        let lanes = config.workers.max(1);
        if buffers < lanes {
            return Err(DataError::InvalidConfig(format!(
                "{buffers} batch buffers fit the limits but {lanes} are needed (one per worker)"
            )));
        }
        let per_lane = buffers / lanes;
        let mut pools = Vec::with_capacity(lanes);
        for _ in 0..lanes {
            let (tx, rx) = unbounded();
            for _ in 0..per_lane {
                let mut b =
                    BatchBuffer::new(config.batch_size, seq_len, config.output, hook.as_ref())?;
                if dataset.has_loss_mask() {
                    b = b.with_target_flags(hook.as_ref())?;
                }
                if let Some(boundaries) = config.documents {
                    b = b.with_positions(boundaries, hook.as_ref())?;
                }
                // The receiver is alive right here, so this cannot fail.
                let _ = tx.send(b);
            }
            pools.push((tx, rx));
        }
        let mode = if config.workers == 0 {
            let (free_tx, free_rx) = pools.pop().ok_or_else(|| DataError::WorkerStopped(0))?;
            Mode::Inline { free_tx, free_rx }
        } else {
            let mut filled = Vec::with_capacity(lanes);
            let mut free = Vec::with_capacity(lanes);
            let mut handles = Vec::with_capacity(lanes);
            for (w, (free_tx, free_rx)) in pools.into_iter().enumerate() {
                let (filled_tx, filled_rx) = bounded::<Filled>(per_lane);
                let ds = Arc::clone(&dataset);
                let sm = Arc::clone(&sampler);
                // Saturating: past the end of the position space `fill_batch` reports the
                // overflow as an error instead of the worker panicking.
                let mut batch = start_batch.saturating_add(w as u64);
                let stride = lanes as u64;
                let handle = std::thread::Builder::new()
                    .name(format!("headroom-data-{w}"))
                    .spawn(move || {
                        // Ends when the loader drops its free-list sender (recv fails) or the
                        // filled receiver (send fails).
                        while let Ok(mut buffer) = free_rx.recv() {
                            let result = fill_batch(&ds, &sm, batch, &mut buffer);
                            if filled_tx.send(Filled { result, buffer }).is_err() {
                                break;
                            }
                            batch = batch.saturating_add(stride);
                        }
                    })
                    .map_err(|e| DataError::io("<worker thread>", e))?;
                filled.push(filled_rx);
                free.push(free_tx);
                handles.push(handle);
            }
            Mode::Workers {
                filled,
                free,
                handles,
            }
        };
        Ok(Loader {
            dataset,
            sampler,
            config,
            start_batch,
            next_batch: start_batch,
            buffers: per_lane * lanes,
            mode: Some(mode),
        })
    }

    /// The next batch. An error (a token outside the vocabulary) consumes that batch's place
    /// in the stream; the following call returns the batch after it.
    pub fn next_batch(&mut self) -> Result<Batch<'_>> {
        let b = self.next_batch;
        self.next_batch = b.checked_add(1).ok_or_else(|| {
            DataError::InvalidConfig("the batch counter has reached 2^64 - 1".into())
        })?;
        match self.mode.as_ref() {
            Some(Mode::Inline { free_tx, free_rx }) => {
                let mut buffer = free_rx
                    .try_recv()
                    .map_err(|_| DataError::WorkerStopped(0))?;
                match fill_batch(&self.dataset, &self.sampler, b, &mut buffer) {
                    Ok(()) => Ok(Batch {
                        buffer: Some(buffer),
                        home: free_tx,
                    }),
                    Err(e) => {
                        let _ = free_tx.send(buffer);
                        Err(e)
                    }
                }
            }
            Some(Mode::Workers { filled, free, .. }) => {
                let lane = ((b - self.start_batch) % filled.len() as u64) as usize;
                let (Some(rx), Some(home)) = (filled.get(lane), free.get(lane)) else {
                    return Err(DataError::WorkerStopped(lane));
                };
                let Filled { result, buffer } =
                    rx.recv().map_err(|_| DataError::WorkerStopped(lane))?;
                match result {
                    Ok(()) => Ok(Batch {
                        buffer: Some(buffer),
                        home,
                    }),
                    Err(e) => {
                        let _ = home.send(buffer);
                        Err(e)
                    }
                }
            }
            None => Err(DataError::WorkerStopped(0)),
        }
    }

    /// The position to save: restoring it with [`Loader::resume`] continues with the batch the
    /// next call to [`Loader::next_batch`] would have returned.
    pub fn state(&self) -> LoaderState {
        LoaderState {
            sampler: self.sampler.config().clone(),
            batch_size: self.config.batch_size as u64,
            next_batch: self.next_batch,
            epoch: self.sampler.epoch_of(
                self.next_batch
                    .saturating_mul(self.config.batch_size as u64),
            ),
            dataset_fingerprint: self.dataset.fingerprint(),
        }
    }

    /// The sampler behind the stream.
    pub fn sampler(&self) -> &WindowSampler {
        &self.sampler
    }

    /// The dataset behind the stream.
    pub fn dataset(&self) -> &Arc<TokenDataset> {
        &self.dataset
    }

    /// Batch buffers allocated (the memory bound is this × [`BatchBuffer::bytes`]).
    pub fn buffer_count(&self) -> usize {
        self.buffers
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        if let Some(Mode::Workers {
            filled,
            free,
            handles,
        }) = self.mode.take()
        {
            // Closing both channel ends unblocks every worker wherever it waits.
            drop(filled);
            drop(free);
            for h in handles {
                let _ = h.join();
            }
        }
    }
}
