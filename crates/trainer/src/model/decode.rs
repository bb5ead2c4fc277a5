//! Cached decoding: the model's own blocks run one step of new tokens at a time, each layer
//! reading the keys and values of every earlier position from a [`KvCache`] instead of
//! recomputing them. Sampling (`headroom sample`) is built on it.
//!
//! Memory, per layer (storage precision, after rotary embedding):
//! - `k`: `[B, kv_heads, capacity, hs]`, the first `len` positions of each head in use
//! - `v`: `[B, kv_heads, capacity, hs]`
//!
//! so `2 · layers · B · kv_heads · capacity · hs` elements in all — GQA's fewer key/value
//! heads shrink it by `heads / kv_heads`. Counted as activations.
//!
//! Trade-off: a step writes its keys and values into room the cache already has; when the room
//! runs out, the layer moves to a buffer [`KV_GROWTH`] positions larger (capped at the model's
//! context), so a cache is copied once per 256 steps instead of once per step — at a batch of
//! 8 sequences and 850 positions that copy moved as many bytes per step as the weights. The
//! room costs at most 255 positions per layer (a prompt's first step allocates exactly).
//! Attention reads the rows in use in place where the backend can
//! (`attention_forward_cached`, the CPU) and copies them out where it cannot (CUDA, one
//! exact-length copy per step, as the concatenation did).

use std::ops::Range;

use headroom_attn::{AttentionForward, AttnError, BackendLimit, DocumentMask};
use headroom_profiler::label_absolute;
use headroom_tensor::{MemoryCategory, Tensor};

use crate::model::ops::ModelOps;
use crate::model::params;
use crate::model::transformer::{Documents, Geometry, Model};
use crate::model::Family;
use crate::ops::matmul::DecodingProducts;
use crate::{Result, TrainError};

/// One layer's cached keys and values, `[B, kv_heads, len, hs]` each.
#[derive(Debug)]
pub struct LayerKv<T> {
    k: Option<T>,
    v: Option<T>,
    len: usize,
}

impl<T> LayerKv<T> {
    /// Positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Positions a layer's cache grows by when a step finds no room (see the module notes).
pub const KV_GROWTH: usize = 256;

/// The keys and values attention reads in a block: the step's own (training, where backward
/// needs them) or the cache's first `len` positions, the step's included.
pub(crate) enum KvInput<'a, T> {
    Fresh(T, T),
    Cached { k: &'a T, v: &'a T, len: usize },
}

impl<T> KvInput<'_, T> {
    /// The step's own keys and values, for backward: a cached decode saves nothing.
    pub(crate) fn into_fresh(self) -> Result<(T, T)> {
        match self {
            KvInput::Fresh(k, v) => Ok((k, v)),
            KvInput::Cached { .. } => Err(TrainError::Input(
                "a cached decode step cannot save activations for backward".into(),
            )),
        }
    }
}

/// What a block's attention gives: the forward state backward needs (training), or the output
/// alone (a cached decode step keeps nothing for backward).
pub(crate) enum Attended<T> {
    Kept(AttentionForward<T>),
    Output(T),
}

impl<T> Attended<T> {
    /// The output `[B, NH, T, hs]`.
    pub(crate) fn output(&self) -> &T {
        match self {
            Attended::Kept(f) => &f.output,
            Attended::Output(o) => o,
        }
    }

    /// The forward state, for backward.
    pub(crate) fn into_kept(self) -> Result<AttentionForward<T>> {
        match self {
            Attended::Kept(f) => Ok(f),
            Attended::Output(_) => Err(TrainError::Input(
                "a cached decode step cannot save attention for backward".into(),
            )),
        }
    }
}

/// Every layer's [`LayerKv`] for a batch of `B` sequences decoded together.
///
/// A batch of prompts of different lengths ([`Model::decode_ragged`]) is lined up by padding
/// after what the rows share: row `b`'s cache slots `hidden[b]` hold padding, hidden from its
/// attention, and its later slots hold positions `slot − hidden[b].len()`. So every row
/// computes what it computes alone, up to the summation order of batched matrix products.
#[derive(Debug)]
pub struct KvCache<T> {
    layers: Vec<LayerKv<T>>,
    batch: usize,
    /// Per batch row, the cache slots holding padding (empty ranges when unpadded).
    hidden: Vec<Range<usize>>,
}

