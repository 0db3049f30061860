//! Packing documents into fixed-width rows (`pack` mode) and grouping them into a few
//! fixed shapes (`bucket` mode). Every function here is deterministic given its RNG.
use std::collections::BTreeSet;

use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use crate::rows::{BlockDocs, Piece, RowPlan};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackStrategy {
    /// Best-fit decreasing over the block: only documents longer than a row are cut.
    BestFit,
    /// Concatenate documents and cut every `width` tokens (nanoGPT style).
    Concat,
}

/// Counts for reporting packing quality.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PackStats {
    pub documents: u64,
    /// Documents split over more than one row.
    pub cut_documents: u64,
}

/// Plans all documents of a block into rows of `width` tokens, then shuffles the rows.
pub fn pack_rows(
    src: &BlockDocs,
    width: usize,
    strategy: PackStrategy,
    rng: Option<&mut ChaCha8Rng>,
) -> (RowPlan, PackStats) {
    let mut rows = match strategy {
        PackStrategy::BestFit => {
            let (pieces, _) = src.pieces(width);
            best_fit(pieces, width)
        }
        PackStrategy::Concat => concat(src, width),
    };
    if let Some(rng) = rng {
        rows.shuffle(rng);
    }
    let mut out = RowPlan::new(width);
    for row in &rows {
        out.push_row(row);
    }
    let mut pieces_of_doc = vec![0u32; src.docs.len()];
    for p in rows.iter().flatten() {
        pieces_of_doc[p.doc as usize] += 1;
    }
    let stats = PackStats {
        documents: src.docs.len() as u64,
        cut_documents: pieces_of_doc.iter().filter(|&&n| n > 1).count() as u64,
    };
    (out, stats)
}

/// Best-fit decreasing: longest piece first, each into the open row whose free space
/// fits it most tightly. Pieces are at most `width` long.
fn best_fit(mut pieces: Vec<Piece>, width: usize) -> Vec<Vec<Piece>> {
    // Stable: equal lengths keep their (already shuffled) order.
    pieces.sort_by_key(|p| std::cmp::Reverse(p.len));
    let mut rows: Vec<Vec<Piece>> = Vec::new();
    // Open rows keyed by (free tokens, row index).
    let mut open: BTreeSet<(u32, u32)> = BTreeSet::new();
    for p in pieces {
        match open.range((p.len, 0)..).next().copied() {
            Some((free, r)) => {
                open.remove(&(free, r));
                rows[r as usize].push(p);
                if free > p.len {
                    open.insert((free - p.len, r));
                }
            }
            None => {
                let r = rows.len() as u32;
                rows.push(vec![p]);
                if (p.len as usize) < width {
                    open.insert((width as u32 - p.len, r));
                }
            }
        }
    }
    rows
}

/// Concatenate-and-split: documents in block order, a new row every `width` tokens.
fn concat(src: &BlockDocs, width: usize) -> Vec<Vec<Piece>> {
    let mut rows = vec![Vec::new()];
    let mut free = width as u32;
    for (i, d) in src.docs.iter().enumerate() {
        let mut start = 0;
        while start < d.len {
            if free == 0 {
                rows.push(Vec::new());
                free = width as u32;
            }
            let len = (d.len - start).min(free);
            rows.last_mut().unwrap().push(Piece {
                doc: i as u32,
                start,
                len,
            });
            start += len;
            free -= len;
        }
    }
    rows
}

/// Bucket mode: one piece per row; rows of a batch share one bucket length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketSpec {
    /// Sequence lengths (inputs per row), ascending; a row holds `len + 1` tokens.
    pub lengths: Vec<usize>,
    /// Tokens per batch: a batch of bucket `len` has `max(1, token_budget / len)` rows.
    pub token_budget: usize,
}

impl BucketSpec {
    pub fn rows_per_batch(&self, len: usize) -> usize {
        (self.token_budget / len).max(1)
    }

    /// Elements a slot needs to hold the largest batch.
    pub fn slot_elems(&self) -> usize {
        self.lengths
            .iter()
            .map(|&l| self.rows_per_batch(l) * (l + 1))
            .max()
            .unwrap_or(0)
    }
}

