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
use std::sync::{Arc, Mutex};

use arrow_array::cast::AsArray;
use arrow_array::{make_array, Array, ArrayRef};
use arrow_data::ffi::FFI_ArrowArray;
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::DataType;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyTuple};
use rdkafka_sys as rd;

use crate::oauth::{self, TokenProvider, TokenSource};
use crate::{cstring, err_name, err_text, new_conf, text, NativeKafkaError};

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

extern "C" {
    #[link_name = "rd_kafka_err2name"]
    fn err2name_raw(err: c_int) -> *const c_char;
}

unsafe extern "C" fn on_delivery(_rk: *mut rd::rd_kafka_t, m: *const rd::rd_kafka_message_t, opaque: *mut c_void) {
    // delivery.report.only.error: called (from poll/flush) for failed records only.
    let reports = &*(opaque as *const Reports);
    let msg = &*m;
    match msg.err {
        rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR => {}
        // Not a cause: records the client dropped because the transaction had already failed.
        rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__PURGE_QUEUE | rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__PURGE_INFLIGHT => {
            reports.purged.fetch_add(1, Ordering::Relaxed);
        }
        err => {
            reports.failed.fetch_add(1, Ordering::Relaxed);
            let size = msg.len + msg.key_len;
            let failure = || {
                let key = (!msg.key.is_null())
                    .then(|| std::slice::from_raw_parts(msg.key as *const u8, msg.key_len).to_vec());
                let topic = if msg.rkt.is_null() { String::new() } else { text(rd::rd_kafka_topic_name(msg.rkt)) };
                // The opaque is the record's index + 1 (produce, produce_columns); null: unknown.
                let index = (msg._private as usize as i64) - 1;
                // Not rd_kafka_message_errstr: on a delivery report that returns the payload as text.
                (err_name(err), err_text(err), topic, msg.partition, key, size, index)
            };
            {
                let mut failures = reports.failures.lock().unwrap();
                if failures.len() < KEEP_FAILURES {
                    failures.push(failure());
                }
            }
            let mut largest = reports.largest.lock().unwrap();
            if largest.as_ref().is_none_or(|l| size > l.5) {
                *largest = Some(failure());
            }
        }
    }
}

unsafe extern "C" fn on_error(_rk: *mut rd::rd_kafka_t, err: c_int, reason: *const c_char, opaque: *mut c_void) {
    // librdkafka reports a refused login or TLS handshake only here, and keeps retrying.
    let reports = &*(opaque as *const Reports);
    let mut errors = reports.client_errors.lock().unwrap();
    if errors.len() >= KEEP_FAILURES {
        errors.remove(0);
    }
    // The code as the int librdkafka passed: no conversion to the bindings' enum, which may not
    // list every code.
    errors.push((text(err2name_raw(err)), text(reason)));
}

#[derive(Clone, Copy)]
struct Client(*mut rd::rd_kafka_t);
unsafe impl Send for Client {}
unsafe impl Sync for Client {}

/// One branch's transactional producer. Executor side.
#[pyclass(module = "lastagent._native")]
pub struct BranchProducer {
    client: Option<Client>,
    reports: Arc<Reports>,
}

