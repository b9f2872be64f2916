//! A real Prometheus (Debian's `prometheus`) scraping a running gpumem,
//! and the chart's Grafana dashboard read as Grafana would run it: what
//! the monitoring tests of both front ends share.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::wait::poll;
use super::Killed;

/// Prometheus starts, reads its first scrapes and answers within this.
pub const PROMETHEUS_WAIT: Duration = Duration::from_secs(60);

/// The dashboard's rows each front end's series fill: the node and GPU
/// rows serve both, the pods row the device plugin's containers, the
/// claims row the DRA driver's claims.
pub const PLUGIN_ROWS: &[&str] = &["Nodes", "GPUs", "Pods"];
pub const DRA_ROWS: &[&str] = &["Nodes", "GPUs", "DRA claims"];

pub fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// `name` from PATH, or a failure that says how to install it.
pub fn prometheus_tool(name: &str) -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "{name} is not installed, and the monitoring tests need a real Prometheus: on \
             Debian or Ubuntu run `apt-get update && apt-get install -y prometheus` (it gives \
             /usr/bin/prometheus and /usr/bin/promtool; stop the service it may start with \
             `systemctl disable --now prometheus`), elsewhere put the binaries of a Prometheus \
             release (2.x or later) on PATH"
        )
    })
}

/// A port nothing listens on now.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A real Prometheus in a directory of its own on a port of its own,
/// scraping and evaluating every second with the chart's rules loaded.
pub struct Prometheus {
    pub port: u16,
    log: PathBuf,
    _process: Killed,
}

impl Prometheus {
    /// With `scrape` (the config's `scrape_configs:` section) in `dir`.
    pub fn start(dir: &Path, scrape: &str) -> Prometheus {
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - {rules:?}\n{scrape}",
                rules = repo("deploy/helm/gpumem/monitoring/gpumem.rules.yaml")
            ),
        )
        .unwrap();
        let port = free_port();
        let log = dir.join("prometheus.log");
        let process = Command::new(prometheus_tool("prometheus"))
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Prometheus {
            port,
            log,
            _process: Killed(process),
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The series Prometheus answers `expr` with, now.
    pub async fn query(&self, expr: &str) -> Vec<Series> {
        query(self.port, expr).await
    }

    /// What `expr` answers once `done` holds, or [`PROMETHEUS_WAIT`] after
    /// `started` (Prometheus scrapes and evaluates every second).
    pub async fn query_until(
        &self,
        expr: &str,
        started: Instant,
        done: impl Fn(&[Series]) -> bool,
    ) -> Vec<Series> {
        let left = PROMETHEUS_WAIT.saturating_sub(started.elapsed());
        let (Ok(series) | Err(series)) = poll(left, Duration::from_millis(250), async || {
            let series = self.query(expr).await;
            if done(&series) {
                Ok(series)
            } else {
                Err(series)
            }
        })
        .await;
        series
    }
}

/// One series of an answer: its labels, and its value as `@value`.
pub type Series = BTreeMap<String, String>;

/// A `scrape_configs:` section scraping gpumem's metrics on `port`.
pub fn static_scrape(port: u16) -> String {
    format!(
        "scrape_configs:\n  - job_name: gpumem\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
    )
}

/// GET over HTTP/1.0 (no chunked answer to decode): the status and body,
/// or `None` while nothing listens.
pub async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let code = response.get(9..12)?.parse().ok()?;
    let (_, body) = response.split_once("\r\n\r\n")?;
    Some((code, body.to_owned()))
}

/// Percent-encodes a query parameter.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The series Prometheus on `port` answers `expr` with, now.
pub async fn query(port: u16, expr: &str) -> Vec<Series> {
    let path = format!("/api/v1/query?query={}", encode(expr));
    let Some((200, body)) = get(port, &path).await else {
        return Vec::new();
    };
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["status"], "success", "{expr}: {body}");
    answer["data"]["result"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|series| {
            let mut labels: Series = serde_json::from_value(series["metric"].clone()).unwrap();
            labels.insert("@value".into(), series["value"][1].as_str().unwrap().into());
            labels
        })
        .collect()
}

