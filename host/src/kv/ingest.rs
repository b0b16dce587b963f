//! Span ingest: validation first and all of it, then the copy into new pages, then one commit.
//!
//! [`PagedKv::prepare`] checks a structurally valid manifest against the receiver — fingerprint, request,
//! token offset, layer set (by model layer id), group kinds, head geometry, dtype, capacity — and only then
//! reserves pages and computes where every payload byte goes. Nothing is mutated before every check passed.
//! [`PagedKv::write_staged`] copies (converting dtype) into reserved pages and the unseen tail of the
//! sequence's last page, and [`PagedKv::commit`] links the pages into the block tables in one step.
//! [`PagedKv::abort`] returns the reservation.

use shm_format::{words, Dtype, EntryKind, Fingerprint, GroupKind, Layout, Manifest, SpanView};
use shm_ring::SpanSink;

use super::convert::{convert, converted_len, convertible};
use super::{PagedKv, SeqId};

/// Why a span was not ingested. The cache is unchanged in every case.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IngestError {
    /// No such sequence.
    #[error("{seq}: expected a live sequence, found none")]
    UnknownSequence {
        /// The id.
        seq: SeqId,
    },
    /// The id is taken.
    #[error("{seq}: expected a new sequence id, found one in use")]
    SequenceExists {
        /// The id.
        seq: SeqId,
    },
    /// The span is for another model's KV geometry.
    #[error("model fingerprint: expected {expected}, found {found}")]
    FingerprintMismatch {
        /// The receiver's.
        expected: Fingerprint,
        /// The span's.
        found: Fingerprint,
    },
    /// The span is for another request.
    #[error("request id: expected {expected}, found {found}")]
    RequestMismatch {
        /// The sequence's request.
        expected: u64,
        /// The span's.
        found: u64,
    },
    /// The span does not start where the sequence ends.
    #[error("token range start: expected {expected} (the tokens the sequence holds), found {found}")]
    TokenOffsetMismatch {
        /// Tokens held.
        expected: u64,
        /// The span's start.
        found: u64,
    },
    /// The span does not end where the request asked its producer to prefill to.
    #[error("token range end: expected {expected} (the prefilled chunk's end), found {found}")]
    TokenEndMismatch {
        /// The chunk's end.
        expected: u64,
        /// The span's end.
        found: u64,
    },
    /// A dense span over a different number of layers.
    #[error("dense span layer count: expected the receiver's {expected} layers, found {found}")]
    LayerCountMismatch {
        /// The receiver's layers.
        expected: u32,
        /// The span's.
        found: u32,
    },
    /// A layer the receiver does not have.
    #[error("layer {layer}: expected a layer id below {layers}, found one the receiver does not have")]
    UnexpectedLayer {
        /// Layer.
        layer: u32,
        /// The receiver's layer count.
        layers: u32,
    },
    /// A layer the producer groups with another attention kind.
    #[error("layer {layer}: expected a {expected} group (the receiver's), found a {found} group (the span's)")]
    GroupKindMismatch {
        /// Layer.
        layer: u32,
        /// The receiver's.
        expected: GroupKind,
        /// The span's.
        found: GroupKind,
    },
    /// K/V for a recurrent layer or a state for an attention layer.
    #[error("layer {layer}: expected {expected} entries, found a {found} entry")]
    WrongEntryKind {
        /// Layer.
        layer: u32,
        /// What the receiver's group holds.
        expected: &'static str,
        /// The entry.
        found: EntryKind,
    },
    /// A receiver layer the span does not carry.
    #[error("layer {layer} (group {group}, {kind}): expected its {entry} entry, found none")]
    MissingLayer {
        /// Layer.
        layer: u32,
        /// Its group in the receiver.
        group: usize,
        /// The group's kind.
        kind: GroupKind,
        /// The missing entry.
        entry: EntryKind,
    },
    /// K/V heads differ from the receiver's group.
    #[error(
        "layer {layer} {entry}: expected {}, found {}",
        words::kv_heads(expected.0, expected.1),
        words::kv_heads(found.0, found.1)
    )]
    HeadGeometryMismatch {
        /// Layer.
        layer: u32,
        /// K or V.
        entry: EntryKind,
        /// The receiver's.
        expected: (u64, u64),
        /// The span's.
        found: (u64, u64),
    },
    /// A recurrent state of the wrong size.
    #[error("layer {layer} state: expected {expected} elements, found shape {}", words::shape(found))]
    StateSizeMismatch {
        /// Layer.
        layer: u32,
        /// The receiver's state size.
        expected: u64,
        /// The span's shape.
        found: Vec<u64>,
    },
    /// A producer's span in another dtype than the one it declared at its handshake (which names the
    /// rounding its K/V went through, the prefix cache's key).
    #[error("dtype: expected {expected} (the wire dtype its producer declared), found {found}")]
    DtypeMismatch {
        /// The declared one.
        expected: &'static str,
        /// The span's.
        found: &'static str,
    },
    /// The cache may not store this dtype.
    #[error("dtype: expected {to} or a type that widens to it, found {from} (lossy conversion is disabled)")]
    DtypeNotConvertible {
        /// The span's.
        from: &'static str,
        /// The cache's.
        to: &'static str,
    },
    /// Not enough free pages.
    #[error(
        "group {group} ({kind}) capacity: expected {needed} free page{}, found {free}",
        if *needed == 1 { "" } else { "s" }
    )]
    CapacityExhausted {
        /// Group.
        group: usize,
        /// Its kind.
        kind: GroupKind,
        /// Pages the span needs.
        needed: u32,
        /// Pages free.
        free: u32,
    },
}

