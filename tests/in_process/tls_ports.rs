//! HTTPS on kvferry's HTTP ports (`kvferry_wire::tls`): what a reader on the path sees of a
//! request with a bearer token over HTTP and over HTTPS, a plain request to an HTTPS port, a
//! client that trusts another CA, and certificate files that cannot be used.

use crate::common::tls::certificates_in as write_certificates;
use axum::routing::get;
use kvferry_wire::http::{Proof, serve};
use kvferry_wire::tls::{ServerTls, trust};
use std::path::PathBuf;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "bearer-token-on-the-path";

/// A CA and a certificate it signed for 127.0.0.1, in a fresh directory named `tag`: (ca,
/// cert, key).
fn certificates_in(tag: &str) -> (PathBuf, PathBuf, PathBuf) {
    let dir = kvferry::cluster::log_dir(tag).expect("dir");
    let files = write_certificates(&dir, &["127.0.0.1"]);
    (files.ca, files.cert, files.key)
}

/// Forwards one connection from its listener to `to`, keeping what the client sent: what a
/// reader on the path sees.
async fn on_the_path(listener: TcpListener, to: std::net::SocketAddr) -> Vec<u8> {
    let (mut client, _) = listener.accept().await.expect("accept");
    let mut server = TcpStream::connect(to).await.expect("connect");
    let (mut client_rx, mut client_tx) = client.split();
    let (mut server_rx, mut server_tx) = server.split();
    let mut seen = Vec::new();
    let upstream = async {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = client_rx.read(&mut buf).await {
            seen.extend_from_slice(&buf[..n]);
            if server_tx.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = server_tx.shutdown().await;
    };
    let downstream = async {
        let _ = tokio::io::copy(&mut server_rx, &mut client_tx).await;
        let _ = client_tx.shutdown().await;
    };
    tokio::join!(upstream, downstream);
    seen
}

/// A port answering `GET /x` with "answered", served with `tls` until the token is
/// cancelled: its address.
async fn port(tls: Option<ServerTls>, shutdown: &CancellationToken) -> std::net::SocketAddr {
    let app = axum::Router::new().route("/x", get(|| async { "answered" }));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let served = serve(listener, app, shutdown.clone(), "test", Proof::Request, tls);
    tokio::spawn(served);
    addr
}

/// What a GET with the bearer token through a reader on the path answers, and what the
/// reader saw, against a port served with `tls`.
async fn through_the_path(tls: Option<ServerTls>, scheme: &str) -> (String, Vec<u8>) {
    let shutdown = CancellationToken::new();
    let server_addr = port(tls, &shutdown).await;
    let path = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let path_addr = path.local_addr().expect("address");
    let reader = tokio::spawn(on_the_path(path, server_addr));
    let http = kvferry_wire::http::client().build().expect("client");
    let answer = http
        .get(format!("{scheme}://{path_addr}/x"))
        .bearer_auth(TOKEN)
        .header(reqwest::header::CONNECTION, "close")
        .send()
        .await
        .expect("answer");
    let body = answer.text().await.expect("body");
    drop(http);
    let seen = tokio::time::timeout(std::time::Duration::from_secs(60), reader)
        .await
        .expect("the connection closed")
        .expect("reader");
    shutdown.cancel();
    (body, seen)
}

fn holds(seen: &[u8], needle: &str) -> bool {
    seen.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[tokio::test]
async fn over_https_a_reader_on_the_path_never_sees_the_bearer_token() {
    let (ca, cert, key) = certificates_in("tls-path");
    // Control: over plain HTTP the reader sees the token.
    let (body, seen) = through_the_path(None, "http").await;
    assert_eq!(body, "answered");
    assert!(holds(&seen, TOKEN), "plain HTTP carries the token in clear");
    trust(&ca).expect("trust");
    let tls = ServerTls::load(&cert, &key).expect("load");
    let (body, seen) = through_the_path(Some(tls), "https").await;
    assert_eq!(body, "answered");
    assert!(
        seen.len() > 100,
        "the request went through the path ({} bytes)",
        seen.len()
    );
    assert!(!holds(&seen, TOKEN), "the token crossed the path in clear");
    assert!(
        !holds(&seen, "Bearer"),
        "the request head crossed the path in clear"
    );
    println!(
        "over https the path saw {} bytes, none of them the token",
        seen.len()
    );
}

#[tokio::test]
async fn an_https_port_answers_no_plain_request_and_an_untrusted_certificate_is_refused() {
    let (_, cert, key) = certificates_in("tls-plain");
    let shutdown = CancellationToken::new();
    let tls = ServerTls::load(&cert, &key).expect("load");
    let addr = port(Some(tls), &shutdown).await;
    // A plain request is never answered as HTTP.
    let mut plain = TcpStream::connect(addr).await.expect("connect");
    plain
        .write_all(b"GET /x HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        plain.read_to_end(&mut answer),
    );
    assert!(
        read.await.is_ok(),
        "the plain connection was neither answered nor closed"
    );
    assert!(!holds(&answer, "answered"), "a plain request was served");
    // A client that trusts another CA refuses the port's certificate.
    let (other_ca, _, _) = certificates_in("tls-other-ca");
    let pem = std::fs::read(&other_ca).expect("read");
    // kvferry's client builder installs rustls' crypto, which reqwest needs.
    let _ = kvferry_wire::http::client();
    #[allow(clippy::disallowed_methods)] // a client that trusts only another CA
    let strict = reqwest::Client::builder()
        .no_proxy()
        .tls_certs_only(reqwest::Certificate::from_pem_bundle(&pem).expect("pem"))
        .build()
        .expect("client");
    let refused = strict.get(format!("https://{addr}/x")).send().await;
    let e = refused.expect_err("an untrusted certificate was accepted");
    println!("untrusted certificate: {e:?}");
    shutdown.cancel();
}

#[test]
fn unusable_files_are_named_with_what_is_wrong() {
    let (ca, cert, key) = certificates_in("tls-files");
    let missing = cert.with_file_name("missing.pem");
    let e = ServerTls::load(&missing, &key).expect_err("missing");
    assert!(e.to_string().starts_with("certificate "), "{e}");
    assert!(e.to_string().contains("missing.pem"), "{e}");
    let e = ServerTls::load(&cert, &cert).expect_err("a certificate is no key");
    assert!(e.to_string().starts_with("key "), "{e}");
    let e = trust(&key).expect_err("a key is no CA");
    assert!(e.to_string().contains("no PEM certificate"), "{e}");
    // A key that is not the certificate's.
    let (_, _, other_key) = certificates_in("tls-other-key");
    let e = ServerTls::load(&cert, &other_key).expect_err("mismatched");
    assert!(e.to_string().contains("with key"), "{e}");
    trust(&ca).expect("a CA is trusted");
}
