//! Rows of tokens with the metadata document-masked attention needs, and the documents
//! of one block that rows are cut from.
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

/// A run of rows of equal width, laid out row-major: what fills (part of) a batch slot.
///
/// For each token position t of a row:
/// - `position_ids[t]` restarts at 0 at the first token of every piece;
/// - `doc_ids[t]` numbers the pieces of the row 0, 1, ...; padding is -1;
/// - `loss_mask[t]` is 1 when token t+1 is the next token of the same piece, so the
///   prediction made at t is trained; it is 0 at a piece's last token and on padding.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rows {
    pub width: usize,
    pub n_rows: usize,
    pub tokens: Vec<i32>,
    pub position_ids: Vec<i32>,
    pub doc_ids: Vec<i32>,
    pub loss_mask: Vec<u8>,
    /// Padding tokens in these rows.
    pub pad_tokens: u64,
    /// Real (document) tokens in these rows.
    pub doc_tokens: u64,
}

pub const PAD_TOKEN: i32 = 0;

/// Buffers handed back for reuse. Blocks are megabytes; allocating them fresh costs a
/// page fault per 4 KiB (it was over half the packing time), so they are recycled.
#[derive(Default)]
pub struct BufferPool {
    rows: Mutex<Vec<Rows>>,
    frames: Mutex<Vec<Vec<u8>>>,
}

/// Buffers kept per kind; more are dropped.
const POOL_LIMIT: usize = 64;

impl BufferPool {
    pub fn take_rows(&self, width: usize, rows: usize) -> Rows {
        match self.rows.lock().unwrap().pop() {
            Some(mut r) => {
                r.reset(width);
                r
            }
            None => Rows::with_capacity(width, rows),
        }
    }

    pub fn give_rows(&self, rows: Rows) {
        let mut pool = self.rows.lock().unwrap();
        if pool.len() < POOL_LIMIT {
            pool.push(rows);
        }
    }

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

impl Rows {
    /// Empties the rows (keeping their memory) for rows of `width` tokens.
    pub fn reset(&mut self, width: usize) {
        self.width = width;
        self.n_rows = 0;
        self.tokens.clear();
        self.position_ids.clear();
        self.doc_ids.clear();
        self.loss_mask.clear();
        self.pad_tokens = 0;
        self.doc_tokens = 0;
    }

    pub fn with_capacity(width: usize, rows: usize) -> Self {
        let n = width * rows;
        Rows {
            width,
            n_rows: 0,
            tokens: Vec::with_capacity(n),
            position_ids: Vec::with_capacity(n),
            doc_ids: Vec::with_capacity(n),
            loss_mask: Vec::with_capacity(n),
            pad_tokens: 0,
            doc_tokens: 0,
        }
    }

    /// Appends one row made of `pieces` (their lengths sum to at most `width`), padded.
    pub fn push_row(&mut self, pieces: &[Piece], src: &BlockDocs) {
        let base = self.tokens.len();
        self.tokens.resize(base + self.width, PAD_TOKEN);
        self.position_ids.resize(base + self.width, 0);
        self.doc_ids.resize(base + self.width, -1);
        self.loss_mask.resize(base + self.width, 0);
        let mut at = base;
        for (seg, p) in pieces.iter().enumerate() {
            let n = p.len as usize;
            assert!(at + n <= base + self.width, "pieces overflow a row");
            src.copy_piece(p, &mut self.tokens[at..at + n]);
            for (k, pos) in self.position_ids[at..at + n].iter_mut().enumerate() {
                *pos = k as i32;
            }
            self.doc_ids[at..at + n].fill(seg as i32);
            self.loss_mask[at..at + n - 1].fill(1);
            at += n;
        }
        let used = (at - base) as u64;
        self.doc_tokens += used;
        self.pad_tokens += self.width as u64 - used;
        self.n_rows += 1;
    }

    /// Appends a row of padding only (to give a batch its fixed shape).
    pub fn push_empty_row(&mut self, src: &BlockDocs) {
        self.push_row(&[], src);
    }

    /// Copies row `r` of `self` into row `dst_row` of equally wide destination slices.
    pub fn copy_row_to(&self, r: usize, dst: RowSlicesMut<'_>, dst_row: usize) {
        let (s, d) = (r * self.width, dst_row * self.width);
        let w = self.width;
        dst.tokens[d..d + w].copy_from_slice(&self.tokens[s..s + w]);
        dst.position_ids[d..d + w].copy_from_slice(&self.position_ids[s..s + w]);
        dst.doc_ids[d..d + w].copy_from_slice(&self.doc_ids[s..s + w]);
        dst.loss_mask[d..d + w].copy_from_slice(&self.loss_mask[s..s + w]);
    }
}

/// Mutable views of the four arrays of a batch slot.
pub struct RowSlicesMut<'a> {
    pub tokens: &'a mut [i32],
    pub position_ids: &'a mut [i32],
    pub doc_ids: &'a mut [i32],
    pub loss_mask: &'a mut [u8],
}
