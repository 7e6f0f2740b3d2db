//! lastagent's compiled Kafka path (`lastagent._native`). Runs on executors, inside Spark's
//! Python worker.
//!
//! `BranchProducer` (producer.rs) is the sink's transactional branch producer. Both clients log
//! in with SASL/OAUTHBEARER through a Python token provider when given one (oauth.rs).
//!
//! `RangeConsumer` reads one partition's offset range with librdkafka and builds the records
//! straight into Arrow arrays, in the row schema of Spark's `kafka` source, without a Python
//! object per record. Each batch goes to pyarrow through the Arrow C data interface (the
//! `__arrow_c_array__` PyCapsule protocol). The range's rules (where it ends, what counts as
//! data loss, how long to wait) stay in Python (`lastagent.sources.kafka_source.read_range`):
//! this module only says what it saw (a full batch, the end of the range, a reset, an error).
//!
//! Every `unsafe` block says why it is sound in a `// SAFETY:` comment, every `unsafe fn` in a
//! `# Safety` section (clippy checks the blocks: `undocumented_unsafe_blocks`). The rules most of
//! them rest on:
//! - A client's librdkafka handle lives as long as its Rust object holds it. Only `close`/`release`
//!   (`&mut self`) and `Drop` take it out, to destroy it; PyO3's borrow flag refuses them while any
//!   other method of the object runs, even one that released the GIL. So a handle in hand is live.
//! - librdkafka's API is thread-safe ("the calling application may call any of the API functions
//!   from any of its own threads at any time", INTRODUCTION.md), except concurrent batch consume
//!   calls on one queue, which `next_batch` (`&mut self`) rules out.
//! - Error codes that come from a broker are read as the C `int` they are, never as the bindings'
//!   `rd_kafka_resp_err_t`: that is a Rust enum, and a code librdkafka 2.12.1 does not list (a
//!   newer broker's) would be an invalid value of it (undefined behaviour).

#![warn(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr;
use std::sync::Arc;

use arrow_array::builder::{
    BinaryBuilder, Int32Builder, Int64Builder, ListBuilder, StringBuilder, StructBuilder,
    TimestampMicrosecondBuilder,
};
use arrow_array::{Array, ArrayRef, StructArray};
use arrow_schema::{DataType, Field, Fields, TimeUnit};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;
use rdkafka_sys as rd;

mod delta;
mod oauth;
mod producer;

use oauth::TokenProvider;

create_exception!(_native, NativeKafkaError, PyException, "librdkafka refused a call (the message says which).");
create_exception!(_native, SettingRefused, NativeKafkaError, "librdkafka refused a setting: args are (name, librdkafka's text).");

/// Messages taken from librdkafka's queue per call (as confluent-kafka's `consume()` batches).
const CHUNK: usize = 10_000;

/// A librdkafka consumer handle and its consumer queue (never null in a RangeConsumer; null only in
/// `destroy_new`'s, which does not use it). librdkafka handles are thread-safe.
#[derive(Clone, Copy)]
struct Handle {
    rk: *mut rd::rd_kafka_t,
    queue: *mut rd::rd_kafka_queue_t,
}
// SAFETY: librdkafka's API is thread-safe, for the rd_kafka_t and its queue alike, so the pointers
// may be used from any thread; the one exception, two rd_kafka_consume_batch_queue calls at once,
// cannot happen (`fill` runs only under next_batch's `&mut RangeConsumer`). No copy is used after
// the handle is destroyed: `destroy` runs only on a Handle just taken out of its RangeConsumer
// (close, Drop), which PyO3 allows only while no other method of it runs, and `destroy_new` only
// on a handle no RangeConsumer holds yet.
unsafe impl Send for Handle {}
// SAFETY: a Handle is two raw pointers and Copy: a `&Handle` on another thread gives nothing more
// than a copy sent there (Send, above).
unsafe impl Sync for Handle {}

extern "C" {
    // Error codes as the C `int` librdkafka passes (see the module's notes): the same functions as
    // the bindings' rd_kafka_err2name/err2str/query_watermark_offsets, with `c_int` for the
    // `rd_kafka_resp_err_t` C enum, which is int-sized (the bindings' enum is `#[repr(i32)]`).
    #[link_name = "rd_kafka_err2name"]
    fn err2name_code(err: c_int) -> *const c_char;
    #[link_name = "rd_kafka_err2str"]
    fn err2str_code(err: c_int) -> *const c_char;
    #[link_name = "rd_kafka_query_watermark_offsets"]
    fn query_watermark_offsets_code(
        rk: *mut rd::rd_kafka_t,
        topic: *const c_char,
        partition: i32,
        low: *mut i64,
        high: *mut i64,
        timeout_ms: c_int,
    ) -> c_int;
}

