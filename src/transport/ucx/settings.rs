//! What an agent's UCX workers ask of UCX beyond the user's `UCX_*` environment: RMA or not,
//! eager chunks or rendezvous, tcp segment sizes, indirect endpoint ids, and whether endpoints
//! can be supervised, all read off `UCX_TLS` and kvferry's own variables.

use super::version::Family;

/// Transports whose hardware checks remote keys (InfiniBand/RoCE reliable and dynamically
/// connected transports): a one-sided write over them reaches only memory its target
/// registered and gave the key of.
const RDMA_TRANSPORTS: [&str; 8] = [
    "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5",
];

/// The variable that gives every agent's UCX context RMA, whatever its transports: for tests
/// of one-sided writes over tcp and shared memory on a trusted host only (then any process
/// that reaches the agent's UCX can read and write its memory).
pub const INSECURE_RMA_VAR: &str = "KVFERRY_INSECURE_UCX_RMA";

pub(super) fn insecure_rma() -> bool {
    std::env::var(INSECURE_RMA_VAR).as_deref() == Ok("1")
}

/// Whether an agent's UCX context asks for RMA: a writer (`writes`) whose `tls` names RDMA
/// transports only (and `self`), or anyone with `insecure`. A context with RMA runs libucx's
/// software puts and gets for any connected peer on every transport without native RMA
/// ([`super::safe::Context`]); the receiver of RDMA writes needs no RMA of its own (its NIC
/// serves them), so a decode never asks. Without it a prefill writes nothing one-sided.
pub(super) fn rma(writes: bool, tls: Option<&str>, insecure: bool) -> bool {
    let rdma_only = tls.is_some_and(|list| {
        !list.starts_with('^')
            && list
                .split(',')
                .map(str::trim)
                .all(|t| t == "self" || RDMA_TRANSPORTS.contains(&t))
    });
    insecure || (writes && rdma_only)
}

/// Whether staged chunks should go eagerly (UCX's `RNDV_THRESH=inf`) rather than by UCX's
/// rendezvous: when the user allowed tcp only (`UCX_TLS` of `tcp` and `self`) and did not set
/// the threshold. Over tcp eager is the faster, for staged chunks: rendezvous costs a
/// handshake per chunk and an emulated one-sided read.
/// Everywhere else rendezvous stays: with RDMA it is the zero-copy path, and over shared memory
/// it moves the bytes by cma, keeping the receiver's shared FIFO to a few small messages. A
/// sender killed in the middle of a FIFO message wedges that FIFO for every sender (UCX 1.13
/// cannot detect the death there), so bulk bytes must not go through it.
fn eager_chunks(tls: Option<&str>, rndv_thresh_set: bool) -> bool {
    let Some(list) = tls else { return false };
    let mut names = list.split(',').map(str::trim);
    !rndv_thresh_set
        && !list.starts_with('^')
        && names.clone().any(|t| t == "tcp")
        && names.all(|t| t == "tcp" || t == "self")
}

/// The transports `sm` stands for in `UCX_TLS`: same-host memory.
const SHARED_MEMORY: [&str; 7] = ["sm", "shm", "posix", "sysv", "cma", "knem", "xpmem"];

/// Whether `tls` lets UCX move bytes through same-host memory: unset (UCX's defaults), an
/// exclusion list that leaves some shared-memory transport, or a list that names one.
fn shared_memory_allowed(tls: Option<&str>) -> bool {
    let Some(list) = tls else { return true };
    let named = |t: &str| SHARED_MEMORY.contains(&t.trim());
    match list.strip_prefix('^') {
        Some(excluded) => {
            let excluded: Vec<&str> = excluded.split(',').map(str::trim).collect();
            !excluded.iter().any(|t| *t == "sm" || *t == "shm")
                && SHARED_MEMORY[2..].iter().any(|t| !excluded.contains(t))
        }
        None => list.split(',').any(named),
    }
}

/// Whether a decode on UCX offers same-host prefills its pool's memory file
/// ([`super::super::maps_pools`]): when this process's `UCX_TLS` allows shared memory.
pub fn maps_pools() -> bool {
    shared_memory_allowed(std::env::var("UCX_TLS").ok().as_deref())
}

/// Whether `tls` names shared-memory transports only (`posix,cma,self`, `sm`, ...). UCX 1.13
/// cannot detect a dead peer over them: it refuses an endpoint asking for that, and logs the
/// refusal as an error on stdout, where kvferry prints its listening line. Such endpoints are
/// made unsupervised from the start ([`super::UcxConfig::supervise`]).
pub(super) fn shared_memory_only(tls: Option<&str>) -> bool {
    let Some(list) = tls else { return false };
    !list.starts_with('^')
        && list
            .split(',')
            .map(str::trim)
            .all(|t| t == "self" || SHARED_MEMORY.contains(&t))
}

/// Whether this process's `UCX_*` environment sets `name` (without its `UCX_` prefix).
pub(super) fn ucx_env_sets(name: &str) -> bool {
    std::env::var_os(format!("UCX_{name}")).is_some()
}

