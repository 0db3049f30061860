//! The loader: worker threads turn blocks into rows or batches, one assembler thread
//! writes them, in block order, into a ring of caller-provided batch slots, and the
//! consumer takes ready slots and gives them back when it is done with them.
//!
//! Determinism: a block's output depends only on (config, epoch, block), and blocks are
//! consumed in sequence order whatever thread produced them, so the batches are the
//! same for any number of threads. Resume: the position (epoch, block, item) of the next
//! undelivered item is all the state there is.
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

#[derive(Clone, Debug)]
pub struct LoaderConfig {
    pub mode: Mode,
    pub seed: u64,
    pub shuffle: bool,
    pub rank: u64,
    pub world_size: u64,
    /// Frames whose documents are shuffled and packed together.
    pub frames_per_block: u64,
    /// Stop after this many epochs; `None` streams forever.
    pub num_epochs: Option<u64>,
    pub threads: usize,
    /// Blocks the workers may run ahead of the assembler.
    pub prefetch_blocks: usize,
    /// Leave out frames that fail their checksum or decoding (counted in the stats)
    /// instead of raising `CorruptShard`.
    pub skip_corrupt: bool,
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

    /// Hash of every setting that changes which batches come out (not threads or prefetch).
    pub fn fingerprint(&self) -> u64 {
        let mode: Vec<u64> = match &self.mode {
            Mode::Pack {
                seq_len,
                batch_size,
                strategy,
            } => {
                vec![
                    1,
                    *seq_len as u64,
                    *batch_size as u64,
                    (*strategy == PackStrategy::Concat) as u64,
                ]
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
        seed_of(&parts)
    }

    fn validate(&self) -> Result<()> {
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
}

/// Where the next undelivered item is: block `block` of `epoch`, item `item` in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Position {
    pub epoch: u64,
    pub block: u64,
    pub item: u64,
}

/// Everything needed to resume exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoaderState {
    pub manifest_hash: u64,
    pub config_fingerprint: u64,
    pub rank: u64,
    pub world_size: u64,
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadyBatch {
    pub slot: usize,
    pub rows: usize,
    /// Tokens per row (sequence length + 1).
    pub width: usize,
    /// Epoch of the batch's first row.
    pub epoch: u64,
    /// The position after this batch: what `state()` reports once it is delivered.
    pub position_after: Position,
    pub doc_tokens: u64,
    pub pad_tokens: u64,
    /// Pieces (runs of one document) in the batch. Every piece's last token has no target
    /// in its row, so the targets that count in the loss are `doc_tokens - pieces`.
    pub pieces: u64,
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoaderStats {
    pub batches: u64,
    pub doc_tokens: u64,
    pub pad_tokens: u64,
    /// Nanoseconds the consumer spent blocked in `next`.
    pub wait_ns: u64,
    pub documents_packed: u64,
    pub documents_cut: u64,
    pub frames_skipped: u64,
}

enum Message {
    Batch(ReadyBatch),
    Failed(Error),
    /// The last epoch is done.
    End,
}

struct Produced {
    blocks: BTreeMap<u64, Result<Block>>,
    /// Next block sequence number to hand to a worker.
    next_seq: u64,
    /// Next block sequence number the assembler needs.
    consumed: u64,
}

struct Shared {
    ds: Arc<Dataset>,
    order: RankOrder,
    config: LoaderConfig,
    /// Linear block index (epoch * blocks_per_epoch + block) of sequence number 0.
    start_linear: u64,
    start_item: u64,
    end_linear: Option<u64>,
    produced: Mutex<Produced>,
    cv: Condvar,
    stop: AtomicBool,
    documents_packed: AtomicU64,
    documents_cut: AtomicU64,
    frames_skipped: AtomicU64,
    /// The most recent skipped frame's error, for the log.
    last_skipped: Mutex<Option<String>>,
    pool: BufferPool,
}

impl Shared {
    fn position(&self, linear: u64, item: u64) -> Position {
        let per = self.order.blocks_per_epoch();
        Position {
            epoch: linear / per,
            block: linear % per,
            item,
        }
    }

    fn finished(&self, seq: u64) -> bool {
        self.end_linear
            .is_some_and(|end| self.start_linear + seq >= end)
    }
}

pub struct Loader {
    shared: Arc<Shared>,
    slots: Arc<Vec<SlotBuffers>>,
    ready_rx: Receiver<Message>,
    free_tx: Sender<usize>,
    stop_tx: Option<Sender<()>>,
    threads: Vec<JoinHandle<()>>,
    held: Mutex<HashSet<usize>>,
    state: Mutex<(Position, LoaderStats, bool)>,
}

impl Loader {
    /// Starts the threads. `start` is where to begin (a saved position, or the default).
    pub fn new(
        ds: Arc<Dataset>,
        config: LoaderConfig,
        slots: Vec<SlotBuffers>,
        start: Position,
    ) -> Result<Self> {
        config.validate()?;
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
        let width = ds.dtype.width();
        if let Some(s) = slots.iter().find(|s| s.token_width != width) {
            return Err(Error::InvalidArgument(format!(
                "slot tokens are {} bytes wide, the dataset's tokens {width}",
                s.token_width
            )));
        }
        let order = RankOrder {
            n_frames: ds.n_frames() as u64,
            rank: config.rank,
            world_size: config.world_size,
            frames_per_block: config.frames_per_block,
            shuffle: config.shuffle,
            seed: config.seed,
        };
        if order.frames_per_epoch() == 0 {
            return Err(Error::InvalidArgument(format!(
                "rank {} of {} gets no frames: the dataset has {} frames; repack with a smaller --frame-mib or use fewer ranks",
                config.rank, config.world_size, order.n_frames
            )));
        }
        let per = order.blocks_per_epoch();
        if start.block >= per {
            return Err(Error::State(format!(
                "block {} is past the {per} blocks of an epoch",
                start.block
            )));
        }
        let start_linear = start.epoch * per + start.block;
        let end_linear = config.num_epochs.map(|n| n * per);
        let shared = Arc::new(Shared {
            ds,
            order,
            start_linear,
            start_item: start.item,
            end_linear,
            produced: Mutex::new(Produced {
                blocks: BTreeMap::new(),
                next_seq: 0,
                consumed: 0,
            }),
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
            Box::new(move || assembler(&sh, &sl, &free_rx, &ready_tx, &stop_rx)),
        )?);
        Ok(Loader {
            shared,
            slots,
            ready_rx,
            free_tx,
            stop_tx: Some(stop_tx),
            threads,
            held: Mutex::new(HashSet::new()),
            state: Mutex::new((start, LoaderStats::default(), false)),
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
        if self.state.lock().unwrap().2 {
            return Ok(None);
        }
        let t0 = Instant::now();
        let msg = self.ready_rx.recv();
        let waited = t0.elapsed().as_nanos() as u64;
        let mut st = self.state.lock().unwrap();
        st.1.wait_ns += waited;
        match msg {
            Ok(Message::Batch(b)) => {
                self.held.lock().unwrap().insert(b.slot);
                st.0 = b.position_after;
                st.1.batches += 1;
                st.1.doc_tokens += b.doc_tokens;
                st.1.pad_tokens += b.pad_tokens;
                Ok(Some(b))
            }
            Ok(Message::Failed(e)) => {
                st.2 = true;
                Err(e)
            }
            Ok(Message::End) => {
                st.2 = true;
                Ok(None)
            }
            Err(_) => {
                st.2 = true;
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
                dtype: self.shared.ds.dtype,
                doc_ids: std::slice::from_raw_parts(s.doc_ids, n),
            }
        }
    }

    pub fn state(&self) -> LoaderState {
        LoaderState {
            manifest_hash: self.shared.ds.manifest_hash,
            config_fingerprint: self.shared.config.fingerprint(),
            rank: self.shared.config.rank,
            world_size: self.shared.config.world_size,
            position: self.state.lock().unwrap().0,
        }
    }

    pub fn stats(&self) -> LoaderStats {
        let mut s = self.state.lock().unwrap().1;
        s.documents_packed = self.shared.documents_packed.load(Ordering::Relaxed);
        s.documents_cut = self.shared.documents_cut.load(Ordering::Relaxed);
        s.frames_skipped = self.shared.frames_skipped.load(Ordering::Relaxed);
        s
    }

    /// The error of the most recently skipped corrupt frame, if any.
    pub fn last_skipped(&self) -> Option<String> {
        self.shared.last_skipped.lock().unwrap().clone()
    }

    pub fn blocks_per_epoch(&self) -> u64 {
        self.shared.order.blocks_per_epoch()
    }

    pub fn n_slots(&self) -> usize {
        self.slots.len()
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.stop_tx.take();
        // Take the lock so that no worker is between its stop check and its wait.
        drop(self.shared.produced.lock().unwrap());
        self.shared.cv.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Checks a saved state against this dataset and configuration and returns where to start.
pub fn resume_position(
    ds: &Dataset,
    config: &LoaderConfig,
    state: &LoaderState,
) -> Result<Position> {
    if state.manifest_hash != ds.manifest_hash {
        return Err(Error::State(format!(
            "the dataset in {} changed since the state was saved (manifest hash {:016x}, saved {:016x})",
            ds.dir.display(),
            ds.manifest_hash,
            state.manifest_hash
        )));
    }
    if state.config_fingerprint != config.fingerprint() {
        return Err(Error::State(
            "loader settings (mode, seq_len, batch size, buckets, seed, shuffle, frames_per_block or epochs) differ from the saved state".into(),
        ));
    }
    let p = state.position;
    let moved = state.world_size != config.world_size || state.rank != config.rank;
    if moved && (p.block != 0 || p.item != 0) {
        return Err(Error::State(format!(
            "the state was saved by rank {} of {} in the middle of epoch {}; a different rank or world size \
             ({} of {}) can only resume at an epoch boundary, because ranks split each epoch's frames by world size",
            state.rank, state.world_size, p.epoch, config.rank, config.world_size
        )));
    }
    Ok(p)
}

fn worker(sh: &Shared) {
    let mut dec = Decoder::new();
    loop {
        let seq = {
            let mut p = sh.produced.lock().unwrap();
            loop {
                if sh.stop.load(Ordering::SeqCst) || sh.finished(p.next_seq) {
                    return;
                }
                if p.next_seq < p.consumed + sh.config.prefetch_blocks as u64 {
                    p.next_seq += 1;
                    break p.next_seq - 1;
                }
                p = sh.cv.wait(p).unwrap();
            }
        };
        let pos = sh.position(sh.start_linear + seq, 0);
        // A panic here would leave the assembler waiting for this block forever: turn it
        // into an error that reaches the consumer instead.
        let block = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            make_block(
                &sh.ds,
                &sh.order,
                &sh.config.mode,
                (pos.epoch, pos.block),
                &mut dec,
                &sh.pool,
                sh.config.skip_corrupt,
            )
        }))
        .unwrap_or_else(|p| Err(Error::Internal(crate::error::panic_message(p))));
        let failed = block.is_err();
        sh.produced.lock().unwrap().blocks.insert(seq, block);
        sh.cv.notify_all();
        if failed {
            return;
        }
    }
}

/// Fills slots in block order. Returns when the data ends, on error, or on stop.
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
    let mut filling: Option<Filling> = None;
    let mut seq = 0u64;
    loop {
        if sh.finished(seq) {
            // The last epoch ended: pad and deliver a partly filled pack batch.
            if let Some(f) = filling.take() {
                let _ = ready_tx.send(Message::Batch(
                    f.finish(slots, sh.position(sh.start_linear + seq, 0)),
                ));
            }
            let _ = ready_tx.send(Message::End);
            return;
        }
        let block = {
            let mut p = sh.produced.lock().unwrap();
            loop {
                if sh.stop.load(Ordering::SeqCst) {
                    return;
                }
                if let Some(b) = p.blocks.remove(&seq) {
                    p.consumed = seq + 1;
                    break b;
                }
                p = sh.cv.wait(p).unwrap();
            }
        };
        sh.cv.notify_all();
        let block = match block {
            Ok(b) => b,
            Err(e) => {
                let _ = ready_tx.send(Message::Failed(e));
                return;
            }
        };
        sh.documents_packed
            .fetch_add(block.stats.documents, Ordering::Relaxed);
        sh.documents_cut
            .fetch_add(block.stats.cut_documents, Ordering::Relaxed);
        if let Some(last) = block.skipped_frames.last() {
            sh.frames_skipped
                .fetch_add(block.skipped_frames.len() as u64, Ordering::Relaxed);
            *sh.last_skipped.lock().unwrap() = Some(last.clone());
        }
        let linear = sh.start_linear + seq;
        let here = sh.position(linear, 0);
        let skip = if seq == 0 { sh.start_item as usize } else { 0 };
        let n = block.output.n_items();
        let after = |i: usize| {
            if i + 1 == n {
                sh.position(linear + 1, 0)
            } else {
                sh.position(linear, i as u64 + 1)
            }
        };
        match &block.output {
            BlockOutput::Rows(rows) => {
                let Mode::Pack { batch_size, .. } = sh.config.mode else {
                    unreachable!()
                };
                for r in skip..n {
                    if filling.is_none() {
                        let Some(slot) = acquire() else { return };
                        filling = Some(Filling::new(slot, rows.width, batch_size, here.epoch));
                    }
                    let f = filling.as_mut().unwrap();
                    f.push(slots, rows, r, &block.docs);
                    if f.rows == batch_size {
                        let _ = ready_tx.send(Message::Batch(
                            filling.take().unwrap().finish(slots, after(r)),
                        ));
                    }
                }
            }
            BlockOutput::Batches(batches) => {
                for (i, b) in batches.iter().enumerate().skip(skip) {
                    let Some(slot) = acquire() else { return };
                    let mut f = Filling::new(slot, b.width, b.n_rows(), here.epoch);
                    for r in 0..b.n_rows() {
                        f.push(slots, b, r, &block.docs);
                    }
                    let _ = ready_tx.send(Message::Batch(f.finish(slots, after(i))));
                }
            }
        }
        block.recycle(&sh.pool);
        seq += 1;
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
}

impl Filling {
    fn new(slot: usize, width: usize, capacity_rows: usize, epoch: u64) -> Self {
        Filling {
            slot,
            width,
            capacity_rows,
            rows: 0,
            epoch,
            doc_tokens: 0,
            pad_tokens: 0,
            pieces: 0,
        }
    }

    /// Writes planned row `r` (tokens from `docs`) as the slot's next row.
    fn push(&mut self, slots: &[SlotBuffers], plan: &RowPlan, r: usize, docs: &BlockDocs) {
        // SAFETY: the assembler took this slot from the free channel, so it has exclusive
        // access until it sends the slot to the consumer.
        let mut dst = unsafe { slots[self.slot].slices_mut() };
        plan.write_row(r, docs, &mut dst, self.rows);
        let real = plan.row_tokens(r);
        self.doc_tokens += real;
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
        }
    }
}
