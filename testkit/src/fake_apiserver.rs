//! An in-process Kubernetes API server for `gpumem demo` and the tests: the
//! real REST paths and JSON that gpumem's client (kube-rs) and kubectl use,
//! over plain HTTP on loopback, with objects held as JSON.
//!
//! It serves what gpumem touches and no more: pods (list and watch with field
//! and label selectors, get, create, merge and strategic-merge patch,
//! binding), nodes (list, watch, get, patch, patch of `status`),
//! `events.k8s.io/v1` events, and `resource.k8s.io/v1` ResourceSlices (list,
//! watch, get, create, replace, patch, delete, deletecollection) and
//! ResourceClaims (list, watch, get, create, delete). Like the real server
//! it bumps `metadata.resourceVersion` on every write, answers a write that
//! names a stale resourceVersion with 409 Conflict, ignores `status` sent to
//! a main resource, and resumes a watch from a resourceVersion. Strategic
//! merge is applied as a JSON merge patch: the same for the maps gpumem
//! patches (annotations, capacity).
//!
//! Like the real registry it returns a ResourceSlice's capacity quantities
//! canonical (`1024Mi` → `1Gi`) and bumps its `metadata.generation` when the
//! spec changes; [`FakeApiServer::drop_consumable_capacity`] makes it a
//! server without the `DRAConsumableCapacity` feature gate.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Path as UrlPath, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Map, Value};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// The kinds served, by their URL resource name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Pod,
    Node,
    Event,
    /// `resource.k8s.io/v1`, cluster-scoped.
    ResourceSlice,
    /// `resource.k8s.io/v1`, namespaced.
    ResourceClaim,
}

impl Kind {
    fn api_version(self) -> &'static str {
        match self {
            Kind::Pod | Kind::Node => "v1",
            Kind::Event => "events.k8s.io/v1",
            Kind::ResourceSlice | Kind::ResourceClaim => "resource.k8s.io/v1",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Node => "Node",
            Kind::Event => "Event",
            Kind::ResourceSlice => "ResourceSlice",
            Kind::ResourceClaim => "ResourceClaim",
        }
    }

    fn of(object: &Value) -> Option<Kind> {
        match object.get("kind")?.as_str()? {
            "Pod" => Some(Kind::Pod),
            "Node" => Some(Kind::Node),
            "Event" => Some(Kind::Event),
            "ResourceSlice" => Some(Kind::ResourceSlice),
            "ResourceClaim" => Some(Kind::ResourceClaim),
            _ => None,
        }
    }

    /// The kind a URL's resource segment (`pods`, `resourceslices`) names.
    fn of_url(segment: &str) -> Option<Kind> {
        [
            Kind::Pod,
            Kind::Node,
            Kind::Event,
            Kind::ResourceSlice,
            Kind::ResourceClaim,
        ]
        .into_iter()
        .find(|kind| kind.resource().split('.').next() == Some(segment))
    }

    fn namespaced(self) -> bool {
        !matches!(self, Kind::Node | Kind::ResourceSlice)
    }

    /// The resource as error messages name it (`pods`,
    /// `resourceslices.resource.k8s.io`).
    fn resource(self) -> &'static str {
        match self {
            Kind::Pod => "pods",
            Kind::Node => "nodes",
            Kind::Event => "events",
            Kind::ResourceSlice => "resourceslices.resource.k8s.io",
            Kind::ResourceClaim => "resourceclaims.resource.k8s.io",
        }
    }

    /// Field selectors the real server accepts for this kind (slices:
    /// `resourceslice.toSelectableFields`; claims: object meta only).
    fn selectable(self, path: &str) -> bool {
        match self {
            Kind::Pod | Kind::Node | Kind::Event => matches!(
                path,
                "metadata.name" | "metadata.namespace" | "spec.nodeName" | "status.phase"
            ),
            Kind::ResourceSlice => {
                matches!(path, "metadata.name" | "spec.nodeName" | "spec.driver")
            }
            Kind::ResourceClaim => matches!(path, "metadata.name" | "metadata.namespace"),
        }
    }
}

type Key = (Kind, String, String);

/// One stored change, kept so a watch can resume from a resourceVersion.
#[derive(Debug, Clone)]
struct Change {
    kind: Kind,
    version: u64,
    kind_of_change: &'static str,
    object: Value,
}

#[derive(Default)]
struct Store {
    objects: BTreeMap<Key, Value>,
    version: u64,
    history: Vec<Change>,
    /// Requests seen, as `METHOD path?query`, for tests to assert on.
    requests: Vec<String>,
    /// Writes to answer with 409 before applying any, for retry tests.
    conflicts: u32,
    /// Writes of one kind to answer with 500: how many, and whether each
    /// is applied first.
    failing_writes: Option<(Kind, u32, bool)>,
    /// Bindings to leave unanswered and unapplied, as an overloaded server
    /// would, for timeout tests.
    hung_bindings: u32,
    /// Serve as an API server without the `DRAConsumableCapacity` feature
    /// gate: drop its fields on write.
    consumable_capacity_off: bool,
    /// Kinds whose lists and watches are answered 403 Forbidden, as after
    /// a ClusterRole lost their verbs.
    forbidden: Vec<Kind>,
    /// Kinds whose watches from a resourceVersion are told it is too old.
    expired: Vec<Kind>,
    /// Per kind, the oldest resourceVersion a watch may still resume from.
    compacted: BTreeMap<Kind, u64>,
    /// Per kind, the newest resourceVersion a watch has sent live.
    delivered: BTreeMap<Kind, u64>,
}

