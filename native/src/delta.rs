//! lastagent's Delta commits through Delta Kernel (`delta_kernel` 0.30.1, its default engine on
//! `object_store`). Runs on the driver only: executors write Parquet with pyarrow and report add
//! actions as JSON; the driver hands them to kernel here.
//!
//! Every function takes the table's URI and the query's `storage.*` settings, reads the table at
//! the version the caller decided on (`read_version`) and commits the next version or reports a
//! conflict: the caller's race rules (re-read, check ownership and `txn`, decide again) stay in
//! Python, as with delta-rs and `max_commit_retries=0`. Kernel's own features (in-commit
//! timestamps, row tracking and its high-water mark, clustering statistics, checkpoints of the
//! table's kind) come with its transaction.
//!
//! Kernel cannot commit a change of table properties (0.30.1 emits a `metaData` action only for
//! schema changes), and delta-rs's property commit rewrites a writer-version-7 table's protocol.
//! `set_properties` therefore writes that one commit itself, as PROTOCOL.md describes it: a
//! `commitInfo` first (with the in-commit timestamp when the table has them) and the table's
//! `metaData` with only the given keys changed; no protocol action, so the table's versions and
//! features stay as they are. It is written put-if-absent, as kernel's own commits are. The same
//! writer (`commit_actions`) commits an epoch to a table kernel's transaction refuses (CHECK
//! constraints, generated columns, legacy protocols) but lastagent writes: there the commit is a
//! plain append (`commitInfo`, `txn`, the adds), as Spark's writer makes it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use delta_kernel::arrow::array::{ArrayRef, RecordBatch, StringArray};
use delta_kernel::arrow::datatypes::{DataType as ArrowType, Field as ArrowField, Schema as ArrowSchema};
use delta_kernel::committer::FileSystemCommitter;
use delta_kernel::engine::arrow_data::ArrowEngineData;
use delta_kernel::object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use delta_kernel::object_store::local::LocalFileSystem;
use delta_kernel::object_store::DynObjectStore;
use delta_kernel::schema::{DataType, MapType, StructField, StructType};
use delta_kernel::snapshot::{Snapshot, SnapshotRef};
use delta_kernel::transaction::{CommitResult, UpdateTableOperation};
use delta_kernel::{Engine, KernelError};
use delta_kernel_default_engine::executor::tokio::TokioMultiThreadExecutor;
use delta_kernel_default_engine::storage::store_from_url_opts;
use delta_kernel_default_engine::DefaultEngine;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use url::Url;

create_exception!(_native, DeltaKernelError, PyException, "Delta Kernel refused or failed a read or a commit (the message says which).");

type KernelEngine = DefaultEngine<TokioMultiThreadExecutor>;

/// The `engineInfo` of every commit lastagent makes.
const ENGINE_INFO: &str = concat!("lastagent/", env!("CARGO_PKG_VERSION"));

/// One engine per store and settings, for the process's life: an engine holds a Tokio runtime
/// (two worker threads) and the store's connection pool; a decision per epoch must not build one.
fn engine_for(url: &Url, storage: &HashMap<String, String>) -> Result<Arc<KernelEngine>, String> {
    static ENGINES: OnceLock<Mutex<HashMap<String, Arc<KernelEngine>>>> = OnceLock::new();
    let mut settings: Vec<_> = storage.iter().collect();
    settings.sort();
    let key = format!("{}://{}|{:?}", url.scheme(), url.host_str().unwrap_or(""), settings);
    let engines = ENGINES.get_or_init(|| Mutex::new(HashMap::new()));
    let mut engines = engines.lock().map_err(|_| "the Delta engine cache was poisoned by a panic".to_string())?;
    if let Some(engine) = engines.get(&key) {
        return Ok(engine.clone());
    }
    let store = store_for(url, storage)?;
    let executor = TokioMultiThreadExecutor::new_owned_runtime(Some(2), Some(8)).map_err(|e| e.to_string())?;
    let engine = Arc::new(DefaultEngine::builder(store).with_task_executor(Arc::new(executor)).build());
    engines.insert(key, engine.clone());
    Ok(engine)
}

