//! The grouped paged KV cache.
//!
//! Layers are grouped by attention kind ([`KvGeometry::groups`]): all full-attention layers form one group,
//! sliding-window layers one group per window, recurrent layers one state group. Each group has a pool of
//! fixed-size pages, preallocated and prefaulted from a memory budget, and each sequence has a block table
//! per group. An attention page holds `page_size` token positions for *every* layer of its group:
//!
//! ```text
//! page = [slot 0: K rows][slot 0: V rows][slot 1: K rows][slot 1: V rows] ...   (slot = layer's index in group)
//! rows = page_size x (kv_heads x head_dim elements)
//! ```
//!
//! A sliding group keeps only the pages its window can still see. Spans land through [`ingest`]: validation
//! first, then the copy into new pages, then one commit. `docs/paged-kv.md` has the whole story.

pub mod convert;
pub mod ingest;
pub mod prefix;
pub use prefix::Rounding;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, VecDeque};
use std::hash::Hasher;
use std::ops::Range;

use shm_format::{words, Dtype, Fingerprint, GroupKind, KvGeometry, LayerKv};

pub use ingest::{IngestError, IntoSequence, Staged};

/// A sequence's id in the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId(pub u64);

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "seq {}", self.0)
    }
}

/// How to build a cache.
#[derive(Clone, Debug)]
pub struct KvConfig {
    /// The model's per-layer KV geometry.
    pub geometry: KvGeometry,
    /// Tokens per page (attention groups).
    pub page_size: u32,
    /// The element type pages store.
    pub dtype: Dtype,
    /// Bytes for all page pools together.
    pub budget_bytes: u64,
    /// Sequences the sliding and recurrent pools are sized for.
    pub max_seqs: u32,
    /// Whether spans may be narrowed to a smaller dtype (f32 to bf16 or f16, or between bf16 and f16).
    pub allow_lossy: bool,
}

impl KvConfig {
    /// Defaults: 64-token pages, 8 sequences, lossy conversion allowed.
    pub fn new(geometry: KvGeometry, dtype: Dtype, budget_bytes: u64) -> Self {
        KvConfig { geometry, page_size: 64, dtype, budget_bytes, max_seqs: 8, allow_lossy: true }
    }
}

/// Why a cache cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// No layers.
    #[error("model geometry: expected at least one layer, found none")]
    NoLayers,
    /// A zero page size, head count or head dim.
    #[error("{what}: expected a nonzero value, found 0")]
    Zero {
        /// Which value.
        what: &'static str,
    },
    /// Layers of one group with different head geometry.
    #[error(
        "group {group}: expected every layer with {}, found layer {layer} with {}",
        words::kv_heads(expected.0.into(), expected.1.into()),
        words::kv_heads(found.0.into(), found.1.into())
    )]
    MixedHeads {
        /// Group.
        group: usize,
        /// First layer's.
        expected: (u32, u32),
        /// The differing layer.
        layer: u32,
        /// Its heads.
        found: (u32, u32),
    },
    /// Recurrent layers of one group with different state sizes.
    #[error("group {group}: expected every recurrent layer with a state of {expected} elements, found layer {layer} with {found}")]
    MixedStates {
        /// Group.
        group: usize,
        /// The first layer's.
        expected: u64,
        /// The differing layer.
        layer: u32,
        /// Its state size.
        found: u64,
    },
    /// The budget does not cover the bounded groups plus one page of each unbounded group.
    #[error(
        "memory budget: expected at least {needed} bytes for this geometry and {max_seqs} sequences, found {budget}"
    )]
    BudgetTooSmall {
        /// Minimum.
        needed: u64,
        /// Sequences asked for.
        max_seqs: u32,
        /// Budget given.
        budget: u64,
    },
    /// The pools for these sequences would not fit in 64 bits of bytes.
    #[error("KV cache size: expected at most 2^64 bytes, found more for {max_seqs} sequences of {max_tokens} tokens")]
    TooLarge {
        /// Tokens per sequence.
        max_tokens: u64,
        /// Sequences.
        max_seqs: u32,
    },
}