impl IngestError {
    /// A stable snake_case name, for metrics and JSON.
    pub fn kind(&self) -> &'static str {
        match self {
            IngestError::UnknownSequence { .. } => "unknown_sequence",
            IngestError::SequenceExists { .. } => "sequence_exists",
            IngestError::FingerprintMismatch { .. } => "fingerprint_mismatch",
            IngestError::RequestMismatch { .. } => "request_mismatch",
            IngestError::TokenOffsetMismatch { .. } => "token_offset_mismatch",
            IngestError::TokenEndMismatch { .. } => "token_end_mismatch",
            IngestError::LayerCountMismatch { .. } => "layer_count_mismatch",
            IngestError::UnexpectedLayer { .. } => "unexpected_layer",
            IngestError::GroupKindMismatch { .. } => "group_kind_mismatch",
            IngestError::WrongEntryKind { .. } => "wrong_entry_kind",
            IngestError::MissingLayer { .. } => "missing_layer",
            IngestError::HeadGeometryMismatch { .. } => "head_geometry_mismatch",
            IngestError::StateSizeMismatch { .. } => "state_size_mismatch",
            IngestError::DtypeMismatch { .. } => "dtype_mismatch",
            IngestError::DtypeNotConvertible { .. } => "dtype_not_convertible",
            IngestError::CapacityExhausted { .. } => "capacity_exhausted",
        }
    }
}

/// One contiguous piece of payload and where it lands.
#[derive(Clone, Copy, Debug)]
struct Run {
    /// Payload offset.
    src: u64,
    /// Payload bytes.
    len: u64,
    group: usize,
    /// Byte offset in the group's pool.
    dst: usize,
    /// Where a run bound for a cached page waits until commit: its byte offset in [`PagedKv::side`].
    side: Option<usize>,
}

/// What the receiver must do to each group.
#[derive(Clone, Debug, Default)]
struct GroupPlan {
    /// Logical page index of the first new page.
    first_new: u64,
    /// Pages reserved, in logical order: taken from the free list, then (the last `from_cache`) cached
    /// prefix pages, which stay cached, unwritten, until commit.
    new_pages: Vec<u32>,
    from_cache: usize,
}

