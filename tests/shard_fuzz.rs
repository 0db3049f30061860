//! Mutated shards never panic: every outcome is Ok or a typed error.
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rust_loader::robustness::{mutate, read_everything, sample_shard};

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    #[test]
    fn mutated_shards_give_errors_not_panics(seed in any::<u64>()) {
        let dir = tempfile::tempdir().unwrap();
        let original = sample_shard(dir.path(), seed % 4).unwrap();
        let m = mutate(&original, &mut ChaCha8Rng::seed_from_u64(seed));
        let _ = read_everything(dir.path(), &m, seed);
    }
}

#[test]
fn an_unmodified_shard_reads_completely() {
    let dir = tempfile::tempdir().unwrap();
    let original = sample_shard(dir.path(), 1).unwrap();
    let frames = read_everything(dir.path(), &original, 0).unwrap();
    assert!(frames > 3);
}
