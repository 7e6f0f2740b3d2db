//! The sink's branch producer (`lastagent._native.BranchProducer`). Runs on executors.
//!
//! A librdkafka transactional producer for one branch (one Kafka transaction of one Spark task
//! attempt). Arrow columns are produced without a Python object per record: keys and values
//! are read from the Arrow C data interface and copied once, into librdkafka's queue. The XA
//! rules stay in Python (`lastagent.kafka_xa.BranchWriter`): this type only carries out the
//! calls and reports what librdkafka said, as (error name, text) pairs.

use std::ffi::{c_char, c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use arrow_array::cast::AsArray;
use arrow_array::{make_array, Array, ArrayRef};
use arrow_data::ffi::FFI_ArrowArray;
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::DataType;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyTuple};
use rdkafka_sys as rd;

use crate::oauth::{self, TokenProvider, TokenSource};
use crate::{code_name, code_text, cstring, destroy_new, err_name, err_text, message_err, new_conf, text, NativeKafkaError};

/// A librdkafka error as Python sees it: (name, text).
type KafkaErr = (String, String);

/// A record the broker or the client refused: (error name, text, topic, partition, the key
/// (Python shows only a digest of it, never the bytes), the record's size in bytes, the record's
/// index among the records the branch was given, -1 if unknown).
type Failure = (String, String, String, i32, Option<Vec<u8>>, usize, i64);

/// What librdkafka's callbacks reported. Shared with them through the client's opaque pointer
/// (with the token provider, which the token refresh callback reaches the same way).
#[derive(Default)]
struct Reports {
    /// The first `KEEP_FAILURES` failed records, in the order their reports came.
    failures: Mutex<Vec<Failure>>,
    /// The largest failed record so far: a batch the broker refuses fails every record in it, and
    /// for a size refusal the largest is the likely cause even when it is not among the first.
    largest: Mutex<Option<Failure>>,
    /// How many records failed (not counting those dropped with the failed transaction).
    failed: AtomicU64,
    purged: AtomicU64,
    client_errors: Mutex<Vec<KafkaErr>>,
    /// SASL/OAUTHBEARER tokens (oauth.rs); dropped after the handle is destroyed (`Drop`).
    token_provider: Option<TokenProvider>,
}

impl TokenSource for Reports {
    fn token_provider(&self) -> Option<&TokenProvider> {
        self.token_provider.as_ref()
    }
}

const KEEP_FAILURES: usize = 16;

/// How long to wait when librdkafka's queue is full before offering the record again, in ms.
/// With delivery.report.only.error a successful delivery is no event, so a poll waits out its
/// whole timeout however soon the queue has room: at 100 ms the queue (100,000 records by
/// default) could run empty while the broker would take more.
const QUEUE_FULL_WAIT_MS: c_int = 5;

