//! Python backends: this cdylib embeds CPython and runs a Python class as a pdhost backend, so that a
//! vendor whose SDK is Python (torch, vLLM, furiosa-llm) writes the backend contract in Python. The
//! producer loads this library like any other; confinement, deadlines and crash handling are the
//! producer's and hold unchanged: a Python exception is the backend's error text, a hang is a timeout, a
//! crash of the interpreter is a producer crash.
//!
//! Configuration: `python_module` and `python_class` name the class (`--producer py:MODULE:CLASS` sets
//! both), `python_path` (a list of directories) goes in front of `sys.path`; everything else, the host's
//! keys included, reaches the class as a dict. The class (docs/plugin-abi.md, "Python backends"):
//!
//! ```python
//! class Backend:
//!     def open(self, config: dict) -> None: ...
//!     def describe(self) -> dict: ...          # layout, dtype, layers, and optionally identity, max_tokens
//!     def prefill(self, request: int, tokens: list[int], start: int, writer) -> None: ...
//!     def release(self, request: int) -> None: ...   # optional
//!     takes_context = True   # optional: prefill(..., context=[tokens before start]) on a prefix-cache hit
//! ```
//!
//! `writer.region(i)` hands out entry `i` as a writable `memoryview` of bytes over the ring slot itself (no
//! copy; `numpy.frombuffer` or `torch.frombuffer` view it in place); `writer.entries` is their number.

use std::os::unix::ffi::{OsStrExt as _, OsStringExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::Mutex;

use pdhost_plugin_abi::{
    BackendError, Capabilities, Description, PdhostDtype, PdhostLayer, PdhostLayerKind, PdhostLayout, PdhostStatus,
    Prefill, Writer,
};
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// An instance of the Python class, and what it described at open.
#[derive(Debug)]
pub struct PyBackend {
    instance: Py<PyAny>,
    description: Description,
    max_tokens: u64,
    /// The class says `takes_context = True` (read once, at open: what its capabilities tell the host and
    /// what its calls do cannot disagree).
    takes_context: bool,
}

// SAFETY: the producer calls a backend from one thread at a time (docs/plugin-abi.md, threading), and
// every touch of the Python object holds the GIL.
unsafe impl Send for PyBackend {}

/// Finds the libpython this library runs on, and makes its symbols global. The producer loads this
/// library, and with it libpython, with `RTLD_LOCAL`, so an extension module the interpreter loads later
/// (numpy's, torch's) would not find the C API it links against (`undefined symbol: PyObject_SelfIter`).
/// Opening libpython again by the path it was loaded from, with `RTLD_NOLOAD | RTLD_GLOBAL`, promotes the
/// loaded copy; it loads nothing new.
fn promote_libpython() -> Result<PathBuf, BackendError> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: `dladdr` fills `info` for an address in a loaded object; `Py_IsInitialized` is libpython's.
    let found = unsafe { libc::dladdr(pyo3::ffi::Py_IsInitialized as *const libc::c_void, info.as_mut_ptr()) };
    // SAFETY: `dladdr` returned non-zero, so it filled `info`.
    let path = (found != 0).then(|| unsafe { info.assume_init() }.dli_fname).filter(|p| !p.is_null());
    let Some(path) = path else {
        return Err(bad_config("libpython: expected dladdr to name the loaded interpreter library, found nothing"));
    };
    // SAFETY: `path` is the NUL-terminated name dladdr returned; NOLOAD only re-flags a loaded object.
    let handle = unsafe { libc::dlopen(path, libc::RTLD_NOW | libc::RTLD_GLOBAL | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return Err(bad_config("libpython: it could not be made global (dlopen with RTLD_NOLOAD failed)"));
    }
    // The handle is deliberately kept: the interpreter stays loaded for the process's life.
    // SAFETY: `path` is a NUL-terminated string owned by the loader, valid while the object is loaded.
    let path = unsafe { std::ffi::CStr::from_ptr(path) };
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(path.to_bytes())))
}

