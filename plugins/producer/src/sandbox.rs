//! What a producer may do once its backend is open.
//!
//! A backend is vendor code in the producer's process. Before it is loaded, the producer ranks itself
//! first for the kernel's OOM killer (`oom_score_adj` 1000, so a backend that eats memory dies before the
//! host does) and, when the host gives one, caps its private memory (`RLIMIT_DATA`). After the backend is
//! opened and described, and before the first prefill, it installs seccomp filters on every thread
//! ([`confine_backend`]):
//!
//! - **Killed on the spot** (`SIGSYS`, which the host reports as `sandbox_violation`): starting a process
//!   (`fork`, `vfork`, a `clone` without `CLONE_THREAD`, `execve`), signalling any process but itself
//!   (`kill`, `tgkill`, `rt_sigqueueinfo` and `rt_tgsigqueueinfo` with another pid, `tkill`,
//!   `pidfd_send_signal`), or having the kernel signal one: a descriptor's owner set to another process
//!   (`fcntl(F_SETOWN)` with another pid, `F_SETOWN_EX`, `ioctl(FIOSETOWN)` and `SIOCSPGRP`, after which
//!   each write by the other end sends the owner `SIGIO`, or whatever `F_SETSIG` chose, `SIGKILL`
//!   included), changing another process's limits (`prlimit64` with another pid and new limits),
//!   changing its parent-death signal (`prctl(PR_SET_PDEATHSIG)`), reaching into another process (`ptrace`, `process_vm_readv`/`writev`,
//!   `pidfd_getfd`), the network (`socket`, `socketpair`, `connect`, `bind`, `listen`, `accept`),
//!   `io_uring` (whose operations seccomp cannot see), and the kernel's administration (`mount`,
//!   `unshare`, `setns`, `chroot`, `bpf`, `perf_event_open`, `userfaultfd`, modules, `kexec`, `reboot`,
//!   swap, keyrings, file handles).
//! - **Refused with `EACCES`**: opening a path (`open`, `openat`, `openat2`, `creat`) and changing the
//!   file system (unlink, rename, mkdir, rmdir, links, truncate, chmod, chown, mknod), and punching holes
//!   (`fallocate` with `FALLOC_FL_PUNCH_HOLE`, `madvise(MADV_REMOVE)`), which would free the data
//!   segment's pages under the host. A library may
//!   open files lazily (a panic's backtrace reads the executable); a refused open is an error it can
//!   report, which reaches the host as `backend_error`.
//! - **`clone3` answers `ENOSYS`**: seccomp cannot read its flags, and the C library then creates threads
//!   with `clone`, whose flags the filter checks.
//!
//! Starting a process is forbidden first, before the producer ends whatever the backend started while
//! it opened ([`end_descendants`]), so that nothing forks between the two; the rest follows. The
//! producer also takes back its own descriptors' ownership ([`disown`]), which the backend could have
//! set while it opened. [`confine_backend`] does all of it, in that order.
//!
//! Everything else is allowed: memory, threads, futexes, time, and the descriptors the producer already
//! holds. Scheduling calls on another process (`setpriority`, `sched_setaffinity`) are allowed too: a
//! thread pool pins and renices its own threads by thread id, which the filter cannot tell from another
//! process's id, and at worst they slow the host. The filters are a deny list on purpose: an allow list breaks the first vendor library whose
//! allocator or thread pool uses one more system call. `--sandbox off` turns the filters off for a backend
//! that needs more (a Python SDK); the OOM rank and the memory cap stay.

use std::collections::BTreeMap;