/// Locks one of the Reports' mutexes, poisoned or not: a panic while one was held (there is none
/// to expect) must not turn into a second one, least of all in a callback, where it would abort.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// librdkafka's delivery report callback (dr_msg_cb). With delivery.report.only.error it is called
/// for failed records only, on the thread that serves the producer's queue: a `poll`, `flush`,
/// `produce` or `produce_columns` call, without the GIL. Must not panic: a panic cannot unwind
/// into librdkafka (C), so it aborts the process (the Spark worker).
///
/// # Safety
///
/// Only librdkafka calls it, as the dr_msg_cb `BranchProducer::new` sets: `opaque` is then that
/// producer's `Reports` (`Arc::as_ptr`), which the BranchProducer keeps until after
/// rd_kafka_destroy, and `m` is a message librdkafka keeps alive for the call.
unsafe extern "C" fn on_delivery(_rk: *mut rd::rd_kafka_t, m: *const rd::rd_kafka_message_t, opaque: *mut c_void) {
    // SAFETY: opaque is the producer's Reports, alive for the call (see # Safety). Only a shared
    // reference is made: two threads polling at once may both run callbacks, and Reports is Sync
    // (mutexes and atomics).
    let reports = unsafe { &*(opaque as *const Reports) };
    // SAFETY: m is live for the call (see # Safety); only plain fields are read through the
    // reference, the error code through message_err (a broker's code may be one the bindings'
    // enum does not list).
    let (msg, code) = unsafe { (&*m, message_err(m)) };
    match rd::rd_kafka_resp_err_t::try_from(code) {
        Ok(rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR) => {}
        // Not a cause: records the client dropped because the transaction had already failed.
        Ok(rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__PURGE_QUEUE | rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__PURGE_INFLIGHT) => {
            reports.purged.fetch_add(1, Ordering::Relaxed);
        }
        _ => {
            reports.failed.fetch_add(1, Ordering::Relaxed);
            // Both buffers are in memory at once: the sum cannot overflow.
            let size = msg.len + msg.key_len;
            let failure = || {
                let key = (!msg.key.is_null()).then(|| {
                    // SAFETY: a non-null key points to key_len bytes of the message, alive for the
                    // call; copied (to_vec) before it returns.
                    unsafe { std::slice::from_raw_parts(msg.key as *const u8, msg.key_len) }.to_vec()
                });
                let topic = if msg.rkt.is_null() {
                    String::new()
                } else {
                    // SAFETY: a non-null rkt is the message's topic handle, alive for the call;
                    // its name is NUL-terminated and lives as long as it; text copies it.
                    unsafe { text(rd::rd_kafka_topic_name(msg.rkt)) }
                };
                // The opaque is the record's index + 1 (produce, produce_columns); null: unknown.
                // Wrapping: an index near u64::MAX must not overflow (a panic here would abort).
                let index = (msg._private as usize as i64).wrapping_sub(1);
                // Not rd_kafka_message_errstr: on a delivery report that returns the payload as text.
                (code_name(code), code_text(code), topic, msg.partition, key, size, index)
            };
            {
                let mut failures = lock(&reports.failures);
                if failures.len() < KEEP_FAILURES {
                    failures.push(failure());
                }
            }
            let mut largest = lock(&reports.largest);
            if largest.as_ref().is_none_or(|l| size > l.5) {
                *largest = Some(failure());
            }
        }
    }
}

/// librdkafka's error callback (error_cb): client errors, e.g. a refused login or TLS handshake,
/// which librdkafka reports only here, and keeps retrying. Same threads, and the same rule
/// against panics, as `on_delivery`.
///
/// # Safety
///
/// Only librdkafka calls it, as the error_cb `BranchProducer::new` sets: `opaque` is then that
/// producer's `Reports` (as for `on_delivery`), and `reason` is null or a NUL-terminated text that
/// librdkafka keeps alive for the call.
unsafe extern "C" fn on_error(_rk: *mut rd::rd_kafka_t, err: c_int, reason: *const c_char, opaque: *mut c_void) {
    // SAFETY: opaque is the producer's Reports, alive for the call (see # Safety); shared
    // reference only, as in on_delivery.
    let reports = unsafe { &*(opaque as *const Reports) };
    // The code as the int librdkafka passed: no conversion to the bindings' enum, which may not
    // list every code.
    // SAFETY: reason is null or NUL-terminated and alive for the call (see # Safety); text copies it.
    let entry = (code_name(err), unsafe { text(reason) });
    let mut errors = lock(&reports.client_errors);
    // One entry per error name, the newest last: a broker that refuses every connection sends
    // "all brokers down" after each of many quick reconnects, and must not push out the one
    // error that says why (a TLS or login failure, which librdkafka reports once, then
    // suppresses as identical).
    errors.retain(|(name, _)| *name != entry.0);
    if errors.len() >= KEEP_FAILURES {
        errors.remove(0); // not empty: KEEP_FAILURES > 0
    }
    errors.push(entry);
}

/// A producer's librdkafka handle.
#[derive(Clone, Copy)]
struct Client(*mut rd::rd_kafka_t);
// SAFETY: librdkafka's API is thread-safe, so the handle may be used from any thread (two
// transactional calls at once are refused by librdkafka with _CONFLICT, not raced). No copy is
// used after the handle is destroyed: release and Drop take it out of the BranchProducer first,
// which PyO3 allows only while no other method of it runs (even one that released the GIL), and
// `destroy_new` only destroys a handle no BranchProducer holds yet.
unsafe impl Send for Client {}
// SAFETY: one raw pointer, and Copy: a `&Client` on another thread gives nothing more than a copy
// sent there (Send, above).
unsafe impl Sync for Client {}

