//! Reads one shard: memory-mapped from the local disk, or from an object store by ranged
//! requests (footer and index once, at open; each frame when it is decoded). The footer and
//! index are validated on open; a frame's checksum is verified each time it is decoded,
//! wherever its bytes came from.
use std::borrow::Cow;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{Error, Result};
use crate::format::{
    checksum, read_u32, read_u64, Footer, FrameEntry, TokenDtype, FOOTER_LEN, FRAME_ENTRY_LEN,
    INDEX_HEADER_LEN,
};
use crate::storage::{FrameCache, Remote};
use bytes::Bytes;

enum Source {
    Mapped(Mmap),
    /// An object of a remote directory: its name there and its index, read at open.
    Remote {
        remote: Arc<Remote>,
        file: String,
        index: Bytes,
        /// Frames kept on the local disk (`data.cache_dir`), if asked for.
        cache: Option<Arc<FrameCache>>,
    },
}

/// A frame's compressed bytes: a view of the map, or the body of the ranged read that
/// fetched it (kept as received: no copy).
pub enum FrameBytes<'a> {
    Mapped(&'a [u8]),
    Fetched(Bytes),
    /// Read from the local cache of remote frames.
    Cached(Vec<u8>),
}

impl std::ops::Deref for FrameBytes<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            FrameBytes::Mapped(b) => b,
            FrameBytes::Fetched(b) => b,
            FrameBytes::Cached(b) => b,
        }
    }
}

pub struct ShardReader {
    name: String,
    source: Source,
    dtype: TokenDtype,
    frames: Vec<FrameEntry>,
    /// Byte offset in the file of the index.
    index_at: usize,
    /// Byte offset in the index of the per-document lengths (u32 each).
    doc_lengths_at: usize,
    n_docs: u64,
    file_len: u64,
}

impl ShardReader {
    /// Maps `path` and validates footer, index checksum and frame bounds.
    pub fn open(path: &Path) -> Result<Self> {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only and shards are never written after their atomic
        // rename into place. A file truncated by another process underneath us could raise
        // SIGBUS; that is the documented contract of every mmap-based reader.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let footer = Footer::parse(&mmap, &name)?;
        let (start, end) = index_bounds(&footer, mmap.len() as u64, &name)?;
        let index = &mmap[start..end];
        let parsed = parse_index(&footer, index, &name)?;
        let file_len = mmap.len() as u64;
        Ok(parsed.into_reader(name, Source::Mapped(mmap), footer, start, file_len))
    }

    /// Opens object `file` of a remote directory, `file_len` bytes long (as its manifest
    /// says): two ranged reads, the footer, then the index.
    pub fn open_remote(
        remote: Arc<Remote>,
        file: &str,
        file_len: u64,
        cache: Option<Arc<FrameCache>>,
    ) -> Result<Self> {
        let name = remote.url_of(file);
        if file_len < FOOTER_LEN as u64 {
            return Err(Error::corrupt(&name, None, "file shorter than the footer"));
        }
        let tail = remote.get_range(file, file_len - FOOTER_LEN as u64..file_len, "its footer")?;
        let footer = Footer::parse(&tail, &name)?;
        let (start, end) = index_bounds(&footer, file_len, &name)?;
        let index = remote.get_range(file, start as u64..end as u64, "its index")?;
        let parsed = parse_index(&footer, &index, &name)?;
        let source = Source::Remote {
            remote,
            file: file.to_string(),
            index,
            cache,
        };
        Ok(parsed.into_reader(name, source, footer, start, file_len))
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }
    pub fn frames(&self) -> &[FrameEntry] {
        &self.frames
    }
    pub fn n_docs(&self) -> u64 {
        self.n_docs
    }
    pub fn n_tokens(&self) -> u64 {
        self.frames.iter().map(|f| f.n_tokens).sum()
    }
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    fn index(&self) -> &[u8] {
        match &self.source {
            Source::Mapped(m) => &m[self.index_at..],
            Source::Remote { index, .. } => index,
        }
    }