/// A validated span with its pages reserved: write its payload, then commit or abort.
#[derive(Debug)]
pub struct Staged {
    seq: SeqId,
    end: u64,
    src_dtype: Dtype,
    groups: Vec<GroupPlan>,
    /// Sorted by `src`; never overlapping.
    runs: Vec<Run>,
    /// First run not yet fully written.
    cursor: usize,
}

impl PagedKv {
    /// Validates `manifest` (already structurally valid: decoded by `shm_format`) against this cache and
    /// the sequence, then reserves its pages. On error nothing has changed.
    pub fn prepare(&mut self, seq: SeqId, manifest: &Manifest) -> Result<Staged, IngestError> {
        self.stage(seq, manifest, None)
    }

    /// [`PagedKv::prepare`] of a producer's span, which must also end at position `end`, what the host
    /// asked it for (a span that stops short would leave the prompt's tail unfilled), and carry `dtype`,
    /// the wire dtype it declared at its handshake.
    pub fn prepare_ending(
        &mut self,
        seq: SeqId,
        manifest: &Manifest,
        end: u64,
        dtype: Dtype,
    ) -> Result<Staged, IngestError> {
        self.stage(seq, manifest, Some((end, dtype)))
    }

    fn stage(&mut self, seq: SeqId, manifest: &Manifest, asked: Option<(u64, Dtype)>) -> Result<Staged, IngestError> {
        let (needed, keep_from) = self.validate(seq, manifest, asked)?;
        // Every check passed: from here on nothing can fail. Free pages first; past them, the cached
        // prefix pages `take_page` would evict, in its order, only named here: the frame may still turn
        // out bad (its checksum is checked after the copy), and a rejected span must not cost the prefix
        // cache its pages. Their runs go to `side` until commit.
        let mut groups = Vec::with_capacity(self.groups.len());
        for (g, &(first_new, count)) in self.groups.iter_mut().zip(&needed) {
            let from_free = (count as usize).min(g.free.len());
            let mut new_pages: Vec<u32> = (0..from_free).map(|_| g.free.pop().expect("counted")).collect();
            new_pages.extend(g.cached.values().take(count as usize - from_free));
            groups.push(GroupPlan { first_new, from_cache: new_pages.len() - from_free, new_pages });
        }
        let s = &self.seqs[&seq];
        let p = u64::from(self.page_size);
        let (start, end) = (manifest.token_start, manifest.token_end);
        let src_es = manifest.dtype.size();
        let mut runs = Vec::new();
        let mut side = 0;
        // A run into one of the plan's cached pages gets the next bytes of `side`.
        let mut run = |src: u64, len: u64, group: usize, dst: usize, page: u32, plan: &GroupPlan| {
            let cached = plan.new_pages[plan.new_pages.len() - plan.from_cache..].contains(&page);
            let at = cached.then(|| {
                let at = side;
                side += converted_len(manifest.dtype, self.dtype, len as usize);
                at
            });
            Run { src, len, group, dst, side: at }
        };
        for e in &manifest.entries {
            let place = self.places[e.layer as usize];
            let g = &self.groups[place.group];
            let plan = &groups[place.group];
            if !g.is_attention() {
                let page = plan.new_pages[0];
                runs.push(run(e.offset, e.len, place.group, g.state_offset(page, place.slot), page, plan));
                continue;
            }
            let table = &s.tables[place.group];
            let src_row = u64::from(g.heads.0) * u64::from(g.heads.1) * src_es;
            let mut pos = keep_from[place.group];
            while pos < end {
                let logical = pos / p;
                let run_end = ((logical + 1) * p).min(end);
                let page = if logical < plan.first_new {
                    table.pages[(logical - table.first) as usize]
                } else {
                    plan.new_pages[(logical - plan.first_new) as usize]
                };
                let dst = g.row_offset(page, place.slot, e.kind == EntryKind::V, (pos % p) as usize, p as usize);
                let src = e.offset + (pos - start) * src_row;
                runs.push(run(src, (run_end - pos) * src_row, place.group, dst, page, plan));
                pos = run_end;
            }
        }
        runs.sort_by_key(|r| r.src);
        if self.side.len() < side {
            self.side.resize(side, 0);
        }
        Ok(Staged { seq, end, src_dtype: manifest.dtype, groups, runs, cursor: 0 })
    }

