//! Turns one block (a few frames of one rank's epoch order) into rows or batches.
//! The output is a pure function of the dataset, the configuration and (epoch, block).
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::dataset::Dataset;
use crate::error::Result;
use crate::order::RankOrder;
use crate::pack::{bucket_batches, pack_rows, BucketSpec, PackStats, PackStrategy};
use crate::rows::{BlockDocs, BufferPool, DocSpan, RowPlan};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Rows of `seq_len + 1` tokens, `batch_size` rows per batch.
    Pack {
        seq_len: usize,
        batch_size: usize,
        strategy: PackStrategy,
    },
    /// One piece per row, rows grouped by bucket length.
    Bucket(BucketSpec),
}

/// What one block yields: planned rows to be grouped into batches (pack) or whole
/// planned batches (bucket). The tokens stay in `docs` until the assembler writes them.
pub enum BlockOutput {
    Rows(RowPlan),
    Batches(Vec<RowPlan>),
}

impl BlockOutput {
    /// Items are rows in pack mode and batches in bucket mode; the loader's position
    /// inside a block counts items.
    pub fn n_items(&self) -> usize {
        match self {
            BlockOutput::Rows(r) => r.n_rows(),
            BlockOutput::Batches(b) => b.len(),
        }
    }
}

pub struct Block {
    pub docs: BlockDocs,
    pub output: BlockOutput,
    pub stats: PackStats,
    /// Corrupt frames left out (only with `skip_corrupt`), as error messages.
    pub skipped_frames: Vec<String>,
}

impl Block {
    /// Hands the decoded frames back for the next block.
    pub fn recycle(self, pool: &BufferPool) {
        pool.give_frames(self.docs.frames);
    }
}

/// Reusable per-thread decoding state.
pub struct Decoder {
    zstd: zstd::bulk::Decompressor<'static>,
}

impl Decoder {
    pub fn new() -> Self {
        Decoder {
            zstd: zstd::bulk::Decompressor::new().expect("zstd context allocation"),
        }
    }
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new()
    }
}

/// Decodes the frames of a block and lists their documents, in frame order.
pub fn read_block(
    ds: &Dataset,
    frames: &[u64],
    dec: &mut Decoder,
    pool: &BufferPool,
) -> Result<BlockDocs> {
    read_block_skipping(ds, frames, dec, pool, None)
}

/// Like `read_block`; with `skipped` given, a corrupt frame is left out and its error
/// recorded there instead of failing the block.
pub fn read_block_skipping(
    ds: &Dataset,
    frames: &[u64],
    dec: &mut Decoder,
    pool: &BufferPool,
    mut skipped: Option<&mut Vec<String>>,
) -> Result<BlockDocs> {
    let mut out = BlockDocs {
        dtype: ds.dtype,
        frames: Vec::with_capacity(frames.len()),
        docs: Vec::new(),
    };
    for &g in frames {
        let fr = ds.frames[g as usize];
        let shard = &ds.shards[fr.shard as usize];
        let mut buf = pool.take_frame();
        match (
            shard.decode_frame(fr.frame as usize, &mut dec.zstd, &mut buf),
            skipped.as_deref_mut(),
        ) {
            (Ok(()), _) => {}
            (Err(e @ crate::Error::CorruptShard { .. }), Some(list)) => {
                list.push(e.to_string());
                pool.give_frames(vec![buf]);
                continue;
            }
            (Err(e), _) => return Err(e),
        }
        let k = out.frames.len();
        let entry = shard.frames()[fr.frame as usize];
        let mut start = 0u32;
        for d in entry.first_doc..entry.first_doc + entry.n_docs {
            let len = shard.doc_len(d);
            out.docs.push(DocSpan {
                frame: k as u32,
                start,
                len,
            });
            start += len;
        }
        out.frames.push(buf);
    }
    Ok(out)
}

pub fn make_block(
    ds: &Dataset,
    order: &RankOrder,
    mode: &Mode,
    (epoch, block): (u64, u64),
    dec: &mut Decoder,
    pool: &BufferPool,
    skip_corrupt: bool,
) -> Result<Block> {
    let frames = order.block_frames(epoch, block);
    let mut skipped_frames = Vec::new();
    let mut docs = read_block_skipping(
        ds,
        &frames,
        dec,
        pool,
        skip_corrupt.then_some(&mut skipped_frames),
    )?;
    let mut rng = ChaCha8Rng::seed_from_u64(order.block_seed(epoch, block));
    if order.shuffle {
        docs.docs.shuffle(&mut rng);
    }
    let rng = order.shuffle.then_some(&mut rng);
    let (output, stats) = match mode {
        Mode::Pack {
            seq_len, strategy, ..
        } => {
            let (rows, stats) = pack_rows(&docs, seq_len + 1, *strategy, rng);
            (BlockOutput::Rows(rows), stats)
        }
        Mode::Bucket(spec) => {
            let (batches, stats) = bucket_batches(&docs, spec, rng);
            (BlockOutput::Batches(batches), stats)
        }
    };
    Ok(Block {
        docs,
        output,
        stats,
        skipped_frames,
    })
}
