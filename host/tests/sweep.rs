//! The hostile-input sweep: every case of issue 10's list, and a few hundred more, run against the `pdhost`
//! binary as a careless or hostile user would run it. Each row asserts the exit status (never outside 0, 1
//! and 2), that a refusal is exactly one line naming the flag and the bound, and, for the whole sweep,
//! that nothing hangs (a watchdog kills a case after [`DEADLINE`]), nothing panics, and nothing is left
//! behind (producer processes, fetch scratch directories).
//!
//! Every case runs under an 8 GiB address-space limit, so a regression that allocates without bound fails
//! its row instead of taking the machine down.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

const PDHOST: &str = env!("CARGO_BIN_EXE_pdhost");

/// The longest any case may run: the slowest rows load both real models.
const DEADLINE: Duration = Duration::from_secs(180);

/// The address-space limit every case runs under.
const ADDRESS_SPACE: u64 = 8 << 30;

/// What a case gets on standard input and output.
#[derive(Clone, Debug, Default)]
enum Io {
    /// stdin empty, stdout captured.
    #[default]
    Plain,
    /// These bytes on stdin.
    Stdin(Vec<u8>),
    /// stdout is a pipe whose reader is gone before the process writes (`pdhost ... | head -0`).
    ClosedStdout,
}

/// One row: a command line and what it must do.
#[derive(Clone, Debug)]
struct Case {
    name: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    io: Io,
    /// The exit status.
    code: i32,
    /// Fragments stderr must hold (for a refusal: its single line).
    says: Vec<String>,
    /// Fragments that must not appear on stderr or stdout.
    never: Vec<String>,
    /// Fragments stdout must hold.
    prints: Vec<String>,
    /// The refusal's one line is on stdout (`inspect-span`'s verdicts), not stderr.
    verdict_on_stdout: bool,
    /// Exit 2 with clap's help rather than a one-line refusal.
    help: bool,
}

fn case(name: &str, args: &[&str]) -> Case {
    Case {
        name: name.to_string(),
        args: args.iter().map(|s| s.to_string()).collect(),
        env: Vec::new(),
        io: Io::Plain,
        code: 0,
        says: Vec::new(),
        never: Vec::new(),
        prints: Vec::new(),
        verdict_on_stdout: false,
        help: false,
    }
}

impl Case {
    /// Refused with `code` in one line holding every fragment.
    fn refused(mut self, code: i32, says: &[&str]) -> Self {
        self.code = code;
        self.says = says.iter().map(|s| s.to_string()).collect();
        self
    }
    fn never(mut self, text: &[&str]) -> Self {
        self.never.extend(text.iter().map(|s| s.to_string()));
        self
    }
    fn prints(mut self, text: &[&str]) -> Self {
        self.prints.extend(text.iter().map(|s| s.to_string()));
        self
    }
    /// Exit 2 with the help on stderr (a command without its subcommand).
    fn help(mut self) -> Self {
        self.code = 2;
        self.help = true;
        self.says = vec!["Usage:".into()];
        self
    }
    fn verdict_on_stdout(mut self) -> Self {
        self.verdict_on_stdout = true;
        self
    }
    fn io(mut self, io: Io) -> Self {
        self.io = io;
        self
    }
    fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }
    fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }
}

/// What one run did.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

fn run(c: &Case) -> Ran {
    let mut cmd = Command::new(PDHOST);
    cmd.args(&c.args).stderr(Stdio::piped());
    for (k, v) in &c.env {
        cmd.env(k, v);
    }
    cmd.stdin(match c.io {
        Io::Stdin(_) => Stdio::piped(),
        _ => Stdio::null(),
    });
    cmd.stdout(Stdio::piped());
    // SAFETY: between fork and exec only setrlimit runs, which is async-signal-safe and touches no lock.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: ADDRESS_SPACE, rlim_max: ADDRESS_SPACE };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let t = Instant::now();
    let mut child = cmd.spawn().expect("spawn pdhost");
    if let Io::ClosedStdout = c.io {
        drop(child.stdout.take());
    }
    if let (Io::Stdin(bytes), Some(mut stdin)) = (&c.io, child.stdin.take()) {
        let bytes = bytes.clone();
        // A writer thread: the child may refuse before reading it all (a closed pipe is fine).
        std::thread::spawn(move || {
            let _ = stdin.write_all(&bytes);
        });
    }
    // Drain both pipes while waiting, so a chatty child never blocks on a full pipe.
    let out = child.stdout.take().map(|mut s| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = std::io::Read::read_to_end(&mut s, &mut v);
            v
        })
    });
    let mut err_pipe = child.stderr.take().expect("stderr");
    let err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = std::io::Read::read_to_end(&mut err_pipe, &mut v);
        v
    });
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if t.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{}: hung (killed after {DEADLINE:?}): pdhost {:?}", c.name, c.args);
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let elapsed = t.elapsed();
    let stdout = out.map(|h| h.join().unwrap()).unwrap_or_default();
    Ran {
        code: status.code(),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&err.join().unwrap()).into_owned(),
        elapsed,
    }
}

/// Runs every case and checks it; returns the failures (all of them, not just the first).
fn check_all(cases: &[Case]) -> Vec<String> {
    let mut failures = Vec::new();
    for c in cases {
        let r = run(c);
        let mut fail =
            |why: String| failures.push(format!("{}: {why}\n  args {:?}\n  stderr {:?}", c.name, c.args, r.stderr));
        match r.code {
            Some(code) if code == c.code => {}
            Some(code) => fail(format!("exit {code}, expected {}", c.code)),
            None => fail("killed by a signal (a crash)".into()),
        }
        if r.stderr.contains("panicked") || r.stderr.contains("RUST_BACKTRACE") {
            fail("panicked".into());
        }
        let said = if c.verdict_on_stdout { &r.stdout } else { &r.stderr };
        if c.code != 0 && !c.help {
            let lines: Vec<&str> = said.lines().collect();
            if lines.len() != 1 || !(c.verdict_on_stdout || lines[0].starts_with("error: ")) {
                fail(format!("expected one line starting with `error: `, found {} lines", lines.len()));
            }
            if said.len() > 2048 {
                fail(format!("a {}-byte message (input echoed?)", said.len()));
            }
        }
        for s in &c.says {
            if !said.contains(s.as_str()) {
                fail(format!("the message lacks {s:?}"));
            }
        }
        for s in &c.never {
            if r.stderr.contains(s.as_str()) || r.stdout.contains(s.as_str()) {
                fail(format!("output holds {s:?}"));
            }
        }
        for s in &c.prints {
            if !r.stdout.contains(s.as_str()) {
                fail(format!("stdout lacks {s:?}: {:?}", r.stdout));
            }
        }
        eprintln!("{:>7.2}s exit {:?} {}", r.elapsed.as_secs_f64(), r.code, c.name);
    }
    failures
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

fn tiny() -> String {
    fixtures().join("reference/tiny_gemma3_8l").display().to_string()
}

/// Fetches a real model through pdhost's own cache (once per test binary) and returns its path.
fn fetched(name: &str) -> PathBuf {
    static PATHS: OnceLock<std::sync::Mutex<std::collections::HashMap<String, PathBuf>>> = OnceLock::new();
    let paths = PATHS.get_or_init(Default::default);
    let mut paths = paths.lock().unwrap_or_else(|e| e.into_inner());
    paths
        .entry(name.to_string())
        .or_insert_with(|| {
            let out = Command::new(PDHOST).args(["models", "fetch", name]).stdin(Stdio::null()).output().unwrap();
            assert!(out.status.success(), "fetching {name}: {}", String::from_utf8_lossy(&out.stderr));
            PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
        })
        .clone()
}

/// `generate` on the tiny checkpoint: local prefill of three ids and two tokens unless `extra` says
/// otherwise. Fast, and valid unless a case makes it not.
fn tiny_gen(name: &str, extra: &[&str]) -> Case {
    let mut c = case(name, &["generate"]);
    c.args.extend(extra.iter().map(|s| s.to_string()));
    let tiny = tiny();
    for (flag, default) in
        [("--model", tiny.as_str()), ("--prompt-ids", "2,100,20"), ("--producer", "local"), ("--max-tokens", "2")]
    {
        let given = extra.contains(&flag)
            || (flag == "--prompt-ids" && (extra.contains(&"--prompt") || extra.contains(&"--prompt-file")));
        if !given {
            c.args.extend([flag.to_string(), default.to_string()]);
        }
    }
    c
}

/// This file's tests one at a time: each ends by asserting that no producer of this build is running
/// ([`assert_clean`]), which another test's live producers would fail (a race seen in CI).
fn exclusive() -> MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Processes running a `pdhost __producer` of this build.
fn producers() -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().filter_map(Result::ok) {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        if args.first().is_some_and(|a| *a == PDHOST.as_bytes()) && args.get(1).is_some_and(|a| *a == b"__producer") {
            pids.push(pid);
        }
    }
    pids
}

