//! One NIXL agent with a UCX backend.

use nixl_sys::{
    Agent, AgentConfig, MemType, MemoryRegion, NixlDescriptor, NixlError, NotificationMap, OptArgs, RegistrationHandle,
    XferDescList, XferOp, XferRequest, XferStatus,
};

/// Why a NIXL call failed. NIXL's own errors carry no text (its details go to its log), so each names
/// the call.
#[derive(Debug, thiserror::Error)]
pub enum NixlFailure {
    /// The runtime is not loaded: the bindings are a stub with nothing behind them.
    #[error("NIXL runtime: expected libnixl_capi.so loaded in this process (Runtime::load), found none")]
    NoRuntime,
    /// A call failed.
    #[error("NIXL {call}: {source}")]
    Call {
        /// The call.
        call: &'static str,
        /// NIXL's error.
        #[source]
        source: NixlError,
    },
    /// A write reaches past the local registration.
    #[error(
        "NIXL write: expected {at} + {len} bytes within the {registered}-byte registration, found it past the end"
    )]
    OutOfRange {
        /// Offset into the registration.
        at: usize,
        /// Bytes to write.
        len: usize,
        /// The registration's length.
        registered: usize,
    },
}

fn call(call: &'static str) -> impl FnOnce(NixlError) -> NixlFailure {
    move |source| NixlFailure::Call { call, source }
}

/// Memory handed to NIXL by address.
#[derive(Debug)]
struct Raw {
    addr: usize,
    len: usize,
}

impl MemoryRegion for Raw {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Raw {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

/// The pause of NIXL's progress thread between its turns, in microseconds.
const PROGRESS_PAUSE_US: u64 = 1000;

/// A NIXL agent with a UCX backend.
#[derive(Debug)]
pub struct Endpoint {
    agent: Agent,
}

/// Memory registered with an [`Endpoint`]; deregistered when dropped.
#[derive(Debug)]
pub struct Registration {
    _handle: RegistrationHandle,
    addr: usize,
    len: usize,
}

impl Registration {
    /// The registered memory's address, as a peer's descriptors name it.
    pub fn addr(&self) -> u64 {
        self.addr as u64
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A posted WRITE. Dropping it before [`Transfer::done`] says so cancels it (NIXL's rule).
pub struct Transfer<'a> {
    endpoint: &'a Endpoint,
    request: XferRequest,
}

impl std::fmt::Debug for Transfer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer").finish_non_exhaustive()
    }
}

impl Transfer<'_> {
    /// Whether every byte has been written and the notification sent; an error if the transfer failed.
    pub fn done(&self) -> Result<bool, NixlFailure> {
        let status = self.endpoint.agent.get_xfer_status(&self.request).map_err(call("get_xfer_status"))?;
        Ok(status == XferStatus::Success)
    }
}

impl Endpoint {
    /// An agent called `name` with NIXL's UCX backend at its default parameters. The runtime must be
    /// loaded ([`crate::Runtime::load`]); without it this is [`NixlFailure::NoRuntime`].
    pub fn new(name: &str) -> Result<Self, NixlFailure> {
        if nixl_sys::is_stub() {
            return Err(NixlFailure::NoRuntime);
        }
        // NIXL's progress thread drives UCX while this process waits elsewhere (a WRITE over TCP needs
        // the target's worker to progress too). By default it spins without pause (`pthr_delay_us` 0),
        // which took a core from prefill; with a pause it costs next to nothing and adds at most that
        // much to a transfer.
        let config = AgentConfig { pthr_delay_us: PROGRESS_PAUSE_US, ..AgentConfig::default() };
        let agent = Agent::new_configured(name, &config).map_err(call("create agent"))?;
        let (_mems, params) = agent.get_plugin_params("UCX").map_err(call("UCX plugin parameters"))?;
        agent.create_backend("UCX", &params).map_err(call("create UCX backend"))?;
        Ok(Endpoint { agent })
    }