/// Groups the pieces of a block into batches of one bucket each, shuffled. Leftover pieces
/// of a bucket (fewer than a batch) move up to the next bucket; leftovers of the largest
/// bucket form one batch padded with empty rows. So each block pads at most one batch.
pub fn bucket_batches(
    src: &BlockDocs,
    spec: &BucketSpec,
    rng: Option<&mut ChaCha8Rng>,
) -> (Vec<RowPlan>, PackStats) {
    let max_width = spec.lengths.last().unwrap() + 1;
    let (pieces, cut) = src.pieces(max_width);
    let mut by_bucket: Vec<Vec<Piece>> = vec![Vec::new(); spec.lengths.len()];
    for p in pieces {
        let b = spec
            .lengths
            .iter()
            .position(|&l| l + 1 >= p.len as usize)
            .unwrap();
        by_bucket[b].push(p);
    }
    let mut batches = Vec::new();
    let mut carry: Vec<Piece> = Vec::new();
    for (b, &len) in spec.lengths.iter().enumerate() {
        let mut pieces = std::mem::take(&mut carry);
        pieces.append(&mut by_bucket[b]);
        let per = spec.rows_per_batch(len);
        let full = pieces.len() / per * per;
        carry = pieces.split_off(full);
        for chunk in pieces.chunks(per) {
            batches.push(fill_batch(chunk, len + 1, per));
        }
    }
    if !carry.is_empty() {
        let len = *spec.lengths.last().unwrap();
        batches.push(fill_batch(&carry, len + 1, spec.rows_per_batch(len)));
    }
    if let Some(rng) = rng {
        batches.shuffle(rng);
    }
    (
        batches,
        PackStats {
            documents: src.docs.len() as u64,
            cut_documents: cut,
        },
    )
}