struct Shared {
    store: Mutex<Store>,
    changes: broadcast::Sender<Change>,
    /// Ends every open watch (as an API server restart would).
    watches: Mutex<CancellationToken>,
    /// Kinds whose live watch events wait, as behind a lagging watch cache.
    held: tokio::sync::watch::Sender<Vec<Kind>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Store> {
        self.store
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    fn mark_delivered(&self, kind: Kind, version: u64) {
        let mut store = self.lock();
        let delivered = store.delivered.entry(kind).or_default();
        *delivered = (*delivered).max(version);
    }
}

/// A running fake API server; stops when dropped.
pub struct FakeApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

/// One device the scheduler allocated to a claim: a result of its allocation.
#[derive(Debug, Clone, Default)]
pub struct Allocated {
    pub request: String,
    pub device: String,
    /// `consumedCapacity.memory`; `None` as an API server without
    /// `DRAConsumableCapacity` leaves it (the device allocated whole).
    pub memory: Option<String>,
    pub share_id: Option<String>,
}

/// A ResourceClaim as the scheduler leaves it once allocated: one request
/// per result, asking the result's memory of device class `driver`, and the
/// results, from `driver`'s pool `pool`.
pub fn allocated_claim(
    namespace: &str,
    name: &str,
    uid: &str,
    driver: &str,
    pool: &str,
    results: &[Allocated],
) -> Value {
    let requests: Vec<Value> = results
        .iter()
        .map(|r| {
            let mut exactly = json!({"deviceClassName": driver});
            if let Some(memory) = &r.memory {
                exactly["capacity"] = json!({"requests": {"memory": memory}});
            }
            json!({"name": r.request, "exactly": exactly})
        })
        .collect();
    let results: Vec<Value> = results
        .iter()
        .map(|r| {
            let mut result = json!({
                "request": r.request,
                "driver": driver,
                "pool": pool,
                "device": r.device,
            });
            if let Some(memory) = &r.memory {
                result["consumedCapacity"] = json!({"memory": memory});
            }
            if let Some(share) = &r.share_id {
                result["shareID"] = json!(share);
            }
            result
        })
        .collect();
    json!({
        "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "spec": {"devices": {"requests": requests}},
        "status": {"allocation": {"devices": {"results": results}}},
    })
}

impl FakeApiServer {
    /// Serves on an ephemeral loopback port.
    pub async fn start() -> io::Result<FakeApiServer> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let (changes, _) = broadcast::channel(1024);
        let shared = Arc::new(Shared {
            store: Mutex::default(),
            changes,
            watches: Mutex::new(CancellationToken::new()),
            held: tokio::sync::watch::Sender::new(Vec::new()),
        });
        let stop = CancellationToken::new();
        let app = router()
            .layer(axum::middleware::from_fn_with_state(shared.clone(), record))
            .with_state(shared.clone());
        let until = stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(until.cancelled_owned())
                .await;
        });
        Ok(FakeApiServer { addr, shared, stop })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig that points at this server (no credentials).
    pub fn write_kubeconfig(&self, path: &Path) -> io::Result<()> {
        let config = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            self.url()
        );
        std::fs::write(path, config)
    }

    /// Creates or replaces an object (`kind` and `metadata.name` required;
    /// namespaced kinds also `metadata.namespace`, default `default`),
    /// filling in what the server would: uid, resourceVersion,
    /// creationTimestamp, and for the `resource.k8s.io` kinds what their
    /// registry does to a write (canonical slice quantities, the slice's
    /// `metadata.generation`, [`drop_consumable_capacity`]). A claim keeps
    /// the status it is given. Returns the stored object.
    ///
    /// [`drop_consumable_capacity`]: FakeApiServer::drop_consumable_capacity
    pub fn put(&self, object: Value) -> Value {
        let mut store = self.shared.lock();
        let (stored, change) = store.upsert(object);
        drop(store);
        if let Some(change) = change {
            let _ = self.shared.changes.send(change);
        }
        stored
    }

    /// The stored object, if any.
    pub fn get(&self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        let key = (kind, namespace.to_owned(), name.to_owned());
        self.shared.lock().objects.get(&key).cloned()
    }

    /// Every stored object of `kind`.
    pub fn list(&self, kind: Kind) -> Vec<Value> {
        self.shared
            .lock()
            .objects
            .iter()
            .filter(|((k, _, _), _)| *k == kind)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Deletes an object, as a pod's end or a node's removal would.
    pub fn delete(&self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        let mut store = self.shared.lock();
        let key = (kind, namespace.to_owned(), name.to_owned());
        let (object, change) = store.remove(&key)?;
        drop(store);
        let _ = self.shared.changes.send(change);
        Some(object)
    }

    /// Deletes the ResourceSlices of `node` (of one driver, or all), as
    /// kubelet does at every start and 30 s after a driver goes away.
    /// Returns the deleted slices.
    pub fn delete_node_slices(&self, node: &str, driver: Option<&str>) -> Vec<Value> {
        let mut fields = vec![("spec.nodeName".to_owned(), true, node.to_owned())];
        if let Some(driver) = driver {
            fields.push(("spec.driver".to_owned(), true, driver.to_owned()));
        }
        let selector = Selector {
            fields,
            labels: Vec::new(),
        };
        delete_matching(&self.shared, Kind::ResourceSlice, None, &selector)
    }

    /// Serves as an API server without the `DRAConsumableCapacity` feature
    /// gate (`on`) or with it. Without it, as the real registry's
    /// `dropDisabledFields` does, writes silently drop a ResourceSlice's
    /// `spec.devices[].allowMultipleAllocations` and
    /// `spec.devices[].capacity.*.requestPolicy`, a ResourceClaim's
    /// `spec.devices.requests[].exactly.capacity` (and `firstAvailable[]`'s,
    /// and constraints' `distinctAttribute`) and its results' `shareID` and
    /// `consumedCapacity` (and `status.devices[].shareID`); an update keeps
    /// them only where the stored object already used the feature. Applies
    /// to `put()` too.
    pub fn drop_consumable_capacity(&self, on: bool) {
        self.shared.lock().consumable_capacity_off = on;
    }

    /// Requests seen so far, as `METHOD /path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.shared.lock().requests.clone()
    }

    /// Answers the next `n` writes with 409 Conflict, as a server does when
    /// someone else wrote the object first.
    pub fn conflict_next_writes(&self, n: u32) {
        self.shared.lock().conflicts = n;
    }

    /// Answers the next `n` writes of `kind` (patch, replace, binding) with
    /// 500 InternalError, as a server whose etcd timed out does. Where
    /// `applied`, each write is stored first, as when etcd committed it
    /// but the answer was lost.
    pub fn fail_next_writes(&self, kind: Kind, n: u32, applied: bool) {
        self.shared.lock().failing_writes = Some((kind, n, applied));
    }

    /// Leaves the next `n` pod bindings unanswered (until the client gives
    /// up) and unapplied, as an overloaded API server may.
    pub fn hang_next_bindings(&self, n: u32) {
        self.shared.lock().hung_bindings = n;
    }

    /// Tells each watch of `kind` that resumes from a resourceVersion that
    /// it is too old (`on`), as a server whose watch cache has moved on
    /// does: a 410 Gone ERROR event, after which clients list afresh.
    pub fn expire_watches(&self, kind: Kind, on: bool) {
        let mut store = self.shared.lock();
        store.expired.retain(|k| *k != kind);
        if on {
            store.expired.push(kind);
        }
    }

    /// Forgets the history of `kind` up to now, as etcd's compaction does:
    /// a watch that resumes from a resourceVersion before the next write is
    /// answered a plain HTTP 410 Gone (not a 200 with an ERROR event), as
    /// the API server answers when its storage has moved on. A list, and a
    /// watch from what it returned once something was written, still work.
    pub fn compact(&self, kind: Kind) {
        let mut store = self.shared.lock();
        let next = store.version + 1;
        store.compacted.insert(kind, next);
    }

    /// Answers lists and watches of `kind` with 403 Forbidden (`on`), as
    /// after a ClusterRole lost those verbs, or serves them again. Open
    /// watches go on until they end ([`end_watches`]).
    ///
    /// [`end_watches`]: FakeApiServer::end_watches
    pub fn forbid(&self, kind: Kind, on: bool) {
        let mut store = self.shared.lock();
        store.forbidden.retain(|k| *k != kind);
        if on {
            store.forbidden.push(kind);
        }
    }

    /// Holds back the live watch events of `kind` (`on`), as a watch cache
    /// that lags writes does, or sends those held, in order, and goes on.
    /// Lists and reads still see every write.
    pub fn hold_watch_events(&self, kind: Kind, on: bool) {
        self.shared.held.send_modify(|held| {
            held.retain(|k| *k != kind);
            if on {
                held.push(kind);
            }
        });
    }

    /// The newest resourceVersion of `kind` some watch has brought its
    /// client up to: its backlog, or a live event (0: none yet).
    pub fn watch_delivered(&self, kind: Kind) -> u64 {
        self.shared
            .lock()
            .delivered
            .get(&kind)
            .copied()
            .unwrap_or(0)
    }

    /// Ends every open watch, as an API server restart does; clients must
    /// watch again from their last resourceVersion.
    pub fn end_watches(&self) {
        let mut token = self
            .shared
            .watches
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        token.cancel();
        *token = CancellationToken::new();
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.stop.cancel();
        self.end_watches();
    }
}

impl Store {
    fn bump(&mut self) -> u64 {
        self.version += 1;
        self.version
    }

    /// Removes an object; the change to broadcast.
    fn remove(&mut self, key: &Key) -> Option<(Value, Change)> {
        let mut object = self.objects.remove(key)?;
        let version = self.bump();
        set_version(&mut object, version);
        let change = Change {
            kind: key.0,
            version,
            kind_of_change: "DELETED",
            object: object.clone(),
        };
        self.history.push(change.clone());
        Some((object, change))
    }

