//! Every HTTP error of the registry and of both agents' engine APIs is `{"error": "..."}` JSON
//! with the right status: one table of requests per process (release binary, loopback), each
//! answered with its status, `Content-Type: application/json` and an `error` that says what was
//! wrong. After each, the process still answers `/healthz`.
//!
//! Requests go over a plain TCP socket, the body written by a thread of its own: a server may
//! answer 413 before it read the whole body, and the answer is read whatever happens to the
//! rest of the write.
//!
//! Needs `cargo build --release --all-features --bin kvferry` first.

use crate::common;

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

const TOKEN: &str = "errors-t0ken";

/// One request and what must come back.
struct Case {
    name: &'static str,
    method: Method,
    path: String,
    /// The body and its content type (none: no body, no content type).
    body: Option<(Vec<u8>, &'static str)>,
    /// The bearer token sent, if any.
    auth: Option<&'static str>,
    status: StatusCode,
    /// A part of the `error` message.
    says: &'static str,
}

fn case(name: &'static str, method: Method, path: &str, status: u16, says: &'static str) -> Case {
    Case {
        name,
        method,
        path: path.to_owned(),
        body: None,
        auth: Some(TOKEN),
        status: StatusCode::from_u16(status).unwrap(),
        says,
    }
}

impl Case {
    fn json(mut self, body: &Value) -> Case {
        self.body = Some((serde_json::to_vec(body).unwrap(), "application/json"));
        self
    }
    fn raw(mut self, body: impl Into<Vec<u8>>, content_type: &'static str) -> Case {
        self.body = Some((body.into(), content_type));
        self
    }
    fn token(mut self, token: Option<&'static str>) -> Case {
        self.auth = token;
        self
    }
}

/// Every route of the decode's engine API that reads or changes a room or the pool.
const DECODE_ROUTES: [(Method, &str); 7] = [
    (Method::POST, "/v1/rooms/1"),
    (Method::GET, "/v1/rooms/1"),
    (Method::DELETE, "/v1/rooms/1"),
    (Method::POST, "/v1/rooms/1/take"),
    (Method::POST, "/v1/rooms/1/hold"),
    (Method::DELETE, "/v1/rooms/1/hold"),
    (Method::GET, "/v1/pool"),
];

/// Every route of the prefill's engine API that reads or changes a room or the pool.
const PREFILL_ROUTES: [(Method, &str); 6] = [
    (Method::POST, "/v1/rooms/1/ready"),
    (Method::GET, "/v1/rooms/1"),
    (Method::DELETE, "/v1/rooms/1"),
    (Method::POST, "/v1/rooms/1/hold"),
    (Method::DELETE, "/v1/rooms/1/hold"),
    (Method::GET, "/v1/pool"),
];

/// Each of `routes` without the token and with a wrong one: 401, whatever the body.
fn token_cases(routes: &[(Method, &'static str)]) -> Vec<Case> {
    routes
        .iter()
        .flat_map(|(method, path)| {
            let body = json!({ "tokens": 16, "pages": [5] });
            [
                case(
                    "no token",
                    method.clone(),
                    path,
                    401,
                    "missing Authorization header",
                )
                .json(&body)
                .token(None),
                case(
                    "wrong token",
                    method.clone(),
                    path,
                    401,
                    "wrong bearer token",
                )
                .json(&body)
                .token(Some("nope")),
            ]
        })
        .collect()
}

/// A plain HTTP/1.1 exchange: the status, the content type and the body of the answer.
fn exchange(base: &str, c: &Case) -> (u16, String, String) {
    let addr = base.strip_prefix("http://").expect("http:// base");
    let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    stream.set_read_timeout(Some(BOUND)).unwrap();
    let mut head = format!(
        "{} {} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n",
        c.method, c.path
    );
    if let Some(token) = c.auth {
        head.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    let body = match &c.body {
        Some((body, content_type)) => {
            head.push_str(&format!("Content-Type: {content_type}\r\n"));
            body.clone()
        }
        None => Vec::new(),
    };
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    stream
        .write_all(head.as_bytes())
        .expect("writing the request head");
    let mut writer = stream.try_clone().expect("clone");
    // The server may answer and close before it read all of the body: ignore write errors.
    let sending = std::thread::spawn(move || {
        let _ = writer.write_all(&body);
    });
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    let _ = stream.shutdown(std::net::Shutdown::Both);
    sending.join().expect("writer thread");
    let text = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("{}: no answer: {text:?}", c.name));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{}: status line {head:?}", c.name));
    let content_type = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_owned())
        })
        .unwrap_or_default();
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    assert!(!chunked, "{}: a chunked error body: {head}", c.name);
    (status, content_type, body.to_owned())
}

