//! Names derived from a lock key: the pub/sub channel its releases are
//! announced on, its fencing counter and its release markers; and the
//! client's namespace, a prefix every one of them starts with.
//!
//! The channel carries the key's Redis Cluster hash tag, so that it maps to
//! the key's slot (what sharded pub/sub needs): the key's own `{tag}` when it
//! has one, else the whole key wrapped in braces.

/// The part of `key` Redis Cluster hashes: the text between the first `{`
/// and the first `}` after it, when that is not empty.
pub(crate) fn hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let rest = &key[open + 1..];
    let close = rest.find('}')?;
    (close > 0).then(|| &rest[..close])
}

/// The Redis Cluster slot of `key` (0 to 16383): CRC16/XMODEM of its hash
/// tag, or of the whole key without one, as the server computes it.
pub(crate) fn slot(key: &str) -> u16 {
    let hashed = hash_tag(key).unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(hashed.as_bytes()) % 16384
}

/// The pub/sub channel releases of `key` are published on:
/// `redmutex:released:{KEY}`, or `redmutex:released:{TAG}:KEY` when the key
/// has a `{TAG}` hash tag (so the channel maps to the key's cluster slot).
pub(crate) fn release_channel(key: &str) -> String {
    match hash_tag(key) {
        Some(tag) => format!("redmutex:released:{{{tag}}}:{key}"),
        // A key with a stray `}` cannot be wrapped as a tag; such a channel is
        // still unique, only not slot-aligned.
        None if key.contains('}') => format!("redmutex:released:{key}"),
        None => format!("redmutex:released:{{{key}}}"),
    }
}

/// The key of `key`'s fencing counter, in the same hash slot: `{KEY}:fence`,
/// or `{TAG}:fence:KEY` when the key has a `{TAG}` hash tag.
pub(crate) fn fence_key(key: &str) -> String {
    match hash_tag(key) {
        Some(tag) => format!("{{{tag}}}:fence:{key}"),
        None if key.contains('}') => format!("redmutex:fence:{key}"),
        None => format!("{{{key}}}:fence"),
    }
}

/// The fair lock's queue of `key` (waiting tokens by ticket), and its
/// waiters' deadlines, in the key's hash slot: `{KEY}:fairq` and
/// `{KEY}:fairexp`, or `{TAG}:fairq:KEY` and `{TAG}:fairexp:KEY` when the
/// key has a `{TAG}`.
pub(crate) fn fair_keys(key: &str) -> (String, String) {
    let name = |what: &str| match hash_tag(key) {
        Some(tag) => format!("{{{tag}}}:{what}:{key}"),
        None if key.contains('}') => format!("redmutex:{what}:{key}"),
        None => format!("{{{key}}}:{what}"),
    };
    (name("fairq"), name("fairexp"))
}

/// The marker a release of `key` by `id` (a token or a hold id) leaves
/// behind, in the key's hash slot: `{KEY}:released:ID`, or
/// `{TAG}:released:KEY:ID` when the key has a `{TAG}`. `None` for a key
/// with `}` and no valid tag, which no other key can share a slot with
/// (its releases then leave no marker).
pub(crate) fn release_marker(key: &str, id: &str) -> Option<String> {
    match hash_tag(key) {
        Some(tag) => Some(format!("{{{tag}}}:released:{key}:{id}")),
        None if key.contains('}') => None,
        None => Some(format!("{{{key}}}:released:{id}")),
    }
}

/// [`release_marker`], or on a single server (where slots do not matter)
/// `redmutex:released:KEY:ID` for a key that has none.
pub(crate) fn marker_anywhere(key: &str, id: &str) -> String {
    release_marker(key, id).unwrap_or_else(|| format!("redmutex:released:{key}:{id}"))
}

/// Whether `name` (without the client's prefix) is one of the names the
/// crate derives from a lock key, not a lock: a fencing counter or a
/// release marker (a forced release's marker holds a token, so its value
/// alone would pass for a lock).
pub(crate) fn is_auxiliary(name: &str) -> bool {
    name.starts_with("redmutex:released:")
        || name.starts_with("redmutex:fence:")
        || name.starts_with("redmutex:fairq:")
        || name.starts_with("redmutex:fairexp:")
        || name.contains("}:fairq")
        || name.contains("}:fairexp")
        || name.contains("}:released:")
        || name.contains("}:fence:")
        || name.ends_with("}:fence")
}

/// Whether [`fence_key`] of `key` hashes to `key`'s cluster slot.
pub(crate) fn same_slot_fence(key: &str) -> bool {
    hash_tag(key).is_some() || !key.contains('}')
}

/// A client's key prefix, and every name the crate derives with it.
///
/// Invariant: with a prefix `P`, the lock named `K` is the key `P K`, and
/// each auxiliary name is `P` followed by the name derived from `P K` as
/// without a prefix. So every key and channel starts with `P` (one ACL
/// pattern `~P*` / `&P*` covers them), and each auxiliary name keeps the
/// hash tag of `P K`, its cluster slot: `P` holds no brace, so the first
/// `{` of an auxiliary name is the derived name's own. Without a prefix,
/// names are exactly those of [`release_channel`], [`fence_key`] and
/// [`release_marker`], so fencing counters of existing deployments carry
/// on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Namespace {
    prefix: String,
}

