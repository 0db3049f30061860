//! PyO3 bindings, built by maturin as `pytrain._loader`. This layer only converts types
//! and errors; the public Python API is `pytrain.data` and `pytrain.data.shards`.
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use pyo3::create_exception;
use pyo3::exceptions::{
    PyException, PyFileNotFoundError, PyOSError, PyPermissionError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::block::Mode;
use crate::dataset::Dataset;
use crate::error::{panic_message, Error};
use crate::format::TokenDtype;
use crate::loader::{
    resume_position, Loader, LoaderConfig, LoaderState, Position, SlotBuffers, SourcePos, Stage,
};
use crate::pack::{BucketSpec, PackStrategy};
use crate::shard_writer::ShardWriter;

create_exception!(
    pytrain._loader,
    LoaderError,
    PyException,
    "Base class of the loader's errors."
);
create_exception!(
    pytrain._loader,
    CorruptShardError,
    LoaderError,
    "A shard's bytes disagree with its checksums or index."
);
create_exception!(
    pytrain._loader,
    ManifestError,
    LoaderError,
    "manifest.json is missing, malformed or disagrees with the shards."
);
create_exception!(
    pytrain._loader,
    RemoteError,
    LoaderError,
    "An object in object storage could not be read (after the store's retries), or is not there."
);
create_exception!(
    pytrain._loader,
    StateError,
    LoaderError,
    "A saved loader state does not fit this dataset or configuration."
);

fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::Io { source, .. } => match source.kind() {
            std::io::ErrorKind::NotFound => PyFileNotFoundError::new_err(msg),
            std::io::ErrorKind::PermissionDenied => PyPermissionError::new_err(msg),
            _ => PyOSError::new_err(msg),
        },
        Error::CorruptShard { .. } => CorruptShardError::new_err(msg),
        Error::Manifest { .. } => ManifestError::new_err(msg),
        // A remote object that could not be read after the object store's retries.
        Error::Remote { .. } => RemoteError::new_err(msg),
        Error::State(_) => StateError::new_err(msg),
        Error::InvalidArgument(_) => PyValueError::new_err(msg),
        Error::Internal(_) => LoaderError::new_err(msg),
    }
}

/// Runs `f` with the GIL released, turning errors and panics into Python exceptions.
fn run<T: Send>(py: Python<'_>, f: impl FnOnce() -> crate::Result<T> + Send) -> PyResult<T> {
    py.detach(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)))
        .unwrap_or_else(|p| Err(Error::Internal(panic_message(p))))
        .map_err(to_py)
}

