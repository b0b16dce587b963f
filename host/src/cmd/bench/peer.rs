//! llama.cpp's `llama-server` beside `pdhost serve` (`pdhost bench serve --peer`): the same cells, the
//! same GGUF, the same threads, with `-np` as many slots as the widest batch and `-c` the context per slot
//! times the slots (llama-server splits its context between slots).
//!
//! It is built once, into `$PDHOST_HOME/llama-server-noamx/`, from the llama.cpp sources that the
//! llama-cpp-python source package vendors (`vendor/llama.cpp/tools/server`), with cmake from the Python
//! package registry in its own virtual environment: both come through pip, like the models.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{json, Value};

/// The llama-cpp-python source package whose vendored llama.cpp is built.
const LLAMA_CPP_PYTHON: &str = "0.3.36";
const START_TIMEOUT: Duration = Duration::from_secs(300);

/// `$PDHOST_HOME/llama-server-noamx/llama-server`, built first if it is not there.
pub fn llama_server(quiet: bool) -> anyhow::Result<PathBuf> {
    // Not `llama-server`, where earlier versions built a native llama.cpp that uses AMX.
    let dir = model::registry::home().join("llama-server-noamx");
    let bin = dir.join("llama-server");
    if bin.is_file() {
        return Ok(bin);
    }
    let bar = super::progress(1, quiet);
    bar.enable_steady_tick(Duration::from_millis(200));
    let scratch = dir.join(format!(".build-{}", std::process::id()));
    let built = (|| {
        std::fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;
        bar.set_message("llama-server: cmake from the Python package registry (once)");
        let cmake = cmake()?;
        bar.set_message(format!("llama-server: the llama-cpp-python {LLAMA_CPP_PYTHON} source package (once)"));
        run(Command::new("python3")
            .args(["-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", "llama-cpp-python", "-d"])
            .arg(&scratch)
            .arg(format!("llama-cpp-python=={LLAMA_CPP_PYTHON}")))?;
        let sdist = scratch.join(format!("llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"));
        run(Command::new("tar").arg("xzf").arg(&sdist).arg("-C").arg(&scratch))?;
        let src = scratch.join(format!("llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp"));
        let build = scratch.join("build");
        bar.set_message("llama-server: building llama.cpp's tools/server (several minutes, once)");
        run(Command::new(&cmake)
            .arg("-S")
            .arg(&src)
            .arg("-B")
            .arg(&build)
            .args(["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"])
            .args(["-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"])
            .args(super::llama_cpp_cmake_options()))?;
        let jobs = model::kernels::available_cores().to_string();
        run(Command::new(&cmake).arg("--build").arg(&build).args(["--target", "llama-server", "-j", &jobs]))?;
        std::fs::rename(build.join("bin/llama-server"), &bin).context("installing llama-server")?;
        anyhow::Ok(())
    })();
    bar.finish_and_clear();
    let _ = std::fs::remove_dir_all(&scratch);
    built?;
    Ok(bin)
}

/// cmake in `$PDHOST_HOME/venvs/cmake`, installed first if it is not there.
fn cmake() -> anyhow::Result<PathBuf> {
    let venv = model::registry::home().join("venvs/cmake");
    let bin = venv.join("bin/cmake");
    if !bin.is_file() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
        run(Command::new(venv.join("bin/python")).args(["-m", "pip", "install", "--quiet", "cmake"]))?;
    }
    Ok(bin)
}

/// Runs a set-up step ([`crate::cmd::set_up`]).
fn run(cmd: &mut Command) -> anyhow::Result<()> {
    crate::cmd::set_up(cmd).map(drop)
}

/// A running `llama-server`, killed when dropped.
pub struct Peer {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
}