/// One branch's transactional producer. Executor side.
#[pyclass(module = "lastagent._native")]
pub struct BranchProducer {
    client: Option<Client>,
    reports: Arc<Reports>,
}

/// The (name, text) of an error object a transactional call returned, which it destroys; None
/// for null (no error).
///
/// # Safety
///
/// `error` is null or an `rd_kafka_error_t` the caller owns (just returned by librdkafka) and
/// does not use after: it is destroyed here.
unsafe fn take_error(error: *mut rd::rd_kafka_error_t) -> Option<KafkaErr> {
    if error.is_null() {
        return None;
    }
    // SAFETY: error is live and ours (the caller's contract). Its name and text live as long as it
    // and are copied (text) before it is destroyed, once.
    unsafe {
        let out = (text(rd::rd_kafka_error_name(error)), text(rd::rd_kafka_error_string(error)));
        rd::rd_kafka_error_destroy(error);
        Some(out)
    }
}

/// Key and value bytes of one Arrow column (binary or string, 32- or 64-bit offsets).
enum ByteColumn {
    Binary(ArrayRef),
}

impl ByteColumn {
    fn import(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Self> {
        let pair = obj.call_method0("__arrow_c_array__")?;
        let pair = pair.cast::<PyTuple>()?;
        let schema = pair.get_item(0)?;
        let array = pair.get_item(1)?;
        let schema = schema.cast::<PyCapsule>()?;
        let array = array.cast::<PyCapsule>()?;
        let schema_ptr = schema.pointer_checked(Some(c"arrow_schema"))?.as_ptr() as *const FFI_ArrowSchema;
        let array_ptr = array.pointer_checked(Some(c"arrow_array"))?.as_ptr() as *mut FFI_ArrowArray;
        // SAFETY: by the Arrow PyCapsule protocol, capsules named "arrow_schema" and "arrow_array"
        // (checked above) hold an ArrowSchema and an ArrowArray of the C data interface, not yet
        // released, that describe each other; we trust the object's __arrow_c_array__ (pyarrow's,
        // from the sink) to keep to it, as pyarrow itself does: the data is not validated. Both
        // capsules are alive (bound here) and fresh from the call, so no other Python code runs
        // between getting the pointers and using them. from_raw moves the array out (the capsule's
        // release becomes a no-op) and the imported data owns it from then on; the schema is only
        // read, and the capsule releases it.
        let data = unsafe {
            let ffi = FFI_ArrowArray::from_raw(array_ptr);
            arrow_array::ffi::from_ffi(ffi, &*schema_ptr)
        }
        .map_err(|e| NativeKafkaError::new_err(format!("{what}: Arrow import failed: {e}")))?;
        let array = make_array(data);
        match array.data_type() {
            DataType::Binary | DataType::LargeBinary | DataType::Utf8 | DataType::LargeUtf8 => Ok(ByteColumn::Binary(array)),
            other => Err(NativeKafkaError::new_err(format!("{what}: an Arrow {other} column; binary or string expected"))),
        }
    }

    fn len(&self) -> usize {
        let ByteColumn::Binary(a) = self;
        a.len()
    }

    fn get(&self, i: usize) -> Option<&[u8]> {
        let ByteColumn::Binary(a) = self;
        if a.is_null(i) {
            return None;
        }
        Some(match a.data_type() {
            DataType::Binary => a.as_binary::<i32>().value(i),
            DataType::LargeBinary => a.as_binary::<i64>().value(i),
            DataType::Utf8 => a.as_string::<i32>().value(i).as_bytes(),
            _ => a.as_string::<i64>().value(i).as_bytes(),
        })
    }
}

/// A record's index as librdkafka's per-message opaque: index + 1, so that null means "unknown".
fn opaque(index: u64) -> *mut c_void {
    (index as usize).wrapping_add(1) as *mut c_void
}

fn ptr_len(b: Option<&[u8]>) -> (*const c_void, usize) {
    match b {
        Some(b) => (b.as_ptr() as *const c_void, b.len()),
        None => (ptr::null(), 0),
    }
}

impl BranchProducer {
    fn client(&self) -> PyResult<Client> {
        self.client.ok_or_else(|| NativeKafkaError::new_err("the producer is released"))
    }
}

#[pymethods]
impl BranchProducer {
    /// Creates the producer from librdkafka settings (name, value) pairs; transactional.id among them.
    /// `token_provider`: for SASL/OAUTHBEARER, a callable returning (token, expiry in ms since the
    /// epoch, principal, extensions dict), called on librdkafka's background thread (oauth.rs).
    #[new]
    #[pyo3(signature = (settings, token_provider=None))]
    fn new(py: Python<'_>, settings: Vec<(String, String)>, token_provider: Option<Bound<'_, PyAny>>) -> PyResult<Self> {
        let token_provider = token_provider.as_ref().map(TokenProvider::new).transpose()?;
        let with_tokens = token_provider.is_some();
        let reports = Arc::new(Reports { token_provider, ..Reports::default() });
        let conf = new_conf(&settings)?;
        // SAFETY: conf is live and ours (new_conf). Its opaque is the Reports: the Arc keeps it at
        // one address, and the producer owns the Arc (`reports`) until after rd_kafka_destroy
        // (release, Drop; or the failure path below, before the Arc is dropped), so the callbacks,
        // which read it as a `Reports`, never outlive it. The callbacks have librdkafka's
        // signatures (checked by the bindings' types); `configure::<Reports>` matches the type the
        // opaque points at.
        unsafe {
            rd::rd_kafka_conf_set_opaque(conf, Arc::as_ptr(&reports) as *mut c_void);
            rd::rd_kafka_conf_set_dr_msg_cb(conf, Some(on_delivery));
            rd::rd_kafka_conf_set_error_cb(conf, Some(on_error));
            if with_tokens {
                oauth::configure::<Reports>(conf);
            }
        }
        let mut errbuf = [0 as c_char; 512];
        // SAFETY: conf is live and ours; errbuf is writable for errbuf.len() bytes. On success the
        // handle takes the conf (rd_kafka_new frees it); on failure it stays ours.
        let rk = unsafe { rd::rd_kafka_new(rd::rd_kafka_type_t::RD_KAFKA_PRODUCER, conf, errbuf.as_mut_ptr(), errbuf.len()) };
        if rk.is_null() {
            // SAFETY: rd_kafka_new failed, so conf is still ours: destroyed once, not used after;
            // errbuf holds librdkafka's NUL-terminated text (zeroed before, never unterminated).
            let reason = unsafe {
                rd::rd_kafka_conf_destroy(conf);
                text(errbuf.as_ptr())
            };
            return Err(NativeKafkaError::new_err(format!("creating the producer failed: {reason}")));
        }
        if with_tokens {
            // SAFETY: rk is live, created from a conf prepared by oauth::configure.
            if let Err(e) = unsafe { oauth::serve_in_background(rk) } {
                // SAFETY: rk is live and known to nothing else yet; destroyed once, here, before
                // the Reports its opaque points at is dropped (on return).
                unsafe { destroy_new(py, rk) };
                return Err(NativeKafkaError::new_err(format!(
                    "a token_provider needs security.protocol SASL_PLAINTEXT or SASL_SSL and sasl.mechanism OAUTHBEARER: {e}"
                )));
            }
        }
        Ok(BranchProducer { client: Some(Client(rk)), reports })
    }