fn assert_clean(failures: Vec<String>, count: usize) {
    assert!(failures.is_empty(), "{} of {count} cases failed:\n{}", failures.len(), failures.join("\n"));
    assert_eq!(producers(), Vec::<u32>::new(), "producer processes left behind");
}

/// A path that is a FIFO, and one that is a symlink to itself, in `dir`.
fn odd_files(dir: &Path) -> (String, String) {
    let fifo = dir.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let looped = dir.join("loop");
    std::os::unix::fs::symlink(&looped, &looped).unwrap();
    (fifo.display().to_string(), looped.display().to_string())
}

/// Every case issue 10 lists under "What was found", in its order.
#[test]
fn every_reported_case_is_refused_or_handled() {
    let _one = exclusive();
    let gemma = fetched("gemma3-270m");
    let smol = fetched("smollm2-135m");
    let dir = tempfile::tempdir().unwrap();
    let (fifo, looped) = odd_files(dir.path());
    let file = |name: &str, bytes: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p.display().to_string()
    };
    // About 350k tokens of text for a 32k context.
    let long_prompt = file("long.txt", "the quick brown fox jumps over a lazy dog ".repeat(42_000).as_bytes());
    let empty = file("empty.txt", b"");
    let ids_3000 = vec!["5"; 3000].join(",");
    let deep = format!("{}{}", "[".repeat(20_000), "]".repeat(20_000));
    let span = fixtures().join("spans/valid-grouped-f32.span").display().to_string();
    let max = u64::MAX.to_string();
    let g = |name: &str, args: &[&str]| {
        let mut c = case(name, &["generate", "--prompt", "Hello there"]);
        c.args.extend(args.iter().map(|s| s.to_string()));
        c
    };
    let smol_gen = |name: &str, args: &[&str]| g(name, args).arg("--model").arg("smollm2-135m");
    let cases = vec![
        // Crashes and hangs.
        g("max-tokens 1000000", &["--max-tokens", "1000000"])
            .refused(2, &["--max-tokens: expected at most", "gemma3-270m's 32768-token context", "found 1000000"]),
        case("350k-token prompt file", &["generate", "--prompt-file", &long_prompt])
            .refused(2, &["--prompt-file: expected at most 32768 tokens", "found"]),
        g("max-tokens u64::MAX gemma", &["--max-tokens", &max]).refused(2, &["--max-tokens: expected at most"]),
        smol_gen("max-tokens u64::MAX smollm2", &["--max-tokens", &max])
            .refused(2, &["--max-tokens: expected at most", "8192-token context"]),
        g("threads 100000", &["--threads", "100000"]).refused(2, &["--threads: expected 1 to", "found 100000"]),
        g("backend-config threads 100000", &["--backend-config", r#"{"threads":100000}"#])
            .refused(2, &["--backend-config: expected \"threads\" from 1 to", "100000"]),
        g("producer-timeout 1e300", &["--producer-timeout", "1e300"])
            .refused(2, &["--producer-timeout: expected seconds above 0 and at most 3600, found 1e300"]),
        case("inspect-span closed stdout", &["inspect-span", &span]).io(Io::ClosedStdout),
        case("inspect-span --json closed stdout", &["inspect-span", &span, "--json"]).io(Io::ClosedStdout),
        case("models list closed stdout", &["models", "list"]).io(Io::ClosedStdout),
        case("bench ring closed stdout", &["bench", "ring", "--sizes", "1", "--iters", "1"]).io(Io::ClosedStdout),
        tiny_gen("generate closed stdout", &[]).io(Io::ClosedStdout),
        case("bench ring iters 0", &["bench", "ring", "--iters", "0"])
            .refused(2, &["--iters: expected 1 to 10000, found 0"]),
        case("bench model prompt-tokens 0", &["bench", "model", "--no-llama-cpp", "--prompt-tokens", "0"])
            // The smallest context of the models benched bounds it: SmolLM2's 8192 less 34.
            .refused(2, &["--prompt-tokens: expected 1 to 8158 (smollm2-135m's context", "found 0"]),
        case("bench model prompt-tokens u64::MAX", &["bench", "model", "--no-llama-cpp", "--prompt-tokens", &max])
            .refused(2, &["--prompt-tokens: expected 1 to"]),
        case("bench serve temperature -1", &["bench", "serve", "--temperature", "-1"])
            .refused(2, &["--temperature: expected a number from 0 (greedy) to 100, found -1"]),
        case("bench serve peer sampled", &["bench", "serve", "--peer", "--temperature", "0.5"])
            .refused(2, &["--temperature: expected 0 (greedy) with --peer, found 0.5"]),
        case("bench serve mixed tiny context", &["bench", "serve", "--mixed", "--context", "20", "--long-prompt", "8"])
            .refused(2, &["--context: expected more than 32 tokens with --mixed (each stream's prompt), found 20"]),
        case("bench ingest tokens u64::MAX", &["bench", "ingest", "--tokens", &max])
            .refused(2, &["--tokens: expected 1 to 65536"]),
        // Accepted, or silently changed.
        g("temperature NaN", &["--temperature", "NaN"])
            .refused(2, &["--temperature: expected a number from 0", "found NaN"]),
        g("temperature negative", &["--temperature", "-0.5"]).refused(2, &["--temperature", "found -0.5"]),
        g("temperature inf", &["--temperature", "inf"]).refused(2, &["--temperature", "found inf"]),
        g("temperature 1e38", &["--temperature", "1e38"]).refused(2, &["--temperature", "found 1e38"]),
        g("top-p 2", &["--temperature", "1", "--top-p", "2"])
            .refused(2, &["--top-p: expected a number above 0 and at most 1, found 2"]),
        g("top-p NaN", &["--temperature", "1", "--top-p", "NaN"]).refused(2, &["--top-p", "found NaN"]),
        g("top-p negative", &["--temperature", "1", "--top-p", "-0.1"]).refused(2, &["--top-p", "found -0.1"]),
        g("presence-penalty 3", &["--presence-penalty", "3"])
            .refused(2, &["--presence-penalty: expected a number from -2 to 2, found 3"]),
        g("frequency-penalty NaN", &["--frequency-penalty", "NaN"]).refused(2, &["--frequency-penalty", "found NaN"]),
        g("repetition-penalty 0", &["--repetition-penalty", "0"])
            .refused(2, &["--repetition-penalty: expected a number from 0.01 to 10 (1: off), found 0"]),
        g("logit-bias twice", &["--logit-bias", "5:1,5:-2"]).refused(2, &["--logit-bias: expected each token once"]),
        g("logit-bias out of the vocabulary", &["--logit-bias", "4294967296:1"])
            .refused(2, &["--logit-bias: expected token ids below", "found 4294967296"]),
        g("logit-bias inf", &["--logit-bias", "5:inf"]).refused(2, &["--logit-bias: expected biases from -100 to 100"]),
        g("logit-bias no colon", &["--logit-bias", "5=1"]).refused(2, &["expected ID:BIAS pairs, found \"5=1\""]),
        g("logprobs 21", &["--logprobs", "21", "--json"])
            .refused(2, &["--logprobs: expected 0 to 20 alternatives per token, found 21"]),
        g("logprobs without --json", &["--logprobs", "2"]).refused(2, &["--json"]),
        g("threads 0", &["--threads", "0"]).refused(2, &["--threads: expected 1 to", "found 0"]),
        case("bench pd threads 0", &["bench", "pd", "--threads", "0"]).refused(2, &["--threads", "found 0"]),
        // A one-token prompt has nothing for a producer to prefill.
        case("bench pd tokens 1", &["bench", "pd", "--tokens", "1,8"])
            .refused(2, &["--tokens: expected 2 to", "(a prompt with a token to prefill;", "found 1"]),
        g("threads 1000", &["--threads", "1000"]).refused(2, &["--threads", "found 1000"]),
        g("max-tokens 100000", &["--max-tokens", "100000"])
            .refused(2, &["--max-tokens: expected at most", "found 100000"]),
        tiny_gen("3000 ids on a 2048-token context", &["--prompt-ids", &ids_3000])
            .refused(2, &["--prompt-ids: expected at most 2048 tokens", "found 3000 tokens"]),
        case("prompt-file /dev/zero", &["generate", "--prompt-file", "/dev/zero"])
            .refused(2, &["--prompt-file: expected a regular file or - (standard input), found /dev/zero: a device"]),
        case("empty prompt gemma", &["generate", "--prompt", ""])
            .refused(2, &["--prompt: expected a non-empty prompt"]),
        case("empty prompt smollm2", &["generate", "--model", "smollm2-135m", "--prompt", ""])
            .refused(2, &["--prompt: expected a non-empty prompt"]),
        case("empty prompt file", &["generate", "--prompt-file", &empty])
            .refused(2, &["--prompt-file: expected a non-empty prompt"]),
        g("local with backend-config", &["--producer", "local", "--backend-config", "{}"])
            .refused(2, &["--backend-config: expected no backend config with the local producer"]),
        // Flags that only set up producers do nothing with local prefill: refused, not ignored; their
        // defaults are no choice of the user's.
        g("local with sandbox", &["--producer", "local", "--sandbox", "off"]).refused(
            2,
            &["--sandbox: expected no --sandbox with --producer local (local prefill starts no producer), found off"],
        ),
        g("local with on-producer-failure", &["--producer", "local", "--on-producer-failure", "fail"]).refused(
            2,
            &["--on-producer-failure: expected no --on-producer-failure with --producer local", "found fail"],
        ),
        case("serve local with max-restarts", &["serve", "--producer", "local", "--max-restarts", "3"])
            .refused(2, &["--max-restarts: expected no --max-restarts with --producer local", "found 3"]),
        case("serve local with producer-memory", &["serve", "--producer", "local", "--producer-memory=512"])
            .refused(2, &["--producer-memory: expected no --producer-memory with --producer local", "found 512"]),
        case("bench model decode-tokens u64::MAX", &["bench", "model", "--no-llama-cpp", "--decode-tokens", &max])
            .refused(2, &["--decode-tokens: expected 1 to 4096"]),
        case("bench pd decode-tokens u64::MAX", &["bench", "pd", "--decode-tokens", &max])
            .refused(2, &["--decode-tokens: expected 1 to 4096"]),
        // Unclear.
        g("model /dev/zero", &["--model", "/dev/zero"])
            .refused(2, &["--model: expected a .gguf file or a checkpoint directory, found /dev/zero: a device"]),
        g("model /dev/null", &["--model", "/dev/null"]).refused(2, &["found /dev/null: a device"]),
        g("model FIFO", &["--model", &fifo]).refused(2, &["a FIFO"]),
        g("model symlink loop", &["--model", &looped]).refused(2, &["--model", "symbolic links"]),
        g("model README.md", &["--model", "../README.md"])
            .refused(2, &["a file starting with \"# pd\""])
            .never(&["[35, 32"]),
        g("page-size 1000000000", &["--page-size", "1000000000"])
            .refused(2, &["--page-size: expected 1 to 4096 tokens, found 1000000000"]),
        g("20k-deep backend-config", &["--backend-config", &deep])
            .refused(2, &["--backend-config: expected JSON nested at most 16 deep, found nesting 20000 deep"]),
        tiny_gen(
            "describe mismatch in words",
            &[
                "--on-producer-failure",
                "fail",
                "--producer",
                "faulty",
                "--backend-config",
                r#"{"fault":"wrong_layer_count","layout":"grouped"}"#,
            ],
        )
        .refused(1, &["remote prefill failed"])
        .never(&["Group {", "Sliding {", "Full {"]),
        tiny_gen(
            "garbage reply",
            &[
                "--on-producer-failure",
                "fail",
                "--producer",
                "faulty",
                "--backend-config",
                r#"{"fault":"garbage_reply"}"#,
            ],
        )
        .refused(1, &["remote prefill failed"])
        .never(&["Hit the end of buffer"]),
        case("bench ingest tokens 0", &["bench", "ingest", "--tokens", "0"])
            .refused(2, &["--tokens: expected 1 to 65536, found 0"]),
        case("bench ingest iters 0", &["bench", "ingest", "--iters", "0"])
            .refused(2, &["--iters: expected 1 to 1000, found 0"]),
        case("inspect-span /proc/self/status", &["inspect-span", "/proc/self/status"])
            .verdict_on_stdout()
            .refused(1, &["rejected (bad_magic)"])
            .never(&["found 0"]),
        case(
            "bench model without llama.cpp prints -",
            &[
                "bench",
                "model",
                "--no-llama-cpp",
                "--prompt-tokens",
                "4",
                "--decode-tokens",
                "1",
                "--batch",
                "1,2",
                "--repeats",
                "1",
                "--kv-dtype",
                "f16",
            ],
        )
        .prints(&[
            " - ",
            "gemma3-270m   exact  RSS of a `generate` of the first prompt after load ",
            "(f16 KV; llama.cpp's is f16)",
        ])
        .never(&["NaN"]),
        case("bench model kv-dtype f8", &["bench", "model", "--no-llama-cpp", "--kv-dtype", "f8"])
            .refused(2, &["invalid value 'f8' for '--kv-dtype <KV_DTYPE>' [possible values: f32, bf16, f16]"]),
        case("bench model batch 0", &["bench", "model", "--no-llama-cpp", "--batch", "1,0"])
            .refused(2, &["--batch: expected 1 to 16, found 0"]),
        case("bench model repeats 21", &["bench", "model", "--no-llama-cpp", "--repeats", "21"])
            .refused(2, &["--repeats: expected 1 to 20, found 21"]),
        case("bench model threads 0", &["bench", "model", "--no-llama-cpp", "--threads", "1,0"])
            .refused(2, &["--threads: expected 1 to", "found 0"]),
        case("bench model models gemma", &["bench", "model", "--no-llama-cpp", "--models", "gemma"]).refused(
            2,
            &["invalid value 'gemma' for '--models <MODEL,...>' [possible values: gemma3-270m, smollm2-135m]"],
        ),
        case("bench model precision bf16", &["bench", "model", "--no-llama-cpp", "--precision", "fast,bf16"])
            .refused(2, &["invalid value 'bf16' for '--precision <PRECISION,...>' [possible values: exact, fast]"]),
        case("bench kernels", &["bench", "kernels", "--batch", "1,2", "--threads", "1", "--iters", "1"])
            .prints(&["gemma3-270m   exact    1     2 ", "smollm2-135m  fast     1     1 ", "x memcpy"])
            .never(&["NaN", "inf"]),
        case(
            "bench kernels cold smollm2",
            &[
                "bench",
                "kernels",
                "--models",
                "smollm2-135m",
                "--batch",
                "1",
                "--threads",
                "1",
                "--iters",
                "1",
                "--cold",
            ],
        )
        .prints(&["each from memory", "smollm2-135m  fast     1     1 "])
        .never(&["NaN", "inf", "gemma3-270m"]),
        case("bench kernels batch 65", &["bench", "kernels", "--batch", "1,65"])
            .refused(2, &["--batch: expected 1 to 64, found 65"]),
    ];
    let _ = (gemma, smol);
    let failures = check_all(&cases);
    assert_clean(failures, cases.len());
}

/// Values no numeric flag should take at face value.
const HOSTILE_NUMBERS: &[&str] = &["", " 1", "-1", "0x10", "1e400", "NaN", "18446744073709551616", "1.5.2", "٣"];

/// A fresh sweep of hostile cases of our own: every numeric flag with hostile values, files of every
/// kind where a file is expected, malformed JSON and ids, and odd environments.
#[test]
fn a_fresh_hostile_sweep_finds_no_crash_hang_or_leak() {
    let _one = exclusive();
    let dir = tempfile::tempdir().unwrap();
    let (fifo, looped) = odd_files(dir.path());
    let file = |name: &str, bytes: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p.display().to_string()
    };
    let d = dir.path().display().to_string();
    let latin1 = file("latin1.txt", b"caf\xe9 au lait");
    let nul_text = file("nul.txt", b"a\0b");
    let big = file("big.txt", &vec![b'a'; (8 << 20) + 1]);
    let zeros_gguf = file("zeros.gguf", &[0u8; 64]);
    let magic_only = file("magic.gguf", b"GGUF");
    let bad_version = file("version.gguf", b"GGUF\xff\xff\xff\xff\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0");
    // A header claiming 2^63 tensors and 2^63 metadata entries.
    let huge_counts = file(
        "counts.gguf",
        &[b"GGUF".as_slice(), &3u32.to_le_bytes(), &(1u64 << 63).to_le_bytes(), &(1u64 << 63).to_le_bytes()].concat(),
    );
    // A Llama GGUF of 2^61 layers: refused before anything is sized by the count.
    let huge_layers = {
        let string = |s: &str| [&(s.len() as u64).to_le_bytes()[..], s.as_bytes()].concat();
        let entry =
            |key: &str, ty: u32, value: &[u8]| [string(key), ty.to_le_bytes().to_vec(), value.to_vec()].concat();
        let header = [b"GGUF".as_slice(), &3u32.to_le_bytes(), &0u64.to_le_bytes(), &2u64.to_le_bytes()].concat();
        let arch = entry("general.architecture", 8, &string("llama"));
        file("layers.gguf", &[header, arch, entry("llama.block_count", 10, &(1u64 << 61).to_le_bytes())].concat())
    };
    let sparse = dir.path().join("sparse.gguf");
    std::fs::File::create(&sparse).unwrap().set_len(1 << 40).unwrap();
    let sparse = sparse.display().to_string();
    let empty_span = file("empty.span", b"");
    let one_byte_span = file("one.span", b"P");
    let sparse_span = dir.path().join("sparse.span");
    std::fs::File::create(&sparse_span).unwrap().set_len(1 << 40).unwrap();
    let sparse_span = sparse_span.display().to_string();
    let ckpt = |name: &str, config: &str| {
        let p = dir.path().join(name);
        std::fs::create_dir(&p).unwrap();
        std::fs::write(p.join("config.json"), config).unwrap();
        p.display().to_string()
    };
    let garbage_ckpt = ckpt("garbage-ckpt", "{not json");
    let deep_ckpt = ckpt("deep-ckpt", &format!("{}{}", "[".repeat(5000), "]".repeat(5000)));
    let zero_heads = ckpt(
        "zero-heads",
        r#"{"model_type":"llama","hidden_size":8,"num_attention_heads":0,"num_hidden_layers":1,"vocab_size":4,"intermediate_size":8}"#,
    );
    let no_weights = ckpt(
        "no-weights",
        r#"{"model_type":"llama","hidden_size":8,"num_attention_heads":2,"num_hidden_layers":1,"vocab_size":4,"intermediate_size":8}"#,
    );
    let huge_width = ckpt(
        "huge-width",
        r#"{"model_type":"llama","hidden_size":4611686018427387904,"num_attention_heads":2,"num_hidden_layers":1,"vocab_size":4,"intermediate_size":8}"#,
    );
    let huge_vocab = ckpt(
        "huge-vocab",
        r#"{"model_type":"llama","hidden_size":8,"num_attention_heads":2,"num_hidden_layers":1,"vocab_size":18446744073709551615,"intermediate_size":8}"#,
    );
    // Gemma 3's tiny checkpoint's config with a window of no positions (no weights needed to refuse it).
    let zero_window = {
        let tiny_config = Path::new(&tiny()).join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(tiny_config).unwrap()).unwrap();
        config["sliding_window"] = 0.into();
        ckpt("zero-window", &config.to_string())
    };
    let not_a_lib = file("libnot.so", b"not an ELF file");
    // An ELF file's first bytes and nothing else: the host takes it, its producer fails to load it.
    let broken_lib = file("libbroken.so", b"\x7fELF and then nothing a loader can use");
    let max = u64::MAX.to_string();

    let mut cases = Vec::new();
    // Every numeric flag of generate, with every hostile number: a clap refusal naming the flag.
    for flag in [
        "--max-tokens",
        "--context",
        "--page-size",
        "--prefill-chunk",
        "--threads",
        "--seed",
        "--producer-timeout",
        "--temperature",
        "--top-p",
    ] {
        for value in HOSTILE_NUMBERS {
            let mut c = tiny_gen(&format!("{flag} {value:?}"), &[flag, value]);
            if matches!(flag, "--seed" | "--top-p") {
                c = c.arg("--temperature").arg("0.5");
            }
            // 1e400 and NaN parse as floats; the checked request refuses them.
            cases.push(c.refused(2, &[flag]));
        }
    }
    // Bench flags with hostile numbers.
    for (bench, flag) in [
        ("ring", "--sizes"),
        ("ring", "--iters"),
        ("ingest", "--tokens"),
        ("ingest", "--iters"),
        ("pd", "--tokens"),
        ("pd", "--iters"),
        ("pd", "--decode-tokens"),
        ("model", "--prompt-tokens"),
        ("kernels", "--batch"),
        ("kernels", "--threads"),
        ("kernels", "--iters"),
    ] {
        for value in ["0", "-5", &max, "abc"] {
            // A negative count says what a count is, not Rust's "invalid digit found in string".
            let says: &[&str] =
                if value == "-5" { &[flag, "expected a whole number, not a negative one"] } else { &[flag] };
            cases.push(case(&format!("bench {bench} {flag} {value}"), &["bench", bench, flag, value]).refused(2, says));
        }
    }
    let more = vec![
        // A free-text flag whose value was left out takes no other flag as its value.
        tiny_gen("prompt without its value", &["--prompt", "--json"])
            .refused(2, &["--prompt: expected the prompt's text, found the flag --json"]),
        case("serve api-key without its value", &["serve", "--api-key", "--port", "0"])
            .refused(2, &["--api-key: expected a key, found the flag --port"]),
        // A flag that means nothing without another names both.
        tiny_gen("top-p without temperature", &["--top-p", "0.5"])
            .refused(2, &["--top-p: expected --temperature with it (without it decoding is greedy), found none"]),
        tiny_gen("logprobs without json", &["--logprobs", "2"]).refused(2, &["--logprobs: expected --json with it"]),
        case("bench serve streams without mixed", &["bench", "serve", "--streams", "3"])
            .refused(2, &["--streams: expected --mixed with it"]),
        // A bench case given twice would run twice.
        case("bench model threads twice", &["bench", "model", "--no-llama-cpp", "--threads", "1,2,1"])
            .refused(2, &["--threads: expected each value once, found 1 twice"]),
        case("bench ring sizes twice", &["bench", "ring", "--sizes", "4,4"])
            .refused(2, &["--sizes: expected each value once, found 4 twice"]),
        // A server's context holds a prompt token and an output token.
        case("serve context 1", &["serve", "--model", &tiny(), "--producer", "local", "--context", "1"])
            .refused(2, &["--context: expected 2 to 2048 tokens", "found 1"]),
        case("bench serve context 1", &["bench", "serve", "--context", "1"]).refused(2, &["--context: expected 2 to"]),
        // What the server a bench starts would refuse, the bench refuses itself, in one line.
        case("bench serve producers 0", &["bench", "serve", "--producers", "0"])
            .refused(2, &["--producers: expected 1 to 8, found 0"]),
        case("bench serve prefill-chunk past the context", &["bench", "serve", "--context", "64", "--prefill-chunk", "65"])
            .refused(2, &["--prefill-chunk: expected 0 to 64, found 65"]),
        // A list of ids may have spaces after its commas; a memory size names its unit.
        tiny_gen("prompt ids with spaces", &["--prompt-ids", "2, 100, 20", "--json"]).prints(&["\"prompt_ids\":[2,100,20]"]),
        tiny_gen("producer-memory 1", &["--producer", "rngd", "--producer-memory", "1"])
            .refused(2, &["--producer-memory: expected 64 to", "MiB (this machine's memory), found 1"]),
        // A server's producer names are trimmed before any check.
        case("serve local with spaces", &["serve", "--producer", " local", "--producer-memory=512"])
            .refused(2, &["--producer-memory: expected no --producer-memory with --producer local"]),
        // A server's producers, refused before a model loads.
        case("serve producer list with local", &["serve", "--producer", "local,rngd"])
            .refused(2, &["--producer: expected one producer, or backends separated by commas (`local` alone)"]),
        case("serve producer list empty entry", &["serve", "--producer", "rngd,"]).refused(2, &["--producer"]),
        case("serve fewer producers than backends", &["serve", "--producer", "faulty,rngd", "--producers", "1"])
            .refused(2, &["--producers: expected 2 to 8, found 1"]),
        case("serve max-restarts 1001", &["serve", "--max-restarts", "1001"])
            .refused(2, &["--max-restarts: expected 0 to 1000, found 1001"]),
        case("serve max-restarts -1", &["serve", "--max-restarts", "-1"])
            .refused(2, &["'-1' for '--max-restarts <MAX_RESTARTS>': expected a whole number, not a negative one"]),
        case("serve port -1", &["serve", "--port", "-1"])
            .refused(2, &["'-1' for '--port <PORT>': expected a port from 0 to 65535"]),
        case("serve local with producers", &["serve", "--producer", "local", "--producers", "3"])
            .refused(2, &["--producers: expected 1 with --producer local"]),
        // An unknown model is the user's flag in every bench that fetches one.
        case("bench pd unknown model", &["bench", "pd", "--model", "bogus"])
            .refused(2, &["--model: expected one of gemma3-270m, smollm2-135m, found \"bogus\""]),
        case("bench soak rates over 1", &["bench", "soak", "--bad-rate", "0.7", "--disconnect-rate", "0.5"])
            .refused(2, &["--disconnect-rate: expected at most 0.3 (1 less --bad-rate), found 0.5"]),
        case("bench soak unknown model", &["bench", "soak", "--model", "bogus"])
            .refused(2, &["--model: expected one of gemma3-270m, smollm2-135m, found \"bogus\""]),
        case("bench serve mixed unknown model", &["bench", "serve", "--mixed", "--model", "bogus"])
            .refused(2, &["--model: expected one of gemma3-270m, smollm2-135m, found \"bogus\""]),
        // `--mixed` runs its own cells: the matrix's flags would be ignored, so they are refused; its
        // producer is checked before any server starts.
        case("bench serve mixed with repeats", &["bench", "serve", "--mixed", "--repeats", "2"])
            .refused(2, &["'--mixed' cannot be used with '--repeats <REPEATS>'"]),
        case("bench serve mixed with concurrency", &["bench", "serve", "--mixed", "--concurrency", "8"])
            .refused(2, &["'--mixed' cannot be used with '--concurrency <N,...>'"]),
        case("bench serve mixed unknown producer", &["bench", "serve", "--mixed", "--producer", "nosuch"])
            .refused(2, &["--producer: expected local, rngd", "found \"nosuch\""]),
        case("serve port abc", &["serve", "--port", "abc"])
            .refused(2, &["'abc' for '--port <PORT>': expected a port from 0 to 65535"]),
        // An empty key could never match (HTTP trims a header's ends): every request would get 401.
        case("serve empty api key", &["serve", "--api-key", ""])
            .refused(2, &["'' for '--api-key <KEY>': expected a key with no whitespace at either end, not empty"]),
        case("serve drain timeout abc", &["serve", "--drain-timeout", "abc"])
            .refused(2, &["'abc' for '--drain-timeout <SECONDS>': expected a number"]),
        case("serve batch wait past a second", &["serve", "--batch-wait", "1001"])
            .refused(2, &["--batch-wait: expected 0 to 1000, found 1001"]),
        // A running server's wait is its own: `bench serve` sets it only in the server it starts.
        case("bench serve batch wait with url", &["bench", "serve", "--url", "http://127.0.0.1:1", "--batch-wait", "5"])
            .refused(2, &["the argument '--url <URL>' cannot be used with '--batch-wait <MS>'"]),
        // A mistyped flag keeps clap's suggestion, on the same line.
        case("generate mistyped flag", &["generate", "--promt", "hi"])
            .refused(2, &["unexpected argument '--promt' found (tip: a similar argument exists: '--prompt')"]),
        case("serve host name", &["serve", "--host", "example.org"])
            .refused(2, &["'example.org' for '--host <HOST>': expected an IP address (such as 127.0.0.1"]),
        tiny_gen("prompt-ids -2", &["--prompt-ids", "1,-2"]).refused(2, &["expected a token id, a whole number from 0"]),
        // Bounds just past the edge.
        tiny_gen("page-size past the context", &["--page-size", "2049"])
            .refused(2, &["--page-size: expected 1 to 2048 tokens"]),
        tiny_gen("page-size 4097 on gemma bound", &["--page-size", "4097"]).refused(2, &["--page-size"]),
        tiny_gen("prefill-chunk past the context", &["--prefill-chunk", "2049"])
            .refused(2, &["--prefill-chunk: expected 0 (the whole prompt) or 1 to 2048"]),
        tiny_gen("context 0", &["--context", "0"]).refused(2, &["--context: expected 1 to 2048 tokens"]),
        tiny_gen("context past the model", &["--context", "2049"]).refused(2, &["--context: expected 1 to 2048"]),
        tiny_gen("prompt plus output past --context", &["--context", "4", "--max-tokens", "2"])
            .refused(2, &["--max-tokens: expected at most 1 after a 3-token prompt (the 4-token --context)"]),
        tiny_gen("producer-timeout 0", &["--producer", "rngd", "--producer-timeout", "0"])
            .refused(2, &["--producer-timeout: expected seconds above 0"]),
        tiny_gen("producer-timeout 3601", &["--producer", "rngd", "--producer-timeout", "3601"])
            .refused(2, &["at most 3600"]),
        tiny_gen("temperature 101", &["--temperature", "101"]).refused(2, &["--temperature"]),
        tiny_gen("top-p 0", &["--temperature", "1", "--top-p", "0"]).refused(2, &["--top-p"]),
        tiny_gen("top-p without temperature", &["--top-p", "0.5"]).refused(2, &["--temperature"]),
        tiny_gen("seed without temperature", &["--seed", "3"]).refused(2, &["--temperature"]),
        // Valid edges run.
        tiny_gen("max-tokens 0 generates nothing", &["--max-tokens", "0"]),
        tiny_gen("context exactly prompt plus output", &["--context", "5", "--max-tokens", "2"]),
        tiny_gen("page-size 1", &["--page-size", "1"]),
        tiny_gen("page-size the whole context", &["--page-size", "2048"]),
        tiny_gen("prefill-chunk 1", &["--prefill-chunk", "1"]),
        tiny_gen("temperature 0 is greedy", &["--temperature", "0"]),
        tiny_gen("sampling at the edges", &["--temperature", "100", "--top-p", "1", "--seed", &max]),
        tiny_gen("threads 1", &["--threads", "1"]),
        tiny_gen("json", &["--json"]).prints(&["\"output_ids\""]),
        tiny_gen("json with a closed stdout", &["--json"]).io(Io::ClosedStdout),
        tiny_gen("kv-dtype bf16", &["--kv-dtype", "bf16"]),
        tiny_gen("whole context as output", &["--max-tokens", "2045", "--prompt-ids", "2,3,4"]).never(&["panicked"]),
        // Prompt ids.
        tiny_gen("ids: empty", &["--prompt-ids", ""]).refused(2, &["--prompt-ids"]),
        tiny_gen("ids: a lone comma", &["--prompt-ids", ","]).refused(2, &["--prompt-ids"]),
        tiny_gen("ids: a gap", &["--prompt-ids", "1,,2"]).refused(2, &["--prompt-ids"]),
        tiny_gen("ids: negative", &["--prompt-ids", "-1"]).refused(2, &["--prompt-ids"]),
        tiny_gen("ids: past u32", &["--prompt-ids", "4294967296"]).refused(2, &["--prompt-ids"]),
        tiny_gen("ids: the vocabulary size", &["--prompt-ids", "2,256"])
            .refused(2, &["--prompt-ids: expected token ids below", "vocabulary size 256, found 256 at position 1"]),
        tiny_gen("ids: u32::MAX", &["--prompt-ids", "4294967295"]).refused(2, &["found 4294967295 at position 0"]),
        tiny_gen("ids: spaces", &["--prompt-ids", "1 2"]).refused(2, &["--prompt-ids"]),
        tiny_gen("ids: hex", &["--prompt-ids", "0x10"]).refused(2, &["--prompt-ids"]),
        // Text prompts on a checkpoint without a tokenizer.
        tiny_gen("text on a model without a tokenizer", &["--prompt", "hello"])
            .refused(2, &["--prompt: expected --prompt-ids (this model has no tokenizer)"]),
        // A prompt that starts with a hyphen is the prompt, not a flag (it was "unexpected argument").
        tiny_gen("a prompt starting with a hyphen", &["--prompt", "- item one"])
            .refused(2, &["--prompt: expected --prompt-ids (this model has no tokenizer)"]),
        // Prompt files.
        tiny_gen("prompt-file: a directory", &["--prompt-file", &d]).refused(2, &["--prompt-file", "a directory"]),
        tiny_gen("prompt-file: a FIFO", &["--prompt-file", &fifo]).refused(2, &["--prompt-file", "a FIFO"]),
        tiny_gen("prompt-file: a symlink loop", &["--prompt-file", &looped])
            .refused(2, &["--prompt-file", "symbolic links"]),
        tiny_gen("prompt-file: missing", &["--prompt-file", "/nonexistent/prompt.txt"])
            .refused(2, &["--prompt-file", "nothing there"]),
        tiny_gen("prompt-file: not UTF-8", &["--prompt-file", &latin1])
            .refused(2, &["--prompt-file: expected UTF-8 text", "offset 3"]),
        tiny_gen("prompt-file: over the cap", &["--prompt-file", &big])
            .refused(2, &["--prompt-file: expected at most 8 MiB of text"]),
        tiny_gen("prompt-file: NUL bytes, no tokenizer", &["--prompt-file", &nul_text]).refused(2, &["--prompt-ids"]),
        tiny_gen("prompt-file: /proc/self/mem", &["--prompt-file", "/proc/self/mem"]).refused(2, &["--prompt-file"]),
        tiny_gen("prompt-file: /dev/stdin FIFO", &["--prompt-file", "/dev/null"]).refused(2, &["a device"]),
        tiny_gen("stdin: not UTF-8", &["--prompt-file", "-"])
            .io(Io::Stdin(b"\xff\xfe".to_vec()))
            .refused(2, &["--prompt-file: expected UTF-8 text, found standard input"]),
        tiny_gen("stdin: empty", &["--prompt-file", "-"]).refused(2, &["--prompt-file: expected a non-empty prompt"]),
        tiny_gen("stdin: over the cap", &["--prompt-file", "-"])
            .io(Io::Stdin(vec![b'a'; (8 << 20) + 10]))
            .refused(2, &["at most 8 MiB"]),
        // Models.
        tiny_gen("model: empty", &["--model", ""]).refused(2, &["--model", "an empty name"]),
        tiny_gen("model: unknown name", &["--model", "llama-70b"])
            .refused(2, &["--model", "\"llama-70b\", which is neither a known name nor a file", "gemma3-270m"]),
        tiny_gen("model: a directory without config.json", &["--model", &d])
            .refused(2, &["a directory without config.json"]),
        tiny_gen("model: /", &["--model", "/"]).refused(2, &["a directory without config.json"]),
        tiny_gen("model: missing .gguf", &["--model", "missing.gguf"]).refused(2, &["missing.gguf: nothing there"]),
        tiny_gen("model: zeros named .gguf", &["--model", &zeros_gguf]).refused(2, &["bytes 00 00 00 00"]),
        tiny_gen("model: a 1 TiB sparse .gguf", &["--model", &sparse]).refused(2, &["bytes 00 00 00 00"]),
        tiny_gen("model: GGUF magic only", &["--model", &magic_only]).refused(1, &[&magic_only]),
        tiny_gen("model: unknown GGUF version", &["--model", &bad_version]).refused(1, &[&bad_version]),
        tiny_gen("model: 2^63 tensors", &["--model", &huge_counts]).refused(1, &[&huge_counts]),
        tiny_gen("model: config.json not JSON", &["--model", &garbage_ckpt]).refused(1, &["config.json"]),
        tiny_gen("model: config.json 5000 deep", &["--model", &deep_ckpt]).refused(1, &["config.json"]),
        tiny_gen("model: zero attention heads", &["--model", &zero_heads]).refused(1, &["attention heads", "0 heads"]),
        tiny_gen("model: no safetensors", &["--model", &no_weights, "--prompt-ids", "1"])
            .refused(1, &["*.safetensors"]),
        tiny_gen("model: a 2^64 vocabulary", &["--model", &huge_vocab]).refused(1, &[]),
        tiny_gen("model: 2^61 layers", &["--model", &huge_layers])
            .refused(1, &["llama.block_count: expected at most 4096 layers, found 2305843009213693952"]),
        tiny_gen("model: a 2^62 width", &["--model", &huge_width]).refused(1, &["width: expected at most 131072"]),
        tiny_gen("model: a sliding window of 0", &["--model", &zero_window])
            .refused(1, &["sliding window: expected at least one position, found 0"]),
        tiny_gen("model: the FIFO", &["--model", &fifo]).refused(2, &["a FIFO"]),
        // Producers and their config.
        tiny_gen("producer: empty", &["--producer", ""])
            .refused(2, &["--producer: expected local, rngd, gpu, faulty, torch, py:MODULE:CLASS, a PATH.so or nixl://HOST:PORT/NAME"]),
        tiny_gen("producer: unknown", &["--producer", "tpu"]).refused(2, &["--producer", "\"tpu\""]),
        tiny_gen("producer: nixl URL without a port", &["--producer", "nixl://host/rngd"])
            .refused(2, &["--producer: expected nixl://HOST:PORT/NAME", "\"nixl://host/rngd\""]),
        // The default build has no NIXL: a remote producer and a node are refused in one line.
        tiny_gen("producer: nixl without the feature", &["--producer", "nixl://127.0.0.1:9/rngd"])
            .refused(2, &["--producer: expected a pdhost built with the nixl feature"]),
        case("producer-node without the feature", &["producer-node", "--backend", "rngd"])
            .refused(2, &["--backend: expected a pdhost built with the nixl feature"]),
        case("producer-node: unknown backend", &["producer-node", "--backend", "tpu"])
            .refused(2, &["--backend: expected rngd, gpu, faulty or a PATH.so, found \"tpu\""]),
        case("producer-node: negative timeout", &["producer-node", "--backend", "rngd", "--producer-timeout", "-1"])
            .refused(2, &["--producer-timeout"]),
        tiny_gen("producer: missing library", &["--producer", "/nonexistent/libx.so"])
            .refused(2, &["--producer: expected a backend library file, found /nonexistent/libx.so: nothing there"]),
        tiny_gen("producer: a directory", &["--producer", &format!("{d}/")]).refused(2, &["a directory"]),
        tiny_gen("producer: not a library", &["--producer", &not_a_lib]).refused(
            2,
            &["--producer: expected a backend library (an ELF shared object), found", "a file starting with \"not \""],
        ),
        tiny_gen("producer: a broken library, fail", &["--producer", &broken_lib, "--on-producer-failure", "fail"])
            .refused(1, &["remote prefill failed", "load failed"]),
        tiny_gen("producer: a broken library, fallback", &["--producer", &broken_lib]).never(&["panicked"]),
        // Nothing to prefill (one token), yet the producer that cannot start fails the request under `fail`.
        tiny_gen(
            "producer: a broken library, fail, a one-token prompt",
            &["--producer", &broken_lib, "--on-producer-failure", "fail", "--prompt-ids", "2"],
        )
        .refused(1, &["remote prefill failed"]),
        // The keys the host gives every backend are checked up front, not left to fail its start.
        tiny_gen("producer: a number for the config's dtype", &["--producer", "rngd", "--backend-config", r#"{"dtype":5}"#])
            .refused(2, &[r#"--backend-config: expected "dtype" one of f32, bf16, f16, found "dtype": 5"#]),
        case("check-backend: unknown backend", &["check-backend", "tpu"]).refused(
            2,
            &["BACKEND: expected a backend (rngd, gpu, faulty, torch, py:MODULE:CLASS, a PATH.so or nixl://HOST:PORT/NAME), found \"tpu\""],
        ),
        case("check-backend: local", &["check-backend", "local"]).refused(2, &["BACKEND: expected a backend", "found \"local\""]),
        tiny_gen("producer: bad dtype in config", &["--producer", "rngd", "--backend-config", r#"{"dtype":"f64"}"#])
            .refused(2, &[r#"found "dtype": "f64""#]),
        tiny_gen("producer: bad precision in config", &["--producer", "gpu", "--backend-config", r#"{"precision":1}"#])
            .refused(2, &[r#"--backend-config: expected "precision" one of exact, fast, found "precision": 1"#]),
        tiny_gen(
            "producer: bad model in config, falls back",
            &["--producer", "gpu", "--backend-config", r#"{"model":"/nonexistent"}"#],
        ),
        tiny_gen("backend-config: empty", &["--producer", "rngd", "--backend-config", ""])
            .refused(2, &["--backend-config: expected a JSON object, found invalid JSON"]),
        tiny_gen("backend-config: null", &["--producer", "rngd", "--backend-config", "null"])
            .refused(2, &["found null"]),
        tiny_gen("backend-config: an array", &["--producer", "rngd", "--backend-config", "[]"])
            .refused(2, &["found an array"]),
        tiny_gen("backend-config: a string", &["--producer", "rngd", "--backend-config", "\"x\""])
            .refused(2, &["found a string"]),
        tiny_gen("backend-config: unterminated", &["--producer", "rngd", "--backend-config", "{"])
            .refused(2, &["invalid JSON"]),
        tiny_gen(
            "backend-config: 70 KB",
            &["--producer", "rngd", "--backend-config", &format!("{{\"a\":\"{}\"}}", "x".repeat(70_000))],
        )
        .refused(2, &["at most 64 KiB"]),
        tiny_gen(
            "backend-config: 17 deep",
            &["--producer", "rngd", "--backend-config", &format!("{{\"a\":{}1{}}}", "[".repeat(16), "]".repeat(16))],
        )
        .refused(2, &["nesting 17 deep"]),
        tiny_gen("backend-config: threads -1", &["--producer", "rngd", "--backend-config", r#"{"threads":-1}"#])
            .refused(2, &["\"threads\": -1"]),
        tiny_gen("backend-config: threads 1.5", &["--producer", "rngd", "--backend-config", r#"{"threads":1.5}"#])
            .refused(2, &["\"threads\": 1.5"]),
        tiny_gen(
            "backend-config: threads as a string",
            &["--producer", "rngd", "--backend-config", r#"{"threads":"2"}"#],
        )
        .refused(2, &["\"threads\""]),
        tiny_gen(
            "backend-config: strings with brackets are not depth",
            &["--producer", "rngd", "--backend-config", &format!("{{\"a\":\"{}\"}}", "[".repeat(100))],
        ),
        tiny_gen(
            "backend-config: unknown fault",
            &["--producer", "faulty", "--on-producer-failure", "fail", "--backend-config", r#"{"fault":"nope"}"#],
        )
        .refused(1, &["remote prefill failed"]),
        // Enums.
        tiny_gen("kv-dtype f64", &["--kv-dtype", "f64"]).refused(2, &["--kv-dtype", "f64"]),
        tiny_gen("kv-dtype upper case", &["--kv-dtype", "BF16"]).refused(2, &["--kv-dtype"]),
        tiny_gen("precision turbo", &["--precision", "turbo"]).refused(2, &["--precision"]),
        tiny_gen("on-producer-failure maybe", &["--on-producer-failure", "maybe"])
            .refused(2, &["--on-producer-failure"]),
        case("bench pd producer local", &["bench", "pd", "--producer", "local"]).refused(2, &["--producer"]),
        // Commands.
        case("no command shows the help", &[]).help(),
        case("unknown command", &["serve-all"]).refused(2, &["serve-all"]),
        case("unknown flag", &["generate", "--prompt", "x", "--frobnicate"]).refused(2, &["--frobnicate"]),
        case("models without an action shows its help", &["models"]).help(),
        case("models fetch unknown", &["models", "fetch", "nope"]).refused(2, &["unknown model \"nope\""]),
        case("models fetch empty", &["models", "fetch", ""]).refused(2, &["unknown model"]),
        case("models verify unknown", &["models", "verify", "nope"]).refused(2, &["nope"]),
        case("backends without an action shows its help", &["backends"]).help(),
        case("backends fetch unknown", &["backends", "fetch", "tensorflow"])
            .refused(2, &["backend: expected torch", "found \"tensorflow\""]),
        case("backends list", &["backends", "list", "--json"]).prints(&["\"name\":\"torch\""]),
        case("check-backend skip unknown", &["check-backend", "rngd", "--skip", "spans"]).refused(2, &["--skip"]),
        case("help with a closed stdout", &["--help"]).io(Io::ClosedStdout),
        case("generate help with a closed stdout", &["generate", "--help"]).io(Io::ClosedStdout),
        case("version", &["--version"]).prints(&["pdhost"]),
        case("models list --json closed stdout", &["models", "list", "--json"]).io(Io::ClosedStdout),
        // inspect-span on files of every kind.
        case("inspect: a directory", &["inspect-span", &d]).refused(2, &["expected a regular file, found a directory"]),
        case("inspect: a FIFO", &["inspect-span", &fifo]).refused(2, &["a FIFO"]),
        case("inspect: a device", &["inspect-span", "/dev/zero"]).refused(2, &["a device"]),
        case("inspect: a symlink loop", &["inspect-span", &looped]).refused(2, &[]),
        case("inspect: missing", &["inspect-span", "/nonexistent.span"]).refused(2, &["/nonexistent.span"]),
        case("inspect: empty", &["inspect-span", &empty_span]).verdict_on_stdout().refused(1, &["rejected"]),
        case("inspect: one byte", &["inspect-span", &one_byte_span]).verdict_on_stdout().refused(1, &["rejected"]),
        case("inspect: a 1 TiB sparse file", &["inspect-span", &sparse_span])
            .verdict_on_stdout()
            .refused(1, &["rejected"]),
        case("inspect: /proc/self/maps", &["inspect-span", "/proc/self/maps"])
            .verdict_on_stdout()
            .refused(1, &["rejected"]),
        case("inspect: --json on /proc/self/status", &["inspect-span", "--json", "/proc/self/status"])
            .verdict_on_stdout()
            .refused(1, &["\"rejected\""]),
        // Odd environments.
        tiny_gen("PDHOST_HOME is a file", &[]).env("PDHOST_HOME", &latin1),
        case("models list with PDHOST_HOME a file", &["models", "list"]).env("PDHOST_HOME", &latin1),
        case("fetch into a PDHOST_HOME that is a file", &["models", "fetch", "smollm2-135m"])
            .env("PDHOST_HOME", &latin1)
            .refused(1, &["Not a directory"]),
        tiny_gen("no HOME", &[]).env("HOME", ""),
    ];
    cases.extend(more);
    assert!(cases.len() >= 150, "{} cases", cases.len());
    let n = cases.len();
    let failures = check_all(&cases);
    assert_clean(failures, n);
}

/// The model cache: a file corrupted mid-way (its sidecar intact) is refused before use and reported by
/// `models list` and `models verify`; an interrupted fetch's scratch directory is cleaned up by the next
/// fetch; `models fetch` replaces a corrupt file.
#[test]
fn a_corrupt_cache_is_caught_and_an_interrupted_fetch_leaves_nothing() {
    let _one = exclusive();
    let real = fetched("smollm2-135m");
    let home = tempfile::tempdir().unwrap();
    let models = home.path().join("models");
    std::fs::create_dir_all(&models).unwrap();
    let file = models.join(real.file_name().unwrap());
    std::fs::copy(&real, &file).unwrap();
    let sidecar = |p: &Path| PathBuf::from(format!("{}.sha256", p.display()));
    std::fs::copy(sidecar(&real), sidecar(&file)).unwrap();
    let h = home.path().display().to_string();
    let in_home = |c: Case| c.env("PDHOST_HOME", &h);

    // Intact first: every command agrees.
    let intact = vec![
        in_home(case("verify intact", &["models", "verify"])).prints(&["intact"]),
        in_home(case("list intact", &["models", "list"])).prints(&["yes"]),
    ];
    let mut failures = check_all(&intact);

    // One byte flipped in the middle, size and sidecar unchanged.
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    std::fs::write(&file, &bytes).unwrap();
    drop(bytes);
    // An interrupted fetch's scratch directory, owned by a process that is gone.
    let mut child = Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let scratch = models.join(format!(".fetch-smollm2-135m-{dead}"));
    std::fs::create_dir_all(scratch.join("wheels-0")).unwrap();
    std::fs::write(scratch.join("wheels-0/partial.whl"), vec![0u8; 1 << 20]).unwrap();

    let corrupt = vec![
        in_home(case("list says corrupt", &["models", "list"])).prints(&["corrupt"]),
        in_home(case("verify fails", &["models", "verify"])).refused(1, &["corrupt"]).prints(&["corrupt"]),
        in_home(case("generate refuses a corrupt model", &["generate", "--model", "smollm2-135m", "--prompt", "Hi"]))
            .refused(1, &["corrupt", "pdhost models fetch smollm2-135m"]),
    ];
    failures.extend(check_all(&corrupt));
    assert!(!scratch.exists(), "the interrupted fetch's scratch directory is still there");
    assert_clean(failures, intact.len() + corrupt.len());
}

/// Ctrl-C in the middle of a real `models fetch` (SIGINT to its whole process group, as a terminal sends
/// it, so pip stops too): the next command that looks at the cache removes the scratch directory, and no
/// partial model is ever taken for a cached one.
#[test]
fn an_interrupted_fetch_leaves_nothing_behind() {
    let _one = exclusive();
    let home = tempfile::tempdir().unwrap();
    let models = home.path().join("models");
    let mut fetch = Command::new(PDHOST)
        .args(["models", "fetch", "smollm2-135m"])
        .env("PDHOST_HOME", home.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    let scratch = || -> Vec<PathBuf> {
        std::fs::read_dir(&models)
            .map(|d| {
                d.filter_map(Result::ok)
                    .map(|e| e.path())
                    .filter(|p| p.to_string_lossy().contains("/.fetch-"))
                    .collect()
            })
            .unwrap_or_default()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while scratch().is_empty() && fetch.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "no scratch directory appeared");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Let pip get going, then interrupt the whole group.
    std::thread::sleep(Duration::from_millis(300));
    let group = i32::try_from(fetch.id()).unwrap();
    // SAFETY: sends a signal to the process group this test just created; no memory is involved.
    unsafe { libc::kill(-group, libc::SIGINT) };
    let status = fetch.wait().unwrap();
    assert!(status.code().is_none_or(|c| [0, 1, 130].contains(&c)), "{status:?}");
    let list =
        Command::new(PDHOST).args(["models", "list", "--json"]).env("PDHOST_HOME", home.path()).output().unwrap();
    assert!(list.status.success(), "{list:?}");
    let v: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    let state = v["models"].as_array().unwrap().iter().find(|m| m["name"] == "smollm2-135m").unwrap()["state"].clone();
    // A fetch that the signal stopped has left no model; only one that finished first (exit 0) has.
    let want = if status.success() { "intact" } else { "missing" };
    assert_eq!(state, want, "after a fetch that ended with {status:?}: {v}");
    assert_eq!(scratch(), Vec::<PathBuf>::new(), "scratch left behind");
}