/// `RD_KAFKA_RESP_ERR_NO_ERROR` as the C `int`.
const NO_ERROR: c_int = rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR as c_int;

fn cstring(what: &str, s: &str) -> PyResult<CString> {
    CString::new(s).map_err(|_| NativeKafkaError::new_err(format!("{what} contains a NUL byte")))
}

/// A copy of a C string from librdkafka (invalid UTF-8 replaced); "" for null.
///
/// # Safety
///
/// `p` is null or points to a NUL-terminated string that stays valid and unchanged until `text`
/// returns. The copy is made before it returns, so a string that is freed or rewritten right
/// after (one owned by a message or error object about to be destroyed, librdkafka's
/// thread-local buffers) is fine.
unsafe fn text(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: p is non-null, NUL-terminated and valid for this call (the caller's contract);
        // the borrow ends with the copy (into_owned), inside the call.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// librdkafka's name of an error code, e.g. "_TRANSPORT", "UNKNOWN_TOPIC_OR_PART", "ERR_120?".
fn code_name(code: c_int) -> String {
    // SAFETY: any int is accepted; the result points into librdkafka's static error table, or for
    // a code it does not list into a thread-local buffer only a later call on this thread rewrites.
    // `text` copies it at once.
    unsafe { text(err2name_code(code)) }
}

/// librdkafka's description of an error code.
fn code_text(code: c_int) -> String {
    // SAFETY: as in code_name (static table, or a thread-local buffer for an unknown code).
    unsafe { text(err2str_code(code)) }
}

fn err_name(err: rd::rd_kafka_resp_err_t) -> String {
    code_name(err as c_int)
}

fn err_text(err: rd::rd_kafka_resp_err_t) -> String {
    code_text(err as c_int)
}

/// The error code of a message, as the C `int` it is (see the module's notes): a consumer error
/// or a failed delivery can carry a broker's code the bindings' enum does not list.
///
/// # Safety
///
/// `m` points to a live `rd_kafka_message_t`.
unsafe fn message_err(m: *const rd::rd_kafka_message_t) -> c_int {
    // SAFETY: m is live (the caller's contract); `err` is a C enum, int-sized and aligned as an
    // int (the bindings' field is a #[repr(i32)] enum), read through a raw pointer so that no
    // value of the Rust enum is made.
    unsafe { ptr::addr_of!((*m).err).cast::<c_int>().read() }
}

/// A librdkafka configuration from (name, value) pairs; the caller owns it. A setting librdkafka
/// refuses is an error naming it.
fn new_conf(settings: &[(String, String)]) -> PyResult<*mut rd::rd_kafka_conf_t> {
    // SAFETY: no precondition. Never null (librdkafka aborts when out of memory); the conf is ours
    // until rd_kafka_new takes it, and destroyed here on every error path below.
    let conf = unsafe { rd::rd_kafka_conf_new() };
    let mut errbuf = [0 as c_char; 512];
    for (name, value) in settings {
        let (cname, cvalue) = match cstring(name, name).and_then(|n| Ok((n, cstring(name, value)?))) {
            Ok(pair) => pair,
            Err(e) => {
                // SAFETY: conf is ours (not given to rd_kafka_new), destroyed once, not used after.
                unsafe { rd::rd_kafka_conf_destroy(conf) };
                return Err(e);
            }
        };
        // SAFETY: conf is live and ours; cname and cvalue are NUL-terminated and outlive the call
        // (librdkafka copies what it keeps); errbuf is writable for errbuf.len() bytes.
        let res = unsafe { rd::rd_kafka_conf_set(conf, cname.as_ptr(), cvalue.as_ptr(), errbuf.as_mut_ptr(), errbuf.len()) };
        if res != rd::rd_kafka_conf_res_t::RD_KAFKA_CONF_OK {
            // SAFETY: librdkafka wrote a NUL-terminated text into errbuf (zeroed before, so never
            // unterminated); conf is ours, destroyed once, not used after.
            let reason = unsafe {
                rd::rd_kafka_conf_destroy(conf);
                text(errbuf.as_ptr())
            };
            return Err(SettingRefused::new_err((name.clone(), reason)));
        }
    }
    Ok(conf)
}

/// Why a `next_batch` call returned.
enum Stop {
    /// The batch holds `max_rows` records.
    Full,
    /// A record, or the end of the partition, at or beyond `until`: the range is read.
    Done,
    /// No message within the wait.
    Wait,
    /// The position is out of range (`auto.offset.reset=error`): records are gone.
    Reset,
    /// Any other error, as (librdkafka's name, its text).
    Error(String, String),
}

impl Stop {
    fn status(&self) -> &'static str {
        match self {
            Stop::Full => "full",
            Stop::Done => "done",
            Stop::Wait => "wait",
            Stop::Reset => "reset",
            Stop::Error(..) => "error",
        }
    }
}

/// Column builders for one batch, in the order of Spark's `kafka` source schema.
struct Columns {
    rows: usize,
    key: BinaryBuilder,
    value: BinaryBuilder,
    offset: Int64Builder,
    timestamp: TimestampMicrosecondBuilder,
    timestamp_type: Int32Builder,
    headers: Option<ListBuilder<StructBuilder>>,
}

fn header_fields() -> Fields {
    Fields::from(vec![Field::new("key", DataType::Utf8, true), Field::new("value", DataType::Binary, true)])
}

impl Columns {
    fn new(capacity: usize, include_headers: bool) -> Self {
        Columns {
            rows: 0,
            key: BinaryBuilder::with_capacity(capacity, 0),
            value: BinaryBuilder::with_capacity(capacity, capacity * 64),
            offset: Int64Builder::with_capacity(capacity),
            timestamp: TimestampMicrosecondBuilder::with_capacity(capacity).with_timezone("UTC"),
            timestamp_type: Int32Builder::with_capacity(capacity),
            headers: include_headers.then(|| {
                ListBuilder::new(StructBuilder::from_fields(header_fields(), 0))
            }),
        }
    }

    /// Appends one data message.
    ///
    /// # Safety
    ///
    /// `m` points to a live message taken from the consumer queue, without error, and is not
    /// destroyed before `add` returns: its key, value and headers are copied out of it here.
    unsafe fn add(&mut self, m: *const rd::rd_kafka_message_t) {
        // SAFETY: m is live for this call (the caller's contract); only its plain fields are read
        // through this reference (the error code, an enum, is not).
        let msg = unsafe { &*m };
        if msg.key.is_null() {
            self.key.append_null();
        } else {
            // SAFETY: a non-null key points to key_len bytes owned by the message (live, above);
            // append_value copies them.
            self.key.append_value(unsafe { std::slice::from_raw_parts(msg.key as *const u8, msg.key_len) });
        }
        if msg.payload.is_null() {
            self.value.append_null();
        } else {
            // SAFETY: for a message without error a non-null payload is its value, len bytes owned
            // by the message (live, above); append_value copies them.
            self.value.append_value(unsafe { std::slice::from_raw_parts(msg.payload as *const u8, msg.len) });
        }
        self.offset.append_value(msg.offset);
        let mut kind: rd::rd_kafka_timestamp_type_t = rd::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_NOT_AVAILABLE;
        // SAFETY: m is live; kind is a valid out-pointer, and librdkafka writes one of the three
        // rd_kafka_timestamp_type_t values (0, 1, 2) the bindings' enum lists.
        let millis = unsafe { rd::rd_kafka_message_timestamp(m, &mut kind) };
        self.timestamp.append_value(millis * 1000);
        // Kafka's TimestampType ids, as Spark shows them: -1 none, 0 CreateTime, 1 LogAppendTime.
        self.timestamp_type.append_value(kind as i32 - 1);
        if let Some(list) = self.headers.as_mut() {
            let mut hdrs: *mut rd::rd_kafka_headers_t = ptr::null_mut();
            // SAFETY: m is live; hdrs is a valid out-pointer. The list it gets belongs to the
            // message (valid until the message is destroyed, after this call) and is not freed here.
            let err = unsafe { rd::rd_kafka_message_headers(m, &mut hdrs) };
            let found = err == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
                && !hdrs.is_null()
                // SAFETY: hdrs is the message's live header list (non-null, just checked).
                && unsafe { rd::rd_kafka_header_cnt(hdrs) } > 0;
            if found {
                let entries = list.values();
                let mut idx = 0;
                loop {
                    let mut name: *const c_char = ptr::null();
                    let mut val: *const c_void = ptr::null();
                    let mut size: usize = 0;
                    // SAFETY: hdrs is the message's live header list; any idx is accepted (one past
                    // the last gives _NOENT); the out-pointers are valid locals.
                    let got = unsafe { rd::rd_kafka_header_get_all(hdrs, idx, &mut name, &mut val, &mut size) };
                    if got != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
                        break;
                    }
                    // Kafka header keys are UTF-8 strings; a malformed one is decoded as Java's
                    // consumer decodes it, with replacement characters.
                    // SAFETY: on success name is the header's NUL-terminated name, never null (it
                    // is stored inside the header), owned by the live list; the Cow borrowing it is
                    // used only until append_value copies it, below.
                    let key = unsafe { CStr::from_ptr(name) }.to_string_lossy();
                    entries
                        .field_builder::<StringBuilder>(0)
                        .expect("header_fields(): field 0 (key) is Utf8, built by a StringBuilder")
                        .append_value(key);
                    let vb = entries
                        .field_builder::<BinaryBuilder>(1)
                        .expect("header_fields(): field 1 (value) is Binary, built by a BinaryBuilder");
                    if val.is_null() {
                        vb.append_null();
                    } else {
                        // SAFETY: a non-null value points to size bytes owned by the live header
                        // list; append_value copies them.
                        vb.append_value(unsafe { std::slice::from_raw_parts(val as *const u8, size) });
                    }
                    entries.append(true);
                    idx += 1;
                }
                list.append(true);
            } else {
                // Spark's kafka source gives null, not an empty array, for a record without headers.
                list.append(false);
            }
        }
        self.rows += 1;
    }

    fn finish(mut self, topic: &str, partition: i32) -> StructArray {
        let n = self.rows;
        let mut topics = StringBuilder::with_capacity(n, n * topic.len());
        let mut partitions = Int32Builder::with_capacity(n);
        for _ in 0..n {
            topics.append_value(topic);
            partitions.append_value(partition);
        }
        let mut fields = vec![
            Field::new("key", DataType::Binary, true),
            Field::new("value", DataType::Binary, true),
            Field::new("topic", DataType::Utf8, true),
            Field::new("partition", DataType::Int32, true),
            Field::new("offset", DataType::Int64, true),
            Field::new("timestamp", DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), true),
            Field::new("timestampType", DataType::Int32, true),
        ];
        let mut arrays: Vec<ArrayRef> = vec![
            Arc::new(self.key.finish()),
            Arc::new(self.value.finish()),
            Arc::new(topics.finish()),
            Arc::new(partitions.finish()),
            Arc::new(self.offset.finish()),
            Arc::new(self.timestamp.finish()),
            Arc::new(self.timestamp_type.finish()),
        ];
        if let Some(mut list) = self.headers.take() {
            let headers = list.finish();
            fields.push(Field::new("headers", headers.data_type().clone(), true));
            arrays.push(Arc::new(headers));
        }
        StructArray::new(Fields::from(fields), arrays, None)
    }
}

