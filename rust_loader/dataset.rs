//! A dataset directory: `manifest.json` plus shard files, opened and cross-checked.
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::format::{checksum, TokenDtype};
use crate::shard_reader::ShardReader;

pub const MANIFEST: &str = "manifest.json";
pub const FORMAT_NAME: &str = "pytrain-token-shards";

#[derive(Debug, Deserialize, serde::Serialize)]
pub struct ManifestShard {
    pub file: String,
    pub documents: u64,
    pub tokens: u64,
    pub frames: u64,
    pub bytes: u64,
    /// xxh3-64 of the whole shard file, as 16 hex digits.
    pub xxh3_64: String,
}

/// What the manifest says of the tokenizer that made the ids (pack-shards writes more).
#[derive(Debug, Default, Deserialize)]
pub struct ManifestTokenizer {
    /// Ids are below it: the model's vocabulary must cover it.
    pub vocab_size: Option<u64>,
    pub eos_id: Option<u32>,
    pub bos_id: Option<u32>,
    /// sha256 of the tokenizer file (the same ids mean the same text only under one).
    pub sha256: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub format_version: u32,
    pub dtype: String,
    pub shards: Vec<ManifestShard>,
    #[serde(default)]
    pub tokenizer: ManifestTokenizer,
}

/// Writes `manifest.json` into `dir`, the one writer of the format (pack-shards' Python
/// side and the synthetic writer both call it). `fields` holds what the caller knows (dtype,
/// tokenizer, shards, args, and anything else such as `bad_input`); the format name and
/// version and the totals are set here, the sums of the shards' entries (a caller's `totals`
/// may add counts the shards cannot tell, such as `input_bytes` or `skipped_empty`).
/// The file is synced before this returns. Keys are written sorted.
pub fn write_manifest(dir: &Path, fields: serde_json::Value) -> Result<()> {
    let serde_json::Value::Object(mut m) = fields else {
        return Err(Error::InvalidArgument("a manifest is a JSON object".into()));
    };
    let shards: Vec<ManifestShard> =
        serde_json::from_value(m.get("shards").cloned().unwrap_or(serde_json::Value::Null))
            .map_err(|e| Error::InvalidArgument(format!("manifest shards: {e}")))?;
    let mut totals = match m.remove("totals") {
        Some(serde_json::Value::Object(t)) => t,
        _ => serde_json::Map::new(),
    };
    let sum = |f: fn(&ManifestShard) -> u64| shards.iter().map(f).sum::<u64>();
    totals.insert("documents".into(), sum(|s| s.documents).into());
    totals.insert("tokens".into(), sum(|s| s.tokens).into());
    totals.insert("frames".into(), sum(|s| s.frames).into());
    totals.insert("bytes".into(), sum(|s| s.bytes).into());
    m.insert("totals".into(), totals.into());
    m.insert("format".into(), FORMAT_NAME.into());
    m.insert("format_version".into(), crate::format::VERSION.into());
    let path = dir.join(MANIFEST);
    let mut text = serde_json::to_vec_pretty(&serde_json::Value::Object(m))
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    text.push(b'\n');
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&path)?;
        std::io::Write::write_all(&mut f, &text)?;
        f.sync_all()
    };
    write().map_err(|e| Error::io(&path, e))
}

/// Where a global frame lives.
#[derive(Clone, Copy, Debug)]
pub struct FrameRef {
    pub shard: u32,
    pub frame: u32,
}

pub struct Dataset {
    pub dir: PathBuf,
    pub dtype: TokenDtype,
    pub shards: Vec<ShardReader>,
    /// Global frame id -> (shard, frame). O(frames), never O(documents).
    pub frames: Vec<FrameRef>,
    /// xxh3-64 of manifest.json's bytes: identifies the dataset in a saved loader state.
    pub manifest_hash: u64,
    pub manifest: Manifest,
}

