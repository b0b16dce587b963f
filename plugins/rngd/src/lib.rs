//! The RNGD-contract backend: an NPU-style device that returns all model layers' K/V as one dense tensor
//! `[layer][k|v][token][kv_head][head_dim]`, bf16 on the wire (the host may ask for f32 or f16 with the
//! `dtype` key, e.g. to keep an f32 cache bit-identical to local prefill). The prefill itself is real:
//! the `model` crate's forward pass on the CPU stands in for the device.

use pdhost_backend_kit::ModelBackend;
use pdhost_plugin_abi::{Backend, BackendError, Capabilities, Description, PdhostLayout, Prefill, Writer};
use shm_format::Dtype;

/// The backend instance.
#[derive(Debug)]
pub struct Rngd(ModelBackend);

impl Backend for Rngd {
    fn open(config: &str) -> Result<Self, BackendError> {
        ModelBackend::open(config, PdhostLayout::Dense, Dtype::Bf16).map(Rngd)
    }

    fn describe(&self) -> Description {
        self.0.describe()
    }

    fn release(&mut self, request_id: u64) {
        self.0.release(request_id)
    }

    fn stage(&mut self, requests: &[Prefill<'_>]) -> Result<(), BackendError> {
        self.0.stage(requests)
    }

    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }

    fn prefill(&mut self, request: &Prefill<'_>, writer: &mut Writer<'_>) -> Result<(), BackendError> {
        self.0.compute(request)?;
        self.0.write_regions(&self.0.manifest(request), writer, None)
    }
}

pdhost_plugin_abi::export_backend!(Rngd, c"rngd");