    /// Fences older producers of the transactional.id and aborts their open transaction.
    ///
    /// A broker connection is made first (a metadata request for no topic). librdkafka's
    /// init_transactions asks for the transaction coordinator at once; when no connection is up
    /// yet it asks again only on its coordinator query timer, 500 ms later, unless a broker's
    /// state change re-triggers it first: the bimodal init_transactions (about 60 or 510 ms) of
    /// docs/benchmarks.md, "One sink task, step by step". If the metadata request fails or times
    /// out, init_transactions runs anyway and reports the cause.
    fn init_transactions(&self, py: Python<'_>, timeout_ms: i32) -> PyResult<Option<KafkaErr>> {
        let c = self.client()?;
        Ok(py.detach(move || {
            let c = c;
            let started = std::time::Instant::now();
            let mut md: *const rd::rd_kafka_metadata_t = ptr::null();
            // SAFETY: c.0 is live (this call holds `&self`, which keeps release and Drop out); on
            // success librdkafka hands us the metadata, destroyed once here and not used after.
            unsafe {
                let err = rd::rd_kafka_metadata(c.0, 0, ptr::null_mut(), &mut md, timeout_ms);
                if err == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR && !md.is_null() {
                    rd::rd_kafka_metadata_destroy(md);
                }
            }
            let left = (timeout_ms as i64 - started.elapsed().as_millis() as i64).max(1) as i32;
            // SAFETY: as above; the error object returned is ours, for take_error to destroy.
            unsafe { take_error(rd::rd_kafka_init_transactions(c.0, left)) }
        }))
    }

