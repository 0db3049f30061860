//! Properties of the whole loader (dataset on disk -> threads -> slots), checked over
//! random configurations: exactly-once delivery, row width, disjoint and complete ranks,
//! thread-count independence, exact resume, resume on another number of ranks, and
//! mixtures (shares, stages, resume).
use std::path::Path;
use std::sync::Arc;

use proptest::prelude::*;
use rust_loader::block::Mode;
use rust_loader::dataset::Dataset;
use rust_loader::loader::{resume_position, Loader, LoaderConfig, Position, SlotBuffers, Stage};
use rust_loader::pack::{BucketSpec, PackStrategy};
use rust_loader::synthetic::{write_synthetic, SyntheticSpec};

fn dataset(dir: &Path, docs: u64, seed: u64) -> (Arc<Dataset>, Vec<u32>) {
    let spec = SyntheticSpec {
        documents: docs,
        mu: 4.0,
        sigma: 1.2,
        max_len: 3000,
        traceable: true,
        frame_bytes: 8192,
        docs_per_shard: 70,
        seed,
        ..Default::default()
    };
    write_synthetic(dir, &spec).unwrap();
    let ds = Dataset::open(dir).unwrap();
    let mut all = Vec::new();
    // Every token of the dataset, from the frames themselves.
    for g in 0..ds.n_frames() as u64 {
        let docs = rust_loader::block::read_block(
            &ds,
            &[g],
            &mut rust_loader::block::Decoder::new(),
            &Default::default(),
        )
        .unwrap();
        all.extend(docs.dtype.to_u32s(&docs.frames[0]));
    }
    all.sort_unstable();
    (Arc::new(ds), all)
}

fn config(mode: Mode, threads: usize, rank: u64, world: u64, epochs: u64) -> LoaderConfig {
    LoaderConfig {
        mode,
        seed: 11,
        shuffle: true,
        rank,
        world_size: world,
        frames_per_block: 2,
        num_epochs: Some(epochs),
        threads,
        prefetch_blocks: 3,
        skip_corrupt: false,
        schedule: Vec::new(),
    }
}

/// Runs a loader to its end (or `limit` batches): per batch, the delivered tokens and the
/// full slot contents (tokens, then doc ids), plus the state after each batch.
fn run(
    ds: &Arc<Dataset>,
    cfg: &LoaderConfig,
    start: Position,
    limit: usize,
) -> Vec<(Vec<u32>, Vec<i64>, Position)> {
    run_mix(std::slice::from_ref(ds), cfg, start, limit)
}

fn run_mix(
    dss: &[Arc<Dataset>],
    cfg: &LoaderConfig,
    start: Position,
    limit: usize,
) -> Vec<(Vec<u32>, Vec<i64>, Position)> {
    let slots = (0..3)
        .map(|_| SlotBuffers::owned(cfg.slot_elems(), dss[0].dtype))
        .collect();
    let loader = Loader::new(dss.to_vec(), cfg.clone(), slots, start).unwrap();
    let mut out = Vec::new();
    while out.len() < limit {
        let Some(b) = loader.next().unwrap() else {
            break;
        };
        let v = loader.view(&b);
        let tokens = v.tokens();
        let real: Vec<u32> = tokens
            .iter()
            .zip(v.doc_ids)
            .filter(|(_, &d)| d >= 0)
            .map(|(&t, _)| t)
            .collect();
        // Targets that count in the loss, as reported, against the derived loss mask.
        let mask = rust_loader::rows::loss_mask(v.doc_ids, b.width);
        assert_eq!(
            b.doc_tokens - b.pieces,
            mask.iter().map(|&m| m as u64).sum::<u64>()
        );
        let mut whole: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
        whole.extend(v.doc_ids.iter().map(|&d| d as i64));
        // Row width never exceeds what the mode promises.
        match &cfg.mode {
            Mode::Pack { seq_len, .. } => assert_eq!(b.width, seq_len + 1),
            Mode::Bucket(spec) => assert!(spec.lengths.contains(&(b.width - 1))),
        }
        out.push((real, whole, loader.state().position));
        loader.release(b.slot).unwrap();
    }
    out
}