    /// What the real registry's strategies do to a write before storing it
    /// (`PrepareForCreate` / `PrepareForUpdate`), for the `resource.k8s.io`
    /// kinds; `old` is the stored object an update replaces.
    fn admit(&self, kind: Kind, object: &mut Value, old: Option<&Value>) {
        match kind {
            Kind::ResourceSlice => {
                canonicalize_slice(object);
                if self.consumable_capacity_off && !slice_uses_consumable_capacity(old) {
                    drop_slice_consumable_capacity(object);
                }
                // metadata.generation: 1 at create, +1 on any spec change.
                let generation = match old {
                    None => 1,
                    Some(old) => {
                        let stored = old
                            .pointer("/metadata/generation")
                            .and_then(Value::as_i64)
                            .unwrap_or(1);
                        if old.get("spec") == object.get("spec") {
                            stored
                        } else {
                            stored + 1
                        }
                    }
                };
                if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
                    meta.insert("generation".into(), json!(generation));
                }
            }
            Kind::ResourceClaim if self.consumable_capacity_off => {
                // The spec's and the status's checks differ, as in the real
                // resourceclaim strategy: the spec keeps its fields only if
                // the old spec used them, the status if the old claim did.
                let spec_in_use = old.is_some_and(claim_spec_uses_consumable_capacity);
                let claim_in_use =
                    spec_in_use || old.is_some_and(claim_status_uses_consumable_capacity);
                if !spec_in_use {
                    drop_claim_spec_consumable_capacity(object);
                }
                if !claim_in_use {
                    drop_claim_status_consumable_capacity(object);
                }
            }
            _ => {}
        }
    }

    /// Stores `object`, new or replacing; the change to broadcast.
    fn upsert(&mut self, mut object: Value) -> (Value, Option<Change>) {
        let Some(kind) = Kind::of(&object) else {
            return (object, None);
        };
        let namespace = if kind.namespaced() {
            meta_str(&object, "namespace")
                .unwrap_or("default")
                .to_owned()
        } else {
            String::new()
        };
        let name = meta_str(&object, "name").unwrap_or_default().to_owned();
        let key = (kind, namespace.clone(), name.clone());
        let existed = self.objects.get(&key).cloned();
        let version = self.bump();
        if let Some(meta) = object
            .as_object_mut()
            .map(|o| o.entry("metadata").or_insert_with(|| json!({})))
            .and_then(Value::as_object_mut)
        {
            if kind.namespaced() {
                meta.insert("namespace".into(), json!(namespace));
            } else {
                meta.remove("namespace");
            }
            let uid = existed
                .as_ref()
                .and_then(|old| meta_str(old, "uid").map(str::to_owned))
                .unwrap_or_else(|| fake_uid(version));
            meta.entry("uid").or_insert(json!(uid));
            meta.entry("creationTimestamp")
                .or_insert(json!("2026-11-23T00:00:00Z"));
        }
        if let Some(o) = object.as_object_mut() {
            o.insert("apiVersion".into(), json!(kind.api_version()));
        }
        self.admit(kind, &mut object, existed.as_ref());
        set_version(&mut object, version);
        self.objects.insert(key, object.clone());
        let change = Change {
            kind,
            version,
            kind_of_change: if existed.is_some() {
                "MODIFIED"
            } else {
                "ADDED"
            },
            object: object.clone(),
        };
        self.history.push(change.clone());
        (object, Some(change))
    }
}

fn router() -> Router<Arc<Shared>> {
    Router::new()
        .route("/api/v1/pods", get(list))
        .route(
            "/api/v1/namespaces/{ns}/pods",
            get(list).post(create_object),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}",
            get(get_object).patch(patch_main).put(replace_pod),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}/binding",
            post(bind_pod),
        )
        .route("/api/v1/nodes", get(list))
        .route("/api/v1/nodes/{name}", get(get_object).patch(patch_main))
        .route(
            "/api/v1/nodes/{name}/status",
            get(get_object).patch(patch_status),
        )
        .route(
            "/apis/events.k8s.io/v1/namespaces/{ns}/events",
            get(list).post(create_object),
        )
        .route(
            "/apis/events.k8s.io/v1/namespaces/{ns}/events/{name}",
            get(get_object).patch(patch_main),
        )
        .route(
            "/apis/resource.k8s.io/v1/resourceslices",
            get(list).post(create_object).delete(delete_slices),
        )
        .route(
            "/apis/resource.k8s.io/v1/resourceslices/{name}",
            get(get_object)
                .put(replace_slice)
                .patch(patch_main)
                .delete(delete_object),
        )
        .route("/apis/resource.k8s.io/v1/resourceclaims", get(list))
        .route(
            "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims",
            get(list).post(create_object),
        )
        .route(
            "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}",
            get(get_object).delete(delete_object),
        )
        .fallback(unknown)
}

type Params = Query<HashMap<String, String>>;
type Shared_ = State<Arc<Shared>>;

/// What a request's URL names: the kind, and the `{ns}` and `{name}` its
/// route has, so that one handler serves each verb for every kind.
struct At {
    kind: Kind,
    ns: Option<String>,
    name: String,
}

impl At {
    /// The namespace, "" for a cluster-scoped kind.
    fn ns(&self) -> &str {
        self.ns.as_deref().unwrap_or_default()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for At {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<At, Response> {
        let UrlPath(mut params) =
            UrlPath::<HashMap<String, String>>::from_request_parts(parts, state)
                .await
                .map_err(IntoResponse::into_response)?;
        let path = parts.uri.path();
        let Some(kind) = resource_segment(path).and_then(Kind::of_url) else {
            return Err(unknown(parts.uri.clone()).await);
        };
        Ok(At {
            kind,
            ns: params.remove("ns"),
            name: params.remove("name").unwrap_or_default(),
        })
    }
}

/// The resource segment of an API path: the one after the version
/// (`/api/v1/…`, `/apis/{group}/{version}/…`) and any `namespaces/{ns}/`.
fn resource_segment(path: &str) -> Option<&str> {
    let mut rest = match path.strip_prefix("/api/v1/") {
        Some(rest) => rest,
        None => path.strip_prefix("/apis/")?.splitn(3, '/').nth(2)?,
    };
    if let Some(namespaced) = rest.strip_prefix("namespaces/") {
        rest = namespaced.split_once('/')?.1;
    }
    rest.split('/').next()
}

/// Every request, as `METHOD /path?query`, before it is served.
async fn record(State(s): Shared_, request: Request, next: Next) -> Response {
    let uri = request.uri();
    // kube-rs ends every URL with `?`, query or not.
    let line = match uri.query().filter(|q| !q.is_empty()) {
        Some(query) => format!("{} {}?{query}", request.method(), uri.path()),
        None => format!("{} {}", request.method(), uri.path()),
    };
    s.lock().requests.push(line);
    next.run(request).await
}

async fn unknown(uri: axum::http::Uri) -> Response {
    status_error(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("the server could not find the requested resource ({uri})"),
    )
}

async fn list(State(s): Shared_, at: At, Query(q): Params) -> Response {
    list_or_watch(&s, at.kind, at.ns.as_deref(), &q)
}

async fn get_object(State(s): Shared_, at: At) -> Response {
    get_one(&s, at.kind, at.ns(), &at.name)
}

async fn create_object(State(s): Shared_, at: At, body: Bytes) -> Response {
    create(&s, at.kind, at.ns(), &body)
}

async fn patch_main(State(s): Shared_, at: At, headers: HeaderMap, body: Bytes) -> Response {
    patch(&s, at.kind, at.ns(), &at.name, &headers, &body, Part::Main)
}

async fn patch_status(State(s): Shared_, at: At, headers: HeaderMap, body: Bytes) -> Response {
    patch(
        &s,
        at.kind,
        at.ns(),
        &at.name,
        &headers,
        &body,
        Part::Status,
    )
}

async fn delete_object(State(s): Shared_, at: At, body: Bytes) -> Response {
    delete_one(&s, at.kind, at.ns(), &at.name, &body)
}

/// `PUT resourceslices/{name}`: the whole object, unconditional unless it
/// names a resourceVersion (the real strategy allows unconditional updates).
async fn replace_slice(State(s): Shared_, UrlPath(name): UrlPath<String>, body: Bytes) -> Response {
    let Ok(new) = serde_json::from_slice::<Value>(&body) else {
        return bad_request("the body is not JSON");
    };
    if let Some(named) = meta_str(&new, "name").filter(|n| *n != name) {
        return bad_request(&format!(
            "the name of the object ({named}) does not match the name on the URL ({name})"
        ));
    }
    write(&s, Kind::ResourceSlice, "", &name, |old| {
        check_version(&new, old)?;
        Ok(new.clone())
    })
}

/// `DELETE resourceslices?fieldSelector=…`: what kubelet sends for a node's
/// slices. Answers the list of deleted objects, as the real server does.
async fn delete_slices(State(s): Shared_, Query(q): Params) -> Response {
    let selector = match Selector::parse(Kind::ResourceSlice, &q) {
        Ok(selector) => selector,
        Err(message) => return bad_request(&message),
    };
    let items = delete_matching(&s, Kind::ResourceSlice, None, &selector);
    let version = s.lock().version;
    axum::Json(json!({
        "kind": "ResourceSliceList",
        "apiVersion": Kind::ResourceSlice.api_version(),
        "metadata": {"resourceVersion": version.to_string()},
        "items": items,
    }))
    .into_response()
}

async fn replace_pod(
    State(s): Shared_,
    UrlPath((ns, name)): UrlPath<(String, String)>,
    body: Bytes,
) -> Response {
    let Ok(new) = serde_json::from_slice::<Value>(&body) else {
        return bad_request("the body is not JSON");
    };
    write(&s, Kind::Pod, &ns, &name, |old| {
        check_version(&new, old)?;
        let mut new = new.clone();
        // Status is a subresource: a PUT to the pod keeps the old one.
        if let (Some(n), Some(status)) = (new.as_object_mut(), old.get("status")) {
            n.insert("status".into(), status.clone());
        }
        Ok(new)
    })
}

/// `POST pods/{name}/binding`: sets `spec.nodeName` once, and merges the
/// Binding's annotations into the pod in the same step. Like the real
/// registry it refuses (409) a pod already bound or being deleted, and a
/// Binding whose `metadata.uid` is not the pod's.
async fn bind_pod(
    State(s): Shared_,
    UrlPath((ns, name)): UrlPath<(String, String)>,
    body: Bytes,
) -> Response {
    let hang = {
        let mut store = s.lock();
        let hang = store.hung_bindings > 0;
        store.hung_bindings = store.hung_bindings.saturating_sub(1);
        hang
    };
    if hang {
        std::future::pending::<()>().await;
    }
    let Ok(binding) = serde_json::from_slice::<Value>(&body) else {
        return bad_request("the body is not JSON");
    };
    let uid = binding
        .pointer("/metadata/uid")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let Some(node) = binding.pointer("/target/name").and_then(Value::as_str) else {
        return bad_request("Binding.target.name is required");
    };
    let node = node.to_owned();
    let annotations = binding
        .pointer("/metadata/annotations")
        .cloned()
        .unwrap_or_else(|| json!({}));
    let response = write(&s, Kind::Pod, &ns, &name, |old| {
        let stored_uid = meta_str(old, "uid").unwrap_or_default();
        if let Some(uid) = uid.as_deref().filter(|u| *u != stored_uid) {
            return Err(conflict(format!(
                "Operation cannot be fulfilled on pods/binding \"{name}\": Precondition failed: \
                 UID in precondition: {uid}, UID in object meta: {stored_uid}"
            )));
        }
        if old.pointer("/metadata/deletionTimestamp").is_some() {
            return Err(conflict(format!(
                "Operation cannot be fulfilled on pods/binding \"{name}\": pod {name} is being \
                 deleted, cannot be assigned to a host"
            )));
        }
        if let Some(current) = old.pointer("/spec/nodeName").and_then(Value::as_str) {
            return Err(conflict(format!(
                "Operation cannot be fulfilled on pods/binding \"{name}\": pod {name} is already assigned to node \"{current}\""
            )));
        }
        let mut new = old.clone();
        merge(
            &mut new,
            &json!({"spec": {"nodeName": node}, "metadata": {"annotations": annotations}}),
        );
        Ok(new)
    });
    if response.status().is_success() {
        (StatusCode::CREATED, axum::Json(json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}))).into_response()
    } else {
        response
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    Main,
    Status,
}

fn patch(
    s: &Shared,
    kind: Kind,
    ns: &str,
    name: &str,
    headers: &HeaderMap,
    body: &[u8],
    part: Part,
) -> Response {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if !matches!(
        content_type,
        "application/merge-patch+json" | "application/strategic-merge-patch+json"
    ) {
        return status_error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            &format!(
                "the fake API server takes merge and strategic-merge patches, not {content_type:?}"
            ),
        );
    }
    let Ok(patch) = serde_json::from_slice::<Value>(body) else {
        return bad_request("the patch is not JSON");
    };
    write(s, kind, ns, name, |old| {
        check_version(&patch, old)?;
        let mut new = old.clone();
        let mut patch = patch.clone();
        // Writes to the main resource ignore status; writes to status ignore
        // everything but status and metadata (as the real registry does).
        if let Some(p) = patch.as_object_mut() {
            match part {
                Part::Main if kind != Kind::Event => {
                    p.remove("status");
                }
                Part::Status => p.retain(|k, _| k == "status" || k == "metadata"),
                Part::Main => {}
            }
        }
        merge(&mut new, &patch);
        Ok(new)
    })
}

