//! The market simulation of Redis in Action §6.2: optimistic
//! WATCH/MULTI/EXEC against a coarse lock and fine-grained locks.
//!
//! ```sh
//! cargo run --release --example market -- [--secs 60] [--mode all|watch|coarse|fine] \
//!     [--load 1x1,5x1,5x5] [--url URL]
//! ```
//!
//! Listers put items from their inventories on a market sorted set; buyers
//! pick a random listed item and buy it, moving funds between user hashes
//! and the item into their inventory. Each lister and buyer is its own
//! thread with its own connection (and, in the lock modes, its own
//! `LockClient`, as separate processes would be).
//!
//! * `watch`: no lock; WATCH the market (and the buyer, or the lister's
//!   inventory), MULTI/EXEC, retried on abort, as the book does first.
//! * `coarse`: one `DistributedLock` on the whole market.
//! * `fine`: a `DistributedLock` per item.
//!
//! It prints the book's columns (items listed, items bought, purchase
//! retries, average wait per purchase), checks that funds and items balance
//! at the end, and shows the book's own 5 listers/5 buyers figures beside
//! ours. Without `--url` it starts a private redis-server.

use redmutex_test_support as support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use redis::{Commands, Connection, RedisResult};
use redmutex::Lease;
use redmutex::{DistributedLock, LockClient, LockOptions};

#[derive(Parser, Debug)]
#[command(
    about = "Redis in Action §6.2 market simulation: WATCH vs coarse lock vs fine-grained locks"
)]
struct Args {
    /// Seconds each simulation runs.
    #[arg(long, default_value_t = 60.0)]
    secs: f64,
    /// Which implementation to run.
    #[arg(long, value_enum, default_value_t = ModeArg::All)]
    mode: ModeArg,
    /// Loads as LISTERSxBUYERS, comma-separated.
    #[arg(long, default_value = "1x1,5x1,5x5")]
    load: String,
    /// Redis server to use instead of a private one. Only keys under
    /// `redmutex-market:*` are written, and they are deleted afterwards.
    #[arg(long)]
    url: Option<String>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ModeArg {
    All,
    Watch,
    Coarse,
    Fine,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Watch,
    Coarse,
    Fine,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Watch => "watch (no lock)",
            Mode::Coarse => "coarse lock",
            Mode::Fine => "fine-grained locks",
        }
    }

    /// The book's figures for 5 listers / 5 buyers over 60 s.
    fn book_5x5(self) -> &'static str {
        match self {
            Mode::Watch => "<600 bought, 161,000 retries, 498 ms wait",
            Mode::Coarse => "20,500 bought",
            Mode::Fine => "111,000 bought, <3 ms wait",
        }
    }
}

type Failure = Box<dyn std::error::Error + Send + Sync>;

/// Funds each buyer starts with: enough never to run out.
const BUYER_FUNDS: i64 = 1_000_000_000_000;

/// Key names of one simulation, all under one prefix.
#[derive(Clone)]
struct Keys {
    prefix: String,
}

impl Keys {
    fn market(&self) -> String {
        format!("{}:market", self.prefix)
    }
    fn user(&self, id: &str) -> String {
        format!("{}:users:{id}", self.prefix)
    }
    fn inventory(&self, id: &str) -> String {
        format!("{}:inventory:{id}", self.prefix)
    }
    fn market_lock(&self) -> String {
        format!("{}:lock:market", self.prefix)
    }
    fn item_lock(&self, listing: &str) -> String {
        format!("{}:lock:item:{listing}", self.prefix)
    }
}

#[derive(Default)]
struct Counters {
    created: AtomicU64,
    listed: AtomicU64,
    bought: AtomicU64,
    retries: AtomicU64,
    lost_races: AtomicU64,
    wait_us: AtomicU64,
}