fn fill_batch(pieces: &[Piece], width: usize, rows: usize) -> RowPlan {
    let mut out = RowPlan::new(width);
    for p in pieces {
        out.push_row(std::slice::from_ref(p));
    }
    while out.n_rows() < rows {
        out.push_row(&[]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::TokenDtype;
    use crate::rows::DocSpan;
    use proptest::prelude::*;
    use rand::SeedableRng;

    /// Documents whose tokens say which document and position they are: doc i, token k
    /// holds i * 10_000 + k, so every delivered token can be traced back.
    fn traceable_docs(lens: &[u32]) -> BlockDocs {
        let mut frame = Vec::new();
        let mut docs = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            docs.push(DocSpan {
                frame: 0,
                start: (frame.len() / 4) as u32,
                len,
            });
            for k in 0..len {
                frame.extend((i as u32 * 10_000 + k).to_le_bytes());
            }
        }
        BlockDocs {
            dtype: TokenDtype::U32,
            frames: vec![frame],
            docs,
        }
    }

    fn all_tokens(src: &BlockDocs) -> Vec<u32> {
        let mut v: Vec<u32> = src
            .docs
            .iter()
            .enumerate()
            .flat_map(|(i, d)| (0..d.len).map(move |k| i as u32 * 10_000 + k))
            .collect();
        v.sort_unstable();
        v
    }

    fn delivered(rows: &crate::rows::Rows) -> Vec<u32> {
        let mut v: Vec<u32> = rows
            .tokens
            .iter()
            .zip(&rows.doc_ids)
            .filter(|(_, &d)| d >= 0)
            .map(|(&t, _)| t)
            .collect();
        v.sort_unstable();
        v
    }

    proptest! {
        #[test]
        fn best_fit_delivers_every_token_once_and_cuts_only_long_docs(
            lens in proptest::collection::vec(1u32..300, 1..200), width in 16usize..257, seed in any::<u64>()
        ) {
            let src = traceable_docs(&lens);
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let (plan, stats) = pack_rows(&src, width, PackStrategy::BestFit, Some(&mut rng));
            let rows = plan.materialize(&src);
            prop_assert_eq!(rows.tokens.len(), rows.n_rows * width);
            prop_assert_eq!(delivered(&rows), all_tokens(&src));
            let long = lens.iter().filter(|&&l| l as usize > width).count() as u64;
            prop_assert_eq!(stats.cut_documents, long);
        }

        #[test]
        fn concat_delivers_every_token_once(lens in proptest::collection::vec(1u32..300, 1..100), width in 8usize..128) {
            let src = traceable_docs(&lens);
            let (plan, _) = pack_rows(&src, width, PackStrategy::Concat, Some(&mut ChaCha8Rng::seed_from_u64(1)));
            let rows = plan.materialize(&src);
            prop_assert_eq!(delivered(&rows), all_tokens(&src));
            // Only the last row may hold padding.
            let total: u64 = lens.iter().map(|&l| l as u64).sum();
            let pad = rows.n_rows as u64 * width as u64 - total;
            prop_assert!(pad < width as u64);
            prop_assert!((0..plan.n_rows()).filter(|&r| plan.row_tokens(r) < width as u64).count() <= 1);
        }

        #[test]
        fn buckets_deliver_every_token_once_in_declared_shapes(
            lens in proptest::collection::vec(1u32..600, 1..200), seed in any::<u64>()
        ) {
            let spec = BucketSpec { lengths: vec![32, 64, 128, 256], token_budget: 1024 };
            let src = traceable_docs(&lens);
            let (plans, _) = bucket_batches(&src, &spec, Some(&mut ChaCha8Rng::seed_from_u64(seed)));
            let mut got = Vec::new();
            let mut padded_batches = 0;
            for b in plans.iter().map(|p| p.materialize(&src)) {
                let len = b.width - 1;
                prop_assert!(spec.lengths.contains(&len));
                prop_assert_eq!(b.n_rows, spec.rows_per_batch(len));
                if b.doc_ids.chunks(b.width).any(|r| r[0] < 0) { padded_batches += 1; }
                got.extend(delivered(&b));
            }
            got.sort_unstable();
            prop_assert_eq!(got, all_tokens(&src));
            prop_assert!(padded_batches <= 1);
        }
    }

    #[test]
    fn row_metadata_marks_documents() {
        let src = traceable_docs(&[3, 2]);
        let mut plan = RowPlan::new(8);
        let p = |doc, len| Piece { doc, start: 0, len };
        plan.push_row(&[p(0, 3), p(1, 2)]);
        let rows = plan.materialize(&src);
        assert_eq!(rows.tokens, vec![0, 1, 2, 10_000, 10_001, 0, 0, 0]);
        assert_eq!(rows.doc_ids, vec![0, 0, 0, 1, 1, -1, -1, -1]);
        assert_eq!(rows.position_ids(), vec![0, 1, 2, 0, 1, 0, 0, 0]);
        assert_eq!(rows.loss_mask(), vec![1, 1, 0, 1, 0, 0, 0, 0]);
        assert_eq!(plan.row_tokens(0), 5);
    }

    #[test]
    fn metadata_restarts_per_row_and_per_piece_of_one_document() {
        // One 7-token document cut into pieces of 4 and 3 in two rows of 4: each piece
        // restarts its positions, and no prediction crosses a row end.
        let src = traceable_docs(&[7]);
        let mut plan = RowPlan::new(4);
        plan.push_row(&[Piece {
            doc: 0,
            start: 0,
            len: 4,
        }]);
        plan.push_row(&[Piece {
            doc: 0,
            start: 4,
            len: 3,
        }]);
        let rows = plan.materialize(&src);
        assert_eq!(rows.tokens, vec![0, 1, 2, 3, 4, 5, 6, 0]);
        assert_eq!(rows.doc_ids, vec![0, 0, 0, 0, 0, 0, 0, -1]);
        assert_eq!(rows.position_ids(), vec![0, 1, 2, 3, 0, 1, 2, 0]);
        assert_eq!(rows.loss_mask(), vec![1, 1, 1, 0, 1, 1, 0, 0]);
    }
}
