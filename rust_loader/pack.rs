//! Packing documents into fixed-width rows (`pack` mode) and grouping them into a few
//! fixed shapes (`bucket` mode). Every function here is deterministic given its RNG.
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
    let (pieces, row_of, n_rows) = match strategy {
        PackStrategy::BestFit => {
            let (mut pieces, _) = src.pieces(width);
            let (row_of, n_rows) = best_fit(&mut pieces, width);
            (pieces, row_of, n_rows)
        }
        PackStrategy::Concat => concat(src, width),
    };
    let mut pieces_of_doc = vec![0u32; src.docs.len()];
    for p in &pieces {
        pieces_of_doc[p.doc as usize] += 1;
    }
    let stats = PackStats {
        documents: src.docs.len() as u64,
        cut_documents: pieces_of_doc.iter().filter(|&&n| n > 1).count() as u64,
    };
    (plan_rows(&pieces, &row_of, n_rows, width, rng), stats)
}

/// The plan of pieces assigned to rows (`row_of[i]` is piece i's row), rows in shuffled
/// order, pieces of a row in assignment order. A counting sort: no per-row allocation.
fn plan_rows(
    pieces: &[Piece],
    row_of: &[u32],
    n_rows: usize,
    width: usize,
    rng: Option<&mut ChaCha8Rng>,
) -> RowPlan {
    let mut order: Vec<u32> = (0..n_rows as u32).collect();
    if let Some(rng) = rng {
        order.shuffle(rng);
    }
    let mut rank = vec![0u32; n_rows];
    for (i, &r) in order.iter().enumerate() {
        rank[r as usize] = i as u32;
    }
    let mut row_starts = vec![0u32; n_rows + 1];
    for &r in row_of {
        row_starts[rank[r as usize] as usize + 1] += 1;
    }
    for i in 0..n_rows {
        row_starts[i + 1] += row_starts[i];
    }
    let mut at = row_starts.clone();
    let mut out = vec![
        Piece {
            doc: 0,
            start: 0,
            len: 0
        };
        pieces.len()
    ];
    for (p, &r) in pieces.iter().zip(row_of) {
        let k = rank[r as usize] as usize;
        out[at[k] as usize] = *p;
        at[k] += 1;
    }
    RowPlan {
        width,
        pieces: out,
        row_starts,
    }
}

/// Open rows indexed by free space: `stacks[f]` holds the rows with exactly `f` free
/// tokens and bit `f` of `nonempty` says whether it has any, so the tightest row that fits
/// a piece is the first set bit at or above the piece's length (at most width/64 words).
struct OpenRows {
    stacks: Vec<Vec<u32>>,
    nonempty: Vec<u64>,
}

impl OpenRows {
    fn new(width: usize) -> Self {
        OpenRows {
            stacks: vec![Vec::new(); width + 1],
            nonempty: vec![0; width / 64 + 1],
        }
    }

    fn push(&mut self, free: usize, row: u32) {
        self.stacks[free].push(row);
        self.nonempty[free / 64] |= 1 << (free % 64);
    }

    /// Removes and returns (free space, row) of a row with the least free space >= `len`.
    fn take_fitting(&mut self, len: usize) -> Option<(usize, u32)> {
        let mut w = len / 64;
        let mut word = self.nonempty[w] & (!0u64 << (len % 64));
        while word == 0 {
            w += 1;
            word = *self.nonempty.get(w)?;
        }
        let free = w * 64 + word.trailing_zeros() as usize;
        let row = self.stacks[free]
            .pop()
            .expect("bit set for a non-empty stack");
        if self.stacks[free].is_empty() {
            self.nonempty[free / 64] &= !(1 << (free % 64));
        }
        Some((free, row))
    }
}

/// Best-fit decreasing: longest piece first, each into the open row whose free space
/// fits it most tightly. Pieces are at most `width` long. Sorts `pieces` and returns the
/// row of each (in the sorted order) and the number of rows.
fn best_fit(pieces: &mut [Piece], width: usize) -> (Vec<u32>, usize) {
    // Stable: equal lengths keep their (already shuffled) order.
    pieces.sort_by_key(|p| std::cmp::Reverse(p.len));
    let mut row_of = Vec::with_capacity(pieces.len());
    let mut n_rows = 0u32;
    let mut open = OpenRows::new(width);
    for p in pieces.iter() {
        let len = p.len as usize;
        let (free, row) = open.take_fitting(len).unwrap_or_else(|| {
            n_rows += 1;
            (width, n_rows - 1)
        });
        row_of.push(row);
        if free > len {
            open.push(free - len, row);
        }
    }
    (row_of, n_rows as usize)
}

/// Concatenate-and-split: documents in block order, a new row every `width` tokens.
/// Returns the pieces, the row of each and the number of rows.
fn concat(src: &BlockDocs, width: usize) -> (Vec<Piece>, Vec<u32>, usize) {
    let mut pieces = Vec::with_capacity(src.docs.len());
    let mut row_of = Vec::with_capacity(src.docs.len());
    let mut row = 0u32;
    let mut free = width as u32;
    for (i, d) in src.docs.iter().enumerate() {
        let mut start = 0;
        while start < d.len {
            if free == 0 {
                row += 1;
                free = width as u32;
            }
            let len = (d.len - start).min(free);
            pieces.push(Piece {
                doc: i as u32,
                start,
                len,
            });
            row_of.push(row);
            start += len;
            free -= len;
        }
    }
    let n_rows = if pieces.is_empty() {
        0
    } else {
        row as usize + 1
    };
    (pieces, row_of, n_rows)
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
    fn best_fit_puts_each_piece_into_the_tightest_open_row() {
        // Sorted 5, 4, 3, 2, 1 into rows of 6: 5 -> A (1 free), 4 -> B (2 free),
        // 3 -> C (3 free), 2 -> B (tightest that fits), 1 -> A.
        let whole_docs = |lens: &[u32]| -> Vec<Piece> {
            let piece = |(i, &len): (usize, &u32)| Piece {
                doc: i as u32,
                start: 0,
                len,
            };
            lens.iter().enumerate().map(piece).collect()
        };
        let mut pieces = whole_docs(&[5, 3, 2, 4, 1]);
        let (row_of, n_rows) = best_fit(&mut pieces, 6);
        let lens: Vec<u32> = pieces.iter().map(|p| p.len).collect();
        assert_eq!(lens, vec![5, 4, 3, 2, 1]);
        assert_eq!(row_of, vec![0, 1, 2, 1, 0]);
        assert_eq!(n_rows, 3);
        // Free space beyond one 64-bit word of the index, and exact fits.
        let mut wide = whole_docs(&[100, 200, 100, 57]);
        let (row_of, n_rows) = best_fit(&mut wide, 300);
        assert_eq!(row_of, vec![0, 0, 1, 1]); // 200+100 fill row 0; 100+57 share row 1
        assert_eq!(n_rows, 2);
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
