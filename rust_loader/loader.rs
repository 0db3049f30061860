//! The loader: worker threads turn blocks into rows or batches, one assembler thread
//! walks the global stream of items (rows in pack mode, batches in bucket mode) and
//! writes this rank's batches, in order, into a ring of caller-provided batch slots; the
//! consumer takes ready slots and gives them back when it is done with them.
//!
//! One global order, whatever the world size: every rank walks the same stream (blocks
//! of frames in a seeded order per epoch, per source), cuts it into the same global
//! batches, and keeps batch g when g % world_size == rank. Only the rows a rank keeps are
//! copied; the others are planned and skipped. So after every rank has taken the same
//! number of batches (a step boundary), all ranks stand at the same point of the global
//! stream, and the state (per source: epoch, block, item, tokens taken; the items taken
//! by all ranks) is the same on every rank and independent of the world size: any number
//! of ranks can continue from it, and every document is delivered exactly once.
//!
//! Mixtures (pack mode): several sources, each its own stream; each row comes from the
//! source whose share of tokens in the current stage lags its weight most (a
//! deterministic deficit rule), so shares hold to within a row and a stage starts at its
//! exact item.
//!
//! Determinism: a block's output depends only on (config, source, epoch, block), and the
//! assembler consumes blocks in sequence whatever thread produced them, so the batches
//! are the same for any number of threads.
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{bounded, select, unbounded, Receiver, Sender};

use crate::block::{make_block, Block, BlockOutput, Decoder, Mode};
use crate::dataset::Dataset;
use crate::error::{Error, Result};
use crate::format::TokenDtype;
use crate::order::{seed_of, RankOrder};
use crate::pack::PackStrategy;
use crate::rows::{write_padding, BlockDocs, BufferPool, RowPlan, RowSlicesMut};

/// From global item `start` on (items taken by all ranks), source i gets `weights[i]` of
/// the tokens (weights need not sum to 1; a zero leaves the source out).
#[derive(Clone, Debug, PartialEq)]
pub struct Stage {
    pub start: u64,
    pub weights: Vec<f64>,
}

#[derive(Clone, Debug)]
pub struct LoaderConfig {
    pub mode: Mode,
    pub seed: u64,
    pub shuffle: bool,
    /// This process's rank and the number of ranks: which global batches it keeps.
    pub rank: u64,
    pub world_size: u64,
    /// Frames whose documents are shuffled and packed together.
    pub frames_per_block: u64,
    /// Stop after this many epochs (of every source); `None` streams forever.
    pub num_epochs: Option<u64>,
    pub threads: usize,
    /// Blocks the workers may run ahead of the assembler, per source.
    pub prefetch_blocks: usize,
    /// Leave out frames that fail their checksum or decoding (counted in the stats)
    /// instead of raising `CorruptShard`.
    pub skip_corrupt: bool,
    /// Mixture weights by stage, ascending starts, the first at 0; empty for one source.
    pub schedule: Vec<Stage>,
}

impl LoaderConfig {
    /// Row width and rows of the largest batch: the size a slot must have.
    pub fn slot_elems(&self) -> usize {
        match &self.mode {
            Mode::Pack {
                seq_len,
                batch_size,
                ..
            } => (seq_len + 1) * batch_size,
            Mode::Bucket(spec) => spec.slot_elems(),
        }
    }

    /// Items (rows or batches) per global batch.
    fn items_per_batch(&self) -> u64 {
        match &self.mode {
            Mode::Pack { batch_size, .. } => *batch_size as u64,
            Mode::Bucket(_) => 1,
        }
    }

