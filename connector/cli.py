"""The ``lastagent`` command: ``status`` and ``recover`` for one link. Runs where an operator is.

Examples::

    lastagent status  --link orders --arbitration-table /data/arb --bootstrap-servers host:9092
    lastagent status  --link payments --table /data/payments --bootstrap-servers host:9092  # lastagent-delta
    lastagent recover --link orders --arbitration-table /data/arb --bootstrap-servers host:9092
    lastagent recover ... --apply                 # commit decided branches, roll back the rest
    lastagent recover ... --rollback lastagent-orders-3-0
    lastagent recover ... --commit lastagent-orders-3-0   # by hand: the operator decides
    lastagent recover ... --accept-lost 41        # a decided epoch's expired branch: accept the loss
    lastagent status ... --command-config client.properties  # a secured cluster, as Kafka's own tools
    lastagent status ... --json --epochs 20      # the document monitoring reads (docs/operations.md)
    lastagent --version                           # lastagent, librdkafka (and its features), OpenSSL

``--command-config`` reads a Java properties file of Kafka client settings (the ``kafka.*`` options
without the prefix: ``security.protocol``, ``sasl.jaas.config``, ``ssl.truststore.location``...), so
passwords stay off the command line; ``--kafka KEY=VALUE`` adds or overrides one setting.
``--storage KEY=VALUE`` gives a ``storage.*`` setting of the query (a table or checkpoint on an
object store; docs/storage.md); credentials are better left in the environment.

Exit status: 0 when nothing of the link is in doubt, 1 while anything stays in doubt or a
decided branch was lost (expired: reported by epoch and branch) and no operator accepted the loss
(``--accept-lost``), 2 on bad usage or an unreachable broker/table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any, NoReturn

from lastagent.core.figures import epoch_rows
from lastagent.errors import ArbitrationError, LastAgentError


def _committer(args: argparse.Namespace) -> Any:
    """The link's committer: arbitration in its own table (Kafka sink) or in the target table (Delta sink)."""
    from lastagent.delta.batch_table import BatchEpochTable, is_batch_link
    from lastagent.delta.target_table import TargetTableStore
    from lastagent.sinks.delta_sink_options import DeltaSinkOptions
    from lastagent.sinks.kafka_sink_options import KafkaSinkOptions
    from lastagent.sinks.link_ports import link_committer

    if bool(args.arbitration_table) == bool(args.table):
        raise LastAgentError("give --arbitration-table (a lastagent-kafka link) or --table (a lastagent-delta "
                             "link), not both or neither")
    raw = {"kafka.bootstrap.servers": args.bootstrap_servers, "link": args.link, "checkpointLocation": "-"}
    if args.command_config:
        raw.update({f"kafka.{k}": v for k, v in read_properties(args.command_config).items()})
    for prefix, settings in (("kafka.", args.kafka), ("storage.", args.storage)):
        for setting in settings or []:
            key, _, value = setting.partition("=")
            raw[prefix + key] = value
    if args.arbitration_table:
        return link_committer(KafkaSinkOptions.parse({**raw, "arbitrationTable": args.arbitration_table}))
    options = DeltaSinkOptions.parse({**raw, "path": args.table})
    batch = BatchEpochTable(args.table, options.storage)
    # Side outputs are the query's options, not the command's: always look for open branches.
    store = batch if is_batch_link(batch.table(), args.link) else TargetTableStore(args.table, storage=options.storage)
    return link_committer(options, store=store, kafka=True)


def read_properties(path: str) -> dict[str, str]:
    """A Java properties file's settings (``key=value`` or ``key: value``, ``#``/``!`` comments,
    a trailing backslash continues the line), as Kafka's ``--command-config`` reads it."""
    out: dict[str, str] = {}
    pending = ""
    with open(path, encoding="utf-8") as f:
        for number, raw_line in enumerate(f, 1):
            line = pending + raw_line.strip() if pending else raw_line.strip()
            if not pending and (not line or line[0] in "#!"):
                continue
            if line.endswith("\\") and not line.endswith("\\\\"):
                pending = line[:-1]
                continue
            pending = ""
            cut = min((i for i in (line.find("="), line.find(":")) if i >= 0), default=-1)
            if cut <= 0:
                # The line may hold a secret: name it by number only.
                raise LastAgentError(f"--command-config {path}: line {number} is not key=value")
            out[line[:cut].strip()] = line[cut + 1:].strip()
    return out


