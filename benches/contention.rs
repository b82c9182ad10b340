//! Criterion benches against a private redis-server (started here, on a free
//! loopback port, through `tests/support`).
//!
//! `cargo bench --bench contention`, then open
//! `target/criterion/report/index.html`.
//!
//! * `uncontended`: lock + `unlock()` with `Release::Lua` and
//!   `Release::Watch`, lock + drop (the release written behind, its reply
//!   read with the next lock's: one round trip per cycle), a semaphore
//!   permit's acquire+release (`permit/3`), and a `PING` on the same kind of
//!   pooled connection, the floor.
//! * `release`: the release alone, Lua vs WATCH (acquire untimed).
//! * `contended`: one key, 1/2/4/8/16 threads of one client; time per
//!   acquisition.
//! * `keys`: 8 threads over 1/4/16/64 keys; time per acquisition.
//! * `held`: 1 to 10,000 locks taken and held at once by one client with
//!   the watchdog on, then released; time per lock. (Their memory, in the
//!   client and in Redis, and the renewals' round trips: `examples/measure/watchdog.rs`.)

use redmutex_test_support as support;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use redmutex::Lease;
use redmutex::{DistributedLock, LockClient, LockOptions, Release, Semaphore};

fn options(release: Release) -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(60))
        .release(release)
}

fn uncontended(c: &mut Criterion, client: &LockClient) {
    let mut group = c.benchmark_group("uncontended");
    group.throughput(Throughput::Elements(1));
    for (name, release) in [("lua", Release::Lua), ("watch", Release::Watch)] {
        let lock = DistributedLock::with_options(client, format!("bench:{name}"), options(release));
        group.bench_function(format!("acquire+release/{name}"), |b| {
            b.iter(|| {
                let guard = lock.lock().expect("lock");
                guard.unlock().expect("unlock");
            })
        });
    }
    let lock = DistributedLock::with_options(client, "bench:drop", options(Release::Lua));
    group.bench_function("acquire+drop/lua", |b| {
        b.iter(|| drop(lock.lock().expect("lock")))
    });
    let semaphore = Semaphore::with_options(
        client,
        "bench:permit",
        3,
        options(Release::Lua).with_extra(redmutex::SemaphoreExtra::default()),
    );
    group.bench_function("acquire+release/permit/3", |b| {
        b.iter(|| {
            let permit = semaphore.acquire().expect("acquire");
            permit.release().expect("release");
        })
    });
    group.bench_function("ping", |b| {
        b.iter(|| {
            let mut con = client
                .pool()
                .expect("a single-node client")
                .get()
                .expect("connection");
            let pong: String = redis::cmd("PING").query(&mut *con).expect("PING");
            pong
        })
    });
    group.finish();
}

fn release_alone(c: &mut Criterion, client: &LockClient) {
    let mut group = c.benchmark_group("release");
    for (name, release) in [("lua", Release::Lua), ("watch", Release::Watch)] {
        let lock =
            DistributedLock::with_options(client, format!("bench:rel:{name}"), options(release));
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let guard = lock.lock().expect("lock");
                    let started = Instant::now();
                    guard.unlock().expect("unlock");
                    timed += started.elapsed();
                }
                timed
            })
        });
    }
    group.finish();
}

/// Runs `iters` lock cycles split over `threads` threads, the n-th thread
/// cycling through `keys`; returns the wall time of the whole batch.
fn run_threads(client: &LockClient, threads: usize, keys: usize, iters: u64) -> Duration {
    let per_thread = iters.div_ceil(threads as u64);
    let barrier = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let locks: Vec<_> = (0..keys)
                .map(|k| {
                    DistributedLock::with_options(
                        client,
                        format!("bench:key:{k}"),
                        options(Release::Lua),
                    )
                })
                .collect();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                for i in 0..per_thread as usize {
                    let lock = &locks[(t + i * threads) % locks.len()];
                    lock.lock().expect("lock").unlock().expect("unlock");
                }
            })
        })
        .collect();
    barrier.wait();
    let started = Instant::now();
    for handle in handles {
        handle.join().expect("bench thread");
    }
    started.elapsed()
}

fn contended(c: &mut Criterion, client: &LockClient) {
    let mut group = c.benchmark_group("contended");
    group.throughput(Throughput::Elements(1));
    for threads in [1usize, 2, 4, 8, 16] {
        group.bench_with_input(
            BenchmarkId::new("one-key", threads),
            &threads,
            |b, &threads| b.iter_custom(|iters| run_threads(client, threads, 1, iters)),
        );
    }
    group.finish();
}

fn many_keys(c: &mut Criterion, client: &LockClient) {
    let mut group = c.benchmark_group("keys");
    group.throughput(Throughput::Elements(1));
    for keys in [1usize, 4, 16, 64] {
        group.bench_with_input(BenchmarkId::new("8-threads", keys), &keys, |b, &keys| {
            b.iter_custom(|iters| run_threads(client, 8, keys, iters))
        });
    }
    group.finish();
}

/// Takes `n` watched locks, holds them all at once, releases them; the
/// time per lock.
fn held(c: &mut Criterion, client: &LockClient) {
    let mut group = c.benchmark_group("held");
    group.sample_size(10);
    let options = options(Release::Lua).watchdog(true);
    for n in [1usize, 10, 100, 1_000, 10_000] {
        let locks: Vec<DistributedLock> = (0..n)
            .map(|i| DistributedLock::with_options(client, format!("bench:held:{i}"), options))
            .collect();
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::new("watched", n), &n, |b, _| {
            b.iter(|| {
                let guards: Vec<_> = locks.iter().map(|l| l.lock().expect("lock")).collect();
                for guard in guards {
                    guard.unlock().expect("unlock");
                }
            })
        });
    }
    group.finish();
}

fn benches(c: &mut Criterion) {
    let server = support::RedisServer::start();
    let client = server.lock_client();
    uncontended(c, &client);
    release_alone(c, &client);
    contended(c, &client);
    many_keys(c, &client);
    held(c, &client);
}

criterion_group! {
    name = contention;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    targets = benches
}
criterion_main!(contention);
