//! The registry's pure state: live registrations, their leases, prefill groups and their fixed
//! topology. No HTTP, no clock of its own (every operation takes `now`), so it is unit-tested
//! directly.
//!
//! Invariants, re-established at the start of every operation by [`Registry::expire`]:
//! - no expired lease is visible (expired entries are removed and counted);
//! - each prefill `(dp_rank, tp_rank, pp_rank)` slot holds at most one instance, and a live
//!   lease is never taken over: another instance gets [`RegistryError::SlotHeld`] until the
//!   holder deregisters or its lease runs out (the registry never silently replaces a live
//!   rank). Decodes are never looked up by rank: each decode instance has a slot of its own,
//!   so any number of decode servers with identical configurations share ranks;
//! - a prefill group exists exactly while at least one prefill rank of its `dp_rank` is live,
//!   and every live member agrees with the topology and layout the group's first registration
//!   fixed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use uuid::Uuid;

use crate::types::{KvLayout, PrefillGroup, RankInfo, Registration, Role};

/// Why an operation on the registry was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// The registration is impossible on its own (rank >= size, empty slice, ...).
    #[error("invalid registration: {0}")]
    Invalid(String),
    /// The registration disagrees with its group or with this instance's earlier registration.
    #[error("{0}")]
    Conflict(String),
    /// The slot is held by another instance whose lease is live. A restarted rank meets its
    /// dead predecessor's lease here until it lapses; a second process started with the same
    /// ranks meets a holder that keeps renewing.
    #[error(
        "{role} dp_rank={dp_rank} tp_rank={tp_rank} pp_rank={pp_rank} is held by live instance {holder} \
         (lease {remaining_ms} ms left): the registry never replaces a live rank; retry after the \
         holder's lease lapses, or stop the other process"
    )]
    SlotHeld {
        /// The slot's role.
        role: Role,
        /// The slot's dp rank.
        dp_rank: u32,
        /// The slot's tp rank.
        tp_rank: u32,
        /// The slot's pp rank.
        pp_rank: u32,
        /// The instance holding the slot.
        holder: Uuid,
        /// What is left of the holder's lease, in ms.
        remaining_ms: u64,
    },
    /// No live registration has this instance id (never registered, expired or removed).
    #[error(
        "instance {0} is not registered (lease expired, deregistered or registry restarted): register again"
    )]
    UnknownInstance(Uuid),
    /// The prefill group is not complete yet; retry later.
    #[error(
        "prefill group dp_rank={dp_rank} incomplete: {registered} of {expected} ranks registered"
    )]
    Incomplete {
        /// The group asked for.
        dp_rank: u32,
        /// Live ranks of the group.
        registered: u32,
        /// `tp_size * pp_size` of the group, 0 when no rank registered yet.
        expected: u32,
    },
}

/// What a successful registration did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registered {
    /// A new instance took a free slot.
    New,
    /// The same instance registered again: its registration and lease are refreshed.
    Refreshed,
}

/// Counts for `/metrics` and `/healthz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RegistryStats {
    /// Live prefill registrations.
    pub prefill_ranks: u64,
    /// Live decode registrations.
    pub decode_ranks: u64,
    /// Prefill groups currently known.
    pub groups: u64,
    /// Accepted registrations since start (new and refreshing).
    pub registrations_total: u64,
    /// Leases that ran out since start.
    pub lease_expiries_total: u64,
}

/// A slot: at most one live instance holds each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct SlotKey {
    pub(crate) role: Role,
    pub(crate) dp_rank: u32,
    pub(crate) tp_rank: u32,
    pub(crate) pp_rank: u32,
    /// A decode's own instance: decodes sharing ranks never contend for a slot.
    pub(crate) decode: Option<Uuid>,
}

impl SlotKey {
    pub(crate) fn of(r: &Registration) -> Self {
        Self {
            role: r.role,
            dp_rank: r.dp_rank,
            tp_rank: r.tp_rank,
            pp_rank: r.pp_rank,
            decode: (r.role == Role::Decode).then_some(r.instance_id),
        }
    }
}

#[derive(Debug)]
struct Entry {
    registration: Registration,
    expires_at: Instant,
}

