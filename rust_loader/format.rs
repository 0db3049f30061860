//! The on-disk layout of one token shard (see docs/FORMAT.md).
//!
//! ```text
//! [zstd frame 0][zstd frame 1]...[index][footer: 48 bytes]
//! index  = n_frames: u64, n_docs: u64, n_frames x FrameEntry (48 bytes), n_docs x u32 doc length
//! footer = magic (8) | version u32 | token width u32 | index offset u64 | index length u64
//!          | index xxh3 u64 | reserved u64
//! ```
//! All integers are little-endian. Frames are ordinary zstd frames, so any zstd tool decodes them.
use crate::error::{Error, Result};

pub const MAGIC: &[u8; 8] = b"PTSHARD\0";
pub const VERSION: u32 = 1;
pub const FOOTER_LEN: usize = 48;
pub const FRAME_ENTRY_LEN: usize = 48;
pub const INDEX_HEADER_LEN: usize = 16;

/// The integer type of token ids on disk: u16 when the vocabulary fits, else u32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenDtype {
    U16,
    U32,
}

impl TokenDtype {
    pub fn width(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }

    pub fn from_width(width: u32) -> Option<Self> {
        match width {
            2 => Some(TokenDtype::U16),
            4 => Some(TokenDtype::U32),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TokenDtype::U16 => "uint16",
            TokenDtype::U32 => "uint32",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "uint16" => Some(TokenDtype::U16),
            "uint32" => Some(TokenDtype::U32),
            _ => None,
        }
    }

    /// The largest token id this dtype can hold.
    pub fn max_token(self) -> u32 {
        match self {
            TokenDtype::U16 => u16::MAX as u32,
            TokenDtype::U32 => u32::MAX,
        }
    }

    /// Reads token `i` of a little-endian token byte string.
    #[inline]
    pub fn get(self, bytes: &[u8], i: usize) -> u32 {
        match self {
            TokenDtype::U16 => u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]) as u32,
            TokenDtype::U32 => u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()),
        }
    }

    /// All tokens of a little-endian token byte string (tests and tools).
    pub fn to_u32s(self, bytes: &[u8]) -> Vec<u32> {
        (0..bytes.len() / self.width())
            .map(|i| self.get(bytes, i))
            .collect()
    }
}

/// One frame's entry in the shard index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FrameEntry {
    /// Byte offset of the zstd frame in the shard file.
    pub offset: u64,
    /// Compressed length in bytes.
    pub compressed_len: u64,
    /// Index (within the shard) of the frame's first document.
    pub first_doc: u64,
    pub n_docs: u64,
    pub n_tokens: u64,
    /// xxh3-64 of the compressed bytes, checked before decompression.
    pub checksum: u64,
}

impl FrameEntry {
    pub fn to_bytes(&self) -> [u8; FRAME_ENTRY_LEN] {
        let mut out = [0u8; FRAME_ENTRY_LEN];
        let fields = [
            self.offset,
            self.compressed_len,
            self.first_doc,
            self.n_docs,
            self.n_tokens,
            self.checksum,
        ];
        for (chunk, v) in out.chunks_exact_mut(8).zip(fields) {
            chunk.copy_from_slice(&v.to_le_bytes());
        }
        out
    }

    pub fn from_bytes(b: &[u8]) -> Self {
        let f = |i: usize| read_u64(b, 8 * i);
        FrameEntry {
            offset: f(0),
            compressed_len: f(1),
            first_doc: f(2),
            n_docs: f(3),
            n_tokens: f(4),
            checksum: f(5),
        }
    }
}

/// The fixed-size trailer that locates the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footer {
    pub version: u32,
    pub dtype: TokenDtype,
    pub index_offset: u64,
    pub index_len: u64,
    pub index_checksum: u64,
}

impl Footer {
    pub fn to_bytes(&self) -> [u8; FOOTER_LEN] {
        let mut out = [0u8; FOOTER_LEN];
        out[0..8].copy_from_slice(MAGIC);
        out[8..12].copy_from_slice(&self.version.to_le_bytes());
        out[12..16].copy_from_slice(&(self.dtype.width() as u32).to_le_bytes());
        out[16..24].copy_from_slice(&self.index_offset.to_le_bytes());
        out[24..32].copy_from_slice(&self.index_len.to_le_bytes());
        out[32..40].copy_from_slice(&self.index_checksum.to_le_bytes());
        out
    }

    /// Parses and checks magic, version and token width; `shard` names the file in errors.
    pub fn parse(b: &[u8], shard: &str) -> Result<Self> {
        if b.len() < FOOTER_LEN {
            return Err(Error::corrupt(shard, None, "file shorter than the footer"));
        }
        let b = &b[b.len() - FOOTER_LEN..];
        if &b[0..8] != MAGIC {
            return Err(Error::corrupt(
                shard,
                None,
                "bad magic: not a pytrain token shard (or truncated)",
            ));
        }
        let version = u32::from_le_bytes(b[8..12].try_into().unwrap());
        if version != VERSION {
            return Err(Error::corrupt(
                shard,
                None,
                format!("format version {version}, this build reads version {VERSION}"),
            ));
        }
        let width = u32::from_le_bytes(b[12..16].try_into().unwrap());
        let dtype = TokenDtype::from_width(width).ok_or_else(|| {
            Error::corrupt(shard, None, format!("token width {width} is not 2 or 4"))
        })?;
        Ok(Footer {
            version,
            dtype,
            index_offset: read_u64(b, 16),
            index_len: read_u64(b, 24),
            index_checksum: read_u64(b, 32),
        })
    }
}

#[inline]
pub fn read_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

#[inline]
pub fn read_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}