/// The installation prefix of `libpython` (`libpython3.11.so.1.0`): the nearest directory above it that
/// holds its standard library (`lib/python3.11/os.py`): `/usr` for a distribution's, the version's own
/// directory for pyenv's.
fn stdlib_home(libpython: &Path) -> Option<PathBuf> {
    let name = libpython.file_name()?.to_str()?;
    let version = name.strip_prefix("lib")?.split(".so").next()?;
    let real = std::fs::canonicalize(libpython).ok()?;
    real.ancestors().skip(1).find(|dir| dir.join("lib").join(version).join("os.py").is_file()).map(Path::to_path_buf)
}

/// Starts the interpreter with the standard library of the libpython it runs on. Left to itself, CPython
/// finds its home through `python3` on `PATH`; under pyenv that is another build's standard library, whose
/// extension modules need symbols this libpython lacks (`_ssl`: `undefined symbol: _PyModule_Add`). A
/// `PYTHONHOME` the user set wins. Signal handlers stay the producer's, as with pyo3's own start.
fn initialize(libpython: &Path) -> Result<(), BackendError> {
    // SAFETY: callable at any time.
    if unsafe { pyo3::ffi::Py_IsInitialized() } != 0 {
        return Ok(());
    }
    // An empty PYTHONHOME is no PYTHONHOME to CPython.
    let set = std::env::var_os("PYTHONHOME").is_some_and(|h| !h.is_empty());
    let home = if set { None } else { stdlib_home(libpython) };
    let home = home.map(|h| std::ffi::CString::new(h.into_os_string().into_vec())).transpose();
    let home = home.map_err(|_| bad_config("libpython: its home has a NUL byte"))?;
    let failed = |what: &str, status: pyo3::ffi::PyStatus| {
        // SAFETY: a status's message is null or a static C string.
        let message = (!status.err_msg.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(status.err_msg) });
        bad_config(format!("{what}: {}", message.map_or("failed".into(), |m| m.to_string_lossy())))
    };
    let mut config = std::mem::MaybeUninit::<pyo3::ffi::PyConfig>::uninit();
    let config = config.as_mut_ptr();
    // SAFETY: `config` is initialised by `PyConfig_InitPythonConfig` before any other use, its strings are
    // set through the API, and it is cleared once the interpreter has copied what it needs.
    unsafe {
        pyo3::ffi::PyConfig_InitPythonConfig(config);
        (*config).install_signal_handlers = 0;
        if let Some(home) = &home {
            let status = pyo3::ffi::PyConfig_SetBytesString(config, &raw mut (*config).home, home.as_ptr());
            if pyo3::ffi::PyStatus_Exception(status) != 0 {
                pyo3::ffi::PyConfig_Clear(config);
                return Err(failed("setting the interpreter's home", status));
            }
        }
        let status = pyo3::ffi::Py_InitializeFromConfig(config);
        pyo3::ffi::PyConfig_Clear(config);
        if pyo3::ffi::PyStatus_Exception(status) != 0 {
            return Err(failed("starting the interpreter", status));
        }
        // As pyo3's own start does: the interpreter is then ready for `Python::attach` from this thread.
        pyo3::ffi::PyEval_SaveThread();
    }
    Ok(())
}

fn bad_config(message: impl Into<String>) -> BackendError {
    BackendError::new(PdhostStatus::BadConfig, message)
}

/// A Python exception as one line: its type, its message, and where it was raised.
fn exception_text(py: Python<'_>, err: &PyErr) -> String {
    let kind = err.get_type(py).name().map_or_else(|_| "exception".to_string(), |n| n.to_string());
    let mut text = format!("{kind}: {}", err.value(py));
    if let Some(tb) = err.traceback(py) {
        let mut frame = tb.into_any();
        while let Ok(next) = frame.getattr("tb_next") {
            if next.is_none() {
                break;
            }
            frame = next;
        }
        let file = frame.getattr("tb_frame").and_then(|f| f.getattr("f_code")).and_then(|c| c.getattr("co_filename"));
        let line = frame.getattr("tb_lineno");
        if let (Ok(file), Ok(line)) = (file, line) {
            text += &format!(" (at {file}:{line})");
        }
    }
    // One line, which a C string carries whole: a NUL would cut it there.
    text.replace('\n', " ").replace('\0', "\\0")
}