/// The topology a prefill group's first registration fixed, and its live members.
#[derive(Debug)]
struct Group {
    dp_size: u32,
    tp_size: u32,
    pp_size: u32,
    layout: KvLayout,
    /// `(pp_rank, tp_rank) -> instance`.
    members: BTreeMap<(u32, u32), Uuid>,
}

impl Group {
    fn fixed_by(r: &Registration) -> Self {
        Self {
            dp_size: r.dp_size,
            tp_size: r.tp_size,
            pp_size: r.pp_size,
            layout: r.layout,
            members: BTreeMap::new(),
        }
    }

    /// The first field on which `r` disagrees with the group, named with both values.
    fn conflict(&self, r: &Registration) -> Option<String> {
        let mine = Group::fixed_by(r);
        let numbers = [
            ("dp_size", mine.dp_size, self.dp_size),
            ("tp_size", mine.tp_size, self.tp_size),
            ("pp_size", mine.pp_size, self.pp_size),
            ("num_layers", mine.layout.num_layers, self.layout.num_layers),
            (
                "num_kv_heads",
                mine.layout.num_kv_heads,
                self.layout.num_kv_heads,
            ),
            ("head_dim", mine.layout.head_dim, self.layout.head_dim),
            ("page_size", mine.layout.page_size, self.layout.page_size),
        ];
        let clash = |field: &str, got: &dyn std::fmt::Display, fixed: &dyn std::fmt::Display| {
            format!(
                "prefill group dp_rank={}: {field} {got} conflicts with {fixed} fixed by the group's first registration",
                r.dp_rank
            )
        };
        if mine.layout.kind != self.layout.kind {
            return Some(clash("kind", &mine.layout.kind, &self.layout.kind));
        }
        if mine.layout.dtype != self.layout.dtype {
            return Some(clash("dtype", &mine.layout.dtype, &self.layout.dtype));
        }
        numbers
            .into_iter()
            .find(|(_, got, fixed)| got != fixed)
            .map(|(field, got, fixed)| clash(field, &got, &fixed))
    }

    fn expected(&self) -> u32 {
        self.tp_size.saturating_mul(self.pp_size)
    }
}

/// Live registrations with leases, and the prefill groups they form.
#[derive(Debug)]
pub struct Registry {
    ttl: Duration,
    entries: HashMap<Uuid, Entry>,
    slots: HashMap<SlotKey, Uuid>,
    groups: BTreeMap<u32, Group>,
    registrations_total: u64,
    lease_expiries_total: u64,
}

