//! Bad input never crashes the registry and never yields a 5xx: a table of malformed requests
//! sent raw over HTTP, each answered with its exact 4xx status and a JSON `{"error": ...}` body,
//! after each of which the server still answers `/healthz`.

use crate::common;

use common::{TestServer, prefill};
use kvferry_bootstrap::{ErrorBody, ServerConfig};
use reqwest::Method;
use reqwest::header::{CONTENT_TYPE, HeaderValue};
use serde_json::{Value, json};

/// One malformed request and what the registry must answer.
struct Case {
    name: &'static str,
    method: Method,
    path: String,
    /// Sent with `Content-Type: application/json` when `json` is true.
    body: Option<Vec<u8>>,
    json: bool,
    status: u16,
    /// A part of the error message that says what was wrong.
    says: &'static str,
}

fn valid() -> Value {
    serde_json::to_value(prefill(0, 0, 4, 0, 1)).unwrap()
}

/// A valid registration with `edit` applied.
fn edited(edit: impl FnOnce(&mut Value)) -> Vec<u8> {
    let mut v = valid();
    edit(&mut v);
    serde_json::to_vec(&v).unwrap()
}

fn post(name: &'static str, body: Vec<u8>, status: u16, says: &'static str) -> Case {
    Case {
        name,
        method: Method::POST,
        path: "/v1/ranks".into(),
        body: Some(body),
        json: true,
        status,
        says,
    }
}

fn call(name: &'static str, method: Method, path: &str, status: u16, says: &'static str) -> Case {
    Case {
        name,
        method,
        path: path.into(),
        body: None,
        json: false,
        status,
        says,
    }
}

fn cases() -> Vec<Case> {
    let unknown = uuid::Uuid::new_v4();
    vec![
        post("truncated json", b"{\"instance_id\":".to_vec(), 400, "EOF"),
        post("not json", b"hello registry".to_vec(), 400, "expected"),
        post("empty body", Vec::new(), 400, "EOF"),
        post(
            "json null",
            b"null".to_vec(),
            400,
            "expected struct Registration",
        ),
        post(
            "json array",
            b"[]".to_vec(),
            400,
            "invalid type: sequence, expected struct Registration",
        ),
        post("invalid utf-8", vec![b'{', 0xff, 0xfe, b'}'], 400, "JSON"),
        post(
            "missing field",
            edited(|v| {
                v.as_object_mut().unwrap().remove("role");
            }),
            400,
            "missing field `role`",
        ),
        post(
            "wrong type",
            edited(|v| v["dp_rank"] = json!("zero")),
            400,
            "dp_rank",
        ),
        post(
            "negative rank",
            edited(|v| v["tp_rank"] = json!(-1)),
            400,
            "tp_rank",
        ),
        post(
            "rank overflows u32",
            edited(|v| v["pp_rank"] = json!(1u64 << 40)),
            400,
            "pp_rank",
        ),
        post(
            "unknown role",
            edited(|v| v["role"] = json!("router")),
            400,
            "unknown variant `router`",
        ),
        post(
            "unknown dtype",
            edited(|v| v["layout"]["dtype"] = json!("int4")),
            400,
            "unknown variant `int4`",
        ),
        post(
            "bad instance id",
            edited(|v| v["instance_id"] = json!("not-a-uuid")),
            400,
            "instance_id",
        ),
        post(
            "rank >= size",
            edited(|v| v["tp_rank"] = json!(4)),
            400,
            "tp_rank 4 must be < tp_size 4",
        ),
        post(
            "size 0",
            edited(|v| v["dp_size"] = json!(0)),
            400,
            "dp_size must be > 0",
        ),
        post(
            "zero page size",
            edited(|v| v["layout"]["page_size"] = json!(0)),
            400,
            "layout.page_size must be > 0",
        ),
        post(
            "empty slice",
            edited(|v| v["slice"]["heads"] = json!({"start": 2, "end": 2})),
            400,
            "slice.heads 2..2 is empty",
        ),
        post(
            "slice outside layout",
            edited(|v| v["slice"]["layers"] = json!({"start": 0, "end": 62})),
            400,
            "slice.layers 0..62 exceeds layout.num_layers 61",
        ),
        post(
            "mla with 8 heads",
            edited(|v| v["layout"]["kind"] = json!("mla")),
            400,
            "must be 1 for an mla layout",
        ),
        post(
            "body over 64 KiB",
            vec![b' '; 80 * 1024],
            413,
            "larger than the 65536 byte limit",
        ),
        Case {
            json: false,
            ..post("no content type", edited(|_| {}), 415, "Content-Type")
        },
        call(
            "unknown route",
            Method::GET,
            "/v1/nope",
            404,
            "no route for GET /v1/nope",
        ),
        call("unversioned route", Method::GET, "/ranks", 404, "no route"),
        call(
            "wrong method on ranks",
            Method::PUT,
            "/v1/ranks",
            405,
            "method PUT not allowed",
        ),
        call(
            "wrong method on groups",
            Method::DELETE,
            "/v1/groups/0",
            405,
            "not allowed",
        ),
        call(
            "get a heartbeat",
            Method::GET,
            &format!("/v1/ranks/{unknown}/heartbeat"),
            405,
            "not allowed",
        ),
        call(
            "bad uuid in path",
            Method::POST,
            "/v1/ranks/not-a-uuid/heartbeat",
            400,
            "UUID",
        ),
        call(
            "bad uuid on delete",
            Method::DELETE,
            "/v1/ranks/123",
            400,
            "UUID",
        ),
        call(
            "unknown instance heartbeat",
            Method::POST,
            &format!("/v1/ranks/{unknown}/heartbeat"),
            404,
            "register again",
        ),
        call(
            "unknown instance delete",
            Method::DELETE,
            &format!("/v1/ranks/{unknown}"),
            404,
            "not registered",
        ),
        call(
            "dp_rank not a number",
            Method::GET,
            "/v1/groups/abc",
            400,
            "abc",
        ),
        call("dp_rank negative", Method::GET, "/v1/groups/-1", 400, "-1"),
        call(
            "dp_rank overflows u32",
            Method::GET,
            "/v1/groups/99999999999",
            400,
            "99999999999",
        ),
    ]
}

#[tokio::test]
async fn malformed_requests_get_a_4xx_with_a_json_error() {
    let server = TestServer::start(ServerConfig::default()).await;
    let http = kvferry_wire::http::client().build().unwrap();
    let cases = cases();
    assert!(cases.len() >= 15);
    for case in cases {
        let mut req = http.request(case.method.clone(), server.at(&case.path));
        if case.json {
            req = req.header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
        if let Some(body) = case.body {
            req = req.body(body);
        }
        let resp = req
            .send()
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let status = resp.status().as_u16();
        let content_type = resp
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let text = resp.text().await.unwrap();
        println!("{:28} -> {status} {text}", case.name);
        assert_eq!(status, case.status, "{}: {text}", case.name);
        assert_eq!(content_type, "application/json", "{}", case.name);
        let body: ErrorBody = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{}: error body {text:?} is not JSON: {e}", case.name));
        assert!(
            body.error.contains(case.says),
            "{}: {:?} should say {:?}",
            case.name,
            body.error,
            case.says
        );
        let health = http.get(server.at("/healthz")).send().await.unwrap();
        assert_eq!(health.status(), 200, "after {}", case.name);
    }
    // Nothing was registered by any of them.
    let health: Value = http
        .get(server.at("/healthz"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["prefill_ranks"], 0);
    server.stop().await;
}
