//! The fault-injection backend. It computes a real prefill (dense or grouped, like `rngd` or `gpu`) and
//! then misbehaves as its configuration says:
//!
//! ```json
//! {"model": "...", "fault": "kill_mid", "layout": "grouped", "on_requests": [1], "delay_ms": 2000}
//! {"model": "...", "fault": "random", "seed": 7, "rate": 0.3}
//! {"model": "...", "call_limit": 4}
//! ```
//!
//! `fault` is one of [`MODES`] or `random` (a mode per request chosen by hashing `seed` and the request
//! id, so the choice survives producer restarts); `on_requests` limits the fault to those request ids
//! (default: every request); `layout` is `dense` (default) or `grouped`. Without `fault` it behaves.
//! `call_limit` makes it report (and enforce) a capability of that many tokens per prefill call.
//! `daemon_in_open: "PATH"` double-forks a daemon inside `open`, before any filter exists (as a vendor
//! SDK starting a helper would), and writes its pid to `PATH`. `sigio_in_open: true` does there what
//! the mode `sigio_host` does in `prefill`. `open_delay_ms: N` makes `open` take N ms more (a backend
//! slow to load its device). `forget_context: true` takes a request that starts past 0 with a context (a
//! prefix-cache hit) but attends to that context's tokens in reverse order: a span right in every way the
//! host can check, whose K/V are plausible and wrong (what `check-backend`'s `kv` check is for).
//!
//! Everything a misbehaving vendor library could do from inside the producer process is fair: crash in
//! three ways at three points, panic, leave a region unwritten or half-written, try what the sandbox
//! forbids (fork a daemon, signal the host directly or through its control socket, exec, connect, open
//! a file), eat memory or ask for far too
//! much at once, stall, exit cleanly mid-request, emit spans whose manifest lies about layers, groups,
//! shapes, dtype, tokens or model, emit frames whose header lies about lengths and ring coordinates or
//! changes after commit, attack the host's segments, and write garbage on the control socket.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pdhost_backend_kit::{bad_config, config_key, ModelBackend};
use pdhost_plugin_abi::{
    Backend, BackendError, Capabilities, Description, PdhostLayout, PdhostStatus, Prefill, Writer,
};
use shm_format::{
    seal_frame, write_prefix, Dtype, Entry, EntryKind, FrameCoords, Group, GroupKind, Layout, CHECKSUM_OFFSET,
};

/// Every fault mode, by name.
pub const MODES: &[&str] = &[
    "kill_before",
    "kill_mid",
    "kill_after",
    "abort_before",
    "abort_mid",
    "abort_after",
    "segv_before",
    "segv_mid",
    "segv_after",
    "hang",
    "slow",
    "exit_mid",
    "panic",
    "fork_daemon",
    "signal_host",
    "sigio_host",
    "exec",
    "connect",
    "open_file",
    "eat_memory",
    "huge_alloc",
    "skip_region",
    "short_write",
    "wrong_layer_count",
    "missing_group",
    "extra_group",
    "duplicated_layer",
    "wrong_shape",
    "wrong_dtype",
    "wrong_token_range",
    "short_span",
    "wrong_fingerprint",
    "truncated_payload",
    "bad_checksum",
    "stale_generation",
    "replayed_sequence",
    "double_fetch",
    "oversize_lengths",
    "write_outside_slot",
    "attack_segments",
    "garbage_reply",
    "oversize_reply",
    "dribble_reply",
];

/// When a crash happens relative to writing the regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum When {
    Before,
    Mid,
    After,
}

/// The backend instance.
#[derive(Debug)]
pub struct Faulty {
    inner: ModelBackend,
    fault: Option<String>,
    on_requests: Option<Vec<u64>>,
    seed: u64,
    rate: f64,
    delay: Duration,
    /// The capability `max_tokens` it reports (`call_limit`; 0: none), and enforces.
    call_limit: u64,
    /// The thread that rewrites the last `double_fetch` frame's header, while it may still run.
    toggler: Option<Toggler>,
    /// `forget_context`: a context call attends to the wrong past.
    forget_context: bool,
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The mode `random` picks for a request, if any: a pure function of the seed and the request id.
pub fn random_mode(seed: u64, rate: f64, request_id: u64) -> Option<&'static str> {
    let h = splitmix(seed ^ splitmix(request_id));
    let pick = (h >> 11) as f64 / (1u64 << 53) as f64;
    (pick < rate).then(|| MODES[(splitmix(h) % MODES.len() as u64) as usize])
}

