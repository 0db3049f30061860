//! Synthetic datasets for tests, benches and memory measurements: log-normal document
//! lengths and Zipf-distributed token ids from a fixed seed, or "traceable" tokens
//! (document i, position k holds i * 10_000 + k) so that delivery can be checked.
use std::path::Path;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, LogNormal, Zipf};

use crate::dataset::write_manifest;
use crate::error::{Error, Result};
use crate::format::TokenDtype;
use crate::shard_writer::ShardWriter;

#[derive(Clone, Debug)]
pub struct SyntheticSpec {
    pub documents: u64,
    /// Log-normal parameters of document length in tokens (mu, sigma of the log).
    pub mu: f64,
    pub sigma: f64,
    pub max_len: u32,
    pub vocab: u32,
    /// Tokens encode (document, position) instead of Zipf ids; needs u32.
    pub traceable: bool,
    pub frame_bytes: usize,
    pub docs_per_shard: u64,
    pub seed: u64,
    /// zstd level of the frames (pack-shards' default is 3; negative levels store
    /// literals raw: faster decoding, larger files).
    pub level: i32,
}

impl Default for SyntheticSpec {
    fn default() -> Self {
        SyntheticSpec {
            documents: 1000,
            mu: 6.0,
            sigma: 1.0,
            max_len: 32_768,
            vocab: 50_257,
            traceable: false,
            frame_bytes: 2 << 20,
            docs_per_shard: 100_000,
            seed: 0,
            level: 3,
        }
    }
}

/// Generates document `i`'s tokens into `out`.
fn document(
    spec: &SyntheticSpec,
    i: u64,
    rng: &mut ChaCha8Rng,
    lens: &LogNormal<f64>,
    zipf: &Zipf<f64>,
    out: &mut Vec<u32>,
) {
    let len = (lens.sample(rng) as u32).clamp(1, spec.max_len);
    out.clear();
    if spec.traceable {
        out.extend((0..len).map(|k| i as u32 * 10_000 + k));
    } else {
        out.extend((0..len).map(|_| (zipf.sample(rng) as u32 - 1).min(spec.vocab - 1)));
    }
}

/// Writes a dataset directory (shards + manifest.json) and returns the token count.
pub fn write_synthetic(dir: &Path, spec: &SyntheticSpec) -> Result<u64> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let dtype = if spec.traceable || spec.vocab > 1 << 16 {
        TokenDtype::U32
    } else {
        TokenDtype::U16
    };
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let lens =
        LogNormal::new(spec.mu, spec.sigma).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let zipf =
        Zipf::new(spec.vocab as f64, 1.1).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let mut shards = Vec::new();
    let mut doc = Vec::new();
    let mut total = 0;
    let mut i = 0;
    while i < spec.documents {
        let file = format!("shard-{:05}.tks", shards.len());
        let mut w = ShardWriter::create(&dir.join(&file), dtype, spec.frame_bytes, spec.level)?;
        let end = (i + spec.docs_per_shard).min(spec.documents);
        for d in i..end {
            document(spec, d, &mut rng, &lens, &zipf, &mut doc);
            w.add_document(&doc)?;
        }
        i = end;
        let s = w.finish()?;
        total += s.tokens;
        shards.push(serde_json::json!({
            "file": file, "documents": s.documents, "tokens": s.tokens, "frames": s.frames,
            "bytes": s.bytes, "xxh3_64": format!("{:016x}", s.checksum),
        }));
    }
    write_manifest(
        dir,
        serde_json::json!({
            "dtype": dtype.name(),
            "tokenizer": {"name": "synthetic", "vocab_size": spec.vocab},
            "shards": shards, "args": {"synthetic_seed": spec.seed, "zstd_level": spec.level},
            "created_by": "pytrain write_synthetic",
        }),
    )?;
    Ok(total)
}