    /// Every check, in order; returns per group `(first new logical page, pages needed)` and the first
    /// position each group keeps.
    #[allow(clippy::type_complexity)]
    fn validate(
        &self,
        seq: SeqId,
        m: &Manifest,
        asked: Option<(u64, Dtype)>,
    ) -> Result<(Vec<(u64, u32)>, Vec<u64>), IngestError> {
        let s = self.seqs.get(&seq).ok_or(IngestError::UnknownSequence { seq })?;
        if m.fingerprint != self.fingerprint {
            return Err(IngestError::FingerprintMismatch { expected: self.fingerprint, found: m.fingerprint });
        }
        if m.request_id != s.request_id {
            return Err(IngestError::RequestMismatch { expected: s.request_id, found: m.request_id });
        }
        if m.token_start != s.len {
            return Err(IngestError::TokenOffsetMismatch { expected: s.len, found: m.token_start });
        }
        if let Some(expected) = asked.map(|(end, _)| end).filter(|&e| e != m.token_end) {
            return Err(IngestError::TokenEndMismatch { expected, found: m.token_end });
        }

        // The layer set, by model layer id.
        let layers = self.places.len() as u32;
        match &m.layout {
            &Layout::Dense { num_layers, .. } => {
                if num_layers != layers {
                    return Err(IngestError::LayerCountMismatch { expected: layers, found: num_layers });
                }
            }
            Layout::Grouped { groups } => {
                for g in groups {
                    for &layer in &g.layers {
                        let (_, expected) =
                            self.group_of(layer).ok_or(IngestError::UnexpectedLayer { layer, layers })?;
                        if expected != g.kind {
                            return Err(IngestError::GroupKindMismatch { layer, expected, found: g.kind });
                        }
                    }
                }
            }
        }
        let mut have = vec![[false; 3]; layers as usize];
        for e in &m.entries {
            let (gi, _) = self.group_of(e.layer).ok_or(IngestError::UnexpectedLayer { layer: e.layer, layers })?;
            let attention = self.groups[gi].is_attention();
            match (attention, e.kind) {
                (true, EntryKind::K | EntryKind::V) | (false, EntryKind::State) => {}
                (true, found) => {
                    return Err(IngestError::WrongEntryKind { layer: e.layer, expected: "k and v", found })
                }
                (false, found) => return Err(IngestError::WrongEntryKind { layer: e.layer, expected: "state", found }),
            }
            have[e.layer as usize][e.kind as usize] = true;
        }
        for (layer, have) in have.iter().enumerate() {
            let place = self.places[layer];
            let g = &self.groups[place.group];
            let required: &[EntryKind] =
                if g.is_attention() { &[EntryKind::K, EntryKind::V] } else { &[EntryKind::State] };
            if let Some(&entry) = required.iter().find(|k| !have[**k as usize]) {
                return Err(IngestError::MissingLayer { layer: layer as u32, group: place.group, kind: g.kind, entry });
            }
        }

        // Each group's geometry.
        for e in &m.entries {
            let g = &self.groups[self.places[e.layer as usize].group];
            if g.is_attention() {
                let expected = (u64::from(g.heads.0), u64::from(g.heads.1));
                let found = (e.shape[1], e.shape[2]);
                if found != expected {
                    return Err(IngestError::HeadGeometryMismatch { layer: e.layer, entry: e.kind, expected, found });
                }
            } else if e.shape.iter().product::<u64>() != g.state_elems {
                return Err(IngestError::StateSizeMismatch {
                    layer: e.layer,
                    expected: g.state_elems,
                    found: e.shape.clone(),
                });
            }
        }

        if let Some(expected) = asked.map(|(_, dtype)| dtype).filter(|&d| d != m.dtype) {
            return Err(IngestError::DtypeMismatch { expected: expected.name(), found: m.dtype.name() });
        }
        if !convertible(m.dtype, self.dtype, self.allow_lossy) {
            return Err(IngestError::DtypeNotConvertible { from: m.dtype.name(), to: self.dtype.name() });
        }

        // Capacity.
        let p = u64::from(self.page_size);
        let (len, end) = (s.len, m.token_end);
        let mut needed = Vec::with_capacity(self.groups.len());
        let mut keep = Vec::with_capacity(self.groups.len());
        for (gi, g) in self.groups.iter().enumerate() {
            let (first_new, count, keep_from) = match g.kind {
                GroupKind::Recurrent => (0, 1, len),
                GroupKind::Full | GroupKind::Sliding { .. } => {
                    // A sliding group writes only the pages its window will still see (whole pages, so
                    // that a prefix-cache hit can use every one of them).
                    let keep_from = match g.kind {
                        GroupKind::Sliding { window } => len.max(sliding_keep_from(end, window, p)),
                        _ => len,
                    };
                    let first_new = len.div_ceil(p).max(keep_from / p);
                    (first_new, end.div_ceil(p).saturating_sub(first_new), keep_from)
                }
            };
            let free = g.available();
            let count = u32::try_from(count).unwrap_or(u32::MAX);
            if count > free {
                return Err(IngestError::CapacityExhausted { group: gi, kind: g.kind, needed: count, free });
            }
            needed.push((first_new, count));
            keep.push(keep_from);
        }
        Ok((needed, keep))
    }

