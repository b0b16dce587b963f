//! `pdhost bench soak`: faults under load, as figures.
//!
//! A reference server (`--producer local`, one slot) first answers each distinct prompt alone. Then the
//! soak server starts: 4 slots and 2 producers, a `faulty` one that fails `--fault-rate` of its prefills
//! in a mode chosen at random from all of them (crashes, hangs, lying spans, sandbox violations, memory)
//! beside a real `rngd` one, falling back to local prefill. `--concurrency` clients send `--requests` over HTTP; some disconnect at a random
//! moment, some send malformed or invalid requests, and a producer is killed from outside every
//! `--kill-every` seconds (the first time, one is stopped with SIGSTOP instead: a hang). The server is then
//! drained with SIGTERM.
//!
//! Every accepted request must have exactly one ending: completed (its output equal to the reference),
//! cancelled by its client, or failed with a typed error. A request that ends any other way is lost. The
//! server's own counters are checked against the clients'. Memory, descriptors, threads, children and
//! `/dev/shm` are compared between two moments when both producers are up: after a warm-up and after the
//! load.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;
use model::gguf::Gguf;
use model::tokenizer::Tokenizer;
use pdhost::request::{self, Field, Invalid};
use serde_json::{json, Value};

use super::serve_bench::{count, percentiles, text_ids, Server};
use crate::cli::SoakBenchArgs;
use crate::cmd::outln;

/// Distinct prompts; requests cycle through them.
const PROMPTS: usize = 12;
/// Prompt plus output tokens per sequence in both servers.
const CONTEXT: u64 = 1024;
/// A request may queue behind the others and a producer's timeout.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
/// Restarts per producer per minute: one a second, so that the faulty producer keeps coming back under
/// its faults rather than sitting out the restart cap's window.
const MAX_RESTARTS: &str = "60";
/// A producer that does not answer a prefill within this is killed (the `hang` fault and SIGSTOP). It
/// must stay well above a loaded prefill: on a 2-core Zen 3, with the host decoding 8 sequences beside
/// both producers, a soak prompt's prefill took close to 3 s, the first value of this. At 3 s a third of
/// the prefills timed out, and each timeout restarted a healthy producer, so that the two were never up
/// together for the resource snapshots.
const PRODUCER_TIMEOUT: &str = "10";
/// How long the soak waits for both producers to be up again before a resource snapshot.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(75);
/// Problems described after the report; the counts cover all of them.
const MAX_PROBLEMS: usize = 8;

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform number in `[0, 1)` from `h`.
fn unit(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// What one request of the mix is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// A good request, streamed or not.
    Good { stream: bool },
    /// A streamed request whose client hangs up after this many events (0: before the first token).
    Disconnect { after: u64 },
    /// The `n`-th kind of malformed request.
    Bad(usize),
}

fn kind_of(args: &SoakBenchArgs, i: u64) -> Kind {
    let h = splitmix(args.seed ^ splitmix(i));
    let pick = unit(h);
    let h2 = splitmix(h);
    if pick < args.bad_rate {
        Kind::Bad((h2 % BAD.len() as u64) as usize)
    } else if pick < args.bad_rate + args.disconnect_rate {
        Kind::Disconnect { after: h2 % (args.max_tokens + 1) }
    } else {
        Kind::Good { stream: h2 & 1 == 1 }
    }
}