/// One batch of records, exported once through the Arrow PyCapsule protocol
/// (`pyarrow.record_batch(batch)` imports it without a copy).
#[pyclass(module = "lastagent._native")]
struct ArrowBatch {
    array: Option<StructArray>,
    rows: usize,
}

#[pymethods]
impl ArrowBatch {
    #[pyo3(signature = (requested_schema=None))]
    fn __arrow_c_array__<'py>(
        &mut self,
        py: Python<'py>,
        requested_schema: Option<Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyCapsule>, Bound<'py, PyCapsule>)> {
        let _ = requested_schema; // the schema is Spark's kafka source schema; no cast is offered
        let array = self
            .array
            .take()
            .ok_or_else(|| NativeKafkaError::new_err("this batch was already exported"))?;
        let (array, schema) = arrow_array::ffi::to_ffi(&array.into_data())
            .map_err(|e| NativeKafkaError::new_err(format!("Arrow export failed: {e}")))?;
        // The consumer of a capsule moves the structure out (its release becomes null); a capsule
        // dropped unread releases it here.
        let schema = PyCapsule::new_with_destructor(py, schema, Some(c"arrow_schema".to_owned()), |s, _| drop(s))?;
        let array = PyCapsule::new_with_destructor(py, array, Some(c"arrow_array".to_owned()), |a, _| drop(a))?;
        Ok((schema, array))
    }

    fn __len__(&self) -> usize {
        self.rows
    }
}