    /// Length in tokens of document `doc` (shard-local index), read from the index.
    #[inline]
    pub fn doc_len(&self, doc: u64) -> u32 {
        read_u32(self.index(), self.doc_lengths_at + 4 * doc as usize)
    }

    /// The frame cache of a remote shard, if it has one, and frame `i`'s name in it.
    fn cache_slot(&self, i: usize) -> Option<(&FrameCache, String)> {
        match &self.source {
            Source::Remote {
                cache: Some(c),
                file,
                ..
            } => Some((c, format!("{file}.{i}"))),
            _ => None,
        }
    }

    /// The compressed bytes of frame `i`, exactly as stored (an ordinary zstd frame), from
    /// where the shard lives: a view of the map, or one ranged read of the remote object.
    fn read_frame(&self, i: usize) -> Result<FrameBytes<'_>> {
        let f = &self.frames[i];
        let (start, end) = (f.offset, f.offset + f.compressed_len);
        match &self.source {
            Source::Mapped(m) => Ok(FrameBytes::Mapped(&m[start as usize..end as usize])),
            Source::Remote { remote, file, .. } => Ok(FrameBytes::Fetched(remote.get_range(
                file,
                start..end,
                &format!("frame {i}"),
            )?)),
        }
    }

    /// Verifies the checksum of frame `i` and decompresses its tokens into `out`
    /// (little-endian bytes, `n_tokens * width` long).
    pub fn decode_frame(
        &self,
        i: usize,
        decompressor: &mut zstd::bulk::Decompressor<'_>,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let f = self.frames.get(i).ok_or_else(|| {
            Error::corrupt(
                &self.name,
                Some(i),
                format!("shard has only {} frames", self.frames.len()),
            )
        })?;
        // A remote frame comes from the local cache where it holds it (frames are named
        // once per read here).
        let slot = self.cache_slot(i);
        let cached = slot.as_ref().and_then(|(cache, key)| cache.get(key));
        let mut frame = match cached {
            Some(bytes) => FrameBytes::Cached(bytes),
            None => self.read_frame(i)?,
        };
        if !matches!(frame, FrameBytes::Mapped(_)) && checksum(&frame) != f.checksum {
            // Bytes from elsewhere than this disk's shard are read once more before the
            // frame is called corrupt: a body damaged on the way, or a cached copy gone bad
            // on the local disk (dropped first), is fetched again from the store.
            if let Some((cache, key)) = &slot {
                cache.forget(key);
            }
            frame = self.read_frame(i)?;
        }
        let raw: &[u8] = &frame;
        if checksum(raw) != f.checksum {
            return Err(Error::corrupt(
                &self.name,
                Some(i),
                "frame checksum mismatch",
            ));
        }
        if let (FrameBytes::Fetched(b), Some((cache, key))) = (&frame, &slot) {
            cache.put(key, b); // only bytes whose checksum held
        }
        let want = f.n_tokens as usize * self.dtype.width();
        // The frame header states its content size: check it before allocating, so a
        // corrupt index can never make us reserve an absurd amount of memory.
        match zstd::zstd_safe::get_frame_content_size(raw) {
            Ok(Some(size)) if size == want as u64 => {}
            other => {
                return Err(Error::corrupt(
                    &self.name,
                    Some(i),
                    format!(
                        "zstd frame header gives content size {other:?}, index says {want} bytes"
                    ),
                ))
            }
        }
        out.clear();
        out.reserve(want);
        let got = decompressor
            .decompress_to_buffer(raw, out)
            .map_err(|e| Error::corrupt(&self.name, Some(i), format!("zstd: {e}")))?;
        if got != want {
            return Err(Error::corrupt(
                &self.name,
                Some(i),
                format!("decoded {got} bytes, index says {want}"),
            ));
        }
        let doc_sum: u64 = (0..f.n_docs)
            .map(|d| self.doc_len(f.first_doc + d) as u64)
            .sum();
        if doc_sum != f.n_tokens {
            return Err(Error::corrupt(
                &self.name,
                Some(i),
                "document lengths do not add up to the frame's tokens",
            ));
        }
        Ok(())
    }

    /// Checks the checksum of every frame and the whole file against `file_checksum`.
    pub fn verify(&self, file_checksum: Option<u64>) -> Result<()> {
        let mut dec = zstd::bulk::Decompressor::new()
            .map_err(|e| Error::corrupt(&self.name, None, e.to_string()))?;
        let mut buf = Vec::new();
        for i in 0..self.frames.len() {
            self.decode_frame(i, &mut dec, &mut buf)?;
        }
        if let Some(want) = file_checksum {
            let whole = match &self.source {
                Source::Mapped(m) => Cow::Borrowed(&m[..]),
                Source::Remote { remote, file, .. } => Cow::Owned(remote.get(file)?),
            };
            if checksum(&whole) != want {
                return Err(Error::corrupt(
                    &self.name,
                    None,
                    "file checksum does not match the manifest",
                ));
            }
        }
        Ok(())
    }
}