/// Malformed, oversized and invalid requests, and what each is.
const BAD: &[(&str, &str)] = &[
    ("malformed JSON", r#"{"prompt": "#),
    ("max_tokens of the wrong type", r#"{"prompt": "Hello", "max_tokens": "many"}"#),
    ("a token id outside the vocabulary", r#"{"prompt": [1, 999999999], "max_tokens": 4}"#),
    ("max_tokens past the context", r#"{"prompt": "Hello", "max_tokens": 1000000}"#),
    ("n = 0", r#"{"prompt": "Hello", "max_tokens": 4, "n": 0}"#),
    ("an empty prompt", r#"{"prompt": "", "max_tokens": 4}"#),
    ("an unknown model", r#"{"model": "no-such-model", "prompt": "Hello", "max_tokens": 4}"#),
    ("max_tokens = 0", r#"{"prompt": "Hello", "max_tokens": 0}"#),
    ("a 5 MiB body", ""),
];

/// How one request ended, as its client saw it.
#[derive(Debug)]
enum Ending {
    /// The whole response arrived; equal to the reference or not.
    Completed { equal: bool, latency: Duration, prefill: String },
    /// The client hung up.
    Cancelled,
    /// Accepted, then ended by the server with an error object (a 500, or an error event): its type.
    Failed(String),
    /// Not accepted: a status other than 200 and 500 (503 when the queue is full) with an error object.
    Refused(String),
    /// A bad request answered with a 4xx and an error object.
    Rejected,
    /// A bad request answered any other way.
    BadAnswered(String),
    /// None of the above: the connection broke, or the answer was not the protocol.
    Lost(String),
}

/// The server's process, its resources at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Resources {
    rss_mib: u64,
    fds: usize,
    threads: usize,
    children: Vec<i32>,
    shm: usize,
}

impl Resources {
    fn of(pid: u32) -> Resources {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let rss_kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0);
        let entries = |dir: &str| std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
        // Clients' connections come and go with their keep-alive: every other descriptor counts.
        let connections = tcp_connections(pid);
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| {
                d.flatten()
                    .filter(|e| {
                        let target = std::fs::read_link(e.path()).unwrap_or_default();
                        let inode = target
                            .to_string_lossy()
                            .strip_prefix("socket:[")
                            .and_then(|t| t.strip_suffix(']'))
                            .map(str::to_string);
                        !inode.is_some_and(|i| connections.contains(&i))
                    })
                    .count()
            })
            .unwrap_or(0);
        Resources {
            rss_mib: rss_kib >> 10,
            fds,
            threads: entries(&format!("/proc/{pid}/task")),
            children: children_of(pid as i32),
            shm: entries("/dev/shm"),
        }
    }

    fn json(&self) -> Value {
        json!({"rss_mib": self.rss_mib, "fds": self.fds, "threads": self.threads,
               "children": self.children.len(), "dev_shm_entries": self.shm})
    }
}

/// The socket inodes of `pid`'s TCP connections (listening sockets excluded).
fn tcp_connections(pid: u32) -> std::collections::BTreeSet<String> {
    const LISTEN: &str = "0A";
    ["tcp", "tcp6"]
        .iter()
        .flat_map(|t| {
            std::fs::read_to_string(format!("/proc/{pid}/net/{t}"))
                .unwrap_or_default()
                .lines()
                .skip(1)
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.get(3) != Some(&LISTEN)).then(|| fields.get(9).map(|i| i.to_string())).flatten()
        })
        .collect()
}

/// The live (not zombie) processes whose parent is `pid` (none when `/proc` cannot be read).
fn children_of(pid: i32) -> Vec<i32> {
    let children = pdhost_producer::procfs::children_of(pid).unwrap_or_default();
    children.into_iter().filter(|c| !c.zombie).map(|c| c.pid).collect()
}

/// Sends request `i` of the mix and says how it ended.
fn send(agent: &ureq::Agent, url: &str, prompt: &[u32], reference: &Value, args: &SoakBenchArgs, i: u64) -> Ending {
    let t = Instant::now();
    let (stream, hang_up) = match kind_of(args, i) {
        Kind::Bad(n) => return send_bad(agent, url, n),
        Kind::Good { stream } => (stream, None),
        Kind::Disconnect { after } => (true, Some(after)),
    };
    let body = json!({"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "stream": stream});
    let mut r = match agent.post(&format!("{url}/v1/completions")).send_json(&body) {
        Ok(r) => r,
        Err(e) => return Ending::Lost(format!("request {i}: {e}")),
    };
    let status = r.status().as_u16();
    if status != 200 {
        let text = r.body_mut().read_to_string().unwrap_or_default();
        return match serde_json::from_str::<Value>(&text).ok().filter(|v| v["error"]["message"].is_string()) {
            Some(v) if status == 500 => Ending::Failed(v["error"]["type"].as_str().unwrap_or("?").to_string()),
            Some(v) => Ending::Refused(format!("{status} {}", v["error"]["type"].as_str().unwrap_or("?"))),
            None => Ending::Lost(format!("request {i}: status {status} without an error object")),
        };
    }
    let last = if stream {
        let mut events = 0;
        let mut last = None;
        let mut done = false;
        if hang_up == Some(0) {
            return Ending::Cancelled;
        }
        for line in BufReader::new(r.into_body().into_reader()).lines() {
            let Ok(line) = line else {
                return Ending::Lost(format!("request {i}: the stream broke after {events} event(s)"));
            };
            let Some(data) = line.strip_prefix("data:").map(str::trim_start) else { continue };
            if data == "[DONE]" {
                done = true;
                break;
            }
            let Ok(mut v) = serde_json::from_str::<Value>(data) else {
                return Ending::Lost(format!("request {i}: an event that is not JSON"));
            };
            if v["error"]["message"].is_string() {
                return Ending::Failed(v["error"]["type"].as_str().unwrap_or("?").to_string());
            }
            if !v["pdhost"].is_null() {
                last = Some(v["pdhost"].take());
            }
            events += 1;
            if hang_up == Some(events) {
                // Dropping the reader closes the connection mid-stream.
                return Ending::Cancelled;
            }
        }
        match (done, last) {
            (true, Some(last)) => last,
            _ => return Ending::Lost(format!("request {i}: the stream ended without [DONE] and a pdhost object")),
        }
    } else {
        match r.body_mut().read_json::<Value>() {
            Ok(mut v) => v["pdhost"].take(),
            Err(e) => return Ending::Lost(format!("request {i}: reading the response: {e}")),
        }
    };
    if !last["output_ids"].is_array() {
        return Ending::Lost(format!("request {i}: a response without pdhost.output_ids"));
    }
    Ending::Completed {
        equal: last["output_ids"] == *reference,
        latency: t.elapsed(),
        prefill: last["prefill"].as_str().unwrap_or("?").to_string(),
    }
}

fn send_bad(agent: &ureq::Agent, url: &str, n: usize) -> Ending {
    let (what, body) = BAD[n];
    if body.is_empty() {
        return send_oversized(url, what);
    }
    let r = agent.post(&format!("{url}/v1/completions")).header("content-type", "application/json").send(body);
    let mut r = match r {
        Ok(r) => r,
        Err(e) => return Ending::Lost(format!("{what}: {e}")),
    };
    let status = r.status().as_u16();
    let mut text = String::new();
    let _ = r.body_mut().as_reader().read_to_string(&mut text);
    let object = serde_json::from_str::<Value>(&text).ok().is_some_and(|v| v["error"]["message"].is_string());
    if (400..500).contains(&status) && object {
        Ending::Rejected
    } else {
        Ending::BadAnswered(format!("{what}: status {status}, {}", request::shorten(&text)))
    }
}

/// A request announcing a 5 MiB body: the server must refuse it with 413 from its `Content-Length` alone.
/// The headers are written by hand and the body never follows, so the client does not race the server's
/// early answer while still writing.
fn send_oversized(url: &str, what: &str) -> Ending {
    use std::io::Write as _;
    let address = url.trim_start_matches("http://");
    let answer = std::net::TcpStream::connect(address).and_then(|mut tcp| {
        tcp.set_read_timeout(Some(REQUEST_TIMEOUT))?;
        write!(
            tcp,
            "POST /v1/completions HTTP/1.1\r\nhost: {address}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n",
            5 << 20
        )?;
        let mut line = String::new();
        BufReader::new(tcp).read_line(&mut line)?;
        Ok(line)
    });
    match answer {
        Ok(line) if line.starts_with("HTTP/1.1 413") => Ending::Rejected,
        Ok(line) => Ending::BadAnswered(format!("{what}: {}", line.trim())),
        Err(e) => Ending::Lost(format!("{what}: {e}")),
    }
}

/// Samples of one metric family from the text format, by their label set.
fn samples(text: &str, family: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter_map(|l| l.strip_prefix(family))
        .filter_map(|rest| {
            let (labels, value) = rest.rsplit_once(' ')?;
            Some((labels.trim_matches(|c| c == '{' || c == '}').to_string(), value.parse().ok()?))
        })
        .collect()
}

fn rate(field: Field, value: f64) -> Result<f64, Invalid> {
    if value.is_finite() && (0.0..=1.0).contains(&value) {
        Ok(value)
    } else {
        Err(Invalid::new(field, "a share from 0 to 1", value))
    }
}

/// Tallies of every request's ending.
#[derive(Debug, Default)]
struct Tally {
    completed: u64,
    unequal: u64,
    cancelled: u64,
    failed: BTreeMap<String, u64>,
    refused: BTreeMap<String, u64>,
    rejected: u64,
    bad_answered: u64,
    lost: u64,
    prefill: BTreeMap<String, u64>,
    latency_ms: Vec<f64>,
    problems: Vec<String>,
}

impl Tally {
    fn add(&mut self, ending: Ending) {
        match ending {
            Ending::Completed { equal, latency, prefill } => {
                self.completed += 1;
                if !equal {
                    self.unequal += 1;
                    self.problems.push("a completed response differed from its reference".into());
                }
                self.latency_ms.push(latency.as_secs_f64() * 1e3);
                *self.prefill.entry(prefill).or_default() += 1;
            }
            Ending::Cancelled => self.cancelled += 1,
            Ending::Failed(kind) => *self.failed.entry(kind).or_default() += 1,
            Ending::Refused(kind) => *self.refused.entry(kind).or_default() += 1,
            Ending::Rejected => self.rejected += 1,
            Ending::BadAnswered(why) => {
                self.bad_answered += 1;
                self.problems.push(format!("bad request answered wrongly: {why}"));
            }
            Ending::Lost(why) => {
                self.lost += 1;
                self.problems.push(format!("lost: {why}"));
            }
        }
    }

    /// Requests the server accepted: every good or disconnecting one it did not refuse.
    fn accepted(&self) -> u64 {
        self.completed + self.cancelled + self.failed.values().sum::<u64>() + self.lost
    }
}

pub fn run(args: &SoakBenchArgs) -> anyhow::Result<ExitCode> {
    let requests = count(Field::Requests, args.requests, 1, 100_000, "")?;
    let concurrency = count(Field::Concurrency, args.concurrency, 1, 64, "")?;
    rate(Field::FaultRate, args.fault_rate)?;
    rate(Field::DisconnectRate, args.disconnect_rate)?;
    rate(Field::BadRate, args.bad_rate)?;
    if args.disconnect_rate + args.bad_rate > 1.0 {
        return Err(Invalid::new(
            Field::DisconnectRate,
            // Rounded: 1 - 0.7 is 0.30000000000000004 in binary floating point.
            format!("at most {} (1 less --bad-rate)", ((1.0 - args.bad_rate) * 1e9).round() / 1e9),
            args.disconnect_rate,
        )
        .into());
    }
    if !(args.kill_every.is_finite() && (args.kill_every == 0.0 || (0.5..=3600.0).contains(&args.kill_every))) {
        return Err(Invalid::new(Field::KillEvery, "0 (none) or 0.5 to 3600 seconds", args.kill_every).into());
    }
    let max_tokens = count(Field::MaxTokens, args.max_tokens, 1, 256, "")?;
    let threads = request::check_threads(args.threads)?;
    let path = super::fetched(&args.model, args.json)?;
    let gguf = Gguf::open(&path)?;
    let tok = Tokenizer::from_gguf(&gguf)?;
    let ids = text_ids(&tok, 2048);
    drop(gguf);
    // Twelve prompts of 9 to 196 tokens from different places in the text.
    let prompts: Vec<Vec<u32>> = (0..PROMPTS).map(|p| ids[p * 97..p * 97 + 9 + p * 17].to_vec()).collect();
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(REQUEST_TIMEOUT))
        .max_idle_connections_per_host(concurrency as usize)
        .build()
        .into();
    let exe = std::env::current_exe().context("locating the pdhost executable")?;
    let serve = |extra: &[&str]| {
        let mut cmd = Command::new(&exe);
        cmd.args(["serve", "--model", &args.model, "--host", "127.0.0.1", "--port", "0"])
            .args(["--context", &CONTEXT.to_string()])
            .args(extra);
        if let Some(t) = args.threads {
            cmd.args(["--threads", &t.to_string()]);
        }
        Server::start(cmd)
    };
    let bar = super::progress(PROMPTS as u64 + requests, args.json);

    // References: each prompt alone, prefilled in the host.
    bar.set_message("references (--producer local)");
    let reference_server = serve(&["--producer", "local", "--slots", "1"])?;
    let mut references = Vec::new();
    for prompt in &prompts {
        let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
        let mut r = agent
            .post(&format!("{}/v1/completions", reference_server.url))
            .send_json(&body)
            .context("a reference request")?;
        let v: Value = r.body_mut().read_json().context("a reference response")?;
        anyhow::ensure!(v["pdhost"]["output_ids"].is_array(), "a reference response without output_ids: {v}");
        references.push(v["pdhost"]["output_ids"].clone());
        bar.inc(1);
    }
    reference_server.stop();

    // The soak server.
    bar.set_message("starting the soak server");
    let backend_config =
        json!({"fault": "random", "seed": args.seed, "rate": args.fault_rate, "delay_ms": 500}).to_string();
    let server = serve(&[
        "--producer",
        "faulty,rngd",
        "--max-restarts",
        MAX_RESTARTS,
        "--slots",
        "4",
        "--queue",
        "256",
        "--backend-config",
        &backend_config,
        "--producer-timeout",
        PRODUCER_TIMEOUT,
        "--producer-memory",
        "2048",
    ])?;
    let url = server.url.clone();
    let pid = server.pid();
    let next = AtomicU64::new(0);
    let tally = Mutex::new(Tally::default());
    // Sends requests from the shared counter until `limit`, or until both producers are up.
    let work = |limit: u64, until_settled: bool| {
        std::thread::scope(|s| {
            for _ in 0..concurrency {
                s.spawn(|| loop {
                    if until_settled && children_of(pid as i32).len() >= 2 {
                        return;
                    }
                    let Ok(i) =
                        next.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < limit).then_some(n + 1))
                    else {
                        return;
                    };
                    let p = (i % PROMPTS as u64) as usize;
                    let ending = send(&agent, &url, &prompts[p], &references[p], args, i);
                    tally.lock().unwrap_or_else(|e| e.into_inner()).add(ending);
                    // The warm-up and the settling send requests past `--requests`: the bar grows.
                    if bar.length().is_some_and(|len| bar.position() >= len) {
                        bar.inc_length(1);
                    }
                    bar.inc(1);
                });
            }
        })
    };
    // Both producers up: more requests of the mix (past `--requests` if need be) until a restarted
    // producer is back, a restart cap's window included.
    let settle = |what: &str| {
        bar.set_message(format!("waiting for both producers ({what})"));
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        while children_of(pid as i32).len() < 2 && Instant::now() < deadline {
            work(next.load(Ordering::Relaxed) + concurrency, true);
            std::thread::sleep(Duration::from_millis(500));
        }
        // Past the keep-alive of the server's blocking threads (tokenizing text prompts), so that the
        // count of threads is the server's own.
        std::thread::sleep(pdhost::server::BLOCKING_KEEP_ALIVE + Duration::from_secs(1));
    };

    // Warm-up: the first `concurrency` requests, then both producers up.
    work(concurrency.min(requests), false);
    settle("before");
    let before = Resources::of(pid);

    // The load, with a producer killed from outside every `kill_every` seconds.
    bar.set_message("soak");
    let done = AtomicBool::new(false);
    let (kills, stops) = (AtomicU64::new(0), AtomicU64::new(0));
    let t = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            if args.kill_every == 0.0 {
                return;
            }
            let mut round = 0u64;
            'outer: loop {
                let wake = Instant::now() + Duration::from_secs_f64(args.kill_every);
                while Instant::now() < wake {
                    if done.load(Ordering::Relaxed) {
                        break 'outer;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                let children = children_of(pid as i32);
                let Some(&victim) = children.get((splitmix(args.seed ^ round) % children.len().max(1) as u64) as usize)
                else {
                    continue;
                };
                let Some(victim) = rustix::process::Pid::from_raw(victim) else { continue };
                let signal = if round == 0 { rustix::process::Signal::STOP } else { rustix::process::Signal::KILL };
                if rustix::process::kill_process(victim, signal).is_ok() {
                    if round == 0 { &stops } else { &kills }.fetch_add(1, Ordering::Relaxed);
                }
                round += 1;
            }
        });
        // `--requests` of them, past those of the warm-up and of the settling.
        work(next.load(Ordering::Relaxed) + requests, false);
        done.store(true, Ordering::Relaxed);
    });
    let wall = t.elapsed();
    settle("after");
    let after = Resources::of(pid);
    let metrics = agent
        .get(&format!("{url}/metrics"))
        .call()
        .ok()
        .and_then(|mut r| r.body_mut().read_to_string().ok())
        .unwrap_or_default();

    // The drain.
    bar.set_message("SIGTERM");
    let producers = after.children.clone();
    let t_drain = Instant::now();
    let drained = server.drain();
    let drain_s = t_drain.elapsed().as_secs_f64();
    let left: Vec<i32> =
        producers.iter().copied().filter(|p| std::path::Path::new(&format!("/proc/{p}")).exists()).collect();
    let shm_after_drain = std::fs::read_dir("/dev/shm").map(|d| d.count()).unwrap_or(0);
    bar.finish_and_clear();

    let tally = tally.into_inner().unwrap_or_else(|e| e.into_inner());
    let server_requests = samples(&metrics, "pdhost_requests_total");
    let outcome = |name: &str| server_requests.get(&format!("outcome=\"{name}\"")).copied().unwrap_or(0.0) as u64;
    let server_ended = outcome("ok") + outcome("cancelled") + outcome("failed");
    let restarts = samples(&metrics, "pdhost_producer_starts_total").get("kind=\"restart\"").copied().unwrap_or(0.0);
    let rejected_spans = samples(&metrics, "pdhost_spans_rejected_total");
    // Requests the clients saw accepted that the server did not end, and the other way round.
    let server_lost = tally.accepted().abs_diff(server_ended);
    let drain_ok = matches!(&drained, Ok(status) if status.success());
    let flat = before.fds == after.fds
        && before.threads == after.threads
        && before.children.len() == after.children.len()
        && before.shm == after.shm
        && after.rss_mib <= before.rss_mib + before.rss_mib / 4 + 16;
    let clean = drain_ok && left.is_empty() && shm_after_drain == before.shm;
    // And something was served: a server that refused everything loses nothing.
    let ok = tally.completed > 0
        && tally.lost == 0
        && server_lost == 0
        && tally.unequal == 0
        && tally.bad_answered == 0
        && flat
        && clean;
    let (p50, p99) = percentiles(&tally.latency_ms);
    let drain_text = match &drained {
        Ok(status) => format!("{status}"),
        Err(e) => e.clone(),
    };

    if args.json {
        let v = json!({
            "bench": "soak", "model": args.model, "requests": requests, "concurrency": concurrency, "threads": threads,
            "fault_rate": args.fault_rate, "disconnect_rate": args.disconnect_rate, "bad_rate": args.bad_rate,
            "kill_every_s": args.kill_every, "max_tokens": max_tokens, "seed": args.seed, "wall_s": wall.as_secs_f64(),
            "accepted": tally.accepted(), "completed": tally.completed, "unequal": tally.unequal,
            "sent": next.load(Ordering::Relaxed), "cancelled": tally.cancelled, "failed": tally.failed,
            "refused": tally.refused, "lost": tally.lost, "server_lost": server_lost,
            "bad": {"rejected": tally.rejected, "answered_otherwise": tally.bad_answered},
            "prefill": tally.prefill,
            "server": {"requests": server_requests, "producer_restarts": restarts, "spans_rejected": rejected_spans},
            "external": {"sigkill": kills.load(Ordering::Relaxed), "sigstop": stops.load(Ordering::Relaxed)},
            "latency_ms": {"p50": p50, "p99": p99},
            "resources": {"before": before.json(), "after": after.json(), "flat": flat},
            "drain": {"exit": drain_text, "ok": drain_ok, "seconds": drain_s, "producers_left": left.len(),
                      "dev_shm_entries": shm_after_drain, "clean": clean},
            "problems": tally.problems.iter().take(MAX_PROBLEMS).collect::<Vec<_>>(),
            "ok": ok,
        });
        outln!("{v}")?;
        return Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE });
    }
    let join = |m: &BTreeMap<String, u64>| {
        if m.is_empty() {
            "none".to_string()
        } else {
            m.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
        }
    };
    let killing = if args.kill_every == 0.0 {
        "no producer killed".to_string()
    } else {
        format!("a producer killed every {} s", args.kill_every)
    };
    outln!(
        "soak: {}, {} requests ({requests} asked, the rest to warm up and to bring both producers back) at \
         concurrency {concurrency}, {:.1} s; a faulty producer failing {} of its prefills beside an rngd one, \
         disconnects {}, bad requests {}, {killing}",
        args.model,
        next.load(Ordering::Relaxed),
        wall.as_secs_f64(),
        args.fault_rate,
        args.disconnect_rate,
        args.bad_rate,
    )?;
    outln!(
        "accepted {}: completed {} ({} equal to the reference, {} not), cancelled by the client {}, failed \
         {} ({}), lost {}",
        tally.accepted(),
        tally.completed,
        tally.completed - tally.unequal,
        tally.unequal,
        tally.cancelled,
        tally.failed.values().sum::<u64>(),
        join(&tally.failed),
        tally.lost
    )?;
    outln!("refused (not accepted): {}", join(&tally.refused))?;
    outln!(
        "the server ended {server_ended} (ok {}, cancelled {}, failed {}): {server_lost} differ from the clients",
        outcome("ok"),
        outcome("cancelled"),
        outcome("failed")
    )?;
    outln!(
        "bad requests: {} rejected with a 4xx error object, {} answered otherwise",
        tally.rejected,
        tally.bad_answered
    )?;
    outln!(
        "prefills of completed requests: {}; producer restarts {restarts}; external SIGKILL {}, SIGSTOP {}",
        join(&tally.prefill),
        kills.load(Ordering::Relaxed),
        stops.load(Ordering::Relaxed)
    )?;
    let spans: Vec<String> =
        rejected_spans.iter().map(|(k, v)| format!("{} {v}", k.trim_start_matches("kind="))).collect();
    outln!("spans and attempts rejected: {}", if spans.is_empty() { "none".into() } else { spans.join(", ") })?;
    let fmt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0} ms"));
    outln!("latency of completed requests: p50 {}, p99 {}", fmt(p50), fmt(p99))?;
    outln!("{:<10} {:>8} {:>6} {:>8} {:>9} {:>9}", "", "RSS MiB", "fds", "threads", "children", "/dev/shm")?;
    for (name, r) in [("before", &before), ("after", &after)] {
        outln!("{name:<10} {:>8} {:>6} {:>8} {:>9} {:>9}", r.rss_mib, r.fds, r.threads, r.children.len(), r.shm)?;
    }
    outln!("resources {}", if flat { "flat" } else { "NOT flat" })?;
    outln!(
        "drain: SIGTERM -> {drain_text} in {drain_s:.1} s; producers left {}, /dev/shm entries {shm_after_drain}",
        left.len()
    )?;
    for p in tally.problems.iter().take(MAX_PROBLEMS) {
        outln!("  {p}")?;
    }
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