impl Faulty {
    fn mode_for(&self, request_id: u64) -> Option<&str> {
        if self.on_requests.as_ref().is_some_and(|ids| !ids.contains(&request_id)) {
            return None;
        }
        match self.fault.as_deref() {
            Some("random") => random_mode(self.seed, self.rate, request_id),
            other => other,
        }
    }
}

impl Backend for Faulty {
    fn open(config: &str) -> Result<Self, BackendError> {
        let json: serde_json::Value =
            serde_json::from_str(config).map_err(|e| bad_config(format!("config: expected JSON, found {e}")))?;
        // Each key of its own read with its type, or refused naming it: a fault test whose fault was
        // silently off could not fail.
        let str_key = |key| config_key(&json, key, "a string", |v| v.as_str());
        let layout = match str_key("layout")? {
            None | Some("dense") => PdhostLayout::Dense,
            Some("grouped") => PdhostLayout::Grouped,
            Some(other) => {
                return Err(bad_config(format!("config layout: expected dense or grouped, found {other:?}")))
            }
        };
        let fault = str_key("fault")?.map(str::to_string);
        if let Some(f) = &fault {
            if f != "random" && !MODES.contains(&f.as_str()) {
                return Err(bad_config(format!(
                    "config fault: expected random or one of {}, found {f:?}",
                    MODES.join(", ")
                )));
            }
        }
        let on_requests = config_key(&json, "on_requests", "an array of request ids", |v| {
            v.as_array()?.iter().map(serde_json::Value::as_u64).collect::<Option<Vec<u64>>>()
        })?;
        let seed = config_key(&json, "seed", "an integer from 0", serde_json::Value::as_u64)?.unwrap_or(0);
        let rate =
            config_key(&json, "rate", "a number from 0 to 1", |v| v.as_f64().filter(|r| (0.0..=1.0).contains(r)))?
                .unwrap_or(0.3);
        let delay_ms = config_key(&json, "delay_ms", "an integer from 0", serde_json::Value::as_u64)?.unwrap_or(2000);
        let call_limit = config_key(&json, "call_limit", "an integer from 0", serde_json::Value::as_u64)?.unwrap_or(0);
        let daemon_in_open = str_key("daemon_in_open")?;
        let sigio_in_open =
            config_key(&json, "sigio_in_open", "true or false", serde_json::Value::as_bool)?.unwrap_or(false);
        let open_delay_ms =
            config_key(&json, "open_delay_ms", "an integer from 0", serde_json::Value::as_u64)?.unwrap_or(0);
        let forget_context =
            config_key(&json, "forget_context", "true or false", serde_json::Value::as_bool)?.unwrap_or(false);
        let inner = ModelBackend::open(config, layout, Dtype::Bf16)?;
        std::thread::sleep(Duration::from_millis(open_delay_ms));
        if sigio_in_open {
            sigio_host();
        }
        if let Some(path) = daemon_in_open {
            let pid = fork_daemon();
            std::fs::write(path, pid.to_string())
                .map_err(|e| BackendError::new(PdhostStatus::BackendError, format!("daemon_in_open {path}: {e}")))?;
        }
        Ok(Faulty {
            inner,
            fault,
            on_requests,
            seed,
            rate,
            delay: Duration::from_millis(delay_ms),
            call_limit,
            toggler: None,
            forget_context,
        })
    }

    fn describe(&self) -> Description {
        self.inner.describe()
    }

    fn release(&mut self, request_id: u64) {
        self.inner.release(request_id)
    }