    fn begin_transaction(&self) -> PyResult<Option<KafkaErr>> {
        let c = self.client()?;
        // SAFETY: c.0 is live (this call holds `&self`); the error object returned is ours, for
        // take_error to destroy.
        Ok(unsafe { take_error(rd::rd_kafka_begin_transaction(c.0)) })
    }

    fn abort_transaction(&self, py: Python<'_>, timeout_ms: i32) -> PyResult<Option<KafkaErr>> {
        let c = self.client()?;
        Ok(py.detach(move || {
            let c = c;
            // SAFETY: c.0 is live (this call holds `&self`); the error object returned is ours,
            // for take_error to destroy.
            unsafe { take_error(rd::rd_kafka_abort_transaction(c.0, timeout_ms)) }
        }))
    }

    /// Adds one record (partition -1: the partitioner decides). Waits while the local queue is full.
    /// `index` is the record's index among the branch's records; a delivery report names it.
    #[pyo3(signature = (topic, value, key, partition, headers, index))]
    #[allow(clippy::too_many_arguments)]
    fn produce(
        &self,
        py: Python<'_>,
        topic: &str,
        value: Option<&[u8]>,
        key: Option<&[u8]>,
        partition: i32,
        headers: Option<Vec<(String, Option<Vec<u8>>)>>,
        index: u64,
    ) -> PyResult<Option<KafkaErr>> {
        let c = self.client()?;
        let ctopic = cstring("topic", topic)?;
        let names = match &headers {
            Some(hs) => hs.iter().map(|(k, _)| cstring("header key", k)).collect::<PyResult<Vec<_>>>()?,
            None => Vec::new(),
        };
        loop {
            let (vptr, vlen) = ptr_len(value);
            let (kptr, klen) = ptr_len(key);
            // SAFETY: c.0 is live (this call holds `&self`). The header list is ours: never null
            // (librdkafka aborts when out of memory), its names (NUL-terminated CStrings in
            // `names`, one per header) and values (copied; a null value with size 0) are copied
            // into it. producev gets each argument with the C type its tag's RD_KAFKA_V_* macro
            // gives (topic: const char *, partition: int32_t, value: void * + size_t, key:
            // const void * + size_t, flags: int, headers: rd_kafka_headers_t *, opaque: void *),
            // ended by RD_KAFKA_VTYPE_END; ctopic, value and key outlive the call and are copied
            // (RD_KAFKA_MSG_F_COPY; the topic always). On success the message takes the header list;
            // on failure it stays ours and is destroyed here, once. The per-message opaque is an
            // integer, never dereferenced (on_delivery reads it back as one).
            let err = unsafe {
                let hdrs = match &headers {
                    Some(hs) if !hs.is_empty() => {
                        let h = rd::rd_kafka_headers_new(hs.len());
                        for ((_, v), name) in hs.iter().zip(&names) {
                            let (p, n) = ptr_len(v.as_deref());
                            rd::rd_kafka_header_add(h, name.as_ptr(), -1, p, if p.is_null() { 0 } else { n as isize });
                        }
                        h
                    }
                    _ => ptr::null_mut(),
                };
                // A null headers list means none (librdkafka's producev takes it so).
                let err = rd::rd_kafka_producev(
                    c.0,
                    rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_TOPIC as c_int, ctopic.as_ptr(),
                    rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_PARTITION as c_int, partition,
                    rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_VALUE as c_int, vptr as *mut c_void, vlen,
                    rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_KEY as c_int, kptr, klen,
                    rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_MSGFLAGS as c_int, rd::RD_KAFKA_MSG_F_COPY as c_int,
                    rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_HEADERS as c_int, hdrs,
                    rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_OPAQUE as c_int, opaque(index),
                    rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_END as c_int,
                );
                if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR && !hdrs.is_null() {
                    rd::rd_kafka_headers_destroy(hdrs); // not taken over on failure
                }
                err
            };
            match err {
                rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR => return Ok(None),
                rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__QUEUE_FULL => {
                    // Local queue full: serve delivery reports until there is room. Bounded memory.
                    py.detach(move || {
                        let c = c;
                        // SAFETY: c.0 is live (this call holds `&self`); the callbacks poll may
                        // run find the Reports alive (the producer holds it).
                        unsafe { rd::rd_kafka_poll(c.0, QUEUE_FULL_WAIT_MS) }
                    });
                }
                err => return Ok(Some((err_name(err), err_text(err)))),
            }
        }
    }

