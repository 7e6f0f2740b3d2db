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

use std::ffi::{c_char, c_void, CStr, CString};
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

mod oauth;
mod producer;

use oauth::TokenProvider;

create_exception!(_native, NativeKafkaError, PyException, "librdkafka refused a call (the message says which).");
create_exception!(_native, SettingRefused, NativeKafkaError, "librdkafka refused a setting: args are (name, librdkafka's text).");

/// Messages taken from librdkafka's queue per call (as confluent-kafka's `consume()` batches).
const CHUNK: usize = 10_000;

/// A librdkafka consumer handle and its consumer queue. librdkafka handles are thread-safe.
#[derive(Clone, Copy)]
struct Handle {
    rk: *mut rd::rd_kafka_t,
    queue: *mut rd::rd_kafka_queue_t,
}
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

fn cstring(what: &str, s: &str) -> PyResult<CString> {
    CString::new(s).map_err(|_| NativeKafkaError::new_err(format!("{what} contains a NUL byte")))
}

unsafe fn text(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

fn err_name(err: rd::rd_kafka_resp_err_t) -> String {
    unsafe { text(rd::rd_kafka_err2name(err)) }
}

fn err_text(err: rd::rd_kafka_resp_err_t) -> String {
    unsafe { text(rd::rd_kafka_err2str(err)) }
}

/// A librdkafka configuration from (name, value) pairs; the caller owns it. A setting librdkafka
/// refuses is an error naming it.
fn new_conf(settings: &[(String, String)]) -> PyResult<*mut rd::rd_kafka_conf_t> {
    unsafe {
        let conf = rd::rd_kafka_conf_new();
        let mut errbuf = [0 as c_char; 512];
        for (name, value) in settings {
            let (cname, cvalue) = (cstring(name, name)?, cstring(name, value)?);
            let res = rd::rd_kafka_conf_set(conf, cname.as_ptr(), cvalue.as_ptr(), errbuf.as_mut_ptr(), errbuf.len());
            if res != rd::rd_kafka_conf_res_t::RD_KAFKA_CONF_OK {
                rd::rd_kafka_conf_destroy(conf);
                return Err(SettingRefused::new_err((name.clone(), text(errbuf.as_ptr()))));
            }
        }
        Ok(conf)
    }
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

    /// Appends one data message. Safety: `m` is a live message without error.
    unsafe fn add(&mut self, m: *const rd::rd_kafka_message_t) {
        let msg = &*m;
        if msg.key.is_null() {
            self.key.append_null();
        } else {
            self.key.append_value(std::slice::from_raw_parts(msg.key as *const u8, msg.key_len));
        }
        if msg.payload.is_null() {
            self.value.append_null();
        } else {
            self.value.append_value(std::slice::from_raw_parts(msg.payload as *const u8, msg.len));
        }
        self.offset.append_value(msg.offset);
        let mut kind: rd::rd_kafka_timestamp_type_t = rd::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_NOT_AVAILABLE;
        let millis = rd::rd_kafka_message_timestamp(m, &mut kind);
        self.timestamp.append_value(millis * 1000);
        // Kafka's TimestampType ids, as Spark shows them: -1 none, 0 CreateTime, 1 LogAppendTime.
        self.timestamp_type.append_value(kind as i32 - 1);
        if let Some(list) = self.headers.as_mut() {
            let mut hdrs: *mut rd::rd_kafka_headers_t = ptr::null_mut();
            let found = rd::rd_kafka_message_headers(m, &mut hdrs) == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
                && !hdrs.is_null()
                && rd::rd_kafka_header_cnt(hdrs) > 0;
            if found {
                let entries = list.values();
                let mut idx = 0;
                loop {
                    let mut name: *const c_char = ptr::null();
                    let mut val: *const c_void = ptr::null();
                    let mut size: usize = 0;
                    if rd::rd_kafka_header_get_all(hdrs, idx, &mut name, &mut val, &mut size)
                        != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
                    {
                        break;
                    }
                    // Kafka header keys are UTF-8 strings; a malformed one is decoded as Java's
                    // consumer decodes it, with replacement characters.
                    let key = CStr::from_ptr(name).to_string_lossy();
                    entries.field_builder::<StringBuilder>(0).unwrap().append_value(key);
                    let vb = entries.field_builder::<BinaryBuilder>(1).unwrap();
                    if val.is_null() {
                        vb.append_null();
                    } else {
                        vb.append_value(std::slice::from_raw_parts(val as *const u8, size));
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

/// Reads messages into `cols` until a stop condition. Runs without the GIL.
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
        let mut n = unsafe { rd::rd_kafka_consume_batch_queue(h.queue, 0, msgs.as_mut_ptr(), want) };
        if n < 0 {
            let err = unsafe { rd::rd_kafka_last_error() };
            return (Stop::Error(err_name(err), err_text(err)), next);
        }
        if n == 0 {
            // Nothing queued: wait for the first message only, and go on as soon as it comes.
            let m = unsafe { rd::rd_kafka_consume_queue(h.queue, wait_ms) };
            if m.is_null() {
                return (Stop::Wait, next);
            }
            msgs[0] = m;
            n = 1;
        }
        let mut stop: Option<Stop> = None;
        for &m in &msgs[..n as usize] {
            unsafe {
                if stop.is_none() {
                    let msg = &*m;
                    match msg.err {
                        rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR => {
                            if msg.offset >= until {
                                stop = Some(Stop::Done);
                            } else {
                                cols.add(m);
                                next = msg.offset + 1;
                            }
                        }
                        rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__PARTITION_EOF => {
                            // Under read_committed the range may end in markers or aborted records
                            // that are never delivered: the end of the partition at `until` ends it.
                            if msg.offset >= until {
                                stop = Some(Stop::Done);
                            }
                        }
                        rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__AUTO_OFFSET_RESET => stop = Some(Stop::Reset),
                        err => stop = Some(Stop::Error(err_name(err), text(rd::rd_kafka_message_errstr(m)))),
                    }
                }
                rd::rd_kafka_message_destroy(m);
            }
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
        unsafe {
            let conf = new_conf(&settings)?;
            let mut errbuf = [0 as c_char; 512];
            if let Some(p) = &token_provider {
                rd::rd_kafka_conf_set_opaque(conf, &**p as *const TokenProvider as *mut c_void);
                // SAFETY: conf is live; its opaque is the boxed provider, which the consumer keeps
                // (in place) until after rd_kafka_destroy (close, Drop).
                oauth::configure::<TokenProvider>(conf);
            }
            let rk = rd::rd_kafka_new(rd::rd_kafka_type_t::RD_KAFKA_CONSUMER, conf, errbuf.as_mut_ptr(), errbuf.len());
            if rk.is_null() {
                rd::rd_kafka_conf_destroy(conf); // not taken over on failure
                return Err(NativeKafkaError::new_err(format!("creating the consumer failed: {}", text(errbuf.as_ptr()))));
            }
            if token_provider.is_some() {
                // SAFETY: rk was just created from a conf prepared by oauth::configure.
                if let Err(e) = oauth::serve_in_background(rk) {
                    let rk = Handle { rk, queue: ptr::null_mut() };
                    // Without the GIL: a refresh already under way waits for it.
                    py.detach(move || {
                        let h = rk;
                        // SAFETY: rk is live and not shared yet; destroyed once.
                        rd::rd_kafka_destroy(h.rk)
                    });
                    return Err(NativeKafkaError::new_err(format!(
                        "a token_provider needs security.protocol SASL_PLAINTEXT or SASL_SSL and sasl.mechanism OAUTHBEARER: {e}"
                    )));
                }
            }
            // Errors and logs of the client come out of the consumer queue, in order with the records.
            rd::rd_kafka_poll_set_consumer(rk);
            let queue = rd::rd_kafka_queue_get_consumer(rk);
            Ok(RangeConsumer { handle: Some(Handle { rk, queue }), topic: String::new(), partition: -1, token_provider })
        }
    }

    /// Assigns one partition from `offset` (replacing any earlier assignment).
    fn assign(&mut self, topic: &str, partition: i32, offset: i64) -> PyResult<()> {
        let h = self.handle()?;
        let ctopic = cstring("topic", topic)?;
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
            let err = unsafe { rd::rd_kafka_query_watermark_offsets(h.rk, ctopic.as_ptr(), partition, &mut low, &mut high, timeout_ms) };
            (err, low, high)
        });
        if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            return Err(NativeKafkaError::new_err(format!("watermarks of {topic}-{partition}: {}", err_text(err))));
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
    ) -> PyResult<(Option<ArrowBatch>, i64, &'static str, Option<(String, String)>)> {
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
            py.detach(move || destroy(h));
        }
    }
}

fn destroy(h: Handle) {
    unsafe {
        rd::rd_kafka_queue_destroy(h.queue);
        rd::rd_kafka_consumer_close(h.rk);
        rd::rd_kafka_destroy(h.rk);
    }
}

impl Drop for RangeConsumer {
    /// Runs with the GIL held (the Python object's deallocation); destroys the handle before the
    /// token provider goes.
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            // Without the GIL: rd_kafka_destroy joins the background thread, whose token refresh
            // may be waiting for the GIL.
            Python::attach(|py| py.detach(move || destroy(h)));
        }
    }
}

/// The librdkafka version this module was built with, e.g. "2.12.1".
#[pyfunction]
fn librdkafka_version() -> String {
    unsafe { text(rd::rd_kafka_version_str()) }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RangeConsumer>()?;
    m.add_class::<ArrowBatch>()?;
    m.add_class::<producer::BranchProducer>()?;
    m.add_function(wrap_pyfunction!(librdkafka_version, m)?)?;
    oauth::watch_shutdown(m.py())?;
    m.add("NativeKafkaError", m.py().get_type::<NativeKafkaError>())?;
    m.add("SettingRefused", m.py().get_type::<SettingRefused>())?;
    Ok(())
}
