//! The global allocator of the command line and the benchmarks: mimalloc, asked for a plain
//! block wherever a plain block is aligned enough.
//!
//! An import builds tens of thousands of small nodes; freeing them with the system allocator
//! took a fifth of the instructions `check` spent on the 80-layer program, and mimalloc takes a
//! third of that. The `mimalloc` crate passes every request to `mi_malloc_aligned`, which in
//! mimalloc v3 keeps its plain path only for block sizes that are powers of two: a node's
//! 96-byte metadata went through the over-allocating aligned path into a 128-byte block, on
//! every node an importer builds. A block of at least 16 bytes is 16-aligned and a smaller one
//! is aligned to its size (mimalloc's own invariant, `MI_MAX_ALIGN_SIZE`), so a request whose
//! alignment is at most 16 and at most its size gets a plain block, as Rust's system allocator
//! decides for `malloc`; any other takes the aligned call.

use libmimalloc_sys as mi;
use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

/// mimalloc's `MI_MAX_ALIGN_SIZE`.
const PLAIN_ALIGN: usize = 16;

pub struct Mimalloc;

fn plain(align: usize, size: usize) -> bool {
    align <= PLAIN_ALIGN && align <= size
}

/// A block for `layout` from `unaligned` where [`plain`] allows, else from `aligned`.
#[inline]
unsafe fn block(
    layout: Layout,
    unaligned: unsafe extern "C" fn(usize) -> *mut c_void,
    aligned: unsafe extern "C" fn(usize, usize) -> *mut c_void,
) -> *mut u8 {
    let (size, align) = (layout.size(), layout.align());
    unsafe {
        if plain(align, size) {
            unaligned(size).cast()
        } else {
            aligned(size, align).cast()
        }
    }
}

// SAFETY: every block comes from mimalloc and goes back to it; `plain` sends a request to the
// unaligned calls only where their blocks meet the layout's alignment (see the top).
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        unsafe { block(layout, mi::mi_malloc, mi::mi_malloc_aligned) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        unsafe { block(layout, mi::mi_zalloc, mi::mi_zalloc_aligned) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let align = layout.align();
        unsafe {
            if plain(align, new_size) {
                mi::mi_realloc(ptr.cast::<c_void>(), new_size).cast()
            } else {
                mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, align).cast()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A block for `layout`, written whole and freed; whether it was aligned.
    fn aligned_block(layout: Layout, zeroed: bool) -> bool {
        unsafe {
            let p = if zeroed {
                Mimalloc.alloc_zeroed(layout)
            } else {
                Mimalloc.alloc(layout)
            };
            assert!(!p.is_null());
            if zeroed {
                assert!((0..layout.size()).all(|i| *p.add(i) == 0));
            }
            std::ptr::write_bytes(p, 0xa5, layout.size());
            let ok = p as usize % layout.align() == 0;
            Mimalloc.dealloc(p, layout);
            ok
        }
    }

    proptest! {
        /// Every size class a node, an argument list or a chunk of nodes uses, under every
        /// alignment up to a page, many blocks at a time so that fresh and reused pages both
        /// serve them.
        #[test]
        fn blocks_meet_their_layouts_alignment(
            size in prop_oneof![1usize..=1024, 1025usize..=300_000],
            align_log in 0u32..=12,
            count in 1usize..=64,
            zeroed in any::<bool>(),
        ) {
            let layout = Layout::from_size_align(size, 1 << align_log).unwrap();
            let held: Vec<*mut u8> = (0..count).map(|_| unsafe { Mimalloc.alloc(layout) }).collect();
            for &p in &held {
                prop_assert!(!p.is_null() && p as usize % layout.align() == 0);
            }
            prop_assert!(aligned_block(layout, zeroed));
            for p in held {
                unsafe { Mimalloc.dealloc(p, layout) };
            }
        }

        /// A block grown or shrunk keeps its bytes and its alignment.
        #[test]
        fn realloc_keeps_bytes_and_alignment(
            size in 1usize..=4096,
            new_size in 1usize..=70_000,
            align_log in 0u32..=12,
        ) {
            let layout = Layout::from_size_align(size, 1 << align_log).unwrap();
            unsafe {
                let p = Mimalloc.alloc(layout);
                for i in 0..size {
                    *p.add(i) = i as u8;
                }
                let q = Mimalloc.realloc(p, layout, new_size);
                prop_assert!(!q.is_null() && q as usize % layout.align() == 0);
                for i in 0..size.min(new_size) {
                    prop_assert_eq!(*q.add(i), i as u8);
                }
                Mimalloc.dealloc(q, Layout::from_size_align(new_size, layout.align()).unwrap());
            }
        }
    }
}