/// A librdkafka consumer that reads one assigned partition at a time into Arrow batches.
///
/// Executor side. Created with librdkafka settings (the same ones a confluent-kafka client
/// takes); reused by the Python worker's next reads with the same settings.
#[pyclass(module = "lastagent._native")]
struct RangeConsumer {
    handle: Option<Handle>,
    topic: String,
    partition: i32,
    /// SASL/OAUTHBEARER tokens (oauth.rs); the client's opaque points at it. Boxed: stays in place
    /// while the handle lives, and is dropped after it is destroyed (`Drop`). Only owned here:
    /// the token refresh callback reads it.
    #[allow(dead_code)]
    token_provider: Option<Box<TokenProvider>>,
}

impl RangeConsumer {
    fn handle(&self) -> PyResult<Handle> {
        self.handle.ok_or_else(|| NativeKafkaError::new_err("the consumer is closed"))
    }
}

/// Reads messages into `cols` until a stop condition. Runs without the GIL, under next_batch's
/// `&mut RangeConsumer`: `h` is live and no other consume call on its queue runs meanwhile.
fn fill(h: Handle, cols: &mut Columns, until: i64, max_rows: usize, wait_ms: i32) -> (Stop, i64) {
    let mut msgs: Vec<*mut rd::rd_kafka_message_t> = vec![ptr::null_mut(); CHUNK.min(max_rows.max(1))];
    let mut next = -1i64;
    loop {
        if cols.rows >= max_rows {
            return (Stop::Full, next);
        }
        // Never take more data messages than the batch has room for: a message taken is never
        // put back, so the queue must keep what this batch cannot hold.
        let want = msgs.len().min(max_rows - cols.rows);
        // What the queue holds now, without waiting: the batch call waits for `want` messages or
        // its whole timeout, which would hold back a range's last records for that long.
        // SAFETY: h.queue is the live consumer queue (see above), used by no other batch consume
        // call meanwhile (which librdkafka does not allow); msgs has room for `want` (at most
        // msgs.len()) pointers, librdkafka fills at most that many, and returns how many it filled:
        // each a message we now own, destroyed below.
        let mut n = unsafe { rd::rd_kafka_consume_batch_queue(h.queue, 0, msgs.as_mut_ptr(), want) };
        if n < 0 {
            // SAFETY: no precondition: this thread's last error, set by the failed call above.
            let err = unsafe { rd::rd_kafka_last_error() };
            return (Stop::Error(err_name(err), err_text(err)), next);
        }
        if n == 0 {
            // Nothing queued: wait for the first message only, and go on as soon as it comes.
            // SAFETY: h.queue is the live consumer queue (see above); a message returned is ours,
            // destroyed below.
            let m = unsafe { rd::rd_kafka_consume_queue(h.queue, wait_ms) };
            if m.is_null() {
                return (Stop::Wait, next);
            }
            msgs[0] = m;
            n = 1;
        }
        let mut stop: Option<Stop> = None;
        // 0 < n <= want <= msgs.len(): the slice is in bounds.
        for &m in &msgs[..n as usize] {
            if stop.is_none() {
                // SAFETY: m is a message librdkafka gave us above (non-null), live until it is
                // destroyed at the end of this iteration; only plain fields are read through the
                // reference, the error code through message_err.
                let (msg, code) = unsafe { (&*m, message_err(m)) };
                match rd::rd_kafka_resp_err_t::try_from(code) {
                    Ok(rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR) => {
                        if msg.offset >= until {
                            stop = Some(Stop::Done);
                        } else {
                            // SAFETY: m is live until its destroy below, and without error.
                            unsafe { cols.add(m) };
                            next = msg.offset + 1;
                        }
                    }
                    Ok(rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__PARTITION_EOF) => {
                        // Under read_committed the range may end in markers or aborted records
                        // that are never delivered: the end of the partition at `until` ends it.
                        if msg.offset >= until {
                            stop = Some(Stop::Done);
                        }
                    }
                    Ok(rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__AUTO_OFFSET_RESET) => stop = Some(Stop::Reset),
                    // SAFETY: m is live; for a message with an error, librdkafka's text is the
                    // message's payload (NUL-terminated, freed with it) or a static one, and text
                    // copies it before the destroy below.
                    _ => stop = Some(Stop::Error(code_name(code), unsafe { text(rd::rd_kafka_message_errstr(m)) })),
                }
            }
            // SAFETY: m is ours (from the consume call above) and destroyed exactly once, here;
            // nothing borrowed from it is used after.
            unsafe { rd::rd_kafka_message_destroy(m) };
        }
        if let Some(s) = stop {
            return (s, next);
        }
        if next >= until {
            return (Stop::Done, next); // the range's last record is in: no need to see what follows
        }
    }
}