/// Why a read failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// No such sequence.
    #[error("{0}: expected a live sequence, found none")]
    UnknownSequence(SeqId),
    /// No such layer, or a layer of the wrong kind for the call.
    #[error("layer {layer}: expected {expected}, found {found}")]
    BadLayer {
        /// Layer.
        layer: u32,
        /// What the call needs.
        expected: &'static str,
        /// What the layer is.
        found: String,
    },
}

/// One group: its layers and its page pool.
#[derive(Debug)]
pub(crate) struct Group {
    pub(crate) kind: GroupKind,
    /// Model layer ids; a layer's slot is its index here.
    pub(crate) layers: Vec<u32>,
    /// `(kv_heads, head_dim)` of attention groups.
    pub(crate) heads: (u32, u32),
    /// Elements of state per layer (recurrent groups).
    pub(crate) state_elems: u64,
    /// Bytes of one token row of one layer's K (or V): `kv_heads * head_dim * dtype size`.
    pub(crate) row_bytes: usize,
    /// Bytes per page.
    pub(crate) page_bytes: usize,
    pub(crate) pool: Vec<u8>,
    pub(crate) pages: u32,
    /// Free page ids; the next page handed out is the last.
    pub(crate) free: Vec<u32>,
    /// Per page, the block tables that hold it (more than one when a prefix is shared).
    pub(crate) refs: Vec<u32>,
    /// Pages no table holds that keep a cached prompt prefix ([`prefix`]), by when they were released:
    /// handed out, oldest first, only once `free` is empty.
    pub(crate) cached: BTreeMap<u64, u32>,
    /// Per page, its key in `cached` (0: not cached).
    pub(crate) cached_at: Vec<u64>,
}

impl Group {
    fn is_attention(&self) -> bool {
        self.kind.is_attention()
    }

    /// Byte offset in the pool of `(page, slot, kind, token_in_page)`.
    pub(crate) fn row_offset(&self, page: u32, slot: usize, v: bool, token: usize, page_size: usize) -> usize {
        page as usize * self.page_bytes + ((slot * 2 + usize::from(v)) * page_size + token) * self.row_bytes
    }

    /// Pages that can be handed out: free ones and cached ones.
    pub(crate) fn available(&self) -> u32 {
        (self.free.len() + self.cached.len()) as u32
    }

    /// Byte offset in the pool of a state slot's layer.
    pub(crate) fn state_offset(&self, page: u32, slot: usize) -> usize {
        page as usize * self.page_bytes + slot * (self.page_bytes / self.layers.len())
    }
}

/// A sequence's pages in one group.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct BlockTable {
    /// Logical page index (position / page_size) of `pages[0]`.
    pub(crate) first: u64,
    pub(crate) pages: VecDeque<u32>,
    /// The first position whose bytes the held pages hold: a sliding span longer than the window
    /// writes only its tail, so the first page may hold less.
    pub(crate) valid_from: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Seq {
    pub(crate) request_id: u64,
    /// Token positions held: `[0, len)` (sliding groups keep only the window's tail of them).
    pub(crate) len: u64,
    pub(crate) tables: Vec<BlockTable>,
}

/// Where a model layer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Place {
    pub(crate) group: usize,
    pub(crate) slot: usize,
}

/// Per-group accounting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupUsage {
    /// The group's kind.
    pub kind: GroupKind,
    /// Its model layer ids.
    pub layers: Vec<u32>,
    /// Bytes per page.
    pub page_bytes: usize,
    /// Pages in the pool.
    pub total: u32,
    /// Pages in use.
    pub used: u32,
    /// Pages free.
    pub free: u32,
    /// Pages that hold only a cached prompt prefix (no sequence uses them); handed out when no page is
    /// free.
    pub cached: u32,
}

/// The grouped paged KV cache.
#[derive(Debug)]
pub struct PagedKv {
    pub(crate) page_size: u32,
    pub(crate) dtype: Dtype,
    pub(crate) allow_lossy: bool,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) geometry: KvGeometry,
    pub(crate) groups: Vec<Group>,
    /// Indexed by model layer id.
    pub(crate) places: Vec<Place>,
    pub(crate) seqs: BTreeMap<SeqId, Seq>,
    /// Full pages of prompts, by content (`None`: the prefix cache is off).
    pub(crate) prefix: Option<prefix::PrefixIndex>,
    /// Where a staged span's runs into cached prefix pages wait for its commit (see `PagedKv::commit`):
    /// grown on first need, then kept.
    pub(crate) side: Vec<u8>,
}