unsafe fn take_error(error: *mut rd::rd_kafka_error_t) -> Option<KafkaErr> {
    if error.is_null() {
        return None;
    }
    let out = (text(rd::rd_kafka_error_name(error)), text(rd::rd_kafka_error_string(error)));
    rd::rd_kafka_error_destroy(error);
    Some(out)
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
        let data = unsafe {
            let schema_ptr = schema.pointer_checked(Some(c"arrow_schema"))?.as_ptr() as *const FFI_ArrowSchema;
            let array_ptr = array.pointer_checked(Some(c"arrow_array"))?.as_ptr() as *mut FFI_ArrowArray;
            // Moves the array out of its capsule (the capsule's release becomes a no-op).
            let ffi = FFI_ArrowArray::from_raw(array_ptr);
            arrow_array::ffi::from_ffi(ffi, &*schema_ptr)
                .map_err(|e| NativeKafkaError::new_err(format!("{what}: Arrow import failed: {e}")))?
        };
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
        unsafe {
            let conf = new_conf(&settings)?;
            let mut errbuf = [0 as c_char; 512];
            rd::rd_kafka_conf_set_opaque(conf, Arc::as_ptr(&reports) as *mut c_void);
            rd::rd_kafka_conf_set_dr_msg_cb(conf, Some(on_delivery));
            rd::rd_kafka_conf_set_error_cb(conf, Some(on_error));
            if with_tokens {
                // SAFETY: conf is live; its opaque is the Reports, which the producer keeps until
                // after rd_kafka_destroy (release, Drop).
                oauth::configure::<Reports>(conf);
            }
            let rk = rd::rd_kafka_new(rd::rd_kafka_type_t::RD_KAFKA_PRODUCER, conf, errbuf.as_mut_ptr(), errbuf.len());
            if rk.is_null() {
                rd::rd_kafka_conf_destroy(conf);
                return Err(NativeKafkaError::new_err(format!("creating the producer failed: {}", text(errbuf.as_ptr()))));
            }
            if with_tokens {
                // SAFETY: rk was just created from a conf prepared by oauth::configure.
                if let Err(e) = oauth::serve_in_background(rk) {
                    let c = Client(rk);
                    // Without the GIL: a refresh already under way waits for it.
                    py.detach(move || {
                        let c = c;
                        // SAFETY: rk is live and not shared yet; destroyed once.
                        rd::rd_kafka_destroy(c.0)
                    });
                    return Err(NativeKafkaError::new_err(format!(
                        "a token_provider needs security.protocol SASL_PLAINTEXT or SASL_SSL and sasl.mechanism OAUTHBEARER: {e}"
                    )));
                }
            }
            Ok(BranchProducer { client: Some(Client(rk)), reports })
        }
    }

    /// Fences older producers of the transactional.id and aborts their open transaction.
    fn init_transactions(&self, py: Python<'_>, timeout_ms: i32) -> PyResult<Option<KafkaErr>> {
        let c = self.client()?;
        Ok(py.detach(move || {
            let c = c;
            unsafe { take_error(rd::rd_kafka_init_transactions(c.0, timeout_ms)) }
        }))
    }

    fn begin_transaction(&self) -> PyResult<Option<KafkaErr>> {
        let c = self.client()?;
        Ok(unsafe { take_error(rd::rd_kafka_begin_transaction(c.0)) })
    }

    fn abort_transaction(&self, py: Python<'_>, timeout_ms: i32) -> PyResult<Option<KafkaErr>> {
        let c = self.client()?;
        Ok(py.detach(move || {
            let c = c;
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
        Ok(py.detach(move || {
            let c = c;
            let rkt = unsafe { rd::rd_kafka_topic_new(c.0, ctopic.as_ptr(), ptr::null_mut()) };
            if rkt.is_null() {
                let err = unsafe { rd::rd_kafka_last_error() };
                return (0, Some((err_name(err), err_text(err))));
            }
            let mut done = 0usize;
            let mut failed = None;
            while done < values.len() {
                let (vptr, vlen) = ptr_len(values.get(done));
                let (kptr, klen) = ptr_len(keys.as_ref().and_then(|k| k.get(done)));
                let rc = unsafe {
                    rd::rd_kafka_produce(rkt, -1, rd::RD_KAFKA_MSG_F_COPY as c_int, vptr as *mut c_void, vlen, kptr, klen,
                                         opaque(first_index + done as u64))
                };
                if rc == 0 {
                    done += 1;
                    if done % 1000 == 0 {
                        unsafe { rd::rd_kafka_poll(c.0, 0) };
                    }
                    continue;
                }
                match unsafe { rd::rd_kafka_last_error() } {
                    rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__QUEUE_FULL => unsafe {
                        rd::rd_kafka_poll(c.0, QUEUE_FULL_WAIT_MS); // local queue full: bounded memory
                    },
                    err => {
                        failed = Some((err_name(err), err_text(err)));
                        break;
                    }
                }
            }
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
            unsafe { rd::rd_kafka_poll(c.0, timeout_ms) };
        });
        Ok(())
    }

    /// Waits until every record is delivered or failed, up to `timeout_ms`; returns how many are left.
    fn flush(&self, py: Python<'_>, timeout_ms: i32) -> PyResult<i32> {
        let c = self.client()?;
        Ok(py.detach(move || {
            let c = c;
            unsafe {
                rd::rd_kafka_flush(c.0, timeout_ms);
                rd::rd_kafka_outq_len(c.0)
            }
        }))
    }

    /// (failed records, records dropped with a failed transaction, client errors), as reported so far.
    fn reports(&self) -> (Vec<Failure>, u64, Vec<KafkaErr>) {
        (
            self.reports.failures.lock().unwrap().clone(),
            self.reports.purged.load(Ordering::Relaxed),
            self.reports.client_errors.lock().unwrap().clone(),
        )
    }

    /// (how many records failed, the largest of them), as reported so far. Cheap: no copy of the list.
    fn failed(&self) -> (u64, Option<Failure>) {
        (self.reports.failed.load(Ordering::Relaxed), self.reports.largest.lock().unwrap().clone())
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
                    // SAFETY: the handle is live and taken out of self: destroyed once.
                    unsafe { rd::rd_kafka_destroy(c.0) }
                })
            });
        }
    }
}