/// The object store of a table's URL. S3 (`s3://`, `s3a://`, `s3n://`) starts from the environment
/// (`AWS_*`), as delta-rs and Spark's s3a do, then takes the `storage.*` settings, each one checked:
/// a setting object_store does not know is refused, never dropped. Google Cloud Storage (`gs://`) and Azure
/// (`abfss://`), the other stores `lastagent.storage` reaches, as kernel's default engine builds them from the
/// settings (object_store's own keys, which are delta-rs's).
fn store_for(url: &Url, storage: &HashMap<String, String>) -> Result<Arc<DynObjectStore>, String> {
    match url.scheme() {
        "file" => Ok(Arc::new(LocalFileSystem::new())),
        "s3" | "s3a" | "s3n" => {
            let bucket = url.host_str().ok_or_else(|| format!("{url}: no bucket"))?;
            let mut builder = AmazonS3Builder::from_env().with_bucket_name(bucket);
            for (key, value) in storage {
                let parsed: AmazonS3ConfigKey =
                    key.parse().map_err(|e| format!("storage setting {key:?}: {e}"))?;
                builder = builder.with_config(parsed, value);
            }
            Ok(Arc::new(builder.build().map_err(|e| e.to_string())?))
        }
        "gs" | "abfss" => store_from_url_opts(url, storage.iter()).map_err(|e| format!("{url}: {e}")),
        other => Err(format!(
            "{url}: lastagent reaches local paths, S3 (s3://, s3a://, s3n://), gs:// and abfss://; {other}:// is not \
             one of them"
        )),
    }
}

/// The table root as kernel wants it: a URL ending in '/'. A plain path is a local directory.
fn table_url(uri: &str) -> Result<Url, String> {
    let mut url = if uri.contains("://") {
        Url::parse(uri).map_err(|e| format!("{uri}: {e}"))?
    } else {
        let path = std::path::absolute(uri).map_err(|e| format!("{uri}: {e}"))?;
        Url::from_directory_path(&path).map_err(|_| format!("{uri}: not an absolute local path"))?
    };
    if !url.path().ends_with('/') {
        let path = format!("{}/", url.path());
        url.set_path(&path);
    }
    Ok(url)
}

fn err(e: impl std::fmt::Display) -> PyErr {
    DeltaKernelError::new_err(e.to_string())
}

fn snapshot(engine: &KernelEngine, url: &Url, version: u64) -> Result<SnapshotRef, KernelError> {
    Snapshot::builder_for(url.as_str()).at_version(version).build(engine)
}

/// The table at `version`, brought forward from the snapshot this process read last (kernel reads only the
/// newer commits), or read anew. `table_id` is the table's id as the caller read it (its metaData): a
/// snapshot of another table at the same path (dropped and made again) is never brought forward.
fn snapshot_at(engine: &KernelEngine, url: &Url, version: u64, table_id: &str) -> Result<SnapshotRef, String> {
    let cached = last_snapshots()?.get(url.as_str()).cloned();
    let same_table = |s: &SnapshotRef| s.table_configuration().metadata().id() == table_id;
    let snap = match cached {
        Some(s) if same_table(&s) && s.version() == version => s,
        Some(s) if same_table(&s) && s.version() < version => Snapshot::builder_from(s)
            .at_version(version)
            .build(engine)
            .or_else(|_| snapshot(engine, url, version))
            .map_err(|e| format!("cannot read {url}: {e}"))?,
        _ => snapshot(engine, url, version).map_err(|e| format!("cannot read {url}: {e}"))?,
    };
    if !same_table(&snap) {
        return Err(format!(
            "{url} is another table than the one read (table id {} at version {version}, not {table_id}); \
             it was dropped and made again meanwhile",
            snap.table_configuration().metadata().id()
        ));
    }
    remember(url, &snap)?;
    Ok(snap)
}

/// The newest snapshot this process read or committed, per table URL.
fn last_snapshots() -> Result<std::sync::MutexGuard<'static, HashMap<String, SnapshotRef>>, String> {
    static LAST: OnceLock<Mutex<HashMap<String, SnapshotRef>>> = OnceLock::new();
    LAST.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .map_err(|_| "the snapshot cache was poisoned by a panic".to_string())
}

fn remember(url: &Url, snap: &SnapshotRef) -> Result<(), String> {
    let mut last = last_snapshots()?;
    if last.get(url.as_str()).is_none_or(|s| s.version() <= snap.version()) {
        last.insert(url.to_string(), snap.clone());
    }
    Ok(())
}

