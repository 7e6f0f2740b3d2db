//! SASL/OAUTHBEARER login through a Python token provider, for both clients (`RangeConsumer`,
//! `BranchProducer`). Runs on executors.
//!
//! librdkafka asks for a token through its refresh callback. The clients route that callback to
//! librdkafka's own background thread (a SASL queue of its own, forwarded there), so a token comes
//! even while Python never polls the client, e.g. during init_transactions. The callback attaches
//! to Python, calls the provider, and hands librdkafka the token or the reason there is none;
//! librdkafka then retries (every 10 s) and reports the reason as a client error (_AUTHENTICATION).

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyCFunction, PyTuple};
use rdkafka_sys as rd;

use crate::text;

/// What a provider must return, as its failures name it.
const SHAPE: &str = "(token: str, expiry_ms: int, principal: str, extensions: dict[str, str])";

/// The longest piece of a provider's exception message a failure reason carries, in characters.
const MAX_MESSAGE: usize = 500;

/// Set when the interpreter starts to shut down (an atexit hook): a refresh then fails the token
/// instead of attaching to an interpreter that is going away. PyO3 cannot check that itself under
/// abi3 before Python 3.13 (Py_IsFinalizing); a refresh that attached just before still races.
static FINALIZING: AtomicBool = AtomicBool::new(false);

/// Registers the atexit hook that sets `FINALIZING`. Runs once, at module import.
pub(crate) fn watch_shutdown(py: Python<'_>) -> PyResult<()> {
    let mark = PyCFunction::new_closure(py, Some(c"lastagent_native_shutdown"), None, |_, _| {
        FINALIZING.store(true, Ordering::Release);
    })?;
    py.import("atexit")?.call_method1("register", (mark,))?;
    Ok(())
}

/// The Python callable that gives tokens. Owned by the client's Rust object and reached from the
/// refresh callback through the client's opaque; the client destroys its librdkafka handle (which
/// joins the background thread) before it drops this.
pub(crate) struct TokenProvider(Py<PyAny>);

impl TokenProvider {
    /// Client creation (executor side): the callable, or TypeError.
    pub(crate) fn new(callable: &Bound<'_, PyAny>) -> PyResult<Self> {
        if !callable.is_callable() {
            let kind = callable.get_type().name().map(|n| n.to_string()).unwrap_or_default();
            return Err(PyTypeError::new_err(format!("token_provider must be callable, not {kind}")));
        }
        Ok(TokenProvider(callable.clone().unbind()))
    }

    /// Calls the provider and checks what it returned. Background thread, attached to Python.
    fn call(&self, py: Python<'_>) -> Result<Token, String> {
        let out = self.0.bind(py).call0().map_err(|e| format!("the token provider raised {}", describe(py, &e)))?;
        let items = match out.cast::<PyTuple>() {
            Ok(t) if t.len() == 4 => t,
            _ => return Err(format!("the token provider returned {}, not {SHAPE}", shape_of(&out))),
        };
        let wrong = |what: &str| format!("the token provider returned {} whose {what}; {SHAPE} expected", shape_of(&out));
        let value: String =
            items.get_item(0).ok().and_then(|i| i.extract().ok()).ok_or_else(|| wrong("token is not a str"))?;
        let expiry_ms: i64 = items
            .get_item(1)
            .ok()
            .and_then(|i| i.extract().ok())
            .ok_or_else(|| wrong("expiry_ms is not an int of 64 bits"))?;
        let principal: String =
            items.get_item(2).ok().and_then(|i| i.extract().ok()).ok_or_else(|| wrong("principal is not a str"))?;
        let extensions: HashMap<String, String> = items
            .get_item(3)
            .ok()
            .and_then(|i| i.extract().ok())
            .ok_or_else(|| wrong("extensions are not a dict of str to str"))?;
        // Checked here, not left to librdkafka: its refusal would quote the token.
        if value.is_empty() {
            return Err("the token provider returned an empty token".to_owned());
        }
        if !value.bytes().all(|b| (0x20..=0x7e).contains(&b) || matches!(b, b'\t' | b'\r' | b'\n')) {
            return Err("the token provider returned a token with characters SASL/OAUTHBEARER does not allow \
                        (visible ASCII, space, tab, CR and LF only)"
                .to_owned());
        }
        let nul = |what: &str| format!("the token provider returned {what} with a NUL byte");
        let mut flat = Vec::with_capacity(extensions.len() * 2);
        for (k, v) in extensions {
            flat.push(CString::new(k).map_err(|_| nul("an extension key"))?);
            flat.push(CString::new(v).map_err(|_| nul("an extension value"))?);
        }
        Ok(Token {
            value: CString::new(value).map_err(|_| nul("a token"))?,
            expiry_ms,
            principal: CString::new(principal).map_err(|_| nul("a principal"))?,
            extensions: flat,
        })
    }
}

/// A token as librdkafka takes it.
struct Token {
    value: CString,
    /// Expiry, in ms since the Unix epoch (librdkafka's md_lifetime_ms).
    expiry_ms: i64,
    principal: CString,
    /// key, value, key, value, ...
    extensions: Vec<CString>,
}

/// "RuntimeError: message" (the message shortened), or just the type's name.
fn describe(py: Python<'_>, e: &PyErr) -> String {
    let name = e.get_type(py).name().map(|n| n.to_string()).unwrap_or_else(|_| "an exception".to_owned());
    match e.value(py).str().map(|s| s.to_string()) {
        Ok(msg) if !msg.is_empty() => {
            let short: String = msg.chars().take(MAX_MESSAGE).collect();
            let more = if short.len() < msg.len() { "..." } else { "" };
            format!("{name}: {short}{more}")
        }
        _ => name,
    }
}