    /// Copies payload bytes `offset..offset + bytes.len()` of a staged span to where they land. Pieces must
    /// arrive in order and without gaps between calls.
    pub fn write_staged(&mut self, staged: &mut Staged, offset: u64, bytes: &[u8]) {
        let end = offset + bytes.len() as u64;
        let (from, to) = (staged.src_dtype, self.dtype);
        while let Some(run) = staged.runs.get(staged.cursor) {
            if run.src >= end {
                break;
            }
            let a = run.src.max(offset);
            let b = (run.src + run.len).min(end);
            if a < b {
                let src = &bytes[(a - offset) as usize..(b - offset) as usize];
                let into = converted_len(from, to, (a - run.src) as usize);
                let (dst, at) = match run.side {
                    Some(side) => (&mut self.side[..], side + into),
                    None => (&mut self.groups[run.group].pool[..], run.dst + into),
                };
                convert(from, src, to, &mut dst[at..at + converted_len(from, to, src.len())]);
            }
            if run.src + run.len <= end {
                staged.cursor += 1;
            } else {
                break;
            }
        }
    }

    /// Links the staged pages into the sequence's block tables and extends it, in one step. Cached
    /// prefix pages the span needed leave the prefix cache only now, and take their bytes from `side`.
    pub fn commit(&mut self, staged: Staged) {
        for (gi, plan) in staged.groups.iter().enumerate() {
            for &page in &plan.new_pages[plan.new_pages.len() - plan.from_cache..] {
                self.evict(gi, page);
            }
        }
        let to = self.dtype;
        for run in &staged.runs {
            if let Some(side) = run.side {
                let len = converted_len(staged.src_dtype, to, run.len as usize);
                self.groups[run.group].pool[run.dst..run.dst + len].copy_from_slice(&self.side[side..side + len]);
            }
        }
        let p = u64::from(self.page_size);
        let s = self.seqs.get_mut(&staged.seq).expect("a staged sequence stays live until commit or abort");
        let (len, end) = (s.len, staged.end);
        let mut released = Vec::new();
        for (gi, ((g, table), plan)) in self.groups.iter_mut().zip(&mut s.tables).zip(staged.groups).enumerate() {
            for &page in &plan.new_pages {
                g.refs[page as usize] += 1;
            }
            if !g.is_attention() {
                released.extend(table.pages.drain(..).map(|page| (gi, page)));
                table.pages.extend(plan.new_pages);
                continue;
            }
            let keep_from = match g.kind {
                GroupKind::Sliding { window } => sliding_keep_from(end, window, p),
                _ => 0,
            };
            if !plan.new_pages.is_empty() {
                if table.pages.is_empty() || table.first + table.pages.len() as u64 != plan.first_new {
                    // A sliding span longer than the window: nothing held before is visible any more.
                    released.extend(table.pages.drain(..).rev().map(|page| (gi, page)));
                    table.first = plan.first_new;
                    table.valid_from = len.max(keep_from / p * p);
                }
                table.pages.extend(plan.new_pages);
            }
            while table.first < keep_from / p {
                released.push((gi, table.pages.pop_front().expect("held pages cover the window")));
                table.first += 1;
            }
        }
        s.len = end;
        for (gi, page) in released {
            self.release(gi, page);
        }
    }

