//! The direct path of a transfer: planning a chunk's runs into the decode's pool and choosing
//! the way they go (mapped writes, the transport's one-sided writes, placed runs), then sending
//! a piece chunk by chunk that way.

use super::{CHUNK_STALL, ChunkBody, Job, PLACED_STALL, Taken};
use crate::agent::ChunkPlan;
use crate::agent::DirectMethod;
use crate::agent::prefill::{DirectTarget, Prefill, Way, fanout};
use crate::kernel::Selection;
use crate::kernel::cpu::PoolSide;
use crate::memory::{Span, WriteRun};
use crate::reason::{FailureCode, Reason};
use crate::transport::{self, PoolMemory};
use std::ops::Range;

/// Placed chunks whose runs may be in flight at once beyond the one being sent.
const PLACED_AHEAD: usize = 2;

fn plan_failed(e: crate::kernel::KernelError) -> Reason {
    Reason::new(FailureCode::BadMessage, format!("direct write plan: {e}"))
}

/// The shortest average run worth going `way` rather than staged: one decode page `block`
/// for the transport's one-sided writes (the head layouts line up), `--placed-min-run-bytes`
/// (`placed_floor`, by default [`crate::agent::placed_min_run`]) for placed runs (each is one
/// message), any length for mapped writes (this process's own copies).
pub(super) fn shortest_run(way: &Way, block: u64, placed_floor: Option<u64>) -> u64 {
    match way {
        Way::Transport {
            method: DirectMethod::Write,
            ..
        } => block,
        Way::Transport {
            method: DirectMethod::Place,
            path,
            ..
        } => placed_floor.unwrap_or_else(|| crate::agent::placed_min_run(path)),
        Way::Mapped(_) => 1,
    }
}

/// Whether runs of lengths `lens` average at least `shortest` bytes.
pub(super) fn runs_pay(lens: impl ExactSizeIterator<Item = u64>, shortest: u64) -> bool {
    let runs = lens.len() as u64;
    runs > 0 && lens.sum::<u64>() / runs >= shortest
}

/// The source's contiguous ranges that `runs` read, in order, each as long as the source
/// allows: a placed chunk's runs for a decode that lands each run in several pieces.
pub(super) fn source_ranges(runs: &[WriteRun]) -> Vec<Span> {
    let mut out: Vec<Span> = Vec::new();
    for r in runs {
        match out.last_mut() {
            Some(last) if last.offset + last.len == r.src => last.len += r.len,
            _ => out.push(r.source()),
        }
    }
    out
}

/// A direct chunk's runs, checksum and the way (an index of `DirectTarget::ways`) they go;
/// `scattered`: the source ranges it goes as when that way lands runs in pieces.
pub(super) struct Planned {
    runs: Vec<WriteRun>,
    scattered: Option<Vec<Span>>,
    sum: u64,
    way: usize,
}

/// `r` counted from `start`, when it does not begin before it.
fn local(r: &Range<usize>, start: usize) -> Option<Range<usize>> {
    Some(r.start.checked_sub(start)?..r.end.checked_sub(start)?)
}

impl Prefill {
    /// The runs that move chunk `c` into the decode's pool `way`, and its checksum. With no
    /// `way` given, the first of the target's ways where the runs pay ([`shortest_run`]): the
    /// first chunk of a piece chooses for the piece. `None` when the decode's layout does not
    /// hold the chunk's layers and heads, or when no way pays.
    pub(super) async fn direct_runs(
        &self,
        job: &Job,
        target: &DirectTarget,
        c: &ChunkPlan,
        heads: &Range<usize>,
        way: Option<usize>,
    ) -> Result<Option<Planned>, Reason> {
        let (l, d, req) = (&self.cfg.layout, &target.layout, &job.req);
        let (Some(dst_layers), Some(dst_heads)) = (
            local(&c.layers, d.layers.start),
            local(
                &(req.heads.start as usize..req.heads.end as usize),
                d.heads.start,
            ),
        ) else {
            return Ok(None);
        };
        let src_layers = c.layers.start - l.layers.start..c.layers.end - l.layers.start;
        let (pool, layout) = (self.pool.clone(), d.clone());
        let (src_pages, dst_pages) = (job.pages.clone(), job.dst_pages.clone());
        let (tokens, heads, wire) = (c.tokens.clone(), heads.clone(), req.wire_order);
        let (num_pages, checksum) = (target.num_pages, self.cfg.checksum);
        let block = target
            .layout
            .block_bytes()
            .map_err(|e| plan_failed(e.into()))? as u64;
        let scatters: Vec<bool> = target.ways.iter().map(Way::scatters).collect();
        // The shortest average run of each way the chunk may go; the way given takes any.
        let shortest: Vec<Option<u64>> = target
            .ways
            .iter()
            .enumerate()
            .map(|(i, w)| match way {
                Some(given) => (given == i).then_some(0),
                None => Some(shortest_run(w, block, self.cfg.placed_min_run_bytes)),
            })
            .collect();
        let planned = tokio::task::spawn_blocking(move || {
            let src = Selection {
                pages: &src_pages,
                tokens: tokens.clone(),
                layers: src_layers.clone(),
                heads,
            };
            let dst = Selection {
                pages: &dst_pages,
                tokens,
                layers: dst_layers,
                heads: dst_heads,
            };
            let runs = crate::kernel::cpu::pool_to_pool(
                PoolSide {
                    layout: pool.layout(),
                    num_pages: pool.num_pages(),
                    sel: &src,
                },
                PoolSide {
                    layout: &layout,
                    num_pages,
                    sel: &dst,
                },
                wire,
            )?;
            let ranges = scatters.iter().any(|&s| s).then(|| source_ranges(&runs));
            let pays = |(i, s): (usize, &Option<u64>)| {
                s.is_some_and(|s| match ranges.as_ref().filter(|_| scatters[i]) {
                    Some(ranges) => runs_pay(ranges.iter().map(|r| r.len), s),
                    None => runs_pay(runs.iter().map(|r| r.len), s),
                })
            };
            let Some(way) = shortest.iter().enumerate().position(pays) else {
                return Ok(None);
            };
            let sum = match checksum {
                true => crate::agent::checksum_digest(pool.checksum(&src, wire)?),
                false => 0,
            };
            let scattered = ranges.filter(|_| scatters[way]);
            Ok::<_, crate::kernel::KernelError>(Some(Planned {
                runs,
                scattered,
                sum,
                way,
            }))
        })
        .await;
        match planned {
            Ok(planned) => planned.map_err(plan_failed),
            Err(e) => Err(Reason::new(
                FailureCode::BadMessage,
                format!("direct write plan stopped: {e}"),
            )),
        }
    }