/// The types of what a provider returned, never its values: "a str", "a tuple (str, int, NoneType)".
fn shape_of(out: &Bound<'_, PyAny>) -> String {
    let name = |o: &Bound<'_, PyAny>| o.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".to_owned());
    match out.cast::<PyTuple>() {
        Ok(t) => format!("a tuple ({})", t.iter().map(|i| name(&i)).collect::<Vec<_>>().join(", ")),
        Err(_) => format!("a {}", name(out)),
    }
}

/// What a client's opaque points at: something that may hold a token provider.
pub(crate) trait TokenSource {
    fn token_provider(&self) -> Option<&TokenProvider>;
}

impl TokenSource for TokenProvider {
    fn token_provider(&self) -> Option<&TokenProvider> {
        Some(self)
    }
}

/// Routes librdkafka's token refresh to the provider of `T`, the type of the conf's opaque.
/// Client creation, before rd_kafka_new.
///
/// # Safety
///
/// `conf` is a live configuration, not yet given to rd_kafka_new, whose opaque is (or will be,
/// before rd_kafka_new) a pointer to a `T` that stays alive and in place until the handle made
/// from it is destroyed: `on_token_refresh::<T>` reads the opaque as a `T`.
pub(crate) unsafe fn configure<T: TokenSource>(conf: *mut rd::rd_kafka_conf_t) {
    // SAFETY: conf is live and not yet owned by a handle (the caller's contract); the callback has
    // librdkafka's signature (the bindings' type checks it), and the `T` it reads the opaque as is
    // the one the caller vouches for.
    unsafe {
        rd::rd_kafka_conf_set_oauthbearer_token_refresh_cb(conf, Some(on_token_refresh::<T>));
        // Refresh requests on a queue of their own (not the main queue, which only a poll
        // serves), so that `serve_in_background` can hand it to the background thread.
        rd::rd_kafka_conf_enable_sasl_queue(conf, 1);
    }
}

/// Serves the refresh requests on librdkafka's background thread (started here), from now on.
/// Client creation, right after rd_kafka_new. librdkafka's text if it cannot: the settings use
/// no SASL/OAUTHBEARER, so the provider would never be asked.
///
/// # Safety
///
/// `rk` is a live handle created from a conf prepared by `configure`.
pub(crate) unsafe fn serve_in_background(rk: *mut rd::rd_kafka_t) -> Result<(), String> {
    // SAFETY: rk is live (the caller's contract). An error object returned is ours: its text lives
    // as long as it and is copied (text) before it is destroyed, once.
    unsafe {
        let error = rd::rd_kafka_sasl_background_callbacks_enable(rk);
        if error.is_null() {
            return Ok(());
        }
        let out = text(rd::rd_kafka_error_string(error));
        rd::rd_kafka_error_destroy(error);
        Err(out)
    }
}

/// librdkafka's token refresh callback. Runs on librdkafka's background thread, without the GIL.
extern "C" fn on_token_refresh<T: TokenSource>(rk: *mut rd::rd_kafka_t, _config: *const c_char, opaque: *mut c_void) {
    // Nothing may unwind into librdkafka (C): a panic becomes a failed refresh.
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the opaque is the `T` the client set on its conf (`configure`'s contract),
        // alive until after rd_kafka_destroy, which joins this thread.
        let source = unsafe { (opaque as *const T).as_ref() };
        let provider = source.and_then(T::token_provider).ok_or_else(|| "no token provider".to_owned())?;
        refresh(rk, provider)
    }));
    let reason = match outcome {
        Ok(Ok(())) => return,
        Ok(Err(reason)) => reason,
        Err(_) => "the token refresh panicked (a bug in lastagent._native)".to_owned(),
    };
    // librdkafka wants a non-empty reason; a NUL byte would cut it short.
    let reason = CString::new(reason.replace('\0', " ")).unwrap_or_else(|_| c"token refresh failed".to_owned());
    // SAFETY: rk is the live handle calling us; librdkafka copies the reason.
    unsafe { rd::rd_kafka_oauthbearer_set_token_failure(rk, reason.as_ptr()) };
}

/// Asks the provider for a token and hands it to librdkafka; Err is why there is none.
/// Background thread, without the GIL.
fn refresh(rk: *mut rd::rd_kafka_t, provider: &TokenProvider) -> Result<(), String> {
    if FINALIZING.load(Ordering::Acquire) {
        return Err("the Python interpreter is shutting down".to_owned());
    }
    let token = Python::try_attach(|py| provider.call(py))
        .ok_or_else(|| "the Python interpreter is not available".to_owned())??;
    let mut flat: Vec<*const c_char> = token.extensions.iter().map(|s| s.as_ptr()).collect();
    let extensions = if flat.is_empty() { ptr::null_mut() } else { flat.as_mut_ptr() };
    let mut errstr = [0 as c_char; 512];
    // SAFETY: rk is the live handle calling us; the strings (and `flat`, pointing into
    // `token.extensions`) outlive the call, and librdkafka copies what it keeps.
    let err = unsafe {
        rd::rd_kafka_oauthbearer_set_token(
            rk,
            token.value.as_ptr(),
            token.expiry_ms,
            token.principal.as_ptr(),
            extensions,
            flat.len(),
            errstr.as_mut_ptr(),
            errstr.len(),
        )
    };
    if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
        // SAFETY: librdkafka wrote a NUL-terminated text into errstr (zeroed before: never unterminated).
        return Err(format!("librdkafka refused the provider's token: {}", unsafe { text(errstr.as_ptr()) }));
    }
    Ok(())
}
