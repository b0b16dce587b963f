//! The producer: one process per vendor backend.
//!
//! It loads exactly one backend library (`RTLD_NOW | RTLD_LOCAL`), opens and describes it, maps the ring
//! the host created (the descriptors named by `--fds`), and then serves prefill requests from the
//! control socket: for each, it reserves a ring slot, writes the frame header and manifest, lets the
//! backend write K/V straight into the slot through the writer's regions, seals the checksum and commits.
//! It dies with its parent (`PR_SET_PDEATHSIG`) and exits when the control socket closes. Once the backend
//! is open, it runs under the [`sandbox`]'s seccomp filters (unless the host says `--sandbox off`).
//!
//! Everything the producer writes is untrusted by the host, which validates every frame; the producer
//! itself trusts the host (it reads ring geometry from the host's control segment).

pub mod procfs;
pub mod protocol;
pub mod sandbox;

use std::ffi::{c_char, c_void, OsString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use pdhost_plugin_abi::{
    PdhostBackend, PdhostBackendV1, PdhostCapabilities, PdhostDescription, PdhostEntryFn, PdhostFrame, PdhostLayer,
    PdhostLayout, PdhostLogLevel, PdhostPrefill, PdhostStatus, PdhostWriter, ENTRY_SYMBOL, PDHOST_ABI_MAJOR,
    PDHOST_BACKEND_V1_0_SIZE,
};
use protocol::{CapabilitiesDesc, Described, FromProducer, LayerDesc, PrefillCall, ToProducer};
use shm_format::{seal_frame, write_prefix, Dtype, EntryKind, Fingerprint, FrameCoords, KvGeometry, Manifest};
use shm_ring::segment::memfd::MemfdSegment;
use shm_ring::RingWriter;

/// Bytes of error text a backend may return.
const ERR_CAP: usize = 1024;
/// How long the producer waits for the host to hand a slot back.
const SLOT_WAIT: Duration = Duration::from_secs(30);

/// The producer's command line.
#[derive(Debug)]
struct Args {
    backend: std::path::PathBuf,
    config: String,
    parent: Option<i32>,
    /// Control segment, data segment, doorbell to the host, doorbell from the host, control socket.
    fds: [i32; 5],
    /// Whether the seccomp filters of [`sandbox`] go on after the backend is open.
    sandbox: bool,
    /// `RLIMIT_DATA` in bytes.
    memory_limit: Option<u64>,
}

const USAGE: &str = "usage: pdhost-producer --backend LIB.so --fds CONTROL,DATA,TO_HOST,FROM_HOST,SOCKET \
[--config JSON] [--parent-pid PID] [--sandbox on|off] [--memory-limit BYTES]

Started by the pdhost host, which passes its ring and control socket as the inherited descriptors --fds
names; see docs/plugin-abi.md.";

fn parse_args(args: Vec<OsString>) -> Result<Args, String> {
    let mut it = args.into_iter();
    let (mut backend, mut config, mut parent, mut fds) = (None, "{}".to_string(), None, None);
    let (mut sandbox, mut memory_limit) = (true, None);
    while let Some(flag) = it.next() {
        let flag = flag.to_string_lossy().into_owned();
        let mut value = || it.next().ok_or_else(|| format!("{flag}: expected a value, found the end of the arguments"));
        match flag.as_str() {
            "--backend" => backend = Some(std::path::PathBuf::from(value()?)),
            "--config" => config = value()?.to_string_lossy().into_owned(),
            "--parent-pid" => {
                let v = value()?;
                parent = Some(
                    v.to_string_lossy().parse().map_err(|_| format!("--parent-pid: expected a pid, found {v:?}"))?,
                )
            }
            "--fds" => fds = Some(parse_fds(&value()?.to_string_lossy())?),
            "--sandbox" => {
                sandbox = match value()?.to_string_lossy().as_ref() {
                    "on" => true,
                    "off" => false,
                    other => return Err(format!("--sandbox: expected on or off, found {other:?}")),
                }
            }
            "--memory-limit" => {
                let v = value()?;
                memory_limit = Some(
                    v.to_string_lossy()
                        .parse()
                        .ok()
                        .filter(|&b: &u64| b > 0)
                        .ok_or_else(|| format!("--memory-limit: expected a number of bytes, found {v:?}"))?,
                )
            }
            "--help" | "-h" => return Err(USAGE.into()),
            other => return Err(format!("unexpected argument {other:?}\n{USAGE}")),
        }
    }
    let backend = backend.ok_or_else(|| format!("expected --backend LIB.so, found none\n{USAGE}"))?;
    let fds = fds.ok_or_else(|| format!("expected --fds, found none\n{USAGE}"))?;
    Ok(Args { backend, config, parent, fds, sandbox, memory_limit })
}

/// Keeps freed heap memory in the process instead of returning it to the kernel (glibc's defaults trim the
/// heap top and unmap large blocks on free). A forward pass allocates and frees the same large buffers on
/// every request; returned memory comes back as fresh pages, and their faults cost ~9% of a 512-token
/// Gemma 3 270M prefill here (`pdhost bench pd`). Both the host and producers call this first.
pub fn keep_freed_memory() {
    // SAFETY: mallopt takes integer arguments and is called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// Runs a producer; `args` excludes the program name.
pub fn main(args: Vec<OsString>) -> ExitCode {
    keep_freed_memory();
    let args = match parse_args(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("pdhost-producer: {e}");
            return ExitCode::from(2);
        }
    };
    confine(args.parent);
    let fds = match adopt_fds(args.fds) {
        Ok(fds) => fds,
        Err(e) => {
            eprintln!("pdhost-producer: {e}");
            return ExitCode::from(2);
        }
    };
    let [control, data, to_host, from_host, socket] = fds;
    let socket = UnixStream::from(socket);
    let served = serve(&args, [control, data, to_host, from_host], &socket);
    // Nothing the backend started outlives the producer's own exit. (Under the filters there is nothing
    // to end, and /proc cannot be read.)
    let _ = sandbox::end_descendants();
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(Fatal { stage, status, message }) => {
            // The host reports the failure it receives; say it here only when the host cannot hear it.
            let failed = FromProducer::StartFailed { stage: stage.into(), status, message: message.clone() };
            if protocol::send(&socket, &failed).is_err() {
                eprintln!("pdhost-producer: {stage}: {message}");
            }
            ExitCode::from(3)
        }
    }
}

