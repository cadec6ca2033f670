//! The etcd store: all registry state lives in an etcd v3 cluster, so any number of registry
//! replicas on the same cluster serve one view, and any replica (or a minority of etcd
//! members) may die.
//!
//! Keys (under [`PREFIX`]):
//! - `slots/prefill/{dp:010}/{pp:010}/{tp:010}` -> the registration (JSON). At most one per
//!   slot; the zero-padded ranks make a prefill group one key range, listed in `(pp, tp)`
//!   order. A decode's slot ends with its instance, `slots/decode/{dp}/{pp}/{tp}/{uuid}`:
//!   decodes sharing ranks never contend;
//! - `instances/{uuid}` -> the instance's slot key, so a heartbeat or a deregistration by
//!   instance id finds its slot and lease.
//!
//! Leases are etcd leases: a registration's two keys are attached to one etcd lease of the
//! registry's lease length (rounded up to whole seconds); a heartbeat is a lease keep-alive;
//! expiry is etcd deleting the keys; a deregistration revokes the lease. A prefill group is
//! derived from its slot keys: it exists while one of them does, and its topology is that of
//! its oldest live member (smallest create revision), which every member agrees with.
//!
//! Atomicity across replicas: a registration reads the slot, the instance and (prefill) the
//! group at one revision, decides as [`Registry::register`](crate::registry::Registry::register)
//! does, then writes in one transaction guarded by what it read (the slot and instance keys
//! unchanged, `create_revision == 0` when absent; no key of the group modified since the read).
//! Of two replicas racing for a free slot exactly one transaction succeeds; the other reads
//! again and answers [`RegistryError::SlotHeld`].
//!
//! Every operation is bounded by [`OP_TIMEOUT`]: transient failures (an etcd member down, a
//! leader election, a lost race) are retried until then, after which the operation fails
//! with [`StoreError::Unavailable`], naming the endpoints (the last etcd error is logged, not
//! sent to clients).

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, GetResponse, KeyValue, PutOptions, Txn,
    TxnOp, TxnOpResponse,
};
use uuid::Uuid;

use super::{Store, StoreError};
use crate::registry::{
    Registered, RegistryError, RegistryStats, SlotKey, group_conflict, millis, other_slot,
};
use crate::types::{PrefillGroup, RankInfo, Registration, Role};

/// Every key of the registry starts with this.
pub const PREFIX: &str = "/kvferry/bootstrap/";
/// The longest one store operation may take, retries included; then it is a 503. Below the
/// client's request timeout, so a client learns the 503 (and tries another replica) rather
/// than timing out.
pub const OP_TIMEOUT: Duration = Duration::from_secs(3);
/// The longest one etcd call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest a connection to one etcd member may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// The pause before retrying a transient failure.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// Registry state in etcd.
pub struct EtcdStore {
    client: Client,
    endpoints: String,
    ttl: Duration,
    lease_secs: i64,
    registrations_total: AtomicU64,
}

impl fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.endpoints)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

/// How one attempt at an operation ended, when not with a result.
enum Attempt {
    /// The registry refuses: final, the same answer as the memory store's.
    Refused(RegistryError),
    /// Etcd failed or the state moved under us: try again until the deadline.
    Retry(String),
    /// Etcd holds something this store cannot read: final, a 503.
    Broken(String),
}

impl From<etcd_client::Error> for Attempt {
    fn from(e: etcd_client::Error) -> Self {
        Attempt::Retry(e.to_string())
    }
}

impl From<RegistryError> for Attempt {
    fn from(e: RegistryError) -> Self {
        Attempt::Refused(e)
    }
}

impl EtcdStore {
    /// A store on the etcd cluster at `endpoints` (`http://H:P`), granting leases of `ttl`.
    /// Connections open lazily: an unreachable cluster shows as 503s, not as an error here.
    pub async fn connect(endpoints: &[String], ttl: Duration) -> Result<Self, StoreError> {
        let joined = endpoints.join(",");
        let unavailable = |message: String| StoreError::Unavailable {
            op: "connect",
            message,
        };
        let options = ConnectOptions::new()
            .with_connect_timeout(CONNECT_TIMEOUT)
            .with_timeout(CALL_TIMEOUT)
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            // A member cut off from the quorum answers at once instead of holding a call
            // until its timeout.
            .with_require_leader(true);
        let client = tokio::time::timeout(OP_TIMEOUT, Client::connect(endpoints, Some(options)))
            .await
            .map_err(|_| {
                unavailable(format!(
                    "etcd at {joined}: no connection within {OP_TIMEOUT:?}"
                ))
            })?
            .map_err(|e| unavailable(format!("etcd at {joined}: {e}")))?;
        let lease_secs = i64::try_from(ttl.as_millis().div_ceil(1000))
            .unwrap_or(i64::MAX)
            .max(1);
        Ok(Self {
            client,
            endpoints: joined,
            ttl,
            lease_secs,
            registrations_total: AtomicU64::new(0),
        })
    }