/// A write refused, answered as a `Status`.
struct Refusal {
    code: StatusCode,
    reason: &'static str,
    message: String,
}

impl Refusal {
    fn into_response(self) -> Response {
        status_error(self.code, self.reason, &self.message)
    }
}

const MODIFIED: &str =
    "the object has been modified; please apply your changes to the latest version and try again";

/// 409 where `new` names a resourceVersion other than the stored one.
fn check_version(new: &Value, old: &Value) -> Result<(), Refusal> {
    let wanted = new
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str);
    let stored = old
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str);
    match wanted {
        Some(w) if Some(w) != stored => Err(conflict(MODIFIED.to_owned())),
        _ => Ok(()),
    }
}

fn conflict(message: String) -> Refusal {
    Refusal {
        code: StatusCode::CONFLICT,
        reason: "Conflict",
        message,
    }
}

/// Reads, changes and stores one object under the lock.
fn write(
    s: &Shared,
    kind: Kind,
    ns: &str,
    name: &str,
    change: impl FnOnce(&Value) -> Result<Value, Refusal>,
) -> Response {
    let mut store = s.lock();
    if store.conflicts > 0 {
        store.conflicts -= 1;
        return conflict(format!("{MODIFIED} (injected)")).into_response();
    }
    let fail = match &mut store.failing_writes {
        Some((k, n, applied)) if *k == kind && *n > 0 => {
            *n -= 1;
            Some(*applied)
        }
        _ => None,
    };
    let internal_error = || {
        status_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "Internal error occurred: etcdserver: request timed out (injected)",
        )
    };
    if fail == Some(false) {
        return internal_error();
    }
    let key = (kind, ns.to_owned(), name.to_owned());
    let Some(old) = store.objects.get(&key) else {
        return not_found(kind, name);
    };
    let mut new = match change(old) {
        Ok(new) => new,
        Err(refusal) => return refusal.into_response(),
    };
    // Identity stays the server's.
    if let Some(meta) = new.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("name".into(), json!(name));
        meta.remove("resourceVersion");
        meta.remove("uid");
    }
    if let Some(o) = new.as_object_mut() {
        o.insert("kind".into(), json!(kind.name()));
    }
    let (stored, change) = store.upsert(new);
    drop(store);
    if let Some(change) = change {
        let _ = s.changes.send(change);
    }
    if fail == Some(true) {
        return internal_error();
    }
    axum::Json(stored).into_response()
}

fn create(s: &Shared, kind: Kind, ns: &str, body: &[u8]) -> Response {
    let Ok(mut object) = serde_json::from_slice::<Value>(body) else {
        return bad_request("the body is not JSON");
    };
    let mut store = s.lock();
    let name = meta_str(&object, "name").map(str::to_owned);
    let name = match name.filter(|n| !n.is_empty()) {
        Some(name) => name,
        // generateName: the prefix and five characters, as the real
        // server's SimpleNameGenerator (here counted, not random).
        None => match meta_str(&object, "generateName").filter(|n| !n.is_empty()) {
            Some(prefix) => format!("{prefix}{}", generated_suffix(store.version + 1)),
            None => {
                return status_error(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "Invalid",
                    "metadata.name: Required value: name or generateName is required",
                )
            }
        },
    };
    if store
        .objects
        .contains_key(&(kind, ns.to_owned(), name.clone()))
    {
        return status_error(
            StatusCode::CONFLICT,
            "AlreadyExists",
            &format!("{} \"{name}\" already exists", kind.resource()),
        );
    }
    if let Some(o) = object.as_object_mut() {
        o.insert("kind".into(), json!(kind.name()));
        if kind == Kind::ResourceClaim {
            // Status must not be set by the user on create.
            o.remove("status");
        }
        if let Some(meta) = o.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.insert("name".into(), json!(name));
            if kind.namespaced() {
                meta.insert("namespace".into(), json!(ns));
            }
        }
    }
    let (stored, change) = store.upsert(object);
    drop(store);
    if let Some(change) = change {
        let _ = s.changes.send(change);
    }
    (StatusCode::CREATED, axum::Json(stored)).into_response()
}

/// `DELETE …/{name}`, honouring the body's `preconditions` (uid,
/// resourceVersion). Answers the deleted object (the resource registries
/// set `ReturnDeletedObject`).
fn delete_one(s: &Shared, kind: Kind, ns: &str, name: &str, body: &[u8]) -> Response {
    let options: Value = if body.is_empty() {
        Value::Null
    } else {
        match serde_json::from_slice(body) {
            Ok(options) => options,
            Err(_) => return bad_request("the DeleteOptions body is not JSON"),
        }
    };
    let mut store = s.lock();
    let key = (kind, ns.to_owned(), name.to_owned());
    let Some(stored) = store.objects.get(&key) else {
        return not_found(kind, name);
    };
    for (field, meta) in [("uid", "uid"), ("resourceVersion", "resourceVersion")] {
        let wanted = options
            .pointer(&format!("/preconditions/{field}"))
            .and_then(Value::as_str);
        let actual = meta_str(stored, meta).unwrap_or_default();
        if let Some(wanted) = wanted.filter(|w| *w != actual) {
            let label = if field == "uid" {
                "UID"
            } else {
                "ResourceVersion"
            };
            return conflict(format!(
                "Operation cannot be fulfilled on {} \"{name}\": Precondition failed: \
                 {label} in precondition: {wanted}, {label} in object meta: {actual}",
                kind.resource()
            ))
            .into_response();
        }
    }
    let Some((object, change)) = store.remove(&key) else {
        return not_found(kind, name);
    };
    drop(store);
    let _ = s.changes.send(change);
    axum::Json(object).into_response()
}