fn main() -> Result<(), Failure> {
    let args = Args::parse();
    if !args.secs.is_finite() || args.secs <= 0.0 {
        return Err("--secs must be positive".into());
    }
    let loads = parse_loads(&args.load)?;
    let modes = match args.mode {
        ModeArg::All => vec![Mode::Watch, Mode::Coarse, Mode::Fine],
        ModeArg::Watch => vec![Mode::Watch],
        ModeArg::Coarse => vec![Mode::Coarse],
        ModeArg::Fine => vec![Mode::Fine],
    };
    let (_private, url) = support::server_or(args.url.as_deref());
    println!(
        "Redis in Action §6.2 market, {} s per run, Redis at {}\n",
        args.secs,
        if args.url.is_some() {
            "--url"
        } else {
            "a private redis-server"
        }
    );
    println!(
        "| listers/buyers | implementation | listed | bought | purchase retries | lost races | avg wait per purchase | balance | book, 5/5 over 60 s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut all_balanced = true;
    for &(listers, buyers) in &loads {
        for &mode in &modes {
            let keys = Keys {
                prefix: format!("redmutex-market:{listers}x{buyers}:{mode:?}"),
            };
            let counters = simulate(&url, &keys, mode, listers, buyers, args.secs)?;
            let balance = check_balance(&url, &keys, listers, buyers, &counters)?;
            all_balanced &= balance.is_ok();
            cleanup(&url, &keys)?;
            let bought = counters.bought.load(Ordering::Relaxed);
            let wait =
                Duration::from_micros(counters.wait_us.load(Ordering::Relaxed) / bought.max(1));
            println!(
                "| {listers}/{buyers} | {} | {} | {} | {} | {} | {} | {} | {} |",
                mode.name(),
                counters.listed.load(Ordering::Relaxed),
                bought,
                counters.retries.load(Ordering::Relaxed),
                counters.lost_races.load(Ordering::Relaxed),
                human(wait),
                match &balance {
                    Ok(()) => "funds ✓ items ✓".to_owned(),
                    Err(why) => format!("UNBALANCED: {why}"),
                },
                if (listers, buyers) == (5, 5) {
                    mode.book_5x5()
                } else {
                    ""
                },
            );
        }
    }
    println!(
        "\npurchase retries: EXEC aborts (WATCH only; a lock never retries). lost races: the \
         item was sold to another buyer before this one got to it."
    );
    if all_balanced {
        Ok(())
    } else {
        Err("funds or items did not balance".into())
    }
}

fn parse_loads(text: &str) -> Result<Vec<(usize, usize)>, Failure> {
    text.split(',')
        .map(|load| {
            let (l, b) = load
                .trim()
                .split_once('x')
                .ok_or_else(|| format!("--load wants LISTERSxBUYERS, got {load:?}"))?;
            let (l, b): (usize, usize) = (l.parse()?, b.parse()?);
            if l == 0 || b == 0 {
                return Err(
                    format!("--load needs at least one lister and one buyer: {load:?}").into(),
                );
            }
            Ok((l, b))
        })
        .collect()
}

fn human(d: Duration) -> String {
    if d < Duration::from_millis(1) {
        format!("{} µs", d.as_micros())
    } else {
        format!("{:.1} ms", d.as_secs_f64() * 1e3)
    }
}

fn connect(url: &str) -> RedisResult<Connection> {
    let con = redis::Client::open(url)?.get_connection()?;
    con.set_read_timeout(Some(Duration::from_secs(10)))?;
    Ok(con)
}

fn lock_options() -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(30))
}

/// Runs listers and buyers for `secs` and returns what they did.
fn simulate(
    url: &str,
    keys: &Keys,
    mode: Mode,
    listers: usize,
    buyers: usize,
    secs: f64,
) -> Result<Arc<Counters>, Failure> {
    cleanup(url, keys)?;
    let mut con = connect(url)?;
    for b in 0..buyers {
        let _: () = con.hset(keys.user(&format!("buyer{b}")), "funds", BUYER_FUNDS)?;
    }
    for l in 0..listers {
        let _: () = con.hset(keys.user(&format!("seller{l}")), "funds", 0)?;
    }
    let counters = Arc::new(Counters::default());
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let mut threads = Vec::new();
    for l in 0..listers {
        let (url, keys, counters) = (url.to_owned(), keys.clone(), counters.clone());
        threads.push(std::thread::spawn(move || {
            lister(&url, &keys, mode, &format!("seller{l}"), end, &counters)
        }));
    }
    for b in 0..buyers {
        let (url, keys, counters) = (url.to_owned(), keys.clone(), counters.clone());
        threads.push(std::thread::spawn(move || {
            buyer(&url, &keys, mode, &format!("buyer{b}"), end, &counters)
        }));
    }
    for thread in threads {
        thread
            .join()
            .map_err(|_| Failure::from("a market thread panicked"))??;
    }
    Ok(counters)
}

/// A small deterministic price sequence per thread (1..=100).
struct Prices(u64);

impl Prices {
    fn next(&mut self) -> i64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % 100 + 1) as i64
    }
}

