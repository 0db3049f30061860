//! Timed robustness run over mutated shards: `cargo run --release --example fuzz_shards -- SECONDS`.
//! Prints how many mutated inputs were tried and how they ended. Exits non-zero on a panic.
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rust_loader::robustness::{mutate, read_everything, sample_shard};

fn main() {
    let secs: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let dir = tempfile::tempdir().expect("temp dir");
    let originals: Vec<Vec<u8>> = (0..8)
        .map(|s| sample_shard(dir.path(), s).expect("sample shard"))
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(0xf022);
    let (mut tried, mut opened, mut errors) = (0u64, 0u64, 0u64);
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        let m = mutate(&originals[tried as usize % originals.len()], &mut rng);
        let r = std::panic::catch_unwind(|| read_everything(dir.path(), &m, tried));
        match r {
            Ok(Ok(_)) => opened += 1,
            Ok(Err(_)) => errors += 1,
            Err(_) => {
                eprintln!("PANIC on input {tried}");
                std::process::exit(1);
            }
        }
        tried += 1;
    }
    println!("{tried} mutated shards in {secs}s: {opened} opened (corrupt frames reported per frame), {errors} rejected with a typed error, 0 panics");
}