    /// Staged as `rngd` stages: every fault strikes in `prefill`, after its batch was computed.
    fn stage(&mut self, requests: &[Prefill<'_>]) -> Result<(), BackendError> {
        self.inner.stage(requests)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { max_tokens: self.call_limit, ..self.inner.capabilities() }
    }

    fn prefill(&mut self, request: &Prefill<'_>, writer: &mut Writer<'_>) -> Result<(), BackendError> {
        // A `double_fetch` fault targets one frame: its header is restored before any later frame is written.
        if let Some(toggler) = self.toggler.take() {
            toggler.stop();
        }
        if self.call_limit > 0 && request.tokens.len() as u64 > self.call_limit {
            return Err(BackendError::new(
                PdhostStatus::Unsupported,
                format!("expected at most {} tokens per call, found {}", self.call_limit, request.tokens.len()),
            ));
        }
        let reversed: Vec<u32>;
        let request = if self.forget_context && !request.context.is_empty() {
            reversed = request.context.iter().rev().copied().collect();
            &Prefill { context: &reversed, ..*request }
        } else {
            request
        };
        let Some(mode) = self.mode_for(request.request_id).map(str::to_string) else {
            return self.behave(request, writer);
        };
        let crash = |how: &str| -> Option<(fn() -> !, When)> {
            let die: fn() -> ! = match how.split('_').next()? {
                "kill" => die_kill,
                "abort" => die_abort,
                "segv" => die_segv,
                "exit" => die_exit0,
                _ => return None,
            };
            let when = match how.split('_').nth(1)? {
                "before" => When::Before,
                "mid" => When::Mid,
                "after" => When::After,
                _ => return None,
            };
            Some((die, when))
        };
        if let Some((die, when)) = crash(&mode) {
            if when == When::Before {
                die();
            }
            self.inner.compute(request)?;
            let manifest = self.inner.manifest(request);
            let half = manifest.entries.len() / 2;
            let limit = if when == When::Mid { Some(half.max(1)) } else { None };
            self.inner.write_regions(&manifest, writer, limit)?;
            if when == When::Mid {
                // Scribble into part of the next region, as a device DMA cut off halfway would.
                if let Ok(region) = writer.region(half as u32) {
                    let n = region.len() / 2;
                    region[..n].fill(0xAB);
                }
            }
            die();
        }
        match mode.as_str() {
            // Half the regions written, then a Rust panic: the ABI's guard reports `PANIC`, and the state
            // this instance is left in is anyone's guess.
            "panic" => {
                self.inner.compute(request)?;
                let manifest = self.inner.manifest(request);
                self.inner.write_regions(&manifest, writer, Some(manifest.entries.len() / 2))?;
                panic!("faulty: panic mode, request {}", request.request_id)
            }
            // OK returned with the last region never taken, or written only in its first half: the
            // producer finds the fill it put there and commits nothing.
            "skip_region" | "short_write" => {
                self.inner.compute(request)?;
                let manifest = self.inner.manifest(request);
                let last = manifest.entries.len() - 1;
                self.inner.write_regions(&manifest, writer, Some(last))?;
                if mode == "short_write" {
                    let e = &manifest.entries[last];
                    let payload = self.inner.payload(&manifest);
                    let half = (e.len / 2) as usize;
                    writer.region(last as u32)?[..half].copy_from_slice(&payload[e.offset as usize..][..half]);
                }
                Ok(())
            }
            // What a vendor library could try from inside `prefill`; the sandbox stops each.
            "fork_daemon" => {
                fork_daemon();
                self.behave(request, writer)
            }
            "signal_host" => {
                // SAFETY: plain system calls.
                unsafe { libc::kill(libc::getppid(), libc::SIGKILL) };
                self.behave(request, writer)
            }
            "sigio_host" => {
                sigio_host();
                self.behave(request, writer)
            }
            "exec" => {
                let program = c"/bin/true";
                let argv = [program.as_ptr(), std::ptr::null()];
                // SAFETY: a NUL-terminated path and a null-terminated argument vector.
                unsafe { libc::execv(program.as_ptr(), argv.as_ptr()) };
                self.behave(request, writer)
            }
            "connect" => {
                let _ = std::net::TcpStream::connect(("127.0.0.1", 9));
                self.behave(request, writer)
            }
            "open_file" => {
                let text = std::fs::read_to_string("/etc/hostname").map_err(|e| {
                    BackendError::new(PdhostStatus::BackendError, format!("faulty: reading /etc/hostname: {e}"))
                })?;
                std::hint::black_box(text);
                self.behave(request, writer)
            }
            "eat_memory" => {
                // Touch every page of 64 MiB blocks until an allocation fails, which aborts the process.
                let mut eaten: Vec<Vec<u8>> = Vec::new();
                loop {
                    let mut block = vec![0u8; 64 << 20];
                    block.iter_mut().step_by(4096).for_each(|b| *b = 1);
                    eaten.push(block);
                }
            }
            "huge_alloc" => {
                // One request far past any cap: refused at once with little resident, which aborts the
                // process after Rust's standard library says so on stderr.
                let huge: Vec<u8> = Vec::with_capacity(1 << 42);
                std::hint::black_box(&huge);
                self.behave(request, writer)
            }
            "hang" => loop {
                std::thread::sleep(Duration::from_secs(3600));
            },
            "slow" => {
                std::thread::sleep(self.delay);
                self.behave(request, writer)
            }
            "garbage_reply" | "oversize_reply" => {
                // Speak on the producer's control socket before it does: a message that does not decode,
                // or a length prefix far past what the host accepts.
                let message: &[u8] = if mode == "garbage_reply" {
                    &[4, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]
                } else {
                    &[0xff, 0xff, 0xff, 0x7f]
                };
                control_sockets().iter().for_each(|&fd| {
                    // SAFETY: writing a local buffer to a descriptor this process holds.
                    unsafe { libc::write(fd, message.as_ptr().cast(), message.len()) };
                });
                self.behave(request, writer)
            }
            "dribble_reply" => {
                // A reply that starts and never finishes in time: a length prefix, then a byte every
                // 100 ms (a per-read timeout alone would wait for all of it).
                let mut message = 64u32.to_le_bytes().to_vec();
                message.extend([0u8; 64]);
                for byte in message {
                    control_sockets().iter().for_each(|&fd| {
                        // SAFETY: writing a local byte to a descriptor this process holds.
                        unsafe { libc::write(fd, std::ptr::from_ref(&byte).cast(), 1) };
                    });
                    std::thread::sleep(Duration::from_millis(100));
                }
                self.behave(request, writer)
            }
            "attack_segments" => {
                let allowed = attack_segments();
                if !allowed.is_empty() {
                    eprintln!("faulty: the host's segments allowed: {}", allowed.join(", "));
                    std::process::abort();
                }
                self.behave(request, writer)
            }
            _ => self.malformed(&mode, request, writer),
        }
    }
}

impl Faulty {
    fn behave(&mut self, request: &Prefill<'_>, writer: &mut Writer<'_>) -> Result<(), BackendError> {
        self.inner.compute(request)?;
        self.inner.write_regions(&self.inner.manifest(request), writer, None)
    }