/// `--fds`: the five distinct descriptor numbers above 2 the host passed (control segment, data segment,
/// doorbell to the host, doorbell from the host, control socket).
pub fn parse_fds(v: &str) -> Result<[i32; 5], String> {
    let numbers: Vec<i32> = v.split(',').filter_map(|n| n.parse().ok()).filter(|&n| n > 2).collect();
    let distinct = numbers.iter().collect::<std::collections::BTreeSet<_>>().len() == numbers.len();
    numbers
        .try_into()
        .ok()
        .filter(|_| distinct)
        .ok_or_else(|| format!("--fds: expected five distinct descriptor numbers above 2, found {v:?}"))
}

/// Takes ownership of the descriptors [`parse_fds`] named, each checked open, and marks them
/// close-on-exec (a backend's own children, if it starts any, must not inherit the ring). Call it once,
/// before anything else in the process opens a file.
pub fn adopt_fds(fds: [i32; 5]) -> Result<[OwnedFd; 5], String> {
    for fd in fds {
        // SAFETY: fcntl on a descriptor number; F_GETFD only reads its flags.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            return Err(format!("--fds: expected descriptor {fd} open, found it closed"));
        }
    }
    // SAFETY: the host passed these descriptors open (checked above), distinct (checked when parsing) and
    // for this process alone; each is taken exactly once, before anything else in the process opens a
    // file (the caller's promise).
    let fds = fds.map(|fd| unsafe { OwnedFd::from_raw_fd(fd) });
    for fd in &fds {
        let _ = rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::CLOEXEC);
    }
    close_others(&fds.each_ref().map(|fd| fd.as_raw_fd()))?;
    Ok(fds)
}

/// Closes every descriptor above stderr but `keep`: whatever else this process inherited was not meant
/// for it (say, another producer's ring, made inheritable by the host for a spawn at the same moment).
/// Runs before any backend code, while this is the process's only thread. Fails closed: a process that
/// can neither close ranges nor list its descriptors does not run a backend.
fn close_others(keep: &[i32]) -> Result<(), String> {
    let mut kept: Vec<u32> = keep.iter().map(|&fd| fd as u32).collect();
    kept.sort_unstable();
    // Every gap between the kept descriptors, above stderr, in one `close_range` each (Linux 5.9).
    let mut from = 3u32;
    let mut ranged = true;
    for next in kept.iter().copied().chain([u32::MAX]) {
        if next > from {
            let last = if next == u32::MAX { u32::MAX } else { next - 1 };
            // SAFETY: closes descriptors no Rust object in this process owns: the only ones adopted are
            // `keep`, outside every range, and nothing else has been opened yet (the caller's promise).
            ranged &= unsafe { libc::syscall(libc::SYS_close_range, from, last, 0u32) } == 0;
        }
        from = from.max(next.saturating_add(1));
    }
    if ranged {
        return Ok(());
    }
    // An older kernel: what /proc lists. The listing's own descriptor is among the numbers, and closed
    // already when they are used.
    let listing = std::fs::read_dir("/proc/self/fd")
        .map_err(|e| format!("closing inherited descriptors: close_range failed and /proc/self/fd: {e}"))?;
    let open: Vec<i32> = listing.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect();
    for fd in open.into_iter().filter(|fd| *fd > 2 && !keep.contains(fd)) {
        // SAFETY: as above.
        unsafe { libc::close(fd) };
    }
    Ok(())
}

/// Before any backend code runs: `PR_SET_NO_NEW_PRIVS` (no exec of this process or its children can gain
/// privileges) and `PR_SET_PDEATHSIG` (the kernel kills this process when the thread that spawned it
/// exits). If the parent already died before the call, exit now.
pub fn confine(parent: Option<i32>) {
    // SAFETY: plain prctl/getppid calls without pointers.
    unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            eprintln!("pdhost-producer: PR_SET_NO_NEW_PRIVS failed: {}", std::io::Error::last_os_error());
            std::process::exit(1);
        }
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
            eprintln!("pdhost-producer: PR_SET_PDEATHSIG failed: {}", std::io::Error::last_os_error());
            std::process::exit(1);
        }
        if parent.is_some_and(|p| libc::getppid() != p) {
            std::process::exit(1);
        }
    }
}

struct Fatal {
    stage: &'static str,
    /// The backend's status code, 0 when the producer itself failed.
    status: u32,
    message: String,
}

fn fatal(stage: &'static str) -> impl Fn(String) -> Fatal {
    move |message| Fatal { stage, status: 0, message }
}

/// A start-up failure the backend reported with `code`.
fn backend_fatal(stage: &'static str, code: u32, err: &[u8]) -> Fatal {
    Fatal { stage, status: code, message: format!("{}: {}", status_text(code), err_text(err)) }
}

/// The loaded library and its vtable. The vtable is copied out: it is static in the library, which stays
/// loaded as long as this value lives.
struct Loaded {
    table: PdhostBackendV1,
    name: String,
    _library: libloading::Library,
}