fn lister(
    url: &str,
    keys: &Keys,
    mode: Mode,
    seller: &str,
    end: Instant,
    counters: &Counters,
) -> Result<(), Failure> {
    let mut con = connect(url)?;
    let locks = LockClient::open(url)?;
    let inventory = keys.inventory(seller);
    let mut prices =
        Prices(seller.len() as u64 * 7919 + seller.bytes().map(u64::from).sum::<u64>());
    let mut n = 0u64;
    while Instant::now() < end {
        // A new item arrives in the seller's inventory (untimed, not a market
        // operation). Named after its seller so every item is unique.
        let item = format!("{seller}-item{n}");
        n += 1;
        let _: () = con.sadd(&inventory, &item)?;
        counters.created.fetch_add(1, Ordering::Relaxed);
        let listing = format!("{item}.{seller}");
        let price = prices.next();
        let listed = match mode {
            Mode::Watch => list_watch(&mut con, keys, &inventory, &item, &listing, price)?,
            Mode::Coarse | Mode::Fine => under_lock(&locks, keys, mode, &listing, || {
                list_locked(&mut con, keys, &inventory, &item, &listing, price)
            })?,
        };
        if listed {
            counters.listed.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

/// The book's `list_item`: WATCH the inventory, check, MULTI/EXEC, retry on abort.
fn list_watch(
    con: &mut Connection,
    keys: &Keys,
    inventory: &str,
    item: &str,
    listing: &str,
    price: i64,
) -> RedisResult<bool> {
    loop {
        let _: () = redis::cmd("WATCH").arg(inventory).query(con)?;
        let owned: bool = con.sismember(inventory, item)?;
        if !owned {
            let _: () = redis::cmd("UNWATCH").query(con)?;
            return Ok(false);
        }
        let done: Option<(i64, i64)> =
            listing_moves(keys, inventory, item, listing, price).query(con)?;
        if done.is_some() {
            return Ok(true);
        }
    }
}

/// `list_item` under a lock: no WATCH, no retry.
fn list_locked(
    con: &mut Connection,
    keys: &Keys,
    inventory: &str,
    item: &str,
    listing: &str,
    price: i64,
) -> RedisResult<bool> {
    let owned: bool = con.sismember(inventory, item)?;
    if !owned {
        return Ok(false);
    }
    let _: (i64, i64) = listing_moves(keys, inventory, item, listing, price).query(con)?;
    Ok(true)
}

/// MULTI: the item leaves the inventory and is listed on the market.
fn listing_moves(
    keys: &Keys,
    inventory: &str,
    item: &str,
    listing: &str,
    price: i64,
) -> redis::Pipeline {
    let mut pipe = redis::pipe();
    pipe.atomic()
        .zadd(keys.market(), listing, price)
        .srem(inventory, item);
    pipe
}

/// Runs `operation` holding the market lock (coarse) or the listing's lock
/// (fine).
fn under_lock<T>(
    locks: &LockClient,
    keys: &Keys,
    mode: Mode,
    listing: &str,
    operation: impl FnOnce() -> RedisResult<T>,
) -> Result<T, Failure> {
    let key = if mode == Mode::Coarse {
        keys.market_lock()
    } else {
        keys.item_lock(listing)
    };
    let guard = DistributedLock::with_options(locks, key, lock_options()).lock()?;
    let outcome = operation()?;
    guard.unlock()?;
    Ok(outcome)
}

fn buyer(
    url: &str,
    keys: &Keys,
    mode: Mode,
    buyer: &str,
    end: Instant,
    counters: &Counters,
) -> Result<(), Failure> {
    let mut con = connect(url)?;
    let locks = LockClient::open(url)?;
    let user = keys.user(buyer);
    let inventory = keys.inventory(buyer);
    while Instant::now() < end {
        let picked: Vec<(String, i64)> = redis::cmd("ZRANDMEMBER")
            .arg(keys.market())
            .arg(1)
            .arg("WITHSCORES")
            .query(&mut con)?;
        let Some((listing, price)) = picked.into_iter().next() else {
            std::thread::sleep(Duration::from_millis(1)); // nothing listed yet
            continue;
        };
        let Some((item, seller)) = listing.split_once('.') else {
            return Err(format!("malformed listing {listing:?}").into());
        };
        let purchase = Purchase {
            keys,
            user: &user,
            inventory: &inventory,
            seller: &keys.user(seller),
            listing: &listing,
            item,
            price,
        };
        let started = Instant::now();
        let outcome = match mode {
            Mode::Watch => purchase.with_watch(&mut con, counters)?,
            Mode::Coarse | Mode::Fine => {
                under_lock(&locks, keys, mode, &listing, || purchase.locked(&mut con))?
            }
        };
        if outcome {
            counters.bought.fetch_add(1, Ordering::Relaxed);
            counters
                .wait_us
                .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        } else {
            counters.lost_races.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

/// One buyer's attempt at one listed item.
struct Purchase<'a> {
    keys: &'a Keys,
    user: &'a str,
    inventory: &'a str,
    seller: &'a str,
    listing: &'a str,
    item: &'a str,
    price: i64,
}

impl Purchase<'_> {
    /// Still listed at the price, and the buyer can pay.
    fn affordable(&self, con: &mut Connection) -> RedisResult<bool> {
        let listed: Option<i64> = con.zscore(self.keys.market(), self.listing)?;
        let funds: i64 = con.hget(self.user, "funds")?;
        Ok(listed == Some(self.price) && funds >= self.price)
    }

    fn transfer(&self) -> redis::Pipeline {
        let mut pipe = redis::pipe();
        pipe.atomic()
            .hincr(self.seller, "funds", self.price)
            .hincr(self.user, "funds", -self.price)
            .sadd(self.inventory, self.item)
            .zrem(self.keys.market(), self.listing);
        pipe
    }

    /// The book's `purchase_item`: WATCH the market and the buyer, check,
    /// MULTI/EXEC, retry on abort.
    fn with_watch(&self, con: &mut Connection, counters: &Counters) -> RedisResult<bool> {
        loop {
            let _: () = redis::cmd("WATCH")
                .arg(self.keys.market())
                .arg(self.user)
                .query(con)?;
            if !self.affordable(con)? {
                let _: () = redis::cmd("UNWATCH").query(con)?;
                return Ok(false);
            }
            let done: Option<(i64, i64, i64, i64)> = self.transfer().query(con)?;
            if done.is_some() {
                return Ok(true);
            }
            counters.retries.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `purchase_item_with_lock`: the caller holds the market or item lock.
    fn locked(&self, con: &mut Connection) -> RedisResult<bool> {
        if !self.affordable(con)? {
            return Ok(false);
        }
        let _: (i64, i64, i64, i64) = self.transfer().query(con)?;
        Ok(true)
    }
}

/// Funds must add up to what the buyers started with; every item created is
/// on the market or in exactly one inventory; every bought item is in a
/// buyer's inventory.
fn check_balance(
    url: &str,
    keys: &Keys,
    listers: usize,
    buyers: usize,
    counters: &Counters,
) -> Result<Result<(), String>, Failure> {
    let mut con = connect(url)?;
    let mut funds = 0i64;
    let mut in_inventories = 0u64;
    let mut bought_items = 0u64;
    for id in (0..listers)
        .map(|l| format!("seller{l}"))
        .chain((0..buyers).map(|b| format!("buyer{b}")))
    {
        let f: i64 = con.hget(keys.user(&id), "funds")?;
        funds += f;
        let n: u64 = con.scard(keys.inventory(&id))?;
        in_inventories += n;
        if id.starts_with("buyer") {
            bought_items += n;
        }
    }
    let on_market: u64 = con.zcard(keys.market())?;
    let created = counters.created.load(Ordering::Relaxed);
    let listed = counters.listed.load(Ordering::Relaxed);
    let bought = counters.bought.load(Ordering::Relaxed);
    let expected_funds = BUYER_FUNDS * buyers as i64;
    Ok(if funds != expected_funds {
        Err(format!("funds {funds} != {expected_funds}"))
    } else if on_market + in_inventories != created {
        Err(format!(
            "items: {on_market} listed + {in_inventories} in inventories != {created} created"
        ))
    } else if bought_items != bought || listed - bought != on_market {
        Err(format!(
            "{bought} bought but {bought_items} in buyers' inventories; {listed} listed, {on_market} on the market"
        ))
    } else {
        Ok(())
    })
}

/// Deletes every key of one simulation.
fn cleanup(url: &str, keys: &Keys) -> RedisResult<()> {
    let mut con = connect(url)?;
    let names: Vec<String> = con
        .scan_match(format!("{}:*", keys.prefix))?
        .collect::<RedisResult<_>>()?;
    for chunk in names.chunks(500) {
        let _: () = redis::cmd("UNLINK").arg(chunk).query(&mut con)?;
    }
    Ok(())
}
