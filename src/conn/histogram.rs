//! A lock-free histogram of durations in fixed memory, for wait and hold
//! times: log-linear buckets of microseconds (exact below 16 µs, then 8
//! buckets per power of two, so a quantile is off by at most 12.5 %), one
//! atomic counter each, and the exact maximum.
//!
//! Recording is two relaxed atomic operations and never allocates or
//! locks; a snapshot reads the buckets one by one, so it may straddle a
//! concurrent record (a count off by one, never a torn value).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Values below this many microseconds each have their own bucket.
const LINEAR: u64 = 16;
/// Buckets per power of two above `LINEAR` (a power of two itself).
const SUB: u64 = 8;
const SUB_BITS: u32 = SUB.trailing_zeros();
/// Powers of two covered: up to 2^40 µs (about 12.7 days); longer values
/// land in the last bucket (the maximum stays exact).
const TOP_EXPONENT: u32 = 40;
const BUCKETS: usize = (LINEAR + (TOP_EXPONENT as u64 - 4 + 1) * SUB) as usize;

/// The bucket of `micros`.
fn bucket(micros: u64) -> usize {
    if micros < LINEAR {
        return micros as usize;
    }
    let exponent = (63 - micros.leading_zeros()).min(TOP_EXPONENT);
    if exponent == TOP_EXPONENT && micros >> TOP_EXPONENT > 1 {
        return BUCKETS - 1;
    }
    let sub = (micros >> (exponent - SUB_BITS)) & (SUB - 1);
    (LINEAR + u64::from(exponent - 4) * SUB + sub) as usize
}

/// The largest value of bucket `index`, in microseconds.
fn upper_bound(index: usize) -> u64 {
    let index = index as u64;
    if index < LINEAR {
        return index;
    }
    let exponent = (index - LINEAR) / SUB + 4;
    let sub = (index - LINEAR) % SUB;
    let width = 1u64 << (exponent - u64::from(SUB_BITS));
    (1u64 << exponent) + (sub + 1) * width - 1
}

/// Durations recorded from any thread.
pub(crate) struct Histogram {
    buckets: [AtomicU64; BUCKETS],
    max_micros: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            max_micros: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    pub(crate) fn record(&self, value: Duration) {
        let micros = u64::try_from(value.as_micros()).unwrap_or(u64::MAX);
        self.buckets[bucket(micros)].fetch_add(1, Ordering::Relaxed);
        self.max_micros.fetch_max(micros, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> Distribution {
        let counts: Vec<u64> = self
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        let max = self.max_micros.load(Ordering::Relaxed);
        let quantile = |q: f64| -> Duration {
            if total == 0 {
                return Duration::ZERO;
            }
            // The rank of the q-th value, 1-based: at least the first.
            let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
            let mut seen = 0u64;
            for (index, n) in counts.iter().enumerate() {
                seen += n;
                if seen >= rank {
                    return Duration::from_micros(upper_bound(index).min(max));
                }
            }
            Duration::from_micros(max)
        };
        Distribution {
            count: total,
            p50: quantile(0.5),
            p90: quantile(0.9),
            p99: quantile(0.99),
            max: Duration::from_micros(max),
        }
    }
}

/// A distribution of durations: how many, and quantiles within 12.5 % (the
/// maximum is exact). All zero when nothing was recorded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Distribution {
    /// How many durations were recorded.
    pub count: u64,
    /// The median.
    pub p50: Duration,
    /// The 90th percentile.
    pub p90: Duration,
    /// The 99th percentile.
    pub p99: Duration,
    /// The longest.
    pub max: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_bounded() {
        let mut last = None;
        for micros in (0..100_000u64).chain([1 << 39, (1 << 40) - 1, 1 << 40, u64::MAX]) {
            let index = bucket(micros);
            assert!(index < BUCKETS, "{micros}");
            if let Some((prev_micros, prev)) = last {
                assert!(index >= prev, "monotonic at {micros}");
                if micros == prev_micros + 1 {
                    assert!(index <= prev + 1, "no gap at {micros}");
                }
            }
            if index < BUCKETS - 1 {
                assert!(upper_bound(index) >= micros, "{micros} within its bucket");
                let width = upper_bound(index)
                    - if index == 0 {
                        0
                    } else {
                        upper_bound(index - 1)
                    };
                assert!(
                    width * 8 <= micros.max(8),
                    "bucket of {micros} at most 1/8 wide: {width}"
                );
            }
            last = Some((micros, index));
        }
    }

    #[test]
    fn quantiles_are_within_an_eighth_and_the_max_exact() {
        let h = Histogram::default();
        assert_eq!(h.snapshot(), Distribution::default(), "empty");
        for ms in 1..=100u64 {
            h.record(Duration::from_millis(ms));
        }
        let d = h.snapshot();
        assert_eq!(d.count, 100);
        assert_eq!(d.max, Duration::from_millis(100));
        for (got, want) in [(d.p50, 50.0), (d.p90, 90.0), (d.p99, 99.0)] {
            let got = got.as_secs_f64() * 1000.0;
            assert!(got >= want && got <= want * 1.125, "{got} for {want}");
        }
        h.record(Duration::MAX);
        assert_eq!(h.snapshot().max, Duration::from_micros(u64::MAX));
    }

    #[test]
    fn one_value_is_every_quantile() {
        let h = Histogram::default();
        h.record(Duration::from_micros(1234));
        let d = h.snapshot();
        assert_eq!(
            (d.p50, d.p99, d.max),
            (d.max, d.max, Duration::from_micros(1234))
        );
    }
}
