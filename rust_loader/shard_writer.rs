//! Writes one shard: documents are grouped into frames of about `frame_bytes` of raw
//! tokens, each compressed as an independent zstd frame, followed by the index and footer.
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::Xxh3;

use crate::error::{Error, Result};
use crate::format::{checksum, Footer, FrameEntry, TokenDtype, INDEX_HEADER_LEN, VERSION};

/// What a finished shard holds, for the manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSummary {
    pub documents: u64,
    pub tokens: u64,
    pub frames: u64,
    pub bytes: u64,
    /// xxh3-64 of the whole file.
    pub checksum: u64,
}

pub struct ShardWriter {
    path: PathBuf,
    out: BufWriter<File>,
    file_hash: Xxh3,
    compressor: zstd::bulk::Compressor<'static>,
    dtype: TokenDtype,
    frame_bytes: usize,
    /// Raw little-endian tokens of the frame being filled.
    pending: Vec<u8>,
    pending_docs: u64,
    frames: Vec<FrameEntry>,
    doc_lengths: Vec<u32>,
    offset: u64,
    tokens: u64,
}

impl ShardWriter {
    /// Creates `path` (which must not exist yet).
    pub fn create(path: &Path, dtype: TokenDtype, frame_bytes: usize, level: i32) -> Result<Self> {
        if frame_bytes == 0 {
            return Err(Error::InvalidArgument(
                "frame_bytes must be positive".into(),
            ));
        }
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| Error::io(path, e))?;
        let compressor = zstd::bulk::Compressor::new(level).map_err(|e| Error::io(path, e))?;
        Ok(ShardWriter {
            path: path.to_path_buf(),
            out: BufWriter::with_capacity(1 << 20, file),
            file_hash: Xxh3::new(),
            compressor,
            dtype,
            frame_bytes,
            pending: Vec::with_capacity(frame_bytes),
            pending_docs: 0,
            frames: Vec::new(),
            doc_lengths: Vec::new(),
            offset: 0,
            tokens: 0,
        })
    }

    /// Compressed bytes written so far (frames only), to decide when to start a new shard.
    pub fn bytes_written(&self) -> u64 {
        self.offset
    }

    pub fn documents(&self) -> u64 {
        self.doc_lengths.len() as u64
    }

    /// Appends one document. Empty documents are rejected: the caller skips and counts them.
    pub fn add_document(&mut self, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument("empty document".into()));
        }
        let len = u32::try_from(tokens.len()).map_err(|_| {
            Error::InvalidArgument(format!(
                "document of {} tokens exceeds 2^32-1",
                tokens.len()
            ))
        })?;
        let max = self.dtype.max_token();
        if let Some(&bad) = tokens.iter().find(|&&t| t > max) {
            return Err(Error::InvalidArgument(format!(
                "token id {bad} does not fit {}; pack with dtype uint32",
                self.dtype.name()
            )));
        }
        let doc_bytes = tokens.len() * self.dtype.width();
        // A document that would overflow the current frame starts a new one; a document
        // larger than a frame on its own gets a frame of its own.
        if !self.pending.is_empty() && self.pending.len() + doc_bytes > self.frame_bytes {
            self.flush_frame()?;
        }
        match self.dtype {
            TokenDtype::U16 => self
                .pending
                .extend(tokens.iter().flat_map(|&t| (t as u16).to_le_bytes())),
            TokenDtype::U32 => self
                .pending
                .extend(tokens.iter().flat_map(|&t| t.to_le_bytes())),
        }
        self.pending_docs += 1;
        self.doc_lengths.push(len);
        self.tokens += tokens.len() as u64;
        if self.pending.len() >= self.frame_bytes {
            self.flush_frame()?;
        }
        Ok(())
    }

    fn write_all(&mut self, bytes: &[u8]) -> Result<()> {
        self.file_hash.update(bytes);
        self.out
            .write_all(bytes)
            .map_err(|e| Error::io(&self.path, e))?;
        self.offset += bytes.len() as u64;
        Ok(())
    }

    fn flush_frame(&mut self) -> Result<()> {
        if self.pending_docs == 0 {
            return Ok(());
        }
        let compressed = self
            .compressor
            .compress(&self.pending)
            .map_err(|e| Error::io(&self.path, e))?;
        let entry = FrameEntry {
            offset: self.offset,
            compressed_len: compressed.len() as u64,
            first_doc: self.doc_lengths.len() as u64 - self.pending_docs,
            n_docs: self.pending_docs,
            n_tokens: (self.pending.len() / self.dtype.width()) as u64,
            checksum: checksum(&compressed),
        };
        self.write_all(&compressed)?;
        self.frames.push(entry);
        self.pending.clear();
        self.pending_docs = 0;
        Ok(())
    }

    /// Writes the last frame, the index and the footer, and syncs the file to disk.
    pub fn finish(mut self) -> Result<ShardSummary> {
        self.flush_frame()?;
        let mut index = Vec::with_capacity(
            INDEX_HEADER_LEN + self.frames.len() * 48 + self.doc_lengths.len() * 4,
        );
        index.extend((self.frames.len() as u64).to_le_bytes());
        index.extend((self.doc_lengths.len() as u64).to_le_bytes());
        for f in &self.frames {
            index.extend(f.to_bytes());
        }
        for &l in &self.doc_lengths {
            index.extend(l.to_le_bytes());
        }
        let footer = Footer {
            version: VERSION,
            dtype: self.dtype,
            index_offset: self.offset,
            index_len: index.len() as u64,
            index_checksum: checksum(&index),
        };
        self.write_all(&index)?;
        self.write_all(&footer.to_bytes())?;
        self.out.flush().map_err(|e| Error::io(&self.path, e))?;
        self.out
            .get_ref()
            .sync_all()
            .map_err(|e| Error::io(&self.path, e))?;
        Ok(ShardSummary {
            documents: self.doc_lengths.len() as u64,
            tokens: self.tokens,
            frames: self.frames.len() as u64,
            bytes: self.offset,
            checksum: self.file_hash.digest(),
        })
    }
}
