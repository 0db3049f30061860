//! Where a dataset's bytes come from: the local disk (memory-mapped by the shard reader) or
//! an S3-compatible object store (crate::remote, the `s3` feature, which the Python
//! extension turns on), and the local cache of the frames read from a store. Only where
//! bytes come from changes: order, packing, state and checksums stay the shard reader's
//! and the loader's.
use std::sync::Arc;

use crate::error::{Error, Result};

#[cfg(feature = "s3")]
pub use crate::remote::{read_file, upload_dataset, Remote};

/// Without the `s3` feature (the pure-Rust core as `cargo test` builds it, without the AWS
/// stack) no remote dataset can be opened: `open` says so in one line, and the type has no
/// values, so its readers are never called.
#[cfg(not(feature = "s3"))]
pub enum Remote {}

#[cfg(not(feature = "s3"))]
impl Remote {
    pub fn open(url: &str) -> Result<Arc<Self>> {
        Err(Error::Remote {
            object: url.to_string(),
            detail: "this build reads no object storage (rust_loader's s3 feature)".to_string(),
        })
    }

    pub fn url_of(&self, _name: &str) -> String {
        match *self {}
    }

    pub fn get(&self, _name: &str) -> Result<Vec<u8>> {
        match *self {}
    }

    pub fn get_range(
        &self,
        _name: &str,
        _range: std::ops::Range<u64>,
        _what: &str,
    ) -> Result<bytes::Bytes> {
        match *self {}
    }
}

/// The URL schemes read from object storage.
pub const REMOTE_SCHEMES: [&str; 2] = ["s3://", "s3a://"];

pub fn is_remote(location: &str) -> bool {
    REMOTE_SCHEMES.iter().any(|s| location.starts_with(s))
}

/// A bounded local cache of the frames read from object storage: each frame, once its
/// checksum held, is kept as a file `<cache_dir>/<manifest hash>/<shard>.<frame>`, so a
/// second epoch, a restarted run or another rank of the node reads it from the local disk.
/// Keyed by the manifest's hash, datasets never mix, wherever they are read from. Bounded
/// by `limit` bytes of this process's view, least recently used first out (ranks on one
/// node each keep their own bound over the shared files). A cached frame is checked like
/// any other; one that fails is dropped and fetched again (crate::shard_reader).
pub struct FrameCache {
    dir: std::path::PathBuf,
    limit: u64,
    state: std::sync::Mutex<Recency>,
}

/// Which frames the cache holds and in what order they were last used: a lookup by name
/// and the oldest first, each in O(log n) (a read of every frame of a remote dataset
/// touches it, under the lock).
#[derive(Default)]
struct Recency {
    /// Frame name -> (its turn in `order`, bytes).
    by_name: std::collections::HashMap<String, (u64, u64)>,
    /// Turn -> frame name; the smallest turn is the least recently used.
    order: std::collections::BTreeMap<u64, String>,
    /// Bytes of the frames held.
    used: u64,
    turn: u64,
}

impl Recency {
    /// Frame `name`, now the most recently used (`len` bytes).
    fn touch(&mut self, name: &str, len: u64) {
        self.remove(name);
        self.turn += 1;
        self.order.insert(self.turn, name.to_string());
        self.by_name.insert(name.to_string(), (self.turn, len));
        self.used += len;
    }

    /// Drops frame `name` from the books; its bytes, if it was there.
    fn remove(&mut self, name: &str) -> Option<u64> {
        let (turn, len) = self.by_name.remove(name)?;
        self.order.remove(&turn);
        self.used -= len;
        Some(len)
    }

    /// The least recently used frames to drop until at most `limit` bytes are held.
    fn over(&mut self, limit: u64) -> Vec<String> {
        let mut out = Vec::new();
        while self.used > limit {
            let Some((_, name)) = self.order.pop_first() else {
                break;
            };
            if let Some((_, len)) = self.by_name.remove(&name) {
                self.used -= len;
            }
            out.push(name);
        }
        out
    }
}

impl FrameCache {
    /// The cache of the dataset whose manifest hashes to `key`, under `root`; what an
    /// earlier process left there counts against `limit` (oldest first out).
    pub fn open(root: &std::path::Path, key: u64, limit: u64) -> Result<Arc<Self>> {
        let dir = root.join(format!("{key:016x}"));
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))? {
            let entry = entry.map_err(|e| Error::io(&dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let Ok(meta) = entry.metadata() else { continue };
            if name.contains(".tmp") {
                let _ = std::fs::remove_file(entry.path()); // a write that died midway
                continue;
            }
            found.push((meta.modified().ok(), name, meta.len()));
        }
        found.sort();
        let mut books = Recency::default();
        for (_, name, len) in found {
            books.touch(&name, len);
        }
        let cache = Arc::new(FrameCache {
            dir,
            limit,
            state: std::sync::Mutex::new(books),
        });
        cache.evict();
        Ok(cache)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Recency> {
        // A panic while holding the lock leaves only this bookkeeping behind: still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Frame `name`'s bytes, if cached (it becomes the most recently used).
    pub fn get(&self, name: &str) -> Option<Vec<u8>> {
        let bytes = std::fs::read(self.dir.join(name)).ok()?;
        self.lock().touch(name, bytes.len() as u64);
        Some(bytes)
    }

    /// Keeps frame `name` (written to a temporary file, then renamed: a reader never sees
    /// half a frame), then evicts down to the bound. Failing to write only loses the cache.
    pub fn put(&self, name: &str, bytes: &[u8]) {
        let len = bytes.len() as u64;
        if len > self.limit {
            return;
        }
        // A name of its own per write: two threads (or ranks) keeping the same frame at
        // once never write into one file.
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = self
            .dir
            .join(format!("{name}.tmp{}-{n}", std::process::id()));
        if std::fs::write(&tmp, bytes).is_err()
            || std::fs::rename(&tmp, self.dir.join(name)).is_err()
        {
            let _ = std::fs::remove_file(&tmp);
            return;
        }
        self.lock().touch(name, len);
        self.evict();
    }

    /// Drops frame `name` (its bytes failed their checksum).
    pub fn forget(&self, name: &str) {
        let _ = std::fs::remove_file(self.dir.join(name));
        self.lock().remove(name);
    }

    /// Deletes the least recently used frames down to the bound (the files outside the
    /// lock: other readers go on meanwhile).
    fn evict(&self) {
        let gone = self.lock().over(self.limit);
        for name in gone {
            let _ = std::fs::remove_file(self.dir.join(&name));
        }
    }
}

#[cfg(all(test, not(feature = "s3")))]
mod tests {
    use crate::dataset::Dataset;

    #[test]
    fn without_the_s3_feature_a_remote_dataset_is_refused_in_one_line() {
        let url = "s3://bucket/web";
        let Err(e) = Dataset::open(std::path::Path::new(url)) else {
            panic!("{url} opened in a build without object storage");
        };
        assert_eq!(
            e.to_string(),
            "s3://bucket/web: this build reads no object storage (rust_loader's s3 feature)"
        );
    }
}