fn run(who: &str, base: &str, cases: Vec<Case>) {
    let mut statuses = std::collections::BTreeSet::new();
    for c in cases {
        let (status, content_type, text) = exchange(base, &c);
        println!("{who:8} {:44} -> {status} {text}", c.name);
        assert_eq!(status, c.status.as_u16(), "{who}: {}: {text}", c.name);
        assert_eq!(
            content_type, "application/json",
            "{who}: {}: {text}",
            c.name
        );
        let body: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{who}: {}: {text:?} is not JSON: {e}", c.name));
        let error = body["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{who}: {}: no error in {body}", c.name));
        assert!(
            error.contains(c.says),
            "{who}: {}: {error:?} should say {:?}",
            c.name,
            c.says
        );
        statuses.insert(status);
        let health = case("health", Method::GET, "/healthz", 200, "");
        let (status, _, _) = exchange(base, &health);
        assert_eq!(status, 200, "{who}: after {}", c.name);
        std::thread::sleep(Duration::from_millis(1));
    }
    println!("{who}: statuses {statuses:?}");
}

/// The query-string errors of `GET /v1/rooms/{room}`, the same on both agents.
fn query_cases(room: &str) -> Vec<Case> {
    vec![
        case(
            "wait_ms negative",
            Method::GET,
            &format!("/v1/rooms/{room}?wait_ms=-1"),
            400,
            "wait_ms",
        ),
        case(
            "wait_ms not a number",
            Method::GET,
            &format!("/v1/rooms/{room}?wait_ms=abc"),
            400,
            "wait_ms",
        ),
        case(
            "wait_ms beyond u64",
            Method::GET,
            &format!("/v1/rooms/{room}?wait_ms=18446744073709551616"),
            400,
            "wait_ms",
        ),
        case(
            "unknown query parameter",
            Method::GET,
            &format!("/v1/rooms/{room}?wait=1"),
            400,
            "wait",
        ),
    ]
}