/// Whether kernel would write to the table: kernel's write gate (every writer feature, the
/// invariants and constraints rules), run by building a transaction that is thrown away.
fn write_gate(engine: &KernelEngine, snap: &SnapshotRef) -> Option<String> {
    snap.clone()
        .update_table(UpdateTableOperation::StreamingUpdate, "lastagent", true)
        .build(engine, Box::new(FileSystemCommitter::new()))
        .err()
        .map(|e| e.to_string())
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// What every function here does first: the table's URL, its engine and its snapshot at `version` (see
/// [`snapshot_at`]); then `work`, with the GIL released. Errors become [`DeltaKernelError`].
fn on_snapshot<T: Send>(
    py: Python<'_>,
    uri: &str,
    storage: &HashMap<String, String>,
    version: u64,
    table_id: &str,
    work: impl FnOnce(&KernelEngine, &Url, SnapshotRef) -> Result<T, String> + Send,
) -> PyResult<T> {
    let url = table_url(uri).map_err(err)?;
    py.detach(|| {
        let engine = engine_for(&url, storage)?;
        let snap = snapshot_at(&engine, &url, version, table_id)?;
        work(&engine, &url, snap)
    })
    .map_err(err)
}

/// Kernel's reason for not writing to the table at `version` (its write gate: every writer feature, the
/// invariants and constraints rules, the iceberg validators), or None when it would. Asked at each epoch's start,
/// so a table kernel refuses is refused before anything is claimed or written.
#[pyfunction]
pub fn delta_write_gate(
    py: Python<'_>,
    uri: &str,
    storage: HashMap<String, String>,
    version: u64,
    table_id: &str,
) -> PyResult<Option<String>> {
    on_snapshot(py, uri, &storage, version, table_id, |engine, _, snap| Ok(write_gate(engine, &snap)))
}

/// A one-row batch of string columns, for kernel's `with_commit_info`.
fn commit_info_batch(fields: &[(String, String)]) -> Result<(Box<ArrowEngineData>, Arc<StructType>), String> {
    let arrow_fields: Vec<ArrowField> =
        fields.iter().map(|(k, _)| ArrowField::new(k, ArrowType::Utf8, true)).collect();
    let columns: Vec<ArrayRef> =
        fields.iter().map(|(_, v)| Arc::new(StringArray::from(vec![Some(v.as_str())])) as ArrayRef).collect();
    let batch = RecordBatch::try_new(Arc::new(ArrowSchema::new(arrow_fields)), columns).map_err(|e| e.to_string())?;
    let schema = StructType::try_new(fields.iter().map(|(k, _)| StructField::nullable(k, DataType::STRING)))
        .map_err(|e| e.to_string())?;
    Ok((Box::new(ArrowEngineData::new(batch)), Arc::new(schema)))
}

/// The add actions the tasks reported (JSON objects whose `stats` is Delta's JSON string), as the
/// typed rows kernel's `add_files` takes: the statistics parsed into the table's stats schema, so
/// kernel can check what the table's features require (`numRecords` for row tracking, the
/// clustering columns' statistics) and write them back as Delta's JSON.
fn add_rows(
    engine: &KernelEngine,
    adds: &[String],
    stats_schema: delta_kernel::schema::SchemaRef,
) -> Result<Box<dyn delta_kernel::EngineData>, String> {
    let mut lines = Vec::with_capacity(adds.len());
    for add in adds {
        let mut value: serde_json::Value = serde_json::from_str(add).map_err(|e| format!("add action {add}: {e}"))?;
        let object = value.as_object_mut().ok_or_else(|| format!("add action {add}: not an object"))?;
        if let Some(serde_json::Value::String(stats)) = object.get("stats").cloned() {
            let parsed: serde_json::Value =
                serde_json::from_str(&stats).map_err(|e| format!("stats of {add}: {e}"))?;
            object.insert("stats".into(), parsed);
        }
        lines.push(value.to_string());
    }
    let schema = StructType::try_new([
        StructField::not_null("path", DataType::STRING),
        StructField::not_null("partitionValues", MapType::new(DataType::STRING, DataType::STRING, true)),
        StructField::not_null("size", DataType::LONG),
        StructField::not_null("modificationTime", DataType::LONG),
        StructField::nullable("stats", stats_schema),
    ])
    .map_err(|e| e.to_string())?;
    let column: ArrayRef = Arc::new(StringArray::from(lines));
    let batch = RecordBatch::try_new(
        Arc::new(ArrowSchema::new(vec![ArrowField::new("json", ArrowType::Utf8, false)])),
        vec![column],
    )
    .map_err(|e| e.to_string())?;
    engine
        .json_handler()
        .parse_json(Box::new(ArrowEngineData::new(batch)), Arc::new(schema))
        .map_err(|e| format!("the tasks' add actions do not fit the table's statistics schema: {e}"))
}

/// Commits an epoch's files on top of `read_version`: the add actions, `txn(app_id, app_version)`,
/// the given commit-info fields (lastagent's record, `userMetadata`) and Spark's streaming
/// operation (`STREAMING UPDATE`, `outputMode`/`queryId`/`epochId` as given).
///
/// Returns `("committed", version)`, or `("conflict", version)` when another writer took
/// `read_version + 1` first: nothing is written then, and the caller reads the table again.
#[pyfunction]
#[pyo3(signature = (uri, storage, read_version, table_id, adds, app_id, app_version, commit_info, operation_parameters))]
#[allow(clippy::too_many_arguments)]
pub fn delta_commit_epoch(
    py: Python<'_>,
    uri: &str,
    storage: HashMap<String, String>,
    read_version: u64,
    table_id: &str,
    adds: Vec<String>,
    app_id: String,
    app_version: i64,
    commit_info: Vec<(String, String)>,
    operation_parameters: Vec<(String, String)>,
) -> PyResult<(String, u64)> {
    on_snapshot(py, uri, &storage, read_version, table_id, |engine, url, snap| {
        let (info, info_schema) = commit_info_batch(&commit_info)?;
        let mut builder = snap
            .update_table(UpdateTableOperation::StreamingUpdate, ENGINE_INFO, true)
            .with_transaction_id(app_id, app_version)
            .with_commit_info(info, info_schema)
            .with_operation_parameters(operation_parameters.into_iter().map(|(k, v)| (k, Some(v))));
        if !adds.is_empty() {
            builder = builder.with_blind_append();
        }
        let mut txn = builder
            .build(engine, Box::new(FileSystemCommitter::new()))
            .map_err(|e| format!("Delta Kernel will not write to {url}: {e}"))?;
        // The executors filled every column the rows lacked with its DEFAULT (lastagent.sinks.table_rows).
        txn.ack_column_defaults();
        if !adds.is_empty() {
            let stats_schema = txn.stats_schema().map_err(|e| e.to_string())?;
            txn.add_files(add_rows(engine, &adds, stats_schema)?);
        }
        match txn.commit(engine).map_err(|e| format!("cannot commit to {url}: {e}"))? {
            CommitResult::Committed(c) => {
                if let Some(after) = c.post_commit_snapshot() {
                    remember(url, after)?;
                }
                Ok(("committed".into(), c.commit_version()))
            }
            CommitResult::Conflicted(c) => Ok(("conflict".into(), c.conflict_version())),
            CommitResult::Retryable(_) => Err(format!(
                "cannot commit to {url}: an I/O error; whether version {} was written is read back next",
                read_version + 1
            )),
        }
    })
}

/// Writes a checkpoint of `version` (classic or V2, as the table's features say). Another
/// checkpoint already there is not an error.
#[pyfunction]
pub fn delta_checkpoint(
    py: Python<'_>,
    uri: &str,
    storage: HashMap<String, String>,
    version: u64,
    table_id: &str,
) -> PyResult<()> {
    on_snapshot(py, uri, &storage, version, table_id, |engine, _, snap| {
        snap.checkpoint(engine, None).map(|_| ()).map_err(|e| e.to_string())
    })
}

/// Writes `version` put-if-absent, as kernel's own commits are written: `commitInfo` (`first`, then the
/// caller's fields and `engineInfo`) and `actions`. Returns "conflict" when another writer wrote it first.
fn put_version(
    engine: &KernelEngine,
    url: &Url,
    version: u64,
    mut first: serde_json::Map<String, serde_json::Value>,
    mut info: serde_json::Map<String, serde_json::Value>,
    actions: &[serde_json::Value],
) -> Result<(String, u64), String> {
    first.append(&mut info);
    first.entry("isolationLevel").or_insert_with(|| "Serializable".into());
    first.insert("engineInfo".into(), ENGINE_INFO.into());
    let mut body = serde_json::json!({ "commitInfo": first }).to_string();
    body.push('\n');
    for action in actions {
        body.push_str(&action.to_string());
        body.push('\n');
    }
    let path = url.join(&format!("_delta_log/{version:020}.json")).map_err(|e| e.to_string())?;
    match engine.storage_handler().put(&path, body.into_bytes().into(), false) {
        Ok(()) => Ok(("committed".into(), version)),
        Err(KernelError::FileAlreadyExists(_)) => Ok(("conflict".into(), version)),
        Err(e) => Err(format!("cannot commit to {url}: {e}")),
    }
}

/// Writes one commit lastagent composed itself on top of `read_version` ([`put_version`]): the
/// `commitInfo` gets `timestamp`, `readVersion` and, when the table keeps them, an in-commit timestamp
/// above the previous one (PROTOCOL.md: the commitInfo's first field). No protocol action unless the
/// caller gives one.
fn put_commit(
    engine: &KernelEngine,
    url: &Url,
    snap: &SnapshotRef,
    read_version: u64,
    mut info: serde_json::Map<String, serde_json::Value>,
    actions: &[serde_json::Value],
) -> Result<(String, u64), String> {
    let now = now_ms();
    let mut first = serde_json::Map::new();
    if let Some(previous) = snap.get_in_commit_timestamp(engine).map_err(|e| e.to_string())? {
        first.insert("inCommitTimestamp".into(), (now.max(previous + 1)).into());
    }
    first.insert("timestamp".into(), now.into());
    info.insert("readVersion".into(), read_version.into());
    put_version(engine, url, read_version + 1, first, info, actions)
}

/// The table's `metaData` at the snapshot, as the log holds it (absent fields left out), to commit again
/// with a change.
fn metadata_of(snap: &SnapshotRef) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    let metadata = serde_json::to_value(snap.table_configuration().metadata()).map_err(|e| e.to_string())?;
    let serde_json::Value::Object(mut object) = metadata else {
        return Err("the table's metaData is not an object".into());
    };
    object.retain(|_, v| !v.is_null());
    Ok(object)
}

