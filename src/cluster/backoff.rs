//! Keeping a watcher going while the API server fails it: spacing its
//! retries, and listing afresh when a watch is refused as too old.
//!
//! kube's `default_backoff` resets at every `Ok` item, and a list-then-watch
//! watcher yields `Ok(Event::Init)` before each list it tries: against a
//! server that refused every list, it retried about once a second, forever,
//! logging each time. This one resets only on progress: an object, or a
//! list complete.

use std::fmt::Debug;
use std::time::Duration;

use futures_util::stream::BoxStream;
use futures_util::{Stream, StreamExt};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;

const FIRST: Duration = Duration::from_millis(800);
const MOST: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub struct WatchBackoff {
    next: Duration,
}

impl Default for WatchBackoff {
    fn default() -> Self {
        WatchBackoff { next: FIRST }
    }
}

impl WatchBackoff {
    /// Sees the watcher's next item: after a failure, how long to wait
    /// before polling it again (it tries again only when polled).
    pub fn after<K>(&mut self, item: &Result<Event<K>, watcher::Error>) -> Option<Duration> {
        match item {
            // A marker: the list is about to be tried, nothing has arrived.
            Ok(Event::Init) => None,
            Ok(_) => {
                self.next = FIRST;
                None
            }
            Err(_) => {
                let wait = self.next;
                self.next = (self.next * 2).min(MOST);
                Some(wait)
            }
        }
    }
}

/// `events` spaced by a [`WatchBackoff`]: each item with the wait taken
/// before the watcher is polled again (`Some` after a failure, for the
/// caller's log line). The wait is part of polling the next item, so a
/// caller that stops waiting on the stream stops it too.
pub fn backed_off<K>(
    events: impl Stream<Item = Result<Event<K>, watcher::Error>>,
) -> impl Stream<Item = (Result<Event<K>, watcher::Error>, Option<Duration>)> {
    let state = (Box::pin(events), WatchBackoff::default(), None);
    futures_util::stream::unfold(state, |(mut events, mut backoff, pause)| async move {
        if let Some(pause) = pause {
            tokio::time::sleep(pause).await;
        }
        let item = events.next().await?;
        let wait = backoff.after(&item);
        Some(((item, wait), (events, backoff, wait)))
    })
}

/// kube-runtime's watcher for `api`, started again (so listing afresh)
/// whenever the API server refuses a watch's start with 410 Gone.
///
/// The watcher relists after a 410 ERROR event inside a watch, but a watch
/// refused at its start with a plain HTTP 410 (the server's history no
/// longer reaches the resourceVersion asked for) leaves it on that same
/// resourceVersion, retried forever, and nothing that changed since is
/// ever seen. The refusal is still passed on, for the caller's backoff
/// and log.
pub fn relisting<K>(
    api: Api<K>,
    config: watcher::Config,
) -> impl Stream<Item = Result<Event<K>, watcher::Error>> + Send
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let start = move || -> BoxStream<'static, Result<Event<K>, watcher::Error>> {
        watcher::watcher(api.clone(), config.clone()).boxed()
    };
    let events = start();
    futures_util::stream::unfold((start, events), |(start, mut events)| async move {
        let item = events.next().await?;
        if gone_at_start(&item) {
            events = start();
        }
        Some((item, (start, events)))
    })
}

fn gone_at_start<K>(item: &Result<Event<K>, watcher::Error>) -> bool {
    matches!(
        item,
        Err(watcher::Error::WatchStartFailed(kube::Error::Api(status))) if status.code == 410
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;

    fn failed() -> Result<Event<Pod>, watcher::Error> {
        Err(watcher::Error::NoResourceVersion)
    }

    #[test]
    fn failures_double_the_wait_and_list_markers_do_not_reset_it() {
        let mut backoff = WatchBackoff::default();
        let mut waits = Vec::new();
        for _ in 0..7 {
            assert_eq!(backoff.after::<Pod>(&Ok(Event::Init)), None);
            waits.push(backoff.after(&failed()).unwrap().as_millis());
        }
        assert_eq!(waits, [800, 1600, 3200, 6400, 12800, 25600, 30000]);
        // An object arrived: the next failure waits the least again.
        assert_eq!(backoff.after(&Ok(Event::InitDone::<Pod>)), None);
        assert_eq!(backoff.after(&failed()), Some(FIRST));
    }
}