fn load(path: &std::path::Path) -> Result<Loaded, String> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    // `dlerror`'s text starts with the path, which the caller's message already names.
    let dl = |e: libloading::Error| {
        let text = e.to_string();
        text.strip_prefix(&format!("{}: ", path.display())).map_or(text.clone(), str::to_string)
    };
    // SAFETY: loading a library runs its initialisers; that is the point of a producer, which exists so
    // that whatever they do happens in this process, not the host.
    let library = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }.map_err(dl)?;
    // SAFETY: the symbol's type is fixed by the ABI (`PdhostEntryFn`).
    let entry = unsafe { library.get::<PdhostEntryFn>(ENTRY_SYMBOL) }.map_err(|e| {
        format!(
            "expected the symbol {}, found none: {}",
            String::from_utf8_lossy(&ENTRY_SYMBOL[..ENTRY_SYMBOL.len() - 1]),
            dl(e)
        )
    })?;
    // SAFETY: calling the entry function as the ABI defines it.
    let table = unsafe { entry() };
    if table.is_null() {
        return Err("pdhost_backend_v1 returned null: expected a vtable".into());
    }
    // SAFETY: the ABI: a non-null table holds its `struct_size` bytes, for as long as the library is loaded.
    let table = unsafe { copy_table(table) }?;
    // SAFETY: the ABI requires null or a NUL-terminated static string; at most 256 bytes of it are read.
    let name = unsafe { c_text(table.name, 256) }.unwrap_or_else(|| "unnamed".to_string());
    Ok(Loaded { table, name, _library: library.into() })
}

/// A private copy of a backend's vtable, checked: its major version, its size, and the 1.0 functions
/// present.
///
/// # Safety
///
/// `table` points to a vtable's header (three `u32`s) followed by the rest of its `struct_size` bytes, all
/// readable.
unsafe fn copy_table(table: *const PdhostBackendV1) -> Result<PdhostBackendV1, String> {
    // The header fields are read first, on their own, so that a short table is never over-read.
    // SAFETY: every vtable starts with these three u32s.
    let (major, size) = unsafe { ((*table).abi_major, (*table).struct_size) };
    if major != PDHOST_ABI_MAJOR {
        return Err(format!("ABI major version: expected {PDHOST_ABI_MAJOR}, found {major}"));
    }
    if (size as usize) < PDHOST_BACKEND_V1_0_SIZE {
        return Err(format!("vtable size: expected at least {PDHOST_BACKEND_V1_0_SIZE} bytes, found {size}"));
    }
    // A table of an older minor version ends early: the fields it lacks stay null (`None`). A size that
    // ends inside a field is cut to the fields it holds whole, so no pointer is half copied.
    let mut copy = std::mem::MaybeUninit::<PdhostBackendV1>::zeroed();
    let whole = (size as usize).min(size_of::<PdhostBackendV1>()) / size_of::<usize>() * size_of::<usize>();
    // SAFETY: the backend's table holds `size >= whole` bytes, copied into a zeroed struct of at least as many.
    unsafe { std::ptr::copy_nonoverlapping(table.cast::<u8>(), copy.as_mut_ptr().cast::<u8>(), whole) };
    // The 1.0 functions are not `Option`s: a C backend that left one null is refused before the table is
    // read as a `PdhostBackendV1` (a null `fn` is undefined behaviour).
    let required = [
        ("open", std::mem::offset_of!(PdhostBackendV1, open)),
        ("describe", std::mem::offset_of!(PdhostBackendV1, describe)),
        ("prefill", std::mem::offset_of!(PdhostBackendV1, prefill)),
        ("close", std::mem::offset_of!(PdhostBackendV1, close)),
    ];
    for (field, offset) in required {
        // SAFETY: `offset` is a pointer-sized, aligned field inside the struct, its bytes initialised (copied,
        // or zeroed); read as an address, not as a function pointer.
        let address = unsafe { copy.as_ptr().cast::<u8>().add(offset).cast::<usize>().read() };
        if address == 0 {
            return Err(format!("vtable: expected a function in `{field}` (ABI 1.0 requires it), found null"));
        }
    }
    // SAFETY: every field is initialised: the 1.0 functions are non-null (checked above), the fields past
    // them are `Option`s of function pointers, for which all-zero bytes are `None`, and the header and
    // `name` are plain data.
    Ok(unsafe { copy.assume_init() })
}

/// Text a backend wrote into an error buffer.
fn err_text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let text = String::from_utf8_lossy(&buf[..end]).replace('\n', " ");
    if text.is_empty() {
        "no reason given".into()
    } else {
        text
    }
}

/// How a line on stderr says it came through the logging callback, at a level: `@pdhost:warn text`. The
/// host logs such a line at its level, and any other stderr line as a warning.
pub const LOG_TAG: &str = "@pdhost:";

/// The logging callback the producer hands a 1.2 backend: one line on stderr, which the host reads and
/// logs tagged with this producer.
unsafe extern "C" fn log_line(_ctx: *mut c_void, level: u32, message: *const c_char, len: usize) {
    if message.is_null() {
        return;
    }
    // SAFETY: the ABI promises `len` readable bytes at `message` for the call.
    let bytes = unsafe { std::slice::from_raw_parts(message.cast::<u8>(), len.min(64 << 10)) };
    let level = match level {
        l if l == PdhostLogLevel::Error as u32 => "error",
        l if l == PdhostLogLevel::Warn as u32 => "warn",
        l if l == PdhostLogLevel::Info as u32 => "info",
        _ => "debug",
    };
    // Called from C: nothing may unwind out of it. A stderr that fails (the host gone) loses the line;
    // `eprintln!` would panic on it, and a panic here would abort the producer.
    let _ = std::panic::catch_unwind(|| {
        use std::io::Write as _;
        let mut err = std::io::stderr().lock();
        for line in String::from_utf8_lossy(bytes).lines() {
            let _ = writeln!(err, "{LOG_TAG}{level} {line}");
        }
    });
}