fn backend_error(py: Python<'_>, what: &str, err: &PyErr) -> BackendError {
    BackendError::new(PdhostStatus::BackendError, format!("{what}: {}", exception_text(py, err)))
}

/// An exception while the backend starts (importing its module, making and opening its class), by what
/// it says: a module that is not there or does not parse (`ImportError`, `SyntaxError`), or a config the
/// class cannot use (`ValueError`, `KeyError`, `TypeError` from its constructor or `open`), is the same on
/// the next start, so `BAD_CONFIG` (never retried); anything else (a device busy, a file not there yet)
/// may pass, so `BACKEND_ERROR` (retried with backoff).
fn start_error(py: Python<'_>, what: &str, err: &PyErr) -> BackendError {
    use pyo3::exceptions::{PyImportError, PyKeyError, PySyntaxError, PyTypeError};
    let for_good = err.is_instance_of::<PyImportError>(py)
        || err.is_instance_of::<PySyntaxError>(py)
        || err.is_instance_of::<PyValueError>(py)
        || err.is_instance_of::<PyKeyError>(py)
        || err.is_instance_of::<PyTypeError>(py);
    let status = if for_good { PdhostStatus::BadConfig } else { PdhostStatus::BackendError };
    BackendError::new(status, format!("{what}: {}", exception_text(py, err)))
}

/// What `describe()` returned, checked.
fn description(d: &Bound<'_, PyAny>) -> Result<(Description, u64), String> {
    let get = |key: &str| d.get_item(key).map_err(|_| format!("describe(): expected a {key:?} key, found none"));
    let text = |key: &str| -> Result<String, String> {
        get(key)?.extract::<String>().map_err(|_| format!("describe()[{key:?}]: expected a string"))
    };
    let layout = match text("layout")?.as_str() {
        "dense" => PdhostLayout::Dense,
        "grouped" => PdhostLayout::Grouped,
        other => return Err(format!("describe()[\"layout\"]: expected dense or grouped, found {other:?}")),
    };
    let dtype = match text("dtype")?.as_str() {
        "f32" => PdhostDtype::F32,
        "f16" => PdhostDtype::F16,
        "bf16" => PdhostDtype::Bf16,
        other => return Err(format!("describe()[\"dtype\"]: expected f32, f16 or bf16, found {other:?}")),
    };
    /// More layers than any model has.
    const MAX_LAYERS: usize = 1 << 16;
    let mut layers = Vec::new();
    let list = get("layers")?;
    let items = list.try_iter().map_err(|_| "describe()[\"layers\"]: expected a list of dicts".to_string())?;
    for (i, item) in items.enumerate() {
        // An endless iterable stops here, not at the memory limit.
        if i == MAX_LAYERS {
            return Err(format!("describe()[\"layers\"]: expected at most {MAX_LAYERS} layers, found more"));
        }
        let item = item.map_err(|e| e.to_string())?;
        let kind: String = item
            .get_item("kind")
            .and_then(|k| k.extract())
            .map_err(|_| format!("layer {i}: expected a \"kind\" of full, sliding or recurrent"))?;
        // The keys a layer of this kind needs (a missing one is named, not taken as 0); the others are
        // not read.
        let needs = |key: &str| match kind.as_str() {
            "full" => ["kv_heads", "head_dim"].contains(&key),
            "sliding" => ["kv_heads", "head_dim", "window"].contains(&key),
            _ => key == "state_elems",
        };
        let field = |key: &str| -> Result<u64, String> {
            match item.get_item(key) {
                Ok(v) => v.extract::<u64>().map_err(|_| format!("layer {i} {key:?}: expected a non-negative integer")),
                Err(_) if needs(key) => Err(format!("layer {i} ({kind}): expected a {key:?}, found none")),
                Err(_) => Ok(0),
            }
        };
        let kind = match kind.as_str() {
            "full" => PdhostLayerKind::Full,
            "sliding" => PdhostLayerKind::Sliding,
            "recurrent" => PdhostLayerKind::Recurrent,
            other => return Err(format!("layer {i} kind: expected full, sliding or recurrent, found {other:?}")),
        };
        let small = |key: &str| -> Result<u32, String> {
            u32::try_from(field(key)?).map_err(|_| format!("layer {i} {key:?}: expected at most {}", u32::MAX))
        };
        layers.push(PdhostLayer {
            kind: kind as u32,
            kv_heads: small("kv_heads")?,
            head_dim: small("head_dim")?,
            window: small("window")?,
            state_elems: field("state_elems")?,
        });
    }
    let identity = match d.get_item("identity") {
        Ok(v) if !v.is_none() => {
            let text = v.extract::<String>().map_err(|_| "describe()[\"identity\"]: expected a string")?;
            // The ABI carries it as a C string: one with a NUL would be cut, or dropped as none.
            if text.contains('\0') {
                return Err("describe()[\"identity\"]: expected a string without NUL characters".into());
            }
            Some(text)
        }
        _ => None,
    };
    let max_tokens = match d.get_item("max_tokens") {
        Ok(v) if !v.is_none() => v.extract::<u64>().map_err(|_| "describe()[\"max_tokens\"]: expected an integer")?,
        _ => 0,
    };
    Ok((Description { layout, dtype, layers, fingerprint: 0, identity }, max_tokens))
}

