//! The prefix cache: full pages of prompts, shared by content between sequences.
//!
//! A prompt is cut into page-sized blocks of tokens. Block `b`'s key hashes the key of block `b - 1`, how
//! its K/V came to be ([`Rounding`]: who computed them, the host or a named backend, and the dtype they
//! were rounded through on the way in; the same tokens another way are other bytes) and its tokens, so a
//! key stands for the whole prefix up to the block's end. A lookup also compares each block's tokens,
//! parent key and rounding, so a hash collision is a miss, never someone else's K/V.
//!
//! When a sequence's prefill is complete, [`PagedKv::register_prefix`] records, for each full block of
//! its prompt, the page each group holds it in. Pages are refcounted by the block tables that hold them; a
//! registered page that no table holds any more is *cached*, not freed, and is handed out again (its
//! registration forgotten) only when a group has no free page left, least recently released first.
//!
//! [`PagedKv::attach_prefix`] gives a new sequence the longest registered prefix it can use, as whole
//! pages shared with their other holders (never written again: every later position lies in later
//! pages). A hit of `h` tokens needs, in every group, what that group would hold after prefilling `h`
//! tokens itself:
//! - a full-attention group: the pages of all `h / page_size` blocks;
//! - a sliding group (window `w`): the pages of the blocks holding positions `h - w .. h`, with their bytes
//!   from `h - w` on. A sliding span longer than the window writes only its tail and a sequence drops
//!   pages that leave its window, so a long prompt's early blocks are found only in the full group: then
//!   the hit is shorter, or none, and those tokens are computed again;
//! - a recurrent group: its state after exactly `h` tokens, which is not kept, so models with recurrent
//!   layers never hit.

use std::collections::HashMap;
use std::hash::Hasher;

use shm_format::{Dtype, GroupKind};

use super::{BlockTable, PagedKv, SeqId};

/// How a block's K/V came to be: who computed them and the dtype they were rounded through on the way
/// into the cache. Blocks of the same tokens hold the same bytes only where both agree: a backend with
/// its own arithmetic (torch's, a vendor's) computes other K/V than the host at any dtype, so its blocks
/// are never handed to a prefill of the host's, nor the host's to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rounding {
    /// The dtype.
    pub dtype: Dtype,
    /// 0 for the host's own forward pass; else a hash of the backend's name.
    by: u64,
}

impl Rounding {
    /// K/V the host computed, rounded to `dtype` (the cache's).
    pub fn host(dtype: Dtype) -> Self {
        Rounding { dtype, by: 0 }
    }

    /// K/V the backend named `name` computed and sent in `dtype`.
    pub fn backend(name: &str, dtype: Dtype) -> Self {
        Rounding { dtype, by: twox_hash::XxHash3_64::oneshot(name.as_bytes()) | 1 }
    }
}

/// What the cache knows of one block of a prompt.
#[derive(Debug)]
struct Block {
    parent: u64,
    rounding: Rounding,
    tokens: Box<[u32]>,
    /// Per group: the page holding the block, and the first position in it whose bytes are there.
    pages: Vec<Option<(u32, u64)>>,
}

/// The registered blocks, and which page belongs to which block.
#[derive(Debug, Default)]
pub(crate) struct PrefixIndex {
    blocks: HashMap<u64, Block>,
    /// Per group: page to the key of the block it holds.
    owner: Vec<HashMap<u32, u64>>,
    tick: u64,
}

/// The key of the block after `parent` holding `tokens`, computed and rounded as `rounding` says.
fn key(parent: u64, rounding: Rounding, tokens: &[u32]) -> u64 {
    let mut h = twox_hash::XxHash3_64::with_seed(0x7072_6566_6978);
    h.write_u64(parent);
    h.write_u8(rounding.dtype as u8);
    h.write_u64(rounding.by);
    for &t in tokens {
        h.write_u32(t);
    }
    h.finish()
}

impl PrefixIndex {
    /// Whether `page` of `group` holds a registered block.
    pub(crate) fn holds(&self, group: usize, page: u32) -> bool {
        self.owner[group].contains_key(&page)
    }