impl PagedKv {
    /// Builds the groups and preallocates (and prefaults) every pool from the budget.
    ///
    /// Sliding groups get enough pages for `max_seqs` sequences at their window (twice, so a write can
    /// reserve new pages before the old ones are freed), recurrent groups two states per sequence, and full
    /// groups share the rest in proportion to their page size.
    pub fn new(config: KvConfig) -> Result<Self, ConfigError> {
        let KvConfig { geometry, page_size, dtype, budget_bytes, max_seqs, allow_lossy } = config;
        if geometry.layers.is_empty() {
            return Err(ConfigError::NoLayers);
        }
        if page_size == 0 {
            return Err(ConfigError::Zero { what: "page size" });
        }
        let esize = dtype.size() as usize;
        let mut groups = Vec::new();
        let mut places = vec![Place { group: 0, slot: 0 }; geometry.layers.len()];
        for (gi, g) in geometry.groups().into_iter().enumerate() {
            let first = geometry.layers[g.layers[0] as usize];
            let heads = first.heads().unwrap_or((0, 0));
            let mut state_elems = 0;
            for (slot, &layer) in g.layers.iter().enumerate() {
                places[layer as usize] = Place { group: gi, slot };
                match geometry.layers[layer as usize] {
                    LayerKv::Recurrent { state_elems: n } => {
                        if n == 0 {
                            return Err(ConfigError::Zero { what: "recurrent state size" });
                        }
                        if state_elems != 0 && n != state_elems {
                            return Err(ConfigError::MixedStates { group: gi, expected: state_elems, layer, found: n });
                        }
                        state_elems = n;
                    }
                    kv => {
                        let h = kv.heads().expect("attention layer");
                        if h.0 == 0 || h.1 == 0 {
                            return Err(ConfigError::Zero { what: "kv_heads or head_dim" });
                        }
                        if h != heads {
                            return Err(ConfigError::MixedHeads { group: gi, expected: heads, layer, found: h });
                        }
                    }
                }
            }
            let row_bytes = heads.0 as usize * heads.1 as usize * esize;
            let page_bytes = if g.kind.is_attention() {
                g.layers.len() * 2 * page_size as usize * row_bytes
            } else {
                g.layers.len() * state_elems as usize * esize
            };
            groups.push(Group {
                kind: g.kind,
                layers: g.layers,
                heads,
                state_elems,
                row_bytes,
                page_bytes,
                pool: Vec::new(),
                pages: 0,
                free: Vec::new(),
                refs: Vec::new(),
                cached: BTreeMap::new(),
                cached_at: Vec::new(),
            });
        }

        // Bounded groups first, then the rest of the budget to the full groups.
        let mut bounded = 0u64;
        for g in &mut groups {
            // A sequence's window and a page either side of it (one reserved before the oldest is freed),
            // twice over; checked, as `request::kv_budget` computes the same.
            let (pages, tokens) = match g.kind {
                GroupKind::Sliding { window } => (2 * (u64::from(window.div_ceil(page_size)) + 1), u64::from(window)),
                GroupKind::Recurrent => (2, 1),
                GroupKind::Full => (0, 0),
            };
            let too_large = ConfigError::TooLarge { max_tokens: tokens, max_seqs };
            g.pages = u32::try_from(pages * u64::from(max_seqs)).map_err(|_| too_large.clone())?;
            bounded = u64::from(g.pages)
                .checked_mul(g.page_bytes as u64)
                .and_then(|b| b.checked_add(bounded))
                .ok_or(too_large)?;
        }
        let full_page_bytes: u64 =
            groups.iter().filter(|g| g.kind == GroupKind::Full).map(|g| g.page_bytes as u64).sum();
        let needed = bounded + full_page_bytes;
        if budget_bytes < needed {
            return Err(ConfigError::BudgetTooSmall { needed, max_seqs, budget: budget_bytes });
        }
        if let Some(full_pages) = (budget_bytes - bounded).checked_div(full_page_bytes) {
            let full_pages = full_pages.min(u64::from(u32::MAX)) as u32;
            for g in groups.iter_mut().filter(|g| g.kind == GroupKind::Full) {
                g.pages = full_pages;
            }
        }
        for g in &mut groups {
            g.pool = shm_ring::prefaulted(g.pages as usize * g.page_bytes);
            // Hand out low page ids first.
            g.free = (0..g.pages).rev().collect();
            g.refs = vec![0; g.pages as usize];
            g.cached_at = vec![0; g.pages as usize];
        }
        Ok(PagedKv {
            page_size,
            dtype,
            allow_lossy,
            fingerprint: geometry.fingerprint(),
            geometry,
            groups,
            places,
            seqs: BTreeMap::new(),
            prefix: None,
            side: Vec::new(),
        })
    }