fn u32s(bytes: &[u8], what: &str) -> PyResult<Vec<u32>> {
    if bytes.len() % 4 != 0 {
        return Err(PyValueError::new_err(format!(
            "{what}: {} bytes is not a whole number of uint32",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

#[pyclass(name = "ShardWriter", module = "pytrain._loader")]
struct PyShardWriter {
    inner: Mutex<Option<ShardWriter>>,
}

#[pymethods]
impl PyShardWriter {
    #[new]
    #[pyo3(signature = (path, dtype, frame_bytes = 2 << 20, level = 3))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        dtype: &str,
        frame_bytes: usize,
        level: i32,
    ) -> PyResult<Self> {
        let dtype = TokenDtype::from_name(dtype).ok_or_else(|| {
            PyValueError::new_err(format!("dtype {dtype:?} is not 'uint16' or 'uint32'"))
        })?;
        let w = run(py, || ShardWriter::create(&path, dtype, frame_bytes, level))?;
        Ok(PyShardWriter {
            inner: Mutex::new(Some(w)),
        })
    }

    /// Appends documents: `tokens` holds little-endian uint32 ids of all documents back
    /// to back, `lengths` their lengths (uint32). Compression runs without the GIL.
    fn add_documents(&self, py: Python<'_>, tokens: &[u8], lengths: &[u8]) -> PyResult<()> {
        let tokens = u32s(tokens, "tokens")?;
        let lengths = u32s(lengths, "lengths")?;
        if lengths.iter().map(|&l| l as u64).sum::<u64>() != tokens.len() as u64 {
            return Err(PyValueError::new_err(
                "lengths do not add up to the number of tokens",
            ));
        }
        run(py, || {
            let mut guard = self.inner.lock().unwrap();
            let w = guard
                .as_mut()
                .ok_or_else(|| Error::InvalidArgument("writer is finished".into()))?;
            let mut at = 0usize;
            for &l in &lengths {
                w.add_document(&tokens[at..at + l as usize])?;
                at += l as usize;
            }
            Ok(())
        })
    }

    #[getter]
    fn bytes_written(&self) -> u64 {
        self.inner
            .lock()
            .unwrap()
            .as_ref()
            .map_or(0, |w| w.bytes_written())
    }

    #[getter]
    fn documents(&self) -> u64 {
        self.inner
            .lock()
            .unwrap()
            .as_ref()
            .map_or(0, |w| w.documents())
    }

    /// Writes index and footer, syncs, and returns the shard's summary for the manifest.
    fn finish<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = run(py, || {
            let w = self
                .inner
                .lock()
                .unwrap()
                .take()
                .ok_or_else(|| Error::InvalidArgument("writer is finished".into()))?;
            w.finish()
        })?;
        let d = PyDict::new(py);
        d.set_item("documents", s.documents)?;
        d.set_item("tokens", s.tokens)?;
        d.set_item("frames", s.frames)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("xxh3_64", format!("{:016x}", s.checksum))?;
        Ok(d)
    }
}

#[pyclass(name = "Dataset", module = "pytrain._loader", frozen)]
struct PyDataset {
    inner: Arc<Dataset>,
}

#[pymethods]
impl PyDataset {
    /// `cache_dir` and `cache_gb`: a bounded local cache of a remote dataset's frames
    /// (crate::storage::FrameCache); ignored for a local dataset.
    #[new]
    #[pyo3(signature = (path, cache_dir = None, cache_gb = 0.0))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        cache_dir: Option<PathBuf>,
        cache_gb: f64,
    ) -> PyResult<Self> {
        if cache_gb.is_nan() || cache_gb < 0.0 {
            return Err(PyValueError::new_err(format!(
                "cache_gb is {cache_gb}; expected a size in GB >= 0"
            )));
        }
        let limit = (cache_gb * 1e9) as u64;
        let cache = cache_dir
            .as_deref()
            .filter(|_| limit > 0)
            .map(|d| (d, limit));
        Ok(PyDataset {
            inner: Arc::new(run(py, || Dataset::open_cached(&path, cache))?),
        })
    }
    #[getter]
    fn n_docs(&self) -> u64 {
        self.inner.n_docs()
    }
    #[getter]
    fn n_tokens(&self) -> u64 {
        self.inner.n_tokens()
    }
    #[getter]
    fn n_frames(&self) -> usize {
        self.inner.n_frames()
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype.name()
    }
    #[getter]
    fn manifest_hash(&self) -> String {
        format!("{:016x}", self.inner.manifest_hash)
    }
    /// The tokenizer's vocabulary size from the manifest (None if it does not say).
    #[getter]
    fn vocab_size(&self) -> Option<u64> {
        self.inner.manifest.tokenizer.vocab_size
    }
    /// The end-of-document id pack-shards added (None if none).
    #[getter]
    fn eos_id(&self) -> Option<u32> {
        self.inner.manifest.tokenizer.eos_id
    }

    /// Lengths of every document in file order (little-endian uint32), read from the
    /// shard indexes without decoding any frame.
    fn doc_lengths<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let mut out = Vec::with_capacity(self.inner.n_docs() as usize * 4);
        for s in &self.inner.shards {
            for d in 0..s.n_docs() {
                out.extend(s.doc_len(d).to_le_bytes());
            }
        }
        PyBytes::new(py, &out)
    }

    /// Checks every frame checksum and every shard's file checksum.
    fn verify(&self, py: Python<'_>) -> PyResult<()> {
        run(py, || self.inner.verify())
    }

    /// Where global frame `frame` lives: (shard file, byte offset, compressed length, tokens).
    fn frame_location(&self, frame: usize) -> PyResult<(String, u64, u64, u64)> {
        let fr = *self
            .inner
            .frames
            .get(frame)
            .ok_or_else(|| PyValueError::new_err(format!("no frame {frame}")))?;
        let shard = &self.inner.shards[fr.shard as usize];
        let e = shard.frames()[fr.frame as usize];
        Ok((
            shard.name().to_string(),
            e.offset,
            e.compressed_len,
            e.n_tokens,
        ))
    }

    /// Decodes global frame `frame`: its tokens (little-endian bytes of the dataset's
    /// dtype) and the lengths of its documents.
    fn read_frame<'py>(
        &self,
        py: Python<'py>,
        frame: usize,
    ) -> PyResult<(Bound<'py, PyBytes>, Vec<u32>)> {
        let ds = self.inner.clone();
        let docs = run(py, move || {
            crate::block::read_block(
                &ds,
                &[frame as u64],
                &mut crate::block::Decoder::new(),
                &Default::default(),
            )
        })?;
        let lens = docs.docs.iter().map(|d| d.len).collect();
        Ok((PyBytes::new(py, &docs.frames[0]), lens))
    }
}