#[pymethods]
impl RangeConsumer {
    /// Creates the consumer from librdkafka settings (name, value) pairs.
    /// `token_provider`: for SASL/OAUTHBEARER, a callable returning (token, expiry in ms since the
    /// epoch, principal, extensions dict), called on librdkafka's background thread (oauth.rs).
    #[new]
    #[pyo3(signature = (settings, token_provider=None))]
    fn new(py: Python<'_>, settings: Vec<(String, String)>, token_provider: Option<Bound<'_, PyAny>>) -> PyResult<Self> {
        let token_provider = token_provider.as_ref().map(TokenProvider::new).transpose()?.map(Box::new);
        let conf = new_conf(&settings)?;
        if let Some(p) = &token_provider {
            // SAFETY: conf is live and ours (new_conf). Its opaque is the boxed provider: the Box
            // keeps it at one address, and the consumer owns it (`token_provider`) until after
            // rd_kafka_destroy (`destroy`, from close or Drop; or the failure paths below, before
            // the Box is dropped), which joins the background thread the refresh callback runs on.
            // `configure::<TokenProvider>` matches the type the opaque points at.
            unsafe {
                rd::rd_kafka_conf_set_opaque(conf, &**p as *const TokenProvider as *mut c_void);
                oauth::configure::<TokenProvider>(conf);
            }
        }
        let mut errbuf = [0 as c_char; 512];
        // SAFETY: conf is live and ours; errbuf is writable for errbuf.len() bytes. On success the
        // handle takes the conf (rd_kafka_new frees it); on failure it stays ours.
        let rk = unsafe { rd::rd_kafka_new(rd::rd_kafka_type_t::RD_KAFKA_CONSUMER, conf, errbuf.as_mut_ptr(), errbuf.len()) };
        if rk.is_null() {
            // SAFETY: rd_kafka_new failed, so conf is still ours: destroyed once, not used after;
            // errbuf holds librdkafka's NUL-terminated text (zeroed before, never unterminated).
            let reason = unsafe {
                rd::rd_kafka_conf_destroy(conf);
                text(errbuf.as_ptr())
            };
            return Err(NativeKafkaError::new_err(format!("creating the consumer failed: {reason}")));
        }
        if token_provider.is_some() {
            // SAFETY: rk is live, created from a conf prepared by oauth::configure.
            if let Err(e) = unsafe { oauth::serve_in_background(rk) } {
                // SAFETY: rk is live and known to nothing else yet; destroyed once, here, before
                // the provider its opaque points at is dropped (on return).
                unsafe { destroy_new(py, rk) };
                return Err(NativeKafkaError::new_err(format!(
                    "a token_provider needs security.protocol SASL_PLAINTEXT or SASL_SSL and sasl.mechanism OAUTHBEARER: {e}"
                )));
            }
        }
        // Errors and logs of the client come out of the consumer queue, in order with the records.
        // SAFETY: rk is a live consumer handle. The queue is a new reference of ours (released in
        // `destroy`), or null when the consumer has no group (no group.id).
        let queue = unsafe {
            rd::rd_kafka_poll_set_consumer(rk);
            rd::rd_kafka_queue_get_consumer(rk)
        };
        if queue.is_null() {
            // SAFETY: as above: rk is live and known to nothing else yet; destroyed once, here.
            unsafe { destroy_new(py, rk) };
            return Err(NativeKafkaError::new_err("the consumer needs a group.id (librdkafka gives no consumer queue without one)"));
        }
        Ok(RangeConsumer { handle: Some(Handle { rk, queue }), topic: String::new(), partition: -1, token_provider })
    }