    /// Hash of the settings that cut the stream into items (not threads, prefetch, rank,
    /// world size, mixture weights, or the rows a batch takes in pack mode: rows are
    /// packed block by block whatever the batch size, so a state at a batch boundary is a
    /// row boundary that any batch size continues from, as any world size does).
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint_with(None)
    }

    /// The fingerprint as versions before the batch size could change wrote it (pack
    /// mode's batch size included): states they saved resume at their batch size.
    fn legacy_fingerprint(&self) -> u64 {
        match &self.mode {
            Mode::Pack { batch_size, .. } => self.fingerprint_with(Some(*batch_size as u64)),
            Mode::Bucket(_) => self.fingerprint(),
        }
    }

    fn fingerprint_with(&self, batch_size: Option<u64>) -> u64 {
        let mode: Vec<u64> = match &self.mode {
            Mode::Pack {
                seq_len, strategy, ..
            } => {
                let mut v = vec![1, *seq_len as u64];
                v.extend(batch_size);
                v.push((*strategy == PackStrategy::Concat) as u64);
                v
            }
            Mode::Bucket(spec) => {
                let mut v = vec![2, spec.token_budget as u64];
                v.extend(spec.lengths.iter().map(|&l| l as u64));
                v
            }
        };
        let mut parts = vec![
            self.seed,
            self.shuffle as u64,
            self.frames_per_block,
            self.num_epochs.unwrap_or(u64::MAX),
        ];
        parts.extend(mode);
        // Not the mixture's schedule: weights may be changed on resume (each source
        // continues where it stood; no document is lost or repeated).
        seed_of(&parts)
    }

    fn validate(&self, sources: usize) -> Result<()> {
        let bad = |m: &str| Err(Error::InvalidArgument(m.to_string()));
        if self.world_size == 0 || self.rank >= self.world_size {
            return bad(&format!(
                "rank {} is not in 0..world_size {}",
                self.rank, self.world_size
            ));
        }
        if self.frames_per_block == 0 || self.threads == 0 || self.prefetch_blocks == 0 {
            return bad("frames_per_block, threads and prefetch_blocks must be positive");
        }
        if sources == 0 {
            return bad("at least one dataset is needed");
        }
        if sources > 1 && !matches!(self.mode, Mode::Pack { .. }) {
            return bad("a mixture of datasets needs mode 'pack' (bucket mode batches one source's documents by length)");
        }
        if sources > 1 || !self.schedule.is_empty() {
            if self.schedule.first().map(|s| s.start) != Some(0) {
                return bad("a mixture's first stage must start at 0");
            }
            if self.schedule.windows(2).any(|w| w[0].start >= w[1].start) {
                return bad("mixture stages must start at ascending points");
            }
            for st in &self.schedule {
                if st.weights.len() != sources
                    || st.weights.iter().any(|w| !w.is_finite() || *w < 0.0)
                    || st.weights.iter().all(|w| *w == 0.0)
                {
                    return bad(&format!(
                        "the stage at item {} needs one finite, non-negative weight per dataset, not all zero",
                        st.start
                    ));
                }
            }
        }
        match &self.mode {
            Mode::Pack {
                seq_len,
                batch_size,
                ..
            } if *seq_len == 0 || *batch_size == 0 => {
                bad("seq_len and batch_size must be positive")
            }
            Mode::Bucket(spec)
                if spec.lengths.is_empty()
                    || spec.lengths[0] == 0
                    || spec.lengths.windows(2).any(|w| w[0] >= w[1]) =>
            {
                bad("bucket lengths must be positive and strictly ascending")
            }
            _ => Ok(()),
        }
    }

    /// Index of the stage in force at global item `item`.
    fn stage_at(&self, item: u64) -> usize {
        self.schedule
            .iter()
            .rposition(|s| s.start <= item)
            .unwrap_or(0)
    }
}

/// Where one source stands: its next undelivered item is item `item` of block `block` of
/// `epoch`; `tokens` it has contributed (documents' tokens, all ranks), in the whole run
/// and in the current stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SourcePos {
    pub epoch: u64,
    pub block: u64,
    pub item: u64,
    pub tokens: u64,
    pub stage_tokens: u64,
}

/// Where the global stream stands: every source's position and the items (rows or
/// batches) all ranks have taken. The same on every rank at a step boundary.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Position {
    /// Empty: the start of every source.
    pub sources: Vec<SourcePos>,
    pub items: u64,
}

/// Everything needed to resume exactly, on any number of ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoaderState {
    pub manifest_hashes: Vec<u64>,
    pub config_fingerprint: u64,
    pub position: Position,
}

/// Memory of one batch slot: `capacity` tokens of `token_width` bytes and as many
/// document ids. The memory may belong to Python (pinned torch tensors), so it is held by
/// raw pointers plus an owner that keeps it alive.
pub struct SlotBuffers {
    tokens: *mut u8,
    token_width: usize,
    doc_ids: *mut i32,
    capacity: usize,
    _owner: Box<dyn Send>,
}

// SAFETY: the pointers refer to memory kept alive by `_owner` for as long as the
// SlotBuffers exists, and the ring protocol gives exactly one side (assembler while
// filling, consumer while held) access to a slot at a time.
unsafe impl Send for SlotBuffers {}
unsafe impl Sync for SlotBuffers {}

impl SlotBuffers {
    /// A slot backed by Rust-owned memory (tests, benches, machines without CUDA).
    pub fn owned(capacity: usize, dtype: TokenDtype) -> Self {
        let token_width = dtype.width();
        let mut o = (vec![0u8; capacity * token_width], vec![0i32; capacity]);
        let (t, d) = (o.0.as_mut_ptr(), o.1.as_mut_ptr());
        SlotBuffers {
            tokens: t,
            token_width,
            doc_ids: d,
            capacity,
            _owner: Box::new(o),
        }
    }