/// Reads a tensor's data pointer after checking what the loader relies on.
fn tensor_ptr(t: &Bound<'_, PyAny>, elem_size: usize, need: usize, what: &str) -> PyResult<usize> {
    let size: usize = t.call_method0("element_size")?.extract()?;
    let numel: usize = t.call_method0("numel")?.extract()?;
    let contiguous: bool = t.call_method0("is_contiguous")?.extract()?;
    let device: String = t.getattr("device")?.getattr("type")?.extract()?;
    if size != elem_size || numel < need || !contiguous || device != "cpu" {
        return Err(PyValueError::new_err(format!(
            "slot tensor {what}: need a contiguous CPU tensor of {need} elements of {elem_size} bytes, \
             got {numel} of {size} bytes on {device} (contiguous: {contiguous})"
        )));
    }
    t.call_method0("data_ptr")?.extract()
}

fn state_to_dict<'py>(py: Python<'py>, s: &LoaderState) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", 2)?;
    d.set_item("config", format!("{:016x}", s.config_fingerprint))?;
    d.set_item("items", s.position.items)?;
    let sources = PyList::empty(py);
    for (h, p) in s.manifest_hashes.iter().zip(&s.position.sources) {
        let e = PyDict::new(py);
        e.set_item("manifest_hash", format!("{h:016x}"))?;
        e.set_item("epoch", p.epoch)?;
        e.set_item("block", p.block)?;
        e.set_item("item", p.item)?;
        e.set_item("tokens", p.tokens)?;
        e.set_item("stage_tokens", p.stage_tokens)?;
        sources.append(e)?;
    }
    d.set_item("sources", sources)?;
    Ok(d)
}

fn field<'py>(d: &Bound<'py, PyDict>, k: &str) -> PyResult<Bound<'py, PyAny>> {
    d.get_item(k)?
        .ok_or_else(|| StateError::new_err(format!("loader state has no field {k:?}")))
}

fn hex_field(d: &Bound<'_, PyDict>, k: &str) -> PyResult<u64> {
    let s: String = field(d, k)?.extract()?;
    u64::from_str_radix(&s, 16)
        .map_err(|_| StateError::new_err(format!("loader state field {k:?} is not hex")))
}

/// Reads a saved state: version 2 (any world size), or version 1 (one dataset; saved by
/// one rank, or at an epoch boundary, where the old per-rank order meets the global one).
fn state_from_dict(d: &Bound<'_, PyDict>) -> PyResult<LoaderState> {
    let version: u32 = field(d, "version")?.extract()?;
    if version == 1 {
        let world: u64 = field(d, "world_size")?.extract()?;
        let p = SourcePos {
            epoch: field(d, "epoch")?.extract()?,
            block: field(d, "block")?.extract()?,
            item: field(d, "item")?.extract()?,
            tokens: 0,
            stage_tokens: 0,
        };
        if world != 1 && (p.block, p.item) != (0, 0) {
            return Err(StateError::new_err(format!(
                "the state was saved by an older version on {world} ranks in the middle of epoch {}, \
                 in an order this version does not use; resume it at an epoch boundary or with that version",
                p.epoch
            )));
        }
        return Ok(LoaderState {
            manifest_hashes: vec![hex_field(d, "manifest_hash")?],
            config_fingerprint: hex_field(d, "config")?,
            position: Position {
                sources: vec![p],
                items: 0,
            },
        });
    }
    if version != 2 {
        return Err(StateError::new_err(format!(
            "loader state version {version}, this build reads 1 and 2"
        )));
    }
    let mut hashes = Vec::new();
    let mut sources = Vec::new();
    for e in field(d, "sources")?.try_iter()? {
        let e = e?;
        let e = e
            .cast::<PyDict>()
            .map_err(|_| StateError::new_err("loader state: a source is not a dict"))?;
        hashes.push(hex_field(e, "manifest_hash")?);
        sources.push(SourcePos {
            epoch: field(e, "epoch")?.extract()?,
            block: field(e, "block")?.extract()?,
            item: field(e, "item")?.extract()?,
            tokens: field(e, "tokens")?.extract()?,
            stage_tokens: field(e, "stage_tokens")?.extract()?,
        });
    }
    Ok(LoaderState {
        manifest_hashes: hashes,
        config_fingerprint: hex_field(d, "config")?,
        position: Position {
            sources,
            items: field(d, "items")?.extract()?,
        },
    })
}