/// One region's bytes, exported through the buffer protocol so that every view of it (a memoryview, a
/// cast of one, a numpy array over one) is counted: after `prefill` returns, a count above zero means
/// Python still reaches the ring slot. The region itself (a view's `.obj`) may outlive the call; it
/// exports nothing after it. Any thread may view it (the ABI lets a backend's own threads fill regions).
#[pyclass]
struct Region {
    /// The slot's bytes; null once the call has returned.
    ptr: AtomicPtr<u8>,
    len: usize,
    exports: AtomicUsize,
}

#[pymethods]
impl Region {
    /// Exports the region, writable, as unsigned bytes.
    ///
    /// # Safety
    ///
    /// Called by the interpreter with a `Py_buffer` to fill (the buffer protocol).
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let this = slf.borrow();
        // Counted before the pointer is read: `finish` nulls the pointer, then reads the count, so a view
        // made as the call returns is either refused here or seen there.
        this.exports.fetch_add(1, Ordering::SeqCst);
        let ptr = this.ptr.load(Ordering::SeqCst);
        if ptr.is_null() {
            this.exports.fetch_sub(1, Ordering::SeqCst);
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "a region is only valid during the prefill call that handed it out",
            ));
        }
        // SAFETY: `view` is the interpreter's to fill; `ptr` and `len` are the region, valid while the
        // export count is checked (the producer fails the call when it is not zero after `prefill`, and
        // the region exports nothing after it: `ptr` is null then).
        let status = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr.cast(), this.len as pyo3::ffi::Py_ssize_t, 0, flags)
        };
        if status != 0 {
            this.exports.fetch_sub(1, Ordering::SeqCst);
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// A view of the region was released.
    ///
    /// # Safety
    ///
    /// Called by the interpreter for a buffer `__getbuffer__` filled.
    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {
        let _ = self.exports.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }
}

/// The writer a Python `prefill` gets: `region(i)` hands out entry `i` once, as a writable memoryview
/// over the ring slot. Valid only during the call: afterwards every view is released, and `region`
/// refuses. Any thread may call it.
#[pyclass]
struct PyWriter {
    state: Mutex<WriterState>,
    #[pyo3(get)]
    entries: u32,
}

/// What [`PyWriter`] guards.
struct WriterState {
    /// The producer's writer, for the duration of one `prefill` call; null after it.
    writer: *mut Writer<'static>,
    /// The views handed out, released when the call returns, and the regions under them.
    views: Vec<(u32, Py<PyAny>, Py<Region>)>,
}

// SAFETY: `writer` is only dereferenced under the mutex, during the `prefill` call that set it (`finish`
// nulls it, under the mutex, before that call returns); the producer's `Writer` hands each region out
// once and may be used from any thread (docs/plugin-abi.md, "Threading").
unsafe impl Send for WriterState {}

