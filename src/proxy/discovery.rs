//! The registry as the proxy reads it (`kvferry proxy --bootstrap`): each health round lists the
//! registered ranks, and every engine server their agents name (`server` in a registration, set
//! by the connectors) is a server of its role: found ones are added, and discovered ones that no
//! rank names any more are removed (scale out and in without restarting the proxy). A server
//! any of whose ranks registers as draining gets no new requests; what its agents registered
//! decides which servers of the other role it can pair with ([`paired`]). Listed servers
//! (`--prefill`, `--decode`) stay whatever the registry says, and take its word on draining and
//! pairing when their agents register them.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvferry_bootstrap::{RankInfo, Registration, RegistryClient, Role, pairing};

use super::backends::{Backend, Backends};

/// What the registry says of one engine server: one of its ranks' registrations, and whether
/// any of them drains.
struct Said {
    registration: Registration,
    draining: bool,
}

/// The engine servers the ranks name, by role and URL.
fn servers(ranks: Vec<RankInfo>) -> BTreeMap<(Role, String), Said> {
    let mut found: BTreeMap<(Role, String), Said> = BTreeMap::new();
    for rank in ranks {
        let r = rank.registration;
        let Some(url) = r.about.server.clone() else {
            continue;
        };
        let url = url.trim_end_matches('/').to_owned();
        let draining = r.about.draining;
        found
            .entry((r.role, url))
            .and_modify(|s| s.draining |= draining)
            .or_insert(Said {
                registration: r,
                draining,
            });
    }
    found
}

/// One look at the registry: servers added, forgotten, and told whether they drain. A registry
/// that cannot be reached changes nothing (logged).
pub(super) async fn look(registry: &RegistryClient, prefills: &Backends, decodes: &Backends) {
    let ranks = match registry.list_ranks().await {
        Ok(ranks) => ranks,
        Err(e) => {
            tracing::warn!(error = %e, "the registry could not be read: servers as they were");
            return;
        }
    };
    let mut found = servers(ranks);
    for (role, backends) in [(Role::Prefill, prefills), (Role::Decode, decodes)] {
        for b in backends.all() {
            match found.remove(&(role, b.url.clone())) {
                Some(said) => b.registered_as(Some(said.registration), said.draining),
                None if b.discovered() => backends.forget(&b.url),
                None => b.registered_as(None, false),
            }
        }
    }
    for ((role, url), said) in found {
        let backends = match role {
            Role::Prefill => prefills,
            Role::Decode => decodes,
        };
        backends
            .discover(&url)
            .registered_as(Some(said.registration), said.draining);
    }
}

/// Whether a prefill and a decode server can exchange KV, by what their agents registered
/// (`kvferry_bootstrap::pairing`); servers the registry has not listed pair with any.
pub(super) fn paired(prefill: &Backend, decode: &Backend) -> Result<(), String> {
    match (prefill.registration(), decode.registration()) {
        (Some(p), Some(d)) => pairing::pairable(&p, &d),
        _ => Ok(()),
    }
}

/// The proxy's registry client: `--bootstrap`'s URLs and the token.
pub fn client(urls: &str, token: Option<String>) -> anyhow::Result<Arc<RegistryClient>> {
    Ok(Arc::new(RegistryClient::new(urls.to_owned(), token)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_bootstrap::{About, AttentionKind, Dtype, IndexRange, KvLayout, Slice};

    fn rank(role: Role, server: &str, tp_rank: u32, draining: bool) -> RankInfo {
        RankInfo {
            registration: Registration {
                instance_id: uuid::Uuid::new_v4(),
                role,
                dp_rank: 0,
                dp_size: 1,
                tp_rank,
                tp_size: 2,
                pp_rank: 0,
                pp_size: 1,
                layout: KvLayout {
                    kind: AttentionKind::Mha,
                    num_layers: 2,
                    num_kv_heads: 2,
                    head_dim: 64,
                    dtype: Dtype::Fp32,
                    page_size: 128,
                    order: None,
                },
                slice: Slice {
                    heads: IndexRange::new(tp_rank, tp_rank + 1),
                    layers: IndexRange::new(0, 2),
                },
                control_endpoint: "tcp://127.0.0.1:1".into(),
                data_endpoints: Default::default(),
                about: About {
                    server: Some(server.into()),
                    draining,
                    ..About::default()
                },
            },
            lease_remaining_ms: 1000,
            unmatched: None,
        }
    }

    #[test]
    fn a_server_is_every_rank_that_names_it_and_drains_when_one_does() {
        let found = servers(vec![
            rank(Role::Prefill, "http://p:8000/", 0, false),
            rank(Role::Prefill, "http://p:8000", 1, true),
            rank(Role::Decode, "http://d:8000", 0, false),
        ]);
        let keys: Vec<_> = found.keys().cloned().collect();
        assert_eq!(
            keys,
            [
                (Role::Prefill, "http://p:8000".to_owned()),
                (Role::Decode, "http://d:8000".to_owned())
            ]
        );
        assert!(found[&(Role::Prefill, "http://p:8000".to_owned())].draining);
        assert!(!found[&(Role::Decode, "http://d:8000".to_owned())].draining);
    }
}
