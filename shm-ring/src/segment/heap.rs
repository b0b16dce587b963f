//! An in-process segment on the heap, for tests of the ring protocol without shared memory.

use std::ptr::NonNull;

use super::Segment;

/// A zeroed, 64-byte-aligned heap region that can be shared between threads.
#[derive(Debug)]
pub struct HeapSegment {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
    writable: bool,
}

// SAFETY: the region is accessed through `Segment`'s methods, which use raw-pointer copies and atomic
// words (`load_acquire` below, `store_release`), never references; sharing the pointer between threads
// is the point of a segment. The one exception is a writer's `SlotWriter::frame_mut`, a `&mut [u8]` over
// its reserved slot: a test that takes it must not read that slot from another thread meanwhile.
unsafe impl Send for HeapSegment {}
// SAFETY: as above.
unsafe impl Sync for HeapSegment {}

impl HeapSegment {
    /// A writable zeroed region of `len` bytes (at least 8).
    pub fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len.max(8), 64).expect("segment layout");
        // SAFETY: the layout has nonzero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        HeapSegment { ptr, layout, writable: true }
    }

    /// A view of the same region, read-only or writable: the in-heap analogue of a second mapping.
    ///
    /// The view borrows `self`, so it cannot outlive the allocation.
    pub fn view(&self, writable: bool) -> HeapView<'_> {
        HeapView { owner: self, writable }
    }
}

impl Drop for HeapSegment {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: `ptr` is a live allocation of `layout.size()` bytes, 64-aligned, writable.
unsafe impl Segment for HeapSegment {
    fn base(&self) -> NonNull<u8> {
        self.ptr
    }
    fn len(&self) -> usize {
        self.layout.size()
    }
    fn writable(&self) -> bool {
        self.writable
    }
    fn load_acquire(&self, offset: usize) -> u64 {
        atomic_load(self, offset)
    }
}

/// An atomic load of the word at `offset`: between threads of one process (these segments' use), the
/// provided volatile read racing another thread's atomic store would be a data race. Heap memory is
/// always writable, as `AtomicU64::from_ptr` asks.
fn atomic_load(segment: &impl Segment, offset: usize) -> u64 {
    let ptr = segment.word_ptr(offset);
    // SAFETY: `word_ptr` checked that the 8 bytes are inside the allocation and 8-byte aligned; every
    // other access to a word is atomic.
    let word = unsafe { std::sync::atomic::AtomicU64::from_ptr(ptr) };
    u64::from_le(word.load(std::sync::atomic::Ordering::Acquire))
}

/// A borrowed view of a [`HeapSegment`].
#[derive(Debug, Clone, Copy)]
pub struct HeapView<'a> {
    owner: &'a HeapSegment,
    writable: bool,
}

// SAFETY: the owner is live for 'a, so the region is; the view is writable only if the owner is.
unsafe impl Segment for HeapView<'_> {
    fn base(&self) -> NonNull<u8> {
        self.owner.ptr
    }
    fn len(&self) -> usize {
        self.owner.len()
    }
    fn writable(&self) -> bool {
        self.writable && self.owner.writable
    }
    fn load_acquire(&self, offset: usize) -> u64 {
        atomic_load(self, offset)
    }
}