/// A batch the loader has filled: which slot holds it, its shape, and its token counts
/// (as tokenizers' `Encoding`, named fields instead of a tuple).
#[pyclass(name = "ReadyBatch", module = "pytrain._loader", frozen, get_all)]
struct PyReadyBatch {
    /// Index of the slot (a pair of CPU tensors) that holds the batch.
    slot: usize,
    rows: usize,
    /// Tokens per row (sequence length + 1).
    width: usize,
    /// Epoch of the batch's first row.
    epoch: u64,
    doc_tokens: u64,
    pad_tokens: u64,
    /// Runs of one document in the batch (each one's last token has no target).
    pieces: u64,
    /// Documents' tokens in the batch by source (one entry for a single dataset).
    source_tokens: Vec<u64>,
}

#[pymethods]
impl PyReadyBatch {
    fn __repr__(&self) -> String {
        format!(
            "ReadyBatch(slot={}, rows={}, width={}, epoch={}, doc_tokens={}, pad_tokens={}, pieces={})",
            self.slot, self.rows, self.width, self.epoch, self.doc_tokens, self.pad_tokens, self.pieces
        )
    }
}

/// The Rust loader's configuration from a Python `LoaderConfig` (attributes by name).
fn loader_config(c: &Bound<'_, PyAny>) -> PyResult<LoaderConfig> {
    fn get<'py, T: FromPyObjectOwned<'py>>(c: &Bound<'py, PyAny>, name: &str) -> PyResult<T> {
        let v = c.getattr(name)?;
        v.extract().map_err(|_| {
            PyValueError::new_err(format!("loader setting {name}: unexpected value {v}"))
        })
    }
    let strategy = match get::<String>(c, "strategy")?.as_str() {
        "best_fit" => PackStrategy::BestFit,
        "concat" => PackStrategy::Concat,
        s => {
            return Err(PyValueError::new_err(format!(
                "strategy {s:?} is not 'best_fit' or 'concat'"
            )))
        }
    };
    let mode = match get::<String>(c, "mode")?.as_str() {
        "pack" => Mode::Pack {
            seq_len: get(c, "seq_len")?,
            batch_size: get(c, "batch_size")?,
            strategy,
        },
        "bucket" => {
            let mut lengths: Vec<usize> = get(c, "bucket_lengths")?;
            lengths.sort_unstable();
            Mode::Bucket(BucketSpec {
                lengths,
                token_budget: get(c, "token_budget")?,
            })
        }
        m => {
            return Err(PyValueError::new_err(format!(
                "mode {m:?} is not 'pack' or 'bucket'"
            )))
        }
    };
    let threads: usize = get(c, "threads")?;
    let prefetch: usize = get(c, "prefetch_blocks")?;
    Ok(LoaderConfig {
        mode,
        seed: get(c, "seed")?,
        shuffle: get(c, "shuffle")?,
        rank: get(c, "rank")?,
        world_size: get(c, "world_size")?,
        frames_per_block: get(c, "frames_per_block")?,
        num_epochs: get(c, "num_epochs")?,
        threads,
        // 0: two blocks ahead per thread.
        prefetch_blocks: if prefetch == 0 { 2 * threads } else { prefetch },
        skip_corrupt: get(c, "skip_corrupt")?,
        schedule: Vec::new(),
    })
}

#[pyclass(name = "Loader", module = "pytrain._loader", frozen)]
struct PyLoader {
    inner: Loader,
}