impl Namespace {
    /// A namespace, or why `prefix` cannot be one.
    pub(crate) fn new(prefix: &str) -> Result<Namespace, String> {
        if prefix.contains(['{', '}']) {
            return Err(format!(
                "the key prefix may not contain '{{' or '}}' (it would change which cluster \
                 slot the keys and their auxiliary keys map to), got {prefix:?}"
            ));
        }
        Ok(Namespace {
            prefix: prefix.to_owned(),
        })
    }

    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    /// [`Namespace::key`], reusing `name`'s allocation without a prefix.
    /// An empty name stays empty, so the lock types refuse it as they do
    /// without a prefix (rather than lock the bare prefix).
    pub(crate) fn own_key(&self, name: String) -> String {
        if self.prefix.is_empty() || name.is_empty() {
            return name;
        }
        self.key(&name)
    }

    /// The key in Redis of the lock named `name`.
    pub(crate) fn key(&self, name: &str) -> String {
        let mut key = String::with_capacity(self.prefix.len() + name.len());
        key.push_str(&self.prefix);
        key.push_str(name);
        key
    }

    /// [`release_channel`] of `key` (a key of this namespace), prefixed.
    pub(crate) fn release_channel(&self, key: &str) -> String {
        self.prefixed(release_channel(key))
    }

    /// [`fair_keys`] of `key`, prefixed.
    pub(crate) fn fair_keys(&self, key: &str) -> (String, String) {
        let (queue, deadlines) = fair_keys(key);
        (self.prefixed(queue), self.prefixed(deadlines))
    }

    /// [`fence_key`] of `key`, prefixed.
    pub(crate) fn fence_key(&self, key: &str) -> String {
        self.prefixed(fence_key(key))
    }

    /// [`release_marker`] of `key` and `id`, prefixed.
    #[cfg(test)]
    pub(crate) fn release_marker(&self, key: &str, id: &str) -> Option<String> {
        release_marker(key, id).map(|name| self.prefixed(name))
    }

    /// [`marker_anywhere`] of `key` and `id`, prefixed.
    pub(crate) fn marker_anywhere(&self, key: &str, id: &str) -> String {
        self.prefixed(marker_anywhere(key, id))
    }

    /// [`Namespace::release_marker`] of `key` and `id` (with `anywhere`,
    /// [`Namespace::marker_anywhere`]) written into `out`, whose
    /// allocation the caller keeps for the next one; false, and `out`
    /// empty, when there is none.
    pub(crate) fn write_marker(
        &self,
        out: &mut String,
        key: &str,
        id: &str,
        anywhere: bool,
    ) -> bool {
        out.clear();
        out.push_str(&self.prefix);
        let pieces: [&str; 6] = match hash_tag(key) {
            Some(tag) => ["{", tag, "}:released:", key, ":", id],
            None if key.contains('}') && !anywhere => {
                out.clear();
                return false;
            }
            None if key.contains('}') => ["redmutex:released:", key, ":", id, "", ""],
            None => ["{", key, "}:released:", id, "", ""],
        };
        for piece in pieces {
            out.push_str(piece);
        }
        true
    }