    /// Adds one record per row of the Arrow columns to `topic` (the partitioner decides), copying
    /// keys and values once, into librdkafka's queue. Returns (records added, error or None).
    /// Row i is the branch's record `first_index + i`; a delivery report names that index.
    #[pyo3(signature = (topic, keys, values, first_index))]
    fn produce_columns(
        &self,
        py: Python<'_>,
        topic: &str,
        keys: Option<Bound<'_, PyAny>>,
        values: Bound<'_, PyAny>,
        first_index: u64,
    ) -> PyResult<(usize, Option<KafkaErr>)> {
        let c = self.client()?;
        let ctopic = cstring("topic", topic)?;
        let values = ByteColumn::import(&values, "value")?;
        let keys = keys.map(|k| ByteColumn::import(&k, "key")).transpose()?;
        if let Some(k) = &keys {
            if k.len() != values.len() {
                return Err(NativeKafkaError::new_err(format!("{} keys for {} values", k.len(), values.len())));
            }
        }
        // c.0 is live through the closure: this call holds `&self`, which keeps release and Drop
        // out; the callbacks poll runs find the Reports alive (the producer holds it).
        Ok(py.detach(move || {
            let c = c;
            // SAFETY: c.0 is live (above); ctopic outlives the call (copied); a null topic conf
            // means the default. A topic handle returned is ours: destroyed once, at the end.
            let rkt = unsafe { rd::rd_kafka_topic_new(c.0, ctopic.as_ptr(), ptr::null_mut()) };
            if rkt.is_null() {
                // SAFETY: no precondition: this thread's last error, set by the failed call above.
                let err = unsafe { rd::rd_kafka_last_error() };
                return (0, Some((err_name(err), err_text(err))));
            }
            let mut done = 0usize;
            let mut failed = None;
            while done < values.len() {
                let (vptr, vlen) = ptr_len(values.get(done));
                let (kptr, klen) = ptr_len(keys.as_ref().and_then(|k| k.get(done)));
                // SAFETY: rkt is our live topic handle; the value and key point into the Arrow
                // buffers of `values`/`keys` (vlen/klen bytes, or null and 0), alive in this
                // closure, and are copied (RD_KAFKA_MSG_F_COPY); partition -1 is
                // RD_KAFKA_PARTITION_UA; the per-message opaque is an integer, never dereferenced.
                let rc = unsafe {
                    rd::rd_kafka_produce(rkt, -1, rd::RD_KAFKA_MSG_F_COPY as c_int, vptr as *mut c_void, vlen, kptr, klen,
                                         opaque(first_index + done as u64))
                };
                if rc == 0 {
                    done += 1;
                    if done.is_multiple_of(1000) {
                        // SAFETY: c.0 is live (above).
                        unsafe { rd::rd_kafka_poll(c.0, 0) };
                    }
                    continue;
                }
                // SAFETY: no precondition: this thread's last error, set by the failed produce.
                match unsafe { rd::rd_kafka_last_error() } {
                    // SAFETY: c.0 is live (above).
                    rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__QUEUE_FULL => unsafe {
                        rd::rd_kafka_poll(c.0, QUEUE_FULL_WAIT_MS); // local queue full: bounded memory
                    },
                    err => {
                        failed = Some((err_name(err), err_text(err)));
                        break;
                    }
                }
            }
            // SAFETY: c.0 is live (above); rkt is ours, destroyed once, here, and not used after.
            unsafe {
                rd::rd_kafka_poll(c.0, 0);
                rd::rd_kafka_topic_destroy(rkt);
            }
            (done, failed)
        }))
    }