#: The version of ``lastagent status --json``'s document. Keys are only ever added; a change to a
#: key's meaning or a removal moves it (docs/operations.md lists every key).
STATUS_VERSION = 1


def status_document(committer: Any, epochs: int = 10, now_ms: int | None = None) -> dict[str, Any]:
    """What ``lastagent status --json`` prints: the link's state and its last ``epochs`` epochs' figures.

    Runs where the operator is (reads the arbitration store and the broker; changes nothing).
    Every key is documented in docs/operations.md.

    Args:
        committer: the link's committer (:func:`_committer`).
        epochs: how many of the newest decided epochs to give figures for.
        now_ms: the time ages are measured against (default: now).
    """
    now = int(time.time() * 1000) if now_ms is None else now_ms
    store, link = committer.store, committer.link
    records = store.records(link)
    rows, files = store.size()
    in_doubt = [_branch(t, decision, epoch, now) for t, decision, epoch in committer.in_doubt()]
    ownership = store.ownership(link)
    # One more record than asked for: an epoch's timings are in the next epoch's record.
    figures = store.figures(link, epochs + 1) if epochs > 0 else []
    latest = store.latest_epoch(link)
    latest_at = next((r.decided_at_ms for r in records if r.epoch == latest), None)
    ages = [b["age_ms"] for b in in_doubt if b["age_ms"] is not None]
    return {
        "version": STATUS_VERSION,
        "link": link,
        "arbitration_table": getattr(committer.options, "arbitration_table", None) or committer.options.path,
        "owner": None if ownership is None else ownership.owner,
        "generation": None if ownership is None else ownership.generation,
        "run": None if ownership is None else ownership.run,
        "decided_epochs": len(records),
        "latest_decided_epoch": latest,
        "latest_decided_at_ms": latest_at,
        "confirmed_through": max((r.confirmed_through for r in records), default=-1),
        "arbitration_rows": rows,
        "arbitration_files": files,
        "in_doubt_count": len(in_doubt),
        "oldest_in_doubt_age_ms": max(ages, default=None),
        "in_doubt": in_doubt,
        "hazards": committer.hazards(),
        "epochs": epoch_rows(figures, epochs),
        "checked_at_ms": now,
    }


def link_status(link: str, bootstrap_servers: str, *, table: str | None = None, arbitration_table: str | None = None,
                epochs: int = 10, kafka: dict[str, str] | None = None,
                storage: dict[str, str] | None = None) -> dict[str, Any]:
    """``lastagent status --json``'s document in one call, from a notebook or a monitoring job.

    Args:
        link: the link's name (the query's ``link`` option).
        bootstrap_servers: ``kafka.bootstrap.servers``.
        table: the target table of a ``lastagent-delta`` link; or
        arbitration_table: the ``arbitrationTable`` of a ``lastagent-kafka`` link.
        epochs: how many of the newest decided epochs to give figures for.
        kafka: more Kafka client settings (``kafka.*`` without the prefix).
        storage: ``storage.*`` settings of the query (object stores).

    Raises:
        LastAgentError: both or neither table given; the table is not there; the store cannot be read.
    """
    args = argparse.Namespace(link=link, bootstrap_servers=bootstrap_servers, table=table,
                              arbitration_table=arbitration_table, command_config=None,
                              kafka=[f"{k}={v}" for k, v in (kafka or {}).items()],
                              storage=[f"{k}={v}" for k, v in (storage or {}).items()])
    with _committer(args) as committer:
        _require_table(committer, args)
        return status_document(committer, epochs)