    fn prefixed(&self, name: String) -> String {
        if self.prefix.is_empty() {
            return name;
        }
        let mut prefixed = String::with_capacity(self.prefix.len() + name.len());
        prefixed.push_str(&self.prefix);
        prefixed.push_str(&name);
        prefixed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_marker_is_the_formatted_one() {
        let mut out = String::from("left over");
        for prefix in ["", "team:"] {
            let names = Namespace::new(prefix).expect("a valid prefix");
            for key in ["job", "{tag}job", "a}b", "{}x", "}{x}", ""] {
                assert_eq!(
                    names.write_marker(&mut out, key, "id", false),
                    names.release_marker(key, "id").is_some()
                );
                assert_eq!(out, names.release_marker(key, "id").unwrap_or_default());
                assert!(names.write_marker(&mut out, key, "id", true));
                assert_eq!(out, names.marker_anywhere(key, "id"));
            }
        }
    }
    use redis::cluster_routing::Slot;

    /// redis-rs's own slot computation, as its cluster routing uses it.
    fn slot(key: &str) -> Slot {
        Slot::for_key(key)
    }

    #[test]
    fn auxiliary_names_share_the_key_slot() {
        assert_eq!(slot("user:{42}:lock"), slot("42"));
        for key in ["a", "jobs:nightly", "{x}y", "{a}}b", "a{b}}"] {
            assert!(same_slot_fence(key));
            assert_eq!(slot(&fence_key(key)), slot(key), "{key}");
            assert_eq!(slot(&release_channel(key)), slot(key), "{key}");
        }
        for key in ["a}b", "x{}y"] {
            assert!(!same_slot_fence(key), "{key}");
        }
    }

    #[test]
    fn slots_are_the_ones_the_server_and_redis_rs_compute() {
        // CLUSTER KEYSLOT's answers.
        use crate::script::names::slot as slot_of;
        assert_eq!(slot_of("foo"), 12182);
        assert_eq!(
            slot_of("{user1000}.following"),
            slot_of("{user1000}.followers")
        );
        for key in ["foo", "bar", "{a}x", "a{}b{c}", "open{only", "", "k\u{e9}y"] {
            assert_eq!(
                redis::cluster_routing::Slot::new(slot_of(key)),
                Some(redis::cluster_routing::Slot::for_key(key)),
                "{key:?}"
            );
        }
    }

    #[test]
    fn hash_tags_follow_redis_cluster_rules() {
        assert_eq!(hash_tag("user:{42}:lock"), Some("42"));
        assert_eq!(hash_tag("{a}{b}"), Some("a"));
        assert_eq!(
            hash_tag("a{}b{c}"),
            None,
            "an empty first tag hashes the whole key"
        );
        assert_eq!(hash_tag("plain"), None);
        assert_eq!(hash_tag("open{only"), None);
    }

    #[test]
    fn channels_share_the_keys_tag() {
        assert_eq!(
            release_channel("jobs:nightly"),
            "redmutex:released:{jobs:nightly}"
        );
        assert_eq!(
            hash_tag(&release_channel("jobs:nightly")),
            Some("jobs:nightly")
        );
        assert_eq!(
            release_channel("user:{42}:lock"),
            "redmutex:released:{42}:user:{42}:lock"
        );
        assert_eq!(hash_tag(&release_channel("user:{42}:lock")), Some("42"));
        assert_eq!(release_channel("odd}key"), "redmutex:released:odd}key");
        assert_ne!(release_channel("a"), release_channel("b"));
    }

    #[test]
    fn derived_names_are_told_apart_from_locks() {
        for key in ["jobs:x", "{tag}:x", "odd}key"] {
            assert!(is_auxiliary(&fence_key(key)), "{key}");
            assert!(is_auxiliary(&marker_anywhere(key, "id")), "{key}");
            assert!(!is_auxiliary(key), "{key}");
        }
    }

    #[test]
    fn release_markers_share_the_keys_slot() {
        assert_eq!(
            release_marker("jobs:nightly", "t1").as_deref(),
            Some("{jobs:nightly}:released:t1")
        );
        assert_eq!(
            release_marker("user:{42}:lock", "t1").as_deref(),
            Some("{42}:released:user:{42}:lock:t1")
        );
        for key in ["a", "jobs:nightly", "{x}y", "{a}}b", "a{b}}"] {
            let marker = release_marker(key, "t").expect("a marker");
            assert_eq!(slot(&marker), slot(key), "{key}");
            assert_ne!(marker, fence_key(key));
        }
        assert_eq!(release_marker("a}b", "t"), None);
        assert_ne!(release_marker("a", "t1"), release_marker("a", "t2"));
    }

    #[test]
    fn fence_counters_share_the_keys_slot() {
        assert_eq!(fence_key("jobs:nightly"), "{jobs:nightly}:fence");
        assert_eq!(hash_tag(&fence_key("jobs:nightly")), Some("jobs:nightly"));
        assert_eq!(fence_key("user:{42}:lock"), "{42}:fence:user:{42}:lock");
        assert_eq!(hash_tag(&fence_key("user:{42}:lock")), Some("42"));
        assert_ne!(fence_key("a"), fence_key("b"));
    }

    #[test]
    fn a_namespace_prefixes_every_name_and_keeps_the_slot() {
        let none = Namespace::default();
        assert_eq!(none.key("job"), "job");
        assert_eq!(none.fence_key("job"), fence_key("job"));
        assert_eq!(none.release_channel("job"), release_channel("job"));
        assert_eq!(none.release_marker("job", "t"), release_marker("job", "t"));

        let team = Namespace::new("teamA:").expect("a valid prefix");
        let key = team.key("job");
        assert_eq!(key, "teamA:job");
        assert_eq!(
            team.own_key(String::new()),
            "",
            "refused like without a prefix"
        );
        assert_eq!(team.fence_key(&key), "teamA:{teamA:job}:fence");
        assert_eq!(
            team.release_channel(&key),
            "teamA:redmutex:released:{teamA:job}"
        );
        for name in ["job", "user:{42}:lock", "{x}y", "a{b}}", "odd}key"] {
            let key = team.key(name);
            let names = [
                team.fence_key(&key),
                team.release_channel(&key),
                team.marker_anywhere(&key, "t"),
            ];
            for derived in names {
                assert!(derived.starts_with("teamA:"), "{derived}");
                if same_slot_fence(&key) {
                    assert_eq!(slot(&derived), slot(&key), "{derived} vs {key}");
                }
            }
            if let Some(marker) = team.release_marker(&key, "t") {
                assert_eq!(slot(&marker), slot(&key), "{marker}");
            }
        }
    }

    #[test]
    fn a_prefix_with_a_brace_is_refused() {
        for prefix in ["{team}:", "a}", "x{"] {
            assert!(Namespace::new(prefix).is_err(), "{prefix}");
        }
        assert!(Namespace::new("").is_ok());
    }
}
