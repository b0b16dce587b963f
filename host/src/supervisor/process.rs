//! The operating-system side of a producer process: its handle and pidfd, the wait on its socket and
//! pidfd, its exit (signal names, peak memory), the threads that log its output, the descriptors and
//! configuration it is started with, and the host's own hardening.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pdhost_producer::protocol::Described;
use rustix::event::{PollFd, PollFlags};
use shm_format::{KvGeometry, LayerKv};
use shm_ring::HostRing;

/// A started producer.
#[derive(Debug)]
pub(super) struct Running {
    pub(super) child: Child,
    pub(super) pidfd: OwnedFd,
    pub(super) ring: HostRing,
    pub(super) socket: UnixStream,
    pub(super) described: Described,
    /// Requests this process was asked to prefill and not yet told are over.
    pub(super) open_requests: std::collections::HashSet<u64>,
    /// Calls sent whose replies are still to come, oldest first.
    pub(super) awaiting: VecDeque<super::Awaited>,
    /// Disconnects when the threads logging the process's stdout and stderr are done.
    pub(super) logging: crossbeam_channel::Receiver<()>,
    /// The last lines of its stderr.
    pub(super) last_lines: LastLines,
}

/// The last [`LastLines::KEEP`] lines a producer wrote to stderr, kept by its logging thread.
#[derive(Clone, Debug, Default)]
pub(super) struct LastLines(Arc<Mutex<VecDeque<String>>>);

impl LastLines {
    const KEEP: usize = 8;

    fn push(&self, line: &str) {
        let mut lines = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if lines.len() == Self::KEEP {
            lines.pop_front();
        }
        lines.push_back(line.to_string());
    }

    /// The last line that says an allocation failed, as the standard libraries of Rust (`memory
    /// allocation of N bytes failed`), C++ (`std::bad_alloc`) and Python (`MemoryError`) say it when
    /// `RLIMIT_DATA` refuses memory. A C backend that dereferences the null `malloc` gave it says nothing.
    pub(super) fn allocation_failure(&self) -> Option<String> {
        let lines = self.0.lock().unwrap_or_else(|p| p.into_inner());
        lines
            .iter()
            .rev()
            .find(|l| {
                (l.contains("memory allocation of") && l.contains("failed"))
                    || l.contains("std::bad_alloc")
                    || l.contains("MemoryError")
            })
            .cloned()
    }
}

/// Makes this process non-dumpable: no core dumps of host memory, and no ptrace attach or
/// `/proc/<pid>/mem` reads by other processes of the same user (producers included). The setting is read
/// back: a host that could not harden itself says so rather than run exposed.
pub fn harden_host() -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    match unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) } {
        0 => Ok(()),
        -1 => Err(std::io::Error::last_os_error()),
        found => Err(std::io::Error::other(format!("PR_GET_DUMPABLE: expected 0 after setting it, found {found}"))),
    }
}

/// The peak resident memory of the exited (not yet reaped) process behind `pidfd`, in bytes: `waitid` with
/// `WNOWAIT` reports its resource usage and leaves it for the reap.
pub(super) fn peak_memory(pidfd: BorrowedFd<'_>) -> Option<u64> {
    // SAFETY: both out-structs are zeroed plain C structs that the kernel fills; `pidfd` is a live pidfd.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let mut usage: libc::rusage = std::mem::zeroed();
        let flags = libc::WEXITED | libc::WNOWAIT | libc::WNOHANG;
        let r = libc::syscall(libc::SYS_waitid, libc::P_PIDFD, pidfd.as_raw_fd(), &mut info, flags, &mut usage);
        (r == 0 && info.si_pid() != 0).then(|| usage.ru_maxrss as u64 * 1024)
    }
}

pub(super) fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGKILL => "SIGKILL".into(),
        libc::SIGABRT => "SIGABRT".into(),
        libc::SIGSEGV => "SIGSEGV".into(),
        libc::SIGBUS => "SIGBUS".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGILL => "SIGILL".into(),
        libc::SIGFPE => "SIGFPE".into(),
        libc::SIGSYS => "SIGSYS".into(),
        other => format!("signal {other}"),
    }
}

/// What woke a wait on the control socket.
pub(super) enum Ready {
    Socket,
    Exited,
    TimedOut,
}

