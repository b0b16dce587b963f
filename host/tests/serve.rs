//! `pdhost serve` against a real HTTP client on loopback: the OpenAI API, outputs equal to `generate`,
//! every bad input a 4xx error object (and the server still serving), the queue, an API key, a client
//! that disconnects, and a SIGTERM drain that leaves no producer behind.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const PDHOST: &str = env!("CARGO_BIN_EXE_pdhost");
const MODEL: &str = "smollm2-135m";

/// A running `pdhost serve`, killed if a test panics.
struct Served {
    child: Child,
    url: String,
    log: Arc<Mutex<String>>,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn fetched(name: &str) {
    let out = Command::new(PDHOST).args(["models", "fetch", name]).stdin(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `pdhost serve` on SmolLM2 with a 1024-token `--context` unless `extra` names its own.
fn serve(extra: &[&str]) -> Served {
    fetched(MODEL);
    let context = if extra.contains(&"--context") { &[][..] } else { &["--context", "1024"][..] };
    let mut child = Command::new(PDHOST)
        .args(["serve", "--model", MODEL, "--port", "0", "--threads", "2"])
        .args(context)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = Arc::new(Mutex::new(String::new()));
    let mut stderr = child.stderr.take().unwrap();
    let sink = Arc::clone(&log);
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stderr.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("first line {line:?}, log {}", log.lock().unwrap()))
        .to_string();
    Served { child, url, log }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

fn post(s: &Served, path: &str, body: &str) -> (u16, Value) {
    post_to(&s.url, path, body)
}

/// [`post`] to the server at `url` (from a thread that does not hold the `Served`).
fn post_to(url: &str, path: &str, body: &str) -> (u16, Value) {
    let mut r = agent().post(&format!("{url}{path}")).header("content-type", "application/json").send(body).unwrap();
    let status = r.status().as_u16();
    let text = r.body_mut().read_to_string().unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

/// `GET /metrics` as text, and one sample's value (`None` when absent).
fn metric(s: &Served, sample: &str) -> Option<f64> {
    let mut r = agent().get(&format!("{}/metrics", s.url)).call().unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let text = r.body_mut().read_to_string().unwrap();
    text.lines().find_map(|l| l.strip_prefix(sample).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.parse().ok()))
}

/// Waits until `sample` of `GET /metrics` reads `value`, failing with `what` and the server's log after
/// `within`.
fn await_metric(s: &Served, sample: &str, value: f64, within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    while metric(s, sample) != Some(value) {
        assert!(Instant::now() < deadline, "{what}: {}", s.log.lock().unwrap());
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn get(s: &Served, path: &str) -> (u16, Value) {
    let mut r = agent().get(&format!("{}{path}", s.url)).call().unwrap();
    let status = r.status().as_u16();
    (status, r.body_mut().read_json().unwrap())
}

/// `pdhost generate --json` for the same request.
fn generate(prompt: &str, max_tokens: u32, extra: &[&str]) -> Value {
    let out = Command::new(PDHOST)
        .args(["generate", "--model", MODEL, "--prompt", prompt, "--max-tokens", &max_tokens.to_string(), "--json"])
        .args(["--threads", "2"])
        .args(extra)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The `data:` payloads of a server-sent event stream, up to `[DONE]`.
fn sse(s: &Served, body: &Value) -> Vec<String> {
    let r = agent().post(&format!("{}/v1/completions", s.url)).send_json(body).unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut out = Vec::new();
    for line in BufReader::new(r.into_body().into_reader()).lines() {
        let line = line.unwrap();
        if let Some(data) = line.strip_prefix("data: ") {
            out.push(data.to_string());
            if data == "[DONE]" {
                break;
            }
        }
    }
    out
}

#[test]
fn completions_equal_generate_streamed_or_not_and_bad_input_gets_an_error_object() {
    let s = serve(&["--producer", "rngd"]);
    // A client that sends half a request and waits does not hold its connection for ever (checked at
    // the end: the server closes it 30 s after it opened).
    let mut idle = std::net::TcpStream::connect(s.url.trim_start_matches("http://")).unwrap();
    std::io::Write::write_all(&mut idle, b"GET /health HTTP/1.1\r\nhost: x\r\n").unwrap();
    // Nor does one that sends part of a body: it is answered 408.
    let mut slow = std::net::TcpStream::connect(s.url.trim_start_matches("http://")).unwrap();
    let part = "POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 20\r\n\r\n{\"pro";
    std::io::Write::write_all(&mut slow, part.as_bytes()).unwrap();
    let opened = Instant::now();
    assert_eq!(get(&s, "/health"), (200, json!({"status": "ok"})));
    let (status, models) = get(&s, "/v1/models");
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"][0]["max_model_len"], 1024);
    // OpenAI's "retrieve model": the same object, or 404 for a model the server does not serve.
    assert_eq!(get(&s, &format!("/v1/models/{MODEL}")), (200, models["data"][0].clone()));
    let (status, v) = get(&s, "/v1/models/gpt-4");
    assert_eq!((status, &v["error"]["code"]), (404, &json!("model_not_found")), "{v}");

    let prompt = "The three primary colours are";
    let reference = generate(prompt, 12, &[]);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0});
    let (status, v) = post(&s, "/v1/completions", &body.to_string());
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], reference["text"]);
    assert_eq!(v["pdhost"]["output_ids"], reference["output_ids"]);
    assert_eq!(v["pdhost"]["logits_xxh3"], reference["logits_xxh3"], "logits bit-identical to generate");
    assert_eq!(v["pdhost"]["prefill"], "remote");
    assert_eq!(v["pdhost"]["producer"], "rngd");
    // Ids do not repeat across runs (a random prefix), and come as OpenAI's `x-request-id` header too.
    let id = v["id"].as_str().unwrap();
    assert!(id.starts_with("cmpl-") && id.len() > "cmpl-12345678-".len(), "{id}");
    let r = agent().post(&format!("{}/v1/completions", s.url)).send_json(&body).unwrap();
    let header = r.headers().get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_string);
    let again: Value = r.into_body().read_json().unwrap();
    assert_eq!(header.as_deref(), again["id"].as_str());
    for key in ["ttft_ms", "decode_ms"] {
        assert!(v["pdhost"][key].as_f64().is_some_and(|ms| ms > 0.0), "pdhost.{key}: {v}");
    }
    let prompt_tokens = reference["prompt_ids"].as_array().unwrap().len();
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": 12, "total_tokens": prompt_tokens + 12})
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    // The same as a stream, with usage: the pieces add up to the same text.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = sse(&s, &streamed);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, reference["text"].as_str().unwrap());
    let finish: Vec<&Value> =
        chunks.iter().map(|c| &c["choices"][0]["finish_reason"]).filter(|f| !f.is_null()).collect();
    assert_eq!(finish, vec![&json!("length")]);
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 12);
    // OpenAI's shape: every other chunk carries `usage` too, as null.
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c.get("usage") == Some(&Value::Null)), "{chunks:?}");
    assert_eq!(
        chunks.iter().find(|c| !c["pdhost"].is_null()).unwrap()["pdhost"]["logits_xxh3"],
        reference["logits_xxh3"]
    );

    // `ignore_eos`: a reply that ends at its end-of-sequence token after three tokens goes on to
    // `max_tokens`, equal to `generate --ignore-eos` bit for bit.
    let short = "<|im_start|>user\nReply with one word: yes or no. Is water wet?<|im_end|>\n<|im_start|>assistant\n";
    let ends = json!({"prompt": short, "max_tokens": 24, "temperature": 0});
    let (_, v) = post(&s, "/v1/completions", &ends.to_string());
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let eos_at = v["pdhost"]["output_ids"].as_array().unwrap().len();
    assert!(eos_at < 24, "the prompt's reply ends early: {v}");
    let go_on = generate(short, 24, &["--ignore-eos"]);
    assert_eq!(go_on["output_ids"][eos_at - 1], v["pdhost"]["output_ids"][eos_at - 1], "the end-of-sequence token");
    let mut ignoring = ends.clone();
    ignoring["ignore_eos"] = json!(true);
    let (_, v) = post(&s, "/v1/completions", &ignoring.to_string());
    assert_eq!((&v["choices"][0]["finish_reason"], &v["usage"]["completion_tokens"]), (&json!("length"), &json!(24)));
    assert_eq!(v["pdhost"]["output_ids"], go_on["output_ids"]);
    assert_eq!(v["pdhost"]["logits_xxh3"], go_on["logits_xxh3"]);
    // `stop_token_ids`: the reply ends at the first of them, included, even under `ignore_eos`.
    let out = go_on["output_ids"].as_array().unwrap();
    let (at, stop_id) = out.iter().enumerate().skip(eos_at + 1).find(|&(i, t)| !out[..i].contains(t)).unwrap();
    let mut stopping = ignoring.clone();
    stopping["stop_token_ids"] = json!([stop_id]);
    let (_, v) = post(&s, "/v1/completions", &stopping.to_string());
    assert_eq!((&v["choices"][0]["finish_reason"], &v["pdhost"]["output_ids"]), (&json!("stop"), &json!(out[..=at])));
    // `min_tokens`: the end-of-sequence token is held back until that many tokens are out.
    let mut holding = ends.clone();
    holding["min_tokens"] = json!(eos_at + 1);
    let (_, v) = post(&s, "/v1/completions", &holding.to_string());
    let held = v["pdhost"]["output_ids"].as_array().unwrap();
    assert!(held.len() > eos_at && held[..eos_at - 1] == out[..eos_at - 1], "{v}");

    // Token ids as the prompt, and a stop string that ends the text before it.
    let ids = reference["prompt_ids"].clone();
    // With the "off" values of fields the server does not implement, as clients send them: accepted.
    let off = json!({"prompt": ids, "max_tokens": 12, "temperature": 0, "presence_penalty": 0, "frequency_penalty": 0.0,
                     "logit_bias": {}, "logprobs": null, "echo": false, "best_of": 1, "user": "u"});
    let (status, v) = post(&s, "/v1/completions", &off.to_string());
    assert_eq!((status, &v["pdhost"]["output_ids"]), (200, &reference["output_ids"]));
    assert_eq!(v["pdhost"].get("ignored_fields"), None, "{v}");
    // A field that nothing reads is named in the answer (and the server's log), not silently dropped.
    let unread = json!({"prompt": ids, "max_tokens": 2, "temperature": 0, "guided_regex": "a+"});
    let (status, v) = post(&s, "/v1/completions", &unread.to_string());
    assert_eq!((status, &v["pdhost"]["ignored_fields"]), (200, &json!(["guided_regex"])), "{v}");
    // Sampling from the most likely token alone (`top_k` 1, or `min_p` 1 where no two tie) is greedy.
    for filter in [json!({"top_k": 1}), json!({"min_p": 1.0, "top_p": 0.5})] {
        let mut sampled = json!({"prompt": ids, "max_tokens": 12, "temperature": 1.3, "seed": 5});
        sampled.as_object_mut().unwrap().extend(filter.as_object().unwrap().clone());
        let (status, v) = post(&s, "/v1/completions", &sampled.to_string());
        assert_eq!((status, &v["pdhost"]["output_ids"]), (200, &reference["output_ids"]), "{filter}");
    }
    let full = reference["text"].as_str().unwrap();
    let cut = full.char_indices().nth(full.chars().count() / 2).map_or(0, |(i, _)| i);
    let stop = &full[cut..(cut + 3).min(full.len())];
    let (_, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop]}).to_string(),
    );
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(full.starts_with(text) && !text.contains(stop), "{text:?} / {stop:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Not before `min_tokens` are out.
    let (_, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "min_tokens": 12, "temperature": 0, "stop": [stop]}).to_string(),
    );
    assert_eq!((v["choices"][0]["text"].as_str(), &v["choices"][0]["finish_reason"]), (Some(full), &json!("length")));
    // A stop string that the last token allowed completes: still a stop, not a length.
    let tail = full
        .char_indices()
        .rev()
        .map(|(i, _)| &full[i..])
        .find(|t| !t.trim().is_empty() && full.find(*t) == Some(full.len() - t.len()))
        .unwrap();
    let (_, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [tail]}).to_string(),
    );
    assert_eq!(v["choices"][0]["text"].as_str(), full.strip_suffix(tail), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{tail:?}: {v}");

    // Every bad input: 4xx, an error object naming what was expected and found, and still serving.

    let vocab = 49152;
    for (body, status, says) in [
        ("{", 400, "body: expected a JSON object, found invalid JSON"),
        ("[]", 400, "body: expected a JSON object, found an array"),
        (r#"{"prompt":"hi","model":"gpt-4"}"#, 404, "model: expected \"smollm2-135m\", found \"gpt-4\""),
        (r#"{"prompt":""}"#, 400, "prompt: expected a non-empty prompt"),
        (r#"{"prompt":42}"#, 400, "prompt: expected a string or an array of token ids, found the number 42"),
        (
            &format!(r#"{{"prompt":[1,{vocab}]}}"#),
            400,
            "prompt: expected token ids below smollm2-135m's vocabulary size 49152, found 49152 at position 1",
        ),
        (
            r#"{"prompt":"hi","max_tokens":5000}"#,
            400,
            "max_tokens: expected at most 1023 after a 1-token prompt (the 1024-token --context), found 5000",
        ),
        (r#"{"prompt":"hi","max_tokens":0}"#, 400, "max_tokens: expected at least 1, found 0"),
        (r#"{"prompt":"hi","max_tokens":-3}"#, 400, "max_tokens: expected a positive integer, found -3"),
        (r#"{"prompt":"hi","n":0}"#, 400, "n: expected 1 to 64, found 0"),
        (r#"{"prompt":"hi","n":-1}"#, 400, "n: expected a positive integer, found -1"),
        (r#"{"prompt":"hi","temperature":-1}"#, 400, "temperature: expected a number from 0"),
        (r#"{"prompt":"hi","top_p":2}"#, 400, "top_p: expected a number above 0 and at most 1, found 2"),
        (r#"{"prompt":"hi","min_p":1.5}"#, 400, "min_p: expected a number from 0 (no limit) to 1, found 1.5"),
        (r#"{"prompt":"hi","top_k":-5}"#, 400, "top_k: expected a positive integer, or 0 or -1 for no limit, found -5"),
        // Penalties out of range, and fields the server does not implement turned on: refused, never
        // answered as if not asked.
        (r#"{"prompt":"hi","presence_penalty":3}"#, 400, "presence_penalty: expected a number from -2 to 2, found 3"),
        (r#"{"prompt":"hi","logprobs":21}"#, 400, "logprobs: expected 0 to 20 alternatives per token, found 21"),
        (r#"{"prompt":"hi","echo":true}"#, 400, "echo: expected false (the prompt is not echoed), found true"),
        (r#"{"prompt":"hi","logit_bias":{"7":-500}}"#, 400, "logit_bias: expected biases from -100 to 100, found -500"),
        (
            r#"{"prompt":"hi","best_of":3}"#,
            400,
            "best_of: expected 1 or n (every completion drawn is returned), found 3",
        ),
        (r#"{"prompt":"hi","ignore_eos":"yes"}"#, 400, "ignore_eos: expected a boolean"),
        (r#"{"prompt":"hi","stop_token_ids":[2,-1]}"#, 400, "stop_token_ids: expected an array of token ids"),
        (
            r#"{"prompt":"hi","stop_token_ids":[49152]}"#,
            400,
            "stop_token_ids: expected token ids below smollm2-135m's vocabulary size 49152, found 49152",
        ),
        (
            r#"{"prompt":"hi","max_tokens":3,"min_tokens":4}"#,
            400,
            "min_tokens: expected at most the reply's token limit (3), found 4",
        ),
    ] {
        let (got, v) = post(&s, "/v1/completions", body);
        assert_eq!(got, status, "{v}");
        let message = v["error"]["message"].as_str().unwrap_or_else(|| panic!("no error object: {v}"));
        assert!(message.contains(says), "{message}");
        assert_eq!(v["error"]["param"].as_str(), says.split(':').next(), "{v}");
        assert!(v["error"]["type"].is_string(), "{v}");
        assert_eq!(get(&s, "/health").0, 200);
    }

    // A path or a method no route serves: an error object too.
    let (status, v) = get(&s, "/v1/embeddings");
    assert_eq!(status, 404, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().ends_with("found /v1/embeddings"), "{v}");
    let mut r = agent().get(&format!("{}/v1/completions", s.url)).call().unwrap();
    assert_eq!(r.status().as_u16(), 405);
    assert_eq!(r.headers().get("allow").and_then(|v| v.to_str().ok()), Some("POST"), "RFC 9110's Allow");
    let v: Value = r.body_mut().read_json().unwrap();
    assert_eq!(v["error"]["message"], "method: expected POST for /v1/completions, found GET");
    // No `--allowed-origins`: no CORS header, so a browser keeps the answer from another site's page.
    let r = agent().get(&format!("{}/v1/models", s.url)).header("origin", "http://localhost:3000").call().unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.headers().get("access-control-allow-origin").is_none(), "{r:?}");

    // A body over the limit: refused from its Content-Length alone, before it is read (sent by hand, so
    // the client does not race the server's early answer while still writing).
    let mut tcp = std::net::TcpStream::connect(s.url.trim_start_matches("http://")).unwrap();
    std::io::Write::write_all(
        &mut tcp,
        format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            5 << 20
        )
        .as_bytes(),
    )
    .unwrap();
    let mut answer = String::new();
    let _ = std::io::Read::read_to_string(&mut tcp, &mut answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer:?}");
    assert!(answer.to_ascii_lowercase().contains("connection: close"), "unread, so the connection ends: {answer:?}");
    assert_eq!(get(&s, "/health").0, 200);
    // A body that is not JSON by its type: a browser sends `text/plain` to any origin without asking.
    let r = agent()
        .post(&format!("{}/v1/completions", s.url))
        .header("content-type", "text/plain")
        .send(r#"{"prompt": "hi", "max_tokens": 1}"#)
        .unwrap();
    assert_eq!(r.status().as_u16(), 415);
    // A body the client garbled (a chunk size that is no number) is that, not one too large.
    let mut tcp = std::net::TcpStream::connect(s.url.trim_start_matches("http://")).unwrap();
    let garbled = "POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n\
                   zz\r\nabc\r\n0\r\n\r\n";
    std::io::Write::write_all(&mut tcp, garbled.as_bytes()).unwrap();
    let mut answer = String::new();
    let _ = std::io::Read::read_to_string(&mut tcp, &mut answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer:?}");
    assert!(
        answer.contains(r#""message":"body: expected a whole HTTP body, found a broken one after 0 bytes"#),
        "{answer:?}"
    );

    // Metrics count what happened.
    assert_eq!(metric(&s, r#"pdhost_requests_total{outcome="ok"}"#), Some(14.0));
    assert_eq!(metric(&s, r#"pdhost_requests_total{outcome="invalid_request"}"#), Some(26.0));
    // One from `/v1/completions`, one from `/v1/models/gpt-4`: every route counts its refusals.
    assert_eq!(metric(&s, r#"pdhost_requests_total{outcome="model_not_found"}"#), Some(2.0));
    assert_eq!(metric(&s, r#"pdhost_requests_total{outcome="not_found"}"#), Some(1.0));
    assert_eq!(metric(&s, r#"pdhost_requests_total{outcome="method_not_allowed"}"#), Some(1.0));
    assert_eq!(metric(&s, r#"pdhost_prefills_total{producer="rngd",where="remote"}"#), Some(14.0));
    assert_eq!(metric(&s, "pdhost_time_to_first_token_seconds_count"), Some(14.0));
    assert_eq!(metric(&s, "pdhost_spans_accepted_total"), Some(14.0));
    assert_eq!(metric(&s, r#"pdhost_producer_starts_total{kind="start"}"#), Some(1.0));
    assert_eq!(metric(&s, "pdhost_requests_running"), Some(0.0));
    idle.set_read_timeout(Some(Duration::from_secs(45).saturating_sub(opened.elapsed()).max(Duration::from_secs(1))))
        .unwrap();
    let mut rest = Vec::new();
    let closed = std::io::Read::read_to_end(&mut idle, &mut rest);
    assert!(closed.is_ok(), "a half-sent request's connection still open after {:?}: {closed:?}", opened.elapsed());
    slow.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut answer = String::new();
    let _ = std::io::Read::read_to_string(&mut slow, &mut answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert!(
        answer.contains("body: expected the rest of the body within 30 s, found 5 bytes, then nothing"),
        "{answer:?}"
    );
    assert_eq!(metric(&s, r#"pdhost_requests_total{outcome="request_timeout"}"#), Some(1.0));
    // A conversation too long for the context is named by its messages, not by a `prompt` it never sent;
    // one that fills it exactly, by what it leaves for a reply, not by a `max_tokens` it never sent.
    let chat = |words: usize| json!({"messages": [{"role": "user", "content": "hello ".repeat(words)}]}).to_string();
    let (status, v) = post(&s, "/v1/chat/completions", &chat(1100));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("messages")), "{v}");
    let refused = "messages: expected a conversation shorter than the 1024-token context (room for a reply), found";
    assert!(v["error"]["message"].as_str().unwrap().starts_with(refused), "{v}");
    let one = json!({"messages": [{"role": "user", "content": "hello "}], "max_tokens": 1}).to_string();
    let (status, v) = post(&s, "/v1/chat/completions", &one);
    let overhead = v["usage"]["prompt_tokens"].as_u64().unwrap_or_else(|| panic!("{status} {v}")) - 1;
    let (status, v) = post(&s, "/v1/chat/completions", &chat(1024 - overhead as usize));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("messages")), "{v}");
    assert_eq!(v["error"]["message"].as_str().unwrap(), format!("{refused} 1024 tokens"), "{v}");

    // A limit past the context is named by the field the client sent.
    let over = json!({"messages": [{"role": "user", "content": "hello"}], "max_completion_tokens": 5000}).to_string();
    let (status, v) = post(&s, "/v1/chat/completions", &over);
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("max_completion_tokens")), "{v}");
    // An empty model name is no name (as vLLM takes it), not an unknown model.
    let (status, v) = post(&s, "/v1/completions", r#"{"prompt":"hi","model":"","max_tokens":1}"#);
    assert_eq!(status, 200, "{v}");
}

#[test]
fn the_queue_refuses_past_its_size_and_a_client_that_leaves_cancels_its_request() {
    let s = serve(&["--producer", "local", "--slots", "1", "--queue", "1"]);
    // A long stream holds the engine.
    let lines = a_long_stream(&s);
    // Two more: one waits in the queue's one place, the other is refused with Retry-After.
    let send = |s: &Served| {
        let url = format!("{}/v1/completions", s.url);
        std::thread::spawn(move || {
            let r = agent().post(&url).send_json(json!({"prompt": "Hi", "max_tokens": 2, "temperature": 0})).unwrap();
            (r.status().as_u16(), r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string()))
        })
    };
    let (a, b) = (send(&s), send(&s));
    let deadline = Instant::now() + Duration::from_secs(60);
    // The refused one answers at once; the queued one only once the long stream is gone.
    while !a.is_finished() && !b.is_finished() {
        assert!(Instant::now() < deadline, "neither request was answered");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (first, queued) = if a.is_finished() { (a, b) } else { (b, a) };
    let refused = first.join().unwrap();
    assert_eq!(refused, (503, Some("1".to_string())));
    // The client of the long stream leaves: its request is cancelled and the queued one runs.
    drop(lines);
    assert_eq!(queued.join().unwrap().0, 200);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !s.log.lock().unwrap().contains("cancelled by its client") {
        assert!(Instant::now() < deadline, "no cancellation logged: {}", s.log.lock().unwrap());
        std::thread::sleep(Duration::from_millis(10));
    }
    // Its pages are free again: every group is back to no page in use.
    assert_eq!(metric(&s, r#"pdhost_requests_total{outcome="cancelled"}"#), Some(1.0));
    assert_eq!(metric(&s, r#"pdhost_requests_total{outcome="queue_full"}"#), Some(1.0));
    assert_eq!(metric(&s, r#"pdhost_kv_pages{group="0 (full attention)",state="used"}"#), Some(0.0));
    assert!(metric(&s, r#"pdhost_kv_pages{group="0 (full attention)",state="free"}"#).is_some_and(|f| f > 0.0));
}

/// A queued request whose client leaves gives its place back within a round, not once the busy slot
/// frees: the next request is queued, not refused (its place used to stay taken, and the next request
/// heard 503 for as long as the slot was busy).
#[test]
fn a_queued_client_that_leaves_gives_its_place_back() {
    let s = serve(&["--producer", "local", "--slots", "1", "--queue", "1"]);
    let url = format!("{}/v1/completions", s.url);
    let lines = a_long_stream(&s);
    let queued = agent().post(&url).send_json(json!({"prompt": "Hi", "max_tokens": 5, "stream": true})).unwrap();
    assert_eq!(queued.status().as_u16(), 200);
    assert_eq!(metric(&s, "pdhost_requests_waiting"), Some(1.0));
    drop(queued);
    await_metric(&s, "pdhost_requests_waiting", 0.0, Duration::from_secs(10), "the place is still taken");
    // The long stream still holds the slot; the next request takes the free place and waits.
    let next = {
        let url = url.clone();
        std::thread::spawn(move || agent().post(&url).send_json(json!({"prompt": "Hi", "max_tokens": 2})).unwrap())
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&s, "pdhost_requests_waiting") != Some(1.0) {
        assert!(!next.is_finished(), "the next request was answered while the slot was busy");
        assert!(Instant::now() < deadline, "the next request never queued");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(lines);
    assert_eq!(next.join().unwrap().status().as_u16(), 200);
}

/// While the only slot's prompt is prefilled by a producer (nothing decodes, so the engine waits for
/// requests and replies at once), requests past the queue's one place are still refused. The engine
/// used to take every request off the queue into a list of its own, where it counted as neither waiting
/// nor running, and none was refused.
#[test]
fn the_queue_refuses_past_its_size_while_a_remote_prefill_holds_the_slot() {
    let config = r#"{"fault": "hang", "on_requests": [1]}"#;
    let s = serve(&[
        "--producer",
        "faulty",
        "--backend-config",
        config,
        "--producer-timeout",
        "20",
        "--slots",
        "1",
        "--queue",
        "1",
    ]);
    let send = |s: &Served| {
        let url = format!("{}/v1/completions", s.url);
        std::thread::spawn(move || {
            let r = agent().post(&url).send_json(json!({"prompt": "Hi there", "max_tokens": 2, "temperature": 0}));
            r.unwrap().status().as_u16()
        })
    };
    let hung = send(&s);
    await_metric(&s, "pdhost_requests_running", 1.0, Duration::from_secs(60), "request 1 was never admitted");
    let mut more: Vec<_> = (0..3).map(|_| send(&s)).collect();
    // Refusals are at once; the hung prefill holds the slot for 20 s.
    let deadline = Instant::now() + Duration::from_secs(15);
    while more.iter().filter(|t| t.is_finished()).count() < 2 {
        assert!(Instant::now() < deadline, "fewer than two of three requests were refused while the slot was held");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(metric(&s, "pdhost_requests_waiting"), Some(1.0));
    let queued = more.iter().position(|t| !t.is_finished()).expect("one request waits");
    let waiting = more.remove(queued);
    assert_eq!(more.into_iter().map(|t| t.join().unwrap()).collect::<Vec<_>>(), [503, 503]);
    // The hung prefill falls back at its deadline; then the queued request runs.
    assert_eq!(hung.join().unwrap(), 200);
    assert_eq!(waiting.join().unwrap(), 200);
    assert_eq!(metric(&s, r#"pdhost_requests_total{outcome="queue_full"}"#), Some(2.0));
    assert_eq!(metric(&s, r#"pdhost_requests_total{outcome="ok"}"#), Some(2.0));
}

/// A stream whose client leaves while it waits for a slot is cancelled before it decodes a token: while
/// queued, or at the latest during its prefill, if the slot came free first (it used to be prefilled and
/// decoded a token first: its leaving was seen only when that token could not be sent).
#[test]
fn a_stream_whose_client_leaves_while_queued_never_decodes() {
    let s = serve(&["--producer", "local", "--slots", "1"]);
    // Idle, a server without producers waits; it does not spin a core (its engine thread once did, on a
    // reply channel that no producer kept open): a busy loop would use about 2 s of CPU here.
    let before = cpu_seconds(s.child.id());
    std::thread::sleep(Duration::from_secs(2));
    let idle = cpu_seconds(s.child.id()) - before;
    assert!(idle < 0.5, "an idle server used {idle:.2} s of CPU in 2 s");
    // Every server's outcomes are there from the start, at zero.
    for outcome in ["ok", "cancelled", "failed"] {
        assert_eq!(metric(&s, &format!("pdhost_requests_total{{outcome=\"{outcome}\"}}")), Some(0.0), "{outcome}");
    }
    let url = format!("{}/v1/completions", s.url);
    let lines = a_long_stream(&s);
    let queued = agent().post(&url).send_json(json!({"prompt": "Hi", "max_tokens": 5, "stream": true})).unwrap();
    assert_eq!(queued.status().as_u16(), 200);
    drop(queued);
    // Then the long stream's client leaves too, and the slot comes free: a second later, so that the
    // queued request's stream task has seen its client go (nothing outside the server shows when).
    std::thread::sleep(Duration::from_secs(1));
    drop(lines);
    // Both counted, and both lines read from the server's log (a thread of this test reads it, and
    // may read a line after the metric that follows it has been scraped).
    let deadline = Instant::now() + Duration::from_secs(30);
    let ended = |id: u32| {
        let log = s.log.lock().unwrap();
        ["cancelled while queued", "cancelled during prefill", "cancelled by its client"]
            .iter()
            .any(|how| log.contains(&format!("{how} id={id}")))
    };
    while metric(&s, r#"pdhost_requests_total{outcome="cancelled"}"#) != Some(2.0) || !ended(1) || !ended(2) {
        assert!(Instant::now() < deadline, "not both cancelled: {}", s.log.lock().unwrap());
        std::thread::sleep(Duration::from_millis(10));
    }
    let log = s.log.lock().unwrap();
    assert!(log.contains("cancelled while queued id=2") || log.contains("cancelled during prefill id=2"), "{log}");
    assert!(!log.contains("cancelled by its client id=2"), "{log}");
}

/// User and system CPU time of process `pid` so far, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    // After the command's closing parenthesis: state is field 3, utime 14 and stime 15 (proc(5)).
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf reads a constant.
    ticks as f64 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

/// A 1000-token stream (never ended by EOS), its first chunk read so that it surely holds a slot; its client leaves when the
/// lines are dropped.
fn a_long_stream(s: &Served) -> impl Iterator<Item = std::io::Result<String>> {
    let long = json!({"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "stream": true,
                      "ignore_eos": true});
    let r = agent().post(&format!("{}/v1/completions", s.url)).send_json(&long).unwrap();
    let mut lines = BufReader::new(r.into_body().into_reader()).lines();
    assert!(lines.next().unwrap().unwrap().starts_with("data: "));
    lines
}

fn producers_of(pid: u32) -> Vec<u32> {
    let children = pdhost_producer::procfs::children_of(pid as i32).unwrap();
    children.iter().map(|c| c.pid as u32).collect()
}

#[test]
fn an_api_key_is_required_when_set_and_sigterm_drains_leaving_nothing() {
    let mut s = serve(&["--producer", "rngd", "--api-key", "sesame", "--allowed-origins", "http://localhost:3000"]);
    let url = format!("{}/v1/completions", s.url);
    let body = json!({"prompt": "Hi", "max_tokens": 2, "temperature": 0});
    let r = agent().post(&url).send_json(&body).unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = agent().post(&url).header("authorization", "Bearer wrong").send_json(&body).unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = agent().post(&url).header("authorization", "Bearer sesame").send_json(&body).unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // The scheme's name is case-insensitive (RFC 9110); the key is not.
    let r = agent().post(&url).header("authorization", "bearer sesame").send_json(&body).unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let r = agent().post(&url).header("authorization", "Bearer SESAME").send_json(&body).unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(get(&s, "/health").0, 200, "health needs no key");

    // A page from an allowed origin: its browser's preflight is answered without the key, and the answer
    // to the request itself names the origin; a page from elsewhere gets no such header.
    let page = "http://localhost:3000";
    let r = agent()
        .options(&url)
        .header("origin", page)
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "authorization,content-type,x-stainless-os")
        .call()
        .unwrap();
    let header = |r: &ureq::http::Response<ureq::Body>, name: &str| {
        r.headers().get(name).map(|v| v.to_str().unwrap().to_ascii_lowercase())
    };
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(header(&r, "access-control-allow-origin").as_deref(), Some(page));
    assert!(header(&r, "access-control-allow-methods").is_some_and(|m| m.contains("post")), "{r:?}");
    let asked = |h: &str| h.contains("authorization") && h.contains("x-stainless-os");
    assert!(header(&r, "access-control-allow-headers").is_some_and(|h| asked(&h)), "the OpenAI SDK's too: {r:?}");
    for (origin, allowed) in [(page, Some(page)), ("http://elsewhere.example", None)] {
        let r = agent()
            .post(&url)
            .header("origin", origin)
            .header("authorization", "Bearer sesame")
            .send_json(&body)
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert_eq!(header(&r, "access-control-allow-origin").as_deref(), allowed, "{origin}");
    }
    for path in ["/tokenize", "/detokenize"] {
        let body = json!({"prompt": "Hi", "tokens": [1]});
        assert_eq!(agent().post(&format!("{}{path}", s.url)).send_json(&body).unwrap().status().as_u16(), 401);
    }

    let pid = s.child.id();
    let kids = producers_of(pid);
    assert_eq!(kids.len(), 1, "one producer while serving");
    // The rings are memfds, held only by the server and its producer (so they go with them), and never
    // named in /dev/shm, checked after the exit below.
    for holder in [pid, kids[0]] {
        let maps = std::fs::read_to_string(format!("/proc/{holder}/maps")).unwrap();
        assert!(maps.contains("memfd:pdhost-"), "process {holder} maps no ring: {maps}");
    }
    // SAFETY: signals the child this test started.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(40);
    let status = loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "no exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status.code(), Some(0), "{}", s.log.lock().unwrap());
    for kid in kids {
        assert!(!std::path::Path::new(&format!("/proc/{kid}")).exists(), "producer {kid} outlived the server");
    }
    let leftovers: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("pdhost"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// While the server starts (a producer's backend takes 60 s to open) its port answers: `/health` and
/// requests get 503 with `Retry-After`. SIGTERM then ends it with status 0 before that backend has
/// opened (it waits for nothing), no producer left.
#[test]
fn sigterm_while_the_server_starts_exits_zero() {
    fetched(MODEL);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = Command::new(PDHOST)
        .args(["serve", "--model", MODEL, "--port", &port.to_string(), "--context", "1024"])
        .args(["--producer", "faulty", "--backend-config", r#"{"open_delay_ms": 60000}"#])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Killed if this test fails before its SIGTERM.
    let mut s = Served { child, url: format!("http://127.0.0.1:{port}"), log: Arc::default() };
    let child = &mut s.child;
    let health = format!("{}/health", s.url);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        let status = agent().get(&health).call().map(|r| r.status().as_u16());
        if let Ok(status) = status {
            break status;
        }
        assert!(Instant::now() < deadline, "the port never answered");
        assert!(child.try_wait().unwrap().is_none(), "the server exited before it listened");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(status, 503, "caught while loading");
    let r = agent().post(&format!("{}/v1/completions", s.url)).send_json(json!({"prompt": "Hi", "max_tokens": 2}));
    let child = &mut s.child;
    let r = r.unwrap();
    assert_eq!(r.status().as_u16(), 503, "a request while loading");
    assert_eq!(r.headers().get("retry-after").map(|v| v.to_str().unwrap()), Some("1"));
    let pid = child.id();
    // The producer is spawned once the model has loaded, and then takes 60 s to open its backend: the
    // signal comes while it opens, so that the check below has a producer to look for.
    let deadline = Instant::now() + Duration::from_secs(30);
    let kids = loop {
        let kids = producers_of(pid);
        if !kids.is_empty() {
            break kids;
        }
        assert!(Instant::now() < deadline, "no producer spawned in 30 s");
        std::thread::sleep(Duration::from_millis(10));
    };
    // SAFETY: signals the child this test started.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "no exit in 30 s after SIGTERM: it waited for the loading");
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut log = String::new();
    child.stderr.take().unwrap().read_to_string(&mut log).unwrap();
    assert_eq!(status.code(), Some(0), "{log}");
    // A producer started before the signal ends with the server (its parent-death signal; whoever
    // adopted it reaps it, so a zombie counts as ended).
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|stat| stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    for kid in kids {
        while alive(kid) {
            assert!(Instant::now() < deadline, "producer {kid} outlived the server");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Chat completions render the messages with the model's own template to exactly transformers' ids
/// (the fixture made with `apply_chat_template`), and decode the same as `generate` on those ids.
#[test]
fn chat_completions_use_the_models_template_and_equal_generate() {
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/chat/chat_templates.json")).unwrap(),
    )
    .unwrap();
    let smol = fixture["models"].as_array().unwrap().iter().find(|m| m["model"] == MODEL).expect("smollm2 cases");
    let case = smol["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["add_generation_prompt"] == true && c["messages"].as_array().unwrap().len() >= 2)
        .expect("a conversation with a generation prompt");
    let ids: Vec<String> = case["ids"].as_array().unwrap().iter().map(|i| i.to_string()).collect();
    let out = Command::new(PDHOST)
        .args(["generate", "--model", MODEL, "--prompt-ids", &ids.join(","), "--max-tokens", "10", "--json"])
        .args(["--threads", "2"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let reference: Value = serde_json::from_slice(&out.stdout).unwrap();

    let s = serve(&["--producer", "gpu"]);
    assert_eq!(get(&s, "/v1/models").1["data"][0]["chat_template"], "metadata");
    let body = json!({"model": MODEL, "messages": case["messages"], "max_tokens": 10, "temperature": 0});
    let mut off = body.clone();
    off["tools"] = json!([]);
    off["response_format"] = json!({"type": "text"});
    off["logprobs"] = json!(false);
    let (status, v) = post(&s, "/v1/chat/completions", &off.to_string());
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["usage"]["prompt_tokens"], case["ids"].as_array().unwrap().len(), "the template's ids");
    assert_eq!(v["pdhost"]["output_ids"], reference["output_ids"]);
    assert_eq!(v["pdhost"]["logits_xxh3"], reference["logits_xxh3"]);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], reference["text"]);

    let chunks_of = |streamed: &Value| {
        let r = agent().post(&format!("{}/v1/chat/completions", s.url)).send_json(streamed).unwrap();
        let mut chunks = Vec::new();
        for line in BufReader::new(r.into_body().into_reader()).lines() {
            let line = line.unwrap();
            match line.strip_prefix("data: ") {
                Some("[DONE]") => break,
                Some(data) => chunks.push(serde_json::from_str::<Value>(data).unwrap()),
                None => {}
            }
        }
        assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant", "{chunks:?}");
        let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        (chunks, text)
    };
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, text) = chunks_of(&streamed);
    assert_eq!(text, reference["text"].as_str().unwrap());
    // A stream that ends before any text (a stop string in its first token) still says its role.
    let first = reference["text"].as_str().unwrap().chars().next().unwrap();
    streamed["stop"] = json!(first.to_string());
    let (chunks, text) = chunks_of(&streamed);
    assert_eq!(text, "");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");

    // `/tokenize` and `/detokenize` (vLLM's): a conversation's ids are the chat request's, as
    // transformers' template gives them; a prompt's are transformers' tokenizer's, with or without its
    // special tokens; ids go back to the text.
    let (status, v) = post(&s, "/tokenize", &json!({"model": MODEL, "messages": case["messages"]}).to_string());
    assert_eq!(status, 200, "{v}");
    assert_eq!((&v["tokens"], &v["count"]), (&case["ids"], &json!(case["ids"].as_array().unwrap().len())));
    assert_eq!((&v["max_model_len"], &v["token_strs"]), (&json!(1024), &Value::Null));
    let tokenizer: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fixtures/reference/tokenizer_smollm2_135m.json"
        ))
        .unwrap(),
    )
    .unwrap();
    for t in tokenizer["cases"].as_array().unwrap() {
        let (_, v) = post(&s, "/tokenize", &json!({"prompt": t["text"]}).to_string());
        assert_eq!(v["tokens"], t["ids_with_bos"], "{t}");
        let plain = json!({"prompt": t["text"], "add_special_tokens": false});
        assert_eq!(post(&s, "/tokenize", &plain.to_string()).1["tokens"], t["ids_plain"], "{t}");
        let (status, v) = post(&s, "/detokenize", &json!({"tokens": t["ids_plain"]}).to_string());
        assert_eq!((status, &v["prompt"]), (200, &t["text"]), "{t}");
    }
    // vLLM's `continue_final_message`: the prompt stops inside the last message (the closed turn's
    // ids, less its end), and a chat completion asked so reads those ids.
    let partial = json!([{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hel"}]);
    let ids = |extra: Value| {
        let mut body = json!({"messages": partial, "add_generation_prompt": false});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        post(&s, "/tokenize", &body.to_string()).1["tokens"].as_array().unwrap().clone()
    };
    let (closed, continued) = (ids(json!({})), ids(json!({"continue_final_message": true})));
    assert!(continued.len() < closed.len() && closed.starts_with(&continued), "{closed:?} {continued:?}");
    let asks = json!({"messages": partial, "add_generation_prompt": false, "continue_final_message": true,
                      "max_tokens": 2, "temperature": 0});
    let (status, v) = post(&s, "/v1/chat/completions", &asks.to_string());
    assert_eq!((status, &v["usage"]["prompt_tokens"]), (200, &json!(continued.len())), "{v}");
    assert!(v["pdhost"].get("ignored_fields").is_none(), "{v}");
    let (_, v) = post(&s, "/tokenize", r#"{"prompt": "Hello, world!", "return_token_strs": true}"#);
    assert_eq!(v["token_strs"], json!(["Hello", ",", "Ġworld", "!"]), "the vocabulary's own spelling");
    for (path, body, status, starts) in [
        (
            "/tokenize",
            json!({"prompt": "x", "messages": case["messages"]}),
            400,
            "prompt: expected a prompt or messages",
        ),
        ("/tokenize", json!({"prompt": [1, 2]}), 400, "prompt: expected a string"),
        ("/tokenize", json!({"prompt": "x", "model": "gpt-4"}), 404, "model:"),
        ("/detokenize", json!({"tokens": [1, 49152]}), 400, "tokens: expected an array of token ids below 49152"),
        ("/detokenize", json!({"tokens": "1"}), 400, "tokens:"),
    ] {
        let (got, v) = post(&s, path, &body.to_string());
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(got == status && message.starts_with(starts), "{path} {body}: {got} {v}");
    }

    // Malformed messages: 400s naming `messages` (SmolLM2's template refuses no conversation; a refusal's
    // 400, through Gemma 3's, is `server::api`'s `a_template_refusal_is_quoted_whole`).
    for body in [
        r#"{"messages":[]}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"n":0}"#,
        r#"{"messages":[{"role":"user"}]}"#,
        r#"{"messages":"hi"}"#,
    ] {
        let (status, v) = post(&s, "/v1/chat/completions", body);
        assert_eq!(status, 400, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().starts_with(if body.contains("\"n\"") {
                "n:"
            } else {
                "messages:"
            }),
            "{v}"
        );
    }
    // What a chat client can ask for and this server does not do: refused, naming the field.
    for (field, value) in [
        ("response_format", json!({"type": "json_object"})),
        ("tools", json!([{"type": "function", "function": {"name": "f"}}])),
        // Alternatives without the log-probabilities they come with.
        ("top_logprobs", json!(2)),
    ] {
        let mut asks = body.clone();
        asks[field] = value;
        let (status, v) = post(&s, "/v1/chat/completions", &asks.to_string());
        assert_eq!((status, &v["error"]["param"]), (400, &json!(field)), "{v}");
    }
}

/// Log-probabilities: the model's own (those `generate --logprobs` reports, from the logits a
/// response's hash covers), in each API's shape, the same streamed or not while another request shares
/// the batch, and the greedy token always the likeliest.
#[test]
fn logprobs_are_those_of_generate_streamed_or_not_in_either_api() {
    let s = serve(&["--producer", "rngd", "--slots", "2"]);
    let prompt = "The capital of France is";
    let reference = generate(prompt, 8, &["--logprobs", "3"]);
    let want: Vec<&Value> = reference["logprobs"].as_array().unwrap().iter().collect();
    assert_eq!(want.len(), 8);
    for t in &want {
        assert_eq!(t["top"][0][0], t["id"], "greedy: the likeliest token {t}");
        assert_eq!(t["top"][0][1], t["logprob"]);
        let tops: Vec<f64> = t["top"].as_array().unwrap().iter().map(|p| p[1].as_f64().unwrap()).collect();
        assert!(tops.windows(2).all(|w| w[0] >= w[1]) && tops[0] <= 0.0, "{t}");
    }
    // A stop string that never comes: the stream holds back text that might become it, and each chunk's
    // log-probabilities are those of the tokens its text completes.
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3, "stop": ["qqqqqqqqqqqq"]});
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    // The stream and the whole response at once: they share decode steps.
    let (chunks, (status, whole)) = std::thread::scope(|scope| {
        let stream = scope.spawn(|| sse(&s, &streamed));
        let whole = post(&s, "/v1/completions", &body.to_string());
        (stream.join().unwrap(), whole)
    });
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["pdhost"]["output_ids"], reference["output_ids"]);
    let lp = &whole["choices"][0]["logprobs"];
    let values = |key: &str, v: &Value| v[key].as_array().unwrap().clone();
    assert_eq!(values("token_logprobs", lp), want.iter().map(|t| t["logprob"].clone()).collect::<Vec<_>>());
    let tokens: Vec<String> = values("tokens", lp).iter().map(|t| t.as_str().unwrap().to_string()).collect();
    assert_eq!(tokens.concat(), whole["choices"][0]["text"].as_str().unwrap(), "the tokens spell the text");
    for (top, t) in values("top_logprobs", lp).iter().zip(&want) {
        // The likeliest first, as OpenAI and vLLM list them (the body's order: this client keeps it).
        let got: Vec<f64> = top.as_object().unwrap().values().map(|v| v.as_f64().unwrap()).collect();
        let expected: Vec<f64> = t["top"].as_array().unwrap().iter().map(|p| p[1].as_f64().unwrap()).collect();
        assert_eq!(got, expected, "{top}");
    }
    let offsets = values("text_offset", lp);
    assert_eq!(offsets[0], 0);
    // Streamed: the chunks' log-probabilities, in order, are the whole response's.
    let chunks: Vec<Value> =
        chunks.iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect();
    let parts: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["logprobs"]).filter(|l| !l.is_null()).collect();
    let joined = |key: &str| parts.iter().flat_map(|p| values(key, p)).collect::<Vec<_>>();
    assert_eq!(joined("token_logprobs"), values("token_logprobs", lp));
    assert_eq!(joined("tokens"), values("tokens", lp));
    assert_eq!(joined("text_offset"), offsets);
    // Never ahead of the text: the tokens reported so far spell a prefix of the text sent so far (a
    // token whose text is held back, or split across chunks, comes with the chunk that completes it).
    let (mut text, mut spelled) = (String::new(), String::new());
    for choice in chunks.iter().map(|c| &c["choices"][0]) {
        text.push_str(choice["text"].as_str().unwrap_or_default());
        if !choice["logprobs"].is_null() {
            spelled.extend(values("tokens", &choice["logprobs"]).iter().map(|t| t.as_str().unwrap().to_string()));
        }
        assert!(text.starts_with(&spelled), "tokens {spelled:?} ahead of the text {text:?}");
    }
    assert_eq!(spelled, text);

    // Chat: `logprobs: true` and `top_logprobs`, each token with its bytes.
    let chat = json!({"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6, "temperature": 0,
                      "logprobs": true, "top_logprobs": 2});
    let (status, v) = post(&s, "/v1/chat/completions", &chat.to_string());
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len() as u64, v["usage"]["completion_tokens"].as_u64().unwrap());
    let bytes: Vec<u8> =
        content.iter().flat_map(|t| t["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8)).collect();
    assert_eq!(String::from_utf8(bytes).unwrap(), v["choices"][0]["message"]["content"].as_str().unwrap());
    for t in content {
        assert_eq!(t["top_logprobs"].as_array().unwrap().len(), 2, "{t}");
        assert_eq!(t["top_logprobs"][0]["token"], t["token"], "greedy: the likeliest {t}");
        assert_eq!(t["top_logprobs"][0]["logprob"], t["logprob"]);
    }
    // A chosen token that is not among the likeliest (here forced by a bias; the log-probabilities are
    // the model's, before it) joins them: up to `logprobs` + 1 entries, as OpenAI's legacy API says.
    let likeliest = want[0]["id"].as_u64().unwrap();
    let forced = want[0]["top"][2][0].as_u64().unwrap();
    let biased = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                        "logit_bias": {forced.to_string(): 100}});
    let (status, v) = post(&s, "/v1/completions", &biased.to_string());
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["pdhost"]["output_ids"], json!([forced]), "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let top = lp["top_logprobs"][0].as_object().unwrap();
    assert_eq!(top.len(), 2, "the likeliest and the chosen: {lp}");
    assert_eq!(top[lp["tokens"][0].as_str().unwrap()], lp["token_logprobs"][0], "{lp}");
    assert_eq!(lp["token_logprobs"][0], want[0]["top"][2][1], "{lp}");
    assert_ne!(likeliest, forced);
    // Tokens that stand for single bytes of multi-byte characters (forced by biases): each one's
    // `text_offset` is where its character starts in the text, in characters (it counted the characters
    // of its `bytes:\xNN` name, ten a byte).
    let path = model::registry::fetch(MODEL, &mut model::registry::Quiet).unwrap();
    let gguf = model::gguf::Gguf::open(&path).unwrap();
    let tokenizer = model::tokenizer::Tokenizer::from_gguf(&gguf).unwrap();
    let bias: serde_json::Map<String, Value> = (0..model::arch::Config::from_gguf(&gguf).unwrap().vocab as u32)
        .filter(|&id| matches!(tokenizer.token_bytes(id)[..], [b] if b >= 0x80))
        .map(|id| (id.to_string(), json!(100)))
        .collect();
    assert!(bias.len() >= 64, "{} single high-byte tokens", bias.len());
    let bytes = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0, "logit_bias": bias});
    let (status, v) = post(&s, "/v1/completions", &bytes.to_string());
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    let offsets: Vec<u64> =
        v["choices"][0]["logprobs"]["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect();
    assert_eq!(offsets.len(), 8, "{v}");
    assert!(
        offsets.iter().all(|&o| o < text.chars().count() as u64) && offsets.windows(2).all(|w| w[0] <= w[1]),
        "{v}"
    );
    assert!(offsets.windows(2).any(|w| w[0] == w[1]), "a character of several byte tokens: {v}");
    // Without them: null, as before.
    let (_, v) = post(&s, "/v1/completions", &json!({"prompt": prompt, "max_tokens": 2}).to_string());
    assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
}

/// The official `openai` Python client, pinned, in a virtual environment under pdhost's cache (made once).
fn openai_python() -> std::path::PathBuf {
    const VERSION: &str = "3.57.0";
    let home = std::env::var_os("PDHOST_HOME")
        .filter(|h| !h.is_empty())
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/pdhost"));
    let venv = home.join("venvs").join(format!("openai-{VERSION}"));
    let python = venv.join("bin/python");
    if python.exists() {
        return python;
    }
    let scratch = home.join("venvs").join(format!(".openai-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let ok = Command::new("python3").args(["-m", "venv"]).arg(&scratch).status().unwrap().success()
        && Command::new(scratch.join("bin/pip"))
            .args(["install", "--quiet", "--disable-pip-version-check", &format!("openai=={VERSION}")])
            .status()
            .unwrap()
            .success();
    assert!(ok, "installing openai=={VERSION} from the Python package registry");
    // Another test process may have won the race; either venv works.
    if std::fs::rename(&scratch, &venv).is_err() {
        let _ = std::fs::remove_dir_all(&scratch);
    }
    python
}

#[test]
fn the_official_openai_client_works_unmodified() {
    let python = openai_python();
    let s = serve(&["--producer", "rngd"]);
    let reference = generate("The capital of France is", 12, &[]);
    let script = format!(
        r#"
import json, openai
c = openai.OpenAI(base_url="{url}/v1", api_key="unused")
out = {{}}
r = c.completions.create(model="{MODEL}", prompt="The capital of France is", max_tokens=12, temperature=0)
out["text"] = r.choices[0].text
out["usage"] = [r.usage.prompt_tokens, r.usage.completion_tokens]
s = c.completions.create(model="{MODEL}", prompt="The capital of France is", max_tokens=12, temperature=0,
                         stream=True, stream_options={{"include_usage": True}})
out["streamed"] = "".join(ch.choices[0].text for ch in s if ch.choices)
r = c.chat.completions.create(model="{MODEL}", messages=[{{"role": "user", "content": "Hi"}}], max_tokens=4, temperature=0)
out["chat_role"] = r.choices[0].message.role
r = c.chat.completions.create(model="{MODEL}", messages=[{{"role": "user", "content": "Hi"}}], max_tokens=4,
                              temperature=0, logprobs=True, top_logprobs=2)
out["chat_logprobs"] = [[t.token, len(t.top_logprobs)] for t in r.choices[0].logprobs.content]
r = c.completions.create(model="{MODEL}", prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=1)
out["logprobs"] = r.choices[0].logprobs.token_logprobs
out["models"] = [m.id for m in c.models.list()]
try:
    c.completions.create(model="{MODEL}", prompt="x", max_tokens=99999)
except openai.BadRequestError as e:
    out["error"] = [e.status_code, e.body["message"] if isinstance(e.body, dict) else str(e.body)]
print(json.dumps(out))
"#,
        url = s.url
    );
    let out = Command::new(python).args(["-c", &script]).stdin(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["text"], reference["text"]);
    assert_eq!(v["streamed"], reference["text"]);
    assert_eq!(v["usage"][1], 12);
    assert_eq!(v["chat_role"], "assistant");
    assert_eq!(v["chat_logprobs"].as_array().unwrap().len(), 4, "{v}");
    assert!(v["chat_logprobs"].as_array().unwrap().iter().all(|t| t[1] == 2), "{v}");
    let lps = generate("The capital of France is", 3, &["--logprobs", "1"]);
    let want: Vec<&Value> = lps["logprobs"].as_array().unwrap().iter().map(|t| &t["logprob"]).collect();
    assert_eq!(v["logprobs"].as_array().unwrap().iter().collect::<Vec<_>>(), want);
    assert_eq!(v["models"], json!([MODEL]));
    assert_eq!(v["error"][0], 400);
    assert!(v["error"][1].as_str().unwrap().starts_with("max_tokens: expected at most"), "{v}");
}

/// With two slots, a short request admitted while a long stream decodes finishes first (the order of
/// events, not timings), and both compute exactly what they compute alone.
#[test]
fn slots_interleave_streams_and_each_equals_generate_alone_sampled_or_greedy() {
    // Spans of two tokens: the short prompt's prefill comes in pieces between the long stream's rounds.
    let s = serve(&["--producer", "rngd", "--slots", "2", "--prefill-chunk", "2"]);
    // The short request below samples, with penalties and a bias against the token it would draw first
    // without them: its seed gives the same draws in a batch as alone. That first token comes from a
    // `generate` run now, before the long stream starts: run while it is live, the stream could end first.
    let sampled = ["--temperature", "0.8", "--top-p", "0.9", "--seed", "5"];
    let unbiased = generate("The three primary colours are", 3, &sampled)["output_ids"][0].as_u64().unwrap();
    let long = json!({"prompt": "Once upon a time", "max_tokens": 120, "temperature": 0, "stream": true});
    let r = agent().post(&format!("{}/v1/completions", s.url)).send_json(&long).unwrap();
    let mut lines = BufReader::new(r.into_body().into_reader()).lines();
    let mut long_chunks = Vec::new();
    // Its first piece of text: it is live.
    while long_chunks.is_empty() {
        let line = lines.next().unwrap().unwrap();
        if let Some(data) = line.strip_prefix("data: ") {
            long_chunks.push(data.to_string());
        }
    }
    let (status, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "The three primary colours are", "max_tokens": 3, "temperature": 0.8, "top_p": 0.9,
                "seed": 5, "repetition_penalty": 1.2, "frequency_penalty": 0.5,
                "logit_bias": {unbiased.to_string(): -100}})
        .to_string(),
    );
    let bias = format!("{unbiased}:-100");
    let penalized = ["--repetition-penalty", "1.2", "--frequency-penalty", "0.5", "--logit-bias", &bias];
    let short = generate("The three primary colours are", 3, &[&sampled[..], &penalized[..]].concat());
    assert_ne!(short["output_ids"][0], unbiased, "the bias moved the first draw");
    assert_eq!(status, 200, "{v}");
    let prefilled = v["usage"]["prompt_tokens"].as_u64().unwrap() - 1;
    assert_eq!(v["pdhost"]["spans"].as_u64(), Some(prefilled.div_ceil(2)), "{v}");
    assert_eq!(v["pdhost"]["output_ids"], short["output_ids"]);
    assert_eq!(v["pdhost"]["logits_xxh3"], short["logits_xxh3"]);
    // The long stream had not finished when the short request was answered, and goes on to the end.
    for line in lines {
        let line = line.unwrap();
        if let Some(data) = line.strip_prefix("data: ") {
            long_chunks.push(data.to_string());
            if data == "[DONE]" {
                break;
            }
        }
    }
    let chunks: Vec<Value> =
        long_chunks.iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect();
    let last = chunks.iter().find(|c| !c["pdhost"].is_null()).expect("a final chunk");
    let alone = generate("Once upon a time", 120, &[]);
    assert_eq!(last["pdhost"]["output_ids"], alone["output_ids"]);
    assert_eq!(last["pdhost"]["logits_xxh3"], alone["logits_xxh3"], "bit-identical while another request ran");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, alone["text"].as_str().unwrap());
    // The server ended the short request (id 2) before the long one (id 1) it had admitted first.
    let log = s.log.lock().unwrap().clone();
    let ended =
        |id: u32| log.find(&format!("request id={id} ")).unwrap_or_else(|| panic!("request {id} not logged: {log}"));
    assert!(ended(2) < ended(1), "{log}");
    // The seeded request reports its seed; unseeded ones each draw their own, and a reported seed gives
    // the same reply again.
    assert_eq!(v["pdhost"]["seed"], 5, "{v}");
    let unseeded = json!({"prompt": "The three primary colours are", "max_tokens": 6, "temperature": 1.5}).to_string();
    let (a, b) = (post(&s, "/v1/completions", &unseeded).1, post(&s, "/v1/completions", &unseeded).1);
    let seed = |v: &Value| v["pdhost"]["seed"].as_u64().unwrap_or_else(|| panic!("no seed: {v}"));
    assert_ne!(seed(&a), seed(&b), "{a}\n{b}");
    let again =
        json!({"prompt": "The three primary colours are", "max_tokens": 6, "temperature": 1.5, "seed": seed(&b)});
    let (status, again) = post(&s, "/v1/completions", &again.to_string());
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["pdhost"]["output_ids"], b["pdhost"]["output_ids"]);
    assert_eq!(again["pdhost"]["logits_xxh3"], b["pdhost"]["logits_xxh3"]);
    assert!(last["pdhost"]["seed"].is_null(), "a greedy reply has no seed: {last}");
}

/// `n` choices of a prompt and a batch of prompts: each choice equals the request of one choice that
/// it stands for (choice `j` sampled with the seed plus `j`), streamed or not, in OpenAI's order.
#[test]
fn n_choices_and_batched_prompts_each_equal_their_own_request() {
    let s = serve(&["--slots", "2", "--queue", "6"]);
    let alone = |body: Value| {
        let (status, v) = post(&s, "/v1/completions", &body.to_string());
        assert_eq!(status, 200, "{v}");
        v
    };
    let sampled = json!({"prompt": "The three primary colours are", "max_tokens": 8, "temperature": 1.2, "seed": 40});
    let mut three = sampled.clone();
    three["n"] = json!(3);
    let v = alone(three.clone());
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{v}");
    // vLLM's token counters: each choice's prompt (a sequence of its own), and every token drawn.
    let prompt_tokens = v["usage"]["prompt_tokens"].as_f64().unwrap();
    assert_eq!(metric(&s, "pdhost_prompt_tokens_total"), Some(3.0 * prompt_tokens));
    assert_eq!(metric(&s, "pdhost_generation_tokens_total"), v["usage"]["completion_tokens"].as_f64());
    let mut completion_tokens = 0;
    for (j, choice) in choices.iter().enumerate() {
        let mut one = sampled.clone();
        one["seed"] = json!(40 + j);
        let one = alone(one);
        assert_eq!((choice["index"].as_u64(), &choice["text"]), (Some(j as u64), &one["choices"][0]["text"]));
        assert_eq!(v["pdhost"]["choices"][j]["output_ids"], one["pdhost"]["output_ids"], "choice {j}");
        assert_eq!(v["pdhost"]["choices"][j]["logits_xxh3"], one["pdhost"]["logits_xxh3"], "choice {j}");
        assert_eq!(v["pdhost"]["choices"][j]["seed"], 40 + j, "choice {j}");
        assert_eq!(v["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"], "a prompt counts once");
        completion_tokens += one["usage"]["completion_tokens"].as_u64().unwrap();
    }
    assert_eq!(v["usage"]["completion_tokens"], completion_tokens);
    // Choice 1 went live with choice 0, from a copy of its prefilled K/V; choice 2, left without a
    // slot until one of them ended, prefilled its own.
    let prefilled = |c: usize| (&v["pdhost"]["choices"][c]["spans"], &v["pdhost"]["choices"][c]["prefix_hit_tokens"]);
    let head = v["usage"]["prompt_tokens"].as_u64().unwrap() - 1;
    assert_eq!(prefilled(1), (&json!(0), &json!(head)), "{v}");
    assert_eq!(prefilled(2), (&json!(1), &json!(0)), "{v}");
    let ids = |c: usize| &v["pdhost"]["choices"][c]["output_ids"];
    assert!(ids(0) != ids(1) || ids(1) != ids(2), "three seeds, three draws: {v}");

    // Streamed: each chunk names its choice, and each choice's text and end are those above.
    three["stream"] = json!(true);
    three["stream_options"] = json!({"include_usage": true});
    let chunks: Vec<Value> =
        sse(&s, &three).iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect();
    for (j, choice) in choices.iter().enumerate() {
        let mine = chunks.iter().filter_map(|c| c["choices"].as_array()?.first()).filter(|c| c["index"] == j);
        let text: String = mine.clone().filter_map(|c| c["text"].as_str()).collect();
        let ends: Vec<&Value> = mine.map(|c| &c["finish_reason"]).filter(|f| !f.is_null()).collect();
        assert_eq!((&json!(text), ends), (&choice["text"], vec![&choice["finish_reason"]]), "choice {j}");
    }
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], completion_tokens);

    // A batch of prompts, text and ids, two choices each: choice `2i + j` is prompt `i`'s `j`-th.
    let greedy = json!({"prompt": ["Once upon a time", [1, 2, 3, 4]], "max_tokens": 6, "temperature": 0, "n": 2});
    let v = alone(greedy);
    assert_eq!(v["choices"].as_array().unwrap().len(), 4, "{v}");
    for (i, prompt) in [json!("Once upon a time"), json!([1, 2, 3, 4])].into_iter().enumerate() {
        let one = alone(json!({"prompt": prompt, "max_tokens": 6, "temperature": 0}));
        for j in 0..2 {
            assert_eq!(v["choices"][2 * i + j]["text"], one["choices"][0]["text"], "prompt {i}, choice {j}");
            assert_eq!(v["pdhost"]["choices"][2 * i + j]["logits_xxh3"], one["pdhost"]["logits_xxh3"]);
        }
    }

    // A client that leaves a stream of three choices (two running, one waiting for a slot) cancels all
    // three, and every place and page comes back.
    let body = json!({"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": true, "n": 3, "stream": true});
    let r = agent().post(&format!("{}/v1/completions", s.url)).send_json(&body).unwrap();
    let mut lines = BufReader::new(r.into_body().into_reader()).lines();
    while !lines.next().unwrap().unwrap().starts_with("data: ") {}
    drop(lines);
    let cancelled = r#"pdhost_requests_total{outcome="cancelled"}"#;
    await_metric(&s, cancelled, 3.0, Duration::from_secs(30), "not all three cancelled");
    assert_eq!(metric(&s, "pdhost_requests_waiting"), Some(0.0));
    assert_eq!(metric(&s, r#"pdhost_kv_pages{group="0 (full attention)",state="used"}"#), Some(0.0));

    // A prompt of a batch that cannot run is named.
    let (status, v) = post(&s, "/v1/completions", &json!({"prompt": [[1, 2], [3, 49152]]}).to_string());
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().ends_with("found 49152 at position 1 (prompt 1)"), "{v}");

    // More choices than the queue holds: refused, naming what was asked.
    let (status, v) = post(&s, "/v1/completions", &json!({"prompt": "hi", "n": 7}).to_string());
    assert_eq!(status, 400, "{v}");
    assert_eq!(
        v["error"]["message"],
        "n: expected at most 6 choices a request (the server's --queue), found 1 prompt(s) times n 7"
    );
}

/// While a drain waits for a stream, new requests hear 503 (not a refused connection); a stream still
/// open when the drain timeout passes does not keep the server up: it exits 0, its producer gone with it.
#[test]
fn the_drain_timeout_ends_a_stream_that_outlives_it() {
    // One slot of 4096 tokens: the stream below (4,000 tokens, never ended by EOS) outlasts the 6 s drain
    // timeout on any machine this runs on. With 1,000 tokens it once finished first: SmolLM2 decodes
    // more than 150 tokens a second here.
    let mut s = serve(&["--producer", "rngd", "--drain-timeout", "6", "--context", "4096", "--slots", "1"]);
    let long = json!({
        "prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "stream": true, "ignore_eos": true
    });
    let r = agent().post(&format!("{}/v1/completions", s.url)).send_json(&long).unwrap();
    let mut lines = BufReader::new(r.into_body().into_reader()).lines();
    assert!(lines.next().unwrap().unwrap().starts_with("data: "));
    // The stream is read as it comes, so that no socket buffer fills and holds back its last events.
    let reader = std::thread::spawn(move || {
        lines.map_while(Result::ok).filter(|l| l.starts_with("data: ")).collect::<Vec<String>>()
    });
    let pid = s.child.id();
    let kids = producers_of(pid);
    // SAFETY: signals the child this test started.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    // The drain timeout (6 s) leaves a slow machine time to see the drain before the server exits.
    let deadline = Instant::now() + Duration::from_secs(5);
    while get(&s, "/health").0 != 503 {
        assert!(Instant::now() < deadline, "still healthy 5 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    }
    let r = agent().post(&format!("{}/v1/completions", s.url)).send_json(json!({"prompt": "Hi"})).unwrap();
    assert_eq!(r.status().as_u16(), 503);
    assert_eq!(r.headers().get("retry-after").map(|v| v.to_str().unwrap()), Some("1"));
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "still up 30 s after SIGTERM with a 6 s drain timeout; its log: {}",
            s.log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status.code(), Some(0), "{}", s.log.lock().unwrap());
    // The server has exited; this test's thread may still be reading its last lines.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !s.log.lock().unwrap().contains("drain timeout") {
        assert!(Instant::now() < deadline, "no drain timeout logged: {}", s.log.lock().unwrap());
        std::thread::sleep(Duration::from_millis(10));
    }
    for kid in kids {
        assert!(!std::path::Path::new(&format!("/proc/{kid}")).exists(), "producer {kid} outlived the server");
    }
    // The stream does not end as if it were complete: an error event, then `[DONE]`.
    let rest = reader.join().unwrap();
    let n = rest.len();
    assert!(n >= 2 && rest[n - 1] == "data: [DONE]", "the stream's end: {:?}", &rest[n.saturating_sub(3)..]);
    assert!(rest[n - 2].contains(r#""code":"engine_stopped""#), "the stream's end: {:?}", &rest[n - 2..]);
}

/// Prefill overlaps decode: while a producer spends 3 s on one request's prompt (the `faulty` backend's
/// `slow` mode on request 2), the stream already live keeps receiving tokens. The order of events is
/// asserted, not timings: tokens of stream A arrive after B was sent and before B's answer, and B was
/// still prefilled remotely.
#[test]
fn a_live_stream_keeps_decoding_while_another_prompt_prefills_in_a_producer() {
    let config = r#"{"fault": "slow", "on_requests": [2], "delay_ms": 3000}"#;
    let s = serve(&["--producer", "faulty", "--backend-config", config, "--slots", "2"]);
    let events = Arc::new(Mutex::new(Vec::<&'static str>::new()));
    let a = {
        let (url, events) = (s.url.clone(), Arc::clone(&events));
        std::thread::spawn(move || {
            let body =
                json!({"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 400, "temperature": 0, "stream": true});
            let r = agent().post(&format!("{url}/v1/completions")).send_json(&body).unwrap();
            for line in BufReader::new(r.into_body().into_reader()).lines() {
                let line = line.unwrap();
                if line == "data: [DONE]" {
                    break;
                }
                if line.starts_with("data: ") {
                    events.lock().unwrap().push("A token");
                }
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while events.lock().unwrap().len() < 3 {
        assert!(Instant::now() < deadline, "stream A never started: {}", s.log.lock().unwrap());
        std::thread::sleep(Duration::from_millis(20));
    }
    events.lock().unwrap().push("B sent");
    let (status, b) = post(&s, "/v1/completions", &json!({"prompt": "Hello there", "max_tokens": 2}).to_string());
    events.lock().unwrap().push("B answered");
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["pdhost"]["prefill"], "remote", "{b}");
    a.join().unwrap();
    let events = events.lock().unwrap();
    let sent = events.iter().position(|e| *e == "B sent").unwrap();
    let answered = events.iter().position(|e| *e == "B answered").unwrap();
    let during = events[sent..answered].iter().filter(|e| **e == "A token").count();
    assert!(during >= 3, "stream A got {during} tokens while B prefilled: {events:?}");
}

/// Requests that arrive while the one producer is busy (request 1 held there 2 s by the `faulty`
/// backend's `slow` fault) go to it together, as one batch of chunks that its backend computes in one
/// pass (`stage`): the metrics count a batch of more than one chunk, and every reply still equals
/// `generate` alone, its logits bits included.
#[test]
fn requests_that_wait_for_a_busy_producer_prefill_as_one_batch_and_each_equals_generate() {
    let config = r#"{"fault": "slow", "on_requests": [1], "delay_ms": 2000}"#;
    let s = serve(&["--producer", "faulty", "--backend-config", config, "--slots", "4"]);
    let prompts = ["The capital of France is", "Water boils at", "My favourite colour is", "Once upon a time"];
    let replies: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, prompt)| {
            let url = s.url.clone();
            let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}).to_string();
            // Request 1 first: the others arrive while it holds the producer.
            std::thread::sleep(Duration::from_millis(if i == 1 { 300 } else { 0 }));
            std::thread::spawn(move || post_to(&url, "/v1/completions", &body))
        })
        .collect();
    for (prompt, reply) in prompts.iter().zip(replies) {
        let (status, v) = reply.join().unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["pdhost"]["prefill"], "remote", "{v}");
        let alone = generate(prompt, 8, &[]);
        assert_eq!(v["pdhost"]["output_ids"], alone["output_ids"], "{prompt}");
        assert_eq!(v["pdhost"]["logits_xxh3"], alone["logits_xxh3"], "{prompt}: bit-identical in a batch");
    }
    let batches = metric(&s, "pdhost_prefill_batch_calls_count").unwrap();
    let chunks = metric(&s, "pdhost_prefill_batch_calls_sum").unwrap();
    assert_eq!(chunks, 4.0, "one chunk per prompt");
    assert!(batches < chunks, "{batches} batches for {chunks} chunks: none held more than one");
}

/// A producer killed halfway through writing one request's span (request 2, the `faulty` backend's
/// `kill_mid`) costs that request its remote prefill and nothing else: with `fallback` it is prefilled
/// locally, in pieces of 256 tokens (its remote prefill was one span), and still equals `generate`; with
/// `fail` it gets a 500 error object. A stream still live when that answer comes (asserted), a request
/// that was waiting for the producer when it crashed, and the request after (on a restarted producer),
/// are remote and equal `generate`.
#[test]
fn a_producer_killed_mid_span_costs_one_request_its_remote_prefill_and_no_one_else_anything() {
    let stream_prompt = "1, 2, 3, 4, 5, 6, 7, 8,";
    let prompt = format!("{}The three primary colours are", "Red, yellow and blue are colours. ".repeat(40));
    let prompt = prompt.as_str();
    // Long enough (and never ended by EOS) to outlast the crashed request's two prefills.
    let stream_reference = generate(stream_prompt, 900, &["--ignore-eos"]);
    let reference = generate(prompt, 8, &[]);
    let prompt_tokens = reference["prompt_ids"].as_array().unwrap().len() as u64;
    assert!(prompt_tokens > 257, "a prompt of more than one local piece: {prompt_tokens} tokens");
    for policy in ["fallback", "fail"] {
        let config = r#"{"fault": "kill_mid", "on_requests": [2]}"#;
        let s = serve(&["--producer", "faulty", "--backend-config", config, "--on-producer-failure", policy]);
        let chunks = Arc::new(Mutex::new(Vec::<Value>::new()));
        let streamer = {
            let (url, chunks) = (s.url.clone(), Arc::clone(&chunks));
            std::thread::spawn(move || {
                let body = json!({"prompt": stream_prompt, "max_tokens": 900, "temperature": 0, "stream": true,
                                  "ignore_eos": true});
                let r = agent().post(&format!("{url}/v1/completions")).send_json(&body).unwrap();
                for line in BufReader::new(r.into_body().into_reader()).lines() {
                    let line = line.unwrap();
                    match line.strip_prefix("data: ") {
                        Some("[DONE]") => break,
                        Some(data) => chunks.lock().unwrap().push(serde_json::from_str(data).unwrap()),
                        None => {}
                    }
                }
            })
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while chunks.lock().unwrap().len() < 3 {
            assert!(Instant::now() < deadline, "the stream never started: {}", s.log.lock().unwrap());
            std::thread::sleep(Duration::from_millis(20));
        }
        let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}).to_string();
        let crashing = {
            let (url, body) = (s.url.clone(), body.clone());
            std::thread::spawn(move || post_to(&url, "/v1/completions", &body))
        };
        // Once request 2 is at the producer (its batch sent, after the stream's), request 3 waits for it.
        // When request 2's crash stops the producer, request 3 waits out the restart's backoff too, and
        // is prefilled by the new process: not sent to the stopped one, refused, and fallen back.
        let batches = "pdhost_prefill_batch_calls_count";
        await_metric(&s, batches, 2.0, Duration::from_secs(60), "request 2 never reached the producer");
        let (status, waited) = post(&s, "/v1/completions", &body);
        assert_eq!(status, 200, "{waited}");
        assert_eq!(waited["pdhost"]["prefill"], "remote", "{policy}: {waited}");
        assert_eq!(waited["pdhost"]["output_ids"], reference["output_ids"], "{waited}");
        let (status, crashed) = crashing.join().unwrap();
        let live = chunks.lock().unwrap().iter().all(|c| c["pdhost"].is_null());
        assert!(live, "{policy}: the stream ended before the crashed request was answered");
        if policy == "fallback" {
            assert_eq!(status, 200, "{crashed}");
            assert_eq!(crashed["pdhost"]["prefill"], "local", "{crashed}");
            let reason = crashed["pdhost"]["fallback_reason"].as_str().unwrap_or_default();
            assert!(reason.starts_with("producer_exited"), "{crashed}");
            assert_eq!(crashed["pdhost"]["output_ids"], reference["output_ids"], "{crashed}");
            assert_eq!(crashed["pdhost"]["logits_xxh3"], reference["logits_xxh3"], "{crashed}");
            assert_eq!(crashed["pdhost"]["spans"], (prompt_tokens - 1).div_ceil(256), "{crashed}");
        } else {
            assert_eq!(status, 500, "{crashed}");
            assert_eq!(crashed["error"]["code"], "generation_failed", "{crashed}");
            assert!(crashed["error"]["message"].as_str().unwrap().contains("faulty"), "{crashed}");
            // Counted once, by the engine (the handler counted it again, as `generation_failed`).
            assert_eq!(metric(&s, r#"pdhost_requests_total{outcome="failed"}"#), Some(1.0));
            assert_eq!(metric(&s, r#"pdhost_requests_total{outcome="generation_failed"}"#), None);
        }
        // The producer restarts after a 50 ms backoff. A request sent inside it waits for the restart:
        // the backoff is not its failure (it was refused as `backing_off`, with no process asked).
        let (status, after) = post(&s, "/v1/completions", &body);
        assert_eq!(status, 200, "{after}");
        assert_eq!(after["pdhost"]["prefill"], "remote", "{after}");
        assert_eq!(after["pdhost"]["output_ids"], reference["output_ids"], "{after}");
        assert_eq!(after["pdhost"]["spans"], 1, "{after}");
        streamer.join().unwrap();
        let chunks = chunks.lock().unwrap();
        let last = chunks.iter().rev().find(|c| !c["pdhost"].is_null()).expect("a chunk with the pdhost object");
        assert_eq!(last["pdhost"]["prefill"], "remote", "{last}");
        assert_eq!(last["pdhost"]["output_ids"], stream_reference["output_ids"], "{last}");
        assert_eq!(last["pdhost"]["logits_xxh3"], stream_reference["logits_xxh3"], "{last}");
        assert_eq!(metric(&s, "pdhost_producer_starts_total{kind=\"restart\"}"), Some(1.0), "{policy}");
    }
}

/// Two producers of two backends (`--producer rngd,faulty`): while the `faulty` one hangs on request 1
/// (its `hang` mode), request 2 is prefilled by the `rngd` one and answered first; request 1 then falls
/// back to local prefill when its producer's deadline kills it, and still equals `generate`. (The pool
/// hands out the last idle producer first, so request 1 goes to the second backend named.) Request 2 is
/// sent once request 1's batch is in its producer's hands, not merely admitted: admitted, request 1
/// waits `--batch-wait` for others to join it, and on a loaded machine request 2 once did, and hung with
/// it.
#[test]
fn a_second_producer_prefills_while_the_first_hangs() {
    let config = r#"{"fault": "hang", "on_requests": [1]}"#;
    let s = serve(&["--producer", "rngd,faulty", "--backend-config", config, "--producer-timeout", "20"]);
    let prompt = "The three primary colours are";
    let reference = generate(prompt, 4, &[]);
    let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}).to_string();
    let first = {
        let (url, body) = (s.url.clone(), body.clone());
        std::thread::spawn(move || post_to(&url, "/v1/completions", &body))
    };
    let batches = "pdhost_prefill_batch_calls_count";
    await_metric(&s, batches, 1.0, Duration::from_secs(60), "request 1 never went to a producer");
    let (status, second) = post(&s, "/v1/completions", &body);
    assert!(!first.is_finished(), "request 1 answered before request 2: {second}\n{}", s.log.lock().unwrap());
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["pdhost"]["prefill"], "remote", "{second}");
    assert_eq!(second["pdhost"]["producer"], "rngd", "{second}");
    assert_eq!(second["pdhost"]["output_ids"], reference["output_ids"], "{second}");
    let (status, first) = first.join().unwrap();
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["pdhost"]["prefill"], "local", "{first}");
    assert_eq!(first["pdhost"]["producer"], "faulty", "{first}: the producer that was asked");
    assert!(first["pdhost"]["fallback_reason"].as_str().unwrap_or_default().starts_with("timeout"), "{first}");
    assert_eq!(first["pdhost"]["output_ids"], reference["output_ids"], "{first}");
}

/// Two producers, one of which can never start (`faulty` refuses its config): every request goes to the
/// healthy one. The broken one refused at once, so it was always the producer that went idle last, and
/// the pool gave it every request while `rngd` sat idle (three 500s under `fail`).
#[test]
fn a_producer_that_cannot_start_gets_no_request_while_another_can_take_it() {
    let s = serve(&[
        "--producer",
        "rngd,faulty",
        "--backend-config",
        r#"{"fault": "nope"}"#,
        "--on-producer-failure",
        "fail",
    ]);
    let prompt = "The three primary colours are";
    let body = json!({"prompt": prompt, "max_tokens": 3, "temperature": 0}).to_string();
    for i in 0..3 {
        let (status, v) = post(&s, "/v1/completions", &body);
        assert_eq!(status, 200, "request {i}: {v}");
        assert_eq!((v["pdhost"]["prefill"].as_str(), v["pdhost"]["producer"].as_str()), (Some("remote"), Some("rngd")));
    }
    // A one-token prompt has nothing to prefill: no producer is asked or named (it said "rngd,faulty").
    let (status, v) = post(&s, "/v1/completions", &json!({"prompt": [2], "max_tokens": 1}).to_string());
    assert_eq!(status, 200, "{v}");
    assert_eq!((v["pdhost"]["prefill"].as_str(), v["pdhost"]["producer"].as_str()), (Some("local"), Some("local")));
}

/// When not one producer can ever start (here `faulty` refuses its config), the server does not serve
/// (each prefill would fall back, or fail, for ever): it exits 1 before listening, its last line naming
/// the producer's refusal. It served, every request prefilled locally.
#[test]
fn a_server_whose_every_producer_can_never_start_does_not_serve() {
    fetched(MODEL);
    let mut child = Command::new(PDHOST)
        .args(["serve", "--model", MODEL, "--port", "0", "--context", "1024"])
        .args(["--producer", "faulty", "--producers", "2", "--backend-config", r#"{"fault": "nope"}"#])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the server is still up after 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (mut out, mut err) = (String::new(), String::new());
    child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(!out.contains("listening on"), "{out}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: the engine did not start: no producer can start")
            && last.contains("producer faulty")
            && last.contains("--backend-config"),
        "{err}"
    );
}

/// With `--prefix-cache on`, a prompt that shares whole pages with an earlier one prefills only the rest
/// (a span at a nonzero offset, in the producer or locally), and its output and logits stay bit-identical
/// to `generate` alone.
#[test]
fn a_prefix_cache_hit_prefills_only_the_rest_and_equals_generate() {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/prompts/lgpl-650w.txt")).unwrap();
    let shared: String = text.chars().take(600).collect();
    let first = format!("{shared} In short:");
    let second = format!("{shared} To sum up, the license says");
    let reference = generate(&second, 6, &[]);
    for producer in ["rngd", "local"] {
        let s = serve(&["--producer", producer, "--prefix-cache", "on", "--page-size", "16"]);
        let complete = |prompt: &str| {
            let body = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0});
            let (status, v) = post(&s, "/v1/completions", &body.to_string());
            assert_eq!(status, 200, "{producer}: {v}");
            v
        };
        let a = complete(&first);
        assert_eq!(a["pdhost"]["prefix_hit_tokens"], 0, "{producer}: nothing cached yet");
        let b = complete(&second);
        let hit = b["pdhost"]["prefix_hit_tokens"].as_u64().unwrap();
        let prompt_tokens = b["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(hit >= 112 && hit % 16 == 0 && hit < prompt_tokens, "{producer}: hit {hit} of {prompt_tokens}");
        assert_eq!(b["pdhost"]["prefill"], if producer == "local" { "local" } else { "remote" }, "{producer}");
        // Only the rest of the prompt (less its last token, which the host runs) was prefilled.
        let a_tokens = a["usage"]["prompt_tokens"].as_u64().unwrap();
        let per_token = a["pdhost"]["bytes"].as_u64().unwrap() / (a_tokens - 1);
        assert_eq!(b["pdhost"]["bytes"].as_u64().unwrap(), (prompt_tokens - 1 - hit) * per_token, "{producer}");
        assert_eq!(b["pdhost"]["spans"], 1);
        assert_eq!(b["pdhost"]["output_ids"], reference["output_ids"], "{producer}");
        assert_eq!(b["pdhost"]["logits_xxh3"], reference["logits_xxh3"], "{producer}: bit-identical logits");
        assert_eq!(metric(&s, "pdhost_prefix_cache_hit_tokens_total"), Some(hit as f64));
        // Both requests ended: their registered pages are cached, the rest free.
        let cached = metric(&s, "pdhost_kv_pages{group=\"0 (full attention)\",state=\"cached\"}").unwrap();
        let used = metric(&s, "pdhost_kv_pages{group=\"0 (full attention)\",state=\"used\"}").unwrap();
        assert!(cached >= (hit / 16) as f64 && used == 0.0, "cached {cached}, used {used}");
    }
}
