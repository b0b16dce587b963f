//! A segment: a fixed-size byte region that two parties share.
//!
//! All raw memory access of the ring goes through [`Segment`]'s provided methods, which bounds-check
//! every access and never form a Rust reference into the region (another process may write it at any
//! time). Implementations: [`memfd::MemfdSegment`] (real shared memory) and [`heap::HeapSegment`] (an
//! in-process stand-in so the protocol can be tested without the OS).
//!
//! Every read of a region another process may write is a volatile access ([`shared`]): a memfd mapping
//! is memory outside any Rust allocation, where a volatile read is one machine load the compiler may
//! neither elide, repeat nor merge with another, so a concurrent write by the peer is not a data race
//! of this program, only a value the read returns. What that value is, torn or not, is the reader's
//! business: the host validates and checksums its private copy, never the region.

pub mod heap;
pub mod memfd;
pub(crate) mod shared;

use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU64, Ordering};

/// A mapped region of `len()` bytes at `base()`.
///
/// # Safety
///
/// Implementors guarantee that `base()..base() + len()` stays mapped and readable for the lifetime of the
/// value, that it is 64-byte aligned, and that it is writable if `writable()` returns true. An
/// implementor that overrides a provided method keeps its checks: `range_ptr` and `word_ptr` return
/// pointers only into the region (the copy kernels trust them), and every access stays volatile or atomic.
pub unsafe trait Segment: Send {
    /// Start of the region.
    fn base(&self) -> NonNull<u8>;
    /// Length of the region in bytes.
    fn len(&self) -> usize;
    /// Whether this process may write the region.
    fn writable(&self) -> bool;

    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `dst.len()` bytes at `offset` into private memory.
    ///
    /// The copy is made of volatile loads ([`shared::copy`]): the bytes may change under it, in which case
    /// `dst` holds some mixture, which is why callers checksum and validate the *copy*, never the region.
    fn copy_out(&self, offset: usize, dst: &mut [u8]) {
        let end = offset.checked_add(dst.len()).expect("segment range overflows");
        assert!(end <= self.len(), "copy of {}..{end} outside a {}-byte segment", offset, self.len());
        // SAFETY: `offset..end` is inside the mapped region (checked above; the trait guarantees the
        // mapping lives as long as `self`), and `dst` is private memory that cannot overlap a shared mapping.
        // No reference to the source is formed, so concurrent writes by the peer cannot violate aliasing.
        unsafe { shared::copy(self.base().as_ptr().add(offset), dst) }
    }

    /// A plain `memcpy` of `dst.len()` bytes at `offset`: the physical reference `pdhost bench` puts
    /// beside the ring's volatile copies.
    ///
    /// # Safety
    ///
    /// Nothing writes `offset..offset + dst.len()` during the call (a benchmark that owns both ends).
    #[doc(hidden)]
    unsafe fn memcpy_out(&self, offset: usize, dst: &mut [u8]) {
        let end = offset.checked_add(dst.len()).expect("segment range overflows");
        assert!(end <= self.len(), "copy of {}..{end} outside a {}-byte segment", offset, self.len());
        // SAFETY: in bounds (checked above), `dst` is private, and nothing writes the source meanwhile
        // (the caller's promise), so the plain copy races with nothing.
        unsafe { std::ptr::copy_nonoverlapping(self.base().as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) }
    }

    /// Reads the aligned 8-byte word at `offset` once, with Acquire ordering.
    ///
    /// This is a single aligned 8-byte volatile load followed by an Acquire fence. On the targets pdhost
    /// supports (x86-64, aarch64) such a load is single-copy atomic, and it needs no write permission,
    /// unlike `AtomicU64::from_ptr`, whose contract requires writable memory: the host reads the
    /// producer's commit words through a read-only mapping.
    fn load_acquire(&self, offset: usize) -> u64 {
        let ptr = self.word_ptr(offset);
        // SAFETY: `word_ptr` checked that the 8 bytes are inside the mapping and 8-byte aligned.
        let value = unsafe { std::ptr::read_volatile(ptr) };
        fence(Ordering::Acquire);
        u64::from_le(value)
    }

    /// Stores the aligned 8-byte word at `offset` with Release ordering. Panics on a read-only segment.
    fn store_release(&self, offset: usize, value: u64) {
        assert!(self.writable(), "store to a read-only segment");
        let ptr = self.word_ptr(offset);
        // SAFETY: the word is in bounds, aligned and writable (checked above). An `AtomicU64` may alias
        // memory that other threads or processes access atomically; nothing here forms a non-atomic
        // reference to it.
        let word = unsafe { AtomicU64::from_ptr(ptr) };
        word.store(value.to_le(), Ordering::Release);
    }

    /// Copies `src` into the region at `offset`. Panics on a read-only segment.
    fn copy_in(&self, offset: usize, src: &[u8]) {
        assert!(self.writable(), "write to a read-only segment");
        let end = offset.checked_add(src.len()).expect("segment range overflows");
        assert!(end <= self.len(), "copy of {}..{end} outside a {}-byte segment", offset, self.len());
        // SAFETY: in bounds and writable (checked above); `src` is private memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.base().as_ptr().add(offset), src.len()) }
    }

    /// A pointer to `offset..offset + len`, checked to lie inside the region, for raw-pointer readers that
    /// must not form references (the fused copy-and-checksum kernel).
    #[doc(hidden)]
    fn range_ptr(&self, offset: usize, len: usize) -> *const u8 {
        let end = offset.checked_add(len).expect("segment range overflows");
        assert!(end <= self.len(), "range {offset}..{end} outside a {}-byte segment", self.len());
        // SAFETY: in bounds (checked above).
        unsafe { self.base().as_ptr().add(offset) }
    }

    /// The bounds- and alignment-checked pointer to the word at `offset`.
    #[doc(hidden)]
    fn word_ptr(&self, offset: usize) -> *mut u64 {
        assert!(offset.is_multiple_of(8), "unaligned word offset {offset}");
        assert!(offset.checked_add(8).is_some_and(|end| end <= self.len()), "word {offset} out of bounds");
        // SAFETY: in bounds (checked above), so the result stays inside the same allocation.
        unsafe { self.base().as_ptr().add(offset).cast() }
    }
}

/// One shared word of a segment, as the slot protocol sees it.
#[derive(Debug)]
pub struct SharedWord<'a, S: Segment> {
    segment: &'a S,
    offset: usize,
}

impl<'a, S: Segment> SharedWord<'a, S> {
    /// The word at `offset` (checked on every access).
    pub fn new(segment: &'a S, offset: usize) -> Self {
        SharedWord { segment, offset }
    }
}

impl<S: Segment> crate::protocol::Word for SharedWord<'_, S> {
    fn load_acquire(&self) -> u64 {
        self.segment.load_acquire(self.offset)
    }
    fn store_release(&self, value: u64) {
        self.segment.store_release(self.offset, value)
    }
}