impl<T: Tensor> KvCache<T> {
    /// Positions cached (the same in every layer).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerKv::len)
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sequences decoded together.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Positions each layer has room for before it must move to a larger buffer (0 when
    /// empty).
    pub fn capacity(&self) -> usize {
        self.layers
            .first()
            .and_then(|l| l.k.as_ref())
            .map_or(0, |k| k.shape().dims().get(2).copied().unwrap_or(0))
    }

    /// Whether some row holds padding ([`Model::decode_ragged`]).
    pub fn is_padded(&self) -> bool {
        self.hidden.iter().any(|h| !h.is_empty())
    }

    /// Row `b`'s position of cache slot `slot`: the slot itself, less the row's padding when
    /// past it; padding slots sit at the padding's start.
    fn position(&self, b: usize, slot: usize) -> usize {
        match self.hidden.get(b) {
            Some(h) if slot >= h.end => slot - h.len(),
            Some(h) if slot >= h.start => h.start,
            _ => slot,
        }
    }

    /// What a step of `t` new slots per row needs beyond the unpadded step: each row's
    /// positions and the mask hiding its padding. `None` when no row is padded.
    fn step_documents(&self, t: usize) -> Result<Option<Documents>> {
        if !self.is_padded() {
            return Ok(None);
        }
        let len = self.len();
        let positions = (0..self.batch)
            .flat_map(|b| (len..len + t).map(move |slot| (b, slot)))
            .map(|(b, slot)| {
                u32::try_from(self.position(b, slot))
                    .map_err(|_| TrainError::Input(format!("decode: position {slot} exceeds u32")))
            })
            .collect::<Result<Vec<_>>>()?;
        let mask = DocumentMask::padding(self.batch, t, &self.hidden)
            .map_err(|e| TrainError::Input(format!("decode: {e}")))?;
        Ok(Some(Documents::padded(positions, mask)))
    }

    /// Bytes the cache holds now, its room included.
    pub fn size_in_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| l.k.iter().chain(l.v.iter()))
            .map(Tensor::size_in_bytes)
            .sum()
    }
}

impl<B: ModelOps> Model<B> {
    /// An empty cache for `batch` sequences.
    pub fn kv_cache(&self, batch: usize) -> KvCache<B::Tensor> {
        KvCache {
            layers: (0..self.cfg.layers)
                .map(|_| LayerKv {
                    k: None,
                    v: None,
                    len: 0,
                })
                .collect(),
            batch,
            hidden: vec![0..0; batch],
        }
    }