/// The caller's commit info (a JSON object) and actions (one JSON object each), parsed.
fn parsed(
    commit_info: &str,
    actions: &[String],
) -> PyResult<(serde_json::Map<String, serde_json::Value>, Vec<serde_json::Value>)> {
    let info = serde_json::from_str(commit_info).map_err(|e| err(format!("commit info {commit_info}: {e}")))?;
    let actions = actions
        .iter()
        .map(|a| serde_json::from_str(a).map_err(|e| err(format!("action {a}: {e}"))))
        .collect::<PyResult<Vec<_>>>()?;
    Ok((info, actions))
}

/// Commits `actions` (JSON objects as the log holds them: `txn`, `add`) with `commit_info` (a JSON
/// object: the operation, its parameters, lastagent's record) on top of `read_version`, written by
/// lastagent through kernel's storage layer ([`put_commit`]): the commits of tables whose features
/// kernel's transaction refuses but lastagent writes (CHECK constraints, generated columns, legacy
/// protocols), where the commit is a plain append. With `schema`, the table's `metaData` with that
/// `schemaString` comes first (mergeSchema's new columns, in the epoch's own commit as Spark's writer
/// makes it).
///
/// Returns `("committed", version)` or `("conflict", version)`.
#[pyfunction]
#[pyo3(signature = (uri, storage, read_version, table_id, commit_info, actions, schema=None))]
#[allow(clippy::too_many_arguments)]
pub fn delta_commit_actions(
    py: Python<'_>,
    uri: &str,
    storage: HashMap<String, String>,
    read_version: u64,
    table_id: &str,
    commit_info: &str,
    actions: Vec<String>,
    schema: Option<String>,
) -> PyResult<(String, u64)> {
    let (info, mut actions) = parsed(commit_info, &actions)?;
    on_snapshot(py, uri, &storage, read_version, table_id, |engine, url, snap| {
        if let Some(schema) = schema {
            let mut metadata = metadata_of(&snap)?;
            metadata.insert("schemaString".into(), schema.into());
            actions.insert(0, serde_json::json!({ "metaData": metadata }));
        }
        put_commit(engine, url, &snap, read_version, info, &actions)
    })
}

