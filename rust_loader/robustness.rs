//! Corrupted-shard harness: mutates a valid shard (bit flips, byte overwrites,
//! truncation, duplicated ranges) and checks that reading it ends in `Ok` or a typed
//! error, never a panic or an absurd allocation. Used by the property test
//! (tests/shard_fuzz.rs) and by the timed run in examples/fuzz_shards.rs.
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};
use crate::format::TokenDtype;
use crate::rows::BufferPool;
use crate::shard_reader::ShardReader;
use crate::shard_writer::ShardWriter;

/// Writes a small valid shard with several frames and returns its bytes.
pub fn sample_shard(dir: &Path, seed: u64) -> Result<Vec<u8>> {
    let path = dir.join(format!("sample-{seed}.tks"));
    let _ = std::fs::remove_file(&path);
    let mut w = ShardWriter::create(&path, TokenDtype::U16, 512, 1)?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for _ in 0..40 {
        let len = rng.random_range(1..200);
        let doc: Vec<u32> = (0..len).map(|_| rng.random_range(0..1000)).collect();
        w.add_document(&doc)?;
    }
    w.finish()?;
    std::fs::read(&path).map_err(|e| Error::io(&path, e))
}

/// Applies 1 to 4 random mutations.
pub fn mutate(bytes: &[u8], rng: &mut ChaCha8Rng) -> Vec<u8> {
    let mut b = bytes.to_vec();
    for _ in 0..rng.random_range(1..=4) {
        if b.is_empty() {
            break;
        }
        let at = rng.random_range(0..b.len());
        match rng.random_range(0..5) {
            0 => b[at] ^= 1 << rng.random_range(0..8),
            1 => b[at] = rng.random(),
            2 => b.truncate(at),
            3 => {
                // Overwrite the tail region (footer and index) where parsing is densest.
                let tail = b.len().saturating_sub(rng.random_range(1..200));
                b[tail] = rng.random();
            }
            _ => {
                let end = (at + rng.random_range(1..64)).min(b.len());
                let chunk = b[at..end].to_vec();
                let to = rng.random_range(0..b.len());
                let stop = (to + chunk.len()).min(b.len());
                b[to..stop].copy_from_slice(&chunk[..stop - to]);
            }
        }
    }
    b
}

/// Opens `bytes` as a shard and decodes every frame. Returns how many frames decoded;
/// any failure must be a typed error (the caller asserts no panic happened).
pub fn read_everything(dir: &Path, bytes: &[u8], tag: u64) -> Result<usize> {
    let path = dir.join(format!("mutant-{tag}.tks"));
    std::fs::write(&path, bytes).map_err(|e| Error::io(&path, e))?;
    let result = (|| {
        let r = ShardReader::open(&path)?;
        let mut dec = zstd::bulk::Decompressor::new().map_err(|e| Error::io(&path, e))?;
        let pool = BufferPool::default();
        let mut buf = pool.take_frame();
        let mut ok = 0;
        for i in 0..r.frames().len() {
            if r.decode_frame(i, &mut dec, &mut buf).is_ok() {
                ok += 1;
            }
        }
        Ok(ok)
    })();
    let _ = std::fs::remove_file(&path);
    result
}