    /// A slot over foreign memory.
    ///
    /// # Safety
    /// `tokens` must be valid for `capacity * token_width` bytes and `doc_ids` for
    /// `capacity` i32s (aligned), neither aliased by any other writer, and both must stay
    /// valid as long as `owner` is alive.
    pub unsafe fn foreign(
        tokens: *mut u8,
        token_width: usize,
        doc_ids: *mut i32,
        capacity: usize,
        owner: Box<dyn Send>,
    ) -> Self {
        SlotBuffers {
            tokens,
            token_width,
            doc_ids,
            capacity,
            _owner: owner,
        }
    }

    /// # Safety
    /// The caller must have exclusive access to the slot (see the ring protocol).
    unsafe fn slices_mut(&self) -> RowSlicesMut<'_> {
        RowSlicesMut {
            tokens: std::slice::from_raw_parts_mut(self.tokens, self.capacity * self.token_width),
            doc_ids: std::slice::from_raw_parts_mut(self.doc_ids, self.capacity),
        }
    }
}

/// A filled slot handed to the consumer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadyBatch {
    pub slot: usize,
    pub rows: usize,
    /// Tokens per row (sequence length + 1).
    pub width: usize,
    /// Epoch (of its source) of the batch's first row.
    pub epoch: u64,
    /// The global position after the step this batch belongs to: what `state()` reports
    /// once it is delivered.
    pub position_after: Position,
    pub doc_tokens: u64,
    pub pad_tokens: u64,
    /// Pieces (runs of one document) in the batch. Every piece's last token has no target
    /// in its row, so the targets that count in the loss are `doc_tokens - pieces`.
    pub pieces: u64,
    /// Documents' tokens in the batch by source.
    pub source_tokens: Vec<u64>,
}

/// Read-only view of a held batch (Rust consumers; Python reads its own tensors).
pub struct BatchView<'a> {
    /// Little-endian token bytes, `dtype.width()` per token.
    pub token_bytes: &'a [u8],
    pub dtype: TokenDtype,
    pub doc_ids: &'a [i32],
}

impl BatchView<'_> {
    pub fn tokens(&self) -> Vec<u32> {
        (0..self.doc_ids.len())
            .map(|i| self.dtype.get(self.token_bytes, i))
            .collect()
    }
}

/// Running totals, readable at any time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoaderStats {
    pub batches: u64,
    pub doc_tokens: u64,
    pub pad_tokens: u64,
    /// Nanoseconds the consumer spent blocked in `next`.
    pub wait_ns: u64,
    pub documents_packed: u64,
    pub documents_cut: u64,
    pub frames_skipped: u64,
    /// Documents' tokens delivered to this rank, by source.
    pub tokens_by_source: Vec<u64>,
}

enum Message {
    Batch(ReadyBatch),
    Failed(Error),
    /// The last epoch is done.
    End,
}

/// Blocks of one source made by the workers, waiting for the assembler.
#[derive(Default)]
struct Produced {
    blocks: BTreeMap<u64, Result<Block>>,
    /// Next block sequence number to hand to a worker.
    next_seq: u64,
    /// Next block sequence number the assembler needs.
    consumed: u64,
}

/// One dataset of the stream and where its blocks start.
struct Source {
    ds: Arc<Dataset>,
    /// The global order of its frames (rank 0 of 1: every rank walks all of it).
    order: RankOrder,
    /// Linear block index (epoch * blocks_per_epoch + block) of sequence number 0.
    start_linear: u64,
    end_linear: Option<u64>,
}

impl Source {
    fn finished(&self, seq: u64) -> bool {
        self.end_linear
            .is_some_and(|end| self.start_linear + seq >= end)
    }
}

struct Shared {
    sources: Vec<Source>,
    config: LoaderConfig,
    start: Position,
    produced: Mutex<Vec<Produced>>,
    cv: Condvar,
    stop: AtomicBool,
    documents_packed: AtomicU64,
    documents_cut: AtomicU64,
    frames_skipped: AtomicU64,
    /// The most recent skipped frame's error, for the log.
    last_skipped: Mutex<Option<String>>,
    pool: BufferPool,
}

/// What the consumer side knows: the position after the last batch taken, the totals,
/// whether the stream has ended.
struct ConsumerState {
    position: Position,
    stats: LoaderStats,
    ended: bool,
}

pub struct Loader {
    shared: Arc<Shared>,
    slots: Arc<Vec<SlotBuffers>>,
    ready_rx: Receiver<Message>,
    free_tx: Sender<usize>,
    stop_tx: Mutex<Option<Sender<()>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    held: Mutex<HashSet<usize>>,
    state: Mutex<ConsumerState>,
}

