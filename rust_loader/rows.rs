//! The documents of one block, rows planned as lists of pieces, and the code that writes
//! a planned row (tokens plus the metadata document-masked attention needs) straight into
//! a batch slot. Rows are never materialised twice: a worker plans them, the assembler
//! writes each token once, into the slot the consumer will read.
use std::sync::Mutex;

use crate::format::TokenDtype;

/// Decoded frames of one block and the documents inside them.
pub struct BlockDocs {
    pub dtype: TokenDtype,
    /// Little-endian token bytes, one buffer per frame.
    pub frames: Vec<Vec<u8>>,
    pub docs: Vec<DocSpan>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DocSpan {
    pub frame: u32,
    /// Token offset of the document inside its frame.
    pub start: u32,
    pub len: u32,
}

/// A contiguous run of one document's tokens placed in a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub doc: u32,
    pub start: u32,
    pub len: u32,
}

impl BlockDocs {
    pub fn n_tokens(&self) -> u64 {
        self.docs.iter().map(|d| d.len as u64).sum()
    }

    /// Splits every document into pieces of at most `max_len` tokens, in document order.
    /// Returns the pieces and how many documents were cut.
    pub fn pieces(&self, max_len: usize) -> (Vec<Piece>, u64) {
        let mut out = Vec::with_capacity(self.docs.len());
        let mut cut = 0;
        for (i, d) in self.docs.iter().enumerate() {
            let mut start = 0u32;
            if d.len as usize > max_len {
                cut += 1;
            }
            while start < d.len {
                let len = (d.len - start).min(max_len as u32);
                out.push(Piece {
                    doc: i as u32,
                    start,
                    len,
                });
                start += len;
            }
        }
        (out, cut)
    }

    fn copy_piece(&self, p: &Piece, out: &mut [i32]) {
        let d = self.docs[p.doc as usize];
        let w = self.dtype.width();
        let from = (d.start + p.start) as usize * w;
        self.dtype.widen_into(
            &self.frames[d.frame as usize][from..from + p.len as usize * w],
            out,
        );
    }
}

/// Rows of equal width, each a list of pieces whose lengths sum to at most `width`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RowPlan {
    pub width: usize,
    pub pieces: Vec<Piece>,
    /// Row r holds pieces[row_starts[r]..row_starts[r + 1]].
    pub row_starts: Vec<u32>,
}

impl RowPlan {
    pub fn new(width: usize) -> Self {
        RowPlan {
            width,
            pieces: Vec::new(),
            row_starts: vec![0],
        }
    }

    pub fn push_row(&mut self, pieces: &[Piece]) {
        debug_assert!(pieces.iter().map(|p| p.len as usize).sum::<usize>() <= self.width);
        self.pieces.extend_from_slice(pieces);
        self.row_starts.push(self.pieces.len() as u32);
    }

    pub fn n_rows(&self) -> usize {
        self.row_starts.len() - 1
    }

    pub fn row(&self, r: usize) -> &[Piece] {
        &self.pieces[self.row_starts[r] as usize..self.row_starts[r + 1] as usize]
    }

    /// Document tokens in row r (the rest of the row is padding).
    pub fn row_tokens(&self, r: usize) -> u64 {
        self.row(r).iter().map(|p| p.len as u64).sum()
    }

    /// Writes row `r` into row `dst_row` of `dst` (rows of `self.width`).
    ///
    /// For each token position t of a row:
    /// - `position_ids[t]` restarts at 0 at the first token of every piece;
    /// - `doc_ids[t]` numbers the pieces of the row 0, 1, ...; padding is -1;
    /// - `loss_mask[t]` is 1 when token t+1 is the next token of the same piece, so the
    ///   prediction made at t is trained; 0 at a piece's last token and on padding.
    pub fn write_row(&self, r: usize, src: &BlockDocs, dst: &mut RowSlicesMut<'_>, dst_row: usize) {
        let base = dst_row * self.width;
        let mut at = base;
        for (seg, p) in self.row(r).iter().enumerate() {
            let n = p.len as usize;
            src.copy_piece(p, &mut dst.tokens[at..at + n]);
            for (k, pos) in dst.position_ids[at..at + n].iter_mut().enumerate() {
                *pos = k as i32;
            }
            dst.doc_ids[at..at + n].fill(seg as i32);
            dst.loss_mask[at..at + n - 1].fill(1);
            dst.loss_mask[at + n - 1] = 0;
            at += n;
        }
        write_padding(dst, at, base + self.width);
    }

    /// The rows written out into fresh arrays (tests and tools; the loader writes slots).
    pub fn materialize(&self, src: &BlockDocs) -> Rows {
        let n = self.n_rows() * self.width;
        let mut rows = Rows {
            width: self.width,
            n_rows: self.n_rows(),
            ..Default::default()
        };
        rows.tokens.resize(n, 0);
        rows.position_ids.resize(n, 0);
        rows.doc_ids.resize(n, 0);
        rows.loss_mask.resize(n, 0);
        let mut dst = RowSlicesMut {
            tokens: &mut rows.tokens,
            position_ids: &mut rows.position_ids,
            doc_ids: &mut rows.doc_ids,
            loss_mask: &mut rows.loss_mask,
        };
        for r in 0..self.n_rows() {
            self.write_row(r, src, &mut dst, r);
        }
        rows
    }
}

pub const PAD_TOKEN: i32 = 0;

/// Marks positions `from..to` of `dst` as padding.
pub fn write_padding(dst: &mut RowSlicesMut<'_>, from: usize, to: usize) {
    dst.tokens[from..to].fill(PAD_TOKEN);
    dst.position_ids[from..to].fill(0);
    dst.doc_ids[from..to].fill(-1);
    dst.loss_mask[from..to].fill(0);
}

/// Rows written out (row-major), as the consumer sees them in a slot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rows {
    pub width: usize,
    pub n_rows: usize,
    pub tokens: Vec<i32>,
    pub position_ids: Vec<i32>,
    pub doc_ids: Vec<i32>,
    pub loss_mask: Vec<u8>,
}

/// Mutable views of the four arrays of a batch slot.
pub struct RowSlicesMut<'a> {
    pub tokens: &'a mut [i32],
    pub position_ids: &'a mut [i32],
    pub doc_ids: &'a mut [i32],
    pub loss_mask: &'a mut [u8],
}

/// Decoded-frame buffers handed back for reuse. Frames are megabytes; allocating them
/// fresh costs a page fault per 4 KiB (it was over half the packing time).
#[derive(Default)]
pub struct BufferPool {
    frames: Mutex<Vec<Vec<u8>>>,
}

/// Buffers kept; more are dropped.
const POOL_LIMIT: usize = 64;

impl BufferPool {
    pub fn take_frame(&self) -> Vec<u8> {
        self.frames.lock().unwrap().pop().unwrap_or_default()
    }

    pub fn give_frames(&self, frames: Vec<Vec<u8>>) {
        let mut pool = self.frames.lock().unwrap();
        for f in frames {
            if pool.len() < POOL_LIMIT {
                pool.push(f);
            }
        }
    }
}