#[pymethods]
impl PyWriter {
    /// Entry `entry`'s destination as a writable memoryview of bytes.
    fn region(&self, py: Python<'_>, entry: i64) -> PyResult<Py<PyAny>> {
        // Any integer is named in the error, a negative one too (not refused by the conversion).
        let Some(entry) = u32::try_from(entry).ok().filter(|&e| e < self.entries) else {
            return Err(PyIndexError::new_err(format!("region {entry}: expected an entry below {}", self.entries)));
        };
        // The lock is held only around Rust: a thread holding it never waits for the interpreter.
        let (ptr, len) = {
            let state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if state.writer.is_null() {
                return Err(PyValueError::new_err("the writer is only valid during prefill"));
            }
            let state = &*state;
            // SAFETY: `writer` points to the `Writer` of the `prefill` call in progress (see `WriterState`).
            let writer = unsafe { &mut *state.writer };
            let region =
                writer.region(entry).map_err(|e| PyValueError::new_err(format!("region {entry}: {}", e.message)))?;
            (region.as_mut_ptr(), region.len())
        };
        // The region is `len` writable bytes of the ring slot, valid until `prefill` returns; `finish`
        // checks that no view of it is left by then.
        let exported = Bound::new(py, Region { ptr: AtomicPtr::new(ptr), len, exports: AtomicUsize::new(0) })?;
        let view = py.import("builtins")?.getattr("memoryview")?.call1((exported.clone(),))?;
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if state.writer.is_null() {
            // The call returned meanwhile (a thread of the backend's still at work): the view never leaves.
            exported.borrow().ptr.store(std::ptr::null_mut(), Ordering::SeqCst);
            let _ = view.call_method0("release");
            return Err(PyValueError::new_err("the writer is only valid during prefill"));
        }
        state.views.push((entry, view.clone().unbind(), exported.unbind()));
        Ok(view.unbind())
    }
}

impl PyWriter {
    /// Ends the call: no more regions, and every view handed out released. A view the backend kept (a
    /// cast, a slice, a numpy array over a region) would still reach the ring slot after the host took
    /// it, and it cannot be revoked; nor can a pointer taken from one whose export was then released,
    /// which `torch.frombuffer` does (it keeps the memoryview object itself, which is how that shows).
    /// Either fails the call as a `PANIC`, so that the host kills this process, and the view with it.
    fn finish(&self, py: Python<'_>) -> Result<(), BackendError> {
        let views = {
            let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            state.writer = std::ptr::null_mut();
            std::mem::take(&mut state.views)
        };
        for (_, view, region) in &views {
            let _ = view.bind(py).call_method0("release");
            // Kept (as a view's `.obj`), the region gives no new view of the slot.
            region.borrow(py).ptr.store(std::ptr::null_mut(), Ordering::SeqCst);
        }
        // Another reference to a memoryview than this list's: the backend kept the view object, or
        // something that took the slot's address from it. An exception's traceback or a reference
        // cycle may hold one for a while: the cycles are collected once before it counts.
        let held = |views: &[(u32, Py<PyAny>, Py<Region>)]| -> Vec<String> {
            views
                .iter()
                .filter(|(_, view, region)| {
                    // SAFETY: a live object (this list holds a reference), read with the interpreter held.
                    let refs = unsafe { pyo3::ffi::Py_REFCNT(view.as_ptr()) };
                    refs > 1 || region.borrow(py).exports.load(Ordering::SeqCst) > 0
                })
                .map(|(entry, ..)| entry.to_string())
                .collect()
        };
        let mut kept = held(&views);
        if !kept.is_empty() {
            if let Ok(gc) = py.import("gc") {
                let _ = gc.call_method0("collect");
            }
            kept = held(&views);
        }
        if kept.is_empty() {
            return Ok(());
        }
        Err(BackendError::new(
            PdhostStatus::Panic,
            format!(
                "prefill returned with a view of region(s) {} still alive (the memoryview, or a cast, slice \
                 or array of it, kept past the call): it would reach a slot the host owns",
                kept.join(", ")
            ),
        ))
    }
}