#[test]
fn every_error_is_json_with_its_status_on_the_registry_and_both_agents() {
    let exe = release_binary();
    let logs = kvferry::cluster::log_dir("http-errors").expect("log dir");
    let registry = common::spawn(
        &exe,
        &[],
        "registry",
        &owned(&[
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--token",
            TOKEN,
        ]),
        &[],
        &logs,
    );
    let url = registry.field("url").unwrap();
    // Rooms 1 and 2 must stay in flight through the tables: no timeout may end them.
    let mut args = AgentOpts {
        pool_pages: 64,
        timeout_ready_ms: 600_000,
        timeout_stall_ms: 600_000,
        ..AgentOpts::default()
    }
    .args();
    args.extend(owned(&["--token", TOKEN, "--max-rooms", "2"]));
    let agent = |role: &str| {
        let mut a = owned(&[role, "--bootstrap", &url]);
        a.extend(args.iter().cloned());
        common::spawn(&exe, &[], role, &a, &[], &logs)
    };
    let prefill = agent("prefill");
    let decode = agent("decode");
    let (p, d) = (prefill.field("api").unwrap(), decode.field("api").unwrap());
    let too_large = vec![b' '; 17 << 20];
    let rt = runtime();
    let http = http_with_token(TOKEN);
    let (taken, holder) = rt.block_on(async {
        // A registration the registry refuses 409: the prefill's own, under another instance.
        let ranks: Value = http
            .get(format!("{url}/v1/ranks"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let mut taken = ranks["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["role"] == "prefill")
            .expect("the prefill registered")
            .clone();
        let holder = taken["instance_id"].as_str().unwrap().to_owned();
        taken["instance_id"] = json!("00000000-0000-4000-8000-000000000001");
        taken.as_object_mut().unwrap().remove("lease_remaining_ms");
        (taken, holder)
    });
    let unknown = "00000000-0000-4000-8000-000000000002";
    run(
        "registry",
        &url,
        vec![
            case(
                "no token on a read",
                Method::GET,
                "/v1/ranks",
                401,
                "Authorization",
            )
            .token(None),
            case(
                "no token on metrics",
                Method::GET,
                "/metrics",
                401,
                "Authorization",
            )
            .token(None),
            case(
                "wrong token",
                Method::GET,
                "/v1/groups/0",
                401,
                "wrong bearer token",
            )
            .token(Some("nope")),
            case("unknown route", Method::GET, "/v1/nope", 404, "no route"),
            case(
                "unknown instance",
                Method::POST,
                &format!("/v1/ranks/{unknown}/heartbeat"),
                404,
                "register again",
            ),
            case("wrong method", Method::PUT, "/v1/ranks", 405, "not allowed"),
            case("body too large", Method::POST, "/v1/ranks", 413, "limit")
                .raw(too_large.clone(), "application/json"),
            case(
                "not JSON content type",
                Method::POST,
                "/v1/ranks",
                415,
                "application/json",
            )
            .raw(serde_json::to_vec(&taken).unwrap(), "text/plain"),
            case("malformed JSON", Method::POST, "/v1/ranks", 400, "")
                .raw("{\"role\":", "application/json"),
            case("bad dp_rank", Method::GET, "/v1/groups/abc", 400, "abc"),
            case(
                "slot held by a live instance",
                Method::POST,
                "/v1/ranks",
                409,
                "held by live instance",
            )
            .json(&taken),
            case(
                "incomplete group",
                Method::GET,
                "/v1/groups/7",
                503,
                "incomplete",
            ),
        ],
    );
    rt.block_on(async {
        // The 409 names the holder in its own field too.
        let resp = http
            .post(format!("{url}/v1/ranks"))
            .bearer_auth(TOKEN)
            .json(&taken)
            .send()
            .await
            .unwrap();
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["holder"], holder.as_str(), "{body}");

        // Decode: one live room (engine pages), so a duplicate conflicts and --max-rooms 2 is
        // reached with a second one.
        expect(
            &http,
            Method::POST,
            &format!("{d}/v1/rooms/1"),
            Some(&json!({ "tokens": 16, "pages": [0] })),
            StatusCode::CREATED,
        )
        .await;
        let mut cases = vec![
            case("unknown route", Method::GET, "/v1/nope", 404, "no route"),
            case(
                "unknown room",
                Method::GET,
                "/v1/rooms/9",
                404,
                "unknown room 9",
            ),
            case(
                "wrong method",
                Method::PUT,
                "/v1/rooms/1",
                405,
                "not allowed",
            ),
            case(
                "wrong method on take",
                Method::GET,
                "/v1/rooms/1/take",
                405,
                "not allowed",
            ),
            case("body too large", Method::POST, "/v1/rooms/2", 413, "limit")
                .raw(too_large.clone(), "application/json"),
            case(
                "form body",
                Method::POST,
                "/v1/rooms/2",
                415,
                "application/json",
            )
            .raw("tokens=16", "application/x-www-form-urlencoded"),
            case(
                "text body",
                Method::POST,
                "/v1/rooms/2",
                415,
                "application/json",
            )
            .raw("{\"tokens\":16}", "text/plain"),
            case(
                "malformed JSON",
                Method::POST,
                "/v1/rooms/2",
                400,
                "invalid JSON",
            )
            .raw("{\"tokens\":", "application/json"),
            case("bad room", Method::POST, "/v1/rooms/abc", 400, "not a u64")
                .json(&json!({ "tokens": 16 })),
            case(
                "can never fit",
                Method::POST,
                "/v1/rooms/2",
                400,
                "--pool-pages",
            )
            .json(&json!({ "tokens": 64 * 16 + 1 })),
            case(
                "duplicate room",
                Method::POST,
                "/v1/rooms/1",
                409,
                "already exists",
            )
            .json(&json!({ "tokens": 16, "pages": [1] })),
            case(
                "take before landing",
                Method::POST,
                "/v1/rooms/1/take",
                409,
                "take it once",
            ),
        ];
        cases.extend(query_cases("1"));
        cases.extend(token_cases(&DECODE_ROUTES));
        cases.extend([
            case(
                "a room naming an untrusted registry",
                Method::POST,
                "/v1/rooms/5",
                403,
                "is not trusted",
            )
            .json(&json!({ "tokens": 16, "pages": [3], "bootstrap": "http://127.0.0.1:9" })),
            case(
                "a hold naming an untrusted registry",
                Method::POST,
                "/v1/rooms/5/hold",
                403,
                "nothing was sent to it",
            )
            .json(&json!({ "bootstrap": "http://10.9.9.9:8998" })),
        ]);
        tokio::task::block_in_place(|| run("decode", &d, cases));
        // Neither refused request made a room.
        let (status, _) = call(&http, Method::GET, &format!("{d}/v1/rooms/5"), None).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        expect(
            &http,
            Method::POST,
            &format!("{d}/v1/rooms/2"),
            Some(&json!({ "tokens": 16, "pages": [1] })),
            StatusCode::CREATED,
        )
        .await;
        let over = case(
            "over --max-rooms",
            Method::POST,
            "/v1/rooms/3",
            429,
            "--max-rooms",
        );
        let over = over.json(&json!({ "tokens": 16, "pages": [2] }));
        tokio::task::block_in_place(|| run("decode", &d, vec![over]));
        for room in [1, 2] {
            expect(
                &http,
                Method::DELETE,
                &format!("{d}/v1/rooms/{room}"),
                None,
                StatusCode::OK,
            )
            .await;
        }

        // Prefill.
        let mut cases = vec![
            case("unknown route", Method::GET, "/v1/nope", 404, "no route"),
            case(
                "unknown room",
                Method::GET,
                "/v1/rooms/9",
                404,
                "unknown room 9",
            ),
            case(
                "wrong method",
                Method::POST,
                "/v1/rooms/1",
                405,
                "not allowed",
            ),
            case(
                "wrong method on ready",
                Method::GET,
                "/v1/rooms/1/ready",
                405,
                "not allowed",
            ),
            case(
                "body too large",
                Method::POST,
                "/v1/rooms/1/ready",
                413,
                "limit",
            )
            .raw(too_large.clone(), "application/json"),
            case(
                "text body",
                Method::POST,
                "/v1/rooms/1/ready",
                415,
                "application/json",
            )
            .raw("{\"tokens\":16}", "text/plain"),
            case(
                "malformed JSON",
                Method::POST,
                "/v1/rooms/1/ready",
                400,
                "invalid JSON",
            )
            .raw("[16]", "application/json"),
            case(
                "can never fit",
                Method::POST,
                "/v1/rooms/1/ready",
                400,
                "--pool-pages",
            )
            .json(&json!({ "tokens": 64 * 16 + 1 })),
            case(
                "IPC event handle not 128 hex digits",
                Method::POST,
                "/v1/rooms/1/ready",
                400,
                "cuda_ipc_event must be 128 hex digits",
            )
            .json(&json!({ "tokens": 16, "cuda_ipc_event": "ab12" })),
            case(
                "IPC event handle not hex",
                Method::POST,
                "/v1/rooms/1/ready",
                400,
                "cuda_ipc_event is not hex",
            )
            .json(&json!({ "tokens": 16, "cuda_ipc_event": "g".repeat(128) })),
            case(
                "IPC event on a host pool",
                Method::POST,
                "/v1/rooms/1/ready",
                400,
                "this agent's pool is host memory",
            )
            .json(&json!({ "tokens": 16, "cuda_ipc_event": "5a".repeat(64) })),
        ];
        cases.extend(query_cases("1"));
        cases.extend(token_cases(&PREFILL_ROUTES));
        tokio::task::block_in_place(|| run("prefill", &p, cases));
        // Health and metrics reveal no room content: open without the token.
        let open = common::http();
        for api in [&p, &d] {
            for path in ["/healthz", "/metrics"] {
                let (status, _) = call(&open, Method::GET, &format!("{api}{path}"), None).await;
                assert_eq!(status, StatusCode::OK, "{api}{path} without the token");
            }
        }
        assert_eq!(
            pool(&http, &p).await,
            (64, 64),
            "no refused request held prefill pages"
        );
    });
}