impl Registry {
    /// An empty registry granting leases of `ttl`.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            entries: HashMap::new(),
            slots: HashMap::new(),
            groups: BTreeMap::new(),
            registrations_total: 0,
            lease_expiries_total: 0,
        }
    }

    /// The lease length granted to every registration.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Removes every registration whose lease ran out by `now`; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let expired: Vec<Uuid> = self
            .entries
            .iter()
            .filter(|(_, e)| e.expires_at <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in &expired {
            if let Some(e) = self.remove_entry(*id) {
                tracing::info!(
                    instance_id = %id,
                    role = %e.registration.role,
                    dp_rank = e.registration.dp_rank,
                    tp_rank = e.registration.tp_rank,
                    pp_rank = e.registration.pp_rank,
                    "lease expired"
                );
            }
        }
        self.lease_expiries_total += expired.len() as u64;
        expired.len()
    }

    /// Registers (or refreshes) `r` with a lease starting at `now`.
    pub fn register(&mut self, r: Registration, now: Instant) -> Result<Registered, RegistryError> {
        self.expire(now);
        r.validate().map_err(|e| RegistryError::Invalid(e.0))?;
        let key = SlotKey::of(&r);
        if let Some(old) = self.entries.get(&r.instance_id)
            && SlotKey::of(&old.registration) != key
        {
            return Err(other_slot(r.instance_id, &SlotKey::of(&old.registration)));
        }
        let occupant = self.slots.get(&key).copied();
        if let Some(holder) = occupant.filter(|id| *id != r.instance_id) {
            // Expired leases were removed above: the holder is live.
            let remaining_ms = self.entries.get(&holder).map_or(0, |e| {
                millis(e.expires_at.saturating_duration_since(now)).max(1)
            });
            return Err(RegistryError::SlotHeld {
                role: key.role,
                dp_rank: key.dp_rank,
                tp_rank: key.tp_rank,
                pp_rank: key.pp_rank,
                holder,
                remaining_ms,
            });
        }
        if r.role == Role::Prefill
            && let Some(group) = self.groups.get(&r.dp_rank)
        {
            // The group's topology binds unless the only member is this very instance
            // registering again: then the group is being redeployed and `r` fixes it anew.
            let only_this_slot =
                group.members.len() == 1 && group.members.contains_key(&(r.pp_rank, r.tp_rank));
            if !only_this_slot && let Some(msg) = group.conflict(&r) {
                return Err(RegistryError::Conflict(msg));
            }
        }
        let outcome = match occupant {
            None => Registered::New,
            Some(_) => Registered::Refreshed,
        };
        if let Some(id) = occupant {
            self.remove_entry(id);
        }
        if r.role == Role::Prefill {
            let group = self
                .groups
                .entry(r.dp_rank)
                .or_insert_with(|| Group::fixed_by(&r));
            group.members.insert((r.pp_rank, r.tp_rank), r.instance_id);
        }
        self.slots.insert(key, r.instance_id);
        self.entries.insert(
            r.instance_id,
            Entry {
                registration: r,
                expires_at: now + self.ttl,
            },
        );
        self.registrations_total += 1;
        Ok(outcome)
    }

    /// Renews the lease of `instance_id` from `now`.
    pub fn heartbeat(&mut self, instance_id: Uuid, now: Instant) -> Result<(), RegistryError> {
        self.expire(now);
        let ttl = self.ttl;
        let entry = self
            .entries
            .get_mut(&instance_id)
            .ok_or(RegistryError::UnknownInstance(instance_id))?;
        entry.expires_at = now + ttl;
        Ok(())
    }

    /// Removes `instance_id` (no expiry counted).
    pub fn deregister(
        &mut self,
        instance_id: Uuid,
        now: Instant,
    ) -> Result<Registration, RegistryError> {
        self.expire(now);
        self.remove_entry(instance_id)
            .map(|e| e.registration)
            .ok_or(RegistryError::UnknownInstance(instance_id))
    }

    /// The prefill group `dp_rank` if all its `tp_size * pp_size` ranks are live.
    pub fn lookup_prefill(
        &mut self,
        dp_rank: u32,
        now: Instant,
    ) -> Result<PrefillGroup, RegistryError> {
        self.expire(now);
        let Some(group) = self.groups.get(&dp_rank) else {
            return Err(RegistryError::Incomplete {
                dp_rank,
                registered: 0,
                expected: 0,
            });
        };
        let registered = u32::try_from(group.members.len()).unwrap_or(u32::MAX);
        if registered < group.expected() {
            return Err(RegistryError::Incomplete {
                dp_rank,
                registered,
                expected: group.expected(),
            });
        }
        let ranks = group
            .members
            .values()
            .filter_map(|id| self.entries.get(id))
            .map(|e| e.registration.clone())
            .collect();
        Ok(PrefillGroup {
            dp_rank,
            dp_size: group.dp_size,
            tp_size: group.tp_size,
            pp_size: group.pp_size,
            layout: group.layout,
            ranks,
        })
    }

    /// Every live registration, prefill first, then by dp, pp, tp rank.
    pub fn list(&mut self, now: Instant) -> Vec<RankInfo> {
        self.expire(now);
        let mut ranks: Vec<RankInfo> = self
            .entries
            .values()
            .map(|e| RankInfo {
                registration: e.registration.clone(),
                lease_remaining_ms: millis(e.expires_at.saturating_duration_since(now)),
                unmatched: None,
            })
            .collect();
        ranks.sort_by_key(|i| {
            let r = &i.registration;
            (r.role, r.dp_rank, r.pp_rank, r.tp_rank)
        });
        ranks
    }

    /// Counts for metrics and health, after expiring leases run out by `now`.
    pub fn stats(&mut self, now: Instant) -> RegistryStats {
        self.expire(now);
        let prefill = self
            .entries
            .values()
            .filter(|e| e.registration.role == Role::Prefill)
            .count() as u64;
        RegistryStats {
            prefill_ranks: prefill,
            decode_ranks: self.entries.len() as u64 - prefill,
            groups: self.groups.len() as u64,
            registrations_total: self.registrations_total,
            lease_expiries_total: self.lease_expiries_total,
        }
    }

    /// Removes an entry from every index; forgets its group once the group is empty.
    fn remove_entry(&mut self, id: Uuid) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        let r = &entry.registration;
        let key = SlotKey::of(r);
        if self.slots.get(&key) == Some(&id) {
            self.slots.remove(&key);
        }
        if r.role == Role::Prefill
            && let Some(group) = self.groups.get_mut(&r.dp_rank)
        {
            if group.members.get(&(r.pp_rank, r.tp_rank)) == Some(&id) {
                group.members.remove(&(r.pp_rank, r.tp_rank));
            }
            if group.members.is_empty() {
                self.groups.remove(&r.dp_rank);
                tracing::info!(
                    dp_rank = r.dp_rank,
                    "prefill group forgotten: no live rank left"
                );
            }
        }
        Some(entry)
    }

    /// The dp ranks of the groups currently known (for tests and diagnostics).
    pub fn group_dp_ranks(&self) -> BTreeSet<u32> {
        self.groups.keys().copied().collect()
    }
}