    /// The fingerprint spans must carry.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// The element type pages store.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The model geometry the cache was built for.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// Tokens per page.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// The group a model layer belongs to, and its kind.
    pub fn group_of(&self, layer: u32) -> Option<(usize, GroupKind)> {
        let p = self.places.get(layer as usize)?;
        Some((p.group, self.groups[p.group].kind))
    }

    /// Starts an empty sequence for `request_id`. Replaces nothing: an existing id is an error.
    pub fn add_sequence(&mut self, seq: SeqId, request_id: u64) -> Result<(), IngestError> {
        if self.seqs.contains_key(&seq) {
            return Err(IngestError::SequenceExists { seq });
        }
        let tables = vec![BlockTable::default(); self.groups.len()];
        self.seqs.insert(seq, Seq { request_id, len: 0, tables });
        Ok(())
    }

    /// Tokens the sequence holds (positions `[0, len)` have been written).
    pub fn seq_len(&self, seq: SeqId) -> Option<u64> {
        self.seqs.get(&seq).map(|s| s.len)
    }

    /// Frees a sequence and returns its pages to their pools (pages of a cached prefix stay cached).
    pub fn remove_sequence(&mut self, seq: SeqId) -> Result<(), ReadError> {
        let s = self.seqs.remove(&seq).ok_or(ReadError::UnknownSequence(seq))?;
        for (gi, table) in s.tables.into_iter().enumerate() {
            for page in table.pages.into_iter().rev() {
                self.release(gi, page);
            }
        }
        Ok(())
    }

    /// Starts `to` as a copy of `from` (for `request_id`): the same tokens, in the same state. Pages no
    /// write will change again are shared (their counts taken, as a prefix-cache hit takes them); the
    /// last page of an attention group, where the next token lands while it is partly filled, is copied
    /// into a page of `to`'s own. Nothing changes on an error.
    pub fn fork(&mut self, from: SeqId, to: SeqId, request_id: u64) -> Result<(), IngestError> {
        if self.seqs.contains_key(&to) {
            return Err(IngestError::SequenceExists { seq: to });
        }
        let src = self.seqs.get(&from).ok_or(IngestError::UnknownSequence { seq: from })?;
        let p = u64::from(self.page_size);
        // Per group, the page to copy: the held page that ends past the sequence's end.
        let partial: Vec<Option<usize>> = self
            .groups
            .iter()
            .zip(&src.tables)
            .map(|(g, t)| {
                let last = t.pages.len().checked_sub(1)?;
                (g.is_attention() && (t.first + t.pages.len() as u64) * p > src.len).then_some(last)
            })
            .collect();
        for (gi, (g, copy)) in self.groups.iter().zip(&partial).enumerate() {
            let free = g.available();
            if copy.is_some() && free == 0 {
                return Err(IngestError::CapacityExhausted { group: gi, kind: g.kind, needed: 1, free });
            }
        }
        let mut seq = Seq { request_id, ..src.clone() };
        for (gi, copy) in partial.into_iter().enumerate() {
            for (i, page) in seq.tables[gi].pages.iter_mut().enumerate() {
                if copy == Some(i) {
                    let own = self.take_page(gi);
                    let g = &mut self.groups[gi];
                    let at = *page as usize * g.page_bytes;
                    g.pool.copy_within(at..at + g.page_bytes, own as usize * g.page_bytes);
                    *page = own;
                }
                // Held by `from`, so never among the cached pages.
                self.groups[gi].refs[*page as usize] += 1;
            }
        }
        self.seqs.insert(to, seq);
        Ok(())
    }