fn dashboard() -> Value {
    let path = repo("deploy/helm/gpumem/monitoring/gpumem-dashboard.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A query of the dashboard as Grafana runs it with every variable's "All"
/// (`.*`) and an interval of a minute.
fn as_run(expr: &str) -> String {
    let expr = expr
        .replace("$__rate_interval", "1m")
        .replace("$node", ".*")
        .replace("$namespace", ".*");
    assert!(
        !expr.contains('$'),
        "a variable this test does not set: {expr}"
    );
    expr
}

/// One query of a dashboard panel.
#[derive(Debug)]
pub struct PanelQuery {
    pub row: String,
    pub panel: String,
    pub expr: String,
    pub legend: String,
}

/// Each query of the panels in `rows`, with its panel's title and legend.
/// Every row of the dashboard is one some front end fills, and each of
/// `rows` is there with its panels.
pub fn dashboard_queries(rows: &[&str]) -> Vec<PanelQuery> {
    let mut queries = Vec::new();
    let mut row = String::new();
    let mut seen = Vec::new();
    for panel in dashboard()["panels"].as_array().unwrap() {
        let title = panel["title"].as_str().unwrap().to_owned();
        if panel["type"] == "row" {
            assert!(
                PLUGIN_ROWS.contains(&title.as_str()) || DRA_ROWS.contains(&title.as_str()),
                "row {title:?}: no front end's test checks it"
            );
            row.clone_from(&title);
            seen.push(title);
            continue;
        }
        if !rows.contains(&row.as_str()) {
            continue;
        }
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push(PanelQuery {
                row: row.clone(),
                panel: title.clone(),
                expr: as_run(target["expr"].as_str().unwrap()),
                legend: target["legendFormat"].as_str().unwrap_or("").to_owned(),
            });
        }
    }
    for wanted in rows {
        assert!(
            seen.iter().any(|r| r == wanted),
            "the dashboard has no row {wanted:?}: {seen:?}"
        );
        assert!(
            queries.iter().any(|q| q.row == *wanted),
            "row {wanted:?} has no queries"
        );
    }
    queries
}

/// The dashboard's query variables (other than the data source): name,
/// the series they read, and the label whose values they offer.
pub fn dashboard_variables() -> Vec<(String, String, String)> {
    dashboard()["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["type"] == "query")
        .map(|v| {
            let name = v["name"].as_str().unwrap().to_owned();
            let query = v["definition"].as_str().unwrap();
            let inner = query
                .strip_prefix("label_values(")
                .and_then(|q| q.strip_suffix(')'))
                .unwrap_or_else(|| panic!("{name}: not label_values(…): {query}"));
            let (series, label) = inner
                .rsplit_once(',')
                .unwrap_or_else(|| panic!("{name}: no label in {query}"));
            (name, as_run(series.trim()), label.trim().to_owned())
        })
        .collect()
}

/// Whether `series` is what a panel with legend `legend` should show: at
/// least one series, each with every label the legend names set, and each
/// of `expected`'s labels, where the legend names it, as given there.
pub fn answers(series: &[Series], legend: &str, expected: &[(&str, &str)]) -> Result<(), String> {
    if series.is_empty() {
        return Err("no series".into());
    }
    let named: Vec<&str> = legend
        .split("{{")
        .skip(1)
        .filter_map(|part| part.split_once("}}").map(|(name, _)| name.trim()))
        .collect();
    for s in series {
        for label in &named {
            if s.get(*label).is_none_or(String::is_empty) {
                return Err(format!("a series without {label}"));
            }
        }
        for (label, value) in expected {
            if named.contains(label) && s[*label] != *value {
                return Err(format!("{label} {:?}, not {value}", s[*label]));
            }
        }
    }
    Ok(())
}

/// Checks each query of `rows`, then each variable, against Prometheus:
/// every one answers as [`answers`] says (a rate needs two scrapes, and
/// what reconciliation finds comes a second later: each query is asked
/// until it answers, within [`PROMETHEUS_WAIT`] of the start). `logs` is
/// shown on failure.
pub async fn check_dashboard(
    prometheus: &Prometheus,
    rows: &[&str],
    expected: &[(&str, &str)],
    variables: &[(&str, &str)],
    logs: impl Fn() -> String,
) {
    let started = Instant::now();
    for q in dashboard_queries(rows) {
        let series = prometheus
            .query_until(&q.expr, started, |s| {
                answers(s, &q.legend, expected).is_ok()
            })
            .await;
        if let Err(why) = answers(&series, &q.legend, expected) {
            panic!(
                "panel {:?}: {}: {why}: {series:?}\n{}",
                q.panel,
                q.expr,
                logs()
            );
        }
    }
    // What each variable offers: the values of its label on its series.
    for (name, series, label) in dashboard_variables() {
        let want = variables
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("variable {name}: no value expected"))
            .1;
        let offered = prometheus
            .query_until(&series, started, |s| {
                s.iter()
                    .any(|s| s.get(&label).map(String::as_str) == Some(want))
            })
            .await;
        let values: Vec<_> = offered.iter().filter_map(|s| s.get(&label)).collect();
        assert!(
            values.iter().any(|v| *v == want),
            "variable {name} (label_values({series}, {label})) offers {values:?}, not {want:?}\n{}",
            logs()
        );
    }
}