    /// Writes a whole frame that is wrong in the way `mode` names.
    fn malformed(&mut self, mode: &str, request: &Prefill<'_>, writer: &mut Writer<'_>) -> Result<(), BackendError> {
        // `short_span`: a well-formed span of all but the chunk's last token, as if it were never prefilled.
        let short;
        let request = match request.tokens {
            [head @ .., _] if mode == "short_span" && !head.is_empty() => {
                short = Prefill { tokens: head, ..*request };
                &short
            }
            _ => request,
        };
        self.inner.compute(request)?;
        let mut manifest = self.inner.manifest(request);
        let mut payload = self.inner.payload(&manifest);
        let frame = writer.frame()?;
        let mut coords = FrameCoords { epoch: frame.epoch, generation: frame.generation, sequence: frame.sequence };
        let mut declared_payload = None;
        let layers = self.inner.geometry().layers.len() as u32;
        match mode {
            "wrong_layer_count" => match &mut manifest.layout {
                // Four layers more than the model has, each with its K and V (26 sent to a 22-layer model).
                Layout::Dense { num_layers, .. } => {
                    let first_extra = *num_layers;
                    *num_layers += 4;
                    for layer in first_extra..first_extra + 4 {
                        push_layer(&mut manifest.entries, &mut payload, layer);
                    }
                }
                // The incident: every model layer sent as one group, into the receiver's sliding group.
                Layout::Grouped { groups } => {
                    let kind = groups[0].kind;
                    *groups = vec![Group { id: 0, kind, layers: (0..layers).collect() }];
                }
            },
            "missing_group" => {
                let gone: Vec<u32> = match &mut manifest.layout {
                    Layout::Dense { num_layers, .. } => {
                        *num_layers -= 1;
                        vec![*num_layers]
                    }
                    Layout::Grouped { groups } => groups.pop().map(|g| g.layers).unwrap_or_default(),
                };
                manifest.entries.retain(|e| !gone.contains(&e.layer));
            }
            "extra_group" | "duplicated_layer" => {
                // New entries with their own payload bytes: an extra layer past the model's, or layer 0 again.
                let layer = if mode == "extra_group" { layers } else { 0 };
                push_layer(&mut manifest.entries, &mut payload, layer);
                match &mut manifest.layout {
                    Layout::Dense { num_layers, .. } if mode == "extra_group" => *num_layers += 1,
                    Layout::Dense { .. } => {}
                    Layout::Grouped { groups } => {
                        let id = groups.len() as u32;
                        groups.push(Group { id, kind: GroupKind::Full, layers: vec![layer] });
                    }
                }
            }
            "wrong_shape" => {
                let e = &mut manifest.entries[0];
                e.shape = vec![e.shape[0], e.shape[1] * 2, e.shape[2] / 2];
            }
            "wrong_dtype" => manifest.dtype = if manifest.dtype == Dtype::F32 { Dtype::Bf16 } else { Dtype::F32 },
            "wrong_token_range" => {
                manifest.token_start += 1;
                manifest.token_end += 1;
            }
            "wrong_fingerprint" => manifest.fingerprint.0 ^= 1,
            "truncated_payload" => {
                payload.truncate(payload.len() / 2);
                declared_payload = Some(payload.len() as u64);
            }
            "stale_generation" => coords.generation = coords.generation.wrapping_sub(1),
            "replayed_sequence" => coords.sequence = coords.sequence.wrapping_sub(1),
            "oversize_lengths" => {
                // Offsets that overflow u64 when added to their length.
                let e = manifest.entries.last_mut().expect("entries");
                e.offset = u64::MAX - 7;
            }
            "write_outside_slot" => declared_payload = Some(frame.buf.len() as u64),
            "bad_checksum" | "double_fetch" | "short_span" => {}
            other => unreachable!("mode {other} is handled before"),
        }
        let declared = declared_payload.unwrap_or(payload.len() as u64);
        let info = write_prefix(frame.buf, &manifest.encode(), declared, coords)
            .map_err(|e| BackendError::new(PdhostStatus::BackendError, format!("faulty framing: {e}")))?;
        let start = info.payload_offset as usize;
        let room = frame.buf.len() - start;
        frame.buf[start..start + payload.len().min(room)].copy_from_slice(&payload[..payload.len().min(room)]);
        if info.frame_len as usize <= frame.buf.len() {
            seal_frame(&mut frame.buf[..info.frame_len as usize]);
        }
        match mode {
            "bad_checksum" => frame.buf[start] ^= 0x01,
            "double_fetch" => self.toggler = Some(Toggler::start(frame.buf.as_mut_ptr())),
            _ => {}
        }
        Ok(())
    }
}

/// Appends K and V entries for `layer`, shaped like the first entry, with their own payload bytes.
fn push_layer(entries: &mut Vec<Entry>, payload: &mut Vec<u8>, layer: u32) {
    let template = entries[0].clone();
    for kind in [EntryKind::K, EntryKind::V] {
        let offset = payload.len() as u64;
        payload.extend(std::iter::repeat_n(0x3Cu8, template.len as usize));
        entries.push(Entry { layer, kind, offset, ..template.clone() });
    }
}

/// A raw pointer that may cross to the thread that rewrites the header.
struct SlotPtr(*mut u8);
// SAFETY: the pointer is only used to write bytes of this process's own writable mapping, which stays
// mapped for the producer's life; racing with the host's reads is the point of this fault.
unsafe impl Send for SlotPtr {}

/// After the producer commits, flips the header's epoch field back and forth for up to 50 ms: a header
/// that changes under the host's feet after commit. [`Toggler::stop`] ends it and restores the byte; the
/// backend calls it before it writes another frame, so that only this frame is affected.
#[derive(Debug)]
struct Toggler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Toggler {
    fn start(frame: *mut u8) -> Toggler {
        const EPOCH: usize = 40; // producer_epoch, inside the checksummed header
        const _: () = assert!(EPOCH != CHECKSUM_OFFSET);
        let ptr = SlotPtr(frame);
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let ptr = ptr;
            // Volatile: the host reads these bytes while they change.
            // SAFETY: a byte of the slot's frame header, inside the writable mapping (see `SlotPtr`).
            let read = || unsafe { std::ptr::read_volatile(ptr.0.add(EPOCH)) };
            // SAFETY: as above.
            let write = |v: u8| unsafe { std::ptr::write_volatile(ptr.0.add(EPOCH), v) };
            let epoch = read();
            let until = std::time::Instant::now() + Duration::from_millis(50);
            while std::time::Instant::now() < until && !stopped.load(Ordering::Relaxed) {
                write(read() ^ 1);
                std::thread::yield_now();
            }
            write(epoch);
        });
        Toggler { stop, thread }
    }

    /// Ends the rewriting and waits until the header holds its committed epoch again.
    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("the header toggler does not panic");
    }
}