    /// Serves delivery reports and client errors for up to `timeout_ms`.
    fn poll(&self, py: Python<'_>, timeout_ms: i32) -> PyResult<()> {
        let c = self.client()?;
        py.detach(move || {
            let c = c;
            // SAFETY: c.0 is live (this call holds `&self`); the callbacks poll runs find the
            // Reports alive (the producer holds it).
            unsafe { rd::rd_kafka_poll(c.0, timeout_ms) };
        });
        Ok(())
    }

    /// Waits until every record is delivered or failed, up to `timeout_ms`; returns how many are left.
    ///
    /// rd_kafka_flush waits for the queue to empty in steps of up to 10 ms, each ended early only by
    /// a delivery report; with delivery.report.only.error a delivered record makes none, so even a
    /// flush whose records were acknowledged in 1 ms took 10 ms (bench/task_phases.py). So the first
    /// 20 ms go in 1 ms calls, the rest in one.
    fn flush(&self, py: Python<'_>, timeout_ms: i32) -> PyResult<i32> {
        let c = self.client()?;
        Ok(py.detach(move || {
            let c = c;
            let started = std::time::Instant::now();
            // SAFETY: c.0 is live (this call holds `&self`); the callbacks flush runs find the
            // Reports alive (the producer holds it).
            unsafe {
                loop {
                    let spent = started.elapsed().as_millis().min(i32::MAX as u128) as i32;
                    let left = timeout_ms.saturating_sub(spent).max(0);
                    rd::rd_kafka_flush(c.0, if spent < 20 { left.min(1) } else { left });
                    if left == 0 || rd::rd_kafka_outq_len(c.0) == 0 {
                        break;
                    }
                }
                rd::rd_kafka_outq_len(c.0)
            }
        }))
    }

    /// (failed records, records dropped with a failed transaction, client errors), as reported so far.
    fn reports(&self) -> (Vec<Failure>, u64, Vec<KafkaErr>) {
        (
            lock(&self.reports.failures).clone(),
            self.reports.purged.load(Ordering::Relaxed),
            lock(&self.reports.client_errors).clone(),
        )
    }

    /// (how many records failed, the largest of them), as reported so far. Cheap: no copy of the list.
    fn failed(&self) -> (u64, Option<Failure>) {
        (self.reports.failed.load(Ordering::Relaxed), lock(&self.reports.largest).clone())
    }

    /// True once a record failed or was dropped with a failed transaction: the transaction can no
    /// longer commit, so waiting for the rest of its records is pointless.
    fn has_failed(&self) -> bool {
        self.reports.failed.load(Ordering::Relaxed) > 0 || self.reports.purged.load(Ordering::Relaxed) > 0
    }

    /// Destroys the client now: threads and sockets go, an open transaction stays open (librdkafka's
    /// destroy sends no EndTxn), to be ended by whoever holds the branch's handle.
    fn release(&mut self, py: Python<'_>) {
        if let Some(c) = self.client.take() {
            py.detach(move || {
                let c = c;
                // SAFETY: taken out of self under `&mut self`: no other copy is in use, and later
                // calls find the producer released, so it is destroyed once. The Reports the
                // callbacks read stays (self.reports) until after.
                unsafe { rd::rd_kafka_destroy(c.0) }
            });
        }
    }
}

impl Drop for BranchProducer {
    /// Runs with the GIL held (the Python object's deallocation); destroys the handle before the
    /// fields (the Reports and its token provider) go.
    fn drop(&mut self) {
        if let Some(c) = self.client.take() {
            // Without the GIL: rd_kafka_destroy joins the background thread, whose token refresh
            // may be waiting for the GIL.
            Python::attach(|py| {
                py.detach(move || {
                    let c = c;
                    // SAFETY: the handle is live and taken out of self in its Drop: nothing else can
                    // use it; destroyed once, before the fields (the Reports) go.
                    unsafe { rd::rd_kafka_destroy(c.0) }
                })
            });
        }
    }
}