#[pymethods]
impl PyLoader {
    /// `config` is `pytrain.config.LoaderConfig` (or any object with its attributes): the
    /// settings and their defaults are defined there, once, and read here by name.
    #[new]
    /// `datasets`: one, or a mixture's sources in the order of the schedule's weights;
    /// `schedule`: [(first global item, [weight per source]), ...] for a mixture.
    #[pyo3(signature = (datasets, slots, config, *, schedule=None, state=None))]
    fn new(
        py: Python<'_>,
        datasets: Vec<PyRef<'_, PyDataset>>,
        slots: Vec<Bound<'_, PyAny>>,
        config: &Bound<'_, PyAny>,
        schedule: Option<Vec<(u64, Vec<f64>)>>,
        state: Option<Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let mut config = loader_config(config)?;
        config.schedule = schedule
            .unwrap_or_default()
            .into_iter()
            .map(|(start, weights)| Stage { start, weights })
            .collect();
        if datasets.is_empty() {
            return Err(PyValueError::new_err("at least one dataset is needed"));
        }
        let dataset = &datasets[0];
        let need = config.slot_elems();
        let width = dataset.inner.dtype.width();
        let mut bufs = Vec::with_capacity(slots.len());
        for (i, slot) in slots.iter().enumerate() {
            let parts: Vec<Bound<'_, PyAny>> = slot.extract()?;
            if parts.len() != 2 {
                return Err(PyValueError::new_err(format!(
                    "slot {i}: need 2 tensors (tokens, doc_ids)"
                )));
            }
            let t = tensor_ptr(&parts[0], width, need, "tokens")?;
            let d = tensor_ptr(&parts[1], 4, need, "doc_ids")?;
            let owner: Box<dyn Send> = Box::new(slot.clone().unbind());
            // SAFETY: each pointer is the data of a contiguous CPU tensor of at least
            // `need` elements of the right size (checked above; torch aligns storage for
            // its dtype); `owner` keeps those tensors alive as long as the slot exists.
            // The Python wrapper creates these tensors itself and never writes to them.
            bufs.push(unsafe {
                SlotBuffers::foreign(t as *mut u8, width, d as *mut i32, need, owner)
            });
        }
        let ds: Vec<_> = datasets.iter().map(|d| d.inner.clone()).collect();
        let start = match state {
            Some(s) => {
                let s = state_from_dict(&s)?;
                resume_position(&ds, &config, &s).map_err(to_py)?
            }
            None => Position::default(),
        };
        let inner = run(py, move || Loader::new(ds, config, bufs, start))?;
        Ok(PyLoader { inner })
    }

    /// Stops the threads and waits for them, without the GIL (a worker may be waiting on a
    /// remote read); the loader gives no batch after it. Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        py.detach(|| self.inner.shutdown());
    }

    /// Blocks (without the GIL) until a batch is ready; None after the last epoch.
    fn next(&self, py: Python<'_>) -> PyResult<Option<PyReadyBatch>> {
        let b = run(py, || self.inner.next())?;
        Ok(b.map(|b| PyReadyBatch {
            slot: b.slot,
            rows: b.rows,
            width: b.width,
            epoch: b.epoch,
            doc_tokens: b.doc_tokens,
            pad_tokens: b.pad_tokens,
            pieces: b.pieces,
            source_tokens: b.source_tokens,
        }))
    }

    fn release(&self, slot: usize) -> PyResult<()> {
        self.inner.release(slot).map_err(to_py)
    }

    fn state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        state_to_dict(py, &self.inner.state())
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("batches", s.batches)?;
        d.set_item("doc_tokens", s.doc_tokens)?;
        d.set_item("pad_tokens", s.pad_tokens)?;
        d.set_item("wait_s", s.wait_ns as f64 * 1e-9)?;
        d.set_item("documents_packed", s.documents_packed)?;
        d.set_item("documents_cut", s.documents_cut)?;
        d.set_item("frames_skipped", s.frames_skipped)?;
        d.set_item("tokens_by_source", s.tokens_by_source)?;
        d.set_item("last_skipped", self.inner.last_skipped())?;
        Ok(d)
    }

    #[getter]
    fn blocks_per_epoch(&self) -> Vec<u64> {
        self.inner.blocks_per_epoch()
    }
}

/// Writes a synthetic dataset (log-normal lengths, Zipf ids; or traceable ids) for
/// benchmarks and tests; returns the number of tokens.
#[pyfunction]
#[pyo3(signature = (path, documents, *, mu = 6.0, sigma = 1.0, max_len = 32768, vocab = 50257,
                    traceable = false, frame_bytes = 2 << 20, docs_per_shard = 100_000, seed = 0,
                    level = 3))]