def _branch(t: Any, decision: str, epoch: int, now_ms: int | None = None) -> dict[str, Any]:
    age = None if now_ms is None or not t.started_ms else max(0, now_ms - t.started_ms)
    return {"transactional_id": t.transactional_id, "producer_id": t.producer_id,
            "producer_epoch": t.producer_epoch, "started_ms": t.started_ms, "timeout_ms": t.timeout_ms,
            "age_ms": age, "partitions": [f"{topic}-{p}" for topic, p in t.partitions],
            "decision": decision, "epoch": epoch}


def _print_status(status: dict[str, Any]) -> None:
    print(f"link {status['link']}  (arbitration: {status['arbitration_table']})")
    print(f"  decided epochs kept: {status['decided_epochs']}, latest decided: {status['latest_decided_epoch']}, "
          f"confirmed through: {status['confirmed_through']}")
    print(f"  owner: {status['owner']}, generation: {status['generation']}")
    print(f"  arbitration size: {status['arbitration_rows']} rows in {status['arbitration_files']} files")
    _print_in_doubt(status["in_doubt"])
    if status["epochs"]:
        print("  epoch  branches  records                 dead letters  branch age/timeout  decide ms  phase 2 ms")
    for e in status["epochs"]:
        records = ",".join(f"{k}={v}" for k, v in (e["records"] or {}).items()) or "-"
        ratio = "-" if e["branch_age_ratio"] is None else f"{e['branch_age_ratio']:.0%}"
        print(f"  {e['epoch']:>5}  {_dash(e['branches']):>8}  {records:<22}  {_dash(e['dead_letters']):>12}  "
              f"{ratio:>18}  {_dash(e['decide_ms']):>9}  {_dash(e['phase2_ms']):>10}")
    for h in status["hazards"]:
        if h["accepted"]:
            print(f"  lost, accepted by an operator: epoch {h['epoch']} branch {h['transactional_id']} "
                  f"({h['records']} records)")
        else:
            print(f"  HAZARD: {h['reason']}")


