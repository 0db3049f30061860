//! Tokenizing documents for packing, with Hugging Face's `tokenizers` crate: a batch of
//! texts in, their ids back to back (with the end/begin-of-document tokens) and their
//! lengths out. The Python package of the same library hands back one Python int per
//! token, which on a 16-core machine made the interpreter, not the tokenizer, the limit
//! of pack-shards (0.53x of a bare `encode_batch_fast`, BENCHMARKS.md).

use crate::{Error, Result};
use tokenizers::Tokenizer;

/// A tokenizer set up for packing: no truncation, no padding, no template tokens.
pub struct Encoder {
    tok: Tokenizer,
    eos: Option<u32>,
    bos: Option<u32>,
}

/// Documents of one batch: ids back to back, lengths, how many encoded to nothing
/// (skipped: an empty document has no end token either), and the UTF-8 bytes of the
/// texts (for bits per byte; counted here, where the strings already are).
pub struct Encoded {
    pub ids: Vec<u32>,
    pub lengths: Vec<u32>,
    pub empty: usize,
    pub text_bytes: u64,
}

impl Encoder {
    /// `json` is a tokenizer.json; `eos`/`bos` the ids added around every document.
    pub fn new(json: &str, eos: Option<u32>, bos: Option<u32>) -> Result<Self> {
        let mut tok: Tokenizer = json
            .parse()
            .map_err(|e| Error::InvalidArgument(format!("tokenizer.json: {e}")))?;
        tok.with_truncation(None)
            .map_err(|e| Error::InvalidArgument(format!("tokenizer.json: {e}")))?;
        tok.with_padding(None);
        Ok(Encoder { tok, eos, bos })
    }

    /// Encodes `texts` in parallel (the tokenizer's thread pool), in order.
    pub fn encode(&self, texts: Vec<String>) -> Result<Encoded> {
        let text_bytes = texts.iter().map(|t| t.len() as u64).sum();
        let encodings = self
            .tok
            .encode_batch_fast(texts, false)
            .map_err(|e| Error::InvalidArgument(format!("tokenizer: {e}")))?;
        let extra = usize::from(self.eos.is_some()) + usize::from(self.bos.is_some());
        let total: usize = encodings.iter().map(|e| e.len() + extra).sum();
        let mut out = Encoded {
            ids: Vec::with_capacity(total),
            lengths: Vec::with_capacity(encodings.len()),
            empty: 0,
            text_bytes,
        };
        for e in &encodings {
            let ids = e.get_ids();
            if ids.is_empty() {
                out.empty += 1;
                continue;
            }
            out.ids.extend(self.bos);
            out.ids.extend_from_slice(ids);
            out.ids.extend(self.eos);
            let len = ids.len() + extra;
            out.lengths.push(u32::try_from(len).map_err(|_| {
                Error::InvalidArgument(format!("a document of {len} tokens exceeds 2^32"))
            })?);
        }
        Ok(out)
    }
}