impl Loader {
    /// Starts the threads over `datasets` (one, or the sources of a mixture, in the order
    /// of the schedule's weights). `start` is where to begin (a saved position, or the
    /// default: the start of every source).
    pub fn new(
        datasets: Vec<Arc<Dataset>>,
        config: LoaderConfig,
        slots: Vec<SlotBuffers>,
        start: Position,
    ) -> Result<Self> {
        config.validate(datasets.len())?;
        if slots.is_empty() {
            return Err(Error::InvalidArgument("at least one slot is needed".into()));
        }
        let need = config.slot_elems();
        if let Some(s) = slots.iter().find(|s| s.capacity < need) {
            return Err(Error::InvalidArgument(format!(
                "a slot holds {} tokens, the batch shape needs {need}",
                s.capacity
            )));
        }
        let width = datasets[0].dtype.width();
        if let Some(d) = datasets.iter().find(|d| d.dtype.width() != width) {
            return Err(Error::InvalidArgument(format!(
                "{} stores {}-byte tokens, {} {width}-byte ones: a mixture needs one token width (repack with the same --dtype)",
                d.dir.display(),
                d.dtype.width(),
                datasets[0].dir.display()
            )));
        }
        let tokenizer = |d: &Dataset| {
            let t = &d.manifest.tokenizer;
            (t.vocab_size, t.sha256.clone())
        };
        if let Some(d) = datasets
            .iter()
            .find(|d| tokenizer(d) != tokenizer(&datasets[0]))
        {
            let (v0, h0) = tokenizer(&datasets[0]);
            let (v, h) = tokenizer(d);
            let vocab = |v: Option<u64>| v.map_or_else(|| "unknown".to_string(), |v| v.to_string());
            return Err(Error::InvalidArgument(format!(
                "{} was packed with another tokenizer than {} (vocabulary {} vs {}, tokenizer sha256 {} vs {}): \
                 a mixture needs one vocabulary; repack with the same tokenizer.json",
                d.dir.display(),
                datasets[0].dir.display(),
                vocab(v),
                vocab(v0),
                h.as_deref().unwrap_or("none"),
                h0.as_deref().unwrap_or("none"),
            )));
        }
        if let Some(s) = slots.iter().find(|s| s.token_width != width) {
            return Err(Error::InvalidArgument(format!(
                "slot tokens are {} bytes wide, the dataset's tokens {width}",
                s.token_width
            )));
        }
        let mut start = start;
        if start.sources.is_empty() {
            start.sources = vec![SourcePos::default(); datasets.len()];
        }
        if start.sources.len() != datasets.len() {
            return Err(Error::State(format!(
                "the state has {} sources, the loader {}",
                start.sources.len(),
                datasets.len()
            )));
        }
        let mut sources = Vec::new();
        for (i, ds) in datasets.into_iter().enumerate() {
            let order = RankOrder {
                n_frames: ds.n_frames() as u64,
                rank: 0,
                world_size: 1,
                frames_per_block: config.frames_per_block,
                shuffle: config.shuffle,
                // Source 0 keeps the seed as given, so one dataset's batches do not change.
                seed: if i == 0 {
                    config.seed
                } else {
                    seed_of(&[config.seed, i as u64])
                },
            };
            if order.n_frames == 0 {
                return Err(Error::InvalidArgument(format!(
                    "{} has no frames (no documents)",
                    ds.dir.display()
                )));
            }
            let per = order.blocks_per_epoch();
            let p = start.sources[i];
            if p.block >= per {
                return Err(Error::State(format!(
                    "block {} is past the {per} blocks of an epoch of {}",
                    p.block,
                    ds.dir.display()
                )));
            }
            sources.push(Source {
                ds,
                start_linear: p.epoch * per + p.block,
                end_linear: config.num_epochs.map(|n| n * per),
                order,
            });
        }
        let n_sources = sources.len();
        let shared = Arc::new(Shared {
            produced: Mutex::new((0..n_sources).map(|_| Produced::default()).collect()),
            sources,
            start: start.clone(),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            documents_packed: AtomicU64::new(0),
            documents_cut: AtomicU64::new(0),
            frames_skipped: AtomicU64::new(0),
            last_skipped: Mutex::new(None),
            pool: BufferPool::default(),
            config,
        });
        let slots = Arc::new(slots);
        let (free_tx, free_rx) = bounded(slots.len());
        for i in 0..slots.len() {
            free_tx.send(i).expect("fresh channel");
        }
        let (ready_tx, ready_rx) = unbounded();
        let (stop_tx, stop_rx) = bounded::<()>(0);
        // Named threads ("ptl-..."), so tools (and the trainer's CPU accounting) can tell
        // the loader's CPU time from the rest of the process.
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| Error::Internal(format!("cannot start a loader thread: {e}")))
        };
        let mut threads = Vec::new();
        for i in 0..shared.config.threads {
            let sh = shared.clone();
            threads.push(spawn(
                format!("ptl-worker-{i}"),
                Box::new(move || worker(&sh)),
            )?);
        }
        let (sh, sl) = (shared.clone(), slots.clone());
        threads.push(spawn(
            "ptl-assembler".into(),
            Box::new(move || {
                // A panic would leave the consumer waiting forever: send it as an error.
                let tx = ready_tx.clone();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    assembler(&sh, &sl, &free_rx, &ready_tx, &stop_rx)
                }));
                if let Err(p) = r {
                    let _ = tx.send(Message::Failed(Error::Internal(
                        crate::error::panic_message(p),
                    )));
                }
            }),
        )?);
        Ok(Loader {
            shared,
            slots,
            ready_rx,
            free_tx,
            stop_tx: Mutex::new(Some(stop_tx)),
            threads: Mutex::new(threads),
            held: Mutex::new(HashSet::new()),
            state: Mutex::new(ConsumerState {
                position: start,
                stats: LoaderStats {
                    tokens_by_source: vec![0; n_sources],
                    ..Default::default()
                },
                ended: false,
            }),
        })
    }

    /// Blocks until the next batch is ready. `Ok(None)` at the end of the last epoch.
    pub fn next(&self) -> Result<Option<ReadyBatch>> {
        {
            let held = self.held.lock().unwrap();
            if held.len() == self.slots.len() {
                return Err(Error::InvalidArgument(format!(
                    "all {} slots are held by the consumer; release a batch before asking for the next",
                    self.slots.len()
                )));
            }
        }
        if self.state.lock().unwrap().ended {
            return Ok(None);
        }
        let t0 = Instant::now();
        let msg = self.ready_rx.recv();
        let waited = t0.elapsed().as_nanos() as u64;
        let mut st = self.state.lock().unwrap();
        st.stats.wait_ns += waited;
        match msg {
            Ok(Message::Batch(b)) => {
                self.held.lock().unwrap().insert(b.slot);
                st.position = b.position_after.clone();
                st.stats.batches += 1;
                st.stats.doc_tokens += b.doc_tokens;
                st.stats.pad_tokens += b.pad_tokens;
                for (t, n) in st.stats.tokens_by_source.iter_mut().zip(&b.source_tokens) {
                    *t += n;
                }
                Ok(Some(b))
            }
            Ok(Message::Failed(e)) => {
                st.ended = true;
                Err(e)
            }
            Ok(Message::End) => {
                st.ended = true;
                Ok(None)
            }
            Err(_) => {
                st.ended = true;
                Err(Error::Internal(
                    "the assembler thread stopped without a reason".into(),
                ))
            }
        }
    }

    /// Returns a held slot to the ring.
    pub fn release(&self, slot: usize) -> Result<()> {
        if !self.held.lock().unwrap().remove(&slot) {
            return Err(Error::InvalidArgument(format!("slot {slot} is not held")));
        }
        // The channel has room for every slot, so this never blocks.
        let _ = self.free_tx.send(slot);
        Ok(())
    }

    /// The data of a held batch.
    pub fn view(&self, b: &ReadyBatch) -> BatchView<'_> {
        assert!(
            self.held.lock().unwrap().contains(&b.slot),
            "slot {} is not held",
            b.slot
        );
        let s = &self.slots[b.slot];
        let n = b.rows * b.width;
        // SAFETY: the slot is held by the consumer, so the assembler does not write it
        // until it is released, and `n` is within the slot's capacity.
        unsafe {
            BatchView {
                token_bytes: std::slice::from_raw_parts(s.tokens, n * s.token_width),
                dtype: self.shared.sources[0].ds.dtype,
                doc_ids: std::slice::from_raw_parts(s.doc_ids, n),
            }
        }
    }

    pub fn state(&self) -> LoaderState {
        LoaderState {
            manifest_hashes: self
                .shared
                .sources
                .iter()
                .map(|s| s.ds.manifest_hash)
                .collect(),
            config_fingerprint: self.shared.config.fingerprint(),
            position: self.state.lock().unwrap().position.clone(),
        }
    }

    pub fn stats(&self) -> LoaderStats {
        let mut s = self.state.lock().unwrap().stats.clone();
        s.documents_packed = self.shared.documents_packed.load(Ordering::Relaxed);
        s.documents_cut = self.shared.documents_cut.load(Ordering::Relaxed);
        s.frames_skipped = self.shared.frames_skipped.load(Ordering::Relaxed);
        s
    }

    /// The error of the most recently skipped corrupt frame, if any.
    pub fn last_skipped(&self) -> Option<String> {
        self.shared.last_skipped.lock().unwrap().clone()
    }

    /// Blocks per epoch of each source.
    pub fn blocks_per_epoch(&self) -> Vec<u64> {
        self.shared
            .sources
            .iter()
            .map(|s| s.order.blocks_per_epoch())
            .collect()
    }

    pub fn n_slots(&self) -> usize {
        self.slots.len()
    }
}