pub(super) fn wait_readable(
    socket: BorrowedFd<'_>,
    pidfd: BorrowedFd<'_>,
    deadline: Instant,
) -> std::io::Result<Ready> {
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Ok(Ready::TimedOut);
        }
        let left = deadline - now;
        let ts = rustix::event::Timespec { tv_sec: left.as_secs() as i64, tv_nsec: i64::from(left.subsec_nanos()) };
        let mut fds = [PollFd::from_borrowed_fd(socket, PollFlags::IN), PollFd::from_borrowed_fd(pidfd, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&ts)) {
            Ok(0) => continue,
            Ok(_) if !fds[0].revents().is_empty() => return Ok(Ready::Socket),
            Ok(_) => return Ok(Ready::Exited),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// The backend's configuration: what the host knows of the model's shape (`num_layers`, `layers`,
/// `kv_heads`, `head_dim`, `window`, `layer_shapes`, `max_tokens`; `docs/plugin-abi.md` lists them with
/// their types), then the user's keys, which override the host's. A config that is not a JSON object is
/// passed as it is, for the backend to refuse.
pub(super) fn config_with_shape(
    config: &str,
    geometry: &KvGeometry,
    max_tokens: u64,
    rope: Option<(f64, f64)>,
) -> String {
    let Ok(serde_json::Value::Object(user)) = serde_json::from_str::<serde_json::Value>(config) else {
        return config.to_string();
    };
    let letter = |l: &LayerKv| match l {
        LayerKv::Full { .. } => 'F',
        LayerKv::Sliding { .. } => 'S',
        LayerKv::Recurrent { .. } => 'R',
    };
    // Arrays, not objects: a minimal flat-JSON parser looking for `"window"` must not find a layer's.
    let shape = |l: &LayerKv| match *l {
        LayerKv::Full { kv_heads, head_dim } => serde_json::json!(["full", kv_heads, head_dim]),
        LayerKv::Sliding { window, kv_heads, head_dim } => serde_json::json!(["sliding", kv_heads, head_dim, window]),
        LayerKv::Recurrent { state_elems } => serde_json::json!(["recurrent", state_elems]),
    };
    let mut out = serde_json::json!({
        "num_layers": geometry.layers.len(),
        "layers": geometry.layers.iter().map(letter).collect::<String>(),
        "layer_shapes": geometry.layers.iter().map(shape).collect::<Vec<_>>(),
        "max_tokens": max_tokens,
    });
    let host = out.as_object_mut().expect("an object");
    if let Some((global, local)) = rope {
        host.insert("rope_theta".into(), global.into());
        host.insert("rope_local_theta".into(), local.into());
    }
    if let Some((kv_heads, head_dim)) = geometry.uniform_heads() {
        host.insert("kv_heads".into(), kv_heads.into());
        host.insert("head_dim".into(), head_dim.into());
    }
    let windows: std::collections::BTreeSet<u32> = geometry
        .layers
        .iter()
        .filter_map(|l| if let LayerKv::Sliding { window, .. } = l { Some(*window) } else { None })
        .collect();
    if let [window] = windows.iter().collect::<Vec<_>>()[..] {
        host.insert("window".into(), (*window).into());
    }
    host.extend(user);
    out.to_string()
}

/// Reads a producer's stdout and stderr on two threads until the process closes them, logging each line
/// tagged with the producer and its pid. A line longer than 4 KiB is cut there. The receiver disconnects
/// once both threads are done.
pub(super) fn log_output(
    name: &str,
    pid: u32,
    stdout: Option<std::process::ChildStdout>,
    stderr: Option<std::process::ChildStderr>,
) -> (crossbeam_channel::Receiver<()>, LastLines) {
    let (done, logging) = crossbeam_channel::bounded::<()>(0);
    let last_lines = LastLines::default();
    let pump = |stream: &'static str, from: Box<dyn std::io::Read + Send>| {
        let (name, done, last_lines) = (name.to_string(), done.clone(), last_lines.clone());
        let spawned = std::thread::Builder::new().name(format!("{name}-{stream}")).spawn(move || {
            let _done = done;
            use std::io::{BufRead, Read};
            let mut reader = std::io::BufReader::new(from);
            let mut line = Vec::new();
            loop {
                line.clear();
                match Read::take(&mut reader, 4096).read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {
                        let text = String::from_utf8_lossy(&line);
                        // Control characters escaped: a carriage return or an escape sequence from a
                        // backend cannot rewrite the host's log lines on a terminal.
                        let text = visible(text.trim_end());
                        let text = text.as_ref();
                        if stream == "stderr" && !text.is_empty() {
                            last_lines.push(text);
                        }
                        // A backend's stderr is its diagnostics: shown by default. Its stdout only at
                        // the info level (a server's default).
                        // A line from the logging callback carries its level (`@pdhost:info text`).
                        let tagged = text.strip_prefix(pdhost_producer::LOG_TAG).and_then(|t| t.split_once(' '));
                        match (text.is_empty(), stream, tagged) {
                            (true, ..) => {}
                            (false, "stderr", Some(("error", t))) => tracing::error!(producer = %name, pid, "{t}"),
                            (false, "stderr", Some(("warn", t))) => tracing::warn!(producer = %name, pid, "{t}"),
                            (false, "stderr", Some(("info", t))) => tracing::info!(producer = %name, pid, "{t}"),
                            (false, "stderr", Some(("debug", t))) => tracing::debug!(producer = %name, pid, "{t}"),
                            (false, "stderr", _) => tracing::warn!(producer = %name, pid, stream, "{text}"),
                            (false, ..) => tracing::info!(producer = %name, pid, stream, "{text}"),
                        }
                    }
                }
            }
        });
        // Without the thread the pipe fills and the producer blocks on a write: then it times out and
        // is restarted, which is the supervisor's ordinary path.
        drop(spawned);
    };
    if let Some(out) = stdout {
        pump("stdout", Box::new(out));
    }
    if let Some(err) = stderr {
        pump("stderr", Box::new(err));
    }
    (logging, last_lines)
}