use seccompiler::{
    apply_filter_all_threads, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

// Linux's values (the same on x86-64 and arm64), which the `libc` crate does not export for glibc.
/// `fcntl`: the signal sent to a descriptor's owner instead of `SIGIO`.
const F_SETSIG: libc::c_int = 10;
/// `fcntl`: a descriptor's owner, as a `struct f_owner_ex` behind a pointer.
const F_SETOWN_EX: libc::c_int = 15;
/// `ioctl`: a descriptor's owner, behind a pointer.
const FIOSETOWN: u64 = 0x8901;
/// `ioctl`: a socket's owning process group, behind a pointer.
const SIOCSPGRP: u64 = 0x8902;

/// Ranks this process first for the OOM killer and caps its private writable memory at `memory_limit`
/// bytes, before any backend code runs.
pub fn limit_memory(memory_limit: Option<u64>) -> Result<(), String> {
    std::fs::write("/proc/self/oom_score_adj", "1000").map_err(|e| format!("oom_score_adj 1000: {e}"))?;
    if let Some(bytes) = memory_limit {
        let limit = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
        // SAFETY: setrlimit reads the struct it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_DATA, &limit) } != 0 {
            return Err(format!("RLIMIT_DATA {bytes}: {}", std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// Makes this process the reaper of every orphan below it (`PR_SET_CHILD_SUBREAPER`), before any backend
/// code runs. A process the backend starts stays below the producer even when its parent exits (the
/// double fork of a daemon, `setsid` or not), so [`end_descendants`] finds it; without this it would move
/// to init and outlive the producer, holding the ring's memory mapped.
pub fn adopt_orphans() -> Result<(), String> {
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        return Err(format!("PR_SET_CHILD_SUBREAPER: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Kills and reaps every process below this one, and returns how many there were. Killing a process
/// hands its own children to this one (see [`adopt_orphans`]), so it repeats until none is left; a
/// backend that forks faster than it is killed is an error after 64 rounds.
pub fn end_descendants() -> Result<usize, String> {
    let me = std::process::id() as i32;
    let mut ended = 0;
    for _ in 0..64 {
        let children =
            crate::procfs::children_of(me).map_err(|e| format!("listing this process's children in /proc: {e}"))?;
        if children.is_empty() {
            return Ok(ended);
        }
        for child in &children {
            // SAFETY: plain system calls on a child of this process (a zombie is only reaped).
            unsafe {
                libc::kill(child.pid, libc::SIGKILL);
                libc::waitpid(child.pid, std::ptr::null_mut(), 0);
            }
        }
        ended += children.len();
    }
    Err(format!("the backend's processes kept forking: {ended} killed and more still running"))
}

/// Confines the backend this process has opened, in an order that leaves no gap: first the filter that
/// kills it when it starts a process (`fork`, `vfork`, `execve`, a `clone` without `CLONE_THREAD`;
/// `clone3` answers `ENOSYS`); then [`disown`] of every descriptor; then [`end_descendants`] of what the
/// backend started while it opened, which can start no more; then the rest of the filters above, on
/// every thread. Returns how many processes it ended. From here on a forbidden call kills the process or
/// fails, as listed in the module's documentation.
pub fn confine_backend() -> Result<usize, String> {
    let arch = arch()?;
    let mut processes = unconditional(&[libc::SYS_fork, libc::SYS_vfork, libc::SYS_execve, libc::SYS_execveat]);
    processes.insert(libc::SYS_clone, vec![rule(0, SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64), 0)?]);
    apply(&[
        filter(processes, SeccompAction::KillProcess, arch)?,
        filter(unconditional(&[libc::SYS_clone3]), SeccompAction::Errno(libc::ENOSYS as u32), arch)?,
    ])?;
    disown()?;
    let ended = end_descendants()?;
    let me = std::process::id() as u64;
    apply(&[
        filter(killed(me)?, SeccompAction::KillProcess, arch)?,
        filter(refused()?, SeccompAction::Errno(libc::EACCES as u32), arch)?,
    ])?;
    Ok(ended)
}

/// Installs `programs` on every thread of this process.
fn apply(programs: &[BpfProgram]) -> Result<(), String> {
    for program in programs {
        apply_filter_all_threads(program).map_err(|e| format!("seccomp: {e}"))?;
    }
    Ok(())
}

/// Takes back the ownership of every descriptor this process holds (no process is sent `SIGIO` for it,
/// and `O_ASYNC` is off). A backend could have pointed any of them at the host while it opened, before
/// the filters: the control socket and doorbell, but also stdout and stderr, whose pipes the host reads
/// (each read signals the writer's owner), or a description it opened anew on one of them
/// (`/proc/self/fd/N`). Fails closed: a descriptor list it cannot read is an error.
fn disown() -> Result<(), String> {
    let listed = std::fs::read_dir("/proc/self/fd").map_err(|e| format!("/proc/self/fd: {e}"))?;
    // Collected first: the listing's own descriptor is among them, and gone once it is dropped.
    let fds: Vec<std::os::fd::RawFd> = listed.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect();
    for fd in fds {
        // SAFETY: fcntl with integer arguments; a descriptor closed since the listing fails with EBADF.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 {
            continue;
        }
        // SAFETY: as above, on a descriptor this process holds.
        let ok = unsafe {
            libc::fcntl(fd, libc::F_SETOWN, 0) == 0
                && libc::fcntl(fd, F_SETSIG, 0) == 0
                && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_ASYNC) == 0
        };
        if !ok {
            return Err(format!("descriptor {fd}'s owner: {}", std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

fn arch() -> Result<TargetArch, String> {
    TargetArch::try_from(std::env::consts::ARCH).map_err(|e| format!("seccomp: {e}"))
}

/// System calls that stop the producer outright (besides starting a process, which the first filter of
/// [`confine_backend`] stops).
const KILLED: &[i64] = &[
    libc::SYS_tkill,
    libc::SYS_pidfd_send_signal,
    libc::SYS_pidfd_getfd,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_socket,
    libc::SYS_socketpair,
    libc::SYS_connect,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_userfaultfd,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_name_to_handle_at,
    libc::SYS_open_by_handle_at,
];

/// System calls that name a path to open or change: refused with `EACCES`.
const REFUSED: &[i64] = &[
    libc::SYS_open,
    libc::SYS_openat,
    libc::SYS_openat2,
    libc::SYS_creat,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_rmdir,
    libc::SYS_link,
    libc::SYS_linkat,
    libc::SYS_symlink,
    libc::SYS_symlinkat,
    libc::SYS_truncate,
    libc::SYS_chmod,
    libc::SYS_fchmodat,
    libc::SYS_chown,
    libc::SYS_lchown,
    libc::SYS_fchownat,
    libc::SYS_mknod,
    libc::SYS_mknodat,
];

fn unconditional(calls: &[i64]) -> BTreeMap<i64, Vec<SeccompRule>> {
    calls.iter().map(|&call| (call, Vec::new())).collect()
}

/// A rule that matches when argument `arg` (its low 32 bits) compares to `value` by `op`.
fn rule(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompRule, String> {
    and(vec![cond(arg, op, value)?])
}

/// Argument `arg` (its low 32 bits) compared to `value` by `op`.
fn cond(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, String> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value).map_err(|e| format!("seccomp rule: {e}"))
}

/// A rule that matches when every one of `conditions` holds.
fn and(conditions: Vec<SeccompCondition>) -> Result<SeccompRule, String> {
    SeccompRule::new(conditions).map_err(|e| format!("seccomp rule: {e}"))
}

/// [`REFUSED`], plus the calls that free a shared segment's pages under the host, whose next read of
/// them would then have to allocate (and, under a memory limit, could fault): a hole punched through a
/// descriptor (`fallocate` with `FALLOC_FL_PUNCH_HOLE`; the data segment cannot be sealed against
/// writes) or through a mapping (`madvise(MADV_REMOVE)`).
fn refused() -> Result<BTreeMap<i64, Vec<SeccompRule>>, String> {
    let mut rules = unconditional(REFUSED);
    let punch = libc::FALLOC_FL_PUNCH_HOLE as u64;
    rules.insert(libc::SYS_fallocate, vec![rule(1, SeccompCmpOp::MaskedEq(punch), punch)?]);
    rules.insert(libc::SYS_madvise, vec![rule(2, SeccompCmpOp::Eq, libc::MADV_REMOVE as u64)?]);
    Ok(rules)
}

/// [`KILLED`], plus a signal sent to another process, directly or through a descriptor's owner.
fn killed(me: u64) -> Result<BTreeMap<i64, Vec<SeccompRule>>, String> {
    let mut rules = unconditional(KILLED);
    for call in [libc::SYS_kill, libc::SYS_tgkill, libc::SYS_rt_sigqueueinfo, libc::SYS_rt_tgsigqueueinfo] {
        rules.insert(call, vec![rule(0, SeccompCmpOp::Ne, me)?]);
    }
    // Clearing the parent-death signal would let a hung producer outlive its host.
    rules.insert(libc::SYS_prctl, vec![rule(0, SeccompCmpOp::Eq, libc::PR_SET_PDEATHSIG as u64)?]);
    // A descriptor owned by another process signals it on every write by the other end (the host's,
    // on the control socket), with the signal `F_SETSIG` chose. `F_SETOWN`'s owner is an argument
    // (itself, or none, is allowed); `F_SETOWN_EX`'s and the ioctls' are behind pointers the filter
    // cannot read.
    rules.insert(
        libc::SYS_fcntl,
        vec![
            and(vec![
                cond(1, SeccompCmpOp::Eq, libc::F_SETOWN as u64)?,
                cond(2, SeccompCmpOp::Ne, me)?,
                cond(2, SeccompCmpOp::Ne, 0)?,
            ])?,
            rule(1, SeccompCmpOp::Eq, F_SETOWN_EX as u64)?,
        ],
    );
    rules.insert(libc::SYS_ioctl, vec![rule(1, SeccompCmpOp::Eq, FIOSETOWN)?, rule(1, SeccompCmpOp::Eq, SIOCSPGRP)?]);
    // Setting another process's limits (reading them, or its own by pid 0 or its pid, is allowed).
    rules.insert(
        libc::SYS_prlimit64,
        vec![and(vec![
            cond(0, SeccompCmpOp::Ne, 0)?,
            cond(0, SeccompCmpOp::Ne, me)?,
            SeccompCondition::new(2, SeccompCmpArgLen::Qword, SeccompCmpOp::Ne, 0)
                .map_err(|e| format!("seccomp rule: {e}"))?,
        ])?],
    );
    Ok(rules)
}

/// One filter: `action` for the calls (and conditions) in `rules`, everything else allowed.
fn filter(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    action: SeccompAction,
    arch: TargetArch,
) -> Result<BpfProgram, String> {
    SeccompFilter::new(rules, SeccompAction::Allow, action, arch)
        .and_then(BpfProgram::try_from)
        .map_err(|e| format!("seccomp filter: {e}"))
}