    /// Assigns one partition from `offset` (replacing any earlier assignment).
    fn assign(&mut self, topic: &str, partition: i32, offset: i64) -> PyResult<()> {
        let h = self.handle()?;
        let ctopic = cstring("topic", topic)?;
        // SAFETY: h.rk is live (a handle in hand: this call holds `&mut self`). The list is ours:
        // never null (librdkafka aborts when out of memory); tp points into it (never null either)
        // until it is destroyed, and the topic name is copied into it; rd_kafka_assign copies the
        // list, which is destroyed once, after.
        let err = unsafe {
            let list = rd::rd_kafka_topic_partition_list_new(1);
            let tp = rd::rd_kafka_topic_partition_list_add(list, ctopic.as_ptr(), partition);
            (*tp).offset = offset;
            let err = rd::rd_kafka_assign(h.rk, list);
            rd::rd_kafka_topic_partition_list_destroy(list);
            err
        };
        if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            return Err(NativeKafkaError::new_err(format!("assigning {topic}-{partition}: {}", err_text(err))));
        }
        self.topic = topic.to_owned();
        self.partition = partition;
        Ok(())
    }

    /// Drops the assignment (and the records prefetched for it).
    fn unassign(&mut self) -> PyResult<()> {
        let h = self.handle()?;
        // SAFETY: h.rk is live (this call holds `&mut self`); a null list clears the assignment.
        let err = unsafe { rd::rd_kafka_assign(h.rk, ptr::null()) };
        if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            return Err(NativeKafkaError::new_err(format!("unassigning: {}", err_text(err))));
        }
        Ok(())
    }

    /// The partition's (low, high) watermark offsets, asked of the broker.
    fn watermarks(&self, py: Python<'_>, topic: &str, partition: i32, timeout_ms: i32) -> PyResult<(i64, i64)> {
        let h = self.handle()?;
        let ctopic = cstring("topic", topic)?;
        let (err, low, high) = py.detach(move || {
            let h = h; // the whole Handle (Send), not its raw-pointer field
            let (mut low, mut high) = (0i64, 0i64);
            // SAFETY: h.rk is live (this call holds `&self`, which keeps close and Drop out);
            // ctopic (moved in here) outlives the call; low and high are valid out-pointers. The
            // code is the broker's, hence read as a C int (query_watermark_offsets_code).
            let err = unsafe { query_watermark_offsets_code(h.rk, ctopic.as_ptr(), partition, &mut low, &mut high, timeout_ms) };
            (err, low, high)
        });
        if err != NO_ERROR {
            return Err(NativeKafkaError::new_err(format!("watermarks of {topic}-{partition}: {}", code_text(err))));
        }
        Ok((low, high))
    }

    /// Reads the assigned partition into one batch of at most `max_rows` records below `until`.
    ///
    /// Returns (batch or None, the offset after the batch's last record or -1, status, error):
    /// status "full", "done" (the range is read), "wait" (nothing within `wait_ms`), "reset"
    /// (the position is out of range) or "error", with error = (librdkafka's name, text).
    #[pyo3(signature = (until, max_rows, wait_ms, include_headers))]
    fn next_batch(
        &mut self,
        py: Python<'_>,
        until: i64,
        max_rows: usize,
        wait_ms: i32,
        include_headers: bool,
    ) -> PyResult<NextBatch> {
        let h = self.handle()?;
        let (cols, stop, next) = py.detach(move || {
            let mut cols = Columns::new(max_rows.min(65_536), include_headers);
            let (stop, next) = fill(h, &mut cols, until, max_rows, wait_ms);
            (cols, stop, next)
        });
        let batch = (cols.rows > 0).then(|| {
            let rows = cols.rows;
            ArrowBatch { array: Some(cols.finish(&self.topic, self.partition)), rows }
        });
        let status = stop.status();
        let error = match stop {
            Stop::Error(name, text) => Some((name, text)),
            _ => None,
        };
        Ok((batch, next, status, error))
    }

    /// Leaves and destroys the client; the object is unusable afterwards.
    fn close(&mut self, py: Python<'_>) {
        if let Some(h) = self.handle.take() {
            // SAFETY: taken out of self under `&mut self`: no other copy is in use, and the next
            // call finds the consumer closed, so it is destroyed once.
            py.detach(move || unsafe { destroy(h) });
        }
    }
}