    /// Returns a staged span's free pages to the free lists, restored exactly; the cached pages it named
    /// were never taken from the prefix cache, nor written. The bytes already written stay where no read
    /// reaches them: in the reserved free pages (never linked), in `side`, and past the sequence's end in
    /// its last page (until a later span overwrites them).
    pub fn abort(&mut self, staged: Staged) {
        for (g, mut plan) in self.groups.iter_mut().zip(staged.groups) {
            plan.new_pages.truncate(plan.new_pages.len() - plan.from_cache);
            g.free.extend(plan.new_pages.into_iter().rev());
        }
    }

    /// Ingests a whole span held in private memory: prepare, write, commit.
    pub fn write_span(&mut self, seq: SeqId, span: &SpanView<'_>) -> Result<(), IngestError> {
        let mut staged = self.prepare(seq, &span.manifest)?;
        self.write_staged(&mut staged, 0, span.payload);
        self.commit(staged);
        Ok(())
    }
}

/// The first position (a page's first) a sliding group of `window` keeps once its sequence holds `end`
/// positions in pages of `p`: the window of the last whole page's end, which a prefix hit on the
/// sequence's whole pages needs, not only the window of `end`. They differ when `p` does not divide the
/// window (a 6-token window in 4-token pages: 23 positions keep from 12, not 16, so that a hit of 20 finds
/// positions 14..20). At most `ceil(window / p) + 1` pages either way.
fn sliding_keep_from(end: u64, window: u32, p: u64) -> u64 {
    (end / p * p).saturating_sub(u64::from(window)) / p * p
}

/// Ingests spans from a ring straight into one sequence.
#[derive(Debug)]
pub struct IntoSequence<'a> {
    /// The cache.
    pub kv: &'a mut PagedKv,
    /// The sequence.
    pub seq: SeqId,
    /// Where the span must end: the end of the chunk its producer was asked for.
    pub end: u64,
    /// The dtype its producer declared at its handshake.
    pub dtype: Dtype,
}

impl SpanSink for IntoSequence<'_> {
    type Staged = Staged;
    type Error = IngestError;

    fn prepare(&mut self, _: &shm_format::HeaderInfo, manifest: &Manifest) -> Result<Staged, IngestError> {
        self.kv.prepare_ending(self.seq, manifest, self.end, self.dtype)
    }
    fn write(&mut self, staged: &mut Staged, offset: u64, bytes: &[u8]) {
        self.kv.write_staged(staged, offset, bytes)
    }
    fn commit(&mut self, staged: Staged) {
        self.kv.commit(staged)
    }
    fn abort(&mut self, staged: Staged) {
        self.kv.abort(staged)
    }
}