impl Loader {
    /// Stops the threads and waits for them (a worker finishes the block it is reading:
    /// for a remote dataset, its requests in flight). Idempotent; the bindings call it
    /// without the GIL, so that a worker waiting on I/O never waits on Python too.
    pub fn shutdown(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.stop_tx.lock().unwrap().take();
        // Take the lock so that no worker is between its stop check and its wait.
        drop(self.shared.produced.lock().unwrap());
        self.shared.cv.notify_all();
        let threads: Vec<_> = self.threads.lock().unwrap().drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Checks a saved state against these datasets and this configuration and returns where
/// to start. Rank and world size are not part of it: any number of ranks may continue.
pub fn resume_position(
    datasets: &[Arc<Dataset>],
    config: &LoaderConfig,
    state: &LoaderState,
) -> Result<Position> {
    if state.manifest_hashes.len() != datasets.len() {
        return Err(Error::State(format!(
            "the state was saved for {} dataset(s), the loader reads {}",
            state.manifest_hashes.len(),
            datasets.len()
        )));
    }
    for (ds, &saved) in datasets.iter().zip(&state.manifest_hashes) {
        if saved != ds.manifest_hash {
            return Err(Error::State(format!(
                "the dataset in {} changed since the state was saved (manifest hash {:016x}, saved {saved:016x})",
                ds.dir.display(),
                ds.manifest_hash,
            )));
        }
    }
    if state.config_fingerprint != config.fingerprint()
        && state.config_fingerprint != config.legacy_fingerprint()
    {
        return Err(Error::State(
            "loader settings (mode, seq_len, strategy, buckets, seed, shuffle, frames_per_block or epochs; \
             for a state saved before batch sizes could change, the batch size) differ from the saved state"
                .into(),
        ));
    }
    Ok(state.position.clone())
}

fn worker(sh: &Shared) {
    let mut dec = Decoder::new();
    let prefetch = sh.config.prefetch_blocks as u64;
    loop {
        // The source with the fewest blocks ready ahead of the assembler gets the next one.
        let (src, seq) = {
            let mut p = sh.produced.lock().unwrap();
            loop {
                if sh.stop.load(Ordering::SeqCst) {
                    return;
                }
                let pick = (0..sh.sources.len())
                    .filter(|&i| {
                        !sh.sources[i].finished(p[i].next_seq)
                            && p[i].next_seq < p[i].consumed + prefetch
                    })
                    .min_by_key(|&i| (p[i].next_seq - p[i].consumed, i));
                if let Some(i) = pick {
                    p[i].next_seq += 1;
                    break (i, p[i].next_seq - 1);
                }
                if (0..sh.sources.len()).all(|i| sh.sources[i].finished(p[i].next_seq)) {
                    return;
                }
                p = sh.cv.wait(p).unwrap();
            }
        };
        let s = &sh.sources[src];
        let linear = s.start_linear + seq;
        let per = s.order.blocks_per_epoch();
        // A panic here would leave the assembler waiting for this block forever: turn it
        // into an error that reaches the consumer instead.
        let block = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            make_block(
                &s.ds,
                &s.order,
                &sh.config.mode,
                (linear / per, linear % per),
                &mut dec,
                &sh.pool,
                sh.config.skip_corrupt,
            )
        }))
        .unwrap_or_else(|p| Err(Error::Internal(crate::error::panic_message(p))));
        let failed = block.is_err();
        sh.produced.lock().unwrap()[src].blocks.insert(seq, block);
        sh.cv.notify_all();
        if failed {
            return;
        }
    }
}