fn status_text(code: u32) -> String {
    PdhostStatus::from_raw(code).map_or_else(|| format!("unknown status {code}"), |s| s.name().to_string())
}

/// An open backend instance.
struct Instance<'l> {
    loaded: &'l Loaded,
    handle: *mut PdhostBackend,
}

impl Drop for Instance<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle came from this table's `open` and is closed once.
        unsafe { (self.loaded.table.close)(self.handle) };
    }
}

/// What the producer needs to frame spans: the described geometry, layout and dtype.
struct Framing {
    geometry: KvGeometry,
    layout: PdhostLayout,
    dtype: Dtype,
    fingerprint: Fingerprint,
}

fn serve(args: &Args, ring_fds: [OwnedFd; 4], socket: &UnixStream) -> Result<(), Fatal> {
    sandbox::limit_memory(args.memory_limit).map_err(fatal("limits"))?;
    sandbox::adopt_orphans().map_err(fatal("limits"))?;
    let loaded = load(&args.backend).map_err(|e| fatal("load")(format!("{}: {e}", args.backend.display())))?;
    let instance = open(&loaded, &args.config)?;
    let (framing, described) = describe(&instance)?;
    let mut ring = RingWriter::open(ring_fds).map_err(|e| fatal("ring")(e.to_string()))?;
    if args.sandbox {
        // What the backend started while it opened (a helper, a daemon) ends here, the descriptors it
        // could have pointed at another process are ours again, and from here on it can start nothing.
        let ended = sandbox::confine_backend().map_err(fatal("sandbox"))?;
        if ended > 0 {
            eprintln!(
                "pdhost-producer: the backend left {ended} process(es) running after open: killed (a backend \
                 that needs helper processes runs with --sandbox off)"
            );
        }
    }
    protocol::send(socket, &FromProducer::Ready(described)).map_err(|e| fatal("socket")(e.to_string()))?;

    loop {
        let message = match protocol::recv::<ToProducer>(socket, protocol::MAX_TO_PRODUCER) {
            Ok(Some(m)) => m,
            Ok(None) | Err(_) => return Ok(()), // the host went away or hung up: nothing left to serve
        };
        let calls = match message {
            ToProducer::Shutdown => return Ok(()),
            ToProducer::Release { request_id } => {
                if let Some(release) = instance.loaded.table.release {
                    // SAFETY: the ABI's `release` on an open handle.
                    unsafe { release(instance.handle, request_id) };
                }
                continue;
            }
            ToProducer::Prefill(call) => vec![call],
            ToProducer::PrefillBatch(calls) => {
                if let Some(failure) = stage(&instance, &calls) {
                    for call in &calls {
                        let reply = FromProducer::Failed {
                            request_id: call.request_id,
                            status: PdhostStatus::Panic as u32,
                            message: failure.clone(),
                        };
                        if protocol::send(socket, &reply).is_err() {
                            return Ok(());
                        }
                    }
                    continue;
                }
                calls
            }
        };
        // Each span is written once its slot is free: the host takes the first while the next are
        // written, so a batch may hold more calls than the ring has slots.
        for call in &calls {
            let reply = prefill(&instance, &framing, &mut ring, call);
            if protocol::send(socket, &reply).is_err() {
                return Ok(());
            }
        }
    }
}

/// Has the backend compute a batch's chunks in one pass (ABI 1.3 `stage`), where it can. Any failure
/// leaves each `prefill` to compute its own chunk, except a panic, returned: the backend's state is
/// unknown, and every call of the batch fails with it.
fn stage(instance: &Instance<'_>, calls: &[PrefillCall]) -> Option<String> {
    let stage = instance.loaded.table.stage?;
    let requests: Vec<PdhostPrefill> = calls.iter().map(raw_prefill).collect();
    let mut err = [0u8; ERR_CAP];
    // SAFETY: the ABI's `stage` on an open handle: `requests` holds `calls.len()` calls, each pointing into
    // `calls`, which outlives the call; an error buffer.
    let code = unsafe {
        stage(instance.handle, requests.as_ptr(), requests.len(), err.as_mut_ptr().cast::<c_char>(), ERR_CAP)
    };
    match PdhostStatus::from_raw(code) {
        Some(PdhostStatus::Ok) => None,
        // A code outside the ABI, as in `prefill`: as a panic.
        Some(PdhostStatus::Panic) | None => Some(format!("backend stage: {}: {}", status_text(code), err_text(&err))),
        _ => {
            eprintln!(
                "pdhost-producer: backend stage: {}: {} (each call computes alone)",
                status_text(code),
                err_text(&err)
            );
            None
        }
    }
}

/// The ABI's view of `call`, borrowing its tokens.
fn raw_prefill(call: &PrefillCall) -> PdhostPrefill {
    PdhostPrefill {
        struct_size: size_of::<PdhostPrefill>() as u32,
        reserved: 0,
        request_id: call.request_id,
        start_pos: call.start_pos,
        n_tokens: call.tokens.len() as u64,
        token_ids: call.tokens.as_ptr(),
        n_context: call.context.len() as u64,
        context_ids: if call.context.is_empty() { std::ptr::null() } else { call.context.as_ptr() },
    }
}