fn die_kill() -> ! {
    // SAFETY: signalling this process.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    unreachable!("SIGKILL cannot be caught")
}

fn die_abort() -> ! {
    std::process::abort()
}

/// A real segmentation fault: a store to a page mapped with no access.
fn die_segv() -> ! {
    // SAFETY: maps one inaccessible page and stores to it; the kernel delivers SIGSEGV, whose default
    // action (Rust's handler restores it for faults outside a stack guard) kills the process.
    unsafe {
        let p = libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
        assert_ne!(p, libc::MAP_FAILED);
        std::ptr::write_volatile(p.cast::<u8>(), 1);
    }
    std::process::abort()
}

fn die_exit0() -> ! {
    std::process::exit(0)
}

/// A double fork, as a daemon starts: the grandchild (`setsid`, then asleep for an hour) loses its
/// parent and would outlive the producer if nothing adopted it. Returns the grandchild's pid (0 when a
/// fork failed).
fn fork_daemon() -> i32 {
    let mut pipe = [0i32; 2];
    // SAFETY: fork in a process whose other threads hold no locks the children need; the children only
    // write a pid to a pipe, sleep or exit.
    unsafe {
        if libc::pipe(pipe.as_mut_ptr()) != 0 {
            return 0;
        }
        match libc::fork() {
            0 => {
                let grandchild = libc::fork();
                if grandchild == 0 {
                    libc::setsid();
                    libc::sleep(3600);
                    libc::_exit(0);
                }
                libc::write(pipe[1], (&raw const grandchild).cast(), 4);
                libc::_exit(0);
            }
            -1 => {
                libc::close(pipe[0]);
                libc::close(pipe[1]);
                0
            }
            child => {
                let mut grandchild = 0i32;
                let got = libc::read(pipe[0], (&raw mut grandchild).cast(), 4);
                libc::waitpid(child, std::ptr::null_mut(), 0);
                libc::close(pipe[0]);
                libc::close(pipe[1]);
                if got == 4 {
                    grandchild.max(0)
                } else {
                    0
                }
            }
        }
    }
}