/// The assembler's place in one source: the block holding its next item, if fetched.
struct Cursor {
    /// Linear block index of the next item, and the item's index in that block.
    linear: u64,
    item: u64,
    block: Option<Block>,
    done: bool,
    tokens: u64,
    stage_tokens: u64,
}

/// Outcome of asking a source for its block.
enum Fetch {
    Ready,
    Done,
    Stop,
    Failed(Error),
}

impl Shared {
    /// Makes sure cursor `i` holds the block of its next item (skipping empty blocks).
    fn fetch(&self, i: usize, c: &mut Cursor) -> Fetch {
        loop {
            if let Some(b) = &c.block {
                if (c.item as usize) < b.output.n_items() {
                    return Fetch::Ready;
                }
                c.block.take().unwrap().recycle(&self.pool);
                c.linear += 1;
                c.item = 0;
            }
            let s = &self.sources[i];
            let seq = c.linear - s.start_linear;
            if s.finished(seq) {
                c.done = true;
                return Fetch::Done;
            }
            let block = {
                let mut p = self.produced.lock().unwrap();
                loop {
                    if self.stop.load(Ordering::SeqCst) {
                        return Fetch::Stop;
                    }
                    if let Some(b) = p[i].blocks.remove(&seq) {
                        p[i].consumed = seq + 1;
                        break b;
                    }
                    p = self.cv.wait(p).unwrap();
                }
            };
            self.cv.notify_all();
            let block = match block {
                Ok(b) => b,
                Err(e) => return Fetch::Failed(e),
            };
            self.documents_packed
                .fetch_add(block.stats.documents, Ordering::Relaxed);
            self.documents_cut
                .fetch_add(block.stats.cut_documents, Ordering::Relaxed);
            if let Some(last) = block.skipped_frames.last() {
                self.frames_skipped
                    .fetch_add(block.skipped_frames.len() as u64, Ordering::Relaxed);
                *self.last_skipped.lock().unwrap() = Some(last.clone());
            }
            c.block = Some(block);
        }
    }