/// Hands a 1.2 backend the logging callback, then opens it with `config`.
fn open<'l>(loaded: &'l Loaded, config: &str) -> Result<Instance<'l>, Fatal> {
    let table = loaded.table;
    if let Some(set_log) = table.set_log {
        // SAFETY: the ABI's `set_log`, before `open`; the callback is a static function and needs no context.
        unsafe { set_log(log_line, std::ptr::null_mut()) };
    }
    let mut err = [0u8; ERR_CAP];
    let mut handle = std::ptr::null_mut();
    // SAFETY: the ABI's `open`: config bytes and lengths, out-pointer and error buffer all valid.
    let code =
        unsafe { (table.open)(config.as_ptr(), config.len(), &mut handle, err.as_mut_ptr().cast::<c_char>(), ERR_CAP) };
    if code != PdhostStatus::Ok as u32 {
        return Err(backend_fatal("open", code, &err));
    }
    if handle.is_null() {
        // A contract breach, never worth retrying (status 0 at `open`: `repeats_on_every_start`).
        let message = "returned OK with a null handle: expected a handle".to_string();
        return Err(Fatal { stage: "open", status: code, message });
    }
    Ok(Instance { loaded, handle })
}

/// The text of a NUL-terminated string a backend handed out, up to its NUL or `max` bytes, whichever
/// comes first (a string without its NUL is cut, not read past); `None` for null.
///
/// # Safety
///
/// `ptr` is null or points to a NUL-terminated string, or to at least `max` readable bytes.
unsafe fn c_text(ptr: *const c_char, max: usize) -> Option<String> {
    if ptr.is_null() {
        return None;
    }
    let mut bytes = Vec::new();
    while bytes.len() < max {
        // SAFETY: byte by byte up to the NUL, which the caller promises; never past `max` bytes.
        match unsafe { *ptr.add(bytes.len()) } as u8 {
            0 => break,
            b => bytes.push(b),
        }
    }
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

fn describe(instance: &Instance<'_>) -> Result<(Framing, Described), Fatal> {
    let mut err = [0u8; ERR_CAP];
    let mut d = PdhostDescription {
        struct_size: size_of::<PdhostDescription>() as u32,
        layout: u32::MAX,
        dtype: u32::MAX,
        num_layers: 0,
        layers: std::ptr::null(),
        fingerprint: 0,
        identity: std::ptr::null(),
    };
    let table = instance.loaded.table;
    // SAFETY: the ABI's `describe` on an open handle with a valid out-pointer and error buffer.
    let code = unsafe { (table.describe)(instance.handle, &mut d, err.as_mut_ptr().cast::<c_char>(), ERR_CAP) };
    let bad = fatal("describe");
    if code != PdhostStatus::Ok as u32 {
        return Err(backend_fatal("describe", code, &err));
    }
    // A backend of an older minor version wrote only the fields it knows; the rest are as set above.
    // SAFETY: null, or a NUL-terminated string valid until close (the ABI's promise); at most 4 KiB of
    // it are read.
    let identity = unsafe { c_text(d.identity, 4096) };
    let capabilities = capabilities(instance)?;
    if d.num_layers == 0 || d.layers.is_null() || d.num_layers > 1 << 16 {
        return Err(bad(format!("layers: expected 1..=65536 described layers, found {}", d.num_layers)));
    }
    if !d.layers.is_aligned() {
        return Err(bad(format!(
            "layers: expected an array aligned to {} bytes, found one at {:p}",
            align_of::<PdhostLayer>(),
            d.layers
        )));
    }
    // SAFETY: the backend promises `num_layers` layers at `layers`, valid until close.
    let layers = unsafe { std::slice::from_raw_parts(d.layers, d.num_layers as usize) };
    let mut described = Described {
        backend: instance.loaded.name.clone(),
        abi_minor: table.abi_minor,
        layout: d.layout,
        dtype: d.dtype,
        fingerprint: d.fingerprint,
        layers: layers
            .iter()
            .map(|l| LayerDesc {
                kind: l.kind,
                kv_heads: l.kv_heads,
                head_dim: l.head_dim,
                window: l.window,
                state_elems: l.state_elems,
            })
            .collect(),
        identity,
        capabilities,
        transport: None,
        batches: table.stage.is_some(),
    };
    let described_wrong = |e: protocol::BadDescription| bad(e.to_string());
    let geometry = described.geometry().map_err(described_wrong)?;
    let dtype = described.wire_dtype().map_err(described_wrong)?;
    let layout = if described.layout_name().map_err(described_wrong)? == "dense" {
        PdhostLayout::Dense
    } else {
        PdhostLayout::Grouped
    };
    if layout == PdhostLayout::Dense && geometry.uniform_heads().is_none() {
        return Err(bad("dense layout: expected every layer to be attention with the same heads".into()));
    }
    if described.fingerprint == 0 {
        described.fingerprint = geometry.fingerprint().0;
    }
    let fingerprint = Fingerprint(described.fingerprint);
    Ok((Framing { geometry, layout, dtype, fingerprint }, described))
}

/// What a 1.2 backend says it can do; all zero for an older one.
fn capabilities(instance: &Instance<'_>) -> Result<CapabilitiesDesc, Fatal> {
    let Some(query) = instance.loaded.table.capabilities else { return Ok(CapabilitiesDesc::default()) };
    let mut c = PdhostCapabilities { struct_size: size_of::<PdhostCapabilities>() as u32, ..Default::default() };
    let mut err = [0u8; ERR_CAP];
    // SAFETY: the ABI's `capabilities` on an open handle with a valid out-pointer and error buffer.
    let code = unsafe { query(instance.handle, &mut c, err.as_mut_ptr().cast::<c_char>(), ERR_CAP) };
    if code != PdhostStatus::Ok as u32 {
        return Err(backend_fatal("capabilities", code, &err));
    }
    Ok(CapabilitiesDesc { flags: c.flags, dtypes: c.dtypes, layouts: c.layouts, max_tokens: c.max_tokens })
}

/// The writer's context during one `prefill` call.
struct SlotCtx {
    /// Start of the slot's frame area (writable mapping).
    frame: *mut u8,
    capacity: u64,
    payload_offset: u64,
    /// `(offset, len)` of each entry inside the payload.
    entries: Vec<(u64, u64)>,
    /// The frame's length as the prefix declares it (what a whole-frame backend is expected to write).
    frame_len: u64,
    /// What was handed out: behind a lock, since a backend may call the writer from several of its
    /// threads during `prefill` (a region must still go out once, and never beside the whole frame).
    handed: std::sync::Mutex<Handed>,
    coords: shm_format::FrameCoords,
}

/// The regions, or the whole frame, given to the backend so far.
#[derive(Debug)]
struct Handed {
    taken: Vec<bool>,
    whole_frame: bool,
}

impl SlotCtx {
    fn handed(&self) -> std::sync::MutexGuard<'_, Handed> {
        // A panic while it was held left nothing half-done: each update is one assignment.
        self.handed.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

unsafe extern "C" fn region(ctx: *mut c_void, entry: u32, ptr: *mut *mut u8, len: *mut u64) -> u32 {
    if ctx.is_null() || ptr.is_null() || len.is_null() {
        return PdhostStatus::InvalidArgument as u32;
    }
    // SAFETY: `ctx` is the `SlotCtx` the producer passed for this call, alive for its duration (the
    // backend may call from any of its threads until `prefill` returns: docs/plugin-abi.md, threading);
    // shared, its mutable part behind a lock.
    let ctx = unsafe { &*ctx.cast::<SlotCtx>() };
    let Some(&(offset, n)) = ctx.entries.get(entry as usize) else {
        return PdhostStatus::InvalidArgument as u32;
    };
    {
        let mut handed = ctx.handed();
        if handed.whole_frame || handed.taken[entry as usize] {
            return PdhostStatus::WriterRefused as u32;
        }
        handed.taken[entry as usize] = true;
    }
    // SAFETY: `payload_offset + offset + n <= frame_len <= capacity`, checked when the prefix was written,
    // so the region lies inside the slot's frame area; out-pointers were checked non-null. The region is
    // filled with FILL first, so that bytes an earlier frame left there can never pass as this span's.
    unsafe {
        let start = ctx.frame.add((ctx.payload_offset + offset) as usize);
        std::ptr::write_bytes(start, FILL, n as usize);
        *ptr = start;
        *len = n;
    }
    PdhostStatus::Ok as u32
}

unsafe extern "C" fn whole_frame(ctx: *mut c_void, out: *mut PdhostFrame) -> u32 {
    if ctx.is_null() || out.is_null() {
        return PdhostStatus::InvalidArgument as u32;
    }
    // SAFETY: as in `region`.
    let ctx = unsafe { &*ctx.cast::<SlotCtx>() };
    {
        // Once: a second whole frame would be a second mutable view of the same bytes.
        let mut handed = ctx.handed();
        if handed.whole_frame || handed.taken.iter().any(|&t| t) {
            return PdhostStatus::WriterRefused as u32;
        }
        handed.whole_frame = true;
    }
    // SAFETY: `out` was checked non-null; the frame area is `capacity` bytes of the writable slot, of which
    // the first `frame_len <= capacity` (checked when the prefix was written) are filled with FILL, so an
    // earlier frame's bytes cannot pass as this one's.
    unsafe {
        std::ptr::write_bytes(ctx.frame, FILL, ctx.frame_len as usize);
        *out = PdhostFrame {
            ptr: ctx.frame,
            capacity: ctx.capacity,
            epoch: ctx.coords.epoch,
            generation: ctx.coords.generation,
            sequence: ctx.coords.sequence,
        };
    }
    PdhostStatus::Ok as u32
}

/// The byte every region is filled with before the backend gets it. An element of all one bits is a NaN in
/// every wire dtype, so it is never K/V a backend meant to write: one left after `prefill` is a short write.
const FILL: u8 = 0xFF;

/// Elements of `bytes` (of `size` bytes each) still all [`FILL`]: how many, and the byte offset of the
/// first.
fn unwritten(bytes: &[u8], size: usize) -> Option<(usize, usize)> {
    let filled = |e: &[u8]| e.iter().all(|&b| b == FILL);
    if !may_hold_fill(bytes, size) {
        return None;
    }
    let count = match size {
        2 => bytes.chunks_exact(2).filter(|c| u16::from_ne_bytes([c[0], c[1]]) == u16::MAX).count(),
        4 => bytes.chunks_exact(4).filter(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]) == u32::MAX).count(),
        _ => bytes.chunks_exact(size).filter(|c| filled(c)).count(),
    };
    (count > 0).then(|| (count, bytes.chunks_exact(size).position(filled).expect("counted") * size))
}