/// [`eager_chunks`] for this process's `UCX_*` environment.
pub(super) fn eager() -> bool {
    let tls = std::env::var("UCX_TLS").ok();
    eager_chunks(tls.as_deref(), ucx_env_sets("RNDV_THRESH"))
}

/// The tcp segments for eager chunks and runs, as (environment variable without `UCX_`, the
/// name UCX 1.13's `ucp_config_modify` takes, value). UCX 1.13 sends tcp messages in 8 KiB
/// segments and receives in 64 KiB ones; with 1 MiB segments a 1 MiB chunk is one send and one
/// receive (staged rooms ran faster than with 8 KiB segments).
/// UCX 1.13 applies a transport's setting given to `ucp_config_modify` only under the field's
/// own name (`TX_SEG_SIZE`): `TCP_TX_SEG_SIZE` is accepted and silently ignored (the
/// endpoint's eager range stays at 8 KiB; tests/in_process/ucx_layer.rs checks it). UCX 1.22
/// takes the environment's name and refuses the field's own ("Invalid parameter"):
/// [`config_name`].
const EAGER_TCP_SEGMENTS: [(&str, &str, &str); 2] = [
    ("TCP_TX_SEG_SIZE", "TX_SEG_SIZE", EAGER_TCP_SEGMENT),
    ("TCP_RX_SEG_SIZE", "RX_SEG_SIZE", EAGER_TCP_SEGMENT),
];

/// The name `ucp_config_modify` applies a transport's setting under, on UCX of `family`: its
/// field's own (`field`) on 1.13, its environment variable's without `UCX_` (`env`) on 1.22.
fn config_name(family: Family, env: &'static str, field: &'static str) -> &'static str {
    match family {
        Family::V1_13 => field,
        Family::V1_22 => env,
    }
}

/// Every worker looks endpoints up by indirect ids in the wire protocols (UCX's `auto` does so
/// only for endpoints with error handling, not for the ones UCX creates for a connecting
/// peer). With direct ids, UCX 1.13 dereferences the id a message names: a rendezvous request
/// still queued from a peer that died, processed after UCX dropped that peer's endpoint, read
/// freed memory and aborted the decode (`ucp_worker.inl:92 Assertion `(*ep_p)->worker ==
/// worker' failed`, in `ucp_rndv_receive`, a prefill killed mid-room over shared memory).
/// With indirect ids the lookup fails and UCX drops the request.
const INDIRECT_IDS: (&str, &str, &str) = ("PROTO_INDIRECT_ID", "PROTO_INDIRECT_ID", "on");

/// The size of [`EAGER_TCP_SEGMENTS`].
const EAGER_TCP_SEGMENT: &str = "1m";

/// The UCX settings an agent's worker adds to the environment's (`is_set` says which the
/// environment has, by its name without `UCX_`), each unless the environment sets it:
/// - always: indirect endpoint ids ([`INDIRECT_IDS`]);
/// - when `tls` allows tcp only and the environment sets no `RNDV_THRESH` (eager chunks,
///   `eager_chunks`): no rendezvous and the large tcp segments (`EAGER_TCP_SEGMENTS`);
/// - otherwise, wherever tcp may carry the traffic (`tls` unset, an exclusion list, or naming
///   tcp): the large receive segment alone. A peer that sends eagerly sends 1 MiB segments,
///   and UCX 1.13 aborts a receiver whose segments are smaller (`tcp_ep.c`: "Assertion
///   `hdr->length <= (iface->config.rx_seg_size - sizeof(*hdr))' failed ... 1048576 vs
///   65536", seen with a tcp-only prefill and a decode on UCX's defaults).
///
/// Names as UCX of `family` takes them ([`config_name`]). Public for
/// tests/in_process/ucx_layer.rs, which checks that UCX applies them.
pub fn worker_vars(
    tls: Option<&str>,
    is_set: impl Fn(&str) -> bool,
    family: Family,
) -> Vec<(&'static str, &'static str)> {
    let unless_set = |vars: &[(&'static str, &'static str, &'static str)]| -> Vec<_> {
        vars.iter()
            .filter(|(env, _, _)| !is_set(env))
            .map(|&(env, field, value)| (config_name(family, env, field), value))
            .collect()
    };
    let mut vars = unless_set(&[INDIRECT_IDS]);
    if eager_chunks(tls, is_set("RNDV_THRESH")) {
        vars.push(("RNDV_THRESH", "inf"));
        vars.extend(unless_set(&EAGER_TCP_SEGMENTS));
        return vars;
    }
    let tcp_possible =
        tls.is_none_or(|list| list.starts_with('^') || list.split(',').any(|t| t.trim() == "tcp"));
    if tcp_possible {
        vars.extend(unless_set(&EAGER_TCP_SEGMENTS[1..]));
    }
    vars
}

#[cfg(test)]
mod tests;
