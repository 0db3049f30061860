//! Loader throughput in tokens/s: frame decode, pack, bucket, and the full threaded
//! loader into slots with 1, 2 and N threads. Data: a synthetic corpus (log-normal
//! lengths, Zipf ids, u16) written once into target/bench-data.
use std::path::PathBuf;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rust_loader::block::{read_block, Decoder, Mode};
use rust_loader::dataset::Dataset;
use rust_loader::loader::{Loader, LoaderConfig, Position, SlotBuffers};
use rust_loader::pack::{bucket_batches, pack_rows, BucketSpec, PackStrategy};
use rust_loader::rows::{BufferPool, RowPlan, RowSlicesMut};
use rust_loader::synthetic::{write_synthetic, SyntheticSpec};

/// The synthetic corpus with frames at zstd `level` (3: pack-shards' default; -1: literals
/// stored raw, decoded ~3x faster, ~1.4x larger).
fn data(level: i32) -> Arc<Dataset> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(format!("target/bench-data/lognormal-200k-zstd{level}"));
    if !dir.join("manifest.json").exists() {
        let _ = std::fs::remove_dir_all(&dir);
        let spec = SyntheticSpec {
            documents: 200_000,
            mu: 6.0,
            sigma: 1.0,
            level,
            ..Default::default()
        };
        write_synthetic(&dir, &spec).unwrap();
    }
    Arc::new(Dataset::open(&dir).unwrap())
}

fn block_ops(c: &mut Criterion) {
    let frames: Vec<u64> = (0..4).collect();
    let pool = BufferPool::default();
    let ds = data(3);
    let docs = read_block(&ds, &frames, &mut Decoder::new(), &pool).unwrap();
    let tokens = docs.n_tokens();
    let mut g = c.benchmark_group("block");
    g.throughput(Throughput::Elements(tokens));
    for level in [3, -1] {
        let ds = data(level);
        g.bench_function(format!("decode_4_frames_zstd{level}"), |b| {
            let mut dec = Decoder::new();
            b.iter(|| pool.give_frames(read_block(&ds, &frames, &mut dec, &pool).unwrap().frames))
        });
    }
    // Planning plus writing every row into slot-sized arrays: the loader's whole
    // per-token work after decoding.
    let mut tokens = Vec::new();
    let mut doc_ids = Vec::new();
    let mut write_all = |plan: &RowPlan| {
        let n = plan.n_rows() * plan.width;
        tokens.resize(n * docs.dtype.width(), 0u8);
        doc_ids.resize(n, 0i32);
        let mut dst = RowSlicesMut {
            tokens: &mut tokens,
            doc_ids: &mut doc_ids,
        };
        for r in 0..plan.n_rows() {
            plan.write_row(r, &docs, &mut dst, r);
        }
    };
    g.bench_function("pack_best_fit_2048", |b| {
        b.iter(|| {
            write_all(
                &pack_rows(
                    &docs,
                    2049,
                    PackStrategy::BestFit,
                    Some(&mut ChaCha8Rng::seed_from_u64(0)),
                )
                .0,
            )
        })
    });
    g.bench_function("pack_concat_2048", |b| {
        b.iter(|| write_all(&pack_rows(&docs, 2049, PackStrategy::Concat, None).0))
    });
    let spec = BucketSpec {
        lengths: vec![128, 256, 512, 1024, 2048],
        token_budget: 65536,
    };
    g.bench_function("bucket_5_lengths", |b| {
        b.iter(|| {
            for plan in bucket_batches(&docs, &spec, Some(&mut ChaCha8Rng::seed_from_u64(0))).0 {
                write_all(&plan);
            }
        })
    });
    g.finish();
}

fn full_loader(c: &mut Criterion) {
    let batch = 16usize;
    let seq = 2048usize;
    let mut g = c.benchmark_group("loader_pack_2048x16");
    g.throughput(Throughput::Elements((batch * (seq + 1) * 64) as u64));
    g.sample_size(10);
    let n = std::thread::available_parallelism().map_or(4, |n| n.get());
    let mut runs = vec![(3, 1usize), (3, 2), (-1, 1), (-1, 2)];
    if n > 2 {
        runs.extend([(3, n), (-1, n)]);
    }
    for (level, threads) in runs {
        let ds = data(level);
        g.bench_function(format!("zstd{level}_threads_{threads}"), |b| {
            let cfg = LoaderConfig {
                mode: Mode::Pack {
                    seq_len: seq,
                    batch_size: batch,
                    strategy: PackStrategy::BestFit,
                },
                seed: 0,
                shuffle: true,
                rank: 0,
                world_size: 1,
                frames_per_block: 4,
                num_epochs: None,
                threads,
                prefetch_blocks: 2 * threads,
                skip_corrupt: false,
                schedule: Vec::new(),
            };
            let slots = (0..4)
                .map(|_| SlotBuffers::owned(cfg.slot_elems(), ds.dtype))
                .collect();
            let loader = Loader::new(vec![ds.clone()], cfg, slots, Position::default()).unwrap();
            b.iter(|| {
                for _ in 0..64 {
                    let r = loader.next().unwrap().unwrap();
                    loader.release(r.slot).unwrap();
                }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, block_ops, full_loader);
criterion_main!(benches);