    /// Sends a piece by the direct path (its first chunk's writes already planned), chunk by
    /// chunk: a credit, the writes (flushed), then the header.
    pub(super) async fn send_direct(
        &self,
        job: &Job,
        target: &DirectTarget,
        plan: &[ChunkPlan],
        heads: &Range<usize>,
        first: Planned,
        chunks: &mut u32,
    ) -> Result<(), Reason> {
        // `direct_target` offers a device pool placed runs only; every other way reads a host
        // pool.
        let Some(source) = self.pool.direct() else {
            let m = "the direct path reads a pool the transport reaches; this one it does not";
            return Err(Reason::new(FailureCode::IncompatibleLayout, m.to_owned()));
        };
        let way = first.way;
        let fanout = (job.req.requesters > 1).then(|| self.fanout.clone());
        let stalled = match target.ways[way].method() {
            DirectMethod::Place => PLACED_STALL,
            DirectMethod::Write => CHUNK_STALL,
        };
        let mut first = Some(first);
        // Placed chunks whose runs the decode is still taking, and direct chunks' headers still
        // with the transport: the next chunk's writes, header and runs go out meanwhile.
        let mut placing: std::collections::VecDeque<(Taken, &str)> = Default::default();
        for c in plan {
            self.credit(&job.peer).await?;
            self.faults.pass(&job.cancel, job.peer.instance).await;
            if job.cancel.is_cancelled() {
                job.peer.credits.add_permits(1);
                return Ok(());
            }
            let planned = match first.take() {
                Some(p) => Some(p),
                None => self.direct_runs(job, target, c, heads, Some(way)).await?,
            };
            let Some(Planned {
                runs,
                scattered,
                mut sum,
                ..
            }) = planned
            else {
                let m = format!("chunk {c:?} is outside the decode pool's layout");
                return Err(Reason::new(FailureCode::IncompatibleLayout, m));
            };
            let (nth, corrupt) = self.faults.next_chunk();
            if corrupt {
                tracing::warn!(
                    chunk = nth,
                    "fault injection: corrupting a direct chunk's checksum"
                );
                sum ^= 1;
            }
            let body = match &target.ways[way] {
                Way::Transport {
                    method: DirectMethod::Place,
                    ..
                } => {
                    let spans =
                        scattered.unwrap_or_else(|| runs.iter().map(|r| r.source()).collect());
                    ChunkBody::Placed(source.clone(), spans)
                }
                how => {
                    let PoolMemory::Host(host) = &source else {
                        let m = "only placed runs go from a device pool";
                        return Err(Reason::new(FailureCode::IncompatibleLayout, m.to_owned()));
                    };
                    let len: u64 = runs.iter().map(|r| r.len).sum();
                    // The writes read this pool until they are flushed, whoever stops waiting.
                    let (peer, pool) = (job.peer.clone(), host.clone());
                    let written = match how {
                        Way::Mapped(mapped) => {
                            let writes = fanout::Writes {
                                heads: job.req.heads.start as usize..job.req.heads.end as usize,
                                pool: mapped.clone(),
                                runs,
                            };
                            let key = (job.room, c.tokens.clone(), c.layers.clone());
                            let fanout = fanout.clone();
                            let endpoint = peer.data_endpoint.clone();
                            let metrics = self.metrics.clone();
                            job.sends.spawn(async move {
                                let written = match fanout {
                                    Some(f) => f.write(key, pool, writes).await,
                                    None => fanout::write_alone(pool, writes).await.map(|()| false),
                                };
                                if written == Ok(true) {
                                    metrics.chunks_one_pass.inc();
                                }
                                written.map(drop).map_err(|m| {
                                    transport::TransportError::new("write", &endpoint, m)
                                })
                            })
                        }
                        Way::Transport { .. } => job.sends.spawn(async move {
                            let mut data = peer.data.lock().await;
                            data.write(pool, runs).await
                        }),
                    };
                    self.taken(job, written, "direct writes not flushed")
                        .await?;
                    if job.cancel.is_cancelled() {
                        return Ok(());
                    }
                    // The writes are this path's gather: the chunk's bytes left the pool.
                    if *chunks == 0 {
                        self.mark_first(job.room, "first_gathered");
                    }
                    ChunkBody::Direct(len as usize)
                }
            };
            if let Some(taken) = self.send_chunk(job, c, *chunks, body, sum).await? {
                placing.push_back((taken, stalled));
            }
            *chunks += 1;
            while placing.len() > PLACED_AHEAD {
                if let Some((taken, stalled)) = placing.pop_front() {
                    self.taken(job, taken, stalled).await?;
                }
            }
        }
        // Awaited after Done, as a staged piece's last sends are.
        let mut unfinished = job.unfinished.lock().unwrap_or_else(|e| e.into_inner());
        unfinished.extend(placing);
        Ok(())
    }
}