    /// The keys and values a block's attention reads: `k`, `v` themselves without a cache;
    /// with one, the cache's positions with `k`, `v` written after them (in place while the
    /// layer has room, else after a move to a larger buffer).
    pub(crate) fn extend_kv<'a>(
        &self,
        kv: Option<&'a mut LayerKv<B::Tensor>>,
        k: B::Tensor,
        v: B::Tensor,
    ) -> Result<KvInput<'a, B::Tensor>> {
        let Some(cache) = kv else {
            return Ok(KvInput::Fresh(k, v));
        };
        let (len, t) = (cache.len, k.shape().dims().get(2).copied().unwrap_or(0));
        let need = len + t;
        let max_seq = self.cfg.max_seq;
        let room = |stored: &B::Tensor| stored.shape().dims().get(2).copied().unwrap_or(0);
        let grow = |old: Option<B::Tensor>, new: &B::Tensor| -> Result<B::Tensor> {
            let mut stored = match old {
                Some(old) if room(&old) >= need => old,
                old => {
                    // A first step allocates exactly (a prompt); later ones leave room.
                    let capacity = if old.is_none() {
                        need
                    } else {
                        need.next_multiple_of(KV_GROWTH).min(max_seq.max(need))
                    };
                    let mut dims = new.shape().dims().to_vec();
                    dims[2] = capacity;
                    let _g = MemoryCategory::Activations.enter();
                    let mut fresh = self.backend().uninit(dims, new.dtype())?;
                    if let Some(old) = old {
                        self.backend().write_seq(&mut fresh, 0, &old, len)?;
                    }
                    fresh
                }
            };
            self.backend().write_seq(&mut stored, len, new, t)?;
            Ok(stored)
        };
        cache.k = Some(grow(cache.k.take(), &k)?);
        cache.v = Some(grow(cache.v.take(), &v)?);
        cache.len = need;
        match (&cache.k, &cache.v) {
            (Some(k), Some(v)) => Ok(KvInput::Cached { k, v, len: need }),
            _ => Err(TrainError::Input("the KV cache lost a tensor".into())),
        }
    }

    /// A block's attention of `q` over `kv` (see [`Model::attention`]): over the step's own
    /// keys and values, kept for backward; over a cache's, the output alone, the cache read in
    /// place where the backend can and through exact-length copies where it cannot.
    pub(crate) fn attend(
        &self,
        q: &B::Tensor,
        kv: &KvInput<'_, B::Tensor>,
        g: Geometry<'_>,
    ) -> Result<Attended<B::Tensor>> {
        let (k, v, len) = match kv {
            KvInput::Fresh(k, v) => return Ok(Attended::Kept(self.attention(q, k, v, g)?)),
            KvInput::Cached { k, v, len } => (*k, *v, *len),
        };
        let _g = MemoryCategory::Activations.enter();
        let be = self.backend();
        let config = &self.opts.attention;
        let mask = g.documents.map(Documents::mask);
        let output = match be.attention_forward_cached(q, k, v, len, config, mask) {
            Err(AttnError::Unsupported {
                limit: BackendLimit::CachedKeys,
                ..
            }) => {
                let exact = |stored: &B::Tensor| -> Result<B::Tensor> {
                    let mut dims = stored.shape().dims().to_vec();
                    dims[2] = len;
                    let _w = MemoryCategory::Workspace.enter();
                    let mut rows = be.uninit(dims, stored.dtype())?;
                    be.truncate_seq(&mut rows, stored)?;
                    Ok(rows)
                };
                let (k, v) = (exact(k)?, exact(v)?);
                match mask {
                    Some(m) => be.attention_forward_documents(q, &k, &v, config, m)?.output,
                    None => be.attention_forward(q, &k, &v, config)?.output,
                }
            }
            other => other?,
        };
        Ok(Attended::Output(self.keep(output)?))
    }

    /// One decode step: `tokens` `[B, t]` (row-major, `B` the cache's batch) are the positions
    /// `cache.len() ..` of each sequence; runs them through every block, growing the cache,
    /// and returns the logits `[B, V]` (f32) of each sequence's last new position — the
    /// distribution of the token after it. A prompt of `t` tokens runs its first `t − 1`
    /// positions without the head (only the last position's logits are needed).
    pub fn decode(&self, cache: &mut KvCache<B::Tensor>, tokens: &[u32]) -> Result<Vec<f32>> {
        let _rows = DecodingProducts::enter();
        let (b, t) = self.check_decode(cache, tokens)?;
        if t > 1 {
            let head: Vec<u32> = tokens
                .chunks_exact(t)
                .flat_map(|row| row[..t - 1].iter().copied())
                .collect();
            self.step(cache, &head, Geometry::new(b, t - 1))?;
        }
        let last: Vec<u32> = tokens.chunks_exact(t).map(|row| row[t - 1]).collect();
        let g = Geometry::new(b, 1);
        let x = self.step(cache, &last, g)?;
        self.logits_of(&x, g)
    }

    /// A first step of rows of different lengths, one per sequence of `cache` (which must
    /// hold no padding yet): each row is padded on the left to the longest, after what the
    /// cache holds, and the padding is hidden from the row from then on — its later steps
    /// ([`Model::decode`]) see the cache's shared start and the row's own tokens only, at the
    /// positions they would have alone. Returns each row's next-token logits `[B, V]` (f32).
    ///
    /// That is transformers' left padding with an attention mask and position ids from it,
    /// except that the shared start (a few-shot prefix, computed once and repeated by
    /// [`Model::repeat_cache`]) is stored before the padding. A row computes what it would
    /// alone up to the summation order of the batched matrix products. Refused (nothing
    /// cached) for an empty row, a row count other than the cache's batch, a cache already
    /// padded, or a row past the model's context.
    pub fn decode_ragged(
        &self,
        cache: &mut KvCache<B::Tensor>,
        rows: &[&[u32]],
    ) -> Result<Vec<f32>> {
        if rows.len() != cache.batch || rows.iter().any(|r| r.is_empty()) || cache.is_padded() {
            return Err(TrainError::Input(format!(
                "decode_ragged: {} rows (each at least one token) for an unpadded cache of {} \
                 sequences",
                rows.len(),
                cache.batch
            )));
        }
        let longest = rows.iter().map(|r| r.len()).max().unwrap_or(0);
        let start = cache.len();
        // Padding repeats the row's first token: any id in the vocabulary would do, its keys
        // are never seen.
        let tokens: Vec<u32> = rows
            .iter()
            .flat_map(|r| std::iter::repeat_n(r[0], longest - r.len()).chain(r.iter().copied()))
            .collect();
        cache.hidden = rows
            .iter()
            .map(|r| start..start + (longest - r.len()))
            .collect();
        let logits = self.decode(cache, &tokens);
        if logits.is_err() && cache.len() == start {
            // Refused before the first block: the cache is as it was.
            cache.hidden = vec![start..start; cache.batch];
        }
        logits
    }

    /// One decode step of `tokens` `[B, t]` as [`Model::decode`], returning the logits
    /// `[rows, V]` (f32) of the new positions `rows` (indices into the step's `B·t` rows, in
    /// the order given), each the distribution of the token after it: the head runs on those
    /// rows alone ([`Model::logits_at`]'s trade-off). A continuation scored after a cached
    /// context.
    pub fn decode_at(
        &self,
        cache: &mut KvCache<B::Tensor>,
        tokens: &[u32],
        rows: &[usize],
    ) -> Result<Vec<f32>> {
        let _rows = DecodingProducts::enter();
        let (b, t) = self.check_decode(cache, tokens)?;
        if let Some(&r) = rows.iter().find(|&&r| r >= b * t) {
            return Err(TrainError::Input(format!(
                "decode: row {r} of a step of {} token rows",
                b * t
            )));
        }
        let x = self.step(cache, tokens, Geometry::new(b, t))?;
        self.logits_of_rows(x, rows)
    }

    /// Keep only the sequences `rows` of `cache` (increasing indices into its batch, at least
    /// one): a batch drops the rows that stopped generating, so later steps compute only what
    /// is still wanted. Each kept row keeps its positions, padding and room (its positions in
    /// use copied, one layer at a time, so the copy costs one layer's keys and values beside
    /// the cache), and its later steps compute what they would have in the whole batch
    /// (bitwise while the batch's products take its rows one by one, as decoding batches of
    /// up to 16 rows do). A call refused for its `rows` changes nothing; one that fails while
    /// copying leaves the cache empty, which decodes from the start.
    pub fn keep_rows(&self, cache: &mut KvCache<B::Tensor>, rows: &[usize]) -> Result<()> {
        let increasing = rows.windows(2).all(|w| w[0] < w[1]);
        if rows.is_empty() || !increasing || rows.last().is_some_and(|&r| r >= cache.batch) {
            return Err(TrainError::Input(format!(
                "keep_rows: rows {rows:?} of a cache of {} sequences (increasing, at least one)",
                cache.batch
            )));
        }
        if rows.len() == cache.batch {
            return Ok(());
        }
        let len = cache.len();
        let select = |t: &B::Tensor| -> Result<B::Tensor> {
            let mut dims = t.shape().dims().to_vec();
            dims[0] = rows.len();
            let _g = MemoryCategory::Activations.enter();
            let mut kept = self.backend().uninit(dims, t.dtype())?;
            self.backend().select_batch(&mut kept, t, rows, len)?;
            Ok(kept)
        };
        let copied = cache.layers.iter_mut().try_for_each(|layer| -> Result<()> {
            for t in [&mut layer.k, &mut layer.v] {
                if let Some(old) = t.as_ref() {
                    *t = Some(select(old)?);
                }
            }
            Ok(())
        });
        if let Err(e) = copied {
            // Some layers hold the kept rows and some all of them: start the cache over.
            *cache = self.kv_cache(rows.len());
            return Err(e);
        }
        cache.hidden = rows.iter().map(|&r| cache.hidden[r].clone()).collect();
        cache.batch = rows.len();
        Ok(())
    }

    /// A cache of `copies` sequences, each a copy of the one sequence `cache` holds: one
    /// context continued several ways in one batch (a question's choices after its keys and
    /// values, computed once). The copies are laid end to end through the sequence-axis
    /// concatenation and cut of flat views, the copy ops the cache's backend has.
    pub fn repeat_cache(
        &self,
        cache: &KvCache<B::Tensor>,
        copies: usize,
    ) -> Result<KvCache<B::Tensor>> {
        if cache.batch != 1 || copies == 0 {
            return Err(TrainError::Input(format!(
                "repeat_cache: {copies} copies of a cache of {} sequences (one, at least one \
                 copy)",
                cache.batch
            )));
        }
        let _g = MemoryCategory::Activations.enter();
        let repeat = |t: &Option<B::Tensor>| -> Result<Option<B::Tensor>> {
            let Some(t) = t else { return Ok(None) };
            // The positions in use alone (the cache may have room past them).
            let mut dims = t.shape().dims().to_vec();
            dims[2] = cache.len();
            let mut one = self.backend().uninit(dims.clone(), t.dtype())?;
            self.backend().truncate_seq(&mut one, t)?;
            let n = one.numel();
            one.reshape([1, 1, n, 1].into())?;
            // Doubled while that stays within `copies`, then the rest from the front: about
            // two copies' worth of bytes moved per copy made (growing one copy at a time moved
            // `copies / 2` per copy, a batch of 16 sequences' 5-shot prefix 7 GB).
            let (mut all, mut count) = (one, 1);
            while 2 * count <= copies {
                let mut grown = self.backend().uninit([1, 1, 2 * count * n, 1], t.dtype())?;
                self.backend().concat_seq(&mut grown, &all, &all)?;
                (all, count) = (grown, 2 * count);
            }
            if count < copies {
                let mut rest = self
                    .backend()
                    .uninit([1, 1, (copies - count) * n, 1], t.dtype())?;
                self.backend().truncate_seq(&mut rest, &all)?;
                let mut grown = self.backend().uninit([1, 1, copies * n, 1], t.dtype())?;
                self.backend().concat_seq(&mut grown, &all, &rest)?;
                all = grown;
            }
            dims[0] = copies;
            all.reshape(dims.into())?;
            Ok(Some(all))
        };
        let layers = cache
            .layers
            .iter()
            .map(|l| {
                Ok(LayerKv {
                    k: repeat(&l.k)?,
                    v: repeat(&l.v)?,
                    len: l.len,
                })
            })
            .collect::<Result<_>>()?;
        Ok(KvCache {
            layers,
            batch: copies,
            hidden: vec![cache.hidden[0].clone(); copies],
        })
    }

    /// Cut `cache` back to its first `len` positions (`len` ≤ its length), in every layer: what
    /// a conversation's next turn shares with the last (`sample --interactive`), kept instead
    /// of recomputed. Decoding after the cut gives the logits a cache built to `len` positions
    /// by the same steps would give, bit for bit. A failed cut (out of memory) leaves the cache
    /// empty.
    pub fn truncate_cache(&self, cache: &mut KvCache<B::Tensor>, len: usize) -> Result<()> {
        if len > cache.len() {
            return Err(TrainError::Input(format!(
                "truncate_cache: {len} positions of a cache of {}",
                cache.len()
            )));
        }
        if len == cache.len() {
            return Ok(());
        }
        let _g = MemoryCategory::Activations.enter();
        let cut = |t: Option<B::Tensor>| -> Result<Option<B::Tensor>> {
            let Some(t) = t else { return Ok(None) };
            if len == 0 {
                return Ok(None);
            }
            let mut dims = t.shape().dims().to_vec();
            dims[2] = len;
            let mut out = self.backend().uninit(dims, t.dtype())?;
            self.backend().truncate_seq(&mut out, &t)?;
            Ok(Some(out))
        };
        let mut cut_layers = || -> Result<()> {
            for layer in &mut cache.layers {
                // Layer by layer, so the peak holds one layer's old and new tensors, as growing
                // does.
                layer.k = cut(layer.k.take())?;
                layer.v = cut(layer.v.take())?;
                layer.len = len;
            }
            Ok(())
        };
        let cut = cut_layers();
        for h in &mut cache.hidden {
            *h = h.start.min(len)..h.end.min(len);
        }
        if cut.is_err() {
            // Some layers cut, some not: emptied, so no step reads a cache of mixed lengths.
            for layer in &mut cache.layers {
                *layer = LayerKv {
                    k: None,
                    v: None,
                    len: 0,
                };
            }
            cache.hidden = vec![0..0; cache.batch];
        }
        cut
    }

    /// `tokens` as `[B, t]` new positions of `cache` (`B` its batch, `t ≥ 1`), within the
    /// model's context and vocabulary: a refused step caches nothing.
    fn check_decode(&self, cache: &KvCache<B::Tensor>, tokens: &[u32]) -> Result<(usize, usize)> {
        let b = cache.batch;
        if b == 0 || tokens.is_empty() || !tokens.len().is_multiple_of(b) {
            return Err(TrainError::Input(format!(
                "decode: {} tokens are not [{b}, t] with t ≥ 1",
                tokens.len()
            )));
        }
        if cache.layers.len() != self.cfg.layers {
            return Err(TrainError::Input(format!(
                "decode: a cache of {} layers for a model of {}",
                cache.layers.len(),
                self.cfg.layers
            )));
        }
        let t = tokens.len() / b;
        // The farthest position any row reaches (a padded row's lie its padding earlier).
        let end = (0..b)
            .map(|row| cache.position(row, cache.len().saturating_add(t)))
            .max()
            .unwrap_or(0);
        if end > self.cfg.max_seq {
            return Err(TrainError::Input(format!(
                "decode: positions up to {end} exceed the model's context of {}",
                self.cfg.max_seq
            )));
        }
        // Every id is checked before the first block runs: a refused step caches nothing.
        self.check_batch(tokens, tokens, Geometry::new(b, t))?;
        Ok((b, t))
    }

    /// Embed `tokens` `[B, t]` at the cache's positions and run every block with its cache:
    /// the last block's output `[B, t, C]`.
    fn step(
        &self,
        cache: &mut KvCache<B::Tensor>,
        tokens: &[u32],
        g: Geometry<'_>,
    ) -> Result<B::Tensor> {
        self.check_batch(tokens, tokens, g)?;
        let pos0 = cache.len();
        let documents = cache.step_documents(g.t)?;
        let g = match &documents {
            Some(d) => g.with_documents(d)?,
            None => g,
        };
        let mut x = self.embed_at(tokens, g, pos0)?;
        for (l, layer) in cache.layers.iter_mut().enumerate() {
            x = match self.cfg.family {
                Family::Gpt2 => {
                    let bw = self.block_weights(l)?;
                    self.gpt2_block_forward(l, bw, &x, g, false, Some(layer))?.0
                }
                Family::Llama(_) => {
                    let bw = self.block_weights(l)?;
                    self.llama_block_forward(l, bw, &x, g, false, Some(layer))?
                        .0
                }
            };
        }
        Ok(x)
    }

    /// [`Model::embed`] for positions `pos0 ..`: GPT-2's position rows are gathered like
    /// tokens and added, the same single f32 addition the training embedding does.
    fn embed_at(&self, tokens: &[u32], g: Geometry<'_>, pos0: usize) -> Result<B::Tensor> {
        if pos0 == 0 || matches!(self.cfg.family, Family::Llama(_)) || g.positions().is_some() {
            return self.embed(tokens, g);
        }
        let _l = label_absolute("embed.out");
        let c = self.cfg.channels;
        let mut out = self.fresh([g.b, g.t, c])?;
        let positions: Vec<u32> = (0..g.b)
            .flat_map(|_| (pos0..pos0 + g.t).map(|p| p as u32))
            .collect();
        let (wte, wpe) = (self.w(params::WTE)?, self.w(params::WPE)?);
        self.embed_at_positions(&mut out, tokens, wte, wpe, &positions)?;
        self.keep(out)
    }
}