fn manifest_err(path: &Path, detail: impl Into<String>) -> Error {
    Error::Manifest {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

impl Dataset {
    /// Opens `dir`, maps every shard and checks each against the manifest's counts.
    /// Opens the dataset at `dir`: a local directory, or an `s3://bucket/prefix` URL
    /// (crate::storage), whose manifest is read whole and each shard's footer and index by
    /// ranged requests.
    pub fn open(dir: &Path) -> Result<Self> {
        Self::open_cached(dir, None)
    }

    /// `open`, keeping the frames of a remote dataset in a bounded local cache: `cache` is
    /// (directory, bytes at most); ignored for a local dataset (crate::storage::FrameCache).
    pub fn open_cached(dir: &Path, cache: Option<(&Path, u64)>) -> Result<Self> {
        let mpath = dir.join(MANIFEST);
        let remote = match dir.to_str() {
            Some(url) if crate::storage::is_remote(url) => Some(crate::storage::Remote::open(url)?),
            _ => None,
        };
        let bytes = match &remote {
            Some(r) => r.get(MANIFEST)?,
            None => std::fs::read(&mpath).map_err(|e| Error::io(&mpath, e))?,
        };
        let manifest: Manifest =
            serde_json::from_slice(&bytes).map_err(|e| manifest_err(&mpath, e.to_string()))?;
        if manifest.format != FORMAT_NAME {
            return Err(manifest_err(
                &mpath,
                format!(
                    "field 'format' is {:?}, want {FORMAT_NAME:?}",
                    manifest.format
                ),
            ));
        }
        if manifest.format_version != crate::format::VERSION {
            return Err(manifest_err(
                &mpath,
                format!(
                    "field 'format_version' is {}, this build reads {}",
                    manifest.format_version,
                    crate::format::VERSION
                ),
            ));
        }
        let dtype = TokenDtype::from_name(&manifest.dtype).ok_or_else(|| {
            manifest_err(&mpath, format!("field 'dtype' is {:?}", manifest.dtype))
        })?;
        if manifest.shards.is_empty() {
            return Err(manifest_err(&mpath, "field 'shards' is empty"));
        }
        let frame_cache = match (&remote, cache) {
            (Some(_), Some((root, limit))) => Some(crate::storage::FrameCache::open(
                root,
                checksum(&bytes),
                limit,
            )?),
            _ => None,
        };
        let mut shards = Vec::with_capacity(manifest.shards.len());
        let mut frames = Vec::new();
        for (si, ms) in manifest.shards.iter().enumerate() {
            let reader = match &remote {
                Some(r) => {
                    ShardReader::open_remote(r.clone(), &ms.file, ms.bytes, frame_cache.clone())?
                }
                None => ShardReader::open(&dir.join(&ms.file))?,
            };
            let field = |name: &str, want: u64, got: u64| -> Result<()> {
                if want == got {
                    Ok(())
                } else {
                    Err(manifest_err(
                        &mpath,
                        format!("shards[{si}].{name} is {want} but {} has {got}", ms.file),
                    ))
                }
            };
            field("documents", ms.documents, reader.n_docs())?;
            field("tokens", ms.tokens, reader.n_tokens())?;
            field("frames", ms.frames, reader.frames().len() as u64)?;
            field("bytes", ms.bytes, reader.file_len())?;
            if reader.dtype() != dtype {
                return Err(manifest_err(
                    &mpath,
                    format!(
                        "{} holds {} tokens, manifest says {}",
                        ms.file,
                        reader.dtype().name(),
                        dtype.name()
                    ),
                ));
            }
            for f in 0..reader.frames().len() {
                frames.push(FrameRef {
                    shard: si as u32,
                    frame: f as u32,
                });
            }
            shards.push(reader);
        }
        Ok(Dataset {
            dir: dir.to_path_buf(),
            dtype,
            shards,
            frames,
            manifest_hash: checksum(&bytes),
            manifest,
        })
    }

    pub fn n_frames(&self) -> usize {
        self.frames.len()
    }

    pub fn n_docs(&self) -> u64 {
        self.shards.iter().map(|s| s.n_docs()).sum()
    }

    pub fn n_tokens(&self) -> u64 {
        self.shards.iter().map(|s| s.n_tokens()).sum()
    }

    /// Verifies every frame checksum and every whole-file checksum against the manifest.
    pub fn verify(&self) -> Result<()> {
        for (ms, reader) in self.manifest.shards.iter().zip(&self.shards) {
            let want = u64::from_str_radix(&ms.xxh3_64, 16).map_err(|_| {
                manifest_err(
                    &self.dir.join(MANIFEST),
                    format!("{}: xxh3_64 {:?} is not hex", ms.file, ms.xxh3_64),
                )
            })?;
            reader.verify(Some(want))?;
        }
        Ok(())
    }
}