/// Creates a table: version 0, put-if-absent, with `commit_info` (the operation; `timestamp` and
/// `engineInfo` added) and `actions` (the `protocol` and `metaData` first, as PROTOCOL.md requires of
/// version 0, then any `txn` and adds of the commit that creates it).
///
/// Returns `("committed", 0)`, or `("conflict", 0)` when the table was created by another writer first.
#[pyfunction]
pub fn delta_create_table(
    py: Python<'_>,
    uri: &str,
    storage: HashMap<String, String>,
    commit_info: &str,
    actions: Vec<String>,
) -> PyResult<(String, u64)> {
    let (info, actions) = parsed(commit_info, &actions)?;
    let url = table_url(uri).map_err(err)?;
    py.detach(|| {
        let engine = engine_for(&url, &storage)?;
        let mut first = serde_json::Map::new();
        first.insert("timestamp".into(), now_ms().into());
        put_version(&engine, &url, 0, first, info, &actions)
    })
    .map_err(err)
}

/// Sets table properties on top of `read_version` in one commit that changes nothing else (see
/// the module's notes): `commitInfo` (`SET TBLPROPERTIES`) and the table's `metaData` with
/// `properties` set.
///
/// Returns `("committed", version)` or `("conflict", version)`.
#[pyfunction]
pub fn delta_set_properties(
    py: Python<'_>,
    uri: &str,
    storage: HashMap<String, String>,
    read_version: u64,
    table_id: &str,
    properties: Vec<(String, String)>,
) -> PyResult<(String, u64)> {
    on_snapshot(py, uri, &storage, read_version, table_id, |engine, url, snap| {
        let mut metadata = metadata_of(&snap)?;
        let configuration = metadata
            .entry("configuration")
            .or_insert_with(|| serde_json::Value::Object(Default::default()))
            .as_object_mut()
            .ok_or("the table's configuration is not an object")?;
        for (k, v) in &properties {
            configuration.insert(k.clone(), serde_json::Value::String(v.clone()));
        }
        let changed: HashMap<_, _> = properties.iter().cloned().collect();
        let mut info = serde_json::Map::new();
        info.insert("operation".into(), "SET TBLPROPERTIES".into());
        info.insert(
            "operationParameters".into(),
            serde_json::json!({"properties": serde_json::to_string(&changed).map_err(|e| e.to_string())?}),
        );
        info.insert("isBlindAppend".into(), false.into());
        put_commit(engine, url, &snap, read_version, info, &[serde_json::json!({ "metaData": metadata })])
    })
}