impl Peer {
    /// Starts `bin` on `gguf` with `slots` slots of `context` tokens each and `threads` threads, and
    /// waits until `/health` says it is ready.
    pub fn start(bin: &Path, gguf: &Path, slots: u64, context: u64, threads: usize) -> anyhow::Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let mut cmd = Command::new(bin);
        super::end_with_bench(&mut cmd, libc::SIGKILL);
        let child = cmd
            .arg("-m")
            .arg(gguf)
            .args(["--host", "127.0.0.1", "--port", &port.to_string(), "-np", &slots.to_string()])
            .args(["-c", &(context * slots).to_string(), "-t", &threads.to_string(), "-tb", &threads.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut peer = Peer { child, url: format!("http://127.0.0.1:{port}") };
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .into();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(Some(status)) = peer.child.try_wait() {
                anyhow::bail!("llama-server exited before it was ready ({status})");
            }
            if agent.get(&format!("{}/health", peer.url)).call().is_ok_and(|r| r.status().as_u16() == 200) {
                return Ok(peer);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "llama-server was not ready after {} s",
                START_TIMEOUT.as_secs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What one request to the peer gave.
#[derive(Debug, Default)]
pub struct PeerResponse {
    pub text: String,
    /// Output tokens: `usage.completion_tokens` (streamed: of the last event; without one, the chunks
    /// with text).
    pub tokens: u64,
    /// Streamed: the client's time to the first chunk with text; whole: the server's `timings.prompt_ms`.
    pub ttft_ms: Option<f64>,
}

/// One greedy completion of token ids at the peer's OpenAI endpoint. `cache_prompt`: whether it may
/// reuse a slot's cached prompt, as pdhost's `--prefix-cache` says of pdhost (llama-server's default is
/// to reuse it; pdhost's is off).
pub fn send(
    agent: &ureq::Agent,
    url: &str,
    prompt: &[u32],
    (max_tokens, stream, cache_prompt): (u64, bool, bool),
) -> Result<PeerResponse, String> {
    // Streamed, the usage comes in the last event: a token whose chunk carries no text still counts.
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                      "stream_options": {"include_usage": true}, "cache_prompt": cache_prompt});
    let t = Instant::now();
    let mut r = agent.post(&format!("{url}/v1/completions")).send_json(&body).map_err(|e| e.to_string())?;
    let status = r.status().as_u16();
    if status != 200 {
        let text = r.body_mut().read_to_string().unwrap_or_default();
        return Err(format!("status {status}: {}", pdhost::request::shorten(&text)));
    }
    let mut out = PeerResponse::default();
    if stream {
        let mut usage = None;
        for line in BufReader::new(r.into_body().into_reader()).lines() {
            let line = line.map_err(|e| format!("reading the stream: {e}"))?;
            let Some(data) = line.strip_prefix("data:").map(str::trim_start) else { continue };
            if data == "[DONE]" {
                break;
            }
            let v: Value = serde_json::from_str(data).map_err(|e| format!("an event that is not JSON ({e})"))?;
            if let Some(text) = v["choices"][0]["text"].as_str().filter(|t| !t.is_empty()) {
                out.ttft_ms.get_or_insert(t.elapsed().as_secs_f64() * 1e3);
                out.text.push_str(text);
                out.tokens += 1;
            }
            if let Some(used) = v["usage"]["completion_tokens"].as_u64() {
                usage = Some(used);
            }
        }
        // The chunks with text, where a peer sends no usage.
        out.tokens = usage.unwrap_or(out.tokens);
    } else {
        let v: Value = r.body_mut().read_json().map_err(|e| format!("reading the response: {e}"))?;
        out.text = v["choices"][0]["text"].as_str().unwrap_or_default().to_string();
        out.tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
        out.ttft_ms = v["timings"]["prompt_ms"].as_f64();
    }
    Ok(out)
}

/// One cell of the matrix, sent to the peer.
#[derive(Debug, Default)]
pub struct PeerCell {
    pub input: u64,
    pub output: u64,
    pub concurrency: u64,
    pub stream: bool,
    pub requests: u64,
    pub errors: u64,
    /// Responses whose text equals pdhost's reference text for the prompt.
    pub same_text: u64,
    pub tokens: u64,
    pub wall: Duration,
    pub ttft_ms: Vec<f64>,
    pub problems: Vec<String>,
}

impl PeerCell {
    /// Sends `repeats` batches of `concurrency` requests, as the matrix does.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        agent: &ureq::Agent,
        url: &str,
        prompt: &[u32],
        (input, output, concurrency, stream): (u64, u64, u64, bool),
        repeats: u64,
        reference_text: &str,
        cache_prompt: bool,
    ) -> Self {
        let mut cell = PeerCell { input, output, concurrency, stream, ..PeerCell::default() };
        for _ in 0..repeats {
            let t = Instant::now();
            let results: Vec<Result<PeerResponse, String>> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..concurrency)
                    .map(|_| s.spawn(|| send(agent, url, prompt, (output, stream, cache_prompt))))
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("panicked".into()))).collect()
            });
            cell.wall += t.elapsed();
            for r in results {
                cell.requests += 1;
                match r {
                    Ok(r) => {
                        cell.tokens += r.tokens;
                        cell.ttft_ms.extend(r.ttft_ms);
                        cell.same_text += u64::from(r.text == reference_text);
                    }
                    Err(e) => {
                        cell.errors += 1;
                        cell.problems.push(format!("llama-server, {input} in, {output} out, x{concurrency}: {e}"));
                    }
                }
            }
        }
        cell
    }

    /// All output tokens / the batches' wall time.
    pub fn rate_aggregate(&self) -> Option<f64> {
        (self.tokens > 0).then(|| self.tokens as f64 / self.wall.as_secs_f64().max(1e-9))
    }

    pub fn json(&self) -> Value {
        let (p50, p99) = super::serve_bench::percentiles(&self.ttft_ms);
        json!({"input_tokens": self.input, "output_tokens": self.output, "concurrency": self.concurrency,
               "stream": self.stream, "requests": self.requests, "errors": self.errors,
               "same_text_as_pdhost": self.same_text, "tok_s_aggregate": self.rate_aggregate(),
               "ttft_ms": {"p50": p50, "p99": p99}, "output_tokens_received": self.tokens,
               "wall_s": self.wall.as_secs_f64()})
    }
}
