//! The order in which a rank visits frames: a seeded permutation of all frames per epoch
//! (a Feistel network with cycle walking, so no array of the permutation is ever stored),
//! dealt round-robin to ranks, and grouped into blocks of `frames_per_block` frames.
//! A block is the unit of work: its output is a pure function of (seed, epoch, rank,
//! world size, block index), which is what makes the loader's state a few integers.

/// A bijection on `0..n` chosen by `key`, computed in O(1) memory.
#[derive(Clone, Copy, Debug)]
pub struct FeistelPermutation {
    n: u64,
    half_bits: u32,
    keys: [u64; 4],
}

/// SplitMix64's finaliser: a cheap, well-mixed 64-bit hash.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Combines several integers into one seed.
pub fn seed_of(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0x9e37_79b9_7f4a_7c15, |acc, &p| mix64(acc ^ mix64(p)))
}

impl FeistelPermutation {
    pub fn new(n: u64, key: u64) -> Self {
        // Smallest even bit width covering n (at least 2), split into two halves.
        let bits = (64 - n.saturating_sub(1).leading_zeros()).max(2);
        let bits = bits + (bits & 1);
        let keys = [0, 1, 2, 3].map(|r| seed_of(&[key, r]));
        FeistelPermutation {
            n,
            half_bits: bits / 2,
            keys,
        }
    }

    fn round_trip(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut l, mut r) = (x >> self.half_bits, x & mask);
        for k in self.keys {
            let f = mix64(r ^ k) & mask;
            (l, r) = (r, l ^ f);
        }
        (l << self.half_bits) | r
    }

    /// The image of `i` (< n). Cycle walking: re-apply until the value lands inside 0..n;
    /// it terminates because the network is a bijection on the power-of-two domain.
    pub fn apply(&self, i: u64) -> u64 {
        debug_assert!(i < self.n);
        let mut x = self.round_trip(i);
        while x >= self.n {
            x = self.round_trip(x);
        }
        x
    }
}

/// Which frames a rank reads, block by block, epoch by epoch.
#[derive(Clone, Debug)]
pub struct RankOrder {
    pub n_frames: u64,
    pub rank: u64,
    pub world_size: u64,
    pub frames_per_block: u64,
    pub shuffle: bool,
    pub seed: u64,
}

impl RankOrder {
    /// Frames dealt to this rank per epoch: positions p in the epoch order with p % world == rank.
    pub fn frames_per_epoch(&self) -> u64 {
        (self.n_frames + self.world_size - 1 - self.rank) / self.world_size
    }

    pub fn blocks_per_epoch(&self) -> u64 {
        self.frames_per_epoch().div_ceil(self.frames_per_block)
    }

    /// Global frame ids of block `block` of `epoch`, in the order they are read.
    pub fn block_frames(&self, epoch: u64, block: u64) -> Vec<u64> {
        let perm = FeistelPermutation::new(self.n_frames, seed_of(&[self.seed, epoch]));
        let start = block * self.frames_per_block;
        let end = (start + self.frames_per_block).min(self.frames_per_epoch());
        (start..end)
            .map(|j| {
                let p = self.rank + j * self.world_size;
                if self.shuffle {
                    perm.apply(p)
                } else {
                    p
                }
            })
            .collect()
    }

    /// Seed for the shuffles inside a block; does not depend on the thread that runs it.
    pub fn block_seed(&self, epoch: u64, block: u64) -> u64 {
        seed_of(&[self.seed, epoch, self.rank, self.world_size, block, 0xb10c])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn feistel_is_a_permutation(n in 1u64..3000, key in any::<u64>()) {
            let p = FeistelPermutation::new(n, key);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let j = p.apply(i) as usize;
                prop_assert!(!seen[j]);
                seen[j] = true;
            }
        }

        #[test]
        fn ranks_cover_every_frame_once(n in 1u64..500, world in 1u64..9, fpb in 1u64..7, epoch in 0u64..4) {
            let mut seen = vec![0u32; n as usize];
            for rank in 0..world {
                let o = RankOrder { n_frames: n, rank, world_size: world, frames_per_block: fpb, shuffle: true, seed: 7 };
                for b in 0..o.blocks_per_epoch() {
                    for f in o.block_frames(epoch, b) {
                        seen[f as usize] += 1;
                    }
                }
            }
            prop_assert!(seen.iter().all(|&c| c == 1));
        }
    }

    #[test]
    fn shuffle_changes_with_epoch() {
        let o = RankOrder {
            n_frames: 100,
            rank: 0,
            world_size: 1,
            frames_per_block: 100,
            shuffle: true,
            seed: 1,
        };
        assert_ne!(o.block_frames(0, 0), o.block_frames(1, 0));
        let plain = RankOrder {
            shuffle: false,
            ..o
        };
        assert_eq!(plain.block_frames(3, 0), (0..100).collect::<Vec<_>>());
    }
}