// -- reads: every Delta read lastagent makes goes through these (the commits above read the same snapshots) --

/// Whether `_delta_log/` holds no commit and no checkpoint: there is no Delta table at `url`.
fn no_table_at(engine: &KernelEngine, url: &Url) -> Result<bool, String> {
    let first = url.join("_delta_log/00000000000000000000").map_err(|e| e.to_string())?;
    let listed = match engine.storage_handler().list_from(&first) {
        Ok(listed) => listed,
        Err(KernelError::FileNotFound(_)) => return Ok(true),
        Err(e) => return Err(format!("cannot list {url}_delta_log/: {e}")),
    };
    for file in listed {
        let file = match file {
            Ok(file) => file,
            Err(KernelError::FileNotFound(_)) => return Ok(true),
            Err(e) => return Err(format!("cannot list {url}_delta_log/: {e}")),
        };
        let name = file.location.path().rsplit('/').next().unwrap_or("");
        if name.ends_with(".json") || name.contains(".checkpoint.") {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The table at its newest version: `(version, metaData JSON, protocol JSON)` as the log holds them, or None when
/// there is no Delta table at `uri`. Brought forward from the snapshot this process read last (kernel lists and
/// reads only the newer commits), or read anew from the newest checkpoint.
#[pyfunction]
pub fn delta_snapshot(
    py: Python<'_>,
    uri: &str,
    storage: HashMap<String, String>,
) -> PyResult<Option<(u64, String, String)>> {
    let url = table_url(uri).map_err(err)?;
    py.detach(|| {
        let engine = engine_for(&url, &storage)?;
        let cached = last_snapshots()?.get(url.as_str()).cloned();
        let fresh = || Snapshot::builder_for(url.as_str()).build(engine.as_ref());
        let built = match cached {
            // A log cleaned up past the cached version cannot be brought forward: read anew.
            Some(s) => Snapshot::builder_from(s).build(engine.as_ref()).or_else(|_| fresh()),
            None => fresh(),
        };
        // A failed read of a path with no commit is "no table"; one whose first commit appeared meanwhile (another
        // writer creating it) is read once more.
        let snap = match built {
            Ok(snap) => snap,
            Err(_) if no_table_at(&engine, &url)? => return Ok::<_, String>(None),
            Err(_) => fresh().map_err(|e| format!("cannot read {url}: {e}"))?,
        };
        let config = snap.table_configuration();
        let metadata = serde_json::to_string(config.metadata()).map_err(|e| e.to_string())?;
        let protocol = serde_json::to_string(config.protocol()).map_err(|e| e.to_string())?;
        last_snapshots()?.insert(url.to_string(), snap.clone());
        Ok(Some((snap.version(), metadata, protocol)))
    })
    .map_err(err)
}

/// The `txn` version of each of `apps` at `version` (None where the app has none, or its `txn` expired under
/// `delta.setTransactionRetentionDuration`, as Spark reads it).
#[pyfunction]
pub fn delta_app_versions(
    py: Python<'_>,
    uri: &str,
    storage: HashMap<String, String>,
    version: u64,
    table_id: &str,
    apps: Vec<String>,
) -> PyResult<Vec<Option<i64>>> {
    on_snapshot(py, uri, &storage, version, table_id, |engine, url, snap| {
        apps.iter()
            .map(|app| snap.get_app_id_version(app, engine).map_err(|e| format!("cannot read {url}: {e}")))
            .collect()
    })
}

/// The `commitInfo` of each of `versions` (a JSON object, `{}` for a commit without one), or None where the
/// commit's file is gone (the log was cleaned up). Kernel has no history API: the commit files are read as
/// PROTOCOL.md lays them out.
#[pyfunction]
pub fn delta_commit_infos(
    py: Python<'_>,
    uri: &str,
    storage: HashMap<String, String>,
    versions: Vec<u64>,
) -> PyResult<Vec<Option<String>>> {
    let url = table_url(uri).map_err(err)?;
    py.detach(|| {
        let engine = engine_for(&url, &storage)?;
        let mut out = Vec::with_capacity(versions.len());
        for version in versions {
            let path = url.join(&format!("_delta_log/{version:020}.json")).map_err(|e| e.to_string())?;
            let read = engine.storage_handler().read_files(vec![(path, None)]).and_then(|mut files| {
                files.next().unwrap_or_else(|| Err(KernelError::FileNotFound(format!("version {version}"))))
            });
            let body = match read {
                Ok(body) => body,
                Err(KernelError::FileNotFound(_)) => {
                    out.push(None);
                    continue;
                }
                Err(e) => return Err(format!("cannot read version {version} of {url}: {e}")),
            };
            let text = std::str::from_utf8(&body).map_err(|e| format!("version {version} of {url}: {e}"))?;
            let mut info = "{}".to_string();
            for line in text.lines().filter(|l| l.contains("\"commitInfo\"")) {
                let action: serde_json::Value =
                    serde_json::from_str(line).map_err(|e| format!("version {version} of {url}: {e}"))?;
                if let Some(found) = action.get("commitInfo") {
                    info = found.to_string();
                    break;
                }
            }
            out.push(Some(info));
        }
        Ok(out)
    })
    .map_err(err)
}

/// One data file of a scan: its path as the log holds it, size, partition values, and whether it has a deletion vector.
type ScanFileRow = (String, i64, HashMap<String, String>, bool);

/// The data files of the table at `version` ([`ScanFileRow`]), from kernel's scan (the log replayed from its
/// checkpoint, removed files left out).
#[pyfunction]
pub fn delta_scan_files(
    py: Python<'_>,
    uri: &str,
    storage: HashMap<String, String>,
    version: u64,
    table_id: &str,
) -> PyResult<Vec<ScanFileRow>> {
    on_snapshot(py, uri, &storage, version, table_id, |engine, url, snap| {
        let failed = |e: KernelError| format!("cannot list the files of {url}: {e}");
        let scan = snap.scan_builder().build().map_err(failed)?;
        let mut files = Vec::new();
        for metadata in scan.scan_metadata(engine).map_err(failed)? {
            files = metadata.map_err(failed)?.visit_scan_files(files, |files, f| {
                files.push((f.path, f.size, f.partition_values, f.dv_info.has_vector()))
            })
            .map_err(failed)?;
        }
        Ok(files)
    })
}