    /// A fresh, increasing stamp for the cached-page order.
    pub(crate) fn tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// `page` of `group` is about to be overwritten: its block no longer has it (and a block left with no
    /// page at all is dropped).
    pub(crate) fn forget(&mut self, group: usize, page: u32) {
        let Some(k) = self.owner[group].remove(&page) else { return };
        if let Some(block) = self.blocks.get_mut(&k) {
            block.pages[group] = None;
            if block.pages.iter().all(Option::is_none) {
                self.blocks.remove(&k);
            }
        }
    }

    /// Everything the index holds, into `h`, in an order its hash maps do not decide.
    pub(crate) fn hash_into(&self, h: &mut impl Hasher) {
        h.write_u64(self.tick);
        let mut keys: Vec<&u64> = self.blocks.keys().collect();
        keys.sort_unstable();
        for k in keys {
            let b = &self.blocks[k];
            h.write_u64(*k);
            h.write_u64(b.parent);
            h.write_u8(b.rounding.dtype as u8);
            h.write_u64(b.rounding.by);
            b.tokens.iter().for_each(|&t| h.write_u32(t));
            for page in &b.pages {
                match page {
                    Some((page, from)) => {
                        h.write_u32(*page);
                        h.write_u64(*from);
                    }
                    None => h.write_u8(0xFD),
                }
            }
        }
        for owner in &self.owner {
            let mut pages: Vec<(&u32, &u64)> = owner.iter().collect();
            pages.sort_unstable();
            for (page, k) in pages {
                h.write_u32(*page);
                h.write_u64(*k);
            }
            h.write_u8(0xFC);
        }
    }

    /// The registered blocks of `tokens`' full pages from the start, as far as they go.
    fn chain<'a>(&'a self, tokens: &[u32], page: usize, rounding: Rounding) -> Vec<&'a Block> {
        let mut found = Vec::new();
        let mut parent = 0;
        for block_tokens in tokens.chunks_exact(page) {
            let k = key(parent, rounding, block_tokens);
            match self.blocks.get(&k) {
                Some(b) if b.parent == parent && b.rounding == rounding && *b.tokens == *block_tokens => found.push(b),
                _ => break,
            }
            parent = k;
        }
        found
    }
}

/// Tokens the cache's prefix index holds for a sequence, and where.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// Positions `0..tokens` are shared from the cache.
    pub tokens: u64,
}

impl PagedKv {
    /// Turns the prefix cache on (see the module documentation). Off by default.
    pub fn enable_prefix_cache(&mut self) {
        let owner = vec![HashMap::new(); self.groups.len()];
        self.prefix.get_or_insert(PrefixIndex { owner, ..PrefixIndex::default() });
    }

    /// Whether the prefix cache is on.
    pub fn prefix_cache(&self) -> bool {
        self.prefix.is_some()
    }