    fn position(&self, cursors: &[Cursor], items: u64) -> Position {
        let sources = cursors
            .iter()
            .zip(&self.sources)
            .map(|(c, s)| {
                let per = s.order.blocks_per_epoch();
                // An exhausted block's next item is the start of the following block.
                let (linear, item) = match &c.block {
                    Some(b) if c.item as usize >= b.output.n_items() => (c.linear + 1, 0),
                    _ => (c.linear, c.item),
                };
                SourcePos {
                    epoch: linear / per,
                    block: linear % per,
                    item,
                    tokens: c.tokens,
                    stage_tokens: c.stage_tokens,
                }
            })
            .collect();
        Position { sources, items }
    }

    /// The source of the next row: among those with weight and data left, the one whose
    /// tokens in this stage lag its weight most (ties: the lowest index).
    fn pick(&self, cursors: &[Cursor], stage: usize) -> Option<usize> {
        if self.sources.len() == 1 {
            return (!cursors[0].done).then_some(0);
        }
        let w = &self.config.schedule[stage].weights;
        let total: u64 = cursors.iter().map(|c| c.stage_tokens).sum();
        let wsum: f64 = (0..cursors.len())
            .filter(|&i| !cursors[i].done)
            .map(|i| w[i])
            .sum();
        (0..cursors.len())
            .filter(|&i| !cursors[i].done && w[i] > 0.0)
            .map(|i| {
                let deficit = w[i] / wsum * total as f64 - cursors[i].stage_tokens as f64;
                (i, deficit)
            })
            .fold(None, |best: Option<(usize, f64)>, (i, d)| match best {
                Some((_, bd)) if bd >= d => best,
                _ => Some((i, d)),
            })
            .map(|(i, _)| i)
    }
}