/// This process's open descriptors and what each refers to, found without opening anything (the sandbox
/// refuses `open`, so `/proc/self/fd` cannot be listed): each number is probed and its link read.
fn open_fds() -> Vec<(i32, String)> {
    (0..4096)
        // SAFETY: F_GETFD on a descriptor number only reads its flags.
        .filter(|&fd| unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0)
        .filter_map(|fd| {
            let target = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
            Some((fd, target.to_string_lossy().into_owned()))
        })
        .collect()
}

/// Makes the host the owner of this process's control sockets, its stdout and stderr, and of a new open
/// file description of each pipe it holds (the doorbells, through `/proc/self/fd`), with `SIGKILL` for
/// their signal: the host's write to a socket, or its read of a pipe this process writes, would then kill
/// it (the kernel signals a descriptor's owner when the descriptor becomes ready). The new descriptions
/// stay open.
fn sigio_host() {
    /// Linux's `F_SETSIG` (x86-64 and arm64), which the `libc` crate does not export for glibc.
    const F_SETSIG: libc::c_int = 10;
    let mut fds = control_sockets();
    fds.extend([1, 2]);
    for (fd, target) in open_fds() {
        if target.starts_with("pipe:") {
            let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL");
            // SAFETY: open of a NUL-terminated path; the descriptor is kept (leaked) on purpose.
            let again = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
            if again >= 0 {
                fds.push(again);
            }
        }
    }
    for fd in fds {
        // SAFETY: fcntl with integer arguments on a descriptor this process holds.
        unsafe {
            libc::fcntl(fd, F_SETSIG, libc::SIGKILL);
            libc::fcntl(fd, libc::F_SETOWN, libc::getppid());
            libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_ASYNC);
        }
    }
}

/// Descriptors of this process that are Unix sockets: the producer's control socket.
fn control_sockets() -> Vec<i32> {
    open_fds().into_iter().filter(|(_, target)| target.starts_with("socket:")).map(|(fd, _)| fd).collect()
}