    /// A block table lets go of `page`: the last one to do so frees it, or keeps it cached when it holds
    /// a prompt prefix.
    pub(crate) fn release(&mut self, group: usize, page: u32) {
        let g = &mut self.groups[group];
        g.refs[page as usize] -= 1;
        if g.refs[page as usize] > 0 {
            return;
        }
        match &mut self.prefix {
            Some(index) if index.holds(group, page) => {
                let tick = index.tick();
                g.cached.insert(tick, page);
                g.cached_at[page as usize] = tick;
            }
            _ => g.free.push(page),
        }
    }

    /// A page to write: a free one, else the least recently released cached one (its prefix block
    /// forgets it).
    pub(crate) fn take_page(&mut self, group: usize) -> u32 {
        if let Some(page) = self.groups[group].free.pop() {
            return page;
        }
        let page = *self.groups[group].cached.values().next().expect("capacity checked");
        self.evict(group, page);
        page
    }

    /// Takes the cached `page` out of the prefix cache: its prefix block forgets it.
    pub(crate) fn evict(&mut self, group: usize, page: u32) {
        let g = &mut self.groups[group];
        g.cached.remove(&g.cached_at[page as usize]);
        g.cached_at[page as usize] = 0;
        self.prefix.as_mut().expect("cached pages exist only with a prefix index").forget(group, page);
    }

    /// Pages used and free per group.
    pub fn usage(&self) -> Vec<GroupUsage> {
        self.groups
            .iter()
            .map(|g| GroupUsage {
                kind: g.kind,
                layers: g.layers.clone(),
                page_bytes: g.page_bytes,
                total: g.pages,
                used: g.pages - g.available(),
                free: g.free.len() as u32,
                cached: g.cached.len() as u32,
            })
            .collect()
    }

    /// The positions a layer attends to for the sequence's next query: all held positions for full
    /// attention, the last `window` for sliding.
    pub fn visible(&self, seq: SeqId, layer: u32) -> Result<Range<u64>, ReadError> {
        let s = self.seqs.get(&seq).ok_or(ReadError::UnknownSequence(seq))?;
        let place = self.place(layer)?;
        Ok(match self.groups[place.group].kind {
            GroupKind::Full => 0..s.len,
            GroupKind::Sliding { window } => s.len.saturating_sub(u64::from(window))..s.len,
            GroupKind::Recurrent => {
                return Err(ReadError::BadLayer { layer, expected: "an attention layer", found: "recurrent".into() })
            }
        })
    }

    fn place(&self, layer: u32) -> Result<Place, ReadError> {
        self.places.get(layer as usize).copied().ok_or(ReadError::BadLayer {
            layer,
            expected: "a layer of the model",
            found: format!("a model with {} layers", self.places.len()),
        })
    }