def _epoch_count(text: str) -> int:
    """``--epochs``: a count of 0 or more (argparse names the option in its error)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count of epochs (0 or more)")
    return n


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _print_in_doubt(branches: list[dict[str, Any]]) -> None:
    if not branches:
        print("  in doubt: none")
        return
    print(f"  in doubt: {len(branches)} branch(es)")
    for b in branches:
        why = f"epoch {b['epoch']} is decided" if b["decision"] == "commit" else "no decision covers it (presumed abort)"
        print(f"    {b['transactional_id']}  producer {b['producer_id']}/{b['producer_epoch']}  "
              f"{','.join(b['partitions'])}  -> {b['decision']} ({why})")


def version_text() -> tuple[str, bool]:
    """What ``lastagent --version`` prints, and whether the compiled Kafka path loaded: lastagent's
    version, the librdkafka and OpenSSL linked into ``lastagent._native`` (a portable wheel carries
    its own static OpenSSL: its OPENSSLDIR is not the system's), and the Python running them."""
    import platform

    import lastagent

    lines = [f"lastagent {lastagent.__version__}"]
    try:
        from lastagent import _native
    except ImportError as exc:
        lines.append(f"lastagent._native: cannot be loaded ({exc}); install a wheel built for this platform "
                     "(docs/install.md)")
        ok = False
    else:
        ssl_version, ssl_dir = _native.openssl_version()
        lines.append(f"librdkafka {_native.librdkafka_version()} (builtin.features: {_native.librdkafka_features()})")
        lines.append(f"{ssl_version} ({ssl_dir})")
        lines.append(f"native module: {_native.__file__}")
        ok = True
    lines.append(f"Python {platform.python_version()} ({platform.python_implementation()}), "
                 f"{platform.machine()}, glibc {platform.libc_ver()[1] or '?'}")
    spark, spark_ok = _spark_discovery()
    lines.append(spark)
    return "\n".join(lines), ok and spark_ok


def _spark_discovery() -> tuple[str, bool]:
    """Whether this Python's Spark finds the two formats: Spark 4 registers each importable top-level module
    named ``pyspark_*`` that has a ``DefaultSource``; looked up here without importing pyspark's JVM side. False
    with a pyspark lastagent does not run on (no pyspark at all is not an error: a driver may have none)."""
    import importlib.util

    modules = ["pyspark_lastagent_kafka", "pyspark_lastagent_delta"]
    found = [m for m in modules if importlib.util.find_spec(m) is not None]
    where = "found" if len(found) == len(modules) else f"MISSING: {', '.join(sorted(set(modules) - set(found)))}"
    try:
        import pyspark
    except ImportError:
        spark = "pyspark not importable in this Python (the Spark runtime's Python must have lastagent installed)"
        why = None
    else:
        from lastagent.spark_versions import differences, refusal, untested_allowed

        version = str(pyspark.__version__)
        why = refusal(version, untested_allowed())
        spark = f"pyspark {version}: " + (f"NOT SUPPORTED: {why}" if why else f"supported ({differences(version)})")
    return f"Spark formats lastagent-kafka, lastagent-delta ({', '.join(modules)}): {where}; {spark}", why is None


class _Version(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the versions of lastagent, librdkafka and OpenSSL")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        text, ok = version_text()
        print(text)
        parser.exit(0 if ok else 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lastagent", description="Inspect and recover lastagent links.")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("status", "epochs, in-doubt branches, arbitration size"),
                       ("recover", "list in-doubt branches and the decision each would get; act on them")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--link", required=True, help="the link name (the 'link' option of the query)")
        p.add_argument("--arbitration-table", help="the 'arbitrationTable' option of a lastagent-kafka query")
        p.add_argument("--table", help="the target table of a lastagent-delta query, or the table of a lastagent.epoch "
                                       "block (its commits are the arbitration)")
        p.add_argument("--bootstrap-servers", required=True, help="kafka.bootstrap.servers")
        p.add_argument("--kafka", action="append", metavar="KEY=VALUE", help="extra kafka.* client setting")
        p.add_argument("--storage", action="append", metavar="KEY=VALUE",
                       help="a storage.* setting of the query (object stores; docs/storage.md), e.g. "
                            "aws_endpoint_url=https://...; credentials are better left in the environment")
        p.add_argument("--command-config", metavar="FILE",
                       help="Kafka client settings (security.protocol, sasl.jaas.config, ssl.*) as a properties file")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "status":
            p.add_argument("--epochs", type=_epoch_count, default=10, metavar="N",
                           help="figures of the newest N decided epochs (default 10; 0 for none)")
        if name == "recover":
            p.add_argument("--apply", action="store_true", help="carry out every listed decision")
            p.add_argument("--commit", nargs="+", default=[], metavar="TXN_ID", help="commit these branches by hand")
            p.add_argument("--rollback", nargs="+", default=[], metavar="TXN_ID", help="roll these back by hand")
            p.add_argument("--accept-lost", type=int, metavar="EPOCH",
                           help="accept that decided epoch EPOCH's lost branches (status: HAZARD) are gone, so the "
                                "link starts again; their records are not recovered (re-produce them first)")
    args = parser.parse_args(argv)
    from kafka.errors import KafkaError

    try:
        with _committer(args) as committer:
            _require_table(committer, args)
            if args.command == "status":
                status = status_document(committer, args.epochs)
                _require_link(committer, args, status)
                print(json.dumps(status, indent=2)) if args.json else _print_status(status)
                open_hazards = [h for h in status["hazards"] if not h["accepted"]]
                return 1 if status["in_doubt"] or open_hazards else 0
            return _recover(committer, args)
    except (LastAgentError, KafkaError, OSError) as exc:
        print(f"lastagent: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


def _require_table(committer: Any, args: argparse.Namespace) -> None:
    """Fails when the arbitration (or target) table is not there: a wrong path must not read as 'no doubt'."""
    path = args.arbitration_table or args.table
    table = committer.store._table() if args.arbitration_table else committer.store.table()
    if table is None:
        raise ArbitrationError(f"{'--arbitration-table' if args.arbitration_table else '--table'} {path}: no Delta "
                               "table there; give the path the query uses")


def _require_link(committer: Any, args: argparse.Namespace, status: dict[str, Any]) -> None:
    """Fails when the table knows nothing of the link (never claimed, nothing decided, nothing open): a link name
    mistyped or never run there must not read as a healthy, empty link."""
    if status["in_doubt"] or status["latest_decided_epoch"] is not None or committer.store.ownership(committer.link):
        return
    flag = "--arbitration-table" if args.arbitration_table else "--table"
    raise ArbitrationError(f"link {committer.link}: no such link is known in {flag} {args.arbitration_table or args.table} "
                           "(no query with this link option ever ran there); check --link and the path")


def _accept_lost(committer: Any, epoch: int, as_json: bool) -> int:
    """Records that decided ``epoch``'s lost branches are gone (XA's forget of a heuristic rollback)."""
    lost = [h for h in committer.hazards() if h["epoch"] == epoch]
    if not lost:
        print(f"lastagent: link {committer.link} epoch {epoch} has no lost decided branch (see `lastagent status`); "
              "nothing was changed", file=sys.stderr)
        return 2
    committer.store.accept_lost(committer.link, epoch)
    records = sum(h["records"] for h in lost)
    if as_json:
        print(json.dumps({"link": committer.link, "accepted_lost": {"epoch": epoch, "branches": lost}}, indent=2))
    else:
        print(f"link {committer.link} epoch {epoch}: the loss of {len(lost)} branch(es), {records} record(s), is "
              "accepted; the link starts again without them")
        for h in lost:
            print(f"    {h['transactional_id']}  producer {h['producer_id']}/{h['producer_epoch']}  {h['records']} records")
    return 0


def _recover(committer: Any, args: argparse.Namespace) -> int:
    if args.accept_lost is not None:
        return _accept_lost(committer, args.accept_lost, args.json)
    in_doubt = committer.in_doubt()
    by_id = {t.transactional_id: (t, d, e) for t, d, e in in_doubt}
    actions: list[tuple[Any, str]] = []
    if args.apply:
        actions = [(t, d) for t, d, _ in in_doubt]
    for verb, ids in (("commit", args.commit), ("rollback", args.rollback)):
        for tid in ids:
            if tid not in by_id:
                print(f"lastagent: {tid} is not an open branch of link {committer.link}", file=sys.stderr)
                return 2
            actions.append((by_id[tid][0], verb))
    if any(verb == "rollback" for _, verb in actions):
        # A running query may be about to decide the branch we roll back: move the link's
        # generation first, so that query can decide nothing more (it stops; restart it).
        fenced = committer.store.claim(committer.link, "", takeover=True)
        print(f"link {committer.link}: generation {fenced.generation} claimed by this command; a query still "
              "running on the link stops at its next epoch and recovers when restarted", file=sys.stderr)
    done = []
    for t, verb in actions:
        result = committer.xa.commit(t.handle()) if verb == "commit" else committer.xa.rollback(t.handle())
        done.append({"transactional_id": t.transactional_id, "action": verb, "outcome": result.outcome.value,
                     "detail": result.detail})
    remaining = [_branch(t, d, e) for t, d, e in committer.in_doubt()]
    if args.json:
        print(json.dumps({"link": committer.link, "done": done, "in_doubt": remaining}, indent=2))
    else:
        for d in done:
            print(f"  {d['action']} {d['transactional_id']}: {d['outcome']} {d['detail']}".rstrip())
        print(f"link {committer.link}")
        _print_in_doubt(remaining)
    return 1 if remaining else 0


def exit_now(code: int) -> NoReturn:
    """Ends a finished command with ``code``, skipping the interpreter's teardown.

    Native runtimes loaded by the Delta and Arrow libraries (pyarrow's thread pools, Delta
    Kernel's tokio workers) have been seen to abort the process while the interpreter tears down
    ("terminate called without an active exception", SIGABRT) after all output was written,
    which turned a decided exit status into -6. The work is done and flushed by then.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run() -> NoReturn:
    """The ``lastagent`` command (console script and ``python -m lastagent.cli``).

    Logging is set up here, for the command's own process only: :func:`main` called from a
    notebook or a test leaves the caller's logging as it is.
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        # kafka-python logs every retry of a failing connection; the command's own error says why.
        handler.addFilter(lambda record: not record.name.startswith("kafka."))
    exit_now(main())


if __name__ == "__main__":
    run()