/// Whether `bytes` may hold an element (of `size` bytes, at offsets from 0) that is all [`FILL`]: false
/// means certainly none. Eight bytes at a time, by the zero-lane test on the inverted word (a lane of `!w`
/// is zero exactly when that element of `w` is all ones), which the compiler vectorises: the common case,
/// a region fully written, costs one read of it.
fn may_hold_fill(bytes: &[u8], size: usize) -> bool {
    let (low, high) = match size {
        2 => (0x0001_0001_0001_0001u64, 0x8000_8000_8000_8000u64),
        4 => (0x0000_0001_0000_0001, 0x8000_0000_8000_0000),
        _ => return true,
    };
    let words = bytes.chunks_exact(8);
    let tail = !words.remainder().is_empty();
    let any = words.fold(0u64, |acc, c| {
        let y = !u64::from_le_bytes(c.try_into().expect("8 bytes"));
        acc | (y.wrapping_sub(low) & !y & high)
    });
    any != 0 || tail
}

/// Why a span was not committed.
#[derive(Debug)]
enum SpanFailure {
    /// The backend (or the writer) returned this status.
    Status(PdhostStatus, String),
    /// The backend returned OK without writing every byte of every region.
    Unwritten(String),
}

/// Builds one span in `frame` (a ring slot, or a private buffer in [`run_in_process`]): header and manifest
/// first, then the backend's K/V through the writer's regions (or its own whole frame), then the checksum.
/// Returns the frame's length and the time inside the backend.
fn frame_span(
    instance: &Instance<'_>,
    framing: &Framing,
    frame: &mut [u8],
    coords: FrameCoords,
    call: &PrefillCall,
) -> Result<(u64, Duration), SpanFailure> {
    let PrefillCall { request_id, start_pos, ref tokens, ref context } = *call;
    if tokens.is_empty() {
        let message = "prefill: expected at least one token, found none".into();
        return Err(SpanFailure::Status(PdhostStatus::InvalidArgument, message));
    }
    if !context.is_empty() && context.len() as u64 != start_pos {
        return Err(SpanFailure::Status(
            PdhostStatus::InvalidArgument,
            format!("prefill context: expected {start_pos} token ids (start_pos), found {}", context.len()),
        ));
    }
    let range = start_pos..start_pos + tokens.len() as u64;
    let mut manifest = match framing.layout {
        PdhostLayout::Dense => {
            Manifest::dense(&framing.geometry, request_id, range, framing.dtype).expect("uniform heads checked")
        }
        PdhostLayout::Grouped => Manifest::grouped(&framing.geometry, request_id, range, framing.dtype),
    };
    manifest.fingerprint = framing.fingerprint;
    let info = write_prefix(frame, &manifest.encode(), manifest.payload_len(), coords)
        .ok()
        .filter(|info| info.frame_len <= frame.len() as u64)
        .ok_or_else(|| {
            let need = manifest.payload_len();
            SpanFailure::Status(
                PdhostStatus::WriterRefused,
                format!("span of {need} payload bytes does not fit a {}-byte ring slot", frame.len()),
            )
        })?;
    let mut ctx = SlotCtx {
        frame: frame.as_mut_ptr(),
        capacity: frame.len() as u64,
        payload_offset: info.payload_offset,
        entries: manifest.entries.iter().map(|e| (e.offset, e.len)).collect(),
        frame_len: info.frame_len,
        handed: std::sync::Mutex::new(Handed { taken: vec![false; manifest.entries.len()], whole_frame: false }),
        coords,
    };
    let writer = PdhostWriter {
        struct_size: size_of::<PdhostWriter>() as u32,
        num_entries: manifest.entries.len() as u32,
        ctx: (&raw mut ctx).cast(),
        region,
        frame: whole_frame,
    };
    let request = raw_prefill(call);
    let mut err = [0u8; ERR_CAP];
    let t = Instant::now();
    // SAFETY: the ABI's `prefill`: open handle, request and writer valid for the call, error buffer. The
    // regions the writer hands out lie inside `frame`, which is borrowed mutably for this whole function.
    let code = unsafe {
        (instance.loaded.table.prefill)(instance.handle, &request, &writer, err.as_mut_ptr().cast::<c_char>(), ERR_CAP)
    };
    let backend = t.elapsed();
    if code != PdhostStatus::Ok as u32 {
        // A code outside the ABI (a C function that ended without a `return`, say) leaves the backend's
        // state as unknown as a panic does: the producer is replaced, not trusted with the next request.
        let status = PdhostStatus::from_raw(code).unwrap_or(PdhostStatus::Panic);
        return Err(SpanFailure::Status(status, format!("backend prefill: {}: {}", status_text(code), err_text(&err))));
    }
    let handed = ctx.handed.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
    if handed.whole_frame {
        // The backend wrote the whole frame; whatever its header says is for the host to judge.
        let mut header = [0u8; shm_format::HEADER_LEN];
        header.copy_from_slice(&frame[..shm_format::HEADER_LEN]);
        let len =
            shm_format::HeaderInfo::parse(&header).map_or(frame.len() as u64, |h| h.frame_len.min(frame.len() as u64));
        return Ok((len, backend));
    }
    // A region never handed out still holds an older frame's bytes, and one written only in part holds
    // the fill: either would reach the host as K/V no one computed. Refuse to commit.
    let entries = manifest.entries.len();
    let name = |i: usize| {
        let e = &manifest.entries[i];
        let kind = match e.kind {
            EntryKind::K => "K",
            EntryKind::V => "V",
            EntryKind::State => "state",
        };
        format!("layer {} {kind} (entry {i} of {entries})", e.layer)
    };
    if let Some(missing) = handed.taken.iter().position(|&t| !t) {
        return Err(SpanFailure::Unwritten(format!("backend returned OK without writing {}", name(missing))));
    }
    let size = framing.dtype.size() as usize;
    for (i, &(offset, len)) in ctx.entries.iter().enumerate() {
        let start = (info.payload_offset + offset) as usize;
        if let Some((count, first)) = unwritten(&frame[start..start + len as usize], size) {
            return Err(SpanFailure::Unwritten(format!(
                "backend returned OK with {} written only in part: {count} of {} elements left unwritten, \
                 the first at byte {first} of {len}",
                name(i),
                len as usize / size
            )));
        }
    }
    seal_frame(&mut frame[..info.frame_len as usize]);
    Ok((info.frame_len, backend))
}