    /// K and V of exactly the positions `layer` attends to, as contiguous runs inside pages.
    pub fn read(&self, seq: SeqId, layer: u32) -> Result<LayerRead<'_>, ReadError> {
        let positions = self.visible(seq, layer)?;
        let place = self.place(layer)?;
        let s = &self.seqs[&seq];
        Ok(LayerRead {
            positions,
            group: &self.groups[place.group],
            table: &s.tables[place.group],
            slot: place.slot,
            page_size: self.page_size as usize,
            dtype: self.dtype,
        })
    }

    /// The recurrent state of `layer` for the sequence, or `None` if no span has set it yet.
    pub fn read_state(&self, seq: SeqId, layer: u32) -> Result<Option<&[u8]>, ReadError> {
        let s = self.seqs.get(&seq).ok_or(ReadError::UnknownSequence(seq))?;
        let place = self.place(layer)?;
        let g = &self.groups[place.group];
        if g.is_attention() {
            return Err(ReadError::BadLayer { layer, expected: "a recurrent layer", found: "attention".into() });
        }
        Ok(s.tables[place.group].pages.front().map(|&page| {
            let at = g.state_offset(page, place.slot);
            &g.pool[at..at + g.state_elems as usize * self.dtype.size() as usize]
        }))
    }

    /// A hash of all the cache holds: every row a sequence's pages hold for its positions (from
    /// `valid_from`: a prefix hit may read a sliding group's rows below the window too), every
    /// recurrent state, the bytes of the pages the prefix cache keeps for later requests, the free lists,
    /// each page's holders, the cached pages (and when they were released), the block tables and
    /// sequences, and the prefix index. Equal before and after a rejected span. (Bytes no read reaches
    /// are left out: a span refused after its first bytes were copied leaves them in the pages it had
    /// reserved and past the end of a sequence's last page, `PagedKv::abort`.)
    pub fn state_hash(&self) -> u64 {
        let mut h = twox_hash::XxHash3_64::with_seed(0);
        for g in &self.groups {
            for &p in g.cached.values() {
                h.write(&g.pool[p as usize * g.page_bytes..][..g.page_bytes]);
            }
            for &p in &g.free {
                h.write_u32(p);
            }
            for &r in &g.refs {
                h.write_u32(r);
            }
            for (&tick, &p) in &g.cached {
                h.write_u64(tick);
                h.write_u32(p);
            }
            for &tick in &g.cached_at {
                h.write_u64(tick);
            }
            h.write_u8(0xFF);
        }
        if let Some(index) = &self.prefix {
            index.hash_into(&mut h);
        }
        for (id, s) in &self.seqs {
            h.write_u64(id.0);
            h.write_u64(s.request_id);
            h.write_u64(s.len);
            for t in &s.tables {
                h.write_u64(t.first);
                h.write_u64(t.valid_from);
                for &p in &t.pages {
                    h.write_u32(p);
                }
                h.write_u8(0xFE);
            }
            let p = u64::from(self.page_size);
            for (g, t) in self.groups.iter().zip(&s.tables) {
                if !g.is_attention() {
                    // A state page holds its layers' states whole (a span replaces the page).
                    for &page in &t.pages {
                        h.write(&g.pool[page as usize * g.page_bytes..][..g.page_bytes]);
                    }
                    continue;
                }
                let from = t.valid_from.max(t.first * p);
                for (logical, &page) in (t.first..).zip(&t.pages) {
                    let (lo, hi) = (from.max(logical * p), s.len.min((logical + 1) * p));
                    if lo >= hi {
                        continue;
                    }
                    for (slot, v) in (0..g.layers.len()).flat_map(|slot| [(slot, false), (slot, true)]) {
                        let at = g.row_offset(page, slot, v, (lo % p) as usize, p as usize);
                        h.write(&g.pool[at..at + (hi - lo) as usize * g.row_bytes]);
                    }
                }
            }
        }
        h.finish()
    }
}

/// The K/V of one layer for one sequence, over exactly the positions it attends to.
#[derive(Debug)]
pub struct LayerRead<'a> {
    /// The positions covered.
    pub positions: Range<u64>,
    group: &'a Group,
    table: &'a BlockTable,
    slot: usize,
    page_size: usize,
    dtype: Dtype,
}

/// A run of consecutive positions inside one page.
#[derive(Debug, Clone, Copy)]
pub struct KvRun<'a> {
    /// First position of the run.
    pub start: u64,
    /// Positions in the run.
    pub tokens: usize,
    /// `tokens` rows of `kv_heads * head_dim` elements.
    pub k: &'a [u8],
    /// Same for V.
    pub v: &'a [u8],
}

impl<'a> LayerRead<'a> {
    /// The element type of the bytes.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// `(kv_heads, head_dim)`.
    pub fn heads(&self) -> (u32, u32) {
        self.group.heads
    }

    /// The runs, in position order.
    pub fn runs(&self) -> impl Iterator<Item = KvRun<'a>> + '_ {
        let p = self.page_size as u64;
        let mut pos = self.positions.start;
        let end = self.positions.end;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let logical = pos / p;
            let page = self.table.pages[(logical - self.table.first) as usize];
            let token = (pos % p) as usize;
            let tokens = ((logical + 1) * p).min(end) - pos;
            let g = self.group;
            let n = tokens as usize * g.row_bytes;
            let k = g.row_offset(page, self.slot, false, token, self.page_size);
            let v = g.row_offset(page, self.slot, true, token, self.page_size);
            let run = KvRun { start: pos, tokens: tokens as usize, k: &g.pool[k..k + n], v: &g.pool[v..v + n] };
            pos += tokens;
            Some(run)
        })
    }

    /// K and V of all covered positions, contiguous, in the cache's dtype.
    pub fn to_bytes(&self) -> (Vec<u8>, Vec<u8>) {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for run in self.runs() {
            k.extend_from_slice(run.k);
            v.extend_from_slice(run.v);
        }
        (k, v)
    }
}