    /// Shares with the empty sequence `seq` the longest registered prefix of `tokens` (computed and
    /// rounded as `rounding` says) that every group can use, in whole pages: afterwards `seq` holds positions
    /// `0..hit.tokens`, and its next span starts there. No hit (the cache off, nothing registered, a
    /// sequence that is not empty) leaves everything as it was.
    pub fn attach_prefix(&mut self, seq: SeqId, tokens: &[u32], rounding: Rounding) -> PrefixHit {
        let Some(index) = &self.prefix else { return PrefixHit::default() };
        if self.seqs.get(&seq).is_none_or(|s| s.len != 0) || self.groups.iter().any(|g| !g.is_attention()) {
            return PrefixHit::default();
        }
        let p = u64::from(self.page_size);
        let blocks = index.chain(tokens, p as usize, rounding);
        // The longest hit every group can serve: the full groups' pages must all be there, so it is at
        // most the run of blocks with full pages; then the sliding windows decide.
        let usable = |n: usize| -> bool {
            let h = n as u64 * p;
            self.groups.iter().enumerate().all(|(gi, g)| match g.kind {
                GroupKind::Full => blocks[..n].iter().all(|b| b.pages[gi].is_some()),
                GroupKind::Sliding { window } => {
                    let lo = h.saturating_sub(u64::from(window));
                    (lo / p..n as u64)
                        .all(|b| blocks[b as usize].pages[gi].is_some_and(|(_, valid)| valid <= (b * p).max(lo)))
                }
                GroupKind::Recurrent => false,
            })
        };
        let Some(n) = (1..=blocks.len()).rev().find(|&n| usable(n)) else { return PrefixHit::default() };
        let h = n as u64 * p;
        let mut tables = Vec::with_capacity(self.groups.len());
        for (gi, g) in self.groups.iter().enumerate() {
            let first = match g.kind {
                GroupKind::Sliding { window } => h.saturating_sub(u64::from(window)) / p,
                _ => 0,
            };
            let held: Vec<(u32, u64)> =
                blocks[first as usize..n].iter().map(|b| b.pages[gi].expect("usable")).collect();
            let valid_from = held.first().map_or(0, |&(_, valid)| valid);
            tables.push(BlockTable { first, pages: held.iter().map(|&(page, _)| page).collect(), valid_from });
        }
        for (gi, table) in tables.iter().enumerate() {
            let g = &mut self.groups[gi];
            for &page in &table.pages {
                let tick = std::mem::take(&mut g.cached_at[page as usize]);
                if tick != 0 {
                    g.cached.remove(&tick);
                }
                g.refs[page as usize] += 1;
            }
        }
        let s = self.seqs.get_mut(&seq).expect("checked");
        s.tables = tables;
        s.len = h;
        PrefixHit { tokens: h }
    }

    /// Registers the full pages of `seq`'s prompt `tokens` (whose K/V were computed and rounded as
    /// `rounding` says) so later sequences can share them. Blocks already registered keep their pages (a group that had
    /// none takes this sequence's). Does nothing with the cache off.
    pub fn register_prefix(&mut self, seq: SeqId, tokens: &[u32], rounding: Rounding) {
        let Some(index) = &mut self.prefix else { return };
        let Some(s) = self.seqs.get(&seq) else { return };
        let p = u64::from(self.page_size);
        let held = tokens.len().min(s.len as usize);
        let mut parent = 0;
        for (b, block_tokens) in tokens[..held].chunks_exact(p as usize).enumerate() {
            let k = key(parent, rounding, block_tokens);
            let b = b as u64;
            let pages: Vec<Option<(u32, u64)>> = self
                .groups
                .iter()
                .zip(&s.tables)
                .map(|(g, t)| {
                    let valid = t.valid_from.max(b * p);
                    let held = g.is_attention() && b >= t.first && valid < (b + 1) * p;
                    held.then(|| t.pages.get((b - t.first) as usize).map(|&page| (page, valid))).flatten()
                })
                .collect();
            match index.blocks.get_mut(&k) {
                Some(block)
                    if block.parent != parent || block.rounding != rounding || *block.tokens != *block_tokens =>
                {
                    return
                }
                Some(block) => {
                    for (gi, (mine, theirs)) in pages.iter().zip(&mut block.pages).enumerate() {
                        if let (Some((page, _)), None) = (mine, &theirs) {
                            if !index.owner[gi].contains_key(page) {
                                *theirs = *mine;
                                index.owner[gi].insert(*page, k);
                            }
                        }
                    }
                }
                None => {
                    // A page holds one block; one that already does (shared into this sequence under
                    // another rounding) is not this block's.
                    let pages: Vec<Option<(u32, u64)>> = pages
                        .into_iter()
                        .enumerate()
                        .map(|(gi, page)| page.filter(|(page, _)| !index.owner[gi].contains_key(page)))
                        .collect();
                    if pages.iter().all(Option::is_none) {
                        return;
                    }
                    for (gi, page) in pages.iter().enumerate() {
                        if let Some((page, _)) = page {
                            index.owner[gi].insert(*page, k);
                        }
                    }
                    index.blocks.insert(k, Block { parent, rounding, tokens: block_tokens.into(), pages });
                }
            }
            parent = k;
        }
    }
}