/// Where the index lies in a file of `file_len` bytes: (start, end), checked against the
/// footer's promise that it ends where the footer begins.
fn index_bounds(footer: &Footer, file_len: u64, name: &str) -> Result<(usize, usize)> {
    let body_len = file_len - FOOTER_LEN as u64;
    let index_end = footer.index_offset.checked_add(footer.index_len);
    if index_end != Some(body_len) || footer.index_len < INDEX_HEADER_LEN as u64 {
        return Err(Error::corrupt(
            name,
            None,
            "index location in footer does not match file size",
        ));
    }
    Ok((footer.index_offset as usize, body_len as usize))
}

/// What the index says, validated: its checksum, counts, and every frame's bounds and order.
struct ParsedIndex {
    frames: Vec<FrameEntry>,
    doc_lengths_at: usize,
    n_docs: u64,
}

impl ParsedIndex {
    fn into_reader(
        self,
        name: String,
        source: Source,
        footer: Footer,
        index_at: usize,
        file_len: u64,
    ) -> ShardReader {
        ShardReader {
            name,
            source,
            dtype: footer.dtype,
            frames: self.frames,
            index_at,
            doc_lengths_at: self.doc_lengths_at,
            n_docs: self.n_docs,
            file_len,
        }
    }
}

fn parse_index(footer: &Footer, index: &[u8], name: &str) -> Result<ParsedIndex> {
    if checksum(index) != footer.index_checksum {
        return Err(Error::corrupt(name, None, "index checksum mismatch"));
    }
    let n_frames = read_u64(index, 0);
    let n_docs = read_u64(index, 8);
    let expect = (INDEX_HEADER_LEN as u64)
        .checked_add(n_frames.saturating_mul(FRAME_ENTRY_LEN as u64))
        .and_then(|v| v.checked_add(n_docs.saturating_mul(4)));
    if expect != Some(footer.index_len) {
        return Err(Error::corrupt(
            name,
            None,
            "index length disagrees with its frame and document counts",
        ));
    }
    let frames: Vec<FrameEntry> = (0..n_frames as usize)
        .map(|i| FrameEntry::from_bytes(&index[INDEX_HEADER_LEN + i * FRAME_ENTRY_LEN..]))
        .collect();
    let mut next_doc = 0u64;
    for (i, f) in frames.iter().enumerate() {
        let end = f.offset.checked_add(f.compressed_len);
        if end.is_none_or(|e| e > footer.index_offset) || f.first_doc != next_doc || f.n_docs == 0 {
            return Err(Error::corrupt(
                name,
                Some(i),
                "frame entry out of bounds or out of order",
            ));
        }
        next_doc += f.n_docs;
    }
    if next_doc != n_docs {
        return Err(Error::corrupt(
            name,
            None,
            "frames do not cover every document",
        ));
    }
    Ok(ParsedIndex {
        frames,
        doc_lengths_at: INDEX_HEADER_LEN + n_frames as usize * FRAME_ENTRY_LEN,
        n_docs,
    })
}