/// What `next_batch` returns: (the batch or None, the offset after the batch's last record or -1,
/// the status, the error as (librdkafka's name, text) or None).
type NextBatch = (Option<ArrowBatch>, i64, &'static str, Option<(String, String)>);

/// Closes and destroys a consumer handle. Without the GIL: rd_kafka_destroy joins the background
/// thread, whose token refresh may be waiting for the GIL.
///
/// # Safety
///
/// `h` is live and nobody uses it (or a copy of it) during or after the call: it was just taken
/// out of its RangeConsumer. Called once per handle.
unsafe fn destroy(h: Handle) {
    // SAFETY: h is live and ours alone (the caller's contract). The queue reference goes first, as
    // rd_kafka_queue_get_consumer requires before rd_kafka_consumer_close; rd_kafka_destroy then
    // frees the handle (and the conf it took), once.
    unsafe {
        rd::rd_kafka_queue_destroy(h.queue);
        rd::rd_kafka_consumer_close(h.rk);
        rd::rd_kafka_destroy(h.rk);
    }
}

/// Destroys a client handle that failed its setup in `new`, without the GIL (a token refresh
/// already under way waits for it).
///
/// # Safety
///
/// `rk` is a live handle that nothing else knows (not in a Rust object yet): destroyed once, here.
/// Whatever its conf's opaque points at outlives the call.
pub(crate) unsafe fn destroy_new(py: Python<'_>, rk: *mut rd::rd_kafka_t) {
    let h = Handle { rk, queue: ptr::null_mut() };
    py.detach(move || {
        let h = h; // the whole Handle (Send), not its raw-pointer field
        // SAFETY: h.rk is live and ours alone (the caller's contract); destroyed once.
        unsafe { rd::rd_kafka_destroy(h.rk) }
    });
}

impl Drop for RangeConsumer {
    /// Runs with the GIL held (the Python object's deallocation); destroys the handle before the
    /// token provider goes.
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            // Without the GIL: rd_kafka_destroy joins the background thread, whose token refresh
            // may be waiting for the GIL. The provider goes after, with the other fields.
            // SAFETY: taken out of self in its Drop: nothing else can use it; destroyed once.
            Python::attach(|py| py.detach(move || unsafe { destroy(h) }));
        }
    }
}