/// The refusal of a registration because its instance already holds `old`, another slot.
pub(crate) fn other_slot(instance_id: Uuid, old: &SlotKey) -> RegistryError {
    RegistryError::Conflict(format!(
        "instance {instance_id} is already registered as {} dp_rank={} tp_rank={} pp_rank={}; \
         a process registers one slot (deregister it first)",
        old.role, old.dp_rank, old.tp_rank, old.pp_rank
    ))
}

/// The first field on which `r` disagrees with the prefill group whose topology `first` (the
/// group's first registration) fixed, as the [`RegistryError::Conflict`] to answer: the etcd
/// store's check (the memory store's is inside [`Registry::register`]).
#[cfg(feature = "etcd")]
pub(crate) fn group_conflict(first: &Registration, r: &Registration) -> Option<RegistryError> {
    Group::fixed_by(first)
        .conflict(r)
        .map(RegistryError::Conflict)
}

/// A duration in whole milliseconds, saturating.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{AttentionKind, Dtype, IndexRange, Slice};

    const TTL: Duration = Duration::from_secs(10);

    fn layout() -> KvLayout {
        KvLayout {
            kind: AttentionKind::Mha,
            num_layers: 61,
            num_kv_heads: 8,
            head_dim: 128,
            dtype: Dtype::Bf16,
            page_size: 16,
            order: None,
        }
    }

    /// Prefill rank `tp_rank`/`pp_rank` of a dp group with `tp` x `pp` ranks.
    fn rank(dp: u32, tp_rank: u32, tp: u32, pp_rank: u32, pp: u32) -> Registration {
        let heads = 8 / tp;
        Registration {
            instance_id: Uuid::new_v4(),
            role: Role::Prefill,
            dp_rank: dp,
            dp_size: 2,
            tp_rank,
            tp_size: tp,
            pp_rank,
            pp_size: pp,
            layout: layout(),
            slice: Slice {
                heads: IndexRange::new(tp_rank * heads, (tp_rank + 1) * heads),
                layers: if pp_rank == 0 {
                    IndexRange::new(0, 31)
                } else {
                    IndexRange::new(31, 61)
                },
            },
            control_endpoint: format!("tcp://p{tp_rank}-{pp_rank}:7000"),
            data_endpoints: BTreeMap::new(),
            about: Default::default(),
        }
    }

    #[test]
    fn group_is_incomplete_until_every_rank_registered() {
        let mut reg = Registry::new(TTL);
        let t0 = Instant::now();
        assert_eq!(
            reg.lookup_prefill(0, t0),
            Err(RegistryError::Incomplete {
                dp_rank: 0,
                registered: 0,
                expected: 0
            })
        );
        let ranks: Vec<_> = [(1, 0), (0, 0), (1, 1)]
            .iter()
            .map(|&(t, p)| rank(0, t, 2, p, 2))
            .collect();
        for r in &ranks {
            assert_eq!(reg.register(r.clone(), t0), Ok(Registered::New));
        }
        let err = reg.lookup_prefill(0, t0).unwrap_err();
        assert_eq!(
            err.to_string(),
            "prefill group dp_rank=0 incomplete: 3 of 4 ranks registered"
        );
        reg.register(rank(0, 0, 2, 1, 2), t0).unwrap();
        let g = reg.lookup_prefill(0, t0).unwrap();
        assert_eq!(g.ranks.len(), 4);
        let order: Vec<_> = g.ranks.iter().map(|r| (r.pp_rank, r.tp_rank)).collect();
        assert_eq!(order, vec![(0, 0), (0, 1), (1, 0), (1, 1)]);
        // Another dp group is independent.
        assert!(matches!(
            reg.lookup_prefill(1, t0),
            Err(RegistryError::Incomplete { .. })
        ));
    }

    #[test]
    fn expiry_hides_ranks_and_forgets_the_group() {
        let mut reg = Registry::new(TTL);
        let t0 = Instant::now();
        let a = rank(0, 0, 2, 0, 1);
        let b = rank(0, 1, 2, 0, 1);
        reg.register(a.clone(), t0).unwrap();
        reg.register(b.clone(), t0).unwrap();
        // b renews, a does not.
        reg.heartbeat(b.instance_id, t0 + TTL / 2).unwrap();
        let later = t0 + TTL + Duration::from_millis(1);
        assert!(matches!(
            reg.lookup_prefill(0, later),
            Err(RegistryError::Incomplete {
                registered: 1,
                expected: 2,
                ..
            })
        ));
        assert_eq!(
            reg.heartbeat(a.instance_id, later),
            Err(RegistryError::UnknownInstance(a.instance_id))
        );
        assert_eq!(reg.stats(later).lease_expiries_total, 1);
        // b expires too: the group is forgotten and another TP size registers cleanly.
        let much_later = t0 + TTL * 2;
        assert_eq!(reg.expire(much_later), 1);
        assert!(reg.group_dp_ranks().is_empty());
        let r = rank(0, 0, 4, 0, 1);
        assert_eq!(reg.register(r, much_later), Ok(Registered::New));
        let s = reg.stats(much_later);
        assert_eq!(
            (
                s.prefill_ranks,
                s.lease_expiries_total,
                s.registrations_total
            ),
            (1, 2, 3)
        );
    }

    #[test]
    fn conflicts_name_the_field_and_both_values() {
        let mut reg = Registry::new(TTL);
        let t0 = Instant::now();
        reg.register(rank(0, 0, 2, 0, 1), t0).unwrap();
        let mut r = rank(0, 1, 2, 0, 1);
        r.layout.page_size = 32;
        let err = reg.register(r, t0).unwrap_err();
        assert_eq!(
            err,
            RegistryError::Conflict(
                "prefill group dp_rank=0: page_size 32 conflicts with 16 fixed by the group's first registration".into()
            )
        );
        let mut r = rank(0, 1, 4, 0, 1);
        r.slice.heads = IndexRange::new(2, 4);
        assert!(
            reg.register(r, t0)
                .unwrap_err()
                .to_string()
                .contains("tp_size 4 conflicts with 2")
        );
        let mut r = rank(0, 1, 2, 0, 1);
        r.layout.dtype = Dtype::Fp8E5m2;
        assert!(
            reg.register(r, t0)
                .unwrap_err()
                .to_string()
                .contains("dtype fp8_e5m2 conflicts with bf16")
        );
        // Decode registrations are not grouped, so they never conflict with a prefill group,
        // and decodes of identical configuration share ranks.
        let mut d = rank(0, 0, 4, 0, 1);
        d.role = Role::Decode;
        d.slice.heads = IndexRange::new(0, 2);
        assert_eq!(reg.register(d.clone(), t0), Ok(Registered::New));
        let twin = Registration {
            instance_id: Uuid::new_v4(),
            ..d.clone()
        };
        assert_eq!(reg.register(twin, t0), Ok(Registered::New));
        assert_eq!(reg.register(d, t0), Ok(Registered::Refreshed));
        assert_eq!(reg.stats(t0).decode_ranks, 2);
        assert!(matches!(
            reg.lookup_prefill(0, t0),
            Err(RegistryError::Incomplete { registered: 1, .. })
        ));
    }

    #[test]
    fn live_slot_is_never_replaced_and_same_instance_refreshes() {
        let mut reg = Registry::new(TTL);
        let t0 = Instant::now();
        let old = rank(0, 0, 1, 0, 1);
        reg.register(old.clone(), t0).unwrap();
        let t1 = t0 + TTL / 2;
        let mut again = old.clone();
        again.control_endpoint = "tcp://moved:7000".into();
        assert_eq!(reg.register(again, t1), Ok(Registered::Refreshed));
        // Refresh extended the lease from t1.
        assert_eq!(
            reg.lookup_prefill(0, t0 + TTL).unwrap().ranks[0].control_endpoint,
            "tcp://moved:7000"
        );
        // Another instance meets the live lease: refused, naming the holder and its lease.
        let new = rank(0, 0, 1, 0, 1);
        let held = reg.register(new.clone(), t1 + TTL / 4).unwrap_err();
        assert_eq!(
            held,
            RegistryError::SlotHeld {
                role: Role::Prefill,
                dp_rank: 0,
                tp_rank: 0,
                pp_rank: 0,
                holder: old.instance_id,
                remaining_ms: millis(TTL * 3 / 4),
            }
        );
        assert!(
            held.to_string().contains(&old.instance_id.to_string()),
            "{held}"
        );
        assert_eq!(
            reg.lookup_prefill(0, t1).unwrap().ranks[0].instance_id,
            old.instance_id
        );
        assert!(reg.heartbeat(old.instance_id, t1 + TTL / 4).is_ok());
        // Once the holder's lease lapsed, the slot is free for the new instance, and the old
        // one is unknown (its client learns it was replaced).
        let lapsed = t1 + TTL / 4 + TTL;
        assert_eq!(reg.register(new.clone(), lapsed), Ok(Registered::New));
        assert_eq!(
            reg.lookup_prefill(0, lapsed).unwrap().ranks[0].instance_id,
            new.instance_id
        );
        assert_eq!(
            reg.heartbeat(old.instance_id, lapsed),
            Err(RegistryError::UnknownInstance(old.instance_id))
        );
        assert_eq!(reg.list(lapsed).len(), 1);
        // The sole member registering again with another layout fixes the group anew.
        let mut redeploy = new.clone();
        redeploy.layout.page_size = 64;
        assert_eq!(reg.register(redeploy, lapsed), Ok(Registered::Refreshed));
        assert_eq!(reg.lookup_prefill(0, lapsed).unwrap().layout.page_size, 64);
    }

    #[test]
    fn one_instance_cannot_hold_two_slots() {
        let mut reg = Registry::new(TTL);
        let t0 = Instant::now();
        let a = rank(0, 0, 2, 0, 1);
        reg.register(a.clone(), t0).unwrap();
        let mut moved = a.clone();
        moved.tp_rank = 1;
        assert!(matches!(
            reg.register(moved, t0),
            Err(RegistryError::Conflict(_))
        ));
        assert_eq!(reg.deregister(a.instance_id, t0).map(|r| r.tp_rank), Ok(0));
        assert!(reg.group_dp_ranks().is_empty());
        assert_eq!(
            reg.deregister(a.instance_id, t0),
            Err(RegistryError::UnknownInstance(a.instance_id))
        );
        assert_eq!(reg.stats(t0).lease_expiries_total, 0);
    }

    #[test]
    fn invalid_registrations_are_refused_before_touching_state() {
        let mut reg = Registry::new(TTL);
        let mut r = rank(0, 0, 2, 0, 1);
        r.tp_rank = 4;
        r.tp_size = 4;
        let err = reg.register(r, Instant::now()).unwrap_err();
        assert_eq!(
            err,
            RegistryError::Invalid("tp_rank 4 must be < tp_size 4".into())
        );
        assert_eq!(reg.stats(Instant::now()), RegistryStats::default());
    }
}