    /// Runs `attempt` until it succeeds or is refused, retrying transient failures, all within
    /// [`OP_TIMEOUT`].
    async fn run<T, F, Fut>(&self, op: &'static str, mut attempt: F) -> Result<T, StoreError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, Attempt>>,
    {
        let deadline = tokio::time::Instant::now() + OP_TIMEOUT;
        let mut attempts = 0u32;
        let mut last = String::from("no answer");
        loop {
            attempts += 1;
            match tokio::time::timeout_at(deadline, attempt(self.client.clone())).await {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(Attempt::Refused(e))) => return Err(e.into()),
                Ok(Err(Attempt::Broken(message))) => {
                    return Err(StoreError::Unavailable { op, message });
                }
                Ok(Err(Attempt::Retry(message))) => last = message,
                Err(_) => break,
            }
            if tokio::time::Instant::now() + RETRY_PAUSE >= deadline {
                break;
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
        tracing::warn!(op, endpoints = %self.endpoints, attempts, last_error = %last, "etcd did not serve the operation in time");
        Err(StoreError::Unavailable {
            op,
            message: format!(
                "etcd at {} did not serve it within {} ms ({attempts} attempts; the registry's log has the last error)",
                self.endpoints,
                millis(OP_TIMEOUT)
            ),
        })
    }

    async fn try_register(&self, mut c: Client, r: &Registration) -> Result<Registered, Attempt> {
        let slot = SlotKey::of(r);
        let slot_key = slot_key(&slot);
        let instance_key = instance_key(r.instance_id);
        let group = (r.role == Role::Prefill).then(|| group_prefix(r.dp_rank));
        // One snapshot: the slot, the instance, and the group's members at one revision.
        let mut reads = vec![
            TxnOp::get(slot_key.clone(), None),
            TxnOp::get(instance_key.clone(), None),
        ];
        if let Some(prefix) = &group {
            reads.push(TxnOp::get(
                prefix.clone(),
                Some(GetOptions::new().with_prefix()),
            ));
        }
        let snapshot = bounded(c.txn(Txn::new().and_then(reads))).await?;
        let revision = snapshot
            .header()
            .map(|h| h.revision())
            .ok_or_else(|| Attempt::Retry("etcd answered without a revision".to_owned()))?;
        let gets: Vec<GetResponse> = snapshot
            .op_responses()
            .into_iter()
            .filter_map(|op| match op {
                TxnOpResponse::Get(g) => Some(g),
                _ => None,
            })
            .collect();
        let first_kv = |i: usize| gets.get(i).and_then(|g| g.kvs().first().cloned());
        let (slot_kv, instance_kv) = (first_kv(0), first_kv(1));
        let members: Vec<KeyValue> = gets.get(2).map(|g| g.kvs().to_vec()).unwrap_or_default();

        if let Some(kv) = &instance_kv {
            let held = kv.value_str().unwrap_or_default();
            if held != slot_key {
                let old = parse_slot_key(held)
                    .ok_or_else(|| broken(format!("instance key {instance_key}"), held))?;
                return Err(other_slot(r.instance_id, &old).into());
            }
        }
        let outcome = match &slot_kv {
            None => Registered::New,
            Some(kv) => {
                let holder = registration(kv)?;
                if holder.instance_id != r.instance_id {
                    let left = bounded(c.lease_time_to_live(kv.lease(), None)).await?.ttl();
                    let Some(remaining_ms) = self.remaining_ms(left) else {
                        return Err(Attempt::Retry("the holder's lease just lapsed".to_owned()));
                    };
                    return Err(RegistryError::SlotHeld {
                        role: slot.role,
                        dp_rank: slot.dp_rank,
                        tp_rank: slot.tp_rank,
                        pp_rank: slot.pp_rank,
                        holder: holder.instance_id,
                        remaining_ms,
                    }
                    .into());
                }
                Registered::Refreshed
            }
        };
        // The group's topology binds unless the only member is this very slot registering
        // again: then the group is being redeployed and `r` fixes it anew.
        let only_this_slot = members.len() == 1 && members[0].key() == slot_key.as_bytes();
        if !only_this_slot
            && let Some(first) = members.iter().min_by_key(|kv| kv.create_revision())
            && let Some(e) = group_conflict(&registration(first)?, r)
        {
            return Err(e.into());
        }

        let lease = bounded(c.lease_grant(self.lease_secs, None)).await?.id();
        let unchanged = |key: &str, kv: &Option<KeyValue>| match kv {
            Some(kv) => Compare::mod_revision(key, CompareOp::Equal, kv.mod_revision()),
            None => Compare::create_revision(key, CompareOp::Equal, 0),
        };
        let mut guards = vec![
            unchanged(&slot_key, &slot_kv),
            unchanged(&instance_key, &instance_kv),
        ];
        if let Some(prefix) = group {
            guards.push(Compare::mod_revision(prefix, CompareOp::Less, revision + 1).with_prefix());
        }
        let value = serde_json::to_vec(r).map_err(|e| Attempt::Broken(e.to_string()))?;
        let with_lease = || Some(PutOptions::new().with_lease(lease));
        let writes = vec![
            TxnOp::put(slot_key.clone(), value, with_lease()),
            TxnOp::put(instance_key, slot_key, with_lease()),
        ];
        let committed = bounded(c.txn(Txn::new().when(guards).and_then(writes))).await?;
        // The lease that no key uses any more (ours after a lost race, the previous one after
        // a refresh) is revoked; if that fails it lapses by itself, holding nothing.
        let unused = match (&slot_kv, committed.succeeded()) {
            (_, false) => Some(lease),
            (Some(kv), true) => Some(kv.lease()),
            (None, true) => None,
        };
        if let Some(id) = unused
            && let Err(e) = bounded(c.lease_revoke(id)).await.map_err(attempt_text)
        {
            tracing::debug!(lease = id, error = %e, "revoking an unused lease failed; it lapses by itself");
        }
        if !committed.succeeded() {
            return Err(Attempt::Retry(
                "the slot or its group changed during the registration".to_owned(),
            ));
        }
        self.registrations_total.fetch_add(1, Ordering::Relaxed);
        Ok(outcome)
    }

    async fn try_heartbeat(mut c: Client, instance_id: Uuid) -> Result<(), Attempt> {
        let found = bounded(c.get(instance_key(instance_id), None)).await?;
        let Some(kv) = found.kvs().first() else {
            return Err(RegistryError::UnknownInstance(instance_id).into());
        };
        let renewed = tokio::time::timeout(CALL_TIMEOUT, c.lease_keep_alive(kv.lease())).await;
        match renewed {
            Ok(Ok(_)) => Ok(()),
            // The lease lapsed between the read and the keep-alive.
            Ok(Err(etcd_client::Error::LeaseKeepAliveError(_))) => {
                Err(RegistryError::UnknownInstance(instance_id).into())
            }
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err(no_answer()),
        }
    }

    async fn try_deregister(mut c: Client, instance_id: Uuid) -> Result<Registration, Attempt> {
        let found = bounded(c.get(instance_key(instance_id), None)).await?;
        let Some(kv) = found.kvs().first() else {
            return Err(RegistryError::UnknownInstance(instance_id).into());
        };
        let slot = bounded(c.get(kv.value().to_vec(), None)).await?;
        let Some(slot_kv) = slot.kvs().first() else {
            return Err(RegistryError::UnknownInstance(instance_id).into());
        };
        let r = registration(slot_kv)?;
        if r.instance_id != instance_id || slot_kv.lease() != kv.lease() {
            return Err(Attempt::Retry(
                "the slot changed during the deregistration".to_owned(),
            ));
        }
        bounded(c.lease_revoke(kv.lease())).await?;
        Ok(r)
    }

    async fn try_lookup(mut c: Client, dp_rank: u32) -> Result<PrefillGroup, Attempt> {
        let found =
            bounded(c.get(group_prefix(dp_rank), Some(GetOptions::new().with_prefix()))).await?;
        let members = found
            .kvs()
            .iter()
            .map(|kv| registration(kv).map(|r| (kv.create_revision(), r)))
            .collect::<Result<Vec<_>, _>>()?;
        let Some((_, first)) = members.iter().min_by_key(|(rev, _)| *rev) else {
            return Err(RegistryError::Incomplete {
                dp_rank,
                registered: 0,
                expected: 0,
            }
            .into());
        };
        let expected = first.tp_size.saturating_mul(first.pp_size);
        let registered = u32::try_from(members.len()).unwrap_or(u32::MAX);
        if registered < expected {
            return Err(RegistryError::Incomplete {
                dp_rank,
                registered,
                expected,
            }
            .into());
        }
        let (dp_size, tp_size, pp_size, layout) =
            (first.dp_size, first.tp_size, first.pp_size, first.layout);
        Ok(PrefillGroup {
            dp_rank,
            dp_size,
            tp_size,
            pp_size,
            layout,
            // Keys are in (pp, tp) order.
            ranks: members.into_iter().map(|(_, r)| r).collect(),
        })
    }

    /// The lease time left to announce for `left_secs`, what etcd says is left of a lease
    /// (whole seconds, rounded down; negative once the lease is gone): rounded up, at most
    /// the lease length, at least 1 ms. None when the lease is gone.
    fn remaining_ms(&self, left_secs: i64) -> Option<u64> {
        let left = u64::try_from(left_secs).ok()?;
        Some(
            left.saturating_add(1)
                .saturating_mul(1000)
                .min(millis(self.ttl))
                .max(1),
        )
    }

    async fn try_list(&self, mut c: Client) -> Result<Vec<RankInfo>, Attempt> {
        let found = bounded(c.get(
            PREFIX.to_owned() + "slots/",
            Some(GetOptions::new().with_prefix()),
        ))
        .await?;
        let leases: BTreeSet<i64> = found.kvs().iter().map(KeyValue::lease).collect();
        let lefts = futures_util::future::join_all(leases.iter().map(|&id| {
            let mut c = c.clone();
            async move {
                let left = bounded(c.lease_time_to_live(id, None)).await?.ttl();
                Ok::<_, Attempt>((id, left))
            }
        }))
        .await
        .into_iter()
        .collect::<Result<HashMap<i64, i64>, _>>()?;
        let mut ranks = Vec::with_capacity(found.kvs().len());
        for kv in found.kvs() {
            let left = lefts.get(&kv.lease()).copied().unwrap_or(-1);
            // None: lapsed since the read.
            if let Some(lease_remaining_ms) = self.remaining_ms(left) {
                ranks.push(RankInfo {
                    registration: registration(kv)?,
                    lease_remaining_ms,
                    unmatched: None,
                });
            }
        }
        ranks.sort_by_key(|i| {
            let r = &i.registration;
            (r.role, r.dp_rank, r.pp_rank, r.tp_rank)
        });
        Ok(ranks)
    }

    async fn try_stats(&self, mut c: Client) -> Result<RegistryStats, Attempt> {
        let options = GetOptions::new().with_prefix().with_keys_only();
        let found = bounded(c.get(PREFIX.to_owned() + "slots/", Some(options))).await?;
        let mut stats = RegistryStats {
            registrations_total: self.registrations_total.load(Ordering::Relaxed),
            ..RegistryStats::default()
        };
        let mut groups = BTreeSet::new();
        for kv in found.kvs() {
            let key = kv.key_str().unwrap_or_default();
            let slot = parse_slot_key(key).ok_or_else(|| broken("slot key".to_owned(), key))?;
            match slot.role {
                Role::Prefill => {
                    stats.prefill_ranks += 1;
                    groups.insert(slot.dp_rank);
                }
                Role::Decode => stats.decode_ranks += 1,
            }
        }
        stats.groups = groups.len() as u64;
        Ok(stats)
    }
}

impl Store for EtcdStore {
    fn ttl(&self) -> Duration {
        self.ttl
    }

    async fn register(&self, r: Registration) -> Result<Registered, StoreError> {
        r.validate().map_err(|e| RegistryError::Invalid(e.0))?;
        let r = &r;
        self.run("register", |c| self.try_register(c, r)).await
    }

    async fn heartbeat(&self, instance_id: Uuid) -> Result<(), StoreError> {
        self.run("heartbeat", |c| Self::try_heartbeat(c, instance_id))
            .await
    }

    async fn deregister(&self, instance_id: Uuid) -> Result<Registration, StoreError> {
        self.run("deregister", |c| Self::try_deregister(c, instance_id))
            .await
    }

    async fn lookup_prefill(&self, dp_rank: u32) -> Result<PrefillGroup, StoreError> {
        self.run("lookup", |c| Self::try_lookup(c, dp_rank)).await
    }

    async fn list(&self) -> Result<Vec<RankInfo>, StoreError> {
        self.run("list", |c| self.try_list(c)).await
    }

    async fn stats(&self) -> Result<RegistryStats, StoreError> {
        self.run("stats", |c| self.try_stats(c)).await
    }
}

/// `call`, bounded by [`CALL_TIMEOUT`], its failure a retryable [`Attempt`].
async fn bounded<T>(
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, Attempt> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(result) => result.map_err(Attempt::from),
        Err(_) => Err(no_answer()),
    }
}

fn no_answer() -> Attempt {
    Attempt::Retry(format!("no answer within {} ms", millis(CALL_TIMEOUT)))
}

fn attempt_text(a: Attempt) -> String {
    match a {
        Attempt::Refused(e) => e.to_string(),
        Attempt::Retry(m) | Attempt::Broken(m) => m,
    }
}

fn broken(what: String, value: &str) -> Attempt {
    Attempt::Broken(format!(
        "etcd holds an unreadable {what}: {value:?} (written by another program under {PREFIX}?)"
    ))
}

/// The registration stored in `kv`.
fn registration(kv: &KeyValue) -> Result<Registration, Attempt> {
    serde_json::from_slice(kv.value()).map_err(|e| {
        let key = String::from_utf8_lossy(kv.key());
        Attempt::Broken(format!(
            "etcd holds an unreadable registration at {key}: {e}"
        ))
    })
}

fn slot_key(s: &SlotKey) -> String {
    let ranks = format!(
        "{PREFIX}slots/{}/{:010}/{:010}/{:010}",
        s.role, s.dp_rank, s.pp_rank, s.tp_rank
    );
    match s.decode {
        Some(id) => format!("{ranks}/{id}"),
        None => ranks,
    }
}

fn group_prefix(dp_rank: u32) -> String {
    format!("{PREFIX}slots/{}/{dp_rank:010}/", Role::Prefill)
}

fn instance_key(id: Uuid) -> String {
    format!("{PREFIX}instances/{id}")
}

fn parse_slot_key(key: &str) -> Option<SlotKey> {
    let rest = key.strip_prefix(PREFIX)?.strip_prefix("slots/")?;
    let mut parts = rest.split('/');
    let role = match parts.next()? {
        "prefill" => Role::Prefill,
        "decode" => Role::Decode,
        _ => return None,
    };
    let mut number = || parts.next()?.parse::<u32>().ok();
    let (dp_rank, pp_rank, tp_rank) = (number()?, number()?, number()?);
    let decode = match role {
        Role::Prefill => None,
        Role::Decode => Some(parts.next()?.parse::<Uuid>().ok()?),
    };
    if parts.next().is_some() {
        return None;
    }
    Some(SlotKey {
        role,
        dp_rank,
        tp_rank,
        pp_rank,
        decode,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_keys_round_trip_and_sort_by_pp_then_tp() {
        let s = SlotKey {
            role: Role::Prefill,
            dp_rank: 3,
            tp_rank: 12,
            pp_rank: 1,
            decode: None,
        };
        let key = slot_key(&s);
        assert_eq!(
            key,
            "/kvferry/bootstrap/slots/prefill/0000000003/0000000001/0000000012"
        );
        assert_eq!(parse_slot_key(&key), Some(s));
        assert!(key.starts_with(&group_prefix(3)));
        assert!(!key.starts_with(&group_prefix(30)));
        let a = slot_key(&SlotKey { tp_rank: 2, ..s });
        let b = slot_key(&SlotKey {
            tp_rank: 10,
            pp_rank: 0,
            ..s
        });
        assert!(b < a, "pp 0 sorts before pp 1 whatever the tp rank");
        let id = Uuid::new_v4();
        let d = SlotKey {
            role: Role::Decode,
            decode: Some(id),
            ..s
        };
        let key = slot_key(&d);
        assert_eq!(
            key,
            format!("/kvferry/bootstrap/slots/decode/0000000003/0000000001/0000000012/{id}")
        );
        assert_eq!(parse_slot_key(&key), Some(d));
        assert_eq!(
            parse_slot_key(&slot_key(&SlotKey { decode: None, ..d })),
            None
        );
        assert_eq!(parse_slot_key(&format!("{}/{id}", slot_key(&s))), None);
        assert_eq!(parse_slot_key("/kvferry/bootstrap/slots/x/1/2/3"), None);
        assert_eq!(parse_slot_key("/other/slots/prefill/1/2/3"), None);
    }
}
