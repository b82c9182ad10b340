//! The Lua scripts, compiled in from `lua/` and sent with `EVALSHA`.
//!
//! `redis::Script::invoke` tries `EVALSHA` and, when the server answers
//! `NOSCRIPT` (after `SCRIPT FLUSH` or a restart), loads the script and tries
//! again, so callers never see `NOSCRIPT`.

use std::sync::LazyLock;

use redis::Script;

/// `lua/acquire.lua`: SET NX PX GET, or the holder's PTTL. Returns `{1, 0}`
/// acquired or `{0, pttl}` held.
pub(crate) static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/acquire.lua")));

/// `lua/release.lua`: owner-checked delete and PUBLISH. Returns 1 released, 0 gone, -1 other owner.
pub(crate) static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/release.lua")));

/// `lua/extend.lua`: owner-checked PEXPIRE. Returns 1 extended, 0 gone, -1 other owner.
pub(crate) static EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/extend.lua")));

/// `lua/reentrant_acquire.lua`: HINCRBY the owner's count. Returns `{count, pttl}`.
pub(crate) static REENTRANT_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/reentrant_acquire.lua")));

/// `lua/reentrant_release.lua`: decrement, DEL at zero. Returns nil (not the
/// owner), -1 gone, 0 still held, 1 released.
pub(crate) static REENTRANT_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/reentrant_release.lua")));

/// `lua/reentrant_extend.lua`: owner-checked PEXPIRE. Returns 1, 0 gone, -1 other owner.
pub(crate) static REENTRANT_EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/reentrant_extend.lua")));

/// `lua/rw_acquire.lua`: read or write acquire. Returns `{acquired, wait_ms}`.
pub(crate) static RW_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/rw_acquire.lua")));

/// `lua/rw_release.lua`: remove this holder's field. Returns 1, 0 gone, -1 other writer.
pub(crate) static RW_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/rw_release.lua")));

/// Reads the common reply of the owner-checked scripts.
pub(crate) fn owner_checked(reply: i64) -> Result<(), crate::NotHeldReason> {
    match reply {
        1 => Ok(()),
        0 => Err(crate::NotHeldReason::Expired),
        _ => Err(crate::NotHeldReason::OwnedByOther),
    }
}
