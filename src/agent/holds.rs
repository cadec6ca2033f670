//! Rooms an engine holds while their requests wait in its queue (`POST /v1/rooms/{room}/hold`
//! on either role): named in the agent's heartbeats to the other side, so that the room is not
//! ended by a timeout meant for a peer that stopped caring (the prefill's room TTL, either
//! side's ready timeout). A hold lasts until the engine moves on (asks for the room, announces
//! it, or releases the hold) and at most `--room-max-ms`.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::engine_api::RoomError;
use crate::protocol::MAX_HELD_ROOMS;

/// Held rooms, each with when its hold began and what the role keeps with it.
pub(crate) struct Holds<T> {
    rooms: Mutex<HashMap<u64, (Instant, T)>>,
}

impl<T: Default + Clone> Holds<T> {
    pub(crate) fn new() -> Self {
        Holds {
            rooms: Mutex::new(HashMap::new()),
        }
    }

    /// Holds `room` (again: the hold keeps its start). At most [`MAX_HELD_ROOMS`], the most a
    /// heartbeat names.
    pub(crate) fn hold(&self, room: u64) -> Result<(), RoomError> {
        let mut rooms = self.rooms();
        if rooms.len() >= MAX_HELD_ROOMS && !rooms.contains_key(&room) {
            return Err(RoomError::Exhausted(format!(
                "{} rooms held already: the most a heartbeat names",
                rooms.len()
            )));
        }
        rooms
            .entry(room)
            .or_insert_with(|| (Instant::now(), T::default()));
        Ok(())
    }

    /// Ends the hold of `room`, if any: what was kept with it.
    pub(crate) fn release(&self, room: u64) -> Option<T> {
        self.rooms().remove(&room).map(|(_, kept)| kept)
    }

    /// Changes what is kept with `room`'s hold, if it is still held; whether it was.
    pub(crate) fn update(&self, room: u64, f: impl FnOnce(&mut T)) -> bool {
        match self.rooms().get_mut(&room) {
            Some((_, kept)) => {
                f(kept);
                true
            }
            None => false,
        }
    }

    /// The holds younger than `max`, with what is kept with each; older ones end here.
    pub(crate) fn live(&self, max: Duration) -> Vec<(u64, T)> {
        let mut rooms = self.rooms();
        rooms.retain(|_, (since, _)| since.elapsed() < max);
        rooms
            .iter()
            .map(|(room, (_, kept))| (*room, kept.clone()))
            .collect()
    }

    fn rooms(&self) -> MutexGuard<'_, HashMap<u64, (Instant, T)>> {
        self.rooms.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_end_when_released_or_too_old() {
        let holds: Holds<Vec<u8>> = Holds::new();
        holds.hold(1).unwrap();
        holds.hold(2).unwrap();
        holds.update(2, |k| k.push(7));
        holds.update(3, |k| k.push(9)); // not held: nothing
        holds.release(1);
        holds.release(4); // not held: nothing
        assert_eq!(holds.live(Duration::from_secs(60)), vec![(2, vec![7])]);
        assert_eq!(holds.live(Duration::ZERO), vec![]);
        assert_eq!(
            holds.live(Duration::from_secs(60)),
            vec![],
            "too old: ended"
        );
    }
}