impl pdhost_plugin_abi::Backend for PyBackend {
    fn open(config: &str) -> Result<Self, BackendError> {
        let json: serde_json::Value =
            serde_json::from_str(config).map_err(|e| bad_config(format!("config: expected JSON, found {e}")))?;
        let name = |key: &str| {
            json.get(key).and_then(|v| v.as_str()).map(str::to_string).ok_or_else(|| {
                bad_config(format!("config: expected {key:?} (set by --producer py:MODULE:CLASS), found none"))
            })
        };
        let (module, class) = (name("python_module")?, name("python_class")?);
        let path: Vec<String> = match json.get("python_path") {
            None => Vec::new(),
            Some(p) => serde_json::from_value(p.clone())
                .map_err(|_| bad_config("config python_path: expected a list of directories"))?,
        };
        let libpython = promote_libpython()?;
        initialize(&libpython)?;
        Python::attach(|py| {
            // Before `python_path` goes in front: a `json.py` of the backend's must not stand in for it.
            let loads =
                py.import("json").and_then(|j| j.getattr("loads")).map_err(|e| backend_error(py, "json", &e))?;
            let sys = py.import("sys").map_err(|e| backend_error(py, "import sys", &e))?;
            let sys_path = sys.getattr("path").and_then(|p| p.cast_into::<PyList>().map_err(Into::into));
            let sys_path = sys_path.map_err(|e| backend_error(py, "sys.path", &e))?;
            for dir in path.iter().rev() {
                sys_path.insert(0, dir).map_err(|e| backend_error(py, "sys.path", &e))?;
            }
            let module_obj =
                py.import(module.as_str()).map_err(|e| start_error(py, &format!("importing {module}"), &e))?;
            let cls = module_obj
                .getattr(class.as_str())
                .map_err(|_| bad_config(format!("{module}: expected a class {class}, found none")))?;
            let instance = cls.call0().map_err(|e| start_error(py, &format!("{module}.{class}()"), &e))?;
            let config_obj = loads.call1((config,)).map_err(|e| backend_error(py, "config", &e))?;
            let config_dict = config_obj.cast::<PyDict>().map_err(|_| bad_config("config: expected a JSON object"))?;
            instance.call_method1("open", (config_dict,)).map_err(|e| start_error(py, "open", &e))?;
            let described = instance.call_method0("describe").map_err(|e| start_error(py, "describe", &e))?;
            let (description, max_tokens) = description(&described).map_err(bad_config)?;
            let takes_context = instance.getattr("takes_context").and_then(|v| v.is_truthy()).unwrap_or(false);
            Ok(PyBackend { instance: instance.unbind(), description, max_tokens, takes_context })
        })
    }

    fn describe(&self) -> Description {
        self.description.clone()
    }

    fn capabilities(&self) -> Capabilities {
        // A class without `takes_context` refuses a prefix-cache hit's call: the host is told so now, and
        // never sends one (its requests take no hit and are prefilled from 0).
        Capabilities { max_tokens: self.max_tokens, refuses_context: !self.takes_context, ..Capabilities::default() }
    }

