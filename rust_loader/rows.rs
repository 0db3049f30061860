//! The documents of one block, rows planned as lists of pieces, and the code that writes
//! a planned row straight into a batch slot. Rows are never materialised twice: a worker
//! plans them, the assembler writes each token once, into the slot the consumer reads.
//!
//! A slot holds two arrays: the tokens, in the dataset's own width (2 or 4 bytes, copied
//! as they are from the decoded frame), and a document id per token. Position ids and
//! the loss mask follow from the document ids (see `position_ids` and `loss_mask`), so the
//! consumer derives them where they are used (on the GPU) instead of the loader writing
//! and copying 5 more bytes per token.
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

    /// Copies piece `p`'s tokens (little-endian bytes) into `out`.
    fn copy_piece(&self, p: &Piece, out: &mut [u8]) {
        let d = self.docs[p.doc as usize];
        let w = self.dtype.width();
        let from = (d.start + p.start) as usize * w;
        out.copy_from_slice(&self.frames[d.frame as usize][from..from + p.len as usize * w]);
    }
}

// Slots hold the frames' little-endian token bytes and consumers read them as native
// integers (NumPy/torch uint16 or int32 views), which is only right on little-endian hosts.
#[cfg(target_endian = "big")]
compile_error!("batch slots hold little-endian tokens read as native integers; big-endian hosts are not supported");

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

    /// Writes row `r` into row `dst_row` of `dst` (rows of `self.width` tokens):
    /// the pieces' tokens one after another, then padding; `doc_ids[t]` numbers the pieces
    /// of the row 0, 1, ... and is -1 on padding.
    pub fn write_row(&self, r: usize, src: &BlockDocs, dst: &mut RowSlicesMut<'_>, dst_row: usize) {
        let w = src.dtype.width();
        let base = dst_row * self.width;
        let mut at = base;
        for (seg, p) in self.row(r).iter().enumerate() {
            let n = p.len as usize;
            src.copy_piece(p, &mut dst.tokens[at * w..(at + n) * w]);
            dst.doc_ids[at..at + n].fill(seg as i32);
            at += n;
        }
        write_padding(dst, w, at, base + self.width);
    }

    /// The rows written out into fresh arrays (tests and tools; the loader writes slots).
    pub fn materialize(&self, src: &BlockDocs) -> Rows {
        let n = self.n_rows() * self.width;
        let w = src.dtype.width();
        let mut bytes = vec![0u8; n * w];
        let mut doc_ids = vec![0i32; n];
        let mut dst = RowSlicesMut {
            tokens: &mut bytes,
            doc_ids: &mut doc_ids,
        };
        for r in 0..self.n_rows() {
            self.write_row(r, src, &mut dst, r);
        }
        Rows {
            width: self.width,
            n_rows: self.n_rows(),
            tokens: (0..n).map(|i| src.dtype.get(&bytes, i)).collect(),
            doc_ids,
        }
    }
}

pub const PAD_TOKEN: u8 = 0;

/// Marks token positions `from..to` of `dst` (tokens of `w` bytes) as padding.
pub fn write_padding(dst: &mut RowSlicesMut<'_>, w: usize, from: usize, to: usize) {
    dst.tokens[from * w..to * w].fill(PAD_TOKEN);
    dst.doc_ids[from..to].fill(-1);
}

/// Position ids of rows of `width` tokens: 0, 1, ... from the first token of each piece
/// (each run of equal document ids); 0 on padding. The consumer's derivation
/// (`pytrain.data.position_ids`) follows this definition.
pub fn position_ids(doc_ids: &[i32], width: usize) -> Vec<i32> {
    let mut out = vec![0; doc_ids.len()];
    for (row_ids, row_out) in doc_ids.chunks(width).zip(out.chunks_mut(width)) {
        for t in 1..row_ids.len() {
            if row_ids[t] >= 0 && row_ids[t] == row_ids[t - 1] {
                row_out[t] = row_out[t - 1] + 1;
            }
        }
    }
    out
}

/// Loss mask of rows of `width` tokens: 1 at t when token t+1 is the next token of the
/// same piece (so the prediction made at t is trained); 0 at a piece's last token, at the
/// row's last token and on padding.
pub fn loss_mask(doc_ids: &[i32], width: usize) -> Vec<u8> {
    let mut out = vec![0; doc_ids.len()];
    for (row_ids, row_out) in doc_ids.chunks(width).zip(out.chunks_mut(width)) {
        for t in 0..row_ids.len().saturating_sub(1) {
            row_out[t] = (row_ids[t] >= 0 && row_ids[t] == row_ids[t + 1]) as u8;
        }
    }
    out
}

/// Rows written out (row-major), as the consumer sees them in a slot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rows {
    pub width: usize,
    pub n_rows: usize,
    pub tokens: Vec<u32>,
    pub doc_ids: Vec<i32>,
}

impl Rows {
    pub fn position_ids(&self) -> Vec<i32> {
        position_ids(&self.doc_ids, self.width)
    }

    pub fn loss_mask(&self) -> Vec<u8> {
        loss_mask(&self.doc_ids, self.width)
    }
}

/// Mutable views of the two arrays of a batch slot: token bytes (the dataset's width per
/// token) and one document id per token.
pub struct RowSlicesMut<'a> {
    pub tokens: &'a mut [u8],
    pub doc_ids: &'a mut [i32],
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