/// The librdkafka version this module was built with, e.g. "2.12.1".
#[pyfunction]
fn librdkafka_version() -> String {
    // SAFETY: no precondition; the result is a NUL-terminated thread-local buffer, written by the
    // first call on this thread and unchanged after; text copies it.
    unsafe { text(rd::rd_kafka_version_str()) }
}

/// librdkafka's `builtin.features` of this build, e.g. "gzip,snappy,ssl,sasl,...,zstd,...".
#[pyfunction]
fn librdkafka_features() -> String {
    let name = c"builtin.features";
    // SAFETY: no precondition; never null (librdkafka aborts when out of memory); ours, destroyed
    // below once both reads are done.
    let conf = unsafe { rd::rd_kafka_conf_new() };
    let mut size: usize = 0;
    // SAFETY: conf is live and ours; name is NUL-terminated; a null dest asks only for the size
    // (with the NUL), written to size.
    let res = unsafe { rd::rd_kafka_conf_get(conf, name.as_ptr(), ptr::null_mut(), &mut size) };
    let mut buf = vec![0 as c_char; size.max(1)];
    let mut len = buf.len();
    let ok = res == rd::rd_kafka_conf_res_t::RD_KAFKA_CONF_OK && {
        // SAFETY: conf is live and ours; buf is writable for len bytes; librdkafka writes at most
        // len bytes, NUL-terminated.
        let res = unsafe { rd::rd_kafka_conf_get(conf, name.as_ptr(), buf.as_mut_ptr(), &mut len) };
        res == rd::rd_kafka_conf_res_t::RD_KAFKA_CONF_OK
    };
    let features = if ok {
        // SAFETY: buf holds a NUL-terminated text (zeroed before, so never unterminated).
        unsafe { text(buf.as_ptr()) }
    } else {
        String::new()
    };
    // SAFETY: conf is ours (never given to rd_kafka_new), destroyed once, not used after.
    unsafe { rd::rd_kafka_conf_destroy(conf) };
    features
}

extern "C" {
    /// OpenSSL's libcrypto (1.1.0 and later), linked in through rdkafka-sys's `ssl` feature
    /// (openssl-sys): the system's library in a development build, a static copy in a portable
    /// wheel (`portable` feature).
    fn OpenSSL_version(kind: c_int) -> *const c_char;
}

/// The OpenSSL librdkafka runs with: its version text and the directory it was configured with
/// (OPENSSLDIR, where it looks for its default CA certificates), e.g.
/// ("OpenSSL 3.6.3 ...", "OPENSSLDIR: \"/usr/lib/ssl\"").
#[pyfunction]
fn openssl_version() -> (String, String) {
    // OPENSSL_VERSION and OPENSSL_DIR in opensslv.h / crypto.h.
    const OPENSSL_VERSION: c_int = 0;
    const OPENSSL_DIR: c_int = 4;
    // SAFETY: any kind is accepted; the result is a static NUL-terminated string; text copies it.
    unsafe { (text(OpenSSL_version(OPENSSL_VERSION)), text(OpenSSL_version(OPENSSL_DIR))) }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RangeConsumer>()?;
    m.add_class::<ArrowBatch>()?;
    m.add_class::<producer::BranchProducer>()?;
    m.add("DeltaKernelError", m.py().get_type::<delta::DeltaKernelError>())?;
    m.add_function(wrap_pyfunction!(delta::delta_write_gate, m)?)?;
    m.add_function(wrap_pyfunction!(delta::delta_commit_epoch, m)?)?;
    m.add_function(wrap_pyfunction!(delta::delta_set_properties, m)?)?;
    m.add_function(wrap_pyfunction!(delta::delta_commit_actions, m)?)?;
    m.add_function(wrap_pyfunction!(delta::delta_create_table, m)?)?;
    m.add_function(wrap_pyfunction!(delta::delta_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(delta::delta_snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(delta::delta_app_versions, m)?)?;
    m.add_function(wrap_pyfunction!(delta::delta_commit_infos, m)?)?;
    m.add_function(wrap_pyfunction!(delta::delta_scan_files, m)?)?;
    m.add_function(wrap_pyfunction!(librdkafka_version, m)?)?;
    m.add_function(wrap_pyfunction!(librdkafka_features, m)?)?;
    m.add_function(wrap_pyfunction!(openssl_version, m)?)?;
    oauth::watch_shutdown(m.py())?;
    m.add("NativeKafkaError", m.py().get_type::<NativeKafkaError>())?;
    m.add("SettingRefused", m.py().get_type::<SettingRefused>())?;
    Ok(())
}