fn modes() -> impl Strategy<Value = Mode> {
    prop_oneof![
        (8usize..300, 1usize..5, any::<bool>()).prop_map(|(s, b, c)| Mode::Pack {
            seq_len: s,
            batch_size: b,
            strategy: if c {
                PackStrategy::Concat
            } else {
                PackStrategy::BestFit
            }
        }),
        (16usize..64, 256usize..2048).prop_map(|(l, t)| Mode::Bucket(BucketSpec {
            lengths: vec![l, 4 * l, 16 * l],
            token_budget: t
        })),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn every_token_once_per_epoch_and_ranks_disjoint(mode in modes(), world in 1u64..5, seed in 0u64..1000) {
        let dir = tempfile::tempdir().unwrap();
        let (ds, all) = dataset(dir.path(), 150, seed);
        let mut got = Vec::new();
        for rank in 0..world {
            for (real, _, _) in run(&ds, &config(mode.clone(), 2, rank, world, 1), Position::default(), usize::MAX) {
                got.extend(real);
            }
        }
        got.sort_unstable();
        prop_assert_eq!(got, all);
    }

    #[test]
    fn same_batches_for_1_2_and_8_threads_and_exact_resume(mode in modes(), cut in 0usize..40, seed in 0u64..1000) {
        let dir = tempfile::tempdir().unwrap();
        let (ds, _) = dataset(dir.path(), 120, seed);
        let full = run(&ds, &config(mode.clone(), 1, 0, 1, 2), Position::default(), usize::MAX);
        for threads in [2, 8] {
            let other = run(&ds, &config(mode.clone(), threads, 0, 1, 2), Position::default(), usize::MAX);
            prop_assert!(other.iter().map(|x| &x.1).eq(full.iter().map(|x| &x.1)));
        }
        let cut = cut.min(full.len() - 1);
        let state_pos = if cut == 0 { Position::default() } else { full[cut - 1].2.clone() };
        let cfg = config(mode.clone(), 3, 0, 1, 2);
        let slots: Vec<SlotBuffers> = (0..1).map(|_| SlotBuffers::owned(cfg.slot_elems(), ds.dtype)).collect();
        let probe = Loader::new(vec![ds.clone()], cfg.clone(), slots, state_pos.clone()).unwrap();
        let mut st = probe.state();
        drop(probe);
        st.position = state_pos;
        let start = resume_position(std::slice::from_ref(&ds), &cfg, &st).unwrap();
        let resumed = run(&ds, &cfg, start, usize::MAX);
        prop_assert!(resumed.iter().map(|x| &x.1).eq(full[cut..].iter().map(|x| &x.1)));
    }

    #[test]
    fn resume_on_another_number_of_ranks_delivers_every_token_once(
        mode in modes(), w1 in 1u64..5, w2 in 1u64..7, k in 0usize..30, seed in 0u64..1000,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let (ds, all) = dataset(dir.path(), 150, seed);
        let total = run(&ds, &config(mode.clone(), 1, 0, 1, 1), Position::default(), usize::MAX).len();
        // Every rank takes k batches (a step boundary), with k batches left for each.
        let k = k.min((total / w1 as usize).saturating_sub(1));
        let mut got = Vec::new();
        let mut positions = Vec::new();
        for rank in 0..w1 {
            let out = run(&ds, &config(mode.clone(), 2, rank, w1, 1), Position::default(), k);
            prop_assert_eq!(out.len(), k);
            positions.push(out.last().map(|x| x.2.clone()).unwrap_or_default());
            got.extend(out.into_iter().flat_map(|x| x.0));
        }
        // The state is the same on every rank.
        prop_assert!(positions.iter().all(|p| *p == positions[0]));
        for rank in 0..w2 {
            let out = run(&ds, &config(mode.clone(), 2, rank, w2, 1), positions[0].clone(), usize::MAX);
            got.extend(out.into_iter().flat_map(|x| x.0));
        }
        got.sort_unstable();
        prop_assert_eq!(got, all);
    }

    #[test]
    fn mixtures_keep_shares_switch_stages_exactly_and_resume_on_other_ranks(
        seq in 16usize..200, batch in 1usize..5, w in 0.1f64..0.9, cut in 1usize..30, w2 in 1u64..4, seed in 0u64..1000,
    ) {
        let d1 = tempfile::tempdir().unwrap();
        let d2 = tempfile::tempdir().unwrap();
        let (a, all_a) = dataset(d1.path(), 160, seed);
        let (b, all_b) = dataset(d2.path(), 90, seed + 1);
        let dss = [a, b];
        let mode = Mode::Pack { seq_len: seq, batch_size: batch, strategy: PackStrategy::BestFit };
        // The second stage starts a third of the way in (in items: rows of all ranks).
        let sb = ((all_a.len() + all_b.len()) / (batch * (seq + 1)) / 3).max(1);
        let switch = (sb * batch) as u64;
        let mut cfg = config(mode, 2, 0, 1, 1);
        cfg.schedule = vec![
            Stage { start: 0, weights: vec![w, 1.0 - w] },
            Stage { start: switch, weights: vec![1.0 - w, w] },
        ];
        let full = run_mix(&dss, &cfg, Position::default(), usize::MAX);
        // Every token of both datasets once.
        let mut got: Vec<u32> = full.iter().flat_map(|x| x.0.clone()).collect();
        let mut want = [all_a.clone(), all_b.clone()].concat();
        got.sort_unstable();
        want.sort_unstable();
        prop_assert_eq!(&got, &want);
        // Shares within one row of the weights, in each stage, while both sources last: a
        // source used up within the stage (b, at a share of 0.9, may be) leaves the rest of
        // the stage to the other.
        let tokens = |p: &Position| (p.sources[0].stage_tokens, p.sources[1].stage_tokens);
        prop_assert!(full.len() > sb + 5);
        let (t0, t1) = tokens(&full[sb - 1].2);
        let share = t0 as f64 / (t0 + t1) as f64;
        let both_last = (t0 as usize) < all_a.len() && (t1 as usize) < all_b.len();
        prop_assert!(!both_last || (share - w).abs() * (t0 + t1) as f64 <= (seq + 1) as f64 + 1.0,
            "stage 1 share {share} vs {w} over {} tokens ({} of a, {} of b)", t0 + t1, all_a.len(), all_b.len());
        prop_assert_eq!(full[sb - 1].2.items, switch);
        // The stage counters restarted at the switch: only the 5 batches after it count.
        let (u0, u1) = tokens(&full[sb + 4].2);
        prop_assert!(u0 + u1 <= 5 * (batch * (seq + 1)) as u64);
        // Resume mid-run on w2 ranks: the rest of the stream, exactly once.
        let cut = cut.min(full.len() - 1);
        let mut rest = Vec::new();
        for rank in 0..w2 {
            let mut c = cfg.clone();
            c.rank = rank;
            c.world_size = w2;
            rest.extend(run_mix(&dss, &c, full[cut - 1].2.clone(), usize::MAX).into_iter().flat_map(|x| x.0));
        }
        let mut before: Vec<u32> = full[..cut].iter().flat_map(|x| x.0.clone()).collect();
        before.extend(rest);
        before.sort_unstable();
        prop_assert_eq!(before, want);
        // One rank resumed: exactly the batches of the uninterrupted run.
        let resumed = run_mix(&dss, &cfg, full[cut - 1].2.clone(), usize::MAX);
        prop_assert!(resumed.iter().map(|x| &x.1).eq(full[cut..].iter().map(|x| &x.1)));
    }
}