/// Deletes every object of `kind` (in `ns`, if given) that `selector`
/// matches; returns them.
fn delete_matching(s: &Shared, kind: Kind, ns: Option<&str>, selector: &Selector) -> Vec<Value> {
    let mut store = s.lock();
    let keys: Vec<Key> = store
        .objects
        .iter()
        .filter(|((k, namespace, _), v)| {
            *k == kind && ns.is_none_or(|ns| ns == namespace) && selector.matches(v)
        })
        .map(|(key, _)| key.clone())
        .collect();
    let mut deleted = Vec::with_capacity(keys.len());
    let mut changes = Vec::with_capacity(keys.len());
    for key in keys {
        if let Some((object, change)) = store.remove(&key) {
            deleted.push(object);
            changes.push(change);
        }
    }
    drop(store);
    for change in changes {
        let _ = s.changes.send(change);
    }
    deleted
}

fn get_one(s: &Shared, kind: Kind, ns: &str, name: &str) -> Response {
    match s
        .lock()
        .objects
        .get(&(kind, ns.to_owned(), name.to_owned()))
    {
        Some(object) => axum::Json(object.clone()).into_response(),
        None => not_found(kind, name),
    }
}

/// A list, or with `watch=true` a stream of watch events, one JSON object a
/// line: first the changes after `resourceVersion` (or every object as
/// ADDED when it is absent or 0), then live ones until `timeoutSeconds`.
fn list_or_watch(
    s: &Arc<Shared>,
    kind: Kind,
    ns: Option<&str>,
    q: &HashMap<String, String>,
) -> Response {
    let selector = match Selector::parse(kind, q) {
        Ok(selector) => selector,
        Err(message) => return bad_request(&message),
    };
    let in_scope = {
        let ns = ns.map(str::to_owned);
        move |object: &Value| {
            ns.as_deref()
                .is_none_or(|ns| meta_str(object, "namespace") == Some(ns))
                && selector.matches(object)
        }
    };
    let watch = matches!(q.get("watch").map(String::as_str), Some("true" | "1"));
    let store = s.lock();
    let resumed = q
        .get("resourceVersion")
        .is_some_and(|v| !matches!(v.as_str(), "" | "0"));
    if watch && resumed && store.expired.contains(&kind) {
        let gone = json!({"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "too old resource version", "reason": "Expired", "code": 410,
        }});
        return Response::builder()
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(format!("{gone}\n")))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    let from: Option<u64> = q.get("resourceVersion").and_then(|v| v.parse().ok());
    if let (true, Some(from), Some(&oldest)) = (watch, from, store.compacted.get(&kind)) {
        if from != 0 && from < oldest {
            return status_error(
                StatusCode::GONE,
                "Expired",
                &format!("too old resource version: {from} ({oldest})"),
            );
        }
    }
    if store.forbidden.contains(&kind) {
        let verb = if watch { "watch" } else { "list" };
        let group = kind
            .api_version()
            .rsplit_once('/')
            .map_or("", |(group, _)| group);
        let plural = kind.resource().split('.').next().unwrap_or_default();
        let scope = ns.map_or_else(
            || "at the cluster scope".to_owned(),
            |ns| format!("in the namespace \"{ns}\""),
        );
        return status_error(
            StatusCode::FORBIDDEN,
            "Forbidden",
            &format!(
                "{} is forbidden: User \"fake\" cannot {verb} resource \"{plural}\" in API \
                 group \"{group}\" {scope}",
                kind.resource()
            ),
        );
    }
    if !watch {
        let items: Vec<Value> = store
            .objects
            .iter()
            .filter(|((k, _, _), v)| *k == kind && in_scope(v))
            .map(|(_, v)| v.clone())
            .collect();
        return axum::Json(json!({
            "kind": format!("{}List", kind.name()),
            "apiVersion": kind.api_version(),
            "metadata": {"resourceVersion": store.version.to_string()},
            "items": items,
        }))
        .into_response();
    }
    let since: u64 = match q.get("resourceVersion").map(String::as_str) {
        None | Some("" | "0") => 0,
        Some(v) => match v.parse() {
            Ok(v) => v,
            Err(_) => return bad_request(&format!("resourceVersion {v:?} is not a number")),
        },
    };
    let backlog: Vec<(String, &'static str, Value)> = if since == 0 {
        store
            .objects
            .iter()
            .filter(|((k, _, _), v)| *k == kind && in_scope(v))
            .map(|(_, v)| (version_of(v), "ADDED", v.clone()))
            .collect()
    } else {
        store
            .history
            .iter()
            .filter(|c| c.kind == kind && c.version > since && in_scope(&c.object))
            .map(|c| (c.version.to_string(), c.kind_of_change, c.object.clone()))
            .collect()
    };
    let last = store.version;
    let mut live = s.changes.subscribe();
    drop(store);
    let ended = s
        .watches
        .lock()
        .unwrap_or_else(|poison| poison.into_inner())
        .clone();
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .map_or(Duration::from_secs(300), Duration::from_secs);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(64);
    let shared = Arc::clone(s);
    tokio::spawn(async move {
        let line = |kind_of_change: &str, object: &Value| {
            let mut text = json!({"type": kind_of_change, "object": object}).to_string();
            text.push('\n');
            Ok(Bytes::from(text))
        };
        for (_, kind_of_change, object) in &backlog {
            if tx.send(line(kind_of_change, object)).await.is_err() {
                return;
            }
        }
        // The watcher has now seen every write up to `last`, whether in the
        // backlog or in the list it started after.
        shared.mark_delivered(kind, last);
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        loop {
            let change = tokio::select! {
                () = &mut deadline => return,
                () = ended.cancelled() => return,
                () = tx.closed() => return,
                change = live.recv() => change,
            };
            match change {
                Ok(c) if c.kind == kind && c.version > last && in_scope(&c.object) => {
                    let mut held = shared.held.subscribe();
                    tokio::select! {
                        () = ended.cancelled() => return,
                        () = tx.closed() => return,
                        released = held.wait_for(|held| !held.contains(&kind)) => {
                            if released.is_err() {
                                return;
                            }
                        }
                    }
                    if tx.send(line(c.kind_of_change, &c.object)).await.is_err() {
                        return;
                    }
                    shared.mark_delivered(kind, c.version);
                }
                Ok(_) => {}
                // Fell behind: end the watch; the client relists.
                Err(_) => return,
            }
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// Field (`a.b=v`, `a.b!=v`) and label (`k=v`, `k!=v`, `k`) selectors.
#[derive(Default, Clone)]
struct Selector {
    fields: Vec<(String, bool, String)>,
    labels: Vec<(String, Option<(bool, String)>)>,
}

impl Selector {
    fn parse(kind: Kind, q: &HashMap<String, String>) -> Result<Selector, String> {
        let mut selector = Selector::default();
        let terms = |text: Option<&String>| -> Vec<String> {
            text.map(|t| {
                t.split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
        };
        for term in terms(q.get("fieldSelector")) {
            let (path, equal, value) =
                split_term(&term).ok_or_else(|| format!("invalid field selector term {term:?}"))?;
            if !kind.selectable(&path) {
                return Err(format!("field label not supported: {path}"));
            }
            selector.fields.push((path, equal, value));
        }
        for term in terms(q.get("labelSelector")) {
            match split_term(&term) {
                Some((key, equal, value)) => selector.labels.push((key, Some((equal, value)))),
                None => selector.labels.push((term, None)),
            }
        }
        Ok(selector)
    }

    fn matches(&self, object: &Value) -> bool {
        let fields = self.fields.iter().all(|(path, equal, value)| {
            let pointer = format!("/{}", path.replace('.', "/"));
            let actual = object
                .pointer(&pointer)
                .and_then(Value::as_str)
                .unwrap_or("");
            (actual == value) == *equal
        });
        let labels = self.labels.iter().all(|(key, test)| {
            let actual = object
                .pointer("/metadata/labels")
                .and_then(|l| l.get(key))
                .and_then(Value::as_str);
            match test {
                None => actual.is_some(),
                Some((equal, value)) => (actual == Some(value.as_str())) == *equal,
            }
        });
        fields && labels
    }
}

fn split_term(term: &str) -> Option<(String, bool, String)> {
    if let Some((k, v)) = term.split_once("!=") {
        return Some((k.to_owned(), false, v.to_owned()));
    }
    let (k, v) = term.split_once("==").or_else(|| term.split_once('='))?;
    Some((k.to_owned(), true, v.to_owned()))
}

/// RFC 7386 JSON merge patch.
fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    if let Value::Object(target) = target {
        for (key, value) in patch {
            if value.is_null() {
                target.remove(key);
            } else {
                merge(target.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}

fn meta_str<'a>(object: &'a Value, field: &str) -> Option<&'a str> {
    object.get("metadata")?.get(field)?.as_str()
}

fn version_of(object: &Value) -> String {
    meta_str(object, "resourceVersion")
        .unwrap_or("0")
        .to_owned()
}

fn set_version(object: &mut Value, version: u64) {
    if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("resourceVersion".into(), json!(version.to_string()));
    }
}

fn fake_uid(n: u64) -> String {
    format!("00000000-0000-4000-8000-{n:012x}")
}

fn not_found(kind: Kind, name: &str) -> Response {
    status_error(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("{} \"{name}\" not found", kind.resource()),
    )
}

/// Five characters from the real name generator's alphabet, derived from `n`.
fn generated_suffix(n: u64) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut n = n;
    (0..5)
        .map(|_| {
            let c = ALPHABET[(n % ALPHABET.len() as u64) as usize];
            n /= ALPHABET.len() as u64;
            char::from(c)
        })
        .collect()
}

/// Whether a ResourceSlice uses `DRAConsumableCapacity` (the real
/// strategy's `draConsumableCapacityFeatureInUse`): any device with
/// `allowMultipleAllocations` or any capacity with a `requestPolicy`.
fn slice_uses_consumable_capacity(slice: Option<&Value>) -> bool {
    let Some(devices) = slice
        .and_then(|s| s.pointer("/spec/devices"))
        .and_then(Value::as_array)
    else {
        return false;
    };
    devices.iter().any(|device| {
        present(device.get("allowMultipleAllocations"))
            || device
                .get("capacity")
                .and_then(Value::as_object)
                .is_some_and(|c| c.values().any(|cap| present(cap.get("requestPolicy"))))
    })
}

fn drop_slice_consumable_capacity(slice: &mut Value) {
    for device in objects_mut(slice.pointer_mut("/spec/devices")) {
        device.remove("allowMultipleAllocations");
        if let Some(capacity) = device.get_mut("capacity").and_then(Value::as_object_mut) {
            for cap in capacity.values_mut().filter_map(Value::as_object_mut) {
                cap.remove("requestPolicy");
            }
        }
    }
}

/// `resourceclaimspec.DRAConsumableCapacityFeatureInUse`: a constraint's
/// `distinctAttribute`, or a capacity request in `exactly` or a
/// `firstAvailable` subrequest.
fn claim_spec_uses_consumable_capacity(claim: &Value) -> bool {
    let devices = claim.pointer("/spec/devices");
    let constraints = devices
        .and_then(|d| d.get("constraints"))
        .and_then(Value::as_array);
    if constraints.is_some_and(|c| c.iter().any(|c| present(c.get("distinctAttribute")))) {
        return true;
    }
    let requests = devices
        .and_then(|d| d.get("requests"))
        .and_then(Value::as_array);
    requests.is_some_and(|requests| {
        requests.iter().any(|r| {
            present(r.pointer("/exactly/capacity"))
                || r.get("firstAvailable")
                    .and_then(Value::as_array)
                    .is_some_and(|subs| subs.iter().any(|s| present(s.get("capacity"))))
        })
    })
}

/// The status half of the real strategy's `draConsumableCapacityFeatureInUse`.
fn claim_status_uses_consumable_capacity(claim: &Value) -> bool {
    let results = claim
        .pointer("/status/allocation/devices/results")
        .and_then(Value::as_array);
    let devices = claim.pointer("/status/devices").and_then(Value::as_array);
    results.is_some_and(|results| {
        results
            .iter()
            .any(|r| present(r.get("shareID")) || present(r.get("consumedCapacity")))
    }) || devices.is_some_and(|d| d.iter().any(|d| present(d.get("shareID"))))
}

fn drop_claim_spec_consumable_capacity(claim: &mut Value) {
    for constraint in objects_mut(claim.pointer_mut("/spec/devices/constraints")) {
        constraint.remove("distinctAttribute");
    }
    for request in objects_mut(claim.pointer_mut("/spec/devices/requests")) {
        if let Some(exactly) = request.get_mut("exactly").and_then(Value::as_object_mut) {
            exactly.remove("capacity");
        }
        for sub in objects_mut(request.get_mut("firstAvailable")) {
            sub.remove("capacity");
        }
    }
}

fn drop_claim_status_consumable_capacity(claim: &mut Value) {
    for result in objects_mut(claim.pointer_mut("/status/allocation/devices/results")) {
        result.remove("shareID");
        result.remove("consumedCapacity");
    }
    for device in objects_mut(claim.pointer_mut("/status/devices")) {
        device.remove("shareID");
    }
}

/// The objects of `array`: none where the field is absent or not an
/// array, as the strategies skip a nil list.
fn objects_mut(array: Option<&mut Value>) -> impl Iterator<Item = &mut Map<String, Value>> {
    array
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
        .filter_map(Value::as_object_mut)
}

/// Set and not null (Go's `!= nil`).
fn present(value: Option<&Value>) -> bool {
    value.is_some_and(|v| !v.is_null())
}

/// Rewrites a slice's capacity quantities (`value`, and `requestPolicy`'s
/// `default`, `validValues` and `validRange`) in canonical form.
fn canonicalize_slice(slice: &mut Value) {
    let fix = |q: &mut Value| {
        if let Some(canonical) = q.as_str().and_then(canonical_quantity) {
            *q = Value::String(canonical);
        }
    };
    for device in objects_mut(slice.pointer_mut("/spec/devices")) {
        let Some(capacity) = device.get_mut("capacity").and_then(Value::as_object_mut) else {
            continue;
        };
        for cap in capacity.values_mut() {
            if let Some(value) = cap.get_mut("value") {
                fix(value);
            }
            let Some(policy) = cap.get_mut("requestPolicy") else {
                continue;
            };
            if let Some(default) = policy.get_mut("default") {
                fix(default);
            }
            if let Some(values) = policy.get_mut("validValues").and_then(Value::as_array_mut) {
                values.iter_mut().for_each(fix);
            }
            if let Some(range) = policy.get_mut("validRange").and_then(Value::as_object_mut) {
                for bound in ["min", "max", "step"] {
                    if let Some(q) = range.get_mut(bound) {
                        fix(q);
                    }
                }
            }
        }
    }
}

/// A quantity as the real server writes it back (`resource.Quantity`'s
/// `CanonicalizeBytes`): binary-suffixed values in the largest power of 1024
/// that keeps them whole (`1024Mi` → `1Gi`; under 1024 or fractional
/// bytes: decimal), decimal ones in the largest power of 1000 (`1000k` →
/// `1M`, `0.5` → `500m`). `None` (leave it) for exponent forms and for
/// what is finer than a milli-unit or not a quantity.
fn canonical_quantity(text: &str) -> Option<String> {
    let (sign, rest) = match text.as_bytes().first()? {
        b'-' => (-1i128, &text[1..]),
        b'+' => (1, &text[1..]),
        _ => (1, text),
    };
    let number_end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    let (number, suffix) = rest.split_at(number_end);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return None;
    }
    let binary = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    let decimal = ["m", "", "k", "M", "G", "T", "P", "E"];
    // The value in thousandths: `scale` over 1000^k or 1024^k.
    let (is_binary, multiplier): (bool, i128) =
        if let Some(k) = binary.iter().position(|s| *s == suffix).filter(|k| *k > 0) {
            (true, 1000 * 1024i128.pow(u32::try_from(k).ok()?))
        } else {
            let k = decimal.iter().position(|s| *s == suffix)?;
            (false, 1000i128.pow(u32::try_from(k).ok()?))
        };
    let digits: i128 = format!("{whole}{fraction}").parse().ok()?;
    let divisor = 10i128.checked_pow(u32::try_from(fraction.len()).ok()?)?;
    let scaled = digits.checked_mul(multiplier)?;
    if scaled % divisor != 0 {
        return None;
    }
    let milli = sign * (scaled / divisor);
    if is_binary && milli % 1000 == 0 && milli.abs() >= 1024 * 1000 {
        let mut bytes = milli / 1000;
        let mut k = 0;
        while k + 1 < binary.len() && bytes % 1024 == 0 {
            bytes /= 1024;
            k += 1;
        }
        return Some(format!("{bytes}{}", binary[k]));
    }
    if milli == 0 {
        return Some("0".into());
    }
    let mut mantissa = milli;
    let mut k = 0;
    while k + 1 < decimal.len() && mantissa % 1000 == 0 {
        mantissa /= 1000;
        k += 1;
    }
    Some(format!("{mantissa}{}", decimal[k]))
}

fn bad_request(message: &str) -> Response {
    status_error(StatusCode::BAD_REQUEST, "BadRequest", message)
}

fn status_error(code: StatusCode, reason: &str, message: &str) -> Response {
    (
        code,
        axum::Json(json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code.as_u16(),
        })),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_patch_follows_rfc_7386() {
        let mut target = json!({"a": {"b": 1, "c": 2}, "d": [1]});
        merge(&mut target, &json!({"a": {"b": null, "e": 3}, "d": [2]}));
        assert_eq!(target, json!({"a": {"c": 2, "e": 3}, "d": [2]}));
    }

    #[test]
    fn selectors_match_fields_and_labels() {
        let pod = json!({"metadata": {"name": "p", "labels": {"app": "x"}}, "spec": {"nodeName": "n1"}, "status": {"phase": "Pending"}});
        let q = |f: &str, l: &str| {
            HashMap::from([
                ("fieldSelector".to_owned(), f.to_owned()),
                ("labelSelector".to_owned(), l.to_owned()),
            ])
        };
        let s = |f, l| Selector::parse(Kind::Pod, &q(f, l)).unwrap().matches(&pod);
        assert!(s("spec.nodeName=n1", ""));
        assert!(!s("spec.nodeName=n2", ""));
        assert!(s("spec.nodeName=n1,status.phase!=Succeeded", "app=x"));
        assert!(!s("", "app!=x"));
        assert!(s("", "app"));
        assert!(Selector::parse(Kind::Pod, &q("spec.unknown=1", "")).is_err());
        assert!(Selector::parse(Kind::ResourceSlice, &q("spec.driver=d", "")).is_ok());
        assert!(Selector::parse(Kind::ResourceSlice, &q("status.phase=x", "")).is_err());
    }

    #[test]
    fn quantities_are_canonical() {
        for (given, canonical) in [
            ("1024Mi", "1Gi"),
            ("15079Mi", "15079Mi"),
            ("14336Mi", "14Gi"),
            ("1Gi", "1Gi"),
            ("16384Mi", "16Gi"),
            ("1.5Gi", "1536Mi"),
            ("0.5Ki", "512"),
            ("1536", "1536"),
            ("1000", "1k"),
            ("1000k", "1M"),
            ("0.5", "500m"),
            ("0", "0"),
            ("0Mi", "0"),
            ("-2048Ki", "-2Mi"),
        ] {
            assert_eq!(
                canonical_quantity(given).as_deref(),
                Some(canonical),
                "{given}"
            );
        }
        for left in ["1e3", "Mi", "", "1.2.3", "1Qi", "0.0001"] {
            assert_eq!(canonical_quantity(left), None, "{left}");
        }
    }

    use futures_util::{StreamExt, TryStreamExt};
    use k8s_openapi::api::resource::v1::{
        DeviceRequest, DeviceRequestAllocationResult, ResourceClaim, ResourceSlice,
    };
    use kube::api::{
        Api, DeleteParams, ListParams, PostParams, Preconditions, WatchEvent, WatchParams,
    };

    fn client(api: &FakeApiServer) -> kube::Client {
        kube::Client::try_from(kube::Config::new(api.url().parse().unwrap())).unwrap()
    }

    fn slice(name: &str, node: &str, driver: &str) -> ResourceSlice {
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {
                "driver": driver,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [{
                    "name": "gpu-0",
                    "allowMultipleAllocations": true,
                    "capacity": {"memory": {
                        "value": "16384Mi",
                        "requestPolicy": {
                            "default": "16384Mi",
                            "validRange": {"min": "1024Mi", "max": "16Gi", "step": "1024Mi"},
                        },
                    }},
                }],
            },
        }))
        .unwrap()
    }

    fn names(slices: &[ResourceSlice]) -> Vec<&str> {
        slices
            .iter()
            .map(|s| s.metadata.name.as_deref().unwrap_or(""))
            .collect()
    }

    #[tokio::test]
    async fn slices_list_and_watch_by_field() {
        let server = FakeApiServer::start().await.unwrap();
        let api: Api<ResourceSlice> = Api::all(client(&server));
        let pp = PostParams::default();
        for (name, node, driver) in [("a-x", "a", "x"), ("a-y", "a", "y"), ("b-x", "b", "x")] {
            api.create(&pp, &slice(name, node, driver)).await.unwrap();
        }
        let on_a = api
            .list(&ListParams::default().fields("spec.nodeName=a"))
            .await
            .unwrap();
        assert_eq!(names(&on_a.items), ["a-x", "a-y"]);
        let a_x = ListParams::default().fields("spec.nodeName=a,spec.driver=x");
        assert_eq!(names(&api.list(&a_x).await.unwrap().items), ["a-x"]);
        let err = api
            .list(&ListParams::default().fields("spec.pool.name=a"))
            .await
            .unwrap_err();
        assert!(matches!(err, kube::Error::Api(s) if s.code == 400));
        assert!(server.requests().iter().any(|r| {
            r.starts_with("GET /apis/resource.k8s.io/v1/resourceslices?")
                && r.contains("fieldSelector=spec.nodeName%3Da%2Cspec.driver%3Dx")
        }));

        let wp = WatchParams::default().fields("spec.nodeName=a,spec.driver=x");
        let version = on_a.metadata.resource_version.unwrap();
        let mut events = api.watch(&wp, &version).await.unwrap().boxed();
        api.create(&pp, &slice("b-x2", "b", "x")).await.unwrap();
        api.delete("a-y", &DeleteParams::default()).await.unwrap();
        api.delete("a-x", &DeleteParams::default()).await.unwrap();
        match events.try_next().await.unwrap() {
            Some(WatchEvent::Deleted(s)) => assert_eq!(s.metadata.name.as_deref(), Some("a-x")),
            other => panic!("{other:?}"),
        }
    }

    /// A client that listed before it watched has seen the listed writes:
    /// `watch_delivered` must not wait for a live event that never comes.
    #[tokio::test]
    async fn a_watch_started_after_a_list_counts_as_delivered_up_to_the_list() {
        let server = FakeApiServer::start().await.unwrap();
        let api: Api<ResourceSlice> = Api::all(client(&server));
        let created = api
            .create(&PostParams::default(), &slice("s", "a", "x"))
            .await
            .unwrap();
        let version: u64 = created.metadata.resource_version.unwrap().parse().unwrap();
        let listed = api.list(&ListParams::default()).await.unwrap();
        let since = listed.metadata.resource_version.unwrap();
        let _events = api.watch(&WatchParams::default(), &since).await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while server.watch_delivered(Kind::ResourceSlice) < version {
            assert!(
                std::time::Instant::now() < deadline,
                "watch_delivered stayed at {} below {version}",
                server.watch_delivered(Kind::ResourceSlice)
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn slices_are_replaced_with_versions_and_generations_and_canonical_quantities() {
        let server = FakeApiServer::start().await.unwrap();
        let api: Api<ResourceSlice> = Api::all(client(&server));
        let created = api
            .create(&PostParams::default(), &slice("s", "a", "x"))
            .await
            .unwrap();
        assert_eq!(created.metadata.generation, Some(1));
        let memory = &created.spec.devices.as_ref().unwrap()[0]
            .capacity
            .as_ref()
            .unwrap()["memory"];
        assert_eq!(memory.value.0, "16Gi");
        let range = memory
            .request_policy
            .as_ref()
            .unwrap()
            .valid_range
            .as_ref()
            .unwrap();
        assert_eq!(
            (
                range.min.0.as_str(),
                range.step.as_ref().unwrap().0.as_str()
            ),
            ("1Gi", "1Gi")
        );

        // Same spec: the generation stays; a changed spec bumps it.
        let same = api
            .replace("s", &PostParams::default(), &created)
            .await
            .unwrap();
        assert_eq!(same.metadata.generation, Some(1));
        let mut changed = same.clone();
        changed.spec.pool.generation = 2;
        let changed = api
            .replace("s", &PostParams::default(), &changed)
            .await
            .unwrap();
        assert_eq!(changed.metadata.generation, Some(2));
        // A stale resourceVersion is a conflict.
        let err = api
            .replace("s", &PostParams::default(), &created)
            .await
            .unwrap_err();
        assert!(matches!(err, kube::Error::Api(s) if s.code == 409));
        // Without one, the write is unconditional.
        let mut unconditional = created.clone();
        unconditional.metadata.resource_version = None;
        api.replace("s", &PostParams::default(), &unconditional)
            .await
            .unwrap();

        // generateName, as the upstream helper names slices.
        let mut generated = slice("", "a", "x");
        generated.metadata.name = None;
        generated.metadata.generate_name = Some("00000-x-a-".into());
        let generated = api
            .create(&PostParams::default(), &generated)
            .await
            .unwrap();
        let name = generated.metadata.name.unwrap();
        assert!(name.starts_with("00000-x-a-") && name.len() == 15, "{name}");
        let again = api
            .create(&PostParams::default(), &slice("s", "a", "x"))
            .await
            .unwrap_err();
        assert!(matches!(err_code(&again), Some(409)));
    }

    fn err_code(err: &kube::Error) -> Option<u16> {
        match err {
            kube::Error::Api(s) => Some(s.code),
            _ => None,
        }
    }

    #[tokio::test]
    async fn slices_are_deleted_by_name_with_preconditions_and_by_field() {
        let server = FakeApiServer::start().await.unwrap();
        let api: Api<ResourceSlice> = Api::all(client(&server));
        let pp = PostParams::default();
        for (name, node, driver) in [
            ("a-x", "a", "x"),
            ("a-y", "a", "y"),
            ("b-x", "b", "x"),
            ("c-x", "c", "x"),
        ] {
            api.create(&pp, &slice(name, node, driver)).await.unwrap();
        }
        let wrong = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some("not-its-uid".into()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        let err = api.delete("c-x", &wrong).await.unwrap_err();
        assert_eq!(err_code(&err), Some(409));
        let deleted = api.delete("c-x", &DeleteParams::default()).await.unwrap();
        assert!(deleted.is_left(), "the deleted object comes back");
        assert_eq!(err_code(&api.get("c-x").await.unwrap_err()), Some(404));

        // What kubelet sends at start.
        let gone = api
            .delete_collection(
                &DeleteParams::default(),
                &ListParams::default().fields("spec.nodeName=a"),
            )
            .await
            .unwrap();
        let gone = gone.left().unwrap();
        assert_eq!(names(&gone.items), ["a-x", "a-y"]);
        assert!(server.requests().iter().any(|r| r
            .starts_with("DELETE /apis/resource.k8s.io/v1/resourceslices?")
            && r.contains("fieldSelector=spec.nodeName%3Da")));
        assert_eq!(
            names(&api.list(&ListParams::default()).await.unwrap().items),
            ["b-x"]
        );
        // The test-side kubelet.
        assert_eq!(server.delete_node_slices("b", Some("y")).len(), 0);
        assert_eq!(server.delete_node_slices("b", None).len(), 1);
        assert!(server.list(Kind::ResourceSlice).is_empty());
    }

    fn claim(name: &str) -> Value {
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "team"},
            "spec": {"devices": {"requests": [{
                "name": "gpu",
                "exactly": {
                    "deviceClassName": "gpumem.io",
                    "capacity": {"requests": {"memory": "4Gi"}},
                },
            }]}},
            "status": {"allocation": {"devices": {"results": [{
                "request": "gpu",
                "driver": "gpumem.io",
                "pool": "a",
                "device": "gpu-0",
                "shareID": "6a3f0c2e-0000-4000-8000-000000000001",
                "consumedCapacity": {"memory": "4Gi"},
            }]}}},
        })
    }

    fn first_request(claim: &ResourceClaim) -> &DeviceRequest {
        let devices = claim.spec.as_ref().unwrap().devices.as_ref().unwrap();
        &devices.requests.as_ref().unwrap()[0]
    }

    fn first_result(claim: &ResourceClaim) -> &DeviceRequestAllocationResult {
        let allocation = claim.status.as_ref().unwrap().allocation.as_ref().unwrap();
        &allocation
            .devices
            .as_ref()
            .unwrap()
            .results
            .as_ref()
            .unwrap()[0]
    }

    #[tokio::test]
    async fn claims_are_served_and_lose_consumable_capacity_without_the_gate() {
        let server = FakeApiServer::start().await.unwrap();
        let client = client(&server);
        let team: Api<ResourceClaim> = Api::namespaced(client.clone(), "team");
        server.put(claim("with-gate"));
        let got = team.get("with-gate").await.unwrap();
        let result = first_result(&got);
        assert!(result.share_id.is_some() && result.consumed_capacity.is_some());
        let all: Api<ResourceClaim> = Api::all(client.clone());
        assert_eq!(
            all.list(&ListParams::default()).await.unwrap().items.len(),
            1
        );
        let other: Api<ResourceClaim> = Api::namespaced(client.clone(), "other");
        assert!(other
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty());
        assert_eq!(
            err_code(&other.get("with-gate").await.unwrap_err()),
            Some(404)
        );

        server.drop_consumable_capacity(true);
        server.put(claim("without-gate"));
        let got = team.get("without-gate").await.unwrap();
        let request = first_request(&got);
        assert!(request.exactly.as_ref().unwrap().capacity.is_none());
        let result = first_result(&got);
        assert!(result.share_id.is_none() && result.consumed_capacity.is_none());
        assert_eq!(result.device, "gpu-0");
        // A claim that already used the feature keeps it on update.
        let kept = server.put(claim("with-gate"));
        assert!(kept
            .pointer("/status/allocation/devices/results/0/shareID")
            .is_some());

        // Create over REST: status is the server's, capacity dropped.
        let posted: ResourceClaim = serde_json::from_value(claim("posted")).unwrap();
        let created = team.create(&PostParams::default(), &posted).await.unwrap();
        assert!(created.status.is_none());
        let request = first_request(&created);
        assert!(request.exactly.as_ref().unwrap().capacity.is_none());

        // Watch from the start: every claim of the namespace as ADDED.
        let mut events = team
            .watch(&WatchParams::default(), "0")
            .await
            .unwrap()
            .boxed();
        let mut seen = Vec::new();
        for _ in 0..3 {
            if let Some(Ok(WatchEvent::Added(c))) = events.next().await {
                seen.push(c.metadata.name.unwrap());
            }
        }
        seen.sort();
        assert_eq!(seen, ["posted", "with-gate", "without-gate"]);
    }

    #[tokio::test]
    async fn slices_lose_consumable_capacity_only_where_unused() {
        let server = FakeApiServer::start().await.unwrap();
        let api: Api<ResourceSlice> = Api::all(client(&server));
        let pp = PostParams::default();
        let kept = |s: &ResourceSlice| {
            let device = &s.spec.devices.as_ref().unwrap()[0];
            (
                device.allow_multiple_allocations.is_some(),
                device.capacity.as_ref().unwrap()["memory"]
                    .request_policy
                    .is_some(),
            )
        };
        // Created with the gate: kept, and kept by updates without it.
        let with = api.create(&pp, &slice("with", "a", "x")).await.unwrap();
        server.drop_consumable_capacity(true);
        let updated = api.replace("with", &pp, &with).await.unwrap();
        assert_eq!(kept(&updated), (true, true));
        // Created without: dropped, and dropped again on update.
        let without = api.create(&pp, &slice("without", "b", "x")).await.unwrap();
        assert_eq!(kept(&without), (false, false));
        let mut again = slice("without", "b", "x");
        again.metadata.resource_version = without.metadata.resource_version.clone();
        let again = api.replace("without", &pp, &again).await.unwrap();
        assert_eq!(kept(&again), (false, false));
        // Once the gate is on, an update adds them.
        server.drop_consumable_capacity(false);
        let mut on = slice("without", "b", "x");
        on.metadata.resource_version = again.metadata.resource_version.clone();
        assert_eq!(
            kept(&api.replace("without", &pp, &on).await.unwrap()),
            (true, true)
        );
    }
}