    fn prefill(&mut self, request: &Prefill<'_>, writer: &mut Writer<'_>) -> Result<(), BackendError> {
        Python::attach(|py| {
            // A request that starts past 0 with the tokens before it (a prefix-cache hit) goes only to a
            // class that says it takes one (the host, told by the capabilities, sends no other one).
            let context = if request.context.is_empty() {
                None
            } else if self.takes_context {
                Some(PyList::new(py, request.context).map_err(|e| backend_error(py, "context", &e))?)
            } else {
                return Err(BackendError::new(
                    PdhostStatus::Unsupported,
                    "a request that starts past position 0 (a prefix-cache hit): this class has no \
                     `takes_context = True`",
                ));
            };
            let entries = writer.entries();
            let tokens = PyList::new(py, request.tokens).map_err(|e| backend_error(py, "tokens", &e))?;
            // SAFETY (of the cast): the pointer is used only by `PyWriter::region` during this call, and
            // `finish` nulls it before the call returns, whatever Python did.
            let raw = (writer as *mut Writer<'_>).cast::<Writer<'static>>();
            let state = Mutex::new(WriterState { writer: raw, views: Vec::new() });
            let py_writer = Bound::new(py, PyWriter { state, entries }).map_err(|e| backend_error(py, "writer", &e))?;
            let args = (request.request_id, tokens, request.start_pos, py_writer.clone());
            let instance = self.instance.bind(py);
            let kwargs = match context {
                None => None,
                Some(context) => {
                    let kwargs = PyDict::new(py);
                    kwargs.set_item("context", context).map_err(|e| backend_error(py, "context", &e))?;
                    Some(kwargs)
                }
            };
            // A Rust panic inside the call (one that came back through Python as a `PanicException` is
            // resumed) must not skip `finish`: the writer would point into a stack frame that is gone.
            let called = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // The exception becomes text here, and its traceback (whose frames may hold views) is
                // dropped before `finish` counts what still holds one.
                instance
                    .call_method("prefill", args, kwargs.as_ref())
                    .map(drop)
                    .map_err(|e| backend_error(py, "prefill", &e))
            }));
            let finished = py_writer.borrow().finish(py);
            let called = called.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            // A view of the slot still held outlives the call, whatever Python raised: `finish`'s error
            // (which has the producer replaced) comes first.
            finished?;
            called
        })
    }

    /// A class with `stage(calls)` gets a batch's calls at once, each a `(request, tokens, start,
    /// context)` tuple (`context` `None` unless the call starts past 0 with one), to compute them in one
    /// pass; its `prefill` of each follows. An exception fails no call (each `prefill` computes).
    fn stage(&mut self, requests: &[Prefill<'_>]) -> Result<(), BackendError> {
        Python::attach(|py| {
            let instance = self.instance.bind(py);
            if !instance.hasattr("stage").unwrap_or(false) {
                return Ok(());
            }
            let calls = requests
                .iter()
                .map(|r| {
                    let tokens = PyList::new(py, r.tokens)?;
                    let context = if r.context.is_empty() { None } else { Some(PyList::new(py, r.context)?) };
                    Ok((r.request_id, tokens, r.start_pos, context))
                })
                .collect::<PyResult<Vec<_>>>()
                .map_err(|e| backend_error(py, "stage", &e))?;
            instance.call_method1("stage", (calls,)).map(drop).map_err(|e| backend_error(py, "stage", &e))
        })
    }

    fn release(&mut self, request_id: u64) {
        Python::attach(|py| {
            let instance = self.instance.bind(py);
            if instance.hasattr("release").unwrap_or(false) {
                if let Err(e) = instance.call_method1("release", (request_id,)) {
                    pdhost_plugin_abi::log(
                        pdhost_plugin_abi::PdhostLogLevel::Warn,
                        &format!("release({request_id}): {}", exception_text(py, &e)),
                    );
                }
            }
        })
    }
}

pdhost_plugin_abi::export_backend!(PyBackend, c"python");

#[cfg(test)]
mod tests {
    use super::*;

    /// The home is the nearest directory above the library with its version's standard library, through
    /// symlinks (Debian's `/lib` is `/usr/lib`); a library with no standard library near it has none.
    #[test]
    fn the_interpreter_home_is_found_above_its_library() {
        let root = std::env::temp_dir().join(format!("pdhost-stdlib-{}", std::process::id()));
        let prefix = root.join("usr");
        std::fs::create_dir_all(prefix.join("lib/python3.11")).unwrap();
        std::fs::create_dir_all(prefix.join("lib/x86_64-linux-gnu")).unwrap();
        std::fs::write(prefix.join("lib/python3.11/os.py"), "").unwrap();
        let lib = prefix.join("lib/x86_64-linux-gnu/libpython3.11.so.1.0");
        std::fs::write(&lib, "").unwrap();
        std::os::unix::fs::symlink(prefix.join("lib"), root.join("lib")).unwrap();
        let canonical = std::fs::canonicalize(&prefix).unwrap();
        assert_eq!(stdlib_home(&lib), Some(canonical.clone()));
        assert_eq!(stdlib_home(&root.join("lib/x86_64-linux-gnu/libpython3.11.so.1.0")), Some(canonical));
        let other = prefix.join("lib/x86_64-linux-gnu/libpython3.99.so.1.0");
        std::fs::write(&other, "").unwrap();
        assert_eq!(stdlib_home(&other), None, "no python3.99 standard library anywhere above it");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
