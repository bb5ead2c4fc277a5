//! [`DocumentMask`]: which document each position of a packed batch belongs to, for
//! document-aware causal attention
//! ([`AttentionBackend::attention_forward_documents`](crate::AttentionBackend::attention_forward_documents)).

use std::sync::Arc;

use crate::{AttnError, Result};

/// Which document each position of a packed batch belongs to.
///
/// Packed training puts several documents end to end in one sequence; with this mask query
/// row `i` of batch row `b` sees key `j` only when `document_start(b, i) ≤ j ≤ i` — causal and
/// inside its own document, as flash-attention's varlen kernels and transformers' packed
/// sequences (documents told apart by `position_ids` restarting at 0) compute it.
///
/// Cheap to clone (the per-position starts are shared), so a forward pass keeps a copy for
/// its backward.
///
/// ```
/// use headroom_attn::{AttentionBackend, AttentionConfig, DocumentMask};
/// use headroom_tensor::{Backend, Cpu};
///
/// # fn main() -> Result<(), headroom_attn::AttnError> {
/// // One row of 6 positions packing documents of 3, 1 and 2 tokens.
/// let mask = DocumentMask::from_positions(1, 6, &[0, 1, 2, 0, 0, 1])?;
/// assert_eq!((mask.documents(), mask.document_start(0, 5)), (3, Some(4)));
///
/// let cpu = Cpu::new();
/// let x = cpu.upload(&[0.5f32; 6 * 4], [1, 1, 6, 4])?;
/// let config = AttentionConfig::flash().causal(true);
/// let fwd = cpu.attention_forward_documents(&x, &x, &x, &config, &mask)?;
/// let grads = cpu.attention_backward(&x, &x, &x, &fwd, &x)?; // the mask comes with `fwd`
/// # let _ = grads;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DocumentMask {
    batch: usize,
    seq: usize,
    /// For every position (row-major `[batch, seq]`), the index within its row of the first
    /// position of its document. Non-decreasing along a row, which is what lets the tiled
    /// kernels skip whole key tiles by looking at a tile's first query row alone.
    starts: Arc<[u32]>,
    /// A padding mask's keys hidden from every query of each batch row, `[start, end)` per
    /// row ([`DocumentMask::padding`]); `None` for packed documents.
    hidden: Option<Arc<[(u32, u32)]>>,
}

impl DocumentMask {
    /// From position ids `[batch·seq]` (row-major by batch row), as transformers reads packed
    /// sequences: a document starts where the position is 0; every other position is its
    /// predecessor's + 1; each row's first position must be 0.
    ///
    /// Errors: [`AttnError::PositionCount`] when `positions` is not `batch·seq` long (or that
    /// product overflows, or `seq` exceeds what u32 position ids can address);
    /// [`AttnError::PositionId`] naming the first batch row and index whose id breaks the rules.
    pub fn from_positions(batch: usize, seq: usize, positions: &[u32]) -> Result<Self> {
        let count_error = |reason| AttnError::PositionCount {
            batch,
            seq,
            got: positions.len(),
            reason,
        };
        let expected = batch
            .checked_mul(seq)
            .ok_or_else(|| count_error("batch × seq overflows usize"))?;
        if positions.len() != expected {
            return Err(count_error("one position id per position is needed"));
        }
        // Starts are stored as u32 like the ids themselves; a row longer than that could hold
        // a document start no u32 can name.
        if u32::try_from(seq).is_err() {
            return Err(count_error(
                "seq exceeds u32::MAX, the largest start a u32 can hold",
            ));
        }
        let mut starts = Vec::with_capacity(positions.len());
        if seq > 0 {
            for (row, ids) in positions.chunks_exact(seq).enumerate() {
                let mut start = 0u32;
                let mut previous = None::<u32>;
                for (index, &id) in ids.iter().enumerate() {
                    let bad = |reason| AttnError::PositionId {
                        row,
                        index,
                        got: id,
                        reason,
                    };
                    match previous {
                        None if id != 0 => {
                            return Err(bad("a batch row must begin a document (position id 0)"))
                        }
                        Some(p) if id != 0 && p.checked_add(1) != Some(id) => {
                            return Err(bad(
                                "a position id must be 0 (a new document) or the previous one + 1",
                            ))
                        }
                        _ => {}
                    }
                    if id == 0 {
                        // `index` < seq ≤ u32::MAX, checked above.
                        start = u32::try_from(index).map_err(|_| bad("index exceeds u32"))?;
                    }
                    starts.push(start);
                    previous = Some(id);
                }
            }
        }
        Ok(DocumentMask {
            batch,
            seq,
            starts: starts.into(),
            hidden: None,
        })
    }

