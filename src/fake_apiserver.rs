//! An in-process Kubernetes API server for `gpumem demo` and the tests: the
//! real REST paths and JSON that gpumem's client (kube-rs) and kubectl use,
//! over plain HTTP on loopback, with objects held as JSON.
//!
//! It serves what gpumem touches and no more: pods (list and watch with field
//! and label selectors, get, create, merge and strategic-merge patch,
//! binding), nodes (list, watch, get, patch, patch of `status`) and
//! `events.k8s.io/v1` events. Like the real server it bumps
//! `metadata.resourceVersion` on every write, answers a write that names a
//! stale resourceVersion with 409 Conflict, ignores `status` sent to a main
//! resource, and resumes a watch from a resourceVersion. Strategic merge is
//! applied as a JSON merge patch: the same for the maps gpumem patches
//! (annotations, capacity).

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, Query, Request, State};
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
}

impl Kind {
    fn api_version(self) -> &'static str {
        match self {
            Kind::Pod | Kind::Node => "v1",
            Kind::Event => "events.k8s.io/v1",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Node => "Node",
            Kind::Event => "Event",
        }
    }

    fn of(object: &Value) -> Option<Kind> {
        match object.get("kind")?.as_str()? {
            "Pod" => Some(Kind::Pod),
            "Node" => Some(Kind::Node),
            "Event" => Some(Kind::Event),
            _ => None,
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
    /// Bindings to leave unanswered and unapplied, as an overloaded server
    /// would, for timeout tests.
    hung_bindings: u32,
}

struct Shared {
    store: Mutex<Store>,
    changes: broadcast::Sender<Change>,
    /// Ends every open watch (as an API server restart would).
    watches: Mutex<CancellationToken>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Store> {
        self.store
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

/// A running fake API server; stops when dropped.
pub struct FakeApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
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
    /// pods and events also `metadata.namespace`, default `default`),
    /// filling in what the server would: uid, resourceVersion,
    /// creationTimestamp. Returns the stored object.
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
        let mut object = store.objects.remove(&key)?;
        let version = store.bump();
        set_version(&mut object, version);
        let change = Change {
            kind,
            version,
            kind_of_change: "DELETED",
            object: object.clone(),
        };
        store.history.push(change.clone());
        drop(store);
        let _ = self.shared.changes.send(change);
        Some(object)
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

    /// Leaves the next `n` pod bindings unanswered (until the client gives
    /// up) and unapplied, as an overloaded API server may.
    pub fn hang_next_bindings(&self, n: u32) {
        self.shared.lock().hung_bindings = n;
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

    /// Stores `object`, new or replacing; the change to broadcast.
    fn upsert(&mut self, mut object: Value) -> (Value, Option<Change>) {
        let Some(kind) = Kind::of(&object) else {
            return (object, None);
        };
        let namespace = match kind {
            Kind::Node => String::new(),
            _ => meta_str(&object, "namespace")
                .unwrap_or("default")
                .to_owned(),
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
            if kind != Kind::Node {
                meta.insert("namespace".into(), json!(namespace));
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
        .route("/api/v1/pods", get(list_all_pods))
        .route(
            "/api/v1/namespaces/{ns}/pods",
            get(list_pods).post(create_pod),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}",
            get(get_pod).patch(patch_pod).put(replace_pod),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}/binding",
            post(bind_pod),
        )
        .route("/api/v1/nodes", get(list_nodes))
        .route("/api/v1/nodes/{name}", get(get_node).patch(patch_node))
        .route(
            "/api/v1/nodes/{name}/status",
            get(get_node).patch(patch_node_status),
        )
        .route(
            "/apis/events.k8s.io/v1/namespaces/{ns}/events",
            get(list_events).post(create_event),
        )
        .route(
            "/apis/events.k8s.io/v1/namespaces/{ns}/events/{name}",
            get(get_event).patch(patch_event),
        )
        .fallback(unknown)
}

type Params = Query<HashMap<String, String>>;
type Shared_ = State<Arc<Shared>>;

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

async fn list_all_pods(State(s): Shared_, Query(q): Params) -> Response {
    list_or_watch(&s, Kind::Pod, None, &q)
}

async fn list_pods(State(s): Shared_, UrlPath(ns): UrlPath<String>, Query(q): Params) -> Response {
    list_or_watch(&s, Kind::Pod, Some(&ns), &q)
}

async fn list_nodes(State(s): Shared_, Query(q): Params) -> Response {
    list_or_watch(&s, Kind::Node, None, &q)
}

async fn list_events(
    State(s): Shared_,
    UrlPath(ns): UrlPath<String>,
    Query(q): Params,
) -> Response {
    list_or_watch(&s, Kind::Event, Some(&ns), &q)
}

async fn get_pod(State(s): Shared_, UrlPath((ns, name)): UrlPath<(String, String)>) -> Response {
    get_one(&s, Kind::Pod, &ns, &name)
}

async fn get_node(State(s): Shared_, UrlPath(name): UrlPath<String>) -> Response {
    get_one(&s, Kind::Node, "", &name)
}

async fn get_event(State(s): Shared_, UrlPath((ns, name)): UrlPath<(String, String)>) -> Response {
    get_one(&s, Kind::Event, &ns, &name)
}

async fn create_pod(State(s): Shared_, UrlPath(ns): UrlPath<String>, body: Bytes) -> Response {
    create(&s, Kind::Pod, &ns, &body)
}

async fn create_event(State(s): Shared_, UrlPath(ns): UrlPath<String>, body: Bytes) -> Response {
    create(&s, Kind::Event, &ns, &body)
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

async fn patch_pod(
    State(s): Shared_,
    UrlPath((ns, name)): UrlPath<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    patch(&s, Kind::Pod, &ns, &name, &headers, &body, Part::Main)
}

async fn patch_node(
    State(s): Shared_,
    UrlPath(name): UrlPath<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    patch(&s, Kind::Node, "", &name, &headers, &body, Part::Main)
}

async fn patch_node_status(
    State(s): Shared_,
    UrlPath(name): UrlPath<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    patch(&s, Kind::Node, "", &name, &headers, &body, Part::Status)
}

async fn patch_event(
    State(s): Shared_,
    UrlPath((ns, name)): UrlPath<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    patch(&s, Kind::Event, &ns, &name, &headers, &body, Part::Main)
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
    axum::Json(stored).into_response()
}

fn create(s: &Shared, kind: Kind, ns: &str, body: &[u8]) -> Response {
    let Ok(mut object) = serde_json::from_slice::<Value>(body) else {
        return bad_request("the body is not JSON");
    };
    let mut store = s.lock();
    let name = meta_str(&object, "name").map(str::to_owned);
    let Some(name) = name.filter(|n| !n.is_empty()) else {
        return status_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "metadata.name: Required value",
        );
    };
    if store
        .objects
        .contains_key(&(kind, ns.to_owned(), name.clone()))
    {
        return status_error(
            StatusCode::CONFLICT,
            "AlreadyExists",
            &format!("{}s \"{name}\" already exists", kind.name().to_lowercase()),
        );
    }
    if let Some(o) = object.as_object_mut() {
        o.insert("kind".into(), json!(kind.name()));
        if let Some(meta) = o.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.insert("namespace".into(), json!(ns));
        }
    }
    let (stored, change) = store.upsert(object);
    drop(store);
    if let Some(change) = change {
        let _ = s.changes.send(change);
    }
    (StatusCode::CREATED, axum::Json(stored)).into_response()
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
    let selector = match Selector::parse(q) {
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
                    if tx.send(line(c.kind_of_change, &c.object)).await.is_err() {
                        return;
                    }
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
    fn parse(q: &HashMap<String, String>) -> Result<Selector, String> {
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
            if !matches!(
                path.as_str(),
                "metadata.name" | "metadata.namespace" | "spec.nodeName" | "status.phase"
            ) {
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
        &format!("{}s \"{name}\" not found", kind.name().to_lowercase()),
    )
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
        let s = |f, l| Selector::parse(&q(f, l)).unwrap().matches(&pod);
        assert!(s("spec.nodeName=n1", ""));
        assert!(!s("spec.nodeName=n2", ""));
        assert!(s("spec.nodeName=n1,status.phase!=Succeeded", "app=x"));
        assert!(!s("", "app!=x"));
        assert!(s("", "app"));
        assert!(Selector::parse(&q("spec.unknown=1", "")).is_err());
    }
}