fn prefill(
    instance: &Instance<'_>,
    framing: &Framing,
    ring: &mut RingWriter<MemfdSegment, MemfdSegment>,
    call: &PrefillCall,
) -> FromProducer {
    let request_id = call.request_id;
    let t = Instant::now();
    let mut slot = match ring.reserve(Instant::now() + SLOT_WAIT) {
        Ok(s) => s,
        Err(e) => {
            let message = format!("ring: {e}");
            return FromProducer::Failed { request_id, status: PdhostStatus::WriterRefused as u32, message };
        }
    };
    let coords = slot.coords();
    match frame_span(instance, framing, slot.frame_mut(), coords, call) {
        Ok((_, backend)) => {
            slot.commit();
            let frame_ns = t.elapsed().saturating_sub(backend).as_nanos() as u64;
            FromProducer::Done {
                request_id,
                sequence: coords.sequence,
                backend_ns: backend.as_nanos() as u64,
                frame_ns,
            }
        }
        Err(SpanFailure::Status(status, message)) => {
            FromProducer::Failed { request_id, status: status as u32, message }
        }
        Err(SpanFailure::Unwritten(message)) => FromProducer::Unwritten { request_id, message },
    }
}

/// A backend run in this process against private buffers, for conformance tests: what it describes, and
/// the sealed frame each `(request_id, start_pos, tokens)` call produces (coordinates all zero, as in a
/// span file).
pub fn run_in_process(
    backend: &std::path::Path,
    config: &str,
    calls: &[(u64, u64, Vec<u32>)],
    capacity: usize,
) -> Result<(Described, Vec<Vec<u8>>), String> {
    let loaded = load(backend)?;
    let instance = open(&loaded, config).map_err(|f| format!("{}: {}", f.stage, f.message))?;
    let (framing, described) = describe(&instance).map_err(|f| format!("{}: {}", f.stage, f.message))?;
    let mut frames = Vec::new();
    for (request_id, start_pos, tokens) in calls {
        let mut buf = vec![0u8; capacity];
        let call =
            PrefillCall { request_id: *request_id, start_pos: *start_pos, tokens: tokens.clone(), context: Vec::new() };
        let (len, _) =
            frame_span(&instance, &framing, &mut buf, FrameCoords::default(), &call).map_err(|f| match f {
                SpanFailure::Status(s, m) => format!("{}: {m}", s.name()),
                SpanFailure::Unwritten(m) => m,
            })?;
        buf.truncate(len as usize);
        frames.push(buf);
    }
    Ok((described, frames))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vtable as a C backend lays it out, as words: the header's `u32` pairs, `name`, then functions.
    #[repr(C, align(8))]
    struct RawTable([u64; size_of::<PdhostBackendV1>() / 8]);

    unsafe extern "C" fn nothing() {}

    fn raw_table(size: usize, functions: usize) -> RawTable {
        let mut t = RawTable([0; size_of::<PdhostBackendV1>() / 8]);
        t.0[0] = u64::from(PDHOST_ABI_MAJOR) | (1 << 32);
        t.0[1] = size as u64;
        for f in 0..functions {
            t.0[3 + f] = nothing as *const () as usize as u64;
        }
        t
    }

    #[test]
    fn a_vtable_without_a_required_function_or_cut_mid_field_is_read_safely() {
        let copy = |t: &RawTable| {
            // SAFETY: `RawTable` is the struct's size, so every `struct_size` below is readable.
            unsafe { copy_table(std::ptr::from_ref(t).cast()) }
        };
        // `open`, `describe`, `prefill`, `close` are offsets 24..56: with one missing it is refused,
        // naming it (it was read as a null `fn`).
        for present in 0..4 {
            let err = copy(&raw_table(PDHOST_BACKEND_V1_0_SIZE, present)).map(|_| ()).unwrap_err();
            let missing = ["open", "describe", "prefill", "close"][present];
            assert!(err.contains(&format!("`{missing}`")), "{err}");
        }
        let t = copy(&raw_table(PDHOST_BACKEND_V1_0_SIZE, 4)).unwrap();
        assert!(t.release.is_none() && t.capabilities.is_none());
        // A size four bytes into `release`, whose word holds a pointer: no half of it is taken.
        let mut cut = raw_table(PDHOST_BACKEND_V1_0_SIZE + 4, 4);
        cut.0[PDHOST_BACKEND_V1_0_SIZE / 8] = nothing as *const () as usize as u64;
        assert!(copy(&cut).unwrap().release.is_none());
        let mut whole = raw_table(PDHOST_BACKEND_V1_0_SIZE + 8, 4);
        whole.0[PDHOST_BACKEND_V1_0_SIZE / 8] = nothing as *const () as usize as u64;
        assert!(copy(&whole).unwrap().release.is_some());
    }

    #[test]
    fn unwritten_elements_are_found_in_every_element_size() {
        let mut region = vec![FILL; 64];
        assert_eq!(unwritten(&region, 4), Some((16, 0)));
        region[..40].fill(0);
        assert_eq!(unwritten(&region, 4), Some((6, 40)));
        assert_eq!(unwritten(&region, 2), Some((12, 40)));
        // An element with some bits set by the backend is written, whatever its value.
        region[40] = 0x7F;
        assert_eq!(unwritten(&region, 4), Some((5, 44)));
        region.fill(0x12);
        assert_eq!(unwritten(&region, 4), None);
        assert_eq!(unwritten(&region, 2), None);
        assert!(!may_hold_fill(&region, 2) && !may_hold_fill(&region, 4));
        // Lanes that are all ones only across an element boundary are not an element of the fill.
        region[2..6].fill(FILL);
        assert_eq!(unwritten(&region, 4), None);
        assert_eq!(unwritten(&region, 2), Some((2, 2)));
    }
}