    /// A padding mask for cached decoding: `q_len` queries per batch row that are the last
    /// `q_len` of the call's keys (the key tensor may be longer, `kv_len ≥ q_len`), causal,
    /// with the keys `hidden[b]` hidden from every query of row `b`. That is a batch of
    /// prompts decoded together after a shared prefix: the keys of the padding that lines the
    /// rows' ragged suffixes up (transformers' left padding with an `attention_mask`, except
    /// that the shared prefix is stored once before the padding). Each row's own tokens then
    /// attend to what they would attend to unpadded; the padding's queries give whatever they
    /// give (a query that sees only hidden keys gets output 0) and are for the caller to
    /// ignore.
    ///
    /// Errors: [`AttnError::PositionCount`] when `hidden` is not one range per batch row, or
    /// a range ends before it starts or past what a u32 holds.
    ///
    /// ```
    /// use headroom_attn::DocumentMask;
    ///
    /// # fn main() -> Result<(), headroom_attn::AttnError> {
    /// let mask = DocumentMask::padding(2, 1, &[3..5, 3..3])?;
    /// assert_eq!((mask.hidden_keys(0), mask.hidden_keys(1)), (3..5, 3..3));
    /// assert!(mask.is_padding());
    /// # Ok(())
    /// # }
    /// ```
    pub fn padding(batch: usize, q_len: usize, hidden: &[std::ops::Range<usize>]) -> Result<Self> {
        let count_error = |reason| AttnError::PositionCount {
            batch,
            seq: q_len,
            got: hidden.len(),
            reason,
        };
        if hidden.len() != batch {
            return Err(count_error(
                "a padding mask needs one hidden key range per batch row",
            ));
        }
        let starts_len = batch
            .checked_mul(q_len)
            .ok_or_else(|| count_error("batch × seq overflows usize"))?;
        let ranges = hidden
            .iter()
            .map(|r| match (u32::try_from(r.start), u32::try_from(r.end)) {
                (Ok(s), Ok(e)) if s <= e => Ok((s, e)),
                _ => Err(count_error(
                    "a hidden key range must not end before it starts or past u32::MAX",
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DocumentMask {
            batch,
            seq: q_len,
            starts: vec![0; starts_len].into(),
            hidden: Some(ranges.into()),
        })
    }

    /// Plain causal attention as a mask: one document per batch row of `seq` positions, so
    /// every query sees every key up to its own. What [`DocumentMask::narrowed`] starts from
    /// when nothing is packed; it gives plain causal attention's bits.
    ///
    /// Errors: [`AttnError::PositionCount`] when `batch × seq` overflows or `seq` exceeds
    /// u32.
    pub fn causal(batch: usize, seq: usize) -> Result<Self> {
        let count_error = |reason| AttnError::PositionCount {
            batch,
            seq,
            got: 0,
            reason,
        };
        let len = batch
            .checked_mul(seq)
            .ok_or_else(|| count_error("batch × seq overflows usize"))?;
        if u32::try_from(seq).is_err() {
            return Err(count_error(
                "seq exceeds u32::MAX, the largest start a u32 can hold",
            ));
        }
        Ok(DocumentMask {
            batch,
            seq,
            starts: vec![0; len].into(),
            hidden: None,
        })
    }

    /// This mask with each query `row` of batch row `b` also kept from the keys before
    /// `first_key(b, row)` (a key index): its first visible key becomes the later of the two.
    /// A sliding window of `W` keys is `first_key = position + 1 − W` for the query's key
    /// position — Mistral's and Qwen2's `sliding_window`, where a query sees `p − W < j ≤ p`.
    /// Packed documents and padding keep their own bounds; the window only narrows them.
    ///
    /// The tiled kernels skip key tiles by the first row of a query tile, which needs first
    /// keys that never decrease along a row: a window's (and a window's over documents) never
    /// do.
    ///
    /// Errors: [`AttnError::MaskStart`] for the first query whose first key would be below
    /// its predecessor's, or past u32.
    ///
    /// ```
    /// use headroom_attn::DocumentMask;
    ///
    /// # fn main() -> Result<(), headroom_attn::AttnError> {
    /// // A window of 3 keys over one row of 6: query i sees keys i − 2 ..= i.
    /// let window = 3;
    /// let mask = DocumentMask::causal(1, 6)?.narrowed(|_, i| (i + 1).saturating_sub(window))?;
    /// let starts: Vec<_> = (0..6).map(|i| mask.document_start(0, i).unwrap()).collect();
    /// assert_eq!(starts, [0, 0, 0, 1, 2, 3]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn narrowed(&self, first_key: impl Fn(usize, usize) -> usize) -> Result<Self> {
        let mut starts = Vec::with_capacity(self.starts.len());
        if self.seq > 0 {
            for (b, row) in self.starts.chunks_exact(self.seq).enumerate() {
                let mut previous = 0u32;
                for (i, &start) in row.iter().enumerate() {
                    let asked = first_key(b, i);
                    let bad = |reason| AttnError::MaskStart {
                        row: b,
                        index: i,
                        got: asked,
                        reason,
                    };
                    let asked = u32::try_from(asked).map_err(|_| bad("exceeds u32::MAX"))?;
                    let first = start.max(asked);
                    if first < previous {
                        return Err(bad("below the previous query's first key"));
                    }
                    starts.push(first);
                    previous = first;
                }
            }
        }
        Ok(DocumentMask {
            starts: starts.into(),
            ..self.clone()
        })
    }

    /// Whether this is a [`DocumentMask::padding`] mask (every query's document starts at key
    /// 0; keys may outnumber queries).
    pub fn is_padding(&self) -> bool {
        self.hidden.is_some()
    }

    /// The keys hidden from every query of batch row `b` (empty for packed documents or a row
    /// out of range).
    pub fn hidden_keys(&self, b: usize) -> std::ops::Range<usize> {
        self.hidden
            .as_deref()
            .and_then(|h| h.get(b))
            .map_or(0..0, |&(s, e)| s as usize..e as usize)
    }

    /// Batch rows covered.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Positions per batch row.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// First key position query `row` of batch row `b` may see (its document's start); None
    /// out of range.
    pub fn document_start(&self, b: usize, row: usize) -> Option<usize> {
        if b >= self.batch || row >= self.seq {
            return None;
        }
        self.starts.get(b * self.seq + row).map(|&s| s as usize)
    }

    /// Number of documents in the whole batch (handy for reports/tests).
    pub fn documents(&self) -> usize {
        if self.seq == 0 {
            return 0;
        }
        self.starts
            .chunks_exact(self.seq)
            .map(|row| {
                row.iter()
                    .enumerate()
                    .filter(|&(i, &s)| s as usize == i)
                    .count()
            })
            .sum()
    }

    /// The starts of batch row `b`'s positions (`seq` of them).
    pub(crate) fn row_starts(&self, b: usize) -> Option<&[u32]> {
        let begin = b.checked_mul(self.seq)?;
        self.starts.get(begin..begin.checked_add(self.seq)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_follow_the_position_ids() {
        let m = DocumentMask::from_positions(2, 5, &[0, 1, 0, 1, 2, 0, 0, 1, 2, 0]).unwrap();
        let starts: Vec<_> = (0..2)
            .flat_map(|b| (0..5).map(move |i| (b, i)))
            .map(|(b, i)| m.document_start(b, i).unwrap())
            .collect();
        assert_eq!(starts, [0, 0, 2, 2, 2, 0, 1, 1, 1, 4]);
        assert_eq!(m.documents(), 5);
        assert_eq!(m.document_start(2, 0), None);
        assert_eq!(m.document_start(0, 5), None);
        assert_eq!(m.row_starts(1), Some(&[0u32, 1, 1, 1, 4][..]));
        let empty = DocumentMask::from_positions(3, 0, &[]).unwrap();
        assert_eq!((empty.documents(), empty.document_start(0, 0)), (0, None));
    }

    #[test]
    fn a_window_narrows_documents_and_padding_without_widening_them() {
        let docs = DocumentMask::from_positions(1, 6, &[0, 1, 2, 3, 0, 1]).unwrap();
        let w = docs.narrowed(|_, i| (i + 1).saturating_sub(2)).unwrap();
        assert_eq!(w.row_starts(0), Some(&[0u32, 0, 1, 2, 4, 4][..]));
        assert!(!w.is_padding());
        // A padded decode step: queries are the last 2 of 7 keys; their own keys 5 and 6.
        let pad = DocumentMask::padding(2, 2, &[1..3, 0..0]).unwrap();
        let w = pad.narrowed(|b, i| b + i + 3).unwrap();
        assert_eq!(w.row_starts(0), Some(&[3u32, 4][..]));
        assert_eq!(w.row_starts(1), Some(&[4u32, 5][..]));
        assert_eq!((w.hidden_keys(0), w.is_padding()), (1..3, true));
        let plain = DocumentMask::causal(2, 3).unwrap();
        assert_eq!(plain.narrowed(|_, _| 0).unwrap(), plain);
        assert_eq!(plain.documents(), 2);
    }

    #[test]
    fn a_narrowing_that_shrinks_a_start_or_overflows_is_a_typed_error() {
        let plain = DocumentMask::causal(2, 3).unwrap();
        assert!(matches!(
            plain.narrowed(|b, i| if b == 1 && i == 2 { 0 } else { 1 }),
            Err(AttnError::MaskStart {
                row: 1,
                index: 2,
                got: 0,
                ..
            })
        ));
        assert!(matches!(
            plain.narrowed(|_, _| usize::MAX),
            Err(AttnError::MaskStart {
                row: 0,
                index: 0,
                ..
            })
        ));
        assert!(matches!(
            DocumentMask::causal(usize::MAX, 2),
            Err(AttnError::PositionCount { .. })
        ));
    }

    #[test]
    fn bad_position_ids_are_typed_errors() {
        assert!(matches!(
            DocumentMask::from_positions(2, 3, &[0, 1, 2]),
            Err(AttnError::PositionCount { got: 3, .. })
        ));
        assert!(matches!(
            DocumentMask::from_positions(usize::MAX, 2, &[]),
            Err(AttnError::PositionCount { .. })
        ));
        assert!(matches!(
            DocumentMask::from_positions(1, 3, &[1, 2, 3]),
            Err(AttnError::PositionId {
                row: 0,
                index: 0,
                got: 1,
                ..
            })
        ));
        assert!(matches!(
            DocumentMask::from_positions(2, 3, &[0, 1, 2, 0, 2, 3]),
            Err(AttnError::PositionId {
                row: 1,
                index: 1,
                got: 2,
                ..
            })
        ));
        let err = DocumentMask::from_positions(1, 2, &[u32::MAX, 0]).unwrap_err();
        assert!(err.to_string().contains("batch row 0"), "{err}");
    }
}