/// Walks the global stream and fills this rank's batches in order. Returns when the data
/// ends, on error, or on stop.
fn assembler(
    sh: &Shared,
    slots: &[SlotBuffers],
    free_rx: &Receiver<usize>,
    ready_tx: &Sender<Message>,
    stop_rx: &Receiver<()>,
) {
    let acquire = || -> Option<usize> {
        select! {
            recv(free_rx) -> s => s.ok(),
            recv(stop_rx) -> _ => None,
        }
    };
    let cfg = &sh.config;
    let (rank, world) = (cfg.rank, cfg.world_size);
    let per_batch = cfg.items_per_batch();
    let n = sh.sources.len();
    let mut cursors: Vec<Cursor> = (0..n)
        .map(|i| {
            let p = sh.start.sources[i];
            Cursor {
                linear: sh.sources[i].start_linear,
                item: p.item,
                block: None,
                done: false,
                tokens: p.tokens,
                stage_tokens: p.stage_tokens,
            }
        })
        .collect();
    // Items taken by all ranks (global) and since this start (local numbering of batches:
    // the start is a step boundary, so batch 0 here is rank 0's).
    let mut items = sh.start.items;
    let mut local = 0u64;
    // The stage of the last item taken: its per-stage token counts are in the state.
    let mut stage = cfg.stage_at(items.saturating_sub(1));
    let mut filling: Option<Filling> = None;
    // This rank's finished batch, held until the last batch of its step group is walked,
    // so that its position is the group's end: the same on every rank.
    let mut pending: Option<Filling> = None;
    loop {
        if !cfg.schedule.is_empty() && cfg.stage_at(items) != stage {
            stage = cfg.stage_at(items);
            for c in &mut cursors {
                c.stage_tokens = 0;
            }
        }
        let Some(src) = sh.pick(&cursors, stage) else {
            // Every source ended: deliver what this rank holds, padded.
            let end = sh.position(&cursors, items);
            for f in [pending.take(), filling.take()].into_iter().flatten() {
                let _ = ready_tx.send(Message::Batch(f.finish(slots, end.clone())));
            }
            let _ = ready_tx.send(Message::End);
            return;
        };
        match sh.fetch(src, &mut cursors[src]) {
            Fetch::Ready => {}
            Fetch::Done => continue,
            Fetch::Stop => return,
            Fetch::Failed(e) => {
                let _ = ready_tx.send(Message::Failed(e));
                return;
            }
        }
        let c = &mut cursors[src];
        let block = c.block.as_ref().unwrap();
        let i = c.item as usize;
        let batch = local / per_batch;
        let mine = batch % world == rank;
        let epoch = c.linear / sh.sources[src].order.blocks_per_epoch();
        let tokens = match &block.output {
            BlockOutput::Rows(rows) => {
                if mine {
                    if filling.is_none() {
                        let Some(slot) = acquire() else { return };
                        filling =
                            Some(Filling::new(slot, rows.width, per_batch as usize, epoch, n));
                    }
                    filling
                        .as_mut()
                        .unwrap()
                        .push(slots, rows, i, &block.docs, src);
                }
                rows.row_tokens(i)
            }
            BlockOutput::Batches(batches) => {
                let b = &batches[i];
                if mine {
                    let Some(slot) = acquire() else { return };
                    let mut f = Filling::new(slot, b.width, b.n_rows(), epoch, n);
                    for r in 0..b.n_rows() {
                        f.push(slots, b, r, &block.docs, src);
                    }
                    filling = Some(f);
                }
                (0..b.n_rows()).map(|r| b.row_tokens(r)).sum()
            }
        };
        c.item += 1;
        c.tokens += tokens;
        c.stage_tokens += tokens;
        items += 1;
        local += 1;
        if local % per_batch == 0 {
            if mine {
                pending = filling.take();
            }
            if batch % world == world - 1 {
                if let Some(f) = pending.take() {
                    let pos = sh.position(&cursors, items);
                    let _ = ready_tx.send(Message::Batch(f.finish(slots, pos)));
                }
            }
        }
    }
}

/// A slot being filled row by row.
struct Filling {
    slot: usize,
    width: usize,
    capacity_rows: usize,
    rows: usize,
    epoch: u64,
    doc_tokens: u64,
    pad_tokens: u64,
    pieces: u64,
    source_tokens: Vec<u64>,
}

impl Filling {
    fn new(slot: usize, width: usize, capacity_rows: usize, epoch: u64, sources: usize) -> Self {
        Filling {
            slot,
            width,
            capacity_rows,
            rows: 0,
            epoch,
            doc_tokens: 0,
            pad_tokens: 0,
            pieces: 0,
            source_tokens: vec![0; sources],
        }
    }

    /// Writes planned row `r` (tokens from `docs` of source `src`) as the slot's next row.
    fn push(
        &mut self,
        slots: &[SlotBuffers],
        plan: &RowPlan,
        r: usize,
        docs: &BlockDocs,
        src: usize,
    ) {
        // SAFETY: the assembler took this slot from the free channel, so it has exclusive
        // access until it sends the slot to the consumer.
        let mut dst = unsafe { slots[self.slot].slices_mut() };
        plan.write_row(r, docs, &mut dst, self.rows);
        let real = plan.row_tokens(r);
        self.doc_tokens += real;
        self.source_tokens[src] += real;
        self.pad_tokens += plan.width as u64 - real;
        self.pieces += plan.row(r).len() as u64;
        self.rows += 1;
    }

    /// Pads the remaining rows and returns the ready batch.
    fn finish(mut self, slots: &[SlotBuffers], position_after: Position) -> ReadyBatch {
        if self.rows < self.capacity_rows {
            // SAFETY: as in `push`.
            let slot = &slots[self.slot];
            let mut dst = unsafe { slot.slices_mut() };
            let (a, b) = (self.rows * self.width, self.capacity_rows * self.width);
            write_padding(&mut dst, slot.token_width, a, b);
            self.pad_tokens += (b - a) as u64;
        }
        ReadyBatch {
            slot: self.slot,
            rows: self.capacity_rows,
            width: self.width,
            epoch: self.epoch,
            position_after,
            doc_tokens: self.doc_tokens,
            pad_tokens: self.pad_tokens,
            pieces: self.pieces,
            source_tokens: self.source_tokens,
        }
    }
}