#[allow(clippy::too_many_arguments)]
fn write_synthetic(
    py: Python<'_>,
    path: PathBuf,
    documents: u64,
    mu: f64,
    sigma: f64,
    max_len: u32,
    vocab: u32,
    traceable: bool,
    frame_bytes: usize,
    docs_per_shard: u64,
    seed: u64,
    level: i32,
) -> PyResult<u64> {
    let spec = crate::synthetic::SyntheticSpec {
        documents,
        mu,
        sigma,
        max_len,
        vocab,
        traceable,
        frame_bytes,
        docs_per_shard,
        seed,
        level,
    };
    run(py, || crate::synthetic::write_synthetic(&path, &spec))
}

/// Writes a dataset's manifest.json from `fields` (JSON text): the format's one writer
/// (crate::dataset::write_manifest sets the format, version and totals).
#[pyfunction]
fn write_manifest(py: Python<'_>, path: PathBuf, fields: &str) -> PyResult<()> {
    let value: serde_json::Value = serde_json::from_str(fields)
        .map_err(|e| PyValueError::new_err(format!("manifest fields: {e}")))?;
    run(py, || crate::dataset::write_manifest(&path, value))
}

/// File `name` of the dataset directory `location` (a local path or an s3:// URL), or None
/// where it has none (crate::storage::read_file).
#[pyfunction]
fn read_file<'py>(
    py: Python<'py>,
    location: &str,
    name: &str,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let got = run(py, || crate::storage::read_file(location, name))?;
    Ok(got.map(|b| PyBytes::new(py, &b)))
}

/// Uploads the dataset directory `path` to the object-storage directory `location`, the
/// manifest last (crate::storage::upload_dataset).
#[pyfunction]
fn upload_dataset(py: Python<'_>, path: PathBuf, location: &str) -> PyResult<()> {
    run(py, || crate::storage::upload_dataset(&path, location))
}

/// pack-shards' tokenizer: encodes batches of documents without the GIL and hands the
/// ids back as little-endian uint32 bytes (no Python object per token).
#[pyclass(name = "Encoder", module = "pytrain._loader", frozen)]
struct PyEncoder {
    inner: crate::encode::Encoder,
}

#[pymethods]
impl PyEncoder {
    #[new]
    #[pyo3(signature = (tokenizer_json, eos=None, bos=None))]
    fn new(tokenizer_json: &str, eos: Option<u32>, bos: Option<u32>) -> PyResult<Self> {
        let inner = crate::encode::Encoder::new(tokenizer_json, eos, bos).map_err(to_py)?;
        Ok(PyEncoder { inner })
    }

    /// Returns (ids, lengths, empty, text_bytes): ids and lengths as little-endian uint32
    /// bytes, the number of texts that encoded to no tokens (left out), and the UTF-8
    /// bytes of all texts.
    fn encode<'py>(
        &self,
        py: Python<'py>,
        texts: Vec<String>,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>, usize, u64)> {
        let e = run(py, || self.inner.encode(texts))?;
        Ok((
            le_bytes(py, &e.ids)?,
            le_bytes(py, &e.lengths)?,
            e.empty,
            e.text_bytes,
        ))
    }
}

fn le_bytes<'py>(py: Python<'py>, v: &[u32]) -> PyResult<Bound<'py, PyBytes>> {
    PyBytes::new_with(py, v.len() * 4, |buf| {
        for (dst, x) in buf.chunks_exact_mut(4).zip(v) {
            dst.copy_from_slice(&x.to_le_bytes());
        }
        Ok(())
    })
}

#[pymodule]
#[pyo3(name = "_loader")]
fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyShardWriter>()?;
    m.add_class::<PyEncoder>()?;
    m.add_class::<PyReadyBatch>()?;
    m.add_class::<PyDataset>()?;
    m.add_class::<PyLoader>()?;
    m.add_function(wrap_pyfunction!(write_synthetic, m)?)?;
    m.add_function(wrap_pyfunction!(write_manifest, m)?)?;
    m.add_function(wrap_pyfunction!(read_file, m)?)?;
    m.add_function(wrap_pyfunction!(upload_dataset, m)?)?;
    m.add("LoaderError", py.get_type::<LoaderError>())?;
    m.add("CorruptShardError", py.get_type::<CorruptShardError>())?;
    m.add("ManifestError", py.get_type::<ManifestError>())?;
    m.add("StateError", py.get_type::<StateError>())?;
    m.add("RemoteError", py.get_type::<RemoteError>())?;
    m.add("FORMAT_VERSION", crate::format::VERSION)?;
    Ok(())
}
