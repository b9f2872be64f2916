//! `/status` bodies recorded in `tests/fixtures/status`: the e2e runner's
//! Go decoder is checked against them (e2e/cmd/gpumem-e2e/status_test.go),
//! and they are checked here against what the daemon serves.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// Set to rewrite the fixtures from what the daemon serves.
pub const UPDATE: &str = "GPUMEM_UPDATE_FIXTURES";

/// The body of `GET /status` on the status socket, as served.
pub async fn raw_status(socket: &Path) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::UnixStream::connect(socket).await.unwrap();
    let request = "GET /status HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    assert!(head.starts_with("HTTP/1.1 200"), "{response}");
    body.to_owned()
}

/// Checks that `body` has the fields of fixture `name` and no others,
/// whatever their values; with [`UPDATE`] set, writes it as the fixture
/// instead, each `(from, to)` of `scrub` replaced in its strings (the run's
/// temporary paths) and the version and commit made placeholders.
pub fn check(name: &str, body: &str, scrub: &[(&str, &str)]) {
    let served: Value = serde_json::from_str(body).unwrap();
    let file = path(name);
    if std::env::var_os(UPDATE).is_some() {
        let mut text = body.to_owned();
        for (from, to) in scrub {
            text = text.replace(from, to);
        }
        let mut doc: Value = serde_json::from_str(&text).unwrap();
        doc["version"] = "<version>".into();
        doc["commit"] = "<commit>".into();
        let pretty = serde_json::to_string_pretty(&doc).unwrap() + "\n";
        std::fs::write(&file, pretty).unwrap();
        return;
    }
    let recorded: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let (now, then) = (key_paths(&served), key_paths(&recorded));
    let added: Vec<_> = now.difference(&then).collect();
    let gone: Vec<_> = then.difference(&now).collect();
    assert!(
        added.is_empty() && gone.is_empty(),
        "/status no longer has the fields of {}: new {added:?}, gone {gone:?}. The e2e runner \
         decodes that shape (e2e/cmd/gpumem-e2e/status.go): rewrite the fixture with \
         {UPDATE}=1, then bring status.go to it (`go test -count=1 ./...` in e2e/ says where).\n{body}",
        file.display()
    );
}

fn path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/status")
        .join(format!("{name}.json"))
}

/// The key paths of a JSON document: `gpus[].uuid`, `dra.slice`; an
/// array's elements share its path.
pub fn key_paths(doc: &Value) -> BTreeSet<String> {
    fn walk(doc: &Value, at: &str, into: &mut BTreeSet<String>) {
        match doc {
            Value::Object(fields) => {
                for (key, value) in fields {
                    let path = if at.is_empty() {
                        key.clone()
                    } else {
                        format!("{at}.{key}")
                    };
                    walk(value, &path, into);
                    into.insert(path);
                }
            }
            Value::Array(items) => {
                for item in items {
                    walk(item, &format!("{at}[]"), into);
                }
            }
            _ => {}
        }
    }
    let mut paths = BTreeSet::new();
    walk(doc, "", &mut paths);
    paths
}