/// Tries to resize or write the host's control segment and to resize the data segment, through every
/// route a process holding the descriptors has. Returns the attempts that succeeded (none, if the host
/// sealed its segments properly).
fn attack_segments() -> Vec<String> {
    let mut allowed = Vec::new();
    for (fd, target) in open_fds() {
        let control = target.starts_with("/memfd:") && target.contains(".control");
        let data = target.starts_with("/memfd:") && target.contains(".data");
        if !control && !data {
            continue;
        }
        let mut try_it = |name: &str, ok: bool| {
            if ok {
                allowed.push(format!("{target} {name}"));
            }
        };
        // SAFETY: system calls on a descriptor this process holds, with pointers to live locals; every
        // mapping made is unmapped.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            libc::fstat(fd, &mut st);
            let len = st.st_size;
            try_it("shrink", libc::ftruncate(fd, 0) == 0);
            try_it("grow", libc::ftruncate(fd, len * 2) == 0);
            try_it("fallocate", libc::fallocate(fd, 0, len, 4096) == 0);
            try_it("add-seal", libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_WRITE) == 0);
            // A hole punched in a slot's last page (no frame of this test reaches it), through the
            // descriptor and through a mapping: the host's read of it would allocate again.
            let hole = len - 4096;
            let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            try_it("punch-hole", libc::fallocate(fd, punch, hole, 4096) == 0);
            if data {
                let rw = libc::PROT_READ | libc::PROT_WRITE;
                let p = libc::mmap(std::ptr::null_mut(), len as usize, rw, libc::MAP_SHARED, fd, 0);
                if p != libc::MAP_FAILED {
                    let page = p.cast::<u8>().add(hole as usize).cast();
                    try_it("madvise-remove", libc::madvise(page, 4096, libc::MADV_REMOVE) == 0);
                    libc::munmap(p, len as usize);
                }
            }
            if control {
                try_it("pwrite", libc::pwrite(fd, b"x".as_ptr().cast(), 1, 64) == 1);
                let rw = libc::PROT_READ | libc::PROT_WRITE;
                let p = libc::mmap(std::ptr::null_mut(), len as usize, rw, libc::MAP_SHARED, fd, 0);
                try_it("mmap-shared-rw", p != libc::MAP_FAILED);
                if p != libc::MAP_FAILED {
                    libc::munmap(p, len as usize);
                }
                let p = libc::mmap(std::ptr::null_mut(), len as usize, libc::PROT_READ, libc::MAP_SHARED, fd, 0);
                if p != libc::MAP_FAILED {
                    try_it("mprotect-rw", libc::mprotect(p, len as usize, rw) == 0);
                    libc::munmap(p, len as usize);
                }
            }
        }
    }
    allowed
}

pdhost_plugin_abi::export_backend!(Faulty, c"faulty");

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(config: &str) -> String {
        match Faulty::open(config) {
            Ok(_) => panic!("{config} was taken"),
            Err(e) => e.message,
        }
    }

    #[test]
    fn each_key_of_its_own_is_read_with_its_type_or_refused_before_the_model_loads() {
        for (config, says) in [
            (r#"{"delay_ms":"2000"}"#, r#"config delay_ms: expected an integer from 0, found "2000""#),
            (r#"{"rate":2}"#, "config rate: expected a number from 0 to 1, found 2"),
            (r#"{"seed":-1}"#, "config seed: expected an integer from 0, found -1"),
            (r#"{"call_limit":1.5}"#, "config call_limit: expected an integer from 0, found 1.5"),
            (r#"{"on_requests":[1,"2"]}"#, r#"config on_requests: expected an array of request ids, found [1,"2"]"#),
            (r#"{"on_requests":1}"#, "config on_requests: expected an array of request ids, found 1"),
            (r#"{"fault":5}"#, "config fault: expected a string, found 5"),
            (r#"{"fault":"nope"}"#, r#"config fault: expected random or one of"#),
            (r#"{"layout":"sideways"}"#, r#"config layout: expected dense or grouped, found "sideways""#),
        ] {
            let config = format!(r#"{{"model":"/nonexistent",{}"#, &config[1..]);
            let message = refused(&config);
            assert!(message.contains(says), "{config}: {message}");
        }
        // Every key well typed: the next thing to fail is the missing model.
        let config = r#"{"model":"/nonexistent","fault":"random","seed":7,"rate":0.5,"delay_ms":10,"call_limit":4,
                         "on_requests":[1,2],"layout":"grouped"}"#;
        assert!(refused(config).contains("/nonexistent"), "{}", refused(config));
    }
}
