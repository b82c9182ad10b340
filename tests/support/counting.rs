//! A global allocator for benches and examples that count what the crate
//! allocates: the system allocator, with the allocations made and the bytes
//! in use counted beside it, and on request each allocation's call sites
//! printed. A binary installs it with
//! `#[global_allocator] static A: support::Counting = support::Counting;`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

/// The system allocator, counting.
pub struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static IN_USE: AtomicI64 = AtomicI64::new(0);
static TRACE: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// This thread is printing a trace: its own allocations are not traced.
    static TRACING: Cell<bool> = const { Cell::new(false) };
}

/// Allocations (and reallocations) made so far, by every thread.
pub fn allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

/// Bytes allocated and not freed so far.
pub fn in_use() -> i64 {
    IN_USE.load(Ordering::Relaxed)
}

/// While on, every allocation prints its size, thread and first call sites
/// outside the allocator and the standard library to stderr (build with
/// `CARGO_PROFILE_BENCH_DEBUG=true` or `CARGO_PROFILE_RELEASE_DEBUG=true`
/// for file and line).
pub fn trace(on: bool) {
    TRACE.store(on, Ordering::Relaxed);
}

fn traced(size: usize) {
    if !TRACE.load(Ordering::Relaxed) {
        return;
    }
    let _ = TRACING.try_with(|tracing| {
        if tracing.replace(true) {
            return;
        }
        let trace = std::backtrace::Backtrace::force_capture().to_string();
        let sites: Vec<&str> = trace
            .lines()
            .filter(|line| line.contains("at ") && !line.contains("/rustc/"))
            .skip(3)
            .take(9)
            .collect();
        eprintln!(
            "allocation of {size} bytes on {:?}\n{}",
            std::thread::current().name(),
            sites.join("\n")
        );
        tracing.set(false);
    });
}

fn bytes(size: usize) -> i64 {
    i64::try_from(size).unwrap_or(i64::MAX)
}

// SAFETY: every call is passed to the system allocator unchanged; only
// counters are updated beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        IN_USE.fetch_add(bytes(layout.size()), Ordering::Relaxed);
        traced(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        IN_USE.fetch_sub(bytes(layout.size()), Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        IN_USE.fetch_add(
            bytes(new_size).saturating_sub(bytes(layout.size())),
            Ordering::Relaxed,
        );
        traced(new_size);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