    /// Registers `len` bytes at `addr`, so that peers may WRITE into them and this endpoint may WRITE
    /// from them.
    ///
    /// # Safety
    ///
    /// The memory stays mapped and readable, and is not reused for anything else, until the
    /// registration is dropped. A peer given this endpoint's [`Endpoint::metadata`] may write any byte
    /// of it at any time until then: the memory must then be writable, and read only as memory another
    /// process may be writing (volatile loads), never through a Rust reference. Memory that this
    /// endpoint only WRITEs from, and whose metadata no peer holds, may be read-only.
    pub unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<Registration, NixlFailure> {
        let raw = Raw { addr: addr as usize, len };
        let handle = self.agent.register_memory(&raw, None).map_err(call("register memory"))?;
        Ok(Registration { _handle: handle, addr: raw.addr, len })
    }

    /// This agent's metadata, for a peer's [`Endpoint::add_peer`]: taken after every registration a peer
    /// will write into.
    pub fn metadata(&self) -> Result<Vec<u8>, NixlFailure> {
        self.agent.get_local_md().map_err(call("local metadata"))
    }

    /// Loads a peer's metadata; returns its agent name, which [`Endpoint::write`] takes.
    pub fn add_peer(&self, metadata: &[u8]) -> Result<String, NixlFailure> {
        self.agent.load_remote_md(metadata).map_err(call("load peer metadata"))
    }

    /// Posts a WRITE of `len` bytes at `at` in `local` into `peer`'s memory at `remote`, followed by
    /// `notification`, which the peer receives after every byte of it.
    pub fn write<'a>(
        &'a self,
        peer: &str,
        local: &Registration,
        at: usize,
        remote: u64,
        len: usize,
        notification: &[u8],
    ) -> Result<Transfer<'a>, NixlFailure> {
        self.post_write(peer, local, at, remote, len, Some(notification))
    }

    fn post_write<'a>(
        &'a self,
        peer: &str,
        local: &Registration,
        at: usize,
        remote: u64,
        len: usize,
        notification: Option<&[u8]>,
    ) -> Result<Transfer<'a>, NixlFailure> {
        if at.checked_add(len).is_none_or(|end| end > local.len) {
            return Err(NixlFailure::OutOfRange { at, len, registered: local.len });
        }
        let mut from = XferDescList::new(MemType::Dram).map_err(call("local descriptors"))?;
        from.add_desc(local.addr + at, len, 0);
        let mut to = XferDescList::new(MemType::Dram).map_err(call("remote descriptors"))?;
        to.add_desc(remote as usize, len, 0);
        let mut args = OptArgs::new().map_err(call("options"))?;
        if let Some(notification) = notification {
            args.set_has_notification(true).map_err(call("notification"))?;
            args.set_notification_message(notification).map_err(call("notification"))?;
        }
        let request =
            self.agent.create_xfer_req(XferOp::Write, &from, &to, peer, Some(&args)).map_err(call("create write"))?;
        self.agent.post_xfer_req(&request, None).map_err(call("post write"))?;
        Ok(Transfer { endpoint: self, request })
    }

    /// Sends `peer` a notification alone, with no data before it (NIXL orders it after nothing).
    pub fn notify(&self, peer: &str, notification: &[u8]) -> Result<(), NixlFailure> {
        self.agent.send_notification(peer, notification, None).map_err(call("send notification"))
    }

    /// Posts a WRITE as [`Endpoint::write`] does, but with no notification after it.
    pub fn write_silently<'a>(
        &'a self,
        peer: &str,
        local: &Registration,
        at: usize,
        remote: u64,
        len: usize,
    ) -> Result<Transfer<'a>, NixlFailure> {
        self.post_write(peer, local, at, remote, len, None)
    }

    /// The notifications received since the last call, each with its sender's agent name.
    pub fn notifications(&self) -> Result<Vec<(String, Vec<u8>)>, NixlFailure> {
        // NIXL appends to the map it is given, so a fresh one each time.
        let mut map = NotificationMap::new().map_err(call("notification map"))?;
        self.agent.get_notifications(&mut map, None).map_err(call("get notifications"))?;
        let mut out = Vec::new();
        let agents: Vec<String> = map
            .agents()
            .map(|a| a.map(str::to_string))
            .collect::<Result<_, _>>()
            .map_err(call("notification sender"))?;
        for agent in agents {
            for payload in map.get_notifications(&agent).map_err(call("notifications of a sender"))? {
                out.push((agent.clone(), payload.map_err(call("notification payload"))?));
            }
        }
        Ok(out)
    }
}