/// Inheritable duplicates of the descriptors a producer needs, to be dropped in the host right after the
/// spawn. The originals stay close-on-exec.
///
/// Descriptors travel by number (`--fds`) instead of being moved into place by a `pre_exec` closure: with
/// no closure, `Command::spawn` uses `posix_spawn` (`clone(CLONE_VM | CLONE_VFORK)`) instead of `fork`. A
/// fork of the host would copy the page tables of its gigabyte of weights and write-protect its KV pools,
/// so that the first span after every (re)start took a minor fault per page it landed in (5,089 faults,
/// 6.7 ms instead of 1.3 ms, for a 744-token Gemma 3 270M span). The cost: a child that another thread
/// spawns while the duplicates exist inherits them too. Producers are (re)started by one thread each
/// (`--producers N`), so the duplicates hold a lock that serialises producer spawns; and a producer closes
/// every descriptor it was not given before any backend code runs ([`pdhost_producer::adopt_fds`]).
pub(super) fn inheritable(fds: [BorrowedFd<'_>; 5]) -> std::io::Result<Inheritable> {
    static SPAWNING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let serial = SPAWNING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    // `dup` gives a new descriptor without FD_CLOEXEC.
    let fds = fds.iter().map(|fd| rustix::io::dup(fd).map_err(std::io::Error::from)).collect::<Result<_, _>>()?;
    Ok(Inheritable { fds, _serial: serial })
}

/// [`inheritable`]'s duplicates, and the lock that keeps other producer spawns out until they are gone.
pub(super) struct Inheritable {
    /// The duplicates, in `--fds` order (dropped before the lock: fields drop in order).
    pub(super) fds: Vec<OwnedFd>,
    _serial: std::sync::MutexGuard<'static, ()>,
}

/// `text` with its control characters but tab escaped (`\r` as `\u{d}`), as a line of the host's log.
fn visible(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(|c| c.is_control() && c != '\t') {
        return text.into();
    }
    text.chars()
        .map(|c| if c.is_control() && c != '\t' { c.escape_unicode().to_string() } else { c.to_string() })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_backends_control_characters_are_escaped() {
        assert_eq!(super::visible("50%\rdone \x1b[2K\tok"), "50%\\u{d}done \\u{1b}[2K\tok");
        assert!(matches!(super::visible("plain\ttext"), std::borrow::Cow::Borrowed("plain\ttext")));
    }
}
